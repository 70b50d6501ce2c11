// x [M, K] float32 @ a GGUF-packed weight [K, N] -> y [M, N] float32, reading the packed bytes
// once: an XLA FFI custom call for XLA:CPU, which has no dot over 4/8-bit weights (it would
// write the dequantized float32 matrix and read it again; see tinyloop_jax/model/qarray.py).
//
// The weight's layout is qarray's: q [K/32, R, N] (R = 32 int8 for q8_0, 16 bytes of two
// nibbles for q4_0/q4_1: value j in the low nibble, j + 16 in the high one), d and m [K/32, N]
// float16. N is minor, so a tile of W columns reads one contiguous W-byte run per (block, j)
// and the inner loops vectorize over columns. Per block b and row t:
//   y[t, n] += d[b, n] * sum_j q[b, j, n] x[t, 32 b + j]   (+ m[b, n] * sum_j x[t, 32 b + j])
// (q4_0 subtracts 8 * d * sum_j x). Tiles are shared out over XLA's intra-op thread pool; the
// calling thread takes tiles too, so the call finishes even when no pool thread is free.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kW = 64;   // columns per tile: one cache line of q per (block, j)
constexpr int64_t kMT = 4;   // rows of x per pass over a tile's bytes
constexpr int64_t kMaxW = 4096;  // columns per tile at most (multiple of 16)
constexpr int64_t kPanelRows = 8;  // more rows: dequantized panels and a register-blocked product

enum Fmt : int32_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

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
  const float* sx;  // [M, nb]: the sum of each block's 32 inputs
  float* y;
  int64_t M, K, N, nb;
  int32_t fmt;
};

template <int32_t FMT>
void tile_generic(const Problem& p, int64_t n0, int64_t w, int64_t b0, int64_t b1, float* dst) {
  constexpr int64_t R = FMT == kQ8_0 ? 32 : 16;
  for (int64_t t0 = 0; t0 < p.M; t0 += kMT) {
    const int64_t mt = std::min(kMT, p.M - t0);
    float out[kMT][kW] = {};
    for (int64_t b = b0; b < b1; ++b) {
      float acc[kMT][kW] = {};
      const uint8_t* qb = p.q + (b * R) * p.N + n0;
      for (int64_t j = 0; j < R; ++j) {
        const uint8_t* row = qb + j * p.N;
        float lo[kW], hi[kW];
        if constexpr (FMT == kQ8_0) {
          for (int64_t n = 0; n < kW; ++n) lo[n] = n < w ? static_cast<float>(static_cast<int8_t>(row[n])) : 0.f;
        } else {
          for (int64_t n = 0; n < kW; ++n) {
            const uint8_t v = n < w ? row[n] : 0;
            lo[n] = static_cast<float>(v & 15);
            hi[n] = static_cast<float>(v >> 4);
          }
        }
        for (int64_t t = 0; t < mt; ++t) {
          const float* xt = p.x + (t0 + t) * p.K + b * kBlock;
          const float xl = xt[j];
          if constexpr (FMT == kQ8_0) {
            for (int64_t n = 0; n < kW; ++n) acc[t][n] += lo[n] * xl;
          } else {
            const float xh = xt[j + 16];
            for (int64_t n = 0; n < kW; ++n) acc[t][n] += lo[n] * xl + hi[n] * xh;
          }
        }
      }
      float dv[kW], mv[kW];
      for (int64_t n = 0; n < kW; ++n) {
        dv[n] = n < w ? half(p.d[b * p.N + n0 + n]) : 0.f;
        mv[n] = FMT == kQ4_1 && n < w ? half(p.m[b * p.N + n0 + n]) : 0.f;
      }
      for (int64_t t = 0; t < mt; ++t) {
        const float s = p.sx[(t0 + t) * p.nb + b];
        for (int64_t n = 0; n < kW; ++n) {
          if constexpr (FMT == kQ4_0) {
            out[t][n] += dv[n] * (acc[t][n] - 8.f * s);
          } else if constexpr (FMT == kQ4_1) {
            out[t][n] += dv[n] * acc[t][n] + mv[n] * s;
          } else {
            out[t][n] += dv[n] * acc[t][n];
          }
        }
      }
    }
    for (int64_t t = 0; t < mt; ++t) std::memcpy(dst + (t0 + t) * p.N + n0, out[t], w * sizeof(float));
  }
}

#if defined(__AVX512F__)
// The same tile with AVX-512, 16 columns a vector: 16 bytes of q widen to 16 int32 lanes, the
// nibbles are masked / shifted there and converted to float. A tile reads a run of w bytes of
// every (block, j) row (w up to kMaxW: a few hundred contiguous bytes per page visited, not one
// cache line), and its accumulators stay in L1. Columns past the tile are masked off.
template <int32_t FMT>
void tile_avx512(const Problem& p, int64_t n0, int64_t w, int64_t b0, int64_t b1, float* dst) {
  constexpr int64_t R = FMT == kQ8_0 ? 32 : 16;
  const int64_t groups = (w + 15) / 16;
  const __mmask16 last = static_cast<__mmask16>(w % 16 ? (1u << (w % 16)) - 1 : 0xFFFF);
  const __m512i fifteen = _mm512_set1_epi32(15);
  thread_local Floats buf;
  thread_local int64_t size = 0;
  float* base = scratch(buf, size, 2 * kMT * kMaxW);
  float (*acc)[kMaxW] = reinterpret_cast<float (*)[kMaxW]>(base);
  float (*out)[kMaxW] = reinterpret_cast<float (*)[kMaxW]>(base + kMT * kMaxW);
  for (int64_t t0 = 0; t0 < p.M; t0 += kMT) {
    const int64_t mt = std::min(kMT, p.M - t0);
    for (int64_t t = 0; t < mt; ++t) std::memset(out[t], 0, groups * 64);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t t = 0; t < mt; ++t) std::memset(acc[t], 0, groups * 64);
      const uint8_t* qb = p.q + (b * R) * p.N + n0;
      // U rows of q per pass over the accumulators: fewer L1 loads and stores per weight, but
      // more streams at once; one row of nibbles at a time streams ~1.5x faster (Zen 4: 22.7 ->
      // 14.7 ms for a decode step's 120 matrices on one thread, U = 2 -> 1)
      constexpr int64_t U = FMT == kQ8_0 ? 2 : 1;
      for (int64_t j = 0; j < R; j += U) {
        __m512 xl[kMT][U], xh[kMT][U];
        for (int64_t t = 0; t < mt; ++t) {
          const float* xt = p.x + (t0 + t) * p.K + b * kBlock;
          for (int64_t u = 0; u < U; ++u) {
            xl[t][u] = _mm512_set1_ps(xt[j + u]);
            if constexpr (FMT != kQ8_0) xh[t][u] = _mm512_set1_ps(xt[j + u + 16]);
          }
        }
        for (int64_t g = 0; g < groups; ++g) {
          const __mmask16 mk = g == groups - 1 ? last : 0xFFFF;
          __m512 lo[U], hi[U];
          for (int64_t u = 0; u < U; ++u) {
            const __m128i raw = _mm_maskz_loadu_epi8(mk, qb + (j + u) * p.N + 16 * g);
            if constexpr (FMT == kQ8_0) {
              lo[u] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
            } else {
              const __m512i v = _mm512_cvtepu8_epi32(raw);
              lo[u] = _mm512_cvtepi32_ps(_mm512_and_si512(v, fifteen));
              hi[u] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
            }
          }
          for (int64_t t = 0; t < mt; ++t) {
            __m512 a = _mm512_load_ps(acc[t] + 16 * g);
            for (int64_t u = 0; u < U; ++u) {
              a = _mm512_fmadd_ps(lo[u], xl[t][u], a);
              if constexpr (FMT != kQ8_0) a = _mm512_fmadd_ps(hi[u], xh[t][u], a);
            }
            _mm512_store_ps(acc[t] + 16 * g, a);
          }
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        const __mmask16 mk = g == groups - 1 ? last : 0xFFFF;
        const int64_t at = b * p.N + n0 + 16 * g;
        const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, p.d + at));
        const __m512 mv = FMT == kQ4_1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, p.m + at))
                                       : _mm512_setzero_ps();
        for (int64_t t = 0; t < mt; ++t) {
          const __m512 s = _mm512_set1_ps(p.sx[(t0 + t) * p.nb + b]);
          const __m512 a = _mm512_load_ps(acc[t] + 16 * g);
          __m512 o = _mm512_load_ps(out[t] + 16 * g);
          if constexpr (FMT == kQ4_0) {
            o = _mm512_fmadd_ps(dv, _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, a), o);
          } else if constexpr (FMT == kQ4_1) {
            o = _mm512_fmadd_ps(mv, s, _mm512_fmadd_ps(dv, a, o));
          } else {
            o = _mm512_fmadd_ps(dv, a, o);
          }
          _mm512_store_ps(out[t] + 16 * g, o);
        }
      }
    }
    for (int64_t t = 0; t < mt; ++t)
      for (int64_t g = 0; g < groups; ++g)
        _mm512_mask_storeu_ps(dst + (t0 + t) * p.N + n0 + 16 * g, g == groups - 1 ? last : 0xFFFF,
                              _mm512_load_ps(out[t] + 16 * g));
  }
}

template <int32_t FMT>
void tile(const Problem& p, int64_t n0, int64_t w, int64_t b0, int64_t b1, float* dst) {
  tile_avx512<FMT>(p, n0, w, b0, b1, dst);
}
#else
template <int32_t FMT>
void tile(const Problem& p, int64_t n0, int64_t w, int64_t b0, int64_t b1, float* dst) {
  for (int64_t c = 0; c < w; c += kW) tile_generic<FMT>(p, n0 + c, std::min(kW, w - c), b0, b1, dst);
}
#endif

#if defined(__AVX512F__)
// MT rows of x times a [K, 64] panel: MT x 4 accumulators held in registers (MT a constant, so
// the compiler keeps them there).
template <int MT>
void panel_rows(const Problem& p, const float* panel, int64_t t0, int64_t n0, int64_t w, float* dst) {
  const int64_t groups = (w + 15) / 16;
  const __mmask16 last = static_cast<__mmask16>(w % 16 ? (1u << (w % 16)) - 1 : 0xFFFF);
  __m512 acc[MT][4];
  for (auto& a : acc) for (auto& v : a) v = _mm512_setzero_ps();
  const float* x = p.x + t0 * p.K;
  for (int64_t k = 0; k < p.K; ++k) {
    const float* wk = panel + k * kW;
    const __m512 w0 = _mm512_load_ps(wk), w1 = _mm512_load_ps(wk + 16), w2 = _mm512_load_ps(wk + 32),
                 w3 = _mm512_load_ps(wk + 48);
    for (int t = 0; t < MT; ++t) {
      const __m512 xb = _mm512_set1_ps(x[t * p.K + k]);
      acc[t][0] = _mm512_fmadd_ps(w0, xb, acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(w1, xb, acc[t][1]);
      acc[t][2] = _mm512_fmadd_ps(w2, xb, acc[t][2]);
      acc[t][3] = _mm512_fmadd_ps(w3, xb, acc[t][3]);
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int64_t g = 0; g < groups; ++g)
      _mm512_mask_storeu_ps(dst + (t0 + t) * p.N + n0 + 16 * g, g == groups - 1 ? last : 0xFFFF, acc[t][g]);
}

// Many rows (a prompt's chunk): dequantize the tile's columns once into a float32 panel
// [K, 64] that stays in L2, then multiply every row of x by it with 4 x 4 vector accumulators
// in registers (4 rows x 64 columns): the unpacking is paid once per weight, not once per row.
template <int32_t FMT>
void panel_gemm(const Problem& p, int64_t n0, int64_t w, float* dst) {
  constexpr int64_t R = FMT == kQ8_0 ? 32 : 16;
  thread_local Floats buf;
  thread_local int64_t size = 0;
  float* panel = scratch(buf, size, p.K * kW);
  __mmask16 mask[4];  // the tile's columns among each vector's 16 (zeros past them)
  for (int g = 0; g < 4; ++g) {
    const int64_t lanes = std::clamp<int64_t>(w - 16 * g, 0, 16);
    mask[g] = static_cast<__mmask16>(lanes == 16 ? 0xFFFF : (1u << lanes) - 1);
  }
  const __m512i fifteen = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
  for (int64_t b = 0; b < p.nb; ++b) {
    __m512 dv[4], mv[4];
    for (int g = 0; g < 4; ++g) {
      const int64_t at = b * p.N + n0 + 16 * g;
      dv[g] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask[g], p.d + at));
      mv[g] = FMT == kQ4_1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask[g], p.m + at)) : _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < R; ++j) {
      const uint8_t* row = p.q + (b * R + j) * p.N + n0;
      float* lo = panel + (b * kBlock + j) * kW;
      float* hi = panel + (b * kBlock + j + 16) * kW;
      for (int g = 0; g < 4; ++g) {
        const __m128i raw = _mm_maskz_loadu_epi8(mask[g], row + 16 * g);
        if constexpr (FMT == kQ8_0) {
          _mm512_store_ps(lo + 16 * g, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), dv[g]));
        } else {
          __m512i l = _mm512_and_si512(_mm512_cvtepu8_epi32(raw), fifteen);
          __m512i h = _mm512_srli_epi32(_mm512_cvtepu8_epi32(raw), 4);
          if constexpr (FMT == kQ4_0) l = _mm512_sub_epi32(l, eight), h = _mm512_sub_epi32(h, eight);
          // value = q * d (+ m): the same two roundings as qarray's dequantize
          _mm512_store_ps(lo + 16 * g, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(l), dv[g]), mv[g]));
          _mm512_store_ps(hi + 16 * g, _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(h), dv[g]), mv[g]));
        }
      }
    }
  }
  int64_t t0 = 0;
  for (; t0 + 4 <= p.M; t0 += 4) panel_rows<4>(p, panel, t0, n0, w, dst);
  switch (p.M - t0) {
    case 3: return panel_rows<3>(p, panel, t0, n0, w, dst);
    case 2: return panel_rows<2>(p, panel, t0, n0, w, dst);
    case 1: return panel_rows<1>(p, panel, t0, n0, w, dst);
  }
}
#endif

// The work: `cols` column tiles x `parts` block ranges. A narrow matrix (a decode step's
// projections: N of a few hundred) is split along K, so each thread streams a contiguous part
// of q; its partial sums land in their own [M, N] slice of `partial` and are added at the end.
// A wide one (the LM head) is split into column tiles written straight into y.
struct Shared {
  Problem p;
  int64_t cols, width, parts;
  float* partial;  // [parts, M, N] when parts > 1
  bool panels;  // many rows: `panel_gemm` over 64-column tiles
  std::atomic<int64_t> next{0}, done{0};
  int64_t units() const { return cols * parts; }
  void run(int64_t i) {
    const int64_t c = i % cols, r = i / cols, n0 = c * width, w = std::min(width, p.N - n0);
    const int64_t b0 = p.nb * r / parts, b1 = p.nb * (r + 1) / parts;
    float* dst = parts > 1 ? partial + r * p.M * p.N : p.y;
#if defined(__AVX512F__)
    if (panels) {
      switch (p.fmt) {
        case kQ8_0: return panel_gemm<kQ8_0>(p, n0, w, dst);
        case kQ4_0: return panel_gemm<kQ4_0>(p, n0, w, dst);
        default: return panel_gemm<kQ4_1>(p, n0, w, dst);
      }
    }
#endif
    switch (p.fmt) {
      case kQ8_0: return tile<kQ8_0>(p, n0, w, b0, b1, dst);
      case kQ4_0: return tile<kQ4_0>(p, n0, w, b0, b1, dst);
      default: return tile<kQ4_1>(p, n0, w, b0, b1, dst);
    }
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

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::Buffer<ffi::F16> d,
                   ffi::Buffer<ffi::F16> m, ffi::ResultBuffer<ffi::F32> y, int32_t fmt) {
  if (fmt < kQ8_0 || fmt > kQ4_1) return ffi::Error::InvalidArgument("qmatmul: unknown format");
  const auto xd = x.dimensions(), qd = q.dimensions();
  if (xd.size() < 1 || qd.size() < 3) return ffi::Error::InvalidArgument("qmatmul: x [..., K], q [..., K/32, R, N]");
  const int64_t K = xd.back(), N = qd.back(), nb = qd[qd.size() - 3];
  const int64_t R = fmt == kQ8_0 ? 32 : 16;
  if (K != nb * kBlock || qd[qd.size() - 2] != R || static_cast<int64_t>(q.element_count()) != nb * R * N
      || static_cast<int64_t>(d.element_count()) != nb * N) {
    return ffi::Error::InvalidArgument("qmatmul: x, q and d do not describe one [K, N] weight");
  }
  const int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (static_cast<int64_t>(y->element_count()) != M * N) return ffi::Error::InvalidArgument("qmatmul: y is not [M, N]");
  auto sx = std::make_unique<float[]>(std::max<int64_t>(M * nb, 1));
  for (int64_t t = 0; t < M; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += x.typed_data()[t * K + b * kBlock + j];
      sx[t * nb + b] = s;
    }
  auto sh = std::make_shared<Shared>();
  sh->p = Problem{x.typed_data(), static_cast<const uint8_t*>(q.untyped_data()),
                  reinterpret_cast<const uint16_t*>(d.typed_data()), reinterpret_cast<const uint16_t*>(m.typed_data()),
                  sx.get(), y->typed_data(), M, K, N, nb, fmt};
  // as many workers as XLA's pool has threads (one per core), this thread one of them
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  std::unique_ptr<float[]> partial;
  sh->panels = false;
#if defined(__AVX512F__)
  if (M > kPanelRows) {
    sh->panels = true, sh->width = kW, sh->cols = (N + kW - 1) / kW, sh->parts = 1, sh->partial = nullptr;
  } else
#endif
  if (N <= kMaxW && nb >= 2 * threads) {
    sh->cols = 1, sh->width = N, sh->parts = threads;
    partial.reset(new float[threads * M * N]);
    sh->partial = partial.get();
  } else {  // at least two tiles per thread for balance, at most kMaxW wide
    const int64_t want = std::max<int64_t>(2 * threads, (N + kMaxW - 1) / kMaxW);
    sh->width = std::min<int64_t>(kMaxW, std::max<int64_t>(16, ((N + want - 1) / want + 15) / 16 * 16));
    sh->cols = (N + sh->width - 1) / sh->width, sh->parts = 1, sh->partial = nullptr;
  }
  const int64_t helpers = std::min<int64_t>(threads - 1, sh->units() - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([sh] { sh->work(); });
  sh->work();
  while (sh->done.load(std::memory_order_acquire) < sh->units()) std::this_thread::yield();
  if (sh->parts > 1) {
    float* out = y->typed_data();
    std::memcpy(out, partial.get(), M * N * sizeof(float));
    for (int64_t r = 1; r < sh->parts; ++r)
      for (int64_t i = 0; i < M * N; ++i) out[i] += partial[r * M * N + i];
  }
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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt"));
