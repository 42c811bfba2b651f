/* alloc.h - the one heap wrapper every module allocates through.
 *
 * Tests can make the N-th allocation fail (kvr_alloc_fail_after) to exercise error paths.
 * Size arithmetic on untrusted numbers goes through the overflow-checked helpers below
 * before it reaches an allocator. Thread-safe. */
#ifndef KVR_CORE_ALLOC_H
#define KVR_CORE_ALLOC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

void *kvr_malloc(size_t n_bytes);
void *kvr_calloc(size_t n, size_t elem_bytes);
void *kvr_realloc(void *p, size_t n_bytes);
/* Aligned allocation (align is a power of two >= sizeof(void*)); free with kvr_free. */
void *kvr_aligned_alloc(size_t align, size_t n_bytes);
void kvr_free(void *p);
char *kvr_strdup(const char *s);

/* Test hook: allocation number `n` from now on (0 = the next one) fails; -1 disables. */
void kvr_alloc_fail_after(long n);

/* Overflow-checked size arithmetic: return false (and leave *out unspecified) on overflow. */
static inline bool kvr_mul_size(size_t a, size_t b, size_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool kvr_add_size(size_t a, size_t b, size_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}
static inline bool kvr_mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool kvr_add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

#endif
