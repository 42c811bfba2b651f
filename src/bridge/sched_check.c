/* sched_check.c - the scheduler's invariants, checked from outside (sched.h kvr_sched_check):
 * what tests and the fuzzer call after every event, kept apart from the state machine it
 * reads so that sched.c holds only what runs. */
#include "bridge/kvpool.h"
#include "bridge/sched.h"
#include "bridge/sched_state.h"
#include "core/err.h"

#include <stdbool.h>

int kvr_sched_check(const struct kvr_sched *s, struct kvr_err *err)
{
    const struct kvr_plan *p = s->plan;
    uint32_t running = 0;
    if (s->n_inflight > p->microbatches)
        return kvr_err_set(err, KVR_EINVAL, "%u batches in flight, window %u", s->n_inflight,
                           p->microbatches);
    for (uint32_t i = 0; i < p->max_seqs; i++) {
        const struct seq *q = &s->seqs[i];
        if (q->state == SEQ_FREE) {
            if (q->r || q->inflight || q->kv_blocks)
                return kvr_err_set(err, KVR_EINVAL, "free slot %u holds state", i);
            continue;
        }
        running++;
        if (!q->r || q->r->seq != (int)i || q->r->waiting)
            return kvr_err_set(err, KVR_EINVAL, "slot %u and its request disagree", i);
        bool blockless = q->kv_blocks == 0 && !q->opened; /* held by a recovery */
        if (q->kv_blocks != req_blocks(s, q->r) && !blockless)
            return kvr_err_set(err, KVR_EINVAL, "slot %u holds %u blocks, needs %u", i,
                               q->kv_blocks, req_blocks(s, q->r));
        const uint32_t *table = s->tables + (size_t)i * s->max_blocks_per_seq;
        for (uint32_t b = 0; b < q->kv_blocks; b++)
            if (s->pool.state[table[b]] != KVR_KV_BLOCK_USED)
                return kvr_err_set(err, KVR_EINVAL, "slot %u uses block %u, not in use", i,
                                   table[b]);
        if (q->n_cached % p->kv_block_tokens || q->n_cached >= q->r->req.n_prompt + q->n_replay)
            return kvr_err_set(err, KVR_EINVAL, "slot %u: %u cached positions of %u", i,
                               q->n_cached, q->r->req.n_prompt);
        uint32_t in_window = 0, decoding = 0;
        for (uint32_t b = 0; b < s->n_inflight; b++) {
            const struct batch *bt = &s->batches[(s->bf_head + b) % p->microbatches];
            for (uint32_t k = 0; k < bt->n_segs; k++) {
                if (bt->segs[k].seq != i)
                    continue;
                in_window++;
                decoding += (bt->segs[k].flags & KVR_SEG_WANTS_TOKEN) != 0;
            }
        }
        if (in_window != q->inflight)
            return kvr_err_set(err, KVR_EINVAL, "slot %u: %u batches in flight, counted %u", i,
                               in_window, q->inflight);
        if (decoding > 1)
            return kvr_err_set(err, KVR_EINVAL, "slot %u wants a token from %u batches", i,
                               decoding);
        if (decoding == 1 && q->state != SEQ_WAIT && q->state != SEQ_ENDING)
            return kvr_err_set(err, KVR_EINVAL, "slot %u has a token coming but is not waiting", i);
        if (q->r->n_generated > q->r->req.max_tokens)
            return kvr_err_set(err, KVR_EINVAL, "slot %u generated past max_tokens", i);
    }
    int rc = kvr_kv_pool_check(&s->pool, err);
    if (rc)
        return rc;
    /* Every block in use is in some slot's table, as often as its reference count says. */
    uint32_t refs = 0;
    for (uint32_t i = 0; i < p->max_seqs; i++)
        refs += s->seqs[i].kv_blocks;
    uint32_t pool_refs = 0;
    for (uint32_t b = 0; b < s->pool.n_blocks; b++)
        pool_refs += s->pool.refs[b];
    if (refs != pool_refs)
        return kvr_err_set(err, KVR_EINVAL,
                           "KV blocks: slots hold %u references, the pool "
                           "counts %u",
                           refs, pool_refs);
    if (running != s->n_running)
        return kvr_err_set(err, KVR_EINVAL, "%u slots in use, counted %u", running, s->n_running);
    if (s->wq_count > s->max_waiting)
        return kvr_err_set(err, KVR_EINVAL, "wait queue over capacity");
    for (uint32_t k = 0; k < s->wq_count; k++) {
        const struct kvr_sched_req *r = s->waitq[(s->wq_head + k) % s->max_waiting];
        if (!r->waiting || r->seq != -1 || r->ended)
            return kvr_err_set(err, KVR_EINVAL, "waiting request %u is not waiting", k);
    }
    return KVR_OK;
}
