// The cross-worker phase inside one process: W runtimes (one per "worker") whose collective actors
// meet over the in-memory transport (transport/local). The multi-process tests
// (tests/multiworker) run the same code over TCP; these cover the error paths deterministically.

#include "transport/communicator.hpp"

#include <consort/caf_error.hpp>

#include "actors/runtime.hpp"
#include "support/time_scale.hpp"

#include <consort/ops.hpp>
#include <consort/transport/local.hpp>

#include <gtest/gtest.h>

#include <functional>
#include <future>
#include <mutex>
#include <thread>

using namespace consort;
using namespace std::chrono_literals;

namespace {

/// W workers of D CPU replicas each, in one process.
struct cluster {
  std::vector<std::shared_ptr<transport::communicator>> cross;
  std::vector<std::unique_ptr<detail::runtime>> workers;

  cluster(int num_workers, int devices, std::chrono::milliseconds timeout = 10s) {
    auto group = transport::local::make_group(num_workers);
    strategy_options opts;
    opts.collective_timeout = timeout;
    for (int w = 0; w < num_workers; ++w) {
      std::vector<std::string> names;
      for (int d = 0; d < devices; ++d)
        names.push_back("CPU:" + std::to_string(d));
      detail::multi_worker_setup setup;
      setup.worker_rank = w;
      setup.num_workers = num_workers;
      setup.cross =
          std::make_shared<transport::communicator>(group[static_cast<size_t>(w)], devices);
      cross.push_back(setup.cross);
      workers.push_back(std::make_unique<detail::runtime>(names, opts, std::move(setup)));
    }
  }

  /// Runs `fn` as one step on every worker; returns each worker's future.
  std::vector<future<per_replica<nest>>> run(const step_function& fn) {
    std::vector<future<per_replica<nest>>> out;
    for (auto& w : workers)
      out.push_back(w->submit(fn));
    return out;
  }
};

tensor row(int r) {
  return tensor::from<float>({static_cast<float>(r), 1.0f}, {2});
}

errc code_of(future<per_replica<nest>>& f) {
  try {
    f.get();
  } catch (const error& e) {
    return e.code();
  }
  return errc::none;
}

std::string message_of(future<per_replica<nest>>& f) {
  try {
    f.get();
  } catch (const error& e) {
    return e.what();
  }
  return {};
}

} // namespace

TEST(CrossWorkerTest, AllReduceSpansEveryReplicaOfEveryWorker) {
  cluster c(3, 2);
  auto results = c.run([](replica_context& ctx) {
    EXPECT_EQ(ctx.num_replicas_in_sync(), 6);
    return nest(ctx.all_reduce("SUM", row(ctx.replica_id_in_sync_group())));
  });
  for (size_t w = 0; w < results.size(); ++w) {
    auto v = results[w].get();
    ASSERT_EQ(v.size(), 2u);
    for (auto& r : v)
      EXPECT_EQ(r.as_tensor(), tensor::from<float>({15.0f, 6.0f}, {2})) << "worker " << w;
  }
}

TEST(CrossWorkerTest, MeanDividesByEveryReplicaAndIntegersBecomeFloat64) {
  cluster c(2, 2);
  auto results = c.run([](replica_context& ctx) {
    return nest(
        ctx.all_reduce("MEAN", tensor::from<int32_t>({ctx.replica_id_in_sync_group()}, {1})));
  });
  for (auto& f : results)
    EXPECT_EQ(f.get()[0].as_tensor(), tensor::from<double>({1.5}, {1}));
}

TEST(CrossWorkerTest, AllGatherIsInReplicaIdOrderAcrossWorkers) {
  cluster c(2, 2);
  auto results = c.run([](replica_context& ctx) {
    auto r = ctx.replica_id_in_sync_group();
    // Ragged: replica r has r rows.
    std::vector<float> v(static_cast<size_t>(r), static_cast<float>(r));
    return nest(ctx.all_gather(tensor::from<float>(v, {r}), 0));
  });
  for (auto& f : results)
    EXPECT_EQ(f.get()[1].as_tensor(), tensor::from<float>({1, 2, 2, 3, 3, 3}, {6}));
}

/// Workers, replicas per worker, axis, and each replica's rows (by replica id).
class CrossWorkerGatherTest
    : public ::testing::TestWithParam<std::tuple<int, int, int, std::vector<int64_t>>> {};

TEST_P(CrossWorkerGatherTest, RaggedPartsOnBothSidesOfTheFusedSizeGatherInReplicaIdOrder) {
  // Parts up to 64 KiB travel with their worker's descriptor; larger ones take the ring after it.
  // Whatever the mix, every worker gets every part in replica-id order.
  auto [workers, replicas, axis, rows] = GetParam();
  cluster c(workers, replicas);
  // Replica r's part: rows[r] x 3 along `axis` (3 x rows[r] for axis 1), element k = r * 1e6 + k.
  auto part = [axis, rows](int r) {
    auto extent = rows[static_cast<size_t>(r)];
    std::vector<float> v(static_cast<size_t>(extent * 3));
    for (size_t k = 0; k < v.size(); ++k)
      v[k] = static_cast<float>(r) * 1e6f + static_cast<float>(k);
    return axis == 0 ? tensor::from<float>(v, {extent, 3}) : tensor::from<float>(v, {3, extent});
  };
  std::vector<tensor> parts;
  for (int r = 0; r < workers * replicas; ++r)
    parts.push_back(part(r));
  auto want = concat(parts, axis);
  auto results = c.run([part, axis](replica_context& ctx) {
    return nest(ctx.all_gather(part(ctx.replica_id_in_sync_group()), axis));
  });
  for (auto& f : results) {
    auto got = f.get();
    for (const auto& v : got.values())
      EXPECT_EQ(v.as_tensor(), want);
  }
  // The group goes on: a small all-reduce after it.
  for (auto& f : c.run([](replica_context& ctx) { return nest(ctx.all_reduce("SUM", row(1))); }))
    EXPECT_EQ(f.get()[0].as_tensor(), tensor::from<float>({static_cast<float>(workers * replicas),
                                                           static_cast<float>(workers * replicas)},
                                                          {2}));
}

TEST(CrossWorkerTest, ALoneReplicasNegativeGatherAxisMeetsTheSameAxisGivenPositive) {
  // One replica per worker (the call runs on the replica's thread): worker 0 says axis -1,
  // worker 1 axis 1 of the same rank-2 parts. The workers compare the normalised axis, so they
  // agree; the error text names the call as it was made.
  cluster c(2, 1);
  auto part = [](int r) {
    return tensor::from<float>({static_cast<float>(r), 10.0f + static_cast<float>(r)}, {2, 1});
  };
  auto results = c.run([part](replica_context& ctx) {
    const int r = ctx.replica_id_in_sync_group();
    return nest(ctx.all_gather(part(r), r == 0 ? -1 : 1));
  });
  const auto want = tensor::from<float>({0, 1, 10, 11}, {2, 2});
  for (auto& f : results)
    EXPECT_EQ(f.get()[0].as_tensor(), want);
  // And a real disagreement is still one: axis -2 (axis 0) against axis 1.
  auto mixed = c.run([part](replica_context& ctx) {
    const int r = ctx.replica_id_in_sync_group();
    return nest(ctx.all_gather(part(r), r == 0 ? -2 : 1));
  });
  for (auto& f : mixed)
    EXPECT_EQ(code_of(f), errc::collective_mismatch);
}

// 8000 rows of 3 float32 = 96 000 B: over the fused size; 2 rows: under it; 0 rows: nothing.
INSTANTIATE_TEST_SUITE_P(Parts, CrossWorkerGatherTest,
                         ::testing::Values(std::tuple{2, 1, 0, std::vector<int64_t>{2, 3}},
                                           std::tuple{2, 1, 0, std::vector<int64_t>{2, 8000}},
                                           std::tuple{2, 1, 1, std::vector<int64_t>{8000, 1}},
                                           std::tuple{3, 1, 0, std::vector<int64_t>{0, 8000, 5}},
                                           std::tuple{3, 1, 1, std::vector<int64_t>{4, 0, 1}},
                                           std::tuple{2, 2, 0, std::vector<int64_t>{1, 0, 3, 4000}},
                                           std::tuple{3, 2, 1,
                                                      std::vector<int64_t>{1, 2, 3, 4, 5, 6}}));

TEST(CrossWorkerTest, BroadcastFromAReplicaOfAnotherWorker) {
  cluster c(2, 2);
  auto results = c.run([](replica_context& ctx) {
    return nest(ctx.broadcast(row(ctx.replica_id_in_sync_group()), 3));
  });
  for (auto& f : results)
    EXPECT_EQ(f.get()[0].as_tensor(), row(3));
}

class CrossWorkerBroadcastTest
    : public ::testing::TestWithParam<std::tuple<int, int, int, int64_t>> {};

TEST_P(CrossWorkerBroadcastTest, EveryReplicaGetsTheRootsValuesOnBothSidesOfTheFusedSize) {
  // Up to 64 KiB the root's worker sends its data with its descriptor (one round); above, the
  // broadcast algorithm follows the descriptors. One call of two leaves, so that the fused bytes
  // must be split between them right.
  auto [workers, replicas, root, elements] = GetParam();
  cluster c(workers, replicas);
  auto leaves = [elements](int r) {
    std::vector<float> a(static_cast<size_t>(elements));
    for (size_t k = 0; k < a.size(); ++k)
      a[k] = static_cast<float>(r) * 1e6f + static_cast<float>(k);
    return std::pair{tensor::from<float>(a, {elements}), tensor::from<int64_t>({r, -r, 7}, {3})};
  };
  auto results = c.run([leaves, root](replica_context& ctx) {
    auto [a, b] = leaves(ctx.replica_id_in_sync_group());
    return ctx.broadcast(nest::list({nest(a), nest(b)}), root);
  });
  auto [want_a, want_b] = leaves(root);
  for (auto& f : results) {
    auto got = f.get();
    for (const auto& v : got.values()) {
      EXPECT_EQ(v[0].as_tensor(), want_a);
      EXPECT_EQ(v[1].as_tensor(), want_b);
    }
  }
  // The group goes on: a small all-reduce after it.
  for (auto& f : c.run([](replica_context& ctx) { return nest(ctx.all_reduce("SUM", row(1))); }))
    EXPECT_EQ(f.get()[0].as_tensor().data<float>()[0], static_cast<float>(workers * replicas));
}

// With the 24 bytes of the other leaf: 16 000 float32 (64 024 B) and fewer are fused; 16 384
// (65 560 B, just over 64 KiB) and 100 000 take the broadcast algorithm.
INSTANTIATE_TEST_SUITE_P(
    Sizes, CrossWorkerBroadcastTest,
    ::testing::Values(std::tuple{2, 1, 1, int64_t{3}}, std::tuple{2, 2, 3, int64_t{16000}},
                      std::tuple{3, 1, 0, int64_t{16384}}, std::tuple{3, 2, 2, int64_t{0}},
                      std::tuple{3, 2, 5, int64_t{100000}}, std::tuple{4, 1, 2, int64_t{7}}));

TEST(CrossWorkerTest, ALoneReplicasLargeAllReduceReadsItsInputInPlaceAndLeavesItUnchanged) {
  // One replica per worker: above 64 KiB the ring reads the replica's own tensor (no copy first)
  // and writes the result to a tensor of its own. The caller's tensor keeps its values.
  constexpr int64_t n = 100003;
  cluster c(2, 1);
  std::vector<tensor> inputs;
  for (int w = 0; w < 2; ++w) {
    std::vector<float> v(static_cast<size_t>(n));
    for (size_t k = 0; k < v.size(); ++k)
      v[k] = static_cast<float>(k % 1000) + static_cast<float>(w);
    inputs.push_back(tensor::from<float>(v, {n}));
  }
  const auto before = std::vector<tensor>{inputs[0].clone(), inputs[1].clone()};
  for (const char* op : {"SUM", "MEAN", "MAX"}) {
    SCOPED_TRACE(op);
    std::vector<future<per_replica<nest>>> results;
    for (int w = 0; w < 2; ++w)
      results.push_back(c.workers[static_cast<size_t>(w)]->submit(
          [x = inputs[static_cast<size_t>(w)], op](replica_context& ctx) {
            return nest(ctx.all_reduce(op, x));
          }));
    for (auto& f : results) {
      auto got = f.get()[0].as_tensor();
      ASSERT_EQ(got.shape(), (shape_t{n}));
      const auto* p = got.data<float>();
      for (int64_t k : {int64_t{0}, int64_t{1}, n / 2, n - 1}) {
        const float base = static_cast<float>(k % 1000);
        const float want = std::string{op} == "SUM"    ? 2 * base + 1
                           : std::string{op} == "MEAN" ? base + 0.5f
                                                       : base + 1;
        EXPECT_EQ(p[k], want) << "element " << k;
      }
    }
    EXPECT_EQ(inputs[0], before[0]);
    EXPECT_EQ(inputs[1], before[1]);
  }
  // An integer MEAN widens to float64 first (a partial of its own), as before.
  std::vector<future<per_replica<nest>>> results;
  for (int w = 0; w < 2; ++w)
    results.push_back(c.workers[static_cast<size_t>(w)]->submit([w](replica_context& ctx) {
      return nest(ctx.all_reduce(
          "MEAN", tensor::from<int32_t>(std::vector<int32_t>(20000, w + 1), {20000})));
    }));
  for (auto& f : results) {
    auto got = f.get()[0].as_tensor();
    EXPECT_EQ(got.dtype(), dtype::float64);
    EXPECT_EQ(got.data<double>()[19999], 1.5);
  }
}

TEST(CrossWorkerTest, HostReduceAndGatherSpanWorkers) {
  cluster c(2, 1);
  std::vector<future<nest>> sums;
  std::vector<future<nest>> means;
  std::vector<future<nest>> gathers;
  for (int w = 0; w < 2; ++w) {
    // Worker w contributes w + 1 rows of value w + 1.
    std::vector<float> v(static_cast<size_t>(w + 1), static_cast<float>(w + 1));
    auto t = tensor::from<float>(v, {w + 1});
    sums.push_back(c.workers[static_cast<size_t>(w)]->reduce(reduce_op::sum, {nest(t)}, 0));
    means.push_back(c.workers[static_cast<size_t>(w)]->reduce(reduce_op::mean, {nest(t)}, 0));
    gathers.push_back(c.workers[static_cast<size_t>(w)]->gather({nest(t)}, 0));
  }
  for (int w = 0; w < 2; ++w) {
    EXPECT_EQ(sums[static_cast<size_t>(w)].get().as_tensor(), tensor::scalar<float>(5.0f));
    // (1 + 2 + 2) / 3 elements: the true count, not the mean of the workers' means.
    EXPECT_EQ(means[static_cast<size_t>(w)].get().as_tensor(), tensor::scalar<float>(5.0f / 3));
    EXPECT_EQ(gathers[static_cast<size_t>(w)].get().as_tensor(),
              tensor::from<float>({1, 2, 2}, {3}));
  }
}

TEST(CrossWorkerTest, ShapesThatDifferBetweenWorkersFailEveryWorkerAndTheGroupGoesOn) {
  cluster c(2, 2);
  auto results = c.run([](replica_context& ctx) {
    auto n = ctx.replica_id_in_sync_group() >= 2 ? 3 : 2;
    return nest(ctx.all_reduce("SUM", tensor::zeros(dtype::float32, {n})));
  });
  for (auto& f : results) {
    auto message = message_of(f);
    EXPECT_NE(message.find("collective mismatch between workers"), std::string::npos) << message;
    EXPECT_NE(message.find("float32[3]"), std::string::npos) << message;
  }
  // Every message of the call was received (the descriptors, and the data of a fused call with
  // them): the next step works.
  for (auto& f : c.run([](replica_context& ctx) { return nest(ctx.all_reduce("SUM", row(1))); }))
    EXPECT_EQ(f.get()[0].as_tensor(), tensor::from<float>({4, 4}, {2}));
}

/// One field of a call's signature that the last worker gets wrong.
struct mismatch_case {
  const char* name;
  /// The call every replica makes; `odd` on the replicas of the last worker.
  std::function<nest(replica_context&, bool odd)> call;
  /// Words every worker's error must contain (both sides of the disagreement).
  std::vector<std::string> words;
};

std::ostream& operator<<(std::ostream& out, const mismatch_case& c) {
  return out << c.name;
}

std::vector<mismatch_case> mismatch_cases() {
  auto filled = [](dtype t, int64_t n) {
    return tensor::zeros(t, {n});
  };
  return {
      {"Kind",
       [=](replica_context& ctx, bool odd) {
         auto x = filled(dtype::float32, 2);
         return odd ? nest(ctx.broadcast(x, 0)) : nest(ctx.all_reduce("SUM", x));
       },
       {"all_reduce(SUM)", "broadcast(root=0)"}},
      {"Op",
       [=](replica_context& ctx, bool odd) {
         return nest(ctx.all_reduce(odd ? "MAX" : "SUM", filled(dtype::float32, 2)));
       },
       {"all_reduce(SUM)", "all_reduce(MAX)"}},
      {"Root",
       [=](replica_context& ctx, bool odd) {
         return nest(ctx.broadcast(filled(dtype::float32, 2), odd ? 1 : 0));
       },
       {"broadcast(root=0)", "broadcast(root=1)"}},
      {"Axis",
       [=](replica_context& ctx, bool odd) {
         return nest(ctx.all_gather(tensor::zeros(dtype::float32, {2, 2}), odd ? 1 : 0));
       },
       {"all_gather(axis=0)", "all_gather(axis=1)"}},
      {"Dtype",
       [=](replica_context& ctx, bool odd) {
         return nest(ctx.all_reduce("SUM", filled(odd ? dtype::float64 : dtype::float32, 2)));
       },
       {"float32[2]", "float64[2]"}},
      {"Shape",
       [=](replica_context& ctx, bool odd) {
         return nest(ctx.all_reduce("SUM", filled(dtype::float32, odd ? 3 : 2)));
       },
       {"float32[2]", "float32[3]"}},
      // 64 B against 80 000 B: one side's data would travel with its descriptor (fused), the
      // other's after it.
      {"ShapeAcrossTheFusedSize",
       [=](replica_context& ctx, bool odd) {
         return nest(ctx.all_reduce("SUM", filled(dtype::float32, odd ? 20000 : 16)));
       },
       {"float32[16]", "float32[20000]"}},
      {"Structure",
       [=](replica_context& ctx, bool odd) {
         auto x = filled(dtype::float32, 2);
         return ctx.all_reduce("SUM", odd ? nest::list({x, x}) : nest::list({x}));
       },
       {"[T]", "[T, T]"}},
      // A tensor (a lone replica's takes its own way to the exchange) against a list of one.
      {"TensorAgainstAList",
       [=](replica_context& ctx, bool odd) {
         auto x = filled(dtype::float32, 2);
         return odd ? ctx.all_reduce("SUM", nest::list({x})) : nest(ctx.all_reduce("SUM", x));
       },
       {"of T with", "of [T] with"}},
  };
}

/// Workers, replicas per worker, and the field the last worker gets wrong.
class CrossWorkerMismatchTest
    : public ::testing::TestWithParam<std::tuple<int, int, mismatch_case>> {};

TEST_P(CrossWorkerMismatchTest, FailsEveryWorkerNamingBothSidesAndTheGroupGoesOn) {
  auto [workers, replicas, c] = GetParam();
  cluster group(workers, replicas);
  const int odd_from = (workers - 1) * replicas; // the last worker's first replica id
  auto call = c.call;
  auto results = group.run([call, odd_from](replica_context& ctx) {
    return call(ctx, ctx.replica_id_in_sync_group() >= odd_from);
  });
  for (size_t w = 0; w < results.size(); ++w) {
    std::string message;
    errc code = errc::none;
    try {
      results[w].get();
    } catch (const error& e) {
      code = e.code();
      message = e.what();
    }
    EXPECT_EQ(code, errc::collective_mismatch) << "worker " << w << ": " << message;
    EXPECT_NE(message.find("collective mismatch between workers"), std::string::npos) << message;
    for (const auto& word : c.words)
      EXPECT_NE(message.find(word), std::string::npos)
          << "worker " << w << ": '" << word << "' missing from: " << message;
  }
  // The call failed cleanly everywhere: the next step gives every worker the right result.
  for (auto& f :
       group.run([](replica_context& ctx) { return nest(ctx.all_reduce("SUM", row(1))); }))
    EXPECT_EQ(f.get()[0].as_tensor(), tensor::from<float>({static_cast<float>(workers * replicas),
                                                           static_cast<float>(workers * replicas)},
                                                          {2}));
}

INSTANTIATE_TEST_SUITE_P(Fields, CrossWorkerMismatchTest,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Values(1, 2),
                                            ::testing::ValuesIn(mismatch_cases())),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "Workers" +
                                  std::to_string(std::get<1>(info.param)) + "Replicas" +
                                  std::get<2>(info.param).name;
                         });

TEST(CrossWorkerTest, AFailureOnOneWorkerAbortsTheCallOnTheOthersAtOnce) {
  // A replica of worker 1 finishes without the collective its peers make: worker 1 fails the
  // call locally and tells worker 0, which fails with that reason long before its deadline.
  cluster c(2, 2, 60s);
  auto start = std::chrono::steady_clock::now();
  auto results = c.run([](replica_context& ctx) {
    if (ctx.replica_id_in_sync_group() == 3)
      return nest(row(0));
    return nest(ctx.all_reduce("SUM", row(1)));
  });
  EXPECT_EQ(code_of(results[1]), errc::collective_aborted);
  auto message = message_of(results[0]);
  EXPECT_NE(message.find("failed on worker 1"), std::string::npos) << message;
  EXPECT_NE(message.find("replica 3"), std::string::npos) << message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, consort::test::scaled(30s));
}

TEST(CrossWorkerTest, ABadArgumentOfALoneReplicaFailsItAndAbortsTheCallOnTheOthersAtOnce) {
  // One replica per worker: the call runs on the replica's thread. Worker 1's broadcast names a
  // root that does not exist; it fails there with invalid_argument and worker 0 learns why.
  cluster c(2, 1, 60s);
  auto start = std::chrono::steady_clock::now();
  auto results = c.run([](replica_context& ctx) {
    return nest(ctx.broadcast(row(1), ctx.replica_id_in_sync_group() == 1 ? 5 : 0));
  });
  auto outcome = [](future<per_replica<nest>>& f) -> std::pair<errc, std::string> {
    try {
      f.get();
    } catch (const error& e) {
      return {e.code(), e.what()};
    }
    return {errc::none, {}};
  };
  auto [their_code, theirs] = outcome(results[1]);
  EXPECT_EQ(their_code, errc::invalid_argument) << theirs;
  EXPECT_NE(theirs.find("root replica 5 is out of range"), std::string::npos) << theirs;
  auto [my_code, mine] = outcome(results[0]);
  EXPECT_EQ(my_code, errc::collective_aborted) << mine;
  EXPECT_NE(mine.find("failed on worker 1"), std::string::npos) << mine;
  EXPECT_NE(mine.find("root replica 5 is out of range"), std::string::npos) << mine;
  EXPECT_LT(std::chrono::steady_clock::now() - start, consort::test::scaled(30s));
  // Nothing was left half-done: the group goes on.
  for (auto& f : c.run([](replica_context& ctx) { return nest(ctx.all_reduce("SUM", row(1))); }))
    EXPECT_EQ(f.get()[0].as_tensor(), tensor::from<float>({2, 2}, {2}));
}

// A worker that never calls: tests/testing/cluster_test.cpp, on simulated time.

TEST(CrossWorkerTest, ALostPeerFailsPendingAndLaterCallsWithPeerLost) {
  cluster c(2, 1);
  // Worker 0 waits in an all-reduce that worker 1 never joins; membership reports worker 1 lost.
  auto f = c.workers[0]->submit(
      [](replica_context& ctx) { return nest(ctx.all_reduce("SUM", row(1))); });
  c.cross[0]->abort("lost worker:1 (rank 1): connection closed without leave");
  auto message = message_of(f);
  EXPECT_NE(message.find("worker:1"), std::string::npos) << message;
  auto later = c.workers[0]->submit(
      [](replica_context& ctx) { return nest(ctx.all_reduce("SUM", row(1))); });
  EXPECT_EQ(code_of(later), errc::peer_lost);
  auto reduced = c.workers[0]->reduce(reduce_op::sum, {nest(row(1))}, std::nullopt);
  try {
    reduced.get();
    ADD_FAILURE() << "a reduce across a broken group succeeded";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::peer_lost);
  }
}

TEST(CrossWorkerTest, ShutdownWhileAnotherWorkerWaitsFailsItsCallAndReturns) {
  cluster c(2, 1);
  auto f = c.workers[0]->submit(
      [](replica_context& ctx) { return nest(ctx.all_reduce("SUM", row(1))); });
  c.workers[0]->shutdown();
  auto code = code_of(f);
  EXPECT_TRUE(code == errc::shutdown || code == errc::peer_lost) << to_string(code);
}

// The last replica to arrive runs a lane's job itself when the lane is idle, and the lane keeps
// its order: a job queued before runs first, one posted meanwhile waits for it.
TEST(CrossWorkerTest, RunOrPostRunsOnTheCallerWhenTheLaneIsIdleAndKeepsTheLanesOrder) {
  auto group = transport::local::make_group(2);
  transport::communicator cross(group[0], 1);
  const auto step = transport::communicator::lane::step;
  std::mutex mu;
  std::vector<std::string> order;
  auto record = [&](std::string what) {
    std::lock_guard<std::mutex> guard{mu};
    order.push_back(std::move(what));
  };
  // Idle: inline, on this thread.
  auto caller = std::this_thread::get_id();
  std::thread::id ran_on;
  cross.run_or_post(step, [&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, caller);
  // Busy with a queued job: run_or_post queues behind it and returns at once.
  std::promise<void> release;
  auto gate = release.get_future().share();
  std::promise<void> first_started;
  cross.post(step, [&, gate] {
    first_started.set_value();
    gate.wait();
    record("first");
  });
  first_started.get_future().wait();
  std::promise<void> second_done;
  cross.run_or_post(step, [&] {
    record("second");
    second_done.set_value();
  });
  {
    std::lock_guard<std::mutex> guard{mu};
    EXPECT_TRUE(order.empty()) << "the second job ran before the first finished";
  }
  release.set_value();
  second_done.get_future().wait();
  // An inline job holds the lane: a job posted while it runs starts after it.
  std::promise<void> third_done;
  std::thread other;
  cross.run_or_post(step, [&] {
    other = std::thread([&] {
      cross.post(step, [&] {
        record("fourth");
        third_done.set_value();
      });
    });
    other.join(); // the post returned; the lane's thread must still wait for this job
    std::this_thread::yield();
    record("third");
  });
  third_done.get_future().wait();
  EXPECT_EQ(order, (std::vector<std::string>{"first", "second", "third", "fourth"}));
  (void)cross.stop();
  // Stopped: it runs at once, here (the job fails fast on an aborted group).
  bool ran = false;
  cross.run_or_post(step, [&] { ran = true; });
  EXPECT_TRUE(ran);
}

namespace {

/// A call whose data phase is the caller's (as NCCL's is for GPU replicas): worker 0's bytes
/// travel to every worker through `share`, and the result reports what the phase saw.
transport::group_call own_data_call(uint8_t flags, std::string signature) {
  transport::group_call call;
  call.what = "all_reduce(SUM) #0 of step 1";
  call.step = 1;
  call.seq = 0;
  call.signature = std::move(signature);
  call.timeout = 5s;
  call.flags = flags;
  return call;
}

/// Runs the call `make_call(w)` makes on each of two workers of a local group at once (worker 1
/// on a thread of its own); returns both results, worker 0's first.
template <class MakeCall>
auto run_on_two_workers(MakeCall make_call) {
  auto group = transport::local::make_group(2);
  std::vector<std::shared_ptr<transport::communicator>> cross;
  for (int w = 0; w < 2; ++w)
    cross.push_back(std::make_shared<transport::communicator>(group[static_cast<size_t>(w)], 1));
  auto run_on = [&](int w) {
    auto call = make_call(w);
    return cross[static_cast<size_t>(w)]->run(transport::communicator::lane::step, call);
  };
  auto other = std::async(std::launch::async, run_on, 1);
  auto mine = run_on(0);
  auto theirs = other.get();
  for (auto& c : cross)
    c->stop();
  return std::make_pair(std::move(mine), std::move(theirs));
}

} // namespace

TEST(CrossWorkerTest, AnOwnDataPhaseSeesEveryWorkersFlagsAndWorkerZerosSharedBytes) {
  auto [mine, theirs] = run_on_two_workers([](int w) {
    auto call = own_data_call(w == 1 ? 1 : 0, "all_reduce(SUM) of [T] on NCCL");
    call.data_phase = [w](const transport::group_call::share_fn& share,
                          std::chrono::milliseconds left,
                          uint8_t all_flags) -> caf::expected<std::vector<tensor>> {
      EXPECT_GT(left.count(), 0);
      std::vector<uint8_t> bytes(16, 0);
      if (w == 0)
        for (size_t i = 0; i < bytes.size(); ++i)
          bytes[i] = static_cast<uint8_t>(100 + i);
      if (auto err = share(bytes))
        return err;
      return std::vector<tensor>{tensor::from<uint8_t>(bytes), tensor::scalar<int32_t>(all_flags)};
    };
    return call;
  });
  ASSERT_TRUE(mine) << caf::to_string(mine.error());
  ASSERT_TRUE(theirs) << caf::to_string(theirs.error());
  std::vector<uint8_t> expected(16);
  for (size_t i = 0; i < expected.size(); ++i)
    expected[i] = static_cast<uint8_t>(100 + i);
  for (const auto* out : {&*mine, &*theirs}) {
    ASSERT_EQ(out->size(), 2u);
    EXPECT_EQ((*out)[0].to_vector<uint8_t>(), expected);
    EXPECT_EQ((*out)[1].item<int32_t>(), 1); // worker 1's flag reached both
  }
}

// The flight recorder's stragglers: every worker learns from the descriptors who entered a call
// last and by how much, on the chief's clock (each worker's system clock plus its offset).
TEST(CrossWorkerTest, EveryWorkerLearnsWhoEnteredACallLastOnTheChiefsClock) {
  // Worker 1's clock is 5 s behind the chief's: moved by its offset, it entered 5 s after worker
  // 0, whatever the order on this host.
  constexpr int64_t offset = 5'000'000'000;
  std::vector<transport::call_lateness> late(2);
  auto [mine, theirs] = run_on_two_workers([&late](int w) {
    auto call = own_data_call(0, "all_reduce(SUM) of [T] on NCCL");
    call.lateness = &late[static_cast<size_t>(w)];
    call.clock_offset_ns = w == 1 ? offset : 0;
    call.data_phase = [](const transport::group_call::share_fn&, std::chrono::milliseconds,
                         uint8_t) -> caf::expected<std::vector<tensor>> {
      return std::vector<tensor>{};
    };
    return call;
  });
  ASSERT_TRUE(mine) << caf::to_string(mine.error());
  ASSERT_TRUE(theirs) << caf::to_string(theirs.error());
  for (const auto& l : late) {
    EXPECT_EQ(l.last.load(), 1);
    // 5 s, less however much later worker 0 really entered (well under a second).
    EXPECT_GT(l.margin_ns.load(), offset - 1'000'000'000);
    EXPECT_LE(l.margin_ns.load(), offset + 1'000'000'000);
  }
}

TEST(CrossWorkerTest, WorkersThatWouldMoveTheDataDifferentlyFailWithAMismatch) {
  bool phase_ran = false;
  auto [mine, theirs] = run_on_two_workers([&phase_ran](int w) {
    // Worker 0's replicas are on GPUs (NCCL), worker 1's are not (TCP): never a hang.
    auto call =
        own_data_call(0, w == 0 ? "all_reduce(SUM) of [T] on NCCL" : "all_reduce(SUM) of [T]");
    if (w == 0)
      call.data_phase = [&](const transport::group_call::share_fn&, std::chrono::milliseconds,
                            uint8_t) -> caf::expected<std::vector<tensor>> {
        phase_ran = true;
        return std::vector<tensor>{};
      };
    return call;
  });
  for (auto* out : {&mine, &theirs}) {
    ASSERT_FALSE(*out);
    auto e = to_consort_error(out->error(), "");
    EXPECT_EQ(e.code(), errc::collective_mismatch) << e.what();
    EXPECT_NE(std::string{e.what()}.find("on NCCL"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(phase_ran);
}
