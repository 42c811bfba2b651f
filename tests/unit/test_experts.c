/* test_experts.c - expert agents' pure parts (docs/EXPERTS.md): the plan's "experts" key
 * (parsing, every rule, hash, JSON round trip, equal-block placement), the EXPERT and
 * EXPERT_RESULT frames at the wire layer with the limits both ends use, the agents' timing
 * records in a batch, and the handshake in which an agent accepts any stage. The agent
 * process and the stage's dispatcher run end to end in tests/integration/
 * moe_ring_identical.sh and experts_recover.sh. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "ring/auth.h"
#include "ring/experts.h"
#include "ring/plan.h"
#include "ring/wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Plans are large: keep them off the test's stack. */
static struct kvr_plan plan_a, plan_b;

static const char head_json[] =
    "{\"model\": \"m.gguf\", \"stages\": [{\"addr\": \"127.0.0.1:7001\", \"layers\": [0, 2]},"
    " {\"addr\": \"127.0.0.1:7002\", \"layers\": [3, 5]}], \"bridge\": \"127.0.0.1:7000\","
    " \"row_width\": 8, \"microbatches\": 2, \"max_seqs\": 4, \"n_ctx\": 64,"
    " \"secret\": \"00112233445566778899aabbccddeeff\"";

/* The base plan with `experts` (a JSON array, or NULL for none): parse rc, and validate rc
 * against a 6-layer model when it parsed. */
static int load(struct kvr_plan *p, const char *experts, struct kvr_err *err)
{
    char json[2048];
    snprintf(json, sizeof json, "%s%s%s}", head_json, experts ? ", \"experts\": " : "",
             experts ? experts : "");
    int rc = kvr_plan_parse(p, json, strlen(json), NULL, err);
    return rc ? rc : kvr_plan_validate(p, 6, err);
}

static const char two_agents[] =
    "[{\"addr\": \"127.0.0.1:7101\", \"threads\": 2, \"holds\": [{\"layers\": [0, 5], "
    "\"experts\": [0, 3]}]}, {\"addr\": \"127.0.0.1:7102\", \"holds\": [{\"layers\": [0, 3], "
    "\"experts\": [4, 7]}, {\"layers\": [5, 5], \"experts\": [4, 4]}]}]";

static void test_plan_experts(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    assert_int_equal(load(&plan_a, two_agents, &err), 0);
    assert_int_equal(plan_a.n_agents, 2);
    assert_string_equal(plan_a.agents[1].addr, "127.0.0.1:7102");
    assert_int_equal(plan_a.agents[0].n_threads, 2);
    assert_int_equal(plan_a.agents[1].n_holds, 2);
    assert_true(kvr_plan_agent_holds(&plan_a.agents[1], 5, 4));
    assert_false(kvr_plan_agent_holds(&plan_a.agents[1], 4, 4));
    assert_false(kvr_plan_agent_holds(&plan_a.agents[1], 5, 5));
    assert_true(kvr_plan_agent_holds_layer(&plan_a.agents[1], 3));
    assert_false(kvr_plan_agent_holds_layer(&plan_a.agents[1], 4));

    /* Written out and read back: the same plan, the same hash. */
    char *json = NULL;
    assert_int_equal(kvr_plan_to_json(&plan_a, &json, &err), 0);
    assert_int_equal(kvr_plan_parse(&plan_b, json, strlen(json), NULL, &err), 0);
    free(json);
    uint8_t ha[KVR_PLAN_HASH_BYTES], hb[KVR_PLAN_HASH_BYTES];
    kvr_plan_hash(&plan_a, ha);
    kvr_plan_hash(&plan_b, hb);
    assert_memory_equal(ha, hb, sizeof ha);
    assert_int_equal(plan_b.n_agents, 2);
    assert_memory_equal(&plan_a.agents[1].holds[1], &plan_b.agents[1].holds[1],
                        sizeof plan_a.agents[1].holds[1]);

    /* The placement is part of the identity; the thread counts are not. */
    plan_b.agents[1].holds[1].last_expert = 5;
    kvr_plan_hash(&plan_b, hb);
    assert_memory_not_equal(ha, hb, sizeof ha);
    plan_b = plan_a;
    plan_b.agents[0].n_threads = 7;
    kvr_plan_hash(&plan_b, hb);
    assert_memory_equal(ha, hb, sizeof ha);
    /* A plan without agents hashes as it did before agents existed: nothing appended. */
    assert_int_equal(load(&plan_b, NULL, &err), 0);
    assert_int_equal(plan_b.n_agents, 0);
    plan_b.n_agents = 0;
    uint8_t hn[KVR_PLAN_HASH_BYTES];
    kvr_plan_hash(&plan_b, hn);
    plan_b.agents[0] = plan_a.agents[0]; /* ignored while n_agents is 0 */
    kvr_plan_hash(&plan_b, hb);
    assert_memory_equal(hn, hb, sizeof hn);
}

static void expect_fail(const char *experts, int want_rc, const char *want_msg)
{
    struct kvr_err err = {0};
    int rc = load(&plan_a, experts, &err);
    if (rc != want_rc || !strstr(err.msg, want_msg))
        fail_msg("experts %s: rc %d \"%s\", wanted %d \"%s\"", experts, rc, err.msg, want_rc,
                 want_msg);
}

static void test_plan_rules(void **state)
{
    (void)state;
    expect_fail("{}", KVR_EINVAL, "must be an array");
    expect_fail("[{\"holds\": [{\"layers\": [0, 1], \"experts\": [0, 1]}]}]", KVR_EINVAL,
                "experts[0] has no \"addr\"");
    expect_fail("[{\"addr\": \"127.0.0.1:7101\"}]", KVR_EINVAL, "experts[0].holds must be");
    expect_fail("[{\"addr\": \"127.0.0.1:7101\", \"holds\": []}]", KVR_EINVAL,
                "experts[0].holds must be");
    expect_fail("[{\"addr\": \"127.0.0.1:7101\", \"holds\": [{\"layers\": [0, 1]}]}]", KVR_EINVAL,
                "experts[0].holds[0].experts must be [first, last]");
    expect_fail("[{\"addr\": \"127.0.0.1:7101\", \"cores\": 2, \"holds\": []}]", KVR_EINVAL,
                "unknown key \"cores\" in experts[0]");
    expect_fail("[{\"addr\": \"127.0.0.1:7101\", \"holds\": [{\"layers\": [0, 1], "
                "\"experts\": [0, -1]}]}]",
                KVR_ERANGE, "experts[0].holds[0].experts[1] is -1");
    expect_fail("[{\"addr\": \"127.0.0.1:7101\", \"holds\": [{\"layers\": [3, 1], "
                "\"experts\": [0, 1]}]}]",
                KVR_EINVAL, "first is past its last");
    expect_fail("[{\"addr\": \"127.0.0.1:7101\", \"holds\": [{\"layers\": [0, 6], "
                "\"experts\": [0, 1]}]}]",
                KVR_EINVAL, "names layer 6; the model's last layer is 5");
    expect_fail("[{\"addr\": \"127.0.0.1:7002\", \"holds\": [{\"layers\": [0, 1], "
                "\"experts\": [0, 1]}]}]",
                KVR_EINVAL, "experts[0] and stage 1 both use address 127.0.0.1:7002");
    expect_fail("[{\"addr\": \"127.0.0.1:7000\", \"holds\": [{\"layers\": [0, 1], "
                "\"experts\": [0, 1]}]}]",
                KVR_EINVAL, "experts[0] and the bridge both use address");
    expect_fail("[{\"addr\": \"localhost\", \"holds\": [{\"layers\": [0, 1], "
                "\"experts\": [0, 1]}]}]",
                KVR_EINVAL, "experts[0] address \"localhost\"");
    /* Overlaps: between agents, and within one agent's holds. */
    expect_fail("[{\"addr\": \"127.0.0.1:7101\", \"holds\": [{\"layers\": [0, 2], "
                "\"experts\": [0, 3]}]}, {\"addr\": \"127.0.0.1:7102\", \"holds\": "
                "[{\"layers\": [2, 5], \"experts\": [3, 7]}]}]",
                KVR_EINVAL, "experts[0].holds[0] and experts[1].holds[0] overlap");
    expect_fail("[{\"addr\": \"127.0.0.1:7101\", \"holds\": [{\"layers\": [0, 2], "
                "\"experts\": [0, 3]}, {\"layers\": [1, 1], \"experts\": [2, 2]}]}]",
                KVR_EINVAL, "experts[0].holds[0] and experts[0].holds[1] overlap");
    expect_fail("[{\"addr\": \"127.0.0.1:7101\", \"holds\": [{\"layers\": [0, 1], "
                "\"experts\": [0, 1]}]}, {\"addr\": \"127.0.0.1:7101\", \"holds\": "
                "[{\"layers\": [0, 1], \"experts\": [2, 3]}]}]",
                KVR_EINVAL, "experts[0] and experts[1] both use address");
    /* Touching rectangles are not overlaps. */
    struct kvr_err err = {0};
    assert_int_equal(load(&plan_a,
                          "[{\"addr\": \"127.0.0.1:7101\", \"holds\": [{\"layers\": [0, 2], "
                          "\"experts\": [0, 3]}]}, {\"addr\": \"127.0.0.1:7102\", \"holds\": "
                          "[{\"layers\": [0, 2], \"experts\": [4, 4]}, {\"layers\": [3, 5], "
                          "\"experts\": [0, 3]}]}]",
                          &err),
                     0);
}

static void test_place(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    assert_int_equal(load(&plan_a, NULL, &err), 0);
    assert_int_equal(kvr_plan_place_experts(&plan_a, 3, 6, 8, "127.0.0.1", 7101, &err), 0);
    assert_int_equal(kvr_plan_validate(&plan_a, 6, &err), 0);
    assert_int_equal(plan_a.n_agents, 3);
    assert_string_equal(plan_a.agents[2].addr, "127.0.0.1:7103");
    /* Every expert of every layer on exactly one agent, in contiguous blocks of 2-3. */
    for (uint32_t il = 0; il < 6; il++)
        for (uint32_t e = 0; e < 8; e++) {
            uint32_t n = 0;
            for (uint32_t j = 0; j < 3; j++)
                n += kvr_plan_agent_holds(&plan_a.agents[j], il, e);
            assert_int_equal(n, 1);
        }
    assert_int_equal(plan_a.agents[0].holds[0].last_expert, 1);
    assert_int_equal(plan_a.agents[1].holds[0].first_expert, 2);
    assert_int_equal(plan_a.agents[2].holds[0].last_expert, 7);
    assert_int_equal(kvr_plan_place_experts(&plan_a, 9, 6, 8, "127.0.0.1", 7101, &err), KVR_EINVAL);
    assert_int_equal(kvr_plan_place_experts(&plan_a, 0, 6, 8, "127.0.0.1", 7101, &err), KVR_EINVAL);
}

/* Every (layer, expert) on at most one agent; stage s's layers have 8 - keep[s] held,
 * the last keep[s] experts not. */
static void check_kept(const struct kvr_plan *p, const uint32_t *keep)
{
    for (uint32_t s = 0; s < p->n_stages; s++)
        for (uint32_t il = p->stages[s].first_layer; il <= p->stages[s].last_layer; il++)
            for (uint32_t e = 0; e < 8; e++) {
                uint32_t n = 0;
                for (uint32_t j = 0; j < p->n_agents; j++)
                    n += kvr_plan_agent_holds(&p->agents[j], il, e);
                assert_int_equal(n, e < 8 - keep[s] ? 1 : 0);
            }
}

/* Stages that keep a share (propose.c's balanced placement writes it this way). */
static void test_place_kept(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    assert_int_equal(load(&plan_a, NULL, &err), 0);
    const uint32_t same[2] = {3, 3}, differ[2] = {2, 4}, none[2] = {0, 0}, most[2] = {6, 6};
    /* The same share: one hold per agent, experts 0-4 in blocks of 2 and 3. */
    assert_int_equal(
        kvr_plan_place_experts_kept(&plan_a, 2, 8, same, NULL, "127.0.0.1", 7101, &err), 0);
    assert_int_equal(kvr_plan_validate(&plan_a, 6, &err), 0);
    check_kept(&plan_a, same);
    assert_int_equal(plan_a.agents[0].n_holds, 1);
    assert_int_equal(plan_a.agents[0].holds[0].last_layer, 5);
    assert_int_equal(plan_a.agents[1].holds[0].first_expert, 3);
    assert_int_equal(plan_a.agents[1].holds[0].last_expert, 4);
    /* Different shares: a hold per stage. */
    assert_int_equal(
        kvr_plan_place_experts_kept(&plan_a, 2, 8, differ, NULL, "127.0.0.1", 7101, &err), 0);
    assert_int_equal(kvr_plan_validate(&plan_a, 6, &err), 0);
    check_kept(&plan_a, differ);
    assert_int_equal(plan_a.agents[1].n_holds, 2);
    assert_int_equal(plan_a.agents[1].holds[1].first_layer, 3);
    assert_int_equal(plan_a.agents[1].holds[1].last_expert, 3);
    /* Nothing kept: the equal blocks of kvr_plan_place_experts. */
    assert_int_equal(
        kvr_plan_place_experts_kept(&plan_a, 2, 8, none, NULL, "127.0.0.1", 7101, &err), 0);
    check_kept(&plan_a, none);
    assert_int_equal(plan_a.agents[0].holds[0].last_expert, 3);
    /* Speeds size the blocks: agent 0 three times as fast holds 6 of 8... */
    const double fast0[2] = {3, 1}, lopsided[2] = {1000, 1};
    assert_int_equal(
        kvr_plan_place_experts_kept(&plan_a, 2, 8, none, fast0, "127.0.0.1", 7101, &err), 0);
    assert_int_equal(plan_a.agents[0].holds[0].last_expert, 5);
    /* ...and however slow an agent is, it keeps one. */
    assert_int_equal(
        kvr_plan_place_experts_kept(&plan_a, 2, 8, most, lopsided, "127.0.0.1", 7101, &err), 0);
    check_kept(&plan_a, most);
    assert_int_equal(plan_a.agents[1].holds[0].first_expert, 1);
    assert_int_equal(plan_a.agents[1].holds[0].last_expert, 1);
    /* A stage cannot keep so many that an agent has none; speeds must be positive. */
    const uint32_t too_many[2] = {0, 7};
    const double zero[2] = {1, 0};
    assert_int_equal(
        kvr_plan_place_experts_kept(&plan_a, 2, 8, too_many, NULL, "127.0.0.1", 7101, &err),
        KVR_EINVAL);
    assert_non_null(strstr(err.msg, "stage 1 keeps 7 of 8 experts"));
    assert_int_equal(
        kvr_plan_place_experts_kept(&plan_a, 2, 8, same, zero, "127.0.0.1", 7101, &err),
        KVR_EINVAL);
    char line[512];
    assert_int_equal(
        kvr_plan_place_experts_kept(&plan_a, 2, 8, differ, NULL, "127.0.0.1", 7101, &err), 0);
    kvr_plan_experts_describe(&plan_a, 8, line, sizeof line);
    assert_non_null(strstr(line, "stage 0 computes 2 of 8 experts of layers 0-2; stage 1 "
                                 "computes 4 of 8 experts of layers 3-5; agent 0 experts 0-2"));
}

/* A model of 6 layers, n_embd 16, 8 experts, top-2, for the limits. */
static struct kvr_hparams small_model(void)
{
    struct kvr_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layer = 6;
    hp.n_embd = 16;
    hp.n_vocab = 64;
    hp.moe.n_expert = 8;
    hp.moe.n_used = 2;
    hp.moe.n_ff_exp = 32;
    return hp;
}

/* Encode a message flat and decode it with lim: the decoder's rc (and message in err). */
static int round_trip(const struct kvr_wire_msg *m, const struct kvr_wire_limits *lim,
                      struct kvr_wire_frame *f, uint8_t *buf, size_t cap, struct kvr_err *err)
{
    size_t n = 0;
    int rc = kvr_wire_encode_flat(m, buf, cap, &n, err);
    if (rc)
        return rc;
    struct kvr_wire_header h;
    if ((rc = kvr_wire_decode_header(buf, lim, &h, err)))
        return rc;
    return kvr_wire_decode_body(f, &h, buf + KVR_WIRE_HEADER_BYTES, n - KVR_WIRE_HEADER_BYTES, lim,
                                err);
}

static void test_expert_frames(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    assert_int_equal(load(&plan_a, two_agents, &err), 0);
    struct kvr_hparams hp = small_model();
    assert_int_equal(kvr_experts_check_model(&plan_a, &hp, &err), 0);
    struct kvr_wire_limits at_agent, at_stage;
    assert_int_equal(kvr_experts_limits(&at_agent, &plan_a, &hp, true, &err), 0);
    assert_int_equal(kvr_experts_limits(&at_stage, &plan_a, &hp, false, &err), 0);
    /* The larger body: an answer of row_width x n_used pair rows. */
    assert_int_equal(at_agent.max_frame_bytes, KVR_WIRE_HEADER_BYTES + 32 + 8 * 2 * 16 * 4);
    assert_int_equal(at_stage.max_frame_bytes, at_agent.max_frame_bytes);

    static uint8_t body[4096], buf[8192];
    memset(body, 0x5a, sizeof body);
    struct kvr_wire_frame f;
    assert_int_equal(kvr_wire_frame_init(&f, &at_agent, &err), 0);
    struct kvr_wire_msg m = {.type = KVR_WIRE_EXPERT,
                             .batch_id = 9,
                             .payload = KVR_WIRE_PAYLOAD_EXPERT,
                             .payload_data = body,
                             .payload_bytes = 300};
    assert_int_equal(round_trip(&m, &at_agent, &f, buf, sizeof buf, &err), 0);
    assert_int_equal(f.hdr.type, KVR_WIRE_EXPERT);
    assert_int_equal(f.hdr.batch_id, 9);
    assert_int_equal(f.hdr.payload_bytes, 300);
    assert_memory_equal(f.payload, body, 300);
    /* One direction each: an agent takes no answers, a stage no requests. */
    m.type = KVR_WIRE_EXPERT_RESULT;
    assert_int_equal(round_trip(&m, &at_agent, &f, buf, sizeof buf, &err), KVR_EPROTO);
    assert_non_null(strstr(err.msg, "EXPERT_RESULT frame is not accepted"));
    struct kvr_wire_frame g;
    assert_int_equal(kvr_wire_frame_init(&g, &at_stage, &err), 0);
    assert_int_equal(round_trip(&m, &at_stage, &g, buf, sizeof buf, &err), 0);
    /* Larger than row_width allows: refused from the header, before any body byte. */
    m.payload_bytes = at_stage.max_frame_bytes - KVR_WIRE_HEADER_BYTES + 1;
    assert_int_equal(round_trip(&m, &at_stage, &g, buf, sizeof buf, &err), KVR_EPROTO);
    assert_non_null(strstr(err.msg, "exceeds the plan's largest frame"));
    /* No records ride along, and the encoder says so too. */
    struct kvr_seg seg = {.seq = 0, .pos0 = 0, .n_tokens = 1, .flags = KVR_SEG_DECODE};
    m.payload_bytes = 64;
    m.segs = &seg;
    m.n_segs = 1;
    assert_int_equal(kvr_wire_encode_flat(&m, buf, sizeof buf, NULL, &err), KVR_EINVAL);
    m.segs = NULL;
    m.n_segs = 0;
    m.payload = KVR_WIRE_PAYLOAD_F32;
    assert_int_equal(kvr_wire_encode_flat(&m, buf, sizeof buf, NULL, &err), KVR_EINVAL);
    /* A header claiming records is refused by the receiver. */
    m.payload = KVR_WIRE_PAYLOAD_EXPERT;
    size_t n = 0;
    assert_int_equal(kvr_wire_encode_flat(&m, buf, sizeof buf, &n, &err), 0);
    buf[20] = 1; /* n_segs */
    kvr_st32(buf + 36, kvr_crc32c(buf, 36));
    struct kvr_wire_header h;
    assert_int_equal(kvr_wire_decode_header(buf, &at_stage, &h, &err), KVR_EPROTO);
    assert_non_null(strstr(err.msg, "carries one expert payload and no records"));
    kvr_wire_frame_fini(&f);
    kvr_wire_frame_fini(&g);

    /* The model must fit the placement. */
    hp.moe.n_expert = 4;
    assert_int_equal(kvr_experts_check_model(&plan_a, &hp, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "names expert 7; the model's layers have 4 experts"));
    hp.moe.n_expert = 0;
    assert_int_equal(kvr_experts_check_model(&plan_a, &hp, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "no mixture-of-experts layers"));
}

/* Agents' records follow the stages' in a batch and reach the bridge apart from them. */
static void test_agent_timings(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    assert_int_equal(load(&plan_a, two_agents, &err), 0);
    struct kvr_wire_limits bridge;
    assert_int_equal(kvr_wire_limits_init(&bridge, &plan_a, 16, 64, KVR_WIRE_RECV_BRIDGE, &err), 0);
    assert_int_equal(bridge.max_agent_timings, 4);
    struct kvr_wire_frame f;
    assert_int_equal(kvr_wire_frame_init(&f, &bridge, &err), 0);
    struct kvr_seg seg = {.seq = 1, .pos0 = 0, .n_tokens = 1, .flags = KVR_SEG_DECODE};
    struct kvr_wire_timing st[2] = {{.stage = 0, .held_ns = 5}, {.stage = 1, .held_ns = 6}};
    struct kvr_wire_timing ag[3] = {
        {.stage = KVR_WIRE_TIMING_AGENT | 1, .held_ns = 7, .starved_ns = 8, .pairs = 3},
        {.stage = KVR_WIRE_TIMING_AGENT | 0, .held_ns = 9, .blocked_ns = 2, .pairs = 4},
        {.stage = KVR_WIRE_TIMING_AGENT | 1, .held_ns = 1, .pairs = 1}};
    struct kvr_wire_msg m = {.type = KVR_WIRE_RESULT,
                             .batch_id = 3,
                             .segs = &seg,
                             .n_segs = 1,
                             .payload = KVR_WIRE_PAYLOAD_RESULTS,
                             .timings = st,
                             .n_timings = 2,
                             .agent_timings = ag,
                             .n_agent_timings = 3};
    static uint8_t buf[4096];
    assert_int_equal(round_trip(&m, &bridge, &f, buf, sizeof buf, &err), 0);
    assert_int_equal(f.hdr.n_timings, 2); /* the stages' records, as before agents */
    assert_int_equal(f.timings[1].held_ns, 6);
    assert_int_equal(f.n_agent_timings, 3);
    assert_int_equal(f.agent_timings[0].stage, KVR_WIRE_TIMING_AGENT | 1);
    assert_int_equal(f.agent_timings[0].pairs, 3);
    assert_int_equal(f.agent_timings[0].starved_ns, 8);
    assert_int_equal(f.agent_timings[1].blocked_ns, 2);
    /* Forwarded (a stage passing them on): the same records go out again. */
    struct kvr_wire_msg fw;
    kvr_wire_msg_forward(&fw, &f);
    assert_int_equal(fw.n_agent_timings, 3);
    assert_int_equal(fw.agent_timings[2].held_ns, 1);

    /* An agent the plan does not have. */
    ag[2].stage = KVR_WIRE_TIMING_AGENT | 2;
    assert_int_equal(round_trip(&m, &bridge, &f, buf, sizeof buf, &err), KVR_EPROTO);
    assert_non_null(strstr(err.msg, "claims expert agent 2 (the plan has 2"));
    ag[2].stage = KVR_WIRE_TIMING_AGENT | 1;
    /* More agent records than the stages can have appended. */
    struct kvr_wire_timing many[5];
    for (int i = 0; i < 5; i++)
        many[i] = (struct kvr_wire_timing){.stage = KVR_WIRE_TIMING_AGENT};
    m.agent_timings = many;
    m.n_agent_timings = 5;
    assert_int_equal(round_trip(&m, &bridge, &f, buf, sizeof buf, &err), KVR_EPROTO);
    /* A stage record after the agents' (the encoder cannot write one; bytes can). */
    m.agent_timings = ag;
    m.n_agent_timings = 1;
    size_t n = 0;
    assert_int_equal(kvr_wire_encode_flat(&m, buf, sizeof buf, &n, &err), 0);
    uint8_t *tim = buf + n - 3 * KVR_WIRE_TIMING_BYTES;
    uint8_t rec[KVR_WIRE_TIMING_BYTES];
    memcpy(rec, tim + KVR_WIRE_TIMING_BYTES, sizeof rec); /* stage 1 <-> the agent's */
    memcpy(tim + KVR_WIRE_TIMING_BYTES, tim + 2 * KVR_WIRE_TIMING_BYTES, sizeof rec);
    memcpy(tim + 2 * KVR_WIRE_TIMING_BYTES, rec, sizeof rec);
    struct kvr_wire_header h;
    assert_int_equal(kvr_wire_decode_header(buf, &bridge, &h, &err), 0);
    assert_int_equal(kvr_wire_decode_body(&f, &h, buf + KVR_WIRE_HEADER_BYTES,
                                          n - KVR_WIRE_HEADER_BYTES, &bridge, &err),
                     KVR_EPROTO);
    assert_non_null(strstr(err.msg, "before the agents' records"));
    kvr_wire_frame_fini(&f);
}

/* An agent accepts any stage, learns which one proved itself, and refuses anything else. */
static int agent_handshake(struct kvr_auth_id client, struct kvr_auth_id *peer_seen,
                           struct kvr_err *err)
{
    struct kvr_auth c, s;
    struct kvr_auth_id self, any;
    int rc = kvr_auth_topology(&plan_a, KVR_AUTH_ROLE_AGENT, 1, false, &self, &any, err);
    assert_int_equal(rc, 0);
    assert_int_equal(any.index, KVR_AUTH_INDEX_ANY);
    assert_int_equal(kvr_auth_init(&c, &plan_a, true, client, self, NULL), 0);
    assert_int_equal(kvr_auth_init(&s, &plan_a, false, self, any, NULL), 0);
    uint8_t a[KVR_AUTH_MSG_BYTES], b[KVR_AUTH_MSG_BYTES];
    assert_int_equal(kvr_auth_hello(&c, a, NULL), 0);
    bool send = true, to_server = true;
    struct kvr_err ignore;
    rc = 0;
    for (int step = 0; send && step < 4 && rc == 0; step++, to_server = !to_server) {
        rc = kvr_auth_recv(to_server ? &s : &c, a, b, &send, to_server ? err : &ignore);
        memcpy(a, b, sizeof a);
    }
    if (rc == 0 && !(s.done && c.done))
        rc = -1;
    *peer_seen = s.peer;
    kvr_auth_wipe(&c);
    kvr_auth_wipe(&s);
    return rc;
}

static void test_agent_auth(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    assert_int_equal(load(&plan_a, two_agents, &err), 0);
    struct kvr_auth_id seen;
    assert_int_equal(agent_handshake((struct kvr_auth_id){KVR_AUTH_ROLE_STAGE, 1}, &seen, &err), 0);
    assert_int_equal(seen.role, KVR_AUTH_ROLE_STAGE);
    assert_int_equal(seen.index, 1);
    assert_int_equal(agent_handshake((struct kvr_auth_id){KVR_AUTH_ROLE_STAGE, 0}, &seen, &err), 0);
    assert_int_equal(seen.index, 0);
    /* Not a stage of the plan, or not a stage at all. */
    assert_int_equal(agent_handshake((struct kvr_auth_id){KVR_AUTH_ROLE_STAGE, 2}, &seen, &err),
                     KVR_EINVAL);
    assert_non_null(strstr(err.msg, "expected a stage on this link, but the peer says it is "
                                    "stage 2"));
    assert_int_equal(
        agent_handshake((struct kvr_auth_id){KVR_AUTH_ROLE_BRIDGE, KVR_AUTH_INDEX_NONE}, &seen,
                        &err),
        KVR_EINVAL);
    /* The agent role exists only as a server, and only for the plan's agents. */
    struct kvr_auth_id self, peer;
    assert_int_equal(kvr_auth_topology(&plan_a, KVR_AUTH_ROLE_AGENT, 2, false, &self, &peer, &err),
                     KVR_EINVAL);
    assert_int_equal(kvr_auth_topology(&plan_a, KVR_AUTH_ROLE_AGENT, 0, true, &self, &peer, &err),
                     KVR_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plan_experts), cmocka_unit_test(test_plan_rules),
        cmocka_unit_test(test_place),        cmocka_unit_test(test_expert_frames),
        cmocka_unit_test(test_place_kept),   cmocka_unit_test(test_agent_timings),
        cmocka_unit_test(test_agent_auth),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
