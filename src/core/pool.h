/* pool.h - a fixed pool of compute threads that run one parallel job at a time.
 *
 * kvr_pool_run(pool, fn, arg) calls fn(arg, ith, nth) once on each of the pool's nth
 * threads (the caller is thread 0) and returns when every call has returned. Jobs split
 * their work by `ith` only, so results never depend on scheduling. Workers spin briefly
 * after a job (jobs come in bursts during a forward pass) and then sleep on a condition
 * variable, so an idle pool costs no CPU.
 *
 * Only one thread may call kvr_pool_run on a given pool at a time. */
#ifndef KVR_CORE_POOL_H
#define KVR_CORE_POOL_H

struct kvr_pool;

typedef void (*kvr_pool_fn)(void *arg, int ith, int nth);

/* n_threads >= 1 (the caller counts as one). Returns NULL on failure. */
struct kvr_pool *kvr_pool_create(int n_threads);
void kvr_pool_destroy(struct kvr_pool *pool);
int kvr_pool_size(const struct kvr_pool *pool);
void kvr_pool_run(struct kvr_pool *pool, kvr_pool_fn fn, void *arg);

/* Split n items among nth threads in contiguous, deterministic ranges: [*begin, *end). */
static inline void kvr_split_range(long n, int ith, int nth, long *begin, long *end)
{
    long per = n / nth, rem = n % nth;
    *begin = ith * per + (ith < rem ? ith : rem);
    *end = *begin + per + (ith < rem ? 1 : 0);
}

#endif
