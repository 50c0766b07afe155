// consort-train: data-parallel training of a small MLP classifier, run by replica actors on every
// worker. The same binary runs as 1 replica, N CPU replicas in one process, or N workers x K
// replicas (tools/consort-launch, TF_CONFIG, srun, mpirun); with the same seed and global batch the
// final weights agree with a single-replica run, which `--verify` checks in the same process.
//
//   ./build/examples/train/consort-train                   # 4 CPU replicas, 600 steps, --verify
//   tools/consort-launch -n 2 --devices-per-worker 2 -- ./build/examples/train/consort-train
//
// Each step: distribute_dataset hands each replica its slice of the global batch; each replica
// computes the summed loss and the gradients of its slice; the gradients are all-reduced (SUM) in
// fused buckets and divided by the global batch, so partial batches weigh correctly; the loss is
// reported with reduce(MEAN, axis=0) over every example of the global batch.

#include "mlp.hpp"

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
#include <vector>

using namespace consort;
using steady = std::chrono::steady_clock;

namespace {

struct options {
  int replicas = 0; // 0: CONSORT_DEVICES_PER_WORKER, else 4
  int64_t steps = 600;
  int64_t global_batch = 64;
  double learning_rate = 0.2;
  uint64_t seed = 42;
  int64_t examples = 4096;
  int hidden = 32;
  size_t bucket_bytes = size_t{64} << 10; // 0: one all-reduce per tensor
  bool verify = true;
  std::string plot;
  std::string trace;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "consort-train: " << problem << "\n"
            << "usage: consort-train [--replicas N] [--steps N] [--global-batch N] [--lr X]\n"
            << "                     [--seed N] [--examples N] [--hidden N] [--bucket-bytes N]\n"
            << "                     [--verify | --no-verify] [--plot loss.svg] [--trace t.json]\n";
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
    else if (a == "--steps")
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
    else if (a == "--bucket-bytes")
      o.bucket_bytes = static_cast<size_t>(number(i, "--bucket-bytes"));
    else if (a == "--verify")
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
  if (o.global_batch < 1 || o.hidden < 1 || o.examples < 1)
    usage("--global-batch, --hidden and --examples must be at least 1");
  return o;
}

// -- tracing -----------------------------------------------------------------------------------

/// Chrome/Perfetto trace events ("X" complete events), one track per worker (pid) and replica
/// (tid). Thread safety: thread-safe.
class tracer {
public:
  explicit tracer(bool on) : on_(on), start_(steady::now()) {}
  bool on() const { return on_; }

  void add(const std::string& name, int pid, int tid, steady::time_point begin,
           steady::time_point end) {
    if (!on_)
      return;
    auto us = [&](steady::time_point t) {
      return std::chrono::duration_cast<std::chrono::microseconds>(t - start_).count();
    };
    std::ostringstream e;
    e << R"({"name":")" << name << R"(","ph":"X","pid":)" << pid << R"(,"tid":)" << tid
      << R"(,"ts":)" << us(begin) << R"(,"dur":)" << std::max<int64_t>(us(end) - us(begin), 1)
      << '}';
    std::lock_guard<std::mutex> guard{mtx_};
    events_.push_back(e.str());
  }

  void write(const std::string& path) const {
    std::ofstream out(path);
    out << "{\"traceEvents\":[\n";
    for (size_t i = 0; i < events_.size(); ++i)
      out << events_[i] << (i + 1 < events_.size() ? ",\n" : "\n");
    out << "]}\n";
  }

private:
  bool on_;
  steady::time_point start_;
  std::mutex mtx_;
  std::vector<std::string> events_;
};

// -- bucketed all-reduce -------------------------------------------------------------------------

/// All-reduces (SUM) `leaves` in buckets of about `bucket_bytes`: the leaves of a bucket are
/// flattened into one float32 vector, reduced with one collective, and cut back apart, as DDP and
/// Horovod fuse small gradients. `bucket_bytes` 0: one all-reduce per leaf.
std::vector<tensor> bucketed_all_reduce(replica_context& ctx, const std::vector<tensor>& leaves,
                                        size_t bucket_bytes, tracer& trace, int worker) {
  std::vector<tensor> out(leaves.size());
  size_t i = 0;
  while (i < leaves.size()) {
    size_t j = i;
    size_t bytes = 0;
    do {
      bytes += leaves[j].num_bytes();
      ++j;
    } while (j < leaves.size() && bucket_bytes > 0 &&
             bytes + leaves[j].num_bytes() <= bucket_bytes);
    auto begin = steady::now();
    if (j == i + 1) {
      out[i] = ctx.all_reduce("SUM", leaves[i]);
    } else {
      std::vector<tensor> flat;
      for (size_t k = i; k < j; ++k)
        flat.push_back(leaves[k].reshape({leaves[k].num_elements()}));
      auto reduced = ctx.all_reduce("SUM", concat(flat, 0));
      int64_t offset = 0;
      for (size_t k = i; k < j; ++k) {
        auto n = leaves[k].num_elements();
        out[k] = reduced.slice(offset, offset + n).reshape(leaves[k].shape());
        offset += n;
      }
    }
    trace.add("all_reduce(" + std::to_string(j - i) + " tensors)", worker,
              ctx.replica_id_in_sync_group(), begin, steady::now());
    i = j;
  }
  return out;
}

// -- training ------------------------------------------------------------------------------------

/// Rounds every leaf of a float64 nest to float32, once.
nest to_float32(const nest& values) {
  std::vector<tensor> out;
  for (const auto& t : flatten(values)) {
    auto v = t.to_vector<double>();
    std::vector<float> f(v.begin(), v.end());
    out.push_back(tensor::from<float>(f, t.shape()));
  }
  return pack_as(values, out);
}

struct history {
  std::vector<double> loss;
  std::vector<double> accuracy;
};

struct outcome {
  nest params;
  history curve;
  double examples_per_s = 0;
  double collective_s = 0;
};

bool is_terminal() {
  return isatty(STDOUT_FILENO) != 0;
}

/// Trains on `strategy` and returns the final parameters. `report` prints progress (chief only).
outcome train_on(strategy& strategy, const options& o, const train::dataset_tensors& data,
                 bool report, tracer& trace, int worker) {
  train::mlp_shape shape{
      static_cast<int>(data.x.shape()[1]), o.hidden,
      static_cast<int>(1 + *std::max_element(data.y.data<int32_t>(),
                                             data.y.data<int32_t>() + data.y.num_elements()))};
  outcome result;
  result.params = train::init_params(shape, o.seed);
  auto ds =
      dataset::from_tensor_slices(nest::dict({{"x", data.x}, {"y", data.y}})).batch(o.global_batch);
  auto dist = strategy.distribute_dataset(ds);
  auto start = steady::now();
  int64_t seen = 0;
  std::mutex collective_mtx;
  double collective_s = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    auto batch = dist.get(step % dist.cardinality());
    auto step_begin = steady::now();
    auto outputs = strategy.run(
        [&, params = result.params](replica_context& ctx, const nest& part) {
          auto begin = steady::now();
          auto lg = train::forward_backward(params, part["x"].as_tensor(), part["y"].as_tensor());
          // float64 gradient sums: how the batch is split changes them only at float64 rounding.
          auto leaves = flatten(lg.grads64);
          auto rows = static_cast<double>(part["y"].as_tensor().num_elements());
          // The counts travel with the gradients in the last bucket.
          leaves.push_back(tensor::from<double>(
              {lg.loss_sum.item<float>(), lg.correct.item<float>(), rows}, {3}));
          auto reduce_begin = steady::now();
          auto reduced = bucketed_all_reduce(ctx, leaves, o.bucket_bytes, trace, worker);
          auto reduce_end = steady::now();
          {
            std::lock_guard<std::mutex> guard{collective_mtx};
            collective_s += std::chrono::duration<double>(reduce_end - reduce_begin).count();
          }
          trace.add("step", worker, ctx.replica_id_in_sync_group(), begin, reduce_end);
          auto totals = reduced.back();
          reduced.pop_back();
          return nest::dict({{"grads", pack_as(lg.grads64, reduced)},
                             {"totals", totals},
                             {"loss", lg.per_example_loss}});
        },
        batch);
    // Every replica holds the same reduced gradients; take the first.
    auto totals = outputs[0]["totals"].as_tensor().to_vector<double>();
    auto global_rows = static_cast<int64_t>(totals[2]);
    if (global_rows > 0)
      train::sgd_update(result.params, to_float32(outputs[0]["grads"]), o.learning_rate,
                        global_rows);
    // The loss as tf.distribute reports it: MEAN over every example of the global batch.
    std::vector<nest> losses;
    for (auto& out : outputs)
      losses.push_back(out["loss"]);
    auto loss = strategy.reduce("MEAN", per_replica<nest>(losses), 0).as_tensor().item<float>();
    auto accuracy = totals[1] / std::max(totals[2], 1.0);
    result.curve.loss.push_back(loss);
    result.curve.accuracy.push_back(accuracy);
    seen += global_rows;
    trace.add("step " + std::to_string(step), worker, -1, step_begin, steady::now());
    if (report) {
      auto elapsed = std::chrono::duration<double>(steady::now() - start).count();
      auto rate = static_cast<double>(seen) / std::max(elapsed, 1e-9);
      if (is_terminal()) {
        int width = 30;
        int done = static_cast<int>(width * (step + 1) / o.steps);
        std::printf("\r[%s%s] step %lld/%lld  loss %.4f  acc %.3f  %.0f examples/s ",
                    std::string(static_cast<size_t>(done), '#').c_str(),
                    std::string(static_cast<size_t>(width - done), '.').c_str(),
                    static_cast<long long>(step + 1), static_cast<long long>(o.steps), loss,
                    accuracy, rate);
        std::fflush(stdout);
        if (step + 1 == o.steps)
          std::printf("\n");
      } else if ((step + 1) % 50 == 0 || step + 1 == o.steps || step == 0) {
        std::printf("step %4lld/%lld  loss %.4f  accuracy %.3f  %.0f examples/s\n",
                    static_cast<long long>(step + 1), static_cast<long long>(o.steps), loss,
                    accuracy, rate);
        std::fflush(stdout);
      }
    }
  }
  auto elapsed = std::chrono::duration<double>(steady::now() - start).count();
  result.examples_per_s = static_cast<double>(seen) / std::max(elapsed, 1e-9);
  result.collective_s = collective_s;
  return result;
}

/// The largest relative difference between the leaves of two parameter sets.
double max_relative_difference(const nest& a, const nest& b) {
  auto la = flatten(a);
  auto lb = flatten(b);
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    auto va = la[i].to_vector<float>();
    auto vb = lb[i].to_vector<float>();
    for (size_t k = 0; k < va.size(); ++k) {
      double scale = std::max({std::fabs(double(va[k])), std::fabs(double(vb[k])), 1e-3});
      worst = std::max(worst, std::fabs(double(va[k]) - double(vb[k])) / scale);
    }
  }
  return worst;
}

void write_plot(const std::string& path, const history& h) {
  const double w = 640, ht = 360, pad = 40;
  auto poly = [&](const std::vector<double>& ys, double lo, double hi) {
    std::ostringstream p;
    for (size_t i = 0; i < ys.size(); ++i) {
      double x = pad + (w - 2 * pad) * (ys.size() > 1 ? double(i) / double(ys.size() - 1) : 0);
      double y = ht - pad - (ht - 2 * pad) * (ys[i] - lo) / std::max(hi - lo, 1e-12);
      p << (i ? " " : "") << std::fixed << std::setprecision(1) << x << ',' << y;
    }
    return p.str();
  };
  double lmax = h.loss.empty() ? 1 : *std::max_element(h.loss.begin(), h.loss.end());
  std::ofstream out(path);
  out << R"(<svg xmlns="http://www.w3.org/2000/svg" width="640" height="360" font-family="sans-serif" font-size="12">)"
      << "\n<rect width=\"640\" height=\"360\" fill=\"white\"/>\n"
      << "<line x1=\"40\" y1=\"320\" x2=\"600\" y2=\"320\" stroke=\"black\"/>\n"
      << "<line x1=\"40\" y1=\"40\" x2=\"40\" y2=\"320\" stroke=\"black\"/>\n"
      << "<polyline fill=\"none\" stroke=\"#d62728\" stroke-width=\"1.5\" points=\""
      << poly(h.loss, 0, lmax) << "\"/>\n"
      << "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\""
      << poly(h.accuracy, 0, 1) << "\"/>\n"
      << "<text x=\"50\" y=\"30\" fill=\"#d62728\">loss (0.." << std::setprecision(3) << lmax
      << ")</text>\n<text x=\"200\" y=\"30\" fill=\"#1f77b4\">accuracy (0..1)</text>\n"
      << "<text x=\"560\" y=\"340\">step " << h.loss.size() << "</text>\n</svg>\n";
}

} // namespace

int main(int argc, char** argv) {
  auto o = parse(argc, argv);
  try {
    multi_worker_options mw;
    int replicas = o.replicas;
    if (replicas == 0) {
      const char* env = std::getenv("CONSORT_DEVICES_PER_WORKER");
      replicas = env && *env ? std::atoi(env) : 4;
    }
    for (int i = 0; i < replicas; ++i)
      mw.devices.push_back("CPU:" + std::to_string(i));
    multi_worker_mirrored_strategy strategy({}, mw);
    bool chief = strategy.worker_rank() == 0;
    int worker = strategy.worker_rank();
    train::synthetic_options data_opts;
    data_opts.examples = o.examples;
    data_opts.seed = o.seed;
    auto data = train::make_dataset(data_opts);
    if (chief)
      std::printf("consort-train: %d worker(s) x %zu replica(s) = %d replicas in sync; "
                  "%lld examples, global batch %lld, %lld steps, buckets of %zu bytes\n",
                  strategy.num_workers(), strategy.num_local_replicas(),
                  strategy.num_replicas_in_sync(), static_cast<long long>(o.examples),
                  static_cast<long long>(o.global_batch), static_cast<long long>(o.steps),
                  o.bucket_bytes);
    tracer trace(!o.trace.empty());
    auto result = train_on(strategy, o, data, chief, trace, worker);
    if (chief)
      std::printf("trained: final loss %.4f, accuracy %.3f; %.0f examples/s, %.2f s in "
                  "collectives (summed over local replicas)\n",
                  result.curve.loss.back(), result.curve.accuracy.back(), result.examples_per_s,
                  result.collective_s);
    if (!o.plot.empty() && chief) {
      write_plot(o.plot, result.curve);
      std::printf("wrote %s\n", o.plot.c_str());
    }
    if (trace.on()) {
      auto path = strategy.num_workers() > 1 ? o.trace + "." + std::to_string(worker) : o.trace;
      trace.write(path);
      if (chief)
        std::printf("wrote %s (open in https://ui.perfetto.dev)\n", path.c_str());
    }
    if (o.verify) {
      // The reference: one replica in this process, same seed, same global batch.
      one_device_strategy single("CPU:0");
      tracer off(false);
      auto reference = train_on(single, o, data, false, off, 0);
      auto diff = max_relative_difference(result.params, reference.params);
      bool ok = diff <= 1e-5;
      std::printf("verify (worker %d): final weights of %d replicas vs 1 replica: max relative "
                  "difference %.2e (limit 1e-5): %s\n",
                  worker, strategy.num_replicas_in_sync(), diff, ok ? "OK" : "MISMATCH");
      if (!ok)
        return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consort-train: %s\n", e.what());
    return 1;
  }
}
