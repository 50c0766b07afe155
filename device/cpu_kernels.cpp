// Host kernels: element-wise reduction of N tensors, reduction along an axis, concatenation, and
// the tf.distribute reduce semantics built from them.
//
// The hot loops are plain loops over typed pointers, written so that g++ -O2/-O3 vectorises them:
// no calls, no branches on the element, `__restrict` pointers, signed integer arithmetic done in
// the unsigned type (it wraps as TensorFlow's does, and stays defined behaviour).

#include "device/nest_paths.hpp"

#include "device/gpu.hpp"
#include <consort/error.hpp>

#include <consort/ops.hpp>

#include "device/element_ops.hpp"
#include "device/half_convert.hpp"
#include "device/parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace consort {

namespace {

using consort::detail::max_fn;
using consort::detail::min_fn;
using consort::detail::prod_fn;
using consort::detail::sum_fn;

// -- block passes ---------------------------------------------------------------------------------
// Each pass is one simple loop over `n` elements; the element-wise reduction runs them over one
// output block at a time, so the block stays in L1 while every input streams through once.

template <class T, class A>
void pass_copy(A* __restrict out, const T* __restrict a, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    out[j] = static_cast<A>(a[j]);
}

template <class T, class A>
void pass_copy_scaled(A* __restrict out, const T* __restrict a, int64_t n, A scale) {
  for (int64_t j = 0; j < n; ++j)
    out[j] = static_cast<A>(a[j]) * scale;
}

template <class Op, class T, class A>
void pass_first(A* __restrict out, const T* __restrict a, const T* __restrict b, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    out[j] = Op::apply(static_cast<A>(a[j]), static_cast<A>(b[j]));
}

template <class Op, class T, class A>
void pass_first_scaled(A* __restrict out, const T* __restrict a, const T* __restrict b, int64_t n,
                       A scale) {
  for (int64_t j = 0; j < n; ++j)
    out[j] = Op::apply(static_cast<A>(a[j]), static_cast<A>(b[j])) * scale;
}

template <class Op, class T, class A>
void pass_next(A* __restrict out, const T* __restrict c, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    out[j] = Op::apply(out[j], static_cast<A>(c[j]));
}

template <class Op, class T, class A>
void pass_next_scaled(A* __restrict out, const T* __restrict c, int64_t n, A scale) {
  for (int64_t j = 0; j < n; ++j)
    out[j] = Op::apply(out[j], static_cast<A>(c[j])) * scale;
}

/// Output elements per block: 16 KiB of output, which stays in a 32 KiB L1 data cache while the
/// inputs stream past it.
template <class A>
constexpr int64_t block_elements = 16384 / static_cast<int64_t>(sizeof(A));

/// out[j] = in[0][j] op in[1][j] op ... op in[N-1][j] (times `scale` when `scaled`), in one pass
/// over the inputs.
/// Below this many bytes touched (inputs plus output), a reduction stays on the calling thread:
/// waking the pool costs more than it saves.
constexpr size_t parallel_threshold_bytes = size_t{4} << 20;

/// Accumulates in `A` and stores in `O`: when they differ (float16 and bfloat16, accumulated in
/// float), each block is reduced into a float block on the stack and rounded once into `out`.
template <class Op, class T, class A, class O = A>
void reduce_blocks(const std::vector<const T*>& in, O* out, int64_t n, bool scaled, A scale) {
  constexpr bool direct = std::is_same_v<A, O>;
  // float16 inputs are widened a block at a time (F16C, device/half_convert.hpp) into float
  // staging buffers, and the passes run on floats instead of converting element by element with
  // the branchy float16 conversion, which g++ does not vectorise. bfloat16's conversion is a shift
  // that the passes vectorise themselves, so it is not staged (a one-off timing found staging it
  // slower; no benchmark in bench/ covers in-process 16-bit reductions yet).
  constexpr bool widen = std::is_same_v<T, float16_t>;
  using X = std::conditional_t<widen, float, T>;
  [[maybe_unused]] A staging[direct ? 1 : block_elements<A>];
  [[maybe_unused]] float widened[2][widen ? block_elements<A> : 1];
  const size_t count = in.size();
  for (int64_t base = 0; base < n; base += block_elements<A>) {
    const int64_t len = std::min(block_elements<A>, n - base);
    // Input i's part of this block, in `slot`'s staging buffer when it is widened.
    auto input = [&](size_t i, int slot) -> const X* {
      if constexpr (widen) {
        detail::to_float(in[i] + base, widened[slot], static_cast<size_t>(len));
        return widened[slot];
      } else {
        (void)slot;
        return in[i] + base;
      }
    };
    A* block = nullptr;
    if constexpr (direct)
      block = out + base;
    else
      block = staging;
    // Stores the block when it was staged (on every path out of this iteration).
    auto store = [&] {
      if constexpr (!direct)
        detail::from_float(block, out + base, static_cast<size_t>(len));
    };
    if (count == 1) {
      if (scaled)
        pass_copy_scaled<X, A>(block, input(0, 0), len, scale);
      else
        pass_copy<X, A>(block, input(0, 0), len);
      store();
      continue;
    }
    if (count == 2 && scaled)
      pass_first_scaled<Op, X, A>(block, input(0, 0), input(1, 1), len, scale);
    else
      pass_first<Op, X, A>(block, input(0, 0), input(1, 1), len);
    for (size_t i = 2; i < count; ++i) {
      if (scaled && i + 1 == count)
        pass_next_scaled<Op, X, A>(block, input(i, 0), len, scale);
      else
        pass_next<Op, X, A>(block, input(i, 0), len);
    }
    store();
  }
}

/// Reduces a [outer, k, inner] view along its middle axis into [outer, inner]; `k` >= 1.
template <class Op, class T, class A>
void reduce_middle_axis(const T* in, A* out, int64_t outer, int64_t k, int64_t inner) {
  for (int64_t o = 0; o < outer; ++o) {
    const T* src = in + o * k * inner;
    A* dst = out + o * inner;
    if (inner == 1) {
      // Reducing the innermost axis: a horizontal reduction of one contiguous row.
      A acc = static_cast<A>(src[0]);
      for (int64_t i = 1; i < k; ++i)
        acc = Op::apply(acc, static_cast<A>(src[i]));
      dst[0] = acc;
      continue;
    }
    for (int64_t base = 0; base < inner; base += block_elements<A>) {
      const int64_t len = std::min(block_elements<A>, inner - base);
      pass_copy<T, A>(dst + base, src + base, len);
      for (int64_t i = 1; i < k; ++i)
        pass_next<Op, T, A>(dst + base, src + i * inner + base, len);
    }
  }
}

// -- dtype dispatch -------------------------------------------------------------------------------

template <class T>
struct type_tag {
  using type = T;
};

/// Calls `fn(type_tag<T>{})` for the C++ type of `t`; bool is rejected (callers check first).
template <class F>
void visit_numeric(dtype t, F&& fn) {
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
    return fn(type_tag<float16_t>{});
  case dtype::bfloat16:
    return fn(type_tag<bfloat16_t>{});
  case dtype::boolean:
    break;
  }
  throw_error(errc::dtype_mismatch, "reduce of bool tensors is not supported; cast to int32 first");
}

/// Calls `fn(type_tag<T>{}, Op{})` for the element type `T` and the combining function of `op`
/// (MEAN combines by summing; the caller divides).
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

/// Whether `T` is float16_t or bfloat16_t, which are accumulated in float and stored as `T`.
template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, float16_t> || std::is_same_v<T, bfloat16_t>;

/// The accumulator (and output) type of MEAN over `T`: double for integers, float for the 16-bit
/// floats (whose output is `T`), else `T`.
template <class T>
using mean_acc_t = std::conditional_t<std::is_floating_point_v<T>, T,
                                      std::conditional_t<is_half_v<T>, float, double>>;

/// `input` converted element by element to `type`, one of float32, float16 and bfloat16 (the
/// 16-bit floats are reduced through float32 and rounded once at the end).
tensor convert_floating(const tensor& input, dtype type) {
  if (input.dtype() == type)
    return input;
  auto out = tensor::empty(type, input.shape(), input.device());
  const int64_t n = input.num_elements();
  visit_numeric(input.dtype(), [&](auto from) {
    using F = typename decltype(from)::type;
    visit_numeric(type, [&](auto to) {
      using T = typename decltype(to)::type;
      if constexpr ((std::is_same_v<F, float> && is_half_v<T>) ||
                    (is_half_v<F> && std::is_same_v<T, float>)) {
        const auto* in = static_cast<const F*>(input.raw_data());
        auto* o = static_cast<T*>(out.raw_mutable_data());
        for (int64_t i = 0; i < n; ++i)
          o[i] = T(static_cast<float>(in[i]));
      } else {
        throw_error(errc::dtype_mismatch, std::string{"internal: convert_floating from "} +
                                              to_string(input.dtype()) + " to " + to_string(type) +
                                              "; expected float32 to or from float16/bfloat16");
      }
    });
  });
  return out;
}

// -- placement ------------------------------------------------------------------------------------

/// Where a kernel over `inputs` runs: on their GPU when they all live on the same one (returns its
/// index), on the host otherwise (returns -1). Inputs on several devices, some of them GPUs, are
/// copied to the host first (into `host_copies`, which then replaces them).
int placement(const std::vector<tensor>& inputs, std::vector<tensor>& host_copies) {
  bool any_gpu = false;
  bool same = true;
  for (const auto& t : inputs) {
    any_gpu = any_gpu || t.on_gpu();
    same = same && t.device() == inputs.front().device();
  }
  if (!any_gpu)
    return -1;
  if (same)
    return detail::gpu::index_of(inputs.front().device());
  host_copies.clear();
  for (const auto& t : inputs)
    host_copies.push_back(t.on_gpu() ? t.to("CPU:0") : t);
  return -1;
}

/// The tensors of `values` in host memory (GPU leaves copied, host leaves as they are).
std::vector<tensor> on_host(const std::vector<tensor>& values) {
  std::vector<tensor> out;
  out.reserve(values.size());
  for (const auto& t : values)
    out.push_back(t.on_gpu() ? t.to("CPU:0") : t);
  return out;
}

// -- checks ---------------------------------------------------------------------------------------

void reject_bool(const tensor& t, const std::string& who) {
  if (t.dtype() == dtype::boolean)
    throw_error(errc::dtype_mismatch,
                who + " is a bool tensor: reduce of bool tensors is not supported; cast to int32 "
                      "first");
}

/// Checks that `inputs` are valid tensors of one dtype and one shape. `what` names the operation
/// and `item` what an input is called in messages ("input", "replica").
void check_same_shape_and_dtype(const std::vector<tensor>& inputs, const char* what,
                                const char* item) {
  if (inputs.empty())
    throw_error(errc::invalid_argument, std::string{what} + " needs at least one " + item);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    auto who = std::string{item} + " " + std::to_string(i);
    if (!t.valid())
      throw_error(errc::invalid_argument,
                  std::string{what} + ": " + who + " is a default-constructed (empty) tensor");
    reject_bool(t, std::string{what} + ": " + who);
    if (t.dtype() != inputs[0].dtype())
      throw_error(errc::dtype_mismatch, std::string{what} + ": " + who + " has dtype " +
                                            to_string(t.dtype()) + " but " + item +
                                            " 0 has dtype " + to_string(inputs[0].dtype()) +
                                            "; all must have the same dtype");
    if (t.shape() != inputs[0].shape())
      throw_error(errc::shape_mismatch, std::string{what} + ": " + who + " has shape " +
                                            to_string(t.shape()) + " but " + item +
                                            " 0 has shape " + to_string(inputs[0].shape()) +
                                            "; an element-wise reduce needs equal shapes");
  }
}

shape_t without_axis(const shape_t& shape, int64_t axis) {
  shape_t out = shape;
  out.erase(out.begin() + axis);
  return out;
}

int64_t product(const shape_t& shape, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i)
    n *= shape[i];
  return n;
}

/// A tensor of `shape` with every element `value`.
tensor filled(dtype type, const shape_t& shape, const std::string& device, double value) {
  auto out = tensor::zeros(type, shape, device);
  if (value == 0)
    return out;
  visit_numeric(type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto* p = out.mutable_data<T>();
    std::fill(p, p + out.num_elements(), static_cast<T>(value));
  });
  return out;
}

/// Divides every element of a floating tensor by `divisor` in place (exact division, as TF does).
void divide_in_place(tensor& t, double divisor) {
  if (t.on_gpu()) {
    detail::gpu::divide(t, divisor);
    return;
  }
  if (t.dtype() == dtype::float32) {
    auto* p = t.mutable_data<float>();
    auto d = static_cast<float>(divisor);
    for (int64_t i = 0; i < t.num_elements(); ++i)
      p[i] /= d;
  } else if (is_half(t.dtype())) {
    // Divided in float and rounded once (the reductions of this file divide half sums in float
    // before rounding; this serves any caller that holds a rounded sum).
    visit_numeric(t.dtype(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      if constexpr (is_half_v<T>) {
        auto* p = static_cast<T*>(t.raw_mutable_data());
        auto d = static_cast<float>(divisor);
        for (int64_t i = 0; i < t.num_elements(); ++i)
          p[i] = T(static_cast<float>(p[i]) / d);
      }
    });
  } else {
    auto* p = t.mutable_data<double>();
    for (int64_t i = 0; i < t.num_elements(); ++i)
      p[i] /= divisor;
  }
}

/// Reduces `input` along the (normalised) `axis` with `op`; the output has `reduced_dtype`. For
/// MEAN, divides by the extent when `divide`, else leaves the sum (in the output dtype) so that a
/// caller can divide by a larger count.
tensor reduce_axis_impl(reduce_op op, const tensor& input, int64_t axis, bool divide) {
  const auto& shape = input.shape();
  const int64_t k = shape[static_cast<size_t>(axis)];
  const auto out_type = reduced_dtype(op, input.dtype());
  auto out_shape = without_axis(shape, axis);
  if (input.on_gpu() && !(k == 0 && (op == reduce_op::min || op == reduce_op::max)))
    return detail::gpu::reduce_axis(op, input, axis, divide);
  if (is_half(input.dtype())) {
    // Accumulated (and divided) in float32, rounded once to the input's dtype.
    auto wide = reduce_axis_impl(op, convert_floating(input, dtype::float32), axis, divide);
    return convert_floating(wide, input.dtype());
  }
  if (k == 0) {
    switch (op) {
    case reduce_op::sum:
      return tensor::zeros(out_type, out_shape, input.device());
    case reduce_op::prod:
      return filled(out_type, out_shape, input.device(), 1);
    case reduce_op::mean:
      // 0/0, as TF's reduce_mean of an empty axis.
      return filled(out_type, out_shape, input.device(),
                    divide ? std::numeric_limits<double>::quiet_NaN() : 0.0);
    case reduce_op::min:
    case reduce_op::max:
      throw_error(errc::invalid_argument, std::string{"reduce "} + to_string(op) + " along axis " +
                                              std::to_string(axis) + " of a tensor of shape " +
                                              to_string(shape) + ": the axis is empty, and " +
                                              to_string(op) + " of no elements is undefined");
    }
  }
  const int64_t outer = product(shape, 0, static_cast<size_t>(axis));
  const int64_t inner = product(shape, static_cast<size_t>(axis) + 1, shape.size());
  auto out = tensor::zeros(out_type, out_shape, input.device());
  if (out.num_elements() == 0)
    return out;
  visit_numeric(input.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const auto* in = static_cast<const T*>(input.raw_data());
    visit_op(op, [&](auto fn) {
      using Op = decltype(fn);
      if constexpr (is_half_v<T>) {
        return; // converted to float32 above
      } else if (op == reduce_op::mean) {
        using A = mean_acc_t<T>;
        reduce_middle_axis<Op, T, A>(in, static_cast<A*>(out.raw_mutable_data()), outer, k, inner);
      } else {
        reduce_middle_axis<Op, T, T>(in, static_cast<T*>(out.raw_mutable_data()), outer, k, inner);
      }
    });
  });
  if (op == reduce_op::mean && divide)
    divide_in_place(out, static_cast<double>(k));
  return out;
}

/// Rethrows `e` with `prefix` in front of its message, keeping its code.
[[noreturn]] void rethrow_with_prefix(const error& e, const std::string& prefix) {
  throw_error(e.code(), prefix + e.what());
}

void check_same_structure(const std::vector<nest>& components, const char* what) {
  if (components.empty())
    throw_error(errc::invalid_argument, std::string{what} + " needs at least one replica's value");
  for (size_t i = 1; i < components.size(); ++i) {
    auto diff = compare_structure(components[0], components[i]);
    if (!diff.empty())
      throw_error(errc::structure_mismatch,
                  std::string{what} + ": replica " + std::to_string(i) +
                      " passed a structure different from replica 0's: " + diff +
                      " (replica 0: " + components[0].structure_string() + ", replica " +
                      std::to_string(i) + ": " + components[i].structure_string() + ")");
  }
}

/// Applies `fn(leaves of every component at one position)` leaf by leaf, keeping the structure
/// of component 0; errors of a leaf are prefixed with its path.
template <class F>
nest leafwise(const std::vector<nest>& components, const char* what, F&& fn) {
  check_same_structure(components, what);
  auto paths = detail::flatten_with_paths(components[0]);
  std::vector<std::vector<tensor>> leaves;
  leaves.reserve(components.size());
  for (const auto& c : components)
    leaves.push_back(flatten(c));
  std::vector<tensor> results;
  results.reserve(paths.size());
  for (size_t l = 0; l < paths.size(); ++l) {
    std::vector<tensor> column;
    column.reserve(components.size());
    for (const auto& replica_leaves : leaves)
      column.push_back(replica_leaves[l]);
    try {
      results.push_back(fn(column));
    } catch (const error& e) {
      if (paths[l].first.empty())
        throw;
      rethrow_with_prefix(e, "at " + detail::describe_leaf(paths[l].first) + ": ");
    }
  }
  return pack_as(components[0], results);
}

/// `concat` with messages that call the operation `what` and each input `item` ("replica").
tensor concat_impl(const std::vector<tensor>& inputs, int64_t axis, const std::string& what,
                   const std::string& item) {
  if (inputs.empty())
    throw_error(errc::invalid_argument, what + " needs at least one " + item + "; got none");
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto who = item + " " + std::to_string(i);
    if (!inputs[i].valid())
      throw_error(errc::invalid_argument, what + ": " + who + " is a default-constructed tensor");
    if (inputs[i].rank() == 0)
      throw_error(errc::invalid_argument, "all_gather/gather needs rank >= 1; got a scalar (" +
                                              who + ", " + inputs[i].to_string(1) +
                                              "), reshape it to [1]");
  }
  const auto& first = inputs[0];
  const int64_t ax = normalize_axis(axis, first.rank(), what.c_str());
  shape_t out_shape = first.shape();
  out_shape[static_cast<size_t>(ax)] = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    auto who = item + " " + std::to_string(i);
    auto other = item + " 0";
    if (t.dtype() != first.dtype())
      throw_error(errc::dtype_mismatch, what + ": " + who + " has dtype " + to_string(t.dtype()) +
                                            " but " + other + " has dtype " +
                                            to_string(first.dtype()) + "; dtypes must agree");
    if (t.rank() != first.rank())
      throw_error(errc::shape_mismatch, what + ": " + who + " has shape " + to_string(t.shape()) +
                                            " (rank " + std::to_string(t.rank()) + ") but " +
                                            other + " has shape " + to_string(first.shape()) +
                                            " (rank " + std::to_string(first.rank()) +
                                            "); ranks must agree");
    for (int64_t d = 0; d < first.rank(); ++d)
      if (d != ax && t.shape()[static_cast<size_t>(d)] != first.shape()[static_cast<size_t>(d)])
        throw_error(errc::shape_mismatch, what + " along axis " + std::to_string(ax) + ": " + who +
                                              " has shape " + to_string(t.shape()) + " but " +
                                              other + " has shape " + to_string(first.shape()) +
                                              "; every extent but axis " + std::to_string(ax) +
                                              "'s must agree");
    out_shape[static_cast<size_t>(ax)] += t.shape()[static_cast<size_t>(ax)];
  }
  if (inputs.size() == 1)
    return first;
  std::vector<tensor> host_copies;
  if (placement(inputs, host_copies) >= 0)
    return detail::gpu::concat(inputs, ax, out_shape);
  if (!host_copies.empty())
    return concat_impl(host_copies, axis, what, item);
  auto out = tensor::zeros(first.dtype(), out_shape, first.device());
  if (out.num_bytes() == 0)
    return out;
  // Row-major: for each index of the axes before `ax`, each input contributes one contiguous
  // chunk of (its extent along `ax`) x (the product of the later axes) elements.
  const int64_t outer = product(out_shape, 0, static_cast<size_t>(ax));
  const auto inner_bytes =
      static_cast<size_t>(product(out_shape, static_cast<size_t>(ax) + 1, out_shape.size())) *
      size_of(first.dtype());
  auto* dst = static_cast<std::byte*>(out.raw_mutable_data());
  for (int64_t o = 0; o < outer; ++o) {
    for (const auto& t : inputs) {
      const auto chunk = static_cast<size_t>(t.shape()[static_cast<size_t>(ax)]) * inner_bytes;
      if (chunk == 0)
        continue;
      std::memcpy(dst, static_cast<const std::byte*>(t.raw_data()) + o * chunk, chunk);
      dst += chunk;
    }
  }
  return out;
}

} // namespace

// -- public kernels -------------------------------------------------------------------------------

consort::dtype reduced_dtype(reduce_op op, consort::dtype input) {
  if (op == reduce_op::mean && !is_floating(input))
    return dtype::float64;
  return input;
}

int64_t normalize_axis(int64_t axis, int64_t rank, const char* what) {
  if (rank == 0)
    throw_error(errc::invalid_argument, std::string{what} + ": axis " + std::to_string(axis) +
                                            " is invalid for a scalar (rank 0), which has no axes");
  if (axis < -rank || axis >= rank)
    throw_error(errc::invalid_argument,
                std::string{what} + ": axis " + std::to_string(axis) +
                    " is out of range for a tensor of rank " + std::to_string(rank) +
                    "; valid axes are " + std::to_string(-rank) + ".." + std::to_string(rank - 1));
  return axis < 0 ? axis + rank : axis;
}

tensor reduce_elementwise(reduce_op op, const std::vector<tensor>& inputs,
                          std::optional<double> mean_divisor) {
  check_same_shape_and_dtype(inputs, "reduce_elementwise", "input");
  const double divisor = mean_divisor.value_or(static_cast<double>(inputs.size()));
  if (op == reduce_op::mean && !(divisor > 0 && std::isfinite(divisor)))
    throw_error(errc::invalid_argument, "reduce_elementwise: the MEAN divisor must be a positive "
                                        "finite number; got " +
                                            std::to_string(divisor));
  // Tensors are immutable once shared, so one input reduced with anything but MEAN is itself.
  if (inputs.size() == 1 && op != reduce_op::mean)
    return inputs[0];
  std::vector<tensor> host_copies;
  if (placement(inputs, host_copies) >= 0)
    return detail::gpu::reduce_elementwise(op, inputs, divisor);
  if (!host_copies.empty())
    return reduce_elementwise(op, host_copies, divisor);
  const auto& first = inputs[0];
  // Every element is written below, so the output needs no zero-fill.
  auto out = tensor::empty(reduced_dtype(op, first.dtype()), first.shape(), first.device());
  const int64_t n = first.num_elements();
  if (n == 0)
    return out;
  // Large reductions are split into chunks of whole blocks for the host thread pool: one core
  // cannot saturate the memory bus, and each chunk still makes one blocked pass over its inputs.
  const auto touched = out.num_bytes() * (inputs.size() + 1);
  const int64_t chunk_elements =
      touched >= parallel_threshold_bytes && detail::parallel_threads() > 1
          ? std::max<int64_t>(n / static_cast<int64_t>(4 * detail::parallel_threads()), 1)
          : n;
  const auto chunks = static_cast<size_t>((n + chunk_elements - 1) / chunk_elements);
  visit_numeric(first.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::vector<const T*> in;
    in.reserve(inputs.size());
    for (const auto& t : inputs)
      in.push_back(static_cast<const T*>(t.raw_data()));
    visit_op(op, [&](auto fn) {
      using Op = decltype(fn);
      // Accumulates in the type of `scale` and stores in the type `dst` points to.
      auto run = [&](auto* dst, auto scale, bool scaled) {
        using O = std::remove_pointer_t<decltype(dst)>;
        using A = decltype(scale);
        detail::parallel_for(chunks, [&](size_t c) {
          const int64_t begin = static_cast<int64_t>(c) * chunk_elements;
          const int64_t len = std::min(chunk_elements, n - begin);
          std::vector<const T*> part(in.size());
          for (size_t i = 0; i < in.size(); ++i)
            part[i] = in[i] + begin;
          reduce_blocks<Op, T, A, O>(part, dst + begin, len, scaled, scale);
        });
      };
      if constexpr (is_half_v<T>) {
        // Accumulated in float, rounded once to T (MEAN keeps the input's dtype, as for floats).
        const bool mean = op == reduce_op::mean;
        run(static_cast<T*>(out.raw_mutable_data()),
            mean ? static_cast<float>(1.0 / divisor) : 0.0f, mean);
      } else if (op == reduce_op::mean) {
        using A = mean_acc_t<T>;
        // The division is folded into the last input pass as a multiplication.
        run(static_cast<A*>(out.raw_mutable_data()), static_cast<A>(1.0 / divisor), true);
      } else {
        run(static_cast<T*>(out.raw_mutable_data()), T{}, false);
      }
    });
  });
  return out;
}

tensor reduce_axis(reduce_op op, const tensor& input, int64_t axis) {
  if (!input.valid())
    throw_error(errc::invalid_argument, "reduce_axis: the input is a default-constructed tensor");
  reject_bool(input, "reduce_axis: the input");
  return reduce_axis_impl(op, input, normalize_axis(axis, input.rank(), "reduce_axis"), true);
}

tensor concat(const std::vector<tensor>& inputs, int64_t axis) {
  return concat_impl(inputs, axis, "concat", "input");
}

tensor reduce_components(reduce_op op, const std::vector<tensor>& components,
                         std::optional<int64_t> axis) {
  // Results of reduce and gather land on the host, as tf.distribute's do.
  for (const auto& t : components)
    if (t.on_gpu())
      return reduce_components(op, on_host(components), axis);
  if (!axis) {
    // Checked here too, so that messages speak of replicas rather than inputs.
    check_same_shape_and_dtype(components, "reduce", "replica");
    return reduce_elementwise(op, components);
  }
  if (!components.empty() && components[0].valid() && is_half(components[0].dtype())) {
    // Reduced along the axis and across replicas in float32, rounded once at the end (a replica
    // of another dtype fails the checks below, with the dtypes in the message).
    bool same = true;
    for (const auto& t : components)
      same = same && t.valid() && t.dtype() == components[0].dtype();
    if (same) {
      std::vector<tensor> wide;
      wide.reserve(components.size());
      for (const auto& t : components)
        wide.push_back(convert_floating(t, dtype::float32));
      return convert_floating(reduce_components(op, wide, axis), components[0].dtype());
    }
  }
  if (components.empty())
    throw_error(errc::invalid_argument, "reduce needs at least one replica's value");
  const auto& first = components[0];
  for (size_t i = 0; i < components.size(); ++i) {
    const auto& t = components[i];
    auto who = "replica " + std::to_string(i);
    if (!t.valid())
      throw_error(errc::invalid_argument,
                  "reduce: " + who + "'s value is a default-constructed tensor");
    reject_bool(t, "reduce: " + who + "'s value");
  }
  const int64_t ax = normalize_axis(*axis, first.rank(), "reduce");
  for (size_t i = 1; i < components.size(); ++i) {
    const auto& t = components[i];
    if (t.dtype() != first.dtype())
      throw_error(errc::dtype_mismatch, "reduce: replica " + std::to_string(i) + " has dtype " +
                                            to_string(t.dtype()) + " but replica 0 has dtype " +
                                            to_string(first.dtype()));
    bool same = t.rank() == first.rank();
    for (int64_t d = 0; same && d < first.rank(); ++d)
      same = d == ax || t.shape()[static_cast<size_t>(d)] == first.shape()[static_cast<size_t>(d)];
    if (!same)
      throw_error(errc::shape_mismatch,
                  "reduce along axis " + std::to_string(ax) + ": replica " + std::to_string(i) +
                      " has shape " + to_string(t.shape()) + " but replica 0 has shape " +
                      to_string(first.shape()) + "; ranks and every extent but axis " +
                      std::to_string(ax) + "'s must agree");
  }
  // Reduce inside each replica (replicas with nothing along the axis add nothing), then across.
  std::vector<tensor> partials;
  int64_t total = 0;
  for (const auto& t : components) {
    const int64_t extent = t.shape()[static_cast<size_t>(ax)];
    if (extent == 0)
      continue;
    total += extent;
    partials.push_back(reduce_axis_impl(op, t, ax, /*divide=*/false));
  }
  if (partials.empty()) {
    if (op == reduce_op::min || op == reduce_op::max)
      throw_error(errc::invalid_argument,
                  std::string{"reduce "} + to_string(op) + " along axis " + std::to_string(ax) +
                      ": every replica's value is empty along that axis (replica 0 has shape " +
                      to_string(first.shape()) + "), and " + to_string(op) +
                      " of no elements is undefined");
    // As one empty axis: SUM gives 0, PROD 1, MEAN NaN (0/0).
    return reduce_axis_impl(op, first, ax, /*divide=*/true);
  }
  // Partial MEANs are sums already in the output dtype, so they are combined by SUM.
  auto combine = op == reduce_op::mean ? reduce_op::sum : op;
  auto out = reduce_elementwise(combine, partials);
  partials.clear(); // so that dividing `out` in place needs no copy when it is a partial itself
  if (op == reduce_op::mean)
    divide_in_place(out, static_cast<double>(total));
  return out;
}

nest reduce_components(reduce_op op, const std::vector<nest>& components,
                       std::optional<int64_t> axis) {
  return leafwise(components, "reduce", [&](const std::vector<tensor>& column) {
    return reduce_components(op, column, axis);
  });
}

nest concat_components(const std::vector<nest>& components, int64_t axis) {
  // Results of gather land on the host, as tf.distribute's do.
  return leafwise(components, "gather", [&](const std::vector<tensor>& column) {
    return concat_impl(on_host(column), axis, "gather", "replica");
  });
}

} // namespace consort
