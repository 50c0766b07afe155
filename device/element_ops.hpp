#pragma once

// The element-wise operations of every reduction, shared by the host kernels
// (device/cpu_kernels.cpp) and the all-reduce algorithms (transport/algorithms/combine.cpp), so
// that in-process and cross-worker reductions compute exactly the same values.
//
// Integers are combined in their unsigned type, so they wrap as TensorFlow's do without signed-
// overflow UB; the cast back also undoes uint8's promotion to int. MIN and MAX are written as the
// expressions minps/maxps compile to, so g++ vectorises the loops that call them.
//
// The CUDA kernels (device/cuda/kernels.cu) call the same functions from device code, so a GPU
// reduction is bitwise the host's: CONSORT_DEVICE_HOST_DEVICE is `__host__ __device__` under nvcc
// and empty for the host compiler, which therefore sees exactly the code it always did.

#include <type_traits>

#if defined(__CUDACC__)
#define CONSORT_DEVICE_HOST_DEVICE __host__ __device__
#else
#define CONSORT_DEVICE_HOST_DEVICE
#endif

namespace consort::detail {

template <class A, bool = std::is_integral_v<A>>
struct wrap {
  using type = A;
};
template <class A>
struct wrap<A, true> {
  using type = std::make_unsigned_t<A>;
};
template <class A>
using wrap_t = typename wrap<A>::type;

struct sum_fn {
  template <class A>
  CONSORT_DEVICE_HOST_DEVICE static A apply(A a, A b) {
    return static_cast<A>(static_cast<wrap_t<A>>(a) + static_cast<wrap_t<A>>(b));
  }
};

struct prod_fn {
  template <class A>
  CONSORT_DEVICE_HOST_DEVICE static A apply(A a, A b) {
    return static_cast<A>(static_cast<wrap_t<A>>(a) * static_cast<wrap_t<A>>(b));
  }
};

struct min_fn {
  template <class A>
  CONSORT_DEVICE_HOST_DEVICE static A apply(A a, A b) {
    return b < a ? b : a;
  }
};

struct max_fn {
  template <class A>
  CONSORT_DEVICE_HOST_DEVICE static A apply(A a, A b) {
    return a < b ? b : a;
  }
};

} // namespace consort::detail
