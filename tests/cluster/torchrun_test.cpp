#include "fake_env.hpp"

#include <consort/cluster.hpp>

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

using consort::cluster_spec;
using consort::errc;
using consort::launcher_options;
using consort::task_id;
using consort::torchrun_cluster_resolver;
using consort::test::fails_with;
using consort::test::fake_env;

namespace {

using env_map = std::map<std::string, std::string>;

// What torchrun gives a worker: rank `rank` of `size`, `local_size` a host.
env_map torchrun(int rank, int size, int local_size = 2) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(size)},
          {"LOCAL_RANK", std::to_string(rank % local_size)},
          {"LOCAL_WORLD_SIZE", std::to_string(local_size)},
          {"MASTER_ADDR", "n0"},
          {"MASTER_PORT", "29500"},
          {"TORCHELASTIC_RUN_ID", "job-1"},
          {"TORCHELASTIC_USE_AGENT_STORE", "False"}};
}

// What Kubeflow's PyTorchJob (without torchrun) gives a replica: the master is rank 0 with
// MASTER_ADDR "localhost"; the workers have the master's service name.
env_map kubeflow(int rank, int size) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(size)},
          {"MASTER_ADDR", rank == 0 ? "localhost" : "job-master-0"},
          {"MASTER_PORT", "23456"},
          {"KUBERNETES_SERVICE_HOST", "10.96.0.1"}};
}

const launcher_options on_host_b{.host = "b"};

} // namespace

TEST(TorchrunClusterResolverTest, ReadsRankWorldSizeAndLocalRank) {
  torchrun_cluster_resolver r(on_host_b, fake_env(torchrun(3, 4)));
  EXPECT_EQ(r.task(), (task_id{"worker", 3}));
  EXPECT_EQ(r.num_workers(), 4);
  EXPECT_EQ(r.worker_rank(), 3);
  EXPECT_EQ(r.local_rank(), 1);
  EXPECT_EQ(r.local_world_size(), 2);
  EXPECT_FALSE(r.is_chief());
  EXPECT_EQ(r.chief(), (task_id{"worker", 0}));
  EXPECT_EQ(r.launcher(), "torchrun");
}

TEST(TorchrunClusterResolverTest, TheChiefIsMasterAddrAtMasterPort) {
  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE(rank);
    torchrun_cluster_resolver r(on_host_b, fake_env(torchrun(rank, 4)));
    EXPECT_EQ(r.chief_address(), "n0:29500");
    EXPECT_EQ(r.is_chief(), rank == 0);
  }
}

TEST(TorchrunClusterResolverTest, BeforeTheExchangeTheClusterHoldsOnlyTheChiefAndThisProcess) {
  torchrun_cluster_resolver worker(on_host_b, fake_env(torchrun(3, 4)));
  EXPECT_FALSE(worker.has_addresses());
  EXPECT_EQ(worker.cluster_spec(), cluster_spec({{"worker", {{0, "n0:29500"}, {3, "b:8889"}}}}));
  EXPECT_EQ(consort::worker_tasks(worker),
            (std::vector<task_id>{{"worker", 0}, {"worker", 1}, {"worker", 2}, {"worker", 3}}));
  // Rank 0's entry is the chief address, where it listens.
  torchrun_cluster_resolver chief(on_host_b, fake_env(torchrun(0, 4)));
  EXPECT_EQ(chief.cluster_spec(), cluster_spec({{"worker", {{0, "n0:29500"}}}}));
  EXPECT_EQ(chief.master(), "n0:29500");
}

TEST(TorchrunClusterResolverTest, WithTheAgentStoreTheChiefTakesTheNextPort) {
  // torchrun's agent hosts its TCPStore on MASTER_PORT on the rank-0 host.
  for (const char* yes : {"True", "true", "1"}) {
    for (int rank : {0, 2}) {
      SCOPED_TRACE(std::string(yes) + " rank " + std::to_string(rank));
      auto env = torchrun(rank, 4);
      env["TORCHELASTIC_USE_AGENT_STORE"] = yes;
      EXPECT_EQ(torchrun_cluster_resolver(on_host_b, fake_env(env)).chief_address(), "n0:29501");
    }
  }
  for (const char* no : {"False", "false", "0"}) {
    SCOPED_TRACE(no);
    auto env = torchrun(1, 4);
    env["TORCHELASTIC_USE_AGENT_STORE"] = no;
    EXPECT_EQ(torchrun_cluster_resolver(on_host_b, fake_env(env)).chief_address(), "n0:29500");
  }
}

TEST(TorchrunClusterResolverTest, RejectsAnAgentStoreValueThatIsNotABoolean) {
  auto env = torchrun(1, 4);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "maybe";
  EXPECT_TRUE(fails_with([&] { torchrun_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument,
                         {"TORCHELASTIC_USE_AGENT_STORE is \"maybe\"", "\"True\" or \"False\""}));
}

TEST(TorchrunClusterResolverTest, WithTheAgentStoreAtPort65535ThereIsNoNextPort) {
  auto env = torchrun(1, 4);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["MASTER_PORT"] = "65535";
  EXPECT_TRUE(fails_with([&] { torchrun_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument,
                         {"MASTER_PORT is 65535", "65536", "CONSORT_CHIEF_ADDRESS"}));
}

TEST(TorchrunClusterResolverTest, TheChiefAddressVariableOverridesMasterAddrAndPort) {
  auto env = torchrun(2, 4);
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["CONSORT_CHIEF_ADDRESS"] = "head:9000";
  EXPECT_EQ(torchrun_cluster_resolver(on_host_b, fake_env(env)).chief_address(), "head:9000");
  // It stands in for MASTER_ADDR and MASTER_PORT, which are then not needed.
  env.erase("MASTER_ADDR");
  env.erase("MASTER_PORT");
  EXPECT_EQ(torchrun_cluster_resolver(on_host_b, fake_env(env)).chief_address(), "head:9000");
  // So does a chief address given in code.
  auto bare = torchrun(2, 4);
  bare.erase("MASTER_ADDR");
  bare.erase("MASTER_PORT");
  launcher_options with_default{.host = "b", .default_chief_address = "fallback:1"};
  EXPECT_EQ(torchrun_cluster_resolver(with_default, fake_env(bare)).chief_address(), "fallback:1");
}

TEST(TorchrunClusterResolverTest, AnIpv6MasterAddrIsBracketed) {
  auto env = torchrun(1, 2);
  env["MASTER_ADDR"] = "fd00::1";
  EXPECT_EQ(torchrun_cluster_resolver(on_host_b, fake_env(env)).chief_address(), "[fd00::1]:29500");
}

TEST(TorchrunClusterResolverTest, KubeflowsMasterNamesItselfAsTheWorkersNameIt) {
  // The master's pod is named as its service, "job-master-0", which the workers have.
  const launcher_options on_master{.host = "job-master-0"};
  torchrun_cluster_resolver master(on_master, fake_env(kubeflow(0, 3)));
  EXPECT_EQ(master.chief_address(), "job-master-0:23456");
  EXPECT_TRUE(master.is_chief());
  EXPECT_EQ(master.local_rank(), 0);
  EXPECT_EQ(master.local_world_size(), std::nullopt);
  torchrun_cluster_resolver worker(on_host_b, fake_env(kubeflow(2, 3)));
  EXPECT_EQ(worker.chief_address(), "job-master-0:23456");
  EXPECT_EQ(worker.num_workers(), 3);
}

TEST(TorchrunClusterResolverTest, LocalhostIsKeptOutsideKubeflowsPlainMaster) {
  const launcher_options on_master{.host = "job-master-0"};
  auto outside_kubernetes = kubeflow(0, 3);
  outside_kubernetes.erase("KUBERNETES_SERVICE_HOST");
  auto under_torchrun = kubeflow(0, 3);
  under_torchrun["TORCHELASTIC_RUN_ID"] = "job-1";
  auto with_local_size = kubeflow(0, 3);
  with_local_size["LOCAL_WORLD_SIZE"] = "3";
  auto alone = kubeflow(0, 1);
  for (const auto& env : {outside_kubernetes, under_torchrun, with_local_size, alone})
    EXPECT_EQ(torchrun_cluster_resolver(on_master, fake_env(env)).chief_address(),
              "localhost:23456");
}

TEST(TorchrunClusterResolverTest, HalfSetEnvironmentsNameWhatIsSetAndWhatIsMissing) {
  struct half_set {
    env_map env;
    std::vector<std::string> fragments;
  };
  const std::vector<half_set> cases = {
      {{{"RANK", "1"}},
       {"torchrun's environment is half set", "RANK=\"1\" is set",
        "WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not set", "as torchrun"}},
      {{{"WORLD_SIZE", "4"}, {"RANK", "1"}, {"MASTER_PORT", "29500"}},
       {"RANK=\"1\", WORLD_SIZE=\"4\" and MASTER_PORT=\"29500\" are set",
        "MASTER_ADDR is not set"}},
      {{{"WORLD_SIZE", "4"}},
       {"WORLD_SIZE=\"4\" is set", "RANK, MASTER_ADDR and MASTER_PORT are not set"}},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "n0"}},
       {"MASTER_ADDR=\"n0\" are set", "MASTER_PORT is not set"}},
      {{{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "n0"}, {"MASTER_PORT", "1"}, {"LOCAL_RANK", "0"}},
       {"LOCAL_RANK=\"0\" are set", "RANK is not set"}},
      // An empty value counts as unset.
      {{{"RANK", "1"}, {"WORLD_SIZE", ""}, {"MASTER_ADDR", "n0"}, {"MASTER_PORT", "1"}},
       {"WORLD_SIZE is not set"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.fragments.front());
    EXPECT_TRUE(fails_with([&] { torchrun_cluster_resolver(on_host_b, fake_env(c.env)); },
                           errc::invalid_argument, c.fragments));
  }
}

TEST(TorchrunClusterResolverTest, RejectsMalformedValuesNamingTheVariable) {
  struct bad_value {
    std::string name;
    std::string value;
    std::vector<std::string> fragments;
  };
  const std::vector<bad_value> cases = {
      {"RANK", "x", {"RANK is \"x\"", "integer >= 0"}},
      {"RANK", "-1", {"RANK is \"-1\""}},
      {"WORLD_SIZE", "0", {"WORLD_SIZE is \"0\"", ">= 1"}},
      {"LOCAL_RANK", "one", {"LOCAL_RANK is \"one\""}},
      {"LOCAL_WORLD_SIZE", "0", {"LOCAL_WORLD_SIZE is \"0\""}},
      {"MASTER_PORT", "70000", {"MASTER_PORT is \"70000\"", "1..65535"}},
      {"MASTER_PORT", "http", {"MASTER_PORT is \"http\""}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name + "=" + c.value);
    auto env = torchrun(1, 4);
    env[c.name] = c.value;
    EXPECT_TRUE(fails_with([&] { torchrun_cluster_resolver(on_host_b, fake_env(env)); },
                           errc::invalid_argument, c.fragments));
  }
}

TEST(TorchrunClusterResolverTest, RejectsRanksOutsideTheirSizes) {
  EXPECT_TRUE(fails_with([] { torchrun_cluster_resolver(on_host_b, fake_env(torchrun(4, 4))); },
                         errc::invalid_argument, {"RANK is 4", "WORLD_SIZE is 4"}));
  auto env = torchrun(1, 4);
  env["LOCAL_RANK"] = "2";
  EXPECT_TRUE(fails_with([&] { torchrun_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument, {"LOCAL_RANK is 2", "LOCAL_WORLD_SIZE is 2"}));
  env = torchrun(1, 4);
  env["LOCAL_WORLD_SIZE"] = "8";
  EXPECT_TRUE(fails_with([&] { torchrun_cluster_resolver(on_host_b, fake_env(env)); },
                         errc::invalid_argument, {"LOCAL_WORLD_SIZE is 8", "WORLD_SIZE is 4"}));
}

TEST(TorchrunClusterResolverTest, SetAddressesGivesTheWholeDenseCluster) {
  torchrun_cluster_resolver r(on_host_b, fake_env(torchrun(1, 2)));
  EXPECT_TRUE(fails_with(
      [&] { r.set_addresses({"a:1"}); }, errc::invalid_argument,
      {"torchrun_cluster_resolver: the address exchange gave 1 address(es)", "WORLD_SIZE = 2"}));
  r.set_addresses({"a:1", "b:1"});
  EXPECT_EQ(r.cluster_spec(), cluster_spec::dense({{"worker", {"a:1", "b:1"}}}));
  EXPECT_EQ(r.chief_address(), "a:1");
  torchrun_cluster_resolver given(on_host_b, {"a:1", "b:1"}, fake_env(torchrun(1, 2)));
  EXPECT_TRUE(given.has_addresses());
}
