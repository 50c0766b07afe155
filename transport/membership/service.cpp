// The membership service (see include/consort/transport/membership.hpp): the options' checks,
// starting and stopping the I/O thread, and the calls from callers' threads. The rest of
// `service::impl` is in core.cpp, chief.cpp and worker.cpp (see service_impl.hpp).

#include "transport/membership/service_impl.hpp"
#include "transport/membership/test_access.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>

#include <boost/asio/post.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>

namespace consort::transport::membership {

namespace {

/// The longest period of the tick that enforces every deadline.
constexpr milliseconds max_tick{50};

/// The longest a graceful close (leave, refusal) waits for the peer to close its side.
constexpr milliseconds max_linger{2000};

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
  if (!opts.cluster.empty())
    for (std::size_t i = 0; i < opts.tasks.size(); ++i) {
      const auto& jobs = opts.cluster.as_dict();
      auto job = jobs.find(opts.tasks[i].type);
      if (job == jobs.end() || job->second.count(opts.tasks[i].index) == 0)
        return "options.tasks[" + std::to_string(i) + "] is " + to_string(opts.tasks[i]) +
               ", which options.cluster " + cluster_check::bounded(opts.cluster.to_json(), 1024) +
               " does not list (expected the cluster the tasks come from)";
    }
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
  for (auto [name, value] :
       {named{"rendezvous_timeout", opts.rendezvous_timeout},
        named{"missing_log_interval", opts.missing_log_interval},
        named{"handshake_timeout", opts.handshake_timeout},
        named{"heartbeat_interval", opts.heartbeat_interval},
        named{"peer_timeout", opts.peer_timeout}, named{"reform_timeout", opts.reform_timeout}})
    if (value.count() <= 0)
      return std::string("options.") + name + " is " + ms_text(value) + " (expected > 0)";
  if (opts.elastic_min_members < 0 ||
      static_cast<std::size_t>(opts.elastic_min_members) > opts.tasks.size())
    return "options.elastic_min_members is " + std::to_string(opts.elastic_min_members) +
           " (expected 0, not elastic, or 1 to the number of tasks, " +
           std::to_string(opts.tasks.size()) + ")";
  if (opts.max_message_bytes < 1024 || opts.max_message_bytes > (std::size_t{1} << 31))
    return "options.max_message_bytes is " + std::to_string(opts.max_message_bytes) +
           " (expected 1024 to 2^31)";
  return {};
}

} // namespace

// -- construction and destruction ----------------------------------------------------------------

service::impl::impl(options opts)
    : opts_(std::move(opts)), chief_(opts_.rank == 0), acceptor_(io_), standby_(io_),
      former_chief_(io_), tick_timer_(io_), retry_timer_(io_), resolver_(io_) {
  self_ = to_string(opts_.tasks[opts_.rank]) + " (rank " + std::to_string(opts_.rank) + ")";
  reference_clock_ = chief_;
  first_chief_address_ = opts_.chief_address;
  cluster_ = cluster_check::of(opts_);
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
  standby_.close(ignored);
  former_chief_.close(ignored);
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

/// Opens `acceptor` listening at `ep` (SO_REUSEADDR: a restarted task binds its port again at
/// once). On failure, `step` names the call that failed.
error_code service::impl::listen_at(asio_tcp::acceptor& acceptor, const asio_tcp::endpoint& ep,
                                    const char*& step) {
  error_code ec;
  step = "socket";
  if (acceptor.open(ep.protocol(), ec); ec)
    return ec;
  step = "setsockopt(SO_REUSEADDR)";
  if (acceptor.set_option(asio_tcp::acceptor::reuse_address(true), ec); ec)
    return ec;
  step = "bind";
  if (acceptor.bind(ep, ec); ec)
    return ec;
  step = "listen";
  acceptor.listen(asio::socket_base::max_listen_connections, ec);
  return ec;
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
    const char* step = "";
    if (ec = listen_at(acceptor_, results.begin()->endpoint(), step); ec)
      return fail(step, ec);
    auto local = acceptor_.local_endpoint(ec);
    if (ec)
      return fail("getsockname", ec);
    listen_address_ = endpoint_text(local);
  }
  if (!chief_ && opts_.elastic_min_members > 0 && !opts_.address.empty()) {
    // Where this member leads the group if it succeeds a lost chief: bound now, so that the
    // others know it from the view; accepted from only once it does (promote).
    host_port own;
    split_address(opts_.address, own); // checked by check_options
    error_code ec;
    asio_tcp::resolver resolver(io_);
    auto results = resolver.resolve(
        own.host, "0", asio_tcp::resolver::passive | asio_tcp::resolver::numeric_service, ec);
    if (!ec && !results.empty()) {
      const char* step = "";
      ec = listen_at(standby_, results.begin()->endpoint(), step);
      if (!ec)
        standby_address_ = endpoint_text(standby_.local_endpoint(ec));
    }
    if (ec || results.empty())
      return make_caf_error(errc::invalid_argument,
                            self_ + " cannot listen on " + own.host +
                                " for leading an elastic group after a lost chief: " +
                                (ec ? ec.message() : std::string{"the host has no address"}));
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

caf::expected<view> service::impl::next_view(uint64_t after, const std::string& address,
                                             clock::time_point until) {
  if (!elastic())
    return make_caf_error(errc::invalid_argument, self_ + ": next_view needs an elastic group "
                                                          "(options.elastic_min_members >= 1)");
  host_port hp;
  if (auto why = split_address(address, hp); !why.empty())
    return make_caf_error(errc::invalid_argument,
                          self_ + ": next_view: the next epoch's collective address: " + why);
  if (address.size() > codec::max_field_bytes)
    return make_caf_error(errc::invalid_argument,
                          self_ + ": next_view: the address is longer than " +
                              std::to_string(codec::max_field_bytes) + " bytes");
  {
    std::lock_guard lock(mu_);
    if (!latest_ && !outcome_)
      return make_caf_error(errc::invalid_argument,
                            self_ + ": next_view before the rendezvous formed the first view");
  }
  asio::post(io_, [this, after, address] { offer(after, address); });
  std::unique_lock lock(mu_);
  auto ready = [&] {
    return (latest_ && latest_->epoch > after) || group_error_ || leave_called_ || stopped_;
  };
  if (!cv_.wait_until(lock, until, ready))
    return make_caf_error(errc::collective_timeout,
                          self_ + ": no view of an epoch after " + std::to_string(after) +
                              " arrived in time (the chief re-forms the group once every "
                              "member offered its part, or reform_timeout passed)");
  if (latest_ && latest_->epoch > after)
    return *latest_;
  if (group_error_)
    return group_error_;
  return make_caf_error(errc::shutdown, self_ + " left the cluster");
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
  if (suspended_)
    return; // it sends nothing, so nothing can come of waiting (membership.hpp, suspend)
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

void service::impl::check_deadlines() {
  if (stopped_)
    return;
  if (std::this_thread::get_id() == thread_.get_id())
    return tick();
  auto ran = std::make_shared<std::promise<void>>();
  auto done = ran->get_future();
  asio::post(io_, [this, ran] {
    if (!stopped_)
      tick();
    ran->set_value();
  });
  // Bounded: a service stopped meanwhile never runs the handler.
  done.wait_for(milliseconds{2000});
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

clock_offset service::chief_clock_offset() const {
  return impl_->chief_clock_offset();
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

caf::expected<view> service::next_view(uint64_t after, const std::string& address,
                                       std::chrono::steady_clock::time_point until) {
  return impl_->next_view(after, address, until);
}

void service_test_access::suspend(service& s) {
  s.impl_->suspend();
}

void service_test_access::check_deadlines(service& s) {
  s.impl_->check_deadlines();
}

void service_test_access::set_host_probe(service& s,
                                         std::function<host_process(uint32_t pid)> probe) {
  s.impl_->set_host_probe(std::move(probe));
}

void service_test_access::crash(service& s) {
  s.impl_->crash();
}

} // namespace consort::transport::membership
