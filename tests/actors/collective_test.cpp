// ReplicaContext collectives through the public API, on real replica threads.

#include <consort/consort.hpp>

#include "support/half_helpers.hpp"
#include "support/strategy_helpers.hpp"

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

namespace consort {
namespace {

using namespace std::chrono_literals;

using test::contains;
using test::cpus;
using test::error_of;

// -- all_reduce over replica counts, dtypes and ops
// -------------------------------------------------

using sweep = std::tuple<int, reduce_op, int64_t>; // replicas, op, elements

class AllReduceSweepTest : public ::testing::TestWithParam<sweep> {};

TEST_P(AllReduceSweepTest, MatchesAReferenceOnEveryReplica) {
  auto [n, op, count] = GetParam();
  mirrored_strategy strategy(cpus(n));
  auto input = [count = count](int id) {
    std::vector<double> v(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i)
      v[static_cast<size_t>(i)] = static_cast<double>((i * 7 + id * 3) % 11) - 5;
    return v;
  };
  auto out = strategy.run([&, op = op, count = count](replica_context& ctx) {
    return ctx.all_reduce(op, tensor::from<double>(input(ctx.replica_id_in_sync_group()), {count}));
  });
  std::vector<double> expected(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    double acc = 0;
    for (int r = 0; r < n; ++r) {
      double x = input(r)[static_cast<size_t>(i)];
      if (r == 0)
        acc = x;
      else if (op == reduce_op::sum || op == reduce_op::mean)
        acc += x;
      else if (op == reduce_op::min)
        acc = std::min(acc, x);
      else if (op == reduce_op::max)
        acc = std::max(acc, x);
      else
        acc *= x;
    }
    expected[static_cast<size_t>(i)] = op == reduce_op::mean ? acc / n : acc;
  }
  for (int r = 0; r < n; ++r) {
    const auto& t = out[static_cast<size_t>(r)];
    EXPECT_EQ(t.device(), "CPU:" + std::to_string(r));
    auto got = t.to_vector<double>();
    ASSERT_EQ(got.size(), expected.size());
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_DOUBLE_EQ(got[i], expected[i]) << "replica " << r << " element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(ReplicasOpsSizes, AllReduceSweepTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 8),
                                            ::testing::Values(reduce_op::sum, reduce_op::mean,
                                                              reduce_op::min, reduce_op::max,
                                                              reduce_op::prod),
                                            ::testing::Values(0, 1, 1001)));

TEST(CollectiveTest, AllReduceOfIntegersKeepsDtypeForSumAndGivesFloat64ForMean) {
  mirrored_strategy strategy(cpus(2));
  auto out = strategy.run([](replica_context& ctx) {
    auto x = tensor::scalar<int32_t>(ctx.replica_id_in_sync_group());
    return nest::list({ctx.all_reduce("SUM", x), ctx.all_reduce("MEAN", x)});
  });
  EXPECT_EQ(out[0][0].as_tensor().dtype(), dtype::int32);
  EXPECT_EQ(out[0][0].as_tensor().item<int32_t>(), 1);
  EXPECT_EQ(out[1][1].as_tensor().dtype(), dtype::float64);
  EXPECT_DOUBLE_EQ(out[1][1].as_tensor().item<double>(), 0.5);
}

TEST(CollectiveTest, AllReduceOfANestReducesLeafByLeaf) {
  mirrored_strategy strategy(cpus(3));
  auto out = strategy.run([](replica_context& ctx) {
    auto id = static_cast<float>(ctx.replica_id_in_sync_group());
    return ctx.all_reduce("MAX", nest::dict({{"a", tensor::scalar(id)},
                                             {"b", nest::list({tensor::from<float>({-id, id})})}}));
  });
  EXPECT_FLOAT_EQ(out[0]["a"].as_tensor().item<float>(), 2);
  EXPECT_EQ(out[2]["b"][0].as_tensor().to_vector<float>(), (std::vector<float>{0, 2}));
}

TEST(CollectiveTest, NestedRaggedAllGatherConcatenatesInReplicaOrder) {
  mirrored_strategy strategy(cpus(3));
  auto out = strategy.run([](replica_context& ctx) {
    int id = ctx.replica_id_in_sync_group();
    // Replica i contributes i+1 rows of "x" and, along axis 1, i columns of "y".
    std::vector<int32_t> rows(static_cast<size_t>(id + 1), id);
    std::vector<float> cols(static_cast<size_t>(2 * id), static_cast<float>(id));
    auto value = nest::dict({{"x", tensor::from<int32_t>(rows)},
                             {"y", nest::list({tensor::from<float>(cols, {2, id})})}});
    auto a = ctx.all_gather(value["x"], 0);
    auto b = ctx.all_gather(value["y"], -1); // axis -1 = axis 1
    return nest::list({a, b});
  });
  for (int r = 0; r < 3; ++r) {
    const auto& v = out[static_cast<size_t>(r)];
    EXPECT_EQ(v[0].as_tensor().to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 1, 2, 2, 2}));
    const auto& y = v[1][0].as_tensor();
    EXPECT_EQ(y.shape(), (shape_t{2, 3}));
    EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{1, 2, 2, 1, 2, 2}));
  }
}

TEST(CollectiveTest, AllGatherOfANestKeepsItsStructure) {
  mirrored_strategy strategy(cpus(2));
  auto out = strategy.run([](replica_context& ctx) {
    auto id = ctx.replica_id_in_sync_group();
    return ctx.all_gather(nest::dict({{"k", tensor::from<int64_t>({id, id})},
                                      {"v", tensor::from<int64_t>({10 * id})}}),
                          0);
  });
  EXPECT_EQ(out[1]["k"].as_tensor().to_vector<int64_t>(), (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_EQ(out[1]["v"].as_tensor().to_vector<int64_t>(), (std::vector<int64_t>{0, 10}));
}

TEST(CollectiveTest, AllGatherRejectsScalarsAndMismatchedRanksOnEveryReplica) {
  mirrored_strategy strategy(cpus(2));
  auto scalar = error_of([&] {
    strategy.run([](replica_context& ctx) { return ctx.all_gather(tensor::scalar(1.0f), 0); });
  });
  EXPECT_EQ(scalar.code(), errc::invalid_argument) << scalar.what();
  EXPECT_TRUE(contains(scalar, "rank 0")) << scalar.what();
  auto ranks = error_of([&] {
    strategy.run([](replica_context& ctx) {
      if (ctx.replica_id_in_sync_group() == 0)
        return ctx.all_gather(tensor::zeros(dtype::float32, {2, 3}), 0);
      return ctx.all_gather(tensor::zeros(dtype::float32, {2, 4}), 0);
    });
  });
  EXPECT_EQ(ranks.code(), errc::collective_mismatch) << ranks.what();
  EXPECT_TRUE(contains(ranks, "same rank and the same extents")) << ranks.what();
}

TEST(CollectiveTest, BroadcastReturnsTheRootsValueToEveryReplica) {
  mirrored_strategy strategy(cpus(4));
  auto out = strategy.run([](replica_context& ctx) {
    auto id = ctx.replica_id_in_sync_group();
    return ctx.broadcast(tensor::from<int32_t>({id, id * 2}), 2);
  });
  for (const auto& t : out)
    EXPECT_EQ(t.to_vector<int32_t>(), (std::vector<int32_t>{2, 4}));
}

TEST(CollectiveTest, DifferentCollectivesAtTheSamePositionFailEveryReplica) {
  mirrored_strategy strategy(cpus(3));
  std::vector<errc> seen(3, errc::none);
  auto e = error_of([&] {
    strategy.run([&seen](replica_context& ctx) {
      auto id = ctx.replica_id_in_sync_group();
      try {
        if (id == 1)
          return ctx.all_gather(tensor::from<float>({1}), 0);
        return ctx.all_reduce("SUM", tensor::from<float>({1}));
      } catch (const error& err) {
        seen[static_cast<size_t>(id)] = err.code();
        throw;
      }
    });
  });
  EXPECT_EQ(e.code(), errc::collective_mismatch) << e.what();
  for (auto code : seen)
    EXPECT_EQ(code, errc::collective_mismatch);
}

TEST(CollectiveTest, DifferentDtypesAtTheSamePositionAreAMismatch) {
  mirrored_strategy strategy(cpus(2));
  auto e = error_of([&] {
    strategy.run([](replica_context& ctx) {
      if (ctx.replica_id_in_sync_group() == 0)
        return ctx.all_reduce("SUM", tensor::scalar<float>(1));
      return ctx.all_reduce("SUM", tensor::scalar<int32_t>(1));
    });
  });
  EXPECT_EQ(e.code(), errc::collective_mismatch);
  EXPECT_TRUE(contains(e, "int32")) << e.what();
}

TEST(CollectiveTest, DifferentStructuresAtTheSamePositionAreAMismatch) {
  mirrored_strategy strategy(cpus(2));
  auto e = error_of([&] {
    strategy.run([](replica_context& ctx) {
      auto t = tensor::scalar<float>(1);
      if (ctx.replica_id_in_sync_group() == 0)
        return ctx.all_reduce("SUM", nest::list({t, t}));
      return ctx.all_reduce("SUM", nest::dict({{"a", t}}));
    });
  });
  EXPECT_EQ(e.code(), errc::collective_mismatch);
  EXPECT_TRUE(contains(e, "structure")) << e.what();
}

TEST(CollectiveTest, AThrowingReplicaFailsItsWaitingPeersAtOnceNotAtTheDeadline) {
  strategy_options opts;
  opts.collective_timeout = 10min; // the peers must not need it
  mirrored_strategy strategy(cpus(4), opts);
  std::vector<errc> seen(4, errc::none);
  auto fut = strategy.run_async([&seen](replica_context& ctx) {
    auto id = ctx.replica_id_in_sync_group();
    if (id == 3)
      throw std::runtime_error("out of memory in layer 2");
    try {
      return ctx.all_reduce("SUM", tensor::scalar<float>(1));
    } catch (const error& err) {
      seen[static_cast<size_t>(id)] = err.code();
      throw;
    }
  });
  ASSERT_TRUE(fut.wait_for(60s)) << "peers waited for the deadline instead of failing at once";
  auto e = error_of([&] { fut.get(); });
  EXPECT_EQ(e.code(), errc::step_failed) << e.what();
  EXPECT_TRUE(contains(e, "replica 3 (CPU:3) failed step 0: out of memory in layer 2")) << e.what();
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(seen[static_cast<size_t>(i)], errc::collective_aborted) << "replica " << i;
}

TEST(CollectiveTest, AReplicaThatSkipsACollectiveFailsItsPeersAtOnce) {
  strategy_options opts;
  opts.collective_timeout = 10min;
  mirrored_strategy strategy(cpus(2), opts);
  auto fut = strategy.run_async([](replica_context& ctx) {
    if (ctx.replica_id_in_sync_group() == 0)
      return tensor::scalar<float>(0); // never calls all_reduce
    return ctx.all_reduce("SUM", tensor::scalar<float>(1));
  });
  ASSERT_TRUE(fut.wait_for(60s));
  auto e = error_of([&] { fut.get(); });
  EXPECT_EQ(e.code(), errc::collective_aborted) << e.what();
  EXPECT_TRUE(contains(e, "replica 0 finished step 0 after 0 collective call(s)")) << e.what();
}

TEST(CollectiveTest, PerCallTimeoutNamesArrivedAndMissingReplicas) {
  mirrored_strategy strategy(cpus(3));
  std::atomic<int> late{0};
  std::atomic<bool> one_is_calling{false};
  auto e = error_of([&] {
    strategy.run([&late, &one_is_calling](replica_context& ctx) {
      auto id = ctx.replica_id_in_sync_group();
      if (id == 2) {
        // Arrives only after its peers have timed out: waits for their errors, not a clock.
        // Blocked, not spinning: on 2 cores a spinning thread delays the others' arrival.
        for (int seen = late.load(); seen < 2; seen = late.load())
          late.wait(seen);
      }
      // Replica 0 calls once replica 1 is about to: the deadline must not have to cover the
      // skew of the step's start on each replica (CI runs under ASan exceeded 50 ms there, and
      // once 200 ms while two replicas spun on yield beside it).
      if (id == 1) {
        one_is_calling = true;
        one_is_calling.notify_all();
      }
      if (id == 0)
        one_is_calling.wait(false);
      try {
        return ctx.all_reduce("SUM", tensor::scalar<float>(1), {.timeout = 500ms});
      } catch (const error&) {
        ++late;
        late.notify_all();
        throw;
      }
    });
  });
  EXPECT_EQ(e.code(), errc::collective_timeout) << e.what();
  EXPECT_TRUE(contains(e, "timed out after 500 ms")) << e.what();
  EXPECT_TRUE(contains(e, "replicas [0, 1] arrived, replicas [2] did not")) << e.what();
  // The next step works normally.
  auto ok = strategy.run(
      [](replica_context& ctx) { return ctx.all_reduce("SUM", tensor::scalar<float>(1)); });
  EXPECT_FLOAT_EQ(ok[2].item<float>(), 3);
}

TEST(CollectiveTest, ManyCollectivesPerStepAndManyStepsStayMatched) {
  mirrored_strategy strategy(cpus(4));
  for (int step = 0; step < 20; ++step) {
    auto out = strategy.run([step](replica_context& ctx) {
      float acc = 0;
      for (int k = 0; k < 5; ++k)
        acc += ctx.all_reduce("SUM", tensor::scalar<float>(static_cast<float>(
                                         ctx.replica_id_in_sync_group() + k + step)))
                   .item<float>();
      return tensor::scalar(acc);
    });
    // sum over k of (0+1+2+3 + 4k + 4 step) = 5*6 + 4*10 + 20*step
    EXPECT_FLOAT_EQ(out[3].item<float>(), 70.0f + 20.0f * static_cast<float>(step));
  }
}

} // namespace
} // namespace consort

// -- float16 and bfloat16 -------------------------------------------------------------------------

namespace consort {
namespace {

using consort::test::floats_of;
using consort::test::half_tensor;

/// Replica 0 holds `base`, the others 1: with four replicas the float32 sum is base + 3, which a
/// per-step accumulation in the 16-bit type loses entirely (base + 1 rounds back to base, ties to
/// even), so the results below tell a float32 accumulator from a 16-bit one.
template <class H>
void expect_float32_accumulation(float base) {
  SCOPED_TRACE(to_string(dtype_of<H>));
  mirrored_strategy strategy(cpus(4));
  const float want_sum = static_cast<float>(H(base + 3));
  const float want_mean = static_cast<float>(H((base + 3) * 0.25f));
  ASSERT_NE(want_sum, base); // the naive 16-bit fold would give `base`
  auto out = strategy.run([base](replica_context& ctx) {
    auto id = ctx.replica_id_in_sync_group();
    auto x = half_tensor<H>({id == 0 ? base : 1.0f, static_cast<float>(id)});
    return nest::list({ctx.all_reduce("SUM", x), ctx.all_reduce("MEAN", x),
                       ctx.all_reduce("MAX", x), ctx.all_gather(x, 0), ctx.broadcast(x, 2)});
  });
  for (size_t r = 0; r < 4; ++r) {
    const auto& results = out[r];
    EXPECT_EQ(results[0].as_tensor().dtype(), dtype_of<H>);
    EXPECT_EQ(floats_of<H>(results[0].as_tensor()), (std::vector<float>{want_sum, 6}));
    EXPECT_EQ(results[1].as_tensor().dtype(), dtype_of<H>); // MEAN keeps the dtype
    EXPECT_EQ(floats_of<H>(results[1].as_tensor()), (std::vector<float>{want_mean, 1.5f}));
    EXPECT_EQ(floats_of<H>(results[2].as_tensor()), (std::vector<float>{base, 3}));
    EXPECT_EQ(floats_of<H>(results[3].as_tensor()),
              (std::vector<float>{base, 0, 1, 1, 1, 2, 1, 3}));
    EXPECT_EQ(floats_of<H>(results[4].as_tensor()), (std::vector<float>{1, 2}));
  }
  // strategy.reduce, with and without an axis, accumulates in float32 too.
  auto values = strategy.distribute_values(
      [base](int id) { return half_tensor<H>({id == 0 ? base : 1.0f}); });
  const tensor sum = strategy.reduce("SUM", values, std::nullopt);
  EXPECT_EQ(sum.dtype(), dtype_of<H>);
  EXPECT_EQ(floats_of<H>(sum), (std::vector<float>{want_sum}));
  const tensor axis_sum = strategy.reduce("SUM", values, 0);
  const tensor axis_mean = strategy.reduce("MEAN", values, 0);
  const tensor axis_max = strategy.reduce("MAX", values, 0);
  EXPECT_EQ(axis_sum.item<float>(), want_sum);
  EXPECT_EQ(axis_mean.item<float>(), want_mean);
  EXPECT_EQ(axis_max.item<float>(), base);
}

TEST(CollectiveTest, Float16CollectivesAccumulateInFloat32AndKeepTheirDtype) {
  expect_float32_accumulation<float16_t>(2048.0f); // spacing 2 from 2048: 2051 -> 2052
}

TEST(CollectiveTest, Bfloat16CollectivesAccumulateInFloat32AndKeepTheirDtype) {
  expect_float32_accumulation<bfloat16_t>(256.0f); // spacing 2 from 256: 259 -> 260
}

TEST(CollectiveTest, Float16AndBfloat16AtTheSamePositionAreAMismatchNamingBoth) {
  mirrored_strategy strategy(cpus(2));
  auto e = error_of([&] {
    strategy.run([](replica_context& ctx) {
      if (ctx.replica_id_in_sync_group() == 0)
        return ctx.all_reduce("SUM", half_tensor<float16_t>({1}));
      return ctx.all_reduce("SUM", half_tensor<bfloat16_t>({1}));
    });
  });
  EXPECT_EQ(e.code(), errc::collective_mismatch);
  EXPECT_TRUE(contains(e, "float16")) << e.what();
  EXPECT_TRUE(contains(e, "bfloat16")) << e.what();
}

} // namespace
} // namespace consort
