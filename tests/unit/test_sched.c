/* test_sched.c - the bridge's scheduler (sched.h) driven with a fake clock and a fake ring
 * (tests/support/fake_ring.h): admission at and over budget, KV exhaustion and the wait
 * queue, chunked prefill next to decodes, cancellation mid-prefill, a RESET mid-batch, a
 * lost link with recovery and replay, a lost probe, and held requests that expire. Every
 * step also checks the harness's invariants (stream events, the stages' view of FREE and
 * OPEN, one token-wanting batch per sequence, kvr_sched_check). The estimate tests run a
 * pipelined fake ring (tests/support/sim_ring.h). The last test checks what the scheduler
 * feeds the console's telemetry. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "../support/fake_ring.h"
#include "../support/sim_ring.h"
#include "bridge/telemetry.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static struct sh *new_sh(uint32_t mb, uint32_t rows, uint32_t seqs, uint32_t blocks, bool admission)
{
    struct sh *h = calloc(1, sizeof *h);
    assert_non_null(h);
    assert_int_equal(sh_init(h, mb, rows, seqs, blocks, admission), 0);
    return h;
}

static void done(struct sh *h)
{
    sh_fini(h);
    if (h->fail[0])
        fail_msg("%s", h->fail);
    free(h);
}

#define OK(h)                                                                                      \
    do {                                                                                           \
        if ((h)->fail[0])                                                                          \
            fail_msg("%s", (h)->fail);                                                             \
    } while (0)

/* Bring the ring up: the probe (a control-only batch freeing every slot) goes round. */
static void ring_up(struct sh *h)
{
    assert_false(kvr_sched_ring_up(h->s));
    sh_link_up(h);
    assert_int_equal(h->n_ring, 1);
    assert_int_equal(h->ring[h->ring_head].n_segs, 0);
    assert_int_equal(h->ring[h->ring_head].n_ctrl, h->plan.max_seqs);
    assert_int_equal(h->ring[h->ring_head].ctrl[0].type, KVR_WIRE_CTRL_FREE);
    sh_run(h, 10);
    assert_true(kvr_sched_ring_up(h->s));
    OK(h);
}

/* The tokens a request gets from the fake model, computed independently of the stages'
 * KV: each follows from the prompt and the tokens before it. */
static void expected_tokens(const struct sh_req *q, uint32_t n, int32_t *out)
{
    int32_t seq[SH_MAX_PROMPT + SH_MAX_GEN];
    uint32_t np = q->r.req.n_prompt;
    memcpy(seq, q->prompt, np * sizeof *seq);
    for (uint32_t k = 0; k < n; k++)
        out[k] = seq[np + k] = sh_model_tokens(seq, np + k);
}

static void assert_stream(const struct sh_req *q, uint32_t n)
{
    int32_t want[SH_MAX_GEN];
    expected_tokens(q, n, want);
    assert_int_equal(q->n_seen, n);
    for (uint32_t k = 0; k < n; k++)
        if (q->seen[k] != want[k])
            fail_msg("token %u: %d, expected %d", k, q->seen[k], want[k]);
}

static void test_refuses_while_down(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 8, 8, 0, 1, 0, 0, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_RING_DOWN);
    assert_null(kvr_sched_next_batch(h->s, h->now)); /* no links: nothing goes out */
    ring_up(h);
    assert_int_equal(sh_submit(h, 1, 200, 60, 0, 1, 0, 0, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_TOO_LONG);
    assert_int_equal(sh_submit(h, 2, 0, 8, 0, 1, 0, 0, &why), KVR_EINVAL);
    done(h);
}

static void test_generates_in_order(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    for (uint32_t i = 0; i < 3; i++)
        assert_int_equal(sh_submit(h, 2 * i, 5 + i, 12, 0, 1, 0, 0, &why), 0);
    sh_run(h, 200);
    OK(h);
    for (uint32_t i = 0; i < 3; i++) {
        const struct sh_req *q = &h->reqs[2 * i];
        assert_true(q->detached);
        if (q->finish == KVR_GEN_FINISH_EOS) /* the fake model said EOG: stream ends there */
            assert_int_equal(q->seen[q->n_seen - 1], SH_EOG);
        else
            assert_int_equal(q->finish, KVR_GEN_FINISH_LENGTH);
        assert_stream(q, q->n_seen);
    }
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.kv_blocks_used, 0);
    assert_int_equal(st.running, 0);
    done(h);
}

/* Teach the cost model: one request runs to its end (its batches are 1 ms + 0.1 ms/row per
 * stage in the fake ring). */
static void warm_up(struct sh *h, uint32_t slot)
{
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, slot, 20, 30, 0, 1, 0, 0, &why), 0);
    sh_run(h, 500);
    OK(h);
    assert_true(h->reqs[slot].detached);
}

static void test_admission_at_and_over_budget(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, true);
    ring_up(h);
    warm_up(h, 1);
    /* A running request, so the estimate is the loaded one, not the idle ring's. */
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 3, 10, 60, 0, 1, 0, 0, &why), 0);
    /* A first-token budget of 1 ms cannot be met even on an idle ring: refused for good,
     * with no retry hint, and the message gives the idle ring's estimate. */
    assert_int_equal(sh_submit(h, 5, 40, 10, 0, 1, 1, 0, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_FIRST_TOKEN_BUDGET);
    assert_true(why.never);
    assert_int_equal(why.retry_after_ms, 0);
    uint32_t idle = 0;
    assert_int_equal(
        sscanf(why.message, "can never meet the first-token budget: estimated %u ms", &idle), 1);
    /* A budget the idle ring meets but this load does not: the refusal says by how much it
     * misses (retry_after_ms = estimate - budget + 1), which gives the estimate. */
    assert_int_equal(sh_submit(h, 5, 40, 10, 0, 1, idle + 1, 0, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_FIRST_TOKEN_BUDGET);
    assert_false(why.never);
    assert_non_null(strstr(why.message, "would miss the first-token budget"));
    uint32_t estimate = idle + 1 + why.retry_after_ms - 1;
    assert_true(estimate > 2 && estimate < 1000);
    /* Just over the budget: refused. At it (the estimate rounded up): admitted. */
    assert_int_equal(sh_submit(h, 5, 40, 10, 0, 1, estimate - 1, 0, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_FIRST_TOKEN_BUDGET);
    assert_int_equal(sh_submit(h, 5, 40, 10, 0, 1, estimate + 1, 0, &why), 0);
    /* The same for the total budget. */
    assert_int_equal(sh_submit(h, 7, 40, 60, 0, 1, 0, 1, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_TOTAL_BUDGET);
    assert_true(why.never && why.retry_after_ms == 0);
    assert_int_equal(sscanf(why.message, "can never meet the total budget: estimated %u ms", &idle),
                     1);
    assert_int_equal(sh_submit(h, 7, 40, 60, 0, 1, 0, idle + 1, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_TOTAL_BUDGET);
    assert_false(why.never);
    uint32_t total = idle + 1 + why.retry_after_ms - 1;
    assert_true(total > estimate);
    assert_int_equal(sh_submit(h, 7, 40, 60, 0, 1, 0, total - 1, &why), KVR_EAGAIN);
    assert_int_equal(sh_submit(h, 7, 40, 60, 0, 1, 0, total + 1, &why), 0);
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.refused[KVR_REFUSE_FIRST_TOKEN_BUDGET], 3);
    assert_int_equal(st.refused[KVR_REFUSE_TOTAL_BUDGET], 3);
    assert_int_equal(st.refused_never[KVR_REFUSE_FIRST_TOKEN_BUDGET], 1);
    assert_int_equal(st.refused_never[KVR_REFUSE_TOTAL_BUDGET], 1);
    sh_run(h, 1000);
    OK(h);
    assert_true(h->reqs[5].detached && h->reqs[7].detached);
    done(h);
}

/* A budget that even the idle ring misses can never be met: refused with no retry hint,
 * counted as such. One the load makes late keeps its hint. */
static void test_never_refusal_has_no_retry_hint(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, true);
    ring_up(h);
    warm_up(h, 1);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 3, 40, 10, 0, 1, 1, 0, &why), KVR_EAGAIN); /* idle ring */
    assert_int_equal(why.reason, KVR_REFUSE_FIRST_TOKEN_BUDGET);
    assert_true(why.never);
    assert_int_equal(why.retry_after_ms, 0);
    assert_non_null(strstr(why.message, "can never meet the first-token budget"));
    assert_non_null(strstr(why.message, "idle ring"));
    assert_int_equal(sh_submit(h, 5, 40, 60, 0, 1, 0, 2, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_TOTAL_BUDGET);
    assert_true(why.never && why.retry_after_ms == 0);
    /* Beyond the context: never either. */
    assert_int_equal(sh_submit(h, 7, 200, 60, 0, 1, 0, 0, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_TOO_LONG);
    assert_true(why.never && why.retry_after_ms == 0);
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.refused_never[KVR_REFUSE_FIRST_TOKEN_BUDGET], 1);
    assert_int_equal(st.refused_never[KVR_REFUSE_TOTAL_BUDGET], 1);
    assert_int_equal(st.refused_never[KVR_REFUSE_TOO_LONG], 1);
    assert_int_equal(st.refused_for_running, 0);
    done(h);
}

static void test_kv_exhaustion_and_wait_queue(void **state)
{
    (void)state;
    /* 10 blocks of 16 tokens; each request needs (40 + 24) / 16 = 4 blocks. */
    struct sh *h = new_sh(2, 16, 4, 10, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 150, 30, 0, 1, 0, 0, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_KV_FULL); /* 12 blocks: more than the ring has */
    assert_int_equal(sh_submit(h, 1, 40, 24, 0, 1, 0, 0, &why), 0);
    assert_int_equal(sh_submit(h, 3, 40, 24, 0, 1, 0, 0, &why), 0);
    assert_int_equal(sh_submit(h, 5, 40, 24, 0, 1, 0, 0, &why), 0); /* no KV left: waits */
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.kv_blocks_used, 8);
    assert_int_equal(st.running, 2);
    assert_int_equal(st.waiting, 1);
    assert_int_equal(h->reqs[5].r.seq, -1);
    /* The wait queue holds 6; the seventh waiting request is refused. */
    for (uint32_t i = 0; i < 5; i++)
        assert_int_equal(sh_submit(h, 7 + 2 * i, 40, 24, 0, 1, 0, 0, &why), 0);
    assert_int_equal(sh_submit(h, 17, 40, 24, 0, 1, 0, 0, &why), KVR_EAGAIN);
    assert_int_equal(why.reason, KVR_REFUSE_QUEUE_FULL);
    /* Everything admitted runs to its end as KV frees up. */
    sh_run(h, 5000);
    OK(h);
    for (uint32_t i = 1; i < 17; i += 2)
        assert_true(h->reqs[i].detached && h->reqs[i].finish == KVR_GEN_FINISH_LENGTH);
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.kv_blocks_used, 0);
    assert_int_equal(st.queue_count, 8);
    done(h);
}

/* The largest prefill chunk the chunking rule (pacing.c kvr_pacing_chunk_limit_ms) allows beside
 * one decode row on the harness's ring (one micro-batch, two stages holding 1 + 0.1 x rows ms, a
 * round trip of both plus 0.5 ms): the decoding stream's time between tokens, 2 x (1 + 0.1 x rows)
 * + 0.5 ms, may grow to 1.8x its decode-only 2.7 ms, and no further than its total budget affords
 * (time left / tokens to go / 1.1) unless that is below 2.7 ms. */
static uint32_t rule_max_chunk(double left_ms, uint32_t togo, bool budget)
{
    double limit = 1.8 * 2.7, gap = budget ? left_ms / togo / 1.1 : 0;
    if (budget && gap >= 2.7 && gap < limit)
        limit = gap;
    uint32_t n = 0;
    while (2 * (1 + 0.1 * (1 + n + 1)) + 0.5 <= limit + 1e-9)
        n++;
    return n;
}

/* A fake ring (`mb` micro-batches, 64 rows, `seqs` slots, `blocks` KV blocks) whose request
 * slot 3 decodes: a stream of `max_tokens` (within `total_ms` if not 0), run for `batches`
 * batches, by then `seen` tokens at least. */
static struct sh *beside_a_stream(uint32_t mb, uint32_t seqs, uint32_t blocks, uint32_t max_tokens,
                                  uint32_t total_ms, uint32_t batches, uint32_t seen)
{
    struct sh *h = new_sh(mb, 64, seqs, blocks, false);
    ring_up(h);
    warm_up(h, 1);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 3, 4, max_tokens, 0, 1, 0, total_ms, &why), 0);
    sh_run(h, batches);
    assert_true(h->reqs[3].n_seen >= seen);
    return h;
}

/* One stream decodes (total budget total_ms, 0: none) while a 200-token prompt goes in:
 * every batch carries its decode row and a chunk of at most rule_max_chunk rows, and at
 * least that less one (the cost model has learnt the ring, the chunks are not smaller than
 * the rule asks). Returns the number of chunks. */
static uint32_t chunks_beside_decodes(uint32_t total_ms)
{
    struct sh *h = beside_a_stream(1, 4, 64, 60, total_ms, 3, 2);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 5, 200, 4, 0, 1, 0, 0, &why), 0); /* a long prompt */
    uint32_t chunks = 0, prefilled = 0;
    while (prefilled < 200 && chunks < 100) {
        const struct sh_batch *bt = &h->ring[h->ring_head];
        const struct kvr_sched_req *dr = &h->reqs[3].r;
        assert_int_equal(h->n_ring, 1);
        /* The batch was built at this `now`, with this many tokens generated. */
        double left_ms = (dr->deadline_ns - h->now) / 1e6;
        uint32_t max = rule_max_chunk(left_ms, dr->req.max_tokens - dr->n_generated, total_ms);
        bool has_decode = false;
        for (uint32_t k = 0; k < bt->n_segs; k++) {
            const struct kvr_seg *g = &bt->segs[k];
            if (g->seq == (uint32_t)h->reqs[3].r.seq)
                has_decode = g->flags & KVR_SEG_DECODE;
            if (g->seq == (uint32_t)h->reqs[5].r.seq && (g->flags & KVR_SEG_PREFILL)) {
                assert_int_equal(g->pos0, prefilled);
                if (g->n_tokens > max || (g->n_tokens + 1 < max && prefilled + g->n_tokens < 200))
                    fail_msg("chunk %u at %u: %u rows, the rule allows %u (%.1f ms left)", chunks,
                             prefilled, g->n_tokens, max, left_ms);
                prefilled += g->n_tokens;
                chunks++;
            }
        }
        assert_true(has_decode);
        uint32_t before = h->reqs[3].n_seen;
        assert_int_equal(sh_deliver(h), 0);
        assert_int_equal(h->reqs[3].n_seen, before + 1); /* decode kept its pace */
        sh_pump(h);
        OK(h);
    }
    assert_int_equal(prefilled, 200);
    sh_run(h, 500);
    OK(h);
    assert_stream(&h->reqs[3], h->reqs[3].n_seen);
    assert_stream(&h->reqs[5], h->reqs[5].n_seen);
    done(h);
    return chunks;
}

static void test_chunked_prefill_beside_decodes(void **state)
{
    (void)state;
    /* No budget: the 1.8x factor binds, 9-10 rows a chunk (1.8x of the batch's own
     * decode-only time, the rule before, allowed 8). */
    uint32_t free_chunks = chunks_beside_decodes(0);
    assert_true(free_chunks >= 20 && free_chunks <= 23);
    /* A budget of 4 ms a token (60 tokens in 264 ms): about 4 rows a chunk, so the stream
     * stays on time; a roomy one (60 s) changes nothing, the factor still binds. */
    uint32_t tight_chunks = chunks_beside_decodes(264);
    print_message("chunks: %u without a budget, %u with 4 ms a token\n", free_chunks, tight_chunks);
    assert_true(tight_chunks >= free_chunks + 5);
    assert_int_equal(chunks_beside_decodes(60000), free_chunks);
}

/* The batch at the head of the fake ring: its prefill rows (of sequence `seq`, or of every
 * sequence when seq < 0), and whether it carries a decode row. */
static uint32_t head_prefill_rows(const struct sh *h, int seq, bool *has_decode)
{
    const struct sh_batch *bt = &h->ring[h->ring_head];
    uint32_t rows = 0;
    *has_decode = false;
    for (uint32_t k = 0; k < bt->n_segs; k++) {
        const struct kvr_seg *g = &bt->segs[k];
        *has_decode = *has_decode || (g->flags & KVR_SEG_DECODE);
        if ((seq < 0 || g->seq == (uint32_t)seq) && (g->flags & KVR_SEG_PREFILL))
            rows += g->n_tokens;
    }
    return rows;
}

/* The waiting share that widens chunks beside streams is a mean over the recent batches:
 * four prompts arriving at once beside one stream first get the chunk one prompt would
 * (with the share of the moment, 4 waiting over 1 decoding, the first chunk was ~4x that),
 * and the chunks widen as the queue stays. */
static void test_chunks_follow_the_recent_share(void **state)
{
    (void)state;
    struct sh *h = beside_a_stream(1, 8, 128, 64, 0, 20, 10);
    struct kvr_refusal why;
    for (uint32_t i = 4; i < 8; i++)
        assert_int_equal(sh_submit(h, i, 200, 4, 0, 1, 0, 0, &why), 0);
    uint32_t first = 0, widest = 0;
    for (uint32_t b = 0; b < 40 && h->n_ring; b++) {
        bool has_decode;
        uint32_t rows = head_prefill_rows(h, -1, &has_decode);
        if (!has_decode)
            break; /* the stream ended: the rule no longer applies */
        if (rows && !first)
            first = rows;
        widest = rows > widest ? rows : widest;
        assert_int_equal(sh_deliver(h), 0);
        sh_pump(h);
        OK(h);
    }
    print_message("prefill rows beside the stream: first batch %u, widest %u\n", first, widest);
    /* One prompt's chunk is 9-10 rows here (test_chunked_prefill_beside_decodes); this batch's
     * own share counts once beside the ~20 before it (12 rows); the share of the moment: 63. */
    assert_true(first >= 4 && first <= 16);
    assert_true(widest >= 2 * first);
    sh_run(h, 2000);
    OK(h);
    for (uint32_t i = 3; i < 8; i++)
        assert_stream(&h->reqs[i], h->reqs[i].n_seen);
    done(h);
}

/* Two micro-batches and one decoding stream: its row is in one batch at a time, so every
 * other batch has no decode row. Such a batch delays the stream as much as one with its row
 * (its next batch queues behind it), so it takes a chunk of the same rule, not the row
 * width (it took 64 rows, and the stream's gaps were a full batch's). */
static void test_chunks_beside_a_stream_in_every_batch(void **state)
{
    (void)state;
    struct sh *h = beside_a_stream(2, 4, 64, 60, 0, 4, 2);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 5, 200, 4, 0, 1, 0, 0, &why), 0); /* a long prompt */
    uint32_t prefilled = 0, n_with = 0, n_without = 0, max_with = 0, max_without = 0;
    for (uint32_t guard = 0; prefilled < 200 && guard < 400; guard++) {
        bool has_decode;
        uint32_t chunk = head_prefill_rows(h, h->reqs[5].r.seq, &has_decode);
        prefilled += chunk;
        if (chunk && prefilled < 200) { /* the last chunk is what was left */
            uint32_t *n = has_decode ? &n_with : &n_without;
            uint32_t *mx = has_decode ? &max_with : &max_without;
            (*n)++;
            *mx = chunk > *mx ? chunk : *mx;
        }
        assert_int_equal(sh_deliver(h), 0);
        sh_pump(h);
        OK(h);
    }
    assert_int_equal(prefilled, 200);
    print_message("chunks beside the stream's row: %u, at most %u rows; in the other batch: %u, "
                  "at most %u rows\n",
                  n_with, max_with, n_without, max_without);
    assert_true(n_with >= 5 && n_without >= 5);
    /* The cost model is still learning the ring (the limit grows from ~5 to ~13 ms over
     * the prompt), so the two kinds are not compared chunk by chunk: both stay far from the
     * row width. */
    assert_true(max_with < 32 && max_without < 32);
    sh_run(h, 500);
    OK(h);
    assert_stream(&h->reqs[3], h->reqs[3].n_seen);
    assert_stream(&h->reqs[5], h->reqs[5].n_seen);
    done(h);
}

static void test_prefill_takes_the_row_width_before_costs_are_known(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 64, 4, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 150, 4, 0, 1, 0, 0, &why), 0);
    /* Two chunks of the row width go into the two micro-batches (non-final chunks of one
     * sequence may follow each other through the ring); the rest waits. */
    assert_int_equal(h->n_ring, 2);
    assert_int_equal(h->ring[h->ring_head].segs[0].n_tokens, 64);
    assert_int_equal(h->ring[(h->ring_head + 1) % SH_RING_CAP].segs[0].pos0, 64);
    sh_run(h, 100);
    OK(h);
    assert_stream(&h->reqs[0], 4);
    done(h);
}

static void test_cancel_mid_prefill(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 100, 8, 0, 1, 0, 0, &why), 0);
    uint32_t slot = (uint32_t)h->reqs[0].r.seq;
    assert_int_equal(h->n_ring, 2); /* chunks 0-15 and 16-31 in flight */
    sh_cancel(h, 0);
    assert_true(h->reqs[0].ended);
    assert_int_equal(h->reqs[0].finish, KVR_GEN_FINISH_CANCELLED);
    assert_false(h->reqs[0].detached); /* its chunks are still in the ring */
    uint64_t sent = h->n_batches_sent;
    assert_int_equal(sh_deliver(h), 0);
    sh_pump(h);
    assert_int_equal(h->n_batches_sent, sent); /* no further chunk, no CANCEL yet */
    assert_false(h->reqs[0].detached);
    assert_int_equal(sh_deliver(h), 0);
    sh_pump(h);
    /* Nothing of it in flight any more: a CANCEL record goes out and the slot is free. */
    assert_int_equal(h->n_batches_sent, sent + 1);
    assert_int_equal(h->last.n_ctrl, 1);
    assert_int_equal(h->last.ctrl[0].type, KVR_WIRE_CTRL_CANCEL);
    assert_int_equal(h->last.ctrl[0].seq, slot);
    assert_int_equal(h->last.n_segs, 0);
    assert_true(h->reqs[0].detached);
    assert_int_equal(h->reqs[0].n_seen, 0);
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.kv_blocks_used, 0);
    /* The slot is reused: its next OPEN follows the CANCEL (the harness checks). */
    assert_int_equal(sh_submit(h, 2, 10, 4, 0, 1, 0, 0, &why), 0);
    assert_int_equal(h->reqs[2].r.seq, (int)slot);
    sh_run(h, 100);
    OK(h);
    assert_stream(&h->reqs[2], 4);
    /* Cancelling a request that waits for a slot ends and detaches it at once. */
    done(h);
}

static void test_cancel_while_waiting(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 1, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 10, 8, 0, 1, 0, 0, &why), 0);
    assert_int_equal(sh_submit(h, 2, 10, 8, 0, 1, 0, 0, &why), 0);
    assert_true(h->reqs[2].r.waiting);
    sh_cancel(h, 2);
    assert_true(h->reqs[2].ended && h->reqs[2].detached);
    assert_int_equal(h->reqs[2].finish, KVR_GEN_FINISH_CANCELLED);
    sh_run(h, 100);
    OK(h);
    done(h);
}

/* A held sequence's re-prefill is cut into one chunk per stage, so the chunks follow each
 * other through the ring instead of one batch crossing the stages in turn; the stream then
 * continues unchanged. */
static void test_recovery_prefill_one_chunk_per_stage(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 64, 4, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 20, 40, 0, 1, 0, 0, &why), 0);
    sh_run(h, 12);
    uint32_t seen = h->reqs[0].n_seen;
    assert_true(seen > 4);
    kvr_sched_reset(h->s, 1, KVR_WIRE_RESET_LINK, h->now);
    memset(h->open, 0, sizeof h->open);
    while (h->n_ring > 0)
        assert_int_equal(sh_deliver(h), 0); /* stale results */
    sh_pump(h);                             /* the probe */
    assert_int_equal(sh_deliver(h), 0);
    assert_true(kvr_sched_ring_up(h->s));
    sh_pump(h);
    /* Both chunks are out at once, one per stage; together they are prompt + tokens sent. */
    uint32_t total = 20 + seen, per = (total + 1) / 2;
    assert_int_equal(h->n_ring, 2);
    const struct sh_batch *a = &h->ring[h->ring_head];
    const struct sh_batch *b = &h->ring[(h->ring_head + 1) % SH_RING_CAP];
    assert_int_equal(a->n_segs, 1);
    assert_int_equal(b->n_segs, 1);
    assert_int_equal(a->segs[0].pos0, 0);
    assert_int_equal(a->segs[0].n_tokens, per);
    assert_false(a->segs[0].flags & KVR_SEG_LAST_CHUNK);
    assert_int_equal(b->segs[0].pos0, per);
    assert_int_equal(b->segs[0].n_tokens, total - per);
    assert_true(b->segs[0].flags & KVR_SEG_LAST_CHUNK);
    sh_run(h, 500);
    OK(h);
    assert_true(h->reqs[0].detached);
    assert_stream(&h->reqs[0], h->reqs[0].n_seen);
    assert_true(h->reqs[0].n_seen == 40 || h->reqs[0].finish == KVR_GEN_FINISH_EOS);
    done(h);
}

/* A stage that sat idle for longer than the telemetry window reports the whole gap as the
 * starved time of the next batch: its starved share over the window still stays within 1. */
static void test_starved_share_after_a_long_idle(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 6, 4, 0, 1, 0, 0, &why), 0);
    sh_run(h, 100);
    h->now += 10 * 1000000000ull; /* ten idle seconds, the last window closed by a tick */
    kvr_sched_tick(h->s, h->now);
    assert_int_equal(sh_submit(h, 1, 6, 40, 0, 1, 0, 0, &why), 0);
    sh_pump(h);
    h->starved_ns = 10 * 1000000000ull;
    assert_int_equal(sh_deliver(h), 0);
    h->now += 2100 * 1000000ull; /* a tick closes the window that batch fell in */
    kvr_sched_tick(h->s, h->now);
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    for (uint32_t i = 0; i < 2; i++) {
        assert_true(st.stage[i].starved_frac > 0);
        assert_true(st.stage[i].starved_frac <= 1.0);
    }
    sh_run(h, 500);
    OK(h);
    done(h);
}

/* A RESET arrives while two batches are in flight: their results are stale, the ring is
 * probed again, the sequences re-prefilled, and every stream continues unchanged. */
static void test_reset_mid_batch(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 6, 20, 0, 1, 0, 0, &why), 0);
    assert_int_equal(sh_submit(h, 1, 9, 20, 0, 1, 0, 0, &why), 0);
    sh_run(h, 8);
    assert_int_equal(h->n_ring, 2);
    uint32_t seen0 = h->reqs[0].n_seen, seen1 = h->reqs[1].n_seen;
    assert_true(seen0 > 0 && seen1 > 0);
    kvr_sched_reset(h->s, 1, KVR_WIRE_RESET_LINK, h->now);
    memset(h->open, 0, sizeof h->open); /* stage 1 dropped everything */
    assert_false(kvr_sched_ring_up(h->s));
    /* The two batches come back (stages before and after the reset passed them): their
     * tokens are not taken. */
    assert_int_equal(sh_deliver(h), 0);
    assert_int_equal(sh_deliver(h), 0);
    assert_int_equal(h->reqs[0].n_seen, seen0);
    assert_int_equal(h->reqs[1].n_seen, seen1);
    /* The probe goes out, alone, and brings the ring up. */
    sh_pump(h);
    assert_int_equal(h->n_ring, 1);
    assert_int_equal(h->last.n_segs, 0);
    assert_int_equal(h->last.n_ctrl, 4);
    assert_int_equal(sh_deliver(h), 0);
    assert_true(kvr_sched_ring_up(h->s));
    sh_pump(h);
    /* Re-prefill: prompt + generated tokens from position 0 (16 rows: one of them may
     * need a second chunk). */
    const struct sh_batch *first = &h->ring[h->ring_head];
    assert_int_equal(first->n_segs, 2);
    for (uint32_t k = 0; k < 2; k++) {
        const struct kvr_seg *g = &first->segs[k];
        uint32_t want = g->seq == (uint32_t)h->reqs[0].r.seq ? 6 + seen0 : 9 + seen1;
        assert_int_equal(g->pos0, 0);
        assert_true(g->flags & KVR_SEG_PREFILL);
        if (g->flags & KVR_SEG_LAST_CHUNK)
            assert_int_equal(g->n_tokens, want);
        else
            assert_true(g->n_tokens < want);
    }
    /* A failed batch that was already given up on changes nothing. */
    kvr_sched_reset(h->s, 1, 0, h->now);
    assert_true(kvr_sched_ring_up(h->s));
    sh_run(h, 500);
    OK(h);
    for (uint32_t i = 0; i < 2; i++) {
        assert_true(h->reqs[i].detached);
        assert_stream(&h->reqs[i], h->reqs[i].n_seen);
        assert_true(h->reqs[i].n_seen == 20 || h->reqs[i].finish == KVR_GEN_FINISH_EOS);
    }
    done(h);
}

/* A link drops while a sampled, penalised request decodes: after the ring is whole again,
 * REPLAY records (the draws, then the last generated ids) come before its last prefill
 * chunk, and its stream continues with the tokens it would have had. */
static void test_recovery_and_replay(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 1, 5, 40, 0.8f, 1.3f, 0, 0, &why), 0);
    sh_run(h, 12);
    uint32_t seen = h->reqs[1].n_seen;
    assert_true(seen >= 10);
    sh_link_down(h, "the tail closed its link");
    assert_false(kvr_sched_ring_up(h->s));
    assert_null(kvr_sched_next_batch(h->s, h->now));
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.inflight, 0);
    assert_int_equal(st.running, 1); /* held, not failed */
    sh_tick(h, 5000 * SH_MS);        /* 5 s later the ring is still broken: still held */
    assert_false(h->reqs[1].ended);
    sh_link_up(h);
    sh_run(h, 1); /* the probe */
    assert_true(kvr_sched_ring_up(h->s));
    /* The first batch after the probe: OPEN, REPLAY with the draws and every generated id
     * (fewer than the window), and the prefill of prompt + generated up to the last row,
     * whose chunk (with the token) only goes once the sampler is restored. */
    const struct sh_batch *bt = &h->ring[h->ring_head];
    assert_true(bt->n_ctrl >= 2);
    assert_int_equal(bt->ctrl[0].type, KVR_WIRE_CTRL_OPEN);
    uint32_t n_ids = 0, n_draws = 0;
    int32_t ids[SH_MAX_GEN];
    for (uint32_t i = 1; i < bt->n_ctrl; i++) {
        if (bt->ctrl[i].type == KVR_WIRE_CTRL_MAP)
            continue; /* its blocks */
        assert_int_equal(bt->ctrl[i].type, KVR_WIRE_CTRL_REPLAY);
        n_draws += bt->ctrl[i].replay.n_draws;
        for (uint32_t k = 0; k < bt->ctrl[i].replay.n_ids; k++)
            ids[n_ids++] = bt->ctrl[i].replay.ids[k];
    }
    assert_int_equal(n_draws, seen);
    assert_int_equal(n_ids, seen);
    for (uint32_t k = 0; k < seen; k++)
        assert_int_equal(ids[k], h->reqs[1].seen[k]);
    uint32_t rows = 0;
    for (uint32_t b = 0; b < h->n_ring; b++)
        rows += h->ring[(h->ring_head + b) % SH_RING_CAP].n_rows;
    assert_true(rows <= 5 + seen);
    sh_run(h, 500);
    OK(h);
    assert_true(h->reqs[1].detached);
    assert_stream(&h->reqs[1], h->reqs[1].n_seen);
    assert_int_equal(h->reqs[1].n_seen, 40);
    done(h);
}

/* A request with a grammar: GRAMMAR records bring its text to the stages before its first
 * token is wanted, over several batches when it is long (the fake ring's stage view fails
 * a token wanted or a REPLAY sent before the whole text); after a recovery the text comes
 * again and REPLAY carries every generated id even without penalties, since the tail's
 * grammar state replays from all of them. */
static void test_grammar_records(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    ring_up(h);
    static char g[3000];
    for (size_t k = 0; k + 1 < sizeof g; k++)
        g[k] = (char)('a' + k % 26);
    h->grammar = g;
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 1, 5, 40, 0.0f, 1.0f, 0, 0, &why), 0);
    h->grammar = NULL;
    assert_int_equal(sh_submit(h, 2, 5, 40, 0.0f, 1.0f, 0, 0, &why), 0); /* free, beside it */
    sh_run(h, 30);
    OK(h);
    uint32_t seen = h->reqs[1].n_seen;
    assert_true(seen >= 5);
    assert_stream(&h->reqs[2], h->reqs[2].n_seen);
    sh_link_down(h, "the tail closed its link");
    sh_link_up(h);
    sh_run(h, 1); /* the probe */
    uint32_t slot = (uint32_t)h->reqs[1].r.seq;
    sh_run(h, 500);
    OK(h);
    assert_int_equal(h->n_grammar_got[slot], sizeof g - 1); /* sent again after the OPEN */
    assert_int_equal(h->n_replay_ids[slot], seen);
    assert_int_equal(h->reqs[1].n_seen, 40);
    assert_stream(&h->reqs[1], 40);
    done(h);
}

static void test_lost_probe_and_lost_batch(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    sh_link_up(h);
    sh_drop(h); /* a stage had no downstream yet and dropped the probe */
    uint64_t sent = h->n_batches_sent;
    sh_tick(h, 400 * SH_MS);
    assert_int_equal(h->n_batches_sent, sent); /* not yet */
    sh_tick(h, 200 * SH_MS);
    assert_int_equal(h->n_batches_sent, sent + 1); /* another probe */
    sh_run(h, 1);
    assert_true(kvr_sched_ring_up(h->s));
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 6, 30, 0, 1, 0, 0, &why), 0);
    sh_run(h, 4);
    uint32_t seen = h->reqs[0].n_seen;
    /* A batch vanishes in the ring: 15 s later the scheduler gives up on it. */
    sh_drop(h);
    assert_int_equal(h->n_ring, 0);
    uint64_t next = kvr_sched_tick(h->s, h->now);
    assert_true(next > h->now && next <= h->now + 15000 * SH_MS);
    sh_tick(h, 15001 * SH_MS);
    assert_false(kvr_sched_ring_up(h->s));
    assert_int_equal(h->n_ring, 1); /* the probe */
    sh_run(h, 500);
    OK(h);
    assert_true(h->reqs[0].n_seen > seen);
    assert_stream(&h->reqs[0], h->reqs[0].n_seen);
    done(h);
}

static void test_held_requests_expire(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 6, 30, 0, 1, 0, 0, &why), 0);
    assert_int_equal(sh_submit(h, 1, 6, 30, 0, 1, 0, 8000, &why), 0);
    sh_run(h, 2);
    sh_link_down(h, "the head closed its link");
    assert_int_equal(kvr_sched_tick(h->s, h->now), h->reqs[1].r.submit_ns + 8000 * SH_MS);
    sh_tick(h, 8000 * SH_MS);
    assert_true(h->reqs[1].ended);
    assert_int_equal(h->reqs[1].finish, KVR_GEN_FINISH_ERROR);
    assert_non_null(strstr(h->reqs[1].message, "budget"));
    assert_false(h->reqs[0].ended);
    sh_tick(h, 22100 * SH_MS);
    assert_true(h->reqs[0].ended);
    assert_non_null(strstr(h->reqs[0].message, "30 s"));
    /* Ended while the ring was down: detached at the next recovery or at shutdown. */
    done(h);
}

/* The prefix cache (DESIGN.md 12): requests that share a prefix with an earlier one map its
 * blocks (MAP with n_cached) and prefill only the rest; the fake stages compute every token
 * from the KV they hold, so the streams equal the ones computed from the tokens alone only
 * if the mapped blocks hold exactly the shared prefix. Later turns of a conversation
 * (prompt = earlier prompt + answer + more) hit the answer's blocks too. */
static void test_prefix_reuse(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 32, 4, 64, false);
    h->shared_prefix = 40; /* two whole blocks and a half */
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 70, 8, 0, 1, 0, 0, &why), 0);
    assert_int_equal(h->reqs[0].r.n_cached, 0); /* nothing cached yet */
    sh_run(h, 2000);
    OK(h);
    assert_stream(&h->reqs[0], 8);
    struct kvr_sched_stats st;
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.kv_blocks_used, 0);
    assert_int_equal(st.kv_blocks_cached, 4); /* 70 + 8 - 1 positions written: 4 whole */
    /* Three more, each sharing the 40-token prefix: 2 blocks found, 38 + 32 computed. */
    uint64_t rows_before = st.prompt_tokens;
    for (uint32_t i = 1; i <= 3; i++) {
        assert_int_equal(sh_submit(h, i, 70, 8, i == 2 ? 0.7f : 0, 1, 0, 0, &why), 0);
        assert_int_equal(h->reqs[i].r.n_cached, 32);
    }
    sh_run(h, 2000);
    OK(h);
    for (uint32_t i = 1; i <= 3; i++)
        assert_stream(&h->reqs[i], 8);
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.prompt_tokens - rows_before, 3 * (70 - 32));
    assert_int_equal(st.prefix_queries, 4 * 70);
    assert_int_equal(st.prefix_hits, 3 * 32);
    /* A prompt that is the whole of an earlier sequence, its answer and more: every whole
     * block of it is found (the answer's ones too), and at least one token is computed. */
    struct sh_req *q = &h->reqs[4];
    memset(q, 0, sizeof *q);
    memcpy(q->prompt, h->reqs[0].prompt, 70 * sizeof(int32_t));
    memcpy(q->prompt + 70, h->reqs[0].seen, 7 * sizeof(int32_t));
    q->prompt[77] = 5;
    q->r.req = (struct kvr_gen_request){.prompt = q->prompt, .n_prompt = 78, .max_tokens = 4};
    kvr_sample_params_default(&q->r.req.sampling);
    q->r.req.sampling.temperature = 0;
    q->r.generated = q->gen;
    q->r.user = q;
    assert_int_equal(kvr_sched_submit(h->s, &q->r, h->now, &why), 0);
    q->used = true;
    sh_pump(h);
    assert_int_equal(q->r.n_cached, 64);
    sh_run(h, 2000);
    OK(h);
    assert_stream(q, 4);
    /* A flush forgets the cached blocks: KV use falls to 0, nothing is found any more. */
    assert_true(kvr_sched_flush_cache(h->s) > 0);
    kvr_sched_stats(h->s, &st);
    assert_int_equal(st.kv_blocks_used + st.kv_blocks_cached, 0);
    assert_int_equal(sh_submit(h, 5, 70, 8, 0, 1, 0, 0, &why), 0);
    assert_int_equal(h->reqs[5].r.n_cached, 0);
    sh_run(h, 2000);
    OK(h);
    assert_stream(&h->reqs[5], 8);
    /* A long shared prefix: 9 cached blocks, more than one MAP record names. */
    h->shared_prefix = 150;
    assert_int_equal(sh_submit(h, 6, 180, 8, 0, 1, 0, 0, &why), 0);
    sh_run(h, 2000);
    assert_int_equal(sh_submit(h, 7, 180, 8, 0, 1, 0, 0, &why), 0);
    assert_int_equal(h->reqs[7].r.n_cached, 144);
    sh_run(h, 2000);
    OK(h);
    assert_stream(&h->reqs[6], 8);
    assert_stream(&h->reqs[7], 8);
    done(h);
}

/* Eviction under pressure: blocks for only a few sequences at a time and many more
 * requests, all sharing a prefix. Cached blocks never keep a request waiting (they are
 * evicted least recently used), every request finishes with the right tokens, and KV use
 * returns to the cached-only level, then 0 after a flush. Without the cache, the same
 * requests give the same tokens. */
static void test_prefix_eviction_under_pressure(void **state)
{
    (void)state;
    int32_t with_cache[16][SH_MAX_GEN];
    uint32_t n_with_cache[16];
    for (int cache = 1; cache >= 0; cache--) {
        struct sh *h = calloc(1, sizeof *h);
        assert_non_null(h);
        assert_int_equal(sh_init(h, 2, 32, 4, 22, false), 0); /* 22 blocks: 4 x 5 and 2 */
        if (!cache) {
            kvr_sched_destroy(h->s);
            struct kvr_sched_config cfg = {.plan = &h->plan,
                                           .max_ctrl = SH_MAX_CTRL,
                                           .max_waiting = 16,
                                           .event = sh_on_event,
                                           .event_ctx = h};
            struct kvr_err err = {0};
            assert_int_equal(kvr_sched_create(&h->s, &cfg, &err), 0);
        }
        h->shared_prefix = 33;
        ring_up(h);
        struct kvr_refusal why;
        for (uint32_t i = 0; i < 6; i++) /* the queue holds 6 */
            assert_int_equal(sh_submit(h, i, 50 + i * 5, 20, 0, 1, 0, 0, &why), 0);
        uint32_t next = 6;
        for (uint32_t round = 0; round < 4000 && !h->fail[0]; round++) {
            sh_run(h, 1);
            struct kvr_sched_stats st;
            kvr_sched_stats(h->s, &st);
            if (st.waiting < 6 && next < 16) {
                assert_int_equal(sh_submit(h, next, 50 + next * 5 % 40, 20, 0, 1, 0, 0, &why), 0);
                next++;
            }
            /* The oldest waiting request waits only if its blocks do not fit in what no
             * running sequence uses (cached blocks count as room): waiting for blocks
             * only the cache holds would be a leak of capacity. */
            for (uint32_t i = 0; i < next && st.running < 4; i++) {
                if (!h->reqs[i].r.waiting)
                    continue;
                uint32_t need = (h->reqs[i].r.req.n_prompt + 20 + 15) / 16;
                if (need <= st.kv_blocks_total - st.kv_blocks_used)
                    fail_msg("request %u waits for %u blocks with %u of %u in use", i, need,
                             st.kv_blocks_used, st.kv_blocks_total);
                break;
            }
        }
        OK(h);
        for (uint32_t i = 0; i < 16; i++) {
            const struct sh_req *q = &h->reqs[i];
            if (!q->detached ||
                (q->finish != KVR_GEN_FINISH_LENGTH && q->finish != KVR_GEN_FINISH_EOS))
                fail_msg("cache %d: request %u: detached %d, finish %d, %s", cache, i, q->detached,
                         q->finish, q->message);
            assert_stream(q, q->n_seen);
            if (cache) {
                memcpy(with_cache[i], q->seen, sizeof with_cache[i]);
                n_with_cache[i] = q->n_seen;
            } else {
                assert_int_equal(q->n_seen, n_with_cache[i]);
                assert_memory_equal(with_cache[i], q->seen, q->n_seen * sizeof(int32_t));
            }
        }
        struct kvr_sched_stats st;
        kvr_sched_stats(h->s, &st);
        assert_int_equal(st.kv_blocks_used, 0);
        if (cache) {
            assert_true(st.prefix_hits > 0);
            assert_true(st.prefix_evicted > 0);
            assert_true(st.kv_blocks_cached > 0);
        } else {
            assert_int_equal(st.prefix_hits, 0);
            assert_int_equal(st.kv_blocks_cached, 0);
        }
        kvr_sched_flush_cache(h->s);
        kvr_sched_stats(h->s, &st);
        assert_int_equal(st.kv_blocks_used + st.kv_blocks_cached, 0);
        done(h);
    }
}

static void test_result_mismatch(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 6, 30, 0, 1, 0, 0, &why), 0);
    /* Results out of order: the ring lost a batch; the shell must drop its links. */
    struct sh_batch tmp = h->ring[h->ring_head];
    h->ring[h->ring_head] = h->ring[(h->ring_head + 1) % SH_RING_CAP];
    h->ring[(h->ring_head + 1) % SH_RING_CAP] = tmp;
    assert_int_equal(sh_deliver(h), KVR_EPROTO);
    sh_link_down(h, "result mismatch");
    sh_link_up(h);
    sh_run(h, 500);
    OK(h);
    assert_stream(&h->reqs[0], h->reqs[0].n_seen);
    done(h);
}

/* ---- estimate accuracy on a pipelined fake ring (tests/support/sim_ring.h) ------------ */

static int cmp_err(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Share of a ratio histogram's counts (difference b - a) within [0.75, 1.25]. */
static double sim_share(const uint64_t *a, const uint64_t *b, uint64_t *n_out)
{
    uint64_t n = 0, in = 0;
    for (uint32_t i = 0; i <= KVR_SCHED_RATIO_BUCKETS; i++) {
        uint64_t c = b[i] - a[i];
        n += c;
        /* buckets (0.75, 0.9], (0.9, 1], (1, 1.1], (1.1, 1.25] */
        if (i > 0 && i < KVR_SCHED_RATIO_BUCKETS && kvr_sched_ratio_bounds[i - 1] >= 0.75 &&
            kvr_sched_ratio_bounds[i] <= 1.25)
            in += c;
    }
    *n_out = n;
    return n ? (double)in / (double)n : 0;
}

/* The 90th percentile of errs[0..n) (sorts them). */
static double sim_p90(double *errs, uint32_t n)
{
    if (n == 0)
        return 0;
    qsort(errs, n, sizeof *errs, cmp_err);
    uint32_t k = (uint32_t)ceil(0.9 * n);
    return errs[k > 0 ? k - 1 : 0];
}

#define BURST_FIRST_MS 17500
#define BURST_TOTAL_MS 24000

#define SIM_LEVELS 6
static const double sim_levels[SIM_LEVELS] = {0.2, 0.35, 0.5, 0.75, 1.0, 1.2};

struct sim_level {
    uint32_t sent, refused, n;
    double p90_first, p90_total;     /* of |estimate / actual - 1| over the level's answers */
    double share_first, share_total; /* of the histograms' counts within +-25% */
};

/* The sweep of bench/estimates.sh on the fake ring: capacity from a closed loop of 32
 * clients (no budgets, 120 s after 30 s of start), then Poisson arrivals at each level with
 * 2 s / 6 s budgets, 150 s of mean arrivals each, 5 s idle between levels. */
static double sim_sweep(struct sim *m, uint64_t seed, uint32_t prompt_max, struct sim_level *out)
{
    sim_init(m, seed, prompt_max);
    print_message("seed %llu, ", (unsigned long long)seed);
    if (getenv("KVR_SIM_FUTURES")) /* appends: both sweeps go to one file */
        assert_non_null(m->futures = fopen(getenv("KVR_SIM_FUTURES"), "a"));
    uint32_t sent = 0, refused = 0;
    for (uint32_t i = 0; i < SIM_SEQS; i++)
        assert_true(sim_submit(m, true, SIM_SERVE_FIRST_MS, SIM_SERVE_TOTAL_MS));
    sim_run(m, 0, m->now + 30000 * SH_MS, 0, 0, &sent, &refused);
    uint32_t c0 = m->completed;
    uint64_t t0 = m->now;
    sim_run(m, 0, m->now + 120000 * SH_MS, 0, 0, &sent, &refused);
    double capacity = (m->completed - c0) / ((m->now - t0) / 1e9);
    for (uint32_t i = 0; i < SIM_REQS; i++)
        m->req[i].closed_loop = false;
    m->resubmit = 0;
    sim_drain(m);
    print_message("prompts 32-%u: capacity %.2f req/s\n", prompt_max, capacity);
    for (uint32_t l = 0; l < SIM_LEVELS; l++) {
        struct sim_level *o = &out[l];
        struct kvr_sched_stats a, b;
        m->now += 5000 * SH_MS;
        kvr_sched_tick(m->s, m->now);
        kvr_sched_stats(m->s, &a);
        double rate = capacity * sim_levels[l];
        m->n_err = 0;
        o->sent = o->refused = 0;
        sim_run(m, rate, m->now + (uint64_t)(150 / rate * 1e9), 2000, 6000, &o->sent, &o->refused);
        sim_drain(m);
        kvr_sched_stats(m->s, &b);
        uint64_t nf, nt;
        o->share_first = sim_share(a.first_ratio_hist, b.first_ratio_hist, &nf);
        o->share_total = sim_share(a.total_ratio_hist, b.total_ratio_hist, &nt);
        o->n = m->n_err;
        o->p90_first = sim_p90(m->err_first, m->n_err);
        o->p90_total = sim_p90(m->err_total, m->n_err);
        print_message("%.2fx (%.2f req/s): %u/%u refused; %u answers, p90 |est/actual - 1| "
                      "first token %.2f, whole %.2f; within 25%%: %.0f%%, %.0f%%\n",
                      sim_levels[l], rate, o->refused, o->sent, o->n, o->p90_first, o->p90_total,
                      100 * o->share_first, 100 * o->share_total);
        if (getenv("KVR_TEST_VERBOSE"))
            for (uint32_t i = 0; i <= KVR_SCHED_RATIO_BUCKETS; i++)
                print_message("  <= %.2f: first %llu, total %llu\n",
                              i < KVR_SCHED_RATIO_BUCKETS ? kvr_sched_ratio_bounds[i] : 99.0,
                              (unsigned long long)(b.first_ratio_hist[i] - a.first_ratio_hist[i]),
                              (unsigned long long)(b.total_ratio_hist[i] - a.total_ratio_hist[i]));
    }
    kvr_sched_shutdown(m->s, "test over", m->now);
    kvr_sched_destroy(m->s);
    if (m->futures)
        fclose(m->futures);
    return capacity;
}

/* The sweep over several seeds, so that a bound guards the scheduler and not one
 * trajectory's luck (with seed 42 alone, bounds that it met failed for 7 of 8 other seeds):
 * per level, the requests and refusals summed, the p90s and shares their means over the
 * seeds. KVR_SIM_SEED=N runs seed N alone; the futures experiment runs seed 42 alone.
 * KVR_SIM_DUMP=1 prints every measured answer's prompt, estimates and outcome (stderr). */
static void sim_sweeps(uint32_t prompt_max, struct sim_level *out)
{
    static const uint64_t seeds[] = {42, 1, 2, 3, 4, 5};
    uint32_t n_seeds = sizeof seeds / sizeof seeds[0];
    uint64_t one = 42;
    const char *env = getenv("KVR_SIM_SEED");
    if (env || getenv("KVR_SIM_FUTURES")) {
        one = env ? strtoull(env, NULL, 10) : 42;
        n_seeds = 1;
    }
    struct sim *m = calloc(1, sizeof *m);
    assert_non_null(m);
    memset(out, 0, SIM_LEVELS * sizeof *out);
    for (uint32_t k = 0; k < n_seeds; k++) {
        struct sim_level lv[SIM_LEVELS];
        sim_sweep(m, n_seeds == 1 ? one : seeds[k], prompt_max, lv);
        for (uint32_t l = 0; l < SIM_LEVELS; l++) {
            out[l].sent += lv[l].sent;
            out[l].refused += lv[l].refused;
            out[l].n += lv[l].n;
            out[l].p90_first += lv[l].p90_first / n_seeds;
            out[l].p90_total += lv[l].p90_total / n_seeds;
            out[l].share_first += lv[l].share_first / n_seeds;
            out[l].share_total += lv[l].share_total / n_seeds;
        }
    }
    for (uint32_t l = 0; l < SIM_LEVELS; l++)
        print_message("%u seeds, %.2fx: %u/%u refused; mean p90 first token %.2f, whole %.2f; "
                      "within 25%%: %.0f%%, %.0f%%\n",
                      n_seeds, sim_levels[l], out[l].refused, out[l].sent, out[l].p90_first,
                      out[l].p90_total, 100 * out[l].share_first, 100 * out[l].share_total);
    free(m);
}

/* A burst of n requests at once on the pipelined ring's SIM_SEQS slots, after a few have
 * taught it its costs, each with budgets first_ms / total_ms. Returns how many were
 * admitted; *late: how many of those missed a budget; *p90: the p90 of |estimate / actual
 * - 1| of the first tokens. */
static uint32_t sim_burst(uint32_t n, uint32_t first_ms, uint32_t total_ms, uint32_t *late,
                          double *p90)
{
    struct sim *m = calloc(1, sizeof *m);
    assert_non_null(m);
    sim_init(m, 7, SIM_PROMPT_BENCH);
    uint32_t sent = 0, refused = 0;
    for (uint32_t i = 0; i < 8; i++)
        assert_true(sim_submit(m, false, 0, 0));
    sim_run(m, 0, m->now + 20000 * SIM_MS, 0, 0, &sent, &refused);
    m->n_err = m->n_late = 0;
    uint32_t admitted = 0;
    for (uint32_t i = 0; i < n; i++)
        admitted += sim_submit(m, false, first_ms, total_ms);
    sim_run(m, 0, m->now + 120000 * SIM_MS, 0, 0, &sent, &refused);
    sim_drain(m);
    assert_int_equal(m->n_err, admitted);
    *late = m->n_late;
    *p90 = sim_p90(m->err_first, m->n_err);
    kvr_sched_shutdown(m->s, "test over", m->now);
    kvr_sched_destroy(m->s);
    free(m);
    return admitted;
}

/* Requests that must wait for a slot are estimated by when the slots free up: the running
 * requests' tokens to go at the measured pace, the queue ahead served in order, their
 * prompts in one lane. A burst of 48 on 32 slots with budgets it meets (its first tokens
 * come within 13.1 s) is admitted whole, and on time. Estimated as the wait for the k-th
 * running request to end plus every prompt ahead prefilled after it, 3 were refused. */
static void test_burst_beyond_the_slots_admitted(void **state)
{
    (void)state;
    uint32_t late;
    double p90;
    uint32_t admitted = sim_burst(48, 60000, 600000, &late, &p90);
    print_message("default budgets: %u of 48 admitted, %u late, p90 |first token estimate / "
                  "actual - 1| %.2f\n",
                  admitted, late, p90);
    admitted = sim_burst(48, BURST_FIRST_MS, BURST_TOTAL_MS, &late, &p90);
    print_message("budgets %u / %u ms: %u of 48 admitted, %u late, p90 %.2f\n", BURST_FIRST_MS,
                  BURST_TOTAL_MS, admitted, late, p90);
    assert_int_equal(admitted, 48);
    assert_int_equal(late, 0);
}

/* bench/estimates.sh's mix (prompts of 32-384 tokens, each well within the 2 s budget on an
 * idle ring). Issue 15 point 4 asks for no refusal at <= 0.5x and p90 |estimate / actual -
 * 1| <= 0.25 at every level; this ring shows (six seeds, means of the p90s): refused 0/854,
 * 1/896, 22/939 at 0.2x, 0.35x, 0.5x; p90 first token 0.14-0.18 (95-97% within +-25%),
 * whole answer 0.21-0.40 (73-94%). Before the first-token estimate followed the scheduler's
 * own rule for urgent prompts (89b0d4b: a prompt whose estimate with its error could miss
 * the budget was estimated at the urgent pace, which the scheduler gives it only if it is
 * late at the streams' pace) first tokens were at 0.15-0.29 (83-96%); without the pipeline's
 * fill in prefill_eta and with the gaps taken from whole answers (04efbc7) 0.29-0.42. The
 * first-token bound is point 4's; the others are guards against regressions, not point 4,
 * which whole answers do not meet: their spread is the prompts that arrive while a request
 * decodes (they share its batches). */
static void test_estimates_on_a_pipelined_ring(void **state)
{
    (void)state;
    struct sim_level lv[SIM_LEVELS];
    sim_sweeps(SIM_PROMPT_BENCH, lv);
    uint32_t sent_light = 0, refused_light = 0;
    for (uint32_t l = 0; l < SIM_LEVELS; l++) {
        if (sim_levels[l] <= 0.5) {
            sent_light += lv[l].sent;
            refused_light += lv[l].refused;
        }
        if (lv[l].p90_first > 0.25 || lv[l].p90_total > 0.5 || lv[l].share_first < 0.85 ||
            lv[l].share_total < 0.55)
            fail_msg("%.2fx: p90 |estimate / actual - 1| first token %.2f, whole %.2f; within "
                     "25%%: %.2f, %.2f",
                     sim_levels[l], lv[l].p90_first, lv[l].p90_total, lv[l].share_first,
                     lv[l].share_total);
    }
    if (refused_light * 50 > sent_light)
        fail_msg("%u of %u refused at <= 0.5x", refused_light, sent_light);
}

/* The mix before (prompts of 32-768 tokens: the longest need ~0.9 s alone on this ring, and
 * beside decoding streams or other long prompts really take more than 2 s). Shows (six
 * seeds): refused 13/919, 65/896, 94/887 at <= 0.5x; first tokens 93-96% within +-25% (p90
 * 0.16-0.20; 89b0d4b: 81-93%, 0.20-0.31), whole answers 75-83% (p90 0.30-0.36; 04efbc7:
 * 0.36-0.61, 0.61 at 0.2x where the gaps of the capacity probe's saturated ring were still
 * the estimate's). The bounds were 80% of first tokens at <= 0.5x, 65% at every level and
 * 50% of whole answers; then 70% and 60%; now 88% of first tokens at every level. */
static void test_estimates_with_long_prompts(void **state)
{
    (void)state;
    struct sim_level lv[SIM_LEVELS];
    sim_sweeps(SIM_PROMPT, lv);
    uint32_t sent_light = 0, refused_light = 0;
    double worst_first = 1, worst_first_light = 1, worst_total = 1;
    for (uint32_t l = 0; l < SIM_LEVELS; l++) {
        if (sim_levels[l] <= 0.5) {
            sent_light += lv[l].sent;
            refused_light += lv[l].refused;
            worst_first_light = fmin(worst_first_light, lv[l].share_first);
        }
        worst_first = fmin(worst_first, lv[l].share_first);
        worst_total = fmin(worst_total, lv[l].share_total);
    }
    if (refused_light * 5 > sent_light || worst_first < 0.88 || worst_total < 0.6)
        fail_msg("refused %u of %u at <= 0.5x, within 25%%: first token %.2f (%.2f at <= "
                 "0.5x), whole %.2f at the worst level",
                 refused_light, sent_light, worst_first, worst_first_light, worst_total);
}

/* The console's telemetry (telemetry.h): requests get ids 1, 2, ...; every returned batch is
 * traced with the ids of the requests it carried; a RESET because a stage's upstream link
 * changed is a loss blamed on the stage before it, recorded once however often the outage
 * recovers in vain; the next whole ring is its recovery, with the requests it held. */
static void test_telemetry_traces_and_ring_events(void **state)
{
    (void)state;
    struct sh *h = new_sh(2, 16, 4, 64, false);
    struct kvr_telemetry *tel = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_telemetry_create(&tel, &err), 0);
    kvr_sched_destroy(h->s);
    struct kvr_sched_config cfg = {.plan = &h->plan,
                                   .max_ctrl = SH_MAX_CTRL,
                                   .max_waiting = 6,
                                   .prefix_cache = true,
                                   .event = sh_on_event,
                                   .event_ctx = h,
                                   .telemetry = tel};
    assert_int_equal(kvr_sched_create(&h->s, &cfg, &err), 0);
    ring_up(h);
    struct kvr_refusal why;
    assert_int_equal(sh_submit(h, 0, 6, 20, 0, 1, 0, 0, &why), 0);
    assert_int_equal(sh_submit(h, 1, 9, 20, 0, 1, 0, 0, &why), 0);
    assert_int_equal(h->reqs[0].r.id, 1);
    assert_int_equal(h->reqs[1].r.id, 2);
    sh_run(h, 8);
    kvr_sched_reset(h->s, 1, KVR_WIRE_RESET_LINK, h->now);
    kvr_sched_reset(h->s, 1, KVR_WIRE_RESET_LINK, h->now); /* the same outage */
    memset(h->open, 0, sizeof h->open);
    assert_int_equal(sh_deliver(h), 0);
    assert_int_equal(sh_deliver(h), 0);
    sh_pump(h);
    assert_int_equal(sh_deliver(h), 0); /* the probe: whole again */
    assert_true(kvr_sched_ring_up(h->s));
    sh_run(h, 500);
    OK(h);

    struct kvr_telemetry_snapshot *snap = malloc(sizeof *snap);
    assert_non_null(snap);
    struct kvr_telemetry_reader reader = {0};
    struct kvr_sched_stats stats;
    kvr_sched_stats(h->s, &stats);
    kvr_telemetry_take(tel, &reader, &h->plan, &stats, NULL, 0, h->now, snap);
    assert_int_equal(snap->n_events, 2);
    assert_int_equal(snap->events[0].type, KVR_TELEMETRY_EV_LOST);
    assert_int_equal(snap->events[0].stage, 0);
    assert_int_equal(snap->events[0].n_held, 2);
    assert_non_null(strstr(snap->events[0].why, "stage 1 dropped its sequences"));
    assert_int_equal(snap->events[1].type, KVR_TELEMETRY_EV_RECOVERED);
    assert_int_equal(snap->events[1].n_held, 2);
    bool named[3] = {false, false, false};
    assert_true(snap->n_traces > 0);
    for (uint32_t i = 0; i < snap->n_traces; i++) {
        const struct kvr_telemetry_trace *tr = &snap->traces[i];
        assert_int_equal(tr->n_stages, h->plan.n_stages); /* a timing record per stage */
        for (uint32_t k = 0; k < tr->n_seqs; k++) {
            assert_in_range(tr->seqs[k].req_id, 1, 2);
            named[tr->seqs[k].req_id] = true;
        }
    }
    assert_true(named[1] && named[2]);
    free(snap);
    kvr_telemetry_destroy(tel);
    done(h);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refuses_while_down),
        cmocka_unit_test(test_generates_in_order),
        cmocka_unit_test(test_admission_at_and_over_budget),
        cmocka_unit_test(test_never_refusal_has_no_retry_hint),
        cmocka_unit_test(test_kv_exhaustion_and_wait_queue),
        cmocka_unit_test(test_chunked_prefill_beside_decodes),
        cmocka_unit_test(test_chunks_beside_a_stream_in_every_batch),
        cmocka_unit_test(test_chunks_follow_the_recent_share),
        cmocka_unit_test(test_prefill_takes_the_row_width_before_costs_are_known),
        cmocka_unit_test(test_cancel_mid_prefill),
        cmocka_unit_test(test_cancel_while_waiting),
        cmocka_unit_test(test_reset_mid_batch),
        cmocka_unit_test(test_starved_share_after_a_long_idle),
        cmocka_unit_test(test_recovery_prefill_one_chunk_per_stage),
        cmocka_unit_test(test_recovery_and_replay),
        cmocka_unit_test(test_grammar_records),
        cmocka_unit_test(test_lost_probe_and_lost_batch),
        cmocka_unit_test(test_held_requests_expire),
        cmocka_unit_test(test_result_mismatch),
        cmocka_unit_test(test_prefix_reuse),
        cmocka_unit_test(test_prefix_eviction_under_pressure),
        cmocka_unit_test(test_burst_beyond_the_slots_admitted),
        cmocka_unit_test(test_estimates_on_a_pipelined_ring),
        cmocka_unit_test(test_estimates_with_long_prompts),
        cmocka_unit_test(test_telemetry_traces_and_ring_events),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
