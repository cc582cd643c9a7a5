// The small per-layer ops of the CPU serving path, each one pass over its
// rows instead of the five to fifteen torch ops (and their temporaries) the
// plain path runs: residual add + RMSNorm (Llama's, or Gemma's with float32
// (1 + w) weights), per-head q/k norms, rotary embedding of q and k with the K/V
// cache write, and SiLU(gate) * up or GELU-tanh(gate) * up. At small batches these ops cost
// dispatch, not arithmetic, which is what a decode step of a small model is.
//
// Results equal the torch path's: fp32 up to the order of a sum, and bf16 with
// torch's rounding after every op it rounds (round_as). Rows are spread over
// torch's OpenMP threads once a batch is large enough to pay for the fork.
#include <cstdint>
#include <type_traits>

#include "cpu_common.h"

namespace {

using namespace pagedserve_cpu;

constexpr int PARALLEL_ROWS = 32;  // below this, one thread: the fork costs more than the rows

// out = weight * rmsnorm(x + residual); the sum is written to residual.
// Without a residual, x itself is normalised (and left as it is; out may be x).
// W == T: Llama's norm, rounded to T before the weight multiplies in T. W float
// with T bf16: Gemma's, whose float32 (1 + weight) multiplies before one rounding.
template <typename T, typename W = T>
void add_rms_norm(T* x, T* residual, const W* weight, T* out, int rows, int hidden, float eps) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS) schedule(static)
  for (int r = 0; r < rows; ++r) {
    T* xr = x + static_cast<int64_t>(r) * hidden;
    T* src = xr;
    if (residual != nullptr) {
      src = residual + static_cast<int64_t>(r) * hidden;
      for (int i = 0; i < hidden; ++i) store(src + i, load(xr + i) + load(src + i));
    }
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < hidden; ++i) ss += load(src + i) * load(src + i);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
    T* o = out + static_cast<int64_t>(r) * hidden;
    if constexpr (std::is_same_v<W, T>) {
      for (int i = 0; i < hidden; ++i) store(o + i, load(weight + i) * round_as(o, load(src + i) * inv));
    } else {
      for (int i = 0; i < hidden; ++i) store(o + i, load(src + i) * inv * weight[i]);
    }
  }
}

// Per-head RMSNorm of q and k in place (Gemma 3, Qwen3: before RoPE), rows of
// qkv [tokens, stride] as rope_and_cache reads them.
template <typename T, typename W>
void head_norms(T* qkv, int64_t stride, int tokens, int heads, int kv_heads, int head_dim, const W* q_weight,
                const W* k_weight, float eps) {
#pragma omp parallel for if (tokens >= PARALLEL_ROWS) schedule(static)
  for (int t = 0; t < tokens; ++t) {
    T* q = qkv + t * stride;
    T* k = q + static_cast<int64_t>(heads) * head_dim;
    add_rms_norm<T, W>(q, nullptr, q_weight, q, heads, head_dim, eps);
    add_rms_norm<T, W>(k, nullptr, k_weight, k, kv_heads, head_dim, eps);
  }
}

// Neox rotary embedding (rotate half) of one head in place.
template <typename T>
inline void rotate(T* x, const float* cos, const float* sin, int half) {
  for (int i = 0; i < half; ++i) {
    const float c = round_as(x, cos[i]), s = round_as(x, sin[i]);
    const float x1 = load(x + i), x2 = load(x + half + i);
    store(x + i, round_as(x, x1 * c) - round_as(x, x2 * s));
    store(x + half + i, round_as(x, x2 * c) + round_as(x, x1 * s));
  }
}

// qkv: [tokens, stride] rows holding q (heads), k and v (kv_heads each) of
// head_dim. q and k are rotated in place, then k and v are copied to their
// slot of the pool [num_blocks, block_size, kv_heads, head_dim]; negative
// slots (padding) are skipped. cos/sin: [max_position, head_dim / 2]. KT is
// the pool's element type: T (copied), or fp8 (quantized: value / scale).
template <typename T, typename KT>
void rope_and_cache(T* qkv, int64_t stride, int tokens, int heads, int kv_heads, int head_dim, const int64_t* positions,
                    const float* cos, const float* sin, KT* k_cache, KT* v_cache, const int64_t* slots, float k_scale,
                    float v_scale) {
  const int half = head_dim / 2;
  const int64_t slot_elems = static_cast<int64_t>(kv_heads) * head_dim;
#pragma omp parallel for if (tokens >= PARALLEL_ROWS) schedule(static)
  for (int t = 0; t < tokens; ++t) {
    T* row = qkv + t * stride;
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    for (int h = 0; h < heads; ++h) rotate(row + static_cast<int64_t>(h) * head_dim, c, s, half);
    T* k = row + static_cast<int64_t>(heads) * head_dim;
    for (int h = 0; h < kv_heads; ++h) rotate(k + static_cast<int64_t>(h) * head_dim, c, s, half);
    if (slots[t] < 0) continue;
    if constexpr (std::is_same_v<KT, T>) {
      std::memcpy(k_cache + slots[t] * slot_elems, k, slot_elems * sizeof(T));
      std::memcpy(v_cache + slots[t] * slot_elems, k + slot_elems, slot_elems * sizeof(T));
    } else {
      // x * (1 / scale), the reciprocal rounded once in fp32: the rule of kernels/fp8.py.
      const float k_inv = 1.0f / k_scale, v_inv = 1.0f / v_scale;
      KT* kd = k_cache + slots[t] * slot_elems;
      KT* vd = v_cache + slots[t] * slot_elems;
      for (int64_t i = 0; i < slot_elems; ++i) {
        store(kd + i, load(k + i) * k_inv);
        store(vd + i, load(k + slot_elems + i) * v_inv);
      }
    }
  }
}

template <typename T>
int rope_and_cache_kv(int kv_dtype, T* qkv, int64_t stride, int tokens, int heads, int kv_heads, int head_dim,
                      const int64_t* positions, const float* cos, const float* sin, void* k_cache, void* v_cache,
                      const int64_t* slots, const float* k_scale, const float* v_scale) {
  switch (kv_dtype) {
    case KV_SAME:
      rope_and_cache(qkv, stride, tokens, heads, kv_heads, head_dim, positions, cos, sin, static_cast<T*>(k_cache),
                     static_cast<T*>(v_cache), slots, 1.0f, 1.0f);
      return 0;
    case KV_FP8_E4M3:
      rope_and_cache(qkv, stride, tokens, heads, kv_heads, head_dim, positions, cos, sin, static_cast<fp8e4*>(k_cache),
                     static_cast<fp8e4*>(v_cache), slots, *k_scale, *v_scale);
      return 0;
    case KV_FP8_E5M2:
      rope_and_cache(qkv, stride, tokens, heads, kv_heads, head_dim, positions, cos, sin, static_cast<fp8e5*>(k_cache),
                     static_cast<fp8e5*>(v_cache), slots, *k_scale, *v_scale);
      return 0;
    default:
      return 2;
  }
}

// out[r] = act(x[r, :width]) * x[r, width:]; x: [rows, 2 * width]. act: SiLU (Llama), or GELU-tanh
// (Gemma), each rounded before the product as torch rounds it.
template <bool GELU, typename T>
void gated_rows(const T* x, T* out, int rows, int width) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const FlushDenormals ftz;  // per row: each OpenMP thread has its own mode
    const T* gate = x + static_cast<int64_t>(r) * 2 * width;
    const T* up = gate + width;
    T* o = out + static_cast<int64_t>(r) * width;
#pragma omp simd
    for (int i = 0; i < width; ++i) {
      const float g = load(gate + i);
      float act;
      if constexpr (GELU) {
        const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2 / pi)
        act = 0.5f * g * (2.0f - 2.0f / (1.0f + exp_any(2.0f * inner)));      // 1 + tanh(inner)
      } else {
        act = g / (1.0f + exp_any(-g));
      }
      store(o + i, round_as(o, act) * load(up + i));
    }
  }
}

// The entry points' dtype dispatch.
int gated(int dtype, const void* x, void* out, int rows, int width, bool gelu) {
  if (rows < 0 || width <= 0) return 1;
  if (dtype == 0 && gelu) gated_rows<true>(static_cast<const float*>(x), static_cast<float*>(out), rows, width);
  else if (dtype == 0) gated_rows<false>(static_cast<const float*>(x), static_cast<float*>(out), rows, width);
  else if (dtype == 1 && gelu) gated_rows<true>(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows, width);
  else if (dtype == 1) gated_rows<false>(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows, width);
  else return 2;
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Each returns 0, or a positive code for bad arguments.
int pagedserve_add_rms_norm(int dtype, void* x, void* residual, const void* weight, void* out, int rows, int hidden,
                            float eps) {
  if (rows < 0 || hidden <= 0) return 1;
  if (dtype == 0) {
    add_rms_norm(static_cast<float*>(x), static_cast<float*>(residual), static_cast<const float*>(weight),
                 static_cast<float*>(out), rows, hidden, eps);
  } else if (dtype == 1) {
    add_rms_norm(static_cast<uint16_t*>(x), static_cast<uint16_t*>(residual), static_cast<const uint16_t*>(weight),
                 static_cast<uint16_t*>(out), rows, hidden, eps);
  } else {
    return 2;
  }
  return 0;
}

// kv_dtype: 0 the pool has qkv's dtype, 2 fp8 e4m3, 3 fp8 e5m2 (k_scale / v_scale read only for fp8).
int pagedserve_rope_and_cache(int dtype, int kv_dtype, void* qkv, int64_t stride, int tokens, int heads, int kv_heads,
                              int head_dim, const int64_t* positions, const float* cos, const float* sin, void* k_cache,
                              void* v_cache, const int64_t* slots, const float* k_scale, const float* v_scale) {
  if (tokens < 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0) return 1;
  if (stride < static_cast<int64_t>(heads + 2 * kv_heads) * head_dim) return 1;
  if (dtype == 0)
    return rope_and_cache_kv(kv_dtype, static_cast<float*>(qkv), stride, tokens, heads, kv_heads, head_dim, positions,
                             cos, sin, k_cache, v_cache, slots, k_scale, v_scale);
  if (dtype == 1)
    return rope_and_cache_kv(kv_dtype, static_cast<uint16_t*>(qkv), stride, tokens, heads, kv_heads, head_dim,
                             positions, cos, sin, k_cache, v_cache, slots, k_scale, v_scale);
  return 2;
}

int pagedserve_silu_and_mul(int dtype, const void* x, void* out, int rows, int width) {
  return gated(dtype, x, out, rows, width, false);
}

// Gemma's (1 + weight) norm: weight float32, multiplied before the one rounding (add_rms_norm above).
int pagedserve_add_rms_norm_f32w(int dtype, void* x, void* residual, const float* weight, void* out, int rows,
                                 int hidden, float eps) {
  if (rows < 0 || hidden <= 0) return 1;
  if (dtype == 0) {
    add_rms_norm<float, float>(static_cast<float*>(x), static_cast<float*>(residual), weight, static_cast<float*>(out),
                               rows, hidden, eps);
  } else if (dtype == 1) {
    add_rms_norm<uint16_t, float>(static_cast<uint16_t*>(x), static_cast<uint16_t*>(residual), weight,
                                  static_cast<uint16_t*>(out), rows, hidden, eps);
  } else {
    return 2;
  }
  return 0;
}

// weight_f32: 0, the weights are in dtype (Llama's norm); 1, float32 (Gemma's).
int pagedserve_head_norms(int dtype, void* qkv, int64_t stride, int tokens, int heads, int kv_heads, int head_dim,
                          const void* q_weight, const void* k_weight, int weight_f32, float eps) {
  if (tokens < 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0) return 1;
  if (stride < static_cast<int64_t>(heads + 2 * kv_heads) * head_dim) return 1;
  if (dtype == 0) {
    head_norms(static_cast<float*>(qkv), stride, tokens, heads, kv_heads, head_dim,
               static_cast<const float*>(q_weight), static_cast<const float*>(k_weight), eps);
  } else if (dtype == 1 && weight_f32) {
    head_norms(static_cast<uint16_t*>(qkv), stride, tokens, heads, kv_heads, head_dim,
               static_cast<const float*>(q_weight), static_cast<const float*>(k_weight), eps);
  } else if (dtype == 1) {
    head_norms(static_cast<uint16_t*>(qkv), stride, tokens, heads, kv_heads, head_dim,
               static_cast<const uint16_t*>(q_weight), static_cast<const uint16_t*>(k_weight), eps);
  } else {
    return 2;
  }
  return 0;
}

int pagedserve_gelu_tanh_and_mul(int dtype, const void* x, void* out, int rows, int width) {
  return gated(dtype, x, out, rows, width, true);
}

}  // extern "C"
