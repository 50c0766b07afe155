// The public strategies: thin facades that validate input, then hand work to the runtime's
// actors (steps) or compute on the caller's thread (blocking host reductions, which the caller
// waits for anyway).

#include <consort/device.hpp>
#include <consort/ops.hpp>
#include <consort/strategy.hpp>

#include "device/gpu.hpp"

#include "actors/context_scope.hpp"
#include "actors/flight_recorder.hpp"
#include "actors/runtime.hpp"
#include "actors/variable_state.hpp"

#include <algorithm>
#include <set>

namespace consort {

namespace detail {

per_replica<tensor> leaves_of(per_replica<nest> values) {
  std::vector<tensor> out;
  out.reserve(values.size());
  for (auto& v : values)
    out.push_back(v.as_tensor());
  return per_replica<tensor>(std::move(out));
}

} // namespace detail

namespace detail {

std::vector<std::string> canonical_devices(const std::vector<std::string>& devices) {
  if (devices.empty())
    throw_error(errc::invalid_argument,
                "a strategy needs at least one device, e.g. {\"CPU:0\", \"CPU:1\"}");
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const auto& name : devices) {
    auto spec = parse_device(name);
    if (spec.kind == device_kind::gpu) {
      if (!gpu::built())
        throw_error(errc::unsupported,
                    "device \"" + name +
                        "\" is a GPU, and this build of consort has no CUDA support; use CPU "
                        "devices (\"CPU:0\", \"CPU:1\", ...) or build with CONSORT_WITH_CUDA=ON");
      gpu::require(spec.index); // unknown_device: how many GPUs there are, or why there are none
    }
    auto canonical = spec.to_string();
    if (!seen.insert(canonical).second)
      throw_error(errc::invalid_argument, "device \"" + name +
                                              "\" appears twice in the device list; each replica "
                                              "needs a device of its own");
    out.push_back(std::move(canonical));
  }
  return out;
}

tensor on_replica_device(const tensor& value, const std::string& device) {
  if (!value.valid() || value.device() == device)
    return value;
  // Host memory serves every CPU device as it is; only a GPU on either side needs a copy.
  if (!value.on_gpu() && gpu::index_of(device) < 0)
    return value;
  return value.to(device);
}

nest on_replica_device(const nest& value, const std::string& device) {
  // The common case, host tensors for a CPU replica, passes the nest itself (no rebuild).
  if (gpu::index_of(device) < 0) {
    bool any_gpu = false;
    for (const auto& t : flatten(value))
      any_gpu = any_gpu || t.on_gpu();
    if (!any_gpu)
      return value;
  }
  return map_structure(value, [&](const tensor& t) { return on_replica_device(t, device); });
}

const strategy_options& validated(const strategy_options& opts) {
  if (opts.collective_timeout.count() <= 0 || opts.step_timeout.count() <= 0)
    throw_error(errc::invalid_argument,
                "strategy_options timeouts must be positive; got collective_timeout " +
                    std::to_string(opts.collective_timeout.count()) + " ms and step_timeout " +
                    std::to_string(opts.step_timeout.count()) + " ms");
  return opts;
}

} // namespace detail

namespace {

using detail::canonical_devices;
using detail::validated;

std::vector<nest> as_nests(const per_replica<tensor>& value) {
  std::vector<nest> out;
  out.reserve(value.size());
  for (const auto& t : value)
    out.emplace_back(t);
  return out;
}

} // namespace

strategy::strategy(std::vector<std::string> devices, strategy_options opts, kind k)
    : kind_(k), rt_(std::make_unique<detail::runtime>(canonical_devices(devices), validated(opts))),
      variables_(detail::make_variable_registry(this)),
      cross_device_ops_(std::make_unique<reduction_to_one_device>()) {
  rt_->set_owner(this);
}

strategy::strategy(std::unique_ptr<detail::runtime> rt, kind k)
    : kind_(k), rt_(std::move(rt)), variables_(detail::make_variable_registry(this)),
      cross_device_ops_(std::make_unique<reduction_to_one_device>()) {
  rt_->set_owner(this);
  // Under MultiWorkerMirroredStrategy, TF's CrossDeviceOps is the collective all-reduce.
  if (k == kind::multi_worker)
    cross_device_ops_ = std::make_unique<collective_all_reduce>(*rt_);
}

void strategy::replace_runtime(std::unique_ptr<detail::runtime> rt, std::mutex* swap_mtx) {
  std::unique_ptr<detail::runtime> previous;
  {
    std::unique_lock<std::mutex> guard;
    if (swap_mtx != nullptr)
      guard = std::unique_lock<std::mutex>{*swap_mtx};
    previous = std::move(rt_);
    rt_ = std::move(rt);
    rt_->set_owner(this);
    if (auto* collective = dynamic_cast<collective_all_reduce*>(cross_device_ops_.get()))
      collective->rebind(*rt_);
    if (variables_)
      detail::set_variable_replicas(*variables_, rt_->num_replicas_in_sync());
  }
  if (previous)
    previous->shutdown();
}

strategy::~strategy() {
  // Variables may outlive their strategy: they keep their local copies, and calls that need the
  // strategy fail with error(shutdown).
  if (variables_)
    detail::set_variable_owner(*variables_, nullptr);
}

strategy::strategy(strategy&& other) noexcept
    : kind_(other.kind_), rt_(std::move(other.rt_)), variables_(std::move(other.variables_)),
      cross_device_ops_(std::move(other.cross_device_ops_)) {
  if (rt_)
    rt_->set_owner(this);
  if (variables_)
    detail::set_variable_owner(*variables_, this);
}

strategy& strategy::operator=(strategy&& other) noexcept {
  if (this != &other) {
    if (variables_)
      detail::set_variable_owner(*variables_, nullptr);
    kind_ = other.kind_;
    rt_ = std::move(other.rt_);
    variables_ = std::move(other.variables_);
    cross_device_ops_ = std::move(other.cross_device_ops_);
    if (rt_)
      rt_->set_owner(this);
    if (variables_)
      detail::set_variable_owner(*variables_, this);
  }
  return *this;
}

int strategy::num_replicas_in_sync() const noexcept {
  return rt_->num_replicas_in_sync();
}

const std::vector<std::string>& strategy::worker_devices() const noexcept {
  return rt_->devices();
}

const strategy_options& strategy::options() const noexcept {
  return rt_->options();
}

const char* strategy::name() const noexcept {
  switch (kind_) {
  case kind::one_device:
    return "OneDeviceStrategy";
  case kind::mirrored:
    return "MirroredStrategy";
  case kind::default_strategy:
    return "DefaultStrategy";
  case kind::multi_worker:
    return "MultiWorkerMirroredStrategy";
  }
  return "Strategy";
}

std::vector<int> strategy::local_replica_ids() const {
  std::vector<int> ids(num_local_replicas());
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = rt_->first_replica_id() + static_cast<int>(i);
  return ids;
}

namespace {

void check_run(const step_function& fn) {
  detail::require_cross_replica_context("strategy.run");
  if (const auto& ctx = detail::current_context(); ctx.kind == detail::context_kind::merge)
    throw_error(errc::invalid_argument,
                "strategy.run cannot be called inside merge_call's function (replica " +
                    std::to_string(ctx.replica_id) + ", step " + std::to_string(ctx.step) +
                    "): the replicas wait in merge_call, so they would never start the new step; "
                    "return from the function and run the next step after this one");
  if (!fn)
    throw_error(errc::invalid_argument, "run needs a step function; got an empty one");
}

} // namespace

future<per_replica<nest>> strategy::submit(step_function fn) {
  check_run(fn);
  return rt_->submit(std::move(fn));
}

per_replica<nest> strategy::run_step(step_function fn) {
  check_run(fn);
  return rt_->run(std::move(fn));
}

void strategy::check_local_results() const {
  detail::require_cross_replica_context("strategy.local_results");
}

void strategy::check_components(size_t count) const {
  if (count != num_local_replicas())
    throw_error(errc::invalid_argument,
                "a per_replica value has " + std::to_string(count) +
                    " components, but this strategy has " + std::to_string(num_local_replicas()) +
                    " local replicas; pass one component per replica (or a plain value for all)");
}

void strategy::check_multi_replica_plain(reduce_op op) const {
  if (kind_ == kind::mirrored && num_local_replicas() > 1 && op != reduce_op::mean &&
      op != reduce_op::min && op != reduce_op::max)
    throw_error(errc::unsupported,
                std::string{"reduce("} + to_string(op) +
                    ") of a plain tensor under MirroredStrategy with " +
                    std::to_string(num_local_replicas()) +
                    " replicas is ambiguous: a plain value stands for the same value on every "
                    "replica, so only MEAN (or MIN/MAX) can return it unchanged; pass the "
                    "per_replica result of run() to combine per-replica values");
}

tensor strategy::reduce(op_arg op, const per_replica<tensor>& value,
                        std::optional<int64_t> axis) const {
  detail::require_cross_replica_context("strategy.reduce");
  check_components(value.size());
  if (kind_ == kind::multi_worker)
    return reduce_async(op, value, axis).get();
  return reduce_components(op.get(), value.values(), axis);
}

nest strategy::reduce(op_arg op, const per_replica<nest>& value,
                      std::optional<int64_t> axis) const {
  detail::require_cross_replica_context("strategy.reduce");
  check_components(value.size());
  if (kind_ == kind::multi_worker)
    return reduce_async(op, value, axis).get();
  return reduce_components(op.get(), value.values(), axis);
}

tensor strategy::reduce(op_arg op, const tensor& value, std::optional<int64_t> axis) const {
  detail::require_cross_replica_context("strategy.reduce");
  if (kind_ == kind::multi_worker) {
    // One contribution per worker, reduced across workers (docs/semantics.md).
    return rt_->reduce(op.get(), {nest(value)}, axis).get().as_tensor();
  }
  check_multi_replica_plain(op.get());
  if (axis)
    return reduce_axis(op.get(), value, *axis);
  return value;
}

future<tensor> strategy::reduce_async(op_arg op, per_replica<tensor> value,
                                      std::optional<int64_t> axis) const {
  detail::require_cross_replica_context("strategy.reduce_async");
  check_components(value.size());
  return rt_->reduce(op.get(), as_nests(value), axis).then([](nest v) { return v.as_tensor(); });
}

future<nest> strategy::reduce_async(op_arg op, per_replica<nest> value,
                                    std::optional<int64_t> axis) const {
  detail::require_cross_replica_context("strategy.reduce_async");
  check_components(value.size());
  return rt_->reduce(op.get(), std::move(value.values()), axis);
}

tensor strategy::gather(const per_replica<tensor>& value, int64_t axis) const {
  detail::require_cross_replica_context("strategy.gather");
  check_components(value.size());
  if (kind_ == kind::multi_worker)
    return gather_async(value, axis).get();
  // Through concat_components: the result lands on the host, as tf.distribute's does, also for
  // one GPU replica (concat alone would return that replica's GPU tensor itself).
  return concat_components(as_nests(value), axis).as_tensor();
}

nest strategy::gather(const per_replica<nest>& value, int64_t axis) const {
  detail::require_cross_replica_context("strategy.gather");
  check_components(value.size());
  if (kind_ == kind::multi_worker)
    return rt_->gather(value.values(), axis).get();
  return concat_components(value.values(), axis);
}

tensor strategy::gather(const tensor& value, int64_t axis) const {
  detail::require_cross_replica_context("strategy.gather");
  if (kind_ == kind::multi_worker)
    return rt_->gather({nest(value)}, axis).get().as_tensor();
  // Validates rank and axis as for per-replica values, then returns the value itself.
  return concat({value}, axis);
}

future<tensor> strategy::gather_async(per_replica<tensor> value, int64_t axis) const {
  detail::require_cross_replica_context("strategy.gather_async");
  check_components(value.size());
  return rt_->gather(as_nests(value), axis).then([](nest v) { return v.as_tensor(); });
}

distributed_dataset strategy::distribute_dataset(const dataset& ds) const {
  return distributed_dataset(ds, num_replicas_in_sync(), local_replica_ids(), rt_->num_workers());
}

distributed_dataset strategy::distribute_datasets_from_function(
    const std::function<dataset(const input_context&)>& fn) const {
  if (!fn)
    throw_error(errc::invalid_argument,
                "distribute_datasets_from_function needs an input function; got an empty one");
  const input_context ctx(rt_->num_workers(), rt_->worker_rank(), num_replicas_in_sync());
  return distributed_dataset::from_per_replica_batches(fn(ctx),
                                                       static_cast<int>(num_local_replicas()));
}

const consort::cross_device_ops& strategy::cross_device_ops() const noexcept {
  return *cross_device_ops_;
}

void strategy::shutdown() {
  rt_->shutdown();
}

std::string strategy::dump_flight_recorder(const std::string& path) const {
  return rt_->recorder().dump(path, "strategy::dump_flight_recorder");
}

std::string strategy::diagnose() const {
  return rt_->recorder().diagnose();
}

clock_offset strategy::chief_clock_offset() const {
  return rt_->chief_clock_offset();
}

std::vector<straggler_stat> strategy::stragglers() const {
  if (rt_->num_workers() < 2)
    return {};
  return rt_->recorder().stragglers();
}

one_device_strategy::one_device_strategy(const std::string& device, strategy_options opts)
    : strategy({device}, opts, kind::one_device) {}

namespace {

/// tf.distribute's default for MirroredStrategy: every visible GPU, else the CPU.
std::vector<std::string> all_gpus_or_cpu() {
  const int n = detail::gpu::count();
  if (n == 0)
    return {"CPU:0"};
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i)
    out.push_back("GPU:" + std::to_string(i));
  return out;
}

} // namespace

mirrored_strategy::mirrored_strategy(strategy_options opts)
    : strategy(all_gpus_or_cpu(), opts, kind::mirrored) {}

mirrored_strategy::mirrored_strategy(std::vector<std::string> devices, strategy_options opts)
    : strategy(std::move(devices), opts, kind::mirrored) {}

default_strategy::default_strategy(strategy_options opts)
    : strategy({"CPU:0"}, opts, kind::default_strategy) {}

} // namespace consort
