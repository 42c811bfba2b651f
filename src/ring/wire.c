/* wire.c - encode and decode ring frames (see wire.h for the API, docs/PROTOCOL.md for the
 * whole protocol).
 *
 * Frame = header (40 bytes) + body. All integers little-endian.
 *
 * Header
 *   off size field          notes
 *     0   4  magic          "KVFR" (0x4b 0x56 0x46 0x52)
 *     4   1  type           enum kvr_wire_type: 1 BATCH, 2 RESULT, 3 HEARTBEAT, 4 GOODBYE,
 *                           5 RESET, 6 REPLAN, 7 EXPERT, 8 EXPERT_RESULT
 *     5   1  payload        enum kvr_wire_payload: 0 none, 1 tokens, 2 f32, 3 f16, 4 bf16,
 *                           5 results, 6 expert (EXPERT, EXPERT_RESULT: ring/experts.h)
 *     6   2  arg            GOODBYE: reason; RESET: the stage that dropped its sequences
 *                           (upstream of the receiver); REPLAN: the new epoch; otherwise 0
 *     8   8  batch_id       HEARTBEAT: the sender's heartbeat counter; RESET: the batch the
 *                           stage could not run, or all ones (its upstream link changed);
 *                           REPLAN: bit i set = stage i of the current plan is kept
 *    16   4  n_rows         sum of the segments' n_tokens
 *    20   2  n_segs
 *    22   2  n_ctrl
 *    24   2  n_timings
 *    26   2  n_results      RESULT only
 *    28   4  payload_bytes  exactly n_rows*4 (tokens), n_rows*n_embd*2|4 (rows),
 *                           n_results*16 + n_top*8 (results and their alternatives,
 *                           n_top <= n_results*20), 0 (none)
 *    32   4  body_bytes     n_ctrl*48 + n_segs*16 + payload_bytes + n_timings*32
 *    36   4  crc            CRC-32C of bytes 0..35
 *
 * Body sections, in this order (each section's offset is a multiple of 16 up to the
 * payload, so a 16-byte aligned body buffer gives an aligned payload):
 *
 * Control record (48 bytes): wire_ctrl.c has its byte table.
 *
 * Segment record (16 bytes): struct kvr_seg
 *     0   4  seq   4   4  pos0   8   4  n_tokens   12   4  flags (enum kvr_seg_flag)
 *   flags: PREFILL (+ LAST_CHUNK (+ WANTS_TOKEN)), or DECODE + WANTS_TOKEN with one token,
 *   or DECODE + WANTS_TOKEN + DRAFTS with 2..1 + KVR_SPEC_MAX_DRAFT tokens.
 *
 * Payload: tokens (int32 each), rows (n_rows x n_embd values, row after row, segment after
 * segment), or result records followed by their alternatives.
 *
 * Result record (16 bytes), one per WANTS_TOKEN segment in order (1..n_tokens consecutive
 * ones for a DRAFTS segment)
 *     0   4  seq   4   4  token (i32)   8   4  logprob (f32)
 *    12   4  flags: bit 0 LOGPROB, bit 1 EOG, bits 8..12 n_top (alternatives, 0..20, only
 *              with LOGPROB)
 * Alternative (8 bytes), after all the result records: every result's n_top in the
 * results' order, each most likely first (model/logprobs.h)
 *     0   4  id (i32, < n_vocab)   4   4  logprob (f32, <= 0)
 *
 * Timing record (32 bytes)
 *     0   4  stage   4   4  reserved (0)   8   8  held_ns   16   8  starved_ns
 *    24   8  blocked_ns
 */
#include "ring/wire.h"
#include "ring/wire_int.h"

#include "core/alloc.h"
#include "model/dtype.h"
#include "model/spec_accept.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>

/* Payload rows and tokens are sent and used in host byte order (wire.h). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring wire format is little-endian; big-endian hosts are not supported"
#endif

/* ---- Names and sizes ------------------------------------------------------------------- */

const char *kvr_wire_type_name(uint32_t type)
{
    static const char *const names[KVR_WIRE_TYPE_COUNT] = {NULL,        "BATCH",   "RESULT",
                                                           "HEARTBEAT", "GOODBYE", "RESET",
                                                           "REPLAN",    "EXPERT",  "EXPERT_RESULT"};
    return type > 0 && type < KVR_WIRE_TYPE_COUNT ? names[type] : "unknown";
}

const char *kvr_wire_payload_name(uint32_t payload)
{
    static const char *const names[KVR_WIRE_PAYLOAD_COUNT] = {"none", "tokens",  "f32",   "f16",
                                                              "bf16", "results", "expert"};
    return payload < KVR_WIRE_PAYLOAD_COUNT ? names[payload] : "unknown";
}

/* The boundary-row payloads and the dtype each carries (its element size is the dtype
 * traits'); -1 for the payloads that are not rows. */
static const int row_dtype[KVR_WIRE_PAYLOAD_COUNT] = {
    [KVR_WIRE_PAYLOAD_NONE] = -1,
    [KVR_WIRE_PAYLOAD_TOKENS] = -1,
    [KVR_WIRE_PAYLOAD_F32] = KVR_DTYPE_F32,
    [KVR_WIRE_PAYLOAD_F16] = KVR_DTYPE_F16,
    [KVR_WIRE_PAYLOAD_BF16] = KVR_DTYPE_BF16,
    [KVR_WIRE_PAYLOAD_RESULTS] = -1,
    [KVR_WIRE_PAYLOAD_EXPERT] = -1,
};

static bool is_rows(uint32_t payload)
{
    return payload < KVR_WIRE_PAYLOAD_COUNT && row_dtype[payload] >= 0;
}

size_t kvr_wire_payload_elem_bytes(uint32_t payload)
{
    if (is_rows(payload))
        return kvr_dtype_traits(row_dtype[payload])->block_bytes; /* one element a block */
    if (payload == KVR_WIRE_PAYLOAD_TOKENS)
        return sizeof(int32_t);
    return payload == KVR_WIRE_PAYLOAD_RESULTS ? KVR_WIRE_RESULT_BYTES : 0;
}

uint32_t kvr_wire_payload_of_dtype(enum kvr_dtype dtype)
{
    for (uint32_t p = 0; p < KVR_WIRE_PAYLOAD_COUNT; p++)
        if (row_dtype[p] == (int)dtype)
            return p;
    return KVR_WIRE_PAYLOAD_COUNT;
}

/* Bitwise CRC-32C (reflected polynomial 0x82F63B78). The header is 36 bytes, so a table
 * would buy nothing measurable and cost a global. */
uint32_t kvr_crc32c(const void *data, size_t n)
{
    const uint8_t *p = data;
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82f63b78u & (0u - (c & 1u)));
    }
    return ~c;
}

/* ---- Limits ---------------------------------------------------------------------------- */

int kvr_wire_limits_init(struct kvr_wire_limits *lim, const struct kvr_plan *plan, uint32_t n_embd,
                         uint32_t n_vocab, int receiver, struct kvr_err *err)
{
    memset(lim, 0, sizeof *lim);
    if (receiver < KVR_WIRE_RECV_ANY || (receiver >= 0 && (uint32_t)receiver >= plan->n_stages))
        return kvr_err_set(err, KVR_EINVAL, "wire: receiver %d is not a stage of the plan",
                           receiver);
    if (n_embd == 0)
        return kvr_err_set(err, KVR_EINVAL, "wire: n_embd is 0");
    uint32_t rows = kvr_wire_payload_of_dtype(plan->wire_dtype);
    if (rows == KVR_WIRE_PAYLOAD_COUNT)
        return kvr_err_set(err, KVR_EINVAL, "wire: the plan's wire dtype is not f32/f16/bf16");
    lim->max_rows = plan->row_width;
    lim->max_segs = plan->row_width < KVR_WIRE_MAX_COUNT ? plan->row_width : KVR_WIRE_MAX_COUNT;
    lim->kv_blocks = plan->kv_blocks;
    lim->kv_block_tokens = plan->kv_block_tokens;
    lim->max_blocks_per_seq = (plan->n_ctx + plan->kv_block_tokens - 1) / plan->kv_block_tokens;
    uint64_t map_records = (lim->max_blocks_per_seq + KVR_WIRE_MAP_IDS - 1) / KVR_WIRE_MAP_IDS;
    uint64_t ctrl = (3ull + map_records) * plan->max_seqs;
    lim->max_ctrl = ctrl < KVR_WIRE_MAX_COUNT ? (uint32_t)ctrl : KVR_WIRE_MAX_COUNT;
    lim->max_seqs = plan->max_seqs;
    lim->n_ctx = plan->n_ctx;
    lim->n_embd = n_embd;
    lim->n_vocab = n_vocab;
    lim->rows_payload = rows;
    /* Every receiver but stage 0 (whose upstream is the bridge) may be told of a reset;
     * every stage may be sent a new plan (on a control link: stage.c refuses it on others). */
    const uint32_t ctl = 1u << KVR_WIRE_HEARTBEAT | 1u << KVR_WIRE_GOODBYE |
                         (receiver == 0 ? 0 : 1u << KVR_WIRE_RESET) |
                         (receiver >= 0 ? 1u << KVR_WIRE_REPLAN : 0);

    /* Largest payload this receiver can be sent. */
    uint64_t row_bytes = (uint64_t)plan->row_width * n_embd * kvr_wire_payload_elem_bytes(rows);
    uint64_t token_bytes = (uint64_t)plan->row_width * 4;
    uint64_t result_bytes = (uint64_t)lim->max_segs *
                            (KVR_WIRE_RESULT_BYTES + KVR_LOGPROBS_MAX_TOP * KVR_WIRE_TOP_BYTES);
    uint64_t payload;
    if (receiver == KVR_WIRE_RECV_BRIDGE) {
        lim->accept_types = ctl | 1u << KVR_WIRE_RESULT;
        lim->batch_payload = KVR_WIRE_PAYLOAD_COUNT;
        lim->min_timings = lim->max_timings = plan->n_stages;
        payload = result_bytes;
    } else if (receiver == KVR_WIRE_RECV_ANY) {
        lim->accept_types = ctl | 1u << KVR_WIRE_BATCH | 1u << KVR_WIRE_RESULT;
        lim->batch_payload = KVR_WIRE_PAYLOAD_COUNT;
        lim->min_timings = 0;
        lim->max_timings = plan->n_stages;
        payload = row_bytes > token_bytes ? row_bytes : token_bytes;
        payload = payload > result_bytes ? payload : result_bytes;
    } else {
        lim->accept_types = ctl | 1u << KVR_WIRE_BATCH;
        lim->batch_payload = receiver == 0 ? KVR_WIRE_PAYLOAD_TOKENS : rows;
        lim->min_timings = lim->max_timings = (uint32_t)receiver;
        payload = receiver == 0 ? token_bytes : row_bytes;
    }
    lim->n_agents = plan->n_agents;
    lim->max_agent_timings = plan->n_agents * (receiver >= 0 ? (uint32_t)receiver : plan->n_stages);
    uint64_t total = KVR_WIRE_HEADER_BYTES + (uint64_t)lim->max_ctrl * KVR_WIRE_CTRL_BYTES +
                     (uint64_t)lim->max_segs * KVR_WIRE_SEG_BYTES + payload +
                     ((uint64_t)lim->max_timings + lim->max_agent_timings) * KVR_WIRE_TIMING_BYTES;
    if (total > KVR_WIRE_MAX_FRAME_BYTES)
        return kvr_err_set(err, KVR_ERANGE,
                           "wire: the plan's largest frame is %" PRIu64 " bytes (row_width %u "
                           "x n_embd %u in %s, max_seqs %u), beyond the %u-byte frame bound: "
                           "lower row_width or use a 16-bit wire dtype",
                           total, plan->row_width, n_embd, kvr_wire_payload_name(rows),
                           plan->max_seqs, KVR_WIRE_MAX_FRAME_BYTES);
    lim->max_frame_bytes = (uint32_t)total;
    return KVR_OK;
}

size_t kvr_wire_scratch_bytes(const struct kvr_wire_limits *lim)
{
    return KVR_WIRE_HEADER_BYTES + (size_t)lim->max_ctrl * KVR_WIRE_CTRL_BYTES +
           (size_t)lim->max_segs * (KVR_WIRE_SEG_BYTES + KVR_WIRE_RESULT_BYTES +
                                    KVR_LOGPROBS_MAX_TOP * KVR_WIRE_TOP_BYTES) +
           ((size_t)lim->max_timings + 1 + lim->max_agent_timings + lim->n_agents) *
               KVR_WIRE_TIMING_BYTES;
}

/* ---- Frames ---------------------------------------------------------------------------- */

int kvr_wire_frame_init(struct kvr_wire_frame *f, const struct kvr_wire_limits *lim,
                        struct kvr_err *err)
{
    memset(f, 0, sizeof *f);
    f->cap_ctrl = lim->max_ctrl;
    f->cap_segs = lim->max_segs;
    f->cap_timings = lim->max_timings + 1;
    f->cap_seqs = lim->max_seqs;
    /* +1 everywhere: calloc(0) may return NULL, and an empty array is legal. */
    f->ctrl = kvr_calloc((size_t)f->cap_ctrl + 1, sizeof *f->ctrl);
    f->segs = kvr_calloc((size_t)f->cap_segs + 1, sizeof *f->segs);
    f->results = kvr_calloc((size_t)f->cap_segs + 1, sizeof *f->results);
    f->timings = kvr_calloc((size_t)f->cap_timings, sizeof *f->timings);
    f->cap_agent_timings = lim->max_agent_timings;
    f->agent_timings = kvr_calloc((size_t)f->cap_agent_timings + 1, sizeof *f->agent_timings);
    f->seq_seen = kvr_calloc((size_t)f->cap_seqs / 64 + 1, sizeof *f->seq_seen);
    if (!f->ctrl || !f->segs || !f->results || !f->timings || !f->agent_timings || !f->seq_seen) {
        kvr_wire_frame_fini(f);
        return kvr_err_set(err, KVR_ENOMEM, "wire: out of memory for frame records");
    }
    return KVR_OK;
}

void kvr_wire_frame_fini(struct kvr_wire_frame *f)
{
    kvr_free(f->ctrl);
    kvr_free(f->segs);
    kvr_free(f->results);
    kvr_free(f->timings);
    kvr_free(f->agent_timings);
    kvr_free(f->seq_seen);
    memset(f, 0, sizeof *f);
}

int kvr_wire_frame_append_timing(struct kvr_wire_frame *f, const struct kvr_wire_timing *t,
                                 struct kvr_err *err)
{
    if (f->hdr.n_timings >= f->cap_timings)
        return kvr_err_set(err, KVR_EFULL, "wire: frame already holds %u timing records",
                           f->hdr.n_timings);
    f->timings[f->hdr.n_timings++] = *t;
    return KVR_OK;
}

void kvr_wire_msg_forward(struct kvr_wire_msg *msg, const struct kvr_wire_frame *f)
{
    memset(msg, 0, sizeof *msg);
    msg->type = f->hdr.type;
    msg->batch_id = f->hdr.batch_id;
    msg->ctrl = f->ctrl;
    msg->n_ctrl = f->hdr.n_ctrl;
    msg->segs = f->segs;
    msg->n_segs = f->hdr.n_segs;
    msg->timings = f->timings;
    msg->n_timings = f->hdr.n_timings;
    msg->agent_timings = f->agent_timings;
    msg->n_agent_timings = f->n_agent_timings;
}

/* ---- Header ---------------------------------------------------------------------------- */

#define PROTO(...) kvr_err_set(err, KVR_EPROTO, __VA_ARGS__)

/* Expected payload length from the header's counts alone, in 64 bits with checked
 * products (n_rows and n_embd are each below 2^32; their product times 4 may not be). */
static bool expected_payload(const struct kvr_wire_header *h, const struct kvr_wire_limits *lim,
                             uint64_t *out)
{
    uint64_t n;
    switch (h->payload) {
    case KVR_WIRE_PAYLOAD_NONE:
        *out = 0;
        return true;
    case KVR_WIRE_PAYLOAD_TOKENS:
        *out = (uint64_t)h->n_rows * 4;
        return true;
    case KVR_WIRE_PAYLOAD_RESULTS: /* the records, then 0..20 alternatives per record */
        n = (uint64_t)h->n_results * KVR_WIRE_RESULT_BYTES;
        *out = h->payload_bytes >= n && (h->payload_bytes - n) % KVR_WIRE_TOP_BYTES == 0 &&
                       (h->payload_bytes - n) / KVR_WIRE_TOP_BYTES <=
                           (uint64_t)h->n_results * KVR_LOGPROBS_MAX_TOP
                   ? h->payload_bytes
                   : n;
        return true;
    case KVR_WIRE_PAYLOAD_EXPERT: /* its own layout: bounded by the frame size below */
        *out = h->payload_bytes;
        return true;
    default:
        return kvr_mul_u64(h->n_rows, lim->n_embd, &n) &&
               kvr_mul_u64(n, kvr_wire_payload_elem_bytes(h->payload), out);
    }
}

/* The header's fields, after its magic and checksum. */
static int read_header(const uint8_t *b, struct kvr_wire_header *h, struct kvr_err *err)
{
    uint32_t magic = kvr_ld32(b);
    if (magic != KVR_WIRE_FRAME_MAGIC)
        return PROTO("bad frame magic 0x%08x (expected \"KVFR\"): the stream is out of step "
                     "or the peer is not a Kvasir process",
                     magic);
    uint32_t crc = kvr_crc32c(b, 36), got = kvr_ld32(b + 36);
    if (crc != got)
        return PROTO("header checksum 0x%08x does not match its bytes (0x%08x): corrupt "
                     "header",
                     got, crc);
    memset(h, 0, sizeof *h);
    h->type = b[4];
    h->payload = b[5];
    h->arg = kvr_ld16(b + 6);
    h->batch_id = kvr_ld64(b + 8);
    h->n_rows = kvr_ld32(b + 16);
    h->n_segs = kvr_ld16(b + 20);
    h->n_ctrl = kvr_ld16(b + 22);
    h->n_timings = kvr_ld16(b + 24);
    h->n_results = kvr_ld16(b + 26);
    h->payload_bytes = kvr_ld32(b + 28);
    h->body_bytes = kvr_ld32(b + 32);
    return KVR_OK;
}

/* HEARTBEAT, GOODBYE, RESET and REPLAN: no body, only their argument and batch id. */
static int check_bodyless(const struct kvr_wire_header *h, const struct kvr_wire_limits *lim,
                          const char *tn, struct kvr_err *err)
{
    if (h->payload != KVR_WIRE_PAYLOAD_NONE || h->n_rows || h->n_segs || h->n_ctrl ||
        h->n_timings || h->n_results || h->payload_bytes || h->body_bytes)
        return PROTO("a %s frame has no body, but this one declares counts or bytes", tn);
    if (h->type == KVR_WIRE_RESET) {
        /* Stages upstream of this receiver are the ones that append timing records. */
        if (h->arg >= lim->max_timings)
            return PROTO("RESET frame names stage %u, which is not upstream of this "
                         "receiver",
                         h->arg);
        return KVR_OK;
    }
    if (h->type == KVR_WIRE_REPLAN) {
        if (h->arg == 0 || h->batch_id == 0)
            return PROTO("REPLAN frame with epoch %u and stage mask 0x%" PRIx64
                         ": both must be nonzero",
                         h->arg, h->batch_id);
        return KVR_OK;
    }
    if (h->type == KVR_WIRE_HEARTBEAT ? h->arg != 0 : h->arg >= KVR_WIRE_GOODBYE_COUNT)
        return PROTO("%s frame with unknown argument %u", tn, h->arg);
    return KVR_OK;
}

/* BATCH, RESULT, EXPERT and EXPERT_RESULT: the payload each may carry. */
static int check_data_kind(const struct kvr_wire_header *h, const struct kvr_wire_limits *lim,
                           const char *tn, struct kvr_err *err)
{
    switch (h->type) {
    case KVR_WIRE_BATCH:
        if (lim->batch_payload < KVR_WIRE_PAYLOAD_COUNT
                ? h->payload != lim->batch_payload
                : h->payload != KVR_WIRE_PAYLOAD_TOKENS && h->payload != lim->rows_payload)
            return PROTO("BATCH frame carries %s; this link expects %s",
                         kvr_wire_payload_name(h->payload),
                         kvr_wire_payload_name(lim->batch_payload < KVR_WIRE_PAYLOAD_COUNT
                                                   ? lim->batch_payload
                                                   : lim->rows_payload));
        if (h->n_results)
            return PROTO("BATCH frame declares %u result records", h->n_results);
        break;
    case KVR_WIRE_EXPERT:
    case KVR_WIRE_EXPERT_RESULT:
        if (h->payload != KVR_WIRE_PAYLOAD_EXPERT || h->n_rows || h->n_segs || h->n_ctrl ||
            h->n_timings || h->n_results)
            return PROTO("a %s frame carries one expert payload and no records", tn);
        break;
    case KVR_WIRE_RESULT:
        if (h->payload != KVR_WIRE_PAYLOAD_RESULTS)
            return PROTO("RESULT frame carries %s, not results", kvr_wire_payload_name(h->payload));
        if (h->n_results > h->n_rows)
            return PROTO("RESULT frame has %u results for %u rows", h->n_results, h->n_rows);
        break;
    }
    return KVR_OK;
}

/* Every count within its limit, the payload and body lengths exactly what the counts
 * imply, the frame within the plan's largest. */
static int check_counts(const struct kvr_wire_header *h, const struct kvr_wire_limits *lim,
                        const char *tn, struct kvr_err *err)
{
    if (h->arg)
        return PROTO("%s frame with nonzero argument %u", tn, h->arg);
    if (h->n_rows > lim->max_rows)
        return PROTO("%s frame has %u rows; the plan's row_width is %u", tn, h->n_rows,
                     lim->max_rows);
    if (h->n_segs > lim->max_segs)
        return PROTO("%s frame has %u segments; at most %u", tn, h->n_segs, lim->max_segs);
    if (h->n_segs > h->n_rows || (h->n_rows > 0 && h->n_segs == 0))
        return PROTO("%s frame has %u segments for %u rows (every segment has at least one "
                     "row, every row belongs to a segment)",
                     tn, h->n_segs, h->n_rows);
    if (h->n_ctrl > lim->max_ctrl)
        return PROTO("%s frame has %u control records; at most %u", tn, h->n_ctrl, lim->max_ctrl);
    if (h->n_timings < lim->min_timings ||
        h->n_timings > lim->max_timings + lim->max_agent_timings) {
        if (lim->min_timings == lim->max_timings)
            return PROTO("%s frame has %u timing records; one per upstream stage (%u) "
                         "expected here",
                         tn, h->n_timings, lim->min_timings);
        return PROTO("%s frame has %u timing records; at most %u", tn, h->n_timings,
                     lim->max_timings);
    }
    uint64_t want;
    if (!expected_payload(h, lim, &want) || want != h->payload_bytes)
        return PROTO("%s frame payload is %u bytes; %u rows (%u results) of %s need %" PRIu64, tn,
                     h->payload_bytes, h->n_rows, h->n_results, kvr_wire_payload_name(h->payload),
                     want);
    uint64_t body = (uint64_t)h->n_ctrl * KVR_WIRE_CTRL_BYTES +
                    (uint64_t)h->n_segs * KVR_WIRE_SEG_BYTES + h->payload_bytes +
                    (uint64_t)h->n_timings * KVR_WIRE_TIMING_BYTES;
    if (body != h->body_bytes)
        return PROTO("%s frame body is %u bytes but its sections add up to %" PRIu64, tn,
                     h->body_bytes, body);
    if (KVR_WIRE_HEADER_BYTES + body > lim->max_frame_bytes)
        return PROTO("%s frame of %" PRIu64 " bytes exceeds the plan's largest frame (%u "
                     "bytes)",
                     tn, KVR_WIRE_HEADER_BYTES + body, lim->max_frame_bytes);
    return KVR_OK;
}

int kvr_wire_decode_header(const uint8_t *b, const struct kvr_wire_limits *lim,
                           struct kvr_wire_header *h, struct kvr_err *err)
{
    int rc = read_header(b, h, err);
    if (rc)
        return rc;
    if (h->type == 0 || h->type >= KVR_WIRE_TYPE_COUNT)
        return PROTO("unknown frame type %u", h->type);
    if (!(lim->accept_types & 1u << h->type))
        return PROTO("a %s frame is not accepted on this link", kvr_wire_type_name(h->type));
    if (h->payload >= KVR_WIRE_PAYLOAD_COUNT)
        return PROTO("unknown payload type %u", h->payload);
    const char *tn = kvr_wire_type_name(h->type);

    switch (h->type) {
    case KVR_WIRE_HEARTBEAT:
    case KVR_WIRE_GOODBYE:
    case KVR_WIRE_RESET:
    case KVR_WIRE_REPLAN:
        return check_bodyless(h, lim, tn, err);
    default:
        if ((rc = check_data_kind(h, lim, tn, err)))
            return rc;
        return check_counts(h, lim, tn, err);
    }
}

/* ---- Body ------------------------------------------------------------------------------ */

#define SEG_KNOWN ((1u << KVR_SEG_FLAG_COUNT) - 1)

static int decode_seg(const uint8_t *p, uint32_t i, const struct kvr_wire_limits *lim,
                      struct kvr_wire_frame *f, struct kvr_err *err)
{
    struct kvr_seg *s = &f->segs[i];
    s->seq = kvr_ld32(p);
    s->pos0 = kvr_ld32(p + 4);
    s->n_tokens = kvr_ld32(p + 8);
    s->flags = kvr_ld32(p + 12);
    if (s->seq >= lim->max_seqs)
        return PROTO("segment %u names seq %u; the plan has %u sequence slots", i, s->seq,
                     lim->max_seqs);
    if (s->n_tokens == 0)
        return PROTO("segment %u (seq %u) has no tokens", i, s->seq);
    if ((uint64_t)s->pos0 + s->n_tokens > lim->n_ctx)
        return PROTO("segment %u (seq %u): positions %u..%" PRIu64 " exceed n_ctx %u", i, s->seq,
                     s->pos0, (uint64_t)s->pos0 + s->n_tokens - 1, lim->n_ctx);
    uint32_t fl = s->flags;
    if (fl & ~SEG_KNOWN)
        return PROTO("segment %u (seq %u) has unknown flags 0x%x", i, s->seq, fl);
    bool prefill = fl & KVR_SEG_PREFILL, decode = fl & KVR_SEG_DECODE;
    const char *bad = NULL;
    if (prefill == decode)
        bad = "must be exactly one of PREFILL and DECODE";
    else if ((fl & KVR_SEG_LAST_CHUNK) && !prefill)
        bad = "LAST_CHUNK without PREFILL";
    else if ((fl & KVR_SEG_DRAFTS) && (!decode || !(fl & KVR_SEG_WANTS_TOKEN)))
        bad = "DRAFTS only on a DECODE segment that wants a token";
    else if (decode && !(fl & KVR_SEG_DRAFTS) && s->n_tokens != 1)
        bad = "a DECODE segment carries exactly one token";
    else if ((fl & KVR_SEG_DRAFTS) && (s->n_tokens < 2 || s->n_tokens > 1 + KVR_SPEC_MAX_DRAFT))
        bad = "a DRAFTS segment carries its last token and 1..16 drafted ones";
    else if ((fl & KVR_SEG_WANTS_TOKEN) && !decode && !(fl & KVR_SEG_LAST_CHUNK))
        bad = "WANTS_TOKEN only on a DECODE segment or a LAST_CHUNK";
    if (bad)
        return PROTO("segment %u (seq %u, flags 0x%x): %s", i, s->seq, fl, bad);
    uint64_t bit = 1ull << (s->seq % 64);
    if (f->seq_seen[s->seq / 64] & bit)
        return PROTO("segment %u: seq %u appears in two segments of one batch", i, s->seq);
    f->seq_seen[s->seq / 64] |= bit;
    return KVR_OK;
}

/* The segments, each checked alone, then their rows against the header's. */
static int decode_segs(struct kvr_wire_frame *f, const uint8_t *p,
                       const struct kvr_wire_limits *lim, struct kvr_err *err)
{
    const struct kvr_wire_header *h = &f->hdr;
    int rc = KVR_OK;
    uint64_t rows = 0;
    uint32_t i_seg = 0;
    for (; i_seg < h->n_segs; i_seg++, p += KVR_WIRE_SEG_BYTES) {
        if ((rc = decode_seg(p, i_seg, lim, f, err)))
            break;
        rows += f->segs[i_seg].n_tokens;
        f->n_logit_rows += (f->segs[i_seg].flags & KVR_SEG_WANTS_TOKEN) != 0;
    }
    /* Clear exactly the bits this frame set, so the bitmap is all zero for the next. */
    for (uint32_t i = 0; i < i_seg; i++)
        f->seq_seen[f->segs[i].seq / 64] &= ~(1ull << (f->segs[i].seq % 64));
    if (rc)
        return rc;
    if (rows != h->n_rows)
        return PROTO("segments hold %" PRIu64 " rows; the header says %u", rows, h->n_rows);
    return KVR_OK;
}

/* Token ids, when the receiver knows the vocabulary. */
static int check_tokens(const struct kvr_wire_header *h, const uint8_t *p,
                        const struct kvr_wire_limits *lim, struct kvr_err *err)
{
    if (h->payload != KVR_WIRE_PAYLOAD_TOKENS || !lim->n_vocab)
        return KVR_OK;
    for (uint32_t r = 0; r < h->n_rows; r++) {
        int32_t t = (int32_t)kvr_ld32(p + 4 * (size_t)r);
        if (t < 0 || (uint32_t)t >= lim->n_vocab)
            return PROTO("row %u has token id %d; the vocabulary has %u tokens", r, t,
                         lim->n_vocab);
    }
    return KVR_OK;
}

/* The alternatives after the result records: as many as their flags say, each id in the
 * vocabulary and each logprob <= 0 (-inf allowed: underflow; NaN fails the test). */
static int decode_tops(struct kvr_wire_frame *f, const uint8_t *p,
                       const struct kvr_wire_limits *lim, struct kvr_err *err)
{
    const struct kvr_wire_header *h = &f->hdr;
    uint64_t n = 0;
    for (uint32_t k = 0; k < h->n_results; k++)
        n += f->results[k].n_top;
    uint64_t have =
        (h->payload_bytes - (uint64_t)h->n_results * KVR_WIRE_RESULT_BYTES) / KVR_WIRE_TOP_BYTES;
    if (n != have)
        return PROTO("RESULT frame's records announce %" PRIu64 " alternatives; its payload "
                     "holds %" PRIu64,
                     n, have);
    for (uint32_t k = 0; k < h->n_results; k++) {
        struct kvr_wire_result *r = &f->results[k];
        for (uint32_t j = 0; j < r->n_top; j++, p += KVR_WIRE_TOP_BYTES) {
            r->top[j].id = (int32_t)kvr_ld32(p);
            r->top[j].logprob = kvr_ldf32(p + 4);
            if (r->top[j].id < 0 || (lim->n_vocab && (uint32_t)r->top[j].id >= lim->n_vocab) ||
                !(r->top[j].logprob <= 0.0f))
                return PROTO("result %u (seq %u): alternative %u is token %d with logprob %g", k,
                             r->seq, j, r->top[j].id, (double)r->top[j].logprob);
        }
    }
    return KVR_OK;
}

/* One result record at q into r, checked alone; its n_top alternatives come later. */
static int decode_result(const uint8_t *q, uint32_t k, const struct kvr_wire_limits *lim,
                         struct kvr_wire_result *r, struct kvr_err *err)
{
    r->seq = kvr_ld32(q);
    r->token = (int32_t)kvr_ld32(q + 4);
    r->logprob = kvr_ldf32(q + 8);
    r->flags = kvr_ld32(q + 12);
    r->n_top = (r->flags & KVR_WIRE_TOP_MASK) >> KVR_WIRE_TOP_SHIFT;
    r->flags &= ~KVR_WIRE_TOP_MASK;
    if (r->token < 0 || (lim->n_vocab && (uint32_t)r->token >= lim->n_vocab))
        return PROTO("result %u (seq %u) has token id %d outside the vocabulary", k, r->seq,
                     r->token);
    if (r->flags & ~((1u << KVR_WIRE_RESULT_FLAG_COUNT) - 1))
        return PROTO("result %u (seq %u) has unknown flags 0x%x", k, r->seq, r->flags);
    bool has = r->flags & KVR_WIRE_RESULT_LOGPROB;
    /* A log-probability is <= 0 (-inf allowed: underflow); NaN fails the test. */
    if (has ? !(r->logprob <= 0.0f) : kvr_ld32(q + 8) != 0 || r->n_top)
        return PROTO("result %u (seq %u) has logprob %g with flags 0x%x and %u alternatives", k,
                     r->seq, (double)r->logprob, r->flags, r->n_top);
    if (r->n_top > KVR_LOGPROBS_MAX_TOP)
        return PROTO("result %u (seq %u) has %u alternatives, at most %d", k, r->seq, r->n_top,
                     KVR_LOGPROBS_MAX_TOP);
    return KVR_OK;
}

/* RESULT: one record per segment that wants a token, in the segments' order (a DRAFTS
 * segment's 1..n_tokens records are the consecutive ones with its seq), then their
 * alternatives. */
static int decode_results(struct kvr_wire_frame *f, const uint8_t *p,
                          const struct kvr_wire_limits *lim, struct kvr_err *err)
{
    const struct kvr_wire_header *h = &f->hdr;
    uint32_t k = 0;
    for (uint32_t i = 0; i < h->n_segs; i++) {
        const struct kvr_seg *sg = &f->segs[i];
        if (!(sg->flags & KVR_SEG_WANTS_TOKEN))
            continue;
        uint32_t most = (sg->flags & KVR_SEG_DRAFTS) ? sg->n_tokens : 1, n = 0;
        for (; k < h->n_results && n < most; k++, n++) {
            int rc =
                decode_result(p + (size_t)k * KVR_WIRE_RESULT_BYTES, k, lim, &f->results[k], err);
            if (rc)
                return rc;
            if (f->results[k].seq != sg->seq && n > 0)
                break; /* the next segment's */
            if (f->results[k].seq != sg->seq)
                return PROTO("result %u is for seq %u; segment %u (wanting a token) is seq %u", k,
                             f->results[k].seq, i, sg->seq);
        }
        if (n == 0)
            return PROTO("RESULT frame has no result for segment %u (seq %u)", i, sg->seq);
    }
    if (k != h->n_results)
        return PROTO("RESULT frame has %u results; its %u segments that want a token took %u",
                     h->n_results, f->n_logit_rows, k);
    return decode_tops(f, p + (size_t)h->n_results * KVR_WIRE_RESULT_BYTES, lim, err);
}

/* The stages' records (record i from stage i), then the agents' (wire.h). */
static int decode_timings(struct kvr_wire_frame *f, const uint8_t *p,
                          const struct kvr_wire_limits *lim, struct kvr_err *err)
{
    const struct kvr_wire_header *h = &f->hdr;
    uint32_t n_stage = 0, n_agent = 0;
    for (uint32_t i = 0; i < h->n_timings; i++, p += KVR_WIRE_TIMING_BYTES) {
        uint32_t who = kvr_ld32(p), reserved = kvr_ld32(p + 4);
        struct kvr_wire_timing *t;
        if (who & KVR_WIRE_TIMING_AGENT) {
            if ((who & ~KVR_WIRE_TIMING_AGENT) >= lim->n_agents ||
                n_agent >= f->cap_agent_timings || n_stage == 0)
                return PROTO("timing record %u claims expert agent %u (the plan has %u; at "
                             "most %u agent records, after a stage's)",
                             i, who & ~KVR_WIRE_TIMING_AGENT, lim->n_agents, f->cap_agent_timings);
            t = &f->agent_timings[n_agent++];
            t->pairs = reserved;
        } else {
            if (who != n_stage || reserved != 0 || n_agent > 0 || n_stage >= lim->max_timings)
                return PROTO("timing record %u claims stage %u (record i comes from stage i, "
                             "reserved field 0, before the agents' records)",
                             i, who);
            t = &f->timings[n_stage++];
            t->pairs = 0;
        }
        t->stage = who;
        t->held_ns = kvr_ld64(p + 8);
        t->starved_ns = kvr_ld64(p + 16);
        t->blocked_ns = kvr_ld64(p + 24);
    }
    if ((h->type == KVR_WIRE_BATCH || h->type == KVR_WIRE_RESULT) && n_stage < lim->min_timings)
        return PROTO("frame has %u stage timing records; %u expected here", n_stage,
                     lim->min_timings);
    f->hdr.n_timings = n_stage;
    f->n_agent_timings = n_agent;
    return KVR_OK;
}

int kvr_wire_decode_body(struct kvr_wire_frame *f, const struct kvr_wire_header *h,
                         const uint8_t *body, size_t len, const struct kvr_wire_limits *lim,
                         struct kvr_err *err)
{
    if (len != h->body_bytes)
        return PROTO("frame body is %zu bytes; its header says %u", len, h->body_bytes);
    if (h->n_ctrl > f->cap_ctrl || h->n_segs > f->cap_segs || h->n_results > f->cap_segs ||
        h->n_timings >= f->cap_timings + f->cap_agent_timings || lim->max_seqs > f->cap_seqs)
        return kvr_err_set(err, KVR_EINVAL, "wire: frame records were sized for smaller limits");
    f->hdr = *h;
    f->payload = NULL;
    f->n_logit_rows = 0;
    const uint8_t *p = body;
    int rc = KVR_OK;
    for (uint32_t i = 0; i < h->n_ctrl; i++, p += KVR_WIRE_CTRL_BYTES)
        if ((rc = kvr_wire_ctrl_decode(p, i, lim, &f->ctrl[i], err)))
            return rc;
    if ((rc = decode_segs(f, p, lim, err)))
        return rc;
    p += (size_t)h->n_segs * KVR_WIRE_SEG_BYTES;
    f->payload = h->payload_bytes ? p : NULL;
    if ((rc = check_tokens(h, p, lim, err)))
        return rc;
    if (h->type == KVR_WIRE_RESULT && (rc = decode_results(f, p, lim, err)))
        return rc;
    return decode_timings(f, p + h->payload_bytes, lim, err);
}

/* ---- Encoding -------------------------------------------------------------------------- */

#define INVAL(...) kvr_err_set(err, KVR_EINVAL, __VA_ARGS__)

/* What the encoder can check without limits (wire.h); gives the frame's row count, its
 * payload type (NONE for frames without a body) and payload length. */
static int check_msg(const struct kvr_wire_msg *m, uint64_t *rows_out, uint32_t *payload_out,
                     uint64_t *payload_bytes_out, struct kvr_err *err)
{
    if (m->type == 0 || m->type >= KVR_WIRE_TYPE_COUNT)
        return INVAL("wire: cannot encode frame type %u", m->type);
    bool expert = m->type == KVR_WIRE_EXPERT || m->type == KVR_WIRE_EXPERT_RESULT;
    bool data = m->type == KVR_WIRE_BATCH || m->type == KVR_WIRE_RESULT || expert;
    if (m->n_ctrl > KVR_WIRE_MAX_COUNT || m->n_segs > KVR_WIRE_MAX_COUNT ||
        (uint64_t)m->n_timings + m->n_agent_timings > KVR_WIRE_MAX_COUNT ||
        m->n_results > KVR_WIRE_MAX_COUNT)
        return INVAL("wire: a count exceeds the header's 16-bit field");
    if (!data && (m->n_ctrl || m->n_segs || m->n_timings || m->n_agent_timings || m->n_results ||
                  m->payload_bytes))
        return INVAL("wire: a %s frame has no body", kvr_wire_type_name(m->type));
    uint64_t rows = 0;
    for (uint32_t i = 0; i < m->n_segs; i++)
        rows += m->segs[i].n_tokens;
    if (rows > UINT32_MAX)
        return INVAL("wire: %" PRIu64 " rows do not fit a frame", rows);

    uint32_t payload = m->payload;
    uint64_t payload_bytes = m->payload_bytes;
    *rows_out = rows;
    if (!data) {
        payload = KVR_WIRE_PAYLOAD_NONE;
    } else if (expert) {
        if (payload != KVR_WIRE_PAYLOAD_EXPERT || m->n_ctrl || m->n_segs || m->n_results ||
            m->n_timings || m->n_agent_timings)
            return INVAL("wire: a %s frame carries one expert payload and no records",
                         kvr_wire_type_name(m->type));
        if (payload_bytes && !m->payload_data)
            return INVAL("wire: payload bytes without payload data");
    } else if (m->type == KVR_WIRE_RESULT) {
        if (payload != KVR_WIRE_PAYLOAD_RESULTS)
            return INVAL("wire: a RESULT frame carries results");
        payload_bytes = (uint64_t)m->n_results * KVR_WIRE_RESULT_BYTES;
        for (uint32_t i = 0; i < m->n_results; i++) {
            if (m->results[i].n_top > KVR_LOGPROBS_MAX_TOP)
                return INVAL("wire: a result carries at most %d alternatives",
                             KVR_LOGPROBS_MAX_TOP);
            payload_bytes += (uint64_t)m->results[i].n_top * KVR_WIRE_TOP_BYTES;
        }
    } else {
        if (payload != KVR_WIRE_PAYLOAD_TOKENS && !is_rows(payload))
            return INVAL("wire: a BATCH frame carries tokens or rows, not %s",
                         kvr_wire_payload_name(payload));
        if (m->n_results)
            return INVAL("wire: only RESULT frames carry results");
        /* Tokens: one int32 per row. Rows: a whole, nonzero number of values per row
         * (the encoder does not know n_embd; the receiver checks it). */
        uint64_t unit = rows * kvr_wire_payload_elem_bytes(payload);
        bool ok =
            payload == KVR_WIRE_PAYLOAD_TOKENS
                ? payload_bytes == unit
                : (rows == 0 ? payload_bytes == 0 : payload_bytes > 0 && payload_bytes % unit == 0);
        if (!ok)
            return INVAL("wire: %" PRIu64 " payload bytes are not %" PRIu64 " whole rows of %s",
                         payload_bytes, rows, kvr_wire_payload_name(payload));
        if (payload_bytes && !m->payload_data)
            return INVAL("wire: payload bytes without payload data");
    }
    *payload_out = payload;
    *payload_bytes_out = payload_bytes;
    return KVR_OK;
}

static void put_header(uint8_t *p, const struct kvr_wire_msg *m, uint64_t rows, uint32_t payload,
                       uint64_t payload_bytes, uint64_t body)
{
    kvr_st32(p, KVR_WIRE_FRAME_MAGIC);
    p[4] = (uint8_t)m->type;
    p[5] = (uint8_t)payload;
    kvr_st16(p + 6, (uint16_t)(m->type == KVR_WIRE_GOODBYE || m->type == KVR_WIRE_RESET ||
                                       m->type == KVR_WIRE_REPLAN
                                   ? m->arg
                                   : 0));
    kvr_st64(p + 8, m->batch_id);
    kvr_st32(p + 16, (uint32_t)rows);
    kvr_st16(p + 20, (uint16_t)m->n_segs);
    kvr_st16(p + 22, (uint16_t)m->n_ctrl);
    kvr_st16(p + 24, (uint16_t)(m->n_timings + m->n_agent_timings));
    kvr_st16(p + 26, (uint16_t)(m->type == KVR_WIRE_RESULT ? m->n_results : 0));
    kvr_st32(p + 28, (uint32_t)payload_bytes);
    kvr_st32(p + 32, (uint32_t)body);
    kvr_st32(p + 36, kvr_crc32c(p, 36));
}

/* The timing records: the stages', then the agents' (their reserved field the pairs). */
static void put_timings(uint8_t *p, const struct kvr_wire_msg *m)
{
    for (uint32_t i = 0; i < m->n_timings + m->n_agent_timings; i++, p += KVR_WIRE_TIMING_BYTES) {
        const struct kvr_wire_timing *t =
            i < m->n_timings ? &m->timings[i] : &m->agent_timings[i - m->n_timings];
        kvr_st32(p, t->stage);
        kvr_st32(p + 4, i < m->n_timings ? 0 : t->pairs);
        kvr_st64(p + 8, t->held_ns);
        kvr_st64(p + 16, t->starved_ns);
        kvr_st64(p + 24, t->blocked_ns);
    }
}

int kvr_wire_encode(const struct kvr_wire_msg *m, uint8_t *scratch, size_t cap,
                    struct iovec iov[KVR_WIRE_MAX_IOV], int *n_iov, size_t *frame_bytes,
                    struct kvr_err *err)
{
    uint64_t rows = 0, payload_bytes = 0;
    uint32_t payload = KVR_WIRE_PAYLOAD_NONE;
    int rc = check_msg(m, &rows, &payload, &payload_bytes, err);
    if (rc)
        return rc;
    bool expert = m->type == KVR_WIRE_EXPERT || m->type == KVR_WIRE_EXPERT_RESULT;
    uint64_t records = KVR_WIRE_HEADER_BYTES + (uint64_t)m->n_ctrl * KVR_WIRE_CTRL_BYTES +
                       (uint64_t)m->n_segs * KVR_WIRE_SEG_BYTES;
    uint64_t results = m->type == KVR_WIRE_RESULT ? payload_bytes : 0;
    uint64_t timings = ((uint64_t)m->n_timings + m->n_agent_timings) * KVR_WIRE_TIMING_BYTES;
    uint64_t body = records - KVR_WIRE_HEADER_BYTES + payload_bytes + timings;
    if (body > UINT32_MAX || payload_bytes > UINT32_MAX)
        return INVAL("wire: a frame body of %" PRIu64 " bytes is too large", body);
    if (records + results + timings > cap)
        return INVAL("wire: scratch of %zu bytes cannot hold %" PRIu64 " bytes of records", cap,
                     records + results + timings);

    uint8_t *p = scratch;
    put_header(p, m, rows, payload, payload_bytes, body);
    p += KVR_WIRE_HEADER_BYTES;
    for (uint32_t i = 0; i < m->n_ctrl; i++)
        p = kvr_wire_ctrl_put(p, &m->ctrl[i]);
    for (uint32_t i = 0; i < m->n_segs; i++, p += KVR_WIRE_SEG_BYTES) {
        kvr_st32(p, m->segs[i].seq);
        kvr_st32(p + 4, m->segs[i].pos0);
        kvr_st32(p + 8, m->segs[i].n_tokens);
        kvr_st32(p + 12, m->segs[i].flags);
    }
    for (uint32_t i = 0; m->type == KVR_WIRE_RESULT && i < m->n_results;
         i++, p += KVR_WIRE_RESULT_BYTES) {
        kvr_st32(p, m->results[i].seq);
        kvr_st32(p + 4, (uint32_t)m->results[i].token);
        kvr_stf32(p + 8, m->results[i].logprob);
        kvr_st32(p + 12, (m->results[i].flags & ~KVR_WIRE_TOP_MASK) | m->results[i].n_top
                                                                          << KVR_WIRE_TOP_SHIFT);
    }
    for (uint32_t i = 0; m->type == KVR_WIRE_RESULT && i < m->n_results; i++)
        for (uint32_t j = 0; j < m->results[i].n_top; j++, p += KVR_WIRE_TOP_BYTES) {
            kvr_st32(p, (uint32_t)m->results[i].top[j].id);
            kvr_stf32(p + 4, m->results[i].top[j].logprob);
        }
    uint8_t *tim = p;
    put_timings(tim, m);

    int n = 0;
    iov[n].iov_base = scratch;
    iov[n++].iov_len = (size_t)(tim - scratch);
    if ((m->type == KVR_WIRE_BATCH || expert) && payload_bytes) {
        iov[n].iov_base = (void *)m->payload_data;
        iov[n++].iov_len = (size_t)payload_bytes;
    }
    if (timings) {
        iov[n].iov_base = tim;
        iov[n++].iov_len = (size_t)timings;
    }
    *n_iov = n;
    *frame_bytes = (size_t)(KVR_WIRE_HEADER_BYTES + body);
    return KVR_OK;
}

int kvr_wire_encode_flat(const struct kvr_wire_msg *m, uint8_t *out, size_t cap,
                         size_t *frame_bytes, struct kvr_err *err)
{
    /* Encode in place: the records land at the start of `out`; the payload (if any) is
     * then inserted before the timing records by moving those up. */
    struct iovec iov[KVR_WIRE_MAX_IOV];
    int n_iov = 0;
    size_t total = 0;
    int rc = kvr_wire_encode(m, out, cap, iov, &n_iov, &total, err);
    if (rc)
        return rc;
    if (total > cap)
        return INVAL("wire: buffer of %zu bytes cannot hold a %zu-byte frame", cap, total);
    size_t at = iov[0].iov_len;
    if (n_iov >= 2 && iov[1].iov_base == (void *)m->payload_data &&
        (m->type == KVR_WIRE_BATCH || m->type == KVR_WIRE_EXPERT ||
         m->type == KVR_WIRE_EXPERT_RESULT)) {
        size_t pay = iov[1].iov_len, tim = n_iov == 3 ? iov[2].iov_len : 0;
        memmove(out + at + pay, out + at, tim);
        memcpy(out + at, m->payload_data, pay);
    }
    *frame_bytes = total;
    return KVR_OK;
}

/* ---- Boundary rows --------------------------------------------------------------------- */

void kvr_wire_rows_from_f32(uint32_t payload, const float *src, size_t n, void *dst)
{
    uint8_t *d = dst;
    switch (payload) {
    case KVR_WIRE_PAYLOAD_F32:
        memcpy(d, src, n * sizeof(float));
        break;
    case KVR_WIRE_PAYLOAD_F16:
        for (size_t i = 0; i < n; i++)
            kvr_st16(d + 2 * i, kvr_f32_to_f16(src[i]));
        break;
    case KVR_WIRE_PAYLOAD_BF16:
        for (size_t i = 0; i < n; i++)
            kvr_st16(d + 2 * i, kvr_f32_to_bf16(src[i]));
        break;
    default:
        break;
    }
}

void kvr_wire_rows_to_f32(uint32_t payload, const void *src, size_t n, float *dst)
{
    const uint8_t *s = src;
    switch (payload) {
    case KVR_WIRE_PAYLOAD_F32:
        memcpy(dst, s, n * sizeof(float));
        break;
    case KVR_WIRE_PAYLOAD_F16:
        for (size_t i = 0; i < n; i++)
            dst[i] = kvr_f16_to_f32(kvr_ld16(s + 2 * i));
        break;
    case KVR_WIRE_PAYLOAD_BF16:
        for (size_t i = 0; i < n; i++)
            dst[i] = kvr_bf16_to_f32(kvr_ld16(s + 2 * i));
        break;
    default:
        break;
    }
}
