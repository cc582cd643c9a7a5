// Prompt-sized products with bf16 activations (pagedserve_quant_linear_parts from
// pagedserve_quant_dequant_rows rows up): each thread decodes a run of 3 packed
// groups (48 output rows) into bf16 panels in a buffer of its own, [K/2][3][16][2]
// as cpu_linear.cpp packs them, and the panels' vdpbf16ps tiles (cpu_panels.h)
// run every row of x over it. The weights then meet the activations as the
// dequantized bf16 model's do: one int8 term of bf16 activations (the decode
// path, llama.cpp's) rounds each to 8 bits of its block's largest, which put
// perplexity 0.58 % (Q8_0) and 0.69 % (Q4_K_M) above the fp32 reference. A
// weight is decoded once per prompt step for all M rows; measurements in
// docs/gpuworker.md ("Accuracy").
#include <omp.h>

#include <vector>

#include "cpu_panels.h"
#include "quant_blocks.h"

namespace {

using namespace pagedserve_cpu;
using namespace pagedserve_quant;
namespace pn = pagedserve_panels;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool HAVE_BF16 = true;

// Weights k (w0) and k + 1 (w1) of 16 rows as vdpbf16ps reads a pair: lane r holds w0[r] in its low
// half and w1[r] in its high one, each rounded to nearest even (as torch's .to(bfloat16)).
inline __m512i pairs(__m512 w0, __m512 w1) {
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);  // words 0-15: w0, 16-31: w1
  return _mm512_permutexvar_epi16(_mm512_load_si512(order), halves);
}

// The 32 weights of a sub-block (quads at q) of one group into its slot of the panels: out is the
// slot of the sub-block's first k pair, pstride the elements from one k pair to the next.
template <int QT>
inline void decode32(const uint8_t* q, const __m512 (&a)[2], const __m512 (&b)[2], uint16_t* out, int64_t pstride) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  for (int jj = 0; jj < 4; ++jj) {
    __m512i v[2];
    quads<QT>(q, jj, v[0], v[1]);
    for (int h = 0; h < 2; ++h) {  // weights 4 jj + i of the sub-block (h = 0), 16 + 4 jj + i (h = 1)
      const int s = QT == Q6_K ? h : 0;
      __m512 w[4];
      for (int i = 0; i < 4; ++i) {
        const __m512i qi = _mm512_and_si512(_mm512_srli_epi32(v[h], 8 * i), byte);
        w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), a[s], b[s]);
      }
      uint16_t* o = out + (8 * h + 2 * jj) * pstride;
      _mm512_storeu_si512(o, pairs(w[0], w[1]));
      _mm512_storeu_si512(o + pstride, pairs(w[2], w[3]));
    }
  }
}

// One packed group (16 rows, all K) into its slot of the panels.
template <int QT>
void decode_group(const uint8_t* wg, int64_t K, uint16_t* out, int64_t pstride) {
  const int64_t units = K / unit_weights(QT), ub = unit_bytes(QT);
  __m512 a[2], b[2];
  for (int64_t un = 0; un < units; ++un)
    for (int s = 0; s < unit_weights(QT) / 32; ++s) {
      const uint8_t* q = sub_block<QT>(wg + un * ub, s, a, b);
      decode32<QT>(q, a, b, out + (un * unit_weights(QT) + 32 * s) / 2 * pstride, pstride);
    }
}

template <int QT>
void linear(const uint16_t* x, const uint8_t* packed, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N,
            int64_t K, int64_t ldy) {
  constexpr int PP = pn::P;
  const int64_t groups = (N + G - 1) / G, runs = groups / PP, gstride = K / unit_weights(QT) * unit_bytes(QT);
#pragma omp parallel
  {
    FlushDenormals ftz;
    static thread_local std::vector<uint16_t> panels;  // each thread's own (OpenMP's threads persist)
    panels.resize(K * PP * G);
    int64_t lo, hi;
    thread_part(runs, lo, hi);
    for (int64_t r = lo; r < hi; ++r) {
      for (int p = 0; p < PP; ++p)
        decode_group<QT>(packed + (r * PP + p) * gstride, K, panels.data() + p * 2 * G, PP * 2 * G);
      // The tiles over these panels prefetch the next run's packed bytes: decoded from L2, not memory.
      pn::panel_rows<PP>(x, panels.data(), bias, y, M, N, K, r * PP * G, ldy,
                         r + 1 < hi ? packed + (r + 1) * PP * gstride : nullptr, PP * gstride);
    }
#pragma omp for schedule(static)
    for (int64_t g = runs * PP; g < groups; ++g) {
      decode_group<QT>(packed + g * gstride, K, panels.data(), 2 * G);
      pn::panel_rows<1>(x, panels.data(), bias, y, M, N, K, g * G, ldy, nullptr);
    }
  }
}
#else
constexpr bool HAVE_BF16 = false;
#endif

}  // namespace

extern "C" {

// From this many rows of bf16 activations the products decode the weight to bf16 panels
// (measured: docs/gpuworker.md, "Accuracy"); below it they quantize the activations to int8.
int pagedserve_quant_dequant_rows = 128;

// y [M][ldy] (columns 0 .. N of each row) = x [M][K] . W^T (+ bias [N] or null), all bf16, W [N][K]
// packed (quant_blocks.h) of ggml type qt. Returns 0; 1 bad arguments; 3 this CPU lacks AVX512-BF16.
int pagedserve_quant_linear_bf16(int qt, const void* x, const uint8_t* packed, const void* bias, void* y, int64_t M,
                                 int64_t N, int64_t K, int64_t ldy) {
  if (!HAVE_BF16) return 3;
  if (M < 1 || ldy < N || packed == nullptr || packed_bytes(qt, N, K) == 0) return 1;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
  const auto* xs = static_cast<const uint16_t*>(x);
  const auto* bs = static_cast<const uint16_t*>(bias);
  auto* ys = static_cast<uint16_t*>(y);
  if (!with_type(qt, [&](auto t) { linear<decltype(t)::value>(xs, packed, bs, ys, M, N, K, ldy); })) return 1;
#endif
  return 0;
}

}  // extern "C"
