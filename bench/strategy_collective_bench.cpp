// strategy_collective_bench: all_reduce, all_gather and broadcast of float32 (or, with
// --dtype, float16 or bfloat16) between worker processes through the public API, the way a user
// calls them: one multi_worker_mirrored_strategy per worker (default options, one CPU replica
// unless the launcher says otherwise), and per iteration one `strategy.run` whose step calls
// `ctx.all_reduce("SUM", x)` (or `ctx.all_gather(x, 0)`, `ctx.broadcast(x, 0)`). Beside the raw
// algorithm (collective_tcp_bench) and torch.distributed's gloo (torch_gloo_bench.py),
// bench/user_path.sh runs all three in one run and prints their ratios (issue 12).
//
// Usage (the cluster comes from TF_CONFIG, which the launcher sets for each worker):
//   tools/consort-launch -n 2 -- ./build/bench/strategy_collective_bench [--min-bytes 4]
//       [--max-bytes 64M] [--factor 4] [--warmup 3] [--iters 20] [--large-bytes 16M]
//       [--large-iters 0] [--ops all_reduce,all_gather,broadcast] [--step-barriers 2]
//       [--dtype float32|float16|bfloat16] [--recorder on|off] [--json FILE]
//
// The flight recorder (docs/debugging.md) is on unless `--recorder off`. Rank 0 also times the
// recorder's own work per collective (an entry made, its arrivals marked, its end recorded, on
// one thread, 200 000 times) and prints it as a share of the smallest all_reduce's p50 of the
// same run; `--recorder off` against `--recorder on` in one sitting gives the end-to-end
// difference (bench/README.md, "The flight recorder's cost").
//
// Per iteration, on every worker: a barrier (a strategy.run whose step all-reduces one float),
// then the timed strategy.run, whose step all-reduces one float `--step-barriers` times (barriers
// inside the step) before the timed call. Two in-step barriers by default, so that the timed call
// starts as the raw algorithm's does (collective_tcp_bench: a barrier that itself follows a call
// made in step with the peers): the first absorbs the skew of the workers' step starts, which
// can outlast a waiter's spin, so that the worker that came first sleeps and wakes late; the
// second starts with both workers at the call. `--step-barriers 1` times the first call after
// that skew instead (bench/README.md, "The user path after two in-step barriers", has both).
// Two times are kept, rank 0's: the collective call, timed inside the
// step around `ctx.all_reduce` (the max over this worker's replicas), and the whole
// `strategy.run` from the call to the per_replica result in the caller's hands. The step returns
// its time and the collective's result; every element of every result is checked by the caller
// after both clocks stopped; the program exits 1 on any wrong element.
// Sizes are of the result: an all_gather row of S bytes gathers max(1, S/4/R) floats from each of
// the R replicas (as collective_tcp_bench); with a 16-bit --dtype a row of S bytes holds S/2
// elements, so rows of equal size move equal bytes. Only rank 0 prints.
//
// Expected output (the figures are made up; bench/README.md has measured ones):
//   [worker:0] # consort strategy_collective_bench  path=multi_worker_mirrored_strategy workers=2
//   ... [worker:0] # all_reduce [worker:0] #       size        count   type  redop       time algbw
//   busbw  #wrong ... [worker:0]            4            1  float    sum     290.12    0.00    0.00
//   0 ... [worker:0] # Out of bounds values : 0 OK

#include "common.hpp"

#include <consort/consort.hpp>

#include "actors/flight_recorder.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <execinfo.h>
#include <unistd.h>

// -- a counting allocator
// -------------------------------------------------------------------------- The `allocs` column:
// the heap allocations that the timed collective call makes on its caller's thread (a lone
// replica's call runs whole there, the exchange with the other workers included). Every operator
// new of the program comes here; the aligned forms keep the library's own. `--trace-allocs 1`
// prints where each allocation of the last timed call of each row comes from.

namespace {
thread_local uint64_t thread_allocations = 0;
/// Set around one timed call by `--trace-allocs 1`: each allocation of the call prints its
/// backtrace (raw addresses, for addr2line) to stderr.
thread_local bool trace_allocations = false;

void print_backtrace(std::size_t bytes) {
  trace_allocations = false; // backtrace() may allocate the first time
  void* frames[32];
  const int n = backtrace(frames, 32);
  char line[64];
  const int len = std::snprintf(line, sizeof(line), "# alloc %zu bytes:\n", bytes);
  (void)!write(2, line, static_cast<std::size_t>(len));
  backtrace_symbols_fd(frames, n, 2);
  trace_allocations = true;
}
} // namespace

void* operator new(std::size_t bytes) {
  ++thread_allocations;
  if (trace_allocations)
    print_backtrace(bytes);
  if (void* p = std::malloc(bytes > 0 ? bytes : 1))
    return p;
  throw std::bad_alloc();
}
// Over-aligned types (a tensor's storage, 64-byte aligned) come through here: counted too.
void* operator new(std::size_t bytes, std::align_val_t align) {
  ++thread_allocations;
  if (trace_allocations)
    print_backtrace(bytes);
  const auto a = static_cast<std::size_t>(align);
  if (void* p = std::aligned_alloc(a, (std::max<std::size_t>(bytes, 1) + a - 1) / a * a))
    return p;
  throw std::bad_alloc();
}
// g++ sees free() of what it takes for a new-expression's pointer; here operator new is malloc.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
#pragma GCC diagnostic pop

namespace {

using namespace consort;
using bench::micros;
using bench::summarize;
using std::chrono::steady_clock;

/// What one collective contributes: its input per replica, the call, and the check.
struct op_desc {
  std::string name;
  std::string redop;
  /// busbw = algbw x bus_factor(n) (nccl-tests).
  std::function<double(int n)> bus_factor;
  /// Elements of each replica's input for a row of `count` result elements and `n` replicas.
  std::function<int64_t(int64_t count, int n)> input_count;
  /// The input of replica `id`.
  std::function<tensor(int id, int64_t elements)> init;
  /// The collective call, made inside the step; exactly this is timed.
  std::function<tensor(replica_context& ctx, const tensor& x)> call;
  /// Wrong elements of `out` (every element when the dtype or element count is wrong).
  std::function<int64_t(const tensor& out, int n, int64_t elements)> check;
};

/// The element type of every tensor of the run (--dtype): float32, float16 or bfloat16.
dtype element_type = dtype::float32;

/// Calls `fn(T{})` for the C++ type of `element_type`.
template <class F>
auto with_element_type(F&& fn) {
  switch (element_type) {
  case dtype::float16:
    return fn(float16_t{});
  case dtype::bfloat16:
    return fn(bfloat16_t{});
  default:
    return fn(float{});
  }
}

/// The nccl-tests name of `element_type` for the `type` column.
const char* type_column() {
  return element_type == dtype::float16    ? "half"
         : element_type == dtype::bfloat16 ? "bfloat16"
                                           : "float";
}

/// Replica `id` holds `id + 1` in every element: sums are small integers, exact in every type.
tensor filled(int id, int64_t elements) {
  auto t = tensor::zeros(element_type, {elements});
  with_element_type([&](auto zero) {
    using T = decltype(zero);
    auto* p = t.mutable_data<T>();
    std::fill(p, p + elements, T(static_cast<float>(id + 1)));
  });
  return t;
}

template <class Want>
int64_t count_not(const tensor& out, int64_t expected_elements, Want want) {
  if (out.dtype() != element_type || out.num_elements() != expected_elements)
    return std::max<int64_t>(expected_elements, 1);
  return with_element_type([&](auto zero) {
    using T = decltype(zero);
    const auto* p = out.data<T>();
    int64_t bad = 0;
    for (int64_t i = 0; i < expected_elements; ++i)
      bad += static_cast<float>(p[i]) != want(i);
    return bad;
  });
}

std::vector<op_desc> all_ops() {
  std::vector<op_desc> ops;
  ops.push_back(
      op_desc{"all_reduce", "sum", [](int n) { return 2.0 * (n - 1) / n; },
              [](int64_t count, int) { return count; }, filled,
              [](replica_context& ctx, const tensor& x) { return ctx.all_reduce("SUM", x); },
              [](const tensor& out, int n, int64_t elements) {
                const auto sum = static_cast<float>(n * (n + 1) / 2);
                return count_not(out, elements, [sum](int64_t) { return sum; });
              }});
  ops.push_back(op_desc{"all_gather", "none", [](int n) { return double(n - 1) / n; },
                        [](int64_t count, int n) { return std::max<int64_t>(1, count / n); },
                        filled,
                        [](replica_context& ctx, const tensor& x) { return ctx.all_gather(x, 0); },
                        [](const tensor& out, int n, int64_t elements) {
                          // Replica r's block (elements long) holds r + 1.
                          return count_not(out, elements * n, [elements](int64_t i) {
                            return static_cast<float>(i / elements + 1);
                          });
                        }});
  ops.push_back(op_desc{"broadcast", "none", [](int) { return 1.0; },
                        [](int64_t count, int) { return count; }, filled,
                        [](replica_context& ctx, const tensor& x) { return ctx.broadcast(x, 0); },
                        [](const tensor& out, int, int64_t elements) {
                          return count_not(out, elements, [](int64_t) { return 1.0f; });
                        }});
  return ops;
}

/// One row of a table: rank 0's times.
struct row_result {
  std::string op;
  int64_t bytes = 0;
  int64_t count = 0;
  int64_t iters = 0;
  bench::stats call; // the collective call inside the step (max over local replicas)
  bench::stats run;  // the whole strategy.run
  double algbw = 0;
  double busbw = 0;
  int64_t wrong = 0; // over every replica of every worker
  /// The heap allocations of the timed call on its caller's thread (max over local replicas,
  /// mean over the iterations).
  double allocations = 0;
  std::vector<double> call_samples;
  std::vector<double> run_samples;
};

std::string json_numbers(const std::vector<double>& values) {
  std::ostringstream out;
  out.precision(6);
  out << '[';
  for (size_t i = 0; i < values.size(); ++i)
    out << (i ? "," : "") << values[i];
  out << ']';
  return out.str();
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in{text};
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty())
      out.push_back(item);
  return out;
}

/// The flight recorder's work per collective on one thread (what a lone replica's call adds:
/// an entry with its signature, started at the call's own clock reading, which the call makes
/// with the recorder off too, for its deadline; its entry time on the system clock; the arrivals
/// the exchange marks; its end), as a share of the smallest all_reduce's p50 measured in this run.
void print_recorder_cost(const std::vector<row_result>& rows, int workers) {
  const row_result* smallest = nullptr;
  for (const auto& r : rows)
    if (r.op == "all_reduce" && (smallest == nullptr || r.bytes < smallest->bytes))
      smallest = &r;
  if (smallest == nullptr)
    return;
  std::vector<std::string> names;
  for (int w = 0; w < workers; ++w)
    names.push_back("worker:" + std::to_string(w));
  detail::flight_recorder rec(2000, 0, names);
  detail::flight_signature sig;
  sig.type = element_type;
  sig.rank = 1;
  sig.dims[0] = 1;
  sig.leaves = 1;
  sig.bytes = 4;
  constexpr int calls = 200'000;
  const uint64_t everyone = (uint64_t{1} << std::min(workers, 63)) - 1;
  std::vector<double> per_call;
  int64_t entered_ns = 0;
  for (int round = 0; round < 5; ++round) {
    auto t0 = steady_clock::now();
    for (int i = 0; i < calls; ++i) {
      entered_ns += rec.unix_ns(t0);
      auto h = rec.collective(static_cast<uint64_t>(i), 0, 0, sig, detail::flight_state::waiting,
                              {}, t0);
      auto* arrived = rec.arrivals(h);
      arrived->store(arrived->load(std::memory_order_relaxed) | everyone,
                     std::memory_order_relaxed);
      rec.ended(h, errc::none);
    }
    auto t1 = steady_clock::now();
    per_call.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / calls);
  }
  std::sort(per_call.begin(), per_call.end());
  const double ns = per_call[per_call.size() / 2];
  if (entered_ns == 0) // keeps the entry times' arithmetic in the loop
    std::printf("# (the recorder's clock starts at the Unix epoch)\n");
  std::printf("# flight recorder: %.0f ns per collective (median of 5 x %d on one thread) = "
              "%.3f %% of the %lld B all_reduce's p50 (%.1f us), %.3f %% of its strategy.run's "
              "p50 (%.1f us) in this run\n",
              ns, calls, 100.0 * ns / (smallest->call.p50 * 1e3),
              static_cast<long long>(smallest->bytes), smallest->call.p50,
              100.0 * ns / (smallest->run.p50 * 1e3), smallest->run.p50);
}

int run(int argc, char** argv) {
  bench::options opts("strategy_collective_bench",
                      "all_reduce, all_gather and broadcast of float32 between worker processes "
                      "through multi_worker_mirrored_strategy\n(strategy.run + ctx.all_reduce / "
                      "all_gather / broadcast), the call timed inside the step; run it under "
                      "tools/consort-launch.");
  opts.add("min-bytes", "4", "smallest size in bytes (suffix K, M, G allowed)");
  opts.add("max-bytes", "64M", "largest size in bytes");
  opts.add("factor", "4", "size multiplier between rows");
  opts.add("warmup", "3", "untimed iterations per size");
  opts.add("iters", "20", "timed iterations per size");
  opts.add("large-bytes", "16M", "sizes from this one on run --large-iters iterations");
  opts.add("large-iters", "0", "timed iterations per size from --large-bytes on (0: --iters)");
  opts.add("ops", "all_reduce,all_gather,broadcast", "collectives to time, comma-separated");
  opts.add("step-barriers", "2",
           "all-reduces of one float inside the step before the timed call (at least 1)");
  opts.add("dtype", "float32", "element type: float32, float16 or bfloat16");
  opts.add("recorder", "on", "the flight recorder: on (2000 entries) or off");
  opts.add("trace-allocs", "0",
           "1: rank 0 prints a backtrace (addresses) per allocation of each row's last call");
  opts.add("json", "", "rank 0 also writes the results (with every sample) as JSON to this file");
  opts.parse(argc, argv);
  const auto min_bytes = opts.bytes("min-bytes");
  const auto max_bytes = opts.bytes("max-bytes");
  const auto factor = opts.integer("factor");
  const auto warmup = opts.integer("warmup");
  const auto iters = opts.integer("iters");
  const auto large_bytes = opts.bytes("large-bytes");
  const auto large_iters = opts.integer("large-iters") > 0 ? opts.integer("large-iters") : iters;
  const auto step_barriers = opts.integer("step-barriers");
  const bool trace_allocs = opts.integer("trace-allocs") != 0;
  if (min_bytes < 4 || max_bytes < min_bytes || factor < 2 || warmup < 0 || iters <= 0 ||
      step_barriers < 1)
    opts.fail("need 4 <= --min-bytes <= --max-bytes, --factor >= 2, --warmup >= 0, --iters > 0, "
              "--step-barriers >= 1");
  std::vector<op_desc> ops;
  for (const auto& name : split(opts.str("ops"))) {
    bool found = false;
    for (auto& d : all_ops())
      if (d.name == name) {
        ops.push_back(d);
        found = true;
      }
    if (!found)
      opts.fail("unknown collective '" + name + "' in --ops (all_reduce, all_gather, broadcast)");
  }
  if (ops.empty())
    opts.fail("--ops is empty");
  const auto type_name = opts.str("dtype");
  if (type_name == "float16")
    element_type = dtype::float16;
  else if (type_name == "bfloat16")
    element_type = dtype::bfloat16;
  else if (type_name != "float32")
    opts.fail("unknown --dtype '" + type_name + "' (float32, float16, bfloat16)");
  const auto width = static_cast<int64_t>(size_of(element_type));
  const auto recorder = opts.str("recorder");
  if (recorder != "on" && recorder != "off")
    opts.fail("unknown --recorder '" + recorder + "' (on, off)");
  strategy_options sopts;
  sopts.flight_recorder_entries = recorder == "on" ? 2000 : 0;

  multi_worker_mirrored_strategy mw(sopts);
  const int rank = mw.worker_rank();
  const int workers = mw.num_workers();
  const int n = mw.num_replicas_in_sync();
  const auto one = tensor::scalar<float>(1);
  auto barrier = [&mw, &one] {
    mw.run([&one](replica_context& ctx) { return ctx.all_reduce("SUM", one); });
  };
  barrier();

  if (rank == 0) {
    std::printf("# consort strategy_collective_bench  path=multi_worker_mirrored_strategy "
                "workers=%d replicas=%d devices=%zu/worker warmup=%lld iters=%lld "
                "large_bytes=%lld large_iters=%lld step_barriers=%lld dtype=%s recorder=%s\n",
                workers, n, mw.num_local_replicas(), static_cast<long long>(warmup),
                static_cast<long long>(iters), static_cast<long long>(large_bytes),
                static_cast<long long>(large_iters), static_cast<long long>(step_barriers),
                to_string(element_type), recorder.c_str());
    std::printf("# machine: nproc=%u cpu=%s\n", bench::nproc(), bench::cpu_model().c_str());
    std::printf("# step: ctx.all_reduce(\"SUM\", x) | ctx.all_gather(x, 0) | ctx.broadcast(x, 0) "
                "of %s x, inputs built once per size\n",
                to_string(element_type));
    std::printf("# time, p50, p99: the collective call timed inside the step on rank 0 after a "
                "%lld barrier(s) in the step (avg, percentiles);\n# run p50/p99: the whole "
                "strategy.run on rank 0. "
                "all_gather size = the result (max(1, count/%d) elements per replica). "
                "GB = 1e9 bytes\n#\n",
                static_cast<long long>(step_barriers), n);
    std::fflush(stdout);
  }

  std::vector<row_result> rows;
  int64_t total_wrong = 0;
  for (const auto& op : ops) {
    if (rank == 0) {
      std::printf("# %s\n#%12s %12s %6s %6s %10s %7s %7s %7s %10s %10s %10s %10s %7s\n",
                  op.name.c_str(), "size", "count", "type", "redop", "time", "algbw", "busbw",
                  "#wrong", "p50", "p99", "run p50", "run p99", "allocs");
      std::printf("#%12s %12s %6s %6s %10s %7s %7s %7s %10s %10s %10s %10s %7s\n", "(B)",
                  "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "(us)",
                  "(us)", "(/call)");
      std::fflush(stdout);
    }
    for (int64_t bytes = std::max(min_bytes, width); bytes <= max_bytes; bytes *= factor) {
      row_result r;
      r.op = op.name;
      r.bytes = bytes;
      r.count = bytes / width;
      r.iters = bytes >= large_bytes ? large_iters : iters;
      const auto elements = op.input_count(r.count, n);
      // Built once per size; tensors share their storage, so no iteration copies them.
      auto inputs = mw.distribute_values([&](int id) { return op.init(id, elements); });
      // Each replica times its call and returns [time in ns, the collective's result]; the
      // caller checks the results after its own clock stopped.
      bool trace = false;
      auto step = [&op, &one, step_barriers, &trace](replica_context& ctx, const tensor& x) {
        // Barriers inside the step, as the raw algorithm's bench has one right before its timed
        // call (after a call in step with the peers): the clock then starts with every worker at
        // the call, and the time is the collective's, not the skew of the workers' step starts
        // (which `run p50` includes).
        for (int64_t b = 0; b < step_barriers; ++b)
          (void)ctx.all_reduce("SUM", one);
        const auto allocations = thread_allocations;
        trace_allocations = trace;
        auto t0 = steady_clock::now();
        auto out = op.call(ctx, x);
        auto t1 = steady_clock::now();
        trace_allocations = false;
        const auto made = thread_allocations - allocations;
        return nest::list(
            {tensor::scalar<double>(std::chrono::duration<double, std::nano>(t1 - t0).count()),
             std::move(out), tensor::scalar<double>(static_cast<double>(made))});
      };
      double wrong = 0;
      for (int64_t it = 0; it < warmup + r.iters; ++it) {
        trace = trace_allocs && rank == 0 && it + 1 == warmup + r.iters;
        barrier();
        auto t0 = steady_clock::now();
        auto values = mw.run(step, inputs);
        auto t1 = steady_clock::now();
        double call_us = 0;
        double allocations = 0;
        for (const auto& v : values) {
          call_us = std::max(call_us, v[0].as_tensor().item<double>() / 1e3);
          wrong += static_cast<double>(op.check(v[1].as_tensor(), n, elements));
          allocations = std::max(allocations, v[2].as_tensor().item<double>());
        }
        if (it >= warmup) {
          r.call_samples.push_back(call_us);
          r.run_samples.push_back(micros(t0, t1));
          r.allocations += allocations / static_cast<double>(r.iters);
        }
      }
      // Every worker's wrong count, summed across workers (a plain value is one per worker).
      r.wrong = static_cast<int64_t>(
          mw.reduce("SUM", tensor::scalar<double>(wrong), std::nullopt).item<double>());
      total_wrong += r.wrong;
      r.call = summarize(r.call_samples);
      r.run = summarize(r.run_samples);
      r.algbw = r.call.avg > 0 ? static_cast<double>(bytes) / (r.call.avg * 1e3) : 0;
      r.busbw = r.algbw * op.bus_factor(n);
      if (rank == 0) {
        std::printf(
            " %12lld %12lld %6s %6s %10.2f %7.2f %7.2f %7lld %10.1f %10.1f %10.1f %10.1f %7.1f\n",
            static_cast<long long>(bytes), static_cast<long long>(r.count), type_column(),
            op.redop.c_str(), r.call.avg, r.algbw, r.busbw, static_cast<long long>(r.wrong),
            r.call.p50, r.call.p99, r.run.p50, r.run.p99, r.allocations);
        std::fflush(stdout);
      }
      rows.push_back(std::move(r));
    }
  }
  if (rank == 0)
    std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(total_wrong),
                total_wrong == 0 ? "OK" : "FAILED");
  if (rank == 0)
    print_recorder_cost(rows, workers);

  auto path = opts.str("json");
  if (rank == 0 && !path.empty()) {
    bench::json_object config;
    config.str("path", "multi_worker_mirrored_strategy").num("workers", workers);
    config.num("replicas", n).num("min_bytes", min_bytes).num("max_bytes", max_bytes);
    config.num("factor", factor).num("warmup", warmup).num("iters", iters);
    config.num("step_barriers", step_barriers).str("dtype", to_string(element_type));
    config.num("large_bytes", large_bytes).num("large_iters", large_iters);
    bench::json_object machine;
    machine.num("nproc", static_cast<int64_t>(bench::nproc())).str("cpu", bench::cpu_model());
    std::vector<bench::json_object> items;
    for (const auto& r : rows) {
      bench::json_object o;
      o.str("op", r.op).num("size", r.bytes).num("count", r.count).num("iters", r.iters);
      o.str("type", type_column()).str("redop", r.op == "all_reduce" ? "sum" : "none");
      o.num("time_us", r.call.avg).num("algbw", r.algbw).num("busbw", r.busbw);
      o.num("wrong", r.wrong).num("p50_us", r.call.p50).num("p99_us", r.call.p99);
      o.num("run_p50_us", r.run.p50).num("run_p99_us", r.run.p99);
      o.num("allocs_per_call", r.allocations);
      o.raw("samples_us", json_numbers(r.call_samples));
      o.raw("run_samples_us", json_numbers(r.run_samples));
      items.push_back(o);
    }
    bench::json_object doc;
    doc.str("benchmark", "strategy_collective_bench").obj("config", config);
    doc.obj("machine", machine).arr("results", items).num("out_of_bounds", total_wrong);
    if (!bench::write_json(path, doc))
      return 1;
  }
  barrier();
  return total_wrong == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strategy_collective_bench: %s\n", e.what());
    return 1;
  }
}
