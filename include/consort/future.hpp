#pragma once

#include <consort/error.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

namespace consort {

namespace detail {

/// A move-only `void(std::exception_ptr, T)` callable (std::function needs copyable targets, and
/// Asio's handlers are move-only).
template <class T>
class completion_fn {
public:
  completion_fn() = default;
  template <class F>
  explicit completion_fn(F&& f)
      : impl_(std::make_unique<model<std::decay_t<F>>>(std::forward<F>(f))) {}
  explicit operator bool() const noexcept { return impl_ != nullptr; }
  void operator()(std::exception_ptr ep, T* value) { impl_->call(ep, value); }

private:
  struct concept_t {
    virtual ~concept_t() = default;
    virtual void call(std::exception_ptr ep, T* value) = 0;
  };
  template <class F>
  struct model final : concept_t {
    explicit model(F f) : fn(std::move(f)) {}
    void call(std::exception_ptr ep, T* value) override {
      if (ep)
        fn(ep, T{});
      else
        fn(nullptr, std::move(*value));
    }
    F fn;
  };
  std::unique_ptr<concept_t> impl_;
};

/// What the engine needs of any future state to fail it at shutdown, whatever its value type.
class shared_state_base {
public:
  virtual ~shared_state_base() = default;
  virtual bool done() const noexcept = 0;
  virtual void fail(std::exception_ptr ep) = 0;
};

/// The state shared by a `future` and the engine side that completes it.
/// Thread safety: thread-safe; `mtx_` guards every member but `ready_`, which is also written
/// under `mtx_` and read without it to spin briefly before blocking.
template <class T>
class shared_state final : public shared_state_base {
public:
  void set_value(T value) {
    complete([&] { value_.emplace(std::move(value)); });
  }
  void set_error(std::exception_ptr ep) {
    complete([&] { error_ = std::move(ep); });
  }
  void set_error(errc code, const std::string& message) {
    set_error(std::make_exception_ptr(error(code, message)));
  }

  bool ready() const noexcept { return ready_.load(std::memory_order_acquire); }
  bool done() const noexcept override { return ready(); }
  void fail(std::exception_ptr ep) override { set_error(std::move(ep)); }

  /// Waits until ready or `deadline`; spins for `spin` first, because the engine often answers
  /// quickly and a condition-variable wake-up costs tens of microseconds here. Then, for
  /// `yield_for`, it keeps polling but yields its core between polls (a peer that is about to
  /// answer and shares the core gets it), and only then blocks.
  bool wait_until(std::chrono::steady_clock::time_point deadline,
                  std::chrono::microseconds spin = std::chrono::microseconds(20),
                  std::chrono::microseconds yield_for = std::chrono::microseconds(0)) {
    auto now = std::chrono::steady_clock::now();
    auto spin_end = std::min(deadline, now + spin);
    while (!ready() && std::chrono::steady_clock::now() < spin_end) {
    }
    auto yield_end = std::min(deadline, now + spin + yield_for);
    while (!ready() && std::chrono::steady_clock::now() < yield_end)
      std::this_thread::yield();
    if (ready())
      return true;
    std::unique_lock<std::mutex> guard{mtx_};
    return cv_.wait_until(guard, deadline, [this] { return ready(); });
  }

  /// Moves the result out. @pre ready()
  T take() {
    std::unique_lock<std::mutex> guard{mtx_};
    if (error_)
      std::rethrow_exception(error_);
    return std::move(*value_);
  }

  /// Calls `fn` once with the result: now if it is there, else on the completing thread.
  void on_complete(completion_fn<T> fn) {
    std::unique_lock<std::mutex> guard{mtx_};
    if (!ready()) {
      continuation_ = std::move(fn);
      return;
    }
    guard.unlock();
    fn(error_, value_ ? &*value_ : nullptr);
  }

private:
  /// Stores the outcome with `assign` (under the lock) unless one is already there, then wakes
  /// waiters and runs the continuation.
  template <class Assign>
  void complete(Assign&& assign) {
    completion_fn<T> cont;
    {
      std::lock_guard<std::mutex> guard{mtx_};
      if (ready())
        return; // first completion wins; later ones (e.g. a late timeout) are dropped
      assign();
      ready_.store(true, std::memory_order_release);
      cont = std::move(continuation_);
    }
    cv_.notify_all();
    if (cont)
      cont(error_, value_ ? &*value_ : nullptr);
  }

  mutable std::mutex mtx_;
  std::condition_variable cv_;
  std::atomic<bool> ready_{false};
  std::exception_ptr error_;
  std::optional<T> value_;
  completion_fn<T> continuation_;
};

} // namespace detail

/// The result of an asynchronous consort call. Wait with a deadline (`wait_for`), block for the
/// value (`get`), attach a continuation (`then`, `on_complete`), or use Asio completion tokens
/// through `consort::async_get` (include <consort/asio.hpp>).
///
/// A future is single-consumer: call exactly one of `get`, `then` or `on_complete`. Continuations
/// run on the engine thread that completes the operation, so they must not block; post heavy work
/// elsewhere (`async_get` with an executor does that for you).
template <class T>
class future {
public:
  using value_type = T;

  future() = default;
  explicit future(std::shared_ptr<detail::shared_state<T>> state) : state_(std::move(state)) {}

  bool valid() const noexcept { return state_ != nullptr; }
  bool ready() const noexcept { return state_ && state_->ready(); }

  /// Waits up to `timeout`; returns whether the result is there.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) const {
    return state_->wait_until(std::chrono::steady_clock::now() + timeout);
  }

  /// Waits without a deadline of its own: the engine's deadlines (collective and step timeouts)
  /// bound it.
  void wait() const {
    while (!state_->wait_until(std::chrono::steady_clock::now() + std::chrono::hours(1))) {
    }
  }

  /// Blocks for the value. @throws consort::error carried by the operation.
  T get() {
    wait();
    return state_->take();
  }

  /// Blocks at most `timeout` for the value.
  /// @throws error(wait_timeout) when it is not there in time (the operation goes on).
  template <class Rep, class Period>
  T get_for(std::chrono::duration<Rep, Period> timeout) {
    if (!wait_for(timeout))
      throw_error(errc::wait_timeout,
                  "the result was not ready within the wait's deadline of " +
                      std::to_string(
                          std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()) +
                      " ms; the operation is still running");
    return state_->take();
  }

  /// Calls `fn(std::exception_ptr, T)` once: the pointer is null on success.
  template <class F>
  void on_complete(F&& fn) {
    state_->on_complete(detail::completion_fn<T>(std::forward<F>(fn)));
  }

  /// Returns a future of `fn(T)`; an error skips `fn` and carries over, and an exception thrown by
  /// `fn` becomes the new future's error.
  template <class F>
  auto then(F&& fn) -> future<std::invoke_result_t<F, T>> {
    using U = std::invoke_result_t<F, T>;
    auto next = std::make_shared<detail::shared_state<U>>();
    on_complete([next, f = std::forward<F>(fn)](std::exception_ptr ep, T value) mutable {
      if (ep) {
        next->set_error(ep);
        return;
      }
      try {
        next->set_value(f(std::move(value)));
      } catch (...) {
        next->set_error(std::current_exception());
      }
    });
    return future<U>{std::move(next)};
  }

private:
  std::shared_ptr<detail::shared_state<T>> state_;
};

/// A promise/future pair: the engine keeps the state, the caller the future.
template <class T>
std::pair<std::shared_ptr<detail::shared_state<T>>, future<T>> make_future() {
  auto state = std::make_shared<detail::shared_state<T>>();
  return {state, future<T>{state}};
}

} // namespace consort
