// The CUDA runtime wrappers of device/cuda/runtime.hpp: device discovery, error conversion, device
// guards, streams with bounded waits, caching allocators for device and pinned host memory, and
// copies.
//
// The caches are process-wide and never destroyed (see `process_state`): other static objects may
// release memory while the process exits, and cudaFree after the CUDA runtime has shut down is an
// error; the memory goes back with the process.

#include "device/cuda/runtime.hpp"

#include <consort/error.hpp>

#include "core/report.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace consort::cuda {

namespace {

// -- device discovery -----------------------------------------------------------------------------

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

std::string gpu_name(int device) {
  return "GPU:" + std::to_string(device);
}

std::string where(int device) {
  return device == host ? std::string{"host"} : gpu_name(device);
}

// -- size classes ---------------------------------------------------------------------------------

constexpr size_t min_block_bytes = 512;

/// The size class of a request of `bytes`: at least 512 bytes, then four classes per power of two
/// (p, 1.25p, 1.5p, 1.75p), so a block wastes at most a fifth of itself while a steady workload of
/// slightly varying sizes still hits the cache.
size_t size_class(size_t bytes) {
  if (bytes <= min_block_bytes)
    return min_block_bytes;
  const size_t power = std::bit_floor(bytes);
  if (bytes == power)
    return power;
  const size_t step = power / 4;
  return (bytes + step - 1) / step * step;
}

// -- process-wide state ---------------------------------------------------------------------------

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

/// The pinned host memory cache. Thread-safe: `mutex` guards every member.
struct pinned_pool {
  std::mutex mutex;
  std::map<size_t, std::vector<void*>> free_blocks;
  size_t cached_bytes = 0;
};

struct process_state {
  process_state() {
    for (int d = 0; d < device_count(); ++d)
      devices.push_back(std::make_unique<device_pool>());
  }
  std::vector<std::unique_ptr<device_pool>> devices; // fixed after construction
  pinned_pool pinned;
  std::mutex peer_mutex; // guards peer_checked
  std::set<std::pair<int, int>> peer_checked;
};

/// Storage for an object that is constructed on first use and never destroyed (as
/// absl::NoDestructor): placement new into static storage, so no `delete` exists to be missed.
template <class T>
class no_destructor {
public:
  no_destructor() { ::new (static_cast<void*>(storage_)) T(); }
  T& get() noexcept { return *std::launder(reinterpret_cast<T*>(storage_)); }

private:
  alignas(T) unsigned char storage_[sizeof(T)];
};

process_state& state() {
  static no_destructor<process_state> instance;
  return instance.get();
}

device_pool& pool_of(int device) {
  return *state().devices[static_cast<size_t>(device)];
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
  auto& s = state();
  {
    std::lock_guard<std::mutex> lock{s.peer_mutex};
    if (!s.peer_checked.insert({std::min(a, b), std::max(a, b)}).second)
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

} // namespace

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

// -- stream ---------------------------------------------------------------------------------------

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

// -- device memory --------------------------------------------------------------------------------

namespace {

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
  if (status == cudaErrorMemoryAllocation) {
    // Out of memory: give every cached block of this GPU back to CUDA (after its last use) and
    // retry once.
    (void)cudaGetLastError();
    auto blocks = take_all(pool);
    const size_t freed = blocks.size();
    free_blocks(device, pool, blocks);
    status = cudaMalloc(&p, cls);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_bytes = 0;
      size_t total_bytes = 0;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess)
        (void)cudaGetLastError();
      throw_error(errc::device_error, "cudaMalloc of " + std::to_string(bytes) +
                                          " bytes (size class " + std::to_string(cls) + ") on " +
                                          gpu_name(device) +
                                          " failed: out of memory (cudaErrorMemoryAllocation) even "
                                          "after emptying the cache of " +
                                          std::to_string(freed) + " cached blocks; the GPU has " +
                                          std::to_string(free_bytes) + " of " +
                                          std::to_string(total_bytes) + " bytes free");
    }
  }
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
    if (last_use != nullptr) {
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
      if (block.ready == nullptr && !idle_within(last_use, device, release_wait)) {
        // Without an event, the block may be cached only once its stream is idle. A stream that
        // fails, or is still busy after release_wait, keeps the block: it is leaked rather than
        // handed to another tensor while the GPU may still write it.
        return;
      }
    }
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
  auto& pinned = state().pinned;
  std::map<size_t, std::vector<void*>> blocks;
  {
    std::lock_guard<std::mutex> lock{pinned.mutex};
    blocks.swap(pinned.free_blocks);
    pinned.cached_bytes = 0;
  }
  for (auto& [cls, pointers] : blocks)
    for (void* p : pointers)
      if (cudaFreeHost(p) != cudaSuccess)
        (void)cudaGetLastError();
}

// -- pinned host memory ---------------------------------------------------------------------------

void* allocate_pinned(size_t bytes) {
  if (device_count() == 0)
    throw_error(errc::device_error, "allocate_pinned of " + std::to_string(bytes) +
                                        " bytes: page-locked memory needs a GPU, and this process "
                                        "sees none (" +
                                        unavailable_reason() + ")");
  auto& pool = state().pinned;
  const size_t cls = size_class(bytes);
  {
    std::lock_guard<std::mutex> lock{pool.mutex};
    auto it = pool.free_blocks.find(cls);
    if (it != pool.free_blocks.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      pool.cached_bytes -= cls;
      return p;
    }
  }
  void* p = nullptr;
  auto status = cudaMallocHost(&p, cls);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    std::map<size_t, std::vector<void*>> cached;
    {
      std::lock_guard<std::mutex> lock{pool.mutex};
      cached.swap(pool.free_blocks);
      pool.cached_bytes = 0;
    }
    for (auto& [c, pointers] : cached)
      for (void* q : pointers)
        if (cudaFreeHost(q) != cudaSuccess)
          (void)cudaGetLastError();
    status = cudaMallocHost(&p, cls);
  }
  check(status, ("cudaMallocHost of " + std::to_string(cls) + " bytes").c_str());
  return p;
}

void release_pinned(void* pointer, size_t bytes) noexcept {
  if (pointer == nullptr)
    return;
  auto& pool = state().pinned;
  const size_t cls = size_class(bytes);
  try {
    std::lock_guard<std::mutex> lock{pool.mutex};
    pool.free_blocks[cls].push_back(pointer);
    pool.cached_bytes += cls;
  } catch (...) {
    if (cudaFreeHost(pointer) != cudaSuccess)
      (void)cudaGetLastError();
  }
}

// -- copies ---------------------------------------------------------------------------------------

void copy_async(void* dst, int dst_device, const void* src, int src_device, size_t bytes,
                cudaStream_t stream) {
  if (bytes == 0)
    return;
  if (dst_device != host)
    require_device(dst_device);
  if (src_device != host)
    require_device(src_device);
  const auto what = "copy of " + std::to_string(bytes) + " bytes from " + where(src_device) +
                    " to " + where(dst_device);
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
  cudaMemcpyKind kind = cudaMemcpyHostToHost;
  if (src_device == host && dst_device != host)
    kind = cudaMemcpyHostToDevice;
  else if (src_device != host && dst_device == host)
    kind = cudaMemcpyDeviceToHost;
  else if (src_device != host)
    kind = cudaMemcpyDeviceToDevice;
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
  const auto what = "copy of " + std::to_string(bytes) + " bytes from " + where(src_device) +
                    " to " + where(dst_device);
  if (gpu == host) {
    synchronize_for(stream, gpu, timeout, what);
    return;
  }
  // Waits on the stream the copy went to: nullptr and cudaStreamPerThread name the stream of the
  // *current* device, which copy_async made `gpu` (the destination's, for nullptr) while queuing.
  device_guard guard{gpu};
  synchronize_for(stream, gpu, timeout, what);
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
