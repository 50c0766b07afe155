#pragma once

// The generic driver of the in-process collective benchmarks (after nccl-tests'
// `struct testColl`): each collective supplies a `collective_desc`; the driver sweeps replica
// counts and sizes, times the collective call inside the step on every replica, checks the
// results and prints nccl-tests style tables.

#include "common.hpp"

#include <consort/consort.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace consort::bench {

/// What one collective contributes to the driver.
struct collective_desc {
  /// Program name, e.g. "all_reduce_bench".
  std::string program;
  /// Collective name for the header, e.g. "all_reduce".
  std::string name;
  /// The redop column, e.g. "sum" ("none" for data movement).
  std::string redop;
  /// busbw = algbw x bus_factor(n): 2(n-1)/n for all-reduce, (n-1)/n for all-gather.
  std::function<double(int n)> bus_factor;
  /// Elements of each replica's input for a row of `count` elements (count = size / 4).
  std::function<int64_t(int64_t count, int n)> input_count;
  /// The input of replica `replica_id` of `n`, with `elements` float32 elements.
  std::function<tensor(int replica_id, int n, int64_t elements)> init_data;
  /// The collective call itself, made inside the step; the driver times exactly this call.
  std::function<tensor(replica_context& ctx, const tensor& input)> run;
  /// Number of wrong elements in the result `out` seen by replica `replica_id` of `n`.
  std::function<int64_t(const tensor& out, int replica_id, int n, int64_t count)> check;
  /// Optional bandwidth target: the minimum algbw (GB/s) of the largest size for `n` replicas
  /// given the machine's single-thread memcpy bandwidth; empty when the issue sets none.
  std::function<double(int n, double memcpy_gbps)> target_algbw;
  /// The target as text, e.g. "algbw >= 0.8 x 2/(N+1) x memcpy bandwidth".
  std::string target_text;
  /// Size (bytes) at which the target is evaluated.
  int64_t target_bytes = int64_t{64} << 20;
  /// Also time the raw-thread baseline of an all-reduce (detail::raw_all_reduce_row) beside
  /// each row: what the same rendezvous costs without consort.
  bool raw_baseline = false;
  /// Optional latency target: the p50 (us) of the smallest size for `n` replicas; 0: none.
  std::function<double(int n)> target_small_p50_us;
};

namespace detail {

/// One row of a table.
struct row_result {
  int replicas = 0;
  int64_t bytes = 0;
  int64_t count = 0;
  double time_us = 0; // average of the per-iteration times
  double algbw = 0;
  double busbw = 0;
  int64_t wrong = 0;
  stats time;         // over iterations of (max over replicas)
  stats last_arrival; // over iterations of (min over replicas): the last arriver's wait
  stats raw;          // the raw-thread baseline, timed the same way (when asked for)
};

/// Where `n` raw threads meet for one all-reduce (SUM) of float32: the last to arrive adds
/// every input into the result and wakes the others, who spin for 20 us before they block, as
/// consort's futures do. The least that an in-process all-reduce between threads costs.
class raw_rendezvous {
public:
  explicit raw_rendezvous(int n) : n_(n), inputs_(static_cast<size_t>(n)) {}

  /// Thread `rank`'s part; `out` receives the sum of every thread's `in`.
  void all_reduce(int rank, const std::vector<float>& in, std::vector<float>& out) {
    std::unique_lock<std::mutex> lock{mu_};
    const auto gen = generation_.load(std::memory_order_relaxed);
    inputs_[static_cast<size_t>(rank)] = &in;
    if (++arrived_ == n_) {
      result_.assign(in.size(), 0.0f);
      for (const auto* v : inputs_)
        for (size_t i = 0; i < v->size(); ++i)
          result_[i] += (*v)[i];
      arrived_ = 0;
      generation_.store(gen + 1, std::memory_order_release);
      lock.unlock();
      cv_.notify_all();
    } else {
      lock.unlock();
      auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(20);
      while (generation_.load(std::memory_order_acquire) == gen &&
             std::chrono::steady_clock::now() < spin_end) {
      }
      lock.lock();
      cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != gen; });
      lock.unlock();
    }
    // Each thread takes its own copy, as each replica gets a tensor of its own. (The result is
    // stable until every thread has passed the next barrier.)
    out = result_;
  }

private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_;
  int arrived_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::vector<const std::vector<float>*> inputs_;
  std::vector<float> result_;
};

/// The raw-thread baseline of one row: `n` threads, each iteration a barrier and then one timed
/// raw_rendezvous::all_reduce of `count` floats; per iteration the max over threads, as the
/// strategy's rows.
inline stats raw_all_reduce_row(int n, int64_t count, int64_t warmup, int64_t iters) {
  raw_rendezvous meet{n};
  std::barrier<> start{n};
  std::vector<std::vector<double>> times(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < n; ++rank) {
    threads.emplace_back([&, rank] {
      std::vector<float> in(static_cast<size_t>(count), static_cast<float>(rank + 1));
      std::vector<float> out;
      auto& mine = times[static_cast<size_t>(rank)];
      for (int64_t it = 0; it < warmup + iters; ++it) {
        start.arrive_and_wait();
        auto t0 = std::chrono::steady_clock::now();
        meet.all_reduce(rank, in, out);
        auto t1 = std::chrono::steady_clock::now();
        if (it >= warmup)
          mine.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        start.arrive_and_wait(); // the result stays in place until every thread copied it
      }
    });
  }
  for (auto& t : threads)
    t.join();
  std::vector<double> slowest(static_cast<size_t>(iters), 0.0);
  for (const auto& mine : times)
    for (size_t i = 0; i < mine.size(); ++i)
      slowest[i] = std::max(slowest[i], mine[i]);
  return summarize(std::move(slowest));
}

/// Prints a time in `width` columns with two decimals while it fits.
inline void print_time(int width, double us, int decimals) {
  if (us >= 99999.5)
    decimals = 0;
  std::printf("%*.*f", width, decimals, us);
}

inline row_result run_row(const collective_desc& desc, strategy& strat, int n, int64_t bytes,
                          int64_t warmup, int64_t iters, bool check, bool barrier) {
  row_result r;
  r.replicas = n;
  r.bytes = bytes;
  r.count = bytes / 4;
  const auto count = r.count;
  const auto elements = desc.input_count(count, n);
  auto inputs = strat.distribute_values([&](int id) { return desc.init_data(id, n, elements); });
  // Each replica times its own collective call and checks its own result after the clock
  // stopped; it returns {time in ns, wrong elements}. With `barrier`, an untimed all-reduce of
  // a scalar first lines the replicas up, so that the time is the call's and not the skew of
  // the step's start on each replica (step_overhead_bench measures that).
  auto step = [&desc, n, count, check, barrier](replica_context& ctx, const tensor& input) {
    if (barrier)
      (void)ctx.all_reduce("SUM", tensor::scalar<float>(1.0f));
    auto t0 = std::chrono::steady_clock::now();
    auto out = desc.run(ctx, input);
    auto t1 = std::chrono::steady_clock::now();
    double wrong =
        check ? static_cast<double>(desc.check(out, ctx.replica_id_in_sync_group(), n, count))
              : 0.0;
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
    return tensor::from(std::vector<double>{ns, wrong});
  };
  std::vector<double> times;
  std::vector<double> last;
  times.reserve(static_cast<size_t>(iters));
  last.reserve(static_cast<size_t>(iters));
  for (int64_t it = 0; it < warmup + iters; ++it) {
    auto values = strat.run(step, inputs);
    double slowest = 0;
    double fastest = 1e300;
    for (const auto& v : values) {
      auto data = v.data<double>();
      slowest = std::max(slowest, data[0] / 1e3);
      fastest = std::min(fastest, data[0] / 1e3);
      if (it >= warmup)
        r.wrong += static_cast<int64_t>(data[1]);
    }
    if (it >= warmup) {
      times.push_back(slowest);
      last.push_back(fastest);
    }
  }
  r.time = summarize(std::move(times));
  r.last_arrival = summarize(std::move(last));
  if (desc.raw_baseline)
    r.raw = raw_all_reduce_row(n, count, warmup, iters);
  r.time_us = r.time.avg;
  // GB/s with GB = 1e9 bytes and time in us: bytes / (us * 1e3).
  r.algbw = r.time_us > 0 ? static_cast<double>(bytes) / (r.time_us * 1e3) : 0;
  r.busbw = r.algbw * desc.bus_factor(n);
  return r;
}

} // namespace detail

/// Runs the benchmark of `desc` with the command line of `argc`/`argv`; returns the exit status
/// (1 when a result was wrong).
inline int run_collective_bench(const collective_desc& desc, int argc, char** argv) {
  options opts{desc.program, "Times " + desc.name +
                                 " of float32 tensors between CPU replicas of one process "
                                 "(mirrored_strategy),\ninside the step, through the public "
                                 "replica_context API; prints an nccl-tests style table."};
  opts.add("replicas", "2,4,8", "replica counts, comma-separated");
  opts.add("min-bytes", "4", "smallest size in bytes (suffix K, M, G allowed)");
  opts.add("max-bytes", "64M", "largest size in bytes (suffix K, M, G allowed)");
  opts.add("factor", "4", "size multiplier between rows (2 or 4, say)");
  opts.add("warmup", "5", "untimed iterations per size");
  opts.add("iters", "50", "timed iterations per size");
  opts.add("check", "1", "1: count wrong result elements on every replica, 0: skip the check");
  opts.add("barrier", "1",
           "1: line the replicas up with an untimed all-reduce before the timed call, 0: not");
  opts.add("json", "", "also write the results as JSON to this file");
  opts.parse(argc, argv);
  auto replicas = opts.int_list("replicas");
  auto min_bytes = opts.bytes("min-bytes");
  auto max_bytes = opts.bytes("max-bytes");
  auto factor = opts.integer("factor");
  auto warmup = opts.integer("warmup");
  auto iters = opts.integer("iters");
  auto check = opts.integer("check") != 0;
  auto barrier = opts.integer("barrier") != 0;
  if (min_bytes < 4 || max_bytes < min_bytes || factor < 2 || warmup < 0 || iters <= 0)
    opts.fail("need 4 <= --min-bytes <= --max-bytes, --factor >= 2, --warmup >= 0, --iters > 0");

  std::vector<int64_t> sizes;
  for (auto b = min_bytes; b <= max_bytes; b *= factor)
    sizes.push_back(b / 4 * 4);

  constexpr size_t memcpy_bytes = size_t{64} << 20;
  constexpr int memcpy_repeats = 10;
  auto memcpy_gbps = memcpy_bandwidth(memcpy_bytes, memcpy_repeats);

  std::printf("# consort %s  backend=inproc replicas=%s minbytes=%lld maxbytes=%lld factor=%lld "
              "warmup=%lld iters=%lld check=%d\n",
              desc.program.c_str(), opts.str("replicas").c_str(), static_cast<long long>(min_bytes),
              static_cast<long long>(max_bytes), static_cast<long long>(factor),
              static_cast<long long>(warmup), static_cast<long long>(iters), check ? 1 : 0);
  std::printf("# machine: nproc=%u cpu=%s\n", nproc(), cpu_model().c_str());
  std::printf("# memcpy bandwidth (64 MiB, 1 thread, best of %d): %.2f GB/s\n", memcpy_repeats,
              memcpy_gbps);
  std::printf("# time: the %s call timed inside the step on each replica%s; per iteration the "
              "max over replicas;\n#       'time' is the average over iterations, p50/p99 their "
              "percentiles. GB = 1e9 bytes.\n",
              desc.name.c_str(), barrier ? ", after an untimed all-reduce that lines them up" : "");
  if (desc.raw_baseline)
    std::printf("# raw: the same call between raw threads (a mutex, the last to arrive adds, the "
                "others spin 20 us and block),\n#      after a std::barrier, timed the same way; "
                "p50/raw compares the p50s of this run\n");
  if (desc.target_algbw)
    std::printf("# target at %lld MiB: %s\n", static_cast<long long>(desc.target_bytes >> 20),
                desc.target_text.c_str());
  std::fflush(stdout);

  struct block_summary {
    int replicas = 0;
    int64_t wrong = 0;
    double avg_busbw = 0;
    bool target_evaluated = false;
    double target_gbps = 0;
    double algbw = 0;
    bool met = false;
    bool small_evaluated = false;
    double small_p50 = 0;
    double small_limit = 0;
    bool small_met = false;
  };
  std::vector<detail::row_result> rows;
  std::vector<block_summary> blocks;
  for (int n : replicas) {
    strategy_options sopts;
    mirrored_strategy strat{cpu_devices(n), sopts};
    std::printf("#\n# replicas=%d  mirrored_strategy devices=CPU:0..CPU:%d\n", n, n - 1);
    std::printf("#       size        count   type  redop      time   algbw   busbw  #wrong"
                "       p50       p99%s\n",
                desc.raw_baseline ? "   raw p50  p50/raw" : "");
    std::printf("#        (B)   (elements)                    (us)  (GB/s)  (GB/s)        "
                "      (us)      (us)%s\n",
                desc.raw_baseline ? "      (us)         " : "");
    std::fflush(stdout);
    block_summary b;
    b.replicas = n;
    double busbw_sum = 0;
    for (auto bytes : sizes) {
      auto r = detail::run_row(desc, strat, n, bytes, warmup, iters, check, barrier);
      std::printf("%12lld %12lld %6s %6s ", static_cast<long long>(r.bytes),
                  static_cast<long long>(r.count), "float", desc.redop.c_str());
      detail::print_time(9, r.time_us, 2);
      std::printf(" %7.2f %7.2f %7lld ", r.algbw, r.busbw, static_cast<long long>(r.wrong));
      detail::print_time(9, r.time.p50, 1);
      std::printf(" ");
      detail::print_time(9, r.time.p99, 1);
      if (desc.raw_baseline) {
        std::printf(" ");
        detail::print_time(9, r.raw.p50, 1);
        std::printf(" %8.2f", r.raw.p50 > 0 ? r.time.p50 / r.raw.p50 : 0.0);
      }
      std::printf("\n");
      if (desc.target_small_p50_us && bytes == sizes.front()) {
        auto limit = desc.target_small_p50_us(n);
        if (limit > 0) {
          b.small_evaluated = true;
          b.small_p50 = r.time.p50;
          b.small_limit = limit;
          b.small_met = r.time.p50 <= limit;
          std::printf("# target (replicas=%d): %lld B p50 %.1f us %s %.0f us: %s\n", n,
                      static_cast<long long>(bytes), r.time.p50, b.small_met ? "<=" : ">", limit,
                      b.small_met ? "met" : "NOT MET");
        }
      }
      b.wrong += r.wrong;
      busbw_sum += r.busbw;
      if (desc.target_algbw && bytes == desc.target_bytes) {
        b.target_evaluated = true;
        b.target_gbps = desc.target_algbw(n, memcpy_gbps);
        b.algbw = r.algbw;
        b.met = r.algbw >= b.target_gbps;
        std::printf("# target (replicas=%d): algbw %.2f GB/s %s %.2f GB/s = %s: %s\n", n, r.algbw,
                    b.met ? ">=" : "<", b.target_gbps, desc.target_text.c_str(),
                    b.met ? "met" : "NOT MET");
      }
      std::fflush(stdout);
      rows.push_back(r);
    }
    b.avg_busbw = sizes.empty() ? 0 : busbw_sum / static_cast<double>(sizes.size());
    if (check)
      std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(b.wrong),
                  b.wrong == 0 ? "OK" : "FAILED");
    else
      std::printf("# Out of bounds values : not checked (--check 0)\n");
    std::printf("# Avg bus bandwidth    : %g\n", b.avg_busbw);
    blocks.push_back(b);
  }

  int64_t total_wrong = 0;
  bool all_met = true;
  bool any_target = false;
  std::printf("#\n# Summary\n");
  for (const auto& b : blocks) {
    total_wrong += b.wrong;
    std::printf("#   replicas=%d: out of bounds %lld, avg busbw %.2f GB/s", b.replicas,
                static_cast<long long>(b.wrong), b.avg_busbw);
    if (b.target_evaluated) {
      any_target = true;
      all_met = all_met && b.met;
      std::printf(", %lld MiB algbw %.2f GB/s vs target %.2f GB/s: %s",
                  static_cast<long long>(desc.target_bytes >> 20), b.algbw, b.target_gbps,
                  b.met ? "met" : "NOT MET");
    }
    if (b.small_evaluated)
      std::printf(", %lld B p50 %.1f us vs target %.0f us: %s",
                  static_cast<long long>(sizes.front()), b.small_p50, b.small_limit,
                  b.small_met ? "met" : "NOT MET");
    std::printf("\n");
  }
  if (check)
    std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(total_wrong),
                total_wrong == 0 ? "OK" : "FAILED");
  else
    std::printf("# Out of bounds values : not checked (--check 0)\n");
  if (desc.target_algbw) {
    if (any_target)
      std::printf("# Target (%s) met for every replica count: %s\n", desc.target_text.c_str(),
                  all_met ? "yes" : "NO");
    else
      std::printf("# Target not evaluated: it needs a %lld MiB row (--max-bytes %lldM)\n",
                  static_cast<long long>(desc.target_bytes >> 20),
                  static_cast<long long>(desc.target_bytes >> 20));
  }

  auto path = opts.str("json");
  if (!path.empty()) {
    json_object config;
    config.str("backend", "inproc").str("replicas", opts.str("replicas"));
    config.num("min_bytes", min_bytes).num("max_bytes", max_bytes).num("factor", factor);
    config.num("warmup", warmup).num("iters", iters).num("check", check ? 1 : 0);
    config.num("barrier", barrier ? 1 : 0);
    json_object machine;
    machine.num("nproc", static_cast<int64_t>(nproc())).str("cpu", cpu_model());
    machine.num("memcpy_gbps", memcpy_gbps);
    std::vector<json_object> items;
    for (const auto& r : rows) {
      json_object o;
      o.num("replicas", r.replicas).num("size", r.bytes).num("count", r.count);
      o.str("type", "float").str("redop", desc.redop);
      o.num("time_us", r.time_us).num("algbw", r.algbw).num("busbw", r.busbw);
      o.num("wrong", r.wrong).num("p50_us", r.time.p50).num("p99_us", r.time.p99);
      o.num("min_us", r.time.min).num("max_us", r.time.max);
      o.num("last_arrival_p50_us", r.last_arrival.p50);
      if (desc.raw_baseline)
        o.num("raw_p50_us", r.raw.p50);
      items.push_back(o);
    }
    std::vector<json_object> summary;
    for (const auto& b : blocks) {
      json_object o;
      o.num("replicas", b.replicas).num("out_of_bounds", b.wrong).num("avg_busbw", b.avg_busbw);
      if (b.target_evaluated) {
        o.num("target_bytes", desc.target_bytes).num("algbw", b.algbw);
        o.num("target_algbw", b.target_gbps).boolean("target_met", b.met);
      }
      summary.push_back(o);
    }
    json_object doc;
    doc.str("benchmark", desc.program).str("collective", desc.name);
    doc.obj("config", config).obj("machine", machine);
    if (desc.target_algbw)
      doc.str("target", desc.target_text);
    doc.arr("results", items).arr("summary", summary);
    doc.num("out_of_bounds", total_wrong);
    if (any_target)
      doc.boolean("target_met", all_met);
    if (!write_json(path, doc))
      return 1;
  }
  return total_wrong == 0 ? 0 : 1;
}

} // namespace consort::bench
