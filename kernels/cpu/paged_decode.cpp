// paged_decode_attention for the CPU: one new query per sequence over its paged KV cache,
// read in place through the block table (no gather into new tensors, no host read-back).
//
// Work item: one sequence with all its heads (at batch >= 4 x threads), else one (sequence,
// KV head), so that small batches still use every thread. Tokens are taken a page at a time,
// the pages read into the cache a sweep ahead (page_sweep.h; not for `cached` rows); scores
// for the page, then an online-softmax update of the accumulators (flash-decoding's
// recurrence, in fp32 whatever the cache dtype; a bf16/fp16 page is converted once, not once
// per query head). The value pass runs head by head so each head's accumulator stays in
// registers. Measured (batch 64, SmolLM2 heads, lengths 50-400, pages scattered, fp32):
// 4.0-4.9 ms per call with one (sequence, KV head) per item and a row at a time, 2.6-3.0 ms
// now; bf16 4.5 -> 2.5 ms (docs/benchmarks.md). On a Zen 5, in the engine (batch 64, 128-
// token prompts, bf16): a vectorised exp 698-702 -> 616-635 us a call, then the dots of 16
// tokens summed in one shuffle tree (page_scores) 640-657 -> 586-618 (ninth session).
// bf16 caches on a build with AVX512-BF16 take paged_decode_bf16.h instead (scores by
// vdpbf16ps on the raw pages, no conversion buffers): warm 0.27 -> 0.13 ms a call, in the
// engine (batch 64, 64-token prompts) 327 -> 240-290 us; with the next pages asked for
// spread over the compute (batch 64, 128-token prompts) 460-475 -> 261-264 us (tenth session).
// `cached` (prefill rows, whose pages were just written) picks that kernel's schedule for
// cached pages; the portable path only skips its sweep.
// Registered as torch.ops.tritonserve.paged_decode_attention (CPU); kernels/cpu_ops.py
// builds it and registers the fake (shape-only) implementation torch.compile traces with.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "page_sweep.h"
#include "paged_decode_bf16.h"
#include "vec_math.h"

namespace {

using tritonserve_vec::exp_clamped;
using tritonserve_vec::sum_lanes16;
using tritonserve_vec::v16;

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// A page's rows for kv heads [h0, h0 + nh) as fp32: in place for an fp32 cache (row stride
// `row`), else converted once into `buffer` (row stride nh * head_dim).
template <typename T>
inline const float* page_as_float(const T* page, float* buffer, int64_t n, int64_t nh,
                                  int64_t row, int64_t head_dim) {
  if constexpr (std::is_same_v<T, float>) {
    return page;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bf16 -> fp32 is the 16 bits shifted up: on raw integers the loop vectorises (through
    // c10::BFloat16's conversion it did not: SmolLM2 heads, batch 64, 64-192 tokens, 0.607 ->
    // 0.57 ms a call on a Zen 5 EPYC; docs/benchmarks.md, ninth session)
    const int64_t span = nh * head_dim;
    const auto* bits = reinterpret_cast<const uint16_t*>(page);
    auto* out = reinterpret_cast<uint32_t*>(buffer);
    for (int64_t t = 0; t < n; ++t)
#pragma omp simd
      for (int64_t d = 0; d < span; ++d)
        out[t * span + d] = static_cast<uint32_t>(bits[t * row + d]) << 16;
    return buffer;
  } else {
    const int64_t span = nh * head_dim;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < span; ++d) buffer[t * span + d] = to_float(page[t * row + d]);
    return buffer;
  }
}

// scores[t] = q . k_t for tokens [0, n) of a page (k_t at k + t * krow), HD a multiple of 16,
// the block size a multiple of 16: per token the products' 16-lane partial sums, then sixteen
// tokens reduced at once. All 16 rows of a group are read (a fixed count keeps the sums in
// registers; with n's count they went to memory, 10-20 % slower): each lies inside the page,
// and a row past n only feeds a lane that is never stored.
template <int HD>
inline void page_scores(const float* q, const float* k, int64_t krow, int64_t n,
                        float* scores) {
  static_assert(HD % 16 == 0, "whole 16-lane chunks");
  v16 qv[HD / 16];
  std::memcpy(qv, q, sizeof qv);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    v16 a[16];
    for (int j = 0; j < 16; ++j) {
      const float* kt = k + (t0 + j) * krow;
      v16 kv;
      std::memcpy(&kv, kt, sizeof kv);
      v16 acc = qv[0] * kv;
      for (int c = 1; c < HD / 16; ++c) {
        std::memcpy(&kv, kt + 16 * c, sizeof kv);
        acc += qv[c] * kv;
      }
      a[j] = acc;
    }
    const v16 sums = sum_lanes16(a);
    std::memcpy(scores + t0, &sums, std::min<int64_t>(16, n - t0) * sizeof(float));
  }
}

// HD > 0: the head size known at compile time (64, 128: fully unrolled, vectorised loops);
// HD == 0: any head size, from head_dim_arg. One sequence, KV heads [h0, h1) and their
// query heads; q / out point at the sequence's row.
template <typename scalar_t, int HD>
void decode_seq(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                const int32_t* table, int64_t seq_len, int64_t block_size,
                int64_t kv_heads, int64_t head_dim_arg, int64_t group, int64_t h0, int64_t h1,
                float scale, scalar_t* out, int64_t q_head_stride, int64_t out_head_stride,
                bool cached) {
  const int64_t head_dim = HD > 0 ? HD : head_dim_arg;
  const int64_t heads = (h1 - h0) * group;  // the query heads of kv heads [h0, h1)
  const int64_t row = kv_heads * head_dim;  // elements between two token slots
  std::vector<float> qf(heads * head_dim), acc(heads * head_dim, 0.0f);
  std::vector<float> m(heads, -std::numeric_limits<float>::infinity()), l(heads, 0.0f);
  std::vector<float> scores(heads * block_size);
  std::vector<float> kbuf(std::is_same_v<scalar_t, float> ? 0 : block_size * (h1 - h0) * head_dim);
  std::vector<float> vbuf(kbuf.size());
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* qh = q + (h0 * group + h) * q_head_stride;
    for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = to_float(qh[d]) * scale;
  }
  const int64_t chunk =
      tritonserve_sweep::chunk_pages(block_size * (h1 - h0) * head_dim * sizeof(scalar_t));
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const int64_t n = std::min(block_size, seq_len - start);
    const int64_t p = start / block_size, page = table[p];
    const scalar_t* kp = k_cache + page * block_size * row + h0 * head_dim;
    const scalar_t* vp = v_cache + page * block_size * row + h0 * head_dim;
    if (!cached && p % chunk == 0)  // the next sweep's pages into the cache (page_sweep.h)
      tritonserve_sweep::sweep(k_cache, v_cache, table, seq_len, p,
                               std::min(p + chunk, (seq_len + block_size - 1) / block_size),
                               block_size, row, h0 * head_dim, (h1 - h0) * head_dim);
    const float* kf_page = page_as_float(kp, kbuf.data(), n, h1 - h0, row, head_dim);
    const float* vf_page = page_as_float(vp, vbuf.data(), n, h1 - h0, row, head_dim);
    const int64_t frow = std::is_same_v<scalar_t, float> ? row : (h1 - h0) * head_dim;
    bool scored = false;
    if constexpr (HD > 0 && HD % 16 == 0) {
      if (block_size % 16 == 0) {  // the engine's case (block sizes 16 and 32)
        for (int64_t h = 0; h < heads; ++h)
          page_scores<HD>(qf.data() + h * HD, kf_page + (h / group) * HD, frow, n,
                          scores.data() + h * block_size);
        scored = true;
      }
    }
    for (int64_t t = 0; !scored && t < n; ++t) {
      for (int64_t hk = 0; hk < h1 - h0; ++hk) {  // a KV head, then its group of queries (an
        const float* k = kf_page + t * frow + hk * head_dim;  // h / group here: an idiv each)
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          const float* qh = qf.data() + h * head_dim;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * k[d];
          scores[h * block_size + t] = s;
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* sh = scores.data() + h * block_size;
      float page_max = *std::max_element(sh, sh + n);
      const float m_new = std::max(m[h], page_max);
      const float alpha = std::exp(m[h] - m_new);  // exp(-inf) = 0 on the first page
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sh[t] = exp_clamped(sh[t] - m_new);
        sum += sh[t];
      }
      l[h] = l[h] * alpha + sum;
      m[h] = m_new;
      float* ah = acc.data() + h * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) ah[d] *= alpha;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* vh = vf_page + (h / group) * head_dim;
      const float* sh = scores.data() + h * block_size;
      float* ah = acc.data() + h * head_dim;
      float a[HD > 0 ? HD : 1];
      if constexpr (HD > 0) {
        for (int64_t d = 0; d < HD; ++d) a[d] = ah[d];
        for (int64_t t = 0; t < n; ++t) {
          const float p = sh[t];
          const float* v = vh + t * frow;
#pragma omp simd
          for (int64_t d = 0; d < HD; ++d) a[d] += p * v[d];
        }
        for (int64_t d = 0; d < HD; ++d) ah[d] = a[d];
      } else {
        for (int64_t t = 0; t < n; ++t) {
          const float p = sh[t];
          const float* v = vh + t * frow;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * v[d];
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* oh = out + (h0 * group + h) * out_head_stride;
    const float inv = 1.0f / l[h];
    for (int64_t d = 0; d < head_dim; ++d) oh[d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
  }
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale,
                                     bool cached) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q [B, H, D] and caches [blocks, block_size, kv_heads, D] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && heads % kv_heads == 0, "head shapes do not fit");
  const int64_t group = heads / kv_heads;
  auto qc = q.stride(2) == 1 ? q : q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty({batch, heads, head_dim}, q.options());
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int64_t table_stride = tables.size(1);
  // items per sequence: 1 (whole pages, sequential reads) when there are enough sequences
  // to keep every thread busy, else one per KV head (batch 1 would otherwise use one core)
  const int64_t split = batch >= 4 * at::get_num_threads() ? 1 : kv_heads;
  // item -> (sequence, KV heads [h0, h1)), longest sequences first, each thread claiming the
  // next item when it is done: a static split of the range left the thread with the longer
  // sequences finishing last
  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return len_ptr[a] > len_ptr[b]; });
  // work(item, following): each thread claims its next item before it runs this one (the
  // bf16 path asks for the following item's first page during this one's last); following
  // is -1 when there is none
  const int64_t items = batch * split;
  auto for_each_item = [&](auto&& work) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t item = next++; item < items;) {
        const int64_t following = next++;
        work(item, following < items ? following : -1);
        item = following;
      }
    });
  };
  // an item's sequence and KV heads [h0, h1)
  auto seq_of = [&](int64_t item) { return order[item / split]; };
  auto h0_of = [&](int64_t item) { return item % split * kv_heads / split; };
  auto h1_of = [&](int64_t item) { return (item % split + 1) * kv_heads / split; };
  const int64_t q_seq_stride = qc.stride(0), q_head_stride = qc.stride(1);
#ifdef TRITONSERVE_DECODE_BF16
  if (q.scalar_type() == at::kBFloat16) {
    if (auto one = tritonserve_decode_bf16::pick(head_dim, group, block_size, cached)) {
      using tritonserve_decode_bf16::Item;
      const auto* q_ptr = reinterpret_cast<const uint16_t*>(qc.data_ptr());
      const auto* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
      const auto* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
      auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr());
      auto item_at = [&](int64_t item) {
        const int64_t b = seq_of(item);
        return Item{table_ptr + b * table_stride, len_ptr[b], h0_of(item), h1_of(item)};
      };
      for_each_item([&](int64_t item, int64_t following) {
        const Item it = item_at(item);
        const Item after = following >= 0 ? item_at(following) : it;
        const int64_t b = seq_of(item);
        one(q_ptr + b * q_seq_stride, k_ptr, v_ptr, it, following >= 0 ? &after : nullptr,
            block_size, kv_heads, static_cast<float>(scale), out_ptr + b * heads * head_dim,
            q_head_stride, head_dim);
      });
      return out;
    }
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* q_ptr = qc.data_ptr<scalar_t>();
    const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    auto one = head_dim == 64 ? decode_seq<scalar_t, 64>
             : head_dim == 128 ? decode_seq<scalar_t, 128> : decode_seq<scalar_t, 0>;
    for_each_item([&](int64_t item, int64_t) {
      const int64_t b = seq_of(item);
      one(q_ptr + b * q_seq_stride, k_ptr, v_ptr, table_ptr + b * table_stride, len_ptr[b],
          block_size, kv_heads, head_dim, group, h0_of(item), h1_of(item),
          static_cast<float>(scale), out_ptr + b * heads * head_dim, q_head_stride, head_dim,
          cached);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tritonserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, bool cached=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
