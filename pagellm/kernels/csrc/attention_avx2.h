// 8-lane (AVX2 + FMA) math for paged_attention.cpp's AVX2 path, written to give the same bits as the
// AVX-512 code it mirrors: tanh8 is the kernel's tanh512 (checked over all 2^32 fp32 inputs), on exp512.h's
// exp256.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

#include "exp512.h"  // exp256: exp512's bits on 8 lanes

namespace attention_avx2 {

// tanh as the kernel's tanh512: odd Taylor series below |x| = 0.4, 1 - 2/(e^2|x| + 1) above.
inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 ax = _mm256_andnot_ps(sign, x);
    __m256 e = exp256(_mm256_min_ps(_mm256_add_ps(ax, ax), _mm256_set1_ps(88.0f)));
    __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                               _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    __m256 x2 = _mm256_mul_ps(ax, ax);
    __m256 s = _mm256_set1_ps(-929569.0f / 638512875.0f);
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(21844.0f / 6081075.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(-1382.0f / 155925.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(62.0f / 2835.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(-17.0f / 315.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(2.0f / 15.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(-1.0f / 3.0f));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(s, x2), ax, ax);
    __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.4f), _CMP_LT_OQ));
    return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}

// Horizontal sums of 8 vectors in one, lane i = sum of a[i], each summed in halving order
// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)): the tree the AVX-512 path's reduce16 applies
// to the low + high halves of a 16-lane accumulator.
inline __m256 reduce8(const __m256* a) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; ++i)  // 8 -> 4 partials: a[i] in the low 128 bits, a[i + 4] in the high
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
    for (int i = 0; i < 2; ++i) {  // 4 -> 2 partials, two inputs per 128 bits
        __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
        c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
}

// Sum of 16 lanes held as (lo, hi) in the order of GCC's _mm512_reduce_add_ps: (hi + lo), then
// 128-bit halves, then lanes 2 apart, then adjacent.
inline float hsum16(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(hi, lo);
    __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// Maximum of 8 lanes (order-free for the finite values it sees).
inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// All-ones in lane i where bit i of bits (i < 8) is set.
inline __m256 lane_mask8(uint32_t bits) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits)), lane), lane));
}
}  // namespace attention_avx2
#endif  // __AVX2__ && __FMA__
