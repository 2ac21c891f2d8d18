// A decode step's whole decoder stack in one parallel region (CPU, bf16 or fp32):
//   decode_layers(x [M, H] (the embedded tokens), norms [2L] (each layer's input and
//     post-attention RMSNorm weights, [H]), panels [4L] (qkv, o, gate/up, down, packed as the
//     dtype's matmul op reads them: bf16 pack_linear_weight_bf16, gate/up in
//     pack_gate_up_bf16's layout; fp32 pack_linear_weight; or any of them uint8 quantized
//     panels, kernels/quant_layout.py), biases [L] (the qkv bias,
//     (Hq + 2 Hk) D, or none at all: an empty list), cos, sin [M, 1, D] (the step's rope
//     lookup), slot_mapping [M] int64, k_caches!, v_caches! [L] ([blocks, block, Hk, D]),
//     block_tables [M, W] int32, seq_lens [M] int32 (context lengths with the new token),
//     num_heads, eps, scale) -> (x, residual) [M, H]: the last layer's MLP output and the
//     residual stream before it (the final norm is the caller's).
//   With input_ids, positions, final_norm [H] (optional, each alone): x is the embedding
//     table [V, H] whose rows input_ids [M] are the input, cos / sin the rope tables [P, 1, D]
//     whose rows positions [M] the step uses, and the result is (the final norm's output,
//     the residual after it): the step's embedding, rope lookup and last add + norm without
//     three more dispatched ops, ~45 us each in a SmolLM2 batch-1 step (cold caches there).
//   gate_up_silu (bf16 dense panels): gate/up packed with silu(gate) * up in its epilogue
//     (pack_gate_up_bf16), else plain panels of 2I outputs, silu_and_mul after (an engine
//     that serves adapters keeps gate and up apart for them).
//   With lora_slots [M]: each row's LoRA adapter (-1: none), whose packed lora_blobs /
//     lora_index (lora_rows.h's layout, lora_step.h) add x A^T B^T to each projection it
//     adapts.
// Per layer, the op-by-op step's work with its roundings: residual += x and the input norm;
// qkv (+ bias); for each (sequence, KV heads) item, q and k rotated, k and v written at the
// sequence's slot, then its decode attention (bf16: paged_decode_bf16.h's streaming
// schedule; fp32: paged_decode_portable.h); o; the post-attention add + norm; gate/up (bf16:
// silu(gate) * up in the epilogue; fp32 or quantized: then silu_and_mul over column shares);
// down.
// The threads meet (Team::meet: a barrier and its clock) four times a layer (six in fp32). The
// norms run on every thread for all M rows (each keeps its own copy of the residual and of the
// normed rows), so they need none; the rope and the K/V write belong to the attention item
// that reads them, so they need none either.
// Why: op by op a decode step is ~150 op calls and ~90 Inductor kernels, each an OpenMP
// region and a trip through Python and the dispatcher, during which the weight stream stops:
// SmolLM2's 121 bf16 matmuls at batch 1 took 7.34 ms called one by one and 6.59 ms in one
// region (a plain read of the same bytes: 6.43 ms; docs/perf-log/2026-cpu-decode.md).
//
// The contracts this op rests on, stated once (each header states its own side):
// - panels_amx.h: a matmul's input holds padded_rows(M) rows, whole 16-row AMX tiles (the
//   rows past M are read, never used): `normed`, `att` and `act` are allocated so
//   (decode_stack.h, which also checks every argument before anything is written).
// - panels_bf16.h: its asm reads x's rows through a memory operand the compiler cannot see,
//   so every row of a matmul's input is stored before the matmul starts: the input is this
//   thread's own normed rows, or the team met after writing it.
// - owned_panels.h: a matmul's panels start as one span a thread; a thread takes its own
//   span's front, then the others' backs, so a team smaller than asked still does them all.
// - page_sweep.h: attention items (a sequence's KV heads, or in a split call a part of its
//   pages) claimed in turn, one counter a layer; a split call's parts leave sums that
//   merge_parts combines after every item. paged_decode_bf16.h / paged_decode_portable.h
//   read q and write att with row stride Hq D and head stride D.
// - phase_clock.h: each thread adds to its own row of the totals, one a team member.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "decode_stack.h"
#include "owned_panels.h"
#include "phase_clock.h"
#include "rows.h"

namespace {

using namespace tritonserve_stack;
using tritonserve_panels::take;
using tritonserve_phases::Phase;
using tritonserve_sweep::Item;

// One thread of the team inside the parallel region: the phases of a layer.
template <typename T>
struct Team {
  static constexpr bool kBf16 = Stack<T>::kBf16;
  static constexpr int64_t cols = Stack<T>::cols;
  Stack<T>& st;
  const int64_t t, team;
  tritonserve_phases::Clock clock;
  T* const my_res;  // this thread's residual stream [M, H]
  T* const my_h;    // this thread's normed rows [Mp, H]
  const float eps, scale;
  std::vector<float> sums;  // a quantized matmul's input group sums
  // a quantized panel widened (panels_quant_bf16.h)
  std::vector<tritonserve_panels_quant::Wide> wide;
  // LoRA, for the current matmul: the adapter rows' input in fp32, in Stack::lora_order's
  // order
  std::vector<float> xf, xsum;  // and x A^T's partial sums added up (lora_step.h)
  std::vector<int64_t> taken;  // the panels this thread computed of the current matmul

  Team(Stack<T>& stack, bool timing)
      : st(stack), t(omp_get_thread_num()), team(omp_get_num_threads()), clock(t, timing),
        my_res(data<T>(stack.res) + t * stack.M * stack.H),
        my_h(data<T>(stack.normed) + t * stack.Mp * stack.H),
        eps(static_cast<float>(stack.a.eps)), scale(static_cast<float>(stack.a.scale)) {}

  // the end of phase p: the team waits for its last member
  void meet(Phase p) {
    clock.busy(p);
#pragma omp barrier
    clock.wait(p);
  }

  void layer(int64_t l) {
    norm(st.xs_p, st.a.norms[2 * l]);
    clock.busy(Phase::kNorm);
    matmul(4 * l, my_h, st.qkv_p, st.qkv_n);
    meet(Phase::kQkv);
    attention_phase(l);
    matmul(4 * l + 1, st.att_p, st.o_p, st.H);
    meet(Phase::kO);
    mlp_phase(l);
  }

  // residual += rows of `from`; my_h = the normed residual (every thread, all M rows)
  void norm(const T* from, const torch::Tensor& weight) {
    std::memcpy(my_h, from, st.M * st.H * sizeof(T));
    const T* w = data<T>(weight);
    for (int64_t r = 0; r < st.M; ++r)
      tritonserve_rows::add_rms_norm_row(my_h + r * st.H, my_res + r * st.H, w, st.H, eps);
  }

  // every (row, KV head)'s rope and K/V write, the items' attention, the split parts merged
  void attention_phase(int64_t l) {
    const int64_t kv_heads = st.kv_heads, M = st.M;
    if (st.write_first) {  // every (row, KV head)'s rope and write before any part reads them
      for (int64_t r = t; r < M * kv_heads; r += team)
        rope_store(l, r / kv_heads, r % kv_heads, r % kv_heads + 1);
      meet(Phase::kAttention);
    }
    const auto& work = *st.work;
    for (int64_t item = st.next[l]++; item < work.count;) {
      const int64_t following = st.next[l]++;
      const Item it = work.at(item);
      const Item after = following < work.count ? work.at(following) : it;
      const int64_t b = work.seq(item);
      if (!st.write_first) rope_store(l, b, it.h0, it.h1);
      attend(l, it, following < work.count ? &after : nullptr, b);
      item = following;
    }
    meet(Phase::kAttention);
    if (st.split) {  // the parts merged, (row, query head)s shared out
      const int64_t heads = st.a.num_heads;
      for (int64_t r = t; r < M * heads; r += team) {
        if constexpr (kBf16)
          tritonserve_sweep::merge_parts(work, r / heads, r % heads,
                                         reinterpret_cast<uint16_t*>(st.att_p) + r * st.D,
                                         tritonserve_vec::float_to_bf16);
        else
          tritonserve_sweep::merge_parts(work, r / heads, r % heads, st.att_p + r * st.D,
                                         [](float x) { return x; });
      }
      meet(Phase::kAttention);
    }
  }

  // the post-attention add + norm, gate/up with silu(gate) * up, down
  void mlp_phase(int64_t l) {
    norm(st.o_p, st.a.norms[2 * l + 1]);
    clock.busy(Phase::kNorm);
    T* act = st.act_p;
    if (st.mm[4 * l + 2].silu) {
      matmul(4 * l + 2, my_h, act, st.inter);
    } else {  // gate/up, then silu(gate) * up over this thread's share of the columns
      T* gu = st.gu_p;
      const int64_t inter = st.inter;
      matmul(4 * l + 2, my_h, gu, 2 * inter);
      meet(Phase::kGateUp);
      const int64_t c0 = t * inter / team, c1 = (t + 1) * inter / team;
      for (int64_t r = 0; r < st.M; ++r)
        tritonserve_rows::silu_and_mul_row(gu + r * 2 * inter + c0,
                                           gu + r * 2 * inter + inter + c0,
                                           act + r * inter + c0, c1 - c0);
    }
    meet(Phase::kGateUp);
    matmul(4 * l + 3, act, st.xs_p, st.H);
    meet(Phase::kDown);
  }

  // matmul i's panels, this thread's own first (a team smaller than asked still takes every
  // span: owned_panels.h)
  void matmul(int64_t i, const T* in, T* y, int64_t ldy) {
    const int64_t threads = st.threads;
    if (st.mm[i].quant) group_sums(st.mm[i], in);
    const bool lora = st.lora.adapts(i);
    if (lora) {  // every adapter row's x A^T, shared out (lora_step.h); then the team meets
      static constexpr Phase kPhaseOf[4] = {Phase::kQkv, Phase::kO, Phase::kGateUp,
                                            Phase::kDown};
      st.lora.shrink(i, in, st.mm[i].K, xf, t, team);
      meet(kPhaseOf[i % 4]);
      taken.clear();
    }
    Owned* own = &st.owned[i * threads];
    int64_t p;
    while (take(own[t], true, p)) {
      product(i, in, y, ldy, p);
      if (lora) taken.push_back(p);
    }
    for (int64_t other = 1; other < threads; ++other)
      while (take(own[(t + other) % threads], false, p)) {
        product(i, in, y, ldy, p);
        if (lora) taken.push_back(p);
      }
    if (lora)  // (x A^T) B^T added to the columns of this thread's panels
      st.lora.expand(i, st.lora.summed(i, team, xsum), taken,
                     st.mm[i].quant ? tritonserve_panels_quant::kCols : cols, st.mm[i].N, y,
                     ldy);
  }

  // a quantized matmul's input group sums (panels_quant.h), this thread's copy
  void group_sums(const Matmul& m, const T* in) {
    sums.resize(st.M * (m.K / tritonserve_panels_quant::kGroup));
    if constexpr (kBf16)
      tritonserve_panels_quant::group_sums_bf16(reinterpret_cast<const uint16_t*>(in), m.K,
                                                st.M, m.K, sums.data());
    else
      tritonserve_panels_quant::group_sums(in, m.K, st.M, m.K, sums.data());
  }

  void product(int64_t i, const T* in, T* y, int64_t ldy, int64_t p) {
    const Matmul& m = st.mm[i];
    const int64_t M = st.M;
    if (m.quant) {
      namespace pq = tritonserve_panels_quant;
      const int64_t col = p * pq::kCols, ncols = std::min(pq::kCols, m.N - col);
      const auto* w = static_cast<const uint8_t*>(m.w) + p * (m.K / pq::kGroup) *
                                                             pq::record_bytes(m.kind);
      const float* bias = m.bias ? m.bias + col : nullptr;
      if constexpr (kBf16) {
        wide.resize(std::max<size_t>(wide.size(), pq::wide_words(m.K)));
        pq::panel_product_bf16(m.kind, reinterpret_cast<const uint16_t*>(in), M, m.K,
                               sums.data(), w, reinterpret_cast<uint16_t*>(y) + col, ldy, ncols,
                               wide.data(), bias);
      } else {
        pq::panel_product(m.kind, in, M, m.K, sums.data(), w, y + col, ldy, ncols);
        if (bias != nullptr)
          for (int64_t r = 0; r < M; ++r)
            for (int64_t c = 0; c < ncols; ++c) y[r * ldy + col + c] += bias[c];
      }
      return;
    }
    if constexpr (kBf16) {
      using namespace tritonserve_panels_bf16;
      const int64_t kp = (m.K + 1) / 2, out_cols = m.silu ? cols / 2 : cols;
      auto* yy = reinterpret_cast<uint16_t*>(y);
      const Out out{yy + p * out_cols, ldy, std::min(cols, m.N - p * cols),
                    m.bias ? m.bias + p * cols : nullptr, m.silu, false};
      tritonserve_amx::panel_product(reinterpret_cast<const uint16_t*>(in), M, m.K,
                                     static_cast<const uint16_t*>(m.w) + p * kp * 2 * cols, kp,
                                     out);
    } else {
      const int64_t col = p * cols, ncols = std::min(cols, m.N - col);
      tritonserve_panels_fp32::panel_product(in, M, m.K,
                                             static_cast<const float*>(m.w) + p * m.K * cols,
                                             y + col, ldy, ncols);
      if (m.bias != nullptr)
        for (int64_t r = 0; r < M; ++r)
          for (int64_t c = 0; c < ncols; ++c) y[r * ldy + col + c] += m.bias[col + c];
    }
  }

  // row b's rope and K/V write for KV heads [h0, h1)
  void rope_store(int64_t l, int64_t b, int64_t h0, int64_t h1) {
    const int64_t D = st.D, q_size = st.q_size, kv_size = st.kv_size, group = st.group;
    const int64_t slot = st.slot_p[b];
    const T* row = st.qkv_p + b * st.qkv_n;
    const T* cb = st.cos_p + b * D;
    const T* sb = st.sin_p + b * D;
    T* qb = st.q_p + b * q_size;
    for (int64_t hk = h0; hk < h1; ++hk)
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        tritonserve_rows::rotate_row(row + h * D, cb, sb, qb + h * D, D / 2);
    if (st.int8_kv) {  // rows of codes + scale: the rotated k through a row of T first
      const int64_t head_row = D + tritonserve_decode_portable::kScaleBytes<int8_t>;
      int8_t* kc = st.k8[l] + slot * st.kv_heads * head_row;
      int8_t* vc = st.v8[l] + slot * st.kv_heads * head_row;
      std::vector<T> k_row(D);
      for (int64_t hk = h0; hk < h1; ++hk) {
        tritonserve_rows::rotate_row(row + q_size + hk * D, cb, sb, k_row.data(), D / 2);
        tritonserve_decode_portable::quantize_row(k_row.data(), kc + hk * head_row, D);
        tritonserve_decode_portable::quantize_row(row + q_size + kv_size + hk * D,
                                                  vc + hk * head_row, D);
      }
      return;
    }
    T* kc = st.k_p[l] + slot * kv_size;
    T* vc = st.v_p[l] + slot * kv_size;
    for (int64_t hk = h0; hk < h1; ++hk) {
      tritonserve_rows::rotate_row(row + q_size + hk * D, cb, sb, kc + hk * D, D / 2);
      std::memcpy(vc + hk * D, row + q_size + kv_size + hk * D, D * sizeof(T));
    }
  }

  // the item's attention over its KV heads [it.h0, it.h1): row b's q in, its att out
  void attend(int64_t l, const Item& it, const Item* following, int64_t b) {
    const T* q_b = st.q_p + b * st.q_size;
    T* att_b = st.att_p + b * st.q_size;
    const int64_t D = st.D;
    if (st.int8_kv) {
      st.int8_attend(q_b, st.k8[l], st.v8[l], it.table, it.len, st.block_size, st.kv_heads, D,
                     st.group, it.h0, it.h1, scale, att_b, D, D, false, 0, 0.0f, it.p0, it.p1,
                     it.partial, nullptr);
      return;
    }
    const T* kc = st.k_p[l];
    const T* vc = st.v_p[l];
    if constexpr (kBf16) {
      st.bf16_attend(
          reinterpret_cast<const uint16_t*>(q_b), reinterpret_cast<const uint16_t*>(kc),
          reinterpret_cast<const uint16_t*>(vc), it, following, st.block_size, st.kv_heads,
          scale, reinterpret_cast<uint16_t*>(att_b), D, D);
    } else {
      st.fp32_attend(q_b, kc, vc, it.table, it.len, st.block_size, st.kv_heads, D, st.group,
                     it.h0, it.h1, scale, att_b, D, D, false, 0, 0.0f, it.p0, it.p1,
                     it.partial, nullptr);
    }
  }
};

template <typename T>
std::tuple<torch::Tensor, torch::Tensor> run_stack(const Args& args) {
  Stack<T> stack(args);
  const bool timing = tritonserve_phases::totals().start(stack.threads);
#pragma omp parallel num_threads(stack.threads)
  {
    Team<T> member(stack, timing);
    for (int64_t l = 0; l < stack.L; ++l) member.layer(l);
  }
  if (timing) ++tritonserve_phases::totals().calls;
  auto residual = stack.res[0].clone();
  if (args.final_norm) {  // fused_ops.cpp's add_rms_norm, row by row: the same roundings
    const T* w = data<T>(*args.final_norm);
    T* x = stack.xs_p;
    T* r = data<T>(residual);
    for (int64_t row = 0; row < stack.M; ++row)
      tritonserve_rows::add_rms_norm_row(x + row * stack.H, r + row * stack.H, w, stack.H,
                                         static_cast<float>(args.eps));
  }
  return {stack.xs, residual};
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
  const int64_t threads = at::get_num_threads();
  auto out = torch::zeros({threads, kPhases, 2}, torch::kFloat64);
  auto* o = out.data_ptr<double>();
  for (int64_t t = 0; t < std::min<int64_t>(threads, totals().rows.size()); ++t)
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
    double eps, double scale, const c10::optional<torch::Tensor>& input_ids,
    const c10::optional<torch::Tensor>& positions, const c10::optional<torch::Tensor>& final_norm,
    const c10::optional<torch::Tensor>& lora_slots,
    const c10::optional<std::vector<torch::Tensor>>& lora_blobs,
    const c10::optional<std::vector<torch::Tensor>>& lora_index, bool gate_up_silu) {
  static const std::vector<torch::Tensor> none;
  const size_t L = k_caches.size();
  TORCH_CHECK(L >= 1 && v_caches.size() == L && norms.size() == 2 * L &&
                  panels.size() == 4 * L && (biases.empty() || biases.size() == L),
              "decode_layers: L caches each of k and v, 2L norms, 4L panels, L or 0 biases");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && k_caches[0].dim() == 4,
              "decode_layers: x must be a contiguous [M, H] matrix and the caches "
              "[blocks, block_size, kv_heads, D]");
  const Args args{x,         norms,    panels,     biases,    cos,   sin,
                  slot_mapping, k_caches, v_caches, block_tables, seq_lens, num_heads,
                  eps,       scale,    input_ids,  positions, final_norm, lora_slots,
                  lora_blobs ? *lora_blobs : none, lora_index ? *lora_index : none,
                  gate_up_silu};
  if (x.scalar_type() == torch::kFloat32) return run_stack<float>(args);
#ifdef TS_AVX512_BF16
  if (x.scalar_type() == torch::kBFloat16) return run_stack<bf16>(args);
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
        "float eps, float scale, Tensor? input_ids=None, Tensor? positions=None, "
        "Tensor? final_norm=None, Tensor? lora_slots=None, Tensor[]? lora_blobs=None, "
        "Tensor[]? lora_index=None, bool gate_up_silu=True) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
