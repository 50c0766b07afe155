// The progress of an shm context: one pass over its peers (queued sends, incoming rings, peer
// states), the progress thread that makes it when no thread waits on an operation, and what
// happens when a peer aborts, is destroyed or its process dies (its operations fail).

#include "transport/shm/shm_impl.hpp"

#include <algorithm>
#include <cstring>

#include <linux/futex.h>
#include <unistd.h>

namespace consort::transport::shm::impl {

void shm_context::lose_peer(peer_link& l, errc code, const std::string& cause) {
  l.set_failed(code, cause);
  l.fail_posted();
  if (l.current_op) {
    l.current_op->fail(l.fail_code, l.fail_cause + " (in the middle of the message)");
    l.current_op.reset();
  }
  l.reading = false;
  std::lock_guard<std::mutex> guard{l.out_mtx};
  for (auto& op : l.out_queue)
    op->fail(l.fail_code, l.fail_cause);
  l.out_queue.clear();
  l.out_offset = 0;
  // A thread asleep on the peer's lockstep message (mailbox.cpp) has no operation that failed
  // above: the doorbell wakes it to see the failure.
  ring_bell(seg_->block(rank_));
}

void shm_context::check_peer(peer_link& l) {
  if (l.failed.load(std::memory_order_acquire) && !l.goodbye)
    return;
  auto& b = seg_->block(l.rank);
  const uint32_t state = b.state.load(std::memory_order_acquire);
  if (state == live)
    return;
  read_incoming(l); // deliver what it wrote before
  std::string reason(b.reason, strnlen(b.reason, reason_bytes));
  if (l.goodbye) {
    // It left cleanly; its sends to us are over. Our sends to it fail.
    std::lock_guard<std::mutex> guard{l.out_mtx};
    for (auto& op : l.out_queue)
      op->fail(errc::peer_left, l.fail_cause);
    l.out_queue.clear();
    l.out_offset = 0;
    return;
  }
  if (state == aborted)
    lose_peer(l, static_cast<errc>(b.code),
              "rank " + std::to_string(l.rank) + " aborted: " + reason);
  else
    lose_peer(l, errc::peer_lost, "rank " + std::to_string(l.rank) + " is gone: " + reason);
}

void shm_context::check_liveness() {
  for (auto& l : links_) {
    if (l.rank < 0 || l.failed.load(std::memory_order_acquire))
      continue;
    auto& b = seg_->block(l.rank);
    const int pid = b.pid.load(std::memory_order_acquire);
    if (pid <= 0 || pid == static_cast<int>(getpid()))
      continue;
    auto s = status_of(pid);
    if (s.exists && !s.zombie && s.start_time == b.start_time.load(std::memory_order_relaxed))
      continue;
    std::lock_guard<std::mutex> guard{l.in_mtx};
    read_incoming(l);
    if (!l.goodbye)
      lose_peer(l, errc::peer_lost,
                "rank " + std::to_string(l.rank) + " (pid " + std::to_string(pid) +
                    ") died: its process " + (s.exists ? "is a zombie" : "no longer exists"));
  }
}

bool shm_context::pass() {
  bool moved = false;
  // Sends are queued only while the backlog counts them (a send written whole when posted never
  // is): without one, no link's queue needs its lock.
  const bool queued = waiters_->backlog.load(std::memory_order_seq_cst) > 0;
  for (auto& l : links_) {
    if (l.rank < 0)
      continue;
    if (queued) {
      std::lock_guard<std::mutex> guard{l.out_mtx};
      if (!l.out_queue.empty() && write_queued(l)) {
        moved = true;
        ring_bell(seg_->block(l.rank));
      }
    }
    std::lock_guard<std::mutex> guard{l.in_mtx};
    moved |= read_incoming(l);
    check_peer(l);
  }
  return moved;
}

inline void shm_context::nap_while_waiters_work(clock::time_point now, uint32_t waiting,
                                                clock::time_point& next_check) {
  // Waiters make the progress; look again when the last one leaves with sends queued, after the
  // grace, or to check liveness.
  if (now >= next_check) {
    check_liveness();
    next_check = now + opts_.liveness_interval;
  }
  auto nap = std::chrono::duration_cast<std::chrono::nanoseconds>(std::min<clock::duration>(
      next_check - now, waiting > 0 ? opts_.liveness_interval : waiter_count::grace));
  const timespec ts = to_timespec(nap);
  futex(&waiters_->n, FUTEX_WAIT_PRIVATE, waiting, &ts);
}

inline void shm_context::run_progress() {
  auto& me = seg_->block(rank_);
  auto next_check = clock::now() + opts_.liveness_interval;
  while (!stop_.load()) {
    const uint32_t w = waiters_->n.load(std::memory_order_seq_cst);
    if (waiters_->active()) {
      nap_while_waiters_work(clock::now(), w, next_check);
      continue;
    }
    const uint32_t seen = me.bell.load(std::memory_order_seq_cst);
    bool moved;
    {
      std::lock_guard<std::mutex> lock{progress_mtx_};
      moved = pass();
    }
    if (moved)
      continue;
    auto now = clock::now();
    if (now >= next_check) {
      check_liveness();
      next_check = now + opts_.liveness_interval;
    }
    sleep_on_bell(me, seen, next_check - now);
  }
}

void shm_context::start() {
  progress_ = std::thread([this] { run_progress(); });
}

} // namespace consort::transport::shm::impl
