#pragma once

// Helpers shared by the resolvers' sources; private to cluster/ (nlohmann::json never reaches a
// public header).

#include <consort/cluster.hpp>

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <string_view>
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

} // namespace consort::cluster_detail
