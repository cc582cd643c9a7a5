// PagedAttention for the CPU serving path: one call per layer for the whole
// batch (prefill, decode, chunked prefill and prefix-cached tails alike),
// reading K/V straight from the block pool, with an online softmax in fp32.
//
// Same contract as kernels/reference.py::paged_attention_ref. A work item is
// (sequence, tile of up to TILE_Q query tokens) with every head, so each block
// of K/V is streamed from memory once per item and each key is dotted with
// TILE_Q * group query rows (cpu_scores.h: 16 keys at once in prefill,
// one vector per key summed 16 at a time in decode). Blocks that consecutive
// sequences share at the start of their tables (a cached system prompt,
// parallel samples) are read once for all of them (cpu_cascade.h), their
// partial softmax merged into each member's. Items are spread over the OpenMP
// threads of torch's own runtime (the library links the libgomp torch already loaded).
//
// Built by kernels/cpu_build.py with g++ -O3 -march=native -fopenmp; no torch
// headers, plain pointers through ctypes, so it compiles in about a second.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <omp.h>

#include "cpu_bf16.h"
#include "cpu_cascade.h"
#include "cpu_common.h"
#include "cpu_scores.h"
#include "cpu_rows.h"

namespace {

using namespace pagedserve_cpu;

constexpr int TILE_Q = 32;
// block_scores transposes each block of keys once per item: it pays from about this many
// query rows per KV head (measured: at decode's 3 rows it made the step's attention 1.5x slower).
constexpr int VECTOR_SCORE_ROWS = 16;

// Folds blocks kb_begin .. of a block table into the rows' state. Token t
// sees keys 0 .. first_ctx + t - 1 (causal), from first_ctx + t - window on
// with a sliding window; keys past last_ctx are not read.
// Each block of the pool is read once, token by token with all KV heads
// together (they are contiguous in a slot). DT is head_dim when it is a
// multiple of LANES known at compile time (0: scalar loops over sh.head_dim).
// KT is the pool's element type: T, or an fp8 format dequantized on load; its
// per-layer scales are folded into the queries (k) and the output (v), so they
// cost nothing per key.
template <typename KT, int DT>
void attend(const KT* k_cache, const KT* v_cache, const int32_t* table, int kb_begin, int first_ctx, int last_ctx,
            Rows& w, const Shape& sh) {
  const int D = DT > 0 ? DT : sh.head_dim;
  const int KVH = sh.num_kv_heads, G = sh.num_heads / KVH, BS = sh.block_size;
  // A bf16 pool (so bf16 q) in whole 16-key blocks: pairs of bf16 per instruction (cpu_bf16.h).
  constexpr bool PAIRS = BF16_PAIRS && std::is_same_v<KT, uint16_t> && DT > 0 && DT % 32 == 0;
  const bool pairs = PAIRS && BS == LANES && w.qh != nullptr;
  const int nq = w.nq, rows = w.rows, per_kv = w.per_kv;
  float *qs = w.qs, *acc = w.acc, *m = w.m, *l = w.l, *s = w.s;
  const int64_t tok_stride = static_cast<int64_t>(KVH) * D;  // between slots of a block
  const int num_blocks = (last_ctx + BS - 1) / BS;
  const int64_t block_elems = static_cast<int64_t>(BS) * tok_stride;
  auto tokens_in = [&](int kb) { return std::min(BS, last_ctx - kb * BS); };
  for (int kb = kb_begin; kb < std::min(kb_begin + AHEAD, num_blocks); ++kb) {
    prefetch(k_cache + table[kb] * block_elems, tokens_in(kb) * tok_stride);
    prefetch(v_cache + table[kb] * block_elems, tokens_in(kb) * tok_stride);
  }
  for (int kb = kb_begin; kb < num_blocks; ++kb) {
    const KT* kblk = k_cache + table[kb] * block_elems;
    const KT* vblk = v_cache + table[kb] * block_elems;
    const int n = tokens_in(kb);
    const int n_ahead = kb + AHEAD < num_blocks ? tokens_in(kb + AHEAD) : 0;
    const KT* k_ahead = n_ahead > 0 ? k_cache + table[kb + AHEAD] * block_elems : nullptr;
    const KT* v_ahead = n_ahead > 0 ? v_cache + table[kb + AHEAD] * block_elems : nullptr;
    if (DT > 0 && BS == LANES && per_kv >= VECTOR_SCORE_ROWS) {  // scores of 16 keys in one vector
      prefetch_slots(k_ahead, v_ahead, 0, n_ahead, tok_stride);
      if constexpr (PAIRS) {
        if (pairs) block_scores_bf16<DT>(kblk, n, tok_stride, KVH, per_kv, w.qh, w.qscale, s);
      }
      if (!pairs) block_scores<KT, (DT > 0 ? DT : LANES)>(kblk, n, tok_stride, KVH, per_kv, qs, s);
    } else if (DT > 0 && BS == LANES && n == LANES) {  // a full block, few rows
      if constexpr (PAIRS) {
        if (pairs) block_dots_bf16<DT>(kblk, tok_stride, KVH, per_kv, w.qh, w.qscale, s, k_ahead, v_ahead, n_ahead);
      }
      if (!pairs) block_dots<KT, (DT > 0 ? DT : LANES)>(kblk, tok_stride, KVH, per_kv, qs, s, k_ahead, v_ahead, n_ahead);
    } else {
      // Scores. Key i is visible to token t when kb * BS + i < first_ctx + t (causal).
      for (int i = 0; i < n; ++i) {
        // Spread between the keys: a burst of prefetches stalls on the miss buffers.
        prefetch_slots(k_ahead, v_ahead, i, std::min(i + 1, n_ahead), tok_stride);
        const int t_min = std::max(0, kb * BS + i - first_ctx + 1);
        for (int kvh = 0; kvh < KVH; ++kvh) {
          const KT* kr = kblk + i * tok_stride + kvh * D;
          for (int rr = t_min * G; rr < per_kv; ++rr) {
            const int r = kvh * per_kv + rr;
            const float* qr = qs + r * D;
            float dot;
            if constexpr (DT > 0) {
              vf a = loadv(qr) * loadv(kr);
              for (int d = LANES; d < DT; d += LANES) a += loadv(qr + d) * loadv(kr + d);
              dot = hsum(a);
            } else {
              dot = 0.0f;
#pragma omp simd reduction(+ : dot)
              for (int d = 0; d < D; ++d) dot += qr[d] * load(kr + d);
            }
            s[r * BS + i] = dot;
          }
        }
      }
    }
    // Online softmax: rescale what was accumulated, turn scores into weights.
    // Row r sees this block's keys i0 <= i < nv (causal, and its window).
    for (int r = 0; r < rows; ++r) {
      const int t = (r / G) % nq;
      const int hi = first_ctx + t - kb * BS;
      const int nv = std::min(n, hi);
      const int i0 = sh.window > 0 ? std::max(0, hi - sh.window) : 0;
      float* sr = s + r * BS;
      if (nv <= i0) {
        std::fill(sr, sr + n, 0.0f);
        continue;
      }
      if (sh.softcap > 0.0f) {
        const float cap = sh.softcap, inv = 1.0f / sh.softcap;
#pragma omp simd
        for (int i = i0; i < nv; ++i) sr[i] = cap * std::tanh(sr[i] * inv);
      }
      float mx = m[r];
      for (int i = i0; i < nv; ++i) mx = std::max(mx, sr[i]);
      const float corr = exp_nonpositive(m[r] - mx);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int i = i0; i < nv; ++i) {
        sr[i] = exp_nonpositive(sr[i] - mx);
        sum += sr[i];
      }
      std::fill(sr, sr + i0, 0.0f);
      std::fill(sr + nv, sr + n, 0.0f);
      l[r] = l[r] * corr + sum;
      m[r] = mx;
      float* ar = acc + r * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) ar[d] *= corr;
    }
    // Weighted values, a chunk of rows of one KV head at a time kept in
    // registers, each value row loaded once per chunk. Weights of keys a row
    // must not see are 0.
    for (int kvh = 0; kvh < KVH; ++kvh)
      for (int c0 = 0; c0 < per_kv; c0 += ROW_CHUNK) {
        const int nc = std::min(ROW_CHUNK, per_kv - c0), r0 = kvh * per_kv + c0;
        if constexpr (PAIRS) {
          if (pairs) {
            weighted_values_bf16<DT, ROW_CHUNK>(vblk, n, tok_stride, kvh, s, r0, nc, acc);
            continue;
          }
        }
        if constexpr (DT > 0) {
          constexpr int NV = DT / LANES;
          vf a[ROW_CHUNK][NV];
          for (int c = 0; c < nc; ++c)
            for (int j = 0; j < NV; ++j) a[c][j] = loadv(acc + (r0 + c) * D + j * LANES);
          for (int i = 0; i < n; ++i) {
            const KT* vr = vblk + i * tok_stride + kvh * D;
            vf v[NV];
            for (int j = 0; j < NV; ++j) v[j] = loadv(vr + j * LANES);
            for (int c = 0; c < nc; ++c) {
              const float p = s[(r0 + c) * BS + i];
              for (int j = 0; j < NV; ++j) a[c][j] += p * v[j];
            }
          }
          for (int c = 0; c < nc; ++c)
            for (int j = 0; j < NV; ++j) storev(acc + (r0 + c) * D + j * LANES, a[c][j]);
        } else {
          for (int i = 0; i < n; ++i) {
            const KT* vr = vblk + i * tok_stride + kvh * D;
            for (int c = 0; c < nc; ++c) {
              const float p = s[(r0 + c) * BS + i];
              float* ar = acc + (r0 + c) * D;
#pragma omp simd
              for (int d = 0; d < D; ++d) ar[d] += p * load(vr + d);
            }
          }
        }
      }
  }
}

// Item index -> (owner, index within it), from prefix sums of items per owner.
inline std::pair<int, int64_t> locate(const std::vector<int64_t>& first, int64_t w) {
  const int o = static_cast<int>(std::upper_bound(first.begin(), first.end(), w) - first.begin()) - 1;
  return {o, w - first[o]};
}

template <typename T, typename KT, int DT>
void paged_attention(const T* q, const KT* k_cache, const KT* v_cache, const int32_t* block_tables,
                     const int32_t* seq_lens, const int32_t* qsl, T* out, int num_seqs, const Shape& sh) {
  const int D = DT > 0 ? DT : sh.head_dim, H = sh.num_heads, G = H / sh.num_kv_heads;
  std::vector<Group> groups = find_groups(block_tables, sh.table_stride, seq_lens, qsl, num_seqs, sh.block_size, TILE_Q);
  // A shared prefix's partial softmax is over keys every member sees: not so behind a sliding window.
  if (sh.window > 0) groups.clear();
  std::vector<const Group*> group_of(num_seqs, nullptr);
  std::vector<int64_t> pfirst(groups.size() + 1, 0);  // prefix items
  const int per_group = (2 * omp_get_max_threads() + static_cast<int>(groups.size()) - 1) /
                        std::max<int>(1, static_cast<int>(groups.size()));
  size_t part_size = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& g = groups[gi];
    g.chunks = std::max(1, std::min(per_group, g.shared / MIN_SHARED_BLOCKS));
    g.part = part_size;
    part_size += static_cast<size_t>(g.chunks) * (qsl[g.seq_end] - qsl[g.seq_begin]) * H * (D + 2);
    pfirst[gi + 1] = pfirst[gi] + g.chunks;
    for (int s = g.seq_begin; s < g.seq_end; ++s) group_of[s] = &g;
  }
  std::vector<float> parts(part_size);
  std::vector<int64_t> first(num_seqs + 1, 0);  // tiles of each sequence
  for (int i = 0; i < num_seqs; ++i) first[i + 1] = first[i] + (qsl[i + 1] - qsl[i] + TILE_Q - 1) / TILE_Q;
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < pfirst.back(); ++w) {  // chunks of shared blocks, every member's rows
      const auto [gi, c] = locate(pfirst, w);
      const Group& g = groups[gi];
      const int kb0 = static_cast<int>(c * g.shared / g.chunks), kb1 = static_cast<int>((c + 1) * g.shared / g.chunks);
      const int tok0 = qsl[g.seq_begin];
      Rows rw = load_rows(q, tok0, qsl[g.seq_end] - tok0, D, sh, scratch);
      const int32_t* table = block_tables + static_cast<int64_t>(g.seq_begin) * sh.table_stride;
      attend<KT, DT>(k_cache, v_cache, table, kb0, kb1 * sh.block_size, kb1 * sh.block_size, rw, sh);
      float* dst = parts.data() + g.part + static_cast<size_t>(c) * rw.rows * (D + 2);
      std::copy(rw.acc, rw.acc + static_cast<size_t>(rw.rows) * D, dst);
      std::copy(rw.m, rw.m + 2 * rw.rows, dst + static_cast<size_t>(rw.rows) * D);  // m, then l
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < first.back(); ++w) {  // tiles of every sequence, past its group's shared blocks
      const auto [seq, tile] = locate(first, w);
      const int q_begin = qsl[seq], q_len = qsl[seq + 1] - q_begin;
      const int q0 = static_cast<int>(tile) * TILE_Q, nq = std::min(TILE_Q, q_len - q0);
      const int first_ctx = seq_lens[seq] - q_len + q0 + 1;  // keys visible to the tile's first token
      const Group* g = group_of[seq];
      // With a window, from the block of the first key the tile's first token sees: long contexts skip the rest.
      const int kb_begin = g != nullptr ? g->shared : sh.window > 0 ? std::max(0, first_ctx - sh.window) / sh.block_size : 0;
      Rows rw = load_rows(q, q_begin + q0, nq, D, sh, scratch);
      attend<KT, DT>(k_cache, v_cache, block_tables + static_cast<int64_t>(seq) * sh.table_stride,
                     kb_begin, first_ctx, first_ctx + nq - 1, rw, sh);
      if (g != nullptr) {
        const int nt = qsl[g->seq_end] - qsl[g->seq_begin], off = q_begin - qsl[g->seq_begin], prows = nt * H;
        auto row_of = [&](int r) { return ((r / (nq * G)) * nt + off + (r / G) % nq) * G + r % G; };
        for (int c = 0; c < g->chunks; ++c) {
          const float* p = parts.data() + g->part + static_cast<size_t>(c) * prows * (D + 2);
          merge(rw, p, p + static_cast<size_t>(prows) * D, p + static_cast<size_t>(prows) * D + prows, D, row_of);
        }
      }
      store_rows(rw, q_begin + q0, D, out, sh);
    }
  }
}

template <typename T, typename KT>
void dispatch(const T* q, const void* k_cache, const void* v_cache, const int32_t* block_tables, const int32_t* seq_lens,
              const int32_t* query_start_loc, T* out, int num_seqs, const Shape& sh) {
  const KT* k = static_cast<const KT*>(k_cache);
  const KT* v = static_cast<const KT*>(v_cache);
  switch (sh.head_dim) {  // the common sizes get fully unrolled dot products
    case 64: return paged_attention<T, KT, 64>(q, k, v, block_tables, seq_lens, query_start_loc, out, num_seqs, sh);
    case 128: return paged_attention<T, KT, 128>(q, k, v, block_tables, seq_lens, query_start_loc, out, num_seqs, sh);
    default: return paged_attention<T, KT, 0>(q, k, v, block_tables, seq_lens, query_start_loc, out, num_seqs, sh);
  }
}

// kv_dtype: the pool's element type, the q dtype's own (T) or an fp8 format.
template <typename T>
int dispatch_kv(int kv_dtype, const T* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
                const int32_t* seq_lens, const int32_t* query_start_loc, T* out, int num_seqs, const Shape& sh) {
  switch (kv_dtype) {
    case KV_SAME: dispatch<T, T>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, num_seqs, sh); return 0;
    case KV_FP8_E4M3: dispatch<T, fp8e4>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, num_seqs, sh); return 0;
    case KV_FP8_E5M2: dispatch<T, fp8e5>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, num_seqs, sh); return 0;
    default: return 2;
  }
}

}  // namespace

extern "C" {

// dtype (q and out): 0 float32, 1 bfloat16. kv_dtype: 0 the same as q, 2 fp8
// e4m3, 3 fp8 e5m2, with k_scale / v_scale pointing at the layer's scales (read
// only for fp8). window: the sliding window (0: none); softcap: the tanh cap
// on the scaled scores (0: none). Returns 0, or a positive code for bad arguments.
int pagedserve_paged_attention_ex(int dtype, int kv_dtype, const void* q, const void* k_cache, const void* v_cache,
                                  const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start_loc,
                                  void* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                                  int table_stride, int64_t q_stride, float scale, const float* k_scale,
                                  const float* v_scale, int window, float softcap) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0) return 1;
  if (q_stride < static_cast<int64_t>(num_heads) * head_dim) return 1;
  if (window < 0 || !(softcap >= 0.0f)) return 1;
  const bool fp8 = kv_dtype == KV_FP8_E4M3 || kv_dtype == KV_FP8_E5M2;
  const Shape sh{num_heads, num_kv_heads, head_dim, block_size, table_stride, q_stride, scale,
                 fp8 ? *k_scale : 1.0f, fp8 ? *v_scale : 1.0f, window, softcap};
  if (dtype == 0)
    return dispatch_kv(kv_dtype, static_cast<const float*>(q), k_cache, v_cache, block_tables, seq_lens,
                       query_start_loc, static_cast<float*>(out), num_seqs, sh);
  if (dtype == 1)
    return dispatch_kv(kv_dtype, static_cast<const uint16_t*>(q), k_cache, v_cache, block_tables, seq_lens,
                       query_start_loc, static_cast<uint16_t*>(out), num_seqs, sh);
  return 2;
}

// The groups of the shared-prefix path for a batch (tests check them): up to
// max_groups (first sequence, end, shared blocks) triples into out; returns
// how many there are.
int pagedserve_cascade_groups(const int32_t* block_tables, int table_stride, const int32_t* seq_lens,
                              const int32_t* query_start_loc, int num_seqs, int block_size, int32_t* out,
                              int max_groups) {
  const std::vector<Group> groups =
      find_groups(block_tables, table_stride, seq_lens, query_start_loc, num_seqs, block_size, TILE_Q);
  for (int i = 0; i < std::min<int>(max_groups, static_cast<int>(groups.size())); ++i) {
    out[3 * i] = groups[i].seq_begin;
    out[3 * i + 1] = groups[i].seq_end;
    out[3 * i + 2] = groups[i].shared;
  }
  return static_cast<int>(groups.size());
}

}  // extern "C"
