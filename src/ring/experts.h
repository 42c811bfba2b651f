/* experts.h - expert agents (DESIGN.md 11, docs/EXPERTS.md): mixture-of-experts layers cut
 * inside themselves over the ring's fabric.
 *
 * An expert agent (`kvasir experts --plan P --index J`) holds the experts the plan's
 * "experts"[J] places on it and nothing else: no KV cache, no sequences, no sampler. The
 * stage that owns a MoE layer runs attention and the router as always; the engine then
 * hands the expert step to this module's dispatcher (kvr_experts_dispatch, a
 * kvr_moe_dispatch_fn), which
 *   1. sends one EXPERT frame to every linked agent holding an expert some row of the
 *      batch uses: those rows (f32, exactly the bits the stage would compute on) and their
 *      full routing (expert ids and weights, decided once, here); all frames are sent
 *      before any answer is waited for;
 *   2. computes, while the agents work, every pair no linked agent holds
 *      (kvr_moe_experts with that mask);
 *   3. reads each agent's EXPERT_RESULT in agent order and copies its pair rows to their
 *      pair index (row * n_used + slot).
 * The engine then adds each row's pairs in slot order (kvr_moe_combine). A pair's bits do
 * not depend on which process computed it (moe.h), so the sum, and every token, is the
 * same with any number of agents, any placement and any arrival order.
 *
 * Recovery (fallback): an agent that is not linked, whose link fails, or whose answer is
 * late (KVR_EXPERTS_RESULT_MS) or malformed is dropped and redialled in the background;
 * its pairs of the batch in hand, and of every batch until it is linked again, are
 * computed by the stage itself (every stage maps the whole model file). No sequence is
 * held and no token changes; the step is slower.
 *
 * Links: the stage dials each agent (dial.h, a thread per agent, so the compute thread
 * never waits in a connect or a handshake) and authenticates as itself; the agent accepts
 * any stage of the plan (KVR_AUTH_INDEX_ANY) and the stage checks it reached agent J. One
 * connection carries both directions, request then answer, sealed like ring links. Frame
 * bodies (payload KVR_WIRE_PAYLOAD_EXPERT, little-endian):
 *
 *   EXPERT (stage -> agent), batch_id = the link's request counter
 *     0  u32 layer         a layer the agent holds experts of
 *     4  u16 n_used        the model's expert_used_count
 *     6  u16 row_kind      0: f32 rows (the only kind so far)
 *     8  u32 n_rows        1 .. row_width
 *    12  u32 reserved      0
 *    16  n_rows x n_used x {u16 expert, u16 0, f32 weight}   every slot of every row
 *     .  n_rows x n_embd f32                                 the rows (ffn_norm output)
 *   EXPERT_RESULT (agent -> stage), batch_id = the request's
 *     0  u32 layer         the request's
 *     4  u32 n_pairs       the request's (row, slot) entries whose expert the agent holds
 *     8  u64 held_ns       the agent computing this frame
 *    16  u64 starved_ns    the agent idle before it arrived
 *    24  u64 blocked_ns    the agent sending its previous answer
 *    32  n_pairs x n_embd f32   those pairs' rows, in (row, slot) order
 * Both sides check every count, id, weight and length before use (a frame that breaks a
 * rule drops the link with a logged reason); the plan's row_width bounds every frame.
 *
 * Threads: an agent runs on the calling thread (its event loop) plus its compute pool. A
 * client is driven by its stage's compute thread only, except kvr_experts_client_stats
 * (any thread; atomics). */
#ifndef KVR_RING_EXPERTS_H
#define KVR_RING_EXPERTS_H

#include "core/err.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/moe.h"
#include "ring/plan.h"
#include "ring/wire.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define KVR_EXPERTS_HEAD_BYTES 16   /* EXPERT body before the routing */
#define KVR_EXPERTS_ROUTE_BYTES 8   /* one routing entry */
#define KVR_EXPERTS_RESULT_HEAD 32  /* EXPERT_RESULT body before the pair rows */
#define KVR_EXPERTS_RESULT_MS 10000 /* an answer later than this: the agent is lost */

/* ---- The agent process -------------------------------------------------------------- */

struct kvr_expert_agent_options {
    uint32_t index;     /* which agent of the plan's "experts" this process is */
    uint32_t n_threads; /* 0: the agent's, then the plan's threads, then 1 */
};

/* Run agent opt->index of a valid plan until *stop is set (then
 * kvr_expert_agent_signal_stop wakes it). 0 after an orderly stop; a negative status with
 * err set when it cannot start (model, placement that does not fit it, address in use). */
int kvr_expert_agent_run(const struct kvr_plan *plan, const struct kvr_expert_agent_options *opt,
                         atomic_int *stop, struct kvr_err *err);
/* Async-signal-safe; a no-op when no agent runs. */
void kvr_expert_agent_signal_stop(void);

/* ---- The owning stage's side --------------------------------------------------------- */

struct kvr_experts_client;

/* Per agent, since the client started (monotonic counters). */
struct kvr_experts_agent_stats {
    bool linked;
    uint64_t frames;         /* EXPERT frames answered */
    uint64_t pairs;          /* pairs the agent computed */
    uint64_t fallback_pairs; /* its pairs this stage computed while it was lost */
    uint64_t lost;           /* times its link was dropped */
    uint64_t held_ns;        /* the agent computing (from its answers) */
    uint64_t starved_ns;     /* the agent idle before a frame */
    uint64_t blocked_ns;     /* the agent sending answers */
    uint64_t wait_ns;        /* this stage waiting for its answers after its own pairs */
};

/* A client for stage `stage` of `plan` over the model g (hp its hparams): NULL in *out
 * (and KVR_OK) when no agent holds experts of the stage's layers. Checks that the
 * placement fits the model (MoE layers, experts < n_expert) and starts one dialler per
 * agent it uses. */
int kvr_experts_client_create(struct kvr_experts_client **out, const struct kvr_plan *plan,
                              uint32_t stage, const struct kvr_hparams *hp, const char *name,
                              struct kvr_err *err);
void kvr_experts_client_destroy(struct kvr_experts_client *c);

/* The kvr_moe_dispatch_fn (ctx = the client). */
void kvr_experts_dispatch(void *ctx, uint32_t layer, struct kvr_moe_work *w,
                          const struct kvr_moe_layer *l, const float *x, uint32_t n_rows,
                          const uint32_t *ids, const float *weights, float *pairs,
                          struct kvr_pool *pool);

/* The timing records of the agents used since the last call (one per agent that computed
 * pairs or whose pairs this stage computed: KVR_WIRE_TIMING_AGENT | j, its held, starved
 * and blocked time and pairs), into out[KVR_PLAN_MAX_AGENTS]; returns how many. The
 * stage appends them to the batch's frame (wire.h), so the bridge sees every agent's load.
 * Compute thread only. */
uint32_t kvr_experts_client_take_timings(struct kvr_experts_client *c, struct kvr_wire_timing *out);

/* Agent j's counters (any thread). false if the client does not use agent j. */
bool kvr_experts_client_stats(const struct kvr_experts_client *c, uint32_t j,
                              struct kvr_experts_agent_stats *out);

/* Checks the plan's placement against a model: every held layer is a MoE layer of it and
 * every held expert < n_expert. */
int kvr_experts_check_model(const struct kvr_plan *plan, const struct kvr_hparams *hp,
                            struct kvr_err *err);

/* The limits of an expert link's receiving end (accepting EXPERT at an agent, or
 * EXPERT_RESULT at a stage), from the plan's row_width and the model. */
int kvr_experts_limits(struct kvr_wire_limits *lim, const struct kvr_plan *plan,
                       const struct kvr_hparams *hp, bool at_agent, struct kvr_err *err);

#endif
