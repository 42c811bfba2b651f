/* matmul_pool.c - matmuls split over a thread pool: the activation rows converted once, then
 * up to three matrices sharing them in one dispatch, by output-row share (work stealing for
 * decode, chunks for more rows). Every output element is one kvr_matmul call's, so the
 * split never changes a bit. */
#include "model/matmul_pool.h"

#include <stdatomic.h>

enum { MAX_FUSED = KVR_MATMUL_POOL_MAX };

/* Up to three matmuls sharing one converted activation (Q/K/V, or gate/up), run in one
 * pool dispatch. Each thread takes the same fraction of every matrix's output rows. */
struct mm_job {
    int n;
    const struct kvr_matrix *w[MAX_FUSED];
    float *y[MAX_FUSED];
    const void *xq;
    int64_t n_rows;
};

/* Output rows are split in multiples of 16 so SIMD tiles stay whole. */
static void split_out(int64_t n_out, int ith, int nth, int64_t *b, int64_t *e)
{
    long chunks = (long)((n_out + 15) / 16), cb, ce;
    kvr_split_range(chunks, ith, nth, &cb, &ce);
    *b = cb * 16;
    *e = ce * 16 < n_out ? ce * 16 : n_out;
}

static void mm_worker(void *arg, int ith, int nth)
{
    const struct mm_job *job = arg;
    for (int i = 0; i < job->n; i++) {
        int64_t b, e;
        split_out(job->w[i]->n_out, ith, nth, &b, &e);
        if (b < e)
            kvr_matmul(job->w[i], job->xq, job->n_rows, job->y[i], job->w[i]->n_out, b, e);
    }
}

/* Decode (at most STEAL_MAX_ROWS activation rows): the job's 16-row groups, counted over its
 * matrices in order, start as one contiguous share per thread. A thread takes its own share
 * from the front a quarter of what is left at a time (at least one group; a quarter cuts the
 * kernel calls and compare-and-swaps about fourfold against one group at a time, and leaves
 * a thief the half it looks for) and, when it is empty, takes the back half of the
 * largest share left. The matrices of a job are consecutive in the packed copy, so a share
 * is one ascending address stream (the kernels' prefetch runs on ahead along it), and a
 * dispatch ends within about a group of its last row. (Equal chunks claimed in turn made
 * every chunk restart the stream, and left one thread idle for half a chunk on average at
 * the end of every matmul.) A share is one word, bits 31..0 its next group and 63..32 its
 * end; it changes only by compare-and-swap, except that a thread whose share is empty
 * stores the half it took. A range value says all there is to know (which groups are
 * unclaimed and whose), so a stale compare-and-swap that happens to match is still right. */
enum { STEAL_MAX_ROWS = 4, STEAL_MAX_THREADS = 64 };

struct steal_share {
    _Alignas(64) _Atomic uint64_t range; /* a cache line each: owners and thieves meet here */
};

struct steal_job {
    const struct mm_job *mm;
    int64_t first[MAX_FUSED + 1]; /* group where matrix i starts; first[n] = all groups */
    struct steal_share share[STEAL_MAX_THREADS];
};

static void run_groups(const struct steal_job *job, int64_t g0, int64_t g1)
{
    const struct mm_job *mm = job->mm;
    for (int i = 0; i < mm->n; i++) {
        int64_t b = g0 > job->first[i] ? g0 : job->first[i];
        int64_t e = g1 < job->first[i + 1] ? g1 : job->first[i + 1];
        if (b >= e)
            continue;
        int64_t n_out = mm->w[i]->n_out, ob = (b - job->first[i]) * 16;
        int64_t oe = (e - job->first[i]) * 16 < n_out ? (e - job->first[i]) * 16 : n_out;
        kvr_matmul(mm->w[i], mm->xq, mm->n_rows, mm->y[i], n_out, ob, oe);
    }
}

static uint64_t share_word(uint32_t next, uint32_t end)
{
    return (uint64_t)end << 32 | next;
}

static void steal_worker(void *arg, int own, int n_shares)
{
    struct steal_job *job = arg;
    _Atomic uint64_t *mine = &job->share[own].range;
    for (;;) {
        uint64_t v = atomic_load_explicit(mine, memory_order_relaxed);
        uint32_t next = (uint32_t)v, end = (uint32_t)(v >> 32);
        if (next < end) { /* a quarter of what is left, so a thief still finds half */
            uint32_t take = (end - next) / 4 ? (end - next) / 4 : 1;
            if (atomic_compare_exchange_weak_explicit(mine, &v, share_word(next + take, end),
                                                      memory_order_relaxed, memory_order_relaxed))
                run_groups(job, next, (int64_t)next + take);
            continue;
        }
        int victim = -1;
        uint64_t vv = 0;
        for (int t = 0; t < n_shares; t++) {
            uint64_t w = atomic_load_explicit(&job->share[t].range, memory_order_relaxed);
            if ((uint32_t)(w >> 32) > (uint32_t)w &&
                (victim < 0 ||
                 (uint32_t)(w >> 32) - (uint32_t)w > (uint32_t)(vv >> 32) - (uint32_t)vv)) {
                victim = t;
                vv = w;
            }
        }
        if (victim < 0)
            return; /* every group is claimed; the pool waits for the ones running */
        uint32_t lo = (uint32_t)vv, hi = (uint32_t)(vv >> 32), mid = lo + (hi - lo) / 2;
        if (atomic_compare_exchange_strong_explicit(&job->share[victim].range, &vv,
                                                    share_word(lo, mid), memory_order_relaxed,
                                                    memory_order_relaxed))
            atomic_store_explicit(mine, share_word(mid, hi), memory_order_relaxed);
    }
}

static void run_stealing(struct kvr_pool *pool, const struct mm_job *mm)
{
    struct steal_job job = {.mm = mm};
    for (int i = 0; i < mm->n; i++)
        job.first[i + 1] = job.first[i] + (mm->w[i]->n_out + 15) / 16;
    int nth = kvr_pool_size(pool);
    for (int t = 0; t < nth; t++) {
        long b, end;
        kvr_split_range((long)job.first[mm->n], t, nth, &b, &end);
        atomic_init(&job.share[t].range, share_word((uint32_t)b, (uint32_t)end));
    }
    kvr_pool_run(pool, steal_worker, &job);
}

struct quant_job {
    enum kvr_dtype type;
    const float *x;
    int64_t n_in;
    int64_t n_rows;
    void *dst;
};

static void quant_worker(void *arg, int ith, int nth)
{
    const struct quant_job *job = arg;
    long b, e;
    kvr_split_range((long)job->n_rows, ith, nth, &b, &e);
    if (b < e)
        kvr_quantize_rows(job->type, job->x, job->n_in, b, e, job->dst);
}

void kvr_matmul_pool(struct kvr_pool *pool, void *xq, const float *x, uint32_t n_rows, int n,
                     const struct kvr_matrix *const *w, float *const *y)
{
    struct quant_job qj = {w[0]->type, x, w[0]->n_in, n_rows, xq};
    if ((double)n_rows * w[0]->n_in * 8 >= KVR_SMALL_WORK)
        kvr_pool_run(pool, quant_worker, &qj);
    else
        quant_worker(&qj, 0, 1);
    struct mm_job job = {.n = n, .xq = xq, .n_rows = n_rows};
    double work = 0;
    for (int i = 0; i < n; i++) {
        job.w[i] = w[i];
        job.y[i] = y[i];
        work += (double)w[i]->n_in * w[i]->n_out * n_rows;
    }
    /* Waking the pool costs microseconds; a small product is cheaper on one thread. */
    if (work < KVR_SMALL_WORK || kvr_pool_size(pool) == 1)
        mm_worker(&job, 0, 1);
    else if (n_rows <= STEAL_MAX_ROWS && kvr_pool_size(pool) <= STEAL_MAX_THREADS)
        run_stealing(pool, &job);
    else /* several chunks per thread: a thread that stalls holds up only a small one */
        kvr_pool_run_chunks(pool, mm_worker, &job, 4 * kvr_pool_size(pool));
}
