// Fused elementwise ops of a decoder layer for the CPU, one pass over each row:
//   add_rms_norm(x!, residual!, weight, eps): residual += x; x = weight * rms_norm(residual)
//     (vLLM's fused_add_rms_norm contract: both tensors updated in place, nothing allocated)
//   silu_and_mul(x) -> out: x [T, 2I] -> silu(x[:, :I]) * x[:, I:]  [T, I]
//   rotary_embedding(x, cos, sin) -> out: x [T, heads, D] (rows of any stride) rotated by
//     rotate-half rope, out = x * cos + rotate_half(x) * sin  [T, heads, D] contiguous; cos,
//     sin [T, 1, D] (the step's lookup). In fp32, rounded once to the dtype (what Inductor's
//     fused kernel computes in the compiled step); eager torch rounds after each op.
//   rope_store_kv(qkv, cos, sin, slot_mapping, k_cache!, v_cache!, num_heads) -> q: the qkv
//     projection's output [T, (H + 2 Hk) D] split, q and k rotated as rotary_embedding does,
//     the rotated k and v written at slot_mapping[t] of the caches [blocks, block, Hk, D]
//     (-1: not written), q returned [T, H, D]: one pass where the compiled bf16 step ran an
//     Inductor kernel of seven loops and barriers, 30 us a layer at batch 64.
// Numerics follow transformers' Llama: the residual sum is rounded to the tensor dtype, the
// statistics and the normalisation run in fp32, the normalised row is rounded to the dtype
// before the weight multiplies it. Plain-torch equivalents: kernels/reference.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "rows.h"
#include "vec_math.h"

namespace {

using namespace tritonserve_rows;

void add_rms_norm(torch::Tensor x, torch::Tensor residual, const torch::Tensor& weight,
                  double eps) {
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes(), "x and residual must be [T, H]");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm needs contiguous tensors");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type() &&
              residual.scalar_type() == x.scalar_type(), "weight / dtype mismatch");
  const int64_t rows = x.size(0), hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        add_rms_norm_row(xp + t * hidden, rp + t * hidden, wp, hidden, static_cast<float>(eps));
    });
  });
}

torch::Tensor silu_and_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul needs x [T, 2 * I]");
  auto xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t rows = xc.size(0), inner = xc.size(1) / 2, stride = xc.stride(0);
  auto out = torch::empty({rows, inner}, xc.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        silu_and_mul_row(xp + t * stride, xp + t * stride + inner, op + t * inner, inner);
    });
  });
  return out;
}

// One pass instead of eager torch's cat, neg, two muls and an add (each a pass over [T, H, D]
// for q and again for k): a 64 x 64-token bf16 prefill spent ~50 ms of 1.17 s there.
torch::Tensor rotary_embedding(const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_embedding needs x [T, heads, D] with contiguous rows and D even");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be [T, 1, D] in x's dtype");
  auto c = cos.contiguous(), s = sin.contiguous();
  auto out = torch::empty({rows, heads, dim}, x.options());
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* sp = s.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          rotate_row(xp + t * row_stride + h * head_stride, cp + t * dim, sp + t * dim,
                     op + (t * heads + h) * dim, dim / 2);
    });
  });
  return out;
}

torch::Tensor rope_store_kv(const torch::Tensor& qkv, const torch::Tensor& cos,
                            const torch::Tensor& sin, const torch::Tensor& slot_mapping,
                            torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "rope_store_kv: caches must be contiguous [blocks, block_size, kv_heads, D]");
  const int64_t kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && dim % 2 == 0 &&
                  qkv.size(1) == (num_heads + 2 * kv_heads) * dim,
              "rope_store_kv: qkv must be [T, (num_heads + 2 kv_heads) D] with contiguous rows");
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() &&
                  v_cache.scalar_type() == qkv.scalar_type() &&
                  cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "rope_store_kv: qkv, cos, sin and the caches must share a dtype");
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim,
              "rope_store_kv: cos and sin must be [T, 1, D]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == rows &&
                  slot_mapping.scalar_type() == torch::kInt64,
              "rope_store_kv: slot_mapping must be int64 [T]");
  auto c = cos.contiguous(), s = sin.contiguous(), slot = slot_mapping.contiguous();
  const int64_t* sp = slot.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)  // before any write: a bad slot changes nothing
    TORCH_CHECK(sp[t] >= -1 && sp[t] < slots, "rope_store_kv: slot ", sp[t],
                " out of range [-1, ", slots, ")");
  auto q = torch::empty({rows, num_heads, dim}, qkv.options());
  const int64_t stride = qkv.stride(0), token = kv_heads * dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store", [&] {
    const scalar_t* xp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* snp = s.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k_cache.data_ptr<scalar_t>();
    scalar_t* vp = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
      // the slots' lines asked for, for writing, before any compute: they are cold (a
      // batch-64 call 23 -> 17 us in the engine)
      for (int64_t t = begin; t < end; ++t)
        if (sp[t] >= 0)
          for (int64_t b = 0; b < token * static_cast<int64_t>(sizeof(scalar_t)); b += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(kp + sp[t] * token) + b, 1, 3);
            __builtin_prefetch(reinterpret_cast<const char*>(vp + sp[t] * token) + b, 1, 3);
          }
      for (int64_t t = begin; t < end; ++t) {
        const bool keep = sp[t] >= 0;
        rope_store_row(xp + t * stride, cp + t * dim, snp + t * dim, num_heads, kv_heads, dim,
                       qp + t * num_heads * dim, keep ? kp + sp[t] * token : nullptr,
                       keep ? vp + sp[t] * token : nullptr);
      }
    });
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_store_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int num_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("rope_store_kv", &rope_store_kv);
}
