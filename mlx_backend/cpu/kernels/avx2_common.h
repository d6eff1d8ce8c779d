// What the AVX2 kernels share (avx2.cpp and the int8 kernels built for wider
// instruction sets): loading a row's scales, reductions, and each row's output.
// Internal linkage: each file that includes it builds its own copy for its flags.
#pragma once

#include <immintrin.h>

#include <cstring>
#include <utility>

#include "qmm.h"

namespace qmm {

namespace {

// How far ahead of its reads a row kernel asks for weights: a decode step streams
// them from memory, and the hardware prefetcher alone leaves the kernel waiting
// (1.1x to 1.6x on the 2-core EPYC, single thread).
constexpr int AHEAD_BYTES = 2048;

inline void fetch_ahead(const void* at, std::size_t ahead = AHEAD_BYTES) {
  _mm_prefetch(static_cast<const char*>(at) + ahead, _MM_HINT_T0);
}

// Row n's scales (or biases) as float32, into room for its groups rounded up to 8.
// Half floats go 8 at a time, the last 8 read on into the next rows' (a few bytes
// of rows that are read anyway); where that would pass the array's end, the row
// ends through a zeroed vector.
inline void load_scales(const Problem& p, const void* base, int n, float* out) {
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
  // 8 at a time while the 8 stay within the array (a row's last 8 may read on
  // into the rows after it, however few groups a row has).
  std::size_t end = std::size_t(p.N) * groups;
  int g = 0;
  for (; g + 8 <= groups || (g < groups && offset + g + 8 <= end); g += 8) {
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

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A row's scales or biases read where they are stored (ST: their type), for the
// float kernels: no float32 copy of each row first.
template <ScaleType ST>
inline __m128 two_values(const void* row, int a, int b) {
  if constexpr (ST == ScaleType::f32) {
    auto f = static_cast<const float*>(row);
    return _mm_unpacklo_ps(_mm_load_ss(f + a), _mm_load_ss(f + b));
  } else {
    auto h = static_cast<const uint16_t*>(row);
    __m128i v = _mm_cvtsi32_si128(int(h[a] | uint32_t(h[b]) << 16));
    if constexpr (ST == ScaleType::f16) {
      return _mm_cvtph_ps(v);
    } else {
      return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(v), 16));
    }
  }
}

// Values [g, g + 8) of a row, when all 8 are in it.
template <ScaleType ST>
inline __m256 eight_values(const void* row, int g) {
  if constexpr (ST == ScaleType::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + g);
  } else {
    auto h = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + g);
    __m128i v = _mm_loadu_si128(h);
    if constexpr (ST == ScaleType::f16) {
      return _mm256_cvtph_ps(v);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
  }
}

// Each row's output for weight row n: its scaled group sums, plus the biases met
// with x's exact group sums, both in the row's vector before its one reduction.
template <int ROWS, ScaleType ST = ScaleType::f32>
inline void store_rows(
    const Problem& p,
    int n,
    int m,
    __m256 total[ROWS],
    const void* biases) {
  int groups = p.K / p.group_size;
  int g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m256 b = eight_values<ST>(biases, g);
    for (int r = 0; r < ROWS; r++) {
      const float* xsum = p.xsum + std::size_t(m + r) * groups;
      total[r] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xsum + g), total[r]);
    }
  }
  if (g < groups && groups >= 8) {
    // The row's last 8 values, the lanes already met masked off.
    int from = groups - 8;
    __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 fresh = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(lanes, _mm256_set1_epi32(g - from - 1)));
    __m256 b = _mm256_and_ps(eight_values<ST>(biases, from), fresh);
    for (int r = 0; r < ROWS; r++) {
      const float* xsum = p.xsum + std::size_t(m + r) * groups;
      total[r] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xsum + from), total[r]);
    }
  } else if (g < groups) {
    float b[8];
    for (int i = 0; i < groups; i++) {
      b[i] = _mm_cvtss_f32(two_values<ST>(biases, i, i));
    }
    for (int r = 0; r < ROWS; r++) {
      const float* xsum = p.xsum + std::size_t(m + r) * groups;
      float dot = 0.0f;
      for (int i = 0; i < groups; i++) {
        dot += b[i] * xsum[i];
      }
      total[r] = _mm256_add_ps(total[r], _mm256_setr_ps(dot, 0, 0, 0, 0, 0, 0, 0));
    }
  }
  for (int r = 0; r < ROWS; r++) {
    p.y[std::size_t(m + r) * p.N + n] = horizontal_sum(total[r]);
  }
}

// A thread's scratch (thread_local), freed when the thread ends: the pool's
// workers are made again at each set_threads.
struct Room {
  char* data = nullptr;
  std::size_t size = 0;

  char* reserve(std::size_t need) {
    if (need > size) {
      delete[] data;
      data = new char[need];
      size = need;
    }
    return data;
  }

  ~Room() {
    delete[] data;
  }
};

// Room for a weight row's scales and biases as float32, rounded up to 8 (the
// calling thread's, kept between calls; plain pointers, since a thread_local
// reached from a loop costs a TLS lookup a row). No std::vector: its members are
// shared across the library's files, and one built here with AVX-512's flags
// could be the copy that a CPU without them runs.
inline std::pair<float*, float*> row_scale_room(int groups) {
  thread_local Room room;
  int each = groups + 8;
  auto scales = reinterpret_cast<float*>(room.reserve(2 * each * sizeof(float)));
  return {scales, scales + each};
}

// tile.operator()<R>(m) over rows m..M of x: tiles of 4, then the 1 to 3 rows
// left.
template <typename Tile>
inline void x_tiles(int m, int M, Tile&& tile) {
  for (; m + 4 <= M; m += 4) {
    tile.template operator()<4>(m);
  }
  switch (M - m) {
    case 3:
      tile.template operator()<3>(m);
      break;
    case 2:
      tile.template operator()<2>(m);
      break;
    case 1:
      tile.template operator()<1>(m);
      break;
  }
}

} // namespace

} // namespace qmm
