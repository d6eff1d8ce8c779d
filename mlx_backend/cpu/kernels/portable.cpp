// The portable kernels: plain C++ that the compiler vectorizes for the target it
// builds for (NEON on aarch64). Used where no hand-written kernel applies.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "qmm.h"

namespace qmm {

namespace {

inline int weight_at(const uint32_t* row, int k, int bits) {
  int per_word = 32 / bits;
  uint32_t word = row[k / per_word];
  return (word >> ((k % per_word) * bits)) & ((1u << bits) - 1);
}

} // namespace

namespace {

template <typename T>
void quantize_to(const Problem& p, bool interleaved, T* xq, float* xd) {
  constexpr float top = std::numeric_limits<T>::max();
  int groups = p.K / p.group_size;
  for (int m = 0; m < p.M; m++) {
    for (int g = 0; g < groups; g++) {
      int k0 = g * p.group_size;
      const float* x = p.x + std::size_t(m) * p.K + k0;
      float amax = 0.0f;
      for (int k = 0; k < p.group_size; k++) {
        amax = std::max(amax, std::abs(x[k]));
      }
      float inverse = amax > 0.0f ? top / amax : 0.0f;
      xd[std::size_t(m) * groups + g] = amax / top;
      T* out = xq + std::size_t(m) * p.K + k0;
      for (int k = 0; k < p.group_size; k++) {
        int at = interleaved ? (k & ~31) + (k & 31) / 2 + (k & 1) * 16 : k;
        out[at] = T(std::lrint(x[k] * inverse));
      }
    }
  }
}

} // namespace

namespace {

// Block position j's value among its 32 (the order the int8 kernels meet the
// codes: for 4 bits, the even values then the odd ones).
inline int block_source(int j, int bits) {
  return bits == 4 ? (j < 16 ? 2 * j : 2 * (j - 16) + 1) : j;
}

// Block position j's code in a block of 32 weights.
inline int block_code(const uint8_t* block, int j, int bits) {
  if (bits == 8) {
    return block[j];
  }
  return j < 16 ? block[j] & 0x0f : block[j - 16] >> 4;
}

} // namespace

void quantize_rows(const Problem& p, bool interleaved, int16_t* xq, float* xd) {
  quantize_to(p, interleaved, xq, xd);
}

void quantize_int8(
    const Problem& p,
    int m0,
    int m1,
    int8_t* xq,
    float* xs,
    float* xsum) {
  int groups = p.K / p.group_size;
  for (int m = m0; m < m1; m++) {
    const float* x = p.x + std::size_t(m) * p.K;
    int8_t* q = xq + std::size_t(m) * p.K;
    float* scales = xs + std::size_t(m) * (p.K / p.x_block);
    float* sums = xsum + std::size_t(m) * groups;
    std::fill(sums, sums + groups, 0.0f);
    for (int k0 = 0; k0 < p.K; k0 += 32) {
      float block[32];
      for (int j = 0; j < 32; j++) {
        block[j] = x[k0 + block_source(j, p.bits)];
      }
      float total = 0.0f;
      for (int l = 0; l < 32 / p.x_block; l++) {
        int from = l * p.x_block;
        float amax = 0.0f;
        for (int i = from; i < from + p.x_block; i++) {
          amax = std::max(amax, std::abs(block[i]));
        }
        float scale = amax / 127.0f;
        float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int lane = 0;
        for (int i = from; i < from + p.x_block; i++) {
          q[k0 + i] = int8_t(std::lrint(block[i] * inverse));
          lane += q[k0 + i];
        }
        scales[(k0 + from) / p.x_block] = scale;
        total += scale * float(lane);
      }
      sums[k0 / p.group_size] += total;
    }
  }
}

void rows_portable_int8(const Problem& p, int n0, int n1) {
  int groups = p.K / p.group_size;
  std::vector<float> scales(groups), biases(groups);
  for (int n = n0; n < n1; n++) {
    scale_row(p, p.scales, n, scales.data());
    scale_row(p, p.biases, n, biases.data());
    auto row =
        reinterpret_cast<const uint8_t*>(p.w + std::size_t(n) * (p.K * p.bits / 32));
    for (int m = 0; m < p.M; m++) {
      const int8_t* q = static_cast<const int8_t*>(p.xq) + std::size_t(m) * p.K;
      const float* xs = p.xd + std::size_t(m) * (p.K / p.x_block);
      const float* xsum = p.xsum + std::size_t(m) * groups;
      float lanes[8] = {};
      for (int k0 = 0; k0 < p.K; k0 += 32) {
        const uint8_t* block = row + k0 * p.bits / 8;
        float scale = scales[k0 / p.group_size];
        for (int l = 0; l < 8; l++) {
          int dot = 0;
          for (int i = 4 * l; i < 4 * l + 4; i++) {
            dot += block_code(block, i, p.bits) * q[k0 + i];
          }
          lanes[l] += float(dot) * (xs[(k0 + 4 * l) / p.x_block] * scale);
        }
      }
      float y = 0.0f;
      for (int g = 0; g < groups; g++) {
        y += biases[g] * xsum[g];
      }
      for (float lane : lanes) {
        y += lane;
      }
      p.y[std::size_t(m) * p.N + n] = y;
    }
  }
}

void lane_order(const Problem& p, float* xl) {
  int per_word = 32 / p.bits;
  for (int m = 0; m < p.M; m++) {
    const float* x = p.x + std::size_t(m) * p.K;
    float* out = xl + std::size_t(m) * p.K;
    for (int k0 = 0; k0 < p.K; k0 += 8 * per_word) {
      int words = std::min(8, (p.K - k0) / per_word);
      for (int j = 0; j < words; j++) {
        for (int i = 0; i < per_word; i++) {
          out[k0 + i * words + j] = x[k0 + j * per_word + i];
        }
      }
    }
  }
}

void dequantize_portable(const Problem& p, int n0, int n1, float* out) {
  int groups = p.K / p.group_size;
  std::vector<float> scales(groups), biases(groups);
  for (int n = n0; n < n1; n++) {
    scale_row(p, p.scales, n, scales.data());
    scale_row(p, p.biases, n, biases.data());
    const uint32_t* row = p.w + std::size_t(n) * (p.K * p.bits / 32);
    float* dst = out + std::size_t(n - n0) * p.K;
    for (int k = 0; k < p.K; k++) {
      int g = k / p.group_size;
      dst[k] = scales[g] * float(weight_at(row, k, p.bits)) + biases[g];
    }
  }
}

void rows_portable(const Problem& p, int n0, int n1) {
  int groups = p.K / p.group_size;
  int per_word = 32 / p.bits;
  uint32_t mask = (1u << p.bits) - 1;
  std::vector<float> scaled(p.K), scales(groups), biases(groups);
  for (int n = n0; n < n1; n++) {
    // The biases meet x's group sums instead of each weight.
    scale_row(p, p.scales, n, scales.data());
    scale_row(p, p.biases, n, biases.data());
    const uint32_t* row = p.w + std::size_t(n) * (p.K / per_word);
    for (int k0 = 0; k0 < p.K; k0 += per_word) {
      uint32_t word = row[k0 / per_word];
      float scale = scales[k0 / p.group_size];
      for (int i = 0; i < per_word; i++) {
        scaled[k0 + i] = scale * float((word >> (i * p.bits)) & mask);
      }
    }
    for (int m = 0; m < p.M; m++) {
      const float* x = p.x + std::size_t(m) * p.K;
      const float* xsum = p.xsum + std::size_t(m) * groups;
      // Eight partial sums, so the compiler can vectorize the dot product.
      float partial[8] = {};
      for (int k = 0; k < p.K; k += 8) {
        for (int i = 0; i < 8; i++) {
          partial[i] += scaled[k + i] * x[k + i];
        }
      }
      float acc = 0.0f;
      for (int i = 0; i < 8; i++) {
        acc += partial[i];
      }
      for (int g = 0; g < groups; g++) {
        acc += biases[g] * xsum[g];
      }
      p.y[std::size_t(m) * p.N + n] = acc;
    }
  }
}

} // namespace qmm
