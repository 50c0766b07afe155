#include "actors/call_matcher.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>

#include <algorithm>
#include <exception>
#include <sstream>

namespace consort::detail {

void reply_to::deliver(const nest& value) {
  if (state)
    state->set_value(value); // a second answer is dropped (the first one wins)
}

void reply_to::deliver(const caf::error& err) {
  if (state)
    state->set_error(std::make_exception_ptr(to_consort_error(err, "")));
}

call_matcher::call_matcher(const std::vector<int>& replica_ids, int num_in_sync,
                           std::chrono::milliseconds default_timeout)
    : num_in_sync_(num_in_sync > 0 ? num_in_sync : static_cast<int>(replica_ids.size())),
      default_timeout_(default_timeout) {
  for (size_t i = 0; i < replica_ids.size(); ++i)
    position_.emplace(replica_ids[i], i);
}

size_t call_matcher::slots() const {
  size_t n = 0;
  for (const auto& [step, entry] : steps_)
    n += entry.slots.size();
  return n;
}

void call_matcher::drop_deadline(slot& s) {
  if (s.deadline) {
    deadlines_.erase(*s.deadline);
    s.deadline.reset();
  }
}

void call_matcher::erase(step_id step, uint32_t seq) {
  auto step_it = steps_.find(step);
  if (step_it == steps_.end())
    return;
  auto slot_it = step_it->second.slots.find(seq);
  if (slot_it == step_it->second.slots.end())
    return;
  drop_deadline(slot_it->second);
  step_it->second.slots.erase(slot_it);
}

void call_matcher::arm(const executor& exec) {
  if (deadlines_.empty())
    return;
  auto first = deadlines_.begin()->first;
  if (first >= armed_for_)
    return;
  armed_for_ = first;
  if (exec.arm_tick)
    exec.arm_tick(first);
}

void call_matcher::fail(slot& s, const caf::error& err, const executor& exec) {
  drop_deadline(s);
  s.failure = err;
  for (size_t i = 0; i < s.replies.size(); ++i) {
    if (s.calls[i] && s.replies[i].pending())
      s.replies[i].deliver(err);
  }
  if (exec.failed)
    exec.failed(s);
}

caf::error call_matcher::never_called(const slot& s, uint32_t seq,
                                      const step_report& report) const {
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

void call_matcher::call(collective_call& call, reply_to reply, clock::time_point now,
                        const executor& exec) {
  // Peers that finished before any collective of the step was flagged sent no report of their
  // own; the caller carries them.
  for (auto& report : call.finished_peers)
    this->report(report, exec);
  auto pos_it = position_.find(call.replica);
  if (pos_it == position_.end()) {
    reply.deliver(make_caf_error(errc::invalid_argument, "collective call from replica " +
                                                             std::to_string(call.replica) +
                                                             ", which is not in this group"));
    return;
  }
  auto pos = pos_it->second;
  auto n = position_.size();
  auto& entry = steps_[call.step];
  if (entry.reports.empty())
    entry.reports.resize(n);
  auto [it, fresh] = entry.slots.try_emplace(call.seq);
  auto& s = it->second;
  auto leaves = flatten(call.request.value);
  if (fresh) {
    s.step = call.step;
    s.seq = call.seq;
    s.calls.resize(n);
    s.replies.resize(n);
    s.sig = signature_from(call, leaves);
    s.what = describe_slot(s.sig, call.step, call.seq);
    s.timeout = call.request.timeout.value_or(default_timeout_);
    // A peer may already have finished the step without this call.
    for (auto& report : entry.reports) {
      if (report && report->calls <= call.seq) {
        s.failure = never_called(s, call.seq, *report);
        break;
      }
    }
    if (!s.failure) {
      int64_t axis = call.request.axis;
      auto problem = check_arguments(call, leaves, num_in_sync_, &axis);
      if (problem.empty()) {
        s.sig.axis = axis;
        s.deadline = deadlines_.emplace(now + s.timeout, std::pair{call.step, call.seq});
        arm(exec);
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
      fail(s, make_caf_error(errc::collective_mismatch, problem), exec);
  }
  s.calls[pos] = std::move(call);
  ++s.arrived;
  if (s.failure) {
    reply.deliver(s.failure);
    if (exec.failed)
      exec.failed(s);
    return;
  }
  s.replies[pos] = std::move(reply);
  if (s.arrived < n)
    return;
  // Everyone is here: the executor answers them all (or fails the slot, which then stays for
  // the step's reports).
  auto step = s.step;
  auto seq = s.seq;
  exec.complete(s);
  if (!s.failure)
    erase(step, seq);
}

void call_matcher::report(step_report& report, const executor& exec) {
  auto pos_it = position_.find(report.replica);
  if (pos_it == position_.end())
    return;
  auto& entry = steps_[report.step];
  if (entry.reports.empty())
    entry.reports.resize(position_.size());
  if (entry.reports[pos_it->second])
    return;
  // Every pending call this replica will never make fails now, not at its deadline.
  for (auto& [seq, s] : entry.slots) {
    if (seq >= report.calls && !s.failure)
      fail(s, never_called(s, seq, report), exec);
  }
  auto step = report.step;
  entry.reports[pos_it->second] = std::move(report);
  if (++entry.reported == position_.size()) {
    for (auto& [seq, s] : entry.slots)
      drop_deadline(s);
    steps_.erase(step);
  }
}

void call_matcher::expire(clock::time_point now, const executor& exec) {
  armed_for_ = clock::time_point::max();
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    auto [step, seq] = deadlines_.begin()->second;
    auto step_it = steps_.find(step);
    if (step_it != steps_.end()) {
      auto slot_it = step_it->second.slots.find(seq);
      if (slot_it != step_it->second.slots.end())
        slot_it->second.deadline.reset();
    }
    deadlines_.erase(deadlines_.begin());
    timed_out(step, seq, exec);
  }
  arm(exec);
}

void call_matcher::timed_out(step_id step, uint32_t seq, const executor& exec) {
  auto step_it = steps_.find(step);
  if (step_it == steps_.end())
    return;
  auto slot_it = step_it->second.slots.find(seq);
  if (slot_it == step_it->second.slots.end() || slot_it->second.failure)
    return;
  auto& s = slot_it->second;
  std::vector<int> arrived;
  std::vector<int> missing;
  for (auto& [id, pos] : position_)
    (s.calls[pos] ? arrived : missing).push_back(id);
  std::sort(arrived.begin(), arrived.end());
  std::sort(missing.begin(), missing.end());
  std::ostringstream out;
  out << s.what << " timed out after " << s.timeout.count() << " ms: replicas " << join_ids(arrived)
      << " arrived, replicas " << join_ids(missing) << " did not";
  fail(s, make_caf_error(errc::collective_timeout, out.str()), exec);
}

} // namespace consort::detail
