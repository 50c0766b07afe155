// float16 and bfloat16: the conversions of consort::float16_t / bfloat16_t (every bit pattern
// through float and back, rounding to nearest even, NaN, infinity, subnormals), tensors of them,
// and the host kernels, which accumulate them in float32 and round once.

#include "support/expect_error.hpp"
#include "support/half_helpers.hpp"

#include "device/half_convert.hpp"

#include <consort/ops.hpp>
#include <consort/tensor.hpp>

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using consort::bfloat16_t;
using consort::dtype;
using consort::errc;
using consort::float16_t;
using consort::reduce_op;
using consort::tensor;
using consort::test::fails_with;
using consort::test::floats_of;
using consort::test::half_tensor;

namespace {

uint16_t half_bits(float f) {
  return float16_t(f).bits();
}

uint16_t bf16_bits(float f) {
  return bfloat16_t(f).bits();
}

float from_half_bits(uint16_t b) {
  return static_cast<float>(float16_t::from_bits(b));
}

float from_bf16_bits(uint16_t b) {
  return static_cast<float>(bfloat16_t::from_bits(b));
}

} // namespace

// -- dtype ----------------------------------------------------------------------------------------

TEST(HalfTest, DtypesAreAppendedNamedTwoBytesWideAndFloating) {
  // Appended: the numbers of the older dtypes never change.
  EXPECT_EQ(static_cast<int>(dtype::boolean), 5);
  EXPECT_EQ(static_cast<int>(dtype::float16), 6);
  EXPECT_EQ(static_cast<int>(dtype::bfloat16), 7);
  EXPECT_STREQ(to_string(dtype::float16), "float16");
  EXPECT_STREQ(to_string(dtype::bfloat16), "bfloat16");
  EXPECT_EQ(size_of(dtype::float16), 2u);
  EXPECT_EQ(size_of(dtype::bfloat16), 2u);
  EXPECT_TRUE(is_floating(dtype::float16));
  EXPECT_TRUE(is_floating(dtype::bfloat16));
  EXPECT_EQ(consort::dtype_of<float16_t>, dtype::float16);
  EXPECT_EQ(consort::dtype_of<bfloat16_t>, dtype::bfloat16);
}

// -- conversions ----------------------------------------------------------------------------------

TEST(HalfTest, EveryFloat16BitPatternSurvivesARoundTripThroughFloat) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const float f = from_half_bits(bits);
    ASSERT_EQ(half_bits(f), bits) << "bits 0x" << std::hex << b << " (" << f << ")";
    const bool nan = (b & 0x7c00) == 0x7c00 && (b & 0x3ff) != 0;
    ASSERT_EQ(std::isnan(f), nan) << std::hex << b;
  }
}

TEST(HalfTest, EveryBfloat16BitPatternSurvivesARoundTripThroughFloat) {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const float f = from_bf16_bits(bits);
    ASSERT_EQ(bf16_bits(f), bits) << "bits 0x" << std::hex << b;
    ASSERT_EQ(std::bit_cast<uint32_t>(f), b << 16);
  }
}

TEST(HalfTest, Float16ValuesAreExact) {
  EXPECT_EQ(from_half_bits(0x3c00), 1.0f);
  EXPECT_EQ(from_half_bits(0xc000), -2.0f);
  EXPECT_EQ(from_half_bits(0x7bff), 65504.0f);              // largest finite
  EXPECT_EQ(from_half_bits(0x0400), std::ldexp(1.0f, -14)); // smallest normal
  EXPECT_EQ(from_half_bits(0x0001), std::ldexp(1.0f, -24)); // smallest subnormal
  EXPECT_EQ(from_half_bits(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(from_half_bits(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(from_half_bits(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::signbit(from_half_bits(0x8000)));
}

TEST(HalfTest, Float16RoundsToNearestAndTiesToEven) {
  // 2049 lies halfway between 2048 (even mantissa) and 2050 (odd): ties go to 2048; 2051 lies
  // between 2050 (odd) and 2052 (even): to 2052.
  EXPECT_EQ(static_cast<float>(float16_t(2049.0f)), 2048.0f);
  EXPECT_EQ(static_cast<float>(float16_t(2051.0f)), 2052.0f);
  EXPECT_EQ(static_cast<float>(float16_t(2049.25f)), 2050.0f);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: to 1 (even).
  EXPECT_EQ(half_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(half_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Overflow: 65519 rounds to the largest finite, 65520 (the halfway point) and up to infinity.
  EXPECT_EQ(half_bits(65519.0f), 0x7bff);
  EXPECT_EQ(half_bits(65520.0f), 0x7c00);
  EXPECT_EQ(half_bits(-1e30f), 0xfc00);
  EXPECT_EQ(half_bits(std::numeric_limits<float>::infinity()), 0x7c00);
}

TEST(HalfTest, Float16SubnormalsRoundCorrectly) {
  const float tiny = std::ldexp(1.0f, -24); // smallest subnormal
  EXPECT_EQ(half_bits(tiny), 0x0001);
  EXPECT_EQ(half_bits(tiny / 2), 0x0000); // a tie: to zero (even)
  EXPECT_EQ(half_bits(tiny * 0.5000001f), 0x0001);
  EXPECT_EQ(half_bits(tiny * 1.5f), 0x0002); // a tie between 1 and 2 units: to 2
  EXPECT_EQ(half_bits(tiny * 2.5f), 0x0002); // a tie between 2 and 3 units: to 2
  EXPECT_EQ(half_bits(-tiny * 3), 0x8003);
  EXPECT_EQ(half_bits(std::ldexp(1023.5f, -24)), 0x0400); // rounds up into the normals
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(half_bits(-std::ldexp(1.0f, -30)), 0x8000);
  EXPECT_EQ(half_bits(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(HalfTest, NaNsStayNaN) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(static_cast<float>(float16_t(qnan))));
  EXPECT_TRUE(std::isnan(static_cast<float>(bfloat16_t(qnan))));
  // A float NaN whose payload is only in the low bits must not become infinity.
  const float low_payload = std::bit_cast<float>(0x7f800001u);
  EXPECT_TRUE(std::isnan(static_cast<float>(float16_t(low_payload))));
  EXPECT_TRUE(std::isnan(static_cast<float>(bfloat16_t(low_payload))));
  EXPECT_EQ(half_bits(-qnan) & 0x8000, 0x8000); // the sign is kept
  EXPECT_FALSE(float16_t(qnan) == float16_t(qnan));
  EXPECT_TRUE(float16_t(0.0f) == float16_t(-0.0f));
}

TEST(HalfTest, Bfloat16RoundsToNearestAndTiesToEven) {
  // bfloat16 has 8 significant bits: 257 is halfway between 256 and 258 (odd): to 256; 259 is
  // halfway between 258 (odd) and 260 (even): to 260.
  EXPECT_EQ(static_cast<float>(bfloat16_t(257.0f)), 256.0f);
  EXPECT_EQ(static_cast<float>(bfloat16_t(259.0f)), 260.0f);
  EXPECT_EQ(static_cast<float>(bfloat16_t(257.5f)), 258.0f);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::max()), 0x7f80); // rounds up to infinity
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::denorm_min()), 0x0000); // a tie: to zero
  EXPECT_EQ(bf16_bits(std::bit_cast<float>(0x00018000u)), 0x0002);        // a tie: to even
}

// -- tensors --------------------------------------------------------------------------------------

TEST(HalfTest, TensorsOfHalvesBehaveAsTensorsOfOtherTypes) {
  auto t = tensor::from<float16_t>({float16_t(1.5f), float16_t(-2.0f), float16_t(65504.0f)}, {3});
  EXPECT_EQ(t.dtype(), dtype::float16);
  EXPECT_EQ(t.num_bytes(), 6u);
  EXPECT_EQ(floats_of<float16_t>(t), (std::vector<float>{1.5f, -2.0f, 65504.0f}));
  EXPECT_EQ(t.to_string(), "float16[3]{1.5, -2, 65504}");
  EXPECT_TRUE(fails_with([&] { (void)t.to_vector<bfloat16_t>(); }, errc::dtype_mismatch,
                         {"float16", "bfloat16"}));
  EXPECT_TRUE(fails_with([&] { (void)t.to_vector<float>(); }, errc::dtype_mismatch,
                         {"float16", "float32"}));

  auto s = tensor::scalar(bfloat16_t(3.0f));
  EXPECT_EQ(s.dtype(), dtype::bfloat16);
  EXPECT_EQ(s.rank(), 0);
  EXPECT_EQ(static_cast<float>(s.item<bfloat16_t>()), 3.0f);
  EXPECT_EQ(s.item<float>(), 3.0f);
  EXPECT_EQ(s.item<double>(), 3.0);
  EXPECT_EQ(s.item<int32_t>(), 3);
  EXPECT_EQ(static_cast<float>(tensor::scalar(2.5f).item<float16_t>()), 2.5f);
  EXPECT_EQ(s.to_string(), "bfloat16[]{3}");
}

// -- host kernels ---------------------------------------------------------------------------------

TEST(HalfTest, ReduceElementwiseAccumulatesInFloat32AndRoundsOnce) {
  // Adding 1 to 2048 in float16 rounds back to 2048 (ties to even) at every step, so a float16
  // accumulator gives 2048; float32 gives 2051, rounded once to 2052.
  std::vector<tensor> in = {half_tensor<float16_t>({2048, 1}), half_tensor<float16_t>({1, 1}),
                            half_tensor<float16_t>({1, 1}), half_tensor<float16_t>({1, 1})};
  auto sum = consort::reduce_elementwise(reduce_op::sum, in);
  EXPECT_EQ(sum.dtype(), dtype::float16);
  EXPECT_EQ(floats_of<float16_t>(sum), (std::vector<float>{2052, 4}));
  // MEAN stays float16: 2051 / 4 = 512.75, rounded once (spacing 0.5 there) to 513.
  auto mean = consort::reduce_elementwise(reduce_op::mean, in);
  EXPECT_EQ(mean.dtype(), dtype::float16);
  EXPECT_EQ(floats_of<float16_t>(mean), (std::vector<float>{513, 1}));
  EXPECT_EQ(floats_of<float16_t>(consort::reduce_elementwise(reduce_op::max, in)),
            (std::vector<float>{2048, 1}));
  EXPECT_EQ(floats_of<float16_t>(consort::reduce_elementwise(reduce_op::min, in)),
            (std::vector<float>{1, 1}));

  // bfloat16 (8 significant bits): 256 + 1 + 1 + 1 = 259 in float32, 260 once rounded; 256 with a
  // bfloat16 accumulator.
  std::vector<tensor> bf = {half_tensor<bfloat16_t>({256, 3}), half_tensor<bfloat16_t>({1, 0.5f}),
                            half_tensor<bfloat16_t>({1, 0.5f}), half_tensor<bfloat16_t>({1, 2})};
  auto bsum = consort::reduce_elementwise(reduce_op::sum, bf);
  EXPECT_EQ(bsum.dtype(), dtype::bfloat16);
  EXPECT_EQ(floats_of<bfloat16_t>(bsum), (std::vector<float>{260, 6}));
  EXPECT_EQ(floats_of<bfloat16_t>(consort::reduce_elementwise(reduce_op::prod, bf)),
            (std::vector<float>{256, 1.5f}));
}

TEST(HalfTest, LargeReductionsRoundOnceInEveryBlockAndChunk) {
  // Past the parallel threshold and over many 16 KiB blocks: every element 2048 + 1 + 1 + 1.
  const size_t n = (size_t{1} << 20) + 7;
  std::vector<float16_t> big(n, float16_t(2048.0f));
  std::vector<float16_t> one(n, float16_t(1.0f));
  std::vector<tensor> in = {tensor::from<float16_t>(big), tensor::from<float16_t>(one),
                            tensor::from<float16_t>(one), tensor::from<float16_t>(one)};
  auto sum = consort::reduce_elementwise(reduce_op::sum, in).to_vector<float16_t>();
  ASSERT_EQ(sum.size(), n);
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(static_cast<float>(sum[i]), 2052.0f) << "element " << i;
}

TEST(HalfTest, ReduceAlongAnAxisAccumulatesInFloat32) {
  auto t = tensor::from<float16_t>({float16_t(2048.0f), float16_t(1.0f), float16_t(1.0f),
                                    float16_t(1.0f), float16_t(2.0f), float16_t(6.0f)},
                                   {6});
  auto sum = consort::reduce_axis(reduce_op::sum, t, 0);
  EXPECT_EQ(sum.dtype(), dtype::float16);
  EXPECT_EQ(static_cast<float>(sum.item<float16_t>()), 2060.0f); // 2059 -> 2060
  auto mean = consort::reduce_axis(reduce_op::mean, t, 0);
  EXPECT_EQ(mean.dtype(), dtype::float16);
  EXPECT_EQ(mean.item<float>(), static_cast<float>(float16_t(2059.0f / 6.0f)));
  // strategy.reduce along an axis: partial sums and the division in float32, one rounding.
  std::vector<tensor> components = {t, t};
  auto both = consort::reduce_components(reduce_op::sum, components, 0);
  EXPECT_EQ(both.dtype(), dtype::float16);
  EXPECT_EQ(both.item<float>(), 4120.0f); // 4118 -> 4120 (spacing 4)
  auto empty = tensor::zeros(dtype::bfloat16, {0, 2});
  EXPECT_EQ(floats_of<bfloat16_t>(consort::reduce_axis(reduce_op::sum, empty, 0)),
            (std::vector<float>{0, 0}));
  auto empty_mean = consort::reduce_axis(reduce_op::mean, empty, 0).to_vector<bfloat16_t>();
  EXPECT_TRUE(std::isnan(static_cast<float>(empty_mean.at(0)))); // 0/0, as tf.reduce_mean
}

TEST(HalfTest, MixingAHalfTypeWithAnotherDtypeIsADtypeMismatchNamingBoth) {
  std::vector<tensor> in = {half_tensor<float16_t>({1}), half_tensor<bfloat16_t>({1})};
  EXPECT_TRUE(fails_with([&] { (void)consort::reduce_elementwise(reduce_op::sum, in); },
                         errc::dtype_mismatch, {"float16", "bfloat16"}));
  std::vector<tensor> axis_in = {half_tensor<float16_t>({1}), tensor::from<float>({1.0f})};
  EXPECT_TRUE(fails_with([&] { (void)consort::reduce_components(reduce_op::sum, axis_in, 0); },
                         errc::dtype_mismatch, {"float16", "float32"}));
  EXPECT_TRUE(fails_with([&] { (void)consort::concat(axis_in, 0); }, errc::dtype_mismatch,
                         {"float16", "float32"}));
}

// -- block conversions (device/half_convert.hpp)
// ---------------------------------------------------

namespace {

/// Floats that probe every branch of the conversions: every value of both 16-bit types, the
/// midpoints between neighbouring float16 values (ties), values around the subnormal and overflow
/// edges, signalling and quiet NaNs, infinities, and a pseudo-random spread of magnitudes.
std::vector<float> probe_floats() {
  std::vector<float> v;
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float h = static_cast<float>(float16_t::from_bits(static_cast<uint16_t>(b)));
    v.push_back(h);
    v.push_back(static_cast<float>(bfloat16_t::from_bits(static_cast<uint16_t>(b))));
    if (std::isfinite(h)) // a tie: halfway to the next float16 up
      v.push_back(h +
                  (static_cast<float>(float16_t::from_bits(static_cast<uint16_t>(b + 1))) - h) / 2);
  }
  for (uint32_t bits :
       {0x7f800001u, 0x7fc00000u, 0xffa00000u, 0x7f800000u, 0xff800000u, 0x477fefffu, 0x477ff000u,
        0x33000000u, 0x33000001u, 0x00000001u, 0x80000001u})
    v.push_back(std::bit_cast<float>(bits));
  uint32_t state = 1;
  for (int i = 0; i < 100000; ++i) {
    state = state * 1664525u + 1013904223u;
    v.push_back(std::bit_cast<float>(state));
  }
  return v;
}

} // namespace

TEST(HalfConvertTest, BlockConversionsGiveTheBitsOfTheElementwiseOnes) {
  // Odd lengths and offsets, so that the vector loops' tails run as well as their bodies.
  const auto floats = probe_floats();
  std::vector<float16_t> h(floats.size());
  std::vector<bfloat16_t> b(floats.size());
  consort::detail::from_float(floats.data() + 1, h.data() + 1, floats.size() - 1);
  consort::detail::from_float(floats.data() + 1, b.data() + 1, floats.size() - 1);
  size_t wrong_h = 0, wrong_b = 0;
  for (size_t i = 1; i < floats.size(); ++i) {
    wrong_h += h[i].bits() != float16_t(floats[i]).bits();
    wrong_b += b[i].bits() != bfloat16_t(floats[i]).bits();
  }
  EXPECT_EQ(wrong_h, 0u) << "float16, F16C: " << consort::detail::half_conversions_use_f16c();
  EXPECT_EQ(wrong_b, 0u);

  std::vector<float16_t> every_h(0x10003);
  std::vector<bfloat16_t> every_b(0x10003);
  for (uint32_t i = 0; i < every_h.size(); ++i) {
    every_h[i] = float16_t::from_bits(static_cast<uint16_t>(i * 7u));
    every_b[i] = bfloat16_t::from_bits(static_cast<uint16_t>(i * 7u));
  }
  std::vector<float> from_h(every_h.size()), from_b(every_b.size());
  consort::detail::to_float(every_h.data(), from_h.data(), every_h.size());
  consort::detail::to_float(every_b.data(), from_b.data(), every_b.size());
  size_t wrong_to = 0;
  for (size_t i = 0; i < every_h.size(); ++i) {
    wrong_to += std::bit_cast<uint32_t>(from_h[i]) !=
                std::bit_cast<uint32_t>(static_cast<float>(every_h[i]));
    wrong_to += std::bit_cast<uint32_t>(from_b[i]) !=
                std::bit_cast<uint32_t>(static_cast<float>(every_b[i]));
  }
  EXPECT_EQ(wrong_to, 0u);
}

TEST(HalfConvertTest, TheOnePassSumGivesTheBitsOfTheElementwiseOne) {
  // Pairs from the probe values (ties, edges, NaNs, infinities among them), summed plain and
  // scaled (MEAN's combine), at odd lengths so that the vector loops' tails run too.
  const auto floats = probe_floats();
  const size_t n = floats.size() / 2;
  std::vector<float16_t> ha(n), hb(n), hout(n);
  std::vector<bfloat16_t> ba(n), bb(n), bout(n);
  for (size_t i = 0; i < n; ++i) {
    ha[i] = float16_t(floats[i]);
    hb[i] = float16_t(floats[n + i]);
    ba[i] = bfloat16_t(floats[i]);
    bb[i] = bfloat16_t(floats[n + i]);
  }
  for (bool scaled : {false, true}) {
    const float s = 1.0f / 3.0f;
    consort::detail::add(ha.data(), hb.data(), hout.data(), n - 1, scaled, s);
    consort::detail::add(ba.data(), bb.data(), bout.data(), n - 1, scaled, s);
    // A sum of two NaNs is a NaN whose payload depends on the order the compiler gave the
    // operands (x86 keeps the first's), so a NaN sum is only checked to be NaN.
    auto same = [](auto got, auto want) {
      return std::isnan(static_cast<float>(want)) ? std::isnan(static_cast<float>(got))
                                                  : got.bits() == want.bits();
    };
    size_t wrong_h = 0, wrong_b = 0;
    for (size_t i = 0; i + 1 < n; ++i) {
      const float rh = static_cast<float>(ha[i]) + static_cast<float>(hb[i]);
      const float rb = static_cast<float>(ba[i]) + static_cast<float>(bb[i]);
      wrong_h += !same(hout[i], float16_t(scaled ? rh * s : rh));
      wrong_b += !same(bout[i], bfloat16_t(scaled ? rb * s : rb));
    }
    EXPECT_EQ(wrong_h, 0u) << "scaled " << scaled;
    EXPECT_EQ(wrong_b, 0u) << "scaled " << scaled;
  }
  // In place (out aliasing an input), as the ring all-reduce combines.
  auto expected = hout;
  consort::detail::add(ha.data(), hb.data(), ha.data(), n - 1, true, 1.0f / 3.0f);
  for (size_t i = 0; i + 1 < n; ++i)
    ASSERT_TRUE(std::isnan(static_cast<float>(expected[i])) ? std::isnan(static_cast<float>(ha[i]))
                                                            : ha[i].bits() == expected[i].bits())
        << i;
}
