// bf16 linear layer for the CPU over weights packed once into column panels of k pairs:
//   pack_linear_weight_bf16(weight [N, K] bf16) -> panels [ceil(N / 32), ceil(K / 2), 32, 2]
//     (panels[p, j, c, i] = weight[32 p + c, 2 j + i]; columns past N and k past K are zero)
//   packed_linear_bf16(x [M, K] bf16, panels, N, bias?) -> x @ weight^T (+ bias)  [M, N] bf16
//   packed_linear_silu_mul_bf16(x, panels of a gate/up weight whose rows kernels/cpu/__init__.py's
//     pack_gate_up_bf16 interleaved 16 / 16) -> silu(x @ gate^T) * (x @ up^T)  [M, I] bf16
// The layout is AVX512-BF16's: one 64-byte load holds 16 columns x 2 k, and one vdpbf16ps
// adds x[m, 2j] * w[2j, c] + x[m, 2j + 1] * w[2j + 1, c] to 16 fp32 accumulators (the pair of
// x broadcast as one 32-bit word). A panel (32 columns) is two such loads per k pair. Sums stay
// in fp32 over all of K; the result is rounded to bf16 once (round to nearest even), as
// oneDNN's bf16 inner product does.
// Without AVX512-BF16 (-march=native decides at build time) the same layout runs on GCC
// vectors: a 32-bit word shifted left by 16 is the even k as fp32, masked it is the odd k.
// Why panels and not oneDNN: a decode step reads every weight once; panels stream each
// thread's columns front to back (the fp32 kernel's finding, kernels/cpu/linear.cpp), and an
// op of our own is one torch.compile traces (oneDNN's prepacked tensor is opaque), so bf16
// decodes can run compiled too. Figures: docs/perf-log/2026-cpu-decode.md.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "owned_panels.h"
#include "panels_amx.h"
#include "panels_bf16.h"
#include "vec_math.h"

namespace {

using namespace tritonserve_panels_bf16;

constexpr int64_t kBlockBytes = 256 << 10;  // a block of x rows kept in L2 across the panels

torch::Tensor pack_linear_weight_bf16(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16,
              "pack_linear_weight_bf16: weight must be a bfloat16 [N, K] matrix");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kCols - 1) / kCols, kp = (K + 1) / 2;
  auto padded = torch::zeros({panels * kCols, kp * 2}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [P * 32, kp * 2] -> [P, 32, kp, 2] -> [P, kp, 32, 2]
  return padded.view({panels, kCols, kp, 2}).permute({0, 2, 1, 3}).contiguous();
}

void check_operands(const char* op, const torch::Tensor& x, const torch::Tensor& panels,
                    int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous bfloat16 [M, K] matrix");
  const int64_t kp = (x.size(1) + 1) / 2;
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kCols && panels.size(3) == 2 &&
                  panels.is_contiguous() && panels.scalar_type() == torch::kBFloat16 &&
                  panels.size(1) == kp,
              op, ": panels must come from pack_linear_weight_bf16 with K = x.size(1)");
  TORCH_CHECK(N > (panels.size(0) - 1) * kCols && N <= panels.size(0) * kCols, op,
              ": N does not match the number of panels");
}

// x [M, K] against every panel into y: panel p's output columns start at p * out_cols (32,
// or 16 for the gate/up epilogue), row stride y.size(1).
void run_panels(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                const float* bias, bool silu, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), kp = (K + 1) / 2;
  if (M == 0) return;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t ldy = y.size(1), out_cols = silu ? kCols / 2 : kCols;
  // Rows in blocks of about kBlockBytes of x, each passing over all of this thread's panels
  // while it stays in L2 (as kernels/cpu/linear.cpp does, for the same prefill reason); on
  // AMX tiles, blocks of whole tile pairs, and a last partial tile staged once, padded.
  const bool amx = tritonserve_amx::use(M, K);
  const int64_t unit = amx ? 2 * tritonserve_amx::kTile : kRows;
  const int64_t block = std::max<int64_t>(unit, kBlockBytes / (K * 2) / unit * unit);
  torch::Tensor tail;
  const uint16_t* tail_p = nullptr;
  if (amx && M % tritonserve_amx::kTile != 0) {
    const int64_t full = M / tritonserve_amx::kTile * tritonserve_amx::kTile;
    tail = torch::zeros({tritonserve_amx::kTile, K}, x.options());  // [16, K]
    tail.narrow(0, 0, M - full).copy_(x.narrow(0, full, M - full));
    tail_p = reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>());
  }
  const int64_t panel_elems = kp * 2 * kCols;
  const bool stream = M * ldy * static_cast<int64_t>(sizeof(uint16_t)) > kStreamBytes;
  auto product = [&](int64_t m0, int64_t rows, int64_t p) {
    const int64_t col = p * kCols;
    const Out out{yp + m0 * ldy + p * out_cols, ldy, std::min(kCols, N - col),
                  bias ? bias + col : nullptr, silu, stream};
    tritonserve_amx::panel_product(xp + m0 * K, rows, K, wp + p * panel_elems, kp, out,
                                   m0 + rows == M ? tail_p : nullptr);
  };
  const int64_t P = panels.size(0);
  if (M <= block && at::get_num_threads() > 1) {  // decode batches: one block of rows
    tritonserve_panels::for_each_owned(P, [&](int64_t p) { product(0, M, p); }, [&] {
      if (stream) ts_store_fence();  // isa.h
    });
    return;
  }
  at::parallel_for(0, P, 2, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t rows = std::min(block, M - m0);
      for (int64_t p = p0; p < p1; ++p) product(m0, rows, p);
    }
    if (stream) ts_store_fence();  // isa.h
  });
}

torch::Tensor packed_linear_bf16(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                                 const c10::optional<torch::Tensor>& bias) {
  check_operands("packed_linear_bf16", x, panels, N);
  torch::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "packed_linear_bf16: bias must have N elements");
    bias32 = torch::zeros({panels.size(0) * kCols}, x.options().dtype(torch::kFloat32));
    bias32.narrow(0, 0, N).copy_(bias->reshape({N}));
  }
  auto y = torch::empty({x.size(0), N}, x.options());
  run_panels(x, panels, N, bias32.defined() ? bias32.data_ptr<float>() : nullptr, false, y);
  return y;
}

// x [M, K], panels of pack_gate_up_bf16's layout (panel p: gate columns 16p.. then up's) ->
// silu(x @ gate^T) * (x @ up^T)  [M, I], I = panels * 16.
torch::Tensor packed_linear_silu_mul_bf16(const torch::Tensor& x, const torch::Tensor& panels) {
  const int64_t inter = panels.size(0) * (kCols / 2);
  check_operands("packed_linear_silu_mul_bf16", x, panels, 2 * inter);
  auto y = torch::empty({x.size(0), inter}, x.options());
  run_panels(x, panels, 2 * inter, nullptr, true, y);
  return y;
}

// AMX tiles on or off for every bf16 panel matmul (TRITONSERVE_AMX=0 starts them off); returns
// whether they are in use now (false where the CPU, the OS or the build has none)
bool set_amx(bool on) {
  tritonserve_amx::wanted().store(on);
  return tritonserve_amx::enabled();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("set_amx(bool on) -> bool", &set_amx);
  m.def("amx_enabled() -> bool", &tritonserve_amx::enabled);
  m.def("pack_linear_weight_bf16(Tensor weight) -> Tensor");
  m.def("packed_linear_bf16(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("packed_linear_silu_mul_bf16(Tensor x, Tensor panels) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("pack_linear_weight_bf16", &pack_linear_weight_bf16);
  m.impl("packed_linear_bf16", &packed_linear_bf16);
  m.impl("packed_linear_silu_mul_bf16", &packed_linear_silu_mul_bf16);
}
