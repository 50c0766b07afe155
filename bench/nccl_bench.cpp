// nccl_bench: NCCL all_reduce (sum), all_gather and broadcast (root 0) between the GPUs of this
// process, one rank per GPU (the communicators come from consort's nccl::init_group, like
// ncclCommInitAll), float32 and bfloat16, 4 B to 1 GiB. Every size gets two rows in the same run:
// `direct`, NCCL called on the buffers with the raw ncclComm_t, and `wrapper`, the same call
// through consort::cuda::nccl::communicator; the wrapper row ends with ratio = wrapper time /
// direct time. For float32 a third row, `consort`, times the same call made by replicas of a
// mirrored_strategy over the same GPUs (ctx.all_reduce / all_gather / broadcast inside one step),
// with ratio = consort time / direct time: what the runtime adds per call (--strategy 0 skips
// it). nccl-tests style output, out-of-place only.
//
// Timing: CUDA events recorded on every rank's stream around `--iters` back-to-back iterations
// (after `--warmup` untimed ones); time = elapsed / iters, max over ranks. Sizes follow
// nccl-tests: for all_gather, size and count are the whole gathered output. algbw = size / time,
// busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather), 1 (broadcast); GB = 1e9 bytes.
// #wrong counts the elements of every rank's output that differ from the expected value (rank r
// sends r + 1; outputs are filled with NaN bytes before each row).
//
// Usage:
//   ./build/bench/nccl_bench [--min-bytes 4] [--max-bytes 1G] [--factor 2] [--warmup 5]
//                            [--iters 20] [--gpus 0] [--check 1] [--strategy 1] [--json FILE]
//
// Expected output (shape; figures depend on the GPU; table lines are wider than the code):
// clang-format off
//   # consort nccl_bench  ranks=1 devices=GPU:0 minbytes=4 maxbytes=1073741824 factor=2 ...
//   # nccl header 2.28.9, library 22809; one process, one rank per GPU (nccl::init_group, ...)
//   # GPU:0 NVIDIA H100 80GB HBM3, 79.2 GiB, sm_90
//   ...
//   # all_reduce  type=float  redop=sum  root=-1  busbw factor 2(n-1)/n
//   #       size        count      type   redop   root     path       time   algbw   busbw  #wrong   ratio
//   #        (B)   (elements)                                         (us)  (GB/s)  (GB/s)
//              4            1     float     sum     -1   direct       6.51    0.00    0.00       0
//              4            1     float     sum     -1  wrapper       6.62    0.00    0.00       0   1.017
//   ...
//   # Out of bounds values : 0 OK
// clang-format on
// Without a GPU it prints `nccl_bench: no GPU (<reason>)` and exits with status 0.

#include "common.hpp"

#include <consort/consort.hpp>

#include "device/cuda/nccl.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace nccl = consort::cuda::nccl;
using namespace std::chrono_literals;

/// Deadline of every wait of the benchmark (it never waits forever either).
constexpr auto wait_timeout = std::chrono::milliseconds{120'000};

void cuda_check(cudaError_t status, const char* call) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string{call} + " failed: " + cudaGetErrorString(status));
}

/// The non-blocking communicator's rule for direct calls too: after ncclInProgress, poll until
/// NCCL reports ncclSuccess before the next call on that communicator.
void direct_check(ncclResult_t result, const char* call, const std::vector<ncclComm_t>& comms) {
  if (result == ncclSuccess)
    return;
  if (result != ncclInProgress)
    throw std::runtime_error(std::string{call} + " failed: " + ncclGetErrorString(result));
  const auto deadline = std::chrono::steady_clock::now() + wait_timeout;
  for (auto comm : comms) {
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) {
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess)
        throw std::runtime_error("ncclCommGetAsyncError failed");
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error(std::string{call} + " did not settle within the deadline");
    }
    if (state != ncclSuccess)
      throw std::runtime_error(std::string{call} + " failed: " + ncclGetErrorString(state));
  }
}

/// One rank: its communicator, stream, events and buffers (send and recv of --max-bytes).
struct rank_state {
  int device = 0;
  nccl::communicator* comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  void* send = nullptr;
  void* recv = nullptr;
};

/// Owns the CUDA resources of every rank.
class ranks {
public:
  ranks(std::vector<nccl::communicator>& comms, size_t bytes) {
    for (auto& c : comms) {
      rank_state r;
      r.device = c.device();
      r.comm = &c;
      cuda_check(cudaSetDevice(r.device), "cudaSetDevice");
      cuda_check(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "cudaStreamCreate");
      cuda_check(cudaEventCreate(&r.start), "cudaEventCreate");
      cuda_check(cudaEventCreate(&r.stop), "cudaEventCreate");
      cuda_check(cudaMalloc(&r.send, bytes), "cudaMalloc (send buffer)");
      cuda_check(cudaMalloc(&r.recv, bytes), "cudaMalloc (recv buffer)");
      all_.push_back(r);
    }
  }
  ~ranks() {
    for (auto& r : all_) {
      (void)cudaSetDevice(r.device);
      (void)cudaFree(r.send);
      (void)cudaFree(r.recv);
      (void)cudaEventDestroy(r.start);
      (void)cudaEventDestroy(r.stop);
      (void)cudaStreamDestroy(r.stream);
    }
  }
  ranks(const ranks&) = delete;
  ranks& operator=(const ranks&) = delete;

  std::vector<rank_state>& all() { return all_; }
  size_t size() const { return all_.size(); }

  /// Waits for every rank's stream (bounded).
  void sync(const std::string& what) {
    std::vector<std::pair<nccl::communicator*, cudaStream_t>> work;
    for (auto& r : all_)
      work.emplace_back(r.comm, r.stream);
    nccl::wait(work, wait_timeout, what);
  }

private:
  std::vector<rank_state> all_;
};

/// An element type of the benchmark and how to write small integers in it.
struct type_desc {
  ncclDataType_t type;
  const char* name;
  /// The bytes of `v` (a small integer, exact in both types) in this type.
  std::function<void(double v, uint8_t* out)> encode;
};

std::vector<type_desc> bench_types() {
  return {
      {ncclFloat32, "float",
       [](double v, uint8_t* out) {
         auto f = static_cast<float>(v);
         std::memcpy(out, &f, sizeof f);
       }},
      // bfloat16 is the upper half of a float32; exact for the small integers used here.
      {ncclBfloat16, "bfloat16",
       [](double v, uint8_t* out) {
         auto f = static_cast<float>(v);
         uint32_t bits = 0;
         std::memcpy(&bits, &f, sizeof bits);
         auto half = static_cast<uint16_t>(bits >> 16);
         std::memcpy(out, &half, sizeof half);
       }},
  };
}

/// Writes `count` copies of the `element`-byte value `pattern` to `data`.
void fill(uint8_t* data, size_t count, const uint8_t* pattern, size_t element) {
  if (element == 4) {
    uint32_t v = 0;
    std::memcpy(&v, pattern, 4);
    std::fill_n(reinterpret_cast<uint32_t*>(data), count, v);
  } else if (element == 2) {
    uint16_t v = 0;
    std::memcpy(&v, pattern, 2);
    std::fill_n(reinterpret_cast<uint16_t*>(data), count, v);
  } else {
    for (size_t i = 0; i < count; ++i)
      std::memcpy(data + i * element, pattern, element);
  }
}

/// Number of the `count` elements at `data` that are not the value `pattern`.
int64_t count_wrong(const uint8_t* data, size_t count, const uint8_t* pattern, size_t element) {
  int64_t wrong = 0;
  if (element == 4) {
    uint32_t v = 0;
    std::memcpy(&v, pattern, 4);
    const auto* p = reinterpret_cast<const uint32_t*>(data);
    for (size_t i = 0; i < count; ++i)
      wrong += p[i] != v;
  } else if (element == 2) {
    uint16_t v = 0;
    std::memcpy(&v, pattern, 2);
    const auto* p = reinterpret_cast<const uint16_t*>(data);
    for (size_t i = 0; i < count; ++i)
      wrong += p[i] != v;
  } else {
    for (size_t i = 0; i < count; ++i)
      wrong += std::memcmp(data + i * element, pattern, element) != 0;
  }
  return wrong;
}

/// What one collective contributes (as nccl-tests' struct testColl).
struct coll_desc {
  std::string name;
  std::string redop; // "sum" or "none"
  int root = -1;
  std::string factor_text;
  std::function<double(int n)> bus_factor;
  /// Elements each rank sends for a row of `count` elements (the whole output for all_gather).
  std::function<size_t(size_t count, int n)> send_count;
  /// The expected value of output segment `s` on any rank (rank r sends r + 1); the output is
  /// `segments(n)` segments of equal length.
  std::function<double(size_t s, int n)> expected;
  std::function<size_t(int n)> segments;
  /// Queues the collective of one rank directly on NCCL.
  std::function<ncclResult_t(rank_state&, size_t send_count, ncclDataType_t)> direct;
  /// Queues the same through the communicator wrapper.
  std::function<void(rank_state&, size_t send_count, ncclDataType_t)> wrapper;
};

std::vector<coll_desc> bench_collectives() {
  std::vector<coll_desc> out;
  {
    coll_desc d;
    d.name = "all_reduce";
    d.redop = "sum";
    d.factor_text = "2(n-1)/n";
    d.bus_factor = [](int n) {
      return 2.0 * (n - 1) / n;
    };
    d.send_count = [](size_t count, int) {
      return count;
    };
    d.expected = [](size_t, int n) {
      return n * (n + 1) / 2.0;
    };
    d.segments = [](int) {
      return size_t{1};
    };
    d.direct = [](rank_state& r, size_t count, ncclDataType_t t) {
      return ncclAllReduce(r.send, r.recv, count, t, ncclSum, r.comm->get(), r.stream);
    };
    d.wrapper = [](rank_state& r, size_t count, ncclDataType_t t) {
      r.comm->all_reduce(r.send, r.recv, count, t, ncclSum, r.stream);
    };
    out.push_back(d);
  }
  {
    coll_desc d;
    d.name = "all_gather";
    d.redop = "none";
    d.factor_text = "(n-1)/n";
    d.bus_factor = [](int n) {
      return static_cast<double>(n - 1) / n;
    };
    d.send_count = [](size_t count, int n) {
      return count / static_cast<size_t>(n);
    };
    d.expected = [](size_t s, int) {
      return static_cast<double>(s + 1);
    };
    d.segments = [](int n) {
      return static_cast<size_t>(n);
    };
    d.direct = [](rank_state& r, size_t count, ncclDataType_t t) {
      return ncclAllGather(r.send, r.recv, count, t, r.comm->get(), r.stream);
    };
    d.wrapper = [](rank_state& r, size_t count, ncclDataType_t t) {
      r.comm->all_gather(r.send, r.recv, count, t, r.stream);
    };
    out.push_back(d);
  }
  {
    coll_desc d;
    d.name = "broadcast";
    d.redop = "none";
    d.root = 0;
    d.factor_text = "1";
    d.bus_factor = [](int) {
      return 1.0;
    };
    d.send_count = [](size_t count, int) {
      return count;
    };
    d.expected = [](size_t, int) {
      return 1.0;
    }; // the root is rank 0, which sends 1
    d.segments = [](int) {
      return size_t{1};
    };
    d.direct = [](rank_state& r, size_t count, ncclDataType_t t) {
      return ncclBroadcast(r.send, r.recv, count, t, 0, r.comm->get(), r.stream);
    };
    d.wrapper = [](rank_state& r, size_t count, ncclDataType_t t) {
      r.comm->broadcast(r.send, r.recv, count, t, 0, r.stream);
    };
    out.push_back(d);
  }
  return out;
}

struct row {
  std::string coll;
  std::string type;
  std::string redop;
  int root = -1;
  std::string path;
  int64_t bytes = 0;
  int64_t count = 0;
  double time_us = 0;
  double algbw = 0;
  double busbw = 0;
  int64_t wrong = 0;
  double ratio = 0; // wrapper rows only
};

/// Runs one collective of one size on every rank through `path` ("direct" or "wrapper").
row run_path(ranks& rs, const coll_desc& c, const type_desc& t, size_t send_count,
             const std::string& path, int64_t warmup, int64_t iters, bool check,
             std::vector<uint8_t>& host) {
  const int n = static_cast<int>(rs.size());
  const size_t element = nccl::size_of(t.type);
  const size_t out_count =
      c.name == "all_gather" ? send_count * static_cast<size_t>(n) : send_count;
  std::vector<ncclComm_t> raw;
  for (auto& r : rs.all())
    raw.push_back(r.comm->get());

  auto issue = [&]() {
    if (path == "direct") {
      if (n > 1)
        direct_check(ncclGroupStart(), "ncclGroupStart", {});
      for (auto& r : rs.all())
        direct_check(c.direct(r, send_count, t.type), c.name.c_str(), {r.comm->get()});
      if (n > 1)
        direct_check(ncclGroupEnd(), "ncclGroupEnd", raw);
    } else {
      std::optional<nccl::group> g;
      if (n > 1)
        g.emplace();
      for (auto& r : rs.all())
        c.wrapper(r, send_count, t.type);
      if (g)
        g->end();
    }
  };

  // NaN bytes in every output, so that an output nobody wrote is counted wrong.
  for (auto& r : rs.all()) {
    cuda_check(cudaSetDevice(r.device), "cudaSetDevice");
    cuda_check(cudaMemsetAsync(r.recv, 0xFF, out_count * element, r.stream), "cudaMemsetAsync");
  }
  rs.sync("memset");
  for (int64_t i = 0; i < warmup; ++i)
    issue();
  rs.sync(c.name + " warm-up");
  for (auto& r : rs.all()) {
    cuda_check(cudaSetDevice(r.device), "cudaSetDevice");
    cuda_check(cudaEventRecord(r.start, r.stream), "cudaEventRecord");
  }
  for (int64_t i = 0; i < iters; ++i)
    issue();
  for (auto& r : rs.all()) {
    cuda_check(cudaSetDevice(r.device), "cudaSetDevice");
    cuda_check(cudaEventRecord(r.stop, r.stream), "cudaEventRecord");
  }
  rs.sync(c.name + " timed iterations");

  row out;
  out.coll = c.name;
  out.type = t.name;
  out.redop = c.redop;
  out.root = c.root;
  out.path = path;
  out.count = static_cast<int64_t>(out_count);
  out.bytes = static_cast<int64_t>(out_count * element);
  double slowest_ms = 0;
  for (auto& r : rs.all()) {
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, r.start, r.stop), "cudaEventElapsedTime");
    slowest_ms = std::max(slowest_ms, static_cast<double>(ms));
  }
  out.time_us = slowest_ms * 1e3 / static_cast<double>(iters);
  out.algbw = out.time_us > 0 ? static_cast<double>(out.bytes) / (out.time_us * 1e3) : 0;
  out.busbw = out.algbw * c.bus_factor(n);

  if (check && out_count > 0) {
    std::vector<uint8_t> want(element);
    const size_t segments = c.segments(n);
    const size_t length = out_count / segments;
    for (auto& r : rs.all()) {
      cuda_check(cudaSetDevice(r.device), "cudaSetDevice");
      cuda_check(cudaMemcpy(host.data(), r.recv, out_count * element, cudaMemcpyDeviceToHost),
                 "cudaMemcpy (check)");
      for (size_t s = 0; s < segments; ++s) {
        t.encode(c.expected(s, n), want.data());
        out.wrong += count_wrong(host.data() + s * length * element, length, want.data(), element);
      }
    }
  }
  return out;
}

/// The same collective through consort's runtime: a mirrored_strategy over the same GPUs runs
/// one step that calls it `warmup` + `iters` times on a float32 GPU tensor; time per call is
/// taken on every replica with a steady clock around the timed calls and the wait for the
/// replica's stream after them (ctx.synchronize()), max over replicas. Rank r's tensor holds r + 1,
/// as for the other rows.
row run_strategy(consort::mirrored_strategy& strategy, const coll_desc& c, size_t send_count,
                 int64_t warmup, int64_t iters, bool check) {
  using namespace consort;
  const int n = strategy.num_replicas_in_sync();
  auto per = strategy.run([&](replica_context& ctx) {
    const auto rank = ctx.replica_id_in_sync_group();
    auto x = tensor::from<float>(std::vector<float>(send_count, static_cast<float>(rank + 1)),
                                 {static_cast<int64_t>(send_count)}, ctx.device());
    auto call = [&] {
      if (c.name == "all_reduce")
        return ctx.all_reduce(reduce_op::sum, x);
      if (c.name == "all_gather")
        return ctx.all_gather(x, 0);
      return ctx.broadcast(x, c.root);
    };
    tensor last;
    for (int64_t i = 0; i < warmup; ++i)
      last = call();
    ctx.synchronize();
    auto begin = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i)
      last = call();
    // The calls return once queued on the replica's stream; the time is until they are done, as
    // nccl-tests times `iters` launches and one stream synchronisation.
    ctx.synchronize();
    auto us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - begin).count();
    int64_t wrong = 0;
    if (check) {
      auto values = last.to_vector<float>();
      const size_t segments = c.segments(n);
      const size_t length = values.size() / segments;
      for (size_t s = 0; s < segments; ++s)
        for (size_t k = 0; k < length; ++k)
          wrong += values[s * length + k] != static_cast<float>(c.expected(s, n));
    }
    return nest::list(
        {tensor::scalar<double>(us / static_cast<double>(iters)), tensor::scalar<int64_t>(wrong)});
  });
  row out;
  out.coll = c.name;
  out.type = "float";
  out.redop = c.redop;
  out.root = c.root;
  out.path = "consort";
  const size_t out_count =
      c.name == "all_gather" ? send_count * static_cast<size_t>(n) : send_count;
  out.count = static_cast<int64_t>(out_count);
  out.bytes = static_cast<int64_t>(out_count * sizeof(float));
  for (const auto& r : per.values()) {
    out.time_us = std::max(out.time_us, r[0].as_tensor().item<double>());
    out.wrong += r[1].as_tensor().item<int64_t>();
  }
  out.algbw = out.time_us > 0 ? static_cast<double>(out.bytes) / (out.time_us * 1e3) : 0;
  out.busbw = out.algbw * c.bus_factor(n);
  return out;
}

void print_row(const row& r, bool with_ratio) {
  std::printf("%12lld %12lld %9s %7s %6d %8s ", static_cast<long long>(r.bytes),
              static_cast<long long>(r.count), r.type.c_str(), r.redop.c_str(), r.root,
              r.path.c_str());
  std::printf(r.time_us >= 99999.5 ? "%10.0f" : "%10.2f", r.time_us);
  std::printf(" %7.2f %7.2f %7lld", r.algbw, r.busbw, static_cast<long long>(r.wrong));
  if (with_ratio)
    std::printf(" %7.3f", r.ratio);
  std::printf("\n");
  std::fflush(stdout);
}

int run(int argc, char** argv) {
  consort::bench::options opts{
      "nccl_bench",
      "Times NCCL all_reduce, all_gather and broadcast between the GPUs of this process (one "
      "rank per GPU),\nfloat32 and bfloat16, each size twice: NCCL called directly and through "
      "consort's communicator\nwrapper, with the ratio of their times; prints an nccl-tests "
      "style table."};
  opts.add("min-bytes", "4", "smallest size in bytes (suffix K, M, G allowed)");
  opts.add("max-bytes", "1G", "largest size in bytes (suffix K, M, G allowed)");
  opts.add("factor", "2", "size multiplier between rows (2 or 4, say)");
  opts.add("warmup", "5", "untimed iterations per row");
  opts.add("iters", "20", "timed iterations per row");
  opts.add("gpus", "0", "number of GPUs (ranks) to use; 0: every visible GPU");
  opts.add("check", "1", "1: count wrong output elements on every rank, 0: skip the check");
  opts.add("strategy", "1", "1: also time each float call through a mirrored_strategy");
  opts.add("json", "", "also write the results as JSON to this file");
  opts.parse(argc, argv);
  const auto min_bytes = opts.bytes("min-bytes");
  const auto max_bytes = opts.bytes("max-bytes");
  const auto factor = opts.integer("factor");
  const auto warmup = opts.integer("warmup");
  const auto iters = opts.integer("iters");
  const auto want_gpus = opts.integer("gpus");
  const bool check = opts.integer("check") != 0;
  if (min_bytes < 1 || max_bytes < min_bytes || factor < 2 || warmup < 0 || iters <= 0 ||
      want_gpus < 0)
    opts.fail("need 1 <= --min-bytes <= --max-bytes, --factor >= 2, --warmup >= 0, --iters > 0, "
              "--gpus >= 0");

  int visible = 0;
  auto status = cudaGetDeviceCount(&visible);
  if (status != cudaSuccess || visible == 0) {
    std::printf("nccl_bench: no GPU (%s)\n", status != cudaSuccess
                                                 ? cudaGetErrorString(status)
                                                 : "cudaGetDeviceCount found 0 devices");
    return 0;
  }
  const int n = want_gpus == 0 ? visible : static_cast<int>(std::min<int64_t>(want_gpus, visible));
  std::vector<int> devices;
  std::string device_text;
  for (int d = 0; d < n; ++d) {
    devices.push_back(d);
    device_text += (d ? ",GPU:" : "GPU:") + std::to_string(d);
  }

  int nccl_version = 0;
  (void)ncclGetVersion(&nccl_version);
  std::printf("# consort nccl_bench  ranks=%d devices=%s minbytes=%lld maxbytes=%lld factor=%lld "
              "warmup=%lld iters=%lld check=%d\n",
              n, device_text.c_str(), static_cast<long long>(min_bytes),
              static_cast<long long>(max_bytes), static_cast<long long>(factor),
              static_cast<long long>(warmup), static_cast<long long>(iters), check ? 1 : 0);
  std::printf("# nccl header %d.%d.%d, library %d; one process, one rank per GPU "
              "(nccl::init_group, non-blocking communicators)\n",
              NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, nccl_version);
  std::vector<std::string> gpu_names;
  for (int d : devices) {
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties");
    gpu_names.emplace_back(prop.name);
    std::printf("# GPU:%d %s, %.1f GiB, sm_%d%d\n", d, prop.name,
                static_cast<double>(prop.totalGlobalMem) / (1 << 30), prop.major, prop.minor);
  }
  std::printf("# time: CUDA events around %lld back-to-back iterations on every rank's stream, "
              "per iteration, max over ranks; GB = 1e9 bytes; out-of-place\n",
              static_cast<long long>(iters));
  std::printf("# direct: ncclAllReduce/ncclAllGather/ncclBroadcast on the raw ncclComm_t%s; "
              "wrapper: consort::cuda::nccl::communicator%s;\n# ratio = wrapper time / direct "
              "time\n",
              n > 1 ? " inside ncclGroupStart/End" : "", n > 1 ? " inside nccl::group" : "");
  std::fflush(stdout);

  // The runtime's row: the same GPUs as replicas of a mirrored_strategy (float32 only: bfloat16
  // is not a consort dtype). Its time includes what the runtime adds per call.
  std::unique_ptr<consort::mirrored_strategy> strategy;
  if (opts.integer("strategy") != 0) {
    std::vector<std::string> names;
    for (int d : devices)
      names.push_back("GPU:" + std::to_string(d));
    strategy = std::make_unique<consort::mirrored_strategy>(names);
    std::printf("# consort: the same call as ctx.all_reduce/all_gather/broadcast inside one "
                "strategy.run step on %s (float only); iters calls then ctx.synchronize(), by "
                "steady clock, max over "
                "replicas; ratio = consort time / direct time\n",
                device_text.c_str());
  }

  auto comms = nccl::init_group(nccl::unique_id::make(), n, 0, devices, wait_timeout);
  ranks rs{comms, static_cast<size_t>(max_bytes)};
  std::vector<uint8_t> host(static_cast<size_t>(max_bytes));

  std::vector<row> rows;
  int64_t total_wrong = 0;
  for (const auto& t : bench_types()) {
    const size_t element = nccl::size_of(t.type);
    // Rank r sends r + 1 in every element of its send buffer, written once per type: every
    // collective here is out of place, so the send buffers never change.
    // (Pageable copies are staged before cudaMemcpyAsync returns, so `host` can be refilled at
    // once; the stream orders the copy before the collectives.)
    for (size_t rank = 0; rank < rs.size(); ++rank) {
      auto& r = rs.all()[rank];
      std::vector<uint8_t> value(element);
      t.encode(static_cast<double>(rank + 1), value.data());
      fill(host.data(), host.size() / element, value.data(), element);
      cuda_check(cudaSetDevice(r.device), "cudaSetDevice");
      cuda_check(cudaMemcpyAsync(r.send, host.data(), host.size() / element * element,
                                 cudaMemcpyHostToDevice, r.stream),
                 "cudaMemcpyAsync (send data)");
    }
    rs.sync("upload of the send data");
    for (const auto& c : bench_collectives()) {
      std::printf("#\n# %s  type=%s  redop=%s  root=%d  busbw factor %s\n", c.name.c_str(), t.name,
                  c.redop.c_str(), c.root, c.factor_text.c_str());
      std::printf("#       size        count      type   redop   root     path       time   algbw"
                  "   busbw  #wrong   ratio\n");
      std::printf("#        (B)   (elements)                                         (us)  (GB/s)"
                  "  (GB/s)\n");
      int64_t wrong = 0;
      double busbw_direct = 0;
      double busbw_wrapper = 0;
      double ratio_sum = 0;
      int measured = 0;
      for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= factor) {
        const size_t count = static_cast<size_t>(bytes) / element;
        const size_t send_count = c.send_count(count, n);
        if (send_count == 0)
          continue; // too small for this type and rank count
        auto direct = run_path(rs, c, t, send_count, "direct", warmup, iters, check, host);
        auto wrapped = run_path(rs, c, t, send_count, "wrapper", warmup, iters, check, host);
        wrapped.ratio = direct.time_us > 0 ? wrapped.time_us / direct.time_us : 0;
        print_row(direct, false);
        print_row(wrapped, true);
        if (strategy && t.type == ncclFloat32) {
          auto through = run_strategy(*strategy, c, send_count, warmup, iters, check);
          through.ratio = direct.time_us > 0 ? through.time_us / direct.time_us : 0;
          print_row(through, true);
          wrong += through.wrong;
          rows.push_back(through);
        }
        wrong += direct.wrong + wrapped.wrong;
        busbw_direct += direct.busbw;
        busbw_wrapper += wrapped.busbw;
        ratio_sum += wrapped.ratio;
        ++measured;
        rows.push_back(direct);
        rows.push_back(wrapped);
      }
      std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(wrong),
                  !check       ? "not checked (--check 0)"
                  : wrong == 0 ? "OK"
                               : "FAILED");
      if (measured > 0)
        std::printf("# Avg bus bandwidth    : direct %g, wrapper %g; avg time ratio "
                    "wrapper/direct %.3f\n",
                    busbw_direct / measured, busbw_wrapper / measured, ratio_sum / measured);
      total_wrong += wrong;
    }
  }
  std::printf("#\n# Out of bounds values : %lld %s\n", static_cast<long long>(total_wrong),
              !check             ? "not checked (--check 0)"
              : total_wrong == 0 ? "OK"
                                 : "FAILED");

  auto path = opts.str("json");
  if (!path.empty()) {
    using consort::bench::json_object;
    json_object config;
    config.num("ranks", n).str("devices", device_text);
    config.num("min_bytes", min_bytes).num("max_bytes", max_bytes).num("factor", factor);
    config.num("warmup", warmup).num("iters", iters).num("check", check ? 1 : 0);
    json_object machine;
    machine.num("nccl_version", nccl_version);
    std::string names;
    for (size_t i = 0; i < gpu_names.size(); ++i)
      names += (i ? "; " : "") + gpu_names[i];
    machine.str("gpus", names);
    std::vector<json_object> items;
    for (const auto& r : rows) {
      json_object o;
      o.str("collective", r.coll).str("type", r.type).str("redop", r.redop).num("root", r.root);
      o.str("path", r.path).num("size", r.bytes).num("count", r.count);
      o.num("time_us", r.time_us).num("algbw", r.algbw).num("busbw", r.busbw);
      o.num("wrong", r.wrong);
      if (r.path == "wrapper")
        o.num("ratio", r.ratio);
      items.push_back(o);
    }
    json_object doc;
    doc.str("benchmark", "nccl_bench").obj("config", config).obj("machine", machine);
    doc.arr("results", items).num("out_of_bounds", total_wrong);
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
    std::fprintf(stderr, "nccl_bench: %s\n", e.what());
    return 1;
  }
}
