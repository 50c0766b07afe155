// The copies of the CUDA runtime wrappers (runtime.hpp: copy_async, copy): between host and
// device memory, within one GPU, and between two GPUs peer to peer where the hardware allows it
// (enabled once per pair of GPUs).

#include "device/cuda/runtime_impl.hpp"

#include <consort/error.hpp>

#include <algorithm>
#include <mutex>
#include <set>
#include <string>
#include <utility>

namespace consort::cuda {

using impl::gpu_name;

namespace {

std::string where(int device) {
  return device == host ? std::string{"host"} : gpu_name(device);
}

/// "copy of <bytes> bytes from <where> to <where>", for messages.
std::string describe_copy(size_t bytes, int src_device, int dst_device) {
  return "copy of " + std::to_string(bytes) + " bytes from " + where(src_device) + " to " +
         where(dst_device);
}

/// The pairs of GPUs whose peer access was looked at (never destroyed: see impl::no_destructor).
struct peer_pairs {
  std::mutex mutex; // guards checked
  std::set<std::pair<int, int>> checked;
};

peer_pairs& peers() {
  static impl::no_destructor<peer_pairs> instance;
  return instance.get();
}

/// The device `stream` belongs to; `fallback` for the legacy default stream (nullptr).
int device_of(cudaStream_t stream, int fallback) {
  if (stream == nullptr)
    return fallback;
  int device = -1;
  check(cudaStreamGetDevice(stream, &device), "cudaStreamGetDevice", fallback);
  return device;
}

/// Lets `a` and `b` access each other's memory where the hardware allows it, once per pair, so
/// that cudaMemcpyPeerAsync goes directly over NVLink/PCIe instead of through host memory.
void enable_peer_access(int a, int b) {
  auto& s = peers();
  {
    std::lock_guard<std::mutex> lock{s.mutex};
    if (!s.checked.insert({std::min(a, b), std::max(a, b)}).second)
      return;
  }
  for (auto [from, to] : {std::pair{a, b}, std::pair{b, a}}) {
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, from, to) != cudaSuccess || can == 0) {
      (void)cudaGetLastError();
      continue;
    }
    device_guard guard{from};
    const auto status = cudaDeviceEnablePeerAccess(to, 0);
    // Already enabled (by someone else) is fine; any other failure leaves the staged path, which
    // cudaMemcpyPeerAsync takes by itself.
    if (status != cudaSuccess)
      (void)cudaGetLastError();
  }
}

/// The kind of a copy within one device or between the host and a device.
cudaMemcpyKind kind_of(int src_device, int dst_device) {
  if (src_device == host && dst_device != host)
    return cudaMemcpyHostToDevice;
  if (src_device != host && dst_device == host)
    return cudaMemcpyDeviceToHost;
  if (src_device != host)
    return cudaMemcpyDeviceToDevice;
  return cudaMemcpyHostToHost;
}

} // namespace

void copy_async(void* dst, int dst_device, const void* src, int src_device, size_t bytes,
                cudaStream_t stream) {
  if (bytes == 0)
    return;
  if (dst_device != host)
    require_device(dst_device);
  if (src_device != host)
    require_device(src_device);
  const auto what = describe_copy(bytes, src_device, dst_device);
  if (dst == nullptr || src == nullptr)
    throw_error(errc::invalid_argument,
                what + ": the " + (dst == nullptr ? "destination" : "source") + " is null");
  // The copy is queued from the stream's device, and the special handles (nullptr: the legacy
  // default stream; cudaStreamPerThread) are resolved there; copy() waits under the same device.
  const int gpu = device_of(stream, dst_device != host ? dst_device : src_device);
  if (dst_device != host && src_device != host && dst_device != src_device) {
    enable_peer_access(src_device, dst_device);
    device_guard guard{gpu};
    check(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, stream),
          ("cudaMemcpyPeerAsync (" + what + ")").c_str(), dst_device);
    return;
  }
  const cudaMemcpyKind kind = kind_of(src_device, dst_device);
  if (gpu == host) {
    check(cudaMemcpyAsync(dst, src, bytes, kind, stream),
          ("cudaMemcpyAsync (" + what + ")").c_str());
    return;
  }
  device_guard guard{gpu};
  check(cudaMemcpyAsync(dst, src, bytes, kind, stream), ("cudaMemcpyAsync (" + what + ")").c_str(),
        gpu);
}

void copy(void* dst, int dst_device, const void* src, int src_device, size_t bytes,
          cudaStream_t stream, std::chrono::milliseconds timeout) {
  copy_async(dst, dst_device, src, src_device, bytes, stream);
  if (bytes == 0)
    return;
  const int gpu = device_of(stream, dst_device != host ? dst_device : src_device);
  const auto what = describe_copy(bytes, src_device, dst_device);
  if (gpu == host) {
    synchronize_for(stream, gpu, timeout, what);
    return;
  }
  // Waits on the stream the copy went to: nullptr and cudaStreamPerThread name the stream of the
  // *current* device, which copy_async made `gpu` (the destination's, for nullptr) while queuing.
  device_guard guard{gpu};
  synchronize_for(stream, gpu, timeout, what);
}

} // namespace consort::cuda
