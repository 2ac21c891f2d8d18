// bf16 linear layer for the CPU over weights packed once into column panels of k pairs:
//   pack_linear_weight_bf16(weight [N, K] bf16) -> panels [ceil(N / 32), ceil(K / 2), 32, 2]
//     (panels[p, j, c, i] = weight[32 p + c, 2 j + i]; columns past N and k past K are zero)
//   packed_linear_bf16(x [M, K] bf16, panels, N, bias?) -> x @ weight^T (+ bias)  [M, N] bf16
// The layout is AVX512-BF16's: one 64-byte load holds 16 columns x 2 k, and one vdpbf16ps
// adds x[m, 2j] * w[2j, c] + x[m, 2j + 1] * w[2j + 1, c] to 16 fp32 accumulators (the pair of
// x broadcast as one 32-bit word). A panel (32 columns) is two such loads per k pair. Sums stay
// in fp32 over all of K; the result is rounded to bf16 once (round to nearest even), as
// oneDNN's bf16 inner product does.
// Without AVX512-BF16 (-march=native decides at build time) the same layout runs on GCC
// vectors: a 32-bit word shifted left by 16 is the even k as fp32, masked it is the odd k.
// Why panels and not oneDNN: a decode step reads every weight once; panels stream each
// thread's columns front to back (the fp32 kernel's finding, kernels/cpu/linear.cpp), and an
// op of our own is one torch.compile traces (oneDNN's prepacked tensor is opaque), so bf16
// decodes can run compiled too. Figures: docs/benchmarks.md (ninth session).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define TS_DPBF16 1
#endif

namespace {

constexpr int64_t kCols = 32;  // output columns per panel
constexpr int64_t kBlockBytes = 256 << 10;  // a block of x rows kept in L2 across the panels
// The first row tile of every block prefetches the weight stream kPrefetchBytes ahead (the
// hardware prefetcher alone left the first pass over a panel waiting on memory). SmolLM2's 121
// matmuls weights cold on a 2-core Zen 5, old / new library side by side: M = 4 6.5 -> 5.4-5.9
// ms, 16 9.4 -> 7.0-7.4, 64 23.0 -> 19.9-20.2, 128-2048 even or 1-4 % faster; one row (its
// own loop) gained nothing (docs/benchmarks.md, ninth session).
constexpr int64_t kPrefetchBytes = 4096;

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// The pair (x[2j], x[2j + 1]) of row x as one 32-bit word; an odd K's last pair is (x, 0).
inline uint32_t pair_at(const uint16_t* x, int64_t j, int64_t K) {
  if (2 * j + 1 < K) {
    uint32_t w;
    std::memcpy(&w, x + 2 * j, sizeof w);
    return w;
  }
  return x[2 * j];
}

// y[m, 0:ncols] (bf16, row stride ldy) = acc[m] + bias, from fp32 sums of 32 columns
inline void store_row(const float* acc, uint16_t* y, int64_t ncols, const float* bias) {
  uint16_t row[kCols];
  for (int64_t c = 0; c < kCols; ++c) row[c] = float_to_bf16(acc[c] + (bias ? bias[c] : 0.f));
  std::memcpy(y, row, ncols * sizeof(uint16_t));
}

#ifdef TS_DPBF16
// R rows of x (row stride ldx) against one panel, all of its kp pairs. 2R accumulators
// (R <= 12 of the 32 zmm registers) and two panel loads per pair, the x pair folded into
// vdpbf16ps as a broadcast. Prefetch: the tile that reads the panel first asks for the
// weight stream ahead (a template argument, as in kernels/cpu/linear.cpp).
template <int R, bool Prefetch>
inline void tile(const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* panel, int64_t kp,
                 uint16_t* y, int64_t ldy, int64_t ncols, const float* bias) {
  __m512 lo[R], hi[R];
  for (int m = 0; m < R; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  // whole pairs read as words; an odd K's last pair through pair_at after the loop (a
  // run-time branch inside it is what kernels/cpu/linear.cpp measured to cost)
  const int64_t full = K / 2;
  for (int64_t j = 0; j < full; ++j) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + j * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + j * 2 * kCols + kCols);
    if (Prefetch) {  // the pair's two lines, kPrefetchBytes further down the stream
      const char* ahead = reinterpret_cast<const char*>(panel + j * 2 * kCols) + kPrefetchBytes;
      __builtin_prefetch(ahead, 0, 3);
      __builtin_prefetch(ahead + 64, 0, 3);
    }
    for (int m = 0; m < R; ++m) {
      uint32_t word;
      std::memcpy(&word, x + m * ldx + 2 * j, sizeof word);
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      lo[m] = _mm512_dpbf16_ps(lo[m], xs, w0);
      hi[m] = _mm512_dpbf16_ps(hi[m], xs, w1);
    }
  }
  if (kp > full) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + full * 2 * kCols);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + full * 2 * kCols + kCols);
    for (int m = 0; m < R; ++m) {
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(
          static_cast<int>(pair_at(x + m * ldx, full, K)));
      lo[m] = _mm512_dpbf16_ps(lo[m], xs, w0);
      hi[m] = _mm512_dpbf16_ps(hi[m], xs, w1);
    }
  }
  for (int m = 0; m < R; ++m) {
    float acc[kCols];
    _mm512_storeu_ps(acc, lo[m]);
    _mm512_storeu_ps(acc + 16, hi[m]);
    store_row(acc, y + m * ldy, ncols, bias);
  }
}
constexpr int kRows = 12;

// One row (a single decode sequence): memory-bound, so four independent accumulator chains
// keep vdpbf16ps's latency behind the weight stream.
inline void row_times_panel(const uint16_t* x, int64_t K, const uint16_t* panel, int64_t kp,
                            uint16_t* y, int64_t ncols, const float* bias) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  int64_t j = 0;
  for (; j + 1 < K / 2; j += 2) {
    const uint16_t* p = panel + j * 2 * kCols;
    uint32_t w[2];
    std::memcpy(w, x + 2 * j, sizeof w);
    const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[0]));
    const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w[1]));
    a0 = _mm512_dpbf16_ps(a0, x0, (__m512bh)_mm512_loadu_si512(p));
    a1 = _mm512_dpbf16_ps(a1, x0, (__m512bh)_mm512_loadu_si512(p + kCols));
    b0 = _mm512_dpbf16_ps(b0, x1, (__m512bh)_mm512_loadu_si512(p + 2 * kCols));
    b1 = _mm512_dpbf16_ps(b1, x1, (__m512bh)_mm512_loadu_si512(p + 3 * kCols));
  }
  for (; j < kp; ++j) {
    const uint16_t* p = panel + j * 2 * kCols;
    const __m512bh xs = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(x, j, K)));
    a0 = _mm512_dpbf16_ps(a0, xs, (__m512bh)_mm512_loadu_si512(p));
    a1 = _mm512_dpbf16_ps(a1, xs, (__m512bh)_mm512_loadu_si512(p + kCols));
  }
  float acc[kCols];
  _mm512_storeu_ps(acc, _mm512_add_ps(a0, b0));
  _mm512_storeu_ps(acc + 16, _mm512_add_ps(a1, b1));
  store_row(acc, y, ncols, bias);
}
#else
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));

// The portable tile: per k pair, 32 columns as four 8-wide words split into even / odd k.
template <int R, bool Prefetch>
inline void tile(const uint16_t* x, int64_t ldx, int64_t K, const uint16_t* panel, int64_t kp,
                 uint16_t* y, int64_t ldy, int64_t ncols, const float* bias) {
  v8 acc[R][4] = {};
  for (int64_t j = 0; j < kp; ++j) {
    v8 even[4], odd[4];
    for (int q = 0; q < 4; ++q) {
      u8 words;
      std::memcpy(&words, panel + j * 2 * kCols + q * 16, sizeof words);
      const u8 e = words << 16, o = words & 0xffff0000u;
      std::memcpy(&even[q], &e, sizeof e);
      std::memcpy(&odd[q], &o, sizeof o);
    }
    for (int m = 0; m < R; ++m) {
      const uint32_t word = pair_at(x + m * ldx, j, K);
      const float xe = bf16_to_float(static_cast<uint16_t>(word));
      const float xo = bf16_to_float(static_cast<uint16_t>(word >> 16));
      for (int q = 0; q < 4; ++q) acc[m][q] += xe * even[q] + xo * odd[q];
    }
  }
  for (int m = 0; m < R; ++m) {
    float row[kCols];
    std::memcpy(row, acc[m], sizeof row);
    store_row(row, y + m * ldy, ncols, bias);
  }
}
constexpr int kRows = 3;

inline void row_times_panel(const uint16_t* x, int64_t K, const uint16_t* panel, int64_t kp,
                            uint16_t* y, int64_t ncols, const float* bias) {
  tile<1, false>(x, K, K, panel, kp, y, 0, ncols, bias);
}
#endif

// tile<rows> for 1 <= rows <= R
template <bool Prefetch, int R = kRows>
inline void tiles(int64_t rows, const uint16_t* x, int64_t ldx, int64_t K,
                  const uint16_t* panel, int64_t kp, uint16_t* y, int64_t ldy, int64_t ncols,
                  const float* bias) {
  if constexpr (R > 1) {
    if (rows < R) {
      tiles<Prefetch, R - 1>(rows, x, ldx, K, panel, kp, y, ldy, ncols, bias);
      return;
    }
  }
  tile<R, Prefetch>(x, ldx, K, panel, kp, y, ldy, ncols, bias);
}

// rows [0, M) of x against one panel
void panel_product(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panel, int64_t kp,
                   uint16_t* y, int64_t N, int64_t ncols, const float* bias) {
  if (M == 1) {
    row_times_panel(x, K, panel, kp, y, ncols, bias);
    return;
  }
  // the first tile prefetches (the panels are contiguous: past this panel's end lies the
  // next one's start; past the last panel's, a prefetch of nothing, which never faults)
  int64_t m = std::min<int64_t>(M, kRows);
  tiles<true>(m, x, K, K, panel, kp, y, N, ncols, bias);
  for (; m + kRows <= M; m += kRows)
    tile<kRows, false>(x + m * K, K, K, panel, kp, y + m * N, N, ncols, bias);
  if (m < M) tiles<false>(M - m, x + m * K, K, K, panel, kp, y + m * N, N, ncols, bias);
}

torch::Tensor pack_linear_weight_bf16(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16,
              "pack_linear_weight_bf16: weight must be a bfloat16 [N, K] matrix");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kCols - 1) / kCols, kp = (K + 1) / 2;
  auto padded = torch::zeros({panels * kCols, kp * 2}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [P * 32, kp * 2] -> [P, 32, kp, 2] -> [P, kp, 32, 2]
  return padded.view({panels, kCols, kp, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor packed_linear_bf16(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "packed_linear_bf16: x must be a contiguous bfloat16 [M, K] matrix");
  const int64_t M = x.size(0), K = x.size(1), kp = (K + 1) / 2;
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kCols && panels.size(3) == 2 &&
                  panels.is_contiguous() && panels.scalar_type() == torch::kBFloat16 &&
                  panels.size(1) == kp,
              "packed_linear_bf16: panels must come from pack_linear_weight_bf16 with K = "
              "x.size(1)");
  TORCH_CHECK(N > (panels.size(0) - 1) * kCols && N <= panels.size(0) * kCols,
              "packed_linear_bf16: N does not match the number of panels");
  torch::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "packed_linear_bf16: bias must have N elements");
    bias32 = torch::zeros({panels.size(0) * kCols}, x.options().dtype(torch::kFloat32));
    bias32.narrow(0, 0, N).copy_(bias->reshape({N}));
  }
  const float* bias_ptr = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // Rows in blocks of about kBlockBytes of x, each passing over all of this thread's panels
  // while it stays in L2 (as kernels/cpu/linear.cpp does, for the same prefill reason).
  const int64_t block = std::max<int64_t>(kRows, kBlockBytes / (K * 2) / kRows * kRows);
  const int64_t panel_elems = kp * 2 * kCols;
  at::parallel_for(0, panels.size(0), 2, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t rows = std::min(block, M - m0);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col = p * kCols, ncols = std::min(kCols, N - col);
        panel_product(xp + m0 * K, rows, K, wp + p * panel_elems, kp, yp + m0 * N + col, N,
                      ncols, bias_ptr ? bias_ptr + col : nullptr);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("pack_linear_weight_bf16(Tensor weight) -> Tensor");
  m.def("packed_linear_bf16(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(tritonserve, CPU, m) {
  m.impl("pack_linear_weight_bf16", &pack_linear_weight_bf16);
  m.impl("packed_linear_bf16", &packed_linear_bf16);
}
