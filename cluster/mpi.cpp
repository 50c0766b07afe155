// Open MPI: rank, size and local rank from mpirun's environment; addresses from an exchange
// (launcher.cpp).

#include "cluster/detail.hpp"

#include <consort/error.hpp>

#include <optional>
#include <utility>

namespace consort {

using cluster_detail::integer_variable;

mpi_cluster_resolver::mpi_cluster_resolver(mpi_options options, const env_lookup& lookup) {
  read_environment(options, lookup);
  require_chief_address("mpirun -x CONSORT_CHIEF_ADDRESS=host0:port, with rank 0's node as host0 "
                        "and a port free there");
}

mpi_cluster_resolver::mpi_cluster_resolver(mpi_options options, std::vector<std::string> addresses,
                                           const env_lookup& lookup) {
  read_environment(options, lookup);
  set_addresses(std::move(addresses));
}

void mpi_cluster_resolver::read_environment(const mpi_options& options, const env_lookup& lookup) {
  const std::vector<std::string> names = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                          "OMPI_COMM_WORLD_LOCAL_RANK"};
  const auto values = cluster_detail::read_variables(lookup, names);
  cluster_detail::require_variables(
      "Open MPI's environment", values, names, names,
      "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_LOCAL_RANK together, as "
      "Open MPI's mpirun sets them (is this process running under mpirun?)");
  const int rank =
      integer_variable("OMPI_COMM_WORLD_RANK", values.at(names[0]), 0, "this process's rank");
  const int size =
      integer_variable("OMPI_COMM_WORLD_SIZE", values.at(names[1]), 1, "the number of processes");
  const int local_rank = integer_variable("OMPI_COMM_WORLD_LOCAL_RANK", values.at(names[2]), 0,
                                          "this process's rank on its node");
  if (rank >= size)
    throw_error(errc::invalid_argument, "OMPI_COMM_WORLD_RANK is " + std::to_string(rank) +
                                            " but OMPI_COMM_WORLD_SIZE is " + std::to_string(size) +
                                            "; expected a rank below the size");
  // Where the ranks are, and which job this is: mpirun sets both in every rank's environment
  // (Open MPI 4.1: PMIX_NAMESPACE and OMPI_MCA_ess_base_jobid are its job id; 5.0: PMIX_NAMESPACE
  // is "prterun-<host>-<pid>@1").
  std::optional<int> local_size;
  const auto local_size_text = cluster_detail::env_value(lookup, "OMPI_COMM_WORLD_LOCAL_SIZE");
  if (local_size_text) {
    local_size = integer_variable("OMPI_COMM_WORLD_LOCAL_SIZE", *local_size_text, 1,
                                  "the number of ranks on this node");
    if (local_rank >= *local_size)
      throw_error(errc::invalid_argument,
                  "OMPI_COMM_WORLD_LOCAL_RANK is " + std::to_string(local_rank) +
                      " but OMPI_COMM_WORLD_LOCAL_SIZE is " + std::to_string(*local_size) +
                      "; expected a local rank below the local size");
  }
  const auto job = cluster_detail::first_of(
      cluster_detail::read_variables(lookup, {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"}),
      {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"});
  place({.launcher = "Open MPI",
         .resolver = "mpi_cluster_resolver",
         .size_variable = "OMPI_COMM_WORLD_SIZE",
         .rank = rank,
         .size = size,
         .local_rank = local_rank,
         .local_rank_variable = "OMPI_COMM_WORLD_LOCAL_RANK",
         .local_size = local_size,
         .local_size_variable = "OMPI_COMM_WORLD_LOCAL_SIZE",
         .job_id = job ? job->second : std::string(),
         .job_id_variable = job ? job->first : std::string()},
        options, lookup);
}

} // namespace consort
