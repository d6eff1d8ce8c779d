// MLX's fast operations as CPU primitives: RMS norm, layer norm, RoPE and
// attention, each one node of the graph where MLX's CPU fallback runs 8 to 30.
#pragma once

#include <optional>
#include <string>
#include <variant>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace qmm {

namespace mx = mlx::core;

mx::array rms_norm(
    const mx::array& x,
    const std::optional<mx::array>& weight,
    float eps,
    mx::StreamOrDevice s = {});

mx::array layer_norm(
    const mx::array& x,
    const std::optional<mx::array>& weight,
    const std::optional<mx::array>& bias,
    float eps,
    mx::StreamOrDevice s = {});

// mx.fast.rope's forward rotation: angles from `base` or from `freqs`.
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    std::optional<float> base,
    float scale,
    const std::variant<int, mx::array>& offset,
    const std::optional<mx::array>& freqs,
    mx::StreamOrDevice s = {});

// mx.fast.scaled_dot_product_attention: mask_mode "", "causal" or "array".
mx::array attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    float scale,
    const std::string& mask_mode,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    mx::StreamOrDevice s = {});

// Attention of a pass's flattened tokens (queries [1, heads, tokens, dims]) over
// paged keys and values, held in arenas of `arena_pages` pages each ([arena_pages
// * KEYS_BLOCK, kv_heads, dims]; page p is page p % arena_pages of arena p /
// arena_pages). Each row of `segments` (first token, tokens, context) is one
// sequence: its queries see its first `context` keys, causal within the segment,
// through its row of `tables`; with a `window`, each query only the last `window`
// of those (itself included), as a sliding-window layer does. `value_dims` (float
// arenas): the values are the first that many dims of the value arenas' rows (MLA's
// latent, the keys' first dims: the key arenas passed as values too); 0: all.
mx::array paged_attention(
    const mx::array& queries,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const mx::array& segments,
    const mx::array& tables,
    float scale,
    int arena_pages,
    int window,
    const std::optional<mx::array>& sinks,
    const std::vector<mx::array>& key_scales = {},
    const std::vector<mx::array>& key_biases = {},
    const std::vector<mx::array>& value_scales = {},
    const std::vector<mx::array>& value_biases = {},
    int bits = 0,
    int group_size = 0,
    int value_dims = 0,
    mx::StreamOrDevice s = {});

// mlx-lm's swiglu: silu(gate) * x, for inputs of one shape.
mx::array swiglu(const mx::array& gate, const mx::array& x, mx::StreamOrDevice s = {});

// log(sum(exp(x))) over the last axis, kept (size 1).
mx::array logsumexp(const mx::array& x, mx::StreamOrDevice s = {});

// An elementwise or last-axis operation of one or two float32 inputs with no
// parameters: SwiGLU, LogSumExp.
class CpuRowOp : public mx::UnaryPrimitive {
 public:
  enum class Op { swiglu, logsumexp };

  CpuRowOp(mx::Stream stream, Op op) : mx::UnaryPrimitive(stream), op_(op) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return op_ == Op::swiglu ? "CpuSwiGLU" : "CpuLogSumExp";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return op_ == static_cast<const CpuRowOp&>(other).op_;
  }
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;
  // Gradients, for whatever differentiates through them (a loss on the CPU).
  std::vector<mx::array> vjp(
      const std::vector<mx::array>& primals,
      const std::vector<mx::array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<mx::array>& outputs) override;

 private:
  Op op_;
};

class CpuNorm : public mx::UnaryPrimitive {
 public:
  // rms: RMS norm, else layer norm; inputs: x, then the weight and bias it has.
  CpuNorm(mx::Stream stream, bool rms, bool has_weight, bool has_bias, float eps)
      : mx::UnaryPrimitive(stream),
        rms_(rms),
        has_weight_(has_weight),
        has_bias_(has_bias),
        eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return rms_ ? "CpuRMSNorm" : "CpuLayerNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  bool rms_;
  bool has_weight_;
  bool has_bias_;
  float eps_;
};

class CpuRoPE : public mx::UnaryPrimitive {
 public:
  // Inputs: x, the offset (a scalar, one per batch row, or for a batch of one a
  // position per token), then freqs if given.
  CpuRoPE(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CpuRoPE";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

class CpuAttention : public mx::UnaryPrimitive {
 public:
  // Inputs: queries, keys, values, then the array mask and sinks it has.
  CpuAttention(
      mx::Stream stream,
      float scale,
      bool causal,
      bool has_mask,
      bool has_sinks)
      : mx::UnaryPrimitive(stream),
        scale_(scale),
        causal_(causal),
        has_mask_(has_mask),
        has_sinks_(has_sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CpuAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  bool causal_;
  bool has_mask_;
  bool has_sinks_;
};

class CpuPagedAttention : public mx::UnaryPrimitive {
 public:
  // Inputs: queries, segments, tables, the key arenas, the value arenas, where
  // bits > 0 (quantized arenas of codes) the arenas of key scales, key biases,
  // value scales and value biases, then sinks if given.
  CpuPagedAttention(
      mx::Stream stream,
      float scale,
      int arenas,
      int arena_pages,
      int window,
      bool has_sinks,
      int bits,
      int group_size,
      int value_dims)
      : mx::UnaryPrimitive(stream),
        scale_(scale),
        arenas_(arenas),
        arena_pages_(arena_pages),
        window_(window),
        has_sinks_(has_sinks),
        bits_(bits),
        group_size_(group_size),
        value_dims_(value_dims) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "CpuPagedAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  int arenas_;
  int arena_pages_;
  int window_;
  bool has_sinks_;
  int bits_;
  int group_size_;
  int value_dims_;
};

// The instruction set the fused kernels run on: "auto" picks the best this CPU
// has, "portable" the plain C++ ones.
void set_fused_isa(const std::string& isa);
std::string fused_isa();
// The fused kernels' instruction sets this CPU runs, best first.
std::vector<std::string> fused_isas();

} // namespace qmm
