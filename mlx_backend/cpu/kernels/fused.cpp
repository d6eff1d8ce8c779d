#include "fused.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "fused_rows.h"
#include "mlx/backend/cpu/simd/math.h"
#include "quantized_matmul.h"
#include "task.h"

namespace qmm {

namespace {

using fused::RowKernels;

const RowKernels& portable_table() {
  static const RowKernels table = fused::portable_rows();
  return table;
}

// The row kernels this CPU runs, best first.
const std::vector<const RowKernels*>& tables() {
  static const std::vector<const RowKernels*> found = [] {
    std::vector<const RowKernels*> out;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
        static const RowKernels avx512 = fused::avx512_rows();
        out.push_back(&avx512);
      }
      static const RowKernels avx2 = fused::avx2_rows();
      out.push_back(&avx2);
    }
#endif
    out.push_back(&portable_table());
    return out;
  }();
  return found;
}

const RowKernels& best_table() {
  return *tables().front();
}

std::atomic<const RowKernels*> chosen{nullptr};

const RowKernels& row_kernels() {
  const RowKernels* table = chosen.load(std::memory_order_acquire);
  if (table == nullptr) {
    table = &best_table();
    chosen.store(table, std::memory_order_release);
  }
  return *table;
}

// Query positions an attention task takes (for each head that reads its keys):
// from 4 tasks' worth of a long chunk's positions on, 64, so that each block of
// keys read serves more rows (a 4096-token prompt prefilled 5-10% faster than at
// 16).
constexpr int POSITIONS_PER_TASK = 16;
constexpr int LONG_POSITIONS_PER_TASK = 64;

int positions_per_task(int positions) {
  return positions >= 4 * LONG_POSITIONS_PER_TASK ? LONG_POSITIONS_PER_TASK
                                                  : POSITIONS_PER_TASK;
}

// An input's float data as rows along its last axis: where each row starts (in
// elements), with a row-major copy for an input whose last axis is strided.
struct Rows {
  const float* data;
  std::vector<int64_t> starts;
  std::vector<float> copy;
};

// Offsets (in elements) of the first element of each row of `a` (its last axis).
std::vector<int64_t> row_starts(const mx::array& a) {
  int n = a.ndim() ? a.shape(-1) : 1;
  int64_t rows = n ? int64_t(a.size()) / n : 0;
  std::vector<int64_t> starts(rows);
  if (a.flags().row_contiguous) {
    for (int64_t r = 0; r < rows; r++) {
      starts[r] = r * n;
    }
    return starts;
  }
  for (int64_t r = 0; r < rows; r++) {
    int64_t rest = r, offset = 0;
    for (int axis = a.ndim() - 2; axis >= 0; axis--) {
      offset += (rest % a.shape(axis)) * a.strides(axis);
      rest /= a.shape(axis);
    }
    starts[r] = offset;
  }
  return starts;
}

Rows rows_of(const mx::array& a) {
  Rows r;
  r.data = a.data<float>();
  r.starts = row_starts(a);
  int n = a.ndim() ? a.shape(-1) : 1;
  if (a.ndim() && a.shape(-1) > 1 && a.strides(-1) != 1) {
    r.copy.resize(a.size());
    int64_t step = a.strides(-1);
    for (size_t row = 0; row < r.starts.size(); row++) {
      for (int i = 0; i < n; i++) {
        r.copy[row * n + i] = r.data[r.starts[row] + i * step];
      }
      r.starts[row] = int64_t(row) * n;
    }
    r.data = r.copy.data();
  }
  return r;
}

// A strided 4-D input read in place where its last axis is contiguous, else
// copied row-major.
struct Tensor4 {
  const float* data;
  int64_t strides[4];
  std::vector<float> copy;
};

Tensor4 tensor4(const mx::array& a) {
  Tensor4 t;
  t.data = a.data<float>();
  for (int i = 0; i < 4; i++) {
    t.strides[i] = a.strides(i);
  }
  if (a.shape(3) > 1 && a.strides(3) != 1) {
    Rows r = rows_of(a);
    t.copy = std::move(r.copy);
    t.data = t.copy.data();
    int64_t stride = 1;
    for (int i = 3; i >= 0; i--) {
      t.strides[i] = stride;
      stride *= a.shape(i);
    }
  }
  return t;
}

mx::array as(const mx::array& a, mx::Dtype dtype, mx::Stream s) {
  return a.dtype() == dtype ? a : mx::astype(a, dtype, s);
}

void check_floating(const char* op, mx::Dtype dtype) {
  if (!mx::issubdtype(dtype, mx::floating)) {
    std::ostringstream msg;
    msg << "[" << op << "] Received unsupported type " << dtype << ".";
    throw std::invalid_argument(msg.str());
  }
}

void check_vector(const char* op, const char* what, const mx::array& a, int size) {
  if (a.ndim() != 1 || a.shape(0) != size) {
    std::ostringstream msg;
    msg << "[" << op << "] " << what << " must have shape (" << size
        << ",) but has shape " << a.shape() << ".";
    throw std::invalid_argument(msg.str());
  }
}

mx::array norm(
    const char* op,
    bool rms,
    const mx::array& x,
    const std::optional<mx::array>& weight,
    const std::optional<mx::array>& bias,
    float eps,
    mx::StreamOrDevice s_) {
  if (x.ndim() == 0) {
    throw std::invalid_argument(
        std::string("[") + op + "] Input must have at least 1 dimension.");
  }
  auto out_type = x.dtype();
  std::vector<mx::array> inputs;
  auto s = mx::to_stream(s_, mx::Device::cpu);
  for (auto* a : {&weight, &bias}) {
    if (a->has_value()) {
      check_vector(op, a == &weight ? "weight" : "bias", **a, x.shape(-1));
      out_type = mx::promote_types(out_type, (*a)->dtype());
    }
  }
  check_floating(op, out_type);
  inputs.push_back(as(x, mx::float32, s));
  for (auto* a : {&weight, &bias}) {
    if (a->has_value()) {
      inputs.push_back(as(**a, mx::float32, s));
    }
  }
  auto y = mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<CpuNorm>(
          s, rms, weight.has_value(), bias.has_value(), eps),
      std::move(inputs));
  return as(y, out_type, s);
}

} // namespace

mx::array rms_norm(
    const mx::array& x,
    const std::optional<mx::array>& weight,
    float eps,
    mx::StreamOrDevice s) {
  return norm("rms_norm", true, x, weight, std::nullopt, eps, s);
}

mx::array layer_norm(
    const mx::array& x,
    const std::optional<mx::array>& weight,
    const std::optional<mx::array>& bias,
    float eps,
    mx::StreamOrDevice s) {
  return norm("layer_norm", false, x, weight, bias, eps, s);
}

void CpuNorm::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  dispatch_task(stream(), inputs, out, [rms = rms_,
                                        has_weight = has_weight_,
                                        has_bias = has_bias_,
                                        eps = eps_](std::vector<mx::array>& in, mx::array& out) {
    Rows x = rows_of(in[0]);
    const float* w = has_weight ? in[1].data<float>() : nullptr;
    const float* b = has_bias ? in[has_weight ? 2 : 1].data<float>() : nullptr;
    int n = in[0].shape(-1);
    int rows = int(x.starts.size());
    float* y = out.data<float>();
    const RowKernels& k = row_kernels();
    // On this thread: one pass over well under a megabyte even in a prefill
    // chunk, where waking the workers would only contend with the BLAS's
    // spinning threads.
    for (int r = 0; r < rows; r++) {
      const float* row = x.data + x.starts[r];
      if (rms) {
        k.rms_norm(row, w, y + int64_t(r) * n, n, eps);
      } else {
        k.layer_norm(row, w, b, y + int64_t(r) * n, n, eps);
      }
    }
  });
}

void CpuNorm::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[CpuNorm] runs on the CPU only");
}

bool CpuNorm::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const CpuNorm&>(other);
  return rms_ == o.rms_ && has_weight_ == o.has_weight_ &&
      has_bias_ == o.has_bias_ && eps_ == o.eps_;
}

mx::array swiglu(const mx::array& gate, const mx::array& x, mx::StreamOrDevice s_) {
  if (gate.shape() != x.shape()) {
    std::ostringstream msg;
    msg << "[swiglu] gate and x must have one shape but have " << gate.shape()
        << " and " << x.shape() << ".";
    throw std::invalid_argument(msg.str());
  }
  auto out_type = mx::promote_types(gate.dtype(), x.dtype());
  check_floating("swiglu", out_type);
  auto s = mx::to_stream(s_, mx::Device::cpu);
  auto y = mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<CpuRowOp>(s, CpuRowOp::Op::swiglu),
      {as(gate, mx::float32, s), as(x, mx::float32, s)});
  return as(y, out_type, s);
}

mx::array logsumexp(const mx::array& x, mx::StreamOrDevice s_) {
  if (x.ndim() == 0 || x.shape(-1) == 0) {
    throw std::invalid_argument(
        "[logsumexp] Input must have at least 1 dimension and a last axis of "
        "at least one element.");
  }
  check_floating("logsumexp", x.dtype());
  auto s = mx::to_stream(s_, mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = 1;
  auto y = mx::array(
      shape,
      mx::float32,
      std::make_shared<CpuRowOp>(s, CpuRowOp::Op::logsumexp),
      {as(x, mx::float32, s)});
  return as(y, x.dtype(), s);
}

std::vector<mx::Shape> CpuRowOp::output_shapes(const std::vector<mx::array>& inputs) {
  auto shape = inputs[0].shape();
  if (op_ == Op::logsumexp) {
    shape.back() = 1;
  }
  return {shape};
}

void CpuRowOp::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto run = [op = op_](std::vector<mx::array>& in, mx::array& out) {
    Rows x = rows_of(in[0]);
    int n = in[0].shape(-1);
    int rows = int(x.starts.size());
    float* y = out.data<float>();
    const RowKernels& k = row_kernels();
    // On this thread, as the norms: a pass over at most a prefill chunk's rows.
    if (op == Op::logsumexp) {
      for (int r = 0; r < rows; r++) {
        y[r] = k.log_sum_exp(x.data + x.starts[r], n);
      }
      return;
    }
    Rows u = rows_of(in[1]);
    for (int r = 0; r < rows; r++) {
      k.silu_mul(x.data + x.starts[r], u.data + u.starts[r], y + int64_t(r) * n, n);
    }
  };
  dispatch_task(stream(), inputs, out, run);
}

std::vector<mx::array> CpuRowOp::vjp(
    const std::vector<mx::array>& primals,
    const std::vector<mx::array>& cotangents,
    const std::vector<int>& argnums,
    const std::vector<mx::array>& outputs) {
  auto s = stream();
  const auto& c = cotangents[0];
  std::vector<mx::array> grads;
  if (op_ == Op::logsumexp) {
    // d/dx = softmax(x) = exp(x - logsumexp(x)).
    auto softmax = mx::exp(mx::subtract(primals[0], outputs[0], s), s);
    grads.push_back(mx::multiply(c, softmax, s));
    return grads;
  }
  const auto& g = primals[0];
  const auto& u = primals[1];
  auto sigmoid = mx::sigmoid(g, s);
  for (int arg : argnums) {
    if (arg == 0) {
      // silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g))).
      auto one = mx::array(1.0f, mx::float32);
      auto slope = mx::multiply(
          sigmoid,
          mx::add(one, mx::multiply(g, mx::subtract(one, sigmoid, s), s), s),
          s);
      grads.push_back(mx::multiply(c, mx::multiply(u, slope, s), s));
    } else {
      grads.push_back(mx::multiply(c, mx::multiply(g, sigmoid, s), s));
    }
  }
  return grads;
}

void CpuRowOp::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[CpuRowOp] runs on the CPU only");
}

mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    std::optional<float> base,
    float scale,
    const std::variant<int, mx::array>& offset_,
    const std::optional<mx::array>& freqs,
    mx::StreamOrDevice s_) {
  auto s = mx::to_stream(s_, mx::Device::cpu);
  mx::array offset = std::holds_alternative<int>(offset_)
      ? mx::array(std::get<int>(offset_), mx::int32)
      : std::get<mx::array>(offset_);
  if (x.ndim() < 3) {
    std::ostringstream msg;
    msg << "[rope] Input must have at least 3 dimensions but got input with "
        << x.ndim() << " dimensions.";
    throw std::invalid_argument(msg.str());
  }
  check_floating("rope", x.dtype());
  // One offset per batch row, or (a batch of one) one position per token.
  bool per_token = x.shape(0) == 1 && offset.size() == x.shape(-2);
  if (offset.ndim() > 1 ||
      (offset.size() != 1 && offset.size() != x.shape(0) && !per_token)) {
    std::ostringstream msg;
    msg << "[rope] offset must be a scalar or vector with " << x.shape(0)
        << " elements (or " << x.shape(-2) << " positions for a batch of one)"
        << " but has shape " << offset.shape() << ".";
    throw std::invalid_argument(msg.str());
  }
  if (!mx::issubdtype(offset.dtype(), mx::integer)) {
    throw std::invalid_argument("[rope] offset must be an integer.");
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    std::ostringstream msg;
    msg << "[rope] dims must be positive, even and at most " << x.shape(-1)
        << " but got " << dims << ".";
    throw std::invalid_argument(msg.str());
  }
  if (freqs.has_value() == base.has_value()) {
    throw std::invalid_argument(
        "[rope] Exactly one of base or freqs must have a value.");
  }
  std::vector<mx::array> inputs = {
      as(x, mx::float32, s), as(offset, mx::int32, s)};
  if (freqs) {
    check_vector("rope", "freqs", *freqs, dims / 2);
    inputs.push_back(as(*freqs, mx::float32, s));
  }
  auto y = mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<CpuRoPE>(
          s, dims, traditional, base.value_or(1.0f), scale),
      std::move(inputs));
  return as(y, x.dtype(), s);
}

namespace {

// The cosines and sines of the positions a RoPE call rotates, kept for the next
// call: a step's layers all rotate the same positions.
struct Angles {
  int half = 0;
  int length = 0;
  float scale = 0.0f;
  std::vector<int> offsets;
  std::vector<float> inv_freqs;
  std::vector<float> cos;
  std::vector<float> sin;

  // Rows of `half` values for offsets[i] + t at i * length + t.
  void update(
      const std::vector<int>& new_offsets,
      int new_length,
      float new_scale,
      const std::vector<float>& new_inv_freqs) {
    if (new_offsets == offsets && new_length == length && new_scale == scale &&
        new_inv_freqs == inv_freqs) {
      return;
    }
    offsets = new_offsets;
    length = new_length;
    scale = new_scale;
    inv_freqs = new_inv_freqs;
    half = int(inv_freqs.size());
    size_t n = offsets.size() * size_t(length) * half;
    cos.resize(n);
    sin.resize(n);
    namespace simd = mx::simd;
    for (size_t o = 0; o < offsets.size(); o++) {
      for (int t = 0; t < length; t++) {
        // As MLX's fallback rounds them: (t + offset) * scale, then each angle.
        float position = (float(t) + float(offsets[o])) * scale;
        size_t row = (o * length + t) * half;
        for (int i = 0; i < half; i++) {
          simd::Simd<float, 1> theta(position * inv_freqs[i]);
          cos[row + i] = simd::cos(theta).value;
          sin[row + i] = simd::sin(theta).value;
        }
      }
    }
  }
};

// RoPE's inverse frequencies: 1 / freqs where given, else from `base`.
std::vector<float> inverse_frequencies(int dims, float base, const float* freqs) {
  int half = dims / 2;
  std::vector<float> inv_freqs(half);
  if (freqs != nullptr) {
    for (int i = 0; i < half; i++) {
      inv_freqs[i] = 1.0f / freqs[i];
    }
  } else {
    float step = std::log(base) / float(half);
    for (int i = 0; i < half; i++) {
      inv_freqs[i] = mx::simd::exp(mx::simd::Simd<float, 1>(float(-i) * step)).value;
    }
  }
  return inv_freqs;
}

} // namespace

namespace fused {

const RowKernels& chosen_rows() {
  return row_kernels();
}

RopeAngles rope_angles(
    int dims,
    float base,
    float scale,
    const float* freqs,
    int position) {
  thread_local Angles angles;
  angles.update({position}, 1, scale, inverse_frequencies(dims, base, freqs));
  return {angles.cos.data(), angles.sin.data()};
}

} // namespace fused

void CpuRoPE::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  dispatch_task(stream(), inputs, out, [dims = dims_,
                                        traditional = traditional_,
                                        base = base_,
                                        scale = scale_](std::vector<mx::array>& in, mx::array& out) {
    thread_local Angles angles;
    auto& x = in[0];
    int half = dims / 2;
    std::vector<float> inv_freqs =
        inverse_frequencies(dims, base, in.size() == 3 ? in[2].data<float>() : nullptr);
    const int* o = in[1].data<int>();
    std::vector<int> offsets(in[1].size());
    for (size_t i = 0; i < offsets.size(); i++) {
      offsets[i] = o[in[1].ndim() ? i * in[1].strides(0) : 0];
    }
    int length = x.shape(-2);
    int n = x.shape(-1);
    // A batch of one with a position per token: each token's own angles.
    bool per_token = x.shape(0) == 1 && length > 1 && int(offsets.size()) == length;
    angles.update(offsets, per_token ? 1 : length, scale, inv_freqs);
    Rows rows = rows_of(x);
    int count = int(rows.starts.size());
    // Rows of one batch entry, and whether each entry has its own offset.
    int per_batch = count / x.shape(0);
    bool own = offsets.size() > 1;
    float* y = out.data<float>();
    const RowKernels& k = row_kernels();
    // On this thread, as the norms.
    for (int r = 0; r < count; r++) {
      int t = r % length;
      size_t at = per_token
          ? size_t(t) * half
          : ((own ? r / per_batch : 0) * size_t(length) + t) * half;
      k.rope(
          rows.data + rows.starts[r],
          angles.cos.data() + at,
          angles.sin.data() + at,
          y + int64_t(r) * n,
          dims,
          n,
          traditional);
    }
  });
}

void CpuRoPE::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[CpuRoPE] runs on the CPU only");
}

bool CpuRoPE::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const CpuRoPE&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ &&
      base_ == o.base_ && scale_ == o.scale_;
}

mx::array attention(
    const mx::array& queries,
    const mx::array& keys,
    const mx::array& values,
    float scale,
    const std::string& mask_mode,
    const std::optional<mx::array>& mask,
    const std::optional<mx::array>& sinks,
    mx::StreamOrDevice s_) {
  const char* op = "scaled_dot_product_attention";
  for (auto* a : {&queries, &keys, &values}) {
    if (a->ndim() != 4) {
      std::ostringstream msg;
      msg << "[" << op << "] input with shape " << a->shape()
          << " expected to be rank 4";
      throw std::invalid_argument(msg.str());
    }
  }
  int B = queries.shape(0), heads = queries.shape(1), L = queries.shape(2);
  int kv_heads = keys.shape(1), S = keys.shape(2);
  if (keys.shape(0) != B || values.shape(0) != B || values.shape(1) != kv_heads ||
      values.shape(2) != S || keys.shape(3) != queries.shape(3) ||
      heads % kv_heads != 0) {
    std::ostringstream msg;
    msg << "[" << op << "] incompatible shapes: queries " << queries.shape()
        << ", keys " << keys.shape() << ", values " << values.shape() << ".";
    throw std::invalid_argument(msg.str());
  }
  if (mask_mode != "" && mask_mode != "causal" && mask_mode != "array") {
    throw std::invalid_argument(
        "[" + std::string(op) + "] mask_mode must be 'causal', 'array' or ''.");
  }
  auto out_type = mx::promote_types(
      queries.dtype(), mx::promote_types(keys.dtype(), values.dtype()));
  check_floating(op, out_type);
  auto s = mx::to_stream(s_, mx::Device::cpu);
  std::vector<mx::array> inputs = {
      as(queries, mx::float32, s),
      as(keys, mx::float32, s),
      as(values, mx::float32, s)};
  bool has_mask = mask_mode == "array" || (mask_mode == "" && mask.has_value());
  if (has_mask) {
    if (!mask.has_value()) {
      throw std::invalid_argument(
          "[" + std::string(op) + "] mask_mode 'array' needs a mask.");
    }
    const mx::Shape target = {B, heads, L, S};
    bool fits = mask->ndim() <= 4;
    for (int i = 1; fits && i <= mask->ndim(); i++) {
      int size = mask->shape(-i);
      fits = size == 1 || size == target[4 - i];
    }
    if (!fits) {
      std::ostringstream msg;
      msg << "[" << op << "] the mask with shape " << mask->shape()
          << " does not broadcast to " << target << ".";
      throw std::invalid_argument(msg.str());
    }
    inputs.push_back(
        mask->dtype() == mx::bool_ ? *mask : as(*mask, mx::float32, s));
  }
  if (sinks.has_value()) {
    check_vector(op, "sinks", *sinks, heads);
    inputs.push_back(as(*sinks, mx::float32, s));
  }
  auto y = mx::array(
      {B, heads, L, values.shape(3)},
      mx::float32,
      std::make_shared<CpuAttention>(
          s, scale, mask_mode == "causal", has_mask, sinks.has_value()),
      std::move(inputs));
  return as(y, out_type, s);
}

void CpuAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  dispatch_task(stream(), inputs, out, [scale = scale_,
                                        causal = causal_,
                                        has_mask = has_mask_,
                                        has_sinks = has_sinks_](std::vector<mx::array>& in, mx::array& out) {
    Tensor4 q = tensor4(in[0]), k = tensor4(in[1]), v = tensor4(in[2]);
    int B = in[0].shape(0), heads = in[0].shape(1), L = in[0].shape(2);
    int D = in[0].shape(3);
    int kv_heads = in[1].shape(1), S = in[1].shape(2), Dv = in[2].shape(3);
    int repeats = heads / kv_heads;
    // The mask's strides over [B, heads, L, S], 0 along the axes it broadcasts.
    const void* mask = nullptr;
    bool keep_mask = false;
    int64_t mask_strides[4] = {0, 0, 0, 0};
    if (has_mask) {
      auto& m = in[3];
      keep_mask = m.dtype() == mx::bool_;
      mask = m.data<char>();
      for (int i = 1; i <= m.ndim(); i++) {
        mask_strides[4 - i] = m.shape(-i) == 1 ? 0 : m.strides(-i);
      }
    }
    const float* sinks = has_sinks ? in.back().data<float>() : nullptr;
    float* y = out.data<float>();
    auto make_row = [&](int b, int h, int l) {
      int kv = h / repeats;
      fused::AttentionRow row;
      row.q = q.data + b * q.strides[0] + h * q.strides[1] + l * q.strides[2];
      row.k = k.data + b * k.strides[0] + kv * k.strides[1];
      row.v = v.data + b * v.strides[0] + kv * v.strides[1];
      row.k_stride = k.strides[2];
      row.v_stride = v.strides[2];
      row.dims = D;
      row.value_dims = Dv;
      row.keys = causal ? std::clamp(S - L + l + 1, 0, S) : S;
      row.first_key = 0;
      row.pages = nullptr;
      row.half = false;
      row.keep = nullptr;
      row.bias = nullptr;
      row.mask_stride = mask_strides[3];
      if (mask != nullptr) {
        int64_t at =
            b * mask_strides[0] + h * mask_strides[1] + l * mask_strides[2];
        if (keep_mask) {
          row.keep = static_cast<const bool*>(mask) + at;
        } else {
          row.bias = static_cast<const float*>(mask) + at;
        }
      }
      row.scale = scale;
      row.has_sink = sinks != nullptr;
      row.sink = sinks != nullptr ? sinks[h] : 0.0f;
      row.out = y + ((int64_t(b) * heads + h) * L + l) * Dv;
      return row;
    };
    const RowKernels& kernels = row_kernels();
    double work = double(B) * heads * L * S * (D + Dv);
    // A task: a few positions of one batch row's kv head, for each query head
    // that reads it; the latest positions (the most keys, when causal) first.
    int per = positions_per_task(L);
    int blocks = (L + per - 1) / per;
    int groups = B * kv_heads;
    run_tasks(blocks * groups, work, [&](int t) {
      int block = blocks - 1 - t / groups, b = (t % groups) / kv_heads;
      int kv = t % kv_heads;
      thread_local std::vector<fused::AttentionRow> rows;
      thread_local std::vector<float> scratch;
      rows.clear();
      for (int l = block * per; l < std::min(L, (block + 1) * per); l++) {
        for (int h = kv * repeats; h < (kv + 1) * repeats; h++) {
          rows.push_back(make_row(b, h, l));
        }
      }
      int count = int(rows.size());
      scratch.resize(fused::attention_rows_scratch(count, D, Dv));
      kernels.attention_rows(rows.data(), count, scratch.data());
    });
  });
}

void CpuAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[CpuAttention] runs on the CPU only");
}

bool CpuAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const CpuAttention&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ &&
      has_mask_ == o.has_mask_ && has_sinks_ == o.has_sinks_;
}

std::vector<mx::Shape> CpuAttention::output_shapes(
    const std::vector<mx::array>& inputs) {
  auto& q = inputs[0];
  return {{q.shape(0), q.shape(1), q.shape(2), inputs[2].shape(3)}};
}

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
    const std::vector<mx::array>& key_scales,
    const std::vector<mx::array>& key_biases,
    const std::vector<mx::array>& value_scales,
    const std::vector<mx::array>& value_biases,
    int bits,
    int group_size,
    int value_dims,
    mx::StreamOrDevice s_) {
  const char* op = "paged_attention";
  int heads = queries.ndim() == 4 ? queries.shape(1) : 0;
  int D = queries.ndim() == 4 ? queries.shape(3) : 0;
  // Quantized arenas hold `bits`-bit codes packed in uint32 words (MLX's
  // quantize), and a scale and a bias per group of `group_size` dims.
  bool quantized = bits > 0;
  int per_word = quantized ? 32 / std::gcd(32, bits) : 1;
  bool fits = queries.ndim() == 4 && queries.shape(0) == 1 && !keys.empty() &&
      keys.size() == values.size() && arena_pages > 0 && segments.ndim() == 2 &&
      segments.shape(1) == 3 && tables.ndim() == 2 &&
      tables.shape(0) == segments.shape(0) && bits >= 0 && bits <= 8;
  if (fits && quantized) {
    fits = group_size > 0 && D % group_size == 0 && D % per_word == 0 &&
        key_scales.size() == keys.size() && key_biases.size() == keys.size() &&
        value_scales.size() == keys.size() && value_biases.size() == keys.size();
  } else if (fits) {
    fits = key_scales.empty() && key_biases.empty() && value_scales.empty() &&
        value_biases.empty();
  }
  // Dims a key row of an arena holds: packed words where quantized.
  auto row_dims = [&](int dims) {
    return quantized ? dims * bits / 32 : dims;
  };
  int Dv = 0;
  if (fits) {
    int words = values[0].ndim() == 3 ? values[0].shape(2) : 0;
    Dv = quantized ? words * 32 / bits : words;
    fits = !quantized || (Dv % group_size == 0 && row_dims(Dv) == words);
    // A row's first value_dims dims (float arenas only).
    if (value_dims != 0) {
      fits = fits && !quantized && value_dims > 0 && value_dims <= words;
      Dv = value_dims;
    }
  }
  for (size_t a = 0; fits && a < keys.size(); a++) {
    auto &k = keys[a], &v = values[a];
    int64_t rows = int64_t(arena_pages) * fused::KEYS_BLOCK;
    fits = k.ndim() == 3 && v.ndim() == 3 && k.shape(0) == rows &&
        v.shape(0) == rows && k.shape(1) == keys[0].shape(1) &&
        v.shape(1) == k.shape(1) && k.shape(2) == row_dims(D) &&
        v.shape(2) == values[0].shape(2) && heads % k.shape(1) == 0;
    if (fits && quantized) {
      fits = k.dtype() == mx::uint32 && v.dtype() == mx::uint32;
      for (auto [group, dims] :
           {std::pair{&key_scales, D},
            {&key_biases, D},
            {&value_scales, Dv},
            {&value_biases, Dv}}) {
        auto& g = (*group)[a];
        fits = fits && g.ndim() == 3 && g.shape(0) == rows &&
            g.shape(1) == k.shape(1) && g.shape(2) == dims / group_size;
      }
    }
  }
  if (!fits) {
    std::ostringstream msg;
    msg << "[" << op << "] incompatible shapes: queries " << queries.shape()
        << ", " << keys.size() << " key and " << values.size()
        << " value arenas of " << arena_pages << " pages, segments "
        << segments.shape() << ", tables " << tables.shape();
    if (quantized) {
      msg << ", " << bits << "-bit codes in groups of " << group_size;
    }
    msg << ".";
    throw std::invalid_argument(msg.str());
  }
  auto out_type = queries.dtype();
  if (!quantized) {
    for (auto* arenas : {&keys, &values}) {
      for (auto& a : *arenas) {
        out_type = mx::promote_types(out_type, a.dtype());
      }
    }
  }
  check_floating(op, out_type);
  auto s = mx::to_stream(s_, mx::Device::cpu);
  // The layout's arrays and the arenas are row-contiguous as the store makes
  // them (checked when the task runs): no copies, no more nodes. Float16 arenas
  // are read as they are (widened a block at a time), quantized ones as codes
  // (dequantized a block at a time); others become float32.
  bool half = !quantized;
  for (auto* arenas : {&keys, &values}) {
    for (auto& a : *arenas) {
      half = half && a.dtype() == mx::float16;
    }
  }
  std::vector<mx::array> inputs = {
      as(queries, mx::float32, s),
      as(segments, mx::int32, s),
      as(tables, mx::int32, s)};
  for (auto* arenas : {&keys, &values}) {
    for (auto& a : *arenas) {
      inputs.push_back(
          quantized ? a : as(a, half ? mx::float16 : mx::float32, s));
    }
  }
  for (auto* arenas : {&key_scales, &key_biases, &value_scales, &value_biases}) {
    for (auto& a : *arenas) {
      inputs.push_back(as(a, mx::float32, s));
    }
  }
  if (sinks.has_value()) {
    check_vector(op, "sinks", *sinks, heads);
    inputs.push_back(as(*sinks, mx::float32, s));
  }
  auto y = mx::array(
      {1, heads, queries.shape(2), Dv},
      mx::float32,
      std::make_shared<CpuPagedAttention>(
          s,
          scale,
          int(keys.size()),
          arena_pages,
          window,
          sinks.has_value(),
          bits,
          group_size,
          value_dims),
      std::move(inputs));
  return as(y, out_type, s);
}

namespace fused {

void paged_attention(const PagedAttention& a) {
  int heads = a.heads, L = a.tokens, D = a.dims, Dv = a.value_dims;
  int kv_heads = a.kv_heads, value_row = a.value_row;
  int arenas = a.arenas, bits = a.bits, group_size = a.group_size;
  int count = a.count, width = a.width, window = a.window;
  const int32_t* segments = a.segments;
  const int32_t* tables = a.tables;
  int repeats = heads / kv_heads;
  // Tasks: a few positions of one sequence's kv head, deepest first.
  struct Task {
    int segment, first, end;
  };
  std::vector<Task> tasks;
  double work = 0;
  for (int i = 0; i < count; i++) {
    int start = segments[3 * i], n = segments[3 * i + 1];
    int context = segments[3 * i + 2];
    int pages = (context + KEYS_BLOCK - 1) / KEYS_BLOCK;
    bool fits = start >= 0 && n >= 0 && start + n <= L && context >= n &&
        pages <= width;
    for (int p = 0; fits && p < pages; p++) {
      int page = tables[int64_t(i) * width + p];
      fits = page >= 0 && page < arenas * a.arena_pages;
    }
    if (!fits) {
      throw std::invalid_argument("[paged_attention] a segment is out of range");
    }
    int per = positions_per_task(n);
    for (int end = n; end > 0; end -= per) {
      tasks.push_back({i, std::max(0, end - per), end});
    }
    work += double(heads) * n * context * (D + Dv);
  }
  // Per token of an arena: elements (bytes of codes where quantized), and
  // where quantized its scales (as many as its biases).
  int64_t token_stride = int64_t(kv_heads) * (bits > 0 ? D * bits / 8 : D);
  int64_t value_stride =
      int64_t(kv_heads) * (bits > 0 ? value_row * bits / 8 : value_row);
  int k_groups = bits > 0 ? D / group_size : 0;
  int v_groups = bits > 0 ? Dv / group_size : 0;
  const RowKernels& kernels = row_kernels();
  int total = int(tasks.size()) * kv_heads;
  run_tasks(total, work, [&](int t) {
    const Task& task = tasks[t / kv_heads];
    int kv = t % kv_heads;
    int start = segments[3 * task.segment], n = segments[3 * task.segment + 1];
    int context = segments[3 * task.segment + 2];
    thread_local std::vector<AttentionRow> rows;
    thread_local std::vector<float> scratch;
    rows.clear();
    for (int l = task.first; l < task.end; l++) {
      for (int h = kv * repeats; h < (kv + 1) * repeats; h++) {
        AttentionRow row;
        row.q = a.q + h * a.q_head_stride + (start + l) * a.q_token_stride;
        row.k = nullptr;
        row.v = nullptr;
        row.k_stride = token_stride;
        row.v_stride = value_stride;
        row.pages = tables + int64_t(task.segment) * width;
        row.half = a.half;
        row.k_arenas = a.k_arenas;
        row.v_arenas = a.v_arenas;
        row.arena_pages = a.arena_pages;
        row.k_page_stride = token_stride * KEYS_BLOCK;
        row.v_page_stride = value_stride * KEYS_BLOCK;
        row.k_head = int64_t(kv) * (bits > 0 ? D * bits / 8 : D);
        row.v_head = int64_t(kv) * (bits > 0 ? value_row * bits / 8 : value_row);
        if (bits > 0) {
          row.bits = bits;
          row.group_size = group_size;
          row.k_scale_arenas = a.groups;
          row.k_bias_arenas = a.groups + arenas;
          row.v_scale_arenas = a.groups + 2 * arenas;
          row.v_bias_arenas = a.groups + 3 * arenas;
          row.k_scale_stride = int64_t(kv_heads) * k_groups;
          row.v_scale_stride = int64_t(kv_heads) * v_groups;
          row.k_scale_head = int64_t(kv) * k_groups;
          row.v_scale_head = int64_t(kv) * v_groups;
        }
        row.dims = D;
        row.value_dims = Dv;
        row.keys = context - n + l + 1;
        row.first_key = window > 0 ? std::max(0, row.keys - window) : 0;
        row.keep = nullptr;
        row.bias = nullptr;
        row.mask_stride = 0;
        row.scale = a.scale;
        row.has_sink = a.sinks != nullptr;
        row.sink = a.sinks != nullptr ? a.sinks[h] : 0.0f;
        row.out = a.out + (int64_t(h) * L + start + l) * Dv;
        rows.push_back(row);
      }
    }
    int rows_count = int(rows.size());
    scratch.resize(attention_rows_scratch(rows_count, D, Dv));
    kernels.attention_rows(rows.data(), rows_count, scratch.data());
  });
}

} // namespace fused

void CpuPagedAttention::eval_cpu(
    const std::vector<mx::array>& inputs,
    mx::array& out) {
  dispatch_task(stream(), inputs, out, [scale = scale_,
                                        arenas = arenas_,
                                        arena_pages = arena_pages_,
                                        window = window_,
                                        has_sinks = has_sinks_,
                                        bits = bits_,
                                        group_size = group_size_,
                                        value_dims = value_dims_](
                                           std::vector<mx::array>& in,
                                           mx::array& out) {
    for (size_t i = 1; i < in.size() - (has_sinks ? 1 : 0); i++) {
      if (!in[i].flags().row_contiguous) {
        throw std::invalid_argument(
            "[paged_attention] the layout and the arenas must be row-contiguous");
      }
    }
    Tensor4 q = tensor4(in[0]);
    auto& first_keys = in[3];
    auto& first_values = in[3 + arenas];
    // Float16 arenas' bits and quantized arenas' codes, read through float
    // pointers the row kernel widens.
    std::vector<const float*> k_arenas(arenas), v_arenas(arenas);
    // Quantized: each arena's key scales, key biases, value scales, value biases.
    std::vector<const float*> groups(bits > 0 ? 4 * arenas : 0);
    for (int a = 0; a < arenas; a++) {
      k_arenas[a] = static_cast<const float*>(in[3 + a].data<void>());
      v_arenas[a] = static_cast<const float*>(in[3 + arenas + a].data<void>());
    }
    for (size_t g = 0; g < groups.size(); g++) {
      groups[g] = in[3 + 2 * arenas + g].data<float>();
    }
    fused::PagedAttention a;
    a.q = q.data;
    a.q_head_stride = q.strides[1];
    a.q_token_stride = q.strides[2];
    a.heads = in[0].shape(1);
    a.tokens = in[0].shape(2);
    a.dims = in[0].shape(3);
    a.kv_heads = first_keys.shape(1);
    // A value row's dims in its arena (codes' where quantized), and those read.
    a.value_row =
        bits > 0 ? first_values.shape(2) * 32 / bits : first_values.shape(2);
    a.value_dims = value_dims > 0 ? value_dims : a.value_row;
    a.segments = in[1].data<int32_t>();
    a.count = in[1].shape(0);
    a.tables = in[2].data<int32_t>();
    a.width = in[2].shape(1);
    a.arenas = arenas;
    a.arena_pages = arena_pages;
    a.k_arenas = k_arenas.data();
    a.v_arenas = v_arenas.data();
    a.half = first_keys.dtype() == mx::float16;
    a.bits = bits;
    a.group_size = group_size;
    a.groups = groups.data();
    a.window = window;
    a.scale = scale;
    a.sinks = has_sinks ? in.back().data<float>() : nullptr;
    a.out = out.data<float>();
    fused::paged_attention(a);
  });
}

void CpuPagedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("[CpuPagedAttention] runs on the CPU only");
}

bool CpuPagedAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const CpuPagedAttention&>(other);
  return scale_ == o.scale_ && arenas_ == o.arenas_ &&
      arena_pages_ == o.arena_pages_ && window_ == o.window_ &&
      has_sinks_ == o.has_sinks_ && bits_ == o.bits_ &&
      group_size_ == o.group_size_ && value_dims_ == o.value_dims_;
}

std::vector<mx::Shape> CpuPagedAttention::output_shapes(
    const std::vector<mx::array>& inputs) {
  int words = inputs[3 + arenas_].shape(2);
  int Dv = value_dims_ > 0 ? value_dims_ : bits_ > 0 ? words * 32 / bits_ : words;
  return {{1, inputs[0].shape(1), inputs[0].shape(2), Dv}};
}

void set_fused_isa(const std::string& isa) {
  std::string names;
  for (const RowKernels* table : tables()) {
    if (isa == "auto" || isa == table->isa) {
      chosen.store(table);
      return;
    }
    names += std::string(", ") + table->isa;
  }
  throw std::invalid_argument("[fused] isa must be auto" + names);
}

std::vector<std::string> fused_isas() {
  std::vector<std::string> out;
  for (const RowKernels* table : tables()) {
    out.push_back(table->isa);
  }
  return out;
}

std::string fused_isa() {
  return row_kernels().isa;
}

} // namespace qmm
