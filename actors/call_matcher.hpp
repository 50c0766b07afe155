#pragma once

// The matching of the replicas' collective calls, without actors: a slot per (step, seq) that
// collects every local replica's call, checks each against the first arrival, fails the calls a
// finished replica will never make (its step report), and keeps every call's deadline. What
// happens to a slot once it is complete or has failed is the executor's: the host kernels,
// NCCL, or the cross-worker phase (actors/collective_actor.cpp). The collective actor owns one
// matcher per worker, under its board's lock; tests drive one directly with a clock of their own
// (tests/actors/call_matcher_test.cpp).
//
// Thread safety: none; the owner serialises every call (the board's mutex).

#include "actors/call_checks.hpp"
#include "actors/protocol.hpp"

#include <caf/error.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace consort::detail {

/// Where a participant's answer goes: the future state its caller waits on (a replica's thread,
/// or a harness that reads it). Empty for a call that was answered already.
struct reply_to {
  nest_state state;

  /// Whether an answer is still owed.
  bool pending() const { return state && !state->done(); }
  void deliver(const nest& value);
  void deliver(const caf::error& err);
};

/// The deadlines of the calls still pending, earliest first, with their (step, seq).
using deadline_map =
    std::multimap<std::chrono::steady_clock::time_point, std::pair<step_id, uint32_t>>;

/// One (step, seq): the arrivals so far and, once known, its failure.
struct slot {
  /// Its entry in the matcher's deadlines while it has one.
  std::optional<deadline_map::iterator> deadline;
  step_id step = 0;
  uint32_t seq = 0;
  /// With several workers: the call went to the cross-worker phase (complete, or failed here).
  bool handed_off = false;
  call_signature sig;
  std::string what; // "all_reduce(SUM) #0 of step 3"
  std::vector<std::optional<collective_call>> calls;
  std::vector<reply_to> replies;
  size_t arrived = 0;
  caf::error failure;
  std::chrono::milliseconds timeout{0};
};

class call_matcher {
public:
  using clock = std::chrono::steady_clock;

  /// What happens to slots; each is called with the owner's lock held.
  struct executor {
    /// Every local replica's call is in and they agree: answer every reply (or `fail` the
    /// slot). The matcher forgets the slot afterwards unless it failed (later arrivals of a
    /// failed slot get its error).
    std::function<void(slot&)> complete;
    /// The slot failed here (a mismatch, a bad argument, a deadline, a replica that will never
    /// call): its replies were answered with the failure. With several workers, the executor
    /// tells the others. May be empty.
    std::function<void(slot&)> failed;
    /// A tick must fire at this time (the earliest deadline; none is armed that fires by
    /// then). The owner calls `expire` when it fires.
    std::function<void(clock::time_point)> arm_tick;
  };

  /// `replica_ids` in local order; `num_in_sync` replicas over every worker (the argument
  /// checks' count, e.g. for a broadcast's root).
  call_matcher(const std::vector<int>& replica_ids, int num_in_sync,
               std::chrono::milliseconds default_timeout);

  /// Replica `call.replica`'s call; `now` starts the deadline of a slot it opens.
  void call(collective_call& call, reply_to reply, clock::time_point now, const executor& exec);
  /// A replica finished its step after `report.calls` calls: every pending or later call of
  /// that step it will never make fails now, naming it.
  void report(step_report& report, const executor& exec);
  /// The tick: every call whose deadline is at or before `now` fails with collective_timeout
  /// naming the replicas that arrived and those that did not; then the tick is armed for the
  /// next deadline.
  void expire(clock::time_point now, const executor& exec);
  /// Fails every pending reply of `s` with `err` (later arrivals get it too).
  void fail(slot& s, const caf::error& err, const executor& exec);

  /// Local position of each replica id.
  const std::unordered_map<int, size_t>& position() const noexcept { return position_; }
  /// Slots still held (pending, or failed and kept for later arrivals) over every step.
  size_t slots() const;
  /// Steps with state (some replica has not reported yet).
  size_t steps() const noexcept { return steps_.size(); }
  /// Deadlines still kept.
  size_t deadlines() const noexcept { return deadlines_.size(); }

private:
  struct step_entry {
    std::map<uint32_t, slot> slots;
    std::vector<std::optional<step_report>> reports;
    size_t reported = 0;
  };

  void drop_deadline(slot& s);
  void erase(step_id step, uint32_t seq);
  void arm(const executor& exec);
  void timed_out(step_id step, uint32_t seq, const executor& exec);
  caf::error never_called(const slot& s, uint32_t seq, const step_report& report) const;

  std::unordered_map<int, size_t> position_;
  int num_in_sync_;
  std::chrono::milliseconds default_timeout_;
  std::map<step_id, step_entry> steps_;
  deadline_map deadlines_;
  /// When the armed tick fires; max() when none is armed.
  clock::time_point armed_for_ = clock::time_point::max();
};

} // namespace consort::detail
