// The bf16 column-panel matmul kernels over pack_linear_weight_bf16's layout: R rows of x
// against one panel of 32 output columns, with the epilogues (bias, the gate/up activation,
// non-temporal rows). Shared by linear_bf16.cpp (the matmul ops) and decode_layers.cpp (the
// whole decode stack in one parallel region). The layout, and why panels: linear_bf16.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "isa.h"
#include "vec_math.h"

namespace tritonserve_panels_bf16 {

constexpr int64_t kCols = 32;  // output columns per panel
// Every row tile of a panel asks for its share of the next panel's lines, spread over its
// pairs (the hardware prefetcher alone left the first pass over a panel waiting on memory).
// SmolLM2's 121 matmuls weights cold on a 2-core Zen 5, side by side: the first tile alone
// asking 4 KB ahead gave M = 4 6.5 -> 5.4-5.9 ms, 16 9.4 -> 7.0-7.4, 64 23.0 -> 19.9-20.2;
// that tile then had to fetch a whole panel in a sixth of the panel's time at
// M = 64 (~96 GB/s for two cores). Spread over every tile: docs/perf-log/2026-cpu-decode.md.
// One row (its own loop) gained nothing from either.
constexpr int64_t kPrefetchBytes = 4096;
struct Ahead {
  const char* base;  // the next panel
  uint64_t first;    // this tile's first line, 16.16 fixed point
  uint64_t rate;     // lines a pair, 16.16
};

// An output larger than this (a core's L2) is written with non-temporal stores: it would
// not stay in L2 for its reader anyway, and the ordinary stores' line fills (read for
// ownership, 64 B per 32-column row, one per row a panel) queued with the weight stream's
// prefetches. The tied lm_head (49,152 x 576) then the softmax draw, weights cold, 2-core
// Zen 5: M = 64 4.82 -> 4.25 ms, 32 2.45 -> 2.19, 16 1.54 -> 1.39, 8 and 4 unchanged; the
// step's logits phase at batch 64 4.5-4.6 -> 3.9-4.1 ms; a 64 x 64 prefill unchanged
// (docs/perf-log/2026-cpu-decode.md).
constexpr int64_t kStreamBytes = 1 << 20;

using tritonserve_vec::bf16_to_float;
using tritonserve_vec::float_to_bf16;  // round to nearest even; NaN stays NaN

// The pair (x[2j], x[2j + 1]) of row x as one 32-bit word; an odd K's last pair is (x, 0).
inline uint32_t pair_at(const uint16_t* x, int64_t j, int64_t K) {
  if (2 * j + 1 < K) {
    uint32_t w;
    std::memcpy(&w, x + 2 * j, sizeof w);
    return w;
  }
  return x[2 * j];
}

// y[m, 0:ncols] (bf16, row stride ldy) = acc[m] + bias, from fp32 sums of 32 columns
inline void store_row(const float* acc, uint16_t* y, int64_t ncols, const float* bias) {
  uint16_t row[kCols];
  for (int64_t c = 0; c < kCols; ++c) row[c] = float_to_bf16(acc[c] + (bias ? bias[c] : 0.f));
  std::memcpy(y, row, ncols * sizeof(uint16_t));
}

// The gate/up epilogue: a panel of pack_gate_up_bf16 holds 16 gate columns then the same 16
// up columns, so y[0:16] = silu(gate) * up with the unfused path's roundings (gate and up
// rounded to bf16 as the matmul would store them, silu rounded as F.silu's bf16 output, the
// product rounded once): the activation never goes to memory at [M, 2I].
inline void store_silu_mul(const float* gate, const float* up, uint16_t* y) {
  uint16_t out[16];
  for (int i = 0; i < 16; ++i) {
    const float g = bf16_to_float(float_to_bf16(gate[i]));
    const float u = bf16_to_float(float_to_bf16(up[i]));
    out[i] = float_to_bf16(tritonserve_vec::silu_as<c10::BFloat16>(g) * u);
  }
  std::memcpy(y, out, sizeof out);
}

// Where a tile's rows go: y (row stride ldy), ncols of the panel's 32 columns, a bias or
// none; silu: the gate/up epilogue (16 columns out, no bias); stream: whole aligned rows
// written non-temporally (kStreamBytes).
struct Out {
  uint16_t* y;
  int64_t ldy, ncols;
  const float* bias;
  bool silu;
  bool stream;
};

#ifdef TS_AVX512_BF16
// x rounded to bf16 (nearest even) and back
inline __m512 round_bf16(__m512 x) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// store_silu_mul on registers (exp_clamped's polynomial as tritonserve_vec::exp16). Through
// the scalar helper (the loop did not vectorise) the epilogue cost 35 us of a 264 us M = 64
// gate/up.
inline void store_silu_mul_dp(__m512 gate, __m512 up, uint16_t* y) {
  const __m512 g = round_bf16(gate), u = round_bf16(up);
  const __m512 e = tritonserve_vec::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));  // exp(-g)
  const __m512 act = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(act, u)));
}

// y[0:ncols] = bf16(lo | hi + bias) in registers (or the gate/up epilogue): vcvtne2ps2bf16
// rounds to nearest even as float_to_bf16 does (NaN stays NaN; it reads an fp32 denormal as
// zero, below bf16's 1e-38 floor anyway), one masked store. The scalar loop it replaces was
// ~400 conversions a 12-row tile against ~3,500 cycles of dot products at K = 576
// (docs/perf-log/2026-cpu-decode.md).
inline void store_row_dp(__m512 lo, __m512 hi, uint16_t* y, int64_t ncols, const float* bias,
                         bool silu, bool stream = false) {
  if (silu) {
    store_silu_mul_dp(lo, hi, y);
    return;
  }
  if (bias) {
    lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
    hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
  }
  const __m512i row = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo -> elements 0..15
  if (stream && ncols == kCols && (reinterpret_cast<uintptr_t>(y) & 63) == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(y), row);
    return;
  }
  const __mmask32 keep = ncols >= kCols ? ~0u : (1u << ncols) - 1;
  _mm512_mask_storeu_epi16(y, keep, row);
}

// R rows of x (row stride ldx) against one panel, all of its kp pairs. 2R accumulators
// (R <= 12 of the 32 zmm registers) and two panel loads per pair, the x pair folded into
// vdpbf16ps as a broadcast; each pair also asks for the tile's share of the weight stream
// ahead (`ahead`).
// Row m's pair is addressed from two pointers, p (row 0's) and q = p + 3 s, with the row
// stride s, 3 s and 5 s (bytes) as index registers: 13 rows in 5 general registers. Why: with
// one pointer a row (what GCC made of x + m * ldx) the 11-row tile ran out of registers and
// reloaded row pointers from xmm registers and the stack every pair (its
// disassembly). The addressing has to be written in asm, GCC picks the pointers otherwise.
// Single core, warm, M = 64, SmolLM2's shapes, best of 30 passes, GFLOP/s (the chip's
// vdpbf16ps peak measured 232): qkv 960 x 576 212 -> 226-233, gate/up 3072 x 576 186-201 ->
// 211-220, down 576 x 1536 207-214 -> 229-233, results bit-identical; the engine's batch-64
// decode step 6-10 % faster, in 15 of 16 alternated blocks
// (docs/perf-log/2026-cpu-decode.md).
// lo[m] += x_m . w0, hi[m] += x_m . w1 (x_m: row m's pair, at p + m s, broadcast)
#define TS_DP_ROW_C(m)                                                                    \
  if constexpr (R > m) {                                                                  \
    uint32_t word;                                                                        \
    std::memcpy(&word, p + m * s, sizeof word);                                           \
    const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));              \
    lo##m = _mm512_dpbf16_ps(lo##m, xs, w0);                                              \
    hi##m = _mm512_dpbf16_ps(hi##m, xs, w1);                                              \
  }
// the same with row m's address mode (ADDR) written out: GCC's asm; other compilers get
// the intrinsics
#if defined(__clang__) || !defined(__GNUC__)
#define TS_DP_ROW(m, ADDR) TS_DP_ROW_C(m)
#else
#define TS_DP_ROW(m, ADDR)                                                               \
  if constexpr (R > m)                                                                   \
  asm("vdpbf16ps " ADDR "%{1to16%}, %[w0], %[lo]\n\t"                                     \
      "vdpbf16ps " ADDR "%{1to16%}, %[w1], %[hi]"                                         \
      : [lo] "+v"(lo##m), [hi] "+v"(hi##m)                                                \
      : [w0] "v"(w0), [w1] "v"(w1), [p] "r"(p), [q] "r"(q), [s] "r"(s), [s3] "r"(s3),     \
        [s5] "r"(s5), "m"(*(const char(*)[4])p))
#endif
#define TS_DP_ROWS                                                                         \
  TS_DP_ROW(0, "(%[p])");         TS_DP_ROW(1, "(%[p],%[s],1)");   TS_DP_ROW(2, "(%[p],%[s],2)");  \
  TS_DP_ROW(3, "(%[q])");         TS_DP_ROW(4, "(%[p],%[s],4)");   TS_DP_ROW(5, "(%[p],%[s5],1)"); \
  TS_DP_ROW(6, "(%[p],%[s3],2)"); TS_DP_ROW(7, "(%[q],%[s],4)");   TS_DP_ROW(8, "(%[p],%[s],8)");  \
  TS_DP_ROW(9, "(%[q],%[s3],2)"); TS_DP_ROW(10, "(%[p],%[s5],2)"); TS_DP_ROW(11, "(%[q],%[s],8)"); \
  TS_DP_ROW(12, "(%[p],%[s3],4)")
#define TS_STORE_ROW(m)                                                                  \
  if constexpr (R > m)                                                                   \
  store_row_dp(lo##m, hi##m, out.y + m * out.ldy, out.ncols, out.bias, out.silu, out.stream)

template <int R>
inline void tile(const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* panel, int64_t kp,
                 const Out& out, const Ahead& ahead) {
  static_assert(R >= 1 && R <= 13, "TS_DP_ROWS addresses 13 rows");
  const __m512 zero = _mm512_setzero_ps();
  __m512 lo0 = zero, lo1 = zero, lo2 = zero, lo3 = zero, lo4 = zero, lo5 = zero, lo6 = zero,
         lo7 = zero, lo8 = zero, lo9 = zero, lo10 = zero, lo11 = zero, lo12 = zero;
  __m512 hi0 = zero, hi1 = zero, hi2 = zero, hi3 = zero, hi4 = zero, hi5 = zero, hi6 = zero,
         hi7 = zero, hi8 = zero, hi9 = zero, hi10 = zero, hi11 = zero, hi12 = zero;
  // whole pairs read as words; an odd K's last pair through pair_at after the loop (a
  // run-time branch inside it is what kernels/cpu/linear.cpp measured to cost)
  const int64_t full = K / 2;
  [[maybe_unused]] int64_t s = ldx * 2, s3 = 3 * s, s5 = 5 * s;
  const char* p = reinterpret_cast<const char*>(x);
  uint64_t line = ahead.first;  // 16.16 fixed point
  asm volatile("" ::: "memory");  // every row of x stored before the asm reads it
  for (int64_t j = 0; j < full; ++j, p += 4) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + j * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + j * 2 * kCols + kCols);
    __builtin_prefetch(ahead.base + (line >> 16) * 64, 0, 3);
    __builtin_prefetch(ahead.base + ((line + ahead.rate / 2) >> 16) * 64, 0, 3);
    line += ahead.rate;
    [[maybe_unused]] const char* q = p + s3;
    TS_DP_ROWS;
  }
  if (kp > full) {  // the rows' last words (x, 0), 4 bytes apart
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + full * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + full * 2 * kCols + kCols);
    uint32_t words[R];
    for (int m = 0; m < R; ++m) words[m] = pair_at(x + m * ldx, full, K);
    p = reinterpret_cast<const char*>(words), s = 4;  // intrinsics: the compiler sees the reads
    TS_DP_ROW_C(0); TS_DP_ROW_C(1); TS_DP_ROW_C(2); TS_DP_ROW_C(3); TS_DP_ROW_C(4);
    TS_DP_ROW_C(5); TS_DP_ROW_C(6); TS_DP_ROW_C(7); TS_DP_ROW_C(8); TS_DP_ROW_C(9);
    TS_DP_ROW_C(10); TS_DP_ROW_C(11); TS_DP_ROW_C(12);
  }
  TS_STORE_ROW(0); TS_STORE_ROW(1); TS_STORE_ROW(2); TS_STORE_ROW(3); TS_STORE_ROW(4);
  TS_STORE_ROW(5); TS_STORE_ROW(6); TS_STORE_ROW(7); TS_STORE_ROW(8); TS_STORE_ROW(9);
  TS_STORE_ROW(10); TS_STORE_ROW(11); TS_STORE_ROW(12);
}
#undef TS_DP_ROW_C
#undef TS_DP_ROW
#undef TS_DP_ROWS
#undef TS_STORE_ROW
constexpr int kRows = 12;

// One row (a single decode sequence): memory-bound, so four independent accumulator chains
// keep vdpbf16ps's latency behind the weight stream. On a Xeon with AMX (the builds for one:
// isa.h's TS_AMX) the row also asks for the weights kRowAheadBytes ahead
// into L2 (past a panel's end, the next panel's: they are contiguous): SmolLM2's 121 matmuls
// at M = 1 13.5-13.9 -> 11.0-11.5 ms (4 and 8 KB ahead and prefetcht0 less). On the Zen 5 EPYC a row's prefetches had measured nothing, so
// other builds keep the plain loop.
#ifdef TS_AMX
constexpr int64_t kRowAheadBytes = 16 << 10;
#else
constexpr int64_t kRowAheadBytes = 0;
#endif
inline void row_times_panel(const uint16_t* x, int64_t K, const uint16_t* panel, int64_t kp,
                            const Out& out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  int64_t j = 0;
  for (; j + 1 < K / 2; j += 2) {
    const uint16_t* p = panel + j * 2 * kCols;
    if constexpr (kRowAheadBytes > 0) {  // this pass's 4 lines, kRowAheadBytes on
      const char* a = reinterpret_cast<const char*>(p) + kRowAheadBytes;
      for (int i = 0; i < 4; ++i) _mm_prefetch(a + 64 * i, _MM_HINT_T2);
    }
    uint32_t w[2];
    std::memcpy(w, x + 2 * j, sizeof w);
    const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[0]));
    const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[1]));
    a0 = _mm512_dpbf16_ps(a0, x0, (__m512bh)_mm512_loadu_si512(p));
    a1 = _mm512_dpbf16_ps(a1, x0, (__m512bh)_mm512_loadu_si512(p + kCols));
    b0 = _mm512_dpbf16_ps(b0, x1, (__m512bh)_mm512_loadu_si512(p + 2 * kCols));
    b1 = _mm512_dpbf16_ps(b1, x1, (__m512bh)_mm512_loadu_si512(p + 3 * kCols));
  }
  for (; j < kp; ++j) {
    const uint16_t* p = panel + j * 2 * kCols;
    const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(x, j, K)));
    a0 = _mm512_dpbf16_ps(a0, xs, (__m512bh)_mm512_loadu_si512(p));
    a1 = _mm512_dpbf16_ps(a1, xs, (__m512bh)_mm512_loadu_si512(p + kCols));
  }
  store_row_dp(_mm512_add_ps(a0, b0), _mm512_add_ps(a1, b1), out.y, out.ncols, out.bias,
               out.silu);
}
#else
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));

// The portable tile: per k pair, 32 columns as four 8-wide words split into even / odd k.
template <int R>
inline void tile(const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* panel, int64_t kp,
                 const Out& out, const Ahead&) {
  v8 acc[R][4] = {};
  for (int64_t j = 0; j < kp; ++j) {
    v8 even[4], odd[4];
    for (int q = 0; q < 4; ++q) {
      u8 words;
      std::memcpy(&words, panel + j * 2 * kCols + q * 16, sizeof words);
      const u8 e = words << 16, o = words & 0xffff0000u;
      std::memcpy(&even[q], &e, sizeof e);
      std::memcpy(&odd[q], &o, sizeof o);
    }
    for (int m = 0; m < R; ++m) {
      const uint32_t word = pair_at(x + m * ldx, j, K);
      const float xe = bf16_to_float(static_cast<uint16_t>(word));
      const float xo = bf16_to_float(static_cast<uint16_t>(word >> 16));
      for (int q = 0; q < 4; ++q) acc[m][q] += xe * even[q] + xo * odd[q];
    }
  }
  for (int m = 0; m < R; ++m) {
    float row[kCols];
    std::memcpy(row, acc[m], sizeof row);
    if (out.silu)
      store_silu_mul(row, row + 16, out.y + m * out.ldy);
    else
      store_row(row, out.y + m * out.ldy, out.ncols, out.bias);
  }
}
constexpr int kRows = 3;

inline void row_times_panel(const uint16_t* x, int64_t K, const uint16_t* panel, int64_t kp,
                            const Out& out) {
  tile<1>(x, K, K, panel, kp, out, Ahead{});
}
#endif

// tile<rows> for 1 <= rows <= R
template <int R = kRows>
inline void tiles(int64_t rows, const uint16_t* x, int64_t ldx, int64_t K,
                  const uint16_t* panel, int64_t kp, const Out& out, const Ahead& ahead) {
  if constexpr (R > 1) {
    if (rows < R) {
      tiles<R - 1>(rows, x, ldx, K, panel, kp, out, ahead);
      return;
    }
  }
  tile<R>(x, ldx, K, panel, kp, out, ahead);
}

// rows [0, M) of x against one panel; out.y is row 0's
inline void panel_product(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panel,
                          int64_t kp, const Out& out) {
  if (M == 1) {
    row_times_panel(x, K, panel, kp, out);
    return;
  }
  // Tiles of even height (64 rows: 11, 11, 11, 11, 10, 10, not five of 12 and one of 4, whose
  // 8 accumulator chains cannot hide vdpbf16ps's latency). Each asks for its share of the next
  // panel (the panels are contiguous; past the last one's end, a prefetch of nothing, which
  // never faults).
  const int64_t count = (M + kRows - 1) / kRows, base = M / count, taller = M % count;
  // One tile reads the panel once, at the stream's pace: it asks kPrefetchBytes ahead (a whole
  // panel ahead measured 6 % slower at M = 4).
  const char* here = reinterpret_cast<const char*>(panel);
  if (count == 1) {
    tiles(M, x, K, K, panel, kp, out, Ahead{here + kPrefetchBytes, 0, 2 << 16});
    return;
  }
  const uint64_t lines = static_cast<uint64_t>(kp) * 2 << 16;  // 128 bytes a pair
  const uint64_t rate = lines / count / std::max<int64_t>(K / 2, 1);
  const char* next = here + kp * 2 * kCols * sizeof(uint16_t);
  for (int64_t i = 0, m = 0; i < count; ++i) {
    const int64_t rows = base + (i < taller ? 1 : 0);
    Out rows_out = out;
    rows_out.y += m * out.ldy;
    tiles(rows, x + m * K, K, K, panel, kp, rows_out, Ahead{next, lines / count * i, rate});
    m += rows;
  }
}

}  // namespace tritonserve_panels_bf16
