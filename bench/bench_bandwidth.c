/* bench_bandwidth.c - memory read bandwidth: the roof a weight-streaming GEMV can reach.
 *
 * Fills a buffer much larger than the last-level cache, then has every pool thread sum its
 * contiguous share with 256-bit loads (4 independent accumulators), and reports the median
 * over the repeats of bytes read / wall time. Usage:
 *   bench_bandwidth [--mib 1024] [--threads 2] [--reps 7] [--huge 0|1]
 * Prints one line per repeat and a final "median" line; the kernel benchmark compares its
 * GEMV against this number. */
#include "core/alloc.h"
#include "core/clock.h"
#include "core/pool.h"

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

struct job {
    const uint8_t *buf;
    size_t n_bytes;
    uint64_t sink[64]; /* one slot per thread (8 apart) so the sum is not optimized away */
};

__attribute__((target("avx2"))) static uint64_t sum_avx2(const uint8_t *p, size_t n)
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

static void run(void *arg, int ith, int nth)
{
    struct job *job = arg;
    size_t n_chunks = job->n_bytes / 4096;
    long b, e;
    kvr_split_range((long)n_chunks, ith, nth, &b, &e);
    job->sink[8 * (ith % 8)] += sum_avx2(job->buf + (size_t)b * 4096, (size_t)(e - b) * 4096);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    long mib = 1024, n_threads = 2, reps = 7, huge = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--mib"))
            mib = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads"))
            n_threads = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--huge"))
            huge = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps"))
            reps = atol(argv[i + 1]);
        else {
            fprintf(stderr, "usage: %s [--mib N] [--threads N] [--reps N] [--huge 0|1]\n", argv[0]);
            return 2;
        }
    }
    if (mib < 1 || n_threads < 1 || n_threads > 64 || reps < 1 || reps > 1000) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    if (!__builtin_cpu_supports("avx2")) {
        fprintf(stderr, "skipped: no avx2\n");
        return 0;
    }
    size_t n_bytes = (size_t)mib << 20;
    uint8_t *buf = kvr_aligned_alloc(4096, n_bytes);
    double *gbs = kvr_calloc((size_t)reps, sizeof *gbs);
    struct kvr_pool *pool = kvr_pool_create((int)n_threads);
    if (!buf || !gbs || !pool) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    if (buf && huge) /* transparent huge pages: fewer TLB misses, as for a copied model */
        madvise(buf, n_bytes, MADV_HUGEPAGE);
    memset(buf, 1, n_bytes); /* fault every page in before timing */
    struct job job = {.buf = buf, .n_bytes = n_bytes};
    kvr_pool_run(pool, run, &job); /* warm-up */
    for (long r = 0; r < reps; r++) {
        uint64_t t0 = kvr_now_ns();
        kvr_pool_run(pool, run, &job);
        uint64_t t1 = kvr_now_ns();
        gbs[r] = (double)n_bytes / (double)(t1 - t0);
        printf("rep %ld: %.2f GB/s\n", r, gbs[r]);
    }
    qsort(gbs, (size_t)reps, sizeof *gbs, cmp_double);
    printf("median read bandwidth: %.2f GB/s (%ld MiB, %ld threads, %ld reps, huge %ld; min %.2f max %.2f)\n",
           gbs[reps / 2], mib, n_threads, reps, huge, gbs[0], gbs[reps - 1]);
    kvr_pool_destroy(pool);
    kvr_free(gbs);
    kvr_free(buf);
    return 0;
}
