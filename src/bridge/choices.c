/* choices.c - the n > 1 choices of one request (see choices.h). Reading order: set-up and
 * submit, events, answers (JSON, then SSE), the end. */
#include "bridge/choices.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/sbuf.h"

#include <string.h>

/* Waiting for events takes turns between the choices' streams of this many ms. */
enum { TURN_MS = 5 };

struct kvr_choices {
    uint32_t n;
    struct kvr_generation *g[KVR_OPENAI_MAX_N]; /* choice i */
    uint32_t turn;                              /* the choice waited on next */
    uint32_t cur;    /* SSE: the choice whose bytes are being read (whole events) */
    bool failed;     /* a choice failed: the others were ended */
    bool tail_built; /* SSE: usage and [DONE] are in `tail` */
    struct kvr_sbuf tail;
    size_t tail_pos;
};

int kvr_choices_create(struct kvr_choices **out, const struct kvr_generation_env *env,
                       enum kvr_openai_api api, uint64_t t_start_ns,
                       const struct kvr_generation *first, uint32_t n, const char *body, size_t len,
                       const char *budget_header, struct kvr_openai_error *e)
{
    struct kvr_choices *c = kvr_calloc(1, sizeof *c);
    if (!c || n > KVR_OPENAI_MAX_N) {
        kvr_free(c);
        return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    }
    kvr_sbuf_init(&c->tail);
    *out = c;
    for (uint32_t i = 0; i < n; i++) {
        if (!(c->g[i] = kvr_generation_create(env, api, t_start_ns)))
            return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        c->n = i + 1;
        int rc = kvr_generation_prepare_choice(c->g[i], first, i, body, len, budget_header, e);
        if (rc)
            return rc;
        if (i > 0)
            kvr_generation_follow(c->g[i], c->g[0]);
    }
    return KVR_OK;
}

int kvr_choices_submit(struct kvr_choices *c, struct kvr_openai_error *e, uint32_t *retry_after_s)
{
    for (uint32_t i = 0; i < c->n; i++) {
        int rc = kvr_generation_submit(c->g[i], e, retry_after_s);
        if (rc) { /* all or none: the ones admitted are cancelled */
            for (uint32_t k = 0; k < i; k++)
                kvr_generation_abandon(c->g[k]);
            return rc;
        }
    }
    return KVR_OK;
}

/* ---- events --------------------------------------------------------------------------- */

bool kvr_choices_done(const struct kvr_choices *c)
{
    for (uint32_t i = 0; i < c->n; i++)
        if (!kvr_generation_done(c->g[i]))
            return false;
    return true;
}

/* One choice failed: the request fails, so the others stop. */
static void end_on_failure(struct kvr_choices *c)
{
    if (c->failed || !kvr_choices_error(c))
        return;
    c->failed = true;
    for (uint32_t i = 0; i < c->n; i++)
        if (!kvr_generation_done(c->g[i]))
            kvr_generation_abandon(c->g[i]);
}

bool kvr_choices_pump(struct kvr_choices *c, uint32_t timeout_ms)
{
    uint64_t end = kvr_now_ns() + (uint64_t)timeout_ms * 1000000;
    for (;;) {
        bool any = false, open = false;
        for (uint32_t i = 0; i < c->n; i++)
            if (!kvr_generation_done(c->g[i])) {
                open = true;
                any = kvr_generation_pump(c->g[i], 0) || any;
            }
        uint64_t now = kvr_now_ns();
        if (any || !open || now >= end) {
            end_on_failure(c);
            return any || !open;
        }
        for (uint32_t k = 0; k < c->n && kvr_generation_done(c->g[c->turn % c->n]); k++)
            c->turn++;
        uint64_t left_ms = (end - now) / 1000000;
        uint32_t slice = left_ms < TURN_MS ? (uint32_t)left_ms : TURN_MS;
        if (kvr_generation_pump(c->g[c->turn++ % c->n], slice)) {
            end_on_failure(c);
            return true;
        }
    }
}

void kvr_choices_shut_down(struct kvr_choices *c)
{
    bool told = false; /* one error event tells the client */
    for (uint32_t i = 0; i < c->n; i++) {
        if (kvr_generation_done(c->g[i]))
            continue;
        if (told) {
            kvr_generation_abandon(c->g[i]);
        } else {
            kvr_generation_shut_down(c->g[i]);
            told = true;
        }
    }
    c->failed = true;
}

void kvr_choices_abandon(struct kvr_choices *c)
{
    for (uint32_t i = 0; i < c->n; i++)
        if (!kvr_generation_done(c->g[i]))
            kvr_generation_abandon(c->g[i]);
}

const struct kvr_openai_error *kvr_choices_error(const struct kvr_choices *c)
{
    for (uint32_t i = 0; i < c->n; i++) {
        const struct kvr_openai_error *e = kvr_generation_error(c->g[i]);
        if (e)
            return e;
    }
    return NULL;
}

static uint32_t completion_tokens(const struct kvr_choices *c)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->n; i++)
        n += kvr_generation_completion_tokens(c->g[i]);
    return n;
}

/* ---- answers -------------------------------------------------------------------------- */

/* Choice 0's body with every choice's entry in choices[] and the usage summed: the bodies
 * are each choice's own (kvr_generation_json), so whatever a choice carries comes along. */
char *kvr_choices_json(const struct kvr_choices *c, uint32_t prompt_tokens, size_t *out_len)
{
    json_t *root = NULL, *list = json_array();
    for (uint32_t i = 0; list && i < c->n; i++) {
        size_t len = 0;
        char *body = kvr_generation_json(c->g[i], &len);
        json_t *j = body ? json_loadb(body, len, 0, NULL) : NULL;
        kvr_free(body);
        json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
        if (!choice || json_array_append(list, choice)) {
            json_decref(j);
            goto fail;
        }
        if (root)
            json_decref(j);
        else
            root = j;
    }
    uint32_t done = completion_tokens(c);
    if (!root)
        goto fail;
    if (json_object_set_new(root, "choices", list) ||
        json_object_set_new(root, "usage",
                            json_pack("{s:I,s:I,s:I}", "prompt_tokens", (json_int_t)prompt_tokens,
                                      "completion_tokens", (json_int_t)done, "total_tokens",
                                      (json_int_t)prompt_tokens + done))) {
        list = NULL; /* set_new took it */
        goto fail;
    }
    size_t n = json_dumpb(root, NULL, 0, JSON_COMPACT | JSON_REAL_PRECISION(9));
    char *out = n ? kvr_malloc(n + 1) : NULL;
    if (out) {
        json_dumpb(root, out, n, JSON_COMPACT | JSON_REAL_PRECISION(9));
        out[n] = 0;
        *out_len = n;
    }
    json_decref(root);
    return out;
fail:
    json_decref(list);
    json_decref(root);
    return NULL;
}

/* After every choice's chunks: the usage (when asked for, and nothing failed) and [DONE]. */
static enum kvr_generation_sse read_tail(struct kvr_choices *c, const struct kvr_openai_meta *m,
                                         uint32_t prompt_tokens, char *buf, size_t max,
                                         size_t *out_n)
{
    if (!c->tail_built) {
        if (m->include_usage && !c->failed && !kvr_choices_error(c))
            kvr_openai_sse_usage(&c->tail, m, prompt_tokens, completion_tokens(c));
        kvr_openai_sse_done(&c->tail);
        c->tail_built = true;
    }
    if (c->tail.failed)
        return KVR_GENERATION_SSE_BROKEN;
    if (c->tail_pos >= c->tail.len)
        return KVR_GENERATION_SSE_END;
    size_t n = c->tail.len - c->tail_pos < max ? c->tail.len - c->tail_pos : max;
    memcpy(buf, c->tail.data + c->tail_pos, n);
    c->tail_pos += n;
    *out_n = n;
    return KVR_GENERATION_SSE_BYTES;
}

/* A choice's bytes are read until it has none left before another's, so events never
 * interleave (a choice only makes new ones when pumped, which waits for EMPTY). */
enum kvr_generation_sse kvr_choices_sse_read(struct kvr_choices *c, const struct kvr_openai_meta *m,
                                             uint32_t prompt_tokens, char *buf, size_t max,
                                             size_t *out_n)
{
    *out_n = 0;
    bool all_ended = true;
    for (uint32_t k = 0; k < c->n; k++) {
        uint32_t i = (c->cur + k) % c->n;
        enum kvr_generation_sse r = kvr_generation_sse_read(c->g[i], buf, max, out_n);
        if (r == KVR_GENERATION_SSE_BYTES) {
            c->cur = i;
            return r;
        }
        if (r == KVR_GENERATION_SSE_BROKEN)
            return r;
        if (r == KVR_GENERATION_SSE_EMPTY && !kvr_generation_done(c->g[i]))
            all_ended = false;
    }
    if (!all_ended)
        return KVR_GENERATION_SSE_EMPTY;
    return read_tail(c, m, prompt_tokens, buf, max, out_n);
}

bool kvr_choices_estimate(const struct kvr_choices *c, double *first_ms, double *total_ms,
                          uint64_t *request_id)
{
    return kvr_generation_estimate(c->g[0], first_ms, total_ms, request_id);
}

/* ---- the end -------------------------------------------------------------------------- */

void kvr_choices_destroy(struct kvr_choices *c, struct kvr_generation *request)
{
    if (!c)
        return;
    for (uint32_t i = 0; i < c->n; i++) {
        if (!kvr_generation_done(c->g[i]))
            kvr_generation_abandon(c->g[i]);
        kvr_generation_absorb(request, c->g[i]);
        kvr_generation_destroy(c->g[i]);
    }
    kvr_sbuf_fini(&c->tail);
    kvr_free(c);
}
