// Scalar helpers written so that an `omp simd` loop vectorises them (std::exp and c10's
// bf16 conversions compile to a call or a branch per element; these are plain arithmetic).
// Shared by the CPU ops in this folder.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tritonserve_vec {

// exp(x) for x in any range, clamped to [-87, 88] (below: ~1e-38, above: ~1.6e38; the
// callers' results do not change there). 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p
// Taylor to degree 6: relative error < 2e-7, about fp32's rounding.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln2 split in two parts
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// bf16 <-> fp32 on the raw bits: the 16 bits shifted up; back, rounded to nearest even
// (what c10::BFloat16's constructor does; NaN stays NaN, overflow goes to inf)
inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7fc0) : rounded;  // a select, still vectorised
}

// load / store of one element as fp32 for T in {float, bf16, half}: bf16 on raw bits (the
// loops vectorise), half through c10 (scalar)
template <typename T>
inline float load_f(const T* p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[0]);
  } else {
    return static_cast<float>(*p);
  }
}

template <typename T>
inline void store_f(T* p, float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    reinterpret_cast<uint16_t*>(p)[0] = float_to_bf16(f);
  } else {
    *p = static_cast<T>(f);
  }
}

// f rounded to T and back: the dtype rounding transformers applies between two steps
template <typename T>
inline float round_to(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_to_float(float_to_bf16(f));
  } else {
    return static_cast<float>(static_cast<T>(f));
  }
}

}  // namespace tritonserve_vec
