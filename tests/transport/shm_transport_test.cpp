// The shared-memory transport (transport/shm): the pair contract (tags, order, sizes, deadlines,
// abort, close) on groups of threads over one segment, messages larger than the ring, the
// collective algorithms over it, and across processes: a fork()ed peer that forms the group over
// a TCP bootstrap, exchanges, and is killed. Nothing sleeps: every wait is an operation with a
// deadline or a wait for a child process.

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/shm.hpp>
#include <consort/transport/tcp.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <signal.h>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace consort::transport {
namespace {

using namespace std::chrono_literals;

deadline later() {
  return clock::now() + 20s;
}

errc code_of(const caf::error& err) {
  if (!err)
    return errc::none;
  return err.category() == caf::atom("consort") ? static_cast<errc>(err.code())
                                                : errc::invalid_argument;
}

std::string text_of(const caf::error& err) {
  return err ? std::string{to_consort_error(err, "").what()} : std::string{"(no error)"};
}

::testing::AssertionResult fails(const caf::error& err, errc code, const std::string& fragment) {
  if (code_of(err) != code)
    return ::testing::AssertionFailure() << "expected " << to_string(code) << ", got "
                                         << to_string(code_of(err)) << ": " << text_of(err);
  if (text_of(err).find(fragment) == std::string::npos)
    return ::testing::AssertionFailure()
           << "the error does not say \"" << fragment << "\": " << text_of(err);
  return ::testing::AssertionSuccess();
}

std::vector<std::byte> pattern(size_t n, int seed) {
  std::vector<std::byte> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = static_cast<std::byte>((i * 131 + static_cast<size_t>(seed) * 7) & 0xff);
  return out;
}

shm::options small_rings() {
  shm::options o;
  o.ring_bytes = 4096;
  return o;
}

/// Skips a test where this machine has no usable /dev/shm (CI containers have one).
#define SKIP_WITHOUT_SHM()                                                                         \
  do {                                                                                             \
    if (auto why = shm::unavailable_reason(); !why.empty())                                        \
      GTEST_SKIP() << "no shared memory here: " << why;                                            \
  } while (false)

// -- the pair contract ----------------------------------------------------------------------------

TEST(ShmTransportTest, SendBeforeAndAfterReceiveDeliverTheBytes) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  auto hello = pattern(5, 1);
  auto send = group[0]->to(1).send(7, {hello});
  std::vector<std::byte> into(5);
  auto recv = group[1]->to(0).recv(7, into);
  EXPECT_FALSE(recv->wait(later())) << text_of(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
  EXPECT_EQ(into, hello);
  EXPECT_EQ(recv->message_bytes(), 5u);

  std::vector<std::byte> second(9);
  auto early = group[0]->to(1).recv(8, second);
  EXPECT_FALSE(early->done());
  auto world = pattern(9, 2);
  EXPECT_FALSE(group[1]->to(0).send(8, {world})->wait(later()));
  EXPECT_FALSE(early->wait(later()));
  EXPECT_EQ(second, world);
}

TEST(ShmTransportTest, PartsAreGatheredInOrderAndZeroByteMessagesComplete) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  auto a = pattern(3, 1);
  auto b = pattern(0, 2);
  auto c = pattern(6, 3);
  std::vector<std::byte> into(9);
  auto recv = group[1]->to(0).recv(1, into);
  EXPECT_FALSE(group[0]->to(1).send(1, {a, b, c})->wait(later()));
  EXPECT_FALSE(recv->wait(later()));
  std::vector<std::byte> want = a;
  want.insert(want.end(), c.begin(), c.end());
  EXPECT_EQ(into, want);
  std::vector<std::byte> none;
  auto empty = group[1]->to(0).recv(2, none);
  EXPECT_FALSE(group[0]->to(1).send(2, {})->wait(later()));
  EXPECT_FALSE(empty->wait(later()));
  EXPECT_EQ(empty->message_bytes(), 0u);
}

TEST(ShmTransportTest, MessagesOfATagArriveInOrderAndReceivesMatchByTag) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  std::vector<std::vector<std::byte>> sent;
  for (int i = 0; i < 5; ++i)
    sent.push_back(pattern(16, i));
  // Tags 1 and 2 interleaved; the receives are posted for tag 2 first.
  std::vector<operation_ptr> sends;
  for (int i = 0; i < 5; ++i)
    sends.push_back(group[0]->to(1).send(i % 2 == 0 ? 1 : 2, {sent[static_cast<size_t>(i)]}));
  std::vector<std::vector<std::byte>> got(5, std::vector<std::byte>(16));
  EXPECT_FALSE(group[1]->to(0).recv(2, got[1])->wait(later()));
  EXPECT_FALSE(group[1]->to(0).recv(2, got[3])->wait(later()));
  for (int i : {0, 2, 4})
    EXPECT_FALSE(group[1]->to(0).recv(1, got[static_cast<size_t>(i)])->wait(later()));
  EXPECT_FALSE(wait_all(sends, later()));
  EXPECT_EQ(got, sent);
}

TEST(ShmTransportTest, AMessageMuchLargerThanTheRingStreamsThroughIt) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2, small_rings());
  const auto big = pattern(std::size_t{1} << 20, 5);
  // Receive first: straight into the buffer.
  std::vector<std::byte> first(big.size());
  auto recv = group[1]->to(0).recv(3, first);
  auto send = group[0]->to(1).send(3, {big});
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
  EXPECT_EQ(first, big);
  // Send first: the receiver takes over a message that is partly stashed.
  auto send2 = group[0]->to(1).send(4, {big});
  std::vector<std::byte> second(big.size());
  auto recv2 = group[1]->to(0).recv(4, second);
  EXPECT_FALSE(recv2->wait(later()));
  EXPECT_FALSE(send2->wait(later()));
  EXPECT_EQ(second, big);
}

TEST(ShmTransportTest, ASizeMismatchFailsTheReceiveAndDropsOnlyThatMessage) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2, small_rings());
  auto wrong = pattern(10000, 1); // larger than the ring: it is dropped while it streams
  auto right = pattern(8, 2);
  auto s1 = group[0]->to(1).send(5, {wrong});
  auto s2 = group[0]->to(1).send(5, {right});
  std::vector<std::byte> small(8);
  EXPECT_TRUE(fails(group[1]->to(0).recv(5, small)->wait(later()), errc::invalid_argument,
                    "the message has 10000 bytes; expected 8"));
  EXPECT_FALSE(group[1]->to(0).recv(5, small)->wait(later()));
  EXPECT_EQ(small, right);
  EXPECT_FALSE(wait_all({s1, s2}, later()));
}

TEST(ShmTransportTest, RecvAtMostTakesASmallerMessageAndRefusesALargerOne) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  auto three = pattern(3, 1);
  auto twenty = pattern(20, 2);
  std::vector<std::byte> into(16);
  auto r1 = group[1]->to(0).recv_at_most(6, into);
  EXPECT_FALSE(group[0]->to(1).send(6, {three})->wait(later()));
  EXPECT_FALSE(r1->wait(later()));
  EXPECT_EQ(r1->message_bytes(), 3u);
  EXPECT_TRUE(std::equal(three.begin(), three.end(), into.begin()));
  EXPECT_FALSE(group[0]->to(1).send(6, {twenty})->wait(later()));
  EXPECT_TRUE(fails(group[1]->to(0).recv_at_most(6, into)->wait(later()), errc::invalid_argument,
                    "expected at most 16"));
}

TEST(ShmTransportTest, AWaitTimesOutAndTheOperationCanStillComplete) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  std::vector<std::byte> into(4);
  auto recv = group[1]->to(0).recv(9, into);
  EXPECT_TRUE(fails(recv->wait(clock::now() + 20ms), errc::collective_timeout,
                    "receive of 4 bytes with tag 0x9 from rank 0 did not complete"));
  auto data = pattern(4, 3);
  EXPECT_FALSE(group[0]->to(1).send(9, {data})->wait(later()));
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_EQ(into, data);
}

TEST(ShmTransportTest, AbortFailsThisRanksAndThePeersOperationsWithItsCodeAndReason) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(3);
  std::vector<std::byte> a(4), b(4);
  auto mine = group[0]->to(1).recv(1, a);
  auto theirs = group[1]->to(0).recv(1, b);
  auto unrelated = group[2]->to(1).recv(1, b);
  group[0]->abort("the step failed", errc::collective_mismatch);
  EXPECT_TRUE(fails(mine->wait(later()), errc::collective_mismatch, "the step failed"));
  EXPECT_TRUE(
      fails(theirs->wait(later()), errc::collective_mismatch, "rank 0 aborted: the step failed"));
  // Later operations fail at once, on both sides; ranks 1 and 2 still talk.
  EXPECT_TRUE(fails(group[0]->to(2).send(1, {})->wait(later()), errc::collective_mismatch,
                    "this rank aborted"));
  EXPECT_TRUE(fails(group[2]->to(0).recv(2, a)->wait(later()), errc::collective_mismatch,
                    "rank 0 aborted"));
  auto x = pattern(4, 1);
  EXPECT_FALSE(group[1]->to(2).send(1, {x})->wait(later()));
  EXPECT_FALSE(unrelated->wait(later()));
}

TEST(ShmTransportTest, AbortWakesAWaiterBlockedWithALongDeadline) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  std::vector<std::byte> into(4);
  auto recv = group[1]->to(0).recv(1, into);
  caf::error result;
  std::thread waiter([&] { result = recv->wait(clock::now() + 60s); });
  auto start = clock::now();
  group[1]->abort("stop");
  waiter.join();
  EXPECT_TRUE(fails(result, errc::peer_lost, "stop"));
  EXPECT_LT(clock::now() - start, 10s);
}

TEST(ShmTransportTest, DestroyingAContextFailsItsPeersOperations) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  std::vector<std::byte> into(4);
  auto recv = group[1]->to(0).recv(1, into);
  group[0].reset();
  EXPECT_TRUE(fails(recv->wait(later()), errc::peer_lost, "rank 0 is gone"));
}

TEST(ShmTransportTest, BadOptionsAreRefusedWithWhatWasExpected) {
  auto refused = [](int size, shm::options o, const std::string& fragment) {
    try {
      shm::make_group(size, o);
    } catch (const error& e) {
      EXPECT_EQ(e.code(), errc::invalid_argument) << e.what();
      EXPECT_NE(std::string{e.what()}.find(fragment), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "make_group accepted " << fragment;
  };
  shm::options o;
  refused(0, o, "at least 1 rank; got 0");
  o.ring_bytes = 5000;
  refused(2, o, "ring_bytes must be a power of two of at least 4096; got 5000");
  o.ring_bytes = 2048;
  refused(2, o, "got 2048");
  o.ring_bytes = 4096;
  o.liveness_interval = 0ms;
  refused(2, o, "liveness_interval must be positive");
}

TEST(ShmTransportTest, EveryRankExchangesWithEveryOtherAtOnce) {
  SKIP_WITHOUT_SHM();
  const int n = 4;
  auto group = shm::make_group(n, small_rings());
  std::vector<std::thread> threads;
  std::vector<int> wrong(n, 0);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      std::vector<std::vector<std::byte>> out, in;
      std::vector<operation_ptr> ops;
      for (int p = 0; p < n; ++p) {
        out.push_back(pattern(20000, r * 10 + p));
        in.emplace_back(20000);
      }
      for (int p = 0; p < n; ++p)
        if (p != r) {
          ops.push_back(group[static_cast<size_t>(r)]->to(p).recv(1, in[static_cast<size_t>(p)]));
          ops.push_back(
              group[static_cast<size_t>(r)]->to(p).send(1, {out[static_cast<size_t>(p)]}));
        }
      if (wait_all(ops, later()))
        wrong[static_cast<size_t>(r)] = 1000;
      for (int p = 0; p < n; ++p)
        if (p != r && in[static_cast<size_t>(p)] != pattern(20000, p * 10 + r))
          ++wrong[static_cast<size_t>(r)];
    });
  for (auto& t : threads)
    t.join();
  EXPECT_EQ(wrong, std::vector<int>(n, 0));
}

TEST(ShmTransportTest, PingPongOfAThousandRoundTrips) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2);
  std::thread echo([&] {
    std::vector<std::byte> buf(8);
    for (int i = 0; i < 1000; ++i) {
      if (group[1]->to(0).recv(1, buf)->wait(later()) ||
          group[1]->to(0).send(2, {buf})->wait(later()))
        return;
    }
  });
  int matched = 0;
  for (int i = 0; i < 1000; ++i) {
    auto msg = pattern(8, i);
    std::vector<std::byte> back(8);
    auto r = group[0]->to(1).recv(2, back);
    if (group[0]->to(1).send(1, {msg})->wait(later()) || r->wait(later()))
      break;
    matched += back == msg;
  }
  echo.join();
  EXPECT_EQ(matched, 1000);
}

// -- close
// -----------------------------------------------------------------------------------------

TEST(ShmCloseTest, ALeaverDeliversItsSendsThenThePeersReceivesFailWithPeerLeft) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(2, small_rings());
  auto big = pattern(50000, 1); // more than the ring: close must finish writing it
  auto send = group[0]->to(1).send(1, {big});
  caf::error closed0, closed1;
  std::thread leaver([&] { closed0 = group[0]->close("job done", later()); });
  std::vector<std::byte> into(big.size());
  EXPECT_FALSE(group[1]->to(0).recv(1, into)->wait(later()));
  EXPECT_EQ(into, big);
  std::vector<std::byte> more(4);
  EXPECT_TRUE(fails(group[1]->to(0).recv(2, more)->wait(later()), errc::peer_left,
                    "rank 0 left the group: job done"));
  closed1 = group[1]->close("me too", later());
  leaver.join();
  EXPECT_FALSE(closed0) << text_of(closed0);
  EXPECT_FALSE(closed1) << text_of(closed1);
  EXPECT_FALSE(send->wait(later()));
  EXPECT_TRUE(fails(group[0]->to(1).send(3, {})->wait(later()), errc::shutdown, "left the group"));
  EXPECT_FALSE(group[0]->close("again", later())); // idempotent
}

TEST(ShmCloseTest, EveryRankClosingAtOnceReturnsWithoutError) {
  SKIP_WITHOUT_SHM();
  const int n = 4;
  auto group = shm::make_group(n);
  std::vector<caf::error> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      errors[static_cast<size_t>(r)] = group[static_cast<size_t>(r)]->close("end", later());
    });
  for (auto& t : threads)
    t.join();
  for (const auto& err : errors)
    EXPECT_FALSE(err) << text_of(err);
}

TEST(ShmCloseTest, CloseGivesUpAtItsDeadlineWhenAPeerNeverCloses) {
  SKIP_WITHOUT_SHM();
  auto group = shm::make_group(3);
  EXPECT_TRUE(fails(group[0]->close("bye", clock::now() + 50ms), errc::collective_timeout,
                    "ranks 1, 2 had not"));
}

// -- the algorithms over shared memory ------------------------------------------------------------

TEST(ShmAlgorithmsTest, AllReduceAllGatherAndBroadcastAreExactForEveryGroupSize) {
  SKIP_WITHOUT_SHM();
  shm::options o;
  o.ring_bytes = 64 << 10; // large messages stream through the rings
  for (int n = 1; n <= 5; ++n) {
    auto group = shm::make_group(n, o);
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}, (size_t{1} << 20) + 3}) {
      std::vector<std::vector<int64_t>> data(static_cast<size_t>(n));
      std::vector<std::vector<std::byte>> gathered(static_cast<size_t>(n));
      std::vector<std::vector<float>> bcast(static_cast<size_t>(n));
      std::vector<caf::error> errors(static_cast<size_t>(n) * 3);
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r)
        threads.emplace_back([&, r] {
          auto& d = data[static_cast<size_t>(r)];
          d.resize(count);
          for (size_t i = 0; i < count; ++i)
            d[i] = static_cast<int64_t>(i % 97) * (r + 1) - r;
          algorithm_options ao;
          ao.tag = 1;
          errors[static_cast<size_t>(r) * 3] = all_reduce(group[static_cast<size_t>(r)], d.data(),
                                                          count, dtype::int64, reduce_op::sum, ao);
          ao.tag = 2;
          std::vector<std::byte> mine(count % 1000 + static_cast<size_t>(r),
                                      static_cast<std::byte>(r + 1));
          errors[static_cast<size_t>(r) * 3 + 1] = all_gather(
              group[static_cast<size_t>(r)], mine, gathered[static_cast<size_t>(r)], nullptr, ao);
          ao.tag = 3;
          auto& b = bcast[static_cast<size_t>(r)];
          b.assign(count, r == n - 1 ? 2.5f : -1.0f);
          errors[static_cast<size_t>(r) * 3 + 2] = broadcast(
              group[static_cast<size_t>(r)], std::as_writable_bytes(std::span(b)), n - 1, ao);
        });
      for (auto& t : threads)
        t.join();
      for (const auto& err : errors)
        ASSERT_FALSE(err) << "ranks " << n << ", count " << count << ": " << text_of(err);
      int64_t rank_sum = 0, scale = 0;
      for (int r = 0; r < n; ++r) {
        rank_sum += r;
        scale += r + 1;
      }
      std::vector<std::byte> want_gather;
      for (int r = 0; r < n; ++r)
        want_gather.insert(want_gather.end(), count % 1000 + static_cast<size_t>(r),
                           static_cast<std::byte>(r + 1));
      for (int r = 0; r < n; ++r) {
        size_t bad = 0;
        for (size_t i = 0; i < count; ++i)
          bad += data[static_cast<size_t>(r)][i] != static_cast<int64_t>(i % 97) * scale - rank_sum;
        EXPECT_EQ(bad, 0u) << "all_reduce, ranks " << n << ", count " << count << ", rank " << r;
        EXPECT_EQ(gathered[static_cast<size_t>(r)], want_gather)
            << "all_gather, ranks " << n << ", count " << count << ", rank " << r;
        EXPECT_EQ(bcast[static_cast<size_t>(r)], std::vector<float>(count, 2.5f))
            << "broadcast, ranks " << n << ", count " << count << ", rank " << r;
      }
    }
  }
}

// -- across processes
// ------------------------------------------------------------------------------

/// This process's mappings of consort segments, as /proc/self/maps names them: a segment that
/// was unlinked after it was mapped reads "/dev/shm/consort-... (deleted)". (Listing /dev/shm
/// would race with the segments of other tests that CTest runs at the same time.)
std::vector<std::string> mapped_segments() {
  std::vector<std::string> out;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (auto at = line.find("/dev/shm/consort-"); at != std::string::npos)
      out.push_back(line.substr(at));
  return out;
}

/// A group of this process (rank 0) and a fork()ed child (rank 1), formed over a TCP bootstrap
/// whose listen addresses travel through pipes. `child` runs in the child with its shm context and
/// returns its exit status; the child never returns into GoogleTest.
struct forked_pair {
  pid_t pid = -1;
  context_ptr shm;
  std::string error;

  forked_pair(const shm::options& so, const std::function<int(context&)>& child)
      : forked_pair(so, so, child) {}

  forked_pair(const shm::options& so, const shm::options& child_options,
              const std::function<int(context&)>& child) {
    int to_child[2], to_parent[2];
    if (pipe(to_child) != 0 || pipe(to_parent) != 0) {
      error = "pipe failed";
      return;
    }
    auto bootstrap = [&](int rank, int read_fd, int write_fd) -> caf::expected<context_ptr> {
      tcp::mesh_options mo;
      mo.rank = rank;
      mo.size = 2;
      mo.listen_address = "127.0.0.1:0";
      mo.group_id = 77;
      mo.connect_timeout = 20s;
      mo.log = [](const std::string&) {
      };
      auto ctx = tcp::listen(mo);
      if (!ctx)
        return ctx.error();
      char mine[64] = {};
      auto address = (*ctx)->listen_address();
      std::strncpy(mine, address.c_str(), sizeof mine - 1);
      char theirs[64] = {};
      if (write(write_fd, mine, sizeof mine) != sizeof mine ||
          read(read_fd, theirs, sizeof theirs) != sizeof theirs)
        return make_caf_error(errc::peer_lost, "the address exchange through the pipes failed");
      std::vector<std::string> all = rank == 0 ? std::vector<std::string>{mine, theirs}
                                               : std::vector<std::string>{theirs, mine};
      if (auto err = (*ctx)->connect(all))
        return err;
      return context_ptr{*ctx};
    };
    pid = fork();
    if (pid == 0) {
      int status = 10;
      auto boot = bootstrap(1, to_child[0], to_parent[1]);
      if (boot) {
        auto ctx = shm::connect(**boot, child_options);
        // The bootstrap ends cleanly, as multi_worker_mirrored_strategy's mesh does: destroyed
        // at once, it could reset a connection whose last message the peer has not read yet.
        (void)(*boot)->close("formed", later());
        status = ctx ? child(**ctx) : 11;
      }
      _exit(status);
    }
    auto boot = bootstrap(0, to_parent[0], to_child[1]);
    if (!boot) {
      error = text_of(boot.error());
      return;
    }
    auto ctx = shm::connect(**boot, so);
    (void)(*boot)->close("formed", later());
    if (!ctx) {
      error = text_of(ctx.error());
      return;
    }
    shm = *ctx;
  }

  /// The child's exit status (-signal when a signal ended it).
  int join() {
    int status = 0;
    if (pid <= 0 || waitpid(pid, &status, 0) != pid)
      return -1000;
    pid = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }

  ~forked_pair() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      join();
    }
  }
};

TEST(ShmProcessTest, TwoProcessesExchangeBothWaysAndLeaveNothingInDevShm) {
  SKIP_WITHOUT_SHM();
  shm::options so;
  so.group_id = 5;
  so.secret = "s3cret";
  const size_t big = std::size_t{8} << 20;
  forked_pair p(so, [&](context& ctx) {
    std::vector<std::byte> in(big);
    if (ctx.to(0).recv(1, in)->wait(later()) || in != pattern(big, 1))
      return 2;
    auto out = pattern(big, 2);
    if (ctx.to(0).send(2, {out})->wait(later()))
      return 3;
    return ctx.close("child done", later()) ? 4 : 0;
  });
  ASSERT_TRUE(p.shm) << p.error;
  auto maps = mapped_segments();
  ASSERT_FALSE(maps.empty());
  for (const auto& m : maps)
    EXPECT_TRUE(m.ends_with("(deleted)")) << "not unlinked once every rank mapped it: " << m;
  auto out = pattern(big, 1);
  EXPECT_FALSE(p.shm->to(1).send(1, {out})->wait(later()));
  std::vector<std::byte> in(big);
  EXPECT_FALSE(p.shm->to(1).recv(2, in)->wait(later()));
  EXPECT_EQ(in, pattern(big, 2));
  EXPECT_FALSE(p.shm->close("parent done", later()));
  EXPECT_EQ(p.join(), 0);
}

TEST(ShmProcessTest, APeerProcessKilledMidWaitFailsTheWaitWithPeerLostSoon) {
  SKIP_WITHOUT_SHM();
  shm::options so;
  so.group_id = 6;
  so.liveness_interval = 50ms;
  forked_pair p(so, [&](context& ctx) {
    // Tell the parent it is ready, then wait for a message that never comes.
    std::byte ready{1};
    if (ctx.to(0).send(1, {const_bytes{&ready, 1}})->wait(later()))
      return 2;
    std::byte never{};
    (void)ctx.to(0).recv(2, {&never, 1})->wait(clock::now() + 60s);
    return 3;
  });
  ASSERT_TRUE(p.shm) << p.error;
  std::byte ready{};
  ASSERT_FALSE(p.shm->to(1).recv(1, {&ready, 1})->wait(later()));
  std::byte never{};
  auto recv = p.shm->to(1).recv(3, {&never, 1});
  ASSERT_EQ(kill(p.pid, SIGKILL), 0);
  auto start = clock::now();
  auto err = recv->wait(clock::now() + 10s);
  EXPECT_TRUE(fails(err, errc::peer_lost, "rank 1 (pid "));
  EXPECT_LT(clock::now() - start, 3s);
  EXPECT_EQ(p.join(), -SIGKILL);
}

TEST(ShmProcessTest, RanksWithDifferentSecretsCannotFormAGroup) {
  SKIP_WITHOUT_SHM();
  shm::options parent;
  parent.group_id = 7;
  parent.secret = "one";
  parent.connect_timeout = 10s;
  auto child = parent;
  child.secret = "two";
  // The child derives another segment name from its secret, so it cannot open rank 0's.
  forked_pair p(parent, child, [](context&) { return 0; });
  EXPECT_FALSE(p.shm);
  EXPECT_NE(p.error.find("not every rank could map the segment: rank 1: "), std::string::npos)
      << p.error;
  EXPECT_NE(p.error.find("cannot open shared memory"), std::string::npos) << p.error;
  EXPECT_EQ(p.join(), 11);
  EXPECT_TRUE(mapped_segments().empty()) << mapped_segments().front();
}

} // namespace
} // namespace consort::transport
