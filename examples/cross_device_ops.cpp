// cross_device_ops: combining values between this worker's devices outside a step, through
// `strategy.cross_device_ops()` (tf.distribute's `CrossDeviceOps`). `reduce` reduces a per-replica
// value and places the result on each destination device; `batch_reduce` does several reduces in
// one call; `broadcast` copies one tensor to every destination. The results are `mirrored`: one
// identical component per destination. CPU devices share host memory, so the components share one
// buffer instead of holding copies. A destination that is not a device of this build is an error.
//
// Usage:
//   ./build/examples/cross_device_ops
//
// Expected output:
//   grads: CPU:0 float32[2]{1, 10} | CPU:1 float32[2]{2, 20} | CPU:2 float32[2]{3, 30}
//   reduce SUM -> [CPU:0]: CPU:0 float32[2]{6, 60}
//   reduce MEAN -> all: CPU:0 float32[2]{2, 20} | CPU:1 float32[2]{2, 20} | CPU:2 float32[2]{2, 20}
//     components share one buffer: yes
//   batch_reduce SUM:
//     grads -> [CPU:0]: CPU:0 float32[2]{6, 60}
//     loss  -> [CPU:1, CPU:2]: CPU:1 float32[]{0.75} | CPU:2 float32[]{0.75}
//   broadcast -> [CPU:0, CPU:2]: CPU:0 int64[3]{7, 8, 9} | CPU:2 int64[3]{7, 8, 9}
//   reduce to [GPU:999] -> refused: this process has no such GPU
//   reduce to [TPU:0] -> unknown_device

#include <consort/consort.hpp>

#include <cstdint>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

using namespace consort;

namespace {

/// "CPU:0 float32[2]{1, 10} | CPU:1 ...": each component with the device it lives on.
std::string show(const per_replica<tensor>& value) {
  std::string out;
  for (const tensor& t : value) {
    out += out.empty() ? "" : " | ";
    out += t.device() + " " + t.to_string();
  }
  return out;
}

} // namespace

int main() {
  mirrored_strategy strategy({"CPU:0", "CPU:1", "CPU:2"});
  const cross_device_ops& ops = strategy.cross_device_ops();
  const std::vector<std::string>& all = strategy.worker_devices();

  // Replica i holds the gradient {i + 1, 10 (i + 1)} and the loss 0.125 (i + 1), on its device.
  auto grads = strategy.distribute_values([&](int id) {
    float k = static_cast<float>(id + 1);
    return tensor::from<float>({k, 10 * k}, {2}, all[static_cast<size_t>(id)]);
  });
  auto losses = strategy.distribute_values([&](int id) {
    return tensor::scalar<float>(0.125f * static_cast<float>(id + 1), all[static_cast<size_t>(id)]);
  });
  std::cout << "grads: " << show(grads) << '\n';

  std::cout << "reduce SUM -> [CPU:0]: " << show(ops.reduce("SUM", grads, {"CPU:0"})) << '\n';
  mirrored<tensor> mean = ops.reduce("MEAN", grads, all);
  std::cout << "reduce MEAN -> all: " << show(mean) << '\n';
  bool shared = mean[0].shares_storage_with(mean[1]) && mean[0].shares_storage_with(mean[2]);
  std::cout << "  components share one buffer: " << (shared ? "yes" : "no") << '\n';

  // The i-th result belongs to the i-th (value, destinations) pair.
  auto results = ops.batch_reduce("SUM", {{grads, {"CPU:0"}}, {losses, {"CPU:1", "CPU:2"}}});
  std::cout << "batch_reduce SUM:\n";
  std::cout << "  grads -> [CPU:0]: " << show(results[0]) << '\n';
  std::cout << "  loss  -> [CPU:1, CPU:2]: " << show(results[1]) << '\n';

  tensor table = tensor::from<int64_t>({7, 8, 9});
  std::cout << "broadcast -> [CPU:0, CPU:2]: " << show(ops.broadcast(table, {"CPU:0", "CPU:2"}))
            << '\n';

  // A GPU destination must exist (unknown_device in a CUDA build, unsupported without CUDA);
  // "TPU:0" is not a device at all.
  try {
    ops.reduce("SUM", grads, {"GPU:999"});
    std::cout << "unexpected: reduce to GPU:999 succeeded\n";
    return 1;
  } catch (const error& e) {
    if (e.code() != errc::unknown_device && e.code() != errc::unsupported)
      throw;
    std::cout << "reduce to [GPU:999] -> refused: this process has no such GPU\n";
  }
  try {
    ops.reduce("SUM", grads, {"TPU:0"});
    std::cout << "unexpected: reduce to TPU:0 succeeded\n";
    return 1;
  } catch (const error& e) {
    std::cout << "reduce to [TPU:0] -> " << to_string(e.code()) << '\n';
  }
  return 0;
}
