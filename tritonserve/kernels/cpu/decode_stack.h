// The decode_layers op's checked arguments and a step's buffers (decode_layers.cpp runs the
// team over them): Args as the op's schema names them, the checks every argument passes
// before anything is written, the matmuls' panels, and the buffers the phases share, each
// matmul input padded to whole AMX tiles (panels_amx.h).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "lora_step.h"
#include "owned_panels.h"
#include "paged_decode_bf16.h"
#include "paged_decode_portable.h"
#include "panels_amx.h"
#include "panels_bf16.h"
#include "panels_fp32.h"
#include "panels_quant_bf16.h"

namespace tritonserve_stack {

using tritonserve_panels::Owned;
using bf16 = c10::BFloat16;

// Whether this build runs the op for a dtype and these shapes: fp32 always (the portable
// attention takes any head size and block size); bf16 with AVX512-BF16, whose attention has
// instances for head sizes 64 and 128, groups up to 8 and pages of a multiple of 16 slots.
inline bool decode_layers_supported(c10::ScalarType dtype, int64_t head_dim, int64_t group,
                             int64_t block_size) {
  if (dtype == c10::kFloat) return head_dim % 2 == 0;
  // a build without AVX512-BF16 has no instance: pick answers nullptr (paged_decode_bf16.h)
  return dtype == c10::kBFloat16 &&
         tritonserve_decode_bf16::pick(head_dim, group, block_size, false) != nullptr;
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
  // the step's own lookups and final norm, done here (the schema's optional three): x is then
  // the embedding table [V, H] and cos / sin the rope tables [P, 1, D] in x's dtype
  const c10::optional<torch::Tensor>& input_ids;  // [M] int64: rows of x
  const c10::optional<torch::Tensor>& positions;  // [M] int64: rows of cos / sin
  const c10::optional<torch::Tensor>& final_norm;  // [H]: the model's last RMSNorm
  // LoRA (lora_rows.h): each row's adapter slot [M] int64 (-1: the base), and a
  // slot's packed blob and index
  const c10::optional<torch::Tensor>& lora_slots;
  const std::vector<torch::Tensor>& lora_blobs;
  const std::vector<torch::Tensor>& lora_index;
  // bf16 dense gate/up panels in pack_gate_up_bf16's layout, silu(gate) * up in the matmul;
  // false: plain panels of 2I outputs (an engine that serves adapters: they add to gate and up)
  bool gate_up_silu;
};

// One matmul of the stack: P panels of a K-wide input's weight with N outputs, an fp32 bias
// (padded to whole panels) or none; silu: bf16's gate/up epilogue (16 outputs a panel);
// quant: the weight is panels_quant.h's records (16 columns a panel) of `kind`.
struct Matmul {
  const void* w;
  int64_t K, N, P;
  const float* bias;
  bool silu, quant;
  tritonserve_panels_quant::Kind kind;
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
  bool int8_kv = false;  // the caches hold int8 rows (k8, v8; k_p and v_p stay empty)
  std::vector<int8_t*> k8, v8;  // [L]
  std::unique_ptr<Owned[]> owned;  // the panels of matmul i, thread t: [i * threads + t]
  std::unique_ptr<std::atomic<int64_t>[]> next;  // a layer's next attention item
  std::unique_ptr<tritonserve_sweep::Items> work;
  tritonserve_lora::Step lora;  // the step's adapters (lora_step.h)
  bool split = false;  // a split call: rope + K/V writes first, the parts merged after
  // rope + K/V writes first: a split call, or rows of one sequence (a speculating request's
  // K + 1 rows: engine/speculative.py), where a row attends to the rows before it
  bool write_first = false;
  // the attention instance for the shapes (the item's KV heads [h0, h1))
  tritonserve_decode_bf16::SeqFn bf16_attend = nullptr;
  decltype(&tritonserve_decode_portable::decode_seq<float, 0>) fp32_attend = nullptr;
  decltype(&tritonserve_decode_portable::decode_seq<T, 0, int8_t>) int8_attend = nullptr;

  explicit Stack(const Args& args) : a(args) {
    check();
    pack_matmuls();
    check_lora();
    allocate();
  }

  void check() {
    const auto dtype = a.x.scalar_type();
    L = static_cast<int64_t>(a.k_caches.size());
    M = a.x.size(0), H = a.x.size(1);
    if (a.input_ids) {
      const auto& ids = *a.input_ids;
      TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64,
                  "decode_layers: input_ids must be int64 [M]");
      M = ids.size(0);
      in_range(ids, a.x.size(0), "input_ids", "token id");
    }
    if (a.final_norm)
      TORCH_CHECK(a.final_norm->numel() == H && a.final_norm->is_contiguous() &&
                      a.final_norm->scalar_type() == dtype,
                  "decode_layers: final_norm must be [H] in x's dtype");
    const auto& k0 = a.k_caches[0];
    // an int8 cache: rows of D codes + their fp32 scale (paged_decode_portable.h)
    int8_kv = k0.scalar_type() == torch::kChar;
    const auto kv_dtype = int8_kv ? torch::kChar : dtype;
    block_size = k0.size(1), kv_heads = k0.size(2);
    D = k0.size(3) - (int8_kv ? tritonserve_decode_portable::kScaleBytes<int8_t> : 0);
    for (int64_t l = 0; l < L; ++l)
      TORCH_CHECK(a.k_caches[l].sizes() == k0.sizes() && a.v_caches[l].sizes() == k0.sizes() &&
                      a.k_caches[l].is_contiguous() && a.v_caches[l].is_contiguous() &&
                      a.k_caches[l].scalar_type() == kv_dtype &&
                      a.v_caches[l].scalar_type() == kv_dtype,
                  "decode_layers: every layer's caches must be contiguous, one shape, x's "
                  "dtype or int8");
    TORCH_CHECK(a.num_heads >= 1 && a.num_heads % kv_heads == 0 && D % 2 == 0,
                "decode_layers: num_heads must be a multiple of the caches' kv_heads");
    group = a.num_heads / kv_heads;
    TORCH_CHECK(decode_layers_supported(dtype, D, group, block_size),
                "decode_layers: no attention instance for head size ", D, ", group ", group,
                ", block size ", block_size);
    q_size = a.num_heads * D, kv_size = kv_heads * D, qkv_n = q_size + 2 * kv_size;
    const int64_t rope_rows = a.positions ? a.cos.size(0) : M;
    TORCH_CHECK(a.cos.numel() == rope_rows * D && a.sin.numel() == rope_rows * D &&
                    a.cos.scalar_type() == dtype && a.sin.scalar_type() == dtype,
                "decode_layers: cos and sin must be [M, 1, D] (with positions: [P, 1, D]) "
                "in x's dtype");
    if (a.positions) {
      TORCH_CHECK(a.positions->dim() == 1 && a.positions->size(0) == M &&
                      a.positions->scalar_type() == torch::kInt64,
                  "decode_layers: positions must be int64 [M]");
      in_range(*a.positions, rope_rows, "positions", "position");
    }
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

  // every index of `idx` in [0, n), checked before anything is written
  static void in_range(const torch::Tensor& idx, int64_t n, const char* name, const char* what) {
    const auto c = idx.contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    for (int64_t i = 0; i < c.numel(); ++i)
      TORCH_CHECK(p[i] >= 0 && p[i] < n, "decode_layers: ", name, ": ", what, " ", p[i],
                  " out of range [0, ", n, ")");
  }

  // rows idx of table [n, width] (contiguous): a new [M, width] tensor
  static torch::Tensor gather(const torch::Tensor& table, const torch::Tensor& idx,
                              int64_t width) {
    const auto t = table.contiguous();
    const auto c = idx.contiguous();
    auto out = torch::empty({c.numel(), width}, t.options());
    const int64_t* p = c.data_ptr<int64_t>();
    const size_t row = width * t.element_size();
    for (int64_t i = 0; i < c.numel(); ++i)
      std::memcpy(static_cast<char*>(out.data_ptr()) + i * row,
                  static_cast<const char*>(t.data_ptr()) + p[i] * row, row);
    return out;
  }

  // down's input width (the intermediate size), from its panels in any form
  static int64_t down_k(const torch::Tensor& p) {
    if (p.scalar_type() == torch::kUInt8) return p.size(1) * tritonserve_panels_quant::kGroup;
    return kBf16 ? p.size(1) * 2 : p.size(1);
  }

  void pack_matmuls() {
    const auto dtype = a.x.scalar_type();
    inter = down_k(a.panels[3]);
    mm.resize(4 * L);
    bias32.resize(L);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t in[4] = {H, q_size, H, inter}, out[4] = {qkv_n, H, 2 * inter, H};
      for (int i = 0; i < 4; ++i) {
        const auto& p = a.panels[4 * l + i];
        namespace pq = tritonserve_panels_quant;
        pq::Kind kind = pq::Kind::kU4;
        const bool quant = p.scalar_type() == torch::kUInt8;
        // bf16 dense gate/up: pack_gate_up_bf16's 16 outputs a panel
        const bool silu = kBf16 && i == 2 && !quant && a.gate_up_silu;
        const int64_t c = quant ? pq::kCols : silu ? cols / 2 : cols;
        const bool shaped =
            quant ? p.dim() == 3 && pq::kind_of(p.size(2), kind) &&
                        p.size(1) * pq::kGroup == in[i]
            : kBf16 ? p.dim() == 4 && p.size(2) == cols && p.size(3) == 2 &&
                          p.size(1) == (in[i] + 1) / 2 && p.scalar_type() == dtype
                    : p.dim() == 3 && p.size(2) == cols && p.size(1) == in[i] &&
                          p.scalar_type() == dtype;
        const int64_t outs = silu ? out[i] / 2 : out[i];
        TORCH_CHECK(shaped && p.is_contiguous() && outs > (p.size(0) - 1) * c &&
                        outs <= p.size(0) * c,
                    "decode_layers: panels[", 4 * l + i, "] do not fit the layer's shapes");
        mm[4 * l + i] = Matmul{p.data_ptr(), in[i], out[i], p.size(0), nullptr, silu, quant,
                               kind};
      }
      for (int i = 0; i < 2; ++i)
        TORCH_CHECK(a.norms[2 * l + i].numel() == H && a.norms[2 * l + i].is_contiguous() &&
                        a.norms[2 * l + i].scalar_type() == dtype,
                    "decode_layers: norms[", 2 * l + i, "] must be [H] in x's dtype");
      if (!a.biases.empty()) {
        TORCH_CHECK(a.biases[l].numel() == qkv_n, "decode_layers: biases[", l, "] must be [",
                    qkv_n, "]");
        const int64_t width = mm[4 * l].quant ? tritonserve_panels_quant::kCols : cols;
        bias32[l] = torch::zeros({mm[4 * l].P * width}, a.x.options().dtype(torch::kFloat32));
        bias32[l].narrow(0, 0, qkv_n).copy_(a.biases[l].reshape({qkv_n}));
        mm[4 * l].bias = bias32[l].data_ptr<float>();
      }
    }
  }

  // the adapters' packed tensors, checked against the matmuls (lora_step.h)
  void check_lora() {
    std::vector<tritonserve_lora::Shape> shapes;
    for (const auto& m : mm) shapes.push_back({m.K, m.N, m.silu});
    lora.check(a.lora_slots, a.lora_blobs, a.lora_index, M, shapes);
  }

  void allocate() {
    threads = std::max<int64_t>(1, at::get_num_threads());
    auto opts = a.x.options();
    c = a.positions ? gather(a.cos, *a.positions, D) : a.cos.contiguous();
    s = a.positions ? gather(a.sin, *a.positions, D) : a.sin.contiguous();
    // [M, H]: the input, then down's output
    xs = a.input_ids ? gather(a.x, *a.input_ids, H) : a.x.clone();
    qkv = torch::empty({M, qkv_n}, opts);             // [M, (Hq + 2 Hk) D]
    q = torch::empty({M, q_size}, opts);              // [M, Hq D] rotated
    Mp = tritonserve_amx::padded_rows(M);             // a matmul input's rows (contracts)
    att = torch::empty({Mp, q_size}, opts);           // [Mp, Hq D]
    o = torch::empty({M, H}, opts);                   // [M, H]
    bool fused = true;  // every gate/up with its activation in the matmul (bf16 dense)
    for (int64_t l = 0; l < L; ++l) fused = fused && mm[4 * l + 2].silu;
    gate_up = torch::empty({fused ? 0 : M, 2 * inter}, opts);  // [M, 2I] where not fused
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
                                                      block_size, true);
    split = work->parts > 1;
    write_first = split;
    {
      const int32_t* tp = tables.data_ptr<int32_t>();
      const int64_t width = tables.size(1);
      std::vector<int32_t> firsts;
      firsts.reserve(M);
      for (int64_t r = 0; r < M && width > 0; ++r) firsts.push_back(tp[r * width]);
      std::sort(firsts.begin(), firsts.end());
      write_first = write_first || std::adjacent_find(firsts.begin(), firsts.end()) != firsts.end();
    }
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
    for (int64_t l = 0; l < L && int8_kv; ++l)
      k8.push_back(a.k_caches[l].data_ptr<int8_t>()), v8.push_back(a.v_caches[l].data_ptr<int8_t>());
    for (int64_t l = 0; l < L && !int8_kv; ++l)
      k_p.push_back(data<T>(a.k_caches[l])), v_p.push_back(data<T>(a.v_caches[l]));
    int8_attend = D == 64    ? tritonserve_decode_portable::decode_seq<T, 64, int8_t>
                  : D == 128 ? tritonserve_decode_portable::decode_seq<T, 128, int8_t>
                             : tritonserve_decode_portable::decode_seq<T, 0, int8_t>;
    if constexpr (kBf16) bf16_attend = tritonserve_decode_bf16::pick(D, group, block_size, false);
    fp32_attend = D == 64    ? tritonserve_decode_portable::decode_seq<float, 64>
                  : D == 128 ? tritonserve_decode_portable::decode_seq<float, 128>
                             : tritonserve_decode_portable::decode_seq<float, 0>;
  }
};

}  // namespace tritonserve_stack
