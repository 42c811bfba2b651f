/* test_pack.c - packed weights (kvr_matrix_pack): the Q8_0 / Q4_0 GEMM, and every path of
 * Q4_K, Q5_K, Q6_K and IQ4_XS.
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

#include "model_options.h"
#include "testutil.h"

#include "core/alloc.h"
#include "core/rng.h"
#include "model/dtype.h"
#include "model/kernels.h"

#include <stdio.h>
#include <stdlib.h>
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
    assert_int_equal(kvr_matrix_pack_bytes(&w), 1088); /* 2 tiles x 2 blocks x 272 */
    w.type = KVR_DTYPE_Q4_0;
    w.row_bytes = 36;
    assert_int_equal(kvr_matrix_pack_bytes(&w), 576); /* 2 x 2 x 144 */
    w.n_in = 96; /* 2 x 3 x 144 = 864, rounded up to 64-byte lines */
    w.row_bytes = 54;
    assert_int_equal(kvr_matrix_pack_bytes(&w), 896);
    w.n_in = 64;
    w.row_bytes = 36;
    w.n_out = 17; /* 3 tiles, stored as 2 pairs: 4 x 2 x 144 */
    assert_int_equal(kvr_matrix_pack_bytes(&w), 1152);
    w.n_out = 9;
    w.type = KVR_DTYPE_F32;
    assert_int_equal(kvr_matrix_pack_bytes(&w), 0);
    w.type = KVR_DTYPE_Q4_K;
    assert_int_equal(kvr_matrix_pack_bytes(&w), 0); /* 64 is not a whole super-block */
    w.n_in = 512;
    assert_int_equal(kvr_matrix_pack_bytes(&w), 2 * 2 * 1152);
    w.type = KVR_DTYPE_Q6_K; /* 2 tiles x 1 x 1680 = 3360, rounded up to 64-byte lines */
    w.n_in = 256;
    assert_int_equal(kvr_matrix_pack_bytes(&w), 3392);
}

/* Where the table in model/kernels.h puts byte `at` of a K-quant unit in block order (every
 * field interleaved by row), as an offset in the pair's chunk for tile k (0 or 1): Q6_K's
 * quant vectors in reading order, then the chunk's 32-byte slots alternating between the
 * two tiles, a last half slot split between them. Written out here, apart from the packer. */
static size_t chunk_offset(int type, size_t unit, int k, size_t at)
{
    size_t slot = at / 32;
    if (type == KVR_DTYPE_Q6_K && slot < 32) { /* ql vector 16h + 8 half + g */
        size_t h = slot / 16, half = slot % 16 / 8, g = slot % 8;
        slot = 3 * (8 * h + g) + half;
    } else if (type == KVR_DTYPE_Q6_K && slot < 48) { /* qh vector 8h + g */
        slot = 3 * (slot - 32) + 2;
    }
    if (32 * slot + 32 <= unit)
        return 64 * slot + 32 * (size_t)k + at % 32;
    return 64 * slot + 16 * (size_t)k + at % 32;
}

/* What kernels.h says byte b of Q6_K's field f (0: ql, 1: qh) becomes in the packed unit:
 * the byte's position l in a half h (64 ql bytes, then 32 qh bytes a half) names four
 * quants, q_k = element 128h + 32k + l', l' = l mod 32, and the byte is A = q0 + 64 (q3 & 3)
 * for the first 32 ql bytes of the half, B = q1 + 64 (q3 >> 2 & 3) for the next 32, C = q2 +
 * 64 (q3 >> 4) for qh. Worked out from the block format, not from the packer. */
static int q6_k_packed_byte(const uint8_t *blk, int f, int b)
{
    const uint8_t *ql = blk, *qh = blk + 128;
    int h = f == 0 ? b / 64 : b / 32, l = b % 32;
    int q[4];
    for (int k = 0; k < 4; k++) {
        int lo = ql[64 * h + 32 * (k % 2) + l], hi = qh[32 * h + l];
        q[k] = (k < 2 ? lo & 15 : lo >> 4) | (hi >> (2 * k) & 3) << 4;
    }
    if (f == 1)
        return q[2] + 64 * (q[3] >> 4);
    return b % 64 < 32 ? q[0] + 64 * (q[3] & 3) : q[1] + 64 * (q[3] >> 2 & 3);
}

/* Every field of a K-quant block lands where the table in model/kernels.h puts it: rows
 * filled with a byte pattern unique to (row, byte), packed, and each byte looked up. */
static void test_pack_layout_k(void **state)
{
    (void)state;
    static const struct {
        int type;
        int n_fields;
        int size[5];
    } types[] = {{KVR_DTYPE_Q4_K, 4, {2, 2, 12, 128}},
                 {KVR_DTYPE_Q5_K, 5, {2, 2, 12, 32, 128}},
                 {KVR_DTYPE_Q6_K, 4, {128, 64, 16, 2}},
                 {KVR_DTYPE_IQ4_XS, 4, {2, 2, 4, 128}}};
    enum { N_OUT = 11, NSB = 2 };
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        size_t bb = kvr_dtype_traits(types[t].type)->block_bytes, row = NSB * bb;
        uint8_t *data = kvr_malloc(N_OUT * row);
        assert_non_null(data);
        for (size_t k = 0; k < N_OUT * row; k++)
            data[k] = (uint8_t)(k * 7 + k / 251);
        struct kvr_matrix w = {types[t].type, 256 * NSB, N_OUT, row, data, NULL};
        size_t n = kvr_matrix_pack_bytes(&w);
        assert_true(n >= 2 * NSB * 8 * bb && n % 64 == 0);
        uint8_t *p = kvr_aligned_alloc(64, n);
        assert_non_null(p);
        kvr_matrix_pack(&w, p);
        for (int tile = 0; tile < 2; tile++)
            for (int sb = 0; sb < NSB; sb++) {
                const uint8_t *c = p + kvr_pack_unit_at(0, sb, NSB, 8 * bb); /* the pair's */
                size_t at = 0;
                for (int f = 0; f < types[t].n_fields; f++) {
                    int sz = types[t].size[f], step = sz == 2 ? 2 : 4;
                    for (int i = 0; i < 8; i++) {
                        int o = 8 * tile + i < N_OUT ? 8 * tile + i : N_OUT - 1;
                        for (int b = 0; b < sz; b++) {
                            size_t in_unit = 8 * at + (size_t)(b / step) * 8 * step +
                                             (size_t)i * step + (size_t)(b % step);
                            size_t got = chunk_offset(types[t].type, 8 * bb, tile, in_unit);
                            assert_true(got < 2 * 8 * bb);
                            const uint8_t *blk = data + (size_t)o * row + sb * bb;
                            int want = types[t].type == KVR_DTYPE_Q6_K && f < 2
                                           ? q6_k_packed_byte(blk, f, b)
                                           : blk[at + b];
                            assert_int_equal(c[got], want);
                        }
                    }
                    at += (size_t)sz;
                }
                assert_int_equal(at, bb);
            }
        kvr_free(p);
        kvr_free(data);
    }
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
    assert_int_equal(n, 576); /* 2 x 272, rounded up to 64-byte lines */
    uint8_t *p = kvr_aligned_alloc(64, n);
    assert_non_null(p);
    kvr_matrix_pack(&w, p);
    for (int t = 0; t < 2; t++) {
        const uint8_t *u = p + kvr_pack_unit_at(t, 0, 1, 272);
        for (int i = 0; i < 8; i++) {
            int o = 8 * t + i < N_OUT ? 8 * t + i : N_OUT - 1; /* last row repeated */
            uint16_t d;
            memcpy(&d, u + 2 * i, 2);
            assert_true(kvr_f16_to_f32(d) == (float)(o + 1));
            for (int g = 0; g < 8; g++)
                for (int k = 0; k < 4; k++)
                    assert_int_equal(u[16 + 32 * g + 4 * i + k],
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
    /* Q8_0 / Q4_0: 2080 = 65 blocks, two K chunks of the GEMM, the second ragged; K-quants:
     * 2304 = 9 super-blocks. 37 rows: a ragged last tile. */
    enum { N_OUT = 37, MAX_ROWS = 17 };
    const int64_t n_in = kvr_dtype_traits(type)->block_elems == 256 ? 2304 : 2080;
    static const int64_t row_counts[] = {1, 3, 4, 5, 8, 13, 16, 17};
    static const int64_t cut_sets[][3] = {{0, 0, 0}, {8, 24, 0}, {3, 16, 30}, {32, 0, 0}};
    static const int n_cuts[] = {0, 2, 3, 1};
    struct pcase c;
    pcase_init(&c, type, n_in, N_OUT, MAX_ROWS);
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

static void test_packed_k_quants(void **state)
{
    (void)state;
    check_packed_equals_reference(KVR_DTYPE_Q4_K);
    check_packed_equals_reference(KVR_DTYPE_Q5_K);
    check_packed_equals_reference(KVR_DTYPE_Q6_K);
    check_packed_equals_reference(KVR_DTYPE_IQ4_XS);
}

/* The prefetch distance is only a speed: every distance (none, one line, the two chosen by
 * CPU vendor) gives the reference's bits; KVR_PREFETCH that is not a byte count up to
 * 1 MiB is refused, and one that is overrides the per-thread-count defaults. */
static void test_prefetch_distances(void **state)
{
    (void)state;
    static const char *const good[] = {"0", "64", "8192", "24576"};
    static const char *const bad[] = {"x", "12k", "-64", "1048577", "99999999999999999999"};
    struct kvr_err err;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        setenv("KVR_PREFETCH", bad[i], 1);
        kvr_test_model_options();
        assert_int_equal(kvr_kernels_setup(2, &err), KVR_EINVAL);
        assert_non_null(strstr(err.msg, "KVR_PREFETCH"));
    }
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        setenv("KVR_PREFETCH", good[i], 1);
        kvr_test_model_options();
        assert_int_equal(kvr_kernels_setup(2, &err), KVR_OK);
        assert_int_equal(kvr_kernels_active()->prefetch_kquant, strtoul(good[i], NULL, 10));
        assert_int_equal(kvr_kernels_active()->prefetch_legacy, strtoul(good[i], NULL, 10));
        check_packed_equals_reference(KVR_DTYPE_Q8_0);
        check_packed_equals_reference(KVR_DTYPE_Q4_0);
        check_packed_equals_reference(KVR_DTYPE_Q4_K);
        check_packed_equals_reference(KVR_DTYPE_Q6_K);
    }
    unsetenv("KVR_PREFETCH");
    kvr_test_model_options();
    /* the vendor's distances: one compute thread never prefetches the K-quants further
     * than several do, and KVR_PREFETCH, when set, wins whatever the thread count */
    assert_int_equal(kvr_kernels_setup(1, &err), KVR_OK);
    size_t one = kvr_kernels_active()->prefetch_kquant;
    check_packed_equals_reference(KVR_DTYPE_Q6_K);
    assert_int_equal(kvr_kernels_setup(2, &err), KVR_OK);
    assert_true(one <= kvr_kernels_active()->prefetch_kquant);
    setenv("KVR_PREFETCH", "4096", 1);
    kvr_test_model_options();
    assert_int_equal(kvr_kernels_setup(1, &err), KVR_OK);
    assert_int_equal(kvr_kernels_active()->prefetch_kquant, 4096);
    unsetenv("KVR_PREFETCH");
    kvr_test_model_options();
    assert_int_equal(kvr_kernels_setup(2, &err), KVR_OK);
}

int main(void)
{
    kvr_test_model_options();
    kvr_kernels_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pack_bytes),         cmocka_unit_test(test_pack_layout_q8_0),
        cmocka_unit_test(test_packed_q8_0),        cmocka_unit_test(test_packed_q4_0),
        cmocka_unit_test(test_pack_layout_k),      cmocka_unit_test(test_packed_k_quants),
        cmocka_unit_test(test_prefetch_distances),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
