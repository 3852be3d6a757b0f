// 8-lane (AVX2 + FMA) math for paged_attention.cpp's AVX2 path, written to give the same bits as the
// AVX-512 code it mirrors: tanh8 is the kernel's tanh512 (checked over all 2^32 fp32 inputs), on exp512.h's
// exp256.
//
// After these helpers, the AVX2 path itself: paged_attention.cpp's inner loops for builds with AVX2 + FMA and
// no AVX-512 (paged_attention.cpp includes this header in those builds only).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_common.h"
#include "exp512.h"  // exp256: exp512's bits on 8 lanes

namespace attention_avx2 {

// tanh as the kernel's tanh512: odd Taylor series below |x| = 0.4, 1 - 2/(e^2|x| + 1) above.
inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 ax = _mm256_andnot_ps(sign, x);
    __m256 e = exp256(_mm256_min_ps(_mm256_add_ps(ax, ax), _mm256_set1_ps(88.0f)));
    __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.0f),
                               _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    __m256 x2 = _mm256_mul_ps(ax, ax);
    __m256 s = _mm256_set1_ps(-929569.0f / 638512875.0f);
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(21844.0f / 6081075.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(-1382.0f / 155925.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(62.0f / 2835.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(-17.0f / 315.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(2.0f / 15.0f));
    s = _mm256_fmadd_ps(s, x2, _mm256_set1_ps(-1.0f / 3.0f));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(s, x2), ax, ax);
    __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.4f), _CMP_LT_OQ));
    return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}

// Horizontal sums of 8 vectors in one, lane i = sum of a[i], each summed in halving order
// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)): the tree the AVX-512 path's reduce16 applies
// to the low + high halves of a 16-lane accumulator.
inline __m256 reduce8(const __m256* a) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; ++i)  // 8 -> 4 partials: a[i] in the low 128 bits, a[i + 4] in the high
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
    for (int i = 0; i < 2; ++i) {  // 4 -> 2 partials, two inputs per 128 bits
        __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
        c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
}

// Sum of 16 lanes held as (lo, hi) in the order of GCC's _mm512_reduce_add_ps: (hi + lo), then
// 128-bit halves, then lanes 2 apart, then adjacent.
inline float hsum16(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(hi, lo);
    __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// Maximum of 8 lanes (order-free for the finite values it sees).
inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// All-ones in lane i where bit i of bits (i < 8) is set.
inline __m256 lane_mask8(uint32_t bits) {
    const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(bits)), lane), lane));
}
}  // namespace attention_avx2

namespace {

using namespace attention_avx2;

// Each 16-lane accumulator of the AVX-512 path is a low and a high 8-lane half here: lane i of
// half h accumulates what lane 8h + i does there, in the same order, and the halves are summed
// (lo + hi, then the halving tree of reduce16) as reduce16 sums a zmm.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 load8(const f16* p) {  // F16C (x86-64-v3 has it): exact
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(bf16* p, __m256 x) {  // round to nearest even (outputs are finite), as store16
  __m256i u = _mm256_castps_si256(x);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}

// 16 bf16 as 8 pairs: the odd elements (2i + 1) and the even ones (2i) as fp32. The bf16 dot
// product of the AVX-512 path (vdpbf16ps) adds, per fp32 lane i, the exact product of elements
// 2i + 1 and then that of elements 2i, rounding after each: two fmas here.
inline void load_pairs(const bf16* p, __m256& odd, __m256& even) {
  __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// bf16 stays bf16 in the query buffer, as with the AVX-512 bf16 dot product: its loop is emulated.
template <typename T> struct QueryBuf { using type = float; };
template <> struct QueryBuf<bf16> { using type = bf16; };

// Half h of the accumulators of qk_tile<RB, KB> (lane i: what lane 8h + i of the zmm holds).
template <int RB, int KB, typename Q, typename K>
inline void qk_half(const Q* q, const K* const* k, int64_t D, int h, __m256* acc, const K* const* pf) {
  for (int i = 0; i < RB * KB; ++i) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  if constexpr (std::is_same_v<Q, bf16> && std::is_same_v<K, bf16>) {
    for (; d + 32 <= D; d += 32) {  // one vdpbf16ps step: elements d + 16h .. d + 16h + 15 for half h
      __m256 ko[KB], ke[KB];
      for (int j = 0; j < KB; ++j) load_pairs(k[j] + d + 16 * h, ko[j], ke[j]);
      if (pf) prefetch_line(pf, KB, d);
      for (int r = 0; r < RB; ++r) {
        __m256 qo, qe;
        load_pairs(q + r * D + d + 16 * h, qo, qe);
        for (int j = 0; j < KB; ++j) {
          acc[r * KB + j] = _mm256_fmadd_ps(qo, ko[j], acc[r * KB + j]);
          acc[r * KB + j] = _mm256_fmadd_ps(qe, ke[j], acc[r * KB + j]);
        }
      }
    }
  }
  for (; d < D; d += 16) {  // one 16-lane fma step: elements d + 8h .. d + 8h + 7
    __m256 kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = load8(k[j] + d + 8 * h);
    if (pf && (d * int64_t(sizeof(K))) % 64 == 0) prefetch_line(pf, KB, d);
    for (int r = 0; r < RB; ++r) {
      __m256 qv = load8(q + r * D + d + 8 * h);
      for (int j = 0; j < KB; ++j) acc[r * KB + j] = _mm256_fmadd_ps(qv, kv[j], acc[r * KB + j]);
    }
  }
}

// 8 dot products q_r . k_j (r < RB rows of q with stride D, j < KB key rows); lane r * KB + j.
// The two halves are separate passes: 8 accumulators (not 16) fit the 16 ymm registers.
template <int RB, int KB, typename Q, typename K>
inline __m256 qk_tile(const Q* q, const K* const* k, int64_t D, const K* const* pf) {
  static_assert(RB * KB == 8, "one ymm of results");
  __m256 lo[8], hi[8];
  qk_half<RB, KB>(q, k, D, 0, lo, pf);
  qk_half<RB, KB>(q, k, D, 1, hi, static_cast<const K* const*>(nullptr));
  for (int i = 0; i < 8; ++i) lo[i] = _mm256_add_ps(lo[i], hi[i]);
  return reduce8(lo);
}

inline void store_tile_4x2(__m256 v, float* s) {
  __m128 a = _mm256_castps256_ps128(v), b = _mm256_extractf128_ps(v, 1);
  _mm_storel_pi(reinterpret_cast<__m64*>(s), a);
  _mm_storeh_pi(reinterpret_cast<__m64*>(s + 16), a);
  _mm_storel_pi(reinterpret_cast<__m64*>(s + 32), b);
  _mm_storeh_pi(reinterpret_cast<__m64*>(s + 48), b);
}
inline void store_tile_2x4(__m256 v, float* s) {
  _mm_storeu_ps(s, _mm256_castps256_ps128(v));
  _mm_storeu_ps(s + 16, _mm256_extractf128_ps(v, 1));
}

// As the AVX-512 chunk_scores, in tiles of 8 dot products: 4 rows x 2 keys, 2 x 4, or 1 x 8.
template <typename Q, typename K>
void chunk_scores(const Q* q, int64_t R, int64_t D, const K* const* k, int c, float* s, const K* const* next_k) {
  auto pf = [&](int64_t r, int j) { return r == 0 && next_k ? next_k + j : nullptr; };
  int64_t r = 0;
  for (; r + 4 <= R; r += 4)
    for (int j = 0; j < kChunk; j += 2)
      if (j < c || pf(r, j)) store_tile_4x2(qk_tile<4, 2>(q + r * D, k + j, D, pf(r, j)), s + r * 16 + j);
  switch (R - r) {
    case 1:
      for (int j = 0; j < kChunk; j += 8)
        if (j < c || pf(r, j)) _mm256_storeu_ps(s + r * 16 + j, qk_tile<1, 8>(q + r * D, k + j, D, pf(r, j)));
      break;
    case 2:
      for (int j = 0; j < kChunk; j += 4)
        if (j < c || pf(r, j)) store_tile_2x4(qk_tile<2, 4>(q + r * D, k + j, D, pf(r, j)), s + r * 16 + j);
      break;
    case 3:  // the zero padding row makes it 4
      for (int j = 0; j < kChunk; j += 2)
        if (j < c || pf(r, j)) store_tile_4x2(qk_tile<4, 2>(q + r * D, k + j, D, pf(r, j)), s + r * 16 + j);
      break;
    default: break;
  }
}

// As the AVX-512 softmax_row; the chunk's 16 lanes as two halves.
inline void softmax_row(const float* s, uint32_t bits, float scale, float soft_cap, float& m, float& l,
                        float* p, float& alpha) {
  if (!bits) {
    _mm256_storeu_ps(p, _mm256_setzero_ps());
    _mm256_storeu_ps(p + 8, _mm256_setzero_ps());
    alpha = 1.0f;
    return;
  }
  const __m256 valid0 = lane_mask8(bits), valid1 = lane_mask8(bits >> 8);
  const __m256 sc = _mm256_set1_ps(scale);
  __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(s), sc), x1 = _mm256_mul_ps(_mm256_loadu_ps(s + 8), sc);
  if (soft_cap > 0.0f) {
    __m256 cap = _mm256_set1_ps(soft_cap);
    x0 = _mm256_mul_ps(tanh8(_mm256_div_ps(x0, cap)), cap);
    x1 = _mm256_mul_ps(tanh8(_mm256_div_ps(x1, cap)), cap);
  }
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  float chunk_max = hmax8(_mm256_max_ps(_mm256_blendv_ps(ninf, x0, valid0), _mm256_blendv_ps(ninf, x1, valid1)));
  float m_new = std::max(m, chunk_max);
  alpha = m_new == m ? 1.0f : std::exp(m - m_new);  // m = -inf on the first chunk: alpha = 0
  __m256 mn = _mm256_set1_ps(m_new);
  __m256 e0 = _mm256_and_ps(valid0, exp256(_mm256_sub_ps(x0, mn)));
  __m256 e1 = _mm256_and_ps(valid1, exp256(_mm256_sub_ps(x1, mn)));
  l = l * alpha + hsum16(e0, e1);
  m = m_new;
  _mm256_storeu_ps(p, e0);
  _mm256_storeu_ps(p + 8, e1);
}

// acc[i] = acc[i] * alpha[i] + sum_j p[i][j] v_j for NR rows, 16 columns (two ymm) per step.
template <int NR, typename V>
inline void pv_rows(float* acc, const float* p, const float* alpha, const V* const* v, int c, int64_t D,
                    const V* const* pf) {
  __m256 scale[NR];
  for (int i = 0; i < NR; ++i) scale[i] = _mm256_set1_ps(alpha[i]);
  for (int64_t d = 0; d < D; d += 16) {
    __m256 a[NR][2];
    for (int i = 0; i < NR; ++i) {
      a[i][0] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + d), scale[i]);
      a[i][1] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + d + 8), scale[i]);
    }
    if (pf && (d * int64_t(sizeof(V))) % 64 == 0) prefetch_line(pf, kChunk, d);
    for (int j = 0; j < c; ++j) {
      __m256 v0 = load8(v[j] + d), v1 = load8(v[j] + d + 8);
      for (int i = 0; i < NR; ++i) {
        __m256 w = _mm256_broadcast_ss(p + i * kChunk + j);
        a[i][0] = _mm256_fmadd_ps(w, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(w, v1, a[i][1]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      _mm256_storeu_ps(acc + i * D + d, a[i][0]);
      _mm256_storeu_ps(acc + i * D + d + 8, a[i][1]);
    }
  }
}

template <typename V>
void chunk_values(float* acc, const float* p, const float* alpha, int64_t R, int64_t D, const V* const* v, int c,
                  const V* const* next_v) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) pv_rows<4>(acc + r * D, p + r * kChunk, alpha + r, v, c, D, r == 0 ? next_v : nullptr);
  float* a = acc + r * D;
  const float* pr = p + r * kChunk;
  const float* al = alpha + r;
  const V* const* pf = r == 0 ? next_v : nullptr;
  switch (R - r) {
    case 1: pv_rows<1>(a, pr, al, v, c, D, pf); break;
    case 2: pv_rows<2>(a, pr, al, v, c, D, pf); break;
    case 3: pv_rows<3>(a, pr, al, v, c, D, pf); break;
    default: break;
  }
}

template <typename T>
inline void store_row(T* dst, const float* acc, float inv, int64_t D) {
  __m256 s = _mm256_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 8) store8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), s));
}

}  // namespace
#endif  // __AVX2__ && __FMA__
