// Tests of detail::replica_queue, through which NCCL work that another thread queued on a GPU
// replica's stream reaches the replica: waiting in order, deadlines, failures seen after the GPU
// finished, and that nothing is left behind. The works are scripted fakes (no GPU needed); the GPU
// side (events, communicators) is covered by the gpu-labelled tests.

#include "actors/gpu_collectives.hpp"
#include "support/expect_error.hpp"

#include <gtest/gtest.h>

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

/// A work that finishes after `polls` calls of finished(), with an optional failure that check()
/// reports from poll `fail_at` on (an asynchronous NCCL error), and expire() recording the failure
/// for every work of the same journal, as aborting a communicator does.
class scripted_work final : public queued_work {
public:
  scripted_work(std::string what, clock::time_point deadline, int polls,
                std::shared_ptr<journal> log)
      : queued_work(std::move(what), deadline), polls_(polls), log_(std::move(log)) {}

  scripted_work& failing_at(int poll, errc code) {
    fail_at_ = poll;
    fail_code_ = code;
    return *this;
  }
  scripted_work& stream_failing() {
    stream_fails_ = true;
    return *this;
  }

  bool finished() override {
    ++seen_;
    log_->entries.push_back("finished " + what());
    if (stream_fails_)
      throw error(errc::device_error, "the stream of " + what() + " failed");
    return seen_ >= polls_;
  }
  void check() override {
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
  std::optional<int> fail_at_;
  errc fail_code_ = errc::none;
  bool stream_fails_ = false;
  std::shared_ptr<journal> log_;
};

auto later() {
  return queued_work::clock::now() + 60s;
}

std::unique_ptr<scripted_work> work(const std::string& what, queued_work::clock::time_point due,
                                    int polls, const std::shared_ptr<journal>& log) {
  return std::make_unique<scripted_work>(what, due, polls, log);
}

} // namespace

TEST(ReplicaQueue, SettlingNothingReturnsAtOnce) {
  replica_queue q{nullptr, 0};
  EXPECT_EQ(q.size(), 0u);
  EXPECT_NO_THROW(q.settle());
  EXPECT_EQ(q.stream(), nullptr);
  EXPECT_EQ(q.device(), 0);
}

TEST(ReplicaQueue, SettleWaitsForEveryWorkInTheOrderQueuedAndLeavesNothing) {
  auto log = std::make_shared<journal>();
  replica_queue q{nullptr, 3};
  q.add(work("A", later(), 3, log));
  q.add(work("B", later(), 1, log));
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

TEST(ReplicaQueue, AWorkPastItsDeadlineExpiresWithCollectiveTimeoutAndTheRestIsDropped) {
  auto log = std::make_shared<journal>();
  replica_queue q{nullptr, 0};
  q.add(work("all_reduce(SUM) #4 of step 2", queued_work::clock::now() - 1ms, 1000, log));
  q.add(work("broadcast #5 of step 2", later(), 1, log));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::collective_timeout,
                         {"all_reduce(SUM) #4 of step 2", "deadline", "aborted"}));
  EXPECT_EQ(q.size(), 0u);
  // One look, then the deadline: the later work is abandoned (its communicators were aborted).
  const std::vector<std::string> expected{"finished all_reduce(SUM) #4 of step 2",
                                          "check all_reduce(SUM) #4 of step 2",
                                          "expire all_reduce(SUM) #4 of step 2"};
  EXPECT_EQ(log->entries, expected);
}

TEST(ReplicaQueue, AFailureSeenWhenTheWorkHasFinishedIsStillThrown) {
  // An asynchronous NCCL error (or an abort) also ends the work on the GPU, with a result that
  // must not be used: finishing is not success.
  auto log = std::make_shared<journal>();
  replica_queue q{nullptr, 0};
  auto w = work("all_gather #0 of step 0", later(), 1, log);
  w->failing_at(1, errc::peer_lost);
  q.add(std::move(w));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::peer_lost,
                         {"all_gather #0 of step 0", "asynchronous error"}));
  EXPECT_EQ(q.size(), 0u);
}

TEST(ReplicaQueue, AFailingStreamIsReportedAsADeviceError) {
  auto log = std::make_shared<journal>();
  replica_queue q{nullptr, 0};
  auto w = work("broadcast #1 of step 7", later(), 1, log);
  w->stream_failing();
  q.add(std::move(w));
  EXPECT_TRUE(fails_with([&] { q.settle(); }, errc::device_error, {"broadcast #1 of step 7"}));
  EXPECT_EQ(q.size(), 0u);
}

TEST(ReplicaQueue, EveryReplicaOfAFailedCommunicatorFailsWithTheFirstFailure) {
  // Two replicas' queues hold their parts of the same calls; the first replica's call expires
  // (aborting the communicators), and the second replica's part, finished by the abort, reports
  // that same failure rather than a result.
  auto log = std::make_shared<journal>();
  replica_queue first{nullptr, 0};
  replica_queue second{nullptr, 1};
  first.add(work("all_reduce(MEAN) #0 of step 9", queued_work::clock::now() - 1ms, 1000, log));
  second.add(work("all_reduce(MEAN) #0 of step 9", later(), 1, log));
  EXPECT_TRUE(fails_with([&] { first.settle(); }, errc::collective_timeout,
                         {"all_reduce(MEAN) #0 of step 9"}));
  EXPECT_TRUE(fails_with([&] { second.settle(); }, errc::collective_timeout,
                         {"all_reduce(MEAN) #0 of step 9", "deadline"}));
}

TEST(ReplicaQueue, WorkAddedFromAnotherThreadIsSettledByTheReplica) {
  auto log = std::make_shared<journal>();
  auto q = std::make_shared<replica_queue>(nullptr, 0);
  std::thread issuer{[q, log] {
    for (int i = 0; i < 100; ++i)
      q->add(work("call " + std::to_string(i), later(), 1, log));
  }};
  issuer.join();
  q->settle();
  EXPECT_EQ(q->size(), 0u);
  EXPECT_EQ(log->entries.size(), 200u);
  EXPECT_EQ(log->entries.back(), "check call 99");
}
