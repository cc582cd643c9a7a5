// Scores of query rows against one block of keys, for cpu_attention.cpp:
// transposed keys for many rows (prefill), one vector per key reduced 16 at
// a time for a few (decode), and the software prefetch of blocks ahead.
#pragma once
#include <cstdint>
#include <type_traits>

#include "cpu_common.h"

namespace pagedserve_cpu {

// Block tables jump around the pool, where no hardware prefetcher follows,
// and one block's K/V are read faster than memory answers a miss: so while
// block kb is read, token i's slot of block kb + AHEAD is prefetched, into
// L2 (locality 1): into L1 (3) the prefetches stalled on the fill buffers and
// a 64-sequence decode over 1,800-token contexts took 1.2-1.4x as long.
constexpr int AHEAD = 2;

template <typename T>
inline void prefetch(const T* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 1);
}

// Slots from .. to - 1 of the K and V blocks ahead (nothing when those are null: no block ahead).
template <typename KT>
inline void prefetch_slots(const KT* k_ahead, const KT* v_ahead, int from, int to, int64_t tok_stride) {
  for (int i = from; i < to; ++i) {
    prefetch(k_ahead + i * tok_stride, tok_stride);
    prefetch(v_ahead + i * tok_stride, tok_stride);
  }
}

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

// Sums of 16 vectors, lane i of the result being the sum of a[i]: pairs of
// vectors fold halves into one (16 -> 8 -> 4 -> 2 -> 1 vectors), 15 adds and
// 30 shuffles where 16 separate horizontal sums take about 7 operations each.
inline vf sum16(vf* a) {
  const vu lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vu hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vu lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vu hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vu lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vu hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vu lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vu hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  for (int i = 0; i < 8; ++i) a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo1) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi1);
  for (int i = 0; i < 4; ++i) a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo2) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi2);
  for (int i = 0; i < 2; ++i) a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo3) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi3);
  return __builtin_shuffle(a[0], a[1], lo4) + __builtin_shuffle(a[0], a[1], hi4);
}

// Scores of a few rows (decode's group of query heads) against a full block of
// LANES keys: each key's dot product in one vector, the 16 reduced together
// (sum16). Below VECTOR_SCORE_ROWS rows this beats transposing the block.
// The n_ahead slots of the block after next are prefetched a few per row,
// spread over the work (a burst of prefetches stalls on the miss buffers).
template <typename KT, int DT>
inline void block_dots(const KT* kblk, int64_t tok_stride, int KVH, int per_kv, const float* qs, float* s,
                       const KT* k_ahead, const KT* v_ahead, int n_ahead) {
  constexpr int NV = DT / LANES;
  constexpr bool DECODE = !std::is_same_v<KT, float>;
  // bf16 and fp8 keys are decoded once per KV head, not once per row.
  alignas(64) float kf[DECODE ? LANES * DT : 1];
  const int rows = KVH * per_kv;
  for (int kvh = 0; kvh < KVH; ++kvh) {
    const float* kbase;
    int64_t kstride;
    if constexpr (DECODE) {
      for (int i = 0; i < LANES; ++i)
        for (int j = 0; j < NV; ++j) storev(kf + i * DT + j * LANES, loadv(kblk + i * tok_stride + kvh * DT + j * LANES));
      kbase = kf;
      kstride = DT;
    } else {
      kbase = kblk + kvh * DT;
      kstride = tok_stride;
    }
    for (int r = kvh * per_kv; r < (kvh + 1) * per_kv; ++r) {
      prefetch_slots(k_ahead, v_ahead, r * n_ahead / rows, (r + 1) * n_ahead / rows, tok_stride);
      vf qv[NV];
      for (int j = 0; j < NV; ++j) qv[j] = loadv(qs + r * DT + j * LANES);
      vf a[LANES];
      for (int i = 0; i < LANES; ++i) {
        const float* kr = kbase + i * kstride;
        a[i] = qv[0] * loadv(kr);
        for (int j = 1; j < NV; ++j) a[i] += qv[j] * loadv(kr + j * LANES);
      }
      storev(s + r * LANES, sum16(a));
    }
  }
}

}  // namespace pagedserve_cpu
