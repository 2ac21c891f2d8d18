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
//   rows past M are read, never used): `normed`, `att` and `act` are allocated so.
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
using tritonserve_panels::take;
using tritonserve_phases::Phase;
using tritonserve_sweep::Item;
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

// The op's arguments, as the schema at the bottom names them.
struct Args {
  const torch::Tensor& x;
  const std::vector<torch::Tensor>& norms;
  const std::vector<torch::Tensor>& panels;
  const std::vector<torch::Tensor>& biases;
  const torch::Tensor& cos;
  const torch::Tensor& sin;
  const torch::Tensor& slot_mapping;
  const std::vector<torch::Tensor>& k_caches;
  const std::vector<torch::Tensor>& v_caches;
  const torch::Tensor& block_tables;
  const torch::Tensor& seq_lens;
  int64_t num_heads;
  double eps, scale;
};

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

// The checked arguments and the step's buffers, shared by the team.
template <typename T>
struct Stack {
  static constexpr bool kBf16 = std::is_same_v<T, bf16>;
  // bf16 panels [P, ceil(K / 2), 32, 2] (gate/up: 16 outputs a panel); fp32 [P, K, 16]
  static constexpr int64_t cols = kBf16 ? tritonserve_panels_bf16::kCols
                                        : tritonserve_panels_fp32::kPanel;
  const Args& a;
  int64_t L, M, H, block_size, kv_heads, D, group, q_size, kv_size, qkv_n, inter, Mp, threads;
  std::vector<Matmul> mm;            // [4L]: qkv, o, gate/up, down of each layer
  std::vector<torch::Tensor> bias32;  // the qkv biases in fp32, padded to whole panels
  torch::Tensor slot, tables, lens, c, s, xs, qkv, q, att, o, gate_up, act, res, normed;
  torch::Tensor scratch;
  // the buffers' and caches' data, read once (the phases index them per row and item)
  T *xs_p, *qkv_p, *q_p, *att_p, *o_p, *gu_p, *act_p;
  const T *cos_p, *sin_p;
  const int64_t* slot_p;
  std::vector<T*> k_p, v_p;  // [L]
  std::unique_ptr<Owned[]> owned;  // the panels of matmul i, thread t: [i * threads + t]
  std::unique_ptr<std::atomic<int64_t>[]> next;  // a layer's next attention item
  std::unique_ptr<tritonserve_sweep::Items> work;
  bool split = false;  // a split call: rope + K/V writes first, the parts merged after
  // the attention instance for the shapes (the item's KV heads [h0, h1))
#ifdef TS_AVX512_BF16
  tritonserve_decode_bf16::SeqFn bf16_attend = nullptr;
#endif
  decltype(&tritonserve_decode_portable::decode_seq<float, 0>) fp32_attend = nullptr;

  explicit Stack(const Args& args) : a(args) {
    check();
    pack_matmuls();
    allocate();
  }

  void check() {
    const auto dtype = a.x.scalar_type();
    L = static_cast<int64_t>(a.k_caches.size());
    M = a.x.size(0), H = a.x.size(1);
    const auto& k0 = a.k_caches[0];
    block_size = k0.size(1), kv_heads = k0.size(2), D = k0.size(3);
    for (int64_t l = 0; l < L; ++l)
      TORCH_CHECK(a.k_caches[l].sizes() == k0.sizes() && a.v_caches[l].sizes() == k0.sizes() &&
                      a.k_caches[l].is_contiguous() && a.v_caches[l].is_contiguous() &&
                      a.k_caches[l].scalar_type() == dtype &&
                      a.v_caches[l].scalar_type() == dtype,
                  "decode_layers: every layer's caches must be contiguous, one shape, x's dtype");
    TORCH_CHECK(a.num_heads >= 1 && a.num_heads % kv_heads == 0 && D % 2 == 0,
                "decode_layers: num_heads must be a multiple of the caches' kv_heads");
    group = a.num_heads / kv_heads;
    TORCH_CHECK(decode_layers_supported(dtype, D, group, block_size),
                "decode_layers: no attention instance for head size ", D, ", group ", group,
                ", block size ", block_size);
    q_size = a.num_heads * D, kv_size = kv_heads * D, qkv_n = q_size + 2 * kv_size;
    TORCH_CHECK(a.cos.numel() == M * D && a.sin.numel() == M * D &&
                    a.cos.scalar_type() == dtype && a.sin.scalar_type() == dtype,
                "decode_layers: cos and sin must be [M, 1, D] in x's dtype");
    TORCH_CHECK(a.slot_mapping.dim() == 1 && a.slot_mapping.size(0) == M &&
                    a.slot_mapping.scalar_type() == torch::kInt64,
                "decode_layers: slot_mapping must be int64 [M]");
    TORCH_CHECK(a.block_tables.dim() == 2 && a.block_tables.size(0) == M &&
                    a.block_tables.scalar_type() == torch::kInt32 && a.seq_lens.dim() == 1 &&
                    a.seq_lens.size(0) == M && a.seq_lens.scalar_type() == torch::kInt32,
                "decode_layers: block_tables int32 [M, W] and seq_lens int32 [M]");
    slot = a.slot_mapping.contiguous(), tables = a.block_tables.contiguous();
    lens = a.seq_lens.contiguous();
    const int64_t slots = k0.size(0) * block_size, width = tables.size(1);
    for (int64_t b = 0; b < M; ++b) {  // before any write: bad metadata changes nothing
      const int64_t sl = slot.data_ptr<int64_t>()[b], n = lens.data_ptr<int32_t>()[b];
      TORCH_CHECK(sl >= 0 && sl < slots, "decode_layers: slot ", sl, " out of range [0, ",
                  slots, ")");
      TORCH_CHECK(n >= 1 && n <= width * block_size, "decode_layers: seq_len ", n,
                  " out of range [1, ", width * block_size, "]");
    }
  }

  void pack_matmuls() {
    const auto dtype = a.x.scalar_type();
    inter = kBf16 ? a.panels[2].size(0) * (cols / 2) : a.panels[3].size(1);
    mm.resize(4 * L);
    bias32.resize(L);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t in[4] = {H, q_size, H, inter}, out[4] = {qkv_n, H, 2 * inter, H};
      for (int i = 0; i < 4; ++i) {
        const auto& p = a.panels[4 * l + i];
        const bool shaped = kBf16 ? p.dim() == 4 && p.size(2) == cols && p.size(3) == 2 &&
                                        p.size(1) == (in[i] + 1) / 2
                                  : p.dim() == 3 && p.size(2) == cols && p.size(1) == in[i];
        TORCH_CHECK(shaped && p.is_contiguous() && p.scalar_type() == dtype &&
                        out[i] > (p.size(0) - 1) * cols && out[i] <= p.size(0) * cols,
                    "decode_layers: panels[", 4 * l + i, "] do not fit the layer's shapes");
        mm[4 * l + i] = Matmul{p.data_ptr(), in[i], out[i], p.size(0), nullptr, kBf16 && i == 2};
      }
      for (int i = 0; i < 2; ++i)
        TORCH_CHECK(a.norms[2 * l + i].numel() == H && a.norms[2 * l + i].is_contiguous() &&
                        a.norms[2 * l + i].scalar_type() == dtype,
                    "decode_layers: norms[", 2 * l + i, "] must be [H] in x's dtype");
      if (!a.biases.empty()) {
        TORCH_CHECK(a.biases[l].numel() == qkv_n, "decode_layers: biases[", l, "] must be [",
                    qkv_n, "]");
        bias32[l] = torch::zeros({mm[4 * l].P * cols}, a.x.options().dtype(torch::kFloat32));
        bias32[l].narrow(0, 0, qkv_n).copy_(a.biases[l].reshape({qkv_n}));
        mm[4 * l].bias = bias32[l].data_ptr<float>();
      }
    }
  }

  void allocate() {
    threads = std::max<int64_t>(1, at::get_num_threads());
    auto opts = a.x.options();
    c = a.cos.contiguous(), s = a.sin.contiguous();
    xs = a.x.clone();                                 // [M, H]: the input, then down's output
    qkv = torch::empty({M, qkv_n}, opts);             // [M, (Hq + 2 Hk) D]
    q = torch::empty({M, q_size}, opts);              // [M, Hq D] rotated
    Mp = tritonserve_amx::padded_rows(M);             // a matmul input's rows (contracts)
    att = torch::empty({Mp, q_size}, opts);           // [Mp, Hq D]
    o = torch::empty({M, H}, opts);                   // [M, H]
    gate_up = torch::empty({kBf16 ? 0 : M, 2 * inter}, opts);  // fp32: [M, 2I]
    act = torch::empty({Mp, inter}, opts);            // [Mp, I]
    res = torch::zeros({threads, M, H}, opts);        // each thread's residual stream
    normed = torch::empty({threads, Mp, H}, opts);    // each thread's normed rows
    owned.reset(new Owned[4 * L * threads]);
    for (int64_t i = 0; i < 4 * L; ++i)
      for (int64_t t = 0; t < threads; ++t)
        owned[i * threads + t].span.store(static_cast<uint64_t>((t + 1) * mm[i].P / threads)
                                              << 32 |
                                          static_cast<uint64_t>(t * mm[i].P / threads));
    work = std::make_unique<tritonserve_sweep::Items>(tables.data_ptr<int32_t>(),
                                                      lens.data_ptr<int32_t>(), M,
                                                      tables.size(1), kv_heads, threads,
                                                      block_size, kBf16);
    split = work->parts > 1;
    if (split) {
      scratch = torch::empty({work->scratch_floats(a.num_heads, D)},
                             a.x.options().dtype(torch::kFloat32));
      work->use_scratch(scratch.data_ptr<float>(), a.num_heads, D);
    }
    next.reset(new std::atomic<int64_t>[L]);
    for (int64_t l = 0; l < L; ++l) next[l].store(0);
    xs_p = data<T>(xs), qkv_p = data<T>(qkv), q_p = data<T>(q), att_p = data<T>(att);
    o_p = data<T>(o), gu_p = data<T>(gate_up), act_p = data<T>(act);
    cos_p = data<T>(c), sin_p = data<T>(s), slot_p = slot.data_ptr<int64_t>();
    for (int64_t l = 0; l < L; ++l)
      k_p.push_back(data<T>(a.k_caches[l])), v_p.push_back(data<T>(a.v_caches[l]));
#ifdef TS_AVX512_BF16
    if constexpr (kBf16) bf16_attend = tritonserve_decode_bf16::pick(D, group, block_size, false);
#endif
    fp32_attend = D == 64    ? tritonserve_decode_portable::decode_seq<float, 64>
                  : D == 128 ? tritonserve_decode_portable::decode_seq<float, 128>
                             : tritonserve_decode_portable::decode_seq<float, 0>;
  }
};

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
    if (st.split) {  // every (row, KV head)'s rope and write before any part reads them
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
      if (!st.split) rope_store(l, b, it.h0, it.h1);
      attend(l, it, following < work.count ? &after : nullptr, b);
      item = following;
    }
    meet(Phase::kAttention);
#ifdef TS_AVX512_BF16
    if constexpr (kBf16) {
      if (st.split) {  // the parts merged, (row, query head)s shared out
        const int64_t heads = st.a.num_heads;
        for (int64_t r = t; r < M * heads; r += team)
          tritonserve_decode_bf16::merge_parts(
              work, r / heads, r % heads, reinterpret_cast<uint16_t*>(st.att_p) + r * st.D);
        meet(Phase::kAttention);
      }
    }
#endif
  }

  // the post-attention add + norm, gate/up with silu(gate) * up, down
  void mlp_phase(int64_t l) {
    norm(st.o_p, st.a.norms[2 * l + 1]);
    clock.busy(Phase::kNorm);
    T* act = st.act_p;
    if constexpr (kBf16) {
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
    Owned* own = &st.owned[i * threads];
    int64_t p;
    while (take(own[t], true, p)) product(st.mm[i], in, y, ldy, p);
    for (int64_t other = 1; other < threads; ++other)
      while (take(own[(t + other) % threads], false, p)) product(st.mm[i], in, y, ldy, p);
  }

  void product(const Matmul& m, const T* in, T* y, int64_t ldy, int64_t p) {
    const int64_t M = st.M;
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
          for (int64_t i = 0; i < ncols; ++i) y[r * ldy + col + i] += m.bias[col + i];
    }
  }

  // row b's rope and K/V write for KV heads [h0, h1)
  void rope_store(int64_t l, int64_t b, int64_t h0, int64_t h1) {
    const int64_t D = st.D, q_size = st.q_size, kv_size = st.kv_size, group = st.group;
    const int64_t slot = st.slot_p[b];
    const T* row = st.qkv_p + b * st.qkv_n;
    const T* cb = st.cos_p + b * D;
    const T* sb = st.sin_p + b * D;
    T* kc = st.k_p[l] + slot * kv_size;
    T* vc = st.v_p[l] + slot * kv_size;
    T* qb = st.q_p + b * q_size;
    for (int64_t hk = h0; hk < h1; ++hk) {
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
        tritonserve_rows::rotate_row(row + h * D, cb, sb, qb + h * D, D / 2);
      tritonserve_rows::rotate_row(row + q_size + hk * D, cb, sb, kc + hk * D, D / 2);
      std::memcpy(vc + hk * D, row + q_size + kv_size + hk * D, D * sizeof(T));
    }
  }

  // the item's attention over its KV heads [it.h0, it.h1): row b's q in, its att out
  void attend(int64_t l, const Item& it, const Item* following, int64_t b) {
    const T* q_b = st.q_p + b * st.q_size;
    T* att_b = st.att_p + b * st.q_size;
    const T* kc = st.k_p[l];
    const T* vc = st.v_p[l];
    const int64_t D = st.D;
#ifdef TS_AVX512_BF16
    if constexpr (kBf16) {
      st.bf16_attend(
          reinterpret_cast<const uint16_t*>(q_b), reinterpret_cast<const uint16_t*>(kc),
          reinterpret_cast<const uint16_t*>(vc), it, following, st.block_size, st.kv_heads,
          scale, reinterpret_cast<uint16_t*>(att_b), D, D);
      return;
    }
#endif
    if constexpr (!kBf16) {
      st.fp32_attend(q_b, kc, vc, it.table, it.len, st.block_size, st.kv_heads, D, st.group,
                  it.h0, it.h1, scale, att_b, D, D, false);
    }
    (void)following;
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
  return {stack.xs, stack.res[0].clone()};
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
    double eps, double scale) {
  const size_t L = k_caches.size();
  TORCH_CHECK(L >= 1 && v_caches.size() == L && norms.size() == 2 * L &&
                  panels.size() == 4 * L && (biases.empty() || biases.size() == L),
              "decode_layers: L caches each of k and v, 2L norms, 4L panels, L or 0 biases");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && k_caches[0].dim() == 4,
              "decode_layers: x must be a contiguous [M, H] matrix and the caches "
              "[blocks, block_size, kv_heads, D]");
  const Args args{x, norms, panels, biases, cos, sin, slot_mapping, k_caches, v_caches,
                  block_tables, seq_lens, num_heads, eps, scale};
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
        "float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
