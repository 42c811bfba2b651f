/* fuzz_grammar.c - libFuzzer target for the GBNF compiler and the matcher.
 *
 * Input: a grammar's text, a NUL byte, then text to match (no NUL: all grammar, no text).
 * The grammar is compiled; if it compiles, the text is fed one byte at a time, and at each
 * step the mask over a small fixed vocabulary must agree with feeding each token to a copy.
 * Invariants checked (a violation traps): compile fails with a message or succeeds; a
 * refused byte leaves the state as it was (same stacks, same completeness); a mask bit is
 * set exactly when its token (or, for the end token, completeness or a dead end) allows. */
#include "core/alloc.h"
#include "model/grammar.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "fuzz_grammar: %s failed at line %d\n", #c, __LINE__);                 \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

static const char *const vocab[] = {"a",        "b",  "ab", "{",   "}",    "\"",
                                    " ",        "0",  "12", "x\"", "\xc3", "\xa9",
                                    "\xc3\xa9", "\n", "[",  "]",   "<end>"};
#define NV ((int32_t)(sizeof vocab / sizeof *vocab))

static void check_mask(struct kvr_grammar_match *m, struct kvr_grammar_match *c,
                       const struct kvr_grammar_vocab *v)
{
    uint32_t bits[1];
    int32_t n = kvr_grammar_mask(m, v, bits);
    if (n < 0)
        return; /* out of memory */
    int32_t count = 0;
    bool any_text = false;
    for (int32_t t = 0; t < NV - 1; t++) {
        if (kvr_grammar_match_copy(c, m))
            return;
        bool ok = !kvr_grammar_accept_token(c, v, t);
        CHECK(ok == ((bits[0] >> t) & 1));
        count += ok;
        any_text |= ok;
    }
    bool end = (bits[0] >> (NV - 1)) & 1;
    CHECK(end == (kvr_grammar_match_complete(m) || !any_text));
    CHECK(n == count + end);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t glen = nul ? (size_t)(nul - data) : size;
    struct kvr_grammar *g = NULL;
    struct kvr_err err = {0};
    if (kvr_grammar_compile(&g, (const char *)data, glen, &err)) {
        CHECK(err.msg[0] != 0);
        return 0;
    }
    struct kvr_grammar_vocab *v = NULL;
    size_t lens[NV];
    bool eog[NV] = {0};
    for (int32_t i = 0; i < NV; i++)
        lens[i] = strlen(vocab[i]);
    eog[NV - 1] = true;
    struct kvr_grammar_match *m = NULL, *c = NULL;
    if (kvr_grammar_vocab_create_bytes(&v, NV, vocab, lens, eog, NULL) ||
        kvr_grammar_match_create(&m, g) || kvr_grammar_match_create(&c, g))
        goto done;
    const uint8_t *text = nul ? nul + 1 : data + size;
    size_t tlen = nul ? size - glen - 1 : 0;
    for (size_t i = 0; i < tlen && i < 256; i++) {
        if (i < 16)
            check_mask(m, c, v);
        uint32_t before = kvr_grammar_match_n_stacks(m);
        bool complete = kvr_grammar_match_complete(m);
        if (kvr_grammar_match_bytes(m, text + i, 1)) {
            CHECK(kvr_grammar_match_n_stacks(m) == before);
            CHECK(kvr_grammar_match_complete(m) == complete);
        }
    }
done:
    kvr_grammar_match_destroy(c);
    kvr_grammar_match_destroy(m);
    kvr_grammar_vocab_destroy(v);
    kvr_grammar_destroy(g);
    return 0;
}
