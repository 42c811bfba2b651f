/* draft.h - where drafted tokens come from (issue 37): lookups, no draft model.
 *
 * Speculation (spec_policy.h) asks for up to k tokens that a sequence is likely to produce
 * next; the tail verifies them (model/spec_accept.h). Three sources, asked in this order:
 *   PREDICTION  the client's expected output (OpenAI's `prediction`), tokenized: the
 *               answer so far is aligned with it by its last tokens, and what follows the
 *               alignment is proposed (from its start while the answer is empty);
 *   PROMPT      prompt lookup: the longest recent n-gram ending the prompt + answer that
 *               also occurs earlier in them; what followed it is proposed;
 *   SUFFIX      the same n-gram looked up in recent answers of other requests: a bounded
 *               ring of their tokens with a hash index of their n-grams.
 * A lookup matches the last max_n .. min_n tokens (longest first), and proposes the tokens
 * that followed the chosen occurrence: for PREDICTION the one nearest the answer's length
 * (where an aligned answer would be), else the latest.
 *
 * Pure: no I/O, no clock, no globals. struct kvr_draft_suffix owns its arrays
 * (kvr_draft_suffix_init allocates them, _fini frees them); the lookups borrow their inputs.
 * One thread at a time (the scheduler's caller). */
#ifndef KVR_BRIDGE_DRAFT_H
#define KVR_BRIDGE_DRAFT_H

#include "core/err.h"

#include <stdint.h>

enum kvr_draft_source {
    KVR_DRAFT_PREDICTION,
    KVR_DRAFT_PROMPT,
    KVR_DRAFT_SUFFIX,
    KVR_DRAFT_SOURCE_COUNT
};

/* "prediction", "prompt_lookup", "suffix" (metric labels). */
const char *kvr_draft_source_name(enum kvr_draft_source src);

/* A text in two parts (prompt, then answer), read as one. */
struct kvr_draft_text {
    const int32_t *a;
    uint32_t n_a;
    const int32_t *b;
    uint32_t n_b;
};

/* n-gram lengths the lookups try, longest first. */
enum { KVR_DRAFT_MAX_N = 4, KVR_DRAFT_MIN_N = 2 };

/* PREDICTION: tokens of pred[0..n_pred) after the answer's alignment, into out (at most
 * max_k). Returns how many. */
uint32_t kvr_draft_prediction(const int32_t *pred, uint32_t n_pred, const int32_t *answer,
                              uint32_t n_answer, uint32_t max_k, int32_t *out);

/* PROMPT: the tokens that followed the latest earlier occurrence of the text's last n-gram. */
uint32_t kvr_draft_prompt(const struct kvr_draft_text *t, uint32_t max_k, int32_t *out);

/* SUFFIX: recent answers, at most `cap_tokens` tokens of them (older ones are overwritten),
 * indexed by their KVR_DRAFT_MIN_N-grams in a table of `index_slots` entries (a newer
 * n-gram with the same hash replaces an older one: lossy, bounded). */
struct kvr_draft_suffix {
    int32_t *toks;   /* [cap] ring of answers' tokens, -1 between answers */
    uint32_t cap;    /* a power of two */
    uint64_t n;      /* tokens ever appended; toks[i % cap] for i in [n - cap, n) */
    uint64_t *index; /* [index_slots] 1 + the position after an n-gram, 0: empty */
    uint32_t index_slots;
};

int kvr_draft_suffix_init(struct kvr_draft_suffix *sx, uint32_t cap_tokens, uint32_t index_slots,
                          struct kvr_err *err);
void kvr_draft_suffix_fini(struct kvr_draft_suffix *sx);
/* Remember an answer (its last cap / 4 tokens at most). */
void kvr_draft_suffix_add(struct kvr_draft_suffix *sx, const int32_t *answer, uint32_t n);
/* The tokens that followed the text's last KVR_DRAFT_MIN_N-gram in a remembered answer,
 * up to that answer's end. */
uint32_t kvr_draft_suffix_propose(const struct kvr_draft_suffix *sx, const struct kvr_draft_text *t,
                                  uint32_t max_k, int32_t *out);

#endif
