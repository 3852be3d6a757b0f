// Rotary embedding, HF's rotate-half layout, in one pass over q or k (the head arithmetic is in rope.h).
// The torch form (pagellm/layers/rotary.py apply_rotary) is 9 small ops at decode,
// twice per layer; this is one call.
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md

#include <cstdint>

#include "rope.h"

namespace {

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
