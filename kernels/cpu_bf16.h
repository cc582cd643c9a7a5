// bf16 attention by vdpbf16ps (AVX512-BF16), for cpu_attention.cpp: with a
// bf16 pool the keys and values are multiplied as stored, two bf16 products
// added into each fp32 lane per instruction, instead of being widened to fp32
// first. Queries are the model's bf16 q (unscaled: the scale multiplies the
// scores), so the scores are the fp32 path's up to summation order. The
// softmax weights are rounded to bf16 for the values' product, as torch's own
// CPU attention rounds its probabilities for bf16 inputs; the row sums stay fp32.
#pragma once
#include <cstdint>
#include <cstring>

#include "cpu_common.h"
#include "cpu_scores.h"

namespace pagedserve_cpu {

#if defined(__AVX512BF16__)
constexpr bool BF16_PAIRS = true;

inline vf as_vf(__m512 m) {
  vf v;
  std::memcpy(&v, &m, sizeof v);
  return v;
}
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// block_dots for a bf16 pool: each key's dot in one vector (DT / 32
// instructions), the 16 keys reduced together by sum16.
template <int DT>
inline void block_dots_bf16(const uint16_t* kblk, int64_t tok_stride, int KVH, int per_kv, const uint16_t* qh,
                            float qscale, float* s, const uint16_t* k_ahead, const uint16_t* v_ahead, int n_ahead) {
  constexpr int NZ = DT / 32;
  const int rows = KVH * per_kv;
  for (int kvh = 0; kvh < KVH; ++kvh)
    for (int r = kvh * per_kv; r < (kvh + 1) * per_kv; ++r) {
      prefetch_slots(k_ahead, v_ahead, r * n_ahead / rows, (r + 1) * n_ahead / rows, tok_stride);
      __m512bh qv[NZ];
      for (int z = 0; z < NZ; ++z) qv[z] = load_bh(qh + r * DT + z * 32);
      vf a[LANES];
      for (int i = 0; i < LANES; ++i) {
        const uint16_t* kr = kblk + i * tok_stride + kvh * DT;
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), load_bh(kr), qv[0]);
        for (int z = 1; z < NZ; ++z) acc = _mm512_dpbf16_ps(acc, load_bh(kr + z * 32), qv[z]);
        a[i] = as_vf(acc);
      }
      storev(s + r * LANES, sum16(a) * qscale);
    }
}

// block_scores for a bf16 pool: a block's keys of one KV head laid out as
// [DT / 2][16] pairs of dims (each pair is one 32-bit word of a key row, so
// this is a copy, not a conversion), then each row is DT / 2 instructions
// with a broadcast pair of its query. Keys past n are zero.
template <int DT>
inline void block_scores_bf16(const uint16_t* kblk, int n, int64_t tok_stride, int KVH, int per_kv,
                              const uint16_t* qh, float qscale, float* s) {
  constexpr int NP = DT / 2;
  alignas(64) uint32_t kt[NP * LANES];
  for (int kvh = 0; kvh < KVH; ++kvh) {
    for (int i = 0; i < LANES; ++i) {
      const uint16_t* kr = kblk + i * tok_stride + kvh * DT;
      for (int p = 0; p < NP; ++p) {
        uint32_t w = 0;
        if (i < n) std::memcpy(&w, kr + 2 * p, sizeof w);
        kt[p * LANES + i] = w;
      }
    }
    const int r_end = (kvh + 1) * per_kv;
    int r = kvh * per_kv;
    for (; r + 4 <= r_end; r += 4) {
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int p = 0; p < NP; ++p) {
        const __m512bh kv = (__m512bh)_mm512_load_si512(kt + p * LANES);
        for (int c = 0; c < 4; ++c) {
          uint32_t qp;
          std::memcpy(&qp, qh + (r + c) * DT + 2 * p, sizeof qp);
          a[c] = _mm512_dpbf16_ps(a[c], kv, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp)));
        }
      }
      for (int c = 0; c < 4; ++c) storev(s + (r + c) * LANES, as_vf(a[c]) * qscale);
    }
    for (; r < r_end; ++r) {
      __m512 a = _mm512_setzero_ps();
      for (int p = 0; p < NP; ++p) {
        uint32_t qp;
        std::memcpy(&qp, qh + r * DT + 2 * p, sizeof qp);
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_load_si512(kt + p * LANES), (__m512bh)_mm512_set1_epi32(static_cast<int>(qp)));
      }
      storev(s + r * LANES, as_vf(a) * qscale);
    }
  }
}

// acc rows r0 .. r0 + nc - 1 of one KV head += their weights (s, first n of
// each row; LANES == block size) times the block's values, two keys per
// instruction: unpacklo/hi interleave two value rows within 128-bit lanes, so
// the accumulators hold dims in that order until the permute at the end.
template <int DT, int CHUNK>
inline void weighted_values_bf16(const uint16_t* vblk, int n, int64_t tok_stride, int kvh, const float* s, int r0,
                                 int nc, float* acc) {
  constexpr int NZ = DT / 32;
  alignas(64) uint32_t pw[CHUNK][LANES / 2];  // each row's weights, bf16 pairs (key 2j low, 2j + 1 high)
  for (int c = 0; c < nc; ++c) {
    const __m512 p = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), s + (r0 + c) * LANES);
    _mm256_store_si256(reinterpret_cast<__m256i*>(pw[c]), (__m256i)_mm512_cvtneps_pbh(p));
  }
  __m512 a[CHUNK][2 * NZ];
  for (int c = 0; c < CHUNK; ++c)
    for (int j = 0; j < 2 * NZ; ++j) a[c][j] = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 2) {
    const uint16_t* v0 = vblk + i * tok_stride + kvh * DT;
    for (int z = 0; z < NZ; ++z) {
      const __m512i x0 = _mm512_loadu_si512(v0 + z * 32);
      // A lone last key pairs with zeros: the slot after it may hold anything (NaN).
      const __m512i x1 = i + 1 < n ? _mm512_loadu_si512(v0 + tok_stride + z * 32) : _mm512_setzero_si512();
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
      for (int c = 0; c < nc; ++c) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[c][i / 2]));
        a[c][2 * z] = _mm512_dpbf16_ps(a[c][2 * z], lo, w);
        a[c][2 * z + 1] = _mm512_dpbf16_ps(a[c][2 * z + 1], hi, w);
      }
    }
  }
  // lo holds dims 0-3, 8-11, 16-19, 24-27 of its 32; hi the other four of each eight.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c = 0; c < nc; ++c)
    for (int z = 0; z < NZ; ++z) {
      float* ar = acc + (r0 + c) * DT + z * 32;
      _mm512_storeu_ps(ar, _mm512_add_ps(_mm512_loadu_ps(ar), _mm512_permutex2var_ps(a[c][2 * z], first, a[c][2 * z + 1])));
      _mm512_storeu_ps(ar + 16,
                       _mm512_add_ps(_mm512_loadu_ps(ar + 16), _mm512_permutex2var_ps(a[c][2 * z], second, a[c][2 * z + 1])));
    }
}
#else
constexpr bool BF16_PAIRS = false;
// Declared only: the callers' `if constexpr (BF16_PAIRS)` branches never instantiate them.
template <int DT>
void block_dots_bf16(const uint16_t*, int64_t, int, int, const uint16_t*, float, float*, const uint16_t*,
                     const uint16_t*, int);
template <int DT>
void block_scores_bf16(const uint16_t*, int, int64_t, int, int, const uint16_t*, float, float*);
template <int DT, int CHUNK>
void weighted_values_bf16(const uint16_t*, int, int64_t, int, const float*, int, int, float*);
#endif

}  // namespace pagedserve_cpu
