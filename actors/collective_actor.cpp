// The collective actor: matches the replicas' collective calls by (step, seq), validates that
// they agree, computes each result once and answers every participant (DESIGN.md §3).
//
// Three parts: the matching itself (slots, the checks against the first arrival, step reports,
// deadlines) is actors/call_matcher.cpp, which knows no actor; the executors of a complete slot
// are here, one per path (the host kernels, in-process NCCL, the cross-worker phase over the
// transport, the cross-worker phase over NCCL); and the actor that wires them: it owns the
// matcher and the NCCL communicators, arms the deadline tick and answers requests.
//
// Its state (collective_board) is shared with its CPU replicas, under a mutex: a replica makes
// its call there on its own thread (direct_collect), and the call that completes a slot computes
// the result on its caller's thread and answers the others, so an in-process collective costs
// one wake-up per waiting replica and no hop through the actor. The actor runs the same code for
// what still arrives as messages: a harness's requests, GPU replicas (whose NCCL communicators
// it owns), the deadline tick and host reductions. Every answer completes the caller's future
// state, on whichever thread made the result.

#include "actors/call_checks.hpp"
#include "actors/call_matcher.hpp"
#include "actors/cross_phase.hpp"
#include "actors/cross_worker.hpp"
#include "actors/gpu_collectives.hpp"
#include "device/gpu.hpp"

#include "actors/protocol.hpp"
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
using detail::call_signature;
using detail::check_against;
using detail::check_arguments;
using detail::cross_gather;
using detail::cross_reduce;
using detail::describe_call;
using detail::error_of;
using detail::join_ids;
using detail::local_part;

using detail::reply_to;
using detail::slot;
using matcher_executor = detail::call_matcher::executor;

} // namespace

/// The collective actor's state, shared with the replicas' own threads: a CPU replica makes its
/// call and its step report here directly (`direct_collect`, `direct_report`), and the call that
/// completes a slot computes the result on its caller's thread (the last replica to arrive),
/// with no hop through the actor. The actor runs the same code for its messages (a harness's
/// request, a GPU replica, the deadline tick, host reductions), under the same lock.
///
/// Thread safety: `mu` guards everything below it.
namespace detail {
struct collective_board {
  std::mutex mu;
  collective_config cfg;
  /// The slots, reports and deadlines of the calls (actors/call_matcher.hpp).
  std::optional<detail::call_matcher> matcher;
  /// Host reductions and gathers run across workers so far (their position on the host lane).
  uint64_t host_ops = 0;
  /// NCCL communicators of this process's GPU replicas, made at the first call that can use them.
  std::unique_ptr<detail::local_nccl> nccl;
  /// Across workers: this worker's ranks of the communicator over every worker's GPU replicas
  /// (used on the step lane only).
  std::shared_ptr<detail::local_nccl> cross_nccl;
};
} // namespace detail

using detail::collective_board;

struct collective_state {
  std::shared_ptr<collective_board> board;
  static inline const char* name = "consort.collective";
};

namespace {

/// Who runs the matching: the actor (in a handler) or a replica's thread (a direct call), with
/// the board's lock held. It offers what the code below needs of an actor: the state, the clock
/// (the system's: the test scheduler's is virtual), and the actor's handle for the deadline tick.
struct driver {
  collective_board& state;
  caf::actor_system& sys;
  collective_actor me;
  /// A replica's own thread (direct_collect), not the actor: a slot it completes runs its
  /// cross-worker phase on that thread, after the board's lock is released (`deferred`).
  bool direct = false;
  std::function<void()> deferred;

  caf::actor_clock& clock() const { return sys.clock(); }
  caf::actor_system& system() const { return sys; }
};

using self_ptr = driver*;

void hand_off_failure(self_ptr self, slot& s);

matcher_executor executor_of(self_ptr self);

/// Fails every pending reply of `s` with `err` (later arrivals get it too).
void fail_slot(self_ptr self, slot& s, const caf::error& err) {
  self->state.matcher->fail(s, err, executor_of(self));
}

int num_in_sync(const collective_board& st) {
  return st.cfg.num_replicas_in_sync > 0 ? st.cfg.num_replicas_in_sync
                                         : static_cast<int>(st.cfg.replica_ids.size());
}

// -- the cross-worker phase ----------------------------------------------------------------------

detail::cross_call cross_call_of(const slot& s) {
  return detail::cross_call_for(s.sig, s.what, s.step, s.seq, s.timeout);
}

/// The result of a complete slot, in replica-id (= local) order.
nest compute(const slot& s) {
  std::vector<std::vector<tensor>> leaves;
  leaves.reserve(s.calls.size());
  for (const auto& c : s.calls)
    leaves.push_back(flatten(c->request.value));
  return detail::compute(s.sig, leaves, s.calls.front()->request.value);
}

/// The future states of a slot's callers, taken out of it (a cross-worker phase answers them).
std::vector<nest_state> take_states(std::vector<reply_to>& replies) {
  std::vector<nest_state> states;
  states.reserve(replies.size());
  for (auto& r : replies)
    if (r.state)
      states.push_back(std::move(r.state));
  return states;
}

/// Answers the callers of a cross-worker phase (on the thread that ran it).
void answer(const std::vector<nest_state>& states, const caf::expected<nest>& result) {
  for (const auto& state : states) {
    if (result)
      state->set_value(*result);
    else
      state->set_error(std::make_exception_ptr(to_consort_error(result.error(), "")));
  }
}

/// The leaves of every call of a complete slot, or nothing when the slot holds no GPU tensor (the
/// common CPU case costs one look at the first call's leaves, and NCCL is out of the question).
std::vector<std::vector<tensor>> gpu_leaves(const slot& s) {
  std::vector<std::vector<tensor>> leaves;
  auto first = flatten(s.calls.front()->request.value);
  if (first.empty() || !first.front().on_gpu())
    return leaves;
  leaves.reserve(s.calls.size());
  leaves.push_back(std::move(first));
  for (size_t i = 1; i < s.calls.size(); ++i)
    leaves.push_back(flatten(s.calls[i]->request.value));
  return leaves;
}

/// Each call's GPU queue (null for a CPU replica or a harness's request), in local order.
std::vector<std::shared_ptr<detail::replica_queue>> queues_of(const slot& s) {
  std::vector<std::shared_ptr<detail::replica_queue>> queues;
  queues.reserve(s.calls.size());
  for (const auto& c : s.calls)
    queues.push_back(c ? c->gpu : nullptr);
  return queues;
}

/// Before a thread other than the replicas' reads the tensors of a call that does not run on
/// NCCL: the GPU replicas' streams must have finished the work that made them (they call without
/// waiting). The streams share the call's deadline; NCCL calls still queued on them are waited
/// for by their own.
void make_ready(const std::vector<std::shared_ptr<detail::replica_queue>>& queues,
                std::chrono::milliseconds timeout, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& q : queues)
    if (q)
      q->make_ready(deadline, "the inputs of " + what + " on GPU:" + std::to_string(q->device()));
}

/// The descriptor flag of a worker whose NCCL communicators must be (re)built.
constexpr uint8_t rebuild_flag = 1;

/// Hands a complete slot of GPU replicas to the step lane when NCCL can run it across workers:
/// the descriptor round checks the call as always, then one communicator over every replica of
/// every worker (rank = replica id in sync group) runs it, and each replica gets its result on
/// its own GPU. False leaves the slot to the TCP path.
bool hand_off_nccl(self_ptr self, slot& s) {
  auto& st = self->state;
  auto leaves = gpu_leaves(s);
  if (leaves.empty())
    return false;
  auto queues = queues_of(s);
  if (!detail::local_nccl::eligible(s.sig.kind, s.sig.op, s.sig.axis, leaves, queues, true))
    return false;
  // Results go to each caller's future, in local order.
  s.handed_off = true;
  auto states = take_states(s.replies);
  if (!st.cross_nccl)
    st.cross_nccl = std::make_shared<detail::local_nccl>();
  auto cc = cross_call_of(s);
  cc.signature += " on NCCL";
  detail::local_nccl::group_spec spec;
  spec.nranks = num_in_sync(st);
  spec.first_rank = st.cfg.replica_ids.front();
  spec.first_id = st.cfg.nccl_unique_id;
  std::vector<int> devices;
  for (const auto& q : queues)
    devices.push_back(q->device());
  cc.data_phase = [nccl = st.cross_nccl, kind = s.sig.kind, op = s.sig.op, root = s.sig.root,
                   leaves = std::move(leaves), queues = std::move(queues), what = s.what,
                   spec](const detail::cross_call::share_fn& share, std::chrono::milliseconds left,
                         uint8_t all_flags) mutable -> caf::expected<std::vector<tensor>> {
    // A worker whose communicators failed (or were never made) asked for a rebuild in its
    // descriptor: every worker rebuilds, so that all ranks join the new communicator together.
    spec.rebuild = (all_flags & rebuild_flag) != 0;
    spec.share = [&share](std::vector<uint8_t>& bytes) {
      if (auto err = share(bytes))
        throw to_consort_error(err, "sharing the NCCL unique id");
    };
    try {
      auto per_replica = nccl->run(kind, op, root, leaves, queues, left, what, spec);
      std::vector<tensor> flat;
      for (auto& r : per_replica)
        for (auto& t : r)
          flat.push_back(std::move(t));
      return flat;
    } catch (const std::exception& e) {
      return error_of(e);
    }
  };
  auto structure = s.calls.front()->request.value;
  auto* cross = st.cfg.cross.get();
  cross->post(detail::cross_worker::lane::step, [cross, cc = std::move(cc),
                                                 structure = std::move(structure),
                                                 states = std::move(states), nccl = st.cross_nccl,
                                                 devices]() mutable {
    // Read on the lane, where the communicators are used (jobs run in order).
    cc.flags = nccl->needs_build(devices) ? rebuild_flag : 0;
    auto out = cross->run(detail::cross_worker::lane::step, cc);
    const size_t per = flatten(structure).size();
    for (size_t r = 0; r < states.size(); ++r) {
      if (!out) {
        states[r]->set_error(std::make_exception_ptr(to_consort_error(out.error(), "")));
        continue;
      }
      try {
        std::vector<tensor> mine(out->begin() + static_cast<std::ptrdiff_t>(r * per),
                                 out->begin() + static_cast<std::ptrdiff_t>((r + 1) * per));
        states[r]->set_value(pack_as(structure, mine));
      } catch (const std::exception& e) {
        states[r]->set_error(std::make_exception_ptr(e));
      }
    }
  });
  return true;
}

/// Hands a complete slot to the step lane: local combination, then the cross-worker phase.
void hand_off(self_ptr self, slot& s) {
  auto& st = self->state;
  if (hand_off_nccl(self, s))
    return;
  s.handed_off = true;
  auto states = take_states(s.replies);
  std::vector<std::vector<tensor>> leaves;
  leaves.reserve(s.calls.size());
  for (auto& c : s.calls)
    leaves.push_back(flatten(c->request.value));
  std::optional<size_t> root_pos;
  if (s.sig.kind == collective_kind::broadcast) {
    if (auto it = st.matcher->position().find(s.sig.root); it != st.matcher->position().end())
      root_pos = it->second;
  }
  auto structure = s.calls.front()->request.value;
  auto* cross = st.cfg.cross.get();
  std::function<void()> job =
      [cross, cc = cross_call_of(s), sig = s.sig, leaves = std::move(leaves), root_pos,
       structure = std::move(structure), states = std::move(states), queues = queues_of(s),
       timeout = s.timeout, what = s.what]() mutable {
        try {
          make_ready(queues, timeout, what);
          local_part(cc, sig, leaves, root_pos);
        } catch (const std::exception& e) {
          cc.leaves.clear();
          cc.local_failure = error_of(e);
        }
        auto out = cross->run(detail::cross_worker::lane::step, cc);
        caf::expected<nest> result = caf::error{};
        if (out) {
          try {
            result = pack_as(structure, *out);
          } catch (const std::exception& e) {
            result = error_of(e);
          }
        } else {
          result = out.error();
        }
        answer(states, result);
      };
  // The last replica to arrive runs the phase itself (its peers wait for it anyway), once the
  // board's lock is released; the actor hands it to the lane's thread.
  if (self->direct)
    self->deferred = std::move(job);
  else
    cross->post(detail::cross_worker::lane::step, std::move(job));
}

/// A slot that failed on this worker still meets the other workers on the step lane, so that
/// they fail with this worker's reason instead of waiting for their deadline. Once per slot.
void hand_off_failure(self_ptr self, slot& s) {
  auto& st = self->state;
  if (!st.cfg.cross || s.handed_off || !s.failure)
    return;
  s.handed_off = true;
  auto cc = cross_call_of(s);
  cc.local_failure = s.failure;
  auto* cross = st.cfg.cross.get();
  cross->post(detail::cross_worker::lane::step, [cross, cc = std::move(cc)]() mutable {
    (void)cross->run(detail::cross_worker::lane::step, cc);
  });
}

void on_report(self_ptr self, step_report& report);

/// Runs a complete slot on NCCL when local_nccl can; false leaves it to the host kernels. NCCL
/// queues the call on the replicas' streams and their results go out at once, complete in stream
/// order: this actor never waits for the GPU.
bool try_nccl(self_ptr self, slot& s) {
  auto& st = self->state;
  auto leaves = gpu_leaves(s);
  if (leaves.empty())
    return false;
  auto queues = queues_of(s);
  if (!detail::local_nccl::eligible(s.sig.kind, s.sig.op, s.sig.axis, leaves, queues))
    return false;
  try {
    if (!st.nccl)
      st.nccl = std::make_unique<detail::local_nccl>();
    int root = 0;
    if (s.sig.kind == collective_kind::broadcast)
      root = static_cast<int>(st.matcher->position().at(s.sig.root));
    auto out = st.nccl->run(s.sig.kind, s.sig.op, root, leaves, queues, s.timeout, s.what);
    const auto& structure = s.calls.front()->request.value;
    for (size_t r = 0; r < s.replies.size(); ++r)
      s.replies[r].deliver(pack_as(structure, out[r]));
  } catch (const std::exception& e) {
    fail_slot(self, s, error_of(e));
  }
  return true;
}

/// A complete slot: across workers, the cross-worker phase; GPU replicas on distinct GPUs of
/// this process, NCCL; else the host kernels, once, answering every replica.
void complete_slot(self_ptr self, slot& s) {
  if (self->state.cfg.cross) {
    hand_off(self, s);
    return;
  }
  // (In-process only: across workers the data phase runs on the cross-worker lane.)
  if (try_nccl(self, s))
    return;
  try {
    if (std::any_of(s.calls.begin(), s.calls.end(), [](const auto& c) { return c && c->gpu; }))
      make_ready(queues_of(s), s.timeout, s.what);
    auto result = compute(s);
    for (auto& r : s.replies)
      r.deliver(result);
  } catch (const std::exception& e) {
    fail_slot(self, s, error_of(e));
  }
}

/// What the matcher does with slots when `self` drives it.
matcher_executor executor_of(self_ptr self) {
  matcher_executor exec;
  exec.complete = [self](slot& s) {
    complete_slot(self, s);
  };
  exec.failed = [self](slot& s) {
    hand_off_failure(self, s);
  };
  // One delayed message is armed at a time, for the earliest deadline: a delayed message per
  // call would stay in CAF's clock for the whole timeout (30 s) after its call completed, which
  // the soak measured as memory growing with the call rate (about 190 bytes a call).
  exec.arm_tick = [self](steady_clock::time_point first) {
    // Rounded up, so that the tick never fires before the deadline it was armed for.
    auto delay =
        ceil<milliseconds>(std::max(first - self->clock().now(), steady_clock::duration{0}));
    caf::delayed_anon_send(self->me, delay, deadline_atom_v, step_id{0}, uint32_t{0});
  };
  return exec;
}

void on_call(self_ptr self, collective_call& call, reply_to reply) {
  // The actor's clock: the test scheduler's is virtual (trigger_timeouts moves it).
  self->state.matcher->call(call, std::move(reply), self->clock().now(), executor_of(self));
}

void on_report(self_ptr self, step_report& report) {
  self->state.matcher->report(report, executor_of(self));
}

/// The deadline tick: every call whose deadline has passed times out, then the tick is armed
/// for the next.
void on_deadline_tick(self_ptr self) {
  self->state.matcher->expire(self->clock().now(), executor_of(self));
}

/// Runs a host reduce or gather across workers on the host lane, which answers `state`.
template <class Request>
void host_across(self_ptr self, Request req, nest_state state) {
  auto& st = self->state;
  auto index = st.host_ops++;
  auto* cross = st.cfg.cross.get();
  auto timeout = st.cfg.default_timeout;
  cross->post(detail::cross_worker::lane::host,
              [cross, timeout, req = std::move(req), index, state = std::move(state)]() {
                caf::expected<nest> result = caf::error{};
                if constexpr (std::is_same_v<Request, host_reduce>)
                  result = cross_reduce(*cross, timeout, req, index);
                else
                  result = cross_gather(*cross, timeout, req, index);
                answer({state}, result);
              });
}

} // namespace

nest solo_collective(const collective_call& call) {
  auto leaves = flatten(call.request.value);
  int64_t axis = call.request.axis;
  auto problem = check_arguments(call, leaves, 1, &axis);
  if (!problem.empty())
    throw error(errc::invalid_argument, problem);
  auto sig = detail::signature_from(call, leaves);
  sig.axis = axis;
  return detail::compute(sig, {std::move(leaves)}, call.request.value);
}

std::shared_ptr<detail::collective_board> make_collective_board(collective_config cfg) {
  auto board = std::make_shared<collective_board>();
  board->matcher.emplace(cfg.replica_ids, cfg.num_replicas_in_sync, cfg.default_timeout);
  board->cfg = std::move(cfg);
  return board;
}

void direct_collect(collective_board& board, caf::actor_system& sys, const collective_actor& coll,
                    collective_call call, nest_state state) {
  driver d{board, sys, coll, false, {}};
  d.direct = true;
  {
    std::lock_guard<std::mutex> lock{board.mu};
    reply_to reply;
    reply.state = std::move(state);
    on_call(&d, call, std::move(reply));
  }
  // This call completed a slot that goes across workers: its phase runs here, on the lane's
  // turn (at once when nothing is queued on it before).
  if (d.deferred)
    board.cfg.cross->run_or_post(detail::cross_worker::lane::step, std::move(d.deferred));
}

void direct_report(collective_board& board, caf::actor_system& sys, const collective_actor& coll,
                   step_report report) {
  std::lock_guard<std::mutex> lock{board.mu};
  driver d{board, sys, coll, false, {}};
  on_report(&d, report);
}

collective_actor spawn_collective(caf::actor_system& sys, collective_config cfg, bool detached) {
  auto board = cfg.board ? cfg.board : make_collective_board(cfg);
  auto impl = [board](collective_actor::stateful_pointer<collective_state> self)
      -> collective_actor::behavior_type {
    self->state.board = board;
    // Runs `fn(driver*)` as this actor, with the board's lock held.
    auto as_actor = [self](auto&& fn) {
      auto& b = *self->state.board;
      std::lock_guard<std::mutex> lock{b.mu};
      driver d{b, self->system(), caf::actor_cast<collective_actor>(self), false, {}};
      return fn(&d);
    };
    auto crossing = [self] {
      return self->state.board->cfg.cross != nullptr;
    };
    return {
        [as_actor](collect_atom, collective_call& call, nest_state& state) {
          reply_to reply;
          reply.state = std::move(state);
          as_actor([&](driver* d) { on_call(d, call, std::move(reply)); });
        },
        [as_actor](step_done_atom, step_report& report) {
          as_actor([&](driver* d) { on_report(d, report); });
        },
        [as_actor](deadline_atom, step_id, uint32_t) {
          as_actor([](driver* d) { on_deadline_tick(d); });
        },
        [as_actor, crossing](reduce_atom, host_reduce& req, nest_state& state) {
          if (crossing()) {
            as_actor([&](driver* d) { host_across(d, std::move(req), std::move(state)); });
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
            as_actor([&](driver* d) { host_across(d, std::move(req), std::move(state)); });
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
