/* test_step.c - a stage's batch step (ring/step.h) at the tail of a 2-stage ring on a tiny
 * synthetic model: a BATCH frame is encoded and decoded as the link would, then run.
 *
 * The regression it guards: a logits row with no finite value (here from NaN boundary
 * rows) has no token to sample. The step must fail the batch with a message, never build a
 * RESULT with token -1 (which the bridge's decoder refuses, dropping the link), and the
 * step must run the next batch once the stage has dropped its sequences. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "../support/tiny_model.h"

#include "model/arch.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "model/logprobs.h"
#include "ring/propose.h"
#include "ring/stage.h"
#include "ring/step.h"
#include "ring/wire.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_TOKENS 3

struct rig {
    char *buf;
    size_t len;
    struct kvr_gguf *g;
    struct kvr_hparams hp;
    struct kvr_plan plan;
    struct kvr_engine *engine;
    struct kvr_step step;
    struct kvr_step_out out;
    struct kvr_wire_limits lim;
    struct kvr_wire_frame frame;
    uint8_t *wire;   /* one encoded frame */
    size_t wire_cap; /* bytes */
};

static void rig_init(struct rig *r)
{
    memset(r, 0, sizeof *r);
    kvr_test_tiny_model("step-test", 5, &r->buf, &r->len, &r->g, &r->hp);
    struct kvr_err err = {0};
    struct kvr_plan_spec spec = {
        .n_stages = 2, .model_path = "x.gguf", .row_width = 16, .max_seqs = 4, .n_ctx = 64};
    if (kvr_plan_propose(&r->plan, r->g, &spec, &err))
        fail_msg("propose: %s", err.msg);
    struct kvr_engine_config cfg;
    kvr_stage_engine_config(&r->plan, 1, &cfg);
    if (kvr_engine_create(&r->engine, r->g, &cfg, &err))
        fail_msg("engine: %s", err.msg);
    if (kvr_step_init(&r->step, &r->plan, 1, r->engine, &r->hp, NULL, &err))
        fail_msg("step: %s", err.msg);
    assert_true(r->step.is_tail);
    if (kvr_wire_limits_init(&r->lim, &r->plan, r->hp.n_embd, r->hp.n_vocab, 1, &err) ||
        kvr_step_out_init(&r->step, &r->out, &r->lim, &err) ||
        kvr_wire_frame_init(&r->frame, &r->lim, &err))
        fail_msg("limits: %s", err.msg);
    r->wire_cap = r->lim.max_frame_bytes;
    r->wire = aligned_alloc(16, (r->wire_cap + 15) / 16 * 16);
    assert_non_null(r->wire);
}

static void rig_fini(struct rig *r)
{
    free(r->wire);
    kvr_wire_frame_fini(&r->frame);
    kvr_step_out_fini(&r->out);
    kvr_step_fini(&r->step);
    kvr_engine_destroy(r->engine);
    kvr_gguf_close(r->g);
    free(r->buf);
}

/* The OPEN's flags when a test sets them (>= 0), else those run_batch chooses. */
static int64_t open_flags = -1;

/* Run a BATCH that opens sequence `seq` (greedy, or at temperature 0.8 with logprobs) on
 * KV block `block` and prefills N_TOKENS boundary rows, every value `x`, wanting a token.
 * Returns kvr_step_run's status; err says why on failure. */
static int run_batch(struct rig *r, uint64_t batch_id, uint32_t seq, uint32_t block, bool greedy,
                     float x, struct kvr_err *err)
{
    struct kvr_sample_params sp;
    kvr_sample_params_default(&sp);
    sp.temperature = greedy ? 0.0f : 0.8f;
    sp.seed = 11;
    struct kvr_wire_ctrl ctrl[2] = {
        {.type = KVR_WIRE_CTRL_OPEN,
         .seq = seq,
         .flags = open_flags >= 0 ? (uint32_t)open_flags
                  : greedy        ? 0
                                  : KVR_WIRE_OPEN_LOGPROBS,
         .sampling = sp},
        {.type = KVR_WIRE_CTRL_MAP, .seq = seq, .map = {.n_ids = 1, .ids = {block}}},
    };
    struct kvr_seg seg = {.seq = seq,
                          .pos0 = 0,
                          .n_tokens = N_TOKENS,
                          .flags = KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN};
    size_t n = (size_t)N_TOKENS * r->hp.n_embd;
    float *rows = malloc(n * sizeof *rows);
    uint8_t *payload = malloc(n * sizeof *rows);
    assert_true(rows && payload);
    for (size_t i = 0; i < n; i++)
        rows[i] = x;
    kvr_wire_rows_from_f32(r->lim.rows_payload, rows, n, payload);
    struct kvr_wire_timing t0 = {.stage = 0, .held_ns = 1};
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .batch_id = batch_id,
                             .ctrl = ctrl,
                             .n_ctrl = 2,
                             .segs = &seg,
                             .n_segs = 1,
                             .payload = r->lim.rows_payload,
                             .payload_data = payload,
                             .payload_bytes = n * kvr_wire_payload_elem_bytes(r->lim.rows_payload),
                             .timings = &t0,
                             .n_timings = 1};
    size_t len = 0;
    struct kvr_err e = {0};
    if (kvr_wire_encode_flat(&m, r->wire, r->wire_cap, &len, &e))
        fail_msg("encode: %s", e.msg);
    struct kvr_wire_header h;
    if (kvr_wire_decode_header(r->wire, &r->lim, &h, &e) ||
        kvr_wire_decode_body(&r->frame, &h, r->wire + KVR_WIRE_HEADER_BYTES,
                             len - KVR_WIRE_HEADER_BYTES, &r->lim, &e))
        fail_msg("decode: %s", e.msg);
    free(rows);
    free(payload);
    return kvr_step_run(&r->step, &r->frame, &r->out, err);
}

/* A finite batch gives one result with a token inside the vocabulary. */
static void expect_token(struct rig *r, uint64_t batch_id, uint32_t seq, uint32_t block,
                         bool greedy)
{
    struct kvr_err err = {0};
    if (run_batch(r, batch_id, seq, block, greedy, 0.25f, &err))
        fail_msg("batch %llu: %s", (unsigned long long)batch_id, err.msg);
    assert_int_equal(r->out.msg.type, KVR_WIRE_RESULT);
    assert_int_equal(r->out.msg.n_results, 1);
    assert_int_equal(r->out.results[0].seq, seq);
    assert_true(r->out.results[0].token >= 0);
    assert_true((uint32_t)r->out.results[0].token < r->hp.n_vocab);
}

/* A NaN logits row fails the batch (greedy and sampled), with a message naming the
 * sequence; after the stage drops its sequences, as stage.c does on any failed batch, the
 * step runs the next batch. */
static void test_degenerate_logits_fail_the_batch(void **state)
{
    (void)state;
    struct rig r;
    rig_init(&r);
    expect_token(&r, 1, 0, 0, true);
    kvr_step_reset(&r.step);
    for (int greedy = 1; greedy >= 0; greedy--) {
        struct kvr_err err = {0};
        int rc = run_batch(&r, 2, 1, 1, greedy, NAN, &err);
        if (rc != KVR_EINVAL)
            fail_msg("%s: a NaN logits row gave status %d and %u results (token %d)",
                     greedy ? "greedy" : "sampled", rc, r.out.msg.n_results,
                     r.out.msg.n_results ? r.out.results[0].token : 0);
        assert_non_null(strstr(err.msg, "sequence 1"));
        assert_non_null(strstr(err.msg, "no finite value"));
        kvr_step_reset(&r.step);
        expect_token(&r, 3, 2, 2, greedy);
        kvr_step_reset(&r.step);
    }
    rig_fini(&r);
}

/* A sequence that asks for logprobs and 5 alternatives gets log_softmax of the tail's own
 * logits row (model/logprobs.h), bit for bit, and the same token as without them. */
static void test_logprobs_from_the_tail_row(void **state)
{
    (void)state;
    struct rig r;
    rig_init(&r);
    const uint32_t flags[3] = {0, KVR_WIRE_OPEN_LOGPROBS,
                               KVR_WIRE_OPEN_LOGPROBS | 5u << KVR_WIRE_TOP_SHIFT};
    int32_t tokens[3];
    for (int k = 0; k < 3; k++) {
        open_flags = flags[k];
        expect_token(&r, 1 + (uint64_t)k, 0, 0, false);
        const struct kvr_wire_result *res = &r.out.results[0];
        tokens[k] = res->token;
        struct kvr_token_logprob want[5];
        double lse = 0;
        assert_int_equal(kvr_logprobs_top(r.step.logits, (int32_t)r.hp.n_vocab, 5, want, &lse), 5);
        assert_int_equal(res->n_top, k == 2 ? 5 : 0);
        assert_int_equal(res->flags & KVR_WIRE_RESULT_LOGPROB, k ? KVR_WIRE_RESULT_LOGPROB : 0);
        if (k)
            assert_true(res->logprob == kvr_logprobs_token(r.step.logits, res->token, lse));
        if (k == 2)
            assert_memory_equal(res->top, want, sizeof want);
        kvr_step_reset(&r.step);
    }
    assert_int_equal(tokens[0], tokens[1]);
    assert_int_equal(tokens[0], tokens[2]);
    open_flags = -1;
    rig_fini(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_degenerate_logits_fail_the_batch),
        cmocka_unit_test(test_logprobs_from_the_tail_row),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
