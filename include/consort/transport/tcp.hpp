#pragma once

// The TCP transport: a full mesh of TCP connections between the ranks of a group, driven by
// Boost.Asio on one I/O thread per context (transport/tcp). Asio stays out of this header.
//
// Start-up, with every address known in advance:
//
//   mesh_options opts;
//   opts.rank = 1; opts.size = 4; opts.group_id = 42;
//   opts.addresses = {"10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000", "10.0.0.4:7000"};
//   auto ctx = tcp::connect_mesh(opts);            // caf::expected<std::shared_ptr<tcp::context>>
//
// or in two phases, when ports are chosen by the kernel (tests, launchers):
//
//   opts.listen_address = "127.0.0.1:0";
//   auto ctx = tcp::listen(opts);                   // binds and starts accepting
//   publish((*ctx)->listen_address());               // "127.0.0.1:40123", through some store
//   auto err = (*ctx)->connect(all_addresses);       // waits for the whole mesh

#include <consort/transport/pair.hpp>

#include <caf/error.hpp>
#include <caf/expected.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace consort::transport::tcp {

/// How a TCP context forms its mesh and bounds what it reads.
struct mesh_options {
  /// This rank, in [0, size).
  int rank = 0;

  /// The number of ranks in the group.
  int size = 1;

  /// The listen endpoint of every rank as "host:port" (IPv4, IPv6 in brackets, or a host name),
  /// indexed by rank. Used by `connect_mesh`; the two-phase start passes them to `connect`.
  std::vector<std::string> addresses;

  /// Where this rank listens, "host:port"; port 0 lets the kernel choose (see
  /// `context::listen_address`). Empty: `addresses[rank]`.
  std::string listen_address;

  /// Identifies the group in the handshake: connections of another group are refused.
  uint64_t group_id = 0;

  /// The membership epoch of the group, checked in the handshake like `group_id`.
  uint64_t epoch = 0;

  /// The group's shared secret; empty: connections are not authenticated (any client that knows
  /// the group id, epoch and size can take a free rank). When set, every connection is a mutual
  /// challenge-response: each side proves it knows the secret with an HMAC-SHA256 over fresh
  /// nonces of both sides, the group id, epoch, size, both ranks and its role, so a recorded
  /// handshake does not verify on another connection, in another group or epoch, or reflected.
  /// Every rank must have the same secret (or none); a mismatch fails `connect` on the connecting
  /// side with `peer_lost` and is logged by the accepting side. Frames after the handshake are
  /// neither encrypted nor authenticated (docs/multi_worker.md, "Authentication").
  std::string secret;

  /// How long `connect` (and `connect_mesh`) may take to form the whole mesh, counted from the
  /// call. Peers may start at different times: refused connects are retried until then.
  std::chrono::milliseconds connect_timeout{30000};

  /// How long an accepted connection may take to present a valid hello before it is closed.
  std::chrono::milliseconds handshake_timeout{5000};

  /// The largest payload of one message, sent or received; a frame announcing more is malformed.
  std::size_t max_payload_bytes = std::size_t{1} << 30;

  /// The most payload bytes this context holds for messages that arrived before their receive was
  /// posted (all pairs together). A message that would exceed it breaks its connection.
  std::size_t max_stash_bytes = std::size_t{512} << 20;

  /// SO_SNDBUF and SO_RCVBUF of every connection; 0 keeps the kernel's (auto-tuned) default.
  int send_buffer_bytes = 0;
  int recv_buffer_bytes = 0;

  /// How long `operation::wait` spins (driving the socket itself) before it blocks on a condition
  /// variable and leaves the I/O to the I/O thread. A thread wake-up costs more than a small
  /// message's hop (docs/algorithms.md has the figures), so a short spin saves most of them.
  std::chrono::microseconds spin{50};

  /// Spin (driving the socket) for the whole wait instead of blocking: the lowest latency for
  /// small messages, at the cost of a busy core per waiting thread.
  bool busy_poll = false;

  /// Receives one line per notable event (a refused or broken connection and why). Empty: stderr.
  std::function<void(const std::string&)> log;
};

/// A rank's TCP view of its group: one connection (pair) to every other rank.
///
/// Errors of its operations (see `operation::wait`) name the peer rank and address, the operation
/// (connect, read, write), the tag and the expected and actual byte counts. `peer_lost` means the
/// connection is gone for good: the group must be rebuilt through membership.
///
/// Thread safety: thread-safe. Destroying it fails every pending operation with `peer_lost`,
/// closes its connections and joins its I/O thread.
class context : public transport::context {
public:
  /// The "host:port" this rank listens on, with the port the kernel chose. The host is the bound
  /// address: publish it to peers only when it is one they can reach (not 0.0.0.0).
  virtual std::string listen_address() const = 0;

  /// The port this rank listens on.
  virtual uint16_t port() const noexcept = 0;

  /// Forms the mesh: connects to every lower rank at `addresses[peer]` (retrying refused
  /// connections), accepts every higher rank, and checks each peer's hello (version, group, epoch,
  /// size, rank) and, with a secret, its proof of the secret. Returns when every pair is connected
  /// or fails. Errors: `invalid_argument` (bad address list), `collective_timeout` (the mesh was
  /// not complete within `mesh_options::connect_timeout`; the message names the ranks missing and
  /// their last error), `peer_lost` (a peer answered with a hello that does not fit this group,
  /// failed authentication against `mesh_options::secret`, or `abort`). Operations may be posted on
  /// pairs before it returns: they proceed once their pair connects.
  /// @pre called once, with `addresses.size() == size()`
  virtual caf::error connect(const std::vector<std::string>& addresses) = 0;
};

/// Creates a context that listens on `opts.listen_address` (or `opts.addresses[opts.rank]`) and
/// accepts connections from higher ranks at once. Errors: `invalid_argument` (bad options or
/// address, or the address cannot be bound; the message has the system error).
caf::expected<std::shared_ptr<context>> listen(const mesh_options& opts);

/// `listen(opts)` then `connect(opts.addresses)`.
caf::expected<std::shared_ptr<context>> connect_mesh(const mesh_options& opts);

} // namespace consort::transport::tcp
