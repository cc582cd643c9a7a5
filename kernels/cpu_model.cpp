// A Llama-family decoder stack in one call: every layer's norms, linears,
// RoPE + cache write, paged attention and SiLU-and-mul (linears over bf16/fp32
// panels or GGUF blocks, per layer), by the same entry
// points the per-op Python path calls (so the result is bit for bit that
// path's), without a Python and ctypes round trip per op. At one to a few
// sequences those round trips were about a quarter of a SmolLM2 decode step
// (about 270 calls a step, 10-30 us each: docs/gpuworker.md, "Fused layers").
#include <cstdint>
#include <cstdlib>
#include <cstring>

extern "C" {
int pagedserve_add_rms_norm(int dtype, void* x, void* residual, const void* weight, void* out, int rows, int hidden,
                            float eps);
int pagedserve_linear(int dtype, const void* x, const void* packed, const void* bias, void* y, int64_t M, int64_t N,
                      int64_t K);
int pagedserve_rope_and_cache(int dtype, int kv_dtype, void* qkv, int64_t stride, int tokens, int heads, int kv_heads,
                              int head_dim, const int64_t* positions, const float* cos, const float* sin,
                              void* k_cache, void* v_cache, const int64_t* slots, const float* k_scale,
                              const float* v_scale);
int pagedserve_paged_attention(int dtype, int kv_dtype, const void* q, const void* k_cache, const void* v_cache,
                               const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start_loc,
                               void* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                               int table_stride, int64_t q_stride, float scale, const float* k_scale,
                               const float* v_scale);
int pagedserve_silu_and_mul(int dtype, const void* x, void* out, int rows, int width);
int pagedserve_quant_linear_parts(int dtype, const void* x, const void* bias, void* y, int64_t M, int64_t K,
                                  int parts, const int32_t* qtypes, const uint8_t* const* packed,
                                  const int64_t* rows);
}

namespace {

// One linear layer: the panels of cpu_linear.cpp (parts == 0: data[0]), or up to 3 GGUF
// weights side by side, repacked by quant_cpu.cpp (part p: ggml type qtypes[p], rows[p] output
// rows; q/k/v of different types, as Q4_K_M mixes them). Field order is cpu_layers.py's Linear.
struct Linear {
  const void* data[3];
  const void* bias;  // null: none
  int64_t rows[3];
  int32_t qtypes[3];
  int32_t parts;
};

// One decoder layer's tensors. Field order is kernels/cpu_layers.py's LayerPtrs.
struct LayerPtrs {
  const void* input_norm;
  const void* post_norm;
  Linear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
  const float* k_scale;
  const float* v_scale;
};

// y [M][N] = x [M][K] . W^T (+ bias) by the kernel the layer-by-layer path calls for w.
int run_linear(int dtype, const Linear& w, const void* x, void* y, int64_t M, int64_t N, int64_t K) {
  if (w.parts == 0) return pagedserve_linear(dtype, x, w.data[0], w.bias, y, M, N, K);
  int64_t rows = 0;
  for (int p = 0; p < w.parts && p < 3; ++p) rows += w.rows[p];
  if (w.parts > 3 || rows != N) return 1;
  return pagedserve_quant_linear_parts(dtype, x, w.bias, y, M, K, w.parts, w.qtypes,
                                       reinterpret_cast<const uint8_t* const*>(w.data), w.rows);
}

// The model's shape and this step's batch. Field order is cpu_layers.py's StackArgs.
struct StackArgs {
  int32_t dtype, kv_dtype, num_layers, tokens;
  int32_t hidden, heads, kv_heads, head_dim, intermediate;
  int32_t num_seqs, block_size, table_stride;
  float eps, scale;
  const LayerPtrs* layers;
  const void* final_norm;
  const int64_t* positions;
  const int64_t* slots;
  const float* cos;
  const float* sin;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  void* x;    // [tokens, hidden]: the embeddings in; the residual stream, updated in place
  void* out;  // [tokens, hidden]: the final norm's output
};

// The step's activations, kept between calls at the largest step's size
// (SmolLM2: 7,296 values a token, 120 MB in fp32 at the default 4,096-token budget).
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
  ~Workspace() { std::free(data); }
  void* get(size_t need) {
    if (need > bytes) {
      std::free(data);
      bytes = (need + 63) / 64 * 64;
      data = std::aligned_alloc(64, bytes);
      if (data == nullptr) bytes = 0;
    }
    return data;
  }
};

thread_local Workspace workspace;

}  // namespace

extern "C" {

// Runs the decoder stack: for each layer, (residual, h) = add_norm; qkv; RoPE
// and cache write; attention; o; add_norm; gate_up; silu*mul; down; then the
// final add_norm into out. Returns 0, a kernel's positive code, or 9 when the
// workspace cannot be allocated.
int pagedserve_llama_stack(const StackArgs* a) {
  const int64_t T = a->tokens, H = a->hidden, D = a->head_dim, I = a->intermediate;
  if (T < 1 || a->num_layers < 1 || H <= 0 || D <= 0 || I <= 0) return 1;
  const int64_t q_width = a->heads * D, qkv_width = (a->heads + 2 * a->kv_heads) * D;
  const size_t elem = a->dtype == 0 ? 4 : 2;
  // h, qkv, attention output, the sublayer output, gate_up, act (64-byte aligned each)
  const int64_t widths[] = {H, qkv_width, q_width, H, 2 * I, I};
  size_t offsets[6], total = 0;
  for (int i = 0; i < 6; ++i) {
    offsets[i] = total;
    total += (static_cast<size_t>(T * widths[i]) * elem + 63) / 64 * 64;
  }
  char* base = static_cast<char*>(workspace.get(total));
  if (base == nullptr) return 9;
  void *h = base + offsets[0], *qkv = base + offsets[1], *attn = base + offsets[2], *y = base + offsets[3],
       *gate_up = base + offsets[4], *act = base + offsets[5];
  const int dt = a->dtype;
  void* residual = nullptr;  // the first norm reads the embeddings, which then become the residual stream
  int rc = 0;
  for (int l = 0; l < a->num_layers; ++l) {
    const LayerPtrs& w = a->layers[l];
    if (residual == nullptr) {
      rc = pagedserve_add_rms_norm(dt, a->x, nullptr, w.input_norm, h, T, H, a->eps);
      residual = a->x;
    } else {
      rc = pagedserve_add_rms_norm(dt, y, residual, w.input_norm, h, T, H, a->eps);
    }
    if (rc) return rc;
    if ((rc = run_linear(dt, w.qkv, h, qkv, T, qkv_width, H))) return rc;
    if ((rc = pagedserve_rope_and_cache(dt, a->kv_dtype, qkv, qkv_width, T, a->heads, a->kv_heads, D, a->positions,
                                        a->cos, a->sin, w.k_cache, w.v_cache, a->slots, w.k_scale, w.v_scale)))
      return rc;
    if ((rc = pagedserve_paged_attention(dt, a->kv_dtype, qkv, w.k_cache, w.v_cache, a->block_tables, a->seq_lens,
                                         a->query_start_loc, attn, a->num_seqs, a->heads, a->kv_heads, D,
                                         a->block_size, a->table_stride, qkv_width, a->scale, w.k_scale, w.v_scale)))
      return rc;
    if ((rc = run_linear(dt, w.o, attn, y, T, H, q_width))) return rc;
    if ((rc = pagedserve_add_rms_norm(dt, y, residual, w.post_norm, h, T, H, a->eps))) return rc;
    if ((rc = run_linear(dt, w.gate_up, h, gate_up, T, 2 * I, H))) return rc;
    if ((rc = pagedserve_silu_and_mul(dt, gate_up, act, T, I))) return rc;
    if ((rc = run_linear(dt, w.down, act, y, T, H, I))) return rc;
  }
  return pagedserve_add_rms_norm(dt, y, residual, a->final_norm, a->out, T, H, a->eps);
}

}  // extern "C"
