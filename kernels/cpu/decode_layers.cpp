// A decode step's whole decoder stack in one parallel region (CPU, bf16, AVX512-BF16):
//   decode_layers_bf16(x [M, H] (the embedded tokens), norms [2L] (each layer's input and
//     post-attention RMSNorm weights, [H]), panels [4L] (qkv, o, gate/up in
//     pack_gate_up_bf16's layout, down: pack_linear_weight_bf16's panels), biases [L] (the qkv
//     bias, [Hq + 2 Hk] D, or none at all: an empty list), cos, sin [M, 1, D] (the step's rope
//     lookup), slot_mapping [M] int64, k_caches!, v_caches! [L] ([blocks, block, Hk, D]),
//     block_tables [M, W] int32, seq_lens [M] int32 (context lengths with the new token),
//     num_heads, eps, scale) -> (x, residual) [M, H]: the last layer's MLP output and the
//     residual stream before it (the final norm is the caller's).
// Per layer, the op-by-op step's work with its roundings: residual += x and the input norm;
// qkv (+ bias); for each (sequence, KV heads) item, q and k rotated, k and v written at the
// sequence's slot, then its decode attention (paged_decode_bf16.h, streaming schedule); o;
// the post-attention add + norm; gate/up with silu(gate) * up in the epilogue; down.
// The threads meet at four barriers a layer. The norms run on every thread for all M rows
// (each keeps its own copy of the residual and of the normed rows), so they need none; the
// rope and the K/V write belong to the attention item that reads them, so they need none
// either. The matmuls split their panels as kernels/cpu/owned_panels.h does.
// Why: op by op a decode step is ~150 op calls and ~90 Inductor kernels, each an OpenMP
// region and a trip through Python and the dispatcher, during which the weight stream stops:
// SmolLM2's 121 matmuls at batch 1 took 7.34 ms called one by one and 6.59 ms in one region
// (a plain read of the same bytes: 6.43 ms; docs/benchmarks.md, nineteenth session).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "owned_panels.h"
#include "paged_decode_bf16.h"
#include "panels_bf16.h"
#include "rows.h"

namespace {

using tritonserve_panels::Owned;
using tritonserve_panels::take;

#if defined(TS_DPBF16) && defined(TRITONSERVE_DECODE_BF16) && defined(TS_BF16_ROWS)
#define TS_DECODE_LAYERS 1
#endif

// Whether this build runs the op for these shapes (the attention has instances for head
// sizes 64 and 128, groups up to 8, pages of a multiple of 16 slots).
bool decode_layers_bf16_supported(int64_t head_dim, int64_t group, int64_t block_size) {
#ifdef TS_DECODE_LAYERS
  return tritonserve_decode_bf16::pick(head_dim, group, block_size, false) != nullptr;
#else
  (void)head_dim, (void)group, (void)block_size;
  return false;
#endif
}

#ifdef TS_DECODE_LAYERS
using bf16 = c10::BFloat16;
using tritonserve_panels_bf16::kCols;
using tritonserve_panels_bf16::Out;
using tritonserve_panels_bf16::panel_product;

inline const uint16_t* u16(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}
inline uint16_t* u16(torch::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}
inline bf16* as_bf16(uint16_t* p) { return reinterpret_cast<bf16*>(p); }
inline const bf16* as_bf16(const uint16_t* p) { return reinterpret_cast<const bf16*>(p); }

// One matmul of the stack: P panels of a K-wide input's weight with N outputs, an fp32 bias
// (padded to P * 32) or none; silu: the gate/up epilogue (16 outputs a panel, not 32).
struct Matmul {
  const uint16_t* w;
  int64_t K, N, P;
  const float* bias;
  bool silu;
};
#endif

std::tuple<torch::Tensor, torch::Tensor> decode_layers_bf16(
    const torch::Tensor& x, const std::vector<torch::Tensor>& norms,
    const std::vector<torch::Tensor>& panels, const std::vector<torch::Tensor>& biases,
    const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slot_mapping,
    std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
    const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t num_heads,
    double eps, double scale) {
#ifndef TS_DECODE_LAYERS
  TORCH_CHECK(false, "decode_layers_bf16: this build has no AVX512-BF16 kernels");
#else
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L >= 1 && v_caches.size() == static_cast<size_t>(L) &&
                  norms.size() == static_cast<size_t>(2 * L) &&
                  panels.size() == static_cast<size_t>(4 * L) &&
                  (biases.empty() || biases.size() == static_cast<size_t>(L)),
              "decode_layers_bf16: L caches each of k and v, 2L norms, 4L panels, L or 0 biases");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "decode_layers_bf16: x must be a contiguous bfloat16 [M, H] matrix");
  const int64_t M = x.size(0), H = x.size(1);
  const auto& k0 = k_caches[0];
  TORCH_CHECK(k0.dim() == 4 && k0.scalar_type() == torch::kBFloat16,
              "decode_layers_bf16: caches must be bfloat16 [blocks, block_size, kv_heads, D]");
  const int64_t block_size = k0.size(1), kv_heads = k0.size(2), D = k0.size(3);
  const int64_t slots = k0.size(0) * block_size;
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(k_caches[l].sizes() == k0.sizes() && v_caches[l].sizes() == k0.sizes() &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == torch::kBFloat16 &&
                    v_caches[l].scalar_type() == torch::kBFloat16,
                "decode_layers_bf16: every layer's caches must be contiguous bfloat16, one shape");
  TORCH_CHECK(num_heads >= 1 && num_heads % kv_heads == 0,
              "decode_layers_bf16: num_heads must be a multiple of the caches' kv_heads");
  const int64_t group = num_heads / kv_heads;
  auto attend = tritonserve_decode_bf16::pick(D, group, block_size, false);
  TORCH_CHECK(attend != nullptr, "decode_layers_bf16: no attention instance for head size ", D,
              ", group ", group, ", block size ", block_size);
  const int64_t q_size = num_heads * D, kv_size = kv_heads * D, qkv_n = q_size + 2 * kv_size;
  TORCH_CHECK(cos.numel() == M * D && sin.numel() == M * D &&
                  cos.scalar_type() == torch::kBFloat16 && sin.scalar_type() == torch::kBFloat16,
              "decode_layers_bf16: cos and sin must be bfloat16 [M, 1, D]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == M &&
                  slot_mapping.scalar_type() == torch::kInt64,
              "decode_layers_bf16: slot_mapping must be int64 [M]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == M &&
                  block_tables.scalar_type() == torch::kInt32 && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == M && seq_lens.scalar_type() == torch::kInt32,
              "decode_layers_bf16: block_tables int32 [M, W] and seq_lens int32 [M]");
  auto slot = slot_mapping.contiguous(), tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t* slot_ptr = slot.data_ptr<int64_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int64_t width = tables.size(1);
  for (int64_t b = 0; b < M; ++b) {  // before any write: bad metadata changes nothing
    TORCH_CHECK(slot_ptr[b] >= 0 && slot_ptr[b] < slots, "decode_layers_bf16: slot ",
                slot_ptr[b], " out of range [0, ", slots, ")");
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= width * block_size,
                "decode_layers_bf16: seq_len ", len_ptr[b], " out of range [1, ",
                width * block_size, "]");
  }
  const int64_t inter = panels[2].size(0) * (kCols / 2);
  std::vector<Matmul> mm(4 * L);
  std::vector<torch::Tensor> bias32(L);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t in[4] = {H, q_size, H, inter}, out[4] = {qkv_n, H, 2 * inter, H};
    for (int i = 0; i < 4; ++i) {
      const auto& p = panels[4 * l + i];
      TORCH_CHECK(p.dim() == 4 && p.size(2) == kCols && p.size(3) == 2 && p.is_contiguous() &&
                      p.scalar_type() == torch::kBFloat16 && p.size(1) == (in[i] + 1) / 2 &&
                      out[i] > (p.size(0) - 1) * kCols && out[i] <= p.size(0) * kCols,
                  "decode_layers_bf16: panels[", 4 * l + i, "] do not fit the layer's shapes");
      mm[4 * l + i] = Matmul{u16(p), in[i], out[i], p.size(0), nullptr, i == 2};
    }
    for (int i = 0; i < 2; ++i)
      TORCH_CHECK(norms[2 * l + i].numel() == H && norms[2 * l + i].is_contiguous() &&
                      norms[2 * l + i].scalar_type() == torch::kBFloat16,
                  "decode_layers_bf16: norms[", 2 * l + i, "] must be bfloat16 [H]");
    if (!biases.empty()) {
      TORCH_CHECK(biases[l].numel() == qkv_n, "decode_layers_bf16: biases[", l, "] must be [",
                  qkv_n, "]");
      bias32[l] = torch::zeros({mm[4 * l].P * kCols}, x.options().dtype(torch::kFloat32));
      bias32[l].narrow(0, 0, qkv_n).copy_(biases[l].reshape({qkv_n}));
      mm[4 * l].bias = bias32[l].data_ptr<float>();
    }
  }
  auto c = cos.contiguous(), s = sin.contiguous();
  const bf16* cos_ptr = as_bf16(u16(c));
  const bf16* sin_ptr = as_bf16(u16(s));

  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), 64));
  auto opts = x.options();
  auto xs = x.clone();                           // [M, H]: the stream's input, then down's output
  auto qkv = torch::empty({M, qkv_n}, opts);     // [M, (Hq + 2 Hk) D]
  auto q = torch::empty({M, q_size}, opts);      // [M, Hq D] rotated
  auto att = torch::empty({M, q_size}, opts);    // [M, Hq D]
  auto o = torch::empty({M, H}, opts);           // [M, H]
  auto act = torch::empty({M, inter}, opts);     // [M, I]
  auto res = torch::zeros({T, M, H}, opts);      // each thread's residual stream
  auto normed = torch::empty({T, M, H}, opts);   // each thread's normed rows
  // the panels of matmul i, thread t: owned[i * T + t] (owned_panels.h's spans)
  std::unique_ptr<Owned[]> owned(new Owned[4 * L * T]);
  for (int64_t i = 0; i < 4 * L; ++i)
    for (int64_t t = 0; t < T; ++t)
      owned[i * T + t].span.store(static_cast<uint64_t>((t + 1) * mm[i].P / T) << 32 |
                                  static_cast<uint64_t>(t * mm[i].P / T));
  // attention items as paged_decode.cpp makes them: whole sequences when there are enough to
  // go round, else one per KV head; longest first, claimed in turn (a counter a layer)
  const int64_t split = M >= 4 * T ? 1 : kv_heads, items = M * split;
  std::vector<int64_t> order(M);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return len_ptr[a] > len_ptr[b]; });
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[L]);
  for (int64_t l = 0; l < L; ++l) next[l].store(0);
  using tritonserve_decode_bf16::Item;
  auto item_at = [&](int64_t item) {
    const int64_t b = order[item / split], part = item % split;
    return Item{table_ptr + b * width, len_ptr[b], part * kv_heads / split,
                (part + 1) * kv_heads / split};
  };
  uint16_t* xs_p = u16(xs);
  uint16_t* qkv_p = u16(qkv);
  uint16_t* q_p = u16(q);
  uint16_t* att_p = u16(att);
  uint16_t* o_p = u16(o);
  uint16_t* act_p = u16(act);
  const float feps = static_cast<float>(eps), fscale = static_cast<float>(scale);

#pragma omp parallel num_threads(T)
  {
    const int64_t t = omp_get_thread_num();
    bf16* my_res = as_bf16(u16(res)) + t * M * H;
    bf16* my_h = as_bf16(u16(normed)) + t * M * H;
    // residual += rows of `from`; my_h = the normed residual (every thread, all M rows)
    auto norm = [&](const uint16_t* from, const torch::Tensor& weight) {
      std::memcpy(my_h, from, M * H * sizeof(uint16_t));
      const bf16* w = as_bf16(u16(weight));
      for (int64_t r = 0; r < M; ++r)
        tritonserve_rows::add_rms_norm_row(my_h + r * H, my_res + r * H, w, H, feps);
    };
    auto matmul = [&](int64_t i, const uint16_t* in, uint16_t* y, int64_t ldy) {
      const Matmul& m = mm[i];
      const int64_t kp = (m.K + 1) / 2, out_cols = m.silu ? kCols / 2 : kCols;
      auto product = [&](int64_t p) {
        const Out out{y + p * out_cols, ldy, std::min(kCols, m.N - p * kCols),
                      m.bias ? m.bias + p * kCols : nullptr, m.silu, false};
        panel_product(in, M, m.K, m.w + p * kp * 2 * kCols, kp, out);
      };
      // a team smaller than T (OpenMP may give fewer threads) still takes every span
      Owned* own = &owned[i * T];
      int64_t p;
      while (take(own[t], true, p)) product(p);
      for (int64_t other = 1; other < T; ++other)
        while (take(own[(t + other) % T], false, p)) product(p);
    };
    // an item's rope, K/V write and attention
    auto attention = [&](int64_t l, const Item& it, const Item* following, int64_t b) {
      const uint16_t* row = qkv_p + b * qkv_n;
      const bf16* cb = cos_ptr + b * D;
      const bf16* sb = sin_ptr + b * D;
      bf16* kc = as_bf16(u16(k_caches[l])) + slot_ptr[b] * kv_size;
      bf16* vc = as_bf16(u16(v_caches[l])) + slot_ptr[b] * kv_size;
      bf16* qb = as_bf16(q_p) + b * q_size;
      for (int64_t hk = it.h0; hk < it.h1; ++hk) {
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
          tritonserve_rows::rotate_row(as_bf16(row + h * D), cb, sb, qb + h * D, D / 2);
        tritonserve_rows::rotate_row(as_bf16(row + q_size + hk * D), cb, sb, kc + hk * D, D / 2);
        std::memcpy(vc + hk * D, row + q_size + kv_size + hk * D, D * sizeof(uint16_t));
      }
      attend(q_p + b * q_size, u16(k_caches[l]), u16(v_caches[l]), it, following, block_size,
             kv_heads, fscale, att_p + b * q_size, D, D);
    };
    for (int64_t l = 0; l < L; ++l) {
      norm(xs_p, norms[2 * l]);
      matmul(4 * l, reinterpret_cast<uint16_t*>(my_h), qkv_p, qkv_n);
#pragma omp barrier
      for (int64_t item = next[l]++; item < items;) {
        const int64_t following = next[l]++;
        const Item it = item_at(item);
        const Item after = following < items ? item_at(following) : it;
        attention(l, it, following < items ? &after : nullptr, order[item / split]);
        item = following;
      }
#pragma omp barrier
      matmul(4 * l + 1, att_p, o_p, H);
#pragma omp barrier
      norm(o_p, norms[2 * l + 1]);
      matmul(4 * l + 2, reinterpret_cast<uint16_t*>(my_h), act_p, inter);
#pragma omp barrier
      matmul(4 * l + 3, act_p, xs_p, H);
#pragma omp barrier
    }
  }
  return {xs, res[0].clone()};
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("decode_layers_bf16_supported(int head_dim, int group, int block_size) -> bool",
        &decode_layers_bf16_supported);
  m.def("decode_layers_bf16(Tensor x, Tensor[] norms, Tensor[] panels, Tensor[] biases, "
        "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor block_tables, Tensor seq_lens, int num_heads, "
        "float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("decode_layers_bf16", &decode_layers_bf16);
}
