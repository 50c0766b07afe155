#pragma once

// Host (CPU) kernels behind reduce, gather and the collectives. Public because they are useful
// on their own and because tests check them directly; strategies call them for you.

#include <consort/nest.hpp>
#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>

#include <cstdint>
#include <optional>
#include <vector>

namespace consort {

/// The dtype a reduction of `input` with `op` produces: the input dtype, except MEAN of an
/// integer (or bool) dtype, which is float64 (never truncated).
consort::dtype reduced_dtype(reduce_op op, consort::dtype input);

/// Element-wise reduction of same-shaped, same-dtype tensors in one pass over the inputs.
/// MEAN divides by `mean_divisor` when given, else by `inputs.size()`.
/// @throws error(shape_mismatch | dtype_mismatch | invalid_argument) naming the offending input.
tensor reduce_elementwise(reduce_op op, const std::vector<tensor>& inputs,
                          std::optional<double> mean_divisor = std::nullopt);

/// Reduces `input` along `axis` (negative counts from the end), removing that axis.
/// MEAN divides by the extent of the axis; MIN/MAX of an empty axis is an error.
tensor reduce_axis(reduce_op op, const tensor& input, int64_t axis);

/// Concatenates along `axis` (negative counts from the end). Extents along `axis` may differ;
/// rank, dtype and all other extents must agree; rank-0 inputs are rejected.
tensor concat(const std::vector<tensor>& inputs, int64_t axis);

/// tf.distribute's cross-replica reduce of one component per replica:
/// - `axis` none: element-wise across components (shapes must match); MEAN divides by the count.
/// - `axis` k: reduce along k inside each component, then across components. MEAN divides by the
///   total number of elements reduced along k (a 4/2 partial batch averages over 6); components
///   with extent 0 along k add nothing.
tensor reduce_components(reduce_op op, const std::vector<tensor>& components,
                         std::optional<int64_t> axis);

/// `reduce_components` applied leaf by leaf; every component must have the same structure.
nest reduce_components(reduce_op op, const std::vector<nest>& components,
                       std::optional<int64_t> axis);

/// `concat` leaf by leaf; every component must have the same structure.
nest concat_components(const std::vector<nest>& components, int64_t axis);

/// Normalises `axis` for a tensor of `rank` (-1 is the last axis).
/// @throws error(invalid_argument) when it is out of range; `what` names the operation.
int64_t normalize_axis(int64_t axis, int64_t rank, const char* what);

} // namespace consort
