/* kernels_avx512.c - the AVX-512 kernel set: F, BW, VL, DQ and VNNI, with FMA and F16C
 * (compiled with those -m flags; matmul.c calls it only after kvr_kernels_init has found
 * them in CPUID and the OS saving the opmask and zmm state in XCR0). The kernels are in
 * kernels_x86.inc with KVR_X86_VNNI set: the quantized dots run on vpdpbusd / vpdpwssd.
 * Types without an entry here (F32, F16, BF16) run the AVX2 kernels (the set's fallback). */
#define KVR_X86_VNNI 1
#define KVR_X86_SET kvr_kernels_avx512
#define KVR_X86_NAME "avx512"
#include "model/kernels_x86.inc"
