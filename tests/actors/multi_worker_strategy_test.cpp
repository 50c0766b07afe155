// multi_worker_mirrored_strategy through its public API, inside one process: the one-worker
// fallback, argument errors, a failed rendezvous, and two workers on two threads over real TCP
// on loopback. The multi-process tests are in tests/multiworker.

#include <consort/cluster.hpp>
#include <consort/elastic.hpp>
#include <consort/ops.hpp>
#include <consort/strategy.hpp>

#include "support/expect_error.hpp"
#include "support/free_port.hpp"
#include "support/scoped_env.hpp"
#include "support/strategy_helpers.hpp"
#include "support/time_scale.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace consort;
using namespace std::chrono_literals;

namespace {

using consort::test::free_port;

std::shared_ptr<const cluster_resolver> two_workers(int port, int index) {
  auto spec = cluster_spec::dense(
      {{"worker", {"127.0.0.1:" + std::to_string(port), "127.0.0.1:" + std::to_string(port + 1)}}});
  return std::make_shared<simple_cluster_resolver>(spec, "worker", index);
}

multi_worker_options quiet(std::shared_ptr<const cluster_resolver> resolver) {
  multi_worker_options mw;
  mw.resolver = std::move(resolver);
  mw.log = [](const std::string&) {
  };
  return mw;
}

} // namespace

TEST(MultiWorkerStrategyTest, WithoutAClusterItIsOneWorkerOfItsDevices) {
  auto mw = quiet(cluster_resolver::local());
  mw.devices = {"CPU:0", "CPU:1"};
  multi_worker_mirrored_strategy strategy({}, mw);
  EXPECT_STREQ(strategy.name(), "MultiWorkerMirroredStrategy");
  EXPECT_EQ(strategy.num_workers(), 1);
  EXPECT_EQ(strategy.worker_rank(), 0);
  EXPECT_EQ(strategy.num_replicas_in_sync(), 2);
  EXPECT_TRUE(strategy.cluster_resolver().is_local());
  auto v = strategy.run(
      [](replica_context& ctx) { return ctx.all_reduce("SUM", tensor::scalar<float>(1.0f)); });
  EXPECT_EQ(strategy.reduce("SUM", v, std::nullopt), tensor::scalar<float>(4.0f));
  // A plain value is one worker's contribution: with one worker, SUM returns it.
  EXPECT_EQ(strategy.reduce("SUM", tensor::scalar<float>(3.0f), std::nullopt),
            tensor::scalar<float>(3.0f));
}

TEST(MultiWorkerStrategyTest, APsTaskHasNoReplicas) {
  auto spec =
      cluster_spec::dense({{"worker", {"127.0.0.1:1", "127.0.0.1:2"}}, {"ps", {"127.0.0.1:3"}}});
  auto mw = quiet(std::make_shared<simple_cluster_resolver>(spec, "ps", 0));
  try {
    multi_worker_mirrored_strategy strategy({}, mw);
    FAIL() << "a ps task built a strategy";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::unsupported) << e.what();
    EXPECT_NE(std::string{e.what()}.find("ps:0"), std::string::npos) << e.what();
  }
}

TEST(MultiWorkerStrategyTest, AnEvaluatorTaskIsAOneWorkerGroupOfItsOwn) {
  // As TF's CollectiveAllReduceExtended on an evaluator (multi_worker_util.worker_count gives 1,
  // id_in_cluster 0, is_chief True): it runs alone, with no rendezvous with the workers.
  auto spec = cluster_spec::dense({{"chief", {"127.0.0.1:1"}},
                                   {"worker", {"127.0.0.1:2", "127.0.0.1:3"}},
                                   {"evaluator", {"127.0.0.1:4"}}});
  auto mw = quiet(std::make_shared<simple_cluster_resolver>(spec, "evaluator", 0));
  mw.devices = {"CPU:0"};
  multi_worker_mirrored_strategy strategy({}, mw);
  EXPECT_EQ(strategy.num_workers(), 1);
  EXPECT_EQ(strategy.worker_rank(), 0);
  EXPECT_EQ(strategy.num_replicas_in_sync(), 1);
  auto out = strategy.run(
      [](replica_context& ctx) { return ctx.all_reduce("SUM", tensor::scalar<float>(2)); });
  EXPECT_EQ(out[0].item<float>(), 2.0f);
}

TEST(MultiWorkerStrategyTest, TheStrategyNotTheResolverRefusesAClusterItCannotRun) {
  // TF_CONFIG resolvers accept these (as TF's do); the strategy refuses them with TF's messages,
  // before any networking.
  auto refused = [](const std::string& tf_config, const std::string& fragment) {
    auto mw = quiet(std::make_shared<tf_config_cluster_resolver>(
        tf_config_cluster_resolver::from_json(tf_config)));
    try {
      multi_worker_mirrored_strategy strategy({}, mw);
    } catch (const error& e) {
      EXPECT_EQ(e.code(), errc::invalid_argument) << e.what();
      EXPECT_NE(std::string{e.what()}.find("MultiWorkerMirroredStrategy: " + fragment),
                std::string::npos)
          << e.what();
      return;
    }
    ADD_FAILURE() << "the strategy started on " << tf_config;
  };
  refused(R"({"cluster": {"worker": ["127.0.0.1:1"], "localhost": ["127.0.0.1:2"]},
              "task": {"type": "worker", "index": 0}})",
          "Disallowed task type found in cluster spec");
  refused(R"({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}})",
          "When `cluster_spec` is given, you must also specify `task_type` and `task_id`");
  refused(R"({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
              "task": {"type": "worker", "index": 5}})",
          "The `task_id` 5 exceeds the maximum id of worker");
  // Two tasks at one address fail at once, naming both, instead of waiting out the rendezvous.
  auto started = std::chrono::steady_clock::now();
  refused(R"({"cluster": {"worker": ["127.0.0.1:23411", "127.0.0.1:23411"]},
              "task": {"type": "worker", "index": 0}})",
          "tasks worker:0 and worker:1 have the same address \"127.0.0.1:23411\"");
  refused(R"({"cluster": {"chief": ["127.0.0.1:5"], "worker": ["127.0.0.1:6", "127.0.0.1:5"]},
              "task": {"type": "worker", "index": 0}})",
          "tasks chief:0 and worker:1 have the same address \"127.0.0.1:5\"");
  EXPECT_LT(std::chrono::steady_clock::now() - started, consort::test::scaled(1s));
}

TEST(MultiWorkerStrategyTest, BadDevicesAndTimeoutsAreRejectedBeforeAnyNetworking) {
  auto mw = quiet(two_workers(free_port(), 1));
  mw.devices = {"CPU:0", "CPU:0"};
  EXPECT_THROW(multi_worker_mirrored_strategy({}, mw), error);
  mw.devices = {"TPU:0"};
  EXPECT_THROW(multi_worker_mirrored_strategy({}, mw), error);
  mw.devices = {};
  strategy_options opts;
  opts.collective_timeout = 0ms;
  EXPECT_THROW(multi_worker_mirrored_strategy(opts, mw), error);
}

TEST(MultiWorkerStrategyTest, AWorkerWhoseChiefNeverStartsFailsNamingTheChief) {
  auto port = free_port();
  auto mw = quiet(two_workers(port, 1));
  mw.rendezvous_timeout = 300ms;
  try {
    multi_worker_mirrored_strategy strategy({}, mw);
    FAIL() << "joined a cluster without a chief";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::collective_timeout) << e.what();
    EXPECT_NE(std::string{e.what()}.find("127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.what();
  }
}

TEST(MultiWorkerStrategyTest, TwoWorkersOnTwoThreadsOverTcp) {
  auto port = free_port();
  auto work = [port](int index) {
    auto mw = quiet(two_workers(port, index));
    mw.devices = {"CPU:0", "CPU:1"};
    multi_worker_mirrored_strategy strategy({}, mw);
    EXPECT_EQ(strategy.worker_rank(), index);
    EXPECT_EQ(strategy.num_replicas_in_sync(), 4);
    EXPECT_EQ(strategy.local_replica_ids(), (std::vector<int>{2 * index, 2 * index + 1}));
    auto v = strategy.run([](replica_context& ctx) {
      return ctx.all_gather(tensor::from<int32_t>({ctx.replica_id_in_sync_group()}, {1}), 0);
    });
    auto total = strategy.reduce("SUM", v, std::nullopt);
    // A plain host value is summed across workers.
    auto plain = strategy.reduce("SUM", tensor::scalar<int32_t>(index + 1), std::nullopt);
    return std::make_pair(total, plain);
  };
  auto other = std::async(std::launch::async, work, 1);
  auto mine = work(0);
  auto theirs = other.get();
  auto want = tensor::from<int32_t>({0, 4, 8, 12}, {4}); // [0, 1, 2, 3] on each of 4 replicas
  EXPECT_EQ(mine.first, want);
  EXPECT_EQ(theirs.first, want);
  EXPECT_EQ(mine.second, tensor::scalar<int32_t>(3));
  EXPECT_EQ(theirs.second, tensor::scalar<int32_t>(3));
}

/// The log lines of a worker whose chief never starts (worker:1 of `spec`, 100 ms: the warning
/// comes before the rendezvous, whose timeout is the expected end), with `secret`.
std::vector<std::string> start_up_log(const cluster_spec& spec, const std::string& secret) {
  ::unsetenv("CONSORT_CLUSTER_SECRET"); // only the option counts here
  auto mw = quiet(std::make_shared<simple_cluster_resolver>(spec, "worker", 1));
  auto lines = std::make_shared<std::vector<std::string>>();
  mw.log = [lines](const std::string& line) {
    lines->push_back(line);
  };
  mw.secret = secret;
  mw.rendezvous_timeout = 100ms;
  EXPECT_THROW(multi_worker_mirrored_strategy({}, mw), error);
  return *lines;
}

int warnings_in(const std::vector<std::string>& lines) {
  return static_cast<int>(std::count_if(lines.begin(), lines.end(), [](const std::string& l) {
    return l.find("has no shared secret") != std::string::npos;
  }));
}

TEST(MultiWorkerStrategyTest, AClusterAcrossHostsWithoutASecretWarnsOnceAtStartUp) {
  auto port = free_port();
  auto two_hosts = cluster_spec::dense(
      {{"worker", {"127.0.0.1:" + std::to_string(port), "127.0.0.2:" + std::to_string(port)}}});
  auto lines = start_up_log(two_hosts, "");
  ASSERT_EQ(warnings_in(lines), 1);
  auto warning = *std::find_if(lines.begin(), lines.end(), [](const std::string& l) {
    return l.find("has no shared secret") != std::string::npos;
  });
  EXPECT_NE(warning.find("the cluster spans hosts (127.0.0.1, 127.0.0.2)"), std::string::npos)
      << warning;
  EXPECT_NE(warning.find("CONSORT_CLUSTER_SECRET"), std::string::npos) << warning;
  // With a secret, or on one loopback host, there is nothing to warn about.
  EXPECT_EQ(warnings_in(start_up_log(two_hosts, "s3cret")), 0);
  EXPECT_EQ(warnings_in(start_up_log(two_workers(port, 1)->cluster_spec(), "")), 0);
}

TEST(MultiWorkerStrategyTest, TwoWorkersWithASecretAuthenticateMembershipAndMesh) {
  auto port = free_port();
  auto work = [port](int index) {
    auto mw = quiet(two_workers(port, index));
    mw.secret = "the secret of this job";
    multi_worker_mirrored_strategy strategy({}, mw);
    auto v = strategy.run(
        [](replica_context& ctx) { return ctx.all_reduce("SUM", tensor::scalar<float>(1.0f)); });
    return strategy.reduce("SUM", v, std::nullopt);
  };
  auto other = std::async(std::launch::async, work, 1);
  // Each of the 2 replicas (one per worker) gets 2; the reduce sums them.
  EXPECT_EQ(work(0), tensor::scalar<float>(4.0f));
  EXPECT_EQ(other.get(), tensor::scalar<float>(4.0f));
}

TEST(MultiWorkerStrategyTest, EachWorkersInputFunctionGetsItsOwnPipelineId) {
  // 2 workers x 1 replica, global batch 4: each worker's function shards the 8 elements by its
  // pipeline id and batches by 2; the replicas' sums over both steps add up to every element once.
  auto port = free_port();
  auto work = [port](int index) {
    multi_worker_mirrored_strategy strategy({}, quiet(two_workers(port, index)));
    int pipeline = -1;
    auto dist = strategy.distribute_datasets_from_function([&](const input_context& ctx) {
      EXPECT_EQ(ctx.num_input_pipelines(), 2);
      EXPECT_EQ(ctx.num_replicas_in_sync(), 2);
      pipeline = ctx.input_pipeline_id();
      return dataset::from_tensor_slices(nest(tensor::from<float>({1, 2, 4, 8, 16, 32, 64, 128})))
          .shard(ctx.num_input_pipelines(), ctx.input_pipeline_id())
          .batch(ctx.get_per_replica_batch_size(4));
    });
    EXPECT_EQ(pipeline, strategy.worker_rank());
    return consort::test::sum_over_steps(strategy, dist);
  };
  auto other = std::async(std::launch::async, work, 1);
  EXPECT_EQ(work(0), 255.0f);
  EXPECT_EQ(other.get(), 255.0f);
}

// -- elastic groups: the public API's refusals and a lone worker's rollback (the groups of several
// workers, killed and restarted, are real processes: tests/multiworker/elastic_test.sh) --------

TEST(ElasticStrategyTest, ReformOfAGroupThatIsNotElasticIsRefused) {
  auto mw = quiet(cluster_resolver::local());
  mw.devices = {"CPU:0"};
  multi_worker_mirrored_strategy strategy({}, mw);
  EXPECT_EQ(strategy.membership_epoch(), 1u);
  EXPECT_TRUE(consort::test::fails_with([&] { strategy.reform(); }, errc::invalid_argument,
                                        {"reform", "not elastic"}));
}

TEST(ElasticStrategyTest, AMinimumOutsideOneToTheWorkersIsRefusedBeforeAnyNetworking) {
  for (int min : {-1, 3}) {
    auto mw = quiet(two_workers(free_port(), 0));
    mw.elastic_min_workers = min;
    EXPECT_TRUE(consort::test::fails_with(
        [&] { multi_worker_mirrored_strategy strategy({}, mw); }, errc::invalid_argument,
        {"elastic_min_workers is " + std::to_string(min), "the number of workers (2)"}));
  }
}

TEST(ElasticStrategyTest, AMalformedMinimumInTheEnvironmentIsRefused) {
  consort::test::scoped_env env{"CONSORT_ELASTIC_MIN_WORKERS", "two"};
  auto mw = quiet(cluster_resolver::local());
  mw.devices = {"CPU:0"};
  EXPECT_TRUE(consort::test::fails_with([&] { multi_worker_mirrored_strategy strategy({}, mw); },
                                        errc::invalid_argument,
                                        {"CONSORT_ELASTIC_MIN_WORKERS is \"two\"", "a count"}));
}

TEST(ElasticStrategyTest, AStepBoundaryOfAGroupThatIsNotElasticLetsTheLoopGoOn) {
  auto mw = quiet(cluster_resolver::local());
  mw.devices = {"CPU:0"};
  multi_worker_mirrored_strategy strategy({}, mw);
  strategy.step_boundary(); // nothing can join: no error, no collective
  auto out = strategy.run([](replica_context&) { return tensor::scalar<int32_t>(1); });
  EXPECT_EQ(out.values().front(), tensor::scalar<int32_t>(1));
}

TEST(ElasticStrategyTest, AMalformedOrNegativePeerTimeoutIsRefused) {
  for (const char* text : {"soon", "-5", "0", "100000000000"}) {
    consort::test::scoped_env env{"CONSORT_PEER_TIMEOUT_MS", text};
    auto mw = quiet(cluster_resolver::local());
    mw.devices = {"CPU:0"};
    EXPECT_TRUE(consort::test::fails_with(
        [&] { multi_worker_mirrored_strategy strategy({}, mw); }, errc::invalid_argument,
        {"CONSORT_PEER_TIMEOUT_MS is \"" + std::string{text} + "\"", "1 to 86400000"}));
  }
  auto mw = quiet(cluster_resolver::local());
  mw.devices = {"CPU:0"};
  mw.peer_timeout = std::chrono::milliseconds{-1};
  EXPECT_TRUE(consort::test::fails_with([&] { multi_worker_mirrored_strategy strategy({}, mw); },
                                        errc::invalid_argument,
                                        {"peer_timeout is -1 ms", "expected 0"}));
  mw.peer_timeout = std::chrono::milliseconds{0};
  mw.heartbeat_interval = std::chrono::milliseconds{-3};
  EXPECT_TRUE(consort::test::fails_with(
      [&] { multi_worker_mirrored_strategy strategy({}, mw); }, errc::invalid_argument,
      {"heartbeat_interval is -3 ms", "an eighth of peer_timeout"}));
}

TEST(ElasticStrategyTest, SyncBeforeAnyCommitIsRefused) {
  auto mw = quiet(cluster_resolver::local());
  mw.devices = {"CPU:0"};
  multi_worker_mirrored_strategy strategy({}, mw);
  elastic_state state{strategy};
  EXPECT_FALSE(state.committed());
  EXPECT_TRUE(consort::test::fails_with([&] { state.sync(); }, errc::invalid_argument,
                                        {"sync before any commit"}));
}

// A lone worker's sync is its own commit: the variables and the extra roll back to it, the first
// commit (local copies) and later ones (variable_values) alike.
TEST(ElasticStrategyTest, SyncRollsTheVariablesAndTheExtraBackToTheCommit) {
  auto mw = quiet(cluster_resolver::local());
  mw.devices = {"CPU:0", "CPU:1"};
  multi_worker_mirrored_strategy strategy({}, mw);
  auto w = strategy.create_variable("w", tensor::from<float>({1, 2}, {2}));
  elastic_state state{strategy};
  state.commit(nest::dict({{"step", tensor::scalar<int64_t>(3)}}));
  w.assign(tensor::from<float>({7, 7}, {2}));
  auto extra = state.sync();
  EXPECT_EQ(extra["step"].as_tensor(), tensor::scalar<int64_t>(3));
  for (const auto& copy : w.local_values())
    EXPECT_EQ(copy, tensor::from<float>({1, 2}, {2}));
  w.assign(tensor::from<float>({5, 6}, {2}));
  state.commit(nest::dict({{"step", tensor::scalar<int64_t>(9)}}));
  w.assign(tensor::from<float>({0, 0}, {2}));
  EXPECT_EQ(state.sync()["step"].as_tensor(), tensor::scalar<int64_t>(9));
  EXPECT_EQ(w.value(), tensor::from<float>({5, 6}, {2}));
  EXPECT_EQ(state.extra()["step"].as_tensor(), tensor::scalar<int64_t>(9));
}
