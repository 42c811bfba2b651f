/* bench_rows.c - what a few activation rows cost a matmul: the verification batches of
 * speculation (issue 37) run 2-16 rows through every matrix of a stage, and a lap pays off
 * only if a row costs much less than the one-row (decode) call.
 *
 * For each type and shape, one thread calls kvr_matmul on packed copies (as the engine
 * makes them) with 1, 2, 4, ... rows, the row counts taking turns within every repeat so a
 * slow spell of the shared machine hits them all:
 *   dram: over copies filling --mib MiB (weights stream from memory, as in a decode step);
 *   hot:  one copy again and again (in cache: the kernel's compute cost alone).
 * Reported per matrix: the least process CPU time of the repeats (one thread, so it is the
 * kernel's own cost whatever else runs), its ratio to one row, and the marginal cost of a
 * row ((t(r) - t(1)) / (r - 1) / t(1)). Usage:
 *   bench_rows [--types q4_0,q8_0] [--shapes 2048x2048,5632x2048] [--rows 1,2,4,8,16]
 *              [--reps 7] [--mib 256] */
#include "core/alloc.h"
#include "model/dtype.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_ROWS 16
#define MAX_COUNTS 8

static double cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
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
    for (int t = 0; t < KVR_DTYPE_COUNT; t++)
        if (t != KVR_DTYPE_Q8_K && kvr_dtype_traits(t) && !strcmp(kvr_dtype_traits(t)->name, s))
            return t;
    return -1;
}

/* CPU ns per matrix of one pass over mats[0..n) with r rows. */
static double pass(const struct kvr_matrix *mats, int n, const void *xq, int64_t r, float *y)
{
    double c0 = cpu_ns();
    for (int m = 0; m < n; m++)
        kvr_matmul(&mats[m], xq, r, y, mats[m].n_out, 0, mats[m].n_out);
    return (cpu_ns() - c0) / n;
}

static void report(const char *what, const int *rows, int n_rows, const double *best)
{
    printf("  %-4s", what);
    for (int i = 0; i < n_rows; i++)
        printf("  %2d: %8.1f us x%5.2f", rows[i], best[i] / 1e3, best[i] / best[0]);
    printf("\n  %-4s marginal row / one-row call:", "");
    for (int i = 1; i < n_rows; i++)
        printf("  %2d: %.3f", rows[i], (best[i] - best[0]) / (rows[i] - rows[0]) / best[0]);
    printf("\n");
}

static int bench_one(int type, int64_t n_out, int64_t n_in, const int *rows, int n_rows, int reps,
                     size_t mib)
{
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(type);
    size_t row_bytes;
    if (!kvr_dtype_row_bytes(type, n_in, &row_bytes))
        return -1;
    struct kvr_matrix w0 = {type, n_in, n_out, row_bytes, NULL, NULL};
    uint8_t *plain = kvr_aligned_alloc(64, row_bytes * (size_t)n_out);
    float *wf = kvr_malloc(sizeof(float) * (size_t)n_in);
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t i = 0; i < n_in; i++)
            wf[i] = 0.05f * frand();
        tr->from_float(wf, plain + (size_t)o * row_bytes, n_in);
    }
    w0.data = plain;
    size_t pb = kvr_matrix_pack_bytes(&w0);
    if (!pb) {
        fprintf(stderr, "%s has no packed layout\n", tr->name);
        return -1;
    }
    int n_copies = (int)((mib << 20) / pb) + 1;
    uint8_t *packed = kvr_aligned_alloc(64, pb * (size_t)n_copies);
    struct kvr_matrix *mats = kvr_calloc((size_t)n_copies, sizeof *mats);
    kvr_matrix_pack(&w0, packed);
    for (int c = 0; c < n_copies; c++) {
        if (c)
            memcpy(packed + (size_t)c * pb, packed, pb);
        mats[c] = w0;
        mats[c].packed = packed + (size_t)c * pb;
    }
    size_t x_stride = kvr_act_row_bytes(type, n_in);
    float *xf = kvr_malloc(sizeof(float) * (size_t)(n_in * MAX_ROWS));
    void *xq = kvr_aligned_alloc(64, x_stride * MAX_ROWS);
    float *y = kvr_malloc(sizeof(float) * (size_t)(n_out * MAX_ROWS));
    for (int64_t i = 0; i < n_in * MAX_ROWS; i++)
        xf[i] = frand();
    kvr_quantize_rows(type, xf, n_in, 0, MAX_ROWS, xq);

    double dram[MAX_COUNTS], hot[MAX_COUNTS];
    for (int i = 0; i < n_rows; i++)
        dram[i] = hot[i] = 1e300;
    pass(mats, n_copies, xq, 1, y); /* first touch */
    for (int rep = 0; rep < reps; rep++)
        for (int i = 0; i < n_rows; i++) {
            double d = pass(mats, n_copies, xq, rows[i], y);
            dram[i] = d < dram[i] ? d : dram[i];
            pass(mats, 1, xq, rows[i], y); /* warm the one copy */
            double h = pass(mats, 1, xq, rows[i], y);
            h = h < (d = pass(mats, 1, xq, rows[i], y)) ? h : d;
            hot[i] = h < hot[i] ? h : hot[i];
        }
    printf("%s %lldx%lld (%.2f MiB packed, %d copies), kernels %s, least CPU time of %d\n",
           tr->name, (long long)n_out, (long long)n_in, (double)pb / (1 << 20), n_copies,
           kvr_kernels_name(), reps);
    report("dram", rows, n_rows, dram);
    printf("  dram one row: %.2f GB/s of weights\n", (double)pb / dram[0]);
    report("hot", rows, n_rows, hot);
    kvr_free(plain);
    kvr_free(packed);
    kvr_free(mats);
    kvr_free(wf);
    kvr_free(xf);
    kvr_free(xq);
    kvr_free(y);
    return 0;
}

int main(int argc, char **argv)
{
    const char *types = "q4_0", *shapes = "2048x2048,5632x2048", *rows_s = "1,2,4,8,16";
    long reps = 7, mib = 256;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--types"))
            types = argv[i + 1];
        else if (!strcmp(argv[i], "--shapes"))
            shapes = argv[i + 1];
        else if (!strcmp(argv[i], "--rows"))
            rows_s = argv[i + 1];
        else if (!strcmp(argv[i], "--reps"))
            reps = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--mib"))
            mib = atol(argv[i + 1]);
        else {
            fprintf(stderr, "usage: bench_rows [--types T,..] [--shapes OxI,..] [--rows 1,2,..] "
                            "[--reps N] [--mib N]\n");
            return 2;
        }
    }
    int rows[MAX_COUNTS], n_rows = 0;
    for (const char *p = rows_s; *p && n_rows < MAX_COUNTS; p += strcspn(p, ","), p += *p == ',') {
        rows[n_rows] = atoi(p);
        if (rows[n_rows] < 1 || rows[n_rows] > MAX_ROWS)
            return fprintf(stderr, "rows: 1 to %d\n", MAX_ROWS), 2;
        n_rows++;
    }
    if (reps < 1 || mib < 1 || !n_rows)
        return 2;
    struct kvr_kernel_options ko = {.isa = getenv("KVR_ISA"), .prefetch = getenv("KVR_PREFETCH")};
    kvr_kernels_configure(&ko);
    kvr_kernels_init();
    char buf[256];
    snprintf(buf, sizeof buf, "%s", types);
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
        int type = parse_type(t);
        if (type < 0)
            return fprintf(stderr, "unknown type %s\n", t), 2;
        for (const char *s = shapes; *s; s += strcspn(s, ","), s += *s == ',') {
            long long o = 0, in = 0;
            if (sscanf(s, "%lldx%lld", &o, &in) != 2)
                return fprintf(stderr, "bad shape %s\n", s), 2;
            if (bench_one(type, o, in, rows, n_rows, (int)reps, (size_t)mib) != 0)
                return 1;
        }
    }
    return 0;
}
