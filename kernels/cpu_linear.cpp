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

#include "cpu_panels.h"

namespace {

using namespace pagedserve_cpu;
using namespace pagedserve_panels;


template <typename T>
void linear(const T* x, const T* packed, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
  const int64_t panels = (N + LANES - 1) / LANES, groups = panels / P, panel_elems = K * LANES;
#pragma omp parallel
  {
    FlushDenormals ftz;
    int64_t lo, hi;  // each thread streams one contiguous part of the groups
    thread_part(groups, lo, hi);
    for (int64_t g = lo; g < hi; ++g)
      panel_rows<P>(x, packed + g * P * panel_elems, bias, y, M, N, K, g * P * LANES, N,
                    g + 1 < hi ? packed + (g + 1) * P * panel_elems : nullptr);
#pragma omp for schedule(static)
    for (int64_t p = groups * P; p < panels; ++p)
      panel_rows<1>(x, packed + p * panel_elems, bias, y, M, N, K, p * LANES, N, static_cast<const T*>(nullptr));
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
