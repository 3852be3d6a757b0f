// act(gate) * up, the gated MLP's activation, shared by layer_ops.cpp (act_mul over a fused gate/up output) and
// quant_gguf.cpp (the same arithmetic in the gate/up matmul's epilogue, on the values it would have stored).
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <cstdint>

#include "bf16.h"
#include "exp512.h"
#include "fma_f32.h"

namespace {

// act_mul: silu(x) = x / (1 + e^-x);  gelu_tanh(x) = 0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3),
// with tanh(y) = 1 - 2 / (e^(2y) + 1): torch's form, so it too gives exactly 0 where tanh(y) rounds to -1.
// The act is rounded to the dtype, then the product rounded: torch's two ops. One formula at every level
// (16 lanes, 8 lanes, scalar) with the same roundings and the same exp (exp512.h), so the avx512, avx2 and
// generic builds give identical bits. bf16 rounding is to nearest even; a NaN stays a (quiet) NaN.

inline float round1(float v, float*) { return v; }
inline float round1(float v, uint16_t*) { return bf16_to_f32(f32_to_bf16(v)); }
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_f32(*p); }
inline void store1(float* p, float v) { *p = v; }
inline void store1(uint16_t* p, float v) { *p = f32_to_bf16(v); }

// The act of N values side by side (their exp chains overlap: exp_lanes).
template <int ACT, int N>
inline void activation_lanes(const float* x, float* act) {
    float arg[N], e[N];
    if (ACT == 0) {
        for (int l = 0; l < N; ++l) arg[l] = 0.f - x[l];
        exp_lanes<N>(arg, e);
        for (int l = 0; l < N; ++l) act[l] = x[l] / (1.f + e[l]);
        return;
    }
    for (int l = 0; l < N; ++l) {
        const float y = 0.7978845608028654f * fma_f32(0.044715f * x[l], x[l] * x[l], x[l]);
        arg[l] = y + y;
    }
    exp_lanes<N>(arg, e);
    for (int l = 0; l < N; ++l) {
        const float tanh = 1.f - 2.f / (e[l] + 1.f);
        act[l] = 0.5f * x[l] * (1.f + tanh);
    }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 round16(__m512 v, float*) { return v; }
inline __m512 round16(__m512 v, uint16_t*) {  // to bf16 and back, nearest even; NaN made quiet, as f32_to_bf16
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round16(v, p)), 16)));
}

template <int ACT>
inline __m512 activation16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.f);
    if (ACT == 0) return _mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    const __m512 c = _mm512_set1_ps(0.7978845608028654f), cubic = _mm512_set1_ps(0.044715f);
    const __m512 y = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(cubic, x), _mm512_mul_ps(x, x), x));
    const __m512 e = exp512(_mm512_add_ps(y, y));
    const __m512 tanh = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, tanh));
}

template <typename T, int ACT>
inline int64_t act_mul_vector(const T* gate, const T* up, T* out, int64_t n) {
    T* tag = nullptr;  // picks the rounding overloads
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        store16(out + i, _mm512_mul_ps(round16(activation16<ACT>(load16(gate + i)), tag), load16(up + i)));
    return i;
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 round8(__m256 v, float*) { return v; }
inline __m256 round8(__m256 v, uint16_t*) {  // as round16
    const __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet),
                                             _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u))));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(round8(v, p)), 16);  // each in [0, 65535]
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

template <int ACT>
inline __m256 activation8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.f);
    if (ACT == 0) return _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    const __m256 c = _mm256_set1_ps(0.7978845608028654f), cubic = _mm256_set1_ps(0.044715f);
    const __m256 y = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(cubic, x), _mm256_mul_ps(x, x), x));
    const __m256 e = exp256(_mm256_add_ps(y, y));
    const __m256 tanh = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, tanh));
}

template <typename T, int ACT>
inline int64_t act_mul_vector(const T* gate, const T* up, T* out, int64_t n) {
    T* tag = nullptr;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {  // two vectors per step: their exp chains overlap
        const __m256 a0 = round8(activation8<ACT>(load8(gate + i)), tag);
        const __m256 a1 = round8(activation8<ACT>(load8(gate + i + 8)), tag);
        store8(out + i, _mm256_mul_ps(a0, load8(up + i)));
        store8(out + i + 8, _mm256_mul_ps(a1, load8(up + i + 8)));
    }
    for (; i + 8 <= n; i += 8)
        store8(out + i, _mm256_mul_ps(round8(activation8<ACT>(load8(gate + i)), tag), load8(up + i)));
    return i;
}
#else
template <typename T, int ACT>
inline int64_t act_mul_vector(const T*, const T*, T*, int64_t) { return 0; }
#endif

template <typename T, int ACT>
void act_mul_row(const T* gate, const T* up, T* out, int64_t n) {
    T* tag = nullptr;
    int64_t i = act_mul_vector<T, ACT>(gate, up, out, n);
    for (; i < n; i += 8) {  // the rest (all of it in plain C++): the same arithmetic, 8 (or fewer) at a time
        const int m = n - i < 8 ? int(n - i) : 8;
        float g[8], a[8];
        for (int l = 0; l < m; ++l) g[l] = load1(gate + i + l);
        if (m == 8)
            activation_lanes<ACT, 8>(g, a);
        else
            for (int l = 0; l < m; ++l) activation_lanes<ACT, 1>(g + l, a + l);
        for (int l = 0; l < m; ++l) store1(out + i + l, round1(a[l], tag) * load1(up + i + l));
    }
}

}  // namespace
