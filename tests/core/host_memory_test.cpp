// The host block cache (device/host_memory.hpp): blocks of 64 KiB and more come back from the
// cache when freed and asked for again; alignment; zero-fill of a reused block; the cache's bound;
// and use from many threads at once (run under TSan in CI).

#include "device/host_memory.hpp"

#include <consort/tensor.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace consort::detail {
namespace {

bool aligned_to(const std::byte* p, std::size_t alignment) {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

/// Whether the cache keeps the blocks these tests free (the sanitizer tier turns it off with
/// CONSORT_HOST_CACHE_MB=0, so that ASan sees every use after free; the tests then check that
/// nothing is kept).
bool caching() {
  return cache_limit_bytes() >= (std::size_t{8} << 20);
}

class HostMemoryTest : public ::testing::Test {
protected:
  // Every test starts and ends with an empty cache, whatever the other tests left in it.
  void SetUp() override { host_cache_release(); }
  void TearDown() override { host_cache_release(); }
};

TEST_F(HostMemoryTest, SmallBlocksComeFromTheHeapAlignedToACacheLine) {
  for (std::size_t bytes :
       {std::size_t{0}, std::size_t{1}, std::size_t{100}, pooled_min_bytes - 1}) {
    host_block b{bytes};
    ASSERT_NE(b.data(), nullptr) << bytes;
    EXPECT_TRUE(aligned_to(b.data(), 64)) << bytes;
    EXPECT_EQ(b.size(), bytes);
    EXPECT_FALSE(b.reused());
  }
  EXPECT_EQ(host_cache_now().cached_blocks, 0u) << "small blocks are not cached";
}

TEST_F(HostMemoryTest, AFreedBlockIsReusedByTheNextRequestOfItsSizeClass) {
  std::byte* first = nullptr;
  {
    host_block b{300 << 10};
    first = b.data();
    std::memset(b.data(), 7, b.size()); // touched: reuse must not pay for fresh pages again
    EXPECT_FALSE(b.reused());
  }
  EXPECT_EQ(host_cache_now().cached_blocks, caching() ? 1u : 0u);
  // 290 KiB is in the same class as 300 KiB (four classes per power of two: 256-320 KiB).
  host_block again{290 << 10};
  EXPECT_EQ(again.reused(), caching());
  if (caching()) {
    EXPECT_EQ(again.data(), first);
  }
  EXPECT_EQ(host_cache_now().cached_blocks, 0u);
  // Another class gets another block.
  host_block other{600 << 10};
  EXPECT_FALSE(other.reused());
}

TEST_F(HostMemoryTest, LargeBlocksAreHugePageAlignedAndReused) {
  std::byte* first = nullptr;
  {
    host_block b{(5 << 20) + 3};
    first = b.data();
    // Mapped with huge pages when the cache is on; a plain heap block (64-byte aligned) when off.
    EXPECT_TRUE(aligned_to(b.data(), caching() ? huge_page_bytes : 64));
    b.data()[b.size() - 1] = std::byte{1}; // the last requested byte is writable
  }
  host_block again{5 << 20};
  EXPECT_EQ(again.reused(), caching());
  if (caching()) {
    EXPECT_EQ(again.data(), first);
  }
}

TEST_F(HostMemoryTest, AZeroedBlockIsZeroAlsoWhenItIsReused) {
  for (std::size_t bytes : {std::size_t{100} << 10, std::size_t{3} << 20}) {
    {
      host_block dirty{bytes};
      std::memset(dirty.data(), 0xab, bytes);
    }
    auto b = host_block::zeroed(bytes);
    EXPECT_EQ(b.reused(), caching()) << bytes;
    EXPECT_TRUE(std::all_of(b.data(), b.data() + bytes, [](std::byte x) {
      return x == std::byte{0};
    })) << bytes;
  }
}

TEST_F(HostMemoryTest, TheCacheKeepsAtMostItsLimitAndReleasesEverything) {
  {
    // More than the limit at once (mapped, never touched, so this costs no memory).
    std::vector<host_block> blocks;
    const std::size_t each = std::size_t{64} << 20;
    for (std::size_t total = 0; total <= cache_limit_bytes() + each; total += each)
      blocks.emplace_back(each);
  }
  const auto kept = host_cache_now();
  EXPECT_LE(kept.cached_bytes, cache_limit_bytes());
  EXPECT_EQ(kept.cached_bytes, cache_limit_bytes()) << "the cache fills up to its limit";
  host_cache_release();
  EXPECT_EQ(host_cache_now().cached_bytes, 0u);
  EXPECT_EQ(host_cache_now().cached_blocks, 0u);
}

TEST_F(HostMemoryTest, TheLimitComesFromTheEnvironmentInMiB) {
  EXPECT_EQ(parse_cache_limit(nullptr), default_cache_limit_bytes);
  EXPECT_EQ(parse_cache_limit(""), default_cache_limit_bytes);
  EXPECT_EQ(parse_cache_limit("0"), 0u);
  EXPECT_EQ(parse_cache_limit("64"), std::size_t{64} << 20);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(parse_cache_limit("64M"), default_cache_limit_bytes);
  EXPECT_EQ(parse_cache_limit("-1"), default_cache_limit_bytes);
  EXPECT_EQ(parse_cache_limit("99999999999"), default_cache_limit_bytes);
  const auto warned = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warned.find("CONSORT_HOST_CACHE_MB=\"64M\" is not a size in MiB"), std::string::npos)
      << warned;
  EXPECT_NE(warned.find("using the default of 512 MiB"), std::string::npos) << warned;
}

TEST_F(HostMemoryTest, AMovedBlockIsFreedOnce) {
  host_block a{128 << 10};
  auto* p = a.data();
  host_block b{std::move(a)};
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(a.data(), nullptr); // NOLINT(bugprone-use-after-move): the moved-from state is empty
  host_block c;
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
  c = host_block{};
  EXPECT_EQ(host_cache_now().cached_blocks, caching() ? 1u : 0u);
}

TEST_F(HostMemoryTest, ThreadsAllocateAndFreeAtOnce) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) {
        host_block b{(std::size_t{64} << 10) * static_cast<std::size_t>(1 + (i + t) % 5)};
        b.data()[0] = std::byte{static_cast<unsigned char>(t)};
        b.data()[b.size() - 1] = b.data()[0];
      }
    });
  for (auto& th : threads)
    th.join();
  EXPECT_LE(host_cache_now().cached_blocks, 20u) << "at most one block per thread and class";
}

TEST_F(HostMemoryTest, TensorsUseTheCache) {
  const void* first = nullptr;
  {
    auto t = tensor::zeros(dtype::float32, {1 << 20});
    first = t.raw_data();
  }
  auto again = tensor::zeros(dtype::float32, {1 << 20});
  if (caching()) {
    EXPECT_EQ(again.raw_data(), first);
  }
  EXPECT_EQ(again.data<float>()[12345], 0.0f);
}

} // namespace
} // namespace consort::detail
