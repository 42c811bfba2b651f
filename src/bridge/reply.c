/* reply.c - an answer as text, reasoning and tool calls, in Chat Completions' shapes (see
 * reply.h; the Responses API's shapes are in responses.c). */
#include "bridge/reply.h"

#include "bridge/responses.h"
#include "bridge/toolcall_grammar.h"
#include "model/grammar.h"
#include "model/tokenizer.h"
#include "core/alloc.h"
#include "core/err.h"
#include "core/utf8.h"

#include <stdio.h>
#include <string.h>

bool kvr_reply_wanted(const struct kvr_chat *chat, const struct kvr_openai_req *req)
{
    size_t len;
    const char *src = kvr_chat_jinja_source(chat, &len);
    if (!src)
        return false;
    bool think;
    enum kvr_toolcall_family f = kvr_toolcall_detect(src, len, &think);
    return req->tools.choice != KVR_TOOL_CHOICE_NONE || think || f == KVR_TOOLCALL_HARMONY;
}

/* The prompt ends inside an open <think> (a template that starts the answer thinking). */
static bool ends_in_think(const char *p, size_t len)
{
    while (len > 0 && (p[len - 1] == '\n' || p[len - 1] == ' '))
        len--;
    return len >= 7 && !memcmp(p + len - 7, "<think>", 7);
}

int kvr_reply_init(struct kvr_reply *r, enum kvr_reply_format format, const struct kvr_chat *chat,
                   const struct kvr_openai_req *req, const char *prompt, size_t len, const char *id)
{
    memset(r, 0, sizeof *r);
    r->format = format;
    size_t src_len = 0;
    const char *src = kvr_chat_jinja_source(chat, &src_len);
    bool think = false;
    r->opts.family = src ? kvr_toolcall_detect(src, src_len, &think) : KVR_TOOLCALL_GENERIC;
    r->opts.calls = req->tools.choice != KVR_TOOL_CHOICE_NONE;
    r->opts.think = think;
    r->opts.in_think = think && ends_in_think(prompt, len);
    r->opts.tools = req->tools.list;
    r->max_calls = req->tools.parallel ? KVR_TOOLCALL_MAX_CALLS : 1;
    kvr_sbuf_init(&r->all);
    kvr_toolcall_result_init(&r->cur);
    size_t idl = strlen(id);
    snprintf(r->resp_id, sizeof r->resp_id, "resp_%.40s", idl > 24 ? id + idl - 24 : id);
    r->resp_reasoning_at = r->resp_text_at = -1;
    for (uint32_t i = 0; i < KVR_TOOLCALL_MAX_CALLS; i++)
        r->resp_call_at[i] = -1;
    for (uint32_t i = 0; i < KVR_TOOLCALL_MAX_CALLS; i++)
        snprintf(r->call_id[i], sizeof r->call_id[i], "call_%.24s%u", idl > 24 ? id + idl - 24 : id,
                 i);
    return KVR_OK;
}

void kvr_reply_fini(struct kvr_reply *r)
{
    kvr_sbuf_fini(&r->all);
    kvr_toolcall_result_fini(&r->cur);
}

/* Whether the tokenizer can write `text` as text: a marker that is a control token decodes
 * to nothing under a grammar's vocabulary (model/grammar.h), so a grammar waiting for it
 * would keep the model from ever calling. */
static bool writable(const struct kvr_tok *tok, const char *text)
{
    size_t n = strlen(text);
    int32_t ids[64];
    struct kvr_tok_scratch *s = NULL;
    if (!tok || kvr_tok_scratch_create(&s, tok, n) != 0)
        return false;
    int k = kvr_tok_encode(tok, s, text, n, false, true, ids, 64);
    kvr_tok_scratch_destroy(s);
    for (int i = 0; i < k; i++)
        if (kvr_tok_type(tok, ids[i]) == KVR_TOK_TYPE_CONTROL)
            return false;
    return k > 0;
}

/* tool_choice auto: the lazy grammar when the family has a trigger the model can write and
 * the grammar fits its limits; otherwise the answer stays free (a schema the compiler
 * refuses does not fail a request that may not call at all). */
static void constrain_auto(struct kvr_reply *r, struct kvr_openai_req *req,
                           const struct kvr_tok *tok)
{
    const char *trigger = kvr_toolcall_trigger(r->opts.family);
    if (req->grammar || !trigger || !writable(tok, trigger))
        return;
    struct kvr_sbuf g;
    kvr_sbuf_init(&g);
    struct kvr_err err = {0};
    struct kvr_grammar *compiled = NULL;
    if (kvr_toolcall_grammar_lazy(&r->opts, &req->tools, &g, NULL, &err) == KVR_OK &&
        g.len <= KVR_GRAMMAR_MAX_TEXT_BYTES &&
        kvr_grammar_compile(&compiled, g.data, g.len, &err) == KVR_OK) {
        kvr_grammar_destroy(compiled);
        req->grammar = kvr_sbuf_take(&g, &req->grammar_len);
        return;
    }
    kvr_sbuf_fini(&g);
}

int kvr_reply_constrain(struct kvr_reply *r, struct kvr_openai_req *req, const struct kvr_tok *tok,
                        struct kvr_openai_error *e)
{
    const struct kvr_tools *t = &req->tools;
    if (t->choice == KVR_TOOL_CHOICE_AUTO) {
        constrain_auto(r, req, tok);
        return KVR_OK;
    }
    if (t->choice != KVR_TOOL_CHOICE_REQUIRED && t->choice != KVR_TOOL_CHOICE_NAMED)
        return KVR_OK;
    if (req->grammar)
        return kvr_openai_error_set(e, 400, "invalid_request_error", "tool_choice", "invalid_value",
                                    "a forced 'tool_choice' and an output grammar "
                                    "('response_format', 'grammar', 'json_schema') exclude "
                                    "each other");
    struct kvr_sbuf g;
    kvr_sbuf_init(&g);
    struct kvr_err err = {0};
    size_t bad = 0;
    int rc = kvr_toolcall_grammar(&r->opts, t, &g, &bad, &err);
    struct kvr_grammar *compiled = NULL;
    if (!rc && (rc = kvr_grammar_compile(&compiled, g.data, g.len, &err)) == KVR_OK)
        kvr_grammar_destroy(compiled);
    if (rc) {
        kvr_sbuf_fini(&g);
        if (rc == KVR_ENOMEM)
            return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        char param[64];
        snprintf(param, sizeof param, "tools[%zu].function.parameters", bad);
        return kvr_openai_error_set(e, 400, "invalid_request_error", param,
                                    rc == KVR_ENOTSUP ? "unsupported_schema" : "invalid_schema",
                                    "%s: %s", param, err.msg[0] ? err.msg : kvr_strerror(rc));
    }
    req->grammar = kvr_sbuf_take(&g, &req->grammar_len);
    if (!req->grammar)
        return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return KVR_OK;
}

const char *kvr_reply_finish(const struct kvr_reply *r, enum kvr_openai_finish f)
{
    if (r->cur.unfinished && f == KVR_OPENAI_FINISH_LENGTH)
        return "length";
    if (r->cur.n_calls > 0)
        return "tool_calls";
    return kvr_openai_finish_name(f);
}

/* A JSON string from the answer's bytes (invalid UTF-8 as U+FFFD). */
static json_t *jstr(const char *s, size_t len)
{
    if (kvr_utf8_valid_len(s, len) == len)
        return json_stringn(s ? s : "", len);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    kvr_utf8_sanitize_to(&b, s, len);
    json_t *j = b.failed ? NULL : json_stringn(b.data ? b.data : "", b.len);
    kvr_sbuf_fini(&b);
    return j;
}

static json_t *sbuf_str(const struct kvr_sbuf *b, size_t from)
{
    return jstr(b->data ? b->data + from : "", b->len - from);
}

/* The answer with `len` more bytes, parsed again; bytes that only extend the text or the
 * reasoning are appended without a parse (kvr_toolcall_plain), so a long answer is not
 * parsed once per token. */
static int reparse(struct kvr_reply *r, const char *text, size_t len, bool final)
{
    kvr_sbuf_append(&r->all, text, len);
    if (r->all.failed)
        return KVR_ENOMEM;
    if (!final && kvr_toolcall_plain(&r->opts, r->cur.tail, text, len)) {
        kvr_sbuf_append(r->cur.tail == KVR_TOOLCALL_TAIL_CONTENT ? &r->cur.content
                                                                 : &r->cur.reasoning,
                        text, len);
        return r->cur.content.failed || r->cur.reasoning.failed ? KVR_ENOMEM : KVR_OK;
    }
    int rc = kvr_toolcall_parse(&r->opts, r->all.data, r->all.len, final, &r->cur);
    while (r->cur.n_calls > r->max_calls) {
        struct kvr_toolcall *c = &r->cur.calls[--r->cur.n_calls];
        kvr_free(c->name);
        kvr_free(c->arguments);
    }
    return rc;
}

/* ---- Chat Completions ------------------------------------------------------------------ */

static json_t *head(const struct kvr_openai_meta *m, const char *object)
{
    return json_pack("{s:s,s:s,s:I,s:s}", "id", m->id, "object", object, "created",
                     (json_int_t)m->created, "model", m->model ? m->model : "");
}

static json_t *usage(const struct kvr_reply_info *in)
{
    return json_pack("{s:I,s:I,s:I}", "prompt_tokens", (json_int_t)in->prompt_tokens,
                     "completion_tokens", (json_int_t)in->completion_tokens, "total_tokens",
                     (json_int_t)in->prompt_tokens + in->completion_tokens);
}

static json_t *call_object(const struct kvr_reply *r, uint32_t i, bool delta)
{
    const struct kvr_toolcall *c = &r->cur.calls[i];
    json_t *o = json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", r->call_id[i], "type", "function",
                          "function", "name", c->name, "arguments", delta ? "" : c->arguments);
    if (o && delta)
        json_object_set_new(o, "index", json_integer(i));
    return o;
}

static int dump_sink(const char *buf, size_t size, void *data)
{
    struct kvr_sbuf *b = data;
    kvr_sbuf_append(b, buf, size);
    return b->failed ? -1 : 0;
}

int kvr_reply_dump(struct kvr_sbuf *out, json_t *j)
{
    int rc = j && !json_dump_callback(j, dump_sink, out, JSON_COMPACT | JSON_REAL_PRECISION(9))
                 ? KVR_OK
                 : KVR_ENOMEM;
    json_decref(j);
    return rc || out->failed ? KVR_ENOMEM : KVR_OK;
}

static int chunk(struct kvr_sbuf *out, const struct kvr_reply_info *in, json_t *delta,
                 const char *finish, const json_t *lp)
{
    json_t *root = head(in->meta, "chat.completion.chunk");
    json_t *choice = json_pack("{s:i,s:o,s:o,s:o}", "index", 0, "delta", delta, "logprobs",
                               lp ? json_deep_copy(lp) : json_null(), "finish_reason",
                               finish ? json_string(finish) : json_null());
    if (!root || !choice || json_object_set_new(root, "choices", json_pack("[o]", choice)) ||
        (in->meta->include_usage && json_object_set_new(root, "usage", json_null()))) {
        if (!root)
            json_decref(choice);
        json_decref(root);
        return KVR_ENOMEM;
    }
    kvr_sbuf_puts(out, "data: ");
    int rc = kvr_reply_dump(out, root);
    kvr_sbuf_puts(out, "\n\n");
    return rc;
}

/* What is new since the last push, as chunks: reasoning, text, then each new call as its
 * head (id, name, empty arguments) and its arguments. */
static int chat_deltas(struct kvr_reply *r, struct kvr_sbuf *out, const struct kvr_reply_info *in)
{
    const struct kvr_toolcall_result *c = &r->cur;
    int rc = KVR_OK;
    if (c->reasoning.len > r->sent_reasoning) {
        json_t *d =
            json_pack("{s:o}", "reasoning_content", sbuf_str(&c->reasoning, r->sent_reasoning));
        rc = chunk(out, in, d, NULL, NULL);
        r->sent_reasoning = c->reasoning.len;
    }
    if (!rc && (c->content.len > r->sent_content || in->logprobs)) {
        json_t *d = json_pack("{s:o}", "content", sbuf_str(&c->content, r->sent_content));
        rc = chunk(out, in, d, NULL, in->logprobs);
        r->sent_content = c->content.len;
    }
    for (; !rc && r->sent_calls < c->n_calls; r->sent_calls++) {
        uint32_t i = r->sent_calls;
        rc =
            chunk(out, in, json_pack("{s:[o]}", "tool_calls", call_object(r, i, true)), NULL, NULL);
        if (!rc)
            rc = chunk(out, in,
                       json_pack("{s:[{s:I,s:{s:s}}]}", "tool_calls", "index", (json_int_t)i,
                                 "function", "arguments", c->calls[i].arguments),
                       NULL, NULL);
    }
    return rc;
}

int kvr_reply_sse_start(struct kvr_reply *r, struct kvr_sbuf *out, const struct kvr_reply_info *in)
{
    if (r->format == KVR_REPLY_RESPONSES)
        return kvr_responses_sse_start(r, out, in);
    return chunk(out, in, json_pack("{s:s,s:s}", "role", "assistant", "content", ""), NULL, NULL);
}

int kvr_reply_sse(struct kvr_reply *r, struct kvr_sbuf *out, const struct kvr_reply_info *in,
                  const char *text, size_t len, bool done)
{
    int rc = reparse(r, text, len, done);
    if (rc)
        return rc;
    if (r->format == KVR_REPLY_RESPONSES)
        return kvr_responses_sse(r, out, in, done);
    if ((rc = chat_deltas(r, out, in)) || !done)
        return rc;
    rc = chunk(out, in, json_object(), kvr_reply_finish(r, in->finish), NULL);
    if (!rc && in->meta->include_usage) {
        json_t *root = head(in->meta, "chat.completion.chunk");
        if (!root || json_object_set_new(root, "choices", json_array()) ||
            json_object_set_new(root, "usage", usage(in))) {
            json_decref(root);
            return KVR_ENOMEM;
        }
        kvr_sbuf_puts(out, "data: ");
        rc = kvr_reply_dump(out, root);
        kvr_sbuf_puts(out, "\n\n");
    }
    kvr_sbuf_puts(out, "data: [DONE]\n\n");
    return rc || out->failed ? KVR_ENOMEM : KVR_OK;
}

char *kvr_reply_json(struct kvr_reply *r, const struct kvr_reply_info *in, const char *text,
                     size_t len, size_t *out_len)
{
    if (reparse(r, text, len, true))
        return NULL;
    if (r->format == KVR_REPLY_RESPONSES)
        return kvr_responses_json(r, in, out_len);
    const struct kvr_toolcall_result *c = &r->cur;
    json_t *msg = json_pack("{s:s}", "role", "assistant");
    bool calls = c->n_calls > 0;
    /* With calls, text that is only the whitespace around them is no text. */
    size_t b = 0, e = c->content.len;
    while (calls && b < e && strchr(" \n\r\t", c->content.data[b]))
        b++;
    while (calls && e > b && strchr(" \n\r\t", c->content.data[e - 1]))
        e--;
    json_object_set_new(msg, "content",
                        calls && b == e ? json_null() : jstr(c->content.data + b, e - b));
    if (c->reasoning.len)
        json_object_set_new(msg, "reasoning_content", sbuf_str(&c->reasoning, 0));
    if (calls) {
        json_t *list = json_array();
        for (uint32_t i = 0; i < c->n_calls; i++)
            json_array_append_new(list, call_object(r, i, false));
        json_object_set_new(msg, "tool_calls", list);
    }
    const char *fin = kvr_reply_finish(r, in->finish);
    json_t *root = head(in->meta, "chat.completion");
    json_t *choice = json_pack("{s:i,s:o,s:o,s:s}", "index", 0, "message", msg, "logprobs",
                               in->logprobs ? json_deep_copy(in->logprobs) : json_null(),
                               "finish_reason", fin ? fin : "stop");
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    if (!root || !choice || json_object_set_new(root, "choices", json_pack("[o]", choice)) ||
        json_object_set_new(root, "usage", usage(in)) || kvr_reply_dump(&out, json_incref(root))) {
        json_decref(root);
        kvr_sbuf_fini(&out);
        return NULL;
    }
    json_decref(root);
    return kvr_sbuf_take(&out, out_len);
}
