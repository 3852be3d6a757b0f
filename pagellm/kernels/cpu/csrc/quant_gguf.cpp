// GGUF block formats x int8 activations: y[M, N] = x[M, K] W^T with W in its file's bits (gguf_format.h) and x
// quantized per row and 32-column group (q8_activations.h), as llama.cpp pairs its formats with Q8_0 / Q8_K; and
// the dequantized rows (embedding lookups), equal to the gguf package's dequantization bit for bit.
//
// Why not llama.cpp's own structure (one weight row against one activation row, a horizontal sum per block):
// the repacked layout puts 16 rows in one register per 4 columns, so an activation row's 4 codes are one
// broadcast and every instruction is 16 rows' work with no horizontal sums; with up to kMaxRowsQ8 activation
// rows per pass over the weights (12 at avx512, 10 at avx2), prefill and large batches reuse each decoded chunk
// that often (quant_gemv_q8.cpp, the same design on pagellm's int4 layout).
//
// Per row lane and group, the arithmetic and its three builds (avx512, avx2, generic; bit-identical):
// gguf_block_rows.h.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "act_mul.h"  // act_mul_row: gguf_mlp's epilogue
#include "gguf_block_rows.h"  // Panel, gguf_block_rows per level; gguf_format.h, q8_activations.h
#include "norm.h"  // add_norm_rows_as: the matmul + residual add + norm epilogue

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

struct MlpWeights {  // pagellm_gguf_mlp's arguments past x and its shape
    const uint8_t *qs, *gp, *sp;
    int64_t I;
    const void* bias;
    int down_format;
    const uint8_t *down_qs, *down_gp, *down_sp;
    int64_t N;
    const void* down_bias;
};

// One parallel region: x quantized, the gate/up blocks (groups of two) with HiddenEmit, a barrier, the down
// blocks. Each thread's hidden groups are its own; the barrier makes all of them the down matmul's input.
template <class F, typename T, int ACT>
void gguf_mlp(const void* x, int x_bf16, int64_t M, int64_t K, const MlpWeights& w, T* out) {
    const QuantizedActivations a = activation_buffers(M, K), h = activation_buffers<1>(M, w.I);
    const bool shared = share_quantization(M, K);
    if (!shared) quantize_rows(x, x_bf16, M, K, a, false);
#pragma omp parallel if (worth_threads(w.I * K))
    {
        if (shared) quantize_rows(x, x_bf16, M, K, a, true);  // its barrier: all rows ready before any block
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads(), groups = w.I / kGroup;
        HiddenEmit<T, ACT> emit{h, M, w.I, w.bias, {}};
        gguf_blocks<F>(2 * (groups * t / threads), 2 * (groups * (t + 1) / threads), w.qs, w.gp, w.sp, a, M, K,
                       w.I / kBlock, emit);
#pragma omp barrier
        down_blocks(w.down_format, w.down_qs, w.down_gp, w.down_sp, h, M, w.I, w.N, w.down_bias, out,
                    int(std::is_same_v<T, uint16_t>), t, threads);
    }
}

// pagellm_gguf_moe's stacked experts: expert e's arrays start e * stride bytes into each
struct MoeWeights {
    const uint8_t *qs, *gp, *sp;
    int64_t qs_stride, gp_stride, sp_stride, I;
    int down_format;
    const uint8_t *down_qs, *down_gp, *down_sp;
    int64_t down_qs_stride, down_gp_stride, down_sp_stride, N;
};

// Row m of a (quantized as one row, M = 1) among rows laid out one after another: pagellm_gguf_moe's rows are
// computed one at a time, as the per-token loop in layers/moe.py calls each expert with one row.
inline QuantizedActivations row_of(const QuantizedActivations& a, int64_t m, int64_t K) {
    const int64_t G = K / kGroup;
    return {a.q + m * K / 4, a.scale + m * G, a.scaled_sum + m * G, a.half_sum + 2 * m * G};
}

// Each thread's share of `units` work units, split by pair (units_per_pair each): fn(pair, first, last) on the
// pairs routed here (ids in [0, X)).
template <class Fn>
void pair_units(int64_t P, int64_t units_per_pair, const int64_t* ids, int64_t X, int64_t t, int64_t threads,
                Fn&& fn) {
    const int64_t units = P * units_per_pair, first = units * t / threads, last = units * (t + 1) / threads;
    for (int64_t p = first / units_per_pair; p < P && p * units_per_pair < last; ++p) {
        const int64_t lo = std::max(first, p * units_per_pair) - p * units_per_pair;
        const int64_t hi = std::min(last, (p + 1) * units_per_pair) - p * units_per_pair;
        if (ids[p] >= 0 && ids[p] < X && lo < hi) fn(p, lo, hi);
    }
}

// One parallel region for a MoE layer's routed experts: x's rows quantized, every pair's gate/up groups with
// HiddenEmit into its hidden row, a barrier, every pair's down blocks into its output row, a barrier, then each
// token's rows summed in ascending expert id, out[t] += y * w in fp32 (two roundings each): the bits of the
// per-token loop of pagellm_gguf_mlp-equal expert calls (layers/moe.py), in one call instead of one per expert.
template <class F, int ACT>
void gguf_moe(const float* x, int64_t T, int64_t K, const int64_t* ids, const float* weights, int64_t k, int64_t X,
              const MoeWeights& w, float* out) {
    const int64_t P = T * k, HG = w.I / kGroup, NB = w.N / kBlock;
    const QuantizedActivations a = activation_buffers(T, K), h = activation_buffers<1>(P, w.I);
    struct Rows {};
    std::vector<float>& y = thread_scratch::scratch<Rows, float>();
    y.resize(P * w.N);
    std::vector<int64_t> order(P);  // each token's pairs by ascending expert id (top-k ids are distinct)
    for (int64_t p = 0; p < P; ++p) order[p] = p;
    for (int64_t t = 0; t < T; ++t)
        std::sort(order.begin() + t * k, order.begin() + (t + 1) * k,
                  [&](int64_t i, int64_t j) { return ids[i] < ids[j]; });
    for (int64_t t = 0; t < T; ++t) quantize_rows(x + t * K, 0, 1, K, row_of(a, t, K), false);
#pragma omp parallel if (worth_threads(P * w.I * K))
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        pair_units(P, HG, ids, X, t, threads, [&](int64_t p, int64_t g0, int64_t g1) {
            HiddenEmit<float, ACT> emit{row_of(h, p, w.I), 1, w.I, nullptr, {}};
            gguf_blocks<F>(2 * g0, 2 * g1, w.qs + ids[p] * w.qs_stride, w.gp + ids[p] * w.gp_stride,
                           w.sp + ids[p] * w.sp_stride, row_of(a, p / k, K), 1, K, w.I / kBlock, emit);
        });
#pragma omp barrier
        with_format(w.down_format, [&](auto f) {
            pair_units(P, NB, ids, X, t, threads, [&](int64_t p, int64_t b0, int64_t b1) {
                auto store = [&](int64_t m0, int mr, int64_t nb, const float (*total)[16], const float (*)[16]) {
                    store_block(y.data() + p * w.N, w.N, nullptr, 0, m0, mr, nb, total);
                };
                gguf_blocks<decltype(f)>(b0, b1, w.down_qs + ids[p] * w.down_qs_stride,
                                         w.down_gp + ids[p] * w.down_gp_stride,
                                         w.down_sp + ids[p] * w.down_sp_stride, row_of(h, p, w.I), 1, w.I, 0, store);
            });
        });
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * w.N; ++i) {
            const int64_t token = i / w.N, n = i % w.N;
            float acc = 0.0f;
            for (int64_t j = token * k; j < (token + 1) * k; ++j) {
                const int64_t p = order[j];
                if (ids[p] < 0 || ids[p] >= X) continue;  // expert parallel: another rank's expert
                const float product = y[p * w.N + n] * weights[p];
                acc = acc + product;
            }
            out[i] = acc;
        }
    }
}

// Row n's dequantized weights into out[K] (fp32 or bf16): scale * (q - zero) (+ min), as the gguf package.
template <class F>
void gguf_row(const uint8_t* qs, const uint8_t* gp, const uint8_t* sp, int64_t n, int64_t K, void* out,
              int64_t offset, int out_bf16) {
    const int64_t G = K / kGroup, nb = n / kBlock;
    const int r = int(n % kBlock);
    for (int64_t g = 0; g < G; ++g) {
        const uint8_t* q = qs + (nb * G + g) * F::kGroupBytes;
        const RowScales s = row_scales<F>(gp + (nb * G + g) * F::kParamBytes, sp + (nb * (K / 256) + g / 8) * F::kSuperBytes, r);
        for (int k = 0; k < 32; ++k) {
            float v = s.scale[k / 16] * float(code_at<F>(q, r, k) - F::kZero);
            if constexpr (F::kMin) v = v + s.min;
            store_value(out, offset + g * 32 + k, v, out_bf16);
        }
    }
}

}  // namespace

// y[M, N] = x[M, K] (fp32 or bf16) W^T (+ bias), y and bias in fp32 or bf16 (out_bf16, apart from x's),
// W [N, K] in GGUF format `format` (gguf_format.h) as qs, gp, sp; row m of y at out + m * ldo (ldo >= N: one
// of several weights side by side, as a joined q/k/v whose parts the file stores in different formats).
// Returns 0, or -1 for an unknown format.
extern "C" int pagellm_gguf_matmul_q8(const void* x, int x_bf16, int64_t M, int64_t K, int format, const uint8_t* qs,
                                      const uint8_t* gp, const uint8_t* sp, int64_t N, int64_t ldo, const void* bias,
                                      void* out, int out_bf16) {
    return with_format(format, [&](auto f) {
        using F = decltype(f);
        q8_matmul(x, x_bf16, M, K, N, [&](int64_t first, int64_t last, const QuantizedActivations& a) {
            gguf_blocks<F>(first, last, qs, gp, sp, a, M, K, 0,
                           [&](int64_t m0, int mr, int64_t nb, const float (*total)[16], const float (*)[16]) {
                               store_block(out, ldo, bias, out_bf16, m0, mr, nb, total);
                           });
        });
    }) ? 0 : -1;
}

namespace {

// product(y) writes [M, N] into the calling thread's buffer y (in out's dtype), then the residual add + norm of
// (residual, y) as layer_ops.cpp's pagellm_add_rms_norm: the fused entries below. product's nonzero code is
// returned with nothing else done.
template <class Product>
int then_add_norm(int64_t M, int64_t N, Product&& product, const void* residual, const void* post_weight,
                  const void* weight, float eps, int unit_offset, void* residual_out, void* out, int out_bf16) {
    struct ProductRows {};
    std::vector<float>& y = thread_scratch::scratch<ProductRows, float>();  // fp32 words; bf16 uses the first half
    y.resize(size_t(M * N));
    if (const int code = product(y.data())) return code;
    add_norm_rows_as(residual, y.data(), post_weight, weight, residual_out, out, M, N, eps, out_bf16, unit_offset);
    return 0;
}

}  // namespace

// pagellm_gguf_matmul_q8 into y [M, N] (bias added, rounded to the residual's dtype), then layer_ops.cpp's
// pagellm_add_rms_norm of (residual, y): residual_out = residual + post(y), out = norm(residual_out), N = the
// norm's width. The bits of the two calls; y lives in a per-thread buffer, and a layer's o projection and the
// add + norm after it are one call (a decode step paid ~10 us a call for the separate one). Returns 0, or -1 for
// an unknown format.
extern "C" int pagellm_gguf_matmul_add_norm(const void* x, int x_bf16, int64_t M, int64_t K, int format,
                                            const uint8_t* qs, const uint8_t* gp, const uint8_t* sp, int64_t N,
                                            const void* bias, const void* residual, const void* post_weight,
                                            const void* weight, float eps, int unit_offset, void* residual_out,
                                            void* out, int out_bf16) {
    return then_add_norm(M, N, [&](void* y) {
        return pagellm_gguf_matmul_q8(x, x_bf16, M, K, format, qs, gp, sp, N, N, bias, y, out_bf16);
    }, residual, post_weight, weight, eps, unit_offset, residual_out, out, out_bf16);
}

// out[M, N] = (act(x W_gate^T + b_gate) * (x W_up^T + b_up)) W_down^T + b_down: a gated MLP in one call, for W
// [2I, K] the joined gate/up (gate rows first) in `format`, W_down [N, I] in `down_format`, the biases [2I] and
// [N] in out's dtype or null, act 0 = silu, 1 = gelu (tanh). The bits of pagellm_gguf_matmul_q8, pagellm_act_mul
// and pagellm_gguf_matmul_q8 again with the intermediates in out's dtype (fp32 or bf16), without storing either
// intermediate, and one parallel region for the three. Returns 0, or -1 for an unknown format or act, or I or
// K not a multiple of 32, or N of 16 (nothing done).
extern "C" int pagellm_gguf_mlp(const void* x, int x_bf16, int64_t M, int64_t K, int format, const uint8_t* qs,
                                const uint8_t* gp, const uint8_t* sp, int64_t I, const void* bias, int act,
                                int down_format, const uint8_t* down_qs, const uint8_t* down_gp,
                                const uint8_t* down_sp, int64_t N, const void* down_bias, void* out, int out_bf16) {
    if ((act != 0 && act != 1) || !with_format(down_format, [](auto) {})) return -1;
    if (I % kGroup || K % kGroup || N % kBlock) return -1;  // a group never finished would leave stale codes
    const MlpWeights w{qs, gp, sp, I, bias, down_format, down_qs, down_gp, down_sp, N, down_bias};
    return with_format(format, [&](auto f) {
        using F = decltype(f);
        if (out_bf16 && act == 1) gguf_mlp<F, uint16_t, 1>(x, x_bf16, M, K, w, static_cast<uint16_t*>(out));
        else if (out_bf16) gguf_mlp<F, uint16_t, 0>(x, x_bf16, M, K, w, static_cast<uint16_t*>(out));
        else if (act == 1) gguf_mlp<F, float, 1>(x, x_bf16, M, K, w, static_cast<float*>(out));
        else gguf_mlp<F, float, 0>(x, x_bf16, M, K, w, static_cast<float*>(out));
    }) ? 0 : -1;
}

// out[T, N] = sum over j of weights[t, j] * expert_{ids[t, j]}(x[t]) for a MoE layer's stacked experts, fp32:
// each expert a gated MLP as pagellm_gguf_mlp computes it on one row (gate/up [X, 2I, K] in `format`, down [X, N,
// I] in `down_format`, expert e's arrays at e * stride bytes, no biases), the sum over j in ascending expert id;
// ids outside [0, X) are skipped. Returns 0, or -1 for an unknown format or act, or I or K not a multiple of 32,
// or N of 16 (nothing done).
extern "C" int pagellm_gguf_moe(const float* x, int64_t T, int64_t K, const int64_t* ids, const float* weights,
                                int64_t k, int64_t X, int format, const uint8_t* qs, const uint8_t* gp,
                                const uint8_t* sp, int64_t qs_stride, int64_t gp_stride, int64_t sp_stride, int64_t I,
                                int act, int down_format, const uint8_t* down_qs, const uint8_t* down_gp,
                                const uint8_t* down_sp, int64_t down_qs_stride, int64_t down_gp_stride,
                                int64_t down_sp_stride, int64_t N, float* out) {
    if ((act != 0 && act != 1) || !with_format(down_format, [](auto) {})) return -1;
    if (I % kGroup || K % kGroup || N % kBlock) return -1;
    const MoeWeights w{qs, gp, sp, qs_stride, gp_stride, sp_stride, I, down_format, down_qs, down_gp, down_sp,
                       down_qs_stride, down_gp_stride, down_sp_stride, N};
    return with_format(format, [&](auto f) {
        if (act == 1) gguf_moe<decltype(f), 1>(x, T, K, ids, weights, k, X, w, out);
        else gguf_moe<decltype(f), 0>(x, T, K, ids, weights, k, X, w, out);
    }) ? 0 : -1;
}

// pagellm_gguf_mlp into y [M, N] (in the residual's dtype), then the residual add + norm of (residual, y) as
// pagellm_gguf_matmul_add_norm: a layer's MLP and the next layer's input norm (or the final norm) in one call,
// the bits of the two. Returns pagellm_gguf_mlp's code (nothing done but y on -1).
extern "C" int pagellm_gguf_mlp_add_norm(const void* x, int x_bf16, int64_t M, int64_t K, int format,
                                         const uint8_t* qs, const uint8_t* gp, const uint8_t* sp, int64_t I,
                                         const void* bias, int act, int down_format, const uint8_t* down_qs,
                                         const uint8_t* down_gp, const uint8_t* down_sp, int64_t N,
                                         const void* down_bias, const void* residual, const void* post_weight,
                                         const void* weight, float eps, int unit_offset, void* residual_out,
                                         void* out, int out_bf16) {
    return then_add_norm(M, N, [&](void* y) {
        return pagellm_gguf_mlp(x, x_bf16, M, K, format, qs, gp, sp, I, bias, act, down_format, down_qs, down_gp,
                                down_sp, N, down_bias, y, out_bf16);
    }, residual, post_weight, weight, eps, unit_offset, residual_out, out, out_bf16);
}

// out[T, K] = rows ids[T] of W dequantized. Returns how many ids were out of range (their rows left untouched),
// or -1 for an unknown format.
extern "C" int64_t pagellm_gguf_rows(int format, const uint8_t* qs, const uint8_t* gp, const uint8_t* sp, int64_t N,
                                     int64_t K, const int64_t* ids, int64_t T, void* out, int out_bf16) {
    int64_t bad = 0;
    const bool known = with_format(format, [&](auto f) {
        using F = decltype(f);
#pragma omp parallel for if (worth_threads(T * K)) reduction(+ : bad) schedule(static)
        for (int64_t i = 0; i < T; ++i) {
            if (ids[i] < 0 || ids[i] >= N) {
                ++bad;
                continue;
            }
            gguf_row<F>(qs, gp, sp, ids[i], K, out, i * K, out_bf16);
        }
    });
    return known ? bad : -1;
}
