#pragma once

// The kernels the runtime itself runs on a GPU: element-wise reduction of replica tensors (every
// reduce op and numeric dtype), MEAN's division, reduction along an axis, and concatenation for a
// ragged all_gather. Private to consort; compiled only when CONSORT_WITH_CUDA is 1.
//
// They compute exactly what the host kernels (device/cpu_kernels.cpp, device/element_ops.hpp)
// compute, element by element in the same order, so a GPU replica's result is bitwise the host's:
// - inputs are combined in order (in[0] op in[1] op ... op in[N-1]); integers wrap (combined in
//   their unsigned type); MIN/MAX use `b < a ? b : a` / `a < b ? b : a`;
// - MEAN accumulates in the output dtype (float64 for integer inputs) and multiplies the last
//   partial by (1.0 / divisor) in the elementwise case, as the host's folded division does;
//   reduce_axis divides exactly by the divisor afterwards, as the host does;
// - bool tensors are not reduced (callers reject them first, as the host kernels do).
// One difference is the hardware's, not the kernels': a NaN that SUM, PROD or MEAN *makes* (inf -
// inf, 0 x inf) or propagates is 0x7fffffff on the GPU where x86 gives 0xffc00000 or the input's
// payload; it is a NaN on both. MIN and MAX select an operand, so their NaNs are bitwise equal.
//
// All pointers are device pointers of one GPU unless said otherwise; every kernel is queued on
// `stream` (made current on its own device for the launch; nullptr is the legacy default stream of
// the current device) and returns without waiting. Sizes of 0 queue nothing and touch no device.
// Bad arguments are error(invalid_argument) or error(dtype_mismatch), thrown before any CUDA call;
// errors of the launch are thrown as error(device_error); errors of the execution surface at the
// next synchronisation. Thread safety: every function may be called from any thread.

#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace consort::cuda {

/// out[j] = in[0][j] op ... op in[count-1][j] for j < n; MEAN multiplies the result by
/// (1.0 / mean_divisor) in the output dtype. `inputs` is a host array of `count` >= 1 device
/// pointers of dtype `type`; `out` has dtype reduced_dtype(op, type) and may alias in[0] when that
/// is `type` (not for MEAN of integers); no other input may overlap it. Any count works: inputs
/// are combined 8 per launch, later launches continuing from `out` in the same order.
void reduce_elementwise(dtype type, reduce_op op, const void* const* inputs, int count, void* out,
                        int64_t n, double mean_divisor, cudaStream_t stream);

/// Reduces a row-major [outer, k, inner] view of `in` along its middle axis into [outer, inner];
/// `k` >= 1. MEAN sums in the output dtype and, when `divisor` > 0, divides by it exactly.
void reduce_axis(dtype type, reduce_op op, const void* in, void* out, int64_t outer, int64_t k,
                 int64_t inner, double divisor, cudaStream_t stream);

/// Divides `n` elements of a float32 or float64 buffer by `divisor` in place (exact division).
void divide(dtype type, void* data, int64_t n, double divisor, cudaStream_t stream);

/// out[j] = alpha * a[j] + beta * b[j] for j < n, for the floating dtypes (float32, float64,
/// float16, bfloat16): as the host's scaled sum of the variables' updates, alpha and beta are
/// rounded to the dtype first (float for the 16-bit floats), each product and the sum are rounded
/// separately (no FMA), and the 16-bit floats compute in float and round once when stored. `out`
/// may be `a` or `b` (an in-place update); no other overlap is allowed.
void scaled_sum(dtype type, double alpha, const void* a, double beta, const void* b, void* out,
                int64_t n, cudaStream_t stream);

/// scaled_sum for `count` buffers of one floating dtype at once, in one launch per 16 of them:
/// out[t][j] = alpha * a[t][j] + beta * b[t][j] for t < count and j < n[t] (`a`, `b`, `out` and
/// `n` are host arrays; each out[t] may be a[t] or b[t]; no other overlap). Buffers of 0 elements
/// are skipped, and their pointers may be null.
void scaled_sum_many(dtype type, double alpha, const void* const* a, double beta,
                     const void* const* b, void* const* out, const int64_t* n, int count,
                     cudaStream_t stream);

/// Fills `n` elements of dtype `type` with `value` (converted to the dtype).
void fill(dtype type, void* data, int64_t n, double value, cudaStream_t stream);

/// Concatenation along an axis, as strided copies: for each of `outer` rows, input i contributes
/// `row_bytes[i]` contiguous bytes (its extent along the axis times the bytes of the later axes),
/// written one after the other into `out` (device pointers, `inputs` a host array of `count`).
void concat(const void* const* inputs, const size_t* row_bytes, int count, void* out, int64_t outer,
            cudaStream_t stream);

} // namespace consort::cuda
