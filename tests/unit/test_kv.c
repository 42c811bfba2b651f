/* test_kv.c - the paged KV cache's named blocks (model/kv.h). The bridge's block pool has
 * its own test (test_kvpool.c).
 *
 * What is checked:
 *  - the cache's map: a mapped sequence uses exactly the named blocks, refuses writes past
 *    them and gaps, counts shared blocks once, and cannot be mixed with lazy blocks;
 *  - the cache types: row sizes of f32, f16 and q8_0 (and what is refused), and the
 *    conversions: f32 exact, f16 round-to-nearest-even within half an ulp, q8_0's blocks
 *    (fp16 scale max|x| / 127 first, then 32 int8) within half a step, exact on a grid. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "model/kv.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

#define BT 4 /* tokens per block */

static void test_kv_map(void **state)
{
    (void)state;
    struct kvr_kv kv;
    struct kvr_err err = {0};
    assert_int_equal(kvr_kv_init(&kv, KVR_DTYPE_F32, 2, 8, BT, 6, 3, 16, &err), 0);
    uint32_t a[3] = {4, 1, 2}, b[2] = {4, 5};
    assert_int_equal(kvr_kv_map(&kv, 0, 0, 0, a, 2, &err), 0);
    assert_int_equal(kvr_kv_map(&kv, 0, 0, 3, a + 2, 1, &err), KVR_EINVAL); /* gap */
    assert_int_equal(kvr_kv_map(&kv, 0, 0, 2, a + 2, 1, &err), 0);
    assert_int_equal(kv.tables[0 * kv.max_blocks_per_seq + 0], 4);
    assert_int_equal(kv.tables[0 * kv.max_blocks_per_seq + 2], 2);
    assert_int_equal(kvr_kv_prepare(&kv, 0, 0, 12, &err), 0);
    assert_int_equal(kvr_kv_prepare(&kv, 0, 12, 1, &err), KVR_ERANGE); /* past its blocks */
    /* Sequence 1 shares block 4 as a cached prefix: it starts at position 4. */
    assert_int_equal(kvr_kv_map(&kv, 1, 5 * BT, 0, b, 2, &err), KVR_EINVAL); /* > context */
    assert_int_equal(kvr_kv_map(&kv, 1, 3, 0, b, 2, &err), KVR_EINVAL);      /* not whole */
    /* Cached positions beyond the blocks mapped so far (more MAP records to come): the
     * sequence may not run until they are mapped. */
    assert_int_equal(kvr_kv_map(&kv, 1, 3 * BT, 0, b, 1, &err), 0);
    assert_int_equal(kvr_kv_prepare(&kv, 1, 3 * BT, 1, &err), KVR_ERANGE);
    kvr_kv_free_seq(&kv, 1);
    assert_int_equal(kvr_kv_map(&kv, 1, BT, 0, b, 2, &err), 0);
    assert_int_equal(kv.n_pos[1], BT);
    assert_int_equal(kvr_kv_prepare(&kv, 1, 0, 1, &err), 0);          /* a rewrite is allowed */
    assert_int_equal(kvr_kv_prepare(&kv, 1, 2, 1, &err), KVR_ERANGE); /* a gap is not */
    assert_int_equal(kvr_kv_prepare(&kv, 1, 1, 7, &err), 0);
    assert_true(kvr_kv_row(&kv, kv.k, 1, 1, 0) == kvr_kv_row(&kv, kv.k, 1, 0, 0));
    assert_true(kvr_kv_row(&kv, kv.k, 1, 1, 5) != kvr_kv_row(&kv, kv.k, 1, 0, 5));
    assert_int_equal(kvr_kv_used(&kv), 4); /* 4, 1, 2, 5: block 4 once */
    uint32_t bad = 6;
    assert_int_equal(kvr_kv_map(&kv, 2, 0, 0, &bad, 1, &err), KVR_EINVAL);
    /* A mapped cache takes no blocks of its own. */
    assert_int_equal(kvr_kv_prepare(&kv, 2, 0, 1, &err), KVR_ERANGE);
    kvr_kv_free_seq(&kv, 0);
    assert_int_equal(kvr_kv_used(&kv), 2);
    kvr_kv_free_seq(&kv, 1);
    assert_int_equal(kvr_kv_used(&kv), 0);
    kvr_kv_fini(&kv);

    /* A cache whose sequences took lazy blocks refuses a map. */
    assert_int_equal(kvr_kv_init(&kv, KVR_DTYPE_F32, 1, 8, BT, 4, 2, 16, &err), 0);
    assert_int_equal(kvr_kv_prepare(&kv, 0, 0, 5, &err), 0);
    assert_int_equal(kvr_kv_used(&kv), 2);
    assert_int_equal(kvr_kv_map(&kv, 1, 0, 0, b, 1, &err), KVR_EINVAL);
    kvr_kv_fini(&kv);
}

static void test_kv_type_sizes(void **state)
{
    (void)state;
    assert_true(kvr_kv_type_ok(KVR_DTYPE_F32) && kvr_kv_type_ok(KVR_DTYPE_F16) &&
                kvr_kv_type_ok(KVR_DTYPE_Q8_0));
    assert_false(kvr_kv_type_ok(KVR_DTYPE_BF16) || kvr_kv_type_ok(KVR_DTYPE_Q4_0));
    assert_int_equal(kvr_kv_bytes(KVR_DTYPE_F32, 64), 256);
    assert_int_equal(kvr_kv_bytes(KVR_DTYPE_F16, 64), 128);
    assert_int_equal(kvr_kv_bytes(KVR_DTYPE_Q8_0, 64), 68);
    assert_int_equal(kvr_kv_bytes(KVR_DTYPE_Q8_0, 48), 0); /* not whole blocks of 32 */
    assert_int_equal(kvr_kv_bytes(KVR_DTYPE_Q4_0, 64), 0);
    struct kvr_kv kv;
    struct kvr_err err = {0};
    assert_int_equal(kvr_kv_init(&kv, KVR_DTYPE_Q8_0, 2, 8, BT, 4, 2, 16, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "q8_0"));
    assert_int_equal(kvr_kv_init(&kv, KVR_DTYPE_BF16, 2, 8, BT, 4, 2, 16, &err), KVR_EINVAL);
    const enum kvr_dtype types[] = {KVR_DTYPE_F32, KVR_DTYPE_F16, KVR_DTYPE_Q8_0};
    const size_t row[] = {256, 128, 68};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvr_kv_init(&kv, types[i], 2, 64, BT, 4, 2, 16, &err), 0);
        assert_int_equal(kv.row_bytes, row[i]);
        /* Rows are row_bytes apart, blocks BT rows, layers n_blocks blocks. */
        assert_int_equal(kvr_kv_prepare(&kv, 0, 0, BT + 1, &err), 0);
        uint8_t *r0 = kvr_kv_row(&kv, kv.k, 1, 0, 0);
        assert_true(kvr_kv_row(&kv, kv.k, 1, 0, 1) == r0 + row[i]);
        assert_true(kvr_kv_row(&kv, kv.k, 0, 0, 0) == kv.k + (size_t)kv.tables[0] * BT * row[i]);
        assert_true(r0 == kvr_kv_row(&kv, kv.k, 0, 0, 0) + (size_t)4 * BT * row[i]);
        kvr_kv_fini(&kv);
    }
}

static void test_kv_conversions(void **state)
{
    (void)state;
    float x[64], y[64];
    uint8_t buf[256];
    uint32_t seed = 12345;
    for (int i = 0; i < 64; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = ((float)(seed >> 8) / (float)(1u << 24) - 0.5f) * (i < 32 ? 8.0f : 0.01f);
    }
    kvr_kv_store(KVR_DTYPE_F32, buf, x, 64);
    kvr_kv_load(KVR_DTYPE_F32, y, buf, 64);
    assert_memory_equal(x, y, sizeof x);

    /* f16: within half an ulp (2^-11 relative for normal values), ties to even. */
    kvr_kv_store(KVR_DTYPE_F16, buf, x, 64);
    kvr_kv_load(KVR_DTYPE_F16, y, buf, 64);
    for (int i = 0; i < 64; i++)
        assert_true(fabsf(y[i] - x[i]) <= fabsf(x[i]) * 0x1p-11f);
    /* Every half that is not a signalling NaN reads back as kvr_f16_to_f32 gives it, on
     * the F16C path too (when the kernels use AVX2) and the plain one. */
    static uint16_t halves[65536];
    static float got[65536];
    for (uint32_t h = 0; h < 65536; h++)
        halves[h] = (uint16_t)h;
    for (int plain = 0; plain < 2; plain++) {
        kvr_kernels_force_reference(plain);
        kvr_kv_load(KVR_DTYPE_F16, got, halves, 65536);
        for (uint32_t h = 0; h < 65536; h++) {
            bool snan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) && !(h & 0x200);
            float want = kvr_f16_to_f32((uint16_t)h);
            if (!snan && memcmp(&got[h], &want, sizeof want))
                fail_msg("half 0x%04x: read %a, want %a (%s)", h, got[h], want,
                         plain ? "plain" : kvr_kernels_name());
        }
    }
    /* Every float stored as a half gives kvr_f32_to_f16's bits, on both paths: a million
     * bit patterns spread over the whole range (normals, subnormals, the overflow edge,
     * infinities and NaNs), and the edges themselves. */
    enum { N_STORE = 1 << 20 };
    static float floats[N_STORE];
    static uint16_t stored[N_STORE];
    static const uint32_t edges[] = {0x00000000, 0x80000000, 0x33000000, 0x33000001, 0x387fe000,
                                     0x387ff000, 0x38800000, 0x477fe000, 0x477fefff, 0x477ff000,
                                     0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xffa00001};
    for (uint32_t i = 0; i < N_STORE; i++) {
        uint32_t bits = i < sizeof edges / sizeof *edges ? edges[i] : i * 4099u + (i >> 7);
        memcpy(&floats[i], &bits, sizeof bits);
    }
    for (int plain = 0; plain < 2; plain++) {
        kvr_kernels_force_reference(plain);
        kvr_kv_store(KVR_DTYPE_F16, stored, floats, N_STORE);
        for (uint32_t i = 0; i < N_STORE; i++)
            if (stored[i] != kvr_f32_to_f16(floats[i]))
                fail_msg("float %a: stored 0x%04x, want 0x%04x (%s)", floats[i], stored[i],
                         kvr_f32_to_f16(floats[i]), plain ? "plain" : kvr_kernels_name());
    }
    kvr_kernels_force_reference(false);
    float ties[4] = {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, -2.0f, 65504.0f};
    const float want[4] = {1.0f, 1.0f + 0x1p-9f, -2.0f, 65504.0f};
    kvr_kv_store(KVR_DTYPE_F16, buf, ties, 4);
    kvr_kv_load(KVR_DTYPE_F16, y, buf, 4);
    assert_memory_equal(y, want, sizeof want);
    assert_int_equal(buf[2] | buf[3] << 8, 0x3c02); /* 1 + 2^-9 as IEEE half */

    /* q8_0: per 32 values, d = max|x| / 127 as fp16, then q = round(x / d). */
    kvr_kv_store(KVR_DTYPE_Q8_0, buf, x, 64);
    kvr_kv_load(KVR_DTYPE_Q8_0, y, buf, 64);
    for (int b = 0; b < 2; b++) {
        float amax = 0;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(x[32 * b + i]));
        float d = amax / 127.0f;
        for (int i = 0; i < 32; i++)
            assert_true(fabsf(y[32 * b + i] - x[32 * b + i]) <= 0.5f * d * 1.01f);
    }
    /* Integers up to 127 (d = 1): exact, and the bytes are the GGUF block. */
    for (int i = 0; i < 32; i++)
        x[i] = (float)(i * 8 - 127 > 127 ? 127 : i * 8 - 127);
    x[5] = 127.0f;
    kvr_kv_store(KVR_DTYPE_Q8_0, buf, x, 32);
    kvr_kv_load(KVR_DTYPE_Q8_0, y, buf, 32);
    assert_memory_equal(x, y, 32 * sizeof(float));
    assert_int_equal(buf[0] | buf[1] << 8, 0x3c00); /* d = 1.0 */
    assert_int_equal((int8_t)buf[2], -127);
    assert_int_equal((int8_t)buf[2 + 5], 127);
    memset(x, 0, 32 * sizeof(float));
    kvr_kv_store(KVR_DTYPE_Q8_0, buf, x, 32);
    kvr_kv_load(KVR_DTYPE_Q8_0, y, buf, 32);
    assert_memory_equal(x, y, 32 * sizeof(float));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_map),
        cmocka_unit_test(test_kv_type_sizes),
        cmocka_unit_test(test_kv_conversions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
