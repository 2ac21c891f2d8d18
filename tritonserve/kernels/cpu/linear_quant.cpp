// Weight-only quantized linear layer for the CPU (fp32 or bf16 activations):
//   packed_linear_quant(x [M, K] fp32 or bf16, weight uint8 [ceil(N / 16), K / 32, record
//     bytes], N, bias?) -> x @ dequantized(weight)^T (+ bias)  [M, N] in x's dtype
// The records are panels_quant.h's (u4: GGUF Q4_1 / Q4_0, int4; s8: Q8_0, int8; s8h: Q6_K;
// s8hm: Q5_1, Q5_K and mixed parts), packed by kernels/quant_layout.py; the weights stay
// packed in memory and are widened in registers.
// Why: a decode step reads every weight once, so its time is the bytes read (SmolLM2 in bf16:
// ~270 MB a token; as the GGUF file's Q4_1 / Q8_0 blocks: ~96 MB).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "owned_panels.h"
#include "panels_quant_bf16.h"

namespace {

using namespace tritonserve_panels_quant;

constexpr int64_t kBlockBytes = 256 << 10;

// Decode-sized batches split the panels as linear.cpp does; larger ones take panel ranges,
// each over row blocks of ~256 KB of x kept in L2. product(m0, rows, p) computes one block.
template <typename Product>
void over_panels(int64_t M, int64_t K, int64_t P, int64_t row_bytes, Product&& product) {
  const int64_t block = std::max<int64_t>(kRows, kBlockBytes / (K * row_bytes) / kRows * kRows);
  if (M <= block && at::get_num_threads() > 1) {
    tritonserve_panels::for_each_owned(P, [&](int64_t p) { product(0, M, p); }, [] {});
    return;
  }
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t rows = std::min(block, M - m0);
      for (int64_t p = p0; p < p1; ++p) product(m0, rows, p);
    }
  });
}

torch::Tensor linear_fp32(const torch::Tensor& x, Kind kind, const torch::Tensor& weight,
                          int64_t N, const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), G = weight.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  std::vector<float> sums(M * G);
  group_sums(xp, K, M, K, sums.data());
  const int64_t panel_bytes = G * record_bytes(kind);
  over_panels(M, K, weight.size(0), 4, [&](int64_t m0, int64_t rows, int64_t p) {
    const int64_t col = p * kCols, ncols = std::min(kCols, N - col);
    float* out = yp + m0 * N + col;
    panel_product(kind, xp + m0 * K, rows, K, sums.data() + m0 * G, wp + p * panel_bytes, out,
                  N, ncols);
    if (bias != nullptr)
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = 0; c < ncols; ++c) out[m * N + c] += bias[col + c];
  });
  return y;
}

// bf16 x: the vdpbf16ps tile where the build has it; elsewhere x widened to fp32 and the
// result rounded once (the same rounding of the same sums)
torch::Tensor linear_bf16(const torch::Tensor& x, Kind kind, const torch::Tensor& weight,
                          int64_t N, const float* bias) {
#ifdef TS_AVX512_BF16
  {
    const int64_t M = x.size(0), K = x.size(1), G = weight.size(1);
    auto y = torch::empty({M, N}, x.options());
    if (M == 0) return y;
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    const uint8_t* wp = weight.data_ptr<uint8_t>();
    auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    std::vector<float> sums(M * G);
    group_sums_bf16(xp, K, M, K, sums.data());
    const int64_t panel_bytes = G * record_bytes(kind);
    over_panels(M, K, weight.size(0), 2, [&](int64_t m0, int64_t rows, int64_t p) {
      thread_local std::vector<__m512i> wide;  // std::vector aligns it (C++17)
      if (rows > kRows) wide.resize(std::max<size_t>(wide.size(), wide_words(K)));
      const int64_t col = p * kCols;
      panel_product_bf16(kind, xp + m0 * K, rows, K, sums.data() + m0 * G,
                         wp + p * panel_bytes, yp + m0 * N + col, N,
                         std::min(kCols, N - col), wide.data(),
                         bias ? bias + col : nullptr);
    });
    return y;
  }
#endif
  return linear_fp32(x.to(torch::kFloat32), kind, weight, N, bias).to(torch::kBFloat16);
}

torch::Tensor packed_linear_quant(const torch::Tensor& x, const torch::Tensor& weight, int64_t N,
                                  const c10::optional<torch::Tensor>& bias) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (bf16 || x.scalar_type() == torch::kFloat32) && x.is_contiguous(),
              "packed_linear_quant: x must be a contiguous float32 or bfloat16 [M, K] matrix");
  Kind kind;
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == torch::kUInt8 &&
                  weight.is_contiguous() && kind_of(weight.size(2), kind),
              "packed_linear_quant: weight must be uint8 [P, K / 32, ", kU4Bytes, ", ",
              kS8Bytes, ", ", kS8HBytes, " or ", kS8HMBytes, "] (kernels/quant_layout.py)");
  const int64_t K = x.size(1), G = weight.size(1), P = weight.size(0);
  TORCH_CHECK(K == G * kGroup, "packed_linear_quant: x has K = ", K, ", the weight ", G * kGroup);
  TORCH_CHECK(N > (P - 1) * kCols && N <= P * kCols,
              "packed_linear_quant: N does not match the number of panels");
  torch::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "packed_linear_quant: bias must have N elements");
    bias32 = bias->reshape({N}).to(torch::kFloat32).contiguous();
  }
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  return bf16 ? linear_bf16(x, kind, weight, N, b) : linear_fp32(x, kind, weight, N, b);
}

// The kinds as this build reads them, a row each: id, code bits, record bytes, codes_at,
// scales a group, offset (tests/test_quant_kinds.py holds them to kernels/quant_layout.py)
torch::Tensor quant_kinds() {
  const int64_t n = sizeof(kKinds) / sizeof(kKinds[0]);
  torch::Tensor out = torch::empty({n, 6}, torch::kInt64);
  auto t = out.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n; ++i) {
    const Kind kind = kKinds[i];
    const int64_t row[6] = {static_cast<int64_t>(kind), code_bits(kind), record_bytes(kind),
                            codes_at(kind), halves(kind), has_offset(kind)};
    for (int j = 0; j < 6; ++j) t[i][j] = row[j];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("packed_linear_quant(Tensor x, Tensor weight, int n, Tensor? bias) -> Tensor");
  m.def("quant_kinds() -> Tensor", &quant_kinds);
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("packed_linear_quant", &packed_linear_quant);
}
