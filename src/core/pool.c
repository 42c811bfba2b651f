#include "core/pool.h"

#include "core/alloc.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* How a job is handed out. One 64-bit word holds the job's generation, its chunk count and
 * the next unclaimed chunk:
 *
 *   bits 63..32  generation (one per kvr_pool_run)
 *   bits 31..16  n_chunks
 *   bits 15..0   next chunk to claim
 *
 * A thread claims chunk c by compare-and-swap from (g, n, c) to (g, n, c + 1), so a claim
 * can only succeed for the job that is current, and the job's fn/arg cannot change while a
 * claimed chunk runs (the caller waits for every chunk to finish). The caller claims chunks
 * too, so it never waits for a worker that the OS has not scheduled yet: on a busy machine
 * it simply does that worker's share itself. It waits only for chunks already started. */

/* Spin iterations a worker polls for the next job before it sleeps. A forward pass posts a
 * job every few microseconds, so a short spin avoids a futex round trip per matmul. */
enum { SPIN_ITERS = 20000 };

struct worker {
    struct kvr_pool *pool;
    pthread_t thread;
};

struct kvr_pool {
    int n_threads;
    struct worker *workers; /* n_threads - 1 entries */
    kvr_pool_fn fn;
    void *arg;
    _Atomic uint64_t claim; /* see above */
    atomic_int n_done;      /* chunks of the current job finished */
    atomic_int quit;
    atomic_int n_sleeping;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_cond_t done;
    bool caller_waiting; /* guarded by lock */
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline uint32_t claim_gen(uint64_t v)
{
    return (uint32_t)(v >> 32);
}
static inline uint32_t claim_n(uint64_t v)
{
    return (uint32_t)(v >> 16) & 0xffffu;
}
static inline uint32_t claim_next(uint64_t v)
{
    return (uint32_t)v & 0xffffu;
}

/* Claim and run chunks of the current job until none is left. */
static void run_chunks(struct kvr_pool *pool)
{
    uint64_t v = atomic_load_explicit(&pool->claim, memory_order_acquire);
    while (claim_next(v) < claim_n(v)) {
        if (!atomic_compare_exchange_weak_explicit(&pool->claim, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        int n = (int)claim_n(v);
        pool->fn(pool->arg, (int)claim_next(v), n);
        if (atomic_fetch_add_explicit(&pool->n_done, 1, memory_order_acq_rel) + 1 == n) {
            pthread_mutex_lock(&pool->lock);
            if (pool->caller_waiting)
                pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->lock);
        }
        v = atomic_load_explicit(&pool->claim, memory_order_acquire);
    }
}

static void *worker_main(void *p)
{
    struct worker *w = p;
    struct kvr_pool *pool = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint64_t v = atomic_load_explicit(&pool->claim, memory_order_acquire);
        for (int i = 0; claim_gen(v) == seen && i < SPIN_ITERS; i++) {
            cpu_relax();
            v = atomic_load_explicit(&pool->claim, memory_order_acquire);
        }
        if (claim_gen(v) == seen) {
            pthread_mutex_lock(&pool->lock);
            atomic_fetch_add(&pool->n_sleeping, 1);
            while (claim_gen(v = atomic_load(&pool->claim)) == seen && !atomic_load(&pool->quit))
                pthread_cond_wait(&pool->wake, &pool->lock);
            atomic_fetch_sub(&pool->n_sleeping, 1);
            pthread_mutex_unlock(&pool->lock);
        }
        if (atomic_load(&pool->quit))
            return NULL;
        seen = claim_gen(v);
        run_chunks(pool);
    }
}

struct kvr_pool *kvr_pool_create(int n_threads)
{
    if (n_threads < 1 || n_threads > 0xffff)
        return NULL;
    struct kvr_pool *pool = kvr_calloc(1, sizeof *pool);
    if (!pool)
        return NULL;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    pool->workers = kvr_calloc((size_t)n_threads, sizeof *pool->workers);
    if (!pool->workers) {
        pthread_cond_destroy(&pool->done);
        pthread_cond_destroy(&pool->wake);
        pthread_mutex_destroy(&pool->lock);
        kvr_free(pool);
        return NULL;
    }
    for (int i = 1; i < n_threads; i++) {
        struct worker *w = &pool->workers[i - 1];
        w->pool = pool;
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            pool->n_threads = i; /* destroy joins only the threads that started */
            kvr_pool_destroy(pool);
            return NULL;
        }
    }
    return pool;
}

void kvr_pool_destroy(struct kvr_pool *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->quit, 1);
    /* A new generation with no chunks wakes every worker, which then sees quit. */
    uint64_t v = atomic_load(&pool->claim);
    atomic_store(&pool->claim, (uint64_t)(claim_gen(v) + 1) << 32);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->n_threads; i++)
        pthread_join(pool->workers[i - 1].thread, NULL);
    kvr_free(pool->workers);
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    kvr_free(pool);
}

int kvr_pool_size(const struct kvr_pool *pool)
{
    return pool->n_threads;
}

void kvr_pool_run_chunks(struct kvr_pool *pool, kvr_pool_fn fn, void *arg, int n_chunks)
{
    if (n_chunks < 1)
        return;
    if (pool->n_threads == 1 || n_chunks == 1) {
        for (int c = 0; c < n_chunks; c++)
            fn(arg, c, n_chunks);
        return;
    }
    if (n_chunks > 0xffff)
        n_chunks = 0xffff; /* callers split by (chunk, n_chunks), so any count is correct */
    pool->fn = fn;
    pool->arg = arg;
    atomic_store_explicit(&pool->n_done, 0, memory_order_relaxed);
    uint64_t old = atomic_load(&pool->claim);
    uint64_t v = (uint64_t)(claim_gen(old) + 1) << 32 | (uint64_t)n_chunks << 16;
    atomic_store(&pool->claim, v); /* seq_cst: pairs with n_sleeping below */
    if (atomic_load(&pool->n_sleeping) > 0) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }
    run_chunks(pool);
    for (int i = 0; atomic_load_explicit(&pool->n_done, memory_order_acquire) < n_chunks; i++) {
        if (i < SPIN_ITERS) {
            cpu_relax();
            continue;
        }
        pthread_mutex_lock(&pool->lock);
        pool->caller_waiting = true;
        while (atomic_load(&pool->n_done) < n_chunks)
            pthread_cond_wait(&pool->done, &pool->lock);
        pool->caller_waiting = false;
        pthread_mutex_unlock(&pool->lock);
    }
}

void kvr_pool_run(struct kvr_pool *pool, kvr_pool_fn fn, void *arg)
{
    kvr_pool_run_chunks(pool, fn, arg, pool->n_threads);
}
