#pragma once

// What the files of the CUDA runtime wrappers (runtime.hpp) share:
//   devices.cpp        device discovery, error conversion, the device guard, device properties
//   streams.cpp        streams and bounded waits on them
//   device_memory.cpp  the caching allocator of device memory, and empty_cache
//   pinned_memory.cpp  the caching allocator of page-locked host memory
//   copies.cpp         host/device and peer-to-peer copies
// Private to device/cuda/, like runtime.hpp.

#include "device/cuda/runtime.hpp"

#include <bit>
#include <cstddef>
#include <new>
#include <string>

namespace consort::cuda::impl {

/// "GPU:<device>", as messages name a device.
std::string gpu_name(int device);

constexpr size_t min_block_bytes = 512;

/// The size class of a request of `bytes`: at least 512 bytes, then four classes per power of two
/// (p, 1.25p, 1.5p, 1.75p), so a block wastes at most a fifth of itself while a steady workload of
/// slightly varying sizes still hits the cache.
inline size_t size_class(size_t bytes) {
  if (bytes <= min_block_bytes)
    return min_block_bytes;
  const size_t power = std::bit_floor(bytes);
  if (bytes == power)
    return power;
  const size_t step = power / 4;
  return (bytes + step - 1) / step * step;
}

/// Storage for an object that is constructed on first use and never destroyed (as
/// absl::NoDestructor): placement new into static storage, so no `delete` exists to be missed.
/// The caches are process-wide and never destroyed: other static objects may release memory while
/// the process exits, and cudaFree after the CUDA runtime has shut down is an error; the memory
/// goes back with the process.
template <class T>
class no_destructor {
public:
  no_destructor() { ::new (static_cast<void*>(storage_)) T(); }
  T& get() noexcept { return *std::launder(reinterpret_cast<T*>(storage_)); }

private:
  alignas(T) unsigned char storage_[sizeof(T)];
};

/// Frees every cached block of page-locked host memory (cudaFreeHost); pinned_memory.cpp.
/// @pre this process sees a GPU.
void empty_pinned_cache() noexcept;

} // namespace consort::cuda::impl
