// PagedAttention for the CPU serving path: one call per layer for the whole
// batch (prefill, decode, chunked prefill and prefix-cached tails alike),
// reading K/V straight from the block pool, with an online softmax in fp32.
//
// Same contract as kernels/reference.py::paged_attention_ref. A work item is
// (sequence, tile of up to TILE_Q query tokens) with every head, so each block
// of K/V is streamed from memory once per item and each key is dotted with
// TILE_Q * group query rows (scores of 16 keys at once in prefill:
// block_scores). Items are spread over the OpenMP threads of
// torch's own runtime (the library links the libgomp torch already loaded).
//
// Built by kernels/cpu_build.py with g++ -O3 -march=native -fopenmp; no torch
// headers, plain pointers through ctypes, so it compiles in about a second.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace pagedserve_cpu;

constexpr int TILE_Q = 32;
// block_scores transposes each block of keys once per item: it pays from about this many
// query rows per KV head (measured: at decode's 3 rows it made the step's attention 1.5x slower).
constexpr int VECTOR_SCORE_ROWS = 16;

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_size, table_stride;
  int64_t q_stride;  // elements between two tokens of q (a view into the fused QKV rows, or heads * head_dim)
  float scale;
  float k_scale, v_scale;  // fp8 pools: stored = value / scale (1 for 16/32-bit pools)
};

// Block tables jump around the pool, where no hardware prefetcher follows,
// and one block's K/V are read faster than memory answers a miss: so while
// block kb is read, token i's slot of block kb + AHEAD is prefetched.
constexpr int AHEAD = 2;

template <typename T>
inline void prefetch(const T* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 3);
}

// Up to this many query rows accumulate in registers at once.
constexpr int ROW_CHUNK = 4;

// Scores of every row against a block of LANES keys, 16 to a vector: the
// block's keys of one KV head are transposed to [DT][16] floats once (fp8 and
// bf16 decoded there), then each row is DT broadcast multiply-adds, no sum
// reduced across lanes. Four rows at a time share each key vector. Keys past
// n are zero; scores a row must not see are written too, and the softmax reads
// only the visible ones.
template <typename KT, int DT>
inline void block_scores(const KT* kblk, int n, int64_t tok_stride, int KVH, int per_kv, const float* qs, float* s) {
  alignas(64) float kt[DT * LANES];
  for (int kvh = 0; kvh < KVH; ++kvh) {
    for (int i = 0; i < LANES; ++i) {
      const KT* kr = kblk + i * tok_stride + kvh * DT;
      for (int d = 0; d < DT; ++d) kt[d * LANES + i] = i < n ? load(kr + d) : 0.0f;
    }
    const int r_end = (kvh + 1) * per_kv;
    int r = kvh * per_kv;
    for (; r + 4 <= r_end; r += 4) {
      vf a[4] = {};
      for (int d = 0; d < DT; ++d) {
        const vf kv = loadv(kt + d * LANES);
        for (int c = 0; c < 4; ++c) a[c] += qs[(r + c) * DT + d] * kv;
      }
      for (int c = 0; c < 4; ++c) storev(s + (r + c) * LANES, a[c]);
    }
    for (; r < r_end; ++r) {
      vf a0 = {}, a1 = {};
      for (int d = 0; d < DT; d += 2) {
        a0 += qs[r * DT + d] * loadv(kt + d * LANES);
        a1 += qs[r * DT + d + 1] * loadv(kt + (d + 1) * LANES);
      }
      storev(s + r * LANES, a0 + a1);
    }
  }
}

// One work item: a sequence's tile of up to TILE_Q query tokens, every head.
// Each block of the pool is read once per item, token by token with all KV
// heads together (they are contiguous in a slot). DT is head_dim when it is a
// multiple of LANES known at compile time (0: scalar loops over sh.head_dim).
// Rows are ordered (kv head, token, group member): row r of KV head h is
// query token t = (r / G) % nq of head h * G + r % G.
// KT is the pool's element type: T, or an fp8 format dequantized on load; its
// per-layer scales are folded into the queries (k) and the output (v), so they
// cost nothing per key.
template <typename T, typename KT, int DT>
void run_item(const T* q, const KT* k_cache, const KT* v_cache, const int32_t* table, int seq_len, int q_begin,
              int q_len, int tile, T* out, const Shape& sh, std::vector<float>& scratch) {
  const int D = DT > 0 ? DT : sh.head_dim;
  const int H = sh.num_heads, KVH = sh.num_kv_heads, G = H / KVH, BS = sh.block_size;
  const int q0 = tile * TILE_Q, nq = std::min(TILE_Q, q_len - q0), rows = nq * H, per_kv = nq * G;
  const int64_t tok_stride = static_cast<int64_t>(KVH) * D;  // between slots of a block
  scratch.assign(static_cast<size_t>(rows) * (2 * D + 2 + BS), 0.0f);
  float* qs = scratch.data();                        // [rows, D] scaled queries
  float* acc = qs + static_cast<size_t>(rows) * D;   // [rows, D] unnormalised output
  float* m = acc + static_cast<size_t>(rows) * D;    // [rows] running max
  float* l = m + rows;                               // [rows] running sum of exp
  float* s = l + rows;                               // [rows, BS] scores, then weights, of one block
  for (int kvh = 0; kvh < KVH; ++kvh)
    for (int t = 0; t < nq; ++t)
      for (int g = 0; g < G; ++g) {
        const int r = (kvh * nq + t) * G + g;
        const T* src = q + static_cast<int64_t>(q_begin + q0 + t) * sh.q_stride + (kvh * G + g) * D;
        for (int d = 0; d < D; ++d) qs[r * D + d] = load(src + d) * (sh.scale * sh.k_scale);
        m[r] = -FLT_MAX;
      }
  const int first_ctx = seq_len - q_len + q0 + 1;  // keys visible to the tile's first token
  const int last_ctx = first_ctx + nq - 1;
  const int num_blocks = (last_ctx + BS - 1) / BS;
  const int64_t block_elems = static_cast<int64_t>(BS) * tok_stride;
  auto tokens_in = [&](int kb) { return std::min(BS, last_ctx - kb * BS); };
  for (int kb = 0; kb < std::min(AHEAD, num_blocks); ++kb) {
    prefetch(k_cache + table[kb] * block_elems, tokens_in(kb) * tok_stride);
    prefetch(v_cache + table[kb] * block_elems, tokens_in(kb) * tok_stride);
  }
  for (int kb = 0; kb < num_blocks; ++kb) {
    const KT* kblk = k_cache + table[kb] * block_elems;
    const KT* vblk = v_cache + table[kb] * block_elems;
    const int n = tokens_in(kb);
    const int n_ahead = kb + AHEAD < num_blocks ? tokens_in(kb + AHEAD) : 0;
    const KT* k_ahead = n_ahead > 0 ? k_cache + table[kb + AHEAD] * block_elems : nullptr;
    const KT* v_ahead = n_ahead > 0 ? v_cache + table[kb + AHEAD] * block_elems : nullptr;
    for (int i = 0; i < n_ahead; ++i) {
      prefetch(k_ahead + i * tok_stride, tok_stride);
      prefetch(v_ahead + i * tok_stride, tok_stride);
    }
    if (DT > 0 && BS == LANES && per_kv >= VECTOR_SCORE_ROWS) {  // scores of 16 keys in one vector
      block_scores<KT, (DT > 0 ? DT : LANES)>(kblk, n, tok_stride, KVH, per_kv, qs, s);
    } else {
      // Scores. Key i is visible to token t when kb * BS + i < first_ctx + t (causal).
      for (int i = 0; i < n; ++i) {
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
    for (int r = 0; r < rows; ++r) {
      const int t = (r / G) % nq;
      const int nv = std::min(n, first_ctx + t - kb * BS);
      float* sr = s + r * BS;
      if (nv <= 0) {
        std::fill(sr, sr + n, 0.0f);
        continue;
      }
      float mx = m[r];
      for (int i = 0; i < nv; ++i) mx = std::max(mx, sr[i]);
      const float corr = exp_nonpositive(m[r] - mx);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < nv; ++i) {
        sr[i] = exp_nonpositive(sr[i] - mx);
        sum += sr[i];
      }
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
  for (int kvh = 0; kvh < KVH; ++kvh)
    for (int t = 0; t < nq; ++t)
      for (int g = 0; g < G; ++g) {
        const int r = (kvh * nq + t) * G + g;
        T* dst = out + (static_cast<int64_t>(q_begin + q0 + t) * H + kvh * G + g) * D;
        const float inv = sh.v_scale / l[r];
        for (int d = 0; d < D; ++d) store(dst + d, acc[r * D + d] * inv);
      }
}

template <typename T, typename KT, int DT>
void paged_attention(const T* q, const KT* k_cache, const KT* v_cache, const int32_t* block_tables,
                     const int32_t* seq_lens, const int32_t* query_start_loc, T* out, int num_seqs, const Shape& sh) {
  // Item index -> (seq, tile): prefix sums of tiles per sequence.
  std::vector<int64_t> first(num_seqs + 1, 0);
  for (int i = 0; i < num_seqs; ++i) {
    const int q_len = query_start_loc[i + 1] - query_start_loc[i];
    first[i + 1] = first[i] + (q_len + TILE_Q - 1) / TILE_Q;
  }
  const int64_t total = first[num_seqs];
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < total; ++w) {
      const int seq = static_cast<int>(std::upper_bound(first.begin(), first.end(), w) - first.begin()) - 1;
      const int tile = static_cast<int>(w - first[seq]);
      const int q_begin = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q_begin;
      run_item<T, KT, DT>(q, k_cache, v_cache, block_tables + static_cast<int64_t>(seq) * sh.table_stride, seq_lens[seq],
                      q_begin, q_len, tile, out, sh, scratch);
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
// only for fp8). Returns 0, or a positive code for bad arguments.
int pagedserve_paged_attention(int dtype, int kv_dtype, const void* q, const void* k_cache, const void* v_cache,
                               const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start_loc,
                               void* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int table_stride, int64_t q_stride, float scale, const float* k_scale,
                               const float* v_scale) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0) return 1;
  if (q_stride < static_cast<int64_t>(num_heads) * head_dim) return 1;
  const bool fp8 = kv_dtype == KV_FP8_E4M3 || kv_dtype == KV_FP8_E5M2;
  const Shape sh{num_heads, num_kv_heads, head_dim, block_size, table_stride, q_stride, scale,
                 fp8 ? *k_scale : 1.0f, fp8 ? *v_scale : 1.0f};
  if (dtype == 0)
    return dispatch_kv(kv_dtype, static_cast<const float*>(q), k_cache, v_cache, block_tables, seq_lens,
                       query_start_loc, static_cast<float*>(out), num_seqs, sh);
  if (dtype == 1)
    return dispatch_kv(kv_dtype, static_cast<const uint16_t*>(q), k_cache, v_cache, block_tables, seq_lens,
                       query_start_loc, static_cast<uint16_t*>(out), num_seqs, sh);
  return 2;
}

}  // extern "C"
