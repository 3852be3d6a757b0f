// e^x over 16, 8 or 1 fp32 lanes, shared by the kernels that need a vector exp:
//
//   exp512      AVX-512F           (16 lanes)
//   exp256      AVX2 + FMA         (8 lanes)
//   exp_scalar  plain C++          (1 lane; exp_lanes<N>: N lanes side by side. fma_f32.h's fma: one
//                                  instruction where there is one, else emulated, exactly rounded)
//
// The three are one algorithm and give the same bits for every fp32 input (checked once over all 2^32
// inputs, each form built at its level; tests/kernels/test_logits_kernels.py compares ~2.5 M of them), so
// a kernel built for any level computes what its AVX-512 build computes:
//
//   clamp     x = min(max(x, -104), 89), with max/min's x86 semantics: a NaN x becomes -104 (so e^NaN
//             gives 0; callers that care mask NaN themselves)
//   n         round-to-nearest-even(x * log2(e))  (the product rounded first)
//   r         x - n ln2 with ln2 split in two, each step one fma
//   e^r       a degree-6 polynomial (Cephes' expf, ~1 ulp), fma steps, then p * r^2 + (r + 1) as one fma
//   2^n e^r   p * 2^n rounded once (AVX-512: scalef). Elsewhere p * 2^(n>>1) * 2^(n - (n>>1)): n is in
//             [-150, 128], so both factors are normal powers of two built from exponent bits, the first
//             product is exact (p is in [0.7, 1.42]) and only the second rounds, also where the result
//             is denormal or overflows to inf, as scalef does.
//
// Results are 0 below about -103.97 and inf above about 88.72. std::exp per element was most of the
// Gated DeltaNet conv's decode time. measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fma_f32.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace pagellm_exp {
constexpr float kLo = -104.f, kHi = 89.f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace pagellm_exp

#ifdef __AVX512F__
inline __m512 exp512(__m512 x) {
    using namespace pagellm_exp;
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kLo)), _mm512_set1_ps(kHi));  // 0 / inf past these
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);  // x - n ln2, ln2 split in two
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    __m512 p = _mm512_set1_ps(kP0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// 2^k for integer lanes k in [-126, 127]: the exponent field alone.
inline __m256 exp256_pow2(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

inline __m256 exp256(__m256 x) {
    using namespace pagellm_exp;
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLo)), _mm256_set1_ps(kHi));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    __m256 p = _mm256_set1_ps(kP0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i k = _mm256_cvtps_epi32(n);  // exact: n is an integer
    const __m256i half = _mm256_srai_epi32(k, 1);
    return _mm256_mul_ps(_mm256_mul_ps(p, exp256_pow2(half)), exp256_pow2(_mm256_sub_epi32(k, half)));
}
#endif  // __AVX2__ && __FMA__

inline float exp_scalar_pow2(int k) {  // 2^k for k in [-126, 127]
    const uint32_t bits = uint32_t(k + 127) << 23;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// e^x[l] for N lanes in plain C++ (N = 1: exp_scalar). Each step runs over all lanes before the next, so
// the N independent chains of 8 fmas overlap where fma_f32 is emulated (generic x86-64: faster than one lane at
// a time); every lane computes exactly what exp_scalar does.
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
template <int N>
inline void exp_lanes(const float* in, float* out) {
    using namespace pagellm_exp;
    float x[N], n[N], r[N], p[N];
    for (int l = 0; l < N; ++l) {
        float v = in[l] > kLo ? in[l] : kLo;  // as maxps(x, lo): lo when x is NaN
        v = v < kHi ? v : kHi;
        x[l] = v;
        // Nearest even for |t| < 2^22: adding 1.5 * 2^23 leaves no fraction bits (the float sum's rounding
        // is the integer rounding, and the even constant keeps parity); subtracting it back is exact.
        const float t = v * kLog2e;
        n[l] = (t + 12582912.f) - 12582912.f;
    }
    for (int l = 0; l < N; ++l) r[l] = fma_f32(-n[l], kLn2Hi, x[l]);
    for (int l = 0; l < N; ++l) r[l] = fma_f32(-n[l], kLn2Lo, r[l]);
    for (int l = 0; l < N; ++l) p[l] = fma_f32(kP0, r[l], kP1);
    for (int l = 0; l < N; ++l) p[l] = fma_f32(p[l], r[l], kP2);
    for (int l = 0; l < N; ++l) p[l] = fma_f32(p[l], r[l], kP3);
    for (int l = 0; l < N; ++l) p[l] = fma_f32(p[l], r[l], kP4);
    for (int l = 0; l < N; ++l) p[l] = fma_f32(p[l], r[l], kP5);
    for (int l = 0; l < N; ++l) p[l] = fma_f32(p[l], r[l] * r[l], r[l] + 1.f);
    for (int l = 0; l < N; ++l) {
        const int k = int(n[l]);
        const int half = k >= 0 ? k / 2 : -((1 - k) / 2);  // floor(k / 2), as the arithmetic shift above
        out[l] = p[l] * exp_scalar_pow2(half) * exp_scalar_pow2(k - half);
    }
}

inline float exp_scalar(float x) {
    float y;
    exp_lanes<1>(&x, &y);
    return y;
}
