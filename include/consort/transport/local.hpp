#pragma once

// The in-memory transport: the ranks of a group are threads of one process. It serves groups of
// in-process replicas and is the fake that the collective algorithms are tested against
// (deterministic, no sockets, same contract as transport/tcp).
//
// How a message moves (zero-copy until matched):
// - `send` copies nothing. The message is queued by reference to the caller's parts.
// - When a receive with the same tag meets it (whichever of the two is posted second), the thread
//   that posts the second one copies the parts straight into the receive buffer (one memcpy per
//   part, no intermediate stash), outside every lock, and completes both operations.
// - So a send completes exactly when the receiver has the bytes; until then the parts must stay
//   valid and unchanged (the contract of pair::send). A receive whose buffer has another size than
//   the message fails with `invalid_argument` and the message is dropped; its send completes (on a
//   real wire the sender cannot tell either).
// - `wait` spins for a few tens of microseconds (a peer that is already on its way hands over in
//   well under a microsecond), then blocks on a condition variable until the
//   deadline.
// - `abort(why)` on a context fails its pending and later operations with `peer_lost`, and the
//   peers' pending and later operations with it too (as a closed connection would). When it
//   returns, no copy touches this context's buffers any more.
// - `close(why, until)` leaves cleanly, as a TCP rank does: the sends it posted before that no
//   receive has met yet are copied and kept for their receivers, and complete (as a write into a
//   socket buffer does; TCP's reader keeps a message that arrives before its receive). Then its
//   peers' receives that meet no kept send, and their later sends to it, fail with `peer_left`,
//   and its own operations with `shutdown`. It returns at once: nothing waits on a peer.
// - Destroying a context aborts it.

#include <consort/transport/pair.hpp>

#include <vector>

namespace consort::transport::local {

/// Makes a group of `size` connected contexts; element `i` is rank `i`. Each context may be used
/// from any thread (typically one thread per rank); they share their message queues.
/// @throws consort::error(invalid_argument) when `size` < 1.
std::vector<context_ptr> make_group(int size);

} // namespace consort::transport::local
