// The int8 row kernel: the weights' unsigned codes meet x rounded to int8 in
// integer dot products, 4 bytes into each int32 lane, and each lane's sum is
// converted and scaled once a block of 32 (x's scale for those 4 values times
// the weights' group scale). Written once, built for each instruction set by the
// file that includes it: QMM_DOT_AVX512VNNI (vpdpbusd on 256 bits, AVX512-VNNI
// with VL), QMM_DOT_AVXVNNI (AVX-VNNI's vpdpbusd) or neither (AVX2's maddubs and
// madd). It defines INT8_ROWS(const Problem&, int n0, int n1).
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
#include <vector>

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
constexpr bool RECENTRED_8BIT = false;

inline __m256i dot_bytes(__m256i w, __m256i x) {
#if defined(QMM_DOT_AVX512VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#endif
}
#else
// maddubs saturates a pair's sum at 32767: 4-bit codes can't reach it (2 * 15 *
// 127), 8-bit ones can, so those meet x as code - 128 (the biases take the 128),
// its magnitude unsigned and its sign moved onto x.
constexpr bool RECENTRED_8BIT = true;

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
    if constexpr (BITS == 8 && RECENTRED_8BIT) {
      __m256i centred = _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80)));
      __m256i magnitude = _mm256_abs_epi8(centred);
      for (int r = 0; r < ROWS; r++) {
        auto at = reinterpret_cast<const __m256i*>(xq[r] + 32 * b);
        __m256i x = _mm256_sign_epi8(_mm256_loadu_si256(at), centred);
        __m256i sums = dot_bytes(magnitude, x);
        __m256 lanes = _mm256_mul_ps(_mm256_loadu_ps(xs[r] + 8 * b), scale);
        total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), lanes, total[r]);
      }
    } else {
      for (int r = 0; r < ROWS; r++) {
        auto at = reinterpret_cast<const __m256i*>(xq[r] + 32 * b);
        __m256i sums = dot_bytes(w, _mm256_loadu_si256(at));
        __m256 lanes = _mm256_mul_ps(_mm256_loadu_ps(xs[r] + 8 * b), scale);
        total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), lanes, total[r]);
      }
    }
  }
  store_rows<ROWS>(p, n, m, total, biases);
}

template <int BITS>
void int8_rows(const Problem& p, int n0, int n1) {
  int groups = p.K / p.group_size;
  thread_local std::vector<float> scale_room, bias_room;
  scale_room.resize(groups + 8);
  bias_room.resize(groups + 8);
  // Plain pointers: a thread_local reached from the loop costs a TLS lookup a row.
  float* scales = scale_room.data();
  float* biases = bias_room.data();
  for (int n = n0; n < n1; n++) {
    load_scales(p, p.scales, n, scales);
    load_scales(p, p.biases, n, biases);
    if constexpr (BITS == 8 && RECENTRED_8BIT) {
      for (int g = 0; g < groups; g++) {
        biases[g] += 128.0f * scales[g];
      }
    }
    int m = 0;
    for (; m + 4 <= p.M; m += 4) {
      int8_tile<BITS, 4>(p, n, m, scales, biases);
    }
    switch (p.M - m) {
      case 3:
        int8_tile<BITS, 3>(p, n, m, scales, biases);
        break;
      case 2:
        int8_tile<BITS, 2>(p, n, m, scales, biases);
        break;
      case 1:
        int8_tile<BITS, 1>(p, n, m, scales, biases);
        break;
    }
  }
}

} // namespace

void INT8_ROWS(const Problem& p, int n0, int n1) {
  if (p.bits == 4) {
    int8_rows<4>(p, n0, n1);
  } else {
    int8_rows<8>(p, n0, n1);
  }
}

} // namespace qmm
