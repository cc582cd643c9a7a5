// Linear layers on CPU: y[m, n] = x[m, :] . w[n, :] (+ bias[n]) over a weight
// packed once at load into panels of 16 output features. A tile keeps MT rows
// of x against P panels in MT * P vector accumulators: each weight vector is
// loaded once per tile and meets MT broadcast x values, so no sum is ever
// reduced across lanes. Each group of P panels is stored interleaved per k,
// [K][P][16] (bf16: k pairs side by side, [K/2][P][16][2], the layout
// vdpbf16ps reads), so a tile reads one sequential stream; the panels after
// the last whole group are [K][16] each. One stream instead of P per tile,
// with an L2 prefetch 8 KB ahead, made the SmolLM2 linears 1.2-1.6x faster at
// 1-16 rows (weight bandwidth 19-22 -> 24-27 GB/s on the 2-core EPYC) and
// 1.1x at 64 (docs/gpuworker.md, "Linear layers"). It replaces oneDNN's copy,
// so the weights are held twice, as before.
#include <omp.h>

#include "cpu_common.h"

namespace {

using namespace pagedserve_cpu;

#if defined(__AVX512F__)
constexpr int P = 3, MT = 8;  // 24 accumulators + 3 weights + 1 broadcast of 32 zmm registers
#else
constexpr int P = 1, MT = 6;  // a vf is two ymm registers here: 12 accumulators of 16
#endif
constexpr int PREFETCH_BYTES = 8192;  // ahead in a tile's stream, into L2 (512 B into L1 was slower)

// fp32: PP panels interleaved, [K][PP][16].
template <int M, int PP>
inline void tile(const float* x, int64_t K, const float* wp, vf (&acc)[MT][P], const Prefetch& pf) {
  const char* done = pf.next;
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = wp + k * PP * LANES;  // the PP panels' vectors of this k, side by side
    vf w[PP];
    for (int p = 0; p < PP; ++p) {
      w[p] = loadv(wk + p * LANES);
      if (pf.self) __builtin_prefetch(reinterpret_cast<const char*>(wk + p * LANES) + PREFETCH_BYTES, 0, 2);
    }
    if (pf.next) prefetch_share(pf, k, done);
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * K + k];
      for (int p = 0; p < PP; ++p) acc[m][p] += w[p] * xv;
    }
  }
}

// bf16: PP panels interleaved, [K/2][PP][16][2]; K even.
template <int M, int PP>
inline void tile(const uint16_t* x, int64_t K, const uint16_t* wp, vf (&acc)[MT][P], const Prefetch& pf) {
  const char* done = pf.next;
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* wk = wp + k * PP * LANES;  // the PP panels' pairs of k, k + 1, side by side
    if (pf.next) prefetch_share(pf, k / 2, done);
#if defined(__AVX512BF16__)
    __m512bh w[PP];
    for (int p = 0; p < PP; ++p) {
      w[p] = (__m512bh)_mm512_loadu_si512(wk + p * 2 * LANES);
      if (pf.self) __builtin_prefetch(reinterpret_cast<const char*>(wk + p * 2 * LANES) + PREFETCH_BYTES, 0, 2);
    }
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + m * K + k, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int p = 0; p < PP; ++p) {
        __m512 a;
        std::memcpy(&a, &acc[m][p], sizeof a);
        a = _mm512_dpbf16_ps(a, w[p], xv);
        std::memcpy(&acc[m][p], &a, sizeof a);
      }
    }
#else
    vf even[PP], odd[PP];  // a 32-bit pair holds w[n, k] in its low half, w[n, k + 1] in its high half
    for (int p = 0; p < PP; ++p) {
      vu u;
      std::memcpy(&u, wk + p * 2 * LANES, sizeof u);
      const vu lo = u << 16, hi = u & 0xFFFF0000u;
      std::memcpy(&even[p], &lo, sizeof lo);
      std::memcpy(&odd[p], &hi, sizeof hi);
    }
    for (int m = 0; m < M; ++m) {
      const float x0 = load(x + m * K + k), x1 = load(x + m * K + k + 1);
      for (int p = 0; p < PP; ++p) acc[m][p] += even[p] * x0 + odd[p] * x1;
    }
#endif
  }
}

// M rows of x against PP panels from feature n0; the last panel may be cut at N.
template <int M, int PP, typename T>
inline void run_tile(const T* x, const T* wp, const T* bias, T* y, int64_t N, int64_t K, int64_t n0,
                     const Prefetch& pf) {
  vf acc[MT][P];
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < PP; ++p) acc[m][p] = vf{};
  tile<M, PP>(x, K, wp, acc, pf);
  for (int p = 0; p < PP; ++p) {
    const int64_t c0 = n0 + p * LANES, cols = std::min<int64_t>(LANES, N - c0);
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < cols; ++j) store(y + m * N + c0 + j, acc[m][p][j] + (bias ? load(bias + c0 + j) : 0.0f));
  }
}

// All rows of x against PP panels, in ceil(M / MT) tiles of nearly equal rows
// (17 rows as 6 + 6 + 5, not 8 + 8 + 1). ``next``: the group this thread runs
// after this one, or null.
template <int PP, typename T>
inline void panel_rows(const T* x, const T* wp, const T* bias, T* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                       const T* next) {
  const int64_t tiles = (M + MT - 1) / MT, base = M / tiles, extra = M % tiles;
  const int64_t steps = std::is_same_v<T, uint16_t> ? K / 2 : K;
  const int64_t group_bytes = K * PP * LANES * static_cast<int64_t>(sizeof(T));
  int64_t m0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < extra);
    const Prefetch pf = tile_prefetch(next, group_bytes, t, tiles, steps);
    const T* xr = x + m0 * K;
    T* yr = y + m0 * N;
    switch (rows) {  // unrolled at compile time
#define PAGEDSERVE_ROWS(r) \
  case r:                  \
    if constexpr (r <= MT) { run_tile<r, PP>(xr, wp, bias, yr, N, K, n0, pf); } \
    break;
      PAGEDSERVE_ROWS(1) PAGEDSERVE_ROWS(2) PAGEDSERVE_ROWS(3) PAGEDSERVE_ROWS(4) PAGEDSERVE_ROWS(5)
      PAGEDSERVE_ROWS(6) PAGEDSERVE_ROWS(7) PAGEDSERVE_ROWS(8)
#undef PAGEDSERVE_ROWS
      default:
        break;
    }
    m0 += rows;
  }
}
static_assert(MT <= 8, "panel_rows unrolls tiles of up to 8 rows");

template <typename T>
void linear(const T* x, const T* packed, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
  const int64_t panels = (N + LANES - 1) / LANES, groups = panels / P, panel_elems = K * LANES;
#pragma omp parallel
  {
    FlushDenormals ftz;
    int64_t lo, hi;  // each thread streams one contiguous part of the groups
    thread_part(groups, lo, hi);
    for (int64_t g = lo; g < hi; ++g)
      panel_rows<P>(x, packed + g * P * panel_elems, bias, y, M, N, K, g * P * LANES,
                    g + 1 < hi ? packed + (g + 1) * P * panel_elems : nullptr);
#pragma omp for schedule(static)
    for (int64_t p = groups * P; p < panels; ++p)
      panel_rows<1>(x, packed + p * panel_elems, bias, y, M, N, K, p * LANES, static_cast<const T*>(nullptr));
  }
}

// w [N, K] row-major -> panels (features past N zero); bf16 pairs k, k + 1 side by side.
template <typename T>
void pack(const T* w, T* packed, int64_t N, int64_t K) {
  const int64_t panels = (N + LANES - 1) / LANES;
  constexpr int pair = std::is_same_v<T, uint16_t> ? 2 : 1;
  const int64_t grouped = panels / P * P;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    // A group of P panels interleaves them per k (one stream); the rest are [K][16] each.
    const int64_t pp = p < grouped ? P : 1, base = (p - p % pp) * K * LANES, slot = p % pp;
    for (int64_t k0 = 0; k0 < K; k0 += pair)
      for (int j = 0; j < LANES; ++j)
        for (int i = 0; i < pair; ++i) {
          const int64_t n = p * LANES + j;
          packed[base + k0 * pp * LANES + slot * pair * LANES + j * pair + i] = n < N ? w[n * K + k0 + i] : T{};
        }
  }
}

bool bad(int dtype, int64_t N, int64_t K) { return N <= 0 || K <= 0 || (dtype == 1 && K % 2 != 0); }

}  // namespace

extern "C" {

// Panels per interleaved group of the packed layout (P).
int pagedserve_linear_group() { return P; }

// dtype: 0 float32, 1 bfloat16. w [N, K] contiguous; packed holds ceil(N / 16) * 16 * K elements.
// K even for bf16. Returns 0, or a positive code for bad arguments.
int pagedserve_linear_pack(int dtype, const void* w, void* packed, int64_t N, int64_t K) {
  if (bad(dtype, N, K)) return 1;
  if (dtype == 0) {
    pack(static_cast<const float*>(w), static_cast<float*>(packed), N, K);
  } else if (dtype == 1) {
    pack(static_cast<const uint16_t*>(w), static_cast<uint16_t*>(packed), N, K);
  } else {
    return 2;
  }
  return 0;
}

// x [M, K], y [M, N] contiguous, of the packed weight's dtype; bias [N] or null.
int pagedserve_linear(int dtype, const void* x, const void* packed, const void* bias, void* y, int64_t M, int64_t N,
                      int64_t K) {
  if (M < 1 || bad(dtype, N, K)) return 1;
  if (dtype == 0) {
    linear(static_cast<const float*>(x), static_cast<const float*>(packed), static_cast<const float*>(bias),
           static_cast<float*>(y), M, N, K);
  } else if (dtype == 1) {
    linear(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(packed), static_cast<const uint16_t*>(bias),
           static_cast<uint16_t*>(y), M, N, K);
  } else {
    return 2;
  }
  return 0;
}

}  // extern "C"
