// Tests of cluster membership: every member in one process over loopback, one service per rank,
// the chief on an ephemeral port; raw sockets play broken or hostile peers. Nothing sleeps: every
// wait is on a future, a loss event or a log line, with a deadline.

#include "transport/membership/cluster_check.hpp" // the digest of a cluster, for raw Joins
#include "transport/membership/codec.hpp"         // to craft messages for the raw peers
#include "transport/membership/test_access.hpp"

#include "support/time_scale.hpp"
#include "support/transport_helpers.hpp"

#include <consort/error.hpp>
#include <consort/transport/membership.hpp>

#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/message.hpp>

#include <utility> // Boost 1.74's Asio needs <utility> before it on C++20

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace {

using namespace std::chrono_literals;
using consort::errc;
using consort::test::has_error;
using consort::test::log_capture;
using consort::test::text_of;
namespace membership = consort::transport::membership;
namespace codec = consort::transport::membership::codec;
namespace cluster_check = consort::transport::membership::cluster_check;
namespace asio = boost::asio;
using bytes = std::vector<std::byte>;
using clock_type = std::chrono::steady_clock;
using std::chrono::milliseconds;

// -- errors --------------------------------------------------------------------------------------

::testing::AssertionResult has_error(const caf::expected<membership::view>& result, errc code,
                                     const std::vector<std::string>& fragments) {
  if (result)
    return ::testing::AssertionFailure()
           << "a view (expected errc::" << consort::to_string(code) << ")";
  return has_error(result.error(), code, fragments);
}

// -- logs and losses -----------------------------------------------------------------------------

/// Collects the loss events of one service; must outlive it.
class loss_recorder {
public:
  std::function<void(const membership::lost_event&)> sink() {
    return [this](const membership::lost_event& e) {
      std::lock_guard lock(mu_);
      events_.push_back(e);
      cv_.notify_all();
    };
  }

  /// Waits up to `timeout` for an event that names `rank`; returns it, or nothing.
  std::optional<membership::lost_event> wait_for(int rank, milliseconds timeout = 10s) {
    std::unique_lock lock(mu_);
    std::optional<membership::lost_event> found;
    cv_.wait_for(lock, timeout, [&] {
      for (const auto& e : events_)
        if (std::find(e.ranks.begin(), e.ranks.end(), rank) != e.ranks.end()) {
          found = e;
          return true;
        }
      return false;
    });
    return found;
  }

  std::vector<membership::lost_event> events() {
    std::lock_guard lock(mu_);
    return events_;
  }

private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<membership::lost_event> events_;
};

std::string describe(const std::vector<membership::lost_event>& events) {
  std::string out;
  for (const auto& e : events) {
    // Appended piece by piece: GCC 12 warns (-Wrestrict) about " " + std::to_string(r).
    out += "{ranks:";
    for (auto r : e.ranks) {
      out += ' ';
      out += std::to_string(r);
    }
    out += "; ";
    out += e.cause;
    out += "} ";
  }
  return out.empty() ? "no events" : out;
}

// -- options and clusters ------------------------------------------------------------------------

bytes pattern(std::size_t size, unsigned seed) {
  bytes out(size);
  for (std::size_t i = 0; i < size; ++i)
    out[i] = static_cast<std::byte>((i * 31 + seed * 7 + 1) & 0xff);
  return out;
}

/// Options of rank `rank` of a cluster of `n` workers (worker:0 ... worker:n-1), with timeouts
/// short enough for tests.
membership::options options_for(int n, int rank, std::string chief_address, log_capture* logs) {
  membership::options opts;
  for (int i = 0; i < n; ++i)
    opts.tasks.push_back({"worker", i});
  opts.rank = rank;
  opts.chief_address = std::move(chief_address);
  opts.address = "127.0.0.1:" + std::to_string(21000 + rank);
  opts.devices = {{"CPU:0", false, uint64_t{1} << 30}};
  opts.rendezvous_timeout = 10s;
  opts.missing_log_interval = 100ms;
  opts.handshake_timeout = 2s;
  opts.heartbeat_interval = 50ms;
  opts.peer_timeout = 500ms;
  if (rank == 0)
    opts.nccl_unique_id = pattern(128, 3);
  if (logs)
    opts.log = logs->sink();
  return opts;
}

std::unique_ptr<membership::service> start_ok(membership::options opts) {
  auto svc = membership::service::start(std::move(opts));
  EXPECT_TRUE(svc) << text_of(svc.error());
  return svc ? std::move(*svc) : nullptr;
}

/// A port of 127.0.0.1 that nothing listens on (bound then released).
uint16_t free_port() {
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  return acceptor.local_endpoint().port();
}

// -- virtual time --------------------------------------------------------------------------------

/// A clock the test moves (`membership::options::clock`); it starts at the steady clock's now
/// and stands still until moved. Must outlive the services that read it.
class manual_clock {
public:
  std::function<clock_type::time_point()> function() {
    return [this] {
      return now();
    };
  }

  clock_type::time_point now() const {
    return clock_type::time_point(clock_type::duration(ticks_.load()));
  }

  /// Moves the clock by `by` in steps of `step`, running the deadline checks of every service
  /// after each step (in order), so that heartbeats keep flowing between the healthy members
  /// and whatever falls due happens at the step it falls due in.
  void advance(milliseconds by, milliseconds step,
               const std::vector<membership::service*>& services) {
    for (milliseconds done{0}; done < by; done += step) {
      ticks_ += clock_type::duration(std::min(step, by - done)).count();
      for (auto* s : services)
        if (s)
          membership::service_test_access::check_deadlines(*s);
    }
  }

private:
  std::atomic<clock_type::rep> ticks_{clock_type::now().time_since_epoch().count()};
};

/// Whether a cluster's deadlines run on real time or on its manual clock.
enum class timing { real, manual };

/// A cluster of `n` services in this process. Members are destroyed before the captures and
/// the clock.
struct cluster {
  explicit cluster(int n, const std::function<void(membership::options&)>& tweak = {},
                   timing t = timing::real) {
    for (int r = 0; r < n; ++r)
      lost.push_back(std::make_unique<loss_recorder>());
    auto configure = [&](membership::options& opts) {
      if (t == timing::manual)
        opts.clock = clock.function();
      if (tweak)
        tweak(opts);
    };
    auto chief_opts = options_for(n, 0, "127.0.0.1:0", &logs);
    configure(chief_opts);
    services.push_back(start_ok(chief_opts));
    if (!services[0])
      return;
    chief_address = services[0]->listen_address();
    for (int r = 1; r < n; ++r) {
      auto opts = options_for(n, r, chief_address, &logs);
      configure(opts);
      services.push_back(start_ok(opts));
    }
    for (int r = 0; r < n; ++r)
      if (services[r])
        services[r]->on_lost(lost[r]->sink());
  }

  /// Runs every member's rendezvous at once; the results by rank.
  std::vector<caf::expected<membership::view>> rendezvous_all() {
    std::vector<std::future<caf::expected<membership::view>>> futures;
    for (auto& svc : services)
      futures.push_back(std::async(std::launch::async, [&svc] { return svc->rendezvous(); }));
    std::vector<caf::expected<membership::view>> out;
    for (auto& f : futures)
      out.push_back(f.get());
    return out;
  }

  /// rendezvous_all, expecting success everywhere.
  bool form() {
    auto views = rendezvous_all();
    for (std::size_t r = 0; r < views.size(); ++r)
      if (!views[r]) {
        ADD_FAILURE() << "rank " << r << ": " << text_of(views[r].error()) << "\nlog:\n"
                      << logs.all();
        return false;
      }
    return true;
  }

  /// Moves the manual clock by `by`, in steps of the heartbeat interval (see manual_clock).
  void advance(milliseconds by) {
    std::vector<membership::service*> all;
    for (auto& svc : services)
      all.push_back(svc.get());
    clock.advance(by, 50ms, all);
  }

  manual_clock clock;
  log_capture logs;
  std::vector<std::unique_ptr<loss_recorder>> lost;
  std::string chief_address;
  std::vector<std::unique_ptr<membership::service>> services;
};

/// Moves `clock` in steps of 50 ms, running the deadline checks of `services`, until `done`
/// holds, at most by `limit`; returns how far it moved. Only for waits whose end is a deadline:
/// while it moves, real events (connections, frames) race with the clock.
milliseconds advance_until(manual_clock& clock, const std::vector<membership::service*>& services,
                           const std::function<bool()>& done, milliseconds limit = 60s) {
  milliseconds moved{0};
  while (!done() && moved < limit) {
    clock.advance(50ms, 50ms, services);
    moved += 50ms;
  }
  return moved;
}

template <class T>
bool ready(const std::future<T>& f) {
  return f.wait_for(0s) == std::future_status::ready;
}

// -- raw peers -----------------------------------------------------------------------------------

/// A plain socket that plays a broken, hostile or hand-made peer of the chief.
class raw_peer : public consort::test::raw_socket {
public:
  explicit raw_peer(const std::string& address) : raw_socket(address) {}

  /// Reads one message; false when none arrives or it is malformed.
  bool read(codec::message& out, milliseconds timeout = 10s) {
    std::byte prefix[codec::prefix_bytes];
    if (!read_exact(prefix, timeout))
      return false;
    uint32_t length = 0;
    if (!codec::decode_length(std::span<const std::byte, 4>(prefix, 4), 1 << 20, length).empty())
      return false;
    bytes body(length);
    return read_exact(body, timeout) && codec::decode(body, 1 << 20, out).empty();
  }
};

// -- the codec -----------------------------------------------------------------------------------

codec::message round_trip(const codec::message& m, std::size_t max = 1 << 20) {
  auto frame = codec::encode(m);
  uint32_t length = 0;
  EXPECT_EQ(codec::decode_length(std::span<const std::byte, 4>(frame.data(), 4), max, length), "");
  EXPECT_EQ(length + codec::prefix_bytes, frame.size());
  codec::message out;
  EXPECT_EQ(codec::decode(std::span(frame).subspan(codec::prefix_bytes), max, out), "");
  return out;
}

TEST(MembershipCodecTest, EveryMessageRoundTripsThroughItsEncoding) {
  codec::join j;
  j.task = {"worker", 3};
  j.address = "10.0.0.4:7000";
  j.devices = {{"GPU:0", true, 80}, {"GPU:1", true, 81}};
  j.version = 7;
  j.nonce = pattern(32, 1);
  j.auth_proof = pattern(32, 2);
  j.pid = 4242;
  j.cluster_digest = 0x0123456789abcdefull;
  j.cluster = "[worker:0=10.0.0.1:7000, worker:3=10.0.0.4:7000]";
  j.sent_ns = 1'700'000'000'123'456'789;
  auto out = std::get<codec::join>(round_trip(j));
  EXPECT_EQ(out.task, j.task);
  EXPECT_EQ(out.address, j.address);
  EXPECT_EQ(out.devices, j.devices);
  EXPECT_EQ(out.version, 7);
  EXPECT_EQ(out.nonce, j.nonce);
  EXPECT_EQ(out.auth_proof, j.auth_proof);
  EXPECT_EQ(out.pid, 4242u);
  EXPECT_EQ(out.cluster_digest, j.cluster_digest);
  EXPECT_EQ(out.cluster, j.cluster);
  EXPECT_EQ(out.sent_ns, j.sent_ns);

  codec::view_message v;
  v.view.epoch = 3;
  v.view.group_id = 99;
  for (int r = 0; r < 2; ++r) {
    membership::member m;
    m.rank = r;
    m.task = consort::task_id{r == 0 ? "chief" : "worker", 0};
    m.address = "host" + std::to_string(r) + ":7000";
    m.devices.push_back(membership::device_info{"CPU:0", false, static_cast<uint64_t>(r)});
    m.standby_address = r == 0 ? "" : "host1:7001";
    m.pid = 4000000000u + static_cast<uint32_t>(r); // the whole range of a pid
    v.view.members.push_back(m);
  }
  v.view.nccl_unique_id = pattern(128, 4);
  v.auth_proof = pattern(32, 5);
  v.sent_ns = 30;
  v.join_sent_ns = 10;
  v.join_received_ns = -20; // another host's clock may be behind
  auto vout = std::get<codec::view_message>(round_trip(v));
  EXPECT_EQ(vout.view, v.view);
  EXPECT_EQ(vout.auth_proof, v.auth_proof);
  EXPECT_EQ(vout.sent_ns, 30);
  EXPECT_EQ(vout.join_sent_ns, 10);
  EXPECT_EQ(vout.join_received_ns, -20);

  auto a = std::get<codec::abort>(round_trip(codec::abort{2, "lost", {1, 3}}));
  EXPECT_EQ(a.epoch, 2u);
  EXPECT_EQ(a.cause, "lost");
  EXPECT_EQ(a.lost_ranks, (std::vector<uint32_t>{1, 3}));
  codec::refusal refusal;
  refusal.task = consort::task_id{"worker", 1};
  refusal.reason = "no";
  auto r = std::get<codec::refusal>(round_trip(refusal));
  EXPECT_EQ(r.task, refusal.task);
  EXPECT_EQ(r.reason, "no");
  auto h = std::get<codec::heartbeat>(round_trip(codec::heartbeat{1, 2, 3}));
  EXPECT_EQ(h.sequence, 3u);
  auto l = std::get<codec::leave>(round_trip(codec::leave{1, 2, "bye"}));
  EXPECT_EQ(l.reason, "bye");
  auto c = std::get<codec::challenge>(round_trip(codec::challenge{pattern(16, 6)}));
  EXPECT_EQ(c.nonce, pattern(16, 6));
}

TEST(MembershipCodecTest, LengthsOutsideTheBoundsAreRejectedBeforeAnyRead) {
  auto check = [](uint32_t v, std::size_t max) {
    std::byte b[4];
    for (int i = 0; i < 4; ++i)
      b[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
    uint32_t length = 0;
    return codec::decode_length(std::span<const std::byte, 4>(b, 4), max, length);
  };
  EXPECT_EQ(check(64, 1024), "");
  EXPECT_NE(check(8, 1024).find("outside [16, 1024]"), std::string::npos);
  EXPECT_NE(check(1032, 1024).find("outside [16, 1024]"), std::string::npos);
  EXPECT_NE(check(0xffffffffu, 1 << 20).find("4294967295"), std::string::npos);
  EXPECT_NE(check(20, 1024).find("not a multiple of 8"), std::string::npos);
}

TEST(MembershipCodecTest, GarbageAndOversizedFieldsAreMalformedNotFatal) {
  codec::message out;
  EXPECT_NE(codec::decode(bytes(64, std::byte{0xff}), 1024, out), "");
  EXPECT_NE(codec::decode(bytes(64, std::byte{0x00}), 1024, out), ""); // null root: no type set?
  codec::join j;
  j.task = {"worker", 1};
  j.address = std::string(5000, 'x');
  auto frame = codec::encode(j);
  auto why = codec::decode(std::span(frame).subspan(codec::prefix_bytes), 1 << 20, out);
  EXPECT_NE(why.find("address is 5000 bytes long"), std::string::npos) << why;
  // The traversal limit follows the frame limit: a message larger than the limit is refused.
  codec::join big;
  big.devices.assign(2000, membership::device_info{"GPU:0", true, 1});
  frame = codec::encode(big);
  EXPECT_NE(codec::decode(std::span(frame).subspan(codec::prefix_bytes), 1024, out), "");
  // Trailing bytes after the message.
  frame = codec::encode(codec::heartbeat{1, 2, 3});
  frame.resize(frame.size() + 8);
  EXPECT_NE(codec::decode(std::span(frame).subspan(codec::prefix_bytes), 1024, out)
                .find("trailing bytes"),
            std::string::npos);
}

// -- options -------------------------------------------------------------------------------------

TEST(MembershipTest, StartRejectsInvalidOptionsWithAClearReason) {
  struct bad {
    std::function<void(membership::options&)> change;
    std::string fragment;
  };
  std::vector<bad> cases = {
      {[](auto& o) { o.tasks.clear(); }, "options.tasks is empty"},
      {[](auto& o) { o.rank = 2; }, "options.rank 2 is outside [0, 2)"},
      {[](auto& o) { o.rank = -1; }, "options.rank -1 is outside [0, 2)"},
      {[](auto& o) { o.tasks[1] = o.tasks[0]; }, "lists worker:0 twice"},
      {[](auto& o) { o.tasks[1].type.clear(); }, "options.tasks[1]"},
      {[](auto& o) { o.chief_address = "nonsense"; }, "options.chief_address: \"nonsense\""},
      {[](auto& o) { o.chief_address = "127.0.0.1:99999"; }, "no valid port"},
      {[](auto& o) {
         o.rank = 1;
         o.chief_address = "127.0.0.1:0";
       },
       "has port 0"},
      {[](auto& o) { o.address.clear(); }, "options.address is empty"},
      {[](auto& o) { o.address = "host"; }, "options.address"},
      {[](auto& o) { o.peer_timeout = 0ms; }, "options.peer_timeout is 0 ms"},
      {[](auto& o) { o.max_message_bytes = 10; }, "options.max_message_bytes is 10"},
      {[](auto& o) { o.chief_address = "256.1.1.1:0"; }, "cannot serve membership on 256.1.1.1:0"},
      {[](auto& o) {
         o.cluster = consort::cluster_spec::dense({{"worker", {"a:1"}}});
       },
       "options.tasks[1] is worker:1, which options.cluster {\"worker\":[\"a:1\"]} does not list"},
  };
  for (const auto& c : cases) {
    auto opts = options_for(2, 0, "127.0.0.1:0", nullptr);
    c.change(opts);
    auto svc = membership::service::start(opts);
    ASSERT_FALSE(svc) << c.fragment;
    EXPECT_TRUE(has_error(svc.error(), errc::invalid_argument, {c.fragment}));
  }
}

// -- rendezvous ----------------------------------------------------------------------------------

TEST(MembershipTest, ChiefAloneFormsAViewOfItself) {
  log_capture logs;
  auto opts = options_for(1, 0, "127.0.0.1:0", &logs);
  auto chief = start_ok(opts);
  ASSERT_TRUE(chief);
  EXPECT_NE(chief->listen_address().find("127.0.0.1:"), std::string::npos);
  auto v = chief->rendezvous();
  ASSERT_TRUE(v) << text_of(v.error());
  EXPECT_EQ(v->epoch, 1u);
  EXPECT_NE(v->group_id, 0u);
  ASSERT_EQ(v->members.size(), 1u);
  EXPECT_EQ(v->members[0].rank, 0);
  EXPECT_EQ(v->members[0].task, (consort::task_id{"worker", 0}));
  EXPECT_EQ(v->members[0].address, opts.address);
  EXPECT_EQ(v->members[0].devices, opts.devices);
  EXPECT_EQ(v->nccl_unique_id, opts.nccl_unique_id);
  // A second call returns the same view.
  auto again = chief->rendezvous();
  ASSERT_TRUE(again);
  EXPECT_EQ(*again, *v);
}

class MembershipSizeTest : public ::testing::TestWithParam<int> {};

TEST_P(MembershipSizeTest, EveryMemberReceivesTheSameViewInRankOrder) {
  auto n = GetParam();
  // Distinct devices per worker (same count), so that a mix-up of members would show.
  cluster c(n, [](membership::options& o) {
    o.devices = {{"GPU:0", true, 1000u + static_cast<uint64_t>(o.rank)},
                 {"GPU:1", true, 2000u + static_cast<uint64_t>(o.rank)}};
  });
  auto views = c.rendezvous_all();
  for (int r = 0; r < n; ++r)
    ASSERT_TRUE(views[r]) << "rank " << r << ": " << text_of(views[r].error()) << "\n"
                          << c.logs.all();
  const auto& v = *views[0];
  EXPECT_EQ(v.epoch, 1u);
  EXPECT_NE(v.group_id, 0u);
  EXPECT_EQ(v.nccl_unique_id, pattern(128, 3));
  ASSERT_EQ(v.members.size(), static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    const auto& m = v.members[r];
    EXPECT_EQ(m.rank, r);
    EXPECT_EQ(m.task, (consort::task_id{"worker", r}));
    EXPECT_EQ(m.address, "127.0.0.1:" + std::to_string(21000 + r));
    ASSERT_EQ(m.devices.size(), 2u);
    EXPECT_EQ(m.devices[0], (membership::device_info{"GPU:0", true, 1000u + r}));
    EXPECT_EQ(m.devices[1], (membership::device_info{"GPU:1", true, 2000u + r}));
  }
  for (int r = 1; r < n; ++r)
    EXPECT_EQ(*views[r], v) << "rank " << r;
  EXPECT_EQ(c.services[0]->rank(), 0);
  EXPECT_EQ(c.services[n - 1]->listen_address(), n > 1 ? std::string{} : c.chief_address);
}

INSTANTIATE_TEST_SUITE_P(Members, MembershipSizeTest, ::testing::Values(2, 3, 4));

TEST(MembershipTest, WorkersStartedBeforeTheChiefRetryUntilItListens) {
  log_capture logs;
  auto address = "127.0.0.1:" + std::to_string(free_port());
  std::vector<std::unique_ptr<membership::service>> workers;
  std::vector<std::future<caf::expected<membership::view>>> futures;
  for (int r = 1; r < 3; ++r) {
    workers.push_back(start_ok(options_for(3, r, address, &logs)));
    ASSERT_TRUE(workers.back());
    auto* w = workers.back().get();
    futures.push_back(std::async(std::launch::async, [w] { return w->rendezvous(); }));
  }
  // The workers have failed to connect at least once before the chief starts.
  ASSERT_TRUE(logs.wait_for({"worker:1", "cannot join the chief at " + address + " yet"}));
  ASSERT_TRUE(logs.wait_for({"worker:2", "cannot join the chief at " + address + " yet"}));
  auto chief = start_ok(options_for(3, 0, address, &logs));
  ASSERT_TRUE(chief);
  auto v = chief->rendezvous();
  ASSERT_TRUE(v) << text_of(v.error()) << "\n" << logs.all();
  for (auto& f : futures) {
    auto wv = f.get();
    ASSERT_TRUE(wv) << text_of(wv.error());
    EXPECT_EQ(*wv, *v);
  }
}

TEST(MembershipTest, MissingWorkerFailsTheChiefNamingItAndTheJoinedWorkerPromptly) {
  manual_clock clock;
  log_capture logs;
  auto chief_opts = options_for(3, 0, "127.0.0.1:0", &logs);
  chief_opts.rendezvous_timeout = 1000ms;
  chief_opts.clock = clock.function();
  auto chief = start_ok(chief_opts);
  ASSERT_TRUE(chief);
  // Worker 1 joins, with a deadline far later than the chief's; worker 2 never starts.
  auto worker_opts = options_for(3, 1, chief->listen_address(), &logs);
  worker_opts.rendezvous_timeout = 30s;
  worker_opts.clock = clock.function();
  auto worker = start_ok(worker_opts);
  ASSERT_TRUE(worker);
  auto joined = std::async(std::launch::async, [&] { return worker->rendezvous(); });
  ASSERT_TRUE(logs.wait_for({"worker:1 (rank 1) joined from 127.0.0.1:"}));
  auto chief_view = std::async(std::launch::async, [&] { return chief->rendezvous(); });
  // The chief's deadline counts from its rendezvous, which may start after the clock moved a
  // little: it fails no earlier than 1000 ms on the clock, and long before the worker's 30 s.
  auto moved = advance_until(clock, {chief.get(), worker.get()}, [&] { return ready(chief_view); });
  EXPECT_GE(moved, 1000ms);
  EXPECT_LT(moved, 30s);
  auto expected = "rendezvous at " + chief->listen_address() +
                  " timed out after 1000 ms: worker:2 did not join (joined: worker:0, worker:1)";
  EXPECT_TRUE(has_error(chief_view.get(), errc::collective_timeout, {expected}));
  auto worker_view = joined.get(); // the chief's abort reached it: not its own deadline
  EXPECT_TRUE(has_error(worker_view, errc::collective_timeout, {expected}));
  EXPECT_TRUE(logs.wait_for(
      {"worker:0 (rank 0): waiting for 1 of 3 tasks to join: worker:2 (joined: worker:0, "
       "worker:1)"}))
      << logs.all();
}

TEST(MembershipTest, WorkerThatCannotReachTheChiefTimesOutWithTheLastError) {
  log_capture logs;
  auto address = "127.0.0.1:" + std::to_string(free_port());
  manual_clock clock;
  auto opts = options_for(2, 1, address, &logs);
  opts.rendezvous_timeout = 300ms;
  opts.clock = clock.function();
  auto worker = start_ok(opts);
  ASSERT_TRUE(worker);
  auto result = std::async(std::launch::async, [&] { return worker->rendezvous(); });
  // Refused attempts are retried (on real time) until the deadline passes on the clock.
  ASSERT_TRUE(logs.wait_for({"cannot join the chief at " + address + " yet", "refused"}))
      << logs.all();
  auto moved = advance_until(clock, {worker.get()}, [&] { return ready(result); });
  EXPECT_GE(moved, 300ms);
  EXPECT_TRUE(has_error(result.get(), errc::collective_timeout,
                        {"could not join the cluster at chief " + address + " within 300 ms",
                         "connect to " + address, "refused"}));
}

// -- authentication ------------------------------------------------------------------------------

/// The outcome of a two-member rendezvous where the chief and the worker have these secrets
/// (the chief's rendezvous fails after `chief_timeout` when the worker is refused).
std::pair<caf::expected<membership::view>, caf::expected<membership::view>>
rendezvous_with_secrets(const std::string& chief_secret, const std::string& worker_secret,
                        log_capture& logs, milliseconds chief_timeout = 300ms) {
  // On a manual clock: the worker's outcome (a view or a refusal) comes from real events while
  // the clock stands still; only then does the clock move, for the chief's deadline.
  manual_clock clock;
  auto chief_opts = options_for(2, 0, "127.0.0.1:0", &logs);
  chief_opts.secret = chief_secret;
  chief_opts.rendezvous_timeout = chief_timeout;
  chief_opts.clock = clock.function();
  auto chief = start_ok(chief_opts);
  if (!chief)
    return {membership::view{}, membership::view{}};
  auto worker_opts = options_for(2, 1, chief->listen_address(), &logs);
  worker_opts.secret = worker_secret;
  worker_opts.clock = clock.function();
  auto worker = start_ok(worker_opts);
  auto c = std::async(std::launch::async, [&] { return chief->rendezvous(); });
  auto w = worker->rendezvous();
  advance_until(clock, {chief.get()}, [&] { return ready(c); });
  return {c.get(), std::move(w)};
}

TEST(MembershipTest, TheRightSharedSecretJoins) {
  log_capture logs;
  auto [c, w] = rendezvous_with_secrets("s3cret", "s3cret", logs, 10s);
  ASSERT_TRUE(c) << text_of(c.error()) << "\n" << logs.all();
  ASSERT_TRUE(w) << text_of(w.error()) << "\n" << logs.all();
  EXPECT_EQ(*c, *w);
}

TEST(MembershipTest, AWrongSharedSecretIsRefusedWithTheReason) {
  log_capture logs;
  auto [c, w] = rendezvous_with_secrets("s3cret", "guess", logs);
  EXPECT_TRUE(has_error(w, errc::invalid_argument,
                        {"refused by the chief at 127.0.0.1:",
                         "authentication failed: the shared secret does not match"}));
  EXPECT_TRUE(has_error(c, errc::collective_timeout, {"worker:1 did not join"}));
  EXPECT_TRUE(logs.wait_for({"refused the Join of worker:1", "the shared secret does not match"}));
}

TEST(MembershipTest, ASecretOnOneSideOnlyIsRefused) {
  {
    log_capture logs;
    auto [c, w] = rendezvous_with_secrets("s3cret", "", logs);
    EXPECT_TRUE(has_error(w, errc::invalid_argument,
                          {"refused by the chief", "authentication failed",
                           "presented no proof of the shared secret"}));
  }
  {
    log_capture logs;
    auto [c, w] = rendezvous_with_secrets("", "s3cret", logs);
    EXPECT_TRUE(
        has_error(w, errc::invalid_argument,
                  {"refused by the chief", "authentication failed", "this chief has none"}));
  }
}

// -- refused joins -------------------------------------------------------------------------------

TEST(MembershipTest, ADuplicateTaskIsRefused) {
  log_capture logs;
  auto chief_opts = options_for(3, 0, "127.0.0.1:0", &logs);
  chief_opts.rendezvous_timeout = 2s;
  auto chief = start_ok(chief_opts);
  ASSERT_TRUE(chief);
  auto first = start_ok(options_for(3, 1, chief->listen_address(), &logs));
  auto first_view = std::async(std::launch::async, [&] { return first->rendezvous(); });
  ASSERT_TRUE(logs.wait_for({"worker:1 (rank 1) joined"}));
  auto second = start_ok(options_for(3, 1, chief->listen_address(), &logs));
  EXPECT_TRUE(has_error(second->rendezvous(), errc::invalid_argument,
                        {"refused by the chief",
                         "task worker:1 (rank 1) already joined, from "
                         "127.0.0.1:",
                         "a duplicate task"}));
  // The first one stays joined: the last worker completes the view.
  auto third = start_ok(options_for(3, 2, chief->listen_address(), &logs));
  auto third_view = std::async(std::launch::async, [&] { return third->rendezvous(); });
  auto v = chief->rendezvous();
  ASSERT_TRUE(v) << text_of(v.error()) << "\n" << logs.all();
  auto fv = first_view.get();
  ASSERT_TRUE(fv) << text_of(fv.error());
  EXPECT_EQ(*fv, *v);
  auto tv = third_view.get();
  ASSERT_TRUE(tv) << text_of(tv.error());
}

TEST(MembershipTest, AnUnknownTaskIsRefused) {
  // Only a Join of the same cluster can name a task the chief does not have: a hand-made one.
  log_capture logs;
  auto chief_opts = options_for(2, 0, "127.0.0.1:0", &logs);
  auto chief = start_ok(chief_opts);
  ASSERT_TRUE(chief);
  raw_peer peer(chief->listen_address());
  codec::message m;
  ASSERT_TRUE(peer.read(m));
  ASSERT_TRUE(std::holds_alternative<codec::challenge>(m)) << codec::kind_of(m);
  codec::join j;
  j.task = {"worker", 9};
  j.address = "127.0.0.1:1";
  j.devices = {{"CPU:0", false, 0}};
  j.nonce = pattern(32, 9);
  j.cluster_digest = cluster_check::of(chief_opts).digest;
  peer.write(codec::encode(j));
  ASSERT_TRUE(peer.read(m));
  ASSERT_TRUE(std::holds_alternative<codec::refusal>(m)) << codec::kind_of(m);
  const auto& reason = std::get<codec::refusal>(m).reason;
  EXPECT_NE(reason.find("task worker:9 is not a worker of this cluster (expected one of: "
                        "worker:0, worker:1)"),
            std::string::npos)
      << reason;
  EXPECT_TRUE(peer.closed_by_peer());
}

TEST(MembershipTest, AWorkerWithAnotherDeviceCountIsRefused) {
  log_capture logs;
  auto chief = start_ok(options_for(2, 0, "127.0.0.1:0", &logs));
  ASSERT_TRUE(chief);
  auto opts = options_for(2, 1, chief->listen_address(), &logs);
  opts.devices = {{"GPU:0", true, 1}, {"GPU:1", true, 1}};
  auto worker = start_ok(opts);
  EXPECT_TRUE(has_error(worker->rendezvous(), errc::invalid_argument,
                        {"worker:1 announces 2 devices but the chief (worker:0) has 1",
                         "the same number of devices on every worker"}));
}

TEST(MembershipTest, AJoinOfAnotherProtocolVersionIsRefused) {
  log_capture logs;
  auto chief = start_ok(options_for(2, 0, "127.0.0.1:0", &logs));
  ASSERT_TRUE(chief);
  raw_peer peer(chief->listen_address());
  codec::message m;
  ASSERT_TRUE(peer.read(m));
  ASSERT_TRUE(std::holds_alternative<codec::challenge>(m)) << codec::kind_of(m);
  EXPECT_GE(std::get<codec::challenge>(m).nonce.size(), 16u);
  codec::join j;
  j.task = {"worker", 1};
  j.address = "127.0.0.1:1";
  j.devices = {{"CPU:0", false, 0}};
  j.version = 2;
  j.nonce = pattern(32, 9);
  peer.write(codec::encode(j));
  ASSERT_TRUE(peer.read(m));
  ASSERT_TRUE(std::holds_alternative<codec::refusal>(m)) << codec::kind_of(m);
  EXPECT_NE(std::get<codec::refusal>(m).reason.find(
                "it speaks membership protocol version 2, this chief speaks version 1"),
            std::string::npos)
      << std::get<codec::refusal>(m).reason;
  EXPECT_TRUE(peer.closed_by_peer());
}

// -- the cluster every task was given ------------------------------------------------------------

TEST(MembershipClusterTest, TheDigestCoversEveryTaskAndAddressInSortedOrder) {
  auto of = [](const consort::cluster_spec& spec, std::vector<consort::task_id> tasks = {}) {
    membership::options opts;
    opts.tasks = std::move(tasks);
    opts.cluster = spec;
    return cluster_check::of(opts);
  };
  auto two = of(consort::cluster_spec::dense({{"worker", {"h:1", "h:2"}}, {"chief", {"h:0"}}}));
  EXPECT_EQ(two.text, "[chief:0=h:0, worker:0=h:1, worker:1=h:2]");
  EXPECT_NE(two.digest, 0u);
  // The same cluster in TF's sparse form, with an evaluator (left out): the same digest.
  auto same = of(consort::cluster_spec({{"evaluator", {{0, "h:9"}}},
                                        {"worker", {{1, "h:2"}, {0, "h:1"}}},
                                        {"chief", {{0, "h:0"}}}}));
  EXPECT_EQ(same.text, two.text);
  EXPECT_EQ(same.digest, two.digest);
  // Another address, another task, a missing task: other digests.
  for (const auto& other :
       {of(consort::cluster_spec::dense({{"worker", {"h:1", "h:3"}}, {"chief", {"h:0"}}})),
        of(consort::cluster_spec::dense({{"worker", {"h:1", "h:2", "h:3"}}, {"chief", {"h:0"}}})),
        of(consort::cluster_spec::dense({{"worker", {"h:1"}}, {"chief", {"h:0"}}}))})
    EXPECT_NE(other.digest, two.digest) << other.text;
  // Without a cluster: the tasks alone, sorted.
  auto tasks = of({}, {{"worker", 1}, {"chief", 0}, {"worker", 0}});
  EXPECT_EQ(tasks.text, "[chief:0, worker:0, worker:1]");
  EXPECT_NE(tasks.digest, two.digest);
  EXPECT_EQ(tasks.digest, cluster_check::digest_of({"chief:0", "worker:0", "worker:1"}));
  // Cut after an entry, never inside one.
  EXPECT_EQ(cluster_check::abbreviate(two.text, 1000), two.text);
  EXPECT_EQ(cluster_check::abbreviate(two.text, 32), "[chief:0=h:0, worker:0=h:1, ...]");
  EXPECT_EQ(cluster_check::abbreviate(two.text, 31), "[chief:0=h:0, ...]");
  EXPECT_EQ(cluster_check::abbreviate(two.text, 12), "[...]");
}

/// The outcomes of a chief's and a worker's rendezvous; nothing where it did not end in time.
struct pair_outcome {
  std::optional<caf::expected<membership::view>> chief, worker;
};

/// Runs the rendezvous of a chief and one worker started with these options (the worker's
/// chief_address is filled in) on `clock`, which the test never moves: no deadline can pass, so
/// only the Joins can end them. Each outcome is awaited for at most 10 s (scaled).
pair_outcome rendezvous_pair(membership::options chief_opts, membership::options worker_opts,
                             manual_clock& clock) {
  pair_outcome out;
  for (auto* o : {&chief_opts, &worker_opts}) {
    o->clock = clock.function();
    o->rendezvous_timeout = 20s; // on the standing clock: never
  }
  auto chief = start_ok(chief_opts);
  if (!chief)
    return out;
  worker_opts.chief_address = chief->listen_address();
  auto worker = start_ok(worker_opts);
  if (!worker)
    return out;
  auto c = std::async(std::launch::async, [&] { return chief->rendezvous(); });
  auto w = std::async(std::launch::async, [&] { return worker->rendezvous(); });
  auto until = clock_type::now() + consort::test::scaled(10s);
  if (c.wait_until(until) == std::future_status::ready)
    out.chief = c.get();
  if (w.wait_until(until) == std::future_status::ready)
    out.worker = w.get();
  return out;
}

TEST(MembershipClusterTest, AWorkerGivenMoreWorkersIsRefusedAndTheChiefFailsAtOnce) {
  manual_clock clock;
  log_capture logs;
  auto chief_opts = options_for(2, 0, "127.0.0.1:0", &logs);
  auto worker_opts = options_for(3, 1, "", &logs);
  auto out = rendezvous_pair(chief_opts, worker_opts, clock);
  ASSERT_TRUE(out.worker) << "the worker's rendezvous did not end\n" << logs.all();
  ASSERT_TRUE(out.chief) << "the chief's rendezvous did not end\n" << logs.all();
  std::vector<std::string> both = {
      "worker:1 was given another cluster than the chief (worker:0): worker:1 has [worker:0, "
      "worker:1, worker:2], the chief has [worker:0, worker:1]; the cluster comes from TF_CONFIG "
      "(or the cluster resolver) and must be the same on every task; the lists first differ at "
      "entry 3: worker:1 has worker:2, the chief has no entry"};
  auto worker_fragments = both;
  worker_fragments.push_back("refused by the chief at 127.0.0.1:");
  EXPECT_TRUE(has_error(*out.worker, errc::invalid_argument, worker_fragments)) << logs.all();
  auto chief_fragments = both;
  chief_fragments.push_back("worker:0 (rank 0): the rendezvous failed: the Join of worker:1 from "
                            "127.0.0.1:");
  EXPECT_TRUE(has_error(*out.chief, errc::invalid_argument, chief_fragments)) << logs.all();
  EXPECT_TRUE(logs.wait_for({"worker:0 (rank 0): refused the Join of worker:1", both[0]}))
      << logs.all();
}

TEST(MembershipClusterTest, AWorkerGivenOtherAddressesIsRefusedNamingBothLists) {
  manual_clock clock;
  log_capture logs;
  auto chief_opts = options_for(2, 0, "127.0.0.1:0", &logs);
  chief_opts.cluster =
      consort::cluster_spec::dense({{"worker", {"10.0.0.1:2222", "10.0.0.2:2222"}}});
  auto worker_opts = options_for(2, 1, "", &logs);
  worker_opts.cluster =
      consort::cluster_spec::dense({{"worker", {"10.0.0.1:2222", "10.0.0.3:2222"}}});
  auto out = rendezvous_pair(chief_opts, worker_opts, clock);
  ASSERT_TRUE(out.worker) << "the worker's rendezvous did not end\n" << logs.all();
  ASSERT_TRUE(out.chief) << "the chief's rendezvous did not end\n" << logs.all();
  std::vector<std::string> both = {
      "worker:1 has [worker:0=10.0.0.1:2222, worker:1=10.0.0.3:2222]",
      "the chief has [worker:0=10.0.0.1:2222, worker:1=10.0.0.2:2222]",
      "must be the same on every task",
      "first differ at entry 2: worker:1 has worker:1=10.0.0.3:2222, the chief has "
      "worker:1=10.0.0.2:2222"};
  EXPECT_TRUE(has_error(*out.worker, errc::invalid_argument, both)) << logs.all();
  EXPECT_TRUE(has_error(*out.chief, errc::invalid_argument, both)) << logs.all();
}

TEST(MembershipClusterTest, AWorkerGivenFewerWorkersIsRefusedAndTheJoinedOnesAreAborted) {
  // The chief and worker:2 were given 3 workers, worker:1 only 2: without the check, the chief
  // waited out its rendezvous for a worker:2 that worker:1 did not expect.
  manual_clock clock;
  log_capture logs;
  auto opts = [&](int n, int rank, const std::string& chief) {
    auto o = options_for(n, rank, chief, &logs);
    o.clock = clock.function();
    o.rendezvous_timeout = 20s; // on the standing clock: never
    return o;
  };
  auto chief = start_ok(opts(3, 0, "127.0.0.1:0"));
  ASSERT_TRUE(chief);
  auto chief_view = std::async(std::launch::async, [&] { return chief->rendezvous(); });
  auto second = start_ok(opts(3, 2, chief->listen_address()));
  ASSERT_TRUE(second);
  auto second_view = std::async(std::launch::async, [&] { return second->rendezvous(); });
  ASSERT_TRUE(logs.wait_for({"worker:2 (rank 2) joined"})) << logs.all();
  auto first = start_ok(opts(2, 1, chief->listen_address()));
  ASSERT_TRUE(first);
  auto first_view = std::async(std::launch::async, [&] { return first->rendezvous(); });
  auto until = clock_type::now() + consort::test::scaled(10s);
  for (auto* f : {&chief_view, &second_view, &first_view})
    ASSERT_EQ(f->wait_until(until), std::future_status::ready) << logs.all();
  std::vector<std::string> both = {
      "worker:1 has [worker:0, worker:1], the chief has [worker:0, worker:1, worker:2]",
      "TF_CONFIG", "must be the same on every task",
      "first differ at entry 3: worker:1 has no entry, the chief has worker:2"};
  EXPECT_TRUE(has_error(first_view.get(), errc::invalid_argument, both));
  EXPECT_TRUE(has_error(chief_view.get(), errc::invalid_argument, both));
  auto aborted = both;
  aborted.push_back("the rendezvous failed: the Join of worker:1");
  EXPECT_TRUE(has_error(second_view.get(), errc::collective_timeout, aborted));
}

TEST(MembershipClusterTest, TheSameClusterIsAcceptedHoweverItWasWritten) {
  manual_clock clock;
  log_capture logs;
  auto chief_opts = options_for(2, 0, "127.0.0.1:0", &logs);
  chief_opts.cluster = consort::cluster_spec::dense(
      {{"worker", {"10.0.0.1:2222", "10.0.0.2:2222"}}, {"evaluator", {"10.0.0.9:2222"}}});
  auto worker_opts = options_for(2, 1, "", &logs);
  worker_opts.cluster =
      consort::cluster_spec({{"worker", {{1, "10.0.0.2:2222"}, {0, "10.0.0.1:2222"}}}});
  auto out = rendezvous_pair(chief_opts, worker_opts, clock);
  ASSERT_TRUE(out.chief && out.worker) << logs.all();
  ASSERT_TRUE(*out.chief) << text_of(out.chief->error()) << "\n" << logs.all();
  ASSERT_TRUE(*out.worker) << text_of(out.worker->error()) << "\n" << logs.all();
  EXPECT_EQ(**out.chief, **out.worker);
  EXPECT_EQ((*out.chief)->members.size(), 2u);
}

TEST(MembershipClusterTest, AStrayTaskOfAnotherClusterIsRefusedAndTheRendezvousGoesOn) {
  // worker:9 is no task of the chief's: it is refused (naming both lists), the others join.
  log_capture logs;
  auto chief = start_ok(options_for(2, 0, "127.0.0.1:0", &logs));
  ASSERT_TRUE(chief);
  auto opts = options_for(2, 1, chief->listen_address(), &logs);
  opts.tasks[1] = {"worker", 9};
  auto stranger = start_ok(opts);
  ASSERT_TRUE(stranger);
  EXPECT_TRUE(has_error(stranger->rendezvous(), errc::invalid_argument,
                        {"refused by the chief", "worker:9 has [worker:0, worker:9]",
                         "the chief has [worker:0, worker:1]",
                         "first differ at entry 2: worker:9 has worker:9, the chief has "
                         "worker:1"}));
  auto worker = start_ok(options_for(2, 1, chief->listen_address(), &logs));
  ASSERT_TRUE(worker);
  auto worker_view = std::async(std::launch::async, [&] { return worker->rendezvous(); });
  auto v = chief->rendezvous();
  ASSERT_TRUE(v) << text_of(v.error()) << "\n" << logs.all();
  auto wv = worker_view.get();
  ASSERT_TRUE(wv) << text_of(wv.error());
  EXPECT_EQ(*wv, *v);
}

TEST(MembershipClusterTest, AJoinWithoutADigestIsRefused) {
  log_capture logs;
  auto chief = start_ok(options_for(2, 0, "127.0.0.1:0", &logs));
  ASSERT_TRUE(chief);
  raw_peer peer(chief->listen_address());
  codec::message m;
  ASSERT_TRUE(peer.read(m));
  codec::join j;
  j.task = {"worker", 1};
  j.address = "127.0.0.1:1";
  j.devices = {{"CPU:0", false, 0}};
  j.nonce = pattern(32, 9);
  peer.write(codec::encode(j));
  ASSERT_TRUE(peer.read(m));
  ASSERT_TRUE(std::holds_alternative<codec::refusal>(m)) << codec::kind_of(m);
  EXPECT_NE(std::get<codec::refusal>(m).reason.find("carries no digest of its cluster"),
            std::string::npos)
      << std::get<codec::refusal>(m).reason;
  EXPECT_TRUE(peer.closed_by_peer());
}

class MembershipLongClusterTest : public ::testing::TestWithParam<std::size_t> {};

TEST_P(MembershipLongClusterTest, ListsAreCutToFitTheJoinAndTheRefusal) {
  // 500 and 501 workers: lists of about 6 KB, over a text's 4 KB and the frame's limit here.
  manual_clock clock;
  log_capture logs;
  auto chief_opts = options_for(500, 0, "127.0.0.1:0", &logs);
  auto worker_opts = options_for(501, 1, "", &logs);
  chief_opts.max_message_bytes = worker_opts.max_message_bytes = GetParam();
  auto out = rendezvous_pair(chief_opts, worker_opts, clock);
  ASSERT_TRUE(out.worker) << "the worker's rendezvous did not end\n" << logs.all();
  ASSERT_TRUE(out.chief) << "the chief's rendezvous did not end\n" << logs.all();
  // A refusal, not a malformed frame; the end of each list is cut, the rule is still there.
  std::vector<std::string> fragments = {"refused by the chief",
                                        "worker:1 has [worker:0, worker:1, worker:2, worker:3",
                                        "the chief has [worker:0, worker:1, worker:2, worker:3",
                                        ", ...]", "must be the same on every task"};
  EXPECT_TRUE(has_error(*out.worker, errc::invalid_argument, fragments)) << logs.all();
  EXPECT_TRUE(has_error(*out.chief, errc::invalid_argument, {"worker:1 has [worker:0, worker:1"}))
      << logs.all();
  EXPECT_LE(text_of(out.worker->error()).size(), GetParam() + 200);
}

INSTANTIATE_TEST_SUITE_P(FrameLimits, MembershipLongClusterTest,
                         ::testing::Values(std::size_t{1} << 20, std::size_t{1024}),
                         [](const ::testing::TestParamInfo<std::size_t>& info) {
                           return "MaxMessageBytes" + std::to_string(info.param);
                         });

// -- malformed traffic ---------------------------------------------------------------------------

/// A malformed first frame and the reason the chief logs for it.
struct bad_frame {
  std::string name;
  std::function<void(raw_peer&)> send;
  std::string reason;
  bool closed_at_the_handshake_deadline = false; // else at once, with the clock standing still
};

class MembershipBadFrameTest : public ::testing::TestWithParam<bad_frame> {};

TEST_P(MembershipBadFrameTest, ConnectionIsClosedWithALoggedReasonAndTheViewStillForms) {
  manual_clock clock;
  log_capture logs;
  auto chief_opts = options_for(3, 0, "127.0.0.1:0", &logs);
  chief_opts.handshake_timeout = 300ms;
  chief_opts.rendezvous_timeout = 600s;
  chief_opts.clock = clock.function();
  auto chief = start_ok(chief_opts);
  ASSERT_TRUE(chief);
  auto chief_view = std::async(std::launch::async, [&] { return chief->rendezvous(); });
  {
    raw_peer peer(chief->listen_address());
    GetParam().send(peer);
    if (GetParam().closed_at_the_handshake_deadline) {
      // The handshake's deadline counts from the accept, which may come a step late.
      auto moved = advance_until(clock, {chief.get()}, [&] {
        return logs.wait_for({"closed the connection from 127.0.0.1:"}, 0ms);
      });
      EXPECT_GE(moved, 300ms);
    }
    EXPECT_TRUE(peer.closed_by_peer());
    EXPECT_TRUE(logs.wait_for({"closed the connection from 127.0.0.1:", GetParam().reason}))
        << logs.all();
  }
  std::vector<std::unique_ptr<membership::service>> workers;
  std::vector<std::future<caf::expected<membership::view>>> views;
  for (int r = 1; r < 3; ++r) {
    workers.push_back(start_ok(options_for(3, r, chief->listen_address(), &logs)));
    auto* w = workers.back().get();
    views.push_back(std::async(std::launch::async, [w] { return w->rendezvous(); }));
  }
  auto v = chief_view.get();
  ASSERT_TRUE(v) << text_of(v.error()) << "\n" << logs.all();
  ASSERT_EQ(v->members.size(), 3u);
  for (auto& f : views) {
    auto wv = f.get();
    ASSERT_TRUE(wv) << text_of(wv.error());
    EXPECT_EQ(*wv, *v);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Frames, MembershipBadFrameTest,
    ::testing::Values(
        bad_frame{"TruncatedPrefix",
                  [](raw_peer& p) {
                    p.write(bytes(2, std::byte{0x40}));
                    p.shutdown_write();
                  },
                  "truncated frame: the connection ended after 2 of 4 bytes of its length "
                  "prefix"},
        bad_frame{"TruncatedMessage",
                  [](raw_peer& p) {
                    p.write_u32(64);
                    p.write(bytes(10, std::byte{0}));
                    p.shutdown_write();
                  },
                  "truncated frame: the connection ended after 10 of 64 bytes of its message"},
        bad_frame{"OversizedLength", [](raw_peer& p) { p.write_u32(0xffffffffu); },
                  "malformed frame: frame length 4294967295 is outside [16, 1048576]"},
        bad_frame{"LengthNotAMultipleOfEight", [](raw_peer& p) { p.write_u32(20); },
                  "not a multiple of 8"},
        bad_frame{"GarbageAfterAValidLength",
                  [](raw_peer& p) {
                    p.write_u32(64);
                    p.write(bytes(64, std::byte{0xff}));
                  },
                  "malformed message"},
        bad_frame{"NotAJoin",
                  [](raw_peer& p) {
                    p.write(codec::encode(codec::heartbeat{1, 1, 1}));
                  },
                  "expected a Join, got a heartbeat message"},
        bad_frame{"ClosedWithoutAJoin", [](raw_peer& p) { p.shutdown_write(); },
                  "the connection closed without a Join (end of file)"},
        bad_frame{"Silent", [](raw_peer&) {}, "no valid Join within 300 ms", true}),
    [](const ::testing::TestParamInfo<bad_frame>& info) { return info.param.name; });

// -- losses --------------------------------------------------------------------------------------

TEST(MembershipTest, ACrashedWorkerIsReportedAtOnceByTheChiefAndTheOtherWorkers) {
  // A long peer timeout: only the end of the connection can explain a prompt report.
  cluster c(3, [](membership::options& o) { o.peer_timeout = 10s; });
  ASSERT_TRUE(c.form());
  auto crashed_at = clock_type::now();
  membership::service_test_access::crash(*c.services[2]);
  auto at_chief = c.lost[0]->wait_for(2, 5s);
  ASSERT_TRUE(at_chief) << c.logs.all();
  EXPECT_EQ(at_chief->ranks, std::vector<int>{2});
  EXPECT_NE(at_chief->cause.find("worker:2 (rank 2): connection closed without leave"),
            std::string::npos)
      << at_chief->cause;
  auto at_worker = c.lost[1]->wait_for(2, 5s);
  ASSERT_TRUE(at_worker) << c.logs.all();
  EXPECT_EQ(at_worker->ranks, std::vector<int>{2});
  EXPECT_EQ(at_worker->cause, at_chief->cause);
  EXPECT_LT(clock_type::now() - crashed_at, consort::test::scaled(5s));
  // The crashed one reports nothing; every loss is reported once.
  EXPECT_TRUE(c.lost[2]->events().empty()) << describe(c.lost[2]->events());
  EXPECT_EQ(c.lost[0]->events().size(), 1u) << describe(c.lost[0]->events());
}

TEST(MembershipTest, ASuspendedWorkerIsLostAfterThePeerTimeout) {
  cluster c(3, {}, timing::manual);
  ASSERT_TRUE(c.form());
  membership::service_test_access::suspend(*c.services[2]);
  // On the manual clock: nobody is lost before the 500 ms peer timeout (the last heartbeats
  // left when the view formed, and the clock stood still since), and the chief reports worker 2
  // in the step that reaches it, while the others' heartbeats keep them alive.
  c.advance(450ms);
  EXPECT_TRUE(c.lost[0]->events().empty()) << describe(c.lost[0]->events()) << c.logs.all();
  c.advance(50ms);
  auto at_chief = c.lost[0]->wait_for(2, 0ms);
  ASSERT_TRUE(at_chief) << c.logs.all();
  EXPECT_EQ(at_chief->ranks, std::vector<int>{2});
  EXPECT_EQ(at_chief->cause, "worker:2 (rank 2) sent no heartbeat for 500 ms");
  auto at_worker = c.lost[1]->wait_for(2); // told by the chief, or its own timeout
  ASSERT_TRUE(at_worker) << c.logs.all();
  EXPECT_EQ(at_worker->cause, at_chief->cause);
  // The others stay alive, four peer timeouts later: nothing else is reported about them.
  c.advance(2000ms);
  EXPECT_EQ(c.lost[0]->events().size(), 1u) << describe(c.lost[0]->events());
  EXPECT_EQ(c.lost[1]->events().size(), 1u) << describe(c.lost[1]->events());
  // Gone at once, rather than a leave whose linger waits on the standing clock.
  membership::service_test_access::crash(*c.services[2]);
}

// A silent peer whose process runs on this host and waits for a CPU (a loaded machine) is not
// hung: it is lost only after ten peer timeouts of silence, or as soon as its process is seen
// stopped or asleep. The probe stands in for /proc (every member of these clusters is this very
// process, whose own threads the default probe never blames).
TEST(MembershipTest, ASilentWorkerWaitingForACpuOnThisHostIsLostOnlyAfterTenPeerTimeouts) {
  cluster c(3, {}, timing::manual);
  ASSERT_TRUE(c.form());
  std::atomic<uint32_t> asked{0};
  membership::service_test_access::set_host_probe(*c.services[0], [&](uint32_t pid) {
    asked = pid;
    return membership::host_process::held_up;
  });
  membership::service_test_access::suspend(*c.services[2]);
  const auto pid = std::to_string(::getpid());
  c.advance(500ms);
  EXPECT_EQ(asked.load(), static_cast<uint32_t>(::getpid())) << "the pid of worker 2's Join";
  EXPECT_TRUE(c.lost[0]->events().empty()) << describe(c.lost[0]->events());
  EXPECT_TRUE(
      c.logs.wait_for({"worker:2 (rank 2) sent no heartbeat for 500 ms, but its process (pid " +
                           pid + ") on this host is runnable, waiting for a CPU",
                       "for up to 5000 ms of silence"},
                      0ms))
      << c.logs.all();
  c.advance(4450ms);
  EXPECT_TRUE(c.lost[0]->events().empty()) << describe(c.lost[0]->events());
  c.advance(50ms);
  auto e = c.lost[0]->wait_for(2, 0ms);
  ASSERT_TRUE(e) << c.logs.all();
  EXPECT_EQ(e->cause, "worker:2 (rank 2) sent no heartbeat for 5000 ms; its process (pid " + pid +
                          " on this host) was runnable all that time but not scheduled");
  membership::service_test_access::crash(*c.services[2]); // as above
}

TEST(MembershipTest, ASilentWorkerIsLostOnceItsProcessIsSeenStoppedAndAtOnceWhenAsleep) {
  cluster c(3, {}, timing::manual);
  ASSERT_TRUE(c.form());
  std::atomic<membership::host_process> state{membership::host_process::held_up};
  membership::service_test_access::set_host_probe(*c.services[0],
                                                  [&](uint32_t) { return state.load(); });
  membership::service_test_access::suspend(*c.services[2]);
  c.advance(700ms); // held up: not lost
  EXPECT_TRUE(c.lost[0]->events().empty()) << describe(c.lost[0]->events());
  state = membership::host_process::stopped; // a debugger, SIGSTOP
  c.advance(50ms);
  auto e = c.lost[0]->wait_for(2, 0ms);
  ASSERT_TRUE(e) << c.logs.all();
  EXPECT_EQ(e->cause, "worker:2 (rank 2) sent no heartbeat for 750 ms; its process (pid " +
                          std::to_string(::getpid()) + " on this host) is stopped now");
  membership::service_test_access::crash(*c.services[2]);

  // Asleep (every thread could run, none sends): lost at the peer timeout, as ever.
  cluster d(2, {}, timing::manual);
  ASSERT_TRUE(d.form());
  membership::service_test_access::set_host_probe(
      *d.services[0], [](uint32_t) { return membership::host_process::asleep; });
  membership::service_test_access::suspend(*d.services[1]);
  d.advance(500ms);
  auto f = d.lost[0]->wait_for(1, 0ms);
  ASSERT_TRUE(f) << d.logs.all();
  EXPECT_EQ(f->cause, "worker:1 (rank 1) sent no heartbeat for 500 ms");
  membership::service_test_access::crash(*d.services[1]);
}

TEST(MembershipTest, MembersHeldUpOnThisHostAreHeardAgainAndNotLost) {
  cluster c(3, {}, timing::manual);
  // Every member's pid is in the view (the chief's own, the workers' from their Joins): how a
  // worker finds its chief's process.
  auto views = c.rendezvous_all();
  for (std::size_t r = 0; r < views.size(); ++r) {
    ASSERT_TRUE(views[r]) << text_of(views[r].error());
    for (const auto& m : views[r]->members)
      EXPECT_EQ(m.pid, static_cast<uint32_t>(::getpid())) << "rank " << r << ", member " << m.rank;
  }
  for (auto& svc : c.services)
    membership::service_test_access::set_host_probe(
        *svc, [](uint32_t) { return membership::host_process::held_up; });
  // The chief alone runs 600 ms later (the others were not scheduled): both are silent to it.
  // (The workers' own ticks, on real time, may send in between: then once more.)
  const auto held = [&](int w) {
    return c.logs.wait_for(
        {"worker:" + std::to_string(w) + " (rank " + std::to_string(w) + ") sent no heartbeat for ",
         "but its process"},
        0ms);
  };
  for (int tries = 0; tries < 5 && !(held(1) && held(2)); ++tries)
    c.clock.advance(600ms, 600ms, {c.services[0].get()});
  EXPECT_TRUE(held(1) && held(2)) << c.logs.all();
  // Then everyone runs again: their heartbeats reach the chief, and nobody is lost.
  advance_until(
      c.clock, {c.services[0].get(), c.services[1].get(), c.services[2].get()},
      [&] {
        return c.logs.wait_for({"heard from worker:1 (rank 1) again after", "held up on this host"},
                               0ms) &&
               c.logs.wait_for({"heard from worker:2 (rank 2) again after"}, 0ms);
      },
      2s);
  EXPECT_TRUE(c.logs.wait_for({"heard from worker:2 (rank 2) again after"}, 0ms)) << c.logs.all();
  c.advance(1000ms);
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(c.lost[r]->events().empty())
        << "rank " << r << ": " << describe(c.lost[r]->events());
}

TEST(MembershipTest, ACrashedChiefIsReportedAsRankZeroByEveryWorker) {
  cluster c(3, [](membership::options& o) { o.peer_timeout = 10s; });
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[0]);
  for (int r = 1; r < 3; ++r) {
    auto e = c.lost[r]->wait_for(0, 5s);
    ASSERT_TRUE(e) << "rank " << r << "\n" << c.logs.all();
    EXPECT_EQ(e->ranks, std::vector<int>{0});
    EXPECT_NE(e->cause.find("worker:0 (rank 0): connection closed without leave"),
              std::string::npos)
        << e->cause;
  }
}

TEST(MembershipTest, ASuspendedChiefIsReportedAsRankZeroAfterThePeerTimeout) {
  cluster c(2, {}, timing::manual);
  ASSERT_TRUE(c.form());
  membership::service_test_access::suspend(*c.services[0]);
  c.advance(450ms);
  EXPECT_TRUE(c.lost[1]->events().empty()) << describe(c.lost[1]->events()) << c.logs.all();
  c.advance(50ms);
  auto e = c.lost[1]->wait_for(0, 0ms);
  ASSERT_TRUE(e) << c.logs.all();
  EXPECT_EQ(e->cause, "worker:0 (rank 0) sent no heartbeat for 500 ms");
  membership::service_test_access::crash(*c.services[0]); // as above
}

// Issue 33's clock offsets: each heartbeat of the chief echoes the worker's last one, so every
// heartbeat completes an NTP-style round trip, and the worker knows the chief's clock within half
// the round trip's delay.
/// A wall clock `ns` behind this host's, as another host's might be (options::wall_clock).
std::function<int64_t()> behind_by(int64_t ns) {
  return [ns] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::system_clock::now().time_since_epoch())
               .count() -
           ns;
  };
}

TEST(MembershipTest, TheHeartbeatsTellAWorkerHowFarTheChiefsClockIs) {
  constexpr int64_t behind = 2'500'000'000; // the worker's wall clock, as another host's might be
  cluster c(
      2,
      [](membership::options& o) {
        if (o.rank == 1)
          o.wall_clock = behind_by(behind);
      },
      timing::manual);
  ASSERT_TRUE(c.form());
  auto chief = c.services[0]->chief_clock_offset();
  EXPECT_TRUE(chief.known);
  EXPECT_EQ(chief.offset_ns, 0);
  advance_until(
      c.clock, {c.services[0].get(), c.services[1].get()},
      [&] { return c.services[1]->chief_clock_offset().samples >= 3; }, 600s);
  auto o = c.services[1]->chief_clock_offset();
  ASSERT_TRUE(o.known) << c.logs.all();
  EXPECT_GE(o.samples, 3u);
  EXPECT_GE(o.delay_ns, 0);
  EXPECT_LE(std::llabs(o.offset_ns - behind), o.delay_ns / 2 + 1000)
      << "offset " << o.offset_ns << " ns, delay " << o.delay_ns << " ns";
}

// A worker's first round trip comes with the view, not a heartbeat interval later: the view
// echoes its Join (when it was sent, when the chief received it) with the time the chief sent it.
// The rendezvous (the chief holding the Join) is not part of the delay.
TEST(MembershipTest, AWorkerKnowsTheChiefsClockFromTheView) {
  constexpr int64_t behind = 2'500'000'000;
  cluster c(
      3,
      [](membership::options& o) {
        o.heartbeat_interval = 60s; // no heartbeat within the test
        o.peer_timeout = 480s;
        if (o.rank == 2)
          o.wall_clock = behind_by(behind);
      },
      timing::manual);
  ASSERT_TRUE(c.form());
  for (int r : {1, 2}) {
    auto o = c.services[static_cast<size_t>(r)]->chief_clock_offset();
    ASSERT_TRUE(o.known) << "rank " << r << "\n" << c.logs.all();
    EXPECT_EQ(o.samples, 1u) << "rank " << r << ": the view's round trip, no heartbeat";
    EXPECT_GE(o.delay_ns, 0);
    const int64_t truth = r == 2 ? behind : 0;
    EXPECT_LE(std::llabs(o.offset_ns - truth), o.delay_ns / 2 + 1000)
        << "rank " << r << ": offset " << o.offset_ns << " ns, delay " << o.delay_ns << " ns";
  }
}

TEST(MembershipTest, AViewWithoutTheChiefsClockStillFormsAndLeavesTheOffsetUnknown) {
  // A chief whose messages carry no clock (0 is Cap'n Proto's absent field: a chief of a version
  // before the clock fields reads the same): the view forms as ever, and the workers know nothing
  // of its clock until a heartbeat round trip says more.
  cluster c(
      3,
      [](membership::options& o) {
        o.heartbeat_interval = 60s; // no heartbeat within the test
        o.peer_timeout = 480s;
        if (o.rank == 0)
          o.wall_clock = [] {
            return int64_t{0};
          };
      },
      timing::manual);
  auto views = c.rendezvous_all();
  for (int r : {1, 2}) {
    ASSERT_TRUE(views[static_cast<size_t>(r)]) << "rank " << r << "\n" << c.logs.all();
    EXPECT_EQ(views[static_cast<size_t>(r)]->members.size(), 3u);
    auto o = c.services[static_cast<size_t>(r)]->chief_clock_offset();
    EXPECT_FALSE(o.known) << "rank " << r << "\n" << c.logs.all();
    EXPECT_EQ(o.samples, 0u) << "rank " << r;
  }
}

TEST(MembershipTest, AMemberThatLeavesIsNotReportedLost) {
  cluster c(4, [](membership::options& o) { o.peer_timeout = 10s; });
  ASSERT_TRUE(c.form());
  c.services[1]->leave("finished");
  c.services[1]->leave("again"); // idempotent
  EXPECT_TRUE(c.logs.wait_for({"worker:0 (rank 0): worker:1 (rank 1) left: finished"}));
  // A later crash is then the only loss anyone reports.
  membership::service_test_access::crash(*c.services[3]);
  for (int r : {0, 2}) {
    ASSERT_TRUE(c.lost[r]->wait_for(3, 5s)) << "rank " << r << "\n" << c.logs.all();
    auto events = c.lost[r]->events();
    ASSERT_EQ(events.size(), 1u) << "rank " << r << ": " << describe(events);
    EXPECT_EQ(events[0].ranks, std::vector<int>{3});
  }
  EXPECT_TRUE(c.lost[1]->events().empty()) << describe(c.lost[1]->events());
}

// A member whose peer is suspended (takes no Leave, never closes its side) still goes: its
// graceful close lingers until the peer timeout (500 ms here) on its clock, then gives up. On a
// manual clock: while the clock stands still it waits; once the clock passes the linger, the
// service's own periodic check ends it, in milliseconds of wall time.
TEST(MembershipTest, DestroyingAMemberWhosePeerIsSuspendedEndsAtItsLinger) {
  cluster c(2, {}, timing::manual);
  ASSERT_TRUE(c.form());
  membership::service_test_access::suspend(
      *c.services[0]); // takes no Leave and never closes its side
  auto started = clock_type::now();
  auto gone = std::async(std::launch::async, [&] { c.services[1].reset(); });
  EXPECT_FALSE(gone.wait_for(30ms) == std::future_status::ready) << "ended before its linger";
  // The clock moves without running the checks (the service is going away under them): the
  // service's periodic check, every 50 ms of real time at most, sees the linger pass.
  milliseconds moved{0};
  while (!ready(gone) && moved < 60s) {
    c.clock.advance(10ms, 10ms, {});
    moved += 10ms;
    gone.wait_for(1ms);
  }
  gone.get();
  EXPECT_GE(moved, 500ms - 10ms);
  EXPECT_LT(clock_type::now() - started, consort::test::scaled(2s))
      << "the real-time guard ended it, not the clock";
  started = clock_type::now();
  c.services[0].reset(); // suspended: it sends no Leave and waits for nothing
  EXPECT_LT(clock_type::now() - started, consort::test::scaled(400ms))
      << "a suspended member waited to leave";
}

// -- elastic groups ------------------------------------------------------------------------------

/// Options of an elastic cluster of `n` workers that needs `min` members.
std::function<void(membership::options&)> elastic(int min) {
  return [min](membership::options& o) {
    o.elastic_min_members = min;
    o.peer_timeout = 10s; // only the end of a connection explains a prompt change
    o.reform_timeout = 10s;
  };
}

/// Waits until `lost` holds an event that begins epoch `epoch`; returns it, or nothing.
std::optional<membership::lost_event> wait_for_change(loss_recorder& lost, uint64_t epoch,
                                                      milliseconds timeout = 10s) {
  auto deadline = clock_type::now() + consort::test::scaled(timeout);
  while (clock_type::now() < deadline) {
    for (const auto& e : lost.events())
      if (e.next_epoch == epoch)
        return e;
    (void)lost.wait_for(-1, 20ms); // no event names rank -1: a bounded wait for the next one
  }
  return std::nullopt;
}

/// Every rank of `ranks` offers address 127.0.0.1:(22000 + 10 * epoch + rank) for the epoch
/// after `after`, at once; the results in the order of `ranks`.
std::vector<caf::expected<membership::view>> offer_all(cluster& c, const std::vector<int>& ranks,
                                                       uint64_t after) {
  std::vector<std::future<caf::expected<membership::view>>> futures;
  for (int r : ranks)
    futures.push_back(std::async(std::launch::async, [&c, r, after] {
      auto address = "127.0.0.1:" + std::to_string(22000 + 10 * (after + 1) + r);
      return c.services[static_cast<std::size_t>(r)]->next_view(
          after, address, clock_type::now() + consort::test::scaled(20s));
    }));
  std::vector<caf::expected<membership::view>> out;
  for (auto& f : futures)
    out.push_back(f.get());
  return out;
}

/// Every view in `views` formed and is `expected` (the epoch every member and the joiner share).
void expect_all_are(const std::vector<caf::expected<membership::view>>& views,
                    const membership::view& expected, cluster& c) {
  for (const auto& v : views) {
    ASSERT_TRUE(v) << text_of(v.error()) << c.logs.all();
    EXPECT_EQ(*v, expected);
  }
}

std::vector<std::string> member_tasks(const membership::view& v) {
  std::vector<std::string> out;
  for (const auto& m : v.members)
    out.push_back(consort::to_string(m.task) + "@" + std::to_string(m.rank) + "=" + m.address);
  return out;
}

TEST(ElasticMembershipTest, NextViewNeedsAnElasticGroup) {
  cluster c(2);
  ASSERT_TRUE(c.form());
  EXPECT_TRUE(has_error(c.services[1]->next_view(1, "127.0.0.1:1", clock_type::now() + 1s),
                        errc::invalid_argument, {"elastic", "elastic_min_members"}));
  membership::options bad = options_for(2, 0, "127.0.0.1:0", nullptr);
  bad.elastic_min_members = 3;
  auto refused = membership::service::start(bad);
  ASSERT_FALSE(refused);
  EXPECT_TRUE(has_error(refused.error(), errc::invalid_argument,
                        {"options.elastic_min_members is 3", "1 to the number of tasks, 2"}));
}

// The survivors of a crash form the next epoch without the crashed member: each is told the
// change once (naming it and the next epoch), offers its new address, and receives the same
// view, ranked from 0 in task order, with the addresses they offered.
TEST(ElasticMembershipTest, ACrashedWorkerIsLeftOutOfTheNextEpoch) {
  cluster c(4, elastic(2));
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[2]);
  for (int r : {0, 1, 3}) {
    auto e = wait_for_change(*c.lost[static_cast<std::size_t>(r)], 2);
    ASSERT_TRUE(e) << "rank " << r << ": "
                   << describe(c.lost[static_cast<std::size_t>(r)]->events()) << c.logs.all();
    EXPECT_EQ(e->ranks, std::vector<int>{2});
    EXPECT_NE(e->cause.find("worker:2 (rank 2)"), std::string::npos) << e->cause;
  }
  auto views = offer_all(c, {0, 1, 3}, 1);
  const std::vector<std::string> expected{
      "worker:0@0=127.0.0.1:22020", "worker:1@1=127.0.0.1:22021", "worker:3@2=127.0.0.1:22023"};
  for (std::size_t i = 0; i < views.size(); ++i) {
    ASSERT_TRUE(views[i]) << text_of(views[i].error()) << c.logs.all();
    EXPECT_EQ(views[i]->epoch, 2u);
    EXPECT_EQ(member_tasks(*views[i]), expected);
    EXPECT_EQ(views[i]->group_id, views[0]->group_id);
  }
  EXPECT_TRUE(c.logs.wait_for({"formed the view of epoch 2: 3 members", "without worker:2"}));
}

// A restarted worker joins the running group under its own task: the members are told of the
// change (the task joining, no one lost), offer their parts, and all of them, the new process
// included (its rendezvous), receive the view of the next epoch.
TEST(ElasticMembershipTest, ARestartedWorkerJoinsTheNextEpoch) {
  cluster c(3, elastic(2));
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[2]);
  auto second = offer_all(c, {0, 1}, 1);
  ASSERT_TRUE(second[0] && second[1]) << c.logs.all();
  // The restarted worker:2.
  auto opts = options_for(3, 2, c.chief_address, &c.logs);
  elastic(2)(opts);
  c.services[2] = start_ok(opts);
  ASSERT_TRUE(c.services[2]);
  auto joined = std::async(std::launch::async, [&c] { return c.services[2]->rendezvous(); });
  for (int r : {0, 1}) {
    auto e = wait_for_change(*c.lost[static_cast<std::size_t>(r)], 3);
    ASSERT_TRUE(e) << "rank " << r << c.logs.all();
    EXPECT_TRUE(e->ranks.empty());
    if (r == 0) { // the chief knows which task joins; the others learn it from the view
      EXPECT_EQ(e->joining, std::vector<int>{2});
    }
    EXPECT_NE(e->cause.find("worker:2 (rank 2) joins the group"), std::string::npos) << e->cause;
    EXPECT_TRUE(e->at_boundary); // a join alone: the members may finish their steps first
  }
  auto third = offer_all(c, {0, 1}, 2);
  auto joiner = joined.get();
  ASSERT_TRUE(joiner) << text_of(joiner.error()) << c.logs.all();
  EXPECT_EQ(joiner->epoch, 3u);
  ASSERT_EQ(joiner->members.size(), 3u);
  EXPECT_EQ(joiner->members[2].address, "127.0.0.1:21002"); // its Join's address
  expect_all_are(third, *joiner, c);
}

// A join waits for the members' next step boundary. Members that reach none within
// reform_timeout (a loop that does not commit) get the plain notice of the same epoch, which
// aborts their calls, and the re-formation goes on as after a loss.
TEST(ElasticMembershipTest, AJoinThatNoStepBoundaryMeetsInTimeBecomesAPlainNotice) {
  auto tweak = [](membership::options& o) {
    elastic(2)(o);
    o.reform_timeout = 1500ms; // the offers after the plain notice must come within it too
  };
  cluster c(3, tweak);
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[2]);
  auto second = offer_all(c, {0, 1}, 1);
  ASSERT_TRUE(second[0] && second[1]) << c.logs.all();
  auto opts = options_for(3, 2, c.chief_address, &c.logs);
  tweak(opts);
  c.services[2] = start_ok(opts);
  ASSERT_TRUE(c.services[2]);
  auto joined = std::async(std::launch::async, [&c] { return c.services[2]->rendezvous(); });
  // Nobody offers: first the notice that waits for a boundary, then, past reform_timeout, the
  // plain one of the same epoch.
  for (int r : {0, 1}) {
    auto& lost = *c.lost[static_cast<std::size_t>(r)];
    std::vector<membership::lost_event> of_3;
    const auto deadline = clock_type::now() + consort::test::scaled(10s);
    while (clock_type::now() < deadline) {
      of_3.clear();
      for (const auto& e : lost.events())
        if (e.next_epoch == 3)
          of_3.push_back(e);
      if (of_3.size() >= 2)
        break;
      (void)lost.wait_for(-1, 20ms); // no event names rank -1: a bounded wait for the next one
    }
    ASSERT_EQ(of_3.size(), 2u) << "rank " << r << ": " << describe(lost.events()) << c.logs.all();
    EXPECT_TRUE(of_3[0].at_boundary);
    EXPECT_FALSE(of_3[1].at_boundary);
    EXPECT_NE(of_3[1].cause.find("worker:2 (rank 2) joins the group"), std::string::npos)
        << of_3[1].cause;
  }
  EXPECT_TRUE(c.logs.wait_for({"not every member reached a step boundary within reform_timeout "
                               "(1500 ms): the calls of epoch 2 are aborted for epoch 3"}))
      << c.logs.all();
  auto third = offer_all(c, {0, 1}, 2);
  auto joiner = joined.get();
  ASSERT_TRUE(joiner) << text_of(joiner.error()) << c.logs.all();
  EXPECT_EQ(joiner->epoch, 3u);
  EXPECT_EQ(joiner->members.size(), 3u);
  expect_all_are(third, *joiner, c);
}

// A loss while a join waits for a step boundary aborts at once: the plain notice of the same
// epoch names the lost member, and the epoch holds the joiner without it.
TEST(ElasticMembershipTest, ALossWhileAJoinWaitsForABoundaryAbortsAtOnce) {
  cluster c(4, elastic(2));
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[3]);
  auto second = offer_all(c, {0, 1, 2}, 1);
  ASSERT_TRUE(second[0] && second[1] && second[2]) << c.logs.all();
  auto opts = options_for(4, 3, c.chief_address, &c.logs);
  elastic(2)(opts);
  c.services[3] = start_ok(opts);
  ASSERT_TRUE(c.services[3]);
  auto joined = std::async(std::launch::async, [&c] { return c.services[3]->rendezvous(); });
  for (int r : {0, 1}) {
    auto e = wait_for_change(*c.lost[static_cast<std::size_t>(r)], 3);
    ASSERT_TRUE(e) << "rank " << r << c.logs.all();
    EXPECT_TRUE(e->at_boundary);
  }
  membership::service_test_access::crash(*c.services[2]);
  for (int r : {0, 1}) {
    auto& lost = *c.lost[static_cast<std::size_t>(r)];
    ASSERT_TRUE(lost.wait_for(2)) << "rank " << r << c.logs.all();
    auto events = lost.events();
    const auto& e = events.back();
    EXPECT_EQ(e.next_epoch, 3u) << describe(events);
    EXPECT_EQ(e.ranks, std::vector<int>{2}) << describe(events);
    EXPECT_FALSE(e.at_boundary) << describe(events);
  }
  auto third = offer_all(c, {0, 1}, 2);
  auto joiner = joined.get();
  ASSERT_TRUE(joiner) << text_of(joiner.error()) << c.logs.all();
  EXPECT_EQ(joiner->epoch, 3u);
  EXPECT_EQ(member_tasks(*joiner).size(), 3u); // worker:0, worker:1 and the joiner
  expect_all_are(third, *joiner, c);
}

// A restart can come before its previous process is seen lost: a new process of a member's task
// replaces the old one, which is told that the group goes on without it.
TEST(ElasticMembershipTest, ANewProcessOfAMembersTaskReplacesItsPreviousProcess) {
  cluster c(3, elastic(2));
  ASSERT_TRUE(c.form());
  auto opts = options_for(3, 2, c.chief_address, &c.logs);
  elastic(2)(opts);
  auto again = start_ok(opts);
  ASSERT_TRUE(again);
  auto joined = std::async(std::launch::async, [&again] { return again->rendezvous(); });
  ASSERT_TRUE(wait_for_change(*c.lost[1], 2)) << c.logs.all();
  auto views = offer_all(c, {0, 1}, 1);
  auto v = joined.get();
  ASSERT_TRUE(v) << text_of(v.error()) << c.logs.all();
  EXPECT_EQ(v->epoch, 2u);
  EXPECT_EQ(v->members.size(), 3u);
  for (auto& other : views) {
    ASSERT_TRUE(other) << text_of(other.error());
    EXPECT_EQ(*other, *v);
  }
  EXPECT_TRUE(has_error(
      c.services[2]->next_view(1, "127.0.0.1:1", clock_type::now() + consort::test::scaled(10s)),
      errc::peer_lost, {"a new process of its task joined the group"}))
      << c.logs.all();
}

// A second loss while the group re-forms amends the re-formation under way: the members left
// form one next epoch without both, without waiting for the second's offer.
TEST(ElasticMembershipTest, ASecondLossDuringTheReformationIsLeftOutToo) {
  cluster c(4, [](membership::options& o) {
    elastic(2)(o);
    o.reform_timeout = 60s; // only the second loss, not the timeout, can let the view form
  });
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[3]);
  ASSERT_TRUE(wait_for_change(*c.lost[2], 2)) << c.logs.all();
  // 0 and 1 offer; 2 crashes before it offers.
  auto offers = std::async(std::launch::async, [&c] { return offer_all(c, {0, 1}, 1); });
  ASSERT_TRUE(c.logs.wait_for({"worker:1 (rank 1): offers its part of epoch 2"}));
  membership::service_test_access::crash(*c.services[2]);
  auto views = offers.get();
  for (auto& v : views) {
    ASSERT_TRUE(v) << text_of(v.error()) << c.logs.all();
    EXPECT_EQ(v->epoch, 2u);
    EXPECT_EQ(v->members.size(), 2u);
  }
}

// A member that does not offer its part within reform_timeout is left out, and told so.
TEST(ElasticMembershipTest, AMemberThatDoesNotOfferItsPartIsLeftOutAtTheTimeout) {
  cluster c(4, [](membership::options& o) {
    elastic(2)(o);
    o.reform_timeout = 300ms;
  });
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[3]);
  auto views = offer_all(c, {0, 1}, 1);
  for (auto& v : views) {
    ASSERT_TRUE(v) << text_of(v.error()) << c.logs.all();
    EXPECT_EQ(member_tasks(*v).size(), 2u);
  }
  EXPECT_TRUE(has_error(
      c.services[2]->next_view(1, "127.0.0.1:1", clock_type::now() + consort::test::scaled(10s)),
      errc::peer_lost, {"left out of epoch 2"}));
}

// Partitions: members lost to silence may be alive and go on under the chief's successor on
// the other side of a cut. The chief's side goes on only with half of the epoch's members (ties
// go to the chief), a successor's only with more than half, so that two sides never both do
// (tests/multiworker/elastic_partition_test.sh cuts a successor off with real processes).
/// elastic(1), where silence is found in 500 ms.
void elastic_and_quick(membership::options& o) {
  elastic(1)(o);
  o.peer_timeout = 500ms;
}

TEST(ElasticMembershipTest, AChiefLeftWithFewerThanHalfAfterSilencesEndsTheGroup) {
  cluster c(3, elastic_and_quick);
  ASSERT_TRUE(c.form());
  membership::service_test_access::suspend(*c.services[1]);
  membership::service_test_access::suspend(*c.services[2]);
  EXPECT_TRUE(has_error(
      c.services[0]->next_view(1, "127.0.0.1:1", clock_type::now() + consort::test::scaled(10s)),
      errc::peer_lost,
      {"1 of the 3 members of epoch 1 remain, fewer than half",
       "the others may go on under a successor behind a partition"}))
      << c.logs.all();
  membership::service_test_access::crash(*c.services[1]);
  membership::service_test_access::crash(*c.services[2]);
}

TEST(ElasticMembershipTest, AChiefLeftWithHalfAfterSilencesGoesOnAndCrashesNeedNoQuorum) {
  cluster half(4, elastic_and_quick);
  ASSERT_TRUE(half.form());
  membership::service_test_access::suspend(*half.services[2]);
  membership::service_test_access::suspend(*half.services[3]);
  for (auto& v : offer_all(half, {0, 1}, 1)) {
    ASSERT_TRUE(v) << text_of(v.error()) << half.logs.all();
    EXPECT_EQ(v->members.size(), 2u);
  }
  membership::service_test_access::crash(*half.services[2]);
  membership::service_test_access::crash(*half.services[3]);
  // Crashed members (their connections closed) are dead: the chief goes on alone.
  cluster crashed(3, elastic_and_quick);
  ASSERT_TRUE(crashed.form());
  membership::service_test_access::crash(*crashed.services[1]);
  membership::service_test_access::crash(*crashed.services[2]);
  auto alone = offer_all(crashed, {0}, 1);
  ASSERT_TRUE(alone[0]) << text_of(alone[0].error()) << crashed.logs.all();
  EXPECT_EQ(alone[0]->members.size(), 1u);
}

// The successor's side: of 2, the other member of a chief that fell silent is no majority (the
// chief may lead on behind a cut), so it ends the group rather than lead one of its own; a
// chief that crashed is dead, and its successor leads alone.
TEST(ElasticMembershipTest, ASuccessorWithoutAMajorityAfterTheChiefFellSilentEndsTheGroup) {
  cluster c(2, elastic_and_quick);
  ASSERT_TRUE(c.form());
  membership::service_test_access::suspend(*c.services[0]);
  EXPECT_TRUE(has_error(
      c.services[1]->next_view(1, "127.0.0.1:1", clock_type::now() + consort::test::scaled(10s)),
      errc::peer_lost,
      {"1 of the 2 members of epoch 1 remain, not a majority",
       "the lost chief may go on with the others behind a partition"}))
      << c.logs.all();
  membership::service_test_access::crash(*c.services[0]);
  cluster crashed(2, elastic_and_quick);
  ASSERT_TRUE(crashed.form());
  membership::service_test_access::crash(*crashed.services[0]);
  auto alone = offer_all(crashed, {1}, 1);
  ASSERT_TRUE(alone[0]) << text_of(alone[0].error()) << crashed.logs.all();
  EXPECT_EQ(alone[0]->members.size(), 1u);
}

TEST(ElasticMembershipTest, FewerMembersThanTheMinimumEndTheGroupEverywhere) {
  cluster c(3, elastic(3));
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[1]);
  for (int r : {0, 2})
    EXPECT_TRUE(has_error(c.services[static_cast<std::size_t>(r)]->next_view(
                              1, "127.0.0.1:1", clock_type::now() + consort::test::scaled(10s)),
                          errc::peer_lost, {"2 members remain, fewer than the 3 it needs"}))
        << "rank " << r << c.logs.all();
}

// The chief is lost: the first member after it succeeds it, and the others reach it at the
// standby address the view gave; the next epoch is led by it (rank 0), and it leads the
// re-formations after that too.
TEST(ElasticMembershipTest, ALostChiefIsSucceededByTheFirstMemberAfterIt) {
  cluster c(4, elastic(2));
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[0]);
  for (int r : {1, 2, 3}) {
    auto e = wait_for_change(*c.lost[static_cast<std::size_t>(r)], 2);
    ASSERT_TRUE(e) << "rank " << r << c.logs.all();
    EXPECT_EQ(e->ranks, std::vector<int>{0});
    EXPECT_NE(e->cause.find("worker:1 succeeds it"), std::string::npos) << e->cause;
  }
  auto views = offer_all(c, {1, 2, 3}, 1);
  const std::vector<std::string> expected{
      "worker:1@0=127.0.0.1:22021", "worker:2@1=127.0.0.1:22022", "worker:3@2=127.0.0.1:22023"};
  for (auto& v : views) {
    ASSERT_TRUE(v) << text_of(v.error()) << c.logs.all();
    EXPECT_EQ(v->epoch, 2u);
    EXPECT_EQ(member_tasks(*v), expected);
    EXPECT_EQ(*v, *views[0]);
  }
  EXPECT_TRUE(c.logs.wait_for({"worker:1 (rank 1): succeeds the lost chief"}));
  // The successor leads the next change as the chief did.
  membership::service_test_access::crash(*c.services[3]);
  ASSERT_TRUE(wait_for_change(*c.lost[2], 3)) << c.logs.all();
  auto third = offer_all(c, {1, 2}, 2);
  for (auto& v : third) {
    ASSERT_TRUE(v) << text_of(v.error()) << c.logs.all();
    EXPECT_EQ(v->epoch, 3u);
    EXPECT_EQ(v->members.size(), 2u);
    EXPECT_EQ(v->members[0].task, (consort::task_id{"worker", 1}));
  }
  // A restarted worker:3 knows only the chief's address from its cluster: the successor, on the
  // same host, serves there too, and it joins the group it leads.
  auto opts = options_for(4, 3, c.chief_address, &c.logs);
  elastic(2)(opts);
  c.services[3] = start_ok(opts);
  ASSERT_TRUE(c.services[3]);
  auto joined = std::async(std::launch::async, [&c] { return c.services[3]->rendezvous(); });
  ASSERT_TRUE(wait_for_change(*c.lost[2], 4)) << c.logs.all();
  auto fourth = offer_all(c, {1, 2}, 3);
  auto v = joined.get();
  ASSERT_TRUE(v) << text_of(v.error()) << c.logs.all();
  EXPECT_EQ(v->epoch, 4u);
  EXPECT_EQ(v->members.size(), 3u);
  for (auto& other : fourth) {
    ASSERT_TRUE(other) << text_of(other.error());
    EXPECT_EQ(*other, *v);
  }
}

// Only the first member after the chief may succeed it (a second candidate could split the
// group): when both are gone, the group ends for the others.
TEST(ElasticMembershipTest, LosingTheChiefAndItsSuccessorEndsTheGroup) {
  cluster c(4, [](membership::options& o) {
    elastic(1)(o);
    o.reform_timeout = 500ms;
  });
  ASSERT_TRUE(c.form());
  membership::service_test_access::crash(*c.services[1]);
  membership::service_test_access::crash(*c.services[0]);
  for (int r : {2, 3})
    EXPECT_TRUE(has_error(c.services[static_cast<std::size_t>(r)]->next_view(
                              1, "127.0.0.1:1", clock_type::now() + consort::test::scaled(10s)),
                          errc::peer_lost, {}))
        << "rank " << r << c.logs.all();
}

} // namespace
