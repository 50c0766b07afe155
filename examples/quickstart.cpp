// quickstart: the smallest consort program (the README snippet). A mirrored strategy over two CPU
// replicas runs one step on both; each replica returns its id, and `reduce` sums them on the host.
//
// Usage:
//   ./build/examples/quickstart
//
// Expected output:
//   MirroredStrategy with 2 replicas on CPU:0, CPU:1
//   replica 0 returned int32[]{0}
//   replica 1 returned int32[]{1}
//   SUM over replicas: 1

#include <consort/consort.hpp>

#include <cstdint>
#include <iostream>
#include <optional>

int main() {
  consort::mirrored_strategy strategy({"CPU:0", "CPU:1"});
  std::cout << strategy.name() << " with " << strategy.num_replicas_in_sync() << " replicas on "
            << strategy.worker_devices()[0] << ", " << strategy.worker_devices()[1] << '\n';

  // The step runs once per replica, each on its own thread; the result has one component each.
  auto ids = strategy.run([](consort::replica_context& ctx) {
    return consort::tensor::scalar<int32_t>(ctx.replica_id_in_sync_group());
  });
  for (size_t i = 0; i < ids.size(); ++i)
    std::cout << "replica " << i << " returned " << ids[i].to_string() << '\n';

  // axis = none: reduce across replicas only (tf.distribute's `axis=None`).
  consort::tensor total = strategy.reduce("SUM", ids, std::nullopt);
  std::cout << "SUM over replicas: " << total.item<int32_t>() << '\n';
  return total.item<int32_t>() == 1 ? 0 : 1;
}
