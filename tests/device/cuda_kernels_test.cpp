// Tests of the CUDA kernels (device/cuda/kernels.hpp) against the host kernels
// (include/consort/ops.hpp), element by element and bit by bit.
//
// With a GPU, every kernel runs for every dtype and reduce op on inputs that include rounding-
// sensitive magnitudes, denormals, signed zeros, infinities and NaNs, for sizes 0, 1, odd and over
// a million elements, on aligned (vectorised) and misaligned (scalar) pointers; the output buffer
// is poisoned first, so a kernel that writes nothing fails. The comparison is bitwise, except that
// for SUM, PROD and MEAN any NaN matches any NaN: a NaN that arithmetic makes has one encoding on
// x86 (0xffc00000) and another on NVIDIA GPUs (0x7fffffff), a hardware difference that no kernel
// can hide without a branch per element. MIN and MAX select an operand, so their NaNs must match
// bit for bit.
//
// Without a GPU, the argument checks run (they come before any device call) and the GPU tests skip
// with unavailable_reason().

#include "device/cuda/kernels.hpp"
#include "device/cuda/runtime.hpp"

#include <consort/error.hpp>
#include <consort/ops.hpp>
#include <consort/tensor.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace cuda = consort::cuda;
using consort::dtype;
using consort::errc;
using consort::reduce_op;
using consort::tensor;
using namespace std::chrono_literals;

namespace {

constexpr dtype all_dtypes[] = {dtype::float32, dtype::float64, dtype::int32, dtype::int64,
                                dtype::uint8};
constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::mean, reduce_op::min, reduce_op::max,
                                 reduce_op::prod};

/// Elements of the largest case; odd, and not a multiple of any vector width.
constexpr int64_t big = 1000003;

// -- host data ------------------------------------------------------------------------------------

/// Random values of dtype `type`: floats of mixed magnitude (so that the order of additions shows
/// in the rounding) with every special value sprinkled in; integers over their whole range (so
/// that sums and products wrap).
tensor random_tensor(dtype type, int64_t n, uint64_t seed) {
  std::mt19937_64 rng{seed};
  auto out = tensor::empty(type, {n});
  auto fill_float = [&](auto* p) {
    using F = std::remove_pointer_t<decltype(p)>;
    std::uniform_real_distribution<F> mantissa{F(-1), F(1)};
    std::uniform_int_distribution<int> exponent{-8, 8};
    const F specials[] = {std::numeric_limits<F>::quiet_NaN(),
                          -std::numeric_limits<F>::quiet_NaN(),
                          std::numeric_limits<F>::infinity(),
                          -std::numeric_limits<F>::infinity(),
                          F(0),
                          -F(0),
                          std::numeric_limits<F>::denorm_min() * 3,
                          -std::numeric_limits<F>::min() / 4};
    std::uniform_int_distribution<int> pick{0, 7};
    for (int64_t i = 0; i < n; ++i)
      p[i] = rng() % 61 == 0 ? specials[pick(rng)] : std::ldexp(mantissa(rng), exponent(rng));
  };
  switch (type) {
  case dtype::float32:
    fill_float(out.mutable_data<float>());
    break;
  case dtype::float64:
    fill_float(out.mutable_data<double>());
    break;
  default: {
    auto* p = static_cast<unsigned char*>(out.raw_mutable_data());
    for (size_t i = 0; i < out.num_bytes(); ++i)
      p[i] = static_cast<unsigned char>(rng());
  }
  }
  return out;
}

template <class T>
std::string text(T v) {
  std::ostringstream out;
  out.precision(17);
  if constexpr (sizeof(T) == 1)
    out << static_cast<int>(v);
  else
    out << v;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  out << " (0x" << std::hex << bits << ")";
  return out.str();
}

/// Compares `actual` (host bytes) with `expected` element by element and bit by bit; with
/// `any_nan`, a NaN matches any NaN (see the file comment).
::testing::AssertionResult same_bits(const tensor& expected,
                                     const std::vector<unsigned char>& actual, bool any_nan) {
  if (actual.size() != expected.num_bytes())
    return ::testing::AssertionFailure()
           << "size " << actual.size() << " bytes, expected " << expected.num_bytes();
  const size_t width = consort::size_of(expected.dtype());
  const auto* e = static_cast<const unsigned char*>(expected.raw_data());
  int64_t wrong = 0;
  int64_t first = -1;
  for (int64_t i = 0; i < expected.num_elements(); ++i) {
    const size_t at = static_cast<size_t>(i) * width;
    if (std::memcmp(e + at, actual.data() + at, width) == 0)
      continue;
    if (any_nan && expected.dtype() == dtype::float32) {
      float a = 0, b = 0;
      std::memcpy(&a, e + at, 4);
      std::memcpy(&b, actual.data() + at, 4);
      if (std::isnan(a) && std::isnan(b))
        continue;
    }
    if (any_nan && expected.dtype() == dtype::float64) {
      double a = 0, b = 0;
      std::memcpy(&a, e + at, 8);
      std::memcpy(&b, actual.data() + at, 8);
      if (std::isnan(a) && std::isnan(b))
        continue;
    }
    if (wrong++ == 0)
      first = i;
  }
  if (wrong == 0)
    return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure();
  failure << wrong << " of " << expected.num_elements() << " elements differ; the first is ["
          << first << "]: expected ";
  const size_t at = static_cast<size_t>(first) * width;
  auto show = [&](auto tag) {
    using T = decltype(tag);
    T a{}, b{};
    std::memcpy(&a, e + at, sizeof(T));
    std::memcpy(&b, actual.data() + at, sizeof(T));
    failure << text(a) << ", got " << text(b);
  };
  switch (expected.dtype()) {
  case dtype::float32:
    show(float{});
    break;
  case dtype::float64:
    show(double{});
    break;
  case dtype::int32:
    show(int32_t{});
    break;
  case dtype::int64:
    show(int64_t{});
    break;
  default:
    show(uint8_t{});
  }
  return failure;
}

bool arithmetic(reduce_op op) {
  return op == reduce_op::sum || op == reduce_op::mean || op == reduce_op::prod;
}

// -- device buffers -------------------------------------------------------------------------------

/// A block of GPU 0 from the caching allocator, released (after its last use on `stream`) when
/// it goes out of scope. Thread safety: a value.
class device_buffer {
public:
  device_buffer(size_t bytes, cudaStream_t stream)
      : bytes_(bytes), pointer_(cuda::allocate(0, bytes)), stream_(stream) {}
  ~device_buffer() { cuda::release(0, pointer_, bytes_, stream_); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  unsigned char* get() const { return static_cast<unsigned char*>(pointer_); }

private:
  size_t bytes_;
  void* pointer_;
  cudaStream_t stream_;
};

class CudaKernelsTest : public ::testing::Test {
protected:
  void SetUp() override {
    if (cuda::device_count() == 0)
      GTEST_SKIP() << "no GPU: " << cuda::unavailable_reason();
    stream_ = cuda::stream{0};
  }

  void TearDown() override {
    if (stream_)
      stream_.synchronize_for(60s, "the test's stream at teardown");
  }

  /// A device copy of `t` starting `offset` bytes into its block.
  std::unique_ptr<device_buffer> upload(const tensor& t, size_t offset = 0) {
    auto buffer = std::make_unique<device_buffer>(t.num_bytes() + offset + 16, stream_.get());
    cuda::copy(buffer->get() + offset, 0, t.raw_data(), cuda::host, t.num_bytes(), stream_.get());
    return buffer;
  }

  /// `bytes` bytes of `p`, after the stream's work.
  std::vector<unsigned char> download(const void* p, size_t bytes) {
    std::vector<unsigned char> out(bytes);
    cuda::copy(out.data(), cuda::host, p, 0, bytes, stream_.get());
    return out;
  }

  /// Fills `bytes` of `p` with 0xAB, so that an element a kernel failed to write shows.
  void poison(void* p, size_t bytes) {
    cuda::check(cudaMemsetAsync(p, 0xAB, bytes, stream_.get()), "cudaMemsetAsync");
  }

  cuda::stream stream_;
};

// -- argument checks (no GPU needed) --------------------------------------------------------------

TEST(CudaKernelsArgumentsTest, ReduceElementwiseRejectsBadArgumentsBeforeTouchingTheDevice) {
  int dummy = 0;
  const void* one[] = {&dummy};
  try {
    cuda::reduce_elementwise(dtype::float32, reduce_op::sum, one, 0, &dummy, 1, 1, nullptr);
    ADD_FAILURE() << "no inputs accepted";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument) << e.what();
  }
  try {
    cuda::reduce_elementwise(dtype::boolean, reduce_op::sum, one, 1, &dummy, 1, 1, nullptr);
    ADD_FAILURE() << "bool accepted";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::dtype_mismatch) << e.what();
  }
  try {
    cuda::reduce_elementwise(dtype::float32, reduce_op::mean, one, 1, &dummy, 1, 0.0, nullptr);
    ADD_FAILURE() << "a MEAN divisor of 0 accepted";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument) << e.what();
  }
  // Nothing to do queues nothing, with or without a GPU.
  EXPECT_NO_THROW(
      cuda::reduce_elementwise(dtype::float32, reduce_op::sum, one, 1, &dummy, 0, 1, nullptr));
}

TEST(CudaKernelsArgumentsTest, OtherKernelsRejectBadArgumentsBeforeTouchingTheDevice) {
  int dummy = 0;
  try {
    cuda::reduce_axis(dtype::float32, reduce_op::sum, &dummy, &dummy, 1, 0, 1, 0, nullptr);
    ADD_FAILURE() << "an empty axis accepted";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument) << e.what();
  }
  try {
    cuda::divide(dtype::int32, &dummy, 1, 2.0, nullptr);
    ADD_FAILURE() << "integer division accepted";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::dtype_mismatch) << e.what();
  }
  try {
    cuda::fill(dtype::boolean, &dummy, 1, 1.0, nullptr);
    ADD_FAILURE() << "bool fill accepted";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::dtype_mismatch) << e.what();
  }
  try {
    cuda::scaled_sum(dtype::int32, 1.0, &dummy, 1.0, &dummy, &dummy, 1, nullptr);
    ADD_FAILURE() << "an integer scaled sum accepted";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::dtype_mismatch) << e.what();
  }
  try {
    cuda::scaled_sum(dtype::float32, 1.0, &dummy, 1.0, nullptr, &dummy, 1, nullptr);
    ADD_FAILURE() << "a null input accepted";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument) << e.what();
  }
  try {
    cuda::scaled_sum(dtype::float32, 1.0, &dummy, 1.0, &dummy, &dummy, -1, nullptr);
    ADD_FAILURE() << "a negative count accepted";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument) << e.what();
  }
  EXPECT_NO_THROW(
      cuda::scaled_sum(dtype::float32, 1.0, nullptr, 1.0, nullptr, nullptr, 0, nullptr));
  {
    const void* in[] = {&dummy};
    void* out[] = {&dummy};
    const int64_t bad_n[] = {-1};
    const int64_t one_n[] = {1};
    const void* null_in[] = {nullptr};
    const std::vector<std::pair<const char*, std::function<void()>>> bad = {
        {"a count < 0",
         [&] {
           cuda::scaled_sum_many(dtype::float32, 1, in, 1, in, out, one_n, -1, nullptr);
         }},
        {"no arrays",
         [&] {
           cuda::scaled_sum_many(dtype::float32, 1, nullptr, 1, in, out, one_n, 1, nullptr);
         }},
        {"a negative size",
         [&] {
           cuda::scaled_sum_many(dtype::float32, 1, in, 1, in, out, bad_n, 1, nullptr);
         }},
        {"a null buffer with elements",
         [&] {
           cuda::scaled_sum_many(dtype::float32, 1, in, 1, null_in, out, one_n, 1, nullptr);
         }},
    };
    for (const auto& [what, call] : bad) {
      try {
        call();
        ADD_FAILURE() << what << " accepted";
      } catch (const consort::error& e) {
        EXPECT_EQ(e.code(), errc::invalid_argument) << what << ": " << e.what();
      }
    }
    try {
      cuda::scaled_sum_many(dtype::uint8, 1, in, 1, in, out, one_n, 1, nullptr);
      ADD_FAILURE() << "a uint8 scaled sum accepted";
    } catch (const consort::error& e) {
      EXPECT_EQ(e.code(), errc::dtype_mismatch) << e.what();
    }
    // Nothing to do (no buffers, or none with elements) queues nothing, with or without a GPU.
    const int64_t zero_n[] = {0};
    EXPECT_NO_THROW(cuda::scaled_sum_many(dtype::float32, 1, nullptr, 1, nullptr, nullptr, nullptr,
                                          0, nullptr));
    EXPECT_NO_THROW(
        cuda::scaled_sum_many(dtype::float32, 1, null_in, 1, null_in, out, zero_n, 1, nullptr));
  }
  EXPECT_NO_THROW(cuda::divide(dtype::float32, &dummy, 0, 2.0, nullptr));
  EXPECT_NO_THROW(cuda::fill(dtype::float32, &dummy, 0, 2.0, nullptr));
  EXPECT_NO_THROW(cuda::concat(nullptr, nullptr, 0, &dummy, 5, nullptr));
}

TEST(CudaKernelsArgumentsTest, KernelsWithoutAGpuThrowDeviceError) {
  if (cuda::device_count() > 0)
    GTEST_SKIP() << "this process sees a GPU; the no-GPU error path cannot be reached";
  int dummy = 0;
  const void* one[] = {&dummy};
  try {
    cuda::reduce_elementwise(dtype::int32, reduce_op::sum, one, 1, &dummy, 1, 1, nullptr);
    ADD_FAILURE() << "a kernel was queued without a GPU";
  } catch (const consort::error& e) {
    EXPECT_EQ(e.code(), errc::device_error) << e.what();
  }
}

// -- with a GPU -----------------------------------------------------------------------------------

TEST_F(CudaKernelsTest, ReduceElementwiseMatchesTheHostBitwiseForEveryDtypeOpCountAndSize) {
  constexpr int max_count = 9; // more than one pass (8 inputs) of the kernel
  for (auto type : all_dtypes) {
    std::vector<tensor> host_inputs;
    std::vector<std::unique_ptr<device_buffer>> aligned, misaligned;
    for (int i = 0; i < max_count; ++i) {
      host_inputs.push_back(random_tensor(type, big, 1000 * static_cast<uint64_t>(type) + i));
      aligned.push_back(upload(host_inputs.back()));
      // One element past a 256-byte boundary: no 16-byte vectors, the scalar path.
      misaligned.push_back(upload(host_inputs.back(), consort::size_of(type)));
    }
    device_buffer out{static_cast<size_t>(big) * 8 + 16, stream_.get()};
    for (auto op : all_ops) {
      const auto out_type = consort::reduced_dtype(op, type);
      for (int count = 1; count <= max_count; ++count) {
        for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1003}, big}) {
          for (bool shifted : {false, true}) {
            if (shifted && n != 1003)
              continue;
            SCOPED_TRACE(std::string{"dtype "} + to_string(type) + ", " + to_string(op) + ", " +
                         std::to_string(count) + " inputs, " + std::to_string(n) + " elements" +
                         (shifted ? ", misaligned" : ""));
            std::vector<tensor> column;
            std::vector<const void*> pointers;
            for (int i = 0; i < count; ++i) {
              column.push_back(host_inputs[static_cast<size_t>(i)].slice(0, n));
              pointers.push_back(shifted ? misaligned[static_cast<size_t>(i)]->get() +
                                               consort::size_of(type)
                                         : aligned[static_cast<size_t>(i)]->get());
            }
            const auto expected = consort::reduce_elementwise(op, column);
            ASSERT_EQ(expected.dtype(), out_type);
            unsigned char* dst = out.get() + (shifted ? consort::size_of(out_type) : 0);
            const size_t out_bytes = static_cast<size_t>(n) * consort::size_of(out_type);
            poison(dst, out_bytes);
            cuda::reduce_elementwise(type, op, pointers.data(), count, dst, n,
                                     static_cast<double>(count), stream_.get());
            ASSERT_TRUE(same_bits(expected, download(dst, out_bytes), arithmetic(op)));
          }
        }
      }
    }
  }
}

TEST_F(CudaKernelsTest, ReduceElementwiseMeanUsesTheGivenDivisor) {
  for (auto type : all_dtypes) {
    SCOPED_TRACE(to_string(type));
    std::vector<tensor> column;
    std::vector<std::unique_ptr<device_buffer>> buffers;
    std::vector<const void*> pointers;
    for (int i = 0; i < 3; ++i) {
      column.push_back(random_tensor(type, 4099, 77 + static_cast<uint64_t>(i)));
      buffers.push_back(upload(column.back()));
      pointers.push_back(buffers.back()->get());
    }
    const auto expected = consort::reduce_elementwise(reduce_op::mean, column, 7.5);
    device_buffer out{expected.num_bytes(), stream_.get()};
    poison(out.get(), expected.num_bytes());
    cuda::reduce_elementwise(type, reduce_op::mean, pointers.data(), 3, out.get(), 4099, 7.5,
                             stream_.get());
    EXPECT_TRUE(same_bits(expected, download(out.get(), expected.num_bytes()), true));
  }
}

TEST_F(CudaKernelsTest, ReduceElementwiseMayWriteOverItsFirstInput) {
  for (auto op : all_ops) {
    SCOPED_TRACE(to_string(op));
    for (int count : {1, 2, 9}) {
      std::vector<tensor> column;
      std::vector<std::unique_ptr<device_buffer>> buffers;
      std::vector<const void*> pointers;
      for (int i = 0; i < count; ++i) {
        column.push_back(random_tensor(dtype::float32, 100001, 500 + static_cast<uint64_t>(i)));
        buffers.push_back(upload(column.back()));
        pointers.push_back(buffers.back()->get());
      }
      const auto expected = consort::reduce_elementwise(op, column);
      cuda::reduce_elementwise(dtype::float32, op, pointers.data(), count, buffers[0]->get(),
                               100001, count, stream_.get());
      EXPECT_TRUE(
          same_bits(expected, download(buffers[0]->get(), expected.num_bytes()), arithmetic(op)))
          << count << " inputs";
    }
  }
}

TEST_F(CudaKernelsTest, ReduceAxisMatchesTheHostBitwiseForEveryDtypeOpAndShape) {
  struct view {
    int64_t outer, k, inner;
  };
  const view views[] = {
      {1, 1, 1},      {3, 5, 7},      {2, 3, 1},    {4, 1, 16}, {5, 2, 6},
      {2, 8, 1024},   {3, 3000, 1},   {1, 2048, 1}, // whole rows: the integer tree path
      {2, 4, 125000}, {1, 8, 125001},               // over a million elements, vectorised and not
  };
  for (auto type : all_dtypes) {
    const auto pool = random_tensor(type, big + 16, 4242 + static_cast<uint64_t>(type));
    const auto input_buffer = upload(pool);
    for (auto op : all_ops) {
      const auto out_type = consort::reduced_dtype(op, type);
      for (const auto& v : views) {
        SCOPED_TRACE(std::string{"dtype "} + to_string(type) + ", " + to_string(op) + ", [" +
                     std::to_string(v.outer) + ", " + std::to_string(v.k) + ", " +
                     std::to_string(v.inner) + "]");
        const int64_t n = v.outer * v.k * v.inner;
        ASSERT_LE(n, pool.num_elements());
        const auto input = pool.slice(0, n).reshape({v.outer, v.k, v.inner});
        const auto expected = consort::reduce_axis(op, input, 1);
        ASSERT_EQ(expected.dtype(), out_type);
        device_buffer out{expected.num_bytes() + 16, stream_.get()};
        poison(out.get(), expected.num_bytes());
        cuda::reduce_axis(type, op, input_buffer->get(), out.get(), v.outer, v.k, v.inner,
                          static_cast<double>(v.k), stream_.get());
        ASSERT_TRUE(same_bits(expected, download(out.get(), expected.num_bytes()), arithmetic(op)));
      }
    }
  }
}

TEST_F(CudaKernelsTest, ReduceAxisMeanWithoutADivisorLeavesTheSum) {
  for (auto type : {dtype::float32, dtype::float64}) {
    SCOPED_TRACE(to_string(type));
    const auto input = random_tensor(type, 6 * 7 * 9, 99).reshape({6, 7, 9});
    // For floats, MEAN's undivided sum is SUM: same accumulator type, same order.
    const auto expected = consort::reduce_axis(reduce_op::sum, input, 1);
    const auto buffer = upload(input);
    device_buffer out{expected.num_bytes(), stream_.get()};
    poison(out.get(), expected.num_bytes());
    cuda::reduce_axis(type, reduce_op::mean, buffer->get(), out.get(), 6, 7, 9, 0, stream_.get());
    EXPECT_TRUE(same_bits(expected, download(out.get(), expected.num_bytes()), true));
  }
}

TEST_F(CudaKernelsTest, DivideDividesExactlyAsTheHost) {
  for (auto type : {dtype::float32, dtype::float64}) {
    for (int64_t n : {int64_t{1}, int64_t{7}, big}) {
      for (size_t offset : {size_t{0}, consort::size_of(type)}) {
        SCOPED_TRACE(std::string{to_string(type)} + ", " + std::to_string(n) +
                     " elements, offset " + std::to_string(offset));
        auto values = random_tensor(type, n, 31);
        const auto buffer = upload(values, offset);
        const double divisor = 3.0;
        cuda::divide(type, buffer->get() + offset, n, divisor, stream_.get());
        // What the host's divide_in_place computes (float32 divides by the divisor as a float).
        auto expected = values.clone();
        if (type == dtype::float32) {
          auto* p = expected.mutable_data<float>();
          const auto d = static_cast<float>(divisor);
          for (int64_t i = 0; i < n; ++i)
            p[i] /= d;
        } else {
          auto* p = expected.mutable_data<double>();
          for (int64_t i = 0; i < n; ++i)
            p[i] /= divisor;
        }
        ASSERT_TRUE(
            same_bits(expected, download(buffer->get() + offset, values.num_bytes()), true));
      }
    }
  }
}

// -- float16 and bfloat16 -------------------------------------------------------------------------

/// Values of the 16-bit float `type`: floats of mixed magnitude rounded to it, with infinities,
/// signed zeros and subnormals sprinkled in. No NaN inputs: CUDA's conversions write their own NaN
/// encoding, so NaNs are compared as "any NaN" below.
tensor random_half(dtype type, int64_t n, uint64_t seed) {
  std::mt19937_64 rng{seed};
  std::uniform_real_distribution<float> mantissa{-1.0f, 1.0f};
  std::uniform_int_distribution<int> exponent{-8, 8};
  const float specials[] = {std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            0.0f,
                            -0.0f,
                            std::ldexp(3.0f, -24),
                            -std::ldexp(1.0f, -16)};
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  for (auto& b : bits) {
    const float f =
        rng() % 61 == 0 ? specials[rng() % 6] : std::ldexp(mantissa(rng), exponent(rng));
    b = type == dtype::float16 ? consort::float16_t(f).bits() : consort::bfloat16_t(f).bits();
  }
  auto out = tensor::empty(type, {n});
  if (n > 0)
    std::memcpy(out.raw_mutable_data(), bits.data(), bits.size() * 2);
  return out;
}

/// Bitwise equality of 16-bit floats, where any NaN matches any NaN.
::testing::AssertionResult same_halves(const tensor& expected,
                                       const std::vector<unsigned char>& actual) {
  if (actual.size() != expected.num_bytes())
    return ::testing::AssertionFailure()
           << "size " << actual.size() << " bytes, expected " << expected.num_bytes();
  auto value = [&](uint16_t b) {
    return expected.dtype() == dtype::float16
               ? static_cast<float>(consort::float16_t::from_bits(b))
               : static_cast<float>(consort::bfloat16_t::from_bits(b));
  };
  const auto* e = static_cast<const unsigned char*>(expected.raw_data());
  for (int64_t i = 0; i < expected.num_elements(); ++i) {
    uint16_t a = 0, b = 0;
    std::memcpy(&a, e + 2 * i, 2);
    std::memcpy(&b, actual.data() + 2 * i, 2);
    if (a == b || (std::isnan(value(a)) && std::isnan(value(b))))
      continue;
    return ::testing::AssertionFailure()
           << "element " << i << ": expected " << value(a) << " (0x" << std::hex << a << "), got "
           << value(b) << " (0x" << b << ")";
  }
  return ::testing::AssertionSuccess();
}

/// What the host computes for the variables' updates (actors/variable.cpp, scaled_sum): alpha and
/// beta rounded to the dtype's arithmetic type A (float for the 16-bit floats), two products and
/// a sum, each rounded, then rounded once to the dtype.
tensor host_scaled_sum(const tensor& a, double alpha, const tensor& b, double beta) {
  auto out = tensor::empty(a.dtype(), a.shape());
  auto run = [&](auto tag, auto acc) {
    using T = decltype(tag);
    using A = decltype(acc);
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    T* po = out.mutable_data<T>();
    for (int64_t i = 0; i < a.num_elements(); ++i)
      po[i] = static_cast<T>(static_cast<A>(alpha) * static_cast<A>(pa[i]) +
                             static_cast<A>(beta) * static_cast<A>(pb[i]));
  };
  switch (a.dtype()) {
  case dtype::float32:
    run(float{}, float{});
    break;
  case dtype::float64:
    run(double{}, double{});
    break;
  case dtype::float16:
    run(consort::float16_t{}, float{});
    break;
  default:
    run(consort::bfloat16_t{}, float{});
  }
  return out;
}

TEST_F(CudaKernelsTest, ScaledSumMatchesTheHostBitwiseAlignedMisalignedAndInPlace) {
  for (auto type : {dtype::float32, dtype::float64, dtype::float16, dtype::bfloat16}) {
    const bool half = type == dtype::float16 || type == dtype::bfloat16;
    for (int64_t n : {int64_t{1}, int64_t{7}, big}) {
      for (size_t offset : {size_t{0}, consort::size_of(type)}) {
        SCOPED_TRACE(std::string{to_string(type)} + ", " + std::to_string(n) +
                     " elements, offset " + std::to_string(offset));
        const auto a = half ? random_half(type, n, 51) : random_tensor(type, n, 51);
        const auto b = half ? random_half(type, n, 52) : random_tensor(type, n, 52);
        const auto expected = host_scaled_sum(a, 0.75, b, -0.3);
        auto matches = [&](const unsigned char* p) {
          const auto got = download(p, expected.num_bytes());
          return half ? same_halves(expected, got) : same_bits(expected, got, true);
        };
        const auto da = upload(a, offset);
        const auto db = upload(b, offset);
        device_buffer out{expected.num_bytes() + offset + 16, stream_.get()};
        poison(out.get(), expected.num_bytes() + offset);
        cuda::scaled_sum(type, 0.75, da->get() + offset, -0.3, db->get() + offset,
                         out.get() + offset, n, stream_.get());
        ASSERT_TRUE(matches(out.get() + offset));
        // In place, as a variable's update runs: out is a.
        cuda::scaled_sum(type, 0.75, da->get() + offset, -0.3, db->get() + offset,
                         da->get() + offset, n, stream_.get());
        ASSERT_TRUE(matches(da->get() + offset));
      }
    }
  }
}

TEST_F(CudaKernelsTest, ScaledSumManyMatchesTheHostBitwiseForRaggedBuffersInPlace) {
  // 21 buffers (launches of 16 and 5) of ragged sizes, one empty; the first launch's buffers at
  // an offset of one element (no 16-byte vectors) in the second round, the last launch's always
  // aligned; out is a (in place) for every buffer.
  const std::vector<int64_t> sizes = {1, 7,   0,  1001, 4, 5,  64, 3, 2,      17, 1,
                                      9, 128, 31, 2,    6, 70, 11, 8, 100003, 33};
  for (auto type : {dtype::float32, dtype::float64, dtype::float16, dtype::bfloat16}) {
    const bool half = type == dtype::float16 || type == dtype::bfloat16;
    for (size_t offset : {size_t{0}, consort::size_of(type)}) {
      SCOPED_TRACE(std::string{to_string(type)} + ", offset " + std::to_string(offset));
      std::vector<tensor> as, bs;
      std::vector<std::unique_ptr<device_buffer>> da, db;
      std::vector<const void*> pa_in, pb;
      std::vector<void*> pa;
      for (size_t i = 0; i < sizes.size(); ++i) {
        const uint64_t seed = 70 + 2 * i;
        as.push_back(half ? random_half(type, sizes[i], seed)
                          : random_tensor(type, sizes[i], seed));
        bs.push_back(half ? random_half(type, sizes[i], seed + 1)
                          : random_tensor(type, sizes[i], seed + 1));
        const size_t at = i >= 16 ? 0 : offset;
        da.push_back(upload(as.back(), at));
        db.push_back(upload(bs.back(), at));
        pa.push_back(da.back()->get() + at);
        pa_in.push_back(pa.back());
        pb.push_back(db.back()->get() + at);
      }
      cuda::scaled_sum_many(type, 0.75, pa_in.data(), -0.3, pb.data(), pa.data(), sizes.data(),
                            static_cast<int>(sizes.size()), stream_.get());
      for (size_t i = 0; i < sizes.size(); ++i) {
        const auto expected = host_scaled_sum(as[i], 0.75, bs[i], -0.3);
        const auto got = download(pa[i], expected.num_bytes());
        ASSERT_TRUE(half ? same_halves(expected, got) : same_bits(expected, got, true))
            << "buffer " << i;
      }
    }
  }
}

TEST_F(CudaKernelsTest, Float16AndBfloat16ReduceElementwiseMatchesTheHostBitwise) {
  for (auto type : {dtype::float16, dtype::bfloat16}) {
    std::vector<tensor> host_inputs;
    std::vector<std::unique_ptr<device_buffer>> buffers;
    for (int i = 0; i < 9; ++i) {
      host_inputs.push_back(random_half(type, big, 7000 + 100 * static_cast<uint64_t>(type) + i));
      buffers.push_back(upload(host_inputs.back()));
    }
    device_buffer out{static_cast<size_t>(big) * 2 + 16, stream_.get()};
    for (auto op : all_ops)
      for (int count : {1, 2, 3, 8, 9}) // 9: more than one pass, through a float buffer
        for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1003}, big}) {
          SCOPED_TRACE(std::string{to_string(type)} + ", " + to_string(op) + ", " +
                       std::to_string(count) + " inputs, " + std::to_string(n) + " elements");
          std::vector<tensor> column;
          std::vector<const void*> pointers;
          for (int i = 0; i < count; ++i) {
            column.push_back(host_inputs[static_cast<size_t>(i)].slice(0, n));
            pointers.push_back(buffers[static_cast<size_t>(i)]->get());
          }
          const auto expected = consort::reduce_elementwise(op, column);
          ASSERT_EQ(expected.dtype(), type);
          poison(out.get(), expected.num_bytes());
          cuda::reduce_elementwise(type, op, pointers.data(), count, out.get(), n,
                                   static_cast<double>(count), stream_.get());
          ASSERT_TRUE(same_halves(expected, download(out.get(), expected.num_bytes())));
        }
  }
}

TEST_F(CudaKernelsTest, Float16ReduceElementwiseAccumulatesInFloat) {
  // 2048 + 1 + 1 + 1: 2052 from a float accumulator (2051 rounded once), 2048 from a half one.
  std::vector<tensor> column;
  std::vector<std::unique_ptr<device_buffer>> buffers;
  std::vector<const void*> pointers;
  for (float v : {2048.0f, 1.0f, 1.0f, 1.0f}) {
    column.push_back(tensor::from<consort::float16_t>({consort::float16_t(v)}));
    buffers.push_back(upload(column.back()));
    pointers.push_back(buffers.back()->get());
  }
  device_buffer out{16, stream_.get()};
  cuda::reduce_elementwise(dtype::float16, reduce_op::sum, pointers.data(), 4, out.get(), 1, 4,
                           stream_.get());
  auto bytes = download(out.get(), 2);
  uint16_t bits = 0;
  std::memcpy(&bits, bytes.data(), 2);
  EXPECT_EQ(static_cast<float>(consort::float16_t::from_bits(bits)), 2052.0f);
}

TEST_F(CudaKernelsTest, Float16AndBfloat16ReduceAxisAndDivideMatchTheHostBitwise) {
  struct view {
    int64_t outer, k, inner;
  };
  const view views[] = {{1, 1, 1}, {3, 5, 7}, {2, 3, 1}, {5, 2, 16}, {1, 3000, 1}, {2, 4, 125000}};
  for (auto type : {dtype::float16, dtype::bfloat16}) {
    const auto pool = random_half(type, big, 4343 + static_cast<uint64_t>(type));
    const auto input_buffer = upload(pool);
    for (auto op : all_ops)
      for (const auto& v : views) {
        SCOPED_TRACE(std::string{to_string(type)} + ", " + to_string(op) + ", [" +
                     std::to_string(v.outer) + ", " + std::to_string(v.k) + ", " +
                     std::to_string(v.inner) + "]");
        const auto input = pool.slice(0, v.outer * v.k * v.inner).reshape({v.outer, v.k, v.inner});
        const auto expected = consort::reduce_axis(op, input, 1);
        ASSERT_EQ(expected.dtype(), type);
        device_buffer out{expected.num_bytes() + 16, stream_.get()};
        poison(out.get(), expected.num_bytes());
        cuda::reduce_axis(type, op, input_buffer->get(), out.get(), v.outer, v.k, v.inner,
                          static_cast<double>(v.k), stream_.get());
        ASSERT_TRUE(same_halves(expected, download(out.get(), expected.num_bytes())));
      }
    // divide: in float, rounded once.
    const auto values = pool.slice(0, 100003);
    const auto buffer = upload(values);
    cuda::divide(type, buffer->get(), 100003, 3.0, stream_.get());
    auto expected = values.clone();
    auto* p = static_cast<uint16_t*>(expected.raw_mutable_data());
    for (int64_t i = 0; i < 100003; ++i) {
      if (type == dtype::float16)
        p[i] = consort::float16_t(static_cast<float>(consort::float16_t::from_bits(p[i])) / 3.0f)
                   .bits();
      else
        p[i] = consort::bfloat16_t(static_cast<float>(consort::bfloat16_t::from_bits(p[i])) / 3.0f)
                   .bits();
    }
    ASSERT_TRUE(same_halves(expected, download(buffer->get(), values.num_bytes())));
  }
}

TEST_F(CudaKernelsTest, FillWritesTheValueConvertedToTheDtype) {
  for (auto type : all_dtypes) {
    for (int64_t n : {int64_t{1}, int64_t{33}, big}) {
      for (size_t offset : {size_t{0}, consort::size_of(type)}) {
        SCOPED_TRACE(std::string{to_string(type)} + ", " + std::to_string(n) +
                     " elements, offset " + std::to_string(offset));
        const double value = 200.75;
        auto expected = tensor::empty(type, {n});
        auto set = [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          for (int64_t i = 0; i < n; ++i)
            p[i] = static_cast<T>(value);
        };
        switch (type) {
        case dtype::float32:
          set(expected.mutable_data<float>());
          break;
        case dtype::float64:
          set(expected.mutable_data<double>());
          break;
        case dtype::int32:
          set(expected.mutable_data<int32_t>());
          break;
        case dtype::int64:
          set(expected.mutable_data<int64_t>());
          break;
        default:
          set(expected.mutable_data<uint8_t>());
        }
        device_buffer buffer{expected.num_bytes() + offset, stream_.get()};
        poison(buffer.get() + offset, expected.num_bytes());
        cuda::fill(type, buffer.get() + offset, n, value, stream_.get());
        ASSERT_TRUE(
            same_bits(expected, download(buffer.get() + offset, expected.num_bytes()), false));
      }
    }
  }
}

TEST_F(CudaKernelsTest, ConcatMatchesTheHostForRaggedInputs) {
  struct layout {
    int64_t outer;
    std::vector<int64_t> extents; // along the concatenated axis
    int64_t inner;
  };
  const layout layouts[] = {
      {1, {3, 0, 5}, 4},   // one row: copies
      {3, {1, 2, 3}, 5},   // odd row sizes
      {1000, {16, 32}, 1}, // 16-byte units for 4-byte elements
      {7, {2, 0, 1, 2, 1, 0, 2, 1, 2, 1, 0, 2, 1, 2, 1, 0, 2, 1, 2, 1}, 2}, // > 16 inputs
      {512, {1000, 3000}, 1}, // over a million elements of 4 bytes
      {4, {0, 0}, 3},         // nothing to copy
  };
  for (auto type : {dtype::uint8, dtype::float32, dtype::float64}) {
    for (const auto& l : layouts) {
      SCOPED_TRACE(std::string{to_string(type)} + ", " + std::to_string(l.outer) + " rows, " +
                   std::to_string(l.extents.size()) + " inputs");
      std::vector<tensor> inputs;
      std::vector<std::unique_ptr<device_buffer>> buffers;
      std::vector<const void*> pointers;
      std::vector<size_t> row_bytes;
      for (size_t i = 0; i < l.extents.size(); ++i) {
        inputs.push_back(random_tensor(type, l.outer * l.extents[i] * l.inner, 7 + i)
                             .reshape({l.outer, l.extents[i], l.inner}));
        buffers.push_back(upload(inputs.back()));
        pointers.push_back(buffers.back()->get());
        row_bytes.push_back(static_cast<size_t>(l.extents[i] * l.inner) * consort::size_of(type));
      }
      const auto expected = consort::concat(inputs, 1);
      device_buffer out{expected.num_bytes() + 16, stream_.get()};
      poison(out.get(), expected.num_bytes());
      cuda::concat(pointers.data(), row_bytes.data(), static_cast<int>(pointers.size()), out.get(),
                   l.outer, stream_.get());
      ASSERT_TRUE(same_bits(expected, download(out.get(), expected.num_bytes()), false));
    }
  }
}

TEST_F(CudaKernelsTest, ConcatHandlesMisalignedInputsByteByByte) {
  // Inputs one byte past an aligned address: the kernel must fall back to 1-byte units.
  const int64_t outer = 9;
  const std::vector<int64_t> extents = {5, 12, 3};
  std::vector<tensor> inputs;
  std::vector<std::unique_ptr<device_buffer>> buffers;
  std::vector<const void*> pointers;
  std::vector<size_t> row_bytes;
  for (size_t i = 0; i < extents.size(); ++i) {
    inputs.push_back(
        random_tensor(dtype::int32, outer * extents[i], 3 + i).reshape({outer, extents[i]}));
    buffers.push_back(upload(inputs.back(), 1));
    pointers.push_back(buffers.back()->get() + 1);
    row_bytes.push_back(static_cast<size_t>(extents[i]) * 4);
  }
  const auto expected = consort::concat(inputs, 1);
  device_buffer out{expected.num_bytes() + 16, stream_.get()};
  poison(out.get(), expected.num_bytes() + 16);
  cuda::concat(pointers.data(), row_bytes.data(), 3, out.get() + 3, outer, stream_.get());
  const auto all = download(out.get(), expected.num_bytes() + 16);
  EXPECT_TRUE(same_bits(
      expected,
      {all.begin() + 3, all.begin() + 3 + static_cast<std::ptrdiff_t>(expected.num_bytes())},
      false));
  // Nothing outside the output was written.
  for (size_t i : {size_t{0}, size_t{1}, size_t{2}, expected.num_bytes() + 3})
    EXPECT_EQ(all[i], 0xAB) << "byte " << i;
}

} // namespace
