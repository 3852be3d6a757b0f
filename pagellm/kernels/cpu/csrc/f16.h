// IEEE half <-> fp32 for a K/V cache stored in float16 (llama.cpp's default cache type), converting exactly as
// torch's .float() and .to(float16) do (nearest even; NaN stays a quiet NaN). Scalar code: a cache row is
// written once per token, and the attention loops convert with F16C where the level has it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

struct f16 {  // raw half bits, a type of its own so overloads tell it from bf16's uint16_t
    uint16_t bits;
};

inline float f16_to_f32(f16 h) {  // exact: every half is an fp32
    uint32_t sign = uint32_t(h.bits & 0x8000u) << 16, exp = (h.bits >> 10) & 0x1fu, man = h.bits & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);  // inf, NaN
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else {  // zero or subnormal: man * 2^-24, exact in fp32
        float f = std::ldexp(float(man), -24);
        std::memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline f16 f32_to_f16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return {uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};  // NaN, made quiet
    if (a >= 0x477ff000u) return {uint16_t(sign | 0x7c00u)};  // >= 65520 rounds to inf (65504 is the largest)
    if (a >= 0x38800000u) {  // a normal half (>= 2^-14): round the 13 dropped bits to nearest even
        uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
        return {uint16_t(sign | ((rounded - 0x38000000u) >> 13))};
    }
    // a subnormal half (or zero): units of 2^-24, the scaling exact; nearbyint rounds to nearest even
    return {uint16_t(sign | uint32_t(std::nearbyint(std::fabs(f) * 16777216.0f)))};
}
