#include "actors/context_scope.hpp"
#include "actors/replica_services.hpp"

#include <consort/replica_context.hpp>

namespace consort {

namespace detail {

namespace {

thread_local thread_context this_thread_context;

std::string describe(const thread_context& ctx) {
  return "replica " + std::to_string(ctx.replica_id) + ", step " + std::to_string(ctx.step);
}

template <class T>
std::vector<nest> components_of(const per_replica<T>& value, size_t replicas) {
  if (value.size() != replicas)
    throw_error(errc::invalid_argument,
                "merge_call's function returned a per_replica value of " +
                    std::to_string(value.size()) + " components for " + std::to_string(replicas) +
                    " local replicas; return one component per replica, or a plain value for all");
  std::vector<nest> out;
  out.reserve(replicas);
  for (const auto& v : value)
    out.emplace_back(v);
  return out;
}

} // namespace

const thread_context& current_context() noexcept {
  return this_thread_context;
}

context_scope::context_scope(thread_context ctx) noexcept : previous_(this_thread_context) {
  this_thread_context = ctx;
}

context_scope::~context_scope() {
  this_thread_context = previous_;
}

void require_cross_replica_context(const char* call) {
  const auto& ctx = this_thread_context;
  if (ctx.kind != context_kind::replica)
    return;
  throw_error(errc::invalid_argument,
              std::string{call} +
                  " requires cross-replica context, and it was called inside a "
                  "step function (replica context of " +
                  describe(ctx) +
                  "); call it outside strategy.run, or from a function given to "
                  "replica_context::merge_call, which runs in cross-replica context");
}

void require_not_in_merge(const char* call) {
  const auto& ctx = this_thread_context;
  if (ctx.kind != context_kind::merge)
    return;
  throw_error(errc::invalid_argument,
              std::string{call} +
                  " requires replica context, and it was called inside "
                  "merge_call's function (cross-replica context of " +
                  describe(ctx) +
                  "), where the other replicas wait in merge_call; use strategy.reduce or "
                  "strategy.gather there, or make the call in the step function");
}

std::vector<nest> merge_results(const per_replica<tensor>& value, size_t replicas) {
  return components_of(value, replicas);
}

std::vector<nest> merge_results(const per_replica<nest>& value, size_t replicas) {
  return components_of(value, replicas);
}

std::vector<nest> merge_results(const nest& value, size_t replicas) {
  return std::vector<nest>(replicas, value);
}

} // namespace detail

namespace {

/// Whether every leaf of `value` is labelled `device` already (labels are canonical, so a
/// match means `t.to(device)` would return `t` as it is).
bool all_on(const nest& value, const std::string& device) {
  if (value.is_tensor())
    return value.as_tensor().device() == device;
  if (value.is_list()) {
    for (const auto& child : value.as_list())
      if (!all_on(child, device))
        return false;
    return true;
  }
  for (const auto& [key, child] : value.as_dict())
    if (!all_on(child, device))
      return false;
  return true;
}

/// Results come back from the collective actor in host memory; label them with this replica's
/// device (free between CPU devices, which share host memory). A result already labelled so (a
/// lone CPU:0 replica's, the common case across workers) is returned as it is, without the
/// rebuild of its nest.
nest on_device(nest value, const std::string& device) {
  if (all_on(value, device))
    return value;
  return map_structure(value, [&](const tensor& t) { return t.to(device); });
}

/// The tensor of a nest that is this function's own, moved out of it (no new count on its
/// storage, no copy of its label and shape). @throws error(structure_mismatch) for another nest.
tensor leaf_of(nest value) {
  const auto& leaf = value.as_tensor();
  return std::move(const_cast<tensor&>(leaf)); // `value` is not const: it is this function's
}

} // namespace

nest replica_context::all_reduce(op_arg op, const nest& value, collective_options opts) {
  return call(collective_kind::all_reduce, value, opts, [&](auto& req) { req.op = op.get(); });
}

tensor replica_context::all_reduce(op_arg op, const tensor& value, collective_options opts) {
  // The commonest call, with nothing to build (replica_services::all_reduce).
  if (detail::current_context().kind == detail::context_kind::merge)
    detail::require_not_in_merge("replica_context::all_reduce");
  auto result = services_->all_reduce(op.get(), value, opts.timeout);
  if (result.device() == device_)
    return result;
  return result.to(device_);
}

nest replica_context::all_gather(const nest& value, int64_t axis, collective_options opts) {
  return call(collective_kind::all_gather, value, opts, [&](auto& req) { req.axis = axis; });
}

tensor replica_context::all_gather(const tensor& value, int64_t axis, collective_options opts) {
  return leaf_of(
      call(collective_kind::all_gather, nest(value), opts, [&](auto& req) { req.axis = axis; }));
}

nest replica_context::broadcast(const nest& value, int root_replica, collective_options opts) {
  return call(collective_kind::broadcast, value, opts, [&](auto& req) { req.root = root_replica; });
}

tensor replica_context::broadcast(const tensor& value, int root_replica, collective_options opts) {
  return leaf_of(call(collective_kind::broadcast, nest(value), opts,
                      [&](auto& req) { req.root = root_replica; }));
}

void replica_context::synchronize() {
  services_->synchronize();
}

nest replica_context::merge(detail::merge_function fn, std::vector<nest> args,
                            const std::type_info& signature) {
  detail::require_not_in_merge("replica_context::merge_call");
  return on_device(services_->merge(std::move(fn), std::move(args), signature), device_);
}

template <class Fill>
nest replica_context::call(collective_kind kind, nest value, collective_options opts, Fill&& fill) {
  if (detail::current_context().kind == detail::context_kind::merge)
    detail::require_not_in_merge(
        (std::string{"replica_context::"} + consort::to_string(kind)).c_str());
  detail::collective_request req;
  req.kind = kind;
  req.value = std::move(value);
  req.timeout = opts.timeout;
  fill(req);
  return on_device(services_->collective(std::move(req)), device_);
}

} // namespace consort
