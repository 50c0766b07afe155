// tf.distribute's contexts through the public API: what a step function (replica context) may not
// call, replica_context::merge_call (a function run once in cross-replica context), and the
// regrouping of run's results. Real replica threads; nothing sleeps: a replica that must come late
// waits on an event that its peers set.

#include <consort/consort.hpp>

#include "support/expect_error.hpp"
#include "support/strategy_helpers.hpp"

#include "support/free_port.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
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
using test::free_port;

tensor f32(float v) {
  return tensor::scalar<float>(v);
}

float value_of(const tensor& t) {
  return t.item<float>();
}

// -- cross-replica calls inside a step ----------------------------------------------------------

TEST(ContextsTest, CrossReplicaCallsInsideAStepFailNamingTheCallAndTheReplica) {
  mirrored_strategy s(cpus(2));
  auto ones = s.run([](replica_context&) { return f32(1.0f); });
  // Each call, made inside a step, fails the step with invalid_argument (no hang, no value).
  const std::vector<std::pair<std::string, std::function<void()>>> calls = {
      {"strategy.reduce",
       [&] {
         s.reduce("SUM", ones, std::nullopt);
       }},
      {"strategy.reduce",
       [&] {
         s.reduce("MEAN", f32(1.0f), std::nullopt);
       }},
      {"strategy.reduce_async",
       [&] {
         s.reduce_async("SUM", ones, std::nullopt);
       }},
      {"strategy.gather",
       [&] {
         s.gather(ones, 0);
       }},
      {"strategy.gather_async",
       [&] {
         s.gather_async(ones, 0);
       }},
      {"strategy.local_results",
       [&] {
         s.local_results(ones);
       }},
      {"strategy.run",
       [&] {
         s.run([](replica_context&) { return f32(0.0f); });
       }},
      {"strategy.run",
       [&] {
         s.run_async([](replica_context&) { return f32(0.0f); });
       }},
  };
  for (const auto& [name, call] : calls) {
    EXPECT_TRUE(fails_with(
        [&] {
          s.run([&, call = call](replica_context&) {
            call();
            return f32(0.0f);
          });
        },
        errc::invalid_argument,
        {name + " requires cross-replica context", "inside a step function", "merge_call"}))
        << name;
  }
  // The same calls outside a step work, and the strategy still runs steps.
  EXPECT_EQ(value_of(s.reduce("SUM", ones, std::nullopt)), 2.0f);
  EXPECT_EQ(s.local_results(ones).size(), 2u);
  auto again = s.run([](replica_context& ctx) { return ctx.all_reduce("SUM", f32(1.0f)); });
  EXPECT_EQ(value_of(again[1]), 2.0f);
}

TEST(ContextsTest, TheErrorNamesTheReplicaAndStepOfTheContext) {
  one_device_strategy s("CPU:0");
  s.run([](replica_context&) { return f32(0.0f); }); // step 0
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([&](replica_context&) {
          s.reduce("SUM", f32(1.0f), std::nullopt);
          return f32(0.0f);
        });
      },
      errc::invalid_argument, {"replica context of replica 0, step 1"}));
}

// -- merge_call ---------------------------------------------------------------------------------

TEST(MergeCallTest, RunsOnceWithEveryReplicasValuesAndEveryReplicaGetsTheResult) {
  mirrored_strategy s(cpus(3));
  std::atomic<int> runs{0};
  std::atomic<strategy*> seen{nullptr};
  auto out = s.run([&](replica_context& ctx) {
    auto mine = f32(static_cast<float>(ctx.replica_id_in_sync_group() + 1));
    return ctx.merge_call(
        [&](strategy& st, const per_replica<tensor>& v) {
          ++runs;
          seen = &st;
          // In cross-replica context: reduce and local_results are allowed here.
          EXPECT_EQ(st.local_results(v).size(), 3u);
          EXPECT_EQ(value_of(v[0]), 1.0f);
          EXPECT_EQ(value_of(v[2]), 3.0f);
          return st.reduce("SUM", v, std::nullopt);
        },
        mine);
  });
  EXPECT_EQ(runs.load(), 1);
  EXPECT_EQ(seen.load(), &s);
  ASSERT_EQ(out.size(), 3u);
  for (const auto& t : out)
    EXPECT_EQ(value_of(t), 6.0f);
}

TEST(MergeCallTest, APerReplicaResultGivesEachReplicaItsOwnComponent) {
  mirrored_strategy s(cpus(2));
  auto out = s.run([](replica_context& ctx) {
    auto grads = nest::dict({{"w", f32(static_cast<float>(ctx.local_replica_index() + 1))}});
    auto doubled = ctx.merge_call(
        [](strategy&, const per_replica<nest>& g) {
          std::vector<nest> each;
          for (const auto& n : g)
            each.push_back(nest::dict({{"w", f32(2.0f * value_of(n["w"].as_tensor()))}}));
          return per_replica<nest>(std::move(each));
        },
        grads);
    static_assert(std::is_same_v<decltype(doubled), nest>);
    return doubled["w"].as_tensor();
  });
  EXPECT_EQ(value_of(out[0]), 2.0f);
  EXPECT_EQ(value_of(out[1]), 4.0f);
}

TEST(MergeCallTest, SeveralMergeCallsOfAStepMatchInOrderAndAVoidFunctionReturnsNothing) {
  mirrored_strategy s(cpus(2));
  std::atomic<int> side_effects{0};
  auto out = s.run([&](replica_context& ctx) {
    ctx.merge_call([&](strategy&) { ++side_effects; });
    auto a = ctx.merge_call([](strategy&, const per_replica<tensor>& v) { return v[0]; },
                            f32(static_cast<float>(10 + ctx.local_replica_index())));
    auto b = ctx.merge_call([](strategy&, const per_replica<tensor>& v) { return v[1]; },
                            f32(static_cast<float>(20 + ctx.local_replica_index())));
    return nest::list({a, b});
  });
  EXPECT_EQ(side_effects.load(), 1);
  for (const auto& v : out) {
    EXPECT_EQ(value_of(v[0].as_tensor()), 10.0f);
    EXPECT_EQ(value_of(v[1].as_tensor()), 21.0f);
  }
}

TEST(MergeCallTest, AReplicaThatFinishesWithoutTheCallAbortsItsPeersAtOnce) {
  strategy_options opts;
  opts.collective_timeout = 60s; // the abort comes at once, not at this deadline
  mirrored_strategy s(cpus(3), opts);
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([](replica_context& ctx) {
          if (ctx.replica_id_in_sync_group() == 1)
            return f32(0.0f);
          return ctx.merge_call([](strategy&, const per_replica<tensor>& v) { return v[0]; },
                                f32(1.0f));
        });
      },
      errc::collective_aborted,
      {"merge_call #0 of step 0", "replica 1 finished its step without calling it"}));
  // The next step runs normally.
  auto out = s.run([](replica_context& ctx) {
    return ctx.merge_call([](strategy&, const per_replica<tensor>& v) { return v[2]; },
                          f32(static_cast<float>(ctx.local_replica_index())));
  });
  EXPECT_EQ(value_of(out[0]), 2.0f);
}

TEST(MergeCallTest, AFailingReplicaFailsTheRunWithItsOwnErrorNotItsPeersAbort) {
  strategy_options opts;
  opts.collective_timeout = 60s;
  mirrored_strategy s(cpus(2), opts);
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([](replica_context& ctx) {
          if (ctx.replica_id_in_sync_group() == 1)
            throw std::runtime_error("bad batch");
          return ctx.merge_call([](strategy&, const per_replica<tensor>& v) { return v[0]; },
                                f32(1.0f));
        });
      },
      errc::step_failed, {"replica 1", "bad batch"}));
}

TEST(MergeCallTest, APeerThatNeverCallsTimesOutNamingIt) {
  strategy_options opts;
  opts.collective_timeout = 200ms;
  mirrored_strategy s(cpus(2), opts);
  // Replica 1 calls only after replica 0's call has failed, so it is missing at the deadline.
  auto late = std::make_shared<std::promise<void>>();
  auto go = late->get_future().share();
  auto err = test::error_of([&] {
    s.run([&, go](replica_context& ctx) {
      auto fn = [](strategy&, const per_replica<tensor>& v) {
        return v[0];
      };
      if (ctx.replica_id_in_sync_group() == 1) {
        if (go.wait_for(60s) != std::future_status::ready)
          throw std::runtime_error("replica 0's merge_call did not fail within 60 s");
        return ctx.merge_call(fn, f32(1.0f));
      }
      try {
        return ctx.merge_call(fn, f32(1.0f));
      } catch (...) {
        late->set_value();
        throw;
      }
    });
  });
  EXPECT_EQ(err.code(), errc::collective_timeout) << err.what();
  EXPECT_TRUE(test::contains(err, "replica(s) 1 did not call it within 200 ms")) << err.what();
}

TEST(MergeCallTest, TheFunctionsErrorReachesEveryReplicaWithItsCode) {
  mirrored_strategy s(cpus(2));
  std::vector<std::string> seen(2);
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([&](replica_context& ctx) {
          try {
            return ctx.merge_call(
                [](strategy&, const per_replica<tensor>&) -> tensor {
                  throw error(errc::unsupported, "no such optimizer");
                },
                f32(1.0f));
          } catch (const error& e) {
            seen[static_cast<size_t>(ctx.local_replica_index())] = e.what();
            throw;
          }
        });
      },
      errc::unsupported, {"merge_call #0 of step 0", "the merge function", "no such optimizer"}));
  for (const auto& text : seen)
    EXPECT_NE(text.find("no such optimizer"), std::string::npos) << text;
}

TEST(MergeCallTest, ReplicaCollectivesInsideTheFunctionAreRefused) {
  mirrored_strategy s(cpus(2));
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([](replica_context& ctx) {
          return ctx.merge_call(
              [&](strategy&, const per_replica<tensor>& v) { return ctx.all_reduce("SUM", v[0]); },
              f32(1.0f));
        });
      },
      errc::invalid_argument,
      {"replica_context::all_reduce requires replica context", "inside merge_call's function"}));
}

TEST(MergeCallTest, RunInsideTheFunctionIsRefusedRatherThanLeftToHang) {
  mirrored_strategy s(cpus(2));
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([](replica_context& ctx) {
          return ctx.merge_call(
              [](strategy& st, const per_replica<tensor>& v) {
                st.run([](replica_context&) { return f32(0.0f); });
                return v[0];
              },
              f32(1.0f));
        });
      },
      errc::invalid_argument,
      {"strategy.run cannot be called inside merge_call's function", "would never start"}));
}

TEST(MergeCallTest, ReplicasCallingDifferentFunctionsFailWithAMismatch) {
  mirrored_strategy s(cpus(2));
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([](replica_context& ctx) {
          if (ctx.local_replica_index() == 0)
            return ctx.merge_call([](strategy&, const per_replica<tensor>& v) { return v[0]; },
                                  f32(1.0f));
          return ctx.merge_call([](strategy&, const per_replica<tensor>& v) { return v[1]; },
                                f32(1.0f));
        });
      },
      errc::collective_mismatch, {"merge_call #0 of step 0", "different functions"}));
}

TEST(MergeCallTest, APerReplicaResultOfTheWrongSizeIsRefused) {
  mirrored_strategy s(cpus(2));
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([](replica_context& ctx) {
          return ctx.merge_call(
              [](strategy&, const per_replica<tensor>& v) {
                return per_replica<tensor>(std::vector<tensor>{v[0]});
              },
              f32(1.0f));
        });
      },
      errc::invalid_argument, {"1 components for 2 local replicas"}));
}

TEST(MergeCallTest, TheFunctionGetsTheStrategyObjectAfterItMoved) {
  mirrored_strategy first(cpus(2));
  mirrored_strategy moved(std::move(first));
  std::atomic<strategy*> seen{nullptr};
  moved.run([&](replica_context& ctx) {
    return ctx.merge_call(
        [&](strategy& st, const per_replica<tensor>& v) {
          seen = &st;
          return v[0];
        },
        f32(1.0f));
  });
  EXPECT_EQ(seen.load(), &moved);
}

TEST(MergeCallTest, AcrossWorkersTheFunctionReducesOverEveryReplicaOfEveryWorker) {
  const auto port = free_port();
  auto work = [port](int index) {
    auto spec = cluster_spec::dense(
        {{"worker",
          {"127.0.0.1:" + std::to_string(port), "127.0.0.1:" + std::to_string(port + 1)}}});
    multi_worker_options mw;
    mw.resolver = std::make_shared<simple_cluster_resolver>(spec, "worker", index);
    mw.devices = cpus(2);
    mw.log = [](const std::string&) {
    };
    multi_worker_mirrored_strategy s({}, mw);
    // Each worker's function sees its own 2 replicas; its reduce spans all 4 (ids 0..3).
    return s.run([](replica_context& ctx) {
      return ctx.merge_call(
          [](strategy& st, const per_replica<tensor>& v) {
            EXPECT_EQ(v.size(), 2u);
            return st.reduce("SUM", v, std::nullopt);
          },
          f32(static_cast<float>(ctx.replica_id_in_sync_group())));
    });
  };
  auto other = std::async(std::launch::async, work, 1);
  auto mine = work(0);
  auto theirs = other.get();
  for (const auto& t : mine)
    EXPECT_EQ(value_of(t), 6.0f);
  for (const auto& t : theirs)
    EXPECT_EQ(value_of(t), 6.0f);
}

// -- regrouping run's results -------------------------------------------------------------------

TEST(RegroupTest, RunFailsWhenReplicasReturnDifferentStructuresNamingBoth) {
  mirrored_strategy s(cpus(2));
  EXPECT_TRUE(fails_with(
      [&] {
        s.run([](replica_context& ctx) {
          if (ctx.local_replica_index() == 0)
            return nest::list({});
          return nest::list({f32(1.0f)});
        });
      },
      errc::structure_mismatch, {"step 0: replica 0 returned [] and replica 1 returned [T]"}));
  // Different shapes in the same structure are fine (a partial batch).
  auto ok = s.run([](replica_context& ctx) {
    return nest::dict({{"x", tensor::zeros(dtype::float32, {ctx.local_replica_index() + 1})}});
  });
  EXPECT_EQ(ok.size(), 2u);
}

TEST(RegroupTest, GivesTheStepsStructureWithAPerReplicaAtEachLeaf) {
  mirrored_strategy s(cpus(2));
  auto out = s.run([](replica_context& ctx) {
    auto id = static_cast<float>(ctx.replica_id_in_sync_group());
    return nest::dict({{"loss", f32(id)}, {"metrics", nest::list({f32(10 + id), f32(20 + id)})}});
  });
  auto r = regroup(out);
  EXPECT_TRUE(r.is_dict());
  EXPECT_EQ(r.keys(), (std::vector<std::string>{"loss", "metrics"}));
  per_replica<tensor> loss = r["loss"];
  EXPECT_EQ(value_of(loss[1]), 1.0f);
  EXPECT_EQ(value_of(s.reduce("SUM", r["loss"], std::nullopt)), 1.0f);
  EXPECT_EQ(r["metrics"].size(), 2u);
  EXPECT_EQ(value_of(r["metrics"][1].leaf()[0]), 20.0f);
  EXPECT_EQ(r["metrics"].values().size(), 2u);
  // Errors say where in the structure the index went wrong.
  EXPECT_TRUE(fails_with([&] { r["nope"]; }, errc::out_of_range, {"nope"}));
  EXPECT_TRUE(fails_with([&] { r["metrics"][2]; }, errc::out_of_range,
                         {"regrouped[\"metrics\"] is a list of 2", "index 2"}));
  EXPECT_TRUE(fails_with([&] { r["loss"]["x"]; }, errc::structure_mismatch,
                         {"regrouped[\"loss\"] is a tensor, not a dict"}));
  EXPECT_TRUE(fails_with([&] { r["metrics"].leaf(); }, errc::structure_mismatch,
                         {"is a list of 2, not a leaf"}));
  EXPECT_TRUE(fails_with([&] { r[0]; }, errc::structure_mismatch, {"not a list"}));
}

TEST(RegroupTest, ValuesOfDifferentStructuresAreRefused) {
  per_replica<nest> mixed(std::vector<nest>{nest::list({f32(1.0f)}), nest(f32(2.0f))});
  EXPECT_TRUE(fails_with([&] { regroup(mixed); }, errc::structure_mismatch,
                         {"local replica 0 has [T] and local replica 1 has T"}));
  EXPECT_TRUE(fails_with([] { regroup(per_replica<nest>{}); }, errc::invalid_argument,
                         {"at least one component"}));
}

} // namespace
} // namespace consort
