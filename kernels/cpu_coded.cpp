// bf16 panels with coded exponents: the same weights as cpu_linear.cpp's panels,
// bit for bit, in 12 bits each instead of 16. A bf16's high byte (sign and the
// exponent's top 7 bits) takes few values in a weight tensor (the 15 most common
// cover all but about 2e-4 of a seeded random 1B's weights), so it is stored as a
// 4-bit code into the tensor's table of them; the low byte (the exponent's last bit
// and the mantissa) is stored as it is. Code 15 escapes: its table entry is a high
// byte no coded weight has, and the weight's own follows in a side stream, read in
// order. Decoding is one vpermb and two byte interleaves per 64 weights, so a decode
// step that reads every weight once (one to a few rows) reads 0.75 of the bytes: the
// 2-core EPYC's memory, not its vector units, bounds those steps (docs/gpuworker.md,
// "Coded panels"). The sums are the plain panels' own, in the same order, so the
// output equals pagedserve_linear's bit for bit; past CODED_ROWS rows the decode's
// vector work costs more than the bytes save, and the plain panels run (the caller
// keeps both).
//
// Layout of a coded tensor (AVX-512 groups of P = 3 panels, K % 4 == 0): a 64-byte
// header (int64 groups, K, escapes; the 16-byte table at 32), int64 escape offsets
// [groups + 1], then per group 3 * K / 4 units of 96 bytes (64 low bytes, 32 code
// bytes) and last the escaped high bytes. Unit u of a group holds plain zmm vectors
// 2u and 2u + 1 of that group's stream, in the order vpunpck{l,h}bw interleaves them.
#include <omp.h>

#include <vector>

#include "cpu_panels.h"

extern "C" int pagedserve_linear(int dtype, const void* x, const void* packed, const void* bias, void* y, int64_t M,
                                 int64_t N, int64_t K);

namespace {

using namespace pagedserve_cpu;
using namespace pagedserve_panels;

constexpr int CODED_ROWS = 4;    // at most this many rows run coded (measured: docs/gpuworker.md)
constexpr int UNIT = 96;         // bytes per 64 weights
constexpr int64_t HEADER = 64;
constexpr int ESCAPE = 15;
constexpr int AHEAD = 8192;      // prefetch distance in the unit stream, as the panels' 8 KB

struct Header {
  int64_t groups, K, escapes, reserved;
  uint8_t table[16];
};

// Byte b (0..63) of a unit's 64 low or high bytes belongs to word `word_of(b)` of vector `vec_of(b)` (0: the
// unpacklo one, 1: unpackhi), inverting vpunpcklbw / vpunpckhbw's per-128-bit-lane interleave.
inline int vec_of(int b) { return (b % 16) / 8; }
inline int word_of(int b) { return (b / 16) * 8 + b % 8; }

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512VBMI2__)
constexpr bool AVAILABLE = P == 3;

struct Decoder {
  __m512i table;     // the 16-byte table in each 128-bit lane: vpermb's 6-bit index finds code & 15 in it
  __m512i sentinel;  // table[ESCAPE], a high byte no coded weight has
  const uint8_t* esc;
  __attribute__((always_inline)) inline void unit(const uint8_t* u, __m512bh& a, __m512bh& b) {
    const __m512i lo = _mm512_loadu_si512(u);
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64));
    // bytes 0-31 index by their low nibble, bytes 32-63 by their high one (bits 4-5 above it land in
    // the table's copies, so no mask is needed)
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(codes), _mm256_srli_epi16(codes, 4), 1);
    __m512i hi = _mm512_permutexvar_epi8(idx, table);
    const __mmask64 e = _mm512_cmpeq_epi8_mask(hi, sentinel);
    if (__builtin_expect(e != 0, 0)) {
      hi = _mm512_mask_expandloadu_epi8(hi, e, esc);
      esc += __builtin_popcountll(e);
    }
    a = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    b = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
  }
};

template <int M>
__attribute__((always_inline)) inline void pair_step(const uint16_t* x, int64_t K, int64_t k, const __m512bh (&w)[3],
                                                     __m512 (&acc)[MT][P]) {
  for (int m = 0; m < M; ++m) {
    uint32_t pair;
    std::memcpy(&pair, x + m * K + k, sizeof pair);
    const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
    for (int p = 0; p < 3; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], w[p], xv);
  }
}

// M rows of x against one coded group: the plain tile's sums, in its order; y's rows N apart, and
// the group's last panel cut at N (its padding features are not stored).
template <int M>
void coded_tile(const uint16_t* x, int64_t K, const uint8_t* units, Decoder d, const uint16_t* bias, uint16_t* y,
                int64_t n0, int64_t N) {
  __m512 acc[MT][P];
  for (int m = 0; m < M; ++m)
    for (int p = 0; p < P; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 4, units += 3 * UNIT) {  // two k pairs: 6 vectors in 3 units
    for (int i = 0; i < 3 * UNIT; i += 64) __builtin_prefetch(units + AHEAD + i, 0, 2);
    __m512bh w[3], carry;
    d.unit(units, w[0], w[1]);
    d.unit(units + UNIT, w[2], carry);
    pair_step<M>(x, K, k, w, acc);
    w[0] = carry;
    d.unit(units + 2 * UNIT, w[1], w[2]);
    pair_step<M>(x, K, k + 2, w, acc);
  }
  vf sums[MT][P];
  std::memcpy(sums, acc, sizeof(vf) * M * P);  // the rows this tile used, in vf's form
  store_tile<M, P>(sums, bias, y, N, n0, N);
}

void coded_linear(const uint16_t* x, const uint8_t* coded, const uint16_t* panels, const uint16_t* bias, uint16_t* y,
                  int64_t M, int64_t N, int64_t K) {
  const Header* h = reinterpret_cast<const Header*>(coded);
  const int64_t* offsets = reinterpret_cast<const int64_t*>(coded + HEADER);
  const uint8_t* units = coded + HEADER + (h->groups + 1) * 8;
  const int64_t group_bytes = 3 * K / 4 * UNIT, panel_elems = K * LANES;
  const uint8_t* escapes = units + h->groups * group_bytes;
  const int64_t panels_n = (N + LANES - 1) / LANES, tiles = (M + MT - 1) / MT, base = M / tiles, extra = M % tiles;
#pragma omp parallel
  {
    FlushDenormals ftz;
    Decoder d{_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h->table))),
              _mm512_set1_epi8(static_cast<char>(h->table[ESCAPE])), nullptr};
    int64_t lo, hi;
    thread_part(h->groups, lo, hi);
    for (int64_t g = lo; g < hi; ++g) {
      int64_t m0 = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t rows = base + (t < extra);
        d.esc = escapes + offsets[g];
        with_rows<MT>(rows, [&](auto r) __attribute__((always_inline)) {
          coded_tile<decltype(r)::value>(x + m0 * K, K, units + g * group_bytes, d, bias, y + m0 * N, g * P * LANES, N);
        });
        m0 += rows;
      }
    }
#pragma omp for schedule(static)
    for (int64_t p = h->groups * P; p < panels_n; ++p)
      panel_rows<1>(x, panels + p * panel_elems, bias, y, M, N, K, p * LANES, N, static_cast<const uint16_t*>(nullptr));
  }
}
#else
constexpr bool AVAILABLE = false;
#endif

// The 15 most common high bytes of the grouped panels (the rest escape), their codes, the escape count.
void choose(const uint16_t* panels, int64_t elems, uint8_t (&table)[16], uint8_t (&code)[256], int64_t& escapes) {
  std::vector<int64_t> counts(256, 0);
#pragma omp parallel
  {
    int64_t local[256] = {0};
#pragma omp for schedule(static)
    for (int64_t i = 0; i < elems; ++i) ++local[panels[i] >> 8];
#pragma omp critical
    for (int v = 0; v < 256; ++v) counts[v] += local[v];
  }
  std::vector<int> order(256);
  for (int v = 0; v < 256; ++v) order[v] = v;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return counts[a] > counts[b]; });
  std::fill(std::begin(code), std::end(code), static_cast<uint8_t>(ESCAPE));
  escapes = 0;
  for (int i = 0; i < 256; ++i) {
    if (i < ESCAPE) {
      table[i] = static_cast<uint8_t>(order[i]);
      code[order[i]] = static_cast<uint8_t>(i);
    } else {
      escapes += counts[order[i]];
    }
  }
  table[ESCAPE] = static_cast<uint8_t>(order[ESCAPE]);  // the sentinel: not coded, so its weights escape too
}

}  // namespace

extern "C" {

// Rows up to which pagedserve_coded_linear runs the coded units (then the plain panels).
int pagedserve_coded_rows() { return AVAILABLE ? CODED_ROWS : 0; }

// panels: pagedserve_linear_pack's bf16 panels of a [N, K] weight. Writes the coded form's size to *size;
// with out non-null and cap >= *size, writes it to out. Returns 0; 1 for bad shapes (K % 4, or no whole
// group); 2 where this CPU cannot run the coded kernel.
int pagedserve_coded_pack(const void* panels, int64_t N, int64_t K, void* out, int64_t cap, int64_t* size) {
  if (!AVAILABLE) return 2;
  const int64_t groups = (N + LANES - 1) / LANES / P;
  if (K <= 0 || K % 4 != 0 || groups < 1) return 1;
  const uint16_t* w = static_cast<const uint16_t*>(panels);
  const int64_t group_elems = K * P * LANES, group_bytes = 3 * K / 4 * UNIT;
  uint8_t table[16], code[256];
  int64_t escapes = 0;
  choose(w, groups * group_elems, table, code, escapes);
  const int64_t units_at = HEADER + (groups + 1) * 8;
  *size = units_at + groups * group_bytes + escapes;
  if (out == nullptr || cap < *size) return 0;
  uint8_t* o = static_cast<uint8_t*>(out);
  Header h{groups, K, escapes, 0, {}};
  std::memcpy(h.table, table, 16);
  std::memset(o, 0, HEADER);
  std::memcpy(o, &h, sizeof h);
  int64_t* offsets = reinterpret_cast<int64_t*>(o + HEADER);
  offsets[0] = 0;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {  // each group's escapes, to place its side stream
    int64_t n = 0;
    for (int64_t i = 0; i < group_elems; ++i) n += code[w[g * group_elems + i] >> 8] == ESCAPE;
    offsets[g + 1] = n;
  }
  for (int64_t g = 0; g < groups; ++g) offsets[g + 1] += offsets[g];
  uint8_t* escaped = o + units_at + groups * group_bytes;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t* src = w + g * group_elems;
    uint8_t* dst = o + units_at + g * group_bytes;
    uint8_t* esc = escaped + offsets[g];
    for (int64_t u = 0; u < group_elems / 64; ++u, src += 64, dst += UNIT) {
      std::memset(dst + 64, 0, 32);
      for (int b = 0; b < 64; ++b) {  // byte b interleaves into word word_of(b) of vector vec_of(b)
        const uint16_t v = src[vec_of(b) * 32 + word_of(b)];
        const uint8_t c = code[v >> 8];
        dst[b] = static_cast<uint8_t>(v & 0xFF);
        dst[64 + b % 32] |= static_cast<uint8_t>(b < 32 ? c : c << 4);
        if (c == ESCAPE) *esc++ = static_cast<uint8_t>(v >> 8);
      }
    }
  }
  return 0;
}

// y [M, N] = x [M, K] . W^T (+ bias), bf16: coded units for up to CODED_ROWS rows, else panels (both of W).
int pagedserve_coded_linear(const void* x, const void* coded, const void* panels, const void* bias, void* y, int64_t M,
                            int64_t N, int64_t K) {
  if (M < 1 || N <= 0 || K <= 0) return 1;
  if (!AVAILABLE || coded == nullptr || M > CODED_ROWS) return pagedserve_linear(1, x, panels, bias, y, M, N, K);
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512VBMI2__)
  const Header* h = static_cast<const Header*>(coded);
  if (h->K != K || h->groups != (N + LANES - 1) / LANES / P) return 1;
  coded_linear(static_cast<const uint16_t*>(x), static_cast<const uint8_t*>(coded), static_cast<const uint16_t*>(panels),
               static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(y), M, N, K);
#endif
  return 0;
}

}  // extern "C"
