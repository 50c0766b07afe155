// The CUDA kernels of device/cuda/kernels.hpp: element-wise reduction, reduction along an axis,
// division, fill and concatenation, bitwise equal to the host kernels of device/cpu_kernels.cpp.
//
// Exactness. Every combining step is element_ops.hpp's own function (compiled for the device via
// CONSORT_DEVICE_HOST_DEVICE), applied to the same operands in the same order as the host: each
// output element is one thread's sequential fold over the inputs (or along the axis), kept in the
// accumulator type A, exactly as the host stores each pass into `out` as A. Floating point needs
// the device to round every operation separately as the host's SSE code does: this file is built
// with -fmad=false (set in CMakeLists.txt), so nvcc never contracts a multiply and an add into one
// FMA; -prec-div=true (IEEE division, as the host's `/`) and -ftz=false (keep denormals) are set
// there too, so a global --use_fast_math cannot change them. (No kernel here even has the a*b+c
// shape: MEAN adds, then multiplies the finished sum; -fmad=false makes that a rule, not luck.)
// The only re-association is in `axis_rows_kernel`, for integer SUM/PROD/MIN/MAX, where wrapping
// arithmetic and integer order make every association give the same bits.
//
// Speed. Grid-stride loops of 256 threads over at most 8 blocks per SM; 16-byte vector loads and
// stores when every pointer is 16-byte aligned (and the axis extent is a multiple of the vector);
// the input pointers travel by value in the kernel's parameters (`input_array`, 8 at most: more
// inputs are chained through `out`, which keeps the element order).
//
// float16 and bfloat16 (CUDA's __half and __nv_bfloat16, the same bits as consort::float16_t and
// bfloat16_t) are accumulated in float and rounded once to their type when stored (the kernels
// carry an accumulator type A and a stored type O), as the host kernels do; more than 8 of them
// are chained through a float buffer, so the rounding still happens once.

#include "device/cuda/kernels.hpp"

#include "device/cuda/runtime.hpp"
#include "device/element_ops.hpp"

#include <consort/error.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

namespace consort::cuda {

namespace {

using consort::detail::max_fn;
using consort::detail::min_fn;
using consort::detail::prod_fn;
using consort::detail::sum_fn;

constexpr int threads_per_block = 256;

/// Inputs per element-wise pass; a 9th input starts a second pass that reads `out` back.
constexpr int max_inputs = 8;

/// Inputs per concatenation launch; later inputs go to further launches (disjoint columns).
constexpr int max_concat_inputs = 16;

/// Integer rows at least this long are reduced by a whole block each (a tree, exact for integers).
constexpr int64_t row_tree_min_extent = 4 * threads_per_block;

/// N elements loaded or stored as one 16-byte access (or as 16-byte pieces when N * sizeof(T) is
/// larger, as for the float64 output of MEAN over 16 uint8 inputs).
template <class T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) vec {
  T v[N];
};

/// Elements of T per 16 bytes.
template <class T>
constexpr int lanes = static_cast<int>(16 / sizeof(T));

/// The device pointers of one pass, passed by value in the kernel's parameter space.
template <class T>
struct input_array {
  const T* p[max_inputs];
};

struct concat_args {
  const unsigned char* src[max_concat_inputs];
  /// Column (in units) where input i starts within this launch's columns; begin[count] = width.
  int64_t begin[max_concat_inputs + 1];
  int count;
};

// -- kernels --------------------------------------------------------------------------------------

/// One pass of the element-wise reduction over `count` inputs: out[j] = (first ? A(in[0][j]) :
/// out[j]) op A(in[i][j]) ..., times `scale` when `scaled`. Vectors of N elements, then a scalar
/// tail.
template <class Op, class T, class A, class O, int N>
__global__ void __launch_bounds__(threads_per_block)
    reduce_kernel(input_array<T> in, int count, O* out, int64_t n, bool first, bool scaled,
                  A scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = n / N;
  for (int64_t v = tid; v < vectors; v += stride) {
    vec<A, N> acc;
    int i = 0;
    if (first) {
      const auto a = reinterpret_cast<const vec<T, N>*>(in.p[0])[v];
#pragma unroll
      for (int e = 0; e < N; ++e)
        acc.v[e] = static_cast<A>(a.v[e]);
      i = 1;
    } else {
      const auto o = reinterpret_cast<const vec<O, N>*>(out)[v];
#pragma unroll
      for (int e = 0; e < N; ++e)
        acc.v[e] = static_cast<A>(o.v[e]);
    }
    // Fully unrolled so that every in.p[i] is a constant index: the pointers are then read from
    // the parameter bank, where a dynamic index would copy the array to local memory first.
#pragma unroll
    for (int slot = 0; slot < max_inputs; ++slot) {
      if (slot < i)
        continue;
      if (slot >= count)
        break;
      const auto c = reinterpret_cast<const vec<T, N>*>(in.p[slot])[v];
#pragma unroll
      for (int e = 0; e < N; ++e)
        acc.v[e] = Op::apply(acc.v[e], static_cast<A>(c.v[e]));
    }
    if (scaled) {
#pragma unroll
      for (int e = 0; e < N; ++e)
        acc.v[e] = acc.v[e] * scale;
    }
    vec<O, N> stored;
#pragma unroll
    for (int e = 0; e < N; ++e)
      stored.v[e] = static_cast<O>(acc.v[e]);
    reinterpret_cast<vec<O, N>*>(out)[v] = stored;
  }
  for (int64_t j = vectors * N + tid; j < n; j += stride) {
    A acc = first ? static_cast<A>(in.p[0][j]) : static_cast<A>(out[j]);
#pragma unroll
    for (int slot = first ? 1 : 0; slot < max_inputs; ++slot) {
      if (slot >= count)
        break;
      acc = Op::apply(acc, static_cast<A>(in.p[slot][j]));
    }
    out[j] = static_cast<O>(scaled ? acc * scale : acc);
  }
}

/// Reduces [outer, k, inner] along k, one thread per N adjacent outputs (`inner` counted in
/// vectors of N), folding i = 0..k-1 in order as the host does; divides by `divisor` before
/// storing when `divided` (for the 16-bit floats, whose MEAN is divided in float before rounding).
template <class Op, class T, class A, class O, int N>
__global__ void __launch_bounds__(threads_per_block)
    axis_kernel(const T* in, O* out, int64_t outer, int64_t k, int64_t inner, bool divided,
                A divisor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t total = outer * inner;
  const auto* src = reinterpret_cast<const vec<T, N>*>(in);
  auto* dst = reinterpret_cast<vec<O, N>*>(out);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t o = idx / inner;
    const auto* p = src + o * k * inner + (idx - o * inner);
    const auto a = p[0];
    vec<A, N> acc;
#pragma unroll
    for (int e = 0; e < N; ++e)
      acc.v[e] = static_cast<A>(a.v[e]);
    for (int64_t i = 1; i < k; ++i) {
      const auto c = p[i * inner];
#pragma unroll
      for (int e = 0; e < N; ++e)
        acc.v[e] = Op::apply(acc.v[e], static_cast<A>(c.v[e]));
    }
    vec<O, N> stored;
#pragma unroll
    for (int e = 0; e < N; ++e)
      stored.v[e] = static_cast<O>(divided ? acc.v[e] / divisor : acc.v[e]);
    dst[idx] = stored;
  }
}

/// Reduces contiguous integer rows of `k` >= blockDim.x elements, one block per row: each thread
/// folds a strided subset, then the block combines the partials as a tree. Only for integer
/// SUM/PROD/MIN/MAX, where any association gives the host's bits (wrapping arithmetic is
/// associative and commutative; min/max of integers select equal values).
template <class Op, class T>
__global__ void __launch_bounds__(threads_per_block)
    axis_rows_kernel(const T* in, T* out, int64_t outer, int64_t k) {
  __shared__ T partial[threads_per_block];
  for (int64_t o = blockIdx.x; o < outer; o += gridDim.x) {
    const T* row = in + o * k;
    T acc = row[threadIdx.x];
    for (int64_t i = threadIdx.x + blockDim.x; i < k; i += blockDim.x)
      acc = Op::apply(acc, row[i]);
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s /= 2) {
      if (threadIdx.x < s)
        partial[threadIdx.x] = Op::apply(partial[threadIdx.x], partial[threadIdx.x + s]);
      __syncthreads();
    }
    if (threadIdx.x == 0)
      out[o] = partial[0];
    __syncthreads(); // `partial` is reused by the next row
  }
}

/// data[j] = data[j] / divisor (IEEE division: -prec-div=true), computed in A (float for the
/// 16-bit floats) and rounded once to T.
template <class T, class A, int N>
__global__ void __launch_bounds__(threads_per_block) divide_kernel(T* data, int64_t n, A divisor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = n / N;
  auto* v = reinterpret_cast<vec<T, N>*>(data);
  for (int64_t i = tid; i < vectors; i += stride) {
    auto x = v[i];
#pragma unroll
    for (int e = 0; e < N; ++e)
      x.v[e] = static_cast<T>(static_cast<A>(x.v[e]) / divisor);
    v[i] = x;
  }
  for (int64_t j = vectors * N + tid; j < n; j += stride)
    data[j] = static_cast<T>(static_cast<A>(data[j]) / divisor);
}

/// out[j] = alpha * a[j] + beta * b[j] for the elements [tid, n) in steps of `stride`, computed in
/// A (float for the 16-bit floats) with each operation rounded (-fmad=false) and rounded once to
/// T. `out` may be `a` or `b`: each element is read before it is written, by the same thread.
template <class T, class A, int N>
__device__ void scaled_sum_range(A alpha, const T* a, A beta, const T* b, T* out, int64_t n,
                                 int64_t tid, int64_t stride) {
  const int64_t vectors = n / N;
  const auto* va = reinterpret_cast<const vec<T, N>*>(a);
  const auto* vb = reinterpret_cast<const vec<T, N>*>(b);
  auto* vo = reinterpret_cast<vec<T, N>*>(out);
  for (int64_t i = tid; i < vectors; i += stride) {
    const auto x = va[i];
    const auto y = vb[i];
    vec<T, N> z;
#pragma unroll
    for (int e = 0; e < N; ++e)
      z.v[e] = static_cast<T>(alpha * static_cast<A>(x.v[e]) + beta * static_cast<A>(y.v[e]));
    vo[i] = z;
  }
  for (int64_t j = vectors * N + tid; j < n; j += stride)
    out[j] = static_cast<T>(alpha * static_cast<A>(a[j]) + beta * static_cast<A>(b[j]));
}

template <class T, class A, int N>
__global__ void __launch_bounds__(threads_per_block)
    scaled_sum_kernel(A alpha, const T* a, A beta, const T* b, T* out, int64_t n) {
  scaled_sum_range<T, A, N>(alpha, a, beta, b, out, n,
                            static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                            static_cast<int64_t>(gridDim.x) * blockDim.x);
}

/// Buffers of one scaled_sum_many launch, passed by value in the kernel's parameter space.
constexpr int max_scaled_buffers = 16;
template <class T>
struct scaled_buffers {
  const T* a[max_scaled_buffers];
  const T* b[max_scaled_buffers];
  T* out[max_scaled_buffers];
  int64_t n[max_scaled_buffers];
};

/// scaled_sum_range over buffer blockIdx.y of `buffers`, with the grid's x dimension.
template <class T, class A, int N>
__global__ void __launch_bounds__(threads_per_block)
    scaled_sum_many_kernel(A alpha, A beta, scaled_buffers<T> buffers) {
  const int t = static_cast<int>(blockIdx.y);
  scaled_sum_range<T, A, N>(alpha, buffers.a[t], beta, buffers.b[t], buffers.out[t], buffers.n[t],
                            static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                            static_cast<int64_t>(gridDim.x) * blockDim.x);
}

template <class T, int N>
__global__ void __launch_bounds__(threads_per_block) fill_kernel(T* data, int64_t n, T value) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t vectors = n / N;
  vec<T, N> x;
#pragma unroll
  for (int e = 0; e < N; ++e)
    x.v[e] = value;
  auto* v = reinterpret_cast<vec<T, N>*>(data);
  for (int64_t i = tid; i < vectors; i += stride)
    v[i] = x;
  for (int64_t j = vectors * N + tid; j < n; j += stride)
    data[j] = value;
}

/// out[j] = To(in[j]): rounds a float accumulator buffer once to a 16-bit float.
template <class From, class To>
__global__ void __launch_bounds__(threads_per_block)
    convert_kernel(const From* in, To* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += stride)
    out[j] = static_cast<To>(in[j]);
}

/// Copies columns [col0, col0 + width) of every output row (`row` units wide) from the inputs of
/// `args`, in units U. The flat index over outer x width advances by the grid stride, split on the
/// host into whole rows (`stride_rows`) and columns (`stride_cols`), so no thread divides in its
/// loop.
template <class U>
__global__ void __launch_bounds__(threads_per_block)
    concat_kernel(concat_args args, U* out, int64_t outer, int64_t row, int64_t col0, int64_t width,
                  int64_t stride_rows, int64_t stride_cols) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t r = tid / width;
  int64_t c = tid - r * width;
  for (; r < outer;) {
    int i = 0;
    while (c >= args.begin[i + 1])
      ++i;
    const int64_t extent = args.begin[i + 1] - args.begin[i];
    const auto* src = reinterpret_cast<const U*>(args.src[i]);
    out[r * row + col0 + c] = src[r * extent + (c - args.begin[i])];
    r += stride_rows;
    c += stride_cols;
    if (c >= width) {
      c -= width;
      ++r;
    }
  }
}

// -- launch helpers -------------------------------------------------------------------------------

/// Makes the stream's device current for the launches of one call (a stream takes work only from
/// its own device) and remembers the device for grid sizes and messages.
class launch_scope {
public:
  explicit launch_scope(cudaStream_t stream) {
    if (stream != nullptr) {
      check(cudaStreamGetDevice(stream, &device_), "cudaStreamGetDevice");
    } else {
      check(cudaGetDevice(&device_), "cudaGetDevice");
    }
    guard_.emplace(device_);
    sm_count_ = sm_count(device_);
  }

  int device() const noexcept { return device_; }

  /// Blocks for `work` items of one thread each: enough for the work, at most 8 per SM (2048
  /// resident threads of 256 on every SM of sm_90; the grid-stride loops cover the rest).
  unsigned blocks(int64_t work) const {
    const int64_t needed = (work + threads_per_block - 1) / threads_per_block;
    const int64_t most = static_cast<int64_t>(sm_count_) * 8;
    return static_cast<unsigned>(needed < 1 ? 1 : (needed < most ? needed : most));
  }

  /// Throws the launch's error, if any, naming `kernel`.
  void check_launch(const char* kernel) const {
    check(cudaGetLastError(), (std::string{"launch of "} + kernel).c_str(), device_);
  }

private:
  static int sm_count(int device) {
    // Asked once per device: an attribute query is cheap but not free, and launches are hot.
    constexpr int cached_devices = 64;
    static std::atomic<int> counts[cached_devices]; // zero (static storage): not asked yet
    if (device < cached_devices) {
      const int n = counts[device].load(std::memory_order_relaxed);
      if (n > 0)
        return n;
    }
    int n = 0;
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
          "cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount)", device);
    if (device < cached_devices)
      counts[device].store(n, std::memory_order_relaxed);
    return n > 0 ? n : 1;
  }

  int device_ = 0;
  int sm_count_ = 1;
  std::optional<device_guard> guard_; // engaged in the constructor (a guard cannot move)
};

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <class T>
struct type_tag {
  using type = T;
};

/// Calls `fn(type_tag<T>{})` for the C++ type of `t`; bool is rejected, as by the host kernels.
template <class F>
void visit_numeric(dtype t, const char* what, F&& fn) {
  switch (t) {
  case dtype::float32:
    return fn(type_tag<float>{});
  case dtype::float64:
    return fn(type_tag<double>{});
  case dtype::int32:
    return fn(type_tag<int32_t>{});
  case dtype::int64:
    return fn(type_tag<int64_t>{});
  case dtype::uint8:
    return fn(type_tag<uint8_t>{});
  case dtype::float16:
    return fn(type_tag<__half>{});
  case dtype::bfloat16:
    return fn(type_tag<__nv_bfloat16>{});
  case dtype::boolean:
    break;
  }
  throw_error(errc::dtype_mismatch, std::string{what} +
                                        ": bool tensors are not supported on the GPU; cast to "
                                        "int32 first");
}

/// Calls `fn(Op{})` for the combining function of `op` (MEAN combines by summing).
template <class F>
void visit_op(reduce_op op, F&& fn) {
  switch (op) {
  case reduce_op::sum:
  case reduce_op::mean:
    return fn(sum_fn{});
  case reduce_op::min:
    return fn(min_fn{});
  case reduce_op::max:
    return fn(max_fn{});
  case reduce_op::prod:
    return fn(prod_fn{});
  }
}

/// Whether T is one of the 16-bit floats, accumulated in float and stored as T.
template <class T>
constexpr bool is_half_v = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

/// The accumulator type of MEAN over T: T for floats, float for the 16-bit floats, double for
/// integers.
template <class T>
using mean_acc_t = std::conditional_t<std::is_floating_point_v<T>, T,
                                      std::conditional_t<is_half_v<T>, float, double>>;

/// The output type of MEAN over T: double for integers, else T.
template <class T>
using mean_out_t = std::conditional_t<std::is_integral_v<T>, double, T>;

template <class Op, class T, class A, class O>
void run_reduce(const launch_scope& scope, const void* const* inputs, int count, O* out, int64_t n,
                bool scaled, A scale, cudaStream_t stream) {
  bool vectorised = aligned16(out);
  for (int i = 0; i < count; ++i)
    vectorised = vectorised && aligned16(inputs[i]);
  constexpr int N = lanes<T>;
  const unsigned blocks = scope.blocks(vectorised ? (n + N - 1) / N : n);
  for (int base = 0; base < count; base += max_inputs) {
    const int m = count - base < max_inputs ? count - base : max_inputs;
    input_array<T> in{};
    for (int i = 0; i < m; ++i)
      in.p[i] = static_cast<const T*>(inputs[base + i]);
    const bool first = base == 0;
    const bool last_scaled = scaled && base + m == count;
    if (vectorised)
      reduce_kernel<Op, T, A, O, N>
          <<<blocks, threads_per_block, 0, stream>>>(in, m, out, n, first, last_scaled, scale);
    else
      reduce_kernel<Op, T, A, O, 1>
          <<<blocks, threads_per_block, 0, stream>>>(in, m, out, n, first, last_scaled, scale);
    scope.check_launch("reduce_elementwise's kernel");
  }
}

/// Reduces 16-bit floats (T) through a float buffer when more than one pass is needed, so that
/// they are rounded to T once: the passes accumulate in the buffer, one kernel rounds it to `out`.
template <class Op, class T>
void run_reduce_half(const launch_scope& scope, const void* const* inputs, int count, T* out,
                     int64_t n, bool scaled, float scale, cudaStream_t stream) {
  if (count <= max_inputs) {
    run_reduce<Op, T, float, T>(scope, inputs, count, out, n, scaled, scale, stream);
    return;
  }
  const auto bytes = static_cast<size_t>(n) * sizeof(float);
  auto* acc = static_cast<float*>(allocate(scope.device(), bytes));
  try {
    run_reduce<Op, T, float, float>(scope, inputs, count, acc, n, scaled, scale, stream);
    convert_kernel<float, T><<<scope.blocks(n), threads_per_block, 0, stream>>>(acc, out, n);
    scope.check_launch("reduce_elementwise's rounding kernel");
  } catch (...) {
    release(scope.device(), acc, bytes, stream);
    throw;
  }
  release(scope.device(), acc, bytes, stream);
}

template <class Op, class T, class A, class O>
void run_axis(const launch_scope& scope, const T* in, O* out, int64_t outer, int64_t k,
              int64_t inner, bool divided, A divisor, cudaStream_t stream) {
  if constexpr (std::is_integral_v<A> && std::is_same_v<A, O>) {
    if (inner == 1 && k >= row_tree_min_extent) {
      const auto rows = static_cast<unsigned>(outer < 65535 * 16 ? outer : 65535 * 16);
      axis_rows_kernel<Op, T><<<rows, threads_per_block, 0, stream>>>(in, out, outer, k);
      scope.check_launch("reduce_axis's row kernel");
      return;
    }
  }
  constexpr int N = lanes<T>;
  if (inner % N == 0 && aligned16(in) && aligned16(out)) {
    const int64_t units = inner / N;
    axis_kernel<Op, T, A, O, N><<<scope.blocks(outer * units), threads_per_block, 0, stream>>>(
        in, out, outer, k, units, divided, divisor);
  } else {
    axis_kernel<Op, T, A, O, 1><<<scope.blocks(outer * inner), threads_per_block, 0, stream>>>(
        in, out, outer, k, inner, divided, divisor);
  }
  scope.check_launch("reduce_axis's kernel");
}

template <class T, class A>
void run_divide(const launch_scope& scope, T* data, int64_t n, A divisor, cudaStream_t stream) {
  constexpr int N = lanes<T>;
  if (aligned16(data))
    divide_kernel<T, A, N>
        <<<scope.blocks((n + N - 1) / N), threads_per_block, 0, stream>>>(data, n, divisor);
  else
    divide_kernel<T, A, 1><<<scope.blocks(n), threads_per_block, 0, stream>>>(data, n, divisor);
  scope.check_launch("divide's kernel");
}

void divide_on(const launch_scope& scope, dtype type, void* data, int64_t n, double divisor,
               cudaStream_t stream) {
  // As the host's divide_in_place: float32 divides by the divisor rounded to float, and the
  // 16-bit floats divide in float and round once.
  if (type == dtype::float32)
    run_divide(scope, static_cast<float*>(data), n, static_cast<float>(divisor), stream);
  else if (type == dtype::float16)
    run_divide(scope, static_cast<__half*>(data), n, static_cast<float>(divisor), stream);
  else if (type == dtype::bfloat16)
    run_divide(scope, static_cast<__nv_bfloat16*>(data), n, static_cast<float>(divisor), stream);
  else
    run_divide(scope, static_cast<double*>(data), n, divisor, stream);
}

template <class U>
void run_concat(const launch_scope& scope, const concat_args& args, void* out, int64_t outer,
                int64_t row, int64_t col0, int64_t width, cudaStream_t stream) {
  const int64_t work = outer * width;
  const unsigned blocks = scope.blocks(work);
  const int64_t stride = static_cast<int64_t>(blocks) * threads_per_block;
  concat_kernel<U><<<blocks, threads_per_block, 0, stream>>>(
      args, static_cast<U*>(out), outer, row, col0, width, stride / width, stride % width);
  scope.check_launch("concat's kernel");
}

std::string dtype_text(dtype t) {
  return to_string(t);
}

/// Rejects bool before anything touches the device, as the host kernels do.
void reject_bool(dtype type, const char* what) {
  if (type == dtype::boolean)
    throw_error(errc::dtype_mismatch,
                std::string{what} + ": bool tensors are not reduced; cast to int32 first");
}

} // namespace

// -- public kernels -------------------------------------------------------------------------------

void reduce_elementwise(dtype type, reduce_op op, const void* const* inputs, int count, void* out,
                        int64_t n, double mean_divisor, cudaStream_t stream) {
  reject_bool(type, "cuda::reduce_elementwise");
  if (count < 1 || inputs == nullptr)
    throw_error(errc::invalid_argument,
                "cuda::reduce_elementwise needs at least one input; got " + std::to_string(count));
  if (n < 0)
    throw_error(errc::invalid_argument, "cuda::reduce_elementwise: the element count is " +
                                            std::to_string(n) + "; expected >= 0");
  if (op == reduce_op::mean && !(mean_divisor > 0 && std::isfinite(mean_divisor)))
    throw_error(errc::invalid_argument,
                "cuda::reduce_elementwise: the MEAN divisor must be a positive finite number; "
                "got " +
                    std::to_string(mean_divisor));
  if (n == 0)
    return;
  for (int i = 0; i < count; ++i)
    if (inputs[i] == nullptr)
      throw_error(errc::invalid_argument,
                  "cuda::reduce_elementwise: input " + std::to_string(i) + " is null");
  if (out == nullptr)
    throw_error(errc::invalid_argument, "cuda::reduce_elementwise: the output is null");
  launch_scope scope{stream};
  visit_numeric(type, "cuda::reduce_elementwise", [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_op(op, [&](auto fn) {
      using Op = decltype(fn);
      if constexpr (is_half_v<T>) {
        if (op != reduce_op::mean && count == 1) {
          if (out != inputs[0])
            check(cudaMemcpyAsync(out, inputs[0], static_cast<size_t>(n) * sizeof(T),
                                  cudaMemcpyDeviceToDevice, stream),
                  "cudaMemcpyAsync (reduce_elementwise of one input)", scope.device());
          return;
        }
        // As the host: accumulated in float, MEAN's reciprocal folded into the last pass.
        const bool mean = op == reduce_op::mean;
        run_reduce_half<Op, T>(scope, inputs, count, static_cast<T*>(out), n, mean,
                               mean ? static_cast<float>(1.0 / mean_divisor) : 0.0f, stream);
      } else if (op == reduce_op::mean) {
        using A = mean_acc_t<T>;
        using O = mean_out_t<T>;
        if (!std::is_same_v<O, T> && out == inputs[0])
          throw_error(errc::invalid_argument,
                      "cuda::reduce_elementwise: MEAN of " + dtype_text(type) +
                          " writes float64, so the output may not alias input 0");
        // As the host: the division is folded into the last pass as a multiplication by the
        // reciprocal rounded to A.
        run_reduce<Op, T, A, O>(scope, inputs, count, static_cast<O*>(out), n, true,
                                static_cast<A>(1.0 / mean_divisor), stream);
      } else if (count == 1) {
        // One input reduced with anything but MEAN is itself.
        if (out != inputs[0])
          check(cudaMemcpyAsync(out, inputs[0], static_cast<size_t>(n) * sizeof(T),
                                cudaMemcpyDeviceToDevice, stream),
                "cudaMemcpyAsync (reduce_elementwise of one input)", scope.device());
      } else {
        run_reduce<Op, T, T, T>(scope, inputs, count, static_cast<T*>(out), n, false, T{}, stream);
      }
    });
  });
}

void reduce_axis(dtype type, reduce_op op, const void* in, void* out, int64_t outer, int64_t k,
                 int64_t inner, double divisor, cudaStream_t stream) {
  reject_bool(type, "cuda::reduce_axis");
  if (k < 1 || outer < 0 || inner < 0)
    throw_error(errc::invalid_argument,
                "cuda::reduce_axis of a [" + std::to_string(outer) + ", " + std::to_string(k) +
                    ", " + std::to_string(inner) +
                    "] view: expected outer >= 0, k >= 1 and inner >= 0 (an empty axis is "
                    "handled by the caller)");
  if (outer == 0 || inner == 0)
    return;
  if (in == nullptr || out == nullptr)
    throw_error(errc::invalid_argument, "cuda::reduce_axis: the input or the output is null");
  launch_scope scope{stream};
  visit_numeric(type, "cuda::reduce_axis", [&](auto tag) {
    using T = typename decltype(tag)::type;
    visit_op(op, [&](auto fn) {
      using Op = decltype(fn);
      const auto* src = static_cast<const T*>(in);
      if constexpr (is_half_v<T>) {
        // Accumulated and divided in float, rounded once (the host reduces them in float32).
        const bool divided = op == reduce_op::mean && divisor > 0;
        run_axis<Op, T, float, T>(scope, src, static_cast<T*>(out), outer, k, inner, divided,
                                  static_cast<float>(divisor), stream);
      } else if (op == reduce_op::mean) {
        using A = mean_acc_t<T>;
        using O = mean_out_t<T>;
        run_axis<Op, T, A, O>(scope, src, static_cast<O*>(out), outer, k, inner, false, A{},
                              stream);
      } else {
        run_axis<Op, T, T, T>(scope, src, static_cast<T*>(out), outer, k, inner, false, T{},
                              stream);
      }
    });
  });
  if (op == reduce_op::mean && divisor > 0 && !is_half(type))
    divide_on(scope, is_floating(type) ? type : dtype::float64, out, outer * inner, divisor,
              stream);
}

void divide(dtype type, void* data, int64_t n, double divisor, cudaStream_t stream) {
  if (!is_floating(type))
    throw_error(errc::dtype_mismatch, "cuda::divide of a " + dtype_text(type) +
                                          " buffer: expected float32, float64, float16 or "
                                          "bfloat16");
  if (n < 0)
    throw_error(errc::invalid_argument,
                "cuda::divide: the element count is " + std::to_string(n) + "; expected >= 0");
  if (n == 0)
    return;
  if (data == nullptr)
    throw_error(errc::invalid_argument, "cuda::divide: the buffer is null");
  launch_scope scope{stream};
  divide_on(scope, type, data, n, divisor, stream);
}

namespace {

/// Calls `fn(type_tag<T>{}, A{})` for the floating dtype `type`: T its device type, A the type its
/// scaled sums compute in. @throws error(dtype_mismatch) for another dtype, naming `what`.
template <class F>
void visit_floating(dtype type, const char* what, F&& fn) {
  switch (type) {
  case dtype::float32:
    return fn(type_tag<float>{}, float{});
  case dtype::float64:
    return fn(type_tag<double>{}, double{});
  case dtype::float16:
    return fn(type_tag<__half>{}, float{});
  case dtype::bfloat16:
    return fn(type_tag<__nv_bfloat16>{}, float{});
  default:
    break;
  }
  throw_error(errc::dtype_mismatch, std::string{what} + " of " + dtype_text(type) +
                                        " buffers: expected float32, float64, float16 or "
                                        "bfloat16");
}

} // namespace

void scaled_sum(dtype type, double alpha, const void* a, double beta, const void* b, void* out,
                int64_t n, cudaStream_t stream) {
  visit_floating(type, "cuda::scaled_sum", [](auto, auto) {});
  if (n < 0)
    throw_error(errc::invalid_argument,
                "cuda::scaled_sum: the element count is " + std::to_string(n) + "; expected >= 0");
  if (n == 0)
    return;
  if (a == nullptr || b == nullptr || out == nullptr)
    throw_error(errc::invalid_argument, "cuda::scaled_sum: a buffer is null (a, b and out must "
                                        "all be device pointers)");
  launch_scope scope{stream};
  visit_floating(type, "cuda::scaled_sum", [&](auto tag, auto acc) {
    using T = typename decltype(tag)::type;
    using A = decltype(acc);
    const auto* pa = static_cast<const T*>(a);
    const auto* pb = static_cast<const T*>(b);
    auto* po = static_cast<T*>(out);
    constexpr int N = lanes<T>;
    if (aligned16(pa) && aligned16(pb) && aligned16(po))
      scaled_sum_kernel<T, A, N><<<scope.blocks((n + N - 1) / N), threads_per_block, 0, stream>>>(
          static_cast<A>(alpha), pa, static_cast<A>(beta), pb, po, n);
    else
      scaled_sum_kernel<T, A, 1><<<scope.blocks(n), threads_per_block, 0, stream>>>(
          static_cast<A>(alpha), pa, static_cast<A>(beta), pb, po, n);
    scope.check_launch("scaled_sum's kernel");
  });
}

void scaled_sum_many(dtype type, double alpha, const void* const* a, double beta,
                     const void* const* b, void* const* out, const int64_t* n, int count,
                     cudaStream_t stream) {
  visit_floating(type, "cuda::scaled_sum_many", [](auto, auto) {});
  if (count < 0 || (count > 0 && (a == nullptr || b == nullptr || out == nullptr || n == nullptr)))
    throw_error(errc::invalid_argument,
                "cuda::scaled_sum_many of " + std::to_string(count) +
                    " buffers: expected count >= 0 and host arrays of a, b, out and n");
  bool work = false;
  for (int t = 0; t < count; ++t) {
    if (n[t] < 0)
      throw_error(errc::invalid_argument, "cuda::scaled_sum_many: buffer " + std::to_string(t) +
                                              " has " + std::to_string(n[t]) +
                                              " elements; expected >= 0");
    if (n[t] > 0 && (a[t] == nullptr || b[t] == nullptr || out[t] == nullptr))
      throw_error(errc::invalid_argument,
                  "cuda::scaled_sum_many: a pointer of buffer " + std::to_string(t) + " is null");
    work = work || n[t] > 0;
  }
  if (!work)
    return;
  launch_scope scope{stream};
  visit_floating(type, "cuda::scaled_sum_many", [&](auto tag, auto acc) {
    using T = typename decltype(tag)::type;
    using A = decltype(acc);
    constexpr int N = lanes<T>;
    // Buffers with elements, max_scaled_buffers per launch (blockIdx.y picks one); vectors of N
    // when every pointer of the launch is 16-byte aligned.
    scaled_buffers<T> args{};
    int held = 0;
    int64_t largest = 0;
    bool aligned = true;
    auto launch = [&] {
      if (held == 0)
        return;
      const dim3 grid{aligned ? scope.blocks((largest + N - 1) / N) : scope.blocks(largest),
                      static_cast<unsigned>(held)};
      if (aligned)
        scaled_sum_many_kernel<T, A, N><<<grid, threads_per_block, 0, stream>>>(
            static_cast<A>(alpha), static_cast<A>(beta), args);
      else
        scaled_sum_many_kernel<T, A, 1><<<grid, threads_per_block, 0, stream>>>(
            static_cast<A>(alpha), static_cast<A>(beta), args);
      scope.check_launch("scaled_sum_many's kernel");
      args = scaled_buffers<T>{};
      held = 0;
      largest = 0;
      aligned = true;
    };
    for (int t = 0; t < count; ++t) {
      if (n[t] == 0)
        continue;
      args.a[held] = static_cast<const T*>(a[t]);
      args.b[held] = static_cast<const T*>(b[t]);
      args.out[held] = static_cast<T*>(out[t]);
      args.n[held] = n[t];
      aligned = aligned && aligned16(a[t]) && aligned16(b[t]) && aligned16(out[t]);
      largest = n[t] > largest ? n[t] : largest;
      if (++held == max_scaled_buffers)
        launch();
    }
    launch();
  });
}

void fill(dtype type, void* data, int64_t n, double value, cudaStream_t stream) {
  reject_bool(type, "cuda::fill");
  if (n < 0)
    throw_error(errc::invalid_argument,
                "cuda::fill: the element count is " + std::to_string(n) + "; expected >= 0");
  if (n == 0)
    return;
  if (data == nullptr)
    throw_error(errc::invalid_argument, "cuda::fill: the buffer is null");
  launch_scope scope{stream};
  visit_numeric(type, "cuda::fill", [&](auto tag) {
    using T = typename decltype(tag)::type;
    // Converted on the host, as the host's `filled` converts (the 16-bit floats through float).
    T v{};
    if constexpr (is_half_v<T>)
      v = static_cast<T>(static_cast<float>(value));
    else
      v = static_cast<T>(value);
    auto* p = static_cast<T*>(data);
    constexpr int N = lanes<T>;
    if (aligned16(p))
      fill_kernel<T, N><<<scope.blocks((n + N - 1) / N), threads_per_block, 0, stream>>>(p, n, v);
    else
      fill_kernel<T, 1><<<scope.blocks(n), threads_per_block, 0, stream>>>(p, n, v);
    scope.check_launch("fill's kernel");
  });
}

void concat(const void* const* inputs, const size_t* row_bytes, int count, void* out, int64_t outer,
            cudaStream_t stream) {
  if (count < 0 || outer < 0 || (count > 0 && (inputs == nullptr || row_bytes == nullptr)))
    throw_error(errc::invalid_argument, "cuda::concat of " + std::to_string(count) +
                                            " inputs over " + std::to_string(outer) +
                                            " rows: expected count >= 0, outer >= 0 and arrays "
                                            "for the inputs and their row sizes");
  size_t row = 0;
  for (int i = 0; i < count; ++i) {
    if (row_bytes[i] > 0 && inputs[i] == nullptr)
      throw_error(errc::invalid_argument, "cuda::concat: input " + std::to_string(i) +
                                              " is null but contributes " +
                                              std::to_string(row_bytes[i]) + " bytes per row");
    row += row_bytes[i];
  }
  if (outer == 0 || row == 0)
    return;
  if (out == nullptr)
    throw_error(errc::invalid_argument, "cuda::concat: the output is null");
  launch_scope scope{stream};
  if (outer == 1) {
    // One row: each input is one contiguous block, which the copy engine moves best.
    size_t offset = 0;
    for (int i = 0; i < count; ++i) {
      if (row_bytes[i] == 0)
        continue;
      check(cudaMemcpyAsync(static_cast<unsigned char*>(out) + offset, inputs[i], row_bytes[i],
                            cudaMemcpyDeviceToDevice, stream),
            ("cudaMemcpyAsync (concat, input " + std::to_string(i) + ")").c_str(), scope.device());
      offset += row_bytes[i];
    }
    return;
  }
  // The widest unit (16, 8, 4, 2 or 1 bytes) that divides every address and every row size.
  uintptr_t bits = reinterpret_cast<uintptr_t>(out) | 16;
  for (int i = 0; i < count; ++i)
    if (row_bytes[i] > 0)
      bits |= reinterpret_cast<uintptr_t>(inputs[i]) | row_bytes[i];
  const size_t unit = static_cast<size_t>(bits & (~bits + 1));
  const auto launch = [&](const concat_args& args, int64_t col0, int64_t width) {
    const auto units_row = static_cast<int64_t>(row / unit);
    switch (unit) {
    case 16:
      return run_concat<uint4>(scope, args, out, outer, units_row, col0, width, stream);
    case 8:
      return run_concat<uint2>(scope, args, out, outer, units_row, col0, width, stream);
    case 4:
      return run_concat<uint32_t>(scope, args, out, outer, units_row, col0, width, stream);
    case 2:
      return run_concat<uint16_t>(scope, args, out, outer, units_row, col0, width, stream);
    default:
      return run_concat<uint8_t>(scope, args, out, outer, units_row, col0, width, stream);
    }
  };
  concat_args args{};
  int64_t col0 = 0;  // first column (units) of the current launch
  int64_t width = 0; // columns of the current launch
  for (int i = 0; i < count; ++i) {
    if (row_bytes[i] == 0)
      continue;
    args.src[args.count] = static_cast<const unsigned char*>(inputs[i]);
    args.begin[args.count] = width;
    width += static_cast<int64_t>(row_bytes[i] / unit);
    ++args.count;
    if (args.count == max_concat_inputs) {
      args.begin[args.count] = width;
      launch(args, col0, width);
      col0 += width;
      width = 0;
      args = concat_args{};
    }
  }
  if (args.count > 0) {
    args.begin[args.count] = width;
    launch(args, col0, width);
  }
}

} // namespace consort::cuda
