#include "device/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include <sched.h>

namespace consort::detail {

namespace {

/// The CPUs this process may run on (its affinity: a worker bound to one core by the launcher
/// or taskset gets no second pool thread to fight over it), at least 1.
unsigned usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0)
    return static_cast<unsigned>(std::max(1, CPU_COUNT(&set)));
  return std::max(1u, std::thread::hardware_concurrency());
}

/// The pool. Workers sleep on `cv_` between jobs; a job is one `parallel_for` call.
///
/// Thread safety: thread-safe; `mtx_` guards `generation_` and `stop_` (and orders the job's
/// publication and the increments of `active_`); `job_`, `chunks_`, `next_`, `done_` and
/// `active_` are atomics read without it. `serial_` admits one job at a time. Lock order:
/// `serial_` before `mtx_`.
class pool {
public:
  static pool& instance() {
    static pool p;
    return p;
  }

  size_t threads() const noexcept { return workers_.size() + 1; }

  void run(size_t chunks, const std::function<void(size_t)>& fn) {
    if (chunks == 0)
      return;
    if (workers_.empty() || chunks == 1) {
      for (size_t i = 0; i < chunks; ++i)
        fn(i);
      return;
    }
    std::lock_guard<std::mutex> one_job_at_a_time{serial_};
    {
      std::lock_guard<std::mutex> guard{mtx_};
      job_ = &fn;
      chunks_ = chunks;
      next_.store(0);
      done_.store(0);
      ++generation_;
    }
    cv_.notify_all();
    work();
    // Wait for chunks still running on workers; they finish in a block's time, so spin.
    while (done_.load(std::memory_order_acquire) < chunks)
      std::this_thread::yield();
    {
      std::lock_guard<std::mutex> guard{mtx_};
      job_ = nullptr;
    }
    // A worker that joined this job late may still be inside work(), between taking an index
    // past the end and comparing it with chunks_. The next job resets next_ and chunks_: that
    // worker would then run a chunk of the next job that another thread also runs, and count it
    // twice in done_, so that run() returns while a chunk still runs. No worker joins once job_
    // is null, and those that joined are awake and about to leave: wait for them.
    while (active_.load(std::memory_order_acquire) != 0)
      std::this_thread::yield();
  }

  ~pool() {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_)
      t.join();
  }

private:
  pool() {
    const auto n = usable_cpus();
    for (unsigned i = 1; i < n; ++i)
      workers_.emplace_back([this] { loop(); });
  }

  /// Takes chunks of the current job until none is left.
  void work() {
    for (;;) {
      auto i = next_.fetch_add(1);
      if (i >= chunks_.load())
        return;
      (*job_.load())(i);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    size_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> guard{mtx_};
        cv_.wait(guard, [&] { return stop_ || (generation_ != seen && job_ != nullptr); });
        if (stop_)
          return;
        seen = generation_;
        active_.fetch_add(1, std::memory_order_relaxed);
      }
      work();
      active_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::mutex serial_;
  std::mutex mtx_;
  std::condition_variable cv_;
  // Atomic because a worker of the current job reads them while it runs; run() does not publish
  // the next job before every worker has left work() (active_).
  std::atomic<const std::function<void(size_t)>*> job_{nullptr};
  std::atomic<size_t> chunks_{0};
  size_t generation_ = 0;
  bool stop_ = false;
  std::atomic<size_t> next_{0};
  std::atomic<size_t> done_{0};
  // Workers inside work(); incremented under mtx_ (see run()).
  std::atomic<size_t> active_{0};
  std::vector<std::thread> workers_;
};

} // namespace

void parallel_for(size_t chunks, const std::function<void(size_t)>& fn) {
  pool::instance().run(chunks, fn);
}

size_t parallel_threads() noexcept {
  return pool::instance().threads();
}

} // namespace consort::detail
