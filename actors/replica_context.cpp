#include "actors/replica_services.hpp"

#include <consort/replica_context.hpp>

namespace consort {

const char* to_string(collective_kind kind) noexcept {
  switch (kind) {
  case collective_kind::all_reduce:
    return "all_reduce";
  case collective_kind::all_gather:
    return "all_gather";
  case collective_kind::broadcast:
    return "broadcast";
  }
  return "unknown collective";
}

namespace {

/// Results come back from the collective actor in host memory; label them with this replica's
/// device (free between CPU devices, which share host memory).
nest on_device(const nest& value, const std::string& device) {
  return map_structure(value, [&](const tensor& t) { return t.to(device); });
}

} // namespace

nest replica_context::all_reduce(op_arg op, const nest& value, collective_options opts) {
  return call(collective_kind::all_reduce, value, opts, [&](auto& req) { req.op = op.get(); });
}

tensor replica_context::all_reduce(op_arg op, const tensor& value, collective_options opts) {
  return all_reduce(op, nest(value), opts).as_tensor();
}

nest replica_context::all_gather(const nest& value, int64_t axis, collective_options opts) {
  return call(collective_kind::all_gather, value, opts, [&](auto& req) { req.axis = axis; });
}

tensor replica_context::all_gather(const tensor& value, int64_t axis, collective_options opts) {
  return all_gather(nest(value), axis, opts).as_tensor();
}

nest replica_context::broadcast(const nest& value, int root_replica, collective_options opts) {
  return call(collective_kind::broadcast, value, opts, [&](auto& req) { req.root = root_replica; });
}

tensor replica_context::broadcast(const tensor& value, int root_replica, collective_options opts) {
  return broadcast(nest(value), root_replica, opts).as_tensor();
}

void replica_context::synchronize() {
  services_->synchronize();
}

template <class Fill>
nest replica_context::call(collective_kind kind, const nest& value, collective_options opts,
                           Fill&& fill) {
  detail::collective_request req;
  req.kind = kind;
  req.value = value;
  req.timeout = opts.timeout;
  fill(req);
  return on_device(services_->collective(std::move(req)), device_);
}

} // namespace consort
