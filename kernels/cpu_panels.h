// The bf16 and fp32 panel tiles of the CPU linear layers (cpu_linear.cpp), shared
// with the quantized products' prompt path (quant_bf16.cpp), which decodes its
// blocks into the same panels. Layout and measurements: cpu_linear.cpp.
#pragma once
#include <type_traits>

#include "cpu_common.h"

namespace pagedserve_panels {

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

// A tile's sums (+ bias) into M rows of y, ldy apart, from feature n0; the last panel may be cut at N
// (its padding features are not stored). Shared with the coded tile (cpu_coded.cpp).
template <int M, int PP, typename T>
inline void store_tile(const vf (&acc)[MT][P], const T* bias, T* y, int64_t N, int64_t n0, int64_t ldy) {
  for (int p = 0; p < PP; ++p) {
    const int64_t c0 = n0 + p * LANES, cols = std::min<int64_t>(LANES, N - c0);
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < cols; ++j) store(y + m * ldy + c0 + j, acc[m][p][j] + (bias ? load(bias + c0 + j) : 0.0f));
  }
}

// M rows of x against PP panels from feature n0; the last panel may be cut at N; y's rows ldy apart.
template <int M, int PP, typename T>
inline void run_tile(const T* x, const T* wp, const T* bias, T* y, int64_t N, int64_t K, int64_t n0, int64_t ldy,
                     const Prefetch& pf) {
  vf acc[MT][P];
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < PP; ++p) acc[m][p] = vf{};
  tile<M, PP>(x, K, wp, acc, pf);
  store_tile<M, PP>(acc, bias, y, N, n0, ldy);
}

// All rows of x against PP panels, in ceil(M / MT) tiles of nearly equal rows
// (17 rows as 6 + 6 + 5, not 8 + 8 + 1). ``next``: the group this thread runs
// after this one, or null; ``next_bytes``: its size where it is not a group of panels.
template <int PP, typename T>
inline void panel_rows(const T* x, const T* wp, const T* bias, T* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                       int64_t ldy, const void* next, int64_t next_bytes = 0) {
  const int64_t tiles = (M + MT - 1) / MT, base = M / tiles, extra = M % tiles;
  const int64_t steps = std::is_same_v<T, uint16_t> ? K / 2 : K;
  const int64_t group_bytes = K * PP * LANES * static_cast<int64_t>(sizeof(T));
  int64_t m0 = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < extra);
    const Prefetch pf = tile_prefetch(next, next_bytes > 0 ? next_bytes : group_bytes, t, tiles, steps);
    const T* xr = x + m0 * K;
    T* yr = y + m0 * ldy;
    with_rows<MT>(rows, [&](auto r) __attribute__((always_inline)) {
      run_tile<decltype(r)::value, PP>(xr, wp, bias, yr, N, K, n0, ldy, pf);
    });
    m0 += rows;
  }
}

}  // namespace pagedserve_panels
