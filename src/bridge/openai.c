/* openai.c - OpenAI request parsing and response formatting (see openai.h).
 *
 * Sections follow a request's life: errors, request fields, length check, responses. The
 * table of known fields is in openai_fields.c, stop strings in openai_stop.c; UTF-8 checks
 * use core/utf8.h. */
#include "bridge/openai.h"

#include "core/alloc.h"
#include "core/err.h"
#include "core/utf8.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors ------------------------------------------------------------------------- */

static void error_vset(struct kvr_openai_error *e, int status, const char *type, const char *param,
                       const char *code, const char *fmt, va_list ap)
    __attribute__((format(printf, 6, 0)));

static void error_vset(struct kvr_openai_error *e, int status, const char *type, const char *param,
                       const char *code, const char *fmt, va_list ap)
{
    e->status = status;
    e->type = type;
    e->code = code;
    if (param)
        snprintf(e->param_buf, sizeof e->param_buf, "%s", param);
    e->param = param ? e->param_buf : NULL;
    vsnprintf(e->message, sizeof e->message, fmt, ap);
}

int kvr_openai_error_set(struct kvr_openai_error *e, int status, const char *type,
                         const char *param, const char *code, const char *fmt, ...)
{
    if (!e)
        return KVR_EINVAL;
    va_list ap;
    va_start(ap, fmt);
    error_vset(e, status, type, param, code, fmt, ap);
    va_end(ap);
    return KVR_EINVAL;
}

/* json_dump_callback sink: JSON text straight into an sbuf. */
static int dump_to_sbuf(const char *buf, size_t size, void *data)
{
    struct kvr_sbuf *b = data;
    kvr_sbuf_append(b, buf, size);
    return b->failed ? -1 : 0;
}

#define DUMP_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(9))

static int dump_json(struct kvr_sbuf *out, const json_t *j)
{
    if (!j || json_dump_callback(j, dump_to_sbuf, out, DUMP_FLAGS) != 0 || out->failed)
        return KVR_ENOMEM;
    return KVR_OK;
}

/* A JSON string from bytes that should be UTF-8; anything invalid becomes U+FFFD rather
 * than making jansson refuse the whole value. */
static json_t *jstr(const char *s, size_t len)
{
    if (kvr_utf8_valid_len(s, len) == len)
        return json_stringn(s, len);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    kvr_utf8_sanitize_to(&b, s, len);
    json_t *j = b.failed ? NULL : json_stringn(b.data ? b.data : "", b.len);
    kvr_sbuf_fini(&b);
    return j;
}

static json_t *error_object(const struct kvr_openai_error *e)
{
    json_t *inner = json_object();
    json_t *outer = json_object();
    if (!inner || !outer)
        goto fail;
    const char *msg = e->message;
    if (json_object_set_new(inner, "message", jstr(msg, strlen(msg))) ||
        json_object_set_new(inner, "type", json_string(e->type ? e->type : "server_error")) ||
        json_object_set_new(inner, "param",
                            e->param ? jstr(e->param, strlen(e->param)) : json_null()) ||
        json_object_set_new(inner, "code", e->code ? json_string(e->code) : json_null()))
        goto fail;
    if (json_object_set_new(outer, "error", inner)) {
        inner = NULL;
        goto fail;
    }
    return outer;
fail:
    json_decref(inner);
    json_decref(outer);
    return NULL;
}

char *kvr_openai_error_json(const struct kvr_openai_error *e, size_t *out_len)
{
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    json_t *j = error_object(e);
    int rc = dump_json(&b, j);
    json_decref(j);
    if (rc) {
        kvr_sbuf_fini(&b);
        return NULL;
    }
    return kvr_sbuf_take(&b, out_len);
}

/* ---- requests ----------------------------------------------------------------------- */

static int bad_request(struct kvr_openai_error *e, const char *param, const char *code,
                       const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static int bad_request(struct kvr_openai_error *e, const char *param, const char *code,
                       const char *fmt, ...)
{
    if (!e)
        return KVR_EINVAL;
    va_list ap;
    va_start(ap, fmt);
    error_vset(e, 400, "invalid_request_error", param, code, fmt, ap);
    va_end(ap);
    return KVR_EINVAL;
}

static int out_of_memory(struct kvr_openai_error *e)
{
    kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return KVR_ENOMEM;
}

static const char *type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    default:
        return "null";
    }
}

/* A field that is absent or null counts as not given. */
static json_t *field(const json_t *obj, const char *key)
{
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

static int want_type(struct kvr_openai_error *e, const char *param, const json_t *v,
                     const char *what)
{
    return bad_request(e, param, "invalid_type", "'%s' must be %s, got %s", param, what,
                       type_name(v));
}

static int get_bool(const json_t *obj, const char *key, bool *out, struct kvr_openai_error *e)
{
    json_t *v = field(obj, key);
    if (!v)
        return KVR_OK;
    if (!json_is_boolean(v))
        return want_type(e, key, v, "a boolean");
    *out = json_is_true(v);
    return KVR_OK;
}

/* An integer field in [lo, hi]; *has (may be NULL) says whether it was given. */
static int get_int(const json_t *obj, const char *key, long long lo, long long hi, long long *out,
                   bool *has, struct kvr_openai_error *e)
{
    json_t *v = field(obj, key);
    if (has)
        *has = v != NULL;
    if (!v)
        return KVR_OK;
    if (!json_is_integer(v))
        return want_type(e, key, v, "an integer");
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return bad_request(e, key, "invalid_value", "'%s' must be between %lld and %lld, got %lld",
                           key, lo, hi, x);
    *out = x;
    return KVR_OK;
}

/* A number field in [lo, hi] (lo excluded when lo_open). */
static int get_num(const json_t *obj, const char *key, double lo, bool lo_open, double hi,
                   float *out, struct kvr_openai_error *e)
{
    json_t *v = field(obj, key);
    if (!v)
        return KVR_OK;
    if (!json_is_number(v))
        return want_type(e, key, v, "a number");
    double x = json_number_value(v);
    if (x > hi || (lo_open ? x <= lo : x < lo))
        return bad_request(e, key, "invalid_value", "'%s' must be %s %g and at most %g, got %g",
                           key, lo_open ? "above" : "at least", lo, hi, x);
    *out = (float)x;
    return KVR_OK;
}

static int bad_seed(struct kvr_openai_error *e)
{
    return bad_request(e, "seed", "invalid_value",
                       "'seed' must be -1 (random) or between 0 and %" PRIu64, UINT64_MAX);
}

/* The sampling fields into the sampler's own struct, with OpenAI's defaults (see openai.h):
 * no top-k, top-p or min-p cut and temperature 1, unlike the sampler's defaults. */
static int parse_sampling(struct kvr_openai_req *r, struct kvr_openai_error *e)
{
    struct kvr_sample_params *s = &r->sampling;
    const json_t *o = r->root;
    int rc;
    memset(s, 0, sizeof *s);
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->repeat_penalty = 1.0f;
    s->repeat_last_n = -1; /* the sampler's whole window: the closest to the completion */
    const char *rp_key = field(o, "repeat_penalty") ? "repeat_penalty" : "repetition_penalty";
    if ((rc = get_num(o, "temperature", 0, false, 2, &s->temperature, e)) ||
        (rc = get_num(o, "top_p", 0, false, 1, &s->top_p, e)) ||
        (rc = get_num(o, "min_p", 0, false, 1, &s->min_p, e)) ||
        (rc = get_num(o, rp_key, 0, true, 10, &s->repeat_penalty, e)) ||
        (rc = get_num(o, "frequency_penalty", -2, false, 2, &s->frequency_penalty, e)) ||
        (rc = get_num(o, "presence_penalty", -2, false, 2, &s->presence_penalty, e)))
        return rc;
    if (s->top_p <= 0.0f) {
        /* "Keep the smallest set reaching 0" is the single most likely token; the sampler
         * takes top_p only in (0, 1]. */
        s->temperature = 0.0f;
        s->top_p = 1.0f;
    }
    long long k = 0, last_n = -1;
    if ((rc = get_int(o, "top_k", -1, INT32_MAX, &k, NULL, e)) ||
        (rc = get_int(o, "repeat_last_n", -1, KVR_SAMPLER_MAX_LAST_N, &last_n, NULL, e)))
        return rc;
    s->top_k = k < 0 ? 0 : (int32_t)k;
    s->repeat_last_n = (int32_t)last_n;
    /* Seeds are unsigned 64-bit; -1 is llama.cpp's "random". Other negative numbers are
     * refused rather than wrapped: every seed can be written as itself. */
    long long seed = 0;
    json_t *v = field(o, "seed");
    if (v && json_is_integer(v) && json_integer_value(v) < -1)
        return bad_seed(e);
    if ((rc = get_int(o, "seed", -1, LLONG_MAX, &seed, &r->has_seed, e)))
        return rc;
    if (seed == -1)
        r->has_seed = false;
    s->seed = seed < 0 ? 0 : (uint64_t)seed;
    return KVR_OK;
}

/* "logit_bias": {"<token id>": bias, ...}, ids as decimal strings below n_vocab, biases in
 * [-100, 100], at most KVR_SAMPLER_MAX_BIAS of them. */
static int parse_logit_bias(struct kvr_openai_req *r, const struct kvr_openai_limits *lim,
                            struct kvr_openai_error *e)
{
    json_t *v = field(r->root, "logit_bias");
    if (!v)
        return KVR_OK;
    if (!json_is_object(v))
        return want_type(e, "logit_bias", v, "an object mapping token ids to biases");
    if (json_object_size(v) > KVR_SAMPLER_MAX_BIAS)
        return bad_request(e, "logit_bias", "invalid_value",
                           "'logit_bias' has %zu entries; at most %d are supported",
                           json_object_size(v), KVR_SAMPLER_MAX_BIAS);
    struct kvr_sample_params *s = &r->sampling;
    const char *key;
    json_t *b;
    json_object_foreach(v, key, b)
    {
        char *end;
        errno = 0;
        long long id = strtoll(key, &end, 10);
        if (!*key || *end || errno || id < 0 || (lim && id >= (long long)lim->n_vocab))
            return bad_request(e, "logit_bias", "invalid_value",
                               "'logit_bias' key '%.40s' is not a token id of this model "
                               "(0 .. %u)",
                               key, lim ? lim->n_vocab - 1 : 0);
        if (!json_is_number(b) || !(json_number_value(b) >= -100 && json_number_value(b) <= 100))
            return bad_request(e, "logit_bias", "invalid_value",
                               "'logit_bias' of token %lld must be a number in [-100, 100]", id);
        for (uint32_t i = 0; i < s->n_bias; i++)
            if (s->bias[i].id == id)
                return bad_request(e, "logit_bias", "invalid_value",
                                   "'logit_bias' names token %lld twice", id);
        s->bias[s->n_bias++] = (struct kvr_logit_bias){(int32_t)id, (float)json_number_value(b)};
    }
    return KVR_OK;
}

static int parse_stop(struct kvr_openai_req *r, struct kvr_openai_error *e)
{
    json_t *v = field(r->root, "stop");
    if (!v)
        return KVR_OK;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > KVR_OPENAI_MAX_STOP)
            return bad_request(e, "stop", "invalid_value",
                               "'stop' may hold at most %d strings, got %zu", KVR_OPENAI_MAX_STOP,
                               n);
        items = NULL;
    } else if (!json_is_string(v)) {
        return want_type(e, "stop", v, "a string or an array of strings");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = items ? items[i] : json_array_get(v, i);
        char param[64];
        snprintf(param, sizeof param, items ? "stop" : "stop[%zu]", i);
        if (!json_is_string(s))
            return want_type(e, param, s, "a string");
        size_t len = json_string_length(s);
        if (len == 0)
            return bad_request(e, param, "invalid_value", "'%s' must not be empty", param);
        if (len > KVR_OPENAI_MAX_STOP_BYTES)
            return bad_request(e, param, "invalid_value", "'%s' is %zu bytes long; the limit is %d",
                               param, len, KVR_OPENAI_MAX_STOP_BYTES);
        r->stop[r->n_stop] = json_string_value(s);
        r->stop_len[r->n_stop] = len;
        r->n_stop++;
    }
    return KVR_OK;
}

static int parse_budget(struct kvr_openai_req *r, struct kvr_openai_error *e)
{
    json_t *b = field(r->root, "latency_budget");
    if (!b)
        return KVR_OK;
    if (!json_is_object(b))
        return want_type(e, "latency_budget", b, "an object");
    static const char *const keys[3] = {"first_token_ms", "total_ms", NULL};
    int rc = kvr_openai_check_keys(b, "latency_budget", keys, e);
    if (rc)
        return rc;
    uint32_t *outs[2] = {&r->first_token_ms, &r->total_ms};
    for (int i = 0; i < 2; i++) {
        char param[64];
        snprintf(param, sizeof param, "latency_budget.%s", keys[i]);
        json_t *v = field(b, keys[i]);
        if (!v)
            continue;
        if (!json_is_integer(v))
            return want_type(e, param, v, "an integer (milliseconds)");
        long long x = json_integer_value(v);
        if (x < 1 || x > KVR_OPENAI_MAX_BUDGET_MS)
            return bad_request(e, param, "invalid_value",
                               "'%s' must be between 1 and %d milliseconds, got %lld", param,
                               KVR_OPENAI_MAX_BUDGET_MS, x);
        *outs[i] = (uint32_t)x;
    }
    if (r->first_token_ms && r->total_ms && r->first_token_ms > r->total_ms)
        return bad_request(e, "latency_budget.first_token_ms", "invalid_value",
                           "'latency_budget.first_token_ms' (%u ms) exceeds "
                           "'latency_budget.total_ms' (%u ms)",
                           r->first_token_ms, r->total_ms);
    return KVR_OK;
}

/* Requests for features Kvasir does not have are refused, not silently ignored: a client
 * that asked for three choices and got one would be misled. Reads "n" on the way. */
static int refuse_unsupported(struct kvr_openai_req *r, struct kvr_openai_error *e)
{
    const json_t *o = r->root;
    json_t *v;
    long long n = 1;
    if ((v = field(o, "n"))) {
        if (!json_is_integer(v))
            return want_type(e, "n", v, "an integer");
        n = json_integer_value(v);
        if (n < 1 || n > KVR_OPENAI_MAX_N)
            return bad_request(e, "n", "invalid_value", "'n' must be 1 to %d, got %lld",
                               KVR_OPENAI_MAX_N, n);
    }
    r->n = (uint32_t)n;
    if ((v = field(o, "best_of")) && !(json_is_integer(v) && json_integer_value(v) == 1))
        return bad_request(e, "best_of", "unsupported_parameter",
                           "'best_of' other than 1 is not supported");
    if ((v = field(o, "echo")) && !json_is_false(v))
        return bad_request(e, "echo", "unsupported_parameter", "'echo' is not supported");
    if ((v = field(o, "suffix")) && !(json_is_string(v) && json_string_length(v) == 0))
        return bad_request(e, "suffix", "unsupported_parameter", "'suffix' is not supported");
    if ((v = field(o, "functions")) && !(json_is_array(v) && json_array_size(v) == 0))
        return bad_request(e, "functions", "unsupported_parameter",
                           "'functions' are not supported");
    return KVR_OK;
}

static int parse_logprobs(struct kvr_openai_req *r, struct kvr_openai_error *e)
{
    const json_t *o = r->root;
    int rc;
    if (r->api == KVR_OPENAI_COMPLETIONS) {
        json_t *v = field(o, "logprobs");
        if (!v)
            return KVR_OK;
        if (!json_is_integer(v))
            return want_type(e, "logprobs", v, "an integer");
        long long n = json_integer_value(v);
        if (n < 0 || n > KVR_OPENAI_MAX_TOP)
            return bad_request(e, "logprobs", "invalid_value",
                               "'logprobs' must be 0 to %d, got %lld", KVR_OPENAI_MAX_TOP, n);
        r->logprobs = true;
        r->top_logprobs = (uint32_t)n;
        return KVR_OK;
    }
    if ((rc = get_bool(o, "logprobs", &r->logprobs, e)))
        return rc;
    long long top = 0;
    bool has_top = false;
    if ((rc = get_int(o, "top_logprobs", 0, KVR_OPENAI_MAX_TOP, &top, &has_top, e)))
        return rc;
    if (has_top && !r->logprobs)
        return bad_request(e, "top_logprobs", "invalid_value",
                           "'top_logprobs' needs 'logprobs': true");
    r->top_logprobs = (uint32_t)top;
    return KVR_OK;
}

static int parse_prompt(struct kvr_openai_req *r, const struct kvr_openai_limits *lim,
                        struct kvr_openai_error *e)
{
    json_t *v = field(r->root, "prompt");
    if (!v)
        return bad_request(e, "prompt", "missing_required_parameter",
                           "you must provide a 'prompt'");
    if (json_is_array(v)) {
        size_t n = json_array_size(v);
        if (n == 0)
            return bad_request(e, "prompt", "invalid_value", "'prompt' must not be an empty array");
        json_t *first = json_array_get(v, 0);
        if (json_is_string(first) || json_is_array(first)) {
            /* An array of prompts: one is fine, more is a batch. */
            if (n > 1)
                return bad_request(e, "prompt", "unsupported_parameter",
                                   "batched prompts are not supported (got %zu): send one "
                                   "prompt per request",
                                   n);
            v = first;
        }
    }
    if (json_is_string(v)) {
        r->prompt = json_string_value(v);
        r->prompt_len = json_string_length(v);
        return KVR_OK;
    }
    if (!json_is_array(v))
        return want_type(e, "prompt", v, "a string, an array of one string, or token ids");
    size_t n = json_array_size(v);
    if (n == 0)
        return bad_request(e, "prompt", "invalid_value", "'prompt' must not be an empty array");
    if (n > lim->n_ctx)
        return bad_request(e, "prompt", "context_length_exceeded",
                           "This model's maximum context length is %u tokens, but the prompt "
                           "is %zu tokens",
                           lim->n_ctx, n);
    r->prompt_ids = kvr_calloc(n, sizeof *r->prompt_ids);
    if (!r->prompt_ids)
        return out_of_memory(e);
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i);
        char param[64];
        snprintf(param, sizeof param, "prompt[%zu]", i);
        if (!json_is_integer(t))
            return want_type(e, param, t, "a token id (integer)");
        long long id = json_integer_value(t);
        if (id < 0 || id >= (long long)lim->n_vocab)
            return bad_request(e, param, "invalid_value",
                               "token id %lld is outside the vocabulary (0 .. %u)", id,
                               lim->n_vocab ? lim->n_vocab - 1 : 0);
        r->prompt_ids[i] = (int32_t)id;
    }
    r->n_prompt_ids = (uint32_t)n;
    return KVR_OK;
}

static const struct {
    const char *name;
    enum kvr_chat_role role;
} roles[] = {
    {"system", KVR_CHAT_ROLE_SYSTEM}, {"developer", KVR_CHAT_ROLE_SYSTEM},
    {"user", KVR_CHAT_ROLE_USER},     {"assistant", KVR_CHAT_ROLE_ASSISTANT},
    {"tool", KVR_CHAT_ROLE_TOOL},
};

/* A message's content: a string, an array of text parts (joined; the joined string
 * replaces the array inside the JSON tree, which then owns it), or null for an assistant
 * message. */
static int parse_content(json_t *msg, size_t i, struct kvr_chat_msg *out,
                         struct kvr_openai_error *e)
{
    char param[64];
    snprintf(param, sizeof param, "messages[%zu].content", i);
    json_t *c = json_object_get(msg, "content");
    if (!c || json_is_null(c)) {
        if (out->role == KVR_CHAT_ROLE_ASSISTANT) {
            out->content = "";
            out->content_len = 0;
            return KVR_OK;
        }
        return bad_request(e, param, "missing_required_parameter", "'%s' is required", param);
    }
    if (json_is_string(c)) {
        out->content = json_string_value(c);
        out->content_len = json_string_length(c);
        return KVR_OK;
    }
    if (!json_is_array(c))
        return want_type(e, param, c, "a string or an array of text parts");
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    size_t j;
    json_t *part;
    json_array_foreach(c, j, part)
    {
        json_t *type = json_is_object(part) ? json_object_get(part, "type") : NULL;
        json_t *text = json_is_object(part) ? json_object_get(part, "text") : NULL;
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0 ||
            !json_is_string(text)) {
            kvr_sbuf_fini(&b);
            snprintf(param, sizeof param, "messages[%zu].content[%zu]", i, j);
            return bad_request(e, param, "unsupported_parameter",
                               "'%s' must be a text part {\"type\": \"text\", \"text\": \"...\"}; "
                               "other content types are not supported",
                               param);
        }
        kvr_sbuf_append(&b, json_string_value(text), json_string_length(text));
    }
    json_t *joined = b.failed ? NULL : json_stringn(b.data ? b.data : "", b.len);
    kvr_sbuf_fini(&b);
    if (!joined || json_object_set_new(msg, "content", joined))
        return out_of_memory(e);
    out->content = json_string_value(joined);
    out->content_len = json_string_length(joined);
    return KVR_OK;
}

static int parse_messages(struct kvr_openai_req *r, struct kvr_openai_error *e)
{
    json_t *v = field(r->root, "messages");
    if (!v)
        return bad_request(e, "messages", "missing_required_parameter",
                           "you must provide 'messages'");
    if (!json_is_array(v))
        return want_type(e, "messages", v, "an array");
    size_t n = json_array_size(v);
    if (n == 0)
        return bad_request(e, "messages", "invalid_value", "'messages' must not be empty");
    r->msgs = kvr_calloc(n, sizeof *r->msgs);
    if (!r->msgs)
        return out_of_memory(e);
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(v, i);
        char param[64];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(m))
            return want_type(e, param, m, "an object");
        snprintf(param, sizeof param, "messages[%zu].role", i);
        json_t *role = json_object_get(m, "role");
        if (!role || json_is_null(role))
            return bad_request(e, param, "missing_required_parameter", "'%s' is required", param);
        if (!json_is_string(role))
            return want_type(e, param, role, "a string");
        size_t k = 0;
        while (k < sizeof roles / sizeof roles[0] &&
               strcmp(json_string_value(role), roles[k].name) != 0)
            k++;
        if (k == sizeof roles / sizeof roles[0])
            return bad_request(e, param, "invalid_value",
                               "'%s' must be 'system', 'developer', 'user', 'assistant' or "
                               "'tool'; '%.32s' is not supported",
                               param, json_string_value(role));
        r->msgs[i].role = roles[k].role;
        /* "name" is OpenAI's speaker name; the tool fields go to the template (tools.h). */
        static const char *const known[] = {
            "role",    "content",           "name", "tool_calls", "tool_call_id",
            "refusal", "reasoning_content", NULL};
        snprintf(param, sizeof param, "messages[%zu]", i);
        int rc = kvr_openai_check_keys(m, param, known, e);
        if (!rc)
            rc = kvr_tools_check_message(m, i, json_string_value(role), e);
        if (rc)
            return rc;
        rc = parse_content(m, i, &r->msgs[i], e);
        if (rc)
            return rc;
        r->n_msgs = i + 1;
    }
    r->msgs_json = v;
    return KVR_OK;
}

/* max_tokens, chat's max_completion_tokens (which wins over it), or llama.cpp's n_predict
 * (given alone; -1 is the rest of the context). */
static int parse_max_tokens(struct kvr_openai_req *r, const struct kvr_openai_limits *lim,
                            struct kvr_openai_error *e)
{
    const json_t *o = r->root;
    const char *key = "max_tokens";
    if (r->api == KVR_OPENAI_CHAT && field(o, "max_completion_tokens"))
        key = "max_completion_tokens";
    if (field(o, "n_predict")) {
        if (field(o, key))
            return bad_request(e, "n_predict", "invalid_value",
                               "'n_predict' is another name for '%s'; give one of them", key);
        key = "n_predict";
    }
    json_t *v = field(o, key);
    if (v && !json_is_integer(v))
        return want_type(e, key, v, "an integer");
    long long x = v ? json_integer_value(v) : 0;
    if (v && x == -1 && !strcmp(key, "n_predict")) {
        r->max_tokens_rest = true;
        return KVR_OK;
    }
    if (v && (x < 1 || x > (long long)lim->n_ctx))
        return bad_request(e, key, "invalid_value",
                           "'%s' must be between 1 and %u (the model's context length)%s, got "
                           "%lld",
                           key, lim->n_ctx, strcmp(key, "n_predict") ? "" : " or -1 (to the end)",
                           x);
    r->has_max_tokens = v != NULL;
    r->max_tokens = (uint32_t)x;
    return KVR_OK;
}

static int parse_fields(struct kvr_openai_req *r, const struct kvr_openai_limits *lim,
                        struct kvr_openai_error *e)
{
    const json_t *o = r->root;
    json_t *v;
    int rc;

    if ((v = field(o, "model"))) {
        if (!json_is_string(v))
            return want_type(e, "model", v, "a string");
        r->model = json_string_value(v);
    }
    if ((rc = r->api == KVR_OPENAI_CHAT ? parse_messages(r, e) : parse_prompt(r, lim, e)))
        return rc;

    if ((rc = parse_max_tokens(r, lim, e)) || (rc = parse_sampling(r, e)) ||
        (rc = parse_logit_bias(r, lim, e)) || (rc = parse_stop(r, e)) ||
        (rc = parse_logprobs(r, e)) || (rc = parse_budget(r, e)) ||
        (rc = refuse_unsupported(r, e)) || (rc = kvr_openai_parse_grammar(r, e)) ||
        (rc = kvr_openai_parse_prediction(r, e)))
        return rc;
    if (r->api == KVR_OPENAI_CHAT && (rc = kvr_tools_parse(o, &r->tools, e)))
        return rc;

    if ((rc = get_bool(o, "stream", &r->stream, e)) ||
        (rc = get_bool(o, "ignore_eos", &r->ignore_eos, e)))
        return rc;
    if ((v = field(o, "stream_options"))) {
        if (!json_is_object(v))
            return want_type(e, "stream_options", v, "an object");
        if (!r->stream)
            return bad_request(e, "stream_options", "invalid_value",
                               "'stream_options' is only allowed when 'stream' is true");
        static const char *const known[] = {"include_usage", NULL};
        if ((rc = kvr_openai_check_keys(v, "stream_options", known, e)))
            return rc;
        json_t *u = field(v, "include_usage");
        if (u && !json_is_boolean(u))
            return want_type(e, "stream_options.include_usage", u, "a boolean");
        r->include_usage = json_is_true(u);
    }
    return kvr_openai_check_fields(o, r->api, e);
}

/* A body jansson refused for an integer beyond int64: parse it again with a "seed" in
 * 2^63 .. 2^64-1 written as 0 (padded with spaces, so that error columns stay right), and
 * the seed's value in *big_seed. NULL when there is no such seed; *rc tells a seed out of
 * range from out of memory. */
static json_t *load_big_seed(const char *body, size_t len, uint64_t *big_seed, int *rc,
                             struct kvr_openai_error *e)
{
    size_t at, n;
    int found = kvr_openai_find_big_seed(body, len, &at, &n, big_seed);
    *rc = found < 0 ? bad_seed(e) : KVR_OK;
    if (found <= 0)
        return NULL;
    char *copy = kvr_malloc(len);
    if (!copy) {
        *rc = out_of_memory(e);
        return NULL;
    }
    memcpy(copy, body, len);
    memset(copy + at, ' ', n);
    copy[at] = '0';
    json_t *j = json_loadb(copy, len, JSON_REJECT_DUPLICATES, NULL);
    kvr_free(copy);
    return j;
}

/* UTF-8, then JSON without duplicate keys, then an object: *root is the parsed body
 * (NULL on failure). With big_seed (generation requests), a seed beyond int64 is read
 * into *big_seed (and *has_big_seed set) rather than refused. */
static int load_object(const char *body, size_t len, json_t **root, uint64_t *big_seed,
                       bool *has_big_seed, struct kvr_openai_error *e)
{
    *root = NULL;
    size_t bad = kvr_utf8_valid_len(body, len);
    if (bad != len)
        return bad_request(e, NULL, "invalid_utf8",
                           "the request body is not valid UTF-8 (invalid byte 0x%02X at offset "
                           "%zu)",
                           (unsigned char)body[bad], bad);
    if (len == 0)
        return bad_request(e, NULL, "invalid_json",
                           "the request body is empty; expected a JSON object");
    json_error_t je;
    /* Duplicate keys are refused: two "max_tokens" would otherwise mean whichever the
     * parser happened to keep. */
    json_t *j = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!j && big_seed && json_error_code(&je) == json_error_numeric_overflow) {
        int rc;
        j = load_big_seed(body, len, big_seed, &rc, e);
        if (rc)
            return rc;
        *has_big_seed = j != NULL;
    }
    if (!j)
        return bad_request(e, NULL, "invalid_json",
                           "the request body is not valid JSON: %s (line %d, column %d)", je.text,
                           je.line, je.column);
    if (!json_is_object(j)) {
        int rc = bad_request(e, NULL, "invalid_json",
                             "the request body must be a JSON object, got %s", type_name(j));
        json_decref(j);
        return rc;
    }
    *root = j;
    return KVR_OK;
}

int kvr_openai_parse(struct kvr_openai_req *r, enum kvr_openai_api api, const char *body,
                     size_t len, const struct kvr_openai_limits *lim, struct kvr_openai_error *e)
{
    memset(r, 0, sizeof *r);
    r->api = api;
    if ((unsigned)api >= KVR_OPENAI_API_COUNT)
        return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "unknown API %d", (int)api);
    uint64_t big_seed = 0;
    bool has_big_seed = false;
    int rc = load_object(body, len, &r->root, &big_seed, &has_big_seed, e);
    if (rc) {
        r->api = api;
        return rc;
    }
    rc = parse_fields(r, lim, e);
    if (!rc && has_big_seed)
        r->sampling.seed = big_seed; /* parse_fields read it as 0 */
    if (rc) {
        kvr_openai_req_fini(r);
        r->api = api;
    }
    return rc;
}

void kvr_openai_req_fini(struct kvr_openai_req *r)
{
    json_decref(r->root);
    kvr_free(r->prompt_ids);
    kvr_free(r->msgs);
    kvr_free(r->grammar);
    memset(r, 0, sizeof *r);
}

/* Which of a field's two names the body uses: `name` unless only `other` is there; NULL
 * when both are. */
static const char *alias(const json_t *obj, const char *name, const char *other)
{
    if (!json_object_get(obj, other))
        return name;
    return json_object_get(obj, name) ? NULL : other;
}

int kvr_openai_parse_tokenize(struct kvr_openai_tokenize_req *r, const char *body, size_t len,
                              struct kvr_openai_error *e)
{
    memset(r, 0, sizeof *r);
    int rc = load_object(body, len, &r->root, NULL, NULL, e);
    if (rc)
        return rc;
    /* vLLM's names for the same fields; "model" names the one model there is. */
    static const char *const known[] = {
        "content", "prompt", "add_special", "add_special_tokens", "with_pieces", "model", NULL};
    const char *ckey = alias(r->root, "content", "prompt");
    const char *akey = alias(r->root, "add_special", "add_special_tokens");
    json_t *c = ckey ? json_object_get(r->root, ckey) : NULL;
    rc = kvr_openai_check_keys(r->root, NULL, known, e);
    if (!rc && (!ckey || !akey))
        rc = bad_request(e, ckey ? "add_special_tokens" : "prompt", "invalid_value",
                         "'%s' is another name for '%s'; give one of them",
                         ckey ? "add_special_tokens" : "prompt", ckey ? "add_special" : "content");
    else if (!rc && !c)
        rc = bad_request(e, "content", "missing_required_parameter",
                         "'content' (the text to tokenize) is required");
    else if (!rc && !json_is_string(c))
        rc = want_type(e, ckey, c, "a string");
    if (!rc)
        rc = get_bool(r->root, akey, &r->add_special, e);
    if (!rc)
        rc = get_bool(r->root, "with_pieces", &r->with_pieces, e);
    if (rc) {
        kvr_openai_tokenize_req_fini(r);
        return rc;
    }
    r->content = json_string_value(c);
    r->content_len = json_string_length(c);
    return KVR_OK;
}

void kvr_openai_tokenize_req_fini(struct kvr_openai_tokenize_req *r)
{
    json_decref(r->root);
    memset(r, 0, sizeof *r);
}

int kvr_openai_parse_detokenize(const char *body, size_t len, int32_t n_vocab, int32_t **ids,
                                uint32_t *n_ids, struct kvr_openai_error *e)
{
    *ids = NULL;
    *n_ids = 0;
    json_t *root;
    int rc = load_object(body, len, &root, NULL, NULL, e);
    if (rc)
        return rc;
    static const char *const known[] = {"tokens", "model", NULL};
    json_t *t = json_object_get(root, "tokens");
    if ((rc = kvr_openai_check_keys(root, NULL, known, e)))
        goto out;
    if (!t) {
        rc = bad_request(e, "tokens", "missing_required_parameter",
                         "'tokens' (an array of token ids) is "
                         "required");
        goto out;
    }
    if (!json_is_array(t)) {
        rc = want_type(e, "tokens", t, "an array of token ids");
        goto out;
    }
    size_t n = json_array_size(t);
    *ids = kvr_malloc((n ? n : 1) * sizeof **ids);
    if (!*ids) {
        rc = out_of_memory(e);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(t, i);
        char param[32];
        snprintf(param, sizeof param, "tokens[%zu]", i);
        if (!json_is_integer(v)) {
            rc = want_type(e, param, v, "an integer");
            goto out;
        }
        json_int_t id = json_integer_value(v);
        if (id < 0 || id >= n_vocab) {
            rc = bad_request(e, param, "invalid_value",
                             "token id %lld is outside the vocabulary (0 .. %d)", (long long)id,
                             (int)n_vocab - 1);
            goto out;
        }
        (*ids)[i] = (int32_t)id;
    }
    *n_ids = (uint32_t)n;
out:
    if (rc) {
        kvr_free(*ids);
        *ids = NULL;
    }
    json_decref(root);
    return rc;
}

int kvr_openai_check_length(const struct kvr_openai_req *r, uint32_t n_prompt, uint32_t n_ctx,
                            uint32_t default_max_tokens, uint32_t *out_max_tokens,
                            struct kvr_openai_error *e)
{
    const char *pparam = r->api == KVR_OPENAI_CHAT ? "messages" : "prompt";
    if (n_prompt == 0)
        return bad_request(e, pparam, "invalid_value", "the prompt is empty (0 tokens)");
    if (n_prompt >= n_ctx)
        return bad_request(e, pparam, "context_length_exceeded",
                           "This model's maximum context length is %u tokens, but the prompt "
                           "is %u tokens, which leaves no room for the completion",
                           n_ctx, n_prompt);
    uint32_t room = n_ctx - n_prompt;
    if (r->has_max_tokens) {
        if (r->max_tokens > room)
            return bad_request(e, r->api == KVR_OPENAI_CHAT ? "max_tokens" : "max_tokens",
                               "context_length_exceeded",
                               "This model's maximum context length is %u tokens. However, "
                               "you requested %" PRIu64 " tokens (%u in the prompt, %u for the "
                               "completion). Please reduce the prompt or max_tokens",
                               n_ctx, (uint64_t)n_prompt + r->max_tokens, n_prompt, r->max_tokens);
        *out_max_tokens = r->max_tokens;
        return KVR_OK;
    }
    uint32_t want = r->max_tokens_rest ? room : default_max_tokens;
    if (!want)
        want = r->api == KVR_OPENAI_COMPLETIONS ? 16 : room;
    *out_max_tokens = want < room ? want : room;
    return KVR_OK;
}

int kvr_openai_parse_budget_header(const char *value, uint32_t *out_ms, struct kvr_openai_error *e)
{
    static const char *const param = "X-Latency-Budget-Ms";
    uint64_t x = 0;
    size_t i = 0;
    for (; value[i]; i++) {
        if (value[i] < '0' || value[i] > '9' || i >= 8)
            break;
        x = x * 10 + (uint64_t)(value[i] - '0');
    }
    if (i == 0 || value[i] != 0 || x < 1 || x > KVR_OPENAI_MAX_BUDGET_MS)
        return bad_request(e, param, "invalid_value",
                           "the X-Latency-Budget-Ms header must be a whole number of "
                           "milliseconds between 1 and %d, got '%.32s'",
                           KVR_OPENAI_MAX_BUDGET_MS, value);
    *out_ms = (uint32_t)x;
    return KVR_OK;
}

/* ---- responses ---------------------------------------------------------------------- */

const char *kvr_openai_finish_name(enum kvr_openai_finish f)
{
    switch (f) {
    case KVR_OPENAI_FINISH_STOP:
        return "stop";
    case KVR_OPENAI_FINISH_LENGTH:
        return "length";
    default:
        return NULL;
    }
}

static json_t *usage_object(uint32_t prompt_tokens, uint32_t completion_tokens)
{
    return json_pack("{s:I,s:I,s:I}", "prompt_tokens", (json_int_t)prompt_tokens,
                     "completion_tokens", (json_int_t)completion_tokens, "total_tokens",
                     (json_int_t)prompt_tokens + completion_tokens);
}

static json_t *finish_value(enum kvr_openai_finish f)
{
    const char *name = kvr_openai_finish_name(f);
    return name ? json_string(name) : json_null();
}

/* {"id", "object", "created", "model"}: the head of every response body. */
static json_t *response_head(const struct kvr_openai_meta *m, const char *object)
{
    return json_pack("{s:s,s:s,s:I,s:s}", "id", m->id, "object", object, "created",
                     (json_int_t)m->created, "model", m->model ? m->model : "");
}

char *kvr_openai_response_json(const struct kvr_openai_meta *m, const char *text, size_t text_len,
                               enum kvr_openai_finish finish, uint32_t prompt_tokens,
                               uint32_t completion_tokens, const json_t *logprobs, size_t *out_len)
{
    bool chat = m->api == KVR_OPENAI_CHAT;
    json_t *root = response_head(m, chat ? "chat.completion" : "text_completion");
    json_t *lp = logprobs ? json_deep_copy(logprobs) : json_null();
    json_t *choice = NULL;
    if (chat)
        choice = json_pack("{s:i,s:{s:s,s:o},s:o,s:o}", "index", (int)m->choice, "message", "role",
                           "assistant", "content", jstr(text, text_len), "logprobs", lp,
                           "finish_reason", finish_value(finish));
    else
        choice = json_pack("{s:o,s:i,s:o,s:o}", "text", jstr(text, text_len), "index",
                           (int)m->choice, "logprobs", lp, "finish_reason", finish_value(finish));
    /* json_pack steals "o" arguments even when it fails, so nothing else to free. */
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    int rc = KVR_ENOMEM;
    if (root && choice && !json_object_set_new(root, "choices", json_pack("[o]", choice)) &&
        !json_object_set_new(root, "usage", usage_object(prompt_tokens, completion_tokens)))
        rc = dump_json(&b, root);
    else if (!root)
        json_decref(choice);
    json_decref(root);
    if (rc) {
        kvr_sbuf_fini(&b);
        return NULL;
    }
    return kvr_sbuf_take(&b, out_len);
}

static int sse_event(struct kvr_sbuf *out, json_t *j)
{
    kvr_sbuf_puts(out, "data: ");
    int rc = dump_json(out, j);
    json_decref(j);
    kvr_sbuf_puts(out, "\n\n");
    return rc || out->failed ? KVR_ENOMEM : KVR_OK;
}

int kvr_openai_sse_chunk(struct kvr_sbuf *out, const struct kvr_openai_meta *m, bool first,
                         const char *text, size_t text_len, enum kvr_openai_finish finish,
                         const json_t *logprobs)
{
    bool chat = m->api == KVR_OPENAI_CHAT;
    json_t *root = response_head(m, chat ? "chat.completion.chunk" : "text_completion");
    json_t *lp = logprobs ? json_deep_copy(logprobs) : json_null();
    json_t *choice;
    if (chat) {
        json_t *delta = json_object();
        if (delta && first)
            json_object_set_new(delta, "role", json_string("assistant"));
        if (delta && (first || text_len))
            json_object_set_new(delta, "content", jstr(text, text_len));
        choice = json_pack("{s:i,s:o,s:o,s:o}", "index", (int)m->choice, "delta", delta, "logprobs",
                           lp, "finish_reason", finish_value(finish));
    } else {
        choice =
            json_pack("{s:i,s:o,s:o,s:o}", "index", (int)m->choice, "text", jstr(text, text_len),
                      "logprobs", lp, "finish_reason", finish_value(finish));
    }
    if (!root || !choice || json_object_set_new(root, "choices", json_pack("[o]", choice)) ||
        (m->include_usage && json_object_set_new(root, "usage", json_null()))) {
        if (!root)
            json_decref(choice);
        json_decref(root);
        return KVR_ENOMEM;
    }
    return sse_event(out, root);
}

int kvr_openai_sse_usage(struct kvr_sbuf *out, const struct kvr_openai_meta *m,
                         uint32_t prompt_tokens, uint32_t completion_tokens)
{
    bool chat = m->api == KVR_OPENAI_CHAT;
    json_t *root = response_head(m, chat ? "chat.completion.chunk" : "text_completion");
    if (!root || json_object_set_new(root, "choices", json_array()) ||
        json_object_set_new(root, "usage", usage_object(prompt_tokens, completion_tokens))) {
        json_decref(root);
        return KVR_ENOMEM;
    }
    return sse_event(out, root);
}

int kvr_openai_sse_error(struct kvr_sbuf *out, const struct kvr_openai_error *e)
{
    json_t *j = error_object(e);
    if (!j)
        return KVR_ENOMEM;
    return sse_event(out, j);
}

void kvr_openai_sse_done(struct kvr_sbuf *out)
{
    kvr_sbuf_puts(out, "data: [DONE]\n\n");
}
