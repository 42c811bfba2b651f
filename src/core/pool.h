/* pool.h - a fixed pool of compute threads that run one parallel job at a time.
 *
 * A job is split into chunks: kvr_pool_run_chunks(pool, fn, arg, n) calls fn(arg, c, n)
 * exactly once for every chunk c in [0, n), on whichever pool thread claims it first (the
 * caller takes part), and returns when every call has returned. Jobs split their work by
 * (c, n) only, so results never depend on which thread ran what. Scratch memory indexed by
 * c is private to that call (a chunk runs once). kvr_pool_run is the same with one chunk
 * per thread.
 *
 * Because chunks are claimed rather than assigned, a worker the OS has not scheduled yet
 * (a busy machine) delays nothing: the caller runs its chunks. Workers spin briefly after a
 * job (jobs come in bursts during a forward pass) and then sleep on a condition variable,
 * so an idle pool costs no CPU.
 *
 * Only one thread may run jobs on a given pool at a time. */
#ifndef KVR_CORE_POOL_H
#define KVR_CORE_POOL_H

struct kvr_pool;

typedef void (*kvr_pool_fn)(void *arg, int chunk, int n_chunks);

/* n_threads >= 1 (the caller counts as one). Returns NULL on failure. */
struct kvr_pool *kvr_pool_create(int n_threads);
void kvr_pool_destroy(struct kvr_pool *pool);
int kvr_pool_size(const struct kvr_pool *pool);
void kvr_pool_run(struct kvr_pool *pool, kvr_pool_fn fn, void *arg);
/* n_chunks >= 1 (at most 65535; more are clamped). */
void kvr_pool_run_chunks(struct kvr_pool *pool, kvr_pool_fn fn, void *arg, int n_chunks);

/* Split n items among nth threads in contiguous, deterministic ranges: [*begin, *end). */
static inline void kvr_split_range(long n, int ith, int nth, long *begin, long *end)
{
    long per = n / nth, rem = n % nth;
    *begin = ith * per + (ith < rem ? ith : rem);
    *end = *begin + per + (ith < rem ? 1 : 0);
}

#endif
