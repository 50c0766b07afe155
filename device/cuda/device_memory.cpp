// The caching allocator of device memory (runtime.hpp: allocate, release, cached_bytes,
// empty_cache): per GPU, released blocks are kept by size class with an event recorded on the
// stream that last used them, and reused once that event has completed, so that steady-state steps
// never call cudaMalloc or cudaFree (both synchronise the device).

#include "device/cuda/runtime_impl.hpp"

#include <consort/error.hpp>

#include "core/report.hpp"

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace consort::cuda {

using impl::gpu_name;
using impl::size_class;

namespace {

/// A block of the device cache; `ready` is recorded on the stream that last used it (nullptr when
/// the caller released it idle).
struct cached_block {
  void* pointer = nullptr;
  cudaEvent_t ready = nullptr;
};

/// The cache of one GPU. Thread-safe: `mutex` guards `free_blocks`, `spare_events` and
/// `cached_bytes`. No CUDA call that can block (cudaMalloc, cudaFree, waits) runs under it.
struct device_pool {
  std::mutex mutex;
  std::map<size_t, std::vector<cached_block>> free_blocks; // by size class, oldest first
  std::vector<cudaEvent_t> spare_events;                   // created on this GPU
  size_t cached_bytes = 0;
};

/// The caches of every GPU of the process (never destroyed: see impl::no_destructor).
struct device_pools {
  device_pools() {
    for (int d = 0; d < device_count(); ++d)
      devices.push_back(std::make_unique<device_pool>());
  }
  std::vector<std::unique_ptr<device_pool>> devices; // fixed after construction
};

device_pool& pool_of(int device) {
  static impl::no_destructor<device_pools> instance;
  return *instance.get().devices[static_cast<size_t>(device)];
}

/// True when the work before `event` has finished. A failed query also counts as finished: the
/// work that used the block was abandoned, and the context is unusable anyway.
bool event_done(cudaEvent_t event) noexcept {
  const auto status = cudaEventQuery(event);
  if (status == cudaSuccess)
    return true;
  // cudaErrorNotReady is recorded as the thread's last error; clear it (and any non-sticky error)
  // so that a later launch check does not report it.
  (void)cudaGetLastError();
  return status != cudaErrorNotReady;
}

/// Takes every cached block (with its size class) out of `pool`.
std::vector<std::pair<size_t, cached_block>> take_all(device_pool& pool) {
  std::vector<std::pair<size_t, cached_block>> out;
  std::lock_guard<std::mutex> lock{pool.mutex};
  for (auto& [cls, blocks] : pool.free_blocks)
    for (const auto& b : blocks)
      out.emplace_back(cls, b);
  pool.free_blocks.clear();
  pool.cached_bytes = 0;
  return out;
}

/// How long freeing cached blocks waits for their last use: a block whose stream is still busy
/// after this (a stuck kernel) goes back to the cache instead of blocking the caller forever.
constexpr auto last_use_wait = std::chrono::seconds(10);

/// Waits (polling, bounded by `deadline`) until the work before `event` has finished.
bool wait_event(cudaEvent_t event, std::chrono::steady_clock::time_point deadline) noexcept {
  for (int polls = 0;; ++polls) {
    if (event_done(event))
      return true;
    if (std::chrono::steady_clock::now() >= deadline)
      return false;
    if (polls < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

/// Frees `blocks` (size class, block) of `device` (cudaFree) once their last use has finished,
/// returning their events to the pool; a block whose last use does not finish within
/// `last_use_wait` goes back to the cache. Never throws.
void free_blocks(int device, device_pool& pool,
                 std::vector<std::pair<size_t, cached_block>>& blocks) noexcept {
  if (blocks.empty())
    return;
  static std::atomic<bool> reported{false};
  const auto deadline = std::chrono::steady_clock::now() + last_use_wait;
  size_t done = 0;
  try {
    device_guard guard{device};
    for (; done < blocks.size(); ++done) {
      auto& [cls, b] = blocks[done];
      if (b.ready != nullptr) {
        if (!wait_event(b.ready, deadline)) {
          std::lock_guard<std::mutex> lock{pool.mutex};
          pool.free_blocks[cls].push_back(b);
          pool.cached_bytes += cls;
          continue;
        }
        std::lock_guard<std::mutex> lock{pool.mutex};
        pool.spare_events.push_back(b.ready);
        b.ready = nullptr;
      }
      if (cudaFree(b.pointer) != cudaSuccess)
        (void)cudaGetLastError();
    }
  } catch (...) {
    // Out of host memory while giving a block or an event back to the pool (device_guard cannot
    // fail for a device that made the blocks): the blocks not yet handled are freed here, each
    // after its last use, and an event that could not be pooled is destroyed.
    detail::report_once(reported, "freeing cached GPU blocks: the pool could not take a block "
                                  "or event back; freeing them directly");
    for (; done < blocks.size(); ++done) {
      auto& b = blocks[done].second;
      if (b.ready != nullptr) {
        const bool finished = wait_event(b.ready, deadline);
        (void)cudaEventDestroy(b.ready);
        if (!finished)
          continue; // still in use at the deadline: leaked rather than freed under the GPU
      }
      if (cudaFree(b.pointer) != cudaSuccess)
        (void)cudaGetLastError();
    }
  }
  blocks.clear();
}

/// A block of class `cls` from the cache whose last use has finished, or nullptr.
void* take_ready(device_pool& pool, size_t cls) {
  std::lock_guard<std::mutex> lock{pool.mutex};
  auto it = pool.free_blocks.find(cls);
  if (it == pool.free_blocks.end())
    return nullptr;
  auto& blocks = it->second;
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto b = blocks[i];
    if (b.ready != nullptr && !event_done(b.ready))
      continue;
    blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
    if (b.ready != nullptr)
      pool.spare_events.push_back(b.ready);
    pool.cached_bytes -= cls;
    return b.pointer;
  }
  return nullptr;
}

/// cudaMalloc of `cls` bytes after an out-of-memory failure: gives every cached block of the GPU
/// back to CUDA (after its last use) and retries once. @throws error(device_error) when the GPU
/// is still out of memory; otherwise returns the retry's status.
cudaError_t malloc_after_emptying_cache(int device, device_pool& pool, void*& p, size_t bytes,
                                        size_t cls) {
  (void)cudaGetLastError();
  auto blocks = take_all(pool);
  const size_t freed = blocks.size();
  free_blocks(device, pool, blocks);
  const auto status = cudaMalloc(&p, cls);
  if (status != cudaErrorMemoryAllocation)
    return status;
  (void)cudaGetLastError();
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess)
    (void)cudaGetLastError();
  throw_error(errc::device_error, "cudaMalloc of " + std::to_string(bytes) + " bytes (size class " +
                                      std::to_string(cls) + ") on " + gpu_name(device) +
                                      " failed: out of memory (cudaErrorMemoryAllocation) even "
                                      "after emptying the cache of " +
                                      std::to_string(freed) + " cached blocks; the GPU has " +
                                      std::to_string(free_bytes) + " of " +
                                      std::to_string(total_bytes) + " bytes free");
}

/// How long release() waits, in its rare fallbacks, for the last use of a block to end.
constexpr auto release_wait = std::chrono::seconds(10);

/// Whether `stream`'s work finishes (successfully) within `timeout`. Never throws.
bool idle_within(cudaStream_t stream, int device, std::chrono::milliseconds timeout) noexcept {
  try {
    synchronize_for(stream, device, timeout, "releasing GPU memory");
    return true;
  } catch (...) { // the failure or the timeout is the answer: not idle
    (void)cudaGetLastError();
    return false;
  }
}

/// Whether `event` completes within `timeout`. Never throws.
bool event_done_within(cudaEvent_t event, std::chrono::milliseconds timeout) noexcept {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int polls = 0;; ++polls) {
    const auto status = cudaEventQuery(event);
    if (status == cudaSuccess)
      return true;
    (void)cudaGetLastError();
    if (status != cudaErrorNotReady || std::chrono::steady_clock::now() >= deadline)
      return false;
    if (polls < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

/// Records `block`'s last use on `last_use` (block.ready: a spare event of the pool, or a new
/// one). Without an event, the block may be cached only once its stream is idle; whether it may be
/// cached (false: the stream failed or is still busy after release_wait, and the block is leaked
/// rather than handed to another tensor while the GPU may still write it).
bool record_last_use(int device, device_pool& pool, cached_block& block, cudaStream_t last_use) {
  device_guard guard{device};
  {
    std::lock_guard<std::mutex> lock{pool.mutex};
    if (!pool.spare_events.empty()) {
      block.ready = pool.spare_events.back();
      pool.spare_events.pop_back();
    }
  }
  if (block.ready == nullptr &&
      cudaEventCreateWithFlags(&block.ready, cudaEventDisableTiming) != cudaSuccess) {
    (void)cudaGetLastError();
    block.ready = nullptr;
  }
  if (block.ready != nullptr && cudaEventRecord(block.ready, last_use) != cudaSuccess) {
    (void)cudaGetLastError();
    std::lock_guard<std::mutex> lock{pool.mutex};
    pool.spare_events.push_back(block.ready);
    block.ready = nullptr;
  }
  return block.ready != nullptr || idle_within(last_use, device, release_wait);
}

} // namespace

void* allocate(int device, size_t bytes) {
  require_device(device);
  if (bytes > (size_t{1} << 60))
    throw_error(errc::device_error, "allocate of " + std::to_string(bytes) + " bytes on " +
                                        gpu_name(device) +
                                        ": no GPU has that much memory (expected at most 2^60)");
  auto& pool = pool_of(device);
  const size_t cls = size_class(bytes);
  if (void* p = take_ready(pool, cls))
    return p;
  device_guard guard{device};
  void* p = nullptr;
  auto status = cudaMalloc(&p, cls);
  if (status == cudaErrorMemoryAllocation)
    status = malloc_after_emptying_cache(device, pool, p, bytes, cls);
  check(status, ("cudaMalloc of " + std::to_string(cls) + " bytes").c_str(), device);
  return p;
}

void release(int device, void* pointer, size_t bytes, cudaStream_t last_use) noexcept {
  if (pointer == nullptr || device < 0 || device >= device_count())
    return;
  auto& pool = pool_of(device);
  const size_t cls = size_class(bytes);
  cached_block block{pointer, nullptr};
  try {
    if (last_use != nullptr && !record_last_use(device, pool, block, last_use))
      return;
    std::lock_guard<std::mutex> lock{pool.mutex};
    pool.free_blocks[cls].push_back(block);
    pool.cached_bytes += cls;
  } catch (...) {
    // Out of host memory while caching: free the block instead, after its last use (bounded:
    // a use that does not end in time leaks the block rather than free memory in use).
    if (block.ready != nullptr && !event_done_within(block.ready, release_wait))
      return;
    if (cudaFree(pointer) != cudaSuccess)
      (void)cudaGetLastError();
  }
}

size_t cached_bytes(int device) noexcept {
  if (device < 0 || device >= device_count())
    return 0;
  auto& pool = pool_of(device);
  std::lock_guard<std::mutex> lock{pool.mutex};
  return pool.cached_bytes;
}

void empty_cache() noexcept {
  for (int d = 0; d < device_count(); ++d) {
    auto& pool = pool_of(d);
    auto blocks = take_all(pool);
    free_blocks(d, pool, blocks);
    std::vector<cudaEvent_t> events;
    {
      std::lock_guard<std::mutex> lock{pool.mutex};
      events.swap(pool.spare_events);
    }
    for (auto e : events)
      if (cudaEventDestroy(e) != cudaSuccess)
        (void)cudaGetLastError();
  }
  if (device_count() == 0)
    return;
  impl::empty_pinned_cache();
}

} // namespace consort::cuda
