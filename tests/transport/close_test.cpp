// Tests of the end of a rank's life in a group (transport::context::close): a rank that leaves
// after its last call still delivers every byte of it, even to a peer that reads late; a peer's
// calls that the leaver never started fail with peer_left naming it; nothing waits past a
// deadline. TCP over loopback (ranks are threads of this process) and the local transport.
// Nothing sleeps: slow readers are held on a condition and released by an event.

#include "support/time_scale.hpp"
#include "support/transport_helpers.hpp"

#include <consort/caf_error.hpp>
#include <consort/error.hpp>
#include <consort/transport/algorithms.hpp>
#include <consort/transport/local.hpp>
#include <consort/transport/pair.hpp>
#include <consort/transport/tcp.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
using consort::errc;
using consort::test::has_error;
using consort::test::log_capture;
using consort::test::text_of;
namespace transport = consort::transport;
namespace tcp = consort::transport::tcp;
using bytes = std::vector<std::byte>;
using transport::clock;
using context_ptr = std::shared_ptr<tcp::context>;
using tweak_fn = std::function<void(int rank, tcp::mesh_options&)>;

transport::deadline in(std::chrono::milliseconds ms) {
  return clock::now() + ms;
}

bytes pattern(std::size_t size, unsigned seed) {
  bytes out(size);
  for (std::size_t i = 0; i < size; ++i)
    out[i] = static_cast<std::byte>((i * 131 + seed * 17) & 0xff);
  return out;
}

std::vector<context_ptr> make_mesh(int n, const tweak_fn& tweak = {},
                                   const consort::test::hooks_tweak& hooks = {}) {
  return consort::test::make_tcp_mesh(n, tweak, hooks);
}

/// A gate that a hook waits at until the test opens it (or a deadline passes, so that a broken
/// test cannot hang).
class gate {
public:
  void open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  void pass() {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, 20s, [this] { return open_; });
  }

private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// -- TCP -----------------------------------------------------------------------------------------

// The race of the field report, made deterministic: rank 1 finishes its sends and leaves while
// rank 0 has not read them yet (its reads from rank 1 are held until rank 1's goodbye is out and
// its side half-closed). Every byte still reaches rank 0, and rank 1's close waits for rank 0 to
// have read them (its end of file) instead of cutting the connection.
TEST(TcpCloseTest, ASlowReceiverGetsEverySendOfARankThatLeftBeforeItRead) {
  auto slow = std::make_shared<gate>();
  std::atomic<bool> armed{false};
  auto ctxs = make_mesh(
      2,
      [&](int, tcp::mesh_options& opts) {
        // Room in the kernel for the sends below, whether or not rank 0 reads.
        opts.send_buffer_bytes = opts.recv_buffer_bytes = 1 << 20;
      },
      [&](int rank, tcp::test_hooks& hooks) {
        if (rank == 0)
          hooks.before_read = [&armed, slow](int) {
            if (armed.load())
              slow->pass();
          };
        else
          hooks.after_goodbye = [slow] {
            slow->open();
          };
      });
  ASSERT_EQ(ctxs.size(), 2u);
  armed = true;
  // Within what the kernel buffers on loopback, so the sends complete with rank 0 not reading.
  auto out = pattern(192 * 1024, 1);
  auto out2 = pattern(1000, 2);
  auto s1 = ctxs[1]->to(0).send(1, {transport::const_bytes(out)});
  auto s2 = ctxs[1]->to(0).send(2, {transport::const_bytes(out2)});
  ASSERT_FALSE(s1->wait(in(10s))) << "the sends of rank 1 complete before rank 0 reads";
  ASSERT_FALSE(s2->wait(in(10s)));
  auto closed = std::async(std::launch::async, [&] { return ctxs[1]->close("done", in(10s)); });
  // Rank 0 reads late: after the goodbye, the end of file of rank 1 is already on its way.
  bytes got(out.size()), got2(out2.size()), never(8);
  auto r1 = ctxs[0]->to(1).recv(1, got);
  EXPECT_FALSE(r1->wait(in(10s))) << text_of(r1->wait(in(1s)));
  EXPECT_EQ(got, out);
  auto r2 = ctxs[0]->to(1).recv(2, got2);
  EXPECT_FALSE(r2->wait(in(10s)));
  EXPECT_EQ(got2, out2);
  EXPECT_FALSE(closed.get()) << "rank 1's close returns once rank 0 closed its side";
  // Nothing more comes from rank 1: a receive it never answers fails at once, naming it.
  auto r3 = ctxs[0]->to(1).recv(3, never);
  EXPECT_TRUE(has_error(r3->wait(in(10s)), errc::peer_left,
                        {"recv of tag 3", "rank 1 left the group (done)", "never started"}));
  auto s3 = ctxs[0]->to(1).send(3, {transport::const_bytes(out2)});
  EXPECT_TRUE(has_error(s3->wait(in(10s)), errc::peer_left, {"send of tag 3", "rank 1 left"}));
}

// A receive already waiting when the peer leaves fails at once with peer_left, never hangs to
// its deadline, and the peer's close returns promptly (the receiver closes its side at once).
TEST(TcpCloseTest, APendingReceiveFailsWithPeerLeftWhenThePeerLeaves) {
  log_capture logs;
  auto ctxs = make_mesh(3, [&](int, tcp::mesh_options& opts) { opts.log = logs.sink(); });
  ASSERT_EQ(ctxs.size(), 3u);
  bytes buf(64);
  auto pending = ctxs[0]->to(2).recv(9, buf);
  auto started = clock::now();
  EXPECT_FALSE(ctxs[2]->close("worker 2 returned from main", in(10s)));
  EXPECT_TRUE(has_error(pending->wait(in(30s)), errc::peer_left,
                        {"recv of tag 9", "rank 2 left the group (worker 2 returned from main)"}));
  EXPECT_LT(clock::now() - started, consort::test::scaled(5s));
  EXPECT_TRUE(logs.wait_for({"left the group", "1 receive(s) from it were pending"}, 10s));
  // The pairs between the others are untouched.
  bytes a = pattern(100, 3), b(100);
  auto r = ctxs[1]->to(0).recv(4, b);
  auto s = ctxs[0]->to(1).send(4, {transport::const_bytes(a)});
  EXPECT_FALSE(s->wait(in(10s)));
  EXPECT_FALSE(r->wait(in(10s)));
  EXPECT_EQ(a, b);
}

// The leaver refuses new work with `shutdown`, and fails its own waiting receives with it.
TEST(TcpCloseTest, OperationsOfARankThatLeftFailWithShutdown) {
  auto ctxs = make_mesh(2);
  ASSERT_EQ(ctxs.size(), 2u);
  bytes buf(16);
  auto mine = ctxs[0]->to(1).recv(5, buf);
  EXPECT_FALSE(ctxs[0]->close("bye", in(10s)));
  EXPECT_TRUE(has_error(mine->wait(in(10s)), errc::shutdown, {"left the group (bye)"}));
  auto later = ctxs[0]->to(1).send(6, {transport::const_bytes(buf)});
  EXPECT_TRUE(has_error(later->wait(in(10s)), errc::shutdown, {"leaving the group"}));
  EXPECT_FALSE(ctxs[0]->close("again", in(1s))) << "a second close returns at once";
}

// Every rank leaving at the same time, the usual end of a job: all return without error.
TEST(TcpCloseTest, AllRanksLeavingAtOnceReturnWithoutError) {
  auto ctxs = make_mesh(4);
  ASSERT_EQ(ctxs.size(), 4u);
  std::vector<std::future<caf::error>> closes;
  for (auto& ctx : ctxs)
    closes.push_back(std::async(std::launch::async, [ctx] { return ctx->close("end", in(10s)); }));
  for (auto& c : closes) {
    auto err = c.get();
    EXPECT_FALSE(err) << text_of(err);
  }
}

// A peer that never reads (stopped, hung) cannot hold the leaver beyond its deadline.
TEST(TcpCloseTest, CloseGivesUpAtItsDeadlineWhenAPeerNeverClosesItsSide) {
  auto stuck = std::make_shared<gate>();
  std::atomic<bool> armed{false};
  auto ctxs = make_mesh(2, {}, [&](int rank, tcp::test_hooks& hooks) {
    if (rank == 0)
      hooks.before_read = [&armed, stuck](int) {
        if (armed.load())
          stuck->pass();
      };
  });
  ASSERT_EQ(ctxs.size(), 2u);
  armed = true;
  auto started = clock::now();
  auto err = ctxs[1]->close("bye", in(300ms));
  auto took = clock::now() - started;
  EXPECT_TRUE(has_error(err, errc::collective_timeout,
                        {"rank 1 left the group (bye)", "rank 0", "did not close its side"}));
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, consort::test::scaled(5s));
  stuck->open();
}

// A collective that a rank never started, because it left: the rank whose receive meets the
// goodbye fails with peer_left, and its abort carries that cause to the ranks that only wait on
// it, so every survivor reports peer_left naming the leaver, small and large.
TEST(TcpCloseTest, ACollectiveALeaverNeverStartedFailsWithPeerLeftOnEverySurvivor) {
  for (std::size_t count : {std::size_t{1}, std::size_t{1} << 18}) {
    auto ctxs = make_mesh(3);
    ASSERT_EQ(ctxs.size(), 3u);
    ASSERT_FALSE(ctxs[2]->close("worker 2 is done", in(10s)));
    std::vector<std::future<caf::error>> runs;
    std::vector<std::vector<float>> data(2, std::vector<float>(count, 1.0f));
    for (int r = 0; r < 2; ++r)
      runs.push_back(std::async(std::launch::async, [&, r] {
        transport::algorithm_options opts;
        opts.timeout = 20s;
        return transport::all_reduce(ctxs[r], data[r].data(), count, consort::dtype::float32,
                                     consort::reduce_op::sum, opts);
      }));
    for (int r = 0; r < 2; ++r)
      EXPECT_TRUE(has_error(runs[r].get(), errc::peer_left, {"rank 2 left the group"}))
          << "rank " << r << ", " << count << " elements";
  }
}

// -- local ---------------------------------------------------------------------------------------

// The in-process transport keeps the same contract: the leaver's sends are received first, then
// what waits on it fails with peer_left and its own operations with shutdown.
TEST(LocalCloseTest, ARankThatLeftDeliversItsSendsThenFailsItsPeersWithPeerLeft) {
  auto group = transport::local::make_group(2);
  auto out = pattern(256, 4);
  auto sent = group[1]->to(0).send(1, {transport::const_bytes(out)});
  auto closed =
      std::async(std::launch::async, [&] { return group[1]->close("local bye", in(10s)); });
  bytes got(out.size()), never(4);
  auto r1 = group[0]->to(1).recv(1, got);
  // Said in full when it fails: this check failed once in CI's TSan tier (1 run in more than 800
  // since), and the error is the clue.
  auto received = r1->wait(in(10s));
  EXPECT_FALSE(received) << consort::to_consort_error(received, "").what();
  EXPECT_EQ(got, out);
  EXPECT_FALSE(closed.get());
  EXPECT_FALSE(sent->wait(in(1s)));
  auto r2 = group[0]->to(1).recv(2, never);
  EXPECT_TRUE(
      has_error(r2->wait(in(10s)), errc::peer_left, {"rank 1 left the group", "local bye"}));
  auto own = group[1]->to(0).send(3, {transport::const_bytes(out)});
  EXPECT_TRUE(has_error(own->wait(in(10s)), errc::shutdown, {"this rank left the group"}));
}

// A send that no receive has met when its rank leaves is kept for the peer, as TCP's socket
// buffer and reader keep it: close returns at once (it does not wait for a peer that may never
// read), the send completes, and the peer still receives the message later, in its order, even
// after the leaver reused its buffer. What the leaver never sent fails with peer_left.
TEST(LocalCloseTest, ALeaversSendThatNoReceiveMetIsKeptForThePeerAndCloseReturnsAtOnce) {
  auto group = transport::local::make_group(3);
  auto first = pattern(8, 5), second = pattern(1000, 6), empty = bytes{};
  auto s1 = group[1]->to(0).send(1, {transport::const_bytes(first)});
  auto s2 = group[1]->to(0).send(1, {transport::const_bytes(second)});
  auto s3 = group[1]->to(2).send(7, {transport::const_bytes(empty)});
  auto started = clock::now();
  EXPECT_FALSE(group[1]->close("bye", in(30s)));
  EXPECT_LT(clock::now() - started, consort::test::scaled(5s)) << "close waited for a receive";
  for (auto* s : {&s1, &s2, &s3})
    EXPECT_FALSE((*s)->wait(in(1s)));
  auto expected_first = first, expected_second = second;
  std::fill(first.begin(), first.end(), std::byte{0}); // the leaver's buffers are its own again
  std::fill(second.begin(), second.end(), std::byte{0});
  bytes got1(expected_first.size()), got2(expected_second.size()), got3, never(4);
  auto r1 = group[0]->to(1).recv(1, got1);
  auto r2 = group[0]->to(1).recv_at_most(1, got2);
  auto r3 = group[2]->to(1).recv(7, got3);
  EXPECT_FALSE(r1->wait(in(1s)));
  EXPECT_FALSE(r2->wait(in(1s)));
  EXPECT_FALSE(r3->wait(in(1s)));
  EXPECT_EQ(got1, expected_first);
  EXPECT_EQ(got2, expected_second);
  EXPECT_EQ(r2->message_bytes(), expected_second.size());
  // Nothing more from it: another receive of the same tag, or of another tag, fails at once.
  auto r4 = group[0]->to(1).recv(1, never);
  EXPECT_TRUE(has_error(r4->wait(in(10s)), errc::peer_left, {"rank 1 left the group", "bye"}));
  auto r5 = group[2]->to(1).recv(8, never);
  EXPECT_TRUE(has_error(r5->wait(in(10s)), errc::peer_left, {"rank 1 left the group"}));
  auto to_leaver = group[0]->to(1).send(2, {transport::const_bytes(never)});
  EXPECT_TRUE(has_error(to_leaver->wait(in(10s)), errc::peer_left, {"rank 1 left the group"}));
  // Destroying the peer that never read a kept message frees it; nothing hangs.
  auto s4 = group[2]->to(0).send(3, {transport::const_bytes(never)});
  group[0]->abort("rank 0 stops");
  EXPECT_TRUE(has_error(s4->wait(in(10s)), errc::peer_lost, {"rank 0 was lost"}));
}

} // namespace
