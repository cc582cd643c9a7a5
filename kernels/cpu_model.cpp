// A Llama-family decoder stack in one call: every layer's norms, linears,
// RoPE + cache write, paged attention and SiLU-and-mul (linears over bf16/fp32
// panels or GGUF blocks, per layer); and Gemma 3's, whose layers add per-head
// q/k norms, norms on each sublayer's output, GELU-tanh, float32 (1 + w) norm
// weights, and sliding layers with their own RoPE and KV group. By the same entry
// points the per-op Python path calls (so a Llama's result is bit for bit that
// path's; Gemma 3's per-op path is torch's ops, equal to rounding), without a
// Python and ctypes round trip per op. At one to a few
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
int pagedserve_silu_and_mul(int dtype, const void* x, void* out, int rows, int width);
int pagedserve_gelu_tanh_and_mul(int dtype, const void* x, void* out, int rows, int width);
int pagedserve_add_rms_norm_f32w(int dtype, void* x, void* residual, const float* weight, void* out, int rows,
                                 int hidden, float eps);
int pagedserve_head_norms(int dtype, void* qkv, int64_t stride, int tokens, int heads, int kv_heads, int head_dim,
                          const void* q_weight, const void* k_weight, int weight_f32, float eps);
int pagedserve_paged_attention_ex(int dtype, int kv_dtype, const void* q, const void* k_cache, const void* v_cache,
                                  const int32_t* block_tables, const int32_t* seq_lens, const int32_t* query_start_loc,
                                  void* out, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                                  int table_stride, int64_t q_stride, float scale, const float* k_scale,
                                  const float* v_scale, int window, float softcap);
int pagedserve_coded_linear(const void* x, const void* coded, const void* panels, const void* bias, void* y, int64_t M,
                            int64_t N, int64_t K);
int pagedserve_quant_linear_parts(int dtype, const void* x, const void* bias, void* y, int64_t M, int64_t K,
                                  int parts, const int32_t* qtypes, const uint8_t* const* packed,
                                  const int64_t* rows);
}

namespace {

// One linear layer: the panels of cpu_linear.cpp (parts == 0: data[0]; bf16's coded copy, cpu_coded.cpp,
// in data[1] or null), or up to 3 GGUF
// weights side by side, repacked by quant_pack.cpp (part p: ggml type qtypes[p], rows[p] output
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
  const void* post_norm;  // the norm before the MLP
  Linear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
  const float* k_scale;
  const float* v_scale;
  // Gemma 3 (null: none): per-head norms on q and k; norms on the attention's and the MLP's output
  const void* q_norm;
  const void* k_norm;
  const void* attn_out_norm;
  const void* mlp_out_norm;
  const float* cos;  // this layer's RoPE tables [max_position][head_dim / 2]
  const float* sin;
  int32_t window;  // sliding window (0: full attention)
  int32_t group;   // the KV group whose slots and block tables it reads (StackArgs.groups)
};

// One KV cache group's view of the batch (a hybrid model's sliding layers free their old blocks).
struct GroupPtrs {
  const int64_t* slots;
  const int32_t* block_tables;
  int64_t table_stride;
};

// y [M][N] = x [M][K] . W^T (+ bias) by the kernel the layer-by-layer path calls for w.
int run_linear(int dtype, const Linear& w, const void* x, void* y, int64_t M, int64_t N, int64_t K) {
  if (w.parts == 0 && dtype == 1 && w.data[1] != nullptr)
    return pagedserve_coded_linear(x, w.data[1], w.data[0], w.bias, y, M, N, K);
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
  int32_t gemma;  // 1: Gemma 3's norms (float32 weights) and GELU-tanh; 0: Llama's norms and SiLU
  int32_t num_groups;
  float eps, scale;
  const LayerPtrs* layers;
  const void* final_norm;
  const int64_t* positions;
  const int64_t* slots;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  void* x;    // [tokens, hidden]: the embeddings in; the residual stream, updated in place
  void* out;  // [tokens, hidden]: the final norm's output
  const GroupPtrs* groups;  // num_groups of them (0: every layer reads slots and block_tables above)
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

// The norm kind of the stack: Llama's (weights in dtype) or Gemma's (float32 (1 + w)).
int norm(const StackArgs* a, void* x, void* residual, const void* w, void* out) {
  const int64_t T = a->tokens, H = a->hidden;
  if (a->gemma) return pagedserve_add_rms_norm_f32w(a->dtype, x, residual, static_cast<const float*>(w), out, T, H, a->eps);
  return pagedserve_add_rms_norm(a->dtype, x, residual, w, out, T, H, a->eps);
}

}  // namespace

extern "C" {

// Runs the decoder stack: for each layer, (residual, h) = add_norm; qkv; [q/k norms;]
// RoPE and cache write; attention; o; [norm;] add_norm; gate_up; act*mul; down; [norm;]
// then the final add_norm into out. Returns 0, a kernel's positive code, 9 when the
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
    if (w.group < 0 || (a->num_groups > 0 ? w.group >= a->num_groups : w.group != 0)) return 1;
    const GroupPtrs g = a->num_groups > 0 ? a->groups[w.group] : GroupPtrs{a->slots, a->block_tables, a->table_stride};
    if (residual == nullptr) {
      rc = norm(a, a->x, nullptr, w.input_norm, h);
      residual = a->x;
    } else {
      rc = norm(a, y, residual, w.input_norm, h);
    }
    if (rc) return rc;
    if ((rc = run_linear(dt, w.qkv, h, qkv, T, qkv_width, H))) return rc;
    if (w.q_norm != nullptr &&
        (rc = pagedserve_head_norms(dt, qkv, qkv_width, T, a->heads, a->kv_heads, D, w.q_norm, w.k_norm, a->gemma,
                                    a->eps)))
      return rc;
    if ((rc = pagedserve_rope_and_cache(dt, a->kv_dtype, qkv, qkv_width, T, a->heads, a->kv_heads, D, a->positions,
                                        w.cos, w.sin, w.k_cache, w.v_cache, g.slots, w.k_scale, w.v_scale)))
      return rc;
    if ((rc = pagedserve_paged_attention_ex(dt, a->kv_dtype, qkv, w.k_cache, w.v_cache, g.block_tables, a->seq_lens,
                                            a->query_start_loc, attn, a->num_seqs, a->heads, a->kv_heads, D,
                                            a->block_size, static_cast<int>(g.table_stride), qkv_width, a->scale,
                                            w.k_scale, w.v_scale, w.window, 0.0f)))
      return rc;
    if ((rc = run_linear(dt, w.o, attn, y, T, H, q_width))) return rc;
    if (w.attn_out_norm != nullptr && (rc = norm(a, y, nullptr, w.attn_out_norm, y))) return rc;
    if ((rc = norm(a, y, residual, w.post_norm, h))) return rc;
    if ((rc = run_linear(dt, w.gate_up, h, gate_up, T, 2 * I, H))) return rc;
    rc = a->gemma ? pagedserve_gelu_tanh_and_mul(dt, gate_up, act, T, I) : pagedserve_silu_and_mul(dt, gate_up, act, T, I);
    if (rc) return rc;
    if ((rc = run_linear(dt, w.down, act, y, T, H, I))) return rc;
    if (w.mlp_out_norm != nullptr && (rc = norm(a, y, nullptr, w.mlp_out_norm, y))) return rc;
  }
  return norm(a, y, residual, a->final_norm, a->out);
}

}  // extern "C"
