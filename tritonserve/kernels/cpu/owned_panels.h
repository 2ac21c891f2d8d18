// Splits a matmul's column panels over torch's OpenMP threads for decode-sized batches: each
// thread owns a contiguous share and computes it front to back; a thread done with its own
// takes the others' from their back, one panel at a time. Used by linear.cpp (fp32) and
// linear_bf16.cpp.
//
// Why: fixed halves do not end together (the OpenMP worker starts after the thread that opens
// the region; one core may run slower), and the first one done waited. A shared counter
// handing out 4-panel chunks measured 6 % slower (the other thread took the panels the weight
// stream had asked for; docs/perf-log/2026-cpu-decode.md); owners keep their stream. SmolLM2's 120 layer
// matmuls in bf16, one process, alternated with the fixed halves, 2-core Zen 5: M = 64 18.7 ->
// 17.3 ms, M = 1 7.8 -> 7.1, M = 16 unchanged. A core taken by another
// process for longer than an op costs the same either way: the thread there still holds the
// panel it was computing.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace tritonserve_panels {

// a thread's panels [front, back) as one word, (back << 32) | front
struct alignas(64) Owned {
  std::atomic<uint64_t> span;
};

// The next panel of `r`: its front (the owner) or its back (another thread); false when none
// is left.
inline bool take(Owned& r, bool front, int64_t& p) {
  uint64_t s = r.span.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t f = s & 0xffffffffu, b = s >> 32;
    if (f >= b) return false;
    const uint64_t t = front ? (b << 32 | (f + 1)) : ((b - 1) << 32 | f);
    if (r.span.compare_exchange_weak(s, t, std::memory_order_relaxed)) {
      p = static_cast<int64_t>(front ? f : b - 1);
      return true;
    }
  }
}

// panel(p) exactly once for every p in [0, count), then done() once on each thread that ran
// (the caller's fence for non-temporal stores).
template <typename Panel, typename Done>
void for_each_owned(int64_t count, Panel&& panel, Done&& done) {
  const int64_t threads = at::get_num_threads();
  std::vector<Owned> owned(threads);
  for (int64_t t = 0; t < threads; ++t)
    owned[t].span.store(static_cast<uint64_t>((t + 1) * count / threads) << 32 |
                        static_cast<uint64_t>(t * count / threads));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t p;
    for (int64_t t = t0; t < t1; ++t) {
      while (take(owned[t], true, p)) panel(p);
      for (int64_t o = 1; o < threads; ++o)
        while (take(owned[(t + o) % threads], false, p)) panel(p);
    }
    done();
  });
}

}  // namespace tritonserve_panels
