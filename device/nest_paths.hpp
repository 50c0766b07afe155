#pragma once

// Private helpers shared by the nest and ops sources (device/) and the dataset (actors/): leaf
// paths for error messages.

#include <consort/nest.hpp>

#include <string>
#include <utility>
#include <vector>

namespace consort::detail {

/// The leaves of `value` in `flatten` order, each with its path (`["b"][1]`; empty for a nest
/// that is a single tensor).
std::vector<std::pair<std::string, tensor>> flatten_with_paths(const nest& value);

/// "leaf ["b"][1]" for a non-empty path, "the value" for the root.
std::string describe_leaf(const std::string& path);

} // namespace consort::detail
