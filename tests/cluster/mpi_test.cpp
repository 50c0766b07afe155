#include "fake_env.hpp"

#include <consort/cluster.hpp>

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <set>
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

// What Open MPI 4.1's mpirun gives rank `rank` of `size` when `local_size` ranks share its node
// (recorded from `mpirun -np 3 env`): the job id twice, no chief address.
std::map<std::string, std::string> mpirun(int rank, int size, int local_rank, int local_size,
                                          const std::string& job = "645005313") {
  auto env = ompi(rank, size, local_rank);
  env["OMPI_COMM_WORLD_LOCAL_SIZE"] = std::to_string(local_size);
  env["OMPI_COMM_WORLD_NODE_RANK"] = std::to_string(local_rank);
  env["OMPI_MCA_ess_base_jobid"] = job;
  env["OMPI_MCA_orte_num_nodes"] = "1";
  env["PMIX_NAMESPACE"] = job;
  env["PMIX_RANK"] = std::to_string(rank);
  env["PMIX_ID"] = job + "." + std::to_string(rank);
  return env;
}

std::string one_node_chief(const std::string& job) {
  return "127.0.0.1:" + std::to_string(consort::one_node_chief_port(job));
}

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
  // Before the exchange the cluster is partial: the chief's check at join must not digest it.
  const consort::cluster_resolver& as_resolver = r;
  EXPECT_FALSE(as_resolver.knows_every_address());
  r.set_addresses({"a:8888", "c:8888", "b:8888"});
  EXPECT_TRUE(r.has_addresses());
  EXPECT_TRUE(as_resolver.knows_every_address());
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

// -- every rank on one node, no chief address (a plain `mpirun -np 3 ./job`) -------------------

TEST(MpiClusterResolverTest, TheOnePortIsAFixedFunctionOfTheJobIdInTheDocumentedRange) {
  // 64-bit FNV-1a, pinned: a rank built from another revision must derive the same port.
  EXPECT_EQ(consort::one_node_chief_port("645005313"), 31098);
  EXPECT_EQ(consort::one_node_chief_port("prterun-vm-1234@1"), 25019);
  std::set<int> ports;
  for (int job = 0; job < 2000; ++job) {
    const int port = consort::one_node_chief_port(std::to_string(645005313 + (job << 16)));
    EXPECT_GE(port, consort::one_node_chief_port_first);
    EXPECT_LT(port, consort::one_node_chief_port_first + consort::one_node_chief_port_count);
    EXPECT_LT(port, 32768); // below Linux's default ephemeral range
    ports.insert(port);
  }
  // Jobs spread over the range (2000 ids into 8192 ports: about 1780 distinct).
  EXPECT_GT(ports.size(), 1500U);
}

TEST(MpiClusterResolverTest, OnOneNodeEveryRankDerivesTheSameChiefAddressFromTheJobId) {
  for (int rank : {2, 1, 0}) {
    SCOPED_TRACE(rank);
    mpi_cluster_resolver r({}, fake_env(mpirun(rank, 3, rank, 3)));
    EXPECT_EQ(r.chief_address(), "127.0.0.1:31098");
    // Every rank is on this node: each listens on the loopback too.
    EXPECT_EQ(r.own_address(), "127.0.0.1:" + std::to_string(8888 + rank));
    EXPECT_EQ(r.cluster_spec().task_address("worker", 0), "127.0.0.1:31098");
    EXPECT_EQ(r.num_workers(), 3);
  }
}

TEST(MpiClusterResolverTest, AnotherJobOnTheSameNodeGetsItsOwnPort) {
  const std::string other = std::to_string(645005313 + (7 << 16));
  const auto a = mpi_cluster_resolver({}, fake_env(mpirun(1, 3, 1, 3))).chief_address();
  const auto b = mpi_cluster_resolver({}, fake_env(mpirun(1, 3, 1, 3, other))).chief_address();
  EXPECT_EQ(b, one_node_chief(other));
  EXPECT_NE(a, b);
}

TEST(MpiClusterResolverTest, TheJobIdComesFromPmixNamespaceElseFromTheEssJobid) {
  auto env = mpirun(1, 2, 1, 2);
  env["PMIX_NAMESPACE"] = "prterun-vm-1234@1"; // Open MPI 5's form wins over the ess job id
  EXPECT_EQ(mpi_cluster_resolver({}, fake_env(env)).chief_address(), "127.0.0.1:25019");
  env.erase("PMIX_NAMESPACE");
  EXPECT_EQ(mpi_cluster_resolver({}, fake_env(env)).chief_address(), "127.0.0.1:31098");
  // Neither: no address can be derived, and rank 1 fails as before.
  env.erase("OMPI_MCA_ess_base_jobid");
  EXPECT_TRUE(fails_with([&] { mpi_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument, {"CONSORT_CHIEF_ADDRESS is not set", "rank 1"}));
}

TEST(MpiClusterResolverTest, AGivenChiefAddressOrHostWinsOverTheOneNodeAddress) {
  auto env = mpirun(1, 3, 1, 3);
  env["CONSORT_CHIEF_ADDRESS"] = "head:9000";
  mpi_cluster_resolver given(on_host_b, fake_env(env));
  EXPECT_EQ(given.chief_address(), "head:9000");
  EXPECT_EQ(given.own_address(), "b:8889");
  mpi_options with_default{.default_chief_address = "fallback:1"};
  EXPECT_EQ(mpi_cluster_resolver(with_default, fake_env(mpirun(1, 3, 1, 3))).chief_address(),
            "fallback:1");
  // A host given in code is kept; the chief is still derived.
  mpi_cluster_resolver on_b(on_host_b, fake_env(mpirun(2, 3, 2, 3)));
  EXPECT_EQ(on_b.chief_address(), "127.0.0.1:31098");
  EXPECT_EQ(on_b.own_address(), "b:8890");
}

TEST(MpiClusterResolverTest, OneRankNeedsNoChiefAddress) {
  mpi_cluster_resolver r(on_host_b, fake_env(mpirun(0, 1, 0, 1)));
  EXPECT_EQ(r.chief_address(), "b:8888");
}

TEST(MpiClusterResolverTest, TheChiefFailsAtOnceWhenTheDerivedPortIsTaken) {
  const std::string job = "consort-mpi-test-taken-port";
  const int port = consort::one_node_chief_port(job);
  // Hold the port as another program would (a listener without SO_REUSEADDR).
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool held = ::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0 &&
                    ::listen(fd, 1) == 0;
  // Taken by someone else already serves as well.
  ASSERT_TRUE(held || errno == EADDRINUSE) << "port " << port;
  EXPECT_TRUE(fails_with(
      [&] { mpi_cluster_resolver({}, fake_env(mpirun(0, 3, 0, 3, job))); }, errc::invalid_argument,
      {"rank 0 cannot listen on " + one_node_chief(job), "PMIX_NAMESPACE=\"" + job + "\"",
       "OMPI_COMM_WORLD_LOCAL_SIZE = OMPI_COMM_WORLD_SIZE = 3", "ports 24576..32767",
       "Address already in use", "CONSORT_CHIEF_ADDRESS=127.0.0.1:<a free port>"}));
  // The other ranks only connect: they resolve, and fail later when no chief answers.
  EXPECT_EQ(mpi_cluster_resolver({}, fake_env(mpirun(1, 3, 1, 3, job))).chief_address(),
            one_node_chief(job));
  ::close(fd);
  // Once free, the chief resolves.
  EXPECT_EQ(mpi_cluster_resolver({}, fake_env(mpirun(0, 3, 0, 3, job))).chief_address(),
            one_node_chief(job));
}

// -- ranks on several nodes, no chief address ----------------------------------------------------

TEST(MpiClusterResolverTest, OnSeveralNodesWithoutAChiefAddressEveryRankFailsAtOnce) {
  // 4 ranks, 2 a node: no rank can know rank 0's host, rank 0 included (it would wait alone).
  for (int rank : {0, 1, 2, 3}) {
    SCOPED_TRACE(rank);
    EXPECT_TRUE(
        fails_with([&] { mpi_cluster_resolver(on_host_b, fake_env(mpirun(rank, 4, rank % 2, 2))); },
                   errc::invalid_argument,
                   {"CONSORT_CHIEF_ADDRESS is not set", "several nodes",
                    "OMPI_COMM_WORLD_LOCAL_SIZE is 2 but OMPI_COMM_WORLD_SIZE is 4",
                    "rank " + std::to_string(rank) + " included",
                    "mpirun -x CONSORT_CHIEF_ADDRESS=host0:port, with rank 0's node as host0"}));
  }
  // With the chief's address every rank resolves, keeping its host's name.
  auto env = mpirun(3, 4, 1, 2);
  env["CONSORT_CHIEF_ADDRESS"] = "head:9000";
  mpi_cluster_resolver r(on_host_b, fake_env(env));
  EXPECT_EQ(r.chief_address(), "head:9000");
  EXPECT_EQ(r.own_address(), "b:8889");
  // Given the exchange's addresses, nothing more is needed.
  EXPECT_EQ(
      mpi_cluster_resolver(on_host_b, {"a:1", "b:1", "c:1", "d:1"}, fake_env(mpirun(3, 4, 1, 2)))
          .chief_address(),
      "a:1");
}

TEST(MpiClusterResolverTest, RejectsABadLocalSize) {
  auto env = mpirun(1, 3, 1, 3);
  env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "many";
  EXPECT_TRUE(fails_with([&] { mpi_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument, {"OMPI_COMM_WORLD_LOCAL_SIZE is \"many\""}));
  EXPECT_TRUE(fails_with([] { mpi_cluster_resolver(on_host_b, fake_env(mpirun(1, 3, 1, 1))); },
                         errc::invalid_argument,
                         {"OMPI_COMM_WORLD_LOCAL_RANK is 1 but OMPI_COMM_WORLD_LOCAL_SIZE is 1"}));
  EXPECT_TRUE(fails_with([] { mpi_cluster_resolver(on_host_b, fake_env(mpirun(1, 3, 1, 4))); },
                         errc::invalid_argument,
                         {"OMPI_COMM_WORLD_LOCAL_SIZE is 4 but OMPI_COMM_WORLD_SIZE is 3"}));
}
