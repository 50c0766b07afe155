// The communicator of a group of workers (transport/communicator.hpp) on its own, with no actor:
// W communicators over an in-memory group, one thread per worker. The same calls through the
// whole engine are tests/actors/cross_worker_test.cpp; these pin the transport layer's contract:
// the descriptor exchange and its checks, the fused and the algorithm data phases, and the life of
// a group (abort, stop, shrink into the next epoch).

#include "transport/communicator.hpp"

#include "support/time_scale.hpp"

#include <consort/caf_error.hpp>
#include <consort/transport/local.hpp>
#include <consort/transport/shm.hpp>
#include <consort/transport/tcp.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace consort {
namespace {

using namespace std::chrono_literals;
using transport::communicator;
using transport::group_call;
using lane = communicator::lane;
using result = caf::expected<std::vector<tensor>>;

/// W communicators over one group of `transport` ("local": in memory; "shm": shared memory, whose
/// descriptors travel in its lockstep channels, with rings small enough that a fused call's
/// message wraps), each worker with `devices` replicas.
/// The communicators of one group, which stop together at the end of the test (each one's clean
/// end waits for the others' goodbyes: stopped one after the other, each would wait them out).
struct comm_group : std::vector<std::shared_ptr<communicator>> {
  comm_group() = default;
  comm_group(const comm_group&) = delete;
  comm_group& operator=(const comm_group&) = delete;
  comm_group(comm_group&&) = default;
  ~comm_group() {
    std::vector<std::future<caf::error>> stops;
    for (auto& c : *this)
      stops.push_back(std::async(std::launch::async, [c] { return c->stop(); }));
    for (auto& f : stops)
      (void)f.get();
  }
};

comm_group make_comms(int workers, int devices = 1, const std::string& transport = "local") {
  std::vector<transport::context_ptr> group;
  if (transport == "shm") {
    transport::shm::options opts;
    opts.ring_bytes = 16 << 10;
    group = transport::shm::make_group(workers, opts);
  } else {
    group = transport::local::make_group(workers);
  }
  comm_group comms;
  for (auto& ctx : group)
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

group_call all_gather_of(tensor t) {
  group_call call;
  call.kind = collective_kind::all_gather;
  call.what = "all_gather #0 of step 0";
  call.signature = std::string{"all_gather of "} + to_string(t.dtype()) + "[-1]";
  call.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(test::scaled(10s));
  call.leaves = {std::move(t)};
  return call;
}

/// A broadcast from replica `root` of a tensor like `t` (the root's worker's value; the others'
/// are overwritten).
group_call broadcast_of(int root, tensor t) {
  group_call call;
  call.kind = collective_kind::broadcast;
  call.root = root;
  call.what = "broadcast #0 of step 0";
  call.signature = std::string{"broadcast of "} + to_string(t.dtype()) + to_string(t.shape());
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

/// The communicator's contract on each transport: in memory, and over shared memory, where the
/// descriptor exchange goes through the lockstep channels.
class GroupCommunicatorOnEachTransport : public ::testing::TestWithParam<std::string> {
protected:
  void SetUp() override {
    if (GetParam() == "shm")
      if (auto why = transport::shm::unavailable_reason(); !why.empty())
        GTEST_SKIP() << "no shared memory here: " << why;
  }
};

INSTANTIATE_TEST_SUITE_P(Transports, GroupCommunicatorOnEachTransport,
                         ::testing::Values("local", "shm"),
                         [](const auto& info) { return info.param; });

TEST_P(GroupCommunicatorOnEachTransport,
       ASmallAllReduceIsFusedWithItsDescriptorsAndALargeOneRunsTheRing) {
  auto comms = make_comms(3, 1, GetParam());
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

TEST_P(GroupCommunicatorOnEachTransport, MeanDividesByTheCountOverEveryWorker) {
  auto comms = make_comms(2, 1, GetParam());
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

TEST_P(GroupCommunicatorOnEachTransport, ARaggedAllGatherConcatenatesInRankOrder) {
  auto comms = make_comms(3, 1, GetParam());
  auto out = run_all(comms, [](int w) {
    return all_gather_of(tensor::from(std::vector<float>(static_cast<size_t>(w + 1), float(w))));
  });
  for (auto& r : out) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->front().to_vector<float>(), (std::vector<float>{0, 1, 1, 2, 2, 2}));
  }
}

TEST_P(GroupCommunicatorOnEachTransport, ABroadcastComesFromTheRootReplicasWorker) {
  auto comms = make_comms(3, 2, GetParam()); // root replica 3 lives on worker 1
  auto out = run_all(comms, [](int w) {
    return broadcast_of(3,
                        w == 1 ? tensor::from<float>({7, 8}) : tensor::empty(dtype::float32, {2}));
  });
  for (auto& r : out) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->front().to_vector<float>(), (std::vector<float>{7, 8}));
  }
}

TEST_P(GroupCommunicatorOnEachTransport,
       BeyondEightWorkersTheDescriptorsTravelByARingAndNothingIsFused) {
  auto comms = make_comms(10, 1, GetParam());
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

TEST_P(GroupCommunicatorOnEachTransport, CallsThatDisagreeFailOnEveryWorkerNamingBothSides) {
  auto comms = make_comms(2, 1, GetParam());
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

TEST_P(GroupCommunicatorOnEachTransport, ALocalFailureReachesTheOtherWorkersInTheDescriptors) {
  auto comms = make_comms(3, 1, GetParam());
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

TEST_P(GroupCommunicatorOnEachTransport, ACallsDeadlineCountsFromWhenItsCallerEnteredIt) {
  // A caller that read the clock already (the flight recorder's start) passes its reading: the
  // call's time runs from there. Entered a minute less 100 ms ago with a minute to go, the call
  // to a peer that never comes times out about 100 ms in, not a minute.
  auto comms = make_comms(2, 1, GetParam());
  auto call = all_reduce_of(tensor::from<float>({1}));
  call.timeout = std::chrono::minutes(1);
  const auto begin = std::chrono::steady_clock::now();
  call.entered = begin - call.timeout + 100ms;
  auto out = comms[0]->run(lane::step, call);
  const auto took = std::chrono::steady_clock::now() - begin;
  EXPECT_EQ(code_of(out), errc::collective_timeout) << text_of(out);
  EXPECT_LT(took, 30s) << "the deadline counted from the call's start, not from `entered`";
}

TEST_P(GroupCommunicatorOnEachTransport, AbortFailsAPendingCallAtOnceAndEveryLaterOneWithTheCause) {
  auto comms = make_comms(2, 1, GetParam());
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

TEST_P(GroupCommunicatorOnEachTransport, StopLeavesCleanlyOnceAndLaterPostsFailAtOnceOnTheCaller) {
  auto comms = make_comms(2, 1, GetParam());
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

// Over shared memory a message up to a lockstep slot (8168 bytes: a 64-byte descriptor and 2026
// floats; a call of up to 4 KiB sends the 32-byte compact one) goes in the slot, a larger one by
// the ring with an empty message in the slot. Calls of both kinds in a row, and calls whose
// workers' messages go different ways (a ragged all-gather, a broadcast, a mismatch), all come out
// whole and alike on every worker.
TEST_P(GroupCommunicatorOnEachTransport, MessagesOnBothSidesOfTheMailboxSlotArriveWhole) {
  auto comms = make_comms(3, 1, GetParam());
  for (int round = 0; round < 3; ++round) {
    for (size_t n : {size_t{1}, size_t{2026}, size_t{2027}, size_t{16000}, size_t{1024}}) {
      SCOPED_TRACE("round " + std::to_string(round) + ", " + std::to_string(n) + " floats");
      auto out = run_all(comms, [n](int w) {
        std::vector<float> v(n);
        for (size_t i = 0; i < n; ++i)
          v[i] = float(w + 1) * float(i % 7);
        return all_reduce_of(tensor::from(v));
      });
      for (auto& r : out) {
        ASSERT_TRUE(r) << text_of(r);
        auto v = r->front().to_vector<float>();
        ASSERT_EQ(v.size(), n);
        for (size_t i = 0; i < n; ++i)
          ASSERT_EQ(v[i], 6.0f * float(i % 7)) << "element " << i;
      }
    }
    // Worker 1's part (16000 bytes) is too large for a slot; the others' are not.
    auto gathered = run_all(comms, [](int w) {
      return all_gather_of(tensor::from(std::vector<float>(w == 1 ? 4000 : 3, float(w))));
    });
    std::vector<float> want(3, 0.0f);
    want.insert(want.end(), 4000, 1.0f);
    want.insert(want.end(), 3, 2.0f);
    for (auto& r : gathered) {
      ASSERT_TRUE(r) << text_of(r);
      EXPECT_EQ(r->front().to_vector<float>(), want);
    }
    // Only the root's worker (2) sends data, 12000 bytes.
    auto broadcast = run_all(comms, [](int w) {
      return broadcast_of(2, w == 2 ? tensor::from(std::vector<float>(3000, 9.0f))
                                    : tensor::empty(dtype::float32, {3000}));
    });
    for (auto& r : broadcast) {
      ASSERT_TRUE(r) << text_of(r);
      EXPECT_EQ(r->front().to_vector<float>(), std::vector<float>(3000, 9.0f));
    }
    // Worker 0's message fits a slot, worker 1's does not: still a clean mismatch on every one.
    auto mismatched = run_all(comms, [](int w) {
      return all_reduce_of(tensor::from(std::vector<float>(w == 1 ? 4000 : 10, 1.0f)));
    });
    for (auto& r : mismatched) {
      EXPECT_EQ(code_of(r), errc::collective_mismatch) << text_of(r);
      EXPECT_NE(text_of(r).find("passed all_reduce of float32[10] but worker 1 passed all_reduce "
                                "of float32[4000]"),
                std::string::npos)
          << text_of(r);
    }
  }
}

// The two lanes run calls at the same time (on shared memory, each in its own lockstep channel):
// neither takes the other's messages.
TEST_P(GroupCommunicatorOnEachTransport, BothLanesRunCallsAtOnceWithoutCrossingTheirMessages) {
  auto comms = make_comms(2, 1, GetParam());
  auto lane_of = [&](lane l, float base) {
    return std::async(std::launch::async, [&comms, l, base] {
      for (int i = 0; i < 200; ++i) {
        auto out = run_all(
            comms,
            [&](int w) {
              return all_reduce_of(tensor::from<float>({base + float(i), float(w)}));
            },
            l);
        for (auto& r : out) {
          if (!r)
            return text_of(r);
          if (r->front().to_vector<float>() != std::vector<float>{2 * (base + float(i)), 1.0f})
            return std::string{"call "} + std::to_string(i) + " of the lane got another's sum";
        }
      }
      return std::string{};
    });
  };
  auto step = lane_of(lane::step, 0.0f);
  auto host = lane_of(lane::host, 1000.0f);
  EXPECT_EQ(step.get(), "");
  EXPECT_EQ(host.get(), "");
}

// -- the lean path of a lone replica's small all-reduce (communicator::run_lone) ----------------

/// How one worker makes its call in a lone-path test: by the lean path, or the general one.
struct lone_or_general {
  bool lone = true;
  tensor input;
  reduce_op op = reduce_op::sum;
  /// The general call as that worker's general path makes it (the lean path's `complete`).
  std::function<void(group_call&)> adjust = [](group_call&) {
  };
  std::chrono::milliseconds timeout =
      std::chrono::duration_cast<std::chrono::milliseconds>(test::scaled(10s));
  int64_t entered_unix_ns = 0;
};

struct lone_result {
  bool took_lean_path = false;
  caf::expected<tensor> value{tensor{}};
  transport::call_lateness late;
  uint64_t arrived = 0;
};

/// The general call of `c` (what all_reduce_of makes, then `c.adjust`).
group_call general_of(const lone_or_general& c) {
  auto call = all_reduce_of(c.input, c.op);
  call.leaves_are_inputs = true;
  call.timeout = c.timeout;
  call.entered_unix_ns = c.entered_unix_ns;
  c.adjust(call);
  return call;
}

/// Runs `make(w)` on every worker at once, each by the path it names; a lean call that the
/// communicator does not take (nothing sent) runs the general call instead.
std::vector<std::unique_ptr<lone_result>>
run_lone_all(const std::vector<std::shared_ptr<communicator>>& comms,
             const std::function<lone_or_general(int)>& make) {
  std::vector<std::unique_ptr<lone_result>> out;
  for (size_t w = 0; w < comms.size(); ++w)
    out.push_back(std::make_unique<lone_result>());
  std::vector<std::future<void>> running;
  for (size_t w = 0; w < comms.size(); ++w)
    running.push_back(std::async(std::launch::async, [&, w] {
      auto c = make(static_cast<int>(w));
      auto& r = *out[w];
      auto general = general_of(c);
      general.lateness = &r.late;
      std::atomic<uint64_t> arrived{0};
      general.arrivals = &arrived;
      if (c.lone) {
        transport::lone_call lone;
        lone.op = c.op;
        lone.signature_hash = general.hash();
        lone.input = &c.input;
        lone.timeout = c.timeout;
        lone.entered_unix_ns = c.entered_unix_ns;
        lone.lateness = &r.late;
        lone.arrivals = &arrived;
        lone.complete = [&](group_call& whole) {
          whole = general_of(c);
          whole.lateness = &r.late;
        };
        if (auto got = comms[w]->run_lone(lane::step, lone)) {
          r.took_lean_path = true;
          r.value = std::move(*got);
          r.arrived = arrived.load();
          return;
        }
      }
      auto got = comms[w]->run(lane::step, general);
      r.arrived = arrived.load();
      if (got)
        r.value = std::move(got->front());
      else
        r.value = std::move(got.error());
    }));
  for (auto& f : running)
    f.get();
  return out;
}

std::string text_of(const caf::expected<tensor>& r) {
  return r ? std::string{} : std::string{to_consort_error(r.error(), "").what()};
}

errc code_of(const caf::expected<tensor>& r) {
  return r ? errc::none : to_consort_error(r.error(), "").code();
}

/// The bytes of a result (bit-for-bit comparisons).
std::vector<unsigned char> bytes_of(const caf::expected<tensor>& r) {
  if (!r)
    return {};
  const auto* p = static_cast<const unsigned char*>(r->raw_data());
  return {p, p + r->num_bytes()};
}

class LoneAllReduce : public ::testing::Test {
protected:
  void SetUp() override {
    if (auto why = transport::shm::unavailable_reason(); !why.empty())
      GTEST_SKIP() << "no shared memory here: " << why;
  }
};

TEST(CallDescriptor, AnAllReduceOfOneLeafTravelsInACompactFormThatFillsOneLineWithEightBytes) {
  transport::call_descriptor d;
  d.kind = static_cast<uint8_t>(collective_kind::all_reduce);
  d.op = static_cast<uint8_t>(reduce_op::max);
  d.step = 0x0102030405060708ull;
  d.seq = 77;
  d.num_leaves = 1;
  d.count = 1;
  d.signature_hash = 0xfeedfacecafebeefull;
  d.entered_ns = -5;
  d.flags = 3;
  d.fused = 1;
  ASSERT_TRUE(d.compactable());
  std::byte wire[transport::call_descriptor::compact_bytes];
  d.write_compact(wire);
  transport::call_descriptor back;
  back.read_compact(wire);
  EXPECT_EQ(std::memcmp(&back, &d, transport::call_descriptor::header_bytes), 0)
      << "the header read back is the one written";
  // The slot's own words (24 bytes), the compact descriptor and 8 bytes of data: one line.
  EXPECT_EQ(24 + transport::call_descriptor::compact_bytes + 8, 64u);
  // What has no compact form: another kind, several leaves or values, a root or an axis, an error.
  for (auto change : std::vector<std::function<void(transport::call_descriptor&)>>{
           [](auto& x) { x.kind = static_cast<uint8_t>(collective_kind::broadcast); },
           [](auto& x) { x.num_leaves = 2; }, [](auto& x) { x.count = 2; },
           [](auto& x) { x.root = 1; }, [](auto& x) { x.axis = 1; },
           [](auto& x) {
             x.failed = 1;
           }}) {
    auto other = d;
    change(other);
    EXPECT_FALSE(other.compactable());
  }
}

TEST_F(LoneAllReduce, TakesTheLeanPathAndAgreesBitForBitWithTheGeneralPathMixedAsTheWorkersLike) {
  auto comms = make_comms(3, 1, "shm");
  // Values whose float sum depends on the order of the fold: both paths fold in rank order.
  auto value = [](int w, dtype type) {
    const std::vector<double> v = {0.1 * (w + 1), 1e8 * (w % 2 ? 1 : -1), 3.0 + w, 1.0 / (w + 3)};
    switch (type) {
    case dtype::float32:
      return tensor::from<float>({float(v[0]), float(v[1]), float(v[2]), float(v[3])});
    case dtype::int32:
      return tensor::from<int32_t>({w + 1, -7 * w, 3, 1 << (4 * w)});
    default:
      return tensor::from<double>(v);
    }
  };
  for (auto type : {dtype::float32, dtype::float64, dtype::int32})
    for (auto op :
         {reduce_op::sum, reduce_op::mean, reduce_op::max, reduce_op::min, reduce_op::prod}) {
      if (op == reduce_op::mean && !is_floating(type))
        continue; // not in place: not the lean path's (below)
      SCOPED_TRACE(std::string{to_string(type)} + " " + to_string(op));
      std::vector<std::vector<unsigned char>> expected;
      for (int mix = 0; mix < 3; ++mix) { // all general, all lone, worker 1 general
        auto out = run_lone_all(comms, [&](int w) {
          lone_or_general c;
          c.lone = mix == 1 || (mix == 2 && w != 1);
          c.input = value(w, type);
          c.op = op;
          c.entered_unix_ns = 1000 + (w == 2 ? 5000 : w); // worker 2 enters last, 4999 ns late
          return c;
        });
        for (int w = 0; w < 3; ++w) {
          const auto& r = *out[static_cast<size_t>(w)];
          ASSERT_TRUE(r.value) << text_of(r.value);
          EXPECT_EQ(r.took_lean_path, mix == 1 || (mix == 2 && w != 1)) << "worker " << w;
          if (expected.size() < 3)
            expected.push_back(bytes_of(r.value));
          EXPECT_EQ(bytes_of(r.value), expected[static_cast<size_t>(w)]) << "worker " << w;
          EXPECT_EQ(bytes_of(r.value), expected[0]) << "the same bits on every worker";
          EXPECT_EQ(r.late.last.load(), 2) << "worker " << w;
          EXPECT_EQ(r.late.margin_ns.load(), 4999) << "worker " << w;
          EXPECT_EQ(r.arrived, 7u & ~(1u << w)) << "worker " << w << ": every peer's arrival";
        }
      }
    }
}

TEST_F(LoneAllReduce, SendsNothingWhenTheCallIsNotItsAndTheGeneralCallThenRunsAsBefore) {
  // No lockstep channel (in memory), a tensor larger than the path takes, bool, an integer
  // MEAN: run_lone gives nothing back, and the general calls that follow meet as usual (nothing
  // of the call was sent).
  auto local = make_comms(2, 1, "local");
  tensor one = tensor::from<float>({1});
  transport::lone_call lone;
  lone.input = &one;
  EXPECT_FALSE(local[0]->run_lone(lane::step, lone).has_value());
  auto comms = make_comms(2, 1, "shm");
  tensor large = tensor::zeros(dtype::float32, {2048}); // 8 KiB
  tensor flags = tensor::from<bool>({true, false});
  tensor ints = tensor::from<int32_t>({1, 2});
  for (auto* t : {&large, &flags, &ints}) {
    lone.input = t;
    lone.op = t == &ints ? reduce_op::mean : reduce_op::sum;
    EXPECT_FALSE(comms[0]->run_lone(lane::step, lone).has_value()) << to_string(t->dtype());
  }
  auto out = run_all(comms, [](int w) { return all_reduce_of(tensor::from<float>({float(w)})); });
  for (auto& r : out) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->front().to_vector<float>(), std::vector<float>{1});
  }
}

TEST_F(LoneAllReduce, APeerWithAnotherShapeOrAFailureGetsTheGeneralPathsErrorsOnEveryWorker) {
  auto comms = make_comms(3, 1, "shm");
  // Worker 1 (general) passes another shape: every worker's error names both sides.
  auto out = run_lone_all(comms, [](int w) {
    lone_or_general c;
    c.lone = w != 1;
    c.input = tensor::from<float>({1, 2});
    if (w == 1)
      c.adjust = [](group_call& call) {
        call.signature = "all_reduce of float32[3]";
      };
    return c;
  });
  for (int w = 0; w < 3; ++w) {
    const auto& r = out[static_cast<size_t>(w)]->value;
    EXPECT_EQ(code_of(r), errc::collective_mismatch) << text_of(r);
    EXPECT_NE(text_of(r).find("passed all_reduce of float32[2] but worker 1 passed all_reduce of "
                              "float32[3]"),
              std::string::npos)
        << "worker " << w << ": " << text_of(r);
  }
  // Worker 2's call failed on its own: the lone workers fail with its reason.
  out = run_lone_all(comms, [](int w) {
    lone_or_general c;
    c.lone = w != 2;
    c.input = tensor::from<float>({1});
    if (w == 2)
      c.adjust = [](group_call& call) {
        call.leaves.clear();
        call.local_failure = make_caf_error(errc::step_failed, "replica 2 threw: bad batch");
      };
    return c;
  });
  for (int w : {0, 1}) {
    const auto& r = out[static_cast<size_t>(w)]->value;
    EXPECT_EQ(code_of(r), errc::collective_aborted) << text_of(r);
    EXPECT_NE(text_of(r).find("failed on worker 2: replica 2 threw: bad batch"), std::string::npos)
        << text_of(r);
  }
  // Worker 0 (general) passes a tensor whose message does not fit a slot: it goes by the pair,
  // and the lone workers, reading its empty slot, answer as the general exchange does.
  out = run_lone_all(comms, [](int w) {
    lone_or_general c;
    c.lone = w != 0;
    c.input = w == 0 ? tensor::zeros(dtype::float32, {4096}) : tensor::from<float>({1});
    return c;
  });
  for (int w = 0; w < 3; ++w)
    EXPECT_EQ(code_of(out[static_cast<size_t>(w)]->value), errc::collective_mismatch)
        << "worker " << w << ": " << text_of(out[static_cast<size_t>(w)]->value);
  // MEAN where worker 2 summed two values (count 2): the lone workers see a call that is not
  // plainly theirs and the general exchange divides by the true count, 4.
  out = run_lone_all(comms, [](int w) {
    lone_or_general c;
    c.input = tensor::from<float>({float(w + 1)});
    c.op = reduce_op::mean;
    c.lone = w != 2;
    if (w == 2)
      c.adjust = [](group_call& call) {
        call.count = 2;
      };
    return c;
  });
  for (int w = 0; w < 3; ++w) {
    const auto& r = out[static_cast<size_t>(w)]->value;
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->to_vector<float>(), std::vector<float>{1.5f}) << "worker " << w;
  }
  // The group goes on, lockstep channels in step: a plain lone call on every worker.
  out = run_lone_all(comms, [](int w) {
    lone_or_general c;
    c.input = tensor::from<float>({float(w)});
    return c;
  });
  for (auto& r : out) {
    ASSERT_TRUE(r->value) << text_of(r->value);
    EXPECT_TRUE(r->took_lean_path);
    EXPECT_EQ(r->value->to_vector<float>(), std::vector<float>{3});
  }
}

TEST_F(LoneAllReduce, APeerThatNeverComesTimesOutAtTheDeadlineNamingIt) {
  auto comms = make_comms(2, 1, "shm");
  tensor one = tensor::from<float>({1});
  lone_or_general c;
  c.input = one;
  c.timeout = 200ms;
  const auto begin = std::chrono::steady_clock::now();
  transport::lone_call lone;
  lone.input = &one;
  lone.signature_hash = general_of(c).hash();
  lone.timeout = c.timeout;
  lone.complete = [&](group_call& whole) {
    whole = general_of(c);
  };
  auto got = comms[0]->run_lone(lane::step, lone);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(code_of(*got), errc::collective_timeout) << text_of(*got);
  EXPECT_NE(text_of(*got).find("all_reduce #0 of step 0"), std::string::npos) << text_of(*got);
  EXPECT_NE(text_of(*got).find("receive from rank 1"), std::string::npos) << text_of(*got);
  EXPECT_LT(std::chrono::steady_clock::now() - begin, test::scaled(10s));
}

/// W communicators of epoch 1 over one in-memory group, named "worker:0" ...
std::vector<std::shared_ptr<communicator>> make_named_comms(int workers) {
  std::vector<std::shared_ptr<communicator>> comms;
  for (auto& ctx : transport::local::make_group(workers)) {
    transport::group_members members{1, {}};
    for (int w = 0; w < workers; ++w)
      members.names.push_back("worker:" + std::to_string(w));
    comms.push_back(std::make_shared<communicator>(ctx, 1, std::move(members)));
  }
  return comms;
}

/// A `connect_group` over one in-memory group of `size` made for the members that remain.
transport::connect_group local_connect(std::vector<transport::context_ptr> next) {
  return [next = std::move(next)](int rank, int size, uint64_t,
                                  transport::deadline) -> caf::expected<transport::context_ptr> {
    if (size != static_cast<int>(next.size()))
      return make_caf_error(errc::invalid_argument, "unexpected size " + std::to_string(size));
    return next[static_cast<size_t>(rank)];
  };
}

/// A `connect_group` that forms a real TCP mesh on 127.0.0.1 for the epoch it is given; the
/// members publish their listen addresses on a board shared by the test's threads (what the
/// membership view carries between processes).
class tcp_rendezvous {
public:
  transport::connect_group connect(std::chrono::milliseconds timeout) {
    return [this, timeout](int rank, int size, uint64_t epoch,
                           transport::deadline) -> caf::expected<transport::context_ptr> {
      transport::tcp::mesh_options opts;
      opts.rank = rank;
      opts.size = size;
      opts.listen_address = "127.0.0.1:0";
      opts.group_id = 7;
      opts.epoch = epoch;
      opts.connect_timeout = timeout;
      auto ctx = transport::tcp::listen(opts);
      if (!ctx)
        return ctx.error();
      std::unique_lock<std::mutex> lock{mtx_};
      addresses_[rank] = (*ctx)->listen_address();
      cv_.notify_all();
      // Waits for every member's address, as a view would bring them; a member that never comes
      // ends the wait at the mesh's own timeout.
      if (!cv_.wait_for(lock, timeout, [&] { return static_cast<int>(addresses_.size()) == size; }))
        return make_caf_error(errc::collective_timeout, "rank " + std::to_string(rank) +
                                                            " of epoch " + std::to_string(epoch) +
                                                            ": not every member published its "
                                                            "address within the timeout");
      std::vector<std::string> all;
      for (auto& [r, a] : addresses_)
        all.push_back(a);
      lock.unlock();
      if (auto err = (*ctx)->connect(all))
        return err;
      return transport::context_ptr{*ctx};
    };
  }

private:
  std::mutex mtx_;
  std::condition_variable cv_;
  std::map<int, std::string> addresses_;
};

// ncclCommShrink's contract: worker 2 of 4 hangs while the others wait in a call; the three
// that remain shrink the group, the call fails everywhere with membership_changed naming the lost
// worker, and the next epoch's group (ranks renumbered in order, names kept) completes its calls.
// Over shared memory a peer's abort reaches a waiting call at once, with the peer's code. When
// that code says the group changed, this worker's own notice of the change may still be on its
// way: its communicator must not run its next call in the old epoch, whose lockstep channels the
// failed call left out of step. It waits for its notice as for a lost peer, and without one in
// the grace it ends the epoch itself.
TEST(GroupCommunicatorTest, APeersAbortForAChangeOfTheGroupFailsTheCallAndEveryLaterOneHere) {
  if (auto why = transport::shm::unavailable_reason(); !why.empty())
    GTEST_SKIP() << "no shared memory here: " << why;
  auto comms = make_comms(3, 1, "shm");
  for (auto& c : comms)
    c->set_change_grace(200ms);
  std::vector<std::future<result>> calls;
  for (int w : {1, 2})
    calls.push_back(std::async(std::launch::async, [&comms, w] {
      auto call = all_reduce_of(tensor::from<float>({1}));
      return comms[static_cast<size_t>(w)]->run(lane::step, call);
    }));
  // Worker 0 never calls: it had the notice first, as the chief does.
  comms[0]->abort("the group of workers changed: worker:3 (rank 3): connection closed without "
                  "leave; it re-forms as epoch 2",
                  errc::membership_changed);
  for (auto& f : calls) {
    auto r = f.get();
    EXPECT_EQ(code_of(r), errc::membership_changed) << text_of(r);
    EXPECT_NE(text_of(r).find("it re-forms as epoch 2"), std::string::npos) << text_of(r);
  }
  // No notice came here: the next call fails with the change too, not in the old channels.
  for (int w : {1, 2}) {
    auto call = all_reduce_of(tensor::from<float>({1}));
    auto again = comms[static_cast<size_t>(w)]->run(lane::step, call);
    EXPECT_EQ(code_of(again), errc::membership_changed) << "worker " << w << ": " << text_of(again);
    EXPECT_NE(text_of(again).find("cannot run"), std::string::npos) << text_of(again);
    EXPECT_NE(text_of(again).find("it re-forms as epoch 2"), std::string::npos) << text_of(again);
  }
}

TEST(GroupCommunicatorTest, ShrinkFailsTheCallInFlightAndTheNextEpochOfTheOthersCompletesItsCalls) {
  auto comms = make_named_comms(4);
  const std::vector<int> remain{0, 1, 3};
  // Worker 2 hangs: it never calls again, so only the shrink can end the others' call before its
  // deadline (10 s, scaled).
  std::vector<std::future<result>> in_flight;
  for (int w : remain)
    in_flight.push_back(std::async(std::launch::async, [&, w] {
      auto call = all_reduce_of(tensor::from<float>({float(w)}));
      return comms[static_cast<size_t>(w)]->run(lane::step, call);
    }));
  auto connect = local_connect(transport::local::make_group(3));
  std::vector<std::future<caf::expected<std::shared_ptr<communicator>>>> shrinking;
  const auto until = transport::clock::now() + test::scaled(10s);
  for (int w : remain)
    shrinking.push_back(std::async(std::launch::async, [&, w] {
      return comms[static_cast<size_t>(w)]->shrink({2}, 2, connect, until);
    }));
  for (auto& f : in_flight) {
    auto r = f.get();
    EXPECT_EQ(code_of(r), errc::membership_changed) << text_of(r);
    EXPECT_NE(text_of(r).find("lost worker:2"), std::string::npos) << text_of(r);
  }
  std::vector<std::shared_ptr<communicator>> next;
  for (auto& f : shrinking) {
    auto c = f.get();
    ASSERT_TRUE(c) << to_consort_error(c.error(), "").what();
    next.push_back(*c);
  }
  for (size_t i = 0; i < next.size(); ++i) {
    EXPECT_EQ(next[i]->rank(), static_cast<int>(i));
    EXPECT_EQ(next[i]->size(), 3);
    EXPECT_EQ(next[i]->members().epoch, 2u);
    EXPECT_EQ(next[i]->members().names,
              (std::vector<std::string>{"worker:0", "worker:1", "worker:3"}));
  }
  // A later call on the old group fails with the change, naming the lost worker.
  auto later = all_reduce_of(tensor::from<float>({1}));
  auto old = comms[0]->run(lane::step, later);
  EXPECT_EQ(code_of(old), errc::membership_changed) << text_of(old);
  EXPECT_NE(text_of(old).find("epoch 1 lost worker:2; the next epoch has 3 workers"),
            std::string::npos)
      << text_of(old);
  // The new group: old ranks 0, 1, 3 contribute 0, 1 and 3.
  auto out = run_all(next, [&](int r) {
    return all_reduce_of(tensor::from<float>({float(remain[static_cast<size_t>(r)])}));
  });
  for (auto& r : out) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->front().to_vector<float>(), (std::vector<float>{4.0f}));
  }
}

// The same over real sockets: the members that remain form a new TCP mesh whose handshake
// carries the next epoch, and a large all-reduce (the ring, not the fused exchange) completes.
TEST(GroupCommunicatorTest, ShrinkOverTcpFormsAMeshOfTheNextEpoch) {
  auto comms = make_named_comms(3);
  comms[0]->abort("killed"); // the chief is lost: the others carry on without it
  tcp_rendezvous board;
  auto connect =
      board.connect(std::chrono::duration_cast<std::chrono::milliseconds>(test::scaled(10s)));
  const auto until = transport::clock::now() + test::scaled(10s);
  std::vector<std::future<caf::expected<std::shared_ptr<communicator>>>> shrinking;
  for (int w : {1, 2})
    shrinking.push_back(std::async(std::launch::async, [&, w] {
      return comms[static_cast<size_t>(w)]->shrink({0}, 5, connect, until);
    }));
  std::vector<std::shared_ptr<communicator>> next;
  for (auto& f : shrinking) {
    auto c = f.get();
    ASSERT_TRUE(c) << to_consort_error(c.error(), "").what();
    next.push_back(*c);
  }
  EXPECT_EQ(next[0]->members().names, (std::vector<std::string>{"worker:1", "worker:2"}));
  EXPECT_EQ(next[1]->members().epoch, 5u);
  auto out = run_all(next, [](int r) {
    return all_reduce_of(tensor::from(std::vector<float>(100000, float(r + 1))));
  });
  for (auto& r : out) {
    ASSERT_TRUE(r) << text_of(r);
    auto v = r->front().to_vector<float>();
    EXPECT_EQ(v.front(), 3.0f);
    EXPECT_EQ(v.back(), 3.0f);
  }
}

// A second loss during re-formation: of the three members that remain, one dies before it
// connects. The others' shrink fails within its deadline (no hang), and retrying without the
// second lost member, in a later epoch, succeeds.
TEST(GroupCommunicatorTest, ASecondLossDuringShrinkFailsItInTimeAndALaterEpochWithoutItSucceeds) {
  auto comms = make_named_comms(4);
  comms[3]->abort("killed");
  tcp_rendezvous first;
  const auto short_wait =
      std::chrono::duration_cast<std::chrono::milliseconds>(test::scaled(300ms));
  auto connect = first.connect(short_wait);
  const auto until = transport::clock::now() + test::scaled(10s);
  // Worker 2 dies before it connects: only 0 and 1 try epoch 2.
  std::vector<std::future<caf::expected<std::shared_ptr<communicator>>>> shrinking;
  for (int w : {0, 1})
    shrinking.push_back(std::async(std::launch::async, [&, w] {
      return comms[static_cast<size_t>(w)]->shrink({3}, 2, connect, until);
    }));
  for (auto& f : shrinking) {
    auto c = f.get();
    ASSERT_FALSE(c);
    EXPECT_EQ(to_consort_error(c.error(), "").code(), errc::collective_timeout)
        << to_consort_error(c.error(), "").what();
  }
  tcp_rendezvous second;
  auto retry =
      second.connect(std::chrono::duration_cast<std::chrono::milliseconds>(test::scaled(10s)));
  shrinking.clear();
  for (int w : {0, 1})
    shrinking.push_back(std::async(std::launch::async, [&, w] {
      return comms[static_cast<size_t>(w)]->shrink({2, 3}, 3, retry, until);
    }));
  std::vector<std::shared_ptr<communicator>> next;
  for (auto& f : shrinking) {
    auto c = f.get();
    ASSERT_TRUE(c) << to_consort_error(c.error(), "").what();
    next.push_back(*c);
  }
  EXPECT_EQ(next[0]->members().epoch, 3u);
  auto out =
      run_all(next, [](int r) { return all_reduce_of(tensor::from<float>({float(r + 1)})); });
  for (auto& r : out) {
    ASSERT_TRUE(r) << text_of(r);
    EXPECT_EQ(r->front().to_vector<float>(), (std::vector<float>{3.0f}));
  }
}

TEST(GroupCommunicatorTest, ShrinkRefusesWhatCannotFormTheNextGroupAndSaysWhy) {
  auto comms = make_named_comms(3);
  auto never = [](int, int, uint64_t,
                  transport::deadline) -> caf::expected<transport::context_ptr> {
    ADD_FAILURE() << "connect must not be called for a refused shrink";
    return make_caf_error(errc::invalid_argument, "not called");
  };
  const auto until = transport::clock::now() + test::scaled(10s);
  auto expect_refused = [&](const std::vector<int>& lost, uint64_t epoch, const std::string& says) {
    auto c = comms[0]->shrink(lost, epoch, never, until);
    ASSERT_FALSE(c);
    auto e = to_consort_error(c.error(), "");
    EXPECT_EQ(e.code(), errc::invalid_argument) << e.what();
    EXPECT_NE(std::string{e.what()}.find(says), std::string::npos) << e.what();
  };
  expect_refused({3}, 2, "lost rank 3 is not one of its ranks; expected 0..2");
  expect_refused({0}, 2, "worker:0 is among the lost ranks but is the one shrinking");
  expect_refused({1, 2}, 2, "without worker:1, worker:2 leaves 1 member; a group needs at least 2");
  expect_refused({1}, 1, "into epoch 1; expected a later epoch");
  // None of these touched the group: it still runs calls.
  EXPECT_EQ(comms[0]->lost_cause(), "");
  // What connect reports comes back as it is.
  auto failing = [](int, int, uint64_t,
                    transport::deadline) -> caf::expected<transport::context_ptr> {
    return make_caf_error(errc::peer_lost, "worker:2 was lost while the group re-formed");
  };
  auto c = comms[0]->shrink({1}, 2, failing, until);
  ASSERT_FALSE(c);
  EXPECT_EQ(to_consort_error(c.error(), "").code(), errc::peer_lost);
  EXPECT_NE(std::string{to_consort_error(c.error(), "").what()}.find("while the group re-formed"),
            std::string::npos);
}

} // namespace
} // namespace consort
