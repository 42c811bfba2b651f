/* bench_kernels.c - matmul kernel throughput: GEMV against memory bandwidth, GEMM in GOP/s.
 *
 * For each weight type and shape (n_out x n_in):
 *   gemv: n_rows = 1 over enough distinct copies of the matrix to exceed the last-level
 *         cache several times (like a decode step walking through its layers), so weights
 *         stream from DRAM. Reports GB/s of weight bytes and its ratio to the read
 *         bandwidth (bench_bandwidth's method, same threads), measured in a pass right
 *         before each repeat; the ratio is the median of the per-repeat ratios.
 *   gemm: n_rows = --rows (default 128) over copies of the matrix filling 64 MiB (beyond
 *         the L3, so weights come from DRAM once per call, as in prefill); reports GOP/s
 *         counting a multiply-add as 2 operations, and the time per matrix.
 * Every figure is the median of --reps repeats (default 7, at least 5). Threads come from
 * the core pool and split output rows with kvr_matmul_split. Usage:
 *   bench_kernels [--types q8_0,q4_0,...] [--shapes 2048x2048,5632x2048] [--threads 2]
 *                 [--rows 128] [--reps 7] [--gemv-mib 512] [--reference] [--pack 0|1|2]
 *                 [--huge 0|1] [--dispatch N]
 * --pack 1 (Q8_0 and Q4_0) also times the GEMM on packed copies of the matrices
 * (kvr_matrix_pack, as the engine makes them), each repeat right after a plain one, and
 * prints the packed GOP/s and the median of the per-repeat speed-ups (plain time / packed
 * time: both sides of a pair see the same load). The GEMV reads the plain weights, unless
 * --pack 2: then every matrix of every pass is packed first, as the engine does (the
 * K-quants' GEMV and GEMM both read the packed copy; Q8_0 and Q4_0 only their GEMM).
 * --huge 1 puts the weights, their packed copies and the bandwidth probe's buffer in
 * transparent huge pages (2 MiB aligned, MADV_HUGEPAGE before the first touch, as the
 * engine's packed copy); "thp" is the process's AnonHugePages, to see the kernel gave them.
 * --dispatch N runs the GEMV as a decode step does: one pool job per matrix, split into N
 * chunks per thread of whole 16-row groups (the engine uses 4), a barrier after each; by
 * default one job covers all the matrices and each thread streams its share of every one.
 * Activation quantization is not timed (the forward pass does it once per matmul input).
 * With --threads 1 the caller runs the kernels itself, so the process CPU time of a call is
 * the kernel's own cost, whatever else the machine runs: "cpu" gives the least of the
 * repeats for the hot GEMV and the GEMM (on a loaded machine, compare those). */
#include "core/alloc.h"
#include "core/clock.h"
#include "core/pool.h"
#include "model/dtype.h"
#include "model/engine.h"

#include "bw_probe.h"
#include "smaps.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define MAX_COPIES 4096

static double cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

/* ---- matmul jobs ---- */

struct mm_job {
    const struct kvr_matrix *w; /* n_mats matrices, run one after the other */
    int n_mats;
    const void *xq;
    int64_t n_rows;
    float *y;
};

static void mm_run(void *arg, int ith, int nth)
{
    struct mm_job *job = arg;
    for (int m = 0; m < job->n_mats; m++) {
        int64_t b, e;
        kvr_matmul_split(job->w[m].n_out, ith, nth, &b, &e);
        if (b < e)
            kvr_matmul(&job->w[m], job->xq, job->n_rows, job->y, job->w[m].n_out, b, e);
    }
}

/* One matrix split into chunks of whole 16-row groups, as the engine's decode dispatch. */
static void mm_chunk(void *arg, int c, int n)
{
    struct mm_job *job = arg;
    long groups = (long)((job->w->n_out + 15) / 16), b, e;
    kvr_split_range(groups, c, n, &b, &e);
    int64_t ob = (int64_t)b * 16, oe = (int64_t)e * 16 < job->w->n_out ? e * 16 : job->w->n_out;
    if (ob < oe)
        kvr_matmul(job->w, job->xq, job->n_rows, job->y, job->w->n_out, ob, oe);
}

static int g_dispatch; /* --dispatch */

/* The GEMV over all of job's matrices: one pool job for all (each thread's share of every
 * matrix, no barrier in between), or with --dispatch N one per matrix in N chunks per
 * thread, as a forward pass runs them (a barrier after each). */
static void gemv_pass(struct kvr_pool *pool, struct mm_job *job)
{
    if (!g_dispatch) {
        kvr_pool_run(pool, mm_run, job);
        return;
    }
    for (int m = 0; m < job->n_mats; m++) {
        struct mm_job one = *job;
        one.w = &job->w[m];
        one.n_mats = 1;
        kvr_pool_run_chunks(pool, mm_chunk, &one, g_dispatch * kvr_pool_size(pool));
    }
}

static uint64_t rng = 88172645463325252ull;
static float frand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)(rng >> 40) / (float)(1ull << 24) - 0.5f;
}

static int parse_type(const char *s)
{
    for (int t = 0; t < KVR_DTYPE_COUNT; t++) /* every weight type of the trait table */
        if (t != KVR_DTYPE_Q8_K && kvr_dtype_traits(t) && !strcmp(kvr_dtype_traits(t)->name, s))
            return t;
    return -1;
}

static int g_huge; /* --huge */

/* A buffer for weights: 2 MiB aligned and advised MADV_HUGEPAGE before its first touch with
 * --huge 1 (as the engine's packed copy), else 64-byte aligned. */
static void *wmalloc(size_t bytes)
{
    if (!g_huge)
        return kvr_aligned_alloc(64, bytes);
    size_t huge = (size_t)2 << 20;
    void *p = kvr_aligned_alloc(huge, (bytes + huge - 1) & ~(huge - 1));
    if (p)
        madvise(p, (bytes + huge - 1) & ~(huge - 1), MADV_HUGEPAGE);
    return p;
}

static int bench_one(struct kvr_pool *pool, int type, int64_t n_out, int64_t n_in,
                     int64_t gemm_rows, int reps, size_t gemv_bytes, struct bw_job *bw, int pack)
{
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(type);
    size_t row_bytes;
    if (!kvr_dtype_row_bytes(type, n_in, &row_bytes)) {
        fprintf(stderr, "%s: n_in %lld is not a multiple of %lld\n", tr->name, (long long)n_in,
                (long long)tr->block_elems);
        return -1;
    }
    size_t mat_bytes = row_bytes * (size_t)n_out;
    int n_copies = (int)((gemv_bytes + mat_bytes - 1) / mat_bytes);
    n_copies = n_copies < 1 ? 1 : n_copies > MAX_COPIES ? MAX_COPIES : n_copies;

    uint8_t *wbuf = wmalloc(mat_bytes * (size_t)n_copies);
    struct kvr_matrix *mats = kvr_calloc((size_t)n_copies, sizeof *mats);
    float *xf = kvr_malloc(sizeof(float) * (size_t)(n_in * gemm_rows));
    size_t x_stride = kvr_act_row_bytes(type, n_in);
    void *xq = kvr_aligned_alloc(64, x_stride * (size_t)gemm_rows);
    float *y = kvr_malloc(sizeof(float) * (size_t)(n_out * gemm_rows));
    double *t = kvr_calloc((size_t)reps, sizeof *t);
    double *bws = kvr_calloc((size_t)reps, sizeof *bws),
           *ratio = kvr_calloc((size_t)reps, sizeof *ratio);
    if (!wbuf || !mats || !xf || !xq || !y || !t || !bws || !ratio) {
        fprintf(stderr, "out of memory\n");
        return -1;
    }
    float *wf = kvr_malloc(sizeof(float) * (size_t)n_in);
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t i = 0; i < n_in; i++)
            wf[i] = 0.05f * frand();
        tr->from_float(wf, wbuf + (size_t)o * row_bytes, n_in);
    }
    kvr_free(wf);
    for (int c = 0; c < n_copies; c++) {
        if (c)
            memcpy(wbuf + (size_t)c * mat_bytes, wbuf, mat_bytes);
        mats[c] =
            (struct kvr_matrix){type, n_in, n_out, row_bytes, wbuf + (size_t)c * mat_bytes, NULL};
    }
    size_t all_bytes = pack == 2 ? kvr_matrix_pack_bytes(&mats[0]) : 0;
    uint8_t *allbuf = all_bytes ? wmalloc(all_bytes * (size_t)n_copies) : NULL;
    if (all_bytes && !allbuf) {
        fprintf(stderr, "out of memory\n");
        return -1;
    }
    for (int c = 0; allbuf && c < n_copies; c++) {
        kvr_matrix_pack(&mats[c], allbuf + (size_t)c * all_bytes);
        mats[c].packed = allbuf + (size_t)c * all_bytes;
    }
    for (int64_t i = 0; i < n_in * gemm_rows; i++)
        xf[i] = frand();
    kvr_quantize_rows(type, xf, n_in, 0, gemm_rows, xq);

    /* GEMV over all copies: weights come from DRAM. Each repeat is paired with a bandwidth
     * pass right before it, so the ratio compares two measurements taken under the same
     * load (the machine is shared and its bandwidth drifts). */
    struct mm_job job = {mats, n_copies, xq, 1, y};
    gemv_pass(pool, &job);
    bandwidth_once(pool, bw);
    for (int r = 0; r < reps; r++) {
        bws[r] = bandwidth_once(pool, bw);
        uint64_t t0 = kvr_now_ns();
        gemv_pass(pool, &job);
        t[r] = (double)(kvr_now_ns() - t0);
        ratio[r] = (double)mat_bytes * n_copies / t[r] / bws[r];
    }
    double gemv_ns = median(t, reps) / n_copies;
    double gemv_gbs = (double)mat_bytes / gemv_ns;
    double bandwidth = median(bws, reps), gemv_ratio = median(ratio, reps);

    /* GEMV on one hot matrix (cache-resident if it fits): the kernel's compute ceiling */
    job.n_mats = 1;
    kvr_pool_run(pool, mm_run, &job);
    double hot_cpu = 1e300, gemm_cpu = 1e300;
    for (int r = 0; r < reps; r++) {
        uint64_t t0 = kvr_now_ns();
        double c0 = cpu_ns();
        for (int k = 0; k < 8; k++)
            kvr_pool_run(pool, mm_run, &job);
        double c = (cpu_ns() - c0) / 8;
        hot_cpu = c < hot_cpu ? c : hot_cpu;
        t[r] = (double)(kvr_now_ns() - t0) / 8;
    }
    double hot_gbs = (double)mat_bytes / median(t, reps);

    /* GEMM over enough matrices to exceed the L3 (64 MiB), so that, as in a forward pass,
     * weights come from DRAM once per call. */
    job.n_rows = gemm_rows;
    job.n_mats = (int)(((size_t)64 << 20) / mat_bytes + 1);
    job.n_mats = job.n_mats > n_copies ? n_copies : job.n_mats;
    size_t pack_bytes = pack == 1 ? kvr_matrix_pack_bytes(&mats[0]) : 0;
    uint8_t *pbuf = pack_bytes ? kvr_aligned_alloc(64, pack_bytes * (size_t)job.n_mats) : NULL;
    struct kvr_matrix *pmats = pack_bytes ? kvr_calloc((size_t)job.n_mats, sizeof *pmats) : NULL;
    double *tp = kvr_calloc((size_t)reps, sizeof *tp);
    if ((pack_bytes && (!pbuf || !pmats)) || !tp) {
        fprintf(stderr, "out of memory\n");
        return -1;
    }
    for (int c = 0; pbuf && c < job.n_mats; c++) { /* pack_bytes is a multiple of 32 */
        pmats[c] = mats[c];
        kvr_matrix_pack(&pmats[c], pbuf + (size_t)c * pack_bytes);
        pmats[c].packed = pbuf + (size_t)c * pack_bytes;
    }
    struct mm_job pjob = job;
    pjob.w = pmats;
    kvr_pool_run(pool, mm_run, &job);
    if (pbuf)
        kvr_pool_run(pool, mm_run, &pjob);
    for (int r = 0; r < reps; r++) {
        uint64_t t0 = kvr_now_ns();
        double c0 = cpu_ns();
        kvr_pool_run(pool, mm_run, &job);
        double c = (cpu_ns() - c0) / job.n_mats;
        gemm_cpu = c < gemm_cpu ? c : gemm_cpu;
        t[r] = (double)(kvr_now_ns() - t0);
        if (pbuf) {
            t0 = kvr_now_ns();
            kvr_pool_run(pool, mm_run, &pjob);
            tp[r] = (double)(kvr_now_ns() - t0);
            ratio[r] = t[r] / tp[r];
        }
    }
    double gemm_ns = median(t, reps) / job.n_mats;
    double gops = 2.0 * (double)n_out * (double)n_in * (double)gemm_rows / gemm_ns;
    char packed_msg[96] = "";
    if (pbuf)
        snprintf(packed_msg, sizeof packed_msg, "  packed %6.1f GOP/s (x%.2f)",
                 2.0 * (double)n_out * (double)n_in * (double)gemm_rows /
                     (median(tp, reps) / job.n_mats),
                 median(ratio, reps));

    printf("%-5s %5lldx%-5lld  gemv %6.2f GB/s (%5.1f%% of bw %5.2f GB/s; %6.1f us)  hot %6.2f GB/s"
           "  gemm[%lld] %6.1f GOP/s (%7.1f us)%s  cpu: hot %.1f us, gemm %.1f us  thp %ld MiB\n",
           tr->name, (long long)n_out, (long long)n_in, gemv_gbs, 100.0 * gemv_ratio, bandwidth,
           gemv_ns / 1e3, hot_gbs, (long long)gemm_rows, gops, gemm_ns / 1e3, packed_msg,
           hot_cpu / 1e3, gemm_cpu / 1e3, anon_huge_mib());
    fflush(stdout);
    kvr_free(tp);
    kvr_free(pmats);
    kvr_free(pbuf);
    kvr_free(allbuf);
    kvr_free(ratio);
    kvr_free(bws);
    kvr_free(t);
    kvr_free(y);
    kvr_free(xq);
    kvr_free(xf);
    kvr_free(mats);
    kvr_free(wbuf);
    return 0;
}

/* The model layer's options from the environment (KVR_ISA, KVR_PREFETCH, KVR_NO_PACK), read
 * as kvasir reads them: the model reads none. */
static void configure_model(void)
{
    const char *no_pack = getenv("KVR_NO_PACK");
    struct kvr_model_options o = {
        .kernels = {.isa = getenv("KVR_ISA"), .prefetch = getenv("KVR_PREFETCH")},
        .no_pack = no_pack && !strcmp(no_pack, "1"),
    };
    kvr_model_configure(&o);
}

int main(int argc, char **argv)
{
    configure_model();
    const char *types = "q8_0,q4_0,q4_K,q6_K,f16,f32";
    const char *shapes = "2048x2048,5632x2048";
    long n_threads = 2, rows = 128, reps = 7, gemv_mib = 512, pack = 0;
    bool reference = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--reference")) {
            reference = true;
            continue;
        }
        if (!v)
            goto usage;
        if (!strcmp(a, "--types"))
            types = v;
        else if (!strcmp(a, "--shapes"))
            shapes = v;
        else if (!strcmp(a, "--threads"))
            n_threads = atol(v);
        else if (!strcmp(a, "--rows"))
            rows = atol(v);
        else if (!strcmp(a, "--reps"))
            reps = atol(v);
        else if (!strcmp(a, "--gemv-mib"))
            gemv_mib = atol(v);
        else if (!strcmp(a, "--pack"))
            pack = atol(v);
        else if (!strcmp(a, "--huge"))
            g_huge = atoi(v) != 0;
        else if (!strcmp(a, "--dispatch"))
            g_dispatch = atoi(v);
        else
            goto usage;
        i++;
    }
    if (n_threads < 1 || n_threads > 256 || rows < 1 || rows > 4096 || reps < 5 || reps > 1000 ||
        gemv_mib < 1 || gemv_mib > (1 << 16) || pack < 0 || pack > 2 || g_dispatch < 0 ||
        g_dispatch > 64)
        goto usage;

    /* as the engine chooses them: the kernel set, and the prefetch distances for this many
     * compute threads */
    struct kvr_err err;
    if (kvr_kernels_setup((int)n_threads, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 2;
    }
    kvr_kernels_force_reference(reference);
    const char *kernels = kvr_kernels_name();
    struct kvr_pool *pool = kvr_pool_create((int)n_threads);
    size_t gemv_bytes = (size_t)gemv_mib << 20;
    uint8_t *bwbuf = wmalloc(gemv_bytes);
    if (!pool || !bwbuf) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    memset(bwbuf, 1, gemv_bytes);
    struct bw_job *bw = kvr_calloc(1, sizeof *bw);
    if (!bw) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    bw->buf = bwbuf;
    bw->n_bytes = gemv_bytes & ~(size_t)4095;
    printf("kernels: %s, threads: %ld, gemv working set: %ld MiB, reps: %ld (medians)\n", kernels,
           n_threads, gemv_mib, reps);

    char tbuf[256], sbuf[256];
    snprintf(tbuf, sizeof tbuf, "%s", types);
    for (char *tsave = NULL, *tn = strtok_r(tbuf, ",", &tsave); tn;
         tn = strtok_r(NULL, ",", &tsave)) {
        int type = parse_type(tn);
        if (type < 0) {
            fprintf(stderr, "unknown type %s\n", tn);
            return 2;
        }
        snprintf(sbuf, sizeof sbuf, "%s", shapes);
        for (char *ssave = NULL, *sn = strtok_r(sbuf, ",", &ssave); sn;
             sn = strtok_r(NULL, ",", &ssave)) {
            long long n_out, n_in;
            if (sscanf(sn, "%lldx%lld", &n_out, &n_in) != 2 || n_out < 1 || n_in < 1 ||
                n_out > (1 << 20) || n_in > (1 << 20)) {
                fprintf(stderr, "bad shape %s (want OUTxIN)\n", sn);
                return 2;
            }
            if (bench_one(pool, type, n_out, n_in, rows, (int)reps, gemv_bytes, bw, (int)pack) != 0)
                return 1;
        }
    }
    kvr_free(bw);
    kvr_free(bwbuf);
    kvr_pool_destroy(pool);
    return 0;
usage:
    fprintf(stderr,
            "usage: %s [--types q8_0,q4_0,q4_K,q6_K,iq4_xs,f16,...] [--shapes OUTxIN,...]\n"
            "          [--threads N] [--rows N] [--reps N>=5] [--gemv-mib N] [--reference]\n"
            "          [--pack 0|1|2] [--huge 0|1] [--dispatch N]\n",
            argv[0]);
    return 2;
}
