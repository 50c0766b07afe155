#pragma once

// The actor protocol of consort: every atom, message struct and typed handle in one place, so a
// test harness can drive the runtime message by message. Everything here is local to one process
// (messages hold shared pointers to step functions and tensor storage), so the structs are
// registered as unsafe message types rather than given serialising `inspect` overloads.
//
// Who talks to whom (DESIGN.md §3):
//
//   caller ──run──▶ strategy_actor ──step──▶ replica_actor (one per device, own thread)
//                        ▲                       │  collective (blocking, with deadline)
//                        └──── step result ──────┤
//                                                ▼
//                                       collective_actor ◀── done (step report, every replica)
//
// A step's protocol, as states:
//   1. strategy numbers the step (0, 1, ...) and sends `step` to every replica;
//   2. each replica runs the step function; its k-th collective call goes to the collective
//      actor as (step, seq = k) and blocks the replica's thread until the reply or the deadline;
//   3. each replica, when its step function returns or throws, sends `done` to the collective
//      actor (so peers waiting on a call it never made fail at once) and then replies to the
//      strategy;
//   4. the strategy delivers `per_replica<nest>` when every replica replied, or the root-cause
//      error (a replica's own failure before collective_aborted echoes of it).

#include <consort/error.hpp>
#include <consort/nest.hpp>
#include <consort/per_replica.hpp>
#include <consort/reduce_op.hpp>
#include <consort/replica_context.hpp>
#include <consort/strategy.hpp>

#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/fwd.hpp>
#include <caf/replies_to.hpp>
#include <caf/type_id.hpp>
#include <caf/typed_actor.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace consort {

/// A step number, assigned by the strategy actor in submission order from 0.
using step_id = uint64_t;

/// A step function shared by every replica of one step (never copied per replica).
using step_function_ptr = std::shared_ptr<const step_function>;

/// One step for one replica.
struct step_message {
  step_id step = 0;
  step_function_ptr fn;
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

/// Registers consort's error codes with CAF (category "consort") and converts both ways.
caf::error make_caf_error(errc code, std::string message);
/// Converts any CAF error to a consort::error: ours keep their code and message, CAF's own
/// (`sec::request_timeout`, ...) get a consort code and a message saying what timed out.
error to_consort_error(const caf::error& err, const std::string& what);

} // namespace consort

CAF_ERROR_CODE_ENUM(consort::errc, "consort")

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::step_message)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::step_report)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::collective_call)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::host_reduce)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::host_gather)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::nest)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::step_results)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::step_function_ptr)

CAF_BEGIN_TYPE_ID_BLOCK(consort, caf::first_custom_type_id)
CAF_ADD_TYPE_ID(consort, (consort::step_message))
CAF_ADD_TYPE_ID(consort, (consort::step_report))
CAF_ADD_TYPE_ID(consort, (consort::collective_call))
CAF_ADD_TYPE_ID(consort, (consort::host_reduce))
CAF_ADD_TYPE_ID(consort, (consort::host_gather))
CAF_ADD_TYPE_ID(consort, (consort::nest))
CAF_ADD_TYPE_ID(consort, (consort::step_results))
CAF_ADD_TYPE_ID(consort, (consort::step_function_ptr))
CAF_ADD_ATOM(consort, consort, run_atom, "run")
CAF_ADD_ATOM(consort, consort, step_atom, "step")
CAF_ADD_ATOM(consort, consort, done_atom, "done")
CAF_ADD_ATOM(consort, consort, collect_atom, "collective")
CAF_ADD_ATOM(consort, consort, deadline_atom, "deadline")
CAF_ADD_ATOM(consort, consort, reduce_atom, "reduce")
CAF_ADD_ATOM(consort, consort, gather_atom, "gather")
CAF_END_TYPE_ID_BLOCK(consort)

namespace consort {

/// A replica bound to exactly one device; it runs the steps it receives one at a time, in
/// arrival order, on its own thread.
using replica_actor = caf::typed_actor<
    // Runs `fn` for `step` with a replica_context, then reports `done` to the collective actor.
    // Reply: the step function's result. Errors: errc::step_failed (the function threw; message
    // names the replica, device, step and exception text), or the collective error the function
    // let escape (collective_mismatch / collective_timeout / collective_aborted).
    caf::replies_to<step_atom, step_message>::with<nest>>;

/// Matches the replicas' collective calls by (step, seq), checks that they agree, computes the
/// result once and answers every participant. Also runs host reductions for the strategy.
using collective_actor = caf::typed_actor<
    // A replica's collective call. Reply (to every participant, once all arrived): the result.
    // Errors: collective_mismatch (kind, op, axis, root, structure, dtype or shape disagree; every
    // participant, including later arrivals, gets it), collective_timeout (deadline passed; names
    // arrived and missing replicas), collective_aborted (a peer failed or finished its step
    // without this call), invalid_argument (bad axis/root, rank-0 all_gather).
    caf::replies_to<collect_atom, collective_call>::with<nest>,
    // A replica finished `step` after `calls` collectives, successfully or not. Fails pending and
    // future calls of that step that this replica will never make. No reply.
    caf::reacts_to<done_atom, step_report>,
    // Internal: the deadline of (step, seq) has passed. No reply.
    caf::reacts_to<deadline_atom, step_id, uint32_t>,
    // Strategy.reduce of host values. Reply: the reduced nest. Errors: as ops.hpp documents.
    caf::replies_to<reduce_atom, host_reduce>::with<nest>,
    // Strategy.gather of host values. Reply: the concatenated nest.
    caf::replies_to<gather_atom, host_gather>::with<nest>>;

/// Numbers steps, fans them out to every replica and collects the replies.
using strategy_actor = caf::typed_actor<
    // Runs one step on every replica. Reply: one result per local replica, in local order.
    // Errors: the root cause among the replicas' errors (a replica's own failure is preferred over
    // the collective_aborted errors it caused in its peers); step_timeout naming the replicas that
    // did not answer within the step deadline; shutdown once stopping.
    caf::replies_to<run_atom, step_function_ptr>::with<step_results>>;

/// How one replica actor is set up.
struct replica_config {
  int replica_id = 0;   ///< id in sync group
  int num_replicas = 1; ///< replicas in sync over all workers
  int local_index = 0;  ///< position among this worker's replicas
  std::string device;   ///< canonical device string, "CPU:0"
  /// Default deadline of a collective call (replica_context calls may override it).
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(30)};
};

/// How the collective actor is set up.
struct collective_config {
  /// Replica ids taking part, in local order (for a single worker: 0 .. n-1).
  std::vector<int> replica_ids;
  /// Default deadline when a call carries none.
  std::chrono::milliseconds default_timeout{std::chrono::seconds(30)};
};

/// Spawns a replica actor. `detached` gives it a thread of its own (always, outside tests: a
/// step function may block and a GPU replica keeps its device current on that thread).
replica_actor spawn_replica(caf::actor_system& sys, replica_config cfg, collective_actor coll,
                            bool detached = true);

/// Spawns the collective actor. Detached by default, because reductions of large tensors are
/// long computations that must not hold a scheduler thread.
collective_actor spawn_collective(caf::actor_system& sys, collective_config cfg,
                                  bool detached = true);

/// Spawns the strategy actor over `replicas` (local order).
strategy_actor spawn_strategy(caf::actor_system& sys, std::vector<replica_actor> replicas,
                              std::chrono::milliseconds step_timeout);

/// Prepares an actor system config for consort: registers the "consort" error category so that
/// CAF renders our errors with their names and messages. Call before creating the system.
void configure_actor_system(caf::actor_system_config& cfg);

} // namespace consort
