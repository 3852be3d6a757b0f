// Weight-only int4 / int8 matrix products y[M, N] = x[M, K] W^T for few activation rows (decode), and the
// int4 dequantizers behind embedding lookups (rows) and the dense path (transposed tiles).
//
// Why: a decode step streams every weight once per token, so its matmuls are bound by memory bandwidth;
// torch's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm reached only 10-15 GB/s at M = 1..8 here.
//
// Numerics match torch's kernels: activations rounded to bf16, weights exact in fp32, fp32 sums, one
// rounding of the result into the output dtype (fp32 outputs skip even that). The exception, with AVX-512 VNNI:
// pagellm_int4_matmul_q8, for larger M, quantizes the activations to int8 (its numerics at its section below).
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
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "bf16.h"

// AVX-512 BF16 only: elsewhere the library exports just pagellm_quant_gemv_vectorized() == 0, and the Python
// side keeps torch's kernels (a scalar kernel would be slower than theirs).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 16;  // int4 rows per block
constexpr int kMaxRows = 8;     // activation rows per pass over a weight block (32 registers)
// Software prefetch distance in the weight stream. Without it the int4 kernel read ~10-15% slower from DRAM
// (layer-sized weights) and the int8 one up to 1.4x slower; 2-4 KB ahead measured best, 1-16 KB within noise.
constexpr int64_t kPrefetch = 4096;

// Activations rounded to bf16 as the torch kernels take them, plus per-group sums for the zero term.
struct Activations {
    std::vector<uint16_t> bf16;    // [M, K]
    std::vector<float> group_sum;  // [M, G] (the int4 kernel's zero term)
};

Activations& prepare(const void* x, int x_bf16, int64_t M, int64_t K) {
    thread_local Activations a;  // reused: no allocation per call
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

inline float load_value(const void* p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store_value(void* p, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
    else
        static_cast<float*>(p)[i] = v;
}

// Threads only where there is enough to share: a fork/join costs a few microseconds.
inline bool worth_threads(int64_t bytes) { return bytes >= (64 << 10); }

inline __m512 bf16x16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
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

// out[offset..+16] = v + bias[column..+16] in the output dtype.
void store16(__m512 v, const void* bias, int64_t column, void* out, int64_t offset, int out_bf16) {
    if (bias) v = _mm512_add_ps(v, out_bf16 ? bf16x16(static_cast<const uint16_t*>(bias) + column)
                                            : _mm512_loadu_ps(static_cast<const float*>(bias) + column));
    if (out_bf16)
        _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(out) + offset), (__m256i)_mm512_cvtneps_pbh(v));
    else
        _mm512_storeu_ps(static_cast<float*>(out) + offset, v);
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
// sequential (4 interleaved rows ran at 12 GB/s from DRAM).
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

extern "C" int pagellm_quant_gemv_vectorized() { return 1; }

// y[M, N] = x[M, K] W^T (+ bias) for the int4 layout above. x fp32 or bf16; bias and out in out's dtype.
extern "C" void pagellm_int4_matmul(const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* codes,
                                    const uint16_t* sz, int64_t N, const void* bias, void* out, int out_bf16) {
    const Activations& a = prepare(x, x_bf16, M, K);
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
    const Activations& a = prepare(x, x_bf16, M, K);
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

#if defined(__AVX512VNNI__)
// ---- int4 weights x int8 activations (vpdpbusd) ------------------------------------------------------------
//
// Why: at M = 16..320 rows the kernel above is bound by its vdpbf16ps (32 products per instruction); vpdpbusd
// does 64 (u8 x s8 -> int32) per instruction at the same rate here (Zen 4: 457 vs 224 G products x 2 per second
// and core). The cost is the activations' int8 rounding (see the tests: ~0.5-1.5% of an output row's norm).
// Measured: ~300 GOPS on one core against the bf16 kernel's ~185, ~600 against ~330 on two (weights from L3).
// What keeps it from 457 a core is each group's fp32 epilogue (cvt, mul, 2 fma per 8 vpdpbusd: 390 GOPS
// without it); the unpacking hardly counts.
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

constexpr int kMaxRowsQ8 = 12;  // activation rows per pass: 12 int32 + 12 fp32 accumulators of 32 registers

// Blocks per chunk (see q8_blocks): ~256 KB of weights, well within the 1 MB L2 (16-64 blocks measured alike).
inline int64_t chunk_blocks(int64_t K) {
    const int64_t block_bytes = kBlock * K / 2 + K / kGroup * 2 * kBlock * 2;  // codes, then scales and zeros
    return std::max<int64_t>(1, (256 << 10) / block_bytes);
}

// The rows run in passes of up to kMaxRowsQ8, of near-equal size (13 rows as 7 + 6, not 12 + 1: a lone row runs
// at a fraction of the rate). Pass p covers rows [first_row(p), first_row(p + 1)).
inline int64_t row_passes(int64_t M) { return (M + kMaxRowsQ8 - 1) / kMaxRowsQ8; }
inline int64_t first_row(int64_t p, int64_t M) { return p * M / row_passes(M); }
inline int64_t pass_of(int64_t m, int64_t M) { return ((m + 1) * row_passes(M) - 1) / M; }

// Each pass's rows stored as one panel, rows fastest: a pass streams its quads, d and d * sum from one pointer at
// compile-time offsets. (Row-major x needed a general register per row, and spilled them.)
struct QuantizedActivations {
    int32_t* q;         // panel p at first_row(p) * K/4: [K/4, rows] a[m, 4t..4t+3] as 4 bytes
    float* scale;       // panel p at first_row(p) * G: [G, rows] d
    float* scaled_sum;  // as scale: d * sum_k a
};

// The calling thread's buffers, grown to M x K: no allocation per call once warm.
QuantizedActivations activation_buffers(int64_t M, int64_t K) {
    thread_local std::vector<int32_t> q;
    thread_local std::vector<float> scale, scaled_sum;
    q.resize(M * K / 4);
    scale.resize(M * (K / kGroup));
    scaled_sum.resize(M * (K / kGroup));
    return {q.data(), scale.data(), scaled_sum.data()};
}

inline __m512 load16(const void* x, int64_t i, int x_bf16) {
    return x_bf16 ? bf16x16(static_cast<const uint16_t*>(x) + i) : _mm512_loadu_ps(static_cast<const float*>(x) + i);
}

// The 32 values lo, hi of one group -> its 8 quads (q[0], q[stride], ...), d, d * sum a.
void quantize_group(__m512 lo, __m512 hi, int32_t* q, int64_t stride, float* scale, float* scaled_sum) {
    // max |x| compared as integers: the same order as floats for non-NaN values, and NaN above inf, so NaN
    // reaches d (vmaxps would drop it)
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    const __m512i abs_lo = _mm512_and_si512(_mm512_castps_si512(lo), magnitude);
    const __m512i abs_hi = _mm512_and_si512(_mm512_castps_si512(hi), magnitude);
    const uint32_t bits = _mm512_reduce_max_epu32(_mm512_max_epu32(abs_lo, abs_hi));
    float amax;
    std::memcpy(&amax, &bits, 4);
    const float d = amax / 127.f;
    if (d == 0.f) {  // all zeros (or below 127 denormals): x / d would be NaN
        for (int t = 0; t < 8; ++t) q[t * stride] = 0;
        *scale = *scaled_sum = 0.f;
        return;
    }
    const __m512 vd = _mm512_set1_ps(d);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    // cvtps rounds half to even (the default MXCSR); the clamp only matters for a d rounded below amax / 127
    const __m512i a = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_div_ps(lo, vd)), top), bottom);
    const __m512i b = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_div_ps(hi, vd)), top), bottom);
    alignas(16) int32_t quads[8];
    _mm_store_si128((__m128i*)quads, _mm512_cvtepi32_epi8(a));
    _mm_store_si128((__m128i*)(quads + 4), _mm512_cvtepi32_epi8(b));
    for (int t = 0; t < 8; ++t) q[t * stride] = quads[t];
    *scale = d;
    *scaled_sum = d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(a, b)));
}

// Group j = m * G + g of x [M, K] into its pass's panel of a.
void quantize_group_at(const void* x, int x_bf16, int64_t j, int64_t M, int64_t G, const QuantizedActivations& a) {
    const int64_t m = j / G, g = j % G, p = pass_of(m, M), m0 = first_row(p, M);
    const int64_t rows = first_row(p + 1, M) - m0, r = m - m0;
    const int64_t at = m0 * G + g * rows + r;  // in scale and scaled_sum; q has 8 quads a group
    quantize_group(load16(x, j * kGroup, x_bf16), load16(x, j * kGroup + 16, x_bf16), a.q + 8 * (m0 * G + g * rows) + r,
                   rows, a.scale + at, a.scaled_sum + at);
}

// Chunk t (32 bytes: 16 rows x 2 bytes) -> per row lane the bytes q(4t), q(4t + 1), q(4t + 2), q(4t + 3).
inline __m512i unpack_chunk(const uint8_t* c) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)c));
    // (v | v << 12) & 0x0F0F0F0F in one vpternlogd: v's upper half is zero and v << 12 has nothing in bytes 0-1's
    // low nibbles, so the two never collide under the mask
    return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
}

// out[r] (16 rows of the block) for the MR activation rows of one pass, from its panels a, d, dsum.
// SPLIT int32 partial sums per row hide the vpdpbusd latency when few rows give few independent chains (exact:
// integers). The sums stay in a local array until the end: through `out` they were stored every group.
template <int MR, int SPLIT>
void q8_block(const uint8_t* codes, const uint16_t* sz, const int32_t* a, const float* d, const float* dsum,
              int64_t K, __m512* out) {
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
    for (int r = 0; r < MR; ++r) out[r] = total[r];
}

template <int MR>
void q8_block_rows(const uint8_t* codes, const uint16_t* sz, const int32_t* a, const float* d, const float* dsum,
                   int64_t K, __m512* out) {
    q8_block<MR, (MR <= 1 ? 4 : MR <= 3 ? 2 : 1)>(codes, sz, a, d, dsum, K, out);
}

template <int... MR>
void q8_block_any(int mr, const uint8_t* codes, const uint16_t* sz, const int32_t* a, const float* d,
                  const float* dsum, int64_t K, __m512* out, std::integer_sequence<int, MR...>) {
    // one call of the table of specialisations 1..kMaxRowsQ8
    using Fn = void (*)(const uint8_t*, const uint16_t*, const int32_t*, const float*, const float*, int64_t, __m512*);
    static constexpr Fn table[] = {q8_block_rows<MR + 1>...};
    table[mr - 1](codes, sz, a, d, dsum, K, out);
}

// Blocks [first, last) against all M activation rows, into out: a chunk of blocks at a time (in L2), pass by
// pass over it (the pass's panel stays in L1). Block by block with all passes each, every block wrote a line
// to each of M output rows: with M >= 64 rows of a big N that fell from ~310 to ~250 GOPS a core; a chunk
// writes each row's lines in one run.
void q8_blocks(int64_t first, int64_t last, const uint8_t* codes, const uint16_t* sz, const QuantizedActivations& a,
               int64_t M, int64_t K, int64_t N, const void* bias, void* out, int out_bf16) {
    const int64_t G = K / kGroup, chunk_size = chunk_blocks(K);
    for (int64_t chunk = first; chunk < last; chunk += chunk_size) {
        for (int64_t p = 0; p < row_passes(M); ++p) {
            const int64_t m0 = first_row(p, M);
            const int mr = int(first_row(p + 1, M) - m0);
            for (int64_t nb = chunk; nb < std::min(last, chunk + chunk_size); ++nb) {
                __m512 total[kMaxRowsQ8];
                q8_block_any(mr, codes + nb * kBlock * K / 2, sz + nb * G * 2 * kBlock, a.q + m0 * K / 4,
                             a.scale + m0 * G, a.scaled_sum + m0 * G, K, total,
                             std::make_integer_sequence<int, kMaxRowsQ8>());
                for (int r = 0; r < mr; ++r)
                    store16(total[r], bias, nb * kBlock, out, (m0 + r) * N + nb * kBlock, out_bf16);
            }
        }
    }
}

}  // namespace

extern "C" int pagellm_quant_gemv_vnni() { return 1; }

// pagellm_int4_matmul with the activations quantized to int8 (numerics above). Same arguments and layout.
extern "C" void pagellm_int4_matmul_q8(const void* x, int x_bf16, int64_t M, int64_t K, const uint8_t* codes,
                                       const uint16_t* sz, int64_t N, const void* bias, void* out, int out_bf16) {
    const QuantizedActivations a = activation_buffers(M, K);  // pointers: shared by the threads below
    const int64_t G = K / kGroup;
    // Every thread reads all rows, so quantizing in parallel costs a barrier, and a barrier (like the fork/join)
    // costs a whole scheduler time slice when another process holds a core: 16 instead of 8 ms a call on a busy
    // machine. So the quantization runs before the fork unless there is enough of it to share (~20 us alone).
    const bool shared_quantization = M * K >= (64 << 10);
    if (!shared_quantization)
        for (int64_t j = 0; j < M * G; ++j) quantize_group_at(x, x_bf16, j, M, G, a);
#pragma omp parallel if (worth_threads(N * K / 2))
    {
        if (shared_quantization) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < M * G; ++j) quantize_group_at(x, x_bf16, j, M, G, a);
        }  // the loop's barrier: all rows quantized before any block reads them
        // a contiguous share of the blocks per thread, as schedule(static), walked in chunks by q8_blocks
        const int64_t blocks = N / kBlock, t = omp_get_thread_num(), threads = omp_get_num_threads();
        q8_blocks(blocks * t / threads, blocks * (t + 1) / threads, codes, sz, a, M, K, N, bias, out, out_bf16);
    }
}

#else

extern "C" int pagellm_quant_gemv_vnni() { return 0; }  // AVX-512 BF16 without VNNI: the bf16 kernel only

#endif  // AVX-512 VNNI

#else

extern "C" int pagellm_quant_gemv_vectorized() { return 0; }
extern "C" int pagellm_quant_gemv_vnni() { return 0; }

#endif  // AVX-512 BF16
