// demo: a short tour of consort on CPU replicas, with no configuration. It builds a mirrored
// strategy (4 CPU replicas unless told otherwise) and shows, in one program: running a step,
// per-replica and plain arguments, the collectives of a replica_context, reduce with and without
// an axis, a distributed dataset with a partial batch, merge_call and regroup, the cross-device
// ops, and asynchronous use (futures with deadlines and a C++20 coroutine on Asio). Every result
// is checked; the last line says "demo: all checks passed" only when all of them hold, else the
// demo exits 1 naming the failed checks.
//
// Usage:
//   ./build/examples/demo [--replicas N]     (N in 1..64, default 4)
//   tools/demo.sh [--replicas N]             (sets up, builds the demo, then runs it)
//
// Expected output:
//   consort demo: MirroredStrategy with 4 replicas on CPU:0, CPU:1, CPU:2, CPU:3
//
//   [run] every replica returns its replica id
//     per replica: 0 | 1 | 2 | 3
//     reduce SUM -> 6
//   [arguments] per-replica x = 10 * id, plain scale = 0.5; the step returns x * scale
//     per replica: 0 | 5 | 10 | 15
//   [collectives] replica i contributes i + 1
//     all_reduce SUM -> 10, MEAN -> 2.5 (float64)
//     all_gather of i + 1 rows each -> int32[10]{0, 1, 1, 2, 2, 2, 3, 3, 3, 3}
//     broadcast from replica 3 -> int32[2]{3, 300}
//     replicas calling different collectives -> collective_mismatch
//   [reduce] global batch 0..7 split 2/2/2/2
//     SUM axis=0 -> 28, MEAN axis=0 -> 3.5
//     SUM axis=none of [i, 10 i] -> float32[2]{6, 60}
//     partial batch 0..5 split 2/2/1/1: MEAN axis=0 -> 2.5
//     MEAN of int32 ids -> float64 1.5
//   [dataset] 11 rows, batch(6), over 4 replicas
//     batch 0: 6 rows split 2/2/1/1
//     batch 1: 5 rows split 2/2/1/0
//   [contexts] merge_call runs one function over every replica's gradient
//     the function ran 1 time(s); every replica got SUM = 10
//     regroup(out)["grad"]: 1 | 2 | 3 | 4, MEAN -> 2.5
//     strategy.reduce inside a step -> invalid_argument (it requires cross-replica context)
//   [cross-device ops]
//     reduce SUM of ids -> CPU:0: 6
//     broadcast to every device: 4 components sharing one buffer
//   [async]
//     run_async + then: SUM of ids = 6 (within the 5 s deadline)
//     coroutine on an io_context: 6, then step_failed from a failing step
//
//   demo: all checks passed (26 checks)

#include <consort/asio.hpp> // first: it includes <utility> before Asio, which Boost 1.74 needs
#include <consort/consort.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace consort;
using namespace std::chrono_literals;
namespace asio = boost::asio;

namespace {

/// Counts checks and remembers the ones that failed.
class checks {
public:
  void operator()(bool ok, const std::string& what) {
    ++count_;
    if (!ok) {
      failed_.push_back(what);
      std::cerr << "CHECK FAILED: " << what << '\n';
    }
  }
  int count() const noexcept { return count_; }
  const std::vector<std::string>& failed() const noexcept { return failed_; }

private:
  int count_ = 0;
  std::vector<std::string> failed_;
};

/// "0 | 5 | 10": one scalar per replica.
template <class T>
std::string per_replica_scalars(const per_replica<tensor>& value) {
  std::ostringstream out;
  for (size_t i = 0; i < value.size(); ++i)
    out << (i > 0 ? " | " : "") << value[i].item<T>();
  return out.str();
}

/// "2/2/1/1": the extent along axis 0 of each component.
std::string split_of(const per_replica<tensor>& value) {
  std::string out;
  for (const tensor& t : value) {
    out += out.empty() ? "" : "/";
    out += std::to_string(t.shape().at(0));
  }
  return out;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& item : items) {
    out += out.empty() ? "" : sep;
    out += item;
  }
  return out;
}

/// The expected "2/2/1/1" for `rows` rows over `n` replicas: as even as possible, larger first.
/// TF's split of `rows` rows of a global batch of `batch` over n replicas: each replica's share of
/// a full batch (as even as possible, in replica order), filled in replica order.
std::string expected_split(int64_t rows, int n, int64_t batch) {
  std::string out;
  for (int i = 0; i < n; ++i) {
    const int64_t share = std::min(batch / n + (i < batch % n ? 1 : 0), rows);
    rows -= share;
    out += i > 0 ? "/" : "";
    out += std::to_string(share);
  }
  return out;
}

/// A scalar tensor per replica: the id.
tensor replica_id(replica_context& ctx) {
  return tensor::scalar<int32_t>(ctx.replica_id_in_sync_group());
}

int run_demo(int n) {
  checks check;
  std::vector<std::string> devices;
  for (int i = 0; i < n; ++i)
    devices.push_back("CPU:" + std::to_string(i));
  mirrored_strategy strategy(devices);
  const int64_t id_sum = int64_t{n} * (n - 1) / 2; // 0 + 1 + ... + (n - 1)
  std::cout << "consort demo: " << strategy.name() << " with " << strategy.num_replicas_in_sync()
            << " replicas on " << join(strategy.worker_devices(), ", ") << "\n\n";
  check(strategy.num_replicas_in_sync() == n, "num_replicas_in_sync is the device count");

  // -- run and reduce -------------------------------------------------------------------------
  std::cout << "[run] every replica returns its replica id\n";
  per_replica<tensor> ids = strategy.run(replica_id);
  std::cout << "  per replica: " << per_replica_scalars<int32_t>(ids) << '\n';
  auto total = strategy.reduce("SUM", ids, std::nullopt).item<int32_t>();
  std::cout << "  reduce SUM -> " << total << '\n';
  bool ids_ok = ids.size() == static_cast<size_t>(n);
  for (size_t i = 0; ids_ok && i < ids.size(); ++i)
    ids_ok = ids[i].item<int32_t>() == static_cast<int32_t>(i);
  check(ids_ok, "replica i returns id i");
  check(total == id_sum, "reduce SUM of ids is n (n - 1) / 2");

  // -- per-replica and plain arguments ----------------------------------------------------------
  std::cout
      << "[arguments] per-replica x = 10 * id, plain scale = 0.5; the step returns x * scale\n";
  auto xs = strategy.distribute_values([](int id) { return tensor::scalar<float>(10.0f * id); });
  auto scaled = strategy.run(
      [](replica_context&, const tensor& x, const tensor& scale) {
        return tensor::scalar<float>(x.item<float>() * scale.item<float>());
      },
      xs, tensor::scalar<float>(0.5f));
  std::cout << "  per replica: " << per_replica_scalars<float>(scaled) << '\n';
  bool args_ok = true;
  for (size_t i = 0; i < scaled.size(); ++i)
    args_ok = args_ok && scaled[i].item<float>() == 5.0f * static_cast<float>(i);
  check(args_ok, "replica i gets its own x and the shared scale");

  // -- collectives ------------------------------------------------------------------------------
  std::cout << "[collectives] replica i contributes i + 1\n";
  const int root = n - 1;
  auto coll = strategy.run([root](replica_context& ctx) {
    int32_t id = ctx.replica_id_in_sync_group();
    tensor mine = tensor::scalar<int32_t>(id + 1);
    return nest::dict({
        {"sum", ctx.all_reduce("SUM", mine)},
        {"mean", ctx.all_reduce("MEAN", mine)},
        {"gather", ctx.all_gather(tensor::from(std::vector<int32_t>(size_t(id + 1), id)), 0)},
        {"bcast", ctx.broadcast(tensor::from<int32_t>({id, 100 * id}), root)},
    });
  });
  const nest& c0 = coll[0];
  auto sum = c0["sum"].as_tensor().item<int32_t>();
  const tensor& mean = c0["mean"].as_tensor();
  const tensor& gathered = c0["gather"].as_tensor();
  const tensor& bcast = c0["bcast"].as_tensor();
  std::cout << "  all_reduce SUM -> " << sum << ", MEAN -> " << mean.item<double>() << " ("
            << to_string(mean.dtype()) << ")\n";
  std::cout << "  all_gather of i + 1 rows each -> " << gathered.to_string(10) << '\n';
  std::cout << "  broadcast from replica " << root << " -> " << bcast.to_string() << '\n';
  check(sum == n * (n + 1) / 2, "all_reduce SUM of i + 1");
  check(mean.dtype() == dtype::float64 && mean.item<double>() == (n + 1) / 2.0,
        "all_reduce MEAN of int32 is float64 (n + 1) / 2");
  std::vector<int32_t> want_gather;
  for (int32_t i = 0; i < n; ++i)
    want_gather.insert(want_gather.end(), size_t(i + 1), i);
  check(gathered.to_vector<int32_t>() == want_gather, "all_gather concatenates ragged rows");
  bool same = true;
  for (const nest& r : coll)
    same = same && r == c0;
  check(same, "every replica gets the same collective results");
  check(bcast.to_vector<int32_t>() == std::vector<int32_t>{root, 100 * root},
        "broadcast returns the root's value");
  if (n >= 2) {
    errc code = errc::none;
    try {
      strategy.run([](replica_context& ctx) {
        tensor one = tensor::from<float>({1});
        return ctx.replica_id_in_sync_group() == 0 ? ctx.all_gather(one, 0)
                                                   : ctx.all_reduce("SUM", one);
      });
    } catch (const error& e) {
      code = e.code();
    }
    std::cout << "  replicas calling different collectives -> " << to_string(code) << '\n';
    check(code == errc::collective_mismatch, "different collectives fail with collective_mismatch");
  } else {
    std::cout << "  replicas calling different collectives -> (needs 2 replicas; skipped)\n";
  }

  // -- reduce with and without an axis ----------------------------------------------------------
  auto batch_of = [&](int64_t rows) {
    std::vector<float> values;
    for (int64_t i = 0; i < rows; ++i)
      values.push_back(static_cast<float>(i));
    auto ds = dataset::from_tensor_slices(tensor::from<float>(values)).batch(rows);
    return strategy.run([](replica_context&, const nest& b) { return b.as_tensor(); },
                        *strategy.distribute_dataset(ds).begin());
  };
  auto rows8 = batch_of(8);
  std::cout << "[reduce] global batch 0..7 split " << split_of(rows8) << '\n';
  auto sum0 = strategy.reduce("SUM", rows8, 0).item<float>();
  auto mean0 = strategy.reduce("MEAN", rows8, 0).item<float>();
  std::cout << "  SUM axis=0 -> " << sum0 << ", MEAN axis=0 -> " << mean0 << '\n';
  check(sum0 == 28.0f && mean0 == 3.5f, "reduce along axis 0 covers the whole global batch");
  auto pairs = strategy.distribute_values([](int id) {
    return tensor::from<float>({static_cast<float>(id), 10.0f * static_cast<float>(id)});
  });
  tensor none = strategy.reduce("SUM", pairs, std::nullopt);
  std::cout << "  SUM axis=none of [i, 10 i] -> " << none.to_string() << '\n';
  check(none.to_vector<float>() ==
            std::vector<float>{static_cast<float>(id_sum), 10.0f * static_cast<float>(id_sum)},
        "reduce with axis none is element-wise across replicas");
  auto rows6 = batch_of(6);
  auto partial = strategy.reduce("MEAN", rows6, 0).item<float>();
  std::cout << "  partial batch 0..5 split " << split_of(rows6) << ": MEAN axis=0 -> " << partial
            << '\n';
  check(partial == 2.5f, "MEAN over a partial batch divides by the true row count");
  tensor int_mean = strategy.reduce("MEAN", ids, std::nullopt);
  std::cout << "  MEAN of int32 ids -> " << to_string(int_mean.dtype()) << ' '
            << int_mean.item<double>() << '\n';
  check(int_mean.dtype() == dtype::float64 && int_mean.item<double>() == (n - 1) / 2.0,
        "integer MEAN is float64, not truncated");

  // -- distributed dataset ----------------------------------------------------------------------
  std::cout << "[dataset] 11 rows, batch(6), over " << n << " replicas\n";
  std::vector<float> features;
  std::vector<int32_t> labels;
  for (int32_t i = 0; i < 11; ++i) {
    features.insert(features.end(), {static_cast<float>(i), -static_cast<float>(i)});
    labels.push_back(i);
  }
  auto ds = dataset::from_tensor_slices(nest::dict({{"x", tensor::from<float>(features, {11, 2})},
                                                    {"y", tensor::from<int32_t>(labels)}}))
                .batch(6);
  int64_t index = 0;
  int64_t label_total = 0;
  for (per_replica<nest> batch : strategy.distribute_dataset(ds)) {
    auto out = strategy.run(
        [](replica_context& ctx, const nest& b) {
          int64_t s = 0;
          for (int32_t y : b["y"].as_tensor().to_vector<int32_t>())
            s += y;
          return nest::dict({{"rows", tensor::zeros(dtype::uint8, {b["x"].as_tensor().shape()[0]})},
                             {"sum", ctx.all_reduce("SUM", tensor::scalar<int64_t>(s))}});
        },
        batch);
    per_replica<tensor> rows;
    for (const nest& r : out)
      rows.values().push_back(r["rows"].as_tensor());
    int64_t global = index == 0 ? 6 : 5;
    std::cout << "  batch " << index << ": " << global << " rows split " << split_of(rows) << '\n';
    check(split_of(rows) == expected_split(global, n, 6),
          "batch " + std::to_string(index) +
              " splits as TF's rebatch does (full-batch shares, filled in replica order)");
    label_total += out[0]["sum"].as_tensor().item<int64_t>();
    ++index;
  }
  check(index == 2 && label_total == 55, "every row is seen exactly once");

  // -- contexts: merge_call, regroup, and what a step may not call -----------------------------
  std::cout << "[contexts] merge_call runs one function over every replica's gradient\n";
  std::atomic<int> merges{0};
  auto stepped = strategy.run([&](replica_context& ctx) {
    auto grad = tensor::scalar<float>(static_cast<float>(ctx.replica_id_in_sync_group() + 1));
    // As an optimizer aggregates: once, in cross-replica context, with every replica's value.
    auto total = ctx.merge_call(
        [&](consort::strategy& s, const per_replica<tensor>& grads) {
          ++merges;
          return s.reduce("SUM", grads, std::nullopt);
        },
        grad);
    return nest::dict({{"grad", grad}, {"total", total}});
  });
  auto view = regroup(stepped); // TF's shape: the step's structure, a per_replica at each leaf
  bool same_total = true;
  for (const tensor& t : view["total"].leaf())
    same_total = same_total && t.item<float>() == view["total"].leaf()[0].item<float>();
  const float grad_total = view["total"].leaf()[0].item<float>();
  std::cout << "  the function ran " << merges.load()
            << " time(s); every replica got SUM = " << grad_total << '\n';
  check(merges.load() == 1 && same_total && grad_total == n * (n + 1) / 2.0f,
        "merge_call runs its function once and every replica gets the result");
  const float grad_mean = strategy.reduce("MEAN", view["grad"], std::nullopt).item<float>();
  std::cout << "  regroup(out)[\"grad\"]: " << per_replica_scalars<float>(view["grad"])
            << ", MEAN -> " << grad_mean << '\n';
  check(grad_mean == (n + 1) / 2.0f, "regroup gives per_replica leaves that reduce takes");
  errc in_step = errc::none;
  try {
    strategy.run([&](replica_context&) {
      strategy.reduce("SUM", ids, std::nullopt); // replica context: refused, as in TF
      return tensor::scalar<int32_t>(0);
    });
  } catch (const error& e) {
    in_step = e.code();
  }
  std::cout << "  strategy.reduce inside a step -> " << to_string(in_step)
            << " (it requires cross-replica context)\n";
  check(in_step == errc::invalid_argument, "a cross-replica call inside a step fails at once");

  // -- cross-device ops -------------------------------------------------------------------------
  std::cout << "[cross-device ops]\n";
  const auto& ops = strategy.cross_device_ops();
  auto on_cpu0 = ops.reduce("SUM", ids, {"CPU:0"});
  std::cout << "  reduce SUM of ids -> " << on_cpu0[0].device() << ": "
            << on_cpu0[0].item<int32_t>() << '\n';
  check(on_cpu0.size() == 1 && on_cpu0[0].item<int32_t>() == id_sum,
        "cross_device_ops reduce places the sum on the destination");
  auto copies = ops.broadcast(tensor::from<float>({1, 2, 3}), strategy.worker_devices());
  bool shared = copies.size() == static_cast<size_t>(n);
  for (size_t i = 0; shared && i < copies.size(); ++i)
    shared = copies[i].shares_storage_with(copies[0]) && copies[i].device() == devices[i];
  std::cout << "  broadcast to every device: " << copies.size() << " components sharing "
            << (shared ? "one buffer" : "separate buffers") << '\n';
  check(shared, "broadcast between CPU devices copies no bytes");

  // -- asynchronous use -------------------------------------------------------------------------
  std::cout << "[async]\n";
  auto fut = strategy.run_async(replica_id).then([](per_replica<tensor> v) {
    int64_t s = 0;
    for (const tensor& t : v)
      s += t.item<int32_t>();
    return s;
  });
  bool in_time = fut.wait_for(5s);
  check(in_time, "run_async completes within its deadline");
  if (!in_time)
    return 1; // don't block on a result that is not coming
  auto async_sum = fut.get();
  std::cout << "  run_async + then: SUM of ids = " << async_sum << " (within the 5 s deadline)\n";
  check(async_sum == id_sum, "then maps the per-replica result");

  asio::io_context io;
  auto work = asio::make_work_guard(io); // until the coroutine is done
  int32_t awaited = -1;
  errc awaited_error = errc::none;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        auto v = co_await async_get(strategy.run_async(replica_id), asio::use_awaitable);
        awaited = strategy.reduce("SUM", v, std::nullopt).item<int32_t>();
        try {
          co_await async_get(strategy.run_async([](replica_context&) -> tensor {
            throw std::runtime_error("deliberate failure");
          }),
                             asio::use_awaitable);
        } catch (const error& e) {
          awaited_error = e.code();
        }
        work.reset();
      },
      asio::detached);
  io.run();
  std::cout << "  coroutine on an io_context: " << awaited << ", then " << to_string(awaited_error)
            << " from a failing step\n";
  check(awaited == id_sum, "co_await async_get gives the step's result");
  check(awaited_error == errc::step_failed, "co_await async_get throws the step's error");

  // -- verdict ----------------------------------------------------------------------------------
  if (!check.failed().empty()) {
    std::cerr << "\ndemo: " << check.failed().size() << " of " << check.count()
              << " checks FAILED: " << join(check.failed(), "; ") << '\n';
    return 1;
  }
  std::cout << "\ndemo: all checks passed (" << check.count() << " checks)\n";
  return 0;
}

int usage(const char* program, int rc) {
  (rc == 0 ? std::cout : std::cerr)
      << "usage: " << program << " [--replicas N]  (N in 1..64, default 4)\n";
  return rc;
}

} // namespace

int main(int argc, char** argv) {
  int replicas = 4;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h")
      return usage(argv[0], 0);
    std::string value;
    if (arg == "--replicas" && i + 1 < argc)
      value = argv[++i];
    else if (arg.rfind("--replicas=", 0) == 0)
      value = arg.substr(11);
    else
      return usage(argv[0], 2);
    char* end = nullptr;
    long n = std::strtol(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || n < 1 || n > 64) {
      std::cerr << "demo: --replicas needs a number in 1..64, got \"" << value << "\"\n";
      return 2;
    }
    replicas = static_cast<int>(n);
  }
  try {
    return run_demo(replicas);
  } catch (const error& e) {
    std::cerr << "demo: unexpected consort::error (" << to_string(e.code()) << "): " << e.what()
              << '\n';
  } catch (const std::exception& e) {
    std::cerr << "demo: unexpected exception: " << e.what() << '\n';
  }
  return 1;
}
