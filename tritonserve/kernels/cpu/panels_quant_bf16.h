// The quantized panels (panels_quant.h's records) against bf16 x, with AVX512-BF16: a k pair
// of the 16 columns widened to 16 lanes of two bf16 and one vdpbf16ps a row. Shared by
// linear_quant.cpp and decode_layers.cpp (bf16). Builds without AVX512-BF16 widen x to fp32
// and use panels_quant.h's tile instead.
#pragma once

#include <utility>

#include "panels_quant.h"

namespace tritonserve_panels_quant {

// How far ahead of the record it widens the tile asks for the weights, into L2 (prefetcht2;
// past a panel's end the next panel's records, which follow in memory): the hardware
// prefetcher alone left the widening and the weight stream apart. Asked into L1 (prefetcht0) 8
// records ahead (the fp32 tile's way, panels_quant.h), the cold Q8_0 lm_head (30 MB) read at
// 16-19 GB/s while a sum of the same bytes read 31-33: the widening and the misses took turns.
// A C++ harness of SmolLM2's 120 Q4_1 layer matmuls + the Q8_0 head on huge pages, cache
// flushed before each pass, configs alternated in one process (2 threads, Zen 4): L1 8 records
// ahead 4.1-4.4 + 1.9 ms a step; into L2 12 KB ahead 2.95-3.0 + 0.86 (the sum of the 96 MB:
// 2.9-3.0); 4-8 KB left the head at 1.3-1.5 ms, 16-48 KB the same or slower; prefetchnta like
// prefetcht0 (docs/perf-log/2026-12-04-quantized-weights.md, "prefetching into L2").
constexpr int64_t kAheadBytes = 12 << 10;
// forced inline as the tiles' helpers below: called from an always_inline one, a plain inline
// function's prefetches were dropped from the one-row path (GCC 12; no prefetcht2 left)
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* rec, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    __builtin_prefetch(rec + kAheadBytes + line, 0, 1);
}

// xs[r * G + g] = group sums of bf16 rows (exact widening, fp32 sums)
inline void group_sums_bf16(const uint16_t* x, int64_t ldx, int64_t R, int64_t K, float* xs) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = 0; k < kGroup; ++k) {
        const uint32_t wide = static_cast<uint32_t>(x[r * ldx + g * kGroup + k]) << 16;
        float f;
        std::memcpy(&f, &wide, 4);
        s += f;
      }
      xs[r * G + g] = s;
    }
}

#ifdef TS_AVX512_BF16
using Wide = __m512i;  // a record's widened pairs (wide_words a panel)
// bf16 x: a k pair of the 16 columns widened to 16 lanes of two bf16 (vdpbf16ps's operand),
// one vdpbf16ps a row. u4 codes go in as 128 + q (bf16 0x4300 | q: exact), the 128 taken
// back with m' = m - 128 d; s8 codes as themselves (every int8 is a bf16). fp32 sums, y
// rounded to bf16 once. Against the fp32 tile: twice the multiply-adds an instruction (a
// batch-64 SmolLM2 step is compute-bound), the same bytes.
// Past one tile of rows the panel is widened once into scratch and read by every tile:
// widened per tile of 8 rows, SmolLM2's batch-64 matmuls took 53 ms against the dense bf16
// panels' 41; with the totals in memory a group (not registers), 50.

// Pair j of a record as vdpbf16ps's operand: 16 lanes (columns) of two bf16, k 2j and 2j+1.
// u4: bf16(128 + q[2j]) | bf16(128 + q[2j+1]) << 16 (0x4300 | q: exact); s8, s8h: bf16(q[2j])
// | bf16(q[2j+1]) << 16, each exact
// The tiles' helpers are forced inline, and each tile of R rows kept a function of its own
// (TS_TILE): with four kinds' instances in one unit GCC inlined every tile into the switch
// of rows_product_bf16, whose register allocation then spilled the totals (~1,000 zmm spills
// a kind against ~200), and the 4- and 64-row tiles ran 2x slower (SmolLM2's 121 matmuls,
// `tritonserve bench cpu-linear --dtype bfloat16`: 4.7 -> 9.2 ms at 4 rows, 54 -> 102 at 64).
#define TS_TILE_INLINE __attribute__((always_inline)) inline
#define TS_TILE __attribute__((noinline))

template <Kind kind>
TS_TILE_INLINE __m512i pair_of(const uint8_t* rec, int j) {
  if constexpr (kind == Kind::kU4) {
    const __m512i u =
        _mm512_srli_epi32(_mm512_loadu_si512(rec + 64 + 64 * (j / 4)), 4 * (j % 4));
    return _mm512_ternarylogic_epi32(u, _mm512_set1_epi32(0x000F000F),
                                     _mm512_set1_epi32(0x43004300), 0xEA);
  } else {
    const uint8_t* codes = rec + codes_at(kind);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * j))));
    const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 + 32 * j))));
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 16),
                                     _mm512_castps_si512(b),
                                     _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)), 0xF8);
  }
}

// A group widened once into scratch (past one tile of rows): its 16 pairs, then
// group_scales' three
constexpr int64_t kWideWords = 16 + 3;

template <Kind kind>
inline void widen_group(const uint8_t* rec, __m512i* pairs) {
#pragma GCC unroll 4
  for (int j = 0; j < 16; ++j) pairs[j] = pair_of<kind>(rec, j);
}

// acc += x's pair at p (broadcast) . the widened pair; under GCC the broadcast is the
// instruction's memory operand (the intrinsic became a scalar load and a vpbroadcastd)
TS_TILE_INLINE void dp_row(__m512& acc, __m512i pair, const uint16_t* p) {
#if defined(__GNUC__) && !defined(__clang__)
  asm("vdpbf16ps %[x]%{1to16%}, %[w], %[acc]"
      : [acc] "+v"(acc)
      : [w] "v"(pair), [x] "m"(*reinterpret_cast<const uint32_t*>(p)));
#else
  uint32_t word;
  std::memcpy(&word, p, 4);
  acc = _mm512_dpbf16_ps(acc, (__m512bh)pair, (__m512bh)_mm512_set1_epi32(word));
#endif
}

// The group's scales and offset: s[0] the scale of its first half group (or the whole group),
// s[1] of its second (s8h, s8hm: d * s[0], d * s[1], exact in fp32), s[2] its offset (u4: m' =
// m - 128 d, undoing the 128 in the codes; s8hm: m; zero for the others)
// (a struct, not std::array: a template argument drops __m512's attributes, and with them
// the tiles ran 2x slower at 4 and 64 rows)
struct GroupScales {
  __m512 s[3];
};

template <Kind kind>
TS_TILE_INLINE GroupScales group_scales(const uint8_t* rec) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
  GroupScales out;
  __m512(&s)[3] = out.s;
  s[0] = s[1] = d;
  s[2] = _mm512_setzero_ps();
  if constexpr (has_offset(kind))
    s[2] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
  if constexpr (kind == Kind::kU4) s[2] = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), d, s[2]);
  if constexpr (halves(kind) == 2)
    for (int h = 0; h < 2; ++h)
      s[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(rec + codes_at(kind) - 32 +
                                                                   16 * h)))));
  return out;
}

// One group of R rows into tot: pair(j) gives the group's pair j (pair_of the record,
// widened straight into the products: no widened copy stored and read back, a 4-row SmolLM2
// bf16 decode step 8.95 -> 6.81 ms in median blocks of `tritonserve bench ab-trees` on a
// 2-core Zen 4; or the scratch's copy past one tile of rows). C chains of sums a row, pair j
// on chain j % C, summed ((0 + 1) + 2) + 3 at the group's end, scaled into tot: with C = 4
// the order row_bf16 sums in.
template <int R, int C, Kind kind, typename Pair, typename Scales>
TS_TILE_INLINE void group_rows(const uint16_t* xg, int64_t ldx, const float* xs, int64_t G,
                               int64_t g, Pair pair, Scales scales, __m512 (&tot)[R]) {
  // s8h, s8hm: pairs 0-7 and 8-15 (k 0-15, 16-31) summed apart, each scaled by its half's
  // d * s
  constexpr int H = halves(kind), span = 16 / H;
  __m512 acc[C][R];
  GroupScales scale;
  for (int h = 0; h < H; ++h) {
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < span; ++j) {
      const __m512i p = pair(h * span + j);
      for (int r = 0; r < R; ++r) dp_row(acc[j % C][r], p, xg + r * ldx + 2 * (h * span + j));
    }
    for (int c = 1; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[0][r] = _mm512_add_ps(acc[0][r], acc[c][r]);
    if (h == 0) scale = scales();  // group_scales' three, loaded after the first products
    for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(scale.s[h], acc[0][r], tot[r]);
  }
  if constexpr (has_offset(kind))
    for (int r = 0; r < R; ++r)
      tot[r] = _mm512_fmadd_ps(scale.s[2], _mm512_set1_ps(xs[r * G + g]), tot[r]);
}

// R rows against a panel: widened inline into the products (Inline: at most one
// tile of rows, the weight read once) or read from `wide` (G groups of 16 pairs, d, m',
// widened once for every tile). The totals stay in registers over all of K. Up to kSplit
// rows sum exactly as row_bf16 does (four chains a group, even groups and odd groups in two
// totals added at the end), so a row's result does not depend on how many rows share the
// call: a speculating step's K + 1 rows give the tokens one row would
// (engine/speculative.py; without it SmolLM2's bf16 greedy output moved after a near tie).
template <int R, Kind kind, bool Inline>
TS_TILE void tile_bf16(const uint16_t* x, int64_t ldx, const float* xs, int64_t G,
                      const uint8_t* w, const __m512i* wide, uint16_t* y, int64_t ldy,
                      int64_t ncols, const float* bias) {
  constexpr int64_t bytes = record_bytes(kind);
  constexpr bool invariant = R <= kSplit;
  constexpr int C = invariant ? 4 : 1;
  __m512 tot[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) tot[h][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512(&into)[R] = (invariant && (g & 1)) ? tot[1] : tot[0];
    const uint16_t* xg = x + g * kGroup;
    if constexpr (Inline) {
      const uint8_t* rec = w + g * bytes;
      prefetch_ahead(rec, bytes);
      group_rows<R, C, kind>(
          xg, ldx, xs, G, g,
          [rec](int j) __attribute__((always_inline)) { return pair_of<kind>(rec, j); },
          [rec]() __attribute__((always_inline)) { return group_scales<kind>(rec); },
          into);
    } else {
      const __m512i* pairs = wide + g * kWideWords;
      group_rows<R, C, kind>(
          xg, ldx, xs, G, g, [pairs](int j) __attribute__((always_inline)) { return pairs[j]; },
          [pairs]() __attribute__((always_inline)) {
            return GroupScales{{_mm512_castsi512_ps(pairs[16]), _mm512_castsi512_ps(pairs[17]),
                           _mm512_castsi512_ps(pairs[18])}};
          },
          into);
    }
  }
  const __mmask16 mask = ncols >= kCols ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512 sum = invariant ? _mm512_add_ps(tot[0][r], tot[1][r]) : tot[0][r];
    _mm256_mask_storeu_epi16(y + r * ldy, mask,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum, b)));
  }
}

// N groups of one row, interleaved, from group g: each group's 16 pairs widened straight into
// four chains of vdpbf16ps (pair j on chain j % 4), summed ((0 + 1) + 2) + 3, scaled into
// tot[n]
template <Kind kind, int N>
TS_TILE_INLINE void row_groups(const uint16_t* x, const float* xs, const uint8_t* w,
                               int64_t g, __m512 (&tot)[2]) {
  constexpr int64_t bytes = record_bytes(kind);
  constexpr int H = halves(kind), span = 16 / H;  // s8h: each half group apart (group_rows)
  const uint8_t* rec = w + g * bytes;
  prefetch_ahead(rec, N * bytes);
  __m512 acc[N][4];
  GroupScales scale[N];
  for (int h = 0; h < H; ++h) {
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < 4; ++c) acc[n][c] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < span; ++j)
      for (int n = 0; n < N; ++n)
        dp_row(acc[n][j % 4], pair_of<kind>(rec + n * bytes, h * span + j),
               x + (g + n) * kGroup + 2 * (h * span + j));
    for (int n = 0; n < N; ++n) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[n][0], acc[n][1]),
                                                     acc[n][2]), acc[n][3]);
      if (h == 0) scale[n] = group_scales<kind>(rec + n * bytes);
      tot[n] = _mm512_fmadd_ps(scale[n].s[h], sum, tot[n]);
    }
  }
  if constexpr (has_offset(kind))
    for (int n = 0; n < N; ++n)
      tot[n] = _mm512_fmadd_ps(scale[n].s[2], _mm512_set1_ps(xs[g + n]), tot[n]);
}

// One row against a panel, two groups a step (even groups into tot[0], odd into tot[1],
// added at the end): the widening of one group overlaps the other's dot products. Over
// SmolLM2's 120 Q4_1 layer matmuls on huge pages (2 threads, Zen 4) 1.21-1.36 ms a pass
// against tile_bf16<1>'s 1.88-2.13 (47-55 against 31-35 GB/s).
template <Kind kind>
TS_TILE void row_bf16(const uint16_t* x, const float* xs, int64_t G, const uint8_t* w,
                     uint16_t* y, int64_t ncols, const float* bias) {
  __m512 tot[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) row_groups<kind, 2>(x, xs, w, g, tot);
  if (g < G) row_groups<kind, 1>(x, xs, w, g, tot);
  const __mmask16 mask = ncols >= kCols ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(
                                        _mm512_add_ps(_mm512_add_ps(tot[0], tot[1]), b)));
}

template <Kind kind>
inline void rows_product_bf16(const uint16_t* x, int64_t ldx, int64_t M, const float* xs,
                              int64_t G, const uint8_t* w, uint16_t* y, int64_t ldy,
                              int64_t ncols, __m512i* wide, const float* bias) {
  constexpr int64_t bytes = record_bytes(kind);
  if (M == 1) return row_bf16<kind>(x, xs, G, w, y, ncols, bias);
  const bool once = M <= kRows;
  if (!once)
    for (int64_t g = 0; g < G; ++g) {
      __m512i* into = wide + g * kWideWords;
      widen_group<kind>(w + g * bytes, into);
      const auto s = group_scales<kind>(w + g * bytes);
      for (int i = 0; i < 3; ++i) into[16 + i] = _mm512_castps_si512(s.s[i]);
    }
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const uint16_t* xm = x + m0 * ldx;
    const float* sm = xs + m0 * G;
    uint16_t* ym = y + m0 * ldy;
    switch (std::min<int64_t>(kRows, M - m0) + (once ? 0 : kRows)) {
#define TS_QUANT_TILE(R)                                                            \
  case R: tile_bf16<R, kind, true>(xm, ldx, sm, G, w, wide, ym, ldy, ncols, bias); break; \
  case R + kRows:                                                                   \
    tile_bf16<R, kind, false>(xm, ldx, sm, G, w, wide, ym, ldy, ncols, bias);       \
    break;
      TS_QUANT_TILE(1) TS_QUANT_TILE(2) TS_QUANT_TILE(3) TS_QUANT_TILE(4)
      TS_QUANT_TILE(5) TS_QUANT_TILE(6) TS_QUANT_TILE(7) TS_QUANT_TILE(8)
#undef TS_QUANT_TILE
    }
  }
}

// __m512i words of scratch a panel of K needs (panel_product_bf16's `wide`)
inline int64_t wide_words(int64_t K) { return K / kGroup * kWideWords; }

// bf16 rows [0, M) of x against one panel, y bf16; xs: group_sums_bf16 of the same rows;
// wide: wide_words(K) of 64-byte aligned scratch (used past one tile of rows); bias: the
// panel's 16 fp32 biases, added before the rounding, or nullptr
inline void panel_product_bf16(Kind kind, const uint16_t* x, int64_t M, int64_t K,
                               const float* xs, const uint8_t* panel, uint16_t* y, int64_t ldy,
                               int64_t ncols, Wide* wide, const float* bias) {
  with_kind(kind, [&](auto k) {
    rows_product_bf16<decltype(k)::value>(x, K, M, xs, K / kGroup, panel, y, ldy, ncols, wide,
                                          bias);
  });
}

#else  // no AVX512-BF16: the names, for callers' `if constexpr` bf16 branches (isa.h); a
// build without the level never runs a bf16 quantized matmul (linear_quant.cpp widens to fp32)
struct alignas(64) Wide {
  uint8_t bytes[64];
};
inline int64_t wide_words(int64_t) { return 0; }
inline void panel_product_bf16(Kind, const uint16_t*, int64_t, int64_t, const float*,
                               const uint8_t*, uint16_t*, int64_t, int64_t, Wide*,
                               const float*) {}
#endif

}  // namespace tritonserve_panels_quant
