// paged_attention.cpp's inner loops without vector instructions (builds with neither AVX-512 nor
// AVX2 + FMA): the same structure, plain loops. paged_attention.cpp includes this header in those
// builds only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attention_common.h"

namespace {

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

}  // namespace
