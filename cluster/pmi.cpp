// PMI (MPICH's and Intel MPI's mpiexec, Hydra) and PMIx launchers: rank and size from their
// environment; addresses from the exchange (launcher.cpp).

#include "cluster/detail.hpp"

#include <consort/error.hpp>

#include <optional>
#include <utility>

namespace consort {

using cluster_detail::first_of;
using cluster_detail::integer_variable;

namespace {

const std::vector<std::string> local_rank_variables = {"MPI_LOCALRANKID", "PMI_LOCAL_RANK"};
const std::vector<std::string> local_size_variables = {"MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"};

// Where this process is on its host.
struct local_position {
  int rank = 0;
  std::string rank_variable; // "" when none gave the rank
  std::optional<int> size;
  std::string size_variable; // "" when none gave the size
};

// The local rank from the first of `names` that is set (0 when none is) and the local size from
// the first of `size_names` that is set (none when none is), the rank checked against the size.
local_position local_position_of(const cluster_detail::env_values& values,
                                 const std::vector<std::string>& names,
                                 const std::vector<std::string>& size_names) {
  local_position where;
  auto local = first_of(values, names);
  if (local) {
    where.rank =
        integer_variable(local->first, local->second, 0, "this process's rank on its host");
    where.rank_variable = local->first;
  }
  if (auto local_size = first_of(values, size_names)) {
    where.size = integer_variable(local_size->first, local_size->second, 1,
                                  "the number of processes on this host");
    where.size_variable = local_size->first;
    if (local && where.rank >= *where.size)
      throw_error(errc::invalid_argument, local->first + " is " + std::to_string(where.rank) +
                                              " but " + local_size->first + " is " +
                                              std::to_string(*where.size) +
                                              "; expected a local rank below the local size");
  }
  return where;
}

void check_rank_below_size(const std::string& rank_name, int rank, const std::string& size_name,
                           int size) {
  if (rank >= size)
    throw_error(errc::invalid_argument, rank_name + " is " + std::to_string(rank) + " but " +
                                            size_name + " is " + std::to_string(size) +
                                            "; expected a rank below the size");
}

} // namespace

// -- pmi_cluster_resolver -------------------------------------------------------------------------

pmi_cluster_resolver::pmi_cluster_resolver(launcher_options options, const env_lookup& lookup) {
  read_environment(options, lookup);
  require_chief_address("mpiexec -genv CONSORT_CHIEF_ADDRESS host0:port, with rank 0's node as "
                        "host0 and a port free there");
}

pmi_cluster_resolver::pmi_cluster_resolver(launcher_options options,
                                           std::vector<std::string> addresses,
                                           const env_lookup& lookup) {
  read_environment(options, lookup);
  set_addresses(std::move(addresses));
}

void pmi_cluster_resolver::read_environment(const launcher_options& options,
                                            const env_lookup& lookup) {
  const std::vector<std::string> names = {"PMI_RANK",       "PMI_SIZE",        "MPI_LOCALRANKID",
                                          "PMI_LOCAL_RANK", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"};
  const auto values = cluster_detail::read_variables(lookup, names);
  cluster_detail::require_variables(
      "PMI's environment", values, names, {"PMI_RANK", "PMI_SIZE"},
      "PMI_RANK and PMI_SIZE together, as MPICH's and Intel MPI's mpiexec (Hydra) set them (is "
      "this process running under mpiexec?)");
  const int rank = integer_variable("PMI_RANK", values.at("PMI_RANK"), 0, "this process's rank");
  const int size =
      integer_variable("PMI_SIZE", values.at("PMI_SIZE"), 1, "the number of processes");
  check_rank_below_size("PMI_RANK", rank, "PMI_SIZE", size);
  const auto local = local_position_of(values, local_rank_variables, local_size_variables);
  // Hydra names no job in the environment (the KVS name travels over PMI_FD), so the local size
  // tells only when the ranks are on several nodes; no chief address is derived from it.
  place({.launcher = "PMI",
         .resolver = "pmi_cluster_resolver",
         .size_variable = "PMI_SIZE",
         .rank = rank,
         .size = size,
         .local_rank = local.rank,
         .local_rank_variable = local.rank_variable,
         .local_size = local.size,
         .local_size_variable = local.size_variable},
        options, lookup);
}

// -- pmix_cluster_resolver ------------------------------------------------------------------------

pmix_cluster_resolver::pmix_cluster_resolver(launcher_options options, const env_lookup& lookup) {
  read_environment(options, lookup);
  require_chief_address("give every process CONSORT_CHIEF_ADDRESS=host0:port, with rank 0's node "
                        "as host0 and a port free there");
}

pmix_cluster_resolver::pmix_cluster_resolver(launcher_options options,
                                             std::vector<std::string> addresses,
                                             const env_lookup& lookup) {
  read_environment(options, lookup);
  set_addresses(std::move(addresses));
}

void pmix_cluster_resolver::read_environment(const launcher_options& options,
                                             const env_lookup& lookup) {
  const std::vector<std::string> size_names = {"PMI_SIZE", "OMPI_COMM_WORLD_SIZE"};
  const std::vector<std::string> local_names = {"MPI_LOCALRANKID", "PMI_LOCAL_RANK",
                                                "OMPI_COMM_WORLD_LOCAL_RANK"};
  const std::vector<std::string> local_size_names = {"MPI_LOCALNRANKS", "PMI_LOCAL_SIZE",
                                                     "OMPI_COMM_WORLD_LOCAL_SIZE"};
  std::vector<std::string> names = {"PMIX_RANK", "PMIX_NAMESPACE"};
  names.insert(names.end(), size_names.begin(), size_names.end());
  names.insert(names.end(), local_names.begin(), local_names.end());
  names.insert(names.end(), local_size_names.begin(), local_size_names.end());
  const auto values = cluster_detail::read_variables(lookup, names);
  cluster_detail::require_variables("PMIx's environment", values, names, {"PMIX_RANK"},
                                    "PMIX_RANK, as a PMIx launcher sets it");
  const int rank = integer_variable("PMIX_RANK", values.at("PMIX_RANK"), 0, "this process's rank");
  // A PMIx server gives the size only through PMIx_Get(PMIX_JOB_SIZE): without a variable that
  // another part of the launcher sets, the size is not known, and guessing one would split the
  // job into one-worker runs.
  auto size_variable = first_of(values, size_names);
  if (!size_variable)
    throw_error(errc::invalid_argument,
                "PMIx's environment gives no size: " +
                    cluster_detail::half_set_clause(values, names,
                                                    {"PMI_SIZE or "
                                                     "OMPI_COMM_WORLD_SIZE"}) +
                    "; a PMIx server publishes the job's size only through "
                    "PMIx_Get(PMIX_JOB_SIZE), which consort does not call; expected a launcher "
                    "that also sets the size (Open MPI's mpirun, srun --mpi=pmix), PMI_SIZE set to "
                    "the number of processes on every process, or TF_CONFIG");
  const int size =
      integer_variable(size_variable->first, size_variable->second, 1, "the number of processes");
  check_rank_below_size("PMIX_RANK", rank, size_variable->first, size);
  const auto local = local_position_of(values, local_names, local_size_names);
  // PMIX_NAMESPACE names the job (the PMIx standard's namespace, alike on every rank of it).
  const auto job = values.find("PMIX_NAMESPACE");
  place({.launcher = "PMIx",
         .resolver = "pmix_cluster_resolver",
         .size_variable = size_variable->first,
         .rank = rank,
         .size = size,
         .local_rank = local.rank,
         .local_rank_variable = local.rank_variable,
         .local_size = local.size,
         .local_size_variable = local.size_variable,
         .job_id = job != values.end() ? job->second : std::string(),
         .job_id_variable = job != values.end() ? job->first : std::string()},
        options, lookup);
}

} // namespace consort
