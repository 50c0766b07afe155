#pragma once

// The engine behind a strategy: one CAF actor system with its replica, collective and strategy
// actors. Private to the library (and its tests); users see consort::strategy.

#include <consort/future.hpp>
#include <consort/nest.hpp>
#include <consort/per_replica.hpp>
#include <consort/reduce_op.hpp>
#include <consort/strategy.hpp>

#include <caf/fwd.hpp>

#include <cstdint>
#include <functional>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace consort::transport {
class communicator;
}

namespace consort::detail {

class flight_recorder;

/// What a runtime needs to be one worker of several (multi_worker_mirrored_strategy).
struct multi_worker_setup {
  /// This worker's rank (the chief is 0) and the number of workers; every worker has the same
  /// number of replicas, so replica ids run from `worker_rank * devices` on.
  int worker_rank = 0;
  int num_workers = 1;
  /// The cross-worker phase of collectives (null with one worker).
  std::shared_ptr<transport::communicator> cross;
  /// The NCCL unique id that the chief put in the membership view (empty when the chief has no
  /// GPU replicas): the id of the first communicator over every worker's GPU replicas.
  std::vector<uint8_t> nccl_unique_id;
  /// Runs at shutdown once the cross-worker lanes have stopped (`closed`: the error of their
  /// clean close, if any): leaves the cluster.
  std::function<void(const caf::error& closed)> on_shutdown;
  /// The membership epoch of the group (1: the first rendezvous), and whether this worker joined
  /// a group that was running already (an elastic group's later epoch).
  uint64_t epoch = 1;
  bool joined_running_group = false;
  /// Whether the group is elastic (multi_worker_options::elastic_min_workers): a change of the
  /// group fails calls with membership_changed, and the training loop re-forms it.
  bool elastic = false;
  /// The worker's flight recorder when the caller made it (to record membership events); null:
  /// the runtime makes one from the strategy's options.
  std::shared_ptr<flight_recorder> recorder;
  /// The chief's wall clock against this worker's (the membership's heartbeats); empty: the
  /// chief's own, or one worker.
  std::function<clock_offset()> chief_clock;
};

/// Checks a device list and returns it in canonical spelling ("cpu:0" -> "CPU:0").
/// @throws error(invalid_argument | unknown_device | unsupported).
std::vector<std::string> canonical_devices(const std::vector<std::string>& devices);

/// Returns `opts` after checking its timeouts. @throws error(invalid_argument).
const strategy_options& validated(const strategy_options& opts);

/// Owns an actor system and the actors of one strategy.
///
/// Thread safety: thread-safe; every call only sends messages, except `shutdown`, which waits
/// for the actors to stop (so it must not be called from a step function).
class runtime {
public:
  /// Spawns one replica actor per device (canonical device strings, local order).
  runtime(std::vector<std::string> devices, strategy_options opts, multi_worker_setup mw = {});
  ~runtime();

  runtime(const runtime&) = delete;
  runtime& operator=(const runtime&) = delete;

  /// Runs `fn` as the next step on every replica.
  future<per_replica<nest>> submit(step_function fn);
  /// `submit(fn).get()`, except that a lone CPU replica that is idle runs the step on the calling
  /// thread (strategy_options::run_on_caller_thread). @throws consort::error as `get` does.
  per_replica<nest> run(step_function fn);

  /// Strategy.reduce of host values, computed on the collective actor.
  future<nest> reduce(reduce_op op, std::vector<nest> components, std::optional<int64_t> axis);

  /// Strategy.gather of host values, computed on the collective actor.
  future<nest> gather(std::vector<nest> components, int64_t axis);

  /// Stops accepting work, fails every outstanding future with error(shutdown), stops the actors
  /// after their current step, and waits for them. Idempotent.
  void shutdown();

  const std::vector<std::string>& devices() const noexcept;
  /// Replicas over all workers.
  int num_replicas_in_sync() const noexcept;
  /// The replica id (in sync group) of this worker's first replica.
  int first_replica_id() const noexcept;
  /// Moves the step deadlines' clock forward (consort::testing's simulated time).
  void advance_step_clock(std::chrono::nanoseconds by);
  /// The oldest running step: its number and how far ahead its deadline is (none: nullopt).
  std::optional<std::pair<uint64_t, std::chrono::nanoseconds>> oldest_running_step() const;

  /// This worker's rank and the number of workers.
  int worker_rank() const noexcept;
  int num_workers() const noexcept;
  uint64_t membership_epoch() const noexcept;
  bool joined_running_group() const noexcept;
  bool elastic() const noexcept;
  const strategy_options& options() const noexcept;

  /// The strategy object that owns this runtime, given to merge_call's functions; the strategy
  /// sets it when it is built and when it moves.
  void set_owner(strategy* owner) noexcept;

  /// The worker's flight recorder (never null; maybe off).
  flight_recorder& recorder() const noexcept;
  /// multi_worker_setup::chief_clock, or known and 0.
  clock_offset chief_clock_offset() const;

  /// The actor system, for tests that speak the actor protocol next to a running strategy.
  caf::actor_system& system() noexcept;

private:
  future<per_replica<nest>> start(step_function fn, bool may_run_here);

  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace consort::detail
