// The CUDA kernels of the training demo's GPU form (see mlp_kernels.hpp).
//
// The GEMMs run on cuBLAS where the process can load it, else on our own tiled kernel. cuBLAS is
// loaded at run time (dlopen of libcublas.so.<CUDA major>), not linked: cuBLAS 13's libcublasLt
// alone is 541 MB, more than a build may carry to the GPU machines this project is lent, and a
// binary linked to it would not start where it is missing. On an H100 our kernel reached well
// under half of cuBLAS's speed on most of the demo's square GEMMs (bench/README.md, "the H100 field
// run"; docs/train.md, "On GPUs"), so cuBLAS is the default for those; CONSORT_CUBLAS=off keeps our
// kernel, whose every output is a sum in one fixed order (the same bytes on every run and for every
// split of the batch's rows).

#include "mlp_kernels.hpp"

#include <cuda_runtime.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>

namespace consort::train::kernels {

namespace {

// -- GEMM: 64 x 64 tiles of C per block of 256 threads, 16 of K at a time ------------------------

constexpr int tile_m = 64;
constexpr int tile_n = 64;
constexpr int tile_k = 16;
constexpr int threads_x = 16; // along n
constexpr int threads_y = 16; // along m
constexpr int per_thread = 4; // outputs per thread along m and along n

static_assert(tile_m == tile_n, "load_tile loads the tiles of A and of B alike");
// One tile in shared memory, [k][row]; +1 column: the loads write down columns without conflicts.
using tile_t = float[tile_k][tile_m + 1];

/// Loads the 64 x 16 tile of op(src) whose rows start at `base` and whose k starts at `k0` into
/// tile[k][row], zero outside the matrix. `src` is stored [extent, K] (`AlongK`: contiguous along
/// k, as A, or B^T for a transposed B) or [K, extent] (contiguous along the rows, as A^T for a
/// transposed A, or B). Each thread loads 4 elements, consecutive threads consecutive addresses.
template <bool AlongK>
__device__ void load_tile(tile_t& tile, const float* __restrict__ src, int64_t extent, int64_t k,
                          int64_t base, int64_t k0, int tid) {
#pragma unroll
  for (int i = 0; i < (tile_m * tile_k) / (threads_x * threads_y); ++i) {
    const int e = tid + i * threads_x * threads_y;
    const int row = AlongK ? e / tile_k : e % tile_m;
    const int kk = AlongK ? e % tile_k : e / tile_m;
    const int64_t gr = base + row;
    const int64_t gk = k0 + kk;
    float v = 0.f;
    if (gr < extent && gk < k)
      v = AlongK ? src[gr * k + gk] : src[gk * extent + gr];
    tile[kk][row] = v;
  }
}

template <bool TransposeA, bool TransposeB>
__global__ void __launch_bounds__(threads_x* threads_y)
    gemm_kernel(int64_t m, int64_t n, int64_t k, const float* __restrict__ a,
                const float* __restrict__ b, float* __restrict__ c, const float* __restrict__ bias,
                bool relu, const float* __restrict__ mask) {
  __shared__ tile_t as;
  __shared__ tile_t bs;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int tid = ty * threads_x + tx;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * tile_m;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * tile_n;
  float acc[per_thread][per_thread] = {};
  for (int64_t k0 = 0; k0 < k; k0 += tile_k) {
    load_tile<!TransposeA>(as, a, m, k, row0, k0, tid);
    load_tile<TransposeB>(bs, b, n, k, col0, k0, tid);
    __syncthreads();
    // Rows ty, ty + 16, ...; columns tx, tx + 16, ...: k in order for every output.
#pragma unroll
    for (int kk = 0; kk < tile_k; ++kk) {
      float av[per_thread];
      float bv[per_thread];
#pragma unroll
      for (int i = 0; i < per_thread; ++i) {
        av[i] = as[kk][ty + i * threads_y];
        bv[i] = bs[kk][tx + i * threads_x];
      }
#pragma unroll
      for (int i = 0; i < per_thread; ++i)
#pragma unroll
        for (int j = 0; j < per_thread; ++j)
          acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < per_thread; ++i) {
    const int64_t gm = row0 + ty + i * threads_y;
    if (gm >= m)
      continue;
#pragma unroll
    for (int j = 0; j < per_thread; ++j) {
      const int64_t gn = col0 + tx + j * threads_x;
      if (gn >= n)
        continue;
      float v = acc[i][j];
      if (bias != nullptr)
        v += bias[gn];
      if (relu)
        v = v > 0.f ? v : 0.f;
      if (mask != nullptr)
        v = mask[gm * n + gn] > 0.f ? v : 0.f;
      c[gm * n + gn] = v;
    }
  }
}

__global__ void column_sums_kernel(int64_t rows, int64_t cols, const float* __restrict__ a,
                                   float* __restrict__ sums) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols)
    return;
  float s = 0.f;
  for (int64_t r = 0; r < rows; ++r)
    s += a[r * cols + col];
  sums[col] = s;
}

/// One thread per row: the row's loss and correctness into scratch, its delta into `delta`.
__global__ void softmax_rows_kernel(int64_t rows, int classes, const float* __restrict__ logits,
                                    const int32_t* __restrict__ labels, float* __restrict__ delta,
                                    double* __restrict__ loss, double* __restrict__ correct) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows)
    return;
  const float* z = logits + r * classes;
  float* d = delta + r * classes;
  const int label = labels[r];
  if (label < 0 || label >= classes) {
    loss[r] = nan("");
    correct[r] = 0;
    for (int j = 0; j < classes; ++j)
      d[j] = 0.f;
    return;
  }
  int top_index = 0;
  for (int j = 1; j < classes; ++j)
    if (z[j] > z[top_index])
      top_index = j;
  const double top = z[top_index];
  double exp_sum = 0;
  for (int j = 0; j < classes; ++j)
    exp_sum += exp(static_cast<double>(z[j]) - top);
  const double log_sum_exp = top + log(exp_sum);
  loss[r] = log_sum_exp - static_cast<double>(z[label]);
  correct[r] = top_index == label ? 1.0 : 0.0;
  for (int j = 0; j < classes; ++j)
    d[j] = static_cast<float>(exp(static_cast<double>(z[j]) - log_sum_exp) - (j == label ? 1 : 0));
}

constexpr int totals_threads = 256;

/// One block: the batch's loss and correct totals, each thread summing a strided share in order
/// and the shares added in a fixed tree.
__global__ void __launch_bounds__(totals_threads)
    totals_kernel(int64_t rows, const double* __restrict__ loss, const double* __restrict__ correct,
                  float* __restrict__ totals) {
  __shared__ double loss_part[totals_threads];
  __shared__ double correct_part[totals_threads];
  const int t = threadIdx.x;
  double l = 0;
  double c = 0;
  for (int64_t r = t; r < rows; r += totals_threads) {
    l += loss[r];
    c += correct[r];
  }
  loss_part[t] = l;
  correct_part[t] = c;
  __syncthreads();
  for (int half = totals_threads / 2; half > 0; half /= 2) {
    if (t < half) {
      loss_part[t] += loss_part[t + half];
      correct_part[t] += correct_part[t + half];
    }
    __syncthreads();
  }
  if (t == 0) {
    totals[0] = static_cast<float>(loss_part[0]);
    totals[1] = static_cast<float>(correct_part[0]);
    totals[2] = static_cast<float>(rows);
  }
}

/// Makes `device` current for a launch and restores the caller's device after it.
class on_device {
public:
  explicit on_device(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess)
      previous_ = -1;
    if (previous_ != device)
      error_ = cudaSetDevice(device);
  }
  ~on_device() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_)
      cudaSetDevice(previous_);
  }
  on_device(const on_device&) = delete;
  on_device& operator=(const on_device&) = delete;
  cudaError_t error() const { return error_; }

private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

/// nullptr when the last launch on this thread was accepted, else CUDA's text.
// -- cuBLAS, loaded at run time ------------------------------------------------------------------

/// The smallest M, N and K that `gemm` hands to cuBLAS. The demo's input and output layers make
/// thin GEMMs (16 features, 4 classes), where cuBLAS was slower than the tiled kernel on most of
/// the shapes an H100 measured (gemm_bench). With this threshold the demo trains faster than on the
/// tiled kernel alone, on the default model and on 3 x 1024 (bench/README.md, "the H100 field
/// run", has the figures).
constexpr int64_t cublas_min_extent = 64;

constexpr int cublas_op_n = 0; // CUBLAS_OP_N
constexpr int cublas_op_t = 1; // CUBLAS_OP_T

/// The few cuBLAS entry points the demo calls (cublas_api.h's v2 API, declared here so that the
/// build needs no cuBLAS header or library), resolved from the library `name`.
struct cublas_library {
  using create_fn = int (*)(void**);
  using set_stream_fn = int (*)(void*, cudaStream_t);
  using sgemm_fn = int (*)(void*, int, int, int, int, int, const float*, const float*, int,
                           const float*, int, const float*, float*, int);
  using status_fn = const char* (*)(int);

  std::string name;
  std::string why_not;
  create_fn create = nullptr;
  set_stream_fn set_stream = nullptr;
  sgemm_fn sgemm = nullptr;
  status_fn status_string = nullptr;

  bool loaded() const { return sgemm != nullptr; }
  const char* status_text(int rc) const {
    return status_string != nullptr ? status_string(rc) : "a cuBLAS call failed";
  }
};

cublas_library load_cublas() {
  cublas_library api;
  const char* setting = std::getenv("CONSORT_CUBLAS");
  const std::string wanted = setting != nullptr ? setting : "";
  if (wanted == "off" || wanted == "0") {
    api.why_not = "CONSORT_CUBLAS=" + wanted;
    return api;
  }
  // The cuBLAS of the CUDA major version this was built with (its runtime is the process's).
  const std::string soname = "libcublas.so." + std::to_string(CUDART_VERSION / 1000);
  const std::string candidate = wanted.empty() || wanted == "on" ? soname : wanted;
  void* lib = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    api.why_not = "cannot load " + candidate + (why != nullptr ? std::string(": ") + why : "");
    return api;
  }
  api.create = reinterpret_cast<cublas_library::create_fn>(dlsym(lib, "cublasCreate_v2"));
  api.set_stream =
      reinterpret_cast<cublas_library::set_stream_fn>(dlsym(lib, "cublasSetStream_v2"));
  auto sgemm = reinterpret_cast<cublas_library::sgemm_fn>(dlsym(lib, "cublasSgemm_v2"));
  api.status_string =
      reinterpret_cast<cublas_library::status_fn>(dlsym(lib, "cublasGetStatusString"));
  if (api.create == nullptr || api.set_stream == nullptr || sgemm == nullptr) {
    api.why_not = candidate + " lacks cublasCreate_v2, cublasSetStream_v2 or cublasSgemm_v2";
    return api;
  }
  api.name = candidate;
  api.sgemm = sgemm;
  return api; // the library stays loaded for the life of the process
}

const cublas_library& cublas() {
  static const cublas_library api = load_cublas();
  return api;
}

/// This thread's cuBLAS handle for `device` (made current by the caller), created on first use
/// and kept for the thread's life: a handle used by one thread at a time gives the same bytes on
/// every call. nullptr when cublasCreate fails.
void* cublas_handle(int device) {
  thread_local std::map<int, void*> handles;
  auto it = handles.find(device);
  if (it != handles.end())
    return it->second;
  void* handle = nullptr;
  if (cublas().create(&handle) != 0)
    return nullptr;
  handles.emplace(device, handle);
  return handle;
}

/// C = relu(C + bias) * (mask > 0), each part when asked for, in that order (the tiled kernel's
/// epilogue, for the cuBLAS path).
__global__ void epilogue_kernel(int64_t m, int64_t n, float* __restrict__ c,
                                const float* __restrict__ bias, bool relu,
                                const float* __restrict__ mask) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= m * n)
    return;
  float v = c[i];
  if (bias != nullptr)
    v += bias[i % n];
  if (relu)
    v = v > 0.f ? v : 0.f;
  if (mask != nullptr)
    v = mask[i] > 0.f ? v : 0.f;
  c[i] = v;
}

const char* launched() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

} // namespace

const char* gemm_tiled(int device, void* stream, bool transpose_a, bool transpose_b, int64_t m,
                       int64_t n, int64_t k, const float* a, const float* b, float* c,
                       const float* bias, bool relu, const float* mask) {
  if (m <= 0 || n <= 0)
    return nullptr;
  on_device guard(device);
  if (guard.error() != cudaSuccess)
    return cudaGetErrorString(guard.error());
  const dim3 grid(blocks_for(n, tile_n), blocks_for(m, tile_m));
  const dim3 block(threads_x, threads_y);
  auto s = static_cast<cudaStream_t>(stream);
  if (!transpose_a && !transpose_b)
    gemm_kernel<false, false><<<grid, block, 0, s>>>(m, n, k, a, b, c, bias, relu, mask);
  else if (transpose_a && !transpose_b)
    gemm_kernel<true, false><<<grid, block, 0, s>>>(m, n, k, a, b, c, bias, relu, mask);
  else if (!transpose_a && transpose_b)
    gemm_kernel<false, true><<<grid, block, 0, s>>>(m, n, k, a, b, c, bias, relu, mask);
  else
    gemm_kernel<true, true><<<grid, block, 0, s>>>(m, n, k, a, b, c, bias, relu, mask);
  return launched();
}

const char* gemm_cublas(int device, void* stream, bool transpose_a, bool transpose_b, int64_t m,
                        int64_t n, int64_t k, const float* a, const float* b, float* c,
                        const float* bias, bool relu, const float* mask) {
  const auto& api = cublas();
  if (!api.loaded())
    return api.why_not.c_str();
  if (m <= 0 || n <= 0)
    return nullptr;
  if (k <= 0 || m > INT32_MAX || n > INT32_MAX || k > INT32_MAX)
    return gemm_tiled(device, stream, transpose_a, transpose_b, m, n, k, a, b, c, bias, relu, mask);
  on_device guard(device);
  if (guard.error() != cudaSuccess)
    return cudaGetErrorString(guard.error());
  auto s = static_cast<cudaStream_t>(stream);
  void* handle = cublas_handle(device);
  if (handle == nullptr)
    return "cublasCreate failed";
  if (int rc = api.set_stream(handle, s); rc != 0)
    return api.status_text(rc);
  // Row-major C [M, N] is column-major C^T [N, M] = op(B)^T op(A)^T: B (or B^T) and A (or A^T)
  // are read as the column-major matrices their row-major storage already is.
  const float one = 1.f, zero = 0.f;
  const int rc =
      api.sgemm(handle, transpose_b ? cublas_op_t : cublas_op_n,
                transpose_a ? cublas_op_t : cublas_op_n, static_cast<int>(n), static_cast<int>(m),
                static_cast<int>(k), &one, b, static_cast<int>(transpose_b ? k : n), a,
                static_cast<int>(transpose_a ? m : k), &zero, c, static_cast<int>(n));
  if (rc != 0)
    return api.status_text(rc);
  if (bias != nullptr || relu || mask != nullptr) {
    epilogue_kernel<<<blocks_for(m * n, 256), 256, 0, s>>>(m, n, c, bias, relu, mask);
    return launched();
  }
  return nullptr;
}

bool gemm_uses_cublas(int64_t m, int64_t n, int64_t k) {
  return cublas().loaded() && std::min({m, n, k}) >= cublas_min_extent;
}

const char* gemm(int device, void* stream, bool transpose_a, bool transpose_b, int64_t m, int64_t n,
                 int64_t k, const float* a, const float* b, float* c, const float* bias, bool relu,
                 const float* mask) {
  if (gemm_uses_cublas(m, n, k))
    return gemm_cublas(device, stream, transpose_a, transpose_b, m, n, k, a, b, c, bias, relu,
                       mask);
  return gemm_tiled(device, stream, transpose_a, transpose_b, m, n, k, a, b, c, bias, relu, mask);
}

const char* gemm_backend() {
  static const std::string text =
      cublas().loaded() ? "cuBLAS (" + cublas().name + ") where every extent is at least " +
                              std::to_string(cublas_min_extent) + ", the tiled kernel below"
                        : "consort's tiled kernel (no cuBLAS: " + cublas().why_not + ")";
  return text.c_str();
}

const char* column_sums(int device, void* stream, int64_t rows, int64_t cols, const float* a,
                        float* sums) {
  if (cols <= 0)
    return nullptr;
  on_device guard(device);
  if (guard.error() != cudaSuccess)
    return cudaGetErrorString(guard.error());
  column_sums_kernel<<<blocks_for(cols, 128), 128, 0, static_cast<cudaStream_t>(stream)>>>(
      rows, cols, a, sums);
  return launched();
}

const char* softmax_cross_entropy(int device, void* stream, int64_t rows, int classes,
                                  const float* logits, const int32_t* labels, float* delta,
                                  double* scratch, float* totals) {
  on_device guard(device);
  if (guard.error() != cudaSuccess)
    return cudaGetErrorString(guard.error());
  auto s = static_cast<cudaStream_t>(stream);
  if (rows > 0) {
    softmax_rows_kernel<<<blocks_for(rows, 128), 128, 0, s>>>(rows, classes, logits, labels, delta,
                                                              scratch, scratch + rows);
    if (const char* e = launched())
      return e;
  }
  // Also for 0 rows: the totals are then zeros.
  totals_kernel<<<1, totals_threads, 0, s>>>(rows, scratch, scratch + rows, totals);
  return launched();
}

} // namespace consort::train::kernels
