#pragma once

// consort::testing: a cluster of workers in one process, for tests of code that uses consort
// (docs/testing.md).
//
// Each worker is a real multi_worker_mirrored_strategy (its actors, replicas, cross-worker lanes
// and collective algorithms are the production ones); only the network between the workers and
// the membership's failure detector are simulated. The test injects faults, observes every
// message, and moves a simulated clock:
//
//   consort::testing::cluster c({.workers = 3, .replicas_per_worker = 2, .seed = 7});
//   auto ok = c.run_all([](consort::replica_context& ctx) {
//     return ctx.all_reduce("SUM", consort::tensor::scalar<float>(1.0f));
//   });                                // one future per worker, as N processes would run it
//   c.kill(2);                         // worker 2 dies: its connections close
//   auto f = c.strategy(0).run_async(step);
//   c.advance(std::chrono::seconds(6)); // simulated time: deadlines pass, no wall-clock wait
//
// What is simulated and what is not:
// - the network: per-link FIFO delivery, tag matching, a goodbye at a clean close, an abort that
//   carries its cause, a connection that closes when a process dies, silence across a partition.
//   Not simulated: the kernel's socket buffers (a send completes when it is copied), TCP's
//   timing, shared memory, NCCL;
// - the membership's failure detector: a worker cut off by a partition, or hung, is declared
//   lost by the others `peer_timeout` of simulated time after the cut, as heartbeats would find
//   it; an elastic group's chief (the harness) re-forms it, restarts workers (`restart`,
//   `max_restarts`) and takes them back at a step boundary; and the
//   outcome of the rendezvous: workers named `late` start only when the test calls `join`, and
//   past `rendezvous_timeout` every worker's start fails naming the missing ones;
// - time: simulated time is real time plus what `advance` added; the deadlines of the network
//   (collective timeouts in the algorithms, the failure detector, delays) and the actors' step
//   deadlines (step_timeout) run on it, and `advance` moves from event to event in time order;
// - scheduling: the workers' threads are real, so thread interleavings are not replayed; the
//   seed makes the test's own choices (faults, victims) replayable through `random()`, and a
//   filter that decides by a message's place on its link (`link_seq`) strikes the same messages
//   on every run, for every fault a verdict can carry (drop, delay, corrupt, a crash, a
//   partition).

#include <consort/strategy.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace consort::transport::membership {
struct view;
} // namespace consort::transport::membership

namespace consort::testing {

namespace detail {
class sim_world;
class sim_membership;
} // namespace detail

/// What became of one message.
enum class fate {
  delivered, ///< reached the receiver (maybe after a delay the filter asked for)
  dropped,   ///< the filter dropped it, or a partition swallowed it: nobody learns of it
  corrupted, ///< the receiver found it malformed and closed the connection (peer_lost both ways)
  refused,   ///< the link was already down (a dead or departed peer, an aborted group)
};

/// "delivered", "dropped", "corrupted" or "refused".
const char* to_string(fate f) noexcept;

/// One message between two workers, as the log records it.
struct message {
  std::chrono::nanoseconds time{0}; ///< simulated time when it was sent
  /// The membership epoch of the group it belongs to: 1, and one more at each re-formation of an
  /// elastic cluster (`cluster_options::elastic_min_workers`). `from` and `to` are workers.
  uint64_t epoch = 1;
  int from = 0;
  int to = 0;
  std::string kind; ///< "data", "goodbye" (a clean close) or "abort" (an abort's notice)
  uint64_t tag = 0; ///< the transport tag (data only)
  /// How many data messages went from `from` to `to` before this one. The algorithms send the
  /// same sequence on a link whatever the threads do, so a filter that decides by (from, to,
  /// link_seq) and the seed injects the same faults at the same points on every run.
  uint64_t link_seq = 0;
  std::size_t bytes = 0;
  fate what = fate::delivered;
  std::chrono::nanoseconds delay{0}; ///< the delay the filter asked for
};

/// What the filter does with a message.
struct verdict {
  enum class action { deliver, drop, corrupt, crash_sender, partition, restart_sender };
  action what = action::deliver;
  /// Delivered this much simulated time later (deliver only). Later messages on the same link
  /// wait behind it: links stay FIFO, as TCP is.
  std::chrono::nanoseconds delay{0};
  /// The workers a partition cuts off (partition only).
  std::vector<int> side{};

  static verdict deliver() { return {}; }
  static verdict drop() { return {action::drop, {}}; }
  static verdict corrupt() { return {action::corrupt, {}}; }
  /// The sender dies as it sends this message (as `cluster::kill`; the message is lost with it):
  /// a crash at an exact point of the protocol.
  static verdict crash_sender() { return {action::crash_sender, {}}; }
  /// The sender dies as it sends this message and a new process of its task starts at once (as
  /// `cluster::restart`): a restart at an exact point of the protocol. Refused as a partition
  /// side can be (the message is delivered and the test's next call throws why) where
  /// `cluster::restart` would refuse it.
  static verdict restart_sender() { return {action::restart_sender, {}}; }
  static verdict delay_by(std::chrono::nanoseconds d) { return {action::deliver, d}; }
  /// A partition begins as this message is sent (as `cluster::partition(side)` would, but at an
  /// exact point of the protocol): the message vanishes when it crosses the cut and is delivered
  /// otherwise, and so does every later one. A side that names no worker, every worker, or a
  /// worker that does not exist is refused: the message is delivered, no partition begins, and
  /// the test's next `advance`, `messages`, `wait_blocked` or `strategy` call throws
  /// error(invalid_argument) saying why.
  static verdict partition(std::vector<int> side) {
    return {action::partition, {}, std::move(side)};
  }
};

/// Decides the fate of each data message (`time`, `from`, `to`, `kind`, `tag`, `link_seq` and
/// `bytes` are set).
/// Called with the harness's lock held: it must not call back into the cluster.
using message_filter = std::function<verdict(const message&)>;

struct cluster_options {
  int workers = 2;
  int replicas_per_worker = 1;
  /// Seeds `cluster::random()`; print it with a failure (`cluster::describe()`) to replay the
  /// test's choices.
  uint64_t seed = 0;
  /// After this much simulated time without a heartbeat, a worker is lost (as
  /// multi_worker_options::peer_timeout).
  std::chrono::milliseconds peer_timeout{std::chrono::seconds(5)};
  /// Every worker's strategy options (collective_timeout is a deadline of the network, so it runs
  /// on simulated time).
  strategy_options strategy{};
  /// Workers that do not start with the others: the cluster forms when the test has called
  /// `join` for each of them (as the chief's view forms when the last worker joins).
  std::vector<int> late{};
  /// How long the others wait for the late workers, in simulated time; then every worker's start
  /// fails with error(collective_timeout) naming the workers that did not join (as
  /// multi_worker_options::rendezvous_timeout).
  std::chrono::milliseconds rendezvous_timeout{std::chrono::seconds(60)};
  /// Elastic (as multi_worker_options::elastic_min_workers, docs/testing.md "Elastic
  /// clusters"): 0, the default, keeps the rule that a lost worker ends the group. n >= 1: when a
  /// worker dies (`kill`, or a filter's crash_sender), the harness, as the chief, forms the next
  /// epoch of the survivors at once while n remain; every survivor's calls in flight fail with
  /// membership_changed and its `reform` continues in that epoch. A worker restarted at once
  /// (`cluster::restart`, verdict::restart_sender) is in that epoch in its old place; one
  /// restarted after its loss (`restart` of a dead worker, `max_restarts`) joins at the next
  /// step boundary. A worker that hangs past the peer timeout (`hang`) is left out and joins
  /// again when it resumes. A partition leaves the side with its quorum (`partition`).
  int elastic_min_workers = 0;
  /// Elastic clusters: how many workers that die (`kill`, a filter's crash_sender) are started
  /// again under their task, in all, as `consort-launch --max-restarts K` does: while restarts
  /// are left, the dead worker's loss forms the survivors' next epoch as always, and a new process
  /// of its task joins them at their next step boundary (see `restart`). Worker 0, the chief's
  /// task, is not restarted (nor by the launcher).
  int max_restarts = 0;
  /// An elastic cluster's membership lines (the workers' `multi_worker_options::log`); empty:
  /// dropped.
  std::function<void(const std::string&)> log{};
  /// Whether the simulated network has lockstep channels, as shared memory between the workers of
  /// one host has (up to 8 workers; docs/multi_worker.md): the communicators then exchange their
  /// calls' descriptors through them, and a lone replica's small all-reduce takes its lean path.
  /// Off (the default), the network is as TCP between hosts. Their messages are sent on the same
  /// links as every other, so faults, filters and the message log see them alike.
  /// CONSORT_TESTING_LOCKSTEP_CHANNELS=1 (or 0) overrides it for every cluster, so that a whole
  /// suite runs over either network unchanged; another value is refused (invalid_argument).
  bool lockstep_channels = false;
};

/// N workers of a multi-worker job in one process, over a simulated network.
///
/// Thread safety: the fault, clock and log functions may be called from any thread, also while
/// steps run; `strategy(i)` is as thread-safe as a strategy.
class cluster {
public:
  /// Builds the workers and their network. @throws error(invalid_argument) for fewer than 2
  /// workers, fewer than 1 replica per worker, or a negative peer_timeout.
  explicit cluster(cluster_options opts = {});
  /// Shuts every worker down (each leaves cleanly, as at the end of a job).
  ~cluster();
  cluster(const cluster&) = delete;
  cluster& operator=(const cluster&) = delete;

  int workers() const noexcept { return opts_.workers; }
  uint64_t seed() const noexcept { return opts_.seed; }
  /// "3 workers x 2 replicas, seed 7": what a failure message should print to replay a run.
  std::string describe() const;
  /// The test's random source, seeded with `seed`.
  std::mt19937_64& random() noexcept { return random_; }

  /// Worker `worker`'s strategy (its rank in the group). @throws error(invalid_argument) for a
  /// worker that does not exist, or while the cluster is still forming (late workers have not
  /// joined and the rendezvous timeout has not passed); error(collective_timeout) when the
  /// rendezvous timed out: what the worker's strategy constructor would have thrown.
  multi_worker_mirrored_strategy& strategy(int worker);

  /// A late worker starts (cluster_options::late). When it is the last one, the cluster forms.
  /// @throws error(invalid_argument) for a worker that is not late or already joined;
  /// error(collective_timeout) when the rendezvous had already timed out.
  void join(int worker);
  /// Whether every worker has started (the strategies exist).
  bool formed() const noexcept { return !strategies_.empty(); }
  /// The membership epoch (1, and one more at each re-formation of an elastic cluster) and its
  /// members, in rank order: the latest the harness formed (one that a restarted worker joins at
  /// a step boundary forms at once; the others reach it at their next boundary).
  uint64_t epoch() const;
  std::vector<int> members() const;

  /// Starts `fn` on every worker at once (`run_async` on each strategy, as N processes would
  /// call `run`) and returns their futures in worker order. @throws as `strategy` before the
  /// cluster has formed.
  template <class F>
  auto run_all(const F& fn) {
    std::vector<decltype(strategy(0).run_async(fn))> out;
    strategy(0); // throws while forming, or after a failed rendezvous
    out.reserve(static_cast<size_t>(workers()));
    for (int w = 0; w < workers(); ++w)
      out.push_back(checked(w).run_async(fn)); // each worker's current process
    return out;
  }

  // -- faults ------------------------------------------------------------------------------------

  /// Worker `worker` dies: its connections close, so every other worker's pending and later
  /// collectives fail with peer_lost naming it, and its own with peer_lost too. Elastic: the
  /// others' fail with membership_changed and the next epoch is formed before this returns (or,
  /// fewer than the minimum left, with peer_lost: the group ended).
  void kill(int worker);
  /// Whether worker `worker`'s current process lives.
  bool alive(int worker) const;
  /// A new process of worker `worker`'s task starts (elastic clusters only), and `strategy(worker)`
  /// is from then on its strategy: a worker that joined a running group (`membership_epoch()` >
  /// 1, `joined_running_group()`; it creates its variables without the creation broadcast, and
  /// its first `elastic_state::sync` takes the group's state). Before this returns:
  /// - a live worker dies first, before its loss is seen, as a supervisor restarts a crashed
  ///   process. The next epoch has the new process in the old one's place (same members, same
  ///   ranks): the others' calls fail with membership_changed ("a new process of its task joins
  ///   in its place"). The old process's calls fail with peer_lost, as a killed one's;
  /// - a dead worker (killed, its loss seen) joins at the members' next step boundary, as a
  ///   restarted task joins a running group: the epoch after the current one forms with it, by
  ///   task order, and every member is told that the group grows (the service's
  ///   Abort.atBoundary): its next `step_boundary` (every later `elastic_state::commit`) fails
  ///   with membership_changed once the commit is kept, and `reform` takes it there.
  /// Old processes' strategy objects live on with the cluster.
  /// @throws error(unsupported) on a cluster that is not elastic, for the group's chief (rank 0:
  ///         a restarted chief does not rejoin) and for worker 0 dead (the chief's task);
  ///         error(invalid_argument) when the group ended.
  void restart(int worker);
  /// How many times worker `worker` was restarted (`restart`, verdict::restart_sender): a
  /// worker's loop that records it can tell that its process was replaced.
  int restarts(int worker) const;
  /// Waits (in real time, up to `within`) until worker `worker` was restarted `restarts` times,
  /// and returns its current process's strategy: a restart by a filter's verdict completes on
  /// the harness's own thread, after the old process's calls failed. @throws
  /// error(collective_timeout) when it was not restarted that often in time.
  multi_worker_mirrored_strategy&
  await_restart(int worker, int restarts,
                std::chrono::milliseconds within = std::chrono::seconds(10));
  /// Cuts the workers in `side` off from the others: their messages vanish and no connection
  /// closes; `peer_timeout` of simulated time later each side declares the other lost
  /// (peer_lost). One partition at a time; a new one replaces the old. Elastic: the side with
  /// its quorum goes on as the next epoch (the chief's side with half of the members, else the
  /// successor's with more than half, as the membership service decides it), and every worker of
  /// the other side ends with peer_lost saying why (every worker, when no side has it).
  void partition(std::vector<int> side);
  /// Ends the partition (workers already declared lost stay lost, as in production).
  void heal();
  /// Worker `worker`'s process stops (SIGSTOP, a debugger, a stall longer than a heartbeat):
  /// nothing it sends or is sent arrives from now on, and no connection closes. `peer_timeout`
  /// of simulated time later (`advance`) the others find it silent. Elastic: the next epoch forms
  /// without it at once, and the others' calls fail with membership_changed ("worker:1 (rank
  /// 1): no heartbeat for 5000 ms"); it is not dead. Otherwise every other worker's calls fail
  /// with peer_lost naming it, and its own too. Its threads are not stopped: the test makes no
  /// call for it while it hangs. @throws error(invalid_argument) for a dead worker.
  void hang(int worker);
  /// Hung worker `worker` goes on; what it sent while it hung is lost. Elastic, when the others
  /// left it out: its calls fail with membership_changed ("the chief left this worker out of
  /// the group: ...; reform() joins the group again"), and its `reform` joins the group again
  /// as the same process, at the members' next step boundary (`membership_change::joined` names
  /// it; its variables keep their values until its `elastic_state::sync`). @throws
  /// error(invalid_argument) for a worker that does not hang.
  void resume(int worker);
  /// Every later data message goes through `filter` (empty: none).
  void on_message(message_filter filter);
  /// Throws the error of a verdict the filter returned and the harness refused (see
  /// verdict::partition), once; `advance`, `messages`, `wait_blocked` and `strategy` call it.
  void check_filter() const;

  // -- time and observation ----------------------------------------------------------------------

  /// Moves simulated time forward: deadlines, delayed messages and the failure detector see it
  /// at once (what the detector finds in an elastic cluster is handled before this returns: the
  /// next epoch formed, the members told). @throws error(invalid_argument) for a negative
  /// duration.
  void advance(std::chrono::nanoseconds by);
  /// Waits (in real time, up to `within`) until a thread of worker `worker` waits on the
  /// network, e.g. inside a collective that needs a peer; false when none did in time. Call it
  /// before `advance` when a deadline must pass for a call that is starting: a call's deadline
  /// counts from when it begins, so time advanced before it began does not count for it.
  bool wait_blocked(int worker, std::chrono::milliseconds within = std::chrono::seconds(10));
  /// Simulated time since the cluster was built.
  std::chrono::nanoseconds now() const;
  /// Every message so far, in the order they were sent.
  std::vector<message> messages() const;

private:
  multi_worker_mirrored_strategy& checked(int worker) const;
  void check_index(int worker, const char* what) const;
  /// Builds every worker's strategy (every worker has started).
  void form();
  /// Fails the rendezvous when its deadline has passed in simulated time.
  void check_rendezvous();
  std::vector<bool> joined_;
  std::chrono::nanoseconds rendezvous_deadline_{0};
  std::string rendezvous_failure_; // set when the rendezvous timed out

  cluster_options opts_;
  std::mt19937_64 random_;
  std::shared_ptr<detail::sim_world> world_;
  std::shared_ptr<detail::sim_membership> membership_; // elastic only
  std::vector<std::unique_ptr<multi_worker_mirrored_strategy>> strategies_;
  /// Restarted workers (elastic): every new process's strategy, and each worker's current one
  /// and restart count (all guarded by restarts_mtx_; strategies_ does not change once formed).
  mutable std::mutex restarts_mtx_;
  std::condition_variable restarted_cv_;
  std::vector<std::unique_ptr<multi_worker_mirrored_strategy>> restarted_;
  std::vector<multi_worker_mirrored_strategy*> current_;
  std::vector<int> restarts_;
  multi_worker_mirrored_strategy* restarted(int worker, const transport::membership::view& v);
};

} // namespace consort::testing
