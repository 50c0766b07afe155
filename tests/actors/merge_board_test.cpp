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
      return board.call(i, 0, arg(static_cast<float>(i + 1)), typeid(int), run, 10s, 10min);
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
                            [&] { return board.call(0, 1, arg(1), typeid(int), run, 60s, 10min); });
  board.finished(1, 1, ""); // made merge call 0 only
  EXPECT_TRUE(fails_with([&] { waiting.get(); }, errc::collective_aborted,
                         {"merge_call #1 of step 7", "replica 1 finished its step without calling "
                                                     "it (it made 1 merge calls)"}));
  // A call made after the peer finished fails at once too, and so does one after a failure.
  EXPECT_TRUE(fails_with([&] { board.call(0, 2, arg(1), typeid(int), run, 60s, 10min); },
                         errc::collective_aborted, {"merge_call #2"}));
  merge_board failed(8, {0, 1});
  failed.finished(0, 0, "replica 0 (CPU:0) failed step 8: bad input");
  EXPECT_TRUE(fails_with([&] { failed.call(1, 0, arg(1), typeid(int), run, 60s, 10min); },
                         errc::collective_aborted,
                         {"replica 0 failed before calling it: replica 0 (CPU:0) failed step 8"}));
  EXPECT_EQ(runs.load(), 0);
}

TEST(MergeBoardTest, AMissingPeerTimesOutAndALateOneGetsTheSameError) {
  merge_board board(2, {0, 1});
  std::atomic<int> runs{0};
  auto run = summing(runs);
  EXPECT_TRUE(fails_with([&] { board.call(0, 0, arg(1), typeid(int), run, 50ms, 10min); },
                         errc::collective_timeout,
                         {"merge_call #0 of step 2 on replica 0", "replica(s) 1 did not call it "
                                                                  "within 50 ms"}));
  EXPECT_TRUE(fails_with([&] { board.call(1, 0, arg(1), typeid(int), run, 10s, 10min); },
                         errc::collective_timeout, {"replica(s) 1 did not call it"}));
  EXPECT_EQ(runs.load(), 0);
}

TEST(MergeBoardTest, DifferentSignaturesFailEveryCallerWithAMismatch) {
  merge_board board(0, {0, 1});
  std::atomic<int> runs{0};
  auto run = summing(runs);
  auto first = std::async(std::launch::async,
                          [&] { return board.call(0, 0, arg(1), typeid(int), run, 10s, 10min); });
  EXPECT_TRUE(fails_with([&] { board.call(1, 0, arg(1), typeid(float), run, 10s, 10min); },
                         errc::collective_mismatch, {"replicas 0 and 1", "different functions"}));
  EXPECT_TRUE(fails_with([&] { first.get(); }, errc::collective_mismatch, {"replicas 0 and 1"}));
  EXPECT_EQ(runs.load(), 0);
}

TEST(MergeBoardTest, TheFunctionsErrorReachesEveryCallerWithItsCode) {
  merge_board board(1, {0, 1});
  merge_board::runner throwing = [](const std::vector<std::vector<nest>>&) -> std::vector<nest> {
    throw error(errc::unsupported, "not here");
  };
  auto first = std::async(std::launch::async, [&] {
    return board.call(0, 0, arg(1), typeid(int), throwing, 10s, 10min);
  });
  EXPECT_TRUE(fails_with([&] { board.call(1, 0, arg(1), typeid(int), throwing, 10s, 10min); },
                         errc::unsupported, {"the merge function, run on replica", "not here"}));
  EXPECT_TRUE(fails_with([&] { first.get(); }, errc::unsupported, {"not here"}));
  // The wrong number of results is an error too.
  merge_board short_board(1, {0});
  merge_board::runner none = [](const std::vector<std::vector<nest>>&) {
    return std::vector<nest>{};
  };
  EXPECT_TRUE(fails_with([&] { short_board.call(0, 0, arg(1), typeid(int), none, 10s, 10min); },
                         errc::invalid_argument, {"gave 0 results for 1 local replicas"}));
}

/// A merge function that blocks until released: it says which replica ran it, and every wait in
/// it and on it is bounded (a broken board fails the test instead of hanging it).
struct blocking_function {
  std::promise<size_t> running;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();

  merge_board::runner for_replica(size_t index) {
    return [this, index](const std::vector<std::vector<nest>>& all) {
      running.set_value(index);
      EXPECT_EQ(released.wait_for(60s), std::future_status::ready);
      return std::vector<nest>(all.size(), nest(tensor::scalar<float>(9.0f)));
    };
  }
};

TEST(MergeBoardTest, WaitersWaitForARunningFunctionPastTheirDeadline) {
  // Once every replica has arrived, the others wait for the function, even past their deadline:
  // it completes the call for all.
  merge_board board(0, {0, 1});
  blocking_function fn;
  auto ran_by = fn.running.get_future();
  std::vector<std::future<nest>> calls;
  for (size_t i = 0; i < 2; ++i)
    calls.push_back(std::async(std::launch::async, [&, i, run = fn.for_replica(i)] {
      return board.call(i, 0, arg(1), typeid(int), run, 300ms, 10min);
    }));
  ASSERT_EQ(ran_by.wait_for(60s), std::future_status::ready);
  const size_t waiter = 1 - ran_by.get();
  // The waiter's 300 ms pass while the function runs: it must not time out.
  EXPECT_EQ(calls[waiter].wait_for(500ms), std::future_status::timeout);
  fn.release.set_value();
  EXPECT_EQ(calls[0].get().as_tensor().item<float>(), 9.0f);
  EXPECT_EQ(calls[1].get().as_tensor().item<float>(), 9.0f);
}

TEST(MergeBoardTest, AWaiterGivesUpOnAFunctionThatOutlivesTheStepDeadline) {
  merge_board board(4, {0, 1});
  blocking_function fn;
  auto ran_by = fn.running.get_future();
  std::vector<std::future<nest>> calls;
  for (size_t i = 0; i < 2; ++i)
    calls.push_back(std::async(std::launch::async, [&, i, run = fn.for_replica(i)] {
      return board.call(i, 0, arg(1), typeid(int), run, 10s, 100ms);
    }));
  ASSERT_EQ(ran_by.wait_for(60s), std::future_status::ready);
  const size_t runner = ran_by.get();
  const size_t waiter = 1 - runner;
  // The waiter fails at the step deadline (100 ms after the function started), well before the
  // call's own 10 s deadline, while the function still runs; the runner finishes.
  if (calls[waiter].wait_for(5s) != std::future_status::ready) {
    fn.release.set_value();
    FAIL() << "the waiter did not give up at the step deadline";
  }
  EXPECT_TRUE(fails_with([&] { calls[waiter].get(); }, errc::step_timeout,
                         {"merge_call #0 of step 4 on replica " + std::to_string(waiter),
                          "the merge function, running on replica " + std::to_string(runner),
                          "has not returned within 100 ms"}));
  fn.release.set_value();
  EXPECT_EQ(calls[runner].get().as_tensor().item<float>(), 9.0f);
}

} // namespace
} // namespace consort::detail
