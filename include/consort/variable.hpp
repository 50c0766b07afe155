#pragma once

#include <consort/checkpoint.hpp>
#include <consort/tensor.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace consort {

/// When the copies of a variable agree (tf.VariableSynchronization).
enum class variable_synchronization : uint8_t {
  /// A mirrored variable: every update inside a step is combined across the replicas of every
  /// worker and applied to every copy, so the copies always hold the same value (TF's ON_WRITE,
  /// the default, and AUTO under a strategy).
  on_write,
  /// A sync-on-read variable: each replica updates its own copy; a read outside a step gives
  /// the aggregate of every replica's copy (TF's ON_READ, the variables of Keras metrics).
  on_read,
};

/// How the replicas' updates (on_write) or copies (on_read) are combined
/// (tf.VariableAggregation).
enum class variable_aggregation : uint8_t {
  /// No combination: a mirrored variable cannot be updated inside a step (TF's default).
  none,
  /// The sum of every replica's value.
  sum,
  /// The mean of every replica's value.
  mean,
  /// The value of replica 0 (of worker 0); the others' values are ignored.
  only_first_replica,
};

/// "ON_WRITE" or "ON_READ".
const char* to_string(variable_synchronization s) noexcept;
/// "NONE", "SUM", "MEAN" or "ONLY_FIRST_REPLICA".
const char* to_string(variable_aggregation a) noexcept;

/// How `strategy::create_variable` makes a variable (tf.Variable's `synchronization` and
/// `aggregation` arguments).
struct variable_options {
  variable_synchronization synchronization = variable_synchronization::on_write;
  /// A sync-on-read variable needs sum or mean.
  variable_aggregation aggregation = variable_aggregation::none;
};

class strategy;
class replica_context;

namespace detail {
struct variable_state;
} // namespace detail

/// A variable created by a strategy (tf.Variable created under `strategy.scope()`): one copy per
/// local replica, on that replica's device. A handle: copies of it name the same variable.
///
/// - Outside a step (cross-replica context): `value()` gives the primary copy (local replica 0's)
///   of a mirrored variable and the aggregate over every replica of every worker of a
///   sync-on-read one; `assign`, `assign_add` and `assign_sub` update every local copy.
/// - Inside a step (replica context): `ctx.read(v)` gives the replica's own copy, and
///   `ctx.assign(v, x)`, `ctx.assign_add(v, x)` and `ctx.assign_sub(v, x)` update it by the
///   rules of `replica_context` (docs/semantics.md, "Variables").
/// - `strategy.local_results(v)` gives every local copy, in local replica order.
///
/// Thread safety: thread-safe; each copy is replaced whole under the variable's lock, and a read
/// returns a tensor that later updates never change (tensors are copy-on-write).
class variable {
public:
  /// An empty handle: every call but `valid()` throws error(invalid_argument).
  variable() = default;

  bool valid() const noexcept { return state_ != nullptr; }
  /// The name given to `create_variable` (unique within its strategy).
  const std::string& name() const;
  consort::dtype dtype() const;
  const shape_t& shape() const;
  variable_synchronization synchronization() const;
  variable_aggregation aggregation() const;

  /// Outside a step: the primary copy of a mirrored variable; the SUM or MEAN over every replica
  /// of every worker of a sync-on-read one, on the host. Under `multi_worker_mirrored_strategy`
  /// the read of a sync-on-read variable is a collective: every worker reads it, in the same
  /// order.
  /// @throws error(invalid_argument) inside a step (use `ctx.read(v)` there); the errors of
  ///         `strategy::reduce` for a sync-on-read variable across workers.
  tensor value() const;

  /// Outside a step, sets every local copy to `x` (copied to each replica's device). For a
  /// sync-on-read variable with aggregation SUM, each copy gets `x / num_replicas_in_sync`, so
  /// that the aggregate reads `x` (as TF's SyncOnReadVariable.assign in cross-replica context).
  /// @throws error(invalid_argument) inside a step; error(shape_mismatch | dtype_mismatch)
  ///         when `x` does not have the variable's shape and dtype.
  void assign(const tensor& x);
  /// Outside a step, adds `x` to every local copy.
  /// @throws as `assign`; error(invalid_argument) for a sync-on-read variable with aggregation
  ///         SUM (TF refuses it too: the aggregate would grow by `x` times the replica count).
  void assign_add(const tensor& x);
  /// Outside a step, subtracts `x` from every local copy. @throws as `assign_add`.
  void assign_sub(const tensor& x);

  /// Every local copy, in local replica order (also `strategy.local_results(v)`).
  /// @throws error(invalid_argument) inside a step.
  std::vector<tensor> local_values() const;

  /// Whether both handles name the same variable.
  friend bool operator==(const variable& a, const variable& b) noexcept {
    return a.state_ == b.state_;
  }

private:
  friend class strategy;
  friend class replica_context;
  friend struct detail::variable_state;
  explicit variable(std::shared_ptr<detail::variable_state> state) : state_(std::move(state)) {}
  detail::variable_state& state() const;

  std::shared_ptr<detail::variable_state> state_;
};

} // namespace consort
