// Quantized matmul kernels for the CPU: y = x @ dequantize(w).T with MLX's affine
// layout (w: [N, K * bits / 32] uint32, scales and biases: [N, K / group_size]).
#pragma once

#include <cstddef>
#include <cstdint>

namespace qmm {

enum class ScaleType { f32, f16, bf16 };

struct Problem {
  const float* x; // [M, K], row-major
  const float* xsum; // [M, K / group_size]: x summed over each group
  // x quantized for the integer kernels: values [M, K] in the order the kernel
  // reads them, and their scales: int16's one a group [M, K / group_size],
  // int8's one per x_block values [M, K / x_block] (quantize_int8: 4 for the
  // row kernels, 32 for the GEMM).
  const void* xq;
  const float* xd;
  int x_block;
  // x [M, K] in the lane order of the weights' words (lane_order), for the float
  // row kernels that read it so.
  const float* xl;
  const uint32_t* w;
  const void* scales;
  const void* biases;
  float* y; // [M, N]
  int M;
  int N;
  int K;
  int bits;
  int group_size;
  ScaleType scale_type;
};

// y[:, n0:n1] for every row of x, reading each weight once.
using RowsKernel = void (*)(const Problem&, int n0, int n1);
// Rows n0..n1 of the dequantized weight, as float32 [n1 - n0, K].
using DequantizeKernel = void (*)(const Problem&, int n0, int n1, float* out);

void rows_portable(const Problem& p, int n0, int n1);
// The int8 kernels' arithmetic in plain C++, for x quantized with any x_block:
// the reference of the row kernels and of the GEMM.
void rows_portable_int8(const Problem& p, int n0, int n1);
void dequantize_portable(const Problem& p, int n0, int n1, float* out);

// x quantized per group to int16 for the int16 kernel; `interleaved` puts each 32
// values as [even ones, odd ones], the order of 4-bit weights' low and high nibbles.
void quantize_rows(const Problem& p, bool interleaved, int16_t* xq, float* xd);

// Rows m0..m1 of x rounded to int8 for the int8 kernels: each block of 32 in the
// order the kernels meet the weights' codes (4 bits: its even values, then its odd
// ones), a scale per p.x_block of those (4 for the row kernels, each int32 lane of
// a dot product summing 4; 32 for the GEMM), and each group's sum of the rounded
// values into `xsum` (which the biases meet).
void quantize_int8(
    const Problem& p,
    int m0,
    int m1,
    int8_t* xq,
    float* xs,
    float* xsum);
using QuantizeKernel =
    void (*)(const Problem&, int m0, int m1, int8_t*, float*, float*);

// x's rows in the order a vector of 8 weight words holds its weights: in each
// block of 8 words, field i of word j at [i * 8 + j] (a last block of 4 words at
// [i * 4 + j]), so that shifting and masking the words yields x's order.
void lane_order(const Problem& p, float* xl);

#if defined(__x86_64__)
void rows_avx2_int8(const Problem& p, int n0, int n1);
void rows_avxvnni_int8(const Problem& p, int n0, int n1);
void rows_avx512vnni_int8(const Problem& p, int n0, int n1);
// quantize_int8 on AVX2 (int8_avx2.cpp), for every x86 int8 kernel.
void quantize_int8_avx2(
    const Problem& p,
    int m0,
    int m1,
    int8_t* xq,
    float* xs,
    float* xsum);
// The int8 GEMM (int8_gemm_impl.h): every row of x at once, x_block 4 or 8.
void gemm_avx2_int8(const Problem& p, int n0, int n1);
void gemm_avxvnni_int8(const Problem& p, int n0, int n1);
void gemm_avx512vnni_int8(const Problem& p, int n0, int n1);
void rows_avx2_int16(const Problem& p, int n0, int n1);
void rows_avx2(const Problem& p, int n0, int n1);
void dequantize_avx2(const Problem& p, int n0, int n1, float* out);
#endif

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000 | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    // Subnormal: normalize the mantissa.
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      exponent--;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

inline float bfloat_to_float(uint16_t b) {
  uint32_t bits = uint32_t(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// Row n's scales (or biases) as float32.
inline void scale_row(const Problem& p, const void* base, int n, float* out) {
  int groups = p.K / p.group_size;
  std::size_t offset = std::size_t(n) * groups;
  switch (p.scale_type) {
    case ScaleType::f32: {
      auto row = static_cast<const float*>(base) + offset;
      for (int g = 0; g < groups; g++) {
        out[g] = row[g];
      }
      break;
    }
    case ScaleType::f16: {
      auto row = static_cast<const uint16_t*>(base) + offset;
      for (int g = 0; g < groups; g++) {
        out[g] = half_to_float(row[g]);
      }
      break;
    }
    case ScaleType::bf16: {
      auto row = static_cast<const uint16_t*>(base) + offset;
      for (int g = 0; g < groups; g++) {
        out[g] = bfloat_to_float(row[g]);
      }
      break;
    }
  }
}

} // namespace qmm
