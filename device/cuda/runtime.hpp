#pragma once

// The CUDA runtime API behind GPU replicas and device tensors. Private to consort (never
// installed, never included by a public header) and compiled only when CONSORT_WITH_CUDA is 1.
//
// Every failing CUDA call becomes error(errc::device_error) whose message names the call, the
// device and CUDA's own text; a GPU index that is not there is error(errc::unknown_device) saying
// how many GPUs this process sees and, when it sees none, why (no driver, no device).
//
// Only the runtime API (libcudart) is used: a binary linked to it starts on a machine without a
// driver, where device_count() is 0 and unavailable_reason() says why.

#include <consort/error.hpp>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <string>

namespace consort::cuda {

/// Number of visible GPUs; 0 without a driver or a device. Never throws; asked once per process.
int device_count() noexcept;

/// Why device_count() is 0 (CUDA's text for cudaGetDeviceCount's error, or "no CUDA device is
/// visible"); empty when there are GPUs.
std::string unavailable_reason();

/// @throws error(device_error) "<call> on GPU:<device> failed: <cudaGetErrorString> (<name>)"
/// when `status` is not cudaSuccess; `device` < 0 leaves the device out of the message.
void check(cudaError_t status, const char* call, int device = -1);

/// @throws error(unknown_device) unless 0 <= `index` < device_count(); the message says how many
/// GPUs there are, or why there are none.
void require_device(int index);

/// Makes `index` the calling thread's current device and restores the previous one on exit.
class device_guard {
public:
  explicit device_guard(int index);
  ~device_guard();
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

private:
  int previous_ = -1;
  int index_ = -1;
};

/// A non-blocking CUDA stream on one device (it does not synchronise with the legacy default
/// stream). Movable, not copyable; destroyed after the work queued on it has finished.
class stream {
public:
  stream() = default;
  explicit stream(int device);
  ~stream();
  stream(stream&& other) noexcept;
  stream& operator=(stream&& other) noexcept;
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  cudaStream_t get() const noexcept { return handle_; }
  int device() const noexcept { return device_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

  /// Waits until the work queued so far has finished, polling (cudaStreamQuery) so that the wait
  /// has a deadline. @throws error(device_error) when a queued operation failed, and
  /// error(collective_timeout) naming `what` when `timeout` passes first.
  void synchronize_for(std::chrono::milliseconds timeout, const std::string& what) const;

private:
  cudaStream_t handle_ = nullptr;
  int device_ = -1;
};

/// stream::synchronize_for for a raw stream of GPU `device` (`device` names it in messages;
/// nullptr is the legacy default stream of the current device).
/// @throws error(device_error) when a queued operation failed, and error(collective_timeout)
/// naming `what` when `timeout` passes first.
void synchronize_for(cudaStream_t stream, int device, std::chrono::milliseconds timeout,
                     const std::string& what);

/// Device memory of one GPU, cached per device by size class so that steady-state steps never call
/// cudaMalloc or cudaFree (both synchronise the device). Thread-safe.
/// @throws error(device_error) when the device is out of memory even after the cache is emptied.
void* allocate(int device, size_t bytes);

/// Returns memory from allocate() to the cache. `last_use`, when given, is the stream that last
/// used it: the block is reused only after the work queued on that stream so far has finished (an
/// event recorded on it is checked before reuse). Without `last_use` the block must be idle. Never
/// throws. @pre `bytes` is the size passed to allocate() for `pointer`.
void release(int device, void* pointer, size_t bytes, cudaStream_t last_use = nullptr) noexcept;

/// Bytes of `device`'s memory held in the cache (released, not yet reused or freed); 0 for a
/// device that is not there.
size_t cached_bytes(int device) noexcept;

/// Frees every cached block of every device (cudaFree); for tests and shutdown.
void empty_cache() noexcept;

/// Page-locked host memory for staging host<->device copies (so cudaMemcpyAsync really is async).
/// Cached like device memory. Never returns nullptr. @throws error(device_error), also when this
/// process sees no GPU (page-locking needs the driver).
void* allocate_pinned(size_t bytes);

/// Returns memory from allocate_pinned() to the cache; no copy may still be using it. Never
/// throws. @pre `bytes` is the size passed to allocate_pinned() for `pointer`.
void release_pinned(void* pointer, size_t bytes) noexcept;

/// Where a copy's pointer lives: a GPU index, or `host` for host memory (pageable or pinned).
inline constexpr int host = -1;

/// Queues a copy of `bytes` from `src` (on `src_device`) to `dst` (on `dst_device`) on `stream`;
/// device to device copies between two GPUs go peer to peer when the GPUs allow it.
/// @throws error(device_error).
void copy_async(void* dst, int dst_device, const void* src, int src_device, size_t bytes,
                cudaStream_t stream);

/// copy_async followed by waiting for the stream (bounded by `timeout`).
void copy(void* dst, int dst_device, const void* src, int src_device, size_t bytes,
          cudaStream_t stream, std::chrono::milliseconds timeout = std::chrono::seconds(60));

/// Properties of a device for benchmarks and messages: name, memory, peak memory bandwidth
/// (bytes/s, from the memory clock and bus width; 0 when CUDA does not report them).
struct device_properties {
  std::string name;
  size_t total_memory = 0;
  double peak_bandwidth = 0;
  int sm_count = 0;
  int major = 0, minor = 0;
  /// The inputs of peak_bandwidth (cudaDevAttrMemoryClockRate, cudaDevAttrGlobalMemoryBusWidth).
  int memory_clock_khz = 0;
  int memory_bus_bits = 0;
};
device_properties properties(int device);

} // namespace consort::cuda
