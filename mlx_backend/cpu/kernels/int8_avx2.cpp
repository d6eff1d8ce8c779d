// The int8 row kernel and GEMM for AVX2 (maddubs and madd), and the AVX2
// quantizer of x that every x86 int8 kernel reads: built with those flags,
// called only where the CPU has them.
#define INT8_ROWS rows_avx2_int8
#define INT8_GEMM gemm_avx2_int8
#include "int8_gemm_impl.h"

namespace qmm {

namespace {

// 32 values of x in the order the kernels meet a block's codes: for 4 bits,
// the even values then the odd ones.
inline void kernel_order(__m256 v[4]) {
  __m256 even[2], odd[2];
  for (int h = 0; h < 2; h++) {
    // Per 128-bit lane: values 0, 2 of each vector (then 1, 3), whose 64-bit
    // halves then go in order.
    __m256 e = _mm256_shuffle_ps(v[2 * h], v[2 * h + 1], _MM_SHUFFLE(2, 0, 2, 0));
    __m256 o = _mm256_shuffle_ps(v[2 * h], v[2 * h + 1], _MM_SHUFFLE(3, 1, 3, 1));
    even[h] = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
    odd[h] = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
  }
  v[0] = even[0];
  v[1] = even[1];
  v[2] = odd[0];
  v[3] = odd[1];
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 127 / amax, 0 where amax is 0 (x's values there are all 0).
inline __m256 inverse_step(__m256 amax) {
  __m256 inverse = _mm256_div_ps(_mm256_set1_ps(127.0f), amax);
  return _mm256_and_ps(inverse, _mm256_cmp_ps(amax, _mm256_setzero_ps(), _CMP_GT_OQ));
}

} // namespace

void quantize_int8_avx2(
    const Problem& p,
    int m0,
    int m1,
    int8_t* xq,
    float* xs,
    float* xsum) {
  if (p.x_block != 4 && p.x_block != 8) {
    throw std::logic_error("[quantized_matmul] x is rounded per 4 or 8 values");
  }
  int groups = p.K / p.group_size;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int m = m0; m < m1; m++) {
    const float* x = p.x + std::size_t(m) * p.K;
    int8_t* q = xq + std::size_t(m) * p.K;
    float* scales = xs + std::size_t(m) * (p.K / p.x_block);
    float* sums = xsum + std::size_t(m) * groups;
    for (int g = 0; g < groups; g++) {
      sums[g] = 0.0f;
    }
    for (int k0 = 0; k0 < p.K; k0 += 32) {
      __m256 v[4];
      for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + k0 + 8 * j);
      }
      if (p.bits == 4) {
        kernel_order(v);
      }
      __m256i values[4];
      __m256 total = _mm256_setzero_ps();
      if (p.x_block == 8) {
        // Each vector is one block.
        for (int j = 0; j < 4; j++) {
          float top = horizontal_max(_mm256_andnot_ps(sign, v[j]));
          values[j] = _mm256_cvtps_epi32(
              _mm256_mul_ps(v[j], inverse_step(_mm256_set1_ps(top))));
          float step = top / 127.0f;
          scales[(k0 + 8 * j) / 8] = step;
          total = _mm256_fmadd_ps(
              _mm256_set1_ps(step), _mm256_cvtepi32_ps(values[j]), total);
        }
      } else {
        // x_block 4: each 128-bit lane is one block, its max spread over it.
        for (int j = 0; j < 4; j++) {
          __m256 a = _mm256_andnot_ps(sign, v[j]);
          a = _mm256_max_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
          a = _mm256_max_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
          __m256 step = _mm256_div_ps(a, _mm256_set1_ps(127.0f));
          values[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse_step(a)));
          total = _mm256_fmadd_ps(step, _mm256_cvtepi32_ps(values[j]), total);
          float* out = scales + (k0 + 8 * j) / 4;
          out[0] = _mm256_cvtss_f32(step);
          out[1] = _mm_cvtss_f32(_mm256_extractf128_ps(step, 1));
        }
      }
      __m256i low = _mm256_packs_epi32(values[0], values[1]);
      __m256i high = _mm256_packs_epi32(values[2], values[3]);
      __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(low, high), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), bytes);
      sums[k0 / p.group_size] += horizontal_sum(total);
    }
  }
}

} // namespace qmm
