// consort-train: data-parallel training of an MLP classifier (16 -> 2 x 512 -> 4 by default,
// float32 GEMMs), run by replica actors on every worker. The same binary runs as 1 replica, N CPU
// replicas in one process, or N workers x K replicas (tools/consort-launch, TF_CONFIG, srun,
// mpirun); with the same seed and global batch the weights agree with a single-replica run to
// float32 rounding, which `--verify` checks over the first steps in the same process.
//
//   ./build/examples/train/consort-train                   # every GPU, else 1 CPU replica per core
//   ./build/examples/train/consort-train --devices GPU:0   # one GPU (verified on one CPU)
//   tools/consort-launch -n 2 -- ./build/examples/train/consort-train --hidden 1024 --layers 3
//
// Each step: distribute_dataset hands each replica its slice of the global batch; each replica
// computes the summed loss and the gradients of its slice; the gradients are all-reduced (SUM) in
// fused buckets, each started as soon as the backward pass has produced it, and divided by the
// global batch, so partial batches weigh correctly. docs/train.md explains the options.

#include "trainer.hpp"

#include <consort/consort.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace consort;
using steady = std::chrono::steady_clock;

namespace {

struct options : train::train_options {
  int replicas = 0;    // 0: CONSORT_DEVICES_PER_WORKER, else one per core (2..8)
  std::string devices; // --devices: a comma-separated list instead of --replicas
  bool verify = true;
  double tolerance = -1; // --tolerance; -1: train::verify_tolerance
  int64_t verify_steps = 10;
  std::string plot;
  std::string trace;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr
      << "consort-train: " << problem << "\n"
      << "usage: consort-train [--replicas N | --devices CPU:0,CPU:1,... | --devices GPU:0,...]\n"
      << "                     [--steps N] [--global-batch N] [--lr X]\n"
      << "                     [--seed N] [--examples N] [--hidden N] [--layers N]\n"
      << "                     [--bucket-bytes N] [--overlap | --no-overlap]\n"
      << "                     [--target-loss X] [--verify | --no-verify] [--verify-steps N]\n"
      << "                     [--tolerance X] [--plot loss.svg] [--trace t.json]\n";
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  auto number = [&](int& i, const char* name) {
    if (i + 1 >= argc)
      usage(std::string{name} + " needs a value");
    char* end = nullptr;
    auto text = argv[++i];
    double v = std::strtod(text, &end);
    if (end == text || *end != '\0' || !(v >= 0))
      usage(std::string{name} + " needs a non-negative number; got \"" + text + "\"");
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--replicas")
      o.replicas = static_cast<int>(number(i, "--replicas"));
    else if (a == "--devices") {
      if (i + 1 >= argc)
        usage("--devices needs a list such as CPU:0,CPU:1");
      o.devices = argv[++i];
    } else if (a == "--steps")
      o.steps = static_cast<int64_t>(number(i, "--steps"));
    else if (a == "--global-batch")
      o.global_batch = static_cast<int64_t>(number(i, "--global-batch"));
    else if (a == "--lr")
      o.learning_rate = number(i, "--lr");
    else if (a == "--seed")
      o.seed = static_cast<uint64_t>(number(i, "--seed"));
    else if (a == "--examples")
      o.examples = static_cast<int64_t>(number(i, "--examples"));
    else if (a == "--hidden")
      o.hidden = static_cast<int>(number(i, "--hidden"));
    else if (a == "--layers")
      o.layers = static_cast<int>(number(i, "--layers"));
    else if (a == "--target-loss")
      o.target_loss = number(i, "--target-loss");
    else if (a == "--tolerance")
      o.tolerance = number(i, "--tolerance");
    else if (a == "--verify-steps")
      o.verify_steps = static_cast<int64_t>(number(i, "--verify-steps"));
    else if (a == "--overlap")
      o.overlap = true;
    else if (a == "--no-overlap")
      o.overlap = false;
    else if (a == "--bucket-bytes") {
      // A byte count, with an optional K, M or G (binary) suffix: 65536, 64K, 1M.
      if (i + 1 >= argc)
        usage("--bucket-bytes needs a value");
      std::string text = argv[++i];
      char* end = nullptr;
      double v = std::strtod(text.c_str(), &end);
      std::string suffix = end;
      double scale = suffix.empty()  ? 1
                     : suffix == "K" ? 1 << 10
                     : suffix == "M" ? 1 << 20
                     : suffix == "G" ? 1 << 30
                                     : -1;
      if (end == text.c_str() || scale < 0 || !(v >= 0))
        usage("--bucket-bytes needs a byte count such as 65536, 64K or 1M; got \"" + text + "\"");
      o.bucket_bytes = static_cast<size_t>(v * scale);
    } else if (a == "--verify")
      o.verify = true;
    else if (a == "--no-verify")
      o.verify = false;
    else if (a == "--plot" || a == "--trace") {
      if (i + 1 >= argc)
        usage(a + " needs a file name");
      (a == "--plot" ? o.plot : o.trace) = argv[++i];
    } else
      usage("unknown argument \"" + a + "\"");
  }
  if (o.global_batch < 1 || o.hidden < 1 || o.examples < 1 || o.layers < 1 || o.steps < 1)
    usage("--steps, --global-batch, --hidden, --layers and --examples must be at least 1");
  if (!(o.learning_rate > 0))
    usage("--lr must be greater than 0");
  if (!o.devices.empty() && o.replicas != 0)
    usage("--devices and --replicas both say which replicas to run; give one of them");
  if (o.verify_steps < 1)
    usage("--verify-steps must be at least 1");
  if (o.verify)
    o.snapshot_step = std::min(o.verify_steps, o.steps);
  return o;
}

bool is_terminal() {
  return isatty(STDOUT_FILENO) != 0;
}

/// The chief's progress: a live bar on a terminal, a log line every 50 steps otherwise.
train::progress_fn progress_printer(int64_t steps) {
  return [steps](int64_t step, double loss, double accuracy, double rate) {
    if (is_terminal()) {
      int width = 30;
      int done = static_cast<int>(width * step / steps);
      std::printf("\r[%s%s] step %lld/%lld  loss %.4f  acc %.3f  %.0f examples/s ",
                  std::string(static_cast<size_t>(done), '#').c_str(),
                  std::string(static_cast<size_t>(width - done), '.').c_str(),
                  static_cast<long long>(step), static_cast<long long>(steps), loss, accuracy,
                  rate);
      if (step == steps)
        std::printf("\n");
    } else if (step % 50 == 0 || step == steps || step == 1) {
      std::printf("step %4lld/%lld  loss %.4f  accuracy %.3f  %.0f examples/s\n",
                  static_cast<long long>(step), static_cast<long long>(steps), loss, accuracy,
                  rate);
    }
    std::fflush(stdout);
  };
}

/// The replicas of `--devices`, checked: CPU replicas, or GPUs this process sees, not both (the
/// model keeps its parameters on the host for CPU replicas and on each GPU for GPU replicas).
/// Empty for an empty list.
std::vector<std::string> devices_of(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  size_t gpus = 0;
  while (start < list.size()) {
    auto comma = list.find(',', start);
    auto name = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    device_spec spec;
    try {
      spec = parse_device(name);
    } catch (const error& e) {
      usage("--devices: " + std::string{e.what()});
    }
    gpus += spec.kind == device_kind::gpu ? 1 : 0;
    out.push_back(spec.to_string());
    if (comma == std::string::npos)
      break;
    start = comma + 1;
  }
  if (!list.empty() && out.empty())
    usage("--devices needs a list such as CPU:0,CPU:1 or GPU:0,GPU:1; got \"" + list + "\"");
  if (gpus != 0 && gpus != out.size())
    usage("--devices: give CPU replicas or GPUs, not both; got \"" + list + "\"");
  for (const auto& name : out)
    if (auto spec = parse_device(name); spec.kind == device_kind::gpu && spec.index >= num_gpus())
      usage("--devices: " + name + " is not available: this process sees " +
            std::to_string(num_gpus()) + " GPU(s)" +
            (num_gpus() == 0 ? " (" + gpus_unavailable_reason() + ")" : std::string{}));
  return out;
}

/// The replicas when neither --devices nor --replicas names them, as MirroredStrategy() picks
/// them: every visible GPU (or the first CONSORT_DEVICES_PER_WORKER of them, under the launcher's
/// --devices-per-worker), else CONSORT_DEVICES_PER_WORKER CPU replicas, else one per core (2..8).
std::vector<std::string> default_devices() {
  const char* env = std::getenv("CONSORT_DEVICES_PER_WORKER");
  int wanted = 0;
  if (env && *env) {
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || v < 1 || v > 4096)
      usage("CONSORT_DEVICES_PER_WORKER must be a count >= 1; got \"" + std::string{env} + "\"");
    wanted = static_cast<int>(v);
  }
  std::vector<std::string> out;
  if (const int gpus = num_gpus(); gpus > 0) {
    if (wanted > gpus)
      usage("CONSORT_DEVICES_PER_WORKER asks for " + std::to_string(wanted) +
            " replicas and this process sees " + std::to_string(gpus) +
            " GPU(s); give --devices CPU:0,... for CPU replicas");
    for (int i = 0; i < (wanted > 0 ? wanted : gpus); ++i)
      out.push_back("GPU:" + std::to_string(i));
    return out;
  }
  // One CPU replica per core (at least 2, so the demo is distributed, at most 8). Said aloud, so
  // that a run that should have found GPUs shows why it did not (and the GPU test's skip can tell
  // "no GPU here" from "GPUs here but not taken").
  std::printf("no GPU visible (%s): CPU replicas\n", gpus_unavailable_reason().c_str());
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  for (int i = 0; i < (wanted > 0 ? wanted : std::clamp(cores, 2, 8)); ++i)
    out.push_back("CPU:" + std::to_string(i));
  return out;
}

} // namespace

int main(int argc, char** argv) {
  auto o = parse(argc, argv);
  try {
    multi_worker_options mw;
    if (!o.devices.empty())
      mw.devices = devices_of(o.devices);
    else if (o.replicas > 0)
      for (int i = 0; i < o.replicas; ++i)
        mw.devices.push_back("CPU:" + std::to_string(i));
    else
      mw.devices = default_devices();
    multi_worker_mirrored_strategy strategy({}, mw);
    bool chief = strategy.worker_rank() == 0;
    int worker = strategy.worker_rank();
    train::synthetic_options data_opts;
    data_opts.examples = o.examples;
    data_opts.seed = o.seed;
    auto data = train::make_dataset(data_opts);
    std::string device_list;
    for (const auto& device : strategy.worker_devices())
      device_list += (device_list.empty() ? "" : ",") + device;
    if (chief)
      std::printf("consort-train: %d worker(s) x %zu replica(s) on %s = %d replicas in sync; MLP "
                  "%lld -> %d x %d -> %d, %lld examples, global batch %lld, "
                  "%lld steps, buckets of %zu bytes, %s\n",
                  strategy.num_workers(), strategy.num_local_replicas(), device_list.c_str(),
                  strategy.num_replicas_in_sync(), static_cast<long long>(data.x.shape()[1]),
                  o.layers, o.hidden, data_opts.classes, static_cast<long long>(o.examples),
                  static_cast<long long>(o.global_batch), static_cast<long long>(o.steps),
                  o.bucket_bytes, o.overlap ? "overlap on" : "overlap off");
    if (chief && parse_device(strategy.worker_devices()[0]).kind == device_kind::gpu)
      std::printf("GEMMs on the GPU: %s\n", train::gpu_gemm_backend().c_str());
    train::tracer trace(!o.trace.empty());
    auto result = train::train_on(strategy, o, data, trace, worker,
                                  chief ? progress_printer(o.steps) : train::progress_fn{});
    if (chief) {
      std::printf("trained: %lld steps, final loss %.4f, accuracy %.3f; %.0f examples/s, %.2f s "
                  "in collectives (summed over local replicas)\n",
                  static_cast<long long>(result.steps), result.curve.loss.back(),
                  result.curve.accuracy.back(), result.examples_per_s, result.collective_s);
      if (o.target_loss > 0) {
        if (result.reached_target)
          std::printf("target loss %.4f reached at step %lld after %.3f s\n", o.target_loss,
                      static_cast<long long>(result.steps), result.time_to_target_s);
        else
          std::printf("target loss %.4f not reached in %lld steps (%.3f s)\n", o.target_loss,
                      static_cast<long long>(result.steps), result.elapsed_s);
      }
    }
    if (!o.plot.empty() && chief) {
      train::write_plot(o.plot, result.curve);
      std::printf("wrote %s\n", o.plot.c_str());
    }
    if (trace.on()) {
      auto path = strategy.num_workers() > 1 ? o.trace + "." + std::to_string(worker) : o.trace;
      trace.write(path);
      if (chief)
        std::printf("wrote %s (open in https://ui.perfetto.dev)\n", path.c_str());
    }
    if (o.verify) {
      // The reference: one replica in this process, same seed and global batch, over the first
      // steps (all of them when the run stopped before the snapshot), on the device of the run's
      // first replica. Every example's forward pass then has the same bits as in the run, only
      // the order of the gradient sums differs, and every weight agrees to float32 rounding.
      const bool whole = result.snapshot.is_dict() == false;
      const nest& mine = whole ? result.params : result.snapshot;
      auto same = static_cast<train::train_options>(o);
      same.steps = whole ? result.steps : o.snapshot_step;
      same.target_loss = 0;
      same.snapshot_step = 0;
      const std::string first = strategy.worker_devices()[0];
      const bool on_gpus = parse_device(first).kind == device_kind::gpu;
      const double limit = o.tolerance >= 0 ? o.tolerance : train::verify_tolerance;
      one_device_strategy single(on_gpus ? first : "CPU:0");
      train::tracer off(false);
      auto reference = train::train_on(single, same, data, off, 0);
      auto worst = train::largest_difference(mine, reference.params);
      bool ok = worst.relative <= limit;
      std::printf("verify (worker %d): weights after %lld steps of %d %s replicas vs 1 %s "
                  "replica: max relative difference %.2e (limit %.0e): %s\n",
                  worker, static_cast<long long>(same.steps), strategy.num_replicas_in_sync(),
                  on_gpus ? "GPU" : "CPU", on_gpus ? "GPU" : "CPU", worst.relative, limit,
                  ok ? "OK" : "MISMATCH");
      if (!ok)
        std::printf("verify (worker %d): largest at parameter %zu element %zu: %.9g here, %.9g "
                    "in the reference\n",
                    worker, worst.tensor, worst.element, static_cast<double>(worst.a),
                    static_cast<double>(worst.b));
      if (on_gpus) {
        // The GPU kernels against the host model: one step on one GPU replica and on one CPU
        // replica. Their forward passes round differently, and a pre-activation within rounding
        // of zero lands on the other side of its ReLU, which moves single gradient elements by
        // up to 1e-3 relative and whole tensors by about 1e-4 normwise; training compounds it.
        // So this check takes one step and compares each tensor normwise (docs/train.md).
        auto one = static_cast<train::train_options>(same);
        one.steps = 1;
        auto gpu_step = train::train_on(single, one, data, off, 0);
        one_device_strategy host("CPU:0");
        auto host_step = train::train_on(host, one, data, off, 0);
        auto kernels = train::largest_difference(gpu_step.params, host_step.params);
        bool kernels_ok = kernels.normwise <= train::verify_tolerance_gpu;
        std::printf("verify (worker %d): weights after 1 step on %s vs 1 CPU replica: normwise "
                    "relative difference %.2e (limit %.0e): %s\n",
                    worker, first.c_str(), kernels.normwise, train::verify_tolerance_gpu,
                    kernels_ok ? "OK" : "MISMATCH");
        ok = ok && kernels_ok;
      }
      if (!ok)
        return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consort-train: %s\n", e.what());
    return 1;
  }
}
