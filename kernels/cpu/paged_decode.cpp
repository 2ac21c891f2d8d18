// paged_decode_attention for the CPU: one new query per sequence over its paged KV cache,
// read in place through the block table (no gather into new tensors, no host read-back).
//
// Work item: (sequence, KV head). Its G query heads share every K/V row they read (GQA).
// Tokens are taken a page at a time: scores for the page, then an online-softmax update of
// the G accumulators (flash-decoding's recurrence, in fp32 whatever the cache dtype).
// Registered as torch.ops.tritonserve.paged_decode_attention (CPU); kernels/cpu_ops.py
// builds it and registers the fake (shape-only) implementation torch.compile traces with.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// A cache row as fp32: in place for an fp32 cache, else converted into `buffer`.
template <typename T>
inline const float* as_float(const T* row, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < n; ++d) buffer[d] = to_float(row[d]);
    return buffer;
  }
}

// HD > 0: the head size known at compile time (64, 128: fully unrolled, vectorised loops);
// HD == 0: any head size, from head_dim_arg.
template <typename scalar_t, int HD>
void decode_one(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                const int32_t* table, int64_t seq_len, int64_t block_size,
                int64_t kv_heads, int64_t head_dim_arg, int64_t group, int64_t kv_head,
                float scale, scalar_t* out, int64_t q_head_stride, int64_t out_head_stride) {
  const int64_t head_dim = HD > 0 ? HD : head_dim_arg;
  const int64_t row = kv_heads * head_dim;  // elements between two token slots
  std::vector<float> qf(group * head_dim), acc(group * head_dim, 0.0f);
  std::vector<float> m(group, -std::numeric_limits<float>::infinity()), l(group, 0.0f);
  std::vector<float> scores(group * block_size), kf(head_dim);
  for (int64_t g = 0; g < group; ++g) {
    const scalar_t* qg = q + (kv_head * group + g) * q_head_stride;
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(qg[d]) * scale;
  }
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const int64_t n = std::min(block_size, seq_len - start);
    const int64_t page = table[start / block_size];
    const scalar_t* kp = k_cache + page * block_size * row + kv_head * head_dim;
    const scalar_t* vp = v_cache + page * block_size * row + kv_head * head_dim;
    for (int64_t t = 0; t < n; ++t) {
      const float* k = as_float(kp + t * row, kf.data(), head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf.data() + g * head_dim;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * k[d];
        scores[g * block_size + t] = s;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores.data() + g * block_size;
      float page_max = *std::max_element(sg, sg + n);
      const float m_new = std::max(m[g], page_max);
      const float alpha = std::exp(m[g] - m_new);  // exp(-inf) = 0 on the first page
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = std::exp(sg[t] - m_new);
        sum += sg[t];
      }
      l[g] = l[g] * alpha + sum;
      m[g] = m_new;
      float* ag = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) ag[d] *= alpha;
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* v = as_float(vp + t * row, kf.data(), head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * block_size + t];
        float* ag = acc.data() + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * v[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    scalar_t* og = out + (kv_head * group + g) * out_head_stride;
    const float inv = 1.0f / l[g];
    for (int64_t d = 0; d < head_dim; ++d) og[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv);
  }
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale) {
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* q_ptr = qc.data_ptr<scalar_t>();
    const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t q_seq_stride = qc.stride(0), q_head_stride = qc.stride(1);
    auto one = head_dim == 64 ? decode_one<scalar_t, 64>
             : head_dim == 128 ? decode_one<scalar_t, 128> : decode_one<scalar_t, 0>;
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / kv_heads, h = item % kv_heads;
        one(q_ptr + b * q_seq_stride, k_ptr, v_ptr, table_ptr + b * table_stride, len_ptr[b],
            block_size, kv_heads, head_dim, group, h, static_cast<float>(scale),
            out_ptr + b * heads * head_dim, q_head_stride, head_dim);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tritonserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
