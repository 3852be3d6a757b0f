// Paged attention for CPU: OpenMP across work items, AVX-512 or AVX2 inside them.
//
// Semantics are those of pagellm.kernels.attention.paged_attention_reference (the oracle):
// query [T, H_q, D] packs the new tokens of B sequences; sequence b owns rows
// query_start_loc[b] : query_start_loc[b+1] and has seq_lens[b] tokens of context after the
// step; logical key j of sequence b lives at cache[block_tables[b, j / bs], j % bs, kv_head].
// The query at position p sees keys k <= p, and with a sliding window W only p - k < W.
//
// Work decomposition. A task is (sequence, kv head, tile of query tokens); its rows are the
// tile's tokens times the G query heads that share the kv head, so each K/V row read from the
// cache serves all of them. Keys are visited in chunks of 16 with an online softmax (running
// max and sum, the accumulator rescaled when the max grows), reading K/V in place through the
// block table: one pass, no gathered copy; the next chunk's rows are prefetched while a chunk
// computes. When there are too few tasks for the threads (a lone long decode), a task's key
// range is split (flash-decoding): each split leaves a partial (max, sum, unnormalised
// accumulator) and a second loop merges them.
//
// Cache positions >= seq_len may hold anything (uninitialised memory, NaN): they are never read.
//
// Instruction sets (pagellm/kernels/native.py builds one library per level). Three versions of
// the inner loops share everything else (planning, threading, the block-table walk, the merge):
//   __AVX512F__          16-lane zmm; bf16 dot products with vdpbf16ps (__AVX512BF16__).
//   __AVX2__ && __FMA__  the AVX-512 loops on 8-lane ymm, computing the same bits: each 16-lane
//                        accumulator is a low and a high half, each half accumulated in the same
//                        order and summed in the same tree (lo + hi, then the halving tree of
//                        reduce16 / GCC's _mm512_reduce_add_ps); vdpbf16ps, which per fp32 lane adds
//                        the (exact) product of the odd bf16 pair elements and then that of the
//                        even ones, rounding after each, is two fmas on the pair split by a mask
//                        and a shift; exp and tanh are the same polynomials (exp512.h, attention_avx2.h).
//                        The one difference: vdpbf16ps treats subnormal bf16 inputs, and fp32
//                        partial sums and products below 2^-126, as zero; the fmas keep them (as
//                        the reference does). So with bf16 data holding such values a raw score
//                        q.k can differ between the builds, by less than
//                        2^-126 * (head_dim + |q|_1 + |k|_1). For data of ordinary scale that is
//                        far below what the softmax resolves and the outputs stay equal (tested,
//                        subnormal keys and subnormal products included); only contrived inputs
//                        (subnormal keys against queries near 2^120) show it. Otherwise the
//                        outputs are bit-identical.
//   otherwise            plain loops: dot products summed in sequence, std::exp and std::tanh.
//                        Agrees with the vector builds to rounding (fp32 outputs within 1e-5,
//                        bf16 within one bf16 rounding), not bit for bit.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include "attention_avx2.h"
#include "exp512.h"

namespace {

using bf16 = uint16_t;  // raw bfloat16 bits

constexpr int kChunk = 16;               // keys per online-softmax step: one zmm of scores per row
constexpr int64_t kTileRows = 32;        // target rows per task: K/V reuse vs. Q+acc staying in L1/L2
constexpr int64_t kMinSplitKeys = 128;   // below this a split costs more in merging than it gains
constexpr int kUnitsPerThread = 4;       // split granularity so dynamic scheduling can balance
constexpr int64_t kMinParallelMacs = int64_t(1) << 19;  // ~20 us of work: less is not worth waking a thread
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void from_float(float* dst, float x) { *dst = x; }
inline void from_float(bf16* dst, float x) {  // round to nearest even, like torch's .to(bfloat16)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *dst = bf16((u >> 16) | 0x40);  // quiet NaN
    return;
  }
  *dst = bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Everything about a call but the tensors' element type.
struct Shape {
  const int64_t* block_tables;     // [B, table_stride]
  const int64_t* query_start_loc;  // [B + 1]
  const int64_t* seq_lens;         // [B]
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, table_stride;
  int64_t q_stride_tok, q_stride_head;                   // elements; last dim contiguous
  int64_t k_stride_block, k_stride_tok, k_stride_head;   // elements
  int64_t v_stride_block, v_stride_tok, v_stride_head;
  float scale;
  int64_t window;  // <= 0: none
  float soft_cap;  // <= 0: none
  int64_t group() const { return num_heads / num_kv_heads; }
};

template <typename T>
struct Problem : Shape {
  T* out;  // [T, H_q, D], contiguous
  const T* query;
  const T* key_cache;
  const T* value_cache;
};

struct Task {
  int64_t seq, kv_head;
  int64_t tok0, ntok;        // query rows tok0 .. tok0 + ntok - 1 of the packed batch
  int64_t pos0;              // position of row tok0 in its sequence
  int64_t key_lo, key_hi;    // keys at least one row of the tile sees
  int64_t nsplit, split_len;
  int64_t partial;           // first partial slot (when nsplit > 1)
};

struct Unit {  // one schedulable piece: a task, or one key split of it
  int64_t cost, task, split;
};

// Keys [lo, hi) visible from position p, clipped to the chunk [c0, c0 + c), as a bit mask.
inline uint32_t visible_bits(int64_t p, int64_t window, int64_t c0, int c) {
  int64_t lo = window > 0 ? std::max<int64_t>(c0, p - window + 1) : c0;
  int64_t hi = std::min<int64_t>(c0 + c, p + 1);
  if (hi <= lo) return 0;
  uint32_t upto = (1u << (hi - c0)) - 1u;  // hi - c0 <= 16
  return upto & ~((1u << (lo - c0)) - 1u);
}

// The rows of the next chunk are requested while this one computes, one line per row per
// step of the inner loops: a chunk's rows are short runs scattered over the cache, which the
// hardware prefetchers catch late, and a burst of requests would stall on full miss queues.
template <typename T>
inline void prefetch_line(const T* const* rows, int n, int64_t d) {
  for (int j = 0; j < n; ++j) __builtin_prefetch(rows[j] + d, 0, 2);
}

// ---------------------------------------------------------------------------------------------
// Inner loops: scores of a chunk, softmax update, V accumulation. AVX-512, AVX2 and scalar
// versions.

#ifdef __AVX512F__

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {  // bf16 -> fp32 is a 16-bit shift into the high half
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
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

#elif defined(__AVX2__) && defined(__FMA__)  // the AVX-512 path on 8-lane registers, same bits

using namespace attention_avx2;

// Each 16-lane accumulator of the AVX-512 path is a low and a high 8-lane half here: lane i of
// half h accumulates what lane 8h + i does there, in the same order, and the halves are summed
// (lo + hi, then the halving tree of reduce16) as reduce16 sums a zmm.

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
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

#else  // scalar fallback: same structure, plain loops

template <typename T> struct QueryBuf { using type = float; };

template <typename Q, typename K>
void chunk_scores(const Q* q, int64_t R, int64_t D, const K* const* k, int c, float* s, const K* const*) {
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < c; ++j) {
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += to_float(q[r * D + d]) * to_float(k[j][d]);
      s[r * kChunk + j] = dot;
    }
}

inline void softmax_row(const float* s, uint32_t bits, float scale, float soft_cap, float& m, float& l,
                        float* p, float& alpha) {
  float x[kChunk];
  float chunk_max = kNegInf;
  for (int j = 0; j < kChunk; ++j) {
    if (!(bits >> j & 1u)) continue;
    x[j] = s[j] * scale;
    if (soft_cap > 0.0f) x[j] = std::tanh(x[j] / soft_cap) * soft_cap;
    chunk_max = std::max(chunk_max, x[j]);
  }
  if (!bits) {
    std::fill(p, p + kChunk, 0.0f);
    alpha = 1.0f;
    return;
  }
  float m_new = std::max(m, chunk_max);
  alpha = m_new == m ? 1.0f : std::exp(m - m_new);
  float sum = 0.0f;
  for (int j = 0; j < kChunk; ++j) {
    p[j] = (bits >> j & 1u) ? std::exp(x[j] - m_new) : 0.0f;
    sum += p[j];
  }
  l = l * alpha + sum;
  m = m_new;
}

template <typename V>
void chunk_values(float* acc, const float* p, const float* alpha, int64_t R, int64_t D, const V* const* v, int c,
                  const V* const*) {
  for (int64_t r = 0; r < R; ++r) {
    float* a = acc + r * D;
    for (int64_t d = 0; d < D; ++d) a[d] *= alpha[r];
    for (int j = 0; j < c; ++j) {
      float w = p[r * kChunk + j];
      for (int64_t d = 0; d < D; ++d) a[d] += w * to_float(v[j][d]);
    }
  }
}

template <typename T>
inline void store_row(T* dst, const float* acc, float inv, int64_t D) {
  for (int64_t d = 0; d < D; ++d) from_float(dst + d, acc[d] * inv);
}

#endif  // __AVX512F__, __AVX2__ && __FMA__, scalar

// ---------------------------------------------------------------------------------------------
// One split of one task.

// Per-thread scratch for a task of up to max_rows rows.
template <typename T>
struct Workspace {
  using Q = typename QueryBuf<T>::type;
  Q* q;          // [rows rounded up to 4, D], rows: token-major, then the G heads
  float* acc;    // [rows, D] unnormalised outputs
  float* s;      // [rows rounded up to 4, 16] raw scores of the chunk
  float* p;      // [rows, 16] probabilities of the chunk
  float *m, *l, *alpha;  // [rows]
  void* block;

  Workspace(int64_t max_rows, int64_t D) {
    int64_t padded = (max_rows + 3) / 4 * 4;
    size_t q_bytes = (padded * D * sizeof(Q) + 63) / 64 * 64;
    size_t floats = max_rows * D + padded * kChunk + max_rows * kChunk + 3 * max_rows;
    size_t bytes = q_bytes + (floats * sizeof(float) + 63) / 64 * 64;
    block = std::aligned_alloc(64, bytes);
    q = static_cast<Q*>(block);
    acc = reinterpret_cast<float*>(static_cast<char*>(block) + q_bytes);
    s = acc + max_rows * D;
    p = s + padded * kChunk;
    m = p + max_rows * kChunk;
    l = m + max_rows;
    alpha = l + max_rows;
  }
  ~Workspace() { std::free(block); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

template <typename T>
void load_queries(const Problem<T>& pb, const Task& t, Workspace<T>& ws) {
  const int64_t D = pb.head_dim, G = pb.group(), R = t.ntok * G;
  using Q = typename Workspace<T>::Q;
  for (int64_t r = 0; r < R; ++r) {
    const T* src = pb.query + (t.tok0 + r / G) * pb.q_stride_tok + (t.kv_head * G + r % G) * pb.q_stride_head;
    Q* dst = ws.q + r * D;
    if constexpr (std::is_same_v<Q, T>) {
      std::memcpy(dst, src, D * sizeof(T));
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]);
    }
  }
  int64_t padded = (R + 3) / 4 * 4;
  std::memset(static_cast<void*>(ws.q + R * D), 0, (padded - R) * D * sizeof(Q));
}

// Row pointers of keys c0 .. c0 + c - 1 of a sequence; the rest of the 16 repeat the first
// so that fixed-width tiles can read them (their scores are masked out).
template <typename T>
void chunk_rows(const Problem<T>& pb, const int64_t* table, int64_t kv_head, int64_t c0, int c,
                const T** k, const T** v) {
  int64_t block = c0 / pb.block_size, row = c0 % pb.block_size;
  for (int j = 0; j < c; ++j) {
    int64_t phys = table[block];
    k[j] = pb.key_cache + phys * pb.k_stride_block + row * pb.k_stride_tok + kv_head * pb.k_stride_head;
    v[j] = pb.value_cache + phys * pb.v_stride_block + row * pb.v_stride_tok + kv_head * pb.v_stride_head;
    if (++row == pb.block_size) {
      row = 0;
      ++block;
    }
  }
  for (int j = c; j < kChunk; ++j) {
    k[j] = k[0];
    v[j] = v[0];
  }
}

// Attend keys [lo, hi) of task t; leave (m, l, acc) in ws.
template <typename T>
void attend_range(const Problem<T>& pb, const Task& t, int64_t lo, int64_t hi, Workspace<T>& ws) {
  const int64_t D = pb.head_dim, G = pb.group(), R = t.ntok * G;
  const int64_t* table = pb.block_tables + t.seq * pb.table_stride;
  std::fill(ws.m, ws.m + R, kNegInf);
  std::fill(ws.l, ws.l + R, 0.0f);
  std::fill(ws.acc, ws.acc + R * D, 0.0f);
  const T* rows[2][2][kChunk];  // [this chunk, next chunk][K, V][key]
  if (lo < hi) chunk_rows(pb, table, t.kv_head, lo, int(std::min<int64_t>(kChunk, hi - lo)), rows[0][0], rows[0][1]);
  for (int64_t c0 = lo, cur = 0; c0 < hi; c0 += kChunk, cur ^= 1) {
    int c = int(std::min<int64_t>(kChunk, hi - c0));
    const T** k = rows[cur][0];
    const T** v = rows[cur][1];
    bool more = c0 + kChunk < hi;
    if (more)
      chunk_rows(pb, table, t.kv_head, c0 + kChunk, int(std::min<int64_t>(kChunk, hi - c0 - kChunk)),
                 rows[cur ^ 1][0], rows[cur ^ 1][1]);
    chunk_scores(ws.q, R, D, k, c, ws.s, more ? rows[cur ^ 1][0] : nullptr);
    for (int64_t i = 0; i < t.ntok; ++i) {
      uint32_t bits = visible_bits(t.pos0 + i, pb.window, c0, c);
      for (int64_t g = 0; g < G; ++g) {
        int64_t r = i * G + g;
        softmax_row(ws.s + r * kChunk, bits, pb.scale, pb.soft_cap, ws.m[r], ws.l[r], ws.p + r * kChunk,
                    ws.alpha[r]);
      }
    }
    chunk_values(ws.acc, ws.p, ws.alpha, R, D, v, c, more ? rows[cur ^ 1][1] : nullptr);
  }
}

template <typename T>
T* output_row(const Problem<T>& pb, const Task& t, int64_t r) {
  const int64_t G = pb.group();
  return pb.out + ((t.tok0 + r / G) * pb.num_heads + t.kv_head * G + r % G) * pb.head_dim;
}

// Partial slot layout: [R] max, [R] sum, [R, D] accumulator. Every slot of a call has the
// size for the largest task (tasks of one call differ little), which keeps indexing simple.
inline int64_t slot_floats(int64_t R, int64_t D) { return R * (D + 2); }

template <typename T>
void run_unit(const Problem<T>& pb, const Task& t, int64_t split, Workspace<T>& ws, float* partials,
              int64_t slot_stride) {
  const int64_t D = pb.head_dim, R = t.ntok * pb.group();
  int64_t lo = t.key_lo + split * t.split_len;
  int64_t hi = std::min(t.key_hi, lo + t.split_len);
  load_queries(pb, t, ws);
  attend_range(pb, t, lo, hi, ws);
  if (t.nsplit == 1) {
    for (int64_t r = 0; r < R; ++r)
      store_row(output_row(pb, t, r), ws.acc + r * D, ws.l[r] > 0.0f ? 1.0f / ws.l[r] : 0.0f, D);
    return;
  }
  float* slot = partials + (t.partial + split) * slot_stride;
  std::memcpy(slot, ws.m, R * sizeof(float));
  std::memcpy(slot + R, ws.l, R * sizeof(float));
  std::memcpy(slot + 2 * R, ws.acc, R * D * sizeof(float));
}

// Merge the splits of task t: weights e^(m_s - M) put every split's sums on the same scale.
template <typename T>
void merge_splits(const Problem<T>& pb, const Task& t, const float* partials, int64_t slot, float* row) {
  const int64_t D = pb.head_dim, R = t.ntok * pb.group();
  const float* first = partials + t.partial * slot;
  for (int64_t r = 0; r < R; ++r) {
    float M = kNegInf;
    for (int64_t s = 0; s < t.nsplit; ++s) M = std::max(M, first[s * slot + r]);
    std::fill(row, row + D, 0.0f);
    float L = 0.0f;
    for (int64_t s = 0; s < t.nsplit; ++s) {
      const float* sl = first + s * slot;
      if (sl[R + r] == 0.0f) continue;  // the split saw no key for this row
      float w = std::exp(sl[r] - M);
      L += w * sl[R + r];
      const float* acc = sl + 2 * R + r * D;
      for (int64_t d = 0; d < D; ++d) row[d] += w * acc[d];
    }
    store_row(output_row(pb, t, r), row, L > 0.0f ? 1.0f / L : 0.0f, D);
  }
}

// ---------------------------------------------------------------------------------------------
// Planning: tasks, key splits, schedule order.

template <typename T>
std::vector<Task> make_tasks(const Problem<T>& pb) {
  const int64_t G = pb.group();
  const int64_t tile = std::max<int64_t>(1, kTileRows / G);
  std::vector<Task> tasks;
  for (int64_t b = 0; b < pb.num_seqs; ++b) {
    int64_t start = pb.query_start_loc[b], end = pb.query_start_loc[b + 1];
    int64_t qlen = end - start, seq_len = pb.seq_lens[b];
    for (int64_t tok0 = start; tok0 < end; tok0 += tile) {
      int64_t ntok = std::min(tile, end - tok0);
      int64_t pos0 = seq_len - qlen + (tok0 - start);
      int64_t key_lo = pb.window > 0 ? std::max<int64_t>(0, pos0 - pb.window + 1) : 0;
      int64_t key_hi = pos0 + ntok;  // the last row sees up to its own position
      for (int64_t h = 0; h < pb.num_kv_heads; ++h)
        tasks.push_back(Task{b, h, tok0, ntok, pos0, key_lo, key_hi, 1, key_hi - key_lo, 0});
    }
  }
  return tasks;
}

inline int64_t total_cost(const std::vector<Task>& tasks, int64_t group) {  // sum of keys x rows
  int64_t total = 0;
  for (const Task& t : tasks) total += (t.key_hi - t.key_lo) * t.ntok * group;
  return total;
}

// Split long tasks when the work would otherwise not spread over the threads; return the
// schedulable units, costliest first, and the number of partial slots the splits need.
std::vector<Unit> split_tasks(std::vector<Task>& tasks, int64_t group, int nthreads, int64_t* num_slots) {
  int64_t total = total_cost(tasks, group);
  int64_t target = std::max<int64_t>(1, total / (int64_t(nthreads) * kUnitsPerThread));
  *num_slots = 0;
  std::vector<Unit> units;
  for (size_t i = 0; i < tasks.size(); ++i) {
    Task& t = tasks[i];
    int64_t keys = t.key_hi - t.key_lo, cost = keys * t.ntok * group;
    int64_t n = nthreads > 1 ? std::min((cost + target - 1) / target, keys / kMinSplitKeys) : 1;
    if (n > 1) {
      // splits start on chunk boundaries so that a short last chunk happens only once
      t.split_len = ((keys + n - 1) / n + kChunk - 1) / kChunk * kChunk;
      t.nsplit = (keys + t.split_len - 1) / t.split_len;
      t.partial = *num_slots;
      *num_slots += t.nsplit;
    }
    for (int64_t s = 0; s < t.nsplit; ++s)
      units.push_back(Unit{std::min(t.split_len, keys - s * t.split_len) * t.ntok * group, int64_t(i), s});
  }
  // longest first: dynamic scheduling then balances uneven lengths (LPT)
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.cost > b.cost; });
  return units;
}

template <typename T>
void run(const Problem<T>& pb, int nthreads) {
  std::vector<Task> tasks = make_tasks(pb);
  if (tasks.empty()) return;
  const int64_t G = pb.group(), D = pb.head_dim;
  if (total_cost(tasks, G) * D < kMinParallelMacs) nthreads = 1;
  nthreads = std::max(1, nthreads);
  int64_t num_slots = 0;
  std::vector<Unit> units = split_tasks(tasks, G, nthreads, &num_slots);
  int64_t max_rows = 0;
  for (const Task& t : tasks) max_rows = std::max(max_rows, t.ntok * G);
  const int64_t slot = slot_floats(max_rows, D);
  std::vector<float> partials(size_t(num_slots * slot));
  std::vector<int64_t> split_ids;
  for (size_t i = 0; i < tasks.size(); ++i)
    if (tasks[i].nsplit > 1) split_ids.push_back(int64_t(i));
  int threads = int(std::min<int64_t>(nthreads, int64_t(units.size())));
#pragma omp parallel num_threads(threads)
  {
    Workspace<T> ws(max_rows, D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < int64_t(units.size()); ++u)
      run_unit(pb, tasks[units[u].task], units[u].split, ws, partials.data(), slot);
    if (!split_ids.empty()) {  // (same on every thread) a loop's barrier costs even with no iterations
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < int64_t(split_ids.size()); ++i)
        merge_splits(pb, tasks[split_ids[i]], partials.data(), slot, ws.acc);
    }
  }
}

}  // namespace

// dtype: 0 = float32, 1 = bfloat16. window <= 0: no sliding window; soft_cap <= 0: none.
// head_dim must be a multiple of 16. Returns 0, -1 for an unsupported dtype, -2 out of memory.
extern "C" int pagellm_paged_attention(
    void* out, const void* query, const void* key_cache, const void* value_cache,
    const int64_t* block_tables, const int64_t* query_start_loc, const int64_t* seq_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t table_stride, int64_t q_stride_tok, int64_t q_stride_head,
    int64_t k_stride_block, int64_t k_stride_tok, int64_t k_stride_head,
    int64_t v_stride_block, int64_t v_stride_tok, int64_t v_stride_head,
    float scale, int64_t window, float soft_cap, int dtype, int num_threads) {
  const Shape shape{block_tables, query_start_loc, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim,
                    block_size, table_stride, q_stride_tok, q_stride_head, k_stride_block, k_stride_tok,
                    k_stride_head, v_stride_block, v_stride_tok, v_stride_head, scale, window, soft_cap};
  try {
    if (dtype == 0) {
      run(Problem<float>{shape, static_cast<float*>(out), static_cast<const float*>(query),
                         static_cast<const float*>(key_cache), static_cast<const float*>(value_cache)},
          num_threads);
      return 0;
    }
    if (dtype == 1) {
      run(Problem<bf16>{shape, static_cast<bf16*>(out), static_cast<const bf16*>(query),
                        static_cast<const bf16*>(key_cache), static_cast<const bf16*>(value_cache)},
          num_threads);
      return 0;
    }
  } catch (const std::bad_alloc&) {  // planning vectors; nothing may unwind into ctypes
    return -2;
  }
  return -1;
}
