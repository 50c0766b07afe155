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
#include "actors/stderr_line.hpp"
#include "actors/strategy_access.hpp"
#include "actors/worker_devices.hpp"
#include "device/gpu.hpp"
#include "transport/communicator.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace consort {

namespace detail {

/// What joining the cluster produced, handed to the strategy's constructor.
struct joined_cluster {
  std::shared_ptr<const cluster_resolver> resolver;
  std::unique_ptr<runtime> rt;
  /// Elastic groups only: what re-forms the group.
  std::shared_ptr<elastic_group> group;
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
      detail::write_stderr_line(choice.note);
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

/// A port of `host` held for an epoch's mesh before its view says the rank and size: bound with
/// SO_REUSEADDR and not listening, so that nothing else takes it and the mesh can listen on it
/// (peers that connect before it listens are refused, and retry).
class port_reservation {
public:
  explicit port_reservation(const std::string& host) {
    auto bare = host;
    if (bare.size() >= 2 && bare.front() == '[' && bare.back() == ']')
      bare = bare.substr(1, bare.size() - 2);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* found = nullptr;
    if (int rc = ::getaddrinfo(bare.c_str(), "0", &hints, &found); rc != 0 || !found)
      throw_error(errc::invalid_argument,
                  "reserving a port on \"" + host + "\" for the next epoch: " + ::gai_strerror(rc));
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard{found, ::freeaddrinfo};
    fd_ = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    sockaddr_storage bound{};
    socklen_t length = sizeof bound;
    if (fd_ < 0 || ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
        ::bind(fd_, found->ai_addr, found->ai_addrlen) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
      auto why = std::string{std::strerror(errno)};
      release();
      throw_error(errc::invalid_argument,
                  "reserving a port on \"" + host + "\" for the next epoch: " + why);
    }
    const auto port = bound.ss_family == AF_INET6
                          ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                          : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    address_ = host + ":" + std::to_string(port);
  }
  ~port_reservation() { release(); }
  port_reservation(const port_reservation&) = delete;
  port_reservation& operator=(const port_reservation&) = delete;

  const std::string& address() const noexcept { return address_; }
  void release() noexcept {
    if (fd_ >= 0)
      ::close(fd_);
    fd_ = -1;
  }

private:
  int fd_ = -1;
  std::string address_;
};

/// A loss or a change of the group fails the cross-worker phase at once: before it exists, the
/// contexts that setting it up waits on. The membership service calls it on its I/O thread.
struct loss_target {
  std::mutex mtx;
  /// Why the group of epochs before `aborted_before` ended (the first cause kept), and the code
  /// their calls fail with: peer_lost, or (elastic) membership_changed.
  std::string cause;
  errc code = errc::peer_lost;
  uint64_t aborted_before = 0;
  /// The current epoch's parts.
  uint64_t epoch = 0;
  std::weak_ptr<transport::communicator> cross;
  std::vector<transport::context_ptr> contexts;

  /// Parts of `epoch` from now on; those of an epoch already ended are aborted at once.
  void begin(uint64_t e) {
    std::lock_guard<std::mutex> guard{mtx};
    epoch = e;
    cross.reset();
    contexts.clear();
  }
  void add(const transport::context_ptr& c) {
    std::lock_guard<std::mutex> guard{mtx};
    contexts.push_back(c);
    if (epoch < aborted_before)
      c->abort(cause, code);
  }
  void add(const std::shared_ptr<transport::communicator>& c) {
    std::lock_guard<std::mutex> guard{mtx};
    cross = c;
    if (epoch < aborted_before)
      c->abort(cause, code);
  }
  /// Ends every epoch before `next` (0: every epoch: the group ended).
  void end(uint64_t next, const std::string& why, errc c) {
    std::lock_guard<std::mutex> guard{mtx};
    const auto before = next == 0 ? std::numeric_limits<uint64_t>::max() : next;
    if (before <= aborted_before)
      return;
    aborted_before = before;
    cause = why;
    code = c;
    if (epoch >= before)
      return;
    if (auto comm = cross.lock())
      comm->abort(cause, code);
    for (auto& ctx : contexts)
      ctx->abort(cause, code);
  }
  /// Whether a change after epoch `e` was announced.
  bool changed_after(uint64_t e) {
    std::lock_guard<std::mutex> guard{mtx};
    return aborted_before > e;
  }

  /// Elastic: a join that waits for the next step boundary (membership::lost_event::at_boundary)
  /// begins epoch `next`.
  uint64_t boundary_epoch = 0;
  std::string boundary_cause;
  void at_boundary(uint64_t next, const std::string& why) {
    std::lock_guard<std::mutex> guard{mtx};
    if (next <= boundary_epoch)
      return;
    boundary_epoch = next;
    boundary_cause = why;
  }
  /// Why the group re-forms at the next step boundary after epoch `e`, or "" when it does not.
  std::string boundary_after(uint64_t e) {
    std::lock_guard<std::mutex> guard{mtx};
    return boundary_epoch > e ? boundary_cause : std::string{};
  }
};

} // namespace

/// What a worker keeps of its cluster to form each epoch's group: the membership service, how
/// it connects, and what it tells the runtime. The strategy holds it (elastic groups re-form).
struct detail::elastic_group {
  strategy_options opts;
  multi_worker_options mw;
  std::string choice; // transport: auto, tcp or shm
  std::vector<std::string> devices;
  std::vector<task_id> tasks;
  task_id me;
  std::string own_host;
  /// Names epoch 1's mesh and shared memory of a group that is not elastic (its view's group id
  /// is not known when the mesh listens).
  std::string mw_group_key;
  std::string secret;
  std::function<void(const std::string&)> log;
  size_t recorder_entries = 0;
  std::shared_ptr<membership::service> service;
  std::shared_ptr<loss_target> target = std::make_shared<loss_target>();
  std::shared_ptr<flight_recorder> first_recorder;
  std::vector<uint8_t> nccl_unique_id;
  membership::view view;
  /// Whether this process formed an epoch yet (a first view of a later epoch: it joined a
  /// running group).
  bool formed_any = false;
  /// Whether this process's first epoch was a later one (multi_worker_mirrored_strategy::
  /// joined_running_group).
  bool joined = false;
  /// Set when the runtime of the current epoch is retired: its shutdown must not leave.
  std::shared_ptr<std::atomic<bool>> retired;
  /// Set when the chief left this worker out of the group (membership::lost_event::left_out):
  /// `reform` then joins the group again as a new member of this task.
  std::shared_ptr<std::atomic<bool>> left_out = std::make_shared<std::atomic<bool>>(false);
  bool elastic() const noexcept { return mw.elastic_min_workers > 0; }
  /// consort::testing's elastic workers: their views and contexts come from the harness (no
  /// service, no mesh).
  strategy_access::simulated_membership sim;
  /// Held while the strategy swaps its engine, and by the harness's calls into the engine.
  std::mutex rt_mtx;

  /// The communicator of `v`'s epoch (two workers or more) over `ctx`, which listens for it:
  /// the mesh, then shared memory when the workers agree on it.
  std::shared_ptr<transport::communicator> join_mesh(const membership::view& v,
                                                     std::shared_ptr<transport::tcp::context> ctx);
  /// The communicator of `v`'s epoch over the simulated network (`sim`).
  std::shared_ptr<transport::communicator> join_simulated(const membership::view& v);
  /// The runtime of `v`'s epoch over `ctx`, a TCP context of this worker that listens for it
  /// (null for a group of one worker or a simulated one).
  std::unique_ptr<runtime> connect(const membership::view& v,
                                   std::shared_ptr<transport::tcp::context> ctx);
  /// `v`'s epoch, and the epochs that follow while changes are announced during its set-up
  /// (elastic); `ctx` listens for `v`'s, or is null to listen on `reserved`.
  std::unique_ptr<runtime> form(membership::view v, std::shared_ptr<transport::tcp::context> ctx,
                                std::unique_ptr<port_reservation> reserved);
  /// Takes part in the epoch after `after` (elastic): offers a reserved port, and waits for the
  /// view.
  std::pair<membership::view, std::unique_ptr<port_reservation>> next_view(uint64_t after);
};

namespace {

std::shared_ptr<transport::tcp::context> listen_for(detail::elastic_group& g,
                                                    const membership::view& v, int rank,
                                                    const std::string& address) {
  transport::tcp::mesh_options mesh;
  mesh.rank = rank;
  mesh.size = static_cast<int>(v.members.size());
  mesh.listen_address = address;
  mesh.group_id = v.group_id;
  mesh.epoch = v.epoch;
  mesh.secret = g.secret;
  mesh.connect_timeout = g.mw.rendezvous_timeout;
  mesh.log = g.log;
  auto ctx = transport::tcp::listen(mesh);
  if (!ctx)
    fail(ctx.error(), "listening for epoch " + std::to_string(v.epoch) + " as " + to_string(g.me));
  return *ctx;
}

int rank_in(const membership::view& v, const task_id& me) {
  for (const auto& m : v.members)
    if (m.task == me)
      return m.rank;
  throw_error(errc::peer_lost,
              "the group's epoch " + std::to_string(v.epoch) + " leaves " + to_string(me) + " out");
}

} // namespace

std::shared_ptr<transport::communicator>
detail::elastic_group::join_mesh(const membership::view& v,
                                 std::shared_ptr<transport::tcp::context> ctx) {
  target->add(ctx);
  std::vector<std::string> addresses;
  for (const auto& m : v.members) {
    if (m.devices.size() != devices.size())
      throw_error(errc::invalid_argument,
                  "worker " + to_string(m.task) + " has " + std::to_string(m.devices.size()) +
                      " devices but this worker has " + std::to_string(devices.size()) +
                      "; MultiWorkerMirroredStrategy needs the same number on every worker");
    addresses.push_back(m.address);
  }
  if (auto err = ctx->connect(addresses))
    fail(err, "connecting to the other workers as " + to_string(me));

  // Shared memory when every worker is on this host and every worker chose it.
  transport::context_ptr data = ctx;
  bool one_host = true;
  for (const auto& a : addresses)
    one_host = one_host && host_of(a) == host_of(addresses.front());
  const auto setup_until = transport::clock::now() + mw.rendezvous_timeout;
  auto shm_agreed = agree(*ctx, choice != "tcp" && one_host, setup_until);
  if (!shm_agreed)
    fail(shm_agreed.error(), "choosing the transport with the other workers as " + to_string(me));
  if (choice == "shm" && !*shm_agreed)
    throw_error(errc::invalid_argument,
                std::string{"the transport is \"shm\" but "} +
                    (one_host ? "another worker chose \"tcp\""
                              : "the workers are on several hosts (shared memory needs one)"));
  if (*shm_agreed) {
    transport::shm::options so;
    so.group_id = v.epoch == 1 && !elastic() ? transport::fnv1a(mw_group_key) : v.group_id;
    so.epoch = v.epoch;
    so.secret = secret;
    so.connect_timeout = mw.rendezvous_timeout;
    auto shm = transport::shm::connect(*ctx, so);
    if (shm) {
      target->add(*shm);
      // The mesh has done its part: leave it cleanly, so that no worker logs a broken connection.
      if (auto err = ctx->close("the workers exchange through shared memory", setup_until))
        fail(err, "closing the TCP mesh after switching to shared memory as " + to_string(me));
      data = *shm;
    } else if (choice == "shm") {
      fail(shm.error(), "setting up shared memory with the other workers as " + to_string(me));
    } else {
      log("shared memory between the workers is unavailable, so they use TCP: " +
          std::string{to_consort_error(shm.error(), "").what()});
    }
  }
  transport::group_members members{v.epoch, {}};
  for (const auto& m : v.members)
    members.names.push_back(to_string(m.task));
  auto cross = std::make_shared<transport::communicator>(data, static_cast<int>(devices.size()),
                                                         members, mw.close_timeout);
  if (elastic())
    cross->set_change_grace(mw.peer_timeout + mw.heartbeat_interval);
  target->add(cross);
  return cross;
}

std::shared_ptr<transport::communicator>
detail::elastic_group::join_simulated(const membership::view& v) {
  auto ctx = sim.context(v);
  target->add(ctx);
  transport::group_members members{v.epoch, {}};
  for (const auto& m : v.members)
    members.names.push_back(to_string(m.task));
  auto cross = std::make_shared<transport::communicator>(
      std::move(ctx), static_cast<int>(devices.size()), members, mw.close_timeout);
  cross->set_change_grace(mw.peer_timeout + mw.heartbeat_interval);
  target->add(cross);
  return cross;
}

std::unique_ptr<detail::runtime>
detail::elastic_group::connect(const membership::view& v,
                               std::shared_ptr<transport::tcp::context> ctx) {
  const int rank = rank_in(v, me);
  const int size = static_cast<int>(v.members.size());
  // An elastic group of one worker needs no mesh.
  std::shared_ptr<transport::communicator> cross;
  if (size > 1)
    cross = sim.context ? join_simulated(v) : join_mesh(v, std::move(ctx));
  transport::group_members members{v.epoch, {}};
  for (const auto& m : v.members)
    members.names.push_back(to_string(m.task));

  detail::multi_worker_setup setup;
  setup.worker_rank = rank;
  setup.num_workers = size;
  setup.cross = std::move(cross);
  setup.epoch = v.epoch;
  setup.joined_running_group = v.epoch > 1 && !formed_any;
  setup.elastic = elastic();
  for (auto b : v.nccl_unique_id)
    setup.nccl_unique_id.push_back(static_cast<uint8_t>(b));
  if (first_recorder && v.epoch == view.epoch && rank == first_recorder->rank()) {
    setup.recorder = first_recorder; // the recorder that saw the start-up
  } else {
    setup.recorder =
        std::make_shared<detail::flight_recorder>(recorder_entries, rank, members.names);
    setup.recorder->note("membership epoch " + std::to_string(v.epoch) + ": " +
                         std::to_string(size) + " workers");
  }
  if (rank == 0)
    setup.recorder->set_straggler_log(log); // the chief names stragglers, once for the job
  first_recorder.reset();
  if (retired)
    retired->store(true); // the previous epoch's engine, shut down once this one replaces it
  retired = std::make_shared<std::atomic<bool>>(false);
  if (rank != 0 && service)
    setup.chief_clock = [svc = std::weak_ptr<membership::service>(service)] {
      auto s = svc.lock();
      return s ? s->chief_clock_offset() : clock_offset{};
    };
  setup.on_shutdown = [svc = service, log = log, retired = retired](const caf::error& closed) {
    if (retired->load())
      return; // an earlier epoch's engine: the worker stays in the cluster
    if (closed)
      log(to_consort_error(closed, "leaving the other workers").what());
    if (svc) // none under consort::testing
      svc->leave("shutdown");
  };
  view = v;
  if (!formed_any)
    joined = setup.joined_running_group;
  formed_any = true;
  return std::make_unique<detail::runtime>(devices, opts, std::move(setup));
}

std::pair<membership::view, std::unique_ptr<port_reservation>>
detail::elastic_group::next_view(uint64_t after) {
  if (sim.next_view)
    return {sim.next_view(after), nullptr};
  auto reserved = std::make_unique<port_reservation>(own_host);
  auto v = service->next_view(after, reserved->address(),
                              std::chrono::steady_clock::now() + mw.rendezvous_timeout);
  if (!v)
    fail(v.error(),
         "re-forming the group after epoch " + std::to_string(after) + " as " + to_string(me));
  return {std::move(*v), std::move(reserved)};
}

std::unique_ptr<detail::runtime>
detail::elastic_group::form(membership::view v, std::shared_ptr<transport::tcp::context> ctx,
                            std::unique_ptr<port_reservation> reserved) {
  for (;;) {
    target->begin(v.epoch);
    try {
      if (!ctx && v.members.size() > 1 && !sim.context)
        ctx = listen_for(*this, v, rank_in(v, me), reserved->address());
      if (reserved)
        reserved->release();
      return connect(v, std::move(ctx));
    } catch (const error& e) {
      // A change announced while this epoch was set up (another worker lost meanwhile): the
      // next one follows.
      if (!elastic() || !target->changed_after(v.epoch))
        throw;
      log("epoch " + std::to_string(v.epoch) + " changed while it was set up (" + e.what() +
          "); taking part in the next one");
      ctx.reset();
      std::tie(v, reserved) = next_view(v.epoch);
    }
  }
}

namespace {

/// multi_worker_options::peer_timeout and heartbeat_interval left at 0: CONSORT_PEER_TIMEOUT_MS
/// when set (a worker held in a debugger needs longer), else 800 ms; heartbeats 8 to a timeout.
void resolve_liveness(multi_worker_options& mw) {
  if (mw.peer_timeout.count() == 0) {
    mw.peer_timeout = multi_worker_options::default_peer_timeout;
    if (const char* env = std::getenv("CONSORT_PEER_TIMEOUT_MS"); env != nullptr && *env) {
      char* end = nullptr;
      errno = 0;
      const long long value = std::strtoll(env, &end, 10);
      if (end == env || *end != '\0' || errno != 0 || value <= 0 || value > 86'400'000)
        throw_error(errc::invalid_argument, "CONSORT_PEER_TIMEOUT_MS is \"" + std::string{env} +
                                                "\"; expected milliseconds, 1 to 86400000 (a day)");
      mw.peer_timeout = std::chrono::milliseconds{value};
    }
  }
  if (mw.peer_timeout.count() < 0)
    throw_error(errc::invalid_argument,
                "multi_worker_options::peer_timeout is " + std::to_string(mw.peer_timeout.count()) +
                    " ms; expected 0 (CONSORT_PEER_TIMEOUT_MS, else 800 ms) or more");
  if (mw.heartbeat_interval.count() == 0)
    mw.heartbeat_interval = std::max(std::chrono::milliseconds{1}, mw.peer_timeout / 8);
  if (mw.heartbeat_interval.count() < 0)
    throw_error(errc::invalid_argument, "multi_worker_options::heartbeat_interval is " +
                                            std::to_string(mw.heartbeat_interval.count()) +
                                            " ms; expected 0 (an eighth of peer_timeout) or more");
}

std::unique_ptr<detail::joined_cluster> join_cluster(strategy_options opts,
                                                     multi_worker_options mw) {
  auto joined = std::make_unique<detail::joined_cluster>();
  std::shared_ptr<const cluster_resolver> resolver = mw.resolver;
  if (!resolver)
    resolver = resolve_cluster();
  joined->resolver = resolver;
  detail::validated(opts);
  // Checked before anything starts: a malformed CONSORT_FLIGHT_RECORDER_ENTRIES or straggler
  // rule fails here.
  const auto recorder_entries = detail::flight_recorder::entries_for(opts.flight_recorder_entries);
  (void)detail::flight_recorder::straggler_rule_for(opts.straggler_share, opts.straggler_steps);
  if (mw.close_timeout.count() < 0)
    throw_error(errc::invalid_argument,
                "multi_worker_options::close_timeout is " +
                    std::to_string(mw.close_timeout.count()) +
                    " ms; expected 0 (do not wait for the other workers at shutdown) or more");
  // TF's checks of the cluster and the task belong to the strategy, not to the resolver.
  validate_multi_worker_cluster(*resolver);
  auto devices = detail::canonical_devices(worker_devices(mw, *resolver));
  auto num_workers = resolver->num_workers();
  if (mw.elastic_min_workers == 0) {
    // tools/consort-launch --elastic MIN says it to every worker.
    const auto text = env_or("CONSORT_ELASTIC_MIN_WORKERS", "0");
    char* end = nullptr;
    const long value = std::strtol(text.c_str(), &end, 10);
    if (end == text.c_str() || *end != '\0' || value < 0 || value > 1 << 20)
      throw_error(errc::invalid_argument, "CONSORT_ELASTIC_MIN_WORKERS is \"" + text +
                                              "\"; expected a count of workers (0: not elastic)");
    mw.elastic_min_workers = static_cast<int>(value);
  }
  resolve_liveness(mw);
  if (mw.elastic_min_workers < 0 || mw.elastic_min_workers > std::max(num_workers, 1))
    throw_error(errc::invalid_argument,
                "multi_worker_options::elastic_min_workers is " +
                    std::to_string(mw.elastic_min_workers) +
                    "; expected 0 (not elastic) or 1 to the number of workers (" +
                    std::to_string(num_workers) + ")");
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
  bool gpus = false;
  for (const auto& name : devices)
    gpus = gpus || parse_device(name).kind == device_kind::gpu;
  if (gpus && mw.elastic_min_workers > 0)
    throw_error(errc::unsupported,
                "multi_worker_options::elastic_min_workers is " +
                    std::to_string(mw.elastic_min_workers) +
                    " but this worker has GPU replicas; "
                    "elastic groups run on CPU replicas (the NCCL communicators across workers are "
                    "not re-formed yet): give CPU devices, or set it to 0");
  auto spec = resolver->cluster_spec();
  auto chief = resolver->chief();
  auto chief_address = spec.task_address(chief.type, chief.index);
  auto own_address = spec.task_address(me.type, me.index);
  auto log = mw.log;
  if (!log)
    log = [](const std::string& line) {
      detail::write_stderr_line(line);
    };

  auto group = std::make_shared<detail::elastic_group>();
  group->opts = opts;
  group->mw = mw;
  group->choice = transport_choice(mw);
  group->devices = devices;
  group->tasks = tasks;
  group->me = me;
  group->own_host = host_of(own_address);
  group->log = log;
  group->recorder_entries = recorder_entries;
  group->mw_group_key = chief_address + "/" + std::to_string(num_workers);

  // One secret authenticates both the membership connections and the mesh.
  auto secret = mw.secret.empty() ? env_or("CONSORT_CLUSTER_SECRET", "") : mw.secret;
  group->secret = secret;
  warn_if_unauthenticated(spec, secret, log);

  // The mesh listens on this task's host, on a port the kernel chooses; the view carries it.
  // Not elastic: it listens now, as rank `rank` of epoch 1. Elastic: the view says the rank and
  // the epoch (a restarted worker joins a running group), so a port is held until it comes.
  std::shared_ptr<transport::tcp::context> ctx;
  std::unique_ptr<port_reservation> reserved;
  std::string collective_address;
  if (group->elastic()) {
    reserved = std::make_unique<port_reservation>(group->own_host);
    collective_address = reserved->address();
  } else {
    transport::tcp::mesh_options mesh;
    mesh.rank = rank;
    mesh.size = num_workers;
    mesh.listen_address = group->own_host + ":0";
    mesh.group_id = transport::fnv1a(group->mw_group_key);
    mesh.epoch = 1;
    mesh.secret = secret;
    mesh.connect_timeout = mw.rendezvous_timeout;
    mesh.log = log;
    auto listening = transport::tcp::listen(mesh);
    if (!listening)
      fail(listening.error(), "MultiWorkerMirroredStrategy on " + to_string(me));
    ctx = *listening;
    collective_address = ctx->listen_address();
  }

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
  mopts.address = collective_address;
  for (const auto& name : devices)
    mopts.devices.push_back({name, parse_device(name).kind == device_kind::gpu, 0});
  // The chief makes the NCCL unique id of the first communicator over every worker's GPU
  // replicas, and the view carries it to every worker (docs/gpu.md).
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
  mopts.elastic_min_members = mw.elastic_min_workers;
  mopts.reform_timeout = mw.reform_timeout;
  mopts.log = log;
  auto svc = membership::service::start(std::move(mopts));
  if (!svc)
    fail(svc.error(), "joining the cluster as " + to_string(me));
  group->service = std::move(*svc);

  // The flight recorder exists from here on, so that a loss before the first step is in it too.
  std::vector<std::string> names;
  for (const auto& t : tasks)
    names.push_back(to_string(t));
  auto recorder =
      std::make_shared<detail::flight_recorder>(recorder_entries, rank, std::move(names));
  group->first_recorder = recorder;
  const bool elastic = group->elastic();
  group->service->on_lost([target = group->target, log, recorder, elastic,
                           left_out = group->left_out](const membership::lost_event& event) {
    if (elastic && event.left_out) {
      // The others went on without this worker: its calls fail as at any change of the
      // group, and `reform` joins it again (as a restarted process of its task would).
      const auto cause = event.cause + "; reform() joins the group again";
      log(cause);
      recorder->note(cause);
      left_out->store(true);
      target->end(0, cause, errc::membership_changed);
      return;
    }
    if (elastic && event.next_epoch > 0 && event.at_boundary) {
      auto cause = "the group of workers grows: " + event.cause + "; it re-forms as epoch " +
                   std::to_string(event.next_epoch) + " at the workers' next step boundary";
      log(cause);
      recorder->note(cause);
      target->at_boundary(event.next_epoch, cause);
      return;
    }
    if (elastic && event.next_epoch > 0) {
      auto cause = "the group of workers changed: " + event.cause + "; it re-forms as epoch " +
                   std::to_string(event.next_epoch);
      log(cause);
      recorder->note(cause);
      target->end(event.next_epoch, cause, errc::membership_changed);
      return;
    }
    // A loss, or (elastic, no rank named) the end of the group.
    const auto cause = (event.ranks.empty() ? "" : "lost ") + event.cause;
    log(cause);
    recorder->note(cause);
    recorder->dump_on_failure(cause);
    target->end(0, cause, errc::peer_lost);
  });
  group->target->begin(1);
  if (ctx)
    group->target->add(ctx);
  auto view = group->service->rendezvous();
  if (!view)
    fail(view.error(), "joining the cluster as " + to_string(me));
  if (!elastic && static_cast<int>(view->members.size()) != num_workers)
    throw_error(errc::invalid_argument, "the chief's view has " +
                                            std::to_string(view->members.size()) +
                                            " members; expected " + std::to_string(num_workers));
  group->view.epoch = view->epoch; // the recorder of start-up serves this epoch
  joined->rt = group->form(std::move(*view), std::move(ctx), std::move(reserved));
  if (elastic)
    joined->group = std::move(group);
  return joined;
}
} // namespace

namespace {

/// The cluster of consort::testing's workers: tasks "worker:N" at "sim-worker-N:0".
std::shared_ptr<const cluster_resolver> simulated_resolver(int workers, int task) {
  std::map<int, std::string> addresses;
  for (int w = 0; w < workers; ++w)
    addresses[w] = "sim-worker-" + std::to_string(w) + ":0";
  return std::make_shared<simple_cluster_resolver>(
      cluster_spec{cluster_spec::job_map{{"worker", std::move(addresses)}}}, "worker", task);
}

} // namespace

std::unique_ptr<multi_worker_mirrored_strategy> detail::strategy_access::simulated_worker(
    const strategy_options& opts, int rank, int workers, std::vector<std::string> devices,
    transport::context_ptr network, std::chrono::milliseconds close_timeout) {
  detail::validated(opts);
  devices = detail::canonical_devices(devices);
  auto joined = std::make_unique<detail::joined_cluster>();
  joined->resolver = simulated_resolver(workers, rank);
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

std::unique_ptr<multi_worker_mirrored_strategy> detail::strategy_access::simulated_elastic_worker(
    const strategy_options& opts, int task, int workers, std::vector<std::string> devices,
    int min_workers, simulated_membership membership, const membership::view& first,
    std::chrono::milliseconds close_timeout, std::chrono::milliseconds change_grace,
    std::function<void(const std::string&)> log) {
  detail::validated(opts);
  const auto recorder_entries = detail::flight_recorder::entries_for(opts.flight_recorder_entries);
  (void)detail::flight_recorder::straggler_rule_for(opts.straggler_share, opts.straggler_steps);
  if (min_workers < 1 || min_workers > workers)
    throw_error(errc::invalid_argument, "elastic_min_workers is " + std::to_string(min_workers) +
                                            "; expected 1 to the number of workers (" +
                                            std::to_string(workers) + ")");
  auto joined = std::make_unique<detail::joined_cluster>();
  joined->resolver = simulated_resolver(workers, task);
  auto group = std::make_shared<detail::elastic_group>();
  group->opts = opts;
  group->mw.elastic_min_workers = min_workers;
  group->mw.close_timeout = close_timeout;
  group->mw.peer_timeout = change_grace;
  group->mw.heartbeat_interval = std::chrono::milliseconds{0};
  group->devices = detail::canonical_devices(devices);
  for (int w = 0; w < workers; ++w)
    group->tasks.push_back(task_id{"worker", w});
  group->me = task_id{"worker", task};
  group->log = std::move(log);
  group->recorder_entries = recorder_entries;
  group->sim = std::move(membership);
  joined->rt = group->form(first, nullptr, nullptr);
  joined->group = std::move(group);
  return std::unique_ptr<multi_worker_mirrored_strategy>(
      new multi_worker_mirrored_strategy(std::move(joined)));
}

void detail::strategy_access::membership_event(multi_worker_mirrored_strategy& s, uint64_t next,
                                               const std::string& cause, bool names_a_loss) {
  if (!s.group_)
    throw_error(errc::invalid_argument, "membership_event: the strategy is not elastic");
  auto& g = *s.group_;
  if (next > 0) {
    const auto why =
        "the group of workers changed: " + cause + "; it re-forms as epoch " + std::to_string(next);
    g.log(why);
    g.target->end(next, why, errc::membership_changed);
  } else {
    const auto why = names_a_loss ? "lost " + cause : cause;
    g.log(why);
    g.target->end(0, why, errc::peer_lost);
  }
}

void detail::strategy_access::membership_left_out(multi_worker_mirrored_strategy& s,
                                                  const std::string& cause) {
  if (!s.group_)
    throw_error(errc::invalid_argument, "membership_left_out: the strategy is not elastic");
  auto& g = *s.group_;
  const auto why = cause + "; reform() joins the group again";
  g.log(why);
  g.left_out->store(true);
  g.target->end(0, why, errc::membership_changed);
}

void detail::strategy_access::membership_boundary(multi_worker_mirrored_strategy& s, uint64_t next,
                                                  const std::string& joins) {
  if (!s.group_)
    throw_error(errc::invalid_argument, "membership_boundary: the strategy is not elastic");
  auto& g = *s.group_;
  const auto why = "the group of workers grows: " + joins + "; it re-forms as epoch " +
                   std::to_string(next) + " at the workers' next step boundary";
  g.log(why);
  g.target->at_boundary(next, why);
}

void detail::strategy_access::advance_step_clock(multi_worker_mirrored_strategy& s,
                                                 std::chrono::nanoseconds by) {
  std::unique_lock<std::mutex> guard;
  if (s.group_) // its engine may be swapped meanwhile (reform)
    guard = std::unique_lock<std::mutex>{s.group_->rt_mtx};
  s.runtime().advance_step_clock(by);
}

std::optional<std::pair<uint64_t, std::chrono::nanoseconds>>
detail::strategy_access::oldest_running_step(multi_worker_mirrored_strategy& s) {
  std::unique_lock<std::mutex> guard;
  if (s.group_)
    guard = std::unique_lock<std::mutex>{s.group_->rt_mtx};
  return s.runtime().oldest_running_step();
}

multi_worker_mirrored_strategy::multi_worker_mirrored_strategy(strategy_options opts,
                                                               multi_worker_options mw)
    : multi_worker_mirrored_strategy(join_cluster(opts, std::move(mw))) {}

multi_worker_mirrored_strategy::multi_worker_mirrored_strategy(
    std::unique_ptr<detail::joined_cluster> joined)
    : strategy(std::move(joined->rt), kind::multi_worker), resolver_(std::move(joined->resolver)),
      group_(std::move(joined->group)) {}

uint64_t multi_worker_mirrored_strategy::membership_epoch() const noexcept {
  return runtime().membership_epoch();
}

multi_worker_mirrored_strategy::membership_change multi_worker_mirrored_strategy::reform() {
  if (!group_)
    throw_error(errc::invalid_argument,
                "reform: this group is not elastic (multi_worker_options::elastic_min_workers is "
                "0, or there is one worker); a lost worker ends its run");
  const auto before = group_->view;
  std::unique_ptr<detail::runtime> rt;
  bool rejoined = false;
  if (!group_->left_out->load()) {
    try {
      auto [next, reserved] = group_->next_view(before.epoch);
      rt = group_->form(std::move(next), nullptr, std::move(reserved));
    } catch (const error& e) {
      // Left out while it waited for the next epoch (it offered its part too late): it joins
      // again below. Any other failure is the caller's.
      if (!group_->left_out->load())
        throw;
      group_->log(to_string(group_->me) + ": left out of the next epoch (" + e.what() +
                  "); joining the group again");
    }
  }
  if (!rt && group_->sim.rejoin) {
    // consort::testing: the harness forms the epoch it joins (at the members' next boundary).
    auto v = group_->sim.rejoin();
    group_->target = std::make_shared<loss_target>(); // the ended one aborts every epoch
    group_->left_out->store(false);
    rt = group_->form(std::move(v), nullptr, nullptr);
    rejoined = true;
  }
  if (!rt) {
    // The others went on without this worker: it joins them again as a new member of its task,
    // with a new membership service, as a restarted process would (at their next step boundary).
    multi_worker_options mw = group_->mw;
    mw.resolver = resolver_;
    auto joined = join_cluster(group_->opts, std::move(mw));
    if (!joined->group)
      throw_error(errc::peer_lost, "reform: this worker was left out, and joining again found "
                                   "no elastic group");
    rt = std::move(joined->rt);
    joined->group->joined = group_->joined; // the same process: its state is what it was
    group_ = std::move(joined->group);      // the previous service, and its ended group, go
    rejoined = true;
  }
  membership_change change;
  change.epoch_before = before.epoch;
  change.workers_before = static_cast<int>(before.members.size());
  change.epoch = group_->view.epoch;
  change.workers = static_cast<int>(group_->view.members.size());
  auto has = [](const transport::membership::view& v, const task_id& t) {
    return std::any_of(v.members.begin(), v.members.end(),
                       [&t](const auto& m) { return m.task == t; });
  };
  for (const auto& m : before.members)
    if (!has(group_->view, m.task))
      change.lost.push_back(to_string(m.task));
  for (const auto& m : group_->view.members)
    if (!has(before, m.task) || (rejoined && m.task == group_->me))
      change.joined.push_back(to_string(m.task));
  // The previous epoch's engine goes without leaving the cluster (form retired it).
  replace_runtime(std::move(rt), &group_->rt_mtx);
  return change;
}

void multi_worker_mirrored_strategy::step_boundary() {
  if (!group_)
    return;
  const auto epoch = group_->view.epoch;
  auto cause = group_->target->boundary_after(epoch);
  // Every worker learns of the join at its own moment: one all-reduce makes it the same boundary
  // everywhere (a worker that did not hear of it yet re-forms too, and waits for the notice).
  int32_t any = cause.empty() ? 0 : 1;
  if (num_workers() > 1) {
    auto out = run([mine = any](replica_context& ctx) {
      return ctx.all_reduce("MAX", tensor::scalar<int32_t>(mine));
    });
    any = out.values().front().item<int32_t>();
  }
  if (any == 0)
    return;
  if (cause.empty())
    cause = "the group of workers grows; it re-forms as epoch " + std::to_string(epoch + 1) +
            " at the workers' next step boundary";
  // This epoch's engine has nothing in flight: it ends here, as after a notice.
  group_->target->end(epoch + 1, cause, errc::membership_changed);
  throw_error(errc::membership_changed, cause);
}

bool multi_worker_mirrored_strategy::joined_running_group() const noexcept {
  return group_ && group_->joined;
}

int multi_worker_mirrored_strategy::worker_rank() const noexcept {
  return runtime().worker_rank();
}

int multi_worker_mirrored_strategy::num_workers() const noexcept {
  return runtime().num_workers();
}

} // namespace consort
