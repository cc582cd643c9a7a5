// GGUF blocks repacked for the products of quant_cpu.cpp (at load), and back: the
// file's bytes reordered into groups of 16 rows (kernels/quant_blocks.h has the
// layout), the inverse, and rows dequantized exactly as kernels/quant.py does.
#include <omp.h>

#include <cstring>

#include "cpu_common.h"
#include "quant_blocks.h"

namespace {

using namespace pagedserve_cpu;
using namespace pagedserve_quant;

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

}  // extern "C"
