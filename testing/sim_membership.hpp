#pragma once

// The membership of an elastic consort::testing::cluster: the harness plays the chief. When a
// worker dies (cluster::kill, or a filter's crash_sender), the survivors' next view is formed at
// once, from the live members in worker order (so a lost chief's successor is the next worker, as
// the membership service's standby is), its contexts are made on the simulated network, and every
// survivor's group is told: its calls in flight fail with membership_changed, and its `reform`
// takes the view. With fewer than the minimum left, the group ends: their calls fail with
// peer_lost, and so does `reform`. A worker restarted at once (cluster::restart, or a filter's
// restart_sender) is a new process of its task that the next view has in the old one's place, as
// the service does with a process restarted before its loss was seen: the harness builds its
// strategy, which starts in that epoch as a worker that joined a running group.
//
// Threads: `lost` runs on the caller's thread; a death by the filter's verdict is noted under
// the network's lock and handled on this object's own thread (as the membership service's I/O
// thread would), which never holds the network's lock while it tells the strategies.

#include "actors/strategy_access.hpp"
#include "testing/sim_transport.hpp"

#include <consort/error.hpp>

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
  sim_membership(std::shared_ptr<sim_world> world, int workers, int min_workers, int max_restarts,
                 std::chrono::milliseconds peer_timeout, std::vector<std::string> devices);
  ~sim_membership();
  sim_membership(const sim_membership&) = delete;
  sim_membership& operator=(const sim_membership&) = delete;

  /// Epoch 1: every worker.
  transport::membership::view first_view() const;
  /// What the current process of worker `w`'s elastic group asks of its membership.
  consort::detail::strategy_access::simulated_membership for_worker(int w);

  /// Builds the strategy of a new process of worker `w` whose first view is `v` (the harness
  /// owns it) and returns it.
  using restarter =
      std::function<multi_worker_mirrored_strategy*(int w, const transport::membership::view& v)>;
  /// The workers' strategies, in worker order, once they exist (they are told of changes), and
  /// how a restarted worker's is made.
  void set_strategies(std::vector<multi_worker_mirrored_strategy*> strategies, restarter restart);
  /// Worker `w` died (the network knows already): the next epoch forms, or the group ends.
  /// `in_place`: a new process of its task takes its place in the next epoch (when
  /// `restart_refusal(w)` is empty by then; else it is a plain loss). Otherwise, while restarts
  /// are left (cluster_options::max_restarts) and it is not worker 0, a new process of its task
  /// joins the survivors' epoch at their next step boundary (`rejoin`).
  void lost(int w, bool in_place = false);
  /// A new process of dead worker `w` joins the group at the members' next step boundary: the
  /// epoch after the current one, with `w` in its place by task order, forms at once, and every
  /// member is told to re-form into it at its next boundary (as the service's Abort.atBoundary).
  /// @throws error(invalid_argument) when `w` lives or the group ended; error(unsupported) for
  /// worker 0 (the chief's task).
  void rejoin(int w);
  /// Why worker `w` cannot be restarted in place now ("" when it can): it is not a live member,
  /// the group ended, or it is the group's chief (a restarted chief does not rejoin).
  /// `code` (when not null) says which error fits: invalid_argument, or unsupported for the chief.
  std::string restart_refusal(int w, errc* code = nullptr) const;
  /// Called under the network's lock (sim_world::worker_hooks::on_crash): `lost` follows on this
  /// object's thread. Returns `restart_refusal(w)` when `restart` (then nothing follows).
  std::string crashed(int w, bool restart);
  /// Called under the network's lock (sim_world::worker_hooks::on_silent): hung worker `w` was
  /// silent for the peer timeout. On this object's thread, the next epoch forms without it, as
  /// for a loss, but it is not dead: it is left out, and told so when it resumes (`resumed`).
  void silent(int w);
  /// Called under the network's lock (sim_world::worker_hooks::on_split): a partition cut `side`
  /// off from the others for the peer timeout. On this object's thread, the side with its quorum
  /// goes on as the next epoch, as the membership service decides it (docs/multi_worker.md,
  /// "Partitions": the chief's side with half of the members, else the successor's with more than
  /// half), and every member of the other side ends with peer_lost saying why; with no side
  /// that has it, every member does.
  void split(std::set<int> side);
  /// Waits (bounded) until every death and silence noted so far is handled: the epochs formed
  /// and the strategies told.
  void settle();
  /// Hung worker `w` goes on: when it was left out, its calls fail with membership_changed
  /// saying so, and its `reform` joins the group again (`rejoin_left_out`).
  void resumed(int w);
  /// Worker `w`, left out, joins the group again as the same process at the members' next step
  /// boundary: the view it joins. @throws error(peer_lost) when the group ended.
  transport::membership::view rejoin_left_out(int w);

  uint64_t epoch() const;
  std::vector<int> members() const;

private:
  transport::membership::view view_of(uint64_t epoch, const std::vector<int>& members) const;
  transport::membership::view next_view(int w, int incarnation, uint64_t after);
  std::string restart_refusal_locked(int w, errc* code) const; // mtx_ held
  std::string rejoin_refusal_locked(int w, errc* code) const;  // mtx_ held
  /// Forms the epoch after `base` (of `members`) with `w` joining at a step boundary, builds its
  /// new process, and tells `told` (empty: every member of `base`) of the join, then, when
  /// `loss_epoch` > 0, of the loss that formed `base`. change_mtx_ held.
  /// `new_process`: a new process of its task (its strategy is made); else the same process,
  /// left out, comes back. Returns the view of the epoch formed.
  transport::membership::view form_join(int w, uint64_t base, std::vector<int> members,
                                        std::vector<multi_worker_mirrored_strategy*> told,
                                        uint64_t loss_epoch, const std::string& loss_cause,
                                        bool new_process);
  /// How a worker leaves the group.
  enum class removal {
    killed,           ///< its process died
    killed_restarted, ///< its process died, and a new one takes its place at once
    silent,           ///< it hung past the peer timeout: left out, not dead
  };
  void remove(int w, removal how);
  transport::context_ptr context(int w, const transport::membership::view& v);
  void run();

  const std::shared_ptr<sim_world> world_;
  const int workers_;
  const int min_workers_;
  const std::chrono::milliseconds peer_timeout_;
  const std::vector<std::string> devices_;

  std::mutex change_mtx_; // one change at a time, in order
  mutable std::mutex mtx_;
  std::condition_variable cv_;
  // Guarded by mtx_:
  std::vector<multi_worker_mirrored_strategy*> strategies_;
  uint64_t epoch_ = 1;
  std::vector<int> members_;
  std::vector<bool> lost_;       // per worker: its current process died
  std::vector<int> incarnation_; // per worker: its current process (0 the first, 1 on restart)
  int restarts_left_;            // cluster_options::max_restarts, less those made
  /// Every epoch formed: its members, and whether a join formed it at a step boundary of the
  /// epoch `base`.
  struct epoch_info {
    std::vector<int> members;
    bool at_boundary = false;
    uint64_t base = 0;
  };
  std::map<uint64_t, epoch_info> epochs_;
  std::vector<bool> left_out_;          // per worker: hung past the peer timeout, left out
  std::vector<std::string> left_cause_; // why
  std::vector<bool> left_as_chief_;     // it was rank 0 then: it does not rejoin
  restarter restart_;
  bool ended_ = false;
  std::string end_cause_;
  std::map<std::pair<uint64_t, int>, transport::context_ptr> pending_; // (epoch, worker)
  std::deque<std::pair<int, removal>> crashes_; // deaths and silences to handle, in order
  std::deque<std::set<int>> splits_;            // partitions to handle, after those
  void handle_split(const std::set<int>& side);
  bool handling_ = false; // one of them is being handled
  bool stopping_ = false;
  std::thread thread_;
};

} // namespace consort::testing::detail
