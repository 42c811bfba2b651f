/* test_replan.c - re-planning a ring over the stages left (propose.h kvr_plan_replan) and
 * the REPLAN frame that carries the decision (wire.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/alloc.h"
#include "model/gguf.h"
#include "model/synth.h"
#include "ring/plan.h"
#include "ring/propose.h"
#include "ring/wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *model_buf;
static struct kvr_gguf *model;

/* A 12-layer model in memory, and a 3-stage plan for it. */
static void make(struct kvr_plan *plan, uint32_t n_stages)
{
    struct kvr_synth_opts o = {.type = KVR_DTYPE_F32, .seed = 1, .n_threads = 1};
    o.shape = (struct kvr_synth_shape){.name = "x",
                                       .n_layers = 12,
                                       .dim = 64,
                                       .ff = 128,
                                       .n_heads = 4,
                                       .n_kv_heads = 4,
                                       .vocab_size = 512,
                                       .ctx = 64,
                                       .rope_base = 10000.0f,
                                       .rms_eps = 1e-5f};
    size_t len = 0;
    FILE *f = open_memstream(&model_buf, &len);
    struct kvr_err err = {0};
    assert_int_equal(kvr_synth_write(&o, f, NULL, &err), 0);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(kvr_gguf_open_mem(&model, model_buf, len, &err), 0);
    struct kvr_plan_spec spec = {.n_stages = n_stages, .model_path = "x.gguf", .base_port = 7001};
    if (kvr_plan_propose(plan, model, &spec, &err))
        fail_msg("propose: %s", err.msg);
}

/* kvr_plan_replan_index as one number: the index in the new ring, or -1 when not in it. */
static int replan_index(const struct kvr_plan *old, uint64_t keep, uint32_t who)
{
    uint32_t index = UINT32_MAX;
    if (!kvr_plan_replan_index(old, keep, who, &index))
        return -1;
    return (int)index;
}

static void unmake(void)
{
    kvr_gguf_close(model);
    free(model_buf);
    model = NULL;
    model_buf = NULL;
}

/* The survivors keep their order, addresses and threads; the layers are balanced over
 * them as a fresh plan for that many stages would be; the epoch and the hash change; the
 * same inputs give the same plan. */
static void test_replan_drops_a_stage(void **state)
{
    (void)state;
    static struct kvr_plan old, out, again, fresh;
    make(&old, 3);
    old.stages[2].n_threads = 5;
    struct kvr_err err = {0};
    if (kvr_plan_replan(&old, model, 0x5 /* stages 0 and 2 */, &out, &err))
        fail_msg("replan: %s", err.msg);
    assert_int_equal(out.n_stages, 2);
    assert_int_equal(out.epoch, 1);
    assert_string_equal(out.stages[0].addr, old.stages[0].addr);
    assert_string_equal(out.stages[1].addr, old.stages[2].addr);
    assert_int_equal(out.stages[1].n_threads, 5);
    assert_int_equal(out.stages[0].first_layer, 0);
    assert_int_equal(out.stages[1].last_layer, 11);
    assert_int_equal(out.stages[0].last_layer + 1, out.stages[1].first_layer);
    assert_string_equal(out.stages[2].addr, ""); /* nothing left of the old third stage */
    assert_string_equal(out.bridge_addr, old.bridge_addr);
    assert_int_equal(out.row_width, old.row_width);
    assert_int_equal(out.secret_bytes, old.secret_bytes);
    struct kvr_plan_spec spec = {.n_stages = 2, .model_path = "x.gguf"};
    assert_int_equal(kvr_plan_propose(&fresh, model, &spec, &err), 0);
    assert_int_equal(out.stages[0].last_layer, fresh.stages[0].last_layer);

    uint8_t h_old[KVR_PLAN_HASH_BYTES], h_new[KVR_PLAN_HASH_BYTES], h_again[KVR_PLAN_HASH_BYTES];
    kvr_plan_hash(&old, h_old);
    kvr_plan_hash(&out, h_new);
    assert_memory_not_equal(h_old, h_new, sizeof h_old);
    assert_int_equal(kvr_plan_replan(&old, model, 0x5, &again, &err), 0);
    kvr_plan_hash(&again, h_again);
    assert_memory_equal(h_new, h_again, sizeof h_new);
    /* The epoch alone changes the hash: a plan of the same shape from another re-plan
     * (epoch 2) is not this one. */
    again.epoch = 2;
    kvr_plan_hash(&again, h_again);
    assert_memory_not_equal(h_new, h_again, sizeof h_new);
    again.epoch = 0;
    out.epoch = 0;
    kvr_plan_hash(&again, h_again);
    kvr_plan_hash(&out, h_new);
    assert_memory_equal(h_new, h_again, sizeof h_new);

    /* A second loss: from the re-planned ring, epoch 2. */
    static struct kvr_plan five, second;
    unmake();
    make(&five, 5);
    assert_int_equal(kvr_plan_replan(&five, model, 0x1d /* 0, 2, 3, 4 */, &out, &err), 0);
    assert_int_equal(out.n_stages, 4);
    assert_int_equal(kvr_plan_replan(&out, model, 0xb /* 0, 1, 3 */, &second, &err), 0);
    assert_int_equal(second.epoch, 2);
    assert_int_equal(second.n_stages, 3);
    assert_string_equal(second.stages[2].addr, five.stages[4].addr);
    unmake();
}

/* A re-plan keeps the expert placement, so the expert links' hash (plan.h) is the same
 * before and after: agents started with the old plan serve the new ring's stages. With a
 * spare taking the lost stage's place too. */
static void test_replan_keeps_expert_links(void **state)
{
    (void)state;
    static struct kvr_plan old, out;
    make(&old, 3);
    struct kvr_err err = {0};
    assert_int_equal(kvr_plan_place_experts(&old, 2, 12, 8, "127.0.0.1", 7101, &err), 0);
    snprintf(old.spares[0].addr, sizeof old.spares[0].addr, "127.0.0.1:7201");
    old.n_spares = 1;
    uint8_t h_old[KVR_PLAN_HASH_BYTES], h_new[KVR_PLAN_HASH_BYTES];
    kvr_plan_experts_link_hash(&old, h_old);
    const uint64_t masks[] = {0x5 /* stage 1 lost */, 0xd /* the spare takes its place */};
    for (int k = 0; k < 2; k++) {
        if (kvr_plan_replan(&old, model, masks[k], &out, &err))
            fail_msg("replan: %s", err.msg);
        assert_int_equal(out.n_agents, 2);
        kvr_plan_experts_link_hash(&out, h_new);
        assert_memory_equal(h_old, h_new, sizeof h_old);
        kvr_plan_hash(&out, h_new);
        kvr_plan_hash(&old, h_old);
        assert_memory_not_equal(h_old, h_new, sizeof h_old); /* the ring's links differ */
        kvr_plan_experts_link_hash(&old, h_old);
    }
    out.agents[1].holds[0].first_expert++; /* another placement: refused */
    kvr_plan_experts_link_hash(&out, h_new);
    assert_memory_not_equal(h_old, h_new, sizeof h_old);
    unmake();
}

static void test_replan_refusals(void **state)
{
    (void)state;
    static struct kvr_plan old, out;
    make(&old, 3);
    struct kvr_err err = {0};
    assert_int_equal(kvr_plan_replan(&old, model, 0x4, &out, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "1 stage left"));
    assert_int_equal(kvr_plan_replan(&old, model, 0, &out, &err), KVR_EINVAL);
    assert_int_equal(kvr_plan_replan(&old, model, 0x9, &out, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "beyond the plan's 3"));
    old.epoch = UINT16_MAX;
    assert_int_equal(kvr_plan_replan(&old, model, 0x3, &out, &err), KVR_ERANGE);
    unmake();
}

/* Spares (docs/PLAN.md "Spare stages"): a spare taken steps into the lost stage's place
 * with exactly its layers, the survivors keep theirs, the spares not taken stay spares; a
 * lost stage with no spare left is dropped and the layers balanced again. The plan with
 * spares survives JSON, and a spare may not share an address. */
static void test_replan_spares(void **state)
{
    (void)state;
    static struct kvr_plan old, out, back;
    make(&old, 3);
    uint8_t h_plain[KVR_PLAN_HASH_BYTES], h[KVR_PLAN_HASH_BYTES];
    kvr_plan_hash(&old, h_plain);
    old.n_spares = 2;
    snprintf(old.spares[0].addr, sizeof old.spares[0].addr, "127.0.0.1:7010");
    old.spares[0].n_threads = 4;
    snprintf(old.spares[1].addr, sizeof old.spares[1].addr, "127.0.0.1:7011");
    struct kvr_err err = {0};
    if (kvr_plan_validate(&old, 12, &err))
        fail_msg("validate: %s", err.msg);
    kvr_plan_hash(&old, h);
    assert_memory_not_equal(h, h_plain, sizeof h); /* the spares are part of the plan */

    uint64_t keep = 0x5 | 1ull << 3; /* stage 1 lost, spare 0 steps in */
    if (kvr_plan_replan(&old, model, keep, &out, &err))
        fail_msg("replan: %s", err.msg);
    assert_int_equal(out.n_stages, 3);
    assert_int_equal(out.epoch, 1);
    for (uint32_t i = 0; i < 3; i++) {
        assert_int_equal(out.stages[i].first_layer, old.stages[i].first_layer);
        assert_int_equal(out.stages[i].last_layer, old.stages[i].last_layer);
    }
    assert_string_equal(out.stages[0].addr, old.stages[0].addr);
    assert_string_equal(out.stages[1].addr, "127.0.0.1:7010");
    assert_int_equal(out.stages[1].n_threads, 4);
    assert_string_equal(out.stages[2].addr, old.stages[2].addr);
    assert_int_equal(out.n_spares, 1);
    assert_string_equal(out.spares[0].addr, "127.0.0.1:7011");
    assert_int_equal(replan_index(&old, keep, 0), 0);
    assert_int_equal(replan_index(&old, keep, 1), -1);
    assert_int_equal(replan_index(&old, keep, 2), 2);
    assert_int_equal(replan_index(&old, keep, 3), 1);
    assert_int_equal(replan_index(&old, keep, 4), -1);

    /* The first spare did not answer: the second one steps in; the first stays a spare. */
    keep = 0x5 | 1ull << 4;
    assert_int_equal(kvr_plan_replan(&old, model, keep, &out, &err), 0);
    assert_string_equal(out.stages[1].addr, "127.0.0.1:7011");
    assert_int_equal(out.stages[1].first_layer, old.stages[1].first_layer);
    assert_int_equal(out.n_spares, 1);
    assert_string_equal(out.spares[0].addr, "127.0.0.1:7010");
    assert_int_equal(replan_index(&old, keep, 4), 1);

    /* The head lost: the spare becomes the head, with the head's layers. */
    keep = 0x6 | 1ull << 3;
    assert_int_equal(kvr_plan_replan(&old, model, keep, &out, &err), 0);
    assert_string_equal(out.stages[0].addr, "127.0.0.1:7010");
    assert_int_equal(out.stages[0].first_layer, 0);
    assert_int_equal(out.stages[0].last_layer, old.stages[0].last_layer);
    assert_int_equal(replan_index(&old, keep, 3), 0);

    /* Two lost, one spare: stage 1's place goes to the spare, stage 2 is left out, and the
     * 12 layers are balanced over the two stages left. */
    keep = 0x1 | 1ull << 3;
    assert_int_equal(kvr_plan_replan(&old, model, keep, &out, &err), 0);
    assert_int_equal(out.n_stages, 2);
    assert_string_equal(out.stages[1].addr, "127.0.0.1:7010");
    assert_int_equal(out.stages[0].first_layer, 0);
    assert_int_equal(out.stages[1].last_layer, 11);
    assert_int_equal(out.stages[0].last_layer + 1, out.stages[1].first_layer);
    assert_int_equal(out.n_spares, 1);

    /* Two spares for one lost stage, or a bit beyond the spares: refused. */
    assert_int_equal(kvr_plan_replan(&old, model, 0x5 | 3ull << 3, &out, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "takes 2 spares for 1 lost"));
    assert_int_equal(kvr_plan_replan(&old, model, 0x5 | 1ull << 5, &out, &err), KVR_EINVAL);
    assert_int_equal(replan_index(&old, 0x5 | 1ull << 5, 0), -1);

    /* JSON: written and read back the same (the hash says so). */
    char *json = NULL;
    assert_int_equal(kvr_plan_to_json(&old, &json, &err), 0);
    assert_non_null(strstr(json, "\"spares\""));
    assert_int_equal(kvr_plan_parse(&back, json, strlen(json), NULL, &err), 0);
    assert_int_equal(back.n_spares, 2);
    assert_int_equal(back.spares[0].n_threads, 4);
    uint8_t h_back[KVR_PLAN_HASH_BYTES];
    kvr_plan_hash(&back, h_back);
    assert_memory_equal(h, h_back, sizeof h);
    /* A spare has no layers of its own: the key is refused. */
    static char bad[16384];
    const char *at = strstr(json, "\"127.0.0.1:7011\"");
    assert_non_null(at);
    int n = snprintf(bad, sizeof bad, "%.*s\"127.0.0.1:7011\", \"layers\": [0, 1]%s",
                     (int)(at - json), json, at + strlen("\"127.0.0.1:7011\""));
    assert_true(n > 0 && (size_t)n < sizeof bad);
    kvr_free(json);
    assert_int_equal(kvr_plan_parse(&back, bad, (size_t)n, NULL, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "spares[1]"));

    /* A spare on a stage's address is refused. */
    snprintf(old.spares[1].addr, sizeof old.spares[1].addr, "%s", old.stages[2].addr);
    assert_int_equal(kvr_plan_validate(&old, 12, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "spares[1] and stage 2"));
    unmake();
}

/* REPLAN: header only, the epoch in arg and the mask in batch_id; every stage accepts it
 * (stage.c acts on it only over a control link), the bridge does not; a zero epoch or
 * mask is refused. */
static void test_replan_frame(void **state)
{
    (void)state;
    static struct kvr_plan plan;
    make(&plan, 3);
    struct kvr_wire_limits lim, bridge;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_limits_init(&lim, &plan, 64, 512, 1, &err), 0);
    assert_int_equal(kvr_wire_limits_init(&bridge, &plan, 64, 512, KVR_WIRE_RECV_BRIDGE, &err), 0);
    uint8_t scratch[4096];
    struct iovec iov[KVR_WIRE_MAX_IOV];
    int n_iov = 0;
    size_t bytes = 0;
    struct kvr_wire_msg m = {.type = KVR_WIRE_REPLAN, .arg = 1, .batch_id = 0x5};
    assert_int_equal(kvr_wire_encode(&m, scratch, sizeof scratch, iov, &n_iov, &bytes, &err), 0);
    assert_int_equal(bytes, KVR_WIRE_HEADER_BYTES);
    struct kvr_wire_header h;
    assert_int_equal(kvr_wire_decode_header(scratch, &lim, &h, &err), 0);
    assert_int_equal(h.type, KVR_WIRE_REPLAN);
    assert_int_equal(h.arg, 1);
    assert_int_equal(h.batch_id, 0x5);
    assert_string_equal(kvr_wire_type_name(KVR_WIRE_REPLAN), "REPLAN");
    assert_int_equal(kvr_wire_decode_header(scratch, &bridge, &h, &err), KVR_EPROTO);
    m.arg = 0;
    assert_int_equal(kvr_wire_encode(&m, scratch, sizeof scratch, iov, &n_iov, &bytes, &err), 0);
    assert_int_equal(kvr_wire_decode_header(scratch, &lim, &h, &err), KVR_EPROTO);
    assert_non_null(strstr(err.msg, "both must be nonzero"));
    unmake();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_replan_drops_a_stage),
        cmocka_unit_test(test_replan_refusals),
        cmocka_unit_test(test_replan_keeps_expert_links),
        cmocka_unit_test(test_replan_spares),
        cmocka_unit_test(test_replan_frame),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
