#pragma once

// A communicator: one group of workers for one membership epoch, and the one way every
// collective between workers goes (docs/architecture.md): the replicas of a worker combine their
// values (actors/), then the communicator runs the call between the workers, descriptor exchange
// then data (transport/algorithms/group_call.hpp), over the pairs of its transport context (TCP,
// shared memory, in-process, or consort::testing's simulated network).
//
// It holds what belongs to the group and changes with it: the members, the transport context, and
// the sequence of calls on each lane (their message tags). The step lane serves the replicas'
// collectives, the host lane `Strategy.reduce` / `gather`; their tags are disjoint. Calls run one
// at a time per lane, in the order they are made. Every worker makes the same calls in the same
// order (steps are numbered alike on every worker and the calls of a step are ordered), so the
// lanes of all workers meet in the same call.
//
// Its life: `abort` fails every pending and later call with the reason, at once (a lost member);
// `stop` leaves the group cleanly (a strategy's shutdown). Its resources go with the last owner:
// jobs queued on a lane hold the communicator they run on.

#include "transport/algorithms/group_call.hpp"

#include <consort/transport/pair.hpp>

#include <caf/error.hpp>
#include <caf/expected.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace consort::transport {

/// Who is in a group and since when: the membership epoch that formed it and its members' names,
/// in rank order (rank 0 the chief).
struct group_members {
  uint64_t epoch = 0;
  /// Task names in rank order ("worker:0", ...); empty: "worker <rank>".
  std::vector<std::string> names;
};

class communicator;

/// How the members that remain reach each other in the next epoch: builds this worker's context
/// of a group of `size` workers in which it has rank `rank`, for membership epoch `epoch` (TCP: a
/// new mesh whose handshake carries the epoch; shared memory: a segment of that epoch), within
/// `until`. Every member that remains calls it with the same `size` and `epoch`.
using connect_group =
    std::function<caf::expected<context_ptr>(int rank, int size, uint64_t epoch, deadline until)>;

/// Thread safety: thread-safe; `run` is called on a lane thread (from jobs given to `post`) or on
/// the thread of a worker's lone replica (`run_or_post`); a lane runs one call at a time.
class communicator {
public:
  enum class lane : uint8_t { step = 0, host = 1 };

  /// A group over `ctx` (whose ranks are the workers) whose workers each hold
  /// `devices_per_worker` replicas (a broadcast's root replica names its worker).
  /// @pre ctx->size() > 1
  communicator(context_ptr ctx, int devices_per_worker, group_members members = {},
               std::chrono::milliseconds close_timeout = std::chrono::seconds(10));

  /// `stop()`.
  ~communicator();

  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int devices_per_worker() const noexcept { return devices_per_worker_; }
  const group_members& members() const noexcept { return members_; }

  /// Runs `call` between the workers on the calling lane `l`: the descriptor exchange, then the
  /// data (fused, by the transport's algorithms, or by the call's own data phase). Returns the
  /// result leaves (the same on every worker) or the error every worker reports for the call.
  caf::expected<std::vector<tensor>> run(lane l, group_call& call);

  /// Runs a lone replica's all-reduce of one small tensor on lane `l` by the lean path
  /// (lone_all_reduce), when it fits (lone_all_reduce::fits on this group's lockstep channel) and
  /// the group is whole; then the result or the error, as `run` of `call.complete`'s call would
  /// give them (the descriptor exchange takes over anything but a plain match). Otherwise nothing:
  /// nothing was sent, and the caller runs the general call.
  std::optional<caf::expected<tensor>> run_lone(lane l, const lone_call& call);

  /// Queues `job` on `l`; jobs of one lane run one at a time in posting order. Jobs must not own
  /// the communicator (they run on its threads).
  void post(lane l, std::function<void()> job);
  /// As `post`, but when the lane is idle (no job queued or running) runs `job` on the calling
  /// thread at once, saving the hop to the lane's thread; the lane's order is kept (a job posted
  /// meanwhile waits for this one). Must not be called from a lane thread.
  void run_or_post(lane l, std::function<void()> job);

  /// Aborts the group: every pending and later call fails with `code` carrying `cause` (a
  /// member was lost, or the group must stop). The first cause (and its code) is kept.
  void abort(const std::string& cause, errc code = errc::peer_lost);

  /// The next epoch's group of the members that remain once the ranks in `lost` are gone (as
  /// `ncclCommShrink` builds one from a parent communicator): this group is aborted first, so
  /// every call pending or made later on it fails with `membership_changed` naming the lost
  /// members (a call that failed before keeps its error); then `connect` builds the context of
  /// the members that remain, in which they keep their order (ranks renumbered from 0), and the
  /// result is a group of epoch `epoch` with the same replicas per worker and the
  /// names of the members that remain. Every member that remains calls it with the same `lost`
  /// and `epoch`, the membership epoch of the next group (greater than this one's; a re-formation
  /// that failed, because another member was lost meanwhile, is retried with a later one).
  /// Errors: `invalid_argument` (`lost` names a rank outside the group or this worker, it leaves
  /// fewer than two members: a group of one worker needs no communicator, or `epoch` is not
  /// later), and whatever `connect` reports (another member lost meanwhile, `until` passed).
  caf::expected<std::shared_ptr<communicator>> shrink(const std::vector<int>& lost, uint64_t epoch,
                                                      const connect_group& connect, deadline until);

  /// Elastic groups: a call that fails because a member is gone or silent (peer_lost, peer_left,
  /// collective_timeout) waits up to `grace` for the membership's verdict (`abort`: a change of
  /// the group, with `membership_changed`, or its end), and then fails with that instead, so
  /// that every member sees the same error. A call failed by a peer's abort for a change of the
  /// group (membership_changed, which shared memory passes on) waits for this worker's own
  /// verdict too, and without one in the grace aborts this communicator with it: the failed call
  /// left the epoch's lockstep channels out of step, so no later call may run in it. 0 (the
  /// default): calls fail with their own error at once.
  void set_change_grace(std::chrono::milliseconds grace) noexcept;

  /// The cause given to `abort`, empty while the group is whole.
  std::string lost_cause() const;

  /// Leaves the group: while it is whole, closes the context cleanly (every send started is
  /// finished and every peer is told, so the last collective reaches every worker; at most
  /// `close_timeout`), then aborts it (pending calls fail), runs the jobs still queued (they fail
  /// at once) and joins the lane threads; later posts run inline and fail at once. Returns the
  /// clean close's error, if any (a peer that did not close its side in time). Idempotent. Must
  /// not be called from a lane thread.
  caf::error stop();

private:
  struct lane_state {
    std::mutex mtx;
    std::condition_variable cv;
    std::deque<std::function<void()>> jobs;
    bool stopping = false;
    /// A job of this lane is running, on its thread or inline (run_or_post); the lane's thread
    /// starts the next one only when it is done.
    bool busy = false;
    /// Held by `run` for a whole call, so that the lane's calls never overlap.
    std::mutex run_mtx;
    /// Next base tag of this lane's algorithm runs (guarded by run_mtx).
    uint64_t next_tag = 0;
    /// Where the peers' descriptors (and fused data) land (guarded by run_mtx).
    std::vector<std::byte> scratch;
    std::thread thread;
  };

  void serve(lane_state& ls);
  caf::expected<std::vector<tensor>> data_phase(const descriptor_exchange& exchange,
                                                group_call& call, call_clock& clock);
  caf::error lost_error(const std::string& what) const;
  /// `err`, or, when the group changed within the grace (set_change_grace), membership_changed.
  caf::error changed_or(caf::error err, const group_call& call);
  /// Member `r`'s task name, or "worker <r>" when the group has no names.
  std::string member_name(int r) const;

  context_ptr ctx_;
  int rank_;
  int size_;
  int devices_per_worker_;
  group_members members_;
  std::chrono::milliseconds close_timeout_;
  std::atomic<int64_t> change_grace_ns_{0};
  mutable std::mutex lost_mtx_;
  std::condition_variable lost_cv_; // notified when lost_ is set
  std::string lost_;                // guarded by lost_mtx_
  /// Set (under lost_mtx_) once lost_ is: a call looks here without the lock.
  std::atomic<bool> broken_{false};
  errc lost_code_ = errc::peer_lost; // guarded by lost_mtx_
  bool stopped_ = false;             // guarded by lost_mtx_
  lane_state lanes_[2];
};

} // namespace consort::transport
