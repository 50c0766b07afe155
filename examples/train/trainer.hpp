#pragma once

// The distributed training loop of consort-train, as a library so that the demo, its benchmark
// (bench/train_bench.cpp) and its tests run the same code.
//
// Each step: distribute_dataset hands each replica its slice of the global batch; each replica
// computes the summed loss and the float64 gradient sums of its slice; the gradients are
// all-reduced (SUM) in fused buckets and divided by the global batch, so partial batches weigh
// correctly; the loss is reported with reduce(MEAN, axis=0) over every example of the global batch.

#include "mlp.hpp"

#include <consort/consort.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace consort::train {

/// What a training run does; every layout given the same options trains the same model.
struct train_options {
  int64_t steps = 600;
  int64_t global_batch = 64;
  double learning_rate = 0.2;
  uint64_t seed = 42;
  int64_t examples = 4096;
  int hidden = 32;
  /// Gradient bucket size in bytes; 0 is one all-reduce per tensor.
  size_t bucket_bytes = size_t{64} << 10;
};

/// Chrome/Perfetto trace events ("X" complete events): one process track per worker (pid) and one
/// thread track per replica (tid; -1 for the worker's own step track). Thread-safe.
class tracer {
public:
  explicit tracer(bool on);
  bool on() const { return on_; }

  void add(const std::string& name, int pid, int tid, std::chrono::steady_clock::time_point begin,
           std::chrono::steady_clock::time_point end);

  /// Writes `{"traceEvents": [...]}`. @throws std::runtime_error naming `path` when it cannot.
  void write(const std::string& path) const;

  size_t size() const;

private:
  bool on_;
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex mtx_;
  std::vector<std::string> events_;
};

/// Splits tensors of `sizes` bytes into buckets [begin, end) of consecutive tensors whose sizes
/// add up to at most `bucket_bytes` (a tensor larger than that gets a bucket of its own);
/// `bucket_bytes` 0 gives one bucket per tensor.
std::vector<std::pair<size_t, size_t>> plan_buckets(const std::vector<size_t>& sizes,
                                                    size_t bucket_bytes);

/// All-reduces (SUM) `leaves` bucket by bucket: the leaves of a bucket are flattened into one
/// vector, reduced with one collective, and cut back apart, as DDP and Horovod fuse small
/// gradients. Leaves of one bucket must share a dtype. Records one trace event per bucket.
std::vector<tensor> bucketed_all_reduce(replica_context& ctx, const std::vector<tensor>& leaves,
                                        size_t bucket_bytes, tracer& trace, int worker);

/// The loss and accuracy of every step.
struct history {
  std::vector<double> loss;
  std::vector<double> accuracy;
};

struct outcome {
  nest params;
  history curve;
  double elapsed_s = 0;
  double examples_per_s = 0;
  /// Seconds inside the gradient all-reduces, summed over this worker's replicas.
  double collective_s = 0;
  /// All-reduce calls per replica per step.
  int64_t collectives_per_step = 0;
};

/// Called on the chief after every step: step (1-based), loss, accuracy, examples/s so far.
using progress_fn = std::function<void(int64_t, double, double, double)>;

/// Trains on `strategy` from the seed's initial parameters and returns the final ones.
outcome train_on(strategy& strategy, const train_options& options, const dataset_tensors& data,
                 tracer& trace, int worker, const progress_fn& progress = {});

/// The largest relative difference between the leaves of two float32 parameter sets (relative to
/// the larger magnitude, at least 1e-3).
double max_relative_difference(const nest& a, const nest& b);

/// Writes the loss (red) and accuracy (blue) curves as an SVG line chart.
/// @throws std::runtime_error naming `path` when it cannot be written.
void write_plot(const std::string& path, const history& curve);

} // namespace consort::train
