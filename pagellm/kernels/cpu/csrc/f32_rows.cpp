// fp32 products y[M, N] = x[M, K] W^T (+ bias) whose row bits do not depend on M, on the row's place in the batch,
// on the thread that computes it, nor on the instruction-set level: a MoE layer's router and shared-expert gate,
// the fp32 matmuls that sit between the blocks' kernels (layers/dense.py).
//
// Why: torch's F.linear picks its kernel and blocking by M, and a row's result changes with them in the last bit
// (a step of 5 tokens, one of 17 and one alone give a token three router logits). A router's weights then differ
// too, and a token's output with the tokens beside it: after a prefix hit, in a chunk, in a verify step, where the
// engine promises the same bits. measured: docs/benchmarks/2026-11-29-xeon-amx-host.md, section 1.
//
// Each (row, output) is one chain: 16 lanes over K in order (a product, then a sum: two roundings, the same in the
// vector units of every level and in plain C++), the tail's lanes the same, and one fixed pairwise reduction of the
// lanes: written out with AVX-512 intrinsics at avx512, plain loops elsewhere, which the compiler vectorises (2 x 8
// lanes at avx2) without reordering anything (-ffp-contract=off). Tiles of 4 weight rows x 4 activation rows share
// their loads.

#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "int4_common.h"  // worth_threads
#include "row_tiles.h"

namespace {

constexpr int kLanes = 16;
constexpr int kRows = 4;  // weight rows a tile (row_tiles.h: kMaxRows activation rows)

// The lanes' fixed pairwise reduction.
inline float lane_sum(float* a) {
    for (int half = kLanes / 2; half > 0; half /= 2)
        for (int l = 0; l < half; ++l) a[l] += a[l + half];
    return a[0];
}

// sums[i * MR + r] = w_i . x_r for R weight rows and MR activation rows of K values.
template <int R, int MR>
void tile(const float* w, const float* x, int64_t K, float* sums) {
#ifdef __AVX512F__
    // The same arithmetic as the loops below, a lane a zmm lane, held in registers (GCC kept the loops' array on
    // the stack, a load and a store per update)
    __m512 acc[R][MR];
    for (int i = 0; i < R; ++i)
        for (int r = 0; r < MR; ++r) acc[i][r] = _mm512_setzero_ps();
    auto step = [&](int64_t k, __mmask16 mask) {
        __m512 wv[R];
        for (int i = 0; i < R; ++i) wv[i] = _mm512_maskz_loadu_ps(mask, w + i * K + k);
        for (int r = 0; r < MR; ++r) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * K + k);
            for (int i = 0; i < R; ++i) acc[i][r] = _mm512_add_ps(acc[i][r], _mm512_mul_ps(wv[i], xv));
        }
    };
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) step(k, __mmask16(0xFFFF));
    if (k < K) step(k, __mmask16((1u << (K - k)) - 1));  // masked lanes add 0 * 0: no value changes
    alignas(64) float a[kLanes];
    for (int i = 0; i < R; ++i)
        for (int r = 0; r < MR; ++r) {
            _mm512_store_ps(a, acc[i][r]);
            sums[i * MR + r] = lane_sum(a);
        }
#else
    float acc[R][MR][kLanes] = {};
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes)
        for (int i = 0; i < R; ++i)
            for (int r = 0; r < MR; ++r)
                for (int l = 0; l < kLanes; ++l) acc[i][r][l] += w[i * K + k + l] * x[r * K + k + l];
    for (int i = 0; i < R; ++i)
        for (int r = 0; r < MR; ++r)
            for (int l = 0; k + l < K; ++l) acc[i][r][l] += w[i * K + k + l] * x[r * K + k + l];
    for (int i = 0; i < R; ++i)
        for (int r = 0; r < MR; ++r) sums[i * MR + r] = lane_sum(acc[i][r]);
#endif
}

}  // namespace

// y[M, N] = x[M, K] W[N, K]^T (+ bias[N]), all fp32 and contiguous.
extern "C" void pagellm_f32_rows_matmul(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                                        const float* bias, float* out) {
    row_tiles<kRows>(
        M, N, worth_threads(N * K * 4),  // the weight's bytes, as bf16_gemv.cpp
        [&](auto R, auto MR, int64_t n, int64_t m0, float* sums) { tile<R, MR>(w + n * K, x + m0 * K, K, sums); },
        [&](int64_t m, int64_t n, float sum) { out[m * N + n] = bias ? sum + bias[n] : sum; });
}
