#pragma once

// The shm transport's wake-ups: a rank's futex doorbell in the segment (ring it, sleep on it),
// the count of threads waiting on a context's operations that decides who makes progress, and
// the pause of a spinning thread. Header-only: all of it is on the hot path.

#include "transport/shm/segment.hpp"

#include <consort/transport/pair.hpp>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <ctime>
#include <memory>
#include <thread>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace consort::transport::shm::impl {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

inline long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

/// CLOCK_MONOTONIC_COARSE in nanoseconds: a tenth of a steady_clock read's cost, to a few
/// milliseconds (the tick). For what needs no more: when an operation was posted (named in its
/// timeout), and when the last waiter left (against a grace of milliseconds).
inline int64_t coarse_now_ns() noexcept {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

/// `d` as a futex timeout.
inline timespec to_timespec(std::chrono::nanoseconds d) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(d.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(d.count() % 1'000'000'000);
  return ts;
}

/// Rings the doorbell of `b`: wakes its sleepers, if any (a futex wake only when one sleeps).
inline void ring_bell(rank_block& b) {
  b.bell.fetch_add(1, std::memory_order_seq_cst);
  if (b.sleepers.load(std::memory_order_seq_cst) > 0)
    futex(&b.bell, FUTEX_WAKE, INT_MAX, nullptr);
}

/// Sleeps on the doorbell of `b` until it rings after `seen` was read, or `timeout` passes.
inline void sleep_on_bell(rank_block& b, uint32_t seen, std::chrono::nanoseconds timeout) {
  b.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (b.bell.load(std::memory_order_seq_cst) == seen && timeout.count() > 0) {
    const timespec ts = to_timespec(timeout);
    futex(&b.bell, FUTEX_WAIT, seen, &ts);
  }
  b.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

/// The threads waiting on a context's operations. While there is one, it makes the progress (it
/// polls, or sleeps on the doorbell and polls when rung), and the progress thread stays off the
/// doorbell: on two cores, a second thread woken for every message costs far more than the copy
/// (bench/README.md, "Shared memory"). The progress thread takes over when no thread has waited
/// for `grace`, or at once when sends are queued.
struct waiter_count {
  static constexpr std::chrono::milliseconds grace{5};

  std::atomic<uint32_t> n{0};
  /// Sends that are queued (did not fit into the ring when posted): the progress thread writes
  /// them when no one waits.
  std::atomic<uint32_t> backlog{0};
  /// When the last waiter left (coarse_now_ns).
  std::atomic<int64_t> last_leave{0};

  void enter() { n.fetch_add(1, std::memory_order_seq_cst); }
  void leave() {
    last_leave.store(coarse_now_ns(), std::memory_order_relaxed);
    if (n.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
        backlog.load(std::memory_order_seq_cst) > 0)
      futex(&n, FUTEX_WAKE_PRIVATE, 1, nullptr);
  }

  /// Whether waiters make the progress now: one waits, or one left less than `grace` ago and no
  /// send is queued.
  bool active() const {
    if (n.load(std::memory_order_seq_cst) > 0)
      return true;
    if (backlog.load(std::memory_order_seq_cst) > 0)
      return false;
    return coarse_now_ns() - last_leave.load(std::memory_order_relaxed) <
           std::chrono::nanoseconds{grace}.count();
  }
};

using waiter_count_ptr = std::shared_ptr<waiter_count>;

} // namespace consort::transport::shm::impl
