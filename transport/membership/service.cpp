// The membership service (see include/consort/transport/membership.hpp): the chief's server, the
// workers' connection to it, the view, heartbeats and loss detection.
//
// Threads. One I/O thread per service runs its io_context and owns every socket, timer and the
// membership state. Callers' threads post work to it and wait on `mu_`/`cv_` for outcomes
// (rendezvous, leave, crash), always with a deadline.
//
// Connections. The chief accepts; on every accepted connection it first sends a Challenge (a
// fresh nonce, with or without a shared secret, so that there is one flow), then reads frames.
// The first must be a valid Join within `handshake_timeout`; the chief checks it and either
// refuses it (Refusal with the reason, then a graceful close) or records the worker as joined.
// When every task has joined and `rendezvous()` was called, the chief sends each worker the view
// (with its proof of the secret for that worker's connection). A worker connects to the chief
// (retrying refused, reset or timed-out attempts with back-off until its rendezvous deadline),
// answers the Challenge with its Join and waits for the View, a Refusal or an Abort.
//
// Authentication (with a shared secret): the proofs and their checks are in proofs.hpp.
//
// Deadlines. One periodic tick (at most 50 ms apart) enforces all of them: handshakes, connection
// attempts, the rendezvous, heartbeats sent and expected, writes that do not complete, and the
// linger of graceful closes. Nothing else waits.
//
// Closing. A clean close (Leave, Refusal, Abort before the view) queues its last message, then
// shuts down the sending side once the queue is written and keeps reading (dropping what arrives)
// until the peer closes too or the linger passes: the last message is never lost to a reset.

#include "transport/address.hpp"
#include "transport/auth.hpp"
#include "transport/framed_connection.hpp"
#include "transport/membership/codec.hpp"
#include "transport/membership/proofs.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/transport/membership.hpp>

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/connect.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <caf/error.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <unistd.h>

namespace consort::transport::membership {

namespace {

namespace asio = boost::asio;
using asio_tcp = boost::asio::ip::tcp;
using error_code = boost::system::error_code;
using clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

/// How many accepted connections may be in their handshake at once; more are closed at once.
constexpr std::size_t max_pending_handshakes = 64;

/// Back-off between attempts to reach a chief that is not up yet.
constexpr milliseconds first_backoff{2};
constexpr milliseconds max_backoff{200};

/// The longest period of the tick that enforces every deadline.
constexpr milliseconds max_tick{50};

using auth::nonce_bytes;
using auth::random_bytes;

/// The longest a graceful close (leave, refusal) waits for the peer to close its side.
constexpr milliseconds max_linger{2000};

static_assert(framed_connection::prefix_bytes == codec::prefix_bytes);

using transport::endpoint_text;
using transport::framed_connection;
using transport::host_port;
using transport::ms_text;
using transport::reason_of;
using transport::split_address;

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names)
    out += (out.empty() ? "" : ", ") + name;
  return out.empty() ? std::string{"none"} : out;
}

/// Why `opts` cannot start a service, or "".
std::string check_options(const options& opts) {
  if (opts.tasks.empty())
    return "options.tasks is empty (expected every worker task, in rank order)";
  for (std::size_t i = 0; i < opts.tasks.size(); ++i) {
    const auto& t = opts.tasks[i];
    if (t.type.empty() || t.index < 0)
      return "options.tasks[" + std::to_string(i) + "] is \"" + to_string(t) +
             "\" (expected a non-empty type and a non-negative index)";
    if (t.type.size() > codec::max_field_bytes)
      return "options.tasks[" + std::to_string(i) + "] has a type longer than " +
             std::to_string(codec::max_field_bytes) + " bytes";
    for (std::size_t j = 0; j < i; ++j)
      if (opts.tasks[j] == t)
        return "options.tasks lists " + to_string(t) + " twice (at ranks " + std::to_string(j) +
               " and " + std::to_string(i) + ")";
  }
  if (opts.tasks.size() > codec::max_members)
    return "options.tasks has " + std::to_string(opts.tasks.size()) + " tasks, over the limit of " +
           std::to_string(codec::max_members);
  if (opts.rank < 0 || static_cast<std::size_t>(opts.rank) >= opts.tasks.size())
    return "options.rank " + std::to_string(opts.rank) + " is outside [0, " +
           std::to_string(opts.tasks.size()) + ")";
  host_port hp;
  if (auto why = split_address(opts.chief_address, hp); !why.empty())
    return "options.chief_address: " + why;
  if (opts.rank != 0 && hp.port == "0")
    return "options.chief_address \"" + opts.chief_address +
           "\" has port 0: a worker needs the port the chief listens on";
  if (!opts.address.empty()) {
    if (auto why = split_address(opts.address, hp); !why.empty())
      return "options.address (this worker's collective address): " + why;
  } else if (opts.tasks.size() > 1) {
    return "options.address is empty (expected this worker's collective \"host:port\")";
  }
  if (opts.address.size() > codec::max_field_bytes)
    return "options.address is longer than " + std::to_string(codec::max_field_bytes) + " bytes";
  if (opts.devices.size() > codec::max_devices)
    return "options.devices has " + std::to_string(opts.devices.size()) +
           " devices, over the limit of " + std::to_string(codec::max_devices);
  for (const auto& d : opts.devices)
    if (d.name.size() > codec::max_field_bytes)
      return "options.devices has a name longer than " + std::to_string(codec::max_field_bytes) +
             " bytes";
  if (opts.nccl_unique_id.size() > codec::max_field_bytes)
    return "options.nccl_unique_id is " + std::to_string(opts.nccl_unique_id.size()) +
           " bytes, over the limit of " + std::to_string(codec::max_field_bytes);
  struct named {
    const char* name;
    milliseconds value;
  };
  for (auto [name, value] : {named{"rendezvous_timeout", opts.rendezvous_timeout},
                             named{"missing_log_interval", opts.missing_log_interval},
                             named{"handshake_timeout", opts.handshake_timeout},
                             named{"heartbeat_interval", opts.heartbeat_interval},
                             named{"peer_timeout", opts.peer_timeout}})
    if (value.count() <= 0)
      return std::string("options.") + name + " is " + ms_text(value) + " (expected > 0)";
  if (opts.max_message_bytes < 1024 || opts.max_message_bytes > (std::size_t{1} << 31))
    return "options.max_message_bytes is " + std::to_string(opts.max_message_bytes) +
           " (expected 1024 to 2^31)";
  return {};
}

} // namespace

// -- the implementation --------------------------------------------------------------------------

/// The service (see the file comment).
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
  void on_lost(std::function<void(const lost_event&)> fn);
  void leave(const std::string& reason);
  void suspend() { suspended_.store(true); }
  void crash();
  void shutdown();

private:
  // -- I/O thread: what the connections report (framed_connection::owner) ----------------------

  bool stopped() const noexcept override { return stopped_; }
  std::string frame_length(std::span<const std::byte, codec::prefix_bytes> prefix,
                           uint32_t& length) override;
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
    std::vector<std::byte> nonce;  // chief: the challenge it sent
    clock::time_point opened_at{}; // accepted, or the attempt started
    clock::time_point last_rx{};   // the last message received
  };
  using conn_ptr = std::shared_ptr<connection>;

  // -- I/O thread: common ----------------------------------------------------------------------

  conn_ptr new_connection();
  void log_line(const std::string& line) const;
  std::string name_of(int rank) const;
  void arm_tick();
  void tick();
  void on_message(const conn_ptr& c, codec::message& m);
  void send(const conn_ptr& c, const codec::message& m);
  void close(const conn_ptr& c);
  void close_gracefully(const conn_ptr& c);
  void failed(const conn_ptr& c, const std::string& what);
  void report(std::vector<int> ranks, const std::string& cause);
  void set_outcome(caf::expected<view> outcome);
  bool decided();
  void start_rendezvous();
  void do_leave(const std::string& reason);
  void do_crash();
  void maybe_leave_done();

  // -- I/O thread: chief -----------------------------------------------------------------------

  void accept_next();
  void on_accepted(const conn_ptr& c);
  void on_join(const conn_ptr& c, codec::join& j);
  std::string check_join(const codec::join& j, const std::vector<std::byte>& nonce,
                         int& rank) const;
  void refuse(const conn_ptr& c, const codec::join& j, const std::string& reason);
  void maybe_form_view();
  void rendezvous_timed_out();
  void log_missing();
  void lose_member(int rank, const std::string& cause);
  std::vector<int> missing_ranks() const;

  // -- I/O thread: worker ----------------------------------------------------------------------

  void start_attempt();
  void attempt_failed(const conn_ptr& c, const std::string& why);
  void on_view(const conn_ptr& c, codec::view_message& m);
  void lose_chief(const std::string& cause);

  options opts_;
  bool chief_;
  std::string self_;           // "worker:1 (rank 1)", the prefix of log lines
  std::string listen_address_; // chief only
  host_port chief_hp_;
  milliseconds tick_period_;
  milliseconds linger_;

  // Declared before every Asio object of this class, so that it is destroyed after them.
  asio::io_context io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  asio_tcp::acceptor acceptor_;
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

  std::atomic<bool> suspended_{false};
  std::atomic<bool> stopped_{false};
  std::atomic<bool> leave_called_{false};
  std::atomic<bool> crash_called_{false};

  mutable std::mutex mu_;
  std::condition_variable cv_;                     // guarded by mu_
  bool rendezvous_requested_ = false;              // guarded by mu_
  std::optional<caf::expected<view>> outcome_;     // guarded by mu_
  std::function<void(const lost_event&)> on_lost_; // guarded by mu_
  bool leave_done_ = false;                        // guarded by mu_
  bool crash_done_ = false;                        // guarded by mu_
};

// -- construction and destruction ----------------------------------------------------------------

service::impl::impl(options opts)
    : opts_(std::move(opts)), chief_(opts_.rank == 0), acceptor_(io_), tick_timer_(io_),
      retry_timer_(io_), resolver_(io_) {
  self_ = to_string(opts_.tasks[opts_.rank]) + " (rank " + std::to_string(opts_.rank) + ")";
  split_address(opts_.chief_address, chief_hp_); // checked by check_options
  tick_period_ =
      std::max(milliseconds{1}, std::min({opts_.heartbeat_interval, opts_.peer_timeout / 4,
                                          opts_.handshake_timeout / 4, max_tick}));
  linger_ = std::min(opts_.peer_timeout, max_linger);
  by_rank_.resize(opts_.tasks.size());
  reported_.assign(opts_.tasks.size(), false);
}

service::impl::~impl() {
  shutdown();
}

void service::impl::shutdown() {
  if (thread_.joinable() && std::this_thread::get_id() == thread_.get_id()) {
    // Joining the I/O thread from itself would never return (see service::on_lost).
    std::fprintf(stderr,
                 "consort membership: %s: the service was destroyed from one of its own "
                 "callbacks\n",
                 self_.c_str());
    std::abort();
  }
  if (stopped_.exchange(true))
    return;
  io_.stop();
  if (thread_.joinable())
    thread_.join();
  // The I/O thread is gone: close every Asio object here, before io_ goes.
  error_code ignored;
  acceptor_.close(ignored);
  for (const auto& c : conns_)
    c->close();
  conns_.clear();
  by_rank_.clear();
  chief_conn_.reset();
  tick_timer_.cancel();
  retry_timer_.cancel();
  resolver_.cancel();
  work_.reset();
  std::lock_guard lock(mu_);
  if (!outcome_)
    outcome_ = make_caf_error(errc::shutdown, self_ + ": the membership service was destroyed");
  cv_.notify_all();
}

caf::error service::impl::start() {
  if (chief_) {
    auto fail = [&](const std::string& what, const error_code& ec) {
      return make_caf_error(errc::invalid_argument, self_ + " cannot serve membership on " +
                                                        opts_.chief_address + ": " + what + ": " +
                                                        ec.message());
    };
    error_code ec;
    asio_tcp::resolver resolver(io_);
    auto results =
        resolver.resolve(chief_hp_.host, chief_hp_.port,
                         asio_tcp::resolver::passive | asio_tcp::resolver::numeric_service, ec);
    if (ec)
      return fail("resolve", ec);
    if (results.empty())
      return make_caf_error(errc::invalid_argument, self_ + " cannot serve membership on " +
                                                        opts_.chief_address +
                                                        ": the host has no address");
    auto ep = results.begin()->endpoint();
    if (acceptor_.open(ep.protocol(), ec); ec)
      return fail("socket", ec);
    if (acceptor_.set_option(asio_tcp::acceptor::reuse_address(true), ec); ec)
      return fail("setsockopt(SO_REUSEADDR)", ec);
    if (acceptor_.bind(ep, ec); ec)
      return fail("bind", ec);
    if (acceptor_.listen(asio::socket_base::max_listen_connections, ec); ec)
      return fail("listen", ec);
    auto local = acceptor_.local_endpoint(ec);
    if (ec)
      return fail("getsockname", ec);
    listen_address_ = endpoint_text(local);
  }
  work_.emplace(io_.get_executor());
  asio::post(io_, [this] {
    if (chief_)
      accept_next();
    arm_tick();
  });
  thread_ = std::thread([this] {
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {
        log_line(std::string("an I/O handler threw: ") + e.what());
      }
    }
  });
  return {};
}

// -- public operations (callers' threads) --------------------------------------------------------

caf::expected<view> service::impl::rendezvous() {
  std::unique_lock lock(mu_);
  if (!rendezvous_requested_ && !outcome_) {
    rendezvous_requested_ = true;
    asio::post(io_, [this] { start_rendezvous(); });
  }
  // The I/O thread decides at the deadline; the margin only guards against it being stuck.
  auto until = clock::now() + opts_.rendezvous_timeout + milliseconds{2000};
  if (!cv_.wait_until(lock, until, [this] { return outcome_.has_value(); }))
    outcome_ = make_caf_error(errc::collective_timeout,
                              self_ +
                                  ": the membership I/O thread did not finish the rendezvous "
                                  "within " +
                                  ms_text(opts_.rendezvous_timeout) + " (plus 2000 ms)");
  return *outcome_;
}

void service::impl::on_lost(std::function<void(const lost_event&)> fn) {
  std::lock_guard lock(mu_);
  on_lost_ = std::move(fn);
}

void service::impl::leave(const std::string& reason) {
  if (crash_called_ || leave_called_.exchange(true) || stopped_)
    return;
  asio::post(io_, [this, reason] { do_leave(reason); });
  if (std::this_thread::get_id() == thread_.get_id())
    return; // from a callback: the I/O thread finishes the leave after it returns
  std::unique_lock lock(mu_);
  cv_.wait_until(lock, clock::now() + linger_ + milliseconds{500}, [this] { return leave_done_; });
}

void service::impl::crash() {
  if (crash_called_.exchange(true) || stopped_)
    return;
  asio::post(io_, [this] { do_crash(); });
  if (std::this_thread::get_id() == thread_.get_id())
    return;
  std::unique_lock lock(mu_);
  cv_.wait_until(lock, clock::now() + milliseconds{2000}, [this] { return crash_done_; });
}

// -- I/O thread: common --------------------------------------------------------------------------

service::impl::conn_ptr service::impl::new_connection() {
  // The cast here, where the private base is accessible, and not inside make_shared.
  return std::make_shared<connection>(io_, static_cast<framed_connection::owner&>(*this));
}

void service::impl::log_line(const std::string& line) const {
  auto text = self_ + ": " + line;
  if (opts_.log) {
    opts_.log(text);
    return;
  }
  text = "consort membership: " + text + "\n";
  std::fwrite(text.data(), 1, text.size(), stderr); // one write: lines of threads do not mix
}

std::string service::impl::name_of(int rank) const {
  return to_string(opts_.tasks[rank]) + " (rank " + std::to_string(rank) + ")";
}

void service::impl::set_outcome(caf::expected<view> outcome) {
  {
    std::lock_guard lock(mu_);
    if (outcome_)
      return;
    outcome_ = std::move(outcome);
  }
  cv_.notify_all();
}

bool service::impl::decided() {
  std::lock_guard lock(mu_);
  return outcome_.has_value();
}

void service::impl::report(std::vector<int> ranks, const std::string& cause) {
  if (suspended_ || crashed_ || leaving_ || stopped_)
    return;
  auto had_ranks = !ranks.empty();
  std::erase_if(ranks, [this](int r) {
    if (r < 0 || static_cast<std::size_t>(r) >= reported_.size() || reported_[r])
      return true;
    reported_[r] = true;
    return false;
  });
  if (had_ranks && ranks.empty())
    return; // every rank of it was reported already
  std::function<void(const lost_event&)> fn;
  {
    std::lock_guard lock(mu_);
    fn = on_lost_;
  }
  if (fn)
    fn(lost_event{std::move(ranks), cause});
}

void service::impl::arm_tick() {
  tick_timer_.expires_after(tick_period_);
  tick_timer_.async_wait([this](const error_code& ec) {
    if (ec || stopped_ || crashed_)
      return;
    tick();
    arm_tick();
  });
}

void service::impl::tick() {
  auto now = clock::now();
  // Graceful closes whose peer did not close in time.
  std::vector<conn_ptr> expired;
  for (const auto& c : conns_)
    if (c->linger_expired(now))
      expired.push_back(c);
  for (const auto& c : expired)
    close(c);
  if (suspended_ || leaving_)
    return;
  // Handshakes and connection attempts.
  std::vector<conn_ptr> stale;
  for (const auto& c : conns_)
    if (c->state == phase::handshake && now - c->opened_at >= opts_.handshake_timeout)
      stale.push_back(c);
  for (const auto& c : stale) {
    if (chief_) {
      log_line("closed the connection from " + c->remote() + ": no valid Join within " +
               ms_text(opts_.handshake_timeout));
      close(c);
    } else {
      attempt_failed(c, "no challenge from the chief at " + opts_.chief_address + " within " +
                            ms_text(opts_.handshake_timeout) + " (connecting or waiting)");
    }
  }
  // The rendezvous.
  if (rendezvous_started_ && !view_formed_ && !rendezvous_failed_) {
    if (now >= rendezvous_deadline_) {
      if (chief_) {
        rendezvous_timed_out();
      } else if (!decided()) {
        rendezvous_failed_ = true;
        auto why = last_error_.empty() ? std::string{"no attempt finished"} : last_error_;
        if (chief_conn_ && !chief_conn_->closed() && chief_conn_->state == phase::joined)
          why = "joined the chief at " + chief_conn_->remote() +
                ", but no view arrived (the chief waits for every task to join)";
        auto text = self_ + " could not join the cluster at chief " + opts_.chief_address +
                    " within " + ms_text(opts_.rendezvous_timeout) + ": " + why;
        log_line(text);
        retry_timer_.cancel();
        if (chief_conn_)
          close(chief_conn_);
        set_outcome(make_caf_error(errc::collective_timeout, text));
      }
    } else if (chief_ && now >= next_missing_log_) {
      log_missing();
      next_missing_log_ = now + opts_.missing_log_interval;
    }
  }
  if (!view_formed_)
    return;
  // Heartbeats out, liveness and stuck writes in.
  std::vector<conn_ptr> members;
  for (const auto& c : conns_)
    if (c->state == phase::member)
      members.push_back(c);
  if (now >= next_heartbeat_) {
    next_heartbeat_ = now + opts_.heartbeat_interval;
    ++heartbeat_sequence_;
    for (const auto& c : members)
      send(c,
           codec::heartbeat{view_.epoch, static_cast<uint32_t>(opts_.rank), heartbeat_sequence_});
  }
  for (const auto& c : members) {
    if (c->closed() || c->state != phase::member)
      continue; // lost through an earlier one of this loop
    std::string cause;
    if (now - c->last_rx >= opts_.peer_timeout)
      cause = name_of(c->rank) + " sent no heartbeat for " + ms_text(opts_.peer_timeout);
    else if (c->writing() && now - c->write_started() >= opts_.peer_timeout)
      cause = name_of(c->rank) + ": a write of " + std::to_string(c->front_bytes()) + " bytes to " +
              c->remote() + " did not complete within " + ms_text(opts_.peer_timeout);
    if (cause.empty())
      continue;
    if (chief_)
      lose_member(c->rank, cause);
    else
      lose_chief(cause);
  }
}

std::string service::impl::frame_length(std::span<const std::byte, codec::prefix_bytes> prefix,
                                        uint32_t& length) {
  return codec::decode_length(prefix, opts_.max_message_bytes, length);
}

void service::impl::on_frame(const std::shared_ptr<framed_connection>& fc,
                             std::vector<std::byte> body) {
  auto c = std::static_pointer_cast<connection>(fc);
  codec::message m;
  auto why = codec::decode(body, opts_.max_message_bytes, m);
  body = {}; // frames are rare: do not keep up to max_message_bytes per connection
  if (!why.empty())
    return failed(c, "malformed message: " + why);
  if (!suspended_ && !c->graceful()) {
    c->last_rx = clock::now();
    on_message(c, m);
  }
}

void service::impl::on_read_error(const std::shared_ptr<framed_connection>& fc,
                                  const error_code& ec) {
  auto c = std::static_pointer_cast<connection>(fc);
  if (c->state == phase::handshake && chief_)
    return failed(c, "the connection closed without a Join (" + reason_of(ec) + ")");
  if (!chief_ && c->state != phase::member)
    return failed(c, "the connection closed (" + reason_of(ec) + ")");
  failed(c, "connection closed without leave (" + reason_of(ec) + ")");
}

void service::impl::on_failure(const std::shared_ptr<framed_connection>& fc,
                               const std::string& what) {
  failed(std::static_pointer_cast<connection>(fc), what);
}

void service::impl::failed(const conn_ptr& c, const std::string& what) {
  if (c->closed())
    return;
  if (suspended_)
    return; // deaf: it does not even notice; the socket stays open until the service goes
  if (c->graceful() || leaving_ || crashed_ || c->state == phase::left || c->state == phase::lost)
    return close(c); // expected: this side or the peer is closing
  if (!chief_) {
    if (c->state == phase::member)
      return lose_chief(name_of(0) + ": " + what);
    return attempt_failed(c, "the chief at " + c->remote() + ": " + what);
  }
  switch (c->state) {
  case phase::handshake:
    log_line("closed the connection from " + c->remote() + ": " + what);
    return close(c);
  case phase::joined:
    log_line(name_of(c->rank) + " at " + c->remote() + " dropped out before the view: " + what +
             "; it may join again");
    by_rank_[c->rank].reset();
    return close(c);
  case phase::member:
    return lose_member(c->rank, name_of(c->rank) + ": " + what);
  default:
    return close(c);
  }
}

void service::impl::send(const conn_ptr& c, const codec::message& m) {
  if (c->closed() || c->send_shut() || suspended_ || crashed_)
    return;
  auto frame = codec::encode(m);
  if (frame.size() - codec::prefix_bytes > opts_.max_message_bytes) {
    // Only a view can be this large; maybe_form_view checks it before sending.
    log_line("not sending a " + std::string(codec::kind_of(m)) + " of " +
             std::to_string(frame.size()) + " bytes to " + c->remote() +
             ": over options.max_message_bytes");
    return;
  }
  c->send(std::move(frame));
}

void service::impl::close(const conn_ptr& c) {
  if (!c->close())
    return;
  if (c->state == phase::handshake && chief_)
    --handshakes_;
  conns_.erase(c);
  maybe_leave_done();
}

void service::impl::close_gracefully(const conn_ptr& c) {
  c->close_gracefully(linger_);
}

void service::impl::on_message(const conn_ptr& c, codec::message& m) {
  auto unexpected = [&] {
    failed(c, std::string("protocol error: unexpected ") + codec::kind_of(m) + " message " +
                  (c->state == phase::handshake ? "before the handshake finished"
                   : c->state == phase::joined  ? "before the view"
                                                : "after the view"));
  };
  if (chief_) {
    switch (c->state) {
    case phase::handshake:
      if (auto* j = std::get_if<codec::join>(&m))
        return on_join(c, *j);
      return failed(c, std::string("expected a Join, got a ") + codec::kind_of(m) + " message");
    case phase::joined:
      if (auto* l = std::get_if<codec::leave>(&m)) {
        log_line(name_of(c->rank) + " left before the view: " + l->reason);
        by_rank_[c->rank].reset();
        c->state = phase::left;
        return close_gracefully(c);
      }
      return unexpected();
    case phase::member:
      if (std::holds_alternative<codec::heartbeat>(m))
        return;
      if (auto* l = std::get_if<codec::leave>(&m)) {
        log_line(name_of(c->rank) + " left: " + l->reason);
        c->state = phase::left;
        return close_gracefully(c);
      }
      return unexpected();
    default:
      return;
    }
  }
  // A worker: the connection to the chief.
  switch (c->state) {
  case phase::handshake: {
    auto* ch = std::get_if<codec::challenge>(&m);
    if (!ch)
      return failed(c, std::string("protocol error: expected a Challenge, got a ") +
                           codec::kind_of(m) + " message");
    if (auto why = proofs::check_challenge(*ch); !why.empty())
      return failed(c, why);
    codec::join j;
    j.task = opts_.tasks[opts_.rank];
    j.address = opts_.address;
    j.devices = opts_.devices;
    j.nonce = my_nonce_ = random_bytes(nonce_bytes);
    chief_nonce_ = ch->nonce;
    if (!opts_.secret.empty())
      j.auth_proof = proofs::join_proof(opts_.secret, chief_nonce_, my_nonce_, j.task, j.address);
    j.pid = static_cast<uint32_t>(::getpid());
    c->state = phase::joined;
    last_error_ = "joined the chief at " + c->remote() + ", but no view arrived";
    return send(c, j);
  }
  case phase::joined:
    if (auto* v = std::get_if<codec::view_message>(&m))
      return on_view(c, *v);
    if (auto* r = std::get_if<codec::refusal>(&m)) {
      auto text = "refused by the chief at " + opts_.chief_address + ": " + r->reason;
      log_line(text);
      rendezvous_failed_ = true;
      c->state = phase::left;
      close_gracefully(c);
      return set_outcome(make_caf_error(errc::invalid_argument, text));
    }
    if (auto* a = std::get_if<codec::abort>(&m)) {
      log_line("the chief at " + opts_.chief_address + " aborted the rendezvous: " + a->cause);
      rendezvous_failed_ = true;
      c->state = phase::left;
      close_gracefully(c);
      return set_outcome(make_caf_error(errc::collective_timeout, a->cause));
    }
    if (auto* l = std::get_if<codec::leave>(&m)) {
      auto text = "the chief at " + opts_.chief_address + " left before the view: " + l->reason;
      log_line(text);
      rendezvous_failed_ = true;
      c->state = phase::left;
      close_gracefully(c);
      return set_outcome(make_caf_error(errc::peer_lost, text));
    }
    return unexpected();
  case phase::member:
    if (std::holds_alternative<codec::heartbeat>(m))
      return;
    if (auto* a = std::get_if<codec::abort>(&m)) {
      log_line("the chief aborted epoch " + std::to_string(a->epoch) + ": " + a->cause);
      std::vector<int> ranks;
      for (auto r : a->lost_ranks)
        if (r < opts_.tasks.size())
          ranks.push_back(static_cast<int>(r));
      return report(std::move(ranks), a->cause);
    }
    if (auto* l = std::get_if<codec::leave>(&m)) {
      log_line("the chief left: " + l->reason);
      c->state = phase::left;
      return close_gracefully(c);
    }
    return unexpected();
  default:
    return;
  }
}

void service::impl::start_rendezvous() {
  if (rendezvous_started_ || leaving_ || crashed_ || decided())
    return;
  rendezvous_started_ = true;
  auto now = clock::now();
  rendezvous_deadline_ = now + opts_.rendezvous_timeout;
  next_missing_log_ = now + opts_.missing_log_interval;
  if (chief_)
    maybe_form_view();
  else
    start_attempt();
}

void service::impl::do_leave(const std::string& reason) {
  if (crashed_ || leaving_)
    return maybe_leave_done();
  leaving_ = true;
  set_outcome(
      make_caf_error(errc::shutdown, self_ + " left the cluster before the view: " + reason));
  error_code ignored;
  acceptor_.close(ignored);
  retry_timer_.cancel();
  resolver_.cancel();
  log_line("leaving the cluster: " + reason);
  auto epoch = view_formed_ ? view_.epoch : 0;
  for (const auto& c : std::vector<conn_ptr>(conns_.begin(), conns_.end())) {
    if (c->state == phase::handshake) {
      close(c);
      continue;
    }
    if (c->state == phase::joined || c->state == phase::member)
      send(c, codec::leave{epoch, static_cast<uint32_t>(opts_.rank), reason});
    c->state = phase::left;
    close_gracefully(c);
  }
  maybe_leave_done();
}

void service::impl::maybe_leave_done() {
  if (!leaving_ || !conns_.empty())
    return;
  {
    std::lock_guard lock(mu_);
    leave_done_ = true;
  }
  cv_.notify_all();
}

void service::impl::do_crash() {
  crashed_ = true;
  set_outcome(make_caf_error(errc::shutdown, self_ + " crashed (test hook) before the view"));
  error_code ignored;
  acceptor_.close(ignored);
  retry_timer_.cancel();
  resolver_.cancel();
  tick_timer_.cancel();
  for (const auto& c : std::vector<conn_ptr>(conns_.begin(), conns_.end()))
    close(c);
  {
    std::lock_guard lock(mu_);
    crash_done_ = true;
    leave_done_ = true;
  }
  cv_.notify_all();
}

// -- I/O thread: chief ---------------------------------------------------------------------------

void service::impl::accept_next() {
  if (stopped_ || crashed_ || leaving_)
    return;
  auto c = new_connection();
  acceptor_.async_accept(c->socket(), [this, c](const error_code& ec) {
    if (stopped_ || crashed_ || leaving_ || ec == asio::error::operation_aborted)
      return;
    if (ec) {
      // Out of descriptors and the like: log, and keep accepting after a pause.
      log_line("accept on " + listen_address_ + " failed: " + ec.message());
      retry_timer_.expires_after(milliseconds{50});
      retry_timer_.async_wait([this](const error_code& ec) {
        if (!ec)
          accept_next();
      });
      return;
    }
    accept_next();
    on_accepted(c);
  });
}

void service::impl::on_accepted(const conn_ptr& c) {
  error_code ec;
  auto remote = c->socket().remote_endpoint(ec);
  c->remote(ec ? std::string{"an unknown address"} : endpoint_text(remote));
  if (handshakes_ >= max_pending_handshakes) {
    log_line("closed the connection from " + c->remote() + ": " + std::to_string(handshakes_) +
             " connections are already in their handshake");
    c->close();
    return;
  }
  ++handshakes_;
  conns_.insert(c);
  c->socket().set_option(asio_tcp::no_delay(true), ec);
  c->opened_at = clock::now();
  c->nonce = random_bytes(nonce_bytes);
  send(c, codec::challenge{c->nonce});
  c->read_frames();
}

std::string service::impl::check_join(const codec::join& j, const std::vector<std::byte>& nonce,
                                      int& rank) const {
  if (j.version != codec::protocol_version)
    return "it speaks membership protocol version " + std::to_string(j.version) +
           ", this chief speaks version " + std::to_string(codec::protocol_version);
  if (rendezvous_failed_)
    return "the rendezvous of this cluster has failed already (" + failure_ + ")";
  if (auto why = proofs::check_join(opts_.secret, nonce, j); !why.empty())
    return why;
  auto who = to_string(j.task);
  auto it = std::find(opts_.tasks.begin(), opts_.tasks.end(), j.task);
  if (it == opts_.tasks.end()) {
    std::vector<std::string> names;
    for (const auto& t : opts_.tasks)
      names.push_back(to_string(t));
    return "task " + who +
           " is not a worker of this cluster (expected one of: " + join_names(names) + ")";
  }
  rank = static_cast<int>(it - opts_.tasks.begin());
  if (rank == 0)
    return "task " + who + " is the chief's own task (rank 0)";
  if (view_formed_)
    return "task " + who + " (rank " + std::to_string(rank) +
           ") is already a member of this cluster's view (epoch " + std::to_string(view_.epoch) +
           "); joining again is not supported";
  if (by_rank_[rank])
    return "task " + who + " (rank " + std::to_string(rank) + ") already joined, from " +
           by_rank_[rank]->remote() + " (a duplicate task)";
  if (j.devices.size() != opts_.devices.size())
    return who + " announces " + std::to_string(j.devices.size()) + " devices but the chief (" +
           to_string(opts_.tasks[0]) + ") has " + std::to_string(opts_.devices.size()) +
           "; multi_worker_mirrored_strategy needs the same number of devices on every worker";
  host_port hp;
  if (auto why = split_address(j.address, hp); !why.empty())
    return "its collective address: " + why;
  return {};
}

void service::impl::on_join(const conn_ptr& c, codec::join& j) {
  int rank = -1;
  auto why = check_join(j, c->nonce, rank);
  if (!why.empty())
    return refuse(c, j, why);
  --handshakes_;
  c->state = phase::joined;
  c->rank = rank;
  c->join = std::move(j);
  by_rank_[rank] = c;
  log_line(name_of(rank) + " joined from " + c->remote() + " (collective address " +
           c->join.address + ", " + std::to_string(c->join.devices.size()) + " devices, pid " +
           std::to_string(c->join.pid) + ")");
  maybe_form_view();
}

void service::impl::refuse(const conn_ptr& c, const codec::join& j, const std::string& reason) {
  log_line("refused the Join of " + to_string(j.task) + " from " + c->remote() + ": " + reason);
  send(c, codec::refusal{j.task, reason});
  --handshakes_;
  c->state = phase::left;
  close_gracefully(c);
}

std::vector<int> service::impl::missing_ranks() const {
  std::vector<int> out;
  for (std::size_t r = 1; r < by_rank_.size(); ++r)
    if (!by_rank_[r])
      out.push_back(static_cast<int>(r));
  return out;
}

void service::impl::maybe_form_view() {
  if (!rendezvous_started_ || view_formed_ || rendezvous_failed_ || leaving_ || crashed_ ||
      !missing_ranks().empty())
    return;
  view v;
  v.epoch = 1;
  do {
    auto bytes = random_bytes(8);
    for (auto b : bytes)
      v.group_id = (v.group_id << 8) | static_cast<uint64_t>(b);
  } while (v.group_id == 0);
  v.members.resize(opts_.tasks.size());
  for (std::size_t r = 0; r < opts_.tasks.size(); ++r) {
    auto& m = v.members[r];
    m.rank = static_cast<int>(r);
    m.task = opts_.tasks[r];
    if (r == 0) {
      m.address = opts_.address;
      m.devices = opts_.devices;
    } else {
      m.address = by_rank_[r]->join.address;
      m.devices = by_rank_[r]->join.devices;
    }
  }
  v.nccl_unique_id = opts_.nccl_unique_id;
  auto size = codec::encode(codec::view_message{v, std::vector<std::byte>(32)}).size() -
              codec::prefix_bytes;
  if (size > opts_.max_message_bytes) {
    rendezvous_failed_ = true;
    failure_ = "the view of " + std::to_string(v.members.size()) + " members is " +
               std::to_string(size) + " bytes, over options.max_message_bytes (" +
               std::to_string(opts_.max_message_bytes) + ")";
    log_line(failure_);
    for (std::size_t r = 1; r < by_rank_.size(); ++r) {
      send(by_rank_[r], codec::abort{0, failure_, {}});
      by_rank_[r]->state = phase::left;
      close_gracefully(by_rank_[r]);
    }
    return set_outcome(make_caf_error(errc::invalid_argument, self_ + ": " + failure_));
  }
  view_formed_ = true;
  view_ = v;
  auto now = clock::now();
  next_heartbeat_ = now + opts_.heartbeat_interval;
  for (std::size_t r = 1; r < by_rank_.size(); ++r) {
    auto& c = by_rank_[r];
    c->state = phase::member;
    c->last_rx = now;
    codec::view_message m{v, {}};
    if (!opts_.secret.empty())
      m.auth_proof = proofs::view_proof(opts_.secret, c->nonce, c->join.nonce, c->join.task,
                                        v.epoch, v.group_id);
    send(c, m);
  }
  log_line("formed the view of epoch " + std::to_string(v.epoch) + ": " +
           std::to_string(v.members.size()) + " members, group " + std::to_string(v.group_id));
  set_outcome(std::move(v));
}

void service::impl::log_missing() {
  auto missing = missing_ranks();
  if (missing.empty())
    return;
  std::vector<std::string> missing_names, joined_names;
  for (std::size_t r = 0; r < by_rank_.size(); ++r)
    (r != 0 && !by_rank_[r] ? missing_names : joined_names).push_back(to_string(opts_.tasks[r]));
  log_line("waiting for " + std::to_string(missing.size()) + " of " +
           std::to_string(opts_.tasks.size()) + " tasks to join: " + join_names(missing_names) +
           " (joined: " + join_names(joined_names) + ")");
}

void service::impl::rendezvous_timed_out() {
  std::vector<std::string> missing_names, joined_names;
  for (std::size_t r = 0; r < by_rank_.size(); ++r)
    (r != 0 && !by_rank_[r] ? missing_names : joined_names).push_back(to_string(opts_.tasks[r]));
  auto text = "rendezvous at " + listen_address_ + " timed out after " +
              ms_text(opts_.rendezvous_timeout) + ": " + join_names(missing_names) +
              " did not join (joined: " + join_names(joined_names) + ")";
  rendezvous_failed_ = true;
  failure_ = text;
  log_line(text);
  for (std::size_t r = 1; r < by_rank_.size(); ++r) {
    if (!by_rank_[r])
      continue;
    send(by_rank_[r], codec::abort{0, text, {}});
    by_rank_[r]->state = phase::left;
    close_gracefully(by_rank_[r]);
    by_rank_[r].reset();
  }
  set_outcome(make_caf_error(errc::collective_timeout, text));
}

void service::impl::lose_member(int rank, const std::string& cause) {
  auto c = by_rank_[rank];
  if (!c || c->state != phase::member)
    return;
  c->state = phase::lost;
  log_line("lost " + cause + " (connection from " + c->remote() + ")");
  close(c);
  report({rank}, cause);
  for (const auto& other : std::vector<conn_ptr>(conns_.begin(), conns_.end()))
    if (other->state == phase::member)
      send(other, codec::abort{view_.epoch, cause, {static_cast<uint32_t>(rank)}});
}

// -- I/O thread: worker --------------------------------------------------------------------------

void service::impl::start_attempt() {
  if (stopped_ || crashed_ || leaving_ || rendezvous_failed_ || view_formed_ || decided())
    return;
  auto c = new_connection();
  c->remote(opts_.chief_address);
  c->rank = 0;
  c->opened_at = clock::now();
  chief_conn_ = c;
  conns_.insert(c);
  resolver_.async_resolve(
      chief_hp_.host, chief_hp_.port, asio_tcp::resolver::numeric_service,
      [this, c](const error_code& ec, asio_tcp::resolver::results_type results) {
        if (stopped_ || c->closed())
          return;
        if (ec || results.empty())
          return attempt_failed(c, "resolve " + chief_hp_.host + ": " +
                                       (ec ? ec.message() : std::string{"no address"}));
        asio::async_connect(
            c->socket(), results, [this, c](const error_code& ec, const asio_tcp::endpoint& ep) {
              if (stopped_ || c->closed())
                return;
              if (ec)
                return attempt_failed(c, "connect to " + opts_.chief_address + ": " + ec.message());
              // A connect to a port of the ephemeral range on which nobody listens yet can be
              // given that very port as its source: a TCP self-connect, which would read its
              // own Join back. Treat it as the refusal it stands for.
              error_code local_ec;
              if (c->socket().local_endpoint(local_ec) == ep && !local_ec)
                return attempt_failed(c, "connect to " + opts_.chief_address +
                                             ": connected to itself (nobody listens there yet)");
              c->remote(endpoint_text(ep));
              error_code ignored;
              c->socket().set_option(asio_tcp::no_delay(true), ignored);
              c->read_frames();
            });
      });
}

void service::impl::attempt_failed(const conn_ptr& c, const std::string& why) {
  close(c);
  last_error_ = why;
  if (stopped_ || crashed_ || leaving_ || rendezvous_failed_ || view_formed_ || decided())
    return;
  auto now = clock::now();
  if (now + backoff_ >= rendezvous_deadline_)
    return; // the tick fails the rendezvous at its deadline with this error
  if (!warned_) {
    // Once: workers usually start before the chief listens, so a refused attempt is common.
    warned_ = true;
    auto left = std::chrono::duration_cast<milliseconds>(rendezvous_deadline_ - now);
    log_line("cannot join the chief at " + opts_.chief_address + " yet (" + why +
             "); retrying for up to " + ms_text(left));
  }
  retry_timer_.expires_after(backoff_);
  backoff_ = std::min(backoff_ * 2, max_backoff);
  retry_timer_.async_wait([this](const error_code& ec) {
    if (!ec && !stopped_)
      start_attempt();
  });
}

void service::impl::on_view(const conn_ptr& c, codec::view_message& m) {
  auto& v = m.view;
  auto why = proofs::check_view(opts_.secret, chief_nonce_, my_nonce_, opts_.tasks[opts_.rank], m);
  if (why.empty() && v.epoch == 0)
    why = "its view has epoch 0";
  if (why.empty() && v.members.size() != opts_.tasks.size())
    why = "its view has " + std::to_string(v.members.size()) + " members, expected " +
          std::to_string(opts_.tasks.size());
  for (std::size_t r = 0; why.empty() && r < v.members.size(); ++r)
    if (v.members[r].rank != static_cast<int>(r) || !(v.members[r].task == opts_.tasks[r]))
      why = "its view lists " + to_string(v.members[r].task) + " with rank " +
            std::to_string(v.members[r].rank) + " at position " + std::to_string(r) +
            ", expected " + to_string(opts_.tasks[r]) + " with rank " + std::to_string(r) +
            " (do all tasks share one cluster spec?)";
  if (!why.empty()) {
    auto text = "the chief at " + opts_.chief_address + " sent an invalid view: " + why;
    log_line(text);
    rendezvous_failed_ = true;
    c->state = phase::left;
    close(c);
    return set_outcome(make_caf_error(errc::invalid_argument, self_ + ": " + text));
  }
  view_formed_ = true;
  view_ = v;
  c->state = phase::member;
  auto now = clock::now();
  c->last_rx = now;
  next_heartbeat_ = now + opts_.heartbeat_interval;
  log_line("received the view of epoch " + std::to_string(v.epoch) + " from the chief at " +
           c->remote() + ": " + std::to_string(v.members.size()) + " members, group " +
           std::to_string(v.group_id));
  set_outcome(std::move(v));
}

void service::impl::lose_chief(const std::string& cause) {
  auto c = chief_conn_;
  if (!c || c->state != phase::member)
    return;
  c->state = phase::lost;
  log_line("lost the chief: " + cause + " (connection to " + c->remote() + ")");
  close(c);
  report({0}, cause);
}

// -- service -------------------------------------------------------------------------------------

caf::expected<std::unique_ptr<service>> service::start(options opts) {
  if (auto why = check_options(opts); !why.empty())
    return make_caf_error(errc::invalid_argument, "membership::service::start: " + why);
  auto ptr = std::make_shared<impl>(std::move(opts));
  if (auto err = ptr->start())
    return err;
  return std::make_unique<service>(std::move(ptr));
}

service::service(std::shared_ptr<impl> ptr) : impl_(std::move(ptr)) {}

service::~service() {
  if (!impl_)
    return;
  impl_->leave("shutdown");
  impl_->shutdown();
}

std::string service::listen_address() const {
  return impl_->listen_address();
}

int service::rank() const noexcept {
  return impl_->rank();
}

caf::expected<view> service::rendezvous() {
  return impl_->rendezvous();
}

void service::on_lost(std::function<void(const lost_event&)> fn) {
  impl_->on_lost(std::move(fn));
}

void service::leave(const std::string& reason) {
  impl_->leave(reason);
}

void service::suspend() {
  impl_->suspend();
}

void service::crash() {
  impl_->crash();
}

} // namespace consort::transport::membership
