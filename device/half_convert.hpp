#pragma once

// Block conversions between float and the 16-bit float types, for the reductions that accumulate
// float16 and bfloat16 in float (the cross-worker combine, transport/algorithms/combine.cpp, and
// the host kernels, device/cpu_kernels.cpp).
//
// Each gives exactly the bits of the element-wise conversions of <consort/tensor.hpp> (round to
// nearest even; NaNs as they keep them), only faster: bfloat16's are branch-free loops the
// compiler vectorises, float16's use the F16C instructions (vcvtph2ps / vcvtps2ph) where the CPU
// has them, chosen at run time, with a block that holds a NaN converted element by element (F16C
// quiets a signalling NaN's payload differently). Without F16C they are the element-wise loops.

#include <consort/tensor.hpp>

#include <cstddef>

namespace consort::detail {

/// out[i] = float(in[i]) for i < n.
void to_float(const float16_t* in, float* out, size_t n) noexcept;
void to_float(const bfloat16_t* in, float* out, size_t n) noexcept;

/// out[i] = T(in[i]) (round to nearest even) for i < n.
void from_float(const float* in, float16_t* out, size_t n) noexcept;
void from_float(const float* in, bfloat16_t* out, size_t n) noexcept;

/// out[i] = T((float(a[i]) + float(b[i])) * s), the factor only when `scaled`, in one pass (the
/// all-reduce's SUM and MEAN combine). `out` may alias `a` or `b`.
void add(const float16_t* a, const float16_t* b, float16_t* out, size_t n, bool scaled,
         float s) noexcept;
void add(const bfloat16_t* a, const bfloat16_t* b, bfloat16_t* out, size_t n, bool scaled,
         float s) noexcept;

/// Whether float16's conversions use F16C on this CPU (for benchmarks and tests).
bool half_conversions_use_f16c() noexcept;

} // namespace consort::detail
