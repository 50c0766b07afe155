// The launchers' common part: reading their environments (and telling a half-set one), and the
// resolver base whose ranks learn each other's addresses at the rendezvous.

#include "cluster/detail.hpp"

#include <consort/error.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <utility>

namespace consort {

namespace cluster_detail {

std::optional<std::string> env_value(const env_lookup& lookup, const std::string& name) {
  auto value = lookup(name);
  if (!value || value->empty())
    return std::nullopt;
  return value;
}

env_values read_variables(const env_lookup& lookup, const std::vector<std::string>& names) {
  env_values values;
  for (const auto& name : names)
    if (auto value = env_value(lookup, name))
      values.emplace(name, std::move(*value));
  return values;
}

std::optional<std::pair<std::string, std::string>> first_of(const env_values& values,
                                                            const std::vector<std::string>& names) {
  for (const auto& name : names)
    if (auto it = values.find(name); it != values.end())
      return *it;
  return std::nullopt;
}

std::string list_and(const std::vector<std::string>& items) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0)
      out += i + 1 == items.size() ? " and " : ", ";
    out += items[i];
  }
  return out;
}

std::string half_set_clause(const env_values& values, const std::vector<std::string>& order,
                            const std::vector<std::string>& missing) {
  constexpr std::size_t max_shown = 64;
  std::vector<std::string> set;
  for (const auto& name : order)
    if (auto it = values.find(name); it != values.end()) {
      const std::string& value = it->second;
      set.push_back(name + "=" +
                    quote(value.size() <= max_shown ? value : value.substr(0, max_shown) + "..."));
    }
  const std::string lacking =
      list_and(missing) + (missing.size() == 1 ? " is not set" : " are not set");
  if (set.empty())
    return lacking;
  return list_and(set) + (set.size() == 1 ? " is set but " : " are set but ") + lacking;
}

void require_variables(const std::string& environment, const env_values& values,
                       const std::vector<std::string>& order,
                       const std::vector<std::string>& required, const std::string& expected) {
  std::vector<std::string> missing;
  for (const auto& name : required)
    if (values.count(name) == 0)
      missing.push_back(name);
  if (missing.empty())
    return;
  throw_error(errc::invalid_argument,
              environment + " is half set: " + half_set_clause(values, order, missing) +
                  "; expected " + expected);
}

int integer_variable(const std::string& name, const std::string& value, int min,
                     const std::string& meaning) {
  auto parsed = parse_integer(value, min, INT_MAX);
  if (!parsed)
    throw_error(errc::invalid_argument, name + " is " + quote(value) + "; expected " + meaning +
                                            ", an integer >= " + std::to_string(min));
  return static_cast<int>(*parsed);
}

std::string this_host(const std::string& what) {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0')
    throw_error(errc::invalid_argument,
                "gethostname() failed; expected " + what + " to name this host");
  return name;
}

bool started_by_srun(const env_lookup& lookup, const std::string& rank,
                     const std::optional<std::string>& size, bool pmix) {
  auto procid = env_value(lookup, "SLURM_PROCID");
  auto mpi_type = env_value(lookup, "SLURM_MPI_TYPE");
  if (!procid || !mpi_type || *mpi_type == "none")
    return false;
  if (pmix && mpi_type->rfind("pmix", 0) != 0)
    return false;
  auto same = [](const std::string& a, const std::string& b) {
    auto x = parse_integer(a, 0, INT_MAX);
    auto y = parse_integer(b, 0, INT_MAX);
    return x && y && *x == *y;
  };
  if (!same(*procid, rank))
    return false;
  if (!size)
    return true;
  auto tasks = env_value(lookup, "SLURM_STEP_NUM_TASKS");
  if (!tasks)
    tasks = env_value(lookup, "SLURM_NTASKS");
  return tasks && same(*tasks, *size);
}

void reject_half_set_launchers(const env_lookup& lookup) {
  struct family {
    const char* whose;
    std::vector<std::string> partial;
    std::vector<std::string> missing;
    const char* expected;
  };
  const std::vector<family> families = {
      {"torchrun's",
       {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
       {"RANK", "WORLD_SIZE"},
       "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT together, as torchrun and Kubeflow's "
       "PyTorchJob set them"},
      {"Open MPI's",
       {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
       {"OMPI_COMM_WORLD_RANK"},
       "OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_LOCAL_RANK together, as "
       "Open MPI's mpirun sets them"},
      {"PMI's",
       {"PMI_SIZE", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"},
       {"PMI_RANK"},
       "PMI_RANK and PMI_SIZE together, as MPICH's and Intel MPI's mpiexec set them"},
      {"consort's",
       {chief_address_variable},
       {"RANK, OMPI_COMM_WORLD_RANK, PMI_RANK or PMIX_RANK"},
       "the chief's address beside the variables of a launcher, which give this process its "
       "rank"},
  };
  std::vector<std::string> clauses;
  for (const auto& f : families) {
    auto seen = read_variables(lookup, f.partial);
    if (seen.empty())
      continue;
    // The missing variables are unset here: resolve_cluster would have chosen the launcher
    // otherwise.
    clauses.push_back(half_set_clause(seen, f.partial, f.missing) + " (" + f.whose +
                      " variables; expected " + f.expected + ")");
  }
  if (clauses.empty())
    return;
  std::string text;
  for (const auto& clause : clauses)
    text += (text.empty() ? "" : "; and ") + clause;
  throw_error(errc::invalid_argument,
              "the environment is half set, so no cluster can be resolved from it: " + text +
                  ". Set the missing variables, or unset these for a local, one-worker run");
}

} // namespace cluster_detail

using cluster_detail::env_value;
using cluster_detail::is_host_port;
using cluster_detail::quote;

int one_node_chief_port(const std::string& job_id) {
  // 64-bit FNV-1a: fixed by its definition, so every rank (and every build) derives the same port.
  std::uint64_t hash = 14695981039346656037ULL;
  for (unsigned char c : job_id) {
    hash ^= c;
    hash *= 1099511628211ULL;
  }
  return one_node_chief_port_first +
         static_cast<int>(hash % static_cast<std::uint64_t>(one_node_chief_port_count));
}

namespace {

// Whether this process can bind `port` on the loopback as the chief's membership service will
// (SO_REUSEADDR); the error text when it cannot.
std::optional<std::string> cannot_bind_loopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return std::string("socket: ") + std::strerror(errno);
  const int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::optional<std::string> failure;
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0)
    failure = std::string("bind: ") + std::strerror(errno);
  ::close(fd);
  return failure;
}

} // namespace

// -- launcher_cluster_resolver --------------------------------------------------------------------

std::string launcher_cluster_resolver::host_of(const launcher_options& options) {
  std::string host =
      options.host.empty() ? cluster_detail::this_host("launcher_options::host") : options.host;
  // An IPv6 literal needs brackets before ":port".
  if (host.find(':') != std::string::npos && host.front() != '[')
    host = "[" + host + "]";
  return host;
}

void launcher_cluster_resolver::place(const placement& where, const launcher_options& options,
                                      const env_lookup& lookup,
                                      const launcher_chief& from_launcher) {
  rank_ = where.rank;
  size_ = where.size;
  local_rank_ = where.local_rank;
  local_size_ = where.local_size;
  launcher_ = where.launcher;
  resolver_ = where.resolver;
  size_variable_ = where.size_variable;
  if (options.port_base < 1 || options.port_base > 65535 || options.port_base + local_rank_ > 65535)
    throw_error(errc::invalid_argument,
                "launcher_options::port_base " + std::to_string(options.port_base) + " + " +
                    (where.local_rank_variable.empty() ? std::string("local rank")
                                                       : where.local_rank_variable) +
                    " " + std::to_string(local_rank_) +
                    " is not a port; expected a sum in 1..65535");
  if (where.local_size && *where.local_size > size_)
    throw_error(errc::invalid_argument,
                where.local_size_variable + " is " + std::to_string(*where.local_size) + " but " +
                    size_variable_ + " is " + std::to_string(size_) + "; expected at most " +
                    size_variable_ + " ranks on a node");
  rpc_layer_ = options.rpc_layer;
  derived_from_.clear();
  several_nodes_.clear();

  std::string source = chief_address_variable;
  auto chief = env_value(lookup, chief_address_variable);
  if (!chief && !from_launcher.address.empty()) {
    chief = from_launcher.address;
    source = from_launcher.source;
  }
  if (!chief && !options.default_chief_address.empty()) {
    chief = options.default_chief_address;
    source = "launcher_options::default_chief_address";
  }
  if (chief && !is_host_port(*chief))
    throw_error(errc::invalid_argument, source + " is " + quote(*chief) +
                                            "; expected the chief's \"host:port\" with a port "
                                            "in 1..65535");
  // Nothing gives the chief's address, but the launcher says where the ranks are: on one node,
  // every rank derives the same loopback address from the job's identity; on several, none can
  // know rank 0's host.
  bool on_loopback = false;
  if (!chief && size_ > 1 && where.local_size) {
    if (*where.local_size < size_) {
      several_nodes_ = where.local_size_variable + " is " + std::to_string(*where.local_size) +
                       " but " + size_variable_ + " is " + std::to_string(size_);
    } else if (!where.job_id.empty()) {
      chief = std::string(one_node_chief_host) + ":" +
              std::to_string(one_node_chief_port(where.job_id));
      derived_from_ = where.job_id_variable + "=" + quote(where.job_id) + " (every rank on one " +
                      "node: " + where.local_size_variable + " = " + size_variable_ + " = " +
                      std::to_string(size_) + ")";
      // Every rank is on this node: the workers need no other interface, and listening on the
      // loopback keeps their ports off the network.
      on_loopback = options.host.empty();
    }
  }
  own_address_ = (on_loopback ? std::string(one_node_chief_host) : host_of(options)) + ":" +
                 std::to_string(options.port_base + local_rank_);
  // Rank 0 is the chief: without a chief address, its own address is the chief's.
  chief_address_ = chief ? *chief : rank_ == 0 ? own_address_ : std::string();
}

void launcher_cluster_resolver::require_chief_address(const std::string& how_to_give_one) const {
  if (!several_nodes_.empty())
    throw_error(errc::invalid_argument,
                std::string(chief_address_variable) + " is not set and no default chief " +
                    "address was given, and the ranks are on several nodes (" + several_nodes_ +
                    "), so no rank can tell where rank 0 listens; expected rank 0's " +
                    "\"host:port\" on every rank, rank " + std::to_string(rank_) + " included (" +
                    launcher_ + ": " + how_to_give_one + ")");
  if (chief_address_.empty())
    throw_error(errc::invalid_argument,
                std::string(chief_address_variable) + " is not set and no default chief " +
                    "address was given; expected rank 0's \"host:port\" so that rank " +
                    std::to_string(rank_) + " can join the address exchange (" + launcher_ + ": " +
                    how_to_give_one + ")");
  if (rank_ == 0 && !derived_from_.empty()) {
    const auto colon = chief_address_.rfind(':');
    const int port = std::stoi(chief_address_.substr(colon + 1));
    if (auto failure = cannot_bind_loopback(port))
      throw_error(errc::invalid_argument,
                  "rank 0 cannot listen on " + chief_address_ +
                      ", the chief's address that every rank derived from " + derived_from_ +
                      " (ports " + std::to_string(one_node_chief_port_first) + ".." +
                      std::to_string(one_node_chief_port_first + one_node_chief_port_count - 1) +
                      "): " + *failure + "; expected a free port: give every rank " +
                      chief_address_variable + "=127.0.0.1:<a free port> (e.g. mpirun -x " +
                      chief_address_variable + "=127.0.0.1:<port>)");
  }
}

void launcher_cluster_resolver::set_addresses(std::vector<std::string> addresses) {
  if (static_cast<long long>(addresses.size()) != size_)
    throw_error(errc::invalid_argument, resolver_ + ": the address exchange gave " +
                                            std::to_string(addresses.size()) +
                                            " address(es); expected one per rank, " +
                                            size_variable_ + " = " + std::to_string(size_));
  for (std::size_t i = 0; i < addresses.size(); ++i)
    if (!is_host_port(addresses[i]))
      throw_error(errc::invalid_argument, resolver_ + ": the address of rank " + std::to_string(i) +
                                              " is " + quote(addresses[i]) +
                                              "; expected \"host:port\" with a port in 1..65535");
  addresses_ = std::move(addresses);
}

std::string launcher_cluster_resolver::chief_address() const {
  return has_addresses() ? addresses_.front() : chief_address_;
}

consort::cluster_spec launcher_cluster_resolver::cluster_spec() const {
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
