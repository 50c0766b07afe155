// reduce_kernel_bench: memory bandwidth of the CUDA kernels behind GPU reductions
// (device/cuda/kernels.hpp): reduce_elementwise of 2 and 8 inputs, divide, reduce_axis and
// concat, for sizes from 1 KiB to 1 GiB (bounded by the GPU's free memory). Each row is timed
// with CUDA events around a batch of launches after a warm-up, and reports the bytes moved (read
// plus written), the achieved GB/s (1e9 bytes) and its share of the memory's peak bandwidth
// (cuda::properties). nccl-tests style output; --json FILE writes the same fields.
//
// Usage:
//   ./build/bench/reduce_kernel_bench [--min-bytes 1K] [--max-bytes 1G] [--factor 4]
//                                     [--warmup 5] [--iters 20] [--dtypes float32]
//                                     [--redop sum] [--check 1] [--json FILE]
//
// Expected output (shape; figures depend on the GPU):
//   # consort reduce_kernel_bench  device=GPU:0 "NVIDIA H100 80GB HBM3" sm_90 132 SMs ...
//   #                 op     type  inputs        size       moved  iters      time    GB/s  %peak
//   #wrong #                                             (B)         (B)              (us)
//     reduce_elementwise  float32       2        1024        3072   2000      2.50    1.23    0.0 0
//   ...
//   # Out of bounds values : 0 OK
//
// Without a GPU it prints "reduce_kernel_bench: no GPU (<reason>)" and exits 0.

#include "common.hpp"

#include "device/cuda/kernels.hpp"
#include "device/cuda/runtime.hpp"

#include <consort/error.hpp>
#include <consort/ops.hpp>
#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace cuda = consort::cuda;
using consort::dtype;
using consort::reduce_op;

namespace {

constexpr int device = 0;

/// A block of GPU memory from the caching allocator, released after its last use on `stream`.
/// Thread safety: a value.
class buffer {
public:
  buffer(size_t bytes, cudaStream_t stream)
      : bytes_(bytes), pointer_(cuda::allocate(device, bytes)), stream_(stream) {}
  ~buffer() { cuda::release(device, pointer_, bytes_, stream_); }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  unsigned char* get() const { return static_cast<unsigned char*>(pointer_); }

private:
  size_t bytes_;
  void* pointer_;
  cudaStream_t stream_;
};

/// One row of the table.
struct row_result {
  std::string op;
  dtype type = dtype::float32;
  int inputs = 0;
  int64_t size = 0;  // bytes of one input (of the whole input for reduce_axis)
  int64_t moved = 0; // bytes read plus bytes written by one launch
  int64_t iters = 0;
  double time_us = 0;
  double gbps = 0;
  double peak_percent = 0;
  int64_t wrong = 0;
};

/// A benchmark case: allocates and fills its buffers for `size` bytes, then runs one launch per
/// call of `run`; `check` counts the wrong output elements after a fresh launch.
struct bench_case {
  std::string op;
  int inputs = 0;
  int64_t moved = 0;
  std::function<void()> run;
  std::function<int64_t()> check;
  std::vector<std::unique_ptr<buffer>> buffers;
};

/// The bits of one element of `t` (a host tensor) at `i`.
std::vector<unsigned char> element_bits(const consort::tensor& t, int64_t i) {
  const size_t width = consort::size_of(t.dtype());
  const auto* p = static_cast<const unsigned char*>(t.raw_data()) + static_cast<size_t>(i) * width;
  return {p, p + width};
}

/// Counts the elements of `count` elements of `width` bytes at device address `p` whose bits are
/// not `expected` (one element's bits, or a whole row's bits repeated).
int64_t count_wrong(const void* p, int64_t count, const std::vector<unsigned char>& pattern,
                    cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(count) * pattern.size();
  std::vector<unsigned char> host(bytes);
  cuda::copy(host.data(), cuda::host, p, device, bytes, stream);
  int64_t wrong = 0;
  for (int64_t i = 0; i < count; ++i)
    wrong += std::memcmp(host.data() + static_cast<size_t>(i) * pattern.size(), pattern.data(),
                         pattern.size()) != 0;
  return wrong;
}

/// A one-element host tensor of dtype `type` holding `value`.
consort::tensor host_value(dtype type, double value) {
  auto t = consort::tensor::zeros(type, {1});
  switch (type) {
  case dtype::float32:
    *t.mutable_data<float>() = static_cast<float>(value);
    break;
  case dtype::float64:
    *t.mutable_data<double>() = value;
    break;
  case dtype::int32:
    *t.mutable_data<int32_t>() = static_cast<int32_t>(value);
    break;
  case dtype::int64:
    *t.mutable_data<int64_t>() = static_cast<int64_t>(value);
    break;
  case dtype::float16:
    *t.mutable_data<consort::float16_t>() = consort::float16_t(static_cast<float>(value));
    break;
  case dtype::bfloat16:
    *t.mutable_data<consort::bfloat16_t>() = consort::bfloat16_t(static_cast<float>(value));
    break;
  default:
    *t.mutable_data<uint8_t>() = static_cast<uint8_t>(value);
  }
  return t;
}

/// reduce_elementwise of `k` inputs of `size` bytes; input i holds i + 1 everywhere, so the host
/// kernel's reduction of one element of each gives every expected output element.
bench_case reduce_case(dtype type, reduce_op op, int k, int64_t size, cudaStream_t stream) {
  bench_case c;
  c.op = "reduce_elementwise";
  c.inputs = k;
  const auto out_type = consort::reduced_dtype(op, type);
  const int64_t n = size / static_cast<int64_t>(consort::size_of(type));
  c.moved = n * static_cast<int64_t>(k * consort::size_of(type) + consort::size_of(out_type));
  std::vector<const void*> pointers;
  std::vector<consort::tensor> column;
  for (int i = 0; i < k; ++i) {
    c.buffers.push_back(std::make_unique<buffer>(static_cast<size_t>(size), stream));
    cuda::fill(type, c.buffers.back()->get(), n, i + 1, stream);
    pointers.push_back(c.buffers.back()->get());
    column.push_back(host_value(type, i + 1));
  }
  c.buffers.push_back(
      std::make_unique<buffer>(static_cast<size_t>(n) * consort::size_of(out_type), stream));
  void* out = c.buffers.back()->get();
  c.run = [=] {
    cuda::reduce_elementwise(type, op, pointers.data(), k, out, n, k, stream);
  };
  const auto expected = element_bits(consort::reduce_elementwise(op, column), 0);
  c.check = [=] {
    cuda::reduce_elementwise(type, op, pointers.data(), k, out, n, k, stream);
    return count_wrong(out, n, expected, stream);
  };
  return c;
}

/// In-place division of a float buffer of `size` bytes (holding 3; checked as 3 / 2 = 1.5).
bench_case divide_case(dtype type, int64_t size, cudaStream_t stream) {
  bench_case c;
  c.op = "divide";
  c.inputs = 1;
  const int64_t n = size / static_cast<int64_t>(consort::size_of(type));
  c.moved = 2 * n * static_cast<int64_t>(consort::size_of(type));
  c.buffers.push_back(std::make_unique<buffer>(static_cast<size_t>(size), stream));
  void* data = c.buffers.back()->get();
  cuda::fill(type, data, n, 3, stream);
  c.run = [=] {
    cuda::divide(type, data, n, 2, stream);
  };
  const auto expected = element_bits(host_value(type, 1.5), 0);
  c.check = [=] {
    cuda::fill(type, data, n, 3, stream);
    cuda::divide(type, data, n, 2, stream);
    return count_wrong(data, n, expected, stream);
  };
  return c;
}

/// reduce_axis of a [1, 8, inner] view of `size` bytes along its middle axis (row i holds i + 1).
bench_case axis_case(dtype type, reduce_op op, int64_t size, cudaStream_t stream) {
  constexpr int k = 8;
  bench_case c;
  c.op = "reduce_axis";
  c.inputs = k;
  const auto out_type = consort::reduced_dtype(op, type);
  const int64_t inner = size / static_cast<int64_t>(consort::size_of(type)) / k;
  c.moved = inner * static_cast<int64_t>(k * consort::size_of(type) + consort::size_of(out_type));
  c.buffers.push_back(std::make_unique<buffer>(static_cast<size_t>(size), stream));
  auto* in = c.buffers.back()->get();
  auto column = consort::tensor::zeros(type, {k, 1});
  for (int i = 0; i < k; ++i) {
    cuda::fill(type, in + static_cast<size_t>(i * inner) * consort::size_of(type), inner, i + 1,
               stream);
    std::memcpy(static_cast<unsigned char*>(column.raw_mutable_data()) +
                    static_cast<size_t>(i) * consort::size_of(type),
                host_value(type, i + 1).raw_data(), consort::size_of(type));
  }
  c.buffers.push_back(
      std::make_unique<buffer>(static_cast<size_t>(inner) * consort::size_of(out_type), stream));
  void* out = c.buffers.back()->get();
  c.run = [=] {
    cuda::reduce_axis(type, op, in, out, 1, k, inner, k, stream);
  };
  const auto expected = element_bits(consort::reduce_axis(op, column, 0), 0);
  c.check = [=] {
    cuda::reduce_axis(type, op, in, out, 1, k, inner, k, stream);
    return count_wrong(out, inner, expected, stream);
  };
  return c;
}

/// concat of 4 inputs along axis 1 of [16, extent_i, 1] views (16 rows, so the kernel runs rather
/// than the copy engine), `size` bytes in all; input i holds i + 1.
bench_case concat_case(dtype type, int64_t size, cudaStream_t stream) {
  constexpr int k = 4;
  constexpr int64_t rows = 16;
  bench_case c;
  c.op = "concat";
  c.inputs = k;
  const size_t width = consort::size_of(type);
  const int64_t extent = std::max<int64_t>(size / static_cast<int64_t>(width) / rows / k, 1);
  c.moved = 2 * rows * extent * k * static_cast<int64_t>(width);
  std::vector<const void*> pointers;
  std::vector<size_t> row_bytes;
  std::vector<unsigned char> row_pattern;
  for (int i = 0; i < k; ++i) {
    const size_t bytes = static_cast<size_t>(rows * extent) * width;
    c.buffers.push_back(std::make_unique<buffer>(bytes, stream));
    cuda::fill(type, c.buffers.back()->get(), rows * extent, i + 1, stream);
    pointers.push_back(c.buffers.back()->get());
    row_bytes.push_back(static_cast<size_t>(extent) * width);
    const auto one = element_bits(host_value(type, i + 1), 0);
    for (int64_t e = 0; e < extent; ++e)
      row_pattern.insert(row_pattern.end(), one.begin(), one.end());
  }
  const auto out_bytes = static_cast<size_t>(c.moved / 2);
  c.buffers.push_back(std::make_unique<buffer>(out_bytes, stream));
  void* out = c.buffers.back()->get();
  c.run = [=] {
    cuda::concat(pointers.data(), row_bytes.data(), k, out, rows, stream);
  };
  c.check = [=] {
    cuda::check(cudaMemsetAsync(out, 0xAB, out_bytes, stream), "cudaMemsetAsync");
    cuda::concat(pointers.data(), row_bytes.data(), k, out, rows, stream);
    return count_wrong(out, rows, row_pattern, stream);
  };
  return c;
}

/// Device bytes a case of `size` bytes allocates (inputs and output), for the free-memory bound.
int64_t footprint(const std::string& op, int inputs, int64_t size) {
  if (op == "reduce_elementwise")
    return (inputs + 2) * size; // a float64 output of MEAN over int32 is twice an input
  if (op == "reduce_axis")
    return 2 * size;
  return 2 * size;
}

/// Times `c` over `iters` launches (after `warmup`) with one pair of events.
double time_us(bench_case& c, int64_t warmup, int64_t iters, const cuda::stream& s) {
  for (int64_t i = 0; i < warmup; ++i)
    c.run();
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  cuda::check(cudaEventCreate(&start), "cudaEventCreate", device);
  cuda::check(cudaEventCreate(&stop), "cudaEventCreate", device);
  cuda::check(cudaEventRecord(start, s.get()), "cudaEventRecord", device);
  for (int64_t i = 0; i < iters; ++i)
    c.run();
  cuda::check(cudaEventRecord(stop, s.get()), "cudaEventRecord", device);
  s.synchronize_for(std::chrono::minutes(5), "the timed launches of " + c.op);
  float ms = 0;
  cuda::check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime", device);
  cuda::check(cudaEventDestroy(start), "cudaEventDestroy", device);
  cuda::check(cudaEventDestroy(stop), "cudaEventDestroy", device);
  return static_cast<double>(ms) * 1e3 / static_cast<double>(iters);
}

int run(int argc, char** argv) {
  consort::bench::options opts{"reduce_kernel_bench",
                               "Memory bandwidth of the CUDA reduction kernels (GPU:0)."};
  opts.add("min-bytes", "1K", "smallest input size");
  opts.add("max-bytes", "1G",
           "largest input size (rows that do not fit in free memory are skipped)");
  opts.add("factor", "4", "size multiplier between rows");
  opts.add("warmup", "5", "untimed launches per row");
  opts.add("iters", "20", "timed launches per row, at least (small rows run up to 2000)");
  opts.add("dtypes", "float32",
           "comma-separated dtypes: float32,float64,int32,int64,uint8,float16,bfloat16");
  opts.add("redop", "sum", "reduce op of reduce_elementwise and reduce_axis");
  opts.add("check", "1", "check each row's output element by element (rows up to 256 MiB)");
  opts.add("json", "", "also write the results to this JSON file");
  opts.parse(argc, argv);

  if (cuda::device_count() == 0) {
    std::printf("reduce_kernel_bench: no GPU (%s)\n", cuda::unavailable_reason().c_str());
    return 0;
  }

  const auto min_bytes = opts.bytes("min-bytes");
  const auto max_bytes = opts.bytes("max-bytes");
  const auto factor = opts.integer("factor");
  const auto warmup = opts.integer("warmup");
  const auto iters = opts.integer("iters");
  const bool check = opts.integer("check") != 0;
  if (min_bytes < 64 || max_bytes < min_bytes || factor < 2 || warmup < 0 || iters <= 0)
    opts.fail("need 64 <= --min-bytes <= --max-bytes, --factor >= 2, --warmup >= 0, --iters > 0");
  const auto op = consort::parse_reduce_op(opts.str("redop"));
  std::vector<dtype> types;
  {
    std::string list = opts.str("dtypes");
    size_t begin = 0;
    while (begin <= list.size()) {
      auto end = list.find(',', begin);
      auto name = list.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
      bool known = false;
      for (auto t : {dtype::float32, dtype::float64, dtype::int32, dtype::int64, dtype::uint8,
                     dtype::float16, dtype::bfloat16})
        if (name == consort::to_string(t)) {
          types.push_back(t);
          known = true;
        }
      if (!known)
        opts.fail("--dtypes: unknown dtype '" + name + "'");
      if (end == std::string::npos)
        break;
      begin = end + 1;
    }
  }

  const auto props = cuda::properties(device);
  const double peak_gbps = props.peak_bandwidth / 1e9;
  cuda::stream s{device};

  std::printf("# consort reduce_kernel_bench  device=GPU:0 \"%s\" sm_%d%d %d SMs %.1f GiB  peak "
              "memory bandwidth %.1f GB/s (%d MHz x %d bits x 2)\n",
              props.name.c_str(), props.major, props.minor, props.sm_count,
              static_cast<double>(props.total_memory) / (1 << 30), peak_gbps,
              props.memory_clock_khz / 1000, props.memory_bus_bits);
  std::printf("# minbytes=%lld maxbytes=%lld factor=%lld warmup=%lld iters=%lld dtypes=%s redop=%s "
              "check=%d\n",
              static_cast<long long>(min_bytes), static_cast<long long>(max_bytes),
              static_cast<long long>(factor), static_cast<long long>(warmup),
              static_cast<long long>(iters), opts.str("dtypes").c_str(), consort::to_string(op),
              check ? 1 : 0);
  std::printf("# size: bytes of one input (of the whole input for reduce_axis, of the whole output "
              "for concat);\n#       moved: bytes read + written per launch; GB/s = moved / time "
              "(GB = 1e9 bytes);\n#       time: average per launch of a batch timed with CUDA "
              "events after the warm-up; %%peak: of the peak above.\n");
  std::printf("#%21s %8s %7s %12s %12s %6s %10s %8s %6s %7s\n", "op", "type", "inputs", "size",
              "moved", "iters", "time", "GB/s", "%peak", "#wrong");
  std::printf("#%21s %8s %7s %12s %12s %6s %10s %8s %6s %7s\n", "", "", "", "(B)", "(B)", "",
              "(us)", "", "", "");
  std::fflush(stdout);

  std::vector<row_result> rows;
  int64_t total_wrong = 0;
  struct spec {
    std::string op;
    int inputs;
  };
  const spec specs[] = {{"reduce_elementwise", 2},
                        {"reduce_elementwise", 8},
                        {"divide", 1},
                        {"reduce_axis", 8},
                        {"concat", 4}};
  for (auto type : types) {
    for (const auto& sp : specs) {
      if (sp.op == "divide" && !consort::is_floating(type))
        continue;
      for (int64_t size = min_bytes; size <= max_bytes; size *= factor) {
        size_t free_bytes = 0;
        size_t total_bytes = 0;
        cuda::check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo", device);
        if (footprint(sp.op, sp.inputs, size) > static_cast<int64_t>(free_bytes / 10 * 9)) {
          std::printf("# %s %s inputs=%d size=%lld skipped: needs %lld bytes, %zu free\n",
                      sp.op.c_str(), consort::to_string(type), sp.inputs,
                      static_cast<long long>(size),
                      static_cast<long long>(footprint(sp.op, sp.inputs, size)), free_bytes);
          break;
        }
        bench_case c = sp.op == "reduce_elementwise"
                           ? reduce_case(type, op, sp.inputs, size, s.get())
                       : sp.op == "divide"      ? divide_case(type, size, s.get())
                       : sp.op == "reduce_axis" ? axis_case(type, op, size, s.get())
                                                : concat_case(type, size, s.get());
        row_result r;
        r.op = c.op;
        r.type = type;
        r.inputs = c.inputs;
        r.size = size;
        r.moved = c.moved;
        // Small rows are launch-bound: run more of them so that the batch takes a while.
        r.iters = std::clamp<int64_t>((int64_t{256} << 20) / std::max<int64_t>(c.moved, 1), iters,
                                      std::max<int64_t>(iters, 2000));
        r.time_us = time_us(c, warmup, r.iters, s);
        r.gbps = static_cast<double>(r.moved) / (r.time_us * 1e-6) / 1e9;
        r.peak_percent = peak_gbps > 0 ? 100.0 * r.gbps / peak_gbps : 0;
        r.wrong = check && size <= (int64_t{256} << 20) ? c.check() : 0;
        s.synchronize_for(std::chrono::minutes(1), "the end of a row");
        total_wrong += r.wrong;
        std::printf(" %21s %8s %7d %12lld %12lld %6lld %10.2f %8.1f %6.1f %7lld\n", r.op.c_str(),
                    consort::to_string(type), r.inputs, static_cast<long long>(r.size),
                    static_cast<long long>(r.moved), static_cast<long long>(r.iters), r.time_us,
                    r.gbps, r.peak_percent, static_cast<long long>(r.wrong));
        std::fflush(stdout);
        rows.push_back(r);
        c.buffers.clear();
        cuda::empty_cache(); // so that the next, larger row finds the memory free
      }
    }
  }
  std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(total_wrong),
              total_wrong == 0 ? "OK" : "FAILED");

  const auto path = opts.str("json");
  if (!path.empty()) {
    consort::bench::json_object config;
    config.str("device", props.name)
        .num("sm_count", props.sm_count)
        .num("peak_gbps", peak_gbps)
        .num("min_bytes", min_bytes)
        .num("max_bytes", max_bytes)
        .num("factor", factor)
        .num("warmup", warmup)
        .num("iters", iters)
        .str("dtypes", opts.str("dtypes"))
        .str("redop", consort::to_string(op));
    std::vector<consort::bench::json_object> items;
    for (const auto& r : rows) {
      consort::bench::json_object o;
      o.str("op", r.op)
          .str("dtype", consort::to_string(r.type))
          .num("inputs", r.inputs)
          .num("size", r.size)
          .num("moved", r.moved)
          .num("iters", r.iters)
          .num("time_us", r.time_us)
          .num("gbps", r.gbps)
          .num("peak_percent", r.peak_percent)
          .num("wrong", r.wrong);
      items.push_back(o);
    }
    consort::bench::json_object doc;
    doc.str("program", "reduce_kernel_bench").obj("config", config).arr("results", items);
    if (!consort::bench::write_json(path, doc))
      return 1;
  }
  return total_wrong == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reduce_kernel_bench: %s\n", e.what());
    return 1;
  }
}
