// The loop over GGUF weight blocks that quant_gguf.cpp's kernels share (the matmul, the fused MLP, a MoE layer's
// experts): blocks against quantized activation panels a chunk at a time, and the epilogues that store a block's
// sums or turn a gate/up pair of them into the down projection's quantized input.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "act_mul.h"  // act_mul_row: HiddenEmit's arithmetic
#include "gguf_block_rows.h"  // Panel, gguf_block_rows per level; gguf_format.h, q8_activations.h
#include "thread_scratch.h"

namespace {

template <class F, int... MR>
void gguf_block_any(int mr, const uint8_t* qs, const uint8_t* gp, const uint8_t* sp, const Panel& a, int64_t K,
                    float (*out)[16], std::integer_sequence<int, MR...>) {
    using Fn = void (*)(const uint8_t*, const uint8_t*, const uint8_t*, const Panel&, int64_t, float (*)[16]);
    static constexpr Fn table[] = {gguf_block_rows<F, MR + 1>...};  // specialisations 1..kMaxRowsQ8
    table[mr - 1](qs, gp, sp, a, K, out);
}

// -zero * covered_sum for every (pass, group, row, half) of a, laid out as a.half_sum: where the integer sums of
// a format with a zero point start, so that no instruction per row and group subtracts it (exact: integers).
// The calling thread's buffer; none for formats without a zero point.
template <class F>
const int32_t* zero_starts(const QuantizedActivations& a, int64_t M, int64_t G) {
    constexpr int32_t kZero = zero_point<F, kShiftedQ8>();
    if constexpr (kZero == 0) return nullptr;
    struct Starts {};
    std::vector<int32_t>& starts = thread_scratch::scratch<Starts, int32_t>();
    starts.resize(2 * M * G);
    for (int64_t i = 0; i < M * G; ++i)
        for (int h = 0; h < 2; ++h) starts[2 * i + h] = -kZero * covered_sum<F>(a.half_sum + 2 * i, h);
    return starts.data();
}

// Blocks [first, last) against all M activation rows: a chunk of blocks at a time (~256 KB, in L2), pass by pass
// over it (as quant_gemv_q8.cpp's q8_blocks, whose measurements hold here). emit(m0, mr, nb, totals, paired)
// takes each block's fp32 sums for rows m0 .. m0 + mr - 1; with pair > 0 paired holds block nb + pair's (the up
// projection's block beside the gate's, for gguf_mlp), otherwise nothing.
template <class F, class Emit>
void gguf_blocks(int64_t first, int64_t last, const uint8_t* qs, const uint8_t* gp, const uint8_t* sp,
                 const QuantizedActivations& a, int64_t M, int64_t K, int64_t pair, Emit&& emit) {
    const int64_t G = K / kGroup;
    const int64_t block_bytes = G * (F::kGroupBytes + F::kParamBytes) + K / 256 * F::kSuperBytes;
    int64_t chunk_size = std::max<int64_t>(1, (256 << 10) / (block_bytes * (pair ? 2 : 1)));
    if (pair) chunk_size += chunk_size % 2;  // a 32-column group's two blocks in one chunk (gguf_mlp)
    const int32_t* starts = zero_starts<F>(a, M, G);
    for (int64_t chunk = first; chunk < last; chunk += chunk_size) {
        for (int64_t p = 0; p < row_passes(M); ++p) {
            const int64_t m0 = first_row(p, M);
            const int mr = int(first_row(p + 1, M) - m0);
            const Panel panel{a.q + m0 * K / 4, a.scale + m0 * G, a.scaled_sum + m0 * G,
                              starts ? starts + 2 * m0 * G : nullptr};
            auto block = [&](int64_t nb, float (*total)[16]) {
                gguf_block_any<F>(mr, qs + nb * G * F::kGroupBytes, gp + nb * G * F::kParamBytes,
                                  sp + nb * (K / 256) * F::kSuperBytes, panel, K, total,
                                  std::make_integer_sequence<int, kMaxRowsQ8>());
            };
            for (int64_t nb = chunk; nb < std::min(last, chunk + chunk_size); ++nb) {
                float total[kMaxRowsQ8][16], paired[kMaxRowsQ8][16];
                block(nb, total);
                if (pair) block(nb + pair, paired);
                emit(m0, mr, nb, total, paired);
            }
        }
    }
}

// The stored output of a block's sums: v (+ bias) rounded once to out's dtype.
inline void store_block(void* out, int64_t ldo, const void* bias, int out_bf16, int64_t m0, int mr, int64_t nb,
                        const float (*total)[16]) {
    for (int r = 0; r < mr; ++r)
        for (int i = 0; i < kBlock; ++i) {
            const float v = total[r][i];
            store_value(out, (m0 + r) * ldo + nb * kBlock + i,
                        bias ? v + load_value(bias, nb * kBlock + i, out_bf16) : v, out_bf16);
        }
}

// gguf_mlp's first matmul's epilogue: the gate and up blocks stored as the plain matmul stores them (into
// 16-value rows of T, the output's type), act_mul.h's row arithmetic on those values into a 32-column scratch
// row, and each finished group (blocks 2g and 2g + 1) quantized straight into the down projection's panels: the
// bits of the separate calls, with no intermediate stored. Blocks come in pairs (gguf_blocks: even ranges and
// chunks), each pass's 2g just before its 2g + 1.
template <typename T, int ACT>
struct HiddenEmit {
    QuantizedActivations hidden;  // [M, I] as the down matmul reads its input
    int64_t M, I;
    const void* bias;  // [2I] in T, or null
    T scratch[kMaxRowsQ8][2 * kBlock];

    void operator()(int64_t m0, int mr, int64_t nb, const float (*gate)[16], const float (*up)[16]) {
        constexpr int kBf16 = std::is_same_v<T, uint16_t>;
        const T* b = static_cast<const T*>(bias);
        T g[kMaxRowsQ8][16], u[kMaxRowsQ8][16];
        store_block(g, 16, b ? b + nb * kBlock : nullptr, kBf16, 0, mr, 0, gate);
        store_block(u, 16, b ? b + I + nb * kBlock : nullptr, kBf16, 0, mr, 0, up);
        const int half = int(nb % 2);
        for (int r = 0; r < mr; ++r) act_mul_row<T, ACT>(g[r], u[r], scratch[r] + half * kBlock, kBlock);
        if (half)
            for (int r = 0; r < mr; ++r)
                quantize_group_from(scratch[r], kBf16, 0, group_slot(m0 + r, nb / 2, M, I / kGroup, hidden));
    }
};

// The down projection's share of thread t of `threads`: its blocks against the quantized hidden rows h.
inline void down_blocks(int down_format, const uint8_t* qs, const uint8_t* gp, const uint8_t* sp,
                        const QuantizedActivations& h, int64_t M, int64_t I, int64_t N, const void* bias, void* out,
                        int out_bf16, int64_t t, int64_t threads) {
    with_format(down_format, [&](auto f) {
        const int64_t count = N / kBlock;
        gguf_blocks<decltype(f)>(count * t / threads, count * (t + 1) / threads, qs, gp, sp, h, M, I, 0,
                                 [&](int64_t m0, int mr, int64_t nb, const float (*total)[16], const float (*)[16]) {
                                     store_block(out, N, bias, out_bf16, m0, mr, nb, total);
                                 });
    });
}

}  // namespace
