// The mixture-of-experts MLP's experts for the CPU, one call a layer:
//   moe_experts(x [T, H] fp32 or bf16, ids [T, k] int64, weights [T, k] fp32,
//               gate_up [E, ...], down [E, ...], I, gate_up_bias [E, 2I]?, down_bias [E, H]?,
//               swiglu_limit, swiglu_alpha) -> [T, H] in x's dtype
// = sum over j of weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), e = ids[t, j]
// Optional, for gpt-oss: fp32 biases added to each expert's gate/up and down, and with
// swiglu_limit > 0 the clamped SwiGLU in place of silu * up (Activation below).
// (kernels/reference.py: fused_moe). gate_up[e] / down[e] is expert e's weight in any form of
// engine/models/linear.py: quantized panels (packed_linear_quant), fp32 or bf16 panels
// (packed_linear, packed_linear_bf16) or plain [N, K].
// The rows are grouped by expert (a counting sort of the T x k choices), so each chosen
// expert's weights are read once a step whatever the batch, and an expert no row chose is not
// read at all: a decode step reads top_k of E experts' bytes at batch 1 (3 of 30 GB for
// Qwen3-30B-A3B). The weighted sum is in fp32, experts in index order (the reference's).
// Why C++: the same loop in Python costs ~6 dispatched ops an expert (~50 us at batch 1 with
// 8 experts a layer: ~10 ms a token over 24 layers). With fp32 activations and quantized or
// fp32-panel experts (Fp32Experts), and with bf16 activations and quantized experts on an
// AVX512-BF16 build (Bf16QuantExperts), the chosen experts' gate/up run in one parallel region
// and their downs in one more; other forms (bf16 activations on bf16 panels) call the matmul
// ops an expert at a time (a bf16 MoE GGUF step dispatched 5,291 ops that way, 1,259 in fp32).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "owned_panels.h"
#include "panels_fp32.h"
#include "panels_quant.h"
#include "panels_quant_bf16.h"

namespace {

// the expert weight bytes the matmuls were given since the last reset (moe_bytes_read): what
// tests/test_moe.py holds to the active experts' bytes
std::atomic<int64_t> g_bytes_read{0};

int64_t moe_bytes_read(bool reset) {
  return reset ? g_bytes_read.exchange(0) : g_bytes_read.load();
}

using LinearOp = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t,
                            const c10::optional<at::Tensor>&);

const c10::TypedOperatorHandle<LinearOp>& linear_op(const char* name) {
  // looked up once each (the handles live as long as the library)
  static std::unordered_map<std::string, c10::TypedOperatorHandle<LinearOp>> ops;
  auto found = ops.find(name);
  if (found == ops.end()) {
    auto handle = c10::Dispatcher::singleton()
                      .findSchemaOrThrow((std::string("tritonserve::") + name).c_str(), "")
                      .typed<LinearOp>();
    found = ops.emplace(name, handle).first;
  }
  return found->second;
}

// x [M, K] @ w^T -> [M, N] in x's dtype, w in one of the forms above
at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  const c10::optional<at::Tensor> none;
  if (w.scalar_type() == torch::kUInt8) return linear_op("packed_linear_quant").call(x, w, N, none);
  if (w.dim() == 2) return at::linear(x, w.to(x.scalar_type()));
  if (w.dim() == 4) return linear_op("packed_linear_bf16").call(x, w, N, none);
  return linear_op("packed_linear").call(x, w, N, none);
}

// The chosen experts' rows, grouped: expert ids[j] takes rows [at[j], at[j + 1]) of the
// gathered matrices
struct Groups {
  std::vector<int64_t> expert, at;
  int64_t rows() const { return at.back(); }
};

// An expert's activation of one row's gate/up h [2I] (gate then up) into act [I], its gate/up
// bias (nullptr: none) added first: silu(gate) * up, or with limit > 0 gpt-oss's clamped
// SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
// (transformers' GptOssExperts._apply_gate).
struct Activation {
  float limit, alpha;

  void operator()(const float* h, const float* bias, int64_t inter, float* act) const {
    for (int64_t c = 0; c < inter; ++c) {
      float gate = h[c], up = h[inter + c];
      if (bias != nullptr) gate += bias[c], up += bias[inter + c];
      if (limit > 0.f) {
        gate = std::min(gate, limit);
        up = std::min(std::max(up, -limit), limit);
        act[c] = (up + 1.f) * gate / (1.f + std::exp(-alpha * gate));
      } else {
        act[c] = gate / (1.f + std::exp(-gate)) * up;
      }
    }
  }
};

// fp32 x and quantized or fp32-panel experts: every chosen expert's gate/up in one parallel
// region (its panels split over the threads as one matmul's are: owned_panels.h), silu * up,
// then every expert's down in one more, instead of two regions an expert. One stacked kind a
// projection (all experts of a layer are packed alike).
struct Fp32Experts {
  const at::Tensor& gate_up;
  const at::Tensor& down;
  int64_t inter, hidden;
  const float* gate_up_bias;  // [E, 2I] or nullptr
  const float* down_bias;     // [E, H] or nullptr
  Activation activation;

  bool quant() const { return gate_up.scalar_type() == torch::kUInt8; }

  // y [R, N] = x [R, K] @ w[e]^T for every group, the weights `stacked` [E, ...]
  void product(const Groups& g, const float* x, int64_t K, const at::Tensor& stacked,
               int64_t N, float* y) const {
    using namespace tritonserve_panels_quant;
    const int64_t panels = (N + kCols - 1) / kCols, n_groups = g.expert.size();
    std::vector<float> sums;
    Kind kind = Kind::kU4;
    const bool q = quant();
    if (q) {
      TORCH_CHECK(kind_of(stacked.size(3), kind), "moe_experts: unknown quantized kind");
      sums.resize(g.rows() * (K / kGroup));
      group_sums(x, K, g.rows(), K, sums.data());
    }
    const int64_t expert_bytes = stacked[0].nbytes();
    const uint8_t* base = static_cast<const uint8_t*>(stacked.data_ptr());
    const int64_t panel_bytes = expert_bytes / stacked.size(1);
    tritonserve_panels::for_each_owned(n_groups * panels, [&](int64_t item) {
      const int64_t j = item / panels, p = item % panels;
      const int64_t r0 = g.at[j], rows = g.at[j + 1] - r0;
      const uint8_t* panel = base + g.expert[j] * expert_bytes + p * panel_bytes;
      const int64_t col = p * kCols, ncols = std::min<int64_t>(kCols, N - col);
      if (q)
        panel_product(kind, x + r0 * K, rows, K, sums.data() + r0 * (K / kGroup), panel,
                      y + r0 * N + col, N, ncols);
      else
        tritonserve_panels_fp32::panel_product(x + r0 * K, rows, K,
                                               reinterpret_cast<const float*>(panel),
                                               y + r0 * N + col, N, ncols);
    }, [] {});
  }

  // [R, H] expert outputs of the gathered rows xg [R, H]
  std::vector<float> run(const Groups& g, const float* xg) const {
    const int64_t R = g.rows();
    std::vector<float> h(R * 2 * inter), act(R * inter), y(R * hidden);
    product(g, xg, hidden, gate_up, 2 * inter, h.data());
    for (size_t j = 0; j < g.expert.size(); ++j) {
      const int64_t e = g.expert[j];
      for (int64_t r = g.at[j]; r < g.at[j + 1]; ++r)
        activation(h.data() + r * 2 * inter,
                   gate_up_bias != nullptr ? gate_up_bias + e * 2 * inter : nullptr, inter,
                   act.data() + r * inter);
    }
    product(g, act.data(), inter, down, hidden, y.data());
    if (down_bias != nullptr)
      for (size_t j = 0; j < g.expert.size(); ++j)
        for (int64_t r = g.at[j]; r < g.at[j + 1]; ++r)
          for (int64_t c = 0; c < hidden; ++c)
            y[r * hidden + c] += down_bias[g.expert[j] * hidden + c];
    return y;
  }
};

#ifdef TS_AVX512_BF16
// bf16 x and quantized experts: Fp32Experts' two regions on the vdpbf16ps tile
// (panels_quant_bf16.h), gate/up and down out in bf16 as packed_linear_quant rounds them,
// the activation in fp32 from the rounded gate/up, rounded once to bf16 for the down.
struct Bf16QuantExperts {
  const at::Tensor& gate_up;
  const at::Tensor& down;
  int64_t inter, hidden;
  const float* gate_up_bias;
  Activation activation;

  void product(const Groups& g, const uint16_t* x, int64_t K, const at::Tensor& stacked,
               int64_t N, uint16_t* y) const {
    using namespace tritonserve_panels_quant;
    const int64_t panels = (N + kCols - 1) / kCols, n_groups = g.expert.size();
    Kind kind = Kind::kU4;
    TORCH_CHECK(kind_of(stacked.size(3), kind), "moe_experts: unknown quantized kind");
    std::vector<float> sums(g.rows() * (K / kGroup));
    group_sums_bf16(x, K, g.rows(), K, sums.data());
    const int64_t expert_bytes = stacked[0].nbytes();
    const uint8_t* base = static_cast<const uint8_t*>(stacked.data_ptr());
    const int64_t panel_bytes = expert_bytes / stacked.size(1);
    tritonserve_panels::for_each_owned(n_groups * panels, [&](int64_t item) {
      const int64_t j = item / panels, p = item % panels;
      const int64_t r0 = g.at[j], rows = g.at[j + 1] - r0;
      thread_local std::vector<Wide> wide;  // past one tile of rows (std::vector aligns it)
      if (rows > kRows) wide.resize(std::max<size_t>(wide.size(), wide_words(K)));
      const int64_t col = p * kCols;
      panel_product_bf16(kind, x + r0 * K, rows, K, sums.data() + r0 * (K / kGroup),
                         base + g.expert[j] * expert_bytes + p * panel_bytes, y + r0 * N + col,
                         N, std::min<int64_t>(kCols, N - col), wide.data(), nullptr);
    }, [] {});
  }

  // [R, H] expert outputs (bf16) of the gathered bf16 rows xg [R, H]
  std::vector<uint16_t> run(const Groups& g, const uint16_t* xg) const {
    const int64_t R = g.rows();
    std::vector<uint16_t> h(R * 2 * inter), act(R * inter), y(R * hidden);
    product(g, xg, hidden, gate_up, 2 * inter, h.data());
    std::vector<float> hf(2 * inter), row(inter);
    for (size_t j = 0; j < g.expert.size(); ++j) {
      const int64_t e = g.expert[j];
      for (int64_t r = g.at[j]; r < g.at[j + 1]; ++r) {
        for (int64_t c = 0; c < 2 * inter; ++c)
          hf[c] = static_cast<float>(c10::BFloat16(h[r * 2 * inter + c], c10::BFloat16::from_bits()));
        activation(hf.data(), gate_up_bias != nullptr ? gate_up_bias + e * 2 * inter : nullptr,
                   inter, row.data());
        for (int64_t c = 0; c < inter; ++c) act[r * inter + c] = c10::BFloat16(row[c]).x;
      }
    }
    product(g, act.data(), inter, down, hidden, y.data());
    return y;
  }
};
#endif

// the forms Fp32Experts runs: quantized panels [E, P, G, record] or fp32 panels [E, P, K, 16]
bool batched_form(const at::Tensor& x, const at::Tensor& w, int64_t K) {
  if (x.scalar_type() != torch::kFloat32 || !w.is_contiguous()) return false;
  if (w.scalar_type() == torch::kUInt8)
    return w.dim() == 4 && w.size(2) * tritonserve_panels_quant::kGroup == K;
  return w.scalar_type() == torch::kFloat32 && w.dim() == 4 && w.size(2) == K &&
         w.size(3) == tritonserve_panels_fp32::kPanel;
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down, int64_t inter,
                       const c10::optional<at::Tensor>& gate_up_bias,
                       const c10::optional<at::Tensor>& down_bias, double swiglu_limit,
                       double swiglu_alpha) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16),
              "moe_experts: x must be a contiguous float32 or bfloat16 [T, H] matrix");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == torch::kInt64,
              "moe_experts: ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat32,
              "moe_experts: weights must be float32 [T, k]");
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = gate_up.size(0);
  TORCH_CHECK(down.size(0) == E, "moe_experts: gate_up and down hold different expert counts");
  // the biases in fp32, contiguous (a no-op for the engine's, stored so at load)
  auto fp32 = [&](const c10::optional<at::Tensor>& b, int64_t cols, const char* name) {
    if (!b.has_value() || !b->defined()) return at::Tensor();
    TORCH_CHECK(b->dim() == 2 && b->size(0) == E && b->size(1) == cols, "moe_experts: ", name,
                " must be [", E, ", ", cols, "]");
    return b->to(torch::kFloat32).contiguous();
  };
  const at::Tensor gu_b = fp32(gate_up_bias, 2 * inter, "gate_up_bias");
  const at::Tensor d_b = fp32(down_bias, H, "down_bias");
  const float* gu_bp = gu_b.defined() ? gu_b.data_ptr<float>() : nullptr;
  const float* d_bp = d_b.defined() ? d_b.data_ptr<float>() : nullptr;
  const Activation activation{static_cast<float>(swiglu_limit),
                              static_cast<float>(swiglu_alpha)};
  auto out = torch::zeros({T, H}, x.options().dtype(torch::kFloat32));
  if (T == 0) return out.to(x.scalar_type());
  const auto ids_c = ids.contiguous();
  const auto w_c = weights.contiguous();
  const int64_t* idp = ids_c.data_ptr<int64_t>();
  const float* wp = w_c.data_ptr<float>();
  // counting sort of the T * k choices by expert: start[e] .. start[e + 1] in `order`
  std::vector<int64_t> start(E + 1, 0), order(T * k);
  for (int64_t i = 0; i < T * k; ++i) {
    TORCH_CHECK(idp[i] >= 0 && idp[i] < E, "moe_experts: expert id ", idp[i], " out of [0, ",
                E, ")");
    ++start[idp[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < T * k; ++i) order[fill[idp[i]]++] = i;
  float* op = out.data_ptr<float>();
  // the batched forms' chosen experts (their bytes counted) and gathered rows: row i of the
  // grouped matrix is choice order[i]'s token
  const auto grouped = [&] {
    Groups g;
    g.at.push_back(0);
    for (int64_t e = 0; e < E; ++e)
      if (start[e + 1] > start[e]) {
        g.expert.push_back(e);
        g.at.push_back(g.at.back() + start[e + 1] - start[e]);
        g_bytes_read += gate_up[e].nbytes() + down[e].nbytes();
      }
    return g;
  };
  const auto gathered = [&](const auto* xp) {
    std::vector<std::remove_const_t<std::remove_pointer_t<decltype(xp)>>> xg(T * k * H);
    for (int64_t i = 0; i < T * k; ++i)
      std::memcpy(xg.data() + i * H, xp + order[i] / k * H, H * sizeof(xg[0]));
    return xg;
  };
  if (batched_form(x, gate_up, H) && batched_form(x, down, inter) &&
      gate_up.scalar_type() == down.scalar_type()) {
    const Groups g = grouped();
    const auto xg = gathered(x.data_ptr<float>());
    const auto y = Fp32Experts{gate_up, down, inter, H, gu_bp, d_bp, activation}.run(
        g, xg.data());
    for (int64_t i = 0; i < T * k; ++i) {  // experts in index order, as the reference sums
      const float w = wp[order[i]];
      float* dst = op + order[i] / k * H;
      const float* src = y.data() + i * H;
      for (int64_t c = 0; c < H; ++c) dst[c] += w * src[c];
    }
    return out;
  }
#ifdef TS_AVX512_BF16
  const auto quant_form = [&](const at::Tensor& w, int64_t K) {
    return w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 4 &&
           w.size(2) * tritonserve_panels_quant::kGroup == K;
  };
  if (x.scalar_type() == torch::kBFloat16 && quant_form(gate_up, H) && quant_form(down, inter)) {
    const Groups g = grouped();
    const auto xg = gathered(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()));
    const auto y = Bf16QuantExperts{gate_up, down, inter, H, gu_bp, activation}.run(
        g, xg.data());
    for (int64_t i = 0; i < T * k; ++i) {  // experts in index order, as the reference sums
      const float w = wp[order[i]];
      float* dst = op + order[i] / k * H;
      const uint16_t* src = y.data() + i * H;
      const int64_t e = g.expert[std::upper_bound(g.at.begin(), g.at.end(), i) - g.at.begin() - 1];
      const float* bias = d_bp != nullptr ? d_bp + e * H : nullptr;  // added in the sum
      for (int64_t c = 0; c < H; ++c) {
        const float v = static_cast<float>(c10::BFloat16(src[c], c10::BFloat16::from_bits()));
        dst[c] += w * (bias != nullptr ? v + bias[c] : v);
      }
    }
    return out.to(x.scalar_type());
  }
#endif
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    auto rows = torch::empty({n}, torch::kInt64);
    int64_t* rp = rows.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) rp[r] = order[start[e] + r] / k;
    g_bytes_read += gate_up[e].nbytes() + down[e].nbytes();
    const at::Tensor xe = n == T && T == 1 ? x : x.index_select(0, rows);
    const at::Tensor h = expert_linear(xe, gate_up[e], 2 * inter);
    at::Tensor act;
    if (gu_bp == nullptr && activation.limit <= 0.f) {
      act = at::silu(h.narrow(1, 0, inter)) * h.narrow(1, inter, inter);
    } else {  // in fp32, each row rounded once into the matmul's dtype
      const at::Tensor hf = h.to(torch::kFloat32).contiguous();
      const float* hp = hf.data_ptr<float>();
      act = torch::empty({n, inter}, h.options());
      std::vector<float> row(inter);
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, act.scalar_type(), "moe_act", [&] {
        scalar_t* ap = act.data_ptr<scalar_t>();
        for (int64_t r = 0; r < n; ++r) {
          activation(hp + r * 2 * inter, gu_bp != nullptr ? gu_bp + e * 2 * inter : nullptr,
                     inter, row.data());
          for (int64_t c = 0; c < inter; ++c) ap[r * inter + c] = static_cast<scalar_t>(row[c]);
        }
      });
    }
    const at::Tensor y = expert_linear(act.contiguous(), down[e], H).to(torch::kFloat32)
                             .contiguous();
    const float* yp = y.data_ptr<float>();
    const float* bias = d_bp != nullptr ? d_bp + e * H : nullptr;  // added in the sum
    for (int64_t r = 0; r < n; ++r) {
      const float w = wp[order[start[e] + r]];
      float* dst = op + rp[r] * H;
      const float* src = yp + r * H;
      if (bias != nullptr)
        for (int64_t c = 0; c < H; ++c) dst[c] += w * (src[c] + bias[c]);
      else
        for (int64_t c = 0; c < H; ++c) dst[c] += w * src[c];
    }
  }
  return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, Tensor down, "
        "int inter, Tensor? gate_up_bias=None, Tensor? down_bias=None, "
        "float swiglu_limit=0.0, float swiglu_alpha=1.702) -> Tensor");
  m.def("moe_bytes_read(bool reset) -> int", &moe_bytes_read);
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("moe_experts", &moe_experts);
}
