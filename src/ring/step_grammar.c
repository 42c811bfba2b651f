/* step_grammar.c - the tail's constrained sequences (see step_grammar.h). */
#include "ring/step_grammar.h"

#include "core/alloc.h"
#include "core/log.h"

#include <string.h>

int kvr_step_grammars_init(struct kvr_step_grammars *g, uint32_t max_seqs,
                           const struct kvr_tok *tok, struct kvr_err *err)
{
    memset(g, 0, sizeof *g);
    g->tok = tok;
    g->max_seqs = max_seqs;
    if (!(g->seqs = kvr_calloc(max_seqs, sizeof *g->seqs)))
        return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory for grammar slots");
    return KVR_OK;
}

static void free_spare(struct kvr_step_grammar_spare *sp)
{
    kvr_free(sp->text);
    kvr_grammar_match_destroy(sp->match);
    kvr_grammar_destroy(sp->grammar);
    memset(sp, 0, sizeof *sp);
}

void kvr_step_grammars_fini(struct kvr_step_grammars *g)
{
    for (uint32_t q = 0; g->seqs && q < g->max_seqs; q++)
        kvr_step_grammar_close(g, q);
    for (uint32_t i = 0; i < KVR_STEP_GRAMMAR_SPARES; i++)
        free_spare(&g->spares[i]);
    kvr_free(g->seqs);
    kvr_grammar_vocab_destroy(g->vocab);
    memset(g, 0, sizeof *g);
}

void kvr_step_grammar_close(struct kvr_step_grammars *g, uint32_t seq)
{
    if (!g->seqs || seq >= g->max_seqs)
        return;
    struct kvr_step_grammar_seq *s = &g->seqs[seq];
    if (s->match && s->text) { /* keep it for a later request with the same text */
        struct kvr_step_grammar_spare *sp = &g->spares[0];
        for (uint32_t i = 1; i < KVR_STEP_GRAMMAR_SPARES; i++)
            if (g->spares[i].used < sp->used)
                sp = &g->spares[i];
        free_spare(sp);
        *sp = (struct kvr_step_grammar_spare){.text = s->text,
                                              .total = s->total,
                                              .used = ++g->clock,
                                              .grammar = s->grammar,
                                              .match = s->match};
        memset(s, 0, sizeof *s);
        return;
    }
    kvr_free(s->text);
    kvr_grammar_match_destroy(s->match);
    kvr_grammar_destroy(s->grammar);
    memset(s, 0, sizeof *s);
}

/* Take a spare compiled from the same text, its matcher back at the start. */
static bool take_spare(struct kvr_step_grammars *g, struct kvr_step_grammar_seq *s)
{
    for (uint32_t i = 0; i < KVR_STEP_GRAMMAR_SPARES; i++) {
        struct kvr_step_grammar_spare *sp = &g->spares[i];
        if (!sp->text || sp->total != s->total || memcmp(sp->text, s->text, s->total))
            continue;
        kvr_free(s->text);
        s->text = sp->text;
        s->grammar = sp->grammar;
        s->match = sp->match;
        kvr_grammar_match_reset(s->match);
        memset(sp, 0, sizeof *sp);
        g->n_reused++;
        return true;
    }
    return false;
}

/* Compile a slot's whole text and start its matcher. */
static void compile_seq(struct kvr_step_grammars *g, uint32_t seq, uint32_t stage)
{
    struct kvr_step_grammar_seq *s = &g->seqs[seq];
    struct kvr_err err = {0};
    if (!g->vocab && g->tok && kvr_grammar_vocab_create(&g->vocab, g->tok, &err)) {
        KVR_ERROR("stage %u: sequence %u: %s", stage, seq, err.msg);
        return;
    }
    if (!g->vocab) {
        KVR_ERROR("stage %u: sequence %u: a grammar needs the tokenizer", stage, seq);
        return;
    }
    if (take_spare(g, s))
        return;
    if (kvr_grammar_compile(&s->grammar, s->text, s->total, &err) ||
        kvr_grammar_match_create(&s->match, s->grammar)) {
        KVR_ERROR("stage %u: sequence %u: its grammar is left out: %s", stage, seq,
                  err.msg[0] ? err.msg : "out of memory");
        kvr_grammar_destroy(s->grammar);
        s->grammar = NULL;
        kvr_free(s->text);
        s->text = NULL;
    }
}

void kvr_step_grammar_piece(struct kvr_step_grammars *g, uint32_t seq,
                            const struct kvr_wire_grammar *rec, uint32_t stage)
{
    if (!g->seqs || seq >= g->max_seqs)
        return;
    struct kvr_step_grammar_seq *s = &g->seqs[seq];
    if (rec->offset == 0) {
        kvr_step_grammar_close(g, seq);
        if (!(s->text = kvr_malloc(rec->total))) {
            KVR_ERROR("stage %u: sequence %u: out of memory for its grammar", stage, seq);
            return;
        }
        s->total = rec->total;
    }
    if (!s->text || rec->total != s->total || rec->offset != s->received) {
        KVR_ERROR("stage %u: sequence %u: grammar piece at %u of %u out of order", stage, seq,
                  rec->offset, rec->total);
        kvr_step_grammar_close(g, seq);
        return;
    }
    uint32_t n = s->total - s->received;
    n = n < KVR_WIRE_GRAMMAR_BYTES ? n : KVR_WIRE_GRAMMAR_BYTES;
    memcpy(s->text + s->received, rec->text, n);
    s->received += n;
    if (s->received == s->total)
        compile_seq(g, seq, stage);
}

bool kvr_step_grammar_active(const struct kvr_step_grammars *g, uint32_t seq)
{
    return g->seqs && seq < g->max_seqs && g->seqs[seq].match;
}

int kvr_step_grammar_mask(struct kvr_step_grammars *g, uint32_t seq, float *logits,
                          uint32_t n_vocab)
{
    if (!kvr_step_grammar_active(g, seq))
        return KVR_OK;
    int32_t n = kvr_grammar_apply(g->seqs[seq].match, g->vocab, logits, (int32_t)n_vocab);
    g->n_masks++;
    return n < 0 ? n : KVR_OK;
}

void kvr_step_grammar_accept(struct kvr_step_grammars *g, uint32_t seq, int32_t token)
{
    if (!kvr_step_grammar_active(g, seq))
        return;
    if (kvr_grammar_accept_token(g->seqs[seq].match, g->vocab, token))
        KVR_WARN("sequence %u: token %d does not follow its grammar", seq, token);
}

int32_t kvr_step_grammar_verify(struct kvr_step_grammars *g, uint32_t seq, struct kvr_sampler *s,
                                float *logits, uint32_t n_vocab, const int32_t *drafts,
                                uint32_t n_drafts, struct kvr_sample_scratch *sc, int32_t *out)
{
    for (uint32_t j = 0; j <= n_drafts; j++) {
        float *row = logits + (size_t)j * n_vocab;
        if (kvr_step_grammar_mask(g, seq, row, n_vocab))
            return KVR_ENOMEM;
        int32_t y = kvr_sampler_sample(s, row, (int32_t)n_vocab, sc, NULL);
        if (y < 0)
            return y;
        kvr_sampler_accept(s, y);
        kvr_step_grammar_accept(g, seq, y);
        out[j] = y;
        if (j == n_drafts || y != drafts[j])
            return (int32_t)j + 1;
    }
    return (int32_t)n_drafts + 1; /* not reached: j == n_drafts returns */
}
