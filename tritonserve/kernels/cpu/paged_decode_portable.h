// The portable CPU decode attention of one sequence (any dtype, fp32 math, GCC vectors):
// paged_decode.cpp's path where paged_decode_bf16.h does not apply, shared with
// decode_layers.cpp (the whole decode stack in fp32). Figures and the work split:
// paged_decode.cpp's header.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "page_sweep.h"
#include "vec_math.h"

namespace tritonserve_decode_portable {

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
    // 0.57 ms a call on a Zen 5 EPYC; docs/perf-log/2026-cpu-decode.md)
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
// query heads; q / out point at the sequence's row. window > 0: the query (at position
// seq_len - 1) sees only the last `window` tokens; the pages wholly before them are not read
// and the earlier slots of the first page read are masked. softcap > 0: each score s becomes
// softcap * tanh(s / softcap) before the softmax (Gemma 2). Pages [page_from, page_to) only
// (a part of a split sequence, page_sweep.h's Items); partial != nullptr: the part's
// unnormalised sums go there for merge_parts (query head h at partial + h * (D + 2): acc,
// m, l; page_sweep.h's merge_parts), out is not written.
template <typename scalar_t, int HD>
void decode_seq(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                const int32_t* table, int64_t seq_len, int64_t block_size,
                int64_t kv_heads, int64_t head_dim_arg, int64_t group, int64_t h0, int64_t h1,
                float scale, scalar_t* out, int64_t q_head_stride, int64_t out_head_stride,
                bool cached, int64_t window, float softcap, int64_t page_from = 0,
                int64_t page_to = std::numeric_limits<int64_t>::max(),
                float* partial = nullptr) {
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
  const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
  const int64_t p0 = std::max(first / block_size, page_from);  // the first page read
  const int64_t end = std::min(seq_len, page_to < (seq_len + block_size - 1) / block_size
                                            ? page_to * block_size : seq_len);
  const int64_t last_page = (end + block_size - 1) / block_size;
  for (int64_t start = p0 * block_size; start < end; start += block_size) {
    const int64_t n = std::min(block_size, end - start);
    const int64_t p = start / block_size, page = table[p];
    const scalar_t* kp = k_cache + page * block_size * row + h0 * head_dim;
    const scalar_t* vp = v_cache + page * block_size * row + h0 * head_dim;
    if (!cached && (p - p0) % chunk == 0)  // the next sweep's pages into the cache (page_sweep.h)
      tritonserve_sweep::sweep(k_cache, v_cache, table, seq_len, p,
                               std::min(p + chunk, last_page),
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
    const int64_t lo = std::max<int64_t>(0, first - start);  // slots before the window
    if (softcap > 0.0f)
      for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores.data() + h * block_size;
        for (int64_t t = lo; t < n; ++t) sh[t] = softcap * std::tanh(sh[t] / softcap);
      }
    for (int64_t h = 0; h < heads; ++h) {
      float* sh = scores.data() + h * block_size;
      float page_max = *std::max_element(sh + lo, sh + n);
      const float m_new = std::max(m[h], page_max);
      const float alpha = std::exp(m[h] - m_new);  // exp(-inf) = 0 on the first page
      float sum = 0.0f;
      for (int64_t t = 0; t < lo; ++t) sh[t] = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = lo; t < n; ++t) {
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
  if (partial != nullptr) {  // a part of a split sequence: its sums, for merge_parts
    for (int64_t h = 0; h < heads; ++h) {
      float* part = partial + (h0 * group + h) * (head_dim + 2);
      std::memcpy(part, acc.data() + h * head_dim, head_dim * sizeof(float));
      part[head_dim] = m[h];
      part[head_dim + 1] = l[h];
    }
    return;
  }
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* oh = out + (h0 * group + h) * out_head_stride;
    const float inv = 1.0f / l[h];
    for (int64_t d = 0; d < head_dim; ++d) oh[d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
  }
}

}  // namespace tritonserve_decode_portable
