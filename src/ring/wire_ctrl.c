/* wire_ctrl.c - a frame's control records, read and written (wire_int.h; the frame around
 * them is wire.c's, docs/PROTOCOL.md the whole protocol).
 *
 * Control record (48 bytes)
 *     0   2  type           enum kvr_wire_ctrl_type: 1 OPEN, 2 FREE, 3 CANCEL, 4 REPLAY,
 *                           5 MAP, 6 BIAS, 7 GRAMMAR, 8 DRAFT
 *     2   2  flags          OPEN: bit 0 = results carry logprobs, bits 8..12 = how many
 *                           alternatives each result carries (0..20, only with bit 0);
 *                           otherwise 0
 *     4   4  seq
 *   OPEN, FREE, CANCEL:
 *     8   4  temperature    f32  \
 *    12   4  top_k          i32   |
 *    16   4  top_p          f32   |
 *    20   4  min_p          f32   |  OPEN only (struct kvr_sample_params,
 *    24   4  repeat_penalty f32   |  but its biases: BIAS carries those);
 *    28   4  freq_penalty   f32   |  all zero for FREE and CANCEL
 *    32   4  pres_penalty   f32   |
 *    36   4  repeat_last_n  i32   |
 *    40   8  seed           u64  /
 *   REPLAY (struct kvr_wire_replay):
 *     8   4  n_draws        u32, <= n_ctx: numbers the tail draws and discards
 *    12   4  n_ids          u32, <= 8
 *    16  32  ids            8 x i32: tokens for the penalty window, < n_vocab; 0 past n_ids
 *   MAP (struct kvr_wire_map; flags 0):
 *     8   4  n_cached       u32: positions already in the blocks, a multiple of the block
 *                           size, <= ceil(n_ctx / block) blocks; the same in every record
 *                           of one opening (the stage checks it against the mapped blocks
 *                           before the sequence runs)
 *    12   4  first          u32: table entry of ids[0]; first + n_ids <= ceil(n_ctx / block)
 *    16   4  n_ids          u32, 1..7
 *    20  28  ids            7 x u32: block ids, < kv_blocks; 0 past n_ids
 *   BIAS (struct kvr_wire_bias; flags 0):
 *     8   4  n              u32, 1..4
 *    12  16  ids            4 x i32: token ids, < n_vocab; 0 past n
 *    28  16  bias           4 x f32: [-100, 100]; 0 past n
 *    44   4  reserved       0
 *   GRAMMAR (struct kvr_wire_grammar; flags 0):
 *     8   4  offset         u32: a multiple of 32, < total
 *    12   4  total          u32: the text's bytes, 1 ..= 262144
 *    16  32  text           min(32, total - offset) bytes of GBNF; 0 past them
 *   DRAFT (struct kvr_wire_draft; flags 0):
 *     8   4  n_ids          u32, 1..9
 *    12  36  ids            9 x i32: drafted tokens, < n_vocab; 0 past n_ids
 */
#include "ring/wire_int.h"

#include <math.h>
#include <string.h>

#define PROTO(...) kvr_err_set(err, KVR_EPROTO, __VA_ARGS__)

/* ---- reading ----------------------------------------------------------------------------- */

static bool all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return false;
    return true;
}

static bool in_range(float x, float lo, float hi)
{
    return isfinite(x) && x >= lo && x <= hi;
}

/* Each record kind after its common part (type, flags, seq): read it into its member of
 * the union and check it. */
static int decode_replay(const uint8_t *p, uint32_t i, const struct kvr_wire_limits *lim,
                         struct kvr_wire_ctrl *c, struct kvr_err *err)
{
    struct kvr_wire_replay *r = &c->replay;
    r->n_draws = kvr_ld32(p + 8);
    r->n_ids = kvr_ld32(p + 12);
    if (c->flags)
        return PROTO("control record %u (REPLAY seq %u) has flags 0x%x", i, c->seq, c->flags);
    if (r->n_draws > lim->n_ctx)
        return PROTO("control record %u (REPLAY seq %u): %u draws, but a sequence samples "
                     "at most n_ctx (%u) tokens",
                     i, c->seq, r->n_draws, lim->n_ctx);
    if (r->n_ids > KVR_WIRE_REPLAY_IDS)
        return PROTO("control record %u (REPLAY seq %u): %u token ids, at most %d", i, c->seq,
                     r->n_ids, KVR_WIRE_REPLAY_IDS);
    for (uint32_t k = 0; k < KVR_WIRE_REPLAY_IDS; k++) {
        r->ids[k] = (int32_t)kvr_ld32(p + 16 + 4 * k);
        if (k >= r->n_ids ? r->ids[k] != 0
                          : r->ids[k] < 0 || (lim->n_vocab && (uint32_t)r->ids[k] >= lim->n_vocab))
            return PROTO("control record %u (REPLAY seq %u): token id %d at %u is %s", i, c->seq,
                         r->ids[k], k,
                         k >= r->n_ids ? "past n_ids and not 0" : "outside the vocabulary");
    }
    return KVR_OK;
}

static int decode_map(const uint8_t *p, uint32_t i, const struct kvr_wire_limits *lim,
                      struct kvr_wire_ctrl *c, struct kvr_err *err)
{
    struct kvr_wire_map *m = &c->map;
    m->n_cached = kvr_ld32(p + 8);
    m->first = kvr_ld32(p + 12);
    m->n_ids = kvr_ld32(p + 16);
    if (c->flags)
        return PROTO("control record %u (MAP seq %u) has flags 0x%x", i, c->seq, c->flags);
    if (m->n_ids == 0 || m->n_ids > KVR_WIRE_MAP_IDS || m->first >= lim->max_blocks_per_seq ||
        m->n_ids > lim->max_blocks_per_seq - m->first)
        return PROTO("control record %u (MAP seq %u): entries %u + %u, a sequence has at "
                     "most %u blocks",
                     i, c->seq, m->first, m->n_ids, lim->max_blocks_per_seq);
    if (m->n_cached % lim->kv_block_tokens ||
        m->n_cached / lim->kv_block_tokens > lim->max_blocks_per_seq)
        return PROTO("control record %u (MAP seq %u): %u cached positions, a sequence "
                     "has at most %u blocks of %u",
                     i, c->seq, m->n_cached, lim->max_blocks_per_seq, lim->kv_block_tokens);
    for (uint32_t k = 0; k < KVR_WIRE_MAP_IDS; k++) {
        m->ids[k] = kvr_ld32(p + 20 + 4 * k);
        if (k >= m->n_ids ? m->ids[k] != 0 : m->ids[k] >= lim->kv_blocks)
            return PROTO("control record %u (MAP seq %u): block id %u at %u is %s", i, c->seq,
                         m->ids[k], k, k >= m->n_ids ? "past n_ids and not 0" : "beyond kv_blocks");
    }
    return KVR_OK;
}

static int decode_bias(const uint8_t *p, uint32_t i, const struct kvr_wire_limits *lim,
                       struct kvr_wire_ctrl *c, struct kvr_err *err)
{
    struct kvr_wire_bias *b = &c->bias;
    b->n = kvr_ld32(p + 8);
    if (c->flags || b->n < 1 || b->n > KVR_WIRE_BIAS_PAIRS || !all_zero(p + 44, 4))
        return PROTO("control record %u (BIAS seq %u): flags 0x%x, %u pairs (1..%d)", i, c->seq,
                     c->flags, b->n, KVR_WIRE_BIAS_PAIRS);
    for (uint32_t k = 0; k < KVR_WIRE_BIAS_PAIRS; k++) {
        b->ids[k] = (int32_t)kvr_ld32(p + 12 + 4 * k);
        b->bias[k] = kvr_ldf32(p + 28 + 4 * k);
        bool ok = k >= b->n
                      ? b->ids[k] == 0 && kvr_ld32(p + 28 + 4 * k) == 0
                      : b->ids[k] >= 0 && (!lim->n_vocab || (uint32_t)b->ids[k] < lim->n_vocab) &&
                            in_range(b->bias[k], -100.0f, 100.0f);
        if (!ok)
            return PROTO("control record %u (BIAS seq %u): pair %u (token %d, %g) is %s", i, c->seq,
                         k, b->ids[k], (double)b->bias[k],
                         k >= b->n ? "past n and not 0" : "out of range");
    }
    return KVR_OK;
}

static int decode_grammar(const uint8_t *p, uint32_t i, struct kvr_wire_ctrl *c,
                          struct kvr_err *err)
{
    struct kvr_wire_grammar *g = &c->grammar;
    g->offset = kvr_ld32(p + 8);
    g->total = kvr_ld32(p + 12);
    if (c->flags || g->total < 1 || g->total > KVR_WIRE_GRAMMAR_MAX_TOTAL ||
        g->offset >= g->total || g->offset % KVR_WIRE_GRAMMAR_BYTES)
        return PROTO("control record %u (GRAMMAR seq %u): flags 0x%x, offset %u of %u bytes", i,
                     c->seq, c->flags, g->offset, g->total);
    uint32_t n = g->total - g->offset;
    n = n < KVR_WIRE_GRAMMAR_BYTES ? n : KVR_WIRE_GRAMMAR_BYTES;
    memcpy(g->text, p + 16, KVR_WIRE_GRAMMAR_BYTES);
    if (!all_zero(p + 16 + n, KVR_WIRE_GRAMMAR_BYTES - n))
        return PROTO("control record %u (GRAMMAR seq %u): bytes past the text are not 0", i,
                     c->seq);
    return KVR_OK;
}

static int decode_draft(const uint8_t *p, uint32_t i, const struct kvr_wire_limits *lim,
                        struct kvr_wire_ctrl *c, struct kvr_err *err)
{
    struct kvr_wire_draft *d = &c->draft;
    d->n_ids = kvr_ld32(p + 8);
    if (c->flags || d->n_ids < 1 || d->n_ids > KVR_WIRE_DRAFT_IDS)
        return PROTO("control record %u (DRAFT seq %u): flags 0x%x, %u ids (1..%d)", i, c->seq,
                     c->flags, d->n_ids, KVR_WIRE_DRAFT_IDS);
    for (uint32_t k = 0; k < KVR_WIRE_DRAFT_IDS; k++) {
        d->ids[k] = (int32_t)kvr_ld32(p + 12 + 4 * k);
        if (k >= d->n_ids ? d->ids[k] != 0
                          : d->ids[k] < 0 || (lim->n_vocab && (uint32_t)d->ids[k] >= lim->n_vocab))
            return PROTO("control record %u (DRAFT seq %u): token id %d at %u is %s", i, c->seq,
                         d->ids[k], k,
                         k >= d->n_ids ? "past n_ids and not 0" : "outside the vocabulary");
    }
    return KVR_OK;
}

/* OPEN: the sampling parameters, in the ranges wire.h gives (n_bias stays 0). */
static int decode_open(const uint8_t *p, uint32_t i, const struct kvr_wire_limits *lim,
                       struct kvr_wire_ctrl *c, struct kvr_err *err)
{
    uint32_t top = (c->flags & KVR_WIRE_TOP_MASK) >> KVR_WIRE_TOP_SHIFT;
    if (c->flags & ~(((1u << KVR_WIRE_OPEN_FLAG_COUNT) - 1) | KVR_WIRE_TOP_MASK) ||
        top > KVR_LOGPROBS_MAX_TOP || (top && !(c->flags & KVR_WIRE_OPEN_LOGPROBS)))
        return PROTO("control record %u (OPEN seq %u) has unknown flags 0x%x (or more than %d "
                     "alternatives, or alternatives without logprobs)",
                     i, c->seq, c->flags, KVR_LOGPROBS_MAX_TOP);
    struct kvr_sample_params *s = &c->sampling;
    s->temperature = kvr_ldf32(p + 8);
    s->top_k = (int32_t)kvr_ld32(p + 12);
    s->top_p = kvr_ldf32(p + 16);
    s->min_p = kvr_ldf32(p + 20);
    s->repeat_penalty = kvr_ldf32(p + 24);
    s->frequency_penalty = kvr_ldf32(p + 28);
    s->presence_penalty = kvr_ldf32(p + 32);
    s->repeat_last_n = (int32_t)kvr_ld32(p + 36);
    s->seed = kvr_ld64(p + 40);
    const char *bad = NULL;
    if (!in_range(s->temperature, 0.0f, 100.0f))
        bad = "temperature (0..100)";
    else if (s->top_k < 0)
        bad = "top_k (>= 0)";
    else if (!in_range(s->top_p, 0.0f, 1.0f))
        bad = "top_p (0..1)";
    else if (!in_range(s->min_p, 0.0f, 1.0f))
        bad = "min_p (0..1)";
    else if (!in_range(s->repeat_penalty, 0.0f, 100.0f) || s->repeat_penalty == 0.0f)
        bad = "repeat_penalty (> 0, <= 100)";
    else if (!in_range(s->frequency_penalty, -100.0f, 100.0f))
        bad = "frequency_penalty (-100..100)";
    else if (!in_range(s->presence_penalty, -100.0f, 100.0f))
        bad = "presence_penalty (-100..100)";
    else if (s->repeat_last_n < -1 || (int64_t)s->repeat_last_n > (int64_t)lim->n_ctx)
        bad = "repeat_last_n (-1..n_ctx)";
    if (bad)
        return PROTO("control record %u (OPEN seq %u): %s out of range", i, c->seq, bad);
    return KVR_OK;
}

int kvr_wire_ctrl_decode(const uint8_t *p, uint32_t i, const struct kvr_wire_limits *lim,
                         struct kvr_wire_ctrl *c, struct kvr_err *err)
{
    memset(c, 0, sizeof *c);
    c->type = kvr_ld16(p);
    c->flags = kvr_ld16(p + 2);
    c->seq = kvr_ld32(p + 4);
    if (c->type == 0 || c->type >= KVR_WIRE_CTRL_TYPE_COUNT)
        return PROTO("control record %u has unknown type %u", i, c->type);
    if (c->seq >= lim->max_seqs)
        return PROTO("control record %u names seq %u; the plan has %u sequence slots", i, c->seq,
                     lim->max_seqs);
    switch (c->type) {
    case KVR_WIRE_CTRL_REPLAY:
        return decode_replay(p, i, lim, c, err);
    case KVR_WIRE_CTRL_MAP:
        return decode_map(p, i, lim, c, err);
    case KVR_WIRE_CTRL_BIAS:
        return decode_bias(p, i, lim, c, err);
    case KVR_WIRE_CTRL_GRAMMAR:
        return decode_grammar(p, i, c, err);
    case KVR_WIRE_CTRL_DRAFT:
        return decode_draft(p, i, lim, c, err);
    case KVR_WIRE_CTRL_OPEN:
        return decode_open(p, i, lim, c, err);
    default: /* FREE, CANCEL: nothing but the seq */
        if (c->flags || !all_zero(p + 8, KVR_WIRE_CTRL_BYTES - 8))
            return PROTO("control record %u (%s seq %u) has nonzero unused fields", i,
                         c->type == KVR_WIRE_CTRL_FREE ? "FREE" : "CANCEL", c->seq);
        return KVR_OK;
    }
}

/* ---- writing ----------------------------------------------------------------------------- */

uint8_t *kvr_wire_ctrl_put(uint8_t *p, const struct kvr_wire_ctrl *c)
{
    memset(p, 0, KVR_WIRE_CTRL_BYTES);
    kvr_st16(p, (uint16_t)c->type);
    kvr_st16(p + 2, (uint16_t)c->flags);
    kvr_st32(p + 4, c->seq);
    if (c->type == KVR_WIRE_CTRL_OPEN) {
        const struct kvr_sample_params *s = &c->sampling;
        kvr_stf32(p + 8, s->temperature);
        kvr_st32(p + 12, (uint32_t)s->top_k);
        kvr_stf32(p + 16, s->top_p);
        kvr_stf32(p + 20, s->min_p);
        kvr_stf32(p + 24, s->repeat_penalty);
        kvr_stf32(p + 28, s->frequency_penalty);
        kvr_stf32(p + 32, s->presence_penalty);
        kvr_st32(p + 36, (uint32_t)s->repeat_last_n);
        kvr_st64(p + 40, s->seed);
    } else if (c->type == KVR_WIRE_CTRL_REPLAY) {
        const struct kvr_wire_replay *r = &c->replay;
        kvr_st32(p + 8, r->n_draws);
        kvr_st32(p + 12, r->n_ids);
        for (uint32_t k = 0; k < KVR_WIRE_REPLAY_IDS && k < r->n_ids; k++)
            kvr_st32(p + 16 + 4 * k, (uint32_t)r->ids[k]);
    } else if (c->type == KVR_WIRE_CTRL_MAP) {
        const struct kvr_wire_map *m = &c->map;
        kvr_st32(p + 8, m->n_cached);
        kvr_st32(p + 12, m->first);
        kvr_st32(p + 16, m->n_ids);
        for (uint32_t k = 0; k < KVR_WIRE_MAP_IDS && k < m->n_ids; k++)
            kvr_st32(p + 20 + 4 * k, m->ids[k]);
    } else if (c->type == KVR_WIRE_CTRL_BIAS) {
        const struct kvr_wire_bias *b = &c->bias;
        kvr_st32(p + 8, b->n);
        for (uint32_t k = 0; k < KVR_WIRE_BIAS_PAIRS && k < b->n; k++) {
            kvr_st32(p + 12 + 4 * k, (uint32_t)b->ids[k]);
            kvr_stf32(p + 28 + 4 * k, b->bias[k]);
        }
    } else if (c->type == KVR_WIRE_CTRL_GRAMMAR) {
        const struct kvr_wire_grammar *g = &c->grammar;
        kvr_st32(p + 8, g->offset);
        kvr_st32(p + 12, g->total);
        uint32_t n = g->total > g->offset ? g->total - g->offset : 0;
        memcpy(p + 16, g->text, n < KVR_WIRE_GRAMMAR_BYTES ? n : KVR_WIRE_GRAMMAR_BYTES);
    } else if (c->type == KVR_WIRE_CTRL_DRAFT) {
        kvr_st32(p + 8, c->draft.n_ids);
        for (uint32_t k = 0; k < KVR_WIRE_DRAFT_IDS && k < c->draft.n_ids; k++)
            kvr_st32(p + 12 + 4 * k, (uint32_t)c->draft.ids[k]);
    }
    return p + KVR_WIRE_CTRL_BYTES;
}
