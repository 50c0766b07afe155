// Variables created by a strategy (mirrored and sync-on-read), their listing, and the SGD
// optimizer, through the public API: 1 to 4 replicas in one process, and 2 workers of 1 or 2
// replicas over consort::testing's simulated network. Nothing sleeps; every wait on a worker is
// bounded.

#include <consort/consort.hpp>
#include <consort/testing.hpp>

#include "support/expect_error.hpp"
#include "support/strategy_helpers.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace consort {
namespace {

using namespace std::chrono_literals;
using test::cpus;
using test::fails_with;

tensor f32(std::vector<float> v) {
  const auto n = static_cast<int64_t>(v.size());
  return tensor::from<float>(v, {n});
}

std::vector<float> values(const tensor& t) {
  return t.to_vector<float>();
}

variable_options mirrored(variable_aggregation a) {
  return {variable_synchronization::on_write, a};
}

variable_options on_read(variable_aggregation a) {
  return {variable_synchronization::on_read, a};
}

/// Every local copy of `v` holds `want`, each on its replica's device.
void expect_copies(const strategy& s, const variable& v, const std::vector<float>& want) {
  auto copies = s.local_results(v);
  ASSERT_EQ(copies.size(), s.num_local_replicas());
  for (size_t i = 0; i < copies.size(); ++i) {
    EXPECT_EQ(values(copies[i]), want) << v.name() << " copy " << i;
    EXPECT_EQ(copies[i].device(), s.worker_devices()[i]) << v.name() << " copy " << i;
  }
}

// -- in one process: 1 to 4 replicas --------------------------------------------------------------

class VariableTest : public ::testing::TestWithParam<int> {
protected:
  int replicas() const { return GetParam(); }
  /// 1 + 2 + ... + replicas: the SUM of every replica's (id + 1).
  float id_sum() const { return static_cast<float>(replicas() * (replicas() + 1) / 2); }
};

TEST_P(VariableTest, AStepReadsItsReplicasCopyAndOutsideReadsThePrimary) {
  mirrored_strategy s(cpus(replicas()));
  auto w = s.create_variable("w", f32({1, 2}));
  EXPECT_EQ(w.synchronization(), variable_synchronization::on_write);
  EXPECT_EQ(w.aggregation(), variable_aggregation::none);
  auto seen = s.run([&](replica_context& ctx) {
    auto mine = ctx.read(w);
    EXPECT_EQ(mine.device(), ctx.device());
    return mine;
  });
  for (const auto& t : seen.values())
    EXPECT_EQ(values(t), (std::vector<float>{1, 2}));
  EXPECT_EQ(values(w.value()), (std::vector<float>{1, 2}));
  expect_copies(s, w, {1, 2});
}

TEST_P(VariableTest, AMirroredUpdateInAStepIsCombinedByItsAggregationAndReachesEveryCopy) {
  mirrored_strategy s(cpus(replicas()));
  auto sum = s.create_variable("sum", f32({10}), mirrored(variable_aggregation::sum));
  auto mean = s.create_variable("mean", f32({10}), mirrored(variable_aggregation::mean));
  auto first =
      s.create_variable("first", f32({10}), mirrored(variable_aggregation::only_first_replica));
  auto set = s.create_variable("set", f32({10}), mirrored(variable_aggregation::sum));
  s.run([&](replica_context& ctx) {
    const float x = static_cast<float>(ctx.replica_id_in_sync_group() + 1);
    ctx.assign_add(sum, f32({x}));
    ctx.assign_sub(mean, f32({x}));
    ctx.assign_add(first, f32({x * 100}));
    ctx.assign(set, f32({x}));
    return ctx.read(sum);
  });
  expect_copies(s, sum, {10 + id_sum()});
  expect_copies(s, mean, {10 - id_sum() / static_cast<float>(replicas())});
  expect_copies(s, first, {10 + 100}); // replica 0's value only
  expect_copies(s, set, {id_sum()});   // assign with SUM: the sum of every replica's value
}

TEST_P(VariableTest, AMirroredUpdateInAStepWithoutAggregationFailsWithTfsMessage) {
  mirrored_strategy s(cpus(replicas()));
  auto w = s.create_variable("w", f32({1}));
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([&](replica_context& ctx) {
          ctx.assign_add(w, f32({1}));
          return ctx.read(w);
        });
      },
      errc::invalid_argument,
      {"You must specify an aggregation method to update a MirroredVariable in Replica Context. "
       "You can do so by passing an explicit value for argument `aggregation` to tf.Variable(..)",
       "\"w\""}));
  expect_copies(s, w, {1}); // nothing changed
  // The strategy still runs steps afterwards.
  auto again = s.run([&](replica_context& ctx) { return ctx.read(w); });
  EXPECT_EQ(again.size(), static_cast<size_t>(replicas()));
}

TEST_P(VariableTest, OutsideAStepAnUpdateChangesEveryCopy) {
  mirrored_strategy s(cpus(replicas()));
  auto w = s.create_variable("w", f32({1, 1}));
  w.assign(f32({5, 6}));
  expect_copies(s, w, {5, 6});
  w.assign_add(f32({1, 2}));
  expect_copies(s, w, {6, 8});
  w.assign_sub(f32({6, 6}));
  expect_copies(s, w, {0, 2});
  EXPECT_EQ(values(w.value()), (std::vector<float>{0, 2}));
}

TEST_P(VariableTest, ASyncOnReadVariableIsUpdatedLocallyAndReadOutsideAsTheAggregate) {
  mirrored_strategy s(cpus(replicas()));
  auto total = s.create_variable("loss_total", f32({0}), on_read(variable_aggregation::sum));
  auto avg = s.create_variable("loss_mean", f32({0}), on_read(variable_aggregation::mean));
  auto mine = s.run([&](replica_context& ctx) {
    const float x = static_cast<float>(ctx.replica_id_in_sync_group() + 1);
    ctx.assign_add(total, f32({x}));
    ctx.assign_add(avg, f32({x}));
    return ctx.read(total); // this replica's own copy, not the aggregate
  });
  for (size_t i = 0; i < mine.size(); ++i)
    EXPECT_EQ(values(mine[i]), (std::vector<float>{static_cast<float>(i + 1)}));
  EXPECT_EQ(values(total.value()), (std::vector<float>{id_sum()}));
  EXPECT_FLOAT_EQ(avg.value().item<float>(), id_sum() / static_cast<float>(replicas()));
  // Outside a step, assign makes the aggregate read the value (SUM: each copy gets its share).
  total.assign(f32({8}));
  EXPECT_FLOAT_EQ(total.value().item<float>(), 8);
  total.assign(f32({0})); // a metric's reset
  EXPECT_EQ(values(total.value()), (std::vector<float>{0}));
  // TF refuses assign_add of a SUM sync-on-read variable outside a step; MEAN takes it.
  EXPECT_TRUE(fails_with([&] { total.assign_add(f32({1})); }, errc::invalid_argument,
                         {"SyncOnReadVariable does not support `assign_add`", "loss_total"}));
  avg.assign(f32({2}));
  avg.assign_add(f32({1}));
  EXPECT_FLOAT_EQ(avg.value().item<float>(), 3);
}

TEST_P(VariableTest, TheStrategyListsItsVariablesWithNamesShapesAndDtypes) {
  mirrored_strategy s(cpus(replicas()));
  s.create_variable("dense/kernel", tensor::zeros(dtype::float32, {3, 2}));
  s.create_variable("dense/bias", tensor::zeros(dtype::float64, {2}));
  s.create_variable("steps", tensor::scalar<int64_t>(7), on_read(variable_aggregation::sum));
  auto vars = s.variables();
  ASSERT_EQ(vars.size(), 3u);
  EXPECT_EQ(vars[0].name(), "dense/kernel");
  EXPECT_EQ(vars[0].shape(), (shape_t{3, 2}));
  EXPECT_EQ(vars[0].dtype(), dtype::float32);
  EXPECT_EQ(vars[1].name(), "dense/bias");
  EXPECT_EQ(vars[1].dtype(), dtype::float64);
  EXPECT_EQ(vars[2].shape(), shape_t{});
  auto saved = s.variable_values();
  ASSERT_EQ(saved.size(), 3u);
  EXPECT_EQ(saved[0].name, "dense/kernel");
  EXPECT_EQ(saved[0].value.shape(), (shape_t{3, 2}));
  // A sync-on-read variable is saved as its aggregate: 7 on every copy, summed.
  EXPECT_EQ(saved[2].value.item<int64_t>(), 7 * replicas());
}

TEST_P(VariableTest, ACheckpointOfTheVariablesRestoresThemWithNoGlue) {
  mirrored_strategy s(cpus(replicas()));
  auto w = s.create_variable("dense/kernel", f32({1, 2}));
  auto metric = s.create_variable("loss", f32({0}), on_read(variable_aggregation::sum));
  s.run([&](replica_context& ctx) {
    ctx.assign_add(metric, f32({static_cast<float>(ctx.replica_id_in_sync_group() + 1)}));
    return f32({0});
  });
  const auto path =
      ::testing::TempDir() + "/variables_" + std::to_string(replicas()) + ".safetensors";
  checkpoint_metadata metadata;
  metadata.step = 3;
  save_checkpoint(path, s.variable_values(), metadata);
  w.assign(f32({9, 9}));
  metric.assign(f32({100}));
  s.assign_variables(load_checkpoint(path).tensors);
  expect_copies(s, w, {1, 2});
  EXPECT_FLOAT_EQ(metric.value().item<float>(), id_sum()); // the aggregate, as saved

  // Nothing is assigned unless every variable has its tensor, of its dtype and shape.
  w.assign(f32({5, 6}));
  EXPECT_TRUE(fails_with(
      [&] {
        s.assign_variables({{"dense/kernel", f32({0, 0})}});
      },
      errc::structure_mismatch, {"\"loss\""}));
  EXPECT_TRUE(fails_with(
      [&] {
        s.assign_variables({{"dense/kernel", f32({0, 0, 0})}, {"loss", f32({0})}});
      },
      errc::shape_mismatch, {"dense/kernel", "[3]"}));
  expect_copies(s, w, {5, 6});
}

TEST_P(VariableTest, BadCallsFailSayingWhatWasWrong) {
  mirrored_strategy s(cpus(replicas()));
  auto w = s.create_variable("w", f32({1, 2}), mirrored(variable_aggregation::sum));
  EXPECT_TRUE(fails_with([&] { s.create_variable("w", f32({0})); }, errc::invalid_argument,
                         {"\"w\"", "already"}));
  EXPECT_TRUE(fails_with([&] { s.create_variable("", f32({0})); }, errc::invalid_argument,
                         {"needs a name"}));
  EXPECT_TRUE(fails_with([&] { s.create_variable("e", tensor()); }, errc::invalid_argument,
                         {"empty initial value"}));
  EXPECT_TRUE(
      fails_with([&] { s.create_variable("m", f32({0}), on_read(variable_aggregation::none)); },
                 errc::invalid_argument, {"sync-on-read", "SUM or MEAN", "NONE"}));
  EXPECT_TRUE(fails_with(
      [&] {
        s.create_variable("i", tensor::scalar<int32_t>(0), mirrored(variable_aggregation::mean));
      },
      errc::invalid_argument, {"MEAN needs a floating dtype", "int32"}));
  EXPECT_TRUE(fails_with(
      [&] {
        w.assign(f32({1, 2, 3}));
      },
      errc::shape_mismatch, {"\"w\"", "[2]", "[3]"}));
  EXPECT_TRUE(fails_with(
      [&] {
        w.assign_add(tensor::from<double>({1, 2}, {2}));
      },
      errc::dtype_mismatch, {"\"w\"", "float32", "float64"}));
  EXPECT_TRUE(fails_with([&] { variable().value(); }, errc::invalid_argument, {"empty handle"}));

  // Inside a step: creating, reading with value(), a wrong shape, another strategy's variable.
  mirrored_strategy other(cpus(replicas() + 1));
  auto foreign = other.create_variable("foreign", f32({0}));
  const std::vector<std::pair<std::string, std::function<void(replica_context&)>>> in_step = {
      {"strategy.create_variable requires cross-replica context",
       [&](replica_context&) {
         s.create_variable("x", f32({0}));
       }},
      {"ctx.read",
       [&](replica_context&) {
         w.value();
       }},
      {"got a value of shape [1]",
       [&](replica_context& ctx) {
         ctx.assign_add(w, f32({1}));
       }},
      {"was created by a strategy of " + std::to_string(replicas() + 1) + " replicas",
       [&](replica_context& ctx) {
         ctx.read(foreign);
       }},
  };
  for (const auto& [fragment, call] : in_step) {
    auto e = test::error_of([&] {
      s.run([&, fn = call](replica_context& ctx) {
        fn(ctx);
        return f32({0});
      });
    });
    EXPECT_TRUE(test::contains(e, fragment)) << fragment << " not in: " << e.what();
  }
  expect_copies(s, w, {1, 2});
}

TEST_P(VariableTest, ABoolVariableIsAssignedButNotAddedTo) {
  mirrored_strategy s(cpus(replicas()));
  auto flag = s.create_variable("flag", tensor::from<bool>({false, true}, {2}));
  flag.assign(tensor::from<bool>({true, true}, {2}));
  for (const auto& copy : s.local_results(flag))
    EXPECT_EQ(copy.to_vector<bool>(), (std::vector<bool>{true, true}));
  EXPECT_TRUE(fails_with(
      [&] {
        flag.assign_add(tensor::from<bool>({true, false}, {2}));
      },
      errc::dtype_mismatch, {"bool", "cast it to int32 first"}));
  for (const auto& copy : s.local_results(flag)) // unchanged
    EXPECT_EQ(copy.to_vector<bool>(), (std::vector<bool>{true, true}));
}

TEST(VariableLifetimeTest, AVariableOutlivesItsStrategyAndCallsNeedingItFailWithShutdown) {
  variable kept, metric;
  {
    mirrored_strategy s(cpus(2));
    kept = s.create_variable("kept", f32({4}));
    metric = s.create_variable("metric", f32({1}), on_read(variable_aggregation::sum));
    auto moved = std::make_unique<mirrored_strategy>(std::move(s));
    // A moved strategy still owns its variables.
    EXPECT_FLOAT_EQ(metric.value().item<float>(), 2);
    EXPECT_EQ(moved->variables().size(), 2u);
  }
  EXPECT_EQ(values(kept.value()), (std::vector<float>{4})); // a local copy
  EXPECT_TRUE(
      fails_with([&] { metric.value(); }, errc::shutdown, {"\"metric\"", "no longer exists"}));
}

// -- SGD
// -------------------------------------------------------------------------------------------

/// A linear model's data: `rows` examples of 3 features and one target, a fixed pattern.
struct regression_data {
  std::vector<std::vector<float>> x;
  std::vector<float> y;
};

regression_data make_data(int rows) {
  regression_data d;
  for (int r = 0; r < rows; ++r) {
    d.x.push_back({0.1f * static_cast<float>(r % 7) - 0.3f, 0.05f * static_cast<float>(r),
                   static_cast<float>((r * 5) % 3) - 1.0f});
    d.y.push_back(0.7f * static_cast<float>(r % 4) - 0.9f);
  }
  return d;
}

/// The gradients of `sum over rows (x.w + b - y)^2 / (2 * global_rows)` over `rows` (Keras's
/// loss scaled by the global batch, as compute_average_loss does).
std::pair<std::vector<float>, float> gradients(const regression_data& d,
                                               const std::vector<int>& rows,
                                               const std::vector<float>& w, float b,
                                               int global_rows) {
  std::vector<float> gw(3, 0.0f);
  float gb = 0.0f;
  for (int r : rows) {
    float err = b - d.y[static_cast<size_t>(r)];
    for (size_t k = 0; k < 3; ++k)
      err += d.x[static_cast<size_t>(r)][k] * w[k];
    for (size_t k = 0; k < 3; ++k)
      gw[k] += err * d.x[static_cast<size_t>(r)][k];
    gb += err;
  }
  const auto n = static_cast<float>(global_rows);
  for (auto& g : gw)
    g /= n;
  return {gw, gb / n};
}

/// The rows of replica `id` of `replicas`: every replicas-th row, starting at `id`.
std::vector<int> rows_of(int id, int replicas, int global_rows) {
  std::vector<int> out;
  for (int r = id; r < global_rows; r += replicas)
    out.push_back(r);
  return out;
}

/// One replica on the whole global batch, `steps` steps of Keras's SGD (with momentum).
std::pair<std::vector<float>, float> reference_sgd(const regression_data& d, int steps, float lr,
                                                   float momentum) {
  std::vector<float> w{0.5f, -0.25f, 0.125f}, vw(3, 0.0f);
  float b = 0.1f, vb = 0.0f;
  const int rows = static_cast<int>(d.y.size());
  for (int step = 0; step < steps; ++step) {
    auto [gw, gb] = gradients(d, rows_of(0, 1, rows), w, b, rows);
    for (size_t k = 0; k < 3; ++k) {
      vw[k] = momentum * vw[k] - lr * gw[k];
      w[k] = momentum == 0 ? w[k] - lr * gw[k] : w[k] + vw[k];
    }
    vb = momentum * vb - lr * gb;
    b = momentum == 0 ? b - lr * gb : b + vb;
  }
  return {w, b};
}

/// The distributed twin: each replica computes its rows' gradients, the optimizer all-reduces
/// them (SUM) and updates the mirrored variables. Returns the copies of worker `s`.
void train(strategy& s, const regression_data& d, int steps, const sgd_options& opts, variable& w,
           variable& b) {
  sgd optimizer(opts);
  const int rows = static_cast<int>(d.y.size());
  for (int step = 0; step < steps; ++step)
    s.run([&](replica_context& ctx) {
      auto [gw, gb] =
          gradients(d, rows_of(ctx.replica_id_in_sync_group(), ctx.num_replicas_in_sync(), rows),
                    values(ctx.read(w)), ctx.read(b).item<float>(), rows);
      optimizer.apply_gradients(ctx, {{f32(gw), w}, {tensor::scalar<float>(gb), b}});
      return ctx.read(w);
    });
}

/// Elementwise within float32 rounding of the sums' order (relative to the magnitude, at least 1).
void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 1e-6 * std::max(1.0f, std::fabs(want[i])))
        << what << " [" << i << "]";
}

TEST_P(VariableTest, SgdUpdatesEqualOneReplicasUpdatesOnTheGlobalBatch) {
  const auto data = make_data(11); // 11 rows: uneven shares on 2 to 4 replicas
  for (float momentum : {0.0f, 0.9f}) {
    for (size_t bucket : {size_t{0}, size_t{25} << 20}) {
      mirrored_strategy s(cpus(replicas()));
      auto w = s.create_variable("w", f32({0.5f, -0.25f, 0.125f}));
      auto b = s.create_variable("b", tensor::scalar<float>(0.1f));
      sgd_options opts{.learning_rate = 0.3, .momentum = momentum, .bucket_bytes = bucket};
      train(s, data, 4, opts, w, b);
      auto [want_w, want_b] = reference_sgd(data, 4, 0.3f, momentum);
      const auto what = "momentum " + std::to_string(momentum) + ", bucket " +
                        std::to_string(bucket) + ", " + std::to_string(replicas()) + " replicas";
      for (const auto& copy : s.local_results(w))
        expect_close(values(copy), want_w, "w, " + what);
      for (const auto& copy : s.local_results(b))
        expect_close(values(copy), {want_b}, "b, " + what);
      // The momentum slots are variables of the strategy (a checkpoint saves them).
      auto vars = s.variables();
      ASSERT_EQ(vars.size(), momentum == 0 ? 2u : 4u) << what;
      if (momentum != 0) {
        EXPECT_EQ(vars[2].name(), "w/momentum");
      }
    }
  }
}

TEST_P(VariableTest, SgdUpdatesAVariableListedTwiceByBothGradients) {
  mirrored_strategy s(cpus(replicas()));
  auto w = s.create_variable("w", f32({0, 0}));
  auto b = s.create_variable("b", f32({1}));
  sgd optimizer({.learning_rate = 0.5});
  s.run([&](replica_context& ctx) {
    optimizer.apply_gradients(ctx, {{f32({1, 1}), w}, {f32({2}), b}, {f32({2, 2}), w}});
    return f32({0});
  });
  const auto n = static_cast<float>(replicas()); // SUM over the replicas
  expect_copies(s, w, {-1.5f * n, -1.5f * n});
  expect_copies(s, b, {1 - n});
}

TEST_P(VariableTest, SgdSkippingAggregationAppliesTheGradientsAsGivenInPlaceAndHoldersKeepTheirs) {
  mirrored_strategy s(cpus(replicas()));
  auto w = s.create_variable("w", f32({1, 2}));
  sgd optimizer({.learning_rate = 0.5});
  auto step = [&](const apply_options& apply) {
    s.run([&](replica_context& ctx) {
      optimizer.apply_gradients(ctx, {{f32({2, 4}), w}}, apply);
      return f32({0});
    });
  };
  // A value read before the update keeps it (copy-on-write).
  const tensor held = w.value();
  step({.skip_gradients_aggregation = true}); // no all-reduce: [1, 2] - 0.5 * [2, 4]
  expect_copies(s, w, {0, 0});
  EXPECT_EQ(values(held), (std::vector<float>{1, 2}));
  // With nothing else holding the copies, the update writes them in place.
  std::vector<const float*> before;
  for (const auto& copy : s.local_results(w))
    before.push_back(copy.data<float>());
  step({}); // aggregated: [0, 0] - 0.5 * (replicas * [2, 4])
  const auto n = static_cast<float>(replicas());
  expect_copies(s, w, {-n, -2 * n});
  const auto after = s.local_results(w);
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_EQ(after[i].data<float>(), before[i]) << "copy " << i << " was not updated in place";
}

TEST_P(VariableTest, SgdRefusesBadPairsNamingThem) {
  mirrored_strategy s(cpus(replicas()));
  auto w = s.create_variable("w", f32({0, 0}));
  auto metric = s.create_variable("metric", f32({0}), on_read(variable_aggregation::sum));
  auto count = s.create_variable("count", tensor::scalar<int32_t>(0));
  sgd optimizer;
  const std::vector<std::pair<std::string, std::vector<std::pair<tensor, variable>>>> bad = {
      {"at least one", {}},
      {"got a value of shape [3]", {{f32({1, 2, 3}), w}}},
      {"\"metric\" is sync-on-read", {{f32({1}), metric}}},
      {"SGD updates floating variables only", {{tensor::scalar<int32_t>(1), count}}},
      {"empty variable handle", {{f32({1}), variable()}}},
  };
  for (const auto& [fragment, pairs] : bad) {
    auto e = test::error_of([&, p = pairs] {
      s.run([&](replica_context& ctx) {
        optimizer.apply_gradients(ctx, p);
        return f32({0});
      });
    });
    EXPECT_TRUE(test::contains(e, fragment)) << fragment << " not in: " << e.what();
  }
  expect_copies(s, w, {0, 0});
  EXPECT_TRUE(fails_with([] { sgd(sgd_options{.learning_rate = -1}); }, errc::invalid_argument,
                         {"learning_rate"}));
  EXPECT_TRUE(fails_with([] { sgd(sgd_options{.momentum = 2}); }, errc::invalid_argument,
                         {"momentum must be in [0, 1]"}));
  EXPECT_TRUE(fails_with([] { sgd(sgd_options{.gradient_reduction = reduce_op::max}); },
                         errc::invalid_argument, {"SUM or MEAN"}));
}

using buckets = std::vector<std::pair<size_t, size_t>>;

TEST(PlanGradientBuckets, ZeroBytesIsOneBucketPerTensor) {
  EXPECT_EQ(plan_gradient_buckets({8, 8, 8}, 0), (buckets{{0, 1}, {1, 2}, {2, 3}}));
}

TEST(PlanGradientBuckets, FillsBucketsUpToTheLimitInOrder) {
  EXPECT_EQ(plan_gradient_buckets({8, 8, 8, 8}, 16), (buckets{{0, 2}, {2, 4}}));
  EXPECT_EQ(plan_gradient_buckets({8, 8, 8}, 1 << 20), (buckets{{0, 3}}));
  EXPECT_EQ(plan_gradient_buckets({4, 8, 4}, 12), (buckets{{0, 2}, {2, 3}}));
}

TEST(PlanGradientBuckets, ATensorLargerThanABucketGetsItsOwn) {
  EXPECT_EQ(plan_gradient_buckets({4, 100, 4}, 16), (buckets{{0, 1}, {1, 2}, {2, 3}}));
  EXPECT_EQ(plan_gradient_buckets({100}, 16), (buckets{{0, 1}}));
}

TEST(PlanGradientBuckets, NoTensorsNoBuckets) {
  EXPECT_TRUE(plan_gradient_buckets({}, 64).empty());
}

INSTANTIATE_TEST_SUITE_P(Replicas, VariableTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "Replicas"; });

// -- a GPU replica (skipped where this process sees no GPU) ------------------------------------

TEST(VariableGpuTest, CopiesLiveOnTheGpuAndStepUpdatesAndSgdReachThem) {
  if (num_gpus() == 0)
    GTEST_SKIP() << "no GPU: " << gpus_unavailable_reason();
  mirrored_strategy s({"GPU:0"});
  auto w = s.create_variable("w", f32({1, 2}), mirrored(variable_aggregation::sum));
  auto metric = s.create_variable("metric", f32({0}), on_read(variable_aggregation::sum));
  expect_copies(s, w, {1, 2}); // on GPU:0
  sgd optimizer({.learning_rate = 0.5});
  auto seen = s.run([&](replica_context& ctx) {
    EXPECT_TRUE(ctx.read(w).on_gpu());
    ctx.assign_add(w, f32({1, 1}).to(ctx.device()));
    ctx.assign_add(metric, f32({3}).to(ctx.device()));
    optimizer.apply_gradients(ctx, {{f32({2, 4}).to(ctx.device()), w}});
    return ctx.read(w);
  });
  EXPECT_EQ(seen[0].device(), "GPU:0");
  expect_copies(s, w, {1, 1}); // [1, 2] + [1, 1] - 0.5 * [2, 4]
  EXPECT_EQ(values(metric.value()), (std::vector<float>{3}));
  w.assign(f32({7, 8})); // a host value, copied to the GPU
  expect_copies(s, w, {7, 8});
}

/// The bytes of `t`, read on the host.
std::vector<unsigned char> bytes_of(const tensor& t) {
  const tensor host = t.on_gpu() ? t.to("CPU:0") : t;
  const auto* p = static_cast<const unsigned char*>(host.raw_data());
  return {p, p + host.num_bytes()};
}

/// `n` values of mixed sign and magnitude (2^-8 to 2^8), in the floating dtype `type`; the same
/// for the same seed. Odd sizes leave a tail after the GPU kernel's 16-byte vectors.
tensor mixed(dtype type, int64_t n, int seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = std::ldexp(std::sin(0.7f * static_cast<float>(i) + static_cast<float>(seed)),
                      static_cast<int>((i * 7 + static_cast<size_t>(seed)) % 17) - 8);
  auto as = [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> out;
    for (float x : v)
      out.push_back(static_cast<T>(x));
    return tensor::from<T>(out, {n});
  };
  switch (type) {
  case dtype::float64:
    return as(double{});
  case dtype::float16:
    return as(float16_t{});
  case dtype::bfloat16:
    return as(bfloat16_t{});
  default:
    return as(float{});
  }
}

constexpr dtype floating_dtypes[] = {dtype::float32, dtype::float64, dtype::float16,
                                     dtype::bfloat16};

TEST(VariableGpuTest, SgdOnGpuCopiesGivesTheHostsBitsForEveryFloatingDtypeAndMomentum) {
  if (num_gpus() == 0)
    GTEST_SKIP() << "no GPU: " << gpus_unavailable_reason();
  const sgd_options plain{.learning_rate = 0.3};
  const sgd_options momentum{.learning_rate = 0.3, .momentum = 0.9};
  const sgd_options nesterov{.learning_rate = 0.3, .momentum = 0.9, .nesterov = true};
  for (const auto& options : {plain, momentum, nesterov})
    for (auto type : floating_dtypes) {
      SCOPED_TRACE(std::string{to_string(type)} + ", momentum " + std::to_string(options.momentum) +
                   (options.nesterov ? ", nesterov" : ""));
      one_device_strategy cpu("CPU:0");
      one_device_strategy gpu("GPU:0");
      const int64_t n = 1001;
      auto on_cpu = cpu.create_variable("w", mixed(type, n, 1));
      auto on_gpu = gpu.create_variable("w", mixed(type, n, 1));
      sgd optimizer(options);
      for (int step = 0; step < 3; ++step) {
        const tensor g = mixed(type, n, 10 + step);
        cpu.run([&](replica_context& ctx) {
          optimizer.apply_gradients(ctx, {{g, on_cpu}});
          return g;
        });
        gpu.run([&](replica_context& ctx) {
          optimizer.apply_gradients(ctx, {{g.to(ctx.device()), on_gpu}});
          return g;
        });
      }
      EXPECT_TRUE(gpu.local_results(on_gpu)[0].on_gpu());
      EXPECT_EQ(bytes_of(on_gpu.value()), bytes_of(on_cpu.value()));
      EXPECT_NE(bytes_of(on_gpu.value()), bytes_of(mixed(type, n, 1))) << "nothing was updated";
      if (options.momentum > 0) {
        ASSERT_EQ(gpu.variables().size(), 2u);
        EXPECT_EQ(gpu.variables()[1].name(), "w/momentum");
        EXPECT_EQ(bytes_of(gpu.variables()[1].value()), bytes_of(cpu.variables()[1].value()));
      }
    }
}

TEST(VariableGpuTest, SgdOverManyVariablesOnTheGpuGivesTheHostsBitsAlignedOrNot) {
  if (num_gpus() == 0)
    GTEST_SKIP() << "no GPU: " << gpus_unavailable_reason();
  // 20 variables of ragged sizes (two launches of 16 and 4), their gradients slices of one flat
  // buffer at odd offsets (no 16-byte vectors) in the first step and tensors of their own in the
  // second; then a variable listed twice and a float64 one among float32s (pair by pair).
  const std::vector<int64_t> sizes = {1, 7, 33,  1001, 4, 5, 64, 3,  2, 17,
                                      1, 9, 128, 31,   2, 6, 70, 11, 8, 1000};
  int64_t total = 0;
  for (auto n : sizes)
    total += n + 1;
  one_device_strategy cpu("CPU:0");
  one_device_strategy gpu("GPU:0");
  std::vector<variable> on_cpu, on_gpu;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto name = "w" + std::to_string(i);
    on_cpu.push_back(cpu.create_variable(name, mixed(dtype::float32, sizes[i], 1 + int(i))));
    on_gpu.push_back(gpu.create_variable(name, mixed(dtype::float32, sizes[i], 1 + int(i))));
  }
  auto d_cpu = cpu.create_variable("d", mixed(dtype::float64, 9, 3));
  auto d_gpu = gpu.create_variable("d", mixed(dtype::float64, 9, 3));
  sgd optimizer({.learning_rate = 0.3});
  auto step = [&](strategy& s, const std::vector<variable>& vars, const variable& d, int kind) {
    s.run([&](replica_context& ctx) {
      const tensor flat = mixed(dtype::float32, total, 40 + kind).to(ctx.device());
      std::vector<std::pair<tensor, variable>> pairs;
      int64_t at = 1; // an odd offset: every slice misaligned
      for (size_t i = 0; i < vars.size(); ++i) {
        const auto n = sizes[i];
        tensor g = kind == 0 ? flat.slice(at, at + n)
                             : mixed(dtype::float32, n, 60 + int(i)).to(ctx.device());
        at += n + 1;
        pairs.emplace_back(g, vars[i]);
      }
      if (kind == 2) { // pair by pair: a repeat and another dtype
        pairs.emplace_back(mixed(dtype::float32, sizes[0], 80).to(ctx.device()), vars[0]);
        pairs.emplace_back(mixed(dtype::float64, 9, 81).to(ctx.device()), d);
      }
      optimizer.apply_gradients(ctx, pairs);
      return f32({0});
    });
  };
  for (int kind : {0, 1, 2}) {
    step(cpu, on_cpu, d_cpu, kind);
    step(gpu, on_gpu, d_gpu, kind);
    for (size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_TRUE(gpu.local_results(on_gpu[i])[0].on_gpu());
      EXPECT_EQ(bytes_of(on_gpu[i].value()), bytes_of(on_cpu[i].value()))
          << on_gpu[i].name() << " after step " << kind;
    }
    EXPECT_EQ(bytes_of(d_gpu.value()), bytes_of(d_cpu.value())) << "after step " << kind;
  }
  EXPECT_NE(bytes_of(on_gpu[3].value()), bytes_of(mixed(dtype::float32, 1001, 4)));
}

TEST(VariableGpuTest, AnUpdateOnTheGpuIsInPlaceAndAHolderKeepsItsValues) {
  if (num_gpus() == 0)
    GTEST_SKIP() << "no GPU: " << gpus_unavailable_reason();
  one_device_strategy s("GPU:0");
  auto w = s.create_variable("w", f32({1, 2, 3}), mirrored(variable_aggregation::sum));
  sgd optimizer({.learning_rate = 0.5});
  auto step = [&] {
    s.run([&](replica_context& ctx) {
      optimizer.apply_gradients(ctx, {{f32({2, 2, 2}).to(ctx.device()), w}});
      ctx.assign_add(w, f32({1, 0, 0}).to(ctx.device()));
      return f32({0});
    });
  };
  const void* before = s.local_results(w)[0].raw_data();
  step(); // [1, 2, 3] - 0.5 * [2, 2, 2] + [1, 0, 0]
  EXPECT_EQ(s.local_results(w)[0].raw_data(), before) << "the copy was not updated in place";
  expect_copies(s, w, {1, 1, 2});
  const tensor held = w.value(); // someone else holds the copy now
  step();
  expect_copies(s, w, {1, 0, 1});
  EXPECT_EQ(values(held), (std::vector<float>{1, 1, 2})) << "a holder saw the update";
}

TEST(VariableGpuTest, AssignAddAndSubOnGpuCopiesGiveTheHostsBitsForEveryFloatingDtype) {
  if (num_gpus() == 0)
    GTEST_SKIP() << "no GPU: " << gpus_unavailable_reason();
  for (auto type : floating_dtypes) {
    SCOPED_TRACE(to_string(type));
    one_device_strategy cpu("CPU:0");
    one_device_strategy gpu("GPU:0");
    const int64_t n = 37;
    for (auto* s : {static_cast<strategy*>(&cpu), static_cast<strategy*>(&gpu)}) {
      auto w = s->create_variable("w", mixed(type, n, 1), mirrored(variable_aggregation::sum));
      auto m = s->create_variable("m", mixed(type, n, 2), on_read(variable_aggregation::mean));
      s->run([&](replica_context& ctx) {
        ctx.assign_add(w, mixed(type, n, 3).to(ctx.device()));
        ctx.assign_sub(m, mixed(type, n, 4).to(ctx.device()));
        ctx.assign_add(m, mixed(type, n, 5)); // a host value for a GPU copy: copied there first
        return f32({0});
      });
      w.assign_sub(mixed(type, n, 6)); // outside a step, every copy
    }
    const auto on_cpu = cpu.variables();
    const auto on_gpu = gpu.variables();
    ASSERT_EQ(on_cpu.size(), 2u);
    ASSERT_EQ(on_gpu.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_TRUE(gpu.local_results(on_gpu[i])[0].on_gpu()) << on_gpu[i].name();
      EXPECT_EQ(bytes_of(on_gpu[i].value()), bytes_of(on_cpu[i].value())) << on_gpu[i].name();
      EXPECT_NE(bytes_of(on_gpu[i].value()), bytes_of(mixed(type, n, 1 + static_cast<int>(i))))
          << on_gpu[i].name() << " was not updated";
    }
  }
}

// -- plain values under MirroredStrategy --------------------------------------------------------

TEST(PlainValueTest, UnderMirroredStrategyMeanMinMaxReturnItAndSumProdAreRefused) {
  mirrored_strategy s(cpus(2));
  for (const char* op : {"MEAN", "MIN", "MAX"})
    EXPECT_EQ(values(s.reduce(op, f32({3}), std::nullopt)), (std::vector<float>{3})) << op;
  for (const char* op : {"SUM", "PROD"})
    EXPECT_TRUE(fails_with([&] { s.reduce(op, f32({3}), std::nullopt); }, errc::unsupported,
                           {"plain tensor under MirroredStrategy"}))
        << op;
  // One replica: every op returns it.
  mirrored_strategy one(cpus(1));
  EXPECT_EQ(values(one.reduce("SUM", f32({3}), std::nullopt)), (std::vector<float>{3}));
}

// -- two workers over the simulated network -----------------------------------------------------

/// Runs `fn(strategy, worker)` on every worker at once, as N processes would, and returns the
/// results in worker order; fails the test when one does not end within 30 s of wall time.
template <class F>
auto on_every_worker(testing::cluster& c, F fn) {
  using R = decltype(fn(c.strategy(0), 0));
  std::vector<std::future<R>> runs;
  for (int w = 0; w < c.workers(); ++w)
    runs.push_back(std::async(std::launch::async, [&c, fn, w] { return fn(c.strategy(w), w); }));
  for (auto& r : runs)
    EXPECT_EQ(r.wait_for(30s), std::future_status::ready) << c.describe();
  return runs;
}

class MultiWorkerVariableTest : public ::testing::TestWithParam<int> {
protected:
  testing::cluster c{{.workers = 2, .replicas_per_worker = GetParam(), .seed = 31}};
  float id_sum() const {
    const int n = 2 * GetParam();
    return static_cast<float>(n * (n + 1) / 2);
  }
};

TEST_P(MultiWorkerVariableTest, EveryWorkerStartsFromWorkerZerosInitialValue) {
  // Each worker computes another initial value; all start from worker 0's bytes.
  auto runs = on_every_worker(c, [](strategy& s, int w) {
    return s.create_variable("w", f32({static_cast<float>(w + 1), 2}));
  });
  for (int w = 0; w < 2; ++w) {
    auto v = runs[static_cast<size_t>(w)].get();
    expect_copies(c.strategy(w), v, {1, 2});
  }
}

TEST_P(MultiWorkerVariableTest, InitialValuesOfAnotherShapeFailOnEveryWorkerSayingWhy) {
  auto runs = on_every_worker(c, [](strategy& s, int w) {
    return test::error_of([&] { s.create_variable("w", tensor::zeros(dtype::float32, {w + 1})); });
  });
  for (auto& r : runs) {
    auto e = r.get();
    EXPECT_EQ(e.code(), errc::collective_mismatch) << e.what();
    EXPECT_TRUE(test::contains(e, "every worker creates the same variables")) << e.what();
  }
}

TEST_P(MultiWorkerVariableTest, VariablesCreatedUnderOtherNamesFailOnEveryWorker) {
  auto runs = on_every_worker(c, [](strategy& s, int w) {
    return test::error_of([&] { s.create_variable(w == 0 ? "a" : "b", f32({0})); });
  });
  for (auto& r : runs) {
    auto e = r.get();
    EXPECT_NE(e.code(), errc::none) << "worker names differ, yet the creation succeeded";
    EXPECT_TRUE(test::contains(e, "every worker creates the same variables")) << e.what();
  }
}

TEST_P(MultiWorkerVariableTest, StepUpdatesCombineEveryReplicaOfEveryWorker) {
  auto made = on_every_worker(c, [](strategy& s, int) {
    return std::vector<variable>{
        s.create_variable("sum", f32({0}), mirrored(variable_aggregation::sum)),
        s.create_variable("first", f32({0}), mirrored(variable_aggregation::only_first_replica)),
        s.create_variable("none", f32({0})),
        s.create_variable("metric", f32({0}), on_read(variable_aggregation::sum))};
  });
  std::vector<std::vector<variable>> vars;
  for (auto& m : made)
    vars.push_back(m.get());
  auto steps = on_every_worker(c, [&vars](strategy& s, int w) {
    const auto& v = vars[static_cast<size_t>(w)];
    return s.run([&v](replica_context& ctx) {
      const float x = static_cast<float>(ctx.replica_id_in_sync_group() + 1);
      ctx.assign_add(v[0], f32({x}));
      ctx.assign_add(v[1], f32({x * 10}));
      ctx.assign_add(v[3], f32({x}));
      return ctx.read(v[3]);
    });
  });
  for (auto& r : steps)
    r.get();
  for (int w = 0; w < 2; ++w) {
    const auto& v = vars[static_cast<size_t>(w)];
    expect_copies(c.strategy(w), v[0], {id_sum()});
    expect_copies(c.strategy(w), v[1], {10}); // replica 0 of worker 0
  }
  // The sync-on-read aggregate spans every replica of every worker (read on every worker).
  auto reads = on_every_worker(c, [&vars](strategy&, int w) {
    return vars[static_cast<size_t>(w)][3].value().item<float>();
  });
  for (auto& r : reads)
    EXPECT_FLOAT_EQ(r.get(), id_sum());
  // Aggregation NONE fails on every worker with TF's message.
  auto none = on_every_worker(c, [&vars](strategy& s, int w) {
    const auto& v = vars[static_cast<size_t>(w)];
    return test::error_of([&] {
      s.run([&v](replica_context& ctx) {
        ctx.assign_add(v[2], f32({1}));
        return f32({0});
      });
    });
  });
  for (auto& r : none) {
    auto e = r.get();
    EXPECT_EQ(e.code(), errc::invalid_argument) << e.what();
    EXPECT_TRUE(test::contains(e, "You must specify an aggregation method")) << e.what();
  }
}

TEST_P(MultiWorkerVariableTest, SgdUpdatesEqualOneReplicasUpdatesOnTheGlobalBatch) {
  const auto data = make_data(13);
  auto runs = on_every_worker(c, [&data](strategy& s, int worker) {
    // Worker 1 starts from other values: the broadcast makes them worker 0's.
    const float shift = static_cast<float>(worker);
    auto w = s.create_variable("w", f32({0.5f + shift, -0.25f, 0.125f}));
    auto b = s.create_variable("b", tensor::scalar<float>(0.1f - shift));
    train(s, data, 4, {.learning_rate = 0.3, .momentum = 0.9}, w, b);
    return std::make_pair(s.local_results(w), s.local_results(b));
  });
  auto [want_w, want_b] = reference_sgd(data, 4, 0.3f, 0.9f);
  for (auto& r : runs) {
    auto [ws, bs] = r.get();
    for (const auto& copy : ws)
      expect_close(values(copy), want_w, "w on " + c.describe());
    for (const auto& copy : bs)
      expect_close(values(copy), {want_b}, "b on " + c.describe());
  }
}

// TF's rule for a plain value under MultiWorkerMirroredStrategy: a host value is one
// contribution per worker, summed (or averaged) across the workers.
TEST_P(MultiWorkerVariableTest, APlainValueIsOneContributionPerWorker) {
  auto runs = on_every_worker(c, [](strategy& s, int w) {
    const auto x = f32({static_cast<float>(w + 1)});
    return std::make_pair(s.reduce("SUM", x, std::nullopt).item<float>(),
                          s.reduce("MEAN", x, std::nullopt).item<float>());
  });
  for (auto& r : runs) {
    auto [sum, mean] = r.get();
    EXPECT_EQ(sum, 3.0f);
    EXPECT_EQ(mean, 1.5f);
  }
}

INSTANTIATE_TEST_SUITE_P(ReplicasPerWorker, MultiWorkerVariableTest, ::testing::Values(1, 2),
                         [](const auto& info) {
                           return "TwoWorkersOf" + std::to_string(info.param);
                         });

} // namespace
} // namespace consort
