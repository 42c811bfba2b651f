/* step.c - a stage's work on one batch (see step.h). Reading order: set-up, control
 * records, sampling, the step itself. */
#include "ring/step.h"

#include "core/alloc.h"
#include "core/log.h"
#include "model/logprobs.h"
#include "model/spec_accept.h"

#include <string.h>

int kvr_step_init(struct kvr_step *st, const struct kvr_plan *plan, uint32_t index,
                  struct kvr_engine *engine, const struct kvr_hparams *hp,
                  const struct kvr_tok *tok, struct kvr_err *err)
{
    memset(st, 0, sizeof *st);
    st->engine = engine;
    st->tok = tok;
    st->index = index;
    st->n_stages = plan->n_stages;
    st->max_seqs = plan->max_seqs;
    st->row_width = plan->row_width;
    st->n_embd = hp->n_embd;
    st->n_vocab = hp->n_vocab;
    st->is_head = index == 0;
    st->is_tail = index + 1 == plan->n_stages;
    st->rows_payload = kvr_wire_payload_of_dtype(plan->wire_dtype);
    size_t n_rows_f = (size_t)plan->row_width * hp->n_embd;
    if (!st->is_head && st->rows_payload != KVR_WIRE_PAYLOAD_F32 &&
        !(st->rows_in = kvr_aligned_alloc(64, n_rows_f * sizeof(float))))
        goto nomem;
    if (st->is_tail) {
        size_t n_logits;
        st->samplers = kvr_calloc(plan->max_seqs, sizeof *st->samplers);
        st->open = kvr_calloc(plan->max_seqs, sizeof *st->open);
        st->want_logprobs = kvr_calloc(plan->max_seqs, sizeof *st->want_logprobs);
        st->n_top = kvr_calloc(plan->max_seqs, sizeof *st->n_top);
        st->drafts = kvr_calloc((size_t)plan->max_seqs * KVR_SPEC_MAX_DRAFT, sizeof *st->drafts);
        st->n_draft = kvr_calloc(plan->max_seqs, sizeof *st->n_draft);
        if (!st->samplers || !st->open || !st->want_logprobs || !st->n_top || !st->drafts ||
            !st->n_draft ||
            !kvr_mul_size((size_t)plan->row_width * hp->n_vocab, sizeof(float), &n_logits) ||
            !(st->logits = kvr_aligned_alloc(64, n_logits)) ||
            kvr_sample_scratch_create(&st->scratch, (int32_t)hp->n_vocab) ||
            kvr_step_grammars_init(&st->grammars, plan->max_seqs, tok, err))
            goto nomem;
    }
    return KVR_OK;
nomem:
    kvr_step_fini(st);
    return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory for its batch step");
}

void kvr_step_fini(struct kvr_step *st)
{
    if (st->samplers && st->open)
        for (uint32_t q = 0; q < st->max_seqs; q++)
            if (st->open[q])
                kvr_sampler_fini(&st->samplers[q]);
    kvr_free(st->samplers);
    kvr_free(st->open);
    kvr_free(st->want_logprobs);
    kvr_free(st->n_top);
    kvr_free(st->drafts);
    kvr_free(st->n_draft);
    kvr_free(st->logits);
    kvr_free(st->rows_in);
    kvr_sample_scratch_destroy(st->scratch);
    kvr_step_grammars_fini(&st->grammars);
    memset(st, 0, sizeof *st);
}

int kvr_step_out_init(const struct kvr_step *st, struct kvr_step_out *o,
                      const struct kvr_wire_limits *up, struct kvr_err *err)
{
    memset(o, 0, sizeof *o);
    size_t n_rows_f = (size_t)st->row_width * st->n_embd;
    o->ctrl = kvr_calloc(up->max_ctrl ? up->max_ctrl : 1, sizeof *o->ctrl);
    o->segs = kvr_calloc(up->max_segs, sizeof *o->segs);
    o->timings = kvr_calloc(st->n_stages + 1, sizeof *o->timings);
    o->agent_timings =
        kvr_calloc((size_t)up->max_agent_timings + up->n_agents + 1, sizeof *o->agent_timings);
    if (!o->ctrl || !o->segs || !o->timings || !o->agent_timings)
        goto nomem;
    if (st->is_tail) {
        if (!(o->results = kvr_calloc(up->max_rows, sizeof *o->results))) /* DRAFTS: per row */
            goto nomem;
    } else {
        if (!(o->rows = kvr_aligned_alloc(64, n_rows_f * sizeof(float))))
            goto nomem;
        if (st->rows_payload != KVR_WIRE_PAYLOAD_F32 &&
            !(o->wire_rows = kvr_aligned_alloc(64, n_rows_f * 2)))
            goto nomem;
    }
    return KVR_OK;
nomem:
    kvr_step_out_fini(o);
    return kvr_err_set(err, KVR_ENOMEM, "stage: out of memory for output slots");
}

void kvr_step_out_fini(struct kvr_step_out *o)
{
    kvr_free(o->ctrl);
    kvr_free(o->segs);
    kvr_free(o->timings);
    kvr_free(o->agent_timings);
    kvr_free(o->results);
    kvr_free(o->rows);
    kvr_free(o->wire_rows);
    memset(o, 0, sizeof *o);
}

/* ---- sequences and control records ---------------------------------------------------- */

static void close_seq(struct kvr_step *st, uint32_t seq)
{
    kvr_engine_seq_free(st->engine, seq);
    if (st->is_tail && st->open[seq]) {
        kvr_sampler_fini(&st->samplers[seq]);
        st->open[seq] = false;
    }
    kvr_step_grammar_close(&st->grammars, seq);
    if (st->is_tail)
        st->n_draft[seq] = 0;
}

void kvr_step_reset(struct kvr_step *st)
{
    for (uint32_t q = 0; q < st->max_seqs; q++)
        close_seq(st, q);
}

bool kvr_step_has_sequences(const struct kvr_step *st)
{
    uint32_t used, total;
    kvr_engine_kv_usage(st->engine, &used, &total);
    return used > 0;
}

/* Tail: put a re-opened sequence's sampler back where it was (wire.h, REPLAY): the draws
 * its earlier samples made, then its recent tokens into the penalty window. */
static void replay_seq(struct kvr_step *st, const struct kvr_wire_ctrl *c)
{
    if (!st->is_tail)
        return;
    if (!st->open[c->seq]) {
        KVR_ERROR("stage %u: REPLAY for sequence %u, which is not open", st->index, c->seq);
        return;
    }
    struct kvr_sampler *sm = &st->samplers[c->seq];
    for (uint32_t k = 0; k < c->replay.n_draws; k++)
        (void)kvr_sampler_uniform(sm);
    for (uint32_t k = 0; k < c->replay.n_ids; k++) {
        kvr_sampler_accept(sm, c->replay.ids[k]);
        kvr_step_grammar_accept(&st->grammars, c->seq, c->replay.ids[k]);
    }
}

/* Tail: the drafted tokens of this batch's DRAFTS segment of the sequence, in order. More
 * than a segment can carry is kept short, so the segment's check fails the batch. */
static void take_draft(struct kvr_step *st, const struct kvr_wire_ctrl *c)
{
    if (!st->is_tail)
        return;
    uint32_t *n = &st->n_draft[c->seq];
    int32_t *ids = st->drafts + (size_t)c->seq * KVR_SPEC_MAX_DRAFT;
    for (uint32_t k = 0; k < c->draft.n_ids; k++) {
        if (*n == KVR_SPEC_MAX_DRAFT) {
            KVR_ERROR("stage %u: sequence %u: more than %d drafted tokens", st->index, c->seq,
                      KVR_SPEC_MAX_DRAFT);
            *n = KVR_SPEC_MAX_DRAFT + 1; /* never matches a segment's n_tokens - 1 */
            return;
        }
        ids[(*n)++] = c->draft.ids[k];
    }
}

/* Control records come before the batch's rows: an OPEN starts a sequence afresh (its slot
 * may hold a finished one), MAP gives it the KV blocks the bridge chose (DESIGN.md 12),
 * FREE and CANCEL release it everywhere, REPLAY restores the sampler of one just re-opened,
 * BIAS adds logit biases to the sampler of one just opened, GRAMMAR a piece of its grammar,
 * DRAFT names the drafted tokens of its DRAFTS segment.
 * A MAP that does not fit leaves the sequence without blocks, so its first segment fails
 * the batch and the bridge is told (RESET). */
static void apply_control(struct kvr_step *st, const struct kvr_wire_frame *in)
{
    for (uint32_t i = 0; i < in->hdr.n_ctrl; i++) {
        const struct kvr_wire_ctrl *c = &in->ctrl[i];
        if (c->type == KVR_WIRE_CTRL_REPLAY) {
            replay_seq(st, c);
            continue;
        }
        if (c->type == KVR_WIRE_CTRL_MAP) {
            struct kvr_err err = {0};
            if (kvr_engine_seq_map(st->engine, c->seq, c->map.n_cached, c->map.first, c->map.ids,
                                   c->map.n_ids, &err)) {
                KVR_ERROR("stage %u: sequence %u: %s", st->index, c->seq, err.msg);
                kvr_engine_seq_free(st->engine, c->seq);
            }
            continue;
        }
        if (c->type == KVR_WIRE_CTRL_DRAFT) {
            take_draft(st, c);
            continue;
        }
        if (c->type == KVR_WIRE_CTRL_BIAS) {
            for (uint32_t k = 0; st->is_tail && st->open[c->seq] && k < c->bias.n; k++)
                if (kvr_sampler_add_bias(&st->samplers[c->seq], c->bias.ids[k], c->bias.bias[k]))
                    KVR_ERROR("stage %u: sequence %u: more than %d logit biases", st->index, c->seq,
                              KVR_SAMPLER_MAX_BIAS);
            continue;
        }
        if (c->type == KVR_WIRE_CTRL_GRAMMAR) {
            if (st->is_tail && st->open[c->seq])
                kvr_step_grammar_piece(&st->grammars, c->seq, &c->grammar, st->index);
            continue;
        }
        close_seq(st, c->seq);
        if (c->type == KVR_WIRE_CTRL_OPEN && st->is_tail) {
            struct kvr_err err = {0};
            if (kvr_sampler_init(&st->samplers[c->seq], &c->sampling, &err)) {
                /* The codec checked the ranges, so this is a disagreement between codec and
                 * sampler; the sequence stays closed and its first result fails loudly. */
                KVR_ERROR("stage %u: sequence %u: %s", st->index, c->seq, err.msg);
                continue;
            }
            st->open[c->seq] = true;
            st->want_logprobs[c->seq] = (c->flags & KVR_WIRE_OPEN_LOGPROBS) != 0;
            st->n_top[c->seq] = (uint8_t)((c->flags & KVR_WIRE_TOP_MASK) >> KVR_WIRE_TOP_SHIFT);
        }
    }
}

/* ---- the step ------------------------------------------------------------------------- */

/* Tail: one token from one logits row. Logprobs are the model's own (log_softmax of the
 * raw row, before a grammar's mask), as llama.cpp and vLLM report them. Returns 1. */
static int sample_one(struct kvr_step *st, const struct kvr_seg *seg, float *logits,
                      struct kvr_wire_result *res, unsigned long long id, struct kvr_err *err)
{
    bool lp = st->want_logprobs[seg->seq];
    double lse = 0.0;
    int n_top =
        lp ? kvr_logprobs_top(logits, (int32_t)st->n_vocab, st->n_top[seg->seq], res->top, &lse)
           : 0;
    if (kvr_step_grammar_mask(&st->grammars, seg->seq, logits, st->n_vocab))
        return kvr_err_set(err, KVR_ENOMEM,
                           "batch %llu: sequence %u: out of memory for its grammar mask", id,
                           seg->seq);
    int32_t tok = n_top < 0 ? n_top
                            : kvr_sampler_sample(&st->samplers[seg->seq], logits,
                                                 (int32_t)st->n_vocab, st->scratch, NULL);
    if (tok < 0) /* no token to send: fail the batch rather than send an invalid id */
        return kvr_err_set(err, KVR_EINVAL,
                           "batch %llu: sequence %u: its logits row has no finite value "
                           "to sample from",
                           id, seg->seq);
    kvr_sampler_accept(&st->samplers[seg->seq], tok);
    kvr_step_grammar_accept(&st->grammars, seg->seq, tok);
    res->seq = seg->seq;
    res->token = tok;
    res->logprob = lp ? kvr_logprobs_token(logits, tok, lse) : 0.0f;
    res->n_top = (uint32_t)n_top;
    res->flags = (lp ? KVR_WIRE_RESULT_LOGPROB : 0) |
                 (st->tok && kvr_tok_is_eog(st->tok, tok) ? KVR_WIRE_RESULT_EOG : 0);
    return 1;
}

/* Tail: the tokens of one segment that wants them, from its logits rows: one sampled token,
 * or for a DRAFTS segment the drafts the target keeps and one of its own (spec_accept.h).
 * Returns how many results it wrote at o->results + n. */
static int sample_seg(struct kvr_step *st, const struct kvr_wire_frame *in,
                      const struct kvr_seg *seg, float *logits, struct kvr_step_out *o, uint32_t n,
                      struct kvr_err *err)
{
    unsigned long long id = (unsigned long long)in->hdr.batch_id;
    if (!st->open[seg->seq])
        return kvr_err_set(err, KVR_EPROTO,
                           "batch %llu: sequence %u wants a token but was never opened", id,
                           seg->seq);
    uint32_t n_drafts = (seg->flags & KVR_SEG_DRAFTS) ? seg->n_tokens - 1 : 0;
    if (n_drafts != st->n_draft[seg->seq])
        return kvr_err_set(err, KVR_EPROTO,
                           "batch %llu: sequence %u: %u drafted rows, %u drafted ids", id, seg->seq,
                           n_drafts, st->n_draft[seg->seq]);
    st->n_draft[seg->seq] = 0;
    if (n_drafts == 0)
        return sample_one(st, seg, logits, &o->results[n], id, err);
    /* The bridge drafts for no sequence with alternatives, nor with a grammar and logprobs
     * (spec_policy.h): a drafted row carries no alternatives, and a masked row's logprob
     * would not be the raw row's. */
    bool lp = st->want_logprobs[seg->seq];
    bool constrained = kvr_step_grammar_active(&st->grammars, seg->seq);
    if (st->n_top[seg->seq] || (constrained && lp))
        return kvr_err_set(err, KVR_EPROTO,
                           "batch %llu: sequence %u: drafts for a sequence with alternatives "
                           "or with a grammar and logprobs",
                           id, seg->seq);
    int32_t toks[KVR_SPEC_MAX_DRAFT + 1];
    float lps[KVR_SPEC_MAX_DRAFT + 1];
    const int32_t *drafts = st->drafts + (size_t)seg->seq * KVR_SPEC_MAX_DRAFT;
    int32_t kept =
        constrained
            ? kvr_step_grammar_verify(&st->grammars, seg->seq, &st->samplers[seg->seq], logits,
                                      st->n_vocab, drafts, n_drafts, st->scratch, toks)
            : kvr_spec_verify(&st->samplers[seg->seq], logits, (int32_t)st->n_vocab, drafts,
                              n_drafts, st->scratch, toks, lp ? lps : NULL);
    if (kept == KVR_ENOMEM)
        return kvr_err_set(err, KVR_ENOMEM,
                           "batch %llu: sequence %u: out of memory for its grammar mask", id,
                           seg->seq);
    if (kept < 0) /* no token to send: fail the batch rather than send an invalid id */
        return kvr_err_set(err, KVR_EINVAL,
                           "batch %llu: sequence %u: its logits row has no finite value "
                           "to sample from",
                           id, seg->seq);
    for (int32_t j = 0; j < kept; j++)
        o->results[n + (uint32_t)j] = (struct kvr_wire_result){
            .seq = seg->seq,
            .token = toks[j],
            .logprob = lp ? lps[j] : 0.0f,
            .flags = (lp ? KVR_WIRE_RESULT_LOGPROB : 0) |
                     (st->tok && kvr_tok_is_eog(st->tok, toks[j]) ? KVR_WIRE_RESULT_EOG : 0)};
    return kept;
}

/* Tail: sample every segment that wants a token. */
static int sample_results(struct kvr_step *st, const struct kvr_wire_frame *in,
                          struct kvr_step_out *o, struct kvr_err *err)
{
    uint32_t n = 0, row = 0;
    for (uint32_t i = 0; i < in->hdr.n_segs; i++) {
        const struct kvr_seg *seg = &in->segs[i];
        if (!(seg->flags & KVR_SEG_WANTS_TOKEN))
            continue;
        int kept = sample_seg(st, in, seg, st->logits + (size_t)row * st->n_vocab, o, n, err);
        if (kept < 0)
            return kept;
        n += (uint32_t)kept;
        row += (seg->flags & KVR_SEG_DRAFTS) ? seg->n_tokens : 1;
    }
    o->msg.results = o->results;
    o->msg.n_results = n;
    o->msg.payload = KVR_WIRE_PAYLOAD_RESULTS;
    o->msg.payload_data = NULL;
    o->msg.payload_bytes = 0;
    return KVR_OK;
}

int kvr_step_run(struct kvr_step *st, const struct kvr_wire_frame *in, struct kvr_step_out *o,
                 struct kvr_err *err)
{
    const struct kvr_wire_header *h = &in->hdr;
    apply_control(st, in);
    /* The membership and records go on unchanged: they are small, and copying them lets
     * the input slot (and its credit) go back upstream as soon as the step is done. */
    memset(&o->msg, 0, sizeof o->msg);
    memcpy(o->ctrl, in->ctrl, h->n_ctrl * sizeof *in->ctrl);
    memcpy(o->segs, in->segs, h->n_segs * sizeof *in->segs);
    memcpy(o->timings, in->timings, h->n_timings * sizeof *in->timings);
    memcpy(o->agent_timings, in->agent_timings, in->n_agent_timings * sizeof *in->agent_timings);
    o->msg.type = st->is_tail ? KVR_WIRE_RESULT : KVR_WIRE_BATCH;
    o->msg.batch_id = h->batch_id;
    o->msg.ctrl = o->ctrl;
    o->msg.n_ctrl = h->n_ctrl;
    o->msg.segs = o->segs;
    o->msg.n_segs = h->n_segs;
    o->msg.timings = o->timings;
    o->msg.n_timings = h->n_timings;
    o->msg.agent_timings = o->agent_timings;
    o->msg.n_agent_timings = in->n_agent_timings;
    if (h->n_segs == 0) { /* a control-only batch */
        o->msg.payload = st->is_tail ? KVR_WIRE_PAYLOAD_RESULTS : st->rows_payload;
        return KVR_OK;
    }
    /* The payload is used where the link put it: token ids at the head, f32 rows
     * elsewhere (16-byte aligned in the slot's buffer, wire.h); f16/bf16 are widened. */
    const int32_t *tokens = st->is_head ? in->payload : NULL;
    const float *rows = NULL;
    if (!st->is_head && h->payload == KVR_WIRE_PAYLOAD_F32) {
        rows = in->payload;
    } else if (!st->is_head) {
        kvr_wire_rows_to_f32(h->payload, in->payload, (size_t)h->n_rows * st->n_embd, st->rows_in);
        rows = st->rows_in;
    }
    float *out = st->is_tail ? st->logits : o->rows;
    int rc = kvr_engine_forward(st->engine, in->segs, h->n_segs, tokens, rows, out, err);
    if (rc)
        return rc;
    if (st->is_tail)
        return sample_results(st, in, o, err);
    size_t n = (size_t)h->n_rows * st->n_embd;
    o->msg.payload = st->rows_payload;
    if (st->rows_payload == KVR_WIRE_PAYLOAD_F32) {
        o->msg.payload_data = o->rows;
        o->msg.payload_bytes = n * sizeof(float);
    } else {
        kvr_wire_rows_from_f32(st->rows_payload, o->rows, n, o->wire_rows);
        o->msg.payload_data = o->wire_rows;
        o->msg.payload_bytes = n * 2;
    }
    return KVR_OK;
}

void kvr_step_time(const struct kvr_step *st, struct kvr_step_out *o, uint64_t starved_ns,
                   uint64_t blocked_ns, uint64_t held_ns)
{
    struct kvr_wire_timing *t = &o->timings[o->msg.n_timings++];
    *t = (struct kvr_wire_timing){
        .stage = st->index, .held_ns = held_ns, .starved_ns = starved_ns, .blocked_ns = blocked_ns};
}

void kvr_step_time_agents(struct kvr_step_out *o, const struct kvr_wire_timing *t, uint32_t n)
{
    memcpy(&o->agent_timings[o->msg.n_agent_timings], t, n * sizeof *t);
    o->msg.n_agent_timings += n;
}
