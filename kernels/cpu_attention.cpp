// PagedAttention for the CPU serving path: one call per layer for the whole
// batch (prefill, decode, chunked prefill and prefix-cached tails alike),
// reading K/V straight from the block pool, with an online softmax in fp32.
//
// Same contract as kernels/reference.py::paged_attention_ref. A work item is
// (sequence, KV head, tile of up to TILE_Q query tokens); it holds every query
// head of that KV head's group, so each key is loaded once per item and dotted
// with TILE_Q * group query rows. Items are spread over the OpenMP threads of
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

namespace {

constexpr int TILE_Q = 8;

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {  // bfloat16: the high half of a float
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}

struct Shape {
  int num_heads, num_kv_heads, head_dim, block_size, table_stride;
  float scale;
};

template <typename T>
void run_item(const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int seq_len, int q_begin,
              int q_len, int kv_head, int tile, T* out, const Shape& sh, std::vector<float>& scratch) {
  const int D = sh.head_dim, G = sh.num_heads / sh.num_kv_heads, BS = sh.block_size;
  const int q0 = tile * TILE_Q, nq = std::min(TILE_Q, q_len - q0), rows = nq * G;
  const int64_t tok_stride = static_cast<int64_t>(sh.num_kv_heads) * D;  // between slots of a block
  scratch.assign(static_cast<size_t>(rows) * (2 * D + 2) + BS, 0.0f);
  float* qs = scratch.data();                  // [rows, D] scaled queries
  float* acc = qs + static_cast<size_t>(rows) * D;  // [rows, D] unnormalised output
  float* m = acc + static_cast<size_t>(rows) * D;   // [rows] running max
  float* l = m + rows;                         // [rows] running sum of exp
  float* s = l + rows;                         // [BS] scores of one block
  // Row r is query token q0 + r / G, head kv_head * G + r % G.
  for (int r = 0; r < rows; ++r) {
    const T* src = q + (static_cast<int64_t>(q_begin + q0 + r / G) * sh.num_heads + kv_head * G + r % G) * D;
    for (int d = 0; d < D; ++d) qs[r * D + d] = load(src + d) * sh.scale;
    m[r] = -FLT_MAX;
    l[r] = 0.0f;
  }
  const int first_ctx = seq_len - q_len + q0 + 1;  // keys visible to the tile's first token
  const int last_ctx = first_ctx + nq - 1;
  for (int kb = 0; kb * BS < last_ctx; ++kb) {
    const int64_t base = static_cast<int64_t>(table[kb]) * BS * tok_stride + static_cast<int64_t>(kv_head) * D;
    const T* kblk = k_cache + base;
    const T* vblk = v_cache + base;
    const int n = std::min(BS, last_ctx - kb * BS);
    for (int r = 0; r < rows; ++r) {
      const int nv = std::min(n, first_ctx + r / G - kb * BS);  // causal: keys <= this token's position
      if (nv <= 0) continue;
      const float* qr = qs + r * D;
      float mx = -FLT_MAX;
      for (int i = 0; i < nv; ++i) {
        const T* kr = kblk + i * tok_stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qr[d] * load(kr + d);
        s[i] = dot;
        mx = std::max(mx, dot);
      }
      const float m_new = std::max(m[r], mx);
      const float corr = std::exp(m[r] - m_new);
      float* ar = acc + r * D;
      float sum = l[r] * corr;
#pragma omp simd
      for (int d = 0; d < D; ++d) ar[d] *= corr;
      for (int i = 0; i < nv; ++i) {
        const float p = std::exp(s[i] - m_new);
        sum += p;
        const T* vr = vblk + i * tok_stride;
#pragma omp simd
        for (int d = 0; d < D; ++d) ar[d] += p * load(vr + d);
      }
      l[r] = sum;
      m[r] = m_new;
    }
  }
  for (int r = 0; r < rows; ++r) {
    T* dst = out + (static_cast<int64_t>(q_begin + q0 + r / G) * sh.num_heads + kv_head * G + r % G) * D;
    const float inv = 1.0f / l[r];
    for (int d = 0; d < D; ++d) store(dst + d, acc[r * D + d] * inv);
  }
}

template <typename T>
void paged_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                     const int32_t* seq_lens, const int32_t* query_start_loc, T* out, int num_seqs, const Shape& sh) {
  // Item index -> (seq, kv head, tile): prefix sums of tiles per sequence.
  std::vector<int64_t> first(num_seqs + 1, 0);
  for (int i = 0; i < num_seqs; ++i) {
    const int q_len = query_start_loc[i + 1] - query_start_loc[i];
    first[i + 1] = first[i] + static_cast<int64_t>((q_len + TILE_Q - 1) / TILE_Q) * sh.num_kv_heads;
  }
  const int64_t total = first[num_seqs];
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < total; ++w) {
      const int seq = static_cast<int>(std::upper_bound(first.begin(), first.end(), w) - first.begin()) - 1;
      const int64_t local = w - first[seq];
      const int kv_head = static_cast<int>(local % sh.num_kv_heads), tile = static_cast<int>(local / sh.num_kv_heads);
      const int q_begin = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q_begin;
      run_item(q, k_cache, v_cache, block_tables + static_cast<int64_t>(seq) * sh.table_stride, seq_lens[seq],
               q_begin, q_len, kv_head, tile, out, sh, scratch);
    }
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns 0, or a positive code for bad arguments.
int pagedserve_paged_attention(int dtype, const void* q, const void* k_cache, const void* v_cache,
                               const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start_loc,
                               void* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int table_stride, float scale) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0) return 1;
  const Shape sh{num_heads, num_kv_heads, head_dim, block_size, table_stride, scale};
  if (dtype == 0) {
    paged_attention(static_cast<const float*>(q), static_cast<const float*>(k_cache),
                    static_cast<const float*>(v_cache), block_tables, seq_lens, query_start_loc,
                    static_cast<float*>(out), num_seqs, sh);
  } else if (dtype == 1) {
    paged_attention(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
                    static_cast<const uint16_t*>(v_cache), block_tables, seq_lens, query_start_loc,
                    static_cast<uint16_t*>(out), num_seqs, sh);
  } else {
    return 2;
  }
  return 0;
}

}  // extern "C"
