// The argmax scans of logits.cpp, one per level (first maximum, the first NaN wins), in their own file to keep
// logits.cpp readable. Included once, inside logits.cpp's anonymous namespace.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

// ---- argmax ---------------------------------------------------------------------------

// The best of a span of a row; indices are the row's. first_nan < 0: the span has no NaN.
struct Best {
    float value;
    int64_t index;
    int64_t first_nan;
};

// `a` covers earlier indices than `b`: on ties, and between NaNs, the earlier wins.
inline Best combine(const Best& a, const Best& b) {
    if (a.first_nan >= 0) return a;
    if (b.first_nan >= 0 || b.value > a.value) return b;
    return a;
}

inline Best scan_scalar(const float* x, int64_t n, int64_t base) {
    Best best{-std::numeric_limits<float>::infinity(), base, -1};
    for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(x[i])) return {x[i], base + i, base + i};
        if (x[i] > best.value) best = {x[i], base + i, -1};
    }
    return best;  // all -inf: index `base`, the first
}

#ifdef __AVX512F__

// Largest span scanned with 32-bit lane indices.
constexpr int64_t kScanMax = int64_t(1) << 30;

// The best of (value, index) lanes: the largest value, the smallest index among equals.
inline void keep_best(__m512& v, __m512i& at, __m512 v2, __m512i at2) {
    const __mmask16 better = _mm512_cmp_ps_mask(v2, v, _CMP_GT_OQ) |
                             (_mm512_cmp_ps_mask(v2, v, _CMP_EQ_OQ) & _mm512_cmp_epi32_mask(at2, at, _MM_CMPINT_LT));
    v = _mm512_mask_mov_ps(v, better, v2);
    at = _mm512_mask_mov_epi32(at, better, at2);
}

// Four independent (max, where) accumulators so the compare -> select chains overlap; a lane
// only moves on a strictly larger value, so it holds the first index of its maximum. `where`
// keeps the offset of the 64-element group; the lane's own offset is added back at the end.
// NaNs are only detected here (compares against them are false) and located by a rescan.
Best scan_vector(const float* x, int64_t n, int64_t base) {
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 best[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
    __m512i where[4] = {};
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m512i group = _mm512_set1_epi32(int(i));
        __m512 v[4];
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm512_loadu_ps(x + i + 16 * k);
            const __mmask16 up = _mm512_cmp_ps_mask(v[k], best[k], _CMP_GT_OQ);
            best[k] = _mm512_mask_mov_ps(best[k], up, v[k]);
            where[k] = _mm512_mask_mov_epi32(where[k], up, group);
        }
        nan |= _mm512_cmp_ps_mask(v[0], v[1], _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v[2], v[3], _CMP_UNORD_Q);
    }
    // The tail: 16 at a time into accumulator 0, offsets being multiples of 16 as above.
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(neg_inf, m, x + i);
        const __mmask16 up = _mm512_cmp_ps_mask(v, best[0], _CMP_GT_OQ);
        best[0] = _mm512_mask_mov_ps(best[0], up, v);
        where[0] = _mm512_mask_mov_epi32(where[0], up, _mm512_set1_epi32(int(i)));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan) return scan_scalar(x, n, base);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int k = 0; k < 4; ++k)
        where[k] = _mm512_add_epi32(where[k], _mm512_add_epi32(lane, _mm512_set1_epi32(16 * k)));
    keep_best(best[0], where[0], best[1], where[1]);
    keep_best(best[2], where[2], best[3], where[3]);
    keep_best(best[0], where[0], best[2], where[2]);
    const float top = _mm512_reduce_max_ps(best[0]);
    if (top == -std::numeric_limits<float>::infinity()) return {top, base, -1};  // all -inf: the first
    const __mmask16 at_top = _mm512_cmp_ps_mask(best[0], _mm512_set1_ps(top), _CMP_EQ_OQ);
    return {top, base + _mm512_mask_reduce_min_epi32(at_top, where[0]), -1};
}

Best scan(const float* x, int64_t n, int64_t base) {
    Best best = scan_vector(x, std::min(n, kScanMax), base);
    for (int64_t i = kScanMax; i < n; i += kScanMax)
        best = combine(best, scan_vector(x + i, std::min(n - i, kScanMax), base + i));
    return best;
}

#elif defined(__AVX2__)

constexpr int64_t kScanMax = int64_t(1) << 30;

// As the AVX-512 scan: four (max, where) accumulators of 8 lanes over groups of 32, a lane moving only
// on a strictly larger value; the tail (n % 32) scanned one by one and combined as a later part.
Best scan_vector(const float* x, int64_t n, int64_t base) {
    const int64_t body = n - n % 32;
    if (body == 0) return scan_scalar(x, n, base);
    const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 best[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
    __m256 where[4] = {};  // int32 group offsets, kept in float registers (blends move bits unchanged)
    __m256 nan = _mm256_setzero_ps();
    for (int64_t i = 0; i < body; i += 32) {
        const __m256 group = _mm256_castsi256_ps(_mm256_set1_epi32(int(i)));
        __m256 v[4];
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm256_loadu_ps(x + i + 8 * k);
            const __m256 up = _mm256_cmp_ps(v[k], best[k], _CMP_GT_OQ);
            best[k] = _mm256_blendv_ps(best[k], v[k], up);
            where[k] = _mm256_blendv_ps(where[k], group, up);
        }
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(v[0], v[1], _CMP_UNORD_Q),
                                             _mm256_cmp_ps(v[2], v[3], _CMP_UNORD_Q)));
    }
    if (_mm256_movemask_ps(nan)) return scan_scalar(x, n, base);
    alignas(32) float value[32];
    alignas(32) int32_t at[32];
    for (int k = 0; k < 4; ++k) {
        _mm256_store_ps(value + 8 * k, best[k]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(at + 8 * k), _mm256_castps_si256(where[k]));
    }
    // The largest value, the smallest index among its lanes (all -inf: lane 0 of group 0, the first).
    float top = value[0];
    int64_t first = at[0];
    for (int l = 1; l < 32; ++l) {
        const int64_t index = int64_t(at[l]) + l;  // the group's offset + the lane's place in the group
        if (value[l] > top || (value[l] == top && index < first)) top = value[l], first = index;
    }
    const Best head{top, base + first, -1};
    return body == n ? head : combine(head, scan_scalar(x + body, n - body, base + body));
}

Best scan(const float* x, int64_t n, int64_t base) {
    Best best = scan_vector(x, std::min(n, kScanMax), base);
    for (int64_t i = kScanMax; i < n; i += kScanMax)
        best = combine(best, scan_vector(x + i, std::min(n - i, kScanMax), base + i));
    return best;
}

#else

Best scan(const float* x, int64_t n, int64_t base) { return scan_scalar(x, n, base); }

#endif  // __AVX512F__
