// The fused operations' row kernels, on float32. The loops are written for the
// compiler to vectorize (fixed-width accumulators, no branches in the inner
// loops); fused_portable.cpp and fused_avx2.cpp build them for their targets.
#pragma once

#include <cstdint>

namespace qmm::fused {

// One query row of attention against its keys and values.
struct AttentionRow {
  const float* q; // [dims]
  const float* k; // key j at k + j * k_stride
  const float* v; // value j at v + j * v_stride
  int64_t k_stride;
  int64_t v_stride;
  // Paged keys and values (pages null: contiguous, as above): with page
  // p = pages[j / KEYS_BLOCK], key j at k_arenas[p / arena_pages] +
  // (p % arena_pages) * k_page_stride + k_head + (j % KEYS_BLOCK) * k_stride.
  const int32_t* pages;
  const float* const* k_arenas;
  const float* const* v_arenas;
  // The paged keys and values are float16 (their pointers point at its bits).
  bool half;
  // Or (bits > 0) MLX's affine quantization: each key's dims as a little-endian
  // stream of `bits`-bit codes (k_stride, k_page_stride and k_head in bytes
  // then), and per group of `group_size` dims a float32 scale and bias, key j's
  // at *_scale_arenas[arena] + page offset + scale_head + j * scale_stride.
  int bits = 0;
  int group_size = 0;
  const float* const* k_scale_arenas = nullptr;
  const float* const* k_bias_arenas = nullptr;
  const float* const* v_scale_arenas = nullptr;
  const float* const* v_bias_arenas = nullptr;
  int64_t k_scale_stride = 0;
  int64_t v_scale_stride = 0;
  int64_t k_scale_head = 0;
  int64_t v_scale_head = 0;
  int arena_pages;
  int64_t k_page_stride;
  int64_t v_page_stride;
  int64_t k_head;
  int64_t v_head;
  int dims;
  int value_dims;
  int keys; // the keys it may see: 0 .. keys - 1
  int first_key; // of those, the first (a sliding window's start; else 0)
  // At most one mask: entry j at mask + j * mask_stride.
  const bool* keep;
  const float* bias;
  int64_t mask_stride;
  float scale;
  bool has_sink;
  float sink;
  float* out; // [value_dims]
};

// Keys per block of the blocked attention kernel.
constexpr int KEYS_BLOCK = 32;

// Floats of scratch that attention_rows needs for `count` rows of `dims` (and
// `value_dims`: a block of float16 or quantized values is widened there, and a
// block of quantized keys before it is transposed).
inline int64_t attention_rows_scratch(int count, int dims, int value_dims) {
  return int64_t(KEYS_BLOCK) * (2 * dims + value_dims) + 2 * int64_t(count);
}

struct RowKernels {
  const char* isa;
  // y = x / rms(x) * w (w may be null).
  void (*rms_norm)(const float* x, const float* w, float* y, int n, float eps);
  // y = (x - mean) / std(x) * w + b (w, b may be null).
  void (*layer_norm)(
      const float* x,
      const float* w,
      const float* b,
      float* y,
      int n,
      float eps);
  // y = x rotated by the angles with cosines c and sines s (dims / 2 each); the
  // rest of the row (dims .. n) copied.
  void (*rope)(
      const float* x,
      const float* c,
      const float* s,
      float* y,
      int dims,
      int n,
      bool traditional);
  // Rows of softmax(q k^T * scale + mask) v that share their keys and values (k,
  // v, their strides and dims as in rows[0]): a block of KEYS_BLOCK keys at a
  // time, read once for all the rows, with each row's softmax kept online.
  void (*attention_rows)(const AttentionRow* rows, int count, float* scratch);
  // y = silu(g) * u, silu and exp as MLX's CPU kernels compute them.
  void (*silu_mul)(const float* g, const float* u, float* y, int n);
  // log(sum(exp(x))), from the row's largest value.
  float (*log_sum_exp)(const float* x, int n);
};

RowKernels portable_rows();

// Attention of `tokens` queries (query token t of head h at q + h *
// q_head_stride + t * q_token_stride) over paged keys and values, as
// CpuPagedAttention runs it (fused.h's paged_attention says what each part
// means), on the kernels' threads; out is [heads, tokens, value_dims].
struct PagedAttention {
  const float* q;
  int64_t q_head_stride;
  int64_t q_token_stride;
  int heads;
  int tokens;
  int dims;
  int kv_heads;
  // A value row's dims in its arena (codes' where quantized), and those read.
  int value_row;
  int value_dims;
  // (first token, tokens, context) per sequence, and its row of tables.
  const int32_t* segments;
  int count;
  const int32_t* tables;
  int width;
  int arenas;
  int arena_pages;
  const float* const* k_arenas;
  const float* const* v_arenas;
  bool half;
  // Quantized arenas (bits > 0): each arena's key scales, key biases, value
  // scales and value biases, `arenas` of each.
  int bits;
  int group_size;
  const float* const* groups;
  int window;
  float scale;
  const float* sinks;
  float* out;
};

void paged_attention(const PagedAttention& a);

// For primitives that run the row kernels inside their own task
// (decode_layer.cpp): the kernels this process chose (set_fused_isa) ...
const RowKernels& chosen_rows();
// ... and RoPE's cosines and sines (dims / 2 each) at one position, as CpuRoPE
// computes them (from `freqs` where given, else from `base`), valid until this
// thread's next call.
struct RopeAngles {
  const float* cos;
  const float* sin;
};
RopeAngles rope_angles(
    int dims,
    float base,
    float scale,
    const float* freqs,
    int position);
#if defined(__x86_64__)
RowKernels avx2_rows();
RowKernels avx512_rows();
#endif

} // namespace qmm::fused
