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

/// tf.distribute's `CrossDeviceOps`: reduce and broadcast between devices of this worker (and,
/// for multi_worker_mirrored_strategy's `collective_all_reduce`, across workers).
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

namespace detail {
class runtime;
} // namespace detail

/// multi_worker_mirrored_strategy's CrossDeviceOps (TF's `CollectiveAllReduce`): `reduce` and
/// `batch_reduce` reduce across every replica of every worker, then place the result on this
/// worker's destinations. SUM over 2 workers x 1 replica, each passing 1.0, is 2.0 on both; MEAN
/// divides by `num_replicas_in_sync`. They are collectives: every worker makes the same calls in
/// the same order, with a component per local replica. `broadcast` copies within this worker, as
/// the base's does. Made by the strategy (`strategy::cross_device_ops()`), valid while it lives.
///
/// Thread safety: call from the thread that drives the strategy (the cross-replica context).
class collective_all_reduce : public cross_device_ops {
public:
  explicit collective_all_reduce(detail::runtime& rt) noexcept : rt_(&rt) {}

  /// @throws the base's errors for bad destinations, error(invalid_argument) for a value without
  ///         one component per local replica, and the cross-worker errors of `strategy::reduce`
  ///         (collective_timeout, peer_lost, ...).
  mirrored<tensor> reduce(op_arg op, const per_replica<tensor>& value,
                          const std::vector<std::string>& destinations) const override;

private:
  friend class strategy; // an elastic group's next epoch runs on another engine
  void rebind(detail::runtime& rt) noexcept { rt_ = &rt; }

  detail::runtime* rt_;
};

} // namespace consort
