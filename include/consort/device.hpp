#pragma once

#include <string>
#include <string_view>

namespace consort {

/// The kinds of device a replica can bind.
enum class device_kind : uint8_t { cpu, gpu };

/// A parsed device name. "CPU:i" is a replica thread with host memory (any i >= 0);
/// "GPU:i" is the i-th visible CUDA device.
struct device_spec {
  device_kind kind = device_kind::cpu;
  int index = 0;

  /// Canonical spelling: "CPU:0", "GPU:1".
  std::string to_string() const;

  friend bool operator==(const device_spec&, const device_spec&) = default;
};

/// Parses "CPU:0", "cpu:0", "GPU:1", "/device:GPU:1", "/gpu:1" and TF's full form
/// "/job:worker/replica:0/task:1/device:CPU:0" (the job part is ignored here).
/// @throws error(unknown_device) saying what was expected when `name` is not a device.
device_spec parse_device(std::string_view name);

/// Number of GPUs this process sees ("GPU:0" .. "GPU:n-1"): 0 in a build without CUDA, without a
/// driver or without a device (as `tf.config.list_physical_devices("GPU")` is then empty). Never
/// throws.
int num_gpus() noexcept;

/// Why `num_gpus()` is 0: "this build of consort has no CUDA support", or CUDA's reason (no
/// driver, no device, CUDA_VISIBLE_DEVICES hiding them). Empty when there are GPUs.
std::string gpus_unavailable_reason();

/// The CUDA stream consort queues the calling thread's GPU work on, as an opaque `cudaStream_t`
/// (`torch.cuda.current_stream()`): on a GPU replica's thread inside `run`, the replica's own
/// stream, so kernels queued there run in order with the step's copies and collectives and need
/// no `replica_context::synchronize()`; on any other thread, CUDA's per-thread default stream
/// (`cudaStreamPerThread`), which consort's copies from that thread use too. nullptr in a build
/// without CUDA.
void* current_cuda_stream() noexcept;

} // namespace consort
