// A multi-worker job for the integration tests: run as N processes (tools/consort-launch, or by
// tests/multiworker/*.sh with TF_CONFIG), it checks multi_worker_mirrored_strategy against a
// single-process reference and exits 0 when every check passed.
//
//   mw_job collectives                       every collective and reduce vs. a mirrored reference
//   mw_job half                              float16 and bfloat16: every collective and reduce of
//                                            exact values vs. the reference, and sums that only a
//                                            float32 accumulator gets right (3 replicas a worker)
//   mw_job partial_batch                     range(14).batch(8) through distribute_dataset: each
//                                            replica's rows in both steps against TF's split
//                                            (2 x 1, 2 x 2, 3 x 1, 3 x 2), printed per replica
//   mw_job kill VICTIM_RANK                  VICTIM dies (SIGKILL) entering an all-reduce; the
//                                            survivors must fail with peer_lost within the bound
//   mw_job partition VICTIM_RANK             VICTIM takes its link down (in a network namespace):
//                                            every worker fails with peer_lost within the bound
//   mw_job join-fails TIMEOUT_MS TEXT        constructing the strategy must fail with an error
//                                            whose message contains TEXT (missing task, refusal)
//   mw_job leave-early LEAVER                after 3 all-reduces LEAVER shuts its strategy down;
//                                            the others' 4th all-reduce, which it never starts,
//                                            must fail at once with peer_left naming it
//   mw_job clean-end ITERS ELEMENTS          ITERS all-reduces of ELEMENTS float32 values, each
//                                            result checked, then return from main: the last
//                                            all-reduce must reach every worker (issue: a worker
//                                            that left first dropped its peers' last bytes)
//
// Values are small integers (stored as floats where needed), so sums are exact in any order and
// results can be compared bit for bit.

#include <consort/consort.hpp>

#include "support/time_scale.hpp"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

using namespace consort;
using clock_type = std::chrono::steady_clock;

namespace {

int failures = 0;
int checks = 0;
std::string me = "worker ?";

void check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::cout << me << ": FAILED " << what << std::endl;
  }
}

void check_equal(const tensor& got, const tensor& want, const std::string& what) {
  bool ok = got.dtype() == want.dtype() && got.shape() == want.shape() && got == want;
  if (!ok)
    std::cout << me << ": " << what << ": got " << to_string(got.dtype()) << to_string(got.shape())
              << ' ' << got.to_string(16) << ", want " << to_string(want.dtype())
              << to_string(want.shape()) << ' ' << want.to_string(16) << std::endl;
  check(ok, what);
}

void check_equal(const nest& got, const nest& want, const std::string& what) {
  auto a = flatten(got);
  auto b = flatten(want);
  check(got.structure_string() == want.structure_string(), what + ": structure");
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    check_equal(a[i], b[i], what + ", leaf " + std::to_string(i));
}

/// Replica r's [2, 3] float32 value: r * 10 + k.
tensor dense(int r) {
  std::vector<float> v(6);
  for (int k = 0; k < 6; ++k)
    v[static_cast<size_t>(k)] = static_cast<float>(r * 10 + k);
  return tensor::from<float>(v, {2, 3});
}

/// Replica r's int32 [3] value.
tensor ints(int r) {
  return tensor::from<int32_t>({r, 2 * r + 1, 7 - r}, {3});
}

/// Replica r's ragged value: `rows` = r % 3 rows of 2 (replica 0 has none).
tensor ragged(int r, bool transpose = false) {
  int rows = r % 3;
  std::vector<float> v(static_cast<size_t>(rows * 2));
  for (size_t k = 0; k < v.size(); ++k)
    v[k] = static_cast<float>(r * 100 + static_cast<int>(k));
  if (transpose)
    return tensor::from<float>(v, {2, rows});
  return tensor::from<float>(v, {rows, 2});
}

/// Runs `fn` on the multi-worker strategy and on the reference, and compares replica by replica
/// (the reference's replica `id` for the multi-worker replica `id`).
template <class F>
void compare_run(strategy& mw, strategy& ref, const std::string& what, F fn) {
  try {
    auto got = mw.run(fn);
    auto want = ref.run(fn);
    auto ids = mw.local_replica_ids();
    for (size_t i = 0; i < ids.size(); ++i)
      check_equal(got[i], want[static_cast<size_t>(ids[i])],
                  what + " on replica " + std::to_string(ids[i]));
  } catch (const std::exception& e) {
    check(false, what + " threw: " + e.what());
  }
}

std::vector<std::string> cpu_devices(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i)
    out.push_back("CPU:" + std::to_string(i));
  return out;
}

int collectives() {
  multi_worker_mirrored_strategy mw;
  auto W = mw.num_workers();
  auto D = static_cast<int>(mw.num_local_replicas());
  auto R = mw.num_replicas_in_sync();
  me = "worker " + std::to_string(mw.worker_rank());
  {
    std::string devices;
    for (const auto& d : mw.worker_devices())
      devices += (devices.empty() ? "" : ",") + d;
    std::cout << me << ": devices " << devices << std::endl;
  }
  check(R == W * D, "num_replicas_in_sync == workers x devices");
  check(std::string{mw.name()} == "MultiWorkerMirroredStrategy", "name");
  mirrored_strategy ref(cpu_devices(R));

  // Replica ids, as the replicas see them.
  {
    auto ids = mw.run([](replica_context& ctx) {
      return tensor::from<int32_t>({ctx.replica_id_in_sync_group(), ctx.num_replicas_in_sync()},
                                   {2});
    });
    for (int i = 0; i < D; ++i)
      check_equal(ids[static_cast<size_t>(i)],
                  tensor::from<int32_t>({mw.worker_rank() * D + i, R}, {2}),
                  "replica id of local replica " + std::to_string(i));
  }
  for (auto op : {"SUM", "MEAN", "MIN", "MAX"})
    compare_run(mw, ref, std::string{"all_reduce "} + op, [op](replica_context& ctx) {
      auto x = dense(ctx.replica_id_in_sync_group() % 3 + 1);
      return ctx.all_reduce(op, x);
    });
  compare_run(mw, ref, "all_reduce PROD", [](replica_context& ctx) {
    auto r = static_cast<float>(ctx.replica_id_in_sync_group() % 2 + 1);
    return ctx.all_reduce("PROD", tensor::from<float>({r, -r, 1.0f}, {3}));
  });
  compare_run(mw, ref, "all_reduce MEAN of int32 (float64 result)", [](replica_context& ctx) {
    return ctx.all_reduce("MEAN", ints(ctx.replica_id_in_sync_group()));
  });
  compare_run(mw, ref, "all_reduce SUM of a nest", [](replica_context& ctx) {
    auto r = ctx.replica_id_in_sync_group();
    return ctx.all_reduce("SUM", nest::dict({{"a", dense(r)}, {"b", nest::list({ints(r)})}}));
  });
  compare_run(mw, ref, "all_reduce SUM of 1M floats (ring)", [](replica_context& ctx) {
    std::vector<float> v(1 << 20);
    for (size_t k = 0; k < v.size(); ++k)
      v[k] = static_cast<float>((static_cast<int>(k) + ctx.replica_id_in_sync_group()) % 17);
    return ctx.all_reduce("SUM", tensor::from<float>(v));
  });
  compare_run(mw, ref, "all_gather axis 0 (ragged, one empty)", [](replica_context& ctx) {
    return ctx.all_gather(ragged(ctx.replica_id_in_sync_group()), 0);
  });
  compare_run(mw, ref, "all_gather axis 1 (ragged)", [](replica_context& ctx) {
    return ctx.all_gather(ragged(ctx.replica_id_in_sync_group(), true), 1);
  });
  for (int root : {0, R - 1})
    compare_run(mw, ref, "broadcast from replica " + std::to_string(root),
                [root](replica_context& ctx) {
                  return ctx.broadcast(dense(ctx.replica_id_in_sync_group()), root);
                });
  compare_run(mw, ref, "three all_reduces in one step", [](replica_context& ctx) {
    auto x = dense(ctx.replica_id_in_sync_group());
    for (int i = 0; i < 3; ++i)
      x = ctx.all_reduce("MAX", x);
    return x;
  });
  for (int i = 0; i < 20; ++i)
    compare_run(mw, ref, "step " + std::to_string(i), [i](replica_context& ctx) {
      return ctx.all_reduce("SUM", dense(ctx.replica_id_in_sync_group() + i));
    });

  // Strategy.reduce / gather of per-replica values: the same as the reference's over all replicas.
  auto mw_values = mw.distribute_values([](int id) { return ragged(id); });
  auto ref_values = ref.distribute_values([](int id) { return ragged(id); });
  auto mw_dense = mw.distribute_values([](int id) { return dense(id); });
  auto ref_dense = ref.distribute_values([](int id) { return dense(id); });
  auto mw_ints = mw.distribute_values([](int id) { return ints(id); });
  auto ref_ints = ref.distribute_values([](int id) { return ints(id); });
  try {
    for (auto op : {"SUM", "MEAN", "MAX"}) {
      check_equal(mw.reduce(op, mw_dense, std::nullopt), ref.reduce(op, ref_dense, std::nullopt),
                  std::string{"reduce "} + op + " axis=None");
      check_equal(mw.reduce(op, mw_dense, 0), ref.reduce(op, ref_dense, 0),
                  std::string{"reduce "} + op + " axis=0");
    }
    check_equal(mw.reduce("MEAN", mw_values, 0), ref.reduce("MEAN", ref_values, 0),
                "reduce MEAN axis=0 of ragged batches (true count, empty replica adds nothing)");
    check_equal(mw.reduce("MEAN", mw_ints, std::nullopt),
                ref.reduce("MEAN", ref_ints, std::nullopt), "reduce MEAN of int32 (float64)");
    check_equal(mw.reduce("SUM", mw_ints, 0), ref.reduce("SUM", ref_ints, 0),
                "reduce SUM axis=0 of int32");
    check_equal(mw.gather(mw_values, 0), ref.gather(ref_values, 0), "gather axis 0 (ragged)");
    check_equal(mw.reduce_async("SUM", mw_dense, std::nullopt).get(),
                ref.reduce("SUM", ref_dense, std::nullopt), "reduce_async SUM");
    // A plain value is one contribution per worker.
    auto plain = tensor::from<float>({static_cast<float>(mw.worker_rank() + 1), 1.0f}, {2});
    auto sum = static_cast<float>(W * (W + 1) / 2);
    check_equal(mw.reduce("SUM", plain, std::nullopt), tensor::from<float>({sum, float(W)}, {2}),
                "reduce SUM of a plain value sums across workers");
    check_equal(mw.reduce("MEAN", plain, std::nullopt),
                tensor::from<float>({sum / float(W), 1.0f}, {2}),
                "reduce MEAN of a plain value averages over workers");
  } catch (const std::exception& e) {
    check(false, std::string{"reduce/gather threw: "} + e.what());
  }

  // distribute_dataset: each global batch of n rows is cut into R parts of ceil(n / R) rows (TF's
  // legacy rebatch under data sharding), and replica (worker w, local i) takes part i * W + w.
  {
    std::vector<float> rows(2 * 13);
    for (size_t k = 0; k < rows.size(); ++k)
      rows[k] = static_cast<float>(k);
    const int64_t bs = R + 1;
    auto ds = dataset::from_tensor_slices(tensor::from<float>(rows, {13, 2})).batch(bs);
    auto mw_ds = mw.distribute_dataset(ds);
    check(mw_ds.cardinality() == ds.cardinality(), "distribute_dataset cardinality");
    for (int64_t b = 0; b < mw_ds.cardinality(); ++b) {
      auto got = mw_ds.get(b);
      const int64_t first = b * bs;
      const int64_t n = std::min(bs, ds.num_rows() - first);
      const int64_t per_part = (n + R - 1) / R;
      for (int i = 0; i < D; ++i) {
        const int64_t part = i * W + mw.worker_rank();
        const int64_t lo = std::min(n, part * per_part);
        const int64_t hi = std::min(n, lo + per_part);
        check_equal(got[static_cast<size_t>(i)], ds.rows(first + lo, first + hi),
                    "batch " + std::to_string(b) + " of local replica " + std::to_string(i));
      }
    }
  }

  // A collective that disagrees between workers fails on every worker, and the group still works
  // (with one worker there is no other to disagree with).
  if (W > 1) {
    bool mismatched = false;
    try {
      mw.run([W](replica_context& ctx) {
        auto n = ctx.replica_id_in_sync_group() / (ctx.num_replicas_in_sync() / W) == W - 1 ? 3 : 2;
        return ctx.all_reduce("SUM", tensor::zeros(dtype::float32, {n}));
      });
    } catch (const error& e) {
      mismatched = e.code() == errc::collective_mismatch || e.code() == errc::collective_aborted;
      if (!mismatched)
        std::cout << me << ": mismatch gave " << e.what() << std::endl;
    }
    check(mismatched, "shapes that differ between workers fail every worker");
    compare_run(mw, ref, "all_reduce after a mismatch", [](replica_context& ctx) {
      return ctx.all_reduce("SUM", dense(ctx.replica_id_in_sync_group()));
    });
  }
  std::cout << me << ": " << checks - failures << " of " << checks << " checks passed" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// Replica r's [2, 3] value of the 16-bit float type H: (r % 4) * 4 + k, small enough that every
/// sum of up to 6 replicas (12 rows along axis 0) stays an integer below 256, exact in bfloat16's
/// 8 significant bits, so that the per-hop rounding across workers never shows.
template <class H>
tensor dense_half(int r) {
  std::vector<H> v(6);
  for (int k = 0; k < 6; ++k)
    v[static_cast<size_t>(k)] = H(static_cast<float>((r % 4) * 4 + k));
  return tensor::from<H>(v, {2, 3});
}

/// One 16-bit float type: exact values against the single-process reference, then values whose
/// sum a 16-bit accumulator gets wrong. Each worker's local replica 0 holds `base`, its others 1:
/// with 3 replicas a worker, each worker's partial is base + 2 (exact), which a 16-bit per-step
/// fold would round back to base; the partials travel in H and are summed across workers in
/// float32, each hop rounded once (exact here), so the result is the float32 sum rounded once.
template <class H>
void half_checks(multi_worker_mirrored_strategy& mw, strategy& ref, float base) {
  const std::string type = to_string(dtype_of<H>);
  auto W = mw.num_workers();
  auto D = static_cast<int>(mw.num_local_replicas());
  for (auto op : {"SUM", "MEAN", "MIN", "MAX"})
    compare_run(mw, ref, type + " all_reduce " + op, [op](replica_context& ctx) {
      return ctx.all_reduce(op, dense_half<H>(ctx.replica_id_in_sync_group() + 1));
    });
  compare_run(mw, ref, type + " all_gather axis 1", [](replica_context& ctx) {
    return ctx.all_gather(dense_half<H>(ctx.replica_id_in_sync_group()), 1);
  });
  compare_run(mw, ref, type + " broadcast from the last replica", [](replica_context& ctx) {
    return ctx.broadcast(dense_half<H>(ctx.replica_id_in_sync_group()),
                         ctx.num_replicas_in_sync() - 1);
  });
  try {
    auto mw_dense = mw.distribute_values([](int id) { return dense_half<H>(id); });
    auto ref_dense = ref.distribute_values([](int id) { return dense_half<H>(id); });
    for (auto op : {"SUM", "MEAN", "MAX"}) {
      check_equal(mw.reduce(op, mw_dense, std::nullopt), ref.reduce(op, ref_dense, std::nullopt),
                  type + " reduce " + op + " axis=None");
      check_equal(mw.reduce(op, mw_dense, 0), ref.reduce(op, ref_dense, 0),
                  type + " reduce " + op + " axis=0");
    }
  } catch (const std::exception& e) {
    check(false, type + " reduce threw: " + e.what());
  }
  if (D != 3)
    return;
  // float32 accumulation: the float32 sum over every replica, rounded once to H.
  const float total = static_cast<float>(W) * (base + static_cast<float>(D - 1));
  const float want_sum = static_cast<float>(H(total));
  const float want_mean = static_cast<float>(H(total * (1.0f / static_cast<float>(W * D))));
  const float naive = static_cast<float>(H(base * static_cast<float>(W)));
  check(want_sum != naive, type + ": the values tell float32 from 16-bit accumulation");
  try {
    auto got = mw.run([base](replica_context& ctx) {
      auto local = ctx.replica_id_in_sync_group() % 3;
      auto x = tensor::from<H>({H(local == 0 ? base : 1.0f)}, {1});
      return nest::list(
          {ctx.all_reduce("SUM", x), ctx.all_reduce("MEAN", x), ctx.all_reduce("MAX", x)});
    });
    for (int i = 0; i < D; ++i) {
      const auto& out = got[static_cast<size_t>(i)];
      const tensor sum = out[0].as_tensor();
      const tensor mean = out[1].as_tensor();
      check(sum.dtype() == dtype_of<H> && mean.dtype() == dtype_of<H>,
            type + " SUM and MEAN keep the dtype");
      check(sum.item<float>() == want_sum, type +
                                               " all_reduce SUM is the float32 sum rounded "
                                               "once: got " +
                                               std::to_string(sum.item<float>()) + ", want " +
                                               std::to_string(want_sum));
      check(mean.item<float>() == want_mean, type + " all_reduce MEAN: got " +
                                                 std::to_string(mean.item<float>()) + ", want " +
                                                 std::to_string(want_mean));
      const tensor max = out[2].as_tensor();
      check(max.item<float>() == base, type + " all_reduce MAX");
    }
    auto values = mw.distribute_values(
        [base](int id) { return tensor::from<H>({H(id % 3 == 0 ? base : 1.0f)}, {1}); });
    const tensor sum = mw.reduce("SUM", values, std::nullopt);
    check(sum.dtype() == dtype_of<H> && sum.item<float>() == want_sum,
          type + " reduce SUM axis=None: got " + sum.to_string());
    const tensor mean = mw.reduce("MEAN", values, 0);
    check(mean.dtype() == dtype_of<H> && mean.item<float>() == want_mean,
          type + " reduce MEAN axis=0: got " + mean.to_string());
  } catch (const std::exception& e) {
    check(false, type + " float32 accumulation threw: " + e.what());
  }
}

int half() {
  multi_worker_mirrored_strategy mw;
  me = "worker " + std::to_string(mw.worker_rank());
  mirrored_strategy ref(cpu_devices(mw.num_replicas_in_sync()));
  half_checks<float16_t>(mw, ref, 2048.0f); // spacing 2 from 2048, 4 from 4096
  half_checks<bfloat16_t>(mw, ref, 256.0f); // spacing 2 from 256, 4 from 512
  // A worker whose replicas pass float16 where the others pass bfloat16 fails every worker.
  bool mismatched = false;
  try {
    mw.run([&mw](replica_context& ctx) {
      if (mw.worker_rank() == 0)
        return ctx.all_reduce("SUM", tensor::from<float16_t>({float16_t(1.0f)}));
      return ctx.all_reduce("SUM", tensor::from<bfloat16_t>({bfloat16_t(1.0f)}));
    });
  } catch (const error& e) {
    mismatched = e.code() == errc::collective_mismatch || e.code() == errc::collective_aborted;
    if (!mismatched)
      std::cout << me << ": mismatch gave " << e.what() << std::endl;
  }
  check(mismatched, "float16 on one worker and bfloat16 on another fail every worker");
  std::cout << me << ": " << checks - failures << " of " << checks << " checks passed" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// `kill`: the victim raises SIGKILL. `partition`: the victim (in a network namespace) takes its
/// interface down and carries on; nobody sees a connection close, so heartbeats must find it.
int loss_scenario(int victim, bool partition) {
  multi_worker_options opts;
  opts.heartbeat_interval = std::chrono::milliseconds(200);
  opts.peer_timeout = std::chrono::milliseconds(2000);
  multi_worker_mirrored_strategy mw({}, opts);
  me = "worker " + std::to_string(mw.worker_rank());
  auto rank = mw.worker_rank();
  for (int i = 0; i < 2; ++i)
    mw.run([](replica_context& ctx) { return ctx.all_reduce("SUM", dense(1)); });
  auto start = clock_type::now();
  try {
    // The victim may finish this all-reduce, enter the next one and die before the others have
    // finished this one (its part is in, theirs still travel): then they fail here, with the same
    // error and within the same bound.
    mw.run([](replica_context& ctx) { return ctx.all_reduce("SUM", dense(1)); });
    mw.run([rank, victim, partition](replica_context& ctx) {
      if (rank == victim && ctx.local_replica_index() == 0) {
        if (!partition) {
          std::cout << me << ": killing myself" << std::endl;
          std::raise(SIGKILL);
        }
        std::cout << me << ": cutting my network link" << std::endl;
        if (std::system("ip link set dev eth0 down") != 0)
          throw std::runtime_error("could not take eth0 down");
      }
      std::vector<float> v(1 << 18, 1.0f);
      return ctx.all_reduce("SUM", tensor::from<float>(v));
    });
    std::cout << me << ": the all-reduce succeeded despite the loss of worker " << victim
              << std::endl;
    return 1;
  } catch (const error& e) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - start);
    std::cout << me << ": " << to_string(e.code()) << " after " << ms.count() << " ms: " << e.what()
              << std::endl;
    bool ok = e.code() == errc::peer_lost &&
              ms < opts.peer_timeout + consort::test::scaled(std::chrono::seconds(3));
    // Later collectives fail at once with the same cause.
    try {
      mw.run([](replica_context& ctx) { return ctx.all_reduce("SUM", dense(1)); });
      ok = false;
    } catch (const error& later) {
      ok = ok && later.code() == errc::peer_lost;
    }
    return ok ? 0 : 1;
  }
}

int join_fails(int timeout_ms, const std::string& text) {
  multi_worker_options opts;
  opts.rendezvous_timeout = std::chrono::milliseconds(timeout_ms);
  auto start = clock_type::now();
  try {
    multi_worker_mirrored_strategy mw({}, opts);
    std::cout << "the strategy joined, but it should not have" << std::endl;
    return 1;
  } catch (const error& e) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - start);
    std::cout << "join failed after " << ms.count() << " ms: " << to_string(e.code()) << ": "
              << e.what() << std::endl;
    bool ok =
        std::string{e.what()}.find(text) != std::string::npos &&
        ms < std::chrono::milliseconds(timeout_ms) + consort::test::scaled(std::chrono::seconds(5));
    if (!ok)
      std::cout << "expected the message to contain \"" << text << "\"" << std::endl;
    return ok ? 0 : 1;
  }
}

int leave_early(int leaver) {
  multi_worker_mirrored_strategy mw;
  me = "worker " + std::to_string(mw.worker_rank());
  const int rank = mw.worker_rank();
  const int n = mw.num_replicas_in_sync();
  for (int i = 0; i < 3; ++i) {
    auto out = mw.run([](replica_context& ctx) { return ctx.all_reduce("SUM", dense(1)); });
    std::vector<float> want(6);
    for (int k = 0; k < 6; ++k)
      want[static_cast<size_t>(k)] = static_cast<float>(n * (10 + k)); // n replicas of dense(1)
    check_equal(out.values().front(), tensor::from<float>(want, {2, 3}),
                "all_reduce " + std::to_string(i));
  }
  if (rank == leaver) {
    mw.shutdown();
    std::cout << me << ": left after 3 all-reduces" << std::endl;
    return failures == 0 ? 0 : 1;
  }
  auto start = clock_type::now();
  try {
    mw.run([](replica_context& ctx) {
      std::vector<float> v(1 << 18, 1.0f);
      return ctx.all_reduce("SUM", tensor::from<float>(v));
    });
    std::cout << me << ": the all-reduce succeeded without worker " << leaver << std::endl;
    return 1;
  } catch (const error& e) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - start);
    std::cout << me << ": " << to_string(e.code()) << " after " << ms.count() << " ms: " << e.what()
              << std::endl;
    auto named = "rank " + std::to_string(leaver) + " left the group";
    bool ok = e.code() == errc::peer_left &&
              std::string{e.what()}.find(named) != std::string::npos &&
              ms < consort::test::scaled(std::chrono::milliseconds(4000));
    if (!ok)
      std::cout << me << ": expected peer_left naming \"" << named << "\" within 4 s" << std::endl;
    return ok && failures == 0 ? 0 : 1;
  }
}

int clean_end(int iters, long elements) {
  multi_worker_mirrored_strategy mw;
  me = "worker " + std::to_string(mw.worker_rank());
  const int n = mw.num_replicas_in_sync();
  for (int i = 0; i < iters; ++i) {
    // Replica r adds r + 1 + i % 3 in every element: small integers, exact in any order.
    auto out = mw.run([i, elements](replica_context& ctx) {
      std::vector<float> v(static_cast<size_t>(elements),
                           static_cast<float>(ctx.replica_id_in_sync_group() + 1 + i % 3));
      return ctx.all_reduce("SUM", tensor::from<float>(v));
    });
    const float want = static_cast<float>(n * (n + 1) / 2 + n * (i % 3));
    for (const auto& component : out.values()) {
      auto got = component.to_vector<float>();
      bool ok = got.size() == static_cast<size_t>(elements);
      for (float x : got)
        ok = ok && x == want;
      check(ok, "all_reduce " + std::to_string(i) + " of " + std::to_string(iters));
    }
  }
  std::cout << me << ": " << checks - failures << " of " << checks
            << " checks passed; leaving with the strategy's destructor" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// cross_device_ops() under MultiWorkerMirroredStrategy is TF's CollectiveAllReduce: reduce and
/// batch_reduce span every replica of every worker (issue 35, item 1), checked against
/// mirrored_strategy over as many replicas in one process (whose reduce is TF's
/// ReductionToOneDevice over the same values).
int cross_device_ops_scenario() {
  multi_worker_mirrored_strategy mw;
  const int D = static_cast<int>(mw.num_local_replicas());
  const int R = mw.num_replicas_in_sync();
  const int first = mw.worker_rank() * D;
  me = "worker " + std::to_string(mw.worker_rank());
  mirrored_strategy ref(cpu_devices(R));
  std::vector<tensor> mine, all;
  for (int r = 0; r < R; ++r) {
    all.push_back(dense(r));
    if (r >= first && r < first + D)
      mine.push_back(dense(r));
  }
  const per_replica<tensor> local(mine), global(all);
  const std::vector<std::string> destinations{"CPU:0", "CPU:1"};
  for (auto op : {"SUM", "MEAN", "MAX"}) {
    auto got = mw.cross_device_ops().reduce(op, local, destinations);
    auto want = ref.cross_device_ops().reduce(op, global, {"CPU:0"});
    check(got.size() == 2, std::string{"reduce "} + op + ": one component per destination");
    for (size_t i = 0; i < got.size(); ++i)
      check_equal(got[i], want[0], std::string{"reduce "} + op + " at " + destinations[i]);
  }
  // TF's example: every replica passes 1.0; SUM is the number of replicas in sync, not of this
  // worker's replicas.
  std::vector<tensor> ones(static_cast<size_t>(D), tensor::scalar<float>(1.0f));
  auto total = mw.cross_device_ops().reduce("SUM", per_replica<tensor>(ones), {"CPU:0"});
  check_equal(total[0], tensor::scalar<float>(static_cast<float>(R)), "reduce SUM of 1.0 each");
  // batch_reduce: each pair across the workers, in order.
  std::vector<tensor> shifted, shifted_all;
  for (const auto& t : mine)
    shifted.push_back(reduce_elementwise(reduce_op::sum, {t, t}));
  for (const auto& t : all)
    shifted_all.push_back(reduce_elementwise(reduce_op::sum, {t, t}));
  auto batch = mw.cross_device_ops().batch_reduce(
      "SUM", {{local, {"CPU:0"}}, {per_replica<tensor>(shifted), {"CPU:1"}}});
  check(batch.size() == 2, "batch_reduce: one result per pair");
  check_equal(batch[0][0], ref.cross_device_ops().reduce("SUM", global, {"CPU:0"})[0],
              "batch_reduce pair 0");
  check_equal(batch[1][0],
              ref.cross_device_ops().reduce("SUM", per_replica<tensor>(shifted_all), {"CPU:0"})[0],
              "batch_reduce pair 1");
  // A value without one component per local replica is refused before any worker waits.
  bool refused = false;
  try {
    std::vector<tensor> extra(mine);
    extra.push_back(dense(0));
    mw.cross_device_ops().reduce("SUM", per_replica<tensor>(extra), {"CPU:0"});
  } catch (const error& e) {
    refused = e.code() == errc::invalid_argument &&
              std::string{e.what()}.find("one component per local replica") != std::string::npos;
  }
  check(refused, "a value with too many components is refused");
  // Still in step afterwards: one more reduce on every worker.
  auto again = mw.cross_device_ops().reduce("SUM", local, {"CPU:0"});
  check_equal(again[0], ref.cross_device_ops().reduce("SUM", global, {"CPU:0"})[0],
              "reduce after a refused call");
  std::cout << me << ": " << checks - failures << " of " << checks << " checks passed" << std::endl;
  return failures == 0 ? 0 : 1;
}

/// "[8, 9, 10]".
std::string list_string(const std::vector<int64_t>& values) {
  std::ostringstream out;
  out << '[';
  for (size_t k = 0; k < values.size(); ++k)
    out << (k ? ", " : "") << values[k];
  out << ']';
  return out.str();
}

/// range(14).batch(8) through distribute_dataset on the real cluster of TF_CONFIG: the rows each
/// replica gets in both steps, against TF's split, hard-coded for 2 x 1 (strategy_common_test.py,
/// testSimpleInputFromDatasetLastPartialBatch: the chief [8, 9, 10], the worker [11, 12, 13]),
/// 2 x 2, 3 x 1 and 3 x 2 (the legacy rebatch over every replica, then each worker's every W-th
/// part). Each worker prints what its replicas got ("chief:0 step 1 local replica 0: [8, 9, 10]")
/// for the registration to match, and checks the global batch too: the row count all-reduced over
/// every replica (8, then 6) and the rows gathered in replica order.
int partial_batch_scenario() {
  multi_worker_mirrored_strategy mw;
  const int W = mw.num_workers();
  const int D = static_cast<int>(mw.num_local_replicas());
  const int rank = mw.worker_rank();
  me = to_string(mw.cluster_resolver().task());
  using rows_t = std::vector<int64_t>;
  // want[step][replica id], replica ids worker-major (worker w's local replica i is w * D + i).
  std::vector<std::vector<rows_t>> want;
  if (W == 2 && D == 1)
    want = {{{0, 1, 2, 3}, {4, 5, 6, 7}}, {{8, 9, 10}, {11, 12, 13}}};
  else if (W == 2 && D == 2)
    want = {{{0, 1}, {4, 5}, {2, 3}, {6, 7}}, {{8, 9}, {12, 13}, {10, 11}, {}}};
  else if (W == 3 && D == 1)
    want = {{{0, 1, 2}, {3, 4, 5}, {6, 7}}, {{8, 9}, {10, 11}, {12, 13}}};
  else if (W == 3 && D == 2)
    want = {{{0, 1}, {6, 7}, {2, 3}, {}, {4, 5}, {}}, {{8}, {11}, {9}, {12}, {10}, {13}}};
  else {
    std::cout << me << ": no expected split for " << W << " workers x " << D << " replicas"
              << std::endl;
    return 1;
  }
  rows_t range(14);
  for (size_t k = 0; k < range.size(); ++k)
    range[k] = static_cast<int64_t>(k);
  auto dist =
      mw.distribute_dataset(dataset::from_tensor_slices(tensor::from<int64_t>(range)).batch(8));
  check(dist.cardinality() == 2, "range(14).batch(8) gives 2 global batches");
  size_t step = 0;
  for (auto batch : dist) {
    if (step >= want.size()) {
      check(false, "more than 2 global batches");
      break;
    }
    check(batch.size() == static_cast<size_t>(D), "one sub-batch per local replica");
    std::vector<tensor> local;
    for (int i = 0; i < D && i < static_cast<int>(batch.size()); ++i) {
      auto got = batch[static_cast<size_t>(i)].as_tensor();
      std::cout << me << " step " << step << " local replica " << i << ": "
                << list_string(got.to_vector<int64_t>()) << std::endl;
      check_equal(got, tensor::from<int64_t>(want[step][static_cast<size_t>(rank * D + i)]),
                  "step " + std::to_string(step) + " local replica " + std::to_string(i));
      local.push_back(got);
    }
    // The global batch over every worker: its row count, and its rows in replica order.
    try {
      auto counts = mw.run(
          [](replica_context& ctx, const nest& x) {
            auto n = static_cast<float>(x.as_tensor().shape()[0]);
            return ctx.all_reduce("SUM", tensor::scalar<float>(n));
          },
          batch);
      check_equal(counts[0], tensor::scalar<float>(step == 0 ? 8.0f : 6.0f),
                  "step " + std::to_string(step) + " rows over every replica");
      rows_t all;
      for (const auto& rows : want[step])
        all.insert(all.end(), rows.begin(), rows.end());
      check_equal(mw.gather(per_replica<tensor>(local), 0), tensor::from<int64_t>(all),
                  "step " + std::to_string(step) + " gathered in replica order");
    } catch (const std::exception& e) {
      check(false, "step " + std::to_string(step) + " threw: " + e.what());
    }
    ++step;
  }
  check(step == 2, "iteration visits both global batches");
  std::cout << me << ": " << checks - failures << " of " << checks << " checks passed" << std::endl;
  return failures == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  std::string scenario = argc > 1 ? argv[1] : "";
  try {
    if (scenario == "collectives")
      return collectives();
    if (scenario == "half")
      return half();
    if (scenario == "cross_device_ops")
      return cross_device_ops_scenario();
    if (scenario == "partial_batch")
      return partial_batch_scenario();
    if (scenario == "kill" && argc > 2)
      return loss_scenario(std::atoi(argv[2]), false);
    if (scenario == "partition" && argc > 2)
      return loss_scenario(std::atoi(argv[2]), true);
    if (scenario == "join-fails" && argc > 3)
      return join_fails(std::atoi(argv[2]), argv[3]);
    if (scenario == "leave-early" && argc > 2)
      return leave_early(std::atoi(argv[2]));
    if (scenario == "clean-end" && argc > 3)
      return clean_end(std::atoi(argv[2]), std::atol(argv[3]));
  } catch (const std::exception& e) {
    std::cout << me << ": " << e.what() << std::endl;
    return 1;
  }
  std::cerr << "usage: mw_job collectives | half | cross_device_ops | partial_batch | kill "
               "VICTIM_RANK | partition "
               "VICTIM_RANK | "
               "join-fails TIMEOUT_MS TEXT | "
               "leave-early LEAVER | clean-end ITERS ELEMENTS"
            << std::endl;
  return 2;
}
