// The merge_call rendezvous (actors/merge_board) on plain threads, free of CAF, so that the TSan
// tier can judge its locking (tools/sanitize.sh). Nothing sleeps: a late replica waits on an event.

#include "actors/merge_board.hpp"

#include "support/expect_error.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>
#include <typeinfo>
#include <vector>

namespace consort::detail {
namespace {

using namespace std::chrono_literals;
using test::fails_with;

/// Sums argument 0 over the replicas and gives every replica the sum plus its index.
merge_board::runner summing(std::atomic<int>& runs) {
  return [&runs](const std::vector<std::vector<nest>>& all) {
    ++runs;
    float total = 0;
    for (const auto& args : all)
      total += args[0].as_tensor().item<float>();
    std::vector<nest> out;
    for (size_t i = 0; i < all.size(); ++i)
      out.emplace_back(tensor::scalar<float>(total + static_cast<float>(i)));
    return out;
  };
}

std::vector<nest> arg(float v) {
  return {nest(tensor::scalar<float>(v))};
}

TEST(MergeBoardTest, TheLastToArriveRunsTheFunctionOnceAndEachGetsItsResult) {
  merge_board board(3, {4, 5, 6});
  std::atomic<int> runs{0};
  auto run = summing(runs);
  std::vector<std::future<nest>> calls;
  for (size_t i = 0; i < 3; ++i)
    calls.push_back(std::async(std::launch::async, [&, i] {
      return board.call(i, 0, arg(static_cast<float>(i + 1)), typeid(int), run, 10s);
    }));
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(calls[i].get().as_tensor().item<float>(), 6.0f + static_cast<float>(i));
  EXPECT_EQ(runs.load(), 1);
}

TEST(MergeBoardTest, APeerThatFinishedWithoutTheCallFailsTheWaitersAtOnce) {
  merge_board board(7, {0, 1});
  std::atomic<int> runs{0};
  auto run = summing(runs);
  auto waiting = std::async(std::launch::async,
                            [&] { return board.call(0, 1, arg(1), typeid(int), run, 60s); });
  board.finished(1, 1, ""); // made merge call 0 only
  EXPECT_TRUE(fails_with([&] { waiting.get(); }, errc::collective_aborted,
                         {"merge_call #1 of step 7", "replica 1 finished its step without calling "
                                                     "it (it made 1 merge calls)"}));
  // A call made after the peer finished fails at once too, and so does one after a failure.
  EXPECT_TRUE(fails_with([&] { board.call(0, 2, arg(1), typeid(int), run, 60s); },
                         errc::collective_aborted, {"merge_call #2"}));
  merge_board failed(8, {0, 1});
  failed.finished(0, 0, "replica 0 (CPU:0) failed step 8: bad input");
  EXPECT_TRUE(fails_with([&] { failed.call(1, 0, arg(1), typeid(int), run, 60s); },
                         errc::collective_aborted,
                         {"replica 0 failed before calling it: replica 0 (CPU:0) failed step 8"}));
  EXPECT_EQ(runs.load(), 0);
}

TEST(MergeBoardTest, AMissingPeerTimesOutAndALateOneGetsTheSameError) {
  merge_board board(2, {0, 1});
  std::atomic<int> runs{0};
  auto run = summing(runs);
  EXPECT_TRUE(fails_with([&] { board.call(0, 0, arg(1), typeid(int), run, 50ms); },
                         errc::collective_timeout,
                         {"merge_call #0 of step 2 on replica 0", "replica(s) 1 did not call it "
                                                                  "within 50 ms"}));
  EXPECT_TRUE(fails_with([&] { board.call(1, 0, arg(1), typeid(int), run, 10s); },
                         errc::collective_timeout, {"replica(s) 1 did not call it"}));
  EXPECT_EQ(runs.load(), 0);
}

TEST(MergeBoardTest, DifferentSignaturesFailEveryCallerWithAMismatch) {
  merge_board board(0, {0, 1});
  std::atomic<int> runs{0};
  auto run = summing(runs);
  auto first = std::async(std::launch::async,
                          [&] { return board.call(0, 0, arg(1), typeid(int), run, 10s); });
  EXPECT_TRUE(fails_with([&] { board.call(1, 0, arg(1), typeid(float), run, 10s); },
                         errc::collective_mismatch, {"replicas 0 and 1", "different functions"}));
  EXPECT_TRUE(fails_with([&] { first.get(); }, errc::collective_mismatch, {"replicas 0 and 1"}));
  EXPECT_EQ(runs.load(), 0);
}

TEST(MergeBoardTest, TheFunctionsErrorReachesEveryCallerWithItsCode) {
  merge_board board(1, {0, 1});
  merge_board::runner throwing = [](const std::vector<std::vector<nest>>&) -> std::vector<nest> {
    throw error(errc::unsupported, "not here");
  };
  auto first = std::async(std::launch::async,
                          [&] { return board.call(0, 0, arg(1), typeid(int), throwing, 10s); });
  EXPECT_TRUE(fails_with([&] { board.call(1, 0, arg(1), typeid(int), throwing, 10s); },
                         errc::unsupported, {"the merge function, run on replica", "not here"}));
  EXPECT_TRUE(fails_with([&] { first.get(); }, errc::unsupported, {"not here"}));
  // The wrong number of results is an error too.
  merge_board short_board(1, {0});
  merge_board::runner none = [](const std::vector<std::vector<nest>>&) {
    return std::vector<nest>{};
  };
  EXPECT_TRUE(fails_with([&] { short_board.call(0, 0, arg(1), typeid(int), none, 10s); },
                         errc::invalid_argument, {"gave 0 results for 1 local replicas"}));
}

TEST(MergeBoardTest, WaitersWaitForARunningFunctionPastTheirDeadline) {
  // Once every replica has arrived, the others wait for the function, even past their deadline:
  // it completes the call for all (its own calls have deadlines, and the step has one).
  merge_board board(0, {0, 1});
  std::promise<void> release;
  auto released = release.get_future().share();
  std::promise<void> running;
  merge_board::runner slow = [&](const std::vector<std::vector<nest>>& all) {
    running.set_value();
    released.wait();
    return std::vector<nest>(all.size(), nest(tensor::scalar<float>(9.0f)));
  };
  auto first = std::async(std::launch::async,
                          [&] { return board.call(0, 0, arg(1), typeid(int), slow, 300ms); });
  auto last = std::async(std::launch::async,
                         [&] { return board.call(1, 0, arg(1), typeid(int), slow, 300ms); });
  running.get_future().wait();
  // The waiter's 300 ms pass while the function runs: it must not time out.
  EXPECT_EQ(first.wait_for(500ms), std::future_status::timeout);
  EXPECT_EQ(last.wait_for(0ms), std::future_status::timeout);
  release.set_value();
  EXPECT_EQ(first.get().as_tensor().item<float>(), 9.0f);
  EXPECT_EQ(last.get().as_tensor().item<float>(), 9.0f);
}

} // namespace
} // namespace consort::detail
