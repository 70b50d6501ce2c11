// The packed formats (GGUF's blocks in qarray's kernel layout): their sizes, a format's dispatch, a
// block's bits unpacked to values, and the problem a call solves.
// Included by qmatmul.cc only (one translation unit: its anonymous namespace).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

#include "qsimd.h"

namespace {


constexpr int64_t kPanelRows = 16; // more rows: dequantized panels and a register-blocked product
constexpr int64_t kAhead = 3;      // blocks of q prefetched ahead of the one being read

enum Fmt : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ5_K = 6, kQ6_K = 7 };

// bytes of q per block and column (GGUF's block less its float16 d and m; qarray.SPECS)
template <int32_t FMT>
constexpr int64_t kRows = FMT == kQ8_0 ? 32 : FMT <= kQ4_1 ? 16 : FMT <= kQ5_1 ? 20 : FMT == kQ4_K ? 140
                          : FMT == kQ5_K ? 172 : 208;
// values per block (a K-quant's super-block: 256) and per sub-block (one scale each)
template <int32_t FMT>
constexpr int64_t kValues = FMT >= kQ4_K ? 256 : 32;
template <int32_t FMT>
constexpr int64_t kSub = FMT == kQ6_K ? 16 : 32;
template <int32_t FMT>
constexpr bool kHasMin = FMT == kQ4_1 || FMT == kQ5_1 || FMT == kQ4_K || FMT == kQ5_K;
// Q5_x and the K-quants are unpacked a block at a time (`unpack`) before the product: their
// bits are spread over several bytes, and one plain loop over the 64 columns a row of bytes
// (which the compiler vectorizes) is simpler than a vector path per format
template <int32_t FMT>
constexpr bool kUnpacked = FMT >= kQ5_0;

int64_t rows_of(int32_t fmt) {
  constexpr int64_t r[] = {kRows<kQ8_0>, kRows<kQ4_0>, kRows<kQ4_1>, kRows<kQ5_0>,
                           kRows<kQ5_1>, kRows<kQ4_K>, kRows<kQ5_K>, kRows<kQ6_K>};
  return r[fmt];
}
int64_t values_of(int32_t fmt) { return fmt >= kQ4_K ? 256 : 32; }
int64_t sub_of(int32_t fmt) { return fmt == kQ6_K ? 16 : 32; }

// fn(std::integral_constant<int32_t, FMT>) for the format `fmt` names
template <class Fn>
void by_format(int32_t fmt, Fn&& fn) {
  switch (fmt) {
    case kQ8_0: return fn(std::integral_constant<int32_t, kQ8_0>{});
    case kQ4_0: return fn(std::integral_constant<int32_t, kQ4_0>{});
    case kQ4_1: return fn(std::integral_constant<int32_t, kQ4_1>{});
    case kQ5_0: return fn(std::integral_constant<int32_t, kQ5_0>{});
    case kQ5_1: return fn(std::integral_constant<int32_t, kQ5_1>{});
    case kQ4_K: return fn(std::integral_constant<int32_t, kQ4_K>{});
    case kQ5_K: return fn(std::integral_constant<int32_t, kQ5_K>{});
    default: return fn(std::integral_constant<int32_t, kQ6_K>{});
  }
}

inline float half(uint16_t h) {
  _Float16 f;
  std::memcpy(&f, &h, sizeof f);
  return static_cast<float>(f);
}

// 64-byte aligned float buffers (aligned vector loads and stores), kept per thread and grown.
struct Free {
  void operator()(float* f) const { std::free(f); }
};
using Floats = std::unique_ptr<float[], Free>;

float* scratch(Floats& buf, int64_t& size, int64_t want) {
  if (size < want) {
    buf.reset(static_cast<float*>(std::aligned_alloc(64, (want * sizeof(float) + 63) / 64 * 64)));
    size = want;
  }
  return buf.get();
}

struct Problem {
  const float* x;
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  const float* sx;  // [M, ns]: the sum of each sub-block's inputs (ns = K / sub-block size)
  float* y;
  int64_t M, K, N, nb, ns;
  int32_t fmt;
  // 8-bit activations (act = 1; x then holds them rounded, as floats): per row and 32 inputs
  // xq [M, K], their scale dx and their sum sq [M, K / 32]; null otherwise
  const int8_t* xq;
  const float* dx;
  const int32_t* sq;
  // tile c's block b: its R x 64 bytes of q and its 64 scales (and mins)
  template <int32_t FMT>
  const uint8_t* qt(int64_t c, int64_t b) const { return q + (c * nb + b) * kRows<FMT> * kW; }
  int64_t at(int64_t c, int64_t b) const { return (c * nb + b) * kW; }
};

// A Q5_x or K-quant block of a tile unpacked: its values as small integers and, per sub-block,
// the float scale and offset of value = v * sc + mn (the same products as qarray's dequantize).
template <int32_t FMT>
struct Unpacked {
  static constexpr int64_t kS = kValues<FMT> / kSub<FMT>;  // sub-blocks
  alignas(64) int8_t v[kValues<FMT>][kW];
  alignas(64) float sc[kS][kW];
  alignas(64) float mn[kS][kW];
};

// out[n] = sign * d[n] * k[n] over the 64 columns: float16 scales times small integers held as
// bytes (signed for Q6_K), in vectors where there are any (scalar, these conversions cost more
// than unpacking the block's bits).
template <bool SIGNED>
inline void scaled(const uint16_t* d, const uint8_t* k, float* out, float sign) {
#if defined(TL_SIMD)
  for (int g = 0; g < kG; ++g) {
    const V::F kv = SIGNED ? V::signed_bytes(k + V::L * g) : V::to_float(V::bytes(k + V::L * g));
    V::store(out + V::L * g, V::mul(V::mul(V::halves(d + V::L * g), kv), V::set1(sign)));
  }
#else
  for (int64_t n = 0; n < kW; ++n)
    out[n] = sign * half(d[n]) * (SIGNED ? static_cast<float>(static_cast<int8_t>(k[n])) : static_cast<float>(k[n]));
#endif
}

// Block b of tile c into u: row r of q is byte r of the block for each of the 64 columns.
template <int32_t FMT>
void unpack(const Problem& p, int64_t c, int64_t b, Unpacked<FMT>& u) {
  // restrict: the bytes written never alias the block read (without it every byte loop is
  // versioned behind a run-time overlap check)
  const uint8_t* __restrict q = p.qt<FMT>(c, b);
  const uint16_t* d = p.d + p.at(c, b);
  const uint16_t* m = p.m + p.at(c, b);
  int8_t(*__restrict v)[kW] = u.v;
  if constexpr (FMT == kQ5_0 || FMT == kQ5_1) {  // qh[4] (bit j: value j's 5th bit), qs[16]
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t n = 0; n < kW; ++n) {
        const uint8_t b0 = q[(4 + j) * kW + n];
        const int hb0 = (q[(j / 8) * kW + n] >> (j % 8)) & 1, hb1 = (q[(2 + j / 8) * kW + n] >> (j % 8)) & 1;
        const int off = FMT == kQ5_0 ? 16 : 0;
        v[j][n] = static_cast<int8_t>(((b0 & 15) | (hb0 << 4)) - off);
        v[j + 16][n] = static_cast<int8_t>(((b0 >> 4) | (hb1 << 4)) - off);
      }
    alignas(64) static constexpr uint8_t ones[kW] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                                     1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    scaled<false>(d, ones, u.sc[0], 1.f);
    if constexpr (FMT == kQ5_1) {
      scaled<false>(m, ones, u.mn[0], 1.f);
    } else {
      std::fill(u.mn[0], u.mn[0] + kW, 0.f);
    }
  } else if constexpr (FMT == kQ4_K || FMT == kQ5_K) {  // scales[12] (, qh[32]), qs[128]
    alignas(64) uint8_t sc[8][kW], mn[8][kW];  // ggml's get_scale_min_k4, 64 columns at a time
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t n = 0; n < kW; ++n) {
        sc[j][n] = q[(j) * kW + n] & 63, mn[j][n] = q[(j + 4) * kW + n] & 63;
        sc[j + 4][n] = (q[(j + 8) * kW + n] & 15) | ((q[(j) * kW + n] >> 6) << 4);
        mn[j + 4][n] = (q[(j + 8) * kW + n] >> 4) | ((q[(j + 4) * kW + n] >> 6) << 4);
      }
    for (int64_t j = 0; j < 8; ++j) scaled<false>(d, sc[j], u.sc[j], 1.f), scaled<false>(m, mn[j], u.mn[j], -1.f);
    const int64_t qs = FMT == kQ5_K ? 44 : 12;
    for (int64_t i = 0; i < 4; ++i)  // bytes 32 i + l: value 64 i + l (low nibble), 64 i + 32 + l (high)
      for (int64_t l = 0; l < 32; ++l)
        for (int64_t n = 0; n < kW; ++n) {
          const uint8_t byte = q[(qs + 32 * i + l) * kW + n];
          int lo = byte & 15, hi = byte >> 4;
          if constexpr (FMT == kQ5_K) {
            const uint8_t h = q[(12 + l) * kW + n];
            lo |= ((h >> (2 * i)) & 1) << 4, hi |= ((h >> (2 * i + 1)) & 1) << 4;
          }
          v[64 * i + l][n] = static_cast<int8_t>(lo), v[64 * i + 32 + l][n] = static_cast<int8_t>(hi);
        }
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16]; half h: value 128 h + 32 k + l
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t l = 0; l < 32; ++l)
        for (int64_t n = 0; n < kW; ++n) {
          const uint8_t a = q[(64 * h + l) * kW + n], b2 = q[(64 * h + 32 + l) * kW + n], hh = q[(128 + 32 * h + l) * kW + n];
          v[128 * h + l][n] = static_cast<int8_t>(((a & 15) | ((hh & 3) << 4)) - 32);
          v[128 * h + 32 + l][n] = static_cast<int8_t>(((b2 & 15) | (((hh >> 2) & 3) << 4)) - 32);
          v[128 * h + 64 + l][n] = static_cast<int8_t>(((a >> 4) | (((hh >> 4) & 3) << 4)) - 32);
          v[128 * h + 96 + l][n] = static_cast<int8_t>(((b2 >> 4) | (((hh >> 6) & 3) << 4)) - 32);
        }
    for (int64_t j = 0; j < 16; ++j) scaled<true>(d, q + (192 + j) * kW, u.sc[j], 1.f), std::fill(u.mn[j], u.mn[j] + kW, 0.f);
  }
}

template <int32_t FMT>
Unpacked<FMT>& unpacked_buffer() {
  thread_local Unpacked<FMT> u;
  return u;
}

// The block's scale applied to the block's sums: out += d * acc (+ m * s), per format.
inline float combine(int32_t fmt, float out, float acc, float d, float m, float s) {
  if (fmt == kQ4_0) return out + d * (acc - 8.f * s);
  if (fmt == kQ4_1) return out + d * acc + m * s;
  return out + d * acc;
}

}  // namespace
