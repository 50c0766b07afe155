#pragma once

/// Cluster resolvers: where the tasks of a multi-worker job are and which one this process is.
///
/// These follow TensorFlow's `tf.train.ClusterSpec` and `tf.distribute.cluster_resolver.*`:
/// a cluster is a set of *jobs* (chief, worker, ps, evaluator), each a set of *tasks* numbered
/// by index and reached at an address ("host:port"). A resolver reads the cluster and this
/// process's task from somewhere (TF_CONFIG, code, Slurm, or a launcher: Open MPI, torchrun,
/// MPICH/Intel MPI, PMIx) and answers the questions a multi-worker strategy asks: who is the
/// chief, what is my rank among the workers, how many workers are there.
///
/// Every failure is a `consort::error` (usually `errc::invalid_argument`) whose message names
/// the source (for example "TF_CONFIG" or "SLURM_PROCID"), says what was wrong and what was
/// expected.

#include <functional>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace consort {

// -- environment access ---------------------------------------------------------------------------

/// Looks up an environment variable by name: its value, or `std::nullopt` when it is not set.
/// Resolvers read the environment only through such a function, so tests can inject one.
using env_lookup = std::function<std::optional<std::string>(const std::string& name)>;

/// An `env_lookup` over the real process environment (`std::getenv`). Like `getenv` itself it
/// must not race with `setenv`/`unsetenv` in another thread.
env_lookup process_environment();

// -- cluster_spec ---------------------------------------------------------------------------------

/// The jobs of a cluster, each a map from task index to network address, like
/// `tf.train.ClusterSpec`. A job is *dense* when its indices are exactly 0..n-1 (TF's list form)
/// and *sparse* otherwise (TF's dict form, used when a task knows only some of its peers).
/// Jobs are kept sorted by name and tasks by index.
///
/// This class is a value type: immutable through its const interface and safe to read from
/// many threads.
class cluster_spec {
public:
  /// Job name → (task index → address).
  using job_map = std::map<std::string, std::map<int, std::string>>;

  // -- constructors -------------------------------------------------------------------------------

  /// An empty cluster (no jobs): the local, single-process case.
  cluster_spec() = default;

  /// A cluster from job name → task index → address (TF's sparse dict form; also fine for dense
  /// jobs). A job may have no tasks.
  /// @throws error(invalid_argument) when a job name is empty or a task index is negative.
  explicit cluster_spec(job_map jobs);

  /// A cluster whose jobs are all dense: job name → addresses of tasks 0, 1, ... (TF's list form).
  /// @throws error(invalid_argument) when a job name is empty.
  static cluster_spec dense(const std::map<std::string, std::vector<std::string>>& jobs);

  /// Parses TF's JSON form of a cluster: an object from job name to either a list of addresses
  /// (`{"worker": ["a:1", "b:1"]}`) or an object from decimal task index to address
  /// (`{"worker": {"0": "a:1", "2": "c:1"}}`).
  /// @throws error(invalid_argument) on malformed JSON (quoting the parser's position), a value
  ///         that is not an object, a job that is neither a list nor an object, a task index that
  ///         is not a non-negative decimal integer, or an address that is not a string.
  static cluster_spec from_json(const std::string& json);

  // -- observers ----------------------------------------------------------------------------------

  /// True when the cluster has no jobs (TF: `not cluster_spec.jobs`). A cluster with a job that
  /// has no tasks is not empty.
  bool empty() const noexcept { return jobs_.empty(); }

  /// The job names, sorted.
  std::vector<std::string> jobs() const;

  /// True when `job` is a job of this cluster.
  bool has_job(const std::string& job) const { return jobs_.count(job) != 0; }

  /// The number of tasks defined in `job` (for a sparse job, only the listed ones).
  /// @throws error(invalid_argument) when `job` is not a job of this cluster, listing the jobs.
  int num_tasks(const std::string& job) const;

  /// The task indices of `job`, ascending.
  /// @throws error(invalid_argument) when `job` is not a job of this cluster.
  std::vector<int> task_indices(const std::string& job) const;

  /// The address of task `index` of `job`.
  /// @throws error(invalid_argument) when `job` is not a job of this cluster;
  ///         error(out_of_range) when `job` has no task `index`, listing its indices.
  const std::string& task_address(const std::string& job, int index) const;

  /// The addresses of `job` as a list indexed by task index, with "" for the gaps of a sparse job
  /// (TF's `job_tasks`, which uses None there). It has (largest index + 1) entries, so a sparse
  /// job with a huge index makes a huge list; prefer `as_dict()` for sparse jobs.
  /// @throws error(invalid_argument) when `job` is not a job of this cluster.
  std::vector<std::string> job_tasks(const std::string& job) const;

  /// True when the indices of `job` are exactly 0..n-1 (an empty job is dense).
  /// @throws error(invalid_argument) when `job` is not a job of this cluster.
  bool is_dense(const std::string& job) const;

  /// Job name → task index → address: the whole cluster (TF's `as_dict`, always in map form).
  const job_map& as_dict() const noexcept { return jobs_; }

  /// TF's JSON form: a dense job as a list, a sparse one as an object keyed by decimal index,
  /// e.g. `{"ps":{"0":"p:1","3":"q:1"},"worker":["a:1","b:1"]}`. `from_json` reads it back.
  std::string to_json() const;

  /// Equal when both have the same jobs with the same tasks at the same addresses (a dense job
  /// equals the sparse job with the same indices, as in TF).
  friend bool operator==(const cluster_spec&, const cluster_spec&) = default;

private:
  job_map jobs_;
};

// -- task_id --------------------------------------------------------------------------------------

/// One task of a cluster: a job name and an index in that job, e.g. worker:1.
struct task_id {
  /// The job name: "chief", "worker", "ps" or "evaluator" (empty for a local process).
  std::string type;
  /// The index of the task in its job.
  int index = 0;

  /// Equal when both the type and the index are.
  friend bool operator==(const task_id&, const task_id&) = default;
};

/// "type:index", e.g. "worker:1".
std::string to_string(const task_id& id);

/// Writes `to_string(id)`.
std::ostream& operator<<(std::ostream& out, const task_id& id);

// -- cluster_resolver -----------------------------------------------------------------------------

/// The abstract resolver, TF's `ClusterResolver`, plus what a multi-worker strategy needs
/// (chief, rank and worker count, from TF's `multi_worker_util`).
///
/// Ranks follow docs/semantics.md: the chief (task chief:0, or worker:0 when there is no chief job)
/// is worker 0, then the worker tasks in index order; a ps task is not a worker; an evaluator is a
/// group of its own (one worker, its chief, rank 0), as in TF's `multi_worker_util`. An empty
/// cluster is *local*: one worker, which is the chief, with rank 0.
///
/// Implementations in this header are immutable after construction (except
/// `launcher_cluster_resolver::set_addresses`) and safe to read from many threads.
class cluster_resolver {
public:
  virtual ~cluster_resolver() = default;

  /// A resolver for a local, single-process run: an empty cluster, no task.
  static std::unique_ptr<cluster_resolver> local();

  // -- what every resolver supplies ---------------------------------------------------------------

  /// The cluster. Empty for a local run.
  virtual consort::cluster_spec cluster_spec() const = 0;

  /// The job name of this process's task; none when not known (TF's None, e.g. a TF_CONFIG
  /// without a "task"). Any job name: the strategy, not the resolver, decides which it supports.
  virtual std::optional<std::string> task_type() const = 0;

  /// The index of this process's task in its job; none when not known (TF's None).
  virtual std::optional<int> task_id() const = 0;

  /// The RPC protocol name used in `master()` URLs, e.g. "grpc"; "" for none.
  virtual std::string rpc_layer() const = 0;

  /// The environment the job runs in (TF's `environment`: "" or, e.g., "cloud"). "" by default.
  virtual std::string environment() const { return {}; }

  /// Device kind → number of accelerators available to this task, e.g. {"GPU": 2}. Empty when the
  /// resolver does not know (the default).
  virtual std::map<std::string, int> num_accelerators() const { return {}; }

  /// Whether `cluster_spec()` holds every task's address already. A launcher's resolver (torchrun,
  /// Open MPI, PMI, PMIx) learns them at the rendezvous: before that its cluster holds only the
  /// chief and this process, so every worker's would differ (the chief's check of the cluster at
  /// join then compares the tasks' names only).
  virtual bool knows_every_address() const { return true; }

  // -- derived answers ----------------------------------------------------------------------------

  /// This process's task, {task_type(), task_id()}, with "" and 0 for what is not known (a
  /// local run); use task_type() and task_id() to tell "none" apart.
  consort::task_id task() const { return {task_type().value_or(""), task_id().value_or(0)}; }

  /// The address of a task as a URL for TF's session master, with TF's semantics:
  /// "" for an empty cluster or when no task type or index is known (TF's SimpleClusterResolver
  /// then returns its `master`, "" by default); otherwise the address of `task_type`:`task_id`
  /// (each defaulting to this process's task when "" or negative), prefixed with
  /// "<rpc_layer>://" when an RPC layer is set (`rpc_layer`, defaulting to `rpc_layer()` when "").
  /// Some resolvers refine this (see `tf_config_cluster_resolver`, which needs a task).
  /// @throws error(invalid_argument | out_of_range) when the task is not in the cluster.
  std::string master(const std::string& task_type = "", int task_id = -1,
                     const std::string& rpc_layer = "") const {
    return master_impl(task_type, task_id, rpc_layer);
  }

  /// True when the cluster is empty: a local, single-process run.
  bool is_local() const { return cluster_spec().empty(); }

  /// True when this task is the chief (TF's `multi_worker_util.is_chief`): a local run; a chief
  /// task; worker:0 when there is no chief job; and an evaluator, which TF treats as the chief of
  /// its own group. False for other tasks, and, as TF's, when the task type is not known.
  /// On a non-empty cluster the task is first checked as TF checks it (the rules of
  /// `validate_multi_worker_cluster` that TF's `_validate_cluster_spec` has).
  /// @throws error(invalid_argument) when the task breaks one of those rules, or has a type but no
  ///         index.
  virtual bool is_chief() const;

  /// The chief's task: chief:0 when the cluster has a chief job, else worker:0; this process's own
  /// task for a local run.
  /// @throws error(invalid_argument) when the cluster has neither a chief nor a worker job.
  virtual consort::task_id chief() const;

  /// This task's rank in its group (TF's `multi_worker_util.id_in_cluster`): 0 for the chief, then
  /// index + (number of chief tasks) for a worker; 0 for an evaluator, which is a group of its own;
  /// 0 for a local run. The task is first checked as `is_chief()` checks it.
  /// @throws error(unsupported) for a ps task, which is not a worker (TF: "There is no id for
  ///         task_type 'ps'"); error(invalid_argument) without a task type or index, when the task
  ///         breaks TF's rules, or for an evaluator whose index is not 0.
  virtual int worker_rank() const;

  /// The number of workers in this task's group (TF's `multi_worker_util.worker_count`): chief
  /// tasks + worker tasks for a chief or worker task; 1 for an evaluator (its own group, also when
  /// it is absent from the cluster, where TF raises a KeyError); 1 for a local run. The task type
  /// is checked as `is_chief()` checks it; the index is not looked at, as TF's is not.
  /// @throws error(unsupported) for a ps task (TF: "Unexpected `task_type` 'ps'");
  ///         error(invalid_argument) without a task type or when the task type breaks TF's rules
  ///         (e.g. a task type that is not a job of the cluster).
  virtual int num_workers() const;

protected:
  cluster_resolver() = default;
  cluster_resolver(const cluster_resolver&) = default;
  cluster_resolver& operator=(const cluster_resolver&) = default;

  /// What `master()` returns for its arguments as the caller passed them ("" and -1 mean this
  /// process's task); the base version implements the rule documented on `master()`.
  virtual std::string master_impl(const std::string& task_type, int task_id,
                                  const std::string& rpc_layer) const;
};

/// The checks a multi-worker strategy makes of its resolver's cluster and task when it starts:
/// TF's `multi_worker_util._validate_cluster_spec` plus the strategy's own "a cluster needs a
/// task", with TF's messages. Nothing to check for an empty (local) cluster. The rules:
/// - a task type and index are given, and the index is not negative;
/// - every job is one of chief, worker, ps, evaluator, and so is the task type;
/// - the task type is a job of the cluster (an evaluator may be absent, as TF allows);
/// - the chief job and the evaluator job have at most one task each;
/// - the task index names a task of its job.
/// @throws error(invalid_argument) whose message starts with `who`.
void validate_multi_worker_cluster(const cluster_resolver& resolver,
                                   const std::string& who = "MultiWorkerMirroredStrategy");

// -- tf_config_cluster_resolver -------------------------------------------------------------------

/// Values that override what TF_CONFIG says, TF's `TFConfigClusterResolver(task_type, task_id,
/// rpc_layer, environment)` constructor arguments. An unset field keeps TF_CONFIG's value.
struct tf_config_overrides {
  /// Overrides "task"."type".
  std::optional<std::string> task_type = std::nullopt;
  /// Overrides "task"."index".
  std::optional<int> task_id = std::nullopt;
  /// Overrides "rpc_layer".
  std::optional<std::string> rpc_layer = std::nullopt;
  /// Overrides "environment".
  std::optional<std::string> environment = std::nullopt;
};

/// Reads the cluster from the TF_CONFIG environment variable as TensorFlow's
/// `TFConfigClusterResolver` does:
/// ```
/// {"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": {"0": "p:2222"}},
///  "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc", "environment": "cloud"}
/// ```
/// - "cluster": job name → list of addresses or object from decimal index to address; missing or
///   `{}` means a local run.
/// - "task": {"type": ..., "index": ...}. The type is read as TF's `str()` reads it (a string as
///   it is, `123456` as "123456", `true` as "True", `null` as "None"); the index as TF's `int()`
///   (an integer or a decimal string). Either may be absent: `task_type()` / `task_id()` are then
///   none, as TF's are None.
/// - "rpc_layer", "environment": strings; "session_master" (a string) is returned by `master()`
///   as TF does. Other top-level keys are ignored, as TF ignores them.
/// - TF_CONFIG unset, empty or only whitespace = local: empty cluster, task from the overrides.
///
/// Like TF's resolver, it accepts any job names and any task: which jobs and tasks a strategy
/// supports is the strategy's check (`multi_worker_mirrored_strategy` applies TF's
/// `multi_worker_util._validate_cluster_spec` when it starts, with TF's messages). What it rejects
/// is malformed input: bad JSON, a "cluster" or "task" of the wrong shape, an index that is not
/// an integer, each an error(invalid_argument) whose message starts with "TF_CONFIG".
///
/// Unlike TF, which reads TF_CONFIG again on every call, the variable is read once, at
/// construction: a strategy's view of its cluster must not change under it, and `setenv` in
/// another thread is a data race. Build a new resolver to read it again.
///
/// Immutable after construction except through the setters; safe to read from many threads.
class tf_config_cluster_resolver : public cluster_resolver {
public:
  /// Reads TF_CONFIG from the process environment.
  /// @throws error(invalid_argument) when TF_CONFIG is malformed or violates a rule above.
  explicit tf_config_cluster_resolver(tf_config_overrides overrides = {});

  /// Reads TF_CONFIG through `lookup` instead of the process environment.
  /// @throws error(invalid_argument) as the constructor above.
  tf_config_cluster_resolver(tf_config_overrides overrides, const env_lookup& lookup);

  /// Reads a TF_CONFIG value given as a string (tests, or a config passed another way).
  /// @throws error(invalid_argument) as the constructors above.
  static tf_config_cluster_resolver from_json(const std::string& tf_config,
                                              tf_config_overrides overrides = {});

  /// The cluster of "cluster" (empty when absent).
  consort::cluster_spec cluster_spec() const override { return spec_; }

  /// The override (or the value set), else "task"."type" as Python's `str()` writes it, else none.
  std::optional<std::string> task_type() const override { return task_type_; }

  /// The override (or the value set), else "task"."index", else none.
  std::optional<int> task_id() const override { return task_id_; }

  /// The override (or the value set), else "rpc_layer", else "".
  std::string rpc_layer() const override { return rpc_layer_; }

  /// TF's setters. They are not synchronized: set before the resolver is shared (a strategy
  /// reads it once, when it joins the cluster).
  void set_task_type(std::optional<std::string> type) { task_type_ = std::move(type); }
  void set_task_id(std::optional<int> id) { task_id_ = id; }
  void set_rpc_layer(std::string rpc_layer) { rpc_layer_ = std::move(rpc_layer); }

  /// The visible GPUs of this process, as TF counts the local task's devices: {"GPU": n}, or
  /// empty without a GPU (or in a build without CUDA).
  /// @throws error(invalid_argument) where `master()` fails for want of a task (a cluster of
  ///         several tasks, no "session_master", and no task type or index), as TF's
  ///         `ClusterResolver.num_accelerators` asks `master()` first.
  std::map<std::string, int> num_accelerators() const override;

  /// The override, else "environment", else "".
  std::string environment() const override { return environment_; }

  /// "session_master" when TF_CONFIG has one (TF's escape hatch), else "".
  const std::string& session_master() const noexcept { return session_master_; }

protected:
  /// TF's `TFConfigClusterResolver.master`: "session_master" when TF_CONFIG has the key (even "");
  /// "" when the cluster is empty or has exactly one job with exactly one task (task 0); otherwise
  /// the address of the task (the arguments, else this process's task), as the base rule.
  /// @throws error(invalid_argument) in that last case when no task type or no index is known,
  ///         where TF's `task_address(None, None)` raises "No such job in cluster: None"; and as
  ///         the base rule when the task is not in the cluster.
  std::string master_impl(const std::string& task_type, int task_id,
                          const std::string& rpc_layer) const override;

private:
  struct from_text_tag {};
  tf_config_cluster_resolver(from_text_tag, const std::optional<std::string>& text,
                             tf_config_overrides overrides);

  consort::cluster_spec spec_;
  std::optional<std::string> task_type_;
  std::optional<int> task_id_;
  std::string rpc_layer_;
  std::string environment_;
  std::string session_master_;
  bool has_session_master_ = false;
};

// -- simple_cluster_resolver ----------------------------------------------------------------------

/// A resolver whose answers are given in code, TF's `SimpleClusterResolver`.
///
/// Like TF's, it checks nothing about the cluster and the task (the strategy does when it starts).
///
/// Immutable after construction except through the setters; safe to read from many threads.
class simple_cluster_resolver : public cluster_resolver {
public:
  /// @throws error(invalid_argument) for a negative accelerator count.
  simple_cluster_resolver(consort::cluster_spec spec, std::optional<std::string> task_type,
                          std::optional<int> task_id, std::string rpc_layer = "",
                          std::map<std::string, int> accelerators = {});

  /// The cluster given at construction.
  consort::cluster_spec cluster_spec() const override { return spec_; }

  /// The task type given at construction (or set).
  std::optional<std::string> task_type() const override { return task_type_; }

  /// The task index given at construction (or set).
  std::optional<int> task_id() const override { return task_id_; }

  /// The RPC layer given at construction (or set).
  std::string rpc_layer() const override { return rpc_layer_; }

  /// TF's setters; not synchronized: set before the resolver is shared.
  void set_task_type(std::optional<std::string> type) { task_type_ = std::move(type); }
  void set_task_id(std::optional<int> id) { task_id_ = id; }
  void set_rpc_layer(std::string rpc_layer) { rpc_layer_ = std::move(rpc_layer); }

  /// The accelerator counts given at construction.
  std::map<std::string, int> num_accelerators() const override { return accelerators_; }

private:
  consort::cluster_spec spec_;
  std::optional<std::string> task_type_;
  std::optional<int> task_id_;
  std::string rpc_layer_;
  std::map<std::string, int> accelerators_;
};

// -- slurm_cluster_resolver -----------------------------------------------------------------------

/// Expands a Slurm hostlist into host names, in order and without deduplication:
/// "node[01-03,7],gpu-[1-2]" → node01, node02, node03, node7, gpu-1, gpu-2. Commas inside
/// brackets separate ranges, outside them hosts. A range "lo-hi" is zero-padded to the width of
/// `lo` ("01-03" → 01, 02, 03). Text may follow a bracket ("n[1-2]-ib" → n1-ib, n2-ib), and
/// several brackets in one host expand to their product, leftmost slowest. "" → no hosts.
/// @throws error(invalid_argument) quoting the hostlist for an empty host (",,"), an unbalanced or
///         nested bracket, an empty or non-numeric range, a range whose end is below its start, or
///         more than 1,000,000 hosts.
std::vector<std::string> expand_hostlist(const std::string& hostlist);

/// Expands Slurm's tasks-per-node form, matching the expanded hostlist node by node:
/// "2(x3),1" → 2, 2, 2, 1.
/// @throws error(invalid_argument) quoting the text when a part is not "N" or "N(xM)".
std::vector<int> expand_tasks_per_node(const std::string& tasks_per_node);

/// The environment variable that sets the port of the first task on each node under Slurm.
inline constexpr const char* port_base_variable = "CONSORT_PORT_BASE";

/// Options of `slurm_cluster_resolver`.
struct slurm_options {
  /// The port of the first task on each node; the k-th task on a node listens on port_base + k.
  /// Unset (the default): the environment chooses, in this order: CONSORT_PORT_BASE; the ports
  /// Slurm reserved for the step (SLURM_STEP_RESV_PORTS, set by `srun --resv-ports`), the k-th
  /// task on a node taking the k-th port; 8888 (TF's default).
  std::optional<int> port_base = std::nullopt;
  /// The RPC layer reported by `rpc_layer()` ("grpc", TF's default for Slurm).
  std::string rpc_layer = "grpc";
};

/// Resolves the cluster of a Slurm job step (`srun`), like TF's `SlurmClusterResolver` with its
/// default single job: every task is a worker.
///
/// Read from the environment:
/// - SLURM_PROCID: this task's rank, which is its worker index;
/// - SLURM_STEP_NUM_TASKS, else SLURM_NTASKS: the number of tasks;
/// - SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST: the nodes, as a hostlist (`expand_hostlist`);
/// - SLURM_STEP_TASKS_PER_NODE, else SLURM_TASKS_PER_NODE: tasks on each node
///   (`expand_tasks_per_node`).
///
/// Tasks are assigned to nodes in nodelist order, as Slurm's default block distribution does:
/// the first node gets ranks 0..n0-1, the next the following n1 ranks, and so on. The k-th task of
/// a node gets address "node:port_base+k" (`slurm_options::port_base` says where the port comes
/// from: code, CONSORT_PORT_BASE, SLURM_STEP_RESV_PORTS such as "12000-12015", else 8888). (TF
/// sorts the host names first, which puts node10 before node9 and disagrees with Slurm's ranks; we
/// keep Slurm's order.)
/// When Slurm also sets SLURM_LOCALID or SLURMD_NODENAME, they must agree with that placement
/// (they do not under, e.g., `srun --distribution=cyclic`, whose addresses this resolver cannot
/// compute).
/// Not resolved: accelerators (`num_accelerators()` is empty) and CUDA_VISIBLE_DEVICES, which is
/// neither read nor set.
///
/// Immutable after construction; safe to read from many threads.
class slurm_cluster_resolver : public cluster_resolver {
public:
  /// Reads the variables above through `lookup`.
  /// @throws error(invalid_argument) naming the variable when one is missing or malformed, when
  ///         the nodelist and the tasks-per-node list have different lengths, when the tasks per
  ///         node do not add up to the number of tasks, when SLURM_PROCID is not below it, when
  ///         a port would exceed 65535, when CONSORT_PORT_BASE or SLURM_STEP_RESV_PORTS is
  ///         malformed or the reserved ports are fewer than a node's tasks, or when SLURM_LOCALID
  ///         or SLURMD_NODENAME disagree with block distribution.
  explicit slurm_cluster_resolver(slurm_options options = {},
                                  const env_lookup& lookup = process_environment());

  /// {"worker": addresses of tasks 0..n-1}.
  consort::cluster_spec cluster_spec() const override { return spec_; }

  /// Always "worker".
  std::optional<std::string> task_type() const override { return "worker"; }

  /// SLURM_PROCID.
  std::optional<int> task_id() const override { return rank_; }

  /// `slurm_options::rpc_layer`.
  std::string rpc_layer() const override { return rpc_layer_; }

  /// The position of this task among the tasks on its node (0 for the first).
  int local_task_index() const noexcept { return local_index_; }

private:
  consort::cluster_spec spec_;
  int rank_ = 0;
  int local_index_ = 0;
  std::string rpc_layer_;
};

// -- launcher_cluster_resolver --------------------------------------------------------------------

/// The environment variable that gives every process of a launcher's job the chief's (rank 0's)
/// "host:port". It overrides what the launcher says (torchrun's MASTER_ADDR and MASTER_PORT).
inline constexpr const char* chief_address_variable = "CONSORT_CHIEF_ADDRESS";

/// The variable that gives a launcher's worker the host name or IP address at which the other
/// workers reach it (`launcher_options::host` for the resolvers that `resolve_cluster` makes);
/// unset: this host's name. `tools/consort-launch --nnodes` sets it to the address of the
/// interface that reaches the rendezvous endpoint.
inline constexpr const char* worker_host_variable = "CONSORT_WORKER_HOST";

/// Options of the launcher resolvers (`mpi_cluster_resolver`, `torchrun_cluster_resolver`,
/// `pmi_cluster_resolver`, `pmix_cluster_resolver`).
struct launcher_options {
  /// The host name or IP at which peers reach this process; "" = `gethostname()`.
  std::string host = {};
  /// This process's port is port_base + its local rank (rank 0 listens there when nothing gives
  /// a chief address).
  int port_base = 8888;
  /// The chief's "host:port" when neither CONSORT_CHIEF_ADDRESS nor the launcher gives one;
  /// "" = none.
  std::string default_chief_address = {};
  /// The RPC layer reported by `rpc_layer()`; "" = none.
  std::string rpc_layer = {};
};

/// The options of `mpi_cluster_resolver`, under the name they had before the other launchers.
using mpi_options = launcher_options;

/// Where the chief of a launcher's job listens when every rank is on one node and nothing gives
/// the chief's address (no CONSORT_CHIEF_ADDRESS, no `launcher_options::default_chief_address`):
/// the loopback address, at a port that every rank derives alike from the job's identity that the
/// launcher puts in every rank's environment (Open MPI's and PMIx's PMIX_NAMESPACE), so that the
/// ranks agree on it without talking. The ports lie in [first, first + count) = 24576..32767,
/// below Linux's default ephemeral range (32768..60999), where neither outgoing connections nor
/// the workers' own listeners (which take ephemeral ports) land, and above the ports that
/// `tools/consort-launch` picks (10000 up to 10000 below the ephemeral range).
inline constexpr const char* one_node_chief_host = "127.0.0.1";
inline constexpr int one_node_chief_port_first = 24576;
inline constexpr int one_node_chief_port_count = 8192;

/// The chief's port for the one-node job whose identity is `job_id` (e.g. PMIX_NAMESPACE's value):
/// `one_node_chief_port_first` + (64-bit FNV-1a of `job_id`) % `one_node_chief_port_count`. The
/// same id gives the same port in every process; two jobs on one node share a port only when their
/// ids collide in it (1 in 8192 for a pair of jobs), and the second chief then fails at start-up,
/// naming CONSORT_CHIEF_ADDRESS.
int one_node_chief_port(const std::string& job_id);

/// The base of the resolvers for jobs whose launcher gives every process its rank and the number
/// of processes, but not the other processes' addresses: Open MPI's `mpirun`, torchrun (and
/// Kubeflow's PyTorchJob), MPICH's and Intel MPI's `mpiexec` (PMI), PMIx launchers. Every rank is
/// a worker; rank 0 is the chief.
///
/// The other ranks' addresses come from an exchange that the multi-worker runtime performs
/// through the chief: every rank connects to the chief's address, sends its own, gets back the
/// list of all addresses in rank order (the rendezvous's view), and the list may be stored with
/// `set_addresses`. This resolver does no networking itself. The chief's address is, in this
/// order: CONSORT_CHIEF_ADDRESS; what the launcher gives (torchrun's MASTER_ADDR and MASTER_PORT;
/// the MPI launchers give none); `launcher_options::default_chief_address`; when the launcher says
/// that every rank is on this node (a local size equal to the size: Open MPI's
/// OMPI_COMM_WORLD_LOCAL_SIZE, PMIx with one of the local sizes it reads) and names the job
/// (PMIX_NAMESPACE), `one_node_chief_host`:`one_node_chief_port(job)`, every rank then listening
/// on the loopback too (`own_address()`, unless `launcher_options::host` is given); on rank 0
/// only, its own address. A rank other than 0 with none fails at construction, and so does every
/// rank, rank 0 included, when the launcher says that the ranks are on several nodes (a local
/// size below the size): no rank can tell where rank 0 is then, and the message says what to pass.
///
/// Until the exchange `cluster_spec()` is a sparse worker job holding only what is known: the
/// chief at index 0 and this process at its rank. `num_workers()` and `worker_rank()` are right
/// either way (they come from the size and rank).
///
/// Not thread-safe: `set_addresses` must not run while another thread reads the resolver.
class launcher_cluster_resolver : public cluster_resolver {
public:
  /// Stores the result of the address exchange: the "host:port" of every rank, in rank order.
  /// @throws error(invalid_argument) when there is not one address per rank or one is not
  ///         "host:port"; the resolver is then unchanged.
  void set_addresses(std::vector<std::string> addresses);

  /// True once `set_addresses` (or a constructor given addresses) has given every rank's address.
  bool has_addresses() const noexcept { return !addresses_.empty(); }
  bool knows_every_address() const override { return has_addresses(); }

  /// {"worker": all addresses} after the exchange; before it, the sparse
  /// {"worker": {0: chief_address(), rank: own_address()}}.
  consort::cluster_spec cluster_spec() const override;

  /// Always "worker".
  std::optional<std::string> task_type() const override { return "worker"; }

  /// This process's rank.
  std::optional<int> task_id() const override { return rank_; }

  /// `launcher_options::rpc_layer`.
  std::string rpc_layer() const override { return rpc_layer_; }

  /// The number of processes the launcher started.
  int num_workers() const override { return size_; }

  /// This process's position among the ranks on its host (0 when the launcher does not say).
  int local_rank() const noexcept { return local_rank_; }

  /// The number of ranks on this process's host, when the launcher says (torchrun's
  /// LOCAL_WORLD_SIZE, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE, ...).
  std::optional<int> local_size() const noexcept { return local_size_; }

  /// host:port_base + local rank: this process's address before the exchange (the runtime
  /// listens on its host). Rank 0's entry in the cluster is the chief address when one is given.
  const std::string& own_address() const noexcept { return own_address_; }

  /// The chief's address: rank 0's entry after the exchange, else as the class comment says.
  std::string chief_address() const;

  /// The launcher, as messages name it: "Open MPI", "torchrun", "PMI" or "PMIx".
  const std::string& launcher() const noexcept { return launcher_; }

protected:
  /// What a launcher's environment says about this process.
  struct placement {
    /// The launcher as messages name it, e.g. "Open MPI".
    std::string launcher;
    /// The class, e.g. "mpi_cluster_resolver", and the variable that gave the size, e.g.
    /// "OMPI_COMM_WORLD_SIZE", for `set_addresses`'s messages.
    std::string resolver;
    std::string size_variable;
    int rank = 0;
    int size = 1;
    int local_rank = 0;
    /// The variable that gave the local rank, for messages; "" when none did.
    std::string local_rank_variable;
    /// The number of ranks on this node and the variable that gave it; none when the launcher
    /// does not say (the chief's address is then never derived, and several nodes never
    /// detected).
    std::optional<int> local_size = std::nullopt;
    std::string local_size_variable = {};
    /// The job's identity, the same on every rank and different from job to job (PMIX_NAMESPACE),
    /// and the variable that gave it; "" when the launcher gives none.
    std::string job_id = {};
    std::string job_id_variable = {};
  };

  /// A chief address the launcher gives, and the variables it came from (for messages).
  struct launcher_chief {
    std::string address;
    std::string source;
  };

  launcher_cluster_resolver() = default;

  /// Sets what `placement` says, this process's address from `options`, and the chief address
  /// (CONSORT_CHIEF_ADDRESS, else `from_launcher` when it has an address, else the options'
  /// default, else the one-node address when `where` says that every rank is on this node and
  /// names the job, else rank 0's own).
  /// @throws error(invalid_argument) when a port would leave 1..65535, a chief address is not
  ///         "host:port", or the local size is above the size.
  void place(const placement& where, const launcher_options& options, const env_lookup& lookup,
             const launcher_chief& from_launcher = {});

  /// Called by the constructors that have no addresses yet, once `place` has run.
  /// @throws error(invalid_argument) when no chief address is known (a rank other than 0 without
  ///         CONSORT_CHIEF_ADDRESS, a default or the one-node address), or, on every rank, when
  ///         none is given and the ranks are on several nodes, naming what would have given one
  ///         (`how_to_give_one`); on rank 0 with the one-node address, when it cannot bind that
  ///         address (a quick bind and close, so that the chief fails at once, naming
  ///         CONSORT_CHIEF_ADDRESS, rather than when it starts to serve).
  void require_chief_address(const std::string& how_to_give_one) const;

  /// The host peers reach this process at: `options.host`, else `gethostname()`; an IPv6 literal
  /// in brackets.
  static std::string host_of(const launcher_options& options);

private:
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  std::optional<int> local_size_;
  std::string launcher_;
  std::string resolver_;
  std::string size_variable_;
  std::string own_address_;
  std::string chief_address_;
  std::string rpc_layer_;
  std::vector<std::string> addresses_;
  // Set by `place` for `require_chief_address`: where the one-node chief address came from
  // ("" when it was not derived), and why the ranks are on several nodes ("" when they are not,
  // or a chief address was given).
  std::string derived_from_;
  std::string several_nodes_;
};

// -- mpi_cluster_resolver -------------------------------------------------------------------------

/// Resolves a job started by Open MPI's `mpirun` (`launcher_cluster_resolver`).
///
/// Read from the environment, the first three required:
/// - OMPI_COMM_WORLD_RANK: this process's rank = its worker index;
/// - OMPI_COMM_WORLD_SIZE: the number of workers;
/// - OMPI_COMM_WORLD_LOCAL_RANK: its position on its node, which offsets its port
///   (`own_address()` = host:port_base + local rank);
/// - OMPI_COMM_WORLD_LOCAL_SIZE (optional): the number of ranks on its node;
/// - PMIX_NAMESPACE, else OMPI_MCA_ess_base_jobid (optional): the job's identity (Open MPI 4.1
///   sets both to its job id, e.g. "645005313"; Open MPI 5 sets PMIX_NAMESPACE, e.g.
///   "prterun-host0-1234@1").
/// The chief's address: CONSORT_CHIEF_ADDRESS (`mpirun -x CONSORT_CHIEF_ADDRESS=host0:port`), else
/// `launcher_options::default_chief_address`, else, when every rank is on one node
/// (OMPI_COMM_WORLD_LOCAL_SIZE = OMPI_COMM_WORLD_SIZE) and the job has an identity,
/// 127.0.0.1:`one_node_chief_port(identity)`, so that a plain `mpirun -np 4 ./my_job` works on
/// one machine; else (rank 0 only) its own address. Ranks on several nodes
/// (OMPI_COMM_WORLD_LOCAL_SIZE below OMPI_COMM_WORLD_SIZE) without a chief address all fail at
/// construction, saying to pass `-x CONSORT_CHIEF_ADDRESS=host0:port`.
class mpi_cluster_resolver : public launcher_cluster_resolver {
public:
  /// Reads the variables above through `lookup`.
  /// @throws error(invalid_argument) naming the variables set and those missing when one is
  ///         missing; naming the variable when one is malformed; when the rank is not below the
  ///         size, when a non-chief rank has no chief address, or when the chief address is not
  ///         "host:port".
  explicit mpi_cluster_resolver(mpi_options options = {},
                                const env_lookup& lookup = process_environment());

  /// As above, with the exchange already done: `addresses` are those of ranks 0..size-1.
  /// @throws error(invalid_argument) as above and as `set_addresses`.
  mpi_cluster_resolver(mpi_options options, std::vector<std::string> addresses,
                       const env_lookup& lookup = process_environment());

private:
  void read_environment(const mpi_options& options, const env_lookup& lookup);
};

// -- torchrun_cluster_resolver --------------------------------------------------------------------

/// The variable torchrun sets to "True" when its agent's TCPStore listens on
/// MASTER_ADDR:MASTER_PORT.
inline constexpr const char* agent_store_variable = "TORCHELASTIC_USE_AGENT_STORE";

/// Resolves a job started by torchrun (`torch.distributed.run`) or by Kubeflow's PyTorchJob
/// (`launcher_cluster_resolver`).
///
/// Read from the environment:
/// - RANK, WORLD_SIZE (required): this process's rank and the number of processes;
/// - MASTER_ADDR, MASTER_PORT (required unless CONSORT_CHIEF_ADDRESS or a default chief address
///   is given): where rank 0 is;
/// - LOCAL_RANK, LOCAL_WORLD_SIZE (optional; Kubeflow's PyTorchJob without torchrun sets neither):
///   this process's position on its host and the number of processes there;
/// - TORCHELASTIC_USE_AGENT_STORE (optional): "True" when torchrun's agent hosts its TCPStore on
///   MASTER_ADDR:MASTER_PORT on the rank-0 host.
///
/// The chief's address: CONSORT_CHIEF_ADDRESS when set; else MASTER_ADDR with MASTER_PORT, or
/// with MASTER_PORT + 1 when TORCHELASTIC_USE_AGENT_STORE is "True" (the agent's store already
/// listens on MASTER_PORT there, and the chief must not try to listen on it too).
/// Kubeflow's PyTorchJob gives its master (rank 0) MASTER_ADDR "localhost" and the others the
/// master's service name, which is the master pod's host name: on rank 0, a MASTER_ADDR of
/// "localhost" inside Kubernetes (KUBERNETES_SERVICE_HOST set) without torchrun (no
/// LOCAL_WORLD_SIZE and no TORCHELASTIC_RUN_ID) in a job of several processes is replaced by this
/// host's name, so that every rank names the chief alike and the chief listens where the others
/// reach it.
class torchrun_cluster_resolver : public launcher_cluster_resolver {
public:
  /// Reads the variables above through `lookup`.
  /// @throws error(invalid_argument) naming the variables set and those missing when a required one
  ///         is missing ("half set"); naming the variable when one is malformed; when RANK is not
  ///         below WORLD_SIZE, LOCAL_RANK not below LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE above
  ///         WORLD_SIZE, or a port outside 1..65535.
  explicit torchrun_cluster_resolver(launcher_options options = {},
                                     const env_lookup& lookup = process_environment());

  /// As above, with the exchange already done: `addresses` are those of ranks 0..size-1.
  /// @throws error(invalid_argument) as above and as `set_addresses`.
  torchrun_cluster_resolver(launcher_options options, std::vector<std::string> addresses,
                            const env_lookup& lookup = process_environment());

  /// LOCAL_WORLD_SIZE; none when not set.
  std::optional<int> local_world_size() const noexcept { return local_world_size_; }

private:
  void read_environment(const launcher_options& options, const env_lookup& lookup);

  std::optional<int> local_world_size_;
};

// -- pmi_cluster_resolver -------------------------------------------------------------------------

/// Resolves a job started by a PMI launcher: MPICH's and Intel MPI's `mpiexec` (Hydra), and
/// others that set PMI-1's variables (`launcher_cluster_resolver`).
///
/// Read from the environment:
/// - PMI_RANK, PMI_SIZE (required): this process's rank and the number of processes;
/// - MPI_LOCALRANKID (Hydra), else PMI_LOCAL_RANK (Cray PMI) (optional, 0 when neither is set):
///   this process's position on its host; MPI_LOCALNRANKS, else PMI_LOCAL_SIZE (optional): the
///   number of processes there.
/// The chief's address: CONSORT_CHIEF_ADDRESS (`mpiexec -genv CONSORT_CHIEF_ADDRESS host0:port`),
/// else the default, else (rank 0 only) its own. Unlike Open MPI's, Hydra's environment names no
/// job (it sets only PMI_RANK, PMI_SIZE, PMI_FD or PMI_PORT and PMI_ID, MPI_LOCALRANKID and
/// MPI_LOCALNRANKS), so no chief address is derived even on one node; ranks on several nodes
/// (MPI_LOCALNRANKS, else PMI_LOCAL_SIZE, below PMI_SIZE) without one all fail at construction.
class pmi_cluster_resolver : public launcher_cluster_resolver {
public:
  /// Reads the variables above through `lookup`.
  /// @throws error(invalid_argument) as `mpi_cluster_resolver`'s constructor, and when the local
  ///         rank is not below the local size.
  explicit pmi_cluster_resolver(launcher_options options = {},
                                const env_lookup& lookup = process_environment());

  /// As above, with the exchange already done: `addresses` are those of ranks 0..size-1.
  pmi_cluster_resolver(launcher_options options, std::vector<std::string> addresses,
                       const env_lookup& lookup = process_environment());

private:
  void read_environment(const launcher_options& options, const env_lookup& lookup);
};

// -- pmix_cluster_resolver ------------------------------------------------------------------------

/// Resolves a job started by a PMIx launcher (PRRTE's `prterun`, a PMIx-enabled resource manager)
/// (`launcher_cluster_resolver`).
///
/// A PMIx server puts only the rank in the environment (PMIX_RANK, with PMIX_NAMESPACE and its
/// own URI); the job's size is published through `PMIx_Get(PMIX_JOB_SIZE)`, which consort does
/// not call. So the size comes from a variable that a launcher sets beside PMIx: PMI_SIZE, else
/// OMPI_COMM_WORLD_SIZE; with neither, construction fails rather than guess.
/// The local rank: MPI_LOCALRANKID, else PMI_LOCAL_RANK, else OMPI_COMM_WORLD_LOCAL_RANK, else 0;
/// the local size (optional): MPI_LOCALNRANKS, else PMI_LOCAL_SIZE, else
/// OMPI_COMM_WORLD_LOCAL_SIZE. The chief's address as for Open MPI, with PMIX_NAMESPACE as the
/// job's identity: on one node (a local size equal to the size) 127.0.0.1 at a port derived from
/// it; on several nodes, CONSORT_CHIEF_ADDRESS is required on every rank.
class pmix_cluster_resolver : public launcher_cluster_resolver {
public:
  /// Reads the variables above through `lookup`.
  /// @throws error(invalid_argument) as `mpi_cluster_resolver`'s constructor, and when no variable
  ///         gives the size, naming those it looked for.
  explicit pmix_cluster_resolver(launcher_options options = {},
                                 const env_lookup& lookup = process_environment());

  /// As above, with the exchange already done: `addresses` are those of ranks 0..size-1.
  pmix_cluster_resolver(launcher_options options, std::vector<std::string> addresses,
                        const env_lookup& lookup = process_environment());

private:
  void read_environment(const launcher_options& options, const env_lookup& lookup);
};

// -- choosing a resolver --------------------------------------------------------------------------

/// The resolver for the environment this process was started in. The first that applies wins:
/// 1. TF_CONFIG set and not empty: `tf_config_cluster_resolver` (by hand, or
///    `tools/consort-launch`);
/// 2. RANK or WORLD_SIZE set (torchrun, Kubeflow's PyTorchJob): `torchrun_cluster_resolver`;
/// 3. OMPI_COMM_WORLD_RANK set (Open MPI's `mpirun`): `mpi_cluster_resolver`;
/// 4. PMI_RANK set (MPICH's or Intel MPI's `mpiexec`): `pmi_cluster_resolver`;
/// 5. PMIX_RANK set (a PMIx launcher): `pmix_cluster_resolver`;
/// 6. SLURM_PROCID set (a task of `srun`): `slurm_cluster_resolver`;
/// 7. otherwise a local, one-worker cluster (`cluster_resolver::local()`).
/// The per-process launchers come before Slurm because they are often started inside a Slurm job
/// (`mpirun` and `mpiexec` start their daemons with `srun`, torchrun is run by `srun` once a node):
/// their processes inherit SLURM_* variables that describe the daemons or the batch step, while
/// the launcher's own variables describe this process. One exception: when `srun` itself started
/// this process through its MPI plugin (SLURM_MPI_TYPE set and not "none") and SLURM_PROCID agrees
/// with PMI_RANK (and the step's task count with PMI_SIZE) or with PMIX_RANK (SLURM_MPI_TYPE
/// "pmix..."), both describe the same step, and Slurm's variables, which give every address, win.
///
/// A half-set environment is an error, never a silent one-worker run: a launcher's variables
/// without the ones that identify the process (e.g. MASTER_ADDR without RANK and WORLD_SIZE,
/// OMPI_COMM_WORLD_SIZE without OMPI_COMM_WORLD_RANK, PMI_SIZE without PMI_RANK,
/// CONSORT_CHIEF_ADDRESS alone), and a chosen launcher with a variable missing (RANK without
/// WORLD_SIZE, WORLD_SIZE without MASTER_ADDR).
/// @throws error(invalid_argument) for a half-set environment, naming the variables set and those
///         missing, or when the chosen resolver rejects its environment.
std::shared_ptr<cluster_resolver> resolve_cluster(const env_lookup& lookup = process_environment());

/// The tasks that are workers of `resolver`'s cluster, in rank order: the chief (chief:0, or
/// worker:0 without a chief job), then the worker tasks by index, whatever this process's own task
/// (an evaluator's or a ps task's view lists the training workers too). Under a launcher
/// (`launcher_cluster_resolver`), before the address exchange, worker:0 .. worker:n-1.
std::vector<task_id> worker_tasks(const cluster_resolver& resolver);

} // namespace consort
