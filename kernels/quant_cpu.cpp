// Products by GGUF quantized weights (kernels/quant.py), as llama.cpp computes
// them on CPU: the activations are quantized per 32 to int8 (one float scale per
// 32, and the sums of each 16), and each 32 weights of a row meet them in int8
// dot products (AVX512-VNNI vpdpbusd: unsigned weight bytes times signed
// activation bytes, four products into each int32 lane), then one float scale
// per block. Every type is written as w = a * q + b with q unsigned:
//   Q8_0 q = w + 128 (stored flipped), a = d, b = -128 d;  Q4_0 a = d, b = -8 d;
//   Q4_1 a = d, b = m;  Q5_0 a = d, b = -16 d;  Q5_1 a = d, b = m;
//   Q4_K a = d sc, b = -dmin m (per 32);  Q6_K a = d sc, b = -32 a (per 16),
// so a block's sum is dx (a . sum(q qx) + b . sum(qx)).
// The packed layout: kernels/quant_blocks.h; repacking: kernels/quant_pack.cpp.
#include <omp.h>

#include <vector>

#include "cpu_common.h"
#include "quant_blocks.h"

namespace {

using namespace pagedserve_cpu;
using namespace pagedserve_quant;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool HAVE_VNNI = true;
// Groups per tile, and rows of x per tile (the most: MT). Above 8 rows, by type, measured on
// the 2-core EPYC at 8 and 64 rows, one thread: 6 rows made Q8_0 1.3-1.5x faster than 4, and
// Q4_1 up to 1.25x slower (kernels/quant_bench.py).
constexpr int P = 2, MT = 8;
template <int QT>
constexpr int rows_per_tile() { return QT == Q8_0 ? 6 : 4; }

// The activations, quantized: q [M][K] int8; d [M][K/32] scale; s [M][K/16] d * sum(q) per 16.
struct Act {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t K;
};

inline __m512i bcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
// MM rows of x (from m0) times the 32 weights of block blk of PP groups (unit pointers u[p]), into acc:
// a, b per group (HALVES: a[p][h], b[p][h] for each 16). The quads are the outer loop, so each weight
// vector is decoded once and meets MM broadcast activations; the int sums stay in registers.
template <int QT, int MM, int PP, bool HALVES>
__attribute__((always_inline)) inline void dot32(const uint8_t* const (&u)[P], const __m512 (&a)[P][2], const __m512 (&b)[P][2], const Act& x,
                  int64_t m0, int64_t blk, __m512 (&acc)[MT][P]) {
  const int64_t KB = x.K / 32;
  __m512i i0[MT][P], i1[MT][P];
  for (int m = 0; m < MM; ++m)
    for (int p = 0; p < PP; ++p) i0[m][p] = _mm512_setzero_si512(), i1[m][p] = _mm512_setzero_si512();
  for (int jj = 0; jj < 4; ++jj) {
    __m512i lo[P], hi[P];
    for (int p = 0; p < PP; ++p) quads<QT>(u[p], jj, lo[p], hi[p]);
    for (int m = 0; m < MM; ++m) {
      const int8_t* xp = x.q + (m0 + m) * x.K + blk * 32;
      const __m512i xl = bcast(xp + 4 * jj), xh = bcast(xp + 4 * (jj + 4));
      for (int p = 0; p < PP; ++p) {
        i0[m][p] = _mm512_dpbusd_epi32(i0[m][p], lo[p], xl);
        if constexpr (HALVES) i1[m][p] = _mm512_dpbusd_epi32(i1[m][p], hi[p], xh);
        else i0[m][p] = _mm512_dpbusd_epi32(i0[m][p], hi[p], xh);
      }
    }
  }
  for (int m = 0; m < MM; ++m) {
    const __m512 dx = _mm512_set1_ps(x.d[(m0 + m) * KB + blk]);
    const float* s = x.s + (m0 + m) * 2 * KB + 2 * blk;
    for (int p = 0; p < PP; ++p) {
      acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[m][p]), _mm512_mul_ps(a[p][0], dx), acc[m][p]);
      if constexpr (HALVES) {
        acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[m][p]), _mm512_mul_ps(a[p][1], dx), acc[m][p]);
        acc[m][p] = _mm512_fmadd_ps(b[p][0], _mm512_set1_ps(s[0]), acc[m][p]);
        acc[m][p] = _mm512_fmadd_ps(b[p][1], _mm512_set1_ps(s[1]), acc[m][p]);
      } else {
        acc[m][p] = _mm512_fmadd_ps(b[p][0], _mm512_set1_ps(s[0] + s[1]), acc[m][p]);
      }
    }
  }
}

// Every cache line of the unit about 4 KB ahead in a group's stream, into L2: a single row tile
// reads the weight from memory, and without it 8 rows ran at half the bandwidth of 1.
template <int QT>
inline void prefetch_unit(const uint8_t* u) {
  constexpr int64_t ub = unit_bytes(QT), ahead = (4096 + ub - 1) / ub * ub;
  for (int64_t c = 0; c < ub; c += 64) __builtin_prefetch(u + ahead + c, 0, 2);
}

// MM rows from m0 against PP groups whose units start at wg (group p at wg + p * gstride).
// Inlined into each run_tile, as dot32 into it, so the sums stay in registers (left to the compiler,
// it kept one out-of-line copy for the fp32 and bf16 outputs: 0.92x at 32-64 rows, 0.88x Q4_1 at 1).
template <int QT, int MM, int PP>
__attribute__((always_inline)) inline void tile(const uint8_t* wg, int64_t gstride, const Act& x, int64_t m0, __m512 (&acc)[MT][P],
                 const Prefetch& pf) {
  const int64_t units = x.K / unit_weights(QT), ub = unit_bytes(QT);
  __m512 a[P][2], b[P][2];  // w = a q + b per row (Q6_K: [0] the sub-block's first 16 weights, [1] its last)
  const uint8_t* u[P];
  const char* done = pf.next;
  for (int64_t un = 0; un < units; ++un) {
    if (pf.next) prefetch_share(pf, un, done);
    if constexpr (unit_weights(QT) == 32) {
      for (int p = 0; p < PP; ++p) {
        if (pf.self) prefetch_unit<QT>(wg + p * gstride + un * ub);  // later row tiles find the unit in cache
        u[p] = sub_block<QT>(wg + p * gstride + un * ub, 0, a[p], b[p]);
      }
      dot32<QT, MM, PP, false>(u, a, b, x, m0, un, acc);
    } else {
      for (int p = 0; p < PP; ++p)
        if (pf.self) prefetch_unit<QT>(wg + p * gstride + un * ub);
      for (int s = 0; s < 8; ++s) {
        for (int p = 0; p < PP; ++p) u[p] = sub_block<QT>(wg + p * gstride + un * ub, s, a[p], b[p]);
        dot32<QT, MM, PP, QT == Q6_K>(u, a, b, x, m0, un * 8 + s, acc);
      }
    }
  }
}

template <int QT, int MM, int PP, typename T>
inline void run_tile(const uint8_t* wg, int64_t gstride, const Act& x, int64_t m0, int64_t n0, int64_t N,
                     const T* bias, T* y, int64_t ldy, const Prefetch& pf) {
  __m512 acc[MT][P];
  for (int m = 0; m < MM; ++m)
    for (int p = 0; p < PP; ++p) acc[m][p] = _mm512_setzero_ps();
  tile<QT, MM, PP>(wg, gstride, x, m0, acc, pf);
  for (int p = 0; p < PP; ++p) {
    const int64_t c0 = n0 + p * G, cols = std::min<int64_t>(G, N - c0);
    alignas(64) float out[G];
    for (int m = 0; m < MM; ++m) {
      _mm512_store_ps(out, acc[m][p]);
      for (int j = 0; j < cols; ++j) store(y + (m0 + m) * ldy + c0 + j, out[j] + (bias ? load(bias + c0 + j) : 0.0f));
    }
  }
}

// R rows at a time (the last tile: the rest) against PP groups; ``next``: the groups this thread
// runs after these (its tiles prefetch them, cpu_common.h's Prefetch), or null.
template <int QT, int PP, int R, typename T>
inline void groups_rows(const uint8_t* wg, int64_t gstride, const Act& x, int64_t M, int64_t n0, int64_t N,
                        const T* bias, T* y, int64_t ldy, const uint8_t* next) {
  const int64_t tiles = (M + R - 1) / R, units = x.K / unit_weights(QT), run_bytes = PP * gstride;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t, m0 += R) {
    const Prefetch pf = tile_prefetch(next, run_bytes, t, tiles, units);
    with_rows<R>(std::min<int64_t>(R, M - m0), [&](auto r) __attribute__((always_inline)) {
      run_tile<QT, decltype(r)::value, PP>(wg, gstride, x, m0, n0, N, bias, y, ldy, pf);
    });
  }
}

// PP groups per tile and R rows per tile, over each thread's contiguous part of the groups.
template <int QT, int PP, int R, typename T>
void linear_tiles(const Act& x, const uint8_t* packed, const T* bias, T* y, int64_t M, int64_t N, int64_t ldy) {
  const int64_t groups = (N + G - 1) / G, runs = groups / PP, gstride = x.K / unit_weights(QT) * unit_bytes(QT);
#pragma omp parallel
  {
    FlushDenormals ftz;
    int64_t lo, hi;  // each thread streams one contiguous part of the runs
    thread_part(runs, lo, hi);
    for (int64_t i = lo; i < hi; ++i)
      groups_rows<QT, PP, R>(packed + i * PP * gstride, gstride, x, M, i * PP * G, N, bias, y, ldy,
                             i + 1 < hi ? packed + (i + 1) * PP * gstride : nullptr);
#pragma omp for schedule(static)
    for (int64_t g = runs * PP; g < groups; ++g)
      groups_rows<QT, 1, R>(packed + g * gstride, gstride, x, M, g * G, N, bias, y, ldy, nullptr);
  }
}

// 2 to 8 rows: all of them in one tile of one group, so the tile that streams the weight from
// memory does all the work (two tiles of 6 + 2 rows of 2 groups ran the 1B decode step's
// linears 1.0x the bf16 panels' speed at 8 rows, one core); one row: 2 groups, two chains.
template <int QT, typename T>
void linear(const Act& x, const uint8_t* packed, const T* bias, T* y, int64_t M, int64_t N, int64_t ldy) {
  if (M >= 2 && M <= 8) linear_tiles<QT, 1, 8>(x, packed, bias, y, M, N, ldy);
  else linear_tiles<QT, P, rows_per_tile<QT>()>(x, packed, bias, y, M, N, ldy);
}

template <typename T>
void dispatch(int qt, const Act& x, const uint8_t* packed, const T* bias, T* y, int64_t M, int64_t N, int64_t ldy) {
  with_type(qt, [&](auto t) { linear<decltype(t)::value>(x, packed, bias, y, M, N, ldy); });
}
#else
constexpr bool HAVE_VNNI = false;
#endif

// x [M][K] -> q int8 (per 32: round(x / d) to nearest even, d = max|x| / 127), d [M][K/32],
// s [M][K/16] = d * sum(q) per 16. Vectorised: done scalar it cost as much as the product at 64 rows.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  // A few rows take less time than waking the other thread (a decode step's single row: ~0.1 us).
#pragma omp parallel for schedule(static) if (M * K >= 16384)
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    const T* xb = x + i * 32;
#if defined(__AVX512F__)
    const __m512 v0 = load16(xb), v1 = load16(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 32), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * 32 + 16), _mm512_cvtepi32_epi8(q1));
    const float dd = amax / 127.0f;
    d[i] = dd;
    s[2 * i] = dd * static_cast<float>(_mm512_reduce_add_epi32(q0));
    s[2 * i + 1] = dd * static_cast<float>(_mm512_reduce_add_epi32(q1));
#else
    float v[32], amax = 0.0f;
    for (int k = 0; k < 32; ++k) v[k] = load(xb + k), amax = std::max(amax, std::fabs(v[k]));
    const float dd = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum[2] = {0, 0};
    for (int k = 0; k < 32; ++k) {
      const int qi = static_cast<int>(std::nearbyint(v[k] * id));
      q[i * 32 + k] = static_cast<int8_t>(qi);
      sum[k / 16] += qi;
    }
    d[i] = dd;
    s[2 * i] = dd * static_cast<float>(sum[0]);
    s[2 * i + 1] = dd * static_cast<float>(sum[1]);
#endif
  }
}

// The second term of fp32 activations: r = x - q1 d1 per element, quantized as quantize_rows does.
// Not contracted into a fused multiply-add, so torch's x - q1 * d1 (kernels/quant_cpu.py) equals it.
__attribute__((optimize("fp-contract=off"))) void residual_rows(const float* x, int64_t M, int64_t K,
                                                               const int8_t* q1, const float* d1, int8_t* q2,
                                                               float* d2, float* s2) {
  static thread_local std::vector<float> buf;
  buf.resize(M * K);
  float* r = buf.data();  // the caller's buffer: a thread_local named inside the loop would be each thread's own
#pragma omp parallel for schedule(static) if (M * K >= 16384)
  for (int64_t i = 0; i < M * K; ++i) r[i] = x[i] - static_cast<float>(q1[i]) * d1[i / 32];
  quantize_rows(static_cast<const float*>(r), M, K, q2, d2, s2);
}

// y [M][N] = the two terms' products (rows m and M + m of t) + bias.
void add_terms(const float* t, const float* bias, float* y, int64_t M, int64_t N) {
#pragma omp parallel for schedule(static) if (M * N >= 16384)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] = t[m * N + n] + t[(M + m) * N + n] + (bias ? bias[n] : 0.0f);
}

}  // namespace

extern "C" {

// The activation quantization the product uses (exposed for the tests): x [M][K] (dtype 0 f32, 1 bf16), K % 32 == 0.
int pagedserve_quant_act(int dtype, const void* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  if (M < 1 || K <= 0 || K % 32) return 1;
  if (dtype == 0) quantize_rows(static_cast<const float*>(x), M, K, q, d, s);
  else if (dtype == 1) quantize_rows(static_cast<const uint16_t*>(x), M, K, q, d, s);
  else return 2;
  return 0;
}

// y [M][sum rows] = x [M][K] . [W_0; W_1; ...]^T (+ bias [sum rows] or null): up to 4 parts side by
// side, part p of type qtypes[p] with rows[p] output rows (q/k/v of different types, as Q4_K_M mixes
// them), each written into its columns of y, x quantized once. x / bias / y of dtype (0 f32, 1 bf16).
// Returns 0; 1 bad arguments; 2 bad dtype; 3 this CPU has no AVX512-VNNI (the caller dequantizes).
int pagedserve_quant_linear_parts(int dtype, const void* x, const void* bias, void* y, int64_t M, int64_t K,
                                  int parts, const int32_t* qtypes, const uint8_t* const* packed,
                                  const int64_t* rows) {
  if (!HAVE_VNNI) return 3;
  if (M < 1 || parts < 1 || parts > 4) return 1;
  int64_t N = 0;
  for (int p = 0; p < parts; ++p) {
    if (packed[p] == nullptr || packed_bytes(qtypes[p], rows[p], K) == 0) return 1;
    N += rows[p];
  }
  if (dtype != 0 && dtype != 1) return 2;
  if (dtype == 1 && M >= pagedserve_quant_dequant_rows) {  // a prompt: the weight decoded to bf16 panels
    int rc = 0;
    for (int64_t p = 0, off = 0; p < parts && rc == 0; off += rows[p], ++p)
      rc = pagedserve_quant_linear_bf16(qtypes[p], x, packed[p], bias ? static_cast<const uint16_t*>(bias) + off : nullptr,
                                        static_cast<uint16_t*>(y) + off, M, rows[p], K, N);
    if (rc != 3) return rc;  // 3: no AVX512-BF16 here, and the int8 products below serve it
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // fp32 activations get two int8 terms, x = q1 d1 + q2 d2 (the second quantizes what the first
  // rounded off), so about 15 bits each instead of 8: the same tiles run 2M rows over one read of
  // the weight. bf16 activations of decode batches keep one term (llama.cpp's trade: the second
  // halves the speed where the products are compute-bound); prompts took the bf16 panels above.
  const int64_t MR = dtype == 0 ? 2 * M : M;
  static thread_local std::vector<int8_t> q;
  static thread_local std::vector<float> d, s, two;
  q.resize(MR * K);
  d.resize(MR * K / 32);
  s.resize(MR * K / 16);
  pagedserve_quant_act(dtype, x, M, K, q.data(), d.data(), s.data());
  if (dtype == 0) {
    residual_rows(static_cast<const float*>(x), M, K, q.data(), d.data(), q.data() + M * K, d.data() + M * K / 32,
                  s.data() + M * K / 16);
    two.resize(MR * N);
  }
  const Act a{q.data(), d.data(), s.data(), K};
  int64_t off = 0;
  for (int p = 0; p < parts; off += rows[p], ++p) {
    if (dtype == 0)
      dispatch(qtypes[p], a, packed[p], static_cast<const float*>(nullptr), two.data() + off, MR, rows[p], N);
    else
      dispatch(qtypes[p], a, packed[p], bias ? static_cast<const uint16_t*>(bias) + off : nullptr,
               static_cast<uint16_t*>(y) + off, M, rows[p], N);
  }
  if (dtype == 0) add_terms(two.data(), static_cast<const float*>(bias), static_cast<float*>(y), M, N);
#endif
  return 0;
}

}  // extern "C"
