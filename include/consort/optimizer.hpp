#pragma once

#include <consort/reduce_op.hpp>
#include <consort/replica_context.hpp>
#include <consort/tensor.hpp>
#include <consort/variable.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace consort {

/// The options of `sgd` (Keras's `tf.keras.optimizers.SGD` arguments, and how the gradients of
/// the replicas are combined).
struct sgd_options {
  /// The step size (Keras's default, 0.01).
  double learning_rate = 0.01;
  /// 0: plain SGD, `w -= learning_rate * g`. Otherwise, with a velocity `v` per variable that
  /// starts at zero: `v = momentum * v - learning_rate * g; w += v` (Keras's formula).
  double momentum = 0.0;
  /// Nesterov momentum: `w += momentum * v - learning_rate * g` after the velocity update.
  bool nesterov = false;
  /// How the replicas' gradients are combined: SUM (Keras's, for a loss already divided by the
  /// global batch size, as TF's custom-training-loop tutorial does with
  /// `compute_average_loss`) or MEAN (for a loss averaged over each replica's own batch).
  reduce_op gradient_reduction = reduce_op::sum;
  /// Gradients are all-reduced in buckets of consecutive tensors of at most this many bytes
  /// (torch DDP's `bucket_cap_mb`, 25 MiB), one collective per bucket whatever the number of
  /// tensors in it (the library fuses a nest's leaves into one call); a tensor larger than that
  /// gets a bucket of its own. 0: one all-reduce per tensor.
  size_t bucket_bytes = size_t{25} << 20;
};

/// Splits tensors of `sizes` bytes, in order, into buckets [begin, end) of consecutive tensors
/// whose sizes add up to at most `bucket_bytes`; a tensor larger than that gets a bucket of its
/// own, and `bucket_bytes` 0 gives one bucket per tensor (torch DDP's bucketing by
/// `bucket_cap_mb`). The plan `sgd::apply_gradients` all-reduces by, for a training loop that
/// all-reduces its own buckets (as the buckets fill during the backward pass) and then applies them
/// with `apply_options::skip_gradients_aggregation`.
std::vector<std::pair<size_t, size_t>> plan_gradient_buckets(const std::vector<size_t>& sizes,
                                                             size_t bucket_bytes);

/// How one `sgd::apply_gradients` call treats its gradients.
struct apply_options {
  /// The gradients are already combined across every replica of every worker (the caller
  /// all-reduced them, e.g. bucket by bucket while its backward pass ran): apply them as given,
  /// with no collective (Keras's `skip_gradients_aggregation=True`; TF 2.4's
  /// `experimental_aggregate_gradients=False`). Every replica must then pass the same values, or
  /// the copies of a mirrored variable drift apart: that is the caller's responsibility, as in
  /// Keras.
  bool skip_gradients_aggregation = false;
};

/// Stochastic gradient descent over a strategy's mirrored variables, as Keras's SGD behaves
/// under a tf.distribute strategy: `apply_gradients` is called inside a step by every replica
/// with its own gradients; it all-reduces them over every replica of every worker (SUM or MEAN,
/// `sgd_options::gradient_reduction`) and applies the same update to every copy of every
/// variable. With momentum, each variable gets a slot, a mirrored variable of zeros named
/// "<variable>/momentum" made on the first step, which `strategy.variables()` lists (so a
/// checkpoint saves it).
///
/// Thread safety: thread-safe (it holds only its options; the slots are variables of the
/// strategy); the replicas of a step share one optimizer.
class sgd {
public:
  /// @throws error(invalid_argument) for a negative or non-finite learning rate, a momentum
  ///         outside [0, 1], or a gradient reduction other than SUM or MEAN.
  explicit sgd(sgd_options options = {});

  const sgd_options& options() const noexcept { return options_; }

  /// Applies one gradient per variable (Keras's `apply_gradients(zip(grads, vars))`), inside a
  /// step, on every replica: every replica calls it with the same variables in the same order.
  /// A copy on the host is updated in place, unless someone else holds its tensor (a value read
  /// earlier, a checkpoint's snapshot): that holder keeps the old values (tensors are
  /// copy-on-write).
  /// @throws error(invalid_argument) for no pairs, an empty handle, a variable that is not
  ///         mirrored (ON_WRITE) or not floating, or one of another strategy;
  ///         error(shape_mismatch | dtype_mismatch) for a gradient unlike its variable, naming
  ///         both; the errors of the all-reduce (a replica or worker that does not call it fails
  ///         its peers at once with collective_aborted, as any collective).
  void apply_gradients(replica_context& ctx,
                       const std::vector<std::pair<tensor, variable>>& grads_and_vars,
                       const apply_options& options = {});

private:
  sgd_options options_;
};

} // namespace consort
