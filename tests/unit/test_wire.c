/* test_wire.c - the frame codec: round trips of every frame type, forwarding through
 * stages, every header and body rule, truncation, limits, row conversion.
 *
 * With KVR_WRITE_CORPUS=DIR set, test_write_corpus also writes the seed corpus of
 * tests/fuzz/fuzz_wire.c into DIR (see tests/fuzz/wire_fuzz_plan.h for the format). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "../fuzz/wire_fuzz_plan.h"
#include "core/alloc.h"
#include "ring/plan.h"
#include "ring/wire.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_EMBD 8
#define N_VOCAB 100
#define BUF_BYTES (1 << 16)

static struct kvr_plan plan;
static _Alignas(64) uint8_t buf[BUF_BYTES];
static uint8_t scratch[BUF_BYTES];

/* 3 stages, 16 rows, 8 sequences, 128 positions; boundary rows in `dtype`. */
static void make_plan(enum kvr_dtype dtype)
{
    memset(&plan, 0, sizeof plan);
    strcpy(plan.model_path, "m.gguf");
    plan.n_stages = 3;
    for (uint32_t i = 0; i < 3; i++) {
        snprintf(plan.stages[i].addr, sizeof plan.stages[i].addr, "127.0.0.1:%u", 7001 + i);
        plan.stages[i].first_layer = 2 * i;
        plan.stages[i].last_layer = 2 * i + 1;
    }
    strcpy(plan.bridge_addr, "127.0.0.1:7000");
    plan.row_width = 16;
    plan.microbatches = 3;
    plan.max_seqs = 8;
    plan.n_ctx = 128;
    plan.kv_block_tokens = 16;
    plan.kv_blocks = 64;
    plan.wire_dtype = dtype;
    plan.secret_bytes = 16;
    struct kvr_err err = {0};
    if (kvr_plan_validate(&plan, 6, &err))
        fail_msg("test plan invalid: %s", err.msg);
}

static void limits(struct kvr_wire_limits *lim, int receiver)
{
    struct kvr_err err = {0};
    if (kvr_wire_limits_init(lim, &plan, N_EMBD, N_VOCAB, receiver, &err))
        fail_msg("limits: %s", err.msg);
}

/* A membership mixing a prefill chunk, a last chunk and two decodes: 11 rows, 3 logit rows. */
static const struct kvr_seg segs4[4] = {
    {.seq = 0, .pos0 = 0, .n_tokens = 5, .flags = KVR_SEG_PREFILL},
    {.seq = 3,
     .pos0 = 10,
     .n_tokens = 4,
     .flags = KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN},
    {.seq = 5, .pos0 = 40, .n_tokens = 1, .flags = KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN},
    {.seq = 6, .pos0 = 127, .n_tokens = 1, .flags = KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN},
};
#define N_ROWS 11

static const struct kvr_wire_ctrl ctrl3[3] = {
    {.type = KVR_WIRE_CTRL_OPEN,
     .flags = KVR_WIRE_OPEN_LOGPROBS,
     .seq = 3,
     .sampling = {.temperature = 0.7f,
                  .top_k = 40,
                  .top_p = 0.95f,
                  .min_p = 0.05f,
                  .repeat_penalty = 1.1f,
                  .frequency_penalty = -0.5f,
                  .presence_penalty = 0.25f,
                  .repeat_last_n = 64,
                  .seed = 0x0123456789abcdefull}},
    {.type = KVR_WIRE_CTRL_FREE, .seq = 1},
    {.type = KVR_WIRE_CTRL_CANCEL, .seq = 7},
};

static const struct kvr_wire_timing timings2[2] = {
    {.stage = 0, .held_ns = 1000, .starved_ns = 2000, .blocked_ns = 3000},
    {.stage = 1, .held_ns = UINT64_MAX, .starved_ns = 0, .blocked_ns = 42},
};

/* Encode through the iovec path and gather the iovecs into buf (what writev would send). */
static size_t encode(const struct kvr_wire_msg *m)
{
    struct iovec iov[KVR_WIRE_MAX_IOV];
    int n_iov = 0;
    size_t total = 0;
    struct kvr_err err = {0};
    if (kvr_wire_encode(m, scratch, sizeof scratch, iov, &n_iov, &total, &err))
        fail_msg("encode: %s", err.msg);
    size_t o = 0;
    for (int i = 0; i < n_iov; i++) {
        memcpy(buf + o, iov[i].iov_base, iov[i].iov_len);
        o += iov[i].iov_len;
    }
    assert_int_equal(o, total);
    /* The flat encoder gives the same bytes. */
    static uint8_t flat[BUF_BYTES];
    size_t n = 0;
    assert_int_equal(kvr_wire_encode_flat(m, flat, sizeof flat, &n, &err), 0);
    assert_int_equal(n, total);
    assert_memory_equal(flat, buf, total);
    return total;
}

static void fix_crc(uint8_t *b)
{
    kvr_st32(b + 36, kvr_crc32c(b, 36));
}

/* Decode buf[0..len) as one frame. */
static int decode(size_t len, const struct kvr_wire_limits *lim, struct kvr_wire_frame *f,
                  struct kvr_err *err)
{
    struct kvr_wire_header h;
    if (len < KVR_WIRE_HEADER_BYTES)
        return KVR_EPROTO;
    int rc = kvr_wire_decode_header(buf, lim, &h, err);
    if (rc)
        return rc;
    return kvr_wire_decode_body(f, &h, buf + KVR_WIRE_HEADER_BYTES, len - KVR_WIRE_HEADER_BYTES,
                                lim, err);
}

static void decode_ok(size_t len, const struct kvr_wire_limits *lim, struct kvr_wire_frame *f)
{
    struct kvr_err err = {0};
    if (decode(len, lim, f, &err))
        fail_msg("decode: %s", err.msg);
}

static void expect_reject(size_t len, const struct kvr_wire_limits *lim, const char *what,
                          const char *msg)
{
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, lim, &err), 0);
    int rc = decode(len, lim, &f, &err);
    kvr_wire_frame_fini(&f);
    if (rc != KVR_EPROTO || !strstr(err.msg, msg))
        fail_msg("%s: rc %d, message \"%s\", wanted \"%s\"", what, rc, err.msg, msg);
}

static void assert_ctrl_equal(const struct kvr_wire_ctrl *a, const struct kvr_wire_ctrl *b)
{
    assert_int_equal(a->type, b->type);
    assert_int_equal(a->flags, b->flags);
    assert_int_equal(a->seq, b->seq);
    assert_memory_equal(&a->sampling, &b->sampling, sizeof a->sampling);
}

static void test_crc32c(void **state)
{
    (void)state;
    /* The standard check value of CRC-32C. */
    assert_int_equal(kvr_crc32c("123456789", 9), 0xe3069283u);
    assert_int_equal(kvr_crc32c("", 0), 0);
}

static void test_round_trip_tokens(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F16);
    struct kvr_wire_limits lim;
    limits(&lim, 0);
    int32_t tokens[N_ROWS];
    for (int i = 0; i < N_ROWS; i++)
        tokens[i] = (i * 37) % N_VOCAB;
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .batch_id = 0xfeedfacecafebeefull,
                             .ctrl = ctrl3,
                             .n_ctrl = 3,
                             .segs = segs4,
                             .n_segs = 4,
                             .payload = KVR_WIRE_PAYLOAD_TOKENS,
                             .payload_data = tokens,
                             .payload_bytes = sizeof tokens};
    size_t len = encode(&m);
    assert_int_equal(len, 40 + 3 * 48 + 4 * 16 + N_ROWS * 4);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    decode_ok(len, &lim, &f);
    assert_int_equal(f.hdr.type, KVR_WIRE_BATCH);
    assert_true(f.hdr.batch_id == 0xfeedfacecafebeefull);
    assert_int_equal(f.hdr.n_rows, N_ROWS);
    assert_int_equal(f.hdr.n_segs, 4);
    assert_int_equal(f.hdr.n_ctrl, 3);
    assert_int_equal(f.hdr.n_timings, 0);
    assert_int_equal(f.n_logit_rows, 3);
    for (int i = 0; i < 3; i++)
        assert_ctrl_equal(&f.ctrl[i], &ctrl3[i]);
    assert_memory_equal(f.segs, segs4, sizeof segs4);
    assert_memory_equal(f.payload, tokens, sizeof tokens);
    assert_int_equal((uintptr_t)f.payload % 8, 0); /* aligned like the body */
    kvr_wire_frame_fini(&f);
}

static void round_trip_rows(enum kvr_dtype dtype, uint32_t payload)
{
    make_plan(dtype);
    struct kvr_wire_limits lim;
    limits(&lim, 1);
    assert_int_equal(lim.rows_payload, payload);
    float rows[N_ROWS * N_EMBD];
    uint16_t half[N_ROWS * N_EMBD];
    for (int i = 0; i < N_ROWS * N_EMBD; i++)
        rows[i] = (float)(i - 40) * 0.125f; /* exact in f16 and bf16 */
    const void *data = rows;
    size_t bytes = sizeof rows;
    if (payload != KVR_WIRE_PAYLOAD_F32) {
        kvr_wire_rows_from_f32(payload, rows, N_ROWS * N_EMBD, half);
        data = half;
        bytes = sizeof half;
    }
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .batch_id = 7,
                             .ctrl = ctrl3,
                             .n_ctrl = 1,
                             .segs = segs4,
                             .n_segs = 4,
                             .payload = payload,
                             .payload_data = data,
                             .payload_bytes = bytes,
                             .timings = timings2,
                             .n_timings = 1};
    size_t len = encode(&m);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    decode_ok(len, &lim, &f);
    assert_int_equal(f.hdr.payload, payload);
    assert_int_equal(f.hdr.payload_bytes, bytes);
    float back[N_ROWS * N_EMBD];
    kvr_wire_rows_to_f32(payload, f.payload, N_ROWS * N_EMBD, back);
    assert_memory_equal(back, rows, sizeof rows);
    assert_int_equal(f.hdr.n_timings, 1);
    assert_memory_equal(&f.timings[0], &timings2[0], sizeof timings2[0]);
    kvr_wire_frame_fini(&f);
}

static void test_round_trip_rows(void **state)
{
    (void)state;
    round_trip_rows(KVR_DTYPE_F32, KVR_WIRE_PAYLOAD_F32);
    round_trip_rows(KVR_DTYPE_F16, KVR_WIRE_PAYLOAD_F16);
    round_trip_rows(KVR_DTYPE_BF16, KVR_WIRE_PAYLOAD_BF16);
}

static const struct kvr_wire_result results3[3] = {
    {.seq = 3, .token = 17, .logprob = -0.5f, .flags = KVR_WIRE_RESULT_LOGPROB},
    {.seq = 5, .token = 0, .logprob = 0.0f, .flags = KVR_WIRE_RESULT_EOG},
    {.seq = 6, .token = N_VOCAB - 1, .logprob = -INFINITY, .flags = KVR_WIRE_RESULT_LOGPROB},
};

static size_t encode_result(const struct kvr_wire_result *results, uint32_t n_results)
{
    struct kvr_wire_timing t3[3] = {timings2[0], timings2[1], {.stage = 2, .held_ns = 5}};
    struct kvr_wire_msg m = {.type = KVR_WIRE_RESULT,
                             .batch_id = 99,
                             .ctrl = ctrl3,
                             .n_ctrl = 3,
                             .segs = segs4,
                             .n_segs = 4,
                             .payload = KVR_WIRE_PAYLOAD_RESULTS,
                             .results = results,
                             .n_results = n_results,
                             .timings = t3,
                             .n_timings = 3};
    return encode(&m);
}

static void test_round_trip_result(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, KVR_WIRE_RECV_BRIDGE);
    size_t len = encode_result(results3, 3);
    assert_int_equal(len, 40 + 3 * 48 + 4 * 16 + 3 * 16 + 3 * 32);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    decode_ok(len, &lim, &f);
    assert_int_equal(f.hdr.type, KVR_WIRE_RESULT);
    assert_int_equal(f.hdr.n_results, 3);
    assert_memory_equal(f.results, results3, sizeof results3);
    assert_int_equal(f.hdr.n_timings, 3);
    assert_int_equal(f.timings[2].stage, 2);
    assert_true(f.timings[1].held_ns == UINT64_MAX);
    kvr_wire_frame_fini(&f);
}

static void test_round_trip_control_frames(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    int receivers[] = {0, 1, 2, KVR_WIRE_RECV_BRIDGE, KVR_WIRE_RECV_ANY};
    for (size_t r = 0; r < sizeof receivers / sizeof receivers[0]; r++) {
        struct kvr_wire_limits lim;
        limits(&lim, receivers[r]);
        struct kvr_wire_frame f;
        struct kvr_err err = {0};
        assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
        struct kvr_wire_msg hb = {.type = KVR_WIRE_HEARTBEAT, .batch_id = 12345};
        size_t len = encode(&hb);
        assert_int_equal(len, KVR_WIRE_HEADER_BYTES);
        decode_ok(len, &lim, &f);
        assert_int_equal(f.hdr.type, KVR_WIRE_HEARTBEAT);
        assert_true(f.hdr.batch_id == 12345);
        struct kvr_wire_msg bye = {.type = KVR_WIRE_GOODBYE, .arg = KVR_WIRE_GOODBYE_ERROR};
        len = encode(&bye);
        decode_ok(len, &lim, &f);
        assert_int_equal(f.hdr.type, KVR_WIRE_GOODBYE);
        assert_int_equal(f.hdr.arg, KVR_WIRE_GOODBYE_ERROR);
        /* RESET: stage 0 dropped its sequences because its upstream link changed. */
        struct kvr_wire_msg reset = {
            .type = KVR_WIRE_RESET, .arg = 0, .batch_id = KVR_WIRE_RESET_LINK};
        len = encode(&reset);
        assert_int_equal(len, KVR_WIRE_HEADER_BYTES);
        if (receivers[r] == 0) {
            expect_reject(len, &lim, "reset to the head", "not accepted on this link");
        } else {
            decode_ok(len, &lim, &f);
            assert_int_equal(f.hdr.type, KVR_WIRE_RESET);
            assert_int_equal(f.hdr.arg, 0);
            assert_true(f.hdr.batch_id == KVR_WIRE_RESET_LINK);
        }
        kvr_wire_frame_fini(&f);
    }
}

/* A BATCH carrying only control records (no rows) is legal: e.g. freeing sequences while
 * nothing else is running. */
static void test_control_only_batch(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F16);
    struct kvr_wire_limits lim;
    limits(&lim, 2);
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .ctrl = ctrl3 + 1,
                             .n_ctrl = 2,
                             .payload = KVR_WIRE_PAYLOAD_F16,
                             .timings = timings2,
                             .n_timings = 2};
    size_t len = encode(&m);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    decode_ok(len, &lim, &f);
    assert_int_equal(f.hdr.n_rows, 0);
    assert_int_equal(f.hdr.n_ctrl, 2);
    assert_null(f.payload);
    kvr_wire_frame_fini(&f);
}

/* The bridge sends tokens to stage 0; stage 0 forwards f16 rows to stage 1, which forwards
 * to stage 2 (the tail), which answers the bridge: membership and control records arrive
 * unchanged, and each hop adds one timing record. */
static void test_forward_around_the_ring(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F16);
    struct kvr_wire_limits lim[3], lim_bridge, lim_any;
    for (int s = 0; s < 3; s++)
        limits(&lim[s], s);
    limits(&lim_bridge, KVR_WIRE_RECV_BRIDGE);
    limits(&lim_any, KVR_WIRE_RECV_ANY);
    /* One frame struct for every hop: sized for any frame of the plan. */
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim_any, &err), 0);

    int32_t tokens[N_ROWS] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .batch_id = 5,
                             .ctrl = ctrl3,
                             .n_ctrl = 3,
                             .segs = segs4,
                             .n_segs = 4,
                             .payload = KVR_WIRE_PAYLOAD_TOKENS,
                             .payload_data = tokens,
                             .payload_bytes = sizeof tokens};
    size_t len = encode(&m);
    uint16_t rows[N_ROWS * N_EMBD];
    for (uint32_t s = 0; s < 3; s++) {
        decode_ok(len, &lim[s], &f);
        struct kvr_wire_timing mine = {.stage = s, .held_ns = 100 + s};
        assert_int_equal(kvr_wire_frame_append_timing(&f, &mine, &err), 0);
        struct kvr_wire_msg out;
        kvr_wire_msg_forward(&out, &f);
        if (s < 2) {
            for (size_t i = 0; i < N_ROWS * N_EMBD; i++)
                rows[i] = (uint16_t)(s * 1000 + i);
            out.payload = KVR_WIRE_PAYLOAD_F16;
            out.payload_data = rows;
            out.payload_bytes = sizeof rows;
        } else {
            out.type = KVR_WIRE_RESULT;
            out.payload = KVR_WIRE_PAYLOAD_RESULTS;
            out.results = results3;
            out.n_results = 3;
        }
        len = encode(&out);
    }
    decode_ok(len, &lim_bridge, &f);
    assert_int_equal(f.hdr.type, KVR_WIRE_RESULT);
    assert_true(f.hdr.batch_id == 5);
    assert_memory_equal(f.segs, segs4, sizeof segs4);
    for (int i = 0; i < 3; i++)
        assert_ctrl_equal(&f.ctrl[i], &ctrl3[i]);
    assert_int_equal(f.hdr.n_timings, 3);
    for (uint32_t s = 0; s < 3; s++) {
        assert_int_equal(f.timings[s].stage, s);
        assert_true(f.timings[s].held_ns == 100 + s);
    }
    assert_memory_equal(f.results, results3, sizeof results3);
    kvr_wire_frame_fini(&f);
}

/* ---- Header rules ---------------------------------------------------------------------- */

/* A valid f16 BATCH to stage 1 in buf; returns its length. */
static size_t valid_batch(void)
{
    make_plan(KVR_DTYPE_F16);
    static uint16_t rows[N_ROWS * N_EMBD];
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .batch_id = 1,
                             .ctrl = ctrl3,
                             .n_ctrl = 3,
                             .segs = segs4,
                             .n_segs = 4,
                             .payload = KVR_WIRE_PAYLOAD_F16,
                             .payload_data = rows,
                             .payload_bytes = sizeof rows,
                             .timings = timings2,
                             .n_timings = 1};
    return encode(&m);
}

static void test_header_rejections(void **state)
{
    (void)state;
    struct kvr_wire_limits lim;
    size_t len;

#define CASE(what, mutation, msg)                                                                  \
    do {                                                                                           \
        len = valid_batch();                                                                       \
        limits(&lim, 1);                                                                           \
        mutation;                                                                                  \
        fix_crc(buf);                                                                              \
        expect_reject(len, &lim, what, msg);                                                       \
    } while (0)

    CASE("magic", buf[0] = 'X', "bad frame magic");
    CASE("type 0", buf[4] = 0, "unknown frame type 0");
    CASE("type 9", buf[4] = 9, "unknown frame type 9");
    CASE("type not accepted", buf[4] = KVR_WIRE_RESULT, "RESULT frame is not accepted");
    CASE("payload unknown", buf[5] = 7, "unknown payload type 7");
    CASE("payload f32 on an f16 link", buf[5] = KVR_WIRE_PAYLOAD_F32,
         "carries f32; this link expects f16");
    CASE("tokens to stage 1", buf[5] = KVR_WIRE_PAYLOAD_TOKENS,
         "carries tokens; this link expects f16");
    CASE("arg on batch", kvr_st16(buf + 6, 1), "nonzero argument 1");
    CASE("too many rows", kvr_st32(buf + 16, 17), "17 rows; the plan's row_width is 16");
    CASE("rows != payload", kvr_st32(buf + 16, 12), "payload is 176 bytes; 12 rows");
    CASE("too many segments", kvr_st16(buf + 20, 17), "17 segments; at most 16");
    CASE("segments > rows", (kvr_st32(buf + 16, 3), kvr_st16(buf + 20, 4)),
         "4 segments for 3 rows");
    CASE("rows without segments", kvr_st16(buf + 20, 0), "0 segments for 11 rows");
    CASE("too many ctrl", kvr_st16(buf + 22, 41), "41 control records; at most 40");
    CASE("timings", kvr_st16(buf + 24, 2), "2 timing records; one per upstream stage (1)");
    CASE("results in batch", kvr_st16(buf + 26, 1), "declares 1 result records");
    CASE("payload length", kvr_st32(buf + 28, 174), "payload is 174 bytes");
    CASE("body length", kvr_st32(buf + 32, 1000), "sections add up to");

    /* Checksum: a flipped bit anywhere in the first 36 bytes, without fixing the CRC. */
    for (int bit = 0; bit < 36 * 8; bit++) {
        len = valid_batch();
        limits(&lim, 1);
        buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
        const char *want = bit < 32 ? "bad frame magic" : "checksum";
        char what[32];
        snprintf(what, sizeof what, "bit %d", bit);
        expect_reject(len, &lim, what, want);
    }
    len = valid_batch();
    buf[37] ^= 1;
    expect_reject(len, &lim, "crc field", "checksum");

    /* A frame over the receiver's limit is refused from its header alone. */
    len = valid_batch();
    limits(&lim, 1);
    lim.max_frame_bytes = (uint32_t)len - 1;
    expect_reject(len, &lim, "frame over the limit", "exceeds the plan's largest frame");

    /* Heartbeat and goodbye carry nothing. */
    struct kvr_wire_msg hb = {.type = KVR_WIRE_HEARTBEAT};
    len = encode(&hb);
    kvr_st32(buf + 32, 16);
    fix_crc(buf);
    expect_reject(len, &lim, "heartbeat with a body", "has no body");
    len = encode(&hb);
    buf[5] = KVR_WIRE_PAYLOAD_F16;
    fix_crc(buf);
    expect_reject(len, &lim, "heartbeat with a payload type", "has no body");
    len = encode(&hb);
    kvr_st16(buf + 6, 1);
    fix_crc(buf);
    expect_reject(len, &lim, "heartbeat arg", "unknown argument 1");
    struct kvr_wire_msg bye = {.type = KVR_WIRE_GOODBYE};
    len = encode(&bye);
    kvr_st16(buf + 6, KVR_WIRE_GOODBYE_COUNT);
    fix_crc(buf);
    expect_reject(len, &lim, "goodbye reason", "unknown argument 2");
    /* A reset is about a stage upstream of the receiver (here stage 1: only stage 0). */
    struct kvr_wire_msg reset = {.type = KVR_WIRE_RESET, .arg = 1, .batch_id = 9};
    len = encode(&reset);
    expect_reject(len, &lim, "reset from downstream", "names stage 1, which is not upstream");
    reset.arg = 0;
    len = encode(&reset);
    kvr_st32(buf + 16, 1);
    fix_crc(buf);
    expect_reject(len, &lim, "reset with rows", "has no body");

    /* RESULT frames: only on the bridge's link, only with results. */
    make_plan(KVR_DTYPE_F32);
    limits(&lim, KVR_WIRE_RECV_BRIDGE);
    len = encode_result(results3, 3);
    buf[5] = KVR_WIRE_PAYLOAD_F32;
    fix_crc(buf);
    expect_reject(len, &lim, "result payload", "RESULT frame carries f32");
    len = encode_result(results3, 3);
    kvr_st16(buf + 26, 5);
    fix_crc(buf);
    expect_reject(len, &lim, "results > segments", "5 results for 4 segments");
    len = encode_result(results3, 3);
    kvr_st16(buf + 24, 2);
    fix_crc(buf);
    expect_reject(len, &lim, "bridge timings", "one per upstream stage (3)");
    len = valid_batch();
    limits(&lim, KVR_WIRE_RECV_BRIDGE);
    expect_reject(len, &lim, "batch to the bridge", "BATCH frame is not accepted");
#undef CASE
}

/* ---- Body rules ------------------------------------------------------------------------ */

/* Encode a tokens BATCH for stage 0 with the given membership and control records. */
static size_t batch_with(const struct kvr_seg *segs, uint32_t n_segs,
                         const struct kvr_wire_ctrl *ctrl, uint32_t n_ctrl)
{
    static int32_t tokens[16];
    uint32_t rows = 0;
    for (uint32_t i = 0; i < n_segs; i++)
        rows += segs[i].n_tokens;
    assert_true(rows <= 16);
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .ctrl = ctrl,
                             .n_ctrl = n_ctrl,
                             .segs = segs,
                             .n_segs = n_segs,
                             .payload = KVR_WIRE_PAYLOAD_TOKENS,
                             .payload_data = tokens,
                             .payload_bytes = rows * 4};
    return encode(&m);
}

static void test_segment_rejections(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, 0);
    const uint32_t P = KVR_SEG_PREFILL, L = KVR_SEG_LAST_CHUNK, D = KVR_SEG_DECODE,
                   W = KVR_SEG_WANTS_TOKEN;
    struct {
        const char *what;
        struct kvr_seg seg[2];
        const char *msg;
    } cases[] = {
        {"zero tokens", {{1, 0, 2, P}, {2, 0, 0, P}}, "segment 1 (seq 2) has no tokens"},
        {"seq range", {{1, 0, 2, P}, {8, 0, 1, D}}, "names seq 8; the plan has 8"},
        {"past n_ctx", {{1, 120, 9, P}, {2, 0, 1, D}}, "positions 120..128 exceed n_ctx 128"},
        {"pos overflow", {{1, UINT32_MAX, 2, P}, {2, 0, 1, D}}, "exceed n_ctx"},
        {"unknown flag", {{1, 0, 2, P | 16}, {2, 0, 1, D}}, "unknown flags 0x11"},
        {"both kinds", {{1, 0, 2, P | D}, {2, 0, 1, D}}, "exactly one of PREFILL and DECODE"},
        {"no kind", {{1, 0, 2, 0}, {2, 0, 1, D}}, "exactly one of PREFILL and DECODE"},
        {"last w/o prefill", {{1, 0, 1, D | L}, {2, 0, 1, D}}, "LAST_CHUNK without PREFILL"},
        {"decode of 2", {{1, 0, 2, D}, {2, 0, 1, D}}, "exactly one token"},
        {"wants mid-prefill", {{1, 0, 2, P | W}, {2, 0, 1, D}}, "WANTS_TOKEN only"},
        {"duplicate seq", {{1, 0, 2, P}, {1, 2, 1, D}}, "seq 1 appears in two segments"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len = batch_with(cases[i].seg, 2, NULL, 0);
        expect_reject(len, &lim, cases[i].what, cases[i].msg);
    }
    /* Segment rows that do not sum to n_rows (header patched consistently). */
    struct kvr_seg ok[2] = {{1, 0, 2, P}, {2, 0, 1, D}};
    size_t len = batch_with(ok, 2, NULL, 0);
    kvr_st32(buf + 40 + 8, 1); /* first segment claims 1 token; header still says 3 rows */
    expect_reject(len, &lim, "row sum", "segments hold 2 rows; the header says 3");

    /* After a rejected duplicate, the decoder's seq bitmap is clean again: the same frame
     * struct decodes a frame reusing those seqs. */
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    struct kvr_seg dup[2] = {{1, 0, 2, P}, {1, 2, 1, D}};
    len = batch_with(dup, 2, NULL, 0);
    assert_int_equal(decode(len, &lim, &f, &err), KVR_EPROTO);
    len = batch_with(ok, 2, NULL, 0);
    assert_int_equal(decode(len, &lim, &f, &err), 0);
    assert_int_equal(decode(len, &lim, &f, &err), 0);
    kvr_wire_frame_fini(&f);

    /* Token ids outside the vocabulary. */
    static int32_t bad_tokens[3] = {0, N_VOCAB, 1};
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .segs = ok,
                             .n_segs = 2,
                             .payload = KVR_WIRE_PAYLOAD_TOKENS,
                             .payload_data = bad_tokens,
                             .payload_bytes = sizeof bad_tokens};
    len = encode(&m);
    expect_reject(len, &lim, "token >= n_vocab", "row 1 has token id 100");
    bad_tokens[1] = -1;
    len = encode(&m);
    expect_reject(len, &lim, "negative token", "row 1 has token id -1");
}

static void test_ctrl_rejections(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, 0);
    struct kvr_seg seg = {0, 0, 1, KVR_SEG_DECODE};
    struct kvr_wire_ctrl c;
    const struct kvr_wire_ctrl open = ctrl3[0];
    size_t len;

#define CTRL_CASE(what, mutation, msg)                                                             \
    do {                                                                                           \
        c = open;                                                                                  \
        mutation;                                                                                  \
        len = batch_with(&seg, 1, &c, 1);                                                          \
        expect_reject(len, &lim, what, msg);                                                       \
    } while (0)

    CTRL_CASE("type 0", c.type = 0, "unknown type 0");
    CTRL_CASE("type 9", c.type = 9, "unknown type 9");
    CTRL_CASE("seq range", c.seq = 8, "names seq 8");
    CTRL_CASE("open flags", c.flags = 2, "unknown flags 0x2");
    CTRL_CASE("temperature NaN", c.sampling.temperature = NAN, "temperature");
    CTRL_CASE("temperature inf", c.sampling.temperature = INFINITY, "temperature");
    CTRL_CASE("temperature < 0", c.sampling.temperature = -0.1f, "temperature");
    CTRL_CASE("top_k < 0", c.sampling.top_k = -1, "top_k");
    CTRL_CASE("top_p > 1", c.sampling.top_p = 1.5f, "top_p");
    CTRL_CASE("top_p NaN", c.sampling.top_p = NAN, "top_p");
    CTRL_CASE("min_p < 0", c.sampling.min_p = -0.01f, "min_p");
    CTRL_CASE("repeat_penalty 0", c.sampling.repeat_penalty = 0.0f, "repeat_penalty");
    CTRL_CASE("repeat_penalty NaN", c.sampling.repeat_penalty = NAN, "repeat_penalty");
    CTRL_CASE("frequency_penalty", c.sampling.frequency_penalty = 1000.0f, "frequency_penalty");
    CTRL_CASE("presence_penalty", c.sampling.presence_penalty = -INFINITY, "presence_penalty");
    CTRL_CASE("repeat_last_n -2", c.sampling.repeat_last_n = -2, "repeat_last_n");
    CTRL_CASE("repeat_last_n > n_ctx", c.sampling.repeat_last_n = 129, "repeat_last_n");
    /* FREE and CANCEL carry nothing but their seq. */
    c = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_FREE, .seq = 1};
    len = batch_with(&seg, 1, &c, 1);
    buf[40 + 20] = 1;
    expect_reject(len, &lim, "free with params", "FREE seq 1) has nonzero unused fields");
    c = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_CANCEL, .seq = 1, .flags = 1};
    len = batch_with(&seg, 1, &c, 1);
    expect_reject(len, &lim, "cancel with flags", "CANCEL seq 1) has nonzero unused fields");
    /* The boundaries themselves are accepted. */
    c = open;
    c.sampling = (struct kvr_sample_params){.temperature = 0.0f,
                                            .top_k = 0,
                                            .top_p = 1.0f,
                                            .min_p = 0.0f,
                                            .repeat_penalty = 100.0f,
                                            .frequency_penalty = -100.0f,
                                            .presence_penalty = 100.0f,
                                            .repeat_last_n = -1,
                                            .seed = 0};
    len = batch_with(&seg, 1, &c, 1);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    assert_int_equal(decode(len, &lim, &f, &err), 0);
    kvr_wire_frame_fini(&f);
#undef CTRL_CASE
}

/* REPLAY restores a re-opened sequence's sampler at the tail (DESIGN.md 8): it round-trips
 * exactly, and every field is bounded. */
static void test_replay_records(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, 0);
    struct kvr_seg seg = {0, 0, 1, KVR_SEG_PREFILL};
    const struct kvr_wire_ctrl replay[2] = {
        {.type = KVR_WIRE_CTRL_REPLAY,
         .seq = 2,
         .replay = {.n_draws = 9, .n_ids = 8, .ids = {1, 2, 3, 4, 5, 6, 7, N_VOCAB - 1}}},
        {.type = KVR_WIRE_CTRL_REPLAY, .seq = 2, .replay = {.n_draws = 0, .n_ids = 1, .ids = {42}}},
    };
    struct kvr_wire_ctrl both[3] = {ctrl3[0], replay[0], replay[1]};
    both[0].seq = 2;
    size_t len = batch_with(&seg, 1, both, 3);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    assert_int_equal(decode(len, &lim, &f, &err), 0);
    assert_int_equal(f.hdr.n_ctrl, 3);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(f.ctrl[i].type, KVR_WIRE_CTRL_REPLAY);
        assert_int_equal(f.ctrl[i].seq, 2);
        assert_memory_equal(&f.ctrl[i].replay, &replay[i - 1].replay, sizeof replay[0].replay);
    }
    /* The boundary: as many draws as positions. */
    struct kvr_wire_ctrl c = replay[1];
    c.replay.n_draws = 128;
    len = batch_with(&seg, 1, &c, 1);
    assert_int_equal(decode(len, &lim, &f, &err), 0);
    kvr_wire_frame_fini(&f);

#define REPLAY_CASE(what, mutation, msg)                                                           \
    do {                                                                                           \
        c = replay[1];                                                                             \
        len = batch_with(&seg, 1, &c, 1);                                                          \
        mutation;                                                                                  \
        expect_reject(len, &lim, what, msg);                                                       \
    } while (0)
    /* The record starts right after the 40-byte header. */
    REPLAY_CASE("flags", kvr_st16(buf + 40 + 2, 1), "has flags 0x1");
    REPLAY_CASE("draws > n_ctx", kvr_st32(buf + 40 + 8, 129), "129 draws");
    REPLAY_CASE("n_ids > 8", kvr_st32(buf + 40 + 12, 9), "9 token ids, at most 8");
    REPLAY_CASE("id >= n_vocab", kvr_st32(buf + 40 + 16, N_VOCAB), "outside the vocabulary");
    REPLAY_CASE("negative id", kvr_st32(buf + 40 + 16, (uint32_t)-1), "outside the vocabulary");
    REPLAY_CASE("id past n_ids", kvr_st32(buf + 40 + 20, 5), "past n_ids and not 0");
    REPLAY_CASE("seq range", kvr_st32(buf + 40 + 4, 8), "names seq 8");
#undef REPLAY_CASE
}

/* MAP names the KV blocks of an opening sequence (DESIGN.md 12): it round-trips exactly
 * and every field is bounded by the plan (8 blocks of 16 per sequence, 64 blocks). */
static void test_map_records(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, 0);
    assert_int_equal(lim.max_blocks_per_seq, 8);
    /* 8 cached blocks: more than the first record names (the second maps the last). */
    struct kvr_seg seg = {2, 112, 1, KVR_SEG_PREFILL};
    const struct kvr_wire_ctrl map[2] = {
        {.type = KVR_WIRE_CTRL_MAP,
         .seq = 2,
         .map = {.n_cached = 128, .first = 0, .n_ids = 7, .ids = {63, 1, 2, 3, 4, 5, 6}}},
        {.type = KVR_WIRE_CTRL_MAP,
         .seq = 2,
         .map = {.n_cached = 128, .first = 7, .n_ids = 1, .ids = {9}}},
    };
    struct kvr_wire_ctrl all[3] = {ctrl3[0], map[0], map[1]};
    all[0].seq = 2;
    size_t len = batch_with(&seg, 1, all, 3);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    assert_int_equal(decode(len, &lim, &f, &err), 0);
    assert_int_equal(f.hdr.n_ctrl, 3);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(f.ctrl[i].type, KVR_WIRE_CTRL_MAP);
        assert_int_equal(f.ctrl[i].seq, 2);
        assert_memory_equal(&f.ctrl[i].map, &map[i - 1].map, sizeof map[0].map);
    }
    kvr_wire_frame_fini(&f);
    struct kvr_wire_ctrl c;
#define MAP_CASE(what, mutation, msg)                                                              \
    do {                                                                                           \
        c = map[0];                                                                                \
        len = batch_with(&seg, 1, &c, 1);                                                          \
        mutation;                                                                                  \
        expect_reject(len, &lim, what, msg);                                                       \
    } while (0)
    MAP_CASE("flags", kvr_st16(buf + 40 + 2, 1), "has flags 0x1");
    MAP_CASE("cached not whole", kvr_st32(buf + 40 + 8, 33), "33 cached positions");
    MAP_CASE("cached > context", kvr_st32(buf + 40 + 8, 144), "144 cached positions");
    MAP_CASE("no ids", kvr_st32(buf + 40 + 16, 0), "entries 0 + 0");
    MAP_CASE("n_ids > 7", kvr_st32(buf + 40 + 16, 8), "entries 0 + 8");
    MAP_CASE("past the table", kvr_st32(buf + 40 + 12, 2), "entries 2 + 7");
    MAP_CASE("id >= kv_blocks", kvr_st32(buf + 40 + 20, 64), "beyond kv_blocks");
    MAP_CASE("seq range", kvr_st32(buf + 40 + 4, 8), "names seq 8");
    c = map[1];
    len = batch_with(&seg, 1, &c, 1);
    kvr_st32(buf + 40 + 24, 5);
    expect_reject(len, &lim, "id past n_ids", "past n_ids and not 0");
#undef MAP_CASE
}

/* BIAS carries a sequence's logit_bias to the tail: it round-trips exactly, and every
 * field is bounded. */
static void test_bias_records(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, 0);
    struct kvr_seg seg = {0, 0, 1, KVR_SEG_PREFILL};
    const struct kvr_wire_ctrl bias[2] = {
        {.type = KVR_WIRE_CTRL_BIAS,
         .seq = 2,
         .bias = {.n = 4, .ids = {0, 7, 9, N_VOCAB - 1}, .bias = {100, -100, 0.5f, -2}}},
        {.type = KVR_WIRE_CTRL_BIAS, .seq = 2, .bias = {.n = 1, .ids = {42}, .bias = {3}}},
    };
    struct kvr_wire_ctrl all[3] = {ctrl3[0], bias[0], bias[1]};
    all[0].seq = 2;
    size_t len = batch_with(&seg, 1, all, 3);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    assert_int_equal(decode(len, &lim, &f, &err), 0);
    assert_int_equal(f.hdr.n_ctrl, 3);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(f.ctrl[i].type, KVR_WIRE_CTRL_BIAS);
        assert_int_equal(f.ctrl[i].seq, 2);
        assert_memory_equal(&f.ctrl[i].bias, &bias[i - 1].bias, sizeof bias[0].bias);
    }
    kvr_wire_frame_fini(&f);
    struct kvr_wire_ctrl c;
#define BIAS_CASE(what, mutation, msg)                                                             \
    do {                                                                                           \
        c = bias[1];                                                                               \
        len = batch_with(&seg, 1, &c, 1);                                                          \
        mutation;                                                                                  \
        expect_reject(len, &lim, what, msg);                                                       \
    } while (0)
    BIAS_CASE("flags", kvr_st16(buf + 40 + 2, 1), "flags 0x1");
    BIAS_CASE("no pairs", kvr_st32(buf + 40 + 8, 0), "0 pairs");
    BIAS_CASE("5 pairs", kvr_st32(buf + 40 + 8, 5), "5 pairs");
    BIAS_CASE("id >= n_vocab", kvr_st32(buf + 40 + 12, N_VOCAB), "out of range");
    BIAS_CASE("negative id", kvr_st32(buf + 40 + 12, (uint32_t)-1), "out of range");
    BIAS_CASE("bias > 100", kvr_stf32(buf + 40 + 28, 101.0f), "out of range");
    BIAS_CASE("bias NaN", kvr_stf32(buf + 40 + 28, NAN), "out of range");
    BIAS_CASE("id past n", kvr_st32(buf + 40 + 16, 5), "past n and not 0");
    BIAS_CASE("bias past n", kvr_stf32(buf + 40 + 32, 1.0f), "past n and not 0");
    BIAS_CASE("reserved", kvr_st32(buf + 40 + 44, 1), "pairs");
#undef BIAS_CASE
}

/* GRAMMAR carries a sequence's grammar text in 32-byte pieces: they round-trip exactly,
 * and offsets, totals and the bytes past the text are checked. */
static void test_grammar_records(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, 0);
    struct kvr_seg seg = {0, 0, 1, KVR_SEG_PREFILL};
    const char *text = "root ::= \"{\" [a-z]+ \"}\" # forty bytes of grammar";
    uint32_t total = (uint32_t)strlen(text);
    struct kvr_wire_ctrl all[3] = {ctrl3[0]};
    all[0].seq = 1;
    for (uint32_t k = 0; k < 2; k++) {
        all[1 + k] = (struct kvr_wire_ctrl){.type = KVR_WIRE_CTRL_GRAMMAR, .seq = 1};
        all[1 + k].grammar.offset = 32 * k;
        all[1 + k].grammar.total = total;
        uint32_t n = total - 32 * k < 32 ? total - 32 * k : 32;
        memcpy(all[1 + k].grammar.text, text + 32 * k, n);
    }
    size_t len = batch_with(&seg, 1, all, 3);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    assert_int_equal(decode(len, &lim, &f, &err), 0);
    assert_int_equal(f.hdr.n_ctrl, 3);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(f.ctrl[i].type, KVR_WIRE_CTRL_GRAMMAR);
        assert_memory_equal(&f.ctrl[i].grammar, &all[i].grammar, sizeof all[i].grammar);
    }
    kvr_wire_frame_fini(&f);
    struct kvr_wire_ctrl c;
#define GRAMMAR_CASE(what, mutation, msg)                                                          \
    do {                                                                                           \
        c = all[2];                                                                                \
        len = batch_with(&seg, 1, &c, 1);                                                          \
        mutation;                                                                                  \
        expect_reject(len, &lim, what, msg);                                                       \
    } while (0)
    GRAMMAR_CASE("flags", kvr_st16(buf + 40 + 2, 1), "flags 0x1");
    GRAMMAR_CASE("offset past total", kvr_st32(buf + 40 + 8, 64), "offset 64 of");
    GRAMMAR_CASE("unaligned offset", kvr_st32(buf + 40 + 8, 3), "offset 3 of");
    GRAMMAR_CASE("empty", kvr_st32(buf + 40 + 12, 0), "of 0 bytes");
    GRAMMAR_CASE("too long", kvr_st32(buf + 40 + 12, KVR_WIRE_GRAMMAR_MAX_TOTAL + 1), "offset");
    GRAMMAR_CASE("byte past the text", buf[40 + 16 + 31] = 'x', "past the text are not 0");
#undef GRAMMAR_CASE
}

static void test_result_and_timing_rejections(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, KVR_WIRE_RECV_BRIDGE);
    struct kvr_wire_result r[3];
    size_t len;

#define RESULT_CASE(what, mutation, msg)                                                           \
    do {                                                                                           \
        memcpy(r, results3, sizeof r);                                                             \
        mutation;                                                                                  \
        len = encode_result(r, 3);                                                                 \
        expect_reject(len, &lim, what, msg);                                                       \
    } while (0)

    RESULT_CASE("wrong seq", r[1].seq = 6, "result 1 is for seq 6; segment 2");
    RESULT_CASE("token range", r[0].token = N_VOCAB, "token id 100 outside");
    RESULT_CASE("negative token", r[2].token = -5, "token id -5 outside");
    RESULT_CASE("unknown flags", r[0].flags = 4 | KVR_WIRE_RESULT_LOGPROB, "unknown flags 0x5");
    RESULT_CASE("positive logprob", r[0].logprob = 0.5f, "logprob 0.5");
    RESULT_CASE("NaN logprob", r[0].logprob = NAN, "logprob nan");
    RESULT_CASE("logprob without flag", r[1].logprob = -1.0f, "logprob -1");
#undef RESULT_CASE
    /* Fewer results than segments that want a token (header patched consistently). */
    len = encode_result(results3, 2);
    expect_reject(len, &lim, "missing result", "2 results for 3 segments that want a token");

    /* Timing records: record i from stage i, reserved field zero. */
    len = encode_result(results3, 3);
    size_t tim = len - 3 * KVR_WIRE_TIMING_BYTES;
    kvr_st32(buf + tim + 32, 2); /* record 1 claims stage 2 */
    expect_reject(len, &lim, "timing order", "timing record 1 claims stage 2");
    len = encode_result(results3, 3);
    kvr_st32(buf + tim + 4, 1);
    expect_reject(len, &lim, "timing reserved", "timing record 0");
}

/* Every truncation of a valid frame is refused (the header needs 40 bytes; the body must
 * be exactly as long as the header says), and so is one extra byte. */
static void test_truncation(void **state)
{
    (void)state;
    size_t len = valid_batch();
    struct kvr_wire_limits lim;
    limits(&lim, 1);
    struct kvr_wire_frame f;
    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    for (size_t n = 0; n < len; n++) {
        err.msg[0] = 0;
        int rc = decode(n, &lim, &f, &err);
        if (rc != KVR_EPROTO)
            fail_msg("a frame cut to %zu of %zu bytes gave %d", n, len, rc);
        if (n >= KVR_WIRE_HEADER_BYTES)
            assert_non_null(strstr(err.msg, "its header says"));
    }
    assert_int_equal(decode(len + 1, &lim, &f, &err), KVR_EPROTO);
    assert_int_equal(decode(len, &lim, &f, &err), 0);
    kvr_wire_frame_fini(&f);
}

/* ---- Limits and encoder checks --------------------------------------------------------- */

static void test_limits(void **state)
{
    (void)state;
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, 0);
    assert_int_equal(lim.batch_payload, KVR_WIRE_PAYLOAD_TOKENS);
    assert_int_equal(lim.min_timings, 0);
    assert_int_equal(lim.max_timings, 0);
    assert_int_equal(lim.max_ctrl, 40); /* 8 seqs x (3 + 2 MAP records of 7 of 8 blocks) */
    assert_int_equal(lim.max_frame_bytes, 40 + 40 * 48 + 16 * 16 + 16 * 4);
    limits(&lim, 2);
    assert_int_equal(lim.batch_payload, KVR_WIRE_PAYLOAD_F32);
    assert_int_equal(lim.min_timings, 2);
    assert_int_equal(lim.max_frame_bytes, 40 + 40 * 48 + 16 * 16 + 16 * 8 * 4 + 2 * 32);
    limits(&lim, KVR_WIRE_RECV_BRIDGE);
    assert_int_equal(lim.accept_types, 1u << KVR_WIRE_RESULT | 1u << KVR_WIRE_HEARTBEAT |
                                           1u << KVR_WIRE_GOODBYE | 1u << KVR_WIRE_RESET);
    assert_int_equal(lim.min_timings, 3);
    /* Resets come from upstream stages: stage 0 (fed by the bridge) never gets one. */
    struct kvr_wire_limits head;
    limits(&head, 0);
    assert_false(head.accept_types & 1u << KVR_WIRE_RESET);
    /* Scratch always holds the records of the largest frame. */
    assert_true(kvr_wire_scratch_bytes(&lim) >= 40 + 40 * 48 + 16 * 32 + 4 * 32);

    struct kvr_err err = {0};
    assert_int_equal(kvr_wire_limits_init(&lim, &plan, N_EMBD, 0, 3, &err), KVR_EINVAL);
    assert_int_equal(kvr_wire_limits_init(&lim, &plan, N_EMBD, 0, -3, &err), KVR_EINVAL);
    assert_int_equal(kvr_wire_limits_init(&lim, &plan, 0, 0, 1, &err), KVR_EINVAL);
    /* The widest plan with a large model exceeds the 1 GiB frame bound: refused up front. */
    plan.row_width = KVR_PLAN_MAX_ROW_WIDTH;
    assert_int_equal(kvr_wire_limits_init(&lim, &plan, 16384, 0, 1, &err), KVR_ERANGE);
    assert_non_null(strstr(err.msg, "row_width 16384 x n_embd 16384"));
    /* Half the bytes per value: the same plan fits in f16, and twice the width does not. */
    plan.wire_dtype = KVR_DTYPE_F16;
    assert_int_equal(kvr_wire_limits_init(&lim, &plan, 16384, 0, 1, &err), 0);
    assert_int_equal(kvr_wire_limits_init(&lim, &plan, 32768, 0, 1, &err), KVR_ERANGE);
    /* The head receives token ids only: its frames stay small whatever n_embd is. */
    assert_int_equal(kvr_wire_limits_init(&lim, &plan, 32768, 0, 0, &err), 0);
}

static void test_encoder_checks(void **state)
{
    (void)state;
    struct iovec iov[KVR_WIRE_MAX_IOV];
    int n_iov;
    size_t total;
    struct kvr_err err = {0};
    float rows[N_ROWS * N_EMBD] = {0};
    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .segs = segs4,
                             .n_segs = 4,
                             .payload = KVR_WIRE_PAYLOAD_F32,
                             .payload_data = rows,
                             .payload_bytes = sizeof rows};
    assert_int_equal(kvr_wire_encode(&m, scratch, sizeof scratch, iov, &n_iov, &total, &err), 0);
    assert_int_equal(n_iov, 2);
    assert_ptr_equal(iov[1].iov_base, rows); /* the payload is not copied */

    m.payload_bytes = sizeof rows - 4;
    assert_int_equal(kvr_wire_encode(&m, scratch, sizeof scratch, iov, &n_iov, &total, &err),
                     KVR_EINVAL);
    assert_non_null(strstr(err.msg, "whole rows"));
    m.payload_bytes = sizeof rows;
    m.type = 7;
    assert_int_equal(kvr_wire_encode(&m, scratch, sizeof scratch, iov, &n_iov, &total, &err),
                     KVR_EINVAL);
    m.type = KVR_WIRE_BATCH;
    m.payload = KVR_WIRE_PAYLOAD_RESULTS;
    assert_int_equal(kvr_wire_encode(&m, scratch, sizeof scratch, iov, &n_iov, &total, &err),
                     KVR_EINVAL);
    m.payload = KVR_WIRE_PAYLOAD_F32;
    m.n_results = 1;
    m.results = results3;
    assert_int_equal(kvr_wire_encode(&m, scratch, sizeof scratch, iov, &n_iov, &total, &err),
                     KVR_EINVAL);
    m.n_results = 0;
    assert_int_equal(kvr_wire_encode(&m, scratch, 100, iov, &n_iov, &total, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "scratch"));
    struct kvr_wire_msg hb = {.type = KVR_WIRE_HEARTBEAT, .n_segs = 1, .segs = segs4};
    assert_int_equal(kvr_wire_encode(&hb, scratch, sizeof scratch, iov, &n_iov, &total, &err),
                     KVR_EINVAL);
    struct kvr_wire_msg res = {.type = KVR_WIRE_RESULT, .payload = KVR_WIRE_PAYLOAD_F32};
    assert_int_equal(kvr_wire_encode(&res, scratch, sizeof scratch, iov, &n_iov, &total, &err),
                     KVR_EINVAL);
    /* Appending past the capacity of a frame's timing array is refused. */
    make_plan(KVR_DTYPE_F32);
    struct kvr_wire_limits lim;
    limits(&lim, 1);
    struct kvr_wire_frame f;
    assert_int_equal(kvr_wire_frame_init(&f, &lim, &err), 0);
    struct kvr_wire_timing t = {0};
    for (uint32_t i = 0; i < f.cap_timings; i++)
        assert_int_equal(kvr_wire_frame_append_timing(&f, &t, &err), 0);
    assert_int_equal(kvr_wire_frame_append_timing(&f, &t, &err), KVR_EFULL);
    kvr_wire_frame_fini(&f);
}

static void test_row_conversion(void **state)
{
    (void)state;
    const float vals[] = {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 1.0f / 1024, INFINITY};
    const size_t n = sizeof vals / sizeof vals[0];
    uint8_t half[2 * 7 + 1], back_buf[4 * 7 + 1];
    float back[7];
    uint32_t payloads[] = {KVR_WIRE_PAYLOAD_F16, KVR_WIRE_PAYLOAD_BF16, KVR_WIRE_PAYLOAD_F32};
    for (size_t p = 0; p < 3; p++) {
        /* Unaligned destinations and sources are fine. */
        kvr_wire_rows_from_f32(payloads[p], vals, n, back_buf + 1);
        kvr_wire_rows_to_f32(payloads[p], back_buf + 1, n, back);
        for (size_t i = 0; i < n; i++) {
            if (payloads[p] == KVR_WIRE_PAYLOAD_BF16 && vals[i] == 65504.0f)
                continue; /* not exact in bf16 (8-bit mantissa) */
            assert_memory_equal(&back[i], &vals[i], sizeof(float));
        }
    }
    /* f16 rounds to nearest even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10. */
    float x = 1.0f + 1.0f / 2048;
    kvr_wire_rows_from_f32(KVR_WIRE_PAYLOAD_F16, &x, 1, half);
    kvr_wire_rows_to_f32(KVR_WIRE_PAYLOAD_F16, half, 1, back);
    assert_true(back[0] == 1.0f);
}

/* ---- Seed corpus for fuzz_wire ---------------------------------------------------------- */

static int n_written;

static void write_seed(const char *dir, unsigned receiver, unsigned dtype, size_t len)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/seed_%02d", dir, n_written++);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    uint8_t prefix[WIRE_FUZZ_PREFIX] = {(uint8_t)receiver, (uint8_t)dtype};
    fwrite(prefix, 1, sizeof prefix, fp);
    fwrite(buf, 1, len, fp);
    fclose(fp);
}

static void test_write_corpus(void **state)
{
    (void)state;
    const char *dir = getenv("KVR_WRITE_CORPUS");
    if (!dir)
        return; /* only when asked: the corpus is committed under tests/fuzz/corpus/ */
    static struct kvr_plan fp;
    /* Frames valid for the fuzz plan: 3 stages, 8 rows, 4 seqs, n_ctx 64, n_embd 4. */
    const struct kvr_seg segs[3] = {
        {.seq = 0, .pos0 = 0, .n_tokens = 4, .flags = KVR_SEG_PREFILL},
        {.seq = 2,
         .pos0 = 60,
         .n_tokens = 3,
         .flags = KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN},
        {.seq = 3, .pos0 = 63, .n_tokens = 1, .flags = KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN},
    };
    struct kvr_wire_ctrl ctrl[3] = {ctrl3[0], ctrl3[1], ctrl3[2]};
    ctrl[0].seq = 2;
    ctrl[0].sampling.repeat_last_n = 32;
    ctrl[2].seq = 3;
    int32_t tokens[8] = {1, 2, 3, 4, 5, 6, 7, 31};
    float rows[8 * WIRE_FUZZ_N_EMBD];
    uint16_t half[8 * WIRE_FUZZ_N_EMBD];
    for (int i = 0; i < 8 * WIRE_FUZZ_N_EMBD; i++)
        rows[i] = (float)i * 0.5f - 3.0f;
    const struct kvr_wire_result res[2] = {
        {.seq = 2, .token = 7, .logprob = -1.5f, .flags = KVR_WIRE_RESULT_LOGPROB},
        {.seq = 3, .token = 31, .flags = KVR_WIRE_RESULT_EOG},
    };
    struct kvr_wire_timing tim[3] = {{0, 1, 2, 3, 0}, {1, 4, 5, 6, 0}, {2, 7, 8, 9, 0}};

    struct kvr_wire_msg m = {.type = KVR_WIRE_BATCH,
                             .batch_id = 1,
                             .ctrl = ctrl,
                             .n_ctrl = 3,
                             .segs = segs,
                             .n_segs = 3,
                             .payload = KVR_WIRE_PAYLOAD_TOKENS,
                             .payload_data = tokens,
                             .payload_bytes = sizeof tokens};
    write_seed(dir, 1, 0, encode(&m)); /* to the head */
    write_seed(dir, 0, 0, encode(&m)); /* to "any" */
    for (unsigned d = 0; d < 3; d++) {
        wire_fuzz_plan(&fp, d);
        uint32_t payload = kvr_wire_payload_of_dtype(fp.wire_dtype);
        kvr_wire_rows_from_f32(payload, rows, 8 * WIRE_FUZZ_N_EMBD, half);
        m.payload = payload;
        m.payload_data = payload == KVR_WIRE_PAYLOAD_F32 ? (const void *)rows : half;
        m.payload_bytes = 8 * WIRE_FUZZ_N_EMBD * kvr_wire_payload_elem_bytes(payload);
        for (unsigned s = 1; s < 3; s++) {
            m.timings = tim;
            m.n_timings = s;
            write_seed(dir, 1 + s, d, encode(&m));
        }
    }
    struct kvr_wire_msg r = {.type = KVR_WIRE_RESULT,
                             .batch_id = 2,
                             .ctrl = ctrl,
                             .n_ctrl = 3,
                             .segs = segs,
                             .n_segs = 3,
                             .payload = KVR_WIRE_PAYLOAD_RESULTS,
                             .results = res,
                             .n_results = 2,
                             .timings = tim,
                             .n_timings = 3};
    write_seed(dir, 4, 0, encode(&r));
    struct kvr_wire_msg ctl_only = {.type = KVR_WIRE_BATCH,
                                    .ctrl = ctrl + 1,
                                    .n_ctrl = 2,
                                    .payload = KVR_WIRE_PAYLOAD_F16,
                                    .timings = tim,
                                    .n_timings = 2};
    write_seed(dir, 3, 1, encode(&ctl_only));
    struct kvr_wire_msg hb = {.type = KVR_WIRE_HEARTBEAT, .batch_id = 77};
    write_seed(dir, 2, 0, encode(&hb));
    struct kvr_wire_msg bye = {.type = KVR_WIRE_GOODBYE, .arg = KVR_WIRE_GOODBYE_ERROR};
    write_seed(dir, 4, 0, encode(&bye));
    struct kvr_wire_msg reset = {.type = KVR_WIRE_RESET, .arg = 1, .batch_id = KVR_WIRE_RESET_LINK};
    write_seed(dir, 4, 0, encode(&reset)); /* stage 1's upstream changed, told the bridge */
    struct kvr_wire_ctrl replay[2] = {ctrl[0],
                                      {.type = KVR_WIRE_CTRL_REPLAY,
                                       .seq = 2,
                                       .replay = {.n_draws = 5, .n_ids = 3, .ids = {4, 31, 0}}}};
    struct kvr_wire_msg reopen = {.type = KVR_WIRE_BATCH,
                                  .batch_id = 9,
                                  .ctrl = replay,
                                  .n_ctrl = 2,
                                  .segs = segs + 1,
                                  .n_segs = 1,
                                  .payload = KVR_WIRE_PAYLOAD_TOKENS,
                                  .payload_data = tokens,
                                  .payload_bytes = 3 * sizeof(int32_t)};
    write_seed(dir, 1, 0, encode(&reopen)); /* a re-opened sequence, to the head */
    print_message("wrote %d seeds to %s\n", n_written, dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32c),
        cmocka_unit_test(test_round_trip_tokens),
        cmocka_unit_test(test_round_trip_rows),
        cmocka_unit_test(test_round_trip_result),
        cmocka_unit_test(test_round_trip_control_frames),
        cmocka_unit_test(test_control_only_batch),
        cmocka_unit_test(test_forward_around_the_ring),
        cmocka_unit_test(test_header_rejections),
        cmocka_unit_test(test_segment_rejections),
        cmocka_unit_test(test_ctrl_rejections),
        cmocka_unit_test(test_replay_records),
        cmocka_unit_test(test_bias_records),
        cmocka_unit_test(test_grammar_records),
        cmocka_unit_test(test_map_records),
        cmocka_unit_test(test_result_and_timing_rejections),
        cmocka_unit_test(test_truncation),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_encoder_checks),
        cmocka_unit_test(test_row_conversion),
        cmocka_unit_test(test_write_corpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
