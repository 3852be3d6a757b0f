// int4 weights x int8 activations: y[M, N] = x[M, K] W^T on quant_gemv.cpp's int4 layout, with x quantized to
// int8 on the fly (llama.cpp's Q8_0 idea). A library of its own so each file stays readable; the layout's sizes
// come from int4_common.h. Three builds of one arithmetic, bit-identical (integer sums are exact, and every
// fp32 step is the same operation in the same order at every level):
//   avx512   vpdpbusd on 16 rows at once (below)
//   avx2     vpmaddubsw + vpaddw on 8 rows at once: q (0..15) x a (-127..127) pair sums are at most 3810, so a
//            group's 8 of them add up in int16 without saturating (30480 < 32767); one vpmaddwd per group widens.
//            Built with AVX-VNNI (-mavxvnni, where the CPU has it): vpdpbusd on 8 lanes instead, int32 throughout
//   generic  plain C++ loops, std::fma where the vector code fuses
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "bf16.h"
#include "int4_common.h"
#include "q8_activations.h"
#include <cmath>

// ---- int4 weights x int8 activations (vpdpbusd) ------------------------------------------------------------
//
// Why: at the M measured the bf16 kernel (quant_gemv.cpp) is bound by its vdpbf16ps (32 products per
// instruction); vpdpbusd does 64 (u8 x s8 -> int32) per instruction at the same rate here. The cost is the
// activations' int8 rounding (see the tests). What keeps the kernel below vpdpbusd's own rate is each group's
// fp32 epilogue (cvt, mul, 2 fma per 8 vpdpbusd); the unpacking hardly counts.
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
//
// Numerics (llama.cpp's Q8_0 idea, on this layout): x is taken in fp32 (bf16 inputs are exact in it; fp32
// inputs are not rounded to bf16). Per activation row m and 32-column group g:
//   d[m, g] = max_k |x| / 127                   (fp32; 0 for an all-zero group)
//   a[m, k] = round_half_even(x / d), clamped to -127..127   (fp32 division, int8)
// and per output
//   y[m, n] = sum_g d * (scale * sum_k q a + zero' * sum_k a),   zero' = zero - 8 * scale (fp32),
// which is sum_k w x with x replaced by d * a. The integer sums are exact in int32; d * sum_k a, zero', the
// products and the sums over groups are fp32; one rounding of the result (+ bias) into the output dtype.
// NaN in a group makes d NaN, so it propagates to the row's outputs.
//
// Weights need no shuffle beyond widening: a 32-byte chunk t holds 16 rows x 2 bytes; widened to one 32-bit lane
// per row, (v | v << 12) & 0x0F0F0F0F puts q(4t), q(4t + 1), q(4t + 2), q(4t + 3) in the lane's bytes 0..3, the
// order of the activations in memory, so one broadcast 4 bytes of a row is vpdpbusd's other operand.

namespace {

// Blocks per chunk (see q8_blocks): ~256 KB of weights, well within the 1 MB L2 (nearby sizes measured alike).
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
inline int64_t chunk_blocks(int64_t K) {
    const int64_t block_bytes = kBlock * K / 2 + K / kGroup * 2 * kBlock * 2;  // codes, then scales and zeros
    return std::max<int64_t>(1, (256 << 10) / block_bytes);
}

#if PAGELLM_Q8_AVX512
// out[r] (16 rows of the block) for the MR activation rows of one pass, from its panels a, d, dsum.
// SPLIT int32 partial sums per row hide the vpdpbusd latency when few rows give few independent chains (exact:
// integers). The sums stay in a local array until the end: through `out` they were stored every group.
template <int MR, int SPLIT>
void q8_block(const uint8_t* codes, const uint16_t* sz, const int32_t* a, const float* d, const float* dsum,
              int64_t K, float (*out)[16]) {
    const int64_t G = K / kGroup;
    __m512 total[MR];
    for (int r = 0; r < MR; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        __m512i acc[MR][SPLIT];
        for (int r = 0; r < MR; ++r)
            for (int s = 0; s < SPLIT; ++s) acc[r][s] = _mm512_setzero_si512();
        const uint8_t* c = codes + g * (kBlock * kGroup / 2);
        for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)c + kPrefetch + 64 * l, _MM_HINT_T0);
        _mm_prefetch((const char*)(sz + g * 2 * kBlock) + kPrefetch / 4, _MM_HINT_T0);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
            const __m512i w = unpack_chunk(c + 32 * t);
            const int32_t* quads = a + (g * 8 + t) * MR;
            for (int r = 0; r < MR; ++r)
                acc[r][t % SPLIT] = _mm512_dpbusd_epi32(acc[r][t % SPLIT], w, _mm512_set1_epi32(quads[r]));
        }
        const __m512 scale = bf16x16(sz + g * 2 * kBlock);
        const __m512 zero8 = _mm512_fmadd_ps(scale, _mm512_set1_ps(-8.f), bf16x16(sz + g * 2 * kBlock + kBlock));
        for (int r = 0; r < MR; ++r) {
            __m512i sum = acc[r][0];
            for (int s = 1; s < SPLIT; ++s) sum = _mm512_add_epi32(sum, acc[r][s]);
            const __m512 scaled = _mm512_mul_ps(scale, _mm512_set1_ps(d[g * MR + r]));
            total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scaled, total[r]);
            total[r] = _mm512_fmadd_ps(zero8, _mm512_set1_ps(dsum[g * MR + r]), total[r]);
        }
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out[r], total[r]);
}

template <int MR>
void q8_block_rows(const uint8_t* codes, const uint16_t* sz, const int32_t* a, const float* d, const float* dsum,
                   int64_t K, float (*out)[16]) {
    q8_block<MR, (MR <= 1 ? 4 : MR <= 3 ? 2 : 1)>(codes, sz, a, d, dsum, K, out);
}

#elif PAGELLM_Q8_AVX2
inline __m256 bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// out[r][0..16] for the MR activation rows of one pass, 8 rows of the block at a time (kMaxRowsQ8's note on
// registers): per chunk, the 8 rows' 4 codes widened into their 32-bit lanes as in the AVX-512 unpack, one
// vpmaddubsw against a row's broadcast quad, the pair sums added in int16 across the group's 8 chunks.
template <int MR>
void q8_block(const uint8_t* codes, const uint16_t* sz, const int32_t* a, const float* d, const float* dsum,
              int64_t K, float (*out)[16]) {
    const int64_t G = K / kGroup;
    const __m256i nibbles = _mm256_set1_epi32(0x0F0F0F0F);
    [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; ++half) {
        __m256 total[MR];
        for (int r = 0; r < MR; ++r) total[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
            const uint8_t* c = codes + g * (kBlock * kGroup / 2) + 16 * half;
            if (half == 0)
                for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)c + kPrefetch + 64 * l, _MM_HINT_T0);
            __m256i acc[MR];
            for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int t = 0; t < 8; ++t) {
                const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(c + 32 * t)));
                const __m256i w = _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), nibbles);
                const int32_t* quads = a + (g * 8 + t) * MR;
                for (int r = 0; r < MR; ++r)
#ifdef __AVXVNNI__
                    acc[r] = _mm256_dpbusd_avx_epi32(acc[r], w, _mm256_set1_epi32(quads[r]));  // int32 sums
#else
                    acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(quads[r])));
#endif
            }
            const uint16_t* s = sz + g * 2 * kBlock + 8 * half;
            const __m256 scale = bf16x8(s);
            const __m256 zero8 = _mm256_fmadd_ps(scale, _mm256_set1_ps(-8.f), bf16x8(s + kBlock));
            for (int r = 0; r < MR; ++r) {
#ifdef __AVXVNNI__
                const __m256i sum = acc[r];
#else
                const __m256i sum = _mm256_madd_epi16(acc[r], ones);
#endif
                const __m256 scaled = _mm256_mul_ps(scale, _mm256_set1_ps(d[g * MR + r]));
                total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scaled, total[r]);
                total[r] = _mm256_fmadd_ps(zero8, _mm256_set1_ps(dsum[g * MR + r]), total[r]);
            }
        }
        for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out[r] + 8 * half, total[r]);
    }
}

template <int MR>
void q8_block_rows(const uint8_t* codes, const uint16_t* sz, const int32_t* a, const float* d, const float* dsum,
                   int64_t K, float (*out)[16]) {
    q8_block<MR>(codes, sz, a, d, dsum, K, out);
}
#else
// The AVX-512 block's arithmetic one value at a time.
template <int MR>
void q8_block_rows(const uint8_t* codes, const uint16_t* sz, const int32_t* a, const float* d, const float* dsum,
                   int64_t K, float (*out)[16]) {
    const int64_t G = K / kGroup;
    for (int r = 0; r < MR; ++r) std::fill(out[r], out[r] + kBlock, 0.f);
    for (int64_t g = 0; g < G; ++g) {
        int32_t acc[MR][kBlock] = {};
        const uint8_t* c = codes + g * (kBlock * kGroup / 2);
        for (int t = 0; t < 8; ++t)
            for (int i = 0; i < kBlock; ++i) {
                const uint8_t lo = c[32 * t + 2 * i], hi = c[32 * t + 2 * i + 1];
                const int32_t w[4] = {lo & 15, hi & 15, lo >> 4, hi >> 4};
                for (int r = 0; r < MR; ++r) {
                    const uint32_t quad = uint32_t(a[(g * 8 + t) * MR + r]);
                    for (int b = 0; b < 4; ++b) acc[r][i] += w[b] * int32_t(int8_t(quad >> (8 * b)));
                }
            }
        for (int i = 0; i < kBlock; ++i) {
            const float scale = bf16_to_f32(sz[g * 2 * kBlock + i]);
            const float zero8 = std::fma(scale, -8.f, bf16_to_f32(sz[g * 2 * kBlock + kBlock + i]));
            for (int r = 0; r < MR; ++r) {
                out[r][i] = std::fma(float(acc[r][i]), scale * d[g * MR + r], out[r][i]);
                out[r][i] = std::fma(zero8, dsum[g * MR + r], out[r][i]);
            }
        }
    }
}
#endif

template <int... MR>
void q8_block_any(int mr, const uint8_t* codes, const uint16_t* sz, const int32_t* a, const float* d,
                  const float* dsum, int64_t K, float (*out)[16], std::integer_sequence<int, MR...>) {
    // one call of the table of specialisations 1..kMaxRowsQ8
    using Fn = void (*)(const uint8_t*, const uint16_t*, const int32_t*, const float*, const float*, int64_t,
                        float (*)[16]);
    static constexpr Fn table[] = {q8_block_rows<MR + 1>...};
    table[mr - 1](codes, sz, a, d, dsum, K, out);
}

// out[offset..+16] = v + bias[column..+16], rounded once into the output dtype.
inline void store_row16(const float* v, const void* bias, int64_t column, void* out, int64_t offset, int out_bf16) {
    for (int i = 0; i < kBlock; ++i)
        store_value(out, offset + i, bias ? v[i] + load_value(bias, column + i, out_bf16) : v[i], out_bf16);
}

// Blocks [first, last) against all M activation rows, into out: a chunk of blocks at a time (in L2), pass by
// pass over it (the pass's panel stays in L1). Block by block with all passes each, every block wrote a line
// to each of M output rows, which was slower with many rows of a big N; a chunk writes each row's lines in one
// run.
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
void q8_blocks(int64_t first, int64_t last, const uint8_t* codes, const uint16_t* sz, const QuantizedActivations& a,
               int64_t M, int64_t K, int64_t N, const void* bias, void* out, int out_bf16) {
    const int64_t G = K / kGroup, chunk_size = chunk_blocks(K);
    for (int64_t chunk = first; chunk < last; chunk += chunk_size) {
        for (int64_t p = 0; p < row_passes(M); ++p) {
            const int64_t m0 = first_row(p, M);
            const int mr = int(first_row(p + 1, M) - m0);
            for (int64_t nb = chunk; nb < std::min(last, chunk + chunk_size); ++nb) {
                float total[kMaxRowsQ8][16];
                q8_block_any(mr, codes + nb * kBlock * K / 2, sz + nb * G * 2 * kBlock, a.q + m0 * K / 4,
                             a.scale + m0 * G, a.scaled_sum + m0 * G, K, total,
                             std::make_integer_sequence<int, kMaxRowsQ8>());
                for (int r = 0; r < mr; ++r)
                    store_row16(total[r], bias, nb * kBlock, out, (m0 + r) * N + nb * kBlock, out_bf16);
            }
        }
    }
}

}  // namespace

// pagellm_int4_matmul with the activations quantized to int8 (numerics above). Same arguments and layout.
extern "C" void pagellm_int4_matmul_q8(const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* codes,
                                       const uint16_t* sz, int64_t N, const void* bias, void* out, int out_bf16) {
    q8_matmul(x, x_bf16, M, K, N, [&](int64_t first, int64_t last, const QuantizedActivations& a) {
        q8_blocks(first, last, codes, sz, a, M, K, N, bias, out, out_bf16);
    });
}

