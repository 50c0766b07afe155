#pragma once

#include <consort/per_replica.hpp>
#include <consort/replica_context.hpp>
#include <consort/tensor.hpp>

#include <string>
#include <utility>
#include <vector>

namespace consort {

/// A value with one identical component per destination device (tf.distribute's `Mirrored`).
template <class T>
using mirrored = per_replica<T>;

/// tf.distribute's `CrossDeviceOps`: reduce and broadcast between devices of this worker.
/// Destinations are device strings ("CPU:0", ...). On CPU devices host memory is shared, so a
/// result is computed once and every destination's component shares its storage.
///
/// Thread safety: thread-safe (it holds no mutable state).
class cross_device_ops {
public:
  virtual ~cross_device_ops() = default;

  /// Reduces `value` across its components and places the result on every destination.
  /// @throws error(unknown_device | unsupported | invalid_argument) for bad destinations.
  virtual mirrored<tensor> reduce(op_arg op, const per_replica<tensor>& value,
                                  const std::vector<std::string>& destinations) const;

  /// Several `reduce`s; the i-th result belongs to the i-th (value, destinations) pair.
  std::vector<mirrored<tensor>> batch_reduce(
      op_arg op,
      const std::vector<std::pair<per_replica<tensor>, std::vector<std::string>>>& pairs) const;

  /// Copies `value` to every destination.
  virtual mirrored<tensor> broadcast(const tensor& value,
                                     const std::vector<std::string>& destinations) const;
};

/// The host-memory implementation used for CPU replicas (TF's `ReductionToOneDevice`).
class reduction_to_one_device : public cross_device_ops {};

} // namespace consort
