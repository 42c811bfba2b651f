/* test_kvpool.c - the bridge's KV block pool and prefix names (bridge/kvpool.h).
 *
 * What is checked:
 *  - block names: deterministic, depend on the block's tokens, on every block before it
 *    (through `prev`) and on the seed (model + plan), and on token order;
 *  - the pool: lookup finds the longest named prefix and stops at the first miss or a
 *    partial block; reference counts keep shared blocks out of reach of eviction; unused
 *    named blocks are evicted least recently used, a chain from its end; allocation is all
 *    or nothing; a duplicate name stays private; flush and reset; the invariants
 *    (kvr_kv_pool_check) after every step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/kvpool.h"

#include <stdbool.h>
#include <string.h>

#define BT 4 /* tokens per block */

static void check(const struct kvr_kv_pool *p)
{
    struct kvr_err err = {0};
    int rc = kvr_kv_pool_check(p, &err);
    if (rc)
        fail_msg("pool invariant: %s", err.msg);
}

static void test_names(void **state)
{
    (void)state;
    int32_t a[BT] = {1, 2, 3, 4}, b[BT] = {1, 2, 3, 5}, c[BT] = {2, 1, 3, 4};
    uint64_t ha = kvr_kv_block_hash(7, a, BT);
    assert_true(ha == kvr_kv_block_hash(7, a, BT));
    assert_true(ha != kvr_kv_block_hash(7, b, BT)); /* its tokens */
    assert_true(ha != kvr_kv_block_hash(7, c, BT)); /* their order */
    assert_true(ha != kvr_kv_block_hash(8, a, BT)); /* the seed / what came before */
    /* The same block after different prefixes has different names. */
    uint64_t after_b = kvr_kv_block_hash(kvr_kv_block_hash(7, b, BT), a, BT);
    uint64_t after_c = kvr_kv_block_hash(kvr_kv_block_hash(7, c, BT), a, BT);
    assert_true(after_b != after_c);
}

/* Publish every whole block of tokens[0..n) held in ids[], chained from seed. */
static void publish_all(struct kvr_kv_pool *p, uint64_t seed, const int32_t *tokens, uint32_t n,
                        const uint32_t *ids)
{
    uint64_t prev = seed;
    for (uint32_t b = 0; (b + 1) * BT <= n; b++) {
        uint64_t name = kvr_kv_block_hash(prev, tokens + b * BT, BT);
        kvr_kv_pool_publish(p, ids[b], prev, name, tokens + b * BT);
        prev = name;
    }
}

static void test_pool_lookup_and_refs(void **state)
{
    (void)state;
    struct kvr_kv_pool p;
    struct kvr_err err = {0};
    assert_int_equal(kvr_kv_pool_init(&p, 8, BT, &err), 0);
    int32_t prompt[14];
    for (int i = 0; i < 14; i++)
        prompt[i] = 100 + i;
    uint32_t ids[8], found[8];
    assert_int_equal(kvr_kv_pool_lookup(&p, 1, prompt, 14, 8, found), 0);
    assert_int_equal(kvr_kv_pool_alloc(&p, ids, 4), 0); /* 14 tokens: 4 blocks */
    check(&p);
    publish_all(&p, 1, prompt, 14, ids); /* 3 whole blocks named */
    check(&p);
    assert_int_equal(kvr_kv_pool_lookup(&p, 1, prompt, 14, 8, found), 3);
    assert_memory_equal(found, ids, 3 * sizeof *ids);
    assert_int_equal(kvr_kv_pool_lookup(&p, 1, prompt, 14, 2, found), 2); /* capped */
    assert_int_equal(kvr_kv_pool_lookup(&p, 1, prompt, 11, 8, found), 2); /* partial block */
    assert_int_equal(kvr_kv_pool_lookup(&p, 2, prompt, 14, 8, found), 0); /* other seed */
    int32_t other[14];
    memcpy(other, prompt, sizeof other);
    other[5] = 7; /* differs in block 1: block 0 still matches, nothing after it */
    assert_int_equal(kvr_kv_pool_lookup(&p, 1, other, 14, 8, found), 1);

    /* A second sequence shares the 3 named blocks and takes one more. */
    assert_int_equal(kvr_kv_pool_lookup(&p, 1, prompt, 14, 8, found), 3);
    kvr_kv_pool_acquire(&p, found, 3);
    uint32_t tail2;
    assert_int_equal(kvr_kv_pool_alloc(&p, &tail2, 1), 0);
    assert_int_equal(p.n_used, 5);
    assert_int_equal(p.refs[ids[0]], 2);
    check(&p);
    /* The first ends: the shared blocks stay used, its unnamed tail block is free. */
    kvr_kv_pool_release(&p, ids, 4);
    assert_int_equal(p.n_used, 4);
    assert_int_equal(p.n_cached, 0);
    assert_int_equal(p.n_free, 4);
    check(&p);
    /* Everything else is taken: the shared blocks cannot be evicted while used. */
    uint32_t more[8];
    assert_int_equal(kvr_kv_pool_alloc(&p, more, 5), KVR_EFULL);
    assert_int_equal(p.n_free, 4); /* all or nothing */
    assert_int_equal(kvr_kv_pool_alloc(&p, more, 4), 0);
    assert_int_equal(kvr_kv_pool_available(&p), 0);
    check(&p);
    /* The second ends: its 3 named blocks are cached, still found. */
    kvr_kv_pool_release(&p, found, 3);
    kvr_kv_pool_release(&p, &tail2, 1);
    assert_int_equal(p.n_cached, 3);
    assert_int_equal(kvr_kv_pool_lookup(&p, 1, prompt, 14, 8, found), 3);
    check(&p);
    kvr_kv_pool_release(&p, more, 4);
    assert_int_equal(kvr_kv_pool_flush(&p), 3);
    assert_int_equal(p.n_free, 8);
    assert_int_equal(kvr_kv_pool_lookup(&p, 1, prompt, 14, 8, found), 0);
    check(&p);
    kvr_kv_pool_fini(&p);
}

static void test_pool_lru(void **state)
{
    (void)state;
    struct kvr_kv_pool p;
    struct kvr_err err = {0};
    assert_int_equal(kvr_kv_pool_init(&p, 6, BT, &err), 0);
    /* Three prompts of two blocks each, ended in the order A, B, C. */
    int32_t t[3][2 * BT];
    uint32_t ids[3][2];
    for (int s = 0; s < 3; s++) {
        for (int i = 0; i < 2 * BT; i++)
            t[s][i] = s * 100 + i;
        assert_int_equal(kvr_kv_pool_alloc(&p, ids[s], 2), 0);
        publish_all(&p, 9, t[s], 2 * BT, ids[s]);
    }
    for (int s = 0; s < 3; s++)
        kvr_kv_pool_release(&p, ids[s], 2);
    assert_int_equal(p.n_cached, 6);
    check(&p);
    /* A is used again (looked up and released): B is now the least recently used. */
    uint32_t f[2];
    assert_int_equal(kvr_kv_pool_lookup(&p, 9, t[0], 2 * BT, 2, f), 2);
    kvr_kv_pool_acquire(&p, f, 2);
    kvr_kv_pool_release(&p, f, 2);
    /* One new block evicts B's second block first (a chain goes from its end). */
    uint32_t n1;
    assert_int_equal(kvr_kv_pool_alloc(&p, &n1, 1), 0);
    assert_int_equal(n1, ids[1][1]);
    assert_int_equal(p.n_evicted, 1);
    assert_int_equal(kvr_kv_pool_lookup(&p, 9, t[1], 2 * BT, 2, f), 1);
    assert_int_equal(kvr_kv_pool_lookup(&p, 9, t[0], 2 * BT, 2, f), 2);
    assert_int_equal(kvr_kv_pool_lookup(&p, 9, t[2], 2 * BT, 2, f), 2);
    /* Two more: B's first block, then C's second. */
    uint32_t n2[2];
    assert_int_equal(kvr_kv_pool_alloc(&p, n2, 2), 0);
    assert_int_equal(n2[0], ids[1][0]);
    assert_int_equal(n2[1], ids[2][1]);
    assert_int_equal(kvr_kv_pool_lookup(&p, 9, t[2], 2 * BT, 2, f), 1);
    assert_int_equal(kvr_kv_pool_lookup(&p, 9, t[0], 2 * BT, 2, f), 2);
    check(&p);
    /* A duplicate of a named block stays private and free once released. */
    assert_true(!kvr_kv_pool_publish(&p, n1, 9, kvr_kv_block_hash(9, t[0], BT), t[0]));
    kvr_kv_pool_release(&p, &n1, 1);
    assert_int_equal(p.state[n1], KVR_KV_BLOCK_FREE);
    check(&p);
    kvr_kv_pool_reset(&p);
    assert_int_equal(p.n_free, 6);
    assert_int_equal(kvr_kv_pool_lookup(&p, 9, t[0], 2 * BT, 2, f), 0);
    check(&p);
    kvr_kv_pool_fini(&p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_pool_lookup_and_refs),
        cmocka_unit_test(test_pool_lru),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
