#pragma once

// The membership of an elastic consort::testing::cluster: the harness plays the chief. When a
// worker dies (cluster::kill, or a filter's crash_sender), the survivors' next view is formed at
// once, from the live members in worker order (so a lost chief's successor is the next worker, as
// the membership service's standby is), its contexts are made on the simulated network, and every
// survivor's group is told: its calls in flight fail with membership_changed, and its `reform`
// takes the view. With fewer than the minimum left, the group ends: their calls fail with
// peer_lost, and so does `reform`.
//
// Threads: `lost` runs on the caller's thread; a death by the filter's verdict is noted under
// the network's lock and handled on this object's own thread (as the membership service's I/O
// thread would), which never holds the network's lock while it tells the strategies.

#include "actors/strategy_access.hpp"
#include "testing/sim_transport.hpp"

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace consort::testing::detail {

class sim_membership : public std::enable_shared_from_this<sim_membership> {
public:
  /// Ends its thread, and every `reform` waiting for a view fails with error(shutdown).
  void stop();
  /// Makes epoch 1's contexts, one per worker, which `for_worker(w).context` hands out.
  sim_membership(std::shared_ptr<sim_world> world, int workers, int min_workers,
                 std::vector<std::string> devices);
  ~sim_membership();
  sim_membership(const sim_membership&) = delete;
  sim_membership& operator=(const sim_membership&) = delete;

  /// Epoch 1: every worker.
  transport::membership::view first_view() const;
  /// What worker `w`'s elastic group asks of its membership.
  consort::detail::strategy_access::simulated_membership for_worker(int w);

  /// The workers' strategies, in worker order, once they exist (they are told of changes).
  void set_strategies(std::vector<multi_worker_mirrored_strategy*> strategies);
  /// Worker `w` died (the network knows already): the next epoch forms, or the group ends.
  void lost(int w);
  /// Called under the network's lock (sim_world::worker_hooks::on_crash): `lost` follows on this
  /// object's thread.
  void crashed(int w);

  uint64_t epoch() const;
  std::vector<int> members() const;

private:
  transport::membership::view view_of(uint64_t epoch, const std::vector<int>& members) const;
  transport::membership::view next_view(int w, uint64_t after);
  transport::context_ptr context(int w, const transport::membership::view& v);
  void run();

  const std::shared_ptr<sim_world> world_;
  const int workers_;
  const int min_workers_;
  const std::vector<std::string> devices_;

  std::mutex change_mtx_; // one change at a time, in order
  mutable std::mutex mtx_;
  std::condition_variable cv_;
  // Guarded by mtx_:
  std::vector<multi_worker_mirrored_strategy*> strategies_;
  uint64_t epoch_ = 1;
  std::vector<int> members_;
  std::vector<bool> lost_;
  bool ended_ = false;
  std::string end_cause_;
  std::map<std::pair<uint64_t, int>, transport::context_ptr> pending_; // (epoch, worker)
  std::deque<int> crashes_;
  bool stopping_ = false;
  std::thread thread_;
};

} // namespace consort::testing::detail
