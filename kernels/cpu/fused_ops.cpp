// Fused elementwise ops of a decoder layer for the CPU, one pass over each row:
//   add_rms_norm(x!, residual!, weight, eps): residual += x; x = weight * rms_norm(residual)
//     (vLLM's fused_add_rms_norm contract: both tensors updated in place, nothing allocated)
//   silu_and_mul(x) -> out: x [T, 2I] -> silu(x[:, :I]) * x[:, I:]  [T, I]
//   rotary_embedding(x, cos, sin) -> out: x [T, heads, D] (rows of any stride) rotated by
//     rotate-half rope, out = x * cos + rotate_half(x) * sin  [T, heads, D] contiguous; cos,
//     sin [T, 1, D] (the step's lookup). In fp32, rounded once to the dtype (what Inductor's
//     fused kernel computes in the compiled step); eager torch rounds after each op.
// Numerics follow transformers' Llama: the residual sum is rounded to the tensor dtype, the
// statistics and the normalisation run in fp32, the normalised row is rounded to the dtype
// before the weight multiplies it. Plain-torch equivalents: kernels/reference.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "vec_math.h"

namespace {

using tritonserve_vec::exp_clamped;
using tritonserve_vec::load_f;
using tritonserve_vec::round_to;
using tritonserve_vec::store_f;

// Both row loops are plain arithmetic on fp32 (bf16 converted on raw bits, exp a polynomial),
// so `omp simd` vectorises them: through c10's conversions and std::exp they ran one element
// at a time, and a 64-prompt bf16 prefill spent 20 % of its time in silu_and_mul (4.5 ms a
// call for 1365 x 1536; tenth session, docs/benchmarks.md). Templates outside the dispatch
// macro: a pragma inside a macro argument does not compile.
template <typename T>
void add_rms_norm_row(T* xr, T* rr, const T* wp, int64_t hidden, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < hidden; ++i) {
    const float s = round_to<T>(load_f(xr + i) + load_f(rr + i));
    store_f(rr + i, s);
    sum += s * s;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i)
    store_f(xr + i, load_f(wp + i) * round_to<T>(load_f(rr + i) * inv));
}

template <typename T>
void silu_and_mul_row(const T* gate, const T* up, T* o, int64_t inner) {
#pragma omp simd
  for (int64_t i = 0; i < inner; ++i) {
    const float g = load_f(gate + i);
    // silu rounded to the dtype first, as F.silu(gate) * up computes it
    store_f(o + i, tritonserve_vec::silu_as<T>(g) * load_f(up + i));
  }
}

template <typename T>
void rotate_row(const T* x, const T* c, const T* s, T* o, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load_f(x + i), x2 = load_f(x + half + i);
    store_f(o + i, x1 * load_f(c + i) - x2 * load_f(s + i));
    store_f(o + half + i, x2 * load_f(c + half + i) + x1 * load_f(s + half + i));
  }
}

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
