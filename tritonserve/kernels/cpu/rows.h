// The row loops of a decoder layer's elementwise ops (residual add + RMSNorm, rotate-half
// rope, the q / k / v split of a qkv row with its rope), shared by fused_ops.cpp (the ops) and
// decode_layers.cpp (the whole decode stack). Numerics: fused_ops.cpp's header.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"
#include "vec_math.h"

namespace tritonserve_rows {

using tritonserve_vec::load_f;
using tritonserve_vec::round_to;
using tritonserve_vec::store_f;

// Both row loops are plain arithmetic on fp32 (bf16 converted on raw bits, exp a polynomial),
// so `omp simd` vectorises them: through c10's conversions and std::exp they ran one element
// at a time, and a 64-prompt bf16 prefill spent 20 % of its time in silu_and_mul (4.5 ms a
// call for 1365 x 1536; docs/perf-log/2026-cpu-decode.md). Templates outside the dispatch
// macro: a pragma inside a macro argument does not compile.
#ifdef TS_AVX512_BF16
// bf16 rows 16 at a time on AVX-512: the loops above stayed scalar for bf16 (240 ns a
// 576-wide row, 15 us for a batch-64 decode's norm on one core). Same roundings: the sum
// rounded to bf16 (vcvtneps2bf16 rounds to nearest even as float_to_bf16 does; it reads an
// fp32 denormal as zero), the normalised row rounded before the weight multiplies it; the sum
// of squares in another order (fp32).
inline __m512 widen(__m256i h) {  // 16 bf16 -> fp32 (the bits shifted up)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::BFloat16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

inline void add_rms_norm_row(c10::BFloat16* xr, c10::BFloat16* rr, const c10::BFloat16* wp,
                             int64_t hidden, float eps) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  const int64_t body = hidden / 32 * 32;
  auto sum_at = [&](int64_t i) {
    const __m256i h = to_bf16(_mm512_add_ps(load16(xr + i), load16(rr + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rr + i), h);
    return widen(h);
  };
  for (int64_t i = 0; i < body; i += 32) {
    const __m512 a = sum_at(i), b = sum_at(i + 16);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
    acc1 = _mm512_fmadd_ps(b, b, acc1);
  }
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (int64_t i = body; i < hidden; ++i) {
    const float v = round_to<c10::BFloat16>(load_f(xr + i) + load_f(rr + i));
    store_f(rr + i, v);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    const __m512 normed = widen(to_bf16(_mm512_mul_ps(load16(rr + i), scale)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xr + i),
                        to_bf16(_mm512_mul_ps(load16(wp + i), normed)));
  }
  for (; i < hidden; ++i)
    store_f(xr + i, load_f(wp + i) * round_to<c10::BFloat16>(load_f(rr + i) * inv));
}
#endif

template <typename T>
void add_rms_norm_row(T* xr, T* rr, const T* wp, int64_t hidden, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < hidden; ++i) {
    const float s = round_to<T>(load_f(xr + i) + load_f(rr + i));
    store_f(rr + i, s);
    sum += s * s;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i)
    store_f(xr + i, load_f(wp + i) * round_to<T>(load_f(rr + i) * inv));
}

template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* o, int64_t inner) {
#pragma omp simd
  for (int64_t i = 0; i < inner; ++i) {
    const float g = load_f(gate + i);
    // silu rounded to the dtype first, as F.silu(gate) * up computes it
    store_f(o + i, tritonserve_vec::silu_as<T>(g) * load_f(up + i));
  }
}

template <typename T>
void rotate_row(const T* x, const T* c, const T* s, T* o, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load_f(x + i), x2 = load_f(x + half + i);
    store_f(o + i, x1 * load_f(c + i) - x2 * load_f(s + i));
    store_f(o + half + i, x2 * load_f(c + half + i) + x1 * load_f(s + half + i));
  }
}

// q, k rotated and v copied out of one qkv row; k and v only when the row has a slot
template <typename T>
void rope_store_row(const T* row, const T* c, const T* s, int64_t heads, int64_t kv_heads,
                    int64_t dim, T* q, T* k, T* v) {
  for (int64_t h = 0; h < heads; ++h) rotate_row(row + h * dim, c, s, q + h * dim, dim / 2);
  if (k == nullptr) return;
  for (int64_t h = 0; h < kv_heads; ++h)
    rotate_row(row + (heads + h) * dim, c, s, k + h * dim, dim / 2);
  std::memcpy(v, row + (heads + kv_heads) * dim, kv_heads * dim * sizeof(T));
}

}  // namespace tritonserve_rows
