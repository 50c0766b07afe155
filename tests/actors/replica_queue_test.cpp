// Tests of detail::replica_queue, through which NCCL work that another thread queued on a GPU
// replica's stream reaches the replica: waiting in order, deadlines, failures seen after the GPU
// finished, and that nothing is left behind. The works are scripted fakes (no GPU needed); the GPU
// side (events, communicators) is covered by the gpu-labelled tests.

#include "actors/gpu_collectives.hpp"
#include "support/expect_error.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using namespace consort;
using consort::detail::queued_work;
using consort::detail::replica_queue;
using consort::test::fails_with;
using namespace std::chrono_literals;

namespace {

/// What the fakes saw, in order: "finished A", "check A", "expire A".
struct journal {
  std::vector<std::string> entries;
  std::optional<error> shared_failure; // the communicators' failure, once any work records it
};

/// A work that finishes after `polls` calls of finished() (never, for -1, until `release` is
/// set), started unless `not_started()`, with an optional failure that check() reports from poll
/// `fail_at` on (an asynchronous NCCL error), and expire() recording the failure for every work
/// of the same journal, as aborting a communicator does.
class scripted_work final : public queued_work {
public:
  scripted_work(std::string what, std::chrono::milliseconds timeout, int polls,
                std::shared_ptr<journal> log)
      : queued_work(std::move(what), timeout), polls_(polls), log_(std::move(log)) {}

  scripted_work& failing_at(int poll, errc code) {
    fail_at_ = poll;
    fail_code_ = code;
    return *this;
  }
  scripted_work& stream_failing() {
    stream_fails_ = true;
    return *this;
  }
  scripted_work& not_started() {
    started_ = false;
    return *this;
  }
  scripted_work& until(std::atomic<bool>* release, std::atomic<int>* polled) {
    release_ = release;
    polled_ = polled;
    return *this;
  }

  bool started() override { return started_; }

  bool finished() override {
    ++seen_;
    if (polled_ != nullptr) {
      polled_->fetch_add(1);
      return release_->load();
    }
    log_->entries.push_back("finished " + what());
    if (stream_fails_)
      throw error(errc::device_error, "the stream of " + what() + " failed");
    return polls_ >= 0 && seen_ >= polls_;
  }
  void check() override {
    if (polled_ == nullptr)
      log_->entries.push_back("check " + what());
    if (fail_at_ && seen_ >= *fail_at_ && !log_->shared_failure)
      log_->shared_failure.emplace(fail_code_, what() + ": NCCL reported an asynchronous error");
    if (log_->shared_failure)
      throw *log_->shared_failure;
  }
  [[noreturn]] void expire(const std::string& message) override {
    log_->entries.push_back("expire " + what());
    if (!log_->shared_failure)
      log_->shared_failure.emplace(errc::collective_timeout, message);
    throw *log_->shared_failure;
  }

private:
  int polls_;
  int seen_ = 0;
  bool started_ = true;
  std::optional<int> fail_at_;
  errc fail_code_ = errc::none;
  bool stream_fails_ = false;
  std::atomic<bool>* release_ = nullptr;
  std::atomic<int>* polled_ = nullptr;
  std::shared_ptr<journal> log_;
};

std::unique_ptr<scripted_work> work(const std::string& what, std::chrono::milliseconds timeout,
                                    int polls, const std::shared_ptr<journal>& log) {
  return std::make_unique<scripted_work>(what, timeout, polls, log);
}

replica_queue queue_with_backlog(std::chrono::milliseconds backlog) {
  return replica_queue{nullptr, 0, backlog};
}

} // namespace

TEST(ReplicaQueue, SettlingNothingReturnsAtOnce) {
  auto stream = std::make_shared<int>(7);
  replica_queue q{stream, 2, 0ms};
  EXPECT_EQ(q.size(), 0u);
  EXPECT_NO_THROW(q.settle());
  EXPECT_EQ(q.stream(), stream.get());
  EXPECT_EQ(q.device(), 2);
  EXPECT_EQ(stream.use_count(), 2) << "the queue keeps the replica's stream alive";
}

TEST(ReplicaQueue, SettleWaitsForEveryWorkInTheOrderQueuedAndLeavesNothing) {
  auto log = std::make_shared<journal>();
  auto q = queue_with_backlog(60s);
  q.add(work("A", 60s, 3, log));
  q.add(work("B", 60s, 1, log));
  EXPECT_EQ(q.size(), 2u);
  q.settle();
  EXPECT_EQ(q.size(), 0u);
  // A is polled until it finishes, asked about failures each time, and only then B.
  const std::vector<std::string> expected{"finished A", "check A", "finished A", "check A",
                                          "finished A", "check A", "finished B", "check B"};
  EXPECT_EQ(log->entries, expected);
  log->entries.clear();
  q.settle(); // settled work is not waited for again
  EXPECT_TRUE(log->entries.empty());
}

TEST(ReplicaQueue, AStartedWorkPastItsTimeoutExpiresWithCollectiveTimeoutAndTheRestIsDropped) {
  auto log = std::make_shared<journal>();
  auto q = queue_with_backlog(60s);
  q.add(work("all_reduce(SUM) #4 of step 2", 0ms, -1, log));
  q.add(work("broadcast #5 of step 2", 60s, 1, log));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::collective_timeout,
                         {"all_reduce(SUM) #4 of step 2", "of the GPU reaching it", "aborted"}));
  EXPECT_EQ(q.size(), 0u);
  // One look, then the deadline: the later work is abandoned (its communicators were aborted).
  const std::vector<std::string> expected{"finished all_reduce(SUM) #4 of step 2",
                                          "check all_reduce(SUM) #4 of step 2",
                                          "expire all_reduce(SUM) #4 of step 2"};
  EXPECT_EQ(log->entries, expected);
}

TEST(ReplicaQueue, GpuWorkQueuedBeforeACallDoesNotCountAgainstItsTimeout) {
  // The stream has not reached the call yet: its own timeout (0 ms) has not begun, and the
  // backlog allowance lets it finish.
  auto log = std::make_shared<journal>();
  auto q = queue_with_backlog(60s);
  auto w = work("all_gather #1 of step 0", 0ms, 3, log);
  w->not_started();
  q.add(std::move(w));
  EXPECT_NO_THROW(q.settle());
  EXPECT_EQ(log->entries.size(), 6u);
}

TEST(ReplicaQueue, AStreamThatNeverReachesTheCallExpiresAfterTheBacklogAllowance) {
  auto log = std::make_shared<journal>();
  auto q = queue_with_backlog(0ms);
  auto w = work("all_gather #1 of step 0", 0ms, -1, log);
  w->not_started();
  q.add(std::move(w));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::collective_timeout,
                         {"all_gather #1 of step 0", "the GPU never reached the call"}));
}

TEST(ReplicaQueue, AFailureSeenWhenTheWorkHasFinishedIsStillThrown) {
  // An asynchronous NCCL error (or an abort) also ends the work on the GPU, with a result that
  // must not be used: finishing is not success.
  auto log = std::make_shared<journal>();
  auto q = queue_with_backlog(60s);
  auto w = work("all_gather #0 of step 0", 60s, 1, log);
  w->failing_at(1, errc::peer_lost);
  q.add(std::move(w));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::peer_lost,
                         {"all_gather #0 of step 0", "asynchronous error"}));
  EXPECT_EQ(q.size(), 0u);
}

TEST(ReplicaQueue, AFailingStreamIsReportedAsADeviceError) {
  auto log = std::make_shared<journal>();
  auto q = queue_with_backlog(60s);
  auto w = work("broadcast #1 of step 7", 60s, 1, log);
  w->stream_failing();
  q.add(std::move(w));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::device_error, {"broadcast #1 of step 7"}));
  EXPECT_EQ(q.size(), 0u);
}

TEST(ReplicaQueue, AFailureIsThrownToEveryLaterSettleUntilTheNextStepClearsIt) {
  // The collective actor may settle a replica's queue on its behalf: the replica must still
  // learn that its calls failed.
  auto log = std::make_shared<journal>();
  auto q = queue_with_backlog(60s);
  q.add(work("all_reduce(MAX) #2 of step 4", 0ms, -1, log));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::collective_timeout, {"#2 of step 4"}));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::collective_timeout, {"#2 of step 4"}));
  q.add(work("late", 60s, 1, log));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::collective_timeout, {"#2 of step 4"}));
  q.clear_failure();
  log->shared_failure.reset();
  q.add(work("next step", 60s, 1, log));
  EXPECT_NO_THROW(q.settle());
  EXPECT_EQ(q.size(), 0u);
}

TEST(ReplicaQueue, EveryReplicaOfAFailedCommunicatorFailsWithTheFirstFailure) {
  // Two replicas' queues hold their parts of the same call; the first replica's part expires
  // (aborting the communicators), and the second replica's part, finished by the abort, reports
  // that same failure rather than a result.
  auto log = std::make_shared<journal>();
  auto first = queue_with_backlog(60s);
  auto second = queue_with_backlog(60s);
  first.add(work("all_reduce(MEAN) #0 of step 9", 0ms, -1, log));
  second.add(work("all_reduce(MEAN) #0 of step 9", 60s, 1, log));
  EXPECT_TRUE(fails_with([&] { first.settle(); }, errc::collective_timeout,
                         {"all_reduce(MEAN) #0 of step 9"}));
  EXPECT_TRUE(fails_with([&] { second.settle(); }, errc::collective_timeout,
                         {"all_reduce(MEAN) #0 of step 9", "of the GPU reaching it"}));
}

TEST(ReplicaQueue, ASecondSettlerWaitsForTheWorkTheFirstIsWaitingFor) {
  // Settling takes turns, and a work leaves the queue only once it has finished: a second thread
  // never returns while work queued before its call is still running.
  auto log = std::make_shared<journal>();
  auto q = std::make_shared<replica_queue>(nullptr, 0, 60s);
  std::atomic<bool> release{false};
  std::atomic<int> polled{0};
  auto w = work("slow", 60s, -1, log);
  w->until(&release, &polled);
  q->add(std::move(w));
  std::atomic<bool> second_returned_early{false};
  std::thread first{[q] {
    q->settle();
  }};
  auto wait_for_polls = [&](int n) {
    while (polled.load() < n)
      std::this_thread::yield();
  };
  wait_for_polls(100); // the first settler is polling, past its yields
  std::atomic<bool> second_started{false};
  std::thread second{[&] {
    second_started = true;
    q->settle();
    second_returned_early = !release.load();
  }};
  while (!second_started.load())
    std::this_thread::yield();
  wait_for_polls(polled.load() + 20); // more polls (each a sleep of up to 1 ms) meanwhile
  release = true;
  first.join();
  second.join();
  EXPECT_FALSE(second_returned_early.load());
  EXPECT_EQ(q->size(), 0u);
}

TEST(ReplicaQueue, WorkAddedFromAnotherThreadIsSettledByTheReplica) {
  auto log = std::make_shared<journal>();
  auto q = std::make_shared<replica_queue>(nullptr, 0, 60s);
  std::thread issuer{[q, log] {
    for (int i = 0; i < 100; ++i)
      q->add(work("call " + std::to_string(i), 60s, 1, log));
  }};
  issuer.join();
  q->settle();
  EXPECT_EQ(q->size(), 0u);
  EXPECT_EQ(log->entries.size(), 200u);
  EXPECT_EQ(log->entries.back(), "check call 99");
}
