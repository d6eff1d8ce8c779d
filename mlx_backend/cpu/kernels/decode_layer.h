// A decoder layer's decode step as one primitive: a pre-norm transformer block
// (RMS norm, q/k/v, RoPE, attention over a contiguous KV cache, o, RMS norm,
// SwiGLU MLP, both residuals) for one token. Unfused, mlx-lm's layer builds 24
// graph nodes, and their building and scheduling took the core that the matmuls'
// second thread needed.
#pragma once

#include <optional>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace qmm {

namespace mx = mlx::core;

// The block's shapes and constants (its weights are inputs).
struct DecodeLayerShape {
  int heads;
  int kv_heads;
  float attention_scale;
  int rope_dims;
  bool rope_traditional;
  // RoPE's base, unless the freqs input is given.
  float rope_base;
  float rope_scale;
  float attention_norm_eps;
  float mlp_norm_eps;
  // Each projection's group size and bits: q, k, v, o, gate, up, down.
  std::vector<int> group_sizes;
  std::vector<int> bits;
};

// [y, keys, values]: x [1, 1, D] through the block at position `offset`, its key
// and value written at that position of the caches ([1, kv_heads, S, dims],
// float32; S > offset), which come back as the new caches (in place where MLX
// may donate them). `linears`: w, scales and biases of q, k, v, o, gate, up and
// down, in that order; `freqs`: RoPE's, where the model gives them.
std::vector<mx::array> decode_layer(
    const mx::array& x,
    const mx::array& keys,
    const mx::array& values,
    int offset,
    const mx::array& attention_norm,
    const mx::array& mlp_norm,
    const std::vector<mx::array>& linears,
    const std::optional<mx::array>& freqs,
    const DecodeLayerShape& shape,
    mx::StreamOrDevice s = {});

// Times a decode layer copied a cache it could not write in place.
int decode_layer_cache_copies();

class CpuDecodeLayer : public mx::Primitive {
 public:
  // Inputs: x, keys, values, the two norms' weights, each projection's w, scales
  // and biases, then freqs if given.
  CpuDecodeLayer(mx::Stream stream, DecodeLayerShape shape, int offset, bool freqs)
      : mx::Primitive(stream),
        shape_(std::move(shape)),
        offset_(offset),
        freqs_(freqs) {}

  void eval_cpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  void eval_gpu(
      const std::vector<mx::array>& inputs,
      std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "CpuDecodeLayer";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(
      const std::vector<mx::array>& inputs) override;

 private:
  DecodeLayerShape shape_;
  int offset_;
  bool freqs_;
};

} // namespace qmm
