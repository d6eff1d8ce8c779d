// The int8 row kernel: the weights' unsigned codes meet x rounded to int8 in
// integer dot products, 4 bytes into each int32 lane, and each lane's sum is
// converted and scaled once a block of 32 (x's scale for those 4 values times
// the weights' group scale). Written once, built for each instruction set by the
// file that includes it: QMM_DOT_AVX512VNNI (vpdpbusd on 256 bits, AVX512-VNNI
// with VL), QMM_DOT_AVXVNNI (AVX-VNNI's vpdpbusd) or neither (AVX2's maddubs and
// madd, for 4-bit codes). It defines INT8_ROWS(const Problem&, int n0, int n1).
// Weight rows go 8 at a time (int8_eight), 4-bit ones against 2 rows of x at a
// time, 8-bit ones against one row of x; a few rows meet 8-bit weights, and the
// weight rows left over, one weight row at a time (int8_tile). From 4 rows of x
// on, compute() sends products to the int8 GEMM (int8_gemm_impl.h).
//
// x comes as quantize_int8 leaves it (qmm.h): int8 values in the order the
// kernel meets the weights (a 4-bit block's even values, then its odd ones),
// a scale per 4 of them, and each group's sum of the rounded values, which the
// biases meet. That sum, not x's exact one, cancels the error that rounding x
// adds through the codes' offset (they are all positive): with the exact sum a
// 4-bit product moved three times as far.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "avx2_common.h"
#include "qmm.h"

namespace qmm {

namespace {

// 32 consecutive weights' codes as bytes: a 4-bit block's low nibbles (its even
// weights) then its high ones (the odd), an 8-bit block as stored.
template <int BITS>
inline __m256i code_bytes(const uint32_t* packed) {
  if constexpr (BITS == 4) {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
  }
}

#if defined(QMM_DOT_AVX512VNNI) || defined(QMM_DOT_AVXVNNI)
// Unsigned codes of any width times signed x, four into each int32 lane.
constexpr bool DOTS_8BIT = true;

inline __m256i dot_bytes(__m256i w, __m256i x) {
#if defined(QMM_DOT_AVX512VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#endif
}
#else
// maddubs saturates a pair's sum at 32767: 4-bit codes can't reach it (2 * 15 *
// 127), 8-bit ones can. Recentred to code - 128 (the bias taking the 128), a decode
// row of 8-bit weights took 1.29x the float32 kernel's time: they stay on that one
// (Kernels::int8_for_8bit).
constexpr bool DOTS_8BIT = false;

inline __m256i dot_bytes(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
#endif

template <int BITS, int ROWS>
inline void int8_tile(
    const Problem& p,
    int n,
    int m,
    const float* scales,
    const float* biases) {
  int blocks = p.K / 32;
  int shift = __builtin_ctz(p.group_size / 32);
  const uint32_t* packed = p.w + std::size_t(n) * (p.K * BITS / 32);
  const int8_t* xq[ROWS];
  const float* xs[ROWS];
  __m256 total[ROWS];
  for (int r = 0; r < ROWS; r++) {
    xq[r] = static_cast<const int8_t*>(p.xq) + std::size_t(m + r) * p.K;
    xs[r] = p.xd + std::size_t(m + r) * (p.K / 4);
    total[r] = _mm256_setzero_ps();
  }
  for (int b = 0; b < blocks; b++, packed += BITS) {
    // A cache line's weights: 4 blocks of 4 bits, 2 of 8.
    if ((b & (16 / BITS - 1)) == 0) {
      fetch_ahead(packed);
    }
    __m256i w = code_bytes<BITS>(packed);
    __m256 scale = _mm256_set1_ps(scales[b >> shift]);
    for (int r = 0; r < ROWS; r++) {
      auto at = reinterpret_cast<const __m256i*>(xq[r] + 32 * b);
      __m256i sums = dot_bytes(w, _mm256_loadu_si256(at));
      __m256 lanes = _mm256_mul_ps(_mm256_loadu_ps(xs[r] + 8 * b), scale);
      total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), lanes, total[r]);
    }
  }
  store_rows<ROWS>(p, n, m, total, biases);
}

template <ScaleType ST>
constexpr int esize() {
  return ST == ScaleType::f32 ? 4 : 2;
}

// A row's biases met with x's group sums, read where they are stored (ST).
template <ScaleType ST>
inline float bias_dot(const void* biases, const float* xsum, int groups) {
  __m256 dot = _mm256_setzero_ps();
  int g = 0;
  for (; g + 8 <= groups; g += 8) {
    dot = _mm256_fmadd_ps(eight_values<ST>(biases, g), _mm256_loadu_ps(xsum + g), dot);
  }
  float tail = 0.0f;
  for (; g < groups; g++) {
    tail += _mm_cvtss_f32(two_values<ST>(biases, g, g)) * xsum[g];
  }
  return horizontal_sum(dot) + tail;
}

// R rows of x (m..m + R) against weight rows n..n + 8 (a lone stream's decode,
// R = 1; a few rows, 2 at a time for 4 bits): two rows' 4-bit codes share a
// vector (and each unpacked vector serves the R rows of x), the rows are read
// in order, and each row's lanes stay apart until one reduction for the 8
// (hadd). The scales and biases are read where they are stored (ST),
// `stride_bytes` a row.
template <int BITS, ScaleType ST, int R>
inline void int8_eight(const Problem& p, int n, int m, std::size_t stride_bytes) {
  static_assert(BITS == 4 || R == 1, "8-bit codes meet one row of x at a time");
  int blocks = p.K / 32;
  int groups = p.K / p.group_size;
  const char* scales = static_cast<const char*>(p.scales) + n * stride_bytes;
  const char* biases = static_cast<const char*>(p.biases) + n * stride_bytes;
  int shift = __builtin_ctz(p.group_size / 32);
  std::size_t stride = std::size_t(p.K) * BITS / 32;
  const uint32_t* rows[8];
  for (int i = 0; i < 8; i++) {
    rows[i] = p.w + std::size_t(n + i) * stride;
  }
  // Each row fetches its place in the next 8 rows, which the loads of these 8
  // have not reached (a fixed 2 KB ahead fell inside them for short rows, and
  // decode rows took about 8% longer).
  std::size_t ahead = 8 * stride * sizeof(uint32_t);
  const int8_t* xq[R];
  const float* xs[R];
  for (int r = 0; r < R; r++) {
    xq[r] = static_cast<const int8_t*>(p.xq) + std::size_t(m + r) * p.K;
    xs[r] = p.xd + std::size_t(m + r) * (p.K / 4);
  }
  // Per row of x: four accumulators of two weight rows each (rows 2j | 2j + 1),
  // or (8 bits) 8 of one row.
  __m256 total[R][8];
  for (int r = 0; r < R; r++) {
    for (int i = 0; i < 8; i++) {
      total[r][i] = _mm256_setzero_ps();
    }
  }
  // Weight rows one pair (4 bits) or one row (8 bits) at a time over all their
  // blocks, so that the weights are read in order: the 8 rows block by block, x
  // loaded once for them, read 8-bit weights at 9-11 GB/s a thread on a Zen 4
  // (sequential reads: 23-25), and decoded 1.28x slower.
  if constexpr (BITS == 4) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; j++) {
      const uint32_t* first = rows[2 * j];
      const uint32_t* second = rows[2 * j + 1];
      const char* row = scales + 2 * j * stride_bytes;
      for (int b = 0; b < blocks; b++) {
        int g = b >> shift;
        if ((b & 3) == 0) {
          fetch_ahead(first + 4 * b, ahead);
          fetch_ahead(second + 4 * b, ahead);
        }
        __m256i codes = _mm256_loadu2_m128i(
            reinterpret_cast<const __m128i*>(second + 4 * b),
            reinterpret_cast<const __m128i*>(first + 4 * b));
        __m256i low = _mm256_and_si256(codes, mask);
        __m256i high = _mm256_and_si256(_mm256_srli_epi16(codes, 4), mask);
        // Row 2j's scale in the low lanes, row 2j + 1's in the high.
        __m128 two = two_values<ST>(row, g, g + int(stride_bytes / esize<ST>()));
        __m256 pair = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
        for (int r = 0; r < R; r++) {
          auto x = reinterpret_cast<const __m128i*>(xq[r] + 32 * b);
          __m256i even_x = _mm256_broadcastsi128_si256(_mm_loadu_si128(x));
          __m256i odd_x = _mm256_broadcastsi128_si256(_mm_loadu_si128(x + 1));
          auto lane_scales = reinterpret_cast<const __m128*>(xs[r] + 8 * b);
          __m256 even_lanes = _mm256_broadcast_ps(lane_scales);
          __m256 odd_lanes = _mm256_broadcast_ps(lane_scales + 1);
          __m256i even = dot_bytes(low, even_x);
          __m256i odd = dot_bytes(high, odd_x);
          total[r][j] = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(even), _mm256_mul_ps(even_lanes, pair), total[r][j]);
          total[r][j] = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(odd), _mm256_mul_ps(odd_lanes, pair), total[r][j]);
        }
      }
    }
  } else {
    for (int i = 0; i < 8; i++) {
      for (int b = 0; b < blocks; b++) {
        int g = b >> shift;
        if ((b & 1) == 0) {
          fetch_ahead(rows[i] + 8 * b, ahead);
        }
        __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[0] + 32 * b));
        __m256 lanes = _mm256_loadu_ps(xs[0] + 8 * b);
        __m256i codes =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + 8 * b));
        __m256i sums = dot_bytes(codes, x);
        __m128 one = two_values<ST>(scales + i * stride_bytes, g, g);
        __m256 scale = _mm256_mul_ps(lanes, _mm256_broadcastss_ps(one));
        total[0][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, total[0][i]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    // Each row's sum: its lanes, halves of a vector for 4 bits, added in a tree.
    __m256 sums;
    const __m256* t = total[r];
    if constexpr (BITS == 4) {
      // Rows 0, 2, 4, 6 | 1, 3, 5, 7.
      __m256 mixed =
          _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
      sums = _mm256_permutevar8x32_ps(mixed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    } else {
      // Rows 0-3 | the same rows' upper lanes, then rows 4-7.
      __m256 low =
          _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
      __m256 high =
          _mm256_hadd_ps(_mm256_hadd_ps(t[4], t[5]), _mm256_hadd_ps(t[6], t[7]));
      sums = _mm256_add_ps(
          _mm256_permute2f128_ps(low, high, 0x20),
          _mm256_permute2f128_ps(low, high, 0x31));
    }
    // The biases meet the groups' sums of the rounded x.
    const float* xsum = p.xsum + std::size_t(m + r) * groups;
    alignas(32) float bias[8];
    for (int i = 0; i < 8; i++) {
      bias[i] = bias_dot<ST>(biases + i * stride_bytes, xsum, groups);
    }
    float* y = p.y + std::size_t(m + r) * p.N + n;
    _mm256_storeu_ps(y, _mm256_add_ps(sums, _mm256_load_ps(bias)));
  }
}

// Weight rows n..n + 8 against rows m..m + R of x, the scales' type dispatched.
template <int BITS, int R>
inline void int8_eight_rows(const Problem& p, int n, int m, std::size_t row_bytes) {
  switch (p.scale_type) {
    case ScaleType::f32:
      return int8_eight<BITS, ScaleType::f32, R>(p, n, m, row_bytes);
    case ScaleType::f16:
      return int8_eight<BITS, ScaleType::f16, R>(p, n, m, row_bytes);
    case ScaleType::bf16:
      return int8_eight<BITS, ScaleType::bf16, R>(p, n, m, row_bytes);
  }
}

template <int BITS>
void int8_rows(const Problem& p, int n0, int n1) {
  int groups = p.K / p.group_size;
  auto [scales, biases] = row_scale_room(groups);
  // 8-bit codes meet several rows of x one weight row at a time (below): 8
  // weight rows a row of x at a time took 1.35x the float32 kernel's time at 4
  // and 16 rows.
  if (BITS == 4 || p.M == 1) {
    // Weight rows 8 at a time, against the rows of x two at a time (each
    // unpacked vector of 4-bit codes serves both; the leftover weight rows
    // below, one at a time).
    int bytes = p.scale_type == ScaleType::f32 ? 4 : 2;
    std::size_t row_bytes = std::size_t(groups) * bytes;
    for (; n0 + 8 <= n1; n0 += 8) {
      int m = 0;
      if constexpr (BITS == 4) {
        for (; m + 2 <= p.M; m += 2) {
          int8_eight_rows<BITS, 2>(p, n0, m, row_bytes);
        }
      }
      for (; m < p.M; m++) {
        int8_eight_rows<BITS, 1>(p, n0, m, row_bytes);
      }
    }
  }
  for (int n = n0; n < n1; n++) {
    load_scales(p, p.scales, n, scales);
    load_scales(p, p.biases, n, biases);
    x_tiles(0, p.M, [&]<int ROWS>(int m) {
      int8_tile<BITS, ROWS>(p, n, m, scales, biases);
    });
  }
}

} // namespace

void INT8_ROWS(const Problem& p, int n0, int n1) {
  if (p.x_block != 4) {
    throw std::logic_error("[quantized_matmul] the int8 row kernels take x_block 4");
  }
  if (p.bits == 4) {
    int8_rows<4>(p, n0, n1);
  } else if constexpr (DOTS_8BIT) {
    int8_rows<8>(p, n0, n1);
  } else {
    throw std::logic_error("[quantized_matmul] 8-bit weights take the float32 kernel");
  }
}

} // namespace qmm
