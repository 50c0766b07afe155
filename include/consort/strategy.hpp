#pragma once

#include <consort/clock_offset.hpp>
#include <consort/cross_device_ops.hpp>
#include <consort/dataset.hpp>
#include <consort/future.hpp>
#include <consort/nest.hpp>
#include <consort/per_replica.hpp>
#include <consort/replica_context.hpp>
#include <consort/stragglers.hpp>
#include <consort/tensor.hpp>
#include <consort/variable.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace consort {

class cluster_resolver;

/// Options shared by every strategy.
struct strategy_options {
  /// Default deadline of every collective wait (overridable per call). Gloo's default is 30 s.
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(30)};
  /// Deadline for every replica to finish one step; a step function still running after it fails
  /// the step with error(step_timeout) naming the replicas that had not finished.
  std::chrono::milliseconds step_timeout{std::chrono::minutes(10)};
  /// Threads of the actor scheduler (0: two, or one on a one-core machine).
  size_t scheduler_threads = 0;
  /// Collectives the flight recorder keeps (docs/debugging.md): -1 takes
  /// CONSORT_FLIGHT_RECORDER_ENTRIES when set, else 2000; 0 turns it off.
  int64_t flight_recorder_entries = -1;
  /// The live straggler rule (docs/debugging.md, "A straggler"): a step's straggler entered its
  /// collectives last by more than `straggler_share` of the step's length; a worker that is it in
  /// more than half of the last `straggler_steps` steps is named. -1 takes
  /// CONSORT_STRAGGLER_SHARE / CONSORT_STRAGGLER_STEPS when set, else 0.05 and 20. Raise the share
  /// for short steps on a host whose cores the workers share: there the worker the scheduler wakes
  /// last is a few ms late.
  double straggler_share = -1;
  int straggler_steps = -1;
  /// With one CPU replica on this worker, a blocking `run` runs the step on the calling thread
  /// when no earlier step is still running (as TF's OneDeviceStrategy calls the function), which
  /// saves the hand-over to the replica's thread and back. Everything else is the same: the
  /// step's number, its order among steps from other threads, its collectives and their
  /// deadlines, its errors. One difference: the step deadline cannot stop the calling thread, so
  /// a step past it fails with step_timeout when its function returns, not at the deadline.
  /// false: every step runs on the replica's thread (`run_async` always does).
  bool run_on_caller_thread = true;
};

/// The step a replica runs: its local index is `ctx.local_replica_index()`.
using step_function = std::function<nest(replica_context&)>;

namespace detail {

class runtime;
struct joined_cluster;
struct elastic_group;
struct strategy_access;
struct variable_registry;

template <class T>
decltype(auto) unwrap_arg(const T& arg, size_t local_index) {
  if constexpr (is_per_replica_v<T>)
    return arg.values()[local_index];
  else
    return (arg);
}

/// A tensor, or the tensors of a nest, given to a replica: on a GPU replica they are copied to
/// its GPU when they live elsewhere; a GPU tensor given to a CPU replica is copied to the host.
/// Anything else, and host tensors given to CPU replicas, pass as they are.
tensor on_replica_device(const tensor& value, const std::string& device);
nest on_replica_device(const nest& value, const std::string& device);

template <class V>
const V& replica_arg(const V& value, const std::string&) {
  return value;
}
inline tensor replica_arg(const tensor& value, const std::string& device) {
  return on_replica_device(value, device);
}
inline nest replica_arg(const nest& value, const std::string& device) {
  return on_replica_device(value, device);
}

template <class T>
struct unwrapped {
  using type = std::decay_t<T>;
};
template <class T>
struct unwrapped<per_replica<T>> {
  using type = T;
};
template <class T>
using unwrapped_t = typename unwrapped<std::decay_t<T>>::type;

template <class R>
nest to_nest(R&& value) {
  using V = std::decay_t<R>;
  static_assert(std::is_same_v<V, tensor> || std::is_same_v<V, nest>,
                "a step function must return consort::tensor or consort::nest");
  return nest(std::forward<R>(value));
}

per_replica<tensor> leaves_of(per_replica<nest> values);

} // namespace detail

/// The common interface of every strategy (tf.distribute's `Strategy`).
///
/// A strategy owns its replicas: one actor per local device, each on its own thread, that runs
/// step functions in the order they are submitted. Blocking calls throw consort::error; the
/// `_async` calls return a consort::future carrying the same errors.
///
/// Thread safety: thread-safe. Steps submitted from several threads are numbered in arrival
/// order and run in that order on every replica.
///
/// Contexts, as in tf.distribute: `run`, `reduce`, `gather` and `local_results` (and their
/// `_async` forms) need cross-replica context. Called inside a step function (replica context)
/// they throw error(invalid_argument) saying so; `replica_context::merge_call` runs a function in
/// cross-replica context, where they may be called.
class strategy {
public:
  virtual ~strategy();
  strategy(const strategy&) = delete;
  strategy& operator=(const strategy&) = delete;
  strategy(strategy&&) noexcept;
  strategy& operator=(strategy&&) noexcept;

  // -- properties -------------------------------------------------------------------------------

  /// Replicas over all workers.
  int num_replicas_in_sync() const noexcept;
  /// The devices of this worker's replicas, in local replica order (canonical spelling).
  const std::vector<std::string>& worker_devices() const noexcept;
  /// Number of replicas of this worker.
  size_t num_local_replicas() const noexcept { return worker_devices().size(); }
  const strategy_options& options() const noexcept;
  /// "OneDeviceStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy" or
  /// "DefaultStrategy".
  const char* name() const noexcept;

  // -- running steps ----------------------------------------------------------------------------

  /// Runs `fn(ctx, args...)` on every local replica (tf.distribute's `Strategy.run`). An argument
  /// that is a `per_replica` gives each replica its own component; any other argument goes to
  /// every replica. `fn` returns a tensor or a nest; the result has one component per replica.
  /// @throws error(invalid_argument) when a per_replica argument has the wrong number of
  ///         components; error(step_failed | collective_* | step_timeout) when the step fails.
  /// With one CPU replica, the step may run on the calling thread
  /// (strategy_options::run_on_caller_thread).
  template <class F, class... Args>
  auto run(F&& fn, Args&&... args) {
    (check_arg(args), ...);
    auto result = run_step(make_step(std::forward<F>(fn), std::forward<Args>(args)...));
    if constexpr (std::is_same_v<run_result_t<F, Args...>, tensor>)
      return detail::leaves_of(std::move(result));
    else
      return result;
  }

  /// Like `run`, without blocking the caller.
  template <class F, class... Args>
  auto run_async(F&& fn, Args&&... args) {
    (check_arg(args), ...);
    auto result = submit(make_step(std::forward<F>(fn), std::forward<Args>(args)...));
    if constexpr (std::is_same_v<run_result_t<F, Args...>, tensor>)
      return result.then([](per_replica<nest> v) { return detail::leaves_of(std::move(v)); });
    else
      return result;
  }

  /// Runs an already type-erased step on the replicas' threads. Every `run_async` ends here.
  future<per_replica<nest>> submit(step_function fn);
  /// Runs an already type-erased step and waits for it: `submit(fn).get()`, except that a lone
  /// CPU replica may run it on this thread (strategy_options::run_on_caller_thread). Every `run`
  /// ends here.
  per_replica<nest> run_step(step_function fn);

  /// Builds a per_replica value from `fn(replica_id_in_sync_group)`, one call per local replica
  /// (tf.distribute's `experimental_distribute_values_from_function`).
  template <class F>
  auto distribute_values(F&& fn) const {
    using T = std::decay_t<std::invoke_result_t<F&, int>>;
    std::vector<T> values;
    for (int id : local_replica_ids())
      values.push_back(fn(id));
    return per_replica<T>(std::move(values));
  }

  /// Replica ids (in sync group) of this worker's replicas, in local order.
  std::vector<int> local_replica_ids() const;

  // -- reductions -------------------------------------------------------------------------------

  /// Reduces a per-replica value to one tensor on this worker's host (tf.distribute's
  /// `Strategy.reduce`). `axis` none reduces across replicas only; `axis` k first reduces along
  /// k inside each replica, MEAN then dividing by the true element count. SUM keeps the dtype;
  /// integer MEAN is float64.
  tensor reduce(op_arg op, const per_replica<tensor>& value, std::optional<int64_t> axis) const;
  nest reduce(op_arg op, const per_replica<nest>& value, std::optional<int64_t> axis) const;
  /// A plain value (not per_replica): one-device and default strategies return it (reduced
  /// along `axis` if given). Under a multi-replica `mirrored_strategy` it stands for the same
  /// value on every replica: MEAN, MIN and MAX return it, SUM and PROD are error(unsupported),
  /// because the replicas' share of it is ambiguous (TF allows only MEAN). Under
  /// `multi_worker_mirrored_strategy` it is one contribution per worker: SUM sums it across the
  /// workers (MEAN averages it, MIN, MAX and PROD combine it), a collective every worker makes.
  tensor reduce(op_arg op, const tensor& value, std::optional<int64_t> axis) const;

  /// `reduce` without blocking the caller: the work runs on the strategy's actors.
  future<tensor> reduce_async(op_arg op, per_replica<tensor> value,
                              std::optional<int64_t> axis) const;
  future<nest> reduce_async(op_arg op, per_replica<nest> value, std::optional<int64_t> axis) const;

  /// Concatenates the components along `axis` in replica-id order (tf.distribute's
  /// `Strategy.gather`); extents along `axis` may differ. A plain value is returned as is.
  tensor gather(const per_replica<tensor>& value, int64_t axis) const;
  nest gather(const per_replica<nest>& value, int64_t axis) const;
  tensor gather(const tensor& value, int64_t axis) const;
  future<tensor> gather_async(per_replica<tensor> value, int64_t axis) const;

  /// The components of `value` held by this worker (tf.distribute's
  /// `experimental_local_results`).
  template <class T>
  std::vector<T> local_results(const per_replica<T>& value) const {
    check_local_results();
    return value.values();
  }
  /// A plain value is its own only local result.
  std::vector<tensor> local_results(const tensor& value) const {
    check_local_results();
    return {value};
  }

  /// Every local copy of `v`, in local replica order.
  /// @throws error(invalid_argument) inside a step, or for an empty handle.
  std::vector<tensor> local_results(const variable& v) const;

  // -- variables --------------------------------------------------------------------------------

  /// Creates a variable with one copy per local replica on the replica's device (tf.Variable
  /// created under `strategy.scope()`). A mirrored variable (the default, synchronization
  /// on_write) starts as `initial_value` on every replica; under `multi_worker_mirrored_strategy`
  /// with several workers, worker 0's initial value is broadcast to every worker, so all start
  /// from the same bytes whatever each computed. That is a collective: every worker creates the
  /// same variables, in the same order. A sync-on-read variable (on_read) needs aggregation SUM
  /// or MEAN; its copies start as `initial_value` too (so a SUM aggregate of zeros reads zero).
  /// `name` must be unique within the strategy (it is the variable's name in a checkpoint).
  /// In an elastic group (`multi_worker_options::elastic_min_workers`), a change of the group
  /// during that broadcast does not fail the creation: the variable starts from this worker's
  /// own `initial_value`, and the change fails the next collective instead (with
  /// membership_changed, until `reform`), where the training loop re-forms and its
  /// `elastic_state::sync` gives every worker the group's values (docs/multi_worker.md, "A loss
  /// while the variables are made").
  /// @throws error(invalid_argument) inside a step, for an empty name or a name already taken, an
  ///         invalid `initial_value`, a sync-on-read variable without SUM or MEAN, or MEAN of a
  ///         non-floating dtype; across workers the collective's errors, explained
  ///         (collective_mismatch when workers gave initial values of other shapes or dtypes).
  variable create_variable(const std::string& name, const tensor& initial_value,
                           variable_options options = {});

  /// The variables of this strategy in creation order (an optimizer's slots, made on its first
  /// step, after the variables created before it).
  std::vector<variable> variables() const;

  /// The name and value (`variable::value()`, read outside a step) of every variable, in
  /// creation order: what a checkpoint saves (`save_checkpoint`, `checkpoint_manager::save`). Under
  /// several workers it reads sync-on-read variables, a collective: every worker calls it.
  /// @throws error(invalid_argument) inside a step; the errors of `variable::value()`.
  std::vector<named_tensor> variable_values() const;

  /// Sets every variable to the tensor of its name in `values` (what `variable_values` gave, or
  /// `load_checkpoint(...).tensors`), outside a step, by `variable::assign`: every local copy of
  /// a mirrored variable, and a sync-on-read one so that its aggregate reads the saved value.
  /// Names in `values` that no variable has are ignored. Nothing is assigned unless every
  /// variable has its tensor, with its dtype and shape.
  /// @throws error(invalid_argument) inside a step; error(structure_mismatch) naming the
  ///         variables `values` lacks; error(dtype_mismatch | shape_mismatch) naming the variable,
  ///         what it is and what `values` holds.
  void assign_variables(const std::vector<named_tensor>& values);

  // -- input and devices ------------------------------------------------------------------------

  /// Splits every global batch of `ds` across the replicas (see `split_batch`).
  /// @throws error(invalid_argument) when `ds` is not batched.
  distributed_dataset distribute_dataset(const dataset& ds) const;

  /// tf.distribute's `distribute_datasets_from_function`: calls `fn` once on this worker with an
  /// input_context (one input pipeline per worker: `num_input_pipelines` workers, this one's rank
  /// as `input_pipeline_id`). `fn` shards and batches its dataset itself, by the per-replica batch
  /// size (`ctx.get_per_replica_batch_size(global)`); its batches go to the local replicas in turn
  /// (see `distributed_dataset::from_per_replica_batches`).
  /// @throws error(invalid_argument) when `fn` is empty or returns an unbatched dataset; what `fn`
  ///         throws.
  distributed_dataset
  distribute_datasets_from_function(const std::function<dataset(const input_context&)>& fn) const;

  /// The cross-device ops that combine values between this worker's devices.
  const consort::cross_device_ops& cross_device_ops() const noexcept;

  /// Stops the replicas after the steps already submitted; later calls fail with
  /// error(shutdown). Called by the destructor.
  void shutdown();

  // -- debugging --------------------------------------------------------------------------------

  /// Writes this worker's flight recorder (its last collectives with their job-wide numbers,
  /// states and who they wait for, its step starts and ends, membership events) as JSON to `path`,
  /// or, when `path` is empty, to `$CONSORT_DUMP_DIR` (else the working directory) as
  /// `consort-flight-<task>-<pid>.json`; returns the path (docs/debugging.md).
  /// @throws error(invalid_argument) when the recorder is off or the file cannot be written.
  std::string dump_flight_recorder(const std::string& path = "") const;

  /// What the flight recorder says about this worker now, in one paragraph: the last collective
  /// done and every collective pending or failed since, with the workers whose part is missing,
  /// and each worker named a straggler (`stragglers()`), with the step it was named at.
  std::string diagnose() const;

  /// Per worker (in rank order), who entered the collectives between workers last over the last
  /// `strategy_options::straggler_steps` steps (20), and who was named a straggler
  /// (`straggler_stat`; the chief also logs a line when it names one). Empty with one worker or
  /// with the recorder off.
  std::vector<straggler_stat> stragglers() const;

  /// How far the chief's wall clock is from this worker's, known from the view on and refreshed
  /// by every membership heartbeat (`clock_offset`): add `offset_ns` to this worker's system-clock
  /// times to put them on the chief's clock, as `consort-train --trace` does. The chief and one
  /// worker: known, 0.
  clock_offset chief_clock_offset() const;

protected:
  /// The engine (its derived strategies and detail::strategy_access use it).
  detail::runtime& runtime() const noexcept { return *rt_; }

  enum class kind : uint8_t { one_device, mirrored, default_strategy, multi_worker };
  strategy(std::vector<std::string> devices, strategy_options opts, kind k);
  strategy(std::unique_ptr<detail::runtime> rt, kind k);

  /// Runs on `rt` from now on (an elastic group's next epoch): the variables count its replicas,
  /// and the previous engine is shut down (its calls still pending fail with error(shutdown)).
  /// The swap holds `swap_mtx` when given (not the shutdown after it).
  void replace_runtime(std::unique_ptr<detail::runtime> rt, std::mutex* swap_mtx = nullptr);

private:
  template <class F, class... Args>
  using run_result_t =
      std::decay_t<std::invoke_result_t<F&, replica_context&, detail::unwrapped_t<Args>...>>;

  /// The type-erased step of `fn(ctx, args...)`: each replica gets its component of a
  /// per_replica argument, on its device.
  template <class F, class... Args>
  static step_function make_step(F&& fn, Args&&... args) {
    return [f = std::forward<F>(fn),
            ... a = std::decay_t<Args>(std::forward<Args>(args))](replica_context& ctx) mutable {
      [[maybe_unused]] auto i = static_cast<size_t>(ctx.local_replica_index());
      return detail::to_nest(
          f(ctx, detail::replica_arg(detail::unwrap_arg(a, i), ctx.device())...));
    };
  }

  template <class T>
  void check_arg(const T& arg) const {
    if constexpr (is_per_replica_v<T>)
      check_components(arg.size());
  }
  void check_components(size_t count) const;
  /// @throws error(invalid_argument) in replica context (inside a step function).
  void check_local_results() const;
  void check_multi_replica_plain(reduce_op op) const;

  kind kind_;
  std::unique_ptr<detail::runtime> rt_;
  std::shared_ptr<detail::variable_registry> variables_;
  std::unique_ptr<consort::cross_device_ops> cross_device_ops_;
};

/// One replica on one device (tf.distribute's `OneDeviceStrategy`).
class one_device_strategy : public strategy {
public:
  /// @throws error(unknown_device) for a malformed device or a GPU this process does not have,
  ///         error(unsupported) for a GPU device in a build without CUDA.
  explicit one_device_strategy(const std::string& device, strategy_options opts = {});
};

/// One replica per local device, synchronous (tf.distribute's `MirroredStrategy`).
class mirrored_strategy : public strategy {
public:
  /// All visible GPUs, or "CPU:0" when there are none (or the build has no CUDA support).
  explicit mirrored_strategy(strategy_options opts = {});
  /// @throws error(invalid_argument) for an empty or duplicated list, error(unknown_device) for a
  ///         malformed device or a GPU this process does not have, error(unsupported) for GPU
  ///         devices in a build without CUDA.
  explicit mirrored_strategy(std::vector<std::string> devices, strategy_options opts = {});
};

/// The strategy in force when none is chosen (tf.distribute's default strategy): one replica on
/// "CPU:0" whose reduce and gather return their input.
class default_strategy : public strategy {
public:
  explicit default_strategy(strategy_options opts = {});
};

/// How a multi_worker_mirrored_strategy finds and watches its cluster.
struct multi_worker_options {
  /// Where the cluster comes from; null: `resolve_cluster()` (TF_CONFIG, torchrun, Open MPI,
  /// MPICH/Intel MPI, PMIx, Slurm, else a local one-worker cluster).
  std::shared_ptr<const cluster_resolver> resolver;

  /// This worker's devices, in local replica order; every worker must have as many. Empty: the
  /// worker's own GPUs, or its slice of its host's by local rank, else CPU replicas;
  /// CONSORT_DEVICES_PER_WORKER (set by consort-launch) says how many (docs/multi_worker.md, "A
  /// worker's devices").
  std::vector<std::string> devices;

  /// How long start-up may take: every worker joining at the chief, then the mesh of
  /// connections between workers. The chief logs who is missing while it waits, and past the
  /// deadline every worker fails with the list of missing tasks.
  std::chrono::milliseconds rendezvous_timeout{std::chrono::seconds(60)};

  /// The default of `peer_timeout`.
  static constexpr std::chrono::milliseconds default_peer_timeout{800};

  /// Heartbeats between every worker and the chief, sent and watched by each process's
  /// membership thread (not the threads that run steps). 0: an eighth of `peer_timeout` (100 ms).
  std::chrono::milliseconds heartbeat_interval{0};

  /// A worker silent for this long is lost: every survivor's pending and later collectives fail
  /// with error(peer_lost) naming it (elastic: membership_changed, and the group re-forms). A
  /// worker that crashes is seen at once (its connections close); this bounds a hung or stopped
  /// process, a partition or a hung host. A worker descheduled, busy in a long step or stopped
  /// for less than this is not lost: its membership thread answers regardless of its steps. A
  /// silent worker on the same host whose process is runnable but gets no CPU (a loaded machine)
  /// is given up to ten times this before it counts as lost.
  /// 0: CONSORT_PEER_TIMEOUT_MS when set (a worker held in a debugger needs more), else
  /// `default_peer_timeout`, 800 ms (docs/multi_worker.md, "Failures").
  std::chrono::milliseconds peer_timeout{0};

  /// The longest `shutdown` (and the destructor) waits for a clean end with the other workers:
  /// every send it started is finished, each worker is told that this one leaves, and this one
  /// reads on until each has closed its side (docs/multi_worker.md, "The end of a run"). A peer
  /// that does not close its side in time (hung, stopped) is cut off; one that crashed costs
  /// nothing.
  std::chrono::milliseconds close_timeout{std::chrono::seconds(10)};

  /// Shared secret of the cluster: a worker that cannot prove it knows it is refused. Empty:
  /// CONSORT_CLUSTER_SECRET when set, else no authentication.
  std::string secret;

  /// Elastic groups (docs/multi_worker.md, "Elastic training"): 0, the default, keeps today's
  /// rule that a lost worker ends the run on every worker. n >= 1: when a worker is lost, the
  /// others go on without it as long as at least n workers remain, and a restarted worker (under
  /// its own task) joins the running group; see `multi_worker_mirrored_strategy::reform`. Every
  /// worker must be given the same n. CPU replicas only: a group with GPU replicas refuses it.
  /// 0 here: CONSORT_ELASTIC_MIN_WORKERS when set (tools/consort-launch --elastic MIN).
  int elastic_min_workers = 0;

  /// Elastic: how long the chief waits, once the group changes, for every worker to take part in
  /// its next epoch (`reform`); a worker that does not is left out.
  std::chrono::milliseconds reform_timeout{std::chrono::seconds(10)};

  /// How the workers exchange collective data (docs/multi_worker.md, "Shared memory"):
  /// - "auto": shared memory when every worker's address (in the chief's view) has the same host,
  ///   TCP otherwise, and TCP when shared memory cannot be set up (the log says why);
  /// - "tcp": always TCP (for comparison, or where /dev/shm is too small);
  /// - "shm": shared memory, and an error when the workers are on several hosts or it cannot be
  ///   set up.
  /// Empty: CONSORT_TRANSPORT when set, else "auto". The workers agree before they switch: shared
  /// memory is used only when every worker chose it ("auto" or "shm" on one host).
  std::string transport;

  /// One line per notable cluster event (missing tasks, refusals, losses). Empty: stderr.
  std::function<void(const std::string&)> log;
};

/// Synchronous replicas on every device of every worker (tf.distribute's
/// `MultiWorkerMirroredStrategy`).
///
/// The same program runs as N worker processes (by hand with TF_CONFIG, `tools/consort-launch`,
/// `srun` or `mpirun`). The constructor joins the cluster: every worker joins at the chief, which
/// answers with the view (ranks, addresses, devices) once all are there; then the workers connect
/// to each other. Replica ids run over all workers (worker rank x devices + local index) and every
/// collective, `reduce` and `gather` spans every replica of every worker. A plain (non
/// per_replica) value is one contribution per worker: `reduce` SUMs it across workers (MEAN
/// averages it over the workers) and `gather` concatenates it in worker order.
///
/// A lost worker (crash, kill, partition) fails every survivor's pending and later collectives
/// with error(peer_lost) naming it, within `multi_worker_options::peer_timeout`; the group is not
/// rebuilt (create a new strategy, in new processes, as after a TF worker failure). An elastic
/// group (`multi_worker_options::elastic_min_workers`) re-forms instead: those calls fail with
/// error(membership_changed), and `reform` continues on the workers that remain.
class multi_worker_mirrored_strategy : public strategy {
public:
  /// Joins the cluster. @throws error(invalid_argument) for a malformed cluster or a refusal by
  /// the chief (wrong secret, device count), error(collective_timeout) when rendezvous does not
  /// complete in time (naming the missing tasks), error(unsupported) on a ps task. An evaluator
  /// task is a one-worker group of its own, as in TF (no rendezvous with the workers).
  explicit multi_worker_mirrored_strategy(strategy_options opts = {}, multi_worker_options mw = {});

  /// The resolver the cluster came from (tf.distribute's `cluster_resolver`).
  const consort::cluster_resolver& cluster_resolver() const noexcept { return *resolver_; }

  /// This worker's rank (the chief is 0) and the number of workers, in the current epoch.
  int worker_rank() const noexcept;
  int num_workers() const noexcept;

  /// The membership epoch the strategy runs in: 1 from the first rendezvous, one more for each
  /// change of an elastic group. A worker that joined a running group starts at a later one.
  uint64_t membership_epoch() const noexcept;

  /// Whether this process started in a group that was already running: a restarted or new
  /// worker of an elastic group, whose first epoch is a later one (a worker that the others left
  /// out and that joined them again keeps what it was). Its variables hold its own initial values
  /// until `elastic_state::sync` gives it the group's state, so no other worker takes its commit
  /// while one that did not join this way can give it.
  bool joined_running_group() const noexcept;

  /// What a re-formation changed.
  struct membership_change {
    uint64_t epoch_before = 0;
    uint64_t epoch = 0;
    int workers_before = 0;
    int workers = 0;
    /// The tasks ("worker:2") that left the group, and those that joined it.
    std::vector<std::string> lost;
    std::vector<std::string> joined;
  };

  /// Elastic groups only: after a call failed with error(membership_changed), continues in the
  /// group's next epoch. It offers this worker's part, waits until the chief formed the epoch
  /// (every worker that remains calls `reform`, at most `reform_timeout` after the change), and
  /// connects to its members; then `worker_rank`, `num_workers` and `num_replicas_in_sync` are
  /// the new group's, the variables are the same objects, and steps run on the new group. The
  /// training loop then rolls back to its last commit (`elastic_state::sync`). A change announced
  /// while it connects is followed at once. Call it from the thread that drives the strategy,
  /// with no call in flight.
  /// A worker that the others left out (it was stopped or cut off past `peer_timeout`; its calls
  /// failed with error(membership_changed) saying so) joins the group again here, as a new member
  /// of its task, at the others' next step boundary, as a restarted process would: its
  /// `membership_change` has the view it had before and the group it joined after, and `joined`
  /// names it. Its flight recorder starts again.
  /// @throws error(invalid_argument) when the group is not elastic; error(peer_lost) when the
  ///         group ended (fewer workers than the minimum remain, or the chief was lost);
  ///         error(collective_timeout) when no next epoch formed in `rendezvous_timeout` (the
  ///         group did not change: the failure had another cause), or when a worker left out
  ///         found no group to join within it.
  membership_change reform();

  /// Elastic groups only (a no-op otherwise): a step boundary, where a task that waits to join
  /// the running group is let in with nothing to roll back. Every worker of the group calls it at
  /// the same step (`elastic_state::commit` does, after it kept the commit). When a task waits,
  /// the call fails on every worker with error(membership_changed), and the loop goes on as after
  /// any change: `reform`, then `elastic_state::sync`, which finds the commit just made. A join
  /// that no boundary reaches within `reform_timeout` aborts the calls in flight instead, as a
  /// loss does. One all-reduce of one value across the workers, to agree.
  void step_boundary();

private:
  friend struct detail::strategy_access; // consort::testing builds workers over its own network
  explicit multi_worker_mirrored_strategy(std::unique_ptr<detail::joined_cluster> joined);

  std::shared_ptr<const consort::cluster_resolver> resolver_;
  std::shared_ptr<detail::elastic_group> group_;
};

} // namespace consort
