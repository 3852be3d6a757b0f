// Activations quantized to int8 per row and 32-column group (llama.cpp's Q8_0 idea), shared by the int8-activation
// kernels: quant_gemv_q8.cpp (pagellm's int4 layout) and quant_gguf.cpp (GGUF block formats). One arithmetic at
// every level, bit-identical:
//   d[m, g] = max_k |x| / 127                   (fp32; 0 for an all-zero group)
//   a[m, k] = round_half_even(x / d), clamped to -127..127   (fp32 division, int8)
// x is taken in fp32 (bf16 inputs are exact in it). NaN in a group makes d NaN, so it reaches the outputs.
//
// Rows are taken in passes of up to kMaxRowsQ8 (as many as the level's registers hold accumulators for), of
// near-equal size (13 rows as 7 + 6, not 12 + 1: a lone row runs at a fraction of the rate). Each pass's rows
// are stored as one panel, rows fastest, so a kernel streams its quads, d and sums from one pointer at
// compile-time offsets.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "int4_common.h"
#include "thread_scratch.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define PAGELLM_Q8_AVX512 1
constexpr int kMaxRowsQ8 = 12;  // 12 int32 + 12 fp32 accumulators of 32 registers
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGELLM_Q8_AVX2 1
// 10 rows: their integer accumulators and fp32 totals outnumber the 16 ymm registers, but the totals, touched
// once per group, spill cheaply, and each decoded chunk of weights serves more rows (6, 8, 10, 12 measured:
// docs/benchmarks/2026-11-24-avx2-level-against-llama-cpp.md)
constexpr int kMaxRowsQ8 = 10;
#else
constexpr int kMaxRowsQ8 = 4;
#endif

// Pass p covers rows [first_row(p), first_row(p + 1)).
inline int64_t row_passes(int64_t M) { return (M + kMaxRowsQ8 - 1) / kMaxRowsQ8; }
inline int64_t first_row(int64_t p, int64_t M) { return p * M / row_passes(M); }
inline int64_t pass_of(int64_t m, int64_t M) { return ((m + 1) * row_passes(M) - 1) / M; }

struct QuantizedActivations {
    int32_t* q;         // panel p at first_row(p) * K/4: [K/4, rows] a[m, 4t..4t+3] as 4 bytes
    float* scale;       // panel p at first_row(p) * G: [G, rows] d
    float* scaled_sum;  // as scale: d * sum_k a
    int32_t* half_sum;  // panel p at first_row(p) * G * 2: [G, rows, 2] sum_k a over columns 0-15, 16-31
};

// The calling thread's buffers, grown to M x K: no allocation per call once warm. kSlot: another set, for a call
// that holds two (the fused MLP: its input's and its hidden rows').
template <int kSlot, int kPart>
struct ActivationPart {};  // thread_scratch's tag of one slot's part

template <int kSlot = 0>
inline QuantizedActivations activation_buffers(int64_t M, int64_t K) {
    std::vector<int32_t>& q = thread_scratch::scratch<ActivationPart<kSlot, 0>, int32_t>();
    std::vector<float>& scale = thread_scratch::scratch<ActivationPart<kSlot, 1>, float>();
    std::vector<float>& scaled_sum = thread_scratch::scratch<ActivationPart<kSlot, 2>, float>();
    std::vector<int32_t>& half_sum = thread_scratch::scratch<ActivationPart<kSlot, 3>, int32_t>();
    q.resize(M * K / 4);
    scale.resize(M * (K / kGroup));
    scaled_sum.resize(M * (K / kGroup));
    half_sum.resize(2 * M * (K / kGroup));
    return {q.data(), scale.data(), scaled_sum.data(), half_sum.data()};
}

// Where one group's results go: quads at q[0], q[stride], ...; d, d * sum at *scale, *scaled_sum; half sums at
// half_sum[0..1].
struct GroupSlot {
    int32_t* q;
    int64_t stride;
    float* scale;
    float* scaled_sum;
    int32_t* half_sum;
};

// The rounding of one x / d to an int8 code as cvtps2dq does it (nearest even; NaN and overflow give INT_MIN),
// then clamped: the plain-C++ twin of the vector quantizers.
inline int32_t code_of(float v) {
    const int32_t i = (v != v || std::fabs(v) >= 2147483648.f) ? INT32_MIN : int32_t(std::nearbyint(v));
    return std::max(-127, std::min(127, i));
}

// d = max |x| / 127 of a group with that maximum's bits: integer order puts NaN above inf, so NaN reaches d.
inline float group_scale(uint32_t max_bits) {
    float amax;
    std::memcpy(&amax, &max_bits, 4);
    return amax / 127.f;
}

// The group's 32 codes -> its slot.
inline void store_codes(const int32_t* codes, float d, const GroupSlot& s) {
    for (int t = 0; t < 8; ++t) {
        uint32_t quad = 0;
        for (int b = 0; b < 4; ++b) quad |= uint32_t(uint8_t(int8_t(codes[4 * t + b]))) << (8 * b);
        s.q[t * s.stride] = int32_t(quad);
    }
    int32_t lo = 0, hi = 0;
    for (int k = 0; k < 16; ++k) lo += codes[k], hi += codes[16 + k];
    *s.scale = d;
    *s.scaled_sum = d * float(lo + hi);
    s.half_sum[0] = lo, s.half_sum[1] = hi;
}

inline void zero_group(const GroupSlot& s) {
    for (int t = 0; t < 8; ++t) s.q[t * s.stride] = 0;  // all zeros (or below 127 denormals): x / d would be NaN
    *s.scale = *s.scaled_sum = 0.f;
    s.half_sum[0] = s.half_sum[1] = 0;
}

#if PAGELLM_Q8_AVX512
// int4 layout chunk t (32 bytes: 16 rows x 2 bytes; quant_gemv.cpp) -> per row lane the bytes q(4t), q(4t + 1), q(4t + 2), q(4t + 3).
inline __m512i unpack_chunk(const uint8_t* c) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)c));
    // (v | v << 12) & 0x0F0F0F0F in one vpternlogd: v's upper half is zero and v << 12 has nothing in bytes 0-1's
    // low nibbles, so the two never collide under the mask
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
}

inline __m512 load16(const void* x, int64_t i, int x_bf16) {
    return x_bf16 ? bf16x16(static_cast<const uint16_t*>(x) + i) : _mm512_loadu_ps(static_cast<const float*>(x) + i);
}

void quantize_group_from(const void* x, int x_bf16, int64_t at, const GroupSlot& s) {
    const __m512 lo = load16(x, at, x_bf16), hi = load16(x, at + 16, x_bf16);
    // max |x| compared as integers: the same order as floats for non-NaN values, and NaN above inf, so NaN
    // reaches d (vmaxps would drop it)
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    const __m512i abs_lo = _mm512_and_si512(_mm512_castps_si512(lo), magnitude);
    const __m512i abs_hi = _mm512_and_si512(_mm512_castps_si512(hi), magnitude);
    const float d = group_scale(_mm512_reduce_max_epu32(_mm512_max_epu32(abs_lo, abs_hi)));
    if (d == 0.f) return zero_group(s);
    const __m512 vd = _mm512_set1_ps(d);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    // cvtps rounds half to even (the default MXCSR); the clamp only matters for a d rounded below amax / 127
    const __m512i a = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_div_ps(lo, vd)), top), bottom);
    const __m512i b = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_div_ps(hi, vd)), top), bottom);
    alignas(16) int32_t quads[8];
    _mm_store_si128((__m128i*)quads, _mm512_cvtepi32_epi8(a));
    _mm_store_si128((__m128i*)(quads + 4), _mm512_cvtepi32_epi8(b));
    for (int t = 0; t < 8; ++t) s.q[t * s.stride] = quads[t];
    const int32_t sum_lo = _mm512_reduce_add_epi32(a), sum_hi = _mm512_reduce_add_epi32(b);
    *s.scale = d;
    *s.scaled_sum = d * float(sum_lo + sum_hi);
    s.half_sum[0] = sum_lo, s.half_sum[1] = sum_hi;
}

#elif PAGELLM_Q8_AVX2
inline __m256 load8(const void* x, int64_t i, int x_bf16) {
    if (!x_bf16) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
    const __m128i h = _mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(x) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The AVX-512 quantizer 8 lanes at a time: the same division and rounding per value.
void quantize_group_from(const void* x, int x_bf16, int64_t at, const GroupSlot& s) {
    __m256 v[4];
    __m256i top = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
        v[i] = load8(x, at + 8 * i, x_bf16);
        top = _mm256_max_epu32(top, _mm256_and_si256(_mm256_castps_si256(v[i]), _mm256_set1_epi32(0x7fffffff)));
    }
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256((__m256i*)lanes, top);
    const float d = group_scale(*std::max_element(lanes, lanes + 8));
    if (d == 0.f) return zero_group(s);
    const __m256 vd = _mm256_set1_ps(d);
    alignas(32) int32_t codes[32];
    for (int i = 0; i < 4; ++i) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_div_ps(v[i], vd));
        _mm256_store_si256((__m256i*)(codes + 8 * i), _mm256_max_epi32(_mm256_min_epi32(a, _mm256_set1_epi32(127)),
                                                                        _mm256_set1_epi32(-127)));
    }
    store_codes(codes, d, s);
}

#else
void quantize_group_from(const void* x, int x_bf16, int64_t at, const GroupSlot& s) {
    uint32_t top = 0;
    for (int k = 0; k < 32; ++k) {
        const float v = load_value(x, at + k, x_bf16);
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        top = std::max(top, bits & 0x7fffffffu);
    }
    const float d = group_scale(top);
    if (d == 0.f) return zero_group(s);
    int32_t codes[32];
    for (int k = 0; k < 32; ++k) codes[k] = code_of(load_value(x, at + k, x_bf16) / d);
    store_codes(codes, d, s);
}
#endif

// Where group g of row m (of M rows, G groups each) goes in its pass's panels of a.
inline GroupSlot group_slot(int64_t m, int64_t g, int64_t M, int64_t G, const QuantizedActivations& a) {
    const int64_t p = pass_of(m, M), m0 = first_row(p, M);
    const int64_t rows = first_row(p + 1, M) - m0, r = m - m0;
    const int64_t at = m0 * G + g * rows + r;  // in scale and scaled_sum; q has 8 quads a group, half_sum 2
    return {a.q + 8 * (m0 * G + g * rows) + r, rows, a.scale + at, a.scaled_sum + at, a.half_sum + 2 * at};
}

// Group j = m * G + g of x [M, K] into its pass's panels of a.
inline void quantize_group_at(const void* x, int x_bf16, int64_t j, int64_t M, int64_t G,
                              const QuantizedActivations& a) {
    quantize_group_from(x, x_bf16, j * kGroup, group_slot(j / G, j % G, M, G, a));
}

// Every group of x [M, K], by the calling threads: inside a parallel region (its loop's barrier ends with all rows
// quantized), or alone before one.
inline void quantize_rows(const void* x, int x_bf16, int64_t M, int64_t K, const QuantizedActivations& a,
                          bool in_parallel) {
    const int64_t G = K / kGroup;
    if (!in_parallel) {
        for (int64_t j = 0; j < M * G; ++j) quantize_group_at(x, x_bf16, j, M, G, a);
        return;
    }
#pragma omp for schedule(static)
    for (int64_t j = 0; j < M * G; ++j) quantize_group_at(x, x_bf16, j, M, G, a);
}

// Every thread reads all rows, so quantizing in parallel costs a barrier, and a barrier (like the fork/join)
// costs a whole scheduler time slice when another process holds a core. So the quantization runs before the
// fork unless there is enough of it to share.
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
inline bool share_quantization(int64_t M, int64_t K) { return M * K >= (64 << 10); }

// The shared frame of an int8-activation matmul over 16-row weight blocks: x quantized, then each thread runs
// blocks(first, last, a) on a contiguous share of the N / 16 blocks (as schedule(static)).
template <class Blocks>
void q8_matmul(const void* x, int x_bf16, int64_t M, int64_t K, int64_t N, Blocks&& blocks) {
    const QuantizedActivations a = activation_buffers(M, K);  // pointers: shared by the threads below
    const bool shared = share_quantization(M, K);
    if (!shared) quantize_rows(x, x_bf16, M, K, a, false);
#pragma omp parallel if (worth_threads(N * K / 2))
    {
        if (shared) quantize_rows(x, x_bf16, M, K, a, true);  // its barrier: all rows ready before any block
        const int64_t count = N / kBlock, t = omp_get_thread_num(), threads = omp_get_num_threads();
        blocks(count * t / threads, count * (t + 1) / threads, a);
    }
}

}  // namespace
