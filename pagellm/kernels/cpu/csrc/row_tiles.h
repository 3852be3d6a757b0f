// The loop both dense kernels share (bf16_gemv.cpp, f32_rows.cpp): weight rows in tiles of kRows against the
// activation rows kMaxRows at a time, the last rows of N one at a time (each row's chain is the same as in a
// whole tile), each tile's sums stored in turn. Threads split the weight tiles (schedule static), so a row's
// result does not depend on the thread either.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int kMaxRows = 4;  // activation rows a tile

// f(R, MR) with R and MR as compile-time constants, MR = mr (1..kMaxRows).
template <int R, class F>
void with_rows(int mr, F&& f) {
    using One = std::integral_constant<int, R>;
    switch (mr) {
        case 1: return f(One{}, std::integral_constant<int, 1>{});
        case 2: return f(One{}, std::integral_constant<int, 2>{});
        case 3: return f(One{}, std::integral_constant<int, 3>{});
        default: return f(One{}, std::integral_constant<int, 4>{});
    }
}

// tile(R, MR, n, m0, sums): sums[i * MR + r] = w_{n + i} . x_{m0 + r}; store(m, n, sum) for every output.
template <int kRows, class Tile, class Store>
void row_tiles(int64_t M, int64_t N, bool threads, Tile&& tile, Store&& store) {
    const int64_t tiles = (N + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (threads)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n = t * kRows;
        const int rows = int(std::min<int64_t>(kRows, N - n));
        for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
            const int mr = int(std::min<int64_t>(kMaxRows, M - m0));
            float sums[kRows * kMaxRows];
            if (rows == kRows)
                with_rows<kRows>(mr, [&](auto R, auto MR) { tile(R, MR, n, m0, sums); });
            else
                for (int i = 0; i < rows; ++i)
                    with_rows<1>(mr, [&](auto R, auto MR) { tile(R, MR, n + i, m0, sums + i * mr); });
            for (int i = 0; i < rows; ++i)
                for (int r = 0; r < mr; ++r) store(m0 + r, n + i, sums[i * mr + r]);
        }
    }
}

}  // namespace
