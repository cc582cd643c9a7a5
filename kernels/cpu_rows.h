// The query rows of one attention work item and their online-softmax state
// (cpu_attention.cpp): the shape of a call, loading the rows, merging two
// partial softmaxes over disjoint keys, and storing the normalised output.
#pragma once

#include <cfloat>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace pagedserve_cpu {

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_size, table_stride;
  int64_t q_stride;  // elements between two tokens of q (a view into the fused QKV rows, or heads * head_dim)
  float scale;
  float k_scale, v_scale;  // fp8 pools: stored = value / scale (1 for 16/32-bit pools)
  int window = 0;        // sliding window: a query at p sees keys p - window < k <= p (0: all earlier keys)
  float softcap = 0.0f;  // scores become softcap * tanh(score / softcap) (0: off)
};

// Up to this many query rows accumulate in registers at once.
constexpr int ROW_CHUNK = 4;

// The query rows of one item and their online-softmax state, in scratch.
// Rows are ordered (kv head, token, group member): row r of KV head h is
// query token t = (r / G) % nq of head h * G + r % G.
struct Rows {
  int nq, rows, per_kv;
  float* qs;   // [rows, D] scaled queries
  float* acc;  // [rows, D] unnormalised output
  float* m;    // [rows] running max
  float* l;    // [rows] running sum of exp
  float* s;    // [rows, BS] scores, then weights, of one block
  uint16_t* qh;  // [rows, D] the bf16 queries as given (bf16 q only, else null), for cpu_bf16.h
  float qscale;  // what qs has that qh has not
};

// Rows for query tokens tok0 .. tok0 + nq - 1 of q, every head.
template <typename T>
Rows load_rows(const T* q, int tok0, int nq, int D, const Shape& sh, std::vector<float>& scratch) {
  constexpr bool RAW = std::is_same_v<T, uint16_t>;
  const int H = sh.num_heads, KVH = sh.num_kv_heads, G = H / KVH, rows = nq * H;
  const size_t raw_floats = RAW ? (static_cast<size_t>(rows) * D + 1) / 2 : 0;
  scratch.assign(static_cast<size_t>(rows) * (2 * D + 2 + sh.block_size) + raw_floats, 0.0f);
  Rows w{nq, rows, nq * G, scratch.data(), nullptr, nullptr, nullptr, nullptr, nullptr, sh.scale * sh.k_scale};
  w.acc = w.qs + static_cast<size_t>(rows) * D;
  w.m = w.acc + static_cast<size_t>(rows) * D;
  w.l = w.m + rows;
  w.s = w.l + rows;
  if constexpr (RAW) w.qh = reinterpret_cast<uint16_t*>(w.s + static_cast<size_t>(rows) * sh.block_size);
  for (int kvh = 0; kvh < KVH; ++kvh)
    for (int t = 0; t < nq; ++t)
      for (int g = 0; g < G; ++g) {
        const int r = (kvh * nq + t) * G + g;
        const T* src = q + static_cast<int64_t>(tok0 + t) * sh.q_stride + (kvh * G + g) * D;
        for (int d = 0; d < D; ++d) w.qs[r * D + d] = load(src + d) * w.qscale;
        if constexpr (RAW) std::copy(src, src + D, w.qh + static_cast<size_t>(r) * D);
        w.m[r] = -FLT_MAX;
      }
  return w;
}

// Folds a partial state (acc, m, l of rows in another order) into w's: the
// two halves of one softmax over disjoint keys. row_of maps w's row to the
// partial's.
template <typename RowOf>
void merge(Rows& w, const float* p_acc, const float* p_m, const float* p_l, int D, RowOf row_of) {
  for (int r = 0; r < w.rows; ++r) {
    const int pr = row_of(r);
    const float mx = std::max(w.m[r], p_m[pr]);
    const float a = exp_nonpositive(w.m[r] - mx), b = exp_nonpositive(p_m[pr] - mx);
    float* ar = w.acc + static_cast<size_t>(r) * D;
    const float* pa = p_acc + static_cast<size_t>(pr) * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) ar[d] = ar[d] * a + pa[d] * b;
    w.l[r] = w.l[r] * a + p_l[pr] * b;
    w.m[r] = mx;
  }
}

// Normalised output of the rows, to tokens tok0 .. of out.
template <typename T>
void store_rows(const Rows& w, int tok0, int D, T* out, const Shape& sh) {
  const int H = sh.num_heads, KVH = sh.num_kv_heads, G = H / KVH;
  for (int kvh = 0; kvh < KVH; ++kvh)
    for (int t = 0; t < w.nq; ++t)
      for (int g = 0; g < G; ++g) {
        const int r = (kvh * w.nq + t) * G + g;
        T* dst = out + (static_cast<int64_t>(tok0 + t) * H + kvh * G + g) * D;
        const float inv = sh.v_scale / w.l[r];
        for (int d = 0; d < D; ++d) store(dst + d, w.acc[r * D + d] * inv);
      }
}

}  // namespace pagedserve_cpu
