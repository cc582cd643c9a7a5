// The packed form of GGUF quantized weights shared by quant_pack.cpp (repacking a
// file's blocks, and back) and quant_cpu.cpp (the products over them).
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
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedserve_quant {

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
inline int64_t file_block_bytes(int qt) {
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

// f(std::integral_constant<int, QT>{}) for the ggml type qt, so a kernel is instantiated per type
// once, here; false for a type not packed here.
template <typename F>
inline bool with_type(int qt, F&& f) {
  switch (qt) {
    case Q8_0: f(std::integral_constant<int, Q8_0>{}); return true;
    case Q4_0: f(std::integral_constant<int, Q4_0>{}); return true;
    case Q4_1: f(std::integral_constant<int, Q4_1>{}); return true;
    case Q5_0: f(std::integral_constant<int, Q5_0>{}); return true;
    case Q5_1: f(std::integral_constant<int, Q5_1>{}); return true;
    case Q4_K: f(std::integral_constant<int, Q4_K>{}); return true;
    case Q6_K: f(std::integral_constant<int, Q6_K>{}); return true;
    default: return false;
  }
}

// Bytes of the packed form of an [N, K] weight of type qt (0: unknown type or K not whole units).
inline int64_t packed_bytes(int qt, int64_t N, int64_t K) {
  if (unit_bytes(qt) == 0 || N <= 0 || K <= 0 || K % unit_weights(qt)) return 0;
  return (N + G - 1) / G * (K / unit_weights(qt)) * unit_bytes(qt);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Decoding a group's units with AVX-512, for the int8 products (quant_cpu.cpp) and the bf16 prompt
// path (quant_bf16.cpp). Every type is w = a q + b per row with q unsigned (quant_cpu.cpp's comment).
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

// Sub-block s (32 weights; 0 for the 32-weight types) of a unit: its 16 rows' a and b ([1]: Q6_K's
// second 16 weights, whose scale is their own), and where its quads start (for quads()).
template <int QT>
inline const uint8_t* sub_block(const uint8_t* unit, int s, __m512 (&a)[2], __m512 (&b)[2]) {
  if constexpr (QT == Q4_K) {
    a[0] = _mm512_mul_ps(f16x16(unit), u8x16(unit + 64 + s * G));
    b[0] = _mm512_mul_ps(f16x16(unit + 32), _mm512_sub_ps(_mm512_setzero_ps(), u8x16(unit + 192 + s * G)));
    return unit + 320 + s * 256;
  } else if constexpr (QT == Q6_K) {
    const __m512 d = f16x16(unit);
    a[0] = _mm512_mul_ps(d, i8x16(unit + 32 + (2 * s) * G));
    a[1] = _mm512_mul_ps(d, i8x16(unit + 32 + (2 * s + 1) * G));
    b[0] = _mm512_mul_ps(a[0], _mm512_set1_ps(-32.0f));
    b[1] = _mm512_mul_ps(a[1], _mm512_set1_ps(-32.0f));
    return unit + 288 + s * 384;
  } else {
    constexpr int64_t sc = QT == Q8_0 ? 512 : QT == Q5_0 || QT == Q5_1 ? 320 : 256;  // d[16], then m[16]
    a[0] = f16x16(unit + sc);
    if constexpr (QT == Q4_1 || QT == Q5_1) b[0] = f16x16(unit + sc + 32);
    else b[0] = _mm512_mul_ps(a[0], _mm512_set1_ps(QT == Q8_0 ? -128.0f : QT == Q4_0 ? -8.0f : -16.0f));
    return unit;
  }
}
#endif

}  // namespace pagedserve_quant

// The bf16 prompt path (quant_bf16.cpp), for pagedserve_quant_linear_parts (quant_cpu.cpp).
extern "C" {
extern int pagedserve_quant_dequant_rows;
int pagedserve_quant_linear_bf16(int qt, const void* x, const uint8_t* packed, const void* bias, void* y, int64_t M,
                                 int64_t N, int64_t K, int64_t ldy);
}
