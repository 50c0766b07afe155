// gemm_bench: the training demo's float32 GEMMs (examples/train/mlp_kernels.cu) on one GPU, on the
// shapes one step of the demo runs, in nccl-tests style rows: our tiled kernel and
// cuBLAS (loaded as the demo loads it; absent rows say why), with the share of cuBLAS's speed our
// kernel reaches and the normwise difference between the two outputs. Its outside peer is cuBLAS
// through torch (bench/torch_gemm_bench.py), timed the same way on the same shapes.
//
//   ./build/bench/gemm_bench [--batch 512] [--hidden 512,1024,4096] [--iters 50] [--json FILE]
//
// Each shape is timed as the demo calls it: forward (A [M, K] x W [K, N], + bias, ReLU), the
// weight gradient (A^T x delta: transpose_a) and the input gradient (delta x W^T: transpose_b).
// Times are CUDA events around `iters` back-to-back launches after 3 warm-up launches; GFLOP/s is
// 2 M N K / time. Without a GPU it says so and exits 0 (it is a benchmark, not a test); a launch
// that fails, or outputs that differ by more than 1e-5 normwise, exit 1.

#include "common/cli.hpp"
#include "mlp_kernels.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(rc));
}

struct device_buffer {
  explicit device_buffer(size_t floats) {
    check(cudaMalloc(&p, floats * sizeof(float)), "cudaMalloc");
    std::vector<float> host(floats);
    uint32_t state = 12345;
    for (auto& x : host) {
      state = state * 1664525u + 1013904223u;
      x = static_cast<float>(state >> 8) / static_cast<float>(1u << 24) - 0.5f;
    }
    check(cudaMemcpy(p, host.data(), floats * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~device_buffer() { cudaFree(p); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  float* p = nullptr;
};

struct gemm_case {
  const char* name;
  bool ta, tb;
  int64_t m, n, k;
  bool bias_relu;
};

using gemm_fn = const char* (*)(int, void*, bool, bool, int64_t, int64_t, int64_t, const float*,
                                const float*, float*, const float*, bool, const float*);

struct timed {
  double us = 0;
  std::vector<float> out;
};

timed time_case(const gemm_case& c, gemm_fn gemm, int iters, cudaStream_t stream) {
  // Operands stored as the kernel reads them: A [M, K] or [K, M]; B [K, N] or [N, K].
  device_buffer a(static_cast<size_t>(c.m * c.k)), b(static_cast<size_t>(c.k * c.n));
  device_buffer out(static_cast<size_t>(c.m * c.n)), bias(static_cast<size_t>(c.n));
  auto launch = [&] {
    const char* why = gemm(0, stream, c.ta, c.tb, c.m, c.n, c.k, a.p, b.p, out.p,
                           c.bias_relu ? bias.p : nullptr, c.bias_relu, nullptr);
    if (why != nullptr)
      throw std::runtime_error(std::string("gemm launch: ") + why);
  };
  for (int i = 0; i < 3; ++i)
    launch();
  cudaEvent_t begin, end;
  check(cudaEventCreate(&begin), "cudaEventCreate");
  check(cudaEventCreate(&end), "cudaEventCreate");
  check(cudaEventRecord(begin, stream), "cudaEventRecord");
  for (int i = 0; i < iters; ++i)
    launch();
  check(cudaEventRecord(end, stream), "cudaEventRecord");
  check(cudaEventSynchronize(end), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, begin, end), "cudaEventElapsedTime");
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  timed t;
  t.us = ms * 1e3 / iters;
  t.out.resize(static_cast<size_t>(c.m * c.n));
  check(cudaMemcpy(t.out.data(), out.p, t.out.size() * sizeof(float), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
  return t;
}

/// |x - y|_2 / max(|x|_2, |y|_2): two float32 summation orders agree to about 1e-7 this way,
/// where single elements near zero may differ by far more relative to themselves.
double normwise_difference(const std::vector<float>& x, const std::vector<float>& y) {
  double diff = 0, nx = 0, ny = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
    diff += (double(x[i]) - double(y[i])) * (double(x[i]) - double(y[i]));
    nx += double(x[i]) * double(x[i]);
    ny += double(y[i]) * double(y[i]);
  }
  const double norm = std::sqrt(std::max(nx, ny));
  return norm > 0 ? std::sqrt(diff) / norm : 0;
}

std::vector<int64_t> parse_list(const std::string& text, const char* flag) {
  std::vector<int64_t> values;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item =
        text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1) {
      std::fprintf(stderr,
                   "gemm_bench: %s expects positive integers separated by commas, got '%s'\n", flag,
                   text.c_str());
      std::exit(2);
    }
    values.push_back(v);
    if (comma == std::string::npos)
      break;
    pos = comma + 1;
  }
  return values;
}

} // namespace

int main(int argc, char** argv) {
  std::string json_path;
  std::string batch_text = "512", hidden_text = "512,1024,4096", iters_text = "50";
  consort::cli::parser cmd("gemm_bench",
                           "The training demo's GEMMs on GPU:0: the tiled kernel against "
                           "cuBLAS on the same shapes.");
  cmd.value("batch", batch_text, "rows of the batch");
  cmd.value("hidden", hidden_text, "hidden sizes, N[,N...]");
  cmd.value("iters", iters_text, "iterations per shape");
  cmd.value("json", json_path, "also write the rows as JSON to this file");
  cmd.parse(argc, argv);
  const int64_t batch = parse_list(batch_text, "--batch").at(0);
  const std::vector<int64_t> hidden = parse_list(hidden_text, "--hidden");
  const int iters = static_cast<int>(parse_list(iters_text, "--iters").at(0));
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::printf("# gemm_bench: no GPU visible; nothing to measure\n");
    return 0;
  }
  try {
    check(cudaSetDevice(0), "cudaSetDevice");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    namespace k = consort::train::kernels;
    const bool have_cublas = k::gemm_cublas(0, nullptr, false, false, 0, 0, 0, nullptr, nullptr,
                                            nullptr, nullptr, false, nullptr) == nullptr;
    std::printf("# gemm_bench: %s, batch %lld, %d iterations per shape; the demo's GEMMs: %s\n",
                prop.name, static_cast<long long>(batch), iters, k::gemm_backend());
    std::printf("# %-8s %6s %6s %6s %12s %10s %12s %10s %11s %10s %6s\n", "gemm", "M", "N", "K",
                "tiled (us)", "GFLOP/s", "cuBLAS (us)", "GFLOP/s", "tiled share", "normwise",
                "demo");
    cudaStream_t stream;
    check(cudaStreamCreate(&stream), "cudaStreamCreate");
    std::string json = "[";
    bool differ = false;
    for (int64_t h : hidden) {
      // The hidden layers' three GEMMs, then the thin ones of the input (16 features) and output
      // (4 classes) layers, which the demo runs at every width.
      const gemm_case cases[] = {
          {"forward", false, false, batch, h, h, true},
          {"grad_w", true, false, h, h, batch, false},
          {"grad_x", false, true, batch, h, h, false},
          {"fwd_in", false, false, batch, h, 16, true},
          {"fwd_out", false, false, batch, 4, h, false},
          {"gw_in", true, false, 16, h, batch, false},
          {"gw_out", true, false, h, 4, batch, false},
          {"gx_out", false, true, batch, h, 4, false},
      };
      for (const auto& c : cases) {
        const double flop =
            2.0 * static_cast<double>(c.m) * static_cast<double>(c.n) * static_cast<double>(c.k);
        auto tiled = time_case(c, k::gemm_tiled, iters, stream);
        timed cublas;
        double diff = 0;
        if (have_cublas) {
          cublas = time_case(c, k::gemm_cublas, iters, stream);
          diff = normwise_difference(tiled.out, cublas.out);
          differ = differ || diff > 1e-5;
        }
        char cublas_us[32] = "-", cublas_gflops[32] = "-", share[32] = "-", diff_text[32] = "-";
        if (have_cublas) {
          std::snprintf(cublas_us, sizeof cublas_us, "%.1f", cublas.us);
          std::snprintf(cublas_gflops, sizeof cublas_gflops, "%.0f", flop / (cublas.us * 1e3));
          std::snprintf(share, sizeof share, "%.2fx", cublas.us / tiled.us);
          std::snprintf(diff_text, sizeof diff_text, "%.1e", diff);
        }
        std::printf("  %-8s %6lld %6lld %6lld %12.1f %10.0f %12s %10s %11s %10s %6s\n", c.name,
                    static_cast<long long>(c.m), static_cast<long long>(c.n),
                    static_cast<long long>(c.k), tiled.us, flop / (tiled.us * 1e3), cublas_us,
                    cublas_gflops, share, diff_text,
                    k::gemm_uses_cublas(c.m, c.n, c.k) ? "cuBLAS" : "tiled");
        char row[320];
        std::snprintf(row, sizeof row,
                      "%s{\"gemm\":\"%s\",\"m\":%lld,\"n\":%lld,\"k\":%lld,\"tiled_us\":%.3f,"
                      "\"cublas_us\":%.3f,\"max_diff\":%.3g}",
                      json.size() > 1 ? "," : "", c.name, static_cast<long long>(c.m),
                      static_cast<long long>(c.n), static_cast<long long>(c.k), tiled.us,
                      have_cublas ? cublas.us : 0.0, diff);
        json += row;
      }
    }
    if (!have_cublas)
      std::printf("# no cuBLAS rows: %s\n", k::gemm_backend());
    std::printf(
        "# tiled share: cuBLAS's time over the tiled kernel's (1.00x: as fast as cuBLAS)\n");
    if (differ) {
      std::printf("# FAILED: the tiled kernel and cuBLAS differ by more than 1e-5 normwise\n");
      cudaStreamDestroy(stream);
      return 1;
    }
    json += "]\n";
    cudaStreamDestroy(stream);
    if (!json_path.empty()) {
      FILE* f = std::fopen(json_path.c_str(), "w");
      if (f == nullptr) {
        std::fprintf(stderr, "gemm_bench: cannot write %s\n", json_path.c_str());
        return 1;
      }
      std::fputs(json.c_str(), f);
      std::fclose(f);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemm_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
