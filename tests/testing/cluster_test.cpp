// consort::testing::cluster: workers of a multi-worker job in one process over the simulated
// network, driven through the public API (the strategies) and the harness's faults and clock;
// and the simulated network itself against the transport's contract.

#include <consort/testing.hpp>
#include <consort/transport/algorithms.hpp>

#include "support/expect_error.hpp"
#include "support/scoped_env.hpp"
#include "support/time_scale.hpp"
#include "support/transport_helpers.hpp"
#include "testing/sim_transport.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace consort {
namespace {

using namespace std::chrono_literals;
using consort::test::fails_with;
using consort::test::has_error;
using testing::cluster;
using testing::verdict;
using wall = std::chrono::steady_clock;

/// The step of the examples: every replica contributes 1.
tensor one_sum(replica_context& ctx) {
  return ctx.all_reduce("SUM", tensor::scalar<float>(1.0f));
}

/// The code and message a future fails with, or "no error"; fails the test if it does not end
/// within `within` of wall time (nothing may hang).
template <class Future>
::testing::AssertionResult fails(Future& f, errc code, const std::vector<std::string>& fragments,
                                 std::chrono::milliseconds within = 10s) {
  if (!f.wait_for(within))
    return ::testing::AssertionFailure()
           << "the run did not end within " << within.count() << " ms of wall time";
  return fails_with([&] { f.get(); }, code, fragments);
}

/// The code a finished future fails with (errc::none when it holds a value).
template <class Future>
errc code_of(Future& f) {
  try {
    f.get();
  } catch (const error& e) {
    return e.code();
  }
  return errc::none;
}

/// Waits (in real time, bounded) until every worker's step has ended or a thread of it waits on
/// the network. A worker then has sent what it sends before it waits, so a test that advances
/// simulated time next cannot outrun it (a deadline passing before a slow worker even sent
/// would change which of its messages are sent at all, under a sanitizer for example).
template <class Futures>
void settle(cluster& c, Futures& runs) {
  for (size_t w = 0; w < runs.size(); ++w)
    for (int i = 0; i < 10000 && !runs[w].ready() && !c.wait_blocked(static_cast<int>(w), 1ms);
         ++i) {
    }
}

/// Every component of every worker's result equals `want`.
template <class Futures>
void expect_all_equal(Futures& futures, float want, const cluster& c) {
  for (size_t w = 0; w < futures.size(); ++w) {
    ASSERT_TRUE(futures[w].wait_for(10s)) << "worker " << w << " did not finish; " << c.describe();
    auto result = futures[w].get();
    for (const auto& v : result.values())
      EXPECT_EQ(v.template item<float>(), want) << "worker " << w << "; " << c.describe();
  }
}

// -- the happy path ------------------------------------------------------------------------------

TEST(TestingCluster, EveryWorkerRunsTheStepAndTheCollectiveSpansTheCluster) {
  cluster c({.workers = 3, .replicas_per_worker = 2, .seed = 7});
  EXPECT_EQ(c.workers(), 3);
  EXPECT_EQ(c.describe(), "3 workers x 2 replicas, seed 7");
  for (int w = 0; w < 3; ++w) {
    EXPECT_EQ(c.strategy(w).worker_rank(), w);
    EXPECT_EQ(c.strategy(w).num_workers(), 3);
    EXPECT_EQ(c.strategy(w).num_replicas_in_sync(), 6);
  }
  for (int round = 0; round < 3; ++round) {
    auto runs = c.run_all(one_sum);
    expect_all_equal(runs, 6.0f, c);
  }
  // Every message went between two distinct workers and was delivered.
  auto log = c.messages();
  ASSERT_FALSE(log.empty());
  for (const auto& m : log) {
    EXPECT_NE(m.from, m.to);
    EXPECT_EQ(m.kind, "data");
    EXPECT_EQ(m.what, testing::fate::delivered);
  }
}

// With lockstep channels (cluster_options::lockstep_channels, as shared memory has them), a lone
// replica's small all-reduce takes its lean path over the simulated links: one message to each
// peer per call, its tag, the 32-byte compact descriptor and the data (8 + 32 + 4 bytes for a
// float32 scalar), on the channel's own tag; and the results are exact, as without them.
TEST(TestingCluster, WithLockstepChannelsALoneReplicasSmallAllReduceTakesTheLeanPath) {
  for (int workers : {2, 3, 4}) {
    SCOPED_TRACE(std::to_string(workers) + " workers");
    // Four workers: by CONSORT_TESTING_LOCKSTEP_CHANNELS=1, which overrides the option (off).
    std::optional<consort::test::scoped_env> env;
    if (workers == 4)
      env.emplace("CONSORT_TESTING_LOCKSTEP_CHANNELS", "1");
    cluster c({.workers = workers,
               .replicas_per_worker = 1,
               .seed = 5,
               .lockstep_channels = workers < 4});
    const auto before = c.messages().size();
    constexpr int calls = 5;
    auto runs = c.run_all([](consort::replica_context& ctx) {
      float sum = 0;
      for (int i = 0; i < calls; ++i)
        sum += ctx.all_reduce("SUM", consort::tensor::scalar<float>(
                                         static_cast<float>(ctx.replica_id_in_sync_group() + 1)))
                   .item<float>();
      return consort::tensor::scalar<float>(sum);
    });
    const float each = static_cast<float>(workers * (workers + 1) / 2);
    for (size_t w = 0; w < runs.size(); ++w) {
      ASSERT_TRUE(runs[w].wait_for(10s)) << "worker " << w << "; " << c.describe();
      EXPECT_EQ(runs[w].get().values()[0].item<float>(), calls * each) << "worker " << w;
    }
    // The step's messages: the step's own start and end (if any) aside, the calls' messages are
    // lockstep messages of 44 bytes, `calls` on each ordered pair of workers.
    auto log = c.messages();
    std::map<std::pair<int, int>, int> lean;
    for (size_t i = before; i < log.size(); ++i)
      if (log[i].kind == "data" && log[i].tag >> 40 == 0xFF'FFFF && log[i].bytes == 8 + 32 + 4)
        ++lean[{log[i].from, log[i].to}];
    EXPECT_EQ(lean.size(), static_cast<size_t>(workers * (workers - 1)));
    for (const auto& [link, n] : lean)
      EXPECT_GE(n, calls) << link.first << " -> " << link.second;
  }
}

TEST(TestingCluster, ALoneReplicasCallsOfManyShapesInARowEachGetTheirOwnResult) {
  // A lone replica's thread keeps its result vector from one call to the next: calls of three
  // leaves, one, two and a nest of one, in a row, each get exactly their own values.
  cluster c({.workers = 2, .replicas_per_worker = 1, .seed = 11});
  auto runs = c.run_all([](consort::replica_context& ctx) {
    const float me = static_cast<float>(ctx.replica_id_in_sync_group() + 1); // 1, 2
    auto three =
        ctx.all_reduce("SUM", consort::nest::list({consort::tensor::scalar<float>(me),
                                                   consort::tensor::scalar<float>(10 * me),
                                                   consort::tensor::scalar<float>(100 * me)}));
    auto one = ctx.all_reduce("SUM", consort::tensor::scalar<float>(1000 * me));
    auto two =
        ctx.all_reduce("MAX", consort::nest::dict({{"a", consort::tensor::scalar<float>(me)},
                                                   {"b", consort::tensor::scalar<float>(-me)}}));
    auto single = ctx.all_reduce("SUM", consort::nest::list({consort::tensor::scalar<float>(me)}));
    return consort::tensor::from<float>(
        {three[0].as_tensor().item<float>(), three[1].as_tensor().item<float>(),
         three[2].as_tensor().item<float>(), one.item<float>(), two["a"].as_tensor().item<float>(),
         two["b"].as_tensor().item<float>(), single[0].as_tensor().item<float>()},
        {7});
  });
  for (size_t w = 0; w < runs.size(); ++w) {
    ASSERT_TRUE(runs[w].wait_for(10s)) << "worker " << w << " did not finish; " << c.describe();
    EXPECT_EQ(runs[w].get().values()[0].to_vector<float>(),
              (std::vector<float>{3, 30, 300, 3000, 2, -1, 3}))
        << "worker " << w << "; " << c.describe();
  }
}

TEST(TestingCluster, ALoneReplicasRememberedSignaturesNeverStandForAnotherShape) {
  // A lone replica's thread keeps the signatures of its recent tensor all-reduces (8 slots by op,
  // dtype and shape), so that a step's repeated calls are not described and hashed again. After
  // calls of 40 shapes have filled every slot, worker 1 passes another shape than worker 0's, 16
  // times: each error names both shapes as passed (a remembered signature of another shape
  // would name that one, or hide the mismatch).
  cluster c({.workers = 2, .replicas_per_worker = 1, .seed = 13});
  auto warm = c.run_all([](consort::replica_context& ctx) {
    float sum = 0;
    for (int64_t n = 1; n <= 40; ++n)
      sum += ctx.all_reduce("SUM", consort::tensor::zeros(consort::dtype::float32, {n}))
                 .to_vector<float>()
                 .size();
    return consort::tensor::scalar<float>(sum);
  });
  for (size_t w = 0; w < warm.size(); ++w)
    ASSERT_TRUE(warm[w].wait_for(20s)) << "worker " << w << "; " << c.describe();
  for (int64_t k = 1; k <= 16; ++k) {
    SCOPED_TRACE("k = " + std::to_string(k));
    auto runs = c.run_all([k](consort::replica_context& ctx) {
      const int64_t n = ctx.replica_id_in_sync_group() == 0 ? k : k + 40;
      return ctx.all_reduce("SUM", consort::tensor::zeros(consort::dtype::float32, {n}));
    });
    const std::string want = "passed all_reduce(SUM) of T with float32[" + std::to_string(k) +
                             "] but worker 1 passed all_reduce(SUM) of T with float32[" +
                             std::to_string(k + 40) + "]";
    for (size_t w = 0; w < runs.size(); ++w) {
      ASSERT_TRUE(runs[w].wait_for(20s)) << "worker " << w << "; " << c.describe();
      try {
        (void)runs[w].get();
        ADD_FAILURE() << "worker " << w << ": shapes that differ must fail";
      } catch (const consort::error& e) {
        EXPECT_EQ(e.code(), consort::errc::collective_mismatch) << e.what();
        EXPECT_NE(std::string{e.what()}.find(want), std::string::npos)
            << "worker " << w << ": " << e.what();
        // The flight recorder's entry has this worker's own shape too.
        const auto own = "(float32[" + std::to_string(w == 0 ? k : k + 40) + "]";
        EXPECT_NE(std::string{e.what()}.find(own), std::string::npos)
            << "worker " << w << ": " << e.what();
      }
    }
  }
}

// The end of a run: every worker has its last result, then each leaves cleanly (a goodbye to
// each peer, no abort), and nothing follows a worker's goodbye.
TEST(TestingCluster, TheEndOfARunDeliversEveryLastResultThenEachWorkerSaysGoodbye) {
  cluster c({.workers = 3, .replicas_per_worker = 2, .seed = 12});
  auto last = c.run_all(one_sum);
  expect_all_equal(last, 6.0f, c);
  for (int w = 0; w < 3; ++w)
    c.strategy(w).shutdown(); // as each process returns from main
  std::map<std::pair<int, int>, int> goodbyes;
  std::set<int> gone;
  for (const auto& m : c.messages()) {
    EXPECT_NE(m.kind, "abort") << "a clean end aborts nothing";
    EXPECT_FALSE(gone.count(m.from) && m.kind == "data")
        << "data from worker " << m.from << " after its goodbye";
    if (m.kind == "goodbye") {
      ++goodbyes[{m.from, m.to}];
      gone.insert(m.from);
    }
  }
  for (int a = 0; a < 3; ++a)
    for (int b = 0; b < 3; ++b)
      if (a != b) {
        EXPECT_EQ((goodbyes[{a, b}]), 1) << "worker " << a << " to worker " << b;
      }
  auto after = c.strategy(0).run_async(one_sum);
  EXPECT_TRUE(fails(after, errc::shutdown, {}));
}

TEST(TestingCluster, HealingBeforeThePeerTimeoutLosesNobody) {
  cluster c({.workers = 3, .seed = 13, .peer_timeout = 5s});
  EXPECT_FALSE(c.wait_blocked(0, 20ms)) << "no call, no thread waiting on the network";
  c.partition({2});
  c.advance(4s);
  c.heal();
  c.advance(10s); // past the peer timeout: the cut ended before it, so nobody is declared lost
  auto runs = c.run_all(one_sum);
  expect_all_equal(runs, 3.0f, c);
}

TEST(TestingCluster, DelayedMessagesKeepTheirLinksOrderAndTheResultsExact) {
  cluster c({.workers = 3, .replicas_per_worker = 1, .seed = 1});
  std::atomic<int> n{0};
  // Every other message waits 20 ms of simulated time (which also passes in real time).
  c.on_message([&](const testing::message&) {
    return n++ % 2 ? verdict::delay_by(20ms) : verdict::deliver();
  });
  auto runs = c.run_all([](replica_context& ctx) {
    std::vector<float> v(1001);
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>(ctx.replica_id_in_sync_group() * 1000 + static_cast<int>(i));
    auto sum = ctx.all_reduce("SUM", tensor::from<float>(v));
    return sum;
  });
  for (size_t w = 0; w < runs.size(); ++w) {
    ASSERT_TRUE(runs[w].wait_for(10s));
    auto got = runs[w].get().values().front().to_vector<float>();
    ASSERT_EQ(got.size(), 1001u);
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_EQ(got[i], static_cast<float>(3000 + 3 * static_cast<int>(i))) << "element " << i;
  }
  bool delayed = false;
  for (const auto& m : c.messages())
    delayed = delayed || m.delay == 20ms;
  EXPECT_TRUE(delayed);
}

TEST(TestingCluster, ADelayWithinTheDeadlineArrivesInTimeAndOneBeyondItLosesToTheDeadline) {
  for (auto delay : {std::chrono::nanoseconds{20s}, std::chrono::nanoseconds{1h}}) {
    cluster c({.workers = 2, .seed = 2}); // collective_timeout 30 s, step_timeout 10 min
    c.on_message([delay](const testing::message& m) {
      return m.from == 1 ? verdict::delay_by(delay) : verdict::deliver();
    });
    auto started = wall::now();
    auto runs = c.run_all(one_sum);
    ASSERT_TRUE(c.wait_blocked(0)) << "worker 0 waits for worker 1's delayed message";
    // Worker 1 has what it needs from worker 0 (the sum travels with the descriptor): it ends,
    // its own message sent and held by the link.
    ASSERT_TRUE(runs[1].wait_for(10s));
    EXPECT_FALSE(runs[0].wait_for(20ms));
    // One call covers the whole delay: time moves from event to event, so the 30 s deadline
    // comes before a message due in an hour, and after one due in 20 s.
    c.advance(delay);
    if (delay < 30s) {
      expect_all_equal(runs, 2.0f, c);
    } else {
      EXPECT_TRUE(fails(runs[0], errc::collective_timeout, {"receive from rank 1"}));
    }
    EXPECT_LT(wall::now() - started, consort::test::scaled(5s));
    EXPECT_GE(c.now(), delay);
  }
}

// -- the start -----------------------------------------------------------------------------------

TEST(TestingCluster, ALateWorkerHoldsTheClusterUntilItJoins) {
  testing::cluster_options opts;
  opts.workers = 3;
  opts.late = {2};
  cluster c(opts);
  EXPECT_FALSE(c.formed());
  EXPECT_TRUE(fails_with([&] { c.strategy(0); }, errc::invalid_argument,
                         {"worker 0 has not started", "still forming"}));
  EXPECT_TRUE(fails_with([&] { c.run_all(one_sum); }, errc::invalid_argument, {"still forming"}));
  c.advance(59s); // within the 60 s rendezvous timeout
  c.join(2);
  EXPECT_TRUE(c.formed());
  auto runs = c.run_all(one_sum);
  expect_all_equal(runs, 3.0f, c);
  EXPECT_TRUE(fails_with([&] { c.join(2); }, errc::invalid_argument, {"already joined"}));
  EXPECT_TRUE(fails_with([&] { c.join(0); }, errc::invalid_argument, {"is not late"}));
}

TEST(TestingCluster, AWorkerThatNeverJoinsFailsEveryStartAtTheRendezvousTimeout) {
  testing::cluster_options opts;
  opts.workers = 3;
  opts.late = {1};
  opts.rendezvous_timeout = 60s;
  cluster c(opts);
  auto started = wall::now();
  c.advance(61s);
  for (int w : {0, 1, 2})
    EXPECT_TRUE(fails_with([&] { c.strategy(w); }, errc::collective_timeout,
                           {"joining the cluster as worker:" + std::to_string(w),
                            "timed out after 60000 ms", "worker:1 did not join",
                            "(joined: worker:0, worker:2)"}));
  EXPECT_TRUE(fails_with([&] { c.join(1); }, errc::collective_timeout,
                         {"worker:1", "too late", "worker:1 did not join"}));
  EXPECT_FALSE(c.formed());
  EXPECT_LT(wall::now() - started, consort::test::scaled(1s));
}

// -- faults --------------------------------------------------------------------------------------

TEST(TestingCluster, AKilledWorkerFailsEverySurvivorsCollectivesWithPeerLostNamingIt) {
  cluster c({.workers = 3, .replicas_per_worker = 2, .seed = 3});
  auto warm = c.run_all(one_sum);
  expect_all_equal(warm, 6.0f, c);
  const auto killed_at = c.messages().size();
  c.kill(2);
  EXPECT_FALSE(c.alive(2));
  EXPECT_TRUE(c.alive(0));
  for (int w : {0, 1}) {
    auto f = c.strategy(w).run_async(one_sum);
    EXPECT_TRUE(fails(f, errc::peer_lost, {"worker:2", "killed"})) << "worker " << w;
    auto later = c.strategy(w).run_async(one_sum);
    EXPECT_TRUE(fails(later, errc::peer_lost, {"worker:2"})) << "later, worker " << w;
  }
  auto dead = c.strategy(2).run_async(one_sum);
  EXPECT_TRUE(fails(dead, errc::peer_lost, {"killed by the test harness"}));
  // A dead process sends nothing: no message from worker 2 after the kill.
  auto log = c.messages();
  for (size_t i = killed_at; i < log.size(); ++i)
    EXPECT_FALSE(log[i].from == 2 && log[i].what == testing::fate::delivered)
        << "message " << i << " from the dead worker";
}

TEST(TestingCluster, AWorkerKilledInTheMiddleOfAnAllReduceFailsTheOthersAtOnce) {
  cluster c({.workers = 3, .seed = 4});
  // Workers 0 and 1 enter the all-reduce; worker 2 never does, then dies.
  auto f0 = c.strategy(0).run_async(one_sum);
  auto f1 = c.strategy(1).run_async(one_sum);
  EXPECT_FALSE(f0.wait_for(20ms));
  auto started = wall::now();
  c.kill(2);
  EXPECT_TRUE(fails(f0, errc::peer_lost, {"worker:2"}));
  EXPECT_TRUE(fails(f1, errc::peer_lost, {"worker:2"}));
  EXPECT_LT(wall::now() - started, consort::test::scaled(5s));
}

TEST(TestingCluster, APartitionIsFoundAfterThePeerTimeoutOfSimulatedTime) {
  cluster c({.workers = 3, .seed = 5, .peer_timeout = 30s});
  c.partition({2});
  auto started = wall::now();
  auto runs = c.run_all(one_sum);
  EXPECT_FALSE(runs[0].wait_for(20ms)) << "silence: nobody learns anything before the timeout";
  c.advance(29s);
  EXPECT_FALSE(runs[0].wait_for(20ms)) << "29 of 30 s: still silent";
  c.advance(2s);
  EXPECT_TRUE(fails(runs[0], errc::peer_lost, {"worker:2", "no heartbeat for 30000 ms"}));
  EXPECT_TRUE(fails(runs[1], errc::peer_lost, {"worker:2", "no heartbeat"}));
  // The cut-off worker finds the others lost too.
  EXPECT_TRUE(fails(runs[2], errc::peer_lost, {"no heartbeat"}));
  EXPECT_LT(wall::now() - started, consort::test::scaled(5s))
      << "30 s of simulated time took no wall-clock wait";
  // Nothing crossed the cut.
  for (const auto& m : c.messages()) {
    if ((m.from == 2) != (m.to == 2) && m.kind == "data") {
      EXPECT_EQ(m.what, testing::fate::dropped);
    }
  }
}

TEST(TestingCluster, AHungWorkerIsFoundAfterThePeerTimeoutAndFindsItselfLostWhenItGoesOn) {
  cluster c({.workers = 3, .seed = 12, .peer_timeout = 30s});
  c.hang(1);
  EXPECT_TRUE(fails_with([&] { c.hang(3); }, errc::invalid_argument, {"no worker 3"}));
  EXPECT_TRUE(fails_with([&] { c.resume(2); }, errc::invalid_argument, {"worker 2 does not hang"}));
  auto runs = c.run_all(one_sum);
  EXPECT_FALSE(runs[0].wait_for(20ms)) << "silence: nobody learns anything before the timeout";
  c.advance(29s);
  EXPECT_FALSE(runs[2].wait_for(20ms)) << "29 of 30 s: still silent";
  c.advance(2s);
  for (int w : {0, 2})
    EXPECT_TRUE(fails(runs[static_cast<size_t>(w)], errc::peer_lost,
                      {"lost worker:1 (rank 1): no heartbeat for 30000 ms (hung by the test "
                       "harness)"}));
  c.resume(1);
  EXPECT_TRUE(
      fails(runs[1], errc::peer_lost, {"the others lost this worker: no heartbeat for 30000 ms"}));
  EXPECT_TRUE(c.alive(1));
  // Nothing went to or from it while it hung.
  for (const auto& m : c.messages()) {
    if ((m.from == 1) != (m.to == 1) && m.kind == "data") {
      EXPECT_EQ(m.what, testing::fate::dropped);
    }
  }
  c.kill(2);
  EXPECT_TRUE(fails_with([&] { c.hang(2); }, errc::invalid_argument, {"worker 2 is dead"}));
}

TEST(TestingCluster, ACollectiveTimeoutPassesInSimulatedTime) {
  testing::cluster_options opts;
  opts.workers = 2;
  opts.strategy.collective_timeout = 20s;
  opts.peer_timeout = 1h;
  cluster c(opts);
  // Worker 1's data never reaches worker 0 (a lossy link, no close, no partition).
  c.on_message(
      [](const testing::message& m) { return m.from == 1 ? verdict::drop() : verdict::deliver(); });
  auto started = wall::now();
  auto f0 = c.strategy(0).run_async(one_sum);
  auto f1 = c.strategy(1).run_async(one_sum);
  ASSERT_TRUE(c.wait_blocked(0)) << "worker 0's collective has begun: its deadline counts";
  EXPECT_FALSE(f0.wait_for(20ms));
  c.advance(21s);
  EXPECT_TRUE(fails(f0, errc::collective_timeout, {}));
  EXPECT_LT(wall::now() - started, consort::test::scaled(5s));
  // Worker 1 is not left hanging either: it fails by its deadline or with worker 0's abort.
  ASSERT_TRUE(f1.wait_for(10s));
}

// Moved here from tests/actors/cross_worker_test.cpp, where it waited 300 ms of wall time: the
// default 30 s deadline now passes in simulated time.
TEST(TestingCluster, AWorkerThatNeverCallsTimesOutTheOthersNamingTheCall) {
  cluster c({.workers = 2, .seed = 8});
  auto started = wall::now();
  // Only worker 0 runs a step with a collective.
  auto f = c.strategy(0).run_async(one_sum);
  ASSERT_TRUE(c.wait_blocked(0));
  c.advance(29s);
  EXPECT_FALSE(f.wait_for(20ms)) << "29 of the 30 s: still waiting";
  c.advance(2s);
  EXPECT_TRUE(fails(f, errc::collective_timeout,
                    {"all_reduce(SUM) #0 of step 0", "receive from rank 1", "did not complete"}));
  EXPECT_LT(wall::now() - started, consort::test::scaled(1s));
}

TEST(TestingCluster, ACorruptedFrameClosesTheConnectionWithPeerLost) {
  cluster c({.workers = 2, .seed = 6});
  std::atomic<bool> once{false};
  c.on_message([&](const testing::message& m) {
    return m.from == 1 && !once.exchange(true) ? verdict::corrupt() : verdict::deliver();
  });
  auto runs = c.run_all(one_sum);
  EXPECT_TRUE(fails(runs[0], errc::peer_lost, {"malformed frame from rank 1"}));
  // Worker 1 had what it needed from worker 0 before its own frame broke the link, or fails
  // with peer_lost: either way it ends, and never with a wrong value.
  ASSERT_TRUE(runs[1].wait_for(10s));
  try {
    EXPECT_EQ(runs[1].get().values().front().item<float>(), 2.0f);
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::peer_lost) << e.what();
  }
  bool corrupted = false;
  for (const auto& m : c.messages())
    corrupted = corrupted || m.what == testing::fate::corrupted;
  EXPECT_TRUE(corrupted);
}

TEST(TestingCluster, AStepThatThrowsOnOneReplicaFailsItsWorkerAndNoWorkerHangs) {
  testing::cluster_options opts;
  opts.workers = 2;
  opts.replicas_per_worker = 2;
  opts.strategy.collective_timeout = 10s;
  cluster c(opts);
  auto started = wall::now();
  auto runs = c.run_all([](replica_context& ctx) {
    if (ctx.replica_id_in_sync_group() == 3)
      throw std::runtime_error("bad batch on replica 3");
    return one_sum(ctx);
  });
  EXPECT_TRUE(fails(runs[1], errc::step_failed, {"bad batch on replica 3"}));
  // Worker 1 tells worker 0, whose all-reduce fails at once naming the cause, long before its
  // 10 s deadline (no time is advanced).
  EXPECT_TRUE(fails(runs[0], errc::collective_aborted,
                    {"on worker 1", "replica 3 failed the step", "bad batch on replica 3"}));
  EXPECT_LT(wall::now() - started, consort::test::scaled(8s));
}

// -- random faults -------------------------------------------------------------------------------

/// The fault one seed injects.
enum class fault { none, kill, partition, drop, delay, corrupt, throw_in_step };

const char* fault_name(fault f) {
  switch (f) {
  case fault::none:
    return "none";
  case fault::kill:
    return "kill";
  case fault::partition:
    return "partition";
  case fault::drop:
    return "drop";
  case fault::delay:
    return "delay";
  case fault::corrupt:
    return "corrupt";
  case fault::throw_in_step:
    return "throw in a step";
  }
  return "?";
}

/// Per fault kind: steps that ended with the sum, and with an error (over every worker).
struct tally {
  int exact = 0;
  int errors = 0;
};

/// A number that depends only on the seed and the message's place on its link (splitmix64), so
/// that a filter built on it injects the same faults on every run of the seed.
uint64_t mix(uint64_t seed, const testing::message& m) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ULL ^ (static_cast<uint64_t>(m.from) << 48) ^
               (static_cast<uint64_t>(m.to) << 40) ^ m.link_seq;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// One seed: 3 workers x `replicas` replicas (over a network with lockstep channels when
/// `lockstep`) run 3 all-reduce steps; a random fault strikes before or
/// during a random step. Every worker's every step must end (simulated time is pushed until it
/// does) with the exact sum or a clear error; returns what went wrong, empty when nothing did.
/// The faults during a step (drop, delay, corrupt; a kill, as a crash of the victim as it sends
/// its first message of the step; a partition, which begins with that message) are decided by
/// the seed and the message's place on its link, so they strike the same messages on every run.
std::string run_seed(uint64_t seed, std::map<fault, tally>& seen, bool lockstep = false,
                     int replicas = 2) {
  testing::cluster_options opts;
  opts.workers = 3;
  opts.replicas_per_worker = replicas;
  const int n = 3 * replicas;
  const float sum = static_cast<float>(n * (n + 1) / 2); // of the replicas' ids + 1
  opts.seed = seed;
  opts.lockstep_channels = lockstep;
  opts.peer_timeout = 3s;
  opts.strategy.collective_timeout = 10s;
  cluster c(opts);
  auto& rng = c.random();
  const auto kind = static_cast<fault>(rng() % 7);
  const int victim = static_cast<int>(rng() % 3);
  const int at_step = static_cast<int>(rng() % 3);
  const bool during = rng() % 2 == 0;
  const std::string what = std::string{"seed "} + std::to_string(seed) + " (" + c.describe() +
                           (lockstep ? ", lockstep channels" : "") + "): fault " +
                           fault_name(kind) + " on worker " + std::to_string(victim) +
                           (during ? " during" : " before") + " step " + std::to_string(at_step);
  // Before the step: a kill or a partition now, or a filter on the messages from now on.
  auto strike_before = [&] {
    switch (kind) {
    case fault::none:
    case fault::throw_in_step:
      break;
    case fault::kill:
      if (during) // the victim crashes as it sends its first message of the step
        c.on_message([victim](const testing::message& m) {
          return m.from == victim ? verdict::crash_sender() : verdict::deliver();
        });
      else
        c.kill(victim);
      break;
    case fault::partition:
      if (during) // the cut begins with the victim's first message of the step
        c.on_message([victim](const testing::message& m) {
          return m.from == victim ? verdict::partition({victim}) : verdict::deliver();
        });
      else
        c.partition({victim});
      break;
    case fault::drop:
      c.on_message([seed, victim](const testing::message& m) {
        return m.from == victim && mix(seed, m) % 4 == 0 ? verdict::drop() : verdict::deliver();
      });
      break;
    case fault::delay:
      c.on_message([seed](const testing::message& m) {
        return verdict::delay_by(std::chrono::milliseconds(mix(seed, m) % 2000));
      });
      break;
    case fault::corrupt:
      c.on_message([seed, victim](const testing::message& m) {
        return m.from == victim && mix(seed, m) % 3 == 0 ? verdict::corrupt() : verdict::deliver();
      });
      break;
    }
  };
  for (int step = 0; step < 3; ++step) {
    if (step == at_step)
      strike_before();
    const bool throws = kind == fault::throw_in_step && step == at_step;
    auto runs = c.run_all([throws, victim, replicas](replica_context& ctx) {
      if (throws && ctx.replica_id_in_sync_group() == replicas * (victim + 1) - 1)
        throw std::runtime_error("injected failure");
      return ctx.all_reduce(
          "SUM", tensor::scalar<float>(static_cast<float>(ctx.replica_id_in_sync_group() + 1)));
    });
    // Push simulated time until every worker's step has ended: 60 s is past every deadline.
    // Time moves only once every worker has ended its step or waits on the network for an
    // operation that is not done (settle): a worker still computing, or not yet woken by a
    // delivery, would otherwise see its deadline come in simulated time while it is merely slow
    // in real time (a loaded machine under ASan: seed 163 failed so, "fault none").
    auto all_done = [&] {
      for (auto& f : runs)
        if (!f.ready())
          return false;
      return true;
    };
    for (int pushed = 0; pushed < 60; ++pushed) {
      settle(c, runs);
      if (all_done())
        break;
      c.advance(1s);
    }
    for (size_t w = 0; w < runs.size(); ++w) {
      if (!runs[w].wait_for(10s))
        return what + ": worker " + std::to_string(w) + " hangs in step " + std::to_string(step);
      try {
        auto result = runs[w].get();
        for (const auto& v : result.values())
          if (v.item<float>() != sum)
            return what + ": worker " + std::to_string(w) + " got " +
                   std::to_string(v.item<float>()) + " instead of " + std::to_string(sum) +
                   " in step " + std::to_string(step);
        ++seen[kind].exact;
      } catch (const error& e) {
        ++seen[kind].errors;
        const auto code = e.code();
        const bool clear = code == errc::peer_lost || code == errc::collective_timeout ||
                           code == errc::step_failed || code == errc::collective_aborted ||
                           code == errc::peer_left;
        if (!clear || std::string{e.what()}.empty())
          return what + ": worker " + std::to_string(w) + " failed with errc::" + to_string(code) +
                 ": " + e.what();
        if (kind == fault::none)
          return what + ": worker " + std::to_string(w) + " failed without a fault: " + e.what();
      }
    }
  }
  return {};
}

TEST(TestingCluster, ASenderCrashesAtAnExactPointOfTheProtocol) {
  cluster c({.workers = 3, .seed = 9});
  auto warm = c.run_all(one_sum);
  expect_all_equal(warm, 3.0f, c);
  // Worker 1 dies as it sends its second message to worker 2 (its first of the next step).
  c.on_message([](const testing::message& m) {
    return m.from == 1 && m.to == 2 && m.link_seq == 1 ? verdict::crash_sender()
                                                       : verdict::deliver();
  });
  auto runs = c.run_all(one_sum);
  for (int w : {0, 2})
    EXPECT_TRUE(fails(runs[static_cast<size_t>(w)], errc::peer_lost, {"worker:1"}))
        << "worker " << w;
  EXPECT_FALSE(c.alive(1));
  int after = 0;
  bool crashed_at = false;
  for (const auto& m : c.messages()) {
    if (m.from == 1 && m.to == 2 && m.link_seq == 1) {
      crashed_at = true;
      EXPECT_EQ(m.what, testing::fate::dropped) << "the message is lost with its sender";
    } else if (crashed_at && m.from == 1 && m.kind == "data") {
      after += m.what == testing::fate::delivered;
    }
  }
  EXPECT_TRUE(crashed_at);
  EXPECT_EQ(after, 0) << "nothing leaves a dead worker";
}

// Every point of a lone replica's step over lockstep channels (as over shared memory on one
// host): a step of two small all-reduces (the lean path) and one of 8 KiB (the descriptor
// exchange, then the data), and worker 1 of 3 dies as it sends its n-th message of the step, or
// is cut off by a partition that begins with that message, for every n. Each survivor's step
// ends, in simulated time, with the exact sums or with peer_lost naming worker:1, and at least one
// fails.
TEST(TestingCluster, WithLockstepChannelsAWorkerThatDiesAtAnyMessageOfAStepFailsItsPeersClearly) {
  auto step = [](replica_context& ctx) {
    const float me = static_cast<float>(ctx.replica_id_in_sync_group() + 1);
    const float a = ctx.all_reduce("SUM", tensor::scalar<float>(me)).item<float>();
    const float b = ctx.all_reduce("MAX", tensor::scalar<float>(me)).item<float>();
    auto big = ctx.all_reduce("SUM", tensor::from<float>(std::vector<float>(2048, me), {2048}));
    return tensor::from<float>({a, b, big.to_vector<float>()[2047]}, {3});
  };
  const std::vector<float> exact{6, 3, 6};
  // How many messages worker 1 sends in the step, from a run without a fault.
  size_t points = 0;
  {
    cluster c({.workers = 3, .seed = 21, .lockstep_channels = true});
    auto warm = c.run_all(one_sum);
    expect_all_equal(warm, 3.0f, c);
    const auto before = c.messages().size();
    auto runs = c.run_all(step);
    for (auto& f : runs) {
      ASSERT_TRUE(f.wait_for(10s));
      EXPECT_EQ(f.get().values()[0].to_vector<float>(), exact);
    }
    const auto log = c.messages();
    for (size_t i = before; i < log.size(); ++i)
      points += log[i].from == 1 && log[i].kind == "data";
    ASSERT_GE(points, 6u) << "two lean calls and one exchange with data, to two peers";
  }
  for (size_t n = 0; n < 2 * points; ++n) {
    const bool cut = n >= points;
    SCOPED_TRACE(std::string{"worker 1 "} + (cut ? "is cut off" : "dies") + " at its message " +
                 std::to_string(n % points) + " of the step");
    cluster c({.workers = 3, .seed = 21, .lockstep_channels = true});
    auto warm = c.run_all(one_sum);
    expect_all_equal(warm, 3.0f, c);
    auto sent = std::make_shared<size_t>(0);
    c.on_message([sent, n, cut, points](const testing::message& m) {
      if (m.from != 1 || m.kind != "data" || (*sent)++ != n % points)
        return verdict::deliver();
      return cut ? verdict::partition({1}) : verdict::crash_sender();
    });
    auto runs = c.run_all(step);
    for (int pushed = 0; pushed < 60; ++pushed) {
      settle(c, runs);
      if (runs[0].ready() && runs[2].ready())
        break;
      c.advance(1s);
    }
    EXPECT_EQ(c.alive(1), cut);
    int failed = 0;
    for (int w : {0, 2}) {
      auto& f = runs[static_cast<size_t>(w)];
      ASSERT_TRUE(f.wait_for(10s)) << "worker " << w << " hangs";
      try {
        EXPECT_EQ(f.get().values()[0].to_vector<float>(), exact) << "worker " << w;
      } catch (const error& e) {
        ++failed;
        EXPECT_EQ(e.code(), errc::peer_lost) << "worker " << w << ": " << e.what();
        EXPECT_NE(std::string{e.what()}.find("worker:1"), std::string::npos)
            << "worker " << w << ": " << e.what();
      }
    }
    EXPECT_GE(failed, 1) << "a message of worker 1 was lost";
  }
}

TEST(TestingCluster, AFilterThatDecidesByLinkPlaceStrikesTheSameMessagesOnEveryRun) {
  auto dropped = [] {
    cluster c({.workers = 3, .replicas_per_worker = 2, .seed = 11});
    c.on_message([](const testing::message& m) {
      return m.from == 2 && mix(11, m) % 2 == 0 ? verdict::drop() : verdict::deliver();
    });
    for (int step = 0; step < 3; ++step) {
      auto runs = c.run_all(one_sum);
      settle(c, runs);
      for (int pushed = 0; pushed < 60 && !runs[0].wait_for(2ms); ++pushed)
        c.advance(1s);
      for (auto& f : runs)
        EXPECT_TRUE(f.wait_for(10s)) << "step " << step;
    }
    std::set<std::tuple<int, int, uint64_t>> out;
    for (const auto& m : c.messages())
      if (m.what == testing::fate::dropped)
        out.insert({m.from, m.to, m.link_seq});
    return out;
  };
  auto first = dropped();
  EXPECT_FALSE(first.empty());
  EXPECT_EQ(dropped(), first);
}

// A partition that begins at an exact message: the first step is exact on every worker; in the
// second, worker 2's message of that step to worker 0 starts the cut. Everything before it was
// delivered, it and every later message across the cut vanish, and workers 0 and 1, which never
// get worker 2's part, fail with peer_lost after the peer timeout. On every run the same messages
// of worker 2 are struck. What the others sent to worker 2 in that step crossed or not depending
// on whether they sent it before the cut began (threads), so worker 2 ends with the exact sum or
// with peer_lost.
TEST(TestingCluster, APartitionVerdictCutsAtAnExactMessageOfTheVictim) {
  auto run = [] {
    cluster c({.workers = 3, .replicas_per_worker = 2, .seed = 13, .peer_timeout = 4s});
    c.on_message([](const testing::message& m) {
      return m.from == 2 && m.to == 0 && m.link_seq == 1 ? verdict::partition({2})
                                                         : verdict::deliver();
    });
    for (int step = 0; step < 2; ++step) {
      auto runs = c.run_all(one_sum);
      settle(c, runs);
      for (int pushed = 0; pushed < 10 && !runs[0].wait_for(2ms); ++pushed)
        c.advance(1s);
      for (int w = 0; w < 3; ++w) {
        auto& f = runs[static_cast<size_t>(w)];
        EXPECT_TRUE(f.wait_for(10s)) << "step " << step;
        auto code = code_of(f);
        if (step == 0)
          EXPECT_EQ(code, errc::none) << "worker " << w;
        else if (w < 2)
          EXPECT_EQ(code, errc::peer_lost) << "worker " << w;
        else
          EXPECT_TRUE(code == errc::none || code == errc::peer_lost) << to_string(code);
      }
    }
    std::vector<std::tuple<int, int, uint64_t, testing::fate>> victims;
    bool cut = false;
    for (const auto& m : c.messages()) {
      if (m.kind != "data")
        continue;
      if (m.from == 2 && m.to == 0 && m.link_seq == 1)
        cut = true;
      if ((m.from == 2) != (m.to == 2)) { // the log is in sending order
        EXPECT_EQ(m.what, cut ? testing::fate::dropped : testing::fate::delivered)
            << m.from << " -> " << m.to << " #" << m.link_seq;
      }
      if (m.from == 2)
        victims.emplace_back(m.from, m.to, m.link_seq, m.what);
    }
    EXPECT_TRUE(cut) << "the cutting message was sent";
    std::sort(victims.begin(), victims.end());
    return victims;
  };
  auto first = run();
  EXPECT_EQ(first.size(), 4u) << "two steps, one message to each peer";
  EXPECT_EQ(run(), first);
}

// A partition verdict whose side is no partition is refused: the message goes through, the step
// is exact, and the test's next call says what was wrong, once.
TEST(TestingCluster, AnInvalidPartitionVerdictIsRefusedSayingWhy) {
  for (auto side : {std::vector<int>{}, std::vector<int>{0, 1}, std::vector<int>{5}}) {
    cluster c({.workers = 2, .seed = 3});
    c.on_message([side](const testing::message& m) {
      return m.link_seq == 0 && m.from == 0 ? verdict::partition(side) : verdict::deliver();
    });
    auto runs = c.run_all(one_sum);
    for (auto& f : runs)
      EXPECT_EQ(code_of(f), errc::none);
    auto why = side.size() == 1 ? "worker 5 does not exist (expected 0 to 1)"
                                : "expected some but not all";
    EXPECT_TRUE(fails_with(
        [&] { c.messages(); }, errc::invalid_argument,
        {"verdict::partition for the message 0 from worker 0 to worker 1", "was refused", why}));
    EXPECT_NO_THROW(c.messages()) << "reported once";
  }
}

/// The fuzz below over the network with or without lockstep channels.
void random_faults(bool lockstep) {
  // CONSORT_HARNESS_SEEDS overrides the count (tools/sanitize.sh runs fewer).
  uint64_t seeds = 1000;
  if (const char* env = std::getenv("CONSORT_HARNESS_SEEDS"))
    seeds = std::strtoull(env, nullptr, 10);
  uint64_t first = 0;
  if (const char* env = std::getenv("CONSORT_HARNESS_SEED_ONLY")) {
    first = std::strtoull(env, nullptr, 10);
    seeds = 1;
  }
  std::map<fault, tally> seen;
  auto started = wall::now();
  for (uint64_t seed = first; seed < first + seeds; ++seed) {
    // Over lockstep channels, every other seed has lone replicas (their small all-reduce
    // takes the lean path).
    auto failure = run_seed(seed, seen, lockstep, lockstep && seed % 2 == 1 ? 1 : 2);
    ASSERT_TRUE(failure.empty()) << failure << "\nreplay: CONSORT_HARNESS_SEED_ONLY=" << seed;
  }
  std::cout << seeds << " seeds in "
            << std::chrono::duration_cast<std::chrono::milliseconds>(wall::now() - started).count()
            << " ms of wall time; worker-steps exact / failed:";
  for (const auto& [kind, t] : seen)
    std::cout << " " << fault_name(kind) << " " << t.exact << "/" << t.errors << ";";
  std::cout << std::endl;
  if (seeds >= 100) {
    // The faults bite: each kind that must break a step did, and fault-free runs never failed.
    for (auto kind : {fault::kill, fault::partition, fault::throw_in_step, fault::corrupt})
      EXPECT_GT(seen[kind].errors, 0) << fault_name(kind);
    EXPECT_GT(seen[fault::none].exact, 0);
    EXPECT_GT(seen[fault::delay].exact, 0);
  }
}

TEST(TestingClusterFuzz, RandomFaultsEndInExactResultsOrClearErrorsOnEveryWorker) {
  random_faults(false);
}

// The same seeds with lockstep channels (as over shared memory on one host), through which the
// workers exchange their calls' descriptors, and through which a lone replica's small all-reduce
// (every other seed) takes its lean path: a failed exchange leaves a channel out of step, and
// what follows must still be an exact result or a clear error.
TEST(TestingClusterFuzz, RandomFaultsOverLockstepChannelsEndInExactResultsOrClearErrors) {
  random_faults(true);
}

TEST(TestingCluster, AStepThatHangsFailsWithStepTimeoutInSimulatedTime) {
  testing::cluster_options opts;
  opts.workers = 2;
  opts.strategy.step_timeout = 10min;
  cluster c(opts);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  auto started = wall::now();
  auto runs = c.run_all([released](replica_context& ctx) {
    if (ctx.replica_id_in_sync_group() == 1)
      released.wait(); // worker 1's replica hangs before its collective
    return one_sum(ctx);
  });
  ASSERT_TRUE(c.wait_blocked(0)) << "worker 0 waits in its all-reduce";
  c.advance(31s); // worker 0's collective deadline (30 s) passes
  EXPECT_TRUE(fails(runs[0], errc::collective_timeout, {"receive from rank 1"}));
  EXPECT_FALSE(runs[1].wait_for(20ms)) << "worker 1's step is within its 10 min";
  c.advance(10min); // and worker 1's step deadline
  EXPECT_TRUE(
      fails(runs[1], errc::step_timeout,
            {"step 0 did not finish within the step deadline of 600000 ms", "on replica(s) 1"}));
  EXPECT_LT(wall::now() - started, consort::test::scaled(5s))
      << "10 minutes of step deadline took no wall-clock wait";
  release.set_value(); // the hung replica finishes (its step already failed)
}

// -- misuse --------------------------------------------------------------------------------------

TEST(TestingCluster, BadOptionsAndArgumentsAreRefusedSayingWhatWasExpected) {
  EXPECT_TRUE(fails_with([] { cluster c({.workers = 1}); }, errc::invalid_argument,
                         {"1 workers", "expected 2 or more"}));
  EXPECT_TRUE(fails_with([] { cluster c({.workers = 2, .replicas_per_worker = 0}); },
                         errc::invalid_argument, {"0 replicas per worker", "expected 1 or more"}));
  cluster c({.workers = 2});
  EXPECT_TRUE(
      fails_with([&] { c.strategy(2); }, errc::invalid_argument, {"no worker 2", "0 to 1"}));
  EXPECT_TRUE(fails_with([&] { c.kill(-1); }, errc::invalid_argument, {"no worker -1"}));
  EXPECT_TRUE(fails_with([&] { c.partition({}); }, errc::invalid_argument,
                         {"0 of 2 workers", "some but not all"}));
  EXPECT_TRUE(fails_with([&] { c.partition({0, 1}); }, errc::invalid_argument, {"2 of 2"}));
  EXPECT_TRUE(fails_with([&] { c.advance(-1ns); }, errc::invalid_argument, {"forward"}));
  EXPECT_TRUE(fails_with([] { cluster bad({.workers = 2, .late = {2}}); }, errc::invalid_argument,
                         {"late: no worker 2"}));
  EXPECT_TRUE(fails_with(
      [] {
        cluster bad({.workers = 3, .late = {1, 1}});
      },
      errc::invalid_argument, {"worker 1 is named twice"}));
  {
    consort::test::scoped_env yes{"CONSORT_TESTING_LOCKSTEP_CHANNELS", "yes"};
    EXPECT_TRUE(fails_with([] { cluster bad({.workers = 2}); }, errc::invalid_argument,
                           {"CONSORT_TESTING_LOCKSTEP_CHANNELS is 'yes'", "expected 1", "or 0"}));
  }
  // The cluster still works after the refusals.
  auto runs = c.run_all(one_sum);
  expect_all_equal(runs, 2.0f, c);
}

// -- the simulated network against the transport's contract --------------------------------------

std::vector<transport::context_ptr> sim_group(int n,
                                              std::shared_ptr<testing::detail::sim_world>& w) {
  w = std::make_shared<testing::detail::sim_world>(n, 5s);
  return w->make_contexts();
}

TEST(SimTransport, TheRingAllReduceIsExactOverIt) {
  for (int n : {2, 3, 5}) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}}) {
      std::shared_ptr<testing::detail::sim_world> world;
      auto ctxs = sim_group(n, world);
      std::vector<std::vector<int32_t>> data(static_cast<size_t>(n), std::vector<int32_t>(count));
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < count; ++i)
          data[static_cast<size_t>(r)][i] = r * 7 + static_cast<int32_t>(i);
      std::vector<std::future<caf::error>> runs;
      for (int r = 0; r < n; ++r)
        runs.push_back(std::async(std::launch::async, [&, r] {
          return transport::all_reduce(ctxs[static_cast<size_t>(r)],
                                       data[static_cast<size_t>(r)].data(), count, dtype::int32,
                                       reduce_op::sum, {});
        }));
      for (auto& f : runs)
        ASSERT_FALSE(f.get());
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < count; ++i)
          ASSERT_EQ(data[static_cast<size_t>(r)][i],
                    7 * n * (n - 1) / 2 + n * static_cast<int32_t>(i))
              << n << " ranks, " << count << " elements, rank " << r << ", element " << i;
    }
  }
}

TEST(SimTransport, ReceivesMatchTagsAndSizesAndALeaverFailsWhatItNeverSent) {
  std::shared_ptr<testing::detail::sim_world> world;
  auto ctxs = sim_group(2, world);
  std::vector<std::byte> a(8, std::byte{1}), b(8, std::byte{2}), got(8), small(4);
  auto r2 = ctxs[1]->to(0).recv(2, got);
  EXPECT_FALSE(
      ctxs[0]->to(1).send(1, {transport::const_bytes(a)})->wait(transport::clock::now() + 1s));
  EXPECT_FALSE(
      ctxs[0]->to(1).send(2, {transport::const_bytes(b)})->wait(transport::clock::now() + 1s));
  EXPECT_FALSE(r2->wait(transport::clock::now() + 1s));
  EXPECT_EQ(got, b);
  EXPECT_TRUE(has_error(ctxs[1]->to(0).recv(1, small)->wait(transport::clock::now() + 1s),
                        errc::invalid_argument, {"recv of tag 1", "has 8 bytes", "dropped"}));
  auto never = ctxs[1]->to(0).recv(3, got);
  EXPECT_TRUE(has_error(never->wait(transport::clock::now() + 10ms), errc::collective_timeout,
                        {"recv of tag 3", "did not complete"}));
  EXPECT_FALSE(ctxs[0]->close("done", transport::clock::now() + 1s));
  EXPECT_TRUE(has_error(never->wait(transport::clock::now() + 1s), errc::peer_left,
                        {"rank 0 left the group (done)"}));
  EXPECT_TRUE(has_error(
      ctxs[1]->to(0).send(4, {transport::const_bytes(a)})->wait(transport::clock::now() + 1s),
      errc::peer_left, {"send of tag 4", "rank 0 left"}));
  EXPECT_TRUE(has_error(
      ctxs[0]->to(1).send(5, {transport::const_bytes(a)})->wait(transport::clock::now() + 1s),
      errc::shutdown, {"leaving the group"}));
}

TEST(SimTransport, AnAbortCarriesItsCodeAndReasonToThePeers) {
  std::shared_ptr<testing::detail::sim_world> world;
  auto ctxs = sim_group(3, world);
  std::vector<std::byte> got(4);
  auto pending = ctxs[2]->to(0).recv(1, got);
  ctxs[0]->abort("rank 0 called all_gather", errc::collective_mismatch);
  EXPECT_TRUE(has_error(pending->wait(transport::clock::now() + 1s), errc::collective_mismatch,
                        {"rank 0 aborted the group: rank 0 called all_gather"}));
  EXPECT_TRUE(has_error(ctxs[0]->to(1).recv(1, got)->wait(transport::clock::now() + 1s),
                        errc::collective_mismatch, {"rank 0 called all_gather"}));
  // The others' own link is untouched.
  std::vector<std::byte> a(4, std::byte{9});
  auto r = ctxs[2]->to(1).recv(7, got);
  EXPECT_FALSE(
      ctxs[1]->to(2).send(7, {transport::const_bytes(a)})->wait(transport::clock::now() + 1s));
  EXPECT_FALSE(r->wait(transport::clock::now() + 1s));
  auto log = world->messages();
  int notices = 0;
  for (const auto& m : log)
    notices += m.kind == "abort" && m.from == 0;
  EXPECT_EQ(notices, 2) << "rank 0 told each peer once";
}

// The lockstep channels of the simulated network keep shared memory's contract
// (tests/transport/shm_test.cpp, ShmMailboxTest): messages in lockstep, read in place; a put
// before the peer took the last one, or of another tag, refused; a take that timed out leaves the
// late message for the next look; a message put before its sender aborted is still taken, then
// the abort is seen; an aborted context's put says the abort's cause first.
TEST(SimTransport, LockstepChannelsKeepSharedMemorysContract) {
  using transport::clock;
  auto world = std::make_shared<testing::detail::sim_world>(3, 5s, true);
  auto ctxs = world->make_contexts();
  ASSERT_NE(ctxs[0]->mailbox(0), nullptr);
  ASSERT_NE(ctxs[0]->mailbox(1), nullptr);
  EXPECT_EQ(ctxs[0]->mailbox(2), nullptr);
  EXPECT_EQ(std::make_shared<testing::detail::sim_world>(2, 5s)->make_contexts()[0]->mailbox(0),
            nullptr)
      << "none on the TCP-like network";
  auto* a = ctxs[0]->mailbox(0);
  auto* b = ctxs[1]->mailbox(0);
  EXPECT_EQ(a->capacity(), 8168u);
  auto text = [](const std::string& t) {
    return transport::const_bytes{reinterpret_cast<const std::byte*>(t.data()), t.size()};
  };
  auto as_text = [](transport::const_bytes got) {
    return std::string{reinterpret_cast<const char*>(got.data()), got.size()};
  };
  for (int round = 0; round < 3; ++round) {
    const std::string mine = "from 0, round " + std::to_string(round);
    const std::string theirs = "from 1, round " + std::to_string(round);
    ASSERT_FALSE(a->put(1, 40 + round, {text(mine)}));
    ASSERT_FALSE(b->put(0, 40 + round, {text(theirs)}));
    EXPECT_TRUE(b->arrived(0));
    auto at_b = b->take(0, 40 + round, clock::now() + 1s);
    auto at_a = a->take(1, 40 + round, clock::now() + 1s);
    ASSERT_TRUE(at_b && at_a);
    EXPECT_EQ(as_text(*at_b), mine);
    EXPECT_EQ(as_text(*at_a), theirs);
  }
  EXPECT_FALSE(ctxs[1]->mailbox(1)->arrived(0)) << "the other channel has nothing";
  // A second put before the peer's answer was taken, and a take of another tag.
  ASSERT_FALSE(a->put(1, 7, {text("x")}));
  EXPECT_TRUE(has_error(
      a->put(1, 8, {text("y")}), errc::invalid_argument,
      {"message 5 of lockstep channel 0 to rank 1", "message 4 of rank 1 was not taken yet"}));
  EXPECT_TRUE(has_error(b->take(0, 9, clock::now() + 1s).error(), errc::invalid_argument,
                        {"carries tag 0x7 where tag 0x9 was expected", "out of step"}));
  const std::vector<std::byte> big(8169);
  EXPECT_TRUE(has_error(ctxs[2]->mailbox(0)->put(0, 1, {transport::const_bytes(big)}),
                        errc::invalid_argument, {"8169 bytes", "at most 8168"}));
  // A take that times out; the message put after it is there for the next look, and taken.
  auto* c = ctxs[2]->mailbox(1);
  auto* a1 = ctxs[0]->mailbox(1);
  EXPECT_TRUE(has_error(c->take(0, 3, clock::now() + 10ms).error(), errc::collective_timeout,
                        {"message 1 of lockstep channel 1 from rank 0"}));
  ASSERT_FALSE(a1->put(2, 3, {text("late")}));
  EXPECT_TRUE(c->arrived(0));
  auto late = c->take(0, 3, clock::now() + 1s);
  ASSERT_TRUE(late) << consort::test::text_of(late.error());
  EXPECT_EQ(as_text(*late), "late");
  // Rank 2 puts, then aborts: rank 0 still takes the message, then sees the abort; rank 2's
  // next put says why it cannot.
  ASSERT_FALSE(c->put(0, 4, {text("last words")}));
  ctxs[2]->abort("rank 2 timed out", errc::collective_timeout);
  auto last = a1->take(2, 4, clock::now() + 1s);
  ASSERT_TRUE(last) << consort::test::text_of(last.error());
  EXPECT_EQ(as_text(*last), "last words");
  EXPECT_TRUE(has_error(a1->take(2, 5, clock::now() + 1s).error(), errc::collective_timeout,
                        {"rank 2 aborted the group: rank 2 timed out"}));
  EXPECT_TRUE(has_error(c->put(0, 5, {text("more")}), errc::collective_timeout,
                        {"this rank aborted: rank 2 timed out"}));
}

} // namespace
} // namespace consort
