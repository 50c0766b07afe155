// Strategy.run / reduce / gather / distribute_dataset through the public API, on real replica
// threads. Nothing here sleeps: every wait is on a future with a deadline.

#include <consort/config.hpp>
#include <consort/consort.hpp>

#include "device/gpu.hpp"
#include "support/expect_error.hpp"
#include "support/strategy_helpers.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace consort {
namespace {

using namespace std::chrono_literals;

using test::cpus;
using test::expect_error;

TEST(StrategyTest, ReduceOfReplicaIdsIsTheirSum) {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});
  auto ids = strategy.run(
      [](replica_context& ctx) { return tensor::scalar<int32_t>(ctx.replica_id_in_sync_group()); });
  static_assert(std::is_same_v<decltype(ids), per_replica<tensor>>);
  tensor total = strategy.reduce("SUM", ids, std::nullopt);
  EXPECT_EQ(total.dtype(), dtype::int32);
  EXPECT_TRUE(total.shape().empty());
  EXPECT_EQ(total.item<int32_t>(), 1);
}

class StrategyReplicaCountTest : public ::testing::TestWithParam<int> {};

TEST_P(StrategyReplicaCountTest, ReplicaIdsDevicesAndCountsAreConsistent) {
  int n = GetParam();
  mirrored_strategy strategy(cpus(n));
  EXPECT_EQ(strategy.num_replicas_in_sync(), n);
  auto out = strategy.run([](replica_context& ctx) {
    return nest::dict({{"id", tensor::scalar<int32_t>(ctx.replica_id_in_sync_group())},
                       {"n", tensor::scalar<int32_t>(ctx.num_replicas_in_sync())},
                       {"dev", tensor::scalar<int32_t>(parse_device(ctx.device()).index)}});
  });
  ASSERT_EQ(out.size(), static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const auto& v = out[static_cast<size_t>(i)];
    EXPECT_EQ(v["id"].as_tensor().item<int32_t>(), i);
    EXPECT_EQ(v["n"].as_tensor().item<int32_t>(), n);
    EXPECT_EQ(v["dev"].as_tensor().item<int32_t>(), i);
  }
  auto sum = strategy.reduce("sum", strategy.run([](replica_context& ctx) {
    return ctx.all_reduce("SUM", tensor::scalar<int64_t>(ctx.replica_id_in_sync_group() + 1));
  }),
                             std::nullopt);
  EXPECT_EQ(sum.item<int64_t>(), static_cast<int64_t>(n) * n * (n + 1) / 2);
}

INSTANTIATE_TEST_SUITE_P(OneToEight, StrategyReplicaCountTest, ::testing::Range(1, 9));

TEST(StrategyTest, ReduceWithAxisNoneVersusZeroOnAGlobalBatch) {
  mirrored_strategy strategy(cpus(2));
  auto ds = dataset::from_tensor_slices(tensor::from<float>({0, 1, 2, 3, 4, 5, 6, 7})).batch(8);
  auto dist = strategy.distribute_dataset(ds);
  ASSERT_EQ(dist.cardinality(), 1);
  auto batch = *dist.begin();
  auto v = strategy.run([](replica_context&, const nest& x) { return x.as_tensor(); }, batch);
  auto none = strategy.reduce("SUM", v, std::nullopt);
  EXPECT_EQ(none.to_vector<float>(), (std::vector<float>{4, 6, 8, 10}));
  auto zero = strategy.reduce("SUM", v, 0);
  EXPECT_EQ(zero.shape(), shape_t{});
  EXPECT_FLOAT_EQ(zero.item<float>(), 28);
  auto mean0 = strategy.reduce("MEAN", v, 0);
  EXPECT_FLOAT_EQ(mean0.item<float>(), 3.5f);
}

TEST(StrategyTest, MeanOverAPartialBatchDividesByTheTrueCount) {
  mirrored_strategy strategy(cpus(2));
  per_replica<tensor> v({tensor::from<float>({0, 1, 2, 3}), tensor::from<float>({4, 5})});
  EXPECT_FLOAT_EQ(strategy.reduce("MEAN", v, 0).item<float>(), 2.5f);
}

TEST(StrategyTest, EmptyReplicaBatchAddsNothingToMean) {
  mirrored_strategy strategy(cpus(3));
  per_replica<tensor> v(
      {tensor::from<float>({1, 2}), tensor::from<float>({3}), tensor::zeros(dtype::float32, {0})});
  auto mean = strategy.reduce("MEAN", v, 0);
  EXPECT_FLOAT_EQ(mean.item<float>(), 2.0f);
}

TEST(StrategyTest, IntegerMeanIsNotTruncated) {
  mirrored_strategy strategy(cpus(2));
  per_replica<tensor> v({tensor::scalar<int32_t>(1), tensor::scalar<int32_t>(2)});
  auto mean = strategy.reduce("MEAN", v, std::nullopt);
  EXPECT_EQ(mean.dtype(), dtype::float64);
  EXPECT_DOUBLE_EQ(mean.item<double>(), 1.5);
  auto sum = strategy.reduce("SUM", v, std::nullopt);
  EXPECT_EQ(sum.dtype(), dtype::int32);
}

TEST(StrategyTest, ReduceOfMismatchedShapesAcrossReplicasIsAnError) {
  mirrored_strategy strategy(cpus(2));
  per_replica<tensor> v({tensor::from<float>({1, 2}), tensor::from<float>({1, 2, 3})});
  expect_error(errc::shape_mismatch, "[3]", [&] { strategy.reduce("SUM", v, std::nullopt); });
}

TEST(StrategyTest, UnknownReduceOpListsTheValidOnes) {
  mirrored_strategy strategy(cpus(2));
  per_replica<tensor> v({tensor::scalar<float>(1), tensor::scalar<float>(2)});
  expect_error(errc::unknown_reduce_op, "MEAN", [&] { strategy.reduce("AVG", v, std::nullopt); });
}

TEST(StrategyTest, PlainValuesUnderEachStrategy) {
  auto value = tensor::from<float>({1, 2, 3});
  one_device_strategy one("CPU:0");
  EXPECT_EQ(one.reduce("SUM", value, std::nullopt), value);
  EXPECT_FLOAT_EQ(one.reduce("SUM", value, 0).item<float>(), 6);
  EXPECT_EQ(one.gather(value, 0), value);
  default_strategy def;
  EXPECT_EQ(def.reduce("SUM", value, std::nullopt), value);
  mirrored_strategy mirrored(cpus(2));
  EXPECT_EQ(mirrored.reduce("MEAN", value, std::nullopt), value);
  expect_error(errc::unsupported, "ambiguous",
               [&] { mirrored.reduce("SUM", value, std::nullopt); });
}

TEST(StrategyTest, GatherConcatenatesRaggedComponentsInReplicaOrder) {
  mirrored_strategy strategy(cpus(3));
  per_replica<tensor> v({tensor::from<int32_t>({1, 2}, {1, 2}), tensor::from<int32_t>({}, {0, 2}),
                         tensor::from<int32_t>({3, 4, 5, 6}, {2, 2})});
  auto g = strategy.gather(v, 0);
  EXPECT_EQ(g.shape(), (shape_t{3, 2}));
  EXPECT_EQ(g.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  expect_error(errc::shape_mismatch, "", [&] { strategy.gather(v, 1); });
  per_replica<tensor> scalars(
      {tensor::scalar<int32_t>(1), tensor::scalar<int32_t>(2), tensor::scalar<int32_t>(3)});
  expect_error(errc::invalid_argument, "rank", [&] { strategy.gather(scalars, 0); });
}

TEST(StrategyTest, PerReplicaArgumentsAreUnwrappedAndPlainOnesShared) {
  mirrored_strategy strategy(cpus(3));
  auto xs = strategy.distribute_values([](int id) { return tensor::scalar<int32_t>(id * 100); });
  auto shared = tensor::scalar<int32_t>(7);
  auto out = strategy.run(
      [](replica_context&, const tensor& mine, const tensor& common) {
        return tensor::scalar<int32_t>(mine.item<int32_t>() + common.item<int32_t>());
      },
      xs, shared);
  EXPECT_EQ(out[0].item<int32_t>(), 7);
  EXPECT_EQ(out[1].item<int32_t>(), 107);
  EXPECT_EQ(out[2].item<int32_t>(), 207);
  per_replica<tensor> wrong({tensor::scalar<int32_t>(1)});
  expect_error(errc::invalid_argument, "3 local replicas",
               [&] { strategy.run([](replica_context&, const tensor& t) { return t; }, wrong); });
}

TEST(StrategyTest, StepsReturningNestsKeepTheirStructure) {
  mirrored_strategy strategy(cpus(2));
  auto out = strategy.run([](replica_context& ctx) {
    auto id = static_cast<float>(ctx.replica_id_in_sync_group());
    return nest::dict({{"loss", tensor::scalar<float>(id)},
                       {"grads", nest::list({tensor::from<float>({id, id}), tensor::scalar(id)})}});
  });
  auto total = strategy.reduce("SUM", out, std::nullopt);
  EXPECT_FLOAT_EQ(total["loss"].as_tensor().item<float>(), 1);
  EXPECT_EQ(total["grads"][0].as_tensor().to_vector<float>(), (std::vector<float>{1, 1}));
}

TEST(StrategyTest, AFailingStepLeavesTheNextStepWorking) {
  mirrored_strategy strategy(cpus(2));
  expect_error(errc::step_failed, "replica 0 (CPU:0) failed step 0: nope", [&] {
    strategy.run([](replica_context& ctx) -> tensor {
      if (ctx.replica_id_in_sync_group() == 0)
        throw std::invalid_argument("nope");
      return tensor::scalar<float>(1);
    });
  });
  auto ok = strategy.run(
      [](replica_context& ctx) { return ctx.all_reduce("SUM", tensor::scalar<float>(1)); });
  EXPECT_FLOAT_EQ(ok[0].item<float>(), 2);
}

TEST(StrategyTest, StepThatNeverFinishesFailsAtTheStepDeadline) {
  strategy_options opts;
  // Long enough for replica 0's trivial step to finish first on a loaded 2-core machine under a
  // sanitizer while replica 1 spins (at 200 ms it sometimes did not, and both were named).
  opts.step_timeout = 1s;
  mirrored_strategy strategy(cpus(2), opts);
  std::atomic<bool> release{false};
  auto fut = strategy.run_async([&release](replica_context& ctx) {
    if (ctx.replica_id_in_sync_group() == 1)
      while (!release.load())
        std::this_thread::yield(); // stands in for a step stuck in user code
    return tensor::scalar<float>(1);
  });
  ASSERT_TRUE(fut.wait_for(30s)) << "the step deadline did not fire";
  release = true; // let the replica go so that shutdown can finish
  expect_error(errc::step_timeout, "on replica(s) 1", [&] { fut.get(); });
}

TEST(StrategyTest, ALoneCpuReplicasRunRunsOnTheCallersThreadUnlessTurnedOff) {
  auto thread_of_step = [](strategy& s) {
    std::thread::id ran_on;
    s.run([&ran_on](replica_context& ctx) {
      ran_on = std::this_thread::get_id();
      return ctx.all_reduce("SUM", tensor::scalar<float>(1));
    });
    return ran_on;
  };
  const auto here = std::this_thread::get_id();
  one_device_strategy lone("CPU:0");
  EXPECT_EQ(thread_of_step(lone), here);
  // run_async never blocks the caller, so its step runs on the replica's thread.
  std::thread::id async_on;
  lone.run_async([&async_on](replica_context&) {
        async_on = std::this_thread::get_id();
        return tensor::scalar<float>(1);
      })
      .get();
  EXPECT_NE(async_on, here);
  strategy_options off;
  off.run_on_caller_thread = false;
  one_device_strategy turned_off("CPU:0", off);
  EXPECT_NE(thread_of_step(turned_off), here);
  mirrored_strategy two(cpus(2));
  EXPECT_NE(thread_of_step(two), here);
}

TEST(StrategyTest, StepsOnTheCallersThreadAreNumberedAndFailAsOnTheReplicasThread) {
  one_device_strategy lone("CPU:0");
  auto step_of = [](replica_context& ctx) {
    return tensor::scalar<int64_t>(static_cast<int64_t>(ctx.step()));
  };
  auto async = lone.run_async(step_of);
  auto blocking = lone.run(step_of);
  EXPECT_EQ(async.get()[0].item<int64_t>(), 0);
  EXPECT_EQ(blocking[0].item<int64_t>(), 1);
  expect_error(errc::step_failed, "replica 0 (CPU:0) failed step 2: bad batch", [&] {
    lone.run([](replica_context&) -> tensor { throw std::runtime_error("bad batch"); });
  });
  expect_error(errc::invalid_argument, "inside a step", [&] {
    lone.run([&lone](replica_context&) {
      lone.run([](replica_context&) { return tensor::scalar<float>(1); });
      return tensor::scalar<float>(1);
    });
  });
  EXPECT_EQ(lone.run(step_of)[0].item<int64_t>(), 4);
}

TEST(StrategyTest, AStepOnTheCallersThreadPastItsDeadlineFailsWhenItReturns) {
  strategy_options opts;
  opts.step_timeout = 10ms;
  one_device_strategy lone("CPU:0", opts);
  const auto start = std::chrono::steady_clock::now();
  expect_error(errc::step_timeout, "step 0 did not finish within the step deadline of 10 ms", [&] {
    lone.run([start](replica_context&) {
      while (std::chrono::steady_clock::now() < start + 1s)
        std::this_thread::yield(); // stands in for a step's long computation
      return tensor::scalar<float>(1);
    });
  });
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1s) << "the caller's thread ran the step";
  EXPECT_FLOAT_EQ(
      lone.run([](replica_context&) { return tensor::scalar<float>(2); })[0].item<float>(), 2);
}

TEST(StrategyTest, InvalidDevicesAreClearErrors) {
  expect_error(errc::unknown_device, "TPU:0", [] { mirrored_strategy s({"CPU:0", "TPU:0"}); });
#if CONSORT_WITH_CUDA
  expect_error(errc::unknown_device, "GPU:999", [] { mirrored_strategy s({"GPU:999"}); });
#else
  expect_error(errc::unsupported, "GPU", [] { mirrored_strategy s({"GPU:0", "GPU:1"}); });
#endif
  expect_error(errc::invalid_argument, "twice", [] { mirrored_strategy s({"CPU:0", "cpu:0"}); });
  expect_error(errc::invalid_argument, "at least one device",
               [] { mirrored_strategy s(std::vector<std::string>{}); });
  strategy_options bad;
  bad.collective_timeout = 0ms;
  expect_error(errc::invalid_argument, "positive", [&] { mirrored_strategy s(cpus(1), bad); });
}

TEST(StrategyTest, DefaultConstructedStrategiesTakeEveryGpuElseOneCpuReplica) {
  // tf.distribute's MirroredStrategy(): every visible GPU, else the CPU; the test holds on
  // machines with and without GPUs.
  std::vector<std::string> expected{"CPU:0"};
  if (const int gpus = detail::gpu::count(); gpus > 0) {
    expected.clear();
    for (int i = 0; i < gpus; ++i)
      expected.push_back("GPU:" + std::to_string(i));
  }
  mirrored_strategy mirrored;
  EXPECT_EQ(mirrored.worker_devices(), expected);
  default_strategy def;
  EXPECT_STREQ(def.name(), "DefaultStrategy");
  one_device_strategy one("/device:CPU:3");
  EXPECT_EQ(one.worker_devices(), std::vector<std::string>{"CPU:3"});
}

TEST(StrategyTest, LocalResultsAreTheComponents) {
  mirrored_strategy strategy(cpus(2));
  per_replica<tensor> v({tensor::scalar<float>(1), tensor::scalar<float>(2)});
  auto local = strategy.local_results(v);
  ASSERT_EQ(local.size(), 2u);
  EXPECT_TRUE(local[1].shares_storage_with(v[1]));
}

TEST(StrategyTest, DistributeDatasetSplitsPartialBatchesAndStops) {
  mirrored_strategy strategy(cpus(2));
  std::vector<float> rows(11);
  std::iota(rows.begin(), rows.end(), 0.0f);
  auto ds = dataset::from_tensor_slices(tensor::from<float>(rows)).batch(6);
  auto dist = strategy.distribute_dataset(ds);
  std::vector<std::vector<int64_t>> sizes;
  float seen = 0;
  for (auto batch : dist) {
    auto v = strategy.run(
        [](replica_context& ctx, const nest& x) {
          return ctx.all_reduce("SUM", reduce_axis(reduce_op::sum, x.as_tensor(), 0));
        },
        batch);
    seen += v[0].item<float>();
    sizes.push_back({batch[0].as_tensor().shape()[0], batch[1].as_tensor().shape()[0]});
  }
  EXPECT_EQ(sizes, (std::vector<std::vector<int64_t>>{{3, 3}, {3, 2}}));
  EXPECT_FLOAT_EQ(seen, 55);
  expect_error(errc::invalid_argument, "batch", [&] {
    strategy.distribute_dataset(dataset::from_tensor_slices(tensor::from<float>(rows)));
  });
}

TEST(StrategyTest, CrossDeviceOpsReduceAndBroadcastToDestinations) {
  mirrored_strategy strategy(cpus(2));
  const auto& ops = strategy.cross_device_ops();
  per_replica<tensor> v({tensor::from<float>({1, 2}), tensor::from<float>({3, 4})});
  auto r = ops.reduce("MEAN", v, {"CPU:0", "CPU:1"});
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[1].device(), "CPU:1");
  EXPECT_EQ(r[0].to_vector<float>(), (std::vector<float>{2, 3}));
  auto b = ops.broadcast(tensor::scalar<int32_t>(5), {"CPU:1"});
  EXPECT_EQ(b[0].item<int32_t>(), 5);
  EXPECT_EQ(b[0].device(), "CPU:1");
  auto batch = ops.batch_reduce("SUM", {{v, {"CPU:0"}}, {v, {"CPU:1"}}});
  ASSERT_EQ(batch.size(), 2u);
  EXPECT_EQ(batch[1][0].to_vector<float>(), (std::vector<float>{4, 6}));
  expect_error(errc::unknown_device, "bogus", [&] { ops.reduce("SUM", v, {"bogus"}); });
}

TEST(StrategyTest, CallsAfterShutdownFailWithShutdown) {
  mirrored_strategy strategy(cpus(2));
  strategy.shutdown();
  expect_error(errc::shutdown, "shut down",
               [&] { strategy.run([](replica_context&) { return tensor::scalar<float>(1); }); });
}

TEST(StrategyTest, HostArgumentsReachCpuReplicasWithoutACopy) {
  mirrored_strategy s({"CPU:0", "CPU:1"});
  auto shared = tensor::from<float>({1, 2, 3});
  auto parts = s.distribute_values([](int id) { return tensor::scalar<int32_t>(id); });
  auto nested = nest::dict({{"w", shared}});
  std::atomic<int> same{0};
  s.run(
      [&](replica_context& ctx, const tensor& all, const tensor& mine, const nest& n) {
        same += all.shares_storage_with(shared) ? 1 : 0;
        same += n["w"].as_tensor().shares_storage_with(shared) ? 1 : 0;
        EXPECT_EQ(mine.item<int32_t>(), ctx.replica_id_in_sync_group());
        return mine;
      },
      shared, parts, nested);
  EXPECT_EQ(same.load(), 4);
}

TEST(StrategyTest, ALoneReplicasCollectivesKeepTheirResultsAndErrors) {
  one_device_strategy s("CPU:0");
  auto v = s.run([](replica_context& ctx) {
    auto x = tensor::from<int32_t>({3, 4});
    EXPECT_EQ(ctx.all_reduce("SUM", x), x);
    auto mean = ctx.all_reduce("MEAN", x);
    EXPECT_EQ(mean.dtype(), dtype::float64);
    EXPECT_EQ(mean.to_vector<double>(), (std::vector<double>{3, 4}));
    EXPECT_EQ(ctx.all_gather(x, 0), x);
    EXPECT_EQ(ctx.broadcast(x, 0), x);
    return x;
  });
  EXPECT_EQ(v.values().size(), 1u);
  expect_error(errc::invalid_argument, "root replica 1 is out of range", [&] {
    s.run([](replica_context& ctx) { return ctx.broadcast(tensor::scalar<float>(1), 1); });
  });
  expect_error(errc::invalid_argument, "scalar", [&] {
    s.run([](replica_context& ctx) { return ctx.all_gather(tensor::scalar<float>(1), 0); });
  });
}

TEST(StrategyTest, SynchronizeOnCpuReplicasReturnsAndCollectivesAfterItStillMatch) {
  // ctx.synchronize() waits for a replica's device work; CPU replicas have none queued, and the
  // call must not count as a collective (the replicas' next collectives still pair up).
  mirrored_strategy s(cpus(3));
  auto v = s.run([](replica_context& ctx) {
    if (ctx.replica_id_in_sync_group() == 1)
      ctx.synchronize();
    auto sum = ctx.all_reduce("SUM", tensor::scalar<int64_t>(ctx.replica_id_in_sync_group()));
    ctx.synchronize();
    return sum;
  });
  for (const auto& t : v.values())
    EXPECT_EQ(t.item<int64_t>(), 3);
}

TEST(StrategyTest, AMeanOverAxis0OfAPartialBatchDividesByItsRowCount) {
  // TF's example: a last batch of 6 of a global batch of 8 on 2 replicas goes as [0, 1, 2, 3] and
  // [4, 5]; reduce(MEAN, axis=0) of the per-replica rows divides by 6, not by 8 or 2.
  mirrored_strategy strategy(cpus(2));
  auto rows = tensor::from<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13});
  auto ds = strategy.distribute_dataset(dataset::from_tensor_slices(nest(rows)).batch(8));
  auto last = ds.get(1);
  EXPECT_EQ(last[0].as_tensor().to_vector<float>(), (std::vector<float>{8, 9, 10, 11}));
  EXPECT_EQ(last[1].as_tensor().to_vector<float>(), (std::vector<float>{12, 13}));
  auto out = strategy.run([](replica_context&, const nest& batch) { return batch.as_tensor(); },
                          per_replica<nest>(last));
  EXPECT_EQ(strategy.reduce("MEAN", out, 0).item<float>(), (8 + 9 + 10 + 11 + 12 + 13) / 6.0f);
  EXPECT_EQ(strategy.reduce("SUM", out, 0).item<float>(), 63.0f);
}

TEST(StrategyTest, DistributeDatasetsFromFunctionGivesTheInputContextAndPerReplicaBatches) {
  mirrored_strategy strategy(cpus(2));
  std::vector<float> values(16);
  std::iota(values.begin(), values.end(), 0.0f);
  int calls = 0;
  auto dist = strategy.distribute_datasets_from_function([&](const input_context& ctx) {
    ++calls;
    EXPECT_EQ(ctx.num_input_pipelines(), 1);
    EXPECT_EQ(ctx.input_pipeline_id(), 0);
    EXPECT_EQ(ctx.num_replicas_in_sync(), 2);
    return dataset::from_tensor_slices(nest(tensor::from<float>(values)))
        .shard(ctx.num_input_pipelines(), ctx.input_pipeline_id())
        .batch(ctx.get_per_replica_batch_size(8));
  });
  EXPECT_EQ(calls, 1);
  ASSERT_EQ(dist.cardinality(), 2);
  EXPECT_EQ(test::sum_over_steps(strategy, dist), 120.0f); // every element once: 0 + ... + 15
  EXPECT_TRUE(test::fails_with(
      [&] {
        strategy.distribute_datasets_from_function([&](const input_context&) {
          return dataset::from_tensor_slices(nest(tensor::from<float>(values)));
        });
      },
      errc::invalid_argument, {"must return a batched dataset"}));
  EXPECT_TRUE(test::fails_with([&] { strategy.distribute_datasets_from_function(nullptr); },
                               errc::invalid_argument, {"needs an input function"}));
}

// A service may make its strategy on one thread and end it on another while the first lives on
// (CAF keeps the last actor system a thread spawned on in that thread's storage, and an actor
// system's destructor waits for that reference to go: before the fix this waited forever).
TEST(StrategyLifetime, AStrategyMadeOnOneThreadEndsOnAnotherWhileTheFirstLivesOn) {
  std::promise<std::unique_ptr<mirrored_strategy>> made;
  std::promise<void> maker_may_end;
  std::thread maker([&] {
    made.set_value(std::make_unique<mirrored_strategy>(cpus(2)));
    maker_may_end.get_future().wait();
  });
  auto s = made.get_future().get();
  EXPECT_EQ(s->run([](replica_context& ctx) {
               return ctx.all_reduce("SUM", tensor::scalar<float>(1.0f));
             })
                .values()
                .front()
                .item<float>(),
            2.0f);
  auto ended = std::async(std::launch::async, [&s] { s.reset(); });
  const bool in_time = ended.wait_for(20s) == std::future_status::ready;
  maker_may_end.set_value(); // before the fix, only the maker's end let the destructor finish
  maker.join();
  ended.wait();
  EXPECT_TRUE(in_time) << "the strategy's end waited for the thread that made it";
}

} // namespace
} // namespace consort
