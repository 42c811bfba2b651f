/* test_telemetry.c - batch traces and ring events go into bounded ring buffers, every
 * reader sees each once (or is told how many it missed), and a snapshot's JSON says what
 * docs/API.md says it does. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "bridge/telemetry.h"
#include "core/alloc.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Three stages of four layers; one expert agent holding layers 5..6. */
static struct kvr_plan *make_plan(void)
{
    struct kvr_plan *p = calloc(1, sizeof *p);
    p->n_stages = 3;
    for (uint32_t i = 0; i < 3; i++) {
        snprintf(p->stages[i].addr, sizeof p->stages[i].addr, "127.0.0.1:%u", 7000 + i);
        p->stages[i].first_layer = 4 * i;
        p->stages[i].last_layer = 4 * i + 3;
    }
    p->stages[1].n_threads = 2;
    p->n_threads = 4;
    p->row_width = 64;
    p->microbatches = 3;
    p->max_seqs = 8;
    p->n_ctx = 512;
    p->kv_block_tokens = 16;
    p->kv_blocks = 256;
    p->n_agents = 1;
    snprintf(p->agents[0].addr, sizeof p->agents[0].addr, "127.0.0.1:7100");
    p->agents[0].n_holds = 1;
    p->agents[0].holds[0] = (struct kvr_plan_hold){5, 6, 0, 3};
    return p;
}

/* Batch `id`: seq 1 prefills 10 rows (last chunk), seq 2 decodes one; stage i held it
 * (i + 1) ms, starved 0.5 ms, blocked 0.25 ms; the agent held it 0.125 ms for 7 pairs. */
static void record(struct kvr_telemetry *t, uint64_t id)
{
    struct kvr_seg segs[2] = {
        {1, 0, 10, KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN},
        {2, 40, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN}};
    uint64_t req_ids[2] = {100 + id, 0};
    struct kvr_wire_timing tm[3], ag = {KVR_WIRE_TIMING_AGENT | 0, 125000, 0, 0, 7};
    for (uint32_t i = 0; i < 3; i++)
        tm[i] = (struct kvr_wire_timing){i, (i + 1) * 1000000ull, 500000, 250000, 0};
    struct kvr_telemetry_batch b = {.batch_id = id,
                                    .sent_ns = id * 10000000ull,
                                    .returned_ns = id * 10000000ull + 7000000,
                                    .segs = segs,
                                    .n_segs = 2,
                                    .req_ids = req_ids,
                                    .n_ctrl = 3,
                                    .timings = tm,
                                    .n_timings = 3,
                                    .agent_timings = &ag,
                                    .n_agent_timings = 1};
    kvr_telemetry_record_batch(t, &b);
}

static json_t *to_json(const struct kvr_telemetry_snapshot *snap)
{
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    assert_int_equal(kvr_telemetry_json(snap, &b), 0);
    assert_non_null(b.data);
    assert_null(strchr(b.data, '\n')); /* one line: it goes out as one SSE data field */
    json_error_t e;
    json_t *j = json_loads(b.data, 0, &e);
    if (!j)
        fail_msg("snapshot is not JSON: %s (%s)", e.text, b.data);
    kvr_sbuf_fini(&b);
    return j;
}

static void test_snapshot_json(void **state)
{
    (void)state;
    struct kvr_telemetry *t;
    assert_int_equal(kvr_telemetry_create(&t, NULL), 0);
    struct kvr_plan *plan = make_plan();
    struct kvr_sched_stats st;
    memset(&st, 0, sizeof st);
    st.ring_up = true;
    st.n_stages = 3;
    st.stage[1] = (struct kvr_sched_stage_stats){2000000, 1000000, 0, 0.5, 0.25, 0.125};
    st.kv_blocks_used = 10;
    st.kv_blocks_cached = 5;
    st.kv_blocks_total = 256;
    st.prefix_queries = 100;
    st.prefix_hits = 48;
    st.refused[KVR_REFUSE_KV_FULL] = 2;
    st.refused[KVR_REFUSE_FIRST_TOKEN_BUDGET] = 1;
    st.tokens_per_s = 123.456789;
    st.n_agents = 1;
    st.agent[0].pairs = 70;
    struct kvr_telemetry_stage_state states[3] = {
        {"up", 1000000, ""}, {"down", 2000000, "link lost"}, {"up", 1000000, ""}};
    record(t, 1);
    record(t, 2);
    kvr_telemetry_ring_event(t, KVR_TELEMETRY_EV_LOST, 1, 3, "stage 1 dropped its link", 30000000);
    kvr_telemetry_ring_event(t, KVR_TELEMETRY_EV_RECOVERED, -1, 3, NULL, 95000000);

    struct kvr_telemetry_snapshot *snap = kvr_malloc(sizeof *snap);
    struct kvr_telemetry_reader rd = {0, 0};
    kvr_telemetry_take(t, &rd, plan, &st, states, 3, 100000000, snap);
    snap->interval_ms = 100;
    json_t *j = to_json(snap);

    assert_int_equal(json_integer_value(json_object_get(j, "v")), 1);
    assert_true(json_real_value(json_object_get(j, "t_ms")) == 100.0);
    json_t *ring = json_object_get(j, "ring");
    assert_true(json_is_true(json_object_get(ring, "up")));
    json_t *stages = json_object_get(ring, "stages");
    assert_int_equal(json_array_size(stages), 3);
    json_t *s1 = json_array_get(stages, 1);
    assert_string_equal(json_string_value(json_object_get(s1, "addr")), "127.0.0.1:7001");
    assert_int_equal(json_integer_value(json_array_get(json_object_get(s1, "layers"), 0)), 4);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(s1, "layers"), 1)), 7);
    assert_int_equal(json_integer_value(json_object_get(s1, "threads")), 2);
    assert_int_equal(json_integer_value(json_object_get(json_array_get(stages, 0), "threads")), 4);
    assert_string_equal(json_string_value(json_object_get(s1, "state")), "down");
    assert_string_equal(json_string_value(json_object_get(s1, "error")), "link lost");
    assert_true(json_real_value(json_object_get(s1, "held")) == 0.5);
    assert_true(json_real_value(json_object_get(s1, "starved")) == 0.25);
    assert_true(json_real_value(json_object_get(s1, "blocked")) == 0.125);
    assert_int_equal(json_integer_value(json_object_get(s1, "kv_blocks")), 15);
    /* The agent holds layers 5..6: it is drawn beside stage 1 only. */
    assert_int_equal(json_array_size(json_object_get(s1, "agents")), 1);
    assert_int_equal(json_array_size(json_object_get(json_array_get(stages, 0), "agents")), 0);
    json_t *ag = json_array_get(json_object_get(ring, "agents"), 0);
    assert_string_equal(json_string_value(json_object_get(ag, "addr")), "127.0.0.1:7100");
    assert_int_equal(json_integer_value(json_array_get(json_object_get(ag, "stages"), 0)), 1);
    assert_int_equal(json_integer_value(json_object_get(ag, "pairs")), 70);

    json_t *sch = json_object_get(j, "sched");
    assert_true(json_real_value(json_object_get(sch, "tokens_per_s")) == 123.4568);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(sch, "refused"), "kv_full")), 2);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(sch, "refused"), "first_token_budget")),
        1);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(sch, "prefix_cache"), "hits")), 48);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(sch, "kv_blocks"), "total")), 256);

    json_t *batches = json_object_get(j, "batches");
    assert_int_equal(json_array_size(batches), 2);
    json_t *b2 = json_array_get(batches, 1);
    assert_int_equal(json_integer_value(json_object_get(b2, "id")), 2);
    assert_true(json_real_value(json_object_get(b2, "sent_ms")) == 20.0);
    assert_true(json_real_value(json_object_get(b2, "returned_ms")) == 27.0);
    assert_int_equal(json_integer_value(json_object_get(b2, "prefill_rows")), 10);
    assert_int_equal(json_integer_value(json_object_get(b2, "decode_rows")), 1);
    json_t *q0 = json_array_get(json_object_get(b2, "seqs"), 0);
    json_t *q1 = json_array_get(json_object_get(b2, "seqs"), 1);
    assert_string_equal(json_string_value(json_object_get(q0, "kind")), "prefill");
    assert_int_equal(json_integer_value(json_object_get(q0, "req")), 102);
    assert_true(json_is_true(json_object_get(q0, "last")));
    assert_string_equal(json_string_value(json_object_get(q1, "kind")), "decode");
    assert_true(json_is_null(json_object_get(q1, "req")));
    json_t *st2 = json_array_get(json_object_get(b2, "stages"), 2);
    assert_true(json_real_value(json_array_get(st2, 0)) == 3.0);
    assert_true(json_real_value(json_array_get(st2, 1)) == 0.5);
    assert_true(json_real_value(json_array_get(st2, 2)) == 0.25);
    json_t *a0 = json_array_get(json_object_get(b2, "agents"), 0);
    assert_int_equal(json_integer_value(json_object_get(a0, "pairs")), 7);
    assert_true(json_real_value(json_object_get(a0, "held_ms")) == 0.125);

    json_t *events = json_object_get(j, "events");
    assert_int_equal(json_array_size(events), 2);
    json_t *e0 = json_array_get(events, 0), *e1 = json_array_get(events, 1);
    assert_string_equal(json_string_value(json_object_get(e0, "type")), "lost");
    assert_int_equal(json_integer_value(json_object_get(e0, "stage")), 1);
    assert_int_equal(json_integer_value(json_object_get(e0, "held")), 3);
    assert_string_equal(json_string_value(json_object_get(e1, "type")), "recovered");
    assert_true(json_is_null(json_object_get(e1, "stage")));
    assert_true(json_real_value(json_object_get(e1, "outage_ms")) == 65.0);
    json_decref(j);

    /* The same reader again: nothing new. */
    kvr_telemetry_take(t, &rd, plan, &st, NULL, 0, 200000000, snap);
    assert_int_equal(snap->n_traces, 0);
    assert_int_equal(snap->n_events, 0);
    j = to_json(snap);
    assert_int_equal(json_array_size(json_object_get(j, "batches")), 0);
    /* Without stage states, the lanes follow the ring. */
    json_t *s0 = json_array_get(json_object_get(json_object_get(j, "ring"), "stages"), 0);
    assert_string_equal(json_string_value(json_object_get(s0, "state")), "up");
    json_decref(j);

    kvr_free(snap);
    free(plan);
    kvr_telemetry_destroy(t);
}

/* Readers are independent; a slow one is told what it missed, never shown a batch twice. */
static void test_readers_and_bounds(void **state)
{
    (void)state;
    struct kvr_telemetry *t;
    assert_int_equal(kvr_telemetry_create(&t, NULL), 0);
    struct kvr_telemetry_snapshot *snap = kvr_malloc(sizeof *snap);
    struct kvr_telemetry_reader fast = {0, 0}, slow = {0, 0};
    uint64_t id = 1;
    for (int round = 0; round < 5; round++) {
        for (int i = 0; i < 10; i++)
            record(t, id++);
        kvr_telemetry_take(t, &fast, NULL, NULL, NULL, 0, 0, snap);
        assert_int_equal(snap->n_traces, 10);
        assert_int_equal(snap->traces_missed, 0);
        assert_int_equal(snap->traces[0].batch_id, id - 10);
        assert_int_equal(snap->traces[9].batch_id, id - 1);
    }
    /* 50 pending: all fit in one snapshot. */
    kvr_telemetry_take(t, &slow, NULL, NULL, NULL, 0, 0, snap);
    assert_int_equal(snap->n_traces, 50);
    assert_int_equal(snap->traces[0].batch_id, 1);
    /* 1000 more: the newest KVR_TELEMETRY_SNAPSHOT_TRACES come, the rest are counted. */
    for (int i = 0; i < 1000; i++)
        record(t, id++);
    kvr_telemetry_take(t, &slow, NULL, NULL, NULL, 0, 0, snap);
    assert_int_equal(snap->n_traces, KVR_TELEMETRY_SNAPSHOT_TRACES);
    assert_int_equal(snap->traces_missed, 1000 - KVR_TELEMETRY_SNAPSHOT_TRACES);
    assert_int_equal(snap->traces[KVR_TELEMETRY_SNAPSHOT_TRACES - 1].batch_id, id - 1);
    assert_int_equal(snap->traces[0].batch_id, id - KVR_TELEMETRY_SNAPSHOT_TRACES);
    /* A new reader gets the newest, never more than the buffer holds. */
    struct kvr_telemetry_reader late = {0, 0};
    kvr_telemetry_take(t, &late, NULL, NULL, NULL, 0, 0, snap);
    assert_int_equal(snap->n_traces, KVR_TELEMETRY_SNAPSHOT_TRACES);
    assert_int_equal(snap->traces_missed, id - 1 - KVR_TELEMETRY_SNAPSHOT_TRACES);

    /* Events: a ring buffer of the last KVR_TELEMETRY_EVENTS. */
    for (uint32_t i = 0; i < KVR_TELEMETRY_EVENTS + 5; i++)
        kvr_telemetry_ring_event(t, KVR_TELEMETRY_EV_LOST, -1, i, "x", 1000 + i);
    kvr_telemetry_take(t, &late, NULL, NULL, NULL, 0, 0, snap);
    assert_int_equal(snap->n_events, KVR_TELEMETRY_EVENTS);
    assert_int_equal(snap->events_missed, 5);
    assert_int_equal(snap->events[0].n_held, 5);
    /* The outage runs from the first LOST. */
    kvr_telemetry_ring_event(t, KVR_TELEMETRY_EV_RECOVERED, -1, 2, NULL, 5000);
    kvr_telemetry_take(t, &late, NULL, NULL, NULL, 0, 0, snap);
    assert_int_equal(snap->n_events, 1);
    assert_int_equal(snap->events[0].outage_ns, 4000);
    kvr_free(snap);
    kvr_telemetry_destroy(t);
}

/* More sequences and agent records than a trace names: counted, rows still summed. */
static void test_wide_batch(void **state)
{
    (void)state;
    struct kvr_telemetry *t;
    assert_int_equal(kvr_telemetry_create(&t, NULL), 0);
    enum { N = KVR_TELEMETRY_SEQS + 6, A = KVR_TELEMETRY_AGENTS + 2 };
    struct kvr_seg segs[N];
    for (uint32_t i = 0; i < N; i++)
        segs[i] = (struct kvr_seg){i, 5, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
    struct kvr_wire_timing ag[A];
    for (uint32_t i = 0; i < A; i++)
        ag[i] = (struct kvr_wire_timing){KVR_WIRE_TIMING_AGENT | i, 1, 2, 3, 4};
    struct kvr_telemetry_batch b = {
        .batch_id = 9, .segs = segs, .n_segs = N, .agent_timings = ag, .n_agent_timings = A};
    kvr_telemetry_record_batch(t, &b);
    struct kvr_telemetry_snapshot *snap = kvr_malloc(sizeof *snap);
    struct kvr_telemetry_reader rd = {0, 0};
    kvr_telemetry_take(t, &rd, NULL, NULL, NULL, 0, 0, snap);
    assert_int_equal(snap->n_traces, 1);
    assert_int_equal(snap->traces[0].n_seqs, KVR_TELEMETRY_SEQS);
    assert_int_equal(snap->traces[0].n_seqs_more, 6);
    assert_int_equal(snap->traces[0].n_rows_decode, N);
    assert_int_equal(snap->traces[0].n_agents_more, 2);
    assert_int_equal(snap->traces[0].agent[3].agent, 3);
    json_t *j = to_json(snap);
    json_t *b0 = json_array_get(json_object_get(j, "batches"), 0);
    assert_int_equal(json_integer_value(json_object_get(b0, "seqs_more")), 6);
    assert_int_equal(json_integer_value(json_object_get(b0, "agents_more")), 2);
    json_decref(j);
    kvr_free(snap);
    kvr_telemetry_destroy(t);
}

static void test_sse_and_interval(void **state)
{
    (void)state;
    struct kvr_telemetry *t;
    assert_int_equal(kvr_telemetry_create(&t, NULL), 0);
    record(t, 1);
    struct kvr_telemetry_snapshot *snap = kvr_malloc(sizeof *snap);
    struct kvr_telemetry_reader rd = {0, 0};
    kvr_telemetry_take(t, &rd, NULL, NULL, NULL, 0, 5000000, snap);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    assert_int_equal(kvr_telemetry_sse(snap, &b), 0);
    assert_true(strncmp(b.data, "event: snapshot\ndata: {", 23) == 0);
    assert_string_equal(b.data + b.len - 3, "}\n\n");
    /* Exactly one blank line: the event's end. */
    assert_int_equal((long)(strstr(b.data, "\n\n") - b.data), (long)b.len - 2);
    kvr_sbuf_fini(&b);
    kvr_free(snap);
    kvr_telemetry_destroy(t);

    assert_int_equal(kvr_telemetry_interval_ms(NULL), KVR_TELEMETRY_DEFAULT_INTERVAL_MS);
    assert_int_equal(kvr_telemetry_interval_ms(""), KVR_TELEMETRY_DEFAULT_INTERVAL_MS);
    assert_int_equal(kvr_telemetry_interval_ms("abc"), KVR_TELEMETRY_DEFAULT_INTERVAL_MS);
    assert_int_equal(kvr_telemetry_interval_ms("-5"), KVR_TELEMETRY_DEFAULT_INTERVAL_MS);
    assert_int_equal(kvr_telemetry_interval_ms("1"), KVR_TELEMETRY_MIN_INTERVAL_MS);
    assert_int_equal(kvr_telemetry_interval_ms("0"), KVR_TELEMETRY_MIN_INTERVAL_MS);
    assert_int_equal(kvr_telemetry_interval_ms("500"), 500);
    assert_int_equal(kvr_telemetry_interval_ms("99999999999999999999999999"),
                     KVR_TELEMETRY_MAX_INTERVAL_MS);
}

/* An allocation failure is reported, not crashed on. */
static void test_create_fails_cleanly(void **state)
{
    (void)state;
    struct kvr_telemetry *t = (void *)1;
    kvr_alloc_fail_after(1);
    struct kvr_err err = {0};
    assert_int_equal(kvr_telemetry_create(&t, &err), KVR_ENOMEM);
    kvr_alloc_fail_after(-1);
    assert_null(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_snapshot_json),        cmocka_unit_test(test_readers_and_bounds),
        cmocka_unit_test(test_wide_batch),           cmocka_unit_test(test_sse_and_interval),
        cmocka_unit_test(test_create_fails_cleanly),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
