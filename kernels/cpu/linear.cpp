// fp32 linear layer for the CPU over weights packed once into column panels:
//   pack_linear_weight(weight [N, K]) -> panels [ceil(N / 16), K, 16] (rows past N are zero)
//   packed_linear(x [M, K], panels, N, bias?) -> x @ weight^T (+ bias)  [M, N]
// A panel holds 16 output columns for every k, contiguous: each thread streams its panels
// front to back once, and the inner step is y[m, 16 cols] += x[m, k] * panel[k, 0:16] (a
// broadcast and two 8-wide FMAs per row: no horizontal sums, any K). A tile of up to 6 rows
// keeps 12 accumulators in registers; K is taken 256 at a time so the panel slice (16 KB)
// stays in L1 while every row tile of a block passes over it; rows come in blocks of ~256 KB
// of x, each kept in L2 while it passes over all of the thread's panels.
// Why not oneDNN: on this AMD EPYC (AVX2, 2 threads), SmolLM2's 121 decode matmuls, weights
// cold (538 MB): oneDNN-prepacked 43-63 ms at M = 1 (8.6-12.5 GB/s of an 18 GB/s read),
// these panels 28.5-29.5 ms (18.3-18.8 GB/s); M = 16: 78-94 vs 62-75 ms; M = 64: 191-207 vs
// 171-180 ms; M = 128-1024 even; M = 2048 (prefill) 3.6-3.8 s vs 2.9-3.3 s (docs/benchmarks.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "owned_panels.h"

namespace {

typedef float v8 __attribute__((vector_size(32)));  // GCC/Clang vectors: AVX, NEON, or scalar

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kChunk = 256;  // k per pass over a panel (16 x 256 x 4 B = 16 KB)
constexpr int kRows = 6;  // rows per register tile: 12 accumulators + 2 panel loads
constexpr int64_t kBlockBytes = 256 << 10;  // a block of x rows kept in L2 across the panels
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
void panel_product(const float* x, int64_t M, int64_t K, const float* panel, float* y,
                   int64_t N, int64_t ncols) {
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

torch::Tensor pack_linear_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32,
              "pack_linear_weight: weight must be a float32 [N, K] matrix");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "packed_linear: x must be a contiguous float32 [M, K] matrix");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.scalar_type() == torch::kFloat32 && panels.size(1) == x.size(1),
              "packed_linear: panels must come from pack_linear_weight with K = x.size(1)");
  TORCH_CHECK(N > (panels.size(0) - 1) * kPanel && N <= panels.size(0) * kPanel,
              "packed_linear: N does not match the number of panels");
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == torch::kFloat32 &&
                    bias->is_contiguous(), "packed_linear: bias must be float32 [N]");
    bias_ptr = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows in blocks of about kBlockBytes of x: each block passes over all of this thread's
  // panels while it stays in L2 (all M rows per panel re-read x from L3 for every panel:
  // SmolLM2's prefill matmuls at M = 2048 ran 4.1-5.0 s unblocked vs oneDNN's 3.2-3.5 s).
  const int64_t block = std::max<int64_t>(kRows, kBlockBytes / (K * 4) / kRows * kRows);
  auto product = [&](int64_t m0, int64_t rows, int64_t p) {
    const int64_t col = p * kPanel, ncols = std::min(kPanel, N - col);
    float* out = yp + m0 * N + col;
    panel_product(xp + m0 * K, rows, K, wp + p * K * kPanel, out, N, ncols);
    if (bias_ptr != nullptr)
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = 0; c < ncols; ++c) out[m * N + c] += bias_ptr[col + c];
  };
  if (M <= block && at::get_num_threads() > 1) {  // decode batches: one block of rows
    tritonserve_panels::for_each_owned(panels.size(0), [&](int64_t p) { product(0, M, p); },
                                       [] {});
    return y;
  }
  at::parallel_for(0, panels.size(0), 4, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t rows = std::min(block, M - m0);
      for (int64_t p = p0; p < p1; ++p) product(m0, rows, p);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
}
