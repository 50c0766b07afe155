// The collective actor: matches the replicas' collective calls by (step, seq), validates that
// they agree, computes each result once and answers every participant (DESIGN.md §3).

#include <consort/actors/protocol.hpp>
#include <consort/ops.hpp>

#include <caf/all.hpp>

#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_map>

namespace consort {

namespace {

using namespace std::chrono;

/// What every participant of one (step, seq) must agree on, taken from the first arrival.
struct call_signature {
  collective_kind kind = collective_kind::all_reduce;
  reduce_op op = reduce_op::sum;
  int64_t axis = 0;
  int root = 0;
  std::string structure;
  std::vector<dtype> dtypes;
  std::vector<shape_t> shapes;
};

std::string describe_call(const call_signature& sig) {
  std::ostringstream out;
  out << to_string(sig.kind);
  switch (sig.kind) {
  case collective_kind::all_reduce:
    out << '(' << to_string(sig.op) << ')';
    break;
  case collective_kind::all_gather:
    out << "(axis=" << sig.axis << ')';
    break;
  case collective_kind::broadcast:
    out << "(root=" << sig.root << ')';
    break;
  }
  return out.str();
}

std::string join_ids(const std::vector<int>& ids) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < ids.size(); ++i)
    out << (i ? ", " : "") << ids[i];
  out << ']';
  return out.str();
}

/// Where a participant's answer goes: a response promise (a `collective` request) or a future
/// state that the replica waits on directly (the replicas' own calls).
struct reply_to {
  caf::typed_response_promise<nest> promise;
  nest_state state;

  bool pending() const { return state ? !state->done() : promise.pending(); }
  void deliver(const nest& value) {
    if (state)
      state->set_value(value);
    else if (promise.pending())
      promise.deliver(value);
  }
  void deliver(const caf::error& err) {
    if (state)
      state->set_error(std::make_exception_ptr(to_consort_error(err, "")));
    else if (promise.pending())
      promise.deliver(err);
  }
};

/// One (step, seq): the arrivals so far and, once known, its failure.
struct slot {
  call_signature sig;
  std::string what; // "all_reduce(SUM) #0 of step 3"
  std::vector<std::optional<collective_call>> calls;
  std::vector<reply_to> replies;
  size_t arrived = 0;
  caf::error failure;
  milliseconds timeout{0};
};

struct step_entry {
  std::map<uint32_t, slot> slots;
  std::vector<std::optional<step_report>> reports;
  size_t reported = 0;
};

} // namespace

struct collective_state {
  collective_config cfg;
  std::unordered_map<int, size_t> position; // replica id -> local position
  std::map<step_id, step_entry> steps;
  static inline const char* name = "consort.collective";
};

namespace {

using self_ptr = collective_actor::stateful_pointer<collective_state>;

/// Fails every promise still waiting in `s` with `err`; later arrivals get `err` too.
void fail_slot(slot& s, const caf::error& err) {
  s.failure = err;
  for (size_t i = 0; i < s.replies.size(); ++i) {
    if (s.calls[i] && s.replies[i].pending())
      s.replies[i].deliver(err);
  }
}

/// Returns an error message when `call` cannot take part in a collective described by `sig`.
std::string check_against(const call_signature& sig, const collective_call& call, int first_replica,
                          const std::vector<tensor>& leaves) {
  const auto& req = call.request;
  std::ostringstream out;
  auto prefix = [&] {
    out << "collective mismatch at step " << call.step << ", call #" << call.seq << ": ";
  };
  call_signature mine;
  mine.kind = req.kind;
  mine.op = req.op;
  mine.axis = req.axis;
  mine.root = req.root;
  if (mine.kind != sig.kind || (sig.kind == collective_kind::all_reduce && mine.op != sig.op) ||
      (sig.kind == collective_kind::all_gather && mine.axis != sig.axis) ||
      (sig.kind == collective_kind::broadcast && mine.root != sig.root)) {
    prefix();
    out << "replica " << call.replica << " called " << describe_call(mine) << " but replica "
        << first_replica << " called " << describe_call(sig)
        << "; every replica must make the same collective calls in the same order";
    return out.str();
  }
  auto structure = req.value.structure_string();
  if (structure != sig.structure) {
    prefix();
    out << "replica " << call.replica << " passed structure " << structure << " but replica "
        << first_replica << " passed " << sig.structure;
    return out.str();
  }
  for (size_t i = 0; i < leaves.size(); ++i) {
    const auto& t = leaves[i];
    if (t.dtype() != sig.dtypes[i]) {
      prefix();
      out << "leaf " << i << ": replica " << call.replica << " passed " << to_string(t.dtype())
          << " but replica " << first_replica << " passed " << to_string(sig.dtypes[i]);
      return out.str();
    }
    if (sig.kind == collective_kind::all_gather) {
      const auto& a = t.shape();
      const auto& b = sig.shapes[i];
      bool ok = a.size() == b.size();
      for (size_t d = 0; ok && d < a.size(); ++d)
        ok = static_cast<int64_t>(d) == sig.axis || a[d] == b[d];
      if (!ok) {
        prefix();
        out << "leaf " << i << ": replica " << call.replica << " passed shape "
            << to_string(t.shape()) << " but replica " << first_replica << " passed "
            << to_string(b) << "; all_gather along axis " << sig.axis
            << " needs the same rank and the same extents on every other axis";
        return out.str();
      }
    } else if (t.shape() != sig.shapes[i]) {
      prefix();
      out << "leaf " << i << ": replica " << call.replica << " passed shape "
          << to_string(t.shape()) << " but replica " << first_replica << " passed "
          << to_string(sig.shapes[i]) << "; " << to_string(sig.kind) << " needs equal shapes";
      return out.str();
    }
  }
  return {};
}

/// Validates the arguments of the first arrival on their own (axis, root, ranks).
std::string check_arguments(const collective_call& call, const std::vector<tensor>& leaves,
                            int num_replicas, int64_t* normalized_axis) {
  const auto& req = call.request;
  std::ostringstream out;
  if (req.kind == collective_kind::broadcast && (req.root < 0 || req.root >= num_replicas)) {
    out << "broadcast at step " << call.step << ", call #" << call.seq << ": root replica "
        << req.root << " is out of range; expected 0 <= root < " << num_replicas;
    return out.str();
  }
  if (req.kind == collective_kind::all_gather) {
    if (leaves.empty()) {
      out << "all_gather at step " << call.step << ", call #" << call.seq
          << ": the value has no tensors";
      return out.str();
    }
    for (size_t i = 0; i < leaves.size(); ++i) {
      auto rank = leaves[i].rank();
      if (rank == 0) {
        out << "all_gather at step " << call.step << ", call #" << call.seq << ": leaf " << i
            << " is a scalar (rank 0); all_gather needs rank >= 1, reshape it to [1]";
        return out.str();
      }
      if (req.axis < -rank || req.axis >= rank) {
        out << "all_gather at step " << call.step << ", call #" << call.seq << ": axis " << req.axis
            << " is out of range for leaf " << i << " of rank " << rank << "; expected -" << rank
            << " <= axis < " << rank;
        return out.str();
      }
      auto axis = req.axis < 0 ? req.axis + rank : req.axis;
      if (i == 0)
        *normalized_axis = axis;
      else if (axis != *normalized_axis) {
        out << "all_gather at step " << call.step << ", call #" << call.seq << ": axis " << req.axis
            << " means axis " << axis << " for leaf " << i << " but axis " << *normalized_axis
            << " for leaf 0; use a non-negative axis with leaves of "
            << "different ranks";
        return out.str();
      }
    }
  }
  return {};
}

/// Computes the result of a complete slot, in replica-id (= local) order.
nest compute(const slot& s) {
  std::vector<std::vector<tensor>> leaves;
  leaves.reserve(s.calls.size());
  for (const auto& c : s.calls)
    leaves.push_back(flatten(c->request.value));
  const auto& structure = s.calls.front()->request.value;
  auto n = leaves.front().size();
  std::vector<tensor> out(n);
  std::vector<tensor> inputs(leaves.size());
  for (size_t i = 0; i < n; ++i) {
    switch (s.sig.kind) {
    case collective_kind::all_reduce:
      for (size_t r = 0; r < leaves.size(); ++r)
        inputs[r] = leaves[r][i];
      out[i] = reduce_elementwise(s.sig.op, inputs);
      break;
    case collective_kind::all_gather:
      for (size_t r = 0; r < leaves.size(); ++r)
        inputs[r] = leaves[r][i];
      out[i] = concat(inputs, s.sig.axis);
      break;
    case collective_kind::broadcast:
      out[i] = leaves[static_cast<size_t>(s.sig.root)][i];
      break;
    }
  }
  return pack_as(structure, out);
}

caf::error error_of(const std::exception& e) {
  if (auto* ce = dynamic_cast<const error*>(&e))
    return make_caf_error(ce->code(), ce->what());
  return make_caf_error(errc::invalid_argument, e.what());
}

/// The reason a replica that reported `report` will never make call `seq` of its step.
caf::error never_called(const slot& s, uint32_t seq, const step_report& report) {
  std::ostringstream out;
  out << s.what << " was abandoned: replica " << report.replica;
  if (report.failure) {
    auto err = to_consort_error(report.failure, "");
    out << " failed the step: " << err.what();
  } else {
    out << " finished step " << report.step << " after " << report.calls
        << " collective call(s), without making call #" << seq
        << "; every replica must make the same collective calls";
  }
  return make_caf_error(errc::collective_aborted, out.str());
}

void on_report(self_ptr self, step_report& report);

void on_call(self_ptr self, collective_call& call, reply_to reply) {
  auto& st = self->state;
  // Peers that finished before any collective of the step was flagged sent no report of their
  // own; the caller carries them.
  for (auto& report : call.finished_peers)
    on_report(self, report);
  auto pos_it = st.position.find(call.replica);
  if (pos_it == st.position.end()) {
    reply.deliver(make_caf_error(errc::invalid_argument, "collective call from replica " +
                                                             std::to_string(call.replica) +
                                                             ", which is not in this group"));
    return;
  }
  auto pos = pos_it->second;
  auto n = st.position.size();
  auto& entry = st.steps[call.step];
  if (entry.reports.empty())
    entry.reports.resize(n);
  auto [it, fresh] = entry.slots.try_emplace(call.seq);
  auto& s = it->second;
  auto leaves = flatten(call.request.value);
  if (fresh) {
    s.calls.resize(n);
    s.replies.resize(n);
    s.sig.kind = call.request.kind;
    s.sig.op = call.request.op;
    s.sig.axis = call.request.axis;
    s.sig.root = call.request.root;
    s.sig.structure = call.request.value.structure_string();
    for (auto& t : leaves) {
      s.sig.dtypes.push_back(t.dtype());
      s.sig.shapes.push_back(t.shape());
    }
    s.what = describe_call(s.sig) + " #" + std::to_string(call.seq) + " of step " +
             std::to_string(call.step);
    s.timeout = call.request.timeout.value_or(st.cfg.default_timeout);
    // A peer may already have finished the step without this call.
    for (auto& report : entry.reports) {
      if (report && report->calls <= call.seq) {
        s.failure = never_called(s, call.seq, *report);
        break;
      }
    }
    if (!s.failure) {
      int64_t axis = call.request.axis;
      auto problem = check_arguments(call, leaves, static_cast<int>(n), &axis);
      if (problem.empty()) {
        s.sig.axis = axis;
        self->delayed_send(self, s.timeout, deadline_atom_v, call.step, call.seq);
      } else {
        s.failure = make_caf_error(errc::invalid_argument, problem);
      }
    }
  }
  if (s.calls[pos]) {
    reply.deliver(make_caf_error(errc::invalid_argument, "replica " + std::to_string(call.replica) +
                                                             " called " + s.what + " twice"));
    return;
  }
  auto first_replica = call.replica;
  for (auto& c : s.calls)
    if (c) {
      first_replica = c->replica;
      break;
    }
  if (!s.failure && !fresh) {
    // Compare against the first arrival; all_gather's axis was normalised, so compare the
    // request as the replica sent it against its own normalisation.
    auto mine = call;
    if (mine.request.kind == collective_kind::all_gather && !leaves.empty()) {
      auto rank = leaves.front().rank();
      if (mine.request.axis < 0)
        mine.request.axis += rank;
    }
    auto problem = check_against(s.sig, mine, first_replica, leaves);
    if (!problem.empty())
      fail_slot(s, make_caf_error(errc::collective_mismatch, problem));
  }
  s.calls[pos] = std::move(call);
  ++s.arrived;
  if (s.failure) {
    reply.deliver(s.failure);
    return;
  }
  s.replies[pos] = std::move(reply);
  if (s.arrived < n)
    return;
  // Everyone is here: compute once, answer all.
  try {
    auto result = compute(s);
    for (auto& r : s.replies)
      r.deliver(result);
    auto step = s.calls.front()->step;
    auto seq = s.calls.front()->seq;
    st.steps[step].slots.erase(seq);
  } catch (const std::exception& e) {
    fail_slot(s, error_of(e));
  }
}

void on_report(self_ptr self, step_report& report) {
  auto& st = self->state;
  auto pos_it = st.position.find(report.replica);
  if (pos_it == st.position.end())
    return;
  auto& entry = st.steps[report.step];
  if (entry.reports.empty())
    entry.reports.resize(st.position.size());
  if (entry.reports[pos_it->second])
    return;
  // Every pending call this replica will never make fails now, not at its deadline.
  for (auto& [seq, s] : entry.slots) {
    if (seq >= report.calls && !s.failure)
      fail_slot(s, never_called(s, seq, report));
  }
  auto step = report.step;
  entry.reports[pos_it->second] = std::move(report);
  if (++entry.reported == st.position.size())
    st.steps.erase(step);
}

void on_deadline(self_ptr self, step_id step, uint32_t seq) {
  auto& st = self->state;
  auto step_it = st.steps.find(step);
  if (step_it == st.steps.end())
    return;
  auto slot_it = step_it->second.slots.find(seq);
  if (slot_it == step_it->second.slots.end() || slot_it->second.failure)
    return;
  auto& s = slot_it->second;
  std::vector<int> arrived;
  std::vector<int> missing;
  for (auto& [id, pos] : st.position)
    (s.calls[pos] ? arrived : missing).push_back(id);
  std::sort(arrived.begin(), arrived.end());
  std::sort(missing.begin(), missing.end());
  std::ostringstream out;
  out << s.what << " timed out after " << s.timeout.count() << " ms: replicas " << join_ids(arrived)
      << " arrived, replicas " << join_ids(missing) << " did not";
  fail_slot(s, make_caf_error(errc::collective_timeout, out.str()));
}

} // namespace

collective_actor spawn_collective(caf::actor_system& sys, collective_config cfg, bool detached) {
  auto impl = [cfg = std::move(cfg)](self_ptr self) -> collective_actor::behavior_type {
    self->state.cfg = cfg;
    for (size_t i = 0; i < cfg.replica_ids.size(); ++i)
      self->state.position.emplace(cfg.replica_ids[i], i);
    return {
        [self](collect_atom, collective_call& call) -> caf::result<nest> {
          reply_to reply;
          reply.promise = self->make_response_promise<nest>();
          auto promise = reply.promise;
          on_call(self, call, std::move(reply));
          return promise;
        },
        [self](collect_atom, collective_call& call, nest_state& state) {
          reply_to reply;
          reply.state = std::move(state);
          on_call(self, call, std::move(reply));
        },
        [self](done_atom, step_report& report) { on_report(self, report); },
        [self](deadline_atom, step_id step, uint32_t seq) { on_deadline(self, step, seq); },
        [](reduce_atom, host_reduce& req) -> caf::result<nest> {
          try {
            return reduce_components(req.op, req.components, req.axis);
          } catch (const std::exception& e) {
            return error_of(e);
          }
        },
        [](gather_atom, host_gather& req) -> caf::result<nest> {
          try {
            return concat_components(req.components, req.axis);
          } catch (const std::exception& e) {
            return error_of(e);
          }
        },
        [](reduce_atom, host_reduce& req, nest_state& state) {
          try {
            state->set_value(reduce_components(req.op, req.components, req.axis));
          } catch (...) {
            state->set_error(std::current_exception());
          }
        },
        [](gather_atom, host_gather& req, nest_state& state) {
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
