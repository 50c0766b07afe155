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

namespace {

using env_map = std::map<std::string, std::string>;

// The variables of each launcher, for rank 1 of a job.
const env_map slurm_step{{"SLURM_PROCID", "1"},
                         {"SLURM_NTASKS", "3"},
                         {"SLURM_STEP_NODELIST", "n[1-3]"},
                         {"SLURM_STEP_TASKS_PER_NODE", "1(x3)"}};
const env_map torchrun_env{
    {"RANK", "1"}, {"WORLD_SIZE", "5"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "29500"}};
const env_map open_mpi{{"OMPI_COMM_WORLD_RANK", "1"},
                       {"OMPI_COMM_WORLD_SIZE", "4"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}};
const env_map hydra{{"PMI_RANK", "1"}, {"PMI_SIZE", "6"}};
const env_map pmix{{"PMIX_RANK", "1"}, {"PMIX_NAMESPACE", "ns"}, {"OMPI_COMM_WORLD_SIZE", "7"}};

env_map merged(std::initializer_list<env_map> parts) {
  env_map out;
  for (const auto& part : parts)
    out.insert(part.begin(), part.end());
  return out;
}

template <class R>
bool is_a(const std::shared_ptr<consort::cluster_resolver>& r) {
  return dynamic_cast<const R*>(r.get()) != nullptr;
}

} // namespace

TEST(ResolveClusterTest, TfConfigThenTorchrunThenOpenMpiThenPmiThenPmixThenSlurmElseLocal) {
  using consort::resolve_cluster;
  using consort::test::fake_env;
  const std::string tf =
      R"({"cluster":{"worker":["a:1","b:1"]},"task":{"type":"worker","index":1}})";
  auto env = merged({slurm_step, torchrun_env, hydra, pmix, {{"CONSORT_CHIEF_ADDRESS", "h:1"}}});
  // Open MPI's size and pmix's OMPI_COMM_WORLD_SIZE are one variable: Open MPI's wins the merge.
  env.insert(open_mpi.begin(), open_mpi.end());
  env["OMPI_COMM_WORLD_SIZE"] = "4";
  env["TF_CONFIG"] = tf;

  auto r = resolve_cluster(fake_env(env));
  EXPECT_TRUE(is_a<consort::tf_config_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 2);
  EXPECT_EQ(r->worker_rank(), 1);

  env["TF_CONFIG"] = ""; // an empty TF_CONFIG does not count
  r = resolve_cluster(fake_env(env));
  EXPECT_TRUE(is_a<consort::torchrun_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 5);

  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    env.erase(name);
  r = resolve_cluster(fake_env(env));
  EXPECT_TRUE(is_a<consort::mpi_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 4);

  env.erase("OMPI_COMM_WORLD_RANK");
  r = resolve_cluster(fake_env(env));
  EXPECT_TRUE(is_a<consort::pmi_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 6);

  env.erase("PMI_RANK");
  r = resolve_cluster(fake_env(env));
  EXPECT_TRUE(is_a<consort::pmix_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 6); // PMI_SIZE comes before OMPI_COMM_WORLD_SIZE

  env.erase("PMIX_RANK");
  r = resolve_cluster(fake_env(env));
  EXPECT_TRUE(is_a<consort::slurm_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 3);

  r = resolve_cluster(fake_env({}));
  EXPECT_TRUE(r->is_local());
  EXPECT_EQ(r->num_workers(), 1);
}

TEST(ResolveClusterTest, ALauncherInsideASlurmJobDescribesThisProcessRatherThanSlurm) {
  using consort::resolve_cluster;
  using consort::test::fake_env;
  // mpirun inside an allocation starts its daemons with srun: its ranks inherit the daemons'
  // SLURM_PROCID (the node) and step size (the nodes), and Open MPI's variables say who they are.
  auto r = resolve_cluster(fake_env(merged({slurm_step,
                                            {{"OMPI_COMM_WORLD_RANK", "5"},
                                             {"OMPI_COMM_WORLD_SIZE", "8"},
                                             {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                             {"CONSORT_CHIEF_ADDRESS", "n1:8888"}}})));
  EXPECT_TRUE(is_a<consort::mpi_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 8);
  EXPECT_EQ(r->worker_rank(), 5);
  // srun runs torchrun once a node; torchrun's workers carry the agent's Slurm task.
  r = resolve_cluster(fake_env(merged({slurm_step, torchrun_env})));
  EXPECT_TRUE(is_a<consort::torchrun_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 5);
  // Hydra's mpiexec over srun (one proxy a node), even with srun's MPI plugin set by default.
  auto hydra_over_srun = merged({slurm_step,
                                 {{"PMI_RANK", "4"},
                                  {"PMI_SIZE", "6"},
                                  {"SLURM_MPI_TYPE", "pmi2"},
                                  {"CONSORT_CHIEF_ADDRESS", "n1:8888"}}});
  r = resolve_cluster(fake_env(hydra_over_srun));
  EXPECT_TRUE(is_a<consort::pmi_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 6);
  // Rank 1 of 6 on the second node: its rank agrees with SLURM_PROCID, but not its size.
  hydra_over_srun["PMI_RANK"] = "1";
  EXPECT_TRUE(is_a<consort::pmi_cluster_resolver>(resolve_cluster(fake_env(hydra_over_srun))));
}

TEST(ResolveClusterTest, SrunsOwnMpiPluginLeavesTheStepToSlurm) {
  using consort::resolve_cluster;
  using consort::test::fake_env;
  // srun --mpi=pmi2 / --mpi=pmix start every task themselves: both describe the same step, and
  // Slurm's variables give every address.
  auto pmi2 =
      merged({slurm_step, {{"PMI_RANK", "1"}, {"PMI_SIZE", "3"}, {"SLURM_MPI_TYPE", "pmi2"}}});
  EXPECT_TRUE(is_a<consort::slurm_cluster_resolver>(resolve_cluster(fake_env(pmi2))));
  auto with_pmix = merged(
      {slurm_step,
       {{"PMIX_RANK", "1"}, {"PMIX_NAMESPACE", "slurm.pmix.7.0"}, {"SLURM_MPI_TYPE", "pmix_v4"}}});
  auto r = resolve_cluster(fake_env(with_pmix));
  EXPECT_TRUE(is_a<consort::slurm_cluster_resolver>(r));
  EXPECT_EQ(r->num_workers(), 3);
  // Without srun's plugin, PMIx's variables come from another launcher, which gives no size.
  with_pmix["SLURM_MPI_TYPE"] = "none";
  with_pmix["CONSORT_CHIEF_ADDRESS"] = "n1:8888";
  EXPECT_TRUE(fails_with([&] { resolve_cluster(fake_env(with_pmix)); }, errc::invalid_argument,
                         {"PMIx's environment gives no size"}));
}

TEST(ResolveClusterTest, AHalfSetLauncherFailsNamingWhatIsSetAndWhatIsMissing) {
  using consort::resolve_cluster;
  using consort::test::fake_env;
  struct half_set {
    env_map env;
    std::vector<std::string> fragments;
  };
  const std::vector<half_set> cases = {
      // The chosen launcher lacks a variable.
      {{{"RANK", "1"}},
       {"torchrun's environment is half set", "RANK=\"1\" is set",
        "WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set"}},
      {{{"WORLD_SIZE", "4"}, {"RANK", "2"}, {"MASTER_PORT", "29500"}},
       {"torchrun's environment is half set", "MASTER_ADDR is not set"}},
      {{{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}},
       {"Open MPI's environment is half set", "OMPI_COMM_WORLD_SIZE is not set"}},
      {{{"PMI_RANK", "1"}}, {"PMI's environment is half set", "PMI_SIZE is not set"}},
      // No launcher is chosen, but some of one's variables are set.
      {{{"MASTER_ADDR", "n0"}, {"MASTER_PORT", "29500"}},
       {"the environment is half set", "MASTER_ADDR=\"n0\" and MASTER_PORT=\"29500\" are set",
        "RANK and WORLD_SIZE are not set", "torchrun's variables",
        "unset these for a local, one-worker run"}},
      {{{"LOCAL_RANK", "0"}}, {"LOCAL_RANK=\"0\" is set but RANK and WORLD_SIZE are not set"}},
      {{{"OMPI_COMM_WORLD_SIZE", "2"}},
       {"OMPI_COMM_WORLD_SIZE=\"2\" is set but OMPI_COMM_WORLD_RANK is not set",
        "Open MPI's variables"}},
      {{{"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "0"}},
       {"PMI_SIZE=\"2\" and MPI_LOCALRANKID=\"0\" are set but PMI_RANK is not set"}},
      {{{"CONSORT_CHIEF_ADDRESS", "h:1"}},
       {"CONSORT_CHIEF_ADDRESS=\"h:1\" is set but RANK, OMPI_COMM_WORLD_RANK, PMI_RANK or "
        "PMIX_RANK is not set"}},
      // Every half-set launcher is named.
      {{{"MASTER_ADDR", "n0"}, {"PMI_SIZE", "2"}},
       {"MASTER_ADDR=\"n0\" is set but RANK and WORLD_SIZE are not set",
        "; and PMI_SIZE=\"2\" is set but PMI_RANK is not set"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.fragments.front() + " / " + c.fragments.back());
    EXPECT_TRUE(
        fails_with([&] { resolve_cluster(fake_env(c.env)); }, errc::invalid_argument, c.fragments));
  }
}

TEST(ResolveClusterTest, SlurmsAllocationVariablesAloneAreALocalRun) {
  // An salloc shell has the job's variables but no task of a step.
  auto r = consort::resolve_cluster(consort::test::fake_env(
      {{"SLURM_JOB_ID", "7"}, {"SLURM_JOB_NODELIST", "n[1-2]"}, {"SLURM_NNODES", "2"}}));
  EXPECT_TRUE(r->is_local());
  // An empty variable counts as unset.
  r = consort::resolve_cluster(consort::test::fake_env({{"MASTER_ADDR", ""}, {"RANK", ""}}));
  EXPECT_TRUE(r->is_local());
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

// tools/consort-launch --nnodes gives every worker the address at which the other nodes reach it:
// every launcher resolver that resolve_cluster makes announces that host instead of this host's
// name, and a malformed value fails at once, naming the variable (an empty one counts as unset).
TEST(ResolveClusterTest, ConsortWorkerHostIsTheAddressALauncherWorkerAnnounces) {
  using consort::resolve_cluster;
  using consort::test::fake_env;
  for (const auto& launcher :
       {torchrun_env, merged({open_mpi, {{"CONSORT_CHIEF_ADDRESS", "n1:1"}}}),
        merged({hydra, {{"CONSORT_CHIEF_ADDRESS", "n1:1"}}})}) {
    auto env = merged({launcher, {{"CONSORT_WORKER_HOST", "10.1.2.3"}}});
    auto r = resolve_cluster(fake_env(env));
    const auto me = r->task();
    const auto address = r->cluster_spec().task_address(me.type, me.index);
    EXPECT_EQ(address.substr(0, address.rfind(':')), "10.1.2.3") << address;
    env["CONSORT_WORKER_HOST"] = "fd00::7"; // IPv6 gets its brackets before the port
    r = resolve_cluster(fake_env(env));
    EXPECT_EQ(r->cluster_spec().task_address(me.type, me.index).rfind("[fd00::7]:", 0), 0u);
    for (const char* bad : {"two words", "[fd00::7"}) {
      env["CONSORT_WORKER_HOST"] = bad;
      EXPECT_TRUE(fails_with([&] { resolve_cluster(fake_env(env)); }, errc::invalid_argument,
                             {"CONSORT_WORKER_HOST is \"", "expected the host name or IP address"}))
          << bad;
    }
  }
}
