/* fake_ring.h - a fake ring and a stream recorder around the scheduler (bridge/sched.h),
 * shared by tests/unit/test_sched.c and tests/fuzz/fuzz_sched.c (fake_ring.c).
 *
 * The fake ring carries copies of the batches the scheduler builds, in order, and answers
 * the oldest with a RESULT frame. The stages' KV is modelled: MAP records set each
 * sequence's block table, every row writes its token into its block, and a segment that
 * wants a token gets token = mix(every token in its sequence's blocks up to its last
 * position), read through the table. So a sequence's continuation depends only on its own
 * tokens, as with batch invariance, a re-prefill after a recovery must give the tokens the
 * lost decodes would have, and a prefix-cache hit gives the same tokens as computing the
 * prefix only if the blocks it maps hold exactly that prefix. Each stage is said to have held the
 * batch for 1 ms + 0.1 ms per row; the clock is the harness's own (`now`), advanced by the caller.
 *
 * Checked on every step, into h->fail (first failure wins):
 *   - no stream event after a stream's end, exactly one END before the DETACH, none after;
 *   - the stages' view (FREE, OPEN and segments in the order they were sent): OPEN only on
 *     a slot that is not open (FREE precedes any re-OPEN), segments and REPLAY only on an
 *     open slot;
 *   - a sequence wants a token from at most one live batch in the ring;
 *   - KV: a segment continues its sequence (pos0 == positions it has, or rewrites the rows a
 *     DRAFTS segment drafted), within its mapped blocks, and never writes a block another
 *     open sequence maps; DRAFT records name exactly a DRAFTS segment's drafted rows, which
 *     the tail keeps as the real one does (model/spec_accept.h, greedy);
 *   - kvr_sched_check (KV accounting, in-flight counts, slots and wait queue). */
#ifndef KVR_TESTS_FAKE_RING_H
#define KVR_TESTS_FAKE_RING_H

#include "bridge/sched.h"
#include "core/err.h"

#include <stdbool.h>
#include <stdint.h>

#define SH_MAX_SEQS 8
#define SH_MAX_ROWS 64
#define SH_MAX_MB 4
#define SH_RING_CAP 8 /* batches the fake ring holds: the window and stale ones after a RESET */
#define SH_MAX_REQS 32
#define SH_MAX_PROMPT 200
#define SH_MAX_GEN 64
#define SH_BT 16                        /* KV block size of the plans */
#define SH_MAX_BLOCKS_SEQ (256 / SH_BT) /* n_ctx 256 */
#define SH_MAX_CTRL ((3 + (SH_MAX_BLOCKS_SEQ + 6) / 7) * SH_MAX_SEQS)
#define SH_MAX_KV 512       /* KV blocks a plan may have */
#define SH_MAX_GRAMMAR 4096 /* grammar bytes a request may have */
#define SH_VOCAB 512
#define SH_EOG 2 /* the fake model's end-of-generation token */
#define SH_MS 1000000ull

struct sh_req {
    struct kvr_sched_req r;
    int32_t prompt[SH_MAX_PROMPT];
    int32_t gen[SH_MAX_GEN];
    int32_t seen[SH_MAX_GEN]; /* tokens the stream delivered, in order */
    uint32_t n_seen;
    bool used; /* submitted and admitted */
    bool ended, detached;
    enum kvr_gen_finish finish;
    char message[KVR_GEN_MSG_BYTES];
};

struct sh_batch {
    uint64_t id;
    uint32_t n_ctrl, n_segs, n_rows;
    struct kvr_wire_ctrl ctrl[SH_MAX_CTRL];
    struct kvr_seg segs[SH_MAX_ROWS];
    int32_t tokens[SH_MAX_ROWS];
};

struct sh {
    struct kvr_plan plan;
    struct kvr_sched *s;
    uint64_t now;
    uint64_t starved_ns; /* the next result's stages report this long idle before it */
    struct sh_req reqs[SH_MAX_REQS];
    struct sh_batch ring[SH_RING_CAP]; /* batches in the fake ring, oldest at ring_head */
    uint32_t ring_head, n_ring;
    bool links_up;
    bool open[SH_MAX_SEQS]; /* the stages' view */
    uint32_t table[SH_MAX_SEQS][SH_MAX_BLOCKS_SEQ], n_mapped[SH_MAX_SEQS], n_pos[SH_MAX_SEQS];
    int32_t kv[SH_MAX_KV][SH_BT]; /* the token each block position holds */
    uint32_t shared_prefix;       /* sh_submit: prompt tokens every request shares */
    const char *grammar;          /* sh_submit: the request's grammar text (NULL: none) */
    char grammar_got[SH_MAX_SEQS][SH_MAX_GRAMMAR]; /* the stages' view: GRAMMAR pieces */
    uint32_t n_grammar_got[SH_MAX_SEQS];
    uint32_t n_replay_ids[SH_MAX_SEQS]; /* REPLAY ids since the OPEN */
    uint64_t prompt_of;                 /* sh_submit: the requests' prompt_of (sched.h) */
    const int32_t *prediction;          /* sh_submit: every request's prediction (may be NULL) */
    uint32_t n_prediction;
    uint32_t n_drafted[SH_MAX_SEQS];  /* the stages' view: DRAFT ids of the batch being seen */
    uint32_t rewritable[SH_MAX_SEQS]; /* ... rows the last DRAFTS segment drafted */
    uint64_t n_batches_sent, n_results;
    struct sh_batch last; /* the last batch sent */
    char fail[256];
};

/* Record the first failure into h->fail. */
void sh_failf(struct sh *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The scheduler's event callback: records each stream, checks the event order. */
void sh_on_event(void *ctx, struct kvr_sched_req *r, const struct kvr_sched_event *ev);
/* A plan of `mb` micro-batches, `rows` row width, `seqs` slots, `blocks` KV blocks of 16. */
int sh_init(struct sh *h, uint32_t mb, uint32_t rows, uint32_t seqs, uint32_t blocks,
            bool admission);
/* The same with speculation in `spec` mode (sched.h). */
int sh_init_spec(struct sh *h, uint32_t mb, uint32_t rows, uint32_t seqs, uint32_t blocks,
                 bool admission, enum kvr_spec_mode spec);
void sh_check(struct sh *h);
/* Whether seq's request has a grammar the stages have not all received (GRAMMAR). */
bool sh_grammar_pending(const struct sh *h, uint32_t seq);
/* The stages see a batch: check it against their view and apply its records. */
void sh_stage_view(struct sh *h, const struct sh_batch *bt);
/* Take every batch the scheduler has to send (the head always has a credit). */
void sh_pump(struct sh *h);
/* The fake model: a token from a sequence's tokens at positions 0..n-1. */
uint32_t sh_mix(uint32_t x, int32_t token, uint32_t pos);
int32_t sh_model_out(uint32_t x);
int32_t sh_model_tokens(const int32_t *tokens, uint32_t n);
/* ... as the stages compute it: through seq's blocks, positions 0..pos. */
int32_t sh_model(const struct sh *h, uint32_t seq, uint32_t pos);
/* The oldest batch in the ring comes back as a RESULT: kvr_sched_result's status, or
 * KVR_EINVAL when the ring holds no batch. */
int sh_deliver(struct sh *h);
/* The oldest batch is lost in the ring without a word. */
void sh_drop(struct sh *h);
void sh_link_up(struct sh *h);
void sh_link_down(struct sh *h, const char *why);
void sh_tick(struct sh *h, uint64_t advance_ns);
/* Submit request slot i: `n_prompt` tokens derived from i, `max_tokens`. Returns what
 * kvr_sched_submit returned. */
int sh_submit(struct sh *h, uint32_t i, uint32_t n_prompt, uint32_t max_tokens, float temperature,
              float repeat_penalty, uint32_t first_ms, uint32_t total_ms, struct kvr_refusal *why);
void sh_cancel(struct sh *h, uint32_t i);
/* Deliver results until the ring is empty and nothing more goes out (at most `max`). */
void sh_run(struct sh *h, uint32_t max);
void sh_fini(struct sh *h);

#endif
