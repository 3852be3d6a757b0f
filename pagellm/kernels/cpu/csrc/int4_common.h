// What quant_gemv.cpp (bf16 activations) and quant_gemv_q8.cpp (int8 activations) share: the int4 layout's
// sizes (described in quant_gemv.cpp), the threading threshold, scalar loads and stores, and (AVX-512 BF16)
// vector bf16 loads and the output store.
#pragma once

#include <cstdint>

#include "bf16.h"

namespace {

constexpr int64_t kGroup = 32;  // columns per scale / zero
constexpr int64_t kBlock = 16;  // int4 rows per block
// Software prefetch distance in the weight stream: without it both kernels read slower from DRAM, and this
// distance measured best.
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
constexpr int64_t kPrefetch = 4096;

// Threads only where there is enough to share: a fork/join costs a few microseconds.
inline bool worth_threads(int64_t bytes) { return bytes >= (64 << 10); }

inline float load_value(const void* p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store_value(void* p, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
    else
        static_cast<float*>(p)[i] = v;
}

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

inline __m512 bf16x16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// out[offset..+16] = v + bias[column..+16] in the output dtype.
inline void store16(__m512 v, const void* bias, int64_t column, void* out, int64_t offset, int out_bf16) {
    if (bias) v = _mm512_add_ps(v, out_bf16 ? bf16x16(static_cast<const uint16_t*>(bias) + column)
                                            : _mm512_loadu_ps(static_cast<const float*>(bias) + column));
    if (out_bf16)
        _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(out) + offset), (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_storeu_ps(static_cast<float*>(out) + offset, v);
}

}  // namespace

#endif  // AVX-512 BF16
