// The bf16 panel matmul on Intel AMX tiles, over the same panels as panels_bf16.h (no second
// copy of the weights): where the CPU has AMX-BF16 and the kernel has the OS's permission,
// this header's panel_product (what linear_bf16.cpp and decode_layers.cpp call) sends
// batches of kMinRows rows and more here, the rest to panels_bf16.h's.
//
// The layout fits as it is: a panel's k pair j holds 32 columns x 2 k (128 bytes), so an AMX
// B tile (16 k pairs x 16 columns x 2) is 16 rows of 64 bytes, 128 bytes apart: columns 0-15
// at the panel's start, 16-31 at +64 bytes. An A tile is 16 rows of x, 32 k each. Two row
// blocks against the panel's two column halves: four C tiles (16 x 16 fp32), two A, two B.
// Sums stay in fp32 over all of K, rounded to bf16 once in panels_bf16.h's epilogue (the same
// store_row_dp, so bias, the gate/up activation and the non-temporal rows are its own).
// The order of the fp32 additions is the tile's, not vdpbf16ps's: results differ from the
// AVX512-BF16 tile in the last bits of the fp32 sum, as two BLAS do.
//
// Why: on a 2-core Xeon with AMX (KVM guest), SmolLM2's 121 matmuls at M = 64 took 77.8 ms
// on the AVX512-BF16 tiles (221 GFLOP/s), 19.0 ms in oneDNN (its AMX kernels) and 17.0 ms
// here; docs/perf-log/2026-cpu-decode.md has the other sizes.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "isa.h"
#include "panels_bf16.h"

#ifdef TS_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tritonserve_amx {

constexpr int64_t kTile = 16;     // rows of an A or C tile
constexpr int64_t kStep = 32;     // k a tile step covers (16 pairs)
constexpr int64_t kMinRows = 4;   // fewer rows stay on the AVX512-BF16 tile
// Where a panel takes two passes (more than 16 rows), the first asks for the weights this far
// ahead into L2 (prefetcht2; past a panel's end the next one's, as the AVX512-BF16 row loop
// does), 32 lines a k step: SmolLM2's 121 matmuls, three rounds alternated, M = 32 16.6-18.5
// -> 15.9-16.3 ms, 64 21.4-24.5 -> 20.3-22.2, 128 33.5-36.7 -> 30.6-33.0; at 16 rows (one
// pass) it cost ~1 ms, so one pass asks nothing. Asking into L1 (prefetcht0) one to four
// panels ahead was 15-25 % slower at every size.
constexpr int64_t kAheadBytes = 16 << 10;

// x rows the kernel reads for M rows: whole tiles (the rows past M are read, never used)
inline int64_t padded_rows(int64_t M) { return (M + kTile - 1) / kTile * kTile; }

#ifdef TS_AMX
// AMX-BF16 and AMX-TILE in CPUID, and Linux's permission for the tile data (asked once for
// the process: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); without it the first tile
// instruction faults).
inline bool granted() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
inline bool available() {
  static const bool ok = granted();
  return ok;
}
#else
inline bool available() { return false; }
#endif

// TRITONSERVE_AMX=0 turns the tiles off (what the benchmarks compare against); storing false
// does the same at run time (tritonserve::set_amx).
inline std::atomic<bool>& wanted() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("TRITONSERVE_AMX");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }()};
  return on;
}
inline bool enabled() { return available() && wanted().load(std::memory_order_relaxed); }

// Whether panel_product takes the tiles for M rows of K: then x must hold padded_rows(M)
// readable rows (or a staged tail, see product()).
inline bool use(int64_t M, int64_t K) { return M >= kMinRows && K % kStep == 0 && enabled(); }

#ifdef TS_AMX
struct alignas(64) Config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// every tile 16 rows of 64 bytes (A: 32 bf16; B: 16 columns x 2; C: 16 fp32)
inline void configure() {
  Config c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = kTile;
  _tile_loadconfig(&c);
}

using tritonserve_panels_bf16::kCols;
using tritonserve_panels_bf16::Out;

// C tiles' rows out through panels_bf16.h's epilogue: rows [0, rows) of block `sums`
// (16 x 32 fp32) to out.y + row0 * ldy
inline void write_rows(const float (*sums)[kCols], int64_t row0, int64_t rows, const Out& out) {
  for (int64_t r = 0; r < rows; ++r)
    tritonserve_panels_bf16::store_row_dp(_mm512_load_ps(sums[r]), _mm512_load_ps(sums[r] + 16),
                                          out.y + (row0 + r) * out.ldy, out.ncols, out.bias,
                                          out.silu, out.stream);
}

// Rows [0, M) of x (row stride ldx) against one panel (K % 32 == 0). Row block i reads
// x + 16 i ldx, except a last partial block when `tail` is given: its rows, padded to 16,
// at tail (row stride K). Without a tail, x must hold padded_rows(M) rows.
inline void product(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
                    const uint16_t* panel, const Out& out, const uint16_t* tail = nullptr) {
  configure();
  const int64_t blocks = (M + kTile - 1) / kTile;
  const bool staged = tail != nullptr && M % kTile != 0;
  auto rows_of = [&](int64_t blk) {
    const uint16_t* a = staged && blk == blocks - 1 ? tail : x + blk * kTile * ldx;
    return a;
  };
  auto stride_of = [&](int64_t blk) {
    return (staged && blk == blocks - 1 ? K : ldx) * int64_t(sizeof(uint16_t));
  };
  alignas(64) float sums[2][kTile][kCols];
  constexpr int64_t kB = 2 * kCols * sizeof(uint16_t);  // bytes from one k pair to the next
  int64_t blk = 0;
  for (; blk + 1 < blocks; blk += 2) {
    const uint16_t* a0 = rows_of(blk);
    const uint16_t* a1 = rows_of(blk + 1);
    const int64_t s0 = stride_of(blk), s1 = stride_of(blk + 1);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += kStep) {
      const uint16_t* b = panel + k * kCols;  // k pair k / 2
      if (blk == 0) {  // the first pass asks for the lines kAheadBytes on
        const char* ahead = reinterpret_cast<const char*>(b) + kAheadBytes;
        for (int i = 0; i < 32; ++i) _mm_prefetch(ahead + 64 * i, _MM_HINT_T2);
      }
      _tile_loadd(4, a0 + k, s0);
      _tile_loadd(6, b, kB);
      _tile_loadd(7, b + kCols, kB);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a1 + k, s1);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, &sums[0][0][0], kCols * sizeof(float));
    _tile_stored(1, &sums[0][0][16], kCols * sizeof(float));
    _tile_stored(2, &sums[1][0][0], kCols * sizeof(float));
    _tile_stored(3, &sums[1][0][16], kCols * sizeof(float));
    write_rows(sums[0], blk * kTile, kTile, out);
    write_rows(sums[1], (blk + 1) * kTile, std::min(kTile, M - (blk + 1) * kTile), out);
  }
  if (blk < blocks) {
    const uint16_t* a0 = rows_of(blk);
    const int64_t s0 = stride_of(blk);
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < K; k += kStep) {
      const uint16_t* b = panel + k * kCols;
      _tile_loadd(4, a0 + k, s0);
      _tile_loadd(6, b, kB);
      _tile_loadd(7, b + kCols, kB);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, &sums[0][0][0], kCols * sizeof(float));
    _tile_stored(1, &sums[0][0][16], kCols * sizeof(float));
    write_rows(sums[0], blk * kTile, std::min(kTile, M - blk * kTile), out);
  }
}
#endif

// panels_bf16.h's panel_product, on the tiles where use(M, K) (x then holds padded_rows(M)
// rows, or its last partial block is staged at `tail`)
inline void panel_product(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panel,
                          int64_t kp, const tritonserve_panels_bf16::Out& out,
                          const uint16_t* tail = nullptr) {
#ifdef TS_AMX
  if (use(M, K)) {
    product(x, K, M, K, panel, out, tail);
    return;
  }
#endif
  (void)tail;
  tritonserve_panels_bf16::panel_product(x, M, K, panel, kp, out);
}

}  // namespace tritonserve_amx
