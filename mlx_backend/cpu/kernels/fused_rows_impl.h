// The row kernels' code, included once per instruction set by a file that names
// it (FUSED_ISA) and builds with that set's flags.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "fused_rows.h"
#include "qmm.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

// s[r][j] = q_r . k_j for R rows and the block's keys, from the block transposed
// (kt: [dims][KEYS_BLOCK]): each load of the keys serves R rows.
template <int R>
inline void block_scores(
    const float* const* q,
    const float* kt,
    int dims,
    float (*s)[KEYS_BLOCK]) {
  float acc[R][KEYS_BLOCK] = {};
  for (int d = 0; d < dims; d++) {
    const float* row = kt + d * KEYS_BLOCK;
    for (int r = 0; r < R; r++) {
      float qd = q[r][d];
      for (int j = 0; j < KEYS_BLOCK; j++) {
        acc[r][j] += qd * row[j];
      }
    }
  }
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < KEYS_BLOCK; j++) {
      s[r][j] = acc[r][j];
    }
  }
}

// out_r[0:N] = out_r[0:N] * c_r + sum_j p_r[j] v_j[0:N] for R rows and the first
// `keys` keys of a block: each load of the values serves R rows.
template <int N, int R>
inline void block_values(
    const float (*p)[KEYS_BLOCK],
    const float* v,
    int64_t v_stride,
    int keys,
    const float* c,
    float* const* out,
    int offset) {
  float acc[R][N];
  for (int r = 0; r < R; r++) {
    for (int i = 0; i < N; i++) {
      acc[r][i] = out[r][offset + i] * c[r];
    }
  }
  for (int j = 0; j < keys; j++) {
    const float* vj = v + j * v_stride + offset;
    for (int r = 0; r < R; r++) {
      float pj = p[r][j];
      for (int i = 0; i < N; i++) {
        acc[r][i] += pj * vj[i];
      }
    }
  }
  for (int r = 0; r < R; r++) {
    for (int i = 0; i < N; i++) {
      out[r][offset + i] = acc[r][i];
    }
  }
}

template <int R>
inline void block_all_values(
    const float (*p)[KEYS_BLOCK],
    const float* v,
    int64_t v_stride,
    int keys,
    const float* c,
    float* const* out,
    int value_dims) {
  int i = 0;
  for (; i + 32 <= value_dims; i += 32) {
    block_values<32, R>(p, v, v_stride, keys, c, out, i);
  }
  for (; i + 8 <= value_dims; i += 8) {
    block_values<8, R>(p, v, v_stride, keys, c, out, i);
  }
  for (; i < value_dims; i++) {
    block_values<1, R>(p, v, v_stride, keys, c, out, i);
  }
}

// A float16's value (IEEE binary16 bits).
inline float widen(uint16_t h) {
  return half_to_float(h);
}

inline float widen(float x) {
  return x;
}

#if defined(__AVX2__)
inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}

inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

#if defined(__AVX2__)
// Eight rows of eight dims (r[i]: key j0 + i, dims d0 .. d0 + 7) stored
// transposed into kt ([dims][KEYS_BLOCK]).
inline void store_transposed8(__m256* r, int j0, int d0, float* kt) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    for (int h = 0; h < 2; h++) {
      r[i + 2 * h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0x44);
      r[i + 2 * h + 1] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0xEE);
    }
  }
  // r[0..3]: dims {0,4}, {1,5}, {2,6}, {3,7} of keys 0-3, r[4..7] of keys 4-7.
  for (int i = 0; i < 4; i++) {
    __m256 a = r[i], b = r[4 + i];
    _mm256_storeu_ps(
        kt + (d0 + i) * KEYS_BLOCK + j0, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(
        kt + (d0 + i + 4) * KEYS_BLOCK + j0, _mm256_permute2f128_ps(a, b, 0x31));
  }
}

// Eight quantized dims' codes as floats: 8 bits (8 bytes), 4 bits (4 bytes,
// low nibbles first).
inline __m256 codes8(const uint8_t* c, int bits) {
  __m128i bytes;
  if (bits == 8) {
    bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  } else {
    int32_t packed;
    std::memcpy(&packed, c, 4);
    __m128i b = _mm_cvtsi32_si128(packed), low = _mm_set1_epi8(15);
    bytes = _mm_unpacklo_epi8(
        _mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  }
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}
#endif

// kt[d][j] = k_j[d] for a block of keys (kt: [dims][KEYS_BLOCK]), float16 keys
// widened; keys from `n` on read as zeros.
template <typename T>
inline void transpose_block(
    const T* k,
    int64_t stride,
    int n,
    int dims,
    float* kt) {
#if defined(__AVX2__)
  // Eight keys by eight dims at a time, in registers (the scalar loop's
  // scattered stores cost as much as the scores).
  if (n == KEYS_BLOCK && dims % 8 == 0) {
    for (int j0 = 0; j0 < KEYS_BLOCK; j0 += 8) {
      for (int d0 = 0; d0 < dims; d0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) {
          r[i] = load8(k + (j0 + i) * stride + d0);
        }
        store_transposed8(r, j0, d0, kt);
      }
    }
    return;
  }
#endif
  for (int j = 0; j < KEYS_BLOCK; j++) {
    for (int d = 0; d < dims; d++) {
      kt[d * KEYS_BLOCK + j] = j < n ? widen(k[j * stride + d]) : 0.0f;
    }
  }
}

// The first `n` float16 values of a block, widened into vb (rows of value_dims).
inline void widen_block(
    const uint16_t* v,
    int64_t stride,
    int n,
    int value_dims,
    float* vb) {
  for (int j = 0; j < n; j++) {
    const uint16_t* row = v + j * stride;
    float* out = vb + int64_t(j) * value_dims;
    int i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= value_dims; i += 8) {
      _mm256_storeu_ps(out + i, load8(row + i));
    }
#endif
    for (; i < value_dims; i++) {
      out[i] = widen(row[i]);
    }
  }
}

// One row of `dims` quantized dims (codes: a little-endian stream of `bits`-bit
// codes; a scale and a bias per group of `group_size`) as floats.
inline void dequantize_row(
    const uint8_t* codes,
    const float* scales,
    const float* biases,
    int dims,
    int bits,
    int group_size,
    float* out) {
  for (int g = 0; g < dims / group_size; g++) {
    float scale = scales[g], bias = biases[g];
    float* y = out + g * group_size;
    int first = g * group_size;
    if (bits == 8) {
      const uint8_t* c = codes + first;
      int i = 0;
#if defined(__AVX2__)
      __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(bias);
      for (; i + 8 <= group_size; i += 8) {
        __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i));
        __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(x, vs, vb));
      }
#endif
      for (; i < group_size; i++) {
        y[i] = float(c[i]) * scale + bias;
      }
    } else if (bits == 4) {
      const uint8_t* c = codes + first / 2;
      int i = 0;
#if defined(__AVX2__)
      __m256 vs = _mm256_set1_ps(scale), vb = _mm256_set1_ps(bias);
      __m128i low = _mm_set1_epi8(15);
      // 16 codes from 8 bytes: low nibbles are the even dims, high the odd.
      for (; 2 * i + 16 <= group_size; i += 8) {
        __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i));
        __m128i lo = _mm_and_si128(bytes, low);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        __m128i codes16 = _mm_unpacklo_epi8(lo, hi);
        __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes16));
        __m256 b = _mm256_cvtepi32_ps(
            _mm256_cvtepu8_epi32(_mm_srli_si128(codes16, 8)));
        _mm256_storeu_ps(y + 2 * i, _mm256_fmadd_ps(a, vs, vb));
        _mm256_storeu_ps(y + 2 * i + 8, _mm256_fmadd_ps(b, vs, vb));
      }
#endif
      for (; 2 * i < group_size; i++) {
        y[2 * i] = float(c[i] & 15) * scale + bias;
        y[2 * i + 1] = float(c[i] >> 4) * scale + bias;
      }
    } else {
      uint32_t mask = (1u << bits) - 1;
      for (int i = 0; i < group_size; i++) {
        int64_t at = int64_t(first + i) * bits;
        const uint8_t* c = codes + at / 8;
        int shift = int(at % 8);
        // A code crosses into the next byte only where it doesn't end the row.
        uint32_t word = c[0] | (shift + bits > 8 ? uint32_t(c[1]) << 8 : 0u);
        y[i] = float((word >> shift) & mask) * scale + bias;
      }
    }
  }
}

// A block of quantized rows: row j's codes at codes + j * stride bytes, its
// scales and biases at + j * scale_stride.
struct QuantizedBlock {
  const uint8_t* codes;
  int64_t stride;
  const float* scales;
  const float* biases;
  int64_t scale_stride;
  int bits;
  int group_size;
};

// The block's first `n` rows widened into out (rows of dims).
inline void dequantize_block(const QuantizedBlock& b, int n, int dims, float* out) {
  for (int j = 0; j < n; j++) {
    dequantize_row(
        b.codes + j * b.stride,
        b.scales + j * b.scale_stride,
        b.biases + j * b.scale_stride,
        dims,
        b.bits,
        b.group_size,
        out + int64_t(j) * dims);
  }
}

// transpose_block for quantized keys; kb: scratch of KEYS_BLOCK rows of dims
// where the block is dequantized first (other widths, the portable path).
inline void transpose_quantized_block(
    const QuantizedBlock& b,
    int n,
    int dims,
    float* kb,
    float* kt) {
#if defined(__AVX2__)
  // 8 and 4 bits: dequantized in registers on the way into the transpose.
  if (n == KEYS_BLOCK && (b.bits == 8 || b.bits == 4) && b.group_size % 8 == 0) {
    for (int j0 = 0; j0 < KEYS_BLOCK; j0 += 8) {
      for (int d0 = 0; d0 < dims; d0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) {
          int64_t j = j0 + i, g = d0 / b.group_size;
          r[i] = _mm256_fmadd_ps(
              codes8(b.codes + j * b.stride + d0 * b.bits / 8, b.bits),
              _mm256_set1_ps(b.scales[j * b.scale_stride + g]),
              _mm256_set1_ps(b.biases[j * b.scale_stride + g]));
        }
        store_transposed8(r, j0, d0, kt);
      }
    }
    return;
  }
#endif
  dequantize_block(b, n, dims, kb);
  transpose_block(kb, int64_t(dims), n, dims, kt);
}

// s[j] times scale for j in [lo, hi), `excluded` elsewhere in the block; and the
// block's top. Written out per instruction set: the compiler kept both loops
// scalar (a max over the block is a chain it may not reorder), and they cost
// about a fifth of a prompt's attention.
inline void scale_scores(float* s, int lo, int hi, float scale, float excluded) {
#if defined(__AVX512F__)
  static_assert(KEYS_BLOCK % 16 == 0);
  const __m512i lane =
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int j = 0; j < KEYS_BLOCK; j += 16) {
    __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(j));
    __mmask16 in = _mm512_cmpge_epi32_mask(at, _mm512_set1_epi32(lo)) &
        _mm512_cmplt_epi32_mask(at, _mm512_set1_epi32(hi));
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(scale));
    _mm512_storeu_ps(s + j, _mm512_mask_blend_ps(in, _mm512_set1_ps(excluded), v));
  }
#elif defined(__AVX2__)
  static_assert(KEYS_BLOCK % 8 == 0);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int j = 0; j < KEYS_BLOCK; j += 8) {
    __m256i at = _mm256_add_epi32(lane, _mm256_set1_epi32(j));
    // lo <= at < hi: at > lo - 1 and hi > at.
    __m256i in = _mm256_and_si256(
        _mm256_cmpgt_epi32(at, _mm256_set1_epi32(lo - 1)),
        _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), at));
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(scale));
    _mm256_storeu_ps(
        s + j,
        _mm256_blendv_ps(_mm256_set1_ps(excluded), v, _mm256_castsi256_ps(in)));
  }
#else
  for (int j = 0; j < KEYS_BLOCK; j++) {
    s[j] = j >= lo && j < hi ? s[j] * scale : excluded;
  }
#endif
}

inline float block_max(const float* s) {
#if defined(__AVX512F__)
  __m512 top = _mm512_loadu_ps(s);
  for (int j = 16; j < KEYS_BLOCK; j += 16) {
    top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
  }
  return _mm512_reduce_max_ps(top);
#elif defined(__AVX2__)
  __m256 top = _mm256_loadu_ps(s);
  for (int j = 8; j < KEYS_BLOCK; j += 8) {
    top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
#else
  float top = s[0];
  for (int j = 1; j < KEYS_BLOCK; j++) {
    top = std::max(top, s[j]);
  }
  return top;
#endif
}

// A row's scores of keys j0 .. j0 + KEYS_BLOCK (its first `seen` visible) turned
// into exp(score - top) with its running top and total moved on; the factor its
// earlier sums take.
inline float online_softmax(
    const AttentionRow& row,
    int j0,
    int seen,
    float* s,
    float& top,
    float& total) {
  constexpr float masked = std::numeric_limits<float>::lowest();
  constexpr float excluded = -std::numeric_limits<float>::infinity();
  scale_scores(s, std::max(0, row.first_key - j0), seen, row.scale, excluded);
  for (int j = 0; j < seen && row.keep != nullptr; j++) {
    s[j] = row.keep[(j0 + j) * row.mask_stride] ? s[j] : masked;
  }
  for (int j = 0; j < seen && row.bias != nullptr; j++) {
    s[j] += row.bias[(j0 + j) * row.mask_stride];
  }
  float block_top = std::max(masked, block_max(s));
  float new_top = std::max(top, block_top);
  float c = exp_lane(top - new_top);
  total = total * c + exp_shifted(s, KEYS_BLOCK, new_top);
  top = new_top;
  return c;
}

// R rows' scores of a block of keys (kt: transposed; row r sees seen[r] of them),
// their softmax moved on, and the block's values added to their outputs.
template <int R>
inline void attend_block(
    const AttentionRow* rows,
    const int* seen,
    int j0,
    const float* kt,
    const float* values,
    int64_t v_stride,
    float* top,
    float* total) {
  const float* q[R];
  float* out[R];
  float c[R];
  float s[R][KEYS_BLOCK];
  int most = 0;
  for (int r = 0; r < R; r++) {
    q[r] = rows[r].q;
    out[r] = rows[r].out;
    most = std::max(most, seen[r]);
  }
  block_scores<R>(q, kt, rows[0].dims, s);
  for (int r = 0; r < R; r++) {
    c[r] = online_softmax(rows[r], j0, seen[r], s[r], top[r], total[r]);
  }
  block_all_values<R>(s, values, v_stride, most, c, out, rows[0].value_dims);
}

// Rows of an attention tile: AVX-512's registers hold 8 rows' scores of a block
// and their values' sums, AVX2's 3. (Against tiles of 3 on AVX-512, 6 rows
// prefilled a 4096-token prompt 1.17-1.30x as fast; 8 rows matched 6 or beat it.)
#if defined(__AVX512F__)
constexpr int ATTENTION_TILE = 8;
#else
constexpr int ATTENTION_TILE = 3;
#endif

// attend_block for a tile of `group` rows (1 to R).
template <int R>
inline void attend_tile(
    int group,
    const AttentionRow* rows,
    const int* seen,
    int j0,
    const float* kt,
    const float* values,
    int64_t v_stride,
    float* top,
    float* total) {
  if constexpr (R > 0) {
    if (group == R) {
      attend_block<R>(rows, seen, j0, kt, values, v_stride, top, total);
    } else {
      attend_tile<R - 1>(group, rows, seen, j0, kt, values, v_stride, top, total);
    }
  }
}

void attention_rows(const AttentionRow* rows, int count, float* scratch) {
  const AttentionRow& first = rows[0];
  int dims = first.dims, value_dims = first.value_dims;
  float* kt = scratch;
  float* vb = kt + int64_t(KEYS_BLOCK) * dims;
  float* kb = vb + int64_t(KEYS_BLOCK) * value_dims;
  float* top = kb + int64_t(KEYS_BLOCK) * dims;
  float* total = top + count;
  // Keys and values are float32, or (paged) float16 or quantized codes: offsets
  // in elements times this are bytes (codes' offsets are bytes already).
  bool quantized = first.pages != nullptr && first.bits > 0;
  int64_t width = quantized ? 1 : first.half ? 2 : 4;
  int keys = 0, lowest = std::numeric_limits<int>::max();
  for (int r = 0; r < count; r++) {
    top[r] = rows[r].has_sink ? rows[r].sink : std::numeric_limits<float>::lowest();
    total[r] = 0.0f;
    std::fill(rows[r].out, rows[r].out + value_dims, 0.0f);
    keys = std::max(keys, rows[r].keys);
    lowest = std::min(lowest, rows[r].first_key);
  }
  // Blocks before every row's window are not read.
  for (int j0 = lowest / KEYS_BLOCK * KEYS_BLOCK; j0 < keys; j0 += KEYS_BLOCK) {
    int n = std::min(KEYS_BLOCK, keys - j0);
    const char* k;
    const char* v;
    int arena = 0;
    int64_t local = 0;
    if (first.pages != nullptr) {
      int page = first.pages[j0 / KEYS_BLOCK];
      arena = page / first.arena_pages;
      local = page % first.arena_pages;
      k = reinterpret_cast<const char*>(first.k_arenas[arena]) +
          (local * first.k_page_stride + first.k_head) * width;
      v = reinterpret_cast<const char*>(first.v_arenas[arena]) +
          (local * first.v_page_stride + first.v_head) * width;
    } else {
      k = reinterpret_cast<const char*>(first.k + j0 * first.k_stride);
      v = reinterpret_cast<const char*>(first.v + j0 * first.v_stride);
    }
    // The next block's keys and values on their way while this one is scored
    // (a page's rows of one head are strided: the prefetchers miss them).
    if (first.pages != nullptr && j0 + KEYS_BLOCK < keys) {
      int page = first.pages[j0 / KEYS_BLOCK + 1];
      int next_arena = page / first.arena_pages;
      int64_t next_local = page % first.arena_pages;
      const char* nk = reinterpret_cast<const char*>(first.k_arenas[next_arena]) +
          (next_local * first.k_page_stride + first.k_head) * width;
      const char* nv = reinterpret_cast<const char*>(first.v_arenas[next_arena]) +
          (next_local * first.v_page_stride + first.v_head) * width;
      // Quantized rows are narrower than dims bytes (8 bits at most).
      int64_t k_row = quantized ? dims * first.bits / 8 : dims * width;
      int64_t v_row = quantized ? value_dims * first.bits / 8 : value_dims * width;
      for (int j = 0; j < KEYS_BLOCK; j++) {
        for (int64_t b = 0; b < k_row; b += 64) {
          __builtin_prefetch(nk + j * first.k_stride * width + b);
        }
        for (int64_t b = 0; b < v_row; b += 64) {
          __builtin_prefetch(nv + j * first.v_stride * width + b);
        }
      }
      if (quantized) {
        // The page's scales and biases: every head's, a few lines each.
        for (auto [arenas, stride] :
             {std::pair{first.k_scale_arenas, first.k_scale_stride},
              {first.k_bias_arenas, first.k_scale_stride},
              {first.v_scale_arenas, first.v_scale_stride},
              {first.v_bias_arenas, first.v_scale_stride}}) {
          const char* at = reinterpret_cast<const char*>(
              arenas[next_arena] + next_local * stride * KEYS_BLOCK);
          for (int64_t b = 0; b < stride * KEYS_BLOCK * 4; b += 64) {
            __builtin_prefetch(at + b);
          }
        }
      }
    }
    const float* values = reinterpret_cast<const float*>(v);
    int64_t v_stride = first.v_stride;
    if (quantized) {
      // This page's block of one head: codes, and its scales and biases.
      auto block = [&](const char* codes,
                       int64_t stride,
                       const float* const* scales,
                       const float* const* biases,
                       int64_t scale_stride,
                       int64_t head) {
        int64_t at = local * scale_stride * KEYS_BLOCK + head;
        return QuantizedBlock{
            reinterpret_cast<const uint8_t*>(codes),
            stride,
            scales[arena] + at,
            biases[arena] + at,
            scale_stride,
            first.bits,
            first.group_size};
      };
      QuantizedBlock kq = block(
          k,
          first.k_stride,
          first.k_scale_arenas,
          first.k_bias_arenas,
          first.k_scale_stride,
          first.k_scale_head);
      QuantizedBlock vq = block(
          v,
          first.v_stride,
          first.v_scale_arenas,
          first.v_bias_arenas,
          first.v_scale_stride,
          first.v_scale_head);
      transpose_quantized_block(kq, n, dims, kb, kt);
      dequantize_block(vq, n, value_dims, vb);
      values = vb;
      v_stride = value_dims;
    } else if (first.half) {
      transpose_block(
          reinterpret_cast<const uint16_t*>(k), first.k_stride, n, dims, kt);
      widen_block(
          reinterpret_cast<const uint16_t*>(v), first.v_stride, n, value_dims, vb);
      values = vb;
      v_stride = value_dims;
    } else {
      transpose_block(
          reinterpret_cast<const float*>(k), first.k_stride, n, dims, kt);
    }
    // Rows in tiles where all see keys of this block (one row alone keeps half the
    // FMA units idle): AVX2's 16 registers take pairs, the last three together;
    // AVX-512's 32 take up to 8 (each loaded key serves them all). A row's sums
    // run in the same order in any tile.
    // The keys of this block a row sees: none where its window starts later.
    auto sees = [&](const AttentionRow& row) {
      return row.first_key < j0 + n ? std::min(n, row.keys - j0) : 0;
    };
    for (int r = 0; r < count;) {
      int seen[ATTENTION_TILE] = {sees(rows[r])};
      if (seen[0] <= 0) {
        r++;
        continue;
      }
      int want = ATTENTION_TILE > 3 ? std::min(ATTENTION_TILE, count - r)
          : count - r == 3         ? 3
                                   : 2;
      int group = 1;
      for (; group < want && r + group < count; group++) {
        seen[group] = sees(rows[r + group]);
        if (seen[group] <= 0) {
          break;
        }
      }
      attend_tile<ATTENTION_TILE>(
          group, rows + r, seen, j0, kt, values, v_stride, top + r, total + r);
      r += group;
    }
  }
  for (int r = 0; r < count; r++) {
    float sum = total[r];
    if (rows[r].has_sink) {
      sum += exp_lane(rows[r].sink - top[r]);
    }
    float inv = 1.0f / sum;
    for (int i = 0; i < value_dims; i++) {
      rows[r].out[i] *= inv;
    }
  }
}

// MLX's sigmoid (from exp(|g|), so that it never overflows) times g, times u.
void silu_mul(const float* g, const float* u, float* y, int n) {
  for (int i = 0; i < n; i++) {
    float e = 1.0f / (1.0f + exp_lane(std::fabs(g[i])));
    float sigmoid = g[i] < 0.0f ? e : 1.0f - e;
    y[i] = (g[i] * sigmoid) * u[i];
  }
}

float log_sum_exp(const float* x, int n) {
  float top_lanes[LANES];
  for (int l = 0; l < LANES; l++) {
    top_lanes[l] = -std::numeric_limits<float>::infinity();
  }
  int i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; l++) {
      top_lanes[l] = x[i + l] > top_lanes[l] ? x[i + l] : top_lanes[l];
    }
  }
  float top = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < LANES; l++) {
    top = std::max(top, top_lanes[l]);
  }
  for (; i < n; i++) {
    top = std::max(top, x[i]);
  }
  if (std::isinf(top)) {
    return top;
  }
  float acc[LANES] = {};
  i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; l++) {
      acc[l] += exp_lane(x[i + l] - top);
    }
  }
  float tail = 0.0f;
  for (; i < n; i++) {
    tail += exp_lane(x[i] - top);
  }
  return std::log(lanes_total(acc) + tail) + top;
}

} // namespace

RowKernels rows() {
  return {
      FUSED_ISA_NAME,
      rms_norm,
      layer_norm,
      rope,
      attention_rows,
      silu_mul,
      log_sum_exp};
}

} // namespace qmm::fused::FUSED_ISA
