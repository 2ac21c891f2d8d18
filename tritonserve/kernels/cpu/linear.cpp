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
// 171-180 ms; M = 128-1024 even; M = 2048 (prefill) 3.6-3.8 s vs 2.9-3.3 s
// (docs/perf-log/2026-cpu-decode.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "owned_panels.h"
#include "panels_fp32.h"

namespace {

using namespace tritonserve_panels_fp32;

constexpr int64_t kBlockBytes = 256 << 10;  // a block of x rows kept in L2 across the panels

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
