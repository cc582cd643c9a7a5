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

// Bytes of the packed form of an [N, K] weight of type qt (0: unknown type or K not whole units).
inline int64_t packed_bytes(int qt, int64_t N, int64_t K) {
  if (unit_bytes(qt) == 0 || N <= 0 || K <= 0 || K % unit_weights(qt)) return 0;
  return (N + G - 1) / G * (K / unit_weights(qt)) * unit_bytes(qt);
}

}  // namespace pagedserve_quant
