// Elastic groups under consort::testing (docs/testing.md, "Elastic clusters"): workers killed
// between steps, inside a collective (a filter's crash_sender at an exact message) and during a
// re-formation, or restarted there (in place, or after their loss, joining at a step boundary);
// the survivors re-form, roll back to their last commit and finish, a new process takes the
// group's state and finishes with them, or, with fewer than the minimum left, every one fails
// with peer_lost. Nothing hangs, every survivor ends with the same weights, and a scenario run
// twice with its seed ends with the same weights.

#include <consort/consort.hpp>
#include <consort/testing.hpp>

#include "device/checkpoint_seam.hpp"
#include "support/expect_error.hpp"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace consort {
namespace {

using namespace std::chrono_literals;
using consort::test::fails_with;
using testing::cluster;

tensor one_sum(replica_context& ctx) {
  return ctx.all_reduce("SUM", tensor::scalar<float>(1.0f));
}

/// Runs `fn(w)` for every worker of `workers` at once, each on its own thread (as N processes
/// would), and waits for all of them, each bounded.
template <class F>
void on_each(const std::vector<int>& workers, F fn) {
  std::vector<std::future<void>> running;
  for (int w : workers)
    running.push_back(std::async(std::launch::async, [&fn, w] { fn(w); }));
  for (auto& f : running)
    ASSERT_EQ(f.wait_for(60s), std::future_status::ready) << "a worker did not end within 60 s";
  for (auto& f : running)
    f.get();
}

nest add_one(replica_context& ctx, variable& v) {
  ctx.assign_add(v, tensor::from<float>({1, 1}, {2}));
  return nest{};
}

TEST(ElasticCluster, AKilledWorkerLeavesTheOthersToGoOnInTheNextEpoch) {
  cluster c({.workers = 3, .replicas_per_worker = 2, .seed = 1, .elastic_min_workers = 2});
  for (auto& f : c.run_all(one_sum))
    for (const auto& t : f.get())
      EXPECT_EQ(t.item<float>(), 6.0f);
  EXPECT_EQ(c.epoch(), 1u);
  c.kill(1);
  EXPECT_EQ(c.epoch(), 2u);
  EXPECT_EQ(c.members(), (std::vector<int>{0, 2}));
  EXPECT_FALSE(c.alive(1));
  // The survivors' next calls fail with membership_changed naming the lost worker.
  for (int w : {0, 2})
    EXPECT_TRUE(fails_with(
        [&] { c.strategy(w).run(one_sum); }, errc::membership_changed,
        {"worker:1 (rank 1): connection closed without leave", "it re-forms as epoch 2"}));
  for (int w : {0, 2}) {
    auto change = c.strategy(w).reform();
    EXPECT_EQ(change.epoch_before, 1u);
    EXPECT_EQ(change.epoch, 2u);
    EXPECT_EQ(change.workers_before, 3);
    EXPECT_EQ(change.workers, 2);
    EXPECT_EQ(change.lost, (std::vector<std::string>{"worker:1"}));
    EXPECT_TRUE(change.joined.empty());
  }
  EXPECT_EQ(c.strategy(0).worker_rank(), 0);
  EXPECT_EQ(c.strategy(2).worker_rank(), 1);
  EXPECT_EQ(c.strategy(2).num_replicas_in_sync(), 4);
  auto a = c.strategy(0).run_async(one_sum);
  auto b = c.strategy(2).run_async(one_sum);
  for (auto* f : {&a, &b})
    for (const auto& t : f->get())
      EXPECT_EQ(t.item<float>(), 4.0f);
  // The second epoch's messages are logged with it.
  bool second = false;
  for (const auto& m : c.messages())
    second = second || (m.epoch == 2 && m.from == 2 && m.to == 0);
  EXPECT_TRUE(second);
}

TEST(ElasticCluster, ALostChiefIsSucceededByTheNextWorker) {
  cluster c({.workers = 3, .seed = 2, .elastic_min_workers = 1});
  for (auto& f : c.run_all(one_sum))
    f.get();
  c.kill(0);
  EXPECT_EQ(c.members(), (std::vector<int>{1, 2}));
  for (int w : {1, 2})
    c.strategy(w).reform();
  EXPECT_EQ(c.strategy(1).worker_rank(), 0);
  EXPECT_EQ(c.strategy(2).worker_rank(), 1);
  auto a = c.strategy(1).run_async(one_sum);
  auto b = c.strategy(2).run_async(one_sum);
  EXPECT_EQ(a.get().values().front().item<float>(), 2.0f);
  EXPECT_EQ(b.get().values().front().item<float>(), 2.0f);
}

TEST(ElasticCluster, BelowTheMinimumTheGroupEndsWithPeerLostAndReformSaysSo) {
  cluster c({.workers = 2, .seed = 3, .elastic_min_workers = 2});
  for (auto& f : c.run_all(one_sum))
    f.get();
  c.kill(1);
  EXPECT_EQ(c.epoch(), 1u);
  EXPECT_TRUE(fails_with([&] { c.strategy(0).run(one_sum); }, errc::peer_lost,
                         {"lost worker:1 (rank 1)", "fewer than the minimum of 2"}));
  EXPECT_TRUE(fails_with([&] { c.strategy(0).reform(); }, errc::peer_lost,
                         {"the elastic group ended", "fewer than the minimum of 2"}));
}

TEST(ElasticCluster, AMalformedMinimumIsRefused) {
  EXPECT_TRUE(fails_with([] { cluster c({.workers = 2, .elastic_min_workers = 3}); },
                         errc::invalid_argument,
                         {"elastic_min_workers is 3", "1 to the number of workers (2)"}));
  EXPECT_TRUE(fails_with([] { cluster c({.workers = 2, .elastic_min_workers = -1}); },
                         errc::invalid_argument, {"elastic_min_workers is -1"}));
}

// Partitions (docs/multi_worker.md, "Partitions"): the side with its quorum goes on, the chief's
// with half of the members (ties go to it), a successor's with more than half; the other side's
// groups end, so that the two never train apart.
TEST(ElasticCluster, APartitionLeavesTheChiefsSideWithHalfAndEndsTheOther) {
  cluster c({.workers = 4, .seed = 13, .elastic_min_workers = 1});
  for (auto& f : c.run_all(one_sum))
    f.get();
  c.partition({1, 3});
  c.advance(5001ms);
  EXPECT_EQ(c.epoch(), 2u);
  EXPECT_EQ(c.members(), (std::vector<int>{0, 2}));
  for (int w : {1, 3})
    EXPECT_TRUE(fails_with([&] { c.strategy(w).run(one_sum); }, errc::peer_lost,
                           {"the group of workers ended: 2 of the 4 members of epoch 1 remain, "
                            "not a majority"}))
        << "worker " << w;
  for (int w : {0, 2})
    EXPECT_TRUE(fails_with([&] { c.strategy(w).run(one_sum); }, errc::membership_changed,
                           {"worker:1, worker:3 sent no heartbeat for 5000 ms (partitioned by the "
                            "test harness)",
                            "it re-forms as epoch 2"}));
  on_each({0, 2}, [&](int w) { EXPECT_EQ(c.strategy(w).reform().epoch, 2u); });
  auto a = c.strategy(0).run_async(one_sum);
  auto b = c.strategy(2).run_async(one_sum);
  for (auto* f : {&a, &b})
    EXPECT_EQ(f->get().values().front().item<float>(), 2.0f);
  c.heal();
  EXPECT_TRUE(fails_with([&] { c.strategy(1).reform(); }, errc::peer_lost, {}));
}

TEST(ElasticCluster, APartitionThatCutsTheChiefOffAloneLeavesItsSuccessorToLead) {
  cluster c({.workers = 3, .seed = 14, .elastic_min_workers = 1});
  for (auto& f : c.run_all(one_sum))
    f.get();
  c.partition({0});
  c.advance(5001ms);
  EXPECT_EQ(c.members(), (std::vector<int>{1, 2}));
  EXPECT_TRUE(fails_with([&] { c.strategy(0).run(one_sum); }, errc::peer_lost,
                         {"1 of the 3 members of epoch 1 remain, fewer than half"}));
  for (int w : {1, 2})
    EXPECT_TRUE(fails_with(
        [&] { c.strategy(w).run(one_sum); }, errc::membership_changed,
        {"worker:0 (the chief's side) sent no heartbeat", "worker:1 succeeds the chief"}));
  on_each({1, 2}, [&](int w) { c.strategy(w).reform(); });
  EXPECT_EQ(c.strategy(1).worker_rank(), 0);
  auto a = c.strategy(1).run_async(one_sum);
  auto b = c.strategy(2).run_async(one_sum);
  for (auto* f : {&a, &b})
    EXPECT_EQ(f->get().values().front().item<float>(), 2.0f);
}

TEST(ElasticCluster, APartitionWithNoSideKeepingItsQuorumEndsEveryWorker) {
  // Of 5: the chief and its successor (2, fewer than half) against 3 without the successor.
  cluster c({.workers = 5, .seed = 15, .elastic_min_workers = 1});
  for (auto& f : c.run_all(one_sum))
    f.get();
  c.partition({0, 1});
  c.advance(5001ms);
  for (int w : {0, 1})
    EXPECT_TRUE(fails_with([&] { c.strategy(w).run(one_sum); }, errc::peer_lost,
                           {"2 of the 5 members of epoch 1 remain, fewer than half"}));
  for (int w : {2, 3, 4})
    EXPECT_TRUE(fails_with([&] { c.strategy(w).run(one_sum); }, errc::peer_lost,
                           {"3 of the 5 members of epoch 1 remain",
                            "the chief's successor worker:1 is on the other side"}));
  EXPECT_EQ(c.epoch(), 1u);
}

TEST(ElasticCluster, ARestartedWorkerTakesItsOldPlaceAndTheGroupsState) {
  cluster c({.workers = 3, .replicas_per_worker = 2, .seed = 4, .elastic_min_workers = 3});
  std::vector<std::optional<variable>> v(3);
  std::vector<std::unique_ptr<elastic_state>> state(3);
  const auto step = [](int64_t n) {
    return nest::dict({{"step", tensor::scalar<int64_t>(n)}});
  };
  on_each({0, 1, 2}, [&](int w) {
    auto& st = c.strategy(w);
    v[w] = st.create_variable("w", tensor::zeros(dtype::float32, {2}),
                              {variable_synchronization::on_write, variable_aggregation::mean});
    state[w] = std::make_unique<elastic_state>(st);
    state[w]->commit(step(0));
    for (int i = 0; i < 2; ++i)
      st.run([&](replica_context& ctx) { return add_one(ctx, *v[w]); });
    state[w]->commit(step(2));
  });
  auto& old = c.strategy(1);
  c.restart(1);
  // With a minimum of 3 a loss would end the group; the new process keeps it whole.
  EXPECT_EQ(c.epoch(), 2u);
  EXPECT_EQ(c.members(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(c.restarts(1), 1);
  EXPECT_EQ(c.restarts(0), 0);
  EXPECT_TRUE(c.alive(1));
  auto& fresh = c.strategy(1);
  EXPECT_NE(&fresh, &old);
  EXPECT_EQ(&c.await_restart(1, 1), &fresh);
  EXPECT_TRUE(
      fails_with([&] { old.run(one_sum); }, errc::peer_lost, {"killed by the test harness"}));
  for (int w : {0, 2})
    EXPECT_TRUE(
        fails_with([&] { c.strategy(w).run(one_sum); }, errc::membership_changed,
                   {"worker:1 (rank 1): connection closed without leave",
                    "a new process of its task joins in its place", "it re-forms as epoch 2"}));
  EXPECT_EQ(fresh.membership_epoch(), 2u);
  EXPECT_EQ(fresh.worker_rank(), 1);
  EXPECT_EQ(fresh.num_replicas_in_sync(), 6);
  // The new process makes its variables (no creation broadcast: the others make none now) and
  // commits them; the survivors re-form; every worker's sync takes the group's state.
  on_each({0, 1, 2}, [&](int w) {
    auto& st = c.strategy(w);
    if (w == 1) {
      v[1] = st.create_variable("w", tensor::from<float>({100, 100}, {2}),
                                {variable_synchronization::on_write, variable_aggregation::mean});
      state[1] = std::make_unique<elastic_state>(st);
      state[1]->commit(step(0));
    } else {
      auto change = st.reform();
      EXPECT_EQ(change.epoch_before, 1u);
      EXPECT_EQ(change.epoch, 2u);
      EXPECT_EQ(change.workers_before, 3);
      EXPECT_EQ(change.workers, 3);
    }
    EXPECT_EQ(state[w]->sync()["step"].as_tensor().item<int64_t>(), 2) << "worker " << w;
    st.run([&](replica_context& ctx) { return add_one(ctx, *v[w]); });
  });
  for (int w = 0; w < 3; ++w)
    EXPECT_EQ(v[w]->value().to_vector<float>(), (std::vector<float>{3, 3})) << "worker " << w;
}

TEST(ElasticCluster, ASyncTakesTheGroupsStateNotANewProcesssEvenWhenItIsRankZero) {
  cluster c({.workers = 3, .seed = 7, .elastic_min_workers = 2});
  std::vector<std::optional<variable>> v(3);
  std::vector<std::unique_ptr<elastic_state>> state(3);
  const auto step = [](int64_t n) {
    return nest::dict({{"step", tensor::scalar<int64_t>(n)}});
  };
  const variable_options mean{variable_synchronization::on_write, variable_aggregation::mean};
  on_each({0, 1, 2}, [&](int w) {
    auto& st = c.strategy(w);
    v[w] = st.create_variable("w", tensor::zeros(dtype::float32, {2}), mean);
    state[w] = std::make_unique<elastic_state>(st);
    state[w]->commit(step(0));
    for (int i = 0; i < 2; ++i)
      st.run([&](replica_context& ctx) { return add_one(ctx, *v[w]); });
    state[w]->commit(step(2));
    EXPECT_FALSE(st.joined_running_group());
  });
  c.restart(1);
  auto& fresh = c.strategy(1);
  EXPECT_TRUE(fresh.joined_running_group());
  v[1] = fresh.create_variable("w", tensor::from<float>({100, 100}, {2}), mean);
  state[1] = std::make_unique<elastic_state>(fresh);
  state[1]->commit(step(0));
  // The chief is lost before the new process synced: in epoch 3 the new process is rank 0.
  c.kill(0);
  EXPECT_EQ(c.members(), (std::vector<int>{1, 2}));
  on_each({1, 2}, [&](int w) {
    auto& st = c.strategy(w);
    EXPECT_EQ(st.reform().epoch, 3u);
    EXPECT_EQ(state[w]->sync()["step"].as_tensor().item<int64_t>(), 2) << "worker " << w;
  });
  EXPECT_EQ(fresh.worker_rank(), 0);
  for (int w : {1, 2})
    EXPECT_EQ(v[w]->value().to_vector<float>(), (std::vector<float>{2, 2})) << "worker " << w;
  // Synced, its commit is the group's state like any other (it is rank 0 now).
  EXPECT_TRUE(fresh.joined_running_group());
}

TEST(ElasticCluster, AChangeWhileTheVariablesAreMadeIsMetAtTheNextCallAndTheSyncAgrees) {
  cluster c({.workers = 3, .seed = 6, .elastic_min_workers = 2});
  c.kill(2); // before the variables are made: their creation broadcast meets the change
  std::vector<std::optional<variable>> v(2);
  on_each({0, 1}, [&](int w) {
    const float own = 10.0f * static_cast<float>(w + 1); // each worker a value of its own
    v[static_cast<size_t>(w)] =
        c.strategy(w).create_variable("w", tensor::from<float>({own, own}, {2}));
  });
  // Each made it from its own initial value, and the change fails the next call.
  EXPECT_EQ(v[0]->value().to_vector<float>(), (std::vector<float>{10, 10}));
  EXPECT_EQ(v[1]->value().to_vector<float>(), (std::vector<float>{20, 20}));
  on_each({0, 1}, [&](int w) {
    auto& st = c.strategy(w);
    elastic_state state{st};
    state.commit();
    EXPECT_TRUE(fails_with([&] { state.sync(); }, errc::membership_changed,
                           {"worker:2 (rank 2)", "it re-forms as epoch 2"}));
    st.reform();
    state.sync();
  });
  // The sync gave both worker 0's values, as the broadcast would have.
  for (int w : {0, 1})
    EXPECT_EQ(v[static_cast<size_t>(w)]->value().to_vector<float>(), (std::vector<float>{10, 10}))
        << "worker " << w;
}

TEST(ElasticCluster, VariablesWhoseCreationFailsForAnyOtherReasonStillThrow) {
  // Not elastic: a loss while the variables are made ends the run, saying where.
  {
    cluster c({.workers = 3, .seed = 7});
    c.kill(2);
    on_each({0, 1}, [&](int w) {
      EXPECT_TRUE(fails_with(
          [&] { c.strategy(w).create_variable("w", tensor::zeros(dtype::float32, {2})); },
          errc::peer_lost,
          {"create_variable(\"w\")", "the broadcast of worker 0's initial value failed"}));
    });
  }
  // Elastic: initial values of another shape are the caller's mistake, not a change of the group.
  cluster c({.workers = 2, .seed = 8, .elastic_min_workers = 1});
  on_each({0, 1}, [&](int w) {
    EXPECT_TRUE(fails_with(
        [&] { c.strategy(w).create_variable("w", tensor::zeros(dtype::float32, {2 + w})); },
        errc::collective_mismatch, {"create_variable(\"w\")", "initial values of one shape"}));
  });
}

TEST(ElasticCluster, AFilterRestartsASenderInsideACollective) {
  cluster c({.workers = 3, .seed = 5, .elastic_min_workers = 3});
  for (auto& f : c.run_all(one_sum))
    f.get();
  const auto sent = c.messages().size();
  c.on_message([](const testing::message& m) {
    return m.epoch == 1 && m.from == 2 && m.to == 0 ? testing::verdict::restart_sender()
                                                    : testing::verdict::deliver();
  });
  auto calls = c.run_all(one_sum);
  // Worker 0 never gets worker 2's part: its call fails with the change. Worker 1 may have had
  // every part before the change reached it; its next call fails then.
  EXPECT_TRUE(fails_with([&] { calls[0].get(); }, errc::membership_changed,
                         {"a new process of its task joins in its place"}));
  EXPECT_TRUE(fails_with([&] { calls[2].get(); }, errc::peer_lost, {"killed by the test harness"}));
  try {
    calls[1].get();
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::membership_changed) << e.what();
  }
  auto& fresh = c.await_restart(2, 1);
  EXPECT_EQ(c.restarts(2), 1);
  EXPECT_EQ(fresh.membership_epoch(), 2u);
  bool dropped = false;
  for (size_t i = sent; i < c.messages().size(); ++i)
    dropped =
        dropped || (c.messages()[i].from == 2 && c.messages()[i].what == testing::fate::dropped);
  EXPECT_TRUE(dropped) << "the restarting sender's message is lost with its process";
  on_each({0, 1}, [&](int w) { c.strategy(w).reform(); });
  for (auto& f : c.run_all(one_sum))
    EXPECT_EQ(f.get().values().front().item<float>(), 3.0f);
}

/// Each worker's variable `w` (two floats, MEAN) and its elastic_state, for the restart tests.
struct trained_workers {
  explicit trained_workers(cluster& cl) : c(cl), v(4), state(4) {}
  cluster& c;
  std::vector<std::optional<variable>> v;
  std::vector<std::unique_ptr<elastic_state>> state;
  static nest at(int64_t n) { return nest::dict({{"step", tensor::scalar<int64_t>(n)}}); }
  /// Worker `w` makes its variable from `initial` and commits it as step 0.
  void make(int w, float initial) {
    auto& st = c.strategy(w);
    v[w] = st.create_variable("w", tensor::from<float>({initial, initial}, {2}),
                              {variable_synchronization::on_write, variable_aggregation::mean});
    state[w] = std::make_unique<elastic_state>(st);
    state[w]->commit(at(0));
  }
  void step(int w) {
    c.strategy(w).run([this, w](replica_context& ctx) { return add_one(ctx, *v[w]); });
  }
  /// Every worker of `ws` at once: its variable from 0, one step, a commit of step 1.
  void start(const std::vector<int>& ws) {
    on_each(ws, [this](int w) {
      make(w, 0);
      step(w);
      state[w]->commit(at(1));
    });
  }
  int64_t sync(int w) { return state[w]->sync()["step"].as_tensor().item<int64_t>(); }
  std::vector<float> value(int w) { return v[w]->value().to_vector<float>(); }
};

TEST(ElasticCluster, AKilledWorkerRestartedJoinsAtTheOthersNextStepBoundary) {
  cluster c({.workers = 3, .seed = 8, .elastic_min_workers = 2});
  trained_workers t(c);
  t.start({0, 1, 2});
  c.kill(2);
  on_each({0, 1}, [&](int w) {
    EXPECT_EQ(c.strategy(w).reform().epoch, 2u);
    EXPECT_EQ(t.sync(w), 1);
    t.step(w);
  });
  c.restart(2);
  EXPECT_EQ(c.restarts(2), 1);
  EXPECT_EQ(c.epoch(), 3u);
  EXPECT_EQ(c.members(), (std::vector<int>{0, 1, 2}));
  auto& fresh = c.strategy(2);
  EXPECT_EQ(fresh.membership_epoch(), 3u);
  EXPECT_TRUE(fresh.joined_running_group());
  // A join aborts nothing: the others' steps go on in epoch 2 until their next boundary, where
  // the commit is kept and then fails with the change; nothing is rolled back.
  on_each({0, 1, 2}, [&](int w) {
    if (w == 2) {
      t.make(2, 100);
    } else {
      t.step(w);
      EXPECT_EQ(c.strategy(w).membership_epoch(), 2u);
      EXPECT_TRUE(fails_with([&] { t.state[w]->commit(trained_workers::at(3)); },
                             errc::membership_changed,
                             {"the group of workers grows: worker:2 (rank 2) joins the group",
                              "it re-forms as epoch 3 at the workers' next step boundary"}));
      auto change = c.strategy(w).reform();
      EXPECT_EQ(change.epoch_before, 2u);
      EXPECT_EQ(change.epoch, 3u);
      EXPECT_EQ(change.joined, (std::vector<std::string>{"worker:2"}));
    }
    EXPECT_EQ(t.sync(w), 3) << "worker " << w;
    t.step(w);
  });
  for (int w = 0; w < 3; ++w)
    EXPECT_EQ(t.value(w), (std::vector<float>{4, 4})) << "worker " << w;
}

TEST(ElasticCluster, WithMaxRestartsAKilledWorkerIsLostThenJoinsAtTheNextBoundary) {
  cluster c({.workers = 3, .seed = 9, .elastic_min_workers = 2, .max_restarts = 1});
  trained_workers t(c);
  on_each({0, 1, 2}, [&](int w) { t.make(w, 0); });
  c.kill(1);
  // Its loss forms epoch 2 of workers 0 and 2; its new process joins them in epoch 3.
  EXPECT_EQ(c.restarts(1), 1);
  EXPECT_EQ(c.epoch(), 3u);
  EXPECT_TRUE(c.alive(1));
  on_each({0, 1, 2}, [&](int w) {
    if (w == 1) {
      t.make(1, 100);
    } else {
      EXPECT_TRUE(fails_with(
          [&] { t.step(w); }, errc::membership_changed,
          {"worker:1 (rank 1): connection closed without leave", "it re-forms as epoch 2"}));
      EXPECT_EQ(c.strategy(w).reform().epoch, 2u); // the loss first
      EXPECT_EQ(t.sync(w), 0);
      t.step(w);
      EXPECT_TRUE(fails_with([&] { t.state[w]->commit(trained_workers::at(1)); },
                             errc::membership_changed, {"worker:1 (rank 1) joins the group"}));
      EXPECT_EQ(c.strategy(w).reform().epoch, 3u); // then the join
    }
    EXPECT_EQ(t.sync(w), 1) << "worker " << w;
  });
  for (int w = 0; w < 3; ++w)
    EXPECT_EQ(t.value(w), (std::vector<float>{1, 1})) << "worker " << w;
  // No restart is left: the next death is a loss alone.
  c.kill(2);
  EXPECT_EQ(c.restarts(2), 0);
  EXPECT_EQ(c.epoch(), 4u);
  EXPECT_EQ(c.members(), (std::vector<int>{0, 1}));
}

TEST(ElasticCluster, AWorkerHungPastThePeerTimeoutIsLeftOutAndJoinsAgainWhenItGoesOn) {
  cluster c({.workers = 3, .seed = 10, .elastic_min_workers = 2});
  trained_workers t(c);
  t.start({0, 1, 2});
  c.hang(1);
  // The others' step waits for worker 1 until its silence is found.
  auto waiting =
      c.strategy(0).run_async([&](replica_context& ctx) { return add_one(ctx, *t.v[0]); });
  ASSERT_TRUE(c.wait_blocked(0));
  EXPECT_EQ(c.epoch(), 1u);
  c.advance(5001ms); // past the peer timeout (5 s)
  EXPECT_EQ(c.epoch(), 2u);
  EXPECT_EQ(c.members(), (std::vector<int>{0, 2}));
  EXPECT_TRUE(c.alive(1)) << "hung, not dead";
  EXPECT_TRUE(fails_with([&] { waiting.get(); }, errc::membership_changed,
                         {"worker:1 (rank 1): no heartbeat for 5000 ms (hung by the test harness)",
                          "it re-forms as epoch 2"}));
  // It goes on, learns it was left out, and joins again as the same process.
  c.resume(1);
  EXPECT_TRUE(fails_with([&] { t.step(1); }, errc::membership_changed,
                         {"the chief left this worker out of the group: worker:1 (rank 1): no "
                          "heartbeat for 5000 ms",
                          "reform() joins the group again"}));
  auto back = c.strategy(1).reform();
  EXPECT_EQ(back.epoch, 3u);
  EXPECT_EQ(back.joined, (std::vector<std::string>{"worker:1"}));
  EXPECT_EQ(c.members(), (std::vector<int>{0, 1, 2}));
  EXPECT_FALSE(c.strategy(1).joined_running_group()) << "the same process, with its state";
  on_each({0, 1, 2}, [&](int w) {
    if (w != 1) {
      EXPECT_EQ(c.strategy(w).reform().epoch, 2u);
      EXPECT_EQ(t.sync(w), 1);
      t.step(w);
      EXPECT_TRUE(fails_with([&] { t.state[w]->commit(trained_workers::at(2)); },
                             errc::membership_changed,
                             {"worker:1 (rank 1) joins the group again (left out while it hung)"}));
      EXPECT_EQ(c.strategy(w).reform().epoch, 3u);
    }
    EXPECT_EQ(t.sync(w), 2) << "worker " << w;
    t.step(w);
  });
  for (int w = 0; w < 3; ++w)
    EXPECT_EQ(t.value(w), (std::vector<float>{3, 3})) << "worker " << w;
}

TEST(ElasticCluster, AHungChiefIsReplacedAndEndsWhenItGoesOn) {
  cluster c({.workers = 3, .seed = 11, .elastic_min_workers = 2});
  for (auto& f : c.run_all(one_sum))
    f.get();
  c.hang(0);
  c.advance(5001ms);
  EXPECT_EQ(c.members(), (std::vector<int>{1, 2}));
  c.resume(0);
  EXPECT_TRUE(fails_with([&] { c.strategy(0).run(one_sum); }, errc::peer_lost,
                         {"the others went on under a successor while this worker, their chief, "
                          "was stopped",
                          "a stopped chief is replaced, not waited for"}));
  EXPECT_TRUE(fails_with([&] { c.strategy(0).reform(); }, errc::peer_lost, {}));
  on_each({1, 2}, [&](int w) { c.strategy(w).reform(); });
  EXPECT_EQ(c.strategy(1).worker_rank(), 0);
  auto a = c.strategy(1).run_async(one_sum);
  auto b = c.strategy(2).run_async(one_sum);
  for (auto* f : {&a, &b})
    EXPECT_EQ(f->get().values().front().item<float>(), 2.0f);
  // Of 2, the other is no majority: the silent chief may lead on behind a partition, so the
  // group ends rather than split (as the membership service's quorum).
  cluster pair({.workers = 2, .seed = 12, .elastic_min_workers = 1});
  pair.hang(0);
  pair.advance(5001ms);
  EXPECT_TRUE(fails_with([&] { pair.strategy(1).run(one_sum); }, errc::peer_lost,
                         {"1 of the 2 members of epoch 1 remain, not a majority"}));
  pair.resume(0);
}

TEST(ElasticCluster, ARestartIsRefusedForTheChiefADeadWorkerAndAClusterThatIsNotElastic) {
  cluster plain({.workers = 2});
  EXPECT_TRUE(fails_with([&] { plain.restart(1); }, errc::unsupported,
                         {"the cluster is not elastic", "kill the worker instead"}));
  cluster c({.workers = 3, .elastic_min_workers = 1});
  EXPECT_TRUE(fails_with([&] { c.restart(0); }, errc::unsupported,
                         {"worker:0 is the group's chief", "a restarted chief does not rejoin"}));
  c.kill(0);
  EXPECT_TRUE(fails_with([&] { c.restart(0); }, errc::unsupported,
                         {"worker:0 is the chief's task", "it is not restarted"}));
  EXPECT_EQ(c.restarts(0), 0);
  EXPECT_TRUE(fails_with([] { cluster bad({.workers = 2, .max_restarts = 1}); },
                         errc::invalid_argument,
                         {"max_restarts is 1", "more on an elastic cluster"}));
  EXPECT_TRUE(
      fails_with([] { cluster bad({.workers = 2, .elastic_min_workers = 1, .max_restarts = -1}); },
                 errc::invalid_argument, {"max_restarts is -1"}));
  cluster ended({.workers = 2, .elastic_min_workers = 2});
  ended.kill(1);
  EXPECT_TRUE(fails_with([&] { ended.restart(1); }, errc::invalid_argument,
                         {"worker:1 cannot rejoin: the elastic group ended"}));
  EXPECT_TRUE(fails_with([&] { c.await_restart(0, 1, 20ms); }, errc::collective_timeout,
                         {"worker 0 was restarted 0 times within 20 ms; expected 1"}));
  // A filter's restart of the chief is refused too: the message is delivered, the next call of
  // the test says why.
  cluster f({.workers = 2, .seed = 6, .elastic_min_workers = 1});
  f.on_message([](const testing::message& m) {
    return m.from == 0 ? testing::verdict::restart_sender() : testing::verdict::deliver();
  });
  for (auto& out : f.run_all(one_sum))
    EXPECT_EQ(out.get().values().front().item<float>(), 2.0f);
  EXPECT_TRUE(fails_with([&] { f.messages(); }, errc::invalid_argument,
                         {"verdict::restart_sender", "from worker 0 to worker 1 was refused",
                          "a restarted chief does not rejoin"}));
  EXPECT_EQ(f.restarts(0), 0);
  EXPECT_EQ(f.epoch(), 1u);
}

// -- seeded scenarios ------------------------------------------------------------------------

/// One scenario: who dies where. Steps add 1 to every element of `w` (MEAN over the replicas:
/// whatever the group's size, `w` ends at `steps` only if every roll-back went back to one
/// commit) and the number of replicas in sync to `u` (SUM: it records the group's size at each
/// step kept, so two runs agree only if they lost their workers at the same steps).
struct scenario {
  int workers = 3;
  int replicas = 1;
  int min_workers = 1;
  int steps = 8;
  int commit_every = 2;
  /// hangs: the victim stops before step `at` past the peer timeout, then goes on (left out,
  /// it joins again; worker 0, the chief, is replaced and ends). dies_writing: the victim, the
  /// chief, dies writing its checkpoint of commit `at` (counted modulo its commits) after
  /// `write_bytes` bytes.
  /// partition: before step `at`, the victim cuts the workers of `cut` off from the others
  /// (it may be one of them) for the peer timeout: the side with its quorum goes on, the other
  /// ends with peer_lost.
  /// in_setup: the victim dies sending its `at`-th message to `peer` from its start, while the
  /// workers make their variables (the creation broadcasts), before any commit.
  enum class kind {
    between_steps,
    in_collective,
    hangs,
    dies_writing,
    partition,
    in_setup
  } how = kind::between_steps;
  std::vector<int> cut;
  int write_bytes = 0;
  int victim = 0;
  int at = 0;      // between_steps: the step it dies before; in_collective: its message on the link
  int peer = 0;    // in_collective: the link's receiver
  int second = -1; // a worker that dies when it learns of the first change (during re-formation)
  /// What becomes of the victim: it dies; or a new process of its task takes its place at once
  /// (cluster::restart, verdict::restart_sender); or its loss is seen and then a new process
  /// joins at the survivors' next step boundary (cluster_options::max_restarts 1).
  enum class rebirth { none, in_place, after_loss } restart = rebirth::none;

  std::string describe(uint64_t seed) const {
    const auto when = [this]() -> std::string {
      switch (how) {
      case kind::between_steps:
        return " before step " + std::to_string(at);
      case kind::in_collective:
        return " sending its message " + std::to_string(at) + " to worker " + std::to_string(peer);
      case kind::in_setup:
        return " sending its message " + std::to_string(at) + " to worker " + std::to_string(peer) +
               " while the variables are made";
      case kind::hangs:
        return " hangs past the peer timeout before step " + std::to_string(at);
      case kind::dies_writing:
        return " writing its checkpoint of commit " + std::to_string(at) +
               " (modulo its commits), after " + std::to_string(write_bytes) + " bytes";
      case kind::partition: {
        std::string side;
        for (int w : cut)
          side += (side.empty() ? "" : ",") + std::to_string(w);
        return " cuts {" + side + "} off before step " + std::to_string(at);
      }
      }
      return {};
    };
    return "seed " + std::to_string(seed) + ": " + std::to_string(workers) + " workers x " +
           std::to_string(replicas) + ", min " + std::to_string(min_workers) + ", " +
           std::to_string(steps) + " steps, commit every " + std::to_string(commit_every) +
           ", worker " + std::to_string(victim) +
           (how == kind::hangs || how == kind::partition ? ""
            : restart == rebirth::in_place               ? " restarts in place"
            : restart == rebirth::after_loss             ? " dies, then rejoins"
                                                         : " dies") +
           when() +
           (second >= 0 ? ", worker " + std::to_string(second) + " dies during re-formation" : "");
  }
};

scenario make_scenario(uint64_t seed) {
  std::mt19937_64 rng(seed);
  scenario s;
  s.workers = 2 + static_cast<int>(rng() % 3);
  s.replicas = 1 + static_cast<int>(rng() % 2);
  s.min_workers = 1 + static_cast<int>(rng() % static_cast<uint64_t>(s.workers - 1));
  s.steps = 4 + static_cast<int>(rng() % 6);
  s.commit_every = 1 + static_cast<int>(rng() % 3);
  s.how = rng() % 2 == 0 ? scenario::kind::between_steps : scenario::kind::in_collective;
  s.victim = static_cast<int>(rng() % static_cast<uint64_t>(s.workers));
  s.at = static_cast<int>(rng() % static_cast<uint64_t>(s.steps));
  s.peer =
      (s.victim + 1 + static_cast<int>(rng() % static_cast<uint64_t>(s.workers - 1))) % s.workers;
  if (s.workers > 2 && rng() % 3 == 0)
    s.second =
        (s.victim + 1 + static_cast<int>(rng() % static_cast<uint64_t>(s.workers - 1))) % s.workers;
  // The first fault comes in epoch 1, where worker 0 is the chief, which is not restarted.
  if (s.victim != 0) {
    const auto r = rng() % 3;
    s.restart = r == 0   ? scenario::rebirth::in_place
                : r == 1 ? scenario::rebirth::after_loss
                         : scenario::rebirth::none;
  }
  if (rng() % 4 == 0) {
    s.how = scenario::kind::hangs; // the same process goes on: no restart
    s.restart = scenario::rebirth::none;
  } else if (rng() % 4 == 0) {
    s.how = scenario::kind::dies_writing; // the chief of epoch 1 is the one that writes
    s.victim = 0;
    s.restart = scenario::rebirth::none;
    s.write_bytes = static_cast<int>(rng() % 300); // a checkpoint here is 300-400 bytes
    if (s.second == 0)
      s.second = -1;
  } else if (rng() % 4 == 0) {
    s.how = scenario::kind::partition;
    s.restart = scenario::rebirth::none;
    const uint64_t mask = 1 + rng() % ((uint64_t{1} << s.workers) - 2); // some, not all
    for (int w = 0; w < s.workers; ++w)
      if (mask & (uint64_t{1} << w))
        s.cut.push_back(w);
  } else if (rng() % 4 == 0) {
    // (Drawn last, so that the seeds of the other kinds keep their scenarios.) Each variable's
    // creation broadcast sends one message to each peer: the first or the second.
    s.how = scenario::kind::in_setup;
    s.at = static_cast<int>(rng() % 2);
  }
  return s;
}

/// How one worker's loop ended.
struct result {
  bool killed = false;    // it died as the scenario said
  errc code = errc::none; // what ended it otherwise (none: it finished)
  std::string text;
  std::vector<float> w, u;
  uint64_t epoch = 0;
  int64_t step = 0;
  /// The most steps a sync took this worker back from its own last commit: at most the steps
  /// between two commits, or the group went back further than any survivor's state.
  int64_t rollback = 0;
};

/// A directory of its own for a run's checkpoints, removed at the end.
struct checkpoint_dir {
  std::filesystem::path path;
  explicit checkpoint_dir(uint64_t seed) {
    static std::atomic<int> runs{0};
    path = std::filesystem::temp_directory_path() /
           ("consort-elastic-" + std::to_string(::getpid()) + "-" + std::to_string(seed) + "-" +
            std::to_string(runs++));
  }
  ~checkpoint_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

/// The training loop of elastic_job, on worker `me` of `c`. Every worker makes its variables
/// and its first commit, then waits at `ready` for the others: the faults of the steps come
/// after, those of the set-up (in_setup) before (a worker whose creation broadcast met the
/// change goes on with its own initial values, and its first step fails with
/// membership_changed: the loop re-forms and syncs to the group's state). At each
/// commit the group's chief of the moment saves the variables into `checkpoints`. `joining`: the
/// loop of the victim's new process (a restart), which starts in a running group and syncs first.
result worker_loop(cluster& c, int me, const scenario& s,
                   std::barrier<std::function<void()>>& ready, const std::string& checkpoints,
                   std::shared_future<void> back, const std::function<void()>& is_back,
                   bool joining = false) {
  checkpoint_manager_options keep;
  keep.max_to_keep = 3;
  checkpoint_manager manager(checkpoints, keep);
  result r;
  auto& st = joining ? c.await_restart(me, 1) : c.strategy(me);
  const int incarnation = joining ? 1 : 0;
  std::optional<variable> made_w, made_u;
  elastic_state state{st};
  // This process died: a restart goes on in the new one's loop.
  const auto died = [&] {
    if (s.restart != scenario::rebirth::none && me == s.victim && incarnation == 0)
      return worker_loop(c, me, s, ready, checkpoints, back, is_back, true);
    result dead;
    dead.killed = true;
    return dead;
  };
  // The set-up's faults need no barrier (a worker waiting at it would not be waiting on the
  // network, which a dead worker's connections wait for before they close).
  const bool at_barrier = !joining && s.how != scenario::kind::in_setup;
  if (!joining && !at_barrier)
    ready.arrive_and_drop();
  try {
    made_w = st.create_variable("w", tensor::zeros(dtype::float32, {4}),
                                {variable_synchronization::on_write, variable_aggregation::mean});
    made_u = st.create_variable("u", tensor::zeros(dtype::float32, {1}),
                                {variable_synchronization::on_write, variable_aggregation::sum});
    state.commit(nest::dict({{"step", tensor::scalar<int64_t>(0)}}));
  } catch (const error& e) {
    // The others go on without this worker, never stranded at the barrier.
    if (at_barrier)
      ready.arrive_and_drop();
    if (!c.alive(me) || c.restarts(me) != incarnation) // killed in the set-up (in_setup)
      return died();
    // Anything else is the test's failure (a membership change is no error here).
    r.code = e.code();
    r.text = std::string{"the set-up failed: "} + e.what();
    return r;
  }
  auto& w = *made_w;
  auto& u = *made_u;
  if (at_barrier)
    ready.arrive_and_wait();
  int64_t step = 0;
  int64_t last_commit = joining ? -1 : 0; // a new process has no state of its own
  bool synced = !joining;
  bool second_dies = me == s.second;
  bool hung = false;
  bool cut_made = false;
  int saves = 0;                                                  // this worker's checkpoint saves
  int64_t last_saved = -1;                                        // and the step of its last
  const auto opts_peer_timeout = std::chrono::milliseconds(5000); // cluster_options' default
  struct signal_back { // the hung victim tells the others it is back, whatever happens to it
    const std::function<void()>& done;
    bool mine;
    ~signal_back() {
      if (mine)
        done();
    }
  } tell_back{is_back, s.how == scenario::kind::hangs && me == s.victim};
  // A worker that re-formed after the hung worker was left out waits at its boundaries until
  // that worker is back and asked to join, so that the join comes at the same boundary on every
  // run (and the job lasts until then, as a real job's steps would outlast the pause).
  bool reformed = false;
  const auto wait_back = [&] {
    if (s.how != scenario::kind::hangs || me == s.victim || !reformed ||
        back.wait_for(60s) == std::future_status::ready)
      return true;
    r.code = errc::collective_timeout;
    r.text = "the hung worker did not come back within 60 s";
    return false;
  };
  // The chief's checkpoint of the step reached.
  const auto save = [&](const std::vector<named_tensor>& values) {
    checkpoint_metadata meta;
    meta.step = step;
    meta.num_workers = st.num_workers();
    meta.num_replicas_in_sync = st.num_replicas_in_sync();
    manager.save(values, meta);
    last_saved = step;
  };
  for (;;) {
    try {
      if (!synced) {
        step = state.sync()["step"].as_tensor().item<int64_t>();
        if (last_commit >= 0)
          r.rollback = std::max(r.rollback, last_commit - step);
        last_commit = step;
        synced = true;
        continue;
      }
      if (step == s.steps) {
        // A last step boundary, where a worker that waits to join comes in (it syncs with the
        // others, who then pass here again).
        if (!wait_back())
          return r;
        st.step_boundary();
        // And a checkpoint of the end, as consort-train saves one (the chief may have died
        // writing the last commit's, whose commit the others kept).
        auto values = st.variable_values();
        if (st.worker_rank() == 0 && last_saved != step)
          save(values);
        break;
      }
      if (s.how == scenario::kind::partition && me == s.victim && step == s.at && !cut_made) {
        cut_made = true;
        c.partition(s.cut);
        c.advance(opts_peer_timeout + 1ms); // past the peer timeout: one side goes on
      }
      if (s.how == scenario::kind::hangs && me == s.victim && step == s.at && !hung) {
        hung = true;
        c.hang(me);
        c.advance(opts_peer_timeout + 1ms); // stopped past the peer timeout: left out
        c.resume(me);
      }
      if (s.how == scenario::kind::between_steps && me == s.victim && incarnation == 0 &&
          step == s.at) {
        if (s.restart == scenario::rebirth::in_place)
          c.restart(me);
        else
          c.kill(me); // with max_restarts 1 (after_loss), a new process then joins
        return died();
      }
      st.run([&w, &u](replica_context& ctx) {
        ctx.assign_add(w, tensor::from<float>({1, 1, 1, 1}, {4}));
        ctx.assign_add(u, tensor::from<float>({1}, {1}));
        return nest{};
      });
      ++step;
      if (step % s.commit_every == 0) {
        // The commit first (a boundary where a worker that joins comes in: then it fails once
        // it is kept, and the group's end saves the last step), then the chief's checkpoint of
        // it: every worker passed the commit, so a chief that dies writing leaves every other
        // worker at the same commit.
        if (!wait_back())
          return r;
        state.commit(nest::dict({{"step", tensor::scalar<int64_t>(step)}}));
        last_commit = step;
        auto values = st.variable_values(); // a collective with ON_READ variables
        if (st.worker_rank() == 0) {
          const int commits = s.steps / s.commit_every;
          const bool dies = s.how == scenario::kind::dies_writing && me == s.victim &&
                            incarnation == 0 && saves == s.at % commits;
          ++saves;
          if (dies)
            consort::detail::checkpoint_kill_writes_after(static_cast<size_t>(s.write_bytes),
                                                          [&c, me] { c.kill(me); });
          struct disarm { // a save that ended before the byte leaves the seam armed
            bool on;
            ~disarm() {
              if (on)
                consort::detail::checkpoint_clear_write_fault();
            }
          } guard{dies};
          save(values);
        }
      }
    } catch (const error& e) {
      // The filter's crash_sender or restart_sender (alive first: a restarted worker is alive
      // again only once its new process's strategy exists, and counted).
      if (!c.alive(me) || c.restarts(me) != incarnation)
        return died();
      if (hung && me == 0 && e.code() == errc::peer_lost) {
        r.killed = true; // a stopped chief is replaced, and ends when it goes on
        return r;
      }
      if (e.code() != errc::membership_changed) {
        r.code = e.code();
        r.text = e.what();
        return r;
      }
      if (second_dies) {
        // After a hung worker came back and asked to join, so that the two changes come in the
        // same order on every run.
        if (s.how == scenario::kind::hangs && back.wait_for(60s) != std::future_status::ready) {
          r.code = errc::collective_timeout;
          r.text = "the hung worker did not come back within 60 s";
          return r;
        }
        c.kill(me);
        r.killed = true;
        return r;
      }
      try {
        st.reform();
      } catch (const error& e2) {
        r.code = e2.code();
        r.text = e2.what();
        return r;
      }
      if (hung && tell_back.mine) { // back in the group: its join is under way
        tell_back.mine = false;
        is_back();
      }
      reformed = true;
      synced = false;
    }
  }
  r.w = w.value().to_vector<float>();
  r.u = u.value().to_vector<float>();
  r.epoch = st.membership_epoch();
  r.step = step;
  return r;
}

/// Runs `s` on a fresh cluster; every worker's loop on its own thread, each bounded.
std::vector<result> run_scenario(const scenario& s, uint64_t seed) {
  testing::cluster_options opts;
  opts.workers = s.workers;
  opts.replicas_per_worker = s.replicas;
  opts.seed = seed;
  opts.elastic_min_workers = s.min_workers;
  opts.max_restarts = s.restart == scenario::rebirth::after_loss ? 1 : 0;
  opts.strategy.collective_timeout = 20s;
  cluster c(opts);
  checkpoint_dir checkpoints(seed);
  // The victim dies sending its `at`-th message to `peer` after the set-up (counted when every
  // worker is ready, before any sends a step's message), or (in_setup) from its start.
  const auto sent_so_far = [&c, &s] {
    uint64_t sent = 0;
    for (const auto& m : c.messages())
      sent += m.kind == "data" && m.from == s.victim && m.to == s.peer ? 1 : 0;
    return sent;
  };
  auto armed_at = std::make_shared<std::atomic<uint64_t>>(UINT64_MAX);
  if (s.how == scenario::kind::in_setup)
    armed_at->store(sent_so_far() + static_cast<uint64_t>(s.at));
  if (s.how == scenario::kind::in_collective || s.how == scenario::kind::in_setup) {
    const int victim = s.victim, peer = s.peer;
    const auto fault = s.restart == scenario::rebirth::in_place ? testing::verdict::restart_sender()
                                                                : testing::verdict::crash_sender();
    c.on_message([victim, peer, armed_at, fault](const testing::message& m) {
      return m.epoch == 1 && m.from == victim && m.to == peer && m.link_seq == armed_at->load()
                 ? fault
                 : testing::verdict::deliver();
    });
  }
  std::barrier<std::function<void()>> ready(s.workers, [&] {
    if (s.how == scenario::kind::in_collective)
      armed_at->store(sent_so_far() + static_cast<uint64_t>(s.at));
  });
  std::promise<void> back_promise;
  std::shared_future<void> back = back_promise.get_future().share();
  std::once_flag once;
  const std::function<void()> is_back = [&] {
    std::call_once(once, [&] { back_promise.set_value(); });
  };
  std::vector<std::future<result>> loops;
  for (int w = 0; w < s.workers; ++w)
    loops.push_back(
        std::async(std::launch::async, [&c, w, &s, &ready, &checkpoints, back, &is_back] {
          return worker_loop(c, w, s, ready, checkpoints.path.string(), back, is_back);
        }));
  std::vector<result> out;
  for (auto& f : loops) {
    if (f.wait_for(60s) != std::future_status::ready) {
      ADD_FAILURE() << "a worker's loop did not end within 60 s: " << s.describe(seed);
      std::abort(); // its thread holds the cluster: nothing to unwind
    }
    out.push_back(f.get());
  }
  // Whoever wrote them, whoever died meanwhile: every checkpoint kept loads, its checksums hold,
  // and it holds the weights of its step (every step adds 1 to every element of `w`); a group
  // that finished kept its last step's.
  const auto kept = checkpoint_manager(checkpoints.path.string()).checkpoints();
  const bool finished = std::any_of(
      out.begin(), out.end(), [](const result& r) { return !r.killed && r.code == errc::none; });
  if (finished) {
    EXPECT_FALSE(kept.empty()) << s.describe(seed);
    if (!kept.empty()) {
      EXPECT_EQ(load_checkpoint(kept.back()).metadata.step, s.steps) << s.describe(seed);
    }
  }
  // The chief killed writing left its temporary file; the newest good checkpoint is still found.
  const bool killed_writing = s.how == scenario::kind::dies_writing && out[0].killed;
  EXPECT_EQ(killed_writing, s.how == scenario::kind::dies_writing)
      << s.describe(seed) << ": the chief reaches that save, and the byte (a file is larger)";
  int temporary = 0;
  for (const auto& item : std::filesystem::directory_iterator(checkpoints.path))
    temporary += item.path().filename().string().find(".tmp-") != std::string::npos ? 1 : 0;
  EXPECT_EQ(temporary, killed_writing ? 1 : 0) << s.describe(seed);
  try {
    auto latest = checkpoint_manager(checkpoints.path.string()).restore_latest();
    EXPECT_EQ(latest.has_value(), !kept.empty()) << s.describe(seed);
    if (latest && !kept.empty()) {
      EXPECT_EQ(latest->path, kept.back()) << s.describe(seed);
    }
  } catch (const error& e) {
    ADD_FAILURE() << s.describe(seed) << ": restore_latest: " << e.what();
  }
  for (const auto& path : kept) {
    SCOPED_TRACE(s.describe(seed) + ": " + path);
    try {
      auto data = load_checkpoint(path);
      const auto* w = data.find("w");
      EXPECT_NE(w, nullptr);
      if (w) {
        EXPECT_EQ(w->to_vector<float>(),
                  std::vector<float>(4, static_cast<float>(data.metadata.step)));
      }
      EXPECT_GE(data.metadata.num_workers, s.min_workers);
    } catch (const error& e) {
      ADD_FAILURE() << e.what();
    }
  }
  return out;
}

/// Checks one run: every worker died as planned, finished with the same weights, or (the group
/// ended) failed with peer_lost.
void check_run(const scenario& s, uint64_t seed, const std::vector<result>& run) {
  SCOPED_TRACE(s.describe(seed));
  const result* finished = nullptr;
  int ended = 0;
  for (int w = 0; w < s.workers; ++w) {
    const auto& r = run[static_cast<size_t>(w)];
    if (r.killed) {
      EXPECT_TRUE(w == s.victim || w == s.second) << "worker " << w << " was not to die";
      continue;
    }
    if (r.code != errc::none) {
      EXPECT_EQ(r.code, errc::peer_lost) << "worker " << w << ": " << r.text;
      // Below the minimum; or, the chief hung in a group of 2, the other cannot take over
      // (1 of 2 is no majority: the chief might lead on behind a partition).
      const bool below = r.text.find("fewer than the minimum of " +
                                     std::to_string(s.min_workers)) != std::string::npos;
      const bool no_quorum =
          ((s.how == scenario::kind::hangs && s.victim == 0) ||
           s.how == scenario::kind::partition) &&
          (r.text.find("not a majority") != std::string::npos ||
           r.text.find("fewer than half") != std::string::npos ||
           r.text.find("is on the other side of the partition") != std::string::npos);
      EXPECT_TRUE(below || no_quorum) << r.text;
      ++ended;
      continue;
    }
    EXPECT_EQ(r.step, s.steps) << "worker " << w;
    EXPECT_LE(r.rollback, s.commit_every)
        << "worker " << w << ": a sync went back past the group's last commit";
    EXPECT_EQ(r.w, std::vector<float>(4, static_cast<float>(s.steps)))
        << "worker " << w << ": a step applied twice or lost";
    if (finished) {
      EXPECT_EQ(r.u, finished->u) << "worker " << w << " and another ended apart";
      EXPECT_EQ(r.epoch, finished->epoch);
    }
    finished = &r;
  }
  // (A partition ends one side while the other finishes.)
  EXPECT_TRUE(finished == nullptr || ended == 0 || s.how == scenario::kind::partition)
      << "some finished while others saw the end";
}

/// The seeded scenarios in four parts, which ctest runs side by side (each part a quarter of
/// CONSORT_ELASTIC_SEEDS, 1000 by default, from CONSORT_ELASTIC_FIRST_SEED).
class ElasticSeeds : public ::testing::TestWithParam<int> {};

TEST_P(ElasticSeeds, FaultsAtEveryPointOfAStepLoseNothingAndReplayTheSame) {
  int seeds = 1000;
  if (const char* env = std::getenv("CONSORT_ELASTIC_SEEDS"))
    seeds = std::atoi(env);
  int first_seed = 0;
  if (const char* env = std::getenv("CONSORT_ELASTIC_FIRST_SEED"))
    first_seed = std::atoi(env);
  const int per_part = (seeds + 3) / 4;
  const int begin = first_seed + GetParam() * per_part;
  const int end = std::min(first_seed + seeds, begin + per_part);
  for (int seed = begin; seed < end; ++seed) {
    const auto s = make_scenario(static_cast<uint64_t>(seed));
    const auto first = run_scenario(s, static_cast<uint64_t>(seed));
    check_run(s, static_cast<uint64_t>(seed), first);
    // The same seed again: the same workers die at the same points, the same weights.
    const auto again = run_scenario(s, static_cast<uint64_t>(seed));
    for (int w = 0; w < s.workers; ++w) {
      const auto& a = first[static_cast<size_t>(w)];
      const auto& b = again[static_cast<size_t>(w)];
      EXPECT_EQ(a.killed, b.killed) << s.describe(static_cast<uint64_t>(seed)) << ", worker " << w;
      EXPECT_EQ(a.code, b.code) << s.describe(static_cast<uint64_t>(seed)) << ", worker " << w;
      // Every survivor at the same commit, also after a death inside a collective: the dead
      // worker's connections close once the others wait on the network, so those that had every
      // part of that collective finished it on both runs.
      EXPECT_EQ(a.u, b.u) << s.describe(static_cast<uint64_t>(seed)) << ", worker " << w;
      EXPECT_EQ(a.w, b.w) << s.describe(static_cast<uint64_t>(seed)) << ", worker " << w;
      EXPECT_EQ(a.epoch, b.epoch) << s.describe(static_cast<uint64_t>(seed)) << ", worker " << w;
    }
    if (::testing::Test::HasFailure())
      break;
  }
}

INSTANTIATE_TEST_SUITE_P(Quarter, ElasticSeeds, ::testing::Range(0, 4));

} // namespace
} // namespace consort
