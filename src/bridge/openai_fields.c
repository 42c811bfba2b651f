/* openai_fields.c - which request fields Kvasir knows, and seeds beyond jansson's integers
 * (see openai.h, "fields").
 *
 * Every top-level field of a generation request is in `fields` below: parsed by openai.c,
 * an alias of a parsed field, accepted only at a value that changes nothing, or refused
 * with the reason. A field in none of these is refused as unknown: a client that asked for
 * grammar-constrained output and got free text would be misled, and a typo ("temprature")
 * would go unnoticed. A null value counts as not given, for every field. docs/API.md has
 * the same table; keep them in step. */
#include "bridge/openai.h"

#include "core/err.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum kind {
    KIND_PARSED,  /* openai.c reads and checks it */
    KIND_ALIAS,   /* another client's name for `note`; openai.c reads it */
    KIND_INERT,   /* accepted at its neutral value (`neutral`), refused otherwise */
    KIND_REFUSED, /* a feature Kvasir lacks; `note` says which */
    KIND_COUNT
};

/* The value at which an inert field changes nothing. */
enum neutral {
    NEUTRAL_ANY_STRING, /* any string: metadata about the caller, not about the answer */
    NEUTRAL_ANY_OBJECT,
    NEUTRAL_ANY_BOOL,
    NEUTRAL_FALSE,
    NEUTRAL_TRUE,
    NEUTRAL_ZERO,     /* the number 0: the sampler is off */
    NEUTRAL_ONE,      /* the number 1: the sampler is off */
    NEUTRAL_AUTO,     /* the string "auto" or "default" */
    NEUTRAL_NO_TOOLS, /* the string "none" or "auto" */
    NEUTRAL_TEXT,     /* ["text"] */
    NEUTRAL_COUNT
};

#define API_C (1u << KVR_OPENAI_COMPLETIONS)
#define API_H (1u << KVR_OPENAI_CHAT)
#define API_BOTH (API_C | API_H)

struct field_rule {
    const char *name;
    unsigned apis; /* API_C, API_H or both */
    enum kind kind;
    enum neutral neutral; /* KIND_INERT only */
    const char *note;     /* the canonical name (ALIAS) or the reason (REFUSED, INERT) */
};

static const struct field_rule fields[] = {
    /* Parsed by openai.c (values checked there). */
    {"model", API_BOTH, KIND_PARSED, 0, NULL},
    {"prompt", API_C, KIND_PARSED, 0, NULL},
    {"messages", API_H, KIND_PARSED, 0, NULL},
    {"max_tokens", API_BOTH, KIND_PARSED, 0, NULL},
    {"max_completion_tokens", API_H, KIND_PARSED, 0, NULL},
    {"temperature", API_BOTH, KIND_PARSED, 0, NULL},
    {"top_p", API_BOTH, KIND_PARSED, 0, NULL},
    {"top_k", API_BOTH, KIND_PARSED, 0, NULL},
    {"min_p", API_BOTH, KIND_PARSED, 0, NULL},
    {"repetition_penalty", API_BOTH, KIND_PARSED, 0, NULL},
    {"repeat_last_n", API_BOTH, KIND_PARSED, 0, NULL},
    {"frequency_penalty", API_BOTH, KIND_PARSED, 0, NULL},
    {"presence_penalty", API_BOTH, KIND_PARSED, 0, NULL},
    {"logit_bias", API_BOTH, KIND_PARSED, 0, NULL},
    {"seed", API_BOTH, KIND_PARSED, 0, NULL},
    {"stop", API_BOTH, KIND_PARSED, 0, NULL},
    {"n", API_BOTH, KIND_PARSED, 0, NULL},
    {"best_of", API_C, KIND_PARSED, 0, NULL},
    {"echo", API_C, KIND_PARSED, 0, NULL},
    {"suffix", API_C, KIND_PARSED, 0, NULL},
    {"stream", API_BOTH, KIND_PARSED, 0, NULL},
    {"stream_options", API_BOTH, KIND_PARSED, 0, NULL},
    {"logprobs", API_BOTH, KIND_PARSED, 0, NULL},
    {"top_logprobs", API_H, KIND_PARSED, 0, NULL},
    {"ignore_eos", API_BOTH, KIND_PARSED, 0, NULL},
    {"latency_budget", API_BOTH, KIND_PARSED, 0, NULL},
    {"tools", API_H, KIND_PARSED, 0, NULL},
    {"tool_choice", API_H, KIND_PARSED, 0, NULL},
    {"parallel_tool_calls", API_H, KIND_PARSED, 0, NULL},
    {"functions", API_H, KIND_PARSED, 0, NULL},
    {"response_format", API_BOTH, KIND_PARSED, 0, NULL},
    {"grammar", API_BOTH, KIND_PARSED, 0, NULL},
    {"json_schema", API_BOTH, KIND_PARSED, 0, NULL},
    /* Other servers' names for the same thing. */
    {"n_predict", API_BOTH, KIND_ALIAS, 0, "max_tokens"},
    {"repeat_penalty", API_BOTH, KIND_ALIAS, 0, "repetition_penalty"},
    /* Accepted where they change nothing. */
    {"user", API_BOTH, KIND_INERT, NEUTRAL_ANY_STRING, "an end-user id for the caller's records"},
    {"safety_identifier", API_BOTH, KIND_INERT, NEUTRAL_ANY_STRING, "an end-user id"},
    {"prompt_cache_key", API_BOTH, KIND_INERT, NEUTRAL_ANY_STRING,
     "the prefix cache finds shared prompts by itself"},
    {"metadata", API_H, KIND_INERT, NEUTRAL_ANY_OBJECT, "only kept with stored completions"},
    {"store", API_H, KIND_INERT, NEUTRAL_FALSE, "stored completions are not supported"},
    {"service_tier", API_BOTH, KIND_INERT, NEUTRAL_AUTO, "there is one service tier"},
    {"function_call", API_H, KIND_INERT, NEUTRAL_NO_TOOLS, "functions are not supported"},
    {"modalities", API_H, KIND_INERT, NEUTRAL_TEXT, "only text output is supported"},
    {"cache_prompt", API_BOTH, KIND_INERT, NEUTRAL_TRUE,
     "the prefix cache cannot be turned off per request"},
    {"typical_p", API_BOTH, KIND_INERT, NEUTRAL_ONE, "typical sampling is not implemented"},
    {"tfs_z", API_BOTH, KIND_INERT, NEUTRAL_ONE, "tail-free sampling is not implemented"},
    {"mirostat", API_BOTH, KIND_INERT, NEUTRAL_ZERO, "mirostat sampling is not implemented"},
    {"dry_multiplier", API_BOTH, KIND_INERT, NEUTRAL_ZERO, "DRY sampling is not implemented"},
    {"xtc_probability", API_BOTH, KIND_INERT, NEUTRAL_ZERO, "XTC sampling is not implemented"},
    {"min_tokens", API_BOTH, KIND_INERT, NEUTRAL_ZERO,
     "a minimum length is not supported yet ('ignore_eos' generates exactly 'max_tokens')"},
    /* Features Kvasir lacks. */
    {"guided_json", API_BOTH, KIND_REFUSED, 0, "guided decoding is not supported yet"},
    {"guided_regex", API_BOTH, KIND_REFUSED, 0, "guided decoding is not supported yet"},
    {"guided_choice", API_BOTH, KIND_REFUSED, 0, "guided decoding is not supported yet"},
    {"guided_grammar", API_BOTH, KIND_REFUSED, 0, "guided decoding is not supported yet"},
    {"structured_outputs", API_BOTH, KIND_REFUSED, 0, "guided decoding is not supported yet"},
    {"prediction", API_H, KIND_REFUSED, 0, "predicted outputs are not supported"},
    {"audio", API_H, KIND_REFUSED, 0, "audio output is not supported"},
    {"reasoning_effort", API_H, KIND_REFUSED, 0, "reasoning controls are not supported"},
    {"verbosity", API_H, KIND_REFUSED, 0, "verbosity control is not supported"},
    {"web_search_options", API_H, KIND_REFUSED, 0, "web search is not supported"},
    {"n_probs", API_BOTH, KIND_REFUSED, 0,
     "top-n probabilities are not supported; 'logprobs' gives the sampled token's"},
    {"stop_token_ids", API_BOTH, KIND_REFUSED, 0, "stopping at token ids is not supported yet"},
};

static const struct field_rule *find_rule(const char *key)
{
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (!strcmp(fields[i].name, key))
            return &fields[i];
    return NULL;
}

static bool is_neutral(enum neutral n, const json_t *v)
{
    const char *s = json_is_string(v) ? json_string_value(v) : NULL;
    switch (n) {
    case NEUTRAL_ANY_STRING:
        return s != NULL;
    case NEUTRAL_ANY_OBJECT:
        return json_is_object(v);
    case NEUTRAL_ANY_BOOL:
        return json_is_boolean(v);
    case NEUTRAL_FALSE:
        return json_is_false(v);
    case NEUTRAL_TRUE:
        return json_is_true(v);
    case NEUTRAL_ZERO:
        return json_is_number(v) && json_number_value(v) == 0.0;
    case NEUTRAL_ONE:
        return json_is_number(v) && json_number_value(v) == 1.0;
    case NEUTRAL_AUTO:
        return s && (!strcmp(s, "auto") || !strcmp(s, "default"));
    case NEUTRAL_NO_TOOLS:
        return s && (!strcmp(s, "none") || !strcmp(s, "auto"));
    case NEUTRAL_TEXT:
        return json_is_array(v) && json_array_size(v) == 1 &&
               json_is_string(json_array_get(v, 0)) &&
               !strcmp(json_string_value(json_array_get(v, 0)), "text");
    default:
        return false;
    }
}

static const char *const neutral_names[NEUTRAL_COUNT] = {
    [NEUTRAL_ANY_STRING] = "a string",
    [NEUTRAL_ANY_OBJECT] = "an object",
    [NEUTRAL_ANY_BOOL] = "a boolean",
    [NEUTRAL_FALSE] = "false",
    [NEUTRAL_TRUE] = "true",
    [NEUTRAL_ZERO] = "0",
    [NEUTRAL_ONE] = "1",
    [NEUTRAL_AUTO] = "\"auto\" or \"default\"",
    [NEUTRAL_NO_TOOLS] = "\"none\" or \"auto\"",
    [NEUTRAL_TEXT] = "[\"text\"]",
};

int kvr_openai_check_fields(const json_t *root, enum kvr_openai_api api, struct kvr_openai_error *e)
{
    static const char *const api_path[KVR_OPENAI_API_COUNT] = {"/v1/completions",
                                                               "/v1/chat/completions"};
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)root, key, v)
    {
        if (json_is_null(v))
            continue;
        const struct field_rule *f = find_rule(key);
        if (!f)
            return kvr_openai_error_set(e, 400, "invalid_request_error", key, "unknown_parameter",
                                        "'%.48s' is not a field of %s; unknown fields are "
                                        "refused rather than ignored (docs/API.md lists them)",
                                        key, api_path[api]);
        if (!(f->apis & (1u << api)))
            return kvr_openai_error_set(e, 400, "invalid_request_error", key, "unknown_parameter",
                                        "'%s' is not a field of %s", key, api_path[api]);
        if (f->kind == KIND_REFUSED)
            return kvr_openai_error_set(e, 400, "invalid_request_error", key,
                                        "unsupported_parameter", "'%s': %s", key, f->note);
        if (f->kind == KIND_INERT && !is_neutral(f->neutral, v))
            return kvr_openai_error_set(e, 400, "invalid_request_error", key,
                                        "unsupported_parameter", "'%s' is accepted only as %s: %s",
                                        key, neutral_names[f->neutral], f->note);
        json_t *canon = f->kind == KIND_ALIAS ? json_object_get(root, f->note) : NULL;
        if (canon && !json_is_null(canon))
            return kvr_openai_error_set(e, 400, "invalid_request_error", key, "invalid_value",
                                        "'%s' is another name for '%s'; give one of them", key,
                                        f->note);
    }
    return KVR_OK;
}

int kvr_openai_check_keys(const json_t *obj, const char *path, const char *const *known,
                          struct kvr_openai_error *e)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)obj, key, v)
    {
        size_t i = 0;
        while (known[i] && strcmp(known[i], key) != 0)
            i++;
        if (known[i] || json_is_null(v))
            continue;
        char param[64];
        snprintf(param, sizeof param, "%s%s%.40s", path ? path : "", path ? "." : "", key);
        return kvr_openai_error_set(e, 400, "invalid_request_error", param, "unknown_parameter",
                                    "'%s' is not a known field; unknown fields are refused "
                                    "rather than ignored (docs/API.md lists them)",
                                    param);
    }
    return KVR_OK;
}

/* ---- seeds beyond int64 ---------------------------------------------------------------- */

/* A tiny scanner over the top level of a JSON object, enough to find one key's value. It
 * runs only on bodies jansson refused for a too-large integer, and gives up (returns NULL)
 * on anything it does not expect: jansson's error then stands. */
static const char *skip_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}

static const char *skip_string(const char *p, const char *end)
{
    if (p >= end || *p != '"')
        return NULL;
    for (p++; p < end; p++) {
        if (*p == '\\')
            p++;
        else if (*p == '"')
            return p + 1;
    }
    return NULL;
}

/* Past one value: strings skipped whole, brackets counted. */
static const char *skip_value(const char *p, const char *end)
{
    int depth = 0;
    while (p < end) {
        if (*p == '"') {
            if (!(p = skip_string(p, end)))
                return NULL;
            if (depth == 0)
                return p;
            continue;
        }
        if (*p == '{' || *p == '[')
            depth++;
        else if (*p == '}' || *p == ']') {
            if (depth == 0)
                return p;
            if (--depth == 0)
                return p + 1;
        } else if (*p == ',' && depth == 0)
            return p;
        p++;
    }
    return NULL;
}

int kvr_openai_find_big_seed(const char *body, size_t len, size_t *at, size_t *n, uint64_t *seed)
{
    const char *p = body, *end = body + len;
    p = skip_ws(p, end);
    if (p >= end || *p++ != '{')
        return 0;
    for (;;) {
        p = skip_ws(p, end);
        const char *key = p;
        if (!(p = skip_string(p, end)))
            return 0;
        bool is_seed = p - key == 6 && !memcmp(key, "\"seed\"", 6);
        p = skip_ws(p, end);
        if (p >= end || *p++ != ':')
            return 0;
        p = skip_ws(p, end);
        const char *v = p;
        if (is_seed && p < end && (*p == '-' || (*p >= '0' && *p <= '9'))) {
            const char *q = p + (*p == '-');
            while (q < end && *q >= '0' && *q <= '9')
                q++;
            if (q < end && (*q == '.' || *q == 'e' || *q == 'E'))
                return 0; /* a real: openai.c says it must be an integer */
            char digits[32];
            if ((size_t)(q - v) >= sizeof digits)
                return -1;
            memcpy(digits, v, (size_t)(q - v));
            digits[q - v] = 0;
            errno = 0;
            unsigned long long x = strtoull(digits, NULL, 10);
            if (*v == '-' || errno || x <= (unsigned long long)LLONG_MAX)
                return -1; /* jansson takes every other integer: this one is out of range */
            *at = (size_t)(v - body);
            *n = (size_t)(q - v);
            *seed = (uint64_t)x;
            return 1;
        }
        if (!(p = skip_value(p, end)))
            return 0;
        p = skip_ws(p, end);
        if (p >= end || *p != ',')
            return 0;
        p++;
    }
}
