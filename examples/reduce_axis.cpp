// reduce_axis: `strategy.reduce(op, value, axis)` on a per-replica value (tf.distribute's
// `Strategy.reduce`).
// - axis = none reduces across replicas only, element-wise: the shapes must match.
// - axis = 0 first reduces along the batch axis inside each replica, then across replicas; MEAN
//   divides by the true number of rows, so a partial batch (4 rows and 2 rows) is averaged over 6
//   rows, not as the mean of two per-replica means.
// - SUM keeps the dtype; MEAN of integers is float64 (never truncated).
//
// Usage:
//   ./build/examples/reduce_axis
//
// Expected output:
//   global batch 0..7 over 2 replicas:
//     replica 0: float32[4]{0, 1, 2, 3}
//     replica 1: float32[4]{4, 5, 6, 7}
//   SUM  axis=none: float32[4]{4, 6, 8, 10}
//   MEAN axis=none: float32[4]{2, 3, 4, 5}
//   SUM  axis=0:    float32[]{28}
//   MEAN axis=0:    float32[]{3.5}
//   partial batch {0, 1, 2, 3} / {4, 5}:
//     MEAN axis=0:    float32[]{2.5} (mean of the replica means would be 2.75)
//     SUM  axis=none: shape_mismatch
//   int32 {1} / {2}:
//     SUM  axis=none: int32[]{3}
//     MEAN axis=none: float64[]{1.5}

#include <consort/consort.hpp>

#include <cstdint>
#include <iostream>
#include <optional>

using namespace consort;

int main() {
  mirrored_strategy strategy({"CPU:0", "CPU:1"});

  // One global batch of 8 rows, split 4/4 over the replicas; each replica returns its rows.
  auto ds = dataset::from_tensor_slices(tensor::from<float>({0, 1, 2, 3, 4, 5, 6, 7})).batch(8);
  auto batch = *strategy.distribute_dataset(ds).begin();
  per_replica<tensor> rows =
      strategy.run([](replica_context&, const nest& x) { return x.as_tensor(); }, batch);
  std::cout << "global batch 0..7 over 2 replicas:\n";
  for (size_t i = 0; i < rows.size(); ++i)
    std::cout << "  replica " << i << ": " << rows[i].to_string() << '\n';

  std::cout << "SUM  axis=none: " << strategy.reduce("SUM", rows, std::nullopt).to_string() << '\n';
  std::cout << "MEAN axis=none: " << strategy.reduce("MEAN", rows, std::nullopt).to_string()
            << '\n';
  std::cout << "SUM  axis=0:    " << strategy.reduce("SUM", rows, 0).to_string() << '\n';
  std::cout << "MEAN axis=0:    " << strategy.reduce("MEAN", rows, 0).to_string() << '\n';

  // A partial batch: the replicas hold different numbers of rows.
  per_replica<tensor> partial({tensor::from<float>({0, 1, 2, 3}), tensor::from<float>({4, 5})});
  std::cout << "partial batch {0, 1, 2, 3} / {4, 5}:\n";
  std::cout << "  MEAN axis=0:    " << strategy.reduce("MEAN", partial, 0).to_string()
            << " (mean of the replica means would be 2.75)\n";
  try {
    strategy.reduce("SUM", partial, std::nullopt); // element-wise needs equal shapes
    std::cout << "unexpected: the reduce succeeded\n";
    return 1;
  } catch (const error& e) {
    std::cout << "  SUM  axis=none: " << to_string(e.code()) << '\n';
  }

  per_replica<tensor> ints({tensor::scalar<int32_t>(1), tensor::scalar<int32_t>(2)});
  std::cout << "int32 {1} / {2}:\n";
  std::cout << "  SUM  axis=none: " << strategy.reduce("SUM", ints, std::nullopt).to_string()
            << '\n';
  std::cout << "  MEAN axis=none: " << strategy.reduce("MEAN", ints, std::nullopt).to_string()
            << '\n';
  return 0;
}
