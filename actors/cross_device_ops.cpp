#include <consort/cross_device_ops.hpp>

#include "actors/context_scope.hpp"
#include "actors/runtime.hpp"
#include "device/gpu.hpp"

#include <consort/device.hpp>
#include <consort/error.hpp>
#include <consort/ops.hpp>

namespace consort {

namespace {

/// Parses every destination into its canonical spelling before any work is done, so that a bad
/// destination fails the call without a half-computed result.
std::vector<std::string> check_destinations(const std::vector<std::string>& destinations,
                                            const char* what) {
  if (destinations.empty())
    throw_error(errc::invalid_argument,
                std::string{what} + " needs at least one destination device; got none");
  std::vector<std::string> out;
  out.reserve(destinations.size());
  for (const auto& name : destinations) {
    auto spec = parse_device(name);
    if (spec.kind == device_kind::gpu) {
      if (!detail::gpu::built())
        throw_error(errc::unsupported, std::string{what} + ": destination \"" + name +
                                           "\" is a GPU; GPU tensors need CUDA support, which "
                                           "this build lacks");
      try {
        detail::gpu::require(spec.index);
      } catch (const error& e) {
        throw_error(e.code(), std::string{what} + ": destination \"" + name + "\": " + e.what());
      }
    }
    out.push_back(spec.to_string());
  }
  return out;
}

} // namespace

mirrored<tensor> cross_device_ops::reduce(op_arg op, const per_replica<tensor>& value,
                                          const std::vector<std::string>& destinations) const {
  auto targets = check_destinations(destinations, "cross_device_ops::reduce");
  // Host memory is shared by every CPU device: reduce once, and let every destination's
  // component share the result's storage.
  auto result = reduce_components(op.get(), value.values(), std::nullopt);
  std::vector<tensor> out;
  out.reserve(targets.size());
  for (const auto& device : targets)
    out.push_back(result.to(device));
  return mirrored<tensor>{std::move(out)};
}

std::vector<mirrored<tensor>> cross_device_ops::batch_reduce(
    op_arg op,
    const std::vector<std::pair<per_replica<tensor>, std::vector<std::string>>>& pairs) const {
  std::vector<mirrored<tensor>> out;
  out.reserve(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) {
    try {
      out.push_back(reduce(op, pairs[i].first, pairs[i].second));
    } catch (const error& e) {
      throw error(e.code(), "batch_reduce: pair " + std::to_string(i) + ": " + e.what());
    }
  }
  return out;
}

mirrored<tensor> collective_all_reduce::reduce(op_arg op, const per_replica<tensor>& value,
                                               const std::vector<std::string>& destinations) const {
  detail::require_cross_replica_context("cross_device_ops::reduce");
  auto targets = check_destinations(destinations, "cross_device_ops::reduce");
  if (value.size() != rt_->devices().size())
    throw_error(errc::invalid_argument,
                "cross_device_ops::reduce: the value has " + std::to_string(value.size()) +
                    " components, but this worker has " + std::to_string(rt_->devices().size()) +
                    " local replicas; pass one component per local replica");
  std::vector<nest> components;
  components.reserve(value.size());
  for (const auto& t : value)
    components.emplace_back(t);
  // Across every replica of every worker, as strategy.reduce does (the collective actor).
  auto result = rt_->reduce(op.get(), std::move(components), std::nullopt).get().as_tensor();
  std::vector<tensor> out;
  out.reserve(targets.size());
  for (const auto& device : targets)
    out.push_back(result.to(device));
  return mirrored<tensor>{std::move(out)};
}

mirrored<tensor> cross_device_ops::broadcast(const tensor& value,
                                             const std::vector<std::string>& destinations) const {
  auto targets = check_destinations(destinations, "cross_device_ops::broadcast");
  if (!value.valid())
    throw_error(errc::invalid_argument,
                "cross_device_ops::broadcast: the value is a default-constructed tensor");
  std::vector<tensor> out;
  out.reserve(targets.size());
  for (const auto& device : targets)
    out.push_back(value.to(device));
  return mirrored<tensor>{std::move(out)};
}

} // namespace consort
