// The int8 row kernel and GEMM for AVX-VNNI (vpdpbusd): built with those flags,
// called only where the CPU has them.
#define QMM_DOT_AVXVNNI
#define INT8_ROWS rows_avxvnni_int8
#define INT8_GEMM gemm_avxvnni_int8
#include "int8_gemm_impl.h"
