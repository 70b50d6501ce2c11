// Paged attention for XLA:CPU: each row's queries attend to its own live pages only (an XLA FFI
// custom call beside qmatmul.cc). The XLA reference (tinyloop_jax/model/paged.py) gathers a
// row's whole page table, live or not; here a row of L live positions reads L keys and values,
// whatever the table's length, so a step's time follows its rows' tokens.
//
//   q      [b, T, H, hd] float32, pre-scaled by hd^-0.5; query t of row r is at position
//          start[r] + t, real for t < n_new[r] (the others come back as zeros)
//   k, v   one cache layer's pages, or the loop stack with `layer` selecting (pass, block):
//          [layers.., KV, NP, P, w] in fp32 / fp16 / int8 / int4 (two per byte, low nibble the
//          even channel, value - 8), with ks, vs [layers.., KV, NP, P, 1] float32 per-token scales
//          for the int formats (unused otherwise)
//   table  [b, R] int32: position p of row r is in page table[r, p / P], offset p % P
//   out    [b, T, H, hd] float32
//
// Query head h reads key/value head h / (H / KV). A query at p_q of row r sees keys p with
// p <= p_q, p > p_q - windows[r] (windows[r] > 0) — causal within the step's own tokens, which
// the step wrote before this call. One online softmax per (query, head); (row, KV head) pairs are
// shared out over XLA's thread pool.

#include <algorithm>
#include <atomic>
#include <vector>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

enum Fmt : int32_t { kF32 = 0, kF16 = 1, kI8 = 2, kI4 = 3 };

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t f;
  if (exp == 0) {
    if (man == 0) {
      f = sign;
    } else {  // subnormal: normalize
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while ((m & 0x400) == 0);
      f = sign | ((127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    f = sign | 0x7f800000u | (man << 13);
  } else {
    f = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
#endif
}

// exp(x) for x <= 0 (softmax weights), branch-free so that `omp simd` loops vectorize it:
// x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial (relative error ~2e-7), 2^n in the
// exponent bits; below -87 it is 0.
#pragma omp declare simd
inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x <= -87.f ? 0.f : p * scale;
}

struct Layer {
  const uint8_t* data;  // this layer's [KV, NP, P, w] stored values
  const float* scale;   // this layer's [KV, NP, P] scales (int formats)
};

struct Job {
  const float* q;
  float* out;
  Layer k, v;
  const int32_t *table, *start, *n_new, *windows;
  int64_t b, T, H, hd, KV, NP, P, R, width;
  int32_t fmt;
  std::atomic<int64_t> next{0}, done{0};
};

// Positions [off, off + n) of page `page`, head g, as floats: dst [n, hd].
void load_block(const Job& j, const Layer& L, int64_t g, int64_t page, int64_t off, int64_t n,
                float* __restrict dst) {
  const int64_t idx = (g * j.NP + page) * j.P + off, hd = j.hd;
  switch (j.fmt) {
    case kF32:
      std::memcpy(dst, L.data + idx * j.width * 4, n * hd * 4);
      break;
    case kF16: {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(L.data) + idx * j.width;
      int64_t c = 0;
#if defined(__F16C__)
      for (; c + 8 <= n * hd; c += 8)
        _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + c))));
#endif
      for (; c < n * hd; ++c) dst[c] = half_to_float(s[c]);
      break;
    }
    case kI8: {
      const int8_t* s = reinterpret_cast<const int8_t*>(L.data) + idx * j.width;
      for (int64_t t = 0; t < n; ++t) {
        const float d = L.scale[idx + t];
        for (int64_t c = 0; c < hd; ++c) dst[t * hd + c] = d * static_cast<float>(s[t * hd + c]);
      }
      break;
    }
    default: {  // int4
      const uint8_t* s = L.data + idx * j.width;
      for (int64_t t = 0; t < n; ++t) {
        const float d = L.scale[idx + t];
        for (int64_t c = 0; c < j.width; ++c) {
          const uint8_t b = s[t * j.width + c];
          dst[t * hd + 2 * c] = d * static_cast<float>(static_cast<int>(b & 15) - 8);
          dst[t * hd + 2 * c + 1] = d * static_cast<float>(static_cast<int>(b >> 4) - 8);
        }
      }
    }
  }
}

// One query head's online-softmax step over nq keys: scores of qv [hd] against kq [nq, hd],
// its running max m and sum l, its output o [hd] rescaled and added the weighted values vq
// [nq, hd]; sc: scratch for nq + 16 scores.
void step_generic(int64_t hd, const float* __restrict qv, const float* kq, const float* vq, int64_t nq,
                  float* __restrict o, float& m, float& l, float* __restrict sc) {
  float mb = -INFINITY;
  for (int64_t p = 0; p < nq; ++p) {
    const float* __restrict kp = kq + p * hd;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < hd; ++c) s += qv[c] * kp[c];
    sc[p] = s;
    mb = std::max(mb, s);
  }
  const float mn = std::max(m, mb);
  const float f = std::exp(m - mn);  // 0 on the first keys (m = -inf)
  float li = l * f;
#pragma omp simd
  for (int64_t c = 0; c < hd; ++c) o[c] *= f;
#pragma omp simd reduction(+ : li)
  for (int64_t p = 0; p < nq; ++p) {
    sc[p] = exp_neg(sc[p] - mn);
    li += sc[p];
  }
  for (int64_t p = 0; p < nq; ++p) {
    const float w = sc[p];
    const float* __restrict vp = vq + p * hd;
#pragma omp simd
    for (int64_t c = 0; c < hd; ++c) o[c] += w * vp[c];
  }
  l = li;
  m = mn;
}

#if defined(__AVX512F__)
// Lane i of the result: the sum of v[i]'s 16 lanes (a transposing add tree: 15 adds and 30
// shuffles for 16 sums, where one reduction each would take 16 x 8 instructions).
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// `step_generic` for heads of 64 channels with AVX-512 (SmolLM2's, Llama's): the scores 16 keys
// at a time (four FMAs a key, one add tree for the 16 sums), the output in four registers
// while the values stream by.
void step64(int64_t, const float* qv, const float* kq, const float* vq, int64_t nq, float* o, float& m, float& l,
            float* sc) {
  constexpr int64_t hd = 64;
  const __m512 q0 = _mm512_loadu_ps(qv), q1 = _mm512_loadu_ps(qv + 16), q2 = _mm512_loadu_ps(qv + 32),
               q3 = _mm512_loadu_ps(qv + 48);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t p = 0; p < nq; p += 16) {
    const int64_t cnt = std::min<int64_t>(16, nq - p);
    __m512 dots[16];
    for (int64_t i = 0; i < 16; ++i) {
      if (i < cnt) {
        const float* kp = kq + (p + i) * hd;
        __m512 d = _mm512_mul_ps(q0, _mm512_loadu_ps(kp));
        d = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kp + 16), d);
        d = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kp + 32), d);
        dots[i] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kp + 48), d);
      } else {
        dots[i] = _mm512_setzero_ps();
      }
    }
    const __mmask16 live = static_cast<__mmask16>(cnt == 16 ? 0xffff : (1u << cnt) - 1);
    const __m512 sv = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), hsum16(dots));
    _mm512_storeu_ps(sc + p, sv);
    mx = _mm512_max_ps(mx, sv);
  }
  const float mn = std::max(m, _mm512_reduce_max_ps(mx));
  const float f = std::exp(m - mn);  // 0 on the first keys (m = -inf)
  float li = l * f;
#pragma omp simd reduction(+ : li)
  for (int64_t p = 0; p < nq; ++p) {
    sc[p] = exp_neg(sc[p] - mn);
    li += sc[p];
  }
  const __m512 fv = _mm512_set1_ps(f);
  __m512 o0 = _mm512_mul_ps(_mm512_loadu_ps(o), fv), o1 = _mm512_mul_ps(_mm512_loadu_ps(o + 16), fv),
         o2 = _mm512_mul_ps(_mm512_loadu_ps(o + 32), fv), o3 = _mm512_mul_ps(_mm512_loadu_ps(o + 48), fv);
  for (int64_t p = 0; p < nq; ++p) {
    const __m512 w = _mm512_set1_ps(sc[p]);
    const float* vp = vq + p * hd;
    o0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vp), o0);
    o1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vp + 16), o1);
    o2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vp + 32), o2);
    o3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vp + 48), o3);
  }
  _mm512_storeu_ps(o, o0), _mm512_storeu_ps(o + 16, o1), _mm512_storeu_ps(o + 32, o2), _mm512_storeu_ps(o + 48, o3);
  l = li;
  m = mn;
}
#endif

// Keys an online-softmax step reads: up to this many of a row's consecutive pages (a page of 16
// keys a step spent as much on the step's bookkeeping, its max, rescale and exponentials, as on
// the dot products)
constexpr int64_t kBlockKeys = 64;

// Row r, KV head g: every real query of the row, for the G query heads of g, a run of up to
// kBlockKeys / P consecutive pages at a time (their keys contiguous in kb, vb; one
// online-softmax STEP per run and query head, inlined).
template <auto STEP>
void unit(const Job& j, int64_t r, int64_t g, std::vector<float>& buf) {
  const int64_t G = j.H / j.KV, hd = j.hd, T = j.T, P = j.P;
  const int64_t B = std::max<int64_t>(1, kBlockKeys / P);  // pages a run
  const int64_t n = std::clamp<int64_t>(j.n_new[r], 0, T), s0 = j.start[r];
  const int64_t len = s0 + n;  // live positions after the step
  const int64_t window = j.windows[r];
  buf.resize(2 * B * P * hd + T * G * (hd + 2) + B * P + 16);
  float* kb = buf.data();
  float* vb = kb + B * P * hd;
  float* acc = vb + B * P * hd;
  float* m = acc + T * G * hd;
  float* l = m + T * G;
  float* sc = l + T * G;
  std::fill(acc, acc + T * G * hd, 0.f);
  std::fill(m, m + T * G, -INFINITY);
  std::fill(l, l + T * G, 0.f);
  const int64_t lo = window > 0 ? std::max<int64_t>(0, s0 - window + 1) : 0;
  for (int64_t e = lo / P; e * P < len && e < j.R;) {
    const int64_t p0 = std::max(e * P, lo);
    int64_t p1 = p0, e1 = e;  // keys [p0, p1) of pages [e, e1), all valid
    for (; e1 < e + B && e1 * P < len && e1 < j.R; ++e1) {
      const int64_t page = j.table[r * j.R + e1];
      if (page < 0 || page >= j.NP) break;
      const int64_t a = std::max(e1 * P, lo), b = std::min(e1 * P + P, len);
      load_block(j, j.k, g, page, a - e1 * P, b - a, kb + (a - p0) * hd);
      load_block(j, j.v, g, page, a - e1 * P, b - a, vb + (a - p0) * hd);
      p1 = b;
    }
    if (e1 == e) {  // an invalid entry: its keys are not read
      ++e;
      continue;
    }
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pq = s0 + t;
      const int64_t a0 = window > 0 ? std::max(p0, pq - window + 1) : p0, a1 = std::min(p1, pq + 1);
      if (a0 >= a1) continue;
      for (int64_t a = 0; a < G; ++a) {
        const int64_t i = t * G + a;
        STEP(hd, j.q + ((r * T + t) * j.H + g * G + a) * hd, kb + (a0 - p0) * hd, vb + (a0 - p0) * hd, a1 - a0,
             acc + i * hd, m[i], l[i], sc);
      }
    }
    e = e1;
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t a = 0; a < G; ++a) {
      float* dst = j.out + ((r * T + t) * j.H + g * G + a) * hd;
      const int64_t i = t * G + a;
      const float inv = (t < n && l[i] > 0.f) ? 1.f / l[i] : 0.f;
      for (int64_t c = 0; c < hd; ++c) dst[c] = acc[i * hd + c] * inv;
    }
}

void work(Job* j) {
  const int64_t units = j->b * j->KV;
  thread_local std::vector<float> buf;
  for (int64_t u; (u = j->next.fetch_add(1)) < units;) {
#if defined(__AVX512F__)
    if (j->hd == 64)
      unit<step64>(*j, u / j->KV, u % j->KV, buf);
    else
#endif
      unit<step_generic>(*j, u / j->KV, u % j->KV, buf);
    j->done.fetch_add(1, std::memory_order_release);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::F32> ks, ffi::Buffer<ffi::F32> vs, ffi::Buffer<ffi::S32> table,
                          ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> n_new, ffi::Buffer<ffi::S32> windows,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int32_t fmt,
                          int32_t kv_heads) {
  if (fmt < kF32 || fmt > kI4) return ffi::Error::InvalidArgument("paged_attention: unknown format");
  const auto qd = q.dimensions(), kd = k.dimensions(), td = table.dimensions();
  if (qd.size() != 4 || kd.size() < 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged_attention: q [b, T, H, hd], k [.., KV, NP, P, w], table [b, R]");
  auto job = std::make_shared<Job>();  // helpers the pool starts late still find it
  Job& j = *job;
  j.b = qd[0], j.T = qd[1], j.H = qd[2], j.hd = qd[3];
  j.KV = kv_heads, j.NP = kd[kd.size() - 3], j.P = kd[kd.size() - 2], j.width = kd.back(), j.R = td[1];
  j.fmt = fmt;
  if (j.KV < 1 || kd[kd.size() - 4] != j.KV || j.H % j.KV || td[0] != j.b
      || j.width != (fmt == kI4 ? j.hd / 2 : j.hd))
    return ffi::Error::InvalidArgument("paged_attention: shapes do not agree");
  const int64_t per_layer = j.KV * j.NP * j.P;  // positions (and scales) of one layer
  int64_t layers = 1;
  for (size_t i = 0; i + 4 < kd.size(); ++i) layers *= kd[i];
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= layers) return ffi::Error::InvalidArgument("paged_attention: layer out of range");
  const int64_t item = fmt == kF32 ? 4 : fmt == kF16 ? 2 : 1;
  const bool scaled = fmt == kI8 || fmt == kI4;
  j.k = Layer{static_cast<const uint8_t*>(k.untyped_data()) + li * per_layer * j.width * item,
              scaled ? ks.typed_data() + li * per_layer : nullptr};
  j.v = Layer{static_cast<const uint8_t*>(v.untyped_data()) + li * per_layer * j.width * item,
              scaled ? vs.typed_data() + li * per_layer : nullptr};
  j.q = q.typed_data(), j.out = out->typed_data();
  j.table = table.typed_data(), j.start = start.typed_data(), j.n_new = n_new.typed_data();
  j.windows = windows.typed_data();
  const int64_t units = j.b * j.KV;
  // helpers only where the work outweighs handing it out (a decode row's few hundred keys do not)
  int64_t keys = 0;
  for (int64_t r = 0; r < j.b; ++r) keys += (j.start[r] + j.n_new[r]) * std::max<int64_t>(j.n_new[r], 1);
  const int64_t work_items = keys * j.H * j.hd;
  const int64_t helpers = work_items < (int64_t{1} << 18)
                              ? 0
                              : std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1) - 1, units - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([job] { work(job.get()); });
  work(job.get());
  while (j.done.load(std::memory_order_acquire) < units) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TinyloopPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int32_t>("kv_heads"));
