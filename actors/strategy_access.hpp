#pragma once

// What consort::testing (the layer above) may build that users cannot: a worker of a
// multi-worker strategy over a network it provides, with no cluster resolver, membership or
// mesh (docs/testing.md).

#include <consort/strategy.hpp>
#include <consort/transport/pair.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace consort::detail {

struct strategy_access {
  /// Worker `rank` of `workers`, its replicas on `devices`, its collectives across workers over
  /// `network` (a context of `workers` ranks whose rank is `rank`). The cluster resolver is a
  /// simple one naming tasks "sim-worker-N:0". @throws error(invalid_argument) for bad options
  /// or devices.
  static std::unique_ptr<multi_worker_mirrored_strategy>
  simulated_worker(const strategy_options& opts, int rank, int workers,
                   std::vector<std::string> devices, transport::context_ptr network,
                   std::chrono::milliseconds close_timeout);

  /// Moves the clock of `s`'s step deadlines (strategy_options::step_timeout) forward by `by`.
  static void advance_step_clock(multi_worker_mirrored_strategy& s, std::chrono::nanoseconds by);
  /// `s`'s oldest running step: its number and how far ahead its deadline is (none: nullopt).
  static std::optional<std::pair<uint64_t, std::chrono::nanoseconds>>
  oldest_running_step(multi_worker_mirrored_strategy& s);
};

} // namespace consort::detail
