/* test_pack.c - packed weights (kvr_matrix_pack) for the Q8_0 / Q4_0 GEMM.
 *
 * The packed path must give the reference's bits: for every row count (GEMV and GEMM
 * sizes, ragged activation tiles), every o-slice (tile-aligned ones use the packed copy,
 * others fall back to the plain kernels) and a ragged last output tile, the fast kernels
 * with a packed copy equal the scalar reference kernels under memcmp. The layout itself is
 * checked against the byte table in model/kernels.h on a hand-filled matrix. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/alloc.h"
#include "core/rng.h"
#include "model/dtype.h"

#include <stdio.h>
#include <string.h>

static uint64_t rng_state = 0x243F6A8885A308D3ull; /* kvr_splitmix64 stream */

static uint64_t rng_next(void)
{
    return kvr_splitmix64(&rng_state);
}

static float rng_float(float scale)
{
    float s = (float)(rng_next() >> 40) / (float)(1ull << 24) - 0.5f;
    if (rng_next() % 61 == 0)
        s *= 8.0f; /* outliers: a block whose max quant is +-127 next to small ones */
    return s * scale;
}

static void test_pack_bytes(void **state)
{
    (void)state;
    struct kvr_matrix w = {KVR_DTYPE_Q8_0, 64, 9, 68, NULL, NULL};
    assert_int_equal(kvr_matrix_pack_bytes(&w), 2 * 2 * 288); /* 2 tiles x 2 blocks */
    w.type = KVR_DTYPE_Q4_0;
    w.row_bytes = 36;
    assert_int_equal(kvr_matrix_pack_bytes(&w), 2 * 2 * 160);
    w.type = KVR_DTYPE_F32;
    assert_int_equal(kvr_matrix_pack_bytes(&w), 0);
    w.type = KVR_DTYPE_Q4_K;
    assert_int_equal(kvr_matrix_pack_bytes(&w), 0);
}

/* One Q8_0 block per row, row o's quant j = o * 10 + j - 100 (wrapping in int8), scale
 * fp16 of (o + 1): the packed bytes are checked field by field from the table. */
static void test_pack_layout_q8_0(void **state)
{
    (void)state;
    enum { N_OUT = 10, BLK = 34 };
    uint8_t data[N_OUT * BLK];
    for (int o = 0; o < N_OUT; o++) {
        uint16_t d = kvr_f32_to_f16((float)(o + 1));
        memcpy(data + o * BLK, &d, 2);
        for (int j = 0; j < 32; j++)
            data[o * BLK + 2 + j] = (uint8_t)(o * 10 + j - 100);
    }
    struct kvr_matrix w = {KVR_DTYPE_Q8_0, 32, N_OUT, BLK, data, NULL};
    size_t n = kvr_matrix_pack_bytes(&w);
    assert_int_equal(n, 2 * 288);
    uint8_t *p = kvr_aligned_alloc(32, n);
    assert_non_null(p);
    kvr_matrix_pack(&w, p);
    for (int t = 0; t < 2; t++) {
        const uint8_t *u = p + t * 288;
        for (int i = 0; i < 8; i++) {
            int o = 8 * t + i < N_OUT ? 8 * t + i : N_OUT - 1; /* last row repeated */
            float d;
            memcpy(&d, u + 4 * i, 4);
            assert_true(d == (float)(o + 1));
            for (int g = 0; g < 8; g++)
                for (int k = 0; k < 4; k++)
                    assert_int_equal(u[32 + 32 * g + 4 * i + k],
                                     (uint8_t)(o * 10 + 4 * g + k - 100));
        }
    }
    kvr_free(p);
}

struct pcase {
    struct kvr_matrix w;
    void *wbuf, *pbuf, *xq;
    size_t x_stride;
};

static void pcase_init(struct pcase *c, int type, int64_t n_in, int64_t n_out, int64_t n_rows)
{
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(type);
    size_t row_bytes;
    assert_true(kvr_dtype_row_bytes(type, n_in, &row_bytes));
    c->wbuf = kvr_malloc(row_bytes * (size_t)n_out);
    float *f = kvr_malloc(sizeof(float) * (size_t)(n_in * (n_rows > 1 ? n_rows : 1)));
    assert_non_null(c->wbuf);
    assert_non_null(f);
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t i = 0; i < n_in; i++)
            f[i] = rng_float(0.05f);
        tr->from_float(f, (uint8_t *)c->wbuf + (size_t)o * row_bytes, n_in);
    }
    c->w = (struct kvr_matrix){type, n_in, n_out, row_bytes, c->wbuf, NULL};
    size_t pb = kvr_matrix_pack_bytes(&c->w);
    assert_true(pb > 0);
    c->pbuf = kvr_aligned_alloc(64, pb);
    assert_non_null(c->pbuf);
    kvr_matrix_pack(&c->w, c->pbuf);
    for (int64_t i = 0; i < n_in * n_rows; i++)
        f[i] = rng_float(2.0f);
    c->x_stride = kvr_act_row_bytes(type, n_in);
    c->xq = kvr_malloc(c->x_stride * (size_t)n_rows);
    assert_non_null(c->xq);
    kvr_quantize_rows(type, f, n_in, 0, n_rows, c->xq);
    kvr_free(f);
}

static void pcase_fini(struct pcase *c)
{
    kvr_free(c->wbuf);
    kvr_free(c->pbuf);
    kvr_free(c->xq);
}

static void check_packed_equals_reference(int type)
{
    /* 2080 = 65 blocks: two K chunks of the GEMM, the second ragged; 37 rows: ragged tile */
    enum { N_IN = 2080, N_OUT = 37, MAX_ROWS = 17 };
    static const int64_t row_counts[] = {1, 3, 4, 5, 8, 13, 16, 17};
    static const int64_t cut_sets[][3] = {{0, 0, 0}, {8, 24, 0}, {3, 16, 30}, {32, 0, 0}};
    static const int n_cuts[] = {0, 2, 3, 1};
    struct pcase c;
    pcase_init(&c, type, N_IN, N_OUT, MAX_ROWS);
    float *want = kvr_malloc(sizeof(float) * MAX_ROWS * N_OUT);
    float *got = kvr_malloc(sizeof(float) * MAX_ROWS * N_OUT);
    assert_non_null(want);
    assert_non_null(got);
    for (size_t i = 0; i < sizeof row_counts / sizeof row_counts[0]; i++) {
        int64_t n_rows = row_counts[i];
        struct kvr_matrix plain = c.w;
        kvr_kernels_force_reference(true);
        kvr_matmul(&plain, c.xq, n_rows, want, N_OUT, 0, N_OUT);
        kvr_kernels_force_reference(false);
        for (size_t s = 0; s < sizeof n_cuts / sizeof n_cuts[0]; s++) {
            struct kvr_matrix packed = c.w;
            packed.packed = c.pbuf;
            memset(got, 0xA5, sizeof(float) * (size_t)(n_rows * N_OUT));
            int64_t prev = 0;
            for (int k = 0; k <= n_cuts[s]; k++) {
                int64_t next = k < n_cuts[s] ? cut_sets[s][k] : N_OUT;
                kvr_matmul(&packed, c.xq, n_rows, got, N_OUT, prev, next);
                prev = next;
            }
            if (memcmp(got, want, sizeof(float) * (size_t)(n_rows * N_OUT)) != 0)
                fail_msg("%s: packed matmul differs from the reference (%lld rows, cut set %zu, "
                         "kernels %s)",
                         kvr_dtype_traits(type)->name, (long long)n_rows, s, kvr_kernels_name());
        }
    }
    kvr_free(want);
    kvr_free(got);
    pcase_fini(&c);
}

static void test_packed_q8_0(void **state)
{
    (void)state;
    check_packed_equals_reference(KVR_DTYPE_Q8_0);
}

static void test_packed_q4_0(void **state)
{
    (void)state;
    check_packed_equals_reference(KVR_DTYPE_Q4_0);
}

int main(void)
{
    kvr_kernels_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pack_bytes),
        cmocka_unit_test(test_pack_layout_q8_0),
        cmocka_unit_test(test_packed_q8_0),
        cmocka_unit_test(test_packed_q4_0),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
