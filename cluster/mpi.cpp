// Open MPI: rank, size and local rank from mpirun's environment; addresses from an exchange.

#include "cluster/detail.hpp"

#include <consort/error.hpp>

#include <unistd.h>

#include <climits>
#include <utility>

namespace consort {

using cluster_detail::is_host_port;
using cluster_detail::parse_integer;
using cluster_detail::quote;

namespace {

int mpi_variable(const env_lookup& lookup, const char* name, int min, const std::string& meaning) {
  auto value = lookup(name);
  if (!value)
    throw_error(errc::invalid_argument, std::string(name) + " is not set; expected " + meaning +
                                            " (is this process running under Open MPI's "
                                            "mpirun?)");
  auto parsed = parse_integer(*value, min, INT_MAX);
  if (!parsed)
    throw_error(errc::invalid_argument, std::string(name) + " is " + quote(*value) + "; expected " +
                                            meaning + ", an integer >= " + std::to_string(min));
  return static_cast<int>(*parsed);
}

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0')
    throw_error(errc::invalid_argument, "mpi_cluster_resolver: gethostname() failed; expected "
                                        "mpi_options::host to name this host");
  return name;
}

} // namespace

mpi_cluster_resolver::mpi_cluster_resolver(mpi_options options, const env_lookup& lookup) {
  read_environment(options, lookup);
  if (chief_address_.empty())
    throw_error(errc::invalid_argument,
                std::string(chief_address_variable) + " is not set and no default chief " +
                    "address was given; expected rank 0's \"host:port\" so that rank " +
                    std::to_string(rank_) + " can join the address exchange");
}

mpi_cluster_resolver::mpi_cluster_resolver(mpi_options options, std::vector<std::string> addresses,
                                           const env_lookup& lookup) {
  read_environment(options, lookup);
  set_addresses(std::move(addresses));
}

void mpi_cluster_resolver::read_environment(const mpi_options& options, const env_lookup& lookup) {
  rank_ = mpi_variable(lookup, "OMPI_COMM_WORLD_RANK", 0, "this process's rank");
  size_ = mpi_variable(lookup, "OMPI_COMM_WORLD_SIZE", 1, "the number of processes");
  local_rank_ =
      mpi_variable(lookup, "OMPI_COMM_WORLD_LOCAL_RANK", 0, "this process's rank on its node");
  if (rank_ >= size_)
    throw_error(errc::invalid_argument, "OMPI_COMM_WORLD_RANK is " + std::to_string(rank_) +
                                            " but OMPI_COMM_WORLD_SIZE is " +
                                            std::to_string(size_) +
                                            "; expected a rank below the size");
  if (options.port_base < 1 || options.port_base > 65535 || options.port_base + local_rank_ > 65535)
    throw_error(errc::invalid_argument,
                "mpi_options::port_base " + std::to_string(options.port_base) +
                    " + OMPI_COMM_WORLD_LOCAL_RANK " + std::to_string(local_rank_) +
                    " is not a port; expected a sum in 1..65535");
  rpc_layer_ = options.rpc_layer;

  std::string host = options.host.empty() ? this_host() : options.host;
  // An IPv6 literal needs brackets before ":port".
  if (host.find(':') != std::string::npos && host.front() != '[')
    host = "[" + host + "]";
  own_address_ = host + ":" + std::to_string(options.port_base + local_rank_);

  std::string source = chief_address_variable;
  auto chief = lookup(chief_address_variable);
  if (!chief || chief->empty()) {
    chief = options.default_chief_address;
    source = "mpi_options::default_chief_address";
  }
  if (!chief->empty() && !is_host_port(*chief))
    throw_error(errc::invalid_argument, source + " is " + quote(*chief) +
                                            "; expected the chief's \"host:port\" with a port "
                                            "in 1..65535");
  // Rank 0 is the chief: without a configured address, its own address is the chief's.
  chief_address_ = chief->empty() && rank_ == 0 ? own_address_ : *chief;
}

void mpi_cluster_resolver::set_addresses(std::vector<std::string> addresses) {
  if (static_cast<long long>(addresses.size()) != size_)
    throw_error(errc::invalid_argument, "mpi_cluster_resolver: the address exchange gave " +
                                            std::to_string(addresses.size()) +
                                            " address(es); expected one per rank, " +
                                            "OMPI_COMM_WORLD_SIZE = " + std::to_string(size_));
  for (std::size_t i = 0; i < addresses.size(); ++i)
    if (!is_host_port(addresses[i]))
      throw_error(errc::invalid_argument, "mpi_cluster_resolver: the address of rank " +
                                              std::to_string(i) + " is " + quote(addresses[i]) +
                                              "; expected \"host:port\" with a port in 1..65535");
  addresses_ = std::move(addresses);
}

std::string mpi_cluster_resolver::chief_address() const {
  return has_addresses() ? addresses_.front() : chief_address_;
}

consort::cluster_spec mpi_cluster_resolver::cluster_spec() const {
  std::map<int, std::string> tasks;
  if (has_addresses()) {
    for (std::size_t i = 0; i < addresses_.size(); ++i)
      tasks.emplace(static_cast<int>(i), addresses_[i]);
  } else {
    if (!chief_address_.empty())
      tasks.emplace(0, chief_address_);
    tasks.emplace(rank_, own_address_);
  }
  return consort::cluster_spec({{"worker", std::move(tasks)}});
}

} // namespace consort
