// GGUF block formats as quant_gguf.cpp holds them: every format is, per row and 32-column group, integer codes q
// and fp32 factors with w = scale * (q - zero) (+ min), taken bit for bit from the file's blocks (the loader's
// kernels/gguf_blocks.py repacks them; nothing is re-rounded):
//
//   format  bits  zero  scale (per row and group)             min
//   Q4_0    4     8     d (f16)                               -
//   Q4_1    4     0     d (f16)                               m (f16)
//   Q5_0    5     16    d (f16)                               -
//   Q5_1    5     0     d (f16)                               m (f16)
//   Q8_0    8     0     d (f16); codes signed                 -
//   Q4_K    4     0     d * sc (f16 per 256 columns x u6)     -(dmin * m) (f16 per 256 x u6)
//   Q5_K    5     0     as Q4_K                               as Q4_K
//   Q6_K    6     32    d * sc (f16 per 256 x i8 per 16 columns: two scales a group)
//
// Layout, per block of 16 rows and 32-column group g (N a multiple of 16):
//   qs  [N/16][G][group_bytes]: 256 bytes of low nibbles in the int4 layout of quant_gemv.cpp (chunk t of 8:
//       16 rows x 2 bytes; byte b of row r: low nibble k = 4t + b, high nibble k = 4t + 2 + b), then one 64-byte
//       plane per code bit above 4: 16 rows x uint32, bit 8b + t holding that bit of code k = 4t + b (so
//       ((plane >> t) & 0x01010101) << bit puts it in the right byte of a chunk's lane). Q6_K's two high bits
//       instead as two 64-byte quads, quad j for chunks 4j .. 4j + 3: 16 rows x uint32, bits 8b + 2c and
//       8b + 2c + 1 holding bits 4 and 5 of code k = 4(4j + c) + b (so one shift, or none, and one mask put a
//       chunk's in place: two planes took two shifts and a mask each, most of a Q6_K chunk's instructions).
//       Q8_0 instead: 8 chunks of 16 rows x 4 bytes (the codes 4t..4t+3 of a row, int8).
//   gp  [N/16][G][group_params]: f16 scale[16] (+ f16 min[16]); K formats u8 sc[16], m[16]; Q6_K i8 sc[2][16]
//   sp  [N/16][K/256][super_params]: K formats f16 d[16], dmin[16]; Q6_K f16 d[16]; others none
#pragma once

#include <cstdint>
#include <cstring>

namespace {

enum class Scales { kF16, kF16Min, kSuper, kQ6K };

template <int Bits, int Zero, Scales S>
struct Format {
    static constexpr int kBits = Bits, kZero = Zero;
    static constexpr Scales kScales = S;
    static constexpr bool kMin = S == Scales::kF16Min || S == Scales::kSuper;
    static constexpr int kHalves = S == Scales::kQ6K ? 2 : 1;  // scales per group
    static constexpr int kPlanes = Bits == 8 ? 0 : Bits - 4;  // 64-byte planes of code bits above the nibble
    static constexpr bool kHighQuads = Bits == 6;  // those two planes as quads of chunks (Q6_K)
    static constexpr int64_t kGroupBytes = Bits == 8 ? 512 : 256 + 64 * (Bits - 4);
    static constexpr int64_t kParamBytes = S == Scales::kF16Min ? 64 : 32;
    static constexpr int64_t kSuperBytes = S == Scales::kSuper ? 64 : S == Scales::kQ6K ? 32 : 0;
};

// The format ids of kernels/gguf_blocks.py.
using Q4_0 = Format<4, 8, Scales::kF16>;
using Q4_1 = Format<4, 0, Scales::kF16Min>;
using Q5_0 = Format<5, 16, Scales::kF16>;
using Q5_1 = Format<5, 0, Scales::kF16Min>;
using Q8_0 = Format<8, 0, Scales::kF16>;
using Q4_K = Format<4, 0, Scales::kSuper>;
using Q5_K = Format<5, 0, Scales::kSuper>;
using Q6_K = Format<6, 32, Scales::kQ6K>;

// IEEE half -> float, exact (every half is an fp32), as vcvtph2ps.
inline float half_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
    uint32_t bits;
    if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {  // zero or subnormal: mantissa * 2^-24, exact in fp32
        float v = float(mantissa) * 5.9604644775390625e-8f;
        std::memcpy(&bits, &v, 4);
        bits |= sign;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t half_at(const uint8_t* p, int64_t i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return h;
}

// Code k (0..31) of row r (0..15) in one group's qs bytes.
template <class F>
inline int32_t code_at(const uint8_t* q, int r, int k) {
    const int t = k / 4, b = k % 4;
    if constexpr (F::kBits == 8) return int8_t(q[64 * t + 4 * r + b]);
    int32_t code = (q[32 * t + 2 * r + (b & 1)] >> (4 * (b >> 1))) & 15;
    if constexpr (F::kHighQuads) {
        uint32_t quad;
        std::memcpy(&quad, q + 256 + 64 * (t / 4) + 4 * r, 4);
        return code | int32_t((quad >> (8 * b + 2 * (t % 4))) & 3) << 4;
    }
    for (int p = 0; p < F::kPlanes; ++p) {
        uint32_t plane;
        std::memcpy(&plane, q + 256 + 64 * p + 4 * r, 4);
        code |= int32_t((plane >> (8 * b + t)) & 1) << (4 + p);
    }
    return code;
}

// Row r's scale (half h of the group) and min, computed as every level computes them.
struct RowScales {
    float scale[2];
    float min;
};

template <class F>
inline RowScales row_scales(const uint8_t* gp, const uint8_t* sp, int r) {
    RowScales s{};
    if constexpr (F::kScales == Scales::kF16 || F::kScales == Scales::kF16Min) {
        s.scale[0] = s.scale[1] = half_to_f32(half_at(gp, r));
        if constexpr (F::kMin) s.min = half_to_f32(half_at(gp, 16 + r));
    } else if constexpr (F::kScales == Scales::kSuper) {
        s.scale[0] = s.scale[1] = half_to_f32(half_at(sp, r)) * float(gp[r]);
        s.min = -(half_to_f32(half_at(sp, 16 + r)) * float(gp[16 + r]));
    } else {
        const float d = half_to_f32(half_at(sp, r));
        s.scale[0] = d * float(int8_t(gp[r]));
        s.scale[1] = d * float(int8_t(gp[16 + r]));
    }
    return s;
}

// Calls fn(Format{}) for a format id, or returns false for an unknown one.
template <class Fn>
inline bool with_format(int id, Fn&& fn) {
    switch (id) {
        case 0: fn(Q4_0{}); return true;
        case 1: fn(Q4_1{}); return true;
        case 2: fn(Q5_0{}); return true;
        case 3: fn(Q5_1{}); return true;
        case 4: fn(Q8_0{}); return true;
        case 5: fn(Q4_K{}); return true;
        case 6: fn(Q5_K{}); return true;
        case 7: fn(Q6_K{}); return true;
        default: return false;
    }
}

}  // namespace
