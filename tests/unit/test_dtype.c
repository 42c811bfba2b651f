/* test_dtype.c - dtype traits, conversions, quantizers and matmul kernels.
 *
 * What is checked, and against what:
 *  - fp16/bf16 conversions: exhaustive fp16 round trips, hand-picked edge cases (overflow,
 *    subnormals, ties to even, NaN, signed zero), and the F16C instruction when present;
 *  - block layouts: hand-made blocks whose values are written out from the GGUF layout, so
 *    the decoders are checked against the format, not against the encoders;
 *  - quantizers: round-trip error bounds per type;
 *  - dot products: against a double-precision dot of the dequantized operands;
 *  - fast kernels (when the CPU has them): quantize_rows and matmul equal the reference bit
 *    for bit, and every output is bit-identical whatever the row count, o-slice or tile path
 *    (batch invariance). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "model_options.h"
#include "testutil.h"

#include "core/alloc.h"
#include "model/dtype.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------------------------------
 * Helpers
 * --------------------------------------------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_next(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Roughly normal (sum of 4 uniforms), scaled; a few outliers like real weights have. */
static float rng_normal(float scale)
{
    float s = 0.0f;
    for (int i = 0; i < 4; i++)
        s += (float)(rng_next() >> 40) / (float)(1ull << 24) - 0.5f;
    if (rng_next() % 97 == 0)
        s *= 6.0f;
    return s * scale;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static const int weight_types[] = {
    KVR_DTYPE_F32,    KVR_DTYPE_F16,  KVR_DTYPE_BF16,   KVR_DTYPE_Q8_0,
    KVR_DTYPE_Q4_0,   KVR_DTYPE_Q4_1, KVR_DTYPE_Q5_0,   KVR_DTYPE_Q5_1,
    KVR_DTYPE_IQ4_NL, KVR_DTYPE_Q2_K, KVR_DTYPE_Q3_K,   KVR_DTYPE_Q4_K,
    KVR_DTYPE_Q5_K,   KVR_DTYPE_Q6_K, KVR_DTYPE_IQ4_XS, KVR_DTYPE_MXFP4};
#define N_WEIGHT_TYPES (sizeof weight_types / sizeof weight_types[0])

/* The best set this CPU runs, or the one KVR_ISA names (CTest runs this binary once per
 * set the machine has, see CMakeLists.txt). */
static bool have_fast_kernels(void)
{
    kvr_kernels_force_reference(false);
    const char *name = kvr_kernels_init();
    static bool said;
    if (!said) {
        print_message("fast kernels under test: %s\n", name);
        said = true;
    }
    return strcmp(name, "reference") != 0;
}

/* ---------------------------------------------------------------------------------------
 * Traits table
 * --------------------------------------------------------------------------------------- */

static void test_traits_table(void **state)
{
    (void)state;
    struct {
        int type;
        const char *name;
        int64_t block_elems;
        size_t block_bytes;
        int dot_type;
        int file_type; /* llama_ftype of an all-this-type file (K-quants: _S), -1 none */
    } want[] = {
        {KVR_DTYPE_F32, "f32", 1, 4, KVR_DTYPE_F32, 0},
        {KVR_DTYPE_F16, "f16", 1, 2, KVR_DTYPE_F32, 1},
        {KVR_DTYPE_BF16, "bf16", 1, 2, KVR_DTYPE_F32, 32},
        {KVR_DTYPE_Q8_0, "q8_0", 32, 34, KVR_DTYPE_Q8_0, 7},
        {KVR_DTYPE_Q4_0, "q4_0", 32, 18, KVR_DTYPE_Q8_0, 2},
        {KVR_DTYPE_Q4_K, "q4_K", 256, 144, KVR_DTYPE_Q8_K, 14},
        {KVR_DTYPE_Q6_K, "q6_K", 256, 210, KVR_DTYPE_Q8_K, 18},
        {KVR_DTYPE_Q8_K, "q8_K", 256, 292, KVR_DTYPE_Q8_K, -1},
        {KVR_DTYPE_Q4_1, "q4_1", 32, 20, KVR_DTYPE_Q8_1, 3},
        {KVR_DTYPE_Q5_0, "q5_0", 32, 22, KVR_DTYPE_Q8_0, 8},
        {KVR_DTYPE_Q5_1, "q5_1", 32, 24, KVR_DTYPE_Q8_1, 9},
        {KVR_DTYPE_Q8_1, "q8_1", 32, 36, KVR_DTYPE_Q8_1, -1},
        {KVR_DTYPE_IQ4_NL, "iq4_nl", 32, 18, KVR_DTYPE_Q8_0, 25},
        {KVR_DTYPE_Q2_K, "q2_K", 256, 84, KVR_DTYPE_Q8_K, 10},
        {KVR_DTYPE_Q3_K, "q3_K", 256, 110, KVR_DTYPE_Q8_K, 11},
        {KVR_DTYPE_Q5_K, "q5_K", 256, 176, KVR_DTYPE_Q8_K, 16},
        {KVR_DTYPE_IQ4_XS, "iq4_xs", 256, 136, KVR_DTYPE_Q8_K, 30},
        {KVR_DTYPE_MXFP4, "mxfp4", 32, 17, KVR_DTYPE_Q8_0, 38},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const struct kvr_dtype_traits *t = kvr_dtype_traits(want[i].type);
        assert_non_null(t);
        assert_string_equal(t->name, want[i].name);
        assert_int_equal(t->block_elems, want[i].block_elems);
        assert_int_equal(t->block_bytes, want[i].block_bytes);
        assert_int_equal(t->dot_type, want[i].dot_type);
        assert_int_equal(t->file_type, want[i].file_type);
        assert_int_equal(kvr_dtype_by_name(want[i].name), want[i].type);
        assert_non_null(t->to_float);
        assert_non_null(t->from_float);
        assert_non_null(t->dot);
    }
    assert_int_equal(kvr_dtype_by_name("Q4_k"), KVR_DTYPE_Q4_K); /* any case */
    assert_int_equal(kvr_dtype_by_name("q4_k_m"), -1);           /* a preset, not a type */
    assert_int_equal(kvr_dtype_by_name(""), -1);
    int unknown[] = {-1, 4, 5, 16, 17, 18, 19, 21, 22, 24, 29, 31, 1000};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++)
        assert_null(kvr_dtype_traits(unknown[i]));

    size_t bytes = 0;
    assert_true(kvr_dtype_row_bytes(KVR_DTYPE_Q4_0, 64, &bytes));
    assert_int_equal(bytes, 36);
    assert_true(kvr_dtype_row_bytes(KVR_DTYPE_Q6_K, 512, &bytes));
    assert_int_equal(bytes, 420);
    assert_true(kvr_dtype_row_bytes(KVR_DTYPE_F16, 7, &bytes));
    assert_int_equal(bytes, 14);
    assert_false(kvr_dtype_row_bytes(KVR_DTYPE_Q8_0, 33, &bytes));
    assert_false(kvr_dtype_row_bytes(KVR_DTYPE_Q4_K, 128, &bytes));
    assert_false(kvr_dtype_row_bytes(KVR_DTYPE_F32, -4, &bytes));
    assert_false(kvr_dtype_row_bytes(KVR_DTYPE_F32, INT64_MAX, &bytes)); /* overflows */
    assert_false(kvr_dtype_row_bytes(5, 32, &bytes));
    assert_true(kvr_dtype_row_bytes(KVR_DTYPE_IQ4_XS, 512, &bytes));
    assert_int_equal(bytes, 272);
    assert_int_equal(kvr_act_row_bytes(KVR_DTYPE_IQ4_XS, 512), 584); /* Q8_K activations */
    assert_int_equal(kvr_act_row_bytes(KVR_DTYPE_Q5_1, 64), 72);     /* two Q8_1 blocks */
    assert_false(kvr_dtype_is_weight(KVR_DTYPE_Q8_1));
    assert_false(kvr_dtype_is_weight(KVR_DTYPE_Q8_K));
    assert_true(kvr_dtype_is_weight(KVR_DTYPE_Q4_1));
    assert_false(kvr_dtype_is_weight(9999));

    /* activation rows: at least the dot type's row, and 0 for impossible shapes */
    assert_int_equal(kvr_act_row_bytes(KVR_DTYPE_F16, 10), 40);
    assert_int_equal(kvr_act_row_bytes(KVR_DTYPE_Q4_K, 512), 584);
    assert_true(kvr_act_row_bytes(KVR_DTYPE_Q4_0, 64) >= 68);
    assert_int_equal(kvr_act_row_bytes(KVR_DTYPE_Q4_0, 64), kvr_act_row_bytes(KVR_DTYPE_Q8_0, 64));
    assert_int_equal(kvr_act_row_bytes(KVR_DTYPE_Q4_0, 48), 0);
}

/* ---------------------------------------------------------------------------------------
 * fp16 / bf16
 * --------------------------------------------------------------------------------------- */

static void test_f16_exhaustive_round_trip(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = kvr_f16_to_f32((uint16_t)h);
        uint16_t back = kvr_f32_to_f16(f);
        if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) { /* NaN: stays a NaN, made quiet */
            assert_true(isnan(f));
            assert_int_equal(back, h | 0x200);
        } else {
            assert_int_equal(back, h);
        }
    }
}

static void test_f16_edge_cases(void **state)
{
    (void)state;
    struct {
        float f;
        uint16_t h;
    } cases[] = {
        {0.0f, 0x0000},
        {-0.0f, 0x8000},
        {1.0f, 0x3C00},
        {-2.0f, 0xC000},
        {0.5f, 0x3800},
        {65504.0f, 0x7BFF},  /* largest finite half */
        {65519.99f, 0x7BFF}, /* just below the rounding midpoint */
        {65520.0f, 0x7C00},  /* midpoint: ties to even = infinity */
        {1e9f, 0x7C00},
        {-1e9f, 0xFC00},
        {INFINITY, 0x7C00},
        {-INFINITY, 0xFC00},
        {0x1p-14f, 0x0400},        /* smallest normal */
        {0x1p-24f, 0x0001},        /* smallest subnormal */
        {0x1p-25f, 0x0000},        /* half of it: tie, to even (zero) */
        {0x1.000002p-25f, 0x0001}, /* just above the tie */
        {0x3p-25f, 0x0002},        /* 1.5 ulp: tie to even (2) */
        {0x5p-25f, 0x0002},        /* 2.5 ulp: tie to even (2) */
        {-0x1p-24f, 0x8001},
        {0x3FFp-24f, 0x03FF},      /* largest subnormal */
        {0x7FFp-25f, 0x0400},      /* rounds up into the smallest normal */
        {1.0f + 0x1p-11f, 0x3C00}, /* tie between 1 and 1+2^-10: even (1) */
        {1.0f + 0x3p-11f, 0x3C02}, /* tie: to even mantissa 2 */
        {1.0f + 0x1p-11f + 0x1p-20f, 0x3C01},
        {1e-10f, 0x0000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = kvr_f32_to_f16(cases[i].f);
        if (got != cases[i].h)
            fail_msg("f32_to_f16(%a) = 0x%04x, want 0x%04x", (double)cases[i].f, got, cases[i].h);
    }
    assert_true(isnan(kvr_f16_to_f32(kvr_f32_to_f16(NAN))));
    assert_int_equal(kvr_f32_to_f16(bits_f32(0x7F800001)) & 0x7E00, 0x7E00); /* sNaN -> qNaN */
    assert_true(kvr_f16_to_f32(0x0001) == 0x1p-24f);
    assert_true(kvr_f16_to_f32(0x8000) == 0.0f && signbit(kvr_f16_to_f32(0x8000)));
    assert_true(kvr_f16_to_f32(0x7BFF) == 65504.0f);
    assert_true(isinf(kvr_f16_to_f32(0xFC00)) && kvr_f16_to_f32(0xFC00) < 0);
}

static void test_bf16_edge_cases(void **state)
{
    (void)state;
    assert_int_equal(kvr_f32_to_bf16(1.0f), 0x3F80);
    assert_int_equal(kvr_f32_to_bf16(-0.0f), 0x8000);
    assert_int_equal(kvr_f32_to_bf16(INFINITY), 0x7F80);
    assert_int_equal(kvr_f32_to_bf16(bits_f32(0x3F808000)), 0x3F80); /* tie: even */
    assert_int_equal(kvr_f32_to_bf16(bits_f32(0x3F818000)), 0x3F82); /* tie: even */
    assert_int_equal(kvr_f32_to_bf16(bits_f32(0x3F808001)), 0x3F81); /* above tie */
    assert_int_equal(kvr_f32_to_bf16(bits_f32(0x7F7FFFFF)), 0x7F80); /* FLT_MAX -> inf */
    assert_int_equal(kvr_f32_to_bf16(bits_f32(0x00000001)), 0x0000); /* tiny subnormal */
    uint16_t nan = kvr_f32_to_bf16(bits_f32(0x7F800001));            /* sNaN, low payload */
    assert_true(isnan(kvr_bf16_to_f32(nan)));
    assert_true(isnan(kvr_bf16_to_f32(kvr_f32_to_bf16(bits_f32(0xFFFFFFFF)))));
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = kvr_bf16_to_f32((uint16_t)h);
        if (isnan(f))
            continue;
        assert_int_equal(kvr_f32_to_bf16(f), h);
    }
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("f16c,avx"))) static uint16_t hw_f32_to_f16(float f)
{
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}
#endif

/* The F16C instruction is an independent implementation of the same IEEE rounding. */
static void test_f16_matches_f16c(void **state)
{
    (void)state;
#if defined(__x86_64__) || defined(__i386__)
    if (!have_fast_kernels()) {
        print_message("skipped: no f16c\n");
        skip();
    }
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = (uint32_t)rng_next();
        if (i % 2) /* concentrate on the half range, subnormals included */
            u = (u & 0x80000000) | (0x32000000 + (u & 0x7FFFFFF) * 2);
        float f = bits_f32(u);
        uint16_t want = hw_f32_to_f16(f), got = kvr_f32_to_f16(f);
        if (want != got)
            fail_msg("f32_to_f16(0x%08x) = 0x%04x, F16C says 0x%04x", u, got, want);
    }
#else
    print_message("skipped: not x86\n");
    skip();
#endif
}

/* ---------------------------------------------------------------------------------------
 * Hand-made blocks: the expected values are computed from the GGUF layout by hand.
 * --------------------------------------------------------------------------------------- */

static void expect_floats(const char *what, const float *got, const float *want, int n)
{
    for (int i = 0; i < n; i++)
        if (got[i] != want[i])
            fail_msg("%s element %d: got %g want %g", what, i, (double)got[i], (double)want[i]);
}

static void test_q4_0_block_layout(void **state)
{
    (void)state;
    uint8_t blk[18] = {0x00, 0x38}; /* d = 0.5 (fp16 0x3800, little-endian) */
    for (int j = 0; j < 16; j++)
        blk[2 + j] = (uint8_t)(j | ((15 - j) << 4));
    float got[32], want[32];
    for (int j = 0; j < 16; j++) {
        want[j] = (float)(j - 8) * 0.5f;           /* low nibbles: elements 0..15 */
        want[16 + j] = (float)(15 - j - 8) * 0.5f; /* high nibbles: elements 16..31 */
    }
    kvr_dtype_traits(KVR_DTYPE_Q4_0)->to_float(blk, got, 32);
    expect_floats("q4_0", got, want, 32);
    assert_true(got[0] == -4.0f && got[15] == 3.5f && got[16] == 3.5f && got[31] == -4.0f);
}

static void test_q8_0_block_layout(void **state)
{
    (void)state;
    uint8_t blk[34] = {0x00, 0x34}; /* d = 0.25 */
    float got[32];
    for (int j = 0; j < 32; j++)
        blk[2 + j] = (uint8_t)(int8_t)(j * 8 - 128);
    kvr_dtype_traits(KVR_DTYPE_Q8_0)->to_float(blk, got, 32);
    for (int j = 0; j < 32; j++)
        assert_true(got[j] == (float)(j * 8 - 128) * 0.25f);
    assert_true(got[0] == -32.0f);
}

static void test_q4_k_block_layout(void **state)
{
    (void)state;
    /* sc = {1,2,3,4,17,33,63,5}, m = {0,1,2,3,16,40,63,7}, packed by hand:
     * byte j (j<4) = sc[j] | (sc[j+4]>>4)<<6, byte j+4 = m[j] | (m[j+4]>>4)<<6,
     * byte j+8 = (sc[j+4]&15) | (m[j+4]&15)<<4. */
    static const uint8_t scales[12] = {0x41, 0x82, 0xC3, 0x04, 0x40, 0x81,
                                       0xC2, 0x03, 0x01, 0x81, 0xFF, 0x75};
    const int sc[8] = {1, 2, 3, 4, 17, 33, 63, 5}, mn[8] = {0, 1, 2, 3, 16, 40, 63, 7};
    uint8_t blk[144] = {0x00, 0x3C, 0x00, 0x38}; /* d = 1, dmin = 0.5 */
    memcpy(blk + 4, scales, 12);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            blk[16 + 32 * c + l] = (uint8_t)((l & 15) | (((l + 3) & 15) << 4));
    float got[256], want[256];
    for (int c = 0; c < 4; c++) {
        for (int l = 0; l < 32; l++) {
            want[64 * c + l] = (float)(sc[2 * c] * (l & 15)) - 0.5f * (float)mn[2 * c];
            want[64 * c + 32 + l] =
                (float)(sc[2 * c + 1] * ((l + 3) & 15)) - 0.5f * (float)mn[2 * c + 1];
        }
    }
    kvr_dtype_traits(KVR_DTYPE_Q4_K)->to_float(blk, got, 256);
    expect_floats("q4_K", got, want, 256);
    /* spot values worked out by hand */
    assert_true(got[1] == 1.0f && got[32] == 5.5f && got[69] == 14.0f && got[128] == -8.0f);
    assert_true(got[170] == 409.0f && got[223] == 913.5f && got[255] == 6.5f);
}

static void test_q6_k_block_layout(void **state)
{
    (void)state;
    uint8_t blk[210];
    for (int i = 0; i < 128; i++)
        blk[i] = (uint8_t)i; /* ql */
    for (int i = 0; i < 64; i++)
        blk[128 + i] = (uint8_t)(i * 5); /* qh */
    for (int k = 0; k < 16; k++)
        blk[192 + k] = (uint8_t)(int8_t)(k - 5); /* scales */
    blk[208] = 0x00;
    blk[209] = 0x34; /* d = 0.25 */
    float got[256];
    kvr_dtype_traits(KVR_DTYPE_Q6_K)->to_float(blk, got, 256);
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; h++) {
        for (int l = 0; l < 32; l++) {
            int q[4] = {(ql[64 * h + l] & 15) | ((qh[32 * h + l] & 3) << 4),
                        (ql[64 * h + l + 32] & 15) | (((qh[32 * h + l] >> 2) & 3) << 4),
                        (ql[64 * h + l] >> 4) | (((qh[32 * h + l] >> 4) & 3) << 4),
                        (ql[64 * h + l + 32] >> 4) | (((qh[32 * h + l] >> 6) & 3) << 4)};
            for (int k = 0; k < 4; k++) {
                int e = 128 * h + 32 * k + l;
                float want = 0.25f * (float)(e / 16 - 5) * (float)(q[k] - 32);
                if (got[e] != want)
                    fail_msg("q6_K element %d: got %g want %g", e, (double)got[e], (double)want);
            }
        }
    }
    /* spot values worked out by hand */
    assert_true(got[0] == 40.0f && got[1] == 18.75f && got[33] == 11.25f && got[64] == 8.0f);
    assert_true(got[97] == -7.5f && got[129] == -11.25f && got[255] == -62.5f);
}

/* Q4_1, Q5_0, Q5_1 and IQ4_NL: one block each, d = 0.5 (fp16 0x3800), m = -2 (0xC000). */
static void test_legacy_block_layouts(void **state)
{
    (void)state;
    static const int grid[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                 1,    13,   25,  38,  53,  69,  89,  113};
    uint8_t qs[16];
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)((j * 7) % 16 | ((j * 3 + 5) % 16) << 4);
    const uint32_t qh = 0xA5F0C381u; /* bit j: fifth bit of element j */
    int nib[32], q5[32];
    for (int j = 0; j < 16; j++) {
        nib[j] = (j * 7) % 16;
        nib[j + 16] = (j * 3 + 5) % 16;
    }
    for (int j = 0; j < 32; j++)
        q5[j] = nib[j] | (int)((qh >> j) & 1) << 4;
    uint8_t b41[20] = {0x00, 0x38, 0x00, 0xC0}, b50[22] = {0x00, 0x38},
            b51[24] = {0x00, 0x38, 0x00, 0xC0}, bnl[18] = {0x00, 0x38};
    memcpy(b41 + 4, qs, 16);
    for (int k = 0; k < 4; k++) {
        b50[2 + k] = (uint8_t)(qh >> (8 * k));
        b51[4 + k] = (uint8_t)(qh >> (8 * k));
    }
    memcpy(b50 + 6, qs, 16);
    memcpy(b51 + 8, qs, 16);
    memcpy(bnl + 2, qs, 16);
    float got[32], want[32];
    for (int j = 0; j < 32; j++)
        want[j] = (float)nib[j] * 0.5f - 2.0f;
    kvr_dtype_traits(KVR_DTYPE_Q4_1)->to_float(b41, got, 32);
    expect_floats("q4_1", got, want, 32);
    for (int j = 0; j < 32; j++)
        want[j] = (float)(q5[j] - 16) * 0.5f;
    kvr_dtype_traits(KVR_DTYPE_Q5_0)->to_float(b50, got, 32);
    expect_floats("q5_0", got, want, 32);
    for (int j = 0; j < 32; j++)
        want[j] = (float)q5[j] * 0.5f - 2.0f;
    kvr_dtype_traits(KVR_DTYPE_Q5_1)->to_float(b51, got, 32);
    expect_floats("q5_1", got, want, 32);
    for (int j = 0; j < 32; j++)
        want[j] = (float)grid[nib[j]] * 0.5f;
    kvr_dtype_traits(KVR_DTYPE_IQ4_NL)->to_float(bnl, got, 32);
    expect_floats("iq4_nl", got, want, 32);
    /* spot values worked out by hand: qs[0] = 0x50, qh bit 0 = 1, bit 16 = 0 */
    kvr_dtype_traits(KVR_DTYPE_Q5_0)->to_float(b50, got, 32);
    assert_true(got[0] == 0.0f && got[16] == -5.5f);
    kvr_dtype_traits(KVR_DTYPE_IQ4_NL)->to_float(bnl, got, 32);
    assert_true(got[0] == -63.5f && got[16] == -17.5f);

    /* MXFP4: E8M0 byte 126 (scale 2^-1), then the nibbles as Q4_0; element = E2M1 * 0.5 */
    static const float e2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    uint8_t bmx[17] = {126};
    memcpy(bmx + 1, qs, 16);
    for (int j = 0; j < 32; j++)
        want[j] = e2m1[nib[j]] * 0.5f;
    kvr_dtype_traits(KVR_DTYPE_MXFP4)->to_float(bmx, got, 32);
    expect_floats("mxfp4", got, want, 32);
    /* the scale's ends: byte 0 is 2^-127 (subnormal), 254 is 2^127 */
    bmx[0] = 0;
    kvr_dtype_traits(KVR_DTYPE_MXFP4)->to_float(bmx, got, 32);
    assert_true(got[16] == 3.0f * 0x1p-127f); /* element 16: code 5, E2M1 3 */
    bmx[0] = 254;
    kvr_dtype_traits(KVR_DTYPE_MXFP4)->to_float(bmx, got, 32);
    assert_true(got[16] == 3.0f * 0x1p127f);
}

/* Q2_K and Q3_K share the 2-bit layout: element 128h + 32j + l is bits 2j..2j+1 of byte
 * 32h + l; Q3_K's third bit is bit 4h + j of hmask byte l. */
static void test_q2_k_q3_k_block_layout(void **state)
{
    (void)state;
    uint8_t q2[84], q3[110];
    int low[256], hbit[256];
    for (int i = 0; i < 64; i++)
        q2[16 + i] = q3[32 + i] = (uint8_t)(i * 37 + 11);
    for (int i = 0; i < 32; i++)
        q3[i] = (uint8_t)(i * 53 + 7);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int e = 128 * h + 32 * j + l;
                low[e] = ((uint8_t)((32 * h + l) * 37 + 11) >> (2 * j)) & 3;
                hbit[e] = ((uint8_t)(l * 53 + 7) >> (4 * h + j)) & 1;
            }
    for (int k = 0; k < 16; k++)
        q2[k] = (uint8_t)((k % 16) | ((15 - k) << 4)); /* scale k, min 15 - k */
    q2[80] = 0x00;
    q2[81] = 0x3C; /* d = 1 */
    q2[82] = 0x00;
    q2[83] = 0x38; /* dmin = 0.5 */
    /* Q3_K scales: stored value v[k] = 3k + 9 (0..63), packed by hand */
    int v[16];
    memset(q3 + 96, 0, 12);
    for (int k = 0; k < 16; k++) {
        v[k] = 3 * k + 9;
        if (k < 8)
            q3[96 + k] |= (uint8_t)(v[k] & 15);
        else
            q3[96 + k - 8] |= (uint8_t)((v[k] & 15) << 4);
        q3[96 + 8 + k % 4] |= (uint8_t)((v[k] >> 4) << (2 * (k / 4)));
    }
    q3[108] = 0x00;
    q3[109] = 0x34; /* d = 0.25 */
    float got[256], want[256];
    for (int e = 0; e < 256; e++)
        want[e] = (float)((e / 16) * low[e]) - 0.5f * (float)(15 - e / 16);
    kvr_dtype_traits(KVR_DTYPE_Q2_K)->to_float(q2, got, 256);
    expect_floats("q2_K", got, want, 256);
    for (int e = 0; e < 256; e++)
        want[e] = 0.25f * (float)(v[e / 16] - 32) * (float)((low[e] | hbit[e] << 2) - 4);
    kvr_dtype_traits(KVR_DTYPE_Q3_K)->to_float(q3, got, 256);
    expect_floats("q3_K", got, want, 256);
    /* spot values worked out by hand: q byte 0 = 11 (0b1011), hmask byte 0 = 7 */
    kvr_dtype_traits(KVR_DTYPE_Q2_K)->to_float(q2, got, 256);
    assert_true(got[0] == -7.5f && got[32] == -2.5f);
    kvr_dtype_traits(KVR_DTYPE_Q3_K)->to_float(q3, got, 256);
    assert_true(got[0] == -17.25f && got[32] == -8.5f);
}

static void test_q5_k_iq4_xs_block_layout(void **state)
{
    (void)state;
    static const int grid[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                 1,    13,   25,  38,  53,  69,  89,  113};
    /* Q5_K: the Q4_K scale bytes of test_q4_k_block_layout, plus qh */
    static const uint8_t scales[12] = {0x41, 0x82, 0xC3, 0x04, 0x40, 0x81,
                                       0xC2, 0x03, 0x01, 0x81, 0xFF, 0x75};
    const int sc[8] = {1, 2, 3, 4, 17, 33, 63, 5}, mn[8] = {0, 1, 2, 3, 16, 40, 63, 7};
    uint8_t b5[176] = {0x00, 0x3C, 0x00, 0x38}; /* d = 1, dmin = 0.5 */
    memcpy(b5 + 4, scales, 12);
    for (int l = 0; l < 32; l++)
        b5[16 + l] = (uint8_t)(l * 29 + 3);
    for (int i = 0; i < 128; i++)
        b5[48 + i] = (uint8_t)(i * 13 + 1);
    float got[256], want[256];
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 32; l++) {
            uint8_t byte = (uint8_t)((32 * (j / 2) + l) * 13 + 1);
            int q = ((j % 2) ? byte >> 4 : byte & 15) | (((uint8_t)(l * 29 + 3) >> j) & 1) << 4;
            want[32 * j + l] = (float)(sc[j] * q) - 0.5f * (float)mn[j];
        }
    kvr_dtype_traits(KVR_DTYPE_Q5_K)->to_float(b5, got, 256);
    expect_floats("q5_K", got, want, 256);
    assert_true(got[0] == 17.0f && got[32] == 31.5f); /* q = 1 | 16, q = 0 | 16 */
    /* IQ4_XS: stored scales v[j] = 7j + 5 */
    uint8_t bx[136] = {0x00, 0x38}; /* d = 0.5 */
    int v[8];
    uint16_t sh = 0;
    for (int j = 0; j < 8; j++) {
        v[j] = 7 * j + 5;
        sh |= (uint16_t)((v[j] >> 4) << (2 * j));
    }
    bx[2] = (uint8_t)sh;
    bx[3] = (uint8_t)(sh >> 8);
    for (int k = 0; k < 4; k++)
        bx[4 + k] = (uint8_t)((v[2 * k] & 15) | (v[2 * k + 1] & 15) << 4);
    for (int i = 0; i < 128; i++)
        bx[8 + i] = (uint8_t)(i * 71 + 2);
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 32; l++) {
            uint8_t byte = (uint8_t)((16 * j + l % 16) * 71 + 2);
            int q = l < 16 ? byte & 15 : byte >> 4;
            want[32 * j + l] = 0.5f * (float)(v[j] - 32) * (float)grid[q];
        }
    kvr_dtype_traits(KVR_DTYPE_IQ4_XS)->to_float(bx, got, 256);
    expect_floats("iq4_xs", got, want, 256);
    assert_true(got[0] == 1120.5f && got[16] == 1714.5f); /* scale -27, indices 2 and 0 */
}

static void test_q8_k_block_layout(void **state)
{
    (void)state;
    float x[256], y[256];
    for (int i = 0; i < 256; i++)
        x[i] = (float)((i % 37) - 18) / 18.0f;
    uint8_t blk[292];
    kvr_dtype_traits(KVR_DTYPE_Q8_K)->from_float(x, blk, 256);
    float d;
    memcpy(&d, blk, 4);
    assert_true(d == 1.0f / 127.0f);
    for (int k = 0; k < 16; k++) {
        int16_t bsum;
        int want = 0;
        memcpy(&bsum, blk + 260 + 2 * k, 2);
        for (int j = 0; j < 16; j++)
            want += (int8_t)blk[4 + 16 * k + j];
        assert_int_equal(bsum, want);
    }
    kvr_dtype_traits(KVR_DTYPE_Q8_K)->to_float(blk, y, 256);
    for (int i = 0; i < 256; i++)
        assert_true(fabsf(y[i] - x[i]) <= 0.5f * d * 1.0001f);
}

/* ---------------------------------------------------------------------------------------
 * Quantizer round trips and dots against dequantized doubles
 * --------------------------------------------------------------------------------------- */

static void test_round_trip_error(void **state)
{
    (void)state;
    struct {
        int type;
        double max_rel_rmse;
    } bounds[] = {
        {KVR_DTYPE_F32, 0.0},     {KVR_DTYPE_F16, 1e-3},   {KVR_DTYPE_BF16, 5e-3},
        {KVR_DTYPE_Q8_0, 0.012},  {KVR_DTYPE_Q4_0, 0.16},  {KVR_DTYPE_Q4_K, 0.12},
        {KVR_DTYPE_Q6_K, 0.04},   {KVR_DTYPE_Q8_K, 0.04},  {KVR_DTYPE_Q4_1, 0.12},
        {KVR_DTYPE_Q5_0, 0.1},    {KVR_DTYPE_Q5_1, 0.06},  {KVR_DTYPE_IQ4_NL, 0.12},
        {KVR_DTYPE_Q2_K, 0.3},    {KVR_DTYPE_Q3_K, 0.2},   {KVR_DTYPE_Q5_K, 0.06},
        {KVR_DTYPE_IQ4_XS, 0.12}, {KVR_DTYPE_Q8_1, 0.012}, {KVR_DTYPE_MXFP4, 0.2},
    };
    enum { N = 4096 };
    float *x = kvr_malloc(N * sizeof *x), *y = kvr_malloc(N * sizeof *y);
    uint8_t *buf = kvr_malloc(N * 4);
    assert_non_null(x);
    assert_non_null(y);
    assert_non_null(buf);
    for (int i = 0; i < N; i++)
        x[i] = rng_normal(0.02f) + (i % 512 == 7 ? 0.3f : 0.0f);
    for (size_t t = 0; t < sizeof bounds / sizeof bounds[0]; t++) {
        const struct kvr_dtype_traits *tr = kvr_dtype_traits(bounds[t].type);
        tr->from_float(x, buf, N);
        tr->to_float(buf, y, N);
        double err = 0, ref = 0;
        for (int i = 0; i < N; i++) {
            err += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
            ref += (double)x[i] * x[i];
        }
        double rel = sqrt(err / ref);
        print_message("%s: relative rms error %.4g\n", tr->name, rel);
        if (rel > bounds[t].max_rel_rmse)
            fail_msg("%s: relative rms error %g > %g", tr->name, rel, bounds[t].max_rel_rmse);
        /* per-element bound for the absmax types: half a step plus the fp16 scale rounding */
        if (bounds[t].type == KVR_DTYPE_Q8_0 || bounds[t].type == KVR_DTYPE_Q4_0) {
            int per = bounds[t].type == KVR_DTYPE_Q8_0 ? 127 : 8;
            for (int b = 0; b < N / 32; b++) {
                float amax = 0;
                for (int j = 0; j < 32; j++)
                    amax = fmaxf(amax, fabsf(x[32 * b + j]));
                float step = amax / (float)per;
                /* Q4_0 can clamp the far end (+8 steps) to +7: one full step */
                float bound = bounds[t].type == KVR_DTYPE_Q8_0 ? 0.6f * step : 1.1f * step;
                for (int j = 0; j < 32; j++)
                    if (fabsf(x[32 * b + j] - y[32 * b + j]) > bound)
                        fail_msg("%s: element %d error %g > %g", tr->name, 32 * b + j,
                                 (double)fabsf(x[32 * b + j] - y[32 * b + j]), (double)bound);
            }
        }
    }
    /* all-zero input gives zero blocks, never NaN */
    memset(x, 0, N * sizeof *x);
    for (size_t t = 0; t < sizeof bounds / sizeof bounds[0]; t++) {
        const struct kvr_dtype_traits *tr = kvr_dtype_traits(bounds[t].type);
        tr->from_float(x, buf, 512);
        tr->to_float(buf, y, 512);
        for (int i = 0; i < 512; i++)
            assert_true(y[i] == 0.0f);
    }
    kvr_free(buf);
    kvr_free(y);
    kvr_free(x);
}

/* Q4_1 and Q5_1 dot with Q8_1, whose s = fp16(d * sum(qs)) stands for d_x * sum(qs) in the
 * min's term: sum over blocks of m_w * (s_x - d_x * sum(qs)), the difference between the
 * format's dot and the dequantized one. Both weight types keep fp16 d, m in bytes 0..3 of a
 * block; a Q8_1 block is fp16 d, fp16 s, 32 int8 quants. */
static double q8_1_min_correction(const uint8_t *w, size_t w_block_bytes, const uint8_t *x,
                                  int n_blocks)
{
    double c = 0;
    for (int b = 0; b < n_blocks; b++) {
        const uint8_t *wb = w + (size_t)b * w_block_bytes, *xb = x + (size_t)b * 36;
        uint16_t m, d, s;
        memcpy(&m, wb + 2, 2);
        memcpy(&d, xb, 2);
        memcpy(&s, xb + 2, 2);
        int sum = 0;
        for (int j = 0; j < 32; j++)
            sum += (int8_t)xb[4 + j];
        c += (double)kvr_f16_to_f32(m) *
             ((double)kvr_f16_to_f32(s) - (double)kvr_f16_to_f32(d) * sum);
    }
    return c;
}

static void test_dot_matches_dequantized(void **state)
{
    (void)state;
    enum { N = 1024 };
    float *w = kvr_malloc(N * 4), *x = kvr_malloc(N * 4), *wd = kvr_malloc(N * 4),
          *xd = kvr_malloc(N * 4);
    uint8_t *wq = kvr_malloc(N * 4 + 64), *xq = kvr_malloc(N * 4 + 64);
    for (int i = 0; i < N; i++) {
        w[i] = rng_normal(0.05f);
        x[i] = rng_normal(1.0f);
    }
    for (size_t t = 0; t < N_WEIGHT_TYPES; t++) {
        const struct kvr_dtype_traits *tr = kvr_dtype_traits(weight_types[t]);
        const struct kvr_dtype_traits *at = kvr_dtype_traits(tr->dot_type);
        tr->from_float(w, wq, N);
        tr->to_float(wq, wd, N);
        at->from_float(x, xq, N);
        at->to_float(xq, xd, N);
        double want = 0, mag = 0;
        for (int i = 0; i < N; i++) {
            want += (double)wd[i] * xd[i];
            mag += fabs((double)wd[i] * xd[i]);
        }
        if (tr->dot_type == KVR_DTYPE_Q8_1) /* the min's term is m_w * s_x, s_x as stored */
            want += q8_1_min_correction(wq, tr->block_bytes, xq, N / 32);
        double got = tr->dot(N, wq, xq);
        if (fabs(got - want) > 1e-5 * mag)
            fail_msg("%s dot: %.9g vs dequantized %.9g (magnitude %g)", tr->name, got, want, mag);
    }
    kvr_free(wq);
    kvr_free(xq);
    kvr_free(w);
    kvr_free(x);
    kvr_free(wd);
    kvr_free(xd);
}

/* ---------------------------------------------------------------------------------------
 * Matmul: fast vs reference, batch invariance
 * --------------------------------------------------------------------------------------- */

struct mm_case {
    struct kvr_matrix w;
    void *wbuf;
    float *x; /* [n_rows x n_in] */
    void *xq; /* [n_rows x act row bytes] */
    size_t x_stride;
    int64_t n_rows;
};

/* n_in per type: several K chunks of the blocked GEMM with a ragged last one for Q8_0 and
 * Q4_0 (2080 = 65 blocks), and an f32 tail (n % 8 != 0). */
static int64_t case_n_in(int type)
{
    switch (type) {
    case KVR_DTYPE_F32:
        return 203;
    case KVR_DTYPE_F16:
    case KVR_DTYPE_BF16:
        return 268;
    case KVR_DTYPE_Q8_0:
    case KVR_DTYPE_Q4_0:
    case KVR_DTYPE_Q4_1:
    case KVR_DTYPE_Q5_0:
    case KVR_DTYPE_Q5_1:
    case KVR_DTYPE_IQ4_NL:
    case KVR_DTYPE_MXFP4:
        return 2080;
    default:
        return 768;
    }
}

static void mm_case_init(struct mm_case *c, int type, int64_t n_out, int64_t n_rows)
{
    int64_t n_in = case_n_in(type);
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(type);
    size_t row_bytes;
    assert_true(kvr_dtype_row_bytes(type, n_in, &row_bytes));
    c->wbuf = kvr_malloc(row_bytes * (size_t)n_out);
    float *wf = kvr_malloc(sizeof(float) * (size_t)n_in);
    assert_non_null(c->wbuf);
    assert_non_null(wf);
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t i = 0; i < n_in; i++)
            wf[i] = rng_normal(0.04f);
        tr->from_float(wf, (uint8_t *)c->wbuf + (size_t)o * row_bytes, n_in);
    }
    kvr_free(wf);
    c->w = (struct kvr_matrix){type, n_in, n_out, row_bytes, c->wbuf, NULL};
    c->n_rows = n_rows;
    c->x = kvr_malloc(sizeof(float) * (size_t)(n_in * n_rows));
    for (int64_t i = 0; i < n_in * n_rows; i++)
        c->x[i] = rng_normal(1.0f);
    c->x_stride = kvr_act_row_bytes(type, n_in);
    assert_true(c->x_stride > 0);
    c->xq = kvr_malloc(c->x_stride * (size_t)n_rows);
    kvr_quantize_rows(type, c->x, n_in, 0, n_rows, c->xq);
}

static void mm_case_fini(struct mm_case *c)
{
    kvr_free(c->wbuf);
    kvr_free(c->x);
    kvr_free(c->xq);
}

/* Y [n_rows x n_out] with the given row count and o-slices (given as cut points). */
static void run_matmul(const struct mm_case *c, int64_t n_rows, const int64_t *cuts, int n_cuts,
                       float *y)
{
    int64_t prev = 0;
    for (int i = 0; i <= n_cuts; i++) {
        int64_t next = i < n_cuts ? cuts[i] : c->w.n_out;
        kvr_matmul(&c->w, c->xq, n_rows, y, c->w.n_out, prev, next);
        prev = next;
    }
}

static void test_quantize_rows_fast_equals_reference(void **state)
{
    (void)state;
    if (!have_fast_kernels()) {
        print_message("skipped: no fast kernels on this CPU\n");
        skip();
    }
    for (size_t t = 0; t < N_WEIGHT_TYPES; t++) {
        int type = weight_types[t];
        int64_t n_in = case_n_in(type) * 2, n_rows = 5;
        size_t stride = kvr_act_row_bytes(type, n_in);
        float *x = kvr_malloc(sizeof(float) * (size_t)(n_in * n_rows));
        uint8_t *a = kvr_malloc(stride * (size_t)n_rows), *b = kvr_malloc(stride * (size_t)n_rows);
        for (int64_t i = 0; i < n_in * n_rows; i++)
            x[i] = rng_normal(i % 3 ? 1.0f : 1e-3f);
        for (int64_t i = 0; i < n_in; i++)
            x[2 * n_in + i] = 0.0f;     /* an all-zero row */
        x[7] = 0.5f * (float)(1 << 20); /* an exact .5 multiple of the step: a rounding tie */
        memset(a, 0xAA, stride * (size_t)n_rows);
        memset(b, 0x55, stride * (size_t)n_rows);
        kvr_kernels_force_reference(true);
        kvr_quantize_rows(type, x, n_in, 0, n_rows, a);
        kvr_kernels_force_reference(false);
        kvr_quantize_rows(type, x, n_in, 0, 2, b);
        kvr_quantize_rows(type, x, n_in, 2, n_rows, b);
        if (memcmp(a, b, stride * (size_t)n_rows) != 0)
            fail_msg("%s: fast activation quantizer differs from the reference",
                     kvr_dtype_traits(type)->name);
        kvr_free(x);
        kvr_free(a);
        kvr_free(b);
    }
}

/* The reference matmul is the trait dot per element; the fast one must equal it bit for bit
 * (both follow the operation order documented in dtype.c). */
static void test_matmul_fast_equals_reference(void **state)
{
    (void)state;
    if (!have_fast_kernels()) {
        print_message("skipped: no fast kernels on this CPU\n");
        skip();
    }
    for (size_t t = 0; t < N_WEIGHT_TYPES; t++) {
        struct mm_case c;
        mm_case_init(&c, weight_types[t], 45, 13);
        size_t n = (size_t)(c.n_rows * c.w.n_out);
        float *ref = kvr_malloc(n * sizeof(float)), *fast = kvr_malloc(n * sizeof(float));
        const struct kvr_dtype_traits *tr = kvr_dtype_traits(c.w.type);
        /* the reference set against the trait dot directly */
        kvr_kernels_force_reference(true);
        run_matmul(&c, c.n_rows, NULL, 0, ref);
        for (int64_t r = 0; r < c.n_rows; r++)
            for (int64_t o = 0; o < c.w.n_out; o++) {
                float d = tr->dot(c.w.n_in, (const uint8_t *)c.w.data + (size_t)o * c.w.row_bytes,
                                  (const uint8_t *)c.xq + (size_t)r * c.x_stride);
                assert_memory_equal(&d, &ref[r * c.w.n_out + o], sizeof d);
            }
        kvr_kernels_force_reference(false);
        for (int64_t rows = 1; rows <= c.n_rows; rows++) { /* GEMV and GEMM paths */
            memset(fast, 0xFF, n * sizeof(float));
            run_matmul(&c, rows, NULL, 0, fast);
            for (int64_t i = 0; i < rows * c.w.n_out; i++) {
                if (f32_bits(fast[i]) != f32_bits(ref[i]))
                    fail_msg("%s rows=%d: y[%d][%d] fast %.9g reference %.9g", tr->name, (int)rows,
                             (int)(i / c.w.n_out), (int)(i % c.w.n_out), (double)fast[i],
                             (double)ref[i]);
            }
        }
        kvr_free(ref);
        kvr_free(fast);
        mm_case_fini(&c);
    }
}

static void check_batch_invariance(bool reference)
{
    static const int64_t row_counts[] = {2, 3, 5, 6, 7, 8, 13, 37};
    static const int64_t cut_sets[][3] = {{0, 0, 0}, {5, 21, 0}, {1, 2, 40}, {16, 32, 0}};
    static const int n_cut_sets[] = {0, 2, 3, 2};
    kvr_kernels_force_reference(reference);
    for (size_t t = 0; t < N_WEIGHT_TYPES; t++) {
        struct mm_case c;
        mm_case_init(&c, weight_types[t], 45, 37);
        int64_t n_out = c.w.n_out;
        float *solo = kvr_malloc(sizeof(float) * (size_t)(c.n_rows * n_out));
        float *y = kvr_malloc(sizeof(float) * (size_t)(c.n_rows * n_out));
        /* every row alone (n_rows = 1), whole matrix */
        for (int64_t r = 0; r < c.n_rows; r++) {
            struct mm_case one = c;
            one.xq = (uint8_t *)c.xq + (size_t)r * c.x_stride;
            run_matmul(&one, 1, NULL, 0, solo + r * n_out);
        }
        for (size_t k = 0; k < sizeof row_counts / sizeof row_counts[0]; k++) {
            for (size_t s = 0; s < sizeof n_cut_sets / sizeof n_cut_sets[0]; s++) {
                int64_t rows = row_counts[k];
                memset(y, 0xFF, sizeof(float) * (size_t)(rows * n_out));
                run_matmul(&c, rows, cut_sets[s], n_cut_sets[s], y);
                if (memcmp(y, solo, sizeof(float) * (size_t)(rows * n_out)) != 0)
                    fail_msg("%s (%s kernels): n_rows=%d cut set %d differs from row-by-row",
                             kvr_dtype_traits(c.w.type)->name, kvr_kernels_name(), (int)rows,
                             (int)s);
            }
        }
        /* the thread split helper, 2 and 3 threads */
        for (int nth = 2; nth <= 3; nth++) {
            memset(y, 0xFF, sizeof(float) * (size_t)(c.n_rows * n_out));
            for (int ith = 0; ith < nth; ith++) {
                int64_t b, e;
                kvr_matmul_split(n_out, ith, nth, &b, &e);
                kvr_matmul(&c.w, c.xq, c.n_rows, y, n_out, b, e);
            }
            assert_memory_equal(y, solo, sizeof(float) * (size_t)(c.n_rows * n_out));
        }
        kvr_free(solo);
        kvr_free(y);
        mm_case_fini(&c);
    }
    kvr_kernels_force_reference(false);
}

static void test_batch_invariance_fast(void **state)
{
    (void)state;
    if (!have_fast_kernels()) {
        print_message("skipped: no fast kernels on this CPU\n");
        skip();
    }
    check_batch_invariance(false);
}

static void test_batch_invariance_reference(void **state)
{
    (void)state;
    check_batch_invariance(true);
}

static void test_matmul_split(void **state)
{
    (void)state;
    for (int ref = 0; ref < 2; ref++) {
        kvr_kernels_force_reference(ref);
        int64_t sizes[] = {0, 1, 7, 8, 9, 45, 256, 5632, 32000};
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            for (int nth = 1; nth <= 5; nth++) {
                int64_t expect = 0;
                for (int ith = 0; ith < nth; ith++) {
                    int64_t b, e;
                    kvr_matmul_split(sizes[i], ith, nth, &b, &e);
                    assert_int_equal(b, expect); /* contiguous, in order, covering */
                    assert_true(e >= b && e <= sizes[i]);
                    if (e < sizes[i] && e > b)
                        assert_int_equal(e % 8 == 0 || ref, 1);
                    expect = e;
                }
                assert_int_equal(expect, sizes[i]);
            }
        }
    }
    kvr_kernels_force_reference(false);
}

static void test_get_row(void **state)
{
    (void)state;
    for (size_t t = 0; t < N_WEIGHT_TYPES; t++) {
        struct mm_case c;
        mm_case_init(&c, weight_types[t], 9, 1);
        float *got = kvr_malloc(sizeof(float) * (size_t)c.w.n_in);
        float *want = kvr_malloc(sizeof(float) * (size_t)c.w.n_in);
        kvr_matrix_get_row(&c.w, 7, got);
        kvr_dtype_traits(c.w.type)->to_float((const uint8_t *)c.w.data + 7 * c.w.row_bytes, want,
                                             c.w.n_in);
        assert_memory_equal(got, want, sizeof(float) * (size_t)c.w.n_in);
        kvr_free(got);
        kvr_free(want);
        mm_case_fini(&c);
    }
}

int main(void)
{
    kvr_test_model_options();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_traits_table),
        cmocka_unit_test(test_f16_exhaustive_round_trip),
        cmocka_unit_test(test_f16_edge_cases),
        cmocka_unit_test(test_bf16_edge_cases),
        cmocka_unit_test(test_f16_matches_f16c),
        cmocka_unit_test(test_q4_0_block_layout),
        cmocka_unit_test(test_q8_0_block_layout),
        cmocka_unit_test(test_q4_k_block_layout),
        cmocka_unit_test(test_q6_k_block_layout),
        cmocka_unit_test(test_q8_k_block_layout),
        cmocka_unit_test(test_legacy_block_layouts),
        cmocka_unit_test(test_q2_k_q3_k_block_layout),
        cmocka_unit_test(test_q5_k_iq4_xs_block_layout),
        cmocka_unit_test(test_round_trip_error),
        cmocka_unit_test(test_dot_matches_dequantized),
        cmocka_unit_test(test_quantize_rows_fast_equals_reference),
        cmocka_unit_test(test_matmul_fast_equals_reference),
        cmocka_unit_test(test_batch_invariance_fast),
        cmocka_unit_test(test_batch_invariance_reference),
        cmocka_unit_test(test_matmul_split),
        cmocka_unit_test(test_get_row),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
