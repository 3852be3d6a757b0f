// Gated DeltaNet decode step for CPU, in place on the bound state tensors by slot index.
//
// Why: torch can only read state[slots] for scattered slots by gathering them into a
// batch copy ([B, Hv, dk, dv] fp32, 2 MiB per request-layer at Hv=32, dk=dv=128) and
// writing it back with index_copy_. Here each (request, head) reads and writes its own
// slot's matrix through a pointer, so the state is touched exactly twice (one read
// pass, one read-modify-write pass) and nothing is copied.
//
// Two entry points, each one call per layer per decode step:
//   pagellm_gdn_conv_decode:  causal depthwise conv + SiLU over [conv_state[s] | x], then
//                             x shifted into conv_state[s] (fp32 or bf16, as the layer).
//   pagellm_gdn_rule_decode:  the gated delta rule on recurrent_state[s, h] (fp32, or bf16: widened as loaded,
//                             rounded as stored, the fp32 arithmetic between, as the torch reference does; half
//                             the bytes read and written per step).
//
// The rule follows pagellm/kernels/gated_delta.py:gated_delta_step_ operation by operation
// (so the two agree to fp32 rounding):
//   read_k = Sᵀk, read_q = Sᵀq                (old S, one pass)
//   delta  = beta * (v - e^g read_k)
//   o      = e^g read_q + (k·q) delta         (= S'ᵀq without a third pass)
//   S'     = e^g S + k ⊗ delta                (second pass)
//
// Levels: the AVX-512 (16 lanes), AVX2 + FMA (8 lanes) and plain C++ builds do the same operations
// in the same order with the same roundings (each read an fma chain over i = 0..dk-1 per column; each
// update one rounded product then one fma; the SiLU's exp from exp512.h, bit-identical at every width),
// so every build gives the same bits as the AVX-512 one. The price is in the generic x86-64 build, which
// has no FMA instruction: its fmas are emulated (fma_f32.h), so its rule runs several times slower
// than separately rounded a * b + c loops did (which the compiler vectorizes; they differ from the fma
// chains by a few fp32 ulp per step).
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"
#include "exp512.h"  // exp512 / exp256 / exp_scalar (and <immintrin.h> where there are vectors)
#include "fma_f32.h"

namespace {


template <int IS_BF16>
inline float load(const void* p, int64_t i) {
    return IS_BF16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

template <int IS_BF16>
inline float round_to(float v) { return IS_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

template <int IS_BF16>
inline void store(void* p, int64_t i, float v) {
    if (IS_BF16)
        static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
    else
        static_cast<float*>(p)[i] = v;
}

// ---- conv -------------------------------------------------------------------------

// silu over n values in place, the same bits at every width.
void silu_inplace(float* x, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_storeu_ps(x + i, _mm512_div_ps(v, _mm512_add_ps(one, e)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_storeu_ps(x + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
#endif
    for (; i < n; i += 8) {  // x / (1 + e^-x), 8 (or fewer) side by side
        const int m = n - i < 8 ? int(n - i) : 8;
        float arg[8], e[8];
        for (int l = 0; l < m; ++l) arg[l] = 0.f - x[i + l];
        if (m == 8)
            exp_lanes<8>(arg, e);
        else
            for (int l = 0; l < m; ++l) e[l] = exp_scalar(arg[l]);
        for (int l = 0; l < m; ++l) x[i + l] = x[i + l] / (1.f + e[l]);
    }
}

constexpr int64_t CONV_BLOCK = 512;  // channels per work item: small enough to split 8192 channels

// Channels [lo, hi) of one request: pre = sum_j w[c, j] window[c, j] over window = [state
// (K-1) | x], rounded to the model dtype before and after the SiLU as the torch path does;
// then x is shifted into the state.
template <int IS_BF16>
void conv_block(void* state, int64_t state_base, const void* x, const void* w, void* out, int64_t out_base,
                int64_t lo, int64_t hi, int64_t taps) {
    float pre[CONV_BLOCK];
    const int64_t hist = taps - 1;
    for (int64_t c = lo; c < hi; ++c) {
        const int64_t s = state_base + c * hist;
        float acc = 0.f;
        for (int64_t j = 0; j < hist; ++j) acc += load<IS_BF16>(state, s + j) * load<IS_BF16>(w, c * taps + j);
        const float xc = load<IS_BF16>(x, out_base + c);
        pre[c - lo] = round_to<IS_BF16>(acc + xc * load<IS_BF16>(w, c * taps + hist));
        for (int64_t j = 0; j + 1 < hist; ++j) store<IS_BF16>(state, s + j, load<IS_BF16>(state, s + j + 1));
        if (hist > 0) store<IS_BF16>(state, s + hist - 1, xc);
    }
    silu_inplace(pre, hi - lo);
    for (int64_t c = lo; c < hi; ++c) store<IS_BF16>(out, out_base + c, pre[c - lo]);
}

template <int IS_BF16>
void conv_decode(void* conv_state, const int64_t* slots, const void* x, const void* weight, void* out,
                 int64_t batch, int64_t channels, int64_t taps) {
    const int64_t blocks = (channels + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel for schedule(static) if (batch * channels >= 4096)
    for (int64_t i = 0; i < batch * blocks; ++i) {
        const int64_t b = i / blocks, lo = (i % blocks) * CONV_BLOCK, hi = std::min(lo + CONV_BLOCK, channels);
        conv_block<IS_BF16>(conv_state, slots[b] * channels * (taps - 1), x, weight, out, b * channels, lo, hi,
                            taps);
    }
}

// ---- rule -------------------------------------------------------------------------
// The state's cells are fp32, or bf16 (BF16 = 1): widened as they are loaded and rounded to nearest even as they
// are stored (as f32_to_bf16, NaN kept quiet), inside the same passes, so a bf16 state costs half the bytes and
// no pass more; the arithmetic between is the fp32 state's, bit for bit.

// read_k[j] = sum_i k[i] S[i, j], read_q likewise, for columns [lo, dv): per column an fma chain from 0
// over i = 0..dk-1, as each vector lane does.
template <int BF16>
void read_scalar(const void* S, const float* k, const float* q, int64_t dk, int64_t dv, int64_t lo,
                 float* read_k, float* read_q) {
    for (int64_t j = lo; j < dv; ++j) read_k[j] = read_q[j] = 0.f;
    for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = lo; j < dv; ++j) {
            const float s = load<BF16>(S, i * dv + j);
            read_k[j] = fma_f32(k[i], s, read_k[j]);
            read_q[j] = fma_f32(q[i], s, read_q[j]);
        }
}

// S = fma(k[i], delta[j], S * decay), as each vector lane does.
template <int BF16>
void update_scalar(void* S, const float* k, const float* delta, float decay, int64_t dk, int64_t dv, int64_t lo) {
    for (int64_t i = 0; i < dk; ++i)
        for (int64_t j = lo; j < dv; ++j)
            store<BF16>(S, i * dv + j, fma_f32(k[i], delta[j], load<BF16>(S, i * dv + j) * decay));
}

#ifdef __AVX512F__
template <int BF16>
inline __m512 load16(const void* S, int64_t at) {
    if (!BF16) return _mm512_loadu_ps(static_cast<const float*>(S) + at);
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(S) + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

template <int BF16>
inline void store16(void* S, int64_t at, __m512 v) {
    if (!BF16) return _mm512_storeu_ps(static_cast<float*>(S) + at, v);
    const __m512i u = _mm512_castps_si512(v), high = _mm512_srli_epi32(u, 16);
    const __m512i even = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, even), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(S) + at), _mm512_cvtepi32_epi16(r));
}

// Columns in tiles of 64: 4 + 4 zmm accumulators give 8 independent FMA chains (enough
// to hide the FMA latency on both ports) while streaming the tile's rows of S once.
constexpr int64_t TILE = 64;

template <int BF16>
int64_t read_vectors(const void* S, const float* k, const float* q, int64_t dk, int64_t dv, float* read_k,
                     float* read_q) {
    int64_t lo = 0;
    for (; lo + TILE <= dv; lo += TILE) {
        __m512 ak[4], aq[4];
        for (int t = 0; t < 4; ++t) ak[t] = aq[t] = _mm512_setzero_ps();
        for (int64_t i = 0; i < dk; ++i) {
            const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
            for (int t = 0; t < 4; ++t) {
                const __m512 s = load16<BF16>(S, i * dv + lo + 16 * t);
                ak[t] = _mm512_fmadd_ps(ki, s, ak[t]);
                aq[t] = _mm512_fmadd_ps(qi, s, aq[t]);
            }
        }
        for (int t = 0; t < 4; ++t) {
            _mm512_storeu_ps(read_k + lo + 16 * t, ak[t]);
            _mm512_storeu_ps(read_q + lo + 16 * t, aq[t]);
        }
    }
    return lo;  // columns [lo, dv) are left to the scalar loop
}

template <int BF16>
int64_t update_vectors(void* S, const float* k, const float* delta, float decay, int64_t dk, int64_t dv) {
    const int64_t whole = dv - dv % 16;
    const __m512 d = _mm512_set1_ps(decay);
    for (int64_t i = 0; i < dk; ++i) {
        const __m512 ki = _mm512_set1_ps(k[i]);
        for (int64_t j = 0; j < whole; j += 16) {
            const __m512 s = _mm512_mul_ps(load16<BF16>(S, i * dv + j), d);
            store16<BF16>(S, i * dv + j, _mm512_fmadd_ps(ki, _mm512_loadu_ps(delta + j), s));
        }
    }
    return whole;
}
#elif defined(__AVX2__) && defined(__FMA__)
template <int BF16>
inline __m256 load8(const void* S, int64_t at) {
    if (!BF16) return _mm256_loadu_ps(static_cast<const float*>(S) + at);
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(S) + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

template <int BF16>
inline void store8(void* S, int64_t at, __m256 v) {
    if (!BF16) return _mm256_storeu_ps(static_cast<float*>(S) + at, v);
    const __m256i u = _mm256_castps_si256(v), high = _mm256_srli_epi32(u, 16);
    const __m256i even = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, even), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(high, _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // each 32-bit lane holds its 16 bits: pack them (no lane exceeds 0xffff), then the two halves' lows together
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(S) + at), _mm256_castsi256_si128(packed));
}

// Columns in tiles of 32 (4 + 4 ymm accumulators: 8 independent FMA chains in 16 registers), then of 8.
constexpr int64_t TILE = 32;

template <int BF16, int W>  // W ymm columns-groups per tile (4: 32 columns, 1: 8)
inline void read_tile_avx2(const void* S, const float* k, const float* q, int64_t dk, int64_t dv, int64_t lo,
                           float* read_k, float* read_q) {
    __m256 ak[W], aq[W];
    for (int t = 0; t < W; ++t) ak[t] = aq[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {
        const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
        for (int t = 0; t < W; ++t) {
            const __m256 s = load8<BF16>(S, i * dv + lo + 8 * t);
            ak[t] = _mm256_fmadd_ps(ki, s, ak[t]);
            aq[t] = _mm256_fmadd_ps(qi, s, aq[t]);
        }
    }
    for (int t = 0; t < W; ++t) {
        _mm256_storeu_ps(read_k + lo + 8 * t, ak[t]);
        _mm256_storeu_ps(read_q + lo + 8 * t, aq[t]);
    }
}

template <int BF16>
int64_t read_vectors(const void* S, const float* k, const float* q, int64_t dk, int64_t dv, float* read_k,
                     float* read_q) {
    int64_t lo = 0;
    for (; lo + TILE <= dv; lo += TILE) read_tile_avx2<BF16, 4>(S, k, q, dk, dv, lo, read_k, read_q);
    for (; lo + 8 <= dv; lo += 8) read_tile_avx2<BF16, 1>(S, k, q, dk, dv, lo, read_k, read_q);
    return lo;  // columns [lo, dv) are left to the scalar loop
}

template <int BF16>
int64_t update_vectors(void* S, const float* k, const float* delta, float decay, int64_t dk, int64_t dv) {
    const int64_t whole = dv - dv % 8;
    const __m256 d = _mm256_set1_ps(decay);
    for (int64_t i = 0; i < dk; ++i) {
        const __m256 ki = _mm256_set1_ps(k[i]);
        for (int64_t j = 0; j < whole; j += 8) {
            const __m256 s = _mm256_mul_ps(load8<BF16>(S, i * dv + j), d);
            store8<BF16>(S, i * dv + j, _mm256_fmadd_ps(ki, _mm256_loadu_ps(delta + j), s));
        }
    }
    return whole;
}
#else
template <int BF16>
int64_t read_vectors(const void*, const float*, const float*, int64_t, int64_t, float*, float*) { return 0; }

template <int BF16>
int64_t update_vectors(void*, const float*, const float*, float, int64_t, int64_t) { return 0; }
#endif

float dot(const float* a, const float* b, int64_t n) {
    float total = 0.f;
    for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
    return total;
}

// One (request, value head): S [dk, dv] in place; q, k [dk]; v, o [dv]; scratch [3 * dv].
template <int BF16>
void rule_head(void* S, const float* q, const float* k, const float* v, float g, float beta, float* o,
               int64_t dk, int64_t dv, float* scratch) {
    float *read_k = scratch, *read_q = scratch + dv, *delta = scratch + 2 * dv;
    const int64_t read = read_vectors<BF16>(S, k, q, dk, dv, read_k, read_q);
    if (read < dv) read_scalar<BF16>(S, k, q, dk, dv, read, read_k, read_q);
    const float decay = std::exp(g), kq = dot(k, q, dk);
    for (int64_t j = 0; j < dv; ++j) {
        delta[j] = beta * (v[j] - decay * read_k[j]);
        o[j] = decay * read_q[j] + kq * delta[j];
    }
    const int64_t updated = update_vectors<BF16>(S, k, delta, decay, dk, dv);
    if (updated < dv) update_scalar<BF16>(S, k, delta, decay, dk, dv, updated);
}

template <int BF16>
void rule_decode(void* state, const int64_t* slots, const float* q, const float* k, const float* v, const float* g,
                 const float* beta, float* out, int64_t batch, int64_t k_heads, int64_t v_heads, int64_t dk,
                 int64_t dv) {
    const int64_t ratio = v_heads / k_heads;
    using Cell = typename std::conditional<BF16, uint16_t, float>::type;
    // One head is ~dk*dv*2 FMAs; fork only when there is more than a couple of heads' work.
#pragma omp parallel if (batch * v_heads > 1)
    {
        float* scratch = new float[3 * dv];
#pragma omp for schedule(static)
        for (int64_t i = 0; i < batch * v_heads; ++i) {
            const int64_t b = i / v_heads, h = i % v_heads, kh = b * k_heads + h / ratio;
            Cell* S = static_cast<Cell*>(state) + (slots[b] * v_heads + h) * dk * dv;
            rule_head<BF16>(S, q + kh * dk, k + kh * dk, v + i * dv, g[i], beta[i], out + i * dv, dk, dv, scratch);
        }
        delete[] scratch;
    }
}

}  // namespace

extern "C" {

// conv_state [S, C, K-1] (updated in place for the given slots only), x / out [B, C],
// weight [C, K], all in the model dtype (fp32 or bf16) and contiguous.
void pagellm_gdn_conv_decode(void* conv_state, const int64_t* slots, const void* x, const void* weight, void* out,
                             int64_t batch, int64_t channels, int64_t taps, int is_bf16) {
    if (is_bf16)
        conv_decode<1>(conv_state, slots, x, weight, out, batch, channels, taps);
    else
        conv_decode<0>(conv_state, slots, x, weight, out, batch, channels, taps);
}

// state [S, Hv, dk, dv] fp32 or bf16 (state_bf16; updated in place for the given slots only); q, k [B, Hk, dk]
// fp32 (normalised / scaled; value head h reads key head h / (Hv / Hk)); v, out [B, Hv, dv];
// g, beta [B, Hv]; all but the state fp32, all contiguous.
void pagellm_gdn_rule_decode(void* state, const int64_t* slots, const float* q, const float* k, const float* v,
                             const float* g, const float* beta, float* out, int64_t batch, int64_t k_heads,
                             int64_t v_heads, int64_t dk, int64_t dv, int state_bf16) {
    if (state_bf16)
        rule_decode<1>(state, slots, q, k, v, g, beta, out, batch, k_heads, v_heads, dk, dv);
    else
        rule_decode<0>(state, slots, q, k, v, g, beta, out, batch, k_heads, v_heads, dk, dv);
}

}  // extern "C"
