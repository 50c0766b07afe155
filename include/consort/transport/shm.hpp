#pragma once

// The shared-memory transport: ranks that are processes (or threads) of one host exchange
// messages through rings in one POSIX shared-memory segment, with futex wake-ups, instead of
// loopback TCP (issue 16; docs/multi_worker.md, "Shared memory").
//
// Layout: one segment per group, created by rank 0 with mode 0600 and unlinked as soon as every
// rank has mapped it, so no other process can open it afterwards and nothing is left behind when
// the group ends or dies. It holds one block per rank (its doorbell, its pid and its state: live,
// aborted with a code and a reason, left, gone) and one single-producer single-consumer byte ring
// per ordered pair of ranks. A message is a 24-byte frame header (tag, size, kind) and its bytes,
// streamed through the ring, so a message may be larger than the ring. Groups of up to 8 ranks
// also have two lockstep channels (`context::mailbox`, pair.hpp): per ordered pair and channel,
// two 8 KiB slots that a message of up to 8160 bytes is copied into and read from in place, with
// no operation, queue or lock (a communicator's descriptor exchange; docs/multi_worker.md).
//
// How a message moves:
// - `send` writes straight into the ring on the caller's thread when nothing is queued before it;
//   what does not fit is queued and written as the receiver frees space. A send completes when its
//   last byte is in the ring (as a TCP send completes when its bytes are in the socket).
// - The receiving side copies the bytes from the ring straight into the posted receive buffer, or
//   into a stash when the receive is not posted yet (a receive posted later takes the stash, and
//   takes over the rest of a message that is still arriving).
// - Progress is made by whichever thread waits on an operation (it polls the rings while it
//   spins) and otherwise by one progress thread per context, which sleeps on its rank's doorbell
//   futex and is rung by peers when they write to it or free space for it.
// - Death: an idle progress thread checks its peers' pids every `liveness_interval`, so a peer
//   process that dies (a crash, SIGKILL) fails the operations with it with `peer_lost` within
//   about that time. `abort` and destroying a context are seen by peers at once.
//
// Same contract as the local and TCP transports (include/consort/transport/pair.hpp): tags,
// per-tag order, `recv_at_most`, deadlines, `abort` with the cause carried to the peers, and
// `close` (every posted send delivered, then a goodbye, then wait for every peer's goodbye).

#include <consort/transport/pair.hpp>

#include <caf/expected.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace consort::transport::shm {

/// How a shared-memory group is formed and how it waits.
struct options {
  /// Bytes of each ring (one per ordered pair of ranks): a power of two of at least 4 KiB. The
  /// segment needs about size * (size - 1) rings; 8 ranks with the default take 56 MiB of /dev/shm
  /// (and 1.75 MiB for the lockstep slots).
  std::size_t ring_bytes = std::size_t{1} << 20;

  /// The group's identity and secret: the segment's name is derived from them (an HMAC-SHA256 under
  /// the secret), so that only members can name it; it is also unlinked once every rank mapped it.
  uint64_t group_id = 0;
  uint64_t epoch = 0;
  std::string secret;

  /// How long `connect` may take (every rank maps the segment).
  std::chrono::milliseconds connect_timeout{30000};

  /// How often an idle progress thread checks that its peers' processes are alive.
  std::chrono::milliseconds liveness_interval{100};

  /// How long `operation::wait` polls the rings itself before it blocks.
  std::chrono::microseconds spin{50};

  /// Whether a waiting thread yields its core between polls (`sched_yield`), as Open MPI's
  /// `mpi_yield_when_idle`, and polls for `yield_spin` instead of `spin` before it blocks. When
  /// more ranks run on the host than it has cores, a rank that spins holds the core its peer needs
  /// to answer, and one that blocks pays a wake-up per hop; a yielding one hands the core over and
  /// takes it back as soon as the answer is there. Unset: CONSORT_YIELD_WHEN_IDLE ("1" or "0")
  /// when set, else on exactly when the group has more ranks than this process may run on (its
  /// CPU affinity), unless tools/consort-launch bound it to cores of its own (CONSORT_LAUNCH_CPUS
  /// set: the launcher sets CONSORT_YIELD_WHEN_IDLE=1 itself when it had to share cores).
  std::optional<bool> yield_when_idle;
  std::chrono::microseconds yield_spin{2000};
};

/// Whether a group of `ranks` ranks on this host waits by yielding (options::yield_when_idle):
/// `choice` when set, else as that field says. Exposed for tests and benchmarks.
bool yields_when_idle(std::optional<bool> choice, int ranks);

/// Whether this machine can run the transport: POSIX shared memory under /dev/shm that takes a
/// small segment. Returns an empty string when it can, otherwise why not.
std::string unavailable_reason();

/// Forms a shared-memory group of the ranks of `bootstrap` (which must all run on this host) and
/// returns this rank's context, with the same rank numbers. Rank 0 creates the segment and tells
/// the others its name through `bootstrap` (tags 0x5348'4d00'0000'0000 and up); each maps it and
/// answers; rank 0 then unlinks it and lets everyone go. Collective: every rank of `bootstrap`
/// must call it with the same options. Close `bootstrap` cleanly afterwards (its `close`), or keep
/// it: destroyed at once, a TCP context may reset a connection whose last message (rank 0's "go")
/// a peer has not read yet.
/// Errors: `invalid_argument` for bad options (naming the field), `peer_lost` when the segment
/// cannot be created or mapped (no /dev/shm, no space: the message says which; callers fall
/// back to TCP), `collective_timeout` when a rank does not answer within `connect_timeout`.
caf::expected<context_ptr> connect(context& bootstrap, const options& opts);

/// A group of `size` contexts over one segment in this process (element `i` is rank `i`), for
/// tests and in-process groups: the same segment, rings and code as across processes.
/// @throws consort::error(invalid_argument) for bad options or `size` < 1,
///         consort::error(peer_lost) when the segment cannot be created.
std::vector<context_ptr> make_group(int size, const options& opts = {});

} // namespace consort::transport::shm
