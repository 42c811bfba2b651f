/* test_gptoss.c - gpt-oss's pieces (model/gptoss.h): the attention sink's softmax against
 * hand-worked values, the clamped SwiGLU at and beyond its limits, and YaRN's tables (no
 * change at factor 1, the fast pairs kept and the slow ones interpolated at factor 32, both
 * scaled by 1 + 0.1 ln 32), and the YaRN keys' checks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "model/gguf.h"
#include "model/gguf_write.h"
#include "model/gptoss.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void test_softmax_sink(void **state)
{
    (void)state;
    float s[3] = {0.0f, 1.0f, 2.0f};
    kvr_softmax_sink(s, 3, 1.0f);
    double z = 1.0 + exp(1.0) + exp(2.0) + exp(1.0); /* the sink's slot has no value */
    assert_float_equal(s[0], 1.0 / z, 1e-6);
    assert_float_equal(s[1], exp(1.0) / z, 1e-6);
    assert_float_equal(s[2], exp(2.0) / z, 1e-6);
    assert_true(s[0] + s[1] + s[2] < 0.85f);
    /* a sink far above every score takes all the weight, without overflow */
    float t[2] = {0.0f, 0.0f};
    kvr_softmax_sink(t, 2, 200.0f);
    assert_true(t[0] >= 0.0f && t[0] < 1e-30f && t[1] == t[0]);
    /* a sink far below changes nothing */
    float u[2] = {0.0f, 0.0f};
    kvr_softmax_sink(u, 2, -200.0f);
    assert_float_equal(u[0], 0.5, 1e-7);
}

static double swiglu_want(double g, double u)
{
    g = g < 7.0 ? g : 7.0;
    u = u < -7.0 ? -7.0 : u > 7.0 ? 7.0 : u;
    return g / (1.0 + exp(-1.702 * g)) * (u + 1.0);
}

static void test_swiglu_oai(void **state)
{
    (void)state;
    float gate[6] = {-3.0f, 0.5f, 6.9f, 7.0f, 20.0f, 1.0f};
    const float up[6] = {0.0f, -1.0f, 2.0f, 9.0f, -30.0f, 7.5f};
    float want[6];
    for (int i = 0; i < 6; i++)
        want[i] = (float)swiglu_want(gate[i], up[i]);
    kvr_swiglu_oai(gate, up, 6);
    for (int i = 0; i < 6; i++)
        assert_float_equal(gate[i], want[i], 1e-5 * (1.0 + fabs(want[i])));
    assert_float_equal(gate[1], 0.0, 0.0); /* up -1: (u + 1) = 0 */
    /* gate 20 is clamped to 7, up -30 to -7: 7 sigmoid(11.914) (-6) */
    assert_float_equal(gate[4], -42.0 / (1.0 + exp(-11.914)), 1e-4);
}

static void test_yarn_tables(void **state)
{
    (void)state;
    enum { N_ROT = 32 };
    float c[N_ROT / 2], s[N_ROT / 2];
    const float base = 150000.0f;
    /* factor 1: plain RoPE, angle pos * base^(-2i / n_rot), unscaled */
    struct kvr_yarn one = {1.0f, 4096, 32.0f, 1.0f, 1.0f, 0.0f};
    kvr_yarn_tables(c, s, N_ROT, 37, base, &one);
    for (int i = 0; i < N_ROT / 2; i++) {
        double t = 37.0 * pow(base, -2.0 * i / N_ROT);
        assert_float_equal(c[i], cos(t), 1e-4);
        assert_float_equal(s[i], sin(t), 1e-4);
    }
    /* factor 32: pair 0 keeps its angle, the last is interpolated, all scaled by mscale */
    struct kvr_yarn y = {32.0f, 4096, 32.0f, 1.0f, 1.0f, 0.0f};
    kvr_yarn_tables(c, s, N_ROT, 37, base, &y);
    double ms = 1.0 + 0.1 * log(32.0);
    assert_float_equal(c[0], cos(37.0) * ms, 1e-4);
    assert_float_equal(s[0], sin(37.0) * ms, 1e-4);
    double slow = 37.0 * pow(base, -2.0 * (N_ROT / 2 - 1) / N_ROT) / 32.0;
    assert_float_equal(c[N_ROT / 2 - 1], cos(slow) * ms, 1e-4);
    assert_float_equal(s[N_ROT / 2 - 1], sin(slow) * ms, 1e-4);
    for (int i = 0; i < N_ROT / 2; i++) /* every pair keeps the magnitude mscale */
        assert_float_equal(hypot(c[i], s[i]), ms, 1e-4);
}

/* A GGUF image with the given YaRN keys (any may be absent: NULL / 0). */
static struct kvr_gguf *yarn_file(char **buf, size_t *len, uint32_t orig, float beta_fast)
{
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    assert_non_null(w);
    if (orig)
        kvr_gguf_writer_add_u32(w, "gpt-oss.rope.scaling.original_context_length", orig);
    if (beta_fast > 0.0f)
        kvr_gguf_writer_add_f32(w, "gpt-oss.rope.scaling.yarn_beta_fast", beta_fast);
    FILE *f = open_memstream(buf, len);
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_writer_write(w, f, &err), 0);
    fclose(f);
    kvr_gguf_writer_destroy(w);
    struct kvr_gguf *g = NULL;
    assert_int_equal(kvr_gguf_open_mem(&g, *buf, *len, &err), 0);
    return g;
}

static void test_yarn_read(void **state)
{
    (void)state;
    char *buf;
    size_t len;
    struct kvr_yarn y;
    struct kvr_err err = {0};
    struct kvr_gguf *g = yarn_file(&buf, &len, 4096, 0.0f);
    assert_int_equal(kvr_yarn_read(&y, g, "gpt-oss", 32.0f, 131072, &err), 0);
    assert_int_equal(y.n_ctx_orig, 4096);
    assert_true(y.factor == 32.0f && y.beta_fast == 32.0f && y.beta_slow == 1.0f);
    assert_int_not_equal(kvr_yarn_read(&y, g, "gpt-oss", 0.5f, 131072, &err), 0);
    assert_non_null(strstr(err.msg, "YaRN"));
    kvr_gguf_close(g);
    free(buf);
    g = yarn_file(&buf, &len, 0, 0.5f); /* beta_fast below beta_slow */
    assert_int_not_equal(kvr_yarn_read(&y, g, "gpt-oss", 32.0f, 2048, &err), 0);
    kvr_gguf_close(g);
    free(buf);
    g = yarn_file(&buf, &len, 0, 0.0f); /* original context: the training context */
    assert_int_equal(kvr_yarn_read(&y, g, "gpt-oss", 4.0f, 2048, &err), 0);
    assert_int_equal(y.n_ctx_orig, 2048);
    kvr_gguf_close(g);
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_softmax_sink),
        cmocka_unit_test(test_swiglu_oai),
        cmocka_unit_test(test_yarn_tables),
        cmocka_unit_test(test_yarn_read),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
