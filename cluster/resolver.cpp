// The cluster_resolver base class, TF's multi-worker validation rules, and the resolvers whose
// answers come from TF_CONFIG or from code.

#include "cluster/detail.hpp"
#include "device/gpu.hpp"

#include <consort/error.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <climits>
#include <cstdlib>
#include <map>
#include <utility>

namespace consort {

using cluster_detail::describe;
using cluster_detail::join;
using cluster_detail::quote;

namespace {

constexpr std::array<std::string_view, 4> known_task_types = {"chief", "worker", "ps", "evaluator"};
constexpr std::string_view known_task_types_text = "chief, worker, ps or evaluator";

bool is_known_task_type(std::string_view type) {
  return std::find(known_task_types.begin(), known_task_types.end(), type) !=
         known_task_types.end();
}

std::string format_master_url(const std::string& address, const std::string& rpc_layer) {
  return rpc_layer.empty() ? address : rpc_layer + "://" + address;
}

std::string jobs_text(const cluster_spec& spec) {
  return join(spec.jobs());
}

} // namespace

// -- validation -----------------------------------------------------------------------------------

namespace {

// TF's multi_worker_util._validate_cluster_spec for a non-empty cluster, in its order, with TF's
// messages after `src`. Without an index (TF's worker_count, which ignores it) the index rules are
// skipped.
void check_tf_rules(const cluster_spec& spec, const std::string& type, std::optional<int> id,
                    const std::string& src) {
  for (const auto& job : spec.jobs())
    if (!is_known_task_type(job))
      throw_error(errc::invalid_argument,
                  src + ": Disallowed task type found in cluster spec: job " + quote(job) +
                      "; allowed types are " + std::string(known_task_types_text));
  if (!is_known_task_type(type))
    throw_error(errc::invalid_argument,
                src + ": Unrecognized task_type: " + quote(type) +
                    ", valid task types are: " + std::string(known_task_types_text));
  // TF lets an evaluator be absent from the cluster (Estimator's TF_CONFIG lists it apart).
  if (!spec.has_job(type) && type != "evaluator")
    throw_error(errc::invalid_argument, src + ": `task_type` " + quote(type) +
                                            " not found in cluster_spec; its jobs are " +
                                            jobs_text(spec));
  for (std::string_view single : {"chief", "evaluator"}) {
    const std::string job(single);
    if (spec.has_job(job) && spec.num_tasks(job) > 1)
      throw_error(errc::invalid_argument,
                  src + ": There must be at most one '" + job + "' job; job " + quote(job) +
                      " has " + std::to_string(spec.num_tasks(job)) + " tasks (indices " +
                      join(spec.task_indices(job)) + ")");
  }
  if (!id)
    return;
  if (*id < 0)
    throw_error(errc::invalid_argument, src + ": task index " + std::to_string(*id) +
                                            " of task type " + quote(type) +
                                            " is negative; expected an index >= 0");
  // TF checks `task_id < number of tasks`; for a sparse job we check that the index names one of
  // its tasks, which is the same rule for a dense job.
  if (spec.has_job(type)) {
    auto indices = spec.task_indices(type);
    if (!std::binary_search(indices.begin(), indices.end(), *id))
      throw_error(errc::invalid_argument,
                  src + ": The `task_id` " + std::to_string(*id) + " exceeds the maximum id of " +
                      type + "; job " + quote(type) + " has " + std::to_string(indices.size()) +
                      " task(s)" +
                      (indices.empty() ? std::string()
                                       : ", expected one of its indices: " + join(indices)));
  }
}

} // namespace

void validate_multi_worker_cluster(const cluster_resolver& resolver, const std::string& who) {
  const auto spec = resolver.cluster_spec();
  if (spec.empty())
    return;
  const auto type = resolver.task_type();
  const auto id = resolver.task_id();
  const std::string& src = who;
  constexpr std::string_view task_example = "\"task\": {\"type\": \"worker\", \"index\": 0}";
  if (!type || !id)
    throw_error(errc::invalid_argument,
                src +
                    ": When `cluster_spec` is given, you must also specify `task_type` and "
                    "`task_id`; the cluster has jobs " +
                    jobs_text(spec) + " but " +
                    (type ? "task " + quote(*type) + " has no index"
                          : std::string("no task type is given")) +
                    " (in TF_CONFIG: " + std::string(task_example) + ")");
  // The rules of multi_worker_util._validate_cluster_spec, in its order.
  check_tf_rules(spec, *type, *id, src);
  // Two tasks at one address cannot both serve it: the second would wait out the rendezvous for a
  // task that can never join. Refused here, naming both.
  std::map<std::string, std::string> owner;
  for (const auto& [job, tasks] : spec.as_dict())
    for (const auto& [index, address] : tasks) {
      const std::string task = job + ":" + std::to_string(index);
      auto [it, fresh] = owner.emplace(address, task);
      if (!fresh)
        throw_error(errc::invalid_argument, src + ": tasks " + it->second + " and " + task +
                                                " have the same address " + quote(address) +
                                                "; expected a distinct \"host:port\" per task");
    }
}

// -- cluster_resolver -----------------------------------------------------------------------------

std::unique_ptr<cluster_resolver> cluster_resolver::local() {
  return std::make_unique<simple_cluster_resolver>(consort::cluster_spec{}, std::nullopt,
                                                   std::nullopt);
}

// The accessors follow TF's multi_worker_util (is_chief, id_in_cluster, worker_count) on a
// non-empty cluster, each checking the task with TF's _validate_cluster_spec first, as TF's do.
// An empty cluster is a local run: TF's strategy then sets is_chief True and one worker
// (CollectiveAllReduceExtended._initialize_local), where multi_worker_util would raise.

namespace {

// "ps:1", or "ps" when the index is not known.
std::string task_text(const std::string& type, std::optional<int> id) {
  return id ? to_string(consort::task_id{type, *id}) : type;
}

[[noreturn]] void throw_no_task_type(const cluster_spec& spec, const std::string& src,
                                     const std::string& tf_says) {
  throw_error(errc::invalid_argument,
              src + ": this process has no task type (TF's multi_worker_util: " + tf_says +
                  "); the cluster has jobs " + jobs_text(spec) +
                  ", so a task is needed; expected one, e.g. TF_CONFIG's \"task\": "
                  "{\"type\": \"worker\", \"index\": 0}");
}

[[noreturn]] void throw_no_index(const std::string& type, const std::string& src) {
  throw_error(errc::invalid_argument,
              src + ": task type " + quote(type) +
                  " has no index; expected one, e.g. TF_CONFIG's \"task\": {\"type\": " +
                  quote(type) + ", \"index\": 0}");
}

} // namespace

bool cluster_resolver::is_chief() const {
  const auto spec = cluster_spec();
  if (spec.empty())
    return true;
  const auto type = task_type();
  // TF's is_chief(cluster_spec, None, None) passes its validation and answers False.
  if (!type)
    return false;
  const auto id = task_id();
  const std::string src = "is_chief()";
  check_tf_rules(spec, *type, id, src);
  if (!id)
    throw_no_index(*type, src);
  // The evaluator is the chief of its own group.
  if (*type == "chief" || *type == "evaluator")
    return true;
  return *type == "worker" && *id == 0 && !spec.has_job("chief");
}

consort::task_id cluster_resolver::chief() const {
  const auto spec = cluster_spec();
  if (spec.empty())
    return task();
  if (spec.has_job("chief"))
    return {"chief", 0};
  if (spec.has_job("worker"))
    return {"worker", 0};
  throw_error(errc::invalid_argument,
              "the cluster has neither a chief nor a worker job (jobs: " + jobs_text(spec) +
                  "); expected a \"chief\" or \"worker\" job to lead it");
}

int cluster_resolver::worker_rank() const {
  const auto spec = cluster_spec();
  if (spec.empty())
    return 0;
  const std::string src = "worker_rank()";
  const auto type = task_type();
  if (!type)
    throw_no_task_type(spec, src, "\"There is no id for task_type None\"");
  const auto id = task_id();
  check_tf_rules(spec, *type, id, src);
  if (*type == "ps")
    throw_error(errc::unsupported,
                src + ": task " + task_text(*type, id) +
                    " has no worker rank (TF: \"There is no id for task_type 'ps'\"); a ps task "
                    "is not a worker; expected a chief, worker or evaluator task");
  if (!id)
    throw_no_index(*type, src);
  if (*type == "chief")
    return 0;
  if (*type == "worker")
    return *id + (spec.has_job("chief") ? spec.num_tasks("chief") : 0);
  // The evaluator is a group of its own, of one task. In the cluster, the checks above make its
  // index 0; absent from it (as TF allows), its index must be 0 too.
  if (*id != 0)
    throw_error(errc::invalid_argument,
                src + ": The `task_id` " + std::to_string(*id) +
                    " exceeds the maximum id of evaluator; an evaluator is a group of its own, "
                    "of one task, so expected index 0");
  return 0;
}

int cluster_resolver::num_workers() const {
  const auto spec = cluster_spec();
  if (spec.empty())
    return 1;
  const std::string src = "num_workers()";
  const auto type = task_type();
  if (!type)
    throw_no_task_type(spec, src, "\"Unexpected `task_type` None\"");
  // TF's worker_count checks the task type, not the index.
  check_tf_rules(spec, *type, std::nullopt, src);
  if (*type == "ps")
    throw_error(errc::unsupported,
                src + ": task " + task_text(*type, task_id()) +
                    " has no worker count (TF: \"Unexpected `task_type` 'ps'\"); a ps task is "
                    "not a worker and has no replicas; expected a chief, worker or evaluator task");
  // The evaluator is a group of its own (TF: the number of evaluator tasks, at most one; consort
  // counts one also when the evaluator is absent from the cluster, where TF raises a KeyError).
  if (*type == "evaluator")
    return 1;
  int count = 0;
  for (const char* job : {"chief", "worker"})
    if (spec.has_job(job))
      count += spec.num_tasks(job);
  return count;
}

std::string cluster_resolver::master_impl(const std::string& type, int id,
                                          const std::string& rpc) const {
  const auto spec = cluster_spec();
  if (spec.empty())
    return {};
  const std::string chosen_type = type.empty() ? task_type().value_or("") : type;
  const auto chosen_id = id >= 0 ? std::optional<int>(id) : task_id();
  // As TF's Slurm and Simple resolvers: without a task there is no master to name.
  if (chosen_type.empty() || !chosen_id)
    return {};
  return format_master_url(spec.task_address(chosen_type, *chosen_id),
                           rpc.empty() ? rpc_layer() : rpc);
}

// -- tf_config_cluster_resolver -------------------------------------------------------------------

namespace {

constexpr std::string_view tf_config_example =
    "a JSON object such as {\"cluster\": {\"worker\": [\"host:port\", ...]}, \"task\": "
    "{\"type\": \"worker\", \"index\": 0}}";

bool blank(const std::string& text) {
  return std::all_of(text.begin(), text.end(),
                     [](unsigned char c) { return std::isspace(c) != 0; });
}

// A string-valued top-level key; null counts as absent, as TF's `key in tf_config` plus a None
// value does.
std::optional<std::string> string_key(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null())
    return std::nullopt;
  if (!it->is_string())
    throw_error(errc::invalid_argument,
                std::string("TF_CONFIG: \"") + key + "\" must be a string, got " + describe(*it));
  return it->get<std::string>();
}

// "task"."type": TF applies str(), so any JSON value names a job ("123456", "True", "None", ...).
std::string python_str(const nlohmann::json& value) {
  if (value.is_string())
    return value.get<std::string>();
  if (value.is_boolean())
    return value.get<bool>() ? "True" : "False";
  if (value.is_null())
    return "None";
  return value.dump(); // integers as Python writes them; floats, lists and objects as JSON
}

// "task"."index": TF applies int(), so an integer or a decimal string.
int task_index_of(const nlohmann::json& index) {
  if (index.is_number_integer()) {
    if (index.is_number_unsigned()
            ? index.get<unsigned long long>() <= INT_MAX
            : index.get<long long>() >= INT_MIN && index.get<long long>() <= INT_MAX)
      return static_cast<int>(index.get<long long>());
  } else if (index.is_string()) {
    if (auto value = cluster_detail::parse_integer(index.get<std::string>(), INT_MIN, INT_MAX))
      return static_cast<int>(*value);
  }
  throw_error(errc::invalid_argument,
              "TF_CONFIG: \"task\".\"index\" must be an integer task index, got " +
                  describe(index));
}

} // namespace

tf_config_cluster_resolver::tf_config_cluster_resolver(tf_config_overrides overrides)
    : tf_config_cluster_resolver(std::move(overrides), process_environment()) {}

tf_config_cluster_resolver::tf_config_cluster_resolver(tf_config_overrides overrides,
                                                       const env_lookup& lookup)
    : tf_config_cluster_resolver(from_text_tag{}, lookup("TF_CONFIG"), std::move(overrides)) {}

tf_config_cluster_resolver tf_config_cluster_resolver::from_json(const std::string& tf_config,
                                                                 tf_config_overrides overrides) {
  return tf_config_cluster_resolver(from_text_tag{}, tf_config, std::move(overrides));
}

tf_config_cluster_resolver::tf_config_cluster_resolver(from_text_tag,
                                                       const std::optional<std::string>& text,
                                                       tf_config_overrides overrides) {
  std::optional<std::string> type;
  std::optional<int> index;
  std::optional<std::string> rpc;
  std::optional<std::string> env;
  if (text && !blank(*text)) {
    const auto config = cluster_detail::parse_json(*text, "TF_CONFIG", tf_config_example);
    if (!config.is_object())
      throw_error(errc::invalid_argument, "TF_CONFIG must be " + std::string(tf_config_example) +
                                              ", got " + describe(config));
    if (auto it = config.find("cluster"); it != config.end())
      spec_ = cluster_detail::cluster_from_json(*it, "TF_CONFIG: \"cluster\"");
    if (auto it = config.find("task"); it != config.end()) {
      if (!it->is_object())
        throw_error(errc::invalid_argument,
                    "TF_CONFIG: \"task\" must be an object {\"type\": ..., \"index\": ...}, got " +
                        describe(*it));
      if (auto t = it->find("type"); t != it->end())
        type = python_str(*t);
      if (auto i = it->find("index"); i != it->end())
        index = task_index_of(*i);
    }
    rpc = string_key(config, "rpc_layer");
    env = string_key(config, "environment");
    if (auto master = string_key(config, "session_master")) {
      session_master_ = std::move(*master);
      has_session_master_ = true;
    }
  }
  if (overrides.task_type)
    type = overrides.task_type;
  if (overrides.task_id)
    index = overrides.task_id;
  if (overrides.rpc_layer)
    rpc = overrides.rpc_layer;
  if (overrides.environment)
    env = overrides.environment;

  task_type_ = std::move(type);
  task_id_ = index;
  rpc_layer_ = rpc.value_or("");
  environment_ = env.value_or("");
}

namespace {

// TF's TFConfigClusterResolver.master: "Return an empty string if we are the only job in the
// ClusterSpec": no job, or one job whose task list (`job_tasks`) has exactly one entry, i.e. only
// task 0. Any other cluster needs a task to name.
bool master_is_empty(const cluster_spec& spec) {
  if (spec.empty())
    return true;
  const auto& jobs = spec.as_dict();
  if (jobs.size() != 1)
    return false;
  const auto& tasks = jobs.begin()->second;
  return tasks.size() == 1 && tasks.begin()->first == 0;
}

int total_tasks(const cluster_spec& spec) {
  int count = 0;
  for (const auto& [job, tasks] : spec.as_dict())
    count += static_cast<int>(tasks.size());
  return count;
}

// TF's master() then calls cluster_spec.task_address(task_type, task_id), which raises for a
// None type ("No such job in cluster: None") or a None index ("No task with index None in job
// 'worker'"). `caller` is the consort call that needs the task.
void require_task_for_master(const cluster_spec& spec, const std::optional<std::string>& type,
                             const std::optional<int> id, const std::string& caller) {
  if (type && !type->empty() && id)
    return;
  const bool no_type = !type || type->empty();
  throw_error(errc::invalid_argument,
              "TF_CONFIG: " + caller + " needs this process's task: the cluster has " +
                  std::to_string(total_tasks(spec)) +
                  (total_tasks(spec) == 1 ? " task in jobs " : " tasks in jobs ") +
                  jobs_text(spec) + ", but " +
                  (no_type ? std::string("no task type is given (TF: \"No such job in cluster: "
                                         "None\")")
                           : "task type " + quote(*type) +
                                 " has no index (TF: \"No task with index None in job '" + *type +
                                 "'\")") +
                  "; expected TF_CONFIG's \"task\": {\"type\": \"worker\", \"index\": 0}, the "
                  "task_type and task_id overrides, or master(task_type, task_id)");
}

} // namespace

std::map<std::string, int> tf_config_cluster_resolver::num_accelerators() const {
  // TF's ClusterResolver.num_accelerators asks master(task_type, task_id) first, so it raises
  // where master() raises for want of a task.
  if (!has_session_master_ && !master_is_empty(spec_))
    require_task_for_master(spec_, task_type_, task_id_, "num_accelerators()");
  const int gpus = detail::gpu::count();
  if (gpus <= 0)
    return {};
  return {{"GPU", gpus}};
}

std::string tf_config_cluster_resolver::master_impl(const std::string& type, int id,
                                                    const std::string& rpc) const {
  // TF returns "session_master" whenever the key is there (`is not None`), even "".
  if (has_session_master_)
    return session_master_;
  if (master_is_empty(spec_))
    return {};
  // The arguments when given, else this process's task; TF raises without one.
  require_task_for_master(spec_, type.empty() ? task_type_ : std::optional<std::string>(type),
                          id >= 0 ? std::optional<int>(id) : task_id_, "master()");
  return cluster_resolver::master_impl(type, id, rpc);
}

// -- simple_cluster_resolver ----------------------------------------------------------------------

simple_cluster_resolver::simple_cluster_resolver(consort::cluster_spec spec,
                                                 std::optional<std::string> task_type,
                                                 std::optional<int> task_id, std::string rpc_layer,
                                                 std::map<std::string, int> accelerators)
    : spec_(std::move(spec)), task_type_(std::move(task_type)), task_id_(task_id),
      rpc_layer_(std::move(rpc_layer)), accelerators_(std::move(accelerators)) {
  for (const auto& [kind, count] : accelerators_)
    if (count < 0)
      throw_error(errc::invalid_argument, "simple_cluster_resolver: " + std::to_string(count) +
                                              " accelerators of kind " + quote(kind) +
                                              "; expected a count >= 0");
}

// -- environment ----------------------------------------------------------------------------------

env_lookup process_environment() {
  return [](const std::string& name) -> std::optional<std::string> {
    if (const char* value = std::getenv(name.c_str()))
      return std::string(value);
    return std::nullopt;
  };
}

// -- choosing a resolver
// ---------------------------------------------------------------------------

namespace {

/// The launcher resolvers' options from the environment: the host at which the other workers
/// reach this one from CONSORT_WORKER_HOST (tools/consort-launch --nnodes sets it), else this
/// host's name.
launcher_options launcher_options_from(const env_lookup& lookup) {
  launcher_options options;
  if (auto host = cluster_detail::env_value(lookup, worker_host_variable)) {
    const bool spaced = host->find_first_of(" \t\n") != std::string::npos;
    if (spaced || (host->front() == '[' && host->back() != ']'))
      throw_error(errc::invalid_argument,
                  std::string(worker_host_variable) + " is " + cluster_detail::quote(*host) +
                      "; expected the host name or IP address (IPv6 with or without brackets) at "
                      "which the other workers reach this one, without a port");
    options.host = *host;
  }
  return options;
}

} // namespace

std::shared_ptr<cluster_resolver> resolve_cluster(const env_lookup& lookup) {
  using cluster_detail::env_value;
  using cluster_detail::started_by_srun;
  // The order is documented in cluster.hpp and docs/multi_worker.md ("Starting the workers"):
  // the per-process launchers before Slurm, whose variables their processes may inherit from the
  // step or the batch script that started the launcher.
  if (env_value(lookup, "TF_CONFIG"))
    return std::make_shared<tf_config_cluster_resolver>(tf_config_overrides{}, lookup);
  if (env_value(lookup, "RANK") || env_value(lookup, "WORLD_SIZE"))
    return std::make_shared<torchrun_cluster_resolver>(launcher_options_from(lookup), lookup);
  if (env_value(lookup, "OMPI_COMM_WORLD_RANK"))
    return std::make_shared<mpi_cluster_resolver>(launcher_options_from(lookup), lookup);
  if (auto rank = env_value(lookup, "PMI_RANK")) {
    if (started_by_srun(lookup, *rank, env_value(lookup, "PMI_SIZE"), false))
      return std::make_shared<slurm_cluster_resolver>(slurm_options{}, lookup);
    return std::make_shared<pmi_cluster_resolver>(launcher_options_from(lookup), lookup);
  }
  if (auto rank = env_value(lookup, "PMIX_RANK")) {
    if (started_by_srun(lookup, *rank, std::nullopt, true))
      return std::make_shared<slurm_cluster_resolver>(slurm_options{}, lookup);
    return std::make_shared<pmix_cluster_resolver>(launcher_options_from(lookup), lookup);
  }
  if (env_value(lookup, "SLURM_PROCID"))
    return std::make_shared<slurm_cluster_resolver>(slurm_options{}, lookup);
  // No silent one-worker run from a half-set environment.
  cluster_detail::reject_half_set_launchers(lookup);
  return cluster_resolver::local();
}

std::vector<task_id> worker_tasks(const cluster_resolver& resolver) {
  std::vector<task_id> tasks;
  auto spec = resolver.cluster_spec();
  if (spec.has_job("chief"))
    tasks.push_back({"chief", 0});
  if (spec.has_job("worker"))
    for (int index : spec.task_indices("worker"))
      tasks.push_back({"worker", index});
  // A launcher's resolver before the address exchange knows only the chief and itself: the
  // workers are numbered by rank. (num_workers() is not asked otherwise: it is the size of this
  // task's own group, one for an evaluator, and a ps task has none.)
  if (auto* launched = dynamic_cast<const launcher_cluster_resolver*>(&resolver);
      launched && static_cast<int>(tasks.size()) != launched->num_workers()) {
    tasks.clear();
    for (int i = 0; i < launched->num_workers(); ++i)
      tasks.push_back({"worker", i});
  }
  return tasks;
}

} // namespace consort
