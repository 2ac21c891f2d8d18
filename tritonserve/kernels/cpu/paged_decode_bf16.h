// Decode attention of one sequence over a bf16 paged cache with AVX512-BF16: the bf16 rows are
// used as they lie in the page, never converted into a buffer. Included by paged_decode.cpp,
// which calls it for bf16 caches when the build has AVX512-BF16, the head size is 32 * C and
// the block size a multiple of 16; else its portable path runs.
//
// A unit is 16 tokens of a page and one KV head. For each of its G query heads:
//   scores: q . k_t by vdpbf16ps on the raw bf16 (products exact, fp32 sums), then the 16
//     tokens' lane sums in one shuffle tree: one zmm of 16 scores;
//   softmax: online, against a reference max that moves only when a score passes it by
//     kSlack (and on the sequence's first unit), so the exp never waits on a reduction;
//     the sum stays in 16 lanes until the end;
//   values: fp32 as the portable path, each V row converted in registers (bf16 -> fp32 is a
//     shift for the even elements, a mask for the odd ones) once for all G query heads,
//     whose accumulators stay in registers (even/odd order, put back in dimension order at
//     the end).
// Two schedules, the caller's choice (`cached`):
//   cached (prefill rows: the pages were just written): a unit's value pass runs after the
//     next unit's scores, so in program order the long scores -> exp chain of one unit sits
//     beside the independent FMAs of the other, and the value pass is token-outer with every
//     accumulator in registers. One core, the cache warm, 16 tokens x 3 KV heads x 3 query
//     heads a chunk: 1,750-2,030 cycles a chunk in the schedule before this one, 1,250-1,340
//     in this one. Each multiply-add taken off the exp chain measured ~3 %: bound by that chain's
//     latency, not by its instruction count.
//   streaming (decode rows: the pages come from memory): the item's pages swept into the
//     cache first (page_sweep.h), then each unit's value pass at once, one 32-element slice
//     of the head at a time, whose 16 V loads go out back to back; after each unit a share
//     of the next sweep's lines is asked for (page_sweep.h's Ahead). Before the sweep the
//     cached schedule measured 5-20 % slower than this one on cold pages (fewer misses in
//     flight), this one 13-25 % slower than it on cached ones; on swept
//     pages the two measured even (sixteenth).
// q is bf16 already (the op's input); the scale multiplies the scores, as the portable path
// scales q in fp32: the two differ by fp32 rounding only.
#pragma once

#include <cstdint>

#include "isa.h"
#include "page_sweep.h"

namespace tritonserve_decode_bf16 {
using tritonserve_sweep::Item;
// the instance for a head size and group, or nullptr when none is built (the caller's
// portable path then runs)
using SeqFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const Item&,
                       const Item*, int64_t, int64_t, float, uint16_t*, int64_t, int64_t);
}  // namespace tritonserve_decode_bf16

#ifdef TS_AVX512_BF16

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "page_sweep.h"
#include "vec_math.h"


namespace tritonserve_decode_bf16 {

using tritonserve_vec::exp16;
using tritonserve_vec::exp_clamped;
using tritonserve_vec::v16;

// 64 bytes as bf16 pairs. A plain load: GCC 12 sent `(__m512bh)` casts of loaded words
// through a stack slot (a store and a reload each) in the scores loop.
inline __m512bh load_bh(const uint16_t* p) {
  __m512bh v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// 16 tokens' scores against one query head: rows k + t * row for t < 16 (all inside the page;
// a row past the sequence only feeds a lane the caller masks)
template <int C>
inline __m512 scores16(const __m512bh* qv, const uint16_t* k, int64_t row) {
  v16 a[16];
  for (int t = 0; t < 16; ++t) {
    const uint16_t* kt = k + t * row;
    __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], load_bh(kt));
    for (int c = 1; c < C; ++c) s = _mm512_dpbf16_ps(s, qv[c], load_bh(kt + 32 * c));
    a[t] = (v16)s;
  }
  return (__m512)tritonserve_vec::sum_lanes16(a);
}

// A score may pass the reference max by this much before the sums are rescaled: weights up
// to e^8 (~3e3) stay far inside fp32, and the rescale (a scalar exp, the accumulators
// multiplied) runs about once per sequence and query head. The weights' exp is
// exp16<5, false>: x <= kSlack, so no upper clamp; degree 5, < 2.5e-6 relative, a thousandth
// of the bf16 output's step (degree 7, the sampler's, measured 2-4 % slower here).
constexpr float kSlack = 8.0f;

// per query head: the reference max, the sum in 16 lanes, and HD accumulators (even/odd order
// within each 32)
template <int C, int G>
struct HeadState {
  float m[G];
  alignas(64) float l[G][16];
  alignas(64) float acc[G][32 * C];
};

// a unit's probabilities, waiting for its value pass: G x 16 weights, the V rows (row 0 of
// the 16), the KV head (its HeadState) and the live tokens
template <int G>
struct Unit {
  alignas(64) float probs[G][16];
  const uint16_t* v;
  int64_t hk, n;
};


// Ask for the K and V rows of one KV head for `n` token slots from `slot` (`row` elements
// apart; bytes 0..2 * HD of each): non-temporal, each line is read once. The cached schedule
// only (its pages were just written); the streaming one sweeps instead (page_sweep.h).
template <int HD>
inline void prefetch_rows(const uint16_t* k_cache, const uint16_t* v_cache, int64_t slot,
                          int64_t n, int64_t row, int64_t head_offset) {
  for (int64_t t = 0; t < n; ++t)
    for (int b = 0; b < HD; b += 32) {  // 32 bf16: one cache line
      const int64_t at = (slot + t) * row + head_offset + b;
      _mm_prefetch(reinterpret_cast<const char*>(k_cache + at), _MM_HINT_NTA);
      _mm_prefetch(reinterpret_cast<const char*>(v_cache + at), _MM_HINT_NTA);
    }
}

// acc[j] += sum over the unit's tokens t of probs[j][t] * v_t. Registers (and G C <= 6:
// SmolLM2's 3 x 2 takes 12 of them): token-outer, all 2 G C accumulators in registers, each
// V row converted and each weight broadcast once. Else one 32-element slice of the head at a
// time: 2 G accumulators, 16 loads of V rows issued together.
template <bool Registers, int C, int G>
inline void value_pass(const Unit<G>& u, HeadState<C, G>& st, int64_t row) {
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  if constexpr (Registers && G * C <= 6) {
    __m512 acc[G][2 * C];
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < 2 * C; ++i) acc[j][i] = _mm512_load_ps(st.acc[j] + 16 * i);
    for (int64_t t = 0; t < u.n; ++t) {
      __m512 ve[C], vo[C];
      for (int c = 0; c < C; ++c) {
        const __m512i x = _mm512_loadu_si512(u.v + t * row + 32 * c);
        ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        vo[c] = _mm512_castsi512_ps(_mm512_and_si512(x, odd_mask));
      }
      for (int j = 0; j < G; ++j) {
        const __m512 pj = _mm512_set1_ps(u.probs[j][t]);
        for (int c = 0; c < C; ++c) {
          acc[j][2 * c] = _mm512_fmadd_ps(pj, ve[c], acc[j][2 * c]);
          acc[j][2 * c + 1] = _mm512_fmadd_ps(pj, vo[c], acc[j][2 * c + 1]);
        }
      }
    }
    for (int j = 0; j < G; ++j)
      for (int i = 0; i < 2 * C; ++i) _mm512_store_ps(st.acc[j] + 16 * i, acc[j][i]);
  } else {
    for (int c = 0; c < C; ++c) {
      __m512 even[G], odd[G];
      for (int j = 0; j < G; ++j) {
        even[j] = _mm512_load_ps(st.acc[j] + 32 * c);
        odd[j] = _mm512_load_ps(st.acc[j] + 32 * c + 16);
      }
      for (int64_t t = 0; t < u.n; ++t) {
        const __m512i x = _mm512_loadu_si512(u.v + t * row + 32 * c);
        const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(x, odd_mask));
        for (int j = 0; j < G; ++j) {
          const __m512 pj = _mm512_set1_ps(u.probs[j][t]);
          even[j] = _mm512_fmadd_ps(pj, ve, even[j]);
          odd[j] = _mm512_fmadd_ps(pj, vo, odd[j]);
        }
      }
      for (int j = 0; j < G; ++j) {
        _mm512_store_ps(st.acc[j] + 32 * c, even[j]);
        _mm512_store_ps(st.acc[j] + 32 * c + 16, odd[j]);
      }
    }
  }
}

// One item and its G query heads a KV head; q / out point at the sequence's row.
// Streaming: the item's pages are read in sweeps (page_sweep.h), each then computed from the
// cache while the next sweep's lines (this item's next chunk, or the first of `following`,
// the thread's next item, or nullptr) are asked for. Cached: while the rows of one (16
// tokens, KV head) compute, the same rows of the next page are asked for (this item's next
// page, or on its last the first of `following`); on cold pages this spread prefetch took a
// call 460-475 -> 261-264 us in the tenth session, the sweep goes further.
template <int C, int G, bool Cached>
void decode_seq(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                const Item& it, const Item* following, int64_t block_size, int64_t kv_heads,
                float scale, uint16_t* out, int64_t q_head_stride, int64_t out_head_stride) {
  constexpr int HD = 32 * C;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t row = kv_heads * HD;  // elements between two token slots
  const int64_t h0 = it.h0, nkv = it.h1 - it.h0;
  const int32_t* table = it.table;
  thread_local std::vector<HeadState<C, G>> states;
  thread_local std::vector<__m512bh> qs;
  states.resize(nkv);
  qs.resize(nkv * G * C);
  for (int64_t hk = 0; hk < nkv; ++hk) {
    for (int j = 0; j < G; ++j) {
      const uint16_t* qh = q + ((h0 + hk) * G + j) * q_head_stride;
      for (int c = 0; c < C; ++c) qs[(hk * G + j) * C + c] = load_bh(qh + 32 * c);
      states[hk].m[j] = kNegInf;
      std::fill(states[hk].l[j], states[hk].l[j] + 16, 0.0f);
      std::fill(states[hk].acc[j], states[hk].acc[j] + HD, 0.0f);
    }
  }
  Unit<G> units[2];  // this unit and (cached) the one whose value pass is pending
  Unit<G>* pending = nullptr;
  auto values = [&](const Unit<G>& u) { value_pass<Cached, C, G>(u, states[u.hk], row); };
  const int64_t chunk = tritonserve_sweep::item_chunk<uint16_t>(it, block_size, HD);
  // streaming: the next sweep's lines, asked for a share after each unit of this one
  tritonserve_sweep::Ahead<uint16_t> ahead;
  int64_t per_unit = 0;
  for (int64_t p = it.p0; p < it.p1; ++p) {
    const int64_t start = p * block_size, n = std::min(block_size, it.len - start);
    const int64_t page = table[p];
    if (!Cached && (p - it.p0) % chunk == 0) {
      const int64_t p1 = std::min(it.p1, p + chunk);
      tritonserve_sweep::sweep(k_cache, v_cache, table, it.len, p, p1, block_size, row, h0 * HD,
                               nkv * HD);
      tritonserve_sweep::ask_next(ahead, k_cache, v_cache, it, following, p1, block_size,
                                  kv_heads, HD);
      // block_size is a multiple of 16 (pick), so only the last page has a partial unit
      const int64_t units = (std::min(it.len, p1 * block_size) - start + 15) / 16 * nkv;
      per_unit = (ahead.lines() + units - 1) / units;
    }
    // cached: the page to ask for, this item's next or on its last the following item's first
    int64_t next = -1, next_n = 0, next_h0 = h0, next_nkv = nkv;
    if (Cached && p + 1 < it.p1) {
      next = table[p + 1], next_n = std::min(block_size, it.len - start - block_size);
    } else if (Cached && following != nullptr && following->p0 < following->p1) {
      next = following->table[following->p0];
      next_n = std::min(block_size, following->len - following->p0 * block_size);
      next_h0 = following->h0, next_nkv = following->h1 - following->h0;
    }
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t ns = std::min<int64_t>(16, n - t0);
      const __mmask16 live = static_cast<__mmask16>((1u << ns) - 1);
      for (int64_t hk = 0; hk < nkv; ++hk) {
        const uint16_t* kp = k_cache + (page * block_size + t0) * row + (h0 + hk) * HD;
        HeadState<C, G>& st = states[hk];
        if (t0 < next_n && hk < next_nkv)  // next_n is 0 unless cached
          prefetch_rows<HD>(k_cache, v_cache, next * block_size + t0,
                            std::min<int64_t>(16, next_n - t0), row, (next_h0 + hk) * HD);
        Unit<G>& u = pending == &units[0] ? units[1] : units[0];
        u.v = v_cache + (page * block_size + t0) * row + (h0 + hk) * HD;
        u.hk = hk, u.n = ns;
        for (int j = 0; j < G; ++j) {
          __m512 s = _mm512_mul_ps(scores16<C>(&qs[(hk * G + j) * C], kp, row),
                                   _mm512_set1_ps(scale));
          s = _mm512_mask_blend_ps(live, _mm512_set1_ps(kNegInf), s);
          if (st.m[j] == kNegInf) {
            st.m[j] = _mm512_reduce_max_ps(s);  // the first unit: ns >= 1 live lanes
          } else if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(st.m[j] + kSlack), _CMP_GT_OQ)) {
            if (pending != nullptr && pending->hk == hk) {  // its weights are in the old scale
              values(*pending);
              pending = nullptr;
            }
            const float m_new = _mm512_reduce_max_ps(s);
            const __m512 alpha = _mm512_set1_ps(exp_clamped(st.m[j] - m_new));
            _mm512_store_ps(st.l[j], _mm512_mul_ps(_mm512_load_ps(st.l[j]), alpha));
            for (int d = 0; d < HD; d += 16)
              _mm512_store_ps(st.acc[j] + d, _mm512_mul_ps(_mm512_load_ps(st.acc[j] + d), alpha));
            st.m[j] = m_new;
          }
          const __m512 e =
              _mm512_maskz_mov_ps(live, exp16<5, false>(_mm512_sub_ps(s, _mm512_set1_ps(st.m[j]))));
          _mm512_store_ps(u.probs[j], e);
          _mm512_store_ps(st.l[j], _mm512_add_ps(_mm512_load_ps(st.l[j]), e));
        }
        if constexpr (Cached) {
          if (pending != nullptr) values(*pending);
          pending = &u;
        } else {
          values(u);
          ahead.advance(per_unit);
        }
      }
    }
  }
  if (pending != nullptr) values(*pending);
  if (it.partial != nullptr) {  // a part of a split sequence: its sums, for merge_parts
    for (int64_t hk = 0; hk < nkv; ++hk)
      for (int j = 0; j < G; ++j) {
        const HeadState<C, G>& st = states[hk];
        float* part = it.partial + ((h0 + hk) * G + j) * (HD + 2);
        for (int c = 0; c < C; ++c)
          for (int i = 0; i < 16; ++i) {
            part[32 * c + 2 * i] = st.acc[j][32 * c + i];
            part[32 * c + 2 * i + 1] = st.acc[j][32 * c + 16 + i];
          }
        part[HD] = st.m[j];
        part[HD + 1] = _mm512_reduce_add_ps(_mm512_load_ps(st.l[j]));
      }
    return;
  }
  for (int64_t hk = 0; hk < nkv; ++hk)
    for (int j = 0; j < G; ++j) {
      const HeadState<C, G>& st = states[hk];
      uint16_t* oh = out + ((h0 + hk) * G + j) * out_head_stride;
      const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(st.l[j]));
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < 16; ++i) {
          oh[32 * c + 2 * i] = tritonserve_vec::float_to_bf16(st.acc[j][32 * c + i] * inv);
          oh[32 * c + 2 * i + 1] = tritonserve_vec::float_to_bf16(st.acc[j][32 * c + 16 + i] * inv);
        }
    }
}

template <int C, bool Cached>
inline SeqFn pick_group(int64_t group) {
  switch (group) {
    case 1: return decode_seq<C, 1, Cached>;
    case 2: return decode_seq<C, 2, Cached>;
    case 3: return decode_seq<C, 3, Cached>;
    case 4: return decode_seq<C, 4, Cached>;
    case 5: return decode_seq<C, 5, Cached>;
    case 6: return decode_seq<C, 6, Cached>;
    case 7: return decode_seq<C, 7, Cached>;
    case 8: return decode_seq<C, 8, Cached>;
    default: return nullptr;
  }
}

template <int C>
inline SeqFn pick_schedule(int64_t group, bool cached) {
  return cached ? pick_group<C, true>(group) : pick_group<C, false>(group);
}

inline SeqFn pick(int64_t head_dim, int64_t group, int64_t block_size, bool cached) {
  if (block_size % 16 != 0) return nullptr;
  if (head_dim == 64) return pick_schedule<2>(group, cached);
  if (head_dim == 128) return pick_schedule<4>(group, cached);
  if (head_dim == 256) return pick_schedule<8>(group, cached);  // Gemma 2 / 3
  return nullptr;
}

}  // namespace tritonserve_decode_bf16
#else  // no AVX512-BF16: no instance, so callers' bf16 branches never run (isa.h)
namespace tritonserve_decode_bf16 {
inline SeqFn pick(int64_t, int64_t, int64_t, bool) { return nullptr; }
}  // namespace tritonserve_decode_bf16
#endif
