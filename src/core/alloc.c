#include "core/alloc.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static atomic_long fail_countdown = -1;

static bool should_fail(void)
{
    long v = atomic_load(&fail_countdown);
    while (v >= 0) {
        if (atomic_compare_exchange_weak(&fail_countdown, &v, v - 1))
            return v == 0;
    }
    return false;
}

void kvr_alloc_fail_after(long n)
{
    atomic_store(&fail_countdown, n);
}

void *kvr_malloc(size_t n_bytes)
{
    return should_fail() ? NULL : malloc(n_bytes ? n_bytes : 1);
}

void *kvr_calloc(size_t n, size_t elem_bytes)
{
    return should_fail() ? NULL : calloc(n ? n : 1, elem_bytes ? elem_bytes : 1);
}

void *kvr_realloc(void *p, size_t n_bytes)
{
    return should_fail() ? NULL : realloc(p, n_bytes ? n_bytes : 1);
}

void *kvr_aligned_alloc(size_t align, size_t n_bytes)
{
    void *p = NULL;
    if (should_fail())
        return NULL;
    if (posix_memalign(&p, align, n_bytes ? n_bytes : align) != 0)
        return NULL;
    return p;
}

void kvr_free(void *p)
{
    free(p);
}

char *kvr_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = kvr_malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}
