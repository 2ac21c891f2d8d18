// Where a decode_layers call's time goes, per thread and phase, when asked for
// (tritonserve::decode_layers_timing(True); `python -m bench profile` prints it): each
// thread's time in a phase's own work (busy) and at the barrier that ends it (wait), summed
// over the calls since timing was turned on. Off by default: one predictable branch a phase.
// Why: the op is one opaque entry in torch.profiler's table (80 % of a batch-64 step); without
// this clock a per-phase figure needed a lab build.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

namespace tritonserve_phases {

enum Phase { kNorm, kQkv, kAttention, kO, kGateUp, kDown, kPhases };

// one thread's seconds, on cache lines of its own (the laps of two threads do not share one)
struct alignas(64) Row {
  double busy[kPhases];
  double wait[kPhases];
};

struct Totals {
  std::atomic<bool> on{false};
  std::vector<Row> rows;  // one a team member: start() grows it to the team
  int64_t calls = 0;
  void reset() {
    std::fill(rows.begin(), rows.end(), Row{});
    calls = 0;
  }
  // before a call's parallel region: whether timing is on, with a row for every member
  bool start(int64_t threads) {
    if (!on.load(std::memory_order_relaxed)) return false;
    if (static_cast<int64_t>(rows.size()) < threads) rows.resize(threads);
    return true;
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
  // on: Totals::start said so for a team that includes `thread`
  Clock(int64_t thread, bool on) : row_(on ? &totals().rows[thread] : nullptr), last_(now()) {}
  void busy(Phase p) {
    if (row_ != nullptr) add(row_->busy[p]);
  }
  void wait(Phase p) {
    if (row_ != nullptr) add(row_->wait[p]);
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
  Row* row_;
  double last_;
};

}  // namespace tritonserve_phases
