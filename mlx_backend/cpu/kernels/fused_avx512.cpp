// The fused operations' row kernels built for AVX-512 (F, VL, BW, DQ; called only
// when the CPU has them): the same code as AVX2's, which the compiler widens to
// 512 bits and 32 vector registers (attention's tiles of rows no longer spill).
#define FUSED_ISA avx512
#define FUSED_ISA_NAME "avx512"
#include "fused_rows_impl.h"

namespace qmm::fused {

RowKernels avx512_rows() {
  return avx512::rows();
}

} // namespace qmm::fused
