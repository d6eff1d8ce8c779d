// The int8 GEMM for many rows of x (a prompt's chunk, a batch): weight rows go
// 16 at a time into a panel of unsigned int8 codes interleaved by 4 (each 4
// values of row i at int32 lane i of a step's two vectors), and x's rows,
// rounded to int8 with a scale per 8 or 4 values (quantize_int8's x_block), meet
// the panel in tiles of GEMM_X_ROWS: each step broadcasts 4 of a row's values
// against the 16 rows' codes, so no lane ever needs a horizontal sum. The int32
// sums of the steps that share one of x's scales are converted and scaled once,
// a block's meet the group's weight scales once, and the biases meet the groups'
// sums of the rounded x at the end. Written once and built for each instruction
// set by the file that includes it, beside the row kernel (int8_rows_impl.h,
// whose dot product and code layout it shares); it defines INT8_GEMM(const
// Problem&, int n0, int n1). The panel is converted once for all of x's rows,
// about one row kernel pass over the weights, so this pays from about 4 rows
// (compute()'s GEMM_ROWS). From there to 7 rows x comes rounded per 4 values,
// as the row kernels take it, and from 8 rows (GEMM_X8_ROWS) per 8.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "int8_rows_impl.h"

namespace qmm {

namespace {

// Weight rows a panel holds: two vectors of 8 int32 lanes.
constexpr int PANEL_ROWS = 16;

// Rows of x a tile takes: their accumulators fit AVX-512's 32 vector registers
// at 8 (one int and one float vector each on 512 bits), AVX2's 16 at 3 and 2
// (two of each on 256 bits; maddubs needs a constant and a scratch register more
// than dpbusd).
#if defined(QMM_DOT_AVX512VNNI)
constexpr int GEMM_X_ROWS = 8;
#elif defined(QMM_DOT_AVXVNNI)
constexpr int GEMM_X_ROWS = 3;
#else
constexpr int GEMM_X_ROWS = 2;
#endif

#if defined(QMM_DOT_AVX512VNNI) || defined(QMM_DOT_AVXVNNI)
inline __m256i block_dot(__m256i sums, __m256i w, __m256i x) {
#if defined(QMM_DOT_AVX512VNNI)
  return _mm256_dpbusd_epi32(sums, w, x);
#else
  return _mm256_dpbusd_avx_epi32(sums, w, x);
#endif
}

inline __m256i block_sums(__m256i sums) {
  return sums;
}
#else
// maddubs's pairs summed in int16 over the block's 8 steps (at most 8 * 2 * 15 *
// 127 = 30480, under int16's limit for 4-bit codes), then madd into int32 once.
inline __m256i block_dot(__m256i sums, __m256i w, __m256i x) {
  return _mm256_add_epi16(sums, _mm256_maddubs_epi16(w, x));
}

inline __m256i block_sums(__m256i sums) {
  return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
}
#endif

// A panel: the codes [K / 4][16][4] bytes, the scales and biases [groups][16].
struct Panel {
  uint8_t* codes;
  float* scales;
  float* biases;
  // The next panel's weight rows, fetched `lines` cache lines a block by the
  // panel's first tile of x (nullptr: none, or a later tile).
  const char* ahead = nullptr;
  int lines = 0;
};

// Block b's share of the next panel's weight rows (none without one).
inline void fetch_next_panel(const Panel& panel, int b) {
  for (int line = 0; panel.ahead != nullptr && line < panel.lines; line++) {
    _mm_prefetch(panel.ahead + (b * panel.lines + line) * 64, _MM_HINT_T0);
  }
}

// The calling thread's panel room for K inputs in `groups` groups (kept between
// calls, as row_scale_room).
inline Panel panel_room(int K, int groups) {
  thread_local Room room;
  std::size_t codes = std::size_t(K) * PANEL_ROWS;
  std::size_t values = std::size_t(groups) * PANEL_ROWS * sizeof(float);
  char* data = room.reserve(codes + 2 * values + 64);
  // Each part 64-byte aligned (codes and values are multiples of 64 bytes).
  auto base =
      reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(data) + 63) & ~63);
  return {
      reinterpret_cast<uint8_t*>(base),
      reinterpret_cast<float*>(base + codes),
      reinterpret_cast<float*>(base + codes + values),
  };
}

// Eight vectors' int32 lanes transposed: out[j] holds lane j of rows[0..8].
inline void transpose_lanes(const __m256i rows[8], __m256i out[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  for (int h = 0; h < 2; h++) {
    __m256i* q = t + 4 * h;
    u[4 * h] = _mm256_unpacklo_epi64(q[0], q[2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(q[0], q[2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(q[1], q[3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(q[1], q[3]);
  }
  for (int j = 0; j < 4; j++) {
    out[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    out[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// The panel's scales and biases ([groups][16], zero past count): each row's as
// float32, then gathered a group at a time for 8 rows. Scattered one value at a
// time they took half of a batch's packing.
inline void pack_scales(const Problem& p, int n, int count, const Panel& panel) {
  int groups = p.K / p.group_size;
  // load_scales writes a row's groups rounded up to 8.
  int each = (groups + 7) / 8 * 8;
  thread_local Room room;
  auto table = reinterpret_cast<float*>(
      room.reserve(std::size_t(2) * PANEL_ROWS * each * sizeof(float)));
  for (int i = 0; i < count; i++) {
    load_scales(p, p.scales, n + i, table + std::size_t(i) * each);
    load_scales(p, p.biases, n + i, table + std::size_t(PANEL_ROWS + i) * each);
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i index = _mm256_mullo_epi32(lane, _mm256_set1_epi32(each));
  __m256 live[2];
  for (int half = 0; half < 2; half++) {
    __m256i row = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * half));
    live[half] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), row));
  }
  for (int g = 0; g < groups; g++) {
    for (int half = 0; half < 2; half++) {
      const float* rows = table + std::size_t(8 * half) * each + g;
      const float* bias_rows = rows + std::size_t(PANEL_ROWS) * each;
      __m256 none = _mm256_setzero_ps();
      _mm256_store_ps(
          panel.scales + g * PANEL_ROWS + 8 * half,
          _mm256_mask_i32gather_ps(none, rows, index, live[half], 4));
      _mm256_store_ps(
          panel.biases + g * PANEL_ROWS + 8 * half,
          _mm256_mask_i32gather_ps(none, bias_rows, index, live[half], 4));
    }
  }
}

#if defined(QMM_DOT_AVX512VNNI)
// pack_panel's 4-bit codes on 512 bits: each 4 bytes of a row's packed block
// hold its step t (low nibbles) and step t + 4 (high nibbles), so 16 rows' blocks
// go through one 16 x 4 transpose of int32 (two-source permutes) and a mask and
// shift per step, where the 256-bit pack unpacks each row first and transposes
// 8 x 8 twice (a batch of 8 rows spent as long packing as multiplying).
inline void pack_panel_512(const Problem& p, int n, int count, const Panel& panel) {
  int blocks = p.K / 32;
  std::size_t stride = std::size_t(p.K) * 4 / 32;
  const uint32_t* rows[PANEL_ROWS];
  for (int i = 0; i < PANEL_ROWS; i++) {
    // Rows past count read row n again (their codes are zeroed below).
    rows[i] = p.w + std::size_t(n + (i < count ? i : 0)) * stride;
  }
  __mmask16 live = __mmask16((1u << count) - 1);
  const __m512i mask = _mm512_set1_epi8(0x0f);
  // Int32 t of each row in a 4-row vector (row q at 4q): rows 0-7 from two vectors.
  __m512i pick[4];
  for (int t = 0; t < 4; t++) {
    alignas(64) int32_t at[16] = {};
    for (int r = 0; r < 8; r++) {
      at[r] = (r / 4) * 16 + (r % 4) * 4 + t;
    }
    pick[t] = _mm512_load_si512(at);
  }
  auto codes = reinterpret_cast<__m512i*>(panel.codes);
  for (int b = 0; b < blocks; b++, codes += 8) {
    __m512i quads[4];
    for (int v = 0; v < 4; v++) {
      auto block = [&](int i) {
        auto at = rows[4 * v + i] + 4 * b;
        return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
      };
      __m512i q = _mm512_castsi128_si512(block(0));
      q = _mm512_inserti32x4(q, block(1), 1);
      q = _mm512_inserti32x4(q, block(2), 2);
      quads[v] = _mm512_inserti32x4(q, block(3), 3);
    }
    for (int t = 0; t < 4; t++) {
      __m512i low = _mm512_permutex2var_epi32(quads[0], pick[t], quads[1]);
      __m512i high = _mm512_permutex2var_epi32(quads[2], pick[t], quads[3]);
      __m512i both = _mm512_shuffle_i64x2(low, high, 0x44);
      __m512i step = _mm512_maskz_mov_epi32(live, both);
      _mm512_store_si512(codes + t, _mm512_and_si512(step, mask));
      _mm512_store_si512(
          codes + t + 4, _mm512_and_si512(_mm512_srli_epi32(step, 4), mask));
    }
  }
  pack_scales(p, n, count, panel);
}
#endif

// Weight rows n..n + count (count <= 16) into the panel; rows past count are
// zero codes, scales and biases.
template <int BITS>
inline void pack_panel(const Problem& p, int n, int count, const Panel& panel) {
#if defined(QMM_DOT_AVX512VNNI)
  if constexpr (BITS == 4) {
    pack_panel_512(p, n, count, panel);
    return;
  }
#endif
  int blocks = p.K / 32;
  std::size_t stride = std::size_t(p.K) * BITS / 32;
  for (int half = 0; half < 2; half++) {
    const uint32_t* rows[8];
    for (int i = 0; i < 8; i++) {
      int row = half * 8 + i;
      rows[i] = row < count ? p.w + std::size_t(n + row) * stride : nullptr;
    }
    for (int b = 0; b < blocks; b++) {
      __m256i codes[8], steps[8];
      for (int i = 0; i < 8; i++) {
        codes[i] =
            rows[i] ? code_bytes<BITS>(rows[i] + b * BITS) : _mm256_setzero_si256();
      }
      transpose_lanes(codes, steps);
      auto out = reinterpret_cast<__m256i*>(panel.codes) + std::size_t(b) * 16 + half;
      for (int j = 0; j < 8; j++) {
        _mm256_store_si256(out + 2 * j, steps[j]);
      }
    }
  }
  pack_scales(p, n, count, panel);
}

// Rows m..m + R of x against the panel of weight rows n..n + count, x with a
// scale per XB values: 8 (a prompt's chunk: each two steps' sums convert
// once) or 4 (a batch's rows, rounded as the row kernels round them: each
// step's sums convert and meet their 4 values' scale); then a block's meet the
// weights' scales.
template <int XB, int R>
inline void gemm_tile(const Problem& p, const Panel& panel, int m, int n, int count) {
  int blocks = p.K / 32;
  int groups = p.K / p.group_size;
  int shift = __builtin_ctz(p.group_size / 32);
  const int8_t* xq[R];
  const float* xd[R];
  __m256 total[R][2];
  for (int r = 0; r < R; r++) {
    xq[r] = static_cast<const int8_t*>(p.xq) + std::size_t(m + r) * p.K;
    xd[r] = p.xd + std::size_t(m + r) * (p.K / XB);
    total[r][0] = total[r][1] = _mm256_setzero_ps();
  }
  auto codes = reinterpret_cast<const __m256i*>(panel.codes);
  for (int b = 0; b < blocks; b++, codes += 16) {
    fetch_next_panel(panel, b);
    const float* scales = panel.scales + (b >> shift) * PANEL_ROWS;
    __m256 low_scale = _mm256_load_ps(scales);
    __m256 high_scale = _mm256_load_ps(scales + 8);
    // Steps that share one of x's scales.
    constexpr int STEPS = XB / 4;
    __m256 block[R][2];
    for (int r = 0; r < R; r++) {
      block[r][0] = block[r][1] = _mm256_setzero_ps();
    }
    for (int j = 0; j < 8; j += STEPS) {
      __m256i sums[R][2];
      for (int r = 0; r < R; r++) {
        sums[r][0] = sums[r][1] = _mm256_setzero_si256();
      }
      for (int t = j; t < j + STEPS; t++) {
        __m256i low = _mm256_load_si256(codes + 2 * t);
        __m256i high = _mm256_load_si256(codes + 2 * t + 1);
        for (int r = 0; r < R; r++) {
          int four;
          __builtin_memcpy(&four, xq[r] + 32 * b + 4 * t, 4);
          __m256i x = _mm256_set1_epi32(four);
          sums[r][0] = block_dot(sums[r][0], low, x);
          sums[r][1] = block_dot(sums[r][1], high, x);
        }
      }
      for (int r = 0; r < R; r++) {
        __m256 d = _mm256_set1_ps(xd[r][(8 * b + j) / STEPS]);
        block[r][0] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums(sums[r][0])), d, block[r][0]);
        block[r][1] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums(sums[r][1])), d, block[r][1]);
      }
    }
    for (int r = 0; r < R; r++) {
      total[r][0] = _mm256_fmadd_ps(block[r][0], low_scale, total[r][0]);
      total[r][1] = _mm256_fmadd_ps(block[r][1], high_scale, total[r][1]);
    }
  }
  // The biases meet the groups' sums of the rounded x.
  for (int g = 0; g < groups; g++) {
    __m256 low_bias = _mm256_load_ps(panel.biases + g * PANEL_ROWS);
    __m256 high_bias = _mm256_load_ps(panel.biases + g * PANEL_ROWS + 8);
    for (int r = 0; r < R; r++) {
      __m256 s = _mm256_set1_ps(p.xsum[std::size_t(m + r) * groups + g]);
      total[r][0] = _mm256_fmadd_ps(low_bias, s, total[r][0]);
      total[r][1] = _mm256_fmadd_ps(high_bias, s, total[r][1]);
    }
  }
  for (int r = 0; r < R; r++) {
    float* y = p.y + std::size_t(m + r) * p.N + n;
    if (count == PANEL_ROWS) {
      _mm256_storeu_ps(y, total[r][0]);
      _mm256_storeu_ps(y + 8, total[r][1]);
    } else {
      alignas(32) float out[PANEL_ROWS];
      _mm256_store_ps(out, total[r][0]);
      _mm256_store_ps(out + 8, total[r][1]);
      for (int i = 0; i < count; i++) {
        y[i] = out[i];
      }
    }
  }
}

#if defined(QMM_DOT_AVX512VNNI)
// gemm_tile on 512 bits: a step's 16 rows of codes are one vector, so each
// broadcast of x meets them in one dpbusd and a block's sums convert and scale
// once for the 16 rows.
template <int XB, int R>
inline void gemm_tile_512(
    const Problem& p,
    const Panel& panel,
    int m,
    int n,
    int count) {
  int blocks = p.K / 32;
  int groups = p.K / p.group_size;
  int shift = __builtin_ctz(p.group_size / 32);
  const int8_t* xq[R];
  const float* xd[R];
  __m512 total[R];
  for (int r = 0; r < R; r++) {
    xq[r] = static_cast<const int8_t*>(p.xq) + std::size_t(m + r) * p.K;
    xd[r] = p.xd + std::size_t(m + r) * (p.K / XB);
    total[r] = _mm512_setzero_ps();
  }
  auto codes = reinterpret_cast<const __m512i*>(panel.codes);
  for (int b = 0; b < blocks; b++, codes += 8) {
    fetch_next_panel(panel, b);
    __m512 scale = _mm512_load_ps(panel.scales + (b >> shift) * PANEL_ROWS);
    constexpr int STEPS = XB / 4;
    __m512 block[R];
    for (int r = 0; r < R; r++) {
      block[r] = _mm512_setzero_ps();
    }
    for (int j = 0; j < 8; j += STEPS) {
      __m512i sums[R];
      for (int r = 0; r < R; r++) {
        sums[r] = _mm512_setzero_si512();
      }
      for (int t = j; t < j + STEPS; t++) {
        __m512i w = _mm512_load_si512(codes + t);
        for (int r = 0; r < R; r++) {
          int four;
          __builtin_memcpy(&four, xq[r] + 32 * b + 4 * t, 4);
          sums[r] = _mm512_dpbusd_epi32(sums[r], w, _mm512_set1_epi32(four));
        }
      }
      for (int r = 0; r < R; r++) {
        __m512 d = _mm512_set1_ps(xd[r][(8 * b + j) / STEPS]);
        block[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), d, block[r]);
      }
    }
    for (int r = 0; r < R; r++) {
      total[r] = _mm512_fmadd_ps(block[r], scale, total[r]);
    }
  }
  for (int g = 0; g < groups; g++) {
    __m512 bias = _mm512_load_ps(panel.biases + g * PANEL_ROWS);
    for (int r = 0; r < R; r++) {
      __m512 s = _mm512_set1_ps(p.xsum[std::size_t(m + r) * groups + g]);
      total[r] = _mm512_fmadd_ps(bias, s, total[r]);
    }
  }
  __mmask16 lanes = __mmask16((1u << count) - 1);
  for (int r = 0; r < R; r++) {
    _mm512_mask_storeu_ps(p.y + std::size_t(m + r) * p.N + n, lanes, total[r]);
  }
}
#endif

template <int XB, int R>
inline void gemm_x_tile(const Problem& p, const Panel& panel, int m, int n, int count) {
#if defined(QMM_DOT_AVX512VNNI)
  gemm_tile_512<XB, R>(p, panel, m, n, count);
#else
  gemm_tile<XB, R>(p, panel, m, n, count);
#endif
}

// The rows of x from m on, fewer than R, in one tile.
template <int XB, int R>
inline void gemm_rest(const Problem& p, const Panel& panel, int m, int n, int count) {
  if constexpr (R > 0) {
    if (p.M - m == R) {
      gemm_x_tile<XB, R>(p, panel, m, n, count);
    } else {
      gemm_rest<XB, R - 1>(p, panel, m, n, count);
    }
  }
}

template <int BITS, int XB>
void int8_gemm(const Problem& p, int n0, int n1) {
  Panel panel = panel_room(p.K, p.K / p.group_size);
  for (int n = n0; n < n1; n += PANEL_ROWS) {
    int count = std::min(PANEL_ROWS, n1 - n);
    pack_panel<BITS>(p, n, count, panel);
    // The next panel's rows stream in while this one's first tile computes: a
    // batch's few rows of x leave the packing waiting on memory otherwise.
    int next = std::max(0, std::min(PANEL_ROWS, n1 - n - PANEL_ROWS));
    std::size_t row_bytes = std::size_t(p.K) * BITS / 8;
    panel.ahead = nullptr;
    if (next > 0) {
      panel.ahead = reinterpret_cast<const char*>(p.w) + (n + PANEL_ROWS) * row_bytes;
      panel.lines = int((next * row_bytes + 64 * (p.K / 32) - 1) / (64 * (p.K / 32)));
    }
    int m = 0;
    for (; m + GEMM_X_ROWS <= p.M; m += GEMM_X_ROWS) {
      gemm_x_tile<XB, GEMM_X_ROWS>(p, panel, m, n, count);
      panel.ahead = nullptr;
    }
    gemm_rest<XB, GEMM_X_ROWS - 1>(p, panel, m, n, count);
  }
}

template <int BITS>
void int8_gemm_bits(const Problem& p, int n0, int n1) {
  if (p.x_block == 8) {
    int8_gemm<BITS, 8>(p, n0, n1);
  } else {
    int8_gemm<BITS, 4>(p, n0, n1);
  }
}

} // namespace

void INT8_GEMM(const Problem& p, int n0, int n1) {
  if (p.bits == 4) {
    int8_gemm_bits<4>(p, n0, n1);
  } else if constexpr (DOTS_8BIT) {
    int8_gemm_bits<8>(p, n0, n1);
  } else {
    throw std::logic_error("[quantized_matmul] 8-bit weights take the float32 kernel");
  }
}

} // namespace qmm
