/* test_plan.c - the deployment plan: parsing, every validation rule, the canonical hash,
 * writing and re-reading, loading with a secret file, and the layer planner.
 *
 * With KVR_WRITE_CORPUS=DIR set, test_write_corpus also writes the seed corpus of
 * tests/fuzz/fuzz_plan.c into DIR. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/alloc.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/synth.h"
#include "ring/plan.h"
#include "ring/propose.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char base_json[] =
    "{\n"
    "  \"model\": \"models/m.gguf\",\n"
    "  \"model_fingerprint\": \"0x00000000deadbeef\",\n"
    "  \"stages\": [\n"
    "    {\"addr\": \"127.0.0.1:7001\", \"layers\": [0, 10]},\n"
    "    {\"addr\": \"127.0.0.1:7002\", \"layers\": [11, 22], \"threads\": 3},\n"
    "    {\"addr\": \"127.0.0.1:7003\", \"layers\": [23, 44]}\n"
    "  ],\n"
    "  \"bridge\": \"127.0.0.1:7000\",\n"
    "  \"row_width\": 64,\n"
    "  \"microbatches\": 4,\n"
    "  \"max_seqs\": 16,\n"
    "  \"n_ctx\": 512,\n"
    "  \"kv_block_tokens\": 16,\n"
    "  \"kv_blocks\": 512,\n"
    "  \"wire_dtype\": \"f16\",\n"
    "  \"kv_type\": \"q8_0\",\n"
    "  \"secret\": \"00112233445566778899aabbccddeeff\"\n"
    "}\n";

/* Plans are ~40 KiB: keep them off the test's stack. */
static struct kvr_plan plan_a, plan_b;

static void parse_ok(struct kvr_plan *p, const char *json)
{
    struct kvr_err err = {0};
    int rc = kvr_plan_parse(p, json, strlen(json), NULL, &err);
    if (rc)
        fail_msg("parse failed: %s", err.msg);
}

static void test_parse_base(void **state)
{
    (void)state;
    struct kvr_plan *p = &plan_a;
    parse_ok(p, base_json);
    assert_string_equal(p->model_path, "models/m.gguf");
    assert_true(p->model_fingerprint == 0xdeadbeefull);
    assert_int_equal(p->n_stages, 3);
    assert_string_equal(p->stages[1].addr, "127.0.0.1:7002");
    assert_int_equal(p->stages[1].first_layer, 11);
    assert_int_equal(p->stages[1].last_layer, 22);
    assert_int_equal(p->stages[1].n_threads, 3);
    assert_int_equal(p->stages[0].n_threads, 0);
    assert_string_equal(p->bridge_addr, "127.0.0.1:7000");
    assert_int_equal(p->row_width, 64);
    assert_int_equal(p->microbatches, 4);
    assert_int_equal(p->max_seqs, 16);
    assert_int_equal(p->n_ctx, 512);
    assert_int_equal(p->kv_block_tokens, 16);
    assert_int_equal(p->kv_blocks, 512);
    assert_int_equal(p->wire_dtype, KVR_DTYPE_F16);
    assert_int_equal(p->kv_type, KVR_DTYPE_Q8_0);
    assert_int_equal(p->secret_bytes, 16);
    assert_int_equal(p->secret[15], 0xff);
    struct kvr_err err = {0};
    assert_int_equal(kvr_plan_validate(p, 45, &err), 0);
    assert_int_equal(kvr_plan_validate(p, 0, &err), 0);
    assert_int_equal(kvr_plan_check_fingerprint(p, 0xdeadbeef, &err), 0);
    assert_int_equal(kvr_plan_check_fingerprint(p, 0xdeadbeee, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "fingerprint"));
}

static void test_defaults(void **state)
{
    (void)state;
    static const char json[] =
        "{\"model\": \"m.gguf\", \"stages\": [{\"addr\": \"a:1\", \"layers\": [0, 0]},"
        " {\"addr\": \"b:1\", \"layers\": [1, 1]}], \"bridge\": \"c:1\", \"row_width\": 8,"
        " \"microbatches\": 2, \"max_seqs\": 3, \"n_ctx\": 100,"
        " \"secret\": \"000102030405060708090a0b0c0d0e0f\"}";
    struct kvr_plan *p = &plan_a;
    parse_ok(p, json);
    assert_true(p->model_fingerprint == 0);
    assert_int_equal(p->kv_block_tokens, KVR_PLAN_DEFAULT_KV_BLOCK_TOKENS);
    /* ceil(100 / 16) = 7 blocks per sequence, 3 sequences */
    assert_int_equal(p->kv_blocks, 21);
    assert_int_equal(p->wire_dtype, KVR_DTYPE_F32);
    assert_int_equal(p->kv_type, KVR_PLAN_DEFAULT_KV_TYPE);
    assert_int_equal(p->n_threads, 0);
    struct kvr_err err = {0};
    assert_int_equal(kvr_plan_validate(p, 2, &err), 0);
    /* A fingerprint of 0 means "do not check". */
    assert_int_equal(kvr_plan_check_fingerprint(p, 12345, &err), 0);
}

/* ---- JSON-level rejections ------------------------------------------------------------- */

struct bad_json {
    const char *from; /* replace this text of base_json ... */
    const char *to;   /* ... by this one */
    const char *msg;  /* expected fragment of the error message */
};

static const struct bad_json bad_jsons[] = {
    {"\"row_width\": 64", "\"row_width\": 64,", "line"}, /* trailing comma */
    {"\"row_width\": 64", "\"row_width\": -1", "between 0 and"},
    {"\"row_width\": 64", "\"row_width\": 4294967296", "between 0 and"},
    {"\"row_width\": 64", "\"row_width\": 1.5", "must be an integer"},
    {"\"row_width\": 64", "\"row_width\": \"64\"", "must be an integer"},
    {"\"row_width\": 64", "\"row_wdith\": 64", "unknown key \"row_wdith\""},
    {"\"row_width\": 64", "\"row_width\": 64, \"row_width\": 32", "duplicate"},
    {"\"microbatches\": 4,", "", "\"microbatches\" is missing"},
    {"\"bridge\": \"127.0.0.1:7000\",", "", "\"bridge\""},
    {"\"model\": \"models/m.gguf\",", "", "\"model\""},
    {"\"layers\": [0, 10]", "\"layers\": [0]", "inclusive range"},
    {"\"layers\": [0, 10]", "\"layers\": [0, 10, 11]", "inclusive range"},
    {"\"layers\": [0, 10]", "\"layers\": \"0-10\"", "inclusive range"},
    {"\"layers\": [0, 10]", "\"layers\": [0, -10]", "stages[0].layers[1]"},
    {"{\"addr\": \"127.0.0.1:7001\", \"layers\": [0, 10]}", "{\"layers\": [0, 10]}",
     "has no \"addr\""},
    {"{\"addr\": \"127.0.0.1:7001\", \"layers\": [0, 10]}",
     "{\"addr\": \"127.0.0.1:7001\", \"layers\": [0, 10], \"gpu\": 1}",
     "unknown key \"gpu\" in stages[0]"},
    {"{\"addr\": \"127.0.0.1:7001\", \"layers\": [0, 10]}", "7", "must be an object"},
    {"\"wire_dtype\": \"f16\"", "\"wire_dtype\": \"q8_0\"", "wire_dtype must be"},
    {"\"kv_type\": \"q8_0\"", "\"kv_type\": \"q4_0\"", "kv_type must be"},
    {"\"kv_type\": \"q8_0\"", "\"kv_type\": 8", "kv_type must be"},
    {"\"secret\": \"00112233445566778899aabbccddeeff\"",
     "\"secret\": \"00112233445566778899aabbccddeefg\"", "hex digits"},
    {"\"secret\": \"00112233445566778899aabbccddeeff\"",
     "\"secret\": \"00112233445566778899aabbccddeef\"", "even number"},
    {"\"secret\": \"00112233445566778899aabbccddeeff\"",
     "\"secret\": \"00112233445566778899aabbccddeeff\", \"secret_file\": \"k\"", "not both"},
    {"\"secret\": \"00112233445566778899aabbccddeeff\"", "\"secret\": 42", "string of hex"},
    {"\"0x00000000deadbeef\"", "\"0xdeadbeefz\"", "not hexadecimal"},
    {"\"0x00000000deadbeef\"", "\"0x00000000deadbeef00\"", "1 to 16 hex digits"},
    {"\"0x00000000deadbeef\"", "3735928559", "hex string"},
};

static char *replaced(const char *text, const char *from, const char *to)
{
    const char *at = strstr(text, from);
    assert_non_null(at);
    size_t n = strlen(text) - strlen(from) + strlen(to) + 1;
    char *out = malloc(n);
    assert_non_null(out);
    snprintf(out, n, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from));
    return out;
}

static void test_parse_rejections(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof bad_jsons / sizeof bad_jsons[0]; i++) {
        char *json = replaced(base_json, bad_jsons[i].from, bad_jsons[i].to);
        struct kvr_err err = {0};
        int rc = kvr_plan_parse(&plan_a, json, strlen(json), NULL, &err);
        if (rc == 0 || !strstr(err.msg, bad_jsons[i].msg))
            fail_msg("case %zu (%s -> %s): rc %d, message \"%s\", wanted \"%s\"", i,
                     bad_jsons[i].from, bad_jsons[i].to, rc, err.msg, bad_jsons[i].msg);
        /* A failed parse leaves no half-filled plan (and no secret) behind. */
        assert_int_equal(plan_a.n_stages, 0);
        assert_int_equal(plan_a.secret_bytes, 0);
        free(json);
    }
    struct kvr_err err = {0};
    assert_int_equal(kvr_plan_parse(&plan_a, "[1, 2]", 6, NULL, &err), KVR_EINVAL);
    assert_int_equal(kvr_plan_parse(&plan_a, "", 0, NULL, &err), KVR_EFORMAT);
    /* Not NUL-terminated: only len bytes are read. */
    assert_int_equal(kvr_plan_parse(&plan_a, base_json, 10, NULL, &err), KVR_EFORMAT);
}

static void test_too_many_stages(void **state)
{
    (void)state;
    char *json = malloc(64 * 1024);
    assert_non_null(json);
    size_t o = (size_t)sprintf(json, "{\"model\": \"m\", \"stages\": [");
    for (int i = 0; i <= KVR_PLAN_MAX_STAGES; i++)
        o += (size_t)sprintf(json + o, "%s{\"addr\": \"h%d:1\", \"layers\": [%d, %d]}",
                             i ? ", " : "", i, i, i);
    sprintf(json + o, "], \"bridge\": \"b:1\", \"row_width\": 1, \"microbatches\": 1, "
                      "\"max_seqs\": 1, \"n_ctx\": 1, \"secret\": "
                      "\"00112233445566778899aabbccddeeff\"}");
    struct kvr_err err = {0};
    assert_int_equal(kvr_plan_parse(&plan_a, json, strlen(json), NULL, &err), KVR_ERANGE);
    assert_non_null(strstr(err.msg, "at most 64"));
    free(json);
}

/* ---- Validation rejections ------------------------------------------------------------- */

typedef void (*mutate_fn)(struct kvr_plan *p);

static void one_stage(struct kvr_plan *p)
{
    p->n_stages = 1;
    p->stages[0].last_layer = 44;
}
static void zero_stages(struct kvr_plan *p)
{
    p->n_stages = 0;
}
static void gap(struct kvr_plan *p)
{
    p->stages[1].first_layer = 12;
}
static void overlap(struct kvr_plan *p)
{
    p->stages[1].first_layer = 10;
}
static void out_of_order(struct kvr_plan *p)
{
    struct kvr_plan_stage t = p->stages[1];
    p->stages[1] = p->stages[2];
    p->stages[2] = t;
}
static void reversed(struct kvr_plan *p)
{
    p->stages[1].last_layer = 5;
}
static void head_late(struct kvr_plan *p)
{
    p->stages[0].first_layer = 2;
}
static void beyond_model(struct kvr_plan *p)
{
    p->stages[2].last_layer = 45;
}
static void short_of_model(struct kvr_plan *p)
{
    p->stages[2].last_layer = 40;
}
static void huge_layer(struct kvr_plan *p)
{
    p->stages[2].last_layer = UINT32_MAX;
}
static void row_width_0(struct kvr_plan *p)
{
    p->row_width = 0;
}
static void row_width_big(struct kvr_plan *p)
{
    p->row_width = KVR_PLAN_MAX_ROW_WIDTH + 1;
}
static void microbatches_0(struct kvr_plan *p)
{
    p->microbatches = 0;
}
static void microbatches_big(struct kvr_plan *p)
{
    p->microbatches = 100000;
}
static void max_seqs_0(struct kvr_plan *p)
{
    p->max_seqs = 0;
}
static void max_seqs_big(struct kvr_plan *p)
{
    p->max_seqs = KVR_PLAN_MAX_SEQS + 1;
}
static void n_ctx_0(struct kvr_plan *p)
{
    p->n_ctx = 0;
}
static void n_ctx_big(struct kvr_plan *p)
{
    p->n_ctx = KVR_PLAN_MAX_CTX + 1;
}
static void kv_block_0(struct kvr_plan *p)
{
    p->kv_block_tokens = 0;
}
static void kv_blocks_0(struct kvr_plan *p)
{
    p->kv_blocks = 0;
}
static void kv_too_small(struct kvr_plan *p)
{
    p->kv_blocks = 31;
} /* 512 / 16 = 32 */
static void kv_overflow(struct kvr_plan *p)
{
    p->kv_blocks = UINT32_MAX;
    p->kv_block_tokens = 65536;
}
static void dup_stage_addr(struct kvr_plan *p)
{
    strcpy(p->stages[2].addr, "127.0.0.1:7001");
}
static void dup_bridge_addr(struct kvr_plan *p)
{
    strcpy(p->stages[1].addr, "127.0.0.1:7000");
}
static void dup_case(struct kvr_plan *p)
{
    strcpy(p->stages[0].addr, "Node-A:7001");
    strcpy(p->stages[1].addr, "node-a:7001");
}
static void addr_no_port(struct kvr_plan *p)
{
    strcpy(p->stages[0].addr, "127.0.0.1");
}
static void addr_port_0(struct kvr_plan *p)
{
    strcpy(p->stages[0].addr, "127.0.0.1:0");
}
static void addr_port_big(struct kvr_plan *p)
{
    strcpy(p->stages[0].addr, "127.0.0.1:65536");
}
static void addr_port_word(struct kvr_plan *p)
{
    strcpy(p->stages[0].addr, "host:http");
}
static void addr_no_host(struct kvr_plan *p)
{
    strcpy(p->stages[0].addr, ":7001");
}
static void addr_space(struct kvr_plan *p)
{
    strcpy(p->stages[0].addr, "my host:7001");
}
static void addr_v6_bare(struct kvr_plan *p)
{
    strcpy(p->stages[0].addr, "::1:7001");
}
static void addr_v6_open(struct kvr_plan *p)
{
    strcpy(p->stages[0].addr, "[::1]7001");
}
static void bridge_bad(struct kvr_plan *p)
{
    strcpy(p->bridge_addr, "bridge");
}
static void no_secret(struct kvr_plan *p)
{
    p->secret_bytes = 0;
}
static void short_secret(struct kvr_plan *p)
{
    p->secret_bytes = 15;
}
static void unread_secret(struct kvr_plan *p)
{
    p->secret_bytes = 0;
    strcpy(p->secret_file, "cluster.key");
}
static void bad_dtype(struct kvr_plan *p)
{
    p->wire_dtype = KVR_DTYPE_Q8_0;
}
static void bad_kv_type(struct kvr_plan *p)
{
    p->kv_type = KVR_DTYPE_BF16;
}
static void threads_big(struct kvr_plan *p)
{
    p->n_threads = 100000;
}
static void stage_threads_big(struct kvr_plan *p)
{
    p->stages[2].n_threads = 100000;
}
static void no_model(struct kvr_plan *p)
{
    p->model_path[0] = 0;
}

struct bad_plan {
    const char *name;
    mutate_fn mutate;
    uint32_t n_layer;
    const char *msg;
};

static const struct bad_plan bad_plans[] = {
    {"one stage", one_stage, 45, "at least two stages: head and tail are different roles"},
    {"no stages", zero_stages, 45, "at least two stages"},
    {"gap", gap, 45, "layers 11..11 are not assigned"},
    {"overlap", overlap, 45, "overlap on layers 10..10"},
    {"out of order", out_of_order, 45, "list stages in layer order"},
    {"reversed", reversed, 45, "must not come after"},
    {"head late", head_late, 45, "layers 0..1 are not assigned"},
    {"beyond model", beyond_model, 45, "outside the model, which has 45 layers"},
    {"short of model", short_of_model, 45, "layers 41..44 of the model are not assigned"},
    {"huge layer", huge_layer, 0, "stage 2 has layers [23, 4294967295], beyond the bound"},
    {"row_width 0", row_width_0, 45, "row_width is 0"},
    {"row_width big", row_width_big, 45, "row_width is 16385, beyond"},
    {"microbatches 0", microbatches_0, 45, "microbatches is 0"},
    {"microbatches big", microbatches_big, 45, "microbatches is 100000"},
    {"max_seqs 0", max_seqs_0, 45, "max_seqs is 0"},
    {"max_seqs big", max_seqs_big, 45, "max_seqs is 16385"},
    {"n_ctx 0", n_ctx_0, 45, "n_ctx is 0"},
    {"n_ctx big", n_ctx_big, 45, "n_ctx is 1048577"},
    {"kv block 0", kv_block_0, 45, "kv_block_tokens is 0"},
    {"kv blocks 0", kv_blocks_0, 45, "kv_blocks is 0"},
    {"kv too small", kv_too_small, 45, "cannot hold one sequence of n_ctx 512"},
    {"kv overflow", kv_overflow, 45, "beyond the bound"},
    {"dup stage addr", dup_stage_addr, 45, "stages 0 and 2 both use address 127.0.0.1:7001"},
    {"dup bridge addr", dup_bridge_addr, 45, "stage 1 and the bridge both use"},
    {"dup case", dup_case, 45, "stages 0 and 1 both use"},
    {"addr no port", addr_no_port, 45, "stage 0 address \"127.0.0.1\""},
    {"addr port 0", addr_port_0, 45, "port 0 is not in 1..65535"},
    {"addr port big", addr_port_big, 45, "port 65536"},
    {"addr port word", addr_port_word, 45, "port must be a number"},
    {"addr no host", addr_no_host, 45, "host is empty"},
    {"addr space", addr_space, 45, "bad character ' '"},
    {"addr v6 bare", addr_v6_bare, 45, "bad character ':'"},
    {"addr v6 open", addr_v6_open, 45, "[addr]:port"},
    {"bridge bad", bridge_bad, 45, "bridge address \"bridge\""},
    {"no secret", no_secret, 45, "no cluster secret"},
    {"short secret", short_secret, 45, "secret is 15 bytes"},
    {"unread secret", unread_secret, 45, "secret_file \"cluster.key\" has not been read"},
    {"bad dtype", bad_dtype, 45, "wire_dtype"},
    {"bad kv type", bad_kv_type, 45, "kv_type"},
    {"threads big", threads_big, 45, "threads is 100000"},
    {"stage threads big", stage_threads_big, 45, "stage 2 has threads 100000"},
    {"no model", no_model, 45, "no model file"},
};

static void test_validate_rejections(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof bad_plans / sizeof bad_plans[0]; i++) {
        parse_ok(&plan_a, base_json);
        bad_plans[i].mutate(&plan_a);
        struct kvr_err err = {0};
        int rc = kvr_plan_validate(&plan_a, bad_plans[i].n_layer, &err);
        if (rc == 0 || err.code != rc || !strstr(err.msg, bad_plans[i].msg))
            fail_msg("%s: rc %d, message \"%s\", wanted \"%s\"", bad_plans[i].name, rc, err.msg,
                     bad_plans[i].msg);
    }
}

static void test_validate_accepts(void **state)
{
    (void)state;
    struct kvr_err err = {0};
    parse_ok(&plan_a, base_json);
    /* IPv6 and host names are fine; so are distinct ports on one host. */
    strcpy(plan_a.stages[0].addr, "[::1]:7001");
    strcpy(plan_a.stages[1].addr, "node-b.example.org:7002");
    strcpy(plan_a.stages[2].addr, "10.0.0.3:65535");
    assert_int_equal(kvr_plan_validate(&plan_a, 45, &err), 0);
    /* Exactly one sequence of n_ctx fits. */
    plan_a.kv_blocks = 32;
    assert_int_equal(kvr_plan_validate(&plan_a, 45, &err), 0);
    /* The widest legal values. */
    plan_a.row_width = KVR_PLAN_MAX_ROW_WIDTH;
    plan_a.max_seqs = KVR_PLAN_MAX_SEQS;
    plan_a.secret_bytes = KVR_PLAN_SECRET_MAX_BYTES;
    assert_int_equal(kvr_plan_validate(&plan_a, 45, &err), 0);
    /* Two stages of one layer each: the smallest ring. */
    plan_a.n_stages = 2;
    plan_a.stages[0].last_layer = 0;
    plan_a.stages[1].first_layer = 1;
    plan_a.stages[1].last_layer = 1;
    assert_int_equal(kvr_plan_validate(&plan_a, 2, &err), 0);
    assert_int_equal(kvr_plan_validate(&plan_a, 3, &err), KVR_EINVAL);
}

/* ---- Hash ------------------------------------------------------------------------------ */

static void test_hash(void **state)
{
    (void)state;
    uint8_t ha[32], hb[32];
    parse_ok(&plan_a, base_json);
    kvr_plan_hash(&plan_a, ha);

    /* Same plan, keys reordered, whitespace changed, a default written out, another
     * secret, another model path, other thread counts: same hash. */
    static const char other[] =
        "{\"wire_dtype\":\"f16\",\"kv_type\":\"q8_0\",\"secret\":"
        "\"ffeeddccbbaa99887766554433221100aa\","
        "\"n_ctx\":512,\"max_seqs\":16,\"microbatches\":4,\"row_width\":64,"
        "\"bridge\":\"127.0.0.1:7000\",\"kv_blocks\":512,\"kv_block_tokens\":16,\"threads\":7,"
        "\"stages\":[{\"layers\":[0,10],\"addr\":\"127.0.0.1:7001\"},"
        "{\"addr\":\"127.0.0.1:7002\",\"layers\":[11,22]},"
        "{\"threads\":2,\"addr\":\"127.0.0.1:7003\",\"layers\":[23,44]}],"
        "\"model_fingerprint\":\"deadbeef\",\"model\":\"/elsewhere/m.gguf\"}";
    parse_ok(&plan_b, other);
    kvr_plan_hash(&plan_b, hb);
    assert_memory_equal(ha, hb, 32);

    /* Any field that the ring must agree on changes it. */
    struct {
        const char *from, *to;
    } changes[] = {
        {"\"0x00000000deadbeef\"", "\"0x00000000deadbeee\""},
        {"[0, 10]", "[0, 11]"},
        {"[11, 22]", "[12, 22]"},
        {"127.0.0.1:7002", "127.0.0.1:7004"},
        {"\"127.0.0.1:7000\"", "\"127.0.0.1:7009\""},
        {"\"row_width\": 64", "\"row_width\": 65"},
        {"\"microbatches\": 4", "\"microbatches\": 5"},
        {"\"max_seqs\": 16", "\"max_seqs\": 17"},
        {"\"n_ctx\": 512", "\"n_ctx\": 513"},
        {"\"kv_block_tokens\": 16", "\"kv_block_tokens\": 32"},
        {"\"kv_blocks\": 512", "\"kv_blocks\": 513"},
        {"\"f16\"", "\"bf16\""},
        {"\"q8_0\"", "\"f16\""},
        {"\"q8_0\"", "\"f32\""},
        {"\"f16\",", "\"f16\", \"encrypt\": false,"},
    };
    for (size_t i = 0; i < sizeof changes / sizeof changes[0]; i++) {
        char *json = replaced(base_json, changes[i].from, changes[i].to);
        parse_ok(&plan_b, json);
        kvr_plan_hash(&plan_b, hb);
        if (!memcmp(ha, hb, 32))
            fail_msg("changing %s to %s did not change the hash", changes[i].from, changes[i].to);
        free(json);
    }
    /* Dropping the last stage (and extending the previous one) changes it too. */
    parse_ok(&plan_b, base_json);
    plan_b.n_stages = 2;
    plan_b.stages[1].last_layer = 44;
    kvr_plan_hash(&plan_b, hb);
    assert_memory_not_equal(ha, hb, 32);

    char hex[65];
    kvr_plan_hash_hex(ha, 32, hex, sizeof hex);
    assert_int_equal(strlen(hex), 64);
    kvr_plan_hash_hex(ha, 4, hex, sizeof hex);
    assert_int_equal(strlen(hex), 8);
    kvr_plan_hash_hex(ha, 32, hex, 9); /* truncates to whole bytes that fit */
    assert_int_equal(strlen(hex), 8);
}

/* ---- Writing and loading --------------------------------------------------------------- */

static void assert_plans_equal(const struct kvr_plan *a, const struct kvr_plan *b)
{
    assert_string_equal(a->model_path, b->model_path);
    assert_true(a->model_fingerprint == b->model_fingerprint);
    assert_int_equal(a->n_stages, b->n_stages);
    for (uint32_t i = 0; i < a->n_stages; i++) {
        assert_string_equal(a->stages[i].addr, b->stages[i].addr);
        assert_int_equal(a->stages[i].first_layer, b->stages[i].first_layer);
        assert_int_equal(a->stages[i].last_layer, b->stages[i].last_layer);
        assert_int_equal(a->stages[i].n_threads, b->stages[i].n_threads);
    }
    assert_string_equal(a->bridge_addr, b->bridge_addr);
    assert_int_equal(a->row_width, b->row_width);
    assert_int_equal(a->microbatches, b->microbatches);
    assert_int_equal(a->max_seqs, b->max_seqs);
    assert_int_equal(a->n_ctx, b->n_ctx);
    assert_int_equal(a->kv_block_tokens, b->kv_block_tokens);
    assert_int_equal(a->kv_blocks, b->kv_blocks);
    assert_int_equal(a->wire_dtype, b->wire_dtype);
    assert_int_equal(a->kv_type, b->kv_type);
    assert_int_equal(a->n_threads, b->n_threads);
    assert_int_equal(a->encrypt, b->encrypt);
    assert_string_equal(a->secret_file, b->secret_file);
    assert_int_equal(a->secret_bytes, b->secret_bytes);
    assert_memory_equal(a->secret, b->secret, a->secret_bytes);
}

/* "encrypt": on unless the plan says false; a boolean, nothing else; written out. */
static void test_encrypt_key(void **state)
{
    (void)state;
    parse_ok(&plan_a, base_json);
    assert_true(plan_a.encrypt);
    char *json = replaced(base_json, "\"f16\",", "\"f16\", \"encrypt\": false,");
    parse_ok(&plan_b, json);
    free(json);
    assert_false(plan_b.encrypt);
    char *text = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_plan_to_json(&plan_b, &text, &err), 0);
    assert_non_null(strstr(text, "\"encrypt\": false"));
    kvr_free(text);
    json = replaced(base_json, "\"f16\",", "\"f16\", \"encrypt\": \"no\",");
    assert_int_equal(kvr_plan_parse(&plan_b, json, strlen(json), NULL, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "encrypt must be true or false"));
    free(json);
}

static void test_json_round_trip(void **state)
{
    (void)state;
    parse_ok(&plan_a, base_json);
    char *text = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_plan_to_json(&plan_a, &text, &err), 0);
    parse_ok(&plan_b, text);
    assert_plans_equal(&plan_a, &plan_b);
    kvr_free(text);

    /* A plan that names a secret file writes the file name, never the secret. */
    plan_a.secret_bytes = 0;
    strcpy(plan_a.secret_file, "keys/cluster.key");
    assert_int_equal(kvr_plan_to_json(&plan_a, &text, &err), 0);
    assert_non_null(strstr(text, "\"secret_file\": \"keys/cluster.key\""));
    assert_null(strstr(text, "\"secret\""));
    kvr_free(text);
}

static char tmpdir[256];

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* A secret file as an operator should make it: private to its owner. */
static void write_key(const char *path, const char *text)
{
    write_file(path, text);
    assert_int_equal(chmod(path, 0600), 0);
}

static void test_load_with_secret_file(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvr_test_plan_XXXXXX");
    assert_non_null(mkdtemp(tmpdir));
    char path[512], key[512], out[512];
    snprintf(key, sizeof key, "%s/cluster.key", tmpdir);
    write_key(key, "  0123456789abcdef0123456789ABCDEF0123456789abcdef\n");
    char *json = replaced(base_json, "\"secret\": \"00112233445566778899aabbccddeeff\"",
                          "\"secret_file\": \"cluster.key\"");
    snprintf(path, sizeof path, "%s/plan.json", tmpdir);
    write_file(path, json);
    free(json);

    struct kvr_err err = {0};
    int rc = kvr_plan_load(&plan_a, path, &err);
    if (rc)
        fail_msg("load: %s", err.msg);
    assert_string_equal(plan_a.dir, tmpdir);
    assert_int_equal(plan_a.secret_bytes, 24);
    assert_false(plan_a.secret_inline);
    assert_int_equal(plan_a.secret[0], 0x01);
    assert_int_equal(plan_a.secret[7], 0xef);
    assert_int_equal(kvr_plan_validate(&plan_a, 45, &err), 0);
    /* The model path resolves against the plan's folder too. */
    assert_int_equal(kvr_plan_path(&plan_a, plan_a.model_path, out, sizeof out, &err), 0);
    char want[600];
    snprintf(want, sizeof want, "%s/models/m.gguf", tmpdir);
    assert_string_equal(out, want);
    assert_int_equal(kvr_plan_path(&plan_a, "/abs/m.gguf", out, sizeof out, &err), 0);
    assert_string_equal(out, "/abs/m.gguf");

    /* Write and load back: same plan (the secret comes from the same file). */
    char path2[512];
    snprintf(path2, sizeof path2, "%s/plan2.json", tmpdir);
    assert_int_equal(kvr_plan_write(&plan_a, path2, &err), 0);
    struct stat st;
    assert_int_equal(stat(path2, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600); /* a plan may hold the secret */
    assert_int_equal(kvr_plan_load(&plan_b, path2, &err), 0);
    assert_plans_equal(&plan_a, &plan_b);

    /* A secret file its group or others may read is refused, naming the mode and the fix;
     * so is one that is not a regular file. */
    static const mode_t open_modes[] = {0640, 0604, 0644, 0660, 0620};
    for (size_t i = 0; i < sizeof open_modes / sizeof open_modes[0]; i++) {
        assert_int_equal(chmod(key, open_modes[i]), 0);
        assert_int_equal(kvr_plan_load(&plan_b, path, &err), KVR_EINVAL);
        char mode_msg[32];
        snprintf(mode_msg, sizeof mode_msg, "has mode %04o", (unsigned)open_modes[i]);
        assert_non_null(strstr(err.msg, mode_msg));
        assert_non_null(strstr(err.msg, "chmod 600"));
        assert_int_equal(plan_b.secret_bytes, 0);
    }
    assert_int_equal(chmod(key, 0400), 0);
    assert_int_equal(kvr_plan_load(&plan_b, path, &err), 0);
    assert_int_equal(chmod(key, 0600), 0);

    /* --secret-file: another file (relative to the working directory, not the plan's
     * folder) replaces the plan's secret; the hash does not change. */
    char key2[600];
    snprintf(key2, sizeof key2, "%s/other.key", tmpdir);
    write_key(key2, "ffeeddccbbaa99887766554433221100\n");
    uint8_t h1[32], h2[32];
    kvr_plan_hash(&plan_a, h1);
    assert_int_equal(kvr_plan_use_secret_file(&plan_a, key2, &err), 0);
    assert_int_equal(plan_a.secret_bytes, 16);
    assert_int_equal(plan_a.secret[0], 0xff);
    assert_string_equal(plan_a.secret_file, key2);
    kvr_plan_hash(&plan_a, h2);
    assert_memory_equal(h1, h2, 32);
    assert_int_equal(chmod(key2, 0644), 0);
    assert_int_equal(kvr_plan_use_secret_file(&plan_a, key2, &err), KVR_EINVAL);
    assert_int_equal(plan_a.secret_bytes, 0);
    unlink(key2);

    /* Writing a secret file: mode 0600, the plan then names it, never an existing file. */
    parse_ok(&plan_b, base_json);
    assert_true(plan_b.secret_inline);
    assert_int_equal(kvr_plan_write_secret_file(&plan_b, key2, "other.key", &err), 0);
    struct stat ks;
    assert_int_equal(stat(key2, &ks), 0);
    assert_int_equal(ks.st_mode & 0777, 0600);
    assert_string_equal(plan_b.secret_file, "other.key");
    assert_false(plan_b.secret_inline);
    char *text = NULL;
    assert_int_equal(kvr_plan_to_json(&plan_b, &text, &err), 0);
    assert_null(strstr(text, "00112233445566778899aabbccddeeff"));
    assert_non_null(strstr(text, "\"secret_file\": \"other.key\""));
    kvr_free(text);
    size_t klen = 0;
    char *ktext = kvr_test_read_file(key2, &klen);
    assert_non_null(ktext);
    assert_string_equal(ktext, "00112233445566778899aabbccddeeff\n");
    free(ktext);
    assert_int_equal(kvr_plan_write_secret_file(&plan_b, key2, "other.key", &err), KVR_EIO);
    unlink(key2);

    /* A bad secret file and a missing one are reported with the path. */
    write_key(key, "not hex at all\n");
    assert_int_equal(kvr_plan_load(&plan_a, path, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "cluster.key"));
    assert_int_equal(plan_a.secret_bytes, 0);
    unlink(key);
    assert_int_equal(kvr_plan_load(&plan_a, path, &err), KVR_EIO);
    assert_non_null(strstr(err.msg, "cluster.key"));
    /* A missing plan, and a syntax error that names the file and line. */
    snprintf(out, sizeof out, "%s/nope.json", tmpdir);
    assert_int_equal(kvr_plan_load(&plan_a, out, &err), KVR_EIO);
    write_file(path, "{\n  \"model\": 1,\n  oops\n}\n");
    assert_int_equal(kvr_plan_load(&plan_a, path, &err), KVR_EFORMAT);
    assert_non_null(strstr(err.msg, "plan.json"));
    assert_non_null(strstr(err.msg, "line 3"));

    unlink(path);
    unlink(path2);
    rmdir(tmpdir);
}

/* ---- Planner --------------------------------------------------------------------------- */

static void balance(const struct kvr_balance_input *in, struct kvr_balance_result *out)
{
    struct kvr_err err = {0};
    int rc = kvr_plan_balance(in, out, &err);
    if (rc)
        fail_msg("balance: %s", err.msg);
    /* Always a partition of [0, n_layer) into non-empty ranges. */
    assert_int_equal(out->first_layer[0], 0);
    for (uint32_t s = 0; s < in->n_stages; s++) {
        assert_true(out->first_layer[s] <= out->last_layer[s]);
        if (s > 0)
            assert_int_equal(out->first_layer[s], out->last_layer[s - 1] + 1);
    }
    assert_int_equal(out->last_layer[in->n_stages - 1], in->n_layer - 1);
}

static uint32_t n_layers(const struct kvr_balance_result *r, uint32_t s)
{
    return r->last_layer[s] - r->first_layer[s] + 1;
}

static void test_balance_uniform(void **state)
{
    (void)state;
    struct kvr_balance_result r;
    struct kvr_balance_input in = {.n_layer = 45, .n_stages = 2};
    balance(&in, &r);
    assert_int_equal(n_layers(&r, 0), 23); /* the tie goes to the earlier stage */
    assert_int_equal(n_layers(&r, 1), 22);
    assert_true(r.max_time == 23.0);

    in.n_stages = 3;
    balance(&in, &r);
    for (uint32_t s = 0; s < 3; s++)
        assert_int_equal(n_layers(&r, s), 15);

    in.n_stages = 5;
    balance(&in, &r);
    for (uint32_t s = 0; s < 5; s++)
        assert_int_equal(n_layers(&r, s), 9);

    /* 45 over 4: 12, 11, 11, 11 (max 12, and the rest as even as possible). */
    in.n_stages = 4;
    balance(&in, &r);
    assert_int_equal(n_layers(&r, 0), 12);
    for (uint32_t s = 1; s < 4; s++)
        assert_int_equal(n_layers(&r, s), 11);
}

static void test_balance_big_output_head(void **state)
{
    (void)state;
    /* Decode reads every weight once per step. A layer of a Llama-3.2-1B-like model
     * (n_embd 2048, n_ff 8192) reads ~4 n_embd^2 + 3 n_embd n_ff weights; its output head
     * n_vocab * n_embd (128256 * 2048), ~3.9 layers' worth; the embedding one row. */
    const double n_embd = 2048, n_ff = 8192, n_vocab = 128256;
    const double layer = 4 * n_embd * n_embd + 3 * n_embd * n_ff;
    double costs[45];
    for (int i = 0; i < 45; i++)
        costs[i] = layer;
    struct kvr_balance_result r;
    struct kvr_balance_input in = {.n_layer = 45,
                                   .n_stages = 3,
                                   .layer_cost = costs,
                                   .head_cost = n_embd,
                                   .tail_cost = n_vocab * n_embd};
    balance(&in, &r);
    /* 16 / 16 / 13 gives max(16, 16, 13 + 3.9) = 16.9 layers' worth, better than 15/15/15
     * (18.9) or 17/16/12 (17). */
    assert_int_equal(n_layers(&r, 0), 16);
    assert_int_equal(n_layers(&r, 1), 16);
    assert_int_equal(n_layers(&r, 2), 13);
    assert_true(fabs(r.max_time - (13 * layer + n_vocab * n_embd)) < 1.0);

    /* A huge head cost pushes layers away from the head instead. */
    in.head_cost = 10 * layer;
    in.tail_cost = 0;
    balance(&in, &r);
    assert_true(n_layers(&r, 0) < n_layers(&r, 1));
}

static void test_balance_speeds_and_memory(void **state)
{
    (void)state;
    struct kvr_balance_result r;
    /* Stage 1 is twice as fast: it takes twice the layers. */
    double speed[2] = {1.0, 2.0};
    struct kvr_balance_input in = {.n_layer = 45, .n_stages = 2, .stage_speed = speed};
    balance(&in, &r);
    assert_int_equal(n_layers(&r, 0), 15);
    assert_int_equal(n_layers(&r, 1), 30);
    assert_true(fabs(r.max_time - 15.0) < 1e-9);

    /* Memory: stage 0 can hold at most 10 layers; it gets 10 and stage 1 the rest. */
    double bytes[45], mem[2] = {10.0, 1000.0};
    for (int i = 0; i < 45; i++)
        bytes[i] = 1.0;
    struct kvr_balance_input in2 = {
        .n_layer = 45, .n_stages = 2, .layer_bytes = bytes, .stage_mem = mem};
    balance(&in2, &r);
    assert_int_equal(n_layers(&r, 0), 10);
    assert_int_equal(n_layers(&r, 1), 35);
    /* Budgets that cannot hold the model. */
    mem[1] = 30.0;
    struct kvr_err err = {0};
    assert_int_equal(kvr_plan_balance(&in2, &r, &err), KVR_ERANGE);
    assert_non_null(strstr(err.msg, "memory"));
    /* The tail's output head counts against its memory. */
    mem[0] = mem[1] = 30.0;
    in2.tail_bytes = 10.0;
    balance(&in2, &r);
    assert_true(n_layers(&r, 1) <= 20);
}

static void test_balance_bad_inputs(void **state)
{
    (void)state;
    struct kvr_balance_result r;
    struct kvr_err err = {0};
    struct kvr_balance_input in = {.n_layer = 3, .n_stages = 4};
    assert_int_equal(kvr_plan_balance(&in, &r, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "at least one layer"));
    in.n_stages = 1;
    assert_int_equal(kvr_plan_balance(&in, &r, &err), KVR_EINVAL);
    in.n_stages = 65;
    in.n_layer = 100;
    assert_int_equal(kvr_plan_balance(&in, &r, &err), KVR_EINVAL);
    double costs[3] = {1, NAN, 1}, speed[2] = {1, 0};
    struct kvr_balance_input in2 = {.n_layer = 3, .n_stages = 2, .layer_cost = costs};
    assert_int_equal(kvr_plan_balance(&in2, &r, &err), KVR_EINVAL);
    costs[1] = 1;
    in2.stage_speed = speed;
    assert_int_equal(kvr_plan_balance(&in2, &r, &err), KVR_EINVAL);
    speed[1] = 1;
    in2.tail_cost = -1;
    assert_int_equal(kvr_plan_balance(&in2, &r, &err), KVR_EINVAL);
}

/* Exhaustive check on small random cases: the planner's bottleneck equals the best over
 * every split. */
static double brute_best(const struct kvr_balance_input *in, uint32_t s, uint32_t from,
                         double so_far)
{
    uint32_t S = in->n_stages, L = in->n_layer;
    double best = INFINITY;
    uint32_t last_end = s + 1 == S ? L : L - (S - 1 - s);
    for (uint32_t end = from + 1; end <= last_end; end++) {
        if (s + 1 == S && end != L)
            continue;
        double c = 0;
        for (uint32_t l = from; l < end; l++)
            c += in->layer_cost[l];
        if (s == 0)
            c += in->head_cost;
        if (s + 1 == S)
            c += in->tail_cost;
        c /= in->stage_speed[s];
        double m = c > so_far ? c : so_far;
        double v = s + 1 == S ? m : brute_best(in, s + 1, end, m);
        if (v < best)
            best = v;
    }
    return best;
}

static void test_balance_matches_brute_force(void **state)
{
    (void)state;
    srand(12345);
    for (int trial = 0; trial < 300; trial++) {
        double costs[12], speed[4];
        uint32_t L = 2 + (uint32_t)(rand() % 11), S = 2 + (uint32_t)(rand() % 3);
        if (S > L)
            S = L;
        for (uint32_t l = 0; l < L; l++)
            costs[l] = (double)(1 + rand() % 9);
        for (uint32_t s = 0; s < S; s++)
            speed[s] = (double)(1 + rand() % 3);
        struct kvr_balance_input in = {.n_layer = L,
                                       .n_stages = S,
                                       .layer_cost = costs,
                                       .head_cost = (double)(rand() % 5),
                                       .tail_cost = (double)(rand() % 20),
                                       .stage_speed = speed};
        struct kvr_balance_result r;
        balance(&in, &r);
        double want = brute_best(&in, 0, 0, 0);
        if (fabs(r.max_time - want) > 1e-9)
            fail_msg("trial %d: planner max %g, best possible %g", trial, r.max_time, want);
    }
}

/* ---- Proposing a plan: the KV cache's type and its memory -------------------------------- */

/* --kv-mem sizes kv_blocks from bytes of the chosen type: on stories260K (5 layers, 32
 * values per position; 2 stages of 3 + 2 layers) a block of 16 positions costs the bigger
 * stage 2 x 3 x 16 x 32 x 4 bytes in f32, half that in f16; q8_0 is refused (heads of 8). */
static void test_propose_kv_type(void **state)
{
    (void)state;
    struct kvr_gguf *g = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_gguf_open(&g, kvr_test_shared("models/stories260K.gguf"), &err), 0);
    struct kvr_plan_spec spec = {.n_stages = 2, .model_path = "m.gguf", .kv_mib = 1};
    const char *types[] = {"f32", "f16"};
    uint32_t blocks[2];
    for (int i = 0; i < 2; i++) {
        spec.kv_type = types[i];
        if (kvr_plan_propose(&plan_a, g, &spec, &err))
            fail_msg("propose %s: %s", types[i], err.msg);
        assert_string_equal(kvr_plan_kv_type_name(plan_a.kv_type), types[i]);
        uint32_t most = 0;
        for (uint32_t s = 0; s < plan_a.n_stages; s++) {
            uint32_t n = plan_a.stages[s].last_layer - plan_a.stages[s].first_layer + 1;
            most = n > most ? n : most;
        }
        blocks[i] = plan_a.kv_blocks;
        assert_int_equal(blocks[i], (1u << 20) / (2u * most * 16 * 32 * (i ? 2 : 4)));
    }
    assert_int_equal(blocks[1], 2 * blocks[0] + (blocks[1] & 1));
    spec.kv_type = NULL; /* the default */
    assert_int_equal(kvr_plan_propose(&plan_a, g, &spec, &err), 0);
    assert_int_equal(plan_a.kv_type, KVR_PLAN_DEFAULT_KV_TYPE);
    spec.kv_type = "q8_0";
    assert_int_equal(kvr_plan_propose(&plan_a, g, &spec, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "multiple of 32"));
    spec.kv_type = "q4_0";
    assert_int_equal(kvr_plan_propose(&plan_a, g, &spec, &err), KVR_EINVAL);
    spec.kv_type = "f16";
    spec.kv_blocks = 100; /* blocks and MiB together */
    assert_int_equal(kvr_plan_propose(&plan_a, g, &spec, &err), KVR_EINVAL);
    kvr_gguf_close(g);
}

/* ---- Proposing a plan with expert agents: the balanced placement ------------------------ */

/* A qwen3moe model in memory: 4 layers, dim 64, 8 experts of width 128, top 2 (the used
 * experts read 4x the attention's weights), a 2048-token output head. */
static struct kvr_gguf *moe_model(char **buf)
{
    struct kvr_synth_opts o = {.type = KVR_DTYPE_F32, .seed = 3, .n_threads = 1};
    o.arch = kvr_arch_find("qwen3moe", strlen("qwen3moe"));
    assert_non_null(o.arch);
    o.shape = (struct kvr_synth_shape){.name = "moe",
                                       .n_layers = 4,
                                       .dim = 64,
                                       .ff = 128,
                                       .n_heads = 4,
                                       .n_kv_heads = 4,
                                       .vocab_size = 2048,
                                       .ctx = 64,
                                       .rope_base = 10000.0f,
                                       .rms_eps = 1e-5f,
                                       .n_expert = 8,
                                       .n_expert_used = 2,
                                       .expert_ff = 128};
    size_t len = 0;
    FILE *f = open_memstream(buf, &len);
    struct kvr_err err = {0};
    assert_int_equal(kvr_synth_write(&o, f, NULL, &err), 0);
    assert_int_equal(fclose(f), 0);
    struct kvr_gguf *g = NULL;
    assert_int_equal(kvr_gguf_open_mem(&g, *buf, len, &err), 0);
    return g;
}

/* Experts the stage owning layer il computes: those no agent holds. */
static uint32_t kept(const struct kvr_plan *p, uint32_t il)
{
    uint32_t n = 0;
    for (uint32_t e = 0; e < 8; e++) {
        bool held = false;
        for (uint32_t j = 0; j < p->n_agents; j++)
            held = held || kvr_plan_agent_holds(&p->agents[j], il, e);
        n += !held;
    }
    return n;
}

/* Each stage keeps the share that balances it with the agents (docs/PLAN.md "Expert
 * placement"): some experts when they dominate, fewer on the tail (it also pays for the
 * output head), none when the agents are far faster, all but one per agent when the
 * stages are; --stage-experts E keeps E everywhere. */
static void test_propose_experts(void **state)
{
    (void)state;
    char *buf = NULL;
    struct kvr_gguf *g = moe_model(&buf);
    struct kvr_err err = {0};
    struct kvr_plan_spec spec = {.n_stages = 2, .model_path = "m.gguf", .n_agents = 2};
    if (kvr_plan_propose(&plan_a, g, &spec, &err))
        fail_msg("propose: %s", err.msg);
    assert_int_equal(plan_a.n_agents, 2);
    uint32_t head = kept(&plan_a, 0), tail = kept(&plan_a, 3);
    assert_true(head >= 1 && head <= 6);
    assert_true(tail <= head);
    for (uint32_t il = 0; il < 4; il++) /* the same share over a stage's layers */
        assert_int_equal(kept(&plan_a, il), il <= plan_a.stages[0].last_layer ? head : tail);
    const double fast[2] = {1000, 1000};
    spec.agent_speed = fast;
    assert_int_equal(kvr_plan_propose(&plan_a, g, &spec, &err), 0);
    assert_int_equal(kept(&plan_a, 0) + kept(&plan_a, 3), 0);
    spec.agent_speed = NULL;
    spec.stage_speed = fast;
    assert_int_equal(kvr_plan_propose(&plan_a, g, &spec, &err), 0);
    assert_int_equal(kept(&plan_a, 0), 6);
    assert_int_equal(kept(&plan_a, 3), 6);
    /* A faster agent holds the bigger block. */
    const double agents[2] = {3, 1};
    spec.stage_speed = NULL;
    spec.agent_speed = agents;
    assert_int_equal(kvr_plan_propose(&plan_a, g, &spec, &err), 0);
    assert_true(
        plan_a.agents[0].holds[0].last_expert + 1 >
        2 * (plan_a.agents[1].holds[0].last_expert - plan_a.agents[0].holds[0].last_expert));
    spec.agent_speed = NULL;
    spec.keep_fixed = true;
    spec.keep = 3;
    assert_int_equal(kvr_plan_propose(&plan_a, g, &spec, &err), 0);
    assert_int_equal(kept(&plan_a, 0), 3);
    assert_int_equal(kept(&plan_a, 3), 3);
    assert_int_equal(plan_a.agents[0].n_holds, 1);
    spec.keep = 7; /* leaves one expert for two agents */
    assert_int_equal(kvr_plan_propose(&plan_a, g, &spec, &err), KVR_EINVAL);
    kvr_gguf_close(g);
    free(buf);
}

/* ---- Seed corpus for fuzz_plan --------------------------------------------------------- */

static void test_write_corpus(void **state)
{
    (void)state;
    const char *dir = getenv("KVR_WRITE_CORPUS");
    if (!dir)
        return; /* only when asked: the corpus is committed under tests/fuzz/corpus/ */
    int n = 0;
    char path[1024];
    const char *texts[2] = {base_json, NULL};
    char *written = NULL;
    struct kvr_err err = {0};
    parse_ok(&plan_a, base_json);
    assert_int_equal(kvr_plan_to_json(&plan_a, &written, &err), 0);
    texts[1] = written;
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/seed_%02d.json", dir, n++);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(texts[i], f);
        fclose(f);
    }
    kvr_free(written);
    for (size_t i = 0; i < sizeof bad_jsons / sizeof bad_jsons[0]; i++) {
        char *json = replaced(base_json, bad_jsons[i].from, bad_jsons[i].to);
        snprintf(path, sizeof path, "%s/seed_%02d.json", dir, n++);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(json, f);
        fclose(f);
        free(json);
    }
    print_message("wrote %d seeds to %s\n", n, dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_base),
        cmocka_unit_test(test_propose_kv_type),
        cmocka_unit_test(test_propose_experts),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_parse_rejections),
        cmocka_unit_test(test_too_many_stages),
        cmocka_unit_test(test_validate_rejections),
        cmocka_unit_test(test_validate_accepts),
        cmocka_unit_test(test_hash),
        cmocka_unit_test(test_json_round_trip),
        cmocka_unit_test(test_load_with_secret_file),
        cmocka_unit_test(test_encrypt_key),
        cmocka_unit_test(test_balance_uniform),
        cmocka_unit_test(test_balance_big_output_head),
        cmocka_unit_test(test_balance_speeds_and_memory),
        cmocka_unit_test(test_balance_bad_inputs),
        cmocka_unit_test(test_balance_matches_brute_force),
        cmocka_unit_test(test_write_corpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
