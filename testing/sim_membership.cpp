// The membership of an elastic consort::testing::cluster (see sim_membership.hpp).

#include "testing/sim_membership.hpp"

#include <consort/error.hpp>

#include <algorithm>
#include <chrono>

namespace consort::testing::detail {

namespace membership = transport::membership;
using consort::detail::strategy_access;

namespace {

/// How long `reform` waits for a next epoch that never comes (the group did not change), in
/// real time: the service's rendezvous_timeout.
constexpr std::chrono::seconds no_change_bound{30};

/// "worker:1, worker:3".
std::string names_of(const std::vector<int>& workers) {
  std::string text;
  for (int w : workers)
    text += (text.empty() ? "worker:" : ", worker:") + std::to_string(w);
  return text;
}

} // namespace

sim_membership::sim_membership(std::shared_ptr<sim_world> world, int workers, int min_workers,
                               int max_restarts, std::chrono::milliseconds peer_timeout,
                               std::vector<std::string> devices)
    : world_(std::move(world)), workers_(workers), min_workers_(min_workers),
      peer_timeout_(peer_timeout), devices_(std::move(devices)),
      lost_(static_cast<size_t>(workers), false), incarnation_(static_cast<size_t>(workers), 0),
      restarts_left_(max_restarts), left_out_(static_cast<size_t>(workers), false),
      left_cause_(static_cast<size_t>(workers)),
      left_as_chief_(static_cast<size_t>(workers), false) {
  for (int w = 0; w < workers_; ++w)
    members_.push_back(w);
  epochs_[1] = {members_, false, 0};
  auto contexts = world_->make_contexts();
  for (int w = 0; w < workers_; ++w)
    pending_[{1, w}] = std::move(contexts[static_cast<size_t>(w)]);
  thread_ = std::thread([this] { run(); });
}

sim_membership::~sim_membership() {
  stop();
}

void sim_membership::stop() {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id())
    thread_.join();
}

void sim_membership::set_strategies(std::vector<multi_worker_mirrored_strategy*> strategies,
                                    restarter restart) {
  std::lock_guard<std::mutex> guard{mtx_};
  strategies_ = std::move(strategies);
  restart_ = std::move(restart);
}

membership::view sim_membership::view_of(uint64_t epoch, const std::vector<int>& members) const {
  membership::view v;
  v.epoch = epoch;
  v.group_id = 0x5e1a571c00000000ULL + epoch;
  for (size_t r = 0; r < members.size(); ++r) {
    membership::member m;
    m.rank = static_cast<int>(r);
    m.task = task_id{"worker", members[r]};
    m.address = "sim-worker-" + std::to_string(members[r]) + ":0";
    for (const auto& d : devices_)
      m.devices.push_back({d, false, 0});
    v.members.push_back(std::move(m));
  }
  return v;
}

membership::view sim_membership::first_view() const {
  std::vector<int> everyone;
  for (int w = 0; w < workers_; ++w)
    everyone.push_back(w);
  return view_of(1, everyone);
}

strategy_access::simulated_membership sim_membership::for_worker(int w) {
  strategy_access::simulated_membership m;
  int incarnation = 0;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    incarnation = incarnation_[static_cast<size_t>(w)];
  }
  // Weak: a worker's strategy may outlive the cluster's membership (it goes first at the end).
  auto gone = [w] {
    return error(errc::shutdown,
                 "worker:" + std::to_string(w) + ": the consort::testing cluster is gone");
  };
  m.next_view = [self = weak_from_this(), w, incarnation, gone](uint64_t after) {
    auto me = self.lock();
    if (!me)
      throw gone();
    return me->next_view(w, incarnation, after);
  };
  m.rejoin = [self = weak_from_this(), w, gone] {
    auto me = self.lock();
    if (!me)
      throw gone();
    return me->rejoin_left_out(w);
  };
  m.context = [self = weak_from_this(), w, gone](const membership::view& v) {
    auto me = self.lock();
    if (!me)
      throw gone();
    return me->context(w, v);
  };
  return m;
}

membership::view sim_membership::next_view(int w, int incarnation, uint64_t after) {
  const std::string me = "worker:" + std::to_string(w);
  std::unique_lock<std::mutex> lock{mtx_};
  const auto until = std::chrono::steady_clock::now() + no_change_bound;
  for (;;) {
    if (incarnation != incarnation_[static_cast<size_t>(w)])
      throw_error(errc::peer_lost, "this process of " + me +
                                       " was killed by the test harness; a new process of its "
                                       "task took its place in the group");
    if (lost_[static_cast<size_t>(w)])
      throw_error(errc::peer_lost,
                  me + " was killed by the test harness; it takes part in no later epoch");
    if (ended_)
      throw_error(errc::peer_lost, "the elastic group ended: " + end_cause_);
    if (stopping_)
      throw_error(errc::shutdown, me + ": the consort::testing cluster is going");
    if (epoch_ > after) {
      // The latest epoch, but for one that a join forms at a step boundary: a worker that has
      // not reached the epoch it follows goes there first (as the chief's views come in order).
      auto e = epoch_;
      for (auto it = epochs_.find(e);
           it != epochs_.end() && it->second.at_boundary && it->second.base > after;
           it = epochs_.find(e))
        e = it->second.base;
      const auto& members = epochs_.at(e).members;
      if (std::find(members.begin(), members.end(), w) == members.end())
        throw_error(errc::peer_lost, "the group's epoch " + std::to_string(e) + " leaves " + me +
                                         " out" +
                                         (left_out_[static_cast<size_t>(w)]
                                              ? ": " + left_cause_[static_cast<size_t>(w)]
                                              : ""));
      return view_of(e, members);
    }
    if (cv_.wait_until(lock, until) == std::cv_status::timeout && epoch_ <= after && !ended_)
      throw_error(errc::collective_timeout,
                  "re-forming the group after epoch " + std::to_string(after) + " as " + me +
                      ": no next epoch formed within " + std::to_string(no_change_bound.count()) +
                      " s (the group did not change)");
  }
}

transport::context_ptr sim_membership::context(int w, const membership::view& v) {
  std::lock_guard<std::mutex> guard{mtx_};
  auto it = pending_.find({v.epoch, w});
  if (it == pending_.end())
    throw_error(errc::invalid_argument, "consort::testing: worker " + std::to_string(w) +
                                            " has no context of epoch " + std::to_string(v.epoch) +
                                            " (taken already?)");
  auto ctx = std::move(it->second);
  pending_.erase(it);
  return ctx;
}

std::string sim_membership::restart_refusal_locked(int w, errc* code) const {
  const std::string me = "worker:" + std::to_string(w);
  if (code)
    *code = errc::invalid_argument;
  if (ended_)
    return me + " cannot rejoin: the elastic group ended (" + end_cause_ + ")";
  auto it = std::find(members_.begin(), members_.end(), w);
  if (lost_[static_cast<size_t>(w)] || it == members_.end())
    return me + " is not a live member of the group (epoch " + std::to_string(epoch_) +
           "); a restart replaces a live member's process";
  if (code)
    *code = errc::unsupported;
  if (it == members_.begin())
    return me + " is the group's chief (rank 0 of epoch " + std::to_string(epoch_) +
           "), and a restarted chief does not rejoin (docs/multi_worker.md, \"What is not "
           "done\"): kill it instead";
  return {};
}

std::string sim_membership::restart_refusal(int w, errc* code) const {
  std::lock_guard<std::mutex> guard{mtx_};
  return restart_refusal_locked(w, code);
}

std::string sim_membership::rejoin_refusal_locked(int w, errc* code) const {
  const std::string me = "worker:" + std::to_string(w);
  if (code)
    *code = errc::invalid_argument;
  if (ended_)
    return me + " cannot rejoin: the elastic group ended (" + end_cause_ + ")";
  if (!lost_[static_cast<size_t>(w)])
    return me + " is alive (a restart of a live worker replaces its process in place)";
  if (code)
    *code = errc::unsupported;
  if (w == 0)
    return me + " is the chief's task, whose new process starts a rendezvous of its own instead "
                "of joining (docs/multi_worker.md, \"What is not done\"): it is not restarted";
  return {};
}

void sim_membership::rejoin(int w) {
  std::lock_guard<std::mutex> change{change_mtx_};
  errc code = errc::none;
  std::vector<int> base_members;
  uint64_t base = 0;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (auto why = rejoin_refusal_locked(w, &code); !why.empty())
      throw_error(code, "consort::testing::cluster::restart: " + why);
    base = epoch_;
    base_members = members_;
  }
  form_join(w, base, base_members, {}, 0, {}, true);
}

void sim_membership::lost(int w, bool in_place) {
  remove(w, in_place ? removal::killed_restarted : removal::killed);
}

void sim_membership::remove(int w, removal how) {
  std::lock_guard<std::mutex> change{change_mtx_};
  std::vector<int> next_members;
  std::string cause;
  uint64_t next = 0;
  bool in_place = how == removal::killed_restarted;
  bool no_quorum = false;
  bool at_boundary = false; // a new process of its task joins at the survivors' next boundary
  multi_worker_mirrored_strategy* victim = nullptr;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (lost_[static_cast<size_t>(w)] || left_out_[static_cast<size_t>(w)])
      return;
    if (how == removal::silent) {
      // Not dead: left out, and told so when it resumes (`resumed`).
      left_out_[static_cast<size_t>(w)] = true;
    } else {
      in_place = in_place && restart_ && restart_refusal_locked(w, nullptr).empty();
      at_boundary = !in_place && restart_ && restarts_left_ > 0 && w != 0;
      lost_[static_cast<size_t>(w)] = true;
      if (static_cast<size_t>(w) < strategies_.size())
        victim = strategies_[static_cast<size_t>(w)];
    }
  }
  // The dead worker's own calls end at once (a killed process waits for nothing); its thread
  // lives on here.
  if (victim)
    strategy_access::membership_event(
        *victim, 0, "worker:" + std::to_string(w) + ": this worker was killed by the test harness");
  {
    std::lock_guard<std::mutex> guard{mtx_};
    auto it = std::find(members_.begin(), members_.end(), w);
    if (ended_ || it == members_.end()) {
      cv_.notify_all(); // its own reform, if waiting, learns it is out
      return;
    }
    cause =
        "worker:" + std::to_string(w) + " (rank " + std::to_string(it - members_.begin()) +
        (how == removal::silent ? "): no heartbeat for " + std::to_string(peer_timeout_.count()) +
                                      " ms" + " (hung by the test harness)"
                                : "): connection closed without leave (killed by the test "
                                  "harness)");
    if (how == removal::silent) {
      left_cause_[static_cast<size_t>(w)] = cause;
      left_as_chief_[static_cast<size_t>(w)] = it == members_.begin();
    }
    next_members = members_;
    if (in_place)
      cause += "; a new process of its task joins in its place";
    else
      next_members.erase(next_members.begin() + (it - members_.begin()));
    // A chief that fell silent may lead on behind a partition: its successor's side needs more
    // than half of the epoch's members, as the membership service's quorum (docs/multi_worker.md,
    // "Partitions"; one silent non-chief leaves the chief's side at least half).
    no_quorum = how == removal::silent && it == members_.begin() &&
                2 * next_members.size() <= members_.size();
    if (static_cast<int>(next_members.size()) >= min_workers_ && !no_quorum)
      next = epoch_ + 1;
    at_boundary = at_boundary && next > 0;
    if (at_boundary)
      --restarts_left_;
  }
  // The next epoch's contexts exist before any survivor hears of it, and so does a restarted
  // worker's new process.
  std::vector<transport::context_ptr> contexts;
  if (next > 0)
    contexts = world_->make_group(next, next_members);
  std::vector<multi_worker_mirrored_strategy*> told;
  restarter make;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (next > 0) {
      epoch_ = next;
      epochs_[next] = {next_members, false, 0};
      for (size_t r = 0; r < next_members.size(); ++r)
        pending_[{next, next_members[r]}] = std::move(contexts[r]);
    } else {
      ended_ = true;
      cause += no_quorum ? "; " + std::to_string(next_members.size()) + " of the " +
                               std::to_string(members_.size()) + " members of epoch " +
                               std::to_string(epoch_) +
                               " remain, not a majority, and the lost chief may go on with the "
                               "others behind a partition (a successor needs more than half)"
                         : "; " + std::to_string(next_members.size()) +
                               " workers remain, fewer than the minimum of " +
                               std::to_string(min_workers_);
      end_cause_ = cause;
    }
    members_ = next_members;
    if (in_place) {
      ++incarnation_[static_cast<size_t>(w)];
      lost_[static_cast<size_t>(w)] = false;
      make = restart_;
    }
    for (int m : next_members)
      if (m != w && static_cast<size_t>(m) < strategies_.size() &&
          strategies_[static_cast<size_t>(m)])
        told.push_back(strategies_[static_cast<size_t>(m)]);
  }
  if (at_boundary) {
    // Restarted under its task (cluster_options::max_restarts): it joins the survivors' epoch
    // at their next step boundary; they hear of the join before they hear of the loss, as the
    // chief's notices would reach them if the new process's Join came at once.
    form_join(w, next, next_members, told, next, cause, true);
    return;
  }
  if (make) {
    // Its strategy starts in the new epoch (it takes its context there), as a process that
    // joined a running group; then it lives on the network. In this order, whoever sees the
    // worker alive again finds its new strategy (cluster::alive, then cluster::restarts).
    auto* fresh = make(w, view_of(next, next_members));
    {
      std::lock_guard<std::mutex> guard{mtx_};
      strategies_[static_cast<size_t>(w)] = fresh;
    }
    world_->revive(w, next);
  }
  cv_.notify_all();
  for (auto* s : told)
    strategy_access::membership_event(*s, next, cause);
}

membership::view sim_membership::form_join(int w, uint64_t base, std::vector<int> members,
                                           std::vector<multi_worker_mirrored_strategy*> told,
                                           uint64_t loss_epoch, const std::string& loss_cause,
                                           bool new_process) {
  members.insert(std::upper_bound(members.begin(), members.end(), w), w);
  const auto rank = std::find(members.begin(), members.end(), w) - members.begin();
  const uint64_t next = base + 1;
  const std::string joins = "worker:" + std::to_string(w) + " (rank " + std::to_string(rank) +
                            ") joins the group" +
                            (new_process ? " (a new process of its task, started by the test "
                                           "harness)"
                                         : " again (left out while it hung)");
  auto contexts = world_->make_group(next, members);
  restarter make;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    epoch_ = next;
    epochs_[next] = {members, true, base};
    for (size_t r = 0; r < members.size(); ++r)
      pending_[{next, members[r]}] = std::move(contexts[r]);
    members_ = members;
    if (new_process) {
      ++incarnation_[static_cast<size_t>(w)];
      lost_[static_cast<size_t>(w)] = false;
      make = restart_;
    }
    if (loss_epoch == 0) // a join alone: every member of the base epoch hears of it
      for (int m : members)
        if (m != w && static_cast<size_t>(m) < strategies_.size() &&
            strategies_[static_cast<size_t>(m)])
          told.push_back(strategies_[static_cast<size_t>(m)]);
  }
  const auto v = view_of(next, members);
  if (make) {
    // As for a restart in place: the new process's strategy first, then it lives on the
    // network.
    auto* fresh = make(w, v);
    {
      std::lock_guard<std::mutex> guard{mtx_};
      strategies_[static_cast<size_t>(w)] = fresh;
    }
    world_->revive(w, next);
  }
  cv_.notify_all();
  for (auto* s : told) {
    strategy_access::membership_boundary(*s, next, joins);
    if (loss_epoch > 0)
      strategy_access::membership_event(*s, loss_epoch, loss_cause);
  }
  return v;
}

std::string sim_membership::crashed(int w, bool restart) {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (restart) {
      if (auto why = restart_refusal_locked(w, nullptr); !why.empty())
        return why;
    }
    crashes_.push_back({w, restart ? removal::killed_restarted : removal::killed});
  }
  cv_.notify_all();
  return {};
}

void sim_membership::silent(int w) {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    crashes_.push_back({w, removal::silent});
  }
  cv_.notify_all();
}

void sim_membership::settle() {
  std::unique_lock<std::mutex> lock{mtx_};
  // Bounded: a change tells strategies, which never wait for the test's thread.
  cv_.wait_for(lock, no_change_bound,
               [this] { return (crashes_.empty() && splits_.empty() && !handling_) || stopping_; });
}

void sim_membership::split(std::set<int> side) {
  {
    std::lock_guard<std::mutex> guard{mtx_};
    splits_.push_back(std::move(side));
  }
  cv_.notify_all();
}

void sim_membership::handle_split(const std::set<int>& side) {
  std::lock_guard<std::mutex> change{change_mtx_};
  std::vector<int> a, b, kept; // the chief's side, the other, the side that goes on
  std::string cause;
  uint64_t next = 0;
  uint64_t epoch = 0;
  int successor = -1;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (ended_ || members_.empty())
      return;
    const bool chief_cut = side.count(members_.front()) > 0;
    for (int m : members_)
      ((side.count(m) > 0) == chief_cut ? a : b).push_back(m);
    if (b.empty())
      return; // the cut runs through no epoch's members
    epoch = epoch_;
    successor = members_.size() >= 2 ? members_[1] : -1;
    const auto n = members_.size();
    const bool successor_on_b = std::find(b.begin(), b.end(), successor) != b.end();
    if (2 * a.size() >= n) {
      kept = a; // the chief's side: half or more
      cause = names_of(b) + " sent no heartbeat for " + std::to_string(peer_timeout_.count()) +
              " ms (partitioned by the test harness)";
    } else if (successor_on_b && 2 * b.size() > n) {
      kept = b; // the successor's side: more than half
      cause = names_of(a) + " (the chief's side) sent no heartbeat for " +
              std::to_string(peer_timeout_.count()) +
              " ms (partitioned by the test harness); worker:" + std::to_string(successor) +
              " succeeds the chief";
    }
    if (!kept.empty() && static_cast<int>(kept.size()) >= min_workers_)
      next = epoch_ + 1;
  }
  // Why a side without its quorum ends (as the service's quorum_refusal says it).
  const auto n = a.size() + b.size();
  const auto why_ended = [&](bool chief_side) -> std::string {
    const auto& mine = chief_side ? a : b;
    const std::string head = "the group of workers ended: " + std::to_string(mine.size()) +
                             " of the " + std::to_string(n) + " members of epoch " +
                             std::to_string(epoch) + " remain, ";
    if (chief_side)
      return head + "fewer than half, and the others may go on under a successor behind a "
                    "partition (the chief needs half)";
    if (std::find(b.begin(), b.end(), successor) == b.end())
      return head + "and the chief's successor worker:" + std::to_string(successor) +
             " is on the other side of the partition";
    return head + "not a majority, and the lost chief may go on with the others behind a "
                  "partition (a successor needs more than half)";
  };
  std::vector<transport::context_ptr> contexts;
  if (next > 0)
    contexts = world_->make_group(next, kept);
  std::vector<std::pair<multi_worker_mirrored_strategy*, std::string>> ended;
  std::vector<multi_worker_mirrored_strategy*> told;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    const auto strategy_of = [this](int w) {
      return static_cast<size_t>(w) < strategies_.size() ? strategies_[static_cast<size_t>(w)]
                                                         : nullptr;
    };
    for (const auto* part : {&a, &b}) {
      if (*part == kept)
        continue;
      for (int w : *part) {
        lost_[static_cast<size_t>(w)] = true; // its group ended: it is in no later epoch
        if (auto* s = strategy_of(w))
          ended.emplace_back(s, why_ended(part == &a));
      }
    }
    if (next > 0) {
      epoch_ = next;
      epochs_[next] = {kept, false, 0};
      for (size_t r = 0; r < kept.size(); ++r)
        pending_[{next, kept[r]}] = std::move(contexts[r]);
      members_ = kept;
      for (int m : kept)
        if (auto* s = strategy_of(m))
          told.push_back(s);
    } else {
      ended_ = true;
      end_cause_ = kept.empty() ? "no side of the partition keeps its quorum"
                                : cause + "; " + std::to_string(kept.size()) +
                                      " workers remain, fewer than the minimum of " +
                                      std::to_string(min_workers_);
      for (int m : kept)
        if (auto* s = strategy_of(m))
          ended.emplace_back(s, "the group of workers ended: " + end_cause_);
      members_.clear();
    }
  }
  cv_.notify_all();
  for (auto& [s, why] : ended)
    strategy_access::membership_event(*s, 0, why, false);
  for (auto* s : told)
    strategy_access::membership_event(*s, next, cause);
}

void sim_membership::resumed(int w) {
  settle(); // a silence found before it resumed is handled first
  multi_worker_mirrored_strategy* s = nullptr;
  std::string cause;
  bool chief = false;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    if (!left_out_[static_cast<size_t>(w)] || static_cast<size_t>(w) >= strategies_.size())
      return;
    s = strategies_[static_cast<size_t>(w)];
    chief = left_as_chief_[static_cast<size_t>(w)];
    cause = chief ? "worker:" + std::to_string(w) +
                        ": the others went on under a successor while "
                        "this worker, their chief, was stopped (" +
                        left_cause_[static_cast<size_t>(w)] +
                        "); a stopped chief is replaced, "
                        "not waited for"
                  : "the chief left this worker out of the group: " +
                        left_cause_[static_cast<size_t>(w)] +
                        "; the others went on without it (a new process of this task joins them)";
  }
  if (!s)
    return;
  if (chief) // as in production: it ends with peer_lost
    strategy_access::membership_event(*s, 0, cause);
  else
    strategy_access::membership_left_out(*s, cause);
}

membership::view sim_membership::rejoin_left_out(int w) {
  std::lock_guard<std::mutex> change{change_mtx_};
  uint64_t base = 0;
  std::vector<int> base_members;
  {
    std::lock_guard<std::mutex> guard{mtx_};
    const std::string me = "worker:" + std::to_string(w);
    if (!left_out_[static_cast<size_t>(w)])
      throw_error(errc::invalid_argument,
                  me + " was not left out of the group: it has no group to join again");
    if (ended_)
      throw_error(errc::peer_lost,
                  me + " was left out, and joining again found no elastic group: " + end_cause_);
    if (left_as_chief_[static_cast<size_t>(w)])
      throw_error(errc::peer_lost, me + " was the group's chief when the others left it out, and "
                                        "a deposed chief does not rejoin (docs/multi_worker.md, "
                                        "\"What is not done\")");
    left_out_[static_cast<size_t>(w)] = false;
    base = epoch_;
    base_members = members_;
  }
  return form_join(w, base, base_members, {}, 0, {}, false);
}

uint64_t sim_membership::epoch() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return epoch_;
}

std::vector<int> sim_membership::members() const {
  std::lock_guard<std::mutex> guard{mtx_};
  return members_;
}

void sim_membership::run() {
  std::unique_lock<std::mutex> lock{mtx_};
  while (!stopping_) {
    if (crashes_.empty() && splits_.empty()) {
      cv_.wait(lock);
      continue;
    }
    if (crashes_.empty()) { // a partition (crashes_ first: they were noted before)
      auto side = std::move(splits_.front());
      splits_.pop_front();
      handling_ = true;
      lock.unlock();
      handle_split(side);
      lock.lock();
      handling_ = false;
      cv_.notify_all();
      continue;
    }
    const auto [w, how] = crashes_.front();
    crashes_.pop_front();
    handling_ = true;
    std::vector<int> others;
    for (int m : members_)
      if (m != w)
        others.push_back(m);
    lock.unlock();
    if (how != removal::silent) // a filter's crash: the others finish what they can first
      world_->close_when_quiet(w, others, std::chrono::seconds(2));
    remove(w, how);
    lock.lock();
    handling_ = false;
    cv_.notify_all();
  }
}

} // namespace consort::testing::detail
