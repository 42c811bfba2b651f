/* sched_trace.c - what the scheduler tells the console's telemetry (telemetry.h): each
 * batch as it comes back, and each loss and recovery of the ring (sched_state.h). */
#include "bridge/sched_state.h"

#include "bridge/telemetry.h"

/* A batch came back: what it carried, by request, and each stage's timing record. Before
 * its results are applied, while every sequence in it still has its request. */
void kvr_sched_trace_batch(struct kvr_sched *s, const struct batch *bt,
                           const struct kvr_wire_frame *f, uint64_t now)
{
    if (!s->cfg.telemetry)
        return;
    uint64_t req_ids[KVR_TELEMETRY_SEQS]; /* the telemetry names no more */
    for (uint32_t i = 0; i < bt->n_segs && i < KVR_TELEMETRY_SEQS; i++) {
        const struct seq *q = &s->seqs[bt->segs[i].seq];
        req_ids[i] = q->r ? q->r->id : 0;
    }
    kvr_telemetry_record_batch(
        s->cfg.telemetry, &(struct kvr_telemetry_batch){.batch_id = bt->id,
                                                        .sent_ns = bt->sent_ns,
                                                        .returned_ns = now,
                                                        .segs = bt->segs,
                                                        .n_segs = bt->n_segs,
                                                        .req_ids = req_ids,
                                                        .n_ctrl = bt->n_ctrl,
                                                        .timings = f->timings,
                                                        .n_timings = f->hdr.n_timings,
                                                        .agent_timings = f->agent_timings,
                                                        .n_agent_timings = f->n_agent_timings});
}

/* recover() is holding n_held sequences: the console shows one loss per outage, not one
 * per probe that fails in it, and blames the stage a RESET named (kvr_sched_reset). */
void kvr_sched_trace_lost(struct kvr_sched *s, uint32_t n_held, const char *why, uint64_t now)
{
    int32_t stage = (int32_t)s->reset_blame - 1;
    s->reset_blame = 0;
    if (!s->cfg.telemetry || s->tel_lost || (!s->ring_up && !n_held))
        return;
    kvr_telemetry_ring_event(s->cfg.telemetry, KVR_TELEMETRY_EV_LOST, stage, n_held, why, now);
    s->tel_lost = true;
}

/* The ring is whole again after a loss: the held sequences are re-prefilled. */
void kvr_sched_trace_recovered(struct kvr_sched *s, uint64_t now)
{
    if (!s->cfg.telemetry || !s->tel_lost)
        return;
    uint32_t n_held = 0;
    for (uint32_t i = 0; i < s->plan->max_seqs; i++)
        n_held += s->seqs[i].held_since != 0;
    kvr_telemetry_ring_event(s->cfg.telemetry, KVR_TELEMETRY_EV_RECOVERED, -1, n_held, NULL, now);
    s->tel_lost = false;
}
