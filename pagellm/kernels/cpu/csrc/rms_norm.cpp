// Fused RMSNorm for CPU: one pass per row instead of the ~10 small torch ops of the
// reference (cast, pow, mean, add, rsqrt, mul, cast...), which at decode cost more than
// the pass itself, 6 calls per Gemma layer. The row arithmetic (and its two flavours) is
// in norm.h.
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md

#include <cstdint>

#include "norm.h"

namespace {

template <int IS_BF16, int UNIT_OFFSET>
void norm_rows(const char* x, const void* weight, char* out, int64_t rows, int64_t dim, float eps) {
    const int64_t stride = dim * (IS_BF16 ? 2 : 4);
    // Threads only pay off for prefill-sized inputs; a decode row is done before a fork would be.
#pragma omp parallel for schedule(static) if (rows * dim >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r)
        norm_row<IS_BF16, UNIT_OFFSET>(x + r * stride, weight, out + r * stride, dim, eps);
}

}  // namespace

extern "C" void pagellm_rms_norm(const void* x, const void* weight, void* out, int64_t rows, int64_t dim,
                                 float eps, int is_bf16, int unit_offset) {
    const char* xs = static_cast<const char*>(x);
    char* os = static_cast<char*>(out);
    if (is_bf16 && unit_offset) norm_rows<1, 1>(xs, weight, os, rows, dim, eps);
    else if (is_bf16) norm_rows<1, 0>(xs, weight, os, rows, dim, eps);
    else if (unit_offset) norm_rows<0, 1>(xs, weight, os, rows, dim, eps);
    else norm_rows<0, 0>(xs, weight, os, rows, dim, eps);
}
