// The int8 row kernel for AVX-VNNI (vpdpbusd): built with those flags, called only
// where the CPU has them.
#define QMM_DOT_AVXVNNI
#define INT8_ROWS rows_avxvnni_int8
#include "int8_rows_impl.h"
