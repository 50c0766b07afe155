// The streams of the CUDA runtime wrappers (runtime.hpp): non-blocking streams of one device, and
// waits on a stream that poll with a deadline instead of blocking for ever.

#include "device/cuda/runtime_impl.hpp"

#include <consort/error.hpp>

#include <string>
#include <thread>
#include <utility>

namespace consort::cuda {

using impl::gpu_name;

stream::stream(int device) : device_(device) {
  device_guard guard{device};
  check(cudaStreamCreateWithFlags(&handle_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
        device);
}

stream::~stream() {
  // cudaStreamDestroy returns at once; CUDA releases the stream after its queued work finished.
  if (handle_ != nullptr && cudaStreamDestroy(handle_) != cudaSuccess)
    (void)cudaGetLastError();
}

stream::stream(stream&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)), device_(std::exchange(other.device_, -1)) {}

stream& stream::operator=(stream&& other) noexcept {
  if (this != &other) {
    stream old{std::move(*this)};
    handle_ = std::exchange(other.handle_, nullptr);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

void stream::synchronize_for(std::chrono::milliseconds timeout, const std::string& what) const {
  if (handle_ == nullptr)
    throw_error(errc::invalid_argument, what + ": synchronize_for on a default-constructed "
                                               "cuda::stream, which has no CUDA stream");
  cuda::synchronize_for(handle_, device_, timeout, what);
}

void synchronize_for(cudaStream_t stream, int device, std::chrono::milliseconds timeout,
                     const std::string& what) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + timeout;
  for (int polls = 0;; ++polls) {
    const auto status = cudaStreamQuery(stream);
    if (status == cudaSuccess)
      return;
    if (status != cudaErrorNotReady)
      check(status, ("cudaStreamQuery (" + what + ")").c_str(), device);
    (void)cudaGetLastError(); // cudaErrorNotReady is recorded as the last error; not one here
    if (clock::now() >= deadline)
      throw_error(errc::collective_timeout,
                  what + ": the work queued on " + (device >= 0 ? gpu_name(device) : "the GPU") +
                      "'s stream did not finish within " + std::to_string(timeout.count()) +
                      " ms (is a kernel stuck, or waiting for a peer that never came?)");
    // A wait on hardware: spin politely first (most waits are microseconds), then sleep briefly
    // so that a long kernel does not burn a core; 100 us bounds the added latency.
    if (polls < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(polls < 1024 ? 10 : 100));
  }
}

} // namespace consort::cuda
