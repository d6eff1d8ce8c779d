#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/variant.h>

#include "decode_layer.h"
#include "fused.h"
#include "quantized_matmul.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_qmm, m) {
  m.doc() = "Quantized matmul kernels for MLX on the CPU";
  m.def(
      "quantized_matmul",
      &qmm::quantized_matmul,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "x @ dequantize(w, scales, biases).T on the CPU (MLX's affine layout).");
  m.def(
      "quantized_matmuls",
      &qmm::quantized_matmuls,
      "x"_a,
      "ws"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "[x @ dequantize(w_i).T for each i], one node for projections that share x.");
  m.def(
      "quantized_rows",
      &qmm::quantized_rows,
      "indices"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "group_size"_a,
      "bits"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "dequantize(w, scales, biases)[indices] as float32 (an embedding's lookup).");
  m.def("settings", [] {
    auto s = qmm::settings();
    nb::dict d;
    d["isa"] = s.isa;
    d["threads"] = s.threads;
    d["rows_limit"] = s.rows_limit;
    d["sgemm"] = s.sgemm;
    d["activations"] = s.activations;
    d["prefill_activations"] = s.prefill_activations;
    return d;
  });
  m.def("set_threads", &qmm::set_threads, "threads"_a);
  m.def(
      "check_pool",
      &qmm::check_pool,
      "runs"_a,
      nb::call_guard<nb::gil_scoped_release>(),
      "Runs the worker pool `runs` times: the tasks run other than once.");
  m.def(
      "read_bandwidth",
      &qmm::read_bandwidth,
      "megabytes"_a = 256,
      "repeats"_a = 5,
      nb::call_guard<nb::gil_scoped_release>(),
      "GB/s the kernels' threads read memory at.");
  m.def("use_sgemm", &qmm::use_sgemm, "use"_a);
  m.def("set_isa", &qmm::set_isa, "isa"_a);
  m.def("isas", &qmm::isas);
  m.def(
      "set_activations",
      &qmm::set_activations,
      "activations"_a,
      "prefill"_a = "",
      "What x meets the weights as: up to the row limit, and past it (\"\": the "
      "same).");

  // MLX's fast operations as single CPU primitives (mx.fast's signatures).
  m.def(
      "rms_norm",
      &qmm::rms_norm,
      "x"_a,
      "weight"_a.none(),
      "eps"_a,
      nb::kw_only(),
      "stream"_a = nb::none());
  m.def(
      "layer_norm",
      &qmm::layer_norm,
      "x"_a,
      "weight"_a.none(),
      "bias"_a.none(),
      "eps"_a,
      nb::kw_only(),
      "stream"_a = nb::none());
  m.def(
      "rope",
      &qmm::rope,
      "a"_a,
      "dims"_a,
      nb::kw_only(),
      "traditional"_a,
      "base"_a.none(),
      "scale"_a,
      "offset"_a,
      "freqs"_a = nb::none(),
      "stream"_a = nb::none());
  m.def(
      "scaled_dot_product_attention",
      &qmm::attention,
      "q"_a,
      "k"_a,
      "v"_a,
      nb::kw_only(),
      "scale"_a,
      "mask_mode"_a,
      "mask"_a = nb::none(),
      "sinks"_a = nb::none(),
      "stream"_a = nb::none());
  m.def(
      "paged_attention",
      &qmm::paged_attention,
      "q"_a,
      "k"_a,
      "v"_a,
      "segments"_a,
      "tables"_a,
      nb::kw_only(),
      "scale"_a,
      "arena_pages"_a,
      "window"_a = 0,
      "sinks"_a = nb::none(),
      "key_scales"_a = std::vector<mlx::core::array>{},
      "key_biases"_a = std::vector<mlx::core::array>{},
      "value_scales"_a = std::vector<mlx::core::array>{},
      "value_biases"_a = std::vector<mlx::core::array>{},
      "bits"_a = 0,
      "group_size"_a = 0,
      "value_dims"_a = 0,
      "stream"_a = nb::none(),
      "Attention of flattened sequences over paged keys and values in arenas, one "
      "node; where bits > 0 the arenas hold MLX's quantized codes, with their "
      "scales and biases.");
  // Operations MLX's CPU build runs one scalar exp at a time.
  m.def(
      "swiglu",
      &qmm::swiglu,
      "gate"_a,
      "x"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "silu(gate) * x as one node.");
  m.def(
      "logsumexp",
      &qmm::logsumexp,
      "x"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "logsumexp over the last axis, kept, as one node.");
  m.def(
      "decode_layer",
      [](const qmm::mx::array& x,
         const qmm::mx::array& keys,
         const qmm::mx::array& values,
         int offset,
         const qmm::mx::array& attention_norm,
         const qmm::mx::array& mlp_norm,
         const std::vector<qmm::mx::array>& linears,
         const std::optional<qmm::mx::array>& freqs,
         int heads,
         int kv_heads,
         float attention_scale,
         int rope_dims,
         bool rope_traditional,
         float rope_base,
         float rope_scale,
         float attention_norm_eps,
         float mlp_norm_eps,
         const std::vector<int>& group_sizes,
         const std::vector<int>& bits) {
        qmm::DecodeLayerShape shape{
            heads,          kv_heads,           attention_scale,
            rope_dims,      rope_traditional,   rope_base,
            rope_scale,     attention_norm_eps, mlp_norm_eps,
            group_sizes,    bits};
        return qmm::decode_layer(
            x, keys, values, offset, attention_norm, mlp_norm, linears, freqs, shape);
      },
      "x"_a,
      "keys"_a,
      "values"_a,
      "offset"_a,
      "attention_norm"_a,
      "mlp_norm"_a,
      "linears"_a,
      "freqs"_a.none(),
      nb::kw_only(),
      "heads"_a,
      "kv_heads"_a,
      "attention_scale"_a,
      "rope_dims"_a,
      "rope_traditional"_a,
      "rope_base"_a,
      "rope_scale"_a,
      "attention_norm_eps"_a,
      "mlp_norm_eps"_a,
      "group_sizes"_a,
      "bits"_a,
      "[y, keys, values]: one token through a pre-norm block, its key and value "
      "written into the caches at offset, as one node.");
  m.def("decode_layer_cache_copies", &qmm::decode_layer_cache_copies);
  m.def("set_fused_isa", &qmm::set_fused_isa, "isa"_a);
  m.def("fused_isa", &qmm::fused_isa);
  m.def("fused_isas", &qmm::fused_isas);
}
