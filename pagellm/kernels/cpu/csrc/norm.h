// One row of RMSNorm, shared by rms_norm.cpp and layer_ops.cpp so the fused and plain calls round alike.
//
// Two flavours, matching pagellm/layers/norm.py (and HF) in where rounding happens:
//   unit_offset:  y = dtype(x / rms(x) * (1 + w))        (Gemma; w given as fp32)
//   plain:        y = dtype(w * dtype(x / rms(x)))       (Llama/Qwen; w in the model dtype)
// rms is computed in fp32. dtype is fp32 (is_bf16 = 0) or bf16 (is_bf16 = 1).
#pragma once

#include <cmath>
#include <cstdint>

#include "bf16.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

inline float load_as_f32(const void* p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline float round_to(float v, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

inline void store_from_f32(void* p, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
    else
        static_cast<float*>(p)[i] = v;
}

// sum of x^2 in one order at every level, so the norms are bit-identical across builds: 16 fp32 lanes, each an
// fma chain over every 16th element, reduced as (l + l+8), then (+4), (+2), (+1); the tail (dim % 16) added
// after, one rounded product and sum each.
inline float sum_squares(const void* row, int64_t dim, int is_bf16) {
    const int64_t body = dim - dim % 16;
    float lanes[16] = {};
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < body; i += 16) {
        __m512 v;
        if (is_bf16) {
            __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i));
            v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        } else {
            v = _mm512_loadu_ps(static_cast<const float*>(row) + i);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    _mm512_storeu_ps(lanes, acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7 and 8-15
    for (int64_t i = 0; i < body; i += 16) {
        __m256 a, b;
        if (is_bf16) {
            const uint16_t* p = static_cast<const uint16_t*>(row) + i;
            a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
            b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8))), 16));
        } else {
            a = _mm256_loadu_ps(static_cast<const float*>(row) + i);
            b = _mm256_loadu_ps(static_cast<const float*>(row) + i + 8);
        }
        lo = _mm256_fmadd_ps(a, a, lo);
        hi = _mm256_fmadd_ps(b, b, hi);
    }
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
#else
    for (int64_t i = 0; i < body; i += 16)
        for (int l = 0; l < 16; ++l) {
            const float v = load_as_f32(row, i + l, is_bf16);
            lanes[l] = std::fma(v, v, lanes[l]);
        }
#endif
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
    float total = lanes[0];
    for (int64_t i = body; i < dim; ++i) {
        float v = load_as_f32(row, i, is_bf16);
        total += v * v;
    }
    return total;
}

template <int IS_BF16, int UNIT_OFFSET>
void norm_row(const void* x, const void* weight, void* out, int64_t dim, float eps) {
    float inv = 1.f / std::sqrt(sum_squares(x, dim, IS_BF16) / float(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) {
        float normed = load_as_f32(x, i, IS_BF16) * inv;
        float y = UNIT_OFFSET ? normed * (1.f + static_cast<const float*>(weight)[i])
                              : load_as_f32(weight, i, IS_BF16) * round_to(normed, IS_BF16);
        store_from_f32(out, i, y, IS_BF16);
    }
}

// One row of the residual add + norm (layer_ops.cpp's pagellm_add_rms_norm, quant_gguf.cpp's matmul epilogue):
// h = residual + post(x), rounded once as torch's add (post: the block's own output norm, Gemma's sandwich
// norms, or null), written to residual_out; out = norm(h).
template <int IS_BF16, int UNIT_OFFSET>
void add_norm_row(const char* residual, const char* x, const void* post_weight, const void* weight,
                  char* residual_out, char* out, int64_t dim, float eps) {
    if (post_weight != nullptr) {  // the post norm first, rounded, into residual_out as scratch
        norm_row<IS_BF16, UNIT_OFFSET>(x, post_weight, residual_out, dim, eps);
        x = residual_out;
    }
    for (int64_t i = 0; i < dim; ++i)
        store_from_f32(residual_out, i, load_as_f32(residual, i, IS_BF16) + load_as_f32(x, i, IS_BF16), IS_BF16);
    norm_row<IS_BF16, UNIT_OFFSET>(residual_out, weight, out, dim, eps);
}

// add_norm_row over rows of dim values (threads for large inputs).
template <int IS_BF16, int UNIT_OFFSET>
void add_norm_rows(const char* residual, const char* x, const void* post_weight, const void* weight,
                   char* residual_out, char* out, int64_t rows, int64_t dim, float eps) {
    const int64_t stride = dim * (IS_BF16 ? 2 : 4);
#pragma omp parallel for schedule(static) if (rows * dim >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r)
        add_norm_row<IS_BF16, UNIT_OFFSET>(residual + r * stride, x + r * stride, post_weight, weight,
                                           residual_out + r * stride, out + r * stride, dim, eps);
}

// The four instantiations by the runtime flags.
inline void add_norm_rows_as(const void* residual, const void* x, const void* post_weight, const void* weight,
                             void* residual_out, void* out, int64_t rows, int64_t dim, float eps, int is_bf16,
                             int unit_offset) {
    auto r = static_cast<const char*>(residual);
    auto xs = static_cast<const char*>(x);
    auto ro = static_cast<char*>(residual_out);
    auto o = static_cast<char*>(out);
    if (is_bf16 && unit_offset) add_norm_rows<1, 1>(r, xs, post_weight, weight, ro, o, rows, dim, eps);
    else if (is_bf16) add_norm_rows<1, 0>(r, xs, post_weight, weight, ro, o, rows, dim, eps);
    else if (unit_offset) add_norm_rows<0, 1>(r, xs, post_weight, weight, ro, o, rows, dim, eps);
    else add_norm_rows<0, 0>(r, xs, post_weight, weight, ro, o, rows, dim, eps);
}
