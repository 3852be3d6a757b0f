// Fused per-layer ops for the Llama-family decoder layers: each replaces 3-6 torch ops (and their
// allocations and dispatch, costly at decode) with one call. qkv_prepare and add_rms_norm do the arithmetic
// of the unfused kernels with the same roundings (bit-identical); act_mul rounds where torch does, but its
// exp may differ from torch's in the last ulp.
// measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md
//
//   qkv_prepare   the fused q/k/v projection's output -> q (per-head RMSNorm, rotary) for attention,
//                 k (norm, rotary) and v written straight into the paged KV cache
//   add_rms_norm  residual += [post-norm](x); out = norm(residual)   (the residual stream between blocks)
//   act_mul       act(gate) * up over the fused gate/up projection's output (silu or gelu-tanh)
//
// dtype is fp32 (is_bf16 = 0) or bf16 (is_bf16 = 1); norms as in norm.h, rotary as in rope.h.

#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "act_mul.h"  // act_mul_row
#include "exp512.h"
#include "f16.h"
#include "norm.h"
#include "rope.h"

namespace {

constexpr int64_t kMaxHeadDim = 1024;

template <typename T, int UNIT_OFFSET>
void norm_rotate(const T* x, const void* weight, float eps, const T* cos, const T* sin, T* out, int64_t dim) {
    if (weight == nullptr) return rotate_row<T>(x, cos, sin, out, dim / 2);
    T normed[kMaxHeadDim];  // the norm's output rounded to the dtype, as the unfused ops hand it on
    norm_row<sizeof(T) == 2, UNIT_OFFSET>(x, weight, normed, dim, eps);
    rotate_row<T>(normed, cos, sin, out, dim / 2);
}

// A cache row of n values from x (in the compute type T), rounded as torch's .to() where C is narrower (the
// mixed pairs: float -> bf16, float -> fp16).
inline void round_into(uint16_t* out, float x) { *out = f32_to_bf16(x); }
inline void round_into(f16* out, float x) { *out = f32_to_f16(x); }
template <typename T, typename C>
inline void to_cache(const T* x, C* out, int64_t n) {
    if constexpr (std::is_same_v<T, C>) {
        std::memcpy(out, x, n * sizeof(T));
    } else {
        int64_t i = 0;
#if defined(__F16C__)
        if constexpr (std::is_same_v<C, f16>) {  // vcvtps2ph: nearest even as f32_to_f16 (FTZ, DAZ ignored)
            for (; i + 8 <= n; i += 8)
                _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                                 _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
#endif
        for (; i < n; ++i) round_into(out + i, x[i]);
    }
}

template <typename T, typename C, int UNIT_OFFSET>
void prepare_token(const T* qkv, int64_t H, int64_t Hk, int64_t D, const void* q_weight, const void* k_weight,
                   float eps, const T* cos, const T* sin, C* key_cache, C* value_cache, int64_t slot, T* q_out) {
    for (int64_t h = 0; h < H; ++h)
        norm_rotate<T, UNIT_OFFSET>(qkv + h * D, q_weight, eps, cos, sin, q_out + h * D, D);
    const T* k = qkv + H * D;
    for (int64_t h = 0; h < Hk; ++h) {
        C* row = key_cache + (slot * Hk + h) * D;
        if constexpr (std::is_same_v<T, C>) {
            norm_rotate<T, UNIT_OFFSET>(k + h * D, k_weight, eps, cos, sin, row, D);
        } else {  // k in the compute type first, then rounded once into the cache, as the unfused ops
            T rotated[kMaxHeadDim];
            norm_rotate<T, UNIT_OFFSET>(k + h * D, k_weight, eps, cos, sin, rotated, D);
            to_cache(rotated, row, D);
        }
    }
    to_cache(k + Hk * D, value_cache + slot * Hk * D, Hk * D);
}

template <typename T, typename C, int UNIT_OFFSET>
void prepare(const T* qkv, int64_t tokens, int64_t H, int64_t Hk, int64_t D, const void* q_weight,
             const void* k_weight, float eps, const T* cos, const T* sin, C* key_cache, C* value_cache,
             const int64_t* slots, T* q_out) {
    const int64_t width = (H + 2 * Hk) * D;
#pragma omp parallel for schedule(static) if (tokens * width >= (1 << 16))
    for (int64_t t = 0; t < tokens; ++t)
        prepare_token<T, C, UNIT_OFFSET>(qkv + t * width, H, Hk, D, q_weight, k_weight, eps, cos + t * D / 2,
                                         sin + t * D / 2, key_cache, value_cache, slots[t], q_out + t * H * D);
}

template <typename T, int ACT>
void act_mul(const T* gate_up, int64_t rows, int64_t n, T* out) {
#pragma omp parallel for schedule(static) if (rows * n >= (1 << 15))
    for (int64_t r = 0; r < rows; ++r) act_mul_row<T, ACT>(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n);
}

}  // namespace

// qkv [tokens, (H + 2 Hk) D] (q heads, k heads, v heads); q/k_weight: the per-head norms (NULL: none; fp32
// when unit_offset, else the dtype); cos, sin [tokens, D/2]; caches [blocks, block_size, Hk, D] in the dtype,
// or bf16 (cache_dtype 1) or fp16 (cache_dtype 2) under fp32; slots [tokens], each below num_slots (the
// caches' blocks * block_size).
// Writes q_out [tokens, H, D] and the tokens' K/V rows. Returns 0; 1 (nothing done) for another dtype pair or
// a D too large or odd; 2 (nothing written) if a slot is out of range, as index_copy_ would refuse it.
extern "C" int pagellm_qkv_prepare(const void* qkv, int64_t tokens, int64_t H, int64_t Hk, int64_t D,
                                   const void* q_weight, const void* k_weight, float eps, int unit_offset,
                                   const void* cos, const void* sin, void* key_cache, void* value_cache,
                                   const int64_t* slots, int64_t num_slots, void* q_out, int is_bf16,
                                   int cache_dtype) {
    if (D > kMaxHeadDim || D % 2 || (is_bf16 && cache_dtype != 1) || cache_dtype < 0 || cache_dtype > 2) return 1;
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return 2;
#define PAGELLM_PREPARE(T, C, U)                                                                           \
    prepare<T, C, U>(static_cast<const T*>(qkv), tokens, H, Hk, D, q_weight, k_weight, eps,               \
                     static_cast<const T*>(cos), static_cast<const T*>(sin), static_cast<C*>(key_cache),   \
                     static_cast<C*>(value_cache), slots, static_cast<T*>(q_out))
    if (is_bf16 && unit_offset) PAGELLM_PREPARE(uint16_t, uint16_t, 1);
    else if (is_bf16) PAGELLM_PREPARE(uint16_t, uint16_t, 0);
    else if (cache_dtype == 1 && unit_offset) PAGELLM_PREPARE(float, uint16_t, 1);
    else if (cache_dtype == 1) PAGELLM_PREPARE(float, uint16_t, 0);
    else if (cache_dtype == 2 && unit_offset) PAGELLM_PREPARE(float, f16, 1);
    else if (cache_dtype == 2) PAGELLM_PREPARE(float, f16, 0);
    else if (unit_offset) PAGELLM_PREPARE(float, float, 1);
    else PAGELLM_PREPARE(float, float, 0);
#undef PAGELLM_PREPARE
    return 0;
}

// residual_out = residual + [post_norm](x); out = norm(residual_out). All [rows, dim]; post_weight NULL: none.
extern "C" void pagellm_add_rms_norm(const void* residual, const void* x, const void* post_weight,
                                     const void* weight, void* residual_out, void* out, int64_t rows, int64_t dim,
                                     float eps, int is_bf16, int unit_offset) {
    add_norm_rows_as(residual, x, post_weight, weight, residual_out, out, rows, dim, eps, is_bf16, unit_offset);
}

// out [rows, n] = act(gate_up[:, :n]) * gate_up[:, n:]; act 0 = silu, 1 = gelu (tanh approximation).
// Returns 0, at every level (identical bits at each); 1 (nothing done) only for an unknown act.
extern "C" int pagellm_act_mul(const void* gate_up, int64_t rows, int64_t n, int act, void* out, int is_bf16) {
    if (act != 0 && act != 1) return 1;
    if (is_bf16 && act == 1) act_mul<uint16_t, 1>(static_cast<const uint16_t*>(gate_up), rows, n, static_cast<uint16_t*>(out));
    else if (is_bf16) act_mul<uint16_t, 0>(static_cast<const uint16_t*>(gate_up), rows, n, static_cast<uint16_t*>(out));
    else if (act == 1) act_mul<float, 1>(static_cast<const float*>(gate_up), rows, n, static_cast<float*>(out));
    else act_mul<float, 0>(static_cast<const float*>(gate_up), rows, n, static_cast<float*>(out));
    return 0;
}
