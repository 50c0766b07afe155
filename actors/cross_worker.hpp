#pragma once

// The cross-worker phase of collectives (docs/architecture.md, docs/multi_worker.md): once the
// replicas of this worker have all made a call (and the collective actor has combined them
// locally), every worker runs the same transport algorithm over the mesh of workers. Private to the
// library and its tests.
//
// Each call is two parts on the wire:
//   1. a fixed-size descriptor (step, seq, kind, op, axis/root, a hash of structure, dtypes and
//      shapes, this worker's local outcome, its element count) that every worker sends every
//      other (up to 8 workers; a ring all-gather beyond), so that a call that disagrees between
//      workers, or failed on one of them, fails on all of them with a clear error instead of
//      exchanging mismatched bytes;
//   2. the data: all_reduce / all_gather (ragged) / broadcast from transport/algorithms.
// A small all-reduce (up to 64 KiB, up to 8 workers) is fused: its data travels in the same
// message as its descriptor, each worker checks the descriptors on receipt and folds the data in
// rank order, so the call takes one round (docs/multi_worker.md, "One collective's hops"). An
// all-gather's extents travel with its descriptor, and so do its small parts: when every
// worker's part came along, the gather is done in that round.
//
// Calls run one at a time per lane, in the order they are made. Every worker makes the same calls
// in the same order (steps are numbered alike on every worker and the calls of a step are ordered),
// so the lanes of all workers meet in the same call. The step lane serves the replicas'
// collectives, the host lane `Strategy.reduce` / `gather`; their message tags are disjoint. A
// worker's lone CPU replica runs its calls on its own thread (`run` from the replica's thread, no
// `post`); the lane's mutex keeps them from overlapping with anything posted.

#include "actors/protocol.hpp"
#include <consort/error.hpp>
#include <consort/nest.hpp>
#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>
#include <consort/transport/pair.hpp>

#include <caf/error.hpp>
#include <caf/expected.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace consort::detail {

/// 64-bit FNV-1a of `s`: call signatures in descriptors, group ids of meshes.
uint64_t fnv1a(const std::string& s) noexcept;

/// One collective as this worker contributes it to the cross-worker phase.
struct cross_call {
  collective_kind kind = collective_kind::all_reduce;
  reduce_op op = reduce_op::sum;
  /// all_gather: the (normalised) axis; reduce: unused.
  int64_t axis = 0;
  /// broadcast: the root replica id in sync group.
  int root = 0;
  /// Identifies the call in errors: "all_reduce(SUM) #0 of step 3".
  std::string what;
  /// Position of the call: every worker must be at the same one.
  step_id step = 0;
  uint32_t seq = 0;
  /// What every worker must agree on (structure, dtypes, shapes except a gather's axis).
  std::string signature;
  /// Set when the call failed on this worker already: the other workers learn it in the
  /// descriptor and fail too.
  caf::error local_failure;
  /// This worker's part, one tensor per leaf: the local partial reduction (all_reduce; MEAN as a
  /// SUM, integers widened to float64), the local concatenation (all_gather), the root's value or
  /// an uninitialised tensor of the same dtype and shape (broadcast).
  std::vector<tensor> leaves;
  /// all_reduce: `leaves` are the caller's own tensors (a lone replica's inputs, not a partial
  /// made for the call), so the reduction writes fresh outputs and only reads them.
  bool leaves_are_inputs = false;
  /// all_reduce MEAN: the number of values this worker summed (replicas, or elements along the
  /// reduced axis); the result is divided by the sum over all workers.
  double count = 0;
  /// all_reduce MEAN: leave the result a SUM and only report `total_count` (the caller divides,
  /// e.g. as a reduce along an axis does).
  bool defer_mean = false;
  /// Set by `run`: the sum of `count` over every worker.
  double total_count = 0;
  /// Bounds the whole cross-worker phase of the call.
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};
  /// Bits that travel in the descriptor; `run` sets `all_flags` to their OR over every worker
  /// before the data phase (e.g. "my NCCL communicator must be rebuilt", so all rebuild together).
  uint8_t flags = 0;
  uint8_t all_flags = 0;
  /// Broadcasts bytes from worker 0 to every worker over the mesh (for `data_phase`).
  using share_fn = std::function<caf::error(std::vector<uint8_t>&)>;
  /// When set, replaces the TCP data phase (NCCL for GPU replicas): called on the lane once every
  /// worker's descriptor agreed, with `share` and the time left; its result is the call's. Every
  /// worker must set it for the same calls (put it in `signature`, so a disagreement is a
  /// collective_mismatch rather than a hang).
  std::function<caf::expected<std::vector<tensor>>(
      const share_fn& share, std::chrono::milliseconds left, uint8_t all_flags)>
      data_phase;
};

/// Runs the cross-worker phase of collectives over a transport context whose ranks are the
/// workers (rank 0 the chief).
///
/// Thread safety: thread-safe; `run` is called on a lane thread (from jobs given to `post`) or on
/// the thread of a worker's lone replica; a lane runs one call at a time.
class cross_worker {
public:
  enum class lane : uint8_t { step = 0, host = 1 };

  /// @pre ctx->size() > 1
  cross_worker(transport::context_ptr ctx, int devices_per_worker,
               std::chrono::milliseconds close_timeout = std::chrono::seconds(10));

  /// `stop()`.
  ~cross_worker();

  /// Leaves the group: while it is whole, closes the context cleanly (every send started is
  /// finished and every peer is told, so the last collective reaches every worker; at most
  /// `close_timeout`), then aborts it (pending calls fail), runs the jobs still queued (they fail
  /// at once) and joins the lane threads; later posts run inline and fail at once. Returns the
  /// clean close's error, if any (a peer that did not close its side in time). Idempotent. Must
  /// not be called from a lane thread.
  caf::error stop();

  cross_worker(const cross_worker&) = delete;
  cross_worker& operator=(const cross_worker&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int devices_per_worker() const noexcept { return devices_per_worker_; }

  /// Queues `job` on `l`; jobs of one lane run one at a time in posting order. Jobs must not own
  /// the cross_worker (they run on its threads).
  void post(lane l, std::function<void()> job);
  /// As `post`, but when the lane is idle (no job queued or running) runs `job` on the calling
  /// thread at once, saving the hop to the lane's thread; the lane's order is kept (a job posted
  /// meanwhile waits for this one). Must not be called from a lane thread.
  void run_or_post(lane l, std::function<void()> job);

  /// Runs the cross-worker phase of `call` on the calling lane `l`; returns the result leaves
  /// (the same on every worker) or the error every worker reports for the call.
  caf::expected<std::vector<tensor>> run(lane l, cross_call& call);

  /// A member was lost (membership) or the group must stop: every pending and later call fails
  /// with peer_lost carrying `cause`. The first cause is kept.
  void abort(const std::string& cause);

  /// The cause given to `abort`, empty while the group is whole.
  std::string lost_cause() const;

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
  uint64_t take_tag(lane l);
  caf::error lost_error(const std::string& what) const;

  transport::context_ptr ctx_;
  int rank_;
  int size_;
  int devices_per_worker_;
  std::chrono::milliseconds close_timeout_;
  mutable std::mutex lost_mtx_;
  std::string lost_;     // guarded by lost_mtx_
  bool stopped_ = false; // guarded by lost_mtx_
  lane_state lanes_[2];
};

} // namespace consort::detail
