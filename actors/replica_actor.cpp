// The replica actor: one per device, on a thread of its own, running step functions in order.

#include "actors/collective_paths.hpp"
#include "actors/context_scope.hpp"
#include "actors/cross_phase.hpp"
#include "actors/protocol.hpp"
#include <consort/strategy.hpp>

#include "actors/gpu_collectives.hpp"
#include "device/gpu.hpp"

#include <caf/all.hpp>

#include <memory>

#include <sstream>

namespace consort {

namespace {

/// Extra time the replica waits beyond a collective's own deadline: the collective actor
/// enforces the deadline and answers with the detailed error; this is the last resort if the
/// collective actor itself is gone.
constexpr std::chrono::milliseconds reply_grace{2000};

/// How long a replica that waits for its peers' collective calls keeps polling, yielding its core
/// between polls, before it blocks. The replicas of a step start some tens of microseconds apart
/// (each is woken for its step), and a blocked replica costs another wake-up when the last one
/// arrives; yielding leaves the core to a peer that needs it. No busy spin comes first: a
/// spinning replica kept a peer that shares its core from arriving (bench/README.md, "a waiting
/// replica polls", has the figures).
constexpr std::chrono::microseconds collective_spin{0};
constexpr std::chrono::microseconds collective_poll{200};

} // namespace

/// What runs a replica's steps: the engine side of the replica_context its steps see. The replica
/// actor runs every step through it on its own thread; a lone CPU replica's step may also run on
/// the thread that called `strategy.run` (step_launcher::run_here), never both at once.
struct replica_runner : detail::replica_services {
  replica_config cfg;
  collective_actor coll;
  caf::actor_system* sys = nullptr;
  step_id current_step = 0;
  uint32_t next_seq = 0;
  uint32_t next_merge_seq = 0;
  /// The join of the step being run (null between steps).
  step_join* join = nullptr;
  /// The collective work that other threads queued on the GPU stream below, not yet seen to
  /// finish (declared first: the binding's fence uses it, so it goes last).
  std::shared_ptr<detail::replica_queue> queue;
  /// A GPU replica's device and stream, bound on its own thread at its first step.
  std::unique_ptr<detail::gpu::replica_binding> gpu;
  /// The GPU of cfg.device, or -1 for a CPU replica.
  int gpu_index = -1;
  /// Steps finished, on any thread (the launcher counts those it gave the runner).
  std::atomic<uint64_t> finished{0};

  nest collective(detail::collective_request request) override {
    auto seq = next_seq++;
    auto timeout = request.timeout.value_or(cfg.collective_timeout);
    request.timeout = timeout;
    auto kind = request.kind;
    // No wait for this replica's stream: NCCL queues the call on it, after the work that made the
    // inputs; a call that takes another path waits for the stream where the tensors are read.
    // One way for every call: the board. A board of one CPU replica completes it on arrival (it
    // has no stream: no count taken on the queue); a GPU replica's NCCL call is queued from the
    // board too, by the thread of the last replica to arrive.
    const bool alone = detail::completes_on_arrival(*cfg.board, gpu != nullptr);
    collective_call call{current_step,       seq, cfg.replica_id,
                         std::move(request), {},  alone ? nullptr : queue};
    if (alone)
      return detail::collect_alone(*cfg.board, call);
    if (join != nullptr)
      call.finished_peers = join->mark_collective_used();
    auto [state, fut] = make_future<nest>();
    direct_collect(*cfg.board, *sys, coll, std::move(call), state);
    // The board answers by the collective's deadline (the actor's tick, with the detailed
    // error); the grace covers a collective actor that is gone.
    if (!state->wait_until(std::chrono::steady_clock::now() + timeout + reply_grace,
                           collective_spin, collective_poll)) {
      std::ostringstream what;
      what << to_string(kind) << " #" << seq << " of step " << current_step << " on replica "
           << cfg.replica_id << ": no answer from the collective actor within "
           << (timeout + reply_grace).count() << " ms";
      throw error(errc::collective_timeout, what.str());
    }
    auto result = fut.get(); // throws the collective's consort::error
    // A replica's collective result lives on its own device, as in tf.distribute (the combining
    // may have happened on the host or another GPU).
    if (gpu)
      result = detail::on_replica_device(result, cfg.device);
    return result;
  }

  tensor all_reduce(reduce_op op, const tensor& value,
                    std::optional<std::chrono::milliseconds> timeout) override {
    auto& board = *cfg.board;
    if (board.cfg.cross != nullptr && detail::completes_on_arrival(board, gpu != nullptr))
      return detail::alone_all_reduce(*board.cfg.cross, value, op, current_step, next_seq++,
                                      cfg.replica_id, timeout.value_or(cfg.collective_timeout),
                                      board.recorder.get());
    detail::collective_request request;
    request.kind = collective_kind::all_reduce;
    request.op = op;
    request.value = nest(value);
    request.timeout = timeout;
    auto result = collective(std::move(request));
    return std::move(const_cast<tensor&>(result.as_tensor())); // `result` is this function's
  }

  nest merge(detail::merge_function fn, std::vector<nest> args,
             const std::type_info& signature) override {
    auto seq = next_merge_seq++;
    auto refused = [&](const char* why) {
      return error(errc::invalid_argument, "merge_call #" + std::to_string(seq) + " of step " +
                                               std::to_string(current_step) + " on replica " +
                                               std::to_string(cfg.replica_id) + ": " + why);
    };
    if (join == nullptr)
      throw refused("the step was not started by a strategy (no rendezvous of its replicas)");
    strategy* owner = cfg.owner ? cfg.owner->load(std::memory_order_acquire) : nullptr;
    if (owner == nullptr)
      throw refused("no strategy owns this runtime, so there is none to give the function");
    const detail::thread_context merging{detail::context_kind::merge, cfg.replica_id, current_step};
    return join->merges().call(
        static_cast<size_t>(cfg.local_index), seq, std::move(args), signature,
        [&](const std::vector<std::vector<nest>>& all) {
          detail::context_scope scope{merging};
          return fn(*owner, all);
        },
        cfg.collective_timeout, cfg.step_timeout);
  }

  void synchronize() override {
    if (gpu)
      gpu->synchronize(cfg.step_timeout, "replica_context::synchronize on replica " +
                                             std::to_string(cfg.replica_id) + " in step " +
                                             std::to_string(current_step));
  }

  /// Binds this thread to the replica's GPU (once): its stream, and the queue of collective work
  /// that host waits on the stream settle first.
  void bind_gpu() {
    if (gpu || gpu_index < 0)
      return;
    gpu = std::make_unique<detail::gpu::replica_binding>(gpu_index);
    // GPU work queued before a collective may hold it up to the step's deadline.
    queue =
        std::make_shared<detail::replica_queue>(gpu->stream_owner(), gpu_index, cfg.step_timeout);
    gpu->fence([q = queue.get()] { q->settle(); });
  }
};

/// The state of a replica actor: the runner it shares with the step launcher.
struct replica_state {
  std::shared_ptr<replica_runner> runner;
  static inline const char* name = "consort.replica";
};

namespace {

using self_ptr = replica_actor::stateful_pointer<replica_state>;

bool is_collective_error(errc code) {
  return code == errc::collective_mismatch || code == errc::collective_timeout ||
         code == errc::collective_aborted;
}

} // namespace

void run_replica_step(replica_runner& st, step_message& msg) {
  st.current_step = msg.step;
  st.next_seq = 0;
  st.next_merge_seq = 0;
  st.join = msg.join.get();
  replica_context ctx{
      st.cfg.replica_id, st.cfg.num_replicas, st.cfg.local_index, st.cfg.device, msg.step, st};
  nest out;
  caf::error failure;
  auto where = [&] {
    return "replica " + std::to_string(st.cfg.replica_id) + " (" + st.cfg.device +
           ") failed step " + std::to_string(msg.step) + ": ";
  };
  try {
    if (!msg.fn)
      throw error(errc::invalid_argument, "the step message carries no step function");
    st.bind_gpu();
    if (st.queue)
      st.queue->clear_failure(); // reported in the step it happened in
    {
      detail::context_scope in_replica{
          {detail::context_kind::replica, st.cfg.replica_id, msg.step}};
      out = (*msg.fn)(ctx);
    }
    // The step's results leave this thread: its GPU work, the collectives queued on its stream
    // included, must be done (each collective by its own deadline, the rest by the step's).
    if (st.gpu)
      st.gpu->synchronize(st.cfg.step_timeout, "the GPU work of step " + std::to_string(msg.step) +
                                                   " on replica " +
                                                   std::to_string(st.cfg.replica_id));
  } catch (const error& e) {
    // Collective errors already say where they happened and must keep their code, so the
    // strategy can tell a root cause from its echoes; anything else is this replica's failure.
    if (is_collective_error(e.code()))
      failure = make_caf_error(e.code(), e.what());
    else
      failure = make_caf_error(e.code(), where() + e.what());
  } catch (const std::exception& e) {
    failure = make_caf_error(errc::step_failed, where() + e.what());
  } catch (...) {
    failure = make_caf_error(errc::step_failed, where() + "an exception not derived from "
                                                          "std::exception");
  }
  // A failed step may leave collectives queued on the stream: wait for them (each by its own
  // deadline; a stuck one aborts its communicators) so that the next step starts on a stream
  // that moves. The step's own failure is what it reports.
  if (failure && st.queue) {
    try {
      st.queue->settle();
    } catch (const std::exception&) { // NOLINT(bugprone-empty-catch): the step already failed
    }
  }
  st.join = nullptr;
  auto index = static_cast<size_t>(st.cfg.local_index);
  // Peers waiting in a merge call this replica never made fail now, not at their deadline.
  if (msg.join)
    msg.join->merges().finished(index, st.next_merge_seq,
                                failure ? to_consort_error(failure, "").what() : std::string{});
  // Tell the collective actor first, so peers waiting on a call this replica never made fail
  // now rather than at their deadline; steps without collectives skip it (see step_join).
  bool report = msg.join ? msg.join->mark_finished(index, st.next_seq, failure) : true;
  if (report) {
    // On the board, where the calls went, so that it sees them in order.
    direct_report(*st.cfg.board, *st.sys, st.coll,
                  step_report{msg.step, st.cfg.replica_id, st.next_seq, failure});
  }
  // Done with the runner: from here on the next step may start on another thread (run_here).
  st.finished.fetch_add(1, std::memory_order_release);
  if (!msg.join)
    return;
  if (failure)
    msg.join->deposit(index, std::move(failure));
  else
    msg.join->deposit(index, std::move(out));
}

bool runs_on_any_thread(const replica_runner& runner) noexcept {
  return runner.gpu_index < 0;
}

uint64_t steps_finished(const replica_runner& runner) noexcept {
  return runner.finished.load(std::memory_order_acquire);
}

replica_actor spawn_replica(caf::actor_system& sys, replica_config cfg, collective_actor coll,
                            bool detached, std::shared_ptr<replica_runner>* runner_out) {
  if (!cfg.board)
    throw_error(errc::invalid_argument,
                "replica " + std::to_string(cfg.replica_id) + " (" + cfg.device +
                    ") has no collective board; expected the one its collective actor shares "
                    "(make_collective_board, collective_config::board)");
  auto runner = std::make_shared<replica_runner>();
  runner->gpu_index = detail::gpu::index_of(cfg.device);
  runner->cfg = std::move(cfg);
  runner->coll = std::move(coll);
  runner->sys = &sys;
  if (runner_out)
    *runner_out = runner;
  auto impl = [runner](self_ptr self) -> replica_actor::behavior_type {
    self->state.runner = runner;
    return {
        [self](step_atom, step_message& msg) { run_replica_step(*self->state.runner, msg); },
    };
  };
  if (detached)
    return sys.spawn<caf::detached>(impl);
  return sys.spawn(impl);
}

} // namespace consort
