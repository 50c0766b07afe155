#pragma once

// The cluster tests' injectable environment; `fails_with` comes from tests/support.

#include "support/expect_error.hpp"

#include <consort/cluster.hpp>

#include <map>
#include <optional>
#include <string>
#include <utility>

namespace consort::test {

/// An environment holding exactly `variables`; the real process environment is never read.
inline env_lookup fake_env(std::map<std::string, std::string> variables) {
  return [variables = std::move(variables)](const std::string& name) -> std::optional<std::string> {
    auto it = variables.find(name);
    if (it == variables.end())
      return std::nullopt;
    return it->second;
  };
}

} // namespace consort::test
