// Reads a sequence's KV pages into this core's cache just before the decode attention
// computes on them: both CPU decode paths (paged_decode.cpp, paged_decode_bf16.h) call it
// for pages that come from memory.
//
// Why: a cold page costs what fetches it. Software prefetches spread over the compute (what
// both paths did until the sixteenth session) keep only ~32 lines in flight a core, ~8 GB/s
// at this Zen 5's ~250 ns; a burst of plain loads over a few pages, nothing else in the way,
// runs at the hardware streamer's rate. Swept, then computed from L2: batch 64 x 128-228
// tokens, bf16, cold, 0.59-0.70 -> 0.42-0.47 ms a call, fp32 0.97 -> 0.65; in the engine's
// batch-64 decode step 537-625 -> 395-400 us a call, its share of the step 30-35 -> 25-26 %
// (docs/benchmarks.md, sixteenth session).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

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
    for (int s = 0; s < kPages; ++s) {
      const int64_t p = std::min(g + s, p1 - 1);
      n[s] = g + s < p1 ? std::min(block_size, len - p * block_size) : 0;
      k[s] = k_cache + int64_t(table[p]) * block_size * row + offset;
      v[s] = v_cache + int64_t(table[p]) * block_size * row + offset;
    }
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

}  // namespace tritonserve_sweep
