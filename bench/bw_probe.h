/* bw_probe.h - the read-bandwidth probe shared by bench_bandwidth and bench_kernels (a
 * header of static functions: each bench is one file and one executable).
 *
 * Every pool thread sums its contiguous share of a buffer much larger than the last-level
 * cache with 256-bit loads into 4 independent accumulators; bytes read / wall time is the
 * roof a weight-streaming GEMV can reach. Call only after checking the CPU has AVX2 (and
 * AVX-512F for the two other read kernels, which exist to check that the first one is the
 * roof: 512-bit loads, and the same with a software prefetch 4 KiB ahead). */
#ifndef KVR_BENCH_BW_PROBE_H
#define KVR_BENCH_BW_PROBE_H

#include "core/clock.h"
#include "core/pool.h"

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

enum bw_kernel { BW_AVX2, BW_AVX512, BW_AVX512_PREFETCH, BW_N_KERNELS };

struct bw_job {
    enum bw_kernel kernel; /* BW_AVX2 unless set */
    const uint8_t *buf;    /* 4096-aligned, n_bytes a multiple of 4096, every page touched */
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

__attribute__((target("avx512f"))) static uint64_t bw_sum_avx512(const uint8_t *p, size_t n,
                                                                 int prefetch)
{
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 256 <= n; i += 256) {
        if (prefetch) /* past the end of the share is harmless: a prefetch never faults */
            for (int l = 0; l < 4; l++)
                _mm_prefetch((const char *)p + i + 4096 + 64 * l, _MM_HINT_T0);
        a0 = _mm512_add_epi64(a0, _mm512_load_si512((const void *)(p + i)));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512((const void *)(p + i + 64)));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512((const void *)(p + i + 128)));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512((const void *)(p + i + 192)));
    }
    return (uint64_t)_mm512_reduce_add_epi64(
        _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
}

static void bw_run(void *arg, int ith, int nth)
{
    struct bw_job *job = arg;
    long b, e;
    kvr_split_range((long)(job->n_bytes / 4096), ith, nth, &b, &e);
    const uint8_t *p = job->buf + (size_t)b * 4096;
    size_t n = (size_t)(e - b) * 4096;
    job->sink[8 * (ith % 64)] += job->kernel == BW_AVX2
                                     ? bw_sum_avx2(p, n)
                                     : bw_sum_avx512(p, n, job->kernel == BW_AVX512_PREFETCH);
}

/* One timed pass of the read kernel over the whole buffer, in GB/s. */
static double bandwidth_once(struct kvr_pool *pool, struct bw_job *job)
{
    uint64_t t0 = kvr_now_ns();
    kvr_pool_run(pool, bw_run, job);
    return (double)job->n_bytes / (double)(kvr_now_ns() - t0);
}

#endif
