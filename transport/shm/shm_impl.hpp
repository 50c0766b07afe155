#pragma once

// What the files of the shm transport share (see include/consort/transport/shm.hpp for its
// contract): the operation (shm_op), the stash of a message that arrived before its receive, this
// rank's link with each peer, the context and its pairs. The members of shm_context are defined
// by concern:
//   context.cpp   construction, destruction, abort, refusing new operations, make_context
//   send.cpp      posting sends and writing queued frames into the outgoing rings
//   receive.cpp   posting receives, reading the incoming rings and matching messages to receives
//   progress.cpp  the progress pass, the progress thread, peer states and liveness
//   close.cpp     leaving the group (goodbyes)
//   operation.cpp shm_op's wait (spin, then sleep on the doorbell)
//   mailbox.cpp   the lockstep channels (shm_mailbox: put into a peer's slot, take in place)
// and the segment (segment.hpp), the doorbell (doorbell.hpp), the rings (ring.hpp) and the
// bootstrap of a group (bootstrap.cpp) have files of their own.

#include "transport/shm/doorbell.hpp"
#include "transport/shm/ring.hpp"
#include "transport/shm/segment.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/transport/shm.hpp>

#include "device/host_memory.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace consort::transport::shm::impl {

class shm_context;

// -- operations -----------------------------------------------------------------------------------

class shm_op final : public operation {
public:
  enum state_t : int { pending = 0, succeeded = 1, failed = 2 };

  shm_op(std::weak_ptr<shm_context> ctx, segment_ptr seg, waiter_count_ptr waiters, bool is_send,
         int self, int peer, uint64_t tag, std::chrono::microseconds spin,
         std::chrono::milliseconds nap, bool yield)
      : is_send(is_send), self(self), peer(peer), tag(tag), posted_ns(coarse_now_ns()),
        ctx_(std::move(ctx)), seg_(std::move(seg)), waiters_(std::move(waiters)), spin_(spin),
        nap_(nap), yield_(yield) {}

  caf::error wait(deadline until) override;

  bool done() const noexcept override { return state_.load(std::memory_order_acquire) != pending; }

  std::size_t message_bytes() const noexcept override {
    if (is_send)
      return bytes();
    return state_.load(std::memory_order_acquire) == succeeded ? received : 0;
  }

  /// Completes the operation once with `err` (empty: success); later calls do nothing. Rings
  /// this rank's doorbell, on which a waiter may sleep.
  void complete(caf::error err) {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (state_.load(std::memory_order_relaxed) != pending)
        return;
      const int next = err ? failed : succeeded;
      error_ = std::move(err);
      state_.store(next, std::memory_order_release);
    }
    if (in_backlog)
      waiters_->backlog.fetch_sub(1, std::memory_order_seq_cst);
    // Wake a waiter sleeping on the doorbell (the progress thread does not sleep on it then).
    if (waiters_->n.load(std::memory_order_seq_cst) > 0)
      ring_bell(seg_->block(self));
  }

  /// Fails the operation with `code`, its description and `cause`.
  void fail(errc code, const std::string& cause) {
    complete(make_caf_error(code, describe() + ": " + cause));
  }

  std::string describe() const;

  std::size_t bytes() const noexcept {
    if (!is_send)
      return into.size();
    std::size_t total = 0;
    for (const auto& part : parts)
      total += part.size();
    return total;
  }

  const bool is_send;
  const int self;
  const int peer;
  const uint64_t tag;
  /// When it was posted (coarse_now_ns: named in its timeout, to the clock's tick).
  const int64_t posted_ns;
  /// A send: its frame header and its parts, streamed in this order.
  frame_header header{};
  send_parts parts;
  /// A receive: the buffer, whether a smaller message fits, and what was received.
  mutable_bytes into;
  bool at_most = false;
  std::size_t received = 0;
  /// A send that was queued: counted in the context's backlog until it completes.
  bool in_backlog = false;
  /// Bytes a send owns (a goodbye's reason); `parts` may point into them.
  std::string owned;

private:
  caf::error result() const {
    return state_.load(std::memory_order_acquire) == succeeded ? caf::error{} : error_;
  }

  // The phases of wait (operation.cpp, which alone uses them: inline there).
  /// The first phase of wait: spins for the context's spin time (at most until `until`),
  /// polling the context when a peer may have moved; whether the operation is done.
  inline bool spin_until_done(deadline until);
  /// The second phase of wait: sleeps on this rank's doorbell, making progress on each wake-up,
  /// until the operation is done or `until` passes.
  inline caf::error sleep_until_done(deadline until);

  std::atomic<int> state_{pending};
  std::mutex mtx_;
  caf::error error_;
  std::weak_ptr<shm_context> ctx_;
  /// Keeps the mapping (and this rank's doorbell) alive as long as the operation.
  segment_ptr seg_;
  waiter_count_ptr waiters_;
  std::chrono::microseconds spin_;
  std::chrono::milliseconds nap_;
  /// Yield the core between polls (options::yield_when_idle).
  bool yield_;
};

using op_ptr = std::shared_ptr<shm_op>;

/// A message that arrived before its receive was posted. Its buffer comes from the host block
/// cache (device/host_memory.hpp), as the TCP transport's: a fresh buffer per message costs a
/// page fault per 4 KiB on its first write, which made a 64 MiB ring all-reduce 4x slower.
struct stash {
  stash(uint64_t tag, std::size_t size) : tag(tag), size(size) {
    if (size > 0)
      block = consort::detail::host_block(size);
  }

  std::byte* data() { return block.data(); }
  bool complete() const { return got == size; }

  uint64_t tag;
  std::size_t size;
  std::size_t got = 0;
  consort::detail::host_block block;
};

using stash_ptr = std::shared_ptr<stash>;

// -- lockstep channels ----------------------------------------------------------------------------

/// A lockstep channel of a context (transport::mailbox; mailbox.cpp): a message goes into the
/// slot of the segment from this rank to the peer (segment.hpp, mailbox_slot), and the peer reads
/// it there. Only the thread that uses the channel touches its counts.
class shm_mailbox final : public transport::mailbox {
public:
  shm_mailbox(shm_context& ctx, int channel);

  std::size_t capacity() const noexcept override { return sizeof(mailbox_slot::data); }
  caf::error put(int peer, uint64_t tag, const send_parts& parts) override;
  caf::expected<const_bytes> take(int peer, uint64_t tag, deadline until) override;
  bool arrived(int peer) const noexcept override;

private:
  /// The slot of `peer`'s next message to this rank.
  mailbox_slot& incoming(int peer) const;
  /// Checks `peer`; an error saying why it cannot be used.
  caf::error check_peer(int peer, const char* action) const;
  /// "shm transport: rank 0: message 7 of lockstep channel 1 from rank 2".
  std::string describe(int peer, uint64_t seq, const char* from) const;
  /// The ways take waits (inline in mailbox.cpp): whether `peer`'s message `seq` came.
  inline bool spin_for(int peer, uint64_t seq, deadline until, caf::error& err);
  inline caf::error sleep_for(int peer, uint64_t seq, deadline until);
  /// The error of a wait that saw the peer or this context fail (none when the message came).
  inline caf::error failure_of(int peer, uint64_t seq);

  shm_context& ctx_;
  const int channel_;
  /// Messages put to and taken from each peer so far.
  std::vector<uint64_t> puts_;
  std::vector<uint64_t> takes_;
};

// -- the context ----------------------------------------------------------------------------------

/// This rank's side of the channel with one peer.
struct peer_link {
  int rank = -1;

  // Outgoing: guarded by out_mtx. The front send may be partly written (out_offset bytes of its
  // header and parts).
  std::mutex out_mtx;
  ring_view out;
  std::deque<op_ptr> out_queue;
  std::size_t out_offset = 0;

  // Incoming: guarded by in_mtx.
  std::mutex in_mtx;
  ring_view in;
  /// Receives waiting for their message, in posting order (a message takes the oldest of its tag),
  /// and messages that came before their receive, in arrival order (a receive takes the oldest of
  /// its tag). Flat vectors rather than a map of queues per tag: few are pending at a time, the
  /// oldest of a tag is nearly always in front, and a vector keeps its capacity, so that posting a
  /// receive or stashing a message allocates no node.
  std::vector<op_ptr> posted;
  std::vector<stash_ptr> stashed;
  /// The message being read: its header, the bytes read, and where they go (an op, a stash, the
  /// goodbye's reason, or nowhere: a dropped message).
  bool reading = false;
  frame_header current{};
  std::size_t current_got = 0;
  op_ptr current_op;
  stash_ptr current_stash;
  std::string current_text;
  bool goodbye = false;

  /// Set once when the peer is lost, aborted or left: what its operations fail with.
  std::atomic<bool> failed{false};
  errc fail_code = errc::peer_lost;
  std::string fail_cause;

  /// Marks the peer as failed (the first cause wins). @pre in_mtx is held.
  void set_failed(errc code, const std::string& cause) {
    if (failed.load())
      return;
    fail_code = code;
    fail_cause = cause;
    failed.store(true, std::memory_order_release);
  }

  /// Fails every posted receive with the peer's failure. @pre in_mtx is held.
  void fail_posted() {
    for (auto& op : posted)
      op->fail(fail_code, fail_cause);
    posted.clear();
  }
};

class shm_context final : public context, public std::enable_shared_from_this<shm_context> {
public:
  shm_context(segment_ptr seg, int rank, const options& opts);
  ~shm_context() override;

  /// Starts the progress thread; called once the context is owned by a shared_ptr.
  void start();

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }

  pair& to(int peer) override;

  void make_pairs();

  // Members declared `inline` are defined in the one file that uses them (named beside them), so
  // that the hot path inlines them into their callers (-fPIC does not inline a function that
  // another object could interpose).

  /// Posts a send to `peer` (send.cpp, for shm_pair::send).
  inline operation_ptr send(int peer, uint64_t tag, send_parts parts);
  /// Posts a receive from `peer` (receive.cpp).
  operation_ptr recv(int peer, uint64_t tag, mutable_bytes into, bool at_most);
  /// A new send or receive of this rank with `peer`.
  op_ptr new_op(bool is_send, int peer, uint64_t tag);
  /// Fails `op` when the context takes no new operations (aborted, closed); whether it did.
  bool fail_if_refused(shm_op& op);

  void abort(const std::string& why, errc code = errc::peer_lost) override;

  caf::error close(const std::string& reason, deadline until) override;

  /// One pass over every peer, after the one under way if any.
  void pass_blocking() {
    std::lock_guard<std::mutex> lock{progress_mtx_};
    pass();
  }

  /// Whether a pass may have anything to do: a peer wrote into its ring to this rank, a send is
  /// queued, or a peer is no longer live. Reads a few words, takes no lock: a spinning waiter
  /// looks on every turn and polls only when it is true.
  bool may_move() const noexcept {
    if (waiters_->backlog.load(std::memory_order_relaxed) > 0)
      return true;
    for (const auto& l : links_) {
      if (l.rank < 0 || l.failed.load(std::memory_order_relaxed))
        continue;
      const auto& c = *l.in.control;
      if (c.head.load(std::memory_order_relaxed) != c.tail.load(std::memory_order_relaxed))
        return true;
      if (seg_->block(l.rank).state.load(std::memory_order_relaxed) != live)
        return true;
    }
    return false;
  }

  /// One pass over every peer if no other thread is making progress; whether anything moved.
  bool poll() {
    std::unique_lock<std::mutex> lock{progress_mtx_, std::try_to_lock};
    if (!lock.owns_lock())
      return false;
    return pass();
  }

private:
  peer_link& link(int p) { return links_[static_cast<std::size_t>(p)]; }

  /// Why new operations are refused (empty: they are not), and the code.
  bool refused(errc& code, std::string& cause);

  // -- sending (send.cpp) --
  /// Writes what fits of the queued sends to `l`'s ring; whether anything was written.
  /// @pre l.out_mtx is held.
  bool write_queued(peer_link& l);

  // -- receiving (receive.cpp) --
  /// Reads what has arrived from `l`'s peer; whether anything was read.
  /// @pre l.in_mtx is held.
  bool read_incoming(peer_link& l);

  // -- progress and peers (progress.cpp) --
  /// The peer is gone for good: every operation with it fails with `code` and `cause`, except
  /// receives of messages already stashed. @pre l.in_mtx is held.
  void lose_peer(peer_link& l, errc code, const std::string& cause);
  /// Looks at `l`'s peer's state: an aborted or destroyed peer fails the operations with it, once
  /// what it had written is read. @pre l.in_mtx is held.
  void check_peer(peer_link& l);
  /// Checks that the peers' processes are alive.
  void check_liveness();
  /// One pass: every queued send, every incoming ring, every peer's state.
  /// @pre progress_mtx_ is held.
  bool pass();
  /// Sleeps while waiters make the progress: until the last one leaves with sends queued, the
  /// grace passes, or the liveness check is due (`next_check`, which it moves on when it checks).
  /// Inline: progress.cpp alone uses it and run_progress.
  inline void nap_while_waiters_work(clock::time_point now, uint32_t waiting,
                                     clock::time_point& next_check);
  /// The progress thread's loop.
  inline void run_progress();

  // -- lifecycle (context.cpp) --
  /// Fails every operation of this context with `code` and `cause`.
  void fail_all(errc code, const std::string& cause);

  // -- leaving (close.cpp) --
  /// Queues a goodbye carrying `reason` after the posted sends to every peer that still reads.
  void queue_goodbyes(const std::string& reason);
  /// The peers (comma-separated ranks) that have not yet taken every message and left; empty
  /// when close is done.
  std::string peers_not_done();

  transport::mailbox* mailbox(int channel) noexcept override {
    return channel >= 0 && channel < mailbox_channels
               ? mailboxes_[static_cast<std::size_t>(channel)].get()
               : nullptr;
  }

  friend class shm_op;
  friend class shm_mailbox;

  segment_ptr seg_;
  const int rank_;
  const int size_;
  const options opts_;
  /// Waits yield the core between polls (options::yield_when_idle).
  const bool yield_;
  std::vector<peer_link> links_;
  std::vector<std::unique_ptr<pair>> pairs_;
  /// The lockstep channels (none beyond mailbox_max_ranks ranks).
  std::array<std::unique_ptr<shm_mailbox>, mailbox_channels> mailboxes_;

  std::mutex progress_mtx_;
  waiter_count_ptr waiters_ = std::make_shared<waiter_count>();
  std::thread progress_;
  std::atomic<bool> stop_{false};

  std::mutex state_mtx_;
  bool aborted_ = false;
  bool closed_ = false;
  /// Set (under state_mtx_) once aborted_ or closed_ is: a new operation looks here without the
  /// lock.
  std::atomic<bool> refusing_{false};
  errc abort_code_ = errc::peer_lost;
  std::string abort_why_;
};

/// The pair of a context with one peer: its operations are the context's.
class shm_pair final : public pair {
public:
  shm_pair(shm_context& ctx, int peer) : ctx_(ctx), peer_(peer) {}
  int peer_rank() const noexcept override { return peer_; }
  operation_ptr send(uint64_t tag, send_parts parts) override;           // send.cpp
  operation_ptr recv(uint64_t tag, mutable_bytes into) override;         // receive.cpp
  operation_ptr recv_at_most(uint64_t tag, mutable_bytes into) override; // receive.cpp

private:
  shm_context& ctx_;
  int peer_;
};

/// A context of rank `rank` on segment `seg`, with its pairs and its progress thread.
std::shared_ptr<shm_context> make_context(segment_ptr seg, int rank, const options& opts);

} // namespace consort::transport::shm::impl
