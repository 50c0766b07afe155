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

// -- ranks, chief, worker count (DESIGN.md §2) ----------------------------------------------------

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

TEST(ClusterResolverTest, NumWorkersCountsChiefAndWorkerTasksOnly) {
  EXPECT_EQ(simple_cluster_resolver(chief_and_workers, "ps", 1).num_workers(), 4);
  EXPECT_EQ(simple_cluster_resolver(workers_only, "worker", 0).num_workers(), 3);
  auto ps_only = cluster_spec::dense({{"ps", {"p:1"}}});
  EXPECT_EQ(simple_cluster_resolver(ps_only, "ps", 0).num_workers(), 0);
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

TEST(ClusterResolverTest, PsIsNeitherChiefNorRanked) {
  simple_cluster_resolver r(chief_and_workers, "ps", 1);
  EXPECT_FALSE(r.is_chief());
  EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::invalid_argument,
                         {"task ps:1 has no worker rank", "chief or worker"}));
}

TEST(ClusterResolverTest, AnEvaluatorIsTheChiefOfItsOwnPartitionButHasNoRank) {
  simple_cluster_resolver r(chief_and_workers, "evaluator", 0);
  EXPECT_TRUE(r.is_chief());
  EXPECT_TRUE(fails_with([&] { r.worker_rank(); }, errc::invalid_argument,
                         {"evaluator:0", "no worker rank"}));
}

TEST(ClusterResolverTest, LocalIsAnEmptyClusterWhoseOnlyWorkerIsTheChief) {
  auto r = cluster_resolver::local();
  EXPECT_TRUE(r->is_local());
  EXPECT_TRUE(r->cluster_spec().empty());
  EXPECT_EQ(r->task_type(), "");
  EXPECT_EQ(r->task_id(), 0);
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

TEST(SimpleClusterResolverTest, ValidatesTheClusterAsTfConfigDoes) {
  auto two_chiefs = cluster_spec::dense({{"chief", {"a:1", "b:1"}}, {"worker", {"w:1"}}});
  EXPECT_TRUE(fails_with([&] { simple_cluster_resolver(two_chiefs, "worker", 0); },
                         errc::invalid_argument,
                         {"simple_cluster_resolver", "at most one 'chief' task"}));
  EXPECT_TRUE(fails_with([] { simple_cluster_resolver(workers_only, "worker", 3); },
                         errc::invalid_argument,
                         {"simple_cluster_resolver", "task index 3 is out of range"}));
  EXPECT_TRUE(fails_with([] { simple_cluster_resolver(workers_only, "ps", 0); },
                         errc::invalid_argument, {"task type \"ps\" is not a job"}));
  EXPECT_TRUE(fails_with([] { simple_cluster_resolver(workers_only, "", 0); },
                         errc::invalid_argument, {"no task type is given"}));
  EXPECT_TRUE(fails_with([] { simple_cluster_resolver(workers_only, "worker", -1); },
                         errc::invalid_argument, {"task index -1", "negative"}));
}

TEST(SimpleClusterResolverTest, AnEmptyClusterNeedsNoTaskButRejectsANegativeIndex) {
  EXPECT_TRUE(simple_cluster_resolver(cluster_spec(), "", 0).is_local());
  EXPECT_TRUE(fails_with([] { simple_cluster_resolver(cluster_spec(), "", -1); },
                         errc::invalid_argument, {"task index -1 is negative"}));
}

TEST(SimpleClusterResolverTest, RejectsANegativeAcceleratorCount) {
  EXPECT_TRUE(fails_with(
      [] {
        simple_cluster_resolver(workers_only, "worker", 0, "", {{"GPU", -1}});
      },
      errc::invalid_argument, {"-1 accelerators", "\"GPU\""}));
}
