// The fused operations' row kernels built for AVX2 and FMA (called only when the
// CPU has them).
#define FUSED_ISA avx2
#define FUSED_ISA_NAME "avx2"
#include "fused_rows_impl.h"

namespace qmm::fused {

RowKernels avx2_rows() {
  return avx2::rows();
}

} // namespace qmm::fused
