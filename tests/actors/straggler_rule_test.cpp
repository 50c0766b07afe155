// The flight recorder's live straggler rule (actors/flight_recorder.hpp, docs/debugging.md "A
// straggler"): who is named, after how many steps, with the default rule and with the share and
// window of strategy_options (or CONSORT_STRAGGLER_SHARE / CONSORT_STRAGGLER_STEPS), and the
// errors of a malformed rule, from the recorder and from a strategy's constructor.
//
// A step here is made to have lasted 100 ms (it is recorded as started 100 ms before now) and
// worker 1 entered its one collective 10 ms after the others: 10 % of the step.

#include "actors/flight_recorder.hpp"
#include "transport/algorithms/group_call.hpp"

#include <consort/consort.hpp>

#include "support/expect_error.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

namespace consort::detail {
namespace {

using namespace std::chrono_literals;
using consort::test::fails_with;

struct env_var {
  env_var(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~env_var() { ::unsetenv(name_); }
  env_var(const env_var&) = delete;
  env_var& operator=(const env_var&) = delete;
  const char* name_;
};

// Three workers; worker `late` entered step `step`'s collective `late_ms` after the one before.
void late_step(flight_recorder& rec, uint64_t step, int late, double late_ms) {
  const auto now = flight_recorder::clock::now();
  rec.step_started(step, now - 100ms);
  flight_signature sig;
  auto h = rec.collective(step, 0, 0, sig, flight_state::waiting, now, now);
  ASSERT_TRUE(h);
  rec.lateness(h)->last.store(late);
  rec.lateness(h)->margin_ns.store(static_cast<int64_t>(late_ms * 1e6));
  rec.ended(h, errc::none);
  rec.step_ended(step, true);
}

struct recorder_of_three {
  explicit recorder_of_three(flight_recorder::straggler_rule rule = {}) {
    rec.set_straggler_rule(rule);
    rec.set_straggler_log([this](const std::string& line) { lines.push_back(line); });
  }
  flight_recorder rec{100, 0, {"worker:0", "worker:1", "worker:2"}};
  std::vector<std::string> lines;
};

TEST(StragglerRule, TheDefaultNamesAWorkerTenPercentLateAtItsEleventhStepOnce) {
  recorder_of_three r;
  EXPECT_EQ(r.rec.rule().share, 0.05);
  EXPECT_EQ(r.rec.rule().steps, 20);
  for (uint64_t s = 0; s < 10; ++s)
    late_step(r.rec, s, 1, 10);
  EXPECT_TRUE(r.lines.empty()) << "10 of 20 steps is not more than half";
  EXPECT_FALSE(r.rec.stragglers()[1].named);
  late_step(r.rec, 10, 1, 10);
  ASSERT_EQ(r.lines.size(), 1u);
  EXPECT_NE(r.lines[0].find("straggler: worker:1 entered the collectives last in 11 of the last 11 "
                            "steps (through step 10)"),
            std::string::npos)
      << r.lines[0];
  for (uint64_t s = 11; s < 30; ++s)
    late_step(r.rec, s, 1, 10);
  EXPECT_EQ(r.lines.size(), 1u) << "named once";
  const auto stats = r.rec.stragglers();
  ASSERT_EQ(stats.size(), 3u);
  EXPECT_TRUE(stats[1].named);
  EXPECT_EQ(stats[1].last_steps, 20);
  EXPECT_EQ(stats[1].steps, 20);
  EXPECT_NEAR(stats[1].late_ms, 10, 1e-9);
  EXPECT_FALSE(stats[0].named);
  EXPECT_FALSE(stats[2].named);
}

TEST(StragglerRule, ALargerShareLetsTheSameLatenessPassAndASmallerOneNamesLess) {
  recorder_of_three wide({0.2, 20});
  for (uint64_t s = 0; s < 30; ++s)
    late_step(wide.rec, s, 1, 10);
  EXPECT_TRUE(wide.lines.empty()) << wide.lines.front();
  EXPECT_EQ(wide.rec.stragglers()[1].last_steps, 0) << "10 % of the step is under 20 %";
  EXPECT_FALSE(wide.rec.stragglers()[1].named);

  recorder_of_three fine({0.01, 20});
  for (uint64_t s = 0; s < 11; ++s)
    late_step(fine.rec, s, 2, 2); // 2 % of the step
  ASSERT_EQ(fine.lines.size(), 1u);
  EXPECT_NE(fine.lines[0].find("straggler: worker:2 "), std::string::npos) << fine.lines[0];
}

TEST(StragglerRule, AShorterWindowNamesSoonerAndForgetsSooner) {
  recorder_of_three r({0.05, 4});
  late_step(r.rec, 0, 1, 10);
  late_step(r.rec, 1, 1, 10);
  EXPECT_TRUE(r.lines.empty()) << "2 of 4 steps is not more than half";
  late_step(r.rec, 2, 1, 10);
  ASSERT_EQ(r.lines.size(), 1u);
  EXPECT_NE(r.lines[0].find("worker:1 entered the collectives last in 3 of the last 3 steps"),
            std::string::npos)
      << r.lines[0];
  // The window keeps 4 steps: worker 2 late at the next 4 leaves worker 1 none of them.
  for (uint64_t s = 3; s < 7; ++s)
    late_step(r.rec, s, 2, 10);
  const auto stats = r.rec.stragglers();
  EXPECT_EQ(stats[1].steps, 4);
  EXPECT_EQ(stats[1].last_steps, 0);
  EXPECT_EQ(stats[2].last_steps, 4);
  EXPECT_TRUE(stats[1].named) << "once named, it stays named";
  EXPECT_TRUE(stats[2].named);
  EXPECT_EQ(r.lines.size(), 2u);
}

TEST(StragglerRule, TheOptionsWinOverTheVariablesWhichWinOverTheDefaults) {
  auto rule = flight_recorder::straggler_rule_for(-1, -1);
  EXPECT_EQ(rule.share, 0.05);
  EXPECT_EQ(rule.steps, 20);
  env_var share("CONSORT_STRAGGLER_SHARE", "0.25");
  env_var steps("CONSORT_STRAGGLER_STEPS", "8");
  rule = flight_recorder::straggler_rule_for(-1, -1);
  EXPECT_EQ(rule.share, 0.25);
  EXPECT_EQ(rule.steps, 8);
  rule = flight_recorder::straggler_rule_for(0.5, 1000);
  EXPECT_EQ(rule.share, 0.5);
  EXPECT_EQ(rule.steps, 1000);
}

TEST(StragglerRule, AMalformedRuleIsRefusedSayingWhatWasExpected) {
  for (double bad : {0.0, 1.5, -0.5, -2.0})
    EXPECT_TRUE(fails_with([&] { flight_recorder::straggler_rule_for(bad, -1); },
                           errc::invalid_argument,
                           {"strategy_options::straggler_share is",
                            "expected a share of the step above 0 and at most 1"}))
        << bad;
  for (int bad : {0, 1001, -2})
    EXPECT_TRUE(fails_with([&] { flight_recorder::straggler_rule_for(-1, bad); },
                           errc::invalid_argument,
                           {"strategy_options::straggler_steps is " + std::to_string(bad),
                            "expected a window of 1 to 1000 steps"}))
        << bad;
  for (const char* bad : {"lots", "0", "1.01", "0.1x", "nan"}) {
    env_var share("CONSORT_STRAGGLER_SHARE", bad);
    EXPECT_TRUE(fails_with(
        [&] { flight_recorder::straggler_rule_for(-1, -1); }, errc::invalid_argument,
        {std::string{"CONSORT_STRAGGLER_SHARE is \""} + bad + "\"", "above 0 and at most 1"}))
        << bad;
  }
  for (const char* bad : {"many", "0", "1001", "-1", "99999999999"}) {
    env_var steps("CONSORT_STRAGGLER_STEPS", bad);
    EXPECT_TRUE(
        fails_with([&] { flight_recorder::straggler_rule_for(-1, -1); }, errc::invalid_argument,
                   {std::string{"CONSORT_STRAGGLER_STEPS is \""} + bad + "\"", "1 to 1000 steps"}))
        << bad;
  }
}

// Through the public API: the strategy refuses a malformed rule before anything starts.
TEST(StragglerRule, AStrategyRefusesAMalformedRuleFromItsOptionsOrTheEnvironment) {
  strategy_options opts;
  opts.straggler_share = 2;
  EXPECT_TRUE(fails_with(
      [&] {
        mirrored_strategy s({"CPU:0", "CPU:1"}, opts);
      },
      errc::invalid_argument, {"strategy_options::straggler_share is 2"}));
  opts.straggler_share = -1;
  opts.straggler_steps = 0;
  EXPECT_TRUE(fails_with([&] { mirrored_strategy s({"CPU:0"}, opts); }, errc::invalid_argument,
                         {"strategy_options::straggler_steps is 0"}));
  env_var steps("CONSORT_STRAGGLER_STEPS", "twenty");
  EXPECT_TRUE(fails_with([] { multi_worker_mirrored_strategy s; }, errc::invalid_argument,
                         {"CONSORT_STRAGGLER_STEPS is \"twenty\""}));
}

// Entry times reach the other workers on the system clock, mapped from the steady clock by one
// pair of readings taken when the recorder starts. A pause between the two reads (a descheduled
// thread) would shift every entry time of this worker by the pause and make it read as late (or
// early) at every call: the straggler test once named the wrong worker, 1.85 ms late in 18 of 20
// steps, under a sanitizer. Here the first bracket holds a 2 ms pause, the later ones do not.
namespace fake_clocks {
int64_t now_ns = 0;           // the true time
int reads = 0;                // steady reads so far
int64_t pause_ns = 2'000'000; // added after the first steady read
std::chrono::steady_clock::time_point steady() {
  const int64_t t = now_ns;
  now_ns += 50; // a read takes 50 ns
  if (reads++ == 0)
    now_ns += pause_ns; // descheduled right after the first read
  return std::chrono::steady_clock::time_point{std::chrono::nanoseconds{t}};
}
int64_t wall() {
  const int64_t t = now_ns;
  now_ns += 50;
  return 1'700'000'000'000'000'000 + t; // the system clock: a fixed offset from steady
}
} // namespace fake_clocks

TEST(StragglerRule, TheRecordersClocksArePairedByTheTightestOfSeveralReadings) {
  fake_clocks::now_ns = 1'000'000;
  fake_clocks::reads = 0;
  const auto [steady, unix_ns] = clock_pair(&fake_clocks::steady, &fake_clocks::wall);
  const int64_t offset = unix_ns - steady.time_since_epoch().count();
  // The true offset is 1.7e18 exactly; one bracket of 2 reads is off by the pause (2 ms).
  EXPECT_LE(std::abs(offset - 1'700'000'000'000'000'000), 100) << offset;
  EXPECT_GT(fake_clocks::reads, 2) << "read again after the paused bracket";

  // On the real clocks the pair agrees with a bracketed reading taken now to within the
  // readings' own width (plus what the system clock may be slewed by in between: nothing here).
  const auto real = clock_pair(&std::chrono::steady_clock::now, [] {
    return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::system_clock::now().time_since_epoch())
                                    .count());
  });
  const auto again = clock_pair(&std::chrono::steady_clock::now, [] {
    return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::system_clock::now().time_since_epoch())
                                    .count());
  });
  const auto off = [](const auto& p) {
    return p.second -
           std::chrono::duration_cast<std::chrono::nanoseconds>(p.first.time_since_epoch()).count();
  };
  EXPECT_LE(std::abs(off(real) - off(again)), 1'000'000) << "1 ms: two pairings a moment apart";
}

} // namespace
} // namespace consort::detail
