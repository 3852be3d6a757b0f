// The inner loops of quant_gguf.cpp: one 16-row weight block against up to kMaxRowsQ8 activation rows, in
// each level's instructions (quant_gguf.cpp includes this header; one build per level).
//
// Per row lane and group: isum = sum_k q a (exact in int32), then in fp32
//   total += (isum - zero * sum_k a) * (scale * d)            (the zero point in integers: exact; the sums
//                                                             start from -zero * sum_k a, one broadcast a row)
//   total += min * (d * sum_k a)                               (formats with a min)
// with Q6_K's two 16-column halves each taking their own scale and half sum. Three builds of this arithmetic,
// bit-identical (integer sums are exact; every fp32 step is the same operation in the same order):
//   avx512   vpdpbusd on 16 rows at once; Q8_0's signed codes shifted to unsigned (xor 0x80), the shift taken
//            back with the zero point (128 * sum a)
//   avx2     vpmaddubsw + vpmaddwd on 8 rows at once (chunks add in int16 as far as they cannot overflow it:
//            8 of 4-bit codes, as quant_gemv_q8.cpp, 4 of 5-bit, 2 of 6-bit; Q8_0 by llama.cpp's sign trick,
//            |q| x sign(a, q), at most 128 x 127 x 2, widens every chunk). With AVX-VNNI: vpdpbusd as avx512
//   generic  plain C++ loops
#pragma once

#include <algorithm>
#include <cstdint>

#include "fma_f32.h"
#include "gguf_format.h"
#include "int4_common.h"
#include "q8_activations.h"

namespace {

// One pass's activation panels (q8_activations.h), at the pass's first row.
struct Panel {
    const int32_t* q;     // [K/4, MR] quads
    const float* d;       // [G, MR]
    const float* dsum;    // [G, MR] d * sum a
    const int32_t* zero_start;  // [G, MR, 2] -zero * sum of a over the columns scale h covers (zero_starts)
};

// The integer zero point a level subtracts: the format's, plus 128 where Q8_0's codes were shifted.
template <class F, bool kShifted>
constexpr int32_t zero_point() { return F::kZero + (F::kBits == 8 && kShifted ? 128 : 0); }

// Sum of a over the columns a group's scale h covers (both halves for one-scale formats).
template <class F>
inline int32_t covered_sum(const int32_t* half, int h) { return F::kHalves == 2 ? half[h] : half[0] + half[1]; }

#if !PAGELLM_Q8_AVX512 && !PAGELLM_Q8_AVX2
constexpr bool kShiftedQ8 = false;
#endif

#if PAGELLM_Q8_AVX512 || PAGELLM_Q8_AVX2
// A group's codes kPrefetch bytes ahead, into L2 rather than L1: T0 that far ahead evicted what the loop reuses
// from L1 and measured slower from DRAM (the MLP of a B=1 decode step, an LM head) than T1 at the distance.
// measured: docs/benchmarks/2026-11-27-weight-prefetch.md
template <class F>
inline void prefetch_group(const uint8_t* q) {
    for (int64_t l = 0; l < F::kGroupBytes; l += 64) _mm_prefetch((const char*)q + kPrefetch + l, _MM_HINT_T1);
}
#endif

#if PAGELLM_Q8_AVX512
constexpr bool kShiftedQ8 = true;

// ((plane >> t) & 0x01010101) << bit or-ed into v: the code bit `bit` of chunk t's 4 codes per row lane.
template <int Bit>
inline __m512i with_plane(__m512i v, __m512i plane, int t) {
    const __m512i moved = _mm512_slli_epi32(_mm512_srli_epi32(plane, t), Bit);
    return _mm512_ternarylogic_epi32(v, moved, _mm512_set1_epi32(0x01010101 << Bit), 0xF8);  // v | (moved & mask)
}

// Chunk 4j + c's two high bits from quad j (bits 2c, 2c + 1 of each byte) to bits 4 and 5, or-ed into v.
inline __m512i with_high_bits(__m512i v, __m512i quad, int c) {
    const __m512i moved = c == 2 ? quad : c == 3 ? _mm512_srli_epi32(quad, 2) : _mm512_slli_epi32(quad, 4 - 2 * c);
    return _mm512_ternarylogic_epi32(v, moved, _mm512_set1_epi32(0x30303030), 0xF8);  // v | (moved & mask)
}

// Chunk t of a group: per row lane the codes 4t..4t+3 as unsigned bytes.
template <class F>
inline __m512i chunk_codes(const uint8_t* q, int t) {
    if constexpr (F::kBits == 8)
        return _mm512_xor_si512(_mm512_loadu_si512(q + 64 * t), _mm512_set1_epi8(char(0x80)));
    __m512i v = unpack_chunk(q + 32 * t);
    if constexpr (F::kHighQuads) return with_high_bits(v, _mm512_loadu_si512(q + 256 + 64 * (t >> 2)), t & 3);
    if constexpr (F::kBits >= 5) v = with_plane<4>(v, _mm512_loadu_si512(q + 256), t);
    return v;
}

struct VectorScales {
    __m512 scale[2];
    __m512 min;
};

template <class F>
inline VectorScales group_scales(const uint8_t* gp, const uint8_t* sp) {
    VectorScales s;
    if constexpr (F::kScales == Scales::kF16 || F::kScales == Scales::kF16Min) {
        s.scale[0] = s.scale[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)gp));
        if constexpr (F::kMin) s.min = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(gp + 32)));
    } else if constexpr (F::kScales == Scales::kSuper) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sp));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 32)));
        s.scale[0] = s.scale[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)gp))));
        const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(gp + 16))));
        s.min = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, m));
    } else {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sp));
        for (int h = 0; h < 2; ++h)
            s.scale[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(gp + 16 * h)))));
    }
    return s;
}

// out[r] (the block's 16 rows) for the MR activation rows of one pass. SPLIT partial sums per row hide the
// vpdpbusd latency when few rows give few independent chains (exact: integers).
template <class F, int MR, int SPLIT>
void gguf_block(const uint8_t* qs, const uint8_t* gp, const uint8_t* sp, const Panel& a, int64_t K, float (*out)[16]) {
    constexpr int kChunks = 8 / F::kHalves;
    constexpr int32_t kZero = zero_point<F, kShiftedQ8>();
    __m512 total[MR];
    for (int r = 0; r < MR; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / kGroup; ++g) {
        const uint8_t* q = qs + g * F::kGroupBytes;
        prefetch_group<F>(q);
        const VectorScales s = group_scales<F>(gp + g * F::kParamBytes, sp + (g / 8) * F::kSuperBytes);
        for (int h = 0; h < F::kHalves; ++h) {
            __m512i acc[MR][SPLIT];
            for (int r = 0; r < MR; ++r)
                for (int i = 0; i < SPLIT; ++i) acc[r][i] = _mm512_setzero_si512();
            if constexpr (kZero != 0)
                for (int r = 0; r < MR; ++r) acc[r][0] = _mm512_set1_epi32(a.zero_start[2 * (g * MR + r) + h]);
#pragma GCC unroll 8
            for (int c = 0; c < kChunks; ++c) {
                const int t = h * kChunks + c;
                const __m512i w = chunk_codes<F>(q, t);
                const int32_t* quads = a.q + (g * 8 + t) * MR;
                for (int r = 0; r < MR; ++r)
                    acc[r][c % SPLIT] = _mm512_dpbusd_epi32(acc[r][c % SPLIT], w, _mm512_set1_epi32(quads[r]));
            }
            for (int r = 0; r < MR; ++r) {
                __m512i sum = acc[r][0];
                for (int i = 1; i < SPLIT; ++i) sum = _mm512_add_epi32(sum, acc[r][i]);
                const __m512 scaled = _mm512_mul_ps(s.scale[h], _mm512_set1_ps(a.d[g * MR + r]));
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scaled, total[r]);
                if constexpr (F::kMin) total[r] = _mm512_fmadd_ps(s.min, _mm512_set1_ps(a.dsum[g * MR + r]), total[r]);
            }
        }
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out[r], total[r]);
}

template <class F, int MR>
void gguf_block_rows(const uint8_t* qs, const uint8_t* gp, const uint8_t* sp, const Panel& a, int64_t K,
                     float (*out)[16]) {
    gguf_block<F, MR, (MR <= 1 ? 4 : MR <= 3 ? 2 : 1)>(qs, gp, sp, a, K, out);
}

#elif PAGELLM_Q8_AVX2
#ifdef __AVXVNNI__
constexpr bool kShiftedQ8 = true;
#else
constexpr bool kShiftedQ8 = false;
#endif

template <int Bit>
inline __m256i with_plane(__m256i v, __m256i plane, int t) {
    const __m256i moved = _mm256_slli_epi32(_mm256_srli_epi32(plane, t), Bit);
    return _mm256_or_si256(v, _mm256_and_si256(moved, _mm256_set1_epi32(0x01010101 << Bit)));
}

// Chunk t of a group, rows 8 * half .. + 7: per row lane the codes 4t..4t+3 (Q8_0: signed, shifted with VNNI).
template <class F>
inline __m256i chunk_codes(const uint8_t* q, int t, int half) {
    if constexpr (F::kBits == 8) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 64 * t + 32 * half));
        return kShiftedQ8 ? _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80))) : v;
    }
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(q + 32 * t + 16 * half)));
    __m256i w = _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), _mm256_set1_epi32(0x0F0F0F0F));
    if constexpr (F::kHighQuads) {  // gguf_format.h: chunk 4j + c's high bits at bits 2c, 2c + 1 of quad j
        const __m256i quad = _mm256_loadu_si256((const __m256i*)(q + 256 + 64 * (t >> 2) + 32 * half));
        const int c = t & 3;
        const __m256i moved = c == 2 ? quad : c == 3 ? _mm256_srli_epi32(quad, 2) : _mm256_slli_epi32(quad, 4 - 2 * c);
        return _mm256_or_si256(w, _mm256_and_si256(moved, _mm256_set1_epi32(0x30303030)));
    }
    if constexpr (F::kBits >= 5) w = with_plane<4>(w, _mm256_loadu_si256((const __m256i*)(q + 256 + 32 * half)), t);
    return w;
}

#ifndef __AVXVNNI__
// Chunks whose vpmaddubsw pair sums still add up exactly in int16: two products of a code (< 2^bits; Q8_0's
// |q| <= 128 by the sign trick) and an activation (|a| <= 127) per pair, so 8 chunks of 4-bit codes, 4 of 5-bit,
// 2 of 6-bit, 1 of 8-bit. Each batch costs one vpmaddwd + vpaddd instead of one per chunk: a quarter of the
// instructions of a 5-bit chunk (Q5_0, most of a Q4_K_M file's weights).
template <class F>
constexpr int int16_chunks() { return F::kBits == 8 ? 1 : 32767 / (((1 << F::kBits) - 1) * 127 * 2); }

// An empty asm that v passes through, so that its sum is built in the order written: GCC otherwise regroups
// the chunks' sums into a tree whose partial sums outnumber the 16 ymm registers and spill to the stack.
// measured: docs/benchmarks/2026-11-24-avx2-level-against-llama-cpp.md
inline void in_order(__m256i& v) { __asm__("" : "+x"(v)); }

// The int16 pair sums of w's codes with a row's broadcast quad.
template <class F>
inline __m256i pair_sums(__m256i w, __m256i quad) {
    if constexpr (F::kBits == 8) return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(quad, w));
    return _mm256_maddubs_epi16(w, quad);
}
#endif

// acc[r] = the 8 lanes' int32 dot products of chunks h * kChunks .. + kChunks - 1 of group q (rows 8 * half ..)
// with activation row r's quads (quads: the group's [8, MR]), plus row r's zero start (starts: the group's
// [MR, 2]).
template <class F, int MR>
inline void chunk_sums(const uint8_t* q, int h, int half, const int32_t* quads, const int32_t* starts,
                       __m256i* acc) {
    constexpr int kChunks = 8 / F::kHalves;
    constexpr bool kStarts = zero_point<F, kShiftedQ8>() != 0;
    for (int r = 0; r < MR; ++r) acc[r] = kStarts ? _mm256_set1_epi32(starts[2 * r + h]) : _mm256_setzero_si256();
#ifdef __AVXVNNI__
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) {
        const int t = h * kChunks + c;
        const __m256i w = chunk_codes<F>(q, t, half);
        for (int r = 0; r < MR; ++r) acc[r] = _mm256_dpbusd_avx_epi32(acc[r], w, _mm256_set1_epi32(quads[t * MR + r]));
    }
#else
    constexpr int kBatch = std::min(int16_chunks<F>(), kChunks);
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int b = 0; b < kChunks; b += kBatch) {
        __m256i part[MR];
#pragma GCC unroll 8
        for (int c = 0; c < kBatch; ++c) {
            const int t = h * kChunks + b + c;
            const __m256i w = chunk_codes<F>(q, t, half);
            for (int r = 0; r < MR; ++r) {
                const __m256i sums = pair_sums<F>(w, _mm256_set1_epi32(quads[t * MR + r]));
                part[r] = c == 0 ? sums : _mm256_add_epi16(part[r], sums);
                in_order(part[r]);
            }
        }
        for (int r = 0; r < MR; ++r) {
            const __m256i widened = _mm256_madd_epi16(part[r], ones);
            acc[r] = b == 0 && !kStarts ? widened : _mm256_add_epi32(acc[r], widened);  // no add to a zero start
            in_order(acc[r]);
        }
    }
#endif
}

inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

struct VectorScales {
    __m256 scale[2];
    __m256 min;
};

template <class F>
inline VectorScales group_scales(const uint8_t* gp, const uint8_t* sp, int half) {
    VectorScales s;
    const int64_t o = 8 * half;
    if constexpr (F::kScales == Scales::kF16 || F::kScales == Scales::kF16Min) {
        s.scale[0] = s.scale[1] = halves8(gp + 2 * o);
        if constexpr (F::kMin) s.min = halves8(gp + 32 + 2 * o);
    } else if constexpr (F::kScales == Scales::kSuper) {
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(gp + o))));
        const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(gp + 16 + o))));
        s.scale[0] = s.scale[1] = _mm256_mul_ps(halves8(sp + 2 * o), sc);
        s.min = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(halves8(sp + 32 + 2 * o), m));
    } else {
        for (int h = 0; h < 2; ++h)
            s.scale[h] = _mm256_mul_ps(halves8(sp + 2 * o), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                                _mm_loadl_epi64((const __m128i*)(gp + 16 * h + o)))));
    }
    return s;
}

template <class F, int MR>
void gguf_block_rows(const uint8_t* qs, const uint8_t* gp, const uint8_t* sp, const Panel& a, int64_t K,
                     float (*out)[16]) {
    for (int half = 0; half < 2; ++half) {
        __m256 total[MR];
        for (int r = 0; r < MR; ++r) total[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < K / kGroup; ++g) {
            const uint8_t* q = qs + g * F::kGroupBytes;
            if (half == 0) prefetch_group<F>(q);
            const VectorScales s = group_scales<F>(gp + g * F::kParamBytes, sp + (g / 8) * F::kSuperBytes, half);
            for (int h = 0; h < F::kHalves; ++h) {
                __m256i acc[MR];
                chunk_sums<F, MR>(q, h, half, a.q + g * 8 * MR, a.zero_start + 2 * g * MR, acc);
                for (int r = 0; r < MR; ++r) {
                    const __m256i sum = acc[r];
                    const __m256 scaled = _mm256_mul_ps(s.scale[h], _mm256_set1_ps(a.d[g * MR + r]));
                    total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scaled, total[r]);
                    if constexpr (F::kMin) total[r] = _mm256_fmadd_ps(s.min, _mm256_set1_ps(a.dsum[g * MR + r]), total[r]);
                }
            }
        }
        for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out[r] + 8 * half, total[r]);
    }
}

#else
// The vector blocks' arithmetic in plain loops over the block's 16 rows, which a compiler vectorizes on int16
// lanes (x86-64's baseline SSE2, NEON). Integer sums are exact in any order: a chunk's four products are summed in
// int16 (codes below 2^6 times activation bytes: |sum| <= 63 * 128 * 4 < 2^15; Q8_0's signed codes one product at
// a time) and widened into int32. The fp32 steps are the vector levels' own, in their order.

// Code 4t + b of row i, for b < 4 and the block's 16 rows: codes[b][i]. bits[p][b][i]: byte b of row i's plane p
// (code bit 4 + p of codes 4t' + b in bit t').
template <class F>
inline void chunk_codes(const uint8_t* q, int t, const uint8_t (*bits)[4][kBlock], int16_t (*codes)[kBlock]) {
    if constexpr (F::kBits == 8) {
        for (int i = 0; i < kBlock; ++i)
            for (int b = 0; b < 4; ++b) codes[b][i] = int8_t(q[64 * t + 4 * i + b]);
        return;
    }
    uint16_t w[kBlock];  // per row: byte 0 | byte 1 << 8, so codes 4t .. 4t + 3 are its nibbles 0, 2, 1, 3
    for (int i = 0; i < kBlock; ++i) w[i] = uint16_t(q[32 * t + 2 * i] | q[32 * t + 2 * i + 1] << 8);  // any endianness
    for (int i = 0; i < kBlock; ++i) {
        codes[0][i] = int16_t(w[i] & 15);
        codes[1][i] = int16_t((w[i] >> 8) & 15);
        codes[2][i] = int16_t((w[i] >> 4) & 15);
        codes[3][i] = int16_t(w[i] >> 12);
    }
    if constexpr (F::kHighQuads) {  // bits[j]: quad j (gguf_format.h)
        for (int b = 0; b < 4; ++b)
            for (int i = 0; i < kBlock; ++i)
                codes[b][i] = int16_t(codes[b][i] | (((bits[t / 4][b][i] >> (2 * (t % 4))) & 3) << 4));
        return;
    }
    for (int p = 0; p < F::kPlanes; ++p)
        for (int b = 0; b < 4; ++b)
            for (int i = 0; i < kBlock; ++i)
                codes[b][i] = int16_t(codes[b][i] | (((bits[p][b][i] >> t) & 1) << (4 + p)));
}

template <class F, int MR>
void gguf_block_rows(const uint8_t* qs, const uint8_t* gp, const uint8_t* sp, const Panel& a, int64_t K,
                     float (*out)[16]) {
    constexpr int kChunks = 8 / F::kHalves;
    for (int r = 0; r < MR; ++r) std::fill(out[r], out[r] + kBlock, 0.f);
    for (int64_t g = 0; g < K / kGroup; ++g) {
        const uint8_t* q = qs + g * F::kGroupBytes;
        uint8_t bits[2][4][kBlock];
        for (int p = 0; p < F::kPlanes; ++p)
            for (int i = 0; i < kBlock; ++i)
                for (int b = 0; b < 4; ++b) bits[p][b][i] = q[256 + 64 * p + 4 * i + b];
        int32_t sums[2][MR][kBlock];
        for (int h = 0; h < F::kHalves; ++h) {
            for (int r = 0; r < MR; ++r) {
                const int32_t start = zero_point<F, kShiftedQ8>() != 0 ? a.zero_start[2 * (g * MR + r) + h] : 0;
                std::fill(sums[h][r], sums[h][r] + kBlock, start);
            }
            for (int c = 0; c < kChunks; ++c) {
                const int t = h * kChunks + c;
                int16_t codes[4][kBlock];
                chunk_codes<F>(q, t, bits, codes);
                for (int r = 0; r < MR; ++r) {
                    const uint32_t quad = uint32_t(a.q[(g * 8 + t) * MR + r]);
                    const int16_t a0 = int8_t(quad), a1 = int8_t(quad >> 8), a2 = int8_t(quad >> 16),
                                  a3 = int8_t(quad >> 24);
                    int32_t* sum = sums[h][r];
                    if constexpr (F::kBits == 8) {
                        for (int i = 0; i < kBlock; ++i)
                            sum[i] += int16_t(codes[0][i] * a0) + int16_t(codes[1][i] * a1) +
                                      int16_t(codes[2][i] * a2) + int16_t(codes[3][i] * a3);
                    } else {
                        for (int i = 0; i < kBlock; ++i)
                            sum[i] += int16_t(codes[0][i] * a0 + codes[1][i] * a1 + codes[2][i] * a2 +
                                              codes[3][i] * a3);
                    }
                }
            }
        }
        for (int i = 0; i < kBlock; ++i) {
            const RowScales s = row_scales<F>(gp + g * F::kParamBytes, sp + (g / 8) * F::kSuperBytes, i);
            for (int h = 0; h < F::kHalves; ++h)
                for (int r = 0; r < MR; ++r) {
                    out[r][i] = fma_f32(float(sums[h][r][i]), s.scale[h] * a.d[g * MR + r], out[r][i]);
                    if constexpr (F::kMin) out[r][i] = fma_f32(s.min, a.dsum[g * MR + r], out[r][i]);
                }
        }
    }
}
#endif

}  // namespace
