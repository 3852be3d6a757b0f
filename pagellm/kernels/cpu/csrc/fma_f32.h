// fma_f32(a, b, c): a * b + c rounded once to fp32, as an FMA instruction computes it, at every level.
//
// Where the target has an fp32 FMA (__FP_FAST_FMAF: x86-64-v3 and up, AArch64, ...) this is std::fma,
// one instruction. Without one (the generic x86-64 build) std::fma is a libm call, slow through glibc's
// dispatch even on a CPU that has FMA after all and far slower on one that does not (glibc then emulates it
// with rounding-mode switches). Instead, exactly rounded in plain double arithmetic, faster than both
// (measured: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md):
//
//   p = a * b in double is exact (24 + 24 bits <= 53, and no float product leaves double's normal range);
//   s = p + c in double, rounded to nearest. float(s) rounds twice, which differs from rounding p + c once
//   only if s is exactly halfway between two floats and inexact: a float midpoint is a double, so were one
//   strictly between p + c and s, s would not be the double nearest p + c. The fast path checks that s is
//   no midpoint (its bits below the float's last place are not exactly 1000...) in float's normal range
//   (below it the float's last place is fixed at 2^-149, so every such s takes the slow path; so do 0,
//   inf and NaN midpoint-looking patterns, harmlessly). The slow path gets TwoSum's error e (s + e == p + c
//   exactly) and makes s round-to-odd: truncated toward zero (one double ulp down in magnitude if e says
//   the exact sum is smaller), its last bit set if e != 0. float() of that is the correctly rounded
//   a * b + c (rounding to odd at >= 24 + 2 bits, then to nearest at 24, equals rounding to nearest
//   directly: Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
//   rounding to odd", IEEE TC 2008), denormal and overflowing results included. Infinities and NaNs give
//   e = NaN and pass through unchanged (NaN payloads may differ from the instruction's).
//
// Checked against the instruction on 10^8 random and constructed (midpoint, cancelling, denormal) triples
// once; tests/kernels/test_logits_kernels.py compares ~650 k of them across the levels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef __FP_FAST_FMAF
// p + dc (exact p, exact dc, s = their double sum) rounded once to float, by rounding to odd.
__attribute__((noinline)) inline float fma_f32_slow(double p, double dc, double s) {
    const double pb = s - dc;  // TwoSum (Knuth): s + e == p + dc exactly, whatever their magnitudes
    const double e = (p - pb) + (dc - (s - pb));
    uint64_t u, ue;
    std::memcpy(&u, &s, 8);
    std::memcpy(&ue, &e, 8);
    // Truncate toward zero (one ulp down in magnitude when the exact sum is smaller, i.e. e's sign is not
    // s's), then set the last bit if inexact.
    const uint64_t inexact = uint64_t((e > 0.0) | (e < 0.0));  // 0 when exact, and for NaN (inf / NaN s)
    u = (u - (((u ^ ue) >> 63) & inexact)) | inexact;
    double odd;
    std::memcpy(&odd, &u, 8);
    return float(odd);
}
#endif

inline float fma_f32(float a, float b, float c) {
#ifdef __FP_FAST_FMAF
    return std::fma(a, b, c);
#else
    const double p = double(a) * double(b), dc = double(c);
    const double s = p + dc;
    uint64_t u;
    std::memcpy(&u, &s, 8);
    const bool normal = ((u >> 52) & 0x7ff) >= 1023 - 126;  // |s| >= 2^-126 (inf and NaN too)
    if (__builtin_expect(normal && (u & 0x1fffffffu) != 0x10000000u, 1)) return float(s);
    return fma_f32_slow(p, dc, s);
#endif
}

