// core_to_core_ns(trips) -> float: the one-way latency of a cache line between two of torch's
// OpenMP threads (ns, the median of 5 runs of `trips` round trips: each thread waits for the
// other's store to one line, then stores back), or NaN with fewer than 2 threads.
// Why: the bench's read rate alone does not say which machine a figure ran on. On the 2-vCPU
// Zen 4 VM of docs/benchmarks.md the two vCPUs sometimes share a CCD (~32 ns here, a read of
// ~33-38 GB/s through one link) and sometimes not (106-181 ns, 52-61 GB/s through two links,
// an OpenMP barrier 540 ns instead of 250): the decode step, whose threads meet five times a
// layer, ran 3.7-4.3 ms on one CCD and 4.1-5.8 on two (docs/perf-log/
// 2026-12-04-quantized-weights.md, "Two machines in one VM"). bench/machine.sh prints it
// beside the read rate.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

double core_to_core_ns(int64_t trips) {
  TORCH_CHECK(trips >= 1, "core_to_core_ns: trips must be at least 1, got ", trips);
  if (at::get_num_threads() < 2) return std::numeric_limits<double>::quiet_NaN();
  struct alignas(64) Line {
    std::atomic<int64_t> turn{0};
  };
  std::vector<double> runs;
  for (int run = 0; run < 5; ++run) {
    Line line;
    double ns = 0.0;
#pragma omp parallel num_threads(2)
    {
      const int64_t me = omp_get_thread_num();
#pragma omp barrier
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < trips; ++i) {
        const int64_t mine = 2 * i + me;  // thread 0 moves on even turns, thread 1 on odd
        while (line.turn.load(std::memory_order_acquire) != mine) spin_pause();
        line.turn.store(mine + 1, std::memory_order_release);
      }
      if (me == 0)
        ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start)
                 .count() / (2.0 * trips);
    }
    runs.push_back(ns);
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tritonserve, m) {
  m.def("core_to_core_ns(int trips) -> float", &core_to_core_ns);
}
