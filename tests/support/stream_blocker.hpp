#pragma once

// Test helper for GPU tests: holds a CUDA stream still until the test lets it go, so that a test
// can see what was queued behind it without finishing. Needs the CUDA runtime headers.

#include <consort/error.hpp>

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>

namespace consort::test {

/// Blocks a stream with a host function until release() (or 30 s, so a failing test cannot hang):
/// the stream's later work, and events recorded on it, stay pending meanwhile.
class stream_blocker {
public:
  explicit stream_blocker(cudaStream_t stream) {
    const auto status = cudaLaunchHostFunc(stream, &stream_blocker::wait, this);
    if (status != cudaSuccess)
      throw error(errc::device_error,
                  std::string{"cudaLaunchHostFunc failed: "} + cudaGetErrorString(status));
  }
  /// Releases the stream and waits until the host function has returned (it reads `this`).
  ~stream_blocker() {
    release();
    std::unique_lock lock{mu_};
    cv_.wait_for(lock, std::chrono::seconds(30), [this] { return done_; });
  }
  stream_blocker(const stream_blocker&) = delete;
  stream_blocker& operator=(const stream_blocker&) = delete;

  void release() {
    std::lock_guard lock{mu_};
    open_ = true;
    cv_.notify_all();
  }

private:
  static void wait(void* self) {
    auto* blocker = static_cast<stream_blocker*>(self);
    std::unique_lock lock{blocker->mu_};
    blocker->cv_.wait_for(lock, std::chrono::seconds(30), [blocker] { return blocker->open_; });
    blocker->done_ = true;
    blocker->cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
  bool done_ = false;
};

} // namespace consort::test
