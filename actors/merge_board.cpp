#include "actors/merge_board.hpp"

#include <algorithm>
#include <exception>
#include <sstream>
#include <utility>

namespace consort::detail {

merge_board::merge_board(uint64_t step, std::vector<int> replica_ids)
    : step_(step), replica_ids_(std::move(replica_ids)), finished_calls_(replica_ids_.size(), -1),
      finish_failures_(replica_ids_.size()) {}

std::string merge_board::where(uint32_t seq) const {
  return "merge_call #" + std::to_string(seq) + " of step " + std::to_string(step_);
}

void merge_board::fail_locked(slot& s, errc code, std::string message) {
  if (s.done || s.failure)
    return;
  s.failure.emplace(code, std::move(message));
  cv_.notify_all();
}

void merge_board::check_finished_locked(uint32_t seq, slot& s) {
  for (size_t i = 0; i < replica_ids_.size(); ++i) {
    if (s.arrived[i] || finished_calls_[i] < 0 || finished_calls_[i] > int64_t{seq})
      continue;
    const auto& why = finish_failures_[i];
    fail_locked(s, errc::collective_aborted,
                where(seq) + ": replica " + std::to_string(replica_ids_[i]) +
                    (why.empty() ? " finished its step without calling it (it made " +
                                       std::to_string(finished_calls_[i]) + " merge calls)"
                                 : " failed before calling it: " + why));
    return;
  }
}

nest merge_board::call(size_t index, uint32_t seq, std::vector<nest> args,
                       const std::type_info& signature, const runner& run,
                       std::chrono::milliseconds timeout, std::chrono::milliseconds run_timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto n = replica_ids_.size();
  std::unique_lock<std::mutex> guard{mu_};
  auto& s = slots_[seq];
  if (s.arrived.empty()) {
    s.args.resize(n);
    s.arrived.assign(n, false);
  }
  if (index >= n || s.arrived[index])
    throw error(errc::invalid_argument, where(seq) + ": local replica " + std::to_string(index) +
                                            " called it twice, or is not a replica of the step");
  s.arrived[index] = true;
  s.args[index] = std::move(args);
  ++s.count;
  if (!s.signature) {
    s.signature = &signature;
    s.signature_of = index;
  } else if (*s.signature != signature) {
    const auto a = std::min(replica_ids_[s.signature_of], replica_ids_[index]);
    const auto b = std::max(replica_ids_[s.signature_of], replica_ids_[index]);
    fail_locked(s, errc::collective_mismatch,
                where(seq) + ": replicas " + std::to_string(a) + " and " + std::to_string(b) +
                    " called merge_call with different functions or arguments; every replica "
                    "must make the same merge calls in the same order");
  }
  check_finished_locked(seq, s);
  if (!s.failure && s.count == n) {
    // The last to arrive runs the merge function, outside the lock: it may reduce across workers.
    s.running = true;
    s.runner_index = index;
    s.run_started = std::chrono::steady_clock::now();
    auto all = std::move(s.args);
    // The waiters switch from the call's deadline to the step deadline measured from now.
    cv_.notify_all();
    guard.unlock();
    std::vector<nest> results;
    std::optional<std::pair<errc, std::string>> failed;
    try {
      results = run(all);
      if (results.size() != n)
        failed.emplace(errc::invalid_argument,
                       "the merge function gave " + std::to_string(results.size()) +
                           " results for " + std::to_string(n) + " local replicas");
    } catch (const error& e) {
      failed.emplace(e.code(), e.what());
    } catch (const std::exception& e) {
      failed.emplace(errc::step_failed, e.what());
    } catch (...) {
      failed.emplace(errc::step_failed, "an exception not derived from std::exception");
    }
    guard.lock();
    s.running = false;
    if (failed) {
      s.failure.emplace(failed->first, where(seq) + ": the merge function, run on replica " +
                                           std::to_string(replica_ids_[index]) +
                                           ", failed: " + failed->second);
    } else {
      s.results = std::move(results);
      s.done = true;
    }
    cv_.notify_all();
  } else {
    // Until every replica arrives the wait has the call's deadline; once the merge function runs,
    // it waits for that, up to `run_timeout` from the function's start (the step deadline).
    auto settled = [&] {
      return s.done || s.failure.has_value();
    };
    while (!settled()) {
      if (s.running) {
        if (cv_.wait_until(guard, s.run_started + run_timeout) == std::cv_status::timeout &&
            !settled() && s.running)
          throw error(errc::step_timeout,
                      where(seq) + " on replica " + std::to_string(replica_ids_[index]) +
                          ": the merge function, running on replica " +
                          std::to_string(replica_ids_[s.runner_index]) +
                          ", has not returned within " + std::to_string(run_timeout.count()) +
                          " ms (the step deadline)");
        continue;
      }
      if (cv_.wait_until(guard, deadline) == std::cv_status::timeout && !settled() && !s.running) {
        std::ostringstream missing;
        bool first = true;
        for (size_t i = 0; i < n; ++i)
          if (!s.arrived[i]) {
            missing << (first ? "" : ", ") << replica_ids_[i];
            first = false;
          }
        fail_locked(s, errc::collective_timeout,
                    where(seq) + " on replica " + std::to_string(replica_ids_[index]) + ": " +
                        "replica(s) " + missing.str() + " did not call it within " +
                        std::to_string(timeout.count()) + " ms");
      }
    }
  }
  if (s.failure)
    throw error(s.failure->first, s.failure->second);
  return s.results[index];
}

void merge_board::finished(size_t index, uint32_t calls, const std::string& failure) {
  std::lock_guard<std::mutex> guard{mu_};
  if (index >= finished_calls_.size())
    return;
  finished_calls_[index] = calls;
  finish_failures_[index] = failure;
  for (auto& [seq, s] : slots_)
    if (!s.done && !s.failure && !s.running)
      check_finished_locked(seq, s);
}

} // namespace consort::detail
