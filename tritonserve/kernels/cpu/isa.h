// The ISA levels of the CPU library, defined once from the compiler's target macros (-march):
// every file in this folder tests these four names and no compiler macro of its own, and
// the loaded library reports them (tritonserve::isa_levels, read by kernels/cpu/__init__.py), so
// Python asks the build what it has instead of guessing.
//   TS_AVX512       AVX-512 F, BW, DQ and VL: the 16-lane fp32 code (exp16, the sampler's
//                   argmax, the lane-sum tree in zmm registers)
//   TS_AVX512_BF16  and AVX512-BF16 (vdpbf16ps): the bf16 panel tiles (panels_bf16.h), the
//                   bf16 rows (rows.h), the bf16 decode attention (paged_decode_bf16.h), and
//                   so decode_layers in bf16
//   TS_AMX          and AMX-TILE + AMX-BF16: the bf16 panel matmuls on tiles (panels_amx.h;
//                   used only where the OS also grants the tile state, checked at run time)
// The headers of each level declare their entry points in every build (stubs without the
// level: an attention `pick` that finds no instance, a quantized bf16 product never reached),
// so the kernels test a level in `if constexpr` / at run time instead of an #if each.
// Without them the same ops run portable C++ that the compiler vectorises for its target
// (x86-64-v3: AVX2 + FMA; tests/test_cpu_build.py builds and tests that one too). Which CPU
// may load a build is checked before loading it, from the target's own macros
// (kernels/cpu/build.py), so a library built for one CPU never runs on another.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define TS_AVX512 1
#endif
// AVX2 + FMA + F16C (x86-64-v3, and every AVX-512 CPU): the 8-lane tiles of the quantized
// panels (panels_quant.h) where there is no AVX-512; the compiler's own vectorisation of the
// portable loops read the u4 codes at 0.7 GB/s on a 2-core AVX2 EPYC (these: 10x that)
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TS_AVX2 1
#endif
#if defined(TS_AVX512) && defined(__AVX512BF16__)
#define TS_AVX512_BF16 1
#endif
#if defined(TS_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TS_AMX 1
#endif

#if defined(TS_AVX512) || defined(TS_AVX2)
#include <immintrin.h>
#endif
#ifdef TS_AVX512
// after non-temporal (streaming) stores: them visible before an op returns
inline void ts_store_fence() { _mm_sfence(); }
#else
inline void ts_store_fence() {}  // the portable code streams nothing
#endif

namespace tritonserve_isa {

// The levels this build has, comma-separated (empty: portable only)
inline const char* levels() {
  return ""
#if defined(TS_AVX2) && !defined(TS_AVX512)
         "avx2"
#endif
#ifdef TS_AVX512
         "avx512"
#endif
#ifdef TS_AVX512_BF16
         ",avx512_bf16"
#endif
#ifdef TS_AMX
         ",amx"
#endif
      ;
}

}  // namespace tritonserve_isa
