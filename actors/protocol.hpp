#pragma once

// The actor protocol of consort: every atom, message struct and typed handle in one place, so a
// test harness can drive the runtime message by message. Private to the library (never installed):
// it names the engine's internals (step_join, step_launcher, detail::replica_services), and no
// public header needs it; the tests include it from the source tree. Everything here is local to
// one process (messages hold shared pointers to step functions and tensor storage), so the
// structs are registered as unsafe message types rather than given serialising `inspect`
// overloads.
//
// Who talks to whom (docs/architecture.md):
//
//   caller ──run──▶ step_actor ──step──▶ replica_actor (one per device, own thread)
//      ▲                 │ watchdog tick          │  collective (blocking, with deadline)
//      │                 ▼                        ▼
//      └────────────── step_join ◀──deposit── collective_actor ◀── done (step report)
//
// A step's protocol, as states:
//   1. the strategy numbers the step (0, 1, ...), makes its step_join and sends `step` to every
//      replica; it keeps a weak reference for the step deadline;
//   2. each replica runs the step function; its k-th collective call goes to the collective
//      actor as (step, seq = k) and blocks the replica's thread until the reply or the deadline;
//   3. each replica deposits its result (or error) in the join; the last one to deposit
//      completes it: the caller's future directly, or, for a `run` request, a `done` message
//      that lets the step actor answer. The step actor is not woken on the common path, which
//      saves a thread hop per step;
//   4. a replica tells the collective actor that it finished (`done` with a step_report) when a
//      collective was used in the step, so peers waiting on a call it never made fail at once.
//      Whether one was used is settled by a handshake on the join (see step_join).
//   5. if the join is not complete at the step deadline, the strategy expires it with
//      step_timeout naming the replicas that had not finished.

#include "actors/merge_board.hpp"
#include "actors/replica_services.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/future.hpp>
#include <consort/nest.hpp>
#include <consort/per_replica.hpp>
#include <consort/reduce_op.hpp>
#include <consort/replica_context.hpp>
#include <consort/strategy.hpp>

#include <caf/actor_clock.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/fwd.hpp>
#include <caf/replies_to.hpp>
#include <caf/type_id.hpp>
#include <caf/typed_actor.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace consort {

namespace transport {
class communicator;
}

namespace detail {
class replica_queue;
struct collective_board;
} // namespace detail

/// A step number, assigned by the step_launcher in submission order from 0.
using step_id = uint64_t;

/// A step function shared by every replica of one step (never copied per replica).
using step_function_ptr = std::shared_ptr<const step_function>;

class step_join;

/// One step for one replica.
struct step_message {
  step_id step = 0;
  step_function_ptr fn;
  /// Where the replica deposits its outcome; shared by every replica of the step.
  std::shared_ptr<step_join> join;
};

/// What a replica tells the collective actor when its step function has returned or thrown.
struct step_report {
  step_id step = 0;
  /// Replica id in sync group.
  int replica = 0;
  /// How many collectives the step function called (sequence numbers 0 .. calls-1).
  uint32_t calls = 0;
  /// Empty when the step function returned normally; else why it failed.
  caf::error failure;
};

/// One collective call of one replica.
struct collective_call {
  step_id step = 0;
  /// Position of this call among the replica's collective calls in this step, from 0.
  uint32_t seq = 0;
  /// Replica id in sync group.
  int replica = 0;
  detail::collective_request request;
  /// Peers the caller saw finished in this step before any collective was used (they sent no
  /// report of their own); the collective actor treats each as a `done` report.
  std::vector<step_report> finished_peers;
  /// A GPU replica's stream and its queued work (null for a CPU replica or a harness). The
  /// replica does not wait for its stream before calling: NCCL queues the call on that stream,
  /// and a collective that takes another path calls make_ready() before reading the tensors.
  std::shared_ptr<detail::replica_queue> gpu;
};

/// A reduction of already-computed per-replica values on the host (Strategy.reduce).
struct host_reduce {
  reduce_op op = reduce_op::sum;
  std::vector<nest> components;
  std::optional<int64_t> axis;
};

/// A concatenation of per-replica values on the host (Strategy.gather).
struct host_gather {
  std::vector<nest> components;
  int64_t axis = 0;
};

/// The results of one step: one nest per local replica.
using step_results = per_replica<nest>;

/// A future state that the actors complete directly (the public API's entry).
using nest_state = std::shared_ptr<detail::shared_state<nest>>;

/// The join of one step: every replica deposits its outcome; the last deposit (or the strategy's
/// deadline, whichever comes first) completes it exactly once.
///
/// It also carries the handshake that tells a replica whether to report `done` to the collective
/// actor. A replica that finishes stores its call count in `finished_calls` and then reads
/// `collectives_used`; a replica about to make a collective call sets `collectives_used` and then
/// reads `finished_calls`. Both are sequentially consistent, so for every pair at least one side
/// sees the other: either the finished replica reports, or the caller carries the finished
/// replica's report in its call (`collective_call::finished_peers`). Steps without collectives
/// thus wake nobody but the caller.
///
/// Thread safety: thread-safe; `mtx_` guards the outcome, the atomics need no lock.
class step_join {
public:
  /// Called once with the outcome, on the thread that completes the join.
  using completion = std::function<void(step_join&)>;

  step_join(step_id step, std::vector<int> replica_ids, completion done);

  step_id step() const noexcept { return step_; }
  size_t size() const noexcept { return replica_ids_.size(); }

  /// Records local replica `index`'s result; completes the join if it was the last.
  void deposit(size_t index, nest value);
  /// Records local replica `index`'s failure; completes the join if it was the last. When
  /// several replicas fail, the join keeps the root cause (a replica's own failure before the
  /// collective errors it caused in its peers).
  void deposit(size_t index, caf::error failure);
  /// Completes the join with error(step_timeout) naming the replicas that have not deposited,
  /// unless it is already complete. Returns whether it did.
  bool expire(std::chrono::milliseconds timeout);

  bool complete() const noexcept { return complete_.load(std::memory_order_acquire); }
  /// The outcome. @pre complete()
  const caf::error& failure() const noexcept { return failure_; }
  /// Moves the results out. @pre complete() and !failure()
  step_results take_results();

  // -- the done-report handshake (see the class comment) --------------------------------------

  /// Called by a finishing replica: records that it made `calls` collectives (and `failure`)
  /// and returns whether it must report `done` itself.
  bool mark_finished(size_t index, uint32_t calls, const caf::error& failure);
  /// Called before every collective call: flags the step and returns the reports of peers that
  /// finished before the flag was up.
  std::vector<step_report> mark_collective_used();

  /// The step's merge_call rendezvous (replica_context::merge_call).
  detail::merge_board& merges() noexcept { return merges_; }

private:
  void finish_locked(std::unique_lock<std::mutex>& guard);
  /// error(structure_mismatch) naming two replicas when the results differ in structure.
  caf::error regroup_failure() const;

  step_id step_;
  std::vector<int> replica_ids_;
  completion done_;
  std::mutex mtx_;
  std::vector<nest> values_;
  std::vector<caf::error> errors_;
  std::vector<bool> deposited_;
  size_t pending_;
  caf::error failure_;
  std::atomic<bool> complete_{false};
  std::atomic<bool> collectives_used_{false};
  /// Per local replica: -1 while running, else the number of collectives it made.
  std::unique_ptr<std::atomic<int64_t>[]> finished_calls_;
  /// Per local replica: its failure, written before its `finished_calls_` entry.
  std::vector<caf::error> finish_errors_;
  detail::merge_board merges_;
};

} // namespace consort

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::step_message)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::host_reduce)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::host_gather)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::nest)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::step_results)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::step_function_ptr)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::nest_state)

CAF_BEGIN_TYPE_ID_BLOCK(consort, caf::first_custom_type_id)
CAF_ADD_TYPE_ID(consort, (consort::step_message))
CAF_ADD_TYPE_ID(consort, (consort::host_reduce))
CAF_ADD_TYPE_ID(consort, (consort::host_gather))
CAF_ADD_TYPE_ID(consort, (consort::nest))
CAF_ADD_TYPE_ID(consort, (consort::step_results))
CAF_ADD_TYPE_ID(consort, (consort::step_function_ptr))
CAF_ADD_TYPE_ID(consort, (consort::nest_state))
CAF_ADD_ATOM(consort, consort, run_atom, "run")
CAF_ADD_ATOM(consort, consort, step_atom, "step")
CAF_ADD_ATOM(consort, consort, joined_atom, "joined")
CAF_ADD_ATOM(consort, consort, deadline_atom, "deadline")
CAF_ADD_ATOM(consort, consort, reduce_atom, "reduce")
CAF_ADD_ATOM(consort, consort, gather_atom, "gather")
CAF_ADD_ATOM(consort, consort, tick_atom, "tick")
CAF_END_TYPE_ID_BLOCK(consort)

namespace consort {

/// A replica bound to exactly one device; it runs the steps it receives one at a time, in
/// arrival order, on its own thread.
using replica_actor = caf::typed_actor<
    // Runs `fn` for `step` with a replica_context and deposits the outcome in `join` (no reply):
    // the step function's result, or errc::step_failed (the function threw; the message names the
    // replica, device, step and exception text), or the collective error the function let escape
    // (collective_mismatch / collective_timeout / collective_aborted). Reports `done` to the
    // collective actor first when the step used collectives (see step_join).
    caf::reacts_to<step_atom, step_message>>;

/// The actor of a worker's collective board (actors/collective_paths.hpp): what changes over
/// time rather than with each call. The replicas match their calls on the board by direct calls,
/// on their own threads (direct_collect, direct_report, collect_alone); the actor keeps the
/// board's deadlines and runs the strategy's host reductions and gathers.
///
/// One protocol: every answer completes the future state that came with the message (the
/// caller waits on it, or a harness reads it), never a response promise, so that a result made
/// on a lane's thread goes straight to its waiter, with no hop back through the actor.
using collective_actor = caf::typed_actor<
    // Internal: the earliest pending deadline of a call may have passed (one delayed tick is
    // armed at a time, for the earliest; the arguments are unused). No reply.
    caf::reacts_to<deadline_atom, step_id, uint32_t>,
    // Strategy.reduce of host values. Answer, in `state`: the reduced nest. Errors: as ops.hpp
    // documents.
    caf::reacts_to<reduce_atom, host_reduce, nest_state>,
    // Strategy.gather of host values. Answer, in `state`: the concatenated nest.
    caf::reacts_to<gather_atom, host_gather, nest_state>>;

/// The actor of steps: runs the `run` requests of message-level harnesses (through the
/// step_launcher, which numbers steps and fans them out to every replica) and watches the step
/// deadlines of every step, however it was launched. (It was the "strategy actor" before the
/// public API launched its steps itself.)
using step_actor = caf::typed_actor<
    // Runs one step on every replica. Reply: one result per local replica, in local order.
    // Errors: the root cause among the replicas' errors (a replica's own failure is preferred over
    // the collective_aborted errors it caused in its peers); step_timeout naming the replicas that
    // did not finish within the step deadline.
    caf::replies_to<run_atom, step_function_ptr>::with<step_results>,
    // Internal: the join of a `run` request completed; answer the requester. No reply.
    caf::reacts_to<joined_atom, step_id>,
    // The step-deadline watchdog: expires overdue steps, and re-arms itself while steps are
    // running. Sent by the step_launcher when it goes from idle to busy. No reply.
    caf::reacts_to<tick_atom>>;

/// What runs one replica's steps (defined in actors/replica_actor.cpp): the replica actor runs
/// each step it receives through it; the step launcher may run a lone CPU replica's step through
/// it on the caller's thread instead (step_launcher::run_here), never while the actor runs one.
struct replica_runner;

/// Numbers steps and sends them to every replica. The step actor launches the steps of
/// `run` requests through it, and the public API launches its own directly, which saves the
/// thread hop into the scheduler on every step. Either way a step's number is
/// taken and its messages are sent under one lock, so every replica sees steps in the same order.
///
/// Thread safety: thread-safe; `mtx_` guards the step counter and the watch list.
class step_launcher {
public:
  step_launcher(caf::actor_system& sys, std::vector<replica_actor> replicas,
                std::vector<int> replica_ids, std::chrono::milliseconds step_timeout);

  /// Starts the next step; `done` runs once when its join completes (on the completing thread).
  std::shared_ptr<step_join> launch(step_function_ptr fn, step_join::completion done);

  /// Gives the launcher the runner of its lone replica, whose steps `run_here` may run on the
  /// caller's thread. Set once, before the first launch; only for one CPU replica.
  void run_here_through(std::shared_ptr<replica_runner> runner);

  /// Runs the next step on the calling thread, when a runner was given and no earlier step is
  /// still running on the replica (else returns null, and the caller launches it). `started`
  /// runs with the step's join before the step does, and `done` when its join completes. The
  /// step has a deadline as every step has, but the deadline cannot stop this thread: a step
  /// past it fails with step_timeout when its function returns. Steps launched meanwhile (from
  /// other threads) wait, in order, and go to the replica's thread once this one ends. `done`
  /// is taken only when the step runs here: a declined one keeps it for `launch`.
  std::shared_ptr<step_join> run_here(step_function_ptr fn,
                                      const std::function<void(step_join&)>& started,
                                      step_join::completion&& done);

  /// Refuses `run_here` from now on, and waits for a step running on a caller's thread to end
  /// (a replica finishes its step before it stops, however it runs). Idempotent.
  void close();

  /// Expires every step past its deadline at `now` (plus the time advanced). Returns whether
  /// steps are still running.
  bool expire_overdue(caf::actor_clock::time_point now);

  /// Moves the step deadlines' clock forward by `by` (consort::testing's simulated time), and
  /// expires what is then overdue at once.
  void advance_clock(std::chrono::nanoseconds by);
  /// The oldest running step: its number and how far ahead its deadline is (none: nullopt).
  struct running_step {
    step_id step;
    std::chrono::nanoseconds deadline_in;
  };
  std::optional<running_step> oldest_running();

  /// The actor that runs the watchdog (set once, after it is spawned).
  void watchdog(step_actor hdl);

  std::chrono::milliseconds step_timeout() const noexcept { return step_timeout_; }
  /// Time between watchdog ticks while steps run: an eighth of the step deadline, within
  /// [1 ms, 1 s]; a step fails at most one tick after its deadline.
  std::chrono::milliseconds tick_interval() const noexcept;

  /// Cleared by the watchdog when it finds nothing to watch; set again by the next launch.
  std::atomic<bool> armed{false};

private:
  /// Numbers the next step and watches its deadline; `wake` receives the watchdog when it must
  /// be re-armed. @pre mtx_ is held.
  std::shared_ptr<step_join> next_watched_locked(step_join::completion done, step_actor& wake);

  caf::actor_system& sys_;
  std::vector<replica_actor> replicas_;
  std::vector<int> replica_ids_;
  std::chrono::milliseconds step_timeout_;
  std::mutex mtx_;
  step_id next_step_ = 0;
  std::deque<std::pair<caf::actor_clock::time_point, std::weak_ptr<step_join>>> watch_;
  step_actor watchdog_;
  /// The lone replica's runner (null: run_here always declines), the steps given to it (sent to
  /// its actor, or run here), and the steps that wait for a step running here to end.
  std::shared_ptr<replica_runner> here_;
  uint64_t given_ = 0;
  bool running_here_ = false;
  bool closed_ = false;
  std::vector<step_message> waiting_;
  /// Signalled when a step run here ends (close waits for it).
  std::condition_variable here_ended_;
  /// Time advanced by advance_clock, added to the actor clock's now.
  std::atomic<int64_t> advanced_ns_{0};
};

/// How one replica actor is set up.
struct replica_config {
  int replica_id = 0;   ///< id in sync group
  int num_replicas = 1; ///< replicas in sync over all workers
  int local_index = 0;  ///< position among this worker's replicas
  std::string device;   ///< canonical device string, "CPU:0"
  /// Default deadline of a collective call (replica_context calls may override it).
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(30)};
  /// Deadline of a step; a GPU replica waits at most this long for its stream at a step's end.
  std::chrono::milliseconds step_timeout{std::chrono::minutes(10)};
  /// The state of the replica's collective actor (make_collective_board; required): a replica
  /// makes its calls and step reports there on its own thread. A board of one CPU replica
  /// completes each call on arrival (collect_alone); otherwise the last replica to arrive
  /// computes the result (or queues its NCCL call, or runs the call between the workers).
  std::shared_ptr<detail::collective_board> board;
  /// The strategy that owns the runtime (kept current when the strategy object moves): what a
  /// merge_call's function gets. Null when no strategy owns it (a harness's runtime).
  const std::atomic<strategy*>* owner = nullptr;
};

/// How the collective actor is set up.
struct collective_config {
  /// Replica ids taking part, in local order (for a single worker: 0 .. n-1; for worker w of a
  /// multi-worker group: w * n .. w * n + n - 1).
  std::vector<int> replica_ids;
  /// Replicas in sync over all workers; 0 means `replica_ids.size()` (a single worker).
  int num_replicas_in_sync = 0;
  /// Default deadline when a call carries none.
  std::chrono::milliseconds default_timeout{std::chrono::seconds(30)};
  /// With several workers: runs the cross-worker phase of every call and host reduction once
  /// the local replicas are combined. Null for a single worker.
  std::shared_ptr<transport::communicator> cross;
  /// With several workers: the NCCL unique id from the membership view, for the first
  /// communicator over every worker's GPU replicas (empty: worker 0 makes one at the first call).
  std::vector<uint8_t> nccl_unique_id;
  /// The actor's state, shared with its replicas (make_collective_board); null: the actor makes
  /// its own from this config (a harness that sends it only host reductions and gathers).
  std::shared_ptr<detail::collective_board> board;
};

/// Runs one step on the calling thread and deposits its outcome in `msg.join`, as the replica
/// actor does with the steps it receives. The runner counts the step as finished before the
/// deposit, and does not touch the runner after it.
void run_replica_step(replica_runner& runner, step_message& msg);
/// Steps the runner has finished, on any thread.
uint64_t steps_finished(const replica_runner& runner) noexcept;
/// Whether the runner's steps may run on any thread: a CPU replica's may, a GPU replica's stay on
/// the thread that keeps its device and stream current.
bool runs_on_any_thread(const replica_runner& runner) noexcept;

/// Spawns a replica actor. `detached` gives it a thread of its own (always, outside tests: a
/// step function may block and a GPU replica keeps its device current on that thread).
/// `runner`, when given, receives the runner the actor runs its steps through.
/// @throws error(invalid_argument) when `cfg.board` is null.
replica_actor spawn_replica(caf::actor_system& sys, replica_config cfg, collective_actor coll,
                            bool detached = true,
                            std::shared_ptr<replica_runner>* runner = nullptr);

/// The state of a collective actor over `cfg`, to share between the actor (collective_config::
/// board) and its replicas (replica_config::board). `cfg.board` is ignored.
std::shared_ptr<detail::collective_board> make_collective_board(collective_config cfg);

/// A replica's own collective call, on its own thread, matched on `board`; `state` completes
/// when the call does. The call that completes its slot computes the result here, on its
/// caller's thread, and answers every participant, NCCL and the cross-worker phase included (the
/// phase on the lane's turn: here at once when nothing is queued on the lane before it). `coll`
/// arms the deadline tick. (A board of one CPU replica needs no slot: collect_alone.)
void direct_collect(detail::collective_board& board, caf::actor_system& sys,
                    const collective_actor& coll, collective_call call, nest_state state);

/// A replica's step report, on its own thread: fails the calls that its peers wait for and it
/// never made.
void direct_report(detail::collective_board& board, caf::actor_system& sys,
                   const collective_actor& coll, step_report report);

/// Spawns the collective actor. Detached by default, because reductions of large tensors are
/// long computations that must not hold a scheduler thread.
collective_actor spawn_collective(caf::actor_system& sys, collective_config cfg,
                                  bool detached = true);

/// Spawns the step actor over `replicas` (local order).
step_actor spawn_step_actor(caf::actor_system& sys, std::vector<replica_actor> replicas,
                            std::chrono::milliseconds step_timeout);

/// Spawns the step actor over a launcher that the caller also uses directly.
step_actor spawn_step_actor(caf::actor_system& sys, std::shared_ptr<step_launcher> launcher);

/// Prepares an actor system config for consort: registers the "consort" error category so that
/// CAF renders our errors with their names and messages. Call before creating the system.
void configure_actor_system(caf::actor_system_config& cfg);

} // namespace consort
