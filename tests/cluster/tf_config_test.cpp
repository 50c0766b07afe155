#include "fake_env.hpp"
#include "support/scoped_env.hpp"

#include <consort/cluster.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

using consort::cluster_spec;
using consort::errc;
using consort::task_id;
using consort::tf_config_cluster_resolver;
using consort::tf_config_overrides;
using consort::validate_multi_worker_cluster;
using consort::test::fails_with;
using consort::test::fake_env;
using consort::test::scoped_env;

namespace {

// The cluster of TensorFlow's own tfconfig_cluster_resolver_test.py.
constexpr const char* ps_worker_cluster =
    R"("cluster": {"ps": ["ps0:2222", "ps1:2222"],
                   "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]})";

std::string with_cluster(const std::string& rest) {
  return std::string("{") + ps_worker_cluster + (rest.empty() ? "" : ", " + rest) + "}";
}

} // namespace

// -- what TF_CONFIG says --------------------------------------------------------------------------

TEST(TfConfigClusterResolverTest, ReadsTensorFlowsDocumentedExample) {
  auto r = tf_config_cluster_resolver::from_json(
      R"({"cluster": {"worker": ["localhost:12345", "localhost:23456"]},
          "task": {"type": "worker", "index": 0}})");
  EXPECT_EQ(r.cluster_spec(),
            cluster_spec::dense({{"worker", {"localhost:12345", "localhost:23456"}}}));
  EXPECT_EQ(r.task_type(), "worker");
  EXPECT_EQ(r.task_id(), 0);
  EXPECT_EQ(r.rpc_layer(), "");
  EXPECT_EQ(r.environment(), "");
  EXPECT_FALSE(r.is_local());
}

TEST(TfConfigClusterResolverTest, ReadsChiefWorkersPsAndEvaluator) {
  auto r = tf_config_cluster_resolver::from_json(
      R"({"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1", "w2:1"], "ps": ["p0:1", "p1:1"],
                      "evaluator": ["e:1"]},
          "task": {"type": "worker", "index": 2}})");
  EXPECT_EQ(r.cluster_spec(), cluster_spec::dense({{"chief", {"c:1"}},
                                                   {"worker", {"w0:1", "w1:1", "w2:1"}},
                                                   {"ps", {"p0:1", "p1:1"}},
                                                   {"evaluator", {"e:1"}}}));
  EXPECT_EQ(r.task(), (task_id{"worker", 2}));
  EXPECT_EQ(r.chief(), (task_id{"chief", 0}));
  EXPECT_FALSE(r.is_chief());
  EXPECT_EQ(r.worker_rank(), 3);
  EXPECT_EQ(r.num_workers(), 4);
}

TEST(TfConfigClusterResolverTest, ReadsSparseJobs) {
  auto r = tf_config_cluster_resolver::from_json(
      R"({"cluster": {"worker": {"1": "w1:1", "3": "w3:1"}, "ps": ["p:1"]},
          "task": {"type": "worker", "index": 3}})");
  EXPECT_EQ(r.cluster_spec(),
            cluster_spec({{"worker", {{1, "w1:1"}, {3, "w3:1"}}}, {"ps", {{0, "p:1"}}}}));
  EXPECT_EQ(r.task(), (task_id{"worker", 3}));
  EXPECT_EQ(r.master(), "w3:1");
}

TEST(TfConfigClusterResolverTest, ReadsTaskTypeIndexAndRpcLayer) {
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("rpc_layer": "grpc", "task": {"type": "ps", "index": 1})"));
  EXPECT_EQ(r.task_type(), "ps");
  EXPECT_EQ(r.task_id(), 1);
  EXPECT_EQ(r.rpc_layer(), "grpc");
}

TEST(TfConfigClusterResolverTest, MasterIsThisTasksAddress) {
  auto r =
      tf_config_cluster_resolver::from_json(with_cluster(R"("task": {"type": "ps", "index": 0})"));
  EXPECT_EQ(r.master(), "ps0:2222");
}

TEST(TfConfigClusterResolverTest, RpcLayerPrefixesTheMasterAddress) {
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("rpc_layer": "grpc", "task": {"type": "ps", "index": 0})"));
  EXPECT_EQ(r.master(), "grpc://ps0:2222");
}

TEST(TfConfigClusterResolverTest, MasterArgumentsOverrideTheTaskAndTheRpcLayer) {
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("rpc_layer": "grpc", "task": {"type": "ps", "index": 0})"));
  EXPECT_EQ(r.master("worker", 1), "grpc://worker1:2222");
  EXPECT_EQ(r.master("", 1), "grpc://ps1:2222");
  EXPECT_EQ(r.master("worker", -1), "grpc://worker0:2222");
  EXPECT_EQ(r.master("worker", 2, "test"), "test://worker2:2222");
}

TEST(TfConfigClusterResolverTest, MasterOfATaskOutsideTheClusterFails) {
  auto r =
      tf_config_cluster_resolver::from_json(with_cluster(R"("task": {"type": "ps", "index": 0})"));
  EXPECT_TRUE(fails_with([&] { r.master("worker", 7); }, errc::out_of_range, {"index 7"}));
  EXPECT_TRUE(fails_with([&] { r.master("chief", 0); }, errc::invalid_argument, {"\"chief\""}));
}

TEST(TfConfigClusterResolverTest, MasterIsEmptyForAClusterOfOneTask) {
  auto r = tf_config_cluster_resolver::from_json(
      R"({"cluster": {"worker": ["worker0:2222"]}, "task": {"type": "worker", "index": 0},
          "rpc_layer": "grpc"})");
  EXPECT_EQ(r.master(), "");
}

TEST(TfConfigClusterResolverTest, MasterIsEmptyForAnEmptyCluster) {
  EXPECT_EQ(tf_config_cluster_resolver::from_json("{}").master(), "");
  EXPECT_EQ(tf_config_cluster_resolver::from_json(R"({"rpc_layer": "grpc"})").master(), "");
}

TEST(TfConfigClusterResolverTest, MasterReturnsSessionMasterWhenSet) {
  auto r = tf_config_cluster_resolver::from_json(with_cluster(
      R"("session_master": "sessionmaster:2222", "task": {"type": "ps", "index": 0})"));
  EXPECT_EQ(r.session_master(), "sessionmaster:2222");
  EXPECT_EQ(r.master(), "sessionmaster:2222");
}

TEST(TfConfigClusterResolverTest, ConstructorArgumentsOverrideTfConfig) {
  const auto config = with_cluster(
      R"("rpc_layer": "grpc", "environment": "cloud", "task": {"type": "ps", "index": 1})");
  auto r = tf_config_cluster_resolver::from_json(
      config, {.task_type = "worker", .task_id = 2, .rpc_layer = "test", .environment = "google"});
  EXPECT_EQ(r.task(), (task_id{"worker", 2}));
  EXPECT_EQ(r.rpc_layer(), "test");
  EXPECT_EQ(r.environment(), "google");
  EXPECT_EQ(r.master(), "test://worker2:2222");
}

TEST(TfConfigClusterResolverTest, OverridingOnlyTheTaskIdKeepsTheTaskTypeOfTfConfig) {
  // An old TF read the index from TF_CONFIG whenever the *type* was not overridden; each override
  // is independent.
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("task": {"type": "worker", "index": 0})"), {.task_id = 1});
  EXPECT_EQ(r.task(), (task_id{"worker", 1}));
  EXPECT_EQ(r.master(), "worker1:2222");
}

TEST(TfConfigClusterResolverTest, EnvironmentComesFromTfConfig) {
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("environment": "cloud", "task": {"type": "ps", "index": 0})"));
  EXPECT_EQ(r.environment(), "cloud");
}

TEST(TfConfigClusterResolverTest, UnknownTopLevelKeysAreIgnored) {
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("task": {"type": "ps", "index": 0, "trial": "7"}, "job": {"x": [1]},
                      "experimental": null)"));
  EXPECT_EQ(r.task(), (task_id{"ps", 0}));
}

TEST(TfConfigClusterResolverTest, NullRpcLayerCountsAsAbsent) {
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("rpc_layer": null, "task": {"type": "ps", "index": 0})"));
  EXPECT_EQ(r.rpc_layer(), "");
}

TEST(TfConfigClusterResolverTest, TaskIndexMayBeADecimalStringAsTfsIntAccepts) {
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("task": {"type": "worker", "index": "2"})"));
  EXPECT_EQ(r.task_id(), 2);
}

TEST(TfConfigClusterResolverTest, OverridesMaySupplyTheTaskTfConfigLacks) {
  auto r = tf_config_cluster_resolver::from_json(with_cluster(""),
                                                 {.task_type = "worker", .task_id = 1});
  EXPECT_EQ(r.task(), (task_id{"worker", 1}));
}

TEST(TfConfigClusterResolverTest, AnEvaluatorMayBeAbsentFromTheCluster) {
  // TF allows this for Estimator's TF_CONFIG, which lists the evaluator apart. The evaluator is a
  // group of its own: one worker, its chief, rank 0 (TF's worker_count raises a KeyError here;
  // consort counts the evaluator's group of one).
  auto r = tf_config_cluster_resolver::from_json(
      R"({"cluster": {"chief": ["c:1"], "worker": ["w:1"]}, "task": {"type": "evaluator", "index": 0}})");
  EXPECT_EQ(r.task(), (task_id{"evaluator", 0}));
  EXPECT_TRUE(r.is_chief());
  EXPECT_EQ(r.num_workers(), 1);
  EXPECT_EQ(r.worker_rank(), 0);
  validate_multi_worker_cluster(r);
}

TEST(TfConfigClusterResolverTest, AnEvaluatorIsAGroupOfItsOwnAsInTfsMultiWorkerUtil) {
  // Issue 35, item 3: a chief, two workers and an evaluator. TF's worker_count("evaluator") is 1,
  // id_in_cluster 0, is_chief True; consort's num_workers() was 3 and worker_rank() threw.
  const std::string cluster =
      R"("cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "evaluator": ["e:1"]})";
  auto task = [&](const std::string& type, int index) {
    return tf_config_cluster_resolver::from_json("{" + cluster + R"(, "task": {"type": ")" + type +
                                                 R"(", "index": )" + std::to_string(index) + "}}");
  };
  auto evaluator = task("evaluator", 0);
  EXPECT_EQ(evaluator.num_workers(), 1);
  EXPECT_EQ(evaluator.worker_rank(), 0);
  EXPECT_TRUE(evaluator.is_chief());
  // The training workers keep their group of three.
  EXPECT_EQ(task("chief", 0).num_workers(), 3);
  EXPECT_EQ(task("chief", 0).worker_rank(), 0);
  EXPECT_TRUE(task("chief", 0).is_chief());
  EXPECT_EQ(task("worker", 1).num_workers(), 3);
  EXPECT_EQ(task("worker", 1).worker_rank(), 2);
  EXPECT_FALSE(task("worker", 0).is_chief());
  EXPECT_EQ(consort::worker_tasks(evaluator),
            (std::vector<task_id>{{"chief", 0}, {"worker", 0}, {"worker", 1}}));
}

TEST(TfConfigClusterResolverTest, APsTaskHasNoWorkerCountOrRankAsInTf) {
  // TF's worker_count raises "Unexpected `task_type` 'ps'"; consort's num_workers() was 2 here.
  auto r =
      tf_config_cluster_resolver::from_json(with_cluster(R"("task": {"type": "ps", "index": 1})"));
  EXPECT_FALSE(r.is_chief());
  EXPECT_TRUE(fails_with([&] { r.num_workers(); }, errc::unsupported,
                         {"task ps:1 has no worker count", "Unexpected `task_type` 'ps'"}));
  EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::unsupported,
                         {"task ps:1 has no worker rank", "There is no id for task_type 'ps'"}));
}

TEST(TfConfigClusterResolverTest, ATaskTypeOutsideTheClusterHasNoWorkerCount) {
  // TF's worker_count raises "`task_type` 'chief' not found in cluster_spec."; consort's was 3.
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("task": {"type": "chief", "index": 0})"));
  EXPECT_TRUE(fails_with([&] { r.num_workers(); }, errc::invalid_argument,
                         {"`task_type` \"chief\" not found in cluster_spec", "ps, worker"}));
  EXPECT_TRUE(fails_with([&] { r.is_chief(); }, errc::invalid_argument, {"not found"}));
  EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::invalid_argument, {"not found"}));
}

// -- local runs -----------------------------------------------------------------------------------

TEST(TfConfigClusterResolverTest, EmptyOrBlankTfConfigIsALocalRun) {
  for (std::string text : {"", "  \n\t", "{}"}) {
    SCOPED_TRACE(text);
    auto r = tf_config_cluster_resolver::from_json(text);
    EXPECT_TRUE(r.is_local());
    EXPECT_TRUE(r.cluster_spec().empty());
    EXPECT_EQ(r.task_type(), std::nullopt);
    EXPECT_EQ(r.task_id(), std::nullopt);
    EXPECT_EQ(r.rpc_layer(), "");
  }
}

TEST(TfConfigClusterResolverTest, AnEmptyClusterIsLocalAndKeepsItsTask) {
  auto r = tf_config_cluster_resolver::from_json(
      R"({"cluster": {}, "task": {"type": "worker", "index": 3}})");
  EXPECT_TRUE(r.is_local());
  EXPECT_EQ(r.task(), (task_id{"worker", 3}));
}

TEST(TfConfigClusterResolverTest, ALocalRunTakesItsTaskFromTheOverrides) {
  auto r = tf_config_cluster_resolver::from_json(
      "", {.task_type = "chief", .task_id = 0, .rpc_layer = "grpc"});
  EXPECT_TRUE(r.is_local());
  EXPECT_EQ(r.task(), (task_id{"chief", 0}));
  EXPECT_EQ(r.rpc_layer(), "grpc");
  EXPECT_EQ(r.master(), "");
}

TEST(TfConfigClusterResolverTest, ALocalRunIsTheChiefWithRankZeroAndOneWorker) {
  auto r = tf_config_cluster_resolver::from_json("");
  EXPECT_TRUE(r.is_chief());
  EXPECT_EQ(r.worker_rank(), 0);
  EXPECT_EQ(r.num_workers(), 1);
  EXPECT_EQ(r.chief(), r.task());
}

// -- reading the environment ----------------------------------------------------------------------

TEST(TfConfigClusterResolverTest, ReadsTfConfigThroughTheInjectedEnvironment) {
  tf_config_cluster_resolver r(
      {}, fake_env({{"TF_CONFIG", with_cluster(R"("task": {"type": "worker", "index": 1})")}}));
  EXPECT_EQ(r.task(), (task_id{"worker", 1}));
  EXPECT_EQ(r.cluster_spec().num_tasks("worker"), 3);
}

TEST(TfConfigClusterResolverTest, AnUnsetTfConfigIsALocalRun) {
  tf_config_cluster_resolver r({.task_type = "worker"}, fake_env({}));
  EXPECT_TRUE(r.is_local());
  EXPECT_EQ(r.task(), (task_id{"worker", 0}));
}

TEST(TfConfigClusterResolverTest, ReadsTfConfigFromTheProcessEnvironment) {
  scoped_env env("TF_CONFIG", R"({"cluster": {"worker": ["a:1", "b:1"]},
                                  "task": {"type": "worker", "index": 1}})");
  tf_config_cluster_resolver r;
  EXPECT_EQ(r.task(), (task_id{"worker", 1}));
  EXPECT_EQ(r.master(), "b:1");
}

// -- errors ---------------------------------------------------------------------------------------

TEST(TfConfigClusterResolverTest, RejectsMalformedJsonQuotingTheParserPosition) {
  EXPECT_TRUE(fails_with(
      [] { tf_config_cluster_resolver::from_json(R"({"cluster": {"worker": ["a:1"})"); },
      errc::invalid_argument,
      {"TF_CONFIG is not valid JSON", "line 1, column 30", "byte 30", "expected a JSON object"}));
}

TEST(TfConfigClusterResolverTest, MalformedJsonInTheEnvironmentIsAnErrorToo) {
  EXPECT_TRUE(fails_with(
      [] {
        tf_config_cluster_resolver({}, fake_env({{"TF_CONFIG", "{cluster: 1}"}}));
      },
      errc::invalid_argument, {"TF_CONFIG is not valid JSON", "column 2"}));
}

TEST(TfConfigClusterResolverTest, RejectsATfConfigThatIsNotAnObject) {
  EXPECT_TRUE(fails_with([] { tf_config_cluster_resolver::from_json(R"(["worker"])"); },
                         errc::invalid_argument, {"TF_CONFIG must be", "array"}));
}

TEST(TfConfigClusterResolverTest, RejectsAClusterThatIsNotAnObject) {
  EXPECT_TRUE(fails_with([] { tf_config_cluster_resolver::from_json(R"({"cluster": ["a:1"]})"); },
                         errc::invalid_argument,
                         {"TF_CONFIG: \"cluster\" must be an object", "array [\"a:1\"]"}));
  EXPECT_TRUE(fails_with([] { tf_config_cluster_resolver::from_json(R"({"cluster": null})"); },
                         errc::invalid_argument, {"\"cluster\" must be an object", "null"}));
}

TEST(TfConfigClusterResolverTest, RejectsAJobThatIsNeitherAListNorAnObject) {
  EXPECT_TRUE(fails_with(
      [] {
        tf_config_cluster_resolver::from_json(
            R"({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}})");
      },
      errc::invalid_argument, {"TF_CONFIG", "job \"worker\"", "list of addresses or an object"}));
}

TEST(TfConfigClusterResolverTest, RejectsAnAddressThatIsNotAString) {
  EXPECT_TRUE(fails_with(
      [] {
        tf_config_cluster_resolver::from_json(
            R"({"cluster": {"worker": ["a:1", 2222]}, "task": {"type": "worker", "index": 0}})");
      },
      errc::invalid_argument, {"TF_CONFIG", "worker:1", "must be a string", "number 2222"}));
}

// -- what the resolver accepts and the strategy refuses
// -------------------------------------------- Like TF's resolver, ours takes any jobs and any
// task; the multi-worker strategy applies TF's multi_worker_util._validate_cluster_spec when it
// starts (validate_multi_worker_cluster), with TF's messages.

namespace {

/// The strategy's check of a TF_CONFIG that the resolver itself accepts.
::testing::AssertionResult strategy_refuses(const std::string& tf_config,
                                            const std::vector<std::string>& fragments,
                                            tf_config_overrides overrides = {}) {
  std::optional<tf_config_cluster_resolver> r;
  try {
    r.emplace(tf_config_cluster_resolver::from_json(tf_config, std::move(overrides)));
  } catch (const consort::error& e) {
    return ::testing::AssertionFailure() << "the resolver refused it: " << e.what();
  }
  auto all = fragments;
  all.insert(all.begin(), "MultiWorkerMirroredStrategy: ");
  return fails_with([&] { validate_multi_worker_cluster(*r); }, errc::invalid_argument, all);
}

} // namespace

TEST(TfConfigClusterResolverTest, TheStrategyRefusesTwoChiefsOrTwoEvaluators) {
  EXPECT_TRUE(strategy_refuses(R"({"cluster": {"chief": ["c0:1", "c1:1"], "worker": ["w:1"]},
                                   "task": {"type": "worker", "index": 0}})",
                               {"There must be at most one 'chief' job", "has 2 tasks"}));
  EXPECT_TRUE(strategy_refuses(R"({"cluster": {"worker": ["w:1"], "evaluator": ["e0:1", "e1:1"]},
                                   "task": {"type": "worker", "index": 0}})",
                               {"There must be at most one 'evaluator' job", "has 2 tasks"}));
}

TEST(TfConfigClusterResolverTest, TheStrategyRefusesATaskIndexThatNamesNoTaskOfItsJob) {
  EXPECT_TRUE(strategy_refuses(
      with_cluster(R"("task": {"type": "worker", "index": 3})"),
      {"The `task_id` 3 exceeds the maximum id of worker", "3 task(s)", "0, 1, 2"}));
  EXPECT_TRUE(strategy_refuses(
      R"({"cluster": {"worker": {"0": "a:1", "2": "c:1"}}, "task": {"type": "worker", "index": 1}})",
      {"The `task_id` 1 exceeds", "0, 2"}));
  EXPECT_TRUE(strategy_refuses(with_cluster(R"("task": {"type": "ps", "index": 0})"),
                               {"The `task_id` 2 exceeds the maximum id of ps"}, {.task_id = 2}));
  EXPECT_TRUE(strategy_refuses(with_cluster(R"("task": {"type": "worker", "index": -1})"),
                               {"task index -1", "negative"}));
}

TEST(TfConfigClusterResolverTest, AClusterWithoutATaskIsReadAndTheStrategyAsksForTheTask) {
  // TF: task_type and task_id are None (master() then raises: see the next tests).
  auto r = tf_config_cluster_resolver::from_json(with_cluster(""));
  EXPECT_EQ(r.task_type(), std::nullopt);
  EXPECT_EQ(r.task_id(), std::nullopt);
  EXPECT_TRUE(strategy_refuses(with_cluster(""),
                               {"When `cluster_spec` is given, you must also specify `task_type` "
                                "and `task_id`",
                                "no task type is given", "ps, worker", "\"task\""}));
  EXPECT_TRUE(strategy_refuses(with_cluster(R"("task": {"index": 0})"), {"no task type"}));
  EXPECT_TRUE(strategy_refuses(with_cluster(R"("task": {"type": "worker"})"),
                               {"task \"worker\" has no index"}));
  EXPECT_EQ(tf_config_cluster_resolver::from_json(with_cluster(R"("task": {"type": "worker"})"))
                .task_id(),
            std::nullopt);
}

TEST(TfConfigClusterResolverTest, MasterWithoutATaskFailsOnAClusterOfSeveralTasks) {
  // Issue 35, item 4. TF's master() calls cluster_spec.task_address(None, None), which raises
  // "No such job in cluster: None"; consort's returned "".
  auto r = tf_config_cluster_resolver::from_json(with_cluster(R"("rpc_layer": "grpc")"));
  EXPECT_TRUE(
      fails_with([&] { r.master(); }, errc::invalid_argument,
                 {"TF_CONFIG: master() needs this process's task", "5 tasks", "jobs ps, worker",
                  "no task type is given", "No such job in cluster: None", "\"task\": {\"type\""}));
  // A type without an index: TF's task_address("worker", None) raises too.
  auto no_index =
      tf_config_cluster_resolver::from_json(with_cluster(R"("task": {"type": "worker"})"));
  EXPECT_TRUE(
      fails_with([&] { no_index.master(); }, errc::invalid_argument,
                 {"task type \"worker\" has no index", "No task with index None in job 'worker'"}));
  // An index without a type.
  auto no_type = tf_config_cluster_resolver::from_json(with_cluster(R"("task": {"index": 1})"));
  EXPECT_TRUE(
      fails_with([&] { no_type.master(); }, errc::invalid_argument, {"no task type is given"}));
}

TEST(TfConfigClusterResolverTest, MasterArgumentsOrOverridesSupplyTheMissingTask) {
  auto r = tf_config_cluster_resolver::from_json(with_cluster(R"("rpc_layer": "grpc")"));
  EXPECT_EQ(r.master("worker", 1), "grpc://worker1:2222");
  EXPECT_EQ(r.master("ps", 0, "test"), "test://ps0:2222");
  // Half a task is still no task, as in TF (master("worker") asks task_address("worker", None)).
  EXPECT_TRUE(fails_with([&] { r.master("worker"); }, errc::invalid_argument,
                         {"task type \"worker\" has no index"}));
  EXPECT_TRUE(
      fails_with([&] { r.master("", 1); }, errc::invalid_argument, {"no task type is given"}));
  auto overridden = tf_config_cluster_resolver::from_json(with_cluster(""),
                                                          {.task_type = "worker", .task_id = 2});
  EXPECT_EQ(overridden.master(), "worker2:2222");
  auto set = tf_config_cluster_resolver::from_json(with_cluster(""));
  set.set_task_type("ps");
  set.set_task_id(1);
  EXPECT_EQ(set.master(), "ps1:2222");
}

TEST(TfConfigClusterResolverTest, MasterWithoutATaskIsEmptyOnlyForOneTaskOrNone) {
  // TF returns "" before it looks at the task when the cluster has no job, or one job whose task
  // list (job_tasks) has one entry.
  EXPECT_EQ(tf_config_cluster_resolver::from_json(R"({"cluster": {"worker": ["w:1"]}})").master(),
            "");
  EXPECT_EQ(
      tf_config_cluster_resolver::from_json(R"({"cluster": {}, "rpc_layer": "grpc"})").master(),
      "");
  // One job of one task at index 1: job_tasks is [None, "w1:1"], two entries, so TF asks for the
  // task.
  EXPECT_TRUE(fails_with(
      [] {
        tf_config_cluster_resolver::from_json(R"({"cluster": {"worker": {"1": "w1:1"}}})").master();
      },
      errc::invalid_argument, {"1 task in jobs worker", "no task type is given"}));
  // Two jobs of one task each.
  EXPECT_TRUE(fails_with(
      [] {
        tf_config_cluster_resolver::from_json(
            R"({"cluster": {"chief": ["c:1"], "worker": ["w:1"]}})")
            .master();
      },
      errc::invalid_argument, {"2 tasks in jobs chief, worker"}));
}

TEST(TfConfigClusterResolverTest, SessionMasterAnswersWithoutATaskEvenWhenEmpty) {
  // TF returns "session_master" whenever the key is there (`is not None`), before the task.
  EXPECT_EQ(
      tf_config_cluster_resolver::from_json(with_cluster(R"("session_master": "sm:1")")).master(),
      "sm:1");
  auto empty = tf_config_cluster_resolver::from_json(with_cluster(R"("session_master": "")"));
  EXPECT_EQ(empty.master(), "");
  EXPECT_EQ(empty.session_master(), "");
  EXPECT_NO_THROW(empty.num_accelerators());
  // null counts as absent, as TF's `is not None` reads it.
  EXPECT_TRUE(fails_with(
      [] {
        tf_config_cluster_resolver::from_json(with_cluster(R"("session_master": null)")).master();
      },
      errc::invalid_argument, {"no task type is given"}));
}

TEST(TfConfigClusterResolverTest, OtherAccessorsWithoutATaskFollowTf) {
  // TF's answers in the same corner (a cluster of several tasks, no "task"): task_type and task_id
  // None, cluster_spec, rpc_layer and environment as TF_CONFIG has them; num_accelerators() raises
  // as master() does (ClusterResolver.num_accelerators asks master() first);
  // multi_worker_util.is_chief False, id_in_cluster and worker_count raise.
  auto r = tf_config_cluster_resolver::from_json(
      with_cluster(R"("rpc_layer": "grpc", "environment": "cloud")"));
  EXPECT_EQ(r.task_type(), std::nullopt);
  EXPECT_EQ(r.task_id(), std::nullopt);
  EXPECT_EQ(r.cluster_spec().num_tasks("worker"), 3);
  EXPECT_EQ(r.cluster_spec().num_tasks("ps"), 2);
  EXPECT_EQ(r.rpc_layer(), "grpc");
  EXPECT_EQ(r.environment(), "cloud");
  EXPECT_FALSE(r.is_local());
  EXPECT_TRUE(fails_with(
      [&] { r.num_accelerators(); }, errc::invalid_argument,
      {"TF_CONFIG: num_accelerators() needs this process's task", "No such job in cluster: None"}));
  EXPECT_FALSE(r.is_chief());
  EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::invalid_argument,
                         {"no task type", "There is no id for task_type None"}));
  EXPECT_TRUE(fails_with([&] { r.num_workers(); }, errc::invalid_argument,
                         {"no task type", "Unexpected `task_type` None"}));
  // With one task in the cluster TF's master() is "" before the task, so the count goes on.
  EXPECT_NO_THROW(tf_config_cluster_resolver::from_json(R"({"cluster": {"worker": ["w:1"]}})")
                      .num_accelerators());
}

TEST(TfConfigClusterResolverTest, TheStrategyRefusesATaskTypeOrJobItDoesNotSupport) {
  EXPECT_TRUE(strategy_refuses(with_cluster(R"("task": {"type": "chief", "index": 0})"),
                               {"`task_type` \"chief\" not found in cluster_spec", "ps, worker"}));
  EXPECT_TRUE(
      strategy_refuses(with_cluster(R"("task": {"type": "master", "index": 0})"),
                       {"Unrecognized task_type: \"master\"", "chief, worker, ps or evaluator"}));
  // Any job name is a job to the resolver (TF's resolver accepts it too).
  const std::string other_job = R"({"cluster": {"worker": ["w:1"], "localhost": ["l:1"]},
                                    "task": {"type": "localhost", "index": 0}})";
  auto r = tf_config_cluster_resolver::from_json(other_job);
  EXPECT_EQ(r.task_type(), "localhost");
  EXPECT_EQ(r.master(), "l:1");
  EXPECT_TRUE(strategy_refuses(other_job, {"Disallowed task type found in cluster spec",
                                           "job \"localhost\"", "chief, worker, ps or evaluator"}));
}

TEST(TfConfigClusterResolverTest, ATaskTypeIsReadAsPythonsStrReadsIt) {
  auto with_type = [](const std::string& type) {
    return tf_config_cluster_resolver::from_json(
               R"({"cluster": {")" + std::string(type == "123456" ? "123456" : "worker") +
               R"(": ["a:1"]}, "task": {"type": )" + type + R"(, "index": 0}})")
        .task_type();
  };
  EXPECT_EQ(with_type("123456"), "123456");
  EXPECT_EQ(with_type("true"), "True");
  EXPECT_EQ(with_type("null"), "None");
  EXPECT_EQ(with_type("\"worker\""), "worker");
  // The job "123456" is a job like any other to the resolver.
  auto r = tf_config_cluster_resolver::from_json(
      R"({"cluster": {"123456": ["a:1", "b:1"]}, "task": {"type": 123456, "index": 1}})");
  EXPECT_EQ(r.task(), (task_id{"123456", 1}));
  EXPECT_EQ(r.master(), "b:1");
}

TEST(TfConfigClusterResolverTest, TheSettersReplaceTheTaskAndTheRpcLayer) {
  auto r = tf_config_cluster_resolver::from_json(with_cluster(""));
  r.set_task_type("worker");
  r.set_task_id(2);
  r.set_rpc_layer("grpc");
  EXPECT_EQ(r.task(), (task_id{"worker", 2}));
  EXPECT_EQ(r.master(), "grpc://worker2:2222");
  validate_multi_worker_cluster(r); // now a valid worker of the cluster
  r.set_task_id(std::nullopt);
  EXPECT_EQ(r.task_id(), std::nullopt);
  // TF's task_address("worker", None) raises "No task with index None in job 'worker'".
  EXPECT_TRUE(fails_with([&] { r.master(); }, errc::invalid_argument,
                         {"task type \"worker\" has no index"}));
}

TEST(TfConfigClusterResolverTest, NumAcceleratorsCountsTheVisibleGpus) {
  auto r = tf_config_cluster_resolver::from_json("");
  const auto gpus = r.num_accelerators();
  // On a machine without a GPU (or a build without CUDA) TF reports no accelerator kinds.
  if (gpus.empty())
    EXPECT_EQ(gpus.count("GPU"), 0u);
  else
    EXPECT_GT(gpus.at("GPU"), 0);
}

TEST(TfConfigClusterResolverTest, RejectsATaskIndexThatIsNotAnInteger) {
  for (std::string index : {"1.5", "true", "\"one\"", "[0]", "4294967296", "\"\""}) {
    SCOPED_TRACE(index);
    EXPECT_TRUE(fails_with(
        [&] {
          tf_config_cluster_resolver::from_json(
              with_cluster(R"("task": {"type": "worker", "index": )" + index + "}"));
        },
        errc::invalid_argument, {"\"task\".\"index\" must be an integer task index"}));
  }
}

TEST(TfConfigClusterResolverTest, RejectsAnRpcLayerThatIsNotAString) {
  EXPECT_TRUE(fails_with(
      [] {
        tf_config_cluster_resolver::from_json(
            with_cluster(R"("rpc_layer": 1, "task": {"type": "worker", "index": 0})"));
      },
      errc::invalid_argument, {"\"rpc_layer\" must be a string", "number 1"}));
}
