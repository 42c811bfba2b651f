/* openai.h - the OpenAI-compatible request and response formats, as pure functions.
 *
 * Three jobs, none of which does I/O:
 *   1. Parse and validate a request body for POST /v1/completions or
 *      /v1/chat/completions into a struct kvr_openai_req, or explain exactly what is wrong
 *      in a struct kvr_openai_error (HTTP status, OpenAI error type, parameter, code,
 *      message). Untrusted bytes: every field's type and range is checked; nothing the
 *      client sends can crash or hang the parser.
 *   2. Cut generated text at stop strings (struct kvr_openai_text): text is released only
 *      when no stop string can still begin inside it, so a client never sees a stop string
 *      or any part of one, even when it spans tokens.
 *   3. Format responses: whole JSON responses, SSE chunks ("data: {...}\n\n"), usage,
 *      logprobs and error bodies.
 *
 * The shapes follow OpenAI's API (see docs/API.md for what is accepted and refused).
 * Memory goes through core/alloc.h (jansson's own allocations aside). No globals; any
 * thread may call any function on its own objects. */
#ifndef KVR_BRIDGE_OPENAI_H
#define KVR_BRIDGE_OPENAI_H

#include "bridge/chat.h"
#include "bridge/tools.h"
#include "core/sbuf.h"
#include "model/sampler.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum kvr_openai_api {
    KVR_OPENAI_COMPLETIONS, /* POST /v1/completions */
    KVR_OPENAI_CHAT,        /* POST /v1/chat/completions */
    KVR_OPENAI_API_COUNT
};

/* ---- errors ------------------------------------------------------------------------- */

#define KVR_OPENAI_ERR_MSG_BYTES 512

/* An error the client is told about. `type` and `code` are static strings (code may be
 * NULL, shown as JSON null). `param` names the offending field as a path such as
 * "messages[2].content"; it points at param_buf (a copy) or is NULL. */
struct kvr_openai_error {
    int status;       /* HTTP status: 400, 401, 404, 405, 413, 429, 500, 503, 504 */
    const char *type; /* "invalid_request_error", "authentication_error", ... */
    const char *param;
    const char *code;
    char param_buf[64];
    char message[KVR_OPENAI_ERR_MSG_BYTES];
};

/* Fill `e` (if non-NULL) and return KVR_EINVAL, so a check fails in one line. */
int kvr_openai_error_set(struct kvr_openai_error *e, int status, const char *type,
                         const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

/* {"error": {"message", "type", "param", "code"}} as a new string (kvr_free), or NULL when
 * out of memory. */
char *kvr_openai_error_json(const struct kvr_openai_error *e, size_t *out_len);

/* ---- requests ----------------------------------------------------------------------- */

#define KVR_OPENAI_MAX_STOP 4            /* stop strings a request may give */
#define KVR_OPENAI_MAX_STOP_BYTES 256    /* longest stop string */
#define KVR_OPENAI_MAX_BUDGET_MS 3600000 /* longest latency budget: one hour */

/* The limits a request is checked against. */
struct kvr_openai_limits {
    uint32_t n_ctx;   /* the model's context: max_tokens may not exceed it */
    uint32_t n_vocab; /* token-id prompts must be below it */
};

/* A parsed request. Strings point into `root` (the parsed JSON, owned) and live until
 * kvr_openai_req_fini. */
struct kvr_openai_req {
    enum kvr_openai_api api;
    json_t *root;

    const char *model; /* NULL when absent */

    /* Completions: a text prompt (prompt != NULL), or token ids given directly. */
    const char *prompt;
    size_t prompt_len;
    int32_t *prompt_ids; /* owned; n_prompt_ids ids, each < n_vocab */
    uint32_t n_prompt_ids;

    /* Chat: the conversation (owned array; contents point into root). "developer" messages
     * are system messages. */
    struct kvr_chat_msg *msgs;
    size_t n_msgs;
    const json_t *msgs_json; /* the "messages" array, one object per msgs entry */
    struct kvr_tools tools;  /* chat: tools, tool_choice, parallel_tool_calls (tools.h) */

    bool has_max_tokens;  /* false: the server's default applies */
    uint32_t max_tokens;  /* 1 .. limits.n_ctx; chat also reads max_completion_tokens, both
                             read llama.cpp's n_predict */
    bool max_tokens_rest; /* n_predict -1: the rest of the context, whatever the default */

    /* The sampler's parameters (model/sampler.h), filled by the parser with OpenAI's
     * meaning and defaults rather than the sampler's own (kvr_sample_params_default):
     *   temperature         [0, 2], default 1; 0 = greedy
     *   top_p               [0, 1], default 1 (off); 0 = greedy (temperature 0, top_p 1)
     *   top_k               >= -1, default 0; -1 and 0 = off (stored as 0)
     *   min_p               [0, 1], default 0 (off)
     *   repeat_penalty      "repetition_penalty" (or llama.cpp's "repeat_penalty"),
     *                       (0, 10], default 1 (off)
     *   frequency_penalty   [-2, 2], default 0; presence_penalty likewise
     *   repeat_last_n       [-1, 256], default -1: the sampler's whole window (256 tokens),
     *                       the closest to OpenAI's whole completion; 0 turns penalties off
     *   seed                0 .. 2^64-1 when has_seed; -1 (llama.cpp's "random") and
     *                       absent leave has_seed false and seed 0: the HTTP layer draws
     *                       one; other negative seeds are refused
     *   bias                "logit_bias": token id -> [-100, 100], distinct ids */
    struct kvr_sample_params sampling;
    bool has_seed; /* the client gave a seed */

    const char *stop[KVR_OPENAI_MAX_STOP]; /* non-empty strings, valid UTF-8 */
    size_t stop_len[KVR_OPENAI_MAX_STOP];
    uint32_t n_stop;

    bool stream;
    bool include_usage; /* stream_options.include_usage */
    bool logprobs;      /* completions: logprobs = 1; chat: logprobs = true */
    bool ignore_eos;    /* vLLM's extension: generate max_tokens even past an
                           end-of-generation token */

    uint32_t first_token_ms; /* latency_budget.first_token_ms; 0 = server default */
    uint32_t total_ms;       /* latency_budget.total_ms; 0 = server default */

    /* The output's grammar (GBNF, model/grammar.h; owned, NULL: free text), from
     * response_format json_object / json_schema or llama.cpp's grammar / json_schema
     * (openai_grammar.c); it compiled when parsed. */
    char *grammar;
    size_t grammar_len;
};

/* Parse `len` bytes of `body`. Checks, in order: UTF-8, JSON syntax, that the root is an
 * object, then every known field's type and range, then that no field is unknown or asks
 * for a feature Kvasir lacks (kvr_openai_check_fields): nothing is silently ignored. A
 * "seed" above 2^63-1, which jansson cannot hold, is read exactly
 * (kvr_openai_find_big_seed). On failure returns KVR_EINVAL with `e` filled (status 400)
 * and leaves `r` empty (fini is still safe); KVR_ENOMEM when out of memory (status 500). */
int kvr_openai_parse(struct kvr_openai_req *r, enum kvr_openai_api api, const char *body,
                     size_t len, const struct kvr_openai_limits *lim, struct kvr_openai_error *e);
void kvr_openai_req_fini(struct kvr_openai_req *r);

/* POST /tokenize: {"content": string, "add_special": bool (false), "with_pieces": bool
 * (false)}, vLLM's "prompt" and "add_special_tokens" as aliases, "model" accepted; content
 * points into root. POST /detokenize: {"tokens": [id, ...]}, every id in [0, n_vocab),
 * "model" accepted; *ids is kvr_malloc'd. Other fields are refused. POST /apply-template takes a
 * chat request (kvr_openai_parse with KVR_OPENAI_CHAT). Errors as for kvr_openai_parse. */
struct kvr_openai_tokenize_req {
    json_t *root;
    const char *content;
    size_t content_len;
    bool add_special; /* BOS/EOS as the model adds them */
    bool with_pieces; /* answer {"id", "piece"} objects instead of bare ids */
};
int kvr_openai_parse_tokenize(struct kvr_openai_tokenize_req *r, const char *body, size_t len,
                              struct kvr_openai_error *e);
void kvr_openai_tokenize_req_fini(struct kvr_openai_tokenize_req *r);
int kvr_openai_parse_detokenize(const char *body, size_t len, int32_t n_vocab, int32_t **ids,
                                uint32_t *n_ids, struct kvr_openai_error *e);

/* ---- fields (openai_fields.c) -------------------------------------------------------- */

/* Every non-null top-level field of a generation request against the table of known
 * fields: parsed, an alias (refused when given with the field it stands for), accepted at
 * a value that changes nothing ("n": 1, "store": false, "modalities": ["text"], ...), or
 * refused with the reason ("grammar-constrained decoding is not supported yet"). Unknown
 * fields are refused. 0, or KVR_EINVAL with `e` naming the field in `param`. */
int kvr_openai_check_fields(const json_t *root, enum kvr_openai_api api,
                            struct kvr_openai_error *e);

/* response_format, grammar and json_schema into r->grammar (openai_grammar.c); part of
 * kvr_openai_parse. KVR_EINVAL with `e` filled (400, the message naming the schema's JSON
 * pointer for an unsupported keyword), KVR_ENOMEM (500). */
int kvr_openai_parse_grammar(struct kvr_openai_req *r, struct kvr_openai_error *e);

/* Refuse a non-null key of `obj` not in `known` (NULL-terminated); `path` (may be NULL)
 * prefixes the param, as in "stream_options.include_usage". */
int kvr_openai_check_keys(const json_t *obj, const char *path, const char *const *known,
                          struct kvr_openai_error *e);

/* jansson holds integers as signed 64-bit and refuses a body with a larger one. Seeds are
 * unsigned 64-bit, so a body jansson refused for that reason is scanned for a top-level
 * "seed" whose value is an integer literal: 1 when it is in 2^63 .. 2^64-1 (its bytes at
 * body[*at], *n of them, its value in *seed), -1 when it is beyond either end of the
 * seed's range, 0 when there is no such seed (jansson's error stands). */
int kvr_openai_find_big_seed(const char *body, size_t len, size_t *at, size_t *n, uint64_t *seed);

/* Once the prompt is tokenized: check that it fits the context and decide how many tokens
 * to generate. Without max_tokens the default is `default_max_tokens` (0: completions take
 * 16 as OpenAI does, chat the rest of the context as vLLM's does), cut to what the context
 * has left; n_predict -1 takes the rest of the context. An explicit max_tokens that does not fit is
 * an error that gives all the counts. */
int kvr_openai_check_length(const struct kvr_openai_req *r, uint32_t n_prompt, uint32_t n_ctx,
                            uint32_t default_max_tokens, uint32_t *out_max_tokens,
                            struct kvr_openai_error *e);

/* The X-Latency-Budget-Ms header: a total budget in milliseconds, 1 .. one hour, digits
 * only. */
int kvr_openai_parse_budget_header(const char *value, uint32_t *out_ms, struct kvr_openai_error *e);

/* ---- stop strings ------------------------------------------------------------------- */

/* Holds back generated text that could still turn out to begin a stop string. Feed it the
 * detokenizer's output (valid UTF-8); it appends to `out` only text that precedes any
 * possible stop string. The stop strings are borrowed for the object's lifetime. */
struct kvr_openai_text {
    const char *stop[KVR_OPENAI_MAX_STOP + 1]; /* +1: a template's end-of-turn text */
    size_t stop_len[KVR_OPENAI_MAX_STOP + 1];
    uint32_t n_stop;
    struct kvr_sbuf held; /* text not yet released: a possible start of a stop string */
    bool stopped;         /* a stop string was found; everything after it is dropped */
};

/* `extra` (may be NULL) is one more stop string, e.g. kvr_chat_tmpl_end_of_turn. Empty
 * strings are skipped. */
void kvr_openai_text_init(struct kvr_openai_text *t, const char *const *stop,
                          const size_t *stop_len, uint32_t n_stop, const char *extra);
void kvr_openai_text_fini(struct kvr_openai_text *t);
/* Returns true when a stop string has been found (now or earlier): `out` then holds all the
 * text before it and later pushes add nothing. */
bool kvr_openai_text_push(struct kvr_openai_text *t, const char *p, size_t n, struct kvr_sbuf *out);
/* The generation ended for another reason (length, EOS): release the held text. */
void kvr_openai_text_flush(struct kvr_openai_text *t, struct kvr_sbuf *out);

/* ---- responses ---------------------------------------------------------------------- */

enum kvr_openai_finish {
    KVR_OPENAI_FINISH_NONE,   /* still generating (stream chunks) */
    KVR_OPENAI_FINISH_STOP,   /* a stop string or the end-of-generation token */
    KVR_OPENAI_FINISH_LENGTH, /* max_tokens or the context ran out */
    KVR_OPENAI_FINISH_COUNT
};

/* "stop", "length", or NULL for NONE. */
const char *kvr_openai_finish_name(enum kvr_openai_finish f);

/* What every response of one request shares. */
struct kvr_openai_meta {
    enum kvr_openai_api api;
    const char *id;  /* "cmpl-..." / "chatcmpl-..." */
    int64_t created; /* Unix seconds */
    const char *model;
    bool include_usage; /* stream: every chunk carries "usage": null, the last the counts */
};

/* Log-probabilities of generated tokens, in the API's shape:
 *   completions: {"tokens": [..], "token_logprobs": [..], "top_logprobs": null,
 *                 "text_offset": [..]}
 *   chat:        {"content": [{"token", "logprob", "bytes": [..], "top_logprobs": []}, ..]}
 * `piece` is the token's text (any bytes; invalid UTF-8 shows as U+FFFD in "token", exact
 * in "bytes"); text_offset is where the token starts in the completion's text. */
json_t *kvr_openai_logprobs_new(enum kvr_openai_api api);
int kvr_openai_logprobs_add(json_t *lp, enum kvr_openai_api api, const char *piece,
                            size_t piece_len, float logprob, size_t text_offset);

/* The whole non-streaming response. `text` is valid UTF-8; `logprobs` (may be NULL) is
 * borrowed. Returns a new string (kvr_free) or NULL when out of memory. */
char *kvr_openai_response_json(const struct kvr_openai_meta *m, const char *text, size_t text_len,
                               enum kvr_openai_finish finish, uint32_t prompt_tokens,
                               uint32_t completion_tokens, const json_t *logprobs, size_t *out_len);

/* One SSE chunk, "data: {...}\n\n", appended to `out`. Chat: `first` adds the assistant
 * role to the delta (OpenAI sends it once, in the first chunk). A chunk with a finish
 * reason ends the choice. `logprobs` may be NULL. Returns 0 or KVR_ENOMEM. */
int kvr_openai_sse_chunk(struct kvr_sbuf *out, const struct kvr_openai_meta *m, bool first,
                         const char *text, size_t text_len, enum kvr_openai_finish finish,
                         const json_t *logprobs);
/* The usage chunk (empty choices) sent before [DONE] when include_usage is set. */
int kvr_openai_sse_usage(struct kvr_sbuf *out, const struct kvr_openai_meta *m,
                         uint32_t prompt_tokens, uint32_t completion_tokens);
/* An error inside a stream: "data: {"error": {...}}\n\n". */
int kvr_openai_sse_error(struct kvr_sbuf *out, const struct kvr_openai_error *e);
/* "data: [DONE]\n\n" */
void kvr_openai_sse_done(struct kvr_sbuf *out);

#endif
