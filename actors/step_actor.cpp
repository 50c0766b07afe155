// The step actor: runs a harness's `run` requests through the step_launcher (which numbers
// steps and fans each out to every replica), and watches the step deadline; the replicas join
// their results in a step_join, the last one completing it.

#include "actors/protocol.hpp"

#include <caf/all.hpp>

#include <algorithm>
#include <deque>
#include <sstream>
#include <unordered_map>

namespace consort {

// -- step_join ------------------------------------------------------------------------------------

namespace {

/// How likely an error is the root cause of a failed step, lower first: a replica's own failure,
/// then replicas that never finished, then collective disagreements, then their echoes.
int rank_of(const caf::error& err) {
  if (err.category() != caf::atom("consort"))
    return 1;
  switch (static_cast<errc>(err.code())) {
  case errc::step_timeout:
    return 1;
  case errc::collective_mismatch:
  case errc::collective_timeout:
    return 2;
  case errc::collective_aborted:
    return 3;
  default:
    return 0;
  }
}

} // namespace

step_join::step_join(step_id step, std::vector<int> replica_ids, completion done)
    : step_(step), replica_ids_(std::move(replica_ids)), done_(std::move(done)),
      values_(replica_ids_.size()), errors_(replica_ids_.size()),
      deposited_(replica_ids_.size(), false), pending_(replica_ids_.size()),
      finished_calls_(std::make_unique<std::atomic<int64_t>[]>(replica_ids_.size())),
      finish_errors_(replica_ids_.size()), merges_(step, replica_ids_) {
  for (size_t i = 0; i < replica_ids_.size(); ++i)
    finished_calls_[i].store(-1, std::memory_order_relaxed);
}

void step_join::deposit(size_t index, nest value) {
  std::unique_lock<std::mutex> guard{mtx_};
  if (complete() || index >= values_.size())
    return;
  values_[index] = std::move(value);
  deposited_[index] = true;
  if (--pending_ == 0)
    finish_locked(guard);
}

void step_join::deposit(size_t index, caf::error failure) {
  std::unique_lock<std::mutex> guard{mtx_};
  if (complete() || index >= errors_.size())
    return;
  errors_[index] = std::move(failure);
  deposited_[index] = true;
  if (--pending_ == 0)
    finish_locked(guard);
}

void step_join::finish_locked(std::unique_lock<std::mutex>& guard) {
  const caf::error* best = nullptr;
  for (const auto& err : errors_)
    if (err && (!best || rank_of(err) < rank_of(*best)))
      best = &err;
  if (best)
    failure_ = *best;
  else
    failure_ = regroup_failure();
  complete_.store(true, std::memory_order_release);
  guard.unlock();
  if (done_)
    done_(*this);
}

caf::error step_join::regroup_failure() const {
  // tf.distribute regroups run's results into one structure with a PerReplica at each leaf, and
  // fails there when the replicas returned different structures; consort fails the run the same
  // way rather than let a later reduce fail far from the cause.
  for (size_t i = 1; i < values_.size(); ++i) {
    auto difference = compare_structure(values_[0], values_[i]);
    if (difference.empty())
      continue;
    return make_caf_error(
        errc::structure_mismatch,
        "step " + std::to_string(step_) + ": replica " + std::to_string(replica_ids_[0]) +
            " returned " + values_[0].structure_string() + " and replica " +
            std::to_string(replica_ids_[i]) + " returned " + values_[i].structure_string() + " (" +
            difference + "); every replica's step must return the same structure");
  }
  return {};
}

bool step_join::expire(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> guard{mtx_};
  if (complete())
    return false;
  std::ostringstream out;
  out << "step " << step_ << " did not finish within the step deadline of " << timeout.count()
      << " ms on replica(s) ";
  bool first = true;
  for (size_t i = 0; i < values_.size(); ++i) {
    if (deposited_[i])
      continue;
    out << (first ? "" : ", ") << replica_ids_[i];
    first = false;
  }
  out << "; a step function that blocks or loops forever holds its replica";
  failure_ = make_caf_error(errc::step_timeout, out.str());
  complete_.store(true, std::memory_order_release);
  guard.unlock();
  if (done_)
    done_(*this);
  return true;
}

step_results step_join::take_results() {
  std::lock_guard<std::mutex> guard{mtx_};
  return step_results{std::move(values_)};
}

bool step_join::mark_finished(size_t index, uint32_t calls, const caf::error& failure) {
  finish_errors_[index] = failure; // published by the seq_cst store below
  finished_calls_[index].store(calls, std::memory_order_seq_cst);
  return calls > 0 || collectives_used_.load(std::memory_order_seq_cst);
}

std::vector<step_report> step_join::mark_collective_used() {
  collectives_used_.store(true, std::memory_order_seq_cst);
  std::vector<step_report> out;
  for (size_t i = 0; i < replica_ids_.size(); ++i) {
    auto calls = finished_calls_[i].load(std::memory_order_seq_cst);
    if (calls >= 0)
      out.push_back(
          step_report{step_, replica_ids_[i], static_cast<uint32_t>(calls), finish_errors_[i]});
  }
  return out;
}

// -- step_launcher --------------------------------------------------------------------------------

step_launcher::step_launcher(caf::actor_system& sys, std::vector<replica_actor> replicas,
                             std::vector<int> replica_ids, std::chrono::milliseconds step_timeout)
    : sys_(sys), replicas_(std::move(replicas)), replica_ids_(std::move(replica_ids)),
      step_timeout_(step_timeout) {}

void step_launcher::watchdog(step_actor hdl) {
  std::lock_guard<std::mutex> guard{mtx_};
  watchdog_ = std::move(hdl);
}

std::chrono::milliseconds step_launcher::tick_interval() const noexcept {
  return std::clamp(step_timeout_ / 8, std::chrono::milliseconds(1),
                    std::chrono::milliseconds(1000));
}

std::shared_ptr<step_join> step_launcher::next_watched_locked(step_join::completion done,
                                                              step_actor& wake) {
  auto join = std::make_shared<step_join>(next_step_++, replica_ids_, std::move(done));
  // Drop completed steps from the front, so the list stays as long as the steps in flight.
  while (!watch_.empty()) {
    auto front = watch_.front().second.lock();
    if (front && !front->complete())
      break;
    watch_.pop_front();
  }
  watch_.emplace_back(
      sys_.clock().now() + std::chrono::nanoseconds{advanced_ns_.load()} + step_timeout_, join);
  if (!armed.exchange(true))
    wake = watchdog_;
  return join;
}

std::shared_ptr<step_join> step_launcher::launch(step_function_ptr fn, step_join::completion done) {
  step_actor wake;
  std::shared_ptr<step_join> join;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    join = next_watched_locked(std::move(done), wake);
    // Sent under the lock: every replica must see steps in the same order. A step that comes
    // while one runs on a caller's thread waits for it to end.
    if (running_here_) {
      waiting_.push_back(step_message{join->step(), fn, join});
    } else {
      for (auto& replica : replicas_)
        caf::anon_send(replica, step_atom_v, step_message{join->step(), fn, join});
      ++given_;
    }
  }
  if (wake)
    caf::anon_send(wake, tick_atom_v);
  return join;
}

void step_launcher::run_here_through(std::shared_ptr<replica_runner> runner) {
  std::lock_guard<std::mutex> guard{mtx_};
  if (replicas_.size() == 1 && runner && runs_on_any_thread(*runner))
    here_ = std::move(runner);
}

std::shared_ptr<step_join> step_launcher::run_here(step_function_ptr fn,
                                                   const std::function<void(step_join&)>& started,
                                                   step_join::completion&& done) {
  step_actor wake;
  std::shared_ptr<step_join> join;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    // Only on an idle replica: every step given to it before has finished, wherever it ran.
    if (!here_ || closed_ || running_here_ || steps_finished(*here_) != given_)
      return nullptr;
    running_here_ = true;
    ++given_;
    join = next_watched_locked(std::move(done), wake);
  }
  if (wake)
    caf::anon_send(wake, tick_atom_v);
  // Whatever happens to the step, the steps that came meanwhile go on, in order, on the
  // replica's thread.
  struct release {
    step_launcher& self;
    ~release() {
      std::lock_guard<std::mutex> guard{self.mtx_};
      self.running_here_ = false;
      for (auto& msg : self.waiting_)
        caf::anon_send(self.replicas_.front(), step_atom_v, std::move(msg));
      self.given_ += self.waiting_.size();
      self.waiting_.clear();
      self.here_ended_.notify_all();
    }
  } release_at_end{*this};
  if (started)
    started(*join);
  step_message msg{join->step(), std::move(fn), join};
  run_replica_step(*here_, msg);
  return join;
}

void step_launcher::close() {
  std::unique_lock<std::mutex> guard{mtx_};
  closed_ = true;
  here_ended_.wait(guard, [this] { return !running_here_; });
}

void step_launcher::advance_clock(std::chrono::nanoseconds by) {
  advanced_ns_ += by.count();
  expire_overdue(sys_.clock().now());
}

std::optional<step_launcher::running_step> step_launcher::oldest_running() {
  const auto now = sys_.clock().now() + std::chrono::nanoseconds{advanced_ns_.load()};
  std::lock_guard<std::mutex> guard{mtx_};
  for (const auto& [deadline, weak] : watch_) {
    auto join = weak.lock();
    if (join && !join->complete())
      return running_step{join->step(),
                          std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now)};
  }
  return std::nullopt;
}

bool step_launcher::expire_overdue(caf::actor_clock::time_point now) {
  now += std::chrono::nanoseconds{advanced_ns_.load()};
  std::vector<std::shared_ptr<step_join>> overdue;
  bool busy = false;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    while (!watch_.empty()) {
      auto& [deadline, weak] = watch_.front();
      auto join = weak.lock();
      if (join && !join->complete()) {
        if (deadline > now)
          break;
        overdue.push_back(std::move(join));
      }
      watch_.pop_front();
    }
    busy = !watch_.empty();
  }
  // Expire outside the lock: completions may launch the next step.
  for (auto& join : overdue)
    join->expire(step_timeout_);
  return busy;
}

// -- the step actor -------------------------------------------------------------------------------

struct step_actor_state {
  std::shared_ptr<step_launcher> launcher;
  /// Joins of `run` requests, waiting to answer their requester.
  std::unordered_map<
      step_id, std::pair<std::shared_ptr<step_join>, caf::typed_response_promise<step_results>>>
      requests;
  static inline const char* name = "consort.steps";
};

namespace {

using self_ptr = step_actor::stateful_pointer<step_actor_state>;

/// The watchdog: expires overdue steps, and keeps ticking while any step runs. When it finds
/// nothing to watch it disarms, and the next launch re-arms it with one `tick`; so exactly one
/// chain of ticks runs at a time.
void on_tick(self_ptr self) {
  auto& launcher = *self->state.launcher;
  if (!launcher.expire_overdue(self->clock().now())) {
    launcher.armed.store(false);
    // A launch between expire_overdue and the store above saw `armed` still set and sent no
    // tick; look once more so that its step is watched. If a launch re-armed meanwhile, its
    // tick continues the chain instead.
    if (!launcher.expire_overdue(self->clock().now()) || launcher.armed.exchange(true))
      return;
  }
  self->delayed_send(self, launcher.tick_interval(), tick_atom_v);
}

step_actor::behavior_type step_actor_impl(self_ptr self, std::shared_ptr<step_launcher> launcher) {
  self->state.launcher = std::move(launcher);
  return {
      [self](run_atom, step_function_ptr& fn) -> caf::result<step_results> {
        auto promise = self->make_response_promise<step_results>();
        // The join may complete on a replica thread, and only the actor may deliver the promise,
        // so the join sends it a `done`. The address keeps no reference alive.
        auto join =
            self->state.launcher->launch(std::move(fn), [addr = self->address()](step_join& j) {
              if (auto hdl = caf::actor_cast<step_actor>(addr))
                caf::anon_send(hdl, joined_atom_v, j.step());
            });
        self->state.requests.emplace(join->step(), std::make_pair(join, promise));
        return promise;
      },
      [self](joined_atom, step_id step) {
        auto it = self->state.requests.find(step);
        if (it == self->state.requests.end())
          return;
        auto& [join, promise] = it->second;
        if (join->failure())
          promise.deliver(join->failure());
        else
          promise.deliver(join->take_results());
        self->state.requests.erase(it);
      },
      [self](tick_atom) { on_tick(self); },
  };
}

} // namespace

step_actor spawn_step_actor(caf::actor_system& sys, std::shared_ptr<step_launcher> launcher) {
  auto hdl = sys.spawn(step_actor_impl, launcher);
  launcher->watchdog(hdl);
  return hdl;
}

step_actor spawn_step_actor(caf::actor_system& sys, std::vector<replica_actor> replicas,
                            std::chrono::milliseconds step_timeout) {
  std::vector<int> ids;
  for (size_t i = 0; i < replicas.size(); ++i)
    ids.push_back(static_cast<int>(i));
  return spawn_step_actor(
      sys, std::make_shared<step_launcher>(sys, std::move(replicas), std::move(ids), step_timeout));
}

} // namespace consort
