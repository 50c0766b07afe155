#include "fake_env.hpp"

#include <consort/cluster.hpp>

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

using consort::cluster_spec;
using consort::errc;
using consort::expand_hostlist;
using consort::expand_tasks_per_node;
using consort::slurm_cluster_resolver;
using consort::task_id;
using consort::test::fails_with;
using consort::test::fake_env;

using hosts = std::vector<std::string>;
using counts = std::vector<int>;

// -- expand_hostlist ------------------------------------------------------------------------------

TEST(ExpandHostlistTest, ExpandsRangesAndKeepsZeroPadding) {
  EXPECT_EQ(expand_hostlist("node[01-03,7],gpu-[1-2]"),
            (hosts{"node01", "node02", "node03", "node7", "gpu-1", "gpu-2"}));
}

TEST(ExpandHostlistTest, ExpandsTensorFlowsDocumentedExample) {
  EXPECT_EQ(expand_hostlist("n[1-2],m5,o[3-4,6,7-9]"),
            (hosts{"n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"}));
}

TEST(ExpandHostlistTest, PadsToTheWidthOfTheRangeStart) {
  EXPECT_EQ(expand_hostlist("n[08-10]"), (hosts{"n08", "n09", "n10"}));
  EXPECT_EQ(expand_hostlist("n[098-101]"), (hosts{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand_hostlist("n[9-10]"), (hosts{"n9", "n10"}));
  EXPECT_EQ(expand_hostlist("n[000]"), (hosts{"n000"}));
}

TEST(ExpandHostlistTest, PlainHostsPassThroughInOrderWithoutDeduplication) {
  EXPECT_EQ(expand_hostlist("b,a,b"), (hosts{"b", "a", "b"}));
  EXPECT_EQ(expand_hostlist("login-1.cluster.example"), (hosts{"login-1.cluster.example"}));
  EXPECT_EQ(expand_hostlist("n[5]"), (hosts{"n5"}));
}

TEST(ExpandHostlistTest, EmptyListHasNoHosts) {
  EXPECT_TRUE(expand_hostlist("").empty());
}

TEST(ExpandHostlistTest, KeepsTextAfterABracket) {
  EXPECT_EQ(expand_hostlist("n[1-2]-ib"), (hosts{"n1-ib", "n2-ib"}));
}

TEST(ExpandHostlistTest, SeveralBracketsExpandToTheirProductLeftmostSlowest) {
  EXPECT_EQ(expand_hostlist("r[1-2]n[1-2]"), (hosts{"r1n1", "r1n2", "r2n1", "r2n2"}));
}

TEST(ExpandHostlistTest, RejectsMalformedHostlistsQuotingThem) {
  for (std::string bad : {",,", "a,", ",a", "a,,b", "n[1-2", "n]1", "n[[1]]", "n[]", "n[a-b]",
                          "n[3-1]", "n[1-2-3]", "n[-1]", "n[1,]", "n[1-]"}) {
    SCOPED_TRACE(bad);
    EXPECT_TRUE(fails_with([&] { expand_hostlist(bad); }, errc::invalid_argument,
                           {"invalid hostlist \"" + bad + "\"", "expected hosts"}));
  }
}

TEST(ExpandHostlistTest, RejectsAHostlistOfMoreThanAMillionHosts) {
  EXPECT_TRUE(fails_with([] { expand_hostlist("n[0-99999999]"); }, errc::invalid_argument,
                         {"more than 1000000 hosts"}));
  EXPECT_TRUE(fails_with([] { expand_hostlist("a[0-9999]b[0-9999]"); }, errc::invalid_argument,
                         {"more than 1000000 hosts"}));
}

// -- expand_tasks_per_node ------------------------------------------------------------------------

TEST(ExpandTasksPerNodeTest, ExpandsRepeatedCounts) {
  EXPECT_EQ(expand_tasks_per_node("2(x3),1"), (counts{2, 2, 2, 1}));
  EXPECT_EQ(expand_tasks_per_node("3(x2),2,1"), (counts{3, 3, 2, 1}));
  EXPECT_EQ(expand_tasks_per_node("4"), (counts{4}));
}

TEST(ExpandTasksPerNodeTest, RejectsMalformedCountsQuotingThem) {
  for (std::string bad : {"", "x", "2(x)", "2(3)", "2(x3", "2x3)", "-1", "2,,1", "2(x-1)", "1.5"}) {
    SCOPED_TRACE(bad);
    EXPECT_TRUE(fails_with([&] { expand_tasks_per_node(bad); }, errc::invalid_argument,
                           {"invalid tasks-per-node list \"" + bad + "\""}));
  }
}

// -- slurm_cluster_resolver -----------------------------------------------------------------------

namespace {

// A step of 5 tasks: two on node1, two on node2, one on gpu-1.
std::map<std::string, std::string> five_task_step(int procid) {
  return {{"SLURM_PROCID", std::to_string(procid)},
          {"SLURM_STEP_NUM_TASKS", "5"},
          {"SLURM_STEP_NODELIST", "node[1-2],gpu-1"},
          {"SLURM_STEP_TASKS_PER_NODE", "2(x2),1"}};
}

} // namespace

TEST(SlurmClusterResolverTest, AssignsTasksToNodesInOrderWithOnePortPerLocalTask) {
  slurm_cluster_resolver r({}, fake_env(five_task_step(3)));
  EXPECT_EQ(
      r.cluster_spec(),
      cluster_spec::dense(
          {{"worker", {"node1:8888", "node1:8889", "node2:8888", "node2:8889", "gpu-1:8888"}}}));
  EXPECT_EQ(r.task(), (task_id{"worker", 3}));
  EXPECT_EQ(r.local_task_index(), 1);
}

TEST(SlurmClusterResolverTest, RanksAreWorkerRanksAndRankZeroIsTheChief) {
  for (int procid = 0; procid < 5; ++procid) {
    SCOPED_TRACE(procid);
    slurm_cluster_resolver r({}, fake_env(five_task_step(procid)));
    EXPECT_EQ(r.worker_rank(), procid);
    EXPECT_EQ(r.num_workers(), 5);
    EXPECT_EQ(r.is_chief(), procid == 0);
    EXPECT_EQ(r.chief(), (task_id{"worker", 0}));
  }
}

TEST(SlurmClusterResolverTest, UsesTheGivenBasePortAndRpcLayer) {
  slurm_cluster_resolver r({.port_base = 7000, .rpc_layer = ""}, fake_env(five_task_step(1)));
  EXPECT_EQ(r.cluster_spec().task_address("worker", 1), "node1:7001");
  EXPECT_EQ(r.rpc_layer(), "");
  EXPECT_EQ(r.master(), "node1:7001");
}

TEST(SlurmClusterResolverTest, RpcLayerIsGrpcByDefaultAsInTensorFlow) {
  slurm_cluster_resolver r({}, fake_env(five_task_step(2)));
  EXPECT_EQ(r.rpc_layer(), "grpc");
  EXPECT_EQ(r.master(), "grpc://node2:8888");
}

TEST(SlurmClusterResolverTest, KeepsTheNodelistOrderRatherThanSortingHostNames) {
  // Sorting names, as TF does, would put node10 before node9 against Slurm's rank order.
  slurm_cluster_resolver r({}, fake_env({{"SLURM_PROCID", "0"},
                                         {"SLURM_NTASKS", "2"},
                                         {"SLURM_STEP_NODELIST", "node[9-10]"},
                                         {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}}));
  EXPECT_EQ(r.cluster_spec().task_address("worker", 0), "node9:8888");
  EXPECT_EQ(r.cluster_spec().task_address("worker", 1), "node10:8888");
}

TEST(SlurmClusterResolverTest, PrefersStepVariablesOverJobVariables) {
  auto env = five_task_step(0);
  env["SLURM_NTASKS"] = "8";
  env["SLURM_JOB_NODELIST"] = "other[1-4]";
  env["SLURM_TASKS_PER_NODE"] = "2(x4)";
  slurm_cluster_resolver r({}, fake_env(env));
  EXPECT_EQ(r.cluster_spec().num_tasks("worker"), 5);
  EXPECT_EQ(r.cluster_spec().task_address("worker", 0), "node1:8888");
}

TEST(SlurmClusterResolverTest, FallsBackToJobVariablesOutsideAStep) {
  slurm_cluster_resolver r({}, fake_env({{"SLURM_PROCID", "1"},
                                         {"SLURM_NTASKS", "2"},
                                         {"SLURM_JOB_NODELIST", "a,b"},
                                         {"SLURM_TASKS_PER_NODE", "1(x2)"}}));
  EXPECT_EQ(r.cluster_spec(), cluster_spec::dense({{"worker", {"a:8888", "b:8888"}}}));
  EXPECT_EQ(r.task_id(), 1);
}

TEST(SlurmClusterResolverTest, AHostNamedTwiceKeepsCountingItsPorts) {
  slurm_cluster_resolver r({}, fake_env({{"SLURM_PROCID", "2"},
                                         {"SLURM_NTASKS", "3"},
                                         {"SLURM_STEP_NODELIST", "a,a"},
                                         {"SLURM_STEP_TASKS_PER_NODE", "2,1"}}));
  EXPECT_EQ(r.cluster_spec(), cluster_spec::dense({{"worker", {"a:8888", "a:8889", "a:8890"}}}));
  EXPECT_EQ(r.local_task_index(), 2);
}

TEST(SlurmClusterResolverTest, AcceptsSlurmsOwnPlacementWhenItAgrees) {
  auto env = five_task_step(3);
  env["SLURM_LOCALID"] = "1";
  env["SLURMD_NODENAME"] = "node2";
  EXPECT_EQ(slurm_cluster_resolver({}, fake_env(env)).task_id(), 3);
}

TEST(SlurmClusterResolverTest, RejectsADistributionOtherThanBlock) {
  auto cyclic = five_task_step(3);
  cyclic["SLURM_LOCALID"] = "0";
  EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(cyclic)); },
                         errc::invalid_argument,
                         {"SLURM_LOCALID is 0", "index 1", "block distribution"}));
  auto elsewhere = five_task_step(3);
  elsewhere["SLURMD_NODENAME"] = "node1";
  EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(elsewhere)); },
                         errc::invalid_argument,
                         {"SLURMD_NODENAME is \"node1\"", "\"node2\"", "block distribution"}));
}

TEST(SlurmClusterResolverTest, MissingVariablesAreNamed) {
  struct missing_case {
    std::vector<std::string> remove;
    std::vector<std::string> fragments;
  };
  const std::vector<missing_case> cases = {
      {{"SLURM_PROCID"}, {"SLURM_PROCID is not set", "srun"}},
      {{"SLURM_STEP_NUM_TASKS"}, {"SLURM_STEP_NUM_TASKS, SLURM_NTASKS are all unset"}},
      {{"SLURM_STEP_NODELIST"}, {"SLURM_STEP_NODELIST, SLURM_JOB_NODELIST are all unset"}},
      {{"SLURM_STEP_TASKS_PER_NODE"},
       {"SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE are all unset"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.remove.front());
    auto env = five_task_step(0);
    for (const auto& name : c.remove)
      env.erase(name);
    EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(env)); },
                           errc::invalid_argument, c.fragments));
  }
}

TEST(SlurmClusterResolverTest, RejectsMalformedNumbersNamingTheVariable) {
  auto env = five_task_step(0);
  env["SLURM_PROCID"] = "x1";
  EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(env)); }, errc::invalid_argument,
                         {"SLURM_PROCID is \"x1\"", "integer >= 0"}));
  env = five_task_step(0);
  env["SLURM_STEP_NUM_TASKS"] = "0";
  EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(env)); }, errc::invalid_argument,
                         {"SLURM_STEP_NUM_TASKS is \"0\"", ">= 1"}));
}

TEST(SlurmClusterResolverTest, RejectsARankNotBelowTheNumberOfTasks) {
  EXPECT_TRUE(fails_with([] { slurm_cluster_resolver({}, fake_env(five_task_step(5))); },
                         errc::invalid_argument,
                         {"SLURM_PROCID is 5", "SLURM_STEP_NUM_TASKS is 5"}));
}

TEST(SlurmClusterResolverTest, RejectsABadHostlistNamingTheVariable) {
  auto env = five_task_step(0);
  env["SLURM_STEP_NODELIST"] = "node[1-2";
  EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(env)); }, errc::invalid_argument,
                         {"SLURM_STEP_NODELIST: invalid hostlist"}));
  env["SLURM_STEP_NODELIST"] = "";
  EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(env)); }, errc::invalid_argument,
                         {"SLURM_STEP_NODELIST is empty"}));
}

TEST(SlurmClusterResolverTest, RejectsBadTasksPerNodeNamingTheVariable) {
  auto env = five_task_step(0);
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x2";
  EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(env)); }, errc::invalid_argument,
                         {"SLURM_STEP_TASKS_PER_NODE: invalid tasks-per-node list"}));
}

TEST(SlurmClusterResolverTest, RejectsACountListThatDoesNotMatchTheNodes) {
  auto env = five_task_step(0);
  env["SLURM_STEP_TASKS_PER_NODE"] = "2,3";
  EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(env)); }, errc::invalid_argument,
                         {"names 3 node(s)", "gives counts for 2", "one count per node"}));
}

TEST(SlurmClusterResolverTest, RejectsCountsThatDoNotAddUpToTheNumberOfTasks) {
  auto env = five_task_step(0);
  env["SLURM_STEP_TASKS_PER_NODE"] = "2(x3)";
  EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(env)); }, errc::invalid_argument,
                         {"adds up to 6 task(s)", "SLURM_STEP_NUM_TASKS is 5"}));
}

TEST(SlurmClusterResolverTest, RejectsPortsBeyond65535) {
  EXPECT_TRUE(
      fails_with([] { slurm_cluster_resolver({.port_base = 65535}, fake_env(five_task_step(0))); },
                 errc::invalid_argument, {"port 65536"}));
  EXPECT_TRUE(
      fails_with([] { slurm_cluster_resolver({.port_base = 0}, fake_env(five_task_step(0))); },
                 errc::invalid_argument, {"port_base is 0"}));
}

// -- ports from the environment -------------------------------------------------------------------

TEST(SlurmClusterResolverTest, ThePortBaseComesFromConsortPortBase) {
  auto env = five_task_step(0);
  env["CONSORT_PORT_BASE"] = "7000";
  EXPECT_EQ(
      slurm_cluster_resolver({}, fake_env(env)).cluster_spec(),
      cluster_spec::dense(
          {{"worker", {"node1:7000", "node1:7001", "node2:7000", "node2:7001", "gpu-1:7000"}}}));
}

TEST(SlurmClusterResolverTest, ThePortsComeFromTheStepsReservedPorts) {
  auto env = five_task_step(0);
  env["SLURM_STEP_RESV_PORTS"] = "12000-12015";
  EXPECT_EQ(slurm_cluster_resolver({}, fake_env(env)).cluster_spec(),
            cluster_spec::dense(
                {{"worker",
                  {"node1:12000", "node1:12001", "node2:12000", "node2:12001", "gpu-1:12000"}}}));
  // A list of ports and ranges: the k-th task on a node takes the k-th port.
  env["SLURM_STEP_RESV_PORTS"] = "12000,12005-12006";
  EXPECT_EQ(slurm_cluster_resolver({}, fake_env(env)).cluster_spec().task_address("worker", 1),
            "node1:12005");
}

TEST(SlurmClusterResolverTest, CodeComesFirstThenConsortPortBaseThenReservedPorts) {
  auto env = five_task_step(0);
  env["CONSORT_PORT_BASE"] = "7000";
  env["SLURM_STEP_RESV_PORTS"] = "12000-12015";
  EXPECT_EQ(slurm_cluster_resolver({.port_base = 6000}, fake_env(env)).master(),
            "grpc://node1:6000");
  EXPECT_EQ(slurm_cluster_resolver({}, fake_env(env)).master(), "grpc://node1:7000");
  env.erase("CONSORT_PORT_BASE");
  EXPECT_EQ(slurm_cluster_resolver({}, fake_env(env)).master(), "grpc://node1:12000");
  env.erase("SLURM_STEP_RESV_PORTS");
  EXPECT_EQ(slurm_cluster_resolver({}, fake_env(env)).master(), "grpc://node1:8888");
}

TEST(SlurmClusterResolverTest, RejectsFewerReservedPortsThanTasksOnANode) {
  auto env = five_task_step(0);
  env["SLURM_STEP_RESV_PORTS"] = "12000";
  EXPECT_TRUE(fails_with(
      [&] { slurm_cluster_resolver({}, fake_env(env)); }, errc::invalid_argument,
      {"SLURM_STEP_RESV_PORTS \"12000\" reserves 1 port(s)", "node \"node1\"", "--resv-ports"}));
}

TEST(SlurmClusterResolverTest, RejectsMalformedPortVariablesNamingThem) {
  struct bad_value {
    std::string name;
    std::string value;
    std::vector<std::string> fragments;
  };
  const std::vector<bad_value> cases = {
      {"CONSORT_PORT_BASE", "x", {"CONSORT_PORT_BASE is \"x\"", "1..65535"}},
      {"CONSORT_PORT_BASE", "0", {"CONSORT_PORT_BASE is \"0\""}},
      {"CONSORT_PORT_BASE", "65535", {"port 65536", "CONSORT_PORT_BASE"}},
      {"SLURM_STEP_RESV_PORTS", "ports", {"SLURM_STEP_RESV_PORTS is \"ports\"", "\"ports\""}},
      {"SLURM_STEP_RESV_PORTS", "12005-12000", {"range \"12005-12000\" ends below its start"}},
      {"SLURM_STEP_RESV_PORTS", "12000-70000", {"\"12000-70000\" is not a port"}},
      {"SLURM_STEP_RESV_PORTS", "12000,", {"part \"\""}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name + "=" + c.value);
    auto env = five_task_step(0);
    env[c.name] = c.value;
    EXPECT_TRUE(fails_with([&] { slurm_cluster_resolver({}, fake_env(env)); },
                           errc::invalid_argument, c.fragments));
  }
}
