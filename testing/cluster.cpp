// consort::testing::cluster: workers of a multi-worker job in one process over the simulated
// network of sim_transport.

#include <consort/testing.hpp>

#include "actors/strategy_access.hpp"
#include "testing/sim_membership.hpp"
#include "testing/sim_transport.hpp"

#include <algorithm>
#include <cstdlib>
#include <set>

namespace consort::testing {

namespace {

/// How long a call of an elastic worker that lost a peer waits (real time) for the membership's
/// verdict, which the harness gives at once.
constexpr std::chrono::milliseconds change_grace{5000};

} // namespace

const char* to_string(fate f) noexcept {
  switch (f) {
  case fate::delivered:
    return "delivered";
  case fate::dropped:
    return "dropped";
  case fate::corrupted:
    return "corrupted";
  case fate::refused:
    return "refused";
  }
  return "?";
}

cluster::cluster(cluster_options opts) : opts_(std::move(opts)), random_(opts_.seed) {
  const std::string who = "consort::testing::cluster: ";
  if (opts_.workers < 2)
    throw_error(errc::invalid_argument,
                who + std::to_string(opts_.workers) +
                    " workers; expected 2 or more (one worker needs no network: use "
                    "mirrored_strategy)");
  if (opts_.replicas_per_worker < 1)
    throw_error(errc::invalid_argument, who + std::to_string(opts_.replicas_per_worker) +
                                            " replicas per worker; expected 1 or more");
  if (opts_.peer_timeout.count() < 0)
    throw_error(errc::invalid_argument, who + "peer_timeout is " +
                                            std::to_string(opts_.peer_timeout.count()) +
                                            " ms; expected 0 or more");
  if (opts_.rendezvous_timeout.count() < 0)
    throw_error(errc::invalid_argument, who + "rendezvous_timeout is " +
                                            std::to_string(opts_.rendezvous_timeout.count()) +
                                            " ms; expected 0 or more");
  if (opts_.elastic_min_workers < 0 || opts_.elastic_min_workers > opts_.workers)
    throw_error(errc::invalid_argument,
                who + "elastic_min_workers is " + std::to_string(opts_.elastic_min_workers) +
                    "; expected 0 (not elastic) or 1 to the number of workers (" +
                    std::to_string(opts_.workers) + ")");
  if (opts_.max_restarts < 0 || (opts_.max_restarts > 0 && opts_.elastic_min_workers == 0))
    throw_error(errc::invalid_argument,
                who + "max_restarts is " + std::to_string(opts_.max_restarts) +
                    "; expected 0, or more on an elastic cluster (elastic_min_workers >= 1): a "
                    "restarted worker joins a running group");
  if (opts_.elastic_min_workers > 0 && !opts_.late.empty())
    throw_error(errc::invalid_argument,
                who + "late workers and elastic_min_workers together are not simulated");
  if (const char* env = std::getenv("CONSORT_TESTING_LOCKSTEP_CHANNELS")) {
    const std::string value{env};
    if (value != "0" && value != "1")
      throw_error(errc::invalid_argument, who + "CONSORT_TESTING_LOCKSTEP_CHANNELS is '" + value +
                                              "'; expected 1 (every cluster's network has "
                                              "lockstep channels) or 0 (none has)");
    opts_.lockstep_channels = value == "1";
  }
  joined_.assign(static_cast<size_t>(opts_.workers), true);
  for (int w : opts_.late) {
    check_index(w, "late");
    if (!joined_[static_cast<size_t>(w)])
      throw_error(errc::invalid_argument,
                  who + "worker " + std::to_string(w) + " is named twice in late");
    joined_[static_cast<size_t>(w)] = false;
  }
  world_ = std::make_shared<detail::sim_world>(opts_.workers, opts_.peer_timeout,
                                               opts_.lockstep_channels);
  rendezvous_deadline_ = world_->now() + opts_.rendezvous_timeout;
  if (opts_.late.empty())
    form();
}

void cluster::form() {
  std::vector<std::string> devices;
  for (int d = 0; d < opts_.replicas_per_worker; ++d)
    devices.push_back("CPU:" + std::to_string(d));
  std::vector<std::unique_ptr<multi_worker_mirrored_strategy>> built;
  if (opts_.elastic_min_workers > 0) {
    membership_ =
        std::make_shared<detail::sim_membership>(world_, opts_.workers, opts_.elastic_min_workers,
                                                 opts_.max_restarts, opts_.peer_timeout, devices);
    auto log = opts_.log ? opts_.log : [](const std::string&) {
    };
    for (int w = 0; w < opts_.workers; ++w)
      built.push_back(consort::detail::strategy_access::simulated_elastic_worker(
          opts_.strategy, w, opts_.workers, devices, opts_.elastic_min_workers,
          membership_->for_worker(w), membership_->first_view(), std::chrono::seconds(1),
          change_grace, log));
    std::vector<multi_worker_mirrored_strategy*> raw;
    for (auto& s : built)
      raw.push_back(s.get());
    membership_->set_strategies(
        raw, [this](int w, const transport::membership::view& v) { return restarted(w, v); });
    std::lock_guard<std::mutex> guard{restarts_mtx_};
    current_ = std::move(raw);
    restarts_.assign(static_cast<size_t>(opts_.workers), 0);
  } else {
    auto contexts = world_->make_contexts();
    for (int w = 0; w < opts_.workers; ++w)
      built.push_back(consort::detail::strategy_access::simulated_worker(
          opts_.strategy, w, opts_.workers, devices, contexts[static_cast<size_t>(w)],
          std::chrono::seconds(1)));
  }
  strategies_ = std::move(built);
  // The actors' step deadlines (step_timeout) move with the network's clock, in event order.
  detail::sim_world::worker_hooks hooks;
  hooks.oldest_step = [this](int rank) {
    return consort::detail::strategy_access::oldest_running_step(checked(rank));
  };
  hooks.on_advanced = [this](std::chrono::nanoseconds step) {
    std::vector<multi_worker_mirrored_strategy*> every;
    for (auto& s : strategies_)
      every.push_back(s.get());
    {
      std::lock_guard<std::mutex> guard{restarts_mtx_};
      for (auto& s : restarted_)
        every.push_back(s.get());
    }
    for (auto* s : every)
      consort::detail::strategy_access::advance_step_clock(*s, step);
  };
  if (membership_) {
    hooks.on_crash = [m = membership_.get()](int w, bool restart) {
      return m->crashed(w, restart);
    };
    hooks.on_silent = [m = membership_.get()](int w) {
      m->silent(w);
    };
    hooks.on_split = [m = membership_.get()](const std::set<int>& side) {
      m->split(side);
    };
  }
  world_->set_worker_hooks(std::move(hooks));
}

cluster::~cluster() {
  world_->set_worker_hooks({});
  // No delivery on the ticker's thread while the workers go (it could hold a worker's last
  // reference to its network); then each worker leaves as at the end of its process.
  world_->stop_ticker();
  // No change of membership while they go.
  if (membership_)
    membership_->stop();
  membership_.reset();
  // Each worker leaves as at the end of its process; the network outlives them all.
  {
    std::lock_guard<std::mutex> guard{restarts_mtx_};
    current_.clear();
  }
  restarted_.clear();
  strategies_.clear();
}

multi_worker_mirrored_strategy* cluster::restarted(int worker,
                                                   const transport::membership::view& v) {
  std::vector<std::string> devices;
  for (int d = 0; d < opts_.replicas_per_worker; ++d)
    devices.push_back("CPU:" + std::to_string(d));
  auto log = opts_.log ? opts_.log : [](const std::string&) {
  };
  auto fresh = consort::detail::strategy_access::simulated_elastic_worker(
      opts_.strategy, worker, opts_.workers, devices, opts_.elastic_min_workers,
      membership_->for_worker(worker), v, std::chrono::seconds(1), change_grace, log);
  std::lock_guard<std::mutex> guard{restarts_mtx_};
  auto* raw = fresh.get();
  restarted_.push_back(std::move(fresh));
  current_[static_cast<size_t>(worker)] = raw;
  ++restarts_[static_cast<size_t>(worker)];
  restarted_cv_.notify_all();
  return raw;
}

multi_worker_mirrored_strategy& cluster::await_restart(int worker, int restarts,
                                                       std::chrono::milliseconds within) {
  check_index(worker, "await_restart");
  std::unique_lock<std::mutex> lock{restarts_mtx_};
  const auto enough = [&] {
    return !restarts_.empty() && restarts_[static_cast<size_t>(worker)] >= restarts;
  };
  if (!restarted_cv_.wait_for(lock, within, enough))
    throw_error(errc::collective_timeout,
                "consort::testing::cluster::await_restart: worker " + std::to_string(worker) +
                    " was restarted " +
                    std::to_string(restarts_.empty() ? 0 : restarts_[static_cast<size_t>(worker)]) +
                    " times within " + std::to_string(within.count()) + " ms; expected " +
                    std::to_string(restarts));
  return *current_[static_cast<size_t>(worker)];
}

void cluster::check_rendezvous() {
  if (formed() || !rendezvous_failure_.empty() || world_->now() < rendezvous_deadline_)
    return;
  std::string missing, joined;
  for (int w = 0; w < opts_.workers; ++w)
    (joined_[static_cast<size_t>(w)] ? joined : missing) +=
        std::string{(joined_[static_cast<size_t>(w)] ? joined : missing).empty() ? "" : ", "} +
        "worker:" + std::to_string(w);
  rendezvous_failure_ = "rendezvous at sim-worker-0:0 timed out after " +
                        std::to_string(opts_.rendezvous_timeout.count()) + " ms: " + missing +
                        " did not join (joined: " + joined + ")";
}

void cluster::join(int worker) {
  check_index(worker, "join");
  const bool late = std::find(opts_.late.begin(), opts_.late.end(), worker) != opts_.late.end();
  if (!late || joined_[static_cast<size_t>(worker)])
    throw_error(errc::invalid_argument,
                "consort::testing::cluster::join: worker " + std::to_string(worker) +
                    (late ? " has already joined" : " is not late (it started with the cluster)"));
  check_rendezvous();
  if (!rendezvous_failure_.empty())
    throw_error(errc::collective_timeout,
                "joining the cluster as worker:" + std::to_string(worker) +
                    ": too late: " + rendezvous_failure_);
  joined_[static_cast<size_t>(worker)] = true;
  if (std::all_of(joined_.begin(), joined_.end(), [](bool j) { return j; }))
    form();
}

std::string cluster::describe() const {
  return std::to_string(opts_.workers) + " workers x " + std::to_string(opts_.replicas_per_worker) +
         " replicas, seed " + std::to_string(opts_.seed);
}

void cluster::check_index(int worker, const char* what) const {
  if (worker < 0 || worker >= opts_.workers)
    throw_error(errc::invalid_argument, std::string{"consort::testing::cluster: "} + what +
                                            ": no worker " + std::to_string(worker) +
                                            "; the workers are 0 to " +
                                            std::to_string(opts_.workers - 1));
}

multi_worker_mirrored_strategy& cluster::checked(int worker) const {
  check_index(worker, "strategy");
  if (!formed())
    throw_error(errc::invalid_argument,
                "consort::testing::cluster: worker " + std::to_string(worker) +
                    " has not started: the cluster is still forming (join the late workers, or "
                    "advance past the rendezvous timeout)");
  std::lock_guard<std::mutex> guard{restarts_mtx_};
  if (!current_.empty())
    return *current_[static_cast<size_t>(worker)];
  return *strategies_[static_cast<size_t>(worker)];
}

multi_worker_mirrored_strategy& cluster::strategy(int worker) {
  check_index(worker, "strategy");
  check_filter();
  if (!formed()) {
    check_rendezvous();
    if (!rendezvous_failure_.empty())
      throw_error(errc::collective_timeout,
                  "joining the cluster as worker:" + std::to_string(worker) + ": " +
                      rendezvous_failure_);
  }
  return checked(worker);
}

void cluster::kill(int worker) {
  check_index(worker, "kill");
  checked(worker);
  world_->kill(worker);
  if (membership_)
    membership_->lost(worker);
}

void cluster::restart(int worker) {
  check_index(worker, "restart");
  checked(worker);
  if (!membership_)
    throw_error(errc::unsupported,
                "consort::testing::cluster::restart: the cluster is not elastic "
                "(cluster_options::elastic_min_workers is 0): there is no running group for a new "
                "process to join (kill the worker instead)");
  if (!world_->alive(worker)) {
    membership_->rejoin(worker); // throws why not
    return;
  }
  errc code = errc::none;
  if (auto why = membership_->restart_refusal(worker, &code); !why.empty())
    throw_error(code, "consort::testing::cluster::restart: " + why);
  world_->kill(worker);
  membership_->lost(worker, true);
}

int cluster::restarts(int worker) const {
  check_index(worker, "restarts");
  std::lock_guard<std::mutex> guard{restarts_mtx_};
  return restarts_.empty() ? 0 : restarts_[static_cast<size_t>(worker)];
}

uint64_t cluster::epoch() const {
  return membership_ ? membership_->epoch() : 1;
}

std::vector<int> cluster::members() const {
  if (membership_)
    return membership_->members();
  std::vector<int> out;
  for (int w = 0; w < opts_.workers; ++w)
    out.push_back(w);
  return out;
}

bool cluster::alive(int worker) const {
  check_index(worker, "alive");
  return world_->alive(worker);
}

void cluster::partition(std::vector<int> side) {
  std::set<int> members;
  for (int w : side) {
    check_index(w, "partition");
    checked(w);
    members.insert(w);
  }
  if (members.empty() || static_cast<int>(members.size()) == workers())
    throw_error(errc::invalid_argument,
                "consort::testing::cluster::partition: the side has " +
                    std::to_string(members.size()) + " of " + std::to_string(workers()) +
                    " workers; expected some but not all (use heal() to end a partition)");
  world_->partition(members);
}

void cluster::hang(int worker) {
  check_index(worker, "hang");
  checked(worker);
  if (!world_->alive(worker))
    throw_error(errc::invalid_argument,
                "consort::testing::cluster::hang: worker " + std::to_string(worker) + " is dead");
  world_->hang(worker);
}

void cluster::resume(int worker) {
  check_index(worker, "resume");
  if (!world_->hung(worker))
    throw_error(errc::invalid_argument, "consort::testing::cluster::resume: worker " +
                                            std::to_string(worker) + " does not hang");
  world_->resume(worker);
  if (membership_)
    membership_->resumed(worker);
}

void cluster::heal() {
  world_->heal();
}

void cluster::on_message(message_filter filter) {
  world_->set_filter(std::move(filter));
}

void cluster::check_filter() const {
  world_->check_filter();
}

void cluster::advance(std::chrono::nanoseconds by) {
  if (by.count() < 0)
    throw_error(errc::invalid_argument,
                "consort::testing::cluster::advance: " + std::to_string(by.count()) +
                    " ns; time only moves forward");
  world_->advance(by);
  if (membership_)
    membership_->settle(); // what the failure detector found is handled
  check_rendezvous();
  check_filter();
}

bool cluster::wait_blocked(int worker, std::chrono::milliseconds within) {
  check_index(worker, "wait_blocked");
  check_filter();
  return world_->wait_blocked(worker, within);
}

std::chrono::nanoseconds cluster::now() const {
  return world_->now();
}

std::vector<message> cluster::messages() const {
  check_filter();
  return world_->messages();
}

} // namespace consort::testing
