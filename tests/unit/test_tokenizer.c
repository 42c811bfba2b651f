/* test_tokenizer.c - SPM and GPT-2 BPE tokenizers against llama.cpp's test vectors, decoding,
 * streaming detokenization, validation errors and encode speed. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/alloc.h"
#include "model/gguf.h"
#include "model/gguf_write.h"
#include "model/tokenizer.h"
#include "model/tokenizer_unicode.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- llama.cpp's vector files ------------------------------------------------------------
 * X.inp holds the inputs, each followed by the separator "\n__ggml_vocab_test__\n" (so an
 * input never includes the newline before the separator line, and an input that is itself
 * one newline shows up as an empty line). X.out holds one line per input: the expected
 * ids, each preceded by a space, without BOS. */

#define MAX_CASES 128

struct vectors {
    char *inp, *outp;
    int n;
    const char *text[MAX_CASES];
    size_t len[MAX_CASES];
    int32_t ids[MAX_CASES][512];
    int n_ids[MAX_CASES];
};

static void load_vectors(struct vectors *v, const char *inp_path, const char *out_path)
{
    static const char sep[] = "\n__ggml_vocab_test__\n";
    size_t n_inp, n_out;
    memset(v, 0, sizeof *v);
    v->inp = kvr_test_read_file(inp_path, &n_inp);
    v->outp = kvr_test_read_file(out_path, &n_out);
    assert_non_null(v->inp);
    assert_non_null(v->outp);
    char *p = v->inp, *end = v->inp + n_inp;
    while (p < end) {
        char *q = strstr(p, sep);
        assert_non_null(q); /* every input, the last included, ends with the separator */
        assert_true(v->n < MAX_CASES);
        v->text[v->n] = p;
        v->len[v->n] = (size_t)(q - p);
        v->n++;
        p = q + strlen(sep);
    }
    int line = 0;
    char *s = v->outp;
    while (*s) {
        char *nl = strchr(s, '\n');
        assert_non_null(nl);
        *nl = 0;
        assert_true(line < v->n);
        for (char *tok = strtok(s, " "); tok; tok = strtok(NULL, " ")) {
            assert_true(v->n_ids[line] < 512);
            v->ids[line][v->n_ids[line]++] = (int32_t)strtol(tok, NULL, 10);
        }
        line++;
        s = nl + 1;
    }
    assert_int_equal(line, v->n);
}

static void free_vectors(struct vectors *v)
{
    free(v->inp);
    free(v->outp);
}

static struct kvr_tok *open_tok(const char *rel)
{
    const char *path = kvr_test_shared(rel);
    struct kvr_gguf *g = NULL;
    struct kvr_err err = {0};
    if (kvr_gguf_open(&g, path, &err) != 0)
        fail_msg("open %s: %s", path, err.msg);
    struct kvr_tok *t = NULL;
    if (kvr_tok_create(&t, g, &err) != 0)
        fail_msg("tokenizer from %s: %s", path, err.msg);
    kvr_gguf_close(g); /* the tokenizer keeps its own copy */
    return t;
}

/* Ids [from, from + 24) of a list, marking index `at` (where two lists part). */
static void print_ids(const char *label, const int32_t *ids, int n, int from, int at)
{
    char line[512];
    size_t m = 0;
    m += (size_t)snprintf(line, sizeof line, "%s", from > 0 ? " ..." : "");
    for (int i = from; i < n && i < from + 24; i++)
        m += (size_t)snprintf(line + m, sizeof line - m, i == at ? " [%d]" : " %d", ids[i]);
    if (n > from + 24)
        m += (size_t)snprintf(line + m, sizeof line - m, " ...");
    print_message("    %s (%d ids):%s\n", label, n, line);
}

static void print_escaped(const char *label, const char *s, size_t n)
{
    char buf[400];
    size_t m = 0;
    for (size_t i = 0; i < n && m + 8 < sizeof buf; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n')
            m += (size_t)snprintf(buf + m, sizeof buf - m, "\\n");
        else if (c == '\t')
            m += (size_t)snprintf(buf + m, sizeof buf - m, "\\t");
        else if (c < 0x20)
            m += (size_t)snprintf(buf + m, sizeof buf - m, "\\x%02x", c);
        else
            buf[m++] = (char)c;
    }
    buf[m] = 0;
    print_message("    %s: \"%s\"\n", label, buf);
}

/* Encode every case; on a mismatch show the input, both id lists and where they part. */
static void check_vectors(const char *vocab_rel, const char *inp_rel, const char *out_rel)
{
    struct kvr_tok *t = open_tok(vocab_rel);
    char inp_path[4096], out_path[4096];
    snprintf(inp_path, sizeof inp_path, "%s", kvr_test_shared(inp_rel));
    snprintf(out_path, sizeof out_path, "%s", kvr_test_shared(out_rel));
    struct vectors *v = malloc(sizeof *v);
    assert_non_null(v);
    load_vectors(v, inp_path, out_path);
    assert_true(v->n >= 40);

    struct kvr_tok_scratch *s = NULL;
    assert_int_equal(kvr_tok_scratch_create(&s, t, 4096), 0);
    int32_t ids[1024];
    int n_bad = 0;
    for (int c = 0; c < v->n; c++) {
        int n = kvr_tok_encode(t, s, v->text[c], v->len[c], false, false, ids, 1024);
        bool same = n == v->n_ids[c] && memcmp(ids, v->ids[c], (size_t)n * sizeof *ids) == 0;
        if (!same) {
            n_bad++;
            int at = 0;
            while (at < n && at < v->n_ids[c] && ids[at] == v->ids[c][at])
                at++;
            print_message("case %d of %s differs at id index %d:\n", c, inp_rel, at);
            int from = at > 8 ? at - 8 : 0;
            print_escaped("input", v->text[c], v->len[c]);
            print_ids("want", v->ids[c], v->n_ids[c], from, at);
            print_ids("got ", ids, n, from, at);
        }
    }
    print_message("%s: %d of %d cases match\n", inp_rel, v->n - n_bad, v->n);
    assert_int_equal(n_bad, 0);
    kvr_tok_scratch_destroy(s);
    free_vectors(v);
    free(v);
    kvr_tok_destroy(t);
}

static void test_spm_vectors(void **state)
{
    (void)state;
    check_vectors("vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-llama-spm.gguf.inp",
                  "vocab/ggml-vocab-llama-spm.gguf.out");
}

static void test_gpt2_vectors(void **state)
{
    (void)state;
    check_vectors("vocab/ggml-vocab-gpt-2.gguf", "vocab/ggml-vocab-gpt-2.gguf.inp",
                  "vocab/ggml-vocab-gpt-2.gguf.out");
}

static void test_llama_bpe_vectors(void **state)
{
    (void)state;
    check_vectors("vocab/ggml-vocab-llama-bpe.gguf", "vocab/ggml-vocab-llama-bpe.gguf.inp",
                  "vocab/ggml-vocab-llama-bpe.gguf.out");
}

static void test_qwen2_vectors(void **state)
{
    (void)state;
    check_vectors("vocab/ggml-vocab-qwen2.gguf", "vocab/ggml-vocab-qwen2.gguf.inp",
                  "vocab/ggml-vocab-qwen2.gguf.out");
}

/* ---- decoding ---------------------------------------------------------------------------- */

/* Decode ids through a streaming detokenizer one id at a time into out. Checks that no push
 * ever emits an incomplete UTF-8 character. Returns the length. */
static size_t detok_all(const struct kvr_tok *t, const int32_t *ids, int n, bool text_start,
                        char *out, size_t cap)
{
    struct kvr_detok d;
    kvr_detok_init(&d, text_start, false);
    size_t m = 0, step = kvr_detok_max_bytes(t);
    for (int i = 0; i < n; i++) {
        assert_true(m + step <= cap);
        int k = kvr_detok_push(t, &d, ids[i], out + m, cap - m);
        assert_true(k >= 0);
        /* Whatever came out ends on a character boundary. */
        for (int j = k - 1; j >= 0 && j >= k - 4; j--) {
            unsigned char c = (unsigned char)out[m + (size_t)j];
            if ((c & 0xC0) == 0x80)
                continue;
            size_t need = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
            assert_int_equal(need, (size_t)(k - j));
            break;
        }
        m += (size_t)k;
    }
    int k = kvr_detok_flush(&d, out + m, cap - m);
    assert_true(k >= 0);
    return m + (size_t)k;
}

/* Decoding from the start of a text gives the text back (SPM strips the space its encoding
 * added; BPE must not strip anything). Every case of the four vocabularies round-trips, as
 * with llama.cpp. What cannot by design is not in them: SPM text containing U+2581 itself
 * (it decodes as a space) or a split-out special (SPM adds a space after it), and bytes
 * that are not UTF-8 (the streaming decoder turns them into U+FFFD). */
static void check_round_trip(const char *vocab_rel)
{
    struct kvr_tok *t = open_tok(vocab_rel);
    char inp_path[4096];
    snprintf(inp_path, sizeof inp_path, "%s.inp", kvr_test_shared(vocab_rel));
    char out_path[4096];
    snprintf(out_path, sizeof out_path, "%s.out", kvr_test_shared(vocab_rel));
    struct vectors *v = malloc(sizeof *v);
    assert_non_null(v);
    load_vectors(v, inp_path, out_path);
    struct kvr_tok_scratch *s = NULL;
    assert_int_equal(kvr_tok_scratch_create(&s, t, 4096), 0);
    int32_t ids[1025];
    static char text[1 << 16];
    for (int c = 0; c < v->n; c++) {
        /* With and without BOS in front: the leading-space strip must skip it. */
        for (int with_bos = 0; with_bos < 2; with_bos++) {
            int n = kvr_tok_encode(t, s, v->text[c], v->len[c], false, false, ids + 1, 1024);
            assert_true(n >= 0);
            const int32_t *p = ids + 1;
            if (with_bos && kvr_tok_bos(t) >= 0) {
                ids[0] = kvr_tok_bos(t);
                p = ids;
                n++;
            }
            size_t m = detok_all(t, p, n, true, text, sizeof text);
            if (m != v->len[c] || memcmp(text, v->text[c], m) != 0) {
                print_escaped("input  ", v->text[c], v->len[c]);
                print_escaped("decoded", text, m);
                fail_msg("case %d (%s BOS) does not round-trip", c, with_bos ? "with" : "no");
            }
        }
    }
    kvr_tok_scratch_destroy(s);
    free_vectors(v);
    free(v);
    kvr_tok_destroy(t);
}

static void test_spm_round_trip(void **state)
{
    (void)state;
    check_round_trip("vocab/ggml-vocab-llama-spm.gguf");
}

static void test_gpt2_round_trip(void **state)
{
    (void)state;
    check_round_trip("vocab/ggml-vocab-gpt-2.gguf");
}

static void test_llama_bpe_round_trip(void **state)
{
    (void)state;
    check_round_trip("vocab/ggml-vocab-llama-bpe.gguf");
}

static void test_qwen2_round_trip(void **state)
{
    (void)state;
    check_round_trip("vocab/ggml-vocab-qwen2.gguf");
}

static void test_spm_decode_pieces(void **state)
{
    (void)state;
    struct kvr_tok *t = open_tok("vocab/ggml-vocab-llama-spm.gguf");
    const char *p;
    size_t n;
    assert_int_equal(kvr_tok_n_vocab(t), 32000);
    assert_int_equal(kvr_tok_bos(t), 1);
    assert_int_equal(kvr_tok_eos(t), 2);
    assert_true(kvr_tok_add_bos(t));
    assert_false(kvr_tok_add_eos(t));
    assert_true(kvr_tok_is_eog(t, 2));
    assert_false(kvr_tok_is_eog(t, 1));
    assert_false(kvr_tok_is_eog(t, 15043));
    assert_int_equal(kvr_tok_type(t, 0), KVR_TOK_TYPE_UNKNOWN);
    assert_int_equal(kvr_tok_type(t, 1), KVR_TOK_TYPE_CONTROL);
    assert_int_equal(kvr_tok_type(t, 13), KVR_TOK_TYPE_BYTE);
    assert_int_equal(kvr_tok_type(t, 32000), KVR_TOK_TYPE_UNDEFINED);

    /* Raw pieces vs decoded text. */
    assert_int_equal(kvr_tok_piece(t, 15043, &p, &n), 0);
    assert_int_equal(n, 8);
    assert_memory_equal(p, "\xE2\x96\x81Hello", 8);
    assert_int_equal(kvr_tok_decode_piece(t, 15043, false, &p, &n), 0);
    assert_int_equal(n, 6);
    assert_memory_equal(p, " Hello", 6);
    assert_int_equal(kvr_tok_decode_piece(t, 13, false, &p, &n), 0); /* <0x0A> */
    assert_int_equal(n, 1);
    assert_int_equal(p[0], '\n');
    assert_int_equal(kvr_tok_decode_piece(t, 1, false, &p, &n), 0);
    assert_int_equal(n, 0);
    assert_int_equal(kvr_tok_decode_piece(t, 1, true, &p, &n), 0);
    assert_int_equal(n, 3);
    assert_memory_equal(p, "<s>", 3);
    assert_int_equal(kvr_tok_decode_piece(t, -1, false, &p, &n), KVR_EINVAL);
    assert_int_equal(kvr_tok_decode_piece(t, 32000, false, &p, &n), KVR_EINVAL);
    assert_int_equal(kvr_tok_find(t, "\xE2\x96\x81Hello", 8), 15043);
    assert_int_equal(kvr_tok_find(t, "no such piece at all", 20), -1);

    /* A whole sequence: the space added by encoding is gone after BOS, kept mid-text. */
    const int32_t seq[] = {1, 15043, 3186};
    char out[256];
    size_t m = detok_all(t, seq, 3, true, out, sizeof out);
    assert_int_equal(m, 11);
    assert_memory_equal(out, "Hello world", 11);
    m = detok_all(t, seq + 1, 2, false, out, sizeof out); /* a continuation keeps it */
    assert_int_equal(m, 12);
    assert_memory_equal(out, " Hello world", 12);
    /* Printing specials, "<s>" is the first piece and the space after it stays. */
    struct kvr_detok d;
    kvr_detok_init(&d, true, true);
    m = 0;
    for (int i = 0; i < 3; i++)
        m += (size_t)kvr_detok_push(t, &d, seq[i], out + m, sizeof out - m);
    assert_int_equal(m, 15);
    assert_memory_equal(out, "<s> Hello world", 15);
    kvr_tok_destroy(t);
}

static void test_streaming_utf8(void **state)
{
    (void)state;
    struct kvr_tok *t = open_tok("vocab/ggml-vocab-llama-spm.gguf");
    /* U+1F999 (llama emoji) as four byte tokens: <0xF0> <0x9F> <0xA6> <0x99>. */
    const int32_t llama[] = {243, 162, 169, 156};
    struct kvr_detok d;
    kvr_detok_init(&d, false, false);
    char out[64];
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvr_detok_push(t, &d, llama[i], out, sizeof out), 0);
    assert_int_equal(kvr_detok_push(t, &d, llama[3], out, sizeof out), 4);
    assert_memory_equal(out, "\xF0\x9F\xA6\x99", 4);
    assert_int_equal(kvr_detok_flush(&d, out, sizeof out), 0);

    /* Too small a buffer: refused, nothing consumed, then the same push succeeds. */
    kvr_detok_init(&d, false, false);
    for (int i = 0; i < 3; i++)
        assert_int_equal(kvr_detok_push(t, &d, llama[i], out, sizeof out), 0);
    assert_int_equal(kvr_detok_push(t, &d, llama[3], out, 3), KVR_EFULL);
    assert_int_equal(kvr_detok_push(t, &d, llama[3], out, 4), 4);

    /* A character cut short by a normal token: U+FFFD, then the token's text. */
    kvr_detok_init(&d, false, false);
    assert_int_equal(kvr_detok_push(t, &d, 243, out, sizeof out), 0); /* <0xF0> */
    assert_int_equal(kvr_detok_push(t, &d, 162, out, sizeof out), 0); /* <0x9F> */
    int k = kvr_detok_push(t, &d, 15043, out, sizeof out);            /* " Hello" */
    assert_int_equal(k, 3 + 6);
    assert_memory_equal(out, "\xEF\xBF\xBD Hello", 9);

    /* Leftovers at the end are flushed as one U+FFFD. */
    kvr_detok_init(&d, false, false);
    assert_int_equal(kvr_detok_push(t, &d, 228, out, sizeof out), 0); /* <0xE1> */
    assert_int_equal(kvr_detok_push(t, &d, 190, out, sizeof out), 0); /* <0xBB> */
    assert_int_equal(kvr_detok_flush(&d, out, 2), KVR_EFULL);
    assert_int_equal(kvr_detok_flush(&d, out, sizeof out), 3);
    assert_memory_equal(out, "\xEF\xBF\xBD", 3);
    assert_int_equal(kvr_detok_flush(&d, out, sizeof out), 0);

    /* Bytes that can never start a character, and an overlong lead. */
    kvr_detok_init(&d, false, false);
    assert_int_equal(kvr_detok_push(t, &d, 3 + 0x80, out, sizeof out), 3); /* <0x80> */
    assert_int_equal(kvr_detok_push(t, &d, 3 + 0xC0, out, sizeof out), 3); /* <0xC0> */
    assert_int_equal(kvr_detok_push(t, &d, 3 + 0xE0, out, sizeof out), 0); /* <0xE0> */
    /* E0 80 would be overlong: E0 alone becomes U+FFFD and 80 another. */
    assert_int_equal(kvr_detok_push(t, &d, 3 + 0x80, out, sizeof out), 6);
    assert_int_equal(kvr_detok_push(t, &d, 999999, out, sizeof out), KVR_EINVAL);
    kvr_tok_destroy(t);
}

/* ---- stories260K ------------------------------------------------------------------------- */

static void test_stories_prompt(void **state)
{
    (void)state;
    struct kvr_tok *t = open_tok("models/stories260K.gguf");
    json_error_t jerr;
    json_t *ref = json_load_file(kvr_test_shared("models/stories260K.reference.json"), 0, &jerr);
    assert_non_null(ref);
    const char *prompt = json_string_value(json_object_get(ref, "prompt"));
    json_t *want = json_object_get(ref, "prompt_ids");
    assert_non_null(prompt);
    assert_true(json_is_array(want));
    assert_true(json_is_true(json_object_get(ref, "add_bos")));
    assert_true(kvr_tok_add_bos(t));

    struct kvr_tok_scratch *s = NULL;
    assert_int_equal(kvr_tok_scratch_create(&s, t, 256), 0);
    int32_t ids[64];
    int n = kvr_tok_encode(t, s, prompt, strlen(prompt), true, false, ids, 64);
    assert_int_equal(n, (int)json_array_size(want));
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 403);
    assert_int_equal(ids[2], 407);
    for (int i = 0; i < n; i++)
        assert_int_equal(ids[i], json_integer_value(json_array_get(want, (size_t)i)));

    /* The generated ids decode to text without breaking any character. */
    json_t *gen = json_object_get(ref, "generated_ids");
    int32_t g[128];
    int n_gen = (int)json_array_size(gen);
    assert_true(n_gen > 0 && n_gen <= 128);
    for (int i = 0; i < n_gen; i++)
        g[i] = (int32_t)json_integer_value(json_array_get(gen, (size_t)i));
    char text[8192];
    size_t m = detok_all(t, g, n_gen, false, text, sizeof text);
    assert_true(m > 0);
    json_decref(ref);
    kvr_tok_scratch_destroy(s);
    kvr_tok_destroy(t);
}

/* ---- specials, limits, errors ------------------------------------------------------------ */

static void test_spm_special_and_limits(void **state)
{
    (void)state;
    struct kvr_tok *t = open_tok("vocab/ggml-vocab-llama-spm.gguf");
    struct kvr_tok_scratch *s = NULL;
    assert_int_equal(kvr_tok_scratch_create(&s, t, 64), 0);
    assert_int_equal(kvr_tok_scratch_max_text(s), 64);
    int32_t ids[64];

    /* Empty text: nothing, or only BOS. */
    assert_int_equal(kvr_tok_encode(t, s, "", 0, false, false, ids, 64), 0);
    assert_int_equal(kvr_tok_encode(t, s, "", 0, true, false, ids, 64), 1);
    assert_int_equal(ids[0], 1);

    /* Parsed specials split the text; the text after one gets its own leading space. */
    int n = kvr_tok_encode(t, s, "Hello</s><s>world", 17, true, true, ids, 64);
    assert_int_equal(n, 5);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 15043); /* "▁Hello" */
    assert_int_equal(ids[2], 2);
    assert_int_equal(ids[3], 1);
    assert_int_equal(ids[4], 3186); /* "▁world" */
    /* Unparsed, "</s>" is plain text and no id 2 appears. */
    n = kvr_tok_encode(t, s, "Hello</s>", 9, false, false, ids, 64);
    assert_true(n > 1);
    for (int i = 0; i < n; i++)
        assert_int_not_equal(ids[i], 2);

    /* Output too small, text too long. */
    assert_int_equal(kvr_tok_encode(t, s, "Hello world", 11, true, false, ids, 2), KVR_EFULL);
    char big[65];
    memset(big, 'a', sizeof big);
    assert_int_equal(kvr_tok_encode(t, s, big, 65, false, false, ids, 64), KVR_ERANGE);

    /* Invalid UTF-8 is encoded byte by byte and decodes back to the same bytes. */
    n = kvr_tok_encode(t, s, "a\xFF\xC3", 3, false, false, ids, 64);
    assert_true(n >= 3);
    assert_int_equal(ids[n - 2], 3 + 0xFF);
    assert_int_equal(ids[n - 1], 3 + 0xC3);
    kvr_tok_scratch_destroy(s);
    kvr_tok_destroy(t);
}

static struct kvr_gguf_str S(const char *s) {
    return (struct kvr_gguf_str){strlen(s), s};
}

static void
expect_create_error(const struct kvr_tok_vocab *v, int code, const char *needle)
{
    struct kvr_tok *t = NULL;
    struct kvr_err err = {0};
    int rc = kvr_tok_create_from_vocab(&t, v, &err);
    if (rc != code || !strstr(err.msg, needle))
        fail_msg("expected %d containing '%s', got %d: %s", code, needle, rc, err.msg);
    assert_null(t);
}

static void test_vocab_validation(void **state)
{
    (void)state;
    struct kvr_gguf_str toks[6] = {S("<unk>"), S("<s>"), S("</s>"), S("a"), S("b"), S("ab")};
    float scores[6] = {0, 0, 0, -1, -2, -3};
    int32_t types[6] = {2, 3, 3, 1, 1, 1};
    struct kvr_tok_vocab v;
    kvr_tok_vocab_init(&v, KVR_TOK_SPM);
    v.n_tokens = 6;
    v.tokens = toks;
    v.scores = scores;
    v.types = types;

    struct kvr_tok *t = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_tok_create_from_vocab(&t, &v, &err), 0);
    struct kvr_tok_scratch *s = NULL;
    assert_int_equal(kvr_tok_scratch_create(&s, t, 16), 0);
    int32_t ids[16];
    /* No "▁" piece and no byte tokens: the prefix space falls back to <unk> per byte. */
    int n = kvr_tok_encode(t, s, "ab", 2, false, false, ids, 16);
    assert_int_equal(n, 4);
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[3], 5);
    kvr_tok_scratch_destroy(s);
    kvr_tok_destroy(t);

    v.bos_id = 6;
    expect_create_error(&v, KVR_EFORMAT, "bos id 6 out of range");
    v.bos_id = 0xFFFFFFFFll; /* "none" as GGUF files write it, but BOS is added */
    expect_create_error(&v, KVR_EFORMAT, "no BOS id");
    v.add_bos = 0;
    assert_int_equal(kvr_tok_create_from_vocab(&t, &v, &err), 0);
    assert_int_equal(kvr_tok_bos(t), -1);
    kvr_tok_destroy(t);
    v.bos_id = 1;
    v.add_bos = -1;

    types[4] = 9;
    expect_create_error(&v, KVR_EFORMAT, "token 4 has unknown type 9");
    types[4] = KVR_TOK_TYPE_BYTE;
    expect_create_error(&v, KVR_EFORMAT, "not of the form <0xXX>");
    types[4] = 1;

    scores[3] = NAN;
    expect_create_error(&v, KVR_EFORMAT, "NaN score");
    scores[3] = -1;

    toks[5] = S("a");
    expect_create_error(&v, KVR_EFORMAT, "token 5 'a' duplicates token 3");
    toks[5] = S("ab");

    v.n_tokens = 0;
    expect_create_error(&v, KVR_ERANGE, "0 tokens");
    v.n_tokens = 6;

    /* BPE merges must name pieces. */
    struct kvr_gguf_str merges[2] = {S("a b"), S("b a")};
    v.kind = KVR_TOK_BPE;
    v.n_merges = 2;
    v.merges = merges;
    expect_create_error(&v, KVR_EFORMAT, "merge 1 'b a': 'ba' is not in the vocabulary");
    merges[1] = S("ab");
    expect_create_error(&v, KVR_EFORMAT, "merge 1 'ab' has no space");
    v.n_merges = 1;
    assert_int_equal(kvr_tok_create_from_vocab(&t, &v, &err), 0);
    kvr_tok_destroy(t);

    /* Allocation failures at every step are reported, never crash or leak. */
    v.kind = KVR_TOK_SPM;
    for (long k = 0; k < 32; k++) {
        kvr_alloc_fail_after(k);
        int rc = kvr_tok_create_from_vocab(&t, &v, &err);
        kvr_alloc_fail_after(-1);
        if (rc == 0) {
            kvr_tok_destroy(t);
            break;
        }
        assert_int_equal(rc, KVR_ENOMEM);
        assert_null(t);
    }
}

/* ---- GGUF keys ---------------------------------------------------------------------------- */

enum fault {
    F_NONE,
    F_NO_MODEL,
    F_MODEL_BERT,
    F_MODEL_NOT_STRING,
    F_NO_TOKENS,
    F_TOKENS_NOT_STRINGS,
    F_SCORES_SHORT,
    F_SCORES_NOT_F32,
    F_TYPES_NOT_I32,
    F_TYPES_LONG,
    F_BOS_RANGE,
    F_BOS_FLOAT,
    F_ADD_BOS_NOT_BOOL,
    F_GPT2_NO_MERGES,
    F_GPT2_PRE_UNKNOWN,
    F_GPT2_NO_PRE,
    F_GPT2_OK,
    F_COUNT
};

/* A small vocabulary written as a GGUF image (malloc'd), with one fault injected. */
static char *gguf_with(enum fault f, size_t *len)
{
    struct kvr_gguf_str toks[4] = {S("<unk>"), S("<s>"), S("</s>"), S("\xE2\x96\x81")};
    struct kvr_gguf_str bpe_toks[4] = {S("a"), S("b"), S("ab"), S("<|endoftext|>")};
    struct kvr_gguf_str merges[1] = {S("a b")};
    const float scores[4] = {0, 0, 0, -1};
    const int32_t types[5] = {2, 3, 3, 1, 1};
    const int32_t bpe_types[4] = {1, 1, 1, 3};
    bool bpe = f >= F_GPT2_NO_MERGES;
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    assert_non_null(w);
    if (f == F_MODEL_NOT_STRING)
        kvr_gguf_writer_add_u32(w, "tokenizer.ggml.model", 1);
    else if (f != F_NO_MODEL)
        kvr_gguf_writer_add_str(w, "tokenizer.ggml.model",
                                f == F_MODEL_BERT ? "bert"
                                : bpe             ? "gpt2"
                                                  : "llama");
    if (bpe && f != F_GPT2_NO_PRE)
        kvr_gguf_writer_add_str(w, "tokenizer.ggml.pre",
                                f == F_GPT2_PRE_UNKNOWN ? "no-such-pre" : "gpt-2");
    if (f == F_TOKENS_NOT_STRINGS)
        kvr_gguf_writer_add_arr(w, "tokenizer.ggml.tokens", KVR_GGUF_TYPE_INT32, 4, types);
    else if (f != F_NO_TOKENS)
        kvr_gguf_writer_add_str_arr(w, "tokenizer.ggml.tokens", 4, bpe ? bpe_toks : toks);
    if (!bpe) {
        if (f == F_SCORES_NOT_F32)
            kvr_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVR_GGUF_TYPE_INT32, 4, types);
        else
            kvr_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVR_GGUF_TYPE_FLOAT32,
                                    f == F_SCORES_SHORT ? 3 : 4, scores);
    }
    if (f == F_TYPES_NOT_I32)
        kvr_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVR_GGUF_TYPE_FLOAT32, 4, scores);
    else
        kvr_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVR_GGUF_TYPE_INT32,
                                f == F_TYPES_LONG ? 5 : 4, bpe ? bpe_types : types);
    if (bpe && f != F_GPT2_NO_MERGES)
        kvr_gguf_writer_add_str_arr(w, "tokenizer.ggml.merges", 1, merges);
    if (f == F_BOS_FLOAT)
        kvr_gguf_writer_add_f32(w, "tokenizer.ggml.bos_token_id", 1.0f);
    else
        kvr_gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id",
                                f == F_BOS_RANGE ? 7
                                : bpe            ? 3
                                                 : 1);
    kvr_gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", bpe ? 3 : 2);
    kvr_gguf_writer_add_u32(w, "tokenizer.ggml.padding_token_id", 0xFFFFFFFFu);
    if (f == F_ADD_BOS_NOT_BOOL)
        kvr_gguf_writer_add_u32(w, "tokenizer.ggml.add_bos_token", 1);
    char *buf = NULL;
    FILE *mf = open_memstream(&buf, len);
    assert_non_null(mf);
    struct kvr_err err = {0};
    if (kvr_gguf_writer_write(w, mf, &err) != 0)
        fail_msg("writing the test GGUF: %s", err.msg);
    fclose(mf);
    kvr_gguf_writer_destroy(w);
    return buf;
}

static void test_gguf_keys(void **state)
{
    (void)state;
    static const struct {
        enum fault f;
        int code;
        const char *needle;
    } cases[] = {
        {F_NONE, 0, ""},
        {F_NO_MODEL, KVR_EFORMAT, "tokenizer.ggml.model: missing"},
        {F_MODEL_BERT, KVR_ENOTSUP, "'bert' is not supported"},
        {F_MODEL_NOT_STRING, KVR_EFORMAT, "tokenizer.ggml.model"},
        {F_NO_TOKENS, KVR_EFORMAT, "tokenizer.ggml.tokens: missing"},
        {F_TOKENS_NOT_STRINGS, KVR_EFORMAT, "tokenizer.ggml.tokens: not a string array"},
        {F_SCORES_SHORT, KVR_EFORMAT, "tokenizer.ggml.scores: 3 scores for 4 tokens"},
        {F_SCORES_NOT_F32, KVR_EFORMAT, "tokenizer.ggml.scores: not a float32 array"},
        {F_TYPES_NOT_I32, KVR_EFORMAT, "tokenizer.ggml.token_type: not an int32 array"},
        {F_TYPES_LONG, KVR_EFORMAT, "tokenizer.ggml.token_type: 5 types for 4 tokens"},
        {F_BOS_RANGE, KVR_EFORMAT, "bos id 7 out of range (vocab 4)"},
        {F_BOS_FLOAT, KVR_EFORMAT, "tokenizer.ggml.bos_token_id: expected an integer"},
        {F_ADD_BOS_NOT_BOOL, KVR_EFORMAT, "tokenizer.ggml.add_bos_token"},
        {F_GPT2_NO_MERGES, KVR_EFORMAT, "tokenizer.ggml.merges: missing"},
        {F_GPT2_PRE_UNKNOWN, KVR_ENOTSUP,
         "tokenizer.ggml.pre: 'no-such-pre' is not supported (supported: gpt-2, llama-bpe, "},
        {F_GPT2_NO_PRE, KVR_ENOTSUP, "tokenizer.ggml.pre: missing"},
        {F_GPT2_OK, 0, ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len;
        char *img = gguf_with(cases[i].f, &len);
        struct kvr_gguf *g = NULL;
        struct kvr_err err = {0};
        if (kvr_gguf_open_mem(&g, img, len, &err) != 0)
            fail_msg("case %zu: the test GGUF does not open: %s", i, err.msg);
        struct kvr_tok *t = NULL;
        int rc = kvr_tok_create(&t, g, &err);
        if (rc != cases[i].code || (rc && !strstr(err.msg, cases[i].needle)))
            fail_msg("case %zu: expected %d '%s', got %d '%s'", i, cases[i].code, cases[i].needle,
                     rc, rc ? err.msg : "");
        if (rc == 0) {
            assert_int_equal(kvr_tok_n_vocab(t), 4);
            assert_int_equal(kvr_tok_kind(t), cases[i].f == F_GPT2_OK ? KVR_TOK_BPE : KVR_TOK_SPM);
            kvr_tok_destroy(t);
        } else {
            assert_null(t);
        }
        kvr_gguf_close(g);
        free(img);
    }
}

/* ---- speed ------------------------------------------------------------------------------- */

/* CPU time of this thread: unlike the wall clock, it does not grow while the thread waits
 * for a core, so a bound on it holds on a loaded machine too. */
static double cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* One encode's CPU time; n_want < 0: any token count. */
static double encode_cpu_ms(const struct kvr_tok *t, struct kvr_tok_scratch *s, const char *text,
                            size_t len, int n_want)
{
    static int32_t ids[1 << 17];
    double t0 = cpu_ms();
    int k = kvr_tok_encode(t, s, text, len, true, false, ids, 1 << 17);
    double dt = cpu_ms() - t0;
    assert_true(k > 0);
    if (n_want >= 0)
        assert_int_equal(k, n_want);
    return dt;
}

/* How the encode time of `full` grows against that of its quarter `part`: `pairs` pairs
 * taken one after the other, each one encode of full and the mean of four encodes of part
 * (the same span of time), and the pair whose full - 8 x part is the median is returned.
 * Linear work gives full ~ 4 x part, a rule quadratic in the length 16 x. This host's CPU
 * speed changes by up to 2x in spells of seconds, which CPU time does not hide: taken apart
 * (the best of several encodes of full, then of part) a spell over one side alone once made
 * a linear pre-tokenizer read 8.5x under ASan; within a pair both sides share the spell, and
 * the median drops a pair a spell's edge cuts through. */
static void linear_pair(const struct kvr_tok *t, struct kvr_tok_scratch *s, const char *full,
                        size_t full_len, int n_want, const char *part, size_t part_len, int pairs,
                        double *full_ms, double *part_ms)
{
    enum { MAX_PAIRS = 9 };
    double f[MAX_PAIRS], q[MAX_PAIRS], excess[MAX_PAIRS];
    assert_true(pairs >= 1 && pairs <= MAX_PAIRS);
    for (int i = 0; i < pairs; i++) {
        f[i] = encode_cpu_ms(t, s, full, full_len, n_want);
        q[i] = 0;
        for (int k = 0; k < 4; k++)
            q[i] += encode_cpu_ms(t, s, part, part_len, -1) / 4;
        excess[i] = f[i] - 8.0 * q[i];
    }
    int order[MAX_PAIRS]; /* the pairs by excess (insertion sort) */
    for (int i = 0; i < pairs; i++) {
        int j = i;
        for (; j > 0 && excess[order[j - 1]] > excess[i]; j--)
            order[j] = order[j - 1];
        order[j] = i;
    }
    int median = order[pairs / 2];
    *full_ms = f[median];
    *part_ms = q[median];
}

/* The longest prefix of text[0, len) that does not cut a UTF-8 character. */
static size_t utf8_prefix(const char *text, size_t len)
{
    while (len > 0 && ((unsigned char)text[len] & 0xC0) == 0x80)
        len--;
    return len;
}

static void check_speed(const char *vocab_rel)
{
    struct kvr_tok *t = open_tok(vocab_rel);
    char inp_path[4096];
    snprintf(inp_path, sizeof inp_path, "%s.inp", kvr_test_shared(vocab_rel));
    size_t n_inp;
    char *inp = kvr_test_read_file(inp_path, &n_inp);
    assert_non_null(inp);
    /* A prompt of about 1,500 tokens made of the (varied, multilingual) test inputs. */
    static char text[1 << 16];
    size_t len = 0;
    struct kvr_tok_scratch *s = NULL;
    assert_int_equal(kvr_tok_scratch_create(&s, t, sizeof text), 0);
    static int32_t ids[1 << 14];
    int n = 0;
    while (n < 1500) {
        size_t take = n_inp < sizeof text - len ? n_inp : sizeof text - len;
        assert_true(take > 0);
        memcpy(text + len, inp, take);
        len += take;
        n = kvr_tok_encode(t, s, text, len, true, false, ids, 1 << 14);
        assert_true(n > 0);
    }
    /* Linear work: a quarter of the text takes about a quarter of the time. A bound on the
     * ratio of two CPU times taken side by side holds on a loaded machine, where an
     * absolute bound does not; a rule quadratic in the text's length gives 16x. */
    double full, quarter;
    size_t quarter_len = utf8_prefix(text, len / 4);
    linear_pair(t, s, text, len, n, text, quarter_len, 5, &full, &quarter);
    print_message("%s: %d tokens from %zu bytes, %.3f ms CPU (a quarter: %.3f ms)\n", vocab_rel, n,
                  len, full, quarter);
    assert_true(full < 8.0 * quarter + 2.0);
    free(inp);
    kvr_tok_scratch_destroy(s);
    kvr_tok_destroy(t);
}

static void test_encode_speed(void **state)
{
    (void)state;
    check_speed("vocab/ggml-vocab-llama-spm.gguf");
    check_speed("vocab/ggml-vocab-gpt-2.gguf");
    check_speed("vocab/ggml-vocab-llama-bpe.gguf");
    check_speed("vocab/ggml-vocab-qwen2.gguf");
}

/* ---- pre-tokenizers ------------------------------------------------------------------------ */

/* The Llama 3 vocabulary with tokenizer.ggml.pre set to `pre` (written to memory, opened
 * through the GGUF path). */
static struct kvr_tok *llama_bpe_as(const char *pre)
{
    const char *path = kvr_test_shared("vocab/ggml-vocab-llama-bpe.gguf");
    struct kvr_gguf *src = NULL, *g = NULL;
    struct kvr_err err = {0};
    if (kvr_gguf_open(&src, path, &err) != 0)
        fail_msg("open %s: %s", path, err.msg);
    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    assert_non_null(w);
    for (int64_t i = 0; i < kvr_gguf_n_kv(src); i++) {
        if (!strcmp(kvr_gguf_kv_key(src, i), "tokenizer.ggml.pre"))
            kvr_gguf_writer_add_str(w, "tokenizer.ggml.pre", pre);
        else
            kvr_gguf_writer_copy_kv(w, src, i);
    }
    char *buf = NULL;
    size_t len = 0;
    FILE *mf = open_memstream(&buf, &len);
    assert_non_null(mf);
    assert_int_equal(kvr_gguf_writer_write(w, mf, &err), 0);
    fclose(mf);
    kvr_gguf_writer_destroy(w);
    kvr_gguf_close(src);
    assert_int_equal(kvr_gguf_open_mem(&g, buf, len, &err), 0);
    struct kvr_tok *t = NULL;
    if (kvr_tok_create(&t, g, &err) != 0)
        fail_msg("pre %s: %s", pre, err.msg);
    kvr_gguf_close(g);
    free(buf);
    return t;
}

/* One name of each row of the table (tokenizer_pre.c). */
static const char *const pre_rows[] = {
    "gpt-2",     "llama-bpe", "dbrx",   "qwen2",       "deepseek-llm", "deepseek-coder", "falcon",
    "starcoder", "bloom",     "viking", "deepseek-v3", "gpt-4o",       "kimi-k2",        "default"};

/* A 100 kB text of one of several shapes, each the worst case of some rule: long runs of
 * one class (one huge word), white space that never ends a word, many tiny words. */
static size_t hostile_text(int shape, char *out, size_t cap)
{
    static const char *const units[] = {
        "Hello, world! It's 2024: 3.14159 apples \xE2\x80\x94 \xE4\xBD\xA0\xE5\xA5\xBD\n",
        "a",
        " ",
        "1",
        "\xE4\xB8\x80",
        "!?",
        "a ",
        " \t\n",
        "\xF0\x9F\xA6\x99"};
    const char *u = units[shape];
    size_t n = strlen(u), m = 0;
    while (m + n <= cap) {
        memcpy(out + m, u, n);
        m += n;
    }
    if (shape == 2 && m > 0)
        out[m - 1] = 'x'; /* a space run that does not end the text */
    return m;
}

#define N_SHAPES 9

static void test_pre_speed(void **state)
{
    (void)state;
    enum { LEN = 100000 };
    static char text[LEN];
    static char quarter_text[LEN / 4];
    for (size_t r = 0; r < sizeof pre_rows / sizeof pre_rows[0]; r++) {
        struct kvr_tok *t = llama_bpe_as(pre_rows[r]);
        struct kvr_tok_scratch *s = NULL;
        assert_int_equal(kvr_tok_scratch_create(&s, t, LEN), 0);
        double worst = 0, worst_quarter = 0;
        int worst_shape = 0;
        for (int shape = 0; shape < N_SHAPES; shape++) {
            size_t len = hostile_text(shape, text, LEN);
            size_t qlen = hostile_text(shape, quarter_text, LEN / 4);
            double full, quarter;
            linear_pair(t, s, text, len, -1, quarter_text, qlen, 3, &full, &quarter);
            /* Linear work: the 100 kB text costs about 4x its 25 kB version (a rule
             * quadratic in a run's length, 16x). Both CPU times are taken side by side, so
             * the bound holds on a loaded machine; the constant covers timer noise on
             * texts of a few ms. */
            if (full > 8.0 * quarter + 5.0)
                fail_msg("pre %s shape %d: 100 kB %.1f ms CPU, 25 kB %.1f ms: not linear",
                         pre_rows[r], shape, full, quarter);
            if (full > worst) {
                worst = full;
                worst_quarter = quarter;
                worst_shape = shape;
            }
        }
        print_message("pre %-15s slowest of %d 100 kB texts: shape %d, %.1f ms CPU (25 kB: %.1f)\n",
                      pre_rows[r], N_SHAPES, worst_shape, worst, worst_quarter);
        kvr_tok_scratch_destroy(s);
        kvr_tok_destroy(t);
    }
}

/* Encode `text` (no BOS) and compare with `want`, showing both on a mismatch. */
static void expect_ids(struct kvr_tok *t, const char *text, bool special, const int32_t *want,
                       int n_want)
{
    struct kvr_tok_scratch *s = NULL;
    assert_int_equal(kvr_tok_scratch_create(&s, t, 4096), 0);
    int32_t ids[256];
    int n = kvr_tok_encode(t, s, text, strlen(text), false, special, ids, 256);
    bool same = n == n_want && memcmp(ids, want, (size_t)n * sizeof *ids) == 0;
    if (!same) {
        print_escaped("input", text, strlen(text));
        print_ids("want", want, n_want, 0, -1);
        print_ids("got ", ids, n, 0, -1);
        fail_msg("ids differ");
    }
    kvr_tok_scratch_destroy(s);
}

static void test_pre_rules(void **state)
{
    (void)state;
    /* Reference ids from llama.cpp's llama-tokenize on the same vocabulary and name. */
    struct kvr_tok *l3 = llama_bpe_as("llama-bpe"), *q2 = llama_bpe_as("qwen2");
    struct kvr_tok *sc = llama_bpe_as("starcoder"), *g2 = llama_bpe_as("gpt-2");
    /* 1-3 digit groups (Llama 3), single digits (Qwen 2, StarCoder), runs (GPT-2). */
    expect_ids(l3, "12345", false, (const int32_t[]){4513, 1774}, 2);
    expect_ids(q2, "12345", false, (const int32_t[]){16, 17, 18, 19, 20}, 5);
    expect_ids(sc, "12345", false, (const int32_t[]){16, 17, 18, 19, 20}, 5);
    expect_ids(g2, "12345", false, (const int32_t[]){4513, 1774}, 2);
    /* GPT-4o: a word breaks before an upper-case letter that follows a lower-case one, an
     * upper-case run ends at its last letter outside ASCII ("INFORMAÇÃ" "O"), and [\r\n/]*
     * after punctuation goes on past a newline ("//\n/" "x"). */
    struct kvr_tok *g4 = llama_bpe_as("gpt-4o");
    expect_ids(g4, "getElementById", false, (const int32_t[]){456, 1726, 1383, 769}, 4);
    expect_ids(g4, "iPhone", false, (const int32_t[]){72, 7084}, 2);
    expect_ids(g4, "INFORMA\xC3\x87\xC3\x83O", false,
               (const int32_t[]){691, 11052, 32, 47013, 19321, 46}, 6);
    expect_ids(g4, "a//\n/x", false, (const int32_t[]){64, 2341, 14, 87}, 4);
    kvr_tok_destroy(g4);
    /* Kimi K2: a Han run is a word of its own (the space before it too), other letters
     * run on across a change of case. */
    struct kvr_tok *kk = llama_bpe_as("kimi-k2");
    expect_ids(kk, "Hello \xE4\xBD\xA0\xE5\xA5\xBD", false,
               (const int32_t[]){9906, 220, 57668, 53901}, 4);
    expect_ids(kk, "getElementById", false, (const int32_t[]){76757, 2787}, 2);
    kvr_tok_destroy(kk);
    kvr_tok_destroy(l3);
    kvr_tok_destroy(q2);
    kvr_tok_destroy(sc);
    kvr_tok_destroy(g2);
}

static void test_specials_and_eog(void **state)
{
    (void)state;
    struct kvr_tok *t = open_tok("vocab/ggml-vocab-llama-bpe.gguf");
    /* As llama.cpp's llama-tokenize --no-bos gives them. */
    const char *chat = "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>";
    expect_ids(t, chat, true, (const int32_t[]){128006, 882, 128007, 271, 13347, 128009}, 6);
    /* Unparsed, control tokens are text. */
    struct kvr_tok_scratch *s = NULL;
    assert_int_equal(kvr_tok_scratch_create(&s, t, 256), 0);
    int32_t ids[256];
    int n = kvr_tok_encode(t, s, chat, strlen(chat), false, false, ids, 256);
    assert_true(n > 6);
    for (int i = 0; i < n; i++)
        assert_true(ids[i] < 128000);
    kvr_tok_scratch_destroy(s);
    /* End of generation: EOS, and the end-of-turn pieces. */
    assert_true(kvr_tok_add_bos(t));
    assert_int_equal(kvr_tok_eos(t), 128001);
    assert_true(kvr_tok_is_eog(t, 128001));
    assert_true(kvr_tok_is_eog(t, kvr_tok_find(t, "<|eot_id|>", 10)));
    assert_false(kvr_tok_is_eog(t, 128000));
    assert_false(kvr_tok_is_eog(t, kvr_tok_find(t, "<|end_header_id|>", 17)));
    assert_false(kvr_tok_is_eog(t, 13347));
    kvr_tok_destroy(t);

    /* Qwen: <think> is user-defined, split out even unparsed; <|im_end|> is the EOS. */
    t = open_tok("vocab/ggml-vocab-qwen2.gguf");
    assert_false(kvr_tok_add_bos(t));
    const char *q = "<|im_start|>user\nHi <think>x</think><|im_end|>";
    expect_ids(t, q, true,
               (const int32_t[]){151644, 872, 198, 13048, 220, 151667, 87, 151668, 151645}, 9);
    expect_ids(t, q, false,
               (const int32_t[]){27, 91, 318, 4906, 91, 29, 872, 198, 13048, 220, 151667, 87,
                                 151668, 27, 91, 318, 6213, 91, 29},
               19);
    assert_true(kvr_tok_is_eog(t, 151645));
    assert_true(kvr_tok_is_eog(t, kvr_tok_find(t, "<|endoftext|>", 13)));
    assert_false(kvr_tok_is_eog(t, 151644));
    kvr_tok_destroy(t);

    /* The EOT/EOM ids of the file count too, and so do the known end-of-turn pieces. */
    struct kvr_gguf_str toks[8] = {S("a"),          S("b"),
                                   S("<x>"),        S("<y>"),
                                   S("<|eom_id|>"), S("<end_of_turn>"),
                                   S("<|im_sep|>"), S("<|end_of_text|>")};
    struct kvr_tok_vocab v;
    kvr_tok_vocab_init(&v, KVR_TOK_BPE);
    v.n_tokens = 8;
    v.tokens = toks;
    v.eot_id = 2;
    v.eom_id = 3;
    struct kvr_err err = {0};
    assert_int_equal(kvr_tok_create_from_vocab(&t, &v, &err), 0);
    assert_true(kvr_tok_is_eog(t, 2));
    assert_true(kvr_tok_is_eog(t, 3));
    assert_true(kvr_tok_is_eog(t, 4));
    assert_true(kvr_tok_is_eog(t, 5));
    assert_false(kvr_tok_is_eog(t, 6));
    assert_true(kvr_tok_is_eog(t, 7));
    assert_false(kvr_tok_is_eog(t, 1));
    assert_false(kvr_tok_is_eog(t, -1));
    assert_false(kvr_tok_is_eog(t, 8));
    kvr_tok_destroy(t);
}

/* The classes the pre-tokenizers use, against the Unicode character database. */
static void test_unicode_classes(void **state)
{
    (void)state;
    /* ASCII is classified without the table: it must agree with the table. */
    for (uint32_t c = 0; c < 0x80; c++) {
        size_t lo = 0, hi = kvr_ucat_n_runs;
        while (hi - lo > 1) {
            size_t mid = lo + (hi - lo) / 2;
            if (kvr_ucat_runs[mid] >> 3 <= c)
                lo = mid;
            else
                hi = mid;
        }
        if ((enum kvr_ucat)(kvr_ucat_runs[lo] & 7) != kvr_cp_ucat(c))
            fail_msg("U+%04X: table %u, fast path %d", c, kvr_ucat_runs[lo] & 7,
                     (int)kvr_cp_ucat(c));
    }
    static const struct {
        uint32_t cp;
        enum kvr_ucat cat;
    } cases[] = {
        {'A', KVR_UCAT_LETTER},     {'_', KVR_UCAT_PUNCT},      {'$', KVR_UCAT_SYMBOL},
        {'`', KVR_UCAT_SYMBOL},     {0xB5, KVR_UCAT_LETTER},    {0xD7, KVR_UCAT_SYMBOL},
        {0x0301, KVR_UCAT_MARK},    {0x0663, KVR_UCAT_NUMBER},  {0x2160, KVR_UCAT_NUMBER},
        {0x00BD, KVR_UCAT_NUMBER},  {0x2014, KVR_UCAT_PUNCT},   {0x3002, KVR_UCAT_PUNCT},
        {0x4E00, KVR_UCAT_LETTER},  {0x9FFF, KVR_UCAT_LETTER},  {0x20000, KVR_UCAT_LETTER},
        {0xAC00, KVR_UCAT_LETTER},  {0x1F999, KVR_UCAT_SYMBOL}, {0x3000, KVR_UCAT_SEPARATOR},
        {0x200B, KVR_UCAT_OTHER},   {0xE000, KVR_UCAT_OTHER},   {0x0378, KVR_UCAT_OTHER},
        {0x10FFFF, KVR_UCAT_OTHER}, {0x110000, KVR_UCAT_OTHER}, {0x0E31, KVR_UCAT_MARK},
        {0x01C5, KVR_UCAT_LETTER},  {0x02B0, KVR_UCAT_LETTER},  {0xFF01, KVR_UCAT_PUNCT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (kvr_cp_ucat(cases[i].cp) != cases[i].cat)
            fail_msg("U+%04X: category %d, want %d", cases[i].cp, (int)kvr_cp_ucat(cases[i].cp),
                     (int)cases[i].cat);
    static const uint32_t spaces[] = {0x09,   0x0A,   0x0B,   0x0C,   0x0D,   0x20,
                                      0x85,   0xA0,   0x1680, 0x2000, 0x200A, 0x2028,
                                      0x2029, 0x202F, 0x205F, 0x3000};
    for (size_t i = 0; i < sizeof spaces / sizeof spaces[0]; i++)
        assert_true(kvr_cp_is_space(spaces[i]));
    static const uint32_t not_spaces[] = {0x08, 0x1C, 0x1F, 0x200B, 0x180E, 0xFEFF, 'a'};
    for (size_t i = 0; i < sizeof not_spaces / sizeof not_spaces[0]; i++)
        assert_false(kvr_cp_is_space(not_spaces[i]));
    assert_int_equal(kvr_cp_class(0x3000), KVR_CP_SPACE);
    assert_int_equal(kvr_cp_class(0x0301), KVR_CP_OTHER);
    assert_int_equal(kvr_cp_class(0x2460), KVR_CP_NUMBER);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spm_vectors),       cmocka_unit_test(test_spm_round_trip),
        cmocka_unit_test(test_spm_decode_pieces), cmocka_unit_test(test_streaming_utf8),
        cmocka_unit_test(test_stories_prompt),    cmocka_unit_test(test_spm_special_and_limits),
        cmocka_unit_test(test_vocab_validation),  cmocka_unit_test(test_gguf_keys),
        cmocka_unit_test(test_gpt2_vectors),      cmocka_unit_test(test_gpt2_round_trip),
        cmocka_unit_test(test_llama_bpe_vectors), cmocka_unit_test(test_llama_bpe_round_trip),
        cmocka_unit_test(test_qwen2_vectors),     cmocka_unit_test(test_qwen2_round_trip),
        cmocka_unit_test(test_pre_speed),         cmocka_unit_test(test_pre_rules),
        cmocka_unit_test(test_specials_and_eog),  cmocka_unit_test(test_unicode_classes),
        cmocka_unit_test(test_encode_speed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
