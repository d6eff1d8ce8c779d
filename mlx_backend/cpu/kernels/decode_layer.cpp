#include "decode_layer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "fused_rows.h"
#include "mlx/backend/cpu/encoder.h"
#include "quantized_matmul.h"

namespace qmm {

namespace {

constexpr int LINEARS = 7;
enum Linear { Q, K, V, O, GATE, UP, DOWN };
// Inputs before the linears' (x, keys, values, two norms).
constexpr int FIRST_LINEAR = 5;

std::atomic<int> cache_copies{0};

void check(bool ok, const std::string& what) {
  if (!ok) {
    throw std::invalid_argument("[decode_layer] " + what);
  }
}

// `src`'s first `rows` positions ([1, heads, S, dims]) into the row-major `dst`
// (a cache MLX could not donate; the positions after them are never read).
void copy_cache(const mx::array& src, int rows, float* dst) {
  const float* base = src.data<float>();
  int heads = src.shape(1), S = src.shape(2), dims = src.shape(3);
  for (int h = 0; h < heads; h++) {
    for (int t = 0; t < rows; t++) {
      const float* row = base + h * src.strides(1) + t * src.strides(2);
      float* out = dst + (int64_t(h) * S + t) * dims;
      if (src.strides(3) == 1) {
        std::memcpy(out, row, sizeof(float) * dims);
        continue;
      }
      for (int d = 0; d < dims; d++) {
        out[d] = row[d * src.strides(3)];
      }
    }
  }
}

// The last decode layer's time on the stream, in microseconds.
std::atomic<int64_t> layer_us{0};

// Whether `a` may be written in place: nothing but this node holds it (MLX's
// donation). Where only its buffer is held twice, by the stream's cleanup of the
// last step's node, it waits (asleep) for the stream to pass that node: up to 4
// layers' time, at least 10 ms. An array held elsewhere (a prompt cache's copy
// of the state) is not waited for.
bool wait_donatable(const mx::array& a) {
  if (!a.flags().row_contiguous) {
    return false;
  }
  auto bound = std::max<int64_t>(10000, 4 * layer_us.load());
  auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(bound);
  while (!a.is_donatable()) {
    if (a.data_shared_ptr().use_count() == 1 ||
        std::chrono::steady_clock::now() > until) {
      return false;
    }
    // Asleep, not spinning: the thread that builds the steps shares the cores
    // with the matmuls' threads.
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return true;
}

// A linear's (outputs, inputs), checked as quantized_matmul checks a weight,
// 4- or 8-bit (the kernels' SIMD shapes).
std::pair<int, int> checked_linear(
    const mx::array* parts,
    int group_size,
    int bits,
    const char* name) {
  std::string what = std::string(name) +
      " must be 4- or 8-bit affine codes (uint32) with scales and biases per "
      "group of a multiple of 32";
  check(bits == 4 || bits == 8, what);
  try {
    int N = check_weight(parts[0], parts[1], parts[2], group_size, bits);
    return {N, parts[0].shape(1) * 32 / bits};
  } catch (const std::invalid_argument& e) {
    check(false, what + ": " + e.what());
  }
  return {};
}

} // namespace

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
    mx::StreamOrDevice s_) {
  auto s = mx::to_stream(s_, mx::Device::cpu);
  check(
      linears.size() == 3 * LINEARS && shape.bits.size() == LINEARS &&
          shape.group_sizes.size() == LINEARS,
      "give w, scales and biases of q, k, v, o, gate, up and down, and each one's "
      "group size and bits");
  check(
      x.dtype() == mx::float32 && x.ndim() == 3 && x.shape(0) == 1 && x.shape(1) == 1,
      "x must be float32 of shape (1, 1, D)");
  int D = x.shape(2);
  for (auto* cache : {&keys, &values}) {
    check(
        cache->dtype() == mx::float32 && cache->ndim() == 4 && cache->shape(0) == 1 &&
            cache->shape(1) == shape.kv_heads && cache->shape(2) > offset &&
            offset >= 0,
        "keys and values must be float32 (1, kv_heads, S, dims) with S > offset");
  }
  int heads = shape.heads, kv_heads = shape.kv_heads;
  check(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
        "heads must be a multiple of kv_heads");
  int dims = keys.shape(3), value_dims = values.shape(3);
  check(keys.shape(2) == values.shape(2), "keys and values must have one length");
  check(
      shape.rope_dims > 0 && shape.rope_dims % 2 == 0 && shape.rope_dims <= dims,
      "rope_dims must be even and at most the heads' dims");
  const char* names[LINEARS] = {"q", "k", "v", "o", "gate", "up", "down"};
  std::pair<int, int> found[LINEARS];
  for (int i = 0; i < LINEARS; i++) {
    found[i] =
        checked_linear(&linears[3 * i], shape.group_sizes[i], shape.bits[i], names[i]);
  }
  // Each linear's (outputs, inputs).
  int hidden = found[GATE].first;
  std::pair<int, int> expected[LINEARS] = {
      {heads * dims, D},
      {kv_heads * dims, D},
      {kv_heads * value_dims, D},
      {D, heads * value_dims},
      {hidden, D},
      {hidden, D},
      {D, hidden}};
  for (int i = 0; i < LINEARS; i++) {
    check(
        found[i] == expected[i],
        std::string(names[i]) + "'s weight does not fit x and the caches");
  }
  for (auto* norm : {&attention_norm, &mlp_norm}) {
    check(norm->ndim() == 1 && norm->shape(0) == D, "the norms' weights must be (D,)");
  }
  std::vector<mx::array> inputs = {
      x,
      keys,
      values,
      mx::astype(attention_norm, mx::float32, s),
      mx::astype(mlp_norm, mx::float32, s)};
  inputs.insert(inputs.end(), linears.begin(), linears.end());
  if (freqs) {
    check(
        freqs->size() == size_t(shape.rope_dims / 2),
        "freqs must be (rope_dims / 2,)");
    inputs.push_back(mx::astype(*freqs, mx::float32, s));
  }
  return mx::array::make_arrays(
      {x.shape(), keys.shape(), values.shape()},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<CpuDecodeLayer>(s, shape, offset, freqs.has_value()),
      inputs);
}

int decode_layer_cache_copies() {
  return cache_copies.load();
}

void CpuDecodeLayer::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // The caches are written in place where nothing else holds them (as MLX's
  // slice update does; wait_donatable), else their filled positions copied
  // first. Each output holds its own copy of the inputs (MLX's make_arrays), so no
  // input of a node with several outputs is ever donatable: the outputs whose
  // inputs MLX did not hand to this call drop theirs now, as MLX's detach would
  // after it.
  for (auto& o : outputs) {
    if (&o.inputs() != &inputs) {
      o.inputs().clear();
    }
  }
  bool copy[3] = {false, false, false};
  for (int i = 0; i < 3; i++) {
    if (i > 0 && wait_donatable(inputs[i])) {
      outputs[i].copy_shared_buffer(inputs[i]);
    } else {
      outputs[i].set_data(mx::allocator::malloc(outputs[i].nbytes()));
      copy[i] = i > 0;
    }
  }
  std::vector<mx::array> in, out;
  for (auto& a : inputs) {
    encoder.set_input_array(a);
    in.push_back(mx::array::unsafe_weak_copy(a));
  }
  for (auto& a : outputs) {
    encoder.set_output_array(a);
    out.push_back(mx::array::unsafe_weak_copy(a));
  }
  encoder.dispatch([in = std::move(in),
                    out = std::move(out),
                    shape = shape_,
                    offset = offset_,
                    has_freqs = freqs_,
                    copy_keys = copy[1],
                    copy_values = copy[2]]() mutable {
    const fused::RowKernels& k = fused::chosen_rows();
    int D = in[0].shape(2);
    int heads = shape.heads, kv_heads = shape.kv_heads;
    int S = in[1].shape(2), dims = in[1].shape(3), value_dims = in[2].shape(3);
    int hidden = in[FIRST_LINEAR + 3 * GATE].shape(0);
    float* keys = out[1].data<float>();
    float* values = out[2].data<float>();
    auto started = std::chrono::steady_clock::now();
    if (copy_keys) {
      copy_cache(in[1], offset, keys);
      cache_copies++;
    }
    if (copy_values) {
      copy_cache(in[2], offset, values);
      cache_copies++;
    }
    std::vector<std::shared_ptr<std::vector<char>>> copies;
    auto data = [&](const mx::array& a) {
      return static_cast<const float*>(row_major(a, copies));
    };
    thread_local std::vector<float> room;
    const float* x = data(in[0]);
    const float* norms[2] = {data(in[3]), data(in[4])};
    // Scratch: h, q, k, v, rotated q, attention, x after attention, o, gate, up
    // and their product.
    int q_size = heads * dims, k_size = kv_heads * dims, v_size = kv_heads * value_dims;
    int a_size = heads * value_dims;
    room.resize(3 * size_t(D) + 2 * q_size + k_size + v_size + a_size + 3 * hidden);
    float* h = room.data();
    float* q = h + D;
    float* kk = q + q_size;
    float* vv = kk + k_size;
    float* qr = vv + v_size;
    float* attended = qr + q_size;
    float* mid = attended + a_size;
    float* o = mid + D;
    float* gate = o + D;
    float* up = gate + hidden;
    float* act = up + hidden;
    auto linear = [&](int i, const float* x_in, float* y) {
      int at = FIRST_LINEAR + 3 * i;
      return product(
          in[at], in[at + 1], in[at + 2], shape.group_sizes[i], shape.bits[i], x_in, 1,
          y, copies);
    };
    // Projections of one x in one run where they share bits and group size (as
    // mlx-lm's siblings do), else one at a time.
    auto run = [&](std::vector<Problem> ps) {
      bool shared = true;
      for (auto& p : ps) {
        shared = shared && p.bits == ps[0].bits && p.group_size == ps[0].group_size;
      }
      if (shared) {
        run_products(ps);
        return;
      }
      for (auto& p : ps) {
        std::vector<Problem> one = {p};
        run_products(one);
      }
    };

    k.rms_norm(x, norms[0], h, D, shape.attention_norm_eps);
    run({linear(Q, h, q), linear(K, h, kk), linear(V, h, vv)});
    const float* freqs = has_freqs ? data(in.back()) : nullptr;
    auto angles = fused::rope_angles(
        shape.rope_dims, shape.rope_base, shape.rope_scale, freqs, offset);
    for (int i = 0; i < heads; i++) {
      k.rope(
          q + i * dims, angles.cos, angles.sin, qr + i * dims, shape.rope_dims, dims,
          shape.rope_traditional);
    }
    for (int i = 0; i < kv_heads; i++) {
      k.rope(
          kk + i * dims, angles.cos, angles.sin,
          keys + (int64_t(i) * S + offset) * dims, shape.rope_dims, dims,
          shape.rope_traditional);
      std::memcpy(
          values + (int64_t(i) * S + offset) * value_dims, vv + i * value_dims,
          sizeof(float) * value_dims);
    }
    // Each kv head's query heads in one task, as CpuAttention's decode rows.
    int repeats = heads / kv_heads;
    double work = double(heads) * (offset + 1) * (dims + value_dims);
    run_tasks(kv_heads, work, [&](int kv) {
      thread_local std::vector<fused::AttentionRow> rows;
      thread_local std::vector<float> scratch;
      rows.clear();
      for (int i = kv * repeats; i < (kv + 1) * repeats; i++) {
        fused::AttentionRow row{};
        row.q = qr + i * dims;
        row.k = keys + int64_t(kv) * S * dims;
        row.v = values + int64_t(kv) * S * value_dims;
        row.k_stride = dims;
        row.v_stride = value_dims;
        row.dims = dims;
        row.value_dims = value_dims;
        row.keys = offset + 1;
        row.scale = shape.attention_scale;
        row.out = attended + i * value_dims;
        rows.push_back(row);
      }
      scratch.resize(fused::attention_rows_scratch(repeats, dims, value_dims));
      k.attention_rows(rows.data(), repeats, scratch.data());
    });
    run({linear(O, attended, o)});
    for (int i = 0; i < D; i++) {
      mid[i] = x[i] + o[i];
    }
    k.rms_norm(mid, norms[1], h, D, shape.mlp_norm_eps);
    run({linear(GATE, h, gate), linear(UP, h, up)});
    k.silu_mul(gate, up, act, hidden);
    run({linear(DOWN, act, o)});
    float* y = out[0].data<float>();
    for (int i = 0; i < D; i++) {
      y[i] = mid[i] + o[i];
    }
    std::chrono::duration<double, std::micro> took =
        std::chrono::steady_clock::now() - started;
    layer_us.store(int64_t(took.count()));
  });
}

void CpuDecodeLayer::eval_gpu(
    const std::vector<mx::array>&,
    std::vector<mx::array>&) {
  throw std::runtime_error("[CpuDecodeLayer] runs on the CPU only");
}

bool CpuDecodeLayer::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const CpuDecodeLayer&>(other);
  const DecodeLayerShape &a = shape_, &b = o.shape_;
  return offset_ == o.offset_ && freqs_ == o.freqs_ && a.heads == b.heads &&
      a.kv_heads == b.kv_heads && a.attention_scale == b.attention_scale &&
      a.rope_dims == b.rope_dims && a.rope_traditional == b.rope_traditional &&
      a.rope_base == b.rope_base && a.rope_scale == b.rope_scale &&
      a.attention_norm_eps == b.attention_norm_eps &&
      a.mlp_norm_eps == b.mlp_norm_eps && a.group_sizes == b.group_sizes &&
      a.bits == b.bits;
}

std::vector<mx::Shape> CpuDecodeLayer::output_shapes(
    const std::vector<mx::array>& inputs) {
  return {inputs[0].shape(), inputs[1].shape(), inputs[2].shape()};
}

} // namespace qmm
