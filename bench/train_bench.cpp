// train_bench: throughput of the training demo (examples/train) per layout, beside the time its
// replicas spend in the gradient all-reduces, with fused gradient buckets and with one all-reduce
// per tensor, all measured in the same run.
//
//   ./build/bench/train_bench                       # layouts 1,2,4 replicas and 2 workers x 1, x 2
//   ./build/bench/train_bench --layouts 1,4 --steps 500 --json train.json
//
// A layout is "R" (one process, R CPU replicas; "1" is one_device_strategy, the baseline) or
// "WxK" (W worker processes of K CPU replicas each, started with tools/consort-launch on this
// host, talking over loopback TCP). Each configuration runs --repeats times, interleaved, and the
// median is reported; the machine is shared and noisy, so read ratios, not absolute figures.

#include "common.hpp"

#include "trainer.hpp"

#include <consort/consort.hpp>

#include <unistd.h>

#include <array>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

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

/// One training run's figures (the chief's, for a multi-worker layout).
struct sample {
  double examples_per_s = 0;
  double elapsed_s = 0;
  double collective_s = 0; // summed over the worker's local replicas
  int64_t calls = 0;       // all-reduces per replica per step
};

train::train_options train_options_of(const bench::options& opts, size_t bucket_bytes) {
  train::train_options o;
  o.steps = opts.integer("steps");
  o.global_batch = opts.integer("global-batch");
  o.hidden = static_cast<int>(opts.integer("hidden"));
  o.examples = opts.integer("examples");
  o.bucket_bytes = bucket_bytes;
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
  auto r = train::train_on(*s, o, data_for(o.examples), off, 0);
  return {r.examples_per_s, r.elapsed_s, r.collective_s, r.collectives_per_step};
}

std::string self_path() {
  std::array<char, 4096> buf{};
  auto n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0)
    throw std::runtime_error("cannot find this program's path (/proc/self/exe)");
  return std::string(buf.data(), static_cast<size_t>(n));
}

/// Runs the layout as worker processes under the launcher; the chief prints one result line.
sample multi_process(const layout& l, const train::train_options& o, const std::string& launcher) {
  auto cmd = "bash '" + launcher + "' -n " + std::to_string(l.workers) + " --devices-per-worker " +
             std::to_string(l.replicas) + " --timeout 300 -- '" + self_path() +
             "' --child 1 --steps " + std::to_string(o.steps) + " --global-batch " +
             std::to_string(o.global_batch) + " --hidden " + std::to_string(o.hidden) +
             " --examples " + std::to_string(o.examples) + " --bucket-bytes " +
             std::to_string(o.bucket_bytes) + " 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(cmd.c_str(), "r"), ::pclose);
  if (!pipe)
    throw std::runtime_error("cannot start " + cmd);
  std::string output;
  std::array<char, 512> line{};
  sample s;
  bool found = false;
  while (std::fgets(line.data(), static_cast<int>(line.size()), pipe.get())) {
    output += line.data();
    const char* tag = std::strstr(line.data(), "train_bench-result ");
    long long calls = 0;
    if (tag && std::sscanf(tag, "train_bench-result %lf %lf %lf %lld", &s.examples_per_s,
                           &s.elapsed_s, &s.collective_s, &calls) == 4) {
      s.calls = calls;
      found = true;
    }
  }
  int status = ::pclose(pipe.release());
  if (!found || status != 0)
    throw std::runtime_error("the " + l.name() + " run failed (status " + std::to_string(status) +
                             "); its output:\n" + output);
  return s;
}

/// --child 1: one worker of a multi-worker layout (started by the launcher).
int child(const bench::options& opts) {
  multi_worker_options mw; // devices from CONSORT_DEVICES_PER_WORKER, cluster from TF_CONFIG
  multi_worker_mirrored_strategy s({}, mw);
  auto o = train_options_of(opts, static_cast<size_t>(opts.integer("bucket-bytes")));
  train::tracer off(false);
  auto r = train::train_on(s, o, data_for(o.examples), off, s.worker_rank());
  if (s.worker_rank() == 0)
    std::printf("train_bench-result %.6f %.6f %.6f %lld\n", r.examples_per_s, r.elapsed_s,
                r.collective_s, static_cast<long long>(r.collectives_per_step));
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct row {
  layout where;
  bool fused = true;
  int64_t calls = 0;
  double examples_per_s = 0;
  double ms_per_step = 0;
  double collective_ms_per_step = 0; // per replica
};

int run(int argc, char** argv) {
  bench::options opts("train_bench", "examples/s of the training demo per layout, fused gradient "
                                     "buckets vs one all-reduce per tensor");
  opts.add("layouts", "1,2,4,2x1,2x2",
           "comma-separated layouts: R replicas, or WxK workers x "
           "replicas (worker processes under tools/consort-launch)");
  opts.add("steps", "300", "training steps per run");
  opts.add("repeats", "3", "runs per configuration (interleaved); the median is reported");
  opts.add("global-batch", "64", "examples per step, over all replicas");
  opts.add("hidden", "32", "hidden units of the MLP");
  opts.add("examples", "4096", "examples in the synthetic dataset");
  opts.add("bucket-bytes", "65536", "the fused bucket size");
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
  const auto repeats = std::max<int64_t>(opts.integer("repeats"), 1);
  const auto steps = opts.integer("steps");
  if (steps < 1)
    throw std::invalid_argument("--steps must be at least 1");
  const auto bucket = static_cast<size_t>(opts.bytes("bucket-bytes"));

  std::printf("# consort train_bench: the training demo (MLP, hidden %lld, global batch %lld), "
              "%lld steps per run, median of %lld runs\n",
              static_cast<long long>(opts.integer("hidden")),
              static_cast<long long>(opts.integer("global-batch")), static_cast<long long>(steps),
              static_cast<long long>(repeats));
  std::printf("# machine: nproc=%u cpu=%s\n", bench::nproc(), bench::cpu_model().c_str());
  std::printf("# fused: gradients in buckets of %zu bytes; per-tensor: one all-reduce per "
              "gradient tensor (and one for the totals)\n",
              bucket);
  std::printf("# collective ms/step: time inside the all-reduces, per replica and step\n#\n");
  std::printf("# %-18s %-10s %9s %12s %12s %9s %13s %10s\n", "layout", "gradients", "allreduce",
              "examples/s", "vs 1 replica", "ms/step", "collective", "collective");
  std::printf("# %-18s %-10s %9s %12s %12s %9s %13s %10s\n", "", "", "per step", "", "(fused)", "",
              "ms/step", "share");

  std::vector<row> rows;
  double baseline = 0;
  for (const auto& l : layouts) {
    row fused_row{l, true}, split_row{l, false};
    std::vector<double> rate[2], step_ms[2], coll_ms[2];
    for (int64_t rep = 0; rep < repeats; ++rep) {
      for (int f = 0; f < 2; ++f) {
        auto o = train_options_of(opts, f == 0 ? bucket : 0);
        auto s = l.workers == 1 ? in_process(l, o) : multi_process(l, o, opts.str("launcher"));
        rate[f].push_back(s.examples_per_s);
        step_ms[f].push_back(1e3 * s.elapsed_s / static_cast<double>(steps));
        coll_ms[f].push_back(1e3 * s.collective_s / static_cast<double>(steps * l.replicas));
        (f == 0 ? fused_row : split_row).calls = s.calls;
      }
    }
    for (int f = 0; f < 2; ++f) {
      auto& r = f == 0 ? fused_row : split_row;
      r.examples_per_s = median(rate[f]);
      r.ms_per_step = median(step_ms[f]);
      r.collective_ms_per_step = median(coll_ms[f]);
    }
    if (baseline == 0 && l.total() == 1)
      baseline = fused_row.examples_per_s;
    for (const auto* r : {&fused_row, &split_row}) {
      char vs[32] = "-";
      if (baseline > 0)
        std::snprintf(vs, sizeof(vs), "%.2fx", r->examples_per_s / baseline);
      std::printf("  %-18s %-10s %9lld %12.0f %12s %9.3f %13.3f %9.0f%%\n", l.name().c_str(),
                  r->fused ? "fused" : "per-tensor", static_cast<long long>(r->calls),
                  r->examples_per_s, vs, r->ms_per_step, r->collective_ms_per_step,
                  100.0 * r->collective_ms_per_step / std::max(r->ms_per_step, 1e-9));
      std::fflush(stdout);
    }
    rows.push_back(fused_row);
    rows.push_back(split_row);
  }

  std::printf("#\n# Bucketing: per-tensor step time / fused step time (> 1: fused is faster)\n");
  bool all_faster = true;
  for (size_t i = 0; i + 1 < rows.size(); i += 2) {
    double ratio = rows[i + 1].ms_per_step / std::max(rows[i].ms_per_step, 1e-9);
    double coll =
        rows[i + 1].collective_ms_per_step / std::max(rows[i].collective_ms_per_step, 1e-9);
    if (rows[i].where.total() == 1) {
      // One replica in sync communicates nothing: its all-reduces are local.
      std::printf("#   %-18s step %.2fx, collectives %.2fx: no communication (not counted)\n",
                  rows[i].where.name().c_str(), ratio, coll);
      continue;
    }
    bool faster = ratio > 1.0;
    all_faster = all_faster && faster;
    std::printf("#   %-18s step %.2fx, collectives %.2fx: %s\n", rows[i].where.name().c_str(),
                ratio, coll, faster ? "fused faster" : "NOT faster");
  }
  std::printf("# Fused buckets faster on every layout with several replicas: %s\n",
              all_faster ? "yes" : "NO");

  auto path = opts.str("json");
  if (!path.empty()) {
    bench::json_object config;
    config.num("steps", steps)
        .num("repeats", repeats)
        .num("bucket_bytes", static_cast<int64_t>(bucket));
    config.num("hidden", opts.integer("hidden")).num("global_batch", opts.integer("global-batch"));
    bench::json_object machine;
    machine.num("nproc", static_cast<int64_t>(bench::nproc())).str("cpu", bench::cpu_model());
    std::vector<bench::json_object> items;
    for (const auto& r : rows) {
      bench::json_object o;
      o.str("layout", r.where.name()).num("workers", r.where.workers);
      o.num("replicas_per_worker", r.where.replicas)
          .str("gradients", r.fused ? "fused" : "per-tensor");
      o.num("allreduces_per_step", r.calls).num("examples_per_s", r.examples_per_s);
      o.num("ms_per_step", r.ms_per_step).num("collective_ms_per_step", r.collective_ms_per_step);
      items.push_back(o);
    }
    bench::json_object doc;
    doc.str("benchmark", "train_bench").obj("config", config).obj("machine", machine);
    doc.arr("results", items).boolean("fused_faster_everywhere", all_faster);
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
