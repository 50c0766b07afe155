// The process-wide cache of host blocks (see host_memory.hpp).

#include "device/host_memory.hpp"

#include <consort/error.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <sys/mman.h>

namespace consort::detail {

namespace {

constexpr std::size_t alignment = 64;

/// The size class of a pooled request: four classes per power of two (at most 25 % more than
/// asked), whole huge pages from `huge_page_bytes` on.
std::size_t size_class(std::size_t bytes) noexcept {
  const std::size_t floor = std::bit_floor(bytes);
  std::size_t c = bytes;
  if (floor != bytes) {
    const std::size_t step = floor / 4;
    c = (bytes + step - 1) / step * step;
  }
  if (c >= huge_page_bytes)
    c = (c + huge_page_bytes - 1) / huge_page_bytes * huge_page_bytes;
  return c;
}

/// Maps `length` bytes (a multiple of `huge_page_bytes`) at a 2 MiB boundary with huge-page
/// advice; null when mmap fails.
std::byte* map_huge(std::size_t length) noexcept {
  const std::size_t padded = length + huge_page_bytes;
  void* p = ::mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return nullptr;
  // Trim the mapping to an aligned `length`: drop the unaligned head and the tail beyond it.
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  const auto aligned = (addr + huge_page_bytes - 1) & ~std::uintptr_t{huge_page_bytes - 1};
  if (aligned > addr)
    ::munmap(p, aligned - addr);
  if (const auto tail = padded - (aligned - addr) - length; tail > 0)
    ::munmap(reinterpret_cast<void*>(aligned + length), tail);
#ifdef MADV_HUGEPAGE
  // Advice only: without THP the mapping still works with small pages.
  ::madvise(reinterpret_cast<void*>(aligned), length, MADV_HUGEPAGE);
#endif
  return reinterpret_cast<std::byte*>(aligned);
}

struct cached {
  std::byte* data;
  void* raw; // the heap block, or null for a mapping
};

/// Freed pooled blocks by size class.
///
/// Thread safety: thread-safe; `mtx_` guards the members.
class block_cache {
public:
  static block_cache& instance() {
    // Never destroyed: blocks may be freed by static destructors after this one would have run.
    static auto* cache = new block_cache;
    return *cache;
  }

  bool take(std::size_t capacity, cached& out) {
    std::lock_guard<std::mutex> guard{mtx_};
    auto it = free_.find(capacity);
    if (it == free_.end() || it->second.empty())
      return false;
    out = it->second.back();
    it->second.pop_back();
    bytes_ -= capacity;
    --blocks_;
    return true;
  }

  /// Keeps the block if there is room; false when the caller must free it.
  bool give(std::size_t capacity, const cached& block) {
    std::lock_guard<std::mutex> guard{mtx_};
    if (bytes_ + capacity > cache_limit_bytes())
      return false;
    free_[capacity].push_back(block);
    bytes_ += capacity;
    ++blocks_;
    return true;
  }

  host_cache_stats stats() {
    std::lock_guard<std::mutex> guard{mtx_};
    return {bytes_, blocks_};
  }

  std::vector<std::pair<std::size_t, cached>> drain() {
    std::lock_guard<std::mutex> guard{mtx_};
    std::vector<std::pair<std::size_t, cached>> all;
    for (auto& [capacity, blocks] : free_)
      for (auto& b : blocks)
        all.emplace_back(capacity, b);
    free_.clear();
    bytes_ = 0;
    blocks_ = 0;
    return all;
  }

private:
  std::mutex mtx_;
  std::map<std::size_t, std::vector<cached>> free_;
  std::size_t bytes_ = 0;
  std::size_t blocks_ = 0;
};

void free_block(std::size_t capacity, const cached& block) noexcept {
  if (block.raw != nullptr)
    std::free(block.raw);
  else
    ::munmap(block.data, capacity);
}

[[noreturn]] void out_of_memory(std::size_t bytes) {
  throw_error(errc::invalid_argument,
              "cannot allocate " + std::to_string(bytes) + " bytes of host memory: out of memory");
}

} // namespace

std::size_t parse_cache_limit(const char* text) noexcept {
  if (text == nullptr || *text == '\0')
    return default_cache_limit_bytes;
  char* end = nullptr;
  const unsigned long long mib = std::strtoull(text, &end, 10);
  if (*end != '\0' || *text == '-' || mib > (std::size_t{1} << 24)) {
    std::fprintf(stderr,
                 "consort: CONSORT_HOST_CACHE_MB=\"%s\" is not a size in MiB (0 to 16777216); "
                 "using the default of %zu MiB\n",
                 text, default_cache_limit_bytes >> 20);
    return default_cache_limit_bytes;
  }
  return static_cast<std::size_t>(mib) << 20;
}

std::size_t cache_limit_bytes() noexcept {
  static const std::size_t limit = parse_cache_limit(std::getenv("CONSORT_HOST_CACHE_MB"));
  return limit;
}

host_block::host_block(std::size_t bytes) : size_(bytes) {
  if (bytes < pooled_min_bytes || cache_limit_bytes() == 0) {
    // A plain heap block, at least one cache line so that `data()` is never null. With the cache
    // off every block is one: the sanitizers track heap blocks (not mappings), and their
    // allocator keeps its pages mapped, so a freed block is not first-touched again.
    raw_ = std::malloc(std::max<std::size_t>(bytes, 1) + alignment);
    if (raw_ == nullptr)
      out_of_memory(bytes);
    const auto addr = reinterpret_cast<std::uintptr_t>(raw_);
    data_ = reinterpret_cast<std::byte*>((addr + alignment - 1) & ~std::uintptr_t{alignment - 1});
    return;
  }
  capacity_ = size_class(bytes);
  cached block{};
  if (block_cache::instance().take(capacity_, block)) {
    data_ = block.data;
    raw_ = block.raw;
    reused_ = true;
    return;
  }
  if (capacity_ >= huge_page_bytes) {
    data_ = map_huge(capacity_);
    if (data_ == nullptr)
      out_of_memory(bytes);
    fresh_ = true;
    return;
  }
  raw_ = std::aligned_alloc(alignment, capacity_);
  if (raw_ == nullptr)
    out_of_memory(bytes);
  data_ = static_cast<std::byte*>(raw_);
}

host_block host_block::zeroed(std::size_t bytes) {
  host_block b{bytes};
  if (!b.fresh_)
    std::memset(b.data_, 0, bytes);
  return b;
}

host_block::host_block(host_block&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)),
      capacity_(std::exchange(other.capacity_, 0)), raw_(std::exchange(other.raw_, nullptr)),
      reused_(other.reused_), fresh_(other.fresh_) {}

host_block& host_block::operator=(host_block&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
    raw_ = std::exchange(other.raw_, nullptr);
    reused_ = other.reused_;
    fresh_ = other.fresh_;
  }
  return *this;
}

host_block::~host_block() {
  release();
}

void host_block::release() noexcept {
  if (data_ == nullptr)
    return;
  if (capacity_ == 0) {
    std::free(raw_);
  } else {
    const cached block{data_, raw_};
    if (!block_cache::instance().give(capacity_, block))
      free_block(capacity_, block);
  }
  data_ = nullptr;
  raw_ = nullptr;
}

host_cache_stats host_cache_now() noexcept {
  return block_cache::instance().stats();
}

void host_cache_release() noexcept {
  for (auto& [capacity, block] : block_cache::instance().drain())
    free_block(capacity, block);
}

} // namespace consort::detail
