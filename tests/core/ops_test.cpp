#include "support/expect_error.hpp"

#include <consort/ops.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

using consort::dtype;
using consort::errc;
using consort::nest;
using consort::reduce_op;
using consort::shape_t;
using consort::tensor;
using consort::test::fails_with;

namespace {

/// A list of components; spelled out because a braced list of tensors would also convert to a
/// list of nests.
using tensors = std::vector<tensor>;

constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::mean, reduce_op::min, reduce_op::max,
                                 reduce_op::prod};

tensor f32(std::vector<float> values, shape_t shape) {
  return tensor::from<float>(values, std::move(shape));
}

tensor f32(std::vector<float> values) {
  return tensor::from<float>(values);
}

tensor i32(std::vector<int32_t> values, shape_t shape) {
  return tensor::from<int32_t>(values, std::move(shape));
}

tensor i32(std::vector<int32_t> values) {
  return tensor::from<int32_t>(values);
}

/// The naive definition of each op, with TF's wrapping integer arithmetic.
template <class T>
T combine(reduce_op op, T a, T b) {
  using W = typename std::conditional_t<std::is_integral_v<T>, std::make_unsigned<T>,
                                        std::type_identity<T>>::type;
  switch (op) {
  case reduce_op::sum:
  case reduce_op::mean:
    return static_cast<T>(static_cast<W>(a) + static_cast<W>(b));
  case reduce_op::prod:
    return static_cast<T>(static_cast<W>(a) * static_cast<W>(b));
  case reduce_op::min:
    return std::min(a, b);
  case reduce_op::max:
    return std::max(a, b);
  }
  return a;
}

template <class T>
std::vector<T> random_values(int64_t n, std::mt19937& rng) {
  std::vector<T> out(static_cast<size_t>(n));
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<double> dist(-2.0, 2.0);
    for (auto& v : out)
      v = static_cast<T>(dist(rng));
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    std::uniform_int_distribution<int> dist(0, 255);
    for (auto& v : out)
      v = static_cast<T>(dist(rng));
  } else {
    std::uniform_int_distribution<int64_t> dist(-1000, 1000);
    for (auto& v : out)
      v = static_cast<T>(dist(rng));
  }
  return out;
}

/// Checks reduce_elementwise against a per-element left fold for one dtype.
template <class T>
void check_against_reference(std::mt19937& rng) {
  for (auto op : all_ops) {
    for (int64_t n : {0, 1, 7, 1001, 8193}) {
      for (size_t count = 1; count <= 8; ++count) {
        SCOPED_TRACE(std::string{to_string(consort::dtype_of<T>)} + " " + to_string(op) +
                     " n=" + std::to_string(n) + " inputs=" + std::to_string(count));
        std::vector<std::vector<T>> values;
        std::vector<tensor> inputs;
        for (size_t i = 0; i < count; ++i) {
          values.push_back(random_values<T>(n, rng));
          inputs.push_back(tensor::from<T>(values.back()));
        }
        auto out = consort::reduce_elementwise(op, inputs);
        ASSERT_EQ(out.shape(), (shape_t{n}));
        if (op == reduce_op::mean) {
          using A = std::conditional_t<std::is_floating_point_v<T>, T, double>;
          ASSERT_EQ(out.dtype(), consort::dtype_of<A>);
          auto got = out.to_vector<A>();
          for (int64_t j = 0; j < n; ++j) {
            double sum = 0;
            for (size_t i = 0; i < count; ++i)
              sum += static_cast<double>(values[i][static_cast<size_t>(j)]);
            double expected = sum / static_cast<double>(count);
            double tolerance = std::is_same_v<A, float> ? 1e-5 : 1e-12;
            ASSERT_NEAR(got[static_cast<size_t>(j)], expected, tolerance) << "element " << j;
          }
        } else {
          ASSERT_EQ(out.dtype(), consort::dtype_of<T>);
          auto got = out.to_vector<T>();
          for (int64_t j = 0; j < n; ++j) {
            auto k = static_cast<size_t>(j);
            T expected = values[0][k];
            for (size_t i = 1; i < count; ++i)
              expected = combine(op, expected, values[i][k]);
            ASSERT_EQ(got[k], expected) << "element " << j;
          }
        }
      }
    }
  }
}

} // namespace

// -- reduced_dtype and normalize_axis ----------------------------------------------------------

TEST(OpsTest, ReducedDtypeIsTheInputDtypeExceptIntegerMean) {
  EXPECT_EQ(reduced_dtype(reduce_op::sum, dtype::int32), dtype::int32);
  EXPECT_EQ(reduced_dtype(reduce_op::prod, dtype::uint8), dtype::uint8);
  EXPECT_EQ(reduced_dtype(reduce_op::mean, dtype::float32), dtype::float32);
  EXPECT_EQ(reduced_dtype(reduce_op::mean, dtype::float64), dtype::float64);
  EXPECT_EQ(reduced_dtype(reduce_op::mean, dtype::int32), dtype::float64);
  EXPECT_EQ(reduced_dtype(reduce_op::mean, dtype::int64), dtype::float64);
  EXPECT_EQ(reduced_dtype(reduce_op::mean, dtype::uint8), dtype::float64);
  EXPECT_EQ(reduced_dtype(reduce_op::mean, dtype::boolean), dtype::float64);
}

TEST(OpsTest, NormalizeAxisCountsNegativeAxesFromTheEnd) {
  EXPECT_EQ(consort::normalize_axis(0, 3, "op"), 0);
  EXPECT_EQ(consort::normalize_axis(2, 3, "op"), 2);
  EXPECT_EQ(consort::normalize_axis(-1, 3, "op"), 2);
  EXPECT_EQ(consort::normalize_axis(-3, 3, "op"), 0);
}

TEST(OpsTest, NormalizeAxisRejectsOutOfRangeAxesNamingTheOperation) {
  EXPECT_TRUE(fails_with([] { consort::normalize_axis(3, 3, "my_op"); }, errc::invalid_argument,
                         {"my_op", "axis 3", "rank 3", "-3..2"}));
  EXPECT_TRUE(fails_with([] { consort::normalize_axis(-4, 3, "my_op"); }, errc::invalid_argument,
                         {"axis -4"}));
  EXPECT_TRUE(fails_with([] { consort::normalize_axis(0, 0, "my_op"); }, errc::invalid_argument,
                         {"scalar", "rank 0"}));
}

// -- reduce_elementwise ---------------------------------------------------------------------------

TEST(OpsTest, ReduceElementwiseMatchesANaiveReferenceForEveryDtypeOpSizeAndInputCount) {
  std::mt19937 rng(1234);
  check_against_reference<float>(rng);
  check_against_reference<double>(rng);
  check_against_reference<int32_t>(rng);
  check_against_reference<int64_t>(rng);
  check_against_reference<uint8_t>(rng);
}

TEST(OpsTest, ReduceElementwiseOfLargeTensorsMatchesTheReference) {
  // 10 MiB and more per tensor, odd length: many blocks, a partial last block, huge-page storage.
  const int64_t n = (int64_t{10} << 20) / 4 + 5;
  std::mt19937 rng(99);
  std::vector<std::vector<int32_t>> values;
  std::vector<tensor> inputs;
  for (int i = 0; i < 3; ++i) {
    values.push_back(random_values<int32_t>(n, rng));
    inputs.push_back(tensor::from<int32_t>(values.back()));
  }
  auto sum = consort::reduce_elementwise(reduce_op::sum, inputs).to_vector<int32_t>();
  auto mean = consort::reduce_elementwise(reduce_op::mean, inputs).to_vector<double>();
  for (size_t j = 0; j < static_cast<size_t>(n); ++j) {
    int32_t expected = values[0][j] + values[1][j] + values[2][j];
    ASSERT_EQ(sum[j], expected) << j;
    ASSERT_NEAR(mean[j], expected / 3.0, 1e-9) << j;
  }
}

TEST(OpsTest, ReduceElementwiseReadsInputsAtAnyOffset) {
  // Slices start 4 bytes into their storage, so no input row is cache-line aligned.
  std::vector<float> values(3 * 1001 + 1);
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = static_cast<float>(i);
  auto all = tensor::from<float>(values);
  std::vector<tensor> inputs{all.slice(1, 1002), all.slice(1002, 2003), all.slice(2003, 3004)};
  auto out = consort::reduce_elementwise(reduce_op::sum, inputs).to_vector<float>();
  for (size_t j = 0; j < 1001; ++j)
    ASSERT_EQ(out[j], values[1 + j] + values[1002 + j] + values[2003 + j]);
}

TEST(OpsTest, ReduceElementwiseWrapsIntegerOverflowLikeTensorFlow) {
  auto big = tensor::from<int32_t>({std::numeric_limits<int32_t>::max()});
  auto one = tensor::from<int32_t>({1});
  EXPECT_EQ(consort::reduce_elementwise(reduce_op::sum, {big, one}).to_vector<int32_t>()[0],
            std::numeric_limits<int32_t>::min());
  auto u = tensor::from<uint8_t>({200});
  EXPECT_EQ(consort::reduce_elementwise(reduce_op::sum, {u, u}).to_vector<uint8_t>()[0], 144);
}

TEST(OpsTest, ReduceElementwiseKeepsShapeAndFirstInputsDevice) {
  auto a = f32({1, 2, 3, 4, 5, 6}, {2, 3}).to("CPU:1");
  auto b = f32({1, 1, 1, 1, 1, 1}, {2, 3});
  auto out = consort::reduce_elementwise(reduce_op::max, {a, b});
  EXPECT_EQ(out.shape(), (shape_t{2, 3}));
  EXPECT_EQ(out.device(), "CPU:1");
  EXPECT_EQ(out, f32({1, 2, 3, 4, 5, 6}, {2, 3}));
}

TEST(OpsTest, ReduceElementwiseOfScalars) {
  auto out =
      consort::reduce_elementwise(reduce_op::prod, {tensor::scalar(2.0), tensor::scalar(3.5)});
  EXPECT_EQ(out.rank(), 0);
  EXPECT_EQ(out.item<double>(), 7.0);
}

TEST(OpsTest, IntegerMeanIsFloat64AndNotTruncated) {
  auto out = consort::reduce_elementwise(reduce_op::mean, {i32({1, 4}), i32({2, 4})});
  EXPECT_EQ(out.dtype(), dtype::float64);
  EXPECT_EQ(out.to_vector<double>(), (std::vector<double>{1.5, 4.0}));
  auto single = consort::reduce_elementwise(reduce_op::mean, {i32({3})});
  EXPECT_EQ(single.dtype(), dtype::float64);
  EXPECT_EQ(single.item<double>(), 3.0);
}

TEST(OpsTest, MeanDividesByTheGivenDivisor) {
  auto out = consort::reduce_elementwise(reduce_op::mean, {f32({2, 4}), f32({6, 8})}, 4.0);
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{2, 3}));
  EXPECT_TRUE(fails_with([] { consort::reduce_elementwise(reduce_op::mean, {f32({1})}, 0.0); },
                         errc::invalid_argument, {"divisor"}));
}

TEST(OpsTest, ReducingOneInputReturnsItWithoutCopying) {
  auto a = f32({1, 2, 3});
  auto out = consort::reduce_elementwise(reduce_op::sum, {a});
  EXPECT_TRUE(out.shares_storage_with(a));
  // Copy-on-write keeps the shared input safe from writes to the result.
  out.mutable_data<float>()[0] = 10;
  EXPECT_EQ(a.to_vector<float>()[0], 1);
}

TEST(OpsTest, ReduceElementwiseRejectsBoolTensors) {
  auto b = tensor::from<bool>({true});
  EXPECT_TRUE(fails_with(
      [&] {
        consort::reduce_elementwise(reduce_op::sum, {b, b});
      },
      errc::dtype_mismatch, {"reduce of bool tensors is not supported; cast to int32 first"}));
}

TEST(OpsTest, ReduceElementwiseRejectsShapeMismatchNamingTheInputAndBothShapes) {
  EXPECT_TRUE(fails_with(
      [] {
        consort::reduce_elementwise(reduce_op::sum, {f32({1, 2}), f32({1, 2}), f32({1, 2, 3})});
      },
      errc::shape_mismatch, {"input 2", "[3]", "[2]"}));
}

TEST(OpsTest, ReduceElementwiseRejectsDtypeMismatchNamingTheInputAndBothDtypes) {
  EXPECT_TRUE(fails_with(
      [] {
        consort::reduce_elementwise(reduce_op::sum, {f32({1}), i32({1})});
      },
      errc::dtype_mismatch, {"input 1", "int32", "float32"}));
}

TEST(OpsTest, ReduceElementwiseRejectsNoInputsAndInvalidTensors) {
  EXPECT_TRUE(fails_with([] { consort::reduce_elementwise(reduce_op::sum, {}); },
                         errc::invalid_argument, {"at least one"}));
  EXPECT_TRUE(fails_with(
      [] {
        consort::reduce_elementwise(reduce_op::sum, {f32({1}), tensor{}});
      },
      errc::invalid_argument, {"input 1", "default-constructed"}));
}

// -- reduce_axis ----------------------------------------------------------------------------------

TEST(OpsTest, ReduceAxisOfAMatrixAlongEitherAxis) {
  auto t = f32({1, 2, 3, 4, 5, 6}, {2, 3});
  EXPECT_EQ(consort::reduce_axis(reduce_op::sum, t, 0), f32({5, 7, 9}));
  EXPECT_EQ(consort::reduce_axis(reduce_op::sum, t, 1), f32({6, 15}));
  EXPECT_EQ(consort::reduce_axis(reduce_op::sum, t, -1), f32({6, 15}));
  EXPECT_EQ(consort::reduce_axis(reduce_op::mean, t, 0), f32({2.5, 3.5, 4.5}));
  EXPECT_EQ(consort::reduce_axis(reduce_op::min, t, 1), f32({1, 4}));
  EXPECT_EQ(consort::reduce_axis(reduce_op::max, t, 0), f32({4, 5, 6}));
  EXPECT_EQ(consort::reduce_axis(reduce_op::prod, t, 1), f32({6, 120}));
}

TEST(OpsTest, ReduceAxisOfTheMiddleAxisOfARank3Tensor) {
  // shape [2, 3, 2]: element (o, k, i) = 6o + 2k + i.
  std::vector<int32_t> values(12);
  for (int32_t i = 0; i < 12; ++i)
    values[static_cast<size_t>(i)] = i;
  auto t = i32(values, {2, 3, 2});
  auto out = consort::reduce_axis(reduce_op::sum, t, 1);
  EXPECT_EQ(out, i32({0 + 2 + 4, 1 + 3 + 5, 6 + 8 + 10, 7 + 9 + 11}, {2, 2}));
}

TEST(OpsTest, ReduceAxisMatchesAReferenceForWideAndTallTensors) {
  std::mt19937 rng(7);
  for (shape_t shape : {shape_t{3, 5000}, shape_t{5000, 3}, shape_t{1, 9000}, shape_t{9000, 1}}) {
    auto values = random_values<int64_t>(shape[0] * shape[1], rng);
    auto t = tensor::from<int64_t>(values, shape);
    for (int64_t axis : {0, 1}) {
      SCOPED_TRACE(consort::to_string(shape) + " axis " + std::to_string(axis));
      auto out = consort::reduce_axis(reduce_op::max, t, axis).to_vector<int64_t>();
      auto other = shape[static_cast<size_t>(1 - axis)];
      ASSERT_EQ(out.size(), static_cast<size_t>(other));
      for (int64_t j = 0; j < other; ++j) {
        int64_t expected = std::numeric_limits<int64_t>::min();
        for (int64_t k = 0; k < shape[static_cast<size_t>(axis)]; ++k) {
          auto index = axis == 0 ? k * shape[1] + j : j * shape[1] + k;
          expected = std::max(expected, values[static_cast<size_t>(index)]);
        }
        ASSERT_EQ(out[static_cast<size_t>(j)], expected);
      }
    }
  }
}

TEST(OpsTest, ReduceAxisIntegerMeanIsFloat64) {
  auto out = consort::reduce_axis(reduce_op::mean, i32({1, 2, 3, 4}, {2, 2}), 1);
  EXPECT_EQ(out.dtype(), dtype::float64);
  EXPECT_EQ(out.to_vector<double>(), (std::vector<double>{1.5, 3.5}));
}

TEST(OpsTest, ReduceAxisOfAnEmptyAxis) {
  auto t = tensor::zeros(dtype::float32, {0, 2});
  EXPECT_EQ(consort::reduce_axis(reduce_op::sum, t, 0), f32({0, 0}));
  EXPECT_EQ(consort::reduce_axis(reduce_op::prod, t, 0), f32({1, 1}));
  auto mean = consort::reduce_axis(reduce_op::mean, t, 0).to_vector<float>();
  ASSERT_EQ(mean.size(), 2u);
  EXPECT_TRUE(std::isnan(mean[0]) && std::isnan(mean[1]));
  auto int_mean = consort::reduce_axis(reduce_op::mean, tensor::zeros(dtype::int32, {0}), 0);
  EXPECT_EQ(int_mean.dtype(), dtype::float64);
  EXPECT_TRUE(std::isnan(int_mean.item<double>()));
  EXPECT_TRUE(fails_with([&] { consort::reduce_axis(reduce_op::min, t, 0); },
                         errc::invalid_argument, {"MIN", "[0, 2]", "empty"}));
  EXPECT_TRUE(fails_with([&] { consort::reduce_axis(reduce_op::max, t, 0); },
                         errc::invalid_argument, {"MAX", "empty"}));
  // An empty other axis is fine: nothing to compute.
  EXPECT_EQ(consort::reduce_axis(reduce_op::min, t, 1).shape(), (shape_t{0}));
}

TEST(OpsTest, ReduceAxisRejectsBadAxesScalarsAndBools) {
  EXPECT_TRUE(fails_with(
      [] {
        consort::reduce_axis(reduce_op::sum, f32({1, 2}), 1);
      },
      errc::invalid_argument, {"reduce_axis", "axis 1", "rank 1"}));
  EXPECT_TRUE(fails_with([] { consort::reduce_axis(reduce_op::sum, tensor::scalar(1.f), 0); },
                         errc::invalid_argument, {"scalar"}));
  EXPECT_TRUE(
      fails_with([] { consort::reduce_axis(reduce_op::sum, tensor::from<bool>({true}), 0); },
                 errc::dtype_mismatch, {"cast to int32"}));
}

// -- concat ---------------------------------------------------------------------------------------

TEST(OpsTest, ConcatAlongAxisZeroAllowsRaggedInputs) {
  auto out = consort::concat({f32({1, 2}, {1, 2}), f32({3, 4, 5, 6}, {2, 2})}, 0);
  EXPECT_EQ(out, f32({1, 2, 3, 4, 5, 6}, {3, 2}));
}

TEST(OpsTest, ConcatAlongAnInnerAxisInterleavesRows) {
  auto a = f32({1, 2}, {2, 1});
  auto b = f32({10, 11, 12, 20, 21, 22}, {2, 3});
  EXPECT_EQ(consort::concat({a, b}, 1), f32({1, 10, 11, 12, 2, 20, 21, 22}, {2, 4}));
  EXPECT_EQ(consort::concat({a, b}, -1), f32({1, 10, 11, 12, 2, 20, 21, 22}, {2, 4}));
}

TEST(OpsTest, ConcatWorksForEveryDtypeIncludingBool) {
  auto out = consort::concat({tensor::from<bool>({true}), tensor::from<bool>({false, true})}, 0);
  EXPECT_EQ(out.to_vector<bool>(), (std::vector<bool>{true, false, true}));
  auto u = consort::concat({tensor::from<uint8_t>({1}), tensor::from<uint8_t>({2})}, 0);
  EXPECT_EQ(u.to_vector<uint8_t>(), (std::vector<uint8_t>{1, 2}));
  auto l = consort::concat({tensor::from<int64_t>({1}), tensor::from<int64_t>({2})}, 0);
  EXPECT_EQ(l.to_vector<int64_t>(), (std::vector<int64_t>{1, 2}));
  auto d = consort::concat({tensor::from<double>({1}), tensor::from<double>({2})}, 0);
  EXPECT_EQ(d.to_vector<double>(), (std::vector<double>{1, 2}));
}

TEST(OpsTest, ConcatSkipsEmptyInputsAndKeepsEmptyResults) {
  auto empty = tensor::zeros(dtype::int32, {0, 2});
  EXPECT_EQ(consort::concat({empty, i32({1, 2}, {1, 2}), empty}, 0), i32({1, 2}, {1, 2}));
  EXPECT_EQ(consort::concat({empty, empty}, 0).shape(), (shape_t{0, 2}));
}

TEST(OpsTest, ConcatOfOneInputReturnsItWithoutCopying) {
  auto a = f32({1, 2});
  EXPECT_TRUE(consort::concat({a}, 0).shares_storage_with(a));
}

TEST(OpsTest, ConcatRejectsScalars) {
  EXPECT_TRUE(fails_with(
      [] {
        consort::concat({f32({1}), tensor::scalar(1.f)}, 0);
      },
      errc::invalid_argument,
      {"all_gather/gather needs rank >= 1; got a scalar", "input 1", "reshape it to [1]"}));
}

TEST(OpsTest, ConcatRejectsMismatchedRanksExtentsAndDtypes) {
  EXPECT_TRUE(fails_with(
      [] {
        consort::concat({f32({1, 2}, {1, 2}), f32({1, 2})}, 0);
      },
      errc::shape_mismatch, {"input 1", "[2]", "[1, 2]", "rank"}));
  EXPECT_TRUE(fails_with(
      [] {
        consort::concat({f32({1, 2}, {1, 2}), f32({1, 2, 3}, {1, 3})}, 0);
      },
      errc::shape_mismatch, {"input 1", "[1, 3]", "[1, 2]", "axis 0"}));
  EXPECT_TRUE(fails_with(
      [] {
        consort::concat({f32({1}), i32({1})}, 0);
      },
      errc::dtype_mismatch, {"input 1", "int32", "float32"}));
  EXPECT_TRUE(fails_with([] { consort::concat({}, 0); }, errc::invalid_argument, {"at least one"}));
  EXPECT_TRUE(
      fails_with([] { consort::concat({f32({1})}, 1); }, errc::invalid_argument, {"axis 1"}));
}

// -- reduce_components (Strategy.reduce) ----------------------------------------------------------

TEST(OpsTest, ReduceComponentsWithoutAxisReducesAcrossReplicas) {
  auto out =
      consort::reduce_components(reduce_op::sum, tensors{f32({1, 2}), f32({3, 4})}, std::nullopt);
  EXPECT_EQ(out, f32({4, 6}));
  auto mean =
      consort::reduce_components(reduce_op::mean, tensors{f32({1, 2}), f32({3, 4})}, std::nullopt);
  EXPECT_EQ(mean, f32({2, 3}));
}

TEST(OpsTest, ReduceComponentsWithoutAxisRejectsShapeMismatchNamingTheReplica) {
  EXPECT_TRUE(fails_with(
      [] {
        consort::reduce_components(reduce_op::sum, tensors{f32({1, 2}), f32({3})}, std::nullopt);
      },
      errc::shape_mismatch, {"replica 1", "[1]", "[2]"}));
  EXPECT_TRUE(fails_with(
      [] {
        consort::reduce_components(reduce_op::sum, tensors{f32({1}), i32({3})}, std::nullopt);
      },
      errc::dtype_mismatch, {"replica 1", "int32", "float32"}));
}

TEST(OpsTest, MeanAlongAnAxisDividesByTheTotalCountNotTheMeanOfMeans) {
  // A partial batch split 4/2: the mean of 0..5 is 2.5; the mean of the means would be 3.
  auto out =
      consort::reduce_components(reduce_op::mean, tensors{f32({0, 1, 2, 3}), f32({4, 5})}, 0);
  EXPECT_EQ(out.rank(), 0);
  EXPECT_EQ(out.item<float>(), 2.5f);
}

TEST(OpsTest, AnEmptyReplicaAddsNothingToAMean) {
  auto empty = tensor::zeros(dtype::float32, {0});
  auto out = consort::reduce_components(reduce_op::mean, tensors{f32({1, 2}), empty}, 0);
  EXPECT_FALSE(std::isnan(out.item<float>()));
  EXPECT_EQ(out.item<float>(), 1.5f);
}

TEST(OpsTest, EmptyReplicasAreSkippedByMinAndMax) {
  auto empty = tensor::zeros(dtype::int32, {0});
  EXPECT_EQ(consort::reduce_components(reduce_op::min, tensors{empty, i32({5, 3}), i32({4})}, 0)
                .item<int32_t>(),
            3);
  EXPECT_EQ(
      consort::reduce_components(reduce_op::max, tensors{i32({5, 3}), empty}, 0).item<int32_t>(),
      5);
}

TEST(OpsTest, SumAlongAnAxisKeepsTheDtype) {
  auto out = consort::reduce_components(reduce_op::sum, tensors{i32({1, 2}), i32({3})}, 0);
  EXPECT_EQ(out.dtype(), dtype::int32);
  EXPECT_EQ(out.item<int32_t>(), 6);
}

TEST(OpsTest, IntegerMeanAlongAnAxisIsFloat64AndNotTruncated) {
  auto out = consort::reduce_components(reduce_op::mean, tensors{i32({1, 2}), i32({2})}, 0);
  EXPECT_EQ(out.dtype(), dtype::float64);
  EXPECT_DOUBLE_EQ(out.item<double>(), 5.0 / 3.0);
}

TEST(OpsTest, ReduceComponentsAlongAnInnerAxis) {
  // [2, 2] and [2, 3] reduced along axis 1: each row's total count is 5.
  auto a = f32({1, 2, 3, 4}, {2, 2});
  auto b = f32({5, 6, 7, 8, 9, 10}, {2, 3});
  EXPECT_EQ(consort::reduce_components(reduce_op::sum, tensors{a, b}, 1), f32({21, 34}));
  EXPECT_EQ(consort::reduce_components(reduce_op::mean, tensors{a, b}, -1),
            f32({21.f / 5, 34.f / 5}));
  EXPECT_EQ(consort::reduce_components(reduce_op::max, tensors{a, b}, 1), f32({7, 10}));
}

TEST(OpsTest, ReduceComponentsWhenEveryReplicaIsEmpty) {
  auto e32 = tensor::zeros(dtype::int32, {0, 2});
  auto sum = consort::reduce_components(reduce_op::sum, tensors{e32, e32}, 0);
  EXPECT_EQ(sum, i32({0, 0}));
  auto mean = consort::reduce_components(reduce_op::mean, tensors{e32, e32}, 0);
  EXPECT_EQ(mean.dtype(), dtype::float64);
  EXPECT_EQ(mean.shape(), (shape_t{2}));
  EXPECT_TRUE(std::isnan(mean.to_vector<double>()[0]));
  auto ef = tensor::zeros(dtype::float32, {0});
  auto fmean = consort::reduce_components(reduce_op::mean, tensors{ef}, 0);
  EXPECT_EQ(fmean.dtype(), dtype::float32);
  EXPECT_TRUE(std::isnan(fmean.item<float>()));
  EXPECT_TRUE(fails_with(
      [&] {
        consort::reduce_components(reduce_op::min, tensors{e32, e32}, 0);
      },
      errc::invalid_argument, {"MIN", "every replica", "empty"}));
  EXPECT_TRUE(fails_with([&] { consort::reduce_components(reduce_op::max, tensors{e32}, 0); },
                         errc::invalid_argument, {"MAX", "empty"}));
}

TEST(OpsTest, ReduceComponentsAlongAnAxisRejectsMismatchesNamingTheReplica) {
  EXPECT_TRUE(fails_with(
      [] {
        consort::reduce_components(reduce_op::sum,
                                   tensors{f32({1, 2}, {1, 2}), f32({1, 2, 3}, {1, 3})}, 0);
      },
      errc::shape_mismatch, {"replica 1", "[1, 3]", "[1, 2]"}));
  EXPECT_TRUE(fails_with(
      [] {
        consort::reduce_components(reduce_op::sum, tensors{f32({1, 2}, {1, 2}), f32({1, 2})}, 0);
      },
      errc::shape_mismatch, {"replica 1", "[2]", "[1, 2]"}));
  EXPECT_TRUE(fails_with(
      [] {
        consort::reduce_components(reduce_op::sum, tensors{f32({1}), i32({1})}, 0);
      },
      errc::dtype_mismatch, {"replica 1", "int32", "float32"}));
  EXPECT_TRUE(fails_with([] { consort::reduce_components(reduce_op::sum, tensors{f32({1})}, 1); },
                         errc::invalid_argument, {"axis 1"}));
  EXPECT_TRUE(fails_with(
      [] { consort::reduce_components(reduce_op::sum, tensors{tensor::scalar(1.f)}, 0); },
      errc::invalid_argument, {"scalar"}));
  EXPECT_TRUE(
      fails_with([] { consort::reduce_components(reduce_op::sum, std::vector<tensor>{}, 0); },
                 errc::invalid_argument, {"at least one"}));
  EXPECT_TRUE(fails_with(
      [] { consort::reduce_components(reduce_op::sum, tensors{tensor::from<bool>({true})}, 0); },
      errc::dtype_mismatch, {"cast to int32"}));
}

// -- nested components ----------------------------------------------------------------------------

TEST(OpsTest, ReduceComponentsOfNestsAppliesLeafByLeaf) {
  auto r0 = nest::dict({{"loss", f32({1, 2})}, {"n", nest::list({i32({1})})}});
  auto r1 = nest::dict({{"loss", f32({3})}, {"n", nest::list({i32({2})})}});
  auto out = consort::reduce_components(reduce_op::mean, std::vector<nest>{r0, r1}, 0);
  EXPECT_EQ(out["loss"].as_tensor().item<float>(), 2.f);
  EXPECT_EQ(out["n"][0].as_tensor().item<double>(), 1.5);
}

TEST(OpsTest, ReduceComponentsOfNestsRejectsAnotherStructureNamingTheReplica) {
  auto r0 = nest::dict({{"a", f32({1})}});
  auto r1 = nest::dict({{"a", f32({1})}});
  auto r2 = nest::dict({{"a", nest::list({f32({1}), f32({2})})}});
  EXPECT_TRUE(fails_with(
      [&] {
        consort::reduce_components(reduce_op::sum, std::vector<nest>{r0, r1, r2}, std::nullopt);
      },
      errc::structure_mismatch,
      {"replica 2", "at [\"a\"]: expected a tensor, got a list of 2 items"}));
  EXPECT_TRUE(fails_with(
      [] { consort::reduce_components(reduce_op::sum, std::vector<nest>{}, std::nullopt); },
      errc::invalid_argument, {"at least one"}));
}

TEST(OpsTest, ReduceComponentsOfNestsNamesTheLeafThatFails) {
  auto r0 = nest::dict({{"a", f32({1})}, {"b", f32({1, 2})}});
  auto r1 = nest::dict({{"a", f32({1})}, {"b", f32({1})}});
  EXPECT_TRUE(fails_with(
      [&] {
        consort::reduce_components(reduce_op::sum, std::vector<nest>{r0, r1}, std::nullopt);
      },
      errc::shape_mismatch, {"leaf [\"b\"]", "replica 1", "[1]", "[2]"}));
}

TEST(OpsTest, ConcatComponentsGathersLeafByLeafInReplicaOrder) {
  auto r0 = nest::list({f32({1}), i32({1, 2})});
  auto r1 = nest::list({f32({2, 3}), i32({3})});
  auto out = consort::concat_components({r0, r1}, 0);
  EXPECT_EQ(out[0].as_tensor(), f32({1, 2, 3}));
  EXPECT_EQ(out[1].as_tensor(), i32({1, 2, 3}));
}

TEST(OpsTest, ConcatComponentsRejectsMismatchesNamingTheReplica) {
  auto r0 = nest::list({f32({1})});
  auto r1 = nest::list({f32({1}), f32({1})});
  EXPECT_TRUE(fails_with(
      [&] {
        consort::concat_components({r0, r1}, 0);
      },
      errc::structure_mismatch, {"replica 1"}));
  auto s0 = nest::list({f32({1}, {1, 1})});
  auto s1 = nest::list({f32({1, 2}, {1, 2})});
  EXPECT_TRUE(fails_with(
      [&] {
        consort::concat_components({s0, s1}, 0);
      },
      errc::shape_mismatch, {"leaf [0]", "replica 1", "[1, 2]", "[1, 1]"}));
  EXPECT_TRUE(fails_with(
      [] {
        consort::concat_components({nest{tensor::scalar(1)}, nest{tensor::scalar(2)}}, 0);
      },
      errc::invalid_argument, {"reshape it to [1]", "replica 0"}));
}

namespace {

TEST(OpsTest, LargeReductionsSplitAcrossThreadsMatchAReference) {
  // Big enough to take the parallel path (over 4 MiB touched), with a length that does not
  // divide evenly into chunks or blocks.
  const int64_t n = (int64_t{1} << 20) + 12345;
  std::vector<consort::tensor> inputs;
  for (int r = 0; r < 3; ++r) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      v[static_cast<size_t>(i)] = static_cast<int32_t>((i * 31 + r * 7) % 1000) - 500;
    inputs.push_back(consort::tensor::from<int32_t>(v, {n}));
  }
  auto sum = consort::reduce_elementwise(consort::reduce_op::sum, inputs);
  auto mean = consort::reduce_elementwise(consort::reduce_op::mean, inputs);
  auto mx = consort::reduce_elementwise(consort::reduce_op::max, inputs);
  const auto* s = sum.data<int32_t>();
  const auto* m = mean.data<double>();
  const auto* x = mx.data<int32_t>();
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) {
    int32_t a = inputs[0].data<int32_t>()[i], b = inputs[1].data<int32_t>()[i],
            c = inputs[2].data<int32_t>()[i];
    wrong += s[i] != a + b + c;
    wrong += std::abs(m[i] - (a + b + c) / 3.0) > 1e-9;
    wrong += x[i] != std::max({a, b, c});
  }
  EXPECT_EQ(wrong, 0);
}

} // namespace
