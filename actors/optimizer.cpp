// Keras's SGD under a strategy: every replica's gradients all-reduced in buckets (one collective
// per bucket, its tensors fused by the library's nest all-reduce), then the same update applied
// by each replica to its own copy of every variable.

#include <consort/nest.hpp>
#include <consort/optimizer.hpp>

#include "actors/variable_state.hpp"

#include <algorithm>
#include <cmath>
#include <string>

namespace consort {

sgd::sgd(sgd_options options) : options_(options) {
  if (!std::isfinite(options_.learning_rate) || options_.learning_rate < 0)
    throw_error(errc::invalid_argument, "sgd: learning_rate must be finite and >= 0; got " +
                                            std::to_string(options_.learning_rate));
  if (!(options_.momentum >= 0 && options_.momentum <= 1))
    throw_error(errc::invalid_argument, "sgd: momentum must be in [0, 1] (Keras's rule); got " +
                                            std::to_string(options_.momentum));
  if (options_.gradient_reduction != reduce_op::sum &&
      options_.gradient_reduction != reduce_op::mean)
    throw_error(errc::invalid_argument,
                std::string{"sgd: gradient_reduction must be SUM or MEAN; got "} +
                    to_string(options_.gradient_reduction));
}

namespace {

void check_pair(replica_context& ctx, const tensor& grad, const variable& v, size_t i) {
  // Text only for an error: this runs for every pair of every step.
  auto where = [i] {
    return "apply_gradients: pair " + std::to_string(i);
  };
  if (!v.valid())
    throw_error(errc::invalid_argument, where() + " has an empty variable handle");
  if (v.synchronization() != variable_synchronization::on_write)
    throw_error(errc::invalid_argument,
                where() + ": variable \"" + v.name() +
                    "\" is sync-on-read (ON_READ); an optimizer updates mirrored variables "
                    "(ON_WRITE), whose copies it keeps equal");
  if (!is_floating(v.dtype()))
    throw_error(errc::invalid_argument, where() + ": variable \"" + v.name() + "\" is " +
                                            to_string(v.dtype()) +
                                            "; SGD updates floating variables only");
  (void)ctx.read(v); // refuses a variable of another strategy
  detail::check_update_value(detail::variable_state::of(v), grad, "apply_gradients");
}

} // namespace

std::vector<std::pair<size_t, size_t>> plan_gradient_buckets(const std::vector<size_t>& sizes,
                                                             size_t bucket_bytes) {
  std::vector<std::pair<size_t, size_t>> buckets;
  size_t i = 0;
  while (i < sizes.size()) {
    size_t j = i;
    size_t bytes = 0;
    do {
      bytes += sizes[j];
      ++j;
    } while (j < sizes.size() && bucket_bytes > 0 && bytes + sizes[j] <= bucket_bytes);
    buckets.emplace_back(i, j);
    i = j;
  }
  return buckets;
}

void sgd::apply_gradients(replica_context& ctx,
                          const std::vector<std::pair<tensor, variable>>& grads_and_vars,
                          const apply_options& apply) {
  if (grads_and_vars.empty())
    throw_error(errc::invalid_argument,
                "apply_gradients needs at least one (gradient, variable) pair; got none");
  for (size_t i = 0; i < grads_and_vars.size(); ++i)
    check_pair(ctx, grads_and_vars[i].first, grads_and_vars[i].second, i);

  // 1. All-reduce the gradients, bucket by bucket, in the order given (unless the caller did).
  std::vector<tensor> reduced;
  reduced.reserve(grads_and_vars.size());
  if (apply.skip_gradients_aggregation) {
    for (const auto& pair : grads_and_vars)
      reduced.push_back(pair.first);
  } else {
    std::vector<size_t> sizes;
    sizes.reserve(grads_and_vars.size());
    for (const auto& pair : grads_and_vars)
      sizes.push_back(pair.first.num_bytes());
    for (auto [begin, end] : plan_gradient_buckets(sizes, options_.bucket_bytes)) {
      nest::list_type bucket;
      for (size_t k = begin; k < end; ++k)
        bucket.emplace_back(grads_and_vars[k].first);
      for (auto& t : flatten(ctx.all_reduce(options_.gradient_reduction, nest::list(bucket))))
        reduced.push_back(std::move(t));
    }
  }

  // 2. Every replica holds the same reduced gradients: each updates its own copies, in place.
  const auto index = static_cast<size_t>(ctx.local_replica_index());
  const double lr = options_.learning_rate;
  const double m = options_.momentum;
  if (m == 0) {
    // Every copy at once (on a GPU, one kernel launch per 16 variables), unless a variable is
    // listed twice: then pair by pair, so that it gets both updates.
    std::vector<detail::variable_state*> states;
    states.reserve(grads_and_vars.size());
    for (const auto& pair : grads_and_vars)
      states.push_back(&detail::variable_state::of(pair.second));
    auto sorted = states;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end()) {
      detail::variable_state::modify_all(states, index, [&](const std::vector<tensor*>& copies) {
        detail::add_scaled_in_place_all(copies, reduced, -lr);
      });
      return;
    }
    for (size_t i = 0; i < states.size(); ++i)
      states[i]->modify(index, [&](tensor& w) { detail::add_scaled_in_place(w, reduced[i], -lr); });
    return;
  }
  for (size_t i = 0; i < grads_and_vars.size(); ++i) {
    const auto& v = grads_and_vars[i].second;
    const auto& g = reduced[i];
    auto& state = detail::variable_state::of(v);
    auto slot = detail::zeros_slot(v, v.name() + "/momentum");
    tensor velocity;
    detail::variable_state::of(slot).update(index, [&](const tensor& old) {
      velocity = detail::scaled_sum(old, m, g, -lr);
      return velocity;
    });
    if (options_.nesterov)
      state.update(index, [&](const tensor& w) {
        return detail::scaled_sum(detail::scaled_sum(w, 1.0, velocity, m), 1.0, g, -lr);
      });
    else
      state.modify(index, [&](tensor& w) { detail::add_scaled_in_place(w, velocity, 1.0); });
  }
}

} // namespace consort
