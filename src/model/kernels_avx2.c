/* kernels_avx2.c - the AVX2 + FMA + F16C kernel set (compiled with -mavx2 -mfma -mf16c;
 * matmul.c calls it only after kvr_kernels_init has checked the CPU). The kernels are in
 * kernels_x86.inc, shared with the AVX-512 set. */
#define KVR_X86_VNNI 0
#define KVR_X86_SET kvr_kernels_avx2
#define KVR_X86_NAME "avx2"
#include "model/kernels_x86.inc"
