#pragma once

// NCCL collectives among the GPU replicas of one process, for the collective actor, and the
// queue through which their work reaches the replicas' streams. Plain C++ (no CUDA header), so the
// actors compile the same with and without CUDA; without CUDA nothing is ever eligible.
//
// One NCCL communicator per local replica's GPU (ranks in local order), made when the strategy
// starts (prepare_local_nccl in actors/collective_paths.hpp) or else at the first eligible call,
// and kept; a call that fails (deadline, NCCL error) aborts them, and the next eligible call
// builds new ones with a new unique id, so one failure does not poison the strategy.
//
// Stream order, not host waits: NCCL queues each call on the calling replicas' own streams, after
// the work that made its inputs, and the call returns once NCCL has queued it. Nobody waits for
// the GPU per call; the replica waits (with the call's deadline) only where its thread must see
// the result: a host read, a collective that takes another path, the end of its step.

#include "actors/protocol.hpp"
#include <consort/error.hpp>
#include <consort/tensor.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace consort::detail {

/// Work that another thread queued on a replica's stream (an NCCL call), which the replica must
/// see finish, or fail, before anything reads what it wrote. Implementations poll; none blocks.
class queued_work {
public:
  using clock = std::chrono::steady_clock;

  /// `timeout`: how long the work may take once the stream has reached it.
  queued_work(std::string what, std::chrono::milliseconds timeout)
      : what_(std::move(what)), issued_(clock::now()), timeout_(timeout) {}
  virtual ~queued_work() = default;
  queued_work(const queued_work&) = delete;
  queued_work& operator=(const queued_work&) = delete;

  /// "all_reduce(SUM) #0 of step 3", for messages.
  const std::string& what() const noexcept { return what_; }
  /// When the work was queued.
  clock::time_point issued() const noexcept { return issued_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// Whether the stream has reached the work (the work queued before it is done).
  virtual bool started() = 0;
  /// Whether the work has finished on the GPU (it may still have failed: check() says).
  /// @throws error(device_error) when its stream failed.
  virtual bool finished() = 0;
  /// Throws the error of the work's communicators when they failed (an asynchronous NCCL error
  /// seen now, or a failure seen earlier by any replica, which aborted them); returns otherwise.
  virtual void check() = 0;
  /// The deadline passed before the work finished: abort its communicators (so that the streams
  /// drain and every replica waiting on them fails as well) and throw error(collective_timeout)
  /// saying `message`, or the failure that aborted them first.
  [[noreturn]] virtual void expire(const std::string& message) = 0;

private:
  std::string what_;
  clock::time_point issued_;
  std::chrono::milliseconds timeout_;
};

/// A GPU replica's stream and the collective work other threads queued on it that the replica
/// has not yet seen finish. The thread that issues NCCL adds; the replica's thread (or a thread
/// about to read its tensors) settles. Thread-safe.
///
/// Deadlines: a work may take its timeout from the moment the stream is seen to have reached it
/// (GPU work queued before a call is not the call's fault), and never longer than its timeout
/// plus `backlog` from when it was queued.
class replica_queue {
public:
  /// `stream`: keeps the replica's cudaStream_t alive (opaque; its get() is the handle), also
  /// for other threads that hold the queue after the replica is gone; `device`: its GPU.
  replica_queue(std::shared_ptr<void> stream, int device, std::chrono::milliseconds backlog)
      : stream_(std::move(stream)), device_(device), backlog_(backlog) {}

  void* stream() const noexcept { return stream_.get(); }
  int device() const noexcept { return device_; }

  /// Adds work queued on stream() after everything added before.
  void add(std::unique_ptr<queued_work> work);

  /// Number of works not yet settled.
  size_t size() const;

  /// Waits for every work added so far, in order, each until its deadline, polling (yield, then
  /// sleeps up to 1 ms) and asking each whether its communicators failed. One caller at a time;
  /// a work leaves the queue only once it has finished. After a failure the queue is empty and
  /// every later settle() throws that failure again, until clear_failure() (a new step): a thread
  /// that settles on the replica's behalf must not leave the replica unaware.
  /// @throws the failure: error(collective_timeout) naming the work and its deadline (its
  /// communicators were aborted), or what check() or finished() threw.
  void settle();

  /// Forgets the failure that settle() rethrows (the replica, when its next step starts).
  void clear_failure();

  /// settle(), then waits for the rest of the stream's work until `deadline`: for a thread that
  /// reads the replica's tensors next (a collective that does not run on NCCL).
  /// @throws as settle(); error(collective_timeout) naming `what` when the stream is still busy
  /// at the deadline, error(device_error) when its work failed, error(unsupported) without CUDA.
  void make_ready(std::chrono::steady_clock::time_point deadline, const std::string& what);

private:
  std::shared_ptr<void> stream_;
  int device_ = -1;
  std::chrono::milliseconds backlog_;
  /// Held by the one settling thread.
  std::mutex turn_;
  mutable std::mutex mutex_; // guards works_ and failure_
  std::vector<std::unique_ptr<queued_work>> works_;
  std::optional<error> failure_;
};

/// Across workers the communicator spans every replica of every worker: `nranks` is the number
/// of replicas in sync and this worker's replicas are ranks `first_rank`.... The first
/// communicator uses `first_id`, the id the chief made and the membership view carried to every
/// worker; when there is none, and for every communicator built after a failure (which needs a
/// new id), worker 0 makes one and `share` broadcasts its bytes to every worker.
struct nccl_group_spec {
  int nranks = 0; // 0: this process's replicas only
  int first_rank = 0;
  std::vector<uint8_t> first_id;
  std::function<void(std::vector<uint8_t>&)> share;
  /// Rebuild the communicators even if this process's are healthy: another worker's failed, and
  /// every rank of a communicator must join the new one together.
  bool rebuild = false;
};

/// The bytes of a new NCCL unique id (ncclGetUniqueId, which also starts NCCL's bootstrap root
/// in this process), for the chief's membership view.
/// @throws error(unsupported) in a build without CUDA; error(device_error) with NCCL's text.
std::vector<uint8_t> make_nccl_unique_id();

class local_nccl {
public:
  local_nccl();
  ~local_nccl();
  local_nccl(const local_nccl&) = delete;
  local_nccl& operator=(const local_nccl&) = delete;

  using group_spec = nccl_group_spec;

  /// True when the next run() on `devices` (GPU indices, local order) must build communicators
  /// (none yet, or the last ones failed). Call from the thread that calls run().
  bool needs_build(const std::vector<int>& devices) const;

  /// Builds the communicators of `devices` (this process's replicas only) now, before any call,
  /// as run() would at the first one. Building them at a call waits for the replicas' streams
  /// (CUDA calls inside NCCL's initialisation synchronise with them), so a first collective
  /// queued behind a busy stream could not start (issue 13).
  /// @throws as run() when they cannot be built; error(unsupported) without CUDA.
  void prepare(const std::vector<int>& devices, std::chrono::milliseconds timeout);

  /// True when NCCL can run the call as is: every leaf of replica r lives on that replica's own
  /// GPU (`queues[r]`, whose stream NCCL queues on; a call without a queue, from a harness, is not
  /// eligible), the replicas' GPUs are distinct, no leaf is bool, an all_reduce MEAN is of floats
  /// (integer MEAN is float64 and stays with the host kernels), and an all_gather is along axis 0
  /// (NCCL's gather concatenates whole buffers). `across_workers`: all_gather is not eligible
  /// (ragged extents of other workers are not known here), and neither is anything without CUDA.
  static bool eligible(collective_kind kind, reduce_op op, int64_t axis,
                       const std::vector<std::vector<tensor>>& leaves,
                       const std::vector<std::shared_ptr<replica_queue>>& queues,
                       bool across_workers = false);

  /// Queues the call on NCCL, on each replica's stream (`queues[r]`, after the work that made
  /// its inputs), and returns each replica's result leaves on that replica's GPU at once: they
  /// are complete in stream order. Each queue gets a work item that finishes with the call and
  /// fails with its communicators, due `timeout` from now; `root` is the broadcasting replica's
  /// rank. Building communicators and NCCL's launch wait at most `timeout`.
  ///
  /// The caller must hold no reference to the inputs once it hands the results out: a replica may
  /// then drop its own, and the last reference must be released in its stream's order.
  /// @throws error(collective_timeout | device_error | ...) naming `what`; the communicators are
  /// then aborted and rebuilt at the next call, and the buffers the failed call used are kept
  /// until the streams have passed it.
  std::vector<std::vector<tensor>> run(collective_kind kind, reduce_op op, int root,
                                       const std::vector<std::vector<tensor>>& leaves,
                                       const std::vector<std::shared_ptr<replica_queue>>& queues,
                                       std::chrono::milliseconds timeout, const std::string& what,
                                       const group_spec& spec = {});

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace consort::detail
