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

#include "page_group.h"
#include "page_sweep.h"
#include "vec_math.h"

namespace tritonserve_decode_portable {

using tritonserve_vec::exp_clamped;
using tritonserve_vec::sum_lanes16;
using tritonserve_vec::v16;

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Bytes after an int8 cache row's head_dim codes: its fp32 scale (kernels/reference.py's
// quantize_kv); 0 for a cache of floating values.
template <typename T>
constexpr int64_t kScaleBytes = std::is_same_v<T, int8_t> ? 4 : 0;

// An int8 cache row (head_dim codes, then the fp32 scale) -> fp32 values.
inline void dequantize_row(const int8_t* row, float* out, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof scale);
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<float>(row[d]) * scale;
}

// Quantize one row of head_dim values into an int8 cache row: symmetric, absmax / 127, codes
// rounded to nearest (what reference.quantize_kv does, to the bit for fp32 input).
template <typename T>
inline void quantize_row(const T* x, int8_t* row, int64_t head_dim) {
  float amax = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const float scale = std::max(amax, 1e-30f) / 127.0f;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float c = std::nearbyint(to_float(x[d]) / scale);
    row[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, c)));
  }
  std::memcpy(row + head_dim, &scale, sizeof scale);
}

// A page's rows for kv heads [h0, h0 + nh) as fp32: in place for an fp32 cache (row stride
// `row`), else converted once into `buffer` (row stride nh * head_dim).
template <typename T>
inline const float* page_as_float(const T* page, float* buffer, int64_t n, int64_t nh,
                                  int64_t row, int64_t head_dim) {
  if constexpr (std::is_same_v<T, float>) {
    return page;
  } else if constexpr (std::is_same_v<T, int8_t>) {  // rows of codes + scale, heads apart
    const int64_t stride = head_dim + kScaleBytes<T>;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < nh; ++h)
        dequantize_row(page + t * row + h * stride, buffer + (t * nh + h) * head_dim, head_dim);
    return buffer;
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

// HD > 0: the head size known at compile time (64, 128, 256: a KV head's group of query heads
// over each page at once, page_group.h); HD == 0: any head size, from head_dim_arg, one query
// head at a time. One sequence, KV heads [h0, h1) and their
// query heads; q / out point at the sequence's row. window > 0: the query (at position
// seq_len - 1) sees only the last `window` tokens; the pages wholly before them are not read
// and the earlier slots of the first page read are masked. softcap > 0: each score s becomes
// softcap * tanh(s / softcap) before the softmax (Gemma 2). Pages [page_from, page_to) only
// (a part of a split sequence, page_sweep.h's Items); partial != nullptr: the part's
// unnormalised sums go there for merge_parts (query head h at partial + h * (D + 2): acc,
// m, l; page_sweep.h's merge_parts), out is not written. sinks != nullptr: query head i's
// sink logit sinks[i] joins the softmax's denominator (exp(sink - max) beside the scores'
// sum) and weighs no value: gpt-oss's attention sinks (never with partial).
// cache_t: the cache's element type, scalar_t's by default; int8_t: rows of codes + scale
// (kScaleBytes), read as codes with the scale applied to scores and weights (grouped), or
// dequantized a page at a time into fp32 like a bf16 page (HD == 0).
template <typename scalar_t, int HD, typename cache_t = scalar_t>
void decode_seq(const scalar_t* q, const cache_t* k_cache, const cache_t* v_cache,
                const int32_t* table, int64_t seq_len, int64_t block_size,
                int64_t kv_heads, int64_t head_dim_arg, int64_t group, int64_t h0, int64_t h1,
                float scale, scalar_t* out, int64_t q_head_stride, int64_t out_head_stride,
                bool cached, int64_t window, float softcap, int64_t page_from = 0,
                int64_t page_to = std::numeric_limits<int64_t>::max(),
                float* partial = nullptr, const float* sinks = nullptr) {
  const int64_t head_dim = HD > 0 ? HD : head_dim_arg;
  const int64_t heads = (h1 - h0) * group;  // the query heads of kv heads [h0, h1)
  const int64_t head_row = head_dim + kScaleBytes<cache_t>;  // a KV head's cache elements
  const int64_t row = kv_heads * head_row;  // elements between two token slots
  // every query head of a KV head's group over a page at once (page_group.h): head sizes
  // that are whole multiples of 32, pages of at most 32 slots (the engine's 16 and 32)
  const bool grouped = HD > 0 && HD % 32 == 0 && block_size <= 32;
  // fp32 and int8 rows are read where they lie; bf16 / fp16 pages converted first
  constexpr bool direct = std::is_same_v<cache_t, float> || std::is_same_v<cache_t, int8_t>;
  std::vector<float> qf(heads * head_dim), acc(heads * head_dim, 0.0f);
  std::vector<float> m(heads, -std::numeric_limits<float>::infinity()), l(heads, 0.0f);
  std::vector<float> scores(heads * block_size);
  std::vector<float> kbuf(std::is_same_v<cache_t, float> || (grouped && direct)
                              ? 0 : block_size * (h1 - h0) * head_dim);
  std::vector<float> vbuf(kbuf.size());
  for (int64_t h = 0; h < heads; ++h) {
    const scalar_t* qh = q + (h0 * group + h) * q_head_stride;
    for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = to_float(qh[d]) * scale;
  }
  const int64_t chunk =
      tritonserve_sweep::chunk_pages(block_size * (h1 - h0) * head_row * sizeof(cache_t));
  const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
  const int64_t p0 = std::max(first / block_size, page_from);  // the first page read
  const int64_t end = std::min(seq_len, page_to < (seq_len + block_size - 1) / block_size
                                            ? page_to * block_size : seq_len);
  const int64_t last_page = (end + block_size - 1) / block_size;
  for (int64_t start = p0 * block_size; start < end; start += block_size) {
    const int64_t n = std::min(block_size, end - start);
    const int64_t p = start / block_size, page = table[p];
    const cache_t* kp = k_cache + page * block_size * row + h0 * head_row;
    const cache_t* vp = v_cache + page * block_size * row + h0 * head_row;
    if (!cached && (p - p0) % chunk == 0)  // the next sweep's pages into the cache (page_sweep.h)
      tritonserve_sweep::sweep(k_cache, v_cache, table, seq_len, p,
                               std::min(p + chunk, last_page),
                               block_size, row, h0 * head_row, (h1 - h0) * head_row);
    // the grouped path reads fp32 and int8 rows where they lie (page_group.h); bf16 / fp16
    // pages and the generic head size read them converted to fp32 first
    const bool convert = !(grouped && direct);
    const float* kf_page =
        convert ? page_as_float(kp, kbuf.data(), n, h1 - h0, row, head_dim) : nullptr;
    const float* vf_page =
        convert ? page_as_float(vp, vbuf.data(), n, h1 - h0, row, head_dim) : nullptr;
    const int64_t frow = std::is_same_v<cache_t, float> ? row : (h1 - h0) * head_dim;
    if constexpr (HD > 0 && HD % 32 == 0) {
      if (grouped) {
        for (int64_t hk = 0; hk < h1 - h0; ++hk) {
          const float* qg = qf.data() + hk * group * HD;
          float* sg = scores.data() + hk * group * block_size;
          if constexpr (direct)
            tritonserve_page_group::group_scores<HD>(qg, group, kp + hk * head_row, row, n, sg,
                                                     block_size);
          else
            tritonserve_page_group::group_scores<HD>(qg, group, kf_page + hk * HD, frow, n, sg,
                                                     block_size);
        }
      }
    }
    for (int64_t t = 0; !grouped && t < n; ++t) {
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
#ifdef TS_AVX512
      if (n == 16 && lo == 0) {  // a whole page of 16 in one zmm: no scalar max, exp or sum
        // (int8 cache, 8k tokens, a layer: these three ran ~40 % of decode_seq's samples)
        const __m512 sv = _mm512_loadu_ps(sh);
        const float m_new = std::max(m[h], _mm512_reduce_max_ps(sv));
        const __m512 e = tritonserve_vec::exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new)));
        _mm512_storeu_ps(sh, e);
        const float alpha = std::exp(m[h] - m_new);
        l[h] = l[h] * alpha + _mm512_reduce_add_ps(e);
        if (m_new != m[h]) {
          float* ah = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ah[d] *= alpha;
        }
        m[h] = m_new;
        continue;
      }
#endif
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
      if (m_new != m[h]) {  // most pages past the first few leave the max where it was
        float* ah = acc.data() + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) ah[d] *= alpha;
      }
      m[h] = m_new;
    }
    if constexpr (HD > 0 && HD % 32 == 0) {
      if (grouped) {
        for (int64_t hk = 0; hk < h1 - h0; ++hk) {
          const float* pg = scores.data() + hk * group * block_size;
          float* ag = acc.data() + hk * group * HD;
          if constexpr (direct)
            tritonserve_page_group::group_values<HD>(pg, group, vp + hk * head_row, row, n,
                                                     block_size, ag);
          else
            tritonserve_page_group::group_values<HD>(pg, group, vf_page + hk * HD, frow, n,
                                                     block_size, ag);
        }
        continue;
      }
    }
    for (int64_t h = 0; h < heads; ++h) {  // the generic head size: one query head at a time
      const float* vh = vf_page + (h / group) * head_dim;
      const float* sh = scores.data() + h * block_size;
      float* ah = acc.data() + h * head_dim;
      for (int64_t t = 0; t < n; ++t) {
        const float p = sh[t];
        const float* v = vh + t * frow;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * v[d];
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
    const float sink = sinks != nullptr ? std::exp(sinks[h0 * group + h] - m[h]) : 0.0f;
    const float inv = 1.0f / (l[h] + sink);
    for (int64_t d = 0; d < head_dim; ++d) oh[d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
  }
}

}  // namespace tritonserve_decode_portable
