#pragma once

// The membership service's implementation (include/consort/transport/membership.hpp): one class,
// `service::impl`, whose member functions are defined by concern:
//
//   service.cpp   the options' checks, start and stop, the calls from callers' threads
//   core.cpp      the I/O thread's common part: deadlines (the tick), frames in and out, failures,
//                 losses reported, leave and crash
//   chief.cpp     rank 0: the server, the Joins, the view, losing a member
//   worker.cpp    every other rank: the connection to the chief, its Join, the view received
//   proofs.hpp    the proofs of the shared secret and their checks (authentication)
//
// and transport/framed_connection.hpp, each connection's socket, write queue, frame reading and
// graceful close. The roles stay member functions of one class rather than classes of their own:
// they share one phase machine per connection, the rendezvous and view state, the tick and the
// leave/crash paths, so that a role class would need an interface as wide as this one.
//
// Threads. One I/O thread per service runs its io_context and owns every socket, timer and the
// membership state. Callers' threads post work to it and wait on `mu_`/`cv_` for outcomes
// (rendezvous, leave, crash), always with a deadline.
//
// Private to transport/membership.

#include "transport/address.hpp"
#include "transport/framed_connection.hpp"
#include "transport/membership/cluster_check.hpp"
#include "transport/membership/codec.hpp"
#include "transport/membership/host_process.hpp"

#include <consort/transport/membership.hpp>

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include <caf/error.hpp>
#include <caf/expected.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace consort::transport::membership {

namespace asio = boost::asio;
using asio_tcp = boost::asio::ip::tcp;
using error_code = boost::system::error_code;
using clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

using transport::endpoint_text;
using transport::framed_connection;
using transport::host_port;
using transport::ms_text;
using transport::reason_of;
using transport::split_address;

static_assert(framed_connection::prefix_bytes == codec::prefix_bytes);

/// Back-off between attempts to reach a chief that is not up yet (worker.cpp).
inline constexpr milliseconds first_backoff{2};
inline constexpr milliseconds max_backoff{200};

/// The service (see the file comment and include/consort/transport/membership.hpp).
///
/// Thread safety: the public functions are thread-safe. Everything Asio and the membership state
/// belong to the I/O thread; `outcome_`, `on_lost_` and the done flags are guarded by `mu_`.
class service::impl : private transport::framed_connection::owner {
public:
  explicit impl(options opts);
  ~impl();

  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;

  caf::error start();
  std::string listen_address() const { return listen_address_; }
  int rank() const noexcept { return opts_.rank; }
  caf::expected<view> rendezvous();
  caf::expected<view> next_view(uint64_t after, const std::string& address,
                                clock::time_point until);
  void on_lost(std::function<void(const lost_event&)> fn);
  void leave(const std::string& reason);
  void suspend() { suspended_.store(true); }
  /// Replaces how a silent peer's process on this host is read (service_test_access).
  void set_host_probe(std::function<host_process(uint32_t)> probe) { probe_ = std::move(probe); }
  void check_deadlines();
  void crash();
  void shutdown();

  /// service::chief_clock_offset.
  clock_offset chief_clock_offset() const;

private:
  // -- I/O thread: what the connections report (framed_connection::owner) ----------------------

  bool stopped() const noexcept override { return stopped_; }
  std::string frame_length(std::span<const std::byte, codec::prefix_bytes> prefix,
                           uint32_t& length) override;
  clock::time_point now() const override { return opts_.clock ? opts_.clock() : clock::now(); }
  void on_frame(const std::shared_ptr<framed_connection>& fc, std::vector<std::byte> body) override;
  void on_read_error(const std::shared_ptr<framed_connection>& fc, const error_code& ec) override;
  void on_failure(const std::shared_ptr<framed_connection>& fc, const std::string& what) override;

  /// Where a connection is in the protocol.
  enum class phase {
    handshake, // chief: accepted, no Join yet; worker: connecting, no Challenge yet
    joined,    // chief: Join accepted; worker: Join sent; no view yet
    member,    // the view was sent (chief) or received (worker)
    left,      // the peer left cleanly, or this side is leaving: nothing is reported
    lost,      // reported lost
  };

  /// A framed connection with the membership protocol's state of it.
  struct connection : transport::framed_connection {
    using framed_connection::framed_connection;
    phase state = phase::handshake;
    int rank = -1;                 // the peer's rank once known
    codec::join join;              // chief: the accepted Join
    int64_t join_received_ns = 0;  // chief: when it received that Join (wall clock)
    std::vector<std::byte> nonce;  // chief: the challenge it sent
    clock::time_point opened_at{}; // accepted, or the attempt started
    clock::time_point last_rx{};   // the last message received
    int64_t peer_sent_ns = 0;      // the last heartbeat from the peer: its sentNs ...
    int64_t peer_received_ns = 0;  // ... and when it arrived, on this process's wall clock
    /// Silent past peer_timeout while its process on this host waits for a CPU: not lost yet
    /// (held_up_by_host). Cleared when a message arrives.
    bool held_up = false;
  };
  using conn_ptr = std::shared_ptr<connection>;

  // -- I/O thread: common ----------------------------------------------------------------------

  conn_ptr new_connection();
  void log_line(const std::string& line) const;
  int64_t wall_ns() const;
  static error_code listen_at(asio_tcp::acceptor& acceptor, const asio_tcp::endpoint& ep,
                              const char*& step);
  /// Records a heartbeat's times for the echo, and (from the chief) one round trip.
  void on_heartbeat(const conn_ptr& c, const codec::heartbeat& h);
  /// One NTP-style round trip with the chief: t1 this worker sent, t2 the chief received, t3 the
  /// chief sent, t4 this worker received (wall clocks, ns); kept among the last 16.
  void record_round_trip(int64_t t1, int64_t t2, int64_t t3, int64_t t4);
  /// The longest reason or cause a Refusal or an Abort carries: it must fit a frame and the
  /// codec's text limit.
  std::size_t text_limit() const;
  std::string name_of(int rank) const;
  void arm_tick();
  void tick();
  void on_message(const conn_ptr& c, codec::message& m);
  void unexpected(const conn_ptr& c, const codec::message& m);
  void send(const conn_ptr& c, const codec::message& m);
  void close(const conn_ptr& c);
  void close_gracefully(const conn_ptr& c);
  void failed(const conn_ptr& c, const std::string& what);
  void report(std::vector<int> ranks, const std::string& cause, uint64_t next_epoch = 0,
              std::vector<int> joining = {}, bool at_boundary = false, bool left_out = false);
  bool elastic() const noexcept { return opts_.elastic_min_members > 0; }
  /// The view `v` is this service's newest (the first one, or an elastic group's next).
  void publish_view(const view& v);
  /// The group ended (elastic): every `next_view` fails with `err` from now on.
  void end_group(caf::error err);
  /// Why `v` cannot be an elastic group's view for this service, or "": its members are tasks of
  /// `options::tasks` in their order, ranked from 0, the chief first, this member among them.
  std::string check_elastic_view(const view& v) const;
  void set_outcome(caf::expected<view> outcome);
  bool decided();
  void start_rendezvous();
  void do_leave(const std::string& reason);
  void do_crash();
  void maybe_leave_done();

  // -- I/O thread: chief -----------------------------------------------------------------------

  void on_chief_message(const conn_ptr& c, codec::message& m);
  void chief_failed(const conn_ptr& c, const std::string& what);
  void accept_next();
  void accept_on(asio_tcp::acceptor& acceptor);
  void on_accepted(const conn_ptr& c);
  void on_join(const conn_ptr& c, codec::join& j);
  /// Why `j` is refused, or ""; `other_cluster` tells a refusal for another cluster.
  std::string check_join(const codec::join& j, const std::vector<std::byte>& nonce, int& rank,
                         bool& other_cluster) const;
  void refuse(const conn_ptr& c, const codec::join& j, const std::string& reason);
  /// `j`, refused for `reason` (another cluster), is a task this chief waits for: the rendezvous
  /// fails at once with `reason`, and the workers that joined are aborted with it.
  void fail_for_other_cluster(const codec::join& j, const std::string& remote,
                              const std::string& reason);
  void maybe_form_view();
  /// Sends `v` to `c`, with the proof of the secret for its connection; it is a member now.
  void send_view(const conn_ptr& c, const view& v, clock::time_point now);
  void rendezvous_timed_out();
  /// Sends Abort with `text` to every worker that joined, and closes and forgets them.
  void abort_joined(const std::string& text);
  void log_missing();
  /// `silent`: lost for its silence, not a broken connection; it is told before it is cut off.
  void lose_member(int rank, const std::string& cause, bool silent = false);
  /// A peer silent for `silence` (at least peer_timeout): true while its process runs on this
  /// host and waits for a CPU, up to held_up_limit() of silence (it is not lost yet; the first
  /// time is logged); false otherwise, with `cause` saying so past the limit.
  bool held_up_by_host(const conn_ptr& c, clock::duration silence, std::string& cause);
  /// The longest silence of a peer held up on this host before it counts as lost.
  clock::duration held_up_limit() const { return 10 * opts_.peer_timeout; }
  /// The process id of the peer on `c`: a Join's, or (a worker's connection to its chief) the
  /// view's rank 0. 0: not known.
  uint32_t peer_pid(const conn_ptr& c) const;
  /// Elastic: the group changes (`lost` gone, `joining` joins): begins the next epoch's
  /// re-formation, or amends the one under way, and announces it to the members.
  /// `maybe_alive`: `lost` went silent (no heartbeat, a stuck write) on a connection that did not
  /// close, so they may only be cut off and go on with another leader: the next epoch then needs
  /// half of the current one's members (`quorum_refusal`).
  void start_reform(const std::vector<int>& lost, int joining, const std::string& cause,
                    bool maybe_alive = false);
  /// Why the next epoch (next_set_) must not form without a quorum of the current one's members,
  /// or "" when it may: when members may be alive behind a partition, the chief's side needs half
  /// of them (ties go to the chief), a successor's more than half, so that two sides never both
  /// go on.
  std::string quorum_refusal() const;
  void on_rejoin(const conn_ptr& c, codec::join& j);
  void maybe_form_next_view();
  void reform_timed_out();
  /// Ends an elastic group: Abort with `text` to everyone, and every `next_view` fails.
  void fail_group(const std::string& text);
  std::vector<int> missing_ranks() const;

  // -- I/O thread: worker ----------------------------------------------------------------------

  void on_worker_message(const conn_ptr& c, codec::message& m);
  void worker_failed(const conn_ptr& c, const std::string& what);
  void join_timed_out();
  /// The chief ended this worker's join before the view (a Refusal, an Abort or a Leave): logs
  /// `text`, closes gracefully and fails the rendezvous with `outcome`.
  void chief_ended_join(const conn_ptr& c, const std::string& text, caf::error outcome);
  void start_attempt();
  void attempt_failed(const conn_ptr& c, const std::string& why);
  void on_view(const conn_ptr& c, codec::view_message& m);
  /// `silent`: lost for its silence; in an elastic group it is told before it is cut off.
  void lose_chief(const std::string& cause, bool silent = false);
  /// Chief of an elastic group: a join waited for a step boundary that not every member reached
  /// within reform_timeout; the plain notice follows.
  void boundary_not_reached();
  /// Chief of an elastic group: a member told it that the group went on without it.
  void deposed(const std::string& cause);
  /// This worker's Join with collective address `address` (and a fresh nonce, its proof).
  codec::join join_for(const std::string& address);
  /// Elastic: the chief was lost. The first member after it in the view succeeds it (promote);
  /// the others reach it at its standby address and offer their parts of the next epoch there.
  void fail_over(const std::string& cause);
  /// Becomes the chief of an elastic group whose chief was lost: accepts on the standby acceptor
  /// and re-forms the group from the members that reach it.
  void promote();
  /// A chief's successor: accepts at the lost chief's address too, when it can bind it (it was on
  /// this host and its port is free); until `former_chief_until_`, tried again at every tick.
  void serve_former_chief_address();
  /// Elastic: sends this member's Join for the announced re-formation when the caller offered
  /// its address for it.
  void maybe_rejoin();
  /// The caller's offer of its address for the epoch after `after` (next_view).
  void offer(uint64_t after, const std::string& address);

  options opts_;
  bool chief_;
  std::string self_;                // "worker:1 (rank 1)", the prefix of log lines
  cluster_check::identity cluster_; // the cluster this process was given, canonical
  std::string listen_address_;      // chief only (a successor: its standby address)
  std::string standby_address_;     // elastic, not the chief: the standby acceptor's address
  std::string first_chief_address_; // options.chief_address as given (fail_over moves the other)
  clock::time_point former_chief_until_{}; // a successor: when to stop trying that address
  host_port chief_hp_;
  milliseconds tick_period_;
  /// When tick() last ran, in real time: a gap of half a peer_timeout means this process was
  /// stopped, and the silence of its peers is not theirs.
  std::chrono::steady_clock::time_point last_tick_real_ = std::chrono::steady_clock::now();
  /// The last round trips to the chief (offset, delay), newest last; guarded by mu_.
  std::deque<std::pair<int64_t, int64_t>> round_trips_;
  uint64_t round_trip_count_ = 0;
  bool reference_clock_ = false; // this process leads (the chief, or its successor); guarded by mu_
  milliseconds linger_;

  // Declared before every Asio object of this class, so that it is destroyed after them.
  asio::io_context io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  asio_tcp::acceptor acceptor_;
  /// Elastic, every member but the chief: listening from the start, accepting only once this
  /// member succeeds a lost chief (promote), so that the others can reach it at once.
  asio_tcp::acceptor standby_;
  /// A chief's successor: the lost chief's own address too, when it was on this host.
  asio_tcp::acceptor former_chief_;
  asio::steady_timer tick_timer_;
  asio::steady_timer retry_timer_;
  asio_tcp::resolver resolver_;
  std::thread thread_;

  // I/O thread only
  std::set<conn_ptr> conns_;      // every open connection
  std::size_t handshakes_ = 0;    // chief: accepted connections without a Join yet
  std::vector<conn_ptr> by_rank_; // chief: the joined connection of each rank
  conn_ptr chief_conn_;           // worker: the current connection to the chief
  bool rendezvous_started_ = false;
  clock::time_point rendezvous_deadline_{};
  clock::time_point next_missing_log_{};
  bool view_formed_ = false;
  bool rendezvous_failed_ = false;
  std::string failure_; // chief: why the rendezvous failed
  view view_;
  clock::time_point next_heartbeat_{};
  uint64_t heartbeat_sequence_ = 0;
  std::vector<bool> reported_; // by rank: reported lost
  bool leaving_ = false;
  bool crashed_ = false;
  std::string last_error_; // worker: why the last attempt to reach the chief failed
  bool warned_ = false;    // worker: a failed attempt was logged
  milliseconds backoff_{first_backoff};
  std::vector<std::byte> my_nonce_;    // worker: the nonce of its Join
  std::vector<std::byte> chief_nonce_; // worker: the nonce of the chief's Challenge

  // Elastic (I/O thread only).
  std::set<int> in_view_;           // chief: the tasks of view_
  bool reforming_ = false;          // chief: a change is under way
  bool at_boundary_ = false;        // chief: ... which the members begin at a step boundary
  std::string reform_cause_;        // chief: ... and why
  uint64_t next_epoch_ = 0;         // chief: the epoch it forms
  std::set<int> next_set_;          // chief: the tasks of that epoch
  std::set<int> rejoined_;          // chief: members of next_set_ whose Join for it arrived
  std::set<int> notified_;          // chief: members told of the change under way
  std::set<int> deferred_joins_;    // chief: tasks that joined during it, for the next one
  bool reform_maybe_split_ = false; // chief: a member of it was lost without a closed connection
  bool succeeding_ = false;         // chief: a successor leading the re-formation after the chief
  bool chief_maybe_alive_ = false;  // worker: the chief was lost without a closed connection
  clock::time_point reform_deadline_{};
  bool group_ended_ = false;
  uint64_t notice_epoch_ = 0; // worker: the newest change announced
  uint64_t rejoined_for_ = 0; // worker: the change its last Join answered
  bool has_offer_ = false;    // the caller's offer: valid while offer_after_ == view_.epoch
  uint64_t offer_after_ = 0;
  std::string offer_address_;
  bool failing_over_ = false; // worker: reaching the chief's successor
  bool join_pending_ =
      false; // worker: the successor's Challenge came; the Join waits for the offer

  std::atomic<bool> suspended_{false};
  /// A peer in this very process (tests) never waits for a CPU while this thread runs.
  std::function<host_process(uint32_t)> probe_ = [](uint32_t pid) {
    return pid == static_cast<uint32_t>(::getpid()) ? host_process::asleep
                                                    : probe_host_process(pid);
  };
  std::atomic<bool> stopped_{false};
  std::atomic<bool> leave_called_{false};
  std::atomic<bool> crash_called_{false};

  mutable std::mutex mu_;
  std::condition_variable cv_;                     // guarded by mu_
  bool rendezvous_requested_ = false;              // guarded by mu_
  std::optional<caf::expected<view>> outcome_;     // guarded by mu_
  std::optional<view> latest_;                     // guarded by mu_: the newest view
  caf::error group_error_;                         // guarded by mu_: why the group ended
  std::function<void(const lost_event&)> on_lost_; // guarded by mu_
  bool leave_done_ = false;                        // guarded by mu_
  bool crash_done_ = false;                        // guarded by mu_
};

} // namespace consort::transport::membership
