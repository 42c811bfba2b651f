/* test_spec_step.c - speculation through every stage of a ring (ring/step.h), in one
 * process: 2 and 3 stages of a tiny synthetic model, each stage's step run on frames
 * encoded and decoded as the links would, driven by a minimal bridge.
 *
 * The answer decoded with drafted rows (some right, some wrong, so every stage writes KV
 * rows that are later rejected) must be the answer decoded one token per lap: greedy and
 * sampled with a seed. A rejected row is dropped only by the next segment's position, which
 * truncates every stage's cache there (model/kv.h); a stale row attended to would change
 * the logits, and so the tokens. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "../support/tiny_model.h"

#include "model/engine.h"
#include "model/spec_accept.h"
#include "ring/propose.h"
#include "ring/stage.h"
#include "ring/step.h"
#include "ring/wire.h"

#include <stdlib.h>
#include <string.h>

#define MAX_STAGES 3
#define N_PROMPT 5
#define N_GEN 40

struct ring {
    char *buf;
    size_t len;
    struct kvr_gguf *g;
    struct kvr_hparams hp;
    struct kvr_plan plan;
    uint32_t n;
    struct kvr_engine *engine[MAX_STAGES];
    struct kvr_step step[MAX_STAGES];
    struct kvr_step_out out[MAX_STAGES];
    struct kvr_wire_limits lim[MAX_STAGES];
    struct kvr_wire_frame frame[MAX_STAGES];
    uint8_t *wire;
    size_t wire_cap;
};

static void ring_init(struct ring *r, uint32_t n_stages)
{
    memset(r, 0, sizeof *r);
    r->n = n_stages;
    kvr_test_tiny_model_layers("spec-test", 7, n_stages, &r->buf, &r->len, &r->g, &r->hp);
    struct kvr_err err = {0};
    struct kvr_plan_spec spec = {
        .n_stages = n_stages, .model_path = "x.gguf", .row_width = 24, .max_seqs = 2, .n_ctx = 64};
    if (kvr_plan_propose(&r->plan, r->g, &spec, &err))
        fail_msg("propose: %s", err.msg);
    for (uint32_t i = 0; i < n_stages; i++) {
        struct kvr_engine_config cfg;
        kvr_stage_engine_config(&r->plan, i, &cfg);
        if (kvr_engine_create(&r->engine[i], r->g, &cfg, &err) ||
            kvr_step_init(&r->step[i], &r->plan, i, r->engine[i], &r->hp, NULL, &err) ||
            kvr_wire_limits_init(&r->lim[i], &r->plan, r->hp.n_embd, r->hp.n_vocab, (int)i, &err) ||
            kvr_step_out_init(&r->step[i], &r->out[i], &r->lim[i], &err) ||
            kvr_wire_frame_init(&r->frame[i], &r->lim[i], &err))
            fail_msg("stage %u: %s", i, err.msg);
        if (r->lim[i].max_frame_bytes > r->wire_cap)
            r->wire_cap = r->lim[i].max_frame_bytes;
    }
    r->wire = aligned_alloc(16, (r->wire_cap + 15) / 16 * 16);
    assert_non_null(r->wire);
}

static void ring_fini(struct ring *r)
{
    free(r->wire);
    for (uint32_t i = 0; i < r->n; i++) {
        kvr_wire_frame_fini(&r->frame[i]);
        kvr_step_out_fini(&r->out[i]);
        kvr_step_fini(&r->step[i]);
        kvr_engine_destroy(r->engine[i]);
    }
    kvr_gguf_close(r->g);
    free(r->buf);
}

/* One batch round the ring: returns the tail's RESULT message (valid until the next). */
static const struct kvr_wire_msg *lap(struct ring *r, const struct kvr_wire_msg *m)
{
    struct kvr_wire_msg cur = *m;
    for (uint32_t i = 0; i < r->n; i++) {
        size_t len = 0;
        struct kvr_wire_header h;
        struct kvr_err err = {0};
        if (kvr_wire_encode_flat(&cur, r->wire, r->wire_cap, &len, &err) ||
            kvr_wire_decode_header(r->wire, &r->lim[i], &h, &err) ||
            kvr_wire_decode_body(&r->frame[i], &h, r->wire + KVR_WIRE_HEADER_BYTES,
                                 len - KVR_WIRE_HEADER_BYTES, &r->lim[i], &err) ||
            kvr_step_run(&r->step[i], &r->frame[i], &r->out[i], &err))
            fail_msg("stage %u: %s", i, err.msg);
        kvr_step_time(&r->step[i], &r->out[i], 0, 0, 1);
        cur = r->out[i].msg;
    }
    return &r->out[r->n - 1].msg;
}

/* Drafts for the step that has produced n tokens: up to k of the reference answer, with
 * the one at `wrong` (if any) replaced. */
struct drafting {
    const int32_t *ref; /* NULL: no speculation */
    uint32_t k;
    uint32_t every_wrong; /* every so many drafted tokens, one is wrong (0: none) */
};

/* Decode N_GEN tokens of one sequence, each lap with the drafts `d` gives. Returns the
 * drafted tokens kept, over all laps. */
static uint32_t decode(struct ring *r, float temperature, const struct drafting *d, int32_t *out)
{
    struct kvr_sample_params sp;
    kvr_sample_params_default(&sp);
    sp.temperature = temperature;
    sp.seed = 42;
    struct kvr_wire_ctrl ctrl[4] = {{.type = KVR_WIRE_CTRL_OPEN, .seq = 1, .sampling = sp},
                                    {.type = KVR_WIRE_CTRL_MAP, .seq = 1}};
    uint32_t nb = (r->plan.n_ctx + r->plan.kv_block_tokens - 1) / r->plan.kv_block_tokens;
    assert_true(nb <= KVR_WIRE_MAP_IDS);
    ctrl[1].map.n_ids = nb;
    for (uint32_t b = 0; b < nb; b++)
        ctrl[1].map.ids[b] = nb + b; /* slot 1's blocks, not 0..: ids are the bridge's choice */
    int32_t tokens[24];
    for (uint32_t i = 0; i < N_PROMPT; i++)
        tokens[i] = (int32_t)(10 + 17 * i);
    struct kvr_seg seg = {1, 0, N_PROMPT,
                          KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN};
    struct kvr_wire_timing none[1];
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .batch_id = 1,
                             .ctrl = ctrl,
                             .n_ctrl = 2,
                             .segs = &seg,
                             .n_segs = 1,
                             .payload = KVR_WIRE_PAYLOAD_TOKENS,
                             .payload_data = tokens,
                             .payload_bytes = N_PROMPT * 4,
                             .timings = none};
    uint32_t n = 0, kept = 0, drafted = 0;
    while (n < N_GEN) {
        const struct kvr_wire_msg *res = lap(r, &m);
        assert_true(res->n_results >= 1 && res->n_results <= seg.n_tokens);
        kept += res->n_results - 1;
        for (uint32_t j = 0; j < res->n_results && n < N_GEN; j++)
            out[n++] = res->results[j].token;
        /* The next decode row: the last token at its position, then the drafts. */
        seg = (struct kvr_seg){1, N_PROMPT + n - 1, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
        tokens[0] = out[n - 1];
        m.n_ctrl = 0;
        uint32_t k = d->ref ? d->k : 0;
        k = n + k < N_GEN ? k : N_GEN - n;
        if (k > 0) {
            seg.n_tokens = 1 + k;
            seg.flags |= KVR_SEG_DRAFTS;
            for (uint32_t c = 0; c < 2; c++)
                ctrl[c] = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_DRAFT, .seq = 1};
            for (uint32_t j = 0; j < k; j++) {
                int32_t t = d->ref[n + j];
                if (d->every_wrong && ++drafted % d->every_wrong == 0)
                    t = (t + 1) % (int32_t)r->hp.n_vocab;
                tokens[1 + j] = t;
                struct kvr_wire_ctrl *c = &ctrl[j / KVR_WIRE_DRAFT_IDS];
                c->draft.ids[c->draft.n_ids++] = t;
                m.n_ctrl = j / KVR_WIRE_DRAFT_IDS + 1;
            }
        }
        m.batch_id++;
        m.payload_bytes = seg.n_tokens * 4;
    }
    /* Free the sequence everywhere, so the next decode starts clean. */
    ctrl[0] = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_FREE, .seq = 1};
    m = (struct kvr_wire_msg){.type = KVR_WIRE_BATCH,
                              .batch_id = m.batch_id,
                              .ctrl = ctrl,
                              .n_ctrl = 1,
                              .payload = KVR_WIRE_PAYLOAD_TOKENS,
                              .timings = none};
    (void)lap(r, &m);
    return kept;
}

static void same_answer(uint32_t n_stages, float temperature)
{
    struct ring r;
    ring_init(&r, n_stages);
    int32_t ref[N_GEN], got[N_GEN];
    struct drafting off = {0};
    assert_int_equal(decode(&r, temperature, &off, ref), 0);
    /* Right drafts: many tokens per lap. */
    struct drafting right = {.ref = ref, .k = 6};
    uint32_t kept = decode(&r, temperature, &right, got);
    assert_memory_equal(got, ref, sizeof ref);
    assert_true(kept >= N_GEN / 2);
    /* Every third drafted token wrong: rows rejected on every stage, then rewritten. */
    struct drafting some = {.ref = ref, .k = 5, .every_wrong = 3};
    kept = decode(&r, temperature, &some, got);
    assert_memory_equal(got, ref, sizeof ref);
    assert_true(kept > 0);
    /* All wrong: one token per lap, every drafted row rejected. */
    struct drafting wrong = {.ref = ref, .k = 12, .every_wrong = 1};
    assert_int_equal(decode(&r, temperature, &wrong, got), 0);
    assert_memory_equal(got, ref, sizeof ref);
    ring_fini(&r);
}

static void test_greedy_two_stages(void **state)
{
    (void)state;
    same_answer(2, 0.0f);
}

static void test_greedy_three_stages(void **state)
{
    (void)state;
    same_answer(3, 0.0f);
}

static void test_sampled_two_stages(void **state)
{
    (void)state;
    same_answer(2, 0.8f);
}

static void test_sampled_three_stages(void **state)
{
    (void)state;
    same_answer(3, 0.8f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_two_stages),
        cmocka_unit_test(test_greedy_three_stages),
        cmocka_unit_test(test_sampled_two_stages),
        cmocka_unit_test(test_sampled_three_stages),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
