#pragma once

// The distributed training loop of consort-train, as a library so that the demo, its benchmark
// (bench/train_bench.cpp) and its tests run the same code.
//
// The model lives in the strategy, as in TF's custom training loop: its parameters are mirrored
// variables and its running loss and accuracy sync-on-read ones (`model_on`). Each step:
// distribute_dataset hands each replica its slice of the global batch; each replica reads its own
// copy of the parameters and computes the summed loss and the gradient sums of its slice; the
// gradients are all-reduced (SUM) in fused buckets (the library's plan_gradient_buckets), each
// bucket as soon as the backward pass has produced it (overlap, as DDP does), and the library's
// sgd applies them to every copy with a learning rate divided by the global batch's rows, so
// partial batches weigh correctly. The loss, accuracy and row count travel in the last bucket, so
// a step costs no collective beyond the gradients'; each replica also adds its own to the
// sync-on-read metrics, which are read (a collective) once per epoch.
// On GPU replicas (docs/train.md, "On GPUs") the same variables have their copies in each GPU's
// memory: a replica queues forward_backward_gpu, the additions to its metrics, the NCCL
// all-reduces and the library's sgd (a CUDA kernel per parameter, in place) on its stream, and
// only the totals come to the host each step.

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
  int64_t global_batch = 512;
  double learning_rate = 0.1;
  uint64_t seed = 42;
  int64_t examples = 4096;
  int hidden = 512;
  /// Hidden layers of `hidden` units.
  int layers = 2;
  /// Classes (the model's logits); 0: 1 + the largest label of the training data. A data file's
  /// reader sets it from every row, so that a class held out of the training rows still has its
  /// logit.
  int classes = 0;
  /// Gradient bucket size in bytes (torch DDP's default bucket_cap_mb, 25 MiB); 0 is one
  /// all-reduce per tensor.
  size_t bucket_bytes = size_t{25} << 20;
  /// Start each bucket's all-reduce while the backward pass of the earlier layers goes on (the
  /// backward pass then runs on a helper thread of the replica, when there are several buckets);
  /// false: all-reduce after it. CPU replicas only: GPU replicas queue the backward kernels and
  /// each bucket's all-reduce on their stream in order, with no helper thread either way.
  bool overlap = true;
  /// Stop after the first step whose loss (the mean over its global batch) is at most this; 0:
  /// run every step.
  double target_loss = 0;
  /// Keep a copy of the parameters after this many steps in `outcome::snapshot` (0: none); the
  /// demo's --verify compares it with a single replica's.
  int64_t snapshot_step = 0;

  // -- checkpoints (docs/train.md, "Checkpoints and resuming") ----------------------------------

  /// Steps already done: the run starts at this step (its batch is `start_step % batches`), from
  /// `initial_params`. A resumed run with the same options computes the same bytes as an
  /// uninterrupted one: a step depends only on the parameters and the step's batch.
  int64_t start_step = 0;
  /// The parameters to start from (those of `init_params` when it is not a dict).
  nest initial_params;
  /// Asked by every CPU replica in every step; a true answer anywhere stops every worker after
  /// that step. The answers travel in the step's all-reduced totals, so every worker sees the same
  /// sum and stops at the same step without a collective of its own. GPU replicas do not ask (the
  /// totals are on the GPU): there the chief's answer after each step stops a one-worker run.
  std::function<bool()> stop_requested;
  /// `on_checkpoint` is called with the host parameters and the steps done after every
  /// `checkpoint_every` steps (0: never), after the last step and after a stop. Only the chief
  /// needs one (it writes), but every worker must have the same `checkpoint_every`: on GPU
  /// replicas each checkpoint brings the parameters to the host with a `strategy.run`, which every
  /// worker makes.
  int64_t checkpoint_every = 0;
  std::function<void(int64_t, const nest&)> on_checkpoint;
  /// Called on every worker after every `commit_every` steps (0: never) with the step count and
  /// the host parameters, which it may keep (a later update copies them first): an elastic run's
  /// in-memory commit (docs/train.md, "Elastic training").
  int64_t commit_every = 0;
  std::function<void(int64_t, const nest&)> on_commit;
  /// Called on every worker after each step with the step count and the host parameters
  /// (`progress` runs on the chief).
  std::function<void(int64_t, const nest&)> on_step;
};

/// Chrome/Perfetto trace events ("X" complete events): one process track per worker (pid) and one
/// thread track per replica (tid; -1 for the worker's own step track, 100 + replica for a replica's
/// compute). Times are kept on the system clock, which the workers of one host share (and hosts
/// under NTP nearly so), so that the workers' events line up in one trace of the job
/// (`write_job`). Written with nlohmann::json: names are escaped. Thread-safe.
class tracer {
public:
  explicit tracer(bool on);
  bool on() const { return on_; }

  /// `flow`, when not empty, names one collective: the events of every worker and replica with
  /// the same flow are linked in the trace (an arrow from the first worker's to each other's).
  void add(const std::string& name, int pid, int tid, std::chrono::steady_clock::time_point begin,
           std::chrono::steady_clock::time_point end, const std::string& flow = {});

  /// This tracer's events as a JSON array (what `write_job` takes from each worker), their times
  /// moved by `shift_us` (onto the chief's clock: `strategy::chief_clock_offset`).
  std::string events_json(int64_t shift_us = 0) const;

  /// Writes `{"traceEvents": [...]}`: this tracer's events alone.
  /// @throws std::runtime_error naming `path` when it cannot.
  void write(const std::string& path) const;

  /// Writes one trace of the job from every worker's `events_json()` (in worker order, named by
  /// `workers`): a process per worker and a thread per replica, named; times from the earliest
  /// event; the collectives of the same `flow` linked across workers and replicas.
  /// @throws std::runtime_error naming `path` when it cannot, or when a worker's events are not
  ///         such an array.
  static void write_job(const std::string& path, const std::vector<std::string>& events,
                        const std::vector<std::string>& workers);

  size_t size() const;

private:
  struct event {
    std::string name;
    int pid = 0;
    int tid = 0;
    int64_t ts_us = 0; // system clock, since the Unix epoch
    int64_t dur_us = 1;
    std::string flow;
  };
  bool on_;
  std::chrono::steady_clock::time_point steady0_;
  int64_t unix0_us_ = 0;
  mutable std::mutex mtx_;
  std::vector<event> events_;
};

/// The model's state, made by the strategy (TF: the model and its metrics built under
/// `strategy.scope()`). A handle: copies name the same variables.
struct model_state {
  /// One mirrored variable per parameter, named by its key (`w3`, `b3`, ..., `w1`, `b1`), in the
  /// order the backward pass produces their gradients.
  std::vector<variable> params;
  /// A sync-on-read SUM variable of 3 float32s, `metrics/totals`: the summed loss, the correct
  /// predictions and the rows of the steps since the last reset; read outside a step, it is the
  /// sum over every replica of every worker (Keras's Mean metrics keep a total and a count the
  /// same way). One variable, so that a step adds to it once and an epoch reads it once.
  variable totals;

  /// The parameters as `init_params` lays them out: the primary copies, on the host.
  nest params_on_host() const;
};

/// The model of `shape` on `strategy`: its variables, created from `initial` (an `init_params`
/// dict) the first time, when under several workers worker 0's values reach every worker (every
/// worker calls it, in the same order of steps); found again and set to `initial` by later calls.
/// @throws error(invalid_argument) when the strategy has the model's variables already with
///         other shapes (a model of another shape needs a strategy of its own); the errors of
///         `strategy::create_variable`.
model_state model_on(strategy& strategy, const mlp_shape& shape, const nest& initial);

/// The loss and accuracy of every step, and of every epoch (the steps over the whole training
/// set) from the sync-on-read metrics.
struct history {
  std::vector<double> loss;
  std::vector<double> accuracy;
  /// Per epoch: the mean loss and the accuracy over its rows, and its first and last steps
  /// (1-based). A run that starts or ends inside an epoch has the part it did. CPU replicas only
  /// (see the file comment).
  std::vector<double> epoch_loss;
  std::vector<double> epoch_accuracy;
  std::vector<int64_t> epoch_first;
  std::vector<int64_t> epoch_end;
};

struct outcome {
  nest params;
  history curve;
  /// The parameters after `snapshot_step` steps (empty when the run stopped before).
  nest snapshot;
  /// Steps done, counting those before `start_step` (fewer than asked when the target loss was
  /// reached or a stop was requested).
  int64_t steps = 0;
  /// Whether `stop_requested` stopped the run.
  bool stopped = false;
  /// Whether a step reached `target_loss`, and the wall time from the start to the end of it.
  bool reached_target = false;
  double time_to_target_s = 0;
  double elapsed_s = 0;
  double examples_per_s = 0;
  /// Seconds inside the gradient all-reduces, summed over this worker's replicas.
  double collective_s = 0;
  /// All-reduce calls per replica per step.
  int64_t collectives_per_step = 0;
};

/// Called on the chief after every step: step (1-based), loss, accuracy, examples/s so far.
using progress_fn = std::function<void(int64_t, double, double, double)>;

/// Trains on `strategy` from the seed's initial parameters and returns the final ones. The
/// dataset's features and classes set the model's input and output widths.
/// @throws error(invalid_argument) for options out of range (steps, batch, sizes), and the
///         errors of the strategy's run (a replica's step failure, a lost peer).
outcome train_on(strategy& strategy, const train_options& options, const dataset_tensors& data,
                 tracer& trace, int worker, const progress_fn& progress = {});

/// The model's number of classes for `data`: `options.classes`, or 1 + the largest label.
/// @throws error(invalid_argument) when a label is `options.classes` or more.
int classes_of(const train_options& options, const dataset_tensors& data);

/// The loss and accuracy of a model over a data set (the demo's held-out rows).
struct evaluation {
  int64_t rows = 0;
  /// The mean cross-entropy loss and the fraction of rows whose highest logit is the label (0
  /// for no rows).
  double loss = 0;
  double accuracy = 0;
};

/// Evaluates `params` (on any device; copied to the host) on `data` on this thread, in chunks of
/// 4096 rows (forward_backward on the host model).
/// @throws forward_backward's errors (a label outside the model's classes).
evaluation evaluate(const nest& params, const dataset_tensors& data);

/// The largest relative difference between the leaves of two float32 parameter sets (relative to
/// the larger magnitude, at least 1e-3).
double max_relative_difference(const nest& a, const nest& b);

/// How two parameter sets differ. Elementwise: the largest relative difference (relative to the
/// larger magnitude, at least 1e-3), the leaf (in flatten order) and element where it lies, and
/// the two values there, so that a failed --verify says what differed. Normwise: the largest over
/// the leaves of |a - b|_2 / max(|a|_2, |b|_2), and that leaf.
struct difference {
  double relative = 0;
  size_t tensor = 0;
  size_t element = 0;
  float a = 0;
  float b = 0;
  double normwise = 0;
  size_t normwise_tensor = 0;
};
difference largest_difference(const nest& a, const nest& b);

/// The largest `max_relative_difference` that `--verify` accepts between the parameters of a
/// data-parallel run and of a single-replica run after the same first steps: float32 gradient
/// sums taken in another order differ in their last bits (see docs/train.md, "What --verify
/// checks").
constexpr double verify_tolerance = 1e-4;

/// The largest normwise difference (`difference::normwise`) that `--verify` accepts between one
/// step on one GPU replica and one step on one CPU replica: the check of the GPU kernels against
/// the host model. (The data-parallel check of a GPU run is against one GPU replica, within
/// `verify_tolerance`.) The GPU's GEMMs round the forward pass differently from the host's, so a
/// pre-activation within rounding of zero can fall on the other side of its ReLU; each such flip
/// moves whole gradient tensors normwise, and later steps compound it, so the check takes one
/// step. The limit leaves a factor of 7 over the differences measured on an H100 after one step
/// (docs/train.md, "What --verify checks", has them over 1 to 300 steps; bench/README.md, "the
/// H100 field run").
constexpr double verify_tolerance_gpu = 2e-3;

/// Writes the loss (red) and accuracy (blue) curves as an SVG line chart.
/// @throws std::runtime_error naming `path` when it cannot be written.
void write_plot(const std::string& path, const history& curve);

} // namespace consort::train
