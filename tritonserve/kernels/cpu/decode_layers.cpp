// A decode step's whole decoder stack in one parallel region (CPU, bf16 or fp32):
//   decode_layers(x [M, H] (the embedded tokens), norms [2L] (each layer's input and
//     post-attention RMSNorm weights, [H]), panels [4L] (qkv, o, gate/up, down, packed as the
//     dtype's matmul op reads them: bf16 pack_linear_weight_bf16, gate/up in
//     pack_gate_up_bf16's layout; fp32 pack_linear_weight), biases [L] (the qkv bias,
//     (Hq + 2 Hk) D, or none at all: an empty list), cos, sin [M, 1, D] (the step's rope
//     lookup), slot_mapping [M] int64, k_caches!, v_caches! [L] ([blocks, block, Hk, D]),
//     block_tables [M, W] int32, seq_lens [M] int32 (context lengths with the new token),
//     num_heads, eps, scale) -> (x, residual) [M, H]: the last layer's MLP output and the
//     residual stream before it (the final norm is the caller's).
// Per layer, the op-by-op step's work with its roundings: residual += x and the input norm;
// qkv (+ bias); for each (sequence, KV heads) item, q and k rotated, k and v written at the
// sequence's slot, then its decode attention (bf16: paged_decode_bf16.h's streaming
// schedule; fp32: paged_decode_portable.h); o; the post-attention add + norm; gate/up (bf16:
// silu(gate) * up in the epilogue; fp32: then silu_and_mul over column shares); down.
// The threads meet at four barriers a layer (six in fp32). The norms run on every thread for
// all M rows (each keeps its own copy of the residual and of the normed rows), so they need
// none; the rope and the K/V write belong to the attention item that reads them, so they
// need none either. The matmuls split their panels as kernels/cpu/owned_panels.h does.
// Why: op by op a decode step is ~150 op calls and ~90 Inductor kernels, each an OpenMP
// region and a trip through Python and the dispatcher, during which the weight stream stops:
// SmolLM2's 121 bf16 matmuls at batch 1 took 7.34 ms called one by one and 6.59 ms in one
// region (a plain read of the same bytes: 6.43 ms; docs/benchmarks.md, nineteenth session).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "owned_panels.h"
#include "paged_decode_bf16.h"
#include "paged_decode_portable.h"
#include "phase_clock.h"
#include "panels_amx.h"
#include "panels_bf16.h"
#include "panels_fp32.h"
#include "rows.h"

namespace {

using tritonserve_panels::Owned;
using tritonserve_phases::Phase;
using tritonserve_panels::take;
using bf16 = c10::BFloat16;

// Whether this build runs the op for a dtype and these shapes: fp32 always (the portable
// attention takes any head size and block size); bf16 with AVX512-BF16, whose attention has
// instances for head sizes 64 and 128, groups up to 8 and pages of a multiple of 16 slots.
bool decode_layers_supported(c10::ScalarType dtype, int64_t head_dim, int64_t group,
                             int64_t block_size) {
  if (dtype == c10::kFloat) return head_dim % 2 == 0;
#ifdef TS_AVX512_BF16
  if (dtype == c10::kBFloat16)
    return tritonserve_decode_bf16::pick(head_dim, group, block_size, false) != nullptr;
#endif
  (void)group, (void)block_size;
  return false;
}

// One matmul of the stack: P panels of a K-wide input's weight with N outputs, an fp32 bias
// (bf16: padded to P * 32) or none; silu: bf16's gate/up epilogue (16 outputs a panel).
struct Matmul {
  const void* w;
  int64_t K, N, P;
  const float* bias;
  bool silu;
};

template <typename T>
T* data(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

template <typename T>
std::tuple<torch::Tensor, torch::Tensor> run_stack(
    const torch::Tensor& x, const std::vector<torch::Tensor>& norms,
    const std::vector<torch::Tensor>& panels, const std::vector<torch::Tensor>& biases,
    const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slot_mapping,
    const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
    const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t num_heads,
    double eps, double scale) {
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  const auto dtype = x.scalar_type();
  const int64_t L = static_cast<int64_t>(k_caches.size());
  const int64_t M = x.size(0), H = x.size(1);
  const auto& k0 = k_caches[0];
  const int64_t block_size = k0.size(1), kv_heads = k0.size(2), D = k0.size(3);
  const int64_t slots = k0.size(0) * block_size;
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(k_caches[l].sizes() == k0.sizes() && v_caches[l].sizes() == k0.sizes() &&
                    k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == dtype && v_caches[l].scalar_type() == dtype,
                "decode_layers: every layer's caches must be contiguous, one shape, x's dtype");
  TORCH_CHECK(num_heads >= 1 && num_heads % kv_heads == 0 && D % 2 == 0,
              "decode_layers: num_heads must be a multiple of the caches' kv_heads");
  const int64_t group = num_heads / kv_heads;
  TORCH_CHECK(decode_layers_supported(dtype, D, group, block_size),
              "decode_layers: no attention instance for head size ", D, ", group ", group,
              ", block size ", block_size);
  const int64_t q_size = num_heads * D, kv_size = kv_heads * D, qkv_n = q_size + 2 * kv_size;
  TORCH_CHECK(cos.numel() == M * D && sin.numel() == M * D && cos.scalar_type() == dtype &&
                  sin.scalar_type() == dtype,
              "decode_layers: cos and sin must be [M, 1, D] in x's dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == M &&
                  slot_mapping.scalar_type() == torch::kInt64,
              "decode_layers: slot_mapping must be int64 [M]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == M &&
                  block_tables.scalar_type() == torch::kInt32 && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == M && seq_lens.scalar_type() == torch::kInt32,
              "decode_layers: block_tables int32 [M, W] and seq_lens int32 [M]");
  auto slot = slot_mapping.contiguous(), tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t* slot_ptr = slot.data_ptr<int64_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int64_t width = tables.size(1);
  for (int64_t b = 0; b < M; ++b) {  // before any write: bad metadata changes nothing
    TORCH_CHECK(slot_ptr[b] >= 0 && slot_ptr[b] < slots, "decode_layers: slot ", slot_ptr[b],
                " out of range [0, ", slots, ")");
    TORCH_CHECK(len_ptr[b] >= 1 && len_ptr[b] <= width * block_size, "decode_layers: seq_len ",
                len_ptr[b], " out of range [1, ", width * block_size, "]");
  }
  // bf16 panels [P, ceil(K / 2), 32, 2] (gate/up: 16 outputs a panel); fp32 [P, K, 16]
  constexpr int64_t cols = kBf16 ? tritonserve_panels_bf16::kCols : tritonserve_panels_fp32::kPanel;
  const int64_t inter = kBf16 ? panels[2].size(0) * (cols / 2) : panels[3].size(1);
  std::vector<Matmul> mm(4 * L);
  std::vector<torch::Tensor> bias32(L);
  for (int64_t l = 0; l < L; ++l) {
    const int64_t in[4] = {H, q_size, H, inter}, out[4] = {qkv_n, H, 2 * inter, H};
    for (int i = 0; i < 4; ++i) {
      const auto& p = panels[4 * l + i];
      const bool shaped = kBf16 ? p.dim() == 4 && p.size(2) == cols && p.size(3) == 2 &&
                                      p.size(1) == (in[i] + 1) / 2
                                : p.dim() == 3 && p.size(2) == cols && p.size(1) == in[i];
      TORCH_CHECK(shaped && p.is_contiguous() && p.scalar_type() == dtype &&
                      out[i] > (p.size(0) - 1) * cols && out[i] <= p.size(0) * cols,
                  "decode_layers: panels[", 4 * l + i, "] do not fit the layer's shapes");
      mm[4 * l + i] = Matmul{p.data_ptr(), in[i], out[i], p.size(0), nullptr, kBf16 && i == 2};
    }
    for (int i = 0; i < 2; ++i)
      TORCH_CHECK(norms[2 * l + i].numel() == H && norms[2 * l + i].is_contiguous() &&
                      norms[2 * l + i].scalar_type() == dtype,
                  "decode_layers: norms[", 2 * l + i, "] must be [H] in x's dtype");
    if (!biases.empty()) {
      TORCH_CHECK(biases[l].numel() == qkv_n, "decode_layers: biases[", l, "] must be [",
                  qkv_n, "]");
      bias32[l] = torch::zeros({mm[4 * l].P * cols}, x.options().dtype(torch::kFloat32));
      bias32[l].narrow(0, 0, qkv_n).copy_(biases[l].reshape({qkv_n}));
      mm[4 * l].bias = bias32[l].data_ptr<float>();
    }
  }
  auto c = cos.contiguous(), s = sin.contiguous();
  const T* cos_ptr = data<T>(c);
  const T* sin_ptr = data<T>(s);

  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), 64));
  auto opts = x.options();
  auto xs = x.clone();                                 // [M, H]: the input, then down's output
  auto qkv = torch::empty({M, qkv_n}, opts);           // [M, (Hq + 2 Hk) D]
  auto q = torch::empty({M, q_size}, opts);            // [M, Hq D] rotated
  // the matmuls' inputs hold whole AMX tiles of rows (panels_amx.h reads rows past M)
  const int64_t Mp = tritonserve_amx::padded_rows(M);
  auto att = torch::empty({Mp, q_size}, opts);         // [Mp, Hq D]
  auto o = torch::empty({M, H}, opts);                 // [M, H]
  auto gate_up = torch::empty({kBf16 ? 0 : M, 2 * inter}, opts);  // fp32: [M, 2I]
  auto act = torch::empty({Mp, inter}, opts);          // [Mp, I]
  auto res = torch::zeros({threads, M, H}, opts);      // each thread's residual stream
  auto normed = torch::empty({threads, Mp, H}, opts);  // each thread's normed rows
  // the panels of matmul i, thread t: owned[i * threads + t] (owned_panels.h's spans)
  std::unique_ptr<Owned[]> owned(new Owned[4 * L * threads]);
  for (int64_t i = 0; i < 4 * L; ++i)
    for (int64_t t = 0; t < threads; ++t)
      owned[i * threads + t].span.store(static_cast<uint64_t>((t + 1) * mm[i].P / threads) << 32 |
                                        static_cast<uint64_t>(t * mm[i].P / threads));
  // attention items as paged_decode.cpp makes them (page_sweep.h), claimed in turn (a
  // counter a layer)
  using tritonserve_sweep::Item;
  tritonserve_sweep::Items work(table_ptr, len_ptr, M, width, kv_heads, threads, block_size,
                                kBf16);
  const int64_t items = work.count;
  // a split call (batch <= Items::kSplitBatch, long contexts; bf16): the parts' sums, merged
  // after the items; its rope and K/V writes run before them, once a (row, KV head)
  const bool split = work.parts > 1;
  torch::Tensor scratch;
  if (split) {
    scratch = torch::empty({work.scratch_floats(num_heads, D)}, x.options().dtype(torch::kFloat32));
    work.use_scratch(scratch.data_ptr<float>(), num_heads, D);
  }
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[L]);
  for (int64_t l = 0; l < L; ++l) next[l].store(0);
  T* xs_p = data<T>(xs);
  T* qkv_p = data<T>(qkv);
  T* q_p = data<T>(q);
  T* att_p = data<T>(att);
  T* o_p = data<T>(o);
  T* gu_p = data<T>(gate_up);
  T* act_p = data<T>(act);
  const float feps = static_cast<float>(eps), fscale = static_cast<float>(scale);

  // the item's attention over its KV heads [it.h0, it.h1): q at q_b, out at att_b
#ifdef TS_AVX512_BF16
  const auto bf16_attend = tritonserve_decode_bf16::pick(D, group, block_size, false);
#endif
  const auto fp32_attend = D == 64    ? tritonserve_decode_portable::decode_seq<float, 64>
                           : D == 128 ? tritonserve_decode_portable::decode_seq<float, 128>
                                      : tritonserve_decode_portable::decode_seq<float, 0>;
  auto attend = [&](int64_t l, const Item& it, const Item* following, const T* q_b, T* att_b) {
    const T* kc = data<T>(k_caches[l]);
    const T* vc = data<T>(v_caches[l]);
#ifdef TS_AVX512_BF16
    if constexpr (kBf16) {
      bf16_attend(reinterpret_cast<const uint16_t*>(q_b),
                  reinterpret_cast<const uint16_t*>(kc), reinterpret_cast<const uint16_t*>(vc),
                  it, following, block_size, kv_heads, fscale,
                  reinterpret_cast<uint16_t*>(att_b), D, D);
      return;
    }
#endif
    if constexpr (!kBf16) {
      fp32_attend(q_b, kc, vc, it.table, it.len, block_size, kv_heads, D, group, it.h0, it.h1,
                  fscale, att_b, D, D, false);
    }
    (void)following;
  };

  const bool timing = tritonserve_phases::totals().on.load(std::memory_order_relaxed);
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), team = omp_get_num_threads();
    tritonserve_phases::Clock clock(t, timing);
    T* my_res = data<T>(res) + t * M * H;
    T* my_h = data<T>(normed) + t * Mp * H;
    // residual += rows of `from`; my_h = the normed residual (every thread, all M rows)
    auto norm = [&](const T* from, const torch::Tensor& weight) {
      std::memcpy(my_h, from, M * H * sizeof(T));
      const T* w = data<T>(weight);
      for (int64_t r = 0; r < M; ++r)
        tritonserve_rows::add_rms_norm_row(my_h + r * H, my_res + r * H, w, H, feps);
    };
    auto product = [&](const Matmul& m, const T* in, T* y, int64_t ldy, int64_t p) {
      if constexpr (kBf16) {
        using namespace tritonserve_panels_bf16;
        const int64_t kp = (m.K + 1) / 2, out_cols = m.silu ? cols / 2 : cols;
        auto* yy = reinterpret_cast<uint16_t*>(y);
        const Out out{yy + p * out_cols, ldy, std::min(cols, m.N - p * cols),
                      m.bias ? m.bias + p * cols : nullptr, m.silu, false};
        tritonserve_amx::panel_product(reinterpret_cast<const uint16_t*>(in), M, m.K,
                                       static_cast<const uint16_t*>(m.w) + p * kp * 2 * cols,
                                       kp, out);
      } else {
        const int64_t col = p * cols, ncols = std::min(cols, m.N - col);
        tritonserve_panels_fp32::panel_product(in, M, m.K,
                                               static_cast<const float*>(m.w) + p * m.K * cols,
                                               y + col, ldy, ncols);
        if (m.bias != nullptr)
          for (int64_t r = 0; r < M; ++r)
            for (int64_t i = 0; i < ncols; ++i) y[r * ldy + col + i] += m.bias[col + i];
      }
    };
    // a team smaller than `threads` (OpenMP may give fewer) still takes every span
    auto matmul = [&](int64_t i, const T* in, T* y, int64_t ldy) {
      Owned* own = &owned[i * threads];
      int64_t p;
      while (take(own[t], true, p)) product(mm[i], in, y, ldy, p);
      for (int64_t other = 1; other < threads; ++other)
        while (take(own[(t + other) % threads], false, p)) product(mm[i], in, y, ldy, p);
    };
    // row b's rope and K/V write for KV heads [h0, h1)
    auto rope_store = [&](int64_t l, int64_t b, int64_t h0, int64_t h1) {
      const T* row = qkv_p + b * qkv_n;
      const T* cb = cos_ptr + b * D;
      const T* sb = sin_ptr + b * D;
      T* kc = data<T>(k_caches[l]) + slot_ptr[b] * kv_size;
      T* vc = data<T>(v_caches[l]) + slot_ptr[b] * kv_size;
      T* qb = q_p + b * q_size;
      for (int64_t hk = h0; hk < h1; ++hk) {
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
          tritonserve_rows::rotate_row(row + h * D, cb, sb, qb + h * D, D / 2);
        tritonserve_rows::rotate_row(row + q_size + hk * D, cb, sb, kc + hk * D, D / 2);
        std::memcpy(vc + hk * D, row + q_size + kv_size + hk * D, D * sizeof(T));
      }
    };
    // an item's rope, K/V write (unless a split call did them first) and attention
    auto attention = [&](int64_t l, const Item& it, const Item* following, int64_t b) {
      if (!split) rope_store(l, b, it.h0, it.h1);
      attend(l, it, following, q_p + b * q_size, att_p + b * q_size);
    };
    for (int64_t l = 0; l < L; ++l) {
      norm(xs_p, norms[2 * l]);
      clock.busy(Phase::kNorm);
      matmul(4 * l, my_h, qkv_p, qkv_n);
      clock.busy(Phase::kQkv);
#pragma omp barrier
      clock.wait(Phase::kQkv);
      if (split) {  // every (row, KV head)'s rope and write before any part reads them
        for (int64_t r = t; r < M * kv_heads; r += team)
          rope_store(l, r / kv_heads, r % kv_heads, r % kv_heads + 1);
        clock.busy(Phase::kAttention);
#pragma omp barrier
        clock.wait(Phase::kAttention);
      }
      for (int64_t item = next[l]++; item < items;) {
        const int64_t following = next[l]++;
        const Item it = work.at(item);
        const Item after = following < items ? work.at(following) : it;
        attention(l, it, following < items ? &after : nullptr, work.seq(item));
        item = following;
      }
      clock.busy(Phase::kAttention);
#pragma omp barrier
      clock.wait(Phase::kAttention);
      if constexpr (kBf16) {
#ifdef TS_AVX512_BF16
        if (split) {  // the parts merged, (row, query head)s shared out
          for (int64_t r = t; r < M * num_heads; r += team)
            tritonserve_decode_bf16::merge_parts(
                work, r / num_heads, r % num_heads,
                reinterpret_cast<uint16_t*>(att_p) + r * D);
          clock.busy(Phase::kAttention);
#pragma omp barrier
          clock.wait(Phase::kAttention);
        }
#endif
      }
      matmul(4 * l + 1, att_p, o_p, H);
      clock.busy(Phase::kO);
#pragma omp barrier
      clock.wait(Phase::kO);
      norm(o_p, norms[2 * l + 1]);
      clock.busy(Phase::kNorm);
      if constexpr (kBf16) {
        matmul(4 * l + 2, my_h, act_p, inter);
      } else {  // gate/up, then silu(gate) * up over this thread's share of the columns
        matmul(4 * l + 2, my_h, gu_p, 2 * inter);
        clock.busy(Phase::kGateUp);
#pragma omp barrier
        clock.wait(Phase::kGateUp);
        const int64_t c0 = t * inter / team, c1 = (t + 1) * inter / team;
        for (int64_t r = 0; r < M; ++r)
          tritonserve_rows::silu_and_mul_row(gu_p + r * 2 * inter + c0,
                                             gu_p + r * 2 * inter + inter + c0,
                                             act_p + r * inter + c0, c1 - c0);
      }
      clock.busy(Phase::kGateUp);
#pragma omp barrier
      clock.wait(Phase::kGateUp);
      matmul(4 * l + 3, act_p, xs_p, H);
      clock.busy(Phase::kDown);
#pragma omp barrier
      clock.wait(Phase::kDown);
    }
  }
  if (timing) ++tritonserve_phases::totals().calls;
  return {xs, res[0].clone()};
}

// Timing on (the totals reset) or off: phase_clock.h
void decode_layers_timing(bool on) {
  auto& totals = tritonserve_phases::totals();
  if (on) totals.reset();
  totals.on.store(on);
}

// The totals since timing was turned on: seconds [threads, phases, 2] (busy, wait) of
// torch's thread count, phases as phase_clock.h orders them, and the calls they cover
std::tuple<torch::Tensor, int64_t> decode_layers_phases() {
  using namespace tritonserve_phases;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), kThreads);
  auto out = torch::zeros({threads, kPhases, 2}, torch::kFloat64);
  auto* o = out.data_ptr<double>();
  for (int64_t t = 0; t < threads; ++t)
    for (int64_t p = 0; p < kPhases; ++p) {
      o[(t * kPhases + p) * 2] = totals().rows[t].busy[p];
      o[(t * kPhases + p) * 2 + 1] = totals().rows[t].wait[p];
    }
  return {out, totals().calls};
}

std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    const torch::Tensor& x, const std::vector<torch::Tensor>& norms,
    const std::vector<torch::Tensor>& panels, const std::vector<torch::Tensor>& biases,
    const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slot_mapping,
    std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
    const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t num_heads,
    double eps, double scale) {
  const size_t L = k_caches.size();
  TORCH_CHECK(L >= 1 && v_caches.size() == L && norms.size() == 2 * L &&
                  panels.size() == 4 * L && (biases.empty() || biases.size() == L),
              "decode_layers: L caches each of k and v, 2L norms, 4L panels, L or 0 biases");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && k_caches[0].dim() == 4,
              "decode_layers: x must be a contiguous [M, H] matrix and the caches "
              "[blocks, block_size, kv_heads, D]");
  if (x.scalar_type() == torch::kFloat32)
    return run_stack<float>(x, norms, panels, biases, cos, sin, slot_mapping, k_caches,
                            v_caches, block_tables, seq_lens, num_heads, eps, scale);
#ifdef TS_AVX512_BF16
  if (x.scalar_type() == torch::kBFloat16)
    return run_stack<bf16>(x, norms, panels, biases, cos, sin, slot_mapping, k_caches,
                           v_caches, block_tables, seq_lens, num_heads, eps, scale);
#endif
  TORCH_CHECK(false, "decode_layers: float32, or bfloat16 on a build with AVX512-BF16; got ",
              x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("decode_layers_supported(ScalarType dtype, int head_dim, int group, int block_size) "
        "-> bool", &decode_layers_supported);
  m.def("decode_layers_timing(bool on) -> ()", &decode_layers_timing);
  m.def("decode_layers_phases() -> (Tensor, int)", &decode_layers_phases);
  m.def("decode_layers(Tensor x, Tensor[] norms, Tensor[] panels, Tensor[] biases, "
        "Tensor cos, Tensor sin, Tensor slot_mapping, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor block_tables, Tensor seq_lens, int num_heads, "
        "float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
