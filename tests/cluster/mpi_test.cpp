#include "fake_env.hpp"

#include <consort/cluster.hpp>

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

using consort::cluster_spec;
using consort::errc;
using consort::mpi_cluster_resolver;
using consort::mpi_options;
using consort::task_id;
using consort::test::fails_with;
using consort::test::fake_env;

namespace {

std::map<std::string, std::string> ompi(int rank, int size, int local_rank) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(local_rank)}};
}

std::map<std::string, std::string> ompi_with_chief(int rank, int size, int local_rank) {
  auto env = ompi(rank, size, local_rank);
  env["CONSORT_CHIEF_ADDRESS"] = "head:9000";
  return env;
}

const mpi_options on_host_b{.host = "b"};

} // namespace

TEST(MpiClusterResolverTest, ReadsRankSizeAndLocalRank) {
  mpi_cluster_resolver r(on_host_b, fake_env(ompi_with_chief(2, 4, 1)));
  EXPECT_EQ(r.task(), (task_id{"worker", 2}));
  EXPECT_EQ(r.num_workers(), 4);
  EXPECT_EQ(r.worker_rank(), 2);
  EXPECT_EQ(r.local_rank(), 1);
  EXPECT_FALSE(r.is_chief());
  EXPECT_EQ(r.chief(), (task_id{"worker", 0}));
}

TEST(MpiClusterResolverTest, OwnAddressIsTheHostAndTheBasePortPlusTheLocalRank) {
  EXPECT_EQ(mpi_cluster_resolver(on_host_b, fake_env(ompi_with_chief(2, 4, 1))).own_address(),
            "b:8889");
  mpi_options options{.host = "b", .port_base = 7000};
  EXPECT_EQ(mpi_cluster_resolver(options, fake_env(ompi_with_chief(3, 4, 3))).own_address(),
            "b:7003");
}

TEST(MpiClusterResolverTest, AnIpv6HostIsBracketed) {
  mpi_options options{.host = "fd00::2"};
  EXPECT_EQ(mpi_cluster_resolver(options, fake_env(ompi_with_chief(1, 2, 0))).own_address(),
            "[fd00::2]:8888");
}

TEST(MpiClusterResolverTest, WithoutAGivenHostItUsesThisMachinesName) {
  mpi_cluster_resolver r({}, fake_env(ompi_with_chief(1, 2, 0)));
  EXPECT_FALSE(r.own_address().empty());
  EXPECT_EQ(r.own_address().substr(r.own_address().size() - 5), ":8888");
}

TEST(MpiClusterResolverTest, BeforeTheExchangeTheClusterHoldsOnlyTheChiefAndThisProcess) {
  mpi_cluster_resolver r(on_host_b, fake_env(ompi_with_chief(2, 4, 1)));
  EXPECT_FALSE(r.has_addresses());
  EXPECT_EQ(r.cluster_spec(), cluster_spec({{"worker", {{0, "head:9000"}, {2, "b:8889"}}}}));
  EXPECT_EQ(r.master(), "b:8889");
  EXPECT_EQ(r.master("worker", 0), "head:9000");
  // The counts come from the environment, not from the partial spec.
  EXPECT_EQ(r.num_workers(), 4);
}

TEST(MpiClusterResolverTest, TheChiefAddressVariableWinsOverTheDefault) {
  mpi_options options{.host = "b", .default_chief_address = "fallback:1"};
  EXPECT_EQ(mpi_cluster_resolver(options, fake_env(ompi_with_chief(1, 2, 0))).chief_address(),
            "head:9000");
  EXPECT_EQ(mpi_cluster_resolver(options, fake_env(ompi(1, 2, 0))).chief_address(), "fallback:1");
}

TEST(MpiClusterResolverTest, RankZeroWithoutAChiefAddressUsesItsOwn) {
  mpi_cluster_resolver r(on_host_b, fake_env(ompi(0, 3, 0)));
  EXPECT_EQ(r.chief_address(), "b:8888");
  EXPECT_TRUE(r.is_chief());
  EXPECT_EQ(r.cluster_spec(), cluster_spec({{"worker", {{0, "b:8888"}}}}));
}

TEST(MpiClusterResolverTest, AnotherRankWithoutAChiefAddressFailsNamingTheVariable) {
  EXPECT_TRUE(fails_with([] { mpi_cluster_resolver(on_host_b, fake_env(ompi(1, 3, 1))); },
                         errc::invalid_argument,
                         {"CONSORT_CHIEF_ADDRESS is not set", "rank 0's \"host:port\""}));
}

TEST(MpiClusterResolverTest, RejectsAChiefAddressThatIsNotHostPort) {
  auto env = ompi(1, 2, 0);
  env["CONSORT_CHIEF_ADDRESS"] = "head";
  EXPECT_TRUE(fails_with([&] { mpi_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument,
                         {"CONSORT_CHIEF_ADDRESS is \"head\"", "\"host:port\""}));
  mpi_options bad_default{.host = "b", .default_chief_address = "head:99999"};
  EXPECT_TRUE(fails_with([&] { mpi_cluster_resolver(bad_default, fake_env(ompi(1, 2, 0))); },
                         errc::invalid_argument, {"default_chief_address is \"head:99999\""}));
}

TEST(MpiClusterResolverTest, SetAddressesGivesTheWholeDenseCluster) {
  mpi_cluster_resolver r(on_host_b, fake_env(ompi_with_chief(2, 3, 0)));
  r.set_addresses({"a:8888", "c:8888", "b:8888"});
  EXPECT_TRUE(r.has_addresses());
  EXPECT_EQ(r.cluster_spec(), cluster_spec::dense({{"worker", {"a:8888", "c:8888", "b:8888"}}}));
  EXPECT_EQ(r.chief_address(), "a:8888");
  EXPECT_EQ(r.master("worker", 1), "c:8888");
  EXPECT_EQ(r.worker_rank(), 2);
  EXPECT_EQ(r.num_workers(), 3);
}

TEST(MpiClusterResolverTest, SetAddressesRejectsAWrongCountAndLeavesTheResolverUnchanged) {
  mpi_cluster_resolver r(on_host_b, fake_env(ompi_with_chief(1, 3, 0)));
  EXPECT_TRUE(fails_with(
      [&] {
        r.set_addresses({"a:1", "b:1"});
      },
      errc::invalid_argument, {"gave 2 address(es)", "OMPI_COMM_WORLD_SIZE = 3"}));
  EXPECT_FALSE(r.has_addresses());
  EXPECT_EQ(r.chief_address(), "head:9000");
}

TEST(MpiClusterResolverTest, SetAddressesRejectsAnAddressThatIsNotHostPort) {
  mpi_cluster_resolver r(on_host_b, fake_env(ompi_with_chief(1, 3, 0)));
  EXPECT_TRUE(fails_with(
      [&] {
        r.set_addresses({"a:1", "b", "c:1"});
      },
      errc::invalid_argument, {"rank 1 is \"b\"", "\"host:port\""}));
  EXPECT_TRUE(fails_with(
      [&] {
        r.set_addresses({"a:1", ":1", "c:1"});
      },
      errc::invalid_argument, {"rank 1 is \":1\""}));
  EXPECT_FALSE(r.has_addresses());
}

TEST(MpiClusterResolverTest, GivenAddressesTheConstructorNeedsNoChiefAddress) {
  mpi_cluster_resolver r(on_host_b, {"a:1", "b:1"}, fake_env(ompi(1, 2, 0)));
  EXPECT_TRUE(r.has_addresses());
  EXPECT_EQ(r.chief_address(), "a:1");
  EXPECT_EQ(r.cluster_spec(), cluster_spec::dense({{"worker", {"a:1", "b:1"}}}));
}

TEST(MpiClusterResolverTest, MissingVariablesAreNamed) {
  for (std::string name :
       {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"}) {
    SCOPED_TRACE(name);
    auto env = ompi_with_chief(0, 2, 0);
    env.erase(name);
    EXPECT_TRUE(fails_with([&] { mpi_cluster_resolver(on_host_b, fake_env(env)); },
                           errc::invalid_argument, {name + " is not set", "mpirun"}));
  }
  // The message names what is set too.
  EXPECT_TRUE(fails_with(
      [] {
        mpi_cluster_resolver(on_host_b, fake_env({{"OMPI_COMM_WORLD_RANK", "1"}}));
      },
      errc::invalid_argument,
      {"Open MPI's environment is half set: OMPI_COMM_WORLD_RANK=\"1\" is set but "
       "OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_LOCAL_RANK are not set"}));
}

TEST(MpiClusterResolverTest, RejectsMalformedNumbersNamingTheVariable) {
  auto env = ompi_with_chief(0, 2, 0);
  env["OMPI_COMM_WORLD_SIZE"] = "two";
  EXPECT_TRUE(fails_with([&] { mpi_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument, {"OMPI_COMM_WORLD_SIZE is \"two\"", ">= 1"}));
  env = ompi_with_chief(0, 2, 0);
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "-1";
  EXPECT_TRUE(fails_with([&] { mpi_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument, {"OMPI_COMM_WORLD_LOCAL_RANK is \"-1\""}));
}

TEST(MpiClusterResolverTest, RejectsARankNotBelowTheSize) {
  EXPECT_TRUE(fails_with(
      [] { mpi_cluster_resolver(on_host_b, fake_env(ompi_with_chief(2, 2, 0))); },
      errc::invalid_argument, {"OMPI_COMM_WORLD_RANK is 2", "OMPI_COMM_WORLD_SIZE is 2"}));
}

TEST(MpiClusterResolverTest, RejectsAPortBeyond65535) {
  mpi_options options{.host = "b", .port_base = 65535};
  EXPECT_TRUE(fails_with([&] { mpi_cluster_resolver(options, fake_env(ompi_with_chief(1, 2, 1))); },
                         errc::invalid_argument, {"port_base 65535", "LOCAL_RANK 1"}));
}
