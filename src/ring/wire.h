/* wire.h - the frame codec of the ring protocol (DESIGN.md 3-5; byte tables in wire.c and
 * docs/PROTOCOL.md).
 *
 * Pure: bytes in, structs out; no I/O, no globals, no allocation outside
 * kvr_wire_frame_init. Everything a peer sends is checked against struct kvr_wire_limits,
 * derived from the plan, so a frame can never make the receiver read, allocate or index
 * beyond what the plan sized at start-up.
 *
 * A frame is a 40-byte header followed by a body:
 *     header | control records | segments | payload | timing records
 * and is one of seven types:
 *   BATCH     bridge -> head -> ... -> tail: membership (segments), in-band control records
 *             (open/free/cancel a sequence), and the payload: token ids (to the head) or
 *             boundary rows n_rows x n_embd in the plan's wire dtype (between stages).
 *   RESULT    tail -> bridge: the same membership and control records, and one result
 *             record per segment flagged KVR_SEG_WANTS_TOKEN (its sampled token); 1..n_tokens
 *             records for a segment also flagged KVR_SEG_DRAFTS (the tokens it kept).
 *   HEARTBEAT sender -> receiver when idle, so a silent peer can be told from a dead one.
 *   GOODBYE   sender -> receiver before a deliberate close.
 *   EXPERT, EXPERT_RESULT  a stage's rows to an expert agent and the agent's answer
 *             (docs/EXPERTS.md; body layout in ring/experts.c): no records, one payload.
 *   RESET     a stage dropped every sequence (its upstream link was lost or replaced, or it
 *             could not run a batch); forwarded by every later stage to the bridge, which
 *             then holds and re-prefills the running sequences (DESIGN.md 8).
 * Every stage appends one timing record to the frame as it forwards it, so a RESULT carries
 * the whole trip through the ring.
 *
 * Receiving (link layer, net.h):
 *   kvr_wire_decode_header(hdr_bytes, limits, &hdr, err)      40 bytes -> counts checked
 *   ... read exactly hdr.body_bytes more bytes ...
 *   kvr_wire_decode_body(&frame, &hdr, body, len, limits, err) records checked and decoded
 * Sending:
 *   kvr_wire_encode(&msg, scratch, cap, iov, &n_iov, &total, err) header and records go to
 *   `scratch`; the payload is referenced, not copied, so rows go out of the activation
 *   buffer with one writev.
 * Forwarding (a stage): kvr_wire_msg_forward(&msg, frame) copies the membership, control
 * and timing records of the received frame into a message; the stage appends its timing
 * record (kvr_wire_frame_append_timing) and sets its own payload.
 *
 * Byte order: little-endian everywhere. Payload rows are sent in host order, so the build
 * refuses big-endian hosts (see wire.c).
 *
 * Threads: all functions are reentrant; a struct kvr_wire_frame is used by one thread. */
#ifndef KVR_RING_WIRE_H
#define KVR_RING_WIRE_H

#include "core/err.h"
#include "model/engine.h"
#include "model/logprobs.h"
#include "model/sampler.h"
#include "ring/plan.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#define KVR_WIRE_FRAME_MAGIC 0x5246564bu /* "KVFR" as bytes on the wire */
#define KVR_WIRE_HEADER_BYTES 40
#define KVR_WIRE_CTRL_BYTES 48
#define KVR_WIRE_SEG_BYTES 16
#define KVR_WIRE_RESULT_BYTES 16
#define KVR_WIRE_TOP_BYTES 8 /* one alternative after the result records: id, logprob */
#define KVR_WIRE_TIMING_BYTES 32
#define KVR_WIRE_MAX_IOV 3                  /* records, payload, timings */
#define KVR_WIRE_MAX_FRAME_BYTES (1u << 30) /* no plan may need a larger frame */
#define KVR_WIRE_MAX_COUNT 65535u           /* the header's 16-bit counts */

enum kvr_wire_type {
    KVR_WIRE_BATCH = 1,
    KVR_WIRE_RESULT = 2,
    KVR_WIRE_HEARTBEAT = 3,
    KVR_WIRE_GOODBYE = 4,
    KVR_WIRE_RESET = 5,
    KVR_WIRE_REPLAN = 6,        /* bridge -> a stage, on a control link only: arg = the new plan's
                                   epoch, batch_id = a mask of the old stages kept (propose.h) */
    KVR_WIRE_EXPERT = 7,        /* owning stage -> expert agent: rows and their routing */
    KVR_WIRE_EXPERT_RESULT = 8, /* expert agent -> stage: the held pairs' output rows */
    KVR_WIRE_TYPE_COUNT = 9
};

/* RESET's batch_id when the stage's upstream link was lost or replaced (otherwise it is the
 * id of the batch the stage could not run). */
#define KVR_WIRE_RESET_LINK UINT64_MAX

/* What the payload holds. */
enum kvr_wire_payload {
    KVR_WIRE_PAYLOAD_NONE = 0,    /* HEARTBEAT, GOODBYE, RESET */
    KVR_WIRE_PAYLOAD_TOKENS = 1,  /* n_rows int32 token ids (BATCH to the head) */
    KVR_WIRE_PAYLOAD_F32 = 2,     /* n_rows x n_embd boundary rows, float32 */
    KVR_WIRE_PAYLOAD_F16 = 3,     /* ... IEEE half */
    KVR_WIRE_PAYLOAD_BF16 = 4,    /* ... bfloat16 */
    KVR_WIRE_PAYLOAD_RESULTS = 5, /* n_results result records (RESULT) */
    KVR_WIRE_PAYLOAD_EXPERT = 6,  /* an EXPERT / EXPERT_RESULT body, laid out and checked
                                     by ring/experts.c; here only bounded by the frame size */
    KVR_WIRE_PAYLOAD_COUNT = 7
};

/* GOODBYE's reason, carried in the header's `arg`. */
enum kvr_wire_goodbye {
    KVR_WIRE_GOODBYE_SHUTDOWN = 0, /* orderly stop */
    KVR_WIRE_GOODBYE_ERROR = 1,    /* the sender hit an error and is dropping the link */
    KVR_WIRE_GOODBYE_COUNT = 2
};

struct kvr_wire_header {
    uint32_t type;          /* enum kvr_wire_type */
    uint32_t payload;       /* enum kvr_wire_payload */
    uint32_t arg;           /* GOODBYE: enum kvr_wire_goodbye; RESET: the stage that dropped
                               its sequences; otherwise 0 */
    uint64_t batch_id;      /* chosen by the bridge, unchanged around the ring;
                               HEARTBEAT: the sender's heartbeat counter; RESET: the batch
                               that failed, or KVR_WIRE_RESET_LINK */
    uint32_t n_rows;        /* token rows: sum of the segments' n_tokens */
    uint32_t n_segs;        /* segment records */
    uint32_t n_ctrl;        /* control records */
    uint32_t n_timings;     /* timing records */
    uint32_t n_results;     /* result records (RESULT only) */
    uint32_t payload_bytes; /* bytes of the payload section */
    uint32_t body_bytes;    /* bytes after the header, all sections */
};

/* ---- Records --------------------------------------------------------------------------- */

enum kvr_wire_ctrl_type {
    KVR_WIRE_CTRL_OPEN = 1,    /* a new sequence: reset its state; the tail keeps its sampling */
    KVR_WIRE_CTRL_FREE = 2,    /* the sequence ended: release its KV blocks everywhere */
    KVR_WIRE_CTRL_CANCEL = 3,  /* the client went away: like FREE, and the tail drops it */
    KVR_WIRE_CTRL_REPLAY = 4,  /* restore a re-opened sequence's sampler (the tail only) */
    KVR_WIRE_CTRL_MAP = 5,     /* the KV blocks a just-opened sequence uses (every stage) */
    KVR_WIRE_CTRL_BIAS = 6,    /* logit biases of a sequence just opened (the tail only) */
    KVR_WIRE_CTRL_GRAMMAR = 7, /* a piece of its grammar's text (the tail only) */
    KVR_WIRE_CTRL_DRAFT = 8,   /* the drafted tokens of the sequence's DRAFTS segment (tail) */
    KVR_WIRE_CTRL_TYPE_COUNT = 9
};

/* (token, bias) pairs one BIAS record carries. */
#define KVR_WIRE_BIAS_PAIRS 4

/* Token ids one REPLAY record carries. */
#define KVR_WIRE_REPLAY_IDS 8

enum kvr_wire_open_flag {
    KVR_WIRE_OPEN_LOGPROBS = 1u << 0, /* results carry the sampled token's log-probability */
    KVR_WIRE_OPEN_FLAG_COUNT = 1
};
/* OPEN flags bits 8..12: how many alternatives (model/logprobs.h, 0 ..=
 * KVR_LOGPROBS_MAX_TOP) each of the sequence's results carries; nonzero only with
 * KVR_WIRE_OPEN_LOGPROBS. Result flags use the same bits for the count that follows. */
#define KVR_WIRE_TOP_SHIFT 8
#define KVR_WIRE_TOP_MASK (0x1fu << KVR_WIRE_TOP_SHIFT)

/* An OPEN record carries the sequence's struct kvr_sample_params (model/sampler.h), all but
 * the logit biases, which follow in BIAS records: the decoder leaves n_bias 0. On the wire
 * the codec accepts only these ranges (tighter than the sampler's own check):
 *   temperature [0, 100] (0 = greedy), top_k >= 0 (0 = off), top_p and min_p [0, 1],
 *   repeat_penalty (0, 100], frequency_penalty and presence_penalty [-100, 100],
 *   repeat_last_n -1 ..= n_ctx (-1 = the sampler's whole window), any seed. */

/* A sequence re-prefilled after a ring failure continues exactly where it stopped only if
 * the tail's sampler is where it was (DESIGN.md 8): the generator must have made the same
 * draws and the penalty window must hold the same tokens. After the OPEN, the bridge sends
 * REPLAY records; the tail draws and discards n_draws numbers, then accepts ids[0..n_ids)
 * into the penalty window, in order (several records apply in order). */
struct kvr_wire_replay {
    uint32_t n_draws;                 /* <= n_ctx: one per sampled token so far, if the
                                         sequence samples (temperature > 0) */
    uint32_t n_ids;                   /* <= KVR_WIRE_REPLAY_IDS */
    int32_t ids[KVR_WIRE_REPLAY_IDS]; /* generated tokens, oldest first; 0 past n_ids */
};

/* Block ids one MAP record carries. */
#define KVR_WIRE_MAP_IDS 7

/* The bridge names every KV block a sequence will use (DESIGN.md 12): after its OPEN, MAP
 * records set its block table, entries [first, first + n_ids) in order, from 0 up to every
 * block its prompt and max_tokens need; its first n_cached positions are already in the
 * first blocks (a prefix-cache hit: those blocks were written by an earlier sequence and
 * are shared), so its prefill starts at position n_cached. Every stage applies the same
 * records, so all map the same blocks in the same order. */
struct kvr_wire_map {
    uint32_t n_cached; /* a multiple of the block size, <= max_blocks_per_seq blocks; the
                          same in every MAP record of one opening, and within the blocks
                          mapped once they all are (the stage checks before it runs) */
    uint32_t first;    /* table entry of ids[0]: 0, then continuing the previous record */
    uint32_t n_ids;    /* 1 .. KVR_WIRE_MAP_IDS */
    uint32_t ids[KVR_WIRE_MAP_IDS]; /* block ids < the plan's kv_blocks; 0 past n_ids */
};

/* OpenAI's logit_bias of a sequence: sent after its OPEN (and after every re-OPEN), the
 * tail adds each pair to the sequence's sampler (sampler.h, step 0). */
struct kvr_wire_bias {
    uint32_t n;                       /* 1 ..= KVR_WIRE_BIAS_PAIRS */
    int32_t ids[KVR_WIRE_BIAS_PAIRS]; /* < n_vocab; 0 past n */
    float bias[KVR_WIRE_BIAS_PAIRS];  /* [-100, 100]; 0 past n */
};

/* Grammar text bytes one GRAMMAR record carries, and the most a grammar may have (the
 * grammar compiler's own limit, model/grammar.h). */
#define KVR_WIRE_GRAMMAR_BYTES 32
#define KVR_WIRE_GRAMMAR_MAX_TOTAL (256u * 1024u)

/* A constrained sequence's GBNF text (model/grammar.h), sent after its OPEN (and after
 * every re-OPEN) and before its REPLAY records, in order: record k carries bytes
 * [32k, 32k + n) of `total`. The tail compiles the text when the last piece arrives and
 * masks the sequence's logits with it from then on (REPLAY ids advance it). */
struct kvr_wire_grammar {
    uint32_t offset;                      /* a multiple of 32, < total */
    uint32_t total;                       /* 1 ..= KVR_WIRE_GRAMMAR_MAX_TOTAL */
    uint8_t text[KVR_WIRE_GRAMMAR_BYTES]; /* n = min(32, total - offset) bytes; 0 past n */
};

/* Token ids one DRAFT record carries. */
#define KVR_WIRE_DRAFT_IDS 9

/* The drafted tokens d1..dk of the sequence's segment flagged KVR_SEG_DRAFTS in the same
 * batch (model/spec_accept.h): the head reads them from the token payload, but the tail
 * must know them to decide where its own tokens depart from them. Several records apply in
 * order; the tail checks that they name exactly n_tokens - 1 ids. */
struct kvr_wire_draft {
    uint32_t n_ids;                  /* 1 ..= KVR_WIRE_DRAFT_IDS */
    int32_t ids[KVR_WIRE_DRAFT_IDS]; /* < n_vocab; 0 past n_ids */
};

struct kvr_wire_ctrl {
    uint32_t type;  /* enum kvr_wire_ctrl_type */
    uint32_t flags; /* OPEN: enum kvr_wire_open_flag bits; else 0 */
    uint32_t seq;   /* < max_seqs */
    union {
        struct kvr_sample_params sampling; /* OPEN (n_bias 0); all zero for FREE and CANCEL */
        struct kvr_wire_replay replay;     /* REPLAY */
        struct kvr_wire_map map;           /* MAP */
        struct kvr_wire_bias bias;         /* BIAS */
        struct kvr_wire_grammar grammar;   /* GRAMMAR */
        struct kvr_wire_draft draft;       /* DRAFT */
    };
};

enum kvr_wire_result_flag {
    KVR_WIRE_RESULT_LOGPROB = 1u << 0, /* `logprob` is set (the sequence asked for it) */
    KVR_WIRE_RESULT_EOG = 1u << 1,     /* the token ends generation in the model's vocab */
    KVR_WIRE_RESULT_FLAG_COUNT = 2
};

/* The tail's answer for one segment flagged KVR_SEG_WANTS_TOKEN (one of them, in order, for
 * a DRAFTS segment: a seq's records are consecutive). On the wire the n_top alternatives of
 * every result follow all the result records, in the results' order (wire.c), and n_top
 * travels in the record's flags (KVR_WIRE_TOP_MASK). */
struct kvr_wire_result {
    uint32_t seq;
    int32_t token;  /* sampled token id, < n_vocab */
    float logprob;  /* log-probability of `token` (<= 0) if KVR_WIRE_RESULT_LOGPROB, else 0 */
    uint32_t flags; /* enum kvr_wire_result_flag bits */
    uint32_t n_top; /* alternatives, <= KVR_LOGPROBS_MAX_TOP; only with RESULT_LOGPROB */
    struct kvr_token_logprob top[KVR_LOGPROBS_MAX_TOP]; /* ids < n_vocab, logprobs <= 0 */
};

/* One stage's account of one batch (DESIGN.md 5). Record i always comes from stage i.
 * After the stages' records come the expert agents' (ring/experts.h), one per agent a
 * stage used for the batch, appended by that stage: stage = KVR_WIRE_TIMING_AGENT | agent
 * index, the reserved field the pairs it computed; they are decoded into the frame's
 * agent_timings, apart from the stages'. */
#define KVR_WIRE_TIMING_AGENT 0x8000u
struct kvr_wire_timing {
    uint32_t stage;      /* stage index (or KVR_WIRE_TIMING_AGENT | agent index) */
    uint64_t held_ns;    /* computing this batch (apply control records + forward) */
    uint64_t starved_ns; /* idle before this batch arrived */
    uint64_t blocked_ns; /* waiting for the downstream to take the stage's previous frame */
    uint32_t pairs;      /* agent records: pairs the agent computed; stages: 0 */
};

/* ---- Limits ---------------------------------------------------------------------------- */

/* Who receives: a stage index (0 .. n_stages-1), or one of these. */
#define KVR_WIRE_RECV_BRIDGE (-1) /* the bridge, reading the tail's results */
#define KVR_WIRE_RECV_ANY (-2)    /* any legal frame of the plan (tests, fuzzing) */

struct kvr_wire_limits {
    uint32_t max_rows;    /* plan row_width */
    uint32_t max_segs;    /* min(row_width, 65535): a segment has >= 1 row */
    uint32_t max_ctrl;    /* min(max_seqs * (3 + ceil(max_blocks_per_seq / 7)), 65535): a
                             free-all probe, OPEN, REPLAY and MAP records */
    uint32_t min_timings; /* stage k receives exactly k timing records, the bridge n_stages */
    uint32_t max_timings;
    uint32_t n_agents;           /* the plan's expert agents: agent records name one of them */
    uint32_t max_agent_timings;  /* agent records a frame may carry (n_agents per stage) */
    uint32_t max_seqs;           /* seq ids are < max_seqs */
    uint32_t n_ctx;              /* pos0 + n_tokens <= n_ctx */
    uint32_t kv_blocks;          /* MAP block ids are < kv_blocks */
    uint32_t kv_block_tokens;    /* MAP n_cached is a multiple of it */
    uint32_t max_blocks_per_seq; /* ceil(n_ctx / kv_block_tokens): MAP table entries */
    uint32_t n_embd;             /* values per boundary row */
    uint32_t n_vocab;            /* token ids are < n_vocab; 0 = not checked */
    uint32_t accept_types;       /* bit (1u << type) for each frame type accepted */
    uint32_t rows_payload;       /* the plan's wire dtype: KVR_WIRE_PAYLOAD_F32/F16/BF16 */
    uint32_t batch_payload;      /* what BATCH must carry: TOKENS (head), rows_payload (other
                                    stages), or KVR_WIRE_PAYLOAD_COUNT: either (RECV_ANY) */
    uint32_t max_frame_bytes;    /* header + the largest body this receiver can get */
};

/* Limits for `receiver` in `plan` with the model's n_embd and n_vocab (0: unchecked).
 * KVR_ERANGE if the plan's largest frame would exceed KVR_WIRE_MAX_FRAME_BYTES, with a
 * message that names the product. The plan must be valid (kvr_plan_validate). */
int kvr_wire_limits_init(struct kvr_wire_limits *lim, const struct kvr_plan *plan, uint32_t n_embd,
                         uint32_t n_vocab, int receiver, struct kvr_err *err);

/* Scratch bytes kvr_wire_encode needs for any frame within `lim` (header and all records
 * except the payload rows). */
size_t kvr_wire_scratch_bytes(const struct kvr_wire_limits *lim);

/* The wire payload type of a plan dtype (F32/F16/BF16), or KVR_WIRE_PAYLOAD_COUNT. */
uint32_t kvr_wire_payload_of_dtype(enum kvr_dtype dtype);
/* Bytes of one payload element: 4 (TOKENS, F32), 2 (F16, BF16), 16 (RESULTS: a record,
 * without the alternatives that may follow), 0 (NONE). */
size_t kvr_wire_payload_elem_bytes(uint32_t payload);
const char *kvr_wire_type_name(uint32_t type);
const char *kvr_wire_payload_name(uint32_t payload);

/* ---- Decoded frames -------------------------------------------------------------------- */

/* A received frame. The arrays are owned by the struct (allocated once from the limits);
 * `payload` borrows the body buffer given to kvr_wire_decode_body. */
struct kvr_wire_frame {
    struct kvr_wire_header hdr;
    struct kvr_wire_ctrl *ctrl;            /* hdr.n_ctrl records (capacity max_ctrl) */
    struct kvr_seg *segs;                  /* hdr.n_segs records (capacity max_segs) */
    const void *payload;                   /* hdr.payload_bytes bytes in the body buffer: int32
                                              tokens, or n_rows x n_embd rows in the wire dtype */
    struct kvr_wire_result *results;       /* hdr.n_results records (capacity max_segs) */
    struct kvr_wire_timing *timings;       /* hdr.n_timings records (capacity max_timings + 1, so
                                              a stage can append its own); hdr.n_timings counts
                                              the stages' records only, once decoded */
    struct kvr_wire_timing *agent_timings; /* n_agent_timings agent records */
    uint32_t n_agent_timings, cap_agent_timings;
    uint32_t n_logit_rows; /* segments flagged WANTS_TOKEN (each wants >= 1 result) */
    uint32_t cap_ctrl, cap_segs, cap_timings;
    uint64_t *seq_seen; /* decoder scratch: one bit per seq slot */
    uint32_t cap_seqs;
};

int kvr_wire_frame_init(struct kvr_wire_frame *f, const struct kvr_wire_limits *lim,
                        struct kvr_err *err);
void kvr_wire_frame_fini(struct kvr_wire_frame *f);

/* Decode and validate a header (exactly KVR_WIRE_HEADER_BYTES bytes) against `lim`: magic,
 * checksum, known type accepted by this receiver, payload type consistent with the frame
 * type, every count within its limit, the payload length exactly what the counts and dtype
 * imply, the body length exactly the sum of its sections, and the frame no larger than
 * lim->max_frame_bytes. Returns KVR_EPROTO with a message on any violation. Only after it
 * succeeds may the caller read hdr->body_bytes more bytes. */
int kvr_wire_decode_header(const uint8_t *bytes, const struct kvr_wire_limits *lim,
                           struct kvr_wire_header *hdr, struct kvr_err *err);

/* Decode and validate the body (`len` must equal hdr->body_bytes) of a frame whose header
 * passed kvr_wire_decode_header with the same limits, into `f` (initialised from limits at
 * least as large). Checks: control records (known type and flags, seq in range, sampling
 * parameters finite and in range, unused fields zero), segments (n_tokens >= 1, seq in
 * range and not repeated, pos0 + n_tokens <= n_ctx, known flags in a legal combination,
 * rows summing to n_rows), token ids (< n_vocab), result records (one per WANTS_TOKEN
 * segment, same seq, in order), timing records (record i from stage i). `body` should be
 * 16-byte aligned: the payload then starts 16-byte aligned and f32 rows or int32 tokens can
 * be used in place. f->payload points into `body`. KVR_EPROTO with a message on any
 * violation (f's contents are then unspecified). */
int kvr_wire_decode_body(struct kvr_wire_frame *f, const struct kvr_wire_header *hdr,
                         const uint8_t *body, size_t len, const struct kvr_wire_limits *lim,
                         struct kvr_err *err);

/* Append a timing record to a received frame (capacity is max_timings + 1). */
int kvr_wire_frame_append_timing(struct kvr_wire_frame *f, const struct kvr_wire_timing *t,
                                 struct kvr_err *err);

/* ---- Encoding -------------------------------------------------------------------------- */

/* A frame to send. All pointers are borrowed for the duration of kvr_wire_encode and, for
 * payload_data, until the iovecs have been written. */
struct kvr_wire_msg {
    uint32_t type; /* enum kvr_wire_type */
    uint32_t arg;  /* GOODBYE: reason; RESET: the stage that dropped its sequences */
    uint64_t batch_id;
    const struct kvr_wire_ctrl *ctrl;
    uint32_t n_ctrl;
    const struct kvr_seg *segs; /* n_rows is computed from these */
    uint32_t n_segs;
    uint32_t payload;         /* enum kvr_wire_payload */
    const void *payload_data; /* TOKENS / F32 / F16 / BF16: the bytes as they go on
                                 the wire (little-endian), sent without a copy */
    size_t payload_bytes;
    const struct kvr_wire_result *results; /* RESULTS: encoded into the scratch buffer */
    uint32_t n_results;
    const struct kvr_wire_timing *timings;
    uint32_t n_timings;
    const struct kvr_wire_timing *agent_timings; /* sent after the stages' records */
    uint32_t n_agent_timings;
};

/* Encode `msg`: header and records into `scratch` (cap bytes; kvr_wire_scratch_bytes of the
 * receiver's limits is always enough), then iov[0..*n_iov) = records, payload (pointing at
 * msg->payload_data), timing records (also in scratch). *frame_bytes = total length. Checks
 * what the encoder can know without limits: counts fit the header, the payload type fits
 * the frame type, payload length is a whole number of rows, result records only in RESULT.
 * The receiver checks the rest. */
int kvr_wire_encode(const struct kvr_wire_msg *msg, uint8_t *scratch, size_t cap,
                    struct iovec iov[KVR_WIRE_MAX_IOV], int *n_iov, size_t *frame_bytes,
                    struct kvr_err *err);

/* The same into one contiguous buffer (copies the payload); for tests, corpora and tools. */
int kvr_wire_encode_flat(const struct kvr_wire_msg *msg, uint8_t *out, size_t cap,
                         size_t *frame_bytes, struct kvr_err *err);

/* Fill `msg` to forward a received frame: same batch id, control records, segments and
 * timing records (including any appended since it was received). The caller sets type
 * (BATCH to the next stage, RESULT from the tail) and the payload fields. */
void kvr_wire_msg_forward(struct kvr_wire_msg *msg, const struct kvr_wire_frame *f);

/* ---- Boundary rows --------------------------------------------------------------------- */

/* Convert n floats to the wire dtype `payload` (F32, F16 or BF16; round-to-nearest-even)
 * and back. dst and src may be unaligned. For F32 on a little-endian host the rows can be
 * sent and used in place instead. */
void kvr_wire_rows_from_f32(uint32_t payload, const float *src, size_t n, void *dst);
void kvr_wire_rows_to_f32(uint32_t payload, const void *src, size_t n, float *dst);

/* ---- Little-endian helpers (also used by auth.c) ---------------------------------------- */

static inline uint16_t kvr_ld16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}
static inline uint32_t kvr_ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t kvr_ld64(const uint8_t *p)
{
    return (uint64_t)kvr_ld32(p) | (uint64_t)kvr_ld32(p + 4) << 32;
}
static inline void kvr_st16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void kvr_st32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void kvr_st64(uint8_t *p, uint64_t v)
{
    kvr_st32(p, (uint32_t)v);
    kvr_st32(p + 4, (uint32_t)(v >> 32));
}
static inline float kvr_ldf32(const uint8_t *p)
{
    uint32_t u = kvr_ld32(p);
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline void kvr_stf32(uint8_t *p, float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    kvr_st32(p, u);
}

/* CRC-32C (Castagnoli) of n bytes: the header checksum. */
uint32_t kvr_crc32c(const void *data, size_t n);

#endif
