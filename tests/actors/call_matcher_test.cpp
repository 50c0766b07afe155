// The matching of collective calls (actors/call_matcher.hpp) without an actor system: slots,
// the check against the first arrival, step reports and deadlines, on a clock the test moves.

#include "actors/call_matcher.hpp"

#include <consort/error.hpp>
#include <consort/future.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

namespace consort::detail {
namespace {

using namespace std::chrono_literals;
using clock_type = call_matcher::clock;

collective_call call_of(int replica, uint32_t seq, nest value, step_id step = 0) {
  collective_call call;
  call.step = step;
  call.seq = seq;
  call.replica = replica;
  call.request.kind = collective_kind::all_reduce;
  call.request.value = std::move(value);
  return call;
}

/// A replica's call as the matcher sees it, and the future it waits on.
struct pending_call {
  reply_to reply;
  future<nest> result;
};

pending_call reply_for() {
  auto [state, fut] = make_future<nest>();
  pending_call p;
  p.reply.state = state;
  p.result = std::move(fut);
  return p;
}

/// The executor of the tests: `complete` answers every reply with the number of calls in the
/// slot (the arithmetic is call_checks_test's); it records what the matcher asked of it.
struct recording_executor {
  int completed = 0;
  int failed = 0;
  std::vector<clock_type::time_point> armed;
  call_matcher::executor exec;

  recording_executor() {
    exec.complete = [this](slot& s) {
      ++completed;
      for (auto& r : s.replies)
        r.deliver(nest(tensor::scalar<float>(static_cast<float>(s.arrived))));
    };
    exec.failed = [this](slot&) {
      ++failed;
    };
    exec.arm_tick = [this](clock_type::time_point t) {
      armed.push_back(t);
    };
  }
};

/// Makes `call` on `m` at `now` and returns the future its caller waits on.
future<nest> submit(call_matcher& m, recording_executor& ex, collective_call call,
                    clock_type::time_point now = clock_type::now()) {
  auto p = reply_for();
  m.call(call, std::move(p.reply), now, ex.exec);
  return std::move(p.result);
}

/// The error a finished future holds ("" and errc::none when it holds a value).
std::pair<errc, std::string> outcome(future<nest>& f) {
  if (!f.ready())
    return {errc::none, "not ready"};
  try {
    f.get();
  } catch (const error& e) {
    return {e.code(), e.what()};
  }
  return {errc::none, ""};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CallMatcherTest, TheLastArrivalCompletesTheSlotOnceAndItIsForgotten) {
  call_matcher m({0, 1, 2}, 0, 30s);
  recording_executor ex;
  auto t0 = clock_type::now();
  std::vector<future<nest>> calls;
  for (int r : {2, 0})
    calls.push_back(submit(m, ex, call_of(r, 0, tensor::scalar<float>(1)), t0));
  EXPECT_EQ(ex.completed, 0);
  EXPECT_FALSE(calls[0].ready());
  EXPECT_EQ(m.slots(), 1u);
  EXPECT_EQ(ex.armed, (std::vector<clock_type::time_point>{t0 + 30s})) << "one tick, armed once";
  calls.push_back(submit(m, ex, call_of(1, 0, tensor::scalar<float>(1)), t0));
  EXPECT_EQ(ex.completed, 1);
  for (auto& c : calls)
    EXPECT_EQ(c.get().as_tensor().item<float>(), 3.0f);
  EXPECT_EQ(m.slots(), 0u);
  EXPECT_EQ(m.deadlines(), 0u);
}

TEST(CallMatcherTest, ACallThatDisagreesWithTheFirstArrivalFailsEveryReplicaNamingBoth) {
  call_matcher m({0, 1}, 0, 30s);
  recording_executor ex;
  auto a = submit(m, ex, call_of(0, 0, tensor::from<float>({1, 2}, {2})));
  auto b = submit(m, ex, call_of(1, 0, tensor::from<double>({1, 2}, {2})));
  for (auto* f : {&a, &b}) {
    auto [code, what] = outcome(*f);
    EXPECT_EQ(code, errc::collective_mismatch);
    EXPECT_TRUE(contains(what, "replica 1 passed float64 but replica 0 passed float32")) << what;
  }
  EXPECT_EQ(ex.completed, 0);
  EXPECT_GE(ex.failed, 1) << "the executor is told (across workers it tells the others)";
  EXPECT_EQ(m.deadlines(), 0u) << "a failed slot keeps no deadline";
}

TEST(CallMatcherTest, ADeadlineFailsTheSlotNamingArrivedAndMissingReplicasAndRearmsTheTick) {
  call_matcher m({0, 1}, 0, 30s);
  recording_executor ex;
  auto t0 = clock_type::now();
  auto first = call_of(0, 0, tensor::scalar<float>(1));
  first.request.timeout = 100ms;
  auto a = submit(m, ex, first, t0);
  // A later call of a later step with a later deadline arms nothing new.
  auto b = submit(m, ex, call_of(0, 0, tensor::scalar<float>(1), 1), t0 + 10ms);
  ASSERT_EQ(ex.armed.size(), 1u);
  EXPECT_EQ(ex.armed[0], t0 + 100ms);
  m.expire(t0 + 99ms, ex.exec); // a tick that came early: nothing is due, it is armed again
  EXPECT_FALSE(a.ready()) << "not before its deadline";
  m.expire(t0 + 100ms, ex.exec);
  auto [code, what] = outcome(a);
  EXPECT_EQ(code, errc::collective_timeout);
  EXPECT_TRUE(contains(what, "all_reduce(SUM) #0 of step 0 timed out after 100 ms: replicas [0] "
                             "arrived, replicas [1] did not"))
      << what;
  EXPECT_FALSE(b.ready());
  // After each tick, the next one is armed for the earliest deadline left.
  EXPECT_EQ(ex.armed,
            (std::vector<clock_type::time_point>{t0 + 100ms, t0 + 100ms, t0 + 10ms + 30s}));
}

TEST(CallMatcherTest, AReplicaThatFinishedWithoutACallFailsItsPeersAtOnceAndLaterCallsToo) {
  call_matcher m({0, 1}, 0, 30s);
  recording_executor ex;
  auto a = submit(m, ex, call_of(0, 0, tensor::scalar<float>(1)));
  step_report done{0, 1, 0, {}}; // step 0, replica 1, after 0 calls, no failure
  m.report(done, ex.exec);
  auto [code, what] = outcome(a);
  EXPECT_EQ(code, errc::collective_aborted);
  EXPECT_TRUE(contains(what, "replica 1 finished step 0 after 0 collective call(s), without "
                             "making call #0"))
      << what;
  // Its next call of that step fails at once too, without a deadline.
  auto b = submit(m, ex, call_of(0, 1, tensor::scalar<float>(1)));
  EXPECT_EQ(outcome(b).first, errc::collective_aborted);
  // Once every replica reported, the step is forgotten.
  step_report mine{0, 0, 2, {}};
  m.report(mine, ex.exec);
  EXPECT_EQ(m.steps(), 0u);
  EXPECT_EQ(m.deadlines(), 0u);
}

TEST(CallMatcherTest, AFailedStepReportCarriesTheReplicasOwnError) {
  call_matcher m({0, 1}, 0, 30s);
  recording_executor ex;
  auto a = submit(m, ex, call_of(0, 0, tensor::scalar<float>(1)));
  step_report failed{0, 1, 0, make_caf_error(errc::step_failed, "bad batch")};
  m.report(failed, ex.exec);
  auto [code, what] = outcome(a);
  EXPECT_EQ(code, errc::collective_aborted);
  EXPECT_TRUE(contains(what, "replica 1 failed the step")) << what;
  EXPECT_TRUE(contains(what, "bad batch")) << what;
}

TEST(CallMatcherTest, BadCallsAreClearErrorsAndLeaveTheSlotUsable) {
  call_matcher m({0, 1}, 0, 30s);
  recording_executor ex;
  auto stranger = submit(m, ex, call_of(9, 0, tensor::scalar<float>(1)));
  auto [code9, what9] = outcome(stranger);
  EXPECT_EQ(code9, errc::invalid_argument);
  EXPECT_TRUE(contains(what9, "replica 9, which is not in this group")) << what9;
  auto a = submit(m, ex, call_of(0, 0, tensor::scalar<float>(1)));
  auto twice = submit(m, ex, call_of(0, 0, tensor::scalar<float>(1)));
  auto [code2, what2] = outcome(twice);
  EXPECT_EQ(code2, errc::invalid_argument);
  EXPECT_TRUE(contains(what2, "replica 0 called all_reduce(SUM) #0 of step 0 twice")) << what2;
  // The slot still completes when replica 1 comes.
  auto b = submit(m, ex, call_of(1, 0, tensor::scalar<float>(1)));
  EXPECT_EQ(ex.completed, 1);
  EXPECT_EQ(a.get().as_tensor().item<float>(), 2.0f);
}

} // namespace
} // namespace consort::detail
