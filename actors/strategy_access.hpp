#pragma once

// What consort::testing (the layer above) may build that users cannot: a worker of a
// multi-worker strategy over a network it provides, with no cluster resolver, membership or
// mesh (docs/testing.md).

#include <consort/strategy.hpp>
#include <consort/transport/membership.hpp>
#include <consort/transport/pair.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
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

  /// What an elastic group of simulated workers has in place of its membership service and its
  /// mesh: the harness plays the chief (consort::testing::cluster with elastic_min_workers).
  struct simulated_membership {
    /// The view after epoch `after` that names this worker (its members' ranks are their
    /// positions in it); throws error(peer_lost) when the group ended.
    std::function<transport::membership::view(uint64_t after)> next_view;
    /// This worker's context for the epoch of `v`, of `v.members.size()` ranks.
    std::function<transport::context_ptr(const transport::membership::view& v)> context;
    /// For a worker the others left out (`membership_left_out`): the view it joins again, at the
    /// members' next step boundary; throws error(peer_lost) when the group ended.
    std::function<transport::membership::view()> rejoin;
  };

  /// Worker `task` (task "worker:`task`") of an elastic group of `workers` tasks that goes on
  /// while `min_workers` remain, formed in `first` (epoch 1) over the contexts of `membership`;
  /// its calls fail with membership_changed when `membership_event` says so, and `reform` takes
  /// the next view from `membership`. A call that loses a peer waits up to `change_grace` (real
  /// time) for that verdict. @throws as `simulated_worker`.
  static std::unique_ptr<multi_worker_mirrored_strategy> simulated_elastic_worker(
      const strategy_options& opts, int task, int workers, std::vector<std::string> devices,
      int min_workers, simulated_membership membership, const transport::membership::view& first,
      std::chrono::milliseconds close_timeout, std::chrono::milliseconds change_grace,
      std::function<void(const std::string&)> log);
  /// The membership's verdict to `s`'s elastic group: it re-forms as epoch `next` (its calls in
  /// flight fail with membership_changed), or, `next` 0, it ended (peer_lost), because of
  /// `cause` ("worker:2 (rank 2): connection closed ...", which an end prefixes with "lost "
  /// when `names_a_loss`; else it says why itself: "the group of workers ended: ...").
  static void membership_event(multi_worker_mirrored_strategy& s, uint64_t next,
                               const std::string& cause, bool names_a_loss = true);
  /// The membership's word to `s`'s elastic group that the others left it out (it hung past the
  /// peer timeout; `cause` says so): its calls fail with membership_changed, and its `reform`
  /// joins the group again, as the service's lost_event::left_out does.
  static void membership_left_out(multi_worker_mirrored_strategy& s, const std::string& cause);
  /// The membership's notice to `s`'s elastic group that a task joins (`joins`: "worker:2 (rank
  /// 2) joins the group"): it re-forms as epoch `next` at its next step boundary
  /// (multi_worker_mirrored_strategy::step_boundary), as at the service's Abort.atBoundary.
  static void membership_boundary(multi_worker_mirrored_strategy& s, uint64_t next,
                                  const std::string& joins);

  /// Moves the clock of `s`'s step deadlines (strategy_options::step_timeout) forward by `by`.
  static void advance_step_clock(multi_worker_mirrored_strategy& s, std::chrono::nanoseconds by);
  /// `s`'s oldest running step: its number and how far ahead its deadline is (none: nullopt).
  static std::optional<std::pair<uint64_t, std::chrono::nanoseconds>>
  oldest_running_step(multi_worker_mirrored_strategy& s);
};

} // namespace consort::detail
