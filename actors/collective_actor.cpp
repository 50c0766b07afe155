// The collective actor: matches the replicas' collective calls by (step, seq), validates that
// they agree, computes each result once and answers every participant (docs/architecture.md).
//
// Three parts: the matching itself (slots, the checks against the first arrival, step reports,
// deadlines) is actors/call_matcher.cpp; the executors of a complete slot (the host kernels,
// in-process NCCL, the communicator's call between workers, over the transport or NCCL) are
// actors/collective_paths.cpp; neither knows an actor. This file wires them: the board's entry
// points for the replicas (direct_collect, direct_report, collect_alone) and the actor, which
// arms the deadline tick and runs the strategy's host reductions and gathers.
//
// The board (collective_board) is shared by the actor and its replicas, under a mutex: a replica
// makes its call there on its own thread, and the call that completes a slot computes the result
// on its caller's thread and answers the others, so an in-process collective costs one wake-up
// per waiting replica and no hop through the actor. A board of one CPU replica has nothing to
// match: its call completes on arrival (collect_alone). Every answer completes the caller's
// future state, on whichever thread made the result.

#include "actors/call_checks.hpp"
#include "actors/collective_paths.hpp"
#include "actors/cross_phase.hpp"
#include "actors/protocol.hpp"
#include "transport/communicator.hpp"

#include <consort/ops.hpp>

#include <caf/all.hpp>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace consort {

namespace {

using namespace std::chrono;
using detail::check_arguments;
using detail::collective_board;
using detail::reply_to;

} // namespace

struct collective_state {
  std::shared_ptr<collective_board> board;
  static inline const char* name = "consort.collective";
};

namespace {

/// A driver of the board for the actor's clock and handle: the matcher's deadlines run on the
/// system's clock (the test scheduler's is virtual), and the tick is a delayed message to the
/// actor. One delayed message is armed at a time, for the earliest deadline: a delayed message
/// per call would stay in CAF's clock for the whole timeout (30 s) after its call completed,
/// which the soak measured as memory growing with the call rate (bench/README.md, "soak").
/// `sys` and `me` outlive the driver (it lives for one call or handler); the tick captures them
/// by address, so that building it allocates nothing.
detail::path_driver driver_for(collective_board& board, caf::actor_system& sys,
                               const collective_actor& me) {
  detail::path_driver d{board, {}, false, {}};
  d.arm_tick = [&sys, &me](steady_clock::time_point first) {
    // Rounded up, so that the tick never fires before the deadline it was armed for.
    auto delay = ceil<milliseconds>(std::max(first - sys.clock().now(), steady_clock::duration{0}));
    caf::delayed_anon_send(me, delay, deadline_atom_v, step_id{0}, uint32_t{0});
  };
  return d;
}

void on_call(detail::path_driver& d, caf::actor_system& sys, collective_call& call,
             reply_to reply) {
  d.state.matcher->call(call, std::move(reply), sys.clock().now(), detail::executor_of(&d));
}

void on_report(detail::path_driver& d, step_report& report) {
  d.state.matcher->report(report, detail::executor_of(&d));
}

/// The deadline tick: every call whose deadline has passed times out, then the tick is armed
/// for the next.
void on_deadline_tick(detail::path_driver& d, caf::actor_system& sys) {
  d.state.matcher->expire(sys.clock().now(), detail::executor_of(&d));
}

} // namespace

bool detail::completes_on_arrival(const collective_board& board, bool gpu) {
  // A lone GPU replica keeps its one-rank NCCL communicator (through a slot, on its own thread):
  // that is the GPU path a single-GPU machine can test.
  return board.cfg.replica_ids.size() == 1 && !gpu;
}

nest detail::collect_alone(collective_board& board, collective_call& call) {
  if (board.cfg.cross)
    return alone_on_worker(*board.cfg.cross, call, board.cfg.num_replicas_in_sync,
                           board.recorder.get());
  auto leaves = flatten(call.request.value);
  int64_t axis = call.request.axis;
  auto problem = check_arguments(call, leaves, 1, &axis);
  if (!problem.empty())
    throw error(errc::invalid_argument, problem);
  auto sig = detail::signature_from(call, leaves);
  sig.axis = axis;
  auto* recorder = board.recorder.get();
  if (recorder == nullptr || !recorder->enabled())
    return detail::compute(sig, {std::move(leaves)}, call.request.value);
  auto h = recorder->collective(call.step, call.seq, call.replica, detail::flight_signature_of(sig),
                                detail::flight_state::waiting, {});
  try {
    auto out = detail::compute(sig, {std::move(leaves)}, call.request.value);
    recorder->ended(h, errc::none);
    return out;
  } catch (const error& e) {
    recorder->ended(h, e.code());
    throw;
  } catch (...) {
    recorder->ended(h, errc::invalid_argument);
    throw;
  }
}

std::shared_ptr<detail::collective_board> make_collective_board(collective_config cfg) {
  auto board = std::make_shared<collective_board>();
  board->matcher.emplace(cfg.replica_ids, cfg.num_replicas_in_sync, cfg.default_timeout);
  board->cfg = std::move(cfg);
  return board;
}

void direct_collect(collective_board& board, caf::actor_system& sys, const collective_actor& coll,
                    collective_call call, nest_state state) {
  auto d = driver_for(board, sys, coll);
  d.direct = true;
  {
    std::lock_guard<std::mutex> lock{board.mu};
    reply_to reply;
    reply.state = std::move(state);
    on_call(d, sys, call, std::move(reply));
  }
  // This call completed a slot that goes across workers: its phase runs here, on the lane's
  // turn (at once when nothing is queued on it before).
  if (d.deferred)
    board.cfg.cross->run_or_post(transport::communicator::lane::step, std::move(d.deferred));
}

void direct_report(collective_board& board, caf::actor_system& sys, const collective_actor& coll,
                   step_report report) {
  std::lock_guard<std::mutex> lock{board.mu};
  auto d = driver_for(board, sys, coll);
  on_report(d, report);
}

collective_actor spawn_collective(caf::actor_system& sys, collective_config cfg, bool detached) {
  auto board = cfg.board ? cfg.board : make_collective_board(cfg);
  auto impl = [board](collective_actor::stateful_pointer<collective_state> self)
      -> collective_actor::behavior_type {
    self->state.board = board;
    // Runs `fn(driver&)` as this actor, with the board's lock held.
    auto as_actor = [self](auto&& fn) {
      auto& b = *self->state.board;
      std::lock_guard<std::mutex> lock{b.mu};
      auto me = caf::actor_cast<collective_actor>(self);
      auto d = driver_for(b, self->system(), me);
      return fn(d);
    };
    auto& sys = self->system();
    auto crossing = [self] {
      return self->state.board->cfg.cross != nullptr;
    };
    return {
        [as_actor, &sys](deadline_atom, step_id, uint32_t) {
          as_actor([&](detail::path_driver& d) { on_deadline_tick(d, sys); });
        },
        [as_actor, crossing](reduce_atom, host_reduce& req, nest_state& state) {
          if (crossing()) {
            as_actor([&](detail::path_driver& d) {
              detail::host_across(&d, std::move(req), std::move(state));
            });
            return;
          }
          try {
            state->set_value(reduce_components(req.op, req.components, req.axis));
          } catch (...) {
            state->set_error(std::current_exception());
          }
        },
        [as_actor, crossing](gather_atom, host_gather& req, nest_state& state) {
          if (crossing()) {
            as_actor([&](detail::path_driver& d) {
              detail::host_across(&d, std::move(req), std::move(state));
            });
            return;
          }
          try {
            state->set_value(concat_components(req.components, req.axis));
          } catch (...) {
            state->set_error(std::current_exception());
          }
        },
    };
  };
  if (detached)
    return sys.spawn<caf::detached>(impl);
  return sys.spawn(impl);
}

} // namespace consort
