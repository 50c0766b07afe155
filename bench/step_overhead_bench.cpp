// step_overhead_bench: the cost of one empty step, `strategy.run` plus `strategy.reduce`, on 1, 2,
// 4 and 8 CPU replicas, next to a raw baseline measured in the same run: the same fan-out and
// join done by N plain std::threads and a condition variable.
//
// Usage:
//   ./build/bench/step_overhead_bench [--replicas 1,2,4,8] [--warmup 200] [--iters 2000]
//                                     [--chunk 100] [--breakdown 0|1] [--json FILE]
//
// Output (its shape; bench/README.md has measured figures, X and R stand for them here):
//   # consort step_overhead_bench  warmup=200 iters=2000 chunk=100 replicas=1,2,4,8
//   ...
//   #  replicas   consort p50   consort p99  baseline p50  baseline p99   ratio p50
//   #                    (us)          (us)          (us)          (us)     (c / b)
//             1             X             X             X             X           R
//   ...
//   # Target: consort p50 <= 2x baseline p50 (the step-overhead target)
//   #   replicas=1: ratio R <= 2: met

#include "common.hpp"

#include <consort/consort.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

namespace {

using consort::bench::micros;
using clock_type = std::chrono::steady_clock;

/// The target: consort's p50 at most this many times the baseline's.
constexpr double target_ratio = 2.0;

/// The empty step both sides run: one float32 scalar per replica.
consort::tensor empty_step() {
  return consort::tensor::scalar<float>(0);
}

/// The raw baseline: N plain threads that a condition variable wakes for each step, the last one
/// to finish waking the caller, which then sums the N results.
///
/// Thread safety: `run_step` must be called from one thread at a time; `mtx_` guards `step_`,
/// `done_` and `stop_`; `results_[i]` is written by worker i before it increments `done_` under
/// `mtx_` and read by the caller after it has seen `done_ == n`.
class raw_fan_out {
public:
  /// Starts `n` workers; worker i runs `step(i)` for every step.
  raw_fan_out(int n, std::function<consort::tensor(size_t)> step)
      : step_fn_(std::move(step)), results_(static_cast<size_t>(n)) {
    for (int i = 0; i < n; ++i)
      threads_.emplace_back([this, i] { work(static_cast<size_t>(i)); });
  }

  ~raw_fan_out() {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_)
      t.join();
  }

  raw_fan_out(const raw_fan_out&) = delete;
  raw_fan_out& operator=(const raw_fan_out&) = delete;

  /// Publishes the next step, waits for every worker and sums their results.
  consort::tensor run_step() {
    {
      std::lock_guard<std::mutex> guard{mtx_};
      done_ = 0;
      ++step_;
    }
    work_cv_.notify_all();
    {
      std::unique_lock<std::mutex> guard{mtx_};
      done_cv_.wait(guard, [this] { return done_ == results_.size(); });
    }
    // The same kernel strategy.reduce uses, so that only the fan-out and join differ.
    return consort::reduce_components(consort::reduce_op::sum, results_, std::nullopt);
  }

private:
  void work(size_t index) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> guard{mtx_};
        work_cv_.wait(guard, [&] { return stop_ || step_ != seen; });
        if (stop_)
          return;
        seen = step_;
      }
      results_[index] = step_fn_(index);
      bool last = false;
      {
        std::lock_guard<std::mutex> guard{mtx_};
        last = ++done_ == results_.size();
      }
      if (last)
        done_cv_.notify_one();
    }
  }

  const std::function<consort::tensor(size_t)> step_fn_;
  std::mutex mtx_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  uint64_t step_ = 0;
  size_t done_ = 0;
  bool stop_ = false;
  std::vector<consort::tensor> results_;
  std::vector<std::thread> threads_;
};

/// One row of the table.
struct row {
  int replicas = 0;
  consort::bench::stats consort;
  consort::bench::stats baseline;
  double ratio_p50 = 0;
  bool met = false;
};

/// Times `count` iterations of `iteration` (which returns the summed step result) into `out`.
template <class F>
void time_iterations(int64_t count, std::vector<double>* out, F&& iteration) {
  for (int64_t i = 0; i < count; ++i) {
    auto t0 = clock_type::now();
    auto sum = iteration();
    auto t1 = clock_type::now();
    if (sum.template item<float>() != 0.0f) {
      std::fprintf(stderr, "wrong result: the sum of the empty steps is %s, expected 0\n",
                   sum.to_string().c_str());
      std::exit(1);
    }
    if (out)
      out->push_back(micros(t0, t1));
  }
}

row measure(int n, int64_t warmup, int64_t iters, int64_t chunk) {
  consort::mirrored_strategy strategy{consort::bench::cpu_devices(n)};
  raw_fan_out raw{n, [](size_t) {
                    return empty_step();
                  }};
  auto consort_iteration = [&] {
    auto values = strategy.run([](consort::replica_context&) { return empty_step(); });
    return strategy.reduce("SUM", values, std::nullopt);
  };
  auto raw_iteration = [&] {
    return raw.run_step();
  };
  time_iterations(warmup, nullptr, consort_iteration);
  time_iterations(warmup, nullptr, raw_iteration);
  std::vector<double> consort_us;
  std::vector<double> raw_us;
  consort_us.reserve(static_cast<size_t>(iters));
  raw_us.reserve(static_cast<size_t>(iters));
  // Chunks of the two sides alternate, and so does which side goes first, so that a burst of
  // noise on this shared machine does not land on one side only.
  bool consort_first = true;
  for (int64_t done = 0; done < iters; done += chunk) {
    auto count = std::min(chunk, iters - done);
    if (consort_first) {
      time_iterations(count, &consort_us, consort_iteration);
      time_iterations(count, &raw_us, raw_iteration);
    } else {
      time_iterations(count, &raw_us, raw_iteration);
      time_iterations(count, &consort_us, consort_iteration);
    }
    consort_first = !consort_first;
  }
  row r;
  r.replicas = n;
  r.consort = consort::bench::summarize(std::move(consort_us));
  r.baseline = consort::bench::summarize(std::move(raw_us));
  r.ratio_p50 = r.baseline.p50 > 0 ? r.consort.p50 / r.baseline.p50 : 0;
  r.met = r.ratio_p50 <= target_ratio;
  return r;
}

/// Where one iteration's time goes, p50 over iterations (us): from the call to the first step
/// starting (fan-out), from there to the last step ending (spread), and from there to the
/// reduced value (join).
struct breakdown {
  double fan_out = 0;
  double spread = 0;
  double join = 0;
};

/// Times `iteration` with the step start and end stamped by every replica into `starts`/`ends`.
template <class F>
breakdown time_phases(int64_t warmup, int64_t iters, std::vector<clock_type::time_point>& starts,
                      std::vector<clock_type::time_point>& ends, F&& iteration) {
  std::vector<double> fan_out;
  std::vector<double> spread;
  std::vector<double> join;
  for (int64_t i = 0; i < warmup + iters; ++i) {
    auto t0 = clock_type::now();
    iteration();
    auto t1 = clock_type::now();
    if (i < warmup)
      continue;
    auto first = *std::min_element(starts.begin(), starts.end());
    auto last = *std::max_element(ends.begin(), ends.end());
    fan_out.push_back(micros(t0, first));
    spread.push_back(micros(first, last));
    join.push_back(micros(last, t1));
  }
  return {consort::bench::summarize(std::move(fan_out)).p50,
          consort::bench::summarize(std::move(spread)).p50,
          consort::bench::summarize(std::move(join)).p50};
}

/// The same iterations as `measure`, with the empty step stamping its start and end (the stamps
/// are the only difference), to show which hand-off costs what.
std::pair<breakdown, breakdown> measure_phases(int n, int64_t warmup, int64_t iters) {
  std::vector<clock_type::time_point> starts(static_cast<size_t>(n));
  std::vector<clock_type::time_point> ends(static_cast<size_t>(n));
  auto stamped = [&](size_t i) {
    starts[i] = clock_type::now();
    auto t = empty_step();
    ends[i] = clock_type::now();
    return t;
  };
  consort::mirrored_strategy strategy{consort::bench::cpu_devices(n)};
  auto consort_phases = time_phases(warmup, iters, starts, ends, [&] {
    auto values = strategy.run([&](consort::replica_context& ctx) {
      return stamped(static_cast<size_t>(ctx.local_replica_index()));
    });
    return strategy.reduce("SUM", values, std::nullopt);
  });
  raw_fan_out raw{n, stamped};
  auto raw_phases = time_phases(warmup, iters, starts, ends, [&] { return raw.run_step(); });
  return {consort_phases, raw_phases};
}

consort::bench::json_object phases_json(const breakdown& b) {
  consort::bench::json_object o;
  o.num("fan_out_p50_us", b.fan_out).num("spread_p50_us", b.spread).num("join_p50_us", b.join);
  return o;
}

consort::bench::json_object stats_json(const consort::bench::stats& s) {
  consort::bench::json_object o;
  o.num("p50_us", s.p50).num("p99_us", s.p99).num("avg_us", s.avg);
  o.num("min_us", s.min).num("max_us", s.max);
  return o;
}

int run(int argc, char** argv) {
  consort::bench::options opts{
      "step_overhead_bench",
      "Times strategy.run of an empty step plus strategy.reduce(SUM) on N CPU replicas,\n"
      "next to a raw std::thread + condition-variable fan-out and join measured in the same run."};
  opts.add("replicas", "1,2,4,8", "replica counts, comma-separated");
  opts.add("warmup", "200", "untimed iterations per side before timing");
  opts.add("iters", "2000", "timed iterations per side");
  opts.add("chunk", "100", "iterations per alternating chunk of consort and baseline");
  opts.add("breakdown", "0",
           "1: afterwards, time where each side's iteration goes (fan-out, spread, join)");
  opts.add("json", "", "also write the results as JSON to this file");
  opts.parse(argc, argv);
  auto replicas = opts.int_list("replicas");
  auto warmup = opts.integer("warmup");
  auto iters = opts.integer("iters");
  auto chunk = opts.integer("chunk");
  if (warmup < 0 || iters <= 0 || chunk <= 0)
    opts.fail("--warmup must be >= 0, --iters and --chunk > 0");

  std::printf("# consort step_overhead_bench  warmup=%lld iters=%lld chunk=%lld replicas=%s\n",
              static_cast<long long>(warmup), static_cast<long long>(iters),
              static_cast<long long>(chunk), opts.str("replicas").c_str());
  std::printf("# machine: nproc=%u cpu=%s\n", consort::bench::nproc(),
              consort::bench::cpu_model().c_str());
  std::printf("# consort:  strategy.run(empty step) + strategy.reduce(\"SUM\", v, nullopt), "
              "mirrored_strategy on CPU:0..CPU:N-1\n");
  std::printf("# baseline: N std::threads woken by notify_all, last one notifies the caller, "
              "caller sums the N results\n");
  std::printf("# time per iteration, from the caller's call to the reduced value\n");
  std::printf("#\n");
  std::printf("#  replicas   consort p50   consort p99  baseline p50  baseline p99   ratio p50\n");
  std::printf("#                    (us)          (us)          (us)          (us)     (c / b)\n");
  std::fflush(stdout);

  std::vector<row> rows;
  for (int n : replicas) {
    auto r = measure(n, warmup, iters, chunk);
    std::printf("%11d  %12.2f  %12.2f  %12.2f  %12.2f  %10.2f\n", r.replicas, r.consort.p50,
                r.consort.p99, r.baseline.p50, r.baseline.p99, r.ratio_p50);
    std::fflush(stdout);
    rows.push_back(r);
  }

  bool all_met = true;
  std::printf("#\n# Target: consort p50 <= %.0fx baseline p50 (the issue's step-overhead target)\n",
              target_ratio);
  for (const auto& r : rows) {
    std::printf("#   replicas=%d: ratio %.2f %s %.0f: %s\n", r.replicas, r.ratio_p50,
                r.met ? "<=" : ">", target_ratio, r.met ? "met" : "NOT MET");
    all_met = all_met && r.met;
  }
  std::printf("# Target met on every row: %s\n", all_met ? "yes" : "NO");

  std::vector<std::pair<breakdown, breakdown>> phases;
  if (opts.integer("breakdown") != 0) {
    std::printf("#\n# Breakdown (--breakdown 1), p50 in us, the step stamping its start and end:\n"
                "#   fan-out = call -> first step starts, spread = first start -> last step ends,\n"
                "#   join = last step ends -> reduced value in the caller's hands\n");
    std::printf("#  replicas   consort: fan-out   spread     join   baseline: fan-out   spread     "
                "join\n");
    for (int n : replicas) {
      phases.push_back(measure_phases(n, warmup, iters));
      const auto& [c, b] = phases.back();
      std::printf("# %9d            %8.2f %8.2f %8.2f             %8.2f %8.2f %8.2f\n", n,
                  c.fan_out, c.spread, c.join, b.fan_out, b.spread, b.join);
      std::fflush(stdout);
    }
  }

  auto path = opts.str("json");
  if (!path.empty()) {
    consort::bench::json_object config;
    config.num("warmup", warmup).num("iters", iters).num("chunk", chunk);
    config.str("replicas", opts.str("replicas"));
    consort::bench::json_object machine;
    machine.num("nproc", static_cast<int64_t>(consort::bench::nproc()));
    machine.str("cpu", consort::bench::cpu_model());
    std::vector<consort::bench::json_object> items;
    for (const auto& r : rows) {
      consort::bench::json_object o;
      o.num("replicas", r.replicas);
      o.obj("consort", stats_json(r.consort));
      o.obj("baseline", stats_json(r.baseline));
      o.num("ratio_p50", r.ratio_p50).boolean("target_met", r.met);
      if (items.size() < phases.size()) {
        o.obj("consort_breakdown", phases_json(phases[items.size()].first));
        o.obj("baseline_breakdown", phases_json(phases[items.size()].second));
      }
      items.push_back(o);
    }
    consort::bench::json_object doc;
    doc.str("benchmark", "step_overhead_bench").obj("config", config).obj("machine", machine);
    doc.str("target", "consort p50 <= 2x baseline p50").num("target_ratio", target_ratio);
    doc.arr("results", items).boolean("target_met", all_met);
    if (!consort::bench::write_json(path, doc))
      return 1;
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "step_overhead_bench: %s\n", e.what());
    return 1;
  }
}
