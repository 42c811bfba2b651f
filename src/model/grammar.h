/* grammar.h - constrained decoding: a GBNF grammar compiled once, matched per sequence, and
 * turned into a mask over the vocabulary before each sample.
 *
 * Grammar text: llama.cpp's GBNF.
 *     # a comment to the end of the line
 *     root  ::= "{" ws pair ("," ws pair)* "}"        rules: name ::= alternatives
 *     pair  ::= [a-z]+ ":" ws value                    sequences, | alternation, ( groups )
 *     value ::= "yes" | "no" | [0-9]{1,3} | .          * + ? {m} {m,} {m,n}; . any character
 *     ws    ::= [ \t\n]*                               [a-z] ranges, [^"\\] negation
 * Names are [A-Za-z0-9_-]+. Literals and classes take \n \r \t \\ \" \' \[ \] \- \^ \/
 * \xHH \uHHHH \UHHHHHHHH. A rule ends where the next `name ::=` starts (newlines are
 * blanks), so an alternative may continue on the next line. The start rule is `root`.
 * Refused with a message naming line and column: undefined rules, a rule defined twice,
 * left recursion (a rule reaching itself before any character, which no stack machine can
 * expand; this includes a repetition of an item that can match the empty text, such as
 * ("a"?)*: write ("a")* instead), and anything past the limits below.
 *
 * Matching works on Unicode code points; tokens bring bytes, which are decoded as UTF-8 as
 * they come, so a character may be split across tokens. The state is a set of stacks (one
 * per way the text so far can continue), each stack the positions still to match in the
 * rules entered; a rule's last item is entered by replacing its frame, so repetition does
 * not grow a stack. The text so far is complete when one stack is empty.
 *
 * Masks: struct kvr_grammar_vocab is a trie of every token's decoded bytes, built once per
 * vocabulary; kvr_grammar_mask walks it with the stacks, so a subtree is skipped at its
 * first byte the grammar refuses. A matcher keeps the masks of the last states it saw
 * (KVR_GRAMMAR_CACHE): states recur (every character inside a JSON string is the same
 * state), so a repeated state's mask costs a lookup. A new state's mask is put together
 * from its stacks' top parts (every frame but the bottom one), each walked once and
 * remembered (KVR_GRAMMAR_TOP_CACHE, grammar_top.c): the 100 items of a JSON array differ
 * only in their bottom frame, so the first item's walks serve the others. Same masks as
 * walking the whole state. End-of-generation tokens are allowed exactly when the text is
 * complete.
 *
 * Ownership: a struct kvr_grammar is immutable after compile and may be shared by any number
 * of matchers and threads; a matcher belongs to one thread at a time and must not outlive
 * its grammar; a vocab is immutable, shared, and must not outlive the tokenizer it came
 * from. Pure: no I/O, no globals. */
#ifndef KVR_MODEL_GRAMMAR_H
#define KVR_MODEL_GRAMMAR_H

#include "core/err.h"
#include "model/tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Limits on what a grammar may be (compile refuses more with KVR_ERANGE). */
#define KVR_GRAMMAR_MAX_TEXT_BYTES (256u * 1024u)
#define KVR_GRAMMAR_MAX_RULES 8192u         /* named and generated (groups, repetitions) */
#define KVR_GRAMMAR_MAX_ELEMENTS (1u << 19) /* after repetitions are expanded */
#define KVR_GRAMMAR_MAX_NESTING 64u         /* parentheses inside one another */
#define KVR_GRAMMAR_MAX_REPEAT 10000u       /* m and n of {m,n} */
/* Limits on a matcher's state: a stack deeper than MAX_DEPTH frames is dropped (nesting
 * beyond it is refused), and MAX_STACKS bounds an ambiguous grammar's live alternatives. */
#define KVR_GRAMMAR_MAX_DEPTH 512u
#define KVR_GRAMMAR_MAX_STACKS 1024u
/* Masks one matcher remembers. */
#define KVR_GRAMMAR_CACHE 32u
/* Top parts of stacks whose masks one matcher remembers (grammar_top.c). */
#define KVR_GRAMMAR_TOP_CACHE 256u

struct kvr_grammar;

/* Compile `len` bytes of GBNF. KVR_EFORMAT (syntax, undefined or duplicate rule, left
 * recursion, no `root`) or KVR_ERANGE (a limit) with a message "grammar: line L col C: ...";
 * KVR_ENOMEM. */
int kvr_grammar_compile(struct kvr_grammar **out, const char *text, size_t len,
                        struct kvr_err *err);
void kvr_grammar_destroy(struct kvr_grammar *g);
uint32_t kvr_grammar_n_rules(const struct kvr_grammar *g);

/* ---- matching ------------------------------------------------------------------------- */

struct kvr_grammar_match;

/* A matcher at the start of the grammar. */
int kvr_grammar_match_create(struct kvr_grammar_match **out, const struct kvr_grammar *g);
void kvr_grammar_match_destroy(struct kvr_grammar_match *m);
/* Back to the start. */
void kvr_grammar_match_reset(struct kvr_grammar_match *m);
/* Make `dst` (a matcher of the same grammar) equal to `src`. KVR_ENOMEM. */
int kvr_grammar_match_copy(struct kvr_grammar_match *dst, const struct kvr_grammar_match *src);
/* Advance by one code point / by bytes of UTF-8 (a character may end in a later call).
 * KVR_EINVAL if the grammar refuses it (or the bytes are not UTF-8): the state is then
 * unchanged. */
int kvr_grammar_match_cp(struct kvr_grammar_match *m, uint32_t cp);
int kvr_grammar_match_bytes(struct kvr_grammar_match *m, const void *bytes, size_t n);
/* The text so far is a whole sentence of the grammar (no character half-read). */
bool kvr_grammar_match_complete(const struct kvr_grammar_match *m);
/* Live stacks (0: nothing can follow, not even the end). */
uint32_t kvr_grammar_match_n_stacks(const struct kvr_grammar_match *m);

/* ---- masks over a vocabulary ----------------------------------------------------------- */

struct kvr_grammar_vocab;

/* The trie of a tokenizer's tokens as they decode (kvr_tok_decode_piece without specials);
 * tokens that decode to nothing never match, end-of-generation tokens are marked. */
int kvr_grammar_vocab_create(struct kvr_grammar_vocab **out, const struct kvr_tok *tok,
                             struct kvr_err *err);
/* The same from arrays (tests): token i is bytes[i][0..lens[i]); eog may be NULL. */
int kvr_grammar_vocab_create_bytes(struct kvr_grammar_vocab **out, int32_t n_vocab,
                                   const char *const *bytes, const size_t *lens, const bool *eog,
                                   struct kvr_err *err);
void kvr_grammar_vocab_destroy(struct kvr_grammar_vocab *v);
int32_t kvr_grammar_vocab_n(const struct kvr_grammar_vocab *v);

/* The tokens the grammar allows next as bits: token i is allowed iff bit (i % 32) of
 * bits[i / 32] is set; bits has (n_vocab + 31) / 32 words. A token is allowed when its
 * bytes can follow the text so far, an end-of-generation token when the text is complete.
 * Returns the number of allowed tokens, or KVR_ENOMEM. */
int32_t kvr_grammar_mask(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                         uint32_t *bits);
/* Set logits[i] = -inf for every token the mask refuses (n_vocab values). Returns the
 * number of allowed tokens (0: the sampler would find no finite logit), or KVR_ENOMEM. */
int32_t kvr_grammar_apply(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                          float *logits, int32_t n_vocab);
/* Advance by a chosen token: its bytes, or for an end-of-generation token nothing (it must
 * come when the text is complete). KVR_EINVAL if the grammar refuses it (state unchanged). */
int kvr_grammar_accept_token(struct kvr_grammar_match *m, const struct kvr_grammar_vocab *v,
                             int32_t id);

/* Time spent in kvr_grammar_mask (ns) and masks computed vs served from the cache, summed
 * over the matcher's life, for benchmarks. The clock is the caller's: pass its readings. */
struct kvr_grammar_stats {
    uint64_t n_masks;                   /* kvr_grammar_mask calls */
    uint64_t n_cached;                  /* ... answered from the cache */
    uint64_t n_plain;                   /* ... that walked the whole trie from the whole state */
    uint64_t n_top_walks, n_top_cached; /* top parts of stacks walked, and found walked */
};
void kvr_grammar_match_stats(const struct kvr_grammar_match *m, struct kvr_grammar_stats *st);

#endif
