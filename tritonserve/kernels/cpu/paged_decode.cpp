// paged_decode_attention for the CPU: one new query per sequence over its paged KV cache,
// read in place through the block table (no gather into new tensors, no host read-back).
//
// Work item: one sequence with all its heads (at batch >= 4 x threads), else one (sequence,
// KV head), so that small batches still use every thread. Tokens are taken a page at a time,
// the pages read into the cache a sweep ahead (page_sweep.h; not for `cached` rows); scores
// for the page, then an online-softmax update of the accumulators (flash-decoding's
// recurrence, in fp32 whatever the cache dtype; a bf16/fp16 page is converted once, not once
// per query head). Head sizes 64 / 128 / 256 score and weigh a KV head's whole group of query
// heads over each page at once (page_group.h). Measured (batch 64, SmolLM2 heads, lengths 50-400, pages scattered, fp32):
// 4.0-4.9 ms per call with one (sequence, KV head) per item and a row at a time, 2.6-3.0 ms
// now; bf16 4.5 -> 2.5 ms (docs/perf-log/2026-cpu-decode.md). On a Zen 5, in the engine (batch 64, 128-
// token prompts, bf16): a vectorised exp 698-702 -> 616-635 us a call, then the dots of 16
// tokens summed in one shuffle tree 640-657 -> 586-618 (since replaced by page_group.h).
// bf16 caches on a build with AVX512-BF16 take paged_decode_bf16.h instead (scores by
// vdpbf16ps on the raw pages, no conversion buffers): warm 0.27 -> 0.13 ms a call, in the
// engine (batch 64, 64-token prompts) 327 -> 240-290 us; with the next pages asked for
// spread over the compute (batch 64, 128-token prompts) 460-475 -> 261-264 us.
// `cached` (prefill rows, whose pages were just written) picks that kernel's schedule for
// cached pages; the portable path only skips its sweep. `window` (> 0: a sliding window, each
// row seeing its last `window` tokens, the pages before them not read) and `softcap` (> 0:
// Gemma 2's score soft-cap) run the portable path in every dtype, as does an int8 cache
// (rows of head_dim codes + an fp32 scale: --kv-cache-dtype int8), its codes converted in
// registers (page_group.h), and so do `sinks` (fp32 [heads]: gpt-oss's sink logits, each in
// its head's softmax denominator).
// Registered as torch.ops.tritonserve.paged_decode_attention (CPU); kernels/cpu/__init__.py
// builds it and registers the fake (shape-only) implementation torch.compile traces with.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "page_sweep.h"
#include "paged_decode_bf16.h"
#include "paged_decode_portable.h"

namespace {

using tritonserve_decode_portable::decode_seq;

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     bool cached, int64_t window, double softcap,
                                     const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q [B, H, D] and caches [blocks, block_size, kv_heads, D] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  // an int8 cache: rows of head_dim codes + their fp32 scale (paged_decode_portable.h)
  const bool int8_kv = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || int8_kv,
              "q and cache dtypes differ (an int8 cache aside)");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k and v cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim + (int8_kv ? 4 : 0) && heads % kv_heads == 0,
              "head shapes do not fit");
  const int64_t group = heads / kv_heads;
  auto qc = q.stride(2) == 1 ? q : q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty({batch, heads, head_dim}, q.options());
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  // a window or a soft-cap: the portable kernel (the bf16 one takes neither); a window no
  // row reaches past is no window (a windowed layer's every call passes it: the engine reads
  // no lengths on the host)
  int32_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, len_ptr[b]);
  torch::Tensor sinks_f;  // fp32 [heads], or undefined
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == heads, "sinks must be [heads]");
    sinks_f = sinks->to(torch::kFloat32).contiguous();
  }
  const float* sink_ptr = sinks_f.defined() ? sinks_f.data_ptr<float>() : nullptr;
  const bool plain = (window <= 0 || longest <= window) && softcap <= 0.0 &&
                     sink_ptr == nullptr;
  // a call of one or two sequences splits their pages into parts (page_sweep.h's Items):
  // the bf16 streaming kernel's and the portable one's; not for prefill rows (`cached`), a
  // window or a soft-cap
  const bool splits = plain && !cached;
  tritonserve_sweep::Items work(table_ptr, len_ptr, batch, tables.size(1), kv_heads,
                                at::get_num_threads(), block_size, splits);
  torch::Tensor scratch;  // the parts' sums of a split call
  if (const int64_t floats = work.scratch_floats(heads, head_dim)) {
    scratch = torch::empty({floats}, q.options().dtype(torch::kFloat32));
    work.use_scratch(scratch.data_ptr<float>(), heads, head_dim);
  }
  // work(item, following): each thread claims its next item before it runs this one (the
  // bf16 path asks for the following item's first page during this one's last); following
  // is -1 when there is none
  const int64_t items = work.count;
  auto for_each_item = [&](auto&& run) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t item = next++; item < items;) {
        const int64_t following = next++;
        run(item, following < items ? following : -1);
        item = following;
      }
    });
  };
  const int64_t q_seq_stride = qc.stride(0), q_head_stride = qc.stride(1);
  if (plain && q.scalar_type() == at::kBFloat16 && !int8_kv) {  // only with AVX512-BF16
    if (auto one = tritonserve_decode_bf16::pick(head_dim, group, block_size, cached)) {
      using tritonserve_decode_bf16::Item;
      const auto* q_ptr = reinterpret_cast<const uint16_t*>(qc.data_ptr());
      const auto* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
      const auto* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
      auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr());
      for_each_item([&](int64_t item, int64_t following) {
        const Item it = work.at(item);
        const Item after = following >= 0 ? work.at(following) : it;
        const int64_t b = work.seq(item);
        one(q_ptr + b * q_seq_stride, k_ptr, v_ptr, it, following >= 0 ? &after : nullptr,
            block_size, kv_heads, static_cast<float>(scale), out_ptr + b * heads * head_dim,
            q_head_stride, head_dim);
      });
      if (work.parts > 1)
        at::parallel_for(0, batch * heads, 1, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r)
            tritonserve_sweep::merge_parts(work, r / heads, r % heads, out_ptr + r * head_dim,
                                           tritonserve_vec::float_to_bf16);
        });
      return out;
    }
  }
  auto portable = [&](auto* k_ptr, auto* v_ptr, auto* q_ptr, auto* out_ptr) {
    using scalar_t = std::remove_cv_t<std::remove_pointer_t<decltype(q_ptr)>>;
    using cache_t = std::remove_cv_t<std::remove_pointer_t<decltype(k_ptr)>>;
    // 256: Gemma 2 / 3 (their 270M shape, batch 16, ~100 tokens: 250 us a call generic)
    auto one = head_dim == 64    ? decode_seq<scalar_t, 64, cache_t>
               : head_dim == 128 ? decode_seq<scalar_t, 128, cache_t>
               : head_dim == 256 ? decode_seq<scalar_t, 256, cache_t>
                                 : decode_seq<scalar_t, 0, cache_t>;
    for_each_item([&](int64_t item, int64_t) {
      const tritonserve_sweep::Item it = work.at(item);
      const int64_t b = work.seq(item);
      one(q_ptr + b * q_seq_stride, k_ptr, v_ptr, it.table, it.len,
          block_size, kv_heads, head_dim, group, it.h0, it.h1,
          static_cast<float>(scale), out_ptr + b * heads * head_dim, q_head_stride, head_dim,
          cached, plain ? 0 : window, static_cast<float>(softcap), it.p0, it.p1, it.partial,
          sink_ptr);
    });
    if (work.parts > 1)
      at::parallel_for(0, batch * heads, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          tritonserve_sweep::merge_parts(work, r / heads, r % heads, out_ptr + r * head_dim,
                                         [](float x) { return static_cast<scalar_t>(x); });
      });
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (int8_kv)
      portable(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
               qc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
    else
      portable(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
               qc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
  });
  return out;
}

std::string isa_levels() { return tritonserve_isa::levels(); }

}  // namespace

TORCH_LIBRARY(tritonserve, m) {
  // the library's ISA levels (isa.h), comma-separated: what Python's choices ask
  m.def("isa_levels() -> str", &isa_levels);
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, bool cached=False, int window=0, float softcap=0.0, "
        "Tensor? sinks=None) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
