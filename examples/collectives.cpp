// collectives: what replicas can compute together inside a step through their replica_context
// (tf.distribute's `ReplicaContext`): all_reduce (SUM, MEAN), all_gather (ragged sizes and nested
// values) and broadcast. Every replica gets the same result.
// Collectives are matched by their order within the step; replicas that make different calls at
// the same position all fail with error(collective_mismatch), which is shown last. Its message
// names both calls, e.g. "replica 1 called all_reduce(SUM) but replica 0 called
// all_gather(axis=0); every replica must make the same collective calls in the same order"; which
// replica arrived first depends on thread timing, so the expected output elides it with <...>.
//
// Usage:
//   ./build/examples/collectives
//
// Expected output:
//   3 replicas; replica i contributes i + 1
//   all_reduce SUM:  int32[]{6}
//   all_reduce MEAN: float64[]{2}
//   all_gather ragged (replica i sends i + 1 rows): int32[6]{0, 1, 1, 2, 2, 2}
//   all_gather of a nest (replica i sends {"id": [i], "rows": i + 1 rows [i, i]}):
//     id   -> int32[3]{0, 1, 2}
//     rows -> int32[6, 2]{0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2}
//   broadcast from replica 2: every replica got int32[2]{2, 200}
//   mismatched calls -> collective_mismatch
//     collective mismatch at step 1, call #0: replica <...> collective calls in the same order

#include <consort/consort.hpp>

#include <cstdint>
#include <iostream>
#include <vector>

using namespace consort;

int main() {
  mirrored_strategy strategy({"CPU:0", "CPU:1", "CPU:2"});
  std::cout << strategy.num_replicas_in_sync() << " replicas; replica i contributes i + 1\n";

  auto out = strategy.run([](replica_context& ctx) {
    int32_t id = ctx.replica_id_in_sync_group();
    tensor mine = tensor::scalar<int32_t>(id + 1);
    // Replica i has i + 1 rows: all_gather allows different extents along the gather axis.
    std::vector<int32_t> rows(static_cast<size_t>(id + 1), id);
    tensor ragged = tensor::from<int32_t>(rows);
    std::vector<int32_t> pairs(2 * rows.size(), id);
    tensor matrix = tensor::from<int32_t>(pairs, {id + 1, 2});
    return nest::dict({
        {"sum", ctx.all_reduce("SUM", mine)},
        {"mean", ctx.all_reduce("MEAN", mine)}, // integer MEAN is float64
        {"ragged", ctx.all_gather(ragged, 0)},
        {"nested",
         ctx.all_gather(nest::dict({{"id", tensor::from<int32_t>({id})}, {"rows", matrix}}), 0)},
        // Every replica passes a value of the same shape; only the root's contents count.
        {"broadcast", ctx.broadcast(tensor::from<int32_t>({id, id * 100}), 2)},
    });
  });

  const nest& r0 = out[0];
  std::cout << "all_reduce SUM:  " << r0["sum"].as_tensor().to_string() << '\n';
  std::cout << "all_reduce MEAN: " << r0["mean"].as_tensor().to_string() << '\n';
  std::cout << "all_gather ragged (replica i sends i + 1 rows): "
            << r0["ragged"].as_tensor().to_string() << '\n';
  std::cout
      << "all_gather of a nest (replica i sends {\"id\": [i], \"rows\": i + 1 rows [i, i]}):\n";
  std::cout << "  id   -> " << r0["nested"]["id"].as_tensor().to_string() << '\n';
  std::cout << "  rows -> " << r0["nested"]["rows"].as_tensor().to_string(12) << '\n';
  bool same = true;
  for (const nest& r : out)
    same = same && r["broadcast"] == r0["broadcast"];
  std::cout << "broadcast from replica 2: " << (same ? "every replica got " : "replicas differ: ")
            << r0["broadcast"].as_tensor().to_string() << '\n';

  // Replica 0 calls all_gather where the others call all_reduce: every replica fails, and so does
  // the step.
  try {
    strategy.run([](replica_context& ctx) {
      tensor one = tensor::from<float>({1});
      if (ctx.replica_id_in_sync_group() == 0)
        return ctx.all_gather(one, 0);
      return ctx.all_reduce("SUM", one);
    });
    std::cout << "unexpected: the mismatched step succeeded\n";
    return 1;
  } catch (const error& e) {
    std::cout << "mismatched calls -> " << to_string(e.code()) << '\n';
    std::cout << "  " << e.what() << '\n';
    return e.code() == errc::collective_mismatch ? 0 : 1;
  }
}
