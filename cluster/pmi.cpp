// PMI (MPICH's and Intel MPI's mpiexec, Hydra) and PMIx launchers: rank and size from their
// environment; addresses from the exchange (launcher.cpp).

#include "cluster/detail.hpp"

#include <consort/error.hpp>

#include <utility>

namespace consort {

using cluster_detail::first_of;
using cluster_detail::integer_variable;

namespace {

const std::vector<std::string> local_rank_variables = {"MPI_LOCALRANKID", "PMI_LOCAL_RANK"};
const std::vector<std::string> local_size_variables = {"MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"};

// The local rank from the first of `names` that is set (0 when none is), checked against the
// local size when one of `size_names` is set. The second member names the variable ("" for none).
std::pair<int, std::string> local_rank_of(const cluster_detail::env_values& values,
                                          const std::vector<std::string>& names,
                                          const std::vector<std::string>& size_names) {
  auto local = first_of(values, names);
  if (!local)
    return {0, ""};
  const int rank =
      integer_variable(local->first, local->second, 0, "this process's rank on its host");
  if (auto local_size = first_of(values, size_names)) {
    const int size = integer_variable(local_size->first, local_size->second, 1,
                                      "the number of processes on this host");
    if (rank >= size)
      throw_error(errc::invalid_argument, local->first + " is " + std::to_string(rank) + " but " +
                                              local_size->first + " is " + std::to_string(size) +
                                              "; expected a local rank below the local size");
  }
  return {rank, local->first};
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
  require_chief_address("mpiexec -genv CONSORT_CHIEF_ADDRESS host0:8888");
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
  const auto [local_rank, local_name] =
      local_rank_of(values, local_rank_variables, local_size_variables);
  place({.launcher = "PMI",
         .resolver = "pmi_cluster_resolver",
         .size_variable = "PMI_SIZE",
         .rank = rank,
         .size = size,
         .local_rank = local_rank,
         .local_rank_variable = local_name},
        options, lookup);
}

// -- pmix_cluster_resolver ------------------------------------------------------------------------

pmix_cluster_resolver::pmix_cluster_resolver(launcher_options options, const env_lookup& lookup) {
  read_environment(options, lookup);
  require_chief_address("give every process CONSORT_CHIEF_ADDRESS=host0:8888");
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
  std::vector<std::string> names = {"PMIX_RANK", "PMIX_NAMESPACE"};
  names.insert(names.end(), size_names.begin(), size_names.end());
  names.insert(names.end(), local_names.begin(), local_names.end());
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
  const auto [local_rank, local_name] = local_rank_of(values, local_names, {});
  place({.launcher = "PMIx",
         .resolver = "pmix_cluster_resolver",
         .size_variable = size_variable->first,
         .rank = rank,
         .size = size,
         .local_rank = local_rank,
         .local_rank_variable = local_name},
        options, lookup);
}

} // namespace consort
