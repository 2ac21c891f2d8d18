// The fp32 column-panel matmul kernels over pack_linear_weight's layout ([ceil(N / 16), K,
// 16]): rows of x against one panel of 16 output columns. Shared by linear.cpp (the matmul
// op) and decode_layers.cpp (the whole decode stack in fp32). The layout, and why panels:
// linear.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tritonserve_panels_fp32 {

typedef float v8 __attribute__((vector_size(32)));  // GCC/Clang vectors: AVX, NEON, or scalar

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kChunk = 256;  // k per pass over a panel (16 x 256 x 4 B = 16 KB)
constexpr int kRows = 6;  // rows per register tile: 12 accumulators + 2 panel loads
// At most this many rows, the first row tile prefetches the weight stream one chunk (16 KB)
// ahead: the hardware prefetcher alone overlapped the weight read and the FMAs poorly (M = 16
// took about read time + compute time). SmolLM2's matmuls, weights cold, interleaved A/B in
// both orders: M = 4 12-19 % faster, M = 16 6-7 %; past 16 rows (the panel chunk re-read from
// L1 by several tiles) prefetching made M = 32-128 4-15 % slower in any tile, so none there.
constexpr int64_t kPrefetchRows = 16;

inline v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// Rows [0, R) of x (row stride ldx) times panel rows [0, kc): y[m, 0:ncols] = (or +=) the
// products. ncols < 16 only in the last panel.
// Prefetch: one cache line of `ahead` per k (the rate the panel is read at). A template
// argument: a run-time check in this loop (or a switch per tile) cost M = 32-64 2-22 %.
template <int R, bool Prefetch>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y,
                 int64_t ldy, int64_t ncols, bool accumulate, const float* ahead) {
  v8 lo[R] = {}, hi[R] = {};
  if (accumulate) {
    for (int m = 0; m < R; ++m) {
      float row[kPanel] = {};
      std::memcpy(row, y + m * ldy, ncols * sizeof(float));
      lo[m] = load8(row);
      hi[m] = load8(row + 8);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (Prefetch) __builtin_prefetch(ahead + k * kPanel, 0, 3);
    const v8 w0 = load8(panel + k * kPanel), w1 = load8(panel + k * kPanel + 8);
    for (int m = 0; m < R; ++m) {
      const float xs = x[m * ldx + k];
      lo[m] += xs * w0;
      hi[m] += xs * w1;
    }
  }
  for (int m = 0; m < R; ++m) {
    float row[kPanel];
    store8(row, lo[m]);
    store8(row + 8, hi[m]);
    std::memcpy(y + m * ldy, row, ncols * sizeof(float));
  }
}

// One row (a single decode sequence): the whole K in one pass with two independent chains
// per half-panel, so FMA latency hides behind the weight stream (memory-bound here).
inline void row_times_panel(const float* x, const float* panel, int64_t K, float* y,
                            int64_t ncols) {
  v8 a0 = {}, a1 = {}, b0 = {}, b1 = {};
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const float* p = panel + k * kPanel;
    a0 += x[k] * load8(p);
    a1 += x[k] * load8(p + 8);
    b0 += x[k + 1] * load8(p + kPanel);
    b1 += x[k + 1] * load8(p + kPanel + 8);
  }
  if (k < K) {
    a0 += x[k] * load8(panel + k * kPanel);
    a1 += x[k] * load8(panel + k * kPanel + 8);
  }
  float row[kPanel];
  store8(row, a0 + b0);
  store8(row + 8, a1 + b1);
  std::memcpy(y, row, ncols * sizeof(float));
}

// tile<rows> for 1 <= rows <= kRows
template <bool Prefetch>
inline void tiles(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t kc,
                  float* y, int64_t ldy, int64_t ncols, bool accumulate, const float* ahead) {
  switch (rows) {
    case 1: tile<1, Prefetch>(x, ldx, panel, kc, y, ldy, ncols, accumulate, ahead); break;
    case 2: tile<2, Prefetch>(x, ldx, panel, kc, y, ldy, ncols, accumulate, ahead); break;
    case 3: tile<3, Prefetch>(x, ldx, panel, kc, y, ldy, ncols, accumulate, ahead); break;
    case 4: tile<4, Prefetch>(x, ldx, panel, kc, y, ldy, ncols, accumulate, ahead); break;
    case 5: tile<5, Prefetch>(x, ldx, panel, kc, y, ldy, ncols, accumulate, ahead); break;
    default: tile<kRows, Prefetch>(x, ldx, panel, kc, y, ldy, ncols, accumulate, ahead);
  }
}

// rows [0, M) of x against one panel, all of K
inline void panel_product(const float* x, int64_t M, int64_t K, const float* panel,
                          float* y, int64_t N, int64_t ncols) {
  if (M == 1) {
    row_times_panel(x, panel, K, y, ncols);
    return;
  }
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, K - k0);
    const float* chunk = panel + k0 * kPanel;
    const bool accumulate = k0 > 0;
    int64_t m = 0;
    if (M <= kPrefetchRows) {  // the first tile prefetches the next chunk of the stream (the
      // panels are contiguous: it may lie in the next panel)
      m = std::min<int64_t>(M, kRows);
      tiles<true>(m, x + k0, K, chunk, kc, y, N, ncols, accumulate, chunk + kChunk * kPanel);
    }
    for (; m + kRows <= M; m += kRows)
      tile<kRows, false>(x + m * K + k0, K, chunk, kc, y + m * N, N, ncols, accumulate, nullptr);
    if (m < M)
      tiles<false>(M - m, x + m * K + k0, K, chunk, kc, y + m * N, N, ncols, accumulate, nullptr);
  }
}

}  // namespace tritonserve_panels_fp32
