// The TCP context: listening, the full mesh (connect, accept, handshake) and abort; the pairs do
// the I/O of established connections (pair_impl.hpp).
//
// Threads. One I/O thread per context runs its io_context: accepts, connects, handshakes and
// retry timers. One poller thread (poller.hpp) watches the established connections' readiness
// with an epoll set of its own, armed only for what is needed, so that a message read by a
// spinning caller wakes no other thread. Callers' threads post operations and, while they wait,
// drive their own pair's socket.
//
// The mesh. Rank i connects to every rank j < i and accepts every rank j > i. The connecting side
// sends its hello first; the accepting side checks it (version, group, epoch, size, rank, not yet
// connected) and answers with its own, which the connecting side checks in turn. Only then does a
// pair take the socket. With a shared secret (`mesh_options::secret`) the handshake is a mutual
// challenge-response (schemas/frame.capnp, docs/multi_worker.md "Authentication"): the connector's
// hello carries its nonce Nc; the acceptor's reply carries its nonce Na and its proof, an
// HMAC-SHA256 over the role "acceptor", the group, epoch, size, both ranks and both nonces; the
// connector checks it, then sends an Auth frame with its own proof (role "connector", same
// fields), which the acceptor checks before the pair takes the socket. The connector proves
// nothing to an acceptor whose proof failed: it sends a refusal instead, so that both sides log
// why. Refused, reset or timed-out connection attempts are retried with back-off
// until the mesh deadline, since peers start at different times. Every accepted connection must
// present a valid hello within `handshake_timeout`; anything else (garbage, a truncated or
// oversized frame, another group) is logged with the remote address and closed, and the context
// goes on serving its real peers. The listening socket stays open after the mesh is complete, so
// a stray or hostile client always meets a handshake that refuses it with a logged reason.

#include "transport/address.hpp"
#include "transport/auth.hpp"
#include "transport/tcp/pair_impl.hpp"
#include "transport/tcp/test_hooks.hpp"
#include "transport/tcp/wire.hpp"

#include <consort/transport/tcp.hpp>

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <pthread.h>
#include <unordered_set>

namespace consort::transport::tcp {

namespace {

namespace asio = boost::asio;
using asio_tcp = boost::asio::ip::tcp;
using error_code = boost::system::error_code;

/// How many accepted connections may be in their handshake at once; more are closed at once.
constexpr std::size_t max_pending_handshakes = 64;

/// Back-off between connection attempts to a peer that is not up yet.
constexpr std::chrono::milliseconds first_backoff{2};
constexpr std::chrono::milliseconds max_backoff{200};

using transport::endpoint_text;
using transport::host_port;
using transport::ms_text;
using transport::split_address;

} // namespace

/// The TCP context (see the file comment).
///
/// Thread safety: thread-safe. `pairs_` is fixed at construction; the mesh state is guarded by
/// mesh_mu_; everything Asio (acceptor, handshakes, timers) belongs to the I/O thread.
class context_impl final : public context {
public:
  context_impl(const mesh_options& opts, test_hooks hooks);
  ~context_impl() override;

  context_impl(const context_impl&) = delete;
  context_impl& operator=(const context_impl&) = delete;

  /// Binds and listens, then starts the I/O thread and accepting.
  caf::error start();

  // -- transport::context ----------------------------------------------------------------------

  int rank() const noexcept override { return opts_.rank; }
  int size() const noexcept override { return opts_.size; }
  transport::pair& to(int peer) override;
  void abort(const std::string& why, errc code = errc::peer_lost) override;
  caf::error close(const std::string& reason, deadline until) override;

  // -- tcp::context ----------------------------------------------------------------------------

  std::string listen_address() const override { return listen_address_; }
  uint16_t port() const noexcept override { return port_; }
  caf::error connect(const std::vector<std::string>& addresses) override;

private:
  /// A connection before its pair takes it: connecting or accepted, until its hellos are checked.
  struct handshake {
    explicit handshake(asio::io_context& io) : socket(io), timer(io), resolver(io) {}
    asio_tcp::socket socket;
    asio::steady_timer timer;
    asio_tcp::resolver resolver;
    asio_tcp::resolver::results_type endpoints;
    std::size_t next_endpoint = 0;
    std::string address; // the remote end, for logs and errors
    int peer = -1; // the rank: known in advance when connecting, from the hello when accepting
    bool outbound = false; // we connected
    bool finished = false;
    bool timed_out = false;
    bool claimed = false;              // this handshake set claimed_[peer]
    std::vector<std::byte> my_nonce;   // with a secret: the nonce of our hello
    std::vector<std::byte> peer_nonce; // with a secret: the nonce of the peer's hello
    std::array<std::byte, wire::prefix_bytes> prefix{};
    std::vector<std::byte> body;
    std::vector<std::byte> out;
  };
  using handshake_ptr = std::shared_ptr<handshake>;
  using hello_handler = std::function<void(const std::string& error, const wire::hello& hello)>;
  using frame_handler = std::function<void(const std::string& error)>;

  // -- I/O thread ------------------------------------------------------------------------------

  void accept_next();
  void on_accepted(const handshake_ptr& hs);
  void start_connect(int peer, std::chrono::milliseconds backoff);
  void connect_next_endpoint(const handshake_ptr& hs, std::chrono::milliseconds backoff);
  void on_connected(const handshake_ptr& hs, std::chrono::milliseconds backoff);
  void attempt_failed(const handshake_ptr& hs, const std::string& why,
                      std::chrono::milliseconds backoff);
  void read_frame(const handshake_ptr& hs, const char* what, frame_handler then);
  void read_hello(const handshake_ptr& hs, hello_handler then);
  void reply_hello(const handshake_ptr& hs, const wire::hello& h);
  void read_auth(const handshake_ptr& hs);
  void on_reply_hello(const handshake_ptr& hs, const wire::hello& h,
                      std::chrono::milliseconds backoff);
  void mesh_refused(const handshake_ptr& hs, const std::string& text);
  void arm_timer(const handshake_ptr& hs, deadline until);
  void finish(const handshake_ptr& hs);
  void refuse(const handshake_ptr& hs, const std::string& why);
  void connected(const handshake_ptr& hs);
  std::string check_hello(const wire::hello& h) const;
  std::string check_auth_mode(const wire::hello& h, const char* peer) const;
  auth::transcript mesh_transcript(const char* role, int connector, int acceptor,
                                   const std::vector<std::byte>& connector_nonce,
                                   const std::vector<std::byte>& acceptor_nonce) const;
  void apply_socket_options(asio_tcp::socket& socket);
  std::string timeout_text(const handshake_ptr& hs, const char* what) const;

  wire::hello my_hello() const;

  mesh_options opts_;
  test_hooks hooks_;
  std::shared_ptr<pair_env> env_;
  std::string listen_address_;
  uint16_t port_ = 0;

  // Declared before every Asio object of this class, so that it is destroyed after them.
  asio::io_context io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  asio_tcp::acceptor acceptor_;
  std::vector<std::shared_ptr<pair_impl>> pairs_; // by rank; null at this rank
  std::thread thread_;
  /// The pairs' readiness (made by start, before any pair opens; stopped before teardown).
  std::unique_ptr<readiness_poller> poller_;

  // I/O thread only
  std::unordered_set<handshake_ptr> handshakes_;
  std::size_t inbound_handshakes_ = 0;
  std::vector<bool> claimed_;          // a hello from this rank was accepted
  std::vector<bool> warned_;           // a failed attempt to reach this rank was logged
  std::vector<std::string> addresses_; // written by connect before it posts to the I/O thread
  deadline mesh_deadline_{};
  std::vector<std::unique_ptr<asio::steady_timer>> retry_timers_;

  std::atomic<bool> closing_{false};
  std::atomic<bool> mesh_done_{false}; // connect returned: no more retries
  std::atomic<bool> connect_called_{false};
  std::atomic<bool> close_called_{false};

  std::mutex mesh_mu_;
  std::condition_variable mesh_cv_;     // guarded by mesh_mu_
  int missing_ = 0;                     // guarded by mesh_mu_
  std::vector<bool> connected_;         // guarded by mesh_mu_
  std::vector<std::string> last_error_; // guarded by mesh_mu_: per rank, why it is missing
  std::string last_refusal_;            // guarded by mesh_mu_
  caf::error mesh_failure_;             // guarded by mesh_mu_
  std::optional<std::string> aborted_;  // guarded by mesh_mu_
};

// -- construction and destruction ----------------------------------------------------------------

context_impl::context_impl(const mesh_options& opts, test_hooks hooks)
    : opts_(opts), hooks_(std::move(hooks)), env_(std::make_shared<pair_env>()), acceptor_(io_) {
  env_->rank = opts.rank;
  env_->size = opts.size;
  env_->spin = opts.spin;
  env_->busy_poll = opts.busy_poll;
  env_->max_payload_bytes = opts.max_payload_bytes;
  env_->max_stash_bytes = opts.max_stash_bytes;
  env_->log = opts.log;
  env_->before_read = hooks_.before_read;
  env_->on_readiness = hooks_.on_readiness;
  pairs_.resize(static_cast<std::size_t>(opts.size));
  for (int peer = 0; peer < opts.size; ++peer)
    if (peer != opts.rank)
      pairs_[peer] = std::make_shared<pair_impl>(env_, io_, peer);
  claimed_.assign(opts.size, false);
  warned_.assign(opts.size, false);
  connected_.assign(opts.size, false);
  last_error_.assign(opts.size, std::string{});
  missing_ = opts.size - 1;
  retry_timers_.resize(opts.size);
  for (auto& timer : retry_timers_)
    timer = std::make_unique<asio::steady_timer>(io_);
}

context_impl::~context_impl() {
  closing_.store(true);
  mesh_done_.store(true);
  {
    std::lock_guard lock(mesh_mu_);
    if (!aborted_)
      aborted_ = "the context was destroyed";
  }
  mesh_cv_.notify_all();
  io_.stop();
  if (thread_.joinable())
    thread_.join();
  // No readiness is reported from here on (the pairs leave its set at teardown).
  if (poller_)
    poller_->stop();
  // The I/O thread is gone: close every Asio object here, before io_ goes. Operations that
  // outlive the context find their pair failed and closed.
  for (auto& pair : pairs_)
    if (pair)
      pair->teardown("the context of rank " + std::to_string(opts_.rank) + " was destroyed");
  error_code ignored;
  acceptor_.close(ignored);
  for (const auto& hs : handshakes_) {
    hs->socket.close(ignored);
    hs->timer.cancel();
    hs->resolver.cancel();
  }
  handshakes_.clear();
  for (auto& timer : retry_timers_)
    timer->cancel();
  work_.reset();
}

caf::error context_impl::start() {
  auto text = opts_.listen_address.empty() ? opts_.addresses[opts_.rank] : opts_.listen_address;
  host_port hp;
  if (auto why = split_address(text, hp); !why.empty())
    return make_caf_error(errc::invalid_argument,
                          "rank " + std::to_string(opts_.rank) + " cannot listen: " + why);
  try {
    poller_ = std::make_unique<readiness_poller>();
  } catch (const std::exception& e) {
    return make_caf_error(errc::invalid_argument, "rank " + std::to_string(opts_.rank) +
                                                      " cannot watch its connections: " + e.what());
  }
  env_->poller = poller_.get();
  error_code ec;
  asio_tcp::resolver resolver(io_);
  auto results = resolver.resolve(
      hp.host, hp.port, asio_tcp::resolver::passive | asio_tcp::resolver::numeric_service, ec);
  auto fail = [&](const char* syscall) {
    return make_caf_error(errc::invalid_argument, "rank " + std::to_string(opts_.rank) +
                                                      " cannot listen on " + text + ": " + syscall +
                                                      ": " + ec.message());
  };
  if (ec)
    return fail("resolve");
  if (results.empty())
    return make_caf_error(errc::invalid_argument, "rank " + std::to_string(opts_.rank) +
                                                      " cannot listen on " + text +
                                                      ": the host has no address");
  auto ep = results.begin()->endpoint();
  if (acceptor_.open(ep.protocol(), ec); ec)
    return fail("socket");
  if (acceptor_.set_option(asio_tcp::acceptor::reuse_address(true), ec); ec)
    return fail("setsockopt(SO_REUSEADDR)");
  // Accepted sockets inherit the buffer sizes; set before listen so the window scale fits them.
  if (opts_.recv_buffer_bytes > 0)
    acceptor_.set_option(asio::socket_base::receive_buffer_size(opts_.recv_buffer_bytes), ec);
  if (opts_.send_buffer_bytes > 0)
    acceptor_.set_option(asio::socket_base::send_buffer_size(opts_.send_buffer_bytes), ec);
  if (acceptor_.bind(ep, ec); ec)
    return fail("bind");
  if (acceptor_.listen(asio::socket_base::max_listen_connections, ec); ec)
    return fail("listen");
  auto local = acceptor_.local_endpoint(ec);
  if (ec)
    return fail("getsockname");
  listen_address_ = endpoint_text(local);
  port_ = local.port();
  work_.emplace(io_.get_executor());
  asio::post(io_, [this] { accept_next(); });
  thread_ = std::thread([this] {
    (void)::pthread_setname_np(::pthread_self(), "consort-tcp-io");
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {
        env_->log_line(std::string("an I/O handler threw: ") + e.what());
      }
    }
  });
  return {};
}

// -- transport::context --------------------------------------------------------------------------

transport::pair& context_impl::to(int peer) {
  if (peer < 0 || peer >= opts_.size || peer == opts_.rank) {
    std::fprintf(stderr, "consort: tcp::context::to(%d) on rank %d of %d: no such peer\n", peer,
                 opts_.rank, opts_.size);
    std::abort();
  }
  return *pairs_[peer];
}

void context_impl::abort(const std::string& why, errc code) {
  {
    std::lock_guard lock(mesh_mu_);
    if (!aborted_)
      aborted_ = why;
  }
  mesh_cv_.notify_all();
  for (auto& pair : pairs_)
    if (pair) {
      // The peer is told the code and the reason (an abort frame), then the connection ends.
      pair->abort("rank " + std::to_string(opts_.rank) + " aborted its transport context: " + why,
                  code);
      // Fail the operations being read or written right here, not on the I/O thread: a receive
      // half read is failed when abort returns, even if the I/O thread was inside its pump.
      pair->pump_rx_now();
      pair->pump_tx();
    }
}

caf::error context_impl::close(const std::string& reason, deadline until) {
  if (close_called_.exchange(true))
    return {};
  // No more connections: a pair that is not open now never will be.
  mesh_done_.store(true);
  {
    std::lock_guard lock(mesh_mu_);
    if (!aborted_)
      aborted_ = "rank " + std::to_string(opts_.rank) + " left the group: " + reason;
  }
  mesh_cv_.notify_all();
  const auto n = pairs_.size();
  // 1. Refuse new operations; remember the last send queued on each pair.
  std::vector<std::shared_ptr<send_op>> last(n);
  for (std::size_t peer = 0; peer < n; ++peer) {
    auto& pair = pairs_[peer];
    if (!pair)
      continue;
    if (!pair->is_open())
      pair->fail("rank " + std::to_string(opts_.rank) + " left the group (" + reason +
                     ") before this connection was formed",
                 pair_impl::log_mode::never, errc::shutdown);
    last[peer] = pair->begin_close(reason);
  }
  // 2. Finish every send started before: in order, so the last one done means all are. A pair
  // that fails meanwhile has nothing left to finish.
  for (std::size_t peer = 0; peer < n; ++peer)
    if (last[peer])
      (void)last[peer]->wait(until);
  // 3. Say goodbye after the last message, then half-close.
  std::vector<std::shared_ptr<send_op>> goodbyes(n);
  for (std::size_t peer = 0; peer < n; ++peer)
    if (pairs_[peer])
      goodbyes[peer] = pairs_[peer]->send_goodbye(reason);
  for (std::size_t peer = 0; peer < n; ++peer)
    if (goodbyes[peer] && !goodbyes[peer]->wait(until))
      pairs_[peer]->shut_write();
  if (hooks_.after_goodbye)
    hooks_.after_goodbye();
  // 4. Read on until each peer closed its side: then it has read everything we sent. Closing
  // earlier, with bytes unread on either side, can make the kernel reset the connection and
  // drop what is still queued for the peer.
  std::vector<int> late;
  for (std::size_t peer = 0; peer < n; ++peer)
    if (pairs_[peer] && !pairs_[peer]->broken() && !pairs_[peer]->wait_peer_closed(until))
      late.push_back(static_cast<int>(peer));
  if (late.empty())
    return {};
  std::ostringstream out;
  out << "rank " << opts_.rank << " left the group (" << reason << "), but";
  for (auto peer : late)
    out << " " << pairs_[peer]->describe();
  out << " did not close " << (late.size() == 1 ? "its side" : "their sides")
      << " before the deadline; the connections are closed anyway";
  return make_caf_error(errc::collective_timeout, out.str());
}

// -- the mesh ------------------------------------------------------------------------------------

caf::error context_impl::connect(const std::vector<std::string>& addresses) {
  if (connect_called_.exchange(true))
    return make_caf_error(errc::invalid_argument, "tcp::context::connect called twice");
  if (addresses.size() != static_cast<std::size_t>(opts_.size))
    return make_caf_error(errc::invalid_argument,
                          "tcp::context::connect: " + std::to_string(addresses.size()) +
                              " addresses for a group of " + std::to_string(opts_.size));
  for (int peer = 0; peer < opts_.rank; ++peer) {
    host_port hp;
    if (auto why = split_address(addresses[peer], hp); !why.empty())
      return make_caf_error(errc::invalid_argument, "tcp::context::connect: the address of rank " +
                                                        std::to_string(peer) + ": " + why);
  }
  auto started = clock::now();
  auto until = started + opts_.connect_timeout;
  addresses_ = addresses;
  mesh_deadline_ = until;
  asio::post(io_, [this] {
    for (int peer = 0; peer < opts_.rank; ++peer)
      start_connect(peer, first_backoff);
  });
  std::unique_lock lock(mesh_mu_);
  mesh_cv_.wait_until(lock, until, [this] { return missing_ == 0 || mesh_failure_ || aborted_; });
  mesh_done_.store(true);
  if (missing_ == 0)
    return {};
  // Describe every missing rank; their pairs fail with it, so that nothing posted on them waits.
  std::vector<std::pair<int, std::string>> missing;
  for (int peer = 0; peer < opts_.size; ++peer) {
    if (peer == opts_.rank || connected_[peer])
      continue;
    auto why = "rank " + std::to_string(peer) + " at " + addresses[peer] + " (";
    if (peer < opts_.rank)
      why += last_error_[peer].empty() ? std::string{"no attempt finished"} : last_error_[peer];
    else
      why += "it has not connected to this rank" +
             (last_refusal_.empty() ? std::string{} : "; last refused: " + last_refusal_);
    missing.emplace_back(peer, why + ")");
  }
  caf::error result;
  if (aborted_) {
    result = make_caf_error(errc::peer_lost, "rank " + std::to_string(opts_.rank) +
                                                 " stopped forming its mesh: " + *aborted_);
  } else if (mesh_failure_) {
    result = mesh_failure_;
  } else {
    std::ostringstream out;
    out << "rank " << opts_.rank << " could not form the mesh of " << opts_.size << " ranks within "
        << ms_text(opts_.connect_timeout) << "; missing:";
    for (const auto& [peer, why] : missing)
      out << " " << why << ";";
    result = make_caf_error(errc::collective_timeout, out.str());
  }
  lock.unlock();
  for (const auto& [peer, why] : missing)
    pairs_[peer]->fail("the mesh was not formed, no connection to " + why,
                       pair_impl::log_mode::never);
  return result;
}

wire::hello context_impl::my_hello() const {
  wire::hello h;
  h.rank = static_cast<uint32_t>(opts_.rank);
  h.size = static_cast<uint32_t>(opts_.size);
  h.group_id = opts_.group_id;
  h.epoch = opts_.epoch;
  return h;
}

std::string context_impl::check_hello(const wire::hello& h) const {
  if (h.version != wire::protocol_version)
    return "its hello has protocol version " + std::to_string(h.version) + ", expected " +
           std::to_string(wire::protocol_version);
  if (h.group_id != opts_.group_id || h.epoch != opts_.epoch)
    return "its hello is of group " + std::to_string(h.group_id) + " epoch " +
           std::to_string(h.epoch) + ", expected group " + std::to_string(opts_.group_id) +
           " epoch " + std::to_string(opts_.epoch);
  if (h.size != static_cast<uint32_t>(opts_.size))
    return "its hello is of a group of " + std::to_string(h.size) + " ranks, expected " +
           std::to_string(opts_.size);
  if (h.rank >= static_cast<uint32_t>(opts_.size))
    return "its hello names rank " + std::to_string(h.rank) + ", outside [0, " +
           std::to_string(opts_.size) + ")";
  if (!h.nonce.empty() &&
      (h.nonce.size() < auth::min_nonce_bytes || h.nonce.size() > auth::max_nonce_bytes))
    return "its hello has a nonce of " + std::to_string(h.nonce.size()) + " bytes, expected " +
           std::to_string(auth::min_nonce_bytes) + " to " + std::to_string(auth::max_nonce_bytes);
  return {};
}

std::string context_impl::check_auth_mode(const wire::hello& h, const char* peer) const {
  // A nonce in a hello says that its sender has a secret: both sides must agree on having one.
  if (opts_.secret.empty() && !h.nonce.empty())
    return std::string("authentication failed: ") + peer + " " + std::to_string(h.rank) +
           " has a shared secret (its hello carries a nonce) but this rank has none (set the same "
           "secret on every rank, or none on all)";
  if (!opts_.secret.empty() && h.nonce.empty())
    return std::string("authentication failed: ") + peer + " " + std::to_string(h.rank) +
           " has no shared secret (its hello carries no nonce), which this rank requires (set "
           "the same secret on every rank)";
  return {};
}

auth::transcript context_impl::mesh_transcript(const char* role, int connector, int acceptor,
                                               const std::vector<std::byte>& connector_nonce,
                                               const std::vector<std::byte>& acceptor_nonce) const {
  // Every field that identifies this connection: a proof made for another role, group, epoch,
  // pair of ranks or pair of nonces does not verify here.
  auth::transcript t(std::string("consort-mesh-v1|") + role);
  t.u64(opts_.group_id)
      .u64(opts_.epoch)
      .u32(static_cast<uint32_t>(opts_.size))
      .u32(static_cast<uint32_t>(connector))
      .u32(static_cast<uint32_t>(acceptor))
      .bytes(connector_nonce)
      .bytes(acceptor_nonce);
  return t;
}

void context_impl::apply_socket_options(asio_tcp::socket& socket) {
  error_code ignored;
  socket.set_option(asio_tcp::no_delay(true), ignored);
  if (opts_.recv_buffer_bytes > 0)
    socket.set_option(asio::socket_base::receive_buffer_size(opts_.recv_buffer_bytes), ignored);
  if (opts_.send_buffer_bytes > 0)
    socket.set_option(asio::socket_base::send_buffer_size(opts_.send_buffer_bytes), ignored);
}

void context_impl::arm_timer(const handshake_ptr& hs, deadline until) {
  hs->timer.expires_at(until);
  hs->timer.async_wait([hs](const error_code& ec) {
    if (ec || hs->finished)
      return;
    hs->timed_out = true;
    error_code ignored;
    hs->socket.close(ignored); // its pending operation completes with operation_aborted
    hs->resolver.cancel();
  });
}

void context_impl::finish(const handshake_ptr& hs) {
  hs->finished = true;
  hs->timer.cancel();
  if (!hs->outbound)
    --inbound_handshakes_;
  handshakes_.erase(hs);
}

std::string context_impl::timeout_text(const handshake_ptr& hs, const char* what) const {
  return std::string("timed out ") + what + " (" +
         ms_text(hs->outbound ? std::min(opts_.handshake_timeout, opts_.connect_timeout)
                              : opts_.handshake_timeout) +
         ")";
}

void context_impl::read_frame(const handshake_ptr& hs, const char* what, frame_handler then) {
  auto on_error = [this, hs, what](const error_code& ec, std::size_t got, std::size_t want,
                                   const char* part) {
    if (hs->timed_out)
      return timeout_text(hs, ("waiting for the " + std::string(what) + "'s " + part).c_str());
    if (ec == asio::error::eof)
      return "truncated " + std::string(what) + ": the connection ended after " +
             std::to_string(got) + " of " + std::to_string(want) + " bytes of its " + part;
    return "read of the " + std::string(what) + "'s " + part + " failed after " +
           std::to_string(got) + " of " + std::to_string(want) + " bytes: " + ec.message();
  };
  asio::async_read(hs->socket, asio::buffer(hs->prefix),
                   [this, hs, what, then = std::move(then), on_error](const error_code& ec,
                                                                      std::size_t n) mutable {
                     if (closing_)
                       return;
                     if (ec)
                       return then(on_error(ec, n, wire::prefix_bytes, "length prefix"));
                     uint32_t length = 0;
                     if (auto why = wire::decode_length(hs->prefix, length); !why.empty())
                       return then("malformed " + std::string(what) + ": " + why);
                     hs->body.resize(length); // bounded by decode_length
                     asio::async_read(hs->socket, asio::buffer(hs->body),
                                      [this, hs, then = std::move(then),
                                       on_error](const error_code& ec, std::size_t n) {
                                        if (closing_)
                                          return;
                                        if (ec)
                                          return then(on_error(ec, n, hs->body.size(), "header"));
                                        then({});
                                      });
                   });
}

void context_impl::read_hello(const handshake_ptr& hs, hello_handler then) {
  read_frame(hs, "hello", [hs, then = std::move(then)](const std::string& error) {
    if (!error.empty())
      return then(error, {});
    wire::hello h;
    if (auto why = wire::decode_hello(hs->body, h); !why.empty())
      return then("malformed hello: " + why, {});
    then({}, h);
  });
}

void context_impl::read_auth(const handshake_ptr& hs) {
  read_frame(hs, "authentication frame", [this, hs](const std::string& error) {
    if (!error.empty())
      return refuse(hs, "no valid authentication frame after the hellos: " + error);
    wire::auth a;
    if (auto why = wire::decode_auth(hs->body, a); !why.empty())
      return refuse(hs, "malformed authentication frame: " + why);
    auto rank = std::to_string(hs->peer);
    if (a.version != wire::protocol_version)
      return refuse(hs, "its authentication frame has protocol version " +
                            std::to_string(a.version) + ", expected " +
                            std::to_string(wire::protocol_version));
    if (!a.refusal.empty()) {
      // Text from a peer that proved nothing: printable ASCII only in our log (bounded by wire).
      for (auto& c : a.refusal)
        if (c < 0x20 || c > 0x7e)
          c = '?';
      return refuse(hs, "authentication failed: rank " + rank +
                            " did not accept this rank's proof of the shared secret (it says: " +
                            a.refusal + ")");
    }
    auto t = mesh_transcript("connector", hs->peer, opts_.rank, hs->peer_nonce, hs->my_nonce);
    if (!t.verify(opts_.secret, a.proof))
      return refuse(hs, "authentication failed: the proof of rank " + rank +
                            " does not match the shared secret (a different secret, or a "
                            "handshake replayed from another connection)");
    if (claimed_[hs->peer])
      return refuse(hs, "its hello is of rank " + rank + ", which is already connected");
    claimed_[hs->peer] = hs->claimed = true;
    connected(hs);
  });
}

// -- accepting -----------------------------------------------------------------------------------

void context_impl::accept_next() {
  if (closing_)
    return;
  auto hs = std::make_shared<handshake>(io_);
  acceptor_.async_accept(hs->socket, [this, hs](const error_code& ec) {
    if (closing_ || ec == asio::error::operation_aborted)
      return;
    if (ec) {
      // Out of descriptors and the like: log, and keep accepting after a pause.
      env_->log_line("accept failed: " + ec.message());
      auto& timer = *retry_timers_[opts_.rank];
      timer.expires_after(std::chrono::milliseconds(50));
      timer.async_wait([this](const error_code& ec) {
        if (!ec)
          accept_next();
      });
      return;
    }
    accept_next();
    on_accepted(hs);
  });
}

void context_impl::on_accepted(const handshake_ptr& hs) {
  error_code ec;
  auto remote = hs->socket.remote_endpoint(ec);
  hs->address = ec ? std::string{"an unknown address"} : endpoint_text(remote);
  if (inbound_handshakes_ >= max_pending_handshakes) {
    env_->log_line("refused a connection from " + hs->address + ": " +
                   std::to_string(inbound_handshakes_) +
                   " connections are already in their handshake");
    error_code ignored;
    hs->socket.close(ignored);
    return;
  }
  ++inbound_handshakes_;
  handshakes_.insert(hs);
  apply_socket_options(hs->socket);
  arm_timer(hs, clock::now() + opts_.handshake_timeout);
  read_hello(hs, [this, hs](const std::string& error, const wire::hello& h) {
    if (!error.empty())
      return refuse(hs, error);
    auto why = check_hello(h);
    if (why.empty()) {
      auto rank = static_cast<int>(h.rank);
      if (rank == opts_.rank)
        why = "its hello claims this rank (" + std::to_string(rank) + ")";
      else if (rank < opts_.rank)
        why = "its hello is of rank " + std::to_string(rank) + ", which this rank connects to (" +
              "only higher ranks connect to rank " + std::to_string(opts_.rank) + ")";
      else if (opts_.secret.empty() && claimed_[rank])
        // With a secret this is checked after the peer proved it: a client that cannot prove it
        // learns nothing of which ranks are connected, and cannot hold a rank's place.
        why = "its hello is of rank " + std::to_string(rank) + ", which is already connected";
    }
    if (!why.empty())
      return refuse(hs, why);
    hs->peer = static_cast<int>(h.rank);
    reply_hello(hs, h);
  });
}

void context_impl::reply_hello(const handshake_ptr& hs, const wire::hello& h) {
  auto reply = my_hello();
  // A mismatch of having a secret is answered with our hello before the refusal, so that the
  // connector can tell why (our hello has a nonce exactly when we have a secret).
  auto refusal = check_auth_mode(h, "rank");
  if (!opts_.secret.empty()) {
    reply.nonce = hs->my_nonce = auth::random_bytes(auth::nonce_bytes);
    if (refusal.empty()) {
      hs->peer_nonce = h.nonce;
      auto proof = mesh_transcript("acceptor", hs->peer, opts_.rank, hs->peer_nonce, hs->my_nonce)
                       .sign(opts_.secret);
      reply.auth_proof.assign(proof.begin(), proof.end());
    }
  } else if (refusal.empty()) {
    // Without a secret the hello is all there is: the rank is taken now.
    claimed_[hs->peer] = hs->claimed = true;
  }
  hs->out = wire::encode_hello(reply);
  asio::async_write(
      hs->socket, asio::buffer(hs->out), [this, hs, refusal](const error_code& ec, std::size_t n) {
        if (closing_)
          return;
        if (ec) {
          if (hs->claimed)
            claimed_[hs->peer] = false;
          return refuse(hs, hs->timed_out
                                ? timeout_text(hs, "writing the reply hello")
                                : "writing the reply hello failed after " + std::to_string(n) +
                                      " of " + std::to_string(hs->out.size()) +
                                      " bytes: " + ec.message());
        }
        if (!refusal.empty())
          return refuse(hs, refusal);
        if (opts_.secret.empty())
          return connected(hs);
        read_auth(hs);
      });
}

void context_impl::refuse(const handshake_ptr& hs, const std::string& why) {
  if (hs->finished)
    return;
  finish(hs);
  error_code ignored;
  hs->socket.close(ignored);
  env_->log_line("refused the connection from " + hs->address + ": " + why);
  std::lock_guard lock(mesh_mu_);
  last_refusal_ = hs->address + ": " + why;
}

// -- connecting ----------------------------------------------------------------------------------

void context_impl::start_connect(int peer, std::chrono::milliseconds backoff) {
  if (closing_ || mesh_done_)
    return;
  auto hs = std::make_shared<handshake>(io_);
  hs->outbound = true;
  hs->peer = peer;
  hs->address = addresses_[peer];
  handshakes_.insert(hs);
  arm_timer(hs, std::min(mesh_deadline_, clock::now() + opts_.handshake_timeout));
  host_port hp;
  split_address(hs->address, hp); // checked by connect
  hs->resolver.async_resolve(
      hp.host, hp.port, asio_tcp::resolver::numeric_service,
      [this, hs, backoff](const error_code& ec, asio_tcp::resolver::results_type results) {
        if (closing_)
          return;
        if (ec || results.empty())
          return attempt_failed(hs,
                                hs->timed_out
                                    ? timeout_text(hs, "resolving the address")
                                    : "resolve: " + (ec ? ec.message() : std::string{"no address"}),
                                backoff);
        hs->endpoints = std::move(results);
        hs->next_endpoint = 0;
        connect_next_endpoint(hs, backoff);
      });
}

void context_impl::connect_next_endpoint(const handshake_ptr& hs,
                                         std::chrono::milliseconds backoff) {
  auto it = hs->endpoints.begin();
  std::advance(it, static_cast<std::ptrdiff_t>(hs->next_endpoint++));
  auto ep = it->endpoint();
  error_code ec;
  hs->socket.close(ec);
  if (hs->socket.open(ep.protocol(), ec); ec)
    return attempt_failed(hs, "socket: " + ec.message(), backoff);
  // Buffer sizes before connect, so that the window scale of the connection fits them.
  apply_socket_options(hs->socket);
  hs->socket.async_connect(ep, [this, hs, backoff, ep](error_code ec) {
    if (closing_)
      return;
    error_code local_ec;
    if (!ec && hs->socket.local_endpoint(local_ec) == ep && !local_ec)
      // Nobody listens at a port of the ephemeral range, and the kernel gave that very port as
      // the source: a TCP self-connect. It stands for a refusal.
      ec = asio::error::connection_refused;
    if (!ec)
      return on_connected(hs, backoff);
    if (!hs->timed_out && hs->next_endpoint < static_cast<std::size_t>(std::distance(
                                                  hs->endpoints.begin(), hs->endpoints.end())))
      return connect_next_endpoint(hs, backoff);
    attempt_failed(hs, hs->timed_out ? timeout_text(hs, "connecting") : "connect: " + ec.message(),
                   backoff);
  });
}

void context_impl::on_connected(const handshake_ptr& hs, std::chrono::milliseconds backoff) {
  auto hello = my_hello();
  if (!opts_.secret.empty())
    hello.nonce = hs->my_nonce = auth::random_bytes(auth::nonce_bytes);
  hs->out = wire::encode_hello(hello);
  asio::async_write(
      hs->socket, asio::buffer(hs->out), [this, hs, backoff](const error_code& ec, std::size_t n) {
        if (closing_)
          return;
        if (ec)
          return attempt_failed(
              hs,
              hs->timed_out ? timeout_text(hs, "writing the hello")
                            : "writing the hello failed after " + std::to_string(n) + " of " +
                                  std::to_string(hs->out.size()) + " bytes: " + ec.message(),
              backoff);
        read_hello(hs, [this, hs, backoff](const std::string& error, const wire::hello& h) {
          // A peer that refuses us closes the connection: an error here is worth a retry (the
          // peer may be a previous incarnation on its way out); a wrong hello is not.
          if (!error.empty())
            return attempt_failed(hs, "no valid hello in reply: " + error, backoff);
          on_reply_hello(hs, h, backoff);
        });
      });
}

void context_impl::on_reply_hello(const handshake_ptr& hs, const wire::hello& h,
                                  std::chrono::milliseconds backoff) {
  auto peer = std::to_string(hs->peer);
  auto why = check_hello(h);
  if (why.empty() && static_cast<int>(h.rank) != hs->peer)
    why = "its hello is of rank " + std::to_string(h.rank) + ", expected rank " + peer;
  if (!why.empty())
    return mesh_refused(hs, "the peer at " + hs->address + " is not rank " + peer +
                                " of this group: " + why);
  if (auto mode = check_auth_mode(h, "rank"); !mode.empty())
    return mesh_refused(hs, "rank " + peer + " at " + hs->address + " was refused: " + mode);
  if (opts_.secret.empty())
    return connected(hs);
  auto t = mesh_transcript("acceptor", opts_.rank, hs->peer, hs->my_nonce, h.nonce);
  if (!t.verify(opts_.secret, h.auth_proof)) {
    // Prove nothing to a peer that has not proven itself: say why instead, then close.
    auto text = "rank " + peer + " at " + hs->address +
                " was refused: authentication failed: its proof of the shared secret does not "
                "match (a different secret, or it is not rank " +
                peer + " of this group)";
    wire::auth a;
    a.refusal = "rank " + std::to_string(opts_.rank) +
                " found that your proof does not match its shared secret (are the secrets the "
                "same?)";
    hs->out = wire::encode_auth(a);
    asio::async_write(hs->socket, asio::buffer(hs->out),
                      [this, hs, text](const error_code&, std::size_t) {
                        if (!closing_)
                          mesh_refused(hs, text);
                      });
    return;
  }
  wire::auth a;
  auto proof =
      mesh_transcript("connector", opts_.rank, hs->peer, hs->my_nonce, h.nonce).sign(opts_.secret);
  a.proof.assign(proof.begin(), proof.end());
  hs->out = wire::encode_auth(a);
  asio::async_write(
      hs->socket, asio::buffer(hs->out), [this, hs, backoff](const error_code& ec, std::size_t n) {
        if (closing_)
          return;
        if (ec)
          return attempt_failed(hs,
                                hs->timed_out ? timeout_text(hs, "writing the authentication frame")
                                              : "writing the authentication frame failed after " +
                                                    std::to_string(n) + " of " +
                                                    std::to_string(hs->out.size()) +
                                                    " bytes: " + ec.message(),
                                backoff);
        connected(hs);
      });
}

void context_impl::mesh_refused(const handshake_ptr& hs, const std::string& text) {
  if (hs->finished)
    return;
  finish(hs);
  error_code ignored;
  hs->socket.close(ignored);
  env_->log_line(text);
  {
    std::lock_guard lock(mesh_mu_);
    if (!mesh_failure_)
      mesh_failure_ = make_caf_error(errc::peer_lost, "rank " + std::to_string(opts_.rank) +
                                                          " cannot form its mesh: " + text);
  }
  mesh_cv_.notify_all();
}

void context_impl::attempt_failed(const handshake_ptr& hs, const std::string& why,
                                  std::chrono::milliseconds backoff) {
  if (hs->finished)
    return;
  finish(hs);
  error_code ignored;
  hs->socket.close(ignored);
  auto peer = hs->peer;
  {
    std::lock_guard lock(mesh_mu_);
    // An attempt cut off by the deadline says little on its own: keep what the attempt before
    // it learned (e.g. "refused"), which is usually why the peer is missing.
    auto& last = last_error_[peer];
    if (hs->timed_out && !last.empty() && last.rfind("timed out", 0) != 0)
      last = why + " (the attempt before: " + last + ")";
    else
      last = why;
  }
  if (closing_ || mesh_done_ || clock::now() + backoff >= mesh_deadline_)
    return;
  if (!warned_[peer]) {
    // Once per peer: peers start at different times, so a refused first attempt is common.
    warned_[peer] = true;
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(mesh_deadline_ - clock::now());
    env_->log_line("cannot reach rank " + std::to_string(peer) + " at " + hs->address + " yet (" +
                   why + "); retrying for up to " + ms_text(left));
  }
  auto& timer = *retry_timers_[peer];
  timer.expires_after(backoff);
  timer.async_wait([this, peer, backoff](const error_code& ec) {
    if (!ec)
      start_connect(peer, std::min(backoff * 2, max_backoff));
  });
}

void context_impl::connected(const handshake_ptr& hs) {
  finish(hs);
  auto peer = hs->peer;
  pairs_[peer]->open(std::move(hs->socket), hs->address);
  {
    std::lock_guard lock(mesh_mu_);
    if (!connected_[peer]) {
      connected_[peer] = true;
      --missing_;
    }
  }
  mesh_cv_.notify_all();
}

// -- factories -----------------------------------------------------------------------------------

caf::expected<std::shared_ptr<context>> listen(const mesh_options& opts) {
  return listen(opts, test_hooks{});
}

caf::expected<std::shared_ptr<context>> listen(const mesh_options& opts, test_hooks hooks) {
  auto bad = [](const std::string& why) {
    return make_caf_error(errc::invalid_argument, "tcp::listen: " + why);
  };
  if (opts.size < 1)
    return bad("size " + std::to_string(opts.size) + " is not positive");
  if (opts.rank < 0 || opts.rank >= opts.size)
    return bad("rank " + std::to_string(opts.rank) + " is outside [0, " +
               std::to_string(opts.size) + ")");
  if (!opts.addresses.empty() && opts.addresses.size() != static_cast<std::size_t>(opts.size))
    return bad(std::to_string(opts.addresses.size()) + " addresses for a group of " +
               std::to_string(opts.size));
  if (opts.listen_address.empty() && opts.addresses.empty())
    return bad("neither listen_address nor addresses is set");
  if (opts.max_payload_bytes == 0)
    return bad("max_payload_bytes is 0");
  if (opts.connect_timeout.count() <= 0 || opts.handshake_timeout.count() <= 0)
    return bad("connect_timeout and handshake_timeout must be positive");
  auto ctx = std::make_shared<context_impl>(opts, std::move(hooks));
  if (auto err = ctx->start())
    return err;
  return std::shared_ptr<context>(std::move(ctx));
}

caf::expected<std::shared_ptr<context>> connect_mesh(const mesh_options& opts) {
  auto ctx = listen(opts);
  if (!ctx)
    return ctx;
  if (auto err = (*ctx)->connect(opts.addresses))
    return err;
  return ctx;
}

} // namespace consort::transport::tcp
