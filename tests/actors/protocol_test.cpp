// The actor protocol driven message by message under CAF's deterministic test scheduler.

#include "support/test_coordinator_fixture.hpp"

#include "actors/collective_paths.hpp"

#include <consort/ops.hpp>

#include <atomic>
#include <deque>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace consort {
namespace {

using namespace std::chrono_literals;

collective_call make_call(step_id step, uint32_t seq, int replica, collective_kind kind,
                          nest value) {
  collective_call call;
  call.step = step;
  call.seq = seq;
  call.replica = replica;
  call.request.kind = kind;
  call.request.value = std::move(value);
  return call;
}

collective_call all_reduce_call(step_id step, uint32_t seq, int replica, float v) {
  return make_call(step, seq, replica, collective_kind::all_reduce,
                   tensor::from<float>({v, 2 * v}, {2}));
}

/// Three replicas' calls on a board shared with its collective actor, as the runtime makes it,
/// and a harness's host reductions sent to the actor.
class CollectiveActorTest : public test::test_coordinator_fixture {
protected:
  CollectiveActorTest() {
    collective_config cfg;
    cfg.replica_ids = {0, 1, 2};
    cfg.default_timeout = 5s;
    board_ = make_collective_board(cfg);
    cfg.board = board_;
    coll_ = spawn_collective(sys(), cfg, /*detached=*/false);
    for (int i = 0; i < 3; ++i)
      clients_.push_back(std::make_unique<caf::scoped_actor>(sys()));
    answers_.resize(3);
  }

  ~CollectiveActorTest() override {
    caf::anon_send_exit(coll_, caf::exit_reason::user_shutdown);
    run();
  }

  caf::scoped_actor& client(int i) { return *clients_[static_cast<size_t>(i)]; }

  /// Replica `i`'s call on the board with the future state it is answered in; its answers are
  /// read in calling order by `take`.
  void send(int i, collective_call call) {
    auto [state, fut] = make_future<nest>();
    direct_collect(*board_, sys(), coll_, std::move(call), state);
    answers_[static_cast<size_t>(i)].push_back(std::move(fut));
  }

  /// Replica `report.replica`'s step report on the board.
  void report(step_report r) { direct_report(*board_, sys(), coll_, std::move(r)); }

  /// The same for a host reduction or gather.
  template <class Request>
  void send_host(int i, Request req) {
    auto [state, fut] = make_future<nest>();
    if constexpr (std::is_same_v<Request, host_reduce>)
      client(i)->send(coll_, reduce_atom_v, req, state);
    else
      client(i)->send(coll_, gather_atom_v, req, state);
    answers_[static_cast<size_t>(i)].push_back(std::move(fut));
  }

  /// Client `i`'s oldest answer that has come: a nest, or the error's consort code and text.
  struct reply {
    bool received = false;
    std::optional<nest> value;
    errc code = errc::none;
    std::string message;
  };

  reply take(int i) {
    reply out;
    auto& queue = answers_[static_cast<size_t>(i)];
    if (queue.empty() || !queue.front().ready())
      return out;
    auto fut = std::move(queue.front());
    queue.pop_front();
    out.received = true;
    try {
      out.value = fut.get();
    } catch (const error& e) {
      out.code = e.code();
      out.message = e.what();
    }
    return out;
  }

  std::shared_ptr<detail::collective_board> board_;
  collective_actor coll_;
  std::vector<std::unique_ptr<caf::scoped_actor>> clients_;
  std::vector<std::deque<future<nest>>> answers_;
};

TEST_F(CollectiveActorTest, AllReduceAnswersEveryReplicaOnlyOnceAllHaveArrived) {
  send(0, all_reduce_call(0, 0, 0, 1));
  send(1, all_reduce_call(0, 0, 1, 2));
  run();
  EXPECT_FALSE(take(0).received);
  EXPECT_FALSE(take(1).received);
  send(2, all_reduce_call(0, 0, 2, 3));
  run();
  for (int i = 0; i < 3; ++i) {
    auto r = take(i);
    ASSERT_TRUE(r.received) << "replica " << i;
    ASSERT_TRUE(r.value) << r.message;
    EXPECT_EQ(r.value->as_tensor().to_vector<float>(), (std::vector<float>{6, 12}));
  }
}

TEST_F(CollectiveActorTest, CallsAreMatchedByStepAndSequenceNotByArrivalOrder) {
  // Replica 0 is already at call #1 while replica 1 makes call #0: each meets its own match.
  send(0, all_reduce_call(4, 0, 0, 1));
  send(0, all_reduce_call(4, 1, 0, 10));
  send(1, all_reduce_call(4, 1, 1, 20));
  send(2, all_reduce_call(4, 1, 2, 30));
  run();
  send(1, all_reduce_call(4, 0, 1, 2));
  send(2, all_reduce_call(4, 0, 2, 3));
  run();
  std::vector<std::vector<float>> firsts;
  for (int i = 0; i < 3; ++i) {
    std::vector<float> got;
    for (int k = 0; k < 2; ++k) {
      auto r = take(i);
      ASSERT_TRUE(r.value) << r.message;
      auto v = r.value->as_tensor().to_vector<float>();
      got.push_back(v[0]);
    }
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, (std::vector<float>{6, 60})) << "replica " << i;
  }
}

TEST_F(CollectiveActorTest, MismatchedKindsFailEveryReplicaIncludingLateArrivals) {
  send(0, all_reduce_call(1, 0, 0, 1));
  send(1, make_call(1, 0, 1, collective_kind::all_gather, tensor::from<float>({1, 2}, {2})));
  run();
  for (int i = 0; i < 2; ++i) {
    auto r = take(i);
    ASSERT_TRUE(r.received);
    EXPECT_EQ(r.code, errc::collective_mismatch);
    EXPECT_NE(r.message.find("replica 1 called all_gather(axis=0)"), std::string::npos)
        << r.message;
    EXPECT_NE(r.message.find("replica 0 called all_reduce(SUM)"), std::string::npos) << r.message;
  }
  send(2, all_reduce_call(1, 0, 2, 3));
  run();
  EXPECT_EQ(take(2).code, errc::collective_mismatch);
}

TEST_F(CollectiveActorTest, MismatchedShapesNameBothShapes) {
  send(0, all_reduce_call(0, 0, 0, 1));
  send(1, make_call(0, 0, 1, collective_kind::all_reduce, tensor::from<float>({1, 2, 3}, {3})));
  run();
  auto r = take(1);
  EXPECT_EQ(r.code, errc::collective_mismatch);
  EXPECT_NE(r.message.find("shape [3]"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("[2]"), std::string::npos) << r.message;
}

TEST_F(CollectiveActorTest, DeadlineNamesArrivedAndMissingReplicas) {
  send(0, all_reduce_call(2, 0, 0, 1));
  send(2, all_reduce_call(2, 0, 2, 1));
  run();
  EXPECT_FALSE(take(0).received);
  fire_timeouts();
  for (int i : {0, 2}) {
    auto r = take(i);
    ASSERT_TRUE(r.received);
    EXPECT_EQ(r.code, errc::collective_timeout);
    EXPECT_NE(r.message.find("all_reduce(SUM) #0 of step 2"), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("replicas [0, 2] arrived, replicas [1] did not"), std::string::npos)
        << r.message;
  }
  // The straggler learns the same at once instead of waiting a deadline of its own.
  send(1, all_reduce_call(2, 0, 1, 1));
  run();
  EXPECT_EQ(take(1).code, errc::collective_timeout);
}

TEST_F(CollectiveActorTest, PeerThatFinishesWithoutTheCallFailsWaitersAtOnce) {
  send(0, all_reduce_call(3, 0, 0, 1));
  send(1, all_reduce_call(3, 0, 1, 1));
  run();
  report(step_report{3, 2, 0, caf::error{}});
  run(); // no timeout fired: the report alone decides
  for (int i = 0; i < 2; ++i) {
    auto r = take(i);
    ASSERT_TRUE(r.received);
    EXPECT_EQ(r.code, errc::collective_aborted);
    EXPECT_NE(r.message.find("replica 2 finished step 3 after 0 collective call(s)"),
              std::string::npos)
        << r.message;
  }
}

TEST_F(CollectiveActorTest, PeerFailureIsForwardedWithItsReason) {
  report(step_report{5, 1, 0, make_caf_error(errc::step_failed, "boom on replica 1")});
  run();
  send(0, all_reduce_call(5, 0, 0, 1));
  run();
  auto r = take(0);
  EXPECT_EQ(r.code, errc::collective_aborted);
  EXPECT_NE(r.message.find("boom on replica 1"), std::string::npos) << r.message;
}

/// A collective actor whose state is shared with its replicas (a board), as the runtime makes it:
/// replicas call `direct_collect` on their own threads; a harness still sends messages.
class CollectiveBoardTest : public test::test_coordinator_fixture {
protected:
  CollectiveBoardTest() {
    collective_config cfg;
    cfg.replica_ids = {0, 1, 2};
    cfg.default_timeout = 5s;
    board_ = make_collective_board(cfg);
    cfg.board = board_;
    coll_ = spawn_collective(sys(), cfg, /*detached=*/false);
  }

  ~CollectiveBoardTest() override {
    caf::anon_send_exit(coll_, caf::exit_reason::user_shutdown);
    run();
  }

  /// Replica `call.replica`'s direct call; its future.
  future<nest> direct(collective_call call) {
    auto [state, fut] = make_future<nest>();
    direct_collect(*board_, sys(), coll_, std::move(call), state);
    return fut;
  }

  static errc code_of(future<nest>& f) {
    try {
      (void)f.get();
    } catch (const error& e) {
      return e.code();
    }
    return errc::none;
  }

  std::shared_ptr<detail::collective_board> board_;
  collective_actor coll_;
};

TEST_F(CollectiveBoardTest, TheLastReplicaToArriveComputesOnItsOwnThreadWithoutTheActor) {
  auto f0 = direct(all_reduce_call(0, 0, 0, 1));
  auto f1 = direct(all_reduce_call(0, 0, 1, 2));
  EXPECT_FALSE(f0.ready());
  EXPECT_FALSE(f1.ready());
  auto f2 = direct(all_reduce_call(0, 0, 2, 3));
  // No message was processed: the third call completed every future on this thread.
  for (auto* f : {&f0, &f1, &f2}) {
    ASSERT_TRUE(f->ready());
    EXPECT_EQ(f->get().as_tensor().to_vector<float>(), (std::vector<float>{6, 12}));
  }
}

TEST_F(CollectiveBoardTest, ADirectMismatchFailsEveryReplicaOnItsCallersThread) {
  auto f0 = direct(all_reduce_call(2, 0, 0, 1));
  auto f1 = direct(make_call(2, 0, 1, collective_kind::broadcast, tensor::scalar<float>(1)));
  ASSERT_TRUE(f0.ready());
  ASSERT_TRUE(f1.ready());
  EXPECT_EQ(code_of(f0), errc::collective_mismatch);
  EXPECT_EQ(code_of(f1), errc::collective_mismatch);
  // The late arrival learns it at once too.
  auto f2 = direct(all_reduce_call(2, 0, 2, 1));
  ASSERT_TRUE(f2.ready());
  EXPECT_EQ(code_of(f2), errc::collective_mismatch);
}

TEST_F(CollectiveBoardTest, ADirectCallsDeadlineIsKeptByTheActorsTick) {
  auto f0 = direct(all_reduce_call(3, 0, 0, 1));
  run();
  EXPECT_FALSE(f0.ready());
  fire_timeouts(); // virtual time: the tick that the direct call armed fires
  ASSERT_TRUE(f0.ready());
  try {
    (void)f0.get();
    ADD_FAILURE() << "the call should have timed out";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::collective_timeout);
    EXPECT_NE(std::string{e.what()}.find("replicas [0] arrived, replicas [1, 2] did not"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(CollectiveBoardTest, ADirectReportFailsTheWaitersAtOnce) {
  auto f0 = direct(all_reduce_call(4, 0, 0, 1));
  direct_report(*board_, sys(), coll_, step_report{4, 1, 0, caf::error{}});
  ASSERT_TRUE(f0.ready());
  EXPECT_EQ(code_of(f0), errc::collective_aborted);
}

TEST_F(CollectiveBoardTest, ACallThatCompletesItsSlotAloneIsAnsweredBeforeDirectCollectReturns) {
  // The lone GPU replica's way: a board of one replica, whose every call completes its slot on
  // the caller's thread. On a GPU the NCCL call is queued there; here the same slot
  // runs the host kernels.
  collective_config cfg;
  cfg.replica_ids = {0};
  cfg.default_timeout = 5s;
  auto board = make_collective_board(cfg);
  auto [state, fut] = make_future<nest>();
  direct_collect(*board, sys(), coll_, all_reduce_call(0, 0, 0, 4), state);
  ASSERT_TRUE(fut.ready()); // no message was processed
  EXPECT_EQ(fut.get().as_tensor().to_vector<float>(), (std::vector<float>{4, 8}));
}

TEST_F(CollectiveBoardTest, ABoardOfOneCpuReplicaCompletesItsCallsOnArrivalWithTheirChecks) {
  // One slot: nothing to match, so the call is complete when it is made (no future, no
  // message); a GPU replica's still goes through a slot (its one-rank NCCL communicator).
  collective_config cfg;
  cfg.replica_ids = {0};
  auto board = make_collective_board(cfg);
  EXPECT_TRUE(detail::completes_on_arrival(*board, false));
  EXPECT_FALSE(detail::completes_on_arrival(*board, true));
  EXPECT_FALSE(detail::completes_on_arrival(*board_, false)) << "three replicas match in slots";
  auto call = all_reduce_call(0, 0, 0, 4);
  auto out = detail::collect_alone(*board, call);
  EXPECT_EQ(out.as_tensor().to_vector<float>(), (std::vector<float>{4, 8}));
  auto bad = make_call(0, 1, 0, collective_kind::broadcast, tensor::scalar<int32_t>(1));
  bad.request.root = 3;
  try {
    (void)detail::collect_alone(*board, bad);
    ADD_FAILURE() << "a root out of range must be refused";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument);
    EXPECT_NE(std::string{e.what()}.find("root replica 3 is out of range"), std::string::npos)
        << e.what();
  }
}

TEST_F(CollectiveBoardTest, AReplicaWithoutABoardIsRefusedWithWhatItNeeds) {
  replica_config rcfg;
  rcfg.replica_id = 2;
  rcfg.device = "CPU:2";
  try {
    (void)spawn_replica(sys(), rcfg, coll_, false);
    ADD_FAILURE() << "a replica without a board must be refused";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument);
    EXPECT_NE(std::string{e.what()}.find("replica 2 (CPU:2) has no collective board"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(CollectiveActorTest, BroadcastRootOutOfRangeIsRejected) {
  auto call = make_call(0, 0, 0, collective_kind::broadcast, tensor::scalar<int32_t>(1));
  call.request.root = 7;
  send(0, call);
  run();
  auto r = take(0);
  EXPECT_EQ(r.code, errc::invalid_argument);
  EXPECT_NE(r.message.find("root replica 7 is out of range"), std::string::npos) << r.message;
}

TEST_F(CollectiveActorTest, HostReduceAndGatherAnswerRequests) {
  host_reduce req{reduce_op::mean,
                  {nest(tensor::from<int32_t>({0, 1, 2, 3})), nest(tensor::from<int32_t>({4, 5}))},
                  0};
  send_host(0, req);
  run();
  auto r = take(0);
  ASSERT_TRUE(r.value) << r.message;
  EXPECT_DOUBLE_EQ(r.value->as_tensor().item<double>(), 2.5);
  host_gather g{{nest(tensor::scalar<float>(1)), nest(tensor::scalar<float>(2))}, 0};
  send_host(0, g);
  run();
  r = take(0);
  EXPECT_EQ(r.code, errc::invalid_argument) << "rank-0 gather must be rejected";
}

// -- step_join
// --------------------------------------------------------------------------------------

TEST(StepJoinTest, FinishedReplicaIsCarriedByTheFirstCollectiveCallerOrReportsItself) {
  step_join join{7, {0, 1, 2}, nullptr};
  // Replica 0 finishes before anyone used a collective: it need not report...
  EXPECT_FALSE(join.mark_finished(0, 0, caf::error{}));
  // ...because the first caller carries its report.
  auto peers = join.mark_collective_used();
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers[0].replica, 0);
  EXPECT_EQ(peers[0].step, 7u);
  EXPECT_EQ(peers[0].calls, 0u);
  // Once a collective is in use, a finishing replica reports itself.
  EXPECT_TRUE(join.mark_finished(2, 0, caf::error{}));
  // A replica that made calls always reports.
  step_join other{8, {0, 1}, nullptr};
  EXPECT_TRUE(other.mark_finished(1, 3, caf::error{}));
}

TEST(StepJoinTest, KeepsTheRootCauseAndCompletesOnce) {
  int completions = 0;
  step_join join{3, {0, 1, 2}, [&](step_join&) {
                   ++completions;
                 }};
  join.deposit(0, make_caf_error(errc::collective_aborted, "echo"));
  join.deposit(1, make_caf_error(errc::step_failed, "root"));
  EXPECT_FALSE(join.complete());
  join.deposit(2, nest(tensor::scalar<float>(1)));
  ASSERT_TRUE(join.complete());
  EXPECT_EQ(completions, 1);
  EXPECT_EQ(to_consort_error(join.failure(), "").code(), errc::step_failed);
  EXPECT_FALSE(join.expire(1000ms)) << "a complete join cannot expire";
  EXPECT_EQ(completions, 1);
}

TEST(StepJoinTest, ExpiryNamesTheReplicasThatHaveNotFinished) {
  step_join join{4, {0, 1, 2}, nullptr};
  join.deposit(1, nest(tensor::scalar<float>(1)));
  ASSERT_TRUE(join.expire(250ms));
  auto e = to_consort_error(join.failure(), "");
  EXPECT_EQ(e.code(), errc::step_timeout);
  EXPECT_NE(std::string(e.what()).find("step 4 did not finish within the step deadline of 250 ms "
                                       "on replica(s) 0, 2;"),
            std::string::npos)
      << e.what();
  join.deposit(0, nest(tensor::scalar<float>(1))); // late deposits are ignored
  EXPECT_EQ(to_consort_error(join.failure(), "").code(), errc::step_timeout);
}

// -- step actor over replica actors
// ------------------------------------------------------------

class StepActorTest : public test::test_coordinator_fixture {
protected:
  void spawn(int n) {
    collective_config ccfg;
    for (int i = 0; i < n; ++i)
      ccfg.replica_ids.push_back(i);
    ccfg.board = make_collective_board(ccfg);
    coll_ = spawn_collective(sys(), ccfg, false);
    for (int i = 0; i < n; ++i) {
      replica_config rcfg;
      rcfg.replica_id = i;
      rcfg.num_replicas = n;
      rcfg.local_index = i;
      rcfg.device = "CPU:" + std::to_string(i);
      rcfg.board = ccfg.board;
      replicas_.push_back(spawn_replica(sys(), rcfg, coll_, false));
    }
    strat_ = spawn_step_actor(sys(), replicas_, 1000ms);
  }

  ~StepActorTest() override {
    caf::anon_send_exit(strat_, caf::exit_reason::user_shutdown);
    for (auto& r : replicas_)
      caf::anon_send_exit(r, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(coll_, caf::exit_reason::user_shutdown);
    run();
  }

  collective_actor coll_;
  std::vector<replica_actor> replicas_;
  step_actor strat_;
};

TEST_F(StepActorTest, RunCollectsOneResultPerReplicaInReplicaOrder) {
  spawn(3);
  caf::scoped_actor self{sys()};
  auto fn = std::make_shared<const step_function>([](replica_context& ctx) {
    return nest(tensor::scalar<int32_t>(ctx.replica_id_in_sync_group() * 10));
  });
  self->send(strat_, run_atom_v, fn);
  run();
  bool got = false;
  self->receive(
      [&](step_results& r) {
        got = true;
        ASSERT_EQ(r.size(), 3u);
        for (int i = 0; i < 3; ++i)
          EXPECT_EQ(r[static_cast<size_t>(i)].as_tensor().item<int32_t>(), i * 10);
      },
      [&](caf::error& err) { FAIL() << to_consort_error(err, "").what(); },
      caf::after(0s) >> [] {});
  EXPECT_TRUE(got);
}

TEST_F(StepActorTest, StepsAreNumberedInSubmissionOrder) {
  spawn(2);
  caf::scoped_actor self{sys()};
  auto fn = std::make_shared<const step_function>([](replica_context& ctx) {
    return nest(tensor::scalar<int64_t>(static_cast<int64_t>(ctx.step())));
  });
  for (int k = 0; k < 3; ++k)
    self->send(strat_, run_atom_v, fn);
  run();
  for (int64_t k = 0; k < 3; ++k) {
    self->receive([&](step_results& r) { EXPECT_EQ(r[1].as_tensor().item<int64_t>(), k); },
                  caf::after(0s) >> [] { FAIL() << "missing reply"; });
  }
}

TEST_F(StepActorTest, ReplicaExceptionFailsTheStepWithThatReplicasMessage) {
  spawn(2);
  caf::scoped_actor self{sys()};
  auto fn = std::make_shared<const step_function>([](replica_context& ctx) -> nest {
    if (ctx.replica_id_in_sync_group() == 1)
      throw std::runtime_error("bad batch");
    return nest(tensor::scalar<float>(1));
  });
  self->send(strat_, run_atom_v, fn);
  run();
  bool failed = false;
  self->receive([&](step_results&) { FAIL() << "step should fail"; },
                [&](caf::error& err) {
                  failed = true;
                  auto e = to_consort_error(err, "");
                  EXPECT_EQ(e.code(), errc::step_failed);
                  EXPECT_STREQ(e.what(), "replica 1 (CPU:1) failed step 0: bad batch");
                },
                caf::after(0s) >> [] {});
  EXPECT_TRUE(failed);
}

TEST_F(StepActorTest, SilentReplicaFailsTheStepAtTheStepDeadline) {
  // A replica actor that never answers stands in for a step function that never returns.
  collective_config ccfg;
  ccfg.replica_ids = {0, 1};
  ccfg.board = make_collective_board(ccfg);
  coll_ = spawn_collective(sys(), ccfg, false);
  replica_config rcfg;
  rcfg.device = "CPU:0";
  rcfg.board = ccfg.board;
  replicas_.push_back(spawn_replica(sys(), rcfg, coll_, false));
  replicas_.push_back(
      caf::actor_cast<replica_actor>(sys().spawn([](caf::event_based_actor*) -> caf::behavior {
        return {[](step_atom, step_message&) { /* never deposits */ }};
      })));
  strat_ = spawn_step_actor(sys(), replicas_, 1000ms);
  caf::scoped_actor self{sys()};
  auto fn = std::make_shared<const step_function>(
      [](replica_context&) { return nest(tensor::scalar<float>(1)); });
  self->send(strat_, run_atom_v, fn);
  run();
  bool early = false;
  self->receive([&](step_results&) { early = true; }, [&](caf::error&) { early = true; },
                caf::after(0s) >> [] {});
  EXPECT_FALSE(early) << "the step must wait for the silent replica until the deadline";
  // The watchdog ticks every eighth of the deadline; each round fires the next tick and moves
  // the test clock to it. The step fails on the first tick at or past its deadline.
  bool failed = false;
  int rounds = 0;
  while (!failed && rounds++ < 20) {
    fire_timeouts();
    self->receive([&](step_results&) { FAIL() << "step should time out"; },
                  [&](caf::error& err) {
                    failed = true;
                    auto e = to_consort_error(err, "");
                    EXPECT_EQ(e.code(), errc::step_timeout);
                    EXPECT_NE(std::string(e.what()).find("on replica(s) 1;"), std::string::npos)
                        << e.what();
                  },
                  caf::after(0s) >> [] {});
  }
  EXPECT_GE(rounds, 8) << "the step failed before its deadline";
  EXPECT_TRUE(failed);
}

// -- a lone CPU replica's step on the caller's thread ---------------------------------------------

/// One CPU replica whose runner the launcher was given (run_here), as the runtime builds a
/// one-replica strategy; the replica actor only runs when the test calls `run()`.
class RunHereTest : public test::test_coordinator_fixture {
protected:
  RunHereTest() {
    collective_config ccfg;
    ccfg.replica_ids = {0};
    ccfg.board = make_collective_board(ccfg);
    coll_ = spawn_collective(sys(), ccfg, false);
    replica_config rcfg;
    rcfg.device = "CPU:0";
    rcfg.board = ccfg.board;
    std::shared_ptr<replica_runner> runner;
    replica_ = spawn_replica(sys(), rcfg, coll_, false, &runner);
    launcher_ = std::make_shared<step_launcher>(sys(), std::vector<replica_actor>{replica_},
                                                std::vector<int>{0}, 1000ms);
    launcher_->run_here_through(runner);
    watchdog_ = spawn_step_actor(sys(), launcher_);
  }

  ~RunHereTest() override {
    caf::anon_send_exit(watchdog_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(replica_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(coll_, caf::exit_reason::user_shutdown);
    run();
  }

  /// A step that appends its number to `order_` and returns it.
  step_function_ptr numbered() {
    return std::make_shared<const step_function>([this](replica_context& ctx) {
      order_.push_back(ctx.step());
      return nest(tensor::scalar<int64_t>(static_cast<int64_t>(ctx.step())));
    });
  }

  static step_function_ptr step(std::function<nest(replica_context&)> fn) {
    return std::make_shared<const step_function>(std::move(fn));
  }

  collective_actor coll_;
  replica_actor replica_;
  std::shared_ptr<step_launcher> launcher_;
  step_actor watchdog_;
  std::vector<step_id> order_;
};

TEST_F(RunHereTest, AnIdleReplicasStepRunsOnTheCallersThreadAndIsDoneWhenRunHereReturns) {
  std::thread::id ran_on;
  bool started = false;
  auto join = launcher_->run_here(
      step([&](replica_context& ctx) {
        ran_on = std::this_thread::get_id();
        return nest(ctx.all_reduce("SUM", tensor::scalar<float>(2)));
      }),
      [&](step_join& j) {
        started = true;
        EXPECT_FALSE(j.complete()) << "`started` runs before the step";
      },
      nullptr);
  ASSERT_TRUE(join);
  EXPECT_TRUE(started);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  // Done without the scheduler running any actor: nothing went to the replica's thread.
  ASSERT_TRUE(join->complete());
  ASSERT_FALSE(join->failure()) << to_consort_error(join->failure(), "").what();
  EXPECT_FLOAT_EQ(join->take_results()[0].as_tensor().item<float>(), 2);
}

TEST_F(RunHereTest, StepsLaunchedWhileOneRunsHereWaitForItAndFollowInOrder) {
  std::shared_ptr<step_join> second;
  std::shared_ptr<step_join> third;
  auto first = launcher_->run_here(step([&](replica_context& ctx) {
                                     order_.push_back(ctx.step());
                                     // Launched meanwhile (as from another thread): the replica
                                     // actor must not get them while this step runs, however long
                                     // the scheduler runs.
                                     second = launcher_->launch(numbered(), nullptr);
                                     third = launcher_->launch(numbered(), nullptr);
                                     EXPECT_FALSE(launcher_->run_here(numbered(), nullptr, nullptr))
                                         << "a second step ran here while the first did";
                                     run();
                                     EXPECT_EQ(order_, std::vector<step_id>({0}))
                                         << "a step ran during step 0";
                                     return nest(tensor::scalar<int64_t>(0));
                                   }),
                                   nullptr, nullptr);
  ASSERT_TRUE(first && second && third);
  EXPECT_TRUE(first->complete());
  EXPECT_FALSE(second->complete());
  run(); // now they go to the replica's thread, in order
  EXPECT_EQ(order_, std::vector<step_id>({0, 1, 2}));
  ASSERT_TRUE(second->complete() && third->complete());
  EXPECT_EQ(third->take_results()[0].as_tensor().item<int64_t>(), 2);
}

TEST_F(RunHereTest, AStepStillOnTheReplicasThreadKeepsTheNextOneOffTheCallersThread) {
  auto queued = launcher_->launch(numbered(), nullptr);
  bool completed = false;
  step_join::completion done = [&completed](step_join&) {
    completed = true;
  };
  EXPECT_FALSE(launcher_->run_here(numbered(), nullptr, std::move(done)))
      << "a step ran here while step 0 had not run on the replica";
  // A declined step keeps its completion, for the launch that follows.
  ASSERT_TRUE(done) << "run_here took the completion of a step it did not run";
  auto launched = launcher_->launch(numbered(), std::move(done));
  run();
  ASSERT_TRUE(queued->complete());
  ASSERT_TRUE(launched->complete());
  EXPECT_TRUE(completed);
  auto here = launcher_->run_here(numbered(), nullptr, nullptr);
  ASSERT_TRUE(here) << "the replica is idle again";
  EXPECT_EQ(order_, std::vector<step_id>({0, 1, 2}));
}

TEST_F(RunHereTest, AStepPastItsDeadlineFailsWithStepTimeoutWhenItsFunctionReturns) {
  std::string error_at_return;
  auto join = launcher_->run_here(
      step([&](replica_context&) {
        // The deadline passes while the function runs: the join fails at once, and the
        // function goes on (nothing can stop this thread).
        launcher_->advance_clock(1001ms);
        return nest(tensor::scalar<float>(1));
      }),
      nullptr, [&](step_join& j) { error_at_return = to_consort_error(j.failure(), "").what(); });
  ASSERT_TRUE(join && join->complete());
  EXPECT_EQ(to_consort_error(join->failure(), "").code(), errc::step_timeout);
  EXPECT_NE(error_at_return.find("step 0 did not finish within the step deadline of 1000 ms on "
                                 "replica(s) 0"),
            std::string::npos)
      << error_at_return;
  // The replica is free again: the next step runs here and succeeds.
  auto next = launcher_->run_here(numbered(), nullptr, nullptr);
  ASSERT_TRUE(next && next->complete());
  EXPECT_FALSE(next->failure());
}

TEST_F(RunHereTest, AThrowingStepFailsAsOnTheReplicasThreadAndFreesTheReplica) {
  auto join = launcher_->run_here(
      step([](replica_context&) -> nest { throw std::runtime_error("bad batch"); }), nullptr,
      nullptr);
  ASSERT_TRUE(join && join->complete());
  auto e = to_consort_error(join->failure(), "");
  EXPECT_EQ(e.code(), errc::step_failed);
  EXPECT_STREQ(e.what(), "replica 0 (CPU:0) failed step 0: bad batch");
  EXPECT_TRUE(launcher_->run_here(numbered(), nullptr, nullptr));
}

TEST_F(RunHereTest, AClosedLauncherRunsNothingHere) {
  launcher_->close();
  EXPECT_FALSE(launcher_->run_here(numbered(), nullptr, nullptr));
  EXPECT_TRUE(order_.empty());
}

TEST_F(RunHereTest, ALauncherOfSeveralReplicasOrOfNoRunnerNeverRunsHere) {
  step_launcher none(sys(), {replica_}, {0}, 1000ms);
  EXPECT_FALSE(none.run_here(numbered(), nullptr, nullptr));
  collective_config ccfg;
  ccfg.replica_ids = {0, 1};
  ccfg.board = make_collective_board(ccfg);
  auto coll = spawn_collective(sys(), ccfg, false);
  std::vector<replica_actor> two;
  std::shared_ptr<replica_runner> runner;
  for (int i = 0; i < 2; ++i) {
    replica_config rcfg;
    rcfg.replica_id = i;
    rcfg.num_replicas = 2;
    rcfg.local_index = i;
    rcfg.device = "CPU:" + std::to_string(i);
    rcfg.board = ccfg.board;
    two.push_back(spawn_replica(sys(), rcfg, coll, false, i == 0 ? &runner : nullptr));
  }
  step_launcher pair(sys(), two, {0, 1}, 1000ms);
  pair.run_here_through(runner);
  EXPECT_FALSE(pair.run_here(numbered(), nullptr, nullptr));
  EXPECT_TRUE(order_.empty());
  for (auto& r : two)
    caf::anon_send_exit(r, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(coll, caf::exit_reason::user_shutdown);
}

} // namespace
} // namespace consort
