/* kernels_avx2.c - AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; called only
 * after kvr_kernels_init has checked the CPU). */
#include "model/kernels.h"

const struct kvr_kernel_set kvr_kernels_avx2 = {.name = "avx2", .o_tile = 1};
