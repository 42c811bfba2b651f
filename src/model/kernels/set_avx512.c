/* kernels/set_avx512.c - the AVX-512 kernel set: F, BW, VL, DQ and VNNI, with FMA and F16C
 * (compiled with those -m flags; matmul.c calls it only after finding them in CPUID and the
 * OS saving the opmask and zmm state in XCR0). The kernel families are the .inc files beside
 * this one, shared with the AVX2 set, with KVR_X86_VNNI set: the quantized dots run on
 * vpdpbusd / vpdpwssd. pairs512.inc adds the kernels that compute both tiles of a packed
 * pair at once. */
#define KVR_X86_VNNI 1
#define KVR_X86_SET kvr_kernels_avx512
#define KVR_X86_NAME "avx512"

#include "model/kernels/common.inc"
#include "model/kernels/quantize.inc"
#include "model/kernels/q8_0.inc"
#include "model/kernels/kquant_inplace.inc"
#include "model/kernels/kquant_packed.inc"
#include "model/kernels/kquant_unpack.inc"
#include "model/kernels/mxfp4.inc"
#include "model/kernels/legacy.inc"
#include "model/kernels/float.inc"
#include "model/kernels/pairs512.inc"
#include "model/kernels/set_table.inc"
