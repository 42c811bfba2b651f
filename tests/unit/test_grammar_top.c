/* test_grammar_top.c - masks by top parts (model/grammar_top.c) against the plain walk of
 * the whole trie: two matchers of one grammar go through the same random tokens, one with
 * the top-part masks, one plain, and every mask must be bit for bit the same. Grammars:
 * JSON schemas as the bridge compiles them (arrays with minItems, nested objects, $ref
 * recursion, patterns, enums), JSON, and ambiguous GBNF (several stacks at once). Vocabs: a
 * synthetic one with JSON pieces, multi-byte and split UTF-8, and the Llama 3 vocabulary
 * (128,256 tokens) from ../shared. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/json_schema.h"
#include "core/rng.h"
#include "model/gguf.h"
#include "model/grammar.h"
#include "model/grammar_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const schemas[] = {
    "{\"type\": \"array\", \"minItems\": 5, \"items\": {\"type\": \"object\", \"properties\": {"
    "\"name\": {\"type\": \"string\"}, \"age\": {\"type\": \"integer\", \"minimum\": 0, "
    "\"maximum\": 120}, \"email\": {\"type\": \"string\", \"format\": \"email\"}, \"role\": "
    "{\"enum\": [\"admin\", \"editor\", \"viewer\"]}, \"tags\": {\"type\": \"array\", \"items\": "
    "{\"type\": \"string\"}, \"maxItems\": 3}, \"active\": {\"type\": \"boolean\"}}, "
    "\"required\": [\"name\", \"age\", \"role\", \"active\"]}}",
    "{\"type\": \"object\", \"properties\": {\"id\": {\"type\": \"string\", \"pattern\": "
    "\"^[A-Z]{2}-[0-9]{3,5}$\"}, \"score\": {\"type\": \"number\"}, \"items\": {\"type\": "
    "\"array\", \"minItems\": 2, \"maxItems\": 4, \"items\": {\"anyOf\": [{\"type\": "
    "\"integer\"}, {\"type\": \"null\"}, {\"const\": \"x\"}]}}}, \"required\": [\"id\"]}",
    "{\"$defs\": {\"node\": {\"type\": \"object\", \"properties\": {\"v\": {\"type\": "
    "\"integer\"}, \"kids\": {\"type\": \"array\", \"items\": {\"$ref\": \"#/$defs/node\"}}}, "
    "\"required\": [\"v\"]}}, \"$ref\": \"#/$defs/node\"}",
    "{}",
};

static const char *const gbnfs[] = {
    "root ::= (\"a\" | \"ab\" | \"abc\")+ \"!\"",
    "root ::= x{3,6} \";\"\nx ::= \"(\" [a-c]* \")\" | \"[\" x? \"]\"",
    "root ::= ([^\"] | \"\\\"\" [a-z]{1,4} \"\\\"\")* \"\\n\"",
    "root ::= \"\\u00e9\" [\\u4e00-\\u4e2f]+ | [\\u00c0-\\u00ff]{2} \"x\"",
};

static struct kvr_grammar *compile_text(const char *text, size_t len)
{
    struct kvr_grammar *g = NULL;
    struct kvr_err err = {0};
    if (kvr_grammar_compile(&g, text, len, &err))
        fail_msg("compile failed: %s\n%s", err.msg, text);
    return g;
}

static struct kvr_grammar *compile_schema(const char *schema)
{
    json_t *j = json_loads(schema, 0, NULL);
    assert_non_null(j);
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    struct kvr_err err = {0};
    if (kvr_json_schema_gbnf(j, &out, &err))
        fail_msg("schema: %s", err.msg);
    json_decref(j);
    size_t len;
    char *text = kvr_sbuf_take(&out, &len);
    struct kvr_grammar *g = compile_text(text, len);
    free(text);
    return g;
}

/* Pieces of JSON, letters, digits, escapes and UTF-8 (whole, and split into lead and
 * continuation bytes), combined at random into n tokens; the last one ends generation. */
static struct kvr_grammar_vocab *synth_vocab(int32_t n, uint64_t seed)
{
    static const char *const parts[] = {"{",
                                        "}",
                                        "[",
                                        "]",
                                        "\"",
                                        ":",
                                        ",",
                                        " ",
                                        "\\",
                                        "\\\"",
                                        "a",
                                        "b",
                                        "c",
                                        "x",
                                        "!",
                                        "(",
                                        ")",
                                        ";",
                                        "\n",
                                        "-",
                                        "0",
                                        "1",
                                        "7",
                                        ".",
                                        "e",
                                        "@",
                                        "AB",
                                        "Z",
                                        "_",
                                        "v",
                                        "id",
                                        "name",
                                        "age",
                                        "email",
                                        "kids",
                                        "true",
                                        "false",
                                        "null",
                                        "admin",
                                        "editor",
                                        "viewer",
                                        "role",
                                        "tags",
                                        "active",
                                        "items",
                                        "score",
                                        "\xc3\xa9",
                                        "\xe4\xb8\x80",
                                        "\xe4\xb8\xaf",
                                        "\xc3",
                                        "\xa9",
                                        "\xe4",
                                        "\xb8",
                                        "\xe4\xb8",
                                        "\x80",
                                        "\xc3\x80"};
    const int n_parts = (int)(sizeof parts / sizeof *parts);
    char **bytes = calloc((size_t)n, sizeof *bytes);
    size_t *lens = calloc((size_t)n, sizeof *lens);
    bool *eog = calloc((size_t)n, sizeof *eog);
    assert_true(bytes && lens && eog);
    uint64_t rng = seed;
    for (int32_t i = 0; i < n; i++) {
        char buf[64] = {0};
        size_t len = 0;
        int k = i < n_parts ? 1 : 1 + (int)(kvr_splitmix64(&rng) % 4);
        for (int j = 0; j < k; j++) {
            const char *p = parts[i < n_parts ? i : (int)(kvr_splitmix64(&rng) % n_parts)];
            if (len + strlen(p) < sizeof buf) {
                memcpy(buf + len, p, strlen(p));
                len += strlen(p);
            }
        }
        bytes[i] = malloc(len + 1);
        memcpy(bytes[i], buf, len + 1);
        lens[i] = i == n - 1 ? 0 : len;
        eog[i] = i == n - 1;
    }
    struct kvr_grammar_vocab *v = NULL;
    struct kvr_err err = {0};
    assert_int_equal(
        kvr_grammar_vocab_create_bytes(&v, n, (const char *const *)bytes, lens, eog, &err), 0);
    for (int32_t i = 0; i < n; i++)
        free(bytes[i]);
    free(bytes);
    free(lens);
    free(eog);
    return v;
}

/* Walk `steps` random tokens; each mask of the fast matcher must equal the plain one's.
 * Tokens: uniform among the allowed, or half the time among the allowed of at most
 * `short_len` bytes (random tokens of a big vocabulary would stay inside strings). */
static void compare(const struct kvr_grammar *g, const struct kvr_grammar_vocab *v,
                    const struct kvr_tok *tok, int steps, uint64_t seed,
                    struct kvr_grammar_stats *sum)
{
    struct kvr_grammar_match *fast, *plain;
    assert_int_equal(kvr_grammar_match_create(&fast, g), 0);
    assert_int_equal(kvr_grammar_match_create(&plain, g), 0);
    kvr_grammar_match_set_plain(plain, true);
    int32_t nv = kvr_grammar_vocab_n(v);
    size_t words = ((size_t)nv + 31) / 32;
    uint32_t *a = malloc(words * 4), *b = malloc(words * 4);
    int32_t *allowed = malloc((size_t)nv * sizeof *allowed);
    int32_t *short_ok = malloc((size_t)nv * sizeof *short_ok);
    assert_true(a && b && allowed && short_ok);
    uint64_t rng = seed;
    for (int step = 0; step < steps; step++) {
        int32_t na = kvr_grammar_mask(fast, v, a), nb = kvr_grammar_mask(plain, v, b);
        assert_int_equal(na, nb);
        if (memcmp(a, b, words * 4)) {
            for (int32_t t = 0; t < nv; t++)
                if (((a[t >> 5] ^ b[t >> 5]) >> (t & 31)) & 1)
                    fail_msg("step %d: token %d: fast %u, plain %u", step, t,
                             (a[t >> 5] >> (t & 31)) & 1, (b[t >> 5] >> (t & 31)) & 1);
        }
        int32_t n = 0, ns = 0;
        for (int32_t t = 0; t < nv; t++)
            if ((a[t >> 5] >> (t & 31)) & 1) {
                allowed[n++] = t;
                const char *p;
                size_t len = 0;
                if (!tok || (!kvr_tok_decode_piece(tok, t, false, &p, &len) && len <= 2))
                    short_ok[ns++] = t;
            }
        assert_true(n > 0);
        bool use_short = ns && (kvr_splitmix64(&rng) & 1);
        int32_t t = use_short ? short_ok[kvr_splitmix64(&rng) % (uint64_t)ns]
                              : allowed[kvr_splitmix64(&rng) % (uint64_t)n];
        int ra = kvr_grammar_accept_token(fast, v, t), rb = kvr_grammar_accept_token(plain, v, t);
        assert_int_equal(ra, rb);
        if (ra || kvr_splitmix64(&rng) % 97 == 0 || (tok && kvr_tok_is_eog(tok, t)) ||
            t == nv - 1) { /* a token past the end, the end, or a new request */
            kvr_grammar_match_reset(fast);
            kvr_grammar_match_reset(plain);
        }
    }
    struct kvr_grammar_stats st;
    kvr_grammar_match_stats(fast, &st);
    sum->n_masks += st.n_masks;
    sum->n_top_walks += st.n_top_walks;
    sum->n_top_cached += st.n_top_cached;
    kvr_grammar_match_stats(plain, &st);
    assert_int_equal(st.n_top_walks, 0);
    free(a);
    free(b);
    free(allowed);
    free(short_ok);
    kvr_grammar_match_destroy(fast);
    kvr_grammar_match_destroy(plain);
}

static void test_synthetic(void **state)
{
    (void)state;
    struct kvr_grammar_stats sum = {0};
    for (uint64_t vs = 1; vs <= 3; vs++) {
        struct kvr_grammar_vocab *v = synth_vocab(3000, vs);
        for (size_t i = 0; i < sizeof schemas / sizeof *schemas; i++) {
            struct kvr_grammar *g = compile_schema(schemas[i]);
            compare(g, v, NULL, 400, vs * 100 + i, &sum);
            kvr_grammar_destroy(g);
        }
        for (size_t i = 0; i < sizeof gbnfs / sizeof *gbnfs; i++) {
            struct kvr_grammar *g = compile_text(gbnfs[i], strlen(gbnfs[i]));
            compare(g, v, NULL, 300, vs * 1000 + i, &sum);
            kvr_grammar_destroy(g);
        }
        kvr_grammar_vocab_destroy(v);
    }
    print_message("synthetic: %llu masks, %llu top parts walked, %llu found walked\n",
                  (unsigned long long)sum.n_masks, (unsigned long long)sum.n_top_walks,
                  (unsigned long long)sum.n_top_cached);
    /* the fast path ran, and its cache served: a test that never used it proves nothing */
    assert_true(sum.n_top_walks > 50);
    assert_true(sum.n_top_cached > sum.n_top_walks);
}

static void test_llama3_vocab(void **state)
{
    (void)state;
    const char *path = kvr_test_shared("vocab/ggml-vocab-llama-bpe.gguf");
    struct kvr_gguf *gg = NULL;
    struct kvr_tok *tok = NULL;
    struct kvr_err err = {0};
    if (kvr_gguf_open(&gg, path, &err) || kvr_tok_create(&tok, gg, &err))
        fail_msg("%s: %s", path, err.msg);
    kvr_gguf_close(gg);
    struct kvr_grammar_vocab *v = NULL;
    assert_int_equal(kvr_grammar_vocab_create(&v, tok, &err), 0);
    struct kvr_grammar_stats sum = {0};
    for (size_t i = 0; i < 3; i++) {
        struct kvr_grammar *g = compile_schema(schemas[i]);
        compare(g, v, tok, 120, 7 + i, &sum);
        kvr_grammar_destroy(g);
    }
    print_message("llama3: %llu masks, %llu top parts walked, %llu found walked\n",
                  (unsigned long long)sum.n_masks, (unsigned long long)sum.n_top_walks,
                  (unsigned long long)sum.n_top_cached);
    assert_true(sum.n_top_walks > 10);
    kvr_grammar_vocab_destroy(v);
    kvr_tok_destroy(tok);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_synthetic),
        cmocka_unit_test(test_llama3_vocab),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
