/* test_mla.c - latent attention (model/mla.h) against its naive form: for tiny synthesized
 * deepseek2 files (with and without q_lora_rank, split and fused kv_b, with YaRN), the
 * absorbed path over the latent cache gives, for the last of 9 rows of one sequence, what
 * kvr_mla_attention_ref gives by decompressing full keys and values per head in double;
 * the rows computed all at once equal those computed one at a time, bit for bit, on 1 and
 * 2 threads; an f16 cache stays close; and the cache holds L + rope values per position. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/alloc.h"
#include "core/pool.h"
#include "core/rng.h"
#include "model/arch.h"
#include "model/dtype.h"
#include "model/gguf.h"
#include "model/kv.h"
#include "model/mla.h"
#include "model/synth.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N_POS 9
#define DIM 64
#define HEADS 4

struct fixture {
    char path[64];
    struct kvr_gguf *g;
    struct kvr_hparams hp;
    struct kvr_mla_layer l;
};

static void open_model(struct fixture *f, int q_lora, bool fused, float yarn)
{
    struct kvr_synth_opts o = {.arch = kvr_arch_find("deepseek2", 9),
                               .type = KVR_DTYPE_F32,
                               .seed = 5,
                               .n_threads = 1,
                               .kv_b_fused = fused,
                               .yarn_factor = yarn,
                               .yarn_log_mul = 0.2f};
    o.shape = (struct kvr_synth_shape){.name = "t",
                                       .n_layers = 1,
                                       .dim = DIM,
                                       .ff = 64,
                                       .n_heads = HEADS,
                                       .n_kv_heads = HEADS,
                                       .vocab_size = 300,
                                       .ctx = 64,
                                       .rope_base = 10000.0f,
                                       .rms_eps = 1e-6f,
                                       .q_lora = q_lora};
    snprintf(f->path, sizeof f->path, "/tmp/test_mla.XXXXXX");
    int fd = mkstemp(f->path);
    assert_true(fd >= 0);
    FILE *fp = fdopen(fd, "wb");
    assert_non_null(fp);
    assert_int_equal(kvr_synth_write(&o, fp, NULL, NULL), 0);
    fclose(fp);
    assert_int_equal(kvr_gguf_open(&f->g, f->path, NULL), 0);
    assert_int_equal(kvr_hparams_read(&f->hp, f->g, NULL), 0);
    assert_int_equal(kvr_mla_layer_view(&f->l, f->g, &f->hp, 0, NULL), 0);
    assert_int_equal(f->l.fused, fused);
}

static void close_model(struct fixture *f)
{
    kvr_mla_layer_fini(&f->l);
    kvr_gguf_close(f->g);
    unlink(f->path);
}

/* The block over rows x[0..N_POS) of sequence 0: all at once (chunk N_POS) or in chunks;
 * out gets every row's H x v outputs. */
static void run_block(struct fixture *f, enum kvr_dtype kv_type, int n_threads, uint32_t chunk,
                      const float *x, float *out)
{
    struct kvr_kv kv;
    struct kvr_mla_work *w;
    const struct kvr_hparams *hp = &f->hp;
    assert_int_equal(kvr_kv_init_keys(&kv, kv_type, 1, hp->kv_dim, 4, 8, 1, 32, NULL), 0);
    assert_null(kv.v);
    assert_int_equal(kv.kv_dim, hp->mla.kv_lora_rank + hp->mla.n_rope);
    assert_int_equal(kvr_mla_work_create(&w, hp, &f->l, 1, N_POS, (uint32_t)n_threads, 32, 4, NULL),
                     0);
    struct kvr_pool *pool = kvr_pool_create(n_threads);
    assert_non_null(pool);
    uint32_t seq[N_POS] = {0}, pos[N_POS];
    for (uint32_t p0 = 0; p0 < N_POS; p0 += chunk) {
        uint32_t n = N_POS - p0 < chunk ? N_POS - p0 : chunk;
        for (uint32_t i = 0; i < n; i++)
            pos[i] = p0 + i;
        assert_int_equal(kvr_kv_prepare(&kv, 0, p0, n, NULL), 0);
        kvr_mla_attention(w, &f->l, &kv, 0, x + (size_t)p0 * DIM, n, seq, pos,
                          out + (size_t)p0 * hp->q_dim, pool);
    }
    kvr_pool_destroy(pool);
    kvr_mla_work_destroy(w);
    kvr_kv_fini(&kv);
}

static float max_rel(const float *a, const float *b, size_t n)
{
    float d = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmaxf(d, fabsf(a[i] - b[i]));
        m = fmaxf(m, fabsf(b[i]));
    }
    return d / m;
}

static void check_variant(int q_lora, bool fused, float yarn)
{
    struct fixture f;
    open_model(&f, q_lora, fused, yarn);
    const struct kvr_hparams *hp = &f.hp;
    float x[N_POS * DIM];
    uint64_t st = 11;
    for (size_t i = 0; i < N_POS * DIM; i++)
        x[i] = (float)(kvr_splitmix64(&st) >> 40) * 0x1p-23f - 1.0f;
    size_t n_out = (size_t)N_POS * hp->q_dim;
    float *all = calloc(n_out, sizeof *all), *one = calloc(n_out, sizeof *one);
    float *two = calloc(n_out, sizeof *two), *half = calloc(n_out, sizeof *half);
    float *ref = calloc(hp->q_dim, sizeof *ref);
    assert_true(all && one && two && half && ref);
    run_block(&f, KVR_DTYPE_F32, 1, N_POS, x, all);
    run_block(&f, KVR_DTYPE_F32, 1, 1, x, one);
    run_block(&f, KVR_DTYPE_F32, 2, 3, x, two);
    assert_memory_equal(all, one, n_out * sizeof(float));
    assert_memory_equal(all, two, n_out * sizeof(float));
    for (uint32_t n = 1; n <= N_POS; n += 4) { /* rows 0, 4, 8 against the naive form */
        assert_int_equal(kvr_mla_attention_ref(hp, &f.l, x, n, ref), 0);
        float rel = max_rel(all + (size_t)(n - 1) * hp->q_dim, ref, hp->q_dim);
        if (rel > 1e-5f)
            fail_msg("q_lora %d fused %d yarn %g row %u: rel %g", q_lora, fused, (double)yarn,
                     n - 1, (double)rel);
    }
    run_block(&f, KVR_DTYPE_F16, 2, 4, x, half);
    assert_true(max_rel(half + n_out - hp->q_dim, ref, hp->q_dim) < 1e-2f);
    free(all), free(one), free(two), free(half), free(ref);
    close_model(&f);
}

static void test_q_lora_split(void **state)
{
    (void)state;
    check_variant(32, false, 0.0f);
}

static void test_plain_q_fused(void **state)
{
    (void)state;
    check_variant(0, true, 0.0f);
}

static void test_yarn(void **state)
{
    (void)state;
    check_variant(32, false, 4.0f);
}

/* The hyperparameters say what the rest of the engine sizes by, and YaRN's scale. */
static void test_hparams(void **state)
{
    (void)state;
    struct fixture f;
    open_model(&f, 32, false, 4.0f);
    const struct kvr_hparams *hp = &f.hp;
    assert_int_equal(hp->mla.kv_lora_rank, DIM / 2);
    assert_int_equal(hp->mla.n_rope, DIM / HEADS / 2);
    assert_int_equal(hp->n_head_kv, 1);
    assert_int_equal(hp->kv_dim, DIM / 2 + DIM / HEADS / 2);
    assert_int_equal(hp->q_dim, HEADS * (DIM / HEADS));
    assert_float_equal(hp->yarn.factor, 4.0f, 0.0f);
    assert_float_equal(hp->yarn.log_mul, 0.2f, 1e-7);
    float mscale = 1.0f + 0.2f * logf(4.0f);
    assert_float_equal(hp->mla.kq_scale, mscale * mscale / sqrtf((float)(DIM / HEADS * 3 / 2)),
                       1e-6);
    close_model(&f);
}

/* The DeepSeek-V2-Lite shape synth names (synth.h). */
static void test_v2_lite_shape(void **state)
{
    (void)state;
    struct kvr_synth_shape s;
    assert_int_equal(kvr_synth_shape_by_name("deepseek-v2-lite", &s), 0);
    assert_int_equal(kvr_synth_check_shape(&s, NULL), 0);
    assert_int_equal(s.n_layers, 27);
    assert_int_equal(s.dim, 2048);
    assert_int_equal(s.kv_lora, 512);
    assert_int_equal(s.q_lora, 0);
    assert_int_equal(s.n_expert, 64);
    assert_int_equal(s.n_expert_used, 6);
    assert_int_equal(s.n_shared_exp, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hparams),       cmocka_unit_test(test_q_lora_split),
        cmocka_unit_test(test_plain_q_fused), cmocka_unit_test(test_yarn),
        cmocka_unit_test(test_v2_lite_shape),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
