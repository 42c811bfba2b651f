/* tokenizer_pre.h - the byte-level BPE pre-tokenizers, chosen by tokenizer.ggml.pre.
 *
 * Before BPE merges anything, the text is split into words by a pattern, and merges never
 * cross a word boundary. Each vocabulary family was trained with its own pattern (its
 * tokenizer.json "pre_tokenizer"), and llama.cpp names them in tokenizer.ggml.pre. A
 * pre-tokenizer here is a row of a table: its names (aliases that use the same rules), up
 * to six rules applied one after another, and two flags.
 *
 * A rule is one regular expression of such a pattern, matched by a hand-written scanner
 * (tokenizer_pre.c). Applying a rule to a piece of text splits it, as the regex "split"
 * of the tokenizers library and llama.cpp do: every match becomes a word, and so does
 * each stretch of text between matches. The next rule splits each word again on its own
 * (a lookahead or $ sees the end of that word, not of the text).
 *
 * Internal to the tokenizer. The table is constant: thread-safe, no state. */
#ifndef KVR_MODEL_TOKENIZER_PRE_H
#define KVR_MODEL_TOKENIZER_PRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVR_PRE_MAX_RULES 6

struct kvr_pre {
    const char *const *names; /* NULL-terminated; names[0] is the canonical one */
    uint8_t n_rules;
    uint8_t rules[KVR_PRE_MAX_RULES]; /* enum pre_rule in tokenizer_pre.c */
    /* A word that is a piece of the vocabulary as a whole becomes that token, without any
     * merge (Llama 3's tokenizer.json sets "ignore_merges"). */
    bool ignore_merges;
    /* Add BOS when the file has no tokenizer.ggml.add_bos_token. */
    bool add_bos;
};

/* The pre-tokenizer named `name` (len bytes, any of its aliases), or NULL. */
const struct kvr_pre *kvr_pre_find(const char *name, size_t len);

/* The pre-tokenizer used when a caller names none (kvr_tok_vocab.pre empty): GPT-2's. */
const struct kvr_pre *kvr_pre_gpt2(void);

/* The i-th accepted name (rows in table order, aliases after the first), NULL past the
 * last. */
const char *kvr_pre_name(size_t i);

/* Write the names, ", "-separated and NUL-terminated, to buf (cut to fit cap): every
 * accepted name with `aliases`, else the first name of each row. */
void kvr_pre_list(char *buf, size_t cap, bool aliases);

/* Split code points cps[0..n) into words. `a` and `b` each hold n + 1 entries; the result is
 * in one of them: returns it, with the words' end offsets (exclusive, increasing, the last
 * one n) and their count in *n_words. Linear in n for every rule. */
const uint32_t *kvr_pre_split(const struct kvr_pre *p, const uint32_t *cps, size_t n, uint32_t *a,
                              uint32_t *b, size_t *n_words);

#endif
