// multi_worker_mirrored_strategy: joins the cluster (membership at the chief, then the mesh of
// TCP connections between workers) and hands the runtime its cross-worker phase
// (docs/multi_worker.md).

#include <consort/caf_error.hpp>
#include <consort/cluster.hpp>
#include <consort/device.hpp>
#include <consort/strategy.hpp>
#include <consort/transport/membership.hpp>
#include <consort/transport/shm.hpp>
#include <consort/transport/tcp.hpp>

#include "actors/flight_recorder.hpp"
#include "actors/gpu_collectives.hpp"
#include "actors/runtime.hpp"
#include "actors/strategy_access.hpp"
#include "actors/worker_devices.hpp"
#include "device/gpu.hpp"
#include "transport/communicator.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <set>

namespace consort {

namespace detail {

/// What joining the cluster produced, handed to the strategy's constructor.
struct joined_cluster {
  std::shared_ptr<const cluster_resolver> resolver;
  std::unique_ptr<runtime> rt;
};

} // namespace detail

namespace {

namespace membership = transport::membership;

std::string env_or(const char* name, std::string fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::string{value} : std::move(fallback);
}

/// The host part of "host:port" ("[v6]:port" keeps its brackets).
std::string host_of(const std::string& address) {
  auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0)
    throw_error(errc::invalid_argument, "task address \"" + address + "\" is not \"host:port\"");
  return address.substr(0, colon);
}

/// Where this worker is among the workers of its host: a launcher's local rank and size, else the
/// worker tasks of the cluster at this task's host (TF_CONFIG, Slurm).
detail::worker_placement placement_of(const cluster_resolver& resolver) {
  detail::worker_placement where;
  where.own_gpus = env_or("CONSORT_OWN_GPUS", "") == "1";
  if (resolver.is_local() || resolver.num_workers() <= 1)
    return where;
  if (auto* launched = dynamic_cast<const launcher_cluster_resolver*>(&resolver)) {
    where.local_index = launched->local_rank();
    where.local_workers = launched->local_size().value_or(1);
    return where;
  }
  const auto spec = resolver.cluster_spec();
  const auto me = resolver.task();
  const auto own_host = host_of(spec.task_address(me.type, me.index));
  int count = 0;
  for (const auto& t : worker_tasks(resolver)) {
    if (host_of(spec.task_address(t.type, t.index)) != own_host)
      continue;
    if (t == me)
      where.local_index = count;
    ++count;
  }
  where.local_workers = std::max(count, 1);
  return where;
}

/// This worker's devices: the option, else its own GPUs or its slice of its host's, else
/// CONSORT_DEVICES_PER_WORKER CPU devices, else CPU:0 (actors/worker_devices.hpp).
std::vector<std::string> worker_devices(const multi_worker_options& mw,
                                        const cluster_resolver& resolver) {
  if (!mw.devices.empty())
    return mw.devices;
  auto choice = detail::default_worker_devices(
      detail::gpu::count(), std::getenv("CONSORT_DEVICES_PER_WORKER"), placement_of(resolver));
  if (!choice.note.empty()) {
    if (mw.log)
      mw.log(choice.note);
    else
      std::cerr << "consort: " << choice.note << std::endl;
  }
  return std::move(choice.devices);
}

/// Whether `host` (as host_of returns it) names this machine's loopback interface.
bool is_loopback_host(std::string host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return host == "localhost" || host == "::1" || host.starts_with("127.") ||
         host == "ip6-localhost";
}

/// Logs one warning when the cluster's tasks are on more than one host, or on a host other than
/// loopback, and there is no secret: then anything that reaches a port of the job can join it or
/// connect to a mesh.
void warn_if_unauthenticated(const cluster_spec& spec, const std::string& secret,
                             const std::function<void(const std::string&)>& log) {
  if (!secret.empty())
    return;
  std::set<std::string> hosts;
  bool remote = false;
  for (const auto& [job, tasks] : spec.as_dict())
    for (const auto& [index, address] : tasks) {
      auto colon = address.rfind(':');
      auto host = colon == std::string::npos ? address : address.substr(0, colon);
      hosts.insert(host);
      remote = remote || !is_loopback_host(host);
    }
  if (hosts.size() <= 1 && !remote)
    return;
  std::string names;
  for (const auto& h : hosts)
    names += (names.empty() ? "" : ", ") + h;
  // One host named by a network address (Slurm's node list names the node, not 127.0.0.1) is
  // reachable from the network too, but does not span hosts.
  log(std::string{"warning: the cluster "} +
      (hosts.size() > 1 ? "spans hosts (" : "listens on a network address (") + names +
      ") but has no shared secret: connections are not authenticated, so anything that can reach "
      "the chief's membership port or a worker's collective port can join or send frames into "
      "a collective. Set multi_worker_options::secret or CONSORT_CLUSTER_SECRET to the same "
      "value on every task (tools/consort-launch generates one); see docs/multi_worker.md, "
      "\"Authentication\"");
}

[[noreturn]] void fail(const caf::error& err, const std::string& what) {
  throw to_consort_error(err, what);
}

/// multi_worker_options::transport, or CONSORT_TRANSPORT, checked.
std::string transport_choice(const multi_worker_options& mw) {
  auto choice = mw.transport.empty() ? env_or("CONSORT_TRANSPORT", "auto") : mw.transport;
  if (choice != "auto" && choice != "tcp" && choice != "shm")
    throw_error(errc::invalid_argument,
                std::string{mw.transport.empty() ? "CONSORT_TRANSPORT"
                                                 : "multi_worker_options::transport"} +
                    " is \"" + choice + "\"; expected \"auto\", \"tcp\" or \"shm\"");
  return choice;
}

/// Every worker's yes or no, agreed over `mesh`: rank 0 gathers the votes and answers with
/// their AND, so that all workers switch transports together or none does.
caf::expected<bool> agree(transport::context& mesh, bool vote, transport::deadline until) {
  constexpr uint64_t tag = 0x5452'4e53'0000'0000; // "TRNS"
  std::byte mine{static_cast<uint8_t>(vote ? 1 : 0)};
  if (mesh.rank() == 0) {
    bool all = vote;
    for (int p = 1; p < mesh.size(); ++p) {
      std::byte theirs{};
      if (auto err = mesh.to(p).recv(tag, {&theirs, 1})->wait(until))
        return err;
      all = all && theirs == std::byte{1};
    }
    std::byte answer{static_cast<uint8_t>(all ? 1 : 0)};
    std::vector<transport::operation_ptr> sends;
    for (int p = 1; p < mesh.size(); ++p)
      sends.push_back(mesh.to(p).send(tag + 1, {transport::const_bytes{&answer, 1}}));
    if (auto err = transport::wait_all(sends, until))
      return err;
    return all;
  }
  if (auto err = mesh.to(0).send(tag, {transport::const_bytes{&mine, 1}})->wait(until))
    return err;
  std::byte answer{};
  if (auto err = mesh.to(0).recv(tag + 1, {&answer, 1})->wait(until))
    return err;
  return answer == std::byte{1};
}

std::unique_ptr<detail::joined_cluster> join_cluster(strategy_options opts,
                                                     multi_worker_options mw) {
  auto joined = std::make_unique<detail::joined_cluster>();
  std::shared_ptr<const cluster_resolver> resolver = mw.resolver;
  if (!resolver)
    resolver = resolve_cluster();
  joined->resolver = resolver;
  detail::validated(opts);
  // Checked before anything starts: a malformed CONSORT_FLIGHT_RECORDER_ENTRIES fails here.
  const auto recorder_entries = detail::flight_recorder::entries_for(opts.flight_recorder_entries);
  if (mw.close_timeout.count() < 0)
    throw_error(errc::invalid_argument,
                "multi_worker_options::close_timeout is " +
                    std::to_string(mw.close_timeout.count()) +
                    " ms; expected 0 (do not wait for the other workers at shutdown) or more");
  // TF's checks of the cluster and the task belong to the strategy, not to the resolver.
  validate_multi_worker_cluster(*resolver);
  auto devices = detail::canonical_devices(worker_devices(mw, *resolver));
  auto num_workers = resolver->num_workers();
  if (resolver->is_local() || num_workers <= 1) {
    joined->rt = std::make_unique<detail::runtime>(devices, opts);
    return joined;
  }
  auto me = resolver->task();
  if (me.type != "chief" && me.type != "worker")
    throw_error(errc::unsupported, "MultiWorkerMirroredStrategy runs on chief and worker tasks; "
                                   "this process is task " +
                                       to_string(me) + ", which has no replicas");
  auto tasks = worker_tasks(*resolver);
  int rank = -1;
  for (size_t i = 0; i < tasks.size(); ++i)
    if (tasks[i] == me)
      rank = static_cast<int>(i);
  if (rank < 0)
    throw_error(errc::invalid_argument,
                "task " + to_string(me) + " is not one of the cluster's workers");
  auto spec = resolver->cluster_spec();
  auto chief = resolver->chief();
  auto chief_address = spec.task_address(chief.type, chief.index);
  auto own_address = spec.task_address(me.type, me.index);
  auto log = mw.log;
  if (!log)
    log = [](const std::string& line) {
      std::cerr << "consort: " << line << std::endl;
    };

  // One secret authenticates both the membership connections and the mesh.
  auto secret = mw.secret.empty() ? env_or("CONSORT_CLUSTER_SECRET", "") : mw.secret;
  warn_if_unauthenticated(spec, secret, log);

  // The mesh listens on this task's host, on a port the kernel chooses; the view carries it.
  transport::tcp::mesh_options mesh;
  mesh.rank = rank;
  mesh.size = num_workers;
  mesh.listen_address = host_of(own_address) + ":0";
  mesh.group_id = transport::fnv1a(chief_address + "/" + std::to_string(num_workers));
  mesh.epoch = 1;
  mesh.secret = secret;
  mesh.connect_timeout = mw.rendezvous_timeout;
  mesh.log = log;
  auto ctx = transport::tcp::listen(mesh);
  if (!ctx)
    fail(ctx.error(), "MultiWorkerMirroredStrategy on " + to_string(me));

  membership::options mopts;
  mopts.tasks = tasks;
  // The cluster's digest travels in the Join, so that every task must have been given the same
  // one. A resolver that learns the addresses at the rendezvous (a launcher's: Open MPI, torchrun,
  // PMI, before its exchange) knows only its own and the chief's: the workers then compare their
  // lists of tasks. Its cluster must not count as complete even when those two are all the tasks
  // (two workers): rank 1 would send a digest of both addresses, and the chief, which knows only
  // its own, would refuse it.
  const bool complete =
      resolver->knows_every_address() &&
      std::all_of(tasks.begin(), tasks.end(), [&spec](const task_id& t) {
        const auto indices = spec.has_job(t.type) ? spec.task_indices(t.type) : std::vector<int>{};
        return std::find(indices.begin(), indices.end(), t.index) != indices.end();
      });
  if (complete)
    mopts.cluster = spec;
  mopts.rank = rank;
  mopts.chief_address = chief_address;
  mopts.address = (*ctx)->listen_address();
  for (const auto& name : devices)
    mopts.devices.push_back({name, parse_device(name).kind == device_kind::gpu, 0});
  // The chief makes the NCCL unique id of the first communicator over every worker's GPU
  // replicas, and the view carries it to every worker (docs/gpu.md).
  bool gpus = false;
  for (const auto& name : devices)
    gpus = gpus || parse_device(name).kind == device_kind::gpu;
  if (rank == 0 && gpus)
    for (auto b : detail::make_nccl_unique_id())
      mopts.nccl_unique_id.push_back(static_cast<std::byte>(b));
  mopts.secret = secret;
  // A worker waits a little longer than the chief, so that past the deadline it receives the
  // chief's verdict (which tasks are missing) rather than only its own timeout.
  mopts.rendezvous_timeout =
      rank == 0 ? mw.rendezvous_timeout
                : mw.rendezvous_timeout +
                      std::min(mw.rendezvous_timeout / 2, std::chrono::milliseconds{5000});
  mopts.heartbeat_interval = mw.heartbeat_interval;
  mopts.peer_timeout = mw.peer_timeout;
  mopts.log = log;
  auto svc = membership::service::start(std::move(mopts));
  if (!svc)
    fail(svc.error(), "joining the cluster as " + to_string(me));
  std::shared_ptr<membership::service> service = std::move(*svc);

  const auto choice = transport_choice(mw);
  // A loss fails the cross-worker phase at once: before it exists, the contexts that setting it
  // up waits on; the lanes and the service outlive no one here: the runtime stops the service's
  // callbacks (leave) before it stops the lanes.
  struct loss_target {
    std::mutex mtx;
    std::string cause;
    std::weak_ptr<transport::communicator> cross;
    std::vector<transport::context_ptr> contexts;
  };
  auto target = std::make_shared<loss_target>();
  target->contexts.push_back(*ctx);
  // The flight recorder exists from here on, so that a loss before the first step is in it too.
  std::vector<std::string> names;
  for (const auto& t : tasks)
    names.push_back(to_string(t));
  auto recorder =
      std::make_shared<detail::flight_recorder>(recorder_entries, rank, std::move(names));
  service->on_lost([target, log, recorder](const membership::lost_event& event) {
    log("lost " + event.cause);
    recorder->note("lost " + event.cause);
    recorder->dump_on_failure("lost " + event.cause);
    std::lock_guard<std::mutex> guard{target->mtx};
    if (target->cause.empty())
      target->cause = "lost " + event.cause;
    if (auto c = target->cross.lock())
      c->abort(target->cause);
    for (auto& c : target->contexts)
      c->abort(target->cause);
  });
  auto view = service->rendezvous();
  if (!view)
    fail(view.error(), "joining the cluster as " + to_string(me));
  std::vector<std::string> addresses;
  for (const auto& m : view->members) {
    if (m.devices.size() != devices.size())
      throw_error(errc::invalid_argument,
                  "worker " + to_string(m.task) + " has " + std::to_string(m.devices.size()) +
                      " devices but this worker has " + std::to_string(devices.size()) +
                      "; MultiWorkerMirroredStrategy needs the same number on every worker");
    addresses.push_back(m.address);
  }
  if (static_cast<int>(addresses.size()) != num_workers)
    throw_error(errc::invalid_argument, "the chief's view has " + std::to_string(addresses.size()) +
                                            " members; expected " + std::to_string(num_workers));
  if (auto err = (*ctx)->connect(addresses))
    fail(err, "connecting to the other workers as " + to_string(me));

  // Shared memory when every worker is on this host and every worker chose it.
  transport::context_ptr data = *ctx;
  bool one_host = true;
  for (const auto& a : addresses)
    one_host = one_host && host_of(a) == host_of(addresses.front());
  const auto setup_until = transport::clock::now() + mw.rendezvous_timeout;
  auto shm_agreed = agree(**ctx, choice != "tcp" && one_host, setup_until);
  if (!shm_agreed)
    fail(shm_agreed.error(), "choosing the transport with the other workers as " + to_string(me));
  if (choice == "shm" && !*shm_agreed)
    throw_error(errc::invalid_argument,
                std::string{"the transport is \"shm\" but "} +
                    (one_host ? "another worker chose \"tcp\""
                              : "the workers are on several hosts (shared memory needs one)"));
  if (*shm_agreed) {
    transport::shm::options so;
    so.group_id = mesh.group_id;
    so.epoch = mesh.epoch;
    so.secret = secret;
    so.connect_timeout = mw.rendezvous_timeout;
    auto shm = transport::shm::connect(**ctx, so);
    if (shm) {
      {
        std::lock_guard<std::mutex> guard{target->mtx};
        target->contexts.push_back(*shm);
        if (!target->cause.empty())
          (*shm)->abort(target->cause);
      }
      // The mesh has done its part: leave it cleanly, so that no worker logs a broken connection.
      if (auto err = (*ctx)->close("the workers exchange through shared memory", setup_until))
        fail(err, "closing the TCP mesh after switching to shared memory as " + to_string(me));
      data = *shm;
    } else if (choice == "shm") {
      fail(shm.error(), "setting up shared memory with the other workers as " + to_string(me));
    } else {
      log("shared memory between the workers is unavailable, so they use TCP: " +
          std::string{to_consort_error(shm.error(), "").what()});
    }
  }
  transport::group_members members{mesh.epoch, {}};
  for (const auto& t : tasks)
    members.names.push_back(to_string(t));
  auto cross = std::make_shared<transport::communicator>(data, static_cast<int>(devices.size()),
                                                         std::move(members), mw.close_timeout);
  {
    std::lock_guard<std::mutex> guard{target->mtx};
    target->cross = cross;
    if (!target->cause.empty())
      cross->abort(target->cause);
  }

  detail::multi_worker_setup setup;
  setup.worker_rank = rank;
  setup.num_workers = num_workers;
  setup.cross = std::move(cross);
  for (auto b : view->nccl_unique_id)
    setup.nccl_unique_id.push_back(static_cast<uint8_t>(b));
  setup.recorder = std::move(recorder);
  setup.on_shutdown = [service, log](const caf::error& closed) {
    if (closed)
      log(to_consort_error(closed, "leaving the other workers").what());
    service->leave("shutdown");
  };
  joined->rt = std::make_unique<detail::runtime>(devices, opts, std::move(setup));
  return joined;
}

} // namespace

std::unique_ptr<multi_worker_mirrored_strategy> detail::strategy_access::simulated_worker(
    const strategy_options& opts, int rank, int workers, std::vector<std::string> devices,
    transport::context_ptr network, std::chrono::milliseconds close_timeout) {
  detail::validated(opts);
  devices = detail::canonical_devices(devices);
  std::map<int, std::string> tasks;
  for (int w = 0; w < workers; ++w)
    tasks[w] = "sim-worker-" + std::to_string(w) + ":0";
  auto joined = std::make_unique<detail::joined_cluster>();
  joined->resolver = std::make_shared<simple_cluster_resolver>(
      cluster_spec{cluster_spec::job_map{{"worker", std::move(tasks)}}}, "worker", rank);
  detail::multi_worker_setup setup;
  setup.worker_rank = rank;
  setup.num_workers = workers;
  transport::group_members members{1, {}};
  for (int w = 0; w < workers; ++w)
    members.names.push_back("worker:" + std::to_string(w));
  setup.cross = std::make_shared<transport::communicator>(
      std::move(network), static_cast<int>(devices.size()), std::move(members), close_timeout);
  joined->rt = std::make_unique<detail::runtime>(std::move(devices), opts, std::move(setup));
  return std::unique_ptr<multi_worker_mirrored_strategy>(
      new multi_worker_mirrored_strategy(std::move(joined)));
}

void detail::strategy_access::advance_step_clock(multi_worker_mirrored_strategy& s,
                                                 std::chrono::nanoseconds by) {
  s.runtime().advance_step_clock(by);
}

std::optional<std::pair<uint64_t, std::chrono::nanoseconds>>
detail::strategy_access::oldest_running_step(multi_worker_mirrored_strategy& s) {
  return s.runtime().oldest_running_step();
}

multi_worker_mirrored_strategy::multi_worker_mirrored_strategy(strategy_options opts,
                                                               multi_worker_options mw)
    : multi_worker_mirrored_strategy(join_cluster(opts, std::move(mw))) {}

multi_worker_mirrored_strategy::multi_worker_mirrored_strategy(
    std::unique_ptr<detail::joined_cluster> joined)
    : strategy(std::move(joined->rt), kind::multi_worker), resolver_(std::move(joined->resolver)) {}

int multi_worker_mirrored_strategy::worker_rank() const noexcept {
  return runtime().worker_rank();
}

int multi_worker_mirrored_strategy::num_workers() const noexcept {
  return runtime().num_workers();
}

} // namespace consort
