/* kernels/set_avx2.c - the AVX2 + FMA + F16C kernel set (compiled with -mavx2 -mfma
 * -mf16c; matmul.c calls it only after checking the CPU). The kernel families are the .inc
 * files beside this one, shared with the AVX-512 set. */
#define KVR_X86_VNNI 0
#define KVR_X86_SET kvr_kernels_avx2
#define KVR_X86_NAME "avx2"

#include "model/kernels/common.inc"
#include "model/kernels/quantize.inc"
#include "model/kernels/q8_0.inc"
#include "model/kernels/kquant_inplace.inc"
#include "model/kernels/kquant_packed.inc"
#include "model/kernels/kquant_unpack.inc"
#include "model/kernels/mxfp4.inc"
#include "model/kernels/legacy.inc"
#include "model/kernels/float.inc"
#include "model/kernels/set_table.inc"
