/* matmul_pool.h - matmuls over a thread pool, for the forward pass (engine.c).
 *
 * kvr_matmul_pool converts the activation rows once (kvr_quantize_rows, into the caller's
 * scratch) and computes every output row of every matrix with kvr_matmul, split over the
 * pool's threads. Which thread computes a row never changes its bits (dtype.h). Allocates
 * nothing; call from the thread that drives the pool. */
#ifndef KVR_MODEL_MATMUL_POOL_H
#define KVR_MODEL_MATMUL_POOL_H

#include "core/pool.h"
#include "model/dtype.h"

#include <stdint.h>

/* Most matrices one call takes (Q/K/V, or gate/up). */
#define KVR_MATMUL_POOL_MAX 3

/* Multiply-adds below which a job runs on the calling thread alone (~20 us of work): waking
 * the pool costs microseconds. */
#define KVR_SMALL_WORK (256.0 * 1024)

/* y[i] (n_rows x w[i]->n_out floats, row stride n_out) = x . w[i] for i < n (at most
 * KVR_MATMUL_POOL_MAX), every w[i] with the same type and input width; x is n_rows x n_in
 * floats. xq is scratch for the converted rows: n_rows x kvr_act_row_bytes(type, n_in)
 * bytes. */
void kvr_matmul_pool(struct kvr_pool *pool, void *xq, const float *x, uint32_t n_rows, int n,
                     const struct kvr_matrix *const *w, float *const *y);

#endif
