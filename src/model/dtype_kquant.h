/* dtype_kquant.h - internal to src/model: the reference kernels of the K-quants and Q8_K
 * (dtype_kquant.c), which the trait table of dtype.c points at. Use them through
 * kvr_dtype_traits; the contracts are those of struct kvr_dtype_traits (n is a multiple of
 * 256). Pure functions, callable from any thread. */
#ifndef KVR_MODEL_DTYPE_KQUANT_H
#define KVR_MODEL_DTYPE_KQUANT_H

#include <stdint.h>

void kvr_q8_k_to_float(const void *src, float *dst, int64_t n);
void kvr_q8_k_from_float(const float *src, void *dst, int64_t n);
float kvr_q8_k_dot(int64_t n, const void *w, const void *x);
void kvr_q4_k_to_float(const void *src, float *dst, int64_t n);
void kvr_q4_k_from_float(const float *src, void *dst, int64_t n);
float kvr_q4_k_dot(int64_t n, const void *w, const void *x);
void kvr_q6_k_to_float(const void *src, float *dst, int64_t n);
void kvr_q6_k_from_float(const float *src, void *dst, int64_t n);
float kvr_q6_k_dot(int64_t n, const void *w, const void *x);
void kvr_q2_k_to_float(const void *src, float *dst, int64_t n);
void kvr_q2_k_from_float(const float *src, void *dst, int64_t n);
float kvr_q2_k_dot(int64_t n, const void *w, const void *x);
void kvr_q3_k_to_float(const void *src, float *dst, int64_t n);
void kvr_q3_k_from_float(const float *src, void *dst, int64_t n);
float kvr_q3_k_dot(int64_t n, const void *w, const void *x);
void kvr_q5_k_to_float(const void *src, float *dst, int64_t n);
void kvr_q5_k_from_float(const float *src, void *dst, int64_t n);
float kvr_q5_k_dot(int64_t n, const void *w, const void *x);

#endif
