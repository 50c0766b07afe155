// The executors of complete slots, one per path (actors/collective_paths.hpp).

#include "actors/collective_paths.hpp"

#include "actors/call_checks.hpp"
#include "actors/cross_phase.hpp"
#include "device/gpu.hpp"
#include "transport/communicator.hpp"

#include <consort/device.hpp>
#include <consort/ops.hpp>

#include <algorithm>
#include <functional>
#include <type_traits>

namespace consort::detail {

namespace {

using self_ptr = path_driver*;

void hand_off_failure(self_ptr self, slot& s);

/// Fails every pending reply of `s` with `err` (later arrivals get it too).
void fail_slot(self_ptr self, slot& s, const caf::error& err) {
  self->state.matcher->fail(s, err, executor_of(self));
}

int num_in_sync(const collective_board& st) {
  return st.cfg.num_replicas_in_sync > 0 ? st.cfg.num_replicas_in_sync
                                         : static_cast<int>(st.cfg.replica_ids.size());
}

// -- the cross-worker phase ----------------------------------------------------------------------

transport::group_call cross_call_of(const slot& s) {
  return cross_call_for(s.sig, s.what, s.step, s.seq, s.timeout);
}

/// Records a complete slot on its way to the other workers (queued until its turn on the lane),
/// under the next job-wide number; the call's exchange marks who arrived.
recorded_call record_slot(self_ptr self, const slot& s, transport::group_call& cc,
                          flight_state state) {
  recorded_call rec;
  auto* recorder = self->state.recorder.get();
  if (recorder == nullptr || !recorder->enabled())
    return rec;
  rec.recorder = recorder;
  int replica = -1;
  for (const auto& c : s.calls)
    if (c) {
      replica = c->replica;
      break;
    }
  rec.h = recorder->collective(s.step, s.seq, replica, flight_signature_of(s.sig), state, {});
  cc.arrivals = recorder->arrivals(rec.h);
  cc.lateness = recorder->lateness(rec.h);
  cc.clock_offset_ns = recorder->chief_offset_ns();
  return rec;
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
std::vector<std::shared_ptr<replica_queue>> queues_of(const slot& s) {
  std::vector<std::shared_ptr<replica_queue>> queues;
  queues.reserve(s.calls.size());
  for (const auto& c : s.calls)
    queues.push_back(c ? c->gpu : nullptr);
  return queues;
}

/// Before a thread other than the replicas' reads the tensors of a call that does not run on
/// NCCL: the GPU replicas' streams must have finished the work that made them (they call without
/// waiting). The streams share the call's deadline; NCCL calls still queued on them are waited
/// for by their own.
void make_ready(const std::vector<std::shared_ptr<replica_queue>>& queues,
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
  if (!local_nccl::eligible(s.sig.kind, s.sig.op, s.sig.axis, leaves, queues, true))
    return false;
  // Results go to each caller's future, in local order.
  s.handed_off = true;
  auto states = take_states(s.replies);
  if (!st.cross_nccl)
    st.cross_nccl = std::make_shared<local_nccl>();
  auto cc = cross_call_of(s);
  cc.signature += " on NCCL";
  auto rec = record_slot(self, s, cc, flight_state::queued);
  local_nccl::group_spec spec;
  spec.nranks = num_in_sync(st);
  spec.first_rank = st.cfg.replica_ids.front();
  spec.first_id = st.cfg.nccl_unique_id;
  std::vector<int> devices;
  for (const auto& q : queues)
    devices.push_back(q->device());
  cc.data_phase = [nccl = st.cross_nccl, kind = s.sig.kind, op = s.sig.op, root = s.sig.root,
                   leaves = std::move(leaves), queues = std::move(queues), what = s.what, spec](
                      const transport::group_call::share_fn& share, std::chrono::milliseconds left,
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
  std::function<void()> job = [cross, cc = std::move(cc), structure = std::move(structure),
                               states = std::move(states), nccl = st.cross_nccl, devices, rec,
                               keep = st.recorder]() mutable {
    // Read on the lane, where the communicators are used (jobs run in order).
    cc.flags = nccl->needs_build(devices) ? rebuild_flag : 0;
    if (rec.recorder != nullptr)
      rec.recorder->started(rec.h);
    auto out = cross->run(transport::communicator::lane::step, cc);
    if (!out)
      out = rec.finish(out.error(), cc.timeout);
    else
      (void)rec.finish({}, cc.timeout);
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
  };
  // As the host phase (hand_off): the last replica to arrive runs it on its own thread, on the
  // lane's turn; the actor hands it to the lane's thread.
  if (self->direct)
    self->deferred = std::move(job);
  else
    cross->post(transport::communicator::lane::step, std::move(job));
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
  auto cc = cross_call_of(s);
  auto rec = record_slot(self, s, cc, flight_state::queued);
  std::function<void()> job =
      [cross, cc = std::move(cc), sig = s.sig, leaves = std::move(leaves), root_pos,
       structure = std::move(structure), states = std::move(states), queues = queues_of(s),
       timeout = s.timeout, what = s.what, rec, keep = st.recorder]() mutable {
        if (rec.recorder != nullptr)
          rec.recorder->started(rec.h);
        try {
          make_ready(queues, timeout, what);
          local_part(cc, sig, leaves, root_pos);
        } catch (const std::exception& e) {
          cc.leaves.clear();
          cc.local_failure = error_of(e);
        }
        auto out = cross->run(transport::communicator::lane::step, cc);
        if (!out)
          out = rec.finish(out.error(), cc.timeout);
        else
          (void)rec.finish({}, cc.timeout);
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
    cross->post(transport::communicator::lane::step, std::move(job));
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
  // It still takes its job-wide number: the other workers count it too.
  auto rec = record_slot(self, s, cc, flight_state::queued);
  auto* cross = st.cfg.cross.get();
  cross->post(transport::communicator::lane::step,
              [cross, cc = std::move(cc), rec, keep = st.recorder]() mutable {
                (void)cross->run(transport::communicator::lane::step, cc);
                if (rec.recorder != nullptr)
                  rec.recorder->ended(rec.h, to_consort_error(cc.local_failure, "").code());
              });
}

/// Runs a complete slot on NCCL when local_nccl can; false leaves it to the host kernels. NCCL
/// queues the call on the replicas' streams and their results go out at once, complete in stream
/// order: this actor never waits for the GPU.
bool try_nccl(self_ptr self, slot& s) {
  auto& st = self->state;
  auto leaves = gpu_leaves(s);
  if (leaves.empty())
    return false;
  auto queues = queues_of(s);
  if (!local_nccl::eligible(s.sig.kind, s.sig.op, s.sig.axis, leaves, queues))
    return false;
  try {
    if (!st.nccl)
      st.nccl = std::make_unique<local_nccl>();
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
  auto* recorder = self->state.recorder.get();
  flight_recorder::handle h;
  if (recorder != nullptr && recorder->enabled())
    h = recorder->collective(s.step, s.seq, s.calls.front() ? s.calls.front()->replica : -1,
                             flight_signature_of(s.sig), flight_state::waiting, {});
  if (try_nccl(self, s)) {
    if (h)
      recorder->ended(h, s.failure ? to_consort_error(s.failure, "").code() : errc::none);
    return;
  }
  try {
    if (std::any_of(s.calls.begin(), s.calls.end(), [](const auto& c) { return c && c->gpu; }))
      make_ready(queues_of(s), s.timeout, s.what);
    auto result = compute(s);
    for (auto& r : s.replies)
      r.deliver(result);
    if (h)
      recorder->ended(h, errc::none);
  } catch (const std::exception& e) {
    fail_slot(self, s, error_of(e));
    if (h)
      recorder->ended(h, to_consort_error(s.failure, "").code());
  }
}

template <class Request>
void host_across_lane(self_ptr self, Request req, nest_state state) {
  auto& st = self->state;
  auto index = st.host_ops++;
  auto* cross = st.cfg.cross.get();
  auto timeout = st.cfg.default_timeout;
  cross->post(transport::communicator::lane::host,
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

call_matcher::executor executor_of(path_driver* self) {
  call_matcher::executor exec;
  exec.complete = [self](slot& s) {
    complete_slot(self, s);
  };
  exec.failed = [self](slot& s) {
    hand_off_failure(self, s);
  };
  exec.arm_tick = [self](std::chrono::steady_clock::time_point first) {
    self->arm_tick(first);
  };
  return exec;
}

void host_across(path_driver* self, host_reduce req, nest_state state) {
  host_across_lane(self, std::move(req), std::move(state));
}

void host_across(path_driver* self, host_gather req, nest_state state) {
  host_across_lane(self, std::move(req), std::move(state));
}

std::vector<int> local_nccl_gpus(const std::vector<std::string>& devices) {
  std::vector<int> gpus;
  for (const auto& name : devices) {
    auto spec = parse_device(name);
    if (spec.kind != device_kind::gpu ||
        std::find(gpus.begin(), gpus.end(), spec.index) != gpus.end())
      return {};
    gpus.push_back(spec.index);
  }
  return gpus;
}

bool prepare_local_nccl(collective_board& board, const std::vector<std::string>& devices,
                        std::chrono::milliseconds timeout, std::string* why) {
  const auto gpus = local_nccl_gpus(devices);
  if (gpus.empty())
    return false;
  try {
    auto nccl = std::make_unique<local_nccl>();
    nccl->prepare(gpus, timeout);
    std::lock_guard<std::mutex> guard{board.mu};
    board.nccl = std::move(nccl);
    return true;
  } catch (const std::exception& e) {
    if (why != nullptr)
      *why = e.what();
    return false;
  }
}

} // namespace consort::detail
