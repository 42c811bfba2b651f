/* step.h - a stage's work on one batch, with no I/O (DESIGN.md 3, 5): apply the batch's
 * control records, run the layer slice on exactly its membership, sample at the tail, and
 * build the frame that goes on (boundary rows to the next stage, or results to the
 * bridge), with the stage's timing record appended. The stage agent (stage.c) is the shell
 * that receives frames into its input slots, calls kvr_step_run on each, times it, and
 * sends what it built; this module never touches a socket, a lock or the clock.
 *
 * The input is the received frame itself (kvr_link_recv_into decoded it in the slot): the
 * head reads its token ids straight from the frame's payload, other stages their f32 rows
 * (f16/bf16 rows are widened once, into a buffer of the step). The output is a struct
 * kvr_step_out: a wire message whose records and rows live in the out struct, sent from
 * there with no further copy (f16/bf16 rows are narrowed once, for the wire).
 *
 * State: the tail keeps one sampler per sequence slot (OPEN sets it up, REPLAY restores
 * it, FREE/CANCEL drop it); every stage's KV lives in its engine. Everything is allocated
 * by kvr_step_init / kvr_step_out_init.
 *
 * Threads: one thread (the compute thread) uses a step and its outs at a time. */
#ifndef KVR_RING_STEP_H
#define KVR_RING_STEP_H

#include "core/err.h"
#include "model/engine.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "ring/plan.h"
#include "ring/step_grammar.h"
#include "ring/wire.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_step {
    struct kvr_engine *engine; /* borrowed: this stage's layer slice */
    const struct kvr_tok *tok; /* borrowed, tail only (may be NULL): flags EOG */
    uint32_t index, n_stages, max_seqs, row_width, n_embd, n_vocab;
    bool is_head, is_tail;
    uint32_t rows_payload; /* the plan's wire dtype as a payload type */
    float *rows_in;        /* non-head, f16/bf16 wire: [row_width x n_embd] */
    /* Tail only. */
    struct kvr_sampler *samplers; /* [max_seqs] */
    bool *open;                   /* [max_seqs] a sequence is open in this slot */
    bool *want_logprobs;          /* [max_seqs] */
    struct kvr_sample_scratch *scratch;
    float *logits;                     /* [row_width x n_vocab] */
    struct kvr_step_grammars grammars; /* constrained sequences (GRAMMAR records) */
};

/* One frame to send on, built by kvr_step_run. */
struct kvr_step_out {
    struct kvr_wire_msg msg;               /* points at the arrays below */
    struct kvr_wire_ctrl *ctrl;            /* [max_ctrl] */
    struct kvr_seg *segs;                  /* [max_segs] */
    struct kvr_wire_timing *timings;       /* [n_stages + 1] */
    struct kvr_wire_timing *agent_timings; /* [upstream's agent records + the plan's agents] */
    struct kvr_wire_result *results;       /* tail: [max_segs] */
    float *rows;                           /* non-tail: [row_width x n_embd] engine output */
    void *wire_rows;                       /* non-tail, f16/bf16 wire: the rows narrowed */
};

/* Set up the step of stage `index` of `plan` over `engine` (whose hparams give n_embd and
 * n_vocab); `up` are the limits of what this stage receives. */
int kvr_step_init(struct kvr_step *st, const struct kvr_plan *plan, uint32_t index,
                  struct kvr_engine *engine, const struct kvr_hparams *hp,
                  const struct kvr_tok *tok, struct kvr_err *err);
void kvr_step_fini(struct kvr_step *st);
int kvr_step_out_init(const struct kvr_step *st, struct kvr_step_out *o,
                      const struct kvr_wire_limits *up, struct kvr_err *err);
void kvr_step_out_fini(struct kvr_step_out *o);

/* Drop every sequence (KV and samplers): the upstream changed, or a batch failed. */
void kvr_step_reset(struct kvr_step *st);
/* Whether any sequence holds KV blocks. */
bool kvr_step_has_sequences(const struct kvr_step *st);

/* Run one received BATCH frame into *o. On failure nothing is built and err says why; the
 * caller drops the batch and its sequences and sends a RESET naming the batch (stage.h).
 * The failures: a segment the engine refuses, a token wanted from a sequence never opened,
 * and a logits row with no finite value (all NaN or -inf), where the sampler has no token
 * to choose (KVR_EINVAL). The last is not sent as a result: no token id would be true, and
 * the bridge treats an id outside the vocabulary as a broken peer and drops the link. The
 * RESET keeps the links up; the bridge holds and re-prefills the batch's sequences, and one
 * that keeps failing ends with an error once its hold runs out. */
int kvr_step_run(struct kvr_step *st, const struct kvr_wire_frame *in, struct kvr_step_out *o,
                 struct kvr_err *err);

/* Append the expert agents' records (experts.h) for this batch to a built frame, after
 * this stage's (at most the plan's n_agents per batch). */
void kvr_step_time_agents(struct kvr_step_out *o, const struct kvr_wire_timing *t, uint32_t n);

/* Append this stage's timing record to a built frame. */
void kvr_step_time(const struct kvr_step *st, struct kvr_step_out *o, uint64_t starved_ns,
                   uint64_t blocked_ns, uint64_t held_ns);

#endif
