// torchrun and Kubeflow's PyTorchJob: rank and size from RANK and WORLD_SIZE, the chief from
// MASTER_ADDR and MASTER_PORT; the other addresses from the exchange (launcher.cpp).

#include "cluster/detail.hpp"

#include <consort/error.hpp>

#include <utility>

namespace consort {

using cluster_detail::env_value;
using cluster_detail::integer_variable;
using cluster_detail::quote;

torchrun_cluster_resolver::torchrun_cluster_resolver(launcher_options options,
                                                     const env_lookup& lookup) {
  read_environment(options, lookup);
  require_chief_address("MASTER_ADDR and MASTER_PORT, or CONSORT_CHIEF_ADDRESS");
}

torchrun_cluster_resolver::torchrun_cluster_resolver(launcher_options options,
                                                     std::vector<std::string> addresses,
                                                     const env_lookup& lookup) {
  read_environment(options, lookup);
  set_addresses(std::move(addresses));
}

void torchrun_cluster_resolver::read_environment(const launcher_options& options,
                                                 const env_lookup& lookup) {
  const std::vector<std::string> names = {
      "RANK",       "WORLD_SIZE",       "MASTER_ADDR",         "MASTER_PORT",
      "LOCAL_RANK", "LOCAL_WORLD_SIZE", chief_address_variable};
  const auto values = cluster_detail::read_variables(lookup, names);
  // CONSORT_CHIEF_ADDRESS (or a chief address given in code) stands in for MASTER_ADDR and
  // MASTER_PORT.
  const bool chief_given =
      values.count(chief_address_variable) != 0 || !options.default_chief_address.empty();
  std::vector<std::string> required = {"RANK", "WORLD_SIZE"};
  if (!chief_given)
    required.insert(required.end(), {"MASTER_ADDR", "MASTER_PORT"});
  cluster_detail::require_variables(
      "torchrun's environment", values, names, required,
      "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT together, as torchrun and Kubeflow's "
      "PyTorchJob set them (CONSORT_CHIEF_ADDRESS may stand in for MASTER_ADDR and MASTER_PORT)");

  const int rank = integer_variable("RANK", values.at("RANK"), 0, "this process's rank");
  const int size =
      integer_variable("WORLD_SIZE", values.at("WORLD_SIZE"), 1, "the number of processes");
  if (rank >= size)
    throw_error(errc::invalid_argument, "RANK is " + std::to_string(rank) + " but WORLD_SIZE is " +
                                            std::to_string(size) +
                                            "; expected a rank below the size");
  int local_rank = 0;
  if (auto it = values.find("LOCAL_RANK"); it != values.end())
    local_rank = integer_variable("LOCAL_RANK", it->second, 0, "this process's rank on its host");
  if (auto it = values.find("LOCAL_WORLD_SIZE"); it != values.end()) {
    local_world_size_ =
        integer_variable("LOCAL_WORLD_SIZE", it->second, 1, "the number of processes on this host");
    if (local_rank >= *local_world_size_)
      throw_error(errc::invalid_argument, "LOCAL_RANK is " + std::to_string(local_rank) +
                                              " but LOCAL_WORLD_SIZE is " +
                                              std::to_string(*local_world_size_) +
                                              "; expected a local rank below the local size");
    if (*local_world_size_ > size)
      throw_error(errc::invalid_argument, "LOCAL_WORLD_SIZE is " +
                                              std::to_string(*local_world_size_) +
                                              " but WORLD_SIZE is " + std::to_string(size) +
                                              "; expected at most WORLD_SIZE processes on a host");
  }

  launcher_chief chief;
  const auto addr = values.find("MASTER_ADDR");
  const auto port_text = values.find("MASTER_PORT");
  if (values.count(chief_address_variable) == 0 && addr != values.end() &&
      port_text != values.end()) {
    auto port = cluster_detail::parse_integer(port_text->second, 1, 65535);
    if (!port)
      throw_error(errc::invalid_argument, "MASTER_PORT is " + quote(port_text->second) +
                                              "; expected the port of rank 0's host, an integer "
                                              "in 1..65535");
    // torchrun says whether its agent's TCPStore already listens on MASTER_PORT on the rank-0
    // host; the chief then takes the next port.
    bool agent_store = false;
    if (auto store = env_value(lookup, agent_store_variable)) {
      if (*store == "True" || *store == "true" || *store == "1")
        agent_store = true;
      else if (*store != "False" && *store != "false" && *store != "0")
        throw_error(errc::invalid_argument, std::string(agent_store_variable) + " is " +
                                                quote(*store) +
                                                "; expected \"True\" or \"False\", as torchrun "
                                                "sets it");
    }
    if (agent_store && *port == 65535)
      throw_error(errc::invalid_argument,
                  "MASTER_PORT is 65535 and " + std::string(agent_store_variable) +
                      " is True: torchrun's agent store listens on MASTER_PORT, and the chief "
                      "would listen on MASTER_PORT + 1 = 65536; expected a MASTER_PORT below "
                      "65535, or CONSORT_CHIEF_ADDRESS");
    std::string host = addr->second;
    std::string source = "MASTER_ADDR and MASTER_PORT";
    // Kubeflow's PyTorchJob gives its master MASTER_ADDR "localhost" and the others the master's
    // service name, which is the master pod's host name: the chief uses that name, as the others
    // do (and listens where they reach it, not on the loopback).
    if (rank == 0 && host == "localhost" && size > 1 &&
        env_value(lookup, "KUBERNETES_SERVICE_HOST") && !local_world_size_ &&
        !env_value(lookup, "TORCHELASTIC_RUN_ID")) {
      host = host_of(options);
      source = "this host's name (in place of Kubeflow's MASTER_ADDR \"localhost\") and "
               "MASTER_PORT";
    } else if (host.find(':') != std::string::npos && host.front() != '[') {
      host = "[" + host + "]"; // an IPv6 literal
    }
    if (agent_store)
      source += " + 1 (TORCHELASTIC_USE_AGENT_STORE is True)";
    chief = {host + ":" + std::to_string(*port + (agent_store ? 1 : 0)), source};
  }
  place({.launcher = "torchrun",
         .resolver = "torchrun_cluster_resolver",
         .size_variable = "WORLD_SIZE",
         .rank = rank,
         .size = size,
         .local_rank = local_rank,
         .local_rank_variable = values.count("LOCAL_RANK") ? "LOCAL_RANK" : ""},
        options, lookup, chief);
}

} // namespace consort
