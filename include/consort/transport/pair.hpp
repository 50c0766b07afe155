#pragma once

// The transport abstraction that collective algorithms see (Gloo's transport::pair/context,
// with deadlines): a context is this rank's view of a group of `size` ranks; a pair is an
// ordered, reliable message channel to one peer. Implementations: transport/local (threads of one
// process, for tests and in-process groups), transport/tcp (Boost.Asio sockets) and transport/shm
// (processes of one host; it alone has `mailbox`, the lockstep channels, below).

#include <consort/error.hpp>

#include <caf/error.hpp>
#include <caf/expected.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <vector>

namespace consort::transport {

using clock = std::chrono::steady_clock;
using deadline = clock::time_point;

/// Bytes to send: read in place until the send completes (never copied into a message).
using const_bytes = std::span<const std::byte>;
/// The parts of one message, in order: up to four kept in the object (a descriptor and a small
/// call's data send with no allocation), more on the heap.
class send_parts {
public:
  send_parts() noexcept = default;
  send_parts(std::initializer_list<const_bytes> parts) {
    for (const auto& part : parts)
      push_back(part);
  }
  send_parts(const send_parts&) = default;
  send_parts& operator=(const send_parts&) = default;
  send_parts(send_parts&& other) noexcept
      : inline_(other.inline_), more_(std::move(other.more_)), size_(other.size_) {
    other.clear();
  }
  send_parts& operator=(send_parts&& other) noexcept {
    inline_ = other.inline_;
    more_ = std::move(other.more_);
    size_ = other.size_;
    other.clear();
    return *this;
  }

  void push_back(const_bytes part) {
    if (size_ < inline_parts) {
      inline_[size_++] = part;
      return;
    }
    if (more_.empty())
      more_.assign(inline_.begin(), inline_.end());
    more_.push_back(part);
    ++size_;
  }
  /// Room for `n` parts (beyond four, on the heap).
  void reserve(size_t n) {
    if (n > inline_parts)
      more_.reserve(n);
  }
  void clear() noexcept {
    more_.clear();
    size_ = 0;
  }
  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  const const_bytes* begin() const noexcept {
    return size_ > inline_parts ? more_.data() : inline_.data();
  }
  const const_bytes* end() const noexcept { return begin() + size_; }
  const const_bytes& operator[](size_t i) const noexcept { return begin()[i]; }

private:
  static constexpr size_t inline_parts = 4;
  std::array<const_bytes, inline_parts> inline_{};
  std::vector<const_bytes> more_; // every part, once there are more than four
  size_t size_ = 0;
};
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
  /// - `invalid_argument`: the message that arrived for this receive does not fit the buffer:
  ///   another size (`recv`) or a larger one (`recv_at_most`); the message is consumed and dropped.
  virtual caf::error wait(deadline until) = 0;

  /// Whether the operation has completed or failed (non-blocking).
  virtual bool done() const noexcept = 0;

  /// A send: the bytes of its message. A receive that completed without error: the bytes of the
  /// message it received (for `recv_at_most`, at most the buffer's size); 0 before.
  virtual std::size_t message_bytes() const noexcept = 0;
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
  virtual operation_ptr send(uint64_t tag, send_parts parts) = 0;

  /// Receives the message with `tag` into `into`, whose size must equal the message's.
  /// `into` must stay valid until the operation completes.
  virtual operation_ptr recv(uint64_t tag, mutable_bytes into) = 0;

  /// As `recv`, for a message of up to `into.size()` bytes whose exact size the receiver cannot
  /// know (a header that says what follows, or a message whose size itself must be checked):
  /// the message is written to the front of `into`, and the operation's `message_bytes()` says
  /// how many bytes it had. A larger message fails the receive with `invalid_argument`.
  virtual operation_ptr recv_at_most(uint64_t tag, mutable_bytes into) = 0;

  /// Says that the calling thread is about to post receives of this pair and wait for them
  /// (`true`, before it posts them and sends its own part of a small exchange) or is done
  /// (`false`, once those waits returned). In between, a transport with a reading thread leaves
  /// the reading to the caller, as to a thread spinning on a receive, so that a message that
  /// arrives while the caller is still sending wakes no other thread (TCP: its poller; a wake-up
  /// costs more than the message on a busy machine). A wait that blocks hands the reading back
  /// while it blocks, so nothing waits on a reader that is asleep. Calls nest; each `true` needs
  /// its `false` (`reading_here_scope`). The default does nothing.
  virtual void reading_here(bool on) { (void)on; }
};

/// `pair.reading_here(true)` for a scope, then `false`.
class reading_here_scope {
public:
  explicit reading_here_scope(pair& p) : pair_(&p) { pair_->reading_here(true); }
  ~reading_here_scope() { pair_->reading_here(false); }
  reading_here_scope(const reading_here_scope&) = delete;
  reading_here_scope& operator=(const reading_here_scope&) = delete;

private:
  pair* pair_;
};

/// A transport's fast way for the small messages of an exchange that its ranks make in lockstep,
/// as the communicator's descriptor exchange does (Open MPI's shared-memory "fast box"): the n-th
/// message a rank puts to a peer pairs with the n-th it takes from that peer, and a rank takes
/// the peer's n-th message before it puts its (n+1)-th to it. A message is written into a slot of
/// memory that the peer reads in place: no operation object, no queue, no lock, and no copy on
/// the receiving side. Transports that have none (TCP, local) return null from
/// `context::mailbox`, and their callers send messages.
///
/// Thread safety: one thread per rank uses a channel at a time; the caller serialises its calls.
class mailbox {
public:
  virtual ~mailbox() = default;

  /// The most bytes one message may have.
  virtual size_t capacity() const noexcept = 0;

  /// Puts this rank's next message to `peer`: `parts` in order, at most `capacity()` bytes in
  /// all, marked with `tag`. Fails with `invalid_argument` when the message is larger, when
  /// `peer` is not another rank of the group, or when this rank did not take `peer`'s previous
  /// message yet (the lockstep is broken, and the slot may still be read); with the context's code
  /// once it aborted or closed.
  virtual caf::error put(int peer, uint64_t tag, const send_parts& parts) = 0;

  /// Waits until `until` for `peer`'s next message, which must carry `tag`, and returns its
  /// bytes, read in place: they stay valid until this rank's next `put` to `peer`. Fails as a
  /// receive does: `collective_timeout` at the deadline; the peer's failure (lost, aborted, left)
  /// when its message did not come before it; this context's code once it aborted or closed;
  /// `invalid_argument` when the message carries another tag. After a failure the channel is out
  /// of step: abort the context (as a failed algorithm does).
  virtual caf::expected<const_bytes> take(int peer, uint64_t tag, deadline until) = 0;

  /// Whether `peer`'s next message is there (it would be taken without waiting).
  virtual bool arrived(int peer) const noexcept = 0;
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

  /// Fails every pending and later operation of this context with `code` naming `why`
  /// (membership calls it when a worker is lost, so nothing waits for a dead peer; an algorithm
  /// that failed calls it so that no peer waits for this rank). Peers learn the code and the
  /// reason where the transport can tell them (TCP: an abort frame), so that their operations
  /// fail with the cause rather than with "the peer closed the connection". Overrides keep the
  /// default argument.
  virtual void abort(const std::string& why, errc code = errc::peer_lost) = 0;

  /// Leaves the group cleanly, the end of a rank's life in the group (docs/multi_worker.md):
  /// 1. new operations are refused (`shutdown`), pending receives fail with `shutdown`;
  /// 2. every send already posted is finished: its bytes reach the peer;
  /// 3. each peer is told that this rank leaves (with `reason`), then the connection is
  ///    half-closed, and this rank reads on until the peer has closed its side.
  /// A peer that is told fails only what this rank can no longer give it: its receives that no
  /// message from this rank matches fail with `peer_left` naming this rank and `reason`; messages
  /// that arrived before the goodbye are still delivered. Returns once every peer has closed its
  /// side, or failed; `collective_timeout` naming the peers that had not when `until` passed (the
  /// connections are then closed anyway). Idempotent: a second call returns at once.
  virtual caf::error close(const std::string& reason, deadline until) = 0;

  /// Lockstep channel `channel` (0 or 1: a communicator's two lanes) of this context, or null
  /// where the transport has none (the default), or the group is too large for one.
  virtual transport::mailbox* mailbox(int channel) noexcept {
    (void)channel;
    return nullptr;
  }
};

/// `reading_here(true)` on the pair to every peer of a context for a scope (or until
/// `release`), for a thread that exchanges a small message with each of them and waits for
/// their messages right after sending its own.
class reading_from_peers {
public:
  explicit reading_from_peers(context& ctx) : ctx_(&ctx) { set(true); }
  ~reading_from_peers() { release(); }
  reading_from_peers(const reading_from_peers&) = delete;
  reading_from_peers& operator=(const reading_from_peers&) = delete;

  /// Ends the scope early (once the receives were waited for). Idempotent.
  void release() {
    if (on_)
      set(false);
  }

private:
  void set(bool on) {
    on_ = on;
    for (int p = 0; p < ctx_->size(); ++p)
      if (p != ctx_->rank())
        ctx_->to(p).reading_here(on);
  }

  context* ctx_;
  bool on_ = false;
};

using context_ptr = std::shared_ptr<context>;

/// Waits for every operation in `ops` (in order) until `until`; returns the first error.
caf::error wait_all(const std::vector<operation_ptr>& ops, deadline until);

} // namespace consort::transport
