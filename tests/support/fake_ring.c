/* fake_ring.c - the fake ring and stream recorder of fake_ring.h. */
#include "fake_ring.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void sh_failf(struct sh *h, const char *fmt, ...)
{
    if (h->fail[0])
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(h->fail, sizeof h->fail, fmt, ap);
    va_end(ap);
}

void sh_on_event(void *ctx, struct kvr_sched_req *r, const struct kvr_sched_event *ev)
{
    struct sh *h = ctx;
    struct sh_req *q = r->user;
    if (q->detached) {
        sh_failf(h, "event %d after the detach", (int)ev->type);
        return;
    }
    switch (ev->type) {
    case KVR_SCHED_EV_TOKEN:
        if (q->ended)
            sh_failf(h, "token after the end of a stream");
        else if (q->n_seen >= r->req.max_tokens)
            sh_failf(h, "more tokens than max_tokens");
        else
            q->seen[q->n_seen++] = ev->gen.token;
        break;
    case KVR_SCHED_EV_END:
        if (q->ended)
            sh_failf(h, "a second end");
        q->ended = true;
        q->finish = ev->gen.finish;
        snprintf(q->message, sizeof q->message, "%s", ev->gen.error);
        break;
    case KVR_SCHED_EV_DETACH:
        if (!q->ended)
            sh_failf(h, "detached before its end");
        q->detached = true;
        break;
    default:
        sh_failf(h, "unknown event %d", (int)ev->type);
    }
}

int sh_init(struct sh *h, uint32_t mb, uint32_t rows, uint32_t seqs, uint32_t blocks,
            bool admission)
{
    memset(h, 0, sizeof *h);
    struct kvr_plan *p = &h->plan;
    p->n_stages = 2;
    p->microbatches = mb;
    p->row_width = rows;
    p->max_seqs = seqs;
    p->n_ctx = 256;
    p->kv_block_tokens = SH_BT;
    p->kv_blocks = blocks < SH_MAX_KV ? blocks : SH_MAX_KV;
    h->now = 1000 * SH_MS;
    struct kvr_sched_config cfg = {.plan = p,
                                   .max_ctrl = SH_MAX_CTRL,
                                   .max_waiting = 6,
                                   .admission = admission,
                                   .prefix_cache = true,
                                   .event = sh_on_event,
                                   .event_ctx = h};
    struct kvr_err err = {0};
    return kvr_sched_create(&h->s, &cfg, &err);
}

void sh_check(struct sh *h)
{
    struct kvr_err err = {0};
    if (kvr_sched_check(h->s, &err))
        sh_failf(h, "kvr_sched_check: %s", err.msg);
    for (uint32_t q = 0; q < h->plan.max_seqs; q++) {
        uint32_t n = 0;
        for (uint32_t b = 0; b < h->n_ring; b++) {
            const struct sh_batch *bt = &h->ring[(h->ring_head + b) % SH_RING_CAP];
            if (!kvr_sched_batch_live(h->s, bt->id))
                continue; /* given up on: its result will be ignored */
            for (uint32_t k = 0; k < bt->n_segs; k++)
                n += bt->segs[k].seq == q && (bt->segs[k].flags & KVR_SEG_WANTS_TOKEN);
        }
        if (n > 1)
            sh_failf(h, "seq %u wants a token from %u batches in flight", q, n);
    }
}

bool sh_grammar_pending(const struct sh *h, uint32_t seq)
{
    for (uint32_t i = 0; i < SH_MAX_REQS; i++) {
        const struct sh_req *q = &h->reqs[i];
        if (q->used && !q->detached && q->r.seq == (int)seq && q->r.req.grammar_bytes)
            return h->n_grammar_got[seq] < q->r.req.grammar_bytes ||
                   memcmp(h->grammar_got[seq], q->r.req.grammar, q->r.req.grammar_bytes) != 0;
    }
    return false;
}

void sh_stage_view(struct sh *h, const struct sh_batch *bt)
{
    for (uint32_t i = 0; i < bt->n_ctrl; i++) {
        const struct kvr_wire_ctrl *c = &bt->ctrl[i];
        if (c->seq >= h->plan.max_seqs) {
            sh_failf(h, "control record for seq %u", c->seq);
            continue;
        }
        if (c->type == KVR_WIRE_CTRL_OPEN) {
            if (h->open[c->seq])
                sh_failf(h, "batch %llu re-opens seq %u before freeing it",
                         (unsigned long long)bt->id, c->seq);
            h->open[c->seq] = true;
            h->n_mapped[c->seq] = h->n_pos[c->seq] = 0;
            h->n_grammar_got[c->seq] = h->n_replay_ids[c->seq] = 0;
        } else if (c->type == KVR_WIRE_CTRL_REPLAY) {
            if (!h->open[c->seq])
                sh_failf(h, "REPLAY for seq %u, not open", c->seq);
            if (sh_grammar_pending(h, c->seq))
                sh_failf(h, "REPLAY for seq %u before its grammar", c->seq);
            h->n_replay_ids[c->seq] += c->replay.n_ids;
        } else if (c->type == KVR_WIRE_CTRL_BIAS) {
            if (!h->open[c->seq])
                sh_failf(h, "BIAS for seq %u, not open", c->seq);
        } else if (c->type == KVR_WIRE_CTRL_GRAMMAR) {
            const struct kvr_wire_grammar *gr = &c->grammar;
            uint32_t n = gr->total - gr->offset < 32 ? gr->total - gr->offset : 32;
            if (!h->open[c->seq] || gr->offset != h->n_grammar_got[c->seq] ||
                gr->total > SH_MAX_GRAMMAR) {
                sh_failf(h, "GRAMMAR for seq %u at %u of %u out of order", c->seq, gr->offset,
                         gr->total);
                continue;
            }
            memcpy(h->grammar_got[c->seq] + gr->offset, gr->text, n);
            h->n_grammar_got[c->seq] += n;
        } else if (c->type == KVR_WIRE_CTRL_MAP) {
            const struct kvr_wire_map *m = &c->map;
            if (!h->open[c->seq] || m->first != h->n_mapped[c->seq] || m->n_ids == 0 ||
                m->first + m->n_ids > SH_MAX_BLOCKS_SEQ || m->n_cached % SH_BT ||
                m->n_cached / SH_BT > SH_MAX_BLOCKS_SEQ) {
                sh_failf(h, "bad MAP for seq %u", c->seq);
                continue;
            }
            for (uint32_t k = 0; k < m->n_ids; k++) {
                if (m->ids[k] >= h->plan.kv_blocks)
                    sh_failf(h, "MAP names block %u of %u", m->ids[k], h->plan.kv_blocks);
                h->table[c->seq][m->first + k] = m->ids[k] % SH_MAX_KV;
            }
            h->n_mapped[c->seq] += m->n_ids;
            h->n_pos[c->seq] = m->n_cached;
        } else {
            h->open[c->seq] = false;
        }
    }
    uint32_t row = 0;
    for (uint32_t k = 0; k < bt->n_segs; k++) {
        const struct kvr_seg *g = &bt->segs[k];
        if (g->seq >= h->plan.max_seqs || !h->open[g->seq])
            continue; /* reported below */
        if ((g->flags & KVR_SEG_WANTS_TOKEN) && sh_grammar_pending(h, g->seq))
            sh_failf(h, "seq %u wants a token before its grammar arrived", g->seq);
        if (g->pos0 != h->n_pos[g->seq] ||
            (g->pos0 + g->n_tokens + SH_BT - 1) / SH_BT > h->n_mapped[g->seq] ||
            (h->n_pos[g->seq] + SH_BT - 1) / SH_BT > h->n_mapped[g->seq]) {
            sh_failf(h, "seq %u writes [%u, +%u) with %u positions in %u blocks", g->seq, g->pos0,
                     g->n_tokens, h->n_pos[g->seq], h->n_mapped[g->seq]);
            row += g->n_tokens;
            continue;
        }
        for (uint32_t t = 0; t < g->n_tokens; t++, row++) {
            uint32_t pos = g->pos0 + t, b = h->table[g->seq][pos / SH_BT];
            for (uint32_t o = 0; o < h->plan.max_seqs; o++)
                for (uint32_t j = 0; o != g->seq && h->open[o] && j < h->n_mapped[o]; j++)
                    if (h->table[o][j] == b)
                        sh_failf(h, "seq %u writes block %u, which seq %u maps", g->seq, b, o);
            h->kv[b][pos % SH_BT] = bt->tokens[row];
        }
        h->n_pos[g->seq] = g->pos0 + g->n_tokens;
    }
    uint32_t rows = 0;
    for (uint32_t k = 0; k < bt->n_segs; k++) {
        const struct kvr_seg *g = &bt->segs[k];
        rows += g->n_tokens;
        if (g->seq >= h->plan.max_seqs || !h->open[g->seq])
            sh_failf(h, "batch %llu runs seq %u, which the stages have not open",
                     (unsigned long long)bt->id, g->seq);
        if (g->pos0 + g->n_tokens > h->plan.n_ctx || g->n_tokens == 0)
            sh_failf(h, "segment out of range");
        for (uint32_t j = 0; j < k; j++)
            if (bt->segs[j].seq == g->seq)
                sh_failf(h, "seq %u twice in one batch", g->seq);
    }
    if (rows != bt->n_rows || rows > h->plan.row_width)
        sh_failf(h, "batch rows %u, segments %u, width %u", bt->n_rows, rows, h->plan.row_width);
}

void sh_pump(struct sh *h)
{
    if (!h->links_up)
        return;
    const struct kvr_wire_msg *m;
    while (h->n_ring < SH_RING_CAP && (m = kvr_sched_next_batch(h->s, h->now)) != NULL) {
        if (m->n_ctrl > SH_MAX_CTRL || m->n_segs > SH_MAX_ROWS) {
            sh_failf(h, "window overflow or oversized batch");
            return;
        }
        struct sh_batch *bt = &h->ring[(h->ring_head + h->n_ring++) % SH_RING_CAP];
        bt->id = m->batch_id;
        bt->n_ctrl = m->n_ctrl;
        bt->n_segs = m->n_segs;
        bt->n_rows = (uint32_t)(m->payload_bytes / sizeof(int32_t));
        memcpy(bt->ctrl, m->ctrl, m->n_ctrl * sizeof *bt->ctrl);
        memcpy(bt->segs, m->segs, m->n_segs * sizeof *bt->segs);
        memcpy(bt->tokens, m->payload_data, bt->n_rows * sizeof(int32_t));
        h->n_batches_sent++;
        h->last = *bt;
        sh_stage_view(h, bt);
    }
    sh_check(h);
}

uint32_t sh_mix(uint32_t x, int32_t token, uint32_t pos)
{
    return (x ^ ((uint32_t)token * 2654435761u ^ (pos + 1))) * 16777619u;
}

int32_t sh_model_out(uint32_t x)
{
    x ^= x >> 13;
    return (int32_t)(x % SH_VOCAB);
}

int32_t sh_model_tokens(const int32_t *tokens, uint32_t n)
{
    uint32_t x = 2166136261u;
    for (uint32_t p = 0; p < n; p++)
        x = sh_mix(x, tokens[p], p);
    return sh_model_out(x);
}

int32_t sh_model(const struct sh *h, uint32_t seq, uint32_t pos)
{
    uint32_t x = 2166136261u;
    for (uint32_t p = 0; p <= pos; p++)
        x = sh_mix(x, h->kv[h->table[seq][p / SH_BT]][p % SH_BT], p);
    return sh_model_out(x);
}

int sh_deliver(struct sh *h)
{
    if (h->n_ring == 0)
        return KVR_EINVAL;
    struct sh_batch *bt = &h->ring[h->ring_head];
    struct kvr_wire_result res[SH_MAX_ROWS];
    struct kvr_wire_timing tim[2];
    uint32_t n_res = 0;
    for (uint32_t k = 0; k < bt->n_segs; k++) {
        const struct kvr_seg *g = &bt->segs[k];
        if (g->flags & KVR_SEG_WANTS_TOKEN) {
            int32_t t = sh_model(h, g->seq, g->pos0 + g->n_tokens - 1);
            res[n_res++] = (struct kvr_wire_result){
                .seq = g->seq, .token = t, .flags = t == SH_EOG ? KVR_WIRE_RESULT_EOG : 0};
        }
    }
    uint64_t held = SH_MS + bt->n_rows * SH_MS / 10;
    for (uint32_t i = 0; i < 2; i++)
        tim[i] = (struct kvr_wire_timing){.stage = i, .held_ns = held, .starved_ns = h->starved_ns};
    h->starved_ns = 0;
    h->now += 2 * held + SH_MS / 2;
    struct kvr_wire_frame f = {.hdr = {.type = KVR_WIRE_RESULT,
                                       .payload = KVR_WIRE_PAYLOAD_RESULTS,
                                       .batch_id = bt->id,
                                       .n_rows = bt->n_rows,
                                       .n_segs = bt->n_segs,
                                       .n_ctrl = bt->n_ctrl,
                                       .n_timings = 2,
                                       .n_results = n_res},
                               .ctrl = bt->ctrl,
                               .segs = bt->segs,
                               .results = res,
                               .timings = tim};
    h->ring_head = (h->ring_head + 1) % SH_RING_CAP;
    h->n_ring--;
    struct kvr_err err = {0};
    int rc = kvr_sched_result(h->s, &f, h->now, &err);
    h->n_results++;
    sh_check(h);
    return rc;
}

void sh_drop(struct sh *h)
{
    if (h->n_ring == 0)
        return;
    h->ring_head = (h->ring_head + 1) % SH_RING_CAP;
    h->n_ring--;
}

void sh_link_up(struct sh *h)
{
    if (h->links_up)
        return;
    h->links_up = true;
    kvr_sched_link_up(h->s, h->now);
    sh_pump(h);
}

void sh_link_down(struct sh *h, const char *why)
{
    h->n_ring = 0;
    h->links_up = false;
    memset(h->open, 0, sizeof h->open); /* the stages drop everything with their links */
    kvr_sched_link_down(h->s, why, h->now);
    sh_check(h);
}

void sh_tick(struct sh *h, uint64_t advance_ns)
{
    h->now += advance_ns;
    kvr_sched_tick(h->s, h->now);
    sh_check(h);
    sh_pump(h);
}

int sh_submit(struct sh *h, uint32_t i, uint32_t n_prompt, uint32_t max_tokens, float temperature,
              float repeat_penalty, uint32_t first_ms, uint32_t total_ms, struct kvr_refusal *why)
{
    struct sh_req *q = &h->reqs[i];
    memset(q, 0, sizeof *q);
    n_prompt = n_prompt > SH_MAX_PROMPT ? SH_MAX_PROMPT : n_prompt;
    max_tokens = max_tokens > SH_MAX_GEN ? SH_MAX_GEN : max_tokens;
    for (uint32_t k = 0; k < n_prompt; k++)
        q->prompt[k] =
            (int32_t)(3 + ((k < h->shared_prefix ? 0 : i) * 37 + k * 11) % (SH_VOCAB - 3));
    q->r.req =
        (struct kvr_gen_request){.prompt = q->prompt,
                                 .n_prompt = n_prompt,
                                 .max_tokens = max_tokens,
                                 .first_token_ms = first_ms,
                                 .total_ms = total_ms,
                                 .grammar = h->grammar,
                                 .grammar_bytes = h->grammar ? (uint32_t)strlen(h->grammar) : 0,
                                 .ignore_eos = (i & 1) != 0};
    kvr_sample_params_default(&q->r.req.sampling);
    q->r.req.sampling.temperature = temperature;
    q->r.req.sampling.repeat_penalty = repeat_penalty;
    q->r.req.sampling.seed = i;
    q->r.generated = q->gen;
    q->r.user = q;
    int rc = kvr_sched_submit(h->s, &q->r, h->now, why);
    q->used = rc == 0;
    sh_check(h);
    sh_pump(h);
    return rc;
}

void sh_cancel(struct sh *h, uint32_t i)
{
    struct sh_req *q = &h->reqs[i];
    if (!q->used || q->detached)
        return;
    kvr_sched_cancel(h->s, &q->r, h->now);
    sh_check(h);
    sh_pump(h);
}

void sh_run(struct sh *h, uint32_t max)
{
    for (uint32_t i = 0; i < max && h->n_ring > 0 && !h->fail[0]; i++) {
        if (sh_deliver(h))
            sh_failf(h, "a result was refused");
        sh_pump(h);
    }
}

void sh_fini(struct sh *h)
{
    kvr_sched_shutdown(h->s, "test over", h->now);
    for (uint32_t i = 0; i < SH_MAX_REQS; i++)
        if (h->reqs[i].used && !h->reqs[i].detached)
            sh_failf(h, "request %u never detached", i);
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    if (st.kv_blocks_used || st.running || st.waiting)
        sh_failf(h, "after shutdown: %u KV blocks, %u running, %u waiting", st.kv_blocks_used,
                 st.running, st.waiting);
    kvr_sched_destroy(h->s);
    h->s = NULL;
}
