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

#include "attention_common.h"  // bf16, kChunk, to_float / from_float, prefetch_line

// ---------------------------------------------------------------------------------------------
// Inner loops: scores of a chunk, softmax update, V accumulation. AVX-512, AVX2 and scalar
// versions, one header each, chosen by the compiler's macros as the build's level sets them.
#ifdef __AVX512F__
#include "attention_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)  // the AVX-512 path on 8-lane registers, same bits
#include "attention_avx2.h"
#else  // scalar fallback: same structure, plain loops
#include "attention_scalar.h"
#endif  // __AVX512F__, __AVX2__ && __FMA__, scalar

namespace {

constexpr int64_t kTileRows = 32;        // target rows per task: K/V reuse vs. Q+acc staying in L1/L2
constexpr int64_t kMinSplitKeys = 128;   // below this a split costs more in merging than it gains
constexpr int kUnitsPerThread = 4;       // split granularity so dynamic scheduling can balance
// Less work than this is not worth waking a thread. Its time: docs/benchmarks/2026-11-24-quantized-layer-crossovers.md;
// a lone decode over one KV head (Gemma 3 270M) at a few hundred keys gains from the split above this.
// measured: docs/benchmarks/2026-11-27-weight-prefetch.md
constexpr int64_t kMinParallelMacs = int64_t(1) << 17;

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

// T: the queries' and outputs' type; C: the cache's (the same, or bf16 under fp32 queries: K/V stored in half
// the bytes a decode step streams, read exactly as fp32 by the loads of every level).
template <typename T, typename C>
struct Problem : Shape {
  T* out;  // [T, H_q, D], contiguous
  const T* query;
  const C* key_cache;
  const C* value_cache;
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

template <typename T, typename C>
void load_queries(const Problem<T, C>& pb, const Task& t, Workspace<T>& ws) {
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
template <typename T, typename C>
void chunk_rows(const Problem<T, C>& pb, const int64_t* table, int64_t kv_head, int64_t c0, int c,
                const C** k, const C** v) {
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
template <typename T, typename C>
void attend_range(const Problem<T, C>& pb, const Task& t, int64_t lo, int64_t hi, Workspace<T>& ws) {
  const int64_t D = pb.head_dim, G = pb.group(), R = t.ntok * G;
  const int64_t* table = pb.block_tables + t.seq * pb.table_stride;
  std::fill(ws.m, ws.m + R, kNegInf);
  std::fill(ws.l, ws.l + R, 0.0f);
  std::fill(ws.acc, ws.acc + R * D, 0.0f);
  const C* rows[2][2][kChunk];  // [this chunk, next chunk][K, V][key]
  if (lo < hi) chunk_rows(pb, table, t.kv_head, lo, int(std::min<int64_t>(kChunk, hi - lo)), rows[0][0], rows[0][1]);
  for (int64_t c0 = lo, cur = 0; c0 < hi; c0 += kChunk, cur ^= 1) {
    int c = int(std::min<int64_t>(kChunk, hi - c0));
    const C** k = rows[cur][0];
    const C** v = rows[cur][1];
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

template <typename T, typename C>
T* output_row(const Problem<T, C>& pb, const Task& t, int64_t r) {
  const int64_t G = pb.group();
  return pb.out + ((t.tok0 + r / G) * pb.num_heads + t.kv_head * G + r % G) * pb.head_dim;
}

// Partial slot layout: [R] max, [R] sum, [R, D] accumulator. Every slot of a call has the
// size for the largest task (tasks of one call differ little), which keeps indexing simple.
inline int64_t slot_floats(int64_t R, int64_t D) { return R * (D + 2); }

template <typename T, typename C>
void run_unit(const Problem<T, C>& pb, const Task& t, int64_t split, Workspace<T>& ws, float* partials,
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
template <typename T, typename C>
void merge_splits(const Problem<T, C>& pb, const Task& t, const float* partials, int64_t slot, float* row) {
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

template <typename T, typename C>
std::vector<Task> make_tasks(const Problem<T, C>& pb) {
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

template <typename T, typename C>
void run(const Problem<T, C>& pb, int nthreads) {
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

// dtype (query, out) and cache_dtype (key_cache, value_cache): 0 = float32, 1 = bfloat16, 2 = float16; the pairs
// taken are (0, 0), (1, 1), (0, 1) and (0, 2). window <= 0: no sliding window; soft_cap <= 0: none. head_dim must be a multiple
// of 16. Returns 0, -1 for an unsupported dtype pair, -2 out of memory.
extern "C" int pagellm_paged_attention(
    void* out, const void* query, const void* key_cache, const void* value_cache,
    const int64_t* block_tables, const int64_t* query_start_loc, const int64_t* seq_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t table_stride, int64_t q_stride_tok, int64_t q_stride_head,
    int64_t k_stride_block, int64_t k_stride_tok, int64_t k_stride_head,
    int64_t v_stride_block, int64_t v_stride_tok, int64_t v_stride_head,
    float scale, int64_t window, float soft_cap, int dtype, int cache_dtype, int num_threads) {
  const Shape shape{block_tables, query_start_loc, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim,
                    block_size, table_stride, q_stride_tok, q_stride_head, k_stride_block, k_stride_tok,
                    k_stride_head, v_stride_block, v_stride_tok, v_stride_head, scale, window, soft_cap};
  auto solve = [&](auto* typed_out, auto* typed_cache) {
    using T = std::remove_pointer_t<decltype(typed_out)>;
    using C = std::remove_pointer_t<decltype(typed_cache)>;
    run(Problem<T, C>{shape, static_cast<T*>(out), static_cast<const T*>(query), static_cast<const C*>(key_cache),
                      static_cast<const C*>(value_cache)},
        num_threads);
    return 0;
  };
  try {
    if (dtype == 0 && cache_dtype == 0) return solve(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
    if (dtype == 1 && cache_dtype == 1) return solve(static_cast<bf16*>(nullptr), static_cast<bf16*>(nullptr));
    if (dtype == 0 && cache_dtype == 1) return solve(static_cast<float*>(nullptr), static_cast<bf16*>(nullptr));
    if (dtype == 0 && cache_dtype == 2) return solve(static_cast<float*>(nullptr), static_cast<f16*>(nullptr));
  } catch (const std::bad_alloc&) {  // planning vectors; nothing may unwind into ctypes
    return -2;
  }
  return -1;
}
