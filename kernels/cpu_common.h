// Helpers shared by the CPU kernels (cpu_attention.cpp, cpu_ops.cpp): bf16
// loads and stores rounded as torch rounds, 16-float vectors, and a
// vectorisable exp. Header-only so every kernel inlines them.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <type_traits>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace pagedserve_cpu {

// Denormals flushed to zero (FTZ and DAZ) while a kernel's loop runs on this
// thread, the caller's mode restored after. The library is linked without
// -ffast-math's startup code (it would flush for the whole process), and
// without flushing the vectorised silu hit denormal assists: 18x slower than
// with them flushed, measured on an Intel Xeon (530 vs 28 us for 64 x 1536).
struct FlushDenormals {
#if defined(__SSE__)
  const unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

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

// What a tile of rows prefetches while it runs over a group of packed weights
// (cpu_linear.cpp's panels, quant_cpu.cpp's blocks). The first tile streams
// its group from memory, a few KB ahead of itself. With T tiles over a group,
// the later ones found the group in cache and the read stalled while they
// computed: each tile also prefetches 1 / T of the thread's next group, spread
// over its steps, so the weight read keeps one pace under all the tiles'
// compute (a 1B decode step's linears 1.1-1.3x faster at 16-32 rows,
// docs/gpuworker.md, "Linear layers").
struct Prefetch {
  bool self;         // ahead of the tile's own stream
  const char* next;  // this tile's share of the next group, or null
  int64_t q16;       // bytes of that share per k step, in 1/65536ths
};

// Tile t of tiles over a group of group_bytes, in steps k steps; next: the thread's next group or null.
inline Prefetch tile_prefetch(const void* next, int64_t group_bytes, int64_t t, int64_t tiles, int64_t steps) {
  Prefetch pf{t == 0, nullptr, 0};
  if (tiles > 1 && next) {  // part t of tiles
    const int64_t lo = group_bytes * t / tiles, hi = group_bytes * (t + 1) / tiles;
    pf.next = static_cast<const char*>(next) + lo;
    pf.q16 = ((hi - lo) << 16) / steps;
  }
  return pf;
}

// Inside an OpenMP parallel region: the calling thread's contiguous part [lo, hi) of n groups, as
// schedule(static) would give it, but known to the loop, so a group's tiles can prefetch the next.
inline void thread_part(int64_t n, int64_t& lo, int64_t& hi) {
  const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
  lo = n * tid / nt;
  hi = n * (tid + 1) / nt;
}

// f(std::integral_constant<int, r>{}) for a tile of r rows, 1 <= r <= MAX <= 8: the tile's row count a
// compile-time constant, so its loops over rows unroll and its sums stay in registers.
template <int MAX, typename F>
__attribute__((always_inline)) inline void with_rows(int64_t r, F&& f) {
  static_assert(MAX >= 1 && MAX <= 8, "with_rows unrolls tiles of up to 8 rows");
  switch (r) {
#define PAGEDSERVE_ROWS(n) \
  case n:                  \
    if constexpr (n <= MAX) f(std::integral_constant<int, n>{}); \
    break;
    PAGEDSERVE_ROWS(1) PAGEDSERVE_ROWS(2) PAGEDSERVE_ROWS(3) PAGEDSERVE_ROWS(4) PAGEDSERVE_ROWS(5)
    PAGEDSERVE_ROWS(6) PAGEDSERVE_ROWS(7) PAGEDSERVE_ROWS(8)
#undef PAGEDSERVE_ROWS
    default:
      break;
  }
}

inline void prefetch_share(const Prefetch& pf, int64_t step, const char*& done) {
  const char* target = pf.next + (((step + 1) * pf.q16) >> 16);
  for (; done < target; done += 64) __builtin_prefetch(done, 0, 2);
}

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

// fp8 KV cache elements (torch.float8_e4m3fn and torch.float8_e5m2): one byte
// each, distinct types so overloads pick the format. Both decode exactly
// through fp16: e5m2 is the high byte of an fp16; e4m3 moves its 4-bit exponent
// into fp16's 5-bit field (times 2^8 for the bias 7 vs 15), subnormals included.
struct fp8e4 { uint8_t bits; };
struct fp8e5 { uint8_t bits; };
// The kv_dtype argument of the entry points (kernels/cpu_attention.py's KV_CODES).
constexpr int KV_SAME = 0, KV_FP8_E4M3 = 2, KV_FP8_E5M2 = 3;

inline uint16_t fp16_bits(fp8e4 x) { return static_cast<uint16_t>(((x.bits & 0x80u) << 8) | ((x.bits & 0x7Fu) << 7)); }
inline uint16_t fp16_bits(fp8e5 x) { return static_cast<uint16_t>(x.bits << 8); }
constexpr float fp8_rescale(const fp8e4*) { return 256.0f; }
constexpr float fp8_rescale(const fp8e5*) { return 1.0f; }

inline float half_to_float(uint16_t h) {  // exact, subnormals included (no FTZ in this library)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | ((exp + 112u) << 23) | (mant << 13);  // exp 31 never occurs: writes saturate
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float load(const fp8e4* p) { return half_to_float(fp16_bits(*p)) * fp8_rescale(p); }
inline float load(const fp8e5* p) { return half_to_float(fp16_bits(*p)) * fp8_rescale(p); }

// float -> fp8, round to nearest even and saturating at the format's largest
// finite value (as vLLM's writes are); the same rule as kernels/fp8.py.
template <int MANT, int BIAS>
inline uint8_t encode_fp8(float v, float max_finite) {
  const uint8_t sign = std::signbit(v) ? 0x80u : 0u;
  const float a = std::min(std::fabs(v), max_finite);
  const float min_normal = std::ldexp(1.0f, 1 - BIAS);
  if (a < min_normal)  // subnormal: a multiple of 2^(1 - BIAS - MANT); 2^MANT rounds up to the least normal
    return sign | static_cast<uint8_t>(std::nearbyint(a * std::ldexp(1.0f, BIAS - 1 + MANT)));
  uint32_t u;
  std::memcpy(&u, &a, sizeof u);
  constexpr int DROP = 23 - MANT;
  u += (1u << (DROP - 1)) - 1u + ((u >> DROP) & 1u);
  const uint32_t e = (u >> 23) - 127u + BIAS, m = (u >> DROP) & ((1u << MANT) - 1u);
  return sign | static_cast<uint8_t>((e << MANT) | m);
}
inline void store(fp8e4* p, float v) { p->bits = encode_fp8<3, 7>(v, 448.0f); }
inline void store(fp8e5* p, float v) { p->bits = encode_fp8<2, 15>(v, 57344.0f); }

// 16 fp8 values -> floats: widen the bytes, build fp16 bits, convert in hardware.
template <typename F>
inline vf loadv_fp8(const F* p) {
  typedef uint8_t vb __attribute__((vector_size(16)));
  vb b;
  std::memcpy(&b, p, sizeof b);
  vh h = __builtin_convertvector(b, vh);
  if constexpr (std::is_same_v<F, fp8e4>) h = ((h & 0x80) << 8) | ((h & 0x7F) << 7);
  else h = h << 8;
  vf v;
#if defined(__AVX512F__)
  __m256i hi;
  std::memcpy(&hi, &h, sizeof hi);
  const __m512 f = _mm512_cvtph_ps(hi);
  std::memcpy(&v, &f, sizeof v);
#elif defined(__F16C__)
  __m128i lo, up;
  std::memcpy(&lo, &h, sizeof lo);
  std::memcpy(&up, reinterpret_cast<const char*>(&h) + 16, sizeof up);
  const __m256 f0 = _mm256_cvtph_ps(lo), f1 = _mm256_cvtph_ps(up);
  std::memcpy(&v, &f0, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &f1, 32);
#else
  for (int i = 0; i < LANES; ++i) v[i] = half_to_float(h[i]);
#endif
  return fp8_rescale(p) == 1.0f ? v : v * fp8_rescale(p);
}
inline vf loadv(const fp8e4* p) { return loadv_fp8(p); }
inline vf loadv(const fp8e5* p) { return loadv_fp8(p); }

}  // namespace pagedserve_cpu
