// The runtime: the actor system of one strategy, the bridge between futures and actors, and the
// conversions between caf::error and consort::error.

#include "actors/runtime.hpp"

#include <consort/actors/protocol.hpp>

#include <caf/all.hpp>

#include <atomic>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace consort {

// -- errors
// ----------------------------------------------------------------------------------------

caf::error make_caf_error(errc code, std::string message) {
  return caf::make_error(code, std::move(message));
}

namespace {

std::string context_text(const caf::error& err) {
  const auto& ctx = err.context();
  if (ctx.size() == 1 && ctx.match_element<std::string>(0))
    return ctx.get_as<std::string>(0);
  return ctx.empty() ? std::string{} : caf::to_string(ctx);
}

} // namespace

error to_consort_error(const caf::error& err, const std::string& what) {
  auto prefix = what.empty() ? std::string{} : what + ": ";
  if (err.category() == caf::atom("consort")) {
    auto code = static_cast<errc>(err.code());
    auto text = context_text(err);
    return error(code, text.empty() ? prefix + to_string(code) : text);
  }
  if (err.category() == caf::atom("system")) {
    switch (static_cast<caf::sec>(err.code())) {
    case caf::sec::request_timeout:
      return error(errc::collective_timeout,
                   prefix + "no answer from the runtime before the deadline");
    case caf::sec::request_receiver_down:
    case caf::sec::invalid_argument:
      break;
    default:
      return error(errc::shutdown, prefix + "the runtime failed: " + caf::to_string(err));
    }
    return error(errc::shutdown, prefix + "the runtime shut down before answering");
  }
  return error(errc::shutdown, prefix + "the runtime failed: " + caf::to_string(err));
}

void configure_actor_system(caf::actor_system_config& cfg) {
  cfg.add_error_category(caf::atom("consort"),
                         [](uint8_t code, caf::atom_value, const caf::message& ctx) {
                           std::string out = "consort::";
                           out += to_string(static_cast<errc>(code));
                           if (!ctx.empty())
                             out += " (" + caf::to_string(ctx) + ")";
                           return out;
                         });
}

namespace detail {
namespace {

/// A request from a public-API thread to the actors, with the future state to complete.
template <class Request, class T>
struct pending {
  Request request;
  std::shared_ptr<shared_state<T>> state;
  uint64_t id = 0;
};

using pending_run = pending<step_function_ptr, step_results>;
using pending_reduce = pending<host_reduce, nest>;
using pending_gather = pending<host_gather, nest>;

/// Margin past the strategy's own step deadline: the strategy answers first with the detailed
/// error; this only fires if the strategy actor itself is gone.
constexpr std::chrono::seconds bridge_grace{5};

} // namespace
} // namespace detail
} // namespace consort

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::detail::pending_run)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::detail::pending_reduce)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(consort::detail::pending_gather)

namespace consort::detail {

struct runtime::impl {
  std::vector<std::string> devices;
  strategy_options opts;
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  std::vector<replica_actor> replicas;
  collective_actor coll;
  strategy_actor strat;
  caf::actor bridge;

  /// Guards `outstanding`, `next_id` and `closed`.
  std::mutex mtx;
  std::unordered_map<uint64_t, std::function<void()>> outstanding;
  uint64_t next_id = 0;
  bool closed = false;

  /// Registers `state` so that shutdown can fail it; returns its id, or 0 when closed.
  template <class T>
  uint64_t track(const std::shared_ptr<shared_state<T>>& state) {
    std::lock_guard<std::mutex> guard{mtx};
    if (closed)
      return 0;
    auto id = ++next_id;
    outstanding.emplace(id, [state] {
      state->set_error(errc::shutdown, "the strategy was shut down before the call completed");
    });
    return id;
  }

  void untrack(uint64_t id) {
    std::lock_guard<std::mutex> guard{mtx};
    outstanding.erase(id);
  }

  template <class T>
  auto completer(uint64_t id, std::shared_ptr<shared_state<T>> state, std::string what) {
    return std::make_pair(
        [this, id, state](T& value) {
          state->set_value(std::move(value));
          untrack(id);
        },
        [this, id, state, what](caf::error& err) {
          state->set_error(std::make_exception_ptr(to_consort_error(err, what)));
          untrack(id);
        });
  }
};

runtime::runtime(std::vector<std::string> devices, strategy_options opts)
    : impl_(std::make_unique<impl>()) {
  auto& d = *impl_;
  d.devices = std::move(devices);
  d.opts = opts;
  configure_actor_system(d.cfg);
  auto threads = opts.scheduler_threads;
  if (threads == 0)
    threads = std::thread::hardware_concurrency() > 1 ? 2 : 1;
  d.cfg.set("scheduler.max-threads", static_cast<int64_t>(threads));
  // After its short busy-poll, an idle scheduler thread should block on its condition variable
  // (woken at once by the next message) rather than poll in 50 us sleeps, which adds up to
  // 50 us to every hop on the latency path.
  d.cfg.set("work-stealing.moderate-poll-attempts", static_cast<int64_t>(0));
  d.sys = std::make_unique<caf::actor_system>(d.cfg);
  auto& sys = *d.sys;
  auto n = static_cast<int>(d.devices.size());
  collective_config ccfg;
  for (int i = 0; i < n; ++i)
    ccfg.replica_ids.push_back(i);
  ccfg.default_timeout = opts.collective_timeout;
  d.coll = spawn_collective(sys, ccfg);
  for (int i = 0; i < n; ++i) {
    replica_config rcfg;
    rcfg.replica_id = i;
    rcfg.num_replicas = n;
    rcfg.local_index = i;
    rcfg.device = d.devices[static_cast<size_t>(i)];
    rcfg.collective_timeout = opts.collective_timeout;
    d.replicas.push_back(spawn_replica(sys, rcfg, d.coll));
  }
  d.strat = spawn_strategy(sys, d.replicas, opts.step_timeout);
  auto* self_impl = impl_.get();
  auto step_deadline = opts.step_timeout + bridge_grace;
  auto host_deadline = opts.collective_timeout + bridge_grace;
  d.bridge = sys.spawn([self_impl, step_deadline, host_deadline](caf::event_based_actor* self) {
    auto& d = *self_impl;
    return caf::behavior{
        [self, &d, step_deadline](pending_run& p) {
          auto [ok, fail] = d.completer(p.id, p.state, "run");
          self->request(d.strat, step_deadline, run_atom_v, std::move(p.request)).then(ok, fail);
        },
        [self, &d, host_deadline](pending_reduce& p) {
          auto [ok, fail] = d.completer(p.id, p.state, "reduce");
          self->request(d.coll, host_deadline, reduce_atom_v, std::move(p.request)).then(ok, fail);
        },
        [self, &d, host_deadline](pending_gather& p) {
          auto [ok, fail] = d.completer(p.id, p.state, "gather");
          self->request(d.coll, host_deadline, gather_atom_v, std::move(p.request)).then(ok, fail);
        },
    };
  });
}

runtime::~runtime() {
  shutdown();
}

namespace {

template <class T>
future<T> closed_future() {
  auto [state, fut] = make_future<T>();
  state->set_error(errc::shutdown, "the strategy has been shut down; create a new one");
  return fut;
}

} // namespace

future<per_replica<nest>> runtime::submit(step_function fn) {
  auto [state, fut] = make_future<step_results>();
  auto id = impl_->track(state);
  if (id == 0)
    return closed_future<step_results>();
  caf::anon_send(impl_->bridge,
                 pending_run{std::make_shared<const step_function>(std::move(fn)), state, id});
  return fut;
}

future<nest> runtime::reduce(reduce_op op, std::vector<nest> components,
                             std::optional<int64_t> axis) {
  auto [state, fut] = make_future<nest>();
  auto id = impl_->track(state);
  if (id == 0)
    return closed_future<nest>();
  caf::anon_send(impl_->bridge,
                 pending_reduce{host_reduce{op, std::move(components), axis}, state, id});
  return fut;
}

future<nest> runtime::gather(std::vector<nest> components, int64_t axis) {
  auto [state, fut] = make_future<nest>();
  auto id = impl_->track(state);
  if (id == 0)
    return closed_future<nest>();
  caf::anon_send(impl_->bridge,
                 pending_gather{host_gather{std::move(components), axis}, state, id});
  return fut;
}

void runtime::shutdown() {
  auto& d = *impl_;
  std::unordered_map<uint64_t, std::function<void()>> outstanding;
  {
    std::lock_guard<std::mutex> guard{d.mtx};
    if (d.closed)
      return;
    d.closed = true;
    outstanding.swap(d.outstanding);
  }
  for (auto& [id, fail] : outstanding)
    fail();
  auto reason = caf::exit_reason::user_shutdown;
  caf::anon_send_exit(d.strat, reason);
  caf::anon_send_exit(d.bridge, reason);
  for (auto& r : d.replicas)
    caf::anon_send_exit(r, reason);
  caf::anon_send_exit(d.coll, reason);
  d.strat = nullptr;
  d.bridge = nullptr;
  d.replicas.clear();
  d.coll = nullptr;
  // Waits for every actor; a replica finishes the step it is running first.
  d.sys.reset();
}

const std::vector<std::string>& runtime::devices() const noexcept {
  return impl_->devices;
}

const strategy_options& runtime::options() const noexcept {
  return impl_->opts;
}

caf::actor_system& runtime::system() noexcept {
  return *impl_->sys;
}

} // namespace consort::detail
