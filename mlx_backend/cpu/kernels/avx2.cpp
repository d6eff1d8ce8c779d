// x86-64 kernels for AVX2 with FMA and F16C (built with those flags; called only
// when the CPU has them).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "avx2_common.h"
#include "qmm.h"

namespace qmm {

namespace {

// 32 consecutive weights, from bits * 4 bytes at `packed`, as four float vectors.
template <int BITS>
inline void unpack32(const uint32_t* packed, __m256 q[4]) {
  if constexpr (BITS == 4) {
    // Byte b holds weight 2b in its low nibble and 2b + 1 in its high one.
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
    __m128i mask = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    __m128i first = _mm_unpacklo_epi8(lo, hi);
    __m128i second = _mm_unpackhi_epi8(lo, hi);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
  } else {
    auto bytes = reinterpret_cast<const __m128i*>(packed);
    __m128i first = _mm_loadu_si128(bytes);
    __m128i second = _mm_loadu_si128(bytes + 1);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
  }
}

// The scales of a block's lanes: a 4-bit block's first 4 words are one group's
// 32 weights and its last 4 the next 32 (the same group from 64 on); an 8-bit
// block is one group.
template <int BITS, ScaleType ST>
inline __m256 block_scales(const void* row, int k0, int shift) {
  int second = BITS == 4 ? (k0 + 32) >> shift : k0 >> shift;
  __m128 two = two_values<ST>(row, k0 >> shift, second);
  return _mm256_permutevar8x32_ps(
      _mm256_castps128_ps256(two), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// Field i of each of 8 words (a vector of 8 words holds 8 weights a word for
// 4 bits, 4 for 8) as floats: a shift and a mask, neither where not needed.
template <int BITS>
inline __m256 word_field(__m256i words, int i) {
  __m256i field = i == 0 ? words : _mm256_srli_epi32(words, i * BITS);
  if (i != 32 / BITS - 1) {
    field = _mm256_and_si256(field, _mm256_set1_epi32((1 << BITS) - 1));
  }
  return _mm256_cvtepi32_ps(field);
}

// The last 4 words of a 4-bit row whose length is an odd number of 32s, against
// x from column k0: their scaled sum, in the low half.
template <int BITS, ScaleType ST>
inline __m256 tail_block(
    const uint32_t* w,
    const float* x,
    const void* scales,
    int k0,
    int shift) {
  __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  __m128i mask = _mm_set1_epi32((1 << BITS) - 1);
  __m128 acc = _mm_setzero_ps();
  for (int i = 0; i < 32 / BITS; i++) {
    __m128i field = _mm_and_si128(_mm_srli_epi32(words, i * BITS), mask);
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(field), _mm_loadu_ps(x + k0 + 4 * i), acc);
  }
  __m128 scale = _mm_broadcastss_ps(two_values<ST>(scales, k0 >> shift, 0));
  return _mm256_zextps128_ps256(_mm_mul_ps(acc, scale));
}

// ROWS rows of x (from row m, in lane order) against weight row n. A vector of 8
// words holds 8 weights a word (4-bit) or 4 (8-bit); shifting and masking it gives
// one field of every word, met by x's matching lanes: no shuffles. Each block's
// sums are scaled per lane (its words' groups), and the biases meet x's exact
// group sums.
template <int BITS, int ROWS, ScaleType ST>
inline void rows_tile(
    const Problem& p,
    int n,
    int m,
    const void* scales,
    const void* biases) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr int BLOCK = 8 * PER_WORD;
  // Group sizes are powers of two (simd_shape): a shift, not a division, per block.
  const int shift = __builtin_ctz(p.group_size);
  const uint32_t* w = p.w + std::size_t(n) * (p.K / PER_WORD);
  const float* x[ROWS];
  __m256 total[ROWS];
  for (int r = 0; r < ROWS; r++) {
    x[r] = p.xl + std::size_t(m + r) * p.K;
    total[r] = _mm256_setzero_ps();
  }
  int k0 = 0;
  for (; k0 + BLOCK <= p.K; k0 += BLOCK, w += 8) {
    fetch_ahead(w);
    __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    // Two chains a row, so that enough FMAs are in flight to hide their latency.
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
#pragma GCC unroll 8
    for (int i = 0; i < PER_WORD; i++) {
      __m256 q = word_field<BITS>(words, i);
      for (int r = 0; r < ROWS; r++) {
        acc[r][i & 1] =
            _mm256_fmadd_ps(q, _mm256_loadu_ps(x[r] + k0 + 8 * i), acc[r][i & 1]);
      }
    }
    __m256 scale = block_scales<BITS, ST>(scales, k0, shift);
    for (int r = 0; r < ROWS; r++) {
      total[r] =
          _mm256_fmadd_ps(_mm256_add_ps(acc[r][0], acc[r][1]), scale, total[r]);
    }
  }
  if (k0 < p.K) {
    for (int r = 0; r < ROWS; r++) {
      __m256 tail = tail_block<BITS, ST>(w, x[r], scales, k0, shift);
      total[r] = _mm256_add_ps(total[r], tail);
    }
  }
  store_rows<ROWS, ST>(p, n, m, total, biases);
}

// One row of x (row m) against weight rows n and n + 1, whose scales and biases
// are `stride` bytes apart: the two rows share each load of x.
template <int BITS, ScaleType ST>
inline void rows_pair(
    const Problem& p,
    int n,
    int m,
    const char* scales,
    const char* biases,
    std::size_t stride) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr int BLOCK = 8 * PER_WORD;
  const int shift = __builtin_ctz(p.group_size);
  const uint32_t* w0 = p.w + std::size_t(n) * (p.K / PER_WORD);
  const uint32_t* w1 = w0 + p.K / PER_WORD;
  const float* x = p.xl + std::size_t(m) * p.K;
  __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  int k0 = 0;
  for (; k0 + BLOCK <= p.K; k0 += BLOCK, w0 += 8, w1 += 8) {
    fetch_ahead(w0);
    fetch_ahead(w1);
    __m256i words0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0));
    __m256i words1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1));
    // Two chains a row, as in rows_tile: the same sums in the same order.
    __m256 acc[2][2];
    acc[0][0] = acc[0][1] = acc[1][0] = acc[1][1] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < PER_WORD; i++) {
      __m256 xv = _mm256_loadu_ps(x + k0 + 8 * i);
      acc[0][i & 1] = _mm256_fmadd_ps(word_field<BITS>(words0, i), xv, acc[0][i & 1]);
      acc[1][i & 1] = _mm256_fmadd_ps(word_field<BITS>(words1, i), xv, acc[1][i & 1]);
    }
    for (int j = 0; j < 2; j++) {
      __m256 scale = block_scales<BITS, ST>(scales + j * stride, k0, shift);
      total[j] =
          _mm256_fmadd_ps(_mm256_add_ps(acc[j][0], acc[j][1]), scale, total[j]);
    }
  }
  if (k0 < p.K) {
    __m256 tail0 = tail_block<BITS, ST>(w0, x, scales, k0, shift);
    __m256 tail1 = tail_block<BITS, ST>(w1, x, scales + stride, k0, shift);
    total[0] = _mm256_add_ps(total[0], tail0);
    total[1] = _mm256_add_ps(total[1], tail1);
  }
  store_rows<1, ST>(p, n, m, total, biases);
  store_rows<1, ST>(p, n + 1, m, total + 1, biases + stride);
}

// WIDE rows of x against weight row n over columns [k0, k1) (whole blocks, or to
// K), into their running totals: for batches. Each field is scaled once, shared by
// all the rows, and meets every row straight into its total, so a block costs one
// conversion for the 8 rows and no per-row reduction.
template <int BITS, int WIDE, ScaleType ST>
inline void rows_tile_wide(
    const Problem& p,
    int n,
    int m,
    int k0,
    int k1,
    const void* scales,
    __m256 total[WIDE]) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr int BLOCK = 8 * PER_WORD;
  const int shift = __builtin_ctz(p.group_size);
  const uint32_t* w = p.w + std::size_t(n) * (p.K / PER_WORD) + k0 / PER_WORD;
  const float* x[WIDE];
  for (int r = 0; r < WIDE; r++) {
    x[r] = p.xl + std::size_t(m + r) * p.K;
  }
  for (; k0 + BLOCK <= k1; k0 += BLOCK, w += 8) {
    fetch_ahead(w);
    __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    __m256 scale = block_scales<BITS, ST>(scales, k0, shift);
#pragma GCC unroll 8
    for (int i = 0; i < PER_WORD; i++) {
      __m256 q = _mm256_mul_ps(word_field<BITS>(words, i), scale);
      for (int r = 0; r < WIDE; r++) {
        total[r] = _mm256_fmadd_ps(q, _mm256_loadu_ps(x[r] + k0 + 8 * i), total[r]);
      }
    }
  }
  if (k0 < k1) {
    for (int r = 0; r < WIDE; r++) {
      __m256 tail = tail_block<BITS, ST>(w, x[r], scales, k0, shift);
      total[r] = _mm256_add_ps(total[r], tail);
    }
  }
}

// The int16 kernel: weights widened to int16 meet x rounded to int16 per group in
// vpmaddwd (16 products a step); a group's int32 sums can't overflow (at most
// 255 * 32767 * 2 * 8 per lane for 128 8-bit weights).
template <int BITS, int ROWS>
inline void rows_tile_int16(
    const Problem& p,
    int n,
    int m,
    const float* scales,
    const float* biases) {
  int groups = p.K / p.group_size;
  int chunks = p.group_size / 32;
  const uint32_t* packed = p.w + std::size_t(n) * (p.K * BITS / 32);
  const int16_t* xq[ROWS];
  const float* xd[ROWS];
  __m256 total[ROWS];
  for (int r = 0; r < ROWS; r++) {
    xq[r] = static_cast<const int16_t*>(p.xq) + std::size_t(m + r) * p.K;
    xd[r] = p.xd + std::size_t(m + r) * groups;
    total[r] = _mm256_setzero_ps();
  }
  for (int g = 0; g < groups; g++) {
    __m256i acc[ROWS];
    for (int r = 0; r < ROWS; r++) {
      acc[r] = _mm256_setzero_si256();
    }
    for (int c = 0; c < chunks; c++, packed += BITS) {
      // First and second 16 weights as int16, in the order x was put in.
      __m256i first, second;
      if constexpr (BITS == 4) {
        __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
        __m128i mask = _mm_set1_epi8(0x0f);
        first = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
        second = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
      } else {
        auto bytes = reinterpret_cast<const __m128i*>(packed);
        first = _mm256_cvtepu8_epi16(_mm_loadu_si128(bytes));
        second = _mm256_cvtepu8_epi16(_mm_loadu_si128(bytes + 1));
      }
      int k = (g * chunks + c) * 32;
      for (int r = 0; r < ROWS; r++) {
        auto x = reinterpret_cast<const __m256i*>(xq[r] + k);
        __m256i sums = _mm256_add_epi32(
            _mm256_madd_epi16(first, _mm256_loadu_si256(x)),
            _mm256_madd_epi16(second, _mm256_loadu_si256(x + 1)));
        acc[r] = _mm256_add_epi32(acc[r], sums);
      }
    }
    for (int r = 0; r < ROWS; r++) {
      __m256 scale = _mm256_set1_ps(scales[g] * xd[r][g]);
      total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), scale, total[r]);
    }
  }
  store_rows<ROWS>(p, n, m, total, biases);
}

// Float32 x against weight rows n0..n1, the scales and biases read as stored: in
// tiles of WIDE_ROWS rows of x while that many are left, then of up to 4. Wide
// tiles go over CHUNK weight rows and COLUMNS columns at a time, so that the 8
// rows of x they read stay in the L1 cache across the chunk.
constexpr int WIDE_ROWS = 8;
constexpr int CHUNK = 16;
constexpr int COLUMNS = 512;

template <int BITS, ScaleType ST>
void rows_float(const Problem& p, int n0, int n1) {
  // Bytes from one weight row's scales (or biases) to the next's.
  std::size_t stride = std::size_t(p.K / p.group_size) * (ST == ScaleType::f32 ? 4 : 2);
  auto scales = static_cast<const char*>(p.scales);
  auto biases = static_cast<const char*>(p.biases);
  int wide = p.M / WIDE_ROWS * WIDE_ROWS;
  __m256 totals[CHUNK][WIDE_ROWS];
  for (int c0 = n0; c0 < n1; c0 += CHUNK) {
    int c1 = std::min(n1, c0 + CHUNK);
    // The next chunk's scales and biases, two more streams.
    std::size_t next = c1 * stride, end = std::min(n1, c1 + CHUNK) * stride;
    for (std::size_t at = next; at < end; at += 64) {
      _mm_prefetch(scales + at, _MM_HINT_T0);
      _mm_prefetch(biases + at, _MM_HINT_T0);
    }
    for (int m = 0; m < wide; m += WIDE_ROWS) {
      for (int n = c0; n < c1; n++) {
        for (int r = 0; r < WIDE_ROWS; r++) {
          totals[n - c0][r] = _mm256_setzero_ps();
        }
      }
      for (int k0 = 0; k0 < p.K; k0 += COLUMNS) {
        int k1 = std::min(p.K, k0 + COLUMNS);
        for (int n = c0; n < c1; n++) {
          const void* s = scales + n * stride;
          rows_tile_wide<BITS, WIDE_ROWS, ST>(p, n, m, k0, k1, s, totals[n - c0]);
        }
      }
      for (int n = c0; n < c1; n++) {
        const void* b = biases + n * stride;
        store_rows<WIDE_ROWS, ST>(p, n, m, totals[n - c0], b);
      }
    }
    // One row of x: weight rows in pairs.
    int first = c0;
    if (p.M == 1) {
      for (; first + 2 <= c1; first += 2) {
        std::size_t offset = first * stride;
        rows_pair<BITS, ST>(p, first, 0, scales + offset, biases + offset, stride);
      }
    }
    for (int n = first; n < c1; n++) {
      std::size_t offset = n * stride;
      const void* s = scales + offset;
      const void* b = biases + offset;
      x_tiles(wide, p.M, [&]<int ROWS>(int m) {
        rows_tile<BITS, ROWS, ST>(p, n, m, s, b);
      });
    }
  }
}

template <int BITS>
void rows_float_bits(const Problem& p, int n0, int n1) {
  switch (p.scale_type) {
    case ScaleType::f32:
      return rows_float<BITS, ScaleType::f32>(p, n0, n1);
    case ScaleType::f16:
      return rows_float<BITS, ScaleType::f16>(p, n0, n1);
    case ScaleType::bf16:
      return rows_float<BITS, ScaleType::bf16>(p, n0, n1);
  }
}

// x rounded to int16 against weight rows n0..n1, in tiles of up to 4 rows of x;
// each row's scales and biases first as float32.
template <int BITS>
void rows_int16(const Problem& p, int n0, int n1) {
  int groups = p.K / p.group_size;
  auto [scales, biases] = row_scale_room(groups);
  for (int n = n0; n < n1; n++) {
    load_scales(p, p.scales, n, scales);
    load_scales(p, p.biases, n, biases);
    x_tiles(0, p.M, [&]<int ROWS>(int m) {
      rows_tile_int16<BITS, ROWS>(p, n, m, scales, biases);
    });
  }
}

template <int BITS>
void dequantize_bits(const Problem& p, int n0, int n1, float* out) {
  int groups = p.K / p.group_size;
  int chunks = p.group_size / 32;
  thread_local std::vector<float> scales, biases;
  scales.resize(groups + 8);
  biases.resize(groups + 8);
  __m256 q[4];
  for (int n = n0; n < n1; n++) {
    load_scales(p, p.scales, n, scales.data());
    load_scales(p, p.biases, n, biases.data());
    const uint32_t* packed = p.w + std::size_t(n) * (p.K * BITS / 32);
    float* dst = out + std::size_t(n - n0) * p.K;
    for (int g = 0; g < groups; g++) {
      __m256 scale = _mm256_broadcast_ss(&scales[g]);
      __m256 bias = _mm256_broadcast_ss(&biases[g]);
      for (int c = 0; c < chunks; c++, packed += BITS, dst += 32) {
        unpack32<BITS>(packed, q);
        for (int i = 0; i < 4; i++) {
          _mm256_storeu_ps(dst + 8 * i, _mm256_fmadd_ps(q[i], scale, bias));
        }
      }
    }
  }
}

} // namespace

void rows_avx2(const Problem& p, int n0, int n1) {
  if (p.bits == 4) {
    rows_float_bits<4>(p, n0, n1);
  } else {
    rows_float_bits<8>(p, n0, n1);
  }
}

void rows_avx2_int16(const Problem& p, int n0, int n1) {
  if (p.bits == 4) {
    rows_int16<4>(p, n0, n1);
  } else {
    rows_int16<8>(p, n0, n1);
  }
}

void dequantize_avx2(const Problem& p, int n0, int n1, float* out) {
  if (p.bits == 4) {
    dequantize_bits<4>(p, n0, n1, out);
  } else {
    dequantize_bits<8>(p, n0, n1, out);
  }
}

} // namespace qmm
