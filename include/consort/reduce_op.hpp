#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace consort {

/// How values from several replicas (or along an axis) combine. `sum` and `mean` are
/// tf.distribute's `ReduceOp`; `min`, `max` and `prod` go beyond it.
enum class reduce_op : uint8_t { sum, mean, min, max, prod };

/// "SUM", "MEAN", "MIN", "MAX" or "PROD" (TensorFlow's spelling).
const char* to_string(reduce_op op) noexcept;

/// Parses a reduce op name case-insensitively ("sum", "Sum", "SUM", ...).
/// @throws error(unknown_reduce_op) naming the bad input and listing the valid names.
reduce_op parse_reduce_op(std::string_view name);

} // namespace consort
