// train_bench: throughput of the training demo (examples/train) per layout, beside torch
// DistributedDataParallel (gloo) training the same MLP on the same data in the same run
// (examples/train/torch_ddp.py), with each consort gradient mode: fused buckets overlapped with
// the backward pass, fused buckets after it, and one all-reduce per tensor.
//
//   ./build/bench/train_bench                         # layouts 1,2,2x1,2x2; MLP 16-3x1024-4
//   ./build/bench/train_bench --layouts 1,2x1 --steps 40 --target-loss 0.6 --json train.json
//
// A layout is "R" (one process, R CPU replicas; "1" is one_device_strategy, the baseline) or
// "WxK" (W worker processes of K CPU replicas each, started with tools/consort-launch on this
// host, talking over loopback TCP). torch runs 1 process for "1" and W*K processes for "WxK"
// (it has no in-process replicas on CPUs). Scaling is weak by default: every replica gets
// --batch-per-replica examples per step, so the global batch grows with the replicas, as it does
// when a job adds machines; --global-batch fixes it instead (strong scaling). Each configuration
// runs --repeats times, interleaved, and the median is reported; the machine is shared and noisy,
// so read ratios, not absolute figures.
#include "common.hpp"

#include "trainer.hpp"

#include <consort/consort.hpp>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#ifndef CONSORT_TORCH_DDP
#define CONSORT_TORCH_DDP "examples/train/torch_ddp.py"
#endif

#ifndef CONSORT_LAUNCHER
#define CONSORT_LAUNCHER "tools/consort-launch"
#endif

namespace {

using namespace consort;

struct layout {
  int workers = 1;
  int replicas = 1; // per worker
  std::string name() const {
    if (workers == 1)
      return std::to_string(replicas) + (replicas == 1 ? " replica" : " replicas");
    return std::to_string(workers) + " workers x " + std::to_string(replicas);
  }
  int total() const { return workers * replicas; }
};

layout parse_layout(const std::string& text) {
  layout l;
  auto x = text.find('x');
  try {
    size_t used = 0;
    if (x == std::string::npos) {
      l.replicas = std::stoi(text, &used);
      if (used != text.size())
        throw std::invalid_argument(text);
    } else {
      l.workers = std::stoi(text.substr(0, x), &used);
      if (used != x)
        throw std::invalid_argument(text);
      auto rest = text.substr(x + 1);
      l.replicas = std::stoi(rest, &used);
      if (used != rest.size())
        throw std::invalid_argument(text);
    }
  } catch (const std::logic_error&) {
    throw std::invalid_argument("layout \"" + text +
                                "\" is neither R (replicas) nor WxK (workers x replicas)");
  }
  if (l.workers < 1 || l.replicas < 1)
    throw std::invalid_argument("layout \"" + text + "\" needs at least 1 worker and 1 replica");
  return l;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    auto comma = text.find(',', start);
    auto part = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!part.empty())
      out.push_back(part);
    if (comma == std::string::npos)
      break;
    start = comma + 1;
  }
  return out;
}

/// Option `name` as a real number; exits with a clear message when it is not one.
double real(const bench::options& opts, const std::string& name) {
  const auto& text = opts.str(name);
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v))
    opts.fail("--" + name + " expects a number, got '" + text + "'");
  return v;
}

/// One training run's figures (the chief's, for a multi-worker layout).
struct sample {
  double examples_per_s = 0;
  double elapsed_s = 0;
  double collective_s = 0; // summed over the worker's local replicas
  int64_t calls = 0;       // all-reduces per replica per step
  int64_t steps = 0;
  bool reached = false;
  double time_to_target_s = 0;
  double final_loss = 0;
};

/// How the gradients travel: the consort modes and the torch peer.
enum class mode { overlap, fused, per_tensor, torch };

const char* name_of(mode m) {
  switch (m) {
  case mode::overlap:
    return "overlap";
  case mode::fused:
    return "fused";
  case mode::per_tensor:
    return "per-tensor";
  case mode::torch:
    return "torch DDP";
  }
  return "?";
}

mode parse_mode(const std::string& text) {
  for (auto m : {mode::overlap, mode::fused, mode::per_tensor})
    if (text == name_of(m))
      return m;
  throw std::invalid_argument("mode \"" + text + "\" is none of overlap, fused, per-tensor");
}

/// What every run of one bench invocation shares.
struct setup {
  int64_t steps = 0;
  int64_t batch_per_replica = 0; // weak scaling when > 0
  int64_t global_batch = 0;      // strong scaling otherwise
  int hidden = 0;
  int layers = 0;
  int64_t examples = 0;
  double lr = 0;
  size_t bucket_bytes = 0;
  std::string launcher;
  std::string python; // empty: no torch rows
  std::string torch_script;

  int64_t batch_for(const layout& l) const {
    return batch_per_replica > 0 ? batch_per_replica * l.total() : global_batch;
  }
};

train::train_options train_options_of(const setup& s, const layout& l, mode m, int64_t steps,
                                      double target) {
  train::train_options o;
  o.steps = steps;
  o.global_batch = s.batch_for(l);
  o.hidden = s.hidden;
  o.layers = s.layers;
  o.examples = s.examples;
  o.learning_rate = s.lr;
  o.bucket_bytes = m == mode::per_tensor ? 0 : s.bucket_bytes;
  o.overlap = m == mode::overlap;
  o.target_loss = target;
  return o;
}

const train::dataset_tensors& data_for(int64_t examples) {
  static const train::dataset_tensors data = [examples] {
    train::synthetic_options d;
    d.examples = examples;
    return train::make_dataset(d);
  }();
  return data;
}

sample of(const train::outcome& r) {
  sample s;
  s.examples_per_s = r.examples_per_s;
  s.elapsed_s = r.elapsed_s;
  s.collective_s = r.collective_s;
  s.calls = r.collectives_per_step;
  s.steps = r.steps;
  s.reached = r.reached_target;
  s.time_to_target_s = r.time_to_target_s;
  s.final_loss = r.curve.loss.empty() ? 0 : r.curve.loss.back();
  return s;
}

sample in_process(const layout& l, const train::train_options& o) {
  std::unique_ptr<strategy> s;
  if (l.replicas == 1) {
    s = std::make_unique<one_device_strategy>("CPU:0");
  } else {
    std::vector<std::string> devices;
    for (int i = 0; i < l.replicas; ++i)
      devices.push_back("CPU:" + std::to_string(i));
    s = std::make_unique<mirrored_strategy>(devices);
  }
  train::tracer off(false);
  return of(train::train_on(*s, o, data_for(o.examples), off, 0));
}

std::string self_path() {
  std::array<char, 4096> buf{};
  auto n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0)
    throw std::runtime_error("cannot find this program's path (/proc/self/exe)");
  return std::string(buf.data(), static_cast<size_t>(n));
}

/// Runs `cmd` and returns its output; throws with the output when it fails.
std::string output_of(const std::string& cmd, const std::string& what) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(cmd.c_str(), "r"), ::pclose);
  if (!pipe)
    throw std::runtime_error("cannot start " + cmd);
  std::string output;
  std::array<char, 512> line{};
  while (std::fgets(line.data(), static_cast<int>(line.size()), pipe.get()))
    output += line.data();
  int status = ::pclose(pipe.release());
  if (status != 0)
    throw std::runtime_error("the " + what + " run failed (status " + std::to_string(status) +
                             "); its output:\n" + output);
  return output;
}

std::string common_args(const train::train_options& o) {
  char lr[32];
  std::snprintf(lr, sizeof(lr), "%.17g", o.learning_rate);
  char target[32];
  std::snprintf(target, sizeof(target), "%.17g", o.target_loss);
  return " --steps " + std::to_string(o.steps) + " --global-batch " +
         std::to_string(o.global_batch) + " --hidden " + std::to_string(o.hidden) + " --layers " +
         std::to_string(o.layers) + " --examples " + std::to_string(o.examples) + " --lr " + lr +
         " --target-loss " + target;
}

/// Runs the layout as worker processes under the launcher; the chief prints one result line.
sample multi_process(const layout& l, const train::train_options& o, const setup& s) {
  auto cmd = "bash '" + s.launcher + "' -n " + std::to_string(l.workers) +
             " --devices-per-worker " + std::to_string(l.replicas) + " --timeout 600 -- '" +
             self_path() + "' --child 1" + common_args(o) + " --bucket-bytes " +
             std::to_string(o.bucket_bytes) + " --modes " +
             (o.bucket_bytes == 0 ? "per-tensor"
              : o.overlap         ? "overlap"
                                  : "fused") +
             " 2>&1";
  auto output = output_of(cmd, l.name());
  const char* tag = std::strstr(output.c_str(), "train_bench-result ");
  sample r;
  long long calls = 0, steps = 0;
  int reached = 0;
  if (!tag || std::sscanf(tag, "train_bench-result %lf %lf %lf %lld %lld %d %lf %lf",
                          &r.examples_per_s, &r.elapsed_s, &r.collective_s, &calls, &steps,
                          &reached, &r.time_to_target_s, &r.final_loss) != 8)
    throw std::runtime_error("the " + l.name() + " run printed no result line; its output:\n" +
                             output);
  r.calls = calls;
  r.steps = steps;
  r.reached = reached != 0;
  return r;
}

/// A number after `"key": ` in the torch script's RESULT line (JSON of flat numbers and bools).
double json_number(const std::string& json, const std::string& key, const std::string& output) {
  auto at = json.find("\"" + key + "\":");
  if (at == std::string::npos)
    throw std::runtime_error("torch_ddp.py's RESULT line has no \"" + key + "\"; its output:\n" +
                             output);
  auto value = json.substr(at + key.size() + 3);
  while (!value.empty() && value[0] == ' ')
    value.erase(0, 1);
  if (value.rfind("true", 0) == 0)
    return 1;
  if (value.rfind("false", 0) == 0 || value.rfind("null", 0) == 0)
    return 0;
  return std::stod(value);
}

/// The torch DDP peer: `processes` gloo processes training the same model on the same data.
sample torch_run(int processes, const train::train_options& o, const setup& s) {
  auto cmd = "'" + s.python + "' '" + s.torch_script + "' --nproc " + std::to_string(processes) +
             common_args(o) + " --bucket-mb " +
             std::to_string(static_cast<double>(s.bucket_bytes) / (1 << 20)) +
             " --threads 1 --log-every 0 2>&1";
  if (o.target_loss <= 0) // torch_ddp.py takes no --target-loss 0
    cmd = std::string(cmd).replace(cmd.find(" --target-loss "), 15 + std::strlen("0"), "");
  auto output = output_of(cmd, "torch DDP x" + std::to_string(processes));
  auto at = output.find("RESULT ");
  if (at == std::string::npos)
    throw std::runtime_error("torch_ddp.py printed no RESULT line; its output:\n" + output);
  auto json = output.substr(at + 7, output.find('\n', at) - at - 7);
  sample r;
  r.examples_per_s = json_number(json, "examples_per_s", output);
  r.elapsed_s = json_number(json, "elapsed_s", output);
  r.steps = static_cast<int64_t>(json_number(json, "steps", output));
  r.reached = json_number(json, "reached_target", output) != 0;
  r.time_to_target_s = json_number(json, "time_to_target_s", output);
  r.final_loss = json_number(json, "final_loss", output);
  return r;
}

/// --child 1: one worker of a multi-worker layout (started by the launcher).
int child(const bench::options& opts) {
  multi_worker_options mw; // devices from CONSORT_DEVICES_PER_WORKER, cluster from TF_CONFIG
  multi_worker_mirrored_strategy s({}, mw);
  train::train_options o;
  o.steps = opts.integer("steps");
  o.global_batch = opts.integer("global-batch");
  o.hidden = static_cast<int>(opts.integer("hidden"));
  o.layers = static_cast<int>(opts.integer("layers"));
  o.examples = opts.integer("examples");
  o.learning_rate = real(opts, "lr");
  o.target_loss = real(opts, "target-loss");
  o.bucket_bytes = static_cast<size_t>(opts.bytes("bucket-bytes"));
  o.overlap = opts.str("modes") == "overlap";
  train::tracer off(false);
  auto r = train::train_on(s, o, data_for(o.examples), off, s.worker_rank());
  if (s.worker_rank() == 0)
    std::printf("train_bench-result %.6f %.6f %.6f %lld %lld %d %.6f %.6f\n", r.examples_per_s,
                r.elapsed_s, r.collective_s, static_cast<long long>(r.collectives_per_step),
                static_cast<long long>(r.steps), r.reached_target ? 1 : 0, r.time_to_target_s,
                r.curve.loss.back());
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// The python that runs torch_ddp.py: `choice` itself, or with "auto" the first of
/// $TORCH_PYTHON, python3, /usr/bin/python3 that imports torch.distributed with gloo; "" if none.
std::string find_python(const std::string& choice) {
  if (choice == "off")
    return "";
  std::vector<std::string> candidates;
  if (choice != "auto") {
    candidates.push_back(choice);
  } else {
    if (const char* env = std::getenv("TORCH_PYTHON"); env && *env)
      candidates.emplace_back(env);
    candidates.emplace_back("python3");
    candidates.emplace_back("/usr/bin/python3");
  }
  for (const auto& py : candidates) {
    auto probe = "'" + py +
                 "' -c 'import torch.distributed as d; assert d.is_gloo_available()' "
                 ">/dev/null 2>&1";
    if (std::system(probe.c_str()) == 0)
      return py;
  }
  if (choice != "auto")
    throw std::invalid_argument("--python " + choice +
                                " cannot import torch.distributed with gloo");
  return "";
}

/// The BLAS libraries torch has loaded after one matmul (from its /proc/self/maps), and whether
/// one of them is Debian's reference BLAS, which makes the torch rows 10-20x slow (bench/README.md,
/// "torch's BLAS").
std::pair<std::string, bool> torch_blas(const std::string& python) {
  auto libs = output_of("'" + python +
                            "' -c \"import torch; torch.ones(64, 64) @ torch.ones(64, 64); "
                            "print(' '.join(sorted({l.split()[-1] for l in open('/proc/self/maps') "
                            "if 'blas' in l.lower() or 'mkl' in l.lower()})))\" 2>/dev/null",
                        "torch BLAS probe");
  while (!libs.empty() && (libs.back() == '\n' || libs.back() == ' '))
    libs.pop_back();
  const bool reference = libs.find("/blas/libblas.so") != std::string::npos;
  return {libs.empty() ? std::string{"none found (torch's own kernels)"} : libs, reference};
}

struct row {
  layout where;
  mode how = mode::overlap;
  int64_t calls = 0;
  double examples_per_s = 0;
  double ms_per_step = 0;
  double collective_ms_per_step = 0; // per replica; consort only
};

int run(int argc, char** argv) {
  bench::options opts("train_bench", "examples/s of the training demo per layout and gradient "
                                     "mode, beside torch DDP on the same model and data");
  opts.add("layouts", "1,2,2x1,2x2",
           "comma-separated layouts: R replicas, or WxK workers x "
           "replicas (worker processes under tools/consort-launch)");
  opts.add("modes", "overlap,fused,per-tensor", "consort gradient modes to run");
  opts.add("steps", "30", "training steps per run");
  opts.add("repeats", "3", "runs per configuration (interleaved); the median is reported");
  opts.add("batch-per-replica", "512",
           "examples per replica and step (weak scaling); 0: fixed "
           "--global-batch");
  opts.add("global-batch", "512",
           "examples per step over all replicas, with --batch-per-replica 0");
  opts.add("hidden", "1024", "units per hidden layer of the MLP");
  opts.add("layers", "3", "hidden layers of the MLP");
  opts.add("examples", "4096", "examples in the synthetic dataset");
  opts.add("lr", "0.05", "SGD learning rate");
  opts.add("bucket-bytes", "25M", "the fused bucket size (torch DDP's bucket_cap_mb too)");
  opts.add("target-loss", "0", "also time each layout (overlap, and torch) to this loss; 0: skip");
  opts.add("target-steps", "400", "the most steps a time-to-loss run takes");
  opts.add("python", "auto", "python with torch for the DDP rows: auto, a path, or off");
  opts.add("torch-script", CONSORT_TORCH_DDP, "examples/train/torch_ddp.py");
  opts.add("launcher", CONSORT_LAUNCHER, "tools/consort-launch, for WxK layouts");
  opts.add("json", "", "also write the results as JSON to this file");
  opts.add("child", "0", "internal: run as one worker of a WxK layout");
  opts.parse(argc, argv);
  if (opts.integer("child") != 0)
    return child(opts);

  std::vector<layout> layouts;
  for (const auto& text : split(opts.str("layouts")))
    layouts.push_back(parse_layout(text));
  if (layouts.empty())
    throw std::invalid_argument("--layouts names no layout");
  std::vector<mode> modes;
  for (const auto& text : split(opts.str("modes")))
    modes.push_back(parse_mode(text));
  setup s;
  s.steps = opts.integer("steps");
  s.batch_per_replica = opts.integer("batch-per-replica");
  s.global_batch = opts.integer("global-batch");
  s.hidden = static_cast<int>(opts.integer("hidden"));
  s.layers = static_cast<int>(opts.integer("layers"));
  s.examples = opts.integer("examples");
  s.lr = real(opts, "lr");
  s.bucket_bytes = static_cast<size_t>(opts.bytes("bucket-bytes"));
  s.launcher = opts.str("launcher");
  s.torch_script = opts.str("torch-script");
  s.python = find_python(opts.str("python"));
  if (!s.python.empty() && ::access(s.torch_script.c_str(), R_OK) != 0) {
    if (opts.str("python") != "auto")
      throw std::invalid_argument("--torch-script " + s.torch_script + " cannot be read");
    s.python.clear(); // reported as skipped below
  }
  const double target = real(opts, "target-loss");
  const auto target_steps = opts.integer("target-steps");
  const auto repeats = std::max<int64_t>(opts.integer("repeats"), 1);
  if (s.steps < 1 || s.hidden < 1 || s.layers < 1 || s.examples < 1 || target_steps < 1)
    throw std::invalid_argument("--steps, --hidden, --layers, --examples and --target-steps must "
                                "be at least 1");
  if (s.batch_per_replica < 0 || (s.batch_per_replica == 0 && s.global_batch < 1))
    throw std::invalid_argument("--batch-per-replica must be >= 0, and --global-batch >= 1 "
                                "when it is 0");

  std::printf("# consort train_bench: MLP 16 -> %d x %d -> 4, %s, lr %g, %lld steps per run, "
              "median of %lld runs\n",
              s.layers, s.hidden,
              s.batch_per_replica > 0
                  ? ("weak scaling: " + std::to_string(s.batch_per_replica) +
                     " examples per replica and step")
                        .c_str()
                  : ("strong scaling: global batch " + std::to_string(s.global_batch)).c_str(),
              s.lr, static_cast<long long>(s.steps), static_cast<long long>(repeats));
  std::printf("# machine: nproc=%u cpu=%s\n", bench::nproc(), bench::cpu_model().c_str());
  std::printf("# modes: overlap = fused buckets of %zu bytes, each all-reduced as soon as the "
              "backward pass produced it;\n#        fused = the same buckets after the backward "
              "pass; per-tensor = one all-reduce per gradient tensor\n",
              s.bucket_bytes);
  std::printf("# torch DDP: %s\n",
              s.python.empty() ? "skipped (no python with torch.distributed/gloo, or --python off)"
                               : ("examples/train/torch_ddp.py under " + s.python +
                                  ", gloo, 1 thread per process, bucket_cap_mb = bucket-bytes")
                                     .c_str());
  if (!s.python.empty()) {
    std::string libs;
    bool reference = false;
    try {
      std::tie(libs, reference) = torch_blas(s.python);
    } catch (const std::exception& e) {
      libs = std::string{"unknown (the probe failed: "} + e.what() + ")";
    }
    std::printf("# torch BLAS: %s\n", libs.c_str());
    if (reference)
      std::printf("# WARNING: torch calls Debian's reference BLAS, 10-20x slower than an optimized "
                  "one: the torch rows are no fair peer; apt-get install libopenblas0-pthread\n");
  }
  std::printf("# vs 1: examples/s over the same mode's 1-replica row; vs torch: over torch DDP's "
              "row with as many processes\n#\n");
  std::printf("# %-18s %-11s %9s %12s %8s %9s %10s %12s %10s\n", "layout", "gradients", "allreduce",
              "examples/s", "vs 1", "vs torch", "ms/step", "collective", "collective");
  std::printf("# %-18s %-11s %9s %12s %8s %9s %10s %12s %10s\n", "", "", "per step", "", "", "", "",
              "ms/step", "share");

  std::vector<row> rows;
  std::map<mode, double> baseline;
  std::map<int, double> torch_rate; // by process count
  for (const auto& l : layouts) {
    std::vector<mode> here = modes;
    // torch has no in-process replicas on CPUs: it runs "1" and "WxK" (as W*K processes).
    const bool with_torch = !s.python.empty() && (l.total() == 1 || l.workers > 1);
    if (with_torch)
      here.push_back(mode::torch);
    std::map<mode, std::vector<double>> rate, step_ms, coll_ms;
    std::map<mode, int64_t> calls;
    for (int64_t rep = 0; rep < repeats; ++rep) {
      for (auto m : here) {
        auto o = train_options_of(s, l, m, s.steps, 0);
        sample r = m == mode::torch ? torch_run(l.total(), o, s)
                   : l.workers == 1 ? in_process(l, o)
                                    : multi_process(l, o, s);
        rate[m].push_back(r.examples_per_s);
        step_ms[m].push_back(1e3 * r.elapsed_s /
                             static_cast<double>(std::max<int64_t>(r.steps, 1)));
        coll_ms[m].push_back(1e3 * r.collective_s /
                             static_cast<double>(std::max<int64_t>(r.steps, 1) * l.replicas));
        calls[m] = r.calls;
      }
    }
    for (auto m : here) {
      row r{l, m, calls[m], median(rate[m]), median(step_ms[m]), median(coll_ms[m])};
      if (l.total() == 1 && !baseline.count(m))
        baseline[m] = r.examples_per_s;
      if (m == mode::torch)
        torch_rate[l.total()] = r.examples_per_s;
      rows.push_back(r);
    }
    for (auto m : here) {
      const row& r = *std::find_if(rows.begin(), rows.end(), [&](const row& x) {
        return x.where.name() == l.name() && x.how == m;
      });
      char vs1[32] = "-", vst[32] = "-", calls_text[32] = "-", coll[32] = "-", share[32] = "-";
      if (baseline.count(m))
        std::snprintf(vs1, sizeof(vs1), "%.2fx", r.examples_per_s / baseline[m]);
      if (m != mode::torch && torch_rate.count(l.total()) && (l.workers > 1 || l.total() == 1))
        std::snprintf(vst, sizeof(vst), "%.2fx", r.examples_per_s / torch_rate[l.total()]);
      if (m != mode::torch) {
        std::snprintf(calls_text, sizeof(calls_text), "%lld", static_cast<long long>(r.calls));
        std::snprintf(coll, sizeof(coll), "%.2f", r.collective_ms_per_step);
        std::snprintf(share, sizeof(share), "%.0f%%",
                      100.0 * r.collective_ms_per_step / std::max(r.ms_per_step, 1e-9));
      }
      std::printf("  %-18s %-11s %9s %12.0f %8s %9s %10.2f %12s %10s\n", l.name().c_str(),
                  name_of(m), calls_text, r.examples_per_s, vs1, vst, r.ms_per_step, coll, share);
    }
    std::fflush(stdout);
  }

  // Fused and overlapped buckets against one all-reduce per tensor, where replicas communicate.
  bool all_faster = true;
  bool compared = false;
  std::printf("#\n# Buckets: per-tensor step time / bucketed step time (> 1: buckets faster)\n");
  for (const auto& l : layouts) {
    if (l.total() == 1)
      continue;
    auto find = [&](mode m) -> const row* {
      for (const auto& r : rows)
        if (r.where.name() == l.name() && r.how == m)
          return &r;
      return nullptr;
    };
    const row* per_tensor = find(mode::per_tensor);
    if (!per_tensor)
      continue;
    for (auto m : {mode::overlap, mode::fused}) {
      const row* bucketed = find(m);
      if (!bucketed)
        continue;
      double ratio = per_tensor->ms_per_step / std::max(bucketed->ms_per_step, 1e-9);
      compared = true;
      all_faster = all_faster && ratio > 1.0;
      std::printf("#   %-18s %-8s %.2fx %s\n", l.name().c_str(), name_of(m), ratio,
                  ratio > 1.0 ? "faster" : "NOT faster");
    }
  }
  if (compared)
    std::printf("# Buckets faster than per-tensor on every layout with several replicas: %s\n",
                all_faster ? "yes" : "NO");

  // Time to a fixed loss: what a user compares.
  std::vector<bench::json_object> target_items;
  if (target > 0) {
    std::printf("#\n# Time to loss %g (at most %lld steps; the first mode, and torch DDP)\n",
                target, static_cast<long long>(target_steps));
    std::printf("# %-18s %-11s %8s %10s %10s\n", "layout", "gradients", "steps", "seconds",
                "vs torch");
    for (const auto& l : layouts) {
      std::map<mode, sample> got;
      std::vector<mode> here{modes.front()};
      if (!s.python.empty() && (l.total() == 1 || l.workers > 1))
        here.push_back(mode::torch);
      for (auto m : here) {
        auto o = train_options_of(s, l, m, target_steps, target);
        got[m] = m == mode::torch ? torch_run(l.total(), o, s)
                 : l.workers == 1 ? in_process(l, o)
                                  : multi_process(l, o, s);
      }
      for (auto m : here) {
        const sample& r = got[m];
        char seconds[32] = "not reached", vs[32] = "-";
        if (r.reached)
          std::snprintf(seconds, sizeof(seconds), "%.2f", r.time_to_target_s);
        if (m != mode::torch && got.count(mode::torch) && r.reached && got[mode::torch].reached)
          std::snprintf(vs, sizeof(vs), "%.2fx",
                        got[mode::torch].time_to_target_s / std::max(r.time_to_target_s, 1e-9));
        std::printf("  %-18s %-11s %8lld %10s %10s\n", l.name().c_str(), name_of(m),
                    static_cast<long long>(r.steps), seconds, vs);
        bench::json_object o;
        o.str("layout", l.name()).str("gradients", name_of(m)).num("steps", r.steps);
        o.boolean("reached", r.reached).num("seconds", r.reached ? r.time_to_target_s : 0);
        target_items.push_back(o);
      }
      std::fflush(stdout);
    }
    std::printf("# vs torch (time): torch's seconds over consort's (> 1: consort reaches the loss "
                "sooner)\n");
  }

  auto path = opts.str("json");
  if (!path.empty()) {
    bench::json_object config;
    config.num("steps", s.steps)
        .num("repeats", repeats)
        .num("bucket_bytes", static_cast<int64_t>(s.bucket_bytes));
    config.num("hidden", s.hidden)
        .num("layers", s.layers)
        .num("batch_per_replica", s.batch_per_replica);
    config.num("global_batch", s.global_batch).num("lr", s.lr).num("target_loss", target);
    bench::json_object machine;
    machine.num("nproc", static_cast<int64_t>(bench::nproc())).str("cpu", bench::cpu_model());
    std::vector<bench::json_object> items;
    for (const auto& r : rows) {
      bench::json_object o;
      o.str("layout", r.where.name()).num("workers", r.where.workers);
      o.num("replicas_per_worker", r.where.replicas).str("gradients", name_of(r.how));
      o.num("allreduces_per_step", r.calls).num("examples_per_s", r.examples_per_s);
      o.num("ms_per_step", r.ms_per_step).num("collective_ms_per_step", r.collective_ms_per_step);
      items.push_back(o);
    }
    bench::json_object doc;
    doc.str("benchmark", "train_bench").obj("config", config).obj("machine", machine);
    doc.arr("results", items).arr("time_to_loss", target_items);
    doc.boolean("buckets_faster_everywhere", all_faster);
    if (!bench::write_json(path, doc))
      return 1;
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_bench: %s\n", e.what());
    return 1;
  }
}
