// Helpers shared by the CPU kernels (cpu_attention.cpp, cpu_ops.cpp): bf16
// loads and stores rounded as torch rounds, 16-float vectors, and a
// vectorisable exp. Header-only so every kernel inlines them.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedserve_cpu {

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {  // bfloat16: the high half of a float
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}

// 2^t for t in [-126, 128), vectorisable: an integer power of two (built in
// the exponent bits) times a degree-6 polynomial of the fraction; relative
// error about 2e-7. A scalar libm call per score cost more than the whole QK^T.
inline float exp2_poly(float t) {
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

constexpr float LOG2E = 1.44269504088896341f;

// exp(x) for x <= 0 (scores minus their running max).
inline float exp_nonpositive(float x) { return exp2_poly(std::max(x, -87.0f) * LOG2E); }

// exp(x) for any float (silu's exp(-x)), clamped where float overflows.
inline float exp_any(float x) { return exp2_poly(std::min(std::max(x, -87.0f), 88.0f) * LOG2E); }

// 16 floats: one AVX-512 register, or two AVX2 ones (GCC vector extensions
// build for whatever -march=native offers).
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
constexpr int LANES = 16;

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf loadv(const uint16_t* p) {  // bfloat16 -> float: shift into the high half
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(vf v) {
  float t = 0.0f;
  for (int i = 0; i < LANES; ++i) t += v[i];
  return t;
}


// The float a bfloat16 rounding of v gives back (torch rounds every bf16 op).
inline float round_bf16(float v) {
  uint16_t h;
  store(&h, v);
  return load(&h);
}
inline float round_as(const float*, float v) { return v; }
inline float round_as(const uint16_t*, float v) { return round_bf16(v); }

}  // namespace pagedserve_cpu
