// sample_softmax(logits [B, V] fp32 or bf16, temperature [B] fp32, seeds [B] int64) -> [B] int64:
// a draw from softmax(logits / T) over the whole vocabulary (T <= 0: the first argmax), the
// rows that ask for no top-k, top-p or min-p filter: the server's default sampling.
// Same rule as kernels.reference.sample on those rows, by the same uniform (splitmix64 of
// the row's seed): inverse CDF over 256-token chunk sums in double, then a cumulative sum
// inside the chosen chunk; a -inf logit (a banned token) weighs exactly 0 and is never drawn.
// Each row is read three times (max, chunk sums, the chosen chunk), nothing [B, V] written:
// the torch path's softmax, max and chunk passes took 1.5-2 ms of a batch-64 SmolLM2 step.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "vec_math.h"

namespace {

constexpr int64_t kChunk = 256;  // kernels/reference.py's _CHUNK

// reference.uniform_from_seeds: splitmix64's finaliser, then 53 bits in [0, 1)
double uniform_from_seed(int64_t seed) {
  uint64_t x = static_cast<uint64_t>(seed) + 0x7F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<double>(x >> 11) * (1.0 / 9007199254740992.0);
}

// exp((l - m) / t), exactly 0 where that is below fp32's range (and for l = -inf). A
// division, not a product with 1 / t: the rounded reciprocal scaled every weight alike and
// moved the CDF by ~1e-7 (1 draw in 2,000 off the torch path's). Unit: t = 1, no division
// (a select would still divide every lane).
template <bool Unit>
__attribute__((always_inline)) inline float weight(float l, float m, float t) {
  const float x = Unit ? l - m : (l - m) / t;
  return x < -87.0f ? 0.0f : tritonserve_vec::exp_clamped(x);
}

using tritonserve_vec::load_f;

// the sum of the weights of l[begin, end), or (w != nullptr) each one stored in w
template <bool Unit, typename T>
float chunk_weights(const T* l, int64_t begin, int64_t end, float m, float t, float* w) {
  float s = 0.0f;
  if (w == nullptr) {
#pragma omp simd reduction(+ : s)
    for (int64_t i = begin; i < end; ++i) s += weight<Unit>(load_f(l + i), m, t);
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t i = begin; i < end; ++i) {
      w[i - begin] = weight<Unit>(load_f(l + i), m, t);
      s += w[i - begin];
    }
  }
  return s;
}

// torch.argmax's rule for a greedy row: the first index of the maximum (NaNs aside), in one
// pass: per lane the value and index of its first maximum, then the smallest index holding
// the row's max. The max pass then a scalar search for it took 0.71 ms for 64 x 49,152 bf16
// logits, longer than a draw (0.49 ms); this, 0.07 ms (docs/perf-log/2026-cpu-decode.md).
#ifdef TS_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32: the 16 bits shifted up
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

template <typename T>
int64_t first_argmax(const T* l, int64_t vocab) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t first = 0, i = 0;
#ifdef TS_AVX512
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    __m512 best[4];
    __m512i at[4], index[4];
    for (int c = 0; c < 4; ++c) {
      best[c] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      at[c] = _mm512_setzero_si512();
      index[c] = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                    14, 15), _mm512_set1_epi32(16 * c));
    }
    const __m512i step = _mm512_set1_epi32(64);
    for (; i + 64 <= vocab && i + 64 < (int64_t{1} << 31); i += 64)
      for (int c = 0; c < 4; ++c) {
        const __m512 x = load16(l + i + 16 * c);
        const __mmask16 more = _mm512_cmp_ps_mask(x, best[c], _CMP_GT_OQ);  // a lane keeps its
        best[c] = _mm512_mask_mov_ps(best[c], more, x);                     // first maximum
        at[c] = _mm512_mask_mov_epi32(at[c], more, index[c]);
        index[c] = _mm512_add_epi32(index[c], step);
      }
    for (int c = 0; c < 4; ++c) {
      alignas(64) float v[16];
      alignas(64) int32_t k[16];
      _mm512_store_ps(v, best[c]);
      _mm512_store_si512(reinterpret_cast<__m512i*>(k), at[c]);
      for (int j = 0; j < 16; ++j)
        if (v[j] > m || (v[j] == m && k[j] < first)) m = v[j], first = k[j];
    }
  }
#endif
  for (; i < vocab; ++i)  // the tail (or the whole row) after every lane's indices
    if (load_f(l + i) > m) m = load_f(l + i), first = i;
  return first;
}

template <typename T>
int64_t draw_row(const T* l, int64_t vocab, float temperature, int64_t seed,
                 std::vector<double>& cumulative) {
  if (temperature <= 0.0f) return first_argmax(l, vocab);
  // the row's max, 16 lanes at a time in GCC vectors (written as plain loops, the compiler
  // kept it scalar: 60 % of the op's time)
  using tritonserve_vec::v16;
  v16 lanes[4];  // four chains: one compare-and-select waited on the last
  for (v16& v : lanes)
    for (int j = 0; j < 16; ++j) v[j] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + 64 <= vocab; i += 64)
    for (int c = 0; c < 4; ++c) {
      float f[16];
      for (int j = 0; j < 16; ++j) f[j] = load_f(l + i + 16 * c + j);
      v16 x;
      std::memcpy(&x, f, sizeof x);
      lanes[c] = x > lanes[c] ? x : lanes[c];
    }
  float m = -std::numeric_limits<float>::infinity();
  for (; i < vocab; ++i) m = load_f(l + i) > m ? load_f(l + i) : m;
  for (const v16& v : lanes)
    for (int j = 0; j < 16; ++j) m = v[j] > m ? v[j] : m;
  if (temperature <= 0.0f || m == -std::numeric_limits<float>::infinity()) {
    for (int64_t k = 0; k < vocab; ++k)
      if (load_f(l + k) == m) return k;  // torch.argmax: the first maximum
    return 0;
  }
  auto weights = [&](int64_t begin, int64_t end, float* w) {  // t = 1: no division
    return temperature == 1.0f ? chunk_weights<true>(l, begin, end, m, temperature, w)
                               : chunk_weights<false>(l, begin, end, m, temperature, w);
  };
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  cumulative.resize(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = std::min(vocab, (c + 1) * kChunk);
    total += weights(c * kChunk, end, nullptr);
    cumulative[c] = total;
  }
  const double target = uniform_from_seed(seed) * total;
  int64_t c = 0;  // the first chunk whose cumulative sum passes the target
  while (c < chunks - 1 && cumulative[c] <= target) ++c;
  const double before = c > 0 ? cumulative[c - 1] : 0.0;
  const int64_t begin = c * kChunk, end = std::min(vocab, begin + kChunk);
  float w[kChunk];
  weights(begin, end, w);
  double inner_total = 0.0;
  for (int64_t i = 0; i < end - begin; ++i) inner_total += w[i];
  // rounding between the two levels must not push the target past the chunk's last token
  const double rest = std::min(target - before, std::nextafter(inner_total, 0.0));
  double inner = 0.0;
  for (int64_t i = 0; i < end - begin; ++i) {
    inner += w[i];
    if (inner > rest) return begin + i;
  }
  for (int64_t i = end - begin - 1; i > 0; --i)  // unreachable but for rounding: the last
    if (w[i] > 0.0f) return begin + i;              // token with weight
  return begin;
}

torch::Tensor sample_softmax(const torch::Tensor& logits, const torch::Tensor& temperature,
                             const torch::Tensor& seeds) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == torch::kFloat32 ||
                                    logits.scalar_type() == torch::kBFloat16),
              "sample_softmax needs float32 or bfloat16 logits [B, V]");
  TORCH_CHECK(temperature.scalar_type() == torch::kFloat32 && seeds.scalar_type() == torch::kInt64
              && temperature.numel() == logits.size(0) && seeds.numel() == logits.size(0),
              "sample_softmax needs float32 temperature [B] and int64 seeds [B]");
  auto l = logits.contiguous();
  auto t = temperature.contiguous();
  auto s = seeds.contiguous();
  const int64_t rows = l.size(0), vocab = l.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* tp = t.data_ptr<float>();
  const int64_t* sp = s.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, l.scalar_type(), "sample_softmax", [&] {
    const scalar_t* lp = l.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> cumulative;
      for (int64_t r = begin; r < end; ++r)
        op[r] = draw_row(lp + r * vocab, vocab, tp[r], sp[r], cumulative);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("sample_softmax(Tensor logits, Tensor temperature, Tensor seeds) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("sample_softmax", &sample_softmax);
}
