// The readiness poller (poller.hpp).

#include "transport/tcp/poller.hpp"

#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

namespace consort::transport::tcp {

namespace {

std::string errno_text(int err) {
  return std::error_code(err, std::system_category()).message();
}

epoll_event event_for(ready_target* target, uint32_t events) {
  epoll_event ev{};
  // Level-triggered and one-shot: re-arming a descriptor that is already ready reports it at
  // once, so a readiness that came while it was disarmed is never lost.
  ev.events = events | EPOLLRDHUP | EPOLLONESHOT;
  ev.data.ptr = target;
  return ev;
}

} // namespace

readiness_poller::readiness_poller() {
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0)
    throw std::system_error(errno, std::system_category(), "epoll_create1");
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    const int err = errno;
    ::close(epoll_fd_);
    throw std::system_error(err, std::system_category(), "eventfd");
  }
  timer_fd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  auto give_up = [this](const char* what) {
    const int err = errno;
    if (timer_fd_ >= 0)
      ::close(timer_fd_);
    ::close(wake_fd_);
    ::close(epoll_fd_);
    throw std::system_error(err, std::system_category(), what);
  };
  if (timer_fd_ < 0)
    give_up("timerfd_create");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr; // the wake-up descriptor
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0)
    give_up("epoll_ctl(ADD eventfd)");
  ev.data.ptr = &timer_fd_; // the defer timer
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, timer_fd_, &ev) != 0)
    give_up("epoll_ctl(ADD timerfd)");
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    ::close(timer_fd_);
    ::close(wake_fd_);
    ::close(epoll_fd_);
    throw;
  }
}

readiness_poller::~readiness_poller() {
  stop();
  ::close(timer_fd_);
  ::close(wake_fd_);
  ::close(epoll_fd_);
}

std::string readiness_poller::add(int fd, ready_target* target, uint32_t events) {
  auto ev = event_for(target, events);
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0)
    return "epoll_ctl(ADD): " + errno_text(errno);
  return {};
}

std::string readiness_poller::arm(int fd, ready_target* target, uint32_t events) {
  auto ev = event_for(target, events);
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &ev) != 0)
    return "epoll_ctl(MOD): " + errno_text(errno);
  return {};
}

void readiness_poller::remove(int fd) {
  epoll_event ev{}; // ignored, but kernels before 2.6.9 wanted one
  (void)::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, &ev);
}

void readiness_poller::defer(ready_target* target) {
  const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::steady_clock::now().time_since_epoch())
                       .count();
  const int64_t grace = std::chrono::nanoseconds(defer_grace).count();
  std::lock_guard lock(deferred_mu_);
  if (std::find(deferred_.begin(), deferred_.end(), target) == deferred_.end())
    deferred_.push_back(target);
  if (timer_at_ns_ - now >= grace - grace / 4)
    return; // fires late enough already
  itimerspec spec{};
  spec.it_value.tv_sec = static_cast<time_t>(grace / 1000000000);
  spec.it_value.tv_nsec = static_cast<long>(grace % 1000000000);
  if (::timerfd_settime(timer_fd_, 0, &spec, nullptr) == 0)
    timer_at_ns_ = now + grace;
  // A refused timer (it cannot be: the descriptor is ours) leaves the target to its next arm.
}

void readiness_poller::undefer(ready_target* target) {
  std::lock_guard lock(deferred_mu_);
  deferred_.erase(std::remove(deferred_.begin(), deferred_.end(), target), deferred_.end());
}

void readiness_poller::on_timer() {
  uint64_t expirations = 0;
  (void)!::read(timer_fd_, &expirations, sizeof(expirations));
  std::vector<ready_target*> due;
  {
    std::lock_guard lock(deferred_mu_);
    const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now().time_since_epoch())
                         .count();
    if (timer_at_ns_ > now) {
      // Pushed forward since it was armed for this expiry: wait for the new time.
      itimerspec spec{};
      const int64_t left = timer_at_ns_ - now;
      spec.it_value.tv_sec = static_cast<time_t>(left / 1000000000);
      spec.it_value.tv_nsec = static_cast<long>(left % 1000000000);
      if (::timerfd_settime(timer_fd_, 0, &spec, nullptr) == 0)
        return;
    }
    due.swap(deferred_);
  }
  // Outside deferred_mu_: a target takes its own lock, under which it may call defer.
  for (auto* target : due)
    target->on_deferred();
}

void readiness_poller::stop() {
  if (stopping_.exchange(true))
    return;
  const uint64_t one = 1;
  // A full counter (it cannot be: one write) would still leave the descriptor readable.
  (void)!::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id())
    thread_.join();
  else if (thread_.joinable())
    thread_.detach();
}

void readiness_poller::run() {
  // Named for `top -H`, perf and gdb (15 characters at most).
  (void)::pthread_setname_np(::pthread_self(), "consort-poll");
  constexpr int max_events = 64;
  epoll_event events[max_events];
  while (!stopping_.load(std::memory_order_acquire)) {
    const int n = ::epoll_wait(epoll_fd_, events, max_events, -1);
    if (n < 0) {
      if (errno == EINTR)
        continue;
      return; // EBADF/EINVAL: the set is gone; nothing can be polled any more
    }
    for (int i = 0; i < n; ++i) {
      if (stopping_.load(std::memory_order_acquire))
        return;
      if (events[i].data.ptr == &timer_fd_)
        on_timer();
      else if (auto* target = static_cast<ready_target*>(events[i].data.ptr))
        target->on_ready(events[i].events);
    }
  }
}

} // namespace consort::transport::tcp
