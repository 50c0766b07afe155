// The shared-memory transport (transport/shm) against the contract of
// include/consort/transport/pair.hpp, case by case as local_test.cpp and close_test.cpp check the
// local and TCP transports: ranks that are threads of this process over one segment
// (shm::make_group), messages much larger than the ring, close; then ranks that are processes: a
// fork()ed child and this process form a 2-rank TCP bootstrap group, then a shared-memory group
// over it (shm::connect), exchange, close, or the child is killed mid-wait.
// Nothing sleeps: every wait is an operation with a deadline, a future, or waitpid for a child
// that ends itself (alarm) if a test goes wrong.

#include "support/expect_error.hpp"
#include "support/scoped_env.hpp"
#include "support/time_scale.hpp"
#include "support/transport_helpers.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/local.hpp>
#include <consort/transport/pair.hpp>
#include <consort/transport/shm.hpp>
#include <consort/transport/tcp.hpp>

#include <caf/error.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

namespace consort::transport {
namespace {

using namespace std::chrono_literals;
using consort::test::fails_with;
using consort::test::has_error;
using consort::test::text_of;
using bytes = std::vector<std::byte>;

/// A deadline that a correct test never reaches.
deadline later() {
  return clock::now() + 20s;
}

bytes bytes_of(const std::string& text) {
  bytes out(text.size());
  if (!text.empty())
    std::memcpy(out.data(), text.data(), text.size());
  return out;
}

std::string string_of(const bytes& data) {
  return std::string{reinterpret_cast<const char*>(data.data()), data.size()};
}

/// `size` bytes that differ with `seed` and repeat only every 251 bytes, so that a misplaced
/// chunk of a message streamed through a ring of 2^k bytes shows.
bytes pattern(std::size_t size, unsigned seed) {
  bytes out(size);
  for (std::size_t i = 0; i < size; ++i)
    out[i] = static_cast<std::byte>((i + seed * 37) % 251);
  return out;
}

/// The smallest rings the transport takes, so that a message of a few KiB already wraps.
shm::options small_rings() {
  shm::options opts;
  opts.ring_bytes = 4096;
  return opts;
}

/// Skips the test where this machine cannot run the transport (no usable /dev/shm).
#define CONSORT_TEST_SKIP_WITHOUT_SHM()                                                            \
  do {                                                                                             \
    if (auto why = shm::unavailable_reason(); !why.empty())                                        \
      GTEST_SKIP() << "no shared memory here: " << why;                                            \
  } while (false)

// -- the pair contract, ranks are threads ------------------------------------------------------

TEST(ShmTransportTest, SendBeforeReceiveDeliversTheBytes) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  auto payload = bytes_of("hello");
  auto send = group[0]->to(1).send(7, {payload});
  bytes into(5);
  auto recv = group[1]->to(0).recv(7, into);
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
  EXPECT_EQ(string_of(into), "hello");
  EXPECT_EQ(recv->message_bytes(), 5u);
  EXPECT_EQ(send->message_bytes(), 5u);
}

TEST(ShmTransportTest, ReceiveBeforeSendDeliversTheBytes) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  bytes into(5);
  auto recv = group[1]->to(0).recv(7, into);
  EXPECT_FALSE(recv->done());
  EXPECT_EQ(recv->message_bytes(), 0u) << "nothing received yet";
  auto payload = bytes_of("world");
  auto send = group[0]->to(1).send(7, {payload});
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
  EXPECT_EQ(string_of(into), "world");
}

// Open MPI's mpi_yield_when_idle: on when the group's ranks outnumber the CPUs this process may
// run on, unless the launcher bound it to cores of its own; the option, then the environment,
// override that.
TEST(ShmTransportTest, WaitsYieldTheCoreExactlyWhenTheRanksOutnumberTheCpus) {
  using test::scoped_env;
  scoped_env no_choice{"CONSORT_YIELD_WHEN_IDLE", nullptr};
  scoped_env not_bound{"CONSORT_LAUNCH_CPUS", nullptr};
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int cpus = CPU_COUNT(&set);
  EXPECT_FALSE(shm::yields_when_idle(std::nullopt, cpus));
  EXPECT_TRUE(shm::yields_when_idle(std::nullopt, cpus + 1));
  EXPECT_TRUE(shm::yields_when_idle(true, 1));
  EXPECT_FALSE(shm::yields_when_idle(false, cpus + 1));
  {
    scoped_env bound{"CONSORT_LAUNCH_CPUS", "0"};
    EXPECT_FALSE(shm::yields_when_idle(std::nullopt, cpus + 1));
  }
  {
    scoped_env on{"CONSORT_YIELD_WHEN_IDLE", "1"};
    EXPECT_TRUE(shm::yields_when_idle(std::nullopt, 1));
    EXPECT_FALSE(shm::yields_when_idle(false, 1)) << "the option comes before the environment";
  }
  scoped_env off{"CONSORT_YIELD_WHEN_IDLE", "0"};
  EXPECT_FALSE(shm::yields_when_idle(std::nullopt, cpus + 1));
}

// A yielding wait still completes every kind of exchange: a ring all-reduce among more ranks than
// this machine may have cores, small and larger than the ring.
TEST(ShmTransportTest, AGroupThatYieldsWhileWaitingCompletesItsAllReduces) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto opts = small_rings();
  opts.yield_when_idle = true;
  opts.yield_spin = std::chrono::microseconds{200};
  auto group = shm::make_group(4, opts);
  for (std::size_t n : {std::size_t{1}, std::size_t{100000}}) {
    std::vector<std::future<std::vector<float>>> ranks;
    for (int r = 0; r < 4; ++r)
      ranks.push_back(std::async(std::launch::async, [&, r] {
        std::vector<float> v(n, static_cast<float>(r + 1));
        auto err = transport::ring_all_reduce{group[static_cast<std::size_t>(r)], v.data(), n,
                                              dtype::float32, reduce_op::sum}
                       .run();
        EXPECT_FALSE(err) << to_consort_error(err, "").what();
        return v;
      }));
    for (auto& f : ranks) {
      auto v = f.get();
      EXPECT_EQ(v.front(), 10.0f);
      EXPECT_EQ(v.back(), 10.0f);
    }
  }
}

TEST(ShmTransportTest, SendGathersItsPartsInOrder) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2, small_rings());
  // The last part is larger than the ring: the gather goes on as the ring drains.
  auto a = bytes_of("head|");
  auto b = bytes_of("");
  auto c = pattern(10000, 3);
  bytes into(a.size() + c.size());
  auto recv = group[0]->to(1).recv(1, into);
  auto send = group[1]->to(0).send(1, {a, b, c});
  ASSERT_FALSE(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
  EXPECT_EQ(string_of(bytes(into.begin(), into.begin() + 5)), "head|");
  EXPECT_EQ(bytes(into.begin() + 5, into.end()), c);
  EXPECT_EQ(send->message_bytes(), into.size());
}

/// "m0", "m1", ... (built with append: g++ 12 warns falsely on "m" + std::to_string(i)).
std::string label(int i) {
  std::string out{"m"};
  out.append(std::to_string(i));
  return out;
}

TEST(ShmTransportTest, MessagesWithOneTagArriveInSendOrder) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  std::vector<bytes> payloads;
  for (int i = 0; i < 10; ++i)
    payloads.push_back(bytes_of(label(i)));
  std::vector<operation_ptr> sends;
  for (int i = 0; i < 5; ++i)
    sends.push_back(group[0]->to(1).send(3, {payloads[static_cast<size_t>(i)]}));
  std::vector<bytes> into(10, bytes(2));
  std::vector<operation_ptr> recvs;
  for (auto& buffer : into)
    recvs.push_back(group[1]->to(0).recv(3, buffer));
  // The second half is sent after its receives were posted.
  for (int i = 5; i < 10; ++i)
    sends.push_back(group[0]->to(1).send(3, {payloads[static_cast<size_t>(i)]}));
  ASSERT_FALSE(wait_all(recvs, later()));
  ASSERT_FALSE(wait_all(sends, later()));
  for (int i = 0; i < 10; ++i)
    EXPECT_EQ(string_of(into[static_cast<size_t>(i)]), label(i));
}

TEST(ShmTransportTest, ReceivesMatchByTagNotByPostingOrder) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  bytes first(1);
  bytes second(1);
  auto recv_tag2 = group[1]->to(0).recv(2, second);
  auto recv_tag1 = group[1]->to(0).recv(1, first);
  std::array<std::byte, 1> one{std::byte{1}};
  std::array<std::byte, 1> two{std::byte{2}};
  auto send1 = group[0]->to(1).send(1, {one});
  EXPECT_FALSE(recv_tag1->wait(later()));
  EXPECT_FALSE(recv_tag2->done());
  auto send2 = group[0]->to(1).send(2, {two});
  EXPECT_FALSE(recv_tag2->wait(later()));
  EXPECT_FALSE(wait_all({send1, send2}, later()));
  EXPECT_EQ(first[0], std::byte{1});
  EXPECT_EQ(second[0], std::byte{2});
}

TEST(ShmTransportTest, ChannelsFromDifferentPeersAreIndependent) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(3);
  std::array<std::byte, 1> from1{std::byte{1}};
  std::array<std::byte, 1> from2{std::byte{2}};
  auto s2 = group[2]->to(0).send(9, {from2});
  auto s1 = group[1]->to(0).send(9, {from1});
  bytes a(1);
  bytes b(1);
  auto r1 = group[0]->to(1).recv(9, a);
  auto r2 = group[0]->to(2).recv(9, b);
  ASSERT_FALSE(wait_all({r1, r2, s1, s2}, later()));
  EXPECT_EQ(a[0], std::byte{1});
  EXPECT_EQ(b[0], std::byte{2});
  // A message from rank 2 does not match a receive from rank 1 with the same tag.
  bytes c(1);
  auto r3 = group[0]->to(1).recv(10, c);
  ASSERT_FALSE(group[2]->to(0).send(10, {from2})->wait(later()));
  EXPECT_TRUE(has_error(r3->wait(clock::now() + 50ms), errc::collective_timeout,
                        {"from rank 1", "did not complete"}));
  ASSERT_FALSE(group[1]->to(0).send(10, {from1})->wait(later()));
  EXPECT_FALSE(r3->wait(later()));
  EXPECT_EQ(c[0], std::byte{1});
  bytes d(1);
  EXPECT_FALSE(group[0]->to(2).recv(10, d)->wait(later()));
  EXPECT_EQ(d[0], std::byte{2});
}

TEST(ShmTransportTest, ZeroByteMessagesComplete) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  // Sent first, then received; received first, then sent.
  auto send = group[0]->to(1).send(4, {});
  auto recv = group[1]->to(0).recv(4, {});
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
  EXPECT_EQ(recv->message_bytes(), 0u);
  auto early = group[1]->to(0).recv(5, {});
  auto late = group[0]->to(1).send(5, {bytes{}});
  EXPECT_FALSE(early->wait(later()));
  EXPECT_FALSE(late->wait(later()));
}

TEST(ShmTransportTest, AMessageMuchLargerThanTheRingArrivesWhenTheReceiveIsPostedFirst) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2, small_rings());
  const auto out = pattern(std::size_t{1} << 20, 1); // 256 rings' worth
  bytes into(out.size());
  auto recv = group[1]->to(0).recv(1, into);
  auto send = group[0]->to(1).send(1, {out});
  ASSERT_FALSE(recv->wait(later())) << text_of(recv->wait(later()));
  ASSERT_FALSE(send->wait(later()));
  EXPECT_TRUE(into == out) << "the bytes differ";
  EXPECT_EQ(recv->message_bytes(), out.size());
}

TEST(ShmTransportTest, AMessageMuchLargerThanTheRingArrivesWhenTheSendIsPostedFirst) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2, small_rings());
  const auto out = pattern(std::size_t{1} << 20, 2);
  const auto next = pattern(100, 3); // the same tag, after it
  auto send = group[0]->to(1).send(1, {out});
  auto send_next = group[0]->to(1).send(1, {next});
  bytes into(out.size());
  bytes into_next(next.size());
  auto recv = group[1]->to(0).recv(1, into);
  auto recv_next = group[1]->to(0).recv(1, into_next);
  ASSERT_FALSE(recv->wait(later())) << text_of(recv->wait(later()));
  ASSERT_FALSE(recv_next->wait(later()));
  ASSERT_FALSE(wait_all({send, send_next}, later()));
  EXPECT_TRUE(into == out) << "the bytes differ";
  EXPECT_EQ(into_next, next);
}

TEST(ShmTransportTest, SizeMismatchFailsTheReceiveWithInvalidArgumentAndDropsTheMessage) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2, small_rings());
  // 8 bytes fit the ring; 10000 stream through it and must be skipped to reach the next message.
  for (std::size_t size : {std::size_t{8}, std::size_t{10000}}) {
    SCOPED_TRACE(std::to_string(size) + " bytes");
    const auto big = pattern(size, 1);
    const auto small = bytes_of("abcd");
    auto s1 = group[0]->to(1).send(6, {big});
    auto s2 = group[0]->to(1).send(6, {small});
    bytes into(4);
    auto r1 = group[1]->to(0).recv(6, into);
    EXPECT_TRUE(has_error(r1->wait(later()), errc::invalid_argument,
                          {"receive of 4 bytes", "from rank 0", std::to_string(size) + " bytes"}));
    EXPECT_FALSE(s1->wait(later())) << "the sender cannot tell, as on a wire";
    // The next message with that tag matches the next receive.
    auto r2 = group[1]->to(0).recv(6, into);
    EXPECT_FALSE(r2->wait(later()));
    EXPECT_FALSE(s2->wait(later()));
    EXPECT_EQ(string_of(into), "abcd");
  }
}

TEST(ShmTransportTest, RecvAtMostTakesAnySmallerMessageAndSaysItsSize) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  bytes into(8);
  // Posted before the message, then after it; equal size; larger (dropped); empty.
  auto before = group[1]->to(0).recv_at_most(7, into);
  EXPECT_EQ(before->message_bytes(), 0u) << "nothing received yet";
  auto abc = bytes_of("abc");
  ASSERT_FALSE(group[0]->to(1).send(7, {abc})->wait(later()));
  ASSERT_FALSE(before->wait(later()));
  EXPECT_EQ(before->message_bytes(), 3u);
  EXPECT_EQ(string_of(into).substr(0, 3), "abc");
  auto eight = bytes_of("12345678");
  auto nine = bytes_of("123456789");
  auto s1 = group[0]->to(1).send(7, {eight});
  auto s2 = group[0]->to(1).send(7, {nine});
  auto s3 = group[0]->to(1).send(7, {});
  auto equal = group[1]->to(0).recv_at_most(7, into);
  ASSERT_FALSE(equal->wait(later()));
  EXPECT_EQ(equal->message_bytes(), 8u);
  EXPECT_EQ(string_of(into), "12345678");
  auto larger = group[1]->to(0).recv_at_most(7, into);
  EXPECT_TRUE(has_error(larger->wait(later()), errc::invalid_argument,
                        {"receive of 8 bytes", "9 bytes", "at most 8"}));
  EXPECT_EQ(larger->message_bytes(), 0u);
  auto empty = group[1]->to(0).recv_at_most(7, into);
  ASSERT_FALSE(empty->wait(later()));
  EXPECT_EQ(empty->message_bytes(), 0u);
  EXPECT_FALSE(wait_all({s1, s2, s3}, later()));
  EXPECT_EQ(s2->message_bytes(), 9u) << "a send's message_bytes is its size";
}

TEST(ShmTransportTest, WaitTimesOutWithCollectiveTimeoutAndTheOperationCanStillComplete) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  bytes into(3);
  auto recv = group[1]->to(0).recv(11, into);
  const auto start = clock::now();
  auto err = recv->wait(start + 50ms);
  const auto waited = clock::now() - start;
  EXPECT_TRUE(has_error(err, errc::collective_timeout,
                        {"rank 1", "receive of 3 bytes", "from rank 0", "deadline"}));
  EXPECT_GE(waited, 50ms);
  EXPECT_LT(waited, consort::test::scaled(5s));
  EXPECT_FALSE(recv->done());
  // A deadline in the past returns at once.
  EXPECT_TRUE(has_error(recv->wait(clock::now() - 1s), errc::collective_timeout, {"deadline"}));
  auto payload = bytes_of("yes");
  auto send = group[0]->to(1).send(11, {payload});
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
  EXPECT_EQ(string_of(into), "yes");
}

TEST(ShmTransportTest, AbortFailsPendingAndLaterOperationsWithItsCodeAndReason) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(3);
  bytes a(1);
  bytes b(1);
  auto own_pending = group[1]->to(0).recv(1, a);  // rank 1's own receive
  auto peer_pending = group[0]->to(1).recv(2, b); // rank 0 waits for rank 1
  std::array<std::byte, 1> x{};
  auto unrelated = group[0]->to(2).send(3, {x});
  group[1]->abort("the step diverged", errc::collective_aborted);
  EXPECT_TRUE(has_error(own_pending->wait(later()), errc::collective_aborted,
                        {"aborted", "the step diverged"}));
  EXPECT_TRUE(has_error(peer_pending->wait(later()), errc::collective_aborted,
                        {"rank 1", "the step diverged"}));
  // Later operations fail at once, on both sides and both directions, with the same cause.
  EXPECT_TRUE(has_error(group[1]->to(2).send(4, {x})->wait(later()), errc::collective_aborted,
                        {"aborted", "the step diverged"}));
  EXPECT_TRUE(has_error(group[0]->to(1).send(4, {x})->wait(later()), errc::collective_aborted,
                        {"rank 1", "the step diverged"}));
  EXPECT_TRUE(has_error(group[2]->to(1).recv(4, a)->wait(later()), errc::collective_aborted,
                        {"rank 1", "the step diverged"}));
  // Pairs that do not involve rank 1 keep working.
  bytes c(1);
  EXPECT_FALSE(group[2]->to(0).recv(3, c)->wait(later()));
  EXPECT_FALSE(unrelated->wait(later()));
  // A second abort changes nothing; the default code is peer_lost.
  group[1]->abort("again", errc::shutdown);
  EXPECT_TRUE(has_error(group[1]->to(0).send(5, {x})->wait(later()), errc::collective_aborted,
                        {"the step diverged"}));
  group[2]->abort("worker 2 was killed");
  EXPECT_TRUE(has_error(group[0]->to(2).recv(6, c)->wait(later()), errc::peer_lost,
                        {"rank 2", "worker 2 was killed"}));
}

TEST(ShmTransportTest, AbortWakesABlockedWaiterPromptly) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  // No spinning, and a liveness nap longer than the test may take: a waiter returns early only
  // if the abort wakes it.
  auto opts = small_rings();
  opts.spin = 0us;
  opts.liveness_interval = 60s;
  // 0: the peer of the waiter aborts; 1: another thread aborts the waiter's own context.
  for (int own = 0; own < 2; ++own) {
    SCOPED_TRACE(own ? "own context aborted" : "peer aborted");
    auto group = shm::make_group(2, opts);
    bytes into(8);
    auto recv = group[0]->to(1).recv(1, into);
    std::promise<void> waiting;
    auto waiter = std::async(std::launch::async, [&] {
      waiting.set_value();
      auto err = recv->wait(clock::now() + 60s);
      return std::make_pair(err, clock::now());
    });
    waiting.get_future().wait();
    const auto aborted_at = clock::now();
    group[own ? 0 : 1]->abort("lost in a partition");
    ASSERT_EQ(waiter.wait_for(30s), std::future_status::ready) << "the waiter was not woken";
    auto [err, returned_at] = waiter.get();
    EXPECT_TRUE(has_error(err, errc::peer_lost, {"lost in a partition"}));
    EXPECT_LT(returned_at - aborted_at, consort::test::scaled(2s));
  }
}

TEST(ShmTransportTest, DestroyingAContextFailsItsPeersOperationsWithPeerLost) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(3);
  bytes into(8);
  auto recv = group[0]->to(1).recv(1, into);
  group[1].reset();
  EXPECT_TRUE(has_error(recv->wait(later()), errc::peer_lost, {"rank 1", "destroyed"}));
  EXPECT_TRUE(has_error(group[2]->to(1).recv(1, into)->wait(later()), errc::peer_lost,
                        {"rank 1", "destroyed"}));
  // Once a rank has seen it, its sends to the destroyed rank fail at once too.
  EXPECT_TRUE(has_error(group[2]->to(1).send(1, {into})->wait(later()), errc::peer_lost,
                        {"rank 1", "destroyed"}));
  // The others still talk.
  auto s = group[2]->to(0).send(2, {into});
  EXPECT_FALSE(group[0]->to(2).recv(2, into)->wait(later()));
  EXPECT_FALSE(s->wait(later()));
}

TEST(ShmTransportTest, MakeGroupRejectsAnEmptyGroupAndBadRingSizes) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  EXPECT_TRUE(
      fails_with([] { shm::make_group(0); }, errc::invalid_argument, {"at least 1 rank", "got 0"}));
  EXPECT_TRUE(fails_with([] { shm::make_group(-3); }, errc::invalid_argument,
                         {"at least 1 rank", "got -3"}));
  for (std::size_t ring :
       {std::size_t{0}, std::size_t{2048}, std::size_t{5000}, std::size_t{4096 + 4096 + 4096}}) {
    shm::options opts;
    opts.ring_bytes = ring;
    EXPECT_TRUE(fails_with([&] { shm::make_group(2, opts); }, errc::invalid_argument,
                           {"ring_bytes", "power of two", "got " + std::to_string(ring)}));
  }
  // The smallest ring and a group of one are fine.
  auto one = shm::make_group(1, small_rings());
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0]->rank(), 0);
  EXPECT_EQ(one[0]->size(), 1);
  EXPECT_TRUE(fails_with([&] { one[0]->to(0); }, errc::invalid_argument, {"no pair to rank 0"}));
  auto two = shm::make_group(2, small_rings());
  EXPECT_EQ(two[1]->rank(), 1);
  EXPECT_EQ(two[1]->to(0).peer_rank(), 0);
  EXPECT_TRUE(fails_with([&] { two[1]->to(2); }, errc::invalid_argument, {"no pair to rank 2"}));
}

TEST(ShmTransportTest, EveryRankExchangesWithEveryOtherConcurrently) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  constexpr int n = 4;
  constexpr int rounds = 20;
  auto group = shm::make_group(n, small_rings());
  std::vector<int> failures(n, 0);
  std::vector<std::string> first_error(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto& ctx = *group[static_cast<size_t>(r)];
      for (int round = 0; round < rounds; ++round) {
        // Size and bytes depend on (sender, receiver, round), so a mix-up would show; up to
        // 9600 bytes, more than the ring.
        auto size_of = [&](int from, int to) {
          return static_cast<size_t>(from * 31 + to * 7 + round) % 97 * 100;
        };
        auto seed_of = [&](int from, int to) {
          return static_cast<unsigned>(from * 1000 + to * 100 + round);
        };
        std::vector<bytes> out(n);
        std::vector<bytes> in(n);
        std::vector<operation_ptr> ops;
        for (int p = 0; p < n; ++p) {
          if (p == r)
            continue;
          const auto up = static_cast<size_t>(p);
          out[up] = pattern(size_of(r, p), seed_of(r, p));
          in[up].resize(size_of(p, r));
          ops.push_back(ctx.to(p).recv(static_cast<uint64_t>(round), in[up]));
          ops.push_back(ctx.to(p).send(static_cast<uint64_t>(round), {out[up]}));
        }
        if (auto err = wait_all(ops, later())) {
          ++failures[static_cast<size_t>(r)];
          first_error[static_cast<size_t>(r)] = text_of(err);
          return;
        }
        for (int p = 0; p < n; ++p)
          if (p != r && in[static_cast<size_t>(p)] != pattern(size_of(p, r), seed_of(p, r)))
            ++failures[static_cast<size_t>(r)];
      }
    });
  }
  for (auto& t : threads)
    t.join();
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(failures[static_cast<size_t>(r)], 0)
        << "rank " << r << ": " << first_error[static_cast<size_t>(r)];
}

TEST(ShmTransportTest, PingPongBetweenTwoThreads) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  constexpr int iterations = 1000;
  auto group = shm::make_group(2, small_rings());
  caf::error failure;
  std::thread echo([&] {
    std::array<std::byte, 8> buffer{};
    for (int i = 0; i < iterations; ++i) {
      if (auto err = group[1]->to(0).recv(1, buffer)->wait(later())) {
        failure = err;
        return;
      }
      if (auto err = group[1]->to(0).send(2, {buffer})->wait(later())) {
        failure = err;
        return;
      }
    }
  });
  std::array<std::byte, 8> ping{};
  std::array<std::byte, 8> pong{};
  const auto start = clock::now();
  for (int i = 0; i < iterations; ++i) {
    ping[0] = std::byte(static_cast<unsigned char>(i));
    ping[1] = std::byte(static_cast<unsigned char>(i >> 8));
    auto send = group[0]->to(1).send(1, {ping});
    auto err = group[0]->to(1).recv(2, pong)->wait(later());
    if (!err)
      err = send->wait(later());
    if (err || pong != ping) {
      ADD_FAILURE() << "round trip " << i << ": " << (err ? text_of(err) : "wrong bytes");
      break;
    }
  }
  const auto elapsed = std::chrono::duration<double, std::micro>(clock::now() - start);
  if (failure || HasFailure())
    group[1]->abort("the test failed"); // the echo thread returns at once
  echo.join();
  EXPECT_FALSE(failure) << text_of(failure);
  std::printf("[ figure   ] shm transport 8-byte ping-pong round trip: %.2f us (mean of %d)\n",
              elapsed.count() / iterations, iterations);
}

// -- lockstep channels (transport::mailbox) -----------------------------------------------------

/// A lockstep message's bytes as text.
std::string string_of(const_bytes data) {
  return std::string{reinterpret_cast<const char*>(data.data()), data.size()};
}

/// The error of a take, or none.
caf::error error_of(const caf::expected<const_bytes>& got) {
  return got ? caf::error{} : got.error();
}

// Every rank puts to every other, then takes each peer's message, round after round, on both
// channels at once (a thread per rank and channel): each message, from empty to a full slot, is
// whole, from the right rank, in order, and the slots are reused many times.
TEST(ShmMailboxTest, RanksPutAndTakeInLockstepOnBothChannelsAtOnce) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  constexpr int n = 3;
  constexpr int rounds = 60;
  auto group = shm::make_group(n);
  const std::size_t capacity = group[0]->mailbox(0)->capacity();
  EXPECT_EQ(capacity, 8168u);
  const std::vector<std::size_t> sizes{0, 1, 68, capacity - 16};
  std::vector<std::future<std::string>> runs;
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < 2; ++c)
      runs.push_back(std::async(std::launch::async, [&, r, c]() -> std::string {
        auto* box = group[static_cast<size_t>(r)]->mailbox(c);
        if (box == nullptr)
          return "no mailbox";
        for (int i = 0; i < rounds; ++i) {
          const auto size = sizes[static_cast<size_t>(i) % sizes.size()];
          for (int p = 0; p < n; ++p) {
            if (p == r)
              continue;
            // A 16-byte head naming the round, the channel and both ranks, then the pattern.
            char head[17];
            std::snprintf(head, sizeof head, "%04d c%d %02d->%02d  ", i, c, r, p);
            const auto body = pattern(size, static_cast<unsigned>(i + r));
            if (auto err = box->put(
                    p, static_cast<uint64_t>(100 + i),
                    {const_bytes{reinterpret_cast<const std::byte*>(head), 16}, const_bytes{body}}))
              return "put: " + text_of(err);
          }
          for (int p = 0; p < n; ++p) {
            if (p == r)
              continue;
            auto got = box->take(p, static_cast<uint64_t>(100 + i), later());
            if (!got)
              return "take: " + text_of(got.error());
            char head[17];
            std::snprintf(head, sizeof head, "%04d c%d %02d->%02d  ", i, c, p, r);
            const auto body = pattern(size, static_cast<unsigned>(i + p));
            if (got->size() != 16 + size || string_of(got->first(16)) != head ||
                !std::equal(body.begin(), body.end(), got->begin() + 16))
              return "round " + std::to_string(i) + ": rank " + std::to_string(r) +
                     " took a wrong message from rank " + std::to_string(p) + " on channel " +
                     std::to_string(c);
          }
        }
        return "";
      }));
  for (auto& run : runs)
    EXPECT_EQ(run.get(), "");
}

// The lockstep lets a rank run one message ahead of its peer: rank 0 takes rank 1's first
// message and puts its second while rank 1 has not taken rank 0's first yet. That one is still
// there, whole (each channel has two slots per ordered pair), and the second comes after it.
TEST(ShmMailboxTest, ARankOneMessageAheadLeavesThePeersUntakenMessageWhole) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  auto* a = group[0]->mailbox(0);
  auto* b = group[1]->mailbox(0);
  const auto first_a = bytes_of("first from 0");
  const auto first_b = bytes_of("first from 1");
  const auto second_a = bytes_of("second from 0");
  ASSERT_FALSE(a->put(1, 1, {first_a}));
  ASSERT_FALSE(b->put(0, 1, {first_b}));
  auto got = a->take(1, 1, later());
  ASSERT_TRUE(got) << text_of(got.error());
  EXPECT_EQ(string_of(*got), "first from 1");
  ASSERT_FALSE(a->put(1, 2, {second_a}));
  got = b->take(0, 1, clock::now() + 2s);
  ASSERT_TRUE(got) << text_of(got.error());
  EXPECT_EQ(string_of(*got), "first from 0");
  got = b->take(0, 2, clock::now() + 2s);
  ASSERT_TRUE(got) << text_of(got.error());
  EXPECT_EQ(string_of(*got), "second from 0");
  EXPECT_FALSE(a->arrived(1)) << "rank 1 put nothing more";
}

TEST(ShmMailboxTest, MisuseIsRefusedSayingWhatWasExpected) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  auto* box = group[0]->mailbox(0);
  ASSERT_NE(box, nullptr);
  EXPECT_EQ(group[0]->mailbox(2), nullptr) << "two channels";
  EXPECT_EQ(group[0]->mailbox(-1), nullptr);
  const bytes one{std::byte{1}};
  const bytes big(box->capacity() + 1);
  EXPECT_TRUE(has_error(box->put(1, 1, {big}), errc::invalid_argument,
                        {"message 1 of lockstep channel 0 to rank 1 has 8169 bytes",
                         "a message may have at most 8168"}));
  for (int peer : {0, 2, -1}) {
    EXPECT_TRUE(has_error(box->put(peer, 1, {one}), errc::invalid_argument,
                          {"cannot put a lockstep message of rank " + std::to_string(peer),
                           "expected another rank of the group of 2"}));
    EXPECT_TRUE(has_error(error_of(box->take(peer, 1, later())), errc::invalid_argument,
                          {"cannot take a lockstep message of rank " + std::to_string(peer)}));
    EXPECT_FALSE(box->arrived(peer));
  }
  // Two puts to a peer without a take in between: the second would overwrite a slot the peer may
  // still read.
  ASSERT_FALSE(box->put(1, 7, {one}));
  EXPECT_TRUE(has_error(box->put(1, 8, {one}), errc::invalid_argument,
                        {"message 1 of rank 1 was not taken yet",
                         "take each of a peer's messages before putting the next one to it"}));
  // The peer takes it under another tag: the exchanges are out of step.
  EXPECT_TRUE(group[1]->mailbox(0)->arrived(0));
  EXPECT_FALSE(group[1]->mailbox(1)->arrived(0)) << "the other channel has nothing";
  EXPECT_TRUE(has_error(error_of(group[1]->mailbox(0)->take(0, 9, later())), errc::invalid_argument,
                        {"message 1 of lockstep channel 0 from rank 0 carries tag 0x7 where tag "
                         "0x9 was expected",
                         "out of step"}));
  // Transports without lockstep channels, and groups too large for them, have none.
  EXPECT_EQ(local::make_group(2)[0]->mailbox(0), nullptr);
  auto nine = shm::make_group(9, small_rings());
  EXPECT_EQ(nine[0]->mailbox(0), nullptr);
  EXPECT_NE(shm::make_group(8, small_rings())[7]->mailbox(1), nullptr);
}

// A failed exchange leaves a channel out of step (a message put, its answer never taken), and
// the caller aborts the context with the failure's cause: the next put says that cause, with its
// code, not that the lockstep was broken; as does a put after the rank left.
TEST(ShmMailboxTest, APutOfAnAbortedContextSaysTheAbortsCauseBeforeTheBrokenLockstep) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  auto* box = group[0]->mailbox(0);
  const bytes one{std::byte{1}};
  ASSERT_FALSE(box->put(1, 7, {one}));
  group[0]->abort("all_reduce #3 timed out waiting for rank 1", errc::collective_timeout);
  EXPECT_TRUE(has_error(box->put(1, 8, {one}), errc::collective_timeout,
                        {"message 2 of lockstep channel 0 to rank 1",
                         "this rank aborted: all_reduce #3 timed out waiting for rank 1"}));
  // A rank that left (close) says so too, with shutdown.
  auto pair = shm::make_group(2);
  auto* left = pair[0]->mailbox(0);
  ASSERT_FALSE(left->put(1, 7, {one}));
  (void)pair[0]->close("the run ended", clock::now() + 50ms); // the peer never closes its side
  EXPECT_TRUE(has_error(left->put(1, 8, {one}), errc::shutdown,
                        {"message 2 of lockstep channel 0 to rank 1", "has left the group"}));
}

TEST(ShmMailboxTest, ATakeWhosePeerNeverPutsTimesOutAtItsDeadline) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto opts = small_rings();
  opts.spin = 100us; // then it sleeps on the doorbell until the deadline
  auto group = shm::make_group(2, opts);
  const auto start = clock::now();
  auto got = group[0]->mailbox(1)->take(1, 5, start + 200ms);
  const auto took = clock::now() - start;
  EXPECT_TRUE(has_error(error_of(got), errc::collective_timeout,
                        {"rank 0: message 1 of lockstep channel 1 from rank 1",
                         "did not arrive before its deadline"}));
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, consort::test::scaled(5s));
}

// A take asleep on the doorbell (no spin; a liveness nap longer than the test may take) returns as
// soon as its peer or its own context aborts, with the abort's code and reason.
TEST(ShmMailboxTest, AnAbortWakesASleepingTakePromptly) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto opts = small_rings();
  opts.spin = 0us;
  opts.liveness_interval = 60s;
  for (int own = 0; own < 2; ++own) {
    SCOPED_TRACE(own ? "own context aborted" : "peer aborted");
    auto group = shm::make_group(2, opts);
    std::promise<void> waiting;
    auto waiter = std::async(std::launch::async, [&] {
      waiting.set_value();
      auto got = group[0]->mailbox(0)->take(1, 1, clock::now() + 60s);
      return std::make_pair(error_of(got), clock::now());
    });
    waiting.get_future().wait();
    const auto aborted_at = clock::now();
    group[own ? 0 : 1]->abort("lost in a partition", errc::membership_changed);
    ASSERT_EQ(waiter.wait_for(30s), std::future_status::ready) << "the take was not woken";
    auto [err, returned_at] = waiter.get();
    EXPECT_TRUE(has_error(err, errc::membership_changed,
                          {"message 1 of lockstep channel 0 from rank 1", "lost in a partition"}));
    EXPECT_LT(returned_at - aborted_at, consort::test::scaled(2s));
    if (own) {
      EXPECT_TRUE(has_error(
          group[0]->mailbox(0)->put(1, 1, {}), errc::membership_changed,
          {"message 1 of lockstep channel 0 to rank 1", "this rank aborted: lost in a partition"}));
    }
  }
}

// A peer that leaves cleanly: the message it put before it left is still taken, then the next
// take fails with peer_left at once.
TEST(ShmMailboxTest, AMessagePutBeforeThePeerLeftIsTakenThenTakesFailWithPeerLeft) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  const auto hello = bytes_of("hello");
  ASSERT_FALSE(group[1]->mailbox(0)->put(0, 3, {hello}));
  auto closed =
      std::async(std::launch::async, [&] { return group[1]->close("worker 1 is done", later()); });
  // Rank 0 sees the goodbye first (a receive that nothing matches fails with it).
  bytes never(1);
  ASSERT_TRUE(has_error(group[0]->to(1).recv(9, never)->wait(later()), errc::peer_left, {}));
  auto* box = group[0]->mailbox(0);
  auto got = box->take(1, 3, later());
  ASSERT_TRUE(got) << text_of(got.error());
  EXPECT_EQ(string_of(*got), "hello");
  ASSERT_FALSE(box->put(1, 4, {hello})) << "a put to a peer that left goes nowhere and is no error";
  const auto start = clock::now();
  EXPECT_TRUE(has_error(
      error_of(box->take(1, 4, later())), errc::peer_left,
      {"message 2 of lockstep channel 0 from rank 1", "rank 1 left the group: worker 1 is done"}));
  EXPECT_LT(clock::now() - start, consort::test::scaled(2s));
  EXPECT_FALSE(group[0]->close("end", later()));
  EXPECT_FALSE(closed.get());
}

// -- close -------------------------------------------------------------------------------------

// The leaver's sends (one larger than the ring, so close must go on writing it as the peer
// reads) are all received; then what the peer still waits for from it fails with peer_left.
TEST(ShmCloseTest, ARankThatLeftDeliversItsSendsThenFailsItsPeersWithPeerLeft) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(3, small_rings());
  const auto out = pattern(256, 4);
  const auto big = pattern(100000, 5);
  bytes never(4);
  auto unmatched = group[0]->to(1).recv(9, never); // posted before the leaver leaves
  auto sent = group[1]->to(0).send(1, {out});
  auto sent_big = group[1]->to(0).send(2, {big});
  auto closed =
      std::async(std::launch::async, [&] { return group[1]->close("worker 1 is done", later()); });
  EXPECT_TRUE(has_error(unmatched->wait(later()), errc::peer_left,
                        {"rank 1 left the group", "worker 1 is done"}));
  bytes got(out.size());
  bytes got_big(big.size());
  auto r1 = group[0]->to(1).recv(1, got);
  auto r2 = group[0]->to(1).recv(2, got_big);
  EXPECT_FALSE(r1->wait(later())) << text_of(r1->wait(later()));
  EXPECT_FALSE(r2->wait(later())) << text_of(r2->wait(later()));
  EXPECT_EQ(got, out);
  EXPECT_TRUE(got_big == big) << "the bytes differ";
  // A receive posted after the goodbye fails at once; so does a send to the leaver.
  EXPECT_TRUE(has_error(group[0]->to(1).recv(3, never)->wait(later()), errc::peer_left,
                        {"rank 1 left the group", "worker 1 is done"}));
  EXPECT_TRUE(has_error(group[0]->to(1).send(3, {out})->wait(later()), errc::peer_left,
                        {"rank 1 left the group"}));
  // The others still talk, then leave too; the leaver's close returns.
  auto s = group[2]->to(0).send(4, {out});
  bytes got2(out.size());
  EXPECT_FALSE(group[0]->to(2).recv(4, got2)->wait(later()));
  EXPECT_FALSE(s->wait(later()));
  EXPECT_EQ(got2, out);
  auto closed2 = std::async(std::launch::async, [&] { return group[2]->close("end", later()); });
  EXPECT_FALSE(group[0]->close("end", later()));
  EXPECT_FALSE(closed2.get());
  auto err = closed.get();
  EXPECT_FALSE(err) << text_of(err);
  EXPECT_FALSE(sent->wait(later()));
  EXPECT_FALSE(sent_big->wait(later()));
}

// The leaver refuses new work with `shutdown`, and fails its own waiting receives with it.
TEST(ShmCloseTest, OperationsOfARankThatLeftFailWithShutdown) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  bytes buf(16);
  auto mine = group[0]->to(1).recv(5, buf);
  auto closed = std::async(std::launch::async, [&] { return group[0]->close("bye", later()); });
  // Before the close returns (it waits for rank 1 to leave too).
  EXPECT_TRUE(has_error(mine->wait(later()), errc::shutdown, {"left the group"}));
  EXPECT_TRUE(
      has_error(group[0]->to(1).send(6, {buf})->wait(later()), errc::shutdown, {"left the group"}));
  EXPECT_FALSE(group[1]->close("bye too", later()));
  auto err = closed.get();
  EXPECT_FALSE(err) << text_of(err);
  EXPECT_TRUE(
      has_error(group[0]->to(1).recv(7, buf)->wait(later()), errc::shutdown, {"left the group"}));
  EXPECT_TRUE(
      has_error(group[1]->to(0).send(7, {buf})->wait(later()), errc::shutdown, {"left the group"}));
  const auto start = clock::now();
  EXPECT_FALSE(group[0]->close("again", clock::now() + 10s)) << "a second close returns at once";
  EXPECT_LT(clock::now() - start, consort::test::scaled(1s));
}

// Every rank leaving at the same time, the usual end of a job, with messages still in the rings:
// all return without error.
TEST(ShmCloseTest, AllRanksLeavingAtOnceReturnWithoutError) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  constexpr int n = 4;
  auto group = shm::make_group(n, small_rings());
  const auto out = pattern(3000, 6);
  std::vector<operation_ptr> sends;
  for (int r = 0; r < n; ++r)
    sends.push_back(group[static_cast<size_t>(r)]->to((r + 1) % n).send(1, {out}));
  std::vector<std::future<caf::error>> closes;
  for (auto& ctx : group)
    closes.push_back(std::async(std::launch::async, [ctx] { return ctx->close("end", later()); }));
  for (auto& c : closes) {
    auto err = c.get();
    EXPECT_FALSE(err) << text_of(err);
  }
  EXPECT_FALSE(wait_all(sends, later()));
}

// A peer that never leaves cannot hold the leaver beyond its deadline.
TEST(ShmCloseTest, CloseGivesUpAtItsDeadlineWhenAPeerNeverClosesItsSide) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  auto group = shm::make_group(3);
  // Rank 2 leaves, and rank 1 has seen it go; rank 0 never leaves.
  auto closed2 = std::async(std::launch::async, [&] { return group[2]->close("bye", later()); });
  bytes never(1);
  EXPECT_TRUE(has_error(group[1]->to(2).recv(1, never)->wait(later()), errc::peer_left,
                        {"rank 2 left the group"}));
  const auto start = clock::now();
  auto err = group[1]->close("bye", clock::now() + 300ms);
  const auto took = clock::now() - start;
  EXPECT_TRUE(has_error(err, errc::collective_timeout, {"rank 1", "close", "0", "deadline"}));
  EXPECT_EQ(text_of(err).find("2 had not"), std::string::npos)
      << "rank 2 left, only rank 0 is missing: " << text_of(err);
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, consort::test::scaled(5s));
  // Rank 0 got the goodbyes all the same.
  EXPECT_TRUE(has_error(group[0]->to(1).recv(1, never)->wait(later()), errc::peer_left,
                        {"rank 1 left the group", "bye"}));
  EXPECT_FALSE(group[0]->close("late", later()));
  EXPECT_FALSE(closed2.get());
}

// -- across processes ----------------------------------------------------------------------------

/// The names under /dev/shm that begin with "consort-".
std::set<std::string> consort_entries() {
  std::set<std::string> out;
  if (DIR* dir = opendir("/dev/shm")) {
    while (dirent* e = readdir(dir))
      if (std::string{e->d_name}.rfind("consort-", 0) == 0)
        out.insert(e->d_name);
    closedir(dir);
  }
  return out;
}

/// The "consort-" segments that this process maps (from /proc/self/maps), each with whether the
/// kernel marks it "(deleted)", that is unlinked.
std::map<std::string, bool> mapped_segments() {
  std::map<std::string, bool> out;
  std::ifstream maps("/proc/self/maps");
  const std::string prefix = "/dev/shm/consort-";
  for (std::string line; std::getline(maps, line);) {
    auto at = line.find(prefix);
    if (at == std::string::npos)
      continue;
    auto name = line.substr(at + 9); // after "/dev/shm/"
    const bool deleted = name.find(" (deleted)") != std::string::npos;
    name = name.substr(0, name.find(' '));
    out[name] = deleted;
  }
  return out;
}

/// Writes all of `data` to `fd`; false on failure.
bool write_all(int fd, const std::string& data) {
  std::size_t done = 0;
  while (done < data.size()) {
    auto n = ::write(fd, data.data() + done, data.size() - done);
    if (n <= 0)
      return false;
    done += static_cast<std::size_t>(n);
  }
  return true;
}

/// Reads one '\n'-terminated line from `fd` (without the '\n'); empty when the writer closed.
std::string read_line(int fd) {
  std::string out;
  char c = 0;
  while (::read(fd, &c, 1) == 1) {
    if (c == '\n')
      return out;
    out += c;
  }
  return {};
}

/// Rank `rank` of the 2-rank TCP group that bootstraps the shared-memory group: listens on an
/// ephemeral loopback port, writes its address to `to_peer`, reads the peer's from `from_peer`,
/// and connects.
caf::expected<std::shared_ptr<tcp::context>> tcp_bootstrap(int rank, int to_peer, int from_peer) {
  tcp::mesh_options opts;
  opts.rank = rank;
  opts.size = 2;
  opts.listen_address = "127.0.0.1:0";
  opts.group_id = 0x5348'4d54;
  opts.secret = "shm-test-bootstrap";
  opts.connect_timeout = 20s;
  // The killed child's connection breaks: expected, not worth a line on stderr.
  opts.log = [](const std::string&) {
  };
  auto ctx = tcp::listen(opts);
  if (!ctx)
    return ctx.error();
  if (!write_all(to_peer, (*ctx)->listen_address() + "\n"))
    return make_caf_error(errc::peer_lost, "writing this rank's address to the pipe failed");
  auto theirs = read_line(from_peer);
  if (theirs.empty())
    return make_caf_error(errc::peer_lost, "the peer process sent no address (it ended?)");
  std::vector<std::string> addresses(2);
  addresses[static_cast<size_t>(rank)] = (*ctx)->listen_address();
  addresses[static_cast<size_t>(1 - rank)] = theirs;
  if (auto err = (*ctx)->connect(addresses))
    return err;
  return *ctx;
}

/// The options both processes form their shared-memory group with.
shm::options process_options() {
  shm::options opts;
  opts.group_id = 0x5348'4d54'0001;
  opts.epoch = 3;
  opts.secret = "shm-test-secret";
  opts.connect_timeout = 20s;
  opts.liveness_interval = 50ms;
  return opts;
}

/// A child process, fork()ed by the constructor, that runs `body(shm_context)` as rank
/// `child_rank` of a 2-rank group with this process and `_exit`s with its result. The child never
/// returns into GoogleTest and runs no assertion: it reports by exit status (10 and up: the
/// bootstrap failed; `body`'s own codes below 10), and alarm() ends it if it hangs. This process
/// (the other rank) gets its contexts from `join_group`.
class forked_peer {
public:
  /// `child_options`: the child's options for shm::connect (another secret, for a test of it).
  forked_peer(int child_rank, const std::function<int(context&)>& body,
              const shm::options& child_options = process_options()) {
    int to_child[2];
    int to_parent[2];
    if (::pipe(to_child) != 0 || ::pipe(to_parent) != 0)
      return;
    child_rank_ = child_rank;
    // This process has no other thread here (each test runs alone in its process under CTest,
    // and the tests before it joined theirs), so the child may use malloc, threads and sockets.
    pid_ = ::fork();
    if (pid_ == 0) {
      ::alarm(60);
      ::close(to_child[1]);
      ::close(to_parent[0]);
      int status = 10; // the TCP bootstrap failed
      try {
        if (auto boot = tcp_bootstrap(child_rank, to_parent[1], to_child[0])) {
          auto ctx = shm::connect(**boot, child_options);
          status = ctx ? body(**ctx) : 11; // 11: shm::connect failed
        }
      } catch (...) {
        status = 12;
      }
      ::_exit(status);
    }
    ::close(to_child[0]);
    ::close(to_parent[1]);
    to_child_ = to_child[1];
    from_child_ = to_parent[0];
  }

  forked_peer(const forked_peer&) = delete;
  forked_peer& operator=(const forked_peer&) = delete;

  ~forked_peer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      wait_exit();
    }
    for (int fd : {to_child_, from_child_})
      if (fd >= 0)
        ::close(fd);
  }

  pid_t pid() const { return pid_; }

  /// This process's side: the TCP bootstrap, then the shared-memory group over it.
  caf::error join_group() {
    if (pid_ <= 0)
      return make_caf_error(errc::peer_lost, "fork or pipe failed");
    auto boot = tcp_bootstrap(1 - child_rank_, to_child_, from_child_);
    if (!boot)
      return boot.error();
    bootstrap_ = *boot;
    auto ctx = shm::connect(*bootstrap_, process_options());
    if (!ctx)
      return ctx.error();
    shm_ = *ctx;
    return {};
  }

  /// This process's shared-memory context. @pre join_group() succeeded
  context& group() { return *shm_; }

  /// Waits for the child to end: its exit status, or minus the signal that ended it.
  int wait_exit() {
    int status = 0;
    if (pid_ <= 0 || ::waitpid(pid_, &status, 0) != pid_)
      return -1000;
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }

private:
  pid_t pid_ = -1;
  int child_rank_ = 1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::shared_ptr<tcp::context> bootstrap_;
  context_ptr shm_;
};

/// Checks that the segment this process maps is unlinked: marked "(deleted)" in its maps and
/// absent from /dev/shm, and that /dev/shm has no "consort-" entry of it that `before` lacked.
void expect_segment_unlinked(const std::set<std::string>& before) {
  auto mapped = mapped_segments();
  ASSERT_EQ(mapped.size(), 1u) << "this process should map exactly one consort segment";
  const auto& [name, deleted] = *mapped.begin();
  EXPECT_TRUE(deleted) << name << " is mapped but not unlinked";
  auto after = consort_entries();
  EXPECT_EQ(after.count(name), 0u) << name << " is still in /dev/shm";
  // Other test processes may create (and at once unlink) segments of their own meanwhile: only
  // the new entries that are ours count.
  for (const auto& entry : after) {
    if (!before.count(entry)) {
      EXPECT_NE(entry, name) << "this test left " << entry << " in /dev/shm";
    }
  }
}

// Two processes, the parent rank 0 (it creates the segment): messages both ways, small and
// 8 MiB (8 rings' worth), then both leave cleanly.
TEST(ShmProcessTest, ForkedPeersExchangeBothWaysThenBothClose) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  const auto before = consort_entries();
  constexpr std::size_t big = std::size_t{8} << 20;
  forked_peer child(1, [](context& ctx) {
    bytes hello(5);
    bytes in(big);
    auto r1 = ctx.to(0).recv(1, hello);
    auto r2 = ctx.to(0).recv(2, in);
    if (wait_all({r1, r2}, later()))
      return 1;
    if (string_of(hello) != "hello" || in != pattern(big, 1))
      return 2;
    auto world = bytes_of("world");
    auto out = pattern(big, 2);
    if (wait_all({ctx.to(0).send(3, {world}), ctx.to(0).send(4, {out})}, later()))
      return 3;
    return ctx.close("child done", later()) ? 4 : 0;
  });
  auto err = child.join_group();
  ASSERT_FALSE(err) << text_of(err);
  expect_segment_unlinked(before);
  auto hello = bytes_of("hello");
  auto out = pattern(big, 1);
  bytes world(5);
  bytes in(big);
  std::vector<operation_ptr> ops{
      child.group().to(1).send(1, {hello}), child.group().to(1).send(2, {out}),
      child.group().to(1).recv(3, world), child.group().to(1).recv(4, in)};
  err = wait_all(ops, later());
  EXPECT_FALSE(err) << text_of(err);
  EXPECT_EQ(string_of(world), "world");
  EXPECT_TRUE(in == pattern(big, 2)) << "the 8 MiB from the child differ";
  err = child.group().close("parent done", later());
  EXPECT_FALSE(err) << text_of(err);
  EXPECT_EQ(child.wait_exit(), 0) << "in the child, 1: a receive failed, 2: wrong bytes, 3: a send "
                                     "failed, 4: close failed, 10: the TCP bootstrap failed, 11: "
                                     "shm::connect failed, 12: an exception";
}

// The child is rank 0 (it created the segment) and is killed with SIGKILL while this process
// waits for a message from it: the wait fails with peer_lost within a few liveness intervals
// (50 ms), far before its deadline.
TEST(ShmProcessTest, AKilledPeerProcessFailsAPendingReceiveWithPeerLostWellBeforeItsDeadline) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  const auto before = consort_entries();
  forked_peer child(0, [](context& ctx) {
    std::array<std::byte, 1> ready{std::byte{1}};
    if (ctx.to(1).send(1, {ready})->wait(later()))
      return 1;
    // Waits for a message that never comes, until it is killed.
    std::array<std::byte, 1> never{};
    (void)ctx.to(1).recv(2, never)->wait(clock::now() + 60s);
    return 2;
  });
  auto err = child.join_group();
  ASSERT_FALSE(err) << text_of(err);
  expect_segment_unlinked(before);
  std::array<std::byte, 1> ready{};
  ASSERT_FALSE(child.group().to(0).recv(1, ready)->wait(later()));
  std::array<std::byte, 1> never{};
  auto pending = child.group().to(0).recv(3, never);
  std::promise<void> waiting;
  auto waiter = std::async(std::launch::async, [&] {
    waiting.set_value();
    auto result = pending->wait(clock::now() + 10s);
    return std::make_pair(result, clock::now());
  });
  waiting.get_future().wait();
  const auto killed_at = clock::now();
  const auto pid = child.pid();
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  auto [result, returned_at] = waiter.get();
  EXPECT_TRUE(has_error(result, errc::peer_lost, {"rank 0", std::to_string(pid)}));
  EXPECT_LT(returned_at - killed_at, consort::test::scaled(3s));
  EXPECT_EQ(child.wait_exit(), -SIGKILL);
  // Later operations with the dead rank fail at once too.
  EXPECT_TRUE(
      has_error(child.group().to(0).send(4, {ready})->wait(later()), errc::peer_lost, {"rank 0"}));
}

// The same for a take: the child (rank 0) is killed while this process waits for its lockstep
// message, asleep on the doorbell after a short spin.
TEST(ShmProcessTest, AKilledPeerProcessFailsAWaitingTakeWithPeerLostWellBeforeItsDeadline) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  forked_peer child(0, [](context& ctx) {
    std::array<std::byte, 1> ready{std::byte{1}};
    if (ctx.to(1).send(1, {ready})->wait(later()))
      return 1;
    (void)ctx.mailbox(0)->take(1, 2, clock::now() + 60s); // until it is killed
    return 2;
  });
  auto err = child.join_group();
  ASSERT_FALSE(err) << text_of(err);
  std::array<std::byte, 1> ready{};
  ASSERT_FALSE(child.group().to(0).recv(1, ready)->wait(later()));
  std::promise<void> waiting;
  auto waiter = std::async(std::launch::async, [&] {
    waiting.set_value();
    auto got = child.group().mailbox(0)->take(0, 2, clock::now() + 10s);
    return std::make_pair(error_of(got), clock::now());
  });
  waiting.get_future().wait();
  const auto killed_at = clock::now();
  const auto pid = child.pid();
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  auto [result, returned_at] = waiter.get();
  EXPECT_TRUE(has_error(result, errc::peer_lost,
                        {"message 1 of lockstep channel 0 from rank 0", std::to_string(pid)}));
  EXPECT_LT(returned_at - killed_at, consort::test::scaled(3s));
  EXPECT_EQ(child.wait_exit(), -SIGKILL);
}

TEST(ShmProcessTest, RanksWithDifferentSecretsCannotFormAGroup) {
  CONSORT_TEST_SKIP_WITHOUT_SHM();
  // The child derives another segment name from its secret, so it cannot open rank 0's; rank 0
  // hears so in the child's answer and fails, and unlinks what it made.
  auto other = process_options();
  other.secret = "another secret";
  forked_peer child(
      1, [](context&) { return 0; }, other);
  auto err = child.join_group();
  EXPECT_TRUE(
      has_error(err, errc::peer_lost,
                {"not every rank could map the segment: rank 1: ", "cannot open shared memory"}))
      << text_of(err);
  EXPECT_EQ(child.wait_exit(), 11);
  EXPECT_TRUE(mapped_segments().empty());
}

} // namespace
} // namespace consort::transport
