#pragma once

// NCCL collectives among the GPU replicas of one process, for the collective actor. Plain C++ (no
// CUDA header), so the actor compiles the same with and without CUDA; without CUDA nothing is
// ever eligible. Private to consort.
//
// One NCCL communicator per local replica's GPU (ranks in local order), made at the first eligible
// call and kept; a call that fails (deadline, NCCL error) aborts them, and the next eligible call
// builds new ones with a new unique id, so one failure does not poison the strategy.

#include <consort/actors/protocol.hpp>
#include <consort/tensor.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace consort::detail {

/// Across workers the communicator spans every replica of every worker: `nranks` is the number
/// of replicas in sync and this worker's replicas are ranks `first_rank`...; worker 0 makes the
/// unique id and `share` broadcasts its bytes to every worker (a new id after a failure).
struct nccl_group_spec {
  int nranks = 0; // 0: this process's replicas only
  int first_rank = 0;
  std::function<void(std::vector<uint8_t>&)> share;
  /// Rebuild the communicators even if this process's are healthy: another worker's failed, and
  /// every rank of a communicator must join the new one together.
  bool rebuild = false;
};

class local_nccl {
public:
  local_nccl();
  ~local_nccl();
  local_nccl(const local_nccl&) = delete;
  local_nccl& operator=(const local_nccl&) = delete;

  using group_spec = nccl_group_spec;

  /// True when NCCL can run the call as is: every leaf of replica r lives on one GPU, the
  /// replicas' GPUs are distinct, no leaf is bool, an all_reduce MEAN is of floats (integer MEAN
  /// is float64 and stays with the host kernels), and an all_gather is along axis 0 (NCCL's
  /// gather concatenates whole buffers). `across_workers`: all_gather is not eligible (ragged
  /// extents of other workers are not known here), and neither is anything without CUDA.
  /// True when the next run() on `devices` (GPU indices, local order) must build communicators
  /// (none yet, or the last ones failed). Call from the thread that calls run().
  bool needs_build(const std::vector<int>& devices) const;

  static bool eligible(collective_kind kind, reduce_op op, int64_t axis,
                       const std::vector<std::vector<tensor>>& leaves, bool across_workers = false);

  /// Runs the call on NCCL and returns each replica's result leaves, on that replica's GPU.
  /// `root` is the broadcasting replica's rank. The inputs must be complete (their replicas
  /// synchronised their streams). Waits at most `timeout`.
  /// @throws error(collective_timeout | device_error | ...) naming `what`; the communicators are
  /// then aborted and rebuilt at the next call.
  std::vector<std::vector<tensor>> run(collective_kind kind, reduce_op op, int root,
                                       const std::vector<std::vector<tensor>>& leaves,
                                       std::chrono::milliseconds timeout, const std::string& what,
                                       const group_spec& spec = {});

private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace consort::detail
