// Variables created by a strategy (tf.Variable under strategy.scope()): the handle, the rules of
// reading and updating them in and out of a step, and the strategy's list of them. No actors
// here: a step's updates go through the replica's collectives, and the broadcast of an initial
// value across workers is a step like any other.

#include <consort/ops.hpp>
#include <consort/replica_context.hpp>
#include <consort/strategy.hpp>
#include <consort/variable.hpp>

#include "actors/context_scope.hpp"
#include "actors/runtime.hpp"
#include "actors/variable_state.hpp"
#include "device/gpu.hpp"

#include <string>
#include <utility>
#include <vector>

namespace consort {

const char* to_string(variable_synchronization s) noexcept {
  switch (s) {
  case variable_synchronization::on_write:
    return "ON_WRITE";
  case variable_synchronization::on_read:
    return "ON_READ";
  }
  return "?";
}

const char* to_string(variable_aggregation a) noexcept {
  switch (a) {
  case variable_aggregation::none:
    return "NONE";
  case variable_aggregation::sum:
    return "SUM";
  case variable_aggregation::mean:
    return "MEAN";
  case variable_aggregation::only_first_replica:
    return "ONLY_FIRST_REPLICA";
  }
  return "?";
}

namespace detail {

namespace {

std::string quoted(const std::string& name) {
  return "variable \"" + name + "\"";
}

template <class T>
struct host_accumulator {
  using type = T;
};
template <>
struct host_accumulator<float16_t> {
  using type = float;
};
template <>
struct host_accumulator<bfloat16_t> {
  using type = float;
};

template <class T, class F>
tensor map2_typed(const tensor& a, const tensor& b, F&& fn) {
  using A = typename host_accumulator<T>::type;
  auto out = tensor::empty(a.dtype(), a.shape());
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  T* po = out.mutable_data<T>();
  const int64_t n = a.num_elements();
  for (int64_t i = 0; i < n; ++i)
    po[i] = static_cast<T>(fn(static_cast<A>(pa[i]), static_cast<A>(pb[i])));
  return out;
}

/// `visit(T{})` with a value of the C++ type of `type` (float16_t and bfloat16_t for the 16-bit
/// floats). @throws error(dtype_mismatch) for bool, which has no arithmetic.
template <class F>
decltype(auto) with_arithmetic_type(consort::dtype type, F&& visit) {
  switch (type) {
  case dtype::float32:
    return visit(float{});
  case dtype::float64:
    return visit(double{});
  case dtype::int32:
    return visit(int32_t{});
  case dtype::int64:
    return visit(int64_t{});
  case dtype::uint8:
    return visit(uint8_t{});
  case dtype::float16:
    return visit(float16_t{});
  case dtype::bfloat16:
    return visit(bfloat16_t{});
  case dtype::boolean:
    break;
  }
  throw_error(errc::dtype_mismatch,
              "arithmetic on a bool variable is not defined; cast it to int32 first");
}

/// `fn(a[i], b[i])` element by element on the host, in the dtype of `a` and `b` (float16 and
/// bfloat16 computed in float32 and rounded once).
template <class F>
tensor map2(const tensor& a_in, const tensor& b_in, F&& fn) {
  const tensor a = a_in.on_gpu() ? a_in.to("CPU:0") : a_in;
  const tensor b = b_in.on_gpu() ? b_in.to("CPU:0") : b_in;
  return with_arithmetic_type(a.dtype(),
                              [&](auto type) { return map2_typed<decltype(type)>(a, b, fn); });
}

/// `x / n` in the dtype of `x` (integers truncate, as TF's cast of the quotient does).
tensor divide_host(const tensor& x, int n) {
  return map2(x, x, [n](auto v, auto) { return v / static_cast<decltype(v)>(n); });
}

/// Replica context; merge_call's function runs in cross-replica context, as in TF.
bool in_step() {
  return current_context().kind == context_kind::replica;
}

void require_outside_step(const variable_state& v, const char* call) {
  if (!in_step())
    return;
  throw_error(
      errc::invalid_argument,
      std::string{"variable::"} + call + " of " + quoted(v.name) +
          " was called inside a step function (replica context); inside a step use "
          "the replica context's read, assign, assign_add and assign_sub (ctx." +
          (std::string{call}.rfind("assign", 0) == 0 ? std::string{call} : std::string{"read"}) +
          "(v, ...)), which follow the variable's synchronization and aggregation");
}

} // namespace

strategy& variable_state::owner(const char* call) const {
  std::lock_guard<std::mutex> guard(registry->mu);
  if (registry->owner == nullptr)
    throw_error(errc::shutdown, std::string{call} + " of " + quoted(name) +
                                    ": the strategy that created the variable no longer exists");
  return *registry->owner;
}

tensor variable_state::read(size_t index) const {
  auto& copy = *copies[index];
  std::lock_guard<std::mutex> guard(copy.mu);
  return copy.value;
}

std::shared_ptr<variable_registry> make_variable_registry(strategy* owner) {
  auto registry = std::make_shared<variable_registry>();
  registry->owner = owner;
  return registry;
}

void set_variable_owner(variable_registry& registry, strategy* owner) noexcept {
  std::vector<std::shared_ptr<variable_state>> gone;
  {
    std::lock_guard<std::mutex> guard(registry.mu);
    registry.owner = owner;
    // The strategy is gone: the list lets go of its variables (each state holds the registry, so
    // keeping them would keep both alive forever); handles the user still holds keep theirs.
    if (!owner)
      gone.swap(registry.list);
  }
}

void set_variable_replicas(variable_registry& registry, int num_replicas_in_sync) {
  std::lock_guard<std::mutex> guard(registry.mu);
  for (auto& state : registry.list)
    state->num_replicas_in_sync = num_replicas_in_sync;
}

tensor add_host(const tensor& a, const tensor& b, int sign) {
  if (sign >= 0)
    return map2(a, b, [](auto x, auto y) { return x + y; });
  return map2(a, b, [](auto x, auto y) { return x - y; });
}

tensor scaled_sum(const tensor& a, double alpha, const tensor& b, double beta) {
  if (a.on_gpu() && is_floating(a.dtype()))
    return gpu::scaled_sum(a, alpha, b, beta);
  return map2(a, b, [alpha, beta](auto x, auto y) {
    using A = decltype(x);
    return static_cast<A>(alpha) * x + static_cast<A>(beta) * y;
  });
}

namespace {

template <class T>
void add_scaled_typed(tensor& a, const tensor& b, double beta) {
  using A = typename host_accumulator<T>::type;
  const A factor = static_cast<A>(beta);
  const T* pb = b.data<T>();
  T* pa = a.mutable_data<T>();
  const int64_t n = a.num_elements();
  for (int64_t i = 0; i < n; ++i)
    pa[i] = static_cast<T>(static_cast<A>(pa[i]) + factor * static_cast<A>(pb[i]));
}

} // namespace

void add_scaled_in_place(tensor& a, const tensor& b_in, double beta) {
  if (a.on_gpu()) {
    if (is_floating(a.dtype()))
      gpu::add_scaled_in_place(a, b_in, beta);
    else
      a = placed_on(scaled_sum(a, 1.0, b_in, beta), a.device());
    return;
  }
  const tensor b = b_in.on_gpu() ? b_in.to("CPU:0") : b_in;
  with_arithmetic_type(a.dtype(), [&](auto type) { add_scaled_typed<decltype(type)>(a, b, beta); });
}

void add_scaled_in_place_all(const std::vector<tensor*>& a, const std::vector<tensor>& b,
                             double beta) {
  bool one_launch = !a.empty();
  for (const tensor* t : a)
    one_launch = one_launch && t->on_gpu() && is_floating(t->dtype()) &&
                 t->dtype() == a.front()->dtype() && t->device() == a.front()->device();
  if (one_launch) {
    gpu::add_scaled_in_place_many(a, b, beta);
    return;
  }
  for (size_t i = 0; i < a.size(); ++i)
    add_scaled_in_place(*a[i], b[i], beta);
}

void add_to_copy(variable_state& v, size_t index, const tensor& delta, int sign) {
  v.modify(index, [&](tensor& current) {
    if (is_floating(current.dtype()))
      add_scaled_in_place(current, delta, sign >= 0 ? 1.0 : -1.0);
    else
      current = placed_on(add_host(current, delta, sign), v.devices[index]);
  });
}

void check_update_value(const variable_state& v, const tensor& x, const char* call) {
  if (!x.valid())
    throw_error(errc::invalid_argument,
                std::string{call} + " of " + quoted(v.name) + " was given an empty tensor");
  if (x.dtype() != v.type)
    throw_error(errc::dtype_mismatch, std::string{call} + " of " + quoted(v.name) + " (" +
                                          to_string(v.type) + to_string(v.shape) + ") got a " +
                                          to_string(x.dtype()) + " value; pass a " +
                                          to_string(v.type) + " tensor");
  if (x.shape() != v.shape)
    throw_error(errc::shape_mismatch, std::string{call} + " of " + quoted(v.name) + " (" +
                                          to_string(v.type) + to_string(v.shape) +
                                          ") got a value of shape " + to_string(x.shape()) +
                                          "; pass a tensor of shape " + to_string(v.shape));
}

namespace {

std::shared_ptr<variable_state> new_state(const std::string& name, const tensor& initial,
                                          variable_options options, const strategy& s) {
  auto state = std::make_shared<variable_state>();
  state->name = name;
  state->type = initial.dtype();
  state->shape = initial.shape();
  state->options = options;
  state->devices = s.worker_devices();
  state->num_replicas_in_sync = s.num_replicas_in_sync();
  for (size_t i = 0; i < state->devices.size(); ++i)
    state->copies.push_back(std::make_unique<variable_copy>());
  return state;
}

/// The registered variable called `name`, or null.
std::shared_ptr<variable_state> find_locked(const variable_registry& registry,
                                            const std::string& name) {
  for (const auto& v : registry.list)
    if (v->name == name)
      return v;
  return nullptr;
}

} // namespace

variable zeros_slot(const variable& like, const std::string& name) {
  auto& base = variable_state::of(like);
  auto& registry = *base.registry;
  std::lock_guard<std::mutex> guard(registry.mu);
  if (auto existing = find_locked(registry, name)) {
    if (existing->type != base.type || existing->shape != base.shape)
      throw_error(errc::invalid_argument,
                  "the slot " + quoted(name) + " of " + quoted(base.name) +
                      " cannot be made: a variable of that name exists with " +
                      to_string(existing->type) + to_string(existing->shape) + ", not " +
                      to_string(base.type) + to_string(base.shape));
    return variable_state::handle(existing);
  }
  auto state = std::make_shared<variable_state>();
  state->name = name;
  state->type = base.type;
  state->shape = base.shape;
  state->devices = base.devices;
  state->num_replicas_in_sync = base.num_replicas_in_sync;
  state->registry = base.registry;
  const auto zeros = tensor::zeros(base.type, base.shape);
  for (const auto& device : state->devices) {
    state->copies.push_back(std::make_unique<variable_copy>());
    state->copies.back()->value = placed_on(zeros, device);
  }
  registry.list.push_back(state);
  return variable_state::handle(std::move(state));
}

} // namespace detail

// -- variable ---------------------------------------------------------------------------------

detail::variable_state& variable::state() const {
  if (!state_)
    throw_error(errc::invalid_argument,
                "this consort::variable is an empty handle; make variables with "
                "strategy::create_variable");
  return *state_;
}

const std::string& variable::name() const {
  return state().name;
}

consort::dtype variable::dtype() const {
  return state().type;
}

const shape_t& variable::shape() const {
  return state().shape;
}

variable_synchronization variable::synchronization() const {
  return state().options.synchronization;
}

variable_aggregation variable::aggregation() const {
  return state().options.aggregation;
}

tensor variable::value() const {
  auto& s = state();
  detail::require_outside_step(s, "value");
  if (s.options.synchronization == variable_synchronization::on_write)
    return s.read(0);
  const auto op =
      s.options.aggregation == variable_aggregation::sum ? reduce_op::sum : reduce_op::mean;
  return s.owner("variable::value").reduce(op, per_replica<tensor>(local_values()), std::nullopt);
}

std::vector<tensor> variable::local_values() const {
  auto& s = state();
  detail::require_outside_step(s, "local_values");
  std::vector<tensor> out;
  out.reserve(s.copies.size());
  for (size_t i = 0; i < s.copies.size(); ++i)
    out.push_back(s.read(i));
  return out;
}

namespace {

void update_every_copy(detail::variable_state& s, const tensor& x, int sign, const char* call) {
  detail::require_outside_step(s, call);
  detail::check_update_value(s, x, call);
  const bool on_read = s.options.synchronization == variable_synchronization::on_read;
  const bool sum = s.options.aggregation == variable_aggregation::sum;
  if (on_read && sum && sign != 0)
    throw_error(errc::invalid_argument,
                std::string{"variable::"} + call + " of " + detail::quoted(s.name) +
                    ": SyncOnReadVariable does not support `" + call +
                    "` in cross-replica context when aggregation is set to "
                    "`tf.VariableAggregation.SUM` (its aggregate would change by the value times "
                    "the replica count); use assign, or update it inside a step");
  tensor value = x;
  if (on_read && sum)
    value = detail::divide_host(x, s.num_replicas_in_sync); // the aggregate then reads `x`
  for (size_t i = 0; i < s.copies.size(); ++i) {
    if (sign == 0)
      s.update(i, [&](const tensor&) { return value; });
    else
      detail::add_to_copy(s, i, value, sign);
  }
}

} // namespace

void variable::assign(const tensor& x) {
  update_every_copy(state(), x, 0, "assign");
}

void variable::assign_add(const tensor& x) {
  update_every_copy(state(), x, 1, "assign_add");
}

void variable::assign_sub(const tensor& x) {
  update_every_copy(state(), x, -1, "assign_sub");
}

// -- replica_context --------------------------------------------------------------------------

namespace {

/// The local copy of `v` that belongs to the replica of `ctx`.
/// @throws error(invalid_argument) when `v` belongs to another strategy.
size_t copy_index(const detail::variable_state& v, const replica_context& ctx) {
  const auto index = static_cast<size_t>(ctx.local_replica_index());
  if (index >= v.devices.size() || v.devices[index] != ctx.device() ||
      v.num_replicas_in_sync != ctx.num_replicas_in_sync()) {
    std::string devices;
    for (const auto& d : v.devices)
      devices += (devices.empty() ? "" : ", ") + d;
    throw_error(errc::invalid_argument,
                detail::quoted(v.name) + " was created by a strategy of " +
                    std::to_string(v.num_replicas_in_sync) + " replicas in sync on " + devices +
                    ", and this step runs on replica " +
                    std::to_string(ctx.replica_id_in_sync_group()) + " of " +
                    std::to_string(ctx.num_replicas_in_sync()) + " (" + ctx.device() +
                    "); use the variables of the strategy that runs the step");
  }
  return index;
}

} // namespace

tensor replica_context::read(const variable& v) const {
  auto& s = v.state();
  return s.read(copy_index(s, *this));
}

void replica_context::assign(const variable& v, const tensor& x) {
  update_variable(v, x, 0, "assign");
}

void replica_context::assign_add(const variable& v, const tensor& x) {
  update_variable(v, x, 1, "assign_add");
}

void replica_context::assign_sub(const variable& v, const tensor& x) {
  update_variable(v, x, -1, "assign_sub");
}

void replica_context::update_variable(const variable& v, const tensor& x, int sign,
                                      const char* call) {
  auto& s = v.state();
  const auto index = copy_index(s, *this);
  detail::require_not_in_merge((std::string{"replica_context::"} + call).c_str());
  detail::check_update_value(s, x, call);
  tensor delta = x;
  if (s.options.synchronization == variable_synchronization::on_write) {
    switch (s.options.aggregation) {
    case variable_aggregation::none:
      throw_error(errc::invalid_argument,
                  std::string{"replica_context::"} + call + " of " + detail::quoted(s.name) +
                      " (replica " + std::to_string(replica_id_) +
                      "): You must specify an aggregation method to update a MirroredVariable in "
                      "Replica Context. You can do so by passing an explicit value for argument "
                      "`aggregation` to tf.Variable(..). In consort: create_variable(name, "
                      "initial_value, {.aggregation = variable_aggregation::sum}) (or mean, or "
                      "only_first_replica)");
    case variable_aggregation::sum:
      delta = all_reduce(reduce_op::sum, x);
      break;
    case variable_aggregation::mean:
      delta = all_reduce(reduce_op::mean, x);
      break;
    case variable_aggregation::only_first_replica:
      delta = broadcast(x, 0);
      break;
    }
  }
  // Every replica holds the same `delta` now (or, on read, its own): each updates its own copy,
  // so every copy of a mirrored variable changes alike without one replica writing another's.
  if (sign == 0)
    s.update(index, [&](const tensor&) { return delta; });
  else
    detail::add_to_copy(s, index, delta, sign);
}

// -- strategy ---------------------------------------------------------------------------------

variable strategy::create_variable(const std::string& name, const tensor& initial_value,
                                   variable_options options) {
  detail::require_cross_replica_context("strategy.create_variable");
  const auto what = "create_variable(\"" + name + "\")";
  if (name.empty())
    throw_error(errc::invalid_argument,
                "create_variable needs a name (unique within the strategy; it is the variable's "
                "name in a checkpoint); got an empty one");
  if (!initial_value.valid())
    throw_error(errc::invalid_argument, what + " was given an empty initial value");
  const bool on_read = options.synchronization == variable_synchronization::on_read;
  if (on_read && options.aggregation != variable_aggregation::sum &&
      options.aggregation != variable_aggregation::mean)
    throw_error(errc::invalid_argument,
                what +
                    ": a sync-on-read variable (ON_READ) needs aggregation SUM or MEAN, which "
                    "says how a read outside a step combines the replicas' copies; got " +
                    to_string(options.aggregation));
  if (options.aggregation == variable_aggregation::mean && !is_floating(initial_value.dtype()))
    throw_error(errc::invalid_argument,
                what +
                    ": aggregation MEAN needs a floating dtype (float32, float64, float16 or "
                    "bfloat16); the initial value is " +
                    to_string(initial_value.dtype()) + " (use SUM, or a floating variable)");
  {
    std::lock_guard<std::mutex> guard(variables_->mu);
    if (detail::find_locked(*variables_, name))
      throw_error(errc::invalid_argument,
                  what + ": this strategy has a variable of that name already; names are unique "
                         "within a strategy (they name the variable in a checkpoint)");
  }
  auto state = detail::new_state(name, initial_value, options, *this);
  state->registry = variables_;

  std::vector<tensor> copies;
  // A worker that joined a running elastic group takes its variables' values from the group
  // (elastic_state::sync), not from a broadcast the others do not make.
  if (kind_ == kind::multi_worker && !runtime().joined_running_group() &&
      static_cast<size_t>(num_replicas_in_sync()) > num_local_replicas()) { // several workers
    // Worker 0's value to every replica of every worker: one broadcast step, whose result lands
    // on each replica's device. The descriptor check of the collective refuses initial values
    // of another shape or dtype on some worker (and, the name being the key, another name).
    try {
      auto out = run(
          [&name](replica_context& ctx, const tensor& init) {
            return ctx.broadcast(nest::dict({{name, init}}), 0);
          },
          initial_value);
      for (const auto& replica : out)
        copies.push_back(replica[name].as_tensor());
    } catch (const error& e) {
      // An elastic group that changes while its variables are made: the variable takes this
      // worker's own initial value, and the change fails the next collective, which stays
      // failed until `reform` (the loop's first `elastic_state::sync`, whose broadcast makes
      // the group's values everyone's). Some workers may have finished this broadcast and
      // others not, so a failure here could not be retried together.
      if (e.code() != errc::membership_changed || !runtime().elastic())
        throw_error(e.code(), what +
                                  ": the broadcast of worker 0's initial value failed; every "
                                  "worker creates the same variables in the same order, with "
                                  "initial values of one shape and dtype: " +
                                  std::string{e.what()});
    }
  }
  if (copies.empty()) {
    for (const auto& device : state->devices)
      copies.push_back(detail::placed_on(initial_value, device));
  }
  for (size_t i = 0; i < copies.size(); ++i)
    state->copies[i]->value = std::move(copies[i]);

  std::lock_guard<std::mutex> guard(variables_->mu);
  if (detail::find_locked(*variables_, name)) // created meanwhile on another thread
    throw_error(errc::invalid_argument,
                what + ": this strategy has a variable of that name already; names are unique "
                       "within a strategy (they name the variable in a checkpoint)");
  variables_->list.push_back(state);
  return variable(std::move(state));
}

std::vector<variable> strategy::variables() const {
  std::lock_guard<std::mutex> guard(variables_->mu);
  std::vector<variable> out;
  out.reserve(variables_->list.size());
  for (const auto& s : variables_->list)
    out.push_back(variable(s));
  return out;
}

std::vector<named_tensor> strategy::variable_values() const {
  detail::require_cross_replica_context("strategy.variable_values");
  std::vector<named_tensor> out;
  for (const auto& v : variables())
    out.push_back({v.name(), v.value()});
  return out;
}

void strategy::assign_variables(const std::vector<named_tensor>& values) {
  detail::require_cross_replica_context("strategy.assign_variables");
  const auto vars = variables();
  std::vector<const tensor*> found(vars.size(), nullptr);
  std::string missing;
  for (size_t i = 0; i < vars.size(); ++i) {
    for (const auto& [name, value] : values)
      if (name == vars[i].name())
        found[i] = &value;
    if (found[i] == nullptr)
      missing += (missing.empty() ? "\"" : ", \"") + vars[i].name() + "\"";
    else
      detail::check_update_value(*vars[i].state_, *found[i], "assign_variables");
  }
  if (!missing.empty())
    throw_error(errc::structure_mismatch,
                "assign_variables: no tensor for the variable(s) " + missing + " among the " +
                    std::to_string(values.size()) +
                    " given; every variable of the strategy needs one (by name)");
  for (size_t i = 0; i < vars.size(); ++i) {
    auto v = vars[i];
    v.assign(*found[i]);
  }
}

std::vector<tensor> strategy::local_results(const variable& v) const {
  check_local_results();
  return v.local_values();
}

} // namespace consort
