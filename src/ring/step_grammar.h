/* step_grammar.h - the tail's constrained sequences (DESIGN.md 3: the sampler lives at the
 * tail, so the grammar does too). Per sequence slot: the GBNF text as GRAMMAR records bring
 * it (wire.h), then its compiled grammar and matcher; one vocabulary trie for them all,
 * built from the tokenizer when the first grammar arrives.
 *
 * Before the sampler: kvr_step_grammar_mask sets the logits of every token the grammar
 * refuses to -inf (an end-of-generation token is allowed once the text is complete). After
 * it: kvr_step_grammar_accept advances the matcher by the chosen token, and REPLAY ids go
 * the same way, so a re-opened sequence's grammar state is rebuilt from its tokens like the
 * sampler's. A sequence's mask depends only on its own tokens: batch invariance holds.
 *
 * A text that does not compile (the bridge compiled it first, so this is a broken peer or
 * a bug) is logged and leaves the sequence unconstrained.
 *
 * Ownership: everything is allocated by the module; kvr_step_grammars_fini frees it.
 * Threads: the stage's compute thread only. No I/O and no clock, as step.h. */
#ifndef KVR_RING_STEP_GRAMMAR_H
#define KVR_RING_STEP_GRAMMAR_H

#include "core/err.h"
#include "model/grammar.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "ring/wire.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_step_grammar_seq {
    char *text; /* [total] while pieces arrive, then kept while a spare may take it */
    uint32_t total, received;
    struct kvr_grammar *grammar;
    struct kvr_grammar_match *match;
};

/* Most closed sequences' grammars kept for reuse: a request with the same grammar text
 * (an agent's tools, a client's schema) takes the compiled grammar and its matcher with
 * the masks it remembers, instead of compiling and walking the vocabulary afresh. */
#define KVR_STEP_GRAMMAR_SPARES 4u

struct kvr_step_grammar_spare {
    char *text; /* NULL: an empty slot */
    uint32_t total;
    uint64_t used; /* when it was last closed, for eviction */
    struct kvr_grammar *grammar;
    struct kvr_grammar_match *match;
};

struct kvr_step_grammars {
    const struct kvr_tok *tok; /* borrowed */
    uint32_t max_seqs;
    struct kvr_step_grammar_seq *seqs; /* [max_seqs] */
    struct kvr_grammar_vocab *vocab;   /* built on first use */
    uint64_t n_masks;                  /* rows masked so far */
    struct kvr_step_grammar_spare spares[KVR_STEP_GRAMMAR_SPARES];
    uint64_t clock;
    uint64_t n_reused; /* grammars taken from the spares */
};

int kvr_step_grammars_init(struct kvr_step_grammars *g, uint32_t max_seqs,
                           const struct kvr_tok *tok, struct kvr_err *err);
void kvr_step_grammars_fini(struct kvr_step_grammars *g);
/* Drop a slot's grammar (OPEN, FREE, CANCEL, a reset). */
void kvr_step_grammar_close(struct kvr_step_grammars *g, uint32_t seq);
/* One GRAMMAR record of `seq` (checked by the codec); the last one compiles the text. */
void kvr_step_grammar_piece(struct kvr_step_grammars *g, uint32_t seq,
                            const struct kvr_wire_grammar *rec, uint32_t stage);
bool kvr_step_grammar_active(const struct kvr_step_grammars *g, uint32_t seq);
/* Mask a row of n_vocab logits in place. KVR_ENOMEM. */
int kvr_step_grammar_mask(struct kvr_step_grammars *g, uint32_t seq, float *logits,
                          uint32_t n_vocab);
/* kvr_spec_verify (model/spec_accept.h) for a constrained sequence: row j is masked with
 * the grammar's state after the tokens emitted before it, so every emitted token is the
 * one a plain decode would sample, and the matcher advances by each. logits (rows
 * n_drafts + 1) are masked in place. Returns the tokens emitted (1..n_drafts + 1), or
 * KVR_EINVAL (a row with no finite logit), or KVR_ENOMEM. */
int32_t kvr_step_grammar_verify(struct kvr_step_grammars *g, uint32_t seq, struct kvr_sampler *s,
                                float *logits, uint32_t n_vocab, const int32_t *drafts,
                                uint32_t n_drafts, struct kvr_sample_scratch *sc, int32_t *out);
/* Advance by a token the sequence took (sampled, or replayed). A token the grammar refuses
 * (only a replay of tokens from before a broken peer could bring one) is logged and
 * ignored. */
void kvr_step_grammar_accept(struct kvr_step_grammars *g, uint32_t seq, int32_t token);

#endif
