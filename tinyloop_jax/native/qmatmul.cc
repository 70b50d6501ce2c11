// x [M, K] float32 @ a GGUF-packed weight [K, N] -> y [M, N] float32, reading the packed bytes
// once: an XLA FFI custom call for XLA:CPU, which has no dot over 4/8-bit weights (it would
// write the dequantized float32 matrix and read it again; see tinyloop_jax/model/qarray.py).
//
// The weight comes in qarray's kernel layout (`qarray.tile`): 64 columns at a time, each such
// tile's bytes contiguous from the first block to the last,
//   q [C, K/S, R, 64]  (a block of S values: R bytes of it per column, GGUF's block less its d
//                       and m. Q8_0: 32 int8; Q4_0 / Q4_1: 16 bytes of two nibbles, value j in
//                       the low nibble, j + 16 in the high one; Q5_x and the K-quants: see
//                       `unpack` and qarray's module doc)
//   d, m [C, K/S, 64]  float16,   C = ceil(N / 64)
// so a tile is one sequential stream (with GGUF's own [K/S, R, N] order a tile would read 64
// bytes of every row, or partial sums would go through L1: 2-3x slower from DRAM). Per block b
// and row t:
//   y[t, n] += d[b, n] * sum_j q[b, j, n] x[t, 32 b + j]   (+ m[b, n] * sum_j x[t, 32 b + j])
// (q4_0 subtracts 8 * d * sum_j x); Q5_x and the K-quants per sub-block, with its own scale
// and offset, after the block's bits are unpacked to bytes. Tiles are shared out between the calling thread and
// helpers: for decode, threads of our own, one per other thread of XLA's intra-op pool
// (`Spinners`); for a prompt's panels, XLA's pool. The calling thread takes tiles too, so a
// call finishes even when no helper comes. Vectors: AVX-512 or AVX2 + FMA + F16C (`V`), else
// plain C++ loops (`stream_generic`, one row at a time, no panels).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "qsimd.h"     // V: the vector operations (TL_SIMD)
#include "qformats.h"   // the formats, a block unpacked, Problem
#include "spinners.h"   // the helper threads of decode calls

namespace ffi = xla::ffi;

namespace {

// Portable: rows t0.. of tile c over blocks [b0, b1), w of its 64 columns, into dst [M, N].
template <int32_t FMT>
void stream_generic(const Problem& p, int64_t c, int64_t w, int64_t b0, int64_t b1, float* dst) {
  if constexpr (kUnpacked<FMT>) {
    Unpacked<FMT>& u = unpacked_buffer<FMT>();
    std::vector<float> out(p.M * kW, 0.f);
    for (int64_t b = b0; b < b1; ++b) {
      unpack<FMT>(p, c, b, u);
      for (int64_t t = 0; t < p.M; ++t)
        for (int64_t s = 0; s < Unpacked<FMT>::kS; ++s) {
          const float* xb = p.x + t * p.K + b * kValues<FMT> + s * kSub<FMT>;
          const float sum = p.sx[t * p.ns + b * Unpacked<FMT>::kS + s];
          for (int64_t n = 0; n < kW; ++n) {
            float acc = 0.f;
            for (int64_t j = 0; j < kSub<FMT>; ++j) acc += static_cast<float>(u.v[s * kSub<FMT> + j][n]) * xb[j];
            out[t * kW + n] += u.sc[s][n] * acc + u.mn[s][n] * sum;
          }
        }
    }
    for (int64_t t = 0; t < p.M; ++t) std::memcpy(dst + t * p.N + c * kW, &out[t * kW], w * sizeof(float));
    return;
  }
  for (int64_t t = 0; t < p.M; ++t) {
    float out[kW] = {};
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* qb = p.qt<FMT>(c, b);
      const float* xb = p.x + t * p.K + b * kValues<FMT>;
      float acc[kW] = {};
      for (int64_t j = 0; j < kRows<FMT>; ++j)
        for (int64_t n = 0; n < kW; ++n) {
          const uint8_t v = qb[j * kW + n];
          if constexpr (FMT == kQ8_0) {
            acc[n] += static_cast<float>(static_cast<int8_t>(v)) * xb[j];
          } else {
            acc[n] += static_cast<float>(v & 15) * xb[j] + static_cast<float>(v >> 4) * xb[j + 16];
          }
        }
      const float s = p.sx[t * p.ns + b];
      for (int64_t n = 0; n < w; ++n)
        out[n] = combine(FMT, out[n], acc[n], half(p.d[p.at(c, b) + n]), FMT == kQ4_1 ? half(p.m[p.at(c, b) + n]) : 0.f, s);
    }
    std::memcpy(dst + t * p.N + c * kW, out, w * sizeof(float));
  }
}

#if defined(TL_SIMD)
// Block b of tile c into L1 ahead of its use: its q bytes, scales and mins (prefetches of
// addresses past the weight's end are dropped, never faults).
template <int32_t FMT>
inline void prefetch(const Problem& p, int64_t c, int64_t b) {
  const char* q = reinterpret_cast<const char*>(p.qt<FMT>(c, b));
  for (int64_t l = 0; l < kRows<FMT> * kW; l += 64) _mm_prefetch(q + l, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p.d + p.at(c, b)), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p.d + p.at(c, b) + 32), _MM_HINT_T0);
  if constexpr (FMT == kQ4_1) {
    _mm_prefetch(reinterpret_cast<const char*>(p.m + p.at(c, b)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p.m + p.at(c, b) + 32), _MM_HINT_T0);
  }
}

// MT rows of x through tile c's blocks [b0, b1): each L bytes of q are widened and converted
// once and used by every row; each row's block sums live in kG registers and are scaled into
// `out` (registers too, where there are enough) once per block.
// The same for an unpacked format: each block unpacked once (into L1) for the MT rows, then
// per sub-block the q8_0-like sums, scaled by the sub-block's sc and offset by mn * sum(x).
template <int32_t FMT, int MT>
void stream_rows_unpacked(const Problem& p, int64_t t0, int64_t c, int64_t w, int64_t b0, int64_t b1, float* dst) {
  constexpr int64_t kS = Unpacked<FMT>::kS;
  Unpacked<FMT>& u = unpacked_buffer<FMT>();
  V::F out[MT][kG];
  for (auto& o : out) for (auto& v : o) v = V::zero();
  for (int64_t b = b0; b < b1; ++b) {
    prefetch<FMT>(p, c, b + 1);
    unpack<FMT>(p, c, b, u);
    for (int64_t s = 0; s < kS; ++s) {
      const float* xb = p.x + t0 * p.K + b * kValues<FMT> + s * kSub<FMT>;
      V::F acc[MT][kG];
      for (auto& a : acc) for (auto& v : a) v = V::zero();
      for (int64_t j = 0; j < kSub<FMT>; ++j)
        for (int g = 0; g < kG; ++g) {
          const V::F v = V::signed_bytes(reinterpret_cast<const uint8_t*>(&u.v[s * kSub<FMT> + j][V::L * g]));
          for (int t = 0; t < MT; ++t) acc[t][g] = V::fma(v, V::set1(xb[t * p.K + j]), acc[t][g]);
        }
      for (int g = 0; g < kG; ++g) {
        const V::F sv = V::load(&u.sc[s][V::L * g]);
        for (int t = 0; t < MT; ++t) {
          out[t][g] = V::fma(sv, acc[t][g], out[t][g]);
          if constexpr (kHasMin<FMT>)
            out[t][g] = V::fma(V::load(&u.mn[s][V::L * g]), V::set1(p.sx[(t0 + t) * p.ns + b * kS + s]), out[t][g]);
        }
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int g = 0; g < kG; ++g) V::store_first(dst + (t0 + t) * p.N + c * kW + V::L * g, out[t][g], w - V::L * g);
}

#if defined(__AVX512F__)
// Q5_0 / Q5_1 with AVX-512, without unpacking: each value is a Q4 nibble plus 16 when its 5th bit
// is set, a masked add on the nibbles converted to floats (the 4 qh bytes of 16 columns gathered
// into one 32-bit word each, then tested per value), then the Q4 sums.
template <int32_t FMT, int MT>
void stream_rows_q5(const Problem& p, int64_t t0, int64_t c, int64_t w, int64_t b0, int64_t b1, float* dst) {
  V::F out[MT][kG];
  for (auto& o : out) for (auto& v : o) v = V::zero();
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* qb = p.qt<FMT>(c, b);
    const float* xb = p.x + t0 * p.K + b * 32;
    prefetch<FMT>(p, c, b + kAhead);
    V::I qh[kG];
    for (int g = 0; g < kG; ++g) {
      const uint8_t* h = qb + V::L * g;
      qh[g] = _mm512_or_si512(_mm512_or_si512(V::bytes(h), _mm512_slli_epi32(V::bytes(h + kW), 8)),
                              _mm512_or_si512(_mm512_slli_epi32(V::bytes(h + 2 * kW), 16),
                                              _mm512_slli_epi32(V::bytes(h + 3 * kW), 24)));
    }
    V::F acc[MT][kG];
    for (auto& a : acc) for (auto& v : a) v = V::zero();
    const V::F sixteen = V::set1(16.f);
    for (int64_t j = 0; j < 16; ++j) {
      const V::I bit0 = _mm512_set1_epi32(1 << j), bit1 = _mm512_set1_epi32(1 << (j + 16));
      for (int g = 0; g < kG; ++g) {
        const V::I u = V::bytes(qb + (4 + j) * kW + V::L * g);
        V::F lo = V::to_float(V::low(u)), hi = V::to_float(V::high(u));
        lo = _mm512_mask_add_ps(lo, _mm512_test_epi32_mask(qh[g], bit0), lo, sixteen);  // + 16 where the bit is set
        hi = _mm512_mask_add_ps(hi, _mm512_test_epi32_mask(qh[g], bit1), hi, sixteen);
        for (int t = 0; t < MT; ++t) {
          acc[t][g] = V::fma(lo, V::set1(xb[t * p.K + j]), acc[t][g]);
          acc[t][g] = V::fma(hi, V::set1(xb[t * p.K + j + 16]), acc[t][g]);
        }
      }
    }
    for (int g = 0; g < kG; ++g) {
      const V::F dv = V::halves(p.d + p.at(c, b) + V::L * g);
      const V::F mv = FMT == kQ5_1 ? V::halves(p.m + p.at(c, b) + V::L * g) : V::zero();
      for (int t = 0; t < MT; ++t) {
        const V::F s = V::set1(p.sx[(t0 + t) * p.ns + b]);
        if constexpr (FMT == kQ5_0) {
          out[t][g] = V::fma(dv, V::fnma(V::set1(16.f), s, acc[t][g]), out[t][g]);
        } else {
          out[t][g] = V::fma(mv, s, V::fma(dv, acc[t][g], out[t][g]));
        }
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int g = 0; g < kG; ++g) V::store_first(dst + (t0 + t) * p.N + c * kW + V::L * g, out[t][g], w - V::L * g);
}
#endif

template <int32_t FMT, int MT>
void stream_rows(const Problem& p, int64_t t0, int64_t c, int64_t w, int64_t b0, int64_t b1, float* dst) {
#if defined(__AVX512F__)
  if constexpr (FMT == kQ5_0 || FMT == kQ5_1) return stream_rows_q5<FMT, MT>(p, t0, c, w, b0, b1, dst);
#endif
  if constexpr (kUnpacked<FMT>) {
    return stream_rows_unpacked<FMT, MT>(p, t0, c, w, b0, b1, dst);
  } else {
  V::F out[MT][kG];
  for (auto& o : out) for (auto& v : o) v = V::zero();
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* qb = p.qt<FMT>(c, b);
    const float* xb = p.x + t0 * p.K + b * kValues<FMT>;
    // a tile is a short stream (18 KiB for a 576-row q4 matrix), too short for the hardware
    // prefetcher to ramp up: ask for the block kAhead blocks on (past the tile's end: the next
    // tile's start, where this thread or the other one goes next)
    prefetch<FMT>(p, c, b + kAhead);
    V::F acc[MT][kG];
    for (auto& a : acc) for (auto& v : a) v = V::zero();
    for (int64_t j = 0; j < kRows<FMT>; ++j) {
      for (int g = 0; g < kG; ++g) {
        const uint8_t* raw = qb + j * kW + V::L * g;
        if constexpr (FMT == kQ8_0) {
          const V::F v = V::signed_bytes(raw);
          for (int t = 0; t < MT; ++t) acc[t][g] = V::fma(v, V::set1(xb[t * p.K + j]), acc[t][g]);
        } else {
          const V::I u = V::bytes(raw);
          const V::F lo = V::to_float(V::low(u)), hi = V::to_float(V::high(u));
          for (int t = 0; t < MT; ++t) {
            acc[t][g] = V::fma(lo, V::set1(xb[t * p.K + j]), acc[t][g]);
            acc[t][g] = V::fma(hi, V::set1(xb[t * p.K + j + 16]), acc[t][g]);
          }
        }
      }
    }
    for (int g = 0; g < kG; ++g) {
      const V::F dv = V::halves(p.d + p.at(c, b) + V::L * g);
      const V::F mv = FMT == kQ4_1 ? V::halves(p.m + p.at(c, b) + V::L * g) : V::zero();
      for (int t = 0; t < MT; ++t) {
        const V::F s = V::set1(p.sx[(t0 + t) * p.ns + b]);
        if constexpr (FMT == kQ4_0) {
          out[t][g] = V::fma(dv, V::fnma(V::set1(8.f), s, acc[t][g]), out[t][g]);
        } else if constexpr (FMT == kQ4_1) {
          out[t][g] = V::fma(mv, s, V::fma(dv, acc[t][g], out[t][g]));
        } else {
          out[t][g] = V::fma(dv, acc[t][g], out[t][g]);
        }
      }
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int g = 0; g < kG; ++g) V::store_first(dst + (t0 + t) * p.N + c * kW + V::L * g, out[t][g], w - V::L * g);
  }
}

// The last n < MT rows from t0, by the pass of their count.
template <int32_t FMT, int MT>
void stream_tail(const Problem& p, int64_t t0, int64_t n, int64_t c, int64_t w, int64_t b0, int64_t b1, float* dst) {
  if constexpr (MT > 0) {
    if (n == MT) return stream_rows<FMT, MT>(p, t0, c, w, b0, b1, dst);
    stream_tail<FMT, MT - 1>(p, t0, n, c, w, b0, b1, dst);
  }
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TL_VNNI 1
// 8-bit activations against Q8_0 / Q4_0 / Q4_1 as integer dot products (AVX-512 VNNI: 64
// multiply-adds an instruction against a float FMA's 16; llama.cpp's way on this CPU). A block is
// turned once into 8 quads of 4 inputs x 64 columns, each column's 4 weights one 32-bit lane (byte
// transposes: vector g's lane 4L + i is column 16L + 4g + i, undone at the end), unsigned (Q8_0
// offset by 128, corrected by 128 x the row's block sum); then each row's 8 x 4 `vpdpbusd` against
// its 4-input groups broadcast, and the block's int32 sums scaled into float outputs.
template <int32_t FMT>
constexpr bool kVnni = FMT == kQ8_0 || FMT == kQ4_0 || FMT == kQ4_1;

// Four byte rows (byte n: column n) -> e[g]: lane dword 4L + i = the 4 rows' bytes of column 16L + 4g + i.
inline void quads(__m512i r0, __m512i r1, __m512i r2, __m512i r3, __m512i* e) {
  const __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
  const __m512i c = _mm512_unpacklo_epi8(r2, r3), d = _mm512_unpackhi_epi8(r2, r3);
  e[0] = _mm512_unpacklo_epi16(a, c), e[1] = _mm512_unpackhi_epi16(a, c);
  e[2] = _mm512_unpacklo_epi16(b, d), e[3] = _mm512_unpackhi_epi16(b, d);
}

// The 4 x 4 transpose of 128-bit lanes across v[0..3]: natural column order <-> the quads' order.
inline void lanes4x4(__m512* v) {
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 t1 = _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2));
  const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 t3 = _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2));
  v[0] = _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0));
  v[1] = _mm512_shuffle_f32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1));
  v[2] = _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0));
  v[3] = _mm512_shuffle_f32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1));
}

// Block b of tile c as quads: w[4 i + g] holds inputs 4i..4i+3 (unsigned bytes).
template <int32_t FMT>
inline void vnni_block(const Problem& p, int64_t c, int64_t b, __m512i* w) {
  const uint8_t* qb = p.qt<FMT>(c, b);
  auto row = [&](int64_t j) { return _mm512_loadu_si512(qb + j * kW); };
  if constexpr (FMT == kQ8_0) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t i = 0; i < 8; ++i)
      quads(_mm512_xor_si512(row(4 * i), flip), _mm512_xor_si512(row(4 * i + 1), flip),
            _mm512_xor_si512(row(4 * i + 2), flip), _mm512_xor_si512(row(4 * i + 3), flip), w + 4 * i);
  } else {  // byte row j: input j in the low nibble, j + 16 in the high one
    const __m512i lo = _mm512_set1_epi8(15);
    for (int64_t i = 0; i < 4; ++i) {
      __m512i r[4];
      for (int64_t k = 0; k < 4; ++k) r[k] = row(4 * i + k);
      quads(_mm512_and_si512(r[0], lo), _mm512_and_si512(r[1], lo), _mm512_and_si512(r[2], lo),
            _mm512_and_si512(r[3], lo), w + 4 * i);
      quads(_mm512_and_si512(_mm512_srli_epi16(r[0], 4), lo), _mm512_and_si512(_mm512_srli_epi16(r[1], 4), lo),
            _mm512_and_si512(_mm512_srli_epi16(r[2], 4), lo), _mm512_and_si512(_mm512_srli_epi16(r[3], 4), lo),
            w + 16 + 4 * i);
    }
  }
}

// MT rows from t0 of block b: out [MT, 64] (the quads' column order, row t0 first) += the block's products.
template <int32_t FMT, int MT>
inline void vnni_rows(const Problem& p, const __m512i* w, const __m512* dv, const __m512* mv, int64_t t0, int64_t b,
                      float* out) {
  __m512i acc[MT][4];
  for (auto& a : acc) for (auto& v : a) v = _mm512_setzero_si512();
  const int8_t* xq = p.xq + t0 * p.K + b * 32;
  for (int64_t i = 0; i < 8; ++i)
    for (int t = 0; t < MT; ++t) {
      int32_t four;
      std::memcpy(&four, xq + t * p.K + 4 * i, 4);
      const __m512i xv = _mm512_set1_epi32(four);
      for (int g = 0; g < 4; ++g) acc[t][g] = _mm512_dpbusd_epi32(acc[t][g], w[4 * i + g], xv);
    }
  for (int t = 0; t < MT; ++t) {
    const int64_t at = (t0 + t) * p.ns + b;
    const __m512i corr = _mm512_set1_epi32(FMT == kQ8_0 ? 128 * p.sq[at] : FMT == kQ4_0 ? 8 * p.sq[at] : 0);
    const __m512 dx = _mm512_set1_ps(p.dx[at]);
    float* o = out + t * kW;
    for (int g = 0; g < 4; ++g) {
      const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[t][g], corr));
      __m512 y = _mm512_fmadd_ps(s, _mm512_mul_ps(dv[g], dx), _mm512_load_ps(o + 16 * g));
      if constexpr (FMT == kQ4_1) y = _mm512_fmadd_ps(mv[g], _mm512_set1_ps(p.sx[at]), y);
      _mm512_store_ps(o + 16 * g, y);
    }
  }
}

template <int32_t FMT, int MT>
void vnni_tail(const Problem& p, const __m512i* w, const __m512* dv, const __m512* mv, int64_t t0, int64_t n,
               int64_t b, float* out) {
  if constexpr (MT > 0) {
    if (n == MT) return vnni_rows<FMT, MT>(p, w, dv, mv, t0, b, out);
    vnni_tail<FMT, MT - 1>(p, w, dv, mv, t0, n, b, out);
  }
}

// Rows [r0, r1) through tile c's blocks [b0, b1), each block's quads made once for all of them
// (a decode step's few rows, or a prompt chunk's share of rows: no float panel).
template <int32_t FMT>
void stream_vnni(const Problem& p, int64_t c, int64_t w, int64_t b0, int64_t b1, int64_t r0, int64_t r1, float* dst) {
  constexpr int kRowsAtOnce = 4;  // 4 x 4 sums + 4 weights + 1 input + the scales in registers (6 rows spilled: 2x slower)
  thread_local Floats buf;
  thread_local int64_t size = 0;
  float* out = scratch(buf, size, (r1 - r0) * kW);
  alignas(64) __m512i wq[32];
  std::fill(out, out + (r1 - r0) * kW, 0.f);
  for (int64_t b = b0; b < b1; ++b) {
    prefetch<FMT>(p, c, b + kAhead);
    vnni_block<FMT>(p, c, b, wq);
    __m512 dv[4], mv[4];
    for (int g = 0; g < 4; ++g) {
      dv[g] = V::halves(p.d + p.at(c, b) + 16 * g);
      mv[g] = FMT == kQ4_1 ? V::halves(p.m + p.at(c, b) + 16 * g) : V::zero();
    }
    lanes4x4(dv);
    if constexpr (FMT == kQ4_1) lanes4x4(mv);
    int64_t t0 = r0;
    for (; t0 + kRowsAtOnce <= r1; t0 += kRowsAtOnce)
      vnni_rows<FMT, kRowsAtOnce>(p, wq, dv, mv, t0, b, out + (t0 - r0) * kW);
    vnni_tail<FMT, kRowsAtOnce - 1>(p, wq, dv, mv, t0, r1 - t0, b, out + (t0 - r0) * kW);
  }
  for (int64_t t = r0; t < r1; ++t) {
    __m512 v[4];
    for (int g = 0; g < 4; ++g) v[g] = _mm512_load_ps(out + (t - r0) * kW + 16 * g);
    lanes4x4(v);
    for (int g = 0; g < 4; ++g) V::store_first(dst + t * p.N + c * kW + 16 * g, v[g], w - 16 * g);
  }
}
#endif

template <int32_t FMT>
void stream(const Problem& p, int64_t c, int64_t w, int64_t b0, int64_t b1, float* dst) {
#if defined(TL_VNNI)
  if constexpr (kVnni<FMT>) {
    if (p.xq) return stream_vnni<FMT>(p, c, w, b0, b1, 0, p.M, dst);
  }
#endif
  int64_t t0 = 0;
  for (; t0 + V::kMT <= p.M; t0 += V::kMT) stream_rows<FMT, V::kMT>(p, t0, c, w, b0, b1, dst);
  stream_tail<FMT, V::kMT - 1>(p, t0, p.M - t0, c, w, b0, b1, dst);
}

// MT rows of x times kNG vectors of columns of a [K, 64] panel from group g0: MT x kNG
// accumulators held in registers (MT a constant, so the compiler keeps them there).
constexpr int kNG = V::kNG;
template <int MT>
void panel_rows(const Problem& p, const float* panel, int64_t t0, int g0, int64_t c, int64_t w, float* dst) {
  V::F acc[MT][kNG];
  for (auto& a : acc) for (auto& v : a) v = V::zero();
  const float* x = p.x + t0 * p.K;
  for (int64_t k = 0; k < p.K; ++k) {
    const float* wk = panel + k * kW + V::L * g0;
    V::F wv[kNG];
    for (int g = 0; g < kNG; ++g) wv[g] = V::load(wk + V::L * g);
    for (int t = 0; t < MT; ++t) {
      const V::F xb = V::set1(x[t * p.K + k]);
      for (int g = 0; g < kNG; ++g) acc[t][g] = V::fma(wv[g], xb, acc[t][g]);
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int g = 0; g < kNG; ++g)
      V::store_first(dst + (t0 + t) * p.N + c * kW + V::L * (g0 + g), acc[t][g], w - V::L * (g0 + g));
}

template <int MT>
void panel_tail(const Problem& p, const float* panel, int64_t t0, int64_t n, int g0, int64_t c, int64_t w, float* dst) {
  if constexpr (MT > 0) {
    if (n == MT) return panel_rows<MT>(p, panel, t0, g0, c, w, dst);
    panel_tail<MT - 1>(p, panel, t0, n, g0, c, w, dst);
  }
}

// Tile c as float32 [K, 64]: value = q * d (+ m), the same two roundings as qarray's dequantize.
template <int32_t FMT>
void dequantize_panel(const Problem& p, int64_t c, float* panel) {
  if constexpr (kUnpacked<FMT>) {
    Unpacked<FMT>& u = unpacked_buffer<FMT>();
    for (int64_t b = 0; b < p.nb; ++b) {
      prefetch<FMT>(p, c, b + 1);
      unpack<FMT>(p, c, b, u);
      for (int64_t i = 0; i < kValues<FMT>; ++i) {
        float* row = panel + (b * kValues<FMT> + i) * kW;
        const int64_t s = i / kSub<FMT>;
        for (int g = 0; g < kG; ++g) {
          const V::F v = V::signed_bytes(reinterpret_cast<const uint8_t*>(&u.v[i][V::L * g]));
          V::store(row + V::L * g, V::add(V::mul(v, V::load(&u.sc[s][V::L * g])), V::load(&u.mn[s][V::L * g])));
        }
      }
    }
    return;
  }
  for (int64_t b = 0; b < p.nb; ++b) {
    const uint8_t* qb = p.qt<FMT>(c, b);
    prefetch<FMT>(p, c, b + kAhead);
    for (int g = 0; g < kG; ++g) {
      const V::F dv = V::halves(p.d + p.at(c, b) + V::L * g);
      const V::F mv = FMT == kQ4_1 ? V::halves(p.m + p.at(c, b) + V::L * g) : V::zero();
      for (int64_t j = 0; j < kRows<FMT>; ++j) {
        const uint8_t* raw = qb + j * kW + V::L * g;
        float* lo = panel + (b * kValues<FMT> + j) * kW + V::L * g;
        if constexpr (FMT == kQ8_0) {
          V::store(lo, V::mul(V::signed_bytes(raw), dv));
        } else {
          const V::I u = V::bytes(raw);
          V::I l = V::low(u), h = V::high(u);
          if constexpr (FMT == kQ4_0) l = V::minus8(l), h = V::minus8(h);
          V::store(lo, V::add(V::mul(V::to_float(l), dv), mv));
          V::store(lo + 16 * kW, V::add(V::mul(V::to_float(h), dv), mv));
        }
      }
    }
  }
}

// Many rows (a prompt's chunk): dequantize tile c into a float32 panel [K, 64] that stays in
// L2, then multiply rows [t0, t1) of x by it with kPR x kNG vector accumulators in registers
// (AVX-512: 6 rows x 64 columns; AVX2: 6 rows x 16 columns, four times): the unpacking is paid once
// per weight and thread, not once per row. `key` numbers the call: a thread that takes the
// same tile's next rows reuses its panel.
template <int32_t FMT>
void panel_gemm(const Problem& p, uint64_t key, int64_t c, int64_t w, int64_t t0, int64_t t1, float* dst) {
  thread_local Floats buf;
  thread_local int64_t size = 0;
  thread_local uint64_t held = 0;
  thread_local int64_t held_tile = -1;
  float* panel = scratch(buf, size, p.K * kW);
  if (held != key || held_tile != c || size < p.K * kW) {
    dequantize_panel<FMT>(p, c, panel);
    held = key, held_tile = c;
  }
  for (int g0 = 0; g0 < kG; g0 += kNG) {
    if (V::L * g0 >= w) break;  // a partial tile's empty half
    int64_t t = t0;
    for (; t + V::kPR <= t1; t += V::kPR) panel_rows<V::kPR>(p, panel, t, g0, c, w, dst);
    panel_tail<V::kPR - 1>(p, panel, t, t1 - t, g0, c, w, dst);
  }
}
#else
template <int32_t FMT>
void stream(const Problem& p, int64_t c, int64_t w, int64_t b0, int64_t b1, float* dst) {
  stream_generic<FMT>(p, c, w, b0, b1, dst);
}
#endif

// The work: C tiles x `parts`. With few rows, parts are block ranges: a matrix with few tiles (a
// decode step's projections: N of a few hundred) is also split along K, so every thread gets
// several units; each part's sums land in their own [M, N] slice of `partial` and are added at
// the end. With panels, parts are ranges of rows.
struct Shared {
  Problem p;
  int64_t tiles, parts;
  float* partial;  // [parts, M, N] when parts > 1
  bool panels;     // many rows: `panel_gemm` per tile
  bool int_rows;   // many rows of 8-bit activations (VNNI formats): `stream_vnni` per tile and rows part
  uint64_t call;   // this call's number (from 1), unique in the process
  std::atomic<int64_t> next{0}, done{0};
  int64_t units() const { return tiles * parts; }
  void run(int64_t i) {
#if defined(TL_SIMD)
    if (panels) {  // unit i: rows part r of tile c, a tile's parts one after another
      const int64_t c = i / parts, r = i % parts, w = std::min(kW, p.N - c * kW);
      const int64_t t0 = p.M * r / parts, t1 = p.M * (r + 1) / parts;
      return by_format(p.fmt, [&](auto f) { panel_gemm<decltype(f)::value>(p, call, c, w, t0, t1, p.y); });
    }
#endif
#if defined(TL_VNNI)
    if (int_rows) {  // as panels, the integer product in place of the float panel
      const int64_t c = i / parts, r = i % parts, w = std::min(kW, p.N - c * kW);
      const int64_t t0 = p.M * r / parts, t1 = p.M * (r + 1) / parts;
      return by_format(p.fmt, [&](auto f) {
        if constexpr (kVnni<decltype(f)::value>) stream_vnni<decltype(f)::value>(p, c, w, 0, p.nb, t0, t1, p.y);
      });
    }
#endif
    const int64_t c = i % tiles, r = i / tiles, w = std::min(kW, p.N - c * kW);
    const int64_t b0 = p.nb * r / parts, b1 = p.nb * (r + 1) / parts;
    float* dst = parts > 1 ? partial + r * p.M * p.N : p.y;
    by_format(p.fmt, [&](auto f) { stream<decltype(f)::value>(p, c, w, b0, b1, dst); });
  }
  // Units handed out by an atomic counter; helpers that start after every unit is taken
  // return at once without touching the buffers.
  void work() {
    for (int64_t i; (i = next.fetch_add(1)) < units();) {
      run(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// 8-bit activations: each row's inputs in blocks of 32 scaled by amax / 127 and rounded to the
// nearest integer (ties to even), as llama.cpp's q8_0 of x with a float32 scale; f holds them
// back as floats (q * d) for the products that stay in float, s each block's integer sum.
struct Act8 {
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d, f;
  std::unique_ptr<int32_t[]> s;
};

Act8 round_inputs(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  Act8 a{std::make_unique<int8_t[]>(std::max<int64_t>(M * K, 1)), std::make_unique<float[]>(std::max<int64_t>(M * nb, 1)),
         std::make_unique<float[]>(std::max<int64_t>(M * K, 1)), std::make_unique<int32_t[]>(std::max<int64_t>(M * nb, 1))};
  for (int64_t r = 0; r < M * nb; ++r) {
    const float* v = x + r * 32;
#if defined(__AVX512F__)
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
    const float amax0 = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d0 = amax0 / 127.f, id0 = d0 > 0.f ? 1.f / d0 : 0.f;
    constexpr int kNear = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 q0 = _mm512_roundscale_ps(_mm512_mul_ps(v0, _mm512_set1_ps(id0)), kNear);
    const __m512 q1 = _mm512_roundscale_ps(_mm512_mul_ps(v1, _mm512_set1_ps(id0)), kNear);
    const __m512i i0 = _mm512_cvtps_epi32(q0), i1 = _mm512_cvtps_epi32(q1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q.get() + r * 32), _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a.q.get() + r * 32 + 16), _mm512_cvtepi32_epi8(i1));
    _mm512_storeu_ps(a.f.get() + r * 32, _mm512_mul_ps(q0, _mm512_set1_ps(d0)));
    _mm512_storeu_ps(a.f.get() + r * 32 + 16, _mm512_mul_ps(q1, _mm512_set1_ps(d0)));
    a.d[r] = d0, a.s[r] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    continue;
#endif
    float amax = 0.f;
    for (int64_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < 32; ++j) {
      const float qv = std::nearbyint(v[j] * id);
      a.q[r * 32 + j] = static_cast<int8_t>(qv);
      a.f[r * 32 + j] = qv * d;
      sum += static_cast<int32_t>(qv);
    }
    a.d[r] = d, a.s[r] = sum;
  }
  return a;
}

// The rows of x [rows, K] that are not all zeros, and where their products go: x and y
// themselves when every row is, else a compact copy of those rows and a buffer that `scatter`
// writes into y [rows, N] (zeros in the others' rows).
struct Live {
  const float* x;
  float* y;
  int64_t m;
  float* y_all;
  int64_t rows, K, N;
  std::vector<int64_t> index;
  std::unique_ptr<float[]> xc, yc;

  Live(const float* x_all, int64_t rows_, int64_t K_, int64_t N_, float* y_all_)
      : x(x_all), y(y_all_), m(rows_), y_all(y_all_), rows(rows_), K(K_), N(N_) {
    for (int64_t t = 0; t < rows; ++t) {
      const float* r = x_all + t * K;
      if (std::any_of(r, r + K, [](float v) { return v != 0.f; })) index.push_back(t);
    }
    if (static_cast<int64_t>(index.size()) == rows) return;
    m = static_cast<int64_t>(index.size());
    xc.reset(new float[std::max<int64_t>(m * K, 1)]);
    yc.reset(new float[std::max<int64_t>(m * N, 1)]);
    for (int64_t i = 0; i < m; ++i) std::memcpy(xc.get() + i * K, x_all + index[i] * K, K * sizeof(float));
    x = xc.get(), y = yc.get();
    if (m == 0) scatter();
  }

  void scatter() {
    if (m == rows) return;
    std::fill(y_all, y_all + rows * N, 0.f);
    for (int64_t i = 0; i < m; ++i) std::memcpy(y_all + index[i] * N, y + i * N, N * sizeof(float));
  }
};

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> d,
                   ffi::Buffer<ffi::F16> m, ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int32_t fmt,
                   int32_t act) {
  if (fmt < kQ8_0 || fmt > kQ6_K) return ffi::Error::InvalidArgument("qmatmul: unknown format");
  if (act != 0 && act != 1) return ffi::Error::InvalidArgument("qmatmul: act is 0 (float) or 1 (8-bit)");
  const auto xd = x.dimensions(), qd0 = q.dimensions(), yd = y->dimensions();
  // q [N/64, K/S, R, 64], or a stack of L such weights [L, ...] of which `layer` picks one (a
  // layer loop's weights, read where they lie: no copy of the layer)
  const size_t lead = qd0.size() == 5 ? 1 : 0;
  if (xd.size() < 1 || qd0.size() != 4 + lead || yd.size() < 1 || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("qmatmul: x [..., K], q [(L,) N/64, K/S, R, 64], layer [1], y [..., N]");
  const int64_t L = lead ? qd0[0] : 1, at = layer.typed_data()[0];
  const int64_t K = xd.back(), N = yd.back(), C = qd0[lead], nb = qd0[lead + 1];
  const int64_t R = rows_of(fmt), sub = sub_of(fmt), ns = K / sub;
  if (K != nb * values_of(fmt) || qd0[lead + 2] != R || qd0[lead + 3] != kW || C != (N + kW - 1) / kW
      || static_cast<int64_t>(d.element_count()) != L * C * nb * kW
      || static_cast<int64_t>(m.element_count()) != L * C * nb * kW) {
    return ffi::Error::InvalidArgument("qmatmul: x, q, d and y do not describe one [K, N] weight");
  }
  if (at < 0 || at >= L) return ffi::Error::InvalidArgument("qmatmul: layer outside the stack");
  const int64_t rows = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (static_cast<int64_t>(y->element_count()) != rows * N)
    return ffi::Error::InvalidArgument("qmatmul: y is not [M, N]");
  // A row of x that is all zeros has a zero product: only the others are multiplied, so the rows
  // a program pads with (a step's filler rows, a chunk's padding: `paged.forward` zeroes them)
  // cost no products
  Live live(x.typed_data(), rows, K, N, y->typed_data());
  const int64_t M = live.m;
  if (M == 0) return ffi::Error::Success();
  const float* xs = live.x;
  float* const ys = live.y;
  Act8 a8;
  if (act) {
    if (K % 32) return ffi::Error::InvalidArgument("qmatmul: 8-bit activations need K a multiple of 32");
    a8 = round_inputs(xs, M, K);
    xs = a8.f.get();
  }
  auto sx = std::make_unique<float[]>(std::max<int64_t>(M * ns, 1));
  for (int64_t t = 0; t < M; ++t)
    for (int64_t b = 0; b < ns; ++b) {
      float s = 0.f;
      for (int64_t j = 0; j < sub; ++j) s += xs[t * K + b * sub + j];
      sx[t * ns + b] = s;
    }
  auto sh = std::make_shared<Shared>();
  const int64_t per = C * nb * kW;  // scales of one weight; its bytes: per * R
  sh->p = Problem{xs, static_cast<const uint8_t*>(q.untyped_data()) + at * per * R,
                  reinterpret_cast<const uint16_t*>(d.typed_data()) + at * per,
                  reinterpret_cast<const uint16_t*>(m.typed_data()) + at * per,
                  sx.get(), ys, M, K, N, nb, ns, fmt, a8.q.get(), a8.d.get(), a8.s.get()};
  // as many workers as XLA's pool has threads (one per core), this thread one of them
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  static std::atomic<uint64_t> calls{0};
  sh->call = calls.fetch_add(1) + 1;
  sh->tiles = C;
  sh->panels = sh->int_rows = false;
#if defined(TL_SIMD)
  sh->panels = M > kPanelRows;
#endif
#if defined(TL_VNNI)
  // 8-bit activations against a VNNI format: integer products for any number of rows (the
  // quads of a block cost ~1/2 of a float panel's product per row at 64 rows)
  sh->int_rows = sh->panels && act && (fmt == kQ8_0 || fmt == kQ4_0 || fmt == kQ4_1);
  sh->panels = sh->panels && !sh->int_rows;
#endif
  // at least ~8 units per thread for balance: parts of K (few rows; while each keeps a few
  // blocks) or of the rows (panels; while each keeps a few dozen)
  const int64_t want = (8 * threads + C - 1) / std::max<int64_t>(C, 1);
  const bool by_rows = sh->panels || sh->int_rows;
  sh->parts = std::clamp<int64_t>(want, 1, std::max<int64_t>(1, by_rows ? M / 24 : nb / 4));
  std::unique_ptr<float[]> partial;
  sh->partial = nullptr;
  if (sh->parts > 1 && !by_rows) {
    partial.reset(new float[sh->parts * M * N]);
    sh->partial = partial.get();
  }
  static auto* spinners = new Spinners<Shared>(threads - 1);  // one per other core, for the process
  // Panels (a prompt's chunk: milliseconds a call) go to XLA's pool, whose threads the prompt's
  // other ops use too: spinning helpers competed with them (512 tokens: 771-849 ms against
  // 605-664 through the pool). Streams (decode: tens of microseconds a call) go to the spinners.
  if (by_rows) {
    for (int64_t h = 0; h < std::min<int64_t>(threads - 1, sh->units() - 1); ++h) pool.Schedule([sh] { sh->work(); });
  } else if (threads > 1 && sh->units() > 1) {
    spinners->submit(sh);
  }
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < sh->units()) std::this_thread::yield();
  if (sh->parts > 1 && !by_rows) {
    std::memcpy(ys, partial.get(), M * N * sizeof(float));
    for (int64_t r = 1; r < sh->parts; ++r)
      for (int64_t i = 0; i < M * N; ++i) ys[i] += partial[r * M * N + i];
  }
  live.scatter();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TinyloopQMatmul, QMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int32_t>("act"));
