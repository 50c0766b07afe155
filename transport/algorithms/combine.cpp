// The element-wise combine kernel of the all-reduce algorithms.
//
// The loops are plain loops over typed restrict pointers, with no call and no branch on the
// element, so that g++ vectorises them; signed integers are combined in their unsigned type (they
// wrap as TensorFlow's do, without undefined behaviour), as in device/cpu_kernels.cpp.
//
// float16 and bfloat16 are combined in float and rounded once per combine: a partial that travels
// between ranks is rounded to its dtype at every hop (as NCCL's ring does), while every combine
// itself computes in float32.

#include "transport/algorithms/common.hpp"

#include "device/element_ops.hpp"
#include "device/half_convert.hpp"

#include <algorithm>
#include <type_traits>

namespace consort::transport::detail {

namespace {

using consort::detail::max_fn;
using consort::detail::min_fn;
using consort::detail::prod_fn;
using consort::detail::sum_fn;

// out = out op b
template <class T, class Op, bool Scaled>
void fold_right(T* __restrict out, const T* __restrict b, size_t n, T s) {
  for (size_t i = 0; i < n; ++i) {
    if constexpr (Scaled)
      out[i] = Op::apply(out[i], b[i]) * s;
    else
      out[i] = Op::apply(out[i], b[i]);
  }
}

// out = a op out
template <class T, class Op, bool Scaled>
void fold_left(T* __restrict out, const T* __restrict a, size_t n, T s) {
  for (size_t i = 0; i < n; ++i) {
    if constexpr (Scaled)
      out[i] = Op::apply(a[i], out[i]) * s;
    else
      out[i] = Op::apply(a[i], out[i]);
  }
}

// out = a op b
template <class T, class Op, bool Scaled>
void fold3(T* __restrict out, const T* __restrict a, const T* __restrict b, size_t n, T s) {
  for (size_t i = 0; i < n; ++i) {
    if constexpr (Scaled)
      out[i] = Op::apply(a[i], b[i]) * s;
    else
      out[i] = Op::apply(a[i], b[i]);
  }
}

template <class T, class Op, bool Scaled>
void combine_as(void* out, const void* a, const void* b, size_t n, T s) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  if (o == x)
    fold_right<T, Op, Scaled>(o, y, n, s);
  else if (o == y)
    fold_left<T, Op, Scaled>(o, x, n, s);
  else
    fold3<T, Op, Scaled>(o, x, y, n, s);
}

/// out = T(float(a) op float(b) * s): a 16-bit float combined in float and rounded once. `out`
/// may alias `a` or `b` (each element is read before it is written).
template <class T, class Op, bool Scaled>
void combine_half_as(void* out, const void* a, const void* b, size_t n, float s) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  if constexpr (std::is_same_v<Op, sum_fn>)
    return consort::detail::add(x, y, o, n, Scaled, s); // one pass, the common case
  // In blocks that stay in L1: both inputs widened to float (vectorised conversions), combined in
  // float (a vectorised loop), rounded once into `out`. A block is read before it is written, so
  // `out` may alias `a` or `b`.
  constexpr size_t block = 512;
  float fx[block], fy[block];
  for (size_t begin = 0; begin < n; begin += block) {
    const size_t count = std::min(block, n - begin);
    consort::detail::to_float(x + begin, fx, count);
    consort::detail::to_float(y + begin, fy, count);
    for (size_t i = 0; i < count; ++i) {
      float r = Op::apply(fx[i], fy[i]);
      if constexpr (Scaled)
        r *= s;
      fx[i] = r;
    }
    consort::detail::from_float(fx, o + begin, count);
  }
}

template <class T>
void combine_half(reduce_op op, void* out, const void* a, const void* b, size_t n, int divisor) {
  if (divisor > 0) {
    const float s = 1.0f / static_cast<float>(divisor);
    switch (op) {
    case reduce_op::sum:
    case reduce_op::mean:
      return combine_half_as<T, sum_fn, true>(out, a, b, n, s);
    case reduce_op::prod:
      return combine_half_as<T, prod_fn, true>(out, a, b, n, s);
    case reduce_op::min:
      return combine_half_as<T, min_fn, true>(out, a, b, n, s);
    case reduce_op::max:
      return combine_half_as<T, max_fn, true>(out, a, b, n, s);
    }
    return;
  }
  switch (op) {
  case reduce_op::sum:
  case reduce_op::mean:
    return combine_half_as<T, sum_fn, false>(out, a, b, n, 0.0f);
  case reduce_op::prod:
    return combine_half_as<T, prod_fn, false>(out, a, b, n, 0.0f);
  case reduce_op::min:
    return combine_half_as<T, min_fn, false>(out, a, b, n, 0.0f);
  case reduce_op::max:
    return combine_half_as<T, max_fn, false>(out, a, b, n, 0.0f);
  }
}

template <class T>
void combine_typed(reduce_op op, void* out, const void* a, const void* b, size_t n, int divisor) {
  if constexpr (std::is_floating_point_v<T>) {
    if (divisor > 0) {
      const T s = T(1) / static_cast<T>(divisor);
      switch (op) {
      case reduce_op::sum:
      case reduce_op::mean:
        return combine_as<T, sum_fn, true>(out, a, b, n, s);
      case reduce_op::prod:
        return combine_as<T, prod_fn, true>(out, a, b, n, s);
      case reduce_op::min:
        return combine_as<T, min_fn, true>(out, a, b, n, s);
      case reduce_op::max:
        return combine_as<T, max_fn, true>(out, a, b, n, s);
      }
      return;
    }
  }
  switch (op) {
  case reduce_op::sum:
  case reduce_op::mean:
    return combine_as<T, sum_fn, false>(out, a, b, n, T{});
  case reduce_op::prod:
    return combine_as<T, prod_fn, false>(out, a, b, n, T{});
  case reduce_op::min:
    return combine_as<T, min_fn, false>(out, a, b, n, T{});
  case reduce_op::max:
    return combine_as<T, max_fn, false>(out, a, b, n, T{});
  }
}

template <class T>
void scale_typed(void* data, size_t n, int divisor) {
  auto* p = static_cast<T*>(data);
  const T s = T(1) / static_cast<T>(divisor);
  for (size_t i = 0; i < n; ++i)
    p[i] *= s;
}

template <class T>
void scale_half(void* data, size_t n, int divisor) {
  auto* p = static_cast<T*>(data);
  const float s = 1.0f / static_cast<float>(divisor);
  constexpr size_t block = 512;
  float f[block];
  for (size_t begin = 0; begin < n; begin += block) {
    const size_t count = std::min(block, n - begin);
    consort::detail::to_float(p + begin, f, count);
    for (size_t i = 0; i < count; ++i)
      f[i] *= s;
    consort::detail::from_float(f, p + begin, count);
  }
}

} // namespace

void combine(dtype type, reduce_op op, void* out, const void* a, const void* b, size_t n,
             int divisor) {
  if (n == 0)
    return;
  switch (type) {
  case dtype::float32:
    return combine_typed<float>(op, out, a, b, n, divisor);
  case dtype::float64:
    return combine_typed<double>(op, out, a, b, n, divisor);
  case dtype::int32:
    return combine_typed<int32_t>(op, out, a, b, n, divisor);
  case dtype::int64:
    return combine_typed<int64_t>(op, out, a, b, n, divisor);
  case dtype::uint8:
    return combine_typed<uint8_t>(op, out, a, b, n, divisor);
  case dtype::float16:
    return combine_half<float16_t>(op, out, a, b, n, divisor);
  case dtype::bfloat16:
    return combine_half<bfloat16_t>(op, out, a, b, n, divisor);
  case dtype::boolean:
    return; // rejected by check_reduction
  }
}

void scale(dtype type, void* data, size_t n, int divisor) {
  if (type == dtype::float32)
    scale_typed<float>(data, n, divisor);
  else if (type == dtype::float64)
    scale_typed<double>(data, n, divisor);
  else if (type == dtype::float16)
    scale_half<float16_t>(data, n, divisor);
  else if (type == dtype::bfloat16)
    scale_half<bfloat16_t>(data, n, divisor);
}

} // namespace consort::transport::detail
