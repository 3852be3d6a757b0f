// Weight-only int4 / int8 matrix products y[M, N] = x[M, K] W^T for few activation rows (decode), and the
// int4 dequantizers behind embedding lookups (rows) and the dense path (transposed tiles).
//
// Why: a decode step streams every weight once per token, so its matmuls are bound by memory bandwidth;
// torch's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm run far below it there.
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
//
// Numerics match torch's kernels: activations rounded to bf16, weights exact in fp32, fp32 sums, one
// rounding of the result into the output dtype (fp32 outputs skip even that). quant_gemv_q8.cpp holds the
// int4 x int8-activation variant (AVX-512 VNNI), on the same layout.
//
// int4 layout, chosen so one register of codes feeds one vdpbf16ps for 16 rows with no shuffles:
//
//   codes [N/16][K/4][16 rows][2 bytes]   byte b of row r in chunk t: low nibble k = 4t + b,
//                                                                     high nibble k = 4t + 2 + b
//   sz    [N/16][G][2][16] bf16           the block's 16 scales, then its 16 zeros, for group g
//
//   w[n, k] = (q - 8) * scale[n, g] + zero[n, g],  g = k / 32,  q in 0..15
//
// A nibble becomes the bf16 number q - 8 through a 16-entry vpermw table, so per group
//   sum_k w x = scale * sum_k (q - 8) x + zero * sum_k x,
// the last sum taken once per activation row: exact products, fp32 sums. (Or-ing the nibble into 0x4300,
// the bf16 of 128 + q, measured as fast but costs ~7 bits of the sums' headroom to the 128 offset.)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "bf16.h"
#include "int4_common.h"
#include "thread_scratch.h"

namespace {

// The codes of row n (block n / 16, row n % 16) into q[K].
void int4_row_codes(const uint8_t* codes, int64_t n, int64_t K, uint8_t* q) {
    const uint8_t* p = codes + (n / kBlock) * kBlock * K / 2 + (n % kBlock) * 2;
    for (int64_t t = 0; t < K / 4; ++t, p += 2 * kBlock) {
        q[4 * t] = p[0] & 15;
        q[4 * t + 1] = p[1] & 15;
        q[4 * t + 2] = p[0] >> 4;
        q[4 * t + 3] = p[1] >> 4;
    }
}

}  // namespace

// out[T, K] = the dequantized int4 rows ids[T] of N, in fp32 or bf16: the kernel's own weights, exact in
// fp32. Returns how many ids were out of range (their rows are left untouched).
extern "C" int64_t pagellm_int4_rows(const uint8_t* codes, const uint16_t* sz, int64_t N, int64_t K,
                                     const int64_t* ids, int64_t T, void* out, int out_bf16) {
    const int64_t G = K / kGroup;
    int64_t bad = 0;
#pragma omp parallel if (worth_threads(T * K)) reduction(+ : bad)
    {
        std::vector<uint8_t> q(K);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T; ++i) {
            const int64_t n = ids[i];
            if (n < 0 || n >= N) {
                ++bad;
                continue;
            }
            int4_row_codes(codes, n, K, q.data());
            const uint16_t* s = sz + (n / kBlock) * G * 2 * kBlock + n % kBlock;
            for (int64_t g = 0; g < G; ++g) {
                const float scale = bf16_to_f32(s[g * 2 * kBlock]), zero = bf16_to_f32(s[g * 2 * kBlock + kBlock]);
                for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k)
                    store_value(out, i * K + k, (float(q[k]) - 8.f) * scale + zero, out_bf16);
            }
        }
    }
    return bad;
}

// The matmuls need AVX-512 BF16: elsewhere pagellm_quant_gemv_vectorized() == 0 and the Python side keeps
// torch's kernels for bf16 activations (a scalar kernel would be slower than theirs); the int4 layout's
// dequantizers above and below serve every level (the int8-activation kernel runs on it everywhere).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

namespace {

constexpr int kMaxRows = 8;     // activation rows per pass over a weight block (32 registers)

// Activations rounded to bf16 as the torch kernels take them, plus per-group sums for the zero term.
struct Activations {
    std::vector<uint16_t>& bf16;    // [M, K]
    std::vector<float>& group_sum;  // [M, G] (the int4 kernel's zero term)
};

Activations prepare(const void* x, int x_bf16, int64_t M, int64_t K) {
    struct Bf16 {};
    struct GroupSum {};
    // the calling thread's: no allocation per call
    Activations a{thread_scratch::scratch<Bf16, uint16_t>(), thread_scratch::scratch<GroupSum, float>()};
    a.bf16.resize(M * K);
    a.group_sum.resize(M * (K / kGroup));
    for (int64_t i = 0; i < M * K; ++i)
        a.bf16[i] = x_bf16 ? static_cast<const uint16_t*>(x)[i] : f32_to_bf16(static_cast<const float*>(x)[i]);
    for (int64_t j = 0; j < M * (K / kGroup); ++j) {
        float s = 0.f;
        for (int64_t k = 0; k < kGroup; ++k) s += bf16_to_f32(a.bf16[j * kGroup + k]);
        a.group_sum[j] = s;
    }
    return a;
}


inline __m512i pair_of(const uint16_t* p) {  // x[k], x[k + 1] in every 32-bit lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

inline __m512 dot_pairs(__m512 acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}

// bf16 of the 16 values of a nibble, as a vpermw table (entries 16..31 unused): int4 codes as q - 8.
inline __m512i code_table() {
    alignas(64) uint16_t t[32] = {};
    for (int n = 0; n < 16; ++n) t[n] = f32_to_bf16(float(n - 8));
    return _mm512_load_si512(t);
}

// total[r] (16 rows of the block) for activation rows r < MR. SPLIT partial sums per row hide the
// latency of the dependent vdpbf16ps chain when few rows give few independent chains.
template <int MR, int SPLIT>
void int4_block(const uint8_t* codes, const uint16_t* sz, const uint16_t* xb, const float* xsum, int64_t K,
                __m512* total) {
    const int64_t G = K / kGroup;
    const __m512i nibble = _mm512_set1_epi16(0x000F), table = code_table();
    for (int r = 0; r < MR; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        __m512 acc[MR][SPLIT];
        for (int r = 0; r < MR; ++r)
            for (int s = 0; s < SPLIT; ++s) acc[r][s] = _mm512_setzero_ps();
        const uint8_t* c = codes + g * (kBlock * kGroup / 2);
        for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)c + kPrefetch + 64 * l, _MM_HINT_T0);
        _mm_prefetch((const char*)(sz + g * 2 * kBlock) + kPrefetch / 4, _MM_HINT_T0);  // sz: 1/4 the bytes
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(c + 32 * t)));
            const __m512i low = _mm512_permutexvar_epi16(_mm512_and_si512(w, nibble), table);
            const __m512i high = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
            for (int r = 0; r < MR; ++r) {
                const uint16_t* xr = xb + r * K + g * kGroup + 4 * t;
                acc[r][(2 * t) % SPLIT] = dot_pairs(acc[r][(2 * t) % SPLIT], low, pair_of(xr));
                acc[r][(2 * t + 1) % SPLIT] = dot_pairs(acc[r][(2 * t + 1) % SPLIT], high, pair_of(xr + 2));
            }
        }
        const __m512 scale = bf16x16(sz + g * 2 * kBlock);
        const __m512 zero = bf16x16(sz + g * 2 * kBlock + kBlock);
        for (int r = 0; r < MR; ++r) {
            __m512 a = acc[r][0];
            for (int s = 1; s < SPLIT; ++s) a = _mm512_add_ps(a, acc[r][s]);
            total[r] = _mm512_fmadd_ps(a, scale, total[r]);
            total[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[r * G + g]), total[r]);
        }
    }
}

template <int MR>
void int4_block_rows(const uint8_t* codes, const uint16_t* sz, const uint16_t* xb, const float* xsum, int64_t K,
                     __m512* total) {
    int4_block<MR, (MR <= 2 ? 4 : MR <= 4 ? 2 : 1)>(codes, sz, xb, xsum, K, total);
}

void int4_block_any(int mr, const uint8_t* codes, const uint16_t* sz, const uint16_t* xb, const float* xsum,
                    int64_t K, __m512* total) {
    switch (mr) {
        case 1: return int4_block_rows<1>(codes, sz, xb, xsum, K, total);
        case 2: return int4_block_rows<2>(codes, sz, xb, xsum, K, total);
        case 3: return int4_block_rows<3>(codes, sz, xb, xsum, K, total);
        case 4: return int4_block_rows<4>(codes, sz, xb, xsum, K, total);
        case 5: return int4_block_rows<5>(codes, sz, xb, xsum, K, total);
        case 6: return int4_block_rows<6>(codes, sz, xb, xsum, K, total);
        case 7: return int4_block_rows<7>(codes, sz, xb, xsum, K, total);
        default: return int4_block_rows<8>(codes, sz, xb, xsum, K, total);
    }
}


// bf16 of the 16 values of a nibble, as vpermw tables (entries 16..31 unused): the low nibble of an int8 code
// as 0..15, the high one as 16 * (-8..7), so a code q = 16 * hi + lo becomes two exact bf16 numbers.
inline __m512i nibble_table(bool high) {
    alignas(64) uint16_t t[32] = {};
    for (int n = 0; n < 16; ++n) t[n] = f32_to_bf16(high ? 16.f * float(n < 8 ? n : n - 16) : float(n));
    return _mm512_load_si512(t);
}

// One int8 weight row against MR activation rows (bf16): each 32 codes become two bf16 vectors through
// vpermw tables, and two vdpbf16ps per activation row sum them exactly in fp32; the conversion is shared by
// the MR rows. U partial sums keep independent chains in flight. One row at a time keeps the weight stream
// sequential (interleaved rows read slower from DRAM).
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
template <int MR>
void int8_row(const int8_t* q, const uint16_t* xb, int64_t K, const __m512i* tables, float* sums) {
    constexpr int U = MR >= 4 ? 1 : 4 / MR;
    __m512 acc[MR][U];
    for (int r = 0; r < MR; ++r)
        for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi16(15);
    int64_t k = 0;
    for (; k < K; k += 32 * U) {
        _mm_prefetch((const char*)(q + k) + kPrefetch, _MM_HINT_T0);
        for (int u = 0; u < U && k + 32 * u < K; ++u) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(q + k + 32 * u)));
            const __m512i low = _mm512_permutexvar_epi16(_mm512_and_si512(w, nibble), tables[0]);
            const __m512i high = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), tables[1]);
            for (int r = 0; r < MR; ++r) {
                const __m512i x = _mm512_loadu_si512((const void*)(xb + r * K + k + 32 * u));
                acc[r][u] = dot_pairs(dot_pairs(acc[r][u], low, x), high, x);
            }
        }
    }
    for (int r = 0; r < MR; ++r) {
        for (int u = 1; u < U; ++u) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);
        sums[r] = _mm512_reduce_add_ps(acc[r][0]);
    }
}

void int8_row_any(int mr, const int8_t* q, const uint16_t* xb, int64_t K, const __m512i* tables, float* sums) {
    switch (mr) {
        case 1: return int8_row<1>(q, xb, K, tables, sums);
        case 2: return int8_row<2>(q, xb, K, tables, sums);
        case 3: return int8_row<3>(q, xb, K, tables, sums);
        case 4: return int8_row<4>(q, xb, K, tables, sums);
        case 5: return int8_row<5>(q, xb, K, tables, sums);
        case 6: return int8_row<6>(q, xb, K, tables, sums);
        case 7: return int8_row<7>(q, xb, K, tables, sums);
        default: return int8_row<8>(q, xb, K, tables, sums);
    }
}

}  // namespace

extern "C" int pagellm_quant_gemv_vectorized() { return 1; }

// y[M, N] = x[M, K] W^T (+ bias) for the int4 layout above. x fp32 or bf16; bias and out in out's dtype.
extern "C" void pagellm_int4_matmul(const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* codes,
                                    const uint16_t* sz, int64_t N, const void* bias, void* out, int out_bf16) {
    const Activations a = prepare(x, x_bf16, M, K);
    const int64_t G = K / kGroup, blocks = N / kBlock;
    const uint16_t* xb = a.bf16.data();
    const float* xsum = a.group_sum.data();
#pragma omp parallel for schedule(static) if (worth_threads(N * K / 2))
    for (int64_t nb = 0; nb < blocks; ++nb) {
        const uint8_t* c = codes + nb * kBlock * K / 2;
        const uint16_t* s = sz + nb * G * 2 * kBlock;
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
            const int mr = int(std::min<int64_t>(kMaxRows, M - m0));
            __m512 total[kMaxRows];
            int4_block_any(mr, c, s, xb + m0 * K, xsum + m0 * G, K, total);
            for (int r = 0; r < mr; ++r)
                store16(total[r], bias, nb * kBlock, out, (m0 + r) * N + nb * kBlock, out_bf16);
        }
    }
}

// out[k, n - first] (row stride ld) = w[n, k] for rows [first, first + rows), both multiples of 16: the
// transposed tile of the dense path (F.linear takes its transpose without a copy). In this layout one chunk
// of 32 bytes holds 4 k's of 16 rows, so each k's 16 values are one shift and mask away.
extern "C" void pagellm_int4_tile_t(const uint8_t* codes, const uint16_t* sz, int64_t K, int64_t first,
                                    int64_t rows, void* out, int64_t ld, int out_bf16) {
    const int64_t G = K / kGroup;
#pragma omp parallel for schedule(static) if (worth_threads(rows * K))
    for (int64_t b = 0; b < rows / kBlock; ++b) {
        const int64_t nb = first / kBlock + b;
        const uint8_t* c = codes + nb * kBlock * K / 2;
        const uint16_t* s = sz + nb * G * 2 * kBlock;
        for (int64_t g = 0; g < G; ++g) {
            const __m512 scale = bf16x16(s + g * 2 * kBlock);
            const __m512 zero8 = _mm512_fmadd_ps(scale, _mm512_set1_ps(-8.f), bf16x16(s + g * 2 * kBlock + kBlock));
            const __m256i nibble = _mm256_set1_epi16(15);
            for (int t = 0; t < 8; ++t) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(c + g * (kBlock * kGroup / 2) + 32 * t));
                const __m256i q[4] = {_mm256_and_si256(w, nibble), _mm256_and_si256(_mm256_srli_epi16(w, 8), nibble),
                                      _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble), _mm256_srli_epi16(w, 12)};
                for (int j = 0; j < 4; ++j) {  // k = 4t + j: byte j % 2 of each row's pair, nibble j / 2
                    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(q[j])), scale, zero8);
                    store16(v, nullptr, 0, out, (g * kGroup + 4 * t + j) * ld + b * kBlock, out_bf16);
                }
            }
        }
    }
}

// y[M, N] = x[M, K] (q[N, K] * scale[N])^T (+ bias): torch's Int8Linear layout as it is.
extern "C" void pagellm_int8_matmul(const void* x, int x_bf16, int64_t M, int64_t K, const int8_t* q,
                                    const uint16_t* scale, int64_t N, const void* bias, void* out, int out_bf16) {
    const Activations a = prepare(x, x_bf16, M, K);
    const uint16_t* xb = a.bf16.data();
    const __m512i tables[2] = {nibble_table(false), nibble_table(true)};
#pragma omp parallel for schedule(static) if (worth_threads(N * K))
    for (int64_t n = 0; n < N; ++n) {
        const float row_scale = bf16_to_f32(scale[n]), row_bias = bias ? load_value(bias, n, out_bf16) : 0.f;
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
            const int mr = int(std::min<int64_t>(kMaxRows, M - m0));
            float sums[kMaxRows];
            int8_row_any(mr, q + n * K, xb + m0 * K, K, tables, sums);
            for (int r = 0; r < mr; ++r) store_value(out, (m0 + r) * N + n, sums[r] * row_scale + row_bias, out_bf16);
        }
    }
}

#else

extern "C" int pagellm_quant_gemv_vectorized() { return 0; }

// pagellm_int4_tile_t above in plain C++, with the same fma's: bit-identical.
extern "C" void pagellm_int4_tile_t(const uint8_t* codes, const uint16_t* sz, int64_t K, int64_t first,
                                    int64_t rows, void* out, int64_t ld, int out_bf16) {
    const int64_t G = K / kGroup;
#pragma omp parallel for schedule(static) if (worth_threads(rows * K))
    for (int64_t b = 0; b < rows / kBlock; ++b) {
        const int64_t nb = first / kBlock + b;
        const uint8_t* c = codes + nb * kBlock * K / 2;
        const uint16_t* s = sz + nb * G * 2 * kBlock;
        for (int64_t g = 0; g < G; ++g)
            for (int r = 0; r < kBlock; ++r) {
                const float scale = bf16_to_f32(s[g * 2 * kBlock + r]);
                const float zero8 = std::fma(scale, -8.f, bf16_to_f32(s[g * 2 * kBlock + kBlock + r]));
                for (int t = 0; t < 8; ++t) {
                    const uint8_t* pair = c + g * (kBlock * kGroup / 2) + 32 * t + 2 * r;
                    const uint8_t q[4] = {uint8_t(pair[0] & 15), uint8_t(pair[1] & 15), uint8_t(pair[0] >> 4),
                                          uint8_t(pair[1] >> 4)};
                    for (int j = 0; j < 4; ++j)
                        store_value(out, (g * kGroup + 4 * t + j) * ld + b * kBlock + r,
                                    std::fma(float(q[j]), scale, zero8), out_bf16);
                }
            }
    }
}

#endif  // AVX-512 BF16
