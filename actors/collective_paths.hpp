#pragma once

// The executors of the collective actor's complete slots, one per path: the host kernels,
// NCCL between this process's GPUs, the cross-worker phase over the transport, and the
// cross-worker phase over NCCL; and the host reductions across workers. They run where the
// matcher (actors/call_matcher.hpp) finds a slot complete or failed: in the actor's handler, or
// on the thread of the replica whose call completed it. No actor here: what they need of their
// driver is the board, whether they run on a replica's thread, and how to arm the deadline tick.

#include "actors/call_matcher.hpp"
#include "actors/flight_recorder.hpp"
#include "actors/gpu_collectives.hpp"
#include "actors/protocol.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace consort::detail {

/// The collective actor's state, shared with the replicas' own threads: a CPU replica makes its
/// call and its step report here directly (`direct_collect`, `direct_report`), and the call that
/// completes a slot computes the result on its caller's thread (the last replica to arrive),
/// with no hop through the actor. The actor runs the same code for its messages (a harness's
/// request, a GPU replica, the deadline tick, host reductions), under the same lock.
///
/// Thread safety: `mu` guards everything below it.
struct collective_board {
  std::mutex mu;
  collective_config cfg;
  /// The slots, reports and deadlines of the calls (actors/call_matcher.hpp).
  std::optional<detail::call_matcher> matcher;
  /// Host reductions and gathers run across workers so far (their position on the host lane).
  uint64_t host_ops = 0;
  /// NCCL communicators of this process's GPU replicas, made when the strategy starts
  /// (prepare_local_nccl) or else at the first call that can use them.
  std::unique_ptr<detail::local_nccl> nccl;
  /// Across workers: this worker's ranks of the communicator over every worker's GPU replicas
  /// (used on the step lane only).
  std::shared_ptr<detail::local_nccl> cross_nccl;
  /// The worker's flight recorder (actors/flight_recorder.hpp); null or off: nothing recorded.
  /// Set before the first call and never changed (read without the lock by collect_alone).
  std::shared_ptr<flight_recorder> recorder;
};

/// Who drives the matcher, with the board's lock held: the collective actor (in a handler) or a
/// replica's thread (a direct call).
struct path_driver {
  collective_board& state;
  /// Arms the collective actor's deadline tick for a deadline (one armed at a time).
  std::function<void(std::chrono::steady_clock::time_point)> arm_tick;
  /// A replica's own thread (direct_collect), not the actor: a slot it completes runs its
  /// cross-worker phase on that thread, after the board's lock is released (`deferred`).
  bool direct = false;
  std::function<void()> deferred;
};

/// Whether a call on `board` completes on arrival, with no slot to match it in: the board has
/// one replica, and it is a CPU one (`gpu` false).
bool completes_on_arrival(const collective_board& board, bool gpu);

/// The call of a board's only replica (completes_on_arrival), on the caller's thread: the
/// argument checks, then the host kernels (the only replica in sync) or the communicator's call
/// between the workers (the worker's only replica), with no future and no hop.
/// @throws error as a matched call would fail. A tensor request's tensor may be moved out of
/// `call`.
nest collect_alone(collective_board& board, collective_call& call);

/// What the matcher does with slots when `self` drives it: complete (one of the paths) or
/// failed (across workers, the others are told); arm the tick.
call_matcher::executor executor_of(path_driver* self);

/// Runs a host reduce or gather across workers on the host lane, which answers `state`.
void host_across(path_driver* self, host_reduce req, nest_state state);
void host_across(path_driver* self, host_gather req, nest_state state);

/// The GPU indices of `devices` (this process's replicas, in local order) when every one is a
/// distinct GPU, the layout whose collectives run on NCCL in this process; empty otherwise.
std::vector<int> local_nccl_gpus(const std::vector<std::string>& devices);

/// When every replica of `devices` (this process's, in local order) is a distinct GPU, builds
/// their NCCL communicators into `board` now, before the first step: at a first collective,
/// building them would wait for the replicas' streams, behind the step's own GPU work (issue
/// 13). Whether they could be built or not, returns normally: a failure here leaves the first
/// call to build them, as before, and to report why. Across workers the communicators span
/// every worker and are built by the descriptor round of the first call instead.
/// @returns whether communicators were built; when a build was tried and failed, `*why` (if
/// given) says why.
bool prepare_local_nccl(collective_board& board, const std::vector<std::string>& devices,
                        std::chrono::milliseconds timeout, std::string* why = nullptr);

} // namespace consort::detail
