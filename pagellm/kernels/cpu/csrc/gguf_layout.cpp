// A GGUF tensor's codes laid out as csrc/gguf_format.h's blocks: the byte shuffling of a repack at load
// (loader/gguf_repack.py's _code_bytes, whose numpy is the reference these bytes are tested against), and the
// file's 4-bit codes unpacked for it (its _nibbles).
//
// Why by hand: numpy does it in several passes over temporaries as large as the tensor, on one core, and it was
// most of a first start's time for a large MoE file (docs/benchmarks/2026-11-29-moe-gguf-whole.md, section 3).
// Here each 16-row block's groups are written in one pass, blocks split over the threads.
//
// codes [n, cols] one byte per weight (n a multiple of 16, cols of 32); out [n / 16, cols / 32, group bytes]:
//   bytes   0-255  nibbles: (t, r, b') holds column 4t + b''s low 4 bits, column 4t + 2 + b''s above them
//   5 bits 256-319 the 5th bits: row r's u32, bit 8b + t is column 4t + b's
//   6 bits 256-383 the top two bits: (j, r)'s u32, bits 8b + 2c and 8b + 2c + 1 are column 4(4j + c) + b's
//   8 bits   0-511 the codes themselves as (t, r, b): column 4t + b of row r

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRows = 16, kGroup = 32;

inline void put_u32(uint8_t* at, uint32_t v) { std::memcpy(at, &v, 4); }  // little-endian, as numpy's view

// One 16-row block's group: src points at its row 0, column 0; rows are `stride` bytes apart.
void group_bytes(const uint8_t* src, int64_t stride, int bits, uint8_t* dst) {
    if (bits == 8) {
        for (int t = 0; t < 8; ++t)
            for (int r = 0; r < kRows; ++r) std::memcpy(dst + (t * kRows + r) * 4, src + r * stride + 4 * t, 4);
        return;
    }
    for (int t = 0; t < 8; ++t)
        for (int r = 0; r < kRows; ++r)
            for (int b = 0; b < 2; ++b) {
                const uint8_t* row = src + r * stride + 4 * t;
                dst[(t * kRows + r) * 2 + b] = static_cast<uint8_t>((row[b] & 15) | ((row[2 + b] & 15) << 4));
            }
    if (bits == 5) {
        for (int r = 0; r < kRows; ++r) {
            uint32_t plane = 0;
            for (int t = 0; t < 8; ++t)
                for (int b = 0; b < 4; ++b) plane |= uint32_t((src[r * stride + 4 * t + b] >> 4) & 1) << (8 * b + t);
            put_u32(dst + 256 + r * 4, plane);
        }
    } else if (bits == 6) {
        for (int j = 0; j < 2; ++j)
            for (int r = 0; r < kRows; ++r) {
                uint32_t quad = 0;
                for (int c = 0; c < 4; ++c)
                    for (int b = 0; b < 4; ++b)
                        quad |= uint32_t((src[r * stride + 4 * (4 * j + c) + b] >> 4) & 3) << (8 * b + 2 * c);
                put_u32(dst + 256 + (j * kRows + r) * 4, quad);
            }
    }
}

int group_size(int64_t bits) { return bits == 4 ? 256 : bits == 5 ? 320 : bits == 6 ? 384 : bits == 8 ? 512 : 0; }

}  // namespace

// 0, or -1 when bits is not 4, 5, 6 or 8 or the shape is not whole blocks (nothing is written then).
extern "C" int pagellm_gguf_code_bytes(const uint8_t* codes, int64_t n, int64_t cols, int64_t bits, uint8_t* out) {
    const int size = group_size(bits);
    if (size == 0 || n % kRows != 0 || cols % kGroup != 0 || n < 0 || cols < 0) return -1;
    const int64_t blocks = n / kRows, groups = cols / kGroup;
#pragma omp parallel for schedule(static) if (blocks * groups > 64)
    for (int64_t nb = 0; nb < blocks; ++nb)
        for (int64_t g = 0; g < groups; ++g)
            group_bytes(codes + nb * kRows * cols + g * kGroup, cols, static_cast<int>(bits),
                        out + (nb * groups + g) * size);
    return 0;
}

// The low 4 bits of each code from a file's nibble bytes, runs of `run` bytes giving their low nibbles, then their
// high ones: out[b, 2 run i + run h + l] = (src[b * stride + run i + l] >> 4h) & 15 for `blocks` rows of `nbytes`
// bytes. 0, or -1 when nbytes is not whole runs or rows overlap (nothing is written then).
extern "C" int pagellm_gguf_unpack_nibbles(const uint8_t* src, int64_t blocks, int64_t stride, int64_t nbytes,
                                           int64_t run, uint8_t* out) {
    if (run <= 0 || nbytes % run != 0 || blocks < 0 || (blocks > 1 && stride < nbytes)) return -1;
#pragma omp parallel for schedule(static) if (blocks * nbytes > (1 << 20))
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* row = src + b * stride;
        uint8_t* codes = out + b * 2 * nbytes;
        for (int64_t i = 0; i < nbytes; i += run)
            for (int64_t l = 0; l < run; ++l) {
                codes[2 * i + l] = row[i + l] & 15;
                codes[2 * i + run + l] = row[i + l] >> 4;
            }
    }
    return 0;
}
