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
//
// The weight is repacked once (at load) into groups of 16 output rows, so one
// 64-byte vector holds 4 consecutive weights of 16 rows: the int32 lanes of a
// product are the 16 outputs, and no sum is reduced across lanes. The bytes are
// the file's (nibbles stay nibbles, scales stay fp16), only reordered; Q4_K
// spends 4 bytes more per 256 weights (its 6-bit scales unpacked to bytes).
// Per group and unit (32 weights; 256 for the K types):
//   Q8_0  q[8 quads][16 rows][4] u8 ^ 0x80, d[16] f16                      544 B
//   Q4_0  n[4][16][4] (low nibble: quad j, high: quad j + 4), d[16] f16    288 B
//   Q4_1  n as Q4_0, d[16], m[16] f16                                      320 B
//   Q5_0  n as Q4_0, h[16][4] (bit j: the fifth bit of quad j), d[16]      352 B
//   Q5_1  n, h as Q5_0, d[16], m[16] f16                                   384 B
//   Q4_K  d[16], dmin[16] f16, sc[8][16], mn[8][16] u8, 8 x n (256 B)     2368 B
//   Q6_K  d[16] f16, sc[16][16] i8, 8 x (n 256 B, h[2][16][4] 128 B)     3360 B
// where h[i] holds the top 2 bits of quads 4i .. 4i + 3, quad 4i + t at bits 2t.
#include <omp.h>

#include <vector>

#include "cpu_common.h"

namespace {

using namespace pagedserve_cpu;

constexpr int Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14;  // ggml's type numbers
constexpr int G = 16;                                             // rows per group

constexpr int unit_weights(int qt) { return qt == Q4_K || qt == Q6_K ? 256 : 32; }
constexpr int64_t unit_bytes(int qt) {
  switch (qt) {
    case Q8_0: return 544;
    case Q4_0: return 288;
    case Q4_1: return 320;
    case Q5_0: return 352;
    case Q5_1: return 384;
    case Q4_K: return 2368;
    case Q6_K: return 3360;
    default: return 0;
  }
}
int64_t file_block_bytes(int qt) {
  switch (qt) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q4_K: return 144;
    case Q6_K: return 210;
    default: return 0;
  }
}

// ---------------------------------------------------------------- repacking
// Nibble vectors of 32 unsigned 4-bit values q[0..31] of row r into n (one group's 256 bytes).
inline void put_nibbles(uint8_t* n, int r, const uint8_t* q) {
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < 4; ++t) n[j * 64 + r * 4 + t] = static_cast<uint8_t>(q[4 * j + t] | (q[16 + 4 * j + t] << 4));
}

// One file block (or superblock) of row r into the group's unit at u.
void pack_block(int qt, const uint8_t* src, uint8_t* u, int r) {
  uint8_t q[32];
  switch (qt) {
    case Q8_0:
      for (int k = 0; k < 32; ++k) u[(k / 4) * 64 + r * 4 + k % 4] = src[2 + k] ^ 0x80u;
      std::memcpy(u + 512 + 2 * r, src, 2);
      break;
    case Q4_0:
    case Q4_1:
      for (int k = 0; k < 16; ++k) q[k] = src[(qt == Q4_1 ? 4 : 2) + k] & 0x0F, q[16 + k] = src[(qt == Q4_1 ? 4 : 2) + k] >> 4;
      put_nibbles(u, r, q);
      std::memcpy(u + 256 + 2 * r, src, 2);
      if (qt == Q4_1) std::memcpy(u + 288 + 2 * r, src + 2, 2);
      break;
    case Q5_0:
    case Q5_1: {
      const int off = qt == Q5_1 ? 4 : 2;
      uint32_t qh;
      std::memcpy(&qh, src + off, 4);
      const uint8_t* qs = src + off + 4;
      for (int k = 0; k < 16; ++k) q[k] = qs[k] & 0x0F, q[16 + k] = qs[k] >> 4;
      put_nibbles(u, r, q);
      for (int quad = 0; quad < 8; ++quad)
        for (int t = 0; t < 4; ++t) u[256 + r * 4 + t] |= static_cast<uint8_t>(((qh >> (4 * quad + t)) & 1u) << quad);
      std::memcpy(u + 320 + 2 * r, src, 2);
      if (qt == Q5_1) std::memcpy(u + 352 + 2 * r, src + 2, 2);
      break;
    }
    case Q4_K: {
      std::memcpy(u + 2 * r, src, 2);
      std::memcpy(u + 32 + 2 * r, src + 2, 2);
      const uint8_t* s = src + 4;  // ggml's get_scale_min_k4
      for (int j = 0; j < 8; ++j) {
        const uint8_t sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        const uint8_t mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        u[64 + j * G + r] = sc;
        u[192 + j * G + r] = mn;
        const uint8_t* qs = src + 16 + (j / 2) * 32;
        for (int l = 0; l < 32; ++l) q[l] = j % 2 ? qs[l] >> 4 : qs[l] & 0x0F;
        put_nibbles(u + 320 + j * 256, r, q);
      }
      break;
    }
    case Q6_K: {
      std::memcpy(u + 2 * r, src + 208, 2);
      for (int j = 0; j < 16; ++j) u[32 + j * G + r] = src[192 + j];
      for (int s = 0; s < 8; ++s) {  // ggml's group s = 4 h + i of 32 weights
        const int h = s / 4, i = s % 4;
        uint8_t* sub = u + 288 + s * 384;
        for (int l = 0; l < 32; ++l) {
          const uint8_t lo = (src[h * 64 + (i % 2) * 32 + l] >> (4 * (i / 2))) & 0x0F;
          q[l] = static_cast<uint8_t>(lo | (((src[128 + h * 32 + l] >> (2 * i)) & 3) << 4));
        }
        uint8_t lo4[32];
        for (int l = 0; l < 32; ++l) lo4[l] = q[l] & 0x0F;
        put_nibbles(sub, r, lo4);
        for (int quad = 0; quad < 8; ++quad)
          for (int t = 0; t < 4; ++t) {
            uint8_t& b = sub[256 + (quad / 4) * 64 + r * 4 + t];
            b = static_cast<uint8_t>(b | ((q[4 * quad + t] >> 4) << (2 * (quad % 4))));
          }
      }
      break;
    }
  }
}

// 32 nibbles of row r back from a group's nibble vectors (put_nibbles' inverse).
inline void get_nibbles(const uint8_t* n, int r, uint8_t* q) {
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < 4; ++t) {
      const uint8_t b = n[j * 64 + r * 4 + t];
      q[4 * j + t] = b & 0x0F;
      q[16 + 4 * j + t] = b >> 4;
    }
}

// pack_block's inverse: row r of the group's unit at u back into the file's block at dst.
void unpack_block(int qt, const uint8_t* u, uint8_t* dst, int r) {
  uint8_t q[32];
  switch (qt) {
    case Q8_0:
      std::memcpy(dst, u + 512 + 2 * r, 2);
      for (int k = 0; k < 32; ++k) dst[2 + k] = u[(k / 4) * 64 + r * 4 + k % 4] ^ 0x80u;
      break;
    case Q4_0:
    case Q4_1: {
      const int off = qt == Q4_1 ? 4 : 2;
      std::memcpy(dst, u + 256 + 2 * r, 2);
      if (qt == Q4_1) std::memcpy(dst + 2, u + 288 + 2 * r, 2);
      get_nibbles(u, r, q);
      for (int k = 0; k < 16; ++k) dst[off + k] = static_cast<uint8_t>(q[k] | (q[16 + k] << 4));
      break;
    }
    case Q5_0:
    case Q5_1: {
      const int off = qt == Q5_1 ? 4 : 2;
      std::memcpy(dst, u + 320 + 2 * r, 2);
      if (qt == Q5_1) std::memcpy(dst + 2, u + 352 + 2 * r, 2);
      get_nibbles(u, r, q);
      uint32_t qh = 0;
      for (int k = 0; k < 32; ++k) qh |= static_cast<uint32_t>((u[256 + r * 4 + k % 4] >> (k / 4)) & 1u) << k;
      std::memcpy(dst + off, &qh, 4);
      for (int k = 0; k < 16; ++k) dst[off + 4 + k] = static_cast<uint8_t>(q[k] | (q[16 + k] << 4));
      break;
    }
    case Q4_K: {
      std::memcpy(dst, u + 2 * r, 2);
      std::memcpy(dst + 2, u + 32 + 2 * r, 2);
      uint8_t sc[8], mn[8];
      for (int j = 0; j < 8; ++j) sc[j] = u[64 + j * G + r], mn[j] = u[192 + j * G + r];
      uint8_t* s = dst + 4;
      for (int j = 0; j < 4; ++j) {
        s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
        s[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
        s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4));
      }
      for (int j = 0; j < 8; ++j) {
        get_nibbles(u + 320 + j * 256, r, q);
        uint8_t* qs = dst + 16 + (j / 2) * 32;
        for (int l = 0; l < 32; ++l) qs[l] = static_cast<uint8_t>(j % 2 ? qs[l] | (q[l] << 4) : q[l]);
      }
      break;
    }
    case Q6_K: {
      std::memcpy(dst + 208, u + 2 * r, 2);
      for (int j = 0; j < 16; ++j) dst[192 + j] = u[32 + j * G + r];
      std::memset(dst, 0, 192);
      for (int s = 0; s < 8; ++s) {
        const int h = s / 4, i = s % 4;
        const uint8_t* sub = u + 288 + s * 384;
        get_nibbles(sub, r, q);
        for (int l = 0; l < 32; ++l) {
          const uint8_t hi = (sub[256 + (l / 16) * 64 + r * 4 + l % 4] >> (2 * ((l / 4) % 4))) & 3;
          dst[h * 64 + (i % 2) * 32 + l] |= static_cast<uint8_t>(q[l] << (4 * (i / 2)));
          dst[128 + h * 32 + l] |= static_cast<uint8_t>(hi << (2 * i));
        }
      }
      break;
    }
  }
}

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
inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512i shift16(__m512i v, int s) {  // left by s (right by -s) in 16-bit lanes; the callers mask per byte
  return s > 0 ? _mm512_slli_epi16(v, s) : s < 0 ? _mm512_srli_epi16(v, -s) : v;
}

// Quads jj and jj + 4 of the block at u (a 32-weight unit, or a K type's sub-block) as unsigned bytes.
template <int QT>
inline void quads(const uint8_t* u, int jj, __m512i& lo, __m512i& hi) {
  if constexpr (QT == Q8_0) {
    lo = _mm512_loadu_si512(u + 64 * jj);
    hi = _mm512_loadu_si512(u + 64 * (jj + 4));
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0F), v = _mm512_loadu_si512(u + 64 * jj);
    lo = _mm512_and_si512(v, m4);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if constexpr (QT == Q5_0 || QT == Q5_1) {  // bit j of h: the fifth bit of quad j
      const __m512i h = _mm512_loadu_si512(u + 256), m1 = _mm512_set1_epi8(0x10);
      lo = _mm512_or_si512(lo, _mm512_and_si512(shift16(h, 4 - jj), m1));
      hi = _mm512_or_si512(hi, _mm512_and_si512(shift16(h, -jj), m1));
    } else if constexpr (QT == Q6_K) {  // bits 2 jj, 2 jj + 1 of h[0] (h[1]): the top two of quad jj (jj + 4)
      const __m512i m2 = _mm512_set1_epi8(0x30);
      lo = _mm512_or_si512(lo, _mm512_and_si512(shift16(_mm512_loadu_si512(u + 256), 4 - 2 * jj), m2));
      hi = _mm512_or_si512(hi, _mm512_and_si512(shift16(_mm512_loadu_si512(u + 320), 4 - 2 * jj), m2));
    }
  }
}

// MM rows of x (from m0) times the 32 weights of block blk of PP groups (unit pointers u[p]), into acc:
// a, b per group (HALVES: a[p][h], b[p][h] for each 16). The quads are the outer loop, so each weight
// vector is decoded once and meets MM broadcast activations; the int sums stay in registers.
template <int QT, int MM, int PP, bool HALVES>
inline void dot32(const uint8_t* const (&u)[P], const __m512 (&a)[P][2], const __m512 (&b)[P][2], const Act& x,
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
template <int QT, int MM, int PP>
inline void tile(const uint8_t* wg, int64_t gstride, const Act& x, int64_t m0, __m512 (&acc)[MT][P],
                 const Prefetch& pf) {
  const int64_t units = x.K / unit_weights(QT), ub = unit_bytes(QT);
  __m512 a[P][2], b[P][2];
  const uint8_t* u[P];
  const char* done = pf.next;
  for (int64_t un = 0; un < units; ++un) {
    if (pf.next) prefetch_share(pf, un, done);
    if constexpr (unit_weights(QT) == 32) {
      for (int p = 0; p < PP; ++p) {
        u[p] = wg + p * gstride + un * ub;
        if (pf.self) prefetch_unit<QT>(u[p]);  // later row tiles find the unit in cache
        const int64_t sc = QT == Q8_0 ? 512 : QT == Q5_0 || QT == Q5_1 ? 320 : 256;  // d[16], then m[16]
        a[p][0] = f16x16(u[p] + sc);
        if constexpr (QT == Q4_1 || QT == Q5_1) b[p][0] = f16x16(u[p] + sc + 32);
        else b[p][0] = _mm512_mul_ps(a[p][0], _mm512_set1_ps(QT == Q8_0 ? -128.0f : QT == Q4_0 ? -8.0f : -16.0f));
      }
      dot32<QT, MM, PP, false>(u, a, b, x, m0, un, acc);
    } else {
      __m512 d[P], dm[P];
      for (int p = 0; p < PP; ++p) {
        if (pf.self) prefetch_unit<QT>(wg + p * gstride + un * ub);
        d[p] = f16x16(wg + p * gstride + un * ub);
        if constexpr (QT == Q4_K) dm[p] = f16x16(wg + p * gstride + un * ub + 32);
      }
      for (int s = 0; s < 8; ++s) {
        for (int p = 0; p < PP; ++p) {
          const uint8_t* unit = wg + p * gstride + un * ub;
          if constexpr (QT == Q4_K) {
            u[p] = unit + 320 + s * 256;
            a[p][0] = _mm512_mul_ps(d[p], u8x16(unit + 64 + s * G));
            b[p][0] = _mm512_mul_ps(dm[p], _mm512_sub_ps(_mm512_setzero_ps(), u8x16(unit + 192 + s * G)));
          } else {
            u[p] = unit + 288 + s * 384;
            a[p][0] = _mm512_mul_ps(d[p], i8x16(unit + 32 + (2 * s) * G));
            a[p][1] = _mm512_mul_ps(d[p], i8x16(unit + 32 + (2 * s + 1) * G));
            b[p][0] = _mm512_mul_ps(a[p][0], _mm512_set1_ps(-32.0f));
            b[p][1] = _mm512_mul_ps(a[p][1], _mm512_set1_ps(-32.0f));
          }
        }
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

// R rows at a time (then the remainder) against PP groups; ``next``: the groups this thread
// runs after these (its tiles prefetch them, cpu_common.h's Prefetch), or null.
template <int QT, int PP, int R, typename T>
inline void groups_rows(const uint8_t* wg, int64_t gstride, const Act& x, int64_t M, int64_t n0, int64_t N,
                        const T* bias, T* y, int64_t ldy, const uint8_t* next) {
  const int64_t tiles = (M + R - 1) / R, units = x.K / unit_weights(QT), run_bytes = PP * gstride;
  for (int64_t t = 0, m0 = 0; t < tiles; ++t, m0 += R) {
    Prefetch pf{t == 0, nullptr, 0};
    if (tiles > 1 && next) {  // tile t's share of the next groups: part t of tiles
      const int64_t lo = run_bytes * t / tiles, hi = run_bytes * (t + 1) / tiles;
      pf.next = reinterpret_cast<const char*>(next) + lo;
      pf.q16 = ((hi - lo) << 16) / units;
    }
    switch (std::min<int64_t>(R, M - m0)) {  // unrolled at compile time
#define PAGEDSERVE_ROWS(r) \
  case r:                  \
    if constexpr (r <= R) run_tile<QT, r, PP>(wg, gstride, x, m0, n0, N, bias, y, ldy, pf); break;
      PAGEDSERVE_ROWS(1) PAGEDSERVE_ROWS(2) PAGEDSERVE_ROWS(3) PAGEDSERVE_ROWS(4) PAGEDSERVE_ROWS(5)
      PAGEDSERVE_ROWS(6) PAGEDSERVE_ROWS(7) PAGEDSERVE_ROWS(8)
#undef PAGEDSERVE_ROWS
      default:
        break;
    }
  }
}
static_assert(MT <= 8, "groups_rows unrolls tiles of up to 8 rows");

// PP groups per tile and R rows per tile, over each thread's contiguous part of the groups.
template <int QT, int PP, int R, typename T>
void linear_tiles(const Act& x, const uint8_t* packed, const T* bias, T* y, int64_t M, int64_t N, int64_t ldy) {
  const int64_t groups = (N + G - 1) / G, runs = groups / PP, gstride = x.K / unit_weights(QT) * unit_bytes(QT);
#pragma omp parallel
  {
    FlushDenormals ftz;
    // Each thread streams one contiguous part of the groups (schedule(static), by hand: a run's
    // tiles prefetch the thread's next run).
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = runs * tid / nt, hi = runs * (tid + 1) / nt;
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
  switch (qt) {
    case Q8_0: linear<Q8_0>(x, packed, bias, y, M, N, ldy); break;
    case Q4_0: linear<Q4_0>(x, packed, bias, y, M, N, ldy); break;
    case Q4_1: linear<Q4_1>(x, packed, bias, y, M, N, ldy); break;
    case Q5_0: linear<Q5_0>(x, packed, bias, y, M, N, ldy); break;
    case Q5_1: linear<Q5_1>(x, packed, bias, y, M, N, ldy); break;
    case Q4_K: linear<Q4_K>(x, packed, bias, y, M, N, ldy); break;
    case Q6_K: linear<Q6_K>(x, packed, bias, y, M, N, ldy); break;
  }
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

// One file block (or superblock) of type qt at b as float32, exactly as kernels/quant.py's
// dequantize (ggml's formulas, each product and sum rounded as torch rounds them: no fused
// multiply-adds here).
__attribute__((optimize("fp-contract=off"))) void dequant_block(int qt, const uint8_t* b, float* out) {
  auto f16 = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
  };
  auto nib = [](const uint8_t* qs, int k) { return k < 16 ? qs[k] & 0x0F : qs[k - 16] >> 4; };  // 32 from 16 bytes
  const float d = f16(b);
  switch (qt) {
    case Q8_0:
      for (int k = 0; k < 32; ++k) out[k] = d * static_cast<float>(static_cast<int8_t>(b[2 + k]));
      break;
    case Q4_0:
      for (int k = 0; k < 32; ++k) out[k] = d * (static_cast<float>(nib(b + 2, k)) - 8.0f);
      break;
    case Q4_1: {
      const float m = f16(b + 2);
      for (int k = 0; k < 32; ++k) out[k] = d * static_cast<float>(nib(b + 4, k)) + m;
      break;
    }
    case Q5_0:
    case Q5_1: {
      const int off = qt == Q5_1 ? 4 : 2;
      uint32_t qh;
      std::memcpy(&qh, b + off, 4);
      const float m = qt == Q5_1 ? f16(b + 2) : 0.0f;
      for (int k = 0; k < 32; ++k) {
        const float q = static_cast<float>(nib(b + off + 4, k) | (((qh >> k) & 1u) << 4));
        out[k] = qt == Q5_1 ? d * q + m : d * (q - 16.0f);
      }
      break;
    }
    case Q4_K: {
      const float dmin = f16(b + 2);
      const uint8_t* s = b + 4;
      for (int j = 0; j < 8; ++j) {
        const uint8_t sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        const uint8_t mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        const float a = d * static_cast<float>(sc), c = dmin * static_cast<float>(mn);
        const uint8_t* qs = b + 16 + (j / 2) * 32;
        for (int l = 0; l < 32; ++l) out[j * 32 + l] = a * static_cast<float>(j % 2 ? qs[l] >> 4 : qs[l] & 0x0F) - c;
      }
      break;
    }
    case Q6_K: {
      const float d6 = f16(b + 208);
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t)
          for (int l = 0; l < 32; ++l) {
            const int w = h * 128 + t * 32 + l;
            const uint8_t lo = (b[h * 64 + (t % 2) * 32 + l] >> (4 * (t / 2))) & 0x0F;
            const uint8_t hi = (b[128 + h * 32 + l] >> (2 * t)) & 3;
            const float a = d6 * static_cast<float>(static_cast<int8_t>(b[192 + w / 16]));
            out[w] = a * (static_cast<float>(lo | (hi << 4)) - 32.0f);
          }
      break;
    }
  }
}

// Bytes of the packed form of an [N, K] weight of type qt (0: unknown type or K not whole units).
int64_t packed_bytes(int qt, int64_t N, int64_t K) {
  if (unit_bytes(qt) == 0 || N <= 0 || K <= 0 || K % unit_weights(qt)) return 0;
  return (N + G - 1) / G * (K / unit_weights(qt)) * unit_bytes(qt);
}

}  // namespace

extern "C" {

// src: the file's rows [N][K / block * block bytes]; dst: dst_bytes = ceil(N / 16) * units per row * unit
// bytes (kernels/quant_cpu.py's packed_bytes), rows past N zero. Returns 0, or 1 for bad arguments.
int pagedserve_quant_repack(int qt, const uint8_t* src, uint8_t* dst, int64_t N, int64_t K, int64_t dst_bytes) {
  const int64_t total = packed_bytes(qt, N, K);
  if (total == 0 || total != dst_bytes) return 1;
  const int64_t units = K / unit_weights(qt), ub = unit_bytes(qt), fb = file_block_bytes(qt), groups = (N + G - 1) / G;
  std::memset(dst, 0, total);
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < G && g * G + r < N; ++r)
      for (int64_t un = 0; un < units; ++un)
        pack_block(qt, src + (g * G + r) * units * fb + un * fb, dst + (g * units + un) * ub, r);
  return 0;
}

// pagedserve_quant_repack's inverse: the file's rows [N][K / block * block bytes] back from packed.
int pagedserve_quant_unpack(int qt, const uint8_t* packed, uint8_t* dst, int64_t N, int64_t K, int64_t packed_len) {
  const int64_t total = packed_bytes(qt, N, K);
  if (total == 0 || total != packed_len) return 1;
  const int64_t units = K / unit_weights(qt), ub = unit_bytes(qt), fb = file_block_bytes(qt), groups = (N + G - 1) / G;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < G && g * G + r < N; ++r)
      for (int64_t un = 0; un < units; ++un)
        unpack_block(qt, packed + (g * units + un) * ub, dst + (g * G + r) * units * fb + un * fb, r);
  return 0;
}

// Rows ids[0..n) of a packed [N, K] weight of type qt as float32 out [n][K], exactly as dequantize
// reads them (an embedding lookup: a decode step's few rows, not the groups around them).
// Returns 0, or 1 for bad arguments (an id out of range included).
int pagedserve_quant_rows(int qt, const uint8_t* packed, int64_t N, int64_t K, const int64_t* ids, int64_t n,
                          float* out) {
  if (packed_bytes(qt, N, K) == 0 || n < 0) return 1;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= N) return 1;
  const int64_t units = K / unit_weights(qt), ub = unit_bytes(qt), uw = unit_weights(qt);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = ids[i] / G;
    const int r = static_cast<int>(ids[i] % G);
    uint8_t blk[256];
    for (int64_t un = 0; un < units; ++un) {
      unpack_block(qt, packed + (g * units + un) * ub, blk, r);
      dequant_block(qt, blk, out + i * K + un * uw);
    }
  }
  return 0;
}

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
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // fp32 activations get two int8 terms, x = q1 d1 + q2 d2 (the second quantizes what the first
  // rounded off), so about 15 bits each instead of 8: the same tiles run 2M rows over one read of
  // the weight. bf16 activations carry 8 bits already, and one term matches them.
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
