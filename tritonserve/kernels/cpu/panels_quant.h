// Weight-only quantized column panels: rows of fp32 x against one panel of 16 output columns
// whose weights stay packed in memory and are widened in registers. Shared by
// linear_quant.cpp (the matmul op) and decode_layers.cpp (the decode stack in fp32).
// A panel is [G = K / 32] group records, each 32 k of the panel's 16 columns:
//   u4 (320 B): d fp16 [16], m fp16 [16], then 4 blocks of 8 k: 16 32-bit words, one a
//       column, nibble 4 h + i of column c's word = q[8 b + 2 i + h][c] (i < 4, h < 2), so
//       k pair i of the block is (word >> 4 i) & 0x000F000F: a shift and a mask, no shuffle
//       (fewer uops than a byte a pair widened by vpmovzxbd; no difference measured,
//       docs/perf-log/2026-12-04-quantized-weights.md);
//       weight = d[c] * q + m[c], q in 0..15 (GGUF Q4_1 as it is; Q4_0 with m = -8 d; int4
//       with a zero point z: m = -z d)
//   s8 (544 B): d fp16 [16], int8 [32 k][16 columns]; weight = d[c] * q (GGUF Q8_0; int8)
//   s8h (576 B): d fp16 [16], s int8 [2][16], int8 [32 k][16 columns]; weight =
//       (d[c] * s[k / 16][c]) * q (GGUF Q6_K: a scale every 16 k under the super block's d);
//       each half group's sums stay apart until its scale d * s (exact in fp32)
//   s8hm (608 B): d fp16 [16], m fp16 [16], s int8 [2][16], int8 [32 k][16 columns]; weight =
//       (d[c] * s[k / 16][c]) * q + m[c]: every other kind in one (GGUF Q5_1, Q5_K; a fused
//       projection whose parts came in different kinds, kernels/quant_layout.py's repack)
// Same bytes a weight as the GGUF blocks (Q4_1: 20 B / 32, Q8_0: 34 B / 32), reordered so one
// load is 4 k pairs (u4, 64 B) or a k (s8, 16 B) of all 16 columns: the lanes are columns, as
// in panels_fp32.h, with no horizontal sums. A group's sums stay apart until its scale:
//   y[c] += d[c] * sum_k q[k][c] x[k] + m[c] * sum_k x[k]
// (xsum: each row's group sums, computed once a call by group_sums). Against the dequantized
// weights' sum_k (d q + m) x this changes only the rounding (fp32 sums either way).
// The weight tensor is uint8 [P, G, record bytes]; packing is Python's
// (kernels/quant_layout.py), with a torch reference of the dequantized weight. The tile for
// bf16 x: panels_quant_bf16.h.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa.h"

namespace tritonserve_panels_quant {

constexpr int64_t kCols = 16;  // output columns a panel
constexpr int64_t kGroup = 32;  // k a scale group
constexpr int64_t kU4Bytes = 64 + 256;
constexpr int64_t kS8Bytes = 32 + 512;
constexpr int64_t kS8HBytes = 64 + 512;
constexpr int64_t kS8HMBytes = 96 + 512;
constexpr int kRows = 8;  // rows a register tile: 8 group sums + 8 totals
// Records ahead the fp32 tile asks for into L1 (prefetcht0): the hardware prefetcher alone
// left the widening and the weight stream apart. The bf16 tile asks into L2 instead
// (panels_quant_bf16.h, kAheadBytes); here (FMAs on widened codes: more work a byte) that
// measured slower: kAheadBytes' harness with fp32 x, seven alternations, medians 3.5-4.4 against
// 3.8-6.0 ms a pass.
constexpr int64_t kFp32Ahead = 8;
// Up to this many rows a tile keeps several chains of sums a row: one chain of a group's 16
// dependent vdpbf16ps (or 32 FMAs) a row left batch 1 waiting on latency. The bf16 tile keeps
// four: SmolLM2's 120 Q4_1 layer matmuls on huge pages (2 threads, Zen 4) 2.09 -> 1.85 ms a
// pass, 31.7 -> 36 GB/s; the AVX-512 fp32 tile four too (it kept two: see its tile), AVX2's
// two (each a pair of 8-lane halves: four chains of registers).
constexpr int kSplit = 4;

// The kinds by their ids in kernels/quant_layout.py's KINDS table (which quant_kinds() in
// linear_quant.cpp hands back, field by field, for tests/test_quant_kinds.py to compare)
enum class Kind { kU4 = 0, kS8 = 1, kS8H = 2, kS8HM = 3 };
constexpr Kind kKinds[] = {Kind::kU4, Kind::kS8, Kind::kS8H, Kind::kS8HM};

constexpr int64_t record_bytes(Kind kind) {
  return kind == Kind::kU4 ? kU4Bytes : kind == Kind::kS8 ? kS8Bytes
                                      : kind == Kind::kS8H ? kS8HBytes : kS8HMBytes;
}
// where a kind's codes start in its record (u4: its words; an s8 kind with half-group scales
// keeps the int8 scales s in the 32 bytes before the codes); its code bits; its scale groups
// a record; whether it has an offset m (at byte 32)
constexpr int64_t codes_at(Kind kind) {
  return kind == Kind::kS8 ? 32 : kind == Kind::kS8HM ? 96 : 64;
}
constexpr int code_bits(Kind kind) { return kind == Kind::kU4 ? 4 : 8; }
constexpr int halves(Kind kind) { return kind == Kind::kS8H || kind == Kind::kS8HM ? 2 : 1; }
constexpr bool has_offset(Kind kind) { return kind == Kind::kU4 || kind == Kind::kS8HM; }

// f(std::integral_constant<Kind, kind>{}): the one place a run-time kind picks its instance
template <typename F>
inline void with_kind(Kind kind, F&& f) {
  switch (kind) {
    case Kind::kU4: return f(std::integral_constant<Kind, Kind::kU4>{});
    case Kind::kS8: return f(std::integral_constant<Kind, Kind::kS8>{});
    case Kind::kS8H: return f(std::integral_constant<Kind, Kind::kS8H>{});
    case Kind::kS8HM: return f(std::integral_constant<Kind, Kind::kS8HM>{});
  }
}

// The kind of a record size, false for none
inline bool kind_of(int64_t bytes, Kind& kind) {
  if (bytes == kU4Bytes) return kind = Kind::kU4, true;
  if (bytes == kS8Bytes) return kind = Kind::kS8, true;
  if (bytes == kS8HBytes) return kind = Kind::kS8H, true;
  if (bytes == kS8HMBytes) return kind = Kind::kS8HM, true;
  return false;
}

// xs[r * G + g] = sum of x[r, 32 g .. 32 g + 31] for R rows (row stride ldx)
inline void group_sums(const float* x, int64_t ldx, int64_t R, int64_t K, float* xs) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + r * ldx + g * kGroup;
      float s = 0.f;
      for (int64_t k = 0; k < kGroup; ++k) s += p[k];
      xs[r * G + g] = s;
    }
}

inline float half(const uint8_t* p, int64_t c) {
  uint16_t h;
  std::memcpy(&h, p + 2 * c, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

#ifdef TS_AVX512
// Up to kSplit rows a row keeps four chains of sums a group (k pair j's even k on chain
// 2 (j % 2), its odd k on the next), summed ((0 + 1) + 2) + 3 at the group's end. Two chains
// left batch 1 waiting on FMA latency: a u4 matmul at 1 row (packed_linear_quant, 512 x 1024
// to 1536 x 576, 64 weights cycled so each is cold, 2-core Zen 4) read 13-20 GB/s with two,
// 21-23 with four (s8h: 18-28 either way, noisy).
template <int R, Kind kind>
inline void tile(const float* x, int64_t ldx, const float* xs, int64_t G, const uint8_t* w,
                 float* y, int64_t ldy, int64_t ncols) {
  constexpr int64_t bytes = record_bytes(kind);
  constexpr int C = R <= kSplit ? 4 : 1;  // chains a row
  __m512 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15);
  __m512 ch[R][C];
  const auto clear = [&] {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) ch[r][c] = _mm512_setzero_ps();
  };
  const auto sum = [&](int r) {  // a row's chains, in one order for every R <= kSplit
    if constexpr (C == 4)
      return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(ch[r][0], ch[r][1]), ch[r][2]),
                           ch[r][3]);
    else
      return ch[r][0];
  };
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w + g * bytes;
    // past the panel's end: the next panel's records, which follow in memory
    for (int64_t line = 0; line < bytes; line += 64)
      __builtin_prefetch(rec + kFp32Ahead * bytes + line, 0, 3);
    const float* xg = x + g * kGroup;
    clear();
    if constexpr (kind == Kind::kU4) {
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const __m512i v = _mm512_srli_epi32(
            _mm512_loadu_si512(rec + 64 + 64 * (j / 4)), 4 * (j % 4));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 16), low));
        const int c0 = C == 4 ? 2 * (j % 2) : 0, c1 = C == 4 ? c0 + 1 : 0;
        for (int r = 0; r < R; ++r) {
          ch[r][c0] = _mm512_fmadd_ps(lo, _mm512_set1_ps(xg[r * ldx + 2 * j]), ch[r][c0]);
          ch[r][c1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(xg[r * ldx + 2 * j + 1]), ch[r][c1]);
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
      const __m512 m =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
      for (int r = 0; r < R; ++r) {
        tot[r] = _mm512_fmadd_ps(d, sum(r), tot[r]);
        tot[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g]), tot[r]);
      }
    } else {  // s8 kinds: each scale group's k (all 32, or 16 a half) summed, then scaled
      constexpr int H = halves(kind), span = 32 / H;
      const uint8_t* codes = rec + codes_at(kind);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
      for (int h = 0; h < H; ++h) {
        if (h) clear();
#pragma GCC unroll 16
        for (int k = h * span; k < (h + 1) * span; k += 2) {
          const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * k))));
          const __m512 u = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * k + 16))));
          const int c0 = C == 4 ? 2 * ((k / 2) % 2) : 0, c1 = C == 4 ? c0 + 1 : 0;
          for (int r = 0; r < R; ++r) {
            ch[r][c0] = _mm512_fmadd_ps(v, _mm512_set1_ps(xg[r * ldx + k]), ch[r][c0]);
            ch[r][c1] = _mm512_fmadd_ps(u, _mm512_set1_ps(xg[r * ldx + k + 1]), ch[r][c1]);
          }
        }
        __m512 dh = d;
        if constexpr (H == 2)
          dh = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                        codes - 32 + 16 * h)))));
        for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(dh, sum(r), tot[r]);
      }
      if constexpr (has_offset(kind)) {
        const __m512 m =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
        for (int r = 0; r < R; ++r)
          tot[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * G + g]), tot[r]);
      }
    }
  }
  const __mmask16 mask = ncols >= kCols ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, mask, tot[r]);
}
#elif defined(TS_AVX2)
// AVX2: the AVX-512 tile's order of work, each 16-column vector as two 8-lane halves. For
// few rows (kSplit) two chains a row (even and odd k), summed at the group's end: one chain
// of 32 dependent FMAs a group was the bound at batch 1 (a 1024 x 1024 u4 matmul 135 us on
// a 2-core AVX2 EPYC, busy).
template <int R, Kind kind>
inline void tile(const float* x, int64_t ldx, const float* xs, int64_t G, const uint8_t* w,
                 float* y, int64_t ldy, int64_t ncols) {
  constexpr int64_t bytes = record_bytes(kind);
  __m256 tot[R][2];
  for (int r = 0; r < R; ++r) tot[r][0] = tot[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(15);
  const auto halfs = [](const uint8_t* p) {  // 8 fp16 -> 8 fp32
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  const auto bytes8 = [](__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); };
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w + g * bytes;
    for (int64_t line = 0; line < bytes; line += 64)
      __builtin_prefetch(rec + kFp32Ahead * bytes + line, 0, 3);
    const float* xg = x + g * kGroup;
    __m256 acc[R][2], acc1[R][2];
    __m256(&odd)[R][2] = R <= kSplit ? acc1 : acc;
    const auto clear = [&] {
      for (int r = 0; r < R; ++r)
        acc[r][0] = acc[r][1] = acc1[r][0] = acc1[r][1] = _mm256_setzero_ps();
    };
    const auto fold = [&] {
      if constexpr (R <= kSplit)
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_add_ps(acc[r][h], acc1[r][h]);
    };
    clear();
    if constexpr (kind == Kind::kU4) {
#pragma GCC unroll 4
      for (int j = 0; j < 16; ++j) {
        const uint8_t* words = rec + 64 + 64 * (j / 4);
        __m256 lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_srli_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 32 * h)), 4 * (j % 4));
          lo[h] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
          hi[h] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), low));
        }
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_set1_ps(xg[r * ldx + 2 * j]);
          const __m256 b = _mm256_set1_ps(xg[r * ldx + 2 * j + 1]);
          for (int h = 0; h < 2; ++h) {
            acc[r][h] = _mm256_fmadd_ps(lo[h], a, acc[r][h]);
            odd[r][h] = _mm256_fmadd_ps(hi[h], b, odd[r][h]);
          }
        }
      }
      fold();
      for (int h = 0; h < 2; ++h) {
        const __m256 d = halfs(rec + 16 * h), m = halfs(rec + 32 + 16 * h);
        for (int r = 0; r < R; ++r)
          tot[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * G + g]),
                                      _mm256_fmadd_ps(d, acc[r][h], tot[r][h]));
      }
    } else {  // s8 kinds: each scale group's k (all 32, or 16 a half) summed, then scaled
      constexpr int H = halves(kind), span = 32 / H;
      const uint8_t* codes = rec + codes_at(kind);
      for (int half_group = 0; half_group < H; ++half_group) {
        if (half_group) clear();
#pragma GCC unroll 4
        for (int k = half_group * span; k < (half_group + 1) * span; k += 2) {
          const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * k));
          const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * k + 16));
          const __m256 v[2] = {bytes8(c), bytes8(_mm_srli_si128(c, 8))};
          const __m256 u[2] = {bytes8(e), bytes8(_mm_srli_si128(e, 8))};
          for (int r = 0; r < R; ++r) {
            const __m256 a = _mm256_set1_ps(xg[r * ldx + k]);
            const __m256 b = _mm256_set1_ps(xg[r * ldx + k + 1]);
            for (int h = 0; h < 2; ++h) {
              acc[r][h] = _mm256_fmadd_ps(v[h], a, acc[r][h]);
              odd[r][h] = _mm256_fmadd_ps(u[h], b, odd[r][h]);
            }
          }
        }
        fold();
        for (int h = 0; h < 2; ++h) {
          __m256 d = halfs(rec + 16 * h);
          if constexpr (H == 2) {
            const __m128i s = _mm_loadu_si128(
                reinterpret_cast<const __m128i*>(codes - 32 + 16 * half_group));
            d = _mm256_mul_ps(d, bytes8(h ? _mm_srli_si128(s, 8) : s));
          }
          for (int r = 0; r < R; ++r) tot[r][h] = _mm256_fmadd_ps(d, acc[r][h], tot[r][h]);
        }
      }
      if constexpr (has_offset(kind))
        for (int h = 0; h < 2; ++h) {
          const __m256 m = halfs(rec + 32 + 16 * h);
          for (int r = 0; r < R; ++r)
            tot[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * G + g]), tot[r][h]);
        }
    }
  }
  for (int r = 0; r < R; ++r) {
    float row[kCols];
    _mm256_storeu_ps(row, tot[r][0]);
    _mm256_storeu_ps(row + 8, tot[r][1]);
    std::memcpy(y + r * ldy, row, ncols * sizeof(float));
  }
}
#else
// Portable: the same order of work on arrays of 16 the compiler vectorises for its target
template <int R, Kind kind>
inline void tile(const float* x, int64_t ldx, const float* xs, int64_t G, const uint8_t* w,
                 float* y, int64_t ldy, int64_t ncols) {
  constexpr int64_t bytes = record_bytes(kind);
  float tot[R][kCols] = {};
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w + g * bytes;
    const float* xg = x + g * kGroup;
    float acc[R][kCols] = {};
    if constexpr (kind == Kind::kU4) {
      for (int j = 0; j < 16; ++j) {
        float lo[kCols], hi[kCols];
        for (int c = 0; c < kCols; ++c) {
          uint32_t word;
          std::memcpy(&word, rec + 64 + 64 * (j / 4) + 4 * c, 4);
          word >>= 4 * (j % 4);
          lo[c] = static_cast<float>(word & 15);
          hi[c] = static_cast<float>((word >> 16) & 15);
        }
        for (int r = 0; r < R; ++r) {
          const float a = xg[r * ldx + 2 * j], b = xg[r * ldx + 2 * j + 1];
          for (int c = 0; c < kCols; ++c) acc[r][c] = acc[r][c] + lo[c] * a + hi[c] * b;
        }
      }
      for (int c = 0; c < kCols; ++c) {
        const float d = half(rec, c), m = half(rec + 32, c);
        for (int r = 0; r < R; ++r) tot[r][c] += d * acc[r][c] + m * xs[r * G + g];
      }
    } else {
      constexpr int H = halves(kind), span = 32 / H;
      for (int h = 0; h < H; ++h) {
        if (h)
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < kCols; ++c) acc[r][c] = 0.f;
        for (int k = h * span; k < (h + 1) * span; ++k) {
          float v[kCols];
          for (int c = 0; c < kCols; ++c)
            v[c] = static_cast<float>(static_cast<int8_t>(rec[codes_at(kind) + 16 * k + c]));
          for (int r = 0; r < R; ++r) {
            const float a = xg[r * ldx + k];
            for (int c = 0; c < kCols; ++c) acc[r][c] += v[c] * a;
          }
        }
        for (int c = 0; c < kCols; ++c) {
          float d = half(rec, c);
          if constexpr (H == 2)
            d *= static_cast<float>(static_cast<int8_t>(rec[codes_at(kind) - 32 + 16 * h + c]));
          for (int r = 0; r < R; ++r) tot[r][c] += d * acc[r][c];
        }
      }
      if constexpr (has_offset(kind))
        for (int c = 0; c < kCols; ++c) {
          const float m = half(rec + 32, c);
          for (int r = 0; r < R; ++r) tot[r][c] += m * xs[r * G + g];
        }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(y + r * ldy, tot[r], ncols * sizeof(float));
}
#endif

template <Kind kind>
inline void rows_product(const float* x, int64_t ldx, int64_t M, const float* xs, int64_t G,
                         const uint8_t* w, float* y, int64_t ldy, int64_t ncols) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const float* xm = x + m0 * ldx;
    const float* sm = xs + m0 * G;
    float* ym = y + m0 * ldy;
    switch (std::min<int64_t>(kRows, M - m0)) {
#define TS_QUANT_TILE(R) \
  case R: tile<R, kind>(xm, ldx, sm, G, w, ym, ldy, ncols); break;
      TS_QUANT_TILE(1) TS_QUANT_TILE(2) TS_QUANT_TILE(3) TS_QUANT_TILE(4)
      TS_QUANT_TILE(5) TS_QUANT_TILE(6) TS_QUANT_TILE(7) TS_QUANT_TILE(8)
#undef TS_QUANT_TILE
    }
  }
}

// Rows [0, M) of x [M, K] (row stride K) against one panel: y[m, 0:ncols] = the products
// (y row stride ldy; ncols < 16 only in the last panel); xs: group_sums of the same rows.
inline void panel_product(Kind kind, const float* x, int64_t M, int64_t K, const float* xs,
                          const uint8_t* panel, float* y, int64_t ldy, int64_t ncols) {
  with_kind(kind, [&](auto k) {
    rows_product<decltype(k)::value>(x, K, M, xs, K / kGroup, panel, y, ldy, ncols);
  });
}

}  // namespace tritonserve_panels_quant

