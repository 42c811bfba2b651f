/* attn.h - internal to src/model: the two inner loops of attention (a query-key dot and a
 * weighted sum of values), with a plain version and an AVX2 one. The engine picks one set
 * for the whole process together with the matmul kernels (kvr_kernels_name), so every row
 * of every batch uses the same arithmetic: batch invariance holds within a process. */
#ifndef KVR_MODEL_ATTN_H
#define KVR_MODEL_ATTN_H

#include <stdint.h>

struct kvr_attn_ops {
    float (*dot)(const float *a, const float *b, uint32_t n); /* sum a[i] * b[i] */
    void (*axpy)(float *y, float a, const float *x, uint32_t n); /* y += a * x */
};

extern const struct kvr_attn_ops kvr_attn_ops_avx2;

#endif
