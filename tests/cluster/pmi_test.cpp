#include "fake_env.hpp"

#include <consort/cluster.hpp>

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

using consort::cluster_spec;
using consort::errc;
using consort::launcher_options;
using consort::pmi_cluster_resolver;
using consort::pmix_cluster_resolver;
using consort::task_id;
using consort::test::fails_with;
using consort::test::fake_env;

namespace {

using env_map = std::map<std::string, std::string>;

// What MPICH's or Intel MPI's mpiexec (Hydra) gives a rank, with the chief's address.
env_map hydra(int rank, int size, int local_rank, int local_size) {
  return {{"PMI_RANK", std::to_string(rank)},
          {"PMI_SIZE", std::to_string(size)},
          {"PMI_FD", "5"},
          {"MPI_LOCALRANKID", std::to_string(local_rank)},
          {"MPI_LOCALNRANKS", std::to_string(local_size)},
          {"CONSORT_CHIEF_ADDRESS", "head:9000"}};
}

// What a PMIx server gives a process: its rank, namespace and the server's URI, no size.
env_map pmix(int rank) {
  return {{"PMIX_RANK", std::to_string(rank)},
          {"PMIX_NAMESPACE", "prterun-head-1234@1"},
          {"PMIX_SERVER_URI41", "prterun-head-1234@0.0;tcp4://10.0.0.1:4242"},
          {"CONSORT_CHIEF_ADDRESS", "head:9000"}};
}

const launcher_options on_host_b{.host = "b"};

} // namespace

// -- PMI (MPICH, Intel MPI) -----------------------------------------------------------------------

TEST(PmiClusterResolverTest, ReadsRankSizeAndHydrasLocalRank) {
  pmi_cluster_resolver r(on_host_b, fake_env(hydra(5, 8, 1, 4)));
  EXPECT_EQ(r.task(), (task_id{"worker", 5}));
  EXPECT_EQ(r.num_workers(), 8);
  EXPECT_EQ(r.worker_rank(), 5);
  EXPECT_EQ(r.local_rank(), 1);
  EXPECT_EQ(r.own_address(), "b:8889");
  EXPECT_EQ(r.chief_address(), "head:9000");
  EXPECT_EQ(r.cluster_spec(), cluster_spec({{"worker", {{0, "head:9000"}, {5, "b:8889"}}}}));
  EXPECT_EQ(r.launcher(), "PMI");
}

TEST(PmiClusterResolverTest, TheLocalRankComesFromCrayPmiOrIsZero) {
  env_map cray = {{"PMI_RANK", "3"},
                  {"PMI_SIZE", "4"},
                  {"PMI_LOCAL_RANK", "1"},
                  {"PMI_LOCAL_SIZE", "2"},
                  {"CONSORT_CHIEF_ADDRESS", "head:9000"}};
  EXPECT_EQ(pmi_cluster_resolver(on_host_b, fake_env(cray)).local_rank(), 1);
  cray.erase("PMI_LOCAL_RANK");
  EXPECT_EQ(pmi_cluster_resolver(on_host_b, fake_env(cray)).local_rank(), 0);
}

TEST(PmiClusterResolverTest, RankZeroWithoutAChiefAddressUsesItsOwn) {
  auto env = hydra(0, 2, 0, 2);
  env.erase("CONSORT_CHIEF_ADDRESS");
  pmi_cluster_resolver r(on_host_b, fake_env(env));
  EXPECT_EQ(r.chief_address(), "b:8888");
  EXPECT_TRUE(r.is_chief());
}

TEST(PmiClusterResolverTest, AnotherRankWithoutAChiefAddressFailsSayingHowToGiveOne) {
  auto env = hydra(1, 2, 1, 2);
  env.erase("CONSORT_CHIEF_ADDRESS");
  EXPECT_TRUE(fails_with([&] { pmi_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument,
                         {"CONSORT_CHIEF_ADDRESS is not set", "rank 1",
                          "mpiexec -genv CONSORT_CHIEF_ADDRESS host0:port"}));
}

TEST(PmiClusterResolverTest, OnOneNodeNoChiefAddressIsDerivedForHydraNamesNoJob) {
  // MPI_LOCALNRANKS = PMI_SIZE: one node, but Hydra's environment has no job identity to derive a
  // port from, so rank 0 keeps its own address and the others still need CONSORT_CHIEF_ADDRESS.
  auto env = hydra(0, 3, 0, 3);
  env.erase("CONSORT_CHIEF_ADDRESS");
  EXPECT_EQ(pmi_cluster_resolver(on_host_b, fake_env(env)).chief_address(), "b:8888");
  env = hydra(2, 3, 2, 3);
  env.erase("CONSORT_CHIEF_ADDRESS");
  EXPECT_TRUE(fails_with([&] { pmi_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument, {"CONSORT_CHIEF_ADDRESS is not set", "rank 2"}));
}

TEST(PmiClusterResolverTest, OnSeveralNodesWithoutAChiefAddressEveryRankFailsAtOnce) {
  for (int rank : {0, 1, 2, 3}) {
    SCOPED_TRACE(rank);
    auto env = hydra(rank, 4, rank % 2, 2);
    env.erase("CONSORT_CHIEF_ADDRESS");
    EXPECT_TRUE(fails_with([&] { pmi_cluster_resolver(on_host_b, fake_env(env)); },
                           errc::invalid_argument,
                           {"CONSORT_CHIEF_ADDRESS is not set", "several nodes",
                            "MPI_LOCALNRANKS is 2 but PMI_SIZE is 4",
                            "mpiexec -genv CONSORT_CHIEF_ADDRESS host0:port"}));
  }
  // Cray PMI's local size counts too; a chief address makes the job valid.
  env_map cray = {{"PMI_RANK", "0"}, {"PMI_SIZE", "4"}, {"PMI_LOCAL_SIZE", "1"}};
  EXPECT_TRUE(fails_with([&] { pmi_cluster_resolver(on_host_b, fake_env(cray)); },
                         errc::invalid_argument, {"PMI_LOCAL_SIZE is 1 but PMI_SIZE is 4"}));
  EXPECT_EQ(pmi_cluster_resolver(on_host_b, fake_env(hydra(0, 4, 0, 2))).chief_address(),
            "head:9000");
}

TEST(PmiClusterResolverTest, HalfSetEnvironmentsNameWhatIsSetAndWhatIsMissing) {
  EXPECT_TRUE(fails_with(
      [] {
        pmi_cluster_resolver(on_host_b, fake_env({{"PMI_RANK", "1"}, {"MPI_LOCALRANKID", "1"}}));
      },
      errc::invalid_argument,
      {"PMI's environment is half set", "PMI_RANK=\"1\" and MPI_LOCALRANKID=\"1\" are set",
       "PMI_SIZE is not set", "mpiexec"}));
  EXPECT_TRUE(fails_with(
      [] {
        pmi_cluster_resolver(on_host_b, fake_env({{"PMI_SIZE", "4"}}));
      },
      errc::invalid_argument, {"PMI_SIZE=\"4\" is set but PMI_RANK is not set"}));
}

TEST(PmiClusterResolverTest, RejectsALocalSizeAboveTheSize) {
  EXPECT_TRUE(fails_with([] { pmi_cluster_resolver(on_host_b, fake_env(hydra(1, 2, 1, 3))); },
                         errc::invalid_argument,
                         {"MPI_LOCALNRANKS is 3 but PMI_SIZE is 2", "at most PMI_SIZE"}));
}

TEST(PmiClusterResolverTest, RejectsBadNumbersAndRanksOutsideTheirSizes) {
  auto env = hydra(1, 2, 1, 2);
  env["PMI_SIZE"] = "two";
  EXPECT_TRUE(fails_with([&] { pmi_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument, {"PMI_SIZE is \"two\"", ">= 1"}));
  EXPECT_TRUE(fails_with([] { pmi_cluster_resolver(on_host_b, fake_env(hydra(2, 2, 0, 1))); },
                         errc::invalid_argument, {"PMI_RANK is 2", "PMI_SIZE is 2"}));
  EXPECT_TRUE(fails_with([] { pmi_cluster_resolver(on_host_b, fake_env(hydra(1, 4, 2, 2))); },
                         errc::invalid_argument, {"MPI_LOCALRANKID is 2", "MPI_LOCALNRANKS is 2"}));
}

// -- PMIx -----------------------------------------------------------------------------------------

TEST(PmixClusterResolverTest, TheSizeComesFromAVariableBesidePmix) {
  auto env = pmix(2);
  env["PMI_SIZE"] = "4";
  env["OMPI_COMM_WORLD_SIZE"] = "9"; // PMI_SIZE comes first
  pmix_cluster_resolver r(on_host_b, fake_env(env));
  EXPECT_EQ(r.task(), (task_id{"worker", 2}));
  EXPECT_EQ(r.num_workers(), 4);
  EXPECT_EQ(r.chief_address(), "head:9000");
  EXPECT_EQ(r.launcher(), "PMIx");
  env.erase("PMI_SIZE");
  EXPECT_EQ(pmix_cluster_resolver(on_host_b, fake_env(env)).num_workers(), 9);
}

TEST(PmixClusterResolverTest, WithoutASizeItFailsRatherThanGuess) {
  EXPECT_TRUE(fails_with([] { pmix_cluster_resolver(on_host_b, fake_env(pmix(1))); },
                         errc::invalid_argument,
                         {"PMIx's environment gives no size",
                          "PMIX_RANK=\"1\" and PMIX_NAMESPACE=\"prterun-head-1234@1\" are set",
                          "PMI_SIZE or OMPI_COMM_WORLD_SIZE is not set", "PMIX_JOB_SIZE"}));
}

TEST(PmixClusterResolverTest, TheLocalRankComesFromTheFirstLocalVariableSet) {
  auto env = pmix(3);
  env["PMI_SIZE"] = "4";
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "1";
  EXPECT_EQ(pmix_cluster_resolver(on_host_b, fake_env(env)).local_rank(), 1);
  env["MPI_LOCALRANKID"] = "0";
  EXPECT_EQ(pmix_cluster_resolver(on_host_b, fake_env(env)).local_rank(), 0);
}

TEST(PmixClusterResolverTest, RejectsARankNotBelowTheSize) {
  auto env = pmix(4);
  env["OMPI_COMM_WORLD_SIZE"] = "4";
  EXPECT_TRUE(fails_with([&] { pmix_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument, {"PMIX_RANK is 4", "OMPI_COMM_WORLD_SIZE is 4"}));
}

TEST(PmixClusterResolverTest, OnOneNodeEveryRankDerivesTheChiefAddressFromTheNamespace) {
  // prterun with PMI_SIZE and a local size: PMIX_NAMESPACE names the job.
  const std::string expected =
      "127.0.0.1:" + std::to_string(consort::one_node_chief_port("prterun-head-1234@1"));
  for (int rank : {1, 2}) {
    SCOPED_TRACE(rank);
    auto env = pmix(rank);
    env.erase("CONSORT_CHIEF_ADDRESS");
    env["PMI_SIZE"] = "3";
    env["MPI_LOCALNRANKS"] = "3";
    env["MPI_LOCALRANKID"] = std::to_string(rank);
    pmix_cluster_resolver r({}, fake_env(env));
    EXPECT_EQ(r.chief_address(), expected);
    EXPECT_EQ(r.own_address(), "127.0.0.1:" + std::to_string(8888 + rank));
  }
}

TEST(PmixClusterResolverTest, OnSeveralNodesWithoutAChiefAddressEveryRankFailsAtOnce) {
  for (int rank : {0, 3}) {
    SCOPED_TRACE(rank);
    auto env = pmix(rank);
    env.erase("CONSORT_CHIEF_ADDRESS");
    env["PMI_SIZE"] = "4";
    env["PMI_LOCAL_SIZE"] = "2";
    EXPECT_TRUE(fails_with([&] { pmix_cluster_resolver(on_host_b, fake_env(env)); },
                           errc::invalid_argument,
                           {"several nodes", "PMI_LOCAL_SIZE is 2 but PMI_SIZE is 4",
                            "give every process CONSORT_CHIEF_ADDRESS=host0:port"}));
  }
}
