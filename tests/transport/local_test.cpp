// The in-memory transport: matching by tag and order, zero-copy until matched, deadlines, abort.
// Several ranks are threads of this process; nothing sleeps, every wait has a deadline.

#include <consort/caf_error.hpp>

#include "support/time_scale.hpp"
#include <consort/error.hpp>
#include <consort/transport/local.hpp>

#include <caf/error.hpp>

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace consort::transport {
namespace {

using namespace std::chrono_literals;

/// A deadline that a correct test never reaches.
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

std::vector<std::byte> bytes_of(const std::string& text) {
  std::vector<std::byte> out(text.size());
  // An empty vector's data() may be null, and memcpy's pointers must not be, even for 0 bytes.
  if (!text.empty())
    std::memcpy(out.data(), text.data(), text.size());
  return out;
}

std::string string_of(const std::vector<std::byte>& bytes) {
  return std::string{reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

TEST(LocalTransportTest, SendBeforeReceiveDeliversTheBytes) {
  auto group = local::make_group(2);
  auto payload = bytes_of("hello");
  auto send = group[0]->to(1).send(7, {payload});
  std::vector<std::byte> into(5);
  auto recv = group[1]->to(0).recv(7, into);
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
  EXPECT_EQ(string_of(into), "hello");
}

TEST(LocalTransportTest, ReceiveBeforeSendDeliversTheBytes) {
  auto group = local::make_group(2);
  std::vector<std::byte> into(5);
  auto recv = group[1]->to(0).recv(7, into);
  EXPECT_FALSE(recv->done());
  auto payload = bytes_of("world");
  auto send = group[0]->to(1).send(7, {payload});
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
  EXPECT_EQ(string_of(into), "world");
}

TEST(LocalTransportTest, SendGathersItsPartsInOrder) {
  auto group = local::make_group(2);
  auto a = bytes_of("head|");
  auto b = bytes_of("");
  auto c = bytes_of("payload");
  std::vector<std::byte> into(12);
  auto recv = group[0]->to(1).recv(1, into);
  auto send = group[1]->to(0).send(1, {a, b, c});
  ASSERT_FALSE(recv->wait(later()));
  EXPECT_EQ(string_of(into), "head|payload");
  EXPECT_FALSE(send->wait(later()));
}

TEST(SendParts, KeepsFourInPlaceThenEveryPartInOrderOnTheHeap) {
  std::array<std::byte, 6> bytes{};
  auto part = [&](size_t i) {
    return const_bytes{bytes.data() + i, 1};
  };
  send_parts parts{part(0), part(1)};
  for (size_t i = 2; i < 6; ++i)
    parts.push_back(part(i)); // the fifth moves all of them to the heap
  ASSERT_EQ(parts.size(), 6u);
  for (size_t i = 0; i < 6; ++i)
    EXPECT_EQ(parts[i].data(), bytes.data() + i) << i;
  send_parts copy = parts;
  send_parts moved = std::move(parts);
  EXPECT_TRUE(parts.empty()); // NOLINT(bugprone-use-after-move): a moved-from list is empty
  EXPECT_EQ(parts.begin(), parts.end());
  size_t i = 0;
  for (const auto& p : moved)
    EXPECT_EQ(p.data(), bytes.data() + i++);
  EXPECT_EQ(i, 6u);
  EXPECT_EQ(copy.size(), 6u);
  EXPECT_EQ(copy[5].data(), bytes.data() + 5);
  send_parts few{part(3)};
  few = std::move(copy);
  EXPECT_EQ(few.size(), 6u);
  EXPECT_TRUE(copy.empty()); // NOLINT(bugprone-use-after-move)
}

TEST(LocalTransportTest, AMessageOfManyPartsArrivesWhole) {
  auto group = local::make_group(2);
  std::vector<std::vector<std::byte>> pieces;
  for (const char* text : {"a", "bc", "", "def", "g", "hi"})
    pieces.push_back(bytes_of(text));
  send_parts parts;
  for (const auto& piece : pieces)
    parts.push_back(piece);
  std::vector<std::byte> into(9);
  auto recv = group[0]->to(1).recv(1, into);
  auto send = group[1]->to(0).send(1, std::move(parts));
  ASSERT_FALSE(recv->wait(later()));
  EXPECT_EQ(string_of(into), "abcdefghi");
  EXPECT_FALSE(send->wait(later()));
}

/// "m0", "m1", ... (built with append: g++ 12 warns falsely on "m" + std::to_string(i)).
std::string label(int i) {
  std::string out{"m"};
  out.append(std::to_string(i));
  return out;
}

TEST(LocalTransportTest, MessagesWithOneTagArriveInSendOrder) {
  auto group = local::make_group(2);
  std::vector<std::vector<std::byte>> payloads;
  for (int i = 0; i < 10; ++i)
    payloads.push_back(bytes_of(label(i)));
  std::vector<operation_ptr> sends;
  for (int i = 0; i < 5; ++i)
    sends.push_back(group[0]->to(1).send(3, {payloads[static_cast<size_t>(i)]}));
  std::vector<std::vector<std::byte>> into(10, std::vector<std::byte>(2));
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

TEST(LocalTransportTest, ReceivesMatchByTagNotByPostingOrder) {
  auto group = local::make_group(2);
  std::vector<std::byte> first(1);
  std::vector<std::byte> second(1);
  auto recv_tag2 = group[1]->to(0).recv(2, second);
  auto recv_tag1 = group[1]->to(0).recv(1, first);
  std::array<std::byte, 1> one{std::byte{1}};
  std::array<std::byte, 1> two{std::byte{2}};
  auto send1 = group[0]->to(1).send(1, {one});
  EXPECT_FALSE(recv_tag1->wait(later()));
  EXPECT_FALSE(recv_tag2->done());
  auto send2 = group[0]->to(1).send(2, {two});
  EXPECT_FALSE(recv_tag2->wait(later()));
  EXPECT_EQ(first[0], std::byte{1});
  EXPECT_EQ(second[0], std::byte{2});
}

TEST(LocalTransportTest, ChannelsFromDifferentPeersAreIndependent) {
  auto group = local::make_group(3);
  std::array<std::byte, 1> from1{std::byte{1}};
  std::array<std::byte, 1> from2{std::byte{2}};
  auto s2 = group[2]->to(0).send(9, {from2});
  auto s1 = group[1]->to(0).send(9, {from1});
  std::vector<std::byte> a(1);
  std::vector<std::byte> b(1);
  auto r1 = group[0]->to(1).recv(9, a);
  auto r2 = group[0]->to(2).recv(9, b);
  ASSERT_FALSE(wait_all({r1, r2, s1, s2}, later()));
  EXPECT_EQ(a[0], std::byte{1});
  EXPECT_EQ(b[0], std::byte{2});
}

TEST(LocalTransportTest, ZeroByteMessagesComplete) {
  auto group = local::make_group(2);
  auto send = group[0]->to(1).send(4, {});
  auto recv = group[1]->to(0).recv(4, {});
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_FALSE(send->wait(later()));
}

TEST(LocalTransportTest, SendCopiesNothingUntilMatched) {
  auto group = local::make_group(2);
  auto payload = bytes_of("before");
  auto send = group[0]->to(1).send(5, {payload});
  EXPECT_FALSE(send->done()) << "a send completes only when the receiver has the bytes";
  // Not allowed by pair::send's contract; done here only to show that the bytes are read in
  // place when the receive is matched, not copied when the send is posted.
  std::memcpy(payload.data(), "after!", 6);
  std::vector<std::byte> into(6);
  auto recv = group[1]->to(0).recv(5, into);
  ASSERT_FALSE(recv->wait(later()));
  EXPECT_TRUE(send->done());
  EXPECT_EQ(string_of(into), "after!");
}

TEST(LocalTransportTest, SizeMismatchFailsTheReceiveWithInvalidArgumentAndDropsTheMessage) {
  auto group = local::make_group(2);
  auto big = bytes_of("12345678");
  auto small = bytes_of("abcd");
  auto s1 = group[0]->to(1).send(6, {big});
  auto s2 = group[0]->to(1).send(6, {small});
  std::vector<std::byte> into(4);
  auto r1 = group[1]->to(0).recv(6, into);
  auto err = r1->wait(later());
  EXPECT_EQ(code_of(err), errc::invalid_argument) << text_of(err);
  EXPECT_NE(text_of(err).find("8 bytes"), std::string::npos) << text_of(err);
  EXPECT_NE(text_of(err).find("receive of 4 bytes"), std::string::npos) << text_of(err);
  EXPECT_FALSE(s1->wait(later())) << "the sender cannot tell, as on a wire";
  // The next message with that tag matches the next receive.
  auto r2 = group[1]->to(0).recv(6, into);
  EXPECT_FALSE(r2->wait(later()));
  EXPECT_EQ(string_of(into), "abcd");
}

TEST(LocalTransportTest, RecvAtMostTakesAnySmallerMessageAndSaysItsSize) {
  auto group = local::make_group(2);
  std::vector<std::byte> into(8);
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
  auto err = larger->wait(later());
  EXPECT_EQ(code_of(err), errc::invalid_argument) << text_of(err);
  EXPECT_NE(text_of(err).find("9 bytes, more than the buffer takes"), std::string::npos)
      << text_of(err);
  EXPECT_EQ(larger->message_bytes(), 0u);
  auto empty = group[1]->to(0).recv_at_most(7, into);
  ASSERT_FALSE(empty->wait(later()));
  EXPECT_EQ(empty->message_bytes(), 0u);
  EXPECT_EQ(s2->message_bytes(), 9u) << "a send's message_bytes is its size";
}

TEST(LocalTransportTest, WaitTimesOutWithCollectiveTimeoutAndTheOperationCanStillComplete) {
  auto group = local::make_group(2);
  std::vector<std::byte> into(3);
  auto recv = group[1]->to(0).recv(11, into);
  const auto start = clock::now();
  auto err = recv->wait(start + 50ms);
  const auto waited = clock::now() - start;
  EXPECT_EQ(code_of(err), errc::collective_timeout) << text_of(err);
  EXPECT_GE(waited, 50ms);
  EXPECT_LT(waited, consort::test::scaled(5s));
  EXPECT_NE(text_of(err).find("from rank 0"), std::string::npos) << text_of(err);
  EXPECT_NE(text_of(err).find("rank 1"), std::string::npos) << text_of(err);
  // A deadline in the past returns at once.
  EXPECT_EQ(code_of(recv->wait(clock::now() - 1s)), errc::collective_timeout);
  auto payload = bytes_of("yes");
  auto send = group[0]->to(1).send(11, {payload});
  EXPECT_FALSE(recv->wait(later()));
  EXPECT_EQ(string_of(into), "yes");
}

TEST(LocalTransportTest, AbortFailsPendingAndLaterOperationsWithPeerLost) {
  auto group = local::make_group(3);
  std::vector<std::byte> a(1);
  std::vector<std::byte> b(1);
  auto own_pending = group[1]->to(0).recv(1, a);  // rank 1's own receive
  auto peer_pending = group[0]->to(1).recv(2, b); // rank 0 waits for rank 1
  std::array<std::byte, 1> x{};
  auto unrelated = group[0]->to(2).send(3, {x});
  group[1]->abort("worker 1 was killed");
  for (const auto& op : {own_pending, peer_pending}) {
    auto err = op->wait(later());
    EXPECT_EQ(code_of(err), errc::peer_lost) << text_of(err);
    EXPECT_NE(text_of(err).find("worker 1 was killed"), std::string::npos) << text_of(err);
  }
  EXPECT_NE(text_of(own_pending->wait(later())).find("this context was aborted"),
            std::string::npos);
  EXPECT_NE(text_of(peer_pending->wait(later())).find("rank 1 was lost"), std::string::npos);
  // Later operations fail at once, on both sides.
  auto later_send = group[0]->to(1).send(4, {x});
  auto later_own = group[1]->to(2).send(4, {x});
  EXPECT_TRUE(later_send->done());
  EXPECT_EQ(code_of(later_send->wait(later())), errc::peer_lost);
  EXPECT_EQ(code_of(later_own->wait(later())), errc::peer_lost);
  // Pairs that do not involve rank 1 keep working.
  std::vector<std::byte> c(1);
  auto r = group[2]->to(0).recv(3, c);
  EXPECT_FALSE(r->wait(later()));
  EXPECT_FALSE(unrelated->wait(later()));
}

TEST(LocalTransportTest, AbortWakesABlockedWaiterPromptly) {
  auto group = local::make_group(2);
  std::vector<std::byte> into(8);
  auto recv = group[0]->to(1).recv(1, into);
  caf::error err;
  clock::duration waited{};
  std::thread waiter([&] {
    const auto start = clock::now();
    err = recv->wait(start + 30s);
    waited = clock::now() - start;
  });
  group[1]->abort("lost in a partition");
  waiter.join();
  EXPECT_EQ(code_of(err), errc::peer_lost) << text_of(err);
  EXPECT_LT(waited, consort::test::scaled(5s));
}

TEST(LocalTransportTest, DestroyingAContextFailsItsPeersOperations) {
  auto group = local::make_group(2);
  std::vector<std::byte> into(8);
  auto recv = group[0]->to(1).recv(1, into);
  group[1].reset();
  auto err = recv->wait(later());
  EXPECT_EQ(code_of(err), errc::peer_lost) << text_of(err);
  EXPECT_NE(text_of(err).find("destroyed"), std::string::npos) << text_of(err);
}

TEST(LocalTransportTest, MakeGroupRejectsAnEmptyGroupAndPairsCheckTheirPeer) {
  EXPECT_THROW(local::make_group(0), consort::error);
  auto group = local::make_group(1);
  ASSERT_EQ(group.size(), 1u);
  EXPECT_EQ(group[0]->rank(), 0);
  EXPECT_EQ(group[0]->size(), 1);
  EXPECT_THROW(group[0]->to(0), consort::error);
  auto two = local::make_group(2);
  EXPECT_EQ(two[1]->to(0).peer_rank(), 0);
  EXPECT_THROW(two[1]->to(2), consort::error);
}

TEST(LocalTransportTest, EveryRankExchangesWithEveryOtherConcurrently) {
  constexpr int n = 8;
  constexpr int rounds = 50;
  auto group = local::make_group(n);
  std::vector<int> failures(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto& ctx = *group[static_cast<size_t>(r)];
      for (int round = 0; round < rounds; ++round) {
        // Message size depends on (sender, receiver, round), so mismatches would show.
        std::vector<std::vector<std::byte>> out(n);
        std::vector<std::vector<std::byte>> in(n);
        std::vector<operation_ptr> ops;
        for (int p = 0; p < n; ++p) {
          if (p == r)
            continue;
          const auto up = static_cast<size_t>(p);
          out[up].assign(static_cast<size_t>(r * 31 + p * 7 + round) % 97,
                         std::byte(static_cast<unsigned char>(r)));
          in[up].resize(static_cast<size_t>(p * 31 + r * 7 + round) % 97);
          ops.push_back(ctx.to(p).recv(static_cast<uint64_t>(round), in[up]));
          ops.push_back(ctx.to(p).send(static_cast<uint64_t>(round), {out[up]}));
        }
        if (wait_all(ops, later()))
          ++failures[static_cast<size_t>(r)];
        for (int p = 0; p < n; ++p)
          for (auto byte : in[static_cast<size_t>(p)])
            if (byte != std::byte(static_cast<unsigned char>(p)))
              ++failures[static_cast<size_t>(r)];
      }
    });
  }
  for (auto& t : threads)
    t.join();
  for (int r = 0; r < n; ++r)
    EXPECT_EQ(failures[static_cast<size_t>(r)], 0) << "rank " << r;
}

TEST(LocalTransportTest, PingPongBetweenTwoThreads) {
  constexpr int iterations = 2000;
  auto group = local::make_group(2);
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
    auto send = group[0]->to(1).send(1, {ping});
    ASSERT_FALSE(group[0]->to(1).recv(2, pong)->wait(later()));
    ASSERT_FALSE(send->wait(later()));
    ASSERT_EQ(pong[0], ping[0]);
  }
  const auto elapsed = std::chrono::duration<double, std::micro>(clock::now() - start);
  echo.join();
  EXPECT_FALSE(failure) << text_of(failure);
  std::printf("[ figure   ] local transport 8-byte ping-pong round trip: %.2f us (mean of %d)\n",
              elapsed.count() / iterations, iterations);
}

} // namespace
} // namespace consort::transport
