/* test_spec.c - speculation at the bridge (issue 37): the draft sources (bridge/draft.h)
 * and the scheduler's speculation room (bridge/spec_policy.h) under the fake ring
 * (tests/support/fake_ring.h), whose tail keeps drafts as the real one does. Greedy answers
 * must be the same tokens with speculation on or off, whatever the drafts; rejected rows
 * are rewritten (the fake stages check every rewrite and read only positions up to a row's
 * own); a recovery re-prefills only the kept tokens; the policy drafts only with spare
 * rows, and backs off a source the sequence keeps rejecting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "../support/fake_ring.h"
#include "bridge/draft.h"

#include <stdlib.h>
#include <string.h>

/* ---- the draft sources -------------------------------------------------------------------- */

static void test_prediction_alignment(void **state)
{
    (void)state;
    const int32_t pred[] = {10, 11, 12, 13, 14, 15, 16, 17};
    int32_t out[8];
    /* Empty answer: from the start. */
    assert_int_equal(kvr_draft_prediction(pred, 8, NULL, 0, 3, out), 3);
    assert_int_equal(out[0], 10);
    /* Aligned by the answer's last tokens, even after a detour. */
    const int32_t ans[] = {10, 99, 12, 13};
    assert_int_equal(kvr_draft_prediction(pred, 8, ans, 4, 8, out), 4);
    assert_int_equal(out[0], 14);
    assert_int_equal(out[3], 17);
    /* Nothing matches: no drafts. */
    const int32_t off[] = {50, 51};
    assert_int_equal(kvr_draft_prediction(pred, 8, off, 2, 8, out), 0);
    /* The end of the prediction: nothing left to propose. */
    const int32_t end[] = {16, 17};
    assert_int_equal(kvr_draft_prediction(pred, 8, end, 2, 8, out), 0);
}

static void test_prompt_lookup(void **state)
{
    (void)state;
    const int32_t prompt[] = {1, 5, 6, 7, 8, 9, 2, 3};
    const int32_t ans[] = {5, 6};
    struct kvr_draft_text t = {prompt, 8, ans, 2};
    int32_t out[4];
    assert_int_equal(kvr_draft_prompt(&t, 4, out), 4);
    assert_int_equal(out[0], 7);
    assert_int_equal(out[3], 2);
    /* The latest earlier occurrence wins; the text's own end is no occurrence. */
    const int32_t rep[] = {4, 4, 4, 4};
    struct kvr_draft_text r = {rep, 4, NULL, 0};
    assert_int_equal(kvr_draft_prompt(&r, 4, out), 1);
    const int32_t none[] = {1, 2, 3};
    struct kvr_draft_text n = {none, 3, NULL, 0};
    assert_int_equal(kvr_draft_prompt(&n, 4, out), 0);
}

static void test_suffix_source(void **state)
{
    (void)state;
    struct kvr_draft_suffix sx;
    struct kvr_err err = {0};
    assert_int_equal(kvr_draft_suffix_init(&sx, 64, 32, &err), 0);
    const int32_t a1[] = {20, 21, 22, 23, 24};
    kvr_draft_suffix_add(&sx, a1, 5);
    const int32_t ctx[] = {7, 21, 22};
    struct kvr_draft_text t = {ctx, 3, NULL, 0};
    int32_t out[8];
    /* What followed the n-gram, up to the answer's end. */
    assert_int_equal(kvr_draft_suffix_propose(&sx, &t, 8, out), 2);
    assert_int_equal(out[0], 23);
    assert_int_equal(out[1], 24);
    /* Bounded: many later answers overwrite it, and it is no longer proposed. */
    int32_t filler[16];
    for (uint32_t r = 0; r < 16; r++) {
        for (uint32_t i = 0; i < 16; i++)
            filler[i] = (int32_t)(100 + r * 16 + i);
        kvr_draft_suffix_add(&sx, filler, 16);
    }
    assert_int_equal(kvr_draft_suffix_propose(&sx, &t, 8, out), 0);
    assert_int_equal(kvr_draft_suffix_init(&(struct kvr_draft_suffix){0}, 60, 32, &err),
                     KVR_EINVAL);
    kvr_draft_suffix_fini(&sx);
}

/* ---- the scheduler with speculation -------------------------------------------------------- */

#define OK(h)                                                                                      \
    do {                                                                                           \
        if ((h)->fail[0])                                                                          \
            fail_msg("%s", (h)->fail);                                                             \
    } while (0)

static struct sh *new_sh(enum kvr_spec_mode spec, uint32_t seqs)
{
    struct sh *h = calloc(1, sizeof *h);
    assert_non_null(h);
    assert_int_equal(sh_init_spec(h, 2, 32, seqs, 128, false, spec), 0);
    sh_link_up(h);
    sh_run(h, 10);
    assert_true(kvr_sched_ring_up(h->s));
    return h;
}

static void done(struct sh *h)
{
    sh_fini(h);
    OK(h);
    free(h);
}

/* The answer request `i` (odd: EOS does not end it) gets without speculation. */
static void reference(uint32_t i, uint32_t n_prompt, uint32_t max_tokens, int32_t *out)
{
    struct sh *h = new_sh(KVR_SPEC_OFF, 4);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, i, n_prompt, max_tokens, 0, 1, 0, 0, &why), 0);
    sh_run(h, 500);
    OK(h);
    assert_int_equal(h->reqs[i].n_seen, max_tokens);
    memcpy(out, h->reqs[i].seen, max_tokens * sizeof *out);
    done(h);
}

/* Run request i with speculation and `pred` as its prediction; its stream must be `want`.
 * Returns the batches it took; *st the scheduler's counters. */
static uint64_t with_prediction(uint32_t i, const int32_t *pred, uint32_t n_pred,
                                const int32_t *want, uint32_t n, struct kvr_sched_stats *st)
{
    struct sh *h = new_sh(KVR_SPEC_AUTO, 4);
    h->prediction = pred;
    h->n_prediction = n_pred;
    uint64_t before = h->n_batches_sent;
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, i, 9, n, 0, 1, 0, 0, &why), 0);
    sh_run(h, 500);
    OK(h);
    assert_int_equal(h->reqs[i].n_seen, n);
    assert_memory_equal(h->reqs[i].seen, want, n * sizeof *want);
    kvr_sched_stats(h->s, st);
    uint64_t batches = h->n_batches_sent - before;
    done(h);
    return batches;
}

static void test_greedy_identical_with_drafts(void **state)
{
    (void)state;
    enum { N = SH_MAX_GEN };
    int32_t truth[N], half[N], junk[N];
    reference(1, 9, N, truth);
    memcpy(half, truth, sizeof half);
    for (uint32_t k = N / 2; k < N; k++)
        half[k] = (int32_t)((truth[k] + 7) % SH_VOCAB);
    for (uint32_t k = 0; k < N; k++)
        junk[k] = (int32_t)(3 + (k * 131) % (SH_VOCAB - 3));
    struct kvr_sched_stats st;
    uint64_t b_true = with_prediction(1, truth, N, truth, N, &st);
    const uint32_t P = KVR_DRAFT_PREDICTION;
    assert_true(st.spec_accepted[P] >= N - 8);
    assert_true(st.spec_accepted[P] <= st.spec_drafted[P]);
    uint64_t b_half = with_prediction(1, half, N, truth, N, &st);
    assert_true(st.spec_accepted[P] >= N / 2 - 8);
    uint64_t b_junk = with_prediction(1, junk, N, truth, N, &st);
    assert_true(st.spec_accepted[P] <= 2);
    /* A lap carries many tokens when the drafts are right. */
    assert_true(b_true * 4 < N);
    assert_true(b_true < b_half);
    assert_true(b_half < b_junk);
}

/* A useless prediction is tried, rejected, and left: few drafted tokens in all. */
static void test_backs_off_rejected_source(void **state)
{
    (void)state;
    enum { N = SH_MAX_GEN };
    int32_t truth[N], junk[N];
    reference(3, 9, N, truth);
    /* A prediction that always aligns (a repeated token the answer never has) but is
     * always wrong: each alignment fails, so only its start is drafted from. */
    for (uint32_t k = 0; k < N; k++)
        junk[k] = truth[k] == 1 ? 0 : 1;
    struct kvr_sched_stats st;
    (void)with_prediction(3, junk, N, truth, N, &st);
    assert_true(st.spec_steps[KVR_DRAFT_PREDICTION] <= 2);
}

/* Speculation off: no DRAFTS segment and no DRAFT record ever goes out. */
static void test_off_sends_no_drafts(void **state)
{
    (void)state;
    enum { N = 32 };
    int32_t truth[N];
    reference(5, 9, N, truth);
    struct sh *h = new_sh(KVR_SPEC_OFF, 4);
    h->prediction = truth;
    h->n_prediction = N;
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 5, 9, N, 0, 1, 0, 0, &why), 0);
    for (uint32_t i = 0; i < 200 && h->n_ring > 0; i++) {
        for (uint32_t k = 0; k < h->last.n_segs; k++)
            assert_false(h->last.segs[k].flags & KVR_SEG_DRAFTS);
        sh_run(h, 1);
    }
    OK(h);
    assert_memory_equal(h->reqs[5].seen, truth, sizeof truth);
    done(h);
}

/* A request waiting for a slot means no spare rows: no drafts until it has one. */
static void test_no_drafts_while_saturated(void **state)
{
    (void)state;
    enum { N = 24 };
    int32_t truth[N];
    reference(1, 9, N, truth);
    struct sh *h = new_sh(KVR_SPEC_AUTO, 1); /* one slot */
    h->prediction = truth;
    h->n_prediction = N;
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 1, 9, N, 0, 1, 0, 0, &why), 0);
    assert_int_equal(sh_submit(h, 3, 9, N, 0, 1, 0, 0, &why), 0); /* waits */
    uint32_t drafted_while_waiting = 0;
    for (uint32_t i = 0; i < 400 && h->n_ring > 0; i++) {
        struct kvr_sched_stats st;
        kvr_sched_stats(h->s, &st);
        for (uint32_t k = 0; st.waiting > 0 && k < h->last.n_segs; k++)
            drafted_while_waiting += (h->last.segs[k].flags & KVR_SEG_DRAFTS) != 0;
        sh_run(h, 1);
    }
    OK(h);
    assert_int_equal(drafted_while_waiting, 0);
    assert_memory_equal(h->reqs[1].seen, truth, sizeof truth);
    done(h);
}

/* The telemetry decides: once a window has closed in which the stages were never starved,
 * no drafts go out; when they wait for work most of the time, drafts go on. */
static uint32_t drafted_after_window(uint64_t starved_ns)
{
    enum { N = SH_MAX_GEN };
    int32_t truth[N];
    reference(1, 9, N, truth);
    struct sh *h = new_sh(KVR_SPEC_AUTO, 4);
    h->prediction = truth;
    h->n_prediction = N;
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 1, 9, N, 0, 1, 0, 0, &why), 0);
    for (uint32_t i = 0; i < 2 && h->n_ring > 0; i++) { /* the prefill, a decode row */
        h->starved_ns = starved_ns;
        assert_int_equal(sh_deliver(h), 0);
        sh_pump(h);
    }
    h->now += 2100 * SH_MS; /* the window closes at the next result */
    uint32_t drafted = 0;
    for (uint32_t i = 0; i < 200 && h->n_ring > 0; i++) {
        h->starved_ns = starved_ns;
        assert_int_equal(sh_deliver(h), 0);
        sh_pump(h);
        for (uint32_t k = 0; i > 0 && k < h->last.n_segs; k++)
            drafted += (h->last.segs[k].flags & KVR_SEG_DRAFTS) != 0;
    }
    OK(h);
    assert_memory_equal(h->reqs[1].seen, truth, sizeof truth);
    done(h);
    return drafted;
}

static void test_telemetry_decides(void **state)
{
    (void)state;
    assert_int_equal(drafted_after_window(0), 0);        /* busy: never starved */
    assert_true(drafted_after_window(2100 * SH_MS) > 0); /* idle most of the window */
}

/* The ring fails while drafted rows are in flight: the held sequence re-prefills only the
 * tokens it kept (the REPLAY records name them all, with one draw each when sampling) and
 * the answer goes on unchanged. */
static void test_recovery_with_drafts_in_flight(void **state)
{
    (void)state;
    enum { N = SH_MAX_GEN };
    int32_t truth[N];
    reference(1, 9, N, truth);
    struct sh *h = new_sh(KVR_SPEC_AUTO, 4);
    h->prediction = truth;
    h->n_prediction = N;
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 1, 9, N, 0, 1, 0, 0, &why), 0);
    bool in_flight = false;
    for (uint32_t i = 0; i < 100 && !in_flight; i++) {
        sh_run(h, 1);
        in_flight =
            h->reqs[1].n_seen > 8 && h->n_ring > 0 && (h->last.segs[0].flags & KVR_SEG_DRAFTS);
    }
    assert_true(in_flight);
    uint32_t kept = h->reqs[1].n_seen;
    sh_link_down(h, "a stage died");
    sh_link_up(h);
    sh_run(h, 1); /* the probe */
    const struct sh_batch *bt = &h->ring[h->ring_head];
    uint32_t rows = 0;
    for (uint32_t b = 0; b < h->n_ring; b++)
        rows += h->ring[(h->ring_head + b) % SH_RING_CAP].n_rows;
    assert_int_equal(bt->ctrl[0].type, KVR_WIRE_CTRL_OPEN);
    assert_true(rows <= 9 + kept); /* the prompt and the kept tokens, nothing drafted */
    sh_run(h, 500);
    OK(h);
    assert_int_equal(h->reqs[1].n_seen, N);
    assert_memory_equal(h->reqs[1].seen, truth, sizeof truth);
    done(h);
}

/* Several streams at once with predictions, some right and some not: each answer is its
 * reference, and the fake stages saw every rewrite of rejected rows. */
static void test_batched_streams(void **state)
{
    (void)state;
    enum { N = 40 };
    int32_t truth[4][N];
    for (uint32_t i = 0; i < 4; i++)
        reference(2 * i + 1, 9, N, truth[i]);
    int32_t pred[N];
    memcpy(pred, truth[0], sizeof pred); /* right for the first, wrong for the others */
    struct sh *h = new_sh(KVR_SPEC_AUTO, 4);
    h->prediction = pred;
    h->n_prediction = N;
    struct kvr_refusal why;
    for (uint32_t i = 0; i < 4; i++)
        assert_int_equal(sh_submit(h, 2 * i + 1, 9, N, 0, 1, 0, 0, &why), 0);
    sh_run(h, 1000);
    OK(h);
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(h->reqs[2 * i + 1].n_seen, N);
        assert_memory_equal(h->reqs[2 * i + 1].seen, truth[i], sizeof truth[i]);
    }
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    assert_true(st.spec_accepted[KVR_DRAFT_PREDICTION] >= N / 2);
    done(h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prediction_alignment),
        cmocka_unit_test(test_prompt_lookup),
        cmocka_unit_test(test_suffix_source),
        cmocka_unit_test(test_greedy_identical_with_drafts),
        cmocka_unit_test(test_backs_off_rejected_source),
        cmocka_unit_test(test_off_sends_no_drafts),
        cmocka_unit_test(test_no_drafts_while_saturated),
        cmocka_unit_test(test_telemetry_decides),
        cmocka_unit_test(test_recovery_with_drafts_in_flight),
        cmocka_unit_test(test_batched_streams),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
