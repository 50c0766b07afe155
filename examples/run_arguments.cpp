// run_arguments: the two kinds of argument `strategy.run` passes to a step function.
// - A `per_replica<T>` (built here with `distribute_values`) gives each replica its own component:
//   the step function receives a plain `T`.
// - Any other argument (a tensor, a nest) goes unchanged to every replica.
// A per_replica with the wrong number of components is rejected before anything runs.
//
// Usage:
//   ./build/examples/run_arguments
//
// Expected output:
//   per-replica argument: replica i gets x = 10 * i
//     CPU:0: x = 0
//     CPU:1: x = 10
//     CPU:2: x = 20
//   plain argument: every replica gets scale = 0.5
//   step result x * scale + replica id:
//     replica 0: float32[]{0}
//     replica 1: float32[]{6}
//     replica 2: float32[]{12}
//   SUM: 18
//   per_replica with 2 components on 3 replicas -> invalid_argument

#include <consort/consort.hpp>

#include <cstdint>
#include <iostream>
#include <optional>

using namespace consort;

int main() {
  mirrored_strategy strategy({"CPU:0", "CPU:1", "CPU:2"});

  // One component per replica, computed from its replica id (tf.distribute's
  // `experimental_distribute_values_from_function`).
  per_replica<tensor> xs =
      strategy.distribute_values([](int id) { return tensor::scalar<float>(10.0f * id); });
  std::cout << "per-replica argument: replica i gets x = 10 * i\n";
  for (size_t i = 0; i < xs.size(); ++i)
    std::cout << "  " << strategy.worker_devices()[i] << ": x = " << xs[i].item<float>() << '\n';

  tensor scale = tensor::scalar<float>(0.5f);
  std::cout << "plain argument: every replica gets scale = " << scale.item<float>() << '\n';

  // The step's parameters are plain tensors: consort unwraps the per_replica for each replica.
  auto step = [](replica_context& ctx, const tensor& x, const tensor& s) {
    return tensor::scalar<float>(x.item<float>() * s.item<float>() +
                                 static_cast<float>(ctx.replica_id_in_sync_group()));
  };
  per_replica<tensor> out = strategy.run(step, xs, scale);
  std::cout << "step result x * scale + replica id:\n";
  for (size_t i = 0; i < out.size(); ++i)
    std::cout << "  replica " << i << ": " << out[i].to_string() << '\n';
  std::cout << "SUM: " << strategy.reduce("SUM", out, std::nullopt).item<float>() << '\n';

  // The number of components must match the number of local replicas.
  per_replica<tensor> two({tensor::scalar<float>(1), tensor::scalar<float>(2)});
  try {
    strategy.run(step, two, scale);
    std::cout << "unexpected: the run succeeded\n";
    return 1;
  } catch (const error& e) {
    std::cout << "per_replica with 2 components on 3 replicas -> " << to_string(e.code()) << '\n';
  }
  return 0;
}
