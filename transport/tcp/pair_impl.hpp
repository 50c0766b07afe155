#pragma once

// One TCP connection of a context (see context.cpp for the mesh, wire.hpp for the frames).
//
// Who does the I/O. The socket is non-blocking and both directions are "pumped": a pump reads
// (or writes) until the kernel says EAGAIN. Any thread may pump, one at a time per direction:
// - a thread waiting on an operation pumps its pair while it spins (the waiting
//   thread reads its own message instead of being woken by the I/O thread, saving a hop);
// - a thread calling `send` writes at once (small messages never leave the caller's thread);
// - the context's poller thread (poller.hpp, an epoll set of its own, not Asio's reactor) pumps
//   when the socket is readable and no thread spins on a receive of the pair, or writable while
//   bytes are queued, so progress never depends on a waiter, and messages that arrive before
//   their receive is posted are drained into the stash rather than stalling the sender.
// A pump that finds its direction busy sets a "kick" flag instead of blocking; the thread inside
// re-runs the pump before it leaves, so no readiness is ever lost. The socket is registered
// one-shot and level-triggered, armed for what is needed (`arm_mu_`): reading while no thread
// spins on the pair (the first spinner disarms it, the last re-arms it, so a message that a
// spinner reads wakes no other thread), writing while bytes wait for room. An event disarms the
// socket until the poller thread re-arms it after its pump; re-arming a ready socket reports it
// at once, so a readiness that came while it was disarmed is not lost.
//
// Receive matching. A frame's header names its tag and size; the oldest posted receive of that
// tag gets the payload read straight into its buffer. With none posted, the payload goes to the
// stash (bounded per context) until a receive claims it.
//
// The end of a connection (pair.hpp, context::close). A rank that leaves finishes its queued
// sends, sends a goodbye frame, half-closes (SHUT_WR) and reads on until the peer's end of file;
// only then is the socket closed. Closing a socket whose peer has not read everything can make
// the kernel reset the connection and drop bytes still queued in it, which is how the last
// collective before an exit was lost. A peer that receives the goodbye fails only what can no
// longer be matched (posted receives, later receives without a stashed message: peer_left),
// keeps delivering what arrived before the goodbye, and half-closes its own side at once, so the
// leaver's close returns after one round trip. An abort frame carries an error code and reason
// to the peer before a connection is cut.
//
// Lock order: rx_mu_ -> tx_mu_ -> match_mu_ -> txq_mu_ -> an operation's mutex -> address_mu_;
// arm_mu_ comes after them all (only epoll_ctl and the poller's defer lock run under it). Pumps
// only ever try-lock rx_mu_ and tx_mu_ (see above), and hold one of them at a time.

#include "transport/tcp/poller.hpp"
#include "transport/tcp/wire.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/transport/tcp.hpp>

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace consort::transport::tcp {

/// What the pairs of a context share; outlives the context while operations hold its pairs.
///
/// Thread safety: immutable after construction except `stash_bytes` (atomic).
struct pair_env {
  int rank = 0;
  int size = 0;
  std::chrono::microseconds spin{50};
  bool busy_poll = false;
  std::size_t max_payload_bytes = 0;
  std::size_t max_stash_bytes = 0;
  std::function<void(const std::string&)> log;
  /// Test hook (test_hooks::before_read, transport/tcp/test_hooks.hpp): called before each read
  /// from a peer's socket.
  std::function<void(int peer)> before_read;
  /// Test hook (test_hooks::on_readiness): called on the poller's thread for each event.
  std::function<void(int peer)> on_readiness;
  /// The context's poller (set before any pair opens; stopped before any pair is torn down).
  readiness_poller* poller = nullptr;
  /// Payload bytes held by the stashes of all pairs of the context.
  std::atomic<std::size_t> stash_bytes{0};

  /// Writes one line to the log, prefixed with this rank.
  void log_line(const std::string& line) const;
};

class pair_impl;

/// The state every send and receive has: completion, its error, and the wait (spin, then block).
///
/// Thread safety: thread-safe; `complete` takes effect once.
class op_base : public operation {
public:
  explicit op_base(std::shared_ptr<pair_impl> pair) : pair_(std::move(pair)) {}

  caf::error wait(deadline until) override;
  bool done() const noexcept override { return done_.load(std::memory_order_acquire); }

  /// Completes the operation with `err` (empty: success). Later calls are ignored.
  void complete(caf::error err = caf::error{});

protected:
  /// Drives this operation's direction of the pair (one pump) while spinning.
  virtual void drive() = 0;
  /// Called before and after the spin phase of a wait.
  virtual void spinning(bool) {}
  /// Called before and after the blocking phase of a wait.
  virtual void blocking(bool) {}
  /// The error for a wait that reached its deadline.
  virtual caf::error timeout_error() const = 0;

  std::shared_ptr<pair_impl> pair_;

private:
  std::atomic<bool> done_{false};
  std::mutex mu_;
  std::condition_variable cv_; // guarded by mu_
  int waiters_ = 0;            // guarded by mu_
  caf::error result_;          // guarded by mu_
};

/// A posted receive.
class recv_op final : public op_base {
public:
  recv_op(std::shared_ptr<pair_impl> pair, uint64_t tag, mutable_bytes into, bool at_most)
      : op_base(std::move(pair)), tag_(tag), into_(into), at_most_(at_most) {}

  uint64_t tag() const noexcept { return tag_; }
  mutable_bytes into() const noexcept { return into_; }
  /// Whether a message of `size` payload bytes can be received into `into()`: the same size, or
  /// (recv_at_most) no larger.
  bool fits(uint64_t size) const noexcept {
    return at_most_ ? size <= into_.size() : size == into_.size();
  }
  /// "the buffer has" or "the buffer has at most": for the error of a message that does not fit.
  const char* buffer_words() const noexcept {
    return at_most_ ? "the buffer takes at most " : "the buffer has ";
  }
  std::size_t message_bytes() const noexcept override {
    return done() ? static_cast<std::size_t>(received.load(std::memory_order_relaxed)) : 0;
  }
  /// Payload bytes written so far (for error messages); the message's size once complete.
  std::atomic<uint64_t> received{0};

  /// Fails this receive because its pair failed with `why` (peer_lost unless `code` says else).
  void fail(const std::string& why, errc code = errc::peer_lost);

protected:
  void drive() override;
  void spinning(bool on) override;
  void blocking(bool on) override;
  caf::error timeout_error() const override;

private:
  uint64_t tag_;
  mutable_bytes into_;
  bool at_most_;
};

/// A posted send: the encoded head and the caller's parts, written in place.
class send_op final : public op_base {
public:
  send_op(std::shared_ptr<pair_impl> pair, uint64_t tag, send_parts parts, uint64_t payload_bytes,
          wire::frame_kind kind = wire::frame_kind::data);

  /// A control frame (goodbye, abort) whose payload the operation owns.
  static std::shared_ptr<send_op> control(std::shared_ptr<pair_impl> pair, wire::frame_kind kind,
                                          std::string payload);

  uint64_t tag() const noexcept { return tag_; }
  uint64_t payload_bytes() const noexcept { return payload_bytes_; }
  std::size_t message_bytes() const noexcept override {
    return static_cast<std::size_t>(payload_bytes_);
  }
  /// Head plus payload bytes.
  uint64_t total_bytes() const noexcept { return head_len_ + payload_bytes_; }

  /// Fails this send because its pair failed with `why` (peer_lost unless `code` says else).
  void fail(const std::string& why, errc code = errc::peer_lost);

protected:
  void drive() override;
  caf::error timeout_error() const override;

private:
  friend class pair_impl;
  uint64_t tag_;
  uint64_t payload_bytes_;
  std::array<std::byte, wire::max_head_bytes> head_{};
  std::size_t head_len_ = 0;
  send_parts parts_;
  /// The payload of a control frame (parts_ points into it).
  std::string owned_;
  /// Bytes of head + payload written (written by the tx pump, read for error messages).
  std::atomic<uint64_t> written_{0};
};

/// A pair of a TCP context (see the file comment).
///
/// Thread safety: thread-safe; `open` runs on the context's I/O thread, `on_ready` on its
/// poller's.
class pair_impl final : public transport::pair,
                        public ready_target,
                        public std::enable_shared_from_this<pair_impl> {
public:
  pair_impl(std::shared_ptr<pair_env> env, boost::asio::io_context& io, int peer_rank);
  ~pair_impl() override;

  pair_impl(const pair_impl&) = delete;
  pair_impl& operator=(const pair_impl&) = delete;

  // -- transport::pair -------------------------------------------------------------------------

  int peer_rank() const noexcept override { return peer_; }
  operation_ptr send(uint64_t tag, send_parts parts) override;
  operation_ptr recv(uint64_t tag, mutable_bytes into) override;
  operation_ptr recv_at_most(uint64_t tag, mutable_bytes into) override;
  /// As a spinner (spinning_on_rx) from before the caller posts its receives. When the last one
  /// leaves, the socket is not re-armed for reading at once: the caller's next exchange is
  /// expected within the poller's defer grace (1 ms) and reads what arrives meanwhile itself;
  /// failing that, the poller re-arms it (readiness_poller::defer). A thread that blocks on a
  /// receive, or waits for the peer's end, re-arms it at once.
  void reading_here(bool on) override;

  // -- life cycle (I/O thread) -----------------------------------------------------------------

  /// Takes over the handshaken `socket` of the peer at `address` and starts the I/O.
  void open(boost::asio::ip::tcp::socket socket, std::string address);

  /// Whether `open` ran.
  bool is_open() const noexcept { return fd_.load(std::memory_order_acquire) >= 0; }

  /// How `fail` logs.
  enum class log_mode { never, always, if_busy };

  /// Fails every pending and later operation with `code` and `why`, shuts the socket down
  /// (the peer sees the connection end) and logs `why`: always, never, or (`if_busy`) only when
  /// operations were pending (a peer that closes an idle connection is shutting down). Once the
  /// peer said goodbye, the code is peer_left and the reason its goodbye. Any thread.
  void fail(const std::string& why, log_mode log, errc code = errc::peer_lost);

  /// Tells the peer, in an abort frame, that this rank aborts the group with `code` and `why`,
  /// when the stream is between frames (else the peer only sees the connection end), then
  /// `fail`s the pair. Any thread but the pumps'.
  void abort(const std::string& why, errc code);

  // -- the clean end (context::close; any thread but the pumps', one at a time) ----------------

  /// Refuses new sends and fails posted receives with `shutdown`; returns the last queued send
  /// (null if none), whose completion means that every send started before has been written.
  std::shared_ptr<send_op> begin_close(const std::string& why);

  /// Queues the goodbye frame with `reason`; null when the pair failed or never opened.
  std::shared_ptr<send_op> send_goodbye(const std::string& reason);

  /// Half-closes the socket (SHUT_WR): the peer reads everything sent so far, then end of file.
  void shut_write();

  /// Waits until the peer's end of file (or a failure) was read, or `until`; true when seen.
  bool wait_peer_closed(deadline until);

  /// Whether the pair failed (or never opened); such a pair has nothing left to close.
  bool broken() const noexcept { return failed_.load(std::memory_order_acquire); }

  /// Fails the pair (unless it already failed) and releases the socket, after the I/O thread
  /// has stopped. Operations that outlive the context then find a failed, closed pair.
  void teardown(const std::string& why);

  // -- pumps (any thread) ----------------------------------------------------------------------

  /// Reads and dispatches what the socket has, unless another thread is at it.
  void pump_rx();
  /// As `pump_rx`, but when another thread is at it, waits for it and runs once more: after an
  /// abort, the receive being read into has failed when this returns (unless this thread is
  /// itself inside a receive pump, which then finishes the job).
  void pump_rx_now();
  /// Matches a new receive with a message that arrived early, or posts it.
  operation_ptr post_recv(std::shared_ptr<recv_op> op);
  /// Writes what is queued, unless another thread is at it.
  void pump_tx();

  /// A thread starts (`true`) or stops spinning on a receive of this pair. While one spins, the
  /// poller leaves the reading to it: the first spinner disarms the socket's read readiness, so
  /// that a message it reads itself wakes no other thread (on a busy machine that wake-up
  /// preempts a spinner); the last one re-arms it, and pumps once more, so that nothing that
  /// arrived meanwhile is left unread.
  void spinning_on_rx(bool on);

  /// A thread starts (`true`) or stops blocking on a receive of this pair: while one blocks, the
  /// poller reads even when spinners (or `reading_here` callers) are registered, since the
  /// blocked thread relies on it.
  void blocked_on_rx(bool on);

  // -- ready_target (the poller's thread) ------------------------------------------------------

  void on_ready(uint32_t events) override;
  void on_deferred() override;

  /// "rank 2 (127.0.0.1:4000)"
  std::string describe() const;

  const pair_env& env() const noexcept { return *env_; }

private:
  struct stash_entry;

  enum class rx_phase { prefix, header, payload };
  enum class sink { op, stash, drop, control };

  // rx side, rx_mu_ held
  void pump_rx_locked();
  bool consume_staged();
  bool begin_message(const wire::header& h);
  void finish_message();
  void abandon_incoming();
  void malformed(const std::string& what);
  void on_goodbye(const std::string& reason);
  void on_abort(const std::string& payload);
  void peer_closed();
  caf::error left_error(const std::string& what) const;

  // tx side, tx_mu_ held; returns true when bytes remain that the socket would not take
  bool pump_tx_locked();
  void request_write_wait();
  /// Fails the pair after a write found the peer's end gone (tx_mu_ not held).
  void conclude_broken_write(const std::string& why);

  /// A spinner (`lazy` false) or a `reading_here` caller (`lazy` true) leaves: pumps what the
  /// poller left to it, and when it was the last, re-arms reading now or after the grace.
  void stop_reading(bool lazy);
  /// Arms the socket for what is needed now: reading unless a thread spins on the pair (or
  /// reading is over), writing while `want_write_`. @pre arm_mu_ is held.
  void arm_locked();
  /// Arms the socket again (any thread).
  void arm();
  std::pair<std::string, errc> failure() const;

  std::shared_ptr<pair_env> env_;
  boost::asio::io_context* io_; // valid until teardown
  const int peer_;

  /// The poller's registration (guarded by arm_mu_, a leaf lock: only epoll_ctl runs under it).
  std::mutex arm_mu_;
  bool registered_ = false; // the descriptor is in the poller's set (open .. teardown)
  bool want_write_ = false; // bytes wait for room in the socket
  uint32_t armed_ = 0;      // the events armed now (0 after an event fired: one-shot)
  /// The last `reading_here` caller left: reading stays with the threads of this pair's small
  /// exchanges, expected back soon, until the poller's defer grace passes (or a thread blocks).
  bool lazy_ = false;
  /// The socket's descriptor for the pumps' syscalls; -1 before open and after teardown.
  /// Changed only with rx_mu_ and tx_mu_ held.
  std::atomic<int> fd_{-1};
  mutable std::mutex address_mu_; // innermost
  std::string address_;           // guarded by address_mu_: the peer's address, set by open
  std::atomic<bool> torn_down_{false};

  // -- failure ------------------------------------------------------------------------------
  std::atomic<bool> failed_{false};
  std::string failure_;                 // guarded by match_mu_; set once, before failed_
  errc failure_code_ = errc::peer_lost; // guarded by match_mu_; set with failure_

  // -- the end ------------------------------------------------------------------------------
  /// This side is leaving (begin_close): sends are refused, arriving data is dropped.
  std::atomic<bool> closing_{false};
  /// The peer said goodbye: it sends nothing more (left_reason_ guarded by match_mu_).
  std::atomic<bool> peer_left_{false};
  std::string left_reason_;
  /// This rank is aborting the pair (guarded by match_mu_): from the moment its abort frame may be
  /// on the wire, whatever fails the pair (the peer, told, closing its end first) fails it with
  /// this reason and code.
  bool aborting_ = false;
  std::string abort_reason_;
  errc abort_code_ = errc::peer_lost;
  /// The peer's end of file was read after a goodbye (either way): reading is over.
  std::atomic<bool> rx_eof_{false};
  /// Our side is half-closed (under tx_mu_).
  bool write_shut_ = false;
  /// A write found the peer's end gone (under tx_mu_): why, until pump_tx concludes it.
  std::string tx_broken_;
  /// How long a broken write waits for another thread's read of what the peer sent before it.
  static constexpr std::chrono::milliseconds broken_write_grace{100};
  std::mutex end_mu_;
  std::condition_variable end_cv_; // guarded by end_mu_: rx_eof_ or failed_ became true

  // -- receive ------------------------------------------------------------------------------
  std::mutex rx_mu_; // the reading pump; try-locked
  std::atomic<bool> rx_kick_{false};
  std::atomic<int> rx_spinners_{0};       // changed under arm_mu_, read anywhere
  std::atomic<int> rx_blocked_{0};        // changed under arm_mu_, read anywhere
  std::atomic<bool> rx_skipped_{false};   // the poller left a readiness to a spinner
  rx_phase phase_ = rx_phase::prefix;     // guarded by rx_mu_
  std::unique_ptr<std::byte[]> stage_;    // guarded by rx_mu_: small reads land here
  std::size_t stage_begin_ = 0;           // guarded by rx_mu_
  std::size_t stage_end_ = 0;             // guarded by rx_mu_
  uint32_t head_len_ = 0;                 // guarded by rx_mu_
  wire::header in_{};                     // guarded by rx_mu_: the frame being read
  uint64_t in_got_ = 0;                   // guarded by rx_mu_
  sink in_sink_ = sink::drop;             // guarded by rx_mu_
  std::byte* in_dst_ = nullptr;           // guarded by rx_mu_
  std::shared_ptr<recv_op> in_op_;        // guarded by rx_mu_
  std::shared_ptr<stash_entry> in_stash_; // guarded by rx_mu_
  std::array<std::byte, wire::max_control_bytes> control_{}; // guarded by rx_mu_

  mutable std::mutex match_mu_;
  /// Posted receives without a message yet, and messages (complete or being read) without a
  /// receive yet, each with its tag, oldest first: a message takes the oldest receive of its tag
  /// and a receive the oldest message. Flat vectors rather than a map of queues per tag: few are
  /// pending at a time, and a vector keeps its capacity, so that a call with a new tag allocates
  /// no node, queue or block (as the shm transport's matching).
  std::vector<std::pair<uint64_t, std::shared_ptr<recv_op>>> posted_;    // match_mu_
  std::vector<std::pair<uint64_t, std::shared_ptr<stash_entry>>> stash_; // match_mu_

  // -- send ---------------------------------------------------------------------------------
  std::mutex tx_mu_; // the writing pump; try-locked
  std::atomic<bool> tx_kick_{false};
  std::mutex txq_mu_;
  std::deque<std::shared_ptr<send_op>> txq_; // guarded by txq_mu_: front is being written
};

} // namespace consort::transport::tcp
