// async_service: serving requests without blocking on the strategy. A small scoring service turns
// each request into one step with `run_async` and maps the per-replica result to a number with
// `future::then`, so it never blocks a thread. Callers choose how to wait:
// - a thread waits with a deadline (`wait_for`); a step still running at the deadline goes on,
//   and the caller may wait again or give up (`get_for` throws error(wait_timeout) instead);
// - a C++20 coroutine on a boost::asio::io_context awaits the result with
//   `consort::async_get(future, boost::asio::use_awaitable)`; an error of the step is thrown at
//   the co_await.
//
// Usage:
//   ./build/examples/async_service
//
// Expected output:
//   thread: score(2) = 10 (ready within the 5 s deadline)
//   thread: held request ready after 50 ms? no, still running
//   thread: released, held request = 1
//   coroutine: score(1) = 5
//   coroutine: score(3) = 15
//   coroutine: score(-1) failed with step_failed
//     replica <...> failed step 4: score: the input must be >= 0, got -1
//   io_context done after 3 requests

#include <consort/asio.hpp> // first: it includes <utility> before Asio, which Boost 1.74 needs
#include <consort/consort.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>

using namespace consort;
using namespace std::chrono_literals;
namespace asio = boost::asio;

namespace {

/// Scores an input with a model sharded over the replicas: replica i holds the weight i + 2 and
/// the score is the sum over replicas of weight * input (all_reduce inside the step).
///
/// Thread safety: thread-safe, like the strategy it uses.
class scoring_service {
public:
  explicit scoring_service(strategy& s) : strategy_(&s) {}

  /// Starts scoring `input`; never blocks. The future fails with error(step_failed) for a
  /// negative input.
  future<double> score(float input) {
    return strategy_
        ->run_async(
            [](replica_context& ctx, const tensor& x) {
              float v = x.item<float>();
              if (v < 0)
                throw std::invalid_argument("score: the input must be >= 0, got " +
                                            std::to_string(static_cast<int>(v)));
              float weight = static_cast<float>(ctx.replica_id_in_sync_group() + 2);
              return ctx.all_reduce("SUM", tensor::scalar<float>(weight * v));
            },
            tensor::scalar<float>(input))
        // Runs on the engine thread that completes the step: cheap, and it must not block.
        .then([](per_replica<tensor> v) { return static_cast<double>(v[0].item<float>()); });
  }

private:
  strategy* strategy_;
};

} // namespace

int main() {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});
  scoring_service service{strategy};

  // -- a thread with a deadline -------------------------------------------------------------------
  future<double> answer = service.score(2);
  if (!answer.wait_for(5s)) {
    std::cout << "thread: no answer within 5 s\n";
    return 1;
  }
  std::cout << "thread: score(2) = " << answer.get() << " (ready within the 5 s deadline)\n";

  // A step that cannot finish until we release it: the deadline passes, the step goes on.
  std::atomic<bool> release{false};
  auto held_step = [&release](replica_context& ctx) {
    while (!release.load())
      std::this_thread::sleep_for(1ms);
    return ctx.all_reduce("MAX", tensor::scalar<int32_t>(ctx.replica_id_in_sync_group()));
  };
  future<int32_t> held = strategy.run_async(held_step).then(
      [](per_replica<tensor> v) { return v[0].item<int32_t>(); });
  std::cout << "thread: held request ready after 50 ms? "
            << (held.wait_for(50ms) ? "yes (unexpected)" : "no, still running") << '\n';
  release = true;
  std::cout << "thread: released, held request = " << held.get_for(5s) << '\n';

  // -- a coroutine on an io_context ---------------------------------------------------------------
  asio::io_context io;
  // async_get's pending operation is not io_context work: keep run() going until the coroutine
  // has finished.
  auto work = asio::make_work_guard(io);
  int handled = 0;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        for (float input : {1.0f, 3.0f, -1.0f}) {
          try {
            double s = co_await async_get(service.score(input), asio::use_awaitable);
            std::cout << "coroutine: score(" << input << ") = " << s << '\n';
          } catch (const error& e) {
            std::cout << "coroutine: score(" << input << ") failed with " << to_string(e.code())
                      << "\n  " << e.what() << '\n';
          }
          ++handled;
        }
        work.reset();
      },
      asio::detached);
  io.run();
  std::cout << "io_context done after " << handled << " requests\n";
  return handled == 3 ? 0 : 1;
}
