#pragma once

// What a consort::variable handle names, and the list of a strategy's variables. Private to the
// library: include/consort/variable.hpp only forward-declares variable_state.

#include <consort/strategy.hpp>
#include <consort/variable.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace consort::detail {

struct variable_state;

/// The variables of one strategy, in creation order, and the strategy itself while it exists.
///
/// Thread safety: thread-safe; `mu` guards `owner` and `list`.
struct variable_registry {
  std::mutex mu;
  /// The strategy that owns the registry: updated when the strategy moves, null once it is gone.
  strategy* owner = nullptr;
  /// Emptied when the strategy is gone (set_variable_owner): a state holds its registry, so a list
  /// kept past its strategy would keep both alive forever.
  std::vector<std::shared_ptr<variable_state>> list;
};

/// `t` labelled with (between CPU devices, which share host memory) or copied to `device`.
inline tensor placed_on(const tensor& t, const std::string& device) {
  return t.device() == device ? t : t.to(device);
}

/// One local replica's copy of a variable.
///
/// Thread safety: `mu` guards `value`. In a step only the copy's own replica writes it; outside a
/// step the caller writes every copy.
struct variable_copy {
  std::mutex mu;
  tensor value;
};

/// What a variable handle names.
struct variable_state {
  std::string name;
  consort::dtype type = consort::dtype::float32;
  shape_t shape;
  variable_options options;
  /// The devices of the local replicas, in local order (the strategy's `worker_devices`).
  std::vector<std::string> devices;
  int num_replicas_in_sync = 1;
  std::shared_ptr<variable_registry> registry;
  /// One per local replica, in local order; the vector itself never changes after creation.
  std::vector<std::unique_ptr<variable_copy>> copies;

  /// The strategy that created the variable. @throws error(shutdown) when it no longer exists.
  strategy& owner(const char* call) const;
  /// The value of local copy `index`.
  tensor read(size_t index) const;
  /// Replaces local copy `index` with `fn(current value)`; the result is placed on the copy's
  /// device.
  template <class F>
  void update(size_t index, F&& fn) {
    auto& copy = *copies[index];
    std::lock_guard<std::mutex> guard(copy.mu);
    copy.value = placed_on(fn(copy.value), devices[index]);
  }
  /// Hands local copy `index` to `fn(tensor&)`, which may change it in place through
  /// `mutable_data` (copy-on-write: a tensor someone else holds is copied first, so that holder
  /// keeps its values). `fn` must leave it on the copy's device, with its shape and dtype.
  template <class F>
  void modify(size_t index, F&& fn) {
    auto& copy = *copies[index];
    std::lock_guard<std::mutex> guard(copy.mu);
    fn(copy.value);
  }
  /// Hands local copy `index` of every variable of `states` (distinct variables: a variable listed
  /// twice would wait for its own lock) to `fn(const std::vector<tensor*>&)`, under all their
  /// locks, taken in the order given. `fn` may change them in place, as for `modify`.
  template <class F>
  static void modify_all(const std::vector<variable_state*>& states, size_t index, F&& fn) {
    std::vector<std::unique_lock<std::mutex>> locks;
    std::vector<tensor*> values;
    locks.reserve(states.size());
    values.reserve(states.size());
    for (auto* state : states) {
      auto& copy = *state->copies[index];
      locks.emplace_back(copy.mu);
      values.push_back(&copy.value);
    }
    fn(values);
  }
  /// The variable's handle.
  static variable handle(std::shared_ptr<variable_state> state) {
    return variable(std::move(state));
  }
  /// The state behind `v`. @throws error(invalid_argument) for an empty handle.
  static variable_state& of(const variable& v) { return v.state(); }
};

/// A registry owned by `owner` (a strategy calls it when it is built).
std::shared_ptr<variable_registry> make_variable_registry(strategy* owner);
/// Sets the registry's owner (null: the strategy is gone).
void set_variable_owner(variable_registry& registry, strategy* owner) noexcept;
/// Every variable of `registry` now belongs to a group of `num_replicas_in_sync` replicas (an
/// elastic group's next epoch; the local copies stay).
void set_variable_replicas(variable_registry& registry, int num_replicas_in_sync);

/// Registers a mirrored variable of zeros shaped like `like`, named `name`, with copies on the
/// devices of `like`, without any collective (zeros are the same bytes on every worker): the
/// slots of an optimizer, made on first use inside a step. Returns the existing variable when
/// one of that name exists already and has `like`'s shape and dtype.
/// @throws error(invalid_argument) when a variable of that name but another shape or dtype exists.
variable zeros_slot(const variable& like, const std::string& name);

/// Element-wise `a + b` (`sign` 1) or `a - b` (`sign` -1) on the host, in the dtype of both (which
/// must agree with their shapes). @throws error(dtype_mismatch) for bool.
tensor add_host(const tensor& a, const tensor& b, int sign);

/// Element-wise `alpha * a + beta * b` in the dtype of `a` and `b` (the factors converted to it
/// first; float16 and bfloat16 computed in float32 and rounded once): on `a`'s GPU when `a` is a
/// floating GPU tensor (gpu::scaled_sum, the same bits), on the host otherwise.
/// @throws error(dtype_mismatch) for bool.
tensor scaled_sum(const tensor& a, double alpha, const tensor& b, double beta);

/// `a += beta * b` element-wise, in place (copied first only when someone else holds `a`), with
/// `scaled_sum`'s arithmetic: on the host for a host tensor, on the GPU for a floating GPU tensor
/// (queued on the replica's stream inside a step); a GPU tensor of another dtype becomes
/// `scaled_sum(a, 1, b, beta)` on its device. @throws error(dtype_mismatch) for bool.
void add_scaled_in_place(tensor& a, const tensor& b, double beta);

/// `*a[i] += beta * b[i]` for every i, with add_scaled_in_place's arithmetic: in one kernel launch
/// per 16 tensors when every `a[i]` is a floating GPU tensor of one dtype on one GPU (an
/// optimizer's step over many variables), one by one otherwise. The `a[i]` must be distinct.
void add_scaled_in_place_all(const std::vector<tensor*>& a, const std::vector<tensor>& b,
                             double beta);

/// Adds (`sign` 1) or subtracts (`sign` -1) `delta` to local copy `index` of `v`: in place for a
/// floating copy (add_scaled_in_place; x + (-1) * y is x - y bit for bit), through `add_host`
/// otherwise. @throws error(dtype_mismatch) for bool.
void add_to_copy(variable_state& v, size_t index, const tensor& delta, int sign);

/// Checks that `x` can update `v`: its shape and dtype. `call` names the operation.
/// @throws error(shape_mismatch | dtype_mismatch) naming the variable, and both shapes or dtypes.
void check_update_value(const variable_state& v, const tensor& x, const char* call);

} // namespace consort::detail
