/* test_synth.c - synthetic models: metadata, shapes, weights against their regeneration,
 * determinism, the built-in vocabulary through the real tokenizer, and --vocab copying. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "model/arch.h"
#include "model/dtype.h"
#include "model/gguf.h"
#include "model/synth.h"
#include "model/tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char tmp_dir[64];

static int setup(void **state)
{
    (void)state;
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/kvr_test_synth.XXXXXX");
    return mkdtemp(tmp_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    return rmdir(tmp_dir);
}

static struct kvr_synth_opts tiny_opts(int type, uint64_t seed, int n_threads)
{
    struct kvr_synth_opts o = {.type = type, .seed = seed, .n_threads = n_threads};
    assert_int_equal(kvr_synth_shape_by_name("tiny", &o.shape), 0);
    return o;
}

/* Write a model to tmp_dir/name; returns the path (static buffer per call site's use). */
static const char *write_model(const char *name, const struct kvr_synth_opts *o,
                               struct kvr_synth_stats *stats)
{
    static char path[128];
    snprintf(path, sizeof path, "%s/%s", tmp_dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    struct kvr_err err = {0};
    int rc = kvr_synth_write(o, f, stats, &err);
    if (rc)
        fail_msg("synth failed: %s", err.msg);
    assert_int_equal(fclose(f), 0);
    return path;
}

static uint32_t get_u32(const struct kvr_gguf *g, const char *key)
{
    uint32_t v = 0;
    struct kvr_err err = {0};
    if (kvr_gguf_get_u32(g, key, &v, &err))
        fail_msg("%s", err.msg);
    return v;
}

/* Every row of `name` dequantizes to its regeneration within the type's rounding error:
 * half a step for Q8_0 (step = block max / 127), one step for Q4_0 (step = block max / 8,
 * the positive end is one level short), plus fp16 rounding of the scale. */
static void check_tensor(const struct kvr_gguf *g, const struct kvr_synth_opts *o, const char *name,
                         int want_type)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
    assert_non_null(t);
    assert_int_equal(t->type, want_type);
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(t->type);
    int64_t n_in = t->ne[0];
    size_t row_bytes;
    assert_true(kvr_dtype_row_bytes(t->type, n_in, &row_bytes));
    float *want = malloc((size_t)n_in * sizeof *want), *got = malloc((size_t)n_in * sizeof *got);
    double sum = 0, sum2 = 0;
    for (int64_t r = 0; r < t->ne[1]; r++) {
        assert_int_equal(kvr_synth_row(o, name, r, want), 0);
        tr->to_float((const uint8_t *)t->data + (size_t)r * row_bytes, got, n_in);
        int64_t block = tr->block_elems > 1 ? tr->block_elems : 1;
        for (int64_t b = 0; b < n_in; b += block) {
            float amax = 0;
            for (int64_t j = b; j < b + block; j++)
                amax = fmaxf(amax, fabsf(want[j]));
            float tol = t->type == KVR_DTYPE_Q8_0   ? amax / 127.0f * 0.51f + amax * 1e-3f
                        : t->type == KVR_DTYPE_Q4_0 ? amax / 8.0f * 1.01f + amax * 1e-3f
                        : t->type == KVR_DTYPE_F16  ? fabsf(amax) * 1e-3f
                                                    : 0.0f;
            for (int64_t j = b; j < b + block; j++) {
                if (fabsf(got[j] - want[j]) > tol)
                    fail_msg("%s row %lld col %lld: got %g want %g (tol %g)", name, (long long)r,
                             (long long)j, got[j], want[j], tol);
                sum += want[j];
                sum2 += (double)want[j] * want[j];
            }
        }
    }
    double n = (double)n_in * (double)t->ne[1];
    double mean = sum / n, var = sum2 / n - mean * mean;
    if (t->n_dims == 1) { /* norm weights: uniform in [0.9, 1.1] */
        assert_true(fabs(mean - 1.0) < 0.03);
    } else if (strstr(name, "token_embd")) {
        assert_true(fabs(sqrt(var) - 1.0) < 0.05);
    } else if (!strstr(name, "attn_output") && !strstr(name, "ffn_down")) {
        assert_true(fabs(sqrt(var) * sqrt((double)n_in) - 1.0) < 0.05);
        assert_true(fabs(mean) < 0.1 / sqrt((double)n_in));
    }
    free(want);
    free(got);
}

static void check_model(const char *path, const struct kvr_synth_opts *o, int mat_type)
{
    struct kvr_gguf *g = NULL;
    struct kvr_err err = {0};
    if (kvr_gguf_open(&g, path, &err))
        fail_msg("%s", err.msg);
    struct kvr_gguf_str s;
    assert_int_equal(kvr_gguf_get_str(g, "general.architecture", &s, &err), 0);
    assert_int_equal(s.len, 5);
    assert_memory_equal(s.ptr, "llama", 5);
    assert_int_equal(get_u32(g, "general.alignment"), 32);
    assert_int_equal(get_u32(g, "llama.block_count"), 4);
    assert_int_equal(get_u32(g, "llama.embedding_length"), 64);
    assert_int_equal(get_u32(g, "llama.feed_forward_length"), 192);
    assert_int_equal(get_u32(g, "llama.attention.head_count"), 4);
    assert_int_equal(get_u32(g, "llama.attention.head_count_kv"), 2);
    assert_int_equal(get_u32(g, "llama.rope.dimension_count"), 16);
    assert_int_equal(get_u32(g, "llama.context_length"), 512);
    assert_int_equal(get_u32(g, "general.file_type"), mat_type == KVR_DTYPE_Q8_0 ? 7 : 2);
    float f;
    assert_int_equal(kvr_gguf_get_f32(g, "llama.rope.freq_base", &f, &err), 0);
    assert_true(f == 10000.0f);
    assert_int_equal(kvr_gguf_get_f32(g, "llama.attention.layer_norm_rms_epsilon", &f, &err), 0);
    assert_true(f == 1e-5f);
    assert_int_equal(get_u32(g, "tokenizer.ggml.bos_token_id"), 1);
    assert_int_equal(get_u32(g, "tokenizer.ggml.eos_token_id"), 2);
    assert_int_equal(get_u32(g, "tokenizer.ggml.unknown_token_id"), 0);
    struct kvr_gguf_arr a;
    assert_int_equal(kvr_gguf_get_arr(g, "tokenizer.ggml.tokens", &a, &err), 0);
    assert_int_equal(a.n, 512);
    assert_int_equal(kvr_gguf_get_arr(g, "tokenizer.ggml.scores", &a, &err), 0);
    assert_int_equal(a.type, KVR_GGUF_TYPE_FLOAT32);
    assert_int_equal(kvr_gguf_get_arr(g, "tokenizer.ggml.token_type", &a, &err), 0);
    assert_int_equal(a.type, KVR_GGUF_TYPE_INT32);

    assert_int_equal(kvr_gguf_n_tensors(g), 3 + 4 * 9);
    static const struct {
        const char *name;
        int64_t ne0, ne1;
    } shapes[] = {
        {"token_embd.weight", 64, 512},   {"output_norm.weight", 64, 1},
        {"output.weight", 64, 512},       {"blk.0.attn_norm.weight", 64, 1},
        {"blk.3.attn_q.weight", 64, 64},  {"blk.3.attn_k.weight", 64, 32},
        {"blk.3.attn_v.weight", 64, 32},  {"blk.3.attn_output.weight", 64, 64},
        {"blk.3.ffn_norm.weight", 64, 1}, {"blk.2.ffn_gate.weight", 64, 192},
        {"blk.2.ffn_up.weight", 64, 192}, {"blk.1.ffn_down.weight", 192, 64},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, shapes[i].name);
        if (!t)
            fail_msg("missing %s", shapes[i].name);
        assert_int_equal(t->n_dims, shapes[i].ne1 > 1 ? 2 : 1);
        assert_int_equal(t->ne[0], shapes[i].ne0);
        assert_int_equal(t->ne[1], shapes[i].ne1);
        assert_int_equal(t->type, shapes[i].ne1 > 1 ? mat_type : KVR_DTYPE_F32);
    }
    assert_null(kvr_gguf_find_tensor(g, "blk.4.attn_q.weight"));

    check_tensor(g, o, "token_embd.weight", mat_type);
    check_tensor(g, o, "blk.0.attn_q.weight", mat_type);
    check_tensor(g, o, "blk.2.ffn_down.weight", mat_type);
    check_tensor(g, o, "blk.3.ffn_up.weight", mat_type);
    check_tensor(g, o, "output.weight", mat_type);
    check_tensor(g, o, "blk.1.attn_norm.weight", KVR_DTYPE_F32);
    kvr_gguf_close(g);
}

static void test_tiny_q8_0(void **state)
{
    (void)state;
    struct kvr_synth_opts o = tiny_opts(KVR_DTYPE_Q8_0, 42, 2);
    struct kvr_synth_stats st;
    const char *path = write_model("tiny_q8_0.gguf", &o, &st);
    assert_int_equal(st.n_tensors, 39);
    assert_int_equal(st.vocab_size, 512);
    assert_int_equal(st.n_params,
                     2 * 64 * 512 + 64 + 4 * (2 * 64 + 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 192));
    check_model(path, &o, KVR_DTYPE_Q8_0);
    unlink(path);
}

static void test_tiny_q4_0(void **state)
{
    (void)state;
    struct kvr_synth_opts o = tiny_opts(KVR_DTYPE_Q4_0, 7, 1);
    const char *path = write_model("tiny_q4_0.gguf", &o, NULL);
    check_model(path, &o, KVR_DTYPE_Q4_0);
    unlink(path);
}

/* Same seed, any thread count: the same bytes. Another seed: other bytes. */
static void test_deterministic(void **state)
{
    (void)state;
    struct kvr_synth_opts o1 = tiny_opts(KVR_DTYPE_Q4_0, 5, 1),
                          o3 = tiny_opts(KVR_DTYPE_Q4_0, 5, 3);
    struct kvr_synth_opts o9 = tiny_opts(KVR_DTYPE_Q4_0, 6, 3);
    char p1[128], p3[128], p9[128];
    snprintf(p1, sizeof p1, "%s", write_model("a.gguf", &o1, NULL));
    snprintf(p3, sizeof p3, "%s", write_model("b.gguf", &o3, NULL));
    snprintf(p9, sizeof p9, "%s", write_model("c.gguf", &o9, NULL));
    size_t n1, n3, n9;
    char *b1 = kvr_test_read_file(p1, &n1), *b3 = kvr_test_read_file(p3, &n3),
         *b9 = kvr_test_read_file(p9, &n9);
    assert_non_null(b1);
    assert_non_null(b3);
    assert_non_null(b9);
    assert_int_equal(n1, n3);
    assert_memory_equal(b1, b3, n1);
    assert_int_equal(n1, n9);
    assert_memory_not_equal(b1, b9, n1);
    free(b1);
    free(b3);
    free(b9);
    unlink(p1);
    unlink(p3);
    unlink(p9);
}

/* The built-in vocabulary works with the real SPM tokenizer: text round-trips, common
 * words are single tokens, and bytes outside the pieces fall back to byte tokens. */
static void test_builtin_vocab(void **state)
{
    (void)state;
    struct kvr_synth_opts o = tiny_opts(KVR_DTYPE_Q8_0, 1, 2);
    o.shape.vocab_size = 4096;
    const char *path = write_model("vocab.gguf", &o, NULL);
    struct kvr_gguf *g = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_open(&g, path, &err), 0);
    struct kvr_tok *t = NULL;
    if (kvr_tok_create(&t, g, &err))
        fail_msg("tokenizer rejects the built-in vocab: %s", err.msg);
    assert_int_equal(kvr_tok_n_vocab(t), 4096);
    assert_int_equal(kvr_tok_find(t, "<0x41>", 6), 3 + 0x41);
    assert_true(kvr_tok_find(t, "\xe2\x96\x81the", 6) > 258);

    static const char text[] = "Once upon a time, there was a little girl named Lily.\n"
                               "She liked to play in the park. 42 \xc3\xbc \xf0\x9f\x99\x82!";
    struct kvr_tok_scratch *s = NULL;
    assert_int_equal(kvr_tok_scratch_create(&s, t, sizeof text), 0);
    int32_t ids[256];
    int n = kvr_tok_encode(t, s, text, sizeof text - 1, true, false, ids, 256);
    assert_true(n > 1);
    assert_int_equal(ids[0], 1);
    assert_true(n < (int)(sizeof text) / 2); /* words merge */
    char out[512];
    size_t used = 0;
    struct kvr_detok d;
    kvr_detok_init(&d, true, false);
    for (int i = 0; i < n; i++) {
        int k = kvr_detok_push(t, &d, ids[i], out + used, sizeof out - used);
        assert_true(k >= 0);
        used += (size_t)k;
    }
    int k = kvr_detok_flush(&d, out + used, sizeof out - used);
    assert_true(k >= 0);
    used += (size_t)k;
    assert_int_equal(used, sizeof text - 1);
    assert_memory_equal(out, text, used);
    kvr_tok_scratch_destroy(s);
    kvr_tok_destroy(t);
    kvr_gguf_close(g);
    unlink(path);
}

/* --vocab: the tokenizer keys are copied and the vocab size follows the file. */
static void test_vocab_file(void **state)
{
    (void)state;
    const char *vpath = kvr_test_shared("vocab/ggml-vocab-llama-spm.gguf");
    struct kvr_gguf *v = NULL, *g = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_open(&v, vpath, &err), 0);
    struct kvr_synth_opts o = tiny_opts(KVR_DTYPE_Q8_0, 3, 2);
    o.vocab = v;
    struct kvr_synth_stats st;
    const char *path = write_model("spm.gguf", &o, &st);
    assert_int_equal(st.vocab_size, 32000);
    assert_int_equal(kvr_gguf_open(&g, path, &err), 0);
    assert_int_equal(kvr_gguf_find_tensor(g, "token_embd.weight")->ne[1], 32000);
    assert_int_equal(kvr_gguf_find_tensor(g, "output.weight")->ne[1], 32000);
    assert_int_equal(get_u32(g, "llama.vocab_size"), 32000);
    int n_copied = 0;
    for (int64_t i = 0; i < kvr_gguf_n_kv(v); i++) {
        const char *key = kvr_gguf_kv_key(v, i);
        if (strncmp(key, "tokenizer.", 10))
            continue;
        int64_t j = kvr_gguf_find_kv(g, key);
        if (j < 0)
            fail_msg("%s not copied", key);
        assert_int_equal(kvr_gguf_kv_type(g, j), kvr_gguf_kv_type(v, i));
        n_copied++;
    }
    assert_true(n_copied >= 8);
    struct kvr_gguf_arr a1, a2;
    assert_int_equal(kvr_gguf_get_arr(v, "tokenizer.ggml.tokens", &a1, &err), 0);
    assert_int_equal(kvr_gguf_get_arr(g, "tokenizer.ggml.tokens", &a2, &err), 0);
    for (uint64_t i = 0; i < a1.n; i += 997) {
        assert_int_equal(a1.strs[i].len, a2.strs[i].len);
        assert_memory_equal(a1.strs[i].ptr, a2.strs[i].ptr, a1.strs[i].len);
    }
    bool b;
    assert_int_equal(kvr_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &b, &err), 0);
    /* the model keys are ours, not the vocab file's */
    assert_int_equal(get_u32(g, "llama.block_count"), 4);
    float row[64];
    assert_int_equal(kvr_synth_row(&o, "token_embd.weight", 31999, row), 0);
    kvr_gguf_close(g);
    kvr_gguf_close(v);
    unlink(path);
}

static void test_bad_options(void **state)
{
    (void)state;
    static const struct {
        int field; /* 0 none, 1 dim, 2 heads, 3 kv heads, 4 vocab, 5 layers */
        int value;
        int type;
        int rc;
        const char *msg;
    } cases[] = {
        {1, 60, KVR_DTYPE_Q8_0, KVR_EINVAL, "dim 60 is not a multiple of heads 8"},
        {2, 64, KVR_DTYPE_Q8_0, KVR_EINVAL, "head dim 1 is odd"},
        {3, 3, KVR_DTYPE_Q8_0, KVR_EINVAL, "heads 4 is not a multiple of kv-heads 3"},
        {3, 5, KVR_DTYPE_Q8_0, KVR_EINVAL, "kv-heads = 5 is not in 1..4"},
        {4, 100, KVR_DTYPE_Q8_0, KVR_EINVAL, "vocab size 100 is outside 260..500000"},
        {5, 0, KVR_DTYPE_Q8_0, KVR_EINVAL, "layers = 0 is not in 1..4096"},
        {0, 0, KVR_DTYPE_Q8_K, KVR_ENOTSUP, "cannot be synthesised"},
        {0, 0, 4, KVR_ENOTSUP, "weight type 4 (unknown)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct kvr_synth_opts o = tiny_opts(cases[i].type, 1, 1);
        switch (cases[i].field) {
        case 1:
            o.shape.dim = cases[i].value;
            o.shape.n_heads = 8;
            break;
        case 2:
            o.shape.n_heads = cases[i].value;
            o.shape.n_kv_heads = 1;
            break;
        case 3:
            o.shape.n_kv_heads = cases[i].value;
            break;
        case 4:
            o.shape.vocab_size = cases[i].value;
            break;
        case 5:
            o.shape.n_layers = cases[i].value;
            break;
        default:
            break;
        }
        FILE *f = tmpfile();
        struct kvr_err err = {0};
        int rc = kvr_synth_write(&o, f, NULL, &err);
        fclose(f);
        if (rc != cases[i].rc || !strstr(err.msg, cases[i].msg))
            fail_msg("case %zu: got %d '%s', want %d '%s'", i, rc, err.msg, cases[i].rc,
                     cases[i].msg);
    }
    struct kvr_synth_opts o = tiny_opts(KVR_DTYPE_Q8_0, 1, 1);
    float row[192];
    assert_int_equal(kvr_synth_row(&o, "blk.9.attn_q.weight", 0, row), KVR_ENOTFOUND);
    assert_int_equal(kvr_synth_row(&o, "blk.0.attn_q.weight", 64, row), KVR_ERANGE);
    assert_int_equal(kvr_synth_row(&o, "blk.0.ffn_down.weight", 63, row), 0);
    struct kvr_synth_shape sh;
    assert_int_equal(kvr_synth_shape_by_name("nope", &sh), KVR_ENOTFOUND);
    assert_int_equal(kvr_synth_shape_by_name("tinyllama-1.1b", &sh), 0);
    assert_int_equal(sh.n_layers, 22);
    assert_int_equal(sh.vocab_size, 32000);
    assert_int_equal(kvr_synth_check_shape(&sh, NULL), 0);
    assert_int_equal(kvr_synth_shape_by_name("ring-45", &sh), 0);
    assert_int_equal(sh.n_layers, 45);
    assert_int_equal(kvr_synth_check_shape(&sh, NULL), 0);
    /* gpt-oss-20b: 24 layers, 32 experts top-4 of width 2880, 64/8 heads of 64, window 128 */
    assert_int_equal(kvr_synth_shape_by_name("gpt-oss-20b", &sh), 0);
    assert_int_equal(kvr_synth_check_shape(&sh, NULL), 0);
    assert_true(sh.n_layers == 24 && sh.dim == 2880 && sh.n_heads == 64 && sh.n_kv_heads == 8);
    assert_true(sh.head_dim == 64 && sh.n_swa == 128 && sh.n_expert == 32);
    assert_true(sh.n_expert_used == 4 && sh.expert_ff == 2880 && sh.vocab_size == 201088);
    struct kvr_synth_opts oss = {.shape = sh,
                                 .arch = kvr_arch_find("gpt-oss", 7),
                                 .type = KVR_DTYPE_MXFP4,
                                 .seed = 1,
                                 .n_threads = 1};
    float *big = malloc(4096 * sizeof *big);
    assert_non_null(big);
    assert_int_equal(kvr_synth_row(&oss, "blk.23.ffn_down_exps.bias", 31, big), 0);
    for (int i = 0; i < 32; i++) /* zero on the routing coordinates (synth.h) */
        assert_true(big[i] == 0.0f);
    assert_int_equal(kvr_synth_row(&oss, "blk.23.attn_sinks.weight", 0, big), 0);
    assert_int_equal(kvr_synth_row(&oss, "blk.0.ffn_up_exps.weight", 32 * 2880 - 1, big), 0);
    assert_int_equal(kvr_synth_row(&oss, "blk.0.ffn_up_exps.weight", 32 * 2880, big), KVR_ERANGE);
    free(big);
}

/* Every architecture: the table's tensors (minus its optional ones) with the shapes of its
 * hyperparameters, each row exactly its regeneration (F32), and a file the engine's
 * hyperparameter reader accepts as that architecture; gemma and --tied have no output. */
static void test_archs(void **state)
{
    (void)state;
    for (int i = 0; kvr_arch_at(i); i++) {
        const struct kvr_arch *a = kvr_arch_at(i);
        struct kvr_synth_opts o = tiny_opts(KVR_DTYPE_F32, 3, 2);
        o.arch = a;
        o.shape.n_layers = 2;
        o.shape.head_dim = 32; /* q width 128, twice the model's */
        o.shape.n_swa = a->sliding ? 8 : 0;
        o.tied = !strcmp(a->name, "qwen2");
        o.rope_freqs = !strcmp(a->name, "llama");
        if (a->moe_always || a->mla) /* the expert tensors are test_moe's, latent attention's
                                        widths test_mla's; here the rest */
            continue;
        struct kvr_synth_stats st;
        const char *path = write_model("arch.gguf", &o, &st);
        struct kvr_gguf *g = NULL;
        struct kvr_err err = {0};
        assert_int_equal(kvr_gguf_open(&g, path, &err), 0);
        struct kvr_hparams hp;
        if (kvr_hparams_read(&hp, g, &err))
            fail_msg("%s: %s", a->name, err.msg);
        assert_ptr_equal(hp.arch, a);
        assert_int_equal(hp.head_dim, 32);
        assert_int_equal(hp.q_dim, 128);
        assert_int_equal(hp.n_swa, a->sliding ? 8 : 0);
        assert_true(!hp.rope_freqs == !o.rope_freqs);
        int per_layer = 0;
        for (int t = 0; t < KVR_LT_COUNT; t++)
            per_layer += (a->has & ~a->optional) >> t & 1;
        bool tied = o.tied || a->embd_scale;
        assert_int_equal(kvr_gguf_n_tensors(g), 2 * per_layer + 2 + !tied + o.rope_freqs);
        assert_int_equal((int)st.n_tensors, (int)kvr_gguf_n_tensors(g));
        assert_true(!kvr_gguf_find_tensor(g, "output.weight") == tied);
        float *row = malloc(512 * sizeof *row);
        for (int64_t k = 0; k < kvr_gguf_n_tensors(g); k++) {
            const struct kvr_gguf_tensor *t = kvr_gguf_tensor(g, k);
            if (!strncmp(t->name, "blk.", 4)) {
                int64_t ne0, ne1;
                const char *suffix = strchr(t->name + 4, '.') + 1;
                int lt = 0;
                while (lt < KVR_LT_COUNT && strcmp(kvr_lt_name((enum kvr_lt)lt), suffix))
                    lt++;
                assert_true(lt < KVR_LT_COUNT && (a->has >> lt & 1));
                kvr_lt_shape(&hp, (enum kvr_lt)lt, &ne0, &ne1);
                assert_int_equal(t->ne[0], ne0);
                assert_int_equal(t->ne[1], ne1 ? ne1 : 1);
            }
            for (int64_t r = 0; r < t->ne[1]; r++) {
                assert_int_equal(kvr_synth_row(&o, t->name, r, row), 0);
                if (memcmp(row, (const float *)t->data + r * t->ne[0],
                           (size_t)t->ne[0] * sizeof(float)))
                    fail_msg("%s: %s row %lld differs", a->name, t->name, (long long)r);
            }
        }
        free(row);
        kvr_gguf_close(g);
        remove(path);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_q8_0),     cmocka_unit_test(test_tiny_q4_0),
        cmocka_unit_test(test_deterministic), cmocka_unit_test(test_builtin_vocab),
        cmocka_unit_test(test_vocab_file),    cmocka_unit_test(test_bad_options),
        cmocka_unit_test(test_archs),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
