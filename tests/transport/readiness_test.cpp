// The TCP transport's readiness (transport/tcp/poller.hpp): the poller reports only what a
// descriptor is armed for, re-reports a readiness that came while it was disarmed, and calls a
// deferred target back once; a pair leaves the reading to a thread inside `reading_here`, gives
// it back to the poller when that thread blocks, and after the defer grace when no thread comes
// back. No test sleeps: each waits on an event with a deadline, and "did not happen" is checked
// at a point that the event would have had to pass first.

#include "transport/tcp/poller.hpp"

#include "support/transport_helpers.hpp"

#include <consort/transport/pair.hpp>
#include <consort/transport/tcp.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

namespace {

using namespace std::chrono_literals;
using consort::test::text_of;
namespace transport = consort::transport;
namespace tcp = consort::transport::tcp;
using clock_type = std::chrono::steady_clock;

// -- the poller ----------------------------------------------------------------------------------

/// A connected pair of Unix stream sockets, closed at the end.
struct socket_pair {
  int fd[2] = {-1, -1};
  socket_pair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, fd), 0); }
  ~socket_pair() {
    ::close(fd[0]);
    ::close(fd[1]);
  }
  void put(char c) { ASSERT_EQ(::write(fd[1], &c, 1), 1); }
  /// Reads what is there (to EAGAIN), so that the reading end is no longer readable.
  void drain() {
    char buf[64];
    while (::read(fd[0], buf, sizeof(buf)) > 0) {
    }
  }
};

/// Counts what the poller reports, and lets a test wait for the count to reach a value.
class recorder final : public tcp::ready_target {
public:
  void on_ready(uint32_t events) override {
    std::lock_guard lock(mu_);
    ++ready_;
    last_events_ = events;
    if (on_ready_hook)
      on_ready_hook();
    cv_.notify_all();
  }
  void on_deferred() override {
    std::lock_guard lock(mu_);
    ++deferred_;
    deferred_at_ = clock_type::now();
    cv_.notify_all();
  }
  /// Waits (at most 10 s) until `on_ready` ran `n` times in all; false when it did not.
  bool wait_ready(int n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 10s, [&] { return ready_ >= n; });
  }
  bool wait_deferred(int n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, 10s, [&] { return deferred_ >= n; });
  }
  int ready() {
    std::lock_guard lock(mu_);
    return ready_;
  }
  int deferred() {
    std::lock_guard lock(mu_);
    return deferred_;
  }
  uint32_t last_events() {
    std::lock_guard lock(mu_);
    return last_events_;
  }
  clock_type::time_point deferred_at() {
    std::lock_guard lock(mu_);
    return deferred_at_;
  }
  std::function<void()> on_ready_hook; // runs under the recorder's lock, on the poller's thread

private:
  std::mutex mu_;
  std::condition_variable cv_;
  int ready_ = 0;
  int deferred_ = 0;
  uint32_t last_events_ = 0;
  clock_type::time_point deferred_at_{};
};

TEST(ReadinessPoller, ReportsAReadableDescriptorOnceUntilItIsArmedAgain) {
  tcp::readiness_poller poller;
  socket_pair s;
  recorder target;
  ASSERT_EQ(poller.add(s.fd[0], &target, EPOLLIN), "");
  s.put('a');
  ASSERT_TRUE(target.wait_ready(1));
  EXPECT_NE(target.last_events() & EPOLLIN, 0u);
  // One-shot: still readable (nothing was read), but not reported until re-armed; re-arming a
  // descriptor that is already ready reports it at once (level-triggered).
  ASSERT_EQ(poller.arm(s.fd[0], &target, EPOLLIN), "");
  ASSERT_TRUE(target.wait_ready(2));
  poller.remove(s.fd[0]);
}

TEST(ReadinessPoller, ADisarmedDescriptorIsNotReportedAndArmingItReportsWhatCameMeanwhile) {
  tcp::readiness_poller poller;
  socket_pair quiet;
  socket_pair marker;
  recorder quiet_target;
  recorder marker_target;
  ASSERT_EQ(poller.add(quiet.fd[0], &quiet_target, 0), ""); // armed for nothing
  ASSERT_EQ(poller.add(marker.fd[0], &marker_target, EPOLLIN), "");
  quiet.put('q');
  // The marker becomes readable after `quiet` did: had `quiet` been armed, the poller would have
  // harvested it no later than the marker.
  marker.put('m');
  ASSERT_TRUE(marker_target.wait_ready(1));
  EXPECT_EQ(quiet_target.ready(), 0) << "a descriptor armed for nothing was reported";
  ASSERT_EQ(poller.arm(quiet.fd[0], &quiet_target, EPOLLIN), "");
  ASSERT_TRUE(quiet_target.wait_ready(1)) << "the readiness that came while disarmed was lost";
  poller.remove(quiet.fd[0]);
  poller.remove(marker.fd[0]);
}

TEST(ReadinessPoller, ADeferredTargetIsCalledBackOnceAfterTheGraceAndAnUndeferredOneNot) {
  tcp::readiness_poller poller;
  recorder kept;
  recorder dropped;
  const auto start = clock_type::now();
  poller.defer(&dropped);
  poller.defer(&kept);
  poller.defer(&kept); // twice: still one call back
  poller.undefer(&dropped);
  ASSERT_TRUE(kept.wait_deferred(1));
  // Timers do not fire early; the first defer armed the timer for the whole grace.
  EXPECT_GE(kept.deferred_at() - start, tcp::readiness_poller::defer_grace);
  // Both were due at the same expiry, which called `kept` back: `dropped` would have been too.
  EXPECT_EQ(dropped.deferred(), 0);
  // A later defer arms a new expiry, which calls it back once more (and only once).
  poller.defer(&kept);
  ASSERT_TRUE(kept.wait_deferred(2));
  EXPECT_EQ(kept.deferred(), 2);
}

TEST(ReadinessPoller, StopEndsTheThreadAndIsIdempotent) {
  auto poller = std::make_unique<tcp::readiness_poller>();
  socket_pair s;
  recorder target;
  ASSERT_EQ(poller->add(s.fd[0], &target, EPOLLIN), "");
  poller->stop();
  poller->stop();
  s.put('x');
  poller.reset(); // joins nothing more; reports nothing after stop
  EXPECT_EQ(target.ready(), 0);
}

// -- pairs: who reads --------------------------------------------------------------------------

using context_ptr = std::shared_ptr<tcp::context>;

/// Which threads read from which peer's socket, per rank (test_hooks::before_read).
struct read_log {
  std::mutex mu;
  std::condition_variable cv;
  std::map<int, std::vector<std::thread::id>> by_peer; // peer -> reading threads, in order
  std::map<int, int> woken;                            // peer -> the poller's events for it

  /// Forgets the reads so far (those of the mesh's start: each pair reads once when it opens,
  /// on the I/O thread, before `connect` returns).
  void clear() {
    std::lock_guard lock(mu);
    by_peer.clear();
    woken.clear();
  }
  void wake(int peer) {
    std::lock_guard lock(mu);
    ++woken[peer];
  }
  int wakes(int peer) {
    std::lock_guard lock(mu);
    return woken[peer];
  }
  void add(int peer) {
    std::lock_guard lock(mu);
    by_peer[peer].push_back(std::this_thread::get_id());
    cv.notify_all();
  }
  /// Whether a thread other than `who` read from `peer`'s socket.
  bool read_by_other(int peer, std::thread::id who) {
    std::lock_guard lock(mu);
    for (auto id : by_peer[peer])
      if (id != who)
        return true;
    return false;
  }
  /// Waits (at most 10 s) until a thread other than `who` reads from `peer`'s socket.
  bool wait_read_by_other(int peer, std::thread::id who) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, 10s, [&] {
      for (auto id : by_peer[peer])
        if (id != who)
          return true;
      return false;
    });
  }
};

/// A group of `n` TCP contexts on loopback; rank 0's reads and poller events are logged in `log`.
std::vector<context_ptr> make_group(int n, read_log& log, std::chrono::microseconds spin = 50us) {
  auto ctxs = consort::test::make_tcp_mesh(
      n, [&](int, tcp::mesh_options& opts) { opts.spin = spin; },
      [&](int rank, tcp::test_hooks& hooks) {
        if (rank == 0) {
          hooks.before_read = [&log](int peer) {
            log.add(peer);
          };
          hooks.on_readiness = [&log](int peer) {
            log.wake(peer);
          };
        }
      });
  log.clear();
  return ctxs;
}

transport::send_parts bytes_of(const std::vector<std::byte>& b) {
  return {transport::const_bytes(b)};
}

/// Rank 0 receives `data` (tag 1) from rank 1 inside `reading_here`, as a small exchange does.
::testing::AssertionResult small_exchange(const std::vector<context_ptr>& ctxs,
                                          const std::vector<std::byte>& data) {
  std::vector<std::byte> in(data.size());
  transport::reading_here_scope reading{ctxs[0]->to(1)};
  auto recv = ctxs[0]->to(1).recv(1, {in.data(), in.size()});
  if (auto err = ctxs[1]->to(0).send(1, bytes_of(data))->wait(clock_type::now() + 10s))
    return ::testing::AssertionFailure() << "send: " << text_of(err);
  if (auto err = recv->wait(clock_type::now() + 10s))
    return ::testing::AssertionFailure() << "recv: " << text_of(err);
  if (in != data)
    return ::testing::AssertionFailure() << "the message arrived changed";
  return ::testing::AssertionSuccess();
}

TEST(TcpReading, AThreadInsideReadingHereReadsItsMessageItselfAndThePollerIsNotWoken) {
  read_log log;
  auto ctxs = make_group(3, log);
  ASSERT_EQ(ctxs.size(), 3u);
  const auto me = std::this_thread::get_id();
  const std::vector<std::byte> data(64, std::byte{7}), marker(8, std::byte{9});
  std::vector<std::byte> in(64), marker_in(8);
  // Rank 0 is about to receive from rank 1: the message arrives before rank 0 waits for it.
  transport::reading_here_scope reading{ctxs[0]->to(1)};
  auto recv = ctxs[0]->to(1).recv(5, {in.data(), in.size()});
  auto sent = ctxs[1]->to(0).send(5, bytes_of(data));
  ASSERT_FALSE(sent->wait(clock_type::now() + 10s));
  // A marker from rank 2, which no thread of rank 0 waits for: the poller reads it. By then it
  // has harvested the readiness of rank 1's message, which came first, had it been armed.
  auto marker_sent = ctxs[2]->to(0).send(6, bytes_of(marker));
  ASSERT_FALSE(marker_sent->wait(clock_type::now() + 10s));
  ASSERT_TRUE(log.wait_read_by_other(2, me)) << "the poller never read rank 2's marker";
  EXPECT_FALSE(log.read_by_other(1, me))
      << "another thread read rank 1's message while this one was inside reading_here";
  EXPECT_EQ(log.wakes(1), 0) << "the poller was woken for rank 1's message";
  ASSERT_FALSE(recv->wait(clock_type::now() + 10s));
  EXPECT_EQ(in, data);
  EXPECT_FALSE(log.read_by_other(1, me));
  auto marker_recv = ctxs[0]->to(2).recv(6, {marker_in.data(), marker_in.size()});
  ASSERT_FALSE(marker_recv->wait(clock_type::now() + 10s));
  EXPECT_EQ(marker_in, marker);
}

TEST(TcpReading, AWaitThatBlocksInsideReadingHereHandsTheReadingBackToThePoller) {
  read_log log;
  // No spin: a wait blocks at once, so the poller must read for it.
  auto ctxs = make_group(2, log, 0us);
  ASSERT_EQ(ctxs.size(), 2u);
  for (int round = 0; round < 20; ++round) {
    const uint64_t tag = 100 + static_cast<uint64_t>(round) * 2;
    std::vector<std::byte> in(16), go_in(1);
    const std::vector<std::byte> data(16, static_cast<std::byte>(round)), go(1, std::byte{1});
    // Rank 1 sends only once rank 0 asked for it, so the message arrives while rank 0 blocks.
    auto peer = std::async(std::launch::async, [&] {
      auto asked = ctxs[1]->to(0).recv(tag, {go_in.data(), go_in.size()});
      if (auto err = asked->wait(clock_type::now() + 10s))
        return err;
      return ctxs[1]->to(0).send(tag + 1, bytes_of(data))->wait(clock_type::now() + 10s);
    });
    {
      transport::reading_here_scope reading{ctxs[0]->to(1)};
      auto recv = ctxs[0]->to(1).recv(tag + 1, {in.data(), in.size()});
      ASSERT_FALSE(ctxs[0]->to(1).send(tag, bytes_of(go))->wait(clock_type::now() + 10s));
      auto err = recv->wait(clock_type::now() + 10s);
      ASSERT_FALSE(err) << "round " << round << ": " << text_of(err);
    }
    EXPECT_EQ(in, data);
    ASSERT_FALSE(peer.get());
  }
}

TEST(TcpReading, AfterReadingHereThePollerReadsAgainOnceTheGraceHasPassed) {
  read_log log;
  auto ctxs = make_group(2, log);
  ASSERT_EQ(ctxs.size(), 2u);
  const auto me = std::this_thread::get_id();
  std::vector<std::byte> in(8);
  const std::vector<std::byte> first(8, std::byte{1}), second(8, std::byte{2});
  // A small exchange of this thread's; it ends with the reading left to this thread for the
  // grace (the next exchange is expected soon).
  ASSERT_TRUE(small_exchange(ctxs, first));
  EXPECT_FALSE(log.read_by_other(1, me));
  EXPECT_EQ(log.wakes(1), 0) << "the poller was woken inside reading_here";
  // This thread does not come back: a message that no thread waits for is read by the poller
  // once the grace has passed, not left in the socket.
  ASSERT_FALSE(ctxs[1]->to(0).send(2, bytes_of(second))->wait(clock_type::now() + 10s));
  EXPECT_TRUE(log.wait_read_by_other(1, me)) << "nothing read rank 1's socket after the grace";
  auto recv = ctxs[0]->to(1).recv(2, {in.data(), in.size()});
  ASSERT_FALSE(recv->wait(clock_type::now() + 10s));
  EXPECT_EQ(in, second);
}

TEST(TcpReading, APeerThatGoesAwayDuringTheGraceIsSeenWithoutAWaiter) {
  read_log log;
  auto ctxs = make_group(2, log);
  ASSERT_EQ(ctxs.size(), 2u);
  const auto me = std::this_thread::get_id();
  std::vector<std::byte> in(8);
  const std::vector<std::byte> data(8, std::byte{3});
  ASSERT_TRUE(small_exchange(ctxs, data));
  // Rank 1 dies; no thread of rank 0 waits. The poller reads its end once the grace passed.
  ctxs[1].reset();
  ASSERT_TRUE(log.wait_read_by_other(1, me));
  // A receive posted afterwards fails at once with the cause, whoever read the end.
  auto recv = ctxs[0]->to(1).recv(2, {in.data(), in.size()});
  auto err = recv->wait(clock_type::now() + 10s);
  EXPECT_TRUE(consort::test::has_error(err, consort::errc::peer_lost, {"rank 1"})) << text_of(err);
}

} // namespace
