// The caching allocator of page-locked host memory (runtime.hpp: allocate_pinned,
// release_pinned), which stages host<->device copies so that cudaMemcpyAsync really is async.
// Blocks are kept by size class, like device memory (device_memory.cpp).

#include "device/cuda/runtime_impl.hpp"

#include <consort/error.hpp>

#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace consort::cuda {

using impl::size_class;

namespace {

/// The pinned host memory cache. Thread-safe: `mutex` guards every member.
struct pinned_pool {
  std::mutex mutex;
  std::map<size_t, std::vector<void*>> free_blocks;
  size_t cached_bytes = 0;
};

/// The process's cache (never destroyed: see impl::no_destructor).
pinned_pool& pinned() {
  static impl::no_destructor<pinned_pool> instance;
  return instance.get();
}

/// A cached block of class `cls`, or nullptr.
void* take_cached(pinned_pool& pool, size_t cls) {
  std::lock_guard<std::mutex> lock{pool.mutex};
  auto it = pool.free_blocks.find(cls);
  if (it == pool.free_blocks.end() || it->second.empty())
    return nullptr;
  void* p = it->second.back();
  it->second.pop_back();
  pool.cached_bytes -= cls;
  return p;
}

} // namespace

void impl::empty_pinned_cache() noexcept {
  auto& pool = pinned();
  std::map<size_t, std::vector<void*>> blocks;
  {
    std::lock_guard<std::mutex> lock{pool.mutex};
    blocks.swap(pool.free_blocks);
    pool.cached_bytes = 0;
  }
  for (auto& [cls, pointers] : blocks)
    for (void* p : pointers)
      if (cudaFreeHost(p) != cudaSuccess)
        (void)cudaGetLastError();
}

void* allocate_pinned(size_t bytes) {
  if (device_count() == 0)
    throw_error(errc::device_error, "allocate_pinned of " + std::to_string(bytes) +
                                        " bytes: page-locked memory needs a GPU, and this process "
                                        "sees none (" +
                                        unavailable_reason() + ")");
  const size_t cls = size_class(bytes);
  if (void* p = take_cached(pinned(), cls))
    return p;
  void* p = nullptr;
  auto status = cudaMallocHost(&p, cls);
  if (status == cudaErrorMemoryAllocation) {
    // Out of page-locked memory: give every cached block back and retry once.
    (void)cudaGetLastError();
    impl::empty_pinned_cache();
    status = cudaMallocHost(&p, cls);
  }
  check(status, ("cudaMallocHost of " + std::to_string(cls) + " bytes").c_str());
  return p;
}

void release_pinned(void* pointer, size_t bytes) noexcept {
  if (pointer == nullptr)
    return;
  auto& pool = pinned();
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

} // namespace consort::cuda
