#include "fake_env.hpp"

#include <consort/cluster.hpp>

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

using consort::cluster_resolver;
using consort::cluster_spec;
using consort::errc;
using consort::simple_cluster_resolver;
using consort::task_id;
using consort::test::fails_with;

namespace {

const cluster_spec chief_and_workers = cluster_spec::dense({{"chief", {"c:1"}},
                                                            {"worker", {"w0:1", "w1:1", "w2:1"}},
                                                            {"ps", {"p0:1", "p1:1"}},
                                                            {"evaluator", {"e:1"}}});
const cluster_spec workers_only = cluster_spec::dense({{"worker", {"w0:1", "w1:1", "w2:1"}}});

} // namespace

// -- ranks, chief, worker count (docs/semantics.md)
// ----------------------------------------------------

TEST(ClusterResolverTest, WorkerRankPutsTheChiefFirstThenWorkersInIndexOrder) {
  EXPECT_EQ(simple_cluster_resolver(chief_and_workers, "chief", 0).worker_rank(), 0);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(simple_cluster_resolver(chief_and_workers, "worker", i).worker_rank(), i + 1);
  }
}

TEST(ClusterResolverTest, WithoutAChiefJobWorkerRankIsTheWorkerIndex) {
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(simple_cluster_resolver(workers_only, "worker", i).worker_rank(), i);
  }
}

TEST(ClusterResolverTest, NumWorkersCountsChiefAndWorkerTasksForAChiefOrAWorker) {
  // TF's worker_count: the chief tasks and the worker tasks; ps and evaluator tasks do not count.
  EXPECT_EQ(simple_cluster_resolver(chief_and_workers, "chief", 0).num_workers(), 4);
  EXPECT_EQ(simple_cluster_resolver(chief_and_workers, "worker", 1).num_workers(), 4);
  EXPECT_EQ(simple_cluster_resolver(workers_only, "worker", 0).num_workers(), 3);
}

TEST(ClusterResolverTest, ChiefIsChiefZeroWhenTheClusterHasAChiefJob) {
  simple_cluster_resolver r(chief_and_workers, "worker", 1);
  EXPECT_EQ(r.chief(), (task_id{"chief", 0}));
  EXPECT_TRUE(simple_cluster_resolver(chief_and_workers, "chief", 0).is_chief());
  EXPECT_FALSE(simple_cluster_resolver(chief_and_workers, "worker", 0).is_chief());
}

TEST(ClusterResolverTest, ChiefIsWorkerZeroWithoutAChiefJob) {
  EXPECT_EQ(simple_cluster_resolver(workers_only, "worker", 2).chief(), (task_id{"worker", 0}));
  EXPECT_TRUE(simple_cluster_resolver(workers_only, "worker", 0).is_chief());
  EXPECT_FALSE(simple_cluster_resolver(workers_only, "worker", 1).is_chief());
}

TEST(ClusterResolverTest, ChiefFailsWhenTheClusterHasNeitherChiefNorWorkers) {
  simple_cluster_resolver r(cluster_spec::dense({{"ps", {"p:1"}}}), "ps", 0);
  EXPECT_TRUE(fails_with([&] { r.chief(); }, errc::invalid_argument,
                         {"neither a chief nor a worker job", "jobs: ps"}));
}

TEST(ClusterResolverTest, APsTaskIsNotChiefAndHasNeitherRankNorWorkerCount) {
  // TF: is_chief is False, id_in_cluster raises "There is no id for task_type 'ps'" and
  // worker_count raises "Unexpected `task_type` 'ps'". Both refusals are errc::unsupported, as the
  // strategy's refusal of a ps task is.
  simple_cluster_resolver r(chief_and_workers, "ps", 1);
  EXPECT_FALSE(r.is_chief());
  EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::unsupported,
                         {"worker_rank(): task ps:1 has no worker rank",
                          "There is no id for task_type 'ps'", "chief, worker or evaluator"}));
  EXPECT_TRUE(fails_with([&] { r.num_workers(); }, errc::unsupported,
                         {"num_workers(): task ps:1 has no worker count",
                          "Unexpected `task_type` 'ps'", "chief, worker or evaluator"}));
  // A cluster of ps tasks only: still no count (it was 0 before).
  simple_cluster_resolver ps_only(cluster_spec::dense({{"ps", {"p:1"}}}), "ps", 0);
  EXPECT_TRUE(fails_with([&] { ps_only.num_workers(); }, errc::unsupported, {"ps:0"}));
}

TEST(ClusterResolverTest, AnEvaluatorIsAGroupOfItsOwnWhoseOnlyWorkerIsItsChief) {
  // TF: worker_count is the number of evaluator tasks (1), id_in_cluster is 0, is_chief True.
  // Before, consort counted the training workers (4) and refused the rank.
  simple_cluster_resolver r(chief_and_workers, "evaluator", 0);
  EXPECT_TRUE(r.is_chief());
  EXPECT_EQ(r.worker_rank(), 0);
  EXPECT_EQ(r.num_workers(), 1);
  // The issue's cluster: a chief, two workers and an evaluator.
  auto four = cluster_spec::dense(
      {{"chief", {"c:1"}}, {"worker", {"w0:1", "w1:1"}}, {"evaluator", {"e:1"}}});
  simple_cluster_resolver evaluator(four, "evaluator", 0);
  EXPECT_EQ(evaluator.num_workers(), 1);
  EXPECT_EQ(evaluator.worker_rank(), 0);
  EXPECT_TRUE(evaluator.is_chief());
  EXPECT_EQ(simple_cluster_resolver(four, "worker", 1).num_workers(), 3);
  EXPECT_EQ(simple_cluster_resolver(four, "worker", 1).worker_rank(), 2);
}

TEST(ClusterResolverTest, AnEvaluatorAbsentFromTheClusterIsAGroupOfOneWithIndexZero) {
  // TF's _validate_cluster_spec allows it (Estimator's TF_CONFIG); TF's worker_count then raises a
  // KeyError, where consort counts the evaluator's own group of one.
  simple_cluster_resolver r(workers_only, "evaluator", 0);
  EXPECT_TRUE(r.is_chief());
  EXPECT_EQ(r.worker_rank(), 0);
  EXPECT_EQ(r.num_workers(), 1);
  simple_cluster_resolver second(workers_only, "evaluator", 2);
  EXPECT_EQ(second.num_workers(), 1);
  EXPECT_TRUE(fails_with([&] { second.worker_rank(); }, errc::invalid_argument,
                         {"The `task_id` 2 exceeds the maximum id of evaluator", "index 0"}));
}

TEST(ClusterResolverTest, ATaskTypeThatIsNotAJobOfTheClusterFailsEveryAccessor) {
  // TF: "`task_type` 'chief' not found in cluster_spec." from is_chief, id_in_cluster and
  // worker_count alike. Before, consort answered true / 0 / 3 for chief:0 here.
  for (const char* type : {"chief", "ps"}) {
    SCOPED_TRACE(type);
    simple_cluster_resolver r(workers_only, type, 0);
    const std::string not_found =
        "`task_type` \"" + std::string(type) + "\" not found in cluster_spec";
    EXPECT_TRUE(fails_with([&] { r.is_chief(); }, errc::invalid_argument,
                           {"is_chief(): " + not_found, "its jobs are worker"}));
    EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::invalid_argument,
                           {"worker_rank(): " + not_found}));
    EXPECT_TRUE(fails_with([&] { r.num_workers(); }, errc::invalid_argument,
                           {"num_workers(): " + not_found}));
  }
}

TEST(ClusterResolverTest, AnUnknownTaskTypeOrJobFailsEveryAccessor) {
  simple_cluster_resolver master(workers_only, "master", 0);
  for (auto call : {+[](const cluster_resolver& r) { r.is_chief(); },
                    +[](const cluster_resolver& r) { r.worker_rank(); },
                    +[](const cluster_resolver& r) {
                      r.num_workers();
                    }}) {
    EXPECT_TRUE(
        fails_with([&] { call(master); }, errc::invalid_argument,
                   {"Unrecognized task_type: \"master\"", "chief, worker, ps or evaluator"}));
    simple_cluster_resolver other_job(
        cluster_spec::dense({{"worker", {"w:1"}}, {"localhost", {"l:1"}}}), "worker", 0);
    EXPECT_TRUE(fails_with([&] { call(other_job); }, errc::invalid_argument,
                           {"Disallowed task type found in cluster spec", "job \"localhost\""}));
    simple_cluster_resolver two_chiefs(
        cluster_spec::dense({{"chief", {"a:1", "b:1"}}, {"worker", {"w:1"}}}), "worker", 0);
    EXPECT_TRUE(fails_with([&] { call(two_chiefs); }, errc::invalid_argument,
                           {"There must be at most one 'chief' job"}));
  }
}

TEST(ClusterResolverTest, AnIndexOutsideItsJobFailsTheChiefAndTheRankButNotTheCount) {
  // TF's is_chief and id_in_cluster check the index; worker_count validates with task_id=0.
  simple_cluster_resolver r(workers_only, "worker", 3);
  EXPECT_TRUE(fails_with([&] { r.is_chief(); }, errc::invalid_argument,
                         {"The `task_id` 3 exceeds the maximum id of worker"}));
  EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::invalid_argument,
                         {"The `task_id` 3 exceeds the maximum id of worker"}));
  EXPECT_EQ(r.num_workers(), 3);
  EXPECT_TRUE(fails_with([&] { simple_cluster_resolver(workers_only, "worker", -1).worker_rank(); },
                         errc::invalid_argument, {"task index -1", "negative"}));
}

TEST(ClusterResolverTest, WithoutATaskTypeTheTaskIsNotChiefAndHasNeitherRankNorCount) {
  // TF: is_chief(spec, None, None) is False; id_in_cluster raises "There is no id for task_type
  // None" and worker_count "Unexpected `task_type` None". Before, consort counted 3 workers.
  simple_cluster_resolver r(workers_only, std::nullopt, std::nullopt);
  EXPECT_FALSE(r.is_chief());
  EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::invalid_argument,
                         {"worker_rank(): this process has no task type",
                          "There is no id for task_type None", "jobs worker", "\"task\""}));
  EXPECT_TRUE(
      fails_with([&] { r.num_workers(); }, errc::invalid_argument,
                 {"num_workers(): this process has no task type", "Unexpected `task_type` None"}));
}

TEST(ClusterResolverTest, ATaskTypeWithoutAnIndexHasACountButNeitherRankNorChief) {
  // TF's worker_count needs only the type; is_chief and id_in_cluster need the index too.
  simple_cluster_resolver r(chief_and_workers, "worker", std::nullopt);
  EXPECT_EQ(r.num_workers(), 4);
  EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::invalid_argument,
                         {"worker_rank(): task type \"worker\" has no index"}));
  EXPECT_TRUE(fails_with([&] { r.is_chief(); }, errc::invalid_argument,
                         {"is_chief(): task type \"worker\" has no index"}));
}

TEST(ClusterResolverTest, AnEmptyClusterIsOneLocalWorkerWhateverTheTask) {
  // TF's strategy runs locally then (is_chief True, one worker), where multi_worker_util would
  // raise for the missing task type.
  for (const char* type : {"chief", "worker", "ps", "evaluator"}) {
    SCOPED_TRACE(type);
    simple_cluster_resolver r(cluster_spec(), type, 3);
    EXPECT_TRUE(r.is_chief());
    EXPECT_EQ(r.worker_rank(), 0);
    EXPECT_EQ(r.num_workers(), 1);
  }
}

TEST(ClusterResolverTest, LocalIsAnEmptyClusterWhoseOnlyWorkerIsTheChief) {
  auto r = cluster_resolver::local();
  EXPECT_TRUE(r->is_local());
  EXPECT_TRUE(r->cluster_spec().empty());
  EXPECT_EQ(r->task_type(), std::nullopt);
  EXPECT_EQ(r->task_id(), std::nullopt);
  EXPECT_EQ(r->master(), "");
  EXPECT_TRUE(r->is_chief());
  EXPECT_EQ(r->worker_rank(), 0);
  EXPECT_EQ(r->num_workers(), 1);
  EXPECT_EQ(r->chief(), (task_id{"", 0}));
  EXPECT_TRUE(r->num_accelerators().empty());
}

TEST(ClusterResolverTest, ANonEmptyClusterIsNotLocal) {
  EXPECT_FALSE(simple_cluster_resolver(workers_only, "worker", 0).is_local());
}

// -- simple_cluster_resolver ----------------------------------------------------------------------

TEST(SimpleClusterResolverTest, ReturnsWhatItWasGiven) {
  simple_cluster_resolver r(workers_only, "worker", 1, "grpc", {{"GPU", 2}});
  EXPECT_EQ(r.cluster_spec(), workers_only);
  EXPECT_EQ(r.task(), (task_id{"worker", 1}));
  EXPECT_EQ(r.rpc_layer(), "grpc");
  EXPECT_EQ(r.environment(), "");
  EXPECT_EQ(r.num_accelerators(), (std::map<std::string, int>{{"GPU", 2}}));
}

TEST(SimpleClusterResolverTest, MasterIsThisTasksAddressWithTheRpcLayer) {
  simple_cluster_resolver r(workers_only, "worker", 1, "grpc");
  EXPECT_EQ(r.master(), "grpc://w1:1");
  EXPECT_EQ(r.master("worker", 2), "grpc://w2:1");
  EXPECT_EQ(r.master("worker", 0, "rdma"), "rdma://w0:1");
  EXPECT_EQ(simple_cluster_resolver(workers_only, "worker", 1).master(), "w1:1");
}

TEST(SimpleClusterResolverTest, MasterOfAnUnknownTaskFails) {
  simple_cluster_resolver r(workers_only, "worker", 1);
  EXPECT_TRUE(fails_with([&] { r.master("ps", 0); }, errc::invalid_argument, {"\"ps\""}));
  EXPECT_TRUE(fails_with([&] { r.master("worker", 9); }, errc::out_of_range, {"index 9"}));
}

TEST(SimpleClusterResolverTest, AcceptsAnyTaskAsTfDoesAndTheStrategyCheckRefusesBadOnes) {
  using consort::validate_multi_worker_cluster;
  auto two_chiefs = cluster_spec::dense({{"chief", {"a:1", "b:1"}}, {"worker", {"w:1"}}});
  // Constructing never fails; the strategy's check (validate_multi_worker_cluster) does.
  auto refused = [](const simple_cluster_resolver& r, const std::vector<std::string>& fragments) {
    return fails_with([&] { validate_multi_worker_cluster(r, "simple"); }, errc::invalid_argument,
                      fragments);
  };
  EXPECT_TRUE(refused(simple_cluster_resolver(two_chiefs, "worker", 0),
                      {"simple: There must be at most one 'chief' job"}));
  EXPECT_TRUE(refused(simple_cluster_resolver(workers_only, "worker", 3),
                      {"The `task_id` 3 exceeds the maximum id of worker"}));
  EXPECT_TRUE(refused(simple_cluster_resolver(workers_only, "ps", 0),
                      {"`task_type` \"ps\" not found in cluster_spec"}));
  EXPECT_TRUE(refused(simple_cluster_resolver(workers_only, std::nullopt, std::nullopt),
                      {"no task type is given"}));
  EXPECT_TRUE(
      refused(simple_cluster_resolver(workers_only, "worker", -1), {"task index -1", "negative"}));
  // A valid worker passes, and so does any local resolver.
  validate_multi_worker_cluster(simple_cluster_resolver(workers_only, "worker", 1));
  validate_multi_worker_cluster(*cluster_resolver::local());
}

TEST(SimpleClusterResolverTest, SettersReplaceTheTask) {
  simple_cluster_resolver r(workers_only, std::nullopt, std::nullopt);
  EXPECT_EQ(r.master(), "");
  r.set_task_type("worker");
  r.set_task_id(1);
  r.set_rpc_layer("grpc");
  EXPECT_EQ(r.task(), (task_id{"worker", 1}));
  EXPECT_EQ(r.master(), "grpc://" + workers_only.task_address("worker", 1));
}

TEST(SimpleClusterResolverTest, AnEmptyClusterNeedsNoTask) {
  EXPECT_TRUE(simple_cluster_resolver(cluster_spec(), std::nullopt, std::nullopt).is_local());
}

TEST(SimpleClusterResolverTest, RejectsANegativeAcceleratorCount) {
  EXPECT_TRUE(fails_with(
      [] {
        simple_cluster_resolver(workers_only, "worker", 0, "", {{"GPU", -1}});
      },
      errc::invalid_argument, {"-1 accelerators", "\"GPU\""}));
}

// -- resolve_cluster / worker_tasks ---------------------------------------------------------------

TEST(ResolveClusterTest, TfConfigComesFirstThenSlurmThenOpenMpiElseLocal) {
  using consort::resolve_cluster;
  using consort::test::fake_env;
  const std::string tf =
      R"({"cluster":{"worker":["a:1","b:1"]},"task":{"type":"worker","index":1}})";
  std::map<std::string, std::string> slurm{{"SLURM_PROCID", "1"},
                                           {"SLURM_NTASKS", "3"},
                                           {"SLURM_STEP_NODELIST", "n[1-3]"},
                                           {"SLURM_STEP_TASKS_PER_NODE", "1(x3)"}};
  std::map<std::string, std::string> mpi{{"OMPI_COMM_WORLD_RANK", "0"},
                                         {"OMPI_COMM_WORLD_SIZE", "4"},
                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}};
  auto everything = slurm;
  everything.insert(mpi.begin(), mpi.end());
  everything["TF_CONFIG"] = tf;

  auto r = resolve_cluster(fake_env(everything));
  EXPECT_NE(dynamic_cast<const consort::tf_config_cluster_resolver*>(r.get()), nullptr);
  EXPECT_EQ(r->num_workers(), 2);
  EXPECT_EQ(r->worker_rank(), 1);

  everything["TF_CONFIG"] = ""; // an empty TF_CONFIG does not count
  r = resolve_cluster(fake_env(everything));
  EXPECT_NE(dynamic_cast<const consort::slurm_cluster_resolver*>(r.get()), nullptr);
  EXPECT_EQ(r->num_workers(), 3);

  r = resolve_cluster(fake_env(mpi));
  EXPECT_NE(dynamic_cast<const consort::mpi_cluster_resolver*>(r.get()), nullptr);
  EXPECT_EQ(r->num_workers(), 4);

  r = resolve_cluster(fake_env({}));
  EXPECT_TRUE(r->is_local());
  EXPECT_EQ(r->num_workers(), 1);
}

TEST(ResolveClusterTest, AMalformedEnvironmentIsAnErrorOfTheChosenResolver) {
  using consort::resolve_cluster;
  using consort::test::fake_env;
  EXPECT_TRUE(fails_with(
      [] {
        resolve_cluster(fake_env({{"TF_CONFIG", "{not json"}}));
      },
      errc::invalid_argument, {"TF_CONFIG"}));
  EXPECT_TRUE(fails_with(
      [] {
        resolve_cluster(fake_env({{"SLURM_PROCID", "x"}}));
      },
      errc::invalid_argument, {"SLURM_PROCID"}));
}

TEST(ResolveClusterTest, WorkerTasksAreInRankOrderChiefFirst) {
  simple_cluster_resolver with_chief(chief_and_workers, "worker", 2);
  EXPECT_EQ(consort::worker_tasks(with_chief),
            (std::vector<task_id>{{"chief", 0}, {"worker", 0}, {"worker", 1}, {"worker", 2}}));
  simple_cluster_resolver plain(workers_only, "worker", 0);
  EXPECT_EQ(consort::worker_tasks(plain),
            (std::vector<task_id>{{"worker", 0}, {"worker", 1}, {"worker", 2}}));
  // An evaluator's or a ps task's view lists the training workers too.
  for (const char* type : {"evaluator", "ps"}) {
    SCOPED_TRACE(type);
    EXPECT_EQ(consort::worker_tasks(simple_cluster_resolver(chief_and_workers, type, 0)),
              (std::vector<task_id>{{"chief", 0}, {"worker", 0}, {"worker", 1}, {"worker", 2}}));
  }
  // Open MPI before the address exchange knows only the chief and itself: ranks 0..n-1.
  consort::mpi_cluster_resolver mpi({.host = "h", .default_chief_address = "h0:1"},
                                    consort::test::fake_env({{"OMPI_COMM_WORLD_RANK", "2"},
                                                             {"OMPI_COMM_WORLD_SIZE", "3"},
                                                             {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}));
  EXPECT_EQ(consort::worker_tasks(mpi),
            (std::vector<task_id>{{"worker", 0}, {"worker", 1}, {"worker", 2}}));
}
