// The in-memory transport (see include/consort/transport/local.hpp for its contract).
//
// Layout: a `group` holds one `channel` per ordered pair of ranks (src -> dst) and one `endpoint`
// per rank. A channel queues the unmatched sends and the unmatched receives per tag; at most one
// of the two queues of a tag is non-empty at any time. Matching happens under the channel's mutex,
// the copy after it is released, by the thread whose post made the match.

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/transport/local.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace consort::transport::local {

namespace {

/// How long `wait` spins before it blocks: long enough to cover a peer that is already running
/// (a spinning hand-off is far cheaper than a condition-variable wake-up; docs/algorithms.md).
constexpr auto spin_budget = std::chrono::microseconds{30};

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// -- operations -----------------------------------------------------------------------------------

/// One posted send or receive.
///
/// Thread safety: `complete` is called once, from any thread; `wait` from one thread at a time;
/// `done` from any thread. The immutable description fields are set before the operation is
/// shared.
class local_op final : public operation {
public:
  enum state_t : int { pending = 0, succeeded = 1, failed = 2 };

  local_op(bool is_send, int self, int peer, uint64_t tag)
      : is_send(is_send), self(self), peer(peer), tag(tag), posted(clock::now()) {}

  caf::error wait(deadline until) override {
    if (done())
      return result();
    // Spin first: when the peer is already on its way the hand-off takes well under a
    // microsecond, while blocking costs a futex wake-up on the other side.
    auto spin_until = std::min(until, clock::now() + spin_budget);
    for (uint32_t i = 1;; ++i) {
      if (done())
        return result();
      if ((i & 63) == 0) {
        if (clock::now() >= spin_until)
          break;
        // With more ranks than cores the peer may need this core to make progress.
        std::this_thread::yield();
      } else {
        cpu_relax();
      }
    }
    std::unique_lock<std::mutex> guard{mtx_};
    if (!cv_.wait_until(guard, until, [this] { return done(); }))
      return make_caf_error(errc::collective_timeout, describe() +
                                                          " did not complete before its deadline "
                                                          "(posted " +
                                                          elapsed_ms() + " ms ago)");
    return result();
  }

  bool done() const noexcept override { return state_.load(std::memory_order_acquire) != pending; }

  /// Completes the operation with `err` (empty: success) and wakes its waiter.
  void complete(caf::error err) {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      const int next = err ? failed : succeeded;
      error_ = std::move(err);
      state_.store(next, std::memory_order_release);
    }
    cv_.notify_all();
  }

  /// "rank 1: send of 64 bytes with tag 0x7000002 to rank 2".
  std::string describe() const {
    std::ostringstream out;
    out << "local transport: rank " << self << ": " << (is_send ? "send" : "receive") << " of "
        << bytes() << " bytes with tag 0x" << std::hex << tag << std::dec
        << (is_send ? " to rank " : " from rank ") << peer;
    return out.str();
  }

  size_t bytes() const noexcept {
    if (!is_send)
      return into.size();
    size_t total = 0;
    for (const auto& part : parts)
      total += part.size();
    return total;
  }

  std::size_t message_bytes() const noexcept override {
    if (is_send)
      return bytes();
    return state_.load(std::memory_order_acquire) == succeeded ? received : 0;
  }

  const bool is_send;
  const int self;
  const int peer;
  const uint64_t tag;
  const clock::time_point posted;
  /// The message of a send (read in place).
  send_parts parts;
  /// A send kept for its receiver after its sender left: the message's own copy, which
  /// `parts` points into (see group::leave).
  std::vector<std::byte> kept;
  /// The buffer of a receive (written in place).
  mutable_bytes into;
  /// A receive: whether a smaller message fits (recv_at_most).
  bool at_most = false;
  /// A receive: the bytes of the message it received (set before it completes).
  std::size_t received = 0;

private:
  caf::error result() const {
    // `error_` was written before `state_` was released and is never written again.
    return state_.load(std::memory_order_acquire) == succeeded ? caf::error{} : error_;
  }

  std::string elapsed_ms() const {
    auto ms = std::chrono::duration<double, std::milli>(clock::now() - posted).count();
    std::ostringstream out;
    out.precision(1);
    out << std::fixed << ms;
    return out.str();
  }

  std::atomic<int> state_{pending};
  /// Guards nothing but the sleep of `wait`: `complete` takes it so that a waiter that has
  /// checked `state_` cannot miss the notification.
  std::mutex mtx_;
  std::condition_variable cv_;
  caf::error error_;
};

using op_ptr = std::shared_ptr<local_op>;

// -- the shared state of a group --------------------------------------------------------------

/// The unmatched messages from one rank to another.
struct channel {
  /// Guards `sends` and `recvs`.
  std::mutex mtx;
  /// Per tag, sends that no receive has matched yet, oldest first.
  std::unordered_map<uint64_t, std::deque<op_ptr>> sends;
  /// Per tag, receives that no send has matched yet, oldest first.
  std::unordered_map<uint64_t, std::deque<op_ptr>> recvs;
};

/// One rank's liveness.
struct endpoint {
  /// Set once by `abort`, before it sweeps the channels; read under a channel's mutex by posts.
  std::atomic<bool> aborted{false};
  /// Guards `why` and `code`.
  std::mutex why_mtx;
  std::string why;
  /// What the peers' operations fail with: peer_lost (abort), peer_left (close).
  errc code = errc::peer_lost;
  /// Copies in flight that read or write this rank's buffers; `abort` waits for zero.
  std::atomic<int> copying{0};

  std::string reason() {
    std::lock_guard<std::mutex> guard{why_mtx};
    return why;
  }

  errc reason_code() {
    std::lock_guard<std::mutex> guard{why_mtx};
    return code;
  }
};

/// Everything the contexts of one group share.
///
/// Thread safety: thread-safe; the lock of a channel is never held while another lock is taken.
class group {
public:
  explicit group(int size)
      : size_(size), channels_(std::make_unique<channel[]>(static_cast<size_t>(size) * size)),
        endpoints_(std::make_unique<endpoint[]>(static_cast<size_t>(size))) {}

  int size() const noexcept { return size_; }

  endpoint& at(int rank) noexcept { return endpoints_[static_cast<size_t>(rank)]; }

  channel& between(int src, int dst) noexcept {
    return channels_[static_cast<size_t>(src) * static_cast<size_t>(size_) +
                     static_cast<size_t>(dst)];
  }

  /// Queues `op` on the channel `src -> dst`, or matches it with the oldest operation of the
  /// other kind and tag there and copies the message.
  void post(const op_ptr& op, int src, int dst) {
    auto& ch = between(src, dst);
    op_ptr send;
    op_ptr recv;
    {
      std::unique_lock<std::mutex> guard{ch.mtx};
      // Checked under the channel's mutex: `abort` sets the flag before it sweeps this channel,
      // so an operation is either swept or sees the flag.
      // A receive from a rank that left cleanly may still meet a send it made before it left
      // (kept by `leave`, as a socket's buffer keeps what was written before the goodbye).
      // Each flag is read once: `sweep` sets it without this channel's mutex, so a second read
      // could see the leaver gone where the first did not, and fail a receive that its kept
      // send would have met.
      const bool src_gone = at(src).aborted.load();
      const bool dst_gone = at(dst).aborted.load();
      const bool from_leaver =
          !op->is_send && src_gone && !dst_gone && ch.sends.count(op->tag) != 0;
      if ((src_gone || dst_gone) && !from_leaver) {
        guard.unlock();
        fail_lost(op, src_gone ? src : dst);
        return;
      }
      auto& mine = op->is_send ? ch.sends : ch.recvs;
      auto& theirs = op->is_send ? ch.recvs : ch.sends;
      auto it = theirs.find(op->tag);
      if (it == theirs.end()) {
        mine[op->tag].push_back(op);
        return;
      }
      auto other = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty())
        theirs.erase(it);
      send = op->is_send ? op : other;
      recv = op->is_send ? other : op;
      // Counted under the mutex, so an `abort` that sweeps this channel afterwards waits for
      // the copy.
      at(src).copying.fetch_add(1);
      at(dst).copying.fetch_add(1);
    }
    deliver(*send, *recv);
    release(src);
    release(dst);
  }

  /// Fails every pending operation that involves `rank` and every later one, then waits until
  /// no copy touches `rank`'s buffers.
  void abort(int rank, const std::string& why, errc code = errc::peer_lost) {
    sweep(rank, why, code, false);
  }

  /// Leaves cleanly (context::close), as a TCP rank does: what it sent before is kept for its
  /// peers (a send that no receive has met yet is copied and completes, as a write into a
  /// socket buffer does), then every other operation with `rank` fails, the peers' with
  /// peer_left and its own with shutdown. A peer's later receive still meets a kept send of its
  /// tag; one that meets none fails with peer_left. Returns at once: nothing waits on a peer.
  caf::error leave(int rank, const std::string& why, deadline /*until*/) {
    sweep(rank, why, errc::peer_left, true);
    return {};
  }

private:
  /// Marks `rank` aborted (or left), then fails every pending operation that involves it,
  /// except, when `keep_sends`, its own unmatched sends, which are copied and kept for their
  /// receivers. Then waits until no copy touches `rank`'s buffers.
  void sweep(int rank, const std::string& why, errc code, bool keep_sends) {
    auto& ep = at(rank);
    {
      std::lock_guard<std::mutex> guard{ep.why_mtx};
      if (ep.aborted.load())
        return;
      ep.why = why;
      ep.code = code;
      ep.aborted.store(true);
    }
    std::vector<op_ptr> victims;
    std::vector<op_ptr> sent;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank)
        continue;
      for (auto* ch : {&between(rank, peer), &between(peer, rank)}) {
        std::lock_guard<std::mutex> guard{ch->mtx};
        const bool keep = keep_sends && ch == &between(rank, peer);
        for (auto& [tag, ops] : ch->sends)
          for (auto& op : ops) {
            if (keep) {
              // Unmatched, so no copy reads it: copy it here, under the channel's lock.
              auto copy = std::make_shared<local_op>(true, op->self, op->peer, op->tag);
              copy->kept.resize(op->bytes());
              auto* out = copy->kept.data();
              for (const auto& part : op->parts) {
                if (!part.empty())
                  std::memcpy(out, part.data(), part.size());
                out += part.size();
              }
              copy->parts = {const_bytes{copy->kept.data(), copy->kept.size()}};
              sent.push_back(std::exchange(op, std::move(copy)));
            } else {
              victims.push_back(std::move(op));
            }
          }
        if (!keep)
          ch->sends.clear();
        for (auto& [tag, ops] : ch->recvs)
          for (auto& op : ops)
            victims.push_back(std::move(op));
        ch->recvs.clear();
      }
    }
    for (auto& op : sent)
      op->complete({});
    for (auto& op : victims)
      fail_lost(op, rank);
    for (int n = ep.copying.load(); n != 0; n = ep.copying.load())
      ep.copying.wait(n);
  }

  /// Fails `op` because `lost` (its own rank or its peer) was aborted or left.
  void fail_lost(const op_ptr& op, int lost) {
    auto code = at(lost).reason_code();
    bool left = code == errc::peer_left;
    std::string text = op->describe() + " failed: ";
    if (lost == op->self) {
      text += left ? "this rank left the group: " : "this context was aborted: ";
      if (left)
        code = errc::shutdown;
    } else {
      text += "rank " + std::to_string(lost) + (left ? " left the group: " : " was lost: ");
    }
    text += at(lost).reason();
    op->complete(make_caf_error(code, std::move(text)));
  }

  /// Copies the message of `send` into the buffer of `recv` and completes both.
  static void deliver(local_op& send, local_op& recv) {
    const size_t bytes = send.bytes();
    if (recv.at_most ? bytes > recv.into.size() : bytes != recv.into.size()) {
      recv.complete(make_caf_error(
          errc::invalid_argument,
          recv.describe() + " failed: the message has " + std::to_string(bytes) + " bytes" +
              (recv.at_most ? ", more than the buffer takes" : "") + "; it was dropped"));
      send.complete({});
      return;
    }
    recv.received = bytes;
    auto* out = recv.into.data();
    for (const auto& part : send.parts) {
      if (!part.empty())
        std::memcpy(out, part.data(), part.size());
      out += part.size();
    }
    recv.complete({});
    send.complete({});
  }

  void release(int rank) {
    auto& ep = at(rank);
    if (ep.copying.fetch_sub(1) == 1)
      ep.copying.notify_all();
  }

  int size_;
  std::unique_ptr<channel[]> channels_;
  std::unique_ptr<endpoint[]> endpoints_;
};

using group_ptr = std::shared_ptr<group>;

// -- pair and context -------------------------------------------------------------------------

/// The channel pair between this rank and one peer.
///
/// Thread safety: thread-safe.
class local_pair final : public pair {
public:
  local_pair(group_ptr grp, int self, int peer) : grp_(std::move(grp)), self_(self), peer_(peer) {}

  int peer_rank() const noexcept override { return peer_; }

  operation_ptr send(uint64_t tag, send_parts parts) override {
    auto op = std::make_shared<local_op>(true, self_, peer_, tag);
    op->parts = std::move(parts);
    grp_->post(op, self_, peer_);
    return op;
  }

  operation_ptr recv(uint64_t tag, mutable_bytes into) override {
    return post_recv(tag, into, false);
  }

  operation_ptr recv_at_most(uint64_t tag, mutable_bytes into) override {
    return post_recv(tag, into, true);
  }

private:
  operation_ptr post_recv(uint64_t tag, mutable_bytes into, bool at_most) {
    auto op = std::make_shared<local_op>(false, self_, peer_, tag);
    op->into = into;
    op->at_most = at_most;
    grp_->post(op, peer_, self_);
    return op;
  }

  group_ptr grp_;
  int self_;
  int peer_;
};

/// One rank of a local group.
///
/// Thread safety: thread-safe (the pairs are created up front and never change).
class local_context final : public context {
public:
  local_context(group_ptr grp, int rank) : grp_(std::move(grp)), rank_(rank) {
    pairs_.resize(static_cast<size_t>(grp_->size()));
    for (int peer = 0; peer < grp_->size(); ++peer)
      if (peer != rank_)
        pairs_[static_cast<size_t>(peer)] = std::make_unique<local_pair>(grp_, rank_, peer);
  }

  ~local_context() override {
    grp_->abort(rank_, "the context of rank " + std::to_string(rank_) + " was destroyed");
  }

  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return grp_->size(); }

  pair& to(int peer) override {
    if (peer < 0 || peer >= grp_->size() || peer == rank_)
      throw_error(errc::invalid_argument, "local transport: rank " + std::to_string(rank_) +
                                              " has no pair to rank " + std::to_string(peer) +
                                              " in a group of " + std::to_string(grp_->size()));
    return *pairs_[static_cast<size_t>(peer)];
  }

  void abort(const std::string& why, errc code = errc::peer_lost) override {
    grp_->abort(rank_, why, code);
  }

  caf::error close(const std::string& reason, deadline until) override {
    return grp_->leave(rank_, reason, until);
  }

private:
  group_ptr grp_;
  int rank_;
  std::vector<std::unique_ptr<local_pair>> pairs_;
};

} // namespace

std::vector<context_ptr> make_group(int size) {
  if (size < 1)
    throw_error(errc::invalid_argument,
                "local transport: a group needs at least one rank, got " + std::to_string(size));
  auto grp = std::make_shared<group>(size);
  std::vector<context_ptr> out;
  out.reserve(static_cast<size_t>(size));
  for (int rank = 0; rank < size; ++rank)
    out.push_back(std::make_shared<local_context>(grp, rank));
  return out;
}

} // namespace consort::transport::local
