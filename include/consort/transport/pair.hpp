#pragma once

// The transport abstraction that collective algorithms see (Gloo's transport::pair/context,
// with deadlines): a context is this rank's view of a group of `size` ranks; a pair is an
// ordered, reliable message channel to one peer. Implementations: transport/local (threads of one
// process, for tests and in-process groups) and transport/tcp (Boost.Asio sockets).

#include <consort/error.hpp>

#include <caf/error.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace consort::transport {

using clock = std::chrono::steady_clock;
using deadline = clock::time_point;

/// Bytes to send: read in place until the send completes (never copied into a message).
using const_bytes = std::span<const std::byte>;
/// Bytes to receive into: written in place.
using mutable_bytes = std::span<std::byte>;

/// One outstanding send or receive.
///
/// Thread safety: `wait` may be called from one thread at a time; `done` from any thread.
class operation {
public:
  virtual ~operation() = default;

  /// Blocks until the operation completes, fails, or `until` passes. Returns an empty error on
  /// success. Errors (errc, with the peer, the operation and byte counts in the message):
  /// - `collective_timeout`: `until` passed; the operation stays posted and may still complete;
  /// - `peer_lost`: the connection broke or the peer closed it;
  /// - `invalid_argument`: the message that arrived for this receive has another size than the
  ///   buffer (the message is consumed and dropped).
  virtual caf::error wait(deadline until) = 0;

  /// Whether the operation has completed or failed (non-blocking).
  virtual bool done() const noexcept = 0;
};

using operation_ptr = std::shared_ptr<operation>;

/// A channel to one peer. Messages with the same tag are delivered in the order they were sent;
/// a receive matches the oldest unmatched message with its tag, whenever it arrives (before or
/// after the receive is posted).
///
/// Thread safety: thread-safe.
class pair {
public:
  virtual ~pair() = default;

  /// The peer's rank in the context.
  virtual int peer_rank() const noexcept = 0;

  /// Sends one message made of `parts`, gathered in order (one scatter-gather write where the
  /// transport can). The bytes must stay valid and unchanged until the operation completes.
  virtual operation_ptr send(uint64_t tag, std::vector<const_bytes> parts) = 0;

  /// Receives the message with `tag` into `into`, whose size must equal the message's.
  /// `into` must stay valid until the operation completes.
  virtual operation_ptr recv(uint64_t tag, mutable_bytes into) = 0;
};

/// This rank's view of a group of ranks, with a pair to every other rank.
///
/// Thread safety: thread-safe.
class context {
public:
  virtual ~context() = default;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;

  /// The pair to `peer`. @pre 0 <= peer < size() and peer != rank()
  virtual pair& to(int peer) = 0;

  /// Fails every pending and later operation of this context with `peer_lost` naming `why`
  /// (membership calls it when a worker is lost, so nothing waits for a dead peer).
  virtual void abort(const std::string& why) = 0;
};

using context_ptr = std::shared_ptr<context>;

/// Waits for every operation in `ops` (in order) until `until`; returns the first error.
caf::error wait_all(const std::vector<operation_ptr>& ops, deadline until);

} // namespace consort::transport
