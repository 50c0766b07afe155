#pragma once

#include <consort/collective_kind.hpp>
#include <consort/nest.hpp>
#include <consort/per_replica.hpp>
#include <consort/reduce_op.hpp>
#include <consort/tensor.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace consort {

/// A reduce op given as an enumerator or as a name ("SUM", "mean", ...). Parsing a name that is
/// not a reduce op throws error(unknown_reduce_op) listing the valid ones.
class op_arg {
public:
  op_arg(reduce_op op) : op_(op) {}                               // NOLINT
  op_arg(std::string_view name) : op_(parse_reduce_op(name)) {}   // NOLINT
  op_arg(const char* name) : op_(parse_reduce_op(name)) {}        // NOLINT
  op_arg(const std::string& name) : op_(parse_reduce_op(name)) {} // NOLINT
  reduce_op get() const noexcept { return op_; }

private:
  reduce_op op_;
};

/// Per-call options of a collective.
struct collective_options {
  /// Overrides the strategy's `collective_timeout` for this call.
  std::optional<std::chrono::milliseconds> timeout;
};

class strategy;
class variable;

namespace detail {
/// The engine side of a replica_context: the replica actor implements it (private to the library:
/// actors/replica_services.hpp, not installed).
class replica_services;

/// merge_call's function, type-erased: given the strategy and every local replica's arguments (in
/// local order, one nest per argument), returns one result per local replica.
using merge_function =
    std::function<std::vector<nest>(strategy&, const std::vector<std::vector<nest>>&)>;

template <class T>
struct merge_result_traits {
  static constexpr bool valid = std::is_void_v<T> || std::is_same_v<T, tensor> ||
                                std::is_same_v<T, nest> || std::is_same_v<T, per_replica<tensor>> ||
                                std::is_same_v<T, per_replica<nest>>;
};

/// Argument `position` of every replica, as one per_replica value.
template <class T>
per_replica<T> regroup_argument(const std::vector<std::vector<nest>>& args, size_t position) {
  std::vector<T> values;
  values.reserve(args.size());
  for (const auto& replica_args : args) {
    if constexpr (std::is_same_v<T, tensor>)
      values.push_back(replica_args[position].as_tensor());
    else
      values.push_back(replica_args[position]);
  }
  return per_replica<T>(std::move(values));
}

/// What each of `replicas` replicas gets of the merge function's result: a per_replica value's
/// own component (it must have one per replica), else the same value.
std::vector<nest> merge_results(const per_replica<tensor>& value, size_t replicas);
std::vector<nest> merge_results(const per_replica<nest>& value, size_t replicas);
std::vector<nest> merge_results(const nest& value, size_t replicas);
} // namespace detail

/// What a step function sees of its replica (tf.distribute's `ReplicaContext`): its identity
/// and the collectives it can call with its peers.
///
/// Collectives are matched across replicas by their order of call within the step: the k-th
/// collective of every replica in a step must be the same kind, op, dtype, structure and axis or
/// root, else every participant gets error(collective_mismatch). Every collective has a deadline
/// (the strategy's `collective_timeout`, or `collective_options::timeout`); a peer that fails or
/// finishes its step without making the call fails the waiting replicas at once with
/// error(collective_aborted).
///
/// Thread safety: use it only on the replica's own thread, inside the step function.
class replica_context {
public:
  replica_context(int replica_id, int num_replicas, int local_index, std::string device,
                  uint64_t step, detail::replica_services& services)
      : replica_id_(replica_id), num_replicas_(num_replicas), local_index_(local_index),
        device_(std::move(device)), step_(step), services_(&services) {}

  replica_context(const replica_context&) = delete;
  replica_context& operator=(const replica_context&) = delete;

  /// This replica's id over all replicas of all workers.
  int replica_id_in_sync_group() const noexcept { return replica_id_; }
  /// Number of replicas over all workers.
  int num_replicas_in_sync() const noexcept { return num_replicas_; }
  /// This replica's position among the replicas of its own worker.
  int local_replica_index() const noexcept { return local_index_; }
  /// The device this replica is bound to, e.g. "CPU:1".
  const std::string& device() const noexcept { return device_; }
  /// The step number the strategy gave this run (0 for the first run).
  uint64_t step() const noexcept { return step_; }

  /// Reduces `value` over every replica and returns the result to each. MEAN divides by
  /// `num_replicas_in_sync()`; integer MEAN returns float64. Shapes and dtypes must agree.
  tensor all_reduce(op_arg op, const tensor& value, collective_options opts = {});
  nest all_reduce(op_arg op, const nest& value, collective_options opts = {});

  /// Concatenates every replica's `value` along `axis` in replica-id order. Sizes along `axis`
  /// may differ; rank and every other extent must agree; rank-0 values are rejected.
  tensor all_gather(const tensor& value, int64_t axis, collective_options opts = {});
  nest all_gather(const nest& value, int64_t axis, collective_options opts = {});

  /// Returns the value of replica `root_replica` to every replica. Every replica passes a value
  /// of the same structure, dtypes and shapes (its contents are ignored except on the root).
  tensor broadcast(const tensor& value, int root_replica = 0, collective_options opts = {});
  nest broadcast(const nest& value, int root_replica = 0, collective_options opts = {});

  /// Waits until the work queued so far on this replica's device has finished: its own copies
  /// and kernels, and its collectives, which on GPU replicas return once they are queued on the
  /// replica's stream (like torch.cuda.synchronize for the replica's stream). Reading a tensor on
  /// the host, and the end of the step, wait the same way; call it to time GPU work or to hand
  /// device pointers to a library that uses another stream. A CPU replica returns at once.
  /// Bounded by the strategy's step deadline.
  /// @throws error(step_timeout) when the work has not finished by then; the error of a
  /// collective that failed on the GPU (collective_timeout, peer_lost, device_error), after which
  /// every replica's collectives of that communicator fail the same way.
  void synchronize();

  /// Runs `fn(strategy, args...)` once for all of this worker's replicas, in cross-replica
  /// context, and gives every replica its part of the result (tf.distribute's
  /// `ReplicaContext.merge_call`; optimizers use it to aggregate gradients).
  ///
  /// Every local replica calls merge_call; the arguments (tensors or nests) arrive regrouped, as
  /// one `per_replica` value per argument holding every local replica's value in local order.
  /// `fn` runs on the thread of the last replica to call, with the strategy that runs the step:
  /// there it may call `strategy.reduce`, `gather` and `local_results` (in a multi-worker
  /// strategy these span every worker, whose replicas make the same merge call). `fn` returns
  /// nothing, a tensor or a nest (every replica gets it), or a per_replica value (each replica
  /// gets its own component). Merge calls are matched by their order within the step, like
  /// collectives, and every replica must make the same ones.
  /// @throws error(collective_timeout) when a local peer does not call within the strategy's
  ///         collective deadline, error(collective_aborted) when a peer finished or failed its step
  ///         without calling, error(collective_mismatch) when peers call with different functions,
  ///         and the error `fn` threw, on every replica (its code kept); error(step_timeout) on
  ///         the replicas that waited for an `fn` still running at the strategy's step deadline.
  template <class F, class... Args>
  auto merge_call(F&& fn, const Args&... args) {
    static_assert(((std::is_same_v<Args, tensor> || std::is_same_v<Args, nest>)&&...),
                  "merge_call's arguments are consort::tensor or consort::nest values");
    using R = std::invoke_result_t<F&, strategy&, per_replica<Args>...>;
    static_assert(detail::merge_result_traits<R>::valid,
                  "merge_call's function returns void, a tensor, a nest, or a per_replica of them");
    detail::merge_function erased = [&fn](strategy& s, const std::vector<std::vector<nest>>& all) {
      return invoke_merge(fn, s, all, std::index_sequence_for<Args...>{},
                          static_cast<std::tuple<Args...>*>(nullptr));
    };
    nest mine = merge(std::move(erased), std::vector<nest>{nest(args)...}, typeid(F));
    if constexpr (std::is_same_v<R, tensor> || std::is_same_v<R, per_replica<tensor>>)
      return mine.as_tensor();
    else if constexpr (std::is_same_v<R, nest> || std::is_same_v<R, per_replica<nest>>)
      return mine;
  }

  // -- variables --------------------------------------------------------------------------------

  /// This replica's copy of `v` (a variable of the strategy running the step), on its device.
  /// @throws error(invalid_argument) for an empty handle or a variable of another strategy.
  tensor read(const variable& v) const;

  /// Sets `v` to `x` (TF's `assign` in replica context). A sync-on-read variable: this replica's
  /// copy only. A mirrored variable: by its aggregation, SUM or MEAN of every replica's `x` (an
  /// all-reduce over every replica of every worker) or replica 0's `x` (ONLY_FIRST_REPLICA, a
  /// broadcast), applied to every copy; every replica makes the call, as a collective.
  /// @throws error(invalid_argument) for a mirrored variable with aggregation NONE (TF's
  ///         message), or as `read`; error(shape_mismatch | dtype_mismatch) when `x` does not
  ///         have the variable's shape and dtype; the collective's errors.
  void assign(const variable& v, const tensor& x);
  /// Adds `x` as `assign` sets it (a mirrored variable with SUM grows by the sum of every
  /// replica's `x`).
  void assign_add(const variable& v, const tensor& x);
  /// Subtracts `x` as `assign_add` adds it.
  void assign_sub(const variable& v, const tensor& x);

private:
  /// `assign` (sign 0), `assign_add` (1) or `assign_sub` (-1).
  void update_variable(const variable& v, const tensor& x, int sign, const char* call);

  template <class F, size_t... I, class... Args>
  static std::vector<nest> invoke_merge(F& fn, strategy& s,
                                        const std::vector<std::vector<nest>>& all,
                                        std::index_sequence<I...>, std::tuple<Args...>*) {
    using R = std::invoke_result_t<F&, strategy&, per_replica<Args>...>;
    if constexpr (std::is_void_v<R>) {
      fn(s, detail::regroup_argument<Args>(all, I)...);
      return detail::merge_results(nest(), all.size());
    } else {
      return detail::merge_results(fn(s, detail::regroup_argument<Args>(all, I)...), all.size());
    }
  }

  /// The type-erased merge_call: this replica's arguments in, its part of the result out.
  nest merge(detail::merge_function fn, std::vector<nest> args, const std::type_info& signature);

  /// Builds the request around `value` (`fill` sets the kind's own field), runs it, labels the
  /// result.
  template <class Fill>
  nest call(collective_kind kind, nest value, collective_options opts, Fill&& fill);

  int replica_id_;
  int num_replicas_;
  int local_index_;
  std::string device_;
  uint64_t step_;
  detail::replica_services* services_;
};

} // namespace consort
