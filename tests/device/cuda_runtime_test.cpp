// Tests of the CUDA runtime wrappers (device/cuda/runtime.hpp).
//
// The first group runs everywhere and checks what happens without a GPU (or with a GPU index that
// is not there): errors with the right code and a message that says why, never a crash. The second
// group needs a GPU and calls GTEST_SKIP with unavailable_reason() when there is none.

#include "device/cuda/runtime.hpp"
#include "support/stream_blocker.hpp"

#include <consort/error.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <set>
#include <string>
#include <vector>

namespace cuda = consort::cuda;
using consort::errc;
using consort::test::stream_blocker;
using namespace std::chrono_literals;

namespace {

#define CONSORT_TEST_REQUIRE_GPU()                                                                 \
  do {                                                                                             \
    if (cuda::device_count() == 0)                                                                 \
      GTEST_SKIP() << "no GPU: " << cuda::unavailable_reason();                                    \
  } while (false)

/// Runs `fn` and returns the consort::error it throws; fails the test when it throws nothing or
/// something else.
template <class F>
consort::error error_of(F&& fn) {
  try {
    fn();
  } catch (const consort::error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-consort exception: " << e.what();
    return consort::error{errc::none, e.what()};
  }
  ADD_FAILURE() << "threw nothing";
  return consort::error{errc::none, ""};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// -- without a GPU (and with indices that are not there)
// --------------------------------------------

TEST(CudaRuntimeTest, DeviceCountComesWithAReasonExactlyWhenItIsZero) {
  const int n = cuda::device_count();
  EXPECT_GE(n, 0);
  EXPECT_EQ(cuda::device_count(), n) << "the count is asked once and cached";
  if (n == 0)
    EXPECT_FALSE(cuda::unavailable_reason().empty());
  else
    EXPECT_EQ(cuda::unavailable_reason(), "");
}

TEST(CudaRuntimeTest, RequireDeviceThrowsUnknownDeviceSayingWhyForAnIndexThatIsNotThere) {
  const int n = cuda::device_count();
  auto e = error_of([&] { cuda::require_device(n); });
  EXPECT_EQ(e.code(), errc::unknown_device);
  EXPECT_TRUE(contains(e.what(), "GPU:" + std::to_string(n))) << e.what();
  if (n == 0)
    EXPECT_TRUE(contains(e.what(), cuda::unavailable_reason())) << e.what();
  else
    EXPECT_TRUE(contains(e.what(), "sees " + std::to_string(n) + " GPU")) << e.what();
  EXPECT_EQ(error_of([] { cuda::require_device(-1); }).code(), errc::unknown_device);
}

TEST(CudaRuntimeTest, CheckThrowsDeviceErrorNamingTheCallTheDeviceAndCudasText) {
  EXPECT_NO_THROW(cuda::check(cudaSuccess, "cudaFoo", 1));
  auto e = error_of([] { cuda::check(cudaErrorInvalidValue, "cudaFoo", 1); });
  EXPECT_EQ(e.code(), errc::device_error);
  const std::string what = e.what();
  EXPECT_TRUE(contains(what, "cudaFoo")) << what;
  EXPECT_TRUE(contains(what, "GPU:1")) << what;
  EXPECT_TRUE(contains(what, "cudaErrorInvalidValue")) << what;
  EXPECT_TRUE(contains(what, cudaGetErrorString(cudaErrorInvalidValue))) << what;

  auto without_device = error_of([] { cuda::check(cudaErrorInvalidValue, "cudaBar"); });
  EXPECT_TRUE(contains(without_device.what(), "cudaBar")) << without_device.what();
  EXPECT_FALSE(contains(without_device.what(), "GPU:")) << without_device.what();
}

TEST(CudaRuntimeTest, EveryEntryPointRejectsAMissingDeviceWithoutCrashing) {
  const int missing = cuda::device_count();
  EXPECT_EQ(error_of([&] { cuda::device_guard guard{missing}; }).code(), errc::unknown_device);
  EXPECT_EQ(error_of([&] { cuda::stream s{missing}; }).code(), errc::unknown_device);
  EXPECT_EQ(error_of([&] { (void)cuda::allocate(missing, 1024); }).code(), errc::unknown_device);
  EXPECT_EQ(error_of([&] { (void)cuda::properties(missing); }).code(), errc::unknown_device);
  std::vector<char> buffer(16);
  EXPECT_EQ(error_of([&] {
              cuda::copy_async(buffer.data(), cuda::host, buffer.data(), missing, 16, nullptr);
            }).code(),
            errc::unknown_device);
  // Releasing to a device that is not there is a no-op, and so is emptying the caches.
  int dummy = 0;
  cuda::release(missing, &dummy, sizeof(dummy));
  EXPECT_EQ(cuda::cached_bytes(missing), 0u);
  cuda::empty_cache();
}

TEST(CudaRuntimeTest, PinnedAllocationWithoutAGpuThrowsDeviceErrorWithTheReason) {
  if (cuda::device_count() > 0)
    GTEST_SKIP() << "this process sees a GPU; the no-GPU error path cannot be reached";
  auto e = error_of([] { (void)cuda::allocate_pinned(4096); });
  EXPECT_EQ(e.code(), errc::device_error);
  EXPECT_TRUE(contains(e.what(), cuda::unavailable_reason())) << e.what();
}

TEST(CudaRuntimeTest, SynchronizeOnADefaultConstructedStreamIsAnInvalidArgument) {
  cuda::stream s;
  EXPECT_FALSE(s);
  auto e = error_of([&] { s.synchronize_for(10ms, "the test's wait"); });
  EXPECT_EQ(e.code(), errc::invalid_argument);
  EXPECT_TRUE(contains(e.what(), "the test's wait")) << e.what();
}

TEST(CudaRuntimeTest, ZeroByteCopiesQueueNothing) {
  // Needs no device at all: nothing is validated or queued for an empty copy.
  EXPECT_NO_THROW(cuda::copy_async(nullptr, 0, nullptr, cuda::host, 0, nullptr));
}

// -- with a GPU
// -------------------------------------------------------------------------------------

TEST(CudaRuntimeTest, RequireDeviceAcceptsEveryVisibleGpu) {
  CONSORT_TEST_REQUIRE_GPU();
  for (int d = 0; d < cuda::device_count(); ++d)
    EXPECT_NO_THROW(cuda::require_device(d));
}

TEST(CudaRuntimeTest, DeviceGuardSelectsTheDeviceAndRestoresThePreviousOne) {
  CONSORT_TEST_REQUIRE_GPU();
  const int last = cuda::device_count() - 1;
  cuda::check(cudaSetDevice(0), "cudaSetDevice");
  {
    cuda::device_guard guard{last};
    int current = -1;
    cuda::check(cudaGetDevice(&current), "cudaGetDevice");
    EXPECT_EQ(current, last);
  }
  int current = -1;
  cuda::check(cudaGetDevice(&current), "cudaGetDevice");
  EXPECT_EQ(current, 0);
}

TEST(CudaRuntimeTest, StreamsAreNonBlockingAndMovable) {
  CONSORT_TEST_REQUIRE_GPU();
  cuda::stream a{0};
  ASSERT_TRUE(a);
  EXPECT_EQ(a.device(), 0);
  unsigned flags = 0;
  cuda::check(cudaStreamGetFlags(a.get(), &flags), "cudaStreamGetFlags");
  EXPECT_EQ(flags & cudaStreamNonBlocking, cudaStreamNonBlocking);
  const auto handle = a.get();
  cuda::stream b{std::move(a)};
  EXPECT_FALSE(a);
  EXPECT_EQ(b.get(), handle);
  cuda::stream c{0};
  c = std::move(b);
  EXPECT_EQ(c.get(), handle);
  EXPECT_NO_THROW(c.synchronize_for(10s, "an idle stream"));
}

TEST(CudaRuntimeTest, SynchronizeForThrowsCollectiveTimeoutNamingTheWaitWhenTheDeadlinePasses) {
  CONSORT_TEST_REQUIRE_GPU();
  cuda::stream s{0};
  stream_blocker blocker{s.get()};
  const auto start = std::chrono::steady_clock::now();
  auto e = error_of([&] { s.synchronize_for(50ms, "the blocked test stream"); });
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(e.code(), errc::collective_timeout);
  EXPECT_TRUE(contains(e.what(), "the blocked test stream")) << e.what();
  EXPECT_TRUE(contains(e.what(), "GPU:0")) << e.what();
  EXPECT_GE(waited, 50ms);
  EXPECT_LT(waited, 5s);
  blocker.release();
  EXPECT_NO_THROW(s.synchronize_for(20s, "the released test stream"));
  // The NotReady polls left no error behind for the next CUDA call to report.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaRuntimeTest, AllocatorReusesAReleasedBlockOfTheSameSizeClass) {
  CONSORT_TEST_REQUIRE_GPU();
  cuda::empty_cache();
  void* p = cuda::allocate(0, 1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(cuda::cached_bytes(0), 0u);
  cuda::release(0, p, 1000);
  EXPECT_GE(cuda::cached_bytes(0), 1000u);
  void* q = cuda::allocate(0, 1000);
  EXPECT_EQ(q, p) << "a released idle block must be reused";
  EXPECT_EQ(cuda::cached_bytes(0), 0u);
  // A much larger request is another size class: a new block.
  void* big = cuda::allocate(0, size_t{1} << 20);
  EXPECT_NE(big, p);
  cuda::release(0, big, size_t{1} << 20);
  cuda::release(0, q, 1000);
  cuda::empty_cache();
  EXPECT_EQ(cuda::cached_bytes(0), 0u);
}

TEST(CudaRuntimeTest, AllocatorDoesNotReuseABlockBeforeItsLastUseStreamFinished) {
  CONSORT_TEST_REQUIRE_GPU();
  cuda::empty_cache();
  cuda::stream s{0};
  constexpr size_t bytes = 4096;
  void* p = cuda::allocate(0, bytes);
  stream_blocker blocker{s.get()};
  cuda::release(0, p, bytes, s.get());
  void* q = cuda::allocate(0, bytes);
  EXPECT_NE(q, p) << "the block was reused while its last-use stream was still busy";
  blocker.release();
  s.synchronize_for(20s, "the released test stream");
  cuda::release(0, q, bytes);
  // Both blocks are idle now: both are reused, and no third block is made.
  void* r1 = cuda::allocate(0, bytes);
  void* r2 = cuda::allocate(0, bytes);
  EXPECT_EQ((std::set<void*>{r1, r2}), (std::set<void*>{p, q}));
  cuda::release(0, r1, bytes);
  cuda::release(0, r2, bytes);
  cuda::empty_cache();
}

TEST(CudaRuntimeTest, AllocatingMoreThanTheGpuHasThrowsDeviceErrorAndLeavesNoErrorBehind) {
  CONSORT_TEST_REQUIRE_GPU();
  const auto props = cuda::properties(0);
  const size_t too_much = props.total_memory * 4;
  auto e = error_of([&] { (void)cuda::allocate(0, too_much); });
  EXPECT_EQ(e.code(), errc::device_error);
  EXPECT_TRUE(contains(e.what(), "out of memory")) << e.what();
  EXPECT_TRUE(contains(e.what(), "GPU:0")) << e.what();
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // The allocator still works.
  void* p = cuda::allocate(0, 512);
  cuda::release(0, p, 512);
}

TEST(CudaRuntimeTest, CopiesRoundTripHostToDeviceToDeviceToHost) {
  CONSORT_TEST_REQUIRE_GPU();
  cuda::stream s{0};
  for (size_t bytes : {size_t{1}, size_t{4097}, size_t{3} << 20}) {
    SCOPED_TRACE(bytes);
    std::vector<unsigned char> source(bytes);
    std::iota(source.begin(), source.end(), static_cast<unsigned char>(bytes));
    void* a = cuda::allocate(0, bytes);
    void* b = cuda::allocate(0, bytes);
    cuda::check(cudaMemsetAsync(b, 0xAB, bytes, s.get()), "cudaMemsetAsync");
    // Pageable host memory.
    cuda::copy(a, 0, source.data(), cuda::host, bytes, s.get());
    cuda::copy_async(b, 0, a, 0, bytes, s.get());
    std::vector<unsigned char> back(bytes, 0);
    cuda::copy(back.data(), cuda::host, b, 0, bytes, s.get());
    EXPECT_EQ(back, source);
    // Pinned host memory, asynchronous both ways.
    auto* pinned = static_cast<unsigned char*>(cuda::allocate_pinned(bytes));
    std::memset(pinned, 0, bytes);
    cuda::copy_async(pinned, cuda::host, a, 0, bytes, s.get());
    s.synchronize_for(20s, "the pinned copy");
    EXPECT_EQ(std::memcmp(pinned, source.data(), bytes), 0);
    cuda::release_pinned(pinned, bytes);
    cuda::release(0, a, bytes, s.get());
    cuda::release(0, b, bytes, s.get());
  }
}

TEST(CudaRuntimeTest, PeerCopiesBetweenTwoGpusRoundTrip) {
  CONSORT_TEST_REQUIRE_GPU();
  if (cuda::device_count() < 2)
    GTEST_SKIP() << "needs two GPUs; this process sees " << cuda::device_count();
  constexpr size_t bytes = (size_t{1} << 20) + 3;
  std::vector<unsigned char> source(bytes);
  std::iota(source.begin(), source.end(), static_cast<unsigned char>(7));
  cuda::stream s{1};
  void* on0 = cuda::allocate(0, bytes);
  void* on1 = cuda::allocate(1, bytes);
  cuda::copy(on0, 0, source.data(), cuda::host, bytes, s.get());
  cuda::copy(on1, 1, on0, 0, bytes, s.get());
  std::vector<unsigned char> back(bytes, 0);
  cuda::copy(back.data(), cuda::host, on1, 1, bytes, s.get());
  EXPECT_EQ(back, source);
  cuda::release(0, on0, bytes);
  cuda::release(1, on1, bytes);
}

TEST(CudaRuntimeTest, PinnedBlocksAreReused) {
  CONSORT_TEST_REQUIRE_GPU();
  void* p = cuda::allocate_pinned(10000);
  ASSERT_NE(p, nullptr);
  cuda::release_pinned(p, 10000);
  void* q = cuda::allocate_pinned(10000);
  EXPECT_EQ(q, p);
  cuda::release_pinned(q, 10000);
}

TEST(CudaRuntimeTest, PropertiesDescribeTheDevice) {
  CONSORT_TEST_REQUIRE_GPU();
  const auto p = cuda::properties(0);
  EXPECT_FALSE(p.name.empty());
  EXPECT_GT(p.total_memory, 0u);
  EXPECT_GT(p.sm_count, 0);
  EXPECT_GE(p.major, 1);
  // Every current NVIDIA GPU reports its memory clock and bus width.
  EXPECT_GT(p.memory_clock_khz, 0);
  EXPECT_GT(p.memory_bus_bits, 0);
  EXPECT_DOUBLE_EQ(p.peak_bandwidth, 2.0 * p.memory_clock_khz * 1e3 * p.memory_bus_bits / 8.0);
}

} // namespace
