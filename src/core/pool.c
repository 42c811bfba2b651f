#include "core/pool.h"

#include "core/alloc.h"

#include <pthread.h>
#include <stdatomic.h>

/* Spin iterations a worker polls for the next job before it sleeps. A forward pass posts
 * a job every few microseconds, so a short spin avoids a futex round trip per matmul. */
enum { SPIN_ITERS = 20000 };

struct worker {
    struct kvr_pool *pool;
    int ith;
    pthread_t thread;
};

struct kvr_pool {
    int n_threads;
    struct worker *workers;     /* n_threads - 1 entries */
    kvr_pool_fn fn;
    void *arg;
    atomic_uint generation;     /* bumped once per posted job */
    atomic_int n_pending;       /* workers still running the current job */
    atomic_int quit;
    atomic_int n_sleeping;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_cond_t done;
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *worker_main(void *p)
{
    struct worker *w = p;
    struct kvr_pool *pool = w->pool;
    unsigned seen = 0;
    for (;;) {
        unsigned gen = atomic_load_explicit(&pool->generation, memory_order_acquire);
        for (int i = 0; gen == seen && i < SPIN_ITERS; i++) {
            cpu_relax();
            gen = atomic_load_explicit(&pool->generation, memory_order_acquire);
        }
        if (gen == seen) {
            pthread_mutex_lock(&pool->lock);
            atomic_fetch_add(&pool->n_sleeping, 1);
            while ((gen = atomic_load(&pool->generation)) == seen && !atomic_load(&pool->quit))
                pthread_cond_wait(&pool->wake, &pool->lock);
            atomic_fetch_sub(&pool->n_sleeping, 1);
            pthread_mutex_unlock(&pool->lock);
        }
        if (atomic_load(&pool->quit))
            return NULL;
        seen = gen;
        pool->fn(pool->arg, w->ith, pool->n_threads);
        if (atomic_fetch_sub_explicit(&pool->n_pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool->lock);
            pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->lock);
        }
    }
}

struct kvr_pool *kvr_pool_create(int n_threads)
{
    if (n_threads < 1)
        return NULL;
    struct kvr_pool *pool = kvr_calloc(1, sizeof *pool);
    if (!pool)
        return NULL;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    pool->workers = kvr_calloc((size_t)n_threads, sizeof *pool->workers);
    if (!pool->workers)
        goto fail_workers;
    for (int i = 1; i < n_threads; i++) {
        struct worker *w = &pool->workers[i - 1];
        w->pool = pool;
        w->ith = i;
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
            pool->n_threads = i; /* destroy joins only the threads that started */
            kvr_pool_destroy(pool);
            return NULL;
        }
    }
    return pool;

fail_workers:
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    kvr_free(pool);
    return NULL;
}

void kvr_pool_destroy(struct kvr_pool *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->quit, 1);
    atomic_fetch_add(&pool->generation, 1);
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

int kvr_pool_size(const struct kvr_pool *pool) { return pool->n_threads; }

void kvr_pool_run(struct kvr_pool *pool, kvr_pool_fn fn, void *arg)
{
    if (pool->n_threads == 1) {
        fn(arg, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->arg = arg;
    atomic_store_explicit(&pool->n_pending, pool->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add(&pool->generation, 1); /* seq_cst: pairs with n_sleeping */
    if (atomic_load(&pool->n_sleeping) > 0) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }
    fn(arg, 0, pool->n_threads);
    for (int i = 0; atomic_load_explicit(&pool->n_pending, memory_order_acquire) > 0; i++) {
        if (i < SPIN_ITERS) {
            cpu_relax();
            continue;
        }
        pthread_mutex_lock(&pool->lock);
        while (atomic_load(&pool->n_pending) > 0)
            pthread_cond_wait(&pool->done, &pool->lock);
        pthread_mutex_unlock(&pool->lock);
    }
}
