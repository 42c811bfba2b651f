/* bw_probe.h - the read-bandwidth probe shared by bench_bandwidth and bench_kernels (a
 * header of static functions: each bench is one file and one executable).
 *
 * Every pool thread sums its contiguous share of a buffer much larger than the last-level
 * cache with 256-bit loads into 4 independent accumulators; bytes read / wall time is the
 * roof a weight-streaming GEMV can reach. Call only after checking the CPU has AVX2. */
#ifndef KVR_BENCH_BW_PROBE_H
#define KVR_BENCH_BW_PROBE_H

#include "core/clock.h"
#include "core/pool.h"

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

struct bw_job {
    const uint8_t *buf; /* 4096-aligned, n_bytes a multiple of 4096, every page touched */
    size_t n_bytes;
    volatile uint64_t sink[8 * 64]; /* per thread, 8 apart: the sums are not optimized away */
};

__attribute__((target("avx2"))) static uint64_t bw_sum_avx2(const uint8_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, s);
    return out[0] + out[1] + out[2] + out[3];
}

static void bw_run(void *arg, int ith, int nth)
{
    struct bw_job *job = arg;
    long b, e;
    kvr_split_range((long)(job->n_bytes / 4096), ith, nth, &b, &e);
    job->sink[8 * (ith % 64)] += bw_sum_avx2(job->buf + (size_t)b * 4096, (size_t)(e - b) * 4096);
}

/* One timed pass of the read kernel over the whole buffer, in GB/s. */
static double bandwidth_once(struct kvr_pool *pool, struct bw_job *job)
{
    uint64_t t0 = kvr_now_ns();
    kvr_pool_run(pool, bw_run, job);
    return (double)job->n_bytes / (double)(kvr_now_ns() - t0);
}

#endif
