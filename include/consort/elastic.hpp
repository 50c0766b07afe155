#pragma once

// What an elastic training loop rolls back to (docs/multi_worker.md, "Elastic training"), as
// Horovod's `hvd.elastic.State`: the loop commits its state every few steps; when the group of
// workers changes, a call fails with error(membership_changed), the loop re-forms the group
// (`multi_worker_mirrored_strategy::reform`) and every worker takes worker 0's last commit
// (`sync`: the first worker's that is no newcomer), so that the workers that remain, and one
// that joins, go on from the same state.
//
//   consort::elastic_state state{strategy};
//   state.commit(nest::dict({{"step", tensor::scalar<int64_t>(0)}}));
//   bool synced = false;                       // a worker that joins takes the group's state
//   for (int64_t step = 0; step < steps;) {
//     try {
//       if (!synced) {
//         step = first_step(state.sync());      // the group's commit, everywhere
//         synced = true;
//       }
//       strategy.run(train_step, next_batch());
//       if (++step % commit_every == 0)
//         state.commit(nest::dict({{"step", tensor::scalar<int64_t>(step)}}));
//     } catch (const consort::error& e) {
//       if (e.code() != consort::errc::membership_changed)
//         throw;
//       strategy.reform();                     // the group's next epoch
//       synced = false;                        // a change during the sync re-forms again
//     }
//   }

#include <consort/checkpoint.hpp>
#include <consort/nest.hpp>
#include <consort/strategy.hpp>

#include <vector>

namespace consort {

/// A training loop's state kept in memory: the strategy's variables and what the loop adds
/// (its step, its place in the data). Thread safety: call from the thread that drives the
/// strategy, outside a step.
class elastic_state {
public:
  /// The state of `strategy`'s variables; nothing is committed yet.
  explicit elastic_state(multi_worker_mirrored_strategy& strategy) noexcept
      : strategy_(&strategy) {}

  /// Keeps a copy of every variable's value (`strategy::variable_values`, a collective under
  /// several workers: every worker commits at the same steps) and of `extra`. The first commit
  /// reads each variable's first local copy instead, with no collective, so that a worker joining
  /// a running group can commit before its first `sync` (which replaces the values).
  /// Every later commit is also a step boundary (`multi_worker_mirrored_strategy::step_boundary`):
  /// a task waiting to join comes in there, and the commit, once kept, throws
  /// error(membership_changed) on every worker; `reform` and `sync` then go on from it, with
  /// nothing to roll back.
  /// @throws the errors of `variable_values`; error(membership_changed) when a task joins here.
  void commit(nest extra = nest{});

  /// The `extra` of the last commit (or of the last `sync`).
  const nest& extra() const noexcept { return extra_; }

  /// Whether anything was committed.
  bool committed() const noexcept { return committed_; }

  /// Makes the group's commit everyone's: one step agrees on the first worker (by rank) whose
  /// commit is the group's state, and broadcasts its variables and extra to every worker, which
  /// assigns them to its variables and keeps them as its commit. The group's state is any
  /// commit but the fresh one of a process that joined a running group and has not synced yet
  /// (`multi_worker_mirrored_strategy::joined_running_group`): such a worker is rank 0 when the
  /// chief is lost while it joins, and its fresh variables must not replace the others'. Worker
  /// 0's when every worker is such a process. Every worker of the group calls it (after `reform`,
  /// and once at the start, where a worker that joined a running group takes the group's state).
  /// Every worker's commit must have the same variables and an `extra` of the same structure,
  /// shapes and dtypes (a joining worker commits its freshly created variables first).
  /// @returns the extra of the commit that was taken.
  /// @throws error(invalid_argument) before any commit; the errors of `strategy::run` (a commit
  ///         of another structure fails the broadcast's descriptor check on every worker;
  ///         another change of the group fails it with error(membership_changed)).
  nest sync();

private:
  multi_worker_mirrored_strategy* strategy_;
  std::vector<named_tensor> variables_;
  nest extra_;
  bool committed_ = false;
  bool fresh_ = false; // the first commit of a process that joined a running group, not synced
};

} // namespace consort
