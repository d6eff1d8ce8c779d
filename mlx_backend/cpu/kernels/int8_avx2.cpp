// The int8 row kernel for AVX2 (maddubs and madd): built with those flags, called only
// where the CPU has them.
#define INT8_ROWS rows_avx2_int8
#include "int8_rows_impl.h"
