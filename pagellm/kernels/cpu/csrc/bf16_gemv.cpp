// Dense bf16 products y[M, N] = x[M, K] W^T (+ bias) for a few activation rows (a decode step of a few requests,
// a verify step's drafts), W the checkpoint's own [N, K] bf16 rows, read in place.
//
// Why: a step of a few rows streams every weight once, so it is bound by memory bandwidth. torch's bf16 matmul on
// a CPU reaches the bandwidth at one row (its gemv), not at two to four, where it takes its GEMM and pays more
// than the bytes it reads: a verify step of a few drafts, or a decode step of a few requests, costs more than it
// reads. bf16_gemv.py's MAX_ROWS says where torch's GEMM takes over.
// measured: docs/benchmarks/2026-11-29-xeon-amx-host.md
//
// kRows weight rows at a time (several streams keep DRAM busier than one), each against up to kMaxRows activation
// rows per pass: every product exact in fp32 (vdpbf16ps, denormals flushed), per (weight row, activation row) 16
// lane sums over K in order and one fixed reduction, the bias added, one rounding into the output dtype. A row's
// result is thus the same bits whatever M is, wherever it sits in the batch and whichever thread computes it: a
// verify step's rows are the decode steps'.

#include <algorithm>
#include <cstdint>

#include "int4_common.h"
#include "row_tiles.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kRows = 6;  // weight rows per tile: 6 x 4 accumulators, 6 weight loads and 1 x load in flight

inline __m512 dot(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }

// sums[i * MR + r] = w_i . x_r for R weight rows and MR activation rows of K values; the last K % 32 columns
// read through a mask (as zeros, which leave a sum's bits as they are).
template <int R, int MR>
void tile(const uint16_t* w, const uint16_t* x, int64_t K, float* sums) {
    __m512 acc[R][MR];
    for (int i = 0; i < R; ++i)
        for (int r = 0; r < MR; ++r) acc[i][r] = _mm512_setzero_ps();
    auto step = [&](int64_t k, __mmask32 mask) {
        __m512i wv[R];
        for (int i = 0; i < R; ++i) {
            // the next tile's row at this column, into L2: a distance within the row measured slower where rows
            // are short (a vocabulary head of 2048 columns) and as fast elsewhere. Past the last row it is only a
            // hint (a prefetch never faults); the address is formed as an integer, never as a pointer past the end.
            _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w + i * K + k) + 2 * R * K),
                         _MM_HINT_T1);
            wv[i] = _mm512_maskz_loadu_epi16(mask, w + i * K + k);
        }
        for (int r = 0; r < MR; ++r) {
            const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + r * K + k);
            for (int i = 0; i < R; ++i) acc[i][r] = dot(acc[i][r], wv[i], xv);
        }
    };
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) step(k, ~__mmask32(0));
    if (k < K) step(k, __mmask32((1u << (K - k)) - 1));
    for (int i = 0; i < R; ++i)
        for (int r = 0; r < MR; ++r) sums[i * MR + r] = _mm512_reduce_add_ps(acc[i][r]);
}

}  // namespace

extern "C" int pagellm_bf16_gemv_vectorized() { return 1; }

// y[M, N] = x[M, K] W[N, K]^T (+ bias[N]); x, W and bias bf16, out bf16 or fp32 (out_bf16), all contiguous.
extern "C" void pagellm_bf16_matmul(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                                    const uint16_t* bias, void* out, int out_bf16) {
    row_tiles<kRows>(
        M, N, worth_threads(N * K * 2),
        [&](auto R, auto MR, int64_t n, int64_t m0, float* sums) { tile<R, MR>(w + n * K, x + m0 * K, K, sums); },
        [&](int64_t m, int64_t n, float sum) {
            store_value(out, m * N + n, sum + (bias ? bf16_to_f32(bias[n]) : 0.f), out_bf16);
        });
}

#else

extern "C" int pagellm_bf16_gemv_vectorized() { return 0; }

#endif  // AVX-512 BF16
