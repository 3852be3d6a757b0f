// One head of rotary embedding, HF's rotate-half layout, shared by rotary.cpp and layer_ops.cpp.
// Rounding follows the torch ops: in bf16 every product and the sum are rounded to bf16, as torch
// rounds each op's result.
//   out[:half] = x1 * cos - x2 * sin;   out[half:] = x2 * cos + x1 * sin
#pragma once

#include <cstdint>

#include "bf16.h"

inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

template <typename T>
void rotate_row(const T* x, const T* cos, const T* sin, T* out, int64_t half);

// No fused multiply-add here: torch rounds x1 * cos before subtracting, so must we to match it bit for bit.
template <>
__attribute__((optimize("fp-contract=off"))) inline void rotate_row<float>(
    const float* x, const float* cos, const float* sin, float* out, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * cos[i] - x2 * sin[i];
        out[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

template <>
inline void rotate_row<uint16_t>(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, uint16_t* out,
                                 int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
        float c = bf16_to_f32(cos[i]), s = bf16_to_f32(sin[i]);
        out[i] = f32_to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
        out[i + half] = f32_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
    }
}
