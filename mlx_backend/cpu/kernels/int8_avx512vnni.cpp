// The int8 row kernel and GEMM for AVX512-VNNI with VL
// (vpdpbusd on 256 bits): built with those flags, called only
// where the CPU has them.
#define QMM_DOT_AVX512VNNI
#define INT8_ROWS rows_avx512vnni_int8
#define INT8_GEMM gemm_avx512vnni_int8
#include "int8_gemm_impl.h"
