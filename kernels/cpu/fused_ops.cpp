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

#include "vec_math.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TS_BF16_ROWS 1
#endif

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
#ifdef TS_BF16_ROWS
// bf16 rows 16 at a time on AVX-512: the loops above stayed scalar for bf16 (240 ns a
// 576-wide row, 15 us for a batch-64 decode's norm on one core). Same roundings: the sum
// rounded to bf16 (vcvtneps2bf16 rounds to nearest even as float_to_bf16 does; it reads an
// fp32 denormal as zero), the normalised row rounded before the weight multiplies it; the sum
// of squares in another order (fp32).
inline __m512 widen(__m256i h) {  // 16 bf16 -> fp32 (the bits shifted up)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::BFloat16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

inline void add_rms_norm_row(c10::BFloat16* xr, c10::BFloat16* rr, const c10::BFloat16* wp,
                             int64_t hidden, float eps) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
  const int64_t body = hidden / 32 * 32;
  auto sum_at = [&](int64_t i) {
    const __m256i h = to_bf16(_mm512_add_ps(load16(xr + i), load16(rr + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rr + i), h);
    return widen(h);
  };
  for (int64_t i = 0; i < body; i += 32) {
    const __m512 a = sum_at(i), b = sum_at(i + 16);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
    acc1 = _mm512_fmadd_ps(b, b, acc1);
  }
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (int64_t i = body; i < hidden; ++i) {
    const float v = round_to<c10::BFloat16>(load_f(xr + i) + load_f(rr + i));
    store_f(rr + i, v);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  int64_t i = 0;
  for (; i + 16 <= hidden; i += 16) {
    const __m512 normed = widen(to_bf16(_mm512_mul_ps(load16(rr + i), scale)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xr + i),
                        to_bf16(_mm512_mul_ps(load16(wp + i), normed)));
  }
  for (; i < hidden; ++i)
    store_f(xr + i, load_f(wp + i) * round_to<c10::BFloat16>(load_f(rr + i) * inv));
}
#endif

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

// q, k rotated and v copied out of one qkv row; k and v only when the row has a slot
template <typename T>
void rope_store_row(const T* row, const T* c, const T* s, int64_t heads, int64_t kv_heads,
                    int64_t dim, T* q, T* k, T* v) {
  for (int64_t h = 0; h < heads; ++h) rotate_row(row + h * dim, c, s, q + h * dim, dim / 2);
  if (k == nullptr) return;
  for (int64_t h = 0; h < kv_heads; ++h)
    rotate_row(row + (heads + h) * dim, c, s, k + h * dim, dim / 2);
  std::memcpy(v, row + (heads + kv_heads) * dim, kv_heads * dim * sizeof(T));
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
