// x86-64 kernels for AVX2 with FMA and F16C (built with those flags; called only
// when the CPU has them).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "qmm.h"

namespace qmm {

namespace {

// Row n's scales (or biases) as float32, into room for its groups rounded up to 8.
// Half floats go 8 at a time, the last 8 read on into the next row's (a few bytes
// of a row that is read anyway); the array's last row ends through a zeroed vector.
void load_scales(const Problem& p, const void* base, int n, float* out) {
  int groups = p.K / p.group_size;
  std::size_t offset = std::size_t(n) * groups;
  if (p.scale_type == ScaleType::f32) {
    std::memcpy(out, static_cast<const float*>(base) + offset, groups * sizeof(float));
    return;
  }
  auto values = static_cast<const uint16_t*>(base) + offset;
  auto convert = [&](__m128i h) {
    return p.scale_type == ScaleType::f16
        ? _mm256_cvtph_ps(h)
        : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  bool last = n == p.N - 1;
  int g = 0;
  for (; g + 8 <= groups || (g < groups && !last); g += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + g));
    _mm256_storeu_ps(out + g, convert(h));
  }
  if (g < groups) {
    alignas(16) uint16_t tail[8] = {};
    std::memcpy(tail, values + g, (groups - g) * sizeof(uint16_t));
    _mm256_storeu_ps(
        out + g, convert(_mm_load_si128(reinterpret_cast<const __m128i*>(tail))));
  }
}

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

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  }
  float total = horizontal_sum(acc);
  for (; i < n; i++) {
    total += a[i] * b[i];
  }
  return total;
}

// Each row's output for weight row n: its scaled group sums, plus the biases met
// with x's exact group sums.
template <int ROWS>
inline void store_rows(
    const Problem& p,
    int n,
    int m,
    const __m256 total[ROWS],
    const float* biases) {
  int groups = p.K / p.group_size;
  for (int r = 0; r < ROWS; r++) {
    const float* xsum = p.xsum + std::size_t(m + r) * groups;
    p.y[std::size_t(m + r) * p.N + n] =
        horizontal_sum(total[r]) + dot(biases, xsum, groups);
  }
}

// ROWS rows of x (from row m, in lane order) against weight row n. A vector of 8
// words holds 8 weights a word (4-bit) or 4 (8-bit); shifting and masking it gives
// one field of every word, met by x's matching lanes: no shuffles. Each block's
// sums are scaled per lane (its words' groups), and the biases meet x's exact
// group sums.
template <int BITS, int ROWS>
inline void rows_tile(
    const Problem& p,
    int n,
    int m,
    const float* scales,
    const float* biases) {
  constexpr int PER_WORD = 32 / BITS;
  constexpr int BLOCK = 8 * PER_WORD;
  const int G = p.group_size;
  const uint32_t* w = p.w + std::size_t(n) * (p.K / PER_WORD);
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  const float* x[ROWS];
  __m256 total[ROWS];
  for (int r = 0; r < ROWS; r++) {
    x[r] = p.xl + std::size_t(m + r) * p.K;
    total[r] = _mm256_setzero_ps();
  }
  int k0 = 0;
  for (; k0 + BLOCK <= p.K; k0 += BLOCK, w += 8) {
    __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    // Two chains a row, so that enough FMAs are in flight to hide their latency.
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
#pragma GCC unroll 8
    for (int i = 0; i < PER_WORD; i++) {
      __m256i field = i == 0 ? words : _mm256_srli_epi32(words, i * BITS);
      if (i != PER_WORD - 1) {
        field = _mm256_and_si256(field, mask);
      }
      __m256 q = _mm256_cvtepi32_ps(field);
      for (int r = 0; r < ROWS; r++) {
        acc[r][i & 1] =
            _mm256_fmadd_ps(q, _mm256_loadu_ps(x[r] + k0 + 8 * i), acc[r][i & 1]);
      }
    }
    // A 4-bit block's first 4 words are 32 weights, its last 4 the next 32.
    __m256 scale = BITS == 4
        ? _mm256_set_m128(
              _mm_broadcast_ss(scales + (k0 + 32) / G),
              _mm_broadcast_ss(scales + k0 / G))
        : _mm256_broadcast_ss(scales + k0 / G);
    for (int r = 0; r < ROWS; r++) {
      total[r] =
          _mm256_fmadd_ps(_mm256_add_ps(acc[r][0], acc[r][1]), scale, total[r]);
    }
  }
  if (k0 < p.K) {
    // The last 4 words of a 4-bit row whose length is an odd number of 32s.
    __m128i words = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    __m128 scale = _mm_broadcast_ss(scales + k0 / G);
    __m128 acc[ROWS];
    for (int r = 0; r < ROWS; r++) {
      acc[r] = _mm_setzero_ps();
    }
    for (int i = 0; i < PER_WORD; i++) {
      __m128i field = _mm_and_si128(
          _mm_srli_epi32(words, i * BITS), _mm256_castsi256_si128(mask));
      __m128 q = _mm_cvtepi32_ps(field);
      for (int r = 0; r < ROWS; r++) {
        acc[r] = _mm_fmadd_ps(q, _mm_loadu_ps(x[r] + k0 + 4 * i), acc[r]);
      }
    }
    for (int r = 0; r < ROWS; r++) {
      total[r] = _mm256_add_ps(
          total[r], _mm256_zextps128_ps256(_mm_mul_ps(acc[r], scale)));
    }
  }
  store_rows<ROWS>(p, n, m, total, biases);
}

// 32 weights as bytes, in the order quantize_rows(interleaved) puts x: 4-bit
// weights as [low nibbles | high nibbles], 8-bit ones as stored.
template <int BITS>
inline __m256i weight_bytes(const uint32_t* packed) {
  if constexpr (BITS == 4) {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
  }
}

// The int8 kernel: maddubs multiplies unsigned weights by int8 x in pairs. 4-bit
// products fit int16 for a whole group (15 * 127 * 2 * 4 < 32768); 8-bit weights
// are recentred to [-128, 127] (the bias takes the 128) and widened each chunk.
template <int BITS, int ROWS>
inline void rows_tile_int8(
    const Problem& p,
    int n,
    int m,
    const float* scales,
    const float* biases) {
  int groups = p.K / p.group_size;
  int chunks = p.group_size / 32;
  const uint32_t* packed = p.w + std::size_t(n) * (p.K * BITS / 32);
  const int8_t* xq[ROWS];
  const float* xd[ROWS];
  __m256 total[ROWS];
  for (int r = 0; r < ROWS; r++) {
    xq[r] = static_cast<const int8_t*>(p.xq) + std::size_t(m + r) * p.K;
    xd[r] = p.xd + std::size_t(m + r) * groups;
    total[r] = _mm256_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int g = 0; g < groups; g++) {
    __m256i acc[ROWS];
    for (int r = 0; r < ROWS; r++) {
      acc[r] = _mm256_setzero_si256();
    }
    for (int c = 0; c < chunks; c++, packed += BITS) {
      __m256i w = weight_bytes<BITS>(packed);
      int k = (g * chunks + c) * 32;
      if constexpr (BITS == 4) {
        for (int r = 0; r < ROWS; r++) {
          __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + k));
          acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(w, x));
        }
      } else {
        __m256i centred = _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80)));
        __m256i magnitude = _mm256_abs_epi8(centred);
        for (int r = 0; r < ROWS; r++) {
          __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + k));
          __m256i pairs =
              _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, centred));
          acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int r = 0; r < ROWS; r++) {
      __m256i sums = BITS == 4 ? _mm256_madd_epi16(acc[r], ones) : acc[r];
      __m256 scale = _mm256_set1_ps(scales[g] * xd[r][g]);
      total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, total[r]);
    }
  }
  store_rows<ROWS>(p, n, m, total, biases);
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

// Every row of x against weight rows n0..n1, in tiles of up to 4 rows.
enum class Activations { float32, int16, int8 };

template <int BITS, Activations X>
void rows_bits(const Problem& p, int n0, int n1) {
  int groups = p.K / p.group_size;
  thread_local std::vector<float> scales, biases;
  scales.resize(groups + 8);
  biases.resize(groups + 8);
  auto tile = [&]<int ROWS>(int n, int m) {
    if constexpr (X == Activations::int8) {
      rows_tile_int8<BITS, ROWS>(p, n, m, scales.data(), biases.data());
    } else if constexpr (X == Activations::int16) {
      rows_tile_int16<BITS, ROWS>(p, n, m, scales.data(), biases.data());
    } else {
      rows_tile<BITS, ROWS>(p, n, m, scales.data(), biases.data());
    }
  };
  for (int n = n0; n < n1; n++) {
    load_scales(p, p.scales, n, scales.data());
    load_scales(p, p.biases, n, biases.data());
    if constexpr (X == Activations::int8 && BITS == 8) {
      for (int g = 0; g < groups; g++) {
        biases[g] += 128.0f * scales[g];
      }
    }
    int m = 0;
    for (; m + 4 <= p.M; m += 4) {
      tile.template operator()<4>(n, m);
    }
    switch (p.M - m) {
      case 3:
        tile.template operator()<3>(n, m);
        break;
      case 2:
        tile.template operator()<2>(n, m);
        break;
      case 1:
        tile.template operator()<1>(n, m);
        break;
    }
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
    rows_bits<4, Activations::float32>(p, n0, n1);
  } else {
    rows_bits<8, Activations::float32>(p, n0, n1);
  }
}

void rows_avx2_int8(const Problem& p, int n0, int n1) {
  if (p.bits == 4) {
    rows_bits<4, Activations::int8>(p, n0, n1);
  } else {
    rows_bits<8, Activations::int8>(p, n0, n1);
  }
}

void rows_avx2_int16(const Problem& p, int n0, int n1) {
  if (p.bits == 4) {
    rows_bits<4, Activations::int16>(p, n0, n1);
  } else {
    rows_bits<8, Activations::int16>(p, n0, n1);
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
