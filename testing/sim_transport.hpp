#pragma once

// The simulated network of consort::testing::cluster: a transport::context per worker, all of
// them in one process, with the faults the harness injects (kill, partition, a filter that drops,
// delays or corrupts messages), a log of every message, and the harness's clock.
//
// The clock. Simulated time is real time since the world began plus whatever the test advanced:
// sim_now = (clock::now() - epoch) + advanced. A wait with deadline `until` gets the budget
// `until - clock::now()` when it begins and times out once that much simulated time has passed,
// so `advance` makes deadlines pass without a wall-clock wait, and a test that never advances
// still ends in real time (nothing hangs). The failure detector of the membership service is
// simulated the same way: a worker cut off by a partition is declared lost by the others
// `peer_timeout` of simulated time after the cut.
//
// The contract of transport::pair holds (tests/testing run the algorithm suites over it): per
// link FIFO, tag matching, size checks, abort with a carried code, close with a goodbye. A send
// copies its bytes and completes at once (as a write into a socket buffer does). With
// `lockstep` (cluster_options::lockstep_channels) every context of up to 8 ranks also has two
// lockstep channels (transport::mailbox, as shared memory's), whose messages travel on the same
// links under a tag of their own.
//
// Thread safety: one mutex guards the whole world; every change notifies one condition variable.
// Tests move kilobytes, not gigabytes, so the simplicity is worth the contention.

#include <consort/testing.hpp>
#include <consort/transport/pair.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace consort::testing::detail {

class sim_context;
class sim_op;
class sim_world;

/// A lock of a world's mutex that the locking thread records, so that a context whose last
/// reference is dropped while its world is locked (by a temporary taken under the lock) cleans up
/// without locking again.
class world_lock {
public:
  explicit world_lock(const sim_world& w);
  ~world_lock();
  world_lock(const world_lock&) = delete;
  world_lock& operator=(const world_lock&) = delete;
  std::unique_lock<std::mutex>& get() noexcept { return lock_; }
  /// Whether this thread holds `w`'s mutex (or waits on its condition variable).
  static bool held(const sim_world& w) noexcept;

private:
  std::unique_lock<std::mutex> lock_;
  const sim_world* previous_;
};

class sim_world : public std::enable_shared_from_this<sim_world> {
public:
  /// `lockstep`: every context has two lockstep channels (cluster_options::lockstep_channels).
  sim_world(int size, std::chrono::milliseconds peer_timeout, bool lockstep = false);
  ~sim_world();

  /// Whether the contexts have lockstep channels.
  bool lockstep() const noexcept { return lockstep_; }

  /// Every worker's context of group 1 (epoch 1), rank r for worker r (made once, by the
  /// constructor's caller).
  std::vector<transport::context_ptr> make_contexts();
  /// The contexts of group `group` (an elastic group's epoch) of the workers `members`, in rank
  /// order: messages between them are routed to this group's contexts, logged with the workers'
  /// indices and `group` as the epoch.
  std::vector<transport::context_ptr> make_group(uint64_t group, const std::vector<int>& members);

  /// Stops the thread that delivers delayed messages on time (the destructor does too); the
  /// owner calls it before it lets go of the workers, so that no delivery runs while they go.
  void stop_ticker();
  void kill(int rank);
  /// Worker `worker`, muted by a filter's crash (its messages vanish from then on), dies once
  /// every worker of `others` waits on the network at once (or `bound` passed): its connections
  /// close then, as kill. In that order every other worker has finished what it could without
  /// it, whatever its threads' timing.
  void close_when_quiet(int worker, const std::vector<int>& others, std::chrono::nanoseconds bound);
  bool alive(int rank) const;
  /// A new process of dead worker `worker` starts (cluster::restart): it lives in the groups from
  /// `group` on, where its contexts are new; its old process's groups stay dead to it.
  void revive(int worker, uint64_t group);
  void partition(const std::set<int>& side);
  /// Worker `worker` stops (cluster::hang): nothing it sends or is sent arrives from now on, and
  /// `peer_timeout` later the others find it silent (`worker_hooks::on_silent`, else every group
  /// with it is aborted with peer_lost). `resume` lets its messages through again.
  void hang(int worker);
  void resume(int worker);
  bool hung(int worker) const;
  void heal();
  void set_filter(message_filter filter);
  void advance(std::chrono::nanoseconds by);
  /// What the world needs from the workers' actors, called without mu_ held.
  struct worker_hooks {
    /// Worker `rank`'s oldest running step: its number and how far ahead its deadline is.
    std::function<std::optional<std::pair<uint64_t, std::chrono::nanoseconds>>(int rank)>
        oldest_step;
    /// Moves every worker's step-deadline clock by one step of `advance`.
    std::function<void(std::chrono::nanoseconds)> on_advanced;
    /// A filter's verdict kills worker `worker` (crash_sender), or kills it and starts a new
    /// process of its task (`restart`, restart_sender; called before the kill, which follows only
    /// when it returns ""; else it says why not). Called with mu_ held: it must only take note.
    std::function<std::string(int worker, bool restart)> on_crash;
    /// Hung worker `worker` has been silent for peer_timeout (an elastic membership leaves it
    /// out); called with mu_ held: it must only take note.
    std::function<void(int worker)> on_silent;
    /// A partition that cut `side` off from the others has lasted peer_timeout (an elastic
    /// membership keeps the side with its quorum); called with mu_ held: it must only take note.
    std::function<void(const std::set<int>& side)> on_split;
  };
  void set_worker_hooks(worker_hooks hooks);
  bool wait_blocked(int rank, std::chrono::nanoseconds within);
  std::chrono::nanoseconds now() const;
  std::vector<message> messages() const;
  /// Throws (once) the error of a verdict the world refused (an invalid partition side).
  void check_filter();

  // -- used by contexts and operations (mu_ held where it says so) --------------------------
  std::chrono::nanoseconds now_locked() const; // mu_ held
  /// Waits for `op` to be done until the simulated deadline; mu_ not held.
  caf::error wait(sim_op& op, transport::deadline until);

  mutable std::mutex mu_;
  std::condition_variable cv_;

  // mu_ held (`from` and `to` are workers, `group` the group of the sending context):
  /// A data message: logged, then filtered, delayed, dropped or handed to the receiver.
  void post(uint64_t group, int from, int to, uint64_t tag, std::vector<std::byte> data);
  /// A control message (`kind` "goodbye" or "abort"): logged, and `deliver_to(receiver)` runs
  /// unless the receiver is dead or cut off. It follows the data of its link.
  void notice(uint64_t group, int from, int to, const char* kind, const std::string& reason,
              const std::function<void(sim_context&)>& deliver_to);

private:
  friend class sim_context;
  struct in_flight {
    std::chrono::nanoseconds due;
    uint64_t group;
    int from, to;
    uint64_t tag;
    std::vector<std::byte> data;
  };

  // mu_ held:
  /// Worker `worker`'s context of `group`; null when dead, gone or not a member.
  std::shared_ptr<sim_context> context_of(uint64_t group, int worker) const;
  /// Whether the process of worker `worker` that is a member of `group` is dead.
  bool dead_in(uint64_t group, int worker) const;
  void flush_link(int from, int to);    // delivers the delayed messages of a link now
  void fire_due();                      // delayed messages and the failure detector
  bool cut(int a, int b) const;         // a partition separates a and b, or one of them hangs
  bool partitioned(int a, int b) const; // a partition separates a and b
  /// When the failure detector next finds someone silent (a partition, a hung worker).
  std::optional<std::chrono::nanoseconds> next_silence() const;
  bool blocked(int rank) const; // mu_ held: a thread of `rank` waits for an op not yet done

  void ticker();
  void kill_locked(int rank);
  void partition_locked(const std::set<int>& side);
  /// Why `side` is no partition of this world (empty when it is one).
  std::string invalid_side(const std::vector<int>& side) const;

  const int size_;
  const std::chrono::milliseconds peer_timeout_;
  const bool lockstep_;
  const transport::clock::time_point epoch_;
  std::chrono::nanoseconds advanced_{0};
  /// Per group (epoch), each worker's context (empty when not a member).
  std::map<uint64_t, std::vector<std::weak_ptr<sim_context>>> groups_;
  std::vector<bool> dead_;      // per worker: its current process died
  std::set<int> muted_;         // died at a filter's verdict; connections not closed yet
  void mute_locked(int worker); // such a death
  /// Per worker: the first group its current process belongs to (0 until it is restarted).
  std::vector<uint64_t> alive_from_;
  // Per worker: the operations that threads wait for inside wait(). One that is done may still be
  // listed until its thread wakes up; `blocked` counts only those not done yet.
  std::vector<std::vector<const sim_op*>> waiting_;
  std::multimap<std::chrono::nanoseconds, int> deadlines_; // of the waits in progress, by worker
  std::vector<uint64_t> waits_begun_;                      // per worker
  worker_hooks hooks_;
  std::set<int> side_; // the partitioned side (empty: none)
  std::chrono::nanoseconds cut_at_{0};
  bool cut_reported_ = false;
  struct hang_state {
    std::chrono::nanoseconds since{0};
    bool reported = false;
  };
  std::map<int, hang_state> hung_; // hung workers
  message_filter filter_;
  std::string filter_error_; // a refused verdict, until check_filter throws it
  std::vector<message> log_;
  std::map<std::pair<int, int>, std::deque<in_flight>> links_; // delayed messages, per link
  std::map<std::pair<int, int>, uint64_t> link_seq_;           // data messages sent, per link
  bool stopping_ = false;
  std::thread ticker_;
};

} // namespace consort::testing::detail
