/* test_generate.c - the single-process generation loop (model/generate.h) on a tiny
 * synthetic model.
 *
 * The regression it guards: a logits row with no finite value has no token to sample, and
 * kvr_sampler_sample says so with a negative status. The loop must fail with a message,
 * never store that status as a token id and feed it back to the engine. Both loops are
 * checked: one sequence at a time, and all at once. A healthy model is run first, so the
 * failure is the poison's doing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "../support/tiny_model.h"

#include "core/err.h"
#include "core/utf8.h"
#include "model/arch.h"
#include "model/generate.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TOKENS 4

struct rig {
    char *buf; /* the GGUF image, writable: the test poisons a tensor in place */
    size_t len;
    struct kvr_gguf *g;
    struct kvr_hparams hp;
    struct kvr_tok *tok;
};

static void rig_init(struct rig *r)
{
    memset(r, 0, sizeof *r);
    kvr_test_tiny_model("generate-test", 7, &r->buf, &r->len, &r->g, &r->hp);
    struct kvr_err err = {0};
    if (kvr_tok_create(&r->tok, r->g, &err))
        fail_msg("tokenizer: %s", err.msg);
}

static void rig_fini(struct rig *r)
{
    kvr_tok_destroy(r->tok);
    kvr_gguf_close(r->g);
    free(r->buf);
}

/* Every weight of the final norm becomes NaN, so every logit is NaN. */
static void poison_output_norm(struct rig *r)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(r->g, "output_norm.weight");
    assert_non_null(t);
    assert_int_equal(t->type, KVR_DTYPE_F32);
    float *w = (float *)(r->buf + ((const char *)t->data - r->buf));
    for (size_t i = 0; i < t->n_bytes / sizeof *w; i++)
        w[i] = NAN;
}

typedef int (*generate_fn)(const struct kvr_gguf *, const struct kvr_hparams *,
                           const struct kvr_tok *, const struct kvr_generate_config *,
                           struct kvr_generate_seq *, uint32_t, kvr_generate_token_fn, void *,
                           struct kvr_generate_stats *, struct kvr_err *);

static void on_token(void *ud, uint32_t seq, int32_t id)
{
    (void)seq;
    assert_true(id >= 0); /* a status must never reach the caller as a token */
    (*(int *)ud)++;
}

static int run(struct rig *r, generate_fn fn, float temperature, int *n_tokens, struct kvr_err *err)
{
    static const int32_t prompt[2][3] = {{1, 17, 42}, {1, 99, 5}};
    int32_t out[2][MAX_TOKENS];
    struct kvr_generate_seq seqs[2];
    for (int i = 0; i < 2; i++) {
        seqs[i] = (struct kvr_generate_seq){
            .ids = prompt[i], .n_ids = 3, .max_tokens = MAX_TOKENS, .out = out[i]};
        kvr_sample_params_default(&seqs[i].sp);
        seqs[i].sp.temperature = temperature;
        seqs[i].sp.seed = 11 + (uint64_t)i;
    }
    struct kvr_generate_config cfg = {
        .n_ctx = 64, .row_width = 8, .kv_type = KVR_DTYPE_F32, .n_threads = 1, .ignore_eos = true};
    struct kvr_generate_stats st;
    *n_tokens = 0;
    return fn(r->g, &r->hp, r->tok, &cfg, seqs, 2, on_token, n_tokens, &st, err);
}

static void check_loop(generate_fn fn)
{
    static const float temps[] = {0.0f, 0.8f};
    for (size_t k = 0; k < 2; k++) {
        struct rig r;
        rig_init(&r);
        struct kvr_err err = {0};
        int n = 0;
        assert_int_equal(run(&r, fn, temps[k], &n, &err), 0);
        assert_int_equal(n, 2 * MAX_TOKENS);

        poison_output_norm(&r);
        err = (struct kvr_err){0};
        assert_int_equal(run(&r, fn, temps[k], &n, &err), KVR_EINVAL);
        assert_int_equal(n, 0);
        assert_non_null(strstr(err.msg, "no finite logit"));
        rig_fini(&r);
    }
}

static void test_one_at_a_time_fails_on_nan_logits(void **state)
{
    (void)state;
    check_loop(kvr_generate);
}

static void test_batched_fails_on_nan_logits(void **state)
{
    (void)state;
    check_loop(kvr_generate_batched);
}

/* ---- grammars ---------------------------------------------------------------------------- */

#define G_TOKENS 12

/* Two sequences, greedy or sampled, with the grammars given (NULL: free), `max` tokens. */
static uint32_t g_salt; /* picks the prompts */

static void run_g(struct rig *r, generate_fn fn, float temperature, struct kvr_grammar *const *g,
                  const uint32_t *max, int32_t out[2][G_TOKENS], uint32_t *n_out)
{
    const int32_t prompt[2][3] = {{1, 17 + (int32_t)g_salt, 42}, {1, 99, 5 + (int32_t)g_salt}};
    struct kvr_generate_seq seqs[2];
    for (int i = 0; i < 2; i++) {
        seqs[i] = (struct kvr_generate_seq){
            .ids = prompt[i], .n_ids = 3, .max_tokens = max[i], .out = out[i], .grammar = g[i]};
        kvr_sample_params_default(&seqs[i].sp);
        seqs[i].sp.temperature = temperature;
        seqs[i].sp.seed = 5 + (uint64_t)i;
    }
    struct kvr_generate_config cfg = {
        .n_ctx = 64, .row_width = 8, .kv_type = KVR_DTYPE_F32, .n_threads = 1, .ignore_eos = true};
    struct kvr_generate_stats st;
    struct kvr_err err = {0};
    if (fn(r->g, &r->hp, r->tok, &cfg, seqs, 2, NULL, NULL, &st, &err))
        fail_msg("generate: %s", err.msg);
    for (int i = 0; i < 2; i++)
        n_out[i] = seqs[i].n_out;
}

/* The longest start of `ids` whose bytes are well-formed UTF-8, as a GBNF literal rule. */
static uint32_t literal_of(const struct kvr_tok *tok, const int32_t *ids, uint32_t n, char *gbnf,
                           size_t cap)
{
    char bytes[512];
    size_t len = 0;
    uint32_t k = 0, best = 0;
    for (; k < n; k++) {
        const char *p;
        size_t l;
        assert_int_equal(kvr_tok_decode_piece(tok, ids[k], false, &p, &l), 0);
        if (len + l > sizeof bytes)
            break;
        memcpy(bytes + len, p, l);
        len += l;
        if (kvr_utf8_valid_len(bytes, len) != len || memchr(bytes, 0, len))
            break;
        best = k + 1;
    }
    len = 0;
    for (uint32_t j = 0; j < best; j++) { /* again, up to `best` */
        const char *p;
        size_t l;
        kvr_tok_decode_piece(tok, ids[j], false, &p, &l);
        memcpy(bytes + len, p, l);
        len += l;
    }
    size_t o = (size_t)snprintf(gbnf, cap, "root ::= \"");
    for (size_t j = 0; j < len && o + 8 < cap; j++) {
        unsigned char c = (unsigned char)bytes[j];
        if (c == '"' || c == '\\')
            o += (size_t)snprintf(gbnf + o, cap - o, "\\%c", c);
        else if (c < 0x20)
            o += (size_t)snprintf(gbnf + o, cap - o, "\\x%02x", c);
        else
            gbnf[o++] = (char)c;
    }
    snprintf(gbnf + o, cap - o, "\"");
    return best;
}

/* A grammar that allows the greedy token at every step changes no token, and a free
 * sequence beside a constrained one gets the same tokens as beside a free one; a
 * restrictive grammar is followed by sampled output. Both loops. */
static void check_grammar_loop(generate_fn fn)
{
    struct rig r;
    rig_init(&r);
    struct kvr_grammar *none[2] = {NULL, NULL};
    int32_t free_out[2][G_TOKENS], out[2][G_TOKENS];
    uint32_t n_free[2], n[2], max[2] = {G_TOKENS, G_TOKENS};
    char gbnf[4096];
    uint32_t k = 0;
    /* a random model soon picks a byte that is not UTF-8, which no grammar can spell: find
     * prompts whose greedy answer starts with a few well-formed tokens */
    for (g_salt = 0; g_salt < 200 && k < 4; g_salt++) {
        run_g(&r, fn, 0.0f, none, max, free_out, n_free);
        k = literal_of(r.tok, free_out[0], n_free[0], gbnf, sizeof gbnf);
    }
    g_salt--;
    if (k < 4)
        fail_msg("no prompt's greedy answer starts with 4 well-formed tokens");
    struct kvr_grammar *g = NULL;
    struct kvr_err err = {0};
    if (kvr_grammar_compile(&g, gbnf, strlen(gbnf), &err))
        fail_msg("%s: %s", gbnf, err.msg);
    struct kvr_grammar *one[2] = {g, NULL};
    uint32_t max_k[2] = {k, G_TOKENS};
    run_g(&r, fn, 0.0f, one, max_k, out, n);
    assert_int_equal(n[0], k);
    assert_memory_equal(out[0], free_out[0], k * sizeof(int32_t));
    assert_int_equal(n[1], n_free[1]); /* the free neighbour */
    assert_memory_equal(out[1], free_out[1], n[1] * sizeof(int32_t));
    kvr_grammar_destroy(g);

    /* sampled under a class: every output byte is in it */
    const char *cls = "root ::= [a-z ]+";
    assert_int_equal(kvr_grammar_compile(&g, cls, strlen(cls), NULL), 0);
    struct kvr_grammar *both[2] = {g, g};
    run_g(&r, fn, 0.8f, both, max, out, n);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(n[i], G_TOKENS);
        struct kvr_grammar_match *m;
        assert_int_equal(kvr_grammar_match_create(&m, g), 0);
        for (uint32_t j = 0; j < n[i]; j++) {
            const char *p;
            size_t l;
            kvr_tok_decode_piece(r.tok, out[i][j], false, &p, &l);
            if (!kvr_tok_is_eog(r.tok, out[i][j]) && (l == 0 || kvr_grammar_match_bytes(m, p, l)))
                fail_msg("seq %d token %u (%d) breaks the grammar", i, j, out[i][j]);
        }
        kvr_grammar_match_destroy(m);
    }
    kvr_grammar_destroy(g);
    rig_fini(&r);
}

static void test_one_at_a_time_grammar(void **state)
{
    (void)state;
    check_grammar_loop(kvr_generate);
}

static void test_batched_grammar(void **state)
{
    (void)state;
    check_grammar_loop(kvr_generate_batched);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_at_a_time_fails_on_nan_logits),
        cmocka_unit_test(test_batched_fails_on_nan_logits),
        cmocka_unit_test(test_one_at_a_time_grammar),
        cmocka_unit_test(test_batched_grammar),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
