// Rotary embedding, HF's rotate-half layout, in one pass over q or k.
// The torch form (pagellm/layers/rotary.py apply_rotary) is 9 small ops (~20 us at
// decode, twice per layer); this is one call. Rounding follows the torch ops: in bf16
// every product and the sum are rounded to bf16, as torch rounds each op's result.
//   out[:half] = x1 * cos - x2 * sin;   out[half:] = x2 * cos + x1 * sin

#include <cstdint>
#include "bf16.h"
#include <cstring>

namespace {


inline float r(float v) { return bf16_to_f32(f32_to_bf16(v)); }

template <typename T>
void rotate_row(const T* x, const T* cos, const T* sin, T* out, int64_t half);

// No fused multiply-add here: torch rounds x1 * cos before subtracting, so must we to match it bit for bit.
template <>
__attribute__((optimize("fp-contract=off"))) void rotate_row<float>(const float* x, const float* cos, const float* sin, float* out, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * cos[i] - x2 * sin[i];
        out[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

template <>
void rotate_row<uint16_t>(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, uint16_t* out,
                          int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
        float c = bf16_to_f32(cos[i]), s = bf16_to_f32(sin[i]);
        out[i] = f32_to_bf16(r(x1 * c) - r(x2 * s));
        out[i + half] = f32_to_bf16(r(x2 * c) + r(x1 * s));
    }
}

template <typename T>
void rotate(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t dim) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= (1 << 16))
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t row = (t * heads + h) * dim;
            rotate_row<T>(x + row, cos + t * half, sin + t * half, out + row, half);
        }
}

}  // namespace

// x, out: [tokens, heads, dim] contiguous; cos, sin: [tokens, dim / 2] contiguous, same dtype as x.
extern "C" void pagellm_rotary(const void* x, const void* cos, const void* sin, void* out, int64_t tokens,
                               int64_t heads, int64_t dim, int is_bf16) {
    if (is_bf16)
        rotate(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(cos),
               static_cast<const uint16_t*>(sin), static_cast<uint16_t*>(out), tokens, heads, dim);
    else
        rotate(static_cast<const float*>(x), static_cast<const float*>(cos), static_cast<const float*>(sin),
               static_cast<float*>(out), tokens, heads, dim);
}
