// The row kernels' code, included once per instruction set by a file that names
// it (FUSED_ISA) and builds with that set's flags.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "fused_rows.h"

#ifndef FUSED_ISA
#error "define FUSED_ISA before including fused_rows_impl.h"
#endif

namespace qmm::fused::FUSED_ISA {

namespace {

// Lanes of the accumulators: two AVX2 vectors, four SSE ones.
constexpr int LANES = 16;

inline float lanes_total(const float* acc) {
  float t[LANES / 2];
  for (int l = 0; l < LANES / 2; l++) {
    t[l] = acc[l] + acc[l + LANES / 2];
  }
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

inline float dot(const float* a, const float* b, int n) {
  float acc[LANES] = {};
  int i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; l++) {
      acc[l] += a[i + l] * b[i + l];
    }
  }
  float tail = 0.0f;
  for (; i < n; i++) {
    tail += a[i] * b[i];
  }
  return lanes_total(acc) + tail;
}

inline float sum_of_squares(const float* a, int n) {
  return dot(a, a, n);
}

inline float sum(const float* a, int n) {
  float acc[LANES] = {};
  int i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; l++) {
      acc[l] += a[i + l];
    }
  }
  float tail = 0.0f;
  for (; i < n; i++) {
    tail += a[i];
  }
  return lanes_total(acc) + tail;
}

// exp(x) as MLX's CPU kernels compute it (Cephes' polynomial for 2^fraction),
// without branches, so the loops that call it vectorize.
inline float exp_lane(float x) {
  float y = x * 1.442695f;
  float whole = std::floor(y + 0.5f);
  float f = y - whole;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  // Clamped so the exponent stays a normal float's; the selects below decide.
  int e = int(std::min(std::max(whole, -127.0f), 128.0f)) + 127;
  uint32_t bits = uint32_t(e) << 23;
  float two;
  std::memcpy(&two, &bits, sizeof(two));
  float r = p * two;
  r = x > 88.0f ? std::numeric_limits<float>::infinity() : r;
  return x < -88.0f ? 0.0f : r;
}

// s[j] = exp(s[j] - top); their sum.
inline float exp_shifted(float* s, int n, float top) {
  float acc[LANES] = {};
  int i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; l++) {
      float e = exp_lane(s[i + l] - top);
      s[i + l] = e;
      acc[l] += e;
    }
  }
  float tail = 0.0f;
  for (; i < n; i++) {
    s[i] = exp_lane(s[i] - top);
    tail += s[i];
  }
  return lanes_total(acc) + tail;
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int n) {
  for (int i = 0; i < n; i++) {
    y[i] += a * x[i];
  }
}

void rms_norm(const float* x, const float* w, float* y, int n, float eps) {
  float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / float(n) + eps);
  if (w == nullptr) {
    for (int i = 0; i < n; i++) {
      y[i] = x[i] * inv;
    }
    return;
  }
  for (int i = 0; i < n; i++) {
    y[i] = (x[i] * inv) * w[i];
  }
}

void layer_norm(
    const float* x,
    const float* w,
    const float* b,
    float* y,
    int n,
    float eps) {
  float mean = sum(x, n) / float(n);
  for (int i = 0; i < n; i++) {
    y[i] = x[i] - mean;
  }
  float inv = 1.0f / std::sqrt(sum_of_squares(y, n) / float(n) + eps);
  for (int i = 0; i < n; i++) {
    y[i] *= inv;
  }
  if (w != nullptr) {
    for (int i = 0; i < n; i++) {
      y[i] *= w[i];
    }
  }
  if (b != nullptr) {
    for (int i = 0; i < n; i++) {
      y[i] += b[i];
    }
  }
}

void rope(
    const float* x,
    const float* c,
    const float* s,
    float* y,
    int dims,
    int n,
    bool traditional) {
  int half = dims / 2;
  if (traditional) {
    for (int i = 0; i < half; i++) {
      float a = x[2 * i];
      float b = x[2 * i + 1];
      y[2 * i] = a * c[i] - b * s[i];
      y[2 * i + 1] = a * s[i] + b * c[i];
    }
  } else {
    for (int i = 0; i < half; i++) {
      float a = x[i];
      float b = x[i + half];
      y[i] = a * c[i] - b * s[i];
      y[i + half] = a * s[i] + b * c[i];
    }
  }
  for (int i = dims; i < n; i++) {
    y[i] = x[i];
  }
}

void attention(const AttentionRow& r, float* scores) {
  // What MLX writes for a masked-out score: a row that masks every key then
  // averages them all, as MLX's softmax does.
  constexpr float masked = std::numeric_limits<float>::lowest();
  float top = r.has_sink ? r.sink : masked;
  for (int j = 0; j < r.keys; j++) {
    float score = dot(r.q, r.k + j * r.k_stride, r.dims) * r.scale;
    if (r.keep != nullptr) {
      score = r.keep[j * r.mask_stride] ? score : masked;
    } else if (r.bias != nullptr) {
      score += r.bias[j * r.mask_stride];
    }
    scores[j] = score;
    top = std::max(top, score);
  }
  float total = exp_shifted(scores, r.keys, top);
  if (r.has_sink) {
    total += exp_lane(r.sink - top);
  }
  std::fill(r.out, r.out + r.value_dims, 0.0f);
  for (int j = 0; j < r.keys; j++) {
    if (scores[j] != 0.0f) {
      axpy(scores[j], r.v + j * r.v_stride, r.out, r.value_dims);
    }
  }
  float inv = 1.0f / total;
  for (int i = 0; i < r.value_dims; i++) {
    r.out[i] *= inv;
  }
}

} // namespace

RowKernels rows() {
  return {FUSED_ISA_NAME, rms_norm, layer_norm, rope, attention};
}

} // namespace qmm::fused::FUSED_ISA
