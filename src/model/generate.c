/* generate.c - prefill then decode in one process (see generate.h). */
#include "model/generate.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "model/engine.h"

#include <math.h>
#include <string.h>

#define KV_BLOCK_TOKENS 16

static struct kvr_engine_config
engine_config(const struct kvr_hparams *hp, const struct kvr_generate_config *cfg, uint32_t n_seqs)
{
    return (struct kvr_engine_config){.first_layer = 0,
                                      .last_layer = hp->n_layer - 1,
                                      .max_rows = cfg->row_width,
                                      .max_seqs = n_seqs,
                                      .n_ctx = cfg->n_ctx,
                                      .kv_block_tokens = KV_BLOCK_TOKENS,
                                      .kv_n_blocks = 0,
                                      .kv_type = cfg->kv_type,
                                      .n_threads = cfg->n_threads};
}

/* ---- one sequence after another ------------------------------------------------------------ */

/* Prefill the prompt in chunks of the row width; the last chunk leaves its logits in
 * `logits`. */
static int prefill(struct kvr_engine *e, const struct kvr_generate_seq *s, uint32_t row_width,
                   float *logits, struct kvr_err *err)
{
    for (uint32_t pos = 0; pos < s->n_ids;) {
        uint32_t n = s->n_ids - pos < row_width ? s->n_ids - pos : row_width;
        bool last = pos + n == s->n_ids;
        struct kvr_seg seg = {
            0, pos, n, KVR_SEG_PREFILL | (last ? KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN : 0)};
        int rc = kvr_engine_forward(e, &seg, 1, s->ids + pos, NULL, logits, err);
        if (rc)
            return rc;
        pos += n;
    }
    return 0;
}

/* A sequence's grammar matcher and the vocabulary trie it masks with (both NULL for a
 * free sequence). */
struct constraint {
    struct kvr_grammar_vocab *vocab; /* destroyed by the function that made it */
    struct kvr_grammar_match *match;
};

/* Build the vocabulary trie once if any sequence has a grammar. */
static int vocab_for(const struct kvr_tok *tok, const struct kvr_generate_seq *seqs, uint32_t n,
                     struct kvr_grammar_vocab **out, struct kvr_err *err)
{
    *out = NULL;
    for (uint32_t i = 0; i < n; i++)
        if (seqs[i].grammar)
            return kvr_grammar_vocab_create(out, tok, err);
    return KVR_OK;
}

/* Mask, sample, advance the grammar: the tail's order (ring/step.c). */
static int32_t sample_constrained(struct kvr_sampler *smp, const struct constraint *c,
                                  float *logits, int32_t n_vocab, struct kvr_sample_scratch *sc)
{
    if (c->match && kvr_grammar_apply(c->match, c->vocab, logits, n_vocab) < 0)
        return KVR_ENOMEM;
    int32_t id = kvr_sampler_sample(smp, logits, n_vocab, sc, NULL);
    if (id >= 0 && c->match)
        (void)kvr_grammar_accept_token(c->match, c->vocab, id); /* the mask allowed it */
    return id;
}

/* The alternatives a sequence asked for at its n_out-th token, from the raw row (before a
 * grammar's mask, as the tail does); returns the row's log-sum-exp for report_logprobs. */
static double top_logprobs(struct kvr_generate_seq *s, const float *logits, int32_t n_vocab)
{
    if (!s->logprobs)
        return 0.0;
    uint32_t k = s->top && s->n_top <= KVR_LOGPROBS_MAX_TOP ? s->n_top : 0;
    struct kvr_token_logprob *top = k ? s->top + (size_t)s->n_out * k : NULL;
    double lse = 0.0;
    int n = kvr_logprobs_top(logits, n_vocab, k, top, &lse);
    for (int j = n < 0 ? 0 : n; j < (int)k; j++)
        top[j] = (struct kvr_token_logprob){-1, -INFINITY};
    return n < 0 ? NAN : lse;
}

/* The logprob of the token it then sampled (its logit is one the mask kept). */
static void report_logprobs(struct kvr_generate_seq *s, const float *logits, int32_t id, double lse)
{
    if (!s->logprobs)
        return;
    s->logprobs[s->n_out] = isnan(lse) ? -INFINITY : kvr_logprobs_token(logits, id, lse);
}

/* Sample a token from `logits`, feed it back, repeat until the sequence ends. */
static int decode(struct kvr_engine *e, const struct kvr_hparams *hp, const struct kvr_tok *tok,
                  const struct kvr_generate_config *cfg, struct kvr_generate_seq *s, uint32_t index,
                  struct kvr_sampler *smp, const struct constraint *con,
                  struct kvr_sample_scratch *sc, float *logits, kvr_generate_token_fn on_token,
                  void *ud, struct kvr_generate_stats *st, struct kvr_err *err)
{
    s->finish = KVR_GENERATE_LENGTH;
    for (uint32_t k = 0; k < s->max_tokens; k++) {
        double lse = top_logprobs(s, logits, (int32_t)hp->n_vocab);
        int32_t id = sample_constrained(smp, con, logits, (int32_t)hp->n_vocab, sc);
        if (id < 0) /* no finite logit: a broken model or weights, never a token id */
            return kvr_err_set(err, id, "sequence %u: no finite logit at token %u", index, k);
        kvr_sampler_accept(smp, id);
        report_logprobs(s, logits, id, lse);
        s->out[s->n_out++] = id;
        if (on_token)
            on_token(ud, index, id);
        if (!cfg->ignore_eos && kvr_tok_is_eog(tok, id)) {
            s->finish = KVR_GENERATE_STOP;
            break;
        }
        if (k + 1 == s->max_tokens)
            break;
        struct kvr_seg seg = {0, s->n_ids + k, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
        uint64_t t0 = kvr_now_ns();
        int rc = kvr_engine_forward(e, &seg, 1, &id, NULL, logits, err);
        if (rc)
            return rc;
        st->decode_ns += kvr_now_ns() - t0;
        st->n_decode++;
    }
    return 0;
}

int kvr_generate(const struct kvr_gguf *g, const struct kvr_hparams *hp, const struct kvr_tok *tok,
                 const struct kvr_generate_config *cfg, struct kvr_generate_seq *seqs,
                 uint32_t n_seqs, kvr_generate_token_fn on_token, void *ud,
                 struct kvr_generate_stats *stats, struct kvr_err *err)
{
    memset(stats, 0, sizeof *stats);
    struct kvr_engine_config ec = engine_config(hp, cfg, 1);
    struct kvr_engine *e = NULL;
    struct kvr_sample_scratch *sc = NULL;
    struct constraint con = {0};
    float *logits = kvr_malloc((size_t)hp->n_vocab * sizeof(float));
    int rc = logits ? kvr_engine_create(&e, g, &ec, err) : KVR_ENOMEM;
    if (rc == 0 && kvr_sample_scratch_create(&sc, (int32_t)hp->n_vocab))
        rc = KVR_ENOMEM;
    if (rc == 0)
        rc = vocab_for(tok, seqs, n_seqs, &con.vocab, err);
    for (uint32_t i = 0; rc == 0 && i < n_seqs; i++) {
        struct kvr_generate_seq *s = &seqs[i];
        struct kvr_sampler smp;
        kvr_grammar_match_destroy(con.match);
        con.match = NULL;
        if (s->grammar && (rc = kvr_grammar_match_create(&con.match, s->grammar)))
            break;
        rc = kvr_sampler_init(&smp, &s->sp, err);
        if (rc)
            break;
        uint64_t t0 = kvr_now_ns();
        rc = prefill(e, s, ec.max_rows, logits, err);
        if (rc == 0) {
            stats->prefill_ns += kvr_now_ns() - t0;
            stats->n_prefill += s->n_ids;
            rc = decode(e, hp, tok, cfg, s, i, &smp, &con, sc, logits, on_token, ud, stats, err);
        }
        kvr_sampler_fini(&smp);
        if (rc == 0)
            kvr_engine_seq_free(e, 0);
    }
    kvr_grammar_match_destroy(con.match);
    kvr_grammar_vocab_destroy(con.vocab);
    kvr_free(logits);
    kvr_sample_scratch_destroy(sc);
    kvr_engine_destroy(e);
    return rc;
}

/* ---- every sequence at once ---------------------------------------------------------------- */

struct batch {
    struct kvr_generate_seq *seqs;
    uint32_t n_seqs, row_width;
    struct kvr_sampler *smp; /* one per sequence */
    struct constraint *con;  /* one per sequence */
    uint32_t *prefilled;     /* prompt tokens already in the KV cache, per sequence */
    struct kvr_seg *segs;    /* this pass, at most row_width */
    int32_t *toks;           /* this pass's token rows, row_width */
    float *logits;           /* row_width x n_vocab */
};

/* One decode row per running sequence first, then prefill chunks while rows are left.
 * Returns the number of segments. */
static uint32_t pack(struct batch *b)
{
    uint32_t n_segs = 0, n_rows = 0;
    for (uint32_t i = 0; i < b->n_seqs && n_rows < b->row_width; i++) {
        struct kvr_generate_seq *s = &b->seqs[i];
        if (s->finish || b->prefilled[i] < s->n_ids || s->n_out == 0)
            continue;
        b->segs[n_segs++] =
            (struct kvr_seg){i, s->n_ids + s->n_out - 1, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
        b->toks[n_rows++] = s->out[s->n_out - 1];
    }
    for (uint32_t i = 0; i < b->n_seqs && n_rows < b->row_width; i++) {
        struct kvr_generate_seq *s = &b->seqs[i];
        if (b->prefilled[i] >= s->n_ids)
            continue;
        uint32_t n = s->n_ids - b->prefilled[i];
        n = n < b->row_width - n_rows ? n : b->row_width - n_rows;
        bool last = b->prefilled[i] + n == s->n_ids;
        b->segs[n_segs++] = (struct kvr_seg){
            i, b->prefilled[i], n,
            KVR_SEG_PREFILL | (last ? KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN : 0)};
        memcpy(b->toks + n_rows, s->ids + b->prefilled[i], n * sizeof *b->toks);
        n_rows += n;
        b->prefilled[i] += n;
    }
    return n_segs;
}

/* Sample one token for every segment that wanted one and add how many sequences ended to
 * *n_ended. Fails (KVR_EINVAL) on a logits row with no finite value. */
static int take_tokens(struct batch *b, struct kvr_engine *e, uint32_t n_segs,
                       const struct kvr_hparams *hp, const struct kvr_tok *tok,
                       const struct kvr_generate_config *cfg, struct kvr_sample_scratch *sc,
                       kvr_generate_token_fn on_token, void *ud, struct kvr_generate_stats *st,
                       uint32_t *n_ended, struct kvr_err *err)
{
    uint32_t r = 0;
    for (uint32_t k = 0; k < n_segs; k++) {
        if (!(b->segs[k].flags & KVR_SEG_WANTS_TOKEN))
            continue;
        uint32_t i = b->segs[k].seq;
        struct kvr_generate_seq *s = &b->seqs[i];
        float *row = b->logits + (size_t)r++ * hp->n_vocab;
        double lse = top_logprobs(s, row, (int32_t)hp->n_vocab);
        int32_t t = sample_constrained(&b->smp[i], &b->con[i], row, (int32_t)hp->n_vocab, sc);
        if (t < 0)
            return kvr_err_set(err, t, "sequence %u: no finite logit at token %u", i, s->n_out);
        kvr_sampler_accept(&b->smp[i], t);
        report_logprobs(s, row, t, lse);
        s->out[s->n_out++] = t;
        st->n_tokens++;
        if (on_token)
            on_token(ud, i, t);
        if (!cfg->ignore_eos && kvr_tok_is_eog(tok, t))
            s->finish = KVR_GENERATE_STOP;
        else if (s->n_out == s->max_tokens)
            s->finish = KVR_GENERATE_LENGTH;
        if (s->finish) {
            kvr_engine_seq_free(e, i);
            (*n_ended)++;
        }
    }
    return 0;
}

int kvr_generate_batched(const struct kvr_gguf *g, const struct kvr_hparams *hp,
                         const struct kvr_tok *tok, const struct kvr_generate_config *cfg,
                         struct kvr_generate_seq *seqs, uint32_t n_seqs,
                         kvr_generate_token_fn on_token, void *ud, struct kvr_generate_stats *stats,
                         struct kvr_err *err)
{
    memset(stats, 0, sizeof *stats);
    struct kvr_engine_config ec = engine_config(hp, cfg, n_seqs);
    struct batch b = {.seqs = seqs, .n_seqs = n_seqs, .row_width = cfg->row_width};
    struct kvr_engine *e = NULL;
    struct kvr_sample_scratch *sc = NULL;
    b.smp = kvr_calloc(n_seqs, sizeof *b.smp);
    b.con = kvr_calloc(n_seqs, sizeof *b.con);
    b.prefilled = kvr_calloc(n_seqs, sizeof *b.prefilled);
    b.segs = kvr_calloc(cfg->row_width, sizeof *b.segs);
    b.toks = kvr_calloc(cfg->row_width, sizeof *b.toks);
    b.logits = kvr_malloc((size_t)cfg->row_width * hp->n_vocab * sizeof(float));
    int rc = 0;
    struct kvr_grammar_vocab *vocab = NULL;
    if (!b.smp || !b.con || !b.prefilled || !b.segs || !b.toks || !b.logits)
        rc = KVR_ENOMEM;
    else if ((rc = kvr_engine_create(&e, g, &ec, err)) == 0 &&
             kvr_sample_scratch_create(&sc, (int32_t)hp->n_vocab))
        rc = KVR_ENOMEM;
    if (rc == 0)
        rc = vocab_for(tok, seqs, n_seqs, &vocab, err);
    for (uint32_t i = 0; rc == 0 && i < n_seqs; i++) {
        b.con[i].vocab = vocab;
        if (seqs[i].grammar)
            rc = kvr_grammar_match_create(&b.con[i].match, seqs[i].grammar);
        if (rc == 0)
            rc = kvr_sampler_init(&b.smp[i], &seqs[i].sp, err);
    }
    uint64_t t0 = kvr_now_ns();
    for (uint32_t n_done = 0; rc == 0 && n_done < n_seqs;) {
        uint32_t n_segs = pack(&b);
        rc = kvr_engine_forward(e, b.segs, n_segs, b.toks, NULL, b.logits, err);
        if (rc)
            break;
        stats->n_passes++;
        rc = take_tokens(&b, e, n_segs, hp, tok, cfg, sc, on_token, ud, stats, &n_done, err);
    }
    stats->wall_ns = kvr_now_ns() - t0;
    for (uint32_t i = 0; b.smp && i < n_seqs; i++)
        kvr_sampler_fini(&b.smp[i]);
    kvr_free(b.smp);
    for (uint32_t i = 0; b.con && i < n_seqs; i++)
        kvr_grammar_match_destroy(b.con[i].match);
    kvr_free(b.con);
    kvr_grammar_vocab_destroy(vocab);
    kvr_free(b.prefilled);
    kvr_free(b.segs);
    kvr_free(b.toks);
    kvr_free(b.logits);
    kvr_sample_scratch_destroy(sc);
    kvr_engine_destroy(e);
    return rc;
}
