// consort::testing::cluster: workers of a multi-worker job in one process over the simulated
// network of sim_transport.

#include <consort/testing.hpp>

#include "actors/strategy_access.hpp"
#include "testing/sim_transport.hpp"

#include <set>

namespace consort::testing {

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
  if (opts_.workers < 2)
    throw_error(errc::invalid_argument,
                "consort::testing::cluster: " + std::to_string(opts_.workers) +
                    " workers; expected 2 or more (one worker needs no network: use "
                    "mirrored_strategy)");
  if (opts_.replicas_per_worker < 1)
    throw_error(errc::invalid_argument,
                "consort::testing::cluster: " + std::to_string(opts_.replicas_per_worker) +
                    " replicas per worker; expected 1 or more");
  if (opts_.peer_timeout.count() < 0)
    throw_error(errc::invalid_argument, "consort::testing::cluster: peer_timeout is " +
                                            std::to_string(opts_.peer_timeout.count()) +
                                            " ms; expected 0 or more");
  world_ = std::make_shared<detail::sim_world>(opts_.workers, opts_.peer_timeout);
  auto contexts = world_->make_contexts();
  std::vector<std::string> devices;
  for (int d = 0; d < opts_.replicas_per_worker; ++d)
    devices.push_back("CPU:" + std::to_string(d));
  for (int w = 0; w < opts_.workers; ++w)
    strategies_.push_back(consort::detail::strategy_access::simulated_worker(
        opts_.strategy, w, opts_.workers, devices, contexts[static_cast<size_t>(w)],
        std::chrono::seconds(1)));
}

cluster::~cluster() {
  // Each worker leaves as at the end of its process; the network outlives them all.
  strategies_.clear();
}

std::string cluster::describe() const {
  return std::to_string(opts_.workers) + " workers x " + std::to_string(opts_.replicas_per_worker) +
         " replicas, seed " + std::to_string(opts_.seed);
}

multi_worker_mirrored_strategy& cluster::checked(int worker) const {
  if (worker < 0 || worker >= static_cast<int>(strategies_.size()))
    throw_error(errc::invalid_argument, "consort::testing::cluster: no worker " +
                                            std::to_string(worker) + "; the workers are 0 to " +
                                            std::to_string(strategies_.size() - 1));
  return *strategies_[static_cast<size_t>(worker)];
}

multi_worker_mirrored_strategy& cluster::strategy(int worker) {
  return checked(worker);
}

void cluster::kill(int worker) {
  checked(worker);
  world_->kill(worker);
}

bool cluster::alive(int worker) const {
  checked(worker);
  return world_->alive(worker);
}

void cluster::partition(std::vector<int> side) {
  std::set<int> members;
  for (int w : side) {
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

void cluster::heal() {
  world_->heal();
}

void cluster::on_message(message_filter filter) {
  world_->set_filter(std::move(filter));
}

void cluster::advance(std::chrono::nanoseconds by) {
  if (by.count() < 0)
    throw_error(errc::invalid_argument,
                "consort::testing::cluster::advance: " + std::to_string(by.count()) +
                    " ns; time only moves forward");
  world_->advance(by);
}

bool cluster::wait_blocked(int worker, std::chrono::milliseconds within) {
  checked(worker);
  return world_->wait_blocked(worker, within);
}

std::chrono::nanoseconds cluster::now() const {
  return world_->now();
}

std::vector<message> cluster::messages() const {
  return world_->messages();
}

} // namespace consort::testing
