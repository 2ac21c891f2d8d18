// Fused elementwise ops of a decoder layer for the CPU, one pass over each row:
//   add_rms_norm(x!, residual!, weight, eps): residual += x; x = weight * rms_norm(residual)
//     (vLLM's fused_add_rms_norm contract: both tensors updated in place, nothing allocated)
//   silu_and_mul(x) -> out: x [T, 2I] -> silu(x[:, :I]) * x[:, I:]  [T, I]
// Numerics follow transformers' Llama: the residual sum is rounded to the tensor dtype, the
// statistics and the normalisation run in fp32, the normalised row is rounded to the dtype
// before the weight multiplies it. Plain-torch equivalents: kernels/reference.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

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
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* xr = xp + t * hidden;
        scalar_t* rr = rp + t * hidden;
        float sum = 0.f;
        for (int64_t i = 0; i < hidden; ++i) {
          const scalar_t s = static_cast<scalar_t>(static_cast<float>(xr[i]) +
                                                   static_cast<float>(rr[i]));
          rr[i] = s;
          const float f = static_cast<float>(s);
          sum += f * f;
        }
        const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) +
                                          static_cast<float>(eps));
        for (int64_t i = 0; i < hidden; ++i) {
          const scalar_t normed = static_cast<scalar_t>(static_cast<float>(rr[i]) * inv);
          xr[i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(normed));
        }
      }
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
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = xp + t * stride;
        const scalar_t* up = gate + inner;
        scalar_t* o = op + t * inner;
        for (int64_t i = 0; i < inner; ++i) {
          const float g = static_cast<float>(gate[i]);
          // silu rounded to the dtype first, as F.silu(gate) * up computes it
          const scalar_t s = static_cast<scalar_t>(g / (1.f + std::exp(-g)));
          o[i] = static_cast<scalar_t>(static_cast<float>(s) * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
}
