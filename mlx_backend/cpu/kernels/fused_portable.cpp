// The fused operations' row kernels as plain C++, for any CPU (NEON on aarch64).
#define FUSED_ISA portable
#define FUSED_ISA_NAME "portable"
#include "fused_rows_impl.h"

namespace qmm::fused {

RowKernels portable_rows() {
  return portable::rows();
}

} // namespace qmm::fused
