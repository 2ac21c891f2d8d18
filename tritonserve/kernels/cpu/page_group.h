// One page of one KV head against its whole group of query heads (GQA), for the portable
// decode attention (paged_decode_portable.h's decode_seq, so paged_decode.cpp and the fp32 /
// int8 `layers` op): each K and V row is read once for the group instead of once a query
// head, and an int8 row's codes are converted in registers with its scale applied to the
// score (K) or the weight (V), never to the values.
//
// Why: at 8k tokens the portable kernel scored each query head over the page on its own and
// ran at ~37 GFLOP/s warm on 2 AVX2 cores (SmolLM2, 9 / 3 heads of 64: 0.42 ms a layer,
// bench cpu-decode); the figures after this file are in docs/benchmarks.md (long context).
// GCC vectors of kL fp32 lanes: eight (one ymm, AVX2's 16 registers hold a block's sums), or
// sixteen where the build has AVX-512 (one zmm: half the instructions a row, and its 32
// registers hold twice the block). int8 cache, 8k tokens, one layer, SmolLM2's heads, 2-core
// Xeon (`bench cpu-decode ... --kv-dtype int8`), cold / warm: 8 lanes 0.43-0.45 / 0.29-0.30
// ms, 16 the same, 16 with decode_seq's page softmax in one zmm 0.415 / 0.258; what is left is
// the FMAs (docs/perf-log/2026-12-07-xeon-amx-prefill-lora.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa.h"
#include "vec_math.h"

namespace tritonserve_page_group {

#ifdef TS_AVX512
constexpr int kL = 16;
constexpr int kRegs = 32;
#else
constexpr int kL = 8;
constexpr int kRegs = 16;
#endif
typedef float v8 __attribute__((vector_size(32)));
typedef float vL __attribute__((vector_size(4 * kL)));
// unaligned, aliasing loads and stores of kL floats / codes as one instruction each (a
// memcpy into a v8 became a copy through the stack in 16-byte halves, whose 32-byte reload
// missed store forwarding: the grouped scores ran 2x slower than the per-head loop)
typedef float vLu __attribute__((vector_size(4 * kL), aligned(4), may_alias));
typedef int8_t vLc __attribute__((vector_size(kL), aligned(1), may_alias));
typedef int32_t vLw __attribute__((vector_size(4 * kL)));

inline vL ld(const float* p) { return *reinterpret_cast<const vLu*>(p); }
inline void st(float* p, vL x) { *reinterpret_cast<vLu*>(p) = x; }

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

// a[j] for j < kL -> out[j] = the sum of a[j]'s lanes
inline vL sum_lanes(const vL* a) {
#ifdef TS_AVX512
  return tritonserve_vec::sum_lanes16(a);
#else
  return sum_lanes8(a);
#endif
}

// kL values of a cache row from element `at` as fp32 (int8: the codes, unscaled)
template <typename cache_t>
inline vL load(const cache_t* row, int64_t at) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
#if defined(TS_AVX512)
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + at));
    return reinterpret_cast<vL>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)));
#elif defined(TS_AVX2)
    // vpmovsxbd + vcvtdq2ps: GCC 12 turned __builtin_convertvector of 8 codes into 8 scalar
    // sign extensions and conversions, the int8 scores 5x slower than fp32 (~460 ns a page
    // of 16 tokens x 3 heads against ~120)
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + at));
    return reinterpret_cast<vL>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
#else
    const vLw wide = __builtin_convertvector(*reinterpret_cast<const vLc*>(row + at), vLw);
    return __builtin_convertvector(wide, vL);
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

// GB query heads x TT tokens from token t0: the kL-lane partial products into part[g * 32 + t]
template <int HD, typename cache_t, int GB, int TT>
inline void score_block(const float* q, const cache_t* k, int64_t krow, int64_t t0, vL* part) {
  vL acc[GB][TT] = {};
  for (int c = 0; c < HD / kL; ++c) {
    vL qc[GB];
    for (int g = 0; g < GB; ++g) qc[g] = ld(q + g * HD + kL * c);
    for (int j = 0; j < TT; ++j) {
      const vL kc = load(k + (t0 + j) * krow, kL * c);
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
  // tokens a block: GB * TT sums in registers, the q chunks read from L1 (AVX2, 8 lanes:
  // 4 x 3 heads 102 ns a page of 16 tokens against 115 for 3 x 3, SmolLM2's heads, fp32;
  // 4 x 4 spills; AVX-512's 32 registers take twice the tokens)
  constexpr int TT = (kRegs == 32 ? 2 : 1) * (GB >= 4 ? 3 : 4);
  alignas(64) vL part[GB * 32];
  int64_t t = 0;
  for (; t + TT <= n; t += TT) score_block<HD, cache_t, GB, TT>(q, k, krow, t, part);
  for (; t < n; ++t) score_block<HD, cache_t, GB, 1>(q, k, krow, t, part);
  for (int64_t u = n; u < ((n + kL - 1) & ~int64_t(kL - 1)); ++u)
    for (int g = 0; g < GB; ++g) part[g * 32 + u] = vL{};
  float scale[32];
  for (int64_t u = 0; u < n; ++u) scale[u] = row_scale<HD>(k + u * krow);
  for (int g = 0; g < GB; ++g)
    for (int64_t t0 = 0; t0 < n; t0 += kL) {
      alignas(64) float s[kL];
      st(s, sum_lanes(part + g * 32 + t0));
      for (int64_t u = t0; u < std::min<int64_t>(n, t0 + kL); ++u)
        scores[g * stride + u] = s[u - t0] * scale[u];
    }
}

// acc[g * HD + d] += sum_t p[g * stride + t] * v_t[d] for GB heads, tokens t < n <= 32
// (an int8 row's scale folded into its weights first)
template <int HD, typename cache_t, int GB>
inline void group_values_gb(const float* p, const cache_t* v, int64_t vrow, int64_t n,
                            int64_t stride, float* acc) {
  // kL-lane chunks of a row at once: GB * DC sums (+ DC values) in the registers
  constexpr int DC = (HD / kL) % 4 == 0 && GB * 4 + 4 <= kRegs - 4 ? 4 : 2;
  static_assert(HD % (kL * DC) == 0, "whole chunks");
  float w[GB][32];
  for (int64_t t = 0; t < n; ++t) {
    const float s = row_scale<HD>(v + t * vrow);
    for (int g = 0; g < GB; ++g) w[g][t] = p[g * stride + t] * s;
  }
  for (int d0 = 0; d0 < HD; d0 += kL * DC) {
    vL a[GB][DC];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DC; ++c) a[g][c] = ld(acc + g * HD + d0 + kL * c);
    for (int64_t t = 0; t < n; ++t) {
      const cache_t* vt = v + t * vrow;
      vL vc[DC];
      for (int c = 0; c < DC; ++c) vc[c] = load(vt, d0 + kL * c);
      for (int g = 0; g < GB; ++g) {
        const float wg = w[g][t];
        for (int c = 0; c < DC; ++c) a[g][c] += wg * vc[c];
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < DC; ++c) st(acc + g * HD + d0 + kL * c, a[g][c]);
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
