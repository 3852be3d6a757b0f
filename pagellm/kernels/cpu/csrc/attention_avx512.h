// paged_attention.cpp's inner loops for AVX-512 builds (__AVX512F__): 16-lane zmm; bf16 dot products with
// vdpbf16ps (__AVX512BF16__). paged_attention.cpp includes this header in those builds only.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_common.h"
#include "exp512.h"

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {  // bf16 -> fp32 is a 16-bit shift into the high half
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 load16(const f16* p) {  // F16C (x86-64-v4 has it): exact
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(bf16* p, __m512 x) {  // round to nearest even (outputs are finite)
  __m512i u = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}


// tanh: odd Taylor series below |x| = 0.4 (where 1 - 2/(e^2x + 1) would cancel), that form above.
inline __m512 tanh512(__m512 x) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  __m512 ax = _mm512_andnot_ps(sign, x);
  __m512 e = exp512(_mm512_min_ps(_mm512_add_ps(ax, ax), _mm512_set1_ps(88.0f)));
  __m512 big = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                             _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  __m512 x2 = _mm512_mul_ps(ax, ax);
  __m512 s = _mm512_set1_ps(-929569.0f / 638512875.0f);
  s = _mm512_fmadd_ps(s, x2, _mm512_set1_ps(21844.0f / 6081075.0f));
  s = _mm512_fmadd_ps(s, x2, _mm512_set1_ps(-1382.0f / 155925.0f));
  s = _mm512_fmadd_ps(s, x2, _mm512_set1_ps(62.0f / 2835.0f));
  s = _mm512_fmadd_ps(s, x2, _mm512_set1_ps(-17.0f / 315.0f));
  s = _mm512_fmadd_ps(s, x2, _mm512_set1_ps(2.0f / 15.0f));
  s = _mm512_fmadd_ps(s, x2, _mm512_set1_ps(-1.0f / 3.0f));
  __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(s, x2), ax, ax);
  __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.4f), _CMP_LT_OQ), big, small);
  return _mm512_or_ps(t, _mm512_and_ps(x, sign));
}

// Horizontal sums of 16 vectors in one: lane i = sum of a[i]. A transpose-and-add tree
// (45 shuffles/adds for 16 sums instead of ~8 per _mm512_reduce_add_ps). The tree leaves
// lane i holding the sum of input kPerm[i]; kPerm is an involution, so feeding input i
// from a[kPerm[i]] puts sum(a[i]) in lane i.
inline __m512 reduce16(const __m512* a) {
  constexpr int kPerm[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  __m512 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i) {  // 512 -> 256 lanes per sum: a[i] in chunks 0-1, a[i+8] in 2-3
    __m512 x = a[kPerm[i]], y = a[kPerm[i + 8]];
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // 256 -> 128: chunk k of d[i] holds one input's 4 partials
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[i], c[i + 4], 0x88), _mm512_shuffle_f32x4(c[i], c[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i) {  // 4 -> 2 partials per input, two inputs per 128-bit chunk
    __m512d x = _mm512_castps_pd(d[i]), y = _mm512_castps_pd(d[i + 2]);
    e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
}

// The query buffer holds bf16 as is when the CPU has a bf16 dot product (products of two
// bf16 are exact in fp32), fp32 otherwise.
template <typename T> struct QueryBuf { using type = float; };
#ifdef __AVX512BF16__
template <> struct QueryBuf<bf16> { using type = bf16; };
#endif

// 16 dot products q_r . k_j (r < RB rows of q with stride D, j < KB key rows); lane r * KB + j.
// pf: KB rows to prefetch alongside, or null.
template <int RB, int KB, typename Q, typename K>
inline __m512 qk_tile(const Q* q, const K* const* k, int64_t D, const K* const* pf) {
  static_assert(RB * KB == 16, "one zmm of results");
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  int64_t d = 0;
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<Q, bf16> && std::is_same_v<K, bf16>) {
    for (; d + 32 <= D; d += 32) {  // 32 bf16 products per instruction, pairs summed in fp32
      __m512bh kv[KB];
      for (int j = 0; j < KB; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(k[j] + d);
      if (pf) prefetch_line(pf, KB, d);
      for (int r = 0; r < RB; ++r) {
        __m512bh qv = (__m512bh)_mm512_loadu_si512(q + r * D + d);
        for (int j = 0; j < KB; ++j) acc[r * KB + j] = _mm512_dpbf16_ps(acc[r * KB + j], qv, kv[j]);
      }
    }
  }
#endif
  for (; d < D; d += 16) {
    __m512 kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = load16(k[j] + d);
    if (pf && (d * int64_t(sizeof(K))) % 64 == 0) prefetch_line(pf, KB, d);
    for (int r = 0; r < RB; ++r) {
      __m512 qv = load16(q + r * D + d);
      for (int j = 0; j < KB; ++j) acc[r * KB + j] = _mm512_fmadd_ps(qv, kv[j], acc[r * KB + j]);
    }
  }
  return reduce16(acc);
}

// Scatter a tile's lanes into the score rows s[r * 16 + j].
inline void store_tile_4x4(__m512 v, float* s) {
  _mm_storeu_ps(s, _mm512_extractf32x4_ps(v, 0));
  _mm_storeu_ps(s + 16, _mm512_extractf32x4_ps(v, 1));
  _mm_storeu_ps(s + 32, _mm512_extractf32x4_ps(v, 2));
  _mm_storeu_ps(s + 48, _mm512_extractf32x4_ps(v, 3));
}
inline void store_tile_2x8(__m512 v, float* s) {
  _mm256_storeu_ps(s, _mm512_castps512_ps256(v));
  _mm256_storeu_ps(s + 16, _mm512_extractf32x8_ps(v, 1));
}

// Raw scores s[r * 16 + j] = q_r . k_j for the R rows and the chunk's c keys. k holds 16
// readable row pointers (padded past c); q has R rounded up to 4 rows, the extra ones zero.
// next_k: the next chunk's 16 K rows, prefetched during the first row block (or null).
template <typename Q, typename K>
void chunk_scores(const Q* q, int64_t R, int64_t D, const K* const* k, int c, float* s, const K* const* next_k) {
  auto pf = [&](int64_t r, int j) { return r == 0 && next_k ? next_k + j : nullptr; };
  int64_t r = 0;
  for (; r + 4 <= R; r += 4)
    for (int j = 0; j < kChunk; j += 4)
      if (j < c || pf(r, j)) store_tile_4x4(qk_tile<4, 4>(q + r * D, k + j, D, pf(r, j)), s + r * 16 + j);
  switch (R - r) {
    case 1: _mm512_storeu_ps(s + r * 16, qk_tile<1, 16>(q + r * D, k, D, pf(r, 0))); break;
    case 2:
      for (int j = 0; j < kChunk; j += 8)
        if (j < c || pf(r, j)) store_tile_2x8(qk_tile<2, 8>(q + r * D, k + j, D, pf(r, j)), s + r * 16 + j);
      break;
    case 3:  // the zero padding row makes it 4
      for (int j = 0; j < kChunk; j += 4)
        if (j < c || pf(r, j)) store_tile_4x4(qk_tile<4, 4>(q + r * D, k + j, D, pf(r, j)), s + r * 16 + j);
      break;
    default: break;
  }
}

// Fold one row's chunk of scores into its running (max m, sum l); leave its probabilities in
// p and the factor its accumulator must be rescaled by in alpha.
inline void softmax_row(const float* s, uint32_t bits, float scale, float soft_cap, float& m, float& l,
                        float* p, float& alpha) {
  __mmask16 valid = __mmask16(bits);
  if (!valid) {
    _mm512_storeu_ps(p, _mm512_setzero_ps());
    alpha = 1.0f;
    return;
  }
  __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s), _mm512_set1_ps(scale));
  if (soft_cap > 0.0f) {
    __m512 cap = _mm512_set1_ps(soft_cap);
    x = _mm512_mul_ps(tanh512(_mm512_div_ps(x, cap)), cap);
  }
  float chunk_max = _mm512_mask_reduce_max_ps(valid, x);
  float m_new = std::max(m, chunk_max);
  alpha = m_new == m ? 1.0f : std::exp(m - m_new);  // m = -inf on the first chunk: alpha = 0
  __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(x, _mm512_set1_ps(m_new))));
  l = l * alpha + _mm512_reduce_add_ps(e);
  m = m_new;
  _mm512_storeu_ps(p, e);
}

// acc[i] = acc[i] * alpha[i] + sum_j p[i][j] v_j for NR rows, register-blocked along D.
// pf: the next chunk's 16 V rows to prefetch alongside, or null.
template <int NR, typename V>
inline void pv_rows(float* acc, const float* p, const float* alpha, const V* const* v, int c, int64_t D,
                    const V* const* pf) {
  __m512 scale[NR];
  for (int i = 0; i < NR; ++i) scale[i] = _mm512_set1_ps(alpha[i]);
  for (int64_t d = 0; d < D; d += 16) {
    __m512 a[NR];
    for (int i = 0; i < NR; ++i) a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + d), scale[i]);
    if (pf && (d * int64_t(sizeof(V))) % 64 == 0) prefetch_line(pf, kChunk, d);
    for (int j = 0; j < c; ++j) {
      __m512 vv = load16(v[j] + d);
      for (int i = 0; i < NR; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i * kChunk + j]), vv, a[i]);
    }
    for (int i = 0; i < NR; ++i) _mm512_storeu_ps(acc + i * D + d, a[i]);
  }
}

template <typename V>
void chunk_values(float* acc, const float* p, const float* alpha, int64_t R, int64_t D, const V* const* v, int c,
                  const V* const* next_v) {
  int64_t r = 0;
  for (; r + 8 <= R; r += 8) pv_rows<8>(acc + r * D, p + r * kChunk, alpha + r, v, c, D, r == 0 ? next_v : nullptr);
  float* a = acc + r * D;
  const float* pr = p + r * kChunk;
  const float* al = alpha + r;
  const V* const* pf = r == 0 ? next_v : nullptr;
  switch (R - r) {
    case 1: pv_rows<1>(a, pr, al, v, c, D, pf); break;
    case 2: pv_rows<2>(a, pr, al, v, c, D, pf); break;
    case 3: pv_rows<3>(a, pr, al, v, c, D, pf); break;
    case 4: pv_rows<4>(a, pr, al, v, c, D, pf); break;
    case 5: pv_rows<5>(a, pr, al, v, c, D, pf); break;
    case 6: pv_rows<6>(a, pr, al, v, c, D, pf); break;
    case 7: pv_rows<7>(a, pr, al, v, c, D, pf); break;
    default: break;
  }
}

// dst[d] = acc[d] * inv for one output row.
template <typename T>
inline void store_row(T* dst, const float* acc, float inv, int64_t D) {
  __m512 s = _mm512_set1_ps(inv);
  for (int64_t d = 0; d < D; d += 16) store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), s));
}

}  // namespace
