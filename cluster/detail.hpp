#pragma once

// Helpers shared by the resolvers' sources; private to cluster/ (nlohmann::json never reaches a
// public header).

#include <consort/cluster.hpp>

#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace consort::cluster_detail {

/// `text` in double quotes, as messages quote user input.
std::string quote(std::string_view text);

/// `items` joined by ", ".
std::string join(const std::vector<std::string>& items);

/// The indices joined by ", ".
std::string join(const std::vector<int>& items);

/// A JSON value as a message shows it: its type and, when short, its text ("number 3",
/// "array [1,2]").
std::string describe(const nlohmann::json& value);

/// Parses `text` as JSON. On failure throws error(invalid_argument) "<what> is not valid JSON:
/// <parser message with line, column and byte>; expected <expected>".
nlohmann::json parse_json(const std::string& text, std::string_view what,
                          std::string_view expected);

/// Builds a cluster from the JSON value of TF's "cluster" key. `where` prefixes every message
/// (e.g. "TF_CONFIG: \"cluster\"").
cluster_spec cluster_from_json(const nlohmann::json& value, std::string_view where);

/// The cluster in TF's JSON form (see `cluster_spec::to_json`).
nlohmann::json cluster_to_json(const cluster_spec& spec);

/// Parses a whole decimal integer in [min, max] ("-3", "42"; no sign "+", no spaces, no
/// fraction). `std::nullopt` when `text` is not one.
std::optional<long long> parse_integer(std::string_view text, long long min, long long max);

/// True when `address` is "host:port" with a non-empty host and a port in 1..65535.
bool is_host_port(std::string_view address);

// -- launcher environments (launcher.cpp) ---------------------------------------------------------

/// The value of the variable `name` when it is set and not empty (an empty value counts as unset,
/// as `resolve_cluster` counts it).
std::optional<std::string> env_value(const env_lookup& lookup, const std::string& name);

/// Variable name → value, for the variables of a list that are set (and not empty).
using env_values = std::map<std::string, std::string>;

/// The variables of `names` that are set (`env_value`).
env_values read_variables(const env_lookup& lookup, const std::vector<std::string>& names);

/// The first of `names` that is in `values`, with its value; none when none is.
std::optional<std::pair<std::string, std::string>> first_of(const env_values& values,
                                                            const std::vector<std::string>& names);

/// "A", "A and B", "A, B and C".
std::string list_and(const std::vector<std::string>& items);

/// What a half-set environment has and lacks: A="1" and B="2" are set but C is not set
/// (the names of `order` that are in `values`, with their values cut to 64 characters; then
/// `missing`). With nothing set: "C and D are not set".
std::string half_set_clause(const env_values& values, const std::vector<std::string>& order,
                            const std::vector<std::string>& missing);

/// Throws error(invalid_argument) "<environment> is half set: <half_set_clause>; expected
/// <expected>" when a name of `required` is not in `values`.
void require_variables(const std::string& environment, const env_values& values,
                       const std::vector<std::string>& order,
                       const std::vector<std::string>& required, const std::string& expected);

/// `value` of the variable `name` as an integer >= min; else throws error(invalid_argument)
/// "<name> is "<value>"; expected <meaning>, an integer >= <min>".
int integer_variable(const std::string& name, const std::string& value, int min,
                     const std::string& meaning);

/// This machine's host name (`gethostname`).
/// @throws error(invalid_argument) when it has none, saying to set `what` instead.
std::string this_host(const std::string& what);

/// True when `srun` itself started this process through its MPI plugin, so that Slurm's variables
/// describe the same step as the PMI or PMIx variables: SLURM_MPI_TYPE is set and not "none"
/// ("pmix..." when `pmix`), SLURM_PROCID equals `rank`, and, when `size` is given, the step's
/// number of tasks (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS) equals it.
bool started_by_srun(const env_lookup& lookup, const std::string& rank,
                     const std::optional<std::string>& size, bool pmix);

/// The check `resolve_cluster` makes before it falls back to a local run: no launcher's variables
/// may be set without the one that identifies the process (MASTER_ADDR, MASTER_PORT, LOCAL_RANK
/// or LOCAL_WORLD_SIZE without RANK and WORLD_SIZE; OMPI_COMM_WORLD_SIZE or _LOCAL_RANK without
/// OMPI_COMM_WORLD_RANK; PMI_SIZE, MPI_LOCALRANKID or PMI_LOCAL_RANK without PMI_RANK;
/// CONSORT_CHIEF_ADDRESS without any launcher).
/// @throws error(invalid_argument) naming, for each such launcher, what is set and what is missing.
void reject_half_set_launchers(const env_lookup& lookup);

} // namespace consort::cluster_detail
