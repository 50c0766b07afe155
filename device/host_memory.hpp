#pragma once

// Host memory for buffers of 64 KiB and more: tensors, the collective algorithms' scratch and the
// TCP transport's early messages, from one process-wide cache.
//
// Why a cache: on the VMs consort runs on, the kernel's first touch of a fresh page is expensive,
// far more than writing the same memory again, and much less so with huge pages (bench/README.md,
// "Large collectives across workers", has the measurement). glibc gives a freed block of more than
// 128 KiB-32 MiB back to the kernel, so a collective that allocates its scratch on every call paid
// for fresh pages on every call. Blocks here are rounded up to a size class (four per power of two,
// at most 25 % more than asked), kept when freed (up to `cache_limit_bytes()` in all), and reused
// by the next request of the same class; blocks of 2 MiB and more are mapped 2 MiB-aligned and
// marked for transparent huge pages. PyTorch's CPU allocator leaves this to the C library; its
// CUDA caching allocator is the same idea for device memory.

#include <cstddef>

namespace consort::detail {

/// Requests below this size are plain heap blocks (malloc's own caching serves them well).
inline constexpr std::size_t pooled_min_bytes = std::size_t{64} << 10;

/// Requests of this size or more are mapped with huge-page advice.
inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

/// Most bytes of freed blocks the cache keeps by default, over every size class. A block freed
/// beyond the limit is given back to the system. The environment variable
/// `CONSORT_HOST_CACHE_MB` sets another limit (in MiB; 0 turns the cache off, and every block is
/// then a plain heap block, which ASan tracks), read once.
inline constexpr std::size_t default_cache_limit_bytes = std::size_t{512} << 20;

/// The limit in force (the default, or `CONSORT_HOST_CACHE_MB`).
std::size_t cache_limit_bytes() noexcept;

/// The limit that `CONSORT_HOST_CACHE_MB` set to `text` (null: unset) gives; a value that is not a
/// whole number of MiB up to 2^24 gives the default, with a warning on stderr naming it.
std::size_t parse_cache_limit(const char* text) noexcept;

/// One block of host memory, 64-byte aligned (2 MiB for blocks of `huge_page_bytes` or more);
/// its bytes are not initialised unless it was made by `zeroed`. Returned to the cache when
/// destroyed.
///
/// Thread safety: a block is owned by one thread at a time; the cache behind it is thread-safe.
class host_block {
public:
  host_block() noexcept = default;

  /// `bytes` of uninitialised memory (a block of 0 bytes has a null `data()`).
  /// @throws error(invalid_argument) when memory is exhausted.
  explicit host_block(std::size_t bytes);

  /// `bytes` of zero-filled memory (a fresh mapping is zero already and costs no `memset`).
  static host_block zeroed(std::size_t bytes);

  host_block(host_block&& other) noexcept;
  host_block& operator=(host_block&& other) noexcept;
  host_block(const host_block&) = delete;
  host_block& operator=(const host_block&) = delete;
  ~host_block();

  std::byte* data() const noexcept { return data_; }

  /// The bytes requested.
  std::size_t size() const noexcept { return size_; }

  /// Whether the block came from the cache rather than from the system (for tests).
  bool reused() const noexcept { return reused_; }

private:
  void release() noexcept;

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0; // the size class (pooled) or 0 (a plain heap block)
  void* raw_ = nullptr;      // what malloc returned (plain and pooled heap blocks)
  bool reused_ = false;
  bool fresh_ = false; // a new mapping: zero-filled by the kernel
};

/// What the cache holds now (for tests and benchmarks).
struct host_cache_stats {
  std::size_t cached_bytes = 0; // freed blocks kept for reuse
  std::size_t cached_blocks = 0;
};

host_cache_stats host_cache_now() noexcept;

/// Gives every cached block back to the system.
void host_cache_release() noexcept;

} // namespace consort::detail
