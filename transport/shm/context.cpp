// The lifecycle of an shm context (shm_impl.hpp): construction (its links to the peers' rings and
// its entry in the segment), its pairs and new operations, refusing operations once it aborted or
// closed, abort, destruction (the state seen by the peers, then every operation failed),
// make_context, and whether its waits yield the core (yields_when_idle).

#include "transport/op_pool.hpp"
#include "transport/shm/shm_impl.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include <sched.h>

#include <linux/futex.h>
#include <unistd.h>

namespace consort::transport::shm::impl {

namespace {

/// Writes `why` (truncated) into `b`'s reason, which peers read when they see its state change.
void copy_reason(rank_block& b, const std::string& why) {
  auto n = std::min(why.size(), reason_bytes - 1);
  std::memcpy(b.reason, why.data(), n);
  b.reason[n] = '\0';
}

} // namespace

} // namespace consort::transport::shm::impl

namespace consort::transport::shm {

bool yields_when_idle(std::optional<bool> choice, int ranks) {
  if (choice)
    return *choice;
  if (const char* env = std::getenv("CONSORT_YIELD_WHEN_IDLE"); env && *env)
    return std::string_view{env} != "0";
  // Bound by the launcher to cores of its own: the launcher says when it had to share them.
  if (const char* bound = std::getenv("CONSORT_LAUNCH_CPUS"); bound && *bound)
    return false;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0)
    return false;
  return ranks > CPU_COUNT(&set);
}

} // namespace consort::transport::shm

namespace consort::transport::shm::impl {

shm_context::shm_context(segment_ptr seg, int rank, const options& opts)
    : seg_(std::move(seg)), rank_(rank), size_(seg_->ranks()), opts_(opts),
      yield_(yields_when_idle(opts.yield_when_idle, size_)),
      links_(static_cast<std::size_t>(size_)) {
  for (int p = 0; p < size_; ++p) {
    if (p == rank_)
      continue;
    auto& l = link(p);
    l.rank = p;
    l.out = {&seg_->control(rank_, p), seg_->ring(rank_, p), seg_->ring_bytes()};
    l.in = {&seg_->control(p, rank_), seg_->ring(p, rank_), seg_->ring_bytes()};
  }
  auto& me = seg_->block(rank_);
  auto self = status_of(static_cast<int>(getpid()));
  me.start_time.store(self.start_time, std::memory_order_relaxed);
  me.pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

shm_context::~shm_context() {
  {
    std::lock_guard<std::mutex> guard{state_mtx_};
    if (!aborted_) {
      auto& me = seg_->block(rank_);
      copy_reason(me, "its context was destroyed");
      me.code = static_cast<int32_t>(errc::peer_lost);
      me.state.store(gone, std::memory_order_release);
    }
  }
  stop_.store(true);
  ring_bell(seg_->block(rank_));
  futex(&waiters_->n, FUTEX_WAKE_PRIVATE, 1, nullptr);
  for (int p = 0; p < size_; ++p)
    if (p != rank_)
      ring_bell(seg_->block(p));
  if (progress_.joinable())
    progress_.join();
  fail_all(errc::peer_lost, "the context was destroyed");
}

pair& shm_context::to(int peer) {
  if (peer < 0 || peer >= size_ || peer == rank_)
    throw_error(errc::invalid_argument, "shm transport: rank " + std::to_string(rank_) +
                                            ": no pair to rank " + std::to_string(peer) +
                                            " in a group of " + std::to_string(size_));
  return *pairs_.at(static_cast<std::size_t>(peer));
}

void shm_context::make_pairs() {
  pairs_.resize(static_cast<std::size_t>(size_));
  for (int p = 0; p < size_; ++p)
    if (p != rank_)
      pairs_[static_cast<std::size_t>(p)] = std::make_unique<shm_pair>(*this, p);
  if (seg_->has_mailboxes())
    for (int c = 0; c < mailbox_channels; ++c)
      mailboxes_[static_cast<std::size_t>(c)] = std::make_unique<shm_mailbox>(*this, c);
}

op_ptr shm_context::new_op(bool is_send, int peer, uint64_t tag) {
  return std::allocate_shared<shm_op>(
      detail::op_allocator<shm_op>{}, weak_from_this(), seg_, waiters_, is_send, rank_, peer, tag,
      yield_ ? opts_.yield_spin : opts_.spin, opts_.liveness_interval, yield_);
}

bool shm_context::refused(errc& code, std::string& cause) {
  if (!refusing_.load(std::memory_order_acquire))
    return false;
  std::lock_guard<std::mutex> guard{state_mtx_};
  if (aborted_) {
    code = abort_code_;
    cause = "this rank aborted: " + abort_why_;
    return true;
  }
  if (closed_) {
    code = errc::shutdown;
    cause = "this rank has left the group (close was called)";
    return true;
  }
  return false;
}

bool shm_context::fail_if_refused(shm_op& op) {
  errc code{};
  std::string cause;
  if (!refused(code, cause))
    return false;
  op.fail(code, cause);
  return true;
}

void shm_context::abort(const std::string& why, errc code) {
  {
    std::lock_guard<std::mutex> guard{state_mtx_};
    if (aborted_)
      return;
    aborted_ = true;
    refusing_.store(true, std::memory_order_release);
    abort_code_ = code;
    abort_why_ = why;
    auto& me = seg_->block(rank_);
    copy_reason(me, why);
    me.code = static_cast<int32_t>(code);
    me.state.store(aborted, std::memory_order_release);
  }
  for (int p = 0; p < size_; ++p)
    if (p != rank_)
      ring_bell(seg_->block(p));
  // And this rank's: a thread asleep on a lockstep message (mailbox.cpp) has no operation that
  // fail_all would complete.
  ring_bell(seg_->block(rank_));
  fail_all(code, "this rank aborted: " + why);
}

void shm_context::fail_all(errc code, const std::string& cause) {
  for (auto& l : links_) {
    if (l.rank < 0)
      continue;
    {
      std::lock_guard<std::mutex> guard{l.in_mtx};
      for (auto& op : l.posted)
        op->fail(code, cause);
      l.posted.clear();
      if (l.current_op) {
        l.current_op->fail(code, cause);
        l.current_op.reset();
      }
    }
    std::lock_guard<std::mutex> guard{l.out_mtx};
    for (auto& op : l.out_queue)
      op->fail(code, cause);
    l.out_queue.clear();
    // A partly written message stays partial: the peer sees this rank's state first.
  }
}

std::shared_ptr<shm_context> make_context(segment_ptr seg, int rank, const options& opts) {
  auto ctx = std::make_shared<shm_context>(std::move(seg), rank, opts);
  ctx->make_pairs();
  ctx->start();
  return ctx;
}

} // namespace consort::transport::shm::impl
