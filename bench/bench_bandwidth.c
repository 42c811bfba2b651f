/* bench_bandwidth.c - memory read bandwidth: the roof a weight-streaming GEMV can reach.
 *
 * Fills a buffer much larger than the last-level cache, then has every pool thread sum its
 * contiguous share with 256-bit loads (4 independent accumulators), and reports the median
 * over the repeats of bytes read / wall time. Usage:
 *   bench_bandwidth [--mib 1024] [--threads 2] [--reps 7] [--huge 0|1] [--kernel avx2|all]
 * Prints one line per repeat and a final "median" line; the kernel benchmark and peer.sh
 * compare decode against this number. `--kernel all` checks that it is the roof: every
 * repeat runs the three read kernels of bw_probe.h in turn (256-bit loads, 512-bit loads,
 * 512-bit loads with a software prefetch), and a median line per kernel follows. */
#include "core/alloc.h"
#include "core/clock.h"
#include "core/pool.h"

#include "bw_probe.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    long mib = 1024, n_threads = 2, reps = 7, huge = 0;
    int n_kernels = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--mib"))
            mib = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads"))
            n_threads = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--huge"))
            huge = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps"))
            reps = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--kernel") && !strcmp(argv[i + 1], "avx2"))
            n_kernels = 1;
        else if (!strcmp(argv[i], "--kernel") && !strcmp(argv[i + 1], "all"))
            n_kernels = BW_N_KERNELS;
        else {
            fprintf(
                stderr,
                "usage: %s [--mib N] [--threads N] [--reps N] [--huge 0|1] [--kernel avx2|all]\n",
                argv[0]);
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
    if (n_kernels > 1 && !__builtin_cpu_supports("avx512f")) {
        fprintf(stderr, "no avx512f: only the avx2 read kernel\n");
        n_kernels = 1;
    }
    size_t n_bytes = (size_t)mib << 20;
    uint8_t *buf = kvr_aligned_alloc(4096, n_bytes);
    double *gbs = kvr_calloc((size_t)(reps * n_kernels), sizeof *gbs);
    struct kvr_pool *pool = kvr_pool_create((int)n_threads);
    if (!buf || !gbs || !pool) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    if (buf && huge) /* transparent huge pages: fewer TLB misses, as for a copied model */
        madvise(buf, n_bytes, MADV_HUGEPAGE);
    memset(buf, 1, n_bytes); /* fault every page in before timing */
    struct bw_job *job = kvr_calloc(1, sizeof *job);
    if (!job) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    job->buf = buf;
    job->n_bytes = n_bytes;
    static const char *const names[BW_N_KERNELS] = {"avx2", "avx512", "avx512+prefetch"};
    bandwidth_once(pool, job); /* warm-up */
    for (long r = 0; r < reps; r++) {
        for (int k = 0; k < n_kernels; k++) { /* kernel k's repeats at gbs[k * reps ...] */
            job->kernel = (enum bw_kernel)k;
            gbs[k * reps + r] = bandwidth_once(pool, job);
            printf("rep %ld: %.2f GB/s%s%s\n", r, gbs[k * reps + r], n_kernels > 1 ? " " : "",
                   n_kernels > 1 ? names[k] : "");
        }
    }
    for (int k = 0; k < n_kernels; k++) {
        double *g = gbs + k * reps;
        qsort(g, (size_t)reps, sizeof *g, cmp_double);
        printf("median read bandwidth%s%s: %.2f GB/s (%ld MiB, %ld threads, %ld reps, huge %ld; "
               "min %.2f max %.2f)\n",
               n_kernels > 1 ? ", " : "", n_kernels > 1 ? names[k] : "", g[reps / 2], mib,
               n_threads, reps, huge, g[0], g[reps - 1]);
    }
    kvr_pool_destroy(pool);
    kvr_free(job);
    kvr_free(gbs);
    kvr_free(buf);
    return 0;
}
