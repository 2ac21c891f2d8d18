// Scalar helpers written so that an `omp simd` loop vectorises them (std::exp and c10's
// bf16 conversions compile to a call or a branch per element; these are plain arithmetic).
// Shared by the CPU ops in this folder.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa.h"

namespace tritonserve_vec {

// exp(x) for x in any range, clamped to [-87, 88] (below: ~1e-38, above: ~1.6e38; the
// callers' results do not change there). 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p
// Taylor to degree 7: the truncation (< 1.1e-8 relative) is below fp32's rounding. Degree 6
// (1.2e-7) moved a sampled token's CDF by ~6e-8: 1 draw in 2,000 differed from torch's.
__attribute__((always_inline)) inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln2 split in two parts
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// bf16 <-> fp32 on the raw bits: the 16 bits shifted up; back, rounded to nearest even
// (what c10::BFloat16's constructor does; NaN stays NaN, overflow goes to inf)
inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7fc0) : rounded;  // a select, still vectorised
}

// load / store of one element as fp32 for T in {float, bf16, half}: bf16 on raw bits (the
// loops vectorise), half through c10 (scalar)
template <typename T>
inline float load_f(const T* p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[0]);
  } else {
    return static_cast<float>(*p);
  }
}

template <typename T>
inline void store_f(T* p, float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    reinterpret_cast<uint16_t*>(p)[0] = float_to_bf16(f);
  } else {
    *p = static_cast<T>(f);
  }
}

// f rounded to T and back: the dtype rounding transformers applies between two steps
template <typename T>
inline float round_to(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_to_float(float_to_bf16(f));
  } else {
    return static_cast<float>(static_cast<T>(f));
  }
}

// silu(g) rounded to T, as F.silu's output in T (the activation the MLP multiplies by up)
template <typename T>
inline float silu_as(float g) {
  return round_to<T>(g / (1.f + exp_clamped(-g)));
}

typedef float v16 __attribute__((vector_size(64)));  // GCC vectors: one zmm, or two ymm

// A two-source lane shuffle of v16s: clang and GCC 12+ have __builtin_shufflevector; GCC 11
// (Ubuntu 22.04, RHEL 9) has only __builtin_shuffle, with the lanes as an index vector.
#if defined(__clang__) || !defined(__GNUC__) || __GNUC__ >= 12
#define TS_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t v16i __attribute__((vector_size(64)));
#define TS_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, v16i{__VA_ARGS__})
#endif

// a[j] for j < 16 -> out with out[j] = the sum of a[j]'s 16 lanes: a tree of two-source
// shuffles, 30 shuffles and 15 adds for 16 sums, where one horizontal sum each took 8 ops.
inline v16 sum_lanes16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i]'s halves summed, 8-15: a[2i + 1]'s
    b[i] = TS_SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                      22, 23) +
           TS_SHUFFLE(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                      29, 30, 31);
  for (int i = 0; i < 4; ++i)  // four lanes a token, tokens 4i .. 4i + 3
    c[i] = TS_SHUFFLE(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                      26, 27) +
           TS_SHUFFLE(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                      30, 31);
  for (int i = 0; i < 2; ++i)  // two lanes a token
    d[i] = TS_SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                      28, 29) +
           TS_SHUFFLE(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                      30, 31);
  return TS_SHUFFLE(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         TS_SHUFFLE(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#ifdef TS_AVX512
// exp_clamped on 16 lanes in registers, the Taylor polynomial to degree Degree (7: exp_clamped's
// own, bit for bit up to FMA contraction; 5: < 2.5e-6 relative, for attention weights), 2^n by
// vscalefps. Upper = false leaves out the clamp at 88 for callers whose x is bounded (one op
// less on a latency-bound chain).
template <int Degree = 7, bool Upper = true>
inline __m512 exp16(__m512 x) {
  static_assert(Degree == 5 || Degree == 7, "exp16: degree 5 or 7");
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  if constexpr (Upper) x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x));
  __m512 p;
  if constexpr (Degree == 7) {
    p = _mm512_set1_ps(1.0f / 5040);
    for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  } else {
    p = _mm512_set1_ps(1.0f / 120);
    for (const float c : {1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
      p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace tritonserve_vec
