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

#include "gguf_block_loop.h"  // gguf_blocks, store_block, HiddenEmit, down_blocks; gguf_block_rows.h
#include "norm.h"  // add_norm_rows_as: the matmul + residual add + norm epilogue

namespace {

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

// The panels of rows [m, m + M) of a, where consecutive runs of rows are each quantized as panels of their own
// (one expert's rows in pagellm_gguf_moe): every array of a run starts where the runs before it end.
inline QuantizedActivations rows_from(const QuantizedActivations& a, int64_t m, int64_t K) {
    const int64_t G = K / kGroup;
    return {a.q + m * K / 4, a.scale + m * G, a.scaled_sum + m * G, a.half_sum + 2 * m * G};
}

// Each thread's share of the experts' work units (units_per_expert each): fn(s, first, last) per expert run s.
template <class Fn>
void expert_units(int64_t runs, int64_t units_per_expert, int64_t t, int64_t threads, Fn&& fn) {
    const int64_t units = runs * units_per_expert, first = units * t / threads, last = units * (t + 1) / threads;
    for (int64_t s = first / units_per_expert; s < runs && s * units_per_expert < last; ++s) {
        const int64_t lo = std::max(first, s * units_per_expert) - s * units_per_expert;
        const int64_t hi = std::min(last, (s + 1) * units_per_expert) - s * units_per_expert;
        if (lo < hi) fn(s, lo, hi);
    }
}

// pagellm_gguf_moe's (token, expert) pairs routed here (ids in [0, X)), by expert and then token: row i of the
// step's work is pair pair[i], in expert run run[i]; run s is rows [start[s], start[s + 1]); token t's rows are
// token_rows[t * k ..] up to its count (the rest -1), ascending, so by expert id.
struct ExpertRuns {
    std::vector<int64_t> pair, run, start, token_rows;

    ExpertRuns(const int64_t* ids, int64_t T, int64_t k, int64_t X) : token_rows(T * k, -1) {
        pair.reserve(T * k);
        for (int64_t p = 0; p < T * k; ++p)
            if (ids[p] >= 0 && ids[p] < X) pair.push_back(p);
        std::stable_sort(pair.begin(), pair.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
        std::vector<int64_t> filled(T, 0);
        for (int64_t i = 0; i < int64_t(pair.size()); ++i) {
            const int64_t t = pair[i] / k;
            token_rows[t * k + filled[t]++] = i;  // ascending i: the token's rows come in expert order
            if (i == 0 || ids[pair[i]] != ids[pair[i - 1]]) start.push_back(i);
            run.push_back(int64_t(start.size()) - 1);
        }
        start.push_back(int64_t(pair.size()));
    }
    int64_t runs() const { return int64_t(start.size()) - 1; }
    int64_t rows(int64_t s) const { return start[s + 1] - start[s]; }
};

struct MoeRows {};  // thread_scratch's tag of pagellm_gguf_moe's output rows

// One parallel region for a MoE layer's routed experts: each expert's rows (its tokens' x) quantized as one
// panel, each expert's gate/up groups over its rows with HiddenEmit into their hidden rows, a barrier, each
// expert's down blocks into its rows' outputs, a barrier, then each token's rows summed in ascending expert id,
// out[t] += y * w in fp32 (two roundings each). The bits of the loop over the experts in layers/moe.py (the
// block kernels' rows do not depend on how many run together), with each expert's weights read once and no
// call per expert.
template <class F, int ACT>
void gguf_moe(const float* x, int64_t T, int64_t K, const int64_t* ids, const float* weights, int64_t k, int64_t X,
              const MoeWeights& w, float* out) {
    const ExpertRuns work(ids, T, k, X);
    const int64_t R = int64_t(work.pair.size()), G = K / kGroup, HG = w.I / kGroup, NB = w.N / kBlock;
    const QuantizedActivations a = activation_buffers(std::max<int64_t>(R, 1), K);
    const QuantizedActivations h = activation_buffers<1>(std::max<int64_t>(R, 1), w.I);
    std::vector<float>& y = thread_scratch::scratch<MoeRows, float>();
    y.resize(std::max<int64_t>(R, 1) * w.N);
    auto quantize = [&](int64_t j) {  // group j % G of row j / G, from its token's x, into its expert's panel
        const int64_t i = j / G, s = work.run[i], m = work.start[s];
        quantize_group_from(x + work.pair[i] / k * K, 0, j % G * kGroup,
                            group_slot(i - m, j % G, work.rows(s), G, rows_from(a, m, K)));
    };
    const bool shared = share_quantization(R, K);  // as q8_matmul: in the region only when there is enough of it
    if (!shared)
        for (int64_t j = 0; j < R * G; ++j) quantize(j);
#pragma omp parallel if (worth_threads(R * w.I * K))
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        if (shared) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < R * G; ++j) quantize(j);  // its barrier: every panel ready before any block
        }
        expert_units(work.runs(), HG, t, threads, [&](int64_t s, int64_t g0, int64_t g1) {
            const int64_t e = ids[work.pair[work.start[s]]], m = work.start[s], M = work.rows(s);
            HiddenEmit<float, ACT> emit{rows_from(h, m, w.I), M, w.I, nullptr, {}};
            gguf_blocks<F>(2 * g0, 2 * g1, w.qs + e * w.qs_stride, w.gp + e * w.gp_stride, w.sp + e * w.sp_stride,
                           rows_from(a, m, K), M, K, w.I / kBlock, emit);
        });
#pragma omp barrier
        with_format(w.down_format, [&](auto f) {
            expert_units(work.runs(), NB, t, threads, [&](int64_t s, int64_t b0, int64_t b1) {
                const int64_t e = ids[work.pair[work.start[s]]], m = work.start[s], M = work.rows(s);
                auto store = [&](int64_t m0, int mr, int64_t nb, const float (*total)[16], const float (*)[16]) {
                    store_block(y.data() + m * w.N, w.N, nullptr, 0, m0, mr, nb, total);
                };
                gguf_blocks<decltype(f)>(b0, b1, w.down_qs + e * w.down_qs_stride, w.down_gp + e * w.down_gp_stride,
                                         w.down_sp + e * w.down_sp_stride, rows_from(h, m, w.I), M, w.I, 0, store);
            });
        });
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * w.N; ++i) {
            const int64_t token = i / w.N, n = i % w.N;
            float acc = 0.0f;
            for (int64_t j = token * k; j < (token + 1) * k && work.token_rows[j] >= 0; ++j) {
                const int64_t r = work.token_rows[j];
                const float product = y[r * w.N + n] * weights[work.pair[r]];
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
// each expert a gated MLP as pagellm_gguf_mlp computes it over its tokens' rows (gate/up [X, 2I, K] in `format`,
// down [X, N, I] in `down_format`, expert e's arrays at e * stride bytes, no biases), the sum over j in ascending
// expert id; ids outside [0, X) are skipped. Returns 0, or -1 for an unknown format or act, or I or K not a
// positive multiple of 32, or N of 16 (nothing done).
extern "C" int pagellm_gguf_moe(const float* x, int64_t T, int64_t K, const int64_t* ids, const float* weights,
                                int64_t k, int64_t X, int format, const uint8_t* qs, const uint8_t* gp,
                                const uint8_t* sp, int64_t qs_stride, int64_t gp_stride, int64_t sp_stride, int64_t I,
                                int act, int down_format, const uint8_t* down_qs, const uint8_t* down_gp,
                                const uint8_t* down_sp, int64_t down_qs_stride, int64_t down_gp_stride,
                                int64_t down_sp_stride, int64_t N, float* out) {
    if ((act != 0 && act != 1) || !with_format(down_format, [](auto) {})) return -1;
    if (I % kGroup || K % kGroup || N % kBlock || I == 0 || K == 0 || N == 0) return -1;
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
