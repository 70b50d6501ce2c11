// The vector operations the kernels use: AVX-512 or AVX2 + FMA + F16C (`V`), else none (TL_SIMD
// undefined: the portable loops). Included by qmatmul.cc only.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define TL_SIMD 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kW = 64;  // columns per tile

#if defined(TL_SIMD)
// The vector operations the kernels use, for AVX-512 (16 lanes, 32 registers) or AVX2 + FMA +
// F16C (8 lanes, 16 registers): a 64-column tile row is G = 64 / L vectors.
#if defined(__AVX512F__)
struct V {
  using F = __m512;
  using I = __m512i;
  static constexpr int L = 16;
  static constexpr int kMT = 6;  // stream rows per pass: MT x 4 block sums in registers (the outputs,
                                 // updated once a block, may live on the stack): 6 against 3 halves the
                                 // passes that re-widen each tile at 16 rows (4-15% faster at 4 and 16)
  static constexpr int kPR = 6;  // panel rows x vectors per register block: 6 x 4 sums + 4 weights
  static constexpr int kNG = 4;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float f) { return _mm512_set1_ps(f); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
  static F halves(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I bytes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F signed_bytes(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static I low(I u) { return _mm512_and_si512(u, _mm512_set1_epi32(15)); }
  static I high(I u) { return _mm512_srli_epi32(u, 4); }
  static I minus8(I u) { return _mm512_sub_epi32(u, _mm512_set1_epi32(8)); }
  static F to_float(I u) { return _mm512_cvtepi32_ps(u); }
  static void store_first(float* p, F v, int64_t lanes) {  // the first `lanes` (clamped to [0, L])
    lanes = std::clamp<int64_t>(lanes, 0, 16);
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>(lanes == 16 ? 0xFFFF : (1u << lanes) - 1), v);
  }
};
#else
struct V {
  using F = __m256;
  using I = __m256i;
  static constexpr int L = 8;
  static constexpr int kMT = 1;  // 8 sums + 8 outputs already fill the 16 registers
  // 6 x 2 sums + 2 weights (a panel's 64 columns in four passes): 10-25% faster at 128 rows
  // than 3 x 4, which reads the panel from L2 twice as often per product
  static constexpr int kPR = 6;
  static constexpr int kNG = 2;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float f) { return _mm256_set1_ps(f); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
  static F halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I bytes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static F signed_bytes(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static I low(I u) { return _mm256_and_si256(u, _mm256_set1_epi32(15)); }
  static I high(I u) { return _mm256_srli_epi32(u, 4); }
  static I minus8(I u) { return _mm256_sub_epi32(u, _mm256_set1_epi32(8)); }
  static F to_float(I u) { return _mm256_cvtepi32_ps(u); }
  static void store_first(float* p, F v, int64_t lanes) {
    if (lanes >= 8) return _mm256_storeu_ps(p, v);
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(p, tmp, std::max<int64_t>(lanes, 0) * sizeof(float));
  }
};
#endif
constexpr int kG = kW / V::L;  // vectors per 64-column tile row
#endif

}  // namespace
