#pragma once

// Cluster membership (docs/multi_worker.md): the workers of a multi-worker job meet at the chief,
// agree on one view of the group (ranks, collective addresses, devices, group id, NCCL id), then
// watch each other with heartbeats until they leave. Boost.Asio and Cap'n Proto stay out of this
// header (transport/membership).
//
// Topology: a star. The chief (rank 0) runs a server; every other worker has exactly one TCP
// connection, to the chief. Messages are schemas/membership.capnp `MembershipMessage`s, framed as
// a u32 little-endian length and a Cap'n Proto flat array, every size bounded before allocation.
//
// Start-up, on every worker (the chief binds, the others connect):
//
//   membership::options opts;
//   opts.tasks = {{"worker", 0}, {"worker", 1}};   // rank order; rank 0 is the chief
//   opts.rank = 1;
//   opts.chief_address = "10.0.0.1:7070";
//   opts.address = "10.0.0.2:7000";                 // this worker's collective (mesh) address
//   opts.devices = {{"CPU:0"}};
//   opts.secret = shared_secret;                    // optional
//   auto svc = membership::service::start(opts);    // caf::expected<std::unique_ptr<service>>
//   (*svc)->on_lost([](const membership::lost_event& e) { /* abort the collectives */ });
//   auto v = (*svc)->rendezvous();                  // caf::expected<membership::view>
//
// The protocol, per connection (chief's view):
//
//   accepted --Challenge-->  joining  <--Join--  (checked: version, proof, cluster digest, task,
//   duplicate, device count; a failed check answers Refusal and closes)  joined
//   --View (all joined)-->  member <-Heartbeat-> ... until Leave (left: never reported lost) or
//   loss (EOF, error, silence, stuck write: reported through on_lost, and Abort to every other
//   member).

#include <consort/clock_offset.hpp>
#include <consort/cluster.hpp>

#include <caf/expected.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace consort::transport::membership {

/// One device of a worker, as announced in its Join.
struct device_info {
  /// The device's name as consort spells it: "CPU:0", "GPU:1".
  std::string name;

  /// True for an accelerator.
  bool gpu = false;

  /// The device's memory; 0 when unknown.
  uint64_t memory_bytes = 0;

  /// Equal when every field is.
  friend bool operator==(const device_info&, const device_info&) = default;
};

/// One member of a view.
struct member {
  /// The member's rank: its position in `options::tasks` (the chief is 0).
  int rank = 0;

  /// The member's task.
  consort::task_id task;

  /// "host:port" of the member's collective traffic (`options::address` of that worker).
  std::string address;

  /// The member's devices, in local replica order.
  std::vector<device_info> devices;

  /// Elastic groups: "host:port" where the member leads the group if it succeeds a lost chief
  /// (the first member after the chief does); empty otherwise.
  std::string standby_address;

  /// The member's process id (its Join's; the chief's own), for logs and for telling, on one
  /// host, a silent member that waits for a CPU from one that is stopped or hung (`peer_timeout`).
  /// 0: not known.
  uint32_t pid = 0;

  /// Equal when every field is.
  friend bool operator==(const member&, const member&) = default;
};

/// The group as the chief formed it; identical on every member.
struct view {
  /// The membership epoch: 1 for the first view.
  uint64_t epoch = 0;

  /// A random non-zero identifier of this group, for transport handshakes
  /// (`tcp::mesh_options::group_id`).
  uint64_t group_id = 0;

  /// Every member, in rank order (`members[i].rank == i`).
  std::vector<member> members;

  /// The chief's `options::nccl_unique_id`, opaque.
  std::vector<std::byte> nccl_unique_id;

  /// Equal when every field is.
  friend bool operator==(const view&, const view&) = default;
};

/// Members lost after the view was formed, or (elastic) a change of the group beginning.
struct lost_event {
  /// The ranks lost (each rank appears in at most one event of an epoch). Ranks are positions in
  /// `options::tasks`, also in an elastic group's later epochs.
  std::vector<int> ranks;

  /// Why, for people; names the task and rank, e.g. "worker:2 (rank 2): connection closed
  /// without leave (end of file)" or "worker:2 (rank 2) sent no heartbeat for 800 ms".
  std::string cause;

  /// Elastic only: the epoch of the re-formation this change begins (`service::next_view`), and
  /// (at the chief; the others learn it from the view) the tasks, as positions in
  /// `options::tasks`, that join in it. 0: the group ends; every later `next_view` fails.
  uint64_t next_epoch = 0;
  std::vector<int> joining;

  /// Elastic, a join and nothing lost: the members may finish their step and re-form at their
  /// next step boundary rather than abort the calls of this epoch. An event of the same epoch
  /// without it follows when they must abort after all (a loss meanwhile, or no re-formation
  /// begun within `reform_timeout`).
  bool at_boundary = false;

  /// Elastic: the chief left this worker out of the group (it was silent past `peer_timeout`, or
  /// did not offer its part in time) and the others went on without it. The group has ended for
  /// this service; the process may join the group again as a new member of its task, with a new
  /// service.
  bool left_out = false;
};

/// How a membership service joins its cluster and watches its peers.
struct options {
  /// Every worker task, in rank order (rank 0 is the chief); the number of workers. Tasks must be
  /// distinct, with a non-empty type and a non-negative index.
  std::vector<consort::task_id> tasks;

  /// This process's rank, in [0, tasks.size()). Rank 0 runs the server.
  int rank = 0;

  /// The cluster this process was given (TF_CONFIG or its cluster resolver), for the check that
  /// every task was given the same one. A worker's Join carries a digest of it (every task of
  /// every job but "evaluator", which TF lets stand apart, with its address, in sorted order) and
  /// its list; the chief refuses a Join whose digest differs from its own, naming both lists, and
  /// when the worker refused so is one the chief waits for, its rendezvous fails at once too
  /// (`invalid_argument`), aborting the workers that joined. Empty: the digest covers `tasks`
  /// alone, without addresses. When set, it must list every task of `tasks`.
  consort::cluster_spec cluster;

  /// "host:port" (IPv4, IPv6 in brackets, or a host name) of the chief's membership server. The
  /// chief binds it (port 0 lets the kernel choose: see `service::listen_address`); the others
  /// connect to it.
  std::string chief_address;

  /// "host:port" of this worker's collective traffic, announced in its Join. Required when there
  /// is more than one worker.
  std::string address;

  /// This worker's devices. Every worker must have as many as the chief.
  std::vector<device_info> devices;

  /// The cluster's shared secret; empty: no authentication. When set, a worker proves it with an
  /// HMAC-SHA256 over the chief's challenge and its own nonce, and the chief proves it back in the
  /// view over both nonces, the epoch and the group id; a worker that cannot prove it is refused,
  /// and a view without a valid proof is rejected. Both sides must agree on having a secret.
  std::string secret;

  /// Chief: every task must have joined within this, counted from `rendezvous()`. Worker: the
  /// time to reach the chief (refused connections are retried) and receive the view.
  std::chrono::milliseconds rendezvous_timeout{60000};

  /// The chief logs the tasks that have not joined yet at this interval while it waits.
  std::chrono::milliseconds missing_log_interval{5000};

  /// An accepted connection must present a valid Join within this (and a worker's connection
  /// attempt must reach the chief and get its challenge within this), or it is closed.
  std::chrono::milliseconds handshake_timeout{5000};

  /// How often members send heartbeats (workers to the chief, the chief to every worker).
  std::chrono::milliseconds heartbeat_interval{100};

  /// A peer from which nothing arrived for this long, or a write to it that did not complete
  /// within this, is lost. A silent peer on this host (connected over loopback or this host's
  /// address) whose process is runnable, waiting for a CPU (read in /proc, by the pid of its Join
  /// or, for the chief, of the view), is lost only after ten times this of silence, or once its
  /// process is seen stopped, gone or asleep.
  std::chrono::milliseconds peer_timeout{800};

  /// The largest membership frame (length prefix excluded), sent or received; a frame announcing
  /// more is malformed. At least 1024.
  std::size_t max_message_bytes = std::size_t{1} << 20;

  /// Chief only: copied into the view, e.g. the NCCL unique id of the group (at most 4096 bytes).
  std::vector<std::byte> nccl_unique_id;

  /// The clock the service's deadlines run on: handshakes, the rendezvous, heartbeats, peer
  /// timeouts, stuck writes and the linger of a leave. Empty: `std::chrono::steady_clock::now`.
  /// A test may pass a clock it moves itself and run the deadline checks after each move
  /// (`service_test_access::check_deadlines`, a private header of the library); retries of refused
  /// connections and the service's own checks (at most 50 ms apart) still pace on real time, and
  /// the bounds of the callers' waits (the rendezvous' deadline plus 2 s, a leave's, a crash's) are
  /// real time too.
  std::function<std::chrono::steady_clock::time_point()> clock;

  /// The wall clock that `service::chief_clock_offset` compares (ns since the Unix epoch). Empty:
  /// the system clock. A test may shift it, as another host's clock would be.
  std::function<int64_t()> wall_clock;

  /// Elastic membership (docs/multi_worker.md, "Elastic"). 0, the default: a member lost after
  /// the view ends the group, on every member (`on_lost`). n >= 1: the chief re-forms the group
  /// without the lost member while at least n members remain, and admits a task that joins
  /// again after the view (a restarted worker, under its own task); each change is a new epoch
  /// (`service::next_view`); a join alone waits for the members' next step boundary
  /// (`lost_event::at_boundary`). Every member must be given the same n. The chief leads every
  /// re-formation; when it is lost, the first member after it in the view succeeds it, and losing
  /// both ends the group.
  int elastic_min_members = 0;

  /// Elastic: how long the chief waits, once a change began, for every member to offer its part
  /// of the next epoch (`next_view`); a member that did not is left out of it as lost.
  std::chrono::milliseconds reform_timeout{10000};

  /// Receives one line per notable event (a refused or broken connection and why, missing tasks,
  /// losses). Called on the service's I/O thread. Empty: stderr, prefixed "consort membership: ".
  std::function<void(const std::string&)> log;
};

/// One process's membership of its cluster (see the file comment).
///
/// Errors name the peer, the operation and the reason: `invalid_argument` (bad options, a refusal
/// by the chief, a malformed view, a worker refused for another cluster: `options::cluster`),
/// `collective_timeout` (the rendezvous did not complete in time; the message names the missing
/// tasks), `peer_lost` (the chief went away or left before the view), `shutdown` (this service left
/// or crashed before the view).
///
/// Thread safety: thread-safe, except that the destructor must not run concurrently with another
/// call. Callbacks (`on_lost`, `options::log`) run on the service's I/O thread.
using consort::clock_offset;

class service {
public:
  class impl;

  // -- constructors, destructors, and assignment operators --------------------------------------

  /// Validates `opts` (clear `invalid_argument` errors: empty or duplicate tasks, rank out of
  /// range, a malformed address, non-positive timeouts); the chief binds `chief_address` and
  /// starts accepting at once, a worker does nothing on the network yet. Runs its own I/O thread.
  static caf::expected<std::unique_ptr<service>> start(options opts);

  /// Takes over a started implementation; use `start`.
  explicit service(std::shared_ptr<impl> ptr);

  /// Leaves with reason "shutdown" unless this service left or crashed already, then stops its
  /// I/O thread. Bounded: it waits at most about min(peer_timeout, 2 s) for peers to take the
  /// Leave, even when they are dead.
  ~service();

  service(const service&) = delete;
  service& operator=(const service&) = delete;

  // -- properties --------------------------------------------------------------------------------

  /// Chief: the "host:port" actually bound, with the port the kernel chose. Worker: empty.
  std::string listen_address() const;

  /// This process's rank.
  int rank() const noexcept;

  // -- membership --------------------------------------------------------------------------------

  /// Blocks until the view is known or the rendezvous fails; a later call returns the same
  /// outcome. Chief: waits until every task of `options::tasks` has joined, then sends the view
  /// (epoch 1, a random group id, the members in rank order with their addresses and devices, the
  /// NCCL id) to all and returns it; past `rendezvous_timeout` it fails with
  /// `collective_timeout` naming the missing tasks, and aborts the rendezvous of the workers that
  /// joined with the same message. Worker: connects to the chief (retrying refused connections
  /// until the deadline), joins, and waits for the view. Errors: see the class comment.
  caf::expected<view> rendezvous();

  /// Sets the function called on the I/O thread for each loss after the view. It must not block
  /// (it may call `leave` or `crash`, which then return without waiting) and must not destroy
  /// the service. Set it before `rendezvous`.
  void on_lost(std::function<void(const lost_event&)> fn);

  /// Elastic only: this member's part of the group's next epoch, and the wait for it. `address`
  /// is where this worker will listen for the next epoch's collective traffic ("host:port").
  /// Once the chief announced a change of the group after epoch `after` (the epoch the caller
  /// runs in; an `on_lost` event with `next_epoch` > `after`), this member offers the address,
  /// and the call returns the first view of an epoch later than `after`, once the chief formed
  /// it from the members that offered theirs (at most `reform_timeout` after the change began).
  /// The caller may call it before the change is announced (its own collective failed first).
  /// Errors: `invalid_argument` (not elastic, a malformed address), `peer_lost` (the group
  /// ended: fewer members than `elastic_min_members` remain, or the chief was lost),
  /// `collective_timeout` (no later view by `until`), `shutdown` (this service left).
  caf::expected<view> next_view(uint64_t after, const std::string& address,
                                std::chrono::steady_clock::time_point until);

  /// The chief's wall clock against this process's, refreshed by every heartbeat from the chief
  /// (`heartbeat_interval`): for timelines of the whole group on the chief's clock.
  clock_offset chief_clock_offset() const;

  /// Leaves the cluster cleanly: sends Leave to the peers and closes; the peers do not report
  /// this member lost. Waits (bounded as the destructor) until the peers closed their side.
  /// A pending `rendezvous` fails with `shutdown`. Idempotent.
  void leave(const std::string& reason);

private:
  /// Faults and clock steps for tests (transport/membership/test_access.hpp, not installed).
  friend class service_test_access;

  std::shared_ptr<impl> impl_;
};

} // namespace consort::transport::membership
