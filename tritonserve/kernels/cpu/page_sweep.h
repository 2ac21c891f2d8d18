// Reads a sequence's KV pages into this core's cache just before the decode attention
// computes on them: both CPU decode paths (paged_decode.cpp, paged_decode_bf16.h) call it
// for pages that come from memory.
//
// Why: a cold page costs what fetches it. Software prefetches spread over the compute (what
// both paths did before this file) keep only ~32 lines in flight a core, ~8 GB/s
// at this Zen 5's ~250 ns; a burst of plain loads over a few pages, nothing else in the way,
// runs at the hardware streamer's rate. Swept, then computed from L2: batch 64 x 128-228
// tokens, bf16, cold, 0.59-0.70 -> 0.42-0.47 ms a call, fp32 0.97 -> 0.65; in the engine's
// batch-64 decode step 537-625 -> 395-400 us a call, its share of the step 30-35 -> 25-26 %
// (docs/perf-log/2026-cpu-decode.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace tritonserve_sweep {

// K + V bytes one sweep brings in before they are computed on: well inside a core's L2
// (1-2 MB on CPUs with AVX-512).
constexpr int64_t kBytes = 512 << 10;
// Pages read side by side, line by line: 4 measured 0.42-0.46 ms a call, 1 (K then V) 0.59,
// 2 0.49, 8 and 16 as 4 (the batch above).
constexpr int kPages = 4;

// Pages one sweep covers, for pages of `page_bytes` bytes of K (as many of V): at least one.
inline int64_t chunk_pages(int64_t page_bytes) {
  return std::max<int64_t>(1, kBytes / (2 * page_bytes));
}

// The kPages pages from page g of a sweep that ends at p1: K and V at `offset` of each page's
// first slot, and the live slots of each (0 for those past p1).
template <typename T>
inline void group_at(const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,
                     int64_t g, int64_t p1, int64_t block_size, int64_t row, int64_t offset,
                     const T* (&k)[kPages], const T* (&v)[kPages], int64_t (&n)[kPages]) {
  for (int s = 0; s < kPages; ++s) {
    const int64_t p = std::min(g + s, p1 - 1);
    n[s] = g + s < p1 ? std::min(block_size, len - p * block_size) : 0;
    k[s] = k_cache + int64_t(table[p]) * block_size * row + offset;
    v[s] = v_cache + int64_t(table[p]) * block_size * row + offset;
  }
}

// Load every cache line of the K and V rows of pages [p0, p1) of `table` (a sequence of
// `len` tokens, `block_size` token slots a page, slots `row` elements apart; at each slot
// the `span` elements from `offset`), kPages pages at a time, each front to back.
// one cache line as a vector (AVX-512 loads it whole; narrower ISAs split it)
typedef long long Line __attribute__((vector_size(64)));

template <typename T>
inline void sweep(const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,
                  int64_t p0, int64_t p1, int64_t block_size, int64_t row, int64_t offset,
                  int64_t span) {
  constexpr int64_t line = 64 / sizeof(T);
  Line sink = {};
  for (int64_t g = p0; g < p1; g += kPages) {
    const T* k[kPages];
    const T* v[kPages];
    int64_t n[kPages];
    group_at(k_cache, v_cache, table, len, g, p1, block_size, row, offset, k, v, n);
    for (int64_t t = 0; t < block_size; ++t)
      for (int64_t e = 0; e < span; e += line)
        for (int s = 0; s < kPages; ++s)
          if (t < n[s]) {
            Line a, b;
            std::memcpy(&a, k[s] + t * row + e, sizeof a);
            std::memcpy(&b, v[s] + t * row + e, sizeof b);
            sink |= a | b;
          }
  }
  asm volatile("" : : "m"(sink));  // the loads are kept
}

// The next sweep's lines asked for while the current one computes: software prefetches in
// sweep()'s order, a share after each unit of work, so that the sweep at the start of the next
// chunk finds part of its lines in the cache or on their way. A core keeps only ~32 misses in
// flight, so this overlaps a part of the reading with the compute, not
// all of it. Batch 64 x 64-192 tokens, bf16, cold, alternated: 0.339 -> 0.294 ms a call
// (faster in 11 of 12 rounds), 0.410 -> 0.345 (9 of 10); in the engine's batch-64 step
// 339-412 -> 303-308 us a call (docs/perf-log/2026-cpu-decode.md). Loads instead of
// prefetches measured 30 % slower (each miss stalls the compute behind it). The AVX512-BF16
// path uses it; in the portable one (fp32, compute-bound) it measured no gain.
template <typename T>
class Ahead {
 public:
  // the lines of pages [p0, p1) of `table` (arguments as sweep()'s), none asked for yet
  void start(const T* k_cache, const T* v_cache, const int32_t* table, int64_t len, int64_t p0,
             int64_t p1, int64_t block_size, int64_t row, int64_t offset, int64_t span) {
    k_cache_ = k_cache, v_cache_ = v_cache, table_ = table, len_ = len, p1_ = p1;
    block_size_ = block_size, row_ = row, offset_ = offset, span_ = span;
    g_ = p0, t_ = 0, e_ = 0;
    done_ = p0 >= p1;
    const int64_t tokens = done_ ? 0 : std::min(len, p1 * block_size) - p0 * block_size;
    lines_ = tokens * ((span + kLine - 1) / kLine);
    if (!done_) group();
  }
  void stop() { done_ = true, lines_ = 0; }
  // lines of K (as many of V) that start() covers
  int64_t lines() const { return lines_; }
  // ask for the next `count` lines of K and the same lines of V
  void advance(int64_t count) {
    while (!done_ && count > 0) {
      for (int s = 0; s < kPages; ++s)
        if (t_ < n_[s]) {
          __builtin_prefetch(k_[s] + t_ * row_ + e_, 0, 3);
          __builtin_prefetch(v_[s] + t_ * row_ + e_, 0, 3);
          --count;
        }
      if ((e_ += kLine) < span_) continue;
      e_ = 0;
      if (++t_ < block_size_) continue;
      t_ = 0;
      g_ += kPages;
      if (g_ >= p1_) done_ = true; else group();
    }
  }

 private:
  static constexpr int64_t kLine = 64 / sizeof(T);
  void group() {  // the kPages pages from g_
    group_at(k_cache_, v_cache_, table_, len_, g_, p1_, block_size_, row_, offset_, k_, v_, n_);
  }
  const T* k_cache_ = nullptr;
  const T* v_cache_ = nullptr;
  const int32_t* table_ = nullptr;
  int64_t len_ = 0, p1_ = 0, block_size_ = 0, row_ = 0, offset_ = 0, span_ = 0;
  int64_t g_ = 0, t_ = 0, e_ = 0, lines_ = 0;  // group of kPages pages, slot, element
  bool done_ = true;
  const T* k_[kPages];
  const T* v_[kPages];
  int64_t n_[kPages];
};

// What one work item of a decode attention reads: a sequence's block table and length, its
// KV heads [h0, h1) and its pages [p0, p1). partial: where a part of a split sequence leaves
// its sums (Items::partial_at), or nullptr: the item writes its output itself.
struct Item {
  const int32_t* table;
  int64_t len, h0, h1, p0, p1;
  float* partial;
};

// A decode call's work items (paged_decode.cpp, decode_layers.cpp): one a sequence (whole
// pages, sequential reads) when there are at least 4 sequences a thread, else one a KV head
// (batch 1 would otherwise use one core); longest sequences first, so that threads claiming
// the next item in turn do not leave the longest for last (a static split of the range did).
// Where the caller can merge (split_pages: both decode kernels; not prefill rows), a call of
// at most kSplitBatch sequences also splits each sequence's pages into parts of kPartTokens tokens,
// each part an item leaving unnormalised sums (m, l, acc) for merge_parts: batch 1 over 3 KV
// heads on 2 threads was 3 items, one thread idle a third of the attention (7.6 % of a step
// in OpenMP waits at 1-2k tokens). The split depends on the lengths only,
// never on the thread count, so the results do not either.
struct Items {
  static constexpr int64_t kSplitBatch = 2;
  static constexpr int64_t kPartTokens = 256;
  const int32_t* tables;  // [batch, width]
  const int32_t* lens;    // [batch]
  int64_t width, kv_heads, split, block_size, part_pages, parts, count;
  std::vector<int64_t> order;  // item / (split * parts) -> sequence
  float* scratch = nullptr;    // [batch, parts, heads, head_dim + 2] when parts > 1
  int64_t heads = 0, head_dim = 0;

  Items(const int32_t* tables_, const int32_t* lens_, int64_t batch, int64_t width_,
        int64_t kv_heads_, int64_t threads, int64_t block_size_, bool split_pages)
      : tables(tables_), lens(lens_), width(width_), kv_heads(kv_heads_),
        split(batch >= 4 * threads ? 1 : kv_heads_), block_size(block_size_),
        part_pages(std::max<int64_t>(1, kPartTokens / block_size_)),
        parts(1), count(0), order(batch) {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
    if (split_pages && batch >= 1 && batch <= kSplitBatch) {
      const int64_t pages = (int64_t(lens[order[0]]) + block_size - 1) / block_size;
      parts = (pages + part_pages - 1) / part_pages;
      // parts enough for every thread: each takes all KV heads, so a page is read as one
      // contiguous run (an int8 row of 68 bytes a head shares its cache lines with the next
      // head's; one head an item read each line up to twice) and a call has a third of the
      // items (8k tokens, SmolLM2, int8: the figure in docs/benchmarks.md, long context)
      if (batch * parts >= 4 * threads) split = 1;
    }
    count = batch * split * parts;
  }
  // floats the caller allocates for the parts' sums (0: no split)
  int64_t scratch_floats(int64_t heads_, int64_t head_dim_) const {
    return parts > 1 ? int64_t(order.size()) * parts * heads_ * (head_dim_ + 2) : 0;
  }
  void use_scratch(float* s, int64_t heads_, int64_t head_dim_) {
    scratch = s, heads = heads_, head_dim = head_dim_;
  }
  // sums of sequence b's part i, query head h: acc [head_dim], then m, then l
  float* partial_at(int64_t b, int64_t i, int64_t h) const {
    return scratch + ((b * parts + i) * heads + h) * (head_dim + 2);
  }
  int64_t seq(int64_t item) const { return order[item / (split * parts)]; }
  Item at(int64_t item) const {
    const int64_t b = seq(item), rest = item % (split * parts);
    const int64_t kv = rest / parts, i = rest % parts;
    const int64_t pages = (int64_t(lens[b]) + block_size - 1) / block_size;
    const int64_t p0 = parts > 1 ? std::min(pages, i * part_pages) : 0;
    const int64_t p1 = parts > 1 ? std::min(pages, (i + 1) * part_pages) : pages;
    return Item{tables + b * width, lens[b], kv * kv_heads / split, (kv + 1) * kv_heads / split,
                p0, p1, parts > 1 ? partial_at(b, i, 0) : nullptr};
  }
};

// Query head h of sequence b from the parts of a split call (Items::parts > 1), whichever
// kernel left them (acc in plain order, then m, then l): the parts' sums rescaled to their
// largest max, out[d] = round(sum_i w_i acc_i[d] / sum_i w_i l_i) with w_i = exp(m_i -
// max_i m_i); a part with no pages (m = -inf, l = 0) weighs nothing.
template <typename Out, typename Round>
inline void merge_parts(const Items& work, int64_t b, int64_t h, Out* out, Round round) {
  const int64_t D = work.head_dim;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < work.parts; ++i) top = std::max(top, work.partial_at(b, i, h)[D]);
  float l = 0.0f;
  alignas(64) float local[512] = {};  // head sizes past 512 (none served) take the heap
  std::vector<float> heap(D > 512 ? D : 0, 0.0f);
  float* acc = D > 512 ? heap.data() : local;
  for (int64_t i = 0; i < work.parts; ++i) {
    const float* part = work.partial_at(b, i, h);
    if (part[D] == -std::numeric_limits<float>::infinity()) continue;
    const float w = tritonserve_vec::exp_clamped(part[D] - top);
    l += w * part[D + 1];
    for (int64_t d = 0; d < D; ++d) acc[d] += w * part[d];
  }
  const float inv = 1.0f / l;
  for (int64_t d = 0; d < D; ++d) out[d] = round(acc[d] * inv);
}

// Pages one sweep of `it` covers (its heads of `head_dim` elements of T a token slot)
template <typename T>
inline int64_t item_chunk(const Item& it, int64_t block_size, int64_t head_dim) {
  return chunk_pages(block_size * (it.h1 - it.h0) * head_dim * int64_t(sizeof(T)));
}

// Point `ahead` at the sweep after the one of `it` that ends at page p1: its next chunk, or
// the first chunk of `following` (the thread's next item; nullptr when there is none).
template <typename T>
inline void ask_next(Ahead<T>& ahead, const T* k_cache, const T* v_cache, const Item& it,
                     const Item* following, int64_t p1, int64_t block_size, int64_t kv_heads,
                     int64_t head_dim) {
  const int64_t row = kv_heads * head_dim;
  const Item* next = p1 < it.p1 ? &it : following;
  if (next == nullptr) {
    ahead.stop();
    return;
  }
  const int64_t from = next == &it ? p1 : next->p0;
  const int64_t to = std::min(next->p1, from + item_chunk<T>(*next, block_size, head_dim));
  ahead.start(k_cache, v_cache, next->table, next->len, from, to, block_size, row,
              next->h0 * head_dim, (next->h1 - next->h0) * head_dim);
}

}  // namespace tritonserve_sweep
