// The last two steps of a decode step on the [rows, V] logits, fused for CPU.
//
// Why: with Gemma 3's vocabulary and a batch of rows, the torch chain is three passes of
// soft-capping in bf16 (div, tanh, mul), a .float() into a fresh [rows, V] tensor (page
// faults) and an argmax, each costly. Here soft-capping and the conversion are one pass
// into a buffer the caller may reuse, and argmax is one pass that also splits a row across
// threads when there are fewer rows than threads.
// measured (this and the figures below): docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
//
//   pagellm_logits_to_f32: out = float(logits), soft-capped when cap > 0 with the roundings
//                          of torch's `tanh(x / cap) * cap` in the input dtype (bf16: each op
//                          in fp32, rounded to bf16; bit-identical to torch). A bf16 logit has
//                          only 65536 possible values, so a large input is capped through a
//                          table of all of them: one gather per 16 logits instead of ~40 vector
//                          ops of tanh (faster, the table's cost included; measured above).
//   pagellm_argmax_rows:   per-row argmax as torch's CPU argmax: first index on ties, NaN is
//                          maximal (the first NaN wins).
//   pagellm_mask_rows:     logits of tokens whose bit is 0 in a row's packed bitmask (a grammar's
//                          allowed tokens) set to -inf, in place, for the rows listed. Why: the torch
//                          form unpacks 32 bits per word into a [rows, V] tensor first; xgrammar's CPU
//                          form was slow on a vocab-sized row (measured above). A word of all ones
//                          (inside a JSON string, most of the vocabulary) or of all zeros is one test
//                          and one fill.
//
// Levels: AVX-512 (16 lanes), AVX2 + FMA (8 lanes) and plain C++ compute one formula with the same
// roundings (tanh and exp built alike, fma where the vector code fuses), so every build gives the
// same bits: soft-capping at all levels equals the AVX-512 build's bit for bit, and argmax is exact.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16.h"
#include "exp512.h"  // exp512 / exp256 / exp_scalar, bit-identical (and <immintrin.h> where there are vectors)
#include "fma_f32.h"

namespace {

// Elements per OpenMP work item: big enough that scheduling is noise, small enough to balance.
constexpr int64_t kBlock = 1 << 14;
// Below this many elements a fork costs more than the work.
constexpr int64_t kParallelMin = 1 << 15;

inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// The tanh of every level (tanh512 below is the reference), one lane: within ~1.5 ulp, an odd
// polynomial below |x| = 0.55 (where 1 - 2/(e+1) loses bits to cancellation), 1 - 2 / (e^2|x| + 1)
// above. The coefficients are a Chebyshev-node fit of (tanh(x) - x) / x^3 in x^2 on [0, 0.55^2]
// (approximation error < 0.07 ulp). After bf16 rounding this equals torch's bf16 tanh on every bf16
// input (tests/kernels/test_logits_kernels.py).
constexpr float kTanhSmall = 0.55f;
constexpr float kT0 = -0.00661022774875164f, kT1 = 0.021309388801455498f, kT2 = -0.05390942841768265f,
                kT3 = 0.13333113491535187f, kT4 = -0.3333333134651184f;

// tanh of N values side by side (as exp_lanes; N = 1: tanh_scalar). The exp runs only if some lane needs
// it, the polynomial only if some lane is small; each lane then takes its branch, as the vector blend does.
template <int N>
inline void tanh_lanes(const float* x, float* out) {
    float ax[N], arg[N], e[N] = {}, small[N] = {};
    bool any_large = false, any_small = false;
    for (int l = 0; l < N; ++l) {
        ax[l] = std::fabs(x[l]);
        arg[l] = ax[l] + ax[l];
        any_small |= ax[l] < kTanhSmall;
        any_large |= !(ax[l] < kTanhSmall);
    }
    if (any_large) exp_lanes<N>(arg, e);  // inf past |x| = 44.5, giving exactly 1
    if (any_small)
        for (int l = 0; l < N; ++l) {
            const float s = ax[l] * ax[l];
            float p = kT0;
            p = fma_f32(p, s, kT1);
            p = fma_f32(p, s, kT2);
            p = fma_f32(p, s, kT3);
            p = fma_f32(p, s, kT4);
            small[l] = fma_f32(ax[l] * s, p, ax[l]);
        }
    for (int l = 0; l < N; ++l) {
        float t = ax[l] < kTanhSmall ? small[l] : 1.f - 2.f / (e[l] + 1.f);
        uint32_t tb, xb;  // odd: |x|'s result, x's sign
        std::memcpy(&tb, &t, 4);
        std::memcpy(&xb, &x[l], 4);
        tb |= xb & 0x80000000u;
        std::memcpy(&t, &tb, 4);
        out[l] = std::isnan(x[l]) ? x[l] : t;  // NaN in, NaN out
    }
}

inline float tanh_scalar(float x) {
    float t;
    tanh_lanes<1>(&x, &t);
    return t;
}

// In bf16 each of torch's ops (div, tanh, mul) is computed in fp32 and rounded to bf16.
template <int IN_BF16>
inline float softcap1(float x, float cap) {
    if (!IN_BF16) return tanh_scalar(x / cap) * cap;
    return round_bf16(round_bf16(tanh_scalar(round_bf16(x / cap))) * cap);
}

template <int IN_BF16>
inline float load1(const void* in, int64_t i) {
    return IN_BF16 ? bf16_to_f32(static_cast<const uint16_t*>(in)[i]) : static_cast<const float*>(in)[i];
}

#ifdef __AVX512F__

// fp32 -> nearest-even bf16, kept as fp32 (low half zero). Integer rounding rather than
// vcvtneps2bf16, which flushes denormals where torch keeps them.
inline __m512 round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));  // NaN stays NaN, made quiet
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u))));
}

// tanh_scalar over 16 lanes.
inline __m512 tanh512(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 ax = _mm512_abs_ps(x);
    const __m512 e = exp512(_mm512_add_ps(ax, ax));  // inf past |x| = 44.5, giving exactly 1
    const __m512 large = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
    const __m512 s = _mm512_mul_ps(ax, ax);
    __m512 p = _mm512_set1_ps(kT0);
    p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(kT1));
    p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(kT2));
    p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(kT3));
    p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(kT4));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(ax, s), p, ax);
    __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(kTanhSmall), _CMP_LT_OQ), large, small);
    t = _mm512_or_ps(t, _mm512_and_ps(x, _mm512_set1_ps(-0.f)));  // odd: |x|'s result, x's sign
    return _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);  // NaN in, NaN out
}

template <int IN_BF16>
inline __m512 load16(const void* in, int64_t i, __mmask16 m) {
    if (!IN_BF16) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(in) + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(in) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16 = high half
}

template <int IN_BF16>
inline __m512 softcap16(__m512 x, __m512 cap) {
    if (!IN_BF16) return _mm512_mul_ps(tanh512(_mm512_div_ps(x, cap)), cap);
    const __m512 t = round_bf16(tanh512(round_bf16(_mm512_div_ps(x, cap))));
    return round_bf16(_mm512_mul_ps(t, cap));
}

template <int IN_BF16, int CAPPED>
void convert_span(const void* in, float* out, int64_t begin, int64_t end, float cap) {
    const __m512 capv = _mm512_set1_ps(cap);
    for (int64_t i = begin; i < end; i += 16) {
        const __mmask16 m = end - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (end - i)) - 1);
        const __m512 x = load16<IN_BF16>(in, i, m);
        _mm512_mask_storeu_ps(out + i, m, CAPPED ? softcap16<IN_BF16>(x, capv) : x);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)

inline __m256 round_bf16(__m256 v) {  // as the 16-lane one
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    const __m256 quiet = _mm256_castsi256_ps(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)));
    const __m256 kept = _mm256_blendv_ps(_mm256_castsi256_ps(r), quiet, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_and_ps(kept, _mm256_castsi256_ps(_mm256_set1_epi32(int(0xffff0000u))));
}

inline __m256 tanh256(__m256 x) {  // tanh_scalar over 8 lanes
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 e = exp256(_mm256_add_ps(ax, ax));
    const __m256 large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
    const __m256 s = _mm256_mul_ps(ax, ax);
    __m256 p = _mm256_set1_ps(kT0);
    p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(kT1));
    p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(kT2));
    p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(kT3));
    p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(kT4));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(ax, s), p, ax);
    __m256 t = _mm256_blendv_ps(large, small, _mm256_cmp_ps(ax, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ));
    t = _mm256_or_ps(t, _mm256_and_ps(x, sign));
    return _mm256_blendv_ps(t, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

template <int IN_BF16>
inline __m256 load8(const void* in, int64_t i) {
    if (!IN_BF16) return _mm256_loadu_ps(static_cast<const float*>(in) + i);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(in) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int IN_BF16>
inline __m256 softcap8(__m256 x, __m256 cap) {
    if (!IN_BF16) return _mm256_mul_ps(tanh256(_mm256_div_ps(x, cap)), cap);
    const __m256 t = round_bf16(tanh256(round_bf16(_mm256_div_ps(x, cap))));
    return round_bf16(_mm256_mul_ps(t, cap));
}

template <int IN_BF16, int CAPPED>
void convert_span(const void* in, float* out, int64_t begin, int64_t end, float cap) {
    const __m256 capv = _mm256_set1_ps(cap);
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {  // two vectors a step: their exp / div chains overlap
        const __m256 a = load8<IN_BF16>(in, i), b = load8<IN_BF16>(in, i + 8);
        _mm256_storeu_ps(out + i, CAPPED ? softcap8<IN_BF16>(a, capv) : a);
        _mm256_storeu_ps(out + i + 8, CAPPED ? softcap8<IN_BF16>(b, capv) : b);
    }
    for (; i < end; ++i) out[i] = CAPPED ? softcap1<IN_BF16>(load1<IN_BF16>(in, i), cap) : load1<IN_BF16>(in, i);
}

#else  // no vectors: the same arithmetic, 8 values side by side

template <int IN_BF16, int CAPPED>
void convert_span(const void* in, float* out, int64_t begin, int64_t end, float cap) {
    int64_t i = begin;
    for (; CAPPED && i + 8 <= end; i += 8) {
        float arg[8], t[8];
        for (int l = 0; l < 8; ++l) {
            const float q = load1<IN_BF16>(in, i + l) / cap;
            arg[l] = IN_BF16 ? round_bf16(q) : q;
        }
        tanh_lanes<8>(arg, t);
        for (int l = 0; l < 8; ++l) out[i + l] = IN_BF16 ? round_bf16(round_bf16(t[l]) * cap) : t[l] * cap;
    }
    for (; i < end; ++i) out[i] = CAPPED ? softcap1<IN_BF16>(load1<IN_BF16>(in, i), cap) : load1<IN_BF16>(in, i);
}

#endif  // __AVX512F__

template <int IN_BF16, int CAPPED>
void convert(const void* in, float* out, int64_t n, float cap) {
    const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t b = 0; b < blocks; ++b)
        convert_span<IN_BF16, CAPPED>(in, out, b * kBlock, std::min(n, (b + 1) * kBlock), cap);
}

// ---- bf16 soft-capping by table ------------------------------------------------------------

constexpr int64_t kBf16Values = 65536;
// From here on the table (65536 soft-caps) is cheaper than computing every logit.
constexpr int64_t kTableMin = 2 * kBf16Values;

// The bf16 bit patterns 0..65535 as one input, so the table is computed by the same code
// (and so with the same roundings) as the direct path.
std::vector<float> softcap_table(float cap) {
    std::vector<uint16_t> every(kBf16Values);
    for (int64_t h = 0; h < kBf16Values; ++h) every[h] = uint16_t(h);
    std::vector<float> table(kBf16Values);
    convert<1, 1>(every.data(), table.data(), kBf16Values, cap);
    return table;
}

void lookup_span(const uint16_t* in, const float* table, float* out, int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef __AVX512F__
    for (; i + 16 <= end; i += 16) {
        const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
        _mm512_storeu_ps(out + i, _mm512_i32gather_ps(h, table, 4));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= end; i += 8) {
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
        _mm256_storeu_ps(out + i, _mm256_i32gather_ps(table, h, 4));
    }
#endif
    for (; i < end; ++i) out[i] = table[in[i]];
}

void softcap_bf16_by_table(const uint16_t* in, float* out, int64_t n, float cap) {
    const std::vector<float> table = softcap_table(cap);
    const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) lookup_span(in, table.data(), out, b * kBlock, std::min(n, (b + 1) * kBlock));
}

#include "logits_argmax.h"  // Best, scan: the row scans at each level

inline int64_t index_of(const Best& b) { return b.first_nan >= 0 ? b.first_nan : b.index; }

// A row is split into parts only when whole rows cannot keep every thread busy (decode with
// B = 1 or an odd B); a part is never shorter than this.
constexpr int64_t kMinPart = 1 << 15;

int64_t parts_per_row(int64_t rows, int64_t V, int threads) {
    if (rows * V < kParallelMin || rows >= 4 * threads || rows % threads == 0) return 1;
    return std::max<int64_t>(1, std::min<int64_t>(threads, V / kMinPart));
}

void argmax_split(const float* x, int64_t rows, int64_t V, int64_t parts, int64_t* out) {
    std::vector<Best> partial(rows * parts);
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < rows * parts; ++item) {
        const int64_t r = item / parts, p = item % parts;
        const int64_t lo = V * p / parts, hi = V * (p + 1) / parts;
        partial[item] = scan(x + r * V + lo, hi - lo, lo);
    }
    for (int64_t r = 0; r < rows; ++r) {
        Best best = partial[r * parts];
        for (int64_t p = 1; p < parts; ++p) best = combine(best, partial[r * parts + p]);
        out[r] = index_of(best);
    }
}

}  // namespace

extern "C" void pagellm_logits_to_f32(const void* logits, int in_bf16, int64_t rows, int64_t V, float cap,
                                      float* out) {
    const int64_t n = rows * V;
    if (in_bf16 && cap > 0 && n >= kTableMin) softcap_bf16_by_table(static_cast<const uint16_t*>(logits), out, n, cap);
    else if (in_bf16 && cap > 0) convert<1, 1>(logits, out, n, cap);
    else if (in_bf16) convert<1, 0>(logits, out, n, cap);
    else if (cap > 0) convert<0, 1>(logits, out, n, cap);
    else convert<0, 0>(logits, out, n, cap);
}

extern "C" void pagellm_argmax_rows(const float* x, int64_t rows, int64_t V, int64_t* out) {
    if (rows <= 0 || V <= 0) return;
    const int64_t parts = parts_per_row(rows, V, omp_get_max_threads());
    if (parts > 1) return argmax_split(x, rows, V, parts, out);
#pragma omp parallel for schedule(static) if (rows * V >= kParallelMin && rows > 1)
    for (int64_t r = 0; r < rows; ++r) out[r] = index_of(scan(x + r * V, V, 0));
}

extern "C" void pagellm_mask_rows(float* logits, int64_t V, const int32_t* bitmask, int64_t words,
                                  const int64_t* rows, int64_t count) {
    const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static) if (count > 1)
    for (int64_t j = 0; j < count; ++j) {
        float* row = logits + rows[j] * V;
        const int32_t* mask = bitmask + j * words;
        for (int64_t w = 0; w < words; ++w) {
            const uint32_t bits = static_cast<uint32_t>(mask[w]);
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t start = w * 32, n = std::min<int64_t>(32, V - start);
            if (n <= 0) break;
            float* x = row + start;
            if (bits == 0) {
                for (int64_t b = 0; b < n; ++b) x[b] = ninf;
                continue;
            }
            for (int64_t b = 0; b < n; ++b)
                if (!((bits >> b) & 1u)) x[b] = ninf;
        }
    }
}

// For tests: out[i] = e^x[i] by one of the shared exp's forms (exp512.h): which = 16: exp512, 8: exp256,
// 1: exp_scalar, 0: exp_lanes<8> (plain C++, 8 side by side). Returns 1 (nothing done) when this build
// has no such form.
extern "C" int pagellm_exp_f32(const float* x, int64_t n, int which, float* out) {
    const int width = which == 16 ? 16 : which == 1 ? 1 : 8;
    if (which != 16 && which != 8 && which != 1 && which != 0) return 1;
#ifndef __AVX512F__
    if (which == 16) return 1;
#endif
#if !(defined(__AVX2__) && defined(__FMA__))
    if (which == 8) return 1;
#endif
    for (int64_t i = 0; i < n; i += width) {
        const int64_t m = std::min<int64_t>(width, n - i);
        float in[16] = {}, y[16];
        std::copy(x + i, x + i + m, in);
        if (which == 1) y[0] = exp_scalar(in[0]);
        else if (which == 0) exp_lanes<8>(in, y);
#if defined(__AVX2__) && defined(__FMA__)
        else if (which == 8) _mm256_storeu_ps(y, exp256(_mm256_loadu_ps(in)));
#endif
#ifdef __AVX512F__
        else _mm512_storeu_ps(y, exp512(_mm512_loadu_ps(in)));
#endif
        std::copy(y, y + m, out + i);
    }
    return 0;
}

// For tests: out[i] = a[i] * b[i] + c[i] rounded once (fma_f32.h: an instruction, or emulated without one).
extern "C" void pagellm_fma_f32(const float* a, const float* b, const float* c, int64_t n, float* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = fma_f32(a[i], b[i], c[i]);
}
