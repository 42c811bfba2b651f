/* stage.h - the stage agent: one process serving one layer slice of the ring (DESIGN.md 5).
 *
 * A stage listens on its plan address for its upstream (the bridge for stage 0, stage i-1
 * otherwise), accepts only a peer that passes the handshake with the same plan and secret,
 * and dials its downstream (stage i+1, or the bridge from the tail), reconnecting with
 * backoff. Frames are processed strictly in arrival order. For each BATCH it applies the
 * in-band control records (open / free / cancel a sequence), runs its layers on exactly the
 * membership it was given, appends its timing record and forwards the result: boundary
 * rows to the next stage, or, at the tail, the sampled token of every segment that wants
 * one, as a RESULT frame to the bridge.
 *
 * Two threads, so receiving the next frame and sending the previous output overlap with
 * compute:
 *   I/O      one event loop (core/ev.h) owning every socket: accepts and authenticates
 *            upstream connections, reads frames straight into preallocated input slots,
 *            keeps the downstream link (dialling with backoff, non-blocking sends, credits,
 *            heartbeats and their acks: a downstream that stops reading is dropped after
 *            KVR_CREDIT_DEAD_MS, credit.h)
 *   compute  the caller's thread: takes the next input (the wait is "starved"), takes a
 *            free output slot (the wait is "blocked": downstream has not taken the previous
 *            frames), runs the batch step (step.h, "held") and sends the result itself
 *            when nothing is queued ahead of it, else hands it to the I/O thread
 * Neither sleeps nor polls: an idle stage wakes only for heartbeats.
 * All buffers are sized from the plan at start-up.
 *
 * When the upstream link is lost or replaced, every sequence's state is stale (the bridge
 * re-opens and re-prefills what it still needs): the stage frees all KV and sampling
 * state and sends a RESET frame downstream, ahead of any frame it computes afterwards;
 * later stages pass it on, so the bridge learns at once (DESIGN.md 8). A batch the stage
 * cannot run (a sequence it no longer has, or at the tail a logits row with no token to
 * sample: step.h) is dropped the same way, with a RESET naming it. At the tail, REPLAY
 * records restore a re-opened sequence's sampler.
 *
 * Re-planning (DESIGN.md 8, docs/PROTOCOL.md 6a): the listening socket also accepts the
 * bridge's control link. Over it the bridge probes the stage (GOODBYE) or sends a REPLAN
 * frame (the next epoch and the stages kept); a stage kept by a valid one acknowledges it,
 * stops both threads and starts again inside kvr_stage_run under the new plan (propose.h
 * kvr_plan_replan), at its new index, with its new layers from the model file it keeps
 * open. Each life has one plan, which does not change while it runs.
 *
 * A spare (options.spare, docs/PLAN.md "Spare stages") holds no layers: it listens on its
 * spare address for the bridge's control links only, answers probes, and when a REPLAN
 * takes it into the ring in a lost stage's place, acknowledges it and starts its first life
 * as that stage of the new plan (the lost stage's layers, loaded from its own model file). */
#ifndef KVR_RING_STAGE_H
#define KVR_RING_STAGE_H

#include "core/err.h"
#include "model/engine.h"
#include "ring/plan.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct kvr_stage_options {
    uint32_t index; /* which stage of the plan this process is (with spare: which spare) */
    bool spare;     /* a spare stage: waits until a re-plan gives it a slice (below) */
    /* A warm standby of stage `index` on the same host: loads the slice, then listens on the
     * stage's address as soon as the process there has died and becomes the stage (only
     * then linking to its neighbours), so a dead stage is replaced without a load. */
    bool standby;
    uint32_t n_threads; /* compute threads; 0 = from the plan (stage, then plan default, 1) */
};

/* The engine configuration stage `index` of `plan` runs with (its layers, the plan's rows,
 * sequences, context and KV cache, its threads). */
void kvr_stage_engine_config(const struct kvr_plan *plan, uint32_t index,
                             struct kvr_engine_config *cfg);

/* Run the stage (through any re-plans) until *stop becomes non-zero (set by a signal handler, which
 * then calls kvr_stage_signal_stop so the stage notices at once). The plan must be valid. Returns 0
 * after an orderly stop or a negative status with `err` set when the stage cannot start (model,
 * memory, address in use). */
int kvr_stage_run(const struct kvr_plan *plan, const struct kvr_stage_options *opt,
                  atomic_int *stop, struct kvr_err *err);

/* Wake the running stage to look at its stop flag. Async-signal-safe (one write to an
 * eventfd); a no-op when no stage runs. */
void kvr_stage_signal_stop(void);

#endif
