#pragma once

// The readiness poller of a TCP context: one thread and one epoll set for the established
// connections (pair_impl), apart from Asio's reactor, which keeps the accepts, handshakes and
// timers.
//
// Why not Asio's reactor. Asio registers a socket for every readiness edge at once and keeps it
// registered, so each message that arrives wakes its I/O thread, even while a thread of ours is
// spinning on that very receive and reads it itself. On a machine with as many busy threads as
// cores, that wake-up preempts a spinner (ours or the peer's) for every message, and the two
// spinners of a two-worker exchange end up sharing one core, each spinning while the other
// waits for the core (`perf sched timehist`, bench/README.md "One epoll of our own"). Here a
// connection is registered one-shot, level-triggered, with only the readiness someone needs:
// reading while no thread spins on the pair, writing while bytes wait for room. Whoever changes
// what is needed re-arms it; an event disarms it until then.
//
// Thread safety: `add`, `arm` and `remove` may be called from any thread; each target's calls
// must be serialised by the caller (pair_impl holds its arm mutex). `on_ready` runs on the
// poller's thread only.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace consort::transport::tcp {

/// What the poller tells of a descriptor's readiness.
class ready_target {
public:
  /// Called on the poller's thread with the epoll events that fired (EPOLLIN, EPOLLOUT,
  /// EPOLLERR, EPOLLHUP, EPOLLRDHUP). The descriptor is disarmed until the next `arm`.
  virtual void on_ready(uint32_t events) = 0;
  /// Called on the poller's thread once the grace of a `defer` has passed.
  virtual void on_deferred() = 0;

protected:
  ~ready_target() = default;
};

/// One epoll set and its thread.
class readiness_poller {
public:
  /// Creates the epoll set and starts the thread.
  /// @throws std::system_error when the kernel refuses the epoll set, its wake-up descriptor or
  ///         the thread.
  readiness_poller();
  /// Stops the thread (stop()).
  ~readiness_poller();
  readiness_poller(const readiness_poller&) = delete;
  readiness_poller& operator=(const readiness_poller&) = delete;

  /// Registers `fd` for `events` (EPOLLIN, EPOLLOUT; one-shot), reported to `target`, which
  /// must stay alive until `remove(fd)` returned and the thread has stopped or passed its events.
  /// @returns an empty string, or why the kernel refused.
  std::string add(int fd, ready_target* target, uint32_t events);
  /// Re-arms `fd` for `events` (0 arms nothing but errors and hang-ups, once).
  /// @returns an empty string, or why the kernel refused.
  std::string arm(int fd, ready_target* target, uint32_t events);
  /// Unregisters `fd` (before it is closed).
  void remove(int fd);

  /// Calls `target->on_deferred()` once `defer_grace` (give or take a quarter) has passed since
  /// the latest `defer` of any target: a connection whose reading was left to a thread that is
  /// expected back soon (pair.hpp, reading_here) gets it back if that thread does not come. The
  /// timer is pushed forward at most every quarter grace, so a caller's steady stream of
  /// `defer`s costs a timer syscall every few calls and wakes nobody.
  void defer(ready_target* target);
  /// Forgets `target`'s pending `defer` (it was re-armed, or is going away).
  void undefer(ready_target* target);

  /// How long reading may be left to a thread that is expected back.
  static constexpr std::chrono::microseconds defer_grace{1000};

  /// Stops the thread and waits for it; events not yet dispatched are dropped. Idempotent.
  /// After it, no `on_ready` runs.
  void stop();

private:
  void run();

  void on_timer();

  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  int timer_fd_ = -1;
  std::mutex deferred_mu_;
  std::vector<ready_target*> deferred_; // guarded by deferred_mu_
  /// When the timer fires (steady clock, ns; guarded by deferred_mu_).
  int64_t timer_at_ns_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

} // namespace consort::transport::tcp
