// Asynchronous use: futures with deadlines, continuations and Asio completion tokens.

#include <consort/asio.hpp>
#include <consort/consort.hpp>

#include <boost/asio/bind_executor.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/use_future.hpp>

#include <gtest/gtest.h>

#include <future>

namespace consort {
namespace {

using namespace std::chrono_literals;
namespace asio = boost::asio;

tensor replica_id(replica_context& ctx) {
  return tensor::scalar<int32_t>(ctx.replica_id_in_sync_group());
}

TEST(AsyncTest, RunAsyncReturnsAtOnceAndCompletesLater) {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});
  std::atomic<bool> go{false};
  auto fut = strategy.run_async([&go](replica_context& ctx) {
    while (!go.load())
      std::this_thread::yield();
    return replica_id(ctx);
  });
  EXPECT_FALSE(fut.ready()) << "run_async must not wait for the step";
  go = true;
  ASSERT_TRUE(fut.wait_for(30s));
  auto v = fut.get();
  EXPECT_EQ(v[1].item<int32_t>(), 1);
}

TEST(AsyncTest, GetForThrowsWaitTimeoutWhileTheStepGoesOn) {
  mirrored_strategy strategy({"CPU:0"});
  std::atomic<bool> go{false};
  auto fut = strategy.run_async([&go](replica_context& ctx) {
    while (!go.load())
      std::this_thread::yield();
    return replica_id(ctx);
  });
  try {
    fut.get_for(1ms);
    ADD_FAILURE() << "expected wait_timeout";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::wait_timeout);
  }
  go = true;
  EXPECT_EQ(fut.get()[0].item<int32_t>(), 0);
}

TEST(AsyncTest, ThenChainsAndCarriesErrors) {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});
  auto total = strategy.run_async(replica_id).then([&](per_replica<tensor> v) {
    return strategy.reduce("SUM", v, std::nullopt).item<int32_t>();
  });
  EXPECT_EQ(total.get(), 1);
  auto failed =
      strategy.run_async([](replica_context&) -> tensor { throw std::runtime_error("x"); })
          .then([](per_replica<tensor>) { return 1; });
  try {
    failed.get();
    ADD_FAILURE() << "expected step_failed";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::step_failed);
  }
}

TEST(AsyncTest, ReduceAndGatherAsyncRunOnTheEngine) {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});
  per_replica<tensor> v({tensor::from<float>({0, 1, 2, 3}), tensor::from<float>({4, 5})});
  EXPECT_FLOAT_EQ(strategy.reduce_async("MEAN", v, 0).get().item<float>(), 2.5f);
  EXPECT_EQ(strategy.gather_async(v, 0).get().num_elements(), 6);
  try {
    strategy.reduce_async("SUM", v, std::nullopt).get();
    ADD_FAILURE() << "expected shape_mismatch";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::shape_mismatch);
  }
}

TEST(AsyncTest, AsioCallbackTokenGetsErrorOrValue) {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});
  asio::io_context io;
  auto work = asio::make_work_guard(io); // keeps run() going until the handler has run
  int got = -1;
  std::thread::id ran_on;
  async_get(strategy.run_async(replica_id),
            asio::bind_executor(io, [&](std::exception_ptr ep, per_replica<tensor> v) {
              EXPECT_FALSE(ep);
              got = v[1].item<int32_t>();
              ran_on = std::this_thread::get_id();
              work.reset();
            }));
  io.run();
  EXPECT_TRUE(ran_on == std::this_thread::get_id()) << "the handler must run on its executor";
  EXPECT_EQ(got, 1);
}

TEST(AsyncTest, AsioUseFutureGivesAStdFuture) {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});
  std::future<per_replica<tensor>> f = async_get(strategy.run_async(replica_id), asio::use_future);
  ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(f.get()[0].item<int32_t>(), 0);
  auto bad = async_get(
      strategy.run_async([](replica_context&) -> tensor { throw std::runtime_error("nope"); }),
      asio::use_future);
  ASSERT_EQ(bad.wait_for(30s), std::future_status::ready);
  EXPECT_THROW(bad.get(), error);
}

TEST(AsyncTest, AsioUseAwaitableWorksInACoroutine) {
  mirrored_strategy strategy({"CPU:0", "CPU:1", "CPU:2"});
  asio::io_context io;
  int sum = -1;
  errc failure = errc::none;
  auto work = asio::make_work_guard(io);
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        auto v = co_await async_get(strategy.run_async(replica_id), asio::use_awaitable);
        sum = strategy.reduce("SUM", v, std::nullopt).item<int32_t>();
        try {
          co_await async_get(strategy.run_async([](replica_context& ctx) {
            return ctx.all_gather(tensor::scalar<float>(1), 0);
          }),
                             asio::use_awaitable);
        } catch (const error& e) {
          failure = e.code();
        }
        work.reset();
      },
      asio::detached);
  io.run();
  EXPECT_EQ(sum, 3);
  EXPECT_EQ(failure, errc::invalid_argument);
}

TEST(AsyncTest, ShutdownFailsOutstandingFutures) {
  auto strategy = std::make_unique<mirrored_strategy>(std::vector<std::string>{"CPU:0"});
  std::atomic<bool> go{false};
  auto first = strategy->run_async([&go](replica_context& ctx) {
    while (!go.load())
      std::this_thread::yield();
    return replica_id(ctx);
  });
  auto queued = strategy->run_async(replica_id);
  std::thread releaser([&] {
    // Shutdown waits for the running step; let it finish once shutdown has failed the futures.
    queued.wait();
    go = true;
  });
  strategy->shutdown();
  releaser.join();
  try {
    queued.get();
    ADD_FAILURE() << "expected shutdown";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::shutdown);
  }
}

} // namespace
} // namespace consort
