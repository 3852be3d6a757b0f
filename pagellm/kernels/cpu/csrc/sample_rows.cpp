// A sampled row's token in one kernel: temperature, top-k, top-p, min-p and the draw, for every row of a step.
//
// Why: the torch chain (runner/sampler.py) makes about eight passes over each [V] row (divide, a top-k of a
// thousand candidates, a logsumexp, a scatter back into a fresh row, clamp, max, exp, the draw's block sums);
// at Gemma 3's V = 262144 top-p cost most of a sampled decode step's time on a CPU. Here a row is read once
// (scaled, its max), its exponentials written once into the thread's scratch, and the filters work on the few
// tokens that can matter.
// measured: docs/benchmarks/2026-11-28-cpu-sampling.md
//
//   pagellm_sample_rows: per row, x = logits * (1 / temperature) (clamped to the largest finite float); e =
//   exp(x - max x), unnormalised; then, as runner/sampler.py's torch path:
//     top-k      the k largest e, ties with the k-th kept (k <= 0 or k >= V: off)
//     top-p      in order of e descending (ties by id), tokens kept while the mass before them, over the whole
//                row's (or the top-k's) mass, is below top_p (top_p >= 1: off)
//     min-p      tokens with e below min_p (the kept maximum is 1) dropped
//     the draw   the first token, in id order, whose running sum of kept mass passes u times the kept total
//   Top-k and top-p look at the tokens with e at least a threshold (2^-10, then 2^-20, 2^-40, everything),
//   lower only while the answer may lie below it: a token under the threshold has every token over it ranked
//   above it, so once those hold the nucleus (or k tokens), it is dropped whatever its own mass. Exact: the
//   same tokens survive as in a full sort.
//
// Levels: e uses exp512.h's exp, the same bits at every level; sums are float64 in 16 fixed lanes and then in a
// fixed order (the compiler vectorises the lanes, which reorders nothing; -ffp-contract=off), so every level
// draws the same token from the same u.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "exp512.h"
#include "thread_scratch.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 1024;  // tokens a partial sum of the draw covers
constexpr float kThresholds[] = {0x1p-10f, 0x1p-20f, 0x1p-40f, 0.0f};

struct ExpTag {};
struct SumTag {};
struct CandidateTag {};

struct Candidate {
    float e;
    int64_t id;
};

// e^x of 16 values at this level (same bits at every level)
inline void exp16(const float* in, float* out) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(out, exp512(_mm512_loadu_ps(in)));
#elif defined(__AVX2__) && defined(__FMA__)
    _mm256_storeu_ps(out, exp256(_mm256_loadu_ps(in)));
    _mm256_storeu_ps(out + 8, exp256(_mm256_loadu_ps(in + 8)));
#else
    exp_lanes<16>(in, out);
#endif
}

// e[i] = exp(min(logits[i] * (1 / t), FLT_MAX) - max over i of the same), two passes over the logits (the
// product recomputed: cheaper than storing it). A NaN logit gets e = 0 and never counts as the largest. Beside
// them sums[b], the float64 sum of e over block b of kBlock tokens (16 fixed lanes, then the lanes in order), e
// below `floor` counted as 0; returns their sum.
double exponentials(const float* logits, int64_t V, float t, float floor, float* e, std::vector<double>& sums) {
    const float finite = std::numeric_limits<float>::max(), scale = 1.0f / t;
    float lane_max[kLanes];
    std::fill(lane_max, lane_max + kLanes, -std::numeric_limits<float>::infinity());
    const int64_t whole = V / kLanes * kLanes;
    for (int64_t i = 0; i < whole; i += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) {
            const float x = std::min(logits[i + l] * scale, finite);
            lane_max[l] = x > lane_max[l] ? x : lane_max[l];
        }
    }
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = whole; i < V; ++i) {
        const float x = std::min(logits[i] * scale, finite);
        m = x > m ? x : m;
    }
    for (int64_t l = 0; l < kLanes; ++l) m = lane_max[l] > m ? lane_max[l] : m;
    m = std::max(m, -finite);  // a row all -inf: every e is then 0
    float x[kLanes];
    const int64_t whole_end = V / kLanes * kLanes;
    for (int64_t i = 0; i < whole_end; i += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) x[l] = std::min(logits[i + l] * scale, finite) - m;
        exp16(x, e + i);
    }
    if (whole_end < V) {  // the row's last, partial 16: into the scratch's slack of kLanes floats past V
        for (int64_t l = 0; l < kLanes; ++l) {
            x[l] = whole_end + l < V ? std::min(logits[whole_end + l] * scale, finite) - m
                                     : -std::numeric_limits<float>::infinity();
        }
        exp16(x, e + whole_end);
    }
    // the sums in a pass of their own: beside the exponentials they cost more (measured)
    sums.assign((V + kBlock - 1) / kBlock, 0.0);
    double total = 0.0;
    for (int64_t b = 0; b < int64_t(sums.size()); ++b) {
        const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
        double lanes[kLanes] = {};
        int64_t i = lo;
        for (; i + kLanes <= hi; i += kLanes) {
            for (int64_t l = 0; l < kLanes; ++l) lanes[l] += e[i + l] >= floor ? double(e[i + l]) : 0.0;
        }
        for (int64_t l = 0; i < hi; ++i, ++l) lanes[l] += e[i] >= floor ? double(e[i]) : 0.0;
        double sum = 0.0;
        for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
        sums[b] = sum;
        total += sum;
    }
    return total;
}

// The first index of the row's largest logit (NaN never largest): the token of a row with no mass at all.
int64_t first_max(const float* logits, int64_t V) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i) best = logits[i] > logits[best] ? i : best;
    return best;
}

// The draw over every token with e >= floor: the block whose running sum passes u * total, then the token.
int64_t draw_all(const float* e, int64_t V, float floor, const std::vector<double>& sums, double total, double u,
                 const float* logits) {
    const double target = u * total;
    double before = 0.0;
    for (int64_t b = 0; b < int64_t(sums.size()); ++b) {
        if (before + sums[b] > target) {
            double running = 0.0;
            int64_t last = -1;
            for (int64_t i = b * kBlock; i < std::min(V, (b + 1) * kBlock); ++i) {
                if (e[i] < floor || e[i] == 0.0f) continue;
                running += e[i];
                last = i;
                if (running > target - before) return i;
            }
            if (last >= 0) return last;  // rounding left the target past the block's own running sum
        }
        before += sums[b];
    }
    for (int64_t i = V - 1; i >= 0; --i) {  // rounding past the total: the last token with mass
        if (e[i] >= floor && e[i] > 0.0f) return i;
    }
    return first_max(logits, V);  // no mass at all (every token filtered)
}

// The tokens with e >= threshold, as (e, id).
void collect(const float* e, int64_t V, float threshold, std::vector<Candidate>& out) {
    out.clear();
    int64_t i = 0;
    for (; i + kLanes <= V; i += kLanes) {
        bool any = false;
        for (int64_t l = 0; l < kLanes; ++l) any |= e[i + l] >= threshold;
        if (!any) continue;
        for (int64_t l = 0; l < kLanes; ++l) {
            if (e[i + l] >= threshold) out.push_back({e[i + l], i + l});
        }
    }
    for (; i < V; ++i) {
        if (e[i] >= threshold) out.push_back({e[i], i});
    }
}

// How many of the sorted candidates top-k and top-p keep, or -1 when the answer may lie below the threshold.
int64_t kept_by_filters(const std::vector<Candidate>& c, int64_t top_k, double top_p, double total, bool last) {
    int64_t kept = int64_t(c.size());
    double base = total;
    if (top_k > 0) {
        if (kept < top_k) return last ? kept : -1;
        kept = top_k;
        while (kept < int64_t(c.size()) && c[kept].e == c[top_k - 1].e) ++kept;  // ties with the k-th stay
        base = 0.0;
        for (int64_t j = 0; j < kept; ++j) base += c[j].e;
    }
    if (top_p >= 1.0) return kept;
    const double target = top_p * base;
    double before = 0.0;
    for (int64_t j = 0; j < kept; ++j) {
        if (before >= target) return j;
        before += c[j].e;
    }
    return top_k > 0 || last ? kept : -1;  // without top-k the nucleus may reach below the threshold
}

int64_t sample_row(const float* logits, int64_t V, float temperature, int64_t top_k, float top_p, float min_p,
                   double u) {
    std::vector<float>& e = thread_scratch::scratch<ExpTag, float>();
    std::vector<double>& sums = thread_scratch::scratch<SumTag, double>();
    std::vector<Candidate>& c = thread_scratch::scratch<CandidateTag, Candidate>();
    e.resize(V + kLanes);
    if (top_k >= V) top_k = 0;
    const bool filtered = top_k > 0 || top_p < 1.0f;
    // min-p alone filters the row's mass here; after top-k or top-p it applies to what they keep
    const double total = exponentials(logits, V, temperature, filtered ? 0.0f : min_p, e.data(), sums);
    if (!filtered) return draw_all(e.data(), V, min_p, sums, total, u, logits);
    int64_t kept = -1;
    for (float threshold : kThresholds) {
        collect(e.data(), V, threshold, c);
        std::sort(c.begin(), c.end(), [](const Candidate& a, const Candidate& b) {
            return a.e > b.e || (a.e == b.e && a.id < b.id);
        });
        kept = kept_by_filters(c, top_k, top_p, total, threshold == 0.0f);
        if (kept >= 0) break;
    }
    while (kept > 1 && c[kept - 1].e < min_p) --kept;  // min-p: the kept maximum is e = 1
    if (kept <= 0 || c[0].e <= 0.0f) return first_max(logits, V);  // no mass at all
    std::sort(c.begin(), c.begin() + kept, [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
    double mass = 0.0;
    for (int64_t j = 0; j < kept; ++j) mass += c[j].e;
    const double target = u * mass;
    double running = 0.0;
    for (int64_t j = 0; j < kept; ++j) {
        running += c[j].e;
        if (running > target && c[j].e > 0.0f) return c[j].id;
    }
    for (int64_t j = kept - 1; j >= 0; --j) {
        if (c[j].e > 0.0f) return c[j].id;
    }
    return first_max(logits, V);
}

}  // namespace

extern "C" void pagellm_sample_rows(const float* logits, int64_t rows, int64_t V, const float* temperature,
                                    const int64_t* top_k, const float* top_p, const float* min_p, const double* u,
                                    int64_t* out) {
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        out[r] = sample_row(logits + r * V, V, temperature[r], top_k[r], top_p[r], min_p[r], u[r]);
    }
}
