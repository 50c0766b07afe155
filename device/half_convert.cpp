#include "device/half_convert.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CONSORT_HALF_X86 1
#else
#define CONSORT_HALF_X86 0
#endif

namespace consort::detail {

namespace {

void to_float_scalar(const float16_t* in, float* out, size_t n) noexcept {
  for (size_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(in[i]);
}

void from_float_scalar(const float* in, float16_t* out, size_t n) noexcept {
  for (size_t i = 0; i < n; ++i)
    out[i] = float16_t(in[i]);
}

#if CONSORT_HALF_X86
// Eight at a time; a group of eight that holds a NaN goes element by element, so that NaNs keep
// the exact bits of the scalar conversions.
__attribute__((target("avx,f16c"))) void to_float_f16c(const float16_t* in, float* out,
                                                       size_t n) noexcept {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h;
    std::memcpy(&h, static_cast<const void*>(in + i), sizeof h);
    // A half is NaN when its exponent is all ones and its mantissa is not zero.
    const __m128i magnitude = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
    const __m128i nan = _mm_cmpgt_epi16(magnitude, _mm_set1_epi16(0x7c00));
    if (_mm_movemask_epi8(nan) != 0) {
      to_float_scalar(in + i, out + i, 8);
      continue;
    }
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  to_float_scalar(in + i, out + i, n - i);
}

__attribute__((target("avx,f16c"))) void from_float_f16c(const float* in, float16_t* out,
                                                         size_t n) noexcept {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(in + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)) != 0) {
      from_float_scalar(in + i, out + i, 8);
      continue;
    }
    const __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(static_cast<void*>(out + i), &h, sizeof h);
  }
  from_float_scalar(in + i, out + i, n - i);
}

/// Eight bfloat16s to floats: zero-extend to 32 bits and shift into the top half.
__attribute__((target("avx2"))) inline __m256 bf16_to_ps(const bfloat16_t* in) noexcept {
  __m128i h;
  std::memcpy(&h, static_cast<const void*>(in), sizeof h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/// Eight floats, none NaN, to bfloat16s, rounded to nearest even.
__attribute__((target("avx2"))) inline void ps_to_bf16(__m256 f, bfloat16_t* out) noexcept {
  const __m256i x = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  // Pack the eight 32-bit lanes (each < 2^16) into eight 16-bit ones, in order.
  const __m128i lo = _mm256_castsi256_si128(rounded);
  const __m128i hi = _mm256_extracti128_si256(rounded, 1);
  const __m128i packed = _mm_packus_epi32(lo, hi);
  std::memcpy(static_cast<void*>(out), &packed, sizeof packed);
}

__attribute__((target("avx2"))) void to_float_avx2(const bfloat16_t* in, float* out,
                                                   size_t n) noexcept {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, bf16_to_ps(in + i));
  for (; i < n; ++i)
    out[i] = static_cast<float>(in[i]);
}

__attribute__((target("avx2"))) void from_float_avx2(const float* in, bfloat16_t* out,
                                                     size_t n) noexcept {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(in + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)) != 0) {
      for (size_t j = i; j < i + 8; ++j)
        out[j] = bfloat16_t(in[j]);
      continue;
    }
    ps_to_bf16(f, out + i);
  }
  for (; i < n; ++i)
    out[i] = bfloat16_t(in[i]);
}

/// out = T((float(a) + float(b)) * s) in one pass, eight at a time; a group whose inputs or sum
/// hold a NaN goes element by element (the scalar conversions' NaN bits).
template <bool Scaled>
__attribute__((target("avx2,f16c"))) void add_f16c(const float16_t* a, const float16_t* b,
                                                   float16_t* out, size_t n, float s) noexcept {
  size_t i = 0;
  const __m256 scale = _mm256_set1_ps(s);
  for (; i + 8 <= n; i += 8) {
    __m128i ha, hb;
    std::memcpy(&ha, static_cast<const void*>(a + i), sizeof ha);
    std::memcpy(&hb, static_cast<const void*>(b + i), sizeof hb);
    __m256 r = _mm256_add_ps(_mm256_cvtph_ps(ha), _mm256_cvtph_ps(hb));
    if constexpr (Scaled)
      r = _mm256_mul_ps(r, scale);
    const __m128i nan_in = _mm_or_si128(
        _mm_cmpgt_epi16(_mm_and_si128(ha, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00)),
        _mm_cmpgt_epi16(_mm_and_si128(hb, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00)));
    if (_mm_movemask_epi8(nan_in) != 0 ||
        _mm256_movemask_ps(_mm256_cmp_ps(r, r, _CMP_UNORD_Q)) != 0)
      break;
    const __m128i h = _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(static_cast<void*>(out + i), &h, sizeof h);
  }
  for (; i < n; ++i) {
    float r = static_cast<float>(a[i]) + static_cast<float>(b[i]);
    if constexpr (Scaled)
      r *= s;
    out[i] = float16_t(r);
  }
}

template <bool Scaled>
__attribute__((target("avx2"))) void add_avx2(const bfloat16_t* a, const bfloat16_t* b,
                                              bfloat16_t* out, size_t n, float s) noexcept {
  size_t i = 0;
  const __m256 scale = _mm256_set1_ps(s);
  for (; i + 8 <= n; i += 8) {
    const __m256 fa = bf16_to_ps(a + i), fb = bf16_to_ps(b + i);
    __m256 r = _mm256_add_ps(fa, fb);
    if constexpr (Scaled)
      r = _mm256_mul_ps(r, scale);
    if (_mm256_movemask_ps(_mm256_cmp_ps(r, r, _CMP_UNORD_Q)) != 0)
      break; // a NaN input makes a NaN sum
    ps_to_bf16(r, out + i);
  }
  for (; i < n; ++i) {
    float r = static_cast<float>(a[i]) + static_cast<float>(b[i]);
    if constexpr (Scaled)
      r *= s;
    out[i] = bfloat16_t(r);
  }
}

bool cpu_has_f16c() noexcept {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}
#endif

const bool use_f16c = [] {
#if CONSORT_HALF_X86
  return cpu_has_f16c();
#else
  return false;
#endif
}();

const bool use_avx2 = [] {
#if CONSORT_HALF_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && cpu_has_f16c();
#else
  return false;
#endif
}();

} // namespace

bool half_conversions_use_f16c() noexcept {
  return use_f16c;
}

void to_float(const float16_t* in, float* out, size_t n) noexcept {
#if CONSORT_HALF_X86
  if (use_f16c)
    return to_float_f16c(in, out, n);
#endif
  to_float_scalar(in, out, n);
}

void from_float(const float* in, float16_t* out, size_t n) noexcept {
#if CONSORT_HALF_X86
  if (use_f16c)
    return from_float_f16c(in, out, n);
#endif
  from_float_scalar(in, out, n);
}

void to_float(const bfloat16_t* in, float* out, size_t n) noexcept {
#if CONSORT_HALF_X86
  if (use_avx2)
    return to_float_avx2(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(in[i]);
}

void from_float(const float* in, bfloat16_t* out, size_t n) noexcept {
#if CONSORT_HALF_X86
  if (use_avx2)
    return from_float_avx2(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i)
    out[i] = bfloat16_t(in[i]);
}

template <class T>
void add_scalar(const T* a, const T* b, T* out, size_t n, bool scaled, float s) noexcept {
  for (size_t i = 0; i < n; ++i) {
    float r = static_cast<float>(a[i]) + static_cast<float>(b[i]);
    out[i] = T(scaled ? r * s : r);
  }
}

void add(const float16_t* a, const float16_t* b, float16_t* out, size_t n, bool scaled,
         float s) noexcept {
#if CONSORT_HALF_X86
  if (use_avx2)
    return scaled ? add_f16c<true>(a, b, out, n, s) : add_f16c<false>(a, b, out, n, s);
#endif
  add_scalar(a, b, out, n, scaled, s);
}

void add(const bfloat16_t* a, const bfloat16_t* b, bfloat16_t* out, size_t n, bool scaled,
         float s) noexcept {
#if CONSORT_HALF_X86
  if (use_avx2)
    return scaled ? add_avx2<true>(a, b, out, n, s) : add_avx2<false>(a, b, out, n, s);
#endif
  add_scalar(a, b, out, n, scaled, s);
}

} // namespace consort::detail
