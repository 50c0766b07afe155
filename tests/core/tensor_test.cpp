#include "support/expect_error.hpp"

#include <consort/config.hpp>
#include <consort/tensor.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

using consort::dtype;
using consort::errc;
using consort::shape_t;
using consort::tensor;
using consort::test::fails_with;

namespace {

const std::byte* bytes_of(const tensor& t) {
  return static_cast<const std::byte*>(t.raw_data());
}

} // namespace

// -- dtype and shape ------------------------------------------------------------------------------

TEST(TensorTest, DtypeNamesAndSizes) {
  EXPECT_STREQ(to_string(dtype::float32), "float32");
  EXPECT_STREQ(to_string(dtype::float64), "float64");
  EXPECT_STREQ(to_string(dtype::int32), "int32");
  EXPECT_STREQ(to_string(dtype::int64), "int64");
  EXPECT_STREQ(to_string(dtype::uint8), "uint8");
  EXPECT_STREQ(to_string(dtype::boolean), "bool");
  EXPECT_EQ(size_of(dtype::float32), 4u);
  EXPECT_EQ(size_of(dtype::float64), 8u);
  EXPECT_EQ(size_of(dtype::int32), 4u);
  EXPECT_EQ(size_of(dtype::int64), 8u);
  EXPECT_EQ(size_of(dtype::uint8), 1u);
  EXPECT_EQ(size_of(dtype::boolean), 1u);
  EXPECT_TRUE(is_floating(dtype::float32));
  EXPECT_FALSE(is_floating(dtype::int64));
}

TEST(TensorTest, ShapeToStringAndElementCount) {
  EXPECT_EQ(consort::to_string(shape_t{}), "[]");
  EXPECT_EQ(consort::to_string(shape_t{2, 3}), "[2, 3]");
  EXPECT_EQ(consort::num_elements(shape_t{}), 1);
  EXPECT_EQ(consort::num_elements(shape_t{2, 3, 4}), 24);
  EXPECT_EQ(consort::num_elements(shape_t{2, 0}), 0);
}

// -- construction ---------------------------------------------------------------------------------

TEST(TensorTest, ZerosIsZeroFilledAndCacheLineAlignedForEveryDtype) {
  for (auto type :
       {dtype::float32, dtype::float64, dtype::int32, dtype::int64, dtype::uint8, dtype::boolean}) {
    SCOPED_TRACE(to_string(type));
    auto t = tensor::zeros(type, {3, 5});
    EXPECT_TRUE(t.valid());
    EXPECT_EQ(t.dtype(), type);
    EXPECT_EQ(t.shape(), (shape_t{3, 5}));
    EXPECT_EQ(t.rank(), 2);
    EXPECT_EQ(t.num_elements(), 15);
    EXPECT_EQ(t.num_bytes(), 15 * size_of(type));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u);
    for (size_t i = 0; i < t.num_bytes(); ++i)
      ASSERT_EQ(bytes_of(t)[i], std::byte{0});
  }
}

TEST(TensorTest, LargeTensorsAreZeroFilledAlignedAndCopiedOnWrite) {
  // 12 MiB: large enough for the huge-page mapping path of the storage.
  const int64_t n = (int64_t{12} << 20) / 4 + 3;
  auto t = tensor::zeros(dtype::int32, {n});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw_data()) % 64, 0u);
  const auto* p = t.data<int32_t>();
  for (int64_t i = 0; i < n; i += 4093)
    ASSERT_EQ(p[i], 0) << i;
  ASSERT_EQ(p[n - 1], 0);
  t.mutable_data<int32_t>()[n - 1] = 5;
  tensor copy = t;
  copy.mutable_data<int32_t>()[n - 1] = 6;
  EXPECT_EQ(t.data<int32_t>()[n - 1], 5);
  EXPECT_EQ(copy.data<int32_t>()[n - 1], 6);
  EXPECT_EQ(t.slice(n - 1, n).item<int32_t>(), 5);
  EXPECT_EQ(t.clone(), t);
}

TEST(TensorTest, ZerosOfNoElementsStillHasStorage) {
  auto t = tensor::zeros(dtype::float32, {0, 4});
  EXPECT_TRUE(t.valid());
  EXPECT_NE(t.raw_data(), nullptr);
  EXPECT_EQ(t.num_bytes(), 0u);
}

TEST(TensorTest, ZerosRejectsANegativeExtent) {
  EXPECT_TRUE(fails_with(
      [] {
        tensor::zeros(dtype::float32, {2, -1});
      },
      errc::invalid_argument, {"[2, -1]", "negative"}));
}

TEST(TensorTest, ZerosCanonicalisesTheDevice) {
  EXPECT_EQ(tensor::zeros(dtype::int32, {1}, "cpu:1").device(), "CPU:1");
  EXPECT_EQ(tensor::zeros(dtype::int32, {1}, "/job:worker/replica:0/task:0/device:CPU:2").device(),
            "CPU:2");
  EXPECT_EQ(tensor::zeros(dtype::int32, {1}).device(), "CPU:0");
  // Canonical names are taken as they are; near misses still go through the parse.
  EXPECT_EQ(tensor::zeros(dtype::int32, {1}, "CPU:12").device(), "CPU:12");
  EXPECT_EQ(tensor::zeros(dtype::int32, {1}, "CPU:007").device(), "CPU:7");
  EXPECT_EQ(tensor::zeros(dtype::int32, {1}, "CPU:00").device(), "CPU:0");
  EXPECT_TRUE(
      fails_with([] { tensor::zeros(dtype::int32, {1}, "CPU:"); }, errc::unknown_device, {"CPU:"}));
  EXPECT_TRUE(fails_with([] { tensor::zeros(dtype::int32, {1}, "CPU:1x"); }, errc::unknown_device,
                         {"CPU:1x"}));
  EXPECT_TRUE(fails_with([] { tensor::zeros(dtype::int32, {1}, "CPU:99999999999"); },
                         errc::unknown_device, {"CPU:99999999999"}));
}

TEST(TensorTest, ZerosOnAMissingGpuAndOnAnUnknownDeviceFail) {
#if CONSORT_WITH_CUDA
  // No machine has 1000 GPUs: the error names the device and says how many GPUs there are (or
  // why there are none).
  EXPECT_TRUE(fails_with([] { tensor::zeros(dtype::int32, {1}, "GPU:999"); }, errc::unknown_device,
                         {"GPU:999", "GPU"}));
  EXPECT_TRUE(fails_with(
      [] {
        tensor::from<float>({1, 2}, {2}, "GPU:999");
      },
      errc::unknown_device, {"GPU:999"}));
#else
  EXPECT_TRUE(fails_with([] { tensor::zeros(dtype::int32, {1}, "GPU:0"); }, errc::unsupported,
                         {"GPU:0", "CUDA"}));
#endif
  EXPECT_TRUE(fails_with([] { tensor::zeros(dtype::int32, {1}, "TPU:0"); }, errc::unknown_device,
                         {"TPU:0"}));
}

TEST(TensorTest, FromRoundTripsValuesOfEveryDtype) {
  EXPECT_EQ(tensor::from<float>({1.5f, -2.f, 3.f}).to_vector<float>(),
            (std::vector<float>{1.5f, -2.f, 3.f}));
  EXPECT_EQ(tensor::from<double>({1e300, -0.5}).to_vector<double>(),
            (std::vector<double>{1e300, -0.5}));
  EXPECT_EQ(tensor::from<int32_t>({-7, 8}).to_vector<int32_t>(), (std::vector<int32_t>{-7, 8}));
  EXPECT_EQ(tensor::from<int64_t>({int64_t{1} << 40}).to_vector<int64_t>(),
            (std::vector<int64_t>{int64_t{1} << 40}));
  EXPECT_EQ(tensor::from<uint8_t>({0, 255}).to_vector<uint8_t>(), (std::vector<uint8_t>{0, 255}));
  EXPECT_EQ(tensor::from<bool>({true, false, true}).to_vector<bool>(),
            (std::vector<bool>{true, false, true}));
  auto t = tensor::from<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(t.shape(), (shape_t{2, 3}));
  EXPECT_EQ(t.data<int32_t>()[4], 5);
}

TEST(TensorTest, FromRejectsAValueCountThatDoesNotFitTheShape) {
  EXPECT_TRUE(fails_with(
      [] {
        tensor::from<float>({1, 2, 3, 4, 5}, {2, 3});
      },
      errc::shape_mismatch, {"5 values", "[2, 3]", "6"}));
}

TEST(TensorTest, ScalarHasRankZeroAndOneElement) {
  auto t = tensor::scalar(2.5);
  EXPECT_EQ(t.rank(), 0);
  EXPECT_EQ(t.num_elements(), 1);
  EXPECT_EQ(t.dtype(), dtype::float64);
  EXPECT_EQ(t.item<double>(), 2.5);
}

TEST(TensorTest, DefaultConstructedTensorIsInvalidAndCannotBeWritten) {
  tensor t;
  EXPECT_FALSE(t.valid());
  EXPECT_EQ(t.raw_data(), nullptr);
  EXPECT_TRUE(
      fails_with([&] { t.raw_mutable_data(); }, errc::invalid_argument, {"default-constructed"}));
  EXPECT_EQ(t, tensor{});
  EXPECT_NE(t, tensor::scalar(0.f));
}

TEST(TensorTest, TypedAccessWithTheWrongTypeNamesBothDtypes) {
  auto t = tensor::from<float>({1.f});
  EXPECT_TRUE(fails_with([&] { t.data<double>(); }, errc::dtype_mismatch, {"float32", "float64"}));
  EXPECT_TRUE(
      fails_with([&] { t.mutable_data<int32_t>(); }, errc::dtype_mismatch, {"float32", "int32"}));
  EXPECT_TRUE(
      fails_with([&] { t.to_vector<uint8_t>(); }, errc::dtype_mismatch, {"float32", "uint8"}));
}

// -- sharing and copy-on-write --------------------------------------------------------------------

TEST(TensorTest, CopiesShareStorage) {
  auto a = tensor::from<int32_t>({1, 2, 3});
  tensor b = a;
  EXPECT_TRUE(b.shares_storage_with(a));
  EXPECT_EQ(b.raw_data(), a.raw_data());
}

TEST(TensorTest, MutatingACopyDoesNotChangeTheOriginal) {
  auto a = tensor::from<int32_t>({1, 2, 3});
  tensor b = a;
  b.mutable_data<int32_t>()[0] = 42;
  EXPECT_EQ(a.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(b.to_vector<int32_t>(), (std::vector<int32_t>{42, 2, 3}));
  EXPECT_FALSE(b.shares_storage_with(a));
}

TEST(TensorTest, MutatingTheOriginalDoesNotChangeACopy) {
  auto a = tensor::from<int32_t>({1, 2, 3});
  tensor b = a;
  a.mutable_data<int32_t>()[2] = 9;
  EXPECT_EQ(b.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(a.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 9}));
}

TEST(TensorTest, MutatingAnUnsharedTensorWritesInPlace) {
  auto a = tensor::from<int32_t>({1, 2, 3});
  const void* before = a.raw_data();
  a.mutable_data<int32_t>()[0] = 5;
  EXPECT_EQ(a.raw_data(), before);
  EXPECT_EQ(a.to_vector<int32_t>()[0], 5);
}

// -- views ----------------------------------------------------------------------------------------

TEST(TensorTest, SliceSharesStorageWithoutCopying) {
  auto t = tensor::from<float>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {4, 3});
  auto s = t.slice(1, 3);
  EXPECT_EQ(s.shape(), (shape_t{2, 3}));
  EXPECT_EQ(bytes_of(s), bytes_of(t) + 3 * sizeof(float));
  EXPECT_EQ(s.to_vector<float>(), (std::vector<float>{3, 4, 5, 6, 7, 8}));
  EXPECT_FALSE(s.shares_storage_with(t)); // same storage, another offset
  EXPECT_TRUE(t.slice(0, 4).shares_storage_with(t));
}

TEST(TensorTest, SliceOfASliceAddsOffsets) {
  auto t = tensor::from<int64_t>({0, 1, 2, 3, 4, 5, 6, 7});
  auto s = t.slice(2, 7).slice(1, 3);
  EXPECT_EQ(s.to_vector<int64_t>(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(bytes_of(s), bytes_of(t) + 3 * sizeof(int64_t));
}

TEST(TensorTest, WritingToASliceLeavesTheSourceUnchanged) {
  auto t = tensor::from<int32_t>({0, 1, 2, 3});
  auto s = t.slice(2, 4);
  s.mutable_data<int32_t>()[0] = 99;
  EXPECT_EQ(s.to_vector<int32_t>(), (std::vector<int32_t>{99, 3}));
  EXPECT_EQ(t.to_vector<int32_t>(), (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(TensorTest, EmptySliceHasExtentZeroAlongAxisZero) {
  auto t = tensor::from<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto s = t.slice(2, 2);
  EXPECT_EQ(s.shape(), (shape_t{0, 3}));
  EXPECT_EQ(s.num_elements(), 0);
  EXPECT_TRUE(s.to_vector<float>().empty());
}

TEST(TensorTest, SliceRejectsBadBoundsAndScalars) {
  auto t = tensor::from<float>({1, 2, 3});
  EXPECT_TRUE(
      fails_with([&] { t.slice(2, 4); }, errc::out_of_range, {"[2, 4)", "[3]", "end <= 3"}));
  EXPECT_TRUE(fails_with([&] { t.slice(-1, 1); }, errc::out_of_range, {"[-1, 1)"}));
  EXPECT_TRUE(fails_with([&] { t.slice(2, 1); }, errc::out_of_range, {"[2, 1)"}));
  EXPECT_TRUE(fails_with([] { tensor::scalar(1).slice(0, 1); }, errc::out_of_range, {"rank >= 1"}));
}

TEST(TensorTest, ReshapeSharesStorageAndKeepsRowMajorOrder) {
  auto t = tensor::from<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  auto r = t.reshape({3, 2});
  EXPECT_TRUE(r.shares_storage_with(t));
  EXPECT_EQ(r.shape(), (shape_t{3, 2}));
  EXPECT_EQ(r.to_vector<int32_t>(), t.to_vector<int32_t>());
  EXPECT_EQ(t.reshape({-1}).shape(), (shape_t{6}));
  EXPECT_EQ(t.reshape({2, -1, 1}).shape(), (shape_t{2, 3, 1}));
}

TEST(TensorTest, ReshapeRejectsAnotherElementCount) {
  auto t = tensor::from<int32_t>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_TRUE(fails_with(
      [&] {
        t.reshape({4, 2});
      },
      errc::shape_mismatch, {"[2, 3]", "[4, 2]", "6", "8"}));
  EXPECT_TRUE(fails_with([&] { t.reshape({4, -1}); }, errc::shape_mismatch, {"[4, -1]"}));
  EXPECT_TRUE(fails_with([&] { t.reshape({-1, -1}); }, errc::invalid_argument, {"[-1, -1]"}));
  EXPECT_TRUE(fails_with([&] { t.reshape({-2, -3}); }, errc::invalid_argument, {"[-2, -3]"}));
}

TEST(TensorTest, ToAnotherCpuDeviceRelabelsAndSharesStorage) {
  auto t = tensor::from<float>({1, 2});
  auto moved = t.to("/job:worker/replica:0/task:0/device:cpu:3");
  EXPECT_EQ(moved.device(), "CPU:3");
  EXPECT_EQ(t.device(), "CPU:0");
  EXPECT_TRUE(moved.shares_storage_with(t));
}

TEST(TensorTest, ToAMissingGpuFailsClearly) {
  auto t = tensor::from<float>({1, 2});
#if CONSORT_WITH_CUDA
  EXPECT_TRUE(fails_with([&] { t.to("GPU:999"); }, errc::unknown_device, {"GPU:999"}));
  EXPECT_FALSE(t.on_gpu());
#else
  EXPECT_TRUE(fails_with([&] { t.to("GPU:0"); }, errc::unsupported,
                         {"GPU tensors need CUDA support, which this build lacks"}));
#endif
  EXPECT_TRUE(fails_with([&] { t.to("XPU:0"); }, errc::unknown_device, {"XPU:0"}));
}

TEST(TensorTest, CloneCopiesTheBytesIntoStorageOfItsOwn) {
  auto t = tensor::from<int32_t>({1, 2, 3, 4}, {2, 2});
  auto s = t.slice(1, 2);
  auto c = s.clone();
  EXPECT_FALSE(c.shares_storage_with(s));
  EXPECT_EQ(c, s);
  EXPECT_EQ(c.shape(), (shape_t{1, 2}));
  const void* before = c.raw_data();
  c.mutable_data<int32_t>()[0] = 7;
  EXPECT_EQ(c.raw_data(), before); // the clone is unshared, so it is written in place
  EXPECT_EQ(t.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c.raw_data()) % 64, 0u);
}

TEST(TensorTest, EqualityComparesDtypeShapeAndBytes) {
  auto a = tensor::from<int32_t>({1, 2, 3, 4}, {2, 2});
  EXPECT_EQ(a, tensor::from<int32_t>({1, 2, 3, 4}, {2, 2}));
  EXPECT_NE(a, tensor::from<int32_t>({1, 2, 3, 5}, {2, 2}));
  EXPECT_NE(a, tensor::from<int32_t>({1, 2, 3, 4}, {4}));
  EXPECT_NE(a, tensor::from<float>({1, 2, 3, 4}, {2, 2}));
  EXPECT_EQ(a.slice(1, 2), tensor::from<int32_t>({3, 4}, {1, 2}));
  EXPECT_EQ(tensor::zeros(dtype::float32, {0}), tensor::zeros(dtype::float32, {0}));
}

TEST(TensorTest, ToStringShowsDtypeShapeAndAtMostMaxElements) {
  auto t = tensor::from<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(t.to_string(), "float32[2, 3]{1, 2, 3, 4, 5, 6}");
  EXPECT_EQ(t.to_string(3), "float32[2, 3]{1, 2, 3, ...}");
  EXPECT_EQ(t.to_string(0), "float32[2, 3]{...}");
  EXPECT_EQ(tensor::from<bool>({true, false}).to_string(), "bool[2]{true, false}");
  EXPECT_EQ(tensor::scalar(1.5).to_string(), "float64[]{1.5}");
  EXPECT_EQ(tensor::from<uint8_t>({200}).to_string(), "uint8[1]{200}");
  EXPECT_EQ(tensor::from<int64_t>({-3}).to_string(), "int64[1]{-3}");
  EXPECT_EQ(tensor{}.to_string(), "tensor(invalid)");
}

TEST(TensorTest, ItemConvertsTheSingleElementFromAnyDtype) {
  EXPECT_EQ(tensor::scalar<int32_t>(7).item<double>(), 7.0);
  EXPECT_EQ(tensor::scalar(2.75f).item<int32_t>(), 2);
  EXPECT_EQ(tensor::scalar(2.75).item<float>(), 2.75f);
  EXPECT_EQ(tensor::scalar<int64_t>(200).item<uint8_t>(), 200);
  EXPECT_EQ(tensor::scalar<uint8_t>(255).item<int64_t>(), 255);
  EXPECT_FALSE(tensor::scalar(0.0).item<bool>());
  EXPECT_TRUE(tensor::scalar(0.5).item<bool>());
  EXPECT_EQ(tensor::scalar(true).item<int32_t>(), 1);
  EXPECT_EQ(tensor::from<float>({4.f}, {1, 1}).item<float>(), 4.f);
}

TEST(TensorTest, ItemOfASliceReadsTheRightElement) {
  auto t = tensor::from<int32_t>({10, 20, 30});
  EXPECT_EQ(t.slice(2, 3).item<int32_t>(), 30);
}

TEST(TensorTest, ItemRejectsATensorWithoutExactlyOneElement) {
  EXPECT_TRUE(fails_with(
      [] {
        tensor::from<float>({1, 2}).item<float>();
      },
      errc::shape_mismatch, {"exactly one element", "[2]", "2 elements"}));
  EXPECT_TRUE(fails_with([] { tensor::zeros(dtype::float32, {0}).item<float>(); },
                         errc::shape_mismatch, {"0 elements"}));
  EXPECT_TRUE(
      fails_with([] { tensor{}.item<float>(); }, errc::shape_mismatch, {"default-constructed"}));
}

namespace {

TEST(TensorTest, ZerosAreZeroEvenWhenALargeBufferIsReused) {
  // Large buffers are recycled through a cache; a recycled buffer must not leak old contents
  // into a tensor that promises zeros.
  const int64_t n = int64_t{5} << 20; // 20 MiB of float32: above the huge-page threshold
  for (int round = 0; round < 3; ++round) {
    auto t = tensor::zeros(dtype::float32, {n});
    const auto* p = t.data<float>();
    int64_t nonzero = 0;
    for (int64_t i = 0; i < n; ++i)
      nonzero += p[i] != 0.0f;
    ASSERT_EQ(nonzero, 0) << "round " << round;
    auto* w = t.mutable_data<float>();
    for (int64_t i = 0; i < n; ++i)
      w[i] = 1.0f;
  }
}

TEST(TensorTest, EmptyHasTheRequestedShapeAndDtype) {
  auto t = tensor::empty(dtype::int64, {3, 4}, "cpu:2");
  EXPECT_EQ(t.dtype(), dtype::int64);
  EXPECT_EQ(t.shape(), (shape_t{3, 4}));
  EXPECT_EQ(t.device(), "CPU:2");
  EXPECT_EQ(t.num_bytes(), 96u);
  EXPECT_TRUE(fails_with([] { tensor::empty(dtype::int32, {-1}); }, errc::invalid_argument,
                         {"tensor::empty", "-1"}));
}

} // namespace
