// Where a decode_layers call's time goes, per thread and phase, when asked for
// (tritonserve::decode_layers_timing(True); `python -m bench profile` prints it): each
// thread's time in a phase's own work (busy) and at the barrier that ends it (wait), summed
// over the calls since timing was turned on. Off by default: one predictable branch a phase.
// Why: the op is one opaque entry in torch.profiler's table (80 % of a batch-64 step); every
// per-phase figure in docs/benchmarks.md until the twenty-third session needed a lab build.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>

namespace tritonserve_phases {

enum Phase { kNorm, kQkv, kAttention, kO, kGateUp, kDown, kPhases };
constexpr int64_t kThreads = 64;  // decode_layers' team is at most this large

// one thread's seconds, on cache lines of its own (the laps of two threads do not share one)
struct alignas(64) Row {
  double busy[kPhases];
  double wait[kPhases];
};

struct Totals {
  std::atomic<bool> on{false};
  Row rows[kThreads];
  int64_t calls = 0;
  void reset() {
    std::memset(rows, 0, sizeof rows);
    calls = 0;
  }
};

inline Totals& totals() {
  static Totals t;
  return t;
}

// One thread's laps within a call: busy(p) / wait(p) add the time since the previous lap to
// phase p's work / barrier time. Each thread writes only its own row of the totals.
class Clock {
 public:
  Clock(int64_t thread, bool on) : t_(thread), on_(on && thread < kThreads), last_(now()) {}
  void busy(Phase p) {
    if (on_) add(totals().rows[t_].busy[p]);
  }
  void wait(Phase p) {
    if (on_) add(totals().rows[t_].wait[p]);
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void add(double& slot) {
    const double n = now();
    slot += n - last_;
    last_ = n;
  }
  int64_t t_;
  bool on_;
  double last_;
};

}  // namespace tritonserve_phases
