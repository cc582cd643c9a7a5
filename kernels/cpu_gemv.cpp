// Linear layers for a few rows (decode at low batch): y[m, n] = x[m, :] . w[n, :]
// (+ bias[n]) over the checkpoint's own [N, K] weight. With a few rows a step
// is bound by streaming the weights once; read row-major, straight through,
// with a software prefetch, SmolLM2's fp32 weights streamed at 23-27 GB/s on
// the 2-core EPYC, against 16-20 GB/s through oneDNN's packed GEMM at one row
// (docs/gpuworker.md, "Linear layers at a few rows").
#include <omp.h>

#include "cpu_common.h"

namespace {

using namespace pagedserve_cpu;

constexpr int MAX_ROWS = 16;  // x rows; more go to oneDNN (gpuworker/cpu_gemm.py)
constexpr int R = 8;          // weight rows per block
constexpr int X_ROWS = 2;     // x rows per pass over a block: R * X_ROWS accumulators stay in registers
constexpr int PREFETCH_ROWS = 16;  // two blocks ahead, at the same k

inline float reduce(vf v) {
#if defined(__AVX512F__)
  __m512 z;
  std::memcpy(&z, &v, sizeof z);
  return _mm512_reduce_add_ps(z);
#else
  return hsum(v);
#endif
}

// Rows n0 .. n0 + RR of w against M rows of x (K a multiple of LANES), into out[m * RR + r].
template <int M, int RR, typename T>
inline void dot_block(const T* x, const T* w, int64_t K, float* out) {
  vf acc[RR][M];
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vf{};
  for (int64_t k = 0; k < K; k += LANES) {
    vf xv[M];
    for (int m = 0; m < M; ++m) xv[m] = loadv(x + m * K + k);
    for (int r = 0; r < RR; ++r) {
      __builtin_prefetch(w + (r + PREFETCH_ROWS) * K + k);
      const vf wv = loadv(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] += wv * xv[m];
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) out[m * RR + r] = reduce(acc[r][m]);
}

#if defined(__AVX512BF16__)
// bf16 with AVX512-BF16: 32 products a step summed into 16 float lanes (vdpbf16ps), no
// conversion to float first; K a multiple of 32.
template <int M, int RR>
inline void dot_block_bf16(const uint16_t* x, const uint16_t* w, int64_t K, float* out) {
  __m512 acc[RR][M];
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2 * LANES) {
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
    for (int r = 0; r < RR; ++r) {
      __builtin_prefetch(w + (r + PREFETCH_ROWS) * K + k);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < M; ++m) out[m * RR + r] = _mm512_reduce_add_ps(acc[r][m]);
}
#endif

// dot_block, or on bf16 with AVX512-BF16 (and K a multiple of 32) dot_block_bf16.
template <int M, int RR, typename T>
inline void dot_any(const T* x, const T* w, int64_t K, float* out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (K % (2 * LANES) == 0) {
      dot_block_bf16<M, RR>(x, w, K, out);
      return;
    }
  }
#endif
  dot_block<M, RR>(x, w, K, out);
}

// All M rows of x against RR weight rows, X_ROWS x rows at a time: the block of w
// is read from memory for the first pass and from L1 for the others.
template <int RR, typename T>
inline void rows(const T* x, const T* w, const T* bias, T* y, int M, int64_t N, int64_t K, int64_t n0) {
  float out[X_ROWS * RR];
  for (int m0 = 0; m0 < M; m0 += X_ROWS) {
    const int mm = std::min(X_ROWS, M - m0);
    const T* xm = x + m0 * K;
    if (mm == 1) {
      dot_any<1, RR>(xm, w, K, out);
    } else {
      dot_any<2, RR>(xm, w, K, out);
    }
    for (int m = 0; m < mm; ++m)
      for (int r = 0; r < RR; ++r)
        store(y + (m0 + m) * N + n0 + r, out[m * RR + r] + (bias ? load(bias + n0 + r) : 0.0f));
  }
}

template <typename T>
void small_linear(const T* x, const T* w, const T* bias, T* y, int M, int64_t N, int64_t K) {
  const int64_t blocks = N / R;
#pragma omp parallel
  {
    FlushDenormals ftz;
#pragma omp for schedule(static)  // each thread streams one contiguous part of w
    for (int64_t b = 0; b < blocks; ++b) rows<R>(x, w + b * R * K, bias, y, M, N, K, b * R);
#pragma omp single
    for (int64_t n = blocks * R; n < N; ++n) rows<1>(x, w + n * K, bias, y, M, N, K, n);
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16 (x, w, bias, y); x [M, K], w [N, K], y [M, N], all contiguous;
// K a multiple of 16, 1 <= M <= 16. Returns 0, or a positive code for bad arguments.
int pagedserve_small_linear(int dtype, const void* x, const void* w, const void* bias, void* y, int M, int64_t N,
                            int64_t K) {
  if (M < 1 || M > MAX_ROWS || N <= 0 || K <= 0 || K % LANES != 0) return 1;
  if (dtype == 0) {
    small_linear(static_cast<const float*>(x), static_cast<const float*>(w), static_cast<const float*>(bias),
                 static_cast<float*>(y), M, N, K);
  } else if (dtype == 1) {
    small_linear(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(bias),
                 static_cast<uint16_t*>(y), M, N, K);
  } else {
    return 2;
  }
  return 0;
}

}  // extern "C"
