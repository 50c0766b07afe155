// The devices of the CUDA runtime wrappers (runtime.hpp): discovery (asked once per process),
// converting failed CUDA calls into errors, checking a GPU index, the current-device guard, and
// device properties.

#include "device/cuda/runtime_impl.hpp"

#include <consort/error.hpp>

#include <string>

namespace consort::cuda {

using impl::gpu_name;

namespace {

struct probe_result {
  int count = 0;
  std::string reason;
};

probe_result probe() {
  probe_result out;
  int n = 0;
  const auto status = cudaGetDeviceCount(&n);
  if (status != cudaSuccess) {
    // Not sticky; cleared so that no later cudaGetLastError reports it again.
    (void)cudaGetLastError();
    out.reason = std::string{"cudaGetDeviceCount failed: "} + cudaGetErrorString(status) + " (" +
                 cudaGetErrorName(status) + ")";
    return out;
  }
  if (n <= 0) {
    out.reason = "no CUDA device is visible (cudaGetDeviceCount reports 0; check "
                 "CUDA_VISIBLE_DEVICES)";
    return out;
  }
  out.count = n;
  return out;
}

const probe_result& probed() noexcept {
  // Asked once per process: the device count cannot change, and the first call initialises the
  // runtime (slow). A failing allocation here terminates, as for any noexcept function.
  static const probe_result result = probe();
  return result;
}

} // namespace

std::string impl::gpu_name(int device) {
  return "GPU:" + std::to_string(device);
}

// -- discovery and errors -------------------------------------------------------------------------

int device_count() noexcept {
  return probed().count;
}

std::string unavailable_reason() {
  return probed().reason;
}

void check(cudaError_t status, const char* call, int device) {
  if (status == cudaSuccess)
    return;
  // The runtime also keeps a failed call's status as the thread's last error; clear it (when it is
  // not sticky), since it is being reported now, so that a later launch check does not report it.
  (void)cudaGetLastError();
  std::string message = call != nullptr ? call : "a CUDA call";
  if (device >= 0)
    message += " on " + gpu_name(device);
  message +=
      std::string{" failed: "} + cudaGetErrorString(status) + " (" + cudaGetErrorName(status) + ")";
  throw_error(errc::device_error, message);
}

void require_device(int index) {
  const int n = device_count();
  if (index >= 0 && index < n)
    return;
  if (n == 0)
    throw_error(errc::unknown_device, gpu_name(index) +
                                          " is not available: this process sees no "
                                          "GPU (" +
                                          unavailable_reason() + ")");
  throw_error(errc::unknown_device, gpu_name(index) + " does not exist: this process sees " +
                                        std::to_string(n) + " GPU" + (n == 1 ? "" : "s") +
                                        " (GPU:0.." + gpu_name(n - 1) + ")");
}

// -- device_guard ---------------------------------------------------------------------------------

device_guard::device_guard(int index) : index_(index) {
  require_device(index);
  check(cudaGetDevice(&previous_), "cudaGetDevice", index);
  if (previous_ != index)
    check(cudaSetDevice(index), "cudaSetDevice", index);
}

device_guard::~device_guard() {
  if (previous_ >= 0 && previous_ != index_ && cudaSetDevice(previous_) != cudaSuccess)
    (void)cudaGetLastError();
}

// -- properties -----------------------------------------------------------------------------------

device_properties properties(int device) {
  require_device(device);
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties", device);
  device_properties out;
  out.name = p.name;
  out.total_memory = p.totalGlobalMem;
  out.sm_count = p.multiProcessorCount;
  out.major = p.major;
  out.minor = p.minor;
  // CUDA 13 removed cudaDeviceProp::memoryClockRate but still offers the attribute (kHz). HBM and
  // GDDR transfer twice per clock: bytes/s = 2 x clock x bus width / 8.
  int clock_khz = 0;
  int bus_bits = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess) {
    (void)cudaGetLastError();
    clock_khz = 0;
    bus_bits = 0;
  }
  out.memory_clock_khz = clock_khz;
  out.memory_bus_bits = bus_bits;
  out.peak_bandwidth = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0);
  return out;
}

} // namespace consort::cuda
