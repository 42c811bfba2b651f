/* test_engine.c - the forward pass against llama.cpp's reference, and batch invariance.
 *
 * Reference: ../shared/models/stories260K.reference.json holds llama.cpp's prompt ids, 64
 * greedy ids and the full logits of the first 8 steps for "Once upon a time". */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "model_options.h"
#include "testutil.h"

#include "core/alloc.h"
#include "model/dtype.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/gguf_write.h"
#include "model/kv.h"
#include "model/synth.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The KV cache type of the engines the tests open (test_invariance_kv_types sets it). */
static enum kvr_dtype kv_type = KVR_DTYPE_F32;

static struct kvr_engine *open_engine(struct kvr_gguf *g, uint32_t first, uint32_t last,
                                      uint32_t threads, uint32_t max_rows)
{
    struct kvr_engine_config cfg = {.first_layer = first,
                                    .last_layer = last,
                                    .max_rows = max_rows,
                                    .max_seqs = 16,
                                    .n_ctx = 256,
                                    .kv_block_tokens = 16,
                                    .kv_n_blocks = 0,
                                    .kv_type = kv_type,
                                    .n_threads = threads};
    struct kvr_engine *e = NULL;
    struct kvr_err err = {0};
    int rc = kvr_engine_create(&e, g, &cfg, &err);
    if (rc)
        fail_msg("engine create: %s", err.msg);
    return e;
}

static int32_t argmax(const float *x, uint32_t n)
{
    int32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = (int32_t)i;
    return best;
}

static void test_reference_stories260k(void **state)
{
    (void)state;
    const char *model = kvr_test_shared("models/stories260K.gguf");
    char model_path[4096];
    snprintf(model_path, sizeof model_path, "%s", model);
    const char *ref_path = kvr_test_shared("models/stories260K.reference.json");
    json_error_t jerr;
    json_t *ref = json_load_file(ref_path, 0, &jerr);
    assert_non_null(ref);

    struct kvr_gguf *g = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_open(&g, model_path, &err), 0);
    struct kvr_engine *e = open_engine(g, 0, 4, 2, 64);
    const struct kvr_hparams *hp = kvr_engine_hparams(e);
    assert_int_equal(hp->n_vocab, 512);

    json_t *prompt = json_object_get(ref, "prompt_ids");
    json_t *gen = json_object_get(ref, "generated_ids");
    json_t *logits8 = json_object_get(ref, "logits_first_8_steps");
    size_t n_prompt = json_array_size(prompt), n_gen = json_array_size(gen);
    assert_true(n_prompt > 0 && n_gen == 64 && json_array_size(logits8) == 8);

    int32_t tokens[64];
    for (size_t i = 0; i < n_prompt; i++)
        tokens[i] = (int32_t)json_integer_value(json_array_get(prompt, i));
    float logits[512];
    struct kvr_seg seg = {0, 0, (uint32_t)n_prompt,
                          KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN};
    double worst = 0.0;
    for (size_t step = 0; step < n_gen; step++) {
        assert_int_equal(kvr_engine_forward(e, &seg, 1, tokens, NULL, logits, &err), 0);
        if (step < 8) {
            json_t *row = json_array_get(logits8, step);
            assert_int_equal(json_array_size(row), 512);
            for (size_t i = 0; i < 512; i++) {
                double d = fabs(logits[i] - json_number_value(json_array_get(row, i)));
                worst = d > worst ? d : worst;
            }
        }
        int32_t tok = argmax(logits, 512);
        int32_t want = (int32_t)json_integer_value(json_array_get(gen, step));
        if (tok != want)
            fail_msg("step %zu: generated %d, llama.cpp generated %d", step, tok, want);
        seg.pos0 += seg.n_tokens;
        seg.n_tokens = 1;
        seg.flags = KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN;
        tokens[0] = tok;
    }
    print_message("stories260K: 64/64 ids match, max |logit diff| over 8 steps = %.3g\n", worst);
    assert_true(worst < 1e-3);
    kvr_engine_destroy(e);
    kvr_gguf_close(g);
    json_decref(ref);
}

/* ---- batch invariance ---------------------------------------------------------------------- */

enum { N_SEQ = 8, N_DECODE = 4 };
static const uint32_t seq_len[N_SEQ] = {1, 3, 7, 12, 5, 19, 2, 9};

/* Logits of every decode step of every sequence: [N_SEQ][N_DECODE + 1][n_vocab]. */
static float *run_alone(struct kvr_gguf *g, uint32_t threads, uint32_t n_layer, int chunked)
{
    struct kvr_engine *e = open_engine(g, 0, n_layer - 1, threads, 64);
    uint32_t V = kvr_engine_hparams(e)->n_vocab;
    float *all = calloc((size_t)N_SEQ * (N_DECODE + 1) * V, sizeof(float));
    struct kvr_err err = {0};
    for (uint32_t s = 0; s < N_SEQ; s++) {
        int32_t toks[32];
        for (uint32_t i = 0; i < seq_len[s]; i++)
            toks[i] = (int32_t)((s * 31 + i * 7 + 3) % V);
        /* Prefill: one segment, or chunks of 4 rows when `chunked`. */
        uint32_t pos = 0;
        while (pos < seq_len[s]) {
            uint32_t n = chunked ? (seq_len[s] - pos < 4 ? seq_len[s] - pos : 4) : seq_len[s];
            int last = pos + n == seq_len[s];
            struct kvr_seg seg = {
                s, pos, n, KVR_SEG_PREFILL | (last ? KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN : 0)};
            float *out = all + ((size_t)s * (N_DECODE + 1)) * V;
            assert_int_equal(kvr_engine_forward(e, &seg, 1, toks + pos, NULL, out, &err), 0);
            pos += n;
        }
        for (uint32_t d = 0; d < N_DECODE; d++) {
            float *prev = all + ((size_t)s * (N_DECODE + 1) + d) * V;
            int32_t tok = argmax(prev, V);
            struct kvr_seg seg = {s, seq_len[s] + d, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
            assert_int_equal(kvr_engine_forward(e, &seg, 1, &tok, NULL, prev + V, &err), 0);
        }
        kvr_engine_seq_free(e, s);
    }
    kvr_engine_destroy(e);
    return all;
}

/* All sequences together: one batch of every prompt, then batches of all decode rows. */
static float *run_together(struct kvr_gguf *g, uint32_t threads, uint32_t n_layer)
{
    struct kvr_engine *e = open_engine(g, 0, n_layer - 1, threads, 64);
    uint32_t V = kvr_engine_hparams(e)->n_vocab;
    float *all = calloc((size_t)N_SEQ * (N_DECODE + 1) * V, sizeof(float));
    float *out = calloc((size_t)N_SEQ * V, sizeof(float));
    struct kvr_err err = {0};
    struct kvr_seg segs[N_SEQ];
    int32_t toks[64];
    uint32_t r = 0;
    for (uint32_t s = 0; s < N_SEQ; s++) {
        segs[s] = (struct kvr_seg){s, 0, seq_len[s],
                                   KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN};
        for (uint32_t i = 0; i < seq_len[s]; i++)
            toks[r++] = (int32_t)((s * 31 + i * 7 + 3) % V);
    }
    assert_int_equal(kvr_engine_forward(e, segs, N_SEQ, toks, NULL, out, &err), 0);
    for (uint32_t d = 0; d <= N_DECODE; d++) {
        for (uint32_t s = 0; s < N_SEQ; s++)
            memcpy(all + ((size_t)s * (N_DECODE + 1) + d) * V, out + (size_t)s * V,
                   V * sizeof(float));
        if (d == N_DECODE)
            break;
        /* Reverse the order of the decode rows, so each sequence sits in another row. */
        for (uint32_t s = 0; s < N_SEQ; s++) {
            uint32_t q = N_SEQ - 1 - s;
            segs[s] = (struct kvr_seg){q, seq_len[q] + d, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
            toks[s] = argmax(all + ((size_t)q * (N_DECODE + 1) + d) * V, V);
        }
        assert_int_equal(kvr_engine_forward(e, segs, N_SEQ, toks, NULL, out, &err), 0);
        /* Undo the reversal. */
        float *tmp = calloc((size_t)N_SEQ * V, sizeof(float));
        for (uint32_t s = 0; s < N_SEQ; s++)
            memcpy(tmp + (size_t)(N_SEQ - 1 - s) * V, out + (size_t)s * V, V * sizeof(float));
        memcpy(out, tmp, (size_t)N_SEQ * V * sizeof(float));
        free(tmp);
    }
    free(out);
    kvr_engine_destroy(e);
    return all;
}

static void check_invariance(const char *path)
{
    struct kvr_gguf *g = NULL;
    struct kvr_err err = {0};
    if (kvr_gguf_open(&g, path, &err))
        fail_msg("open %s: %s", path, err.msg);
    struct kvr_hparams hp;
    assert_int_equal(kvr_hparams_read(&hp, g, &err), 0);
    size_t n = (size_t)N_SEQ * (N_DECODE + 1) * hp.n_vocab * sizeof(float);
    float *base = run_alone(g, 1, hp.n_layer, 0);
    float *variants[4] = {run_alone(g, 2, hp.n_layer, 0), run_alone(g, 1, hp.n_layer, 1),
                          run_together(g, 1, hp.n_layer), run_together(g, 2, hp.n_layer)};
    const char *names[4] = {"alone, 2 threads", "alone, chunked prefill", "together, 1 thread",
                            "together, 2 threads"};
    for (int i = 0; i < 4; i++) {
        if (memcmp(base, variants[i], n) != 0)
            fail_msg("%s: logits differ from alone, 1 thread (%s)", path, names[i]);
        free(variants[i]);
    }
    free(base);
    kvr_gguf_close(g);
}

static void test_invariance_stories260k(void **state)
{
    (void)state;
    check_invariance(kvr_test_shared("models/stories260K.gguf"));
}

/* Quantized weights go through the SIMD kernels: invariance must hold there too. */
static void test_invariance_synth(void **state)
{
    (void)state;
    const char *kvasir = getenv("KVASIR");
    if (!kvasir)
        skip();
    const char *types[] = {"q8_0", "q4_0", "q4_k", "f16"};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        char path[256], cmd[1024];
        snprintf(path, sizeof path, "/tmp/kvr_test_engine_%d_%s.gguf", (int)getpid(), types[i]);
        snprintf(cmd, sizeof cmd, "%s synth --shape tiny --type %s -o %s >/dev/null 2>&1", kvasir,
                 types[i], path);
        if (system(cmd) != 0)
            fail_msg("synth failed: %s", cmd);
        check_invariance(path);
        remove(path);
    }
}

/* Splitting the layers over several engines (as a ring does) gives the same logits. */
static void test_split_matches_whole(void **state)
{
    (void)state;
    const char *path = kvr_test_shared("models/stories260K.gguf");
    struct kvr_gguf *g = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_open(&g, path, &err), 0);
    struct kvr_engine *whole = open_engine(g, 0, 4, 1, 64);
    struct kvr_engine *parts[3] = {open_engine(g, 0, 1, 1, 64), open_engine(g, 2, 2, 2, 64),
                                   open_engine(g, 3, 4, 1, 64)};
    int32_t toks[6] = {1, 403, 407, 9, 88, 3};
    struct kvr_seg seg = {5, 0, 6, KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN};
    float a[512], b[512], h1[6 * 64], h2[6 * 64];
    assert_int_equal(kvr_engine_forward(whole, &seg, 1, toks, NULL, a, &err), 0);
    assert_int_equal(kvr_engine_forward(parts[0], &seg, 1, toks, NULL, h1, &err), 0);
    assert_int_equal(kvr_engine_forward(parts[1], &seg, 1, NULL, h1, h2, &err), 0);
    assert_int_equal(kvr_engine_forward(parts[2], &seg, 1, NULL, h2, b, &err), 0);
    assert_memory_equal(a, b, sizeof a);
    for (int i = 0; i < 3; i++)
        kvr_engine_destroy(parts[i]);
    kvr_engine_destroy(whole);
    kvr_gguf_close(g);
}

/* Bad memberships are refused with a message, never computed. */
static void test_bad_batches(void **state)
{
    (void)state;
    const char *path = kvr_test_shared("models/stories260K.gguf");
    struct kvr_gguf *g = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_open(&g, path, &err), 0);
    struct kvr_engine *e = open_engine(g, 0, 4, 1, 8);
    int32_t toks[16] = {1, 2, 3};
    float out[512 * 2];
    struct kvr_seg too_wide = {0, 0, 9, KVR_SEG_PREFILL};
    assert_int_equal(kvr_engine_forward(e, &too_wide, 1, toks, NULL, out, &err), KVR_ERANGE);
    assert_non_null(strstr(err.msg, "row width"));
    struct kvr_seg bad_seq = {99, 0, 1, 0};
    assert_int_equal(kvr_engine_forward(e, &bad_seq, 1, toks, NULL, out, &err), KVR_ERANGE);
    struct kvr_seg gap = {0, 5, 1, 0};
    assert_int_equal(kvr_engine_forward(e, &gap, 1, toks, NULL, out, &err), KVR_ERANGE);
    assert_non_null(strstr(err.msg, "cached"));
    int32_t bad_tok = 512;
    struct kvr_seg one = {0, 0, 1, KVR_SEG_WANTS_TOKEN};
    assert_int_equal(kvr_engine_forward(e, &one, 1, &bad_tok, NULL, out, &err), KVR_ERANGE);
    struct kvr_seg twice[2] = {{1, 0, 1, 0}, {1, 1, 1, 0}};
    assert_int_equal(kvr_engine_forward(e, twice, 2, toks, NULL, out, &err), KVR_EINVAL);
    assert_int_equal(kvr_engine_forward(e, &one, 1, toks, NULL, out, &err), 0);
    kvr_engine_destroy(e);
    kvr_gguf_close(g);
}

static void test_kv_blocks(void **state)
{
    (void)state;
    struct kvr_kv kv;
    struct kvr_err err = {0};
    assert_int_equal(kvr_kv_init(&kv, KVR_DTYPE_F32, 2, 8, 4, 5, 3, 16, &err), 0);
    assert_int_equal(kvr_kv_prepare(&kv, 0, 0, 9, &err), 0); /* 3 blocks */
    assert_int_equal(kv.n_free, 2);
    assert_int_equal(kvr_kv_prepare(&kv, 1, 0, 9, &err), KVR_EFULL); /* needs 3 */
    assert_int_equal(kv.n_free, 2);
    assert_int_equal(kvr_kv_prepare(&kv, 1, 0, 8, &err), 0);
    assert_int_equal(kv.n_free, 0);
    assert_int_equal(kvr_kv_prepare(&kv, 0, 4, 1, &err), 0); /* truncate to 5 positions */
    assert_int_equal(kv.n_free, 1);
    assert_int_equal(kvr_kv_prepare(&kv, 2, 1, 1, &err), KVR_ERANGE);  /* gap */
    assert_int_equal(kvr_kv_prepare(&kv, 2, 0, 17, &err), KVR_ERANGE); /* beyond context */
    kvr_kv_free_seq(&kv, 0);
    kvr_kv_free_seq(&kv, 1);
    assert_int_equal(kv.n_free, 5);
    kvr_kv_fini(&kv);
}

/* Write the synthesized model o to path (/tmp/kvr_test_engine_PID_TAG.gguf). */
static void write_synth(const struct kvr_synth_opts *o, const char *tag, char *path, size_t cap)
{
    snprintf(path, cap, "/tmp/kvr_test_engine_%d_%s.gguf", (int)getpid(), tag);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    struct kvr_err err = {0};
    if (kvr_synth_write(o, f, NULL, &err))
        fail_msg("synth %s: %s", tag, err.msg);
    assert_int_equal(fclose(f), 0);
}

/* Every architecture of the table (its biases, q/k norms, post-norms, fused tensors,
 * sliding window of 8 over prompts of up to 19 tokens, GeGLU, experts), in Q8_0 through the SIMD
 * kernels: a sequence's logits are the same bits alone, batched, chunked, on 1 or 2
 * threads. */
static void test_invariance_archs(void **state)
{
    (void)state;
    for (int i = 0; kvr_arch_at(i); i++) {
        const struct kvr_arch *a = kvr_arch_at(i);
        struct kvr_synth_opts o = {
            .arch = a, .type = KVR_DTYPE_Q8_0, .seed = 11, .n_threads = 1, .logit_scale = 4};
        assert_int_equal(kvr_synth_shape_by_name("tiny", &o.shape), 0);
        o.shape.n_layers = a->swa_period > 4 ? (int)a->swa_period : 3;
        o.shape.n_swa = a->sliding ? 8 : 0;
        if (!strcmp(a->name, "qwen3"))
            o.shape.head_dim = 32;
        if (a->moe_always) {
            o.shape.n_expert = 4;
            o.shape.n_expert_used = 2;
        }
        char path[256];
        write_synth(&o, a->name, path, sizeof path);
        check_invariance(path);
        print_message("%s: invariant alone/batched/chunked, 1/2 threads\n", a->name);
        remove(path);
    }
}

/* Decode matmuls large enough to run on the pool go through engine.c's shares and steals
 * (the tiny shapes above stay on one thread): in a packed 4-bit type, a K-quant and Q8_0,
 * a sequence's logits are the same bits alone on 1, 2 and 3 threads and batched. */
static void test_invariance_shares(void **state)
{
    (void)state;
    const enum kvr_dtype types[] = {KVR_DTYPE_Q4_0, KVR_DTYPE_Q6_K, KVR_DTYPE_Q8_0};
    for (int t = 0; t < 3; t++) {
        struct kvr_synth_opts o = {
            .type = types[t], .seed = 7 + (uint64_t)t, .n_threads = 2, .logit_scale = 4};
        assert_int_equal(kvr_synth_shape_by_name("tiny", &o.shape), 0);
        o.shape.n_layers = 2;
        o.shape.dim = 512; /* 512 x 512 and up: over engine.c's SMALL_WORK at one row */
        o.shape.ff = 1024;
        o.shape.n_heads = 8;
        o.shape.vocab_size = 2048;
        char path[256];
        write_synth(&o, "shares", path, sizeof path);
        struct kvr_err err = {0};
        check_invariance(path);
        struct kvr_gguf *g = NULL;
        assert_int_equal(kvr_gguf_open(&g, path, &err), 0);
        struct kvr_hparams hp;
        assert_int_equal(kvr_hparams_read(&hp, g, &err), 0);
        float *one = run_alone(g, 1, hp.n_layer, 0), *three = run_alone(g, 3, hp.n_layer, 0);
        size_t n = (size_t)N_SEQ * (N_DECODE + 1) * hp.n_vocab * sizeof(float);
        if (memcmp(one, three, n) != 0)
            fail_msg("type %d: logits on 3 threads differ from 1 thread", (int)types[t]);
        free(one);
        free(three);
        kvr_gguf_close(g);
        remove(path);
    }
}

/* f16 and q8_0 KV caches: a sequence's logits are the same bits alone, batched, chunked,
 * on 1 or 2 threads, as with f32 (llama, head width 32 so q8_0's blocks fit a head); they
 * differ from f32's (the values are rounded), by at most 2% of the logits' range; a q8_0
 * cache is refused for heads of 16. */
static void test_invariance_kv_types(void **state)
{
    (void)state;
    struct kvr_synth_opts o = {.arch = kvr_arch_find("llama", 5),
                               .type = KVR_DTYPE_Q8_0,
                               .seed = 5,
                               .n_threads = 1,
                               .logit_scale = 4};
    assert_non_null(o.arch);
    assert_int_equal(kvr_synth_shape_by_name("tiny", &o.shape), 0);
    o.shape.head_dim = 32;
    char path[256];
    write_synth(&o, "kvtypes", path, sizeof path);
    struct kvr_err err = {0};
    struct kvr_gguf *g = NULL;
    assert_int_equal(kvr_gguf_open(&g, path, &err), 0);
    struct kvr_hparams hp;
    assert_int_equal(kvr_hparams_read(&hp, g, &err), 0);
    float *f32 = run_alone(g, 1, hp.n_layer, 0);
    const enum kvr_dtype types[] = {KVR_DTYPE_F16, KVR_DTYPE_Q8_0};
    for (int t = 0; t < 2; t++) {
        kv_type = types[t];
        check_invariance(path);
        float *other = run_alone(g, 1, hp.n_layer, 0);
        /* Measured: at most 0.5% (f16) and 0.6% (q8_0) of the logits' range. */
        float d = 0, lo = f32[0], hi = f32[0];
        for (uint32_t s = 0; s < N_SEQ; s++) /* the prompts' logits (later ones may diverge) */
            for (uint32_t i = 0; i < hp.n_vocab; i++) {
                size_t at = (size_t)s * (N_DECODE + 1) * hp.n_vocab + i;
                d = fmaxf(d, fabsf(f32[at] - other[at]));
                lo = fminf(lo, f32[at]);
                hi = fmaxf(hi, f32[at]);
            }
        print_message("kv type %s: logits within %.2f%% of their range of f32's\n",
                      types[t] == KVR_DTYPE_F16 ? "f16" : "q8_0", 100 * d / (hi - lo));
        assert_true(d > 0 && d <= 0.02f * (hi - lo));
        free(other);
    }
    free(f32);
    kv_type = KVR_DTYPE_F32;
    kvr_gguf_close(g);
    remove(path);

    /* Heads of 16 values cannot hold q8_0 blocks of 32. */
    struct kvr_engine *e = NULL;
    assert_int_equal(kvr_gguf_open(&g, kvr_test_shared("models/stories260K.gguf"), &err), 0);
    struct kvr_engine_config cfg = {.last_layer = 4,
                                    .max_rows = 8,
                                    .max_seqs = 2,
                                    .n_ctx = 32,
                                    .kv_block_tokens = 16,
                                    .kv_type = KVR_DTYPE_Q8_0,
                                    .n_threads = 1};
    assert_int_equal(kvr_engine_create(&e, g, &cfg, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "q8_0"));
    assert_null(e);
    cfg.kv_type = KVR_DTYPE_F16;
    assert_int_equal(kvr_engine_create(&e, g, &cfg, &err), 0);
    kvr_engine_destroy(e);
    kvr_gguf_close(g);
}

/* An architecture not in the table is refused with the list of those that are. */
static void test_unknown_arch(void **state)
{
    (void)state;
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    assert_non_null(w);
    kvr_gguf_writer_add_str(w, "general.architecture", "mamba");
    char path[256];
    snprintf(path, sizeof path, "/tmp/kvr_test_engine_%d_mamba.gguf", (int)getpid());
    FILE *f = fopen(path, "wb");
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_writer_write(w, f, &err), 0);
    fclose(f);
    kvr_gguf_writer_destroy(w);
    struct kvr_gguf *g = NULL;
    assert_int_equal(kvr_gguf_open(&g, path, &err), 0);
    struct kvr_hparams hp;
    assert_int_equal(kvr_hparams_read(&hp, g, &err), KVR_ENOTSUP);
    assert_non_null(strstr(err.msg, "'mamba'"));
    assert_non_null(strstr(err.msg, kvr_arch_list()));
    kvr_gguf_close(g);
    remove(path);
}

int main(void)
{
    kvr_test_model_options();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_blocks),
        cmocka_unit_test(test_reference_stories260k),
        cmocka_unit_test(test_bad_batches),
        cmocka_unit_test(test_split_matches_whole),
        cmocka_unit_test(test_invariance_stories260k),
        cmocka_unit_test(test_invariance_synth),
        cmocka_unit_test(test_invariance_archs),
        cmocka_unit_test(test_invariance_shares),
        cmocka_unit_test(test_invariance_kv_types),
        cmocka_unit_test(test_unknown_arch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
