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

} // namespace consort
