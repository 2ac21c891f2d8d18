// LoRA adapters inside the decode_layers op (fp32 and bf16 steps): each row of the step
// names an adapter slot (-1: the base model), and each of a layer's four matmuls (qkv, o,
// gate/up, down) adds, to a row with an adapter, x A^T B^T over that adapter's parts of the
// projection (engine/lora.py packs them: LoraAdapter.packed).
//
// The contract with the packer, one adapter's two tensors:
// - blob: 1-D, fp32 (an fp32 engine's) or bf16 (a bf16 engine's: half the bytes a step
//   reads). Per projection, its stacked A transposed in chunks of 16 ranks, [rank / 16][K][16]
//   (q, k and v stacked: one pass over x for the three; the ranks padded with zeros to a
//   multiple of 16; a chunk contiguous, so the threads sharing the chunks out read apart),
//   then each part's B transposed in tiles of 64 columns, [n / 64][part rank][64] (the last
//   tile padded with zeros), the adapter's scale folded in.
// - index: int64 [4L, kIndexWidth], a row per projection (4 l + 0..3): the A's offset in the
//   blob (elements), its rank (0: the adapter leaves the projection alone), the number of
//   parts, then a part each: (rank start, rank end, first output column, columns, its BT's
//   offset).
// Why inside the op: steps with an adapter row ran the model op by op, at 0.31x of the
// layers op's tokens/s at 1 stream (docs/benchmarks.md, "LoRA adapters").
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "vec_math.h"

namespace tritonserve_lora {

using tritonserve_vec::v16;

constexpr int kMaxParts = 3;  // q, k, v of the fused qkv
constexpr int kIndexWidth = 3 + 5 * kMaxParts;
constexpr int64_t kLanes = 16;  // a v16 of fp32; A's ranks are padded to a multiple
constexpr int64_t kTile = 64;   // BT's columns a tile

// a part's BT elements (its columns padded to whole tiles)
inline int64_t tiled_size(int64_t ranks, int64_t n) { return ranks * ((n + kTile - 1) / kTile) * kTile; }

struct Part {
  int64_t rs, re, col, n;  // ranks [rs, re) of the projection's A, output columns [col, col+n)
  const void* bt;          // BT [re - rs, n] in tiles: [n / 64][re - rs][64], the blob's dtype
};

struct Proj {
  const void* at = nullptr;  // A^T [K, rank] in chunks of 16 ranks: [rank / 16][K][16]
  bool bf16 = false;         // the blob holds bf16 (a bf16 engine's adapters), else fp32
  int64_t rank = 0;          // padded to a multiple of kLanes (the pad's columns are zeros)
  int nparts = 0;
  Part parts[kMaxParts];
};

// 16 weights widened to fp32 (bf16: the bits shifted up; by intrinsics, where GCC's
// __builtin_convertvector went through ymm halves with inserts and extracts)
template <typename W>
inline v16 load16(const W* p) {
  v16 v;
  if constexpr (std::is_same_v<W, float>) {
    std::memcpy(&v, p, sizeof v);
  } else {
#if defined(__AVX512F__)
    const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
    std::memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256 lo = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
    const __m256 hi = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
    std::memcpy(&v, &lo, sizeof lo);
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < 16; ++i) v[i] = tritonserve_vec::load_f(p + i);
#endif
  }
  return v;
}

// Bytes ahead of a weight stream's loads that the loops below ask for (software prefetch;
// the samples of both loops sat on the loads of each new line). One row, rank 16, SmolLM2's
// blocks, 2-core Xeon, three rounds: a step's cost of the adapter 1.19-1.40 ms without,
// 1.01-1.16 at 2 KB ahead, 1.05-1.19 at 4 KB
// (docs/perf-log/2026-12-07-xeon-amx-prefill-lora.md).
constexpr int64_t kAhead = 2048;

template <typename W>
inline void ahead(const W* p) {
  const char* c = reinterpret_cast<const char*>(p) + kAhead;
  __builtin_prefetch(c, 0, 3);
  __builtin_prefetch(c + 64, 0, 3);
}

// Both products below are register blocks: RB rows x NV vectors of accumulators, each
// weight vector loaded once for the RB rows, each row's scalar broadcast once for the NV
// vectors (no horizontal sums). Dot products a rank (the first form) ran at 11 GMAC/s here
// against 60+ for a block (Xeon, AVX-512).

// xa[r, k0 + 16 v + i] = sum_j x[r, j] AT[j, k0 + 16 v + i] for RB rows; with few
// accumulators, B banks of them take alternate j (independent FMA chains: one row's 576-long
// chain waited on each FMA's latency)
// (j over [j0, j1) of the K inputs: a thread's share of a chunk when there are few chunks)
template <typename W, int RB, int NV>
inline void shrink_block(const W* at, int64_t k0, const float* x, int64_t K, int64_t j0,
                         int64_t j1, float* xa, int64_t stride) {
  constexpr int B = RB * NV >= 4 ? 1 : 4 / (RB * NV);
  v16 acc[B][RB][NV];
#pragma GCC unroll 4
  for (int q = 0; q < B; ++q)
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[q][r][v] = v16{};
  int64_t j = j0;
  for (; j + B <= j1; j += B) {
    constexpr int64_t bytes = kLanes * sizeof(W);  // a j's of one 16-rank stream
    if ((j - j0) * bytes % 128 < B * bytes)  // two lines each 128 bytes
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) ahead(at + ((k0 / kLanes + v) * K + j) * kLanes);
#pragma GCC unroll 4
    for (int q = 0; q < B; ++q) {
      v16 a[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) a[v] = load16(at + ((k0 / kLanes + v) * K + j + q) * kLanes);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const float xj = x[r * K + j + q];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[q][r][v] += xj * a[v];
      }
    }
  }
  for (; j < j1; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        acc[0][r][v] += x[r * K + j] * load16(at + ((k0 / kLanes + v) * K + j) * kLanes);
#pragma GCC unroll 4
  for (int q = 1; q < B; ++q)
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[0][r][v] += acc[q][r][v];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      std::memcpy(xa + r * stride + k0 + kLanes * v, &acc[0][r][v], sizeof(v16));
}

// ranks [k0, k1) (multiples of 16) of xa's rows, for `rows` fp32 rows of x (K wide,
// contiguous), over its inputs [j0, j1), xa's rows `stride` apart
template <typename W>
inline void shrink_all(const W* at, int64_t k0, int64_t k1, const float* x, int64_t K,
                       int64_t j0, int64_t j1, int64_t rows, float* xa, int64_t stride) {
  for (int64_t r = 0; r < rows;) {
    const int64_t rb = rows - r >= 4 ? 4 : rows - r >= 2 ? 2 : 1;
    for (int64_t k = k0; k < k1;) {
      const int64_t nv = std::min<int64_t>(4, (k1 - k) / kLanes);
      const float* xr = x + r * K;
      float* out = xa + r * stride;
#define TS_LORA_SHRINK(RB)                                                            \
  if (nv == 4) shrink_block<W, RB, 4>(at, k, xr, K, j0, j1, out, stride);               \
  else if (nv == 3) shrink_block<W, RB, 3>(at, k, xr, K, j0, j1, out, stride);          \
  else if (nv == 2) shrink_block<W, RB, 2>(at, k, xr, K, j0, j1, out, stride);          \
  else shrink_block<W, RB, 1>(at, k, xr, K, j0, j1, out, stride);
      if (rb == 4) {
        TS_LORA_SHRINK(4)
      } else if (rb == 2) {
        TS_LORA_SHRINK(2)
      } else {
        TS_LORA_SHRINK(1)
      }
#undef TS_LORA_SHRINK
      k += nv * kLanes;
    }
    r += rb;
  }
}

// xa = x A^T for ranks [k0, k1) of projection p over its inputs [j0, j1) (a thread's share)
inline void shrink(const Proj& p, int64_t k0, int64_t k1, const float* x, int64_t K,
                   int64_t j0, int64_t j1, int64_t rows, float* xa, int64_t stride) {
  if (p.bf16)
    shrink_all(static_cast<const c10::BFloat16*>(p.at), k0, k1, x, K, j0, j1, rows, xa, stride);
  else
    shrink_all(static_cast<const float*>(p.at), k0, k1, x, K, j0, j1, rows, xa, stride);
}

// y_r[c + 16 v + i] += sum_k xa_r[rs + k] b[k * kTile + 16 v + i] for RB rows (y_r: row
// rows[r] of y; b: the tile's first row at column c): the product summed in fp32, rounded to
// T, then added once (as torch's out += (xa @ B^T).to(out.dtype) rounds)
template <typename W, typename T, int RB, int NV>
inline void expand_block(const W* b, int64_t ranks, const float* xa, int64_t stride,
                         const int64_t* rows, int64_t c, T* y, int64_t ldy) {
  v16 acc[RB][NV];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = v16{};
  for (int64_t k = 0; k < ranks; ++k, b += kTile) {
    ahead(b);
    v16 bk[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bk[v] = load16(b + kLanes * v);
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const float xk = xa[r * stride + k];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += xk * bk[v];
    }
  }
  // acc read at constant indices only (the loops unrolled): else GCC keeps it on the stack
  // and stores every accumulator each k (3x slower here)
  float sum[RB][NV * kLanes];
#pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) std::memcpy(&sum[r][kLanes * v], &acc[r][v], sizeof(v16));
  for (int r = 0; r < RB; ++r) {
    T* yr = y + rows[r] * ldy + c;
#pragma omp simd
    for (int64_t i = 0; i < NV * kLanes; ++i)
      tritonserve_vec::store_f(yr + i, tritonserve_vec::load_f(yr + i) +
                                           tritonserve_vec::round_to<T>(sum[r][i]));
  }
}

// the columns [c0, c1) of y that a part covers, for RB rows: blocks of 64, 32 or 16 columns
// within a tile (each block's BT rows contiguous, 64 apart: the row-major BT's 16 rows 1-3 KB
// apart streamed at a third of the rate), the odd columns one at a time
template <typename W, typename T, int RB>
inline void expand_cols(const Part& part, const float* xa, int64_t stride, const int64_t* rows,
                        int64_t c0, int64_t c1, T* y, int64_t ldy) {
  const int64_t ranks = part.re - part.rs, hi = std::min(c1, part.col + part.n);
  const W* bt = static_cast<const W*>(part.bt);
  xa += part.rs;
  for (int64_t c = std::max(c0, part.col); c < hi;) {
    const int64_t o = c - part.col, within = o % kTile;
    const W* b = bt + (o / kTile) * ranks * kTile + within;
    if (within == 0 && c + kTile <= hi) {
      expand_block<W, T, RB, 4>(b, ranks, xa, stride, rows, c, y, ldy);
      c += kTile;
    } else if (within % 32 == 0 && c + 32 <= hi) {
      expand_block<W, T, RB, 2>(b, ranks, xa, stride, rows, c, y, ldy);
      c += 32;
    } else if (within % kLanes == 0 && c + kLanes <= hi) {
      expand_block<W, T, RB, 1>(b, ranks, xa, stride, rows, c, y, ldy);
      c += kLanes;
    } else {
      for (int r = 0; r < RB; ++r) {
        float s = 0.0f;
        for (int64_t k = 0; k < ranks; ++k)
          s += xa[r * stride + k] * tritonserve_vec::load_f(b + k * kTile);
        T* yc = y + rows[r] * ldy + c;
        tritonserve_vec::store_f(yc, tritonserve_vec::load_f(yc) + tritonserve_vec::round_to<T>(s));
      }
      ++c;
    }
  }
}

template <typename W, typename T>
inline void expand_rows(const Part& part, const float* xa, int64_t stride, const int64_t* rows,
                        int64_t count, int64_t c0, int64_t c1, T* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + 4 <= count; r += 4)
    expand_cols<W, T, 4>(part, xa + r * stride, stride, rows + r, c0, c1, y, ldy);
  for (; r + 2 <= count; r += 2)
    expand_cols<W, T, 2>(part, xa + r * stride, stride, rows + r, c0, c1, y, ldy);
  for (; r < count; ++r) expand_cols<W, T, 1>(part, xa + r * stride, stride, rows + r, c0, c1, y, ldy);
}

// one adapter's `count` rows (their xa `stride` apart, rows[i] their rows of y): every part's
// columns in [c0, c1)
template <typename T>
inline void expand(const Proj& p, const float* xa, int64_t stride, const int64_t* rows,
                   int64_t count, int64_t c0, int64_t c1, T* y, int64_t ldy) {
  for (int i = 0; i < p.nparts; ++i) {
    const Part& part = p.parts[i];
    if (std::max(c0, part.col) >= std::min(c1, part.col + part.n)) continue;
    if (p.bf16)
      expand_rows<c10::BFloat16>(part, xa, stride, rows, count, c0, c1, y, ldy);
    else
      expand_rows<float>(part, xa, stride, rows, count, c0, c1, y, ldy);
  }
}

}  // namespace tritonserve_lora
