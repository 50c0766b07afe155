// The runtime: the actor system of one strategy, and the bridge between futures and actors.

#include "actors/runtime.hpp"

#include "actors/collective_paths.hpp"
#include "actors/flight_recorder.hpp"
#include "transport/communicator.hpp"

#include "actors/protocol.hpp"

#include <caf/all.hpp>

#include <atomic>
#include <mutex>
#include <thread>

namespace consort {

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

struct runtime::impl {
  std::vector<std::string> devices;
  strategy_options opts;
  multi_worker_setup mw;
  int first_id = 0;
  int in_sync = 0;
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  std::vector<replica_actor> replicas;
  collective_actor coll;
  step_actor strat;
  std::shared_ptr<step_launcher> launcher;
  /// The strategy object that owns this runtime (merge_call gives it to its function).
  std::atomic<strategy*> owner{nullptr};

  /// Guards `outstanding` and `closed`.
  std::mutex mtx;
  /// Future states handed out and maybe not complete yet; shutdown fails those still pending.
  std::vector<std::weak_ptr<shared_state_base>> outstanding;
  bool closed = false;

  /// Registers `state` so that shutdown can fail it; returns false when closed.
  bool track(const std::shared_ptr<shared_state_base>& state) {
    std::lock_guard<std::mutex> guard{mtx};
    if (closed)
      return false;
    // Amortised pruning keeps the list as long as the number of calls in flight.
    if (outstanding.size() >= 64 && (outstanding.size() & (outstanding.size() - 1)) == 0) {
      std::erase_if(outstanding, [](const auto& weak) {
        auto strong = weak.lock();
        return !strong || strong->done();
      });
    }
    outstanding.push_back(state);
    return true;
  }
};

runtime::runtime(std::vector<std::string> devices, strategy_options opts, multi_worker_setup mw)
    : impl_(std::make_unique<impl>()) {
  auto& d = *impl_;
  d.devices = std::move(devices);
  d.opts = opts;
  d.mw = std::move(mw);
  // The flight recorder first: a malformed CONSORT_FLIGHT_RECORDER_ENTRIES or straggler rule
  // fails before anything starts.
  if (!d.mw.recorder) {
    std::vector<std::string> names;
    if (d.mw.cross)
      names = d.mw.cross->members().names;
    if (names.empty())
      for (int w = 0; w < d.mw.num_workers; ++w)
        names.push_back("worker:" + std::to_string(w));
    d.mw.recorder = std::make_shared<flight_recorder>(
        flight_recorder::entries_for(opts.flight_recorder_entries), d.mw.worker_rank,
        std::move(names));
  }
  d.mw.recorder->set_straggler_rule(
      flight_recorder::straggler_rule_for(opts.straggler_share, opts.straggler_steps));
  // The chief (and a lone worker) knows its own clock's offset from the chief's: none.
  if (!d.mw.chief_clock)
    d.mw.recorder->set_chief_offset(0, 0);
  d.first_id = d.mw.worker_rank * static_cast<int>(d.devices.size());
  d.in_sync = d.mw.num_workers * static_cast<int>(d.devices.size());
  configure_actor_system(d.cfg);
  auto threads = opts.scheduler_threads;
  if (threads == 0)
    threads = std::thread::hardware_concurrency() > 1 ? 2 : 1;
  d.cfg.set("scheduler.max-threads", static_cast<int64_t>(threads));
  // After its short busy-poll, an idle scheduler thread should block on its condition variable
  // (woken at once by the next message) rather than poll in CAF's sleeps, whose length is added
  // to every hop on the latency path.
  d.cfg.set("work-stealing.moderate-poll-attempts", static_cast<int64_t>(0));
  d.sys = std::make_unique<caf::actor_system>(d.cfg);
  auto& sys = *d.sys;
  auto n = static_cast<int>(d.devices.size());
  collective_config ccfg;
  for (int i = 0; i < n; ++i)
    ccfg.replica_ids.push_back(d.first_id + i);
  ccfg.num_replicas_in_sync = d.in_sync;
  ccfg.default_timeout = opts.collective_timeout;
  ccfg.cross = d.mw.cross;
  ccfg.nccl_unique_id = d.mw.nccl_unique_id;
  // Shared with the replicas: a CPU replica matches its calls there on its own thread.
  ccfg.board = make_collective_board(ccfg);
  ccfg.board->recorder = d.mw.recorder;
  // GPU replicas of this process alone: their NCCL communicators are built now, not at the first
  // collective, where NCCL's initialisation would wait for the replicas' streams (issue 13).
  // A build that fails here is tried again by the first collective, which fails the step with
  // the same cause if it persists; the strategy itself starts either way, as it did before.
  if (!d.mw.cross) {
    std::string ignored;
    detail::prepare_local_nccl(*ccfg.board, d.devices, opts.collective_timeout, &ignored);
  }
  d.coll = spawn_collective(sys, ccfg);
  std::shared_ptr<replica_runner> here;
  for (int i = 0; i < n; ++i) {
    replica_config rcfg;
    rcfg.replica_id = d.first_id + i;
    rcfg.num_replicas = d.in_sync;
    rcfg.local_index = i;
    rcfg.device = d.devices[static_cast<size_t>(i)];
    rcfg.collective_timeout = opts.collective_timeout;
    rcfg.step_timeout = opts.step_timeout;
    rcfg.board = ccfg.board;
    rcfg.owner = &d.owner;
    // A lone CPU replica's blocking steps may run on the caller's thread (run_here).
    const bool lone = n == 1 && opts.run_on_caller_thread;
    d.replicas.push_back(spawn_replica(sys, rcfg, d.coll, true, lone ? &here : nullptr));
  }
  std::vector<int> ids(d.replicas.size());
  for (size_t i = 0; i < ids.size(); ++i)
    ids[i] = d.first_id + static_cast<int>(i);
  d.launcher = std::make_shared<step_launcher>(sys, d.replicas, ids, opts.step_timeout);
  if (here)
    d.launcher->run_here_through(std::move(here));
  d.strat = spawn_step_actor(sys, d.launcher);
  // CAF keeps a strong reference to the logger of the last actor system that made or spawned
  // on a thread, in that thread's storage, and the system's destructor waits for its logger to
  // go. An engine made on one thread and shut down on another (an elastic group re-formed on
  // another thread than the one that made the strategy) would wait forever: this thread lets
  // go now.
  caf::logger::set_current_actor_system(nullptr);
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
  return start(std::move(fn), false);
}

per_replica<nest> runtime::run(step_function fn) {
  return start(std::move(fn), true).get();
}

future<per_replica<nest>> runtime::start(step_function fn, bool may_run_here) {
  auto [state, fut] = make_future<step_results>();
  if (!impl_->track(state))
    return closed_future<step_results>();
  auto* recorder = impl_->mw.recorder.get();
  if (impl_->mw.chief_clock) // refreshed once a step: the heartbeats move it every 100 ms
    if (const auto offset = impl_->mw.chief_clock(); offset.known)
      recorder->set_chief_offset(offset.offset_ns, offset.delay_ns);
  // One completion, made once: a step that does not run here takes it to launch.
  step_join::completion done = [state, recorder](step_join& join) {
    recorder->step_ended(join.step(), !join.failure());
    if (join.failure())
      state->set_error(std::make_exception_ptr(to_consort_error(join.failure(), "run")));
    else
      state->set_value(join.take_results());
  };
  auto step = std::make_shared<const step_function>(std::move(fn));
  const auto launched = flight_recorder::clock::now();
  // A lone CPU replica that is idle runs a blocking step here, on the caller's thread.
  if (may_run_here &&
      impl_->launcher->run_here(
          step, [&](step_join& join) { recorder->step_started(join.step(), launched); },
          std::move(done)))
    return fut;
  // Launched from this thread: the replicas get the step without a hop through the scheduler,
  // and the last one to finish completes the future.
  auto join = impl_->launcher->launch(std::move(step), std::move(done));
  // Its number is known once launched (the step may even have ended): recorded with the time
  // it was launched at.
  if (join)
    recorder->step_started(join->step(), launched);
  return fut;
}

future<nest> runtime::reduce(reduce_op op, std::vector<nest> components,
                             std::optional<int64_t> axis) {
  auto [state, fut] = make_future<nest>();
  if (!impl_->track(state))
    return closed_future<nest>();
  caf::anon_send(impl_->coll, reduce_atom_v, host_reduce{op, std::move(components), axis}, state);
  return fut;
}

future<nest> runtime::gather(std::vector<nest> components, int64_t axis) {
  auto [state, fut] = make_future<nest>();
  if (!impl_->track(state))
    return closed_future<nest>();
  caf::anon_send(impl_->coll, gather_atom_v, host_gather{std::move(components), axis}, state);
  return fut;
}

void runtime::shutdown() {
  auto& d = *impl_;
  std::vector<std::weak_ptr<shared_state_base>> outstanding;
  {
    std::lock_guard<std::mutex> guard{d.mtx};
    if (d.closed)
      return;
    d.closed = true;
    outstanding.swap(d.outstanding);
  }
  auto reason = std::make_exception_ptr(
      error(errc::shutdown, "the strategy was shut down before the call completed"));
  for (auto& weak : outstanding)
    if (auto state = weak.lock())
      state->fail(reason);
  // The cross-worker lanes stop first, with a clean end of the mesh: every send this worker
  // started reaches its peer, and every peer is told that it leaves, so that the last collective
  // completes on every worker (and a later one fails there with peer_left, not a hang). Then no
  // replica waits on another worker and no lane thread outlives the actor system it answers
  // through. Then this worker leaves the cluster (the others do not report it lost).
  caf::error closed;
  if (d.mw.cross)
    closed = d.mw.cross->stop();
  // A step running on a caller's thread ends before the actors go (as a replica's would).
  if (d.launcher)
    d.launcher->close();
  if (d.mw.on_shutdown)
    d.mw.on_shutdown(closed);
  auto exit = caf::exit_reason::user_shutdown;
  caf::anon_send_exit(d.strat, exit);
  for (auto& r : d.replicas)
    caf::anon_send_exit(r, exit);
  caf::anon_send_exit(d.coll, exit);
  d.strat = nullptr;
  d.launcher.reset();
  d.replicas.clear();
  d.coll = nullptr;
  // Waits for every actor; a replica finishes the step it is running first.
  d.sys.reset();
  d.mw.cross.reset();
}

const std::vector<std::string>& runtime::devices() const noexcept {
  return impl_->devices;
}

int runtime::num_replicas_in_sync() const noexcept {
  return impl_->in_sync;
}

int runtime::first_replica_id() const noexcept {
  return impl_->first_id;
}

void runtime::advance_step_clock(std::chrono::nanoseconds by) {
  if (impl_ && impl_->launcher)
    impl_->launcher->advance_clock(by);
}

std::optional<std::pair<uint64_t, std::chrono::nanoseconds>> runtime::oldest_running_step() const {
  if (impl_ && impl_->launcher)
    if (auto r = impl_->launcher->oldest_running())
      return std::pair{r->step, r->deadline_in};
  return std::nullopt;
}

int runtime::worker_rank() const noexcept {
  return impl_->mw.worker_rank;
}

int runtime::num_workers() const noexcept {
  return impl_->mw.num_workers;
}

uint64_t runtime::membership_epoch() const noexcept {
  return impl_->mw.epoch;
}

bool runtime::joined_running_group() const noexcept {
  return impl_->mw.joined_running_group;
}

bool runtime::elastic() const noexcept {
  return impl_->mw.elastic;
}

void runtime::set_owner(strategy* owner) noexcept {
  impl_->owner.store(owner, std::memory_order_release);
}

const strategy_options& runtime::options() const noexcept {
  return impl_->opts;
}

flight_recorder& runtime::recorder() const noexcept {
  return *impl_->mw.recorder;
}

clock_offset runtime::chief_clock_offset() const {
  if (impl_->mw.chief_clock)
    return impl_->mw.chief_clock();
  return clock_offset{true, 0, 0, 0};
}

caf::actor_system& runtime::system() noexcept {
  return *impl_->sys;
}

} // namespace detail
} // namespace consort
