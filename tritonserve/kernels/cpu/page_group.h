// One page of one KV head against its whole group of query heads (GQA), for the portable
// decode attention (paged_decode_portable.h's decode_seq, so paged_decode.cpp and the fp32 /
// int8 `layers` op): each K and V row is read once for the group instead of once a query
// head, and an int8 row's codes are converted in registers with its scale applied to the
// score (K) or the weight (V), never to the values.
//
// Why: at 8k tokens the portable kernel scored each query head over the page on its own and
// ran at ~37 GFLOP/s warm on 2 AVX2 cores (SmolLM2, 9 / 3 heads of 64: 0.42 ms a layer,
// bench cpu-decode); the figures after this file are in docs/benchmarks.md (long context).
// Eight-lane GCC vectors: one ymm on AVX2 and AVX-512 alike, so each block of query heads and
// tokens keeps its sums in the 16 registers AVX2 has.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa.h"

namespace tritonserve_page_group {

typedef float v8 __attribute__((vector_size(32)));
// unaligned, aliasing loads and stores of 8 floats / 8 codes as one instruction each (a
// memcpy into a v8 became a copy through the stack in 16-byte halves, whose 32-byte reload
// missed store forwarding: the grouped scores ran 2x slower than the per-head loop)
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int8_t v8c __attribute__((vector_size(8), aligned(1), may_alias));
typedef int32_t v8w __attribute__((vector_size(32)));

inline v8 ld(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void st(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }

#if defined(__clang__) || !defined(__GNUC__) || __GNUC__ >= 12
#define TS_SHUFFLE8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t v8i __attribute__((vector_size(32)));
#define TS_SHUFFLE8(a, b, ...) __builtin_shuffle(a, b, v8i{__VA_ARGS__})
#endif

// a[j] for j < 8 -> out[j] = the sum of a[j]'s 8 lanes (hadd-shaped: shuffles within
// 128-bit halves, one swap of halves at the end)
inline v8 sum_lanes8(const v8* a) {
  v8 t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = TS_SHUFFLE8(a[2 * i], a[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
           TS_SHUFFLE8(a[2 * i], a[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
  for (int i = 0; i < 2; ++i)
    u[i] = TS_SHUFFLE8(t[2 * i], t[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
           TS_SHUFFLE8(t[2 * i], t[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
  return TS_SHUFFLE8(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         TS_SHUFFLE8(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Eight values of a cache row from element `at` as fp32 (int8: the codes, unscaled)
template <typename cache_t>
inline v8 load8(const cache_t* row, int64_t at) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
#ifdef TS_AVX2
    // vpmovsxbd + vcvtdq2ps: GCC 12 turned __builtin_convertvector of 8 codes into 8 scalar
    // sign extensions and conversions, the int8 scores 5x slower than fp32 (~460 ns a page
    // of 16 tokens x 3 heads against ~120)
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + at));
    return reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
#else
    const v8w wide = __builtin_convertvector(*reinterpret_cast<const v8c*>(row + at), v8w);
    return __builtin_convertvector(wide, v8);
#endif
  } else {
    return ld(row + at);
  }
}

// An int8 row's scale (the fp32 after its HD codes); 1 for a float row
template <int HD, typename cache_t>
inline float row_scale(const cache_t* row) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    float s;
    std::memcpy(&s, row + HD, sizeof s);
    return s;
  } else {
    return 1.0f;
  }
}

// GB query heads x TT tokens from token t0: the 8-lane partial products into part[g * 32 + t]
template <int HD, typename cache_t, int GB, int TT>
inline void score_block(const float* q, const cache_t* k, int64_t krow, int64_t t0, v8* part) {
  v8 acc[GB][TT] = {};
  for (int c = 0; c < HD / 8; ++c) {
    v8 qc[GB];
    for (int g = 0; g < GB; ++g) qc[g] = ld(q + g * HD + 8 * c);
    for (int j = 0; j < TT; ++j) {
      const v8 kc = load8(k + (t0 + j) * krow, 8 * c);
      for (int g = 0; g < GB; ++g) acc[g][j] += qc[g] * kc;
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < TT; ++j) part[g * 32 + t0 + j] = acc[g][j];
}

// scores[g * stride + t] = q_g . k_t for GB heads (q_g at q + g * HD, scaled already) and
// tokens t < n <= 32 (k_t at k + t * krow; an int8 row's scale applied to its score)
template <int HD, typename cache_t, int GB>
inline void group_scores_gb(const float* q, const cache_t* k, int64_t krow, int64_t n,
                            float* scores, int64_t stride) {
  // tokens a block: GB * TT sums in registers, the q chunks read from L1 (4 x 3 heads: 102
  // ns a page of 16 tokens against 115 for 3 x 3, SmolLM2's heads, fp32; 4 x 4 spills)
  constexpr int TT = GB >= 4 ? 3 : 4;
  alignas(32) v8 part[GB * 32];
  int64_t t = 0;
  for (; t + TT <= n; t += TT) score_block<HD, cache_t, GB, TT>(q, k, krow, t, part);
  for (; t < n; ++t) score_block<HD, cache_t, GB, 1>(q, k, krow, t, part);
  for (int64_t u = n; u < ((n + 7) & ~int64_t(7)); ++u)
    for (int g = 0; g < GB; ++g) part[g * 32 + u] = v8{};
  float scale[32];
  for (int64_t u = 0; u < n; ++u) scale[u] = row_scale<HD>(k + u * krow);
  for (int g = 0; g < GB; ++g)
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      alignas(32) float s[8];
      st(s, sum_lanes8(part + g * 32 + t0));
      for (int64_t u = t0; u < std::min<int64_t>(n, t0 + 8); ++u)
        scores[g * stride + u] = s[u - t0] * scale[u];
    }
}

// acc[g * HD + d] += sum_t p[g * stride + t] * v_t[d] for GB heads, tokens t < n <= 32
// (an int8 row's scale folded into its weights first)
template <int HD, typename cache_t, int GB>
inline void group_values_gb(const float* p, const cache_t* v, int64_t vrow, int64_t n,
                            int64_t stride, float* acc) {
  constexpr int DC = GB >= 3 ? 2 : 4;  // 8-lane chunks of a row at once: GB * DC sums
  static_assert(HD % (8 * DC) == 0, "whole chunks");
  float w[GB][32];
  for (int64_t t = 0; t < n; ++t) {
    const float s = row_scale<HD>(v + t * vrow);
    for (int g = 0; g < GB; ++g) w[g][t] = p[g * stride + t] * s;
  }
  for (int d0 = 0; d0 < HD; d0 += 8 * DC) {
    v8 a[GB][DC];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DC; ++c) a[g][c] = ld(acc + g * HD + d0 + 8 * c);
    for (int64_t t = 0; t < n; ++t) {
      const cache_t* vt = v + t * vrow;
      v8 vc[DC];
      for (int c = 0; c < DC; ++c) vc[c] = load8(vt, d0 + 8 * c);
      for (int g = 0; g < GB; ++g) {
        const float wg = w[g][t];
        for (int c = 0; c < DC; ++c) a[g][c] += wg * vc[c];
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DC; ++c) st(acc + g * HD + d0 + 8 * c, a[g][c]);
  }
}

// The group's G query heads in blocks of at most 4 (3 a block where that divides better):
// f(std::integral_constant<int, gb>, g) for each block [g, g + gb)
template <typename F>
inline void for_head_blocks(int G, F&& f) {
  for (int g = 0; g < G;) {
    const int gb = G - g == 4 || G - g >= 7 ? 4 : std::min(G - g, 3);
    switch (gb) {
      case 4: f(std::integral_constant<int, 4>{}, g); break;
      case 3: f(std::integral_constant<int, 3>{}, g); break;
      case 2: f(std::integral_constant<int, 2>{}, g); break;
      default: f(std::integral_constant<int, 1>{}, g);
    }
    g += gb;
  }
}

// scores[g * stride + t] = q_g . k_t, g < G, t < n <= 32: every query head of a KV head's
// group over one page (k: the head's first row, krow elements from a token's row to the next)
template <int HD, typename cache_t>
inline void group_scores(const float* q, int G, const cache_t* k, int64_t krow, int64_t n,
                         float* scores, int64_t stride) {
  for_head_blocks(G, [&](auto gb, int g) {
    group_scores_gb<HD, cache_t, decltype(gb)::value>(q + g * HD, k, krow, n,
                                                     scores + g * stride, stride);
  });
}

// acc[g * HD + d] += sum_t p[g * stride + t] * v_t[d], g < G, t < n <= 32
template <int HD, typename cache_t>
inline void group_values(const float* p, int G, const cache_t* v, int64_t vrow, int64_t n,
                         int64_t stride, float* acc) {
  for_head_blocks(G, [&](auto gb, int g) {
    group_values_gb<HD, cache_t, decltype(gb)::value>(p + g * stride, v, vrow, n, stride,
                                                     acc + g * HD);
  });
}

}  // namespace tritonserve_page_group
