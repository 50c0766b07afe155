// all_reduce_bench: in-process all-reduce (SUM) of float32 tensors between CPU replicas, through
// the public API: one strategy.run per iteration whose step calls ctx.all_reduce("SUM", x), the
// call timed inside the step on every replica. nccl-tests style output.
//
// Usage:
//   ./build/bench/all_reduce_bench [--replicas 2,4,8] [--min-bytes 4] [--max-bytes 64M]
//                                  [--factor 4] [--warmup 5] [--iters 50] [--check 1]
//                                  [--json FILE]
//
// Output (its shape; bench/README.md has measured figures, X and Y stand for them here):
//   # consort all_reduce_bench  backend=inproc replicas=2,4,8 minbytes=4 maxbytes=67108864 ...
//   # memcpy bandwidth (64 MiB, 1 thread, best of 10): X GB/s
//   ...
//   # replicas=2  mirrored_strategy devices=CPU:0..CPU:1
//   #       size        count   type  redop      time   algbw   busbw  #wrong       p50 ...
//              4            1  float    sum         X       X       X       0         X ...
//   ...
//       67108864     16777216  float    sum         X       X       X       0         X ...
//   # target (replicas=2): algbw X GB/s >= Y GB/s = algbw >= 0.8 x 2/(N+1) x memcpy ...: met
//   # Out of bounds values : 0 OK
//   # Avg bus bandwidth    : X

#include "collective_bench.hpp"

#include <consort/consort.hpp>

#include <algorithm>
#include <vector>

namespace {

consort::bench::collective_desc all_reduce_desc() {
  consort::bench::collective_desc d;
  d.program = "all_reduce_bench";
  d.name = "all_reduce";
  d.redop = "sum";
  d.bus_factor = [](int n) {
    return 2.0 * (n - 1) / n;
  };
  d.input_count = [](int64_t count, int) {
    return count;
  };
  // Replica r holds r + 1 in every element, so every element of the sum is n(n+1)/2, exact in
  // float32 for any replica count this benchmark can run.
  d.init_data = [](int replica_id, int, int64_t elements) {
    auto t = consort::tensor::zeros(consort::dtype::float32, {elements});
    auto* p = t.mutable_data<float>();
    std::fill(p, p + elements, static_cast<float>(replica_id + 1));
    return t;
  };
  d.run = [](consort::replica_context& ctx, const consort::tensor& x) {
    return ctx.all_reduce("SUM", x);
  };
  d.check = [](const consort::tensor& out, int, int n, int64_t count) -> int64_t {
    const auto expected = static_cast<float>(n * (n + 1) / 2);
    if (out.dtype() != consort::dtype::float32 || out.num_elements() != count)
      return count;
    const auto* p = out.data<float>();
    return static_cast<int64_t>(count - std::count(p, p + count, expected));
  };
  // The target: the all-reduce of n inputs reads n buffers and writes one, so a single
  // memory-bound pass moves (n + 1) buffers where a memcpy moves 2; reaching 80% of that bound.
  d.target_algbw = [](int n, double memcpy_gbps) {
    return 0.8 * 2.0 / (n + 1) * memcpy_gbps;
  };
  d.target_text = "algbw >= 0.8 x 2/(N+1) x memcpy bandwidth";
  d.raw_baseline = true;
  // Issue 12: a 4 B all-reduce between 2 replicas of one process within 30 us (p50).
  d.target_small_p50_us = [](int n) {
    return n == 2 ? 30.0 : 0.0;
  };
  return d;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return consort::bench::run_collective_bench(all_reduce_desc(), argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "all_reduce_bench: %s\n", e.what());
    return 1;
  }
}
