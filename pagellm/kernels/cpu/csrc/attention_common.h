// What paged_attention.cpp's driver and its inner loops (attention_avx512.h, attention_avx2.h,
// attention_scalar.h: one of them per build) share: the element types, the chunk size, bf16 <-> fp32
// and the prefetch of a chunk's rows. All are in the one translation unit's anonymous namespace.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#include "f16.h"  // f16: a K/V cache type only (fp32 queries read it, converted on load)

namespace {

using bf16 = uint16_t;  // raw bfloat16 bits

constexpr int kChunk = 16;               // keys per online-softmax step: one zmm of scores per row
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(f16 x) { return f16_to_f32(x); }
inline void from_float(float* dst, float x) { *dst = x; }
inline void from_float(bf16* dst, float x) {  // round to nearest even, like torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *dst = bf16((u >> 16) | 0x40);  // quiet NaN
    return;
  }
  *dst = bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The rows of the next chunk are requested while this one computes, one line per row per
// step of the inner loops: a chunk's rows are short runs scattered over the cache, which the
// hardware prefetchers catch late, and a burst of requests would stall on full miss queues.
template <typename T>
inline void prefetch_line(const T* const* rows, int n, int64_t d) {
  for (int j = 0; j < n; ++j) __builtin_prefetch(rows[j] + d, 0, 2);
}

}  // namespace
