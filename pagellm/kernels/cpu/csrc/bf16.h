// bf16 <-> fp32 conversions shared by the kernels, rounding exactly as torch does.
#pragma once

#include <cstdint>
#include <cstring>

inline float bf16_to_f32(uint16_t h) {  // bf16 is the high half of an fp32
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}
