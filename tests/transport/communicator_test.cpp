// The communicator of a group of workers (transport/communicator.hpp) on its own, with no actor:
// W communicators over an in-memory group, one thread per worker. The same calls through the
// whole engine are tests/actors/cross_worker_test.cpp; these pin the transport layer's contract:
// the descriptor exchange and its checks, the fused and the algorithm data phases, and the life of
// a group (abort, stop).

#include "transport/communicator.hpp"

#include "support/time_scale.hpp"

#include <consort/caf_error.hpp>
#include <consort/transport/local.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

namespace consort {
namespace {

using namespace std::chrono_literals;
using transport::communicator;
using transport::group_call;
using lane = communicator::lane;
using result = caf::expected<std::vector<tensor>>;

/// W communicators over one in-memory group, each worker with `devices` replicas.
std::vector<std::shared_ptr<communicator>> make_comms(int workers, int devices = 1) {
  std::vector<std::shared_ptr<communicator>> comms;
  for (auto& ctx : transport::local::make_group(workers))
    comms.push_back(std::make_shared<communicator>(ctx, devices));
  return comms;
}

/// Runs `make(w)` on every worker's communicator at once (a thread each); the results by rank.
std::vector<result> run_all(const std::vector<std::shared_ptr<communicator>>& comms,
                            const std::function<group_call(int)>& make, lane l = lane::step) {
  std::vector<std::future<result>> running;
  for (size_t w = 0; w < comms.size(); ++w)
    running.push_back(std::async(std::launch::async, [&, w] {
      auto call = make(static_cast<int>(w));
      return comms[w]->run(l, call);
    }));
  std::vector<result> out;
  for (auto& f : running)
    out.push_back(f.get());
  return out;
}

group_call all_reduce_of(tensor t, reduce_op op = reduce_op::sum) {
  group_call call;
  call.kind = collective_kind::all_reduce;
  call.op = op;
  call.what = "all_reduce #0 of step 0";
  call.signature = std::string{"all_reduce of "} + to_string(t.dtype()) + to_string(t.shape());
  call.count = 1;
  call.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(test::scaled(10s));
  call.leaves = {std::move(t)};
  return call;
}

errc code_of(const result& r) {
  return r ? errc::none : to_consort_error(r.error(), "").code();
}

std::string text_of(const result& r) {
  return r ? std::string{} : std::string{to_consort_error(r.error(), "").what()};
}

TEST(GroupCommunicatorTest, ASmallAllReduceIsFusedWithItsDescriptorsAndALargeOneRunsTheRing) {
  auto comms = make_comms(3);
  for (int64_t n : {int64_t{4}, int64_t{100000}}) { // 16 B (fused), 400 KB (an algorithm)
    auto out = run_all(comms, [n](int w) {
      return all_reduce_of(tensor::from(std::vector<float>(static_cast<size_t>(n), float(w + 1))));
    });
    for (auto& r : out) {
      ASSERT_TRUE(r) << text_of(r);
      auto v = r->front().to_vector<float>();
      ASSERT_EQ(v.size(), static_cast<size_t>(n));
      EXPECT_EQ(v.front(), 6.0f);
      EXPECT_EQ(v.back(), 6.0f);
    }
  }
}

TEST(GroupCommunicatorTest, MeanDividesByTheCountOverEveryWorker) {
  auto comms = make_comms(2);
  auto out = run_all(comms, [](int w) {
    auto call = all_reduce_of(tensor::from<float>({float(w) * 4}), reduce_op::mean);
    call.count = w == 0 ? 1 : 3; // worker 1 summed three values
    return call;
  });
  for (auto& r : out) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_FLOAT_EQ(r->front().to_vector<float>().front(), 1.0f); // (0 + 4) / 4
  }
}

TEST(GroupCommunicatorTest, ARaggedAllGatherConcatenatesInRankOrder) {
  auto comms = make_comms(3);
  auto out = run_all(comms, [](int w) {
    group_call call;
    call.kind = collective_kind::all_gather;
    call.what = "all_gather #0 of step 0";
    call.signature = "all_gather of float32[-1]";
    call.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(test::scaled(10s));
    call.leaves = {tensor::from(std::vector<float>(static_cast<size_t>(w + 1), float(w)))};
    return call;
  });
  for (auto& r : out) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->front().to_vector<float>(), (std::vector<float>{0, 1, 1, 2, 2, 2}));
  }
}

TEST(GroupCommunicatorTest, ABroadcastComesFromTheRootReplicasWorker) {
  auto comms = make_comms(3, 2); // root replica 3 lives on worker 1
  auto out = run_all(comms, [](int w) {
    group_call call;
    call.kind = collective_kind::broadcast;
    call.root = 3;
    call.what = "broadcast #0 of step 0";
    call.signature = "broadcast of float32[2]";
    call.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(test::scaled(10s));
    call.leaves = {w == 1 ? tensor::from<float>({7, 8}) : tensor::empty(dtype::float32, {2})};
    return call;
  });
  for (auto& r : out) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->front().to_vector<float>(), (std::vector<float>{7, 8}));
  }
}

TEST(GroupCommunicatorTest, BeyondEightWorkersTheDescriptorsTravelByARingAndNothingIsFused) {
  auto comms = make_comms(10);
  auto sums = run_all(comms, [](int w) { return all_reduce_of(tensor::from<float>({float(w)})); });
  for (auto& r : sums) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->front().to_vector<float>(), (std::vector<float>{45}));
  }
  auto gathered = run_all(comms, [](int w) {
    group_call call;
    call.kind = collective_kind::all_gather;
    call.what = "all_gather #1 of step 0";
    call.signature = "all_gather of int32[-1]";
    call.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(test::scaled(10s));
    call.leaves = {tensor::from(std::vector<int32_t>(static_cast<size_t>(w % 3), w))};
    return call;
  });
  std::vector<int32_t> want;
  for (int w = 0; w < 10; ++w)
    want.insert(want.end(), static_cast<size_t>(w % 3), w);
  for (auto& r : gathered) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->front().to_vector<int32_t>(), want);
  }
  auto mismatched = run_all(comms, [](int w) {
    auto call = all_reduce_of(tensor::from<float>({1}));
    call.seq = w == 9 ? 1 : 0;
    return call;
  });
  for (auto& r : mismatched)
    EXPECT_EQ(code_of(r), errc::collective_mismatch) << text_of(r);
  EXPECT_NE(text_of(mismatched[0]).find("worker 9 is at all_reduce(SUM) #1 of step 0"),
            std::string::npos)
      << text_of(mismatched[0]);
}

TEST(GroupCommunicatorTest, CallsThatDisagreeFailOnEveryWorkerNamingBothSides) {
  auto comms = make_comms(2);
  auto out = run_all(comms, [](int w) {
    auto call = all_reduce_of(tensor::from<float>({1, 2}));
    if (w == 1)
      call.signature = "all_reduce of float32[3]";
    return call;
  });
  for (auto& r : out) {
    EXPECT_EQ(code_of(r), errc::collective_mismatch) << text_of(r);
    EXPECT_NE(text_of(r).find("worker 0 (the chief) passed all_reduce of float32[2] but worker 1 "
                              "passed all_reduce of float32[3]"),
              std::string::npos)
        << text_of(r);
  }
  // The group goes on: the next call agrees and succeeds.
  auto next = run_all(comms, [](int) { return all_reduce_of(tensor::from<float>({1})); });
  for (auto& r : next)
    EXPECT_TRUE(r) << text_of(r);
}

TEST(GroupCommunicatorTest, ALocalFailureReachesTheOtherWorkersInTheDescriptors) {
  auto comms = make_comms(3);
  auto out = run_all(comms, [](int w) {
    auto call = all_reduce_of(tensor::from<float>({1}));
    if (w == 2) {
      call.leaves.clear();
      call.local_failure = make_caf_error(errc::step_failed, "replica 2 threw: bad batch");
    }
    return call;
  });
  EXPECT_EQ(code_of(out[2]), errc::step_failed) << text_of(out[2]);
  for (int w : {0, 1}) {
    EXPECT_EQ(code_of(out[static_cast<size_t>(w)]), errc::collective_aborted);
    EXPECT_NE(
        text_of(out[static_cast<size_t>(w)]).find("failed on worker 2: replica 2 threw: bad batch"),
        std::string::npos)
        << text_of(out[static_cast<size_t>(w)]);
  }
}

TEST(GroupCommunicatorTest, AbortFailsAPendingCallAtOnceAndEveryLaterOneWithTheCause) {
  auto comms = make_comms(2);
  // Worker 0 calls alone: its peer never comes, so only the abort can end the call before its
  // deadline (10 s, scaled).
  auto pending = std::async(std::launch::async, [&] {
    auto call = all_reduce_of(tensor::from<float>({1}));
    return comms[0]->run(lane::step, call);
  });
  comms[0]->abort("lost worker:1 (rank 1): connection closed without leave");
  auto r = pending.get();
  EXPECT_EQ(code_of(r), errc::peer_lost) << text_of(r);
  EXPECT_NE(text_of(r).find("connection closed without leave"), std::string::npos) << text_of(r);
  EXPECT_EQ(comms[0]->lost_cause(), "lost worker:1 (rank 1): connection closed without leave");
  auto later = all_reduce_of(tensor::from<float>({1}));
  auto again = comms[0]->run(lane::host, later);
  EXPECT_EQ(code_of(again), errc::peer_lost);
  EXPECT_NE(text_of(again).find("the group of workers is broken: lost worker:1"), std::string::npos)
      << text_of(again);
  // A second abort keeps the first cause.
  comms[0]->abort("another cause");
  EXPECT_EQ(comms[0]->lost_cause(), "lost worker:1 (rank 1): connection closed without leave");
}

TEST(GroupCommunicatorTest, StopLeavesCleanlyOnceAndLaterPostsFailAtOnceOnTheCaller) {
  auto comms = make_comms(2);
  auto stopped = std::async(std::launch::async, [&] { return comms[1]->stop(); });
  EXPECT_FALSE(comms[0]->stop()) << "both sides closed their end cleanly";
  EXPECT_FALSE(stopped.get());
  EXPECT_FALSE(comms[0]->stop()) << "a second stop returns at once";
  bool ran = false;
  comms[0]->post(lane::step, [&] {
    auto call = all_reduce_of(tensor::from<float>({1}));
    ran = !comms[0]->run(lane::step, call); // fails: the group was stopped
  });
  EXPECT_TRUE(ran) << "a post after stop runs on the caller and fails at once";
}

} // namespace
} // namespace consort
