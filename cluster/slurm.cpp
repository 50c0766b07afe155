// Slurm: hostlist expansion and the resolver over a job step's environment.

#include "cluster/detail.hpp"

#include <consort/error.hpp>

#include <climits>
#include <initializer_list>
#include <utility>

namespace consort {

using cluster_detail::env_value;
using cluster_detail::integer_variable;
using cluster_detail::join;
using cluster_detail::parse_integer;
using cluster_detail::quote;

namespace {

// Far more hosts than any Slurm allocation has; it stops "n[0-999999999]" from exhausting memory.
constexpr long long max_hosts = 1'000'000;

[[noreturn]] void bad_hostlist(const std::string& hostlist, const std::string& why) {
  throw_error(errc::invalid_argument, "invalid hostlist " + quote(hostlist) + ": " + why +
                                          "; expected hosts such as \"node[01-03,7],gpu-1\"");
}

// The values of one bracket, e.g. "01-03,7" → 01, 02, 03, 7.
std::vector<std::string> expand_ranges(const std::string& hostlist, const std::string& ranges) {
  std::vector<std::string> values;
  std::size_t start = 0;
  while (start <= ranges.size()) {
    auto comma = ranges.find(',', start);
    if (comma == std::string::npos)
      comma = ranges.size();
    const std::string range = ranges.substr(start, comma - start);
    const auto dash = range.find('-');
    const std::string lo_text = range.substr(0, dash);
    const std::string hi_text = dash == std::string::npos ? lo_text : range.substr(dash + 1);
    auto digits_only = [](const std::string& s) {
      return !s.empty() && s.size() <= 18 && s.find_first_not_of("0123456789") == std::string::npos;
    };
    if (!digits_only(lo_text) || !digits_only(hi_text))
      bad_hostlist(hostlist, "range " + quote(range) + " is not a number or \"lo-hi\"");
    const long long lo = *parse_integer(lo_text, 0, LLONG_MAX);
    const long long hi = *parse_integer(hi_text, 0, LLONG_MAX);
    if (hi < lo)
      bad_hostlist(hostlist, "range " + quote(range) + " ends below its start");
    if (hi - lo + 1 + static_cast<long long>(values.size()) > max_hosts)
      bad_hostlist(hostlist, "it expands to more than " + std::to_string(max_hosts) + " hosts");
    // Slurm pads every value to the width of the range's start: "08-10" → 08, 09, 10.
    for (long long i = lo; i <= hi; ++i) {
      std::string value = std::to_string(i);
      if (value.size() < lo_text.size())
        value.insert(0, lo_text.size() - value.size(), '0');
      values.push_back(std::move(value));
    }
    start = comma + 1;
  }
  return values;
}

// One host expression, e.g. "rack[1-2]-n[01-02]", into its hosts (leftmost bracket slowest).
void expand_host(const std::string& hostlist, const std::string& part,
                 std::vector<std::string>& hosts) {
  std::vector<std::string> expanded{""};
  std::size_t pos = 0;
  while (pos < part.size()) {
    std::vector<std::string> choices;
    if (part[pos] == '[') {
      const auto close = part.find(']', pos);
      // The splitter has already checked that brackets balance and do not nest.
      choices = expand_ranges(hostlist, part.substr(pos + 1, close - pos - 1));
      pos = close + 1;
    } else {
      const auto open = part.find('[', pos);
      const auto end = open == std::string::npos ? part.size() : open;
      choices.push_back(part.substr(pos, end - pos));
      pos = end;
    }
    if (static_cast<long long>(expanded.size() * choices.size() + hosts.size()) > max_hosts)
      bad_hostlist(hostlist, "it expands to more than " + std::to_string(max_hosts) + " hosts");
    std::vector<std::string> next;
    next.reserve(expanded.size() * choices.size());
    for (const auto& head : expanded)
      for (const auto& choice : choices)
        next.push_back(head + choice);
    expanded = std::move(next);
  }
  for (auto& host : expanded)
    hosts.push_back(std::move(host));
}

// The value of the first of `names` that is set, with its name.
std::pair<std::string, std::string> first_variable(const env_lookup& lookup,
                                                   std::initializer_list<const char*> names,
                                                   const std::string& meaning) {
  std::vector<std::string> tried;
  for (const char* name : names) {
    if (auto value = lookup(name))
      return {name, *value};
    tried.push_back(name);
  }
  throw_error(errc::invalid_argument,
              (tried.size() == 1 ? tried[0] + " is not set" : join(tried) + " are all unset") +
                  "; expected " + meaning + " (is this process running inside a Slurm step, " +
                  "started by srun?)");
}

// The ports of the tasks on a node, task k taking the k-th, from SLURM_STEP_RESV_PORTS: ranges
// "lo-hi" or single ports separated by commas, e.g. "12000-12015" or "12000,12002-12003".
std::vector<int> reserved_ports(const std::string& text) {
  auto bad = [&](const std::string& why) {
    throw_error(errc::invalid_argument,
                "SLURM_STEP_RESV_PORTS is " + quote(text) + ": " + why +
                    "; expected the step's reserved ports, e.g. \"12000-12015\"");
  };
  std::vector<int> ports;
  std::size_t start = 0;
  while (start <= text.size()) {
    auto comma = text.find(',', start);
    if (comma == std::string::npos)
      comma = text.size();
    const std::string range = text.substr(start, comma - start);
    const auto dash = range.find('-');
    auto lo = parse_integer(range.substr(0, dash), 1, 65535);
    auto hi = dash == std::string::npos ? lo : parse_integer(range.substr(dash + 1), 1, 65535);
    if (!lo || !hi)
      bad("part " + quote(range) + " is not a port in 1..65535 or a range \"lo-hi\" of them");
    if (*hi < *lo)
      bad("range " + quote(range) + " ends below its start");
    for (long long port = *lo; port <= *hi; ++port)
      ports.push_back(static_cast<int>(port));
    start = comma + 1;
  }
  return ports;
}

} // namespace

std::vector<std::string> expand_hostlist(const std::string& hostlist) {
  std::vector<std::string> hosts;
  if (hostlist.empty())
    return hosts;
  // Split at commas outside brackets; check that brackets balance and do not nest.
  std::string part;
  bool in_bracket = false;
  auto flush = [&] {
    if (part.empty())
      bad_hostlist(hostlist, "it has an empty host name (two commas in a row, or a comma at "
                             "an end)");
    expand_host(hostlist, part, hosts);
    part.clear();
  };
  for (char c : hostlist) {
    if (c == '[') {
      if (in_bracket)
        bad_hostlist(hostlist, "it has a '[' inside brackets");
      in_bracket = true;
    } else if (c == ']') {
      if (!in_bracket)
        bad_hostlist(hostlist, "it has a ']' without a '['");
      in_bracket = false;
    } else if (c == ',' && !in_bracket) {
      flush();
      continue;
    }
    part += c;
  }
  if (in_bracket)
    bad_hostlist(hostlist, "a '[' is not closed");
  flush();
  return hosts;
}

std::vector<int> expand_tasks_per_node(const std::string& tasks_per_node) {
  auto bad = [&](const std::string& why) {
    throw_error(errc::invalid_argument, "invalid tasks-per-node list " + quote(tasks_per_node) +
                                            ": " + why + "; expected counts such as \"2(x3),1\"");
  };
  constexpr long long max_count = 1'000'000;
  std::vector<int> counts;
  std::size_t start = 0;
  while (start <= tasks_per_node.size()) {
    auto comma = tasks_per_node.find(',', start);
    if (comma == std::string::npos)
      comma = tasks_per_node.size();
    const std::string item = tasks_per_node.substr(start, comma - start);
    std::string count_text = item;
    long long repeat = 1;
    if (auto open = item.find('('); open != std::string::npos) {
      // "N(xM)": N tasks on each of M nodes.
      if (item.size() < open + 4 || item.compare(open, 2, "(x") != 0 || item.back() != ')')
        bad("part " + quote(item) + " is not \"N\" or \"N(xM)\"");
      auto parsed = parse_integer(item.substr(open + 2, item.size() - open - 3), 1, max_count);
      if (!parsed || item[open + 2] == '-')
        bad("part " + quote(item) + " has a bad repeat count");
      repeat = *parsed;
      count_text = item.substr(0, open);
    }
    auto count = parse_integer(count_text, 0, max_count);
    if (!count || count_text[0] == '-')
      bad("part " + quote(item) + " is not \"N\" or \"N(xM)\"");
    if (static_cast<long long>(counts.size()) + repeat > max_hosts)
      bad("it lists more than " + std::to_string(max_hosts) + " nodes");
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), static_cast<int>(*count));
    start = comma + 1;
  }
  return counts;
}

slurm_cluster_resolver::slurm_cluster_resolver(slurm_options options, const env_lookup& lookup)
    : rpc_layer_(std::move(options.rpc_layer)) {
  const auto [rank_name, rank_text] =
      first_variable(lookup, {"SLURM_PROCID"}, "this task's rank in the step");
  rank_ = integer_variable(rank_name, rank_text, 0, "this task's rank");
  const auto [ntasks_name, ntasks_text] = first_variable(
      lookup, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}, "the number of tasks of the step");
  const int ntasks = integer_variable(ntasks_name, ntasks_text, 1, "the number of tasks");
  const auto [nodes_name, nodes_text] = first_variable(
      lookup, {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}, "the step's nodes as a hostlist");
  const auto [tpn_name, tpn_text] =
      first_variable(lookup, {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"},
                     "the number of tasks on each node, e.g. \"2(x3),1\"");

  // Name the variable in the parse errors: the helpers know only the text.
  std::vector<std::string> hosts;
  std::vector<int> counts;
  try {
    hosts = expand_hostlist(nodes_text);
  } catch (const error& e) {
    throw_error(e.code(), nodes_name + ": " + e.what());
  }
  try {
    counts = expand_tasks_per_node(tpn_text);
  } catch (const error& e) {
    throw_error(e.code(), tpn_name + ": " + e.what());
  }
  if (hosts.empty())
    throw_error(errc::invalid_argument,
                nodes_name + " is empty; expected the step's nodes, e.g. \"node[01-04]\"");
  if (hosts.size() != counts.size())
    throw_error(errc::invalid_argument,
                nodes_name + " " + quote(nodes_text) + " names " + std::to_string(hosts.size()) +
                    " node(s) but " + tpn_name + " " + quote(tpn_text) + " gives counts for " +
                    std::to_string(counts.size()) + "; expected one count per node");
  long long total = 0;
  for (int count : counts)
    total += count;
  if (total != ntasks)
    throw_error(errc::invalid_argument, tpn_name + " " + quote(tpn_text) + " adds up to " +
                                            std::to_string(total) + " task(s) but " + ntasks_name +
                                            " is " + std::to_string(ntasks) +
                                            "; expected them to agree");
  if (rank_ >= ntasks)
    throw_error(errc::invalid_argument, rank_name + " is " + std::to_string(rank_) + " but " +
                                            ntasks_name + " is " + std::to_string(ntasks) +
                                            "; expected a rank below the number of tasks");
  // The ports: from code; else CONSORT_PORT_BASE; else the ports Slurm reserved for the step
  // (srun --resv-ports), which are free on every node of the step; else TF's 8888.
  int port_base = 8888;
  std::string port_source = "the default port base";
  std::vector<int> reserved;
  if (options.port_base) {
    port_base = *options.port_base;
    port_source = "slurm_options::port_base";
    if (port_base < 1 || port_base > 65535)
      throw_error(errc::invalid_argument, "slurm_options::port_base is " +
                                              std::to_string(port_base) +
                                              "; expected a port in 1..65535");
  } else if (auto base = env_value(lookup, port_base_variable)) {
    auto parsed = parse_integer(*base, 1, 65535);
    if (!parsed)
      throw_error(errc::invalid_argument, std::string(port_base_variable) + " is " + quote(*base) +
                                              "; expected the port of the first task on each "
                                              "node, an integer in 1..65535");
    port_base = static_cast<int>(*parsed);
    port_source = port_base_variable;
  } else if (auto resv = env_value(lookup, "SLURM_STEP_RESV_PORTS")) {
    reserved = reserved_ports(*resv);
    port_source = "SLURM_STEP_RESV_PORTS " + quote(*resv);
  }

  // Block distribution: node i gets the next counts[i] ranks; the k-th task on a node listens on
  // port_base + k (or the k-th reserved port). A host named twice keeps counting from where it
  // stopped, so ports never clash.
  std::map<std::string, int> next_local;
  std::map<int, std::string> tasks;
  std::string own_host;
  int rank = 0;
  for (std::size_t node = 0; node < hosts.size(); ++node) {
    for (int k = 0; k < counts[node]; ++k, ++rank) {
      const int local = next_local[hosts[node]]++;
      if (!reserved.empty() && local >= static_cast<int>(reserved.size()))
        throw_error(errc::invalid_argument,
                    port_source + " reserves " + std::to_string(reserved.size()) +
                        " port(s) but node " + quote(hosts[node]) + " has more tasks (task " +
                        std::to_string(rank) + " is its task " + std::to_string(local + 1) +
                        "); expected a reserved port for each task on a node (srun "
                        "--resv-ports=N with N at least the tasks per node)");
      const int port =
          reserved.empty() ? port_base + local : reserved[static_cast<std::size_t>(local)];
      if (port > 65535)
        throw_error(errc::invalid_argument,
                    "task " + std::to_string(rank) + " on node " + quote(hosts[node]) +
                        " would listen on port " + std::to_string(port) + " (" + port_source + " " +
                        std::to_string(port_base) + " + " + std::to_string(local) +
                        "); expected port_base + tasks per node - 1 <= 65535");
      tasks.emplace(rank, hosts[node] + ":" + std::to_string(port));
      if (rank == rank_) {
        local_index_ = local;
        own_host = hosts[node];
      }
    }
  }
  // Slurm tells each task where it really is; a disagreement means a distribution other than
  // block (e.g. srun --distribution=cyclic), under which the addresses above would be wrong.
  if (auto localid = lookup("SLURM_LOCALID")) {
    const int actual =
        integer_variable("SLURM_LOCALID", *localid, 0, "this task's index on its node");
    if (actual != local_index_)
      throw_error(errc::invalid_argument,
                  "SLURM_LOCALID is " + std::to_string(actual) + " but block distribution puts " +
                      rank_name + " " + std::to_string(rank_) + " at index " +
                      std::to_string(local_index_) + " on its node; expected Slurm's default " +
                      "block distribution (srun --distribution=block)");
  }
  if (auto nodename = lookup("SLURMD_NODENAME"); nodename && *nodename != own_host)
    throw_error(errc::invalid_argument,
                "SLURMD_NODENAME is " + quote(*nodename) + " but block distribution puts " +
                    rank_name + " " + std::to_string(rank_) + " on " + quote(own_host) +
                    "; expected Slurm's default block distribution (srun --distribution=block)");
  spec_ = consort::cluster_spec({{"worker", std::move(tasks)}});
}

} // namespace consort
