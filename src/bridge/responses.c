/* responses.c - the Responses API on the chat path (see responses.h).
 *
 * Sections: the store, the request (Responses body -> chat body), the answer (output items,
 * the response object, stream events). */
#include "bridge/responses.h"

#include "bridge/generation.h"

#include "core/alloc.h"
#include "core/err.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ---- the store --------------------------------------------------------------------------- */

/* A ring of the last finished responses: id -> the conversation (chat messages, the
 * answer's included) a follow-up continues. */
struct kvr_responses_store {
    pthread_mutex_t lock;
    struct {
        char id[48];
        json_t *messages;
    } slot[KVR_RESPONSES_STORE];
    uint32_t next;
};

struct kvr_responses_store *kvr_responses_store_create(void)
{
    struct kvr_responses_store *s = kvr_calloc(1, sizeof *s);
    if (s && pthread_mutex_init(&s->lock, NULL) != 0) {
        kvr_free(s);
        return NULL;
    }
    return s;
}

void kvr_responses_store_destroy(struct kvr_responses_store *s)
{
    if (!s)
        return;
    for (uint32_t i = 0; i < KVR_RESPONSES_STORE; i++)
        json_decref(s->slot[i].messages);
    pthread_mutex_destroy(&s->lock);
    kvr_free(s);
}

/* Takes `messages`. */
static void store_put(struct kvr_responses_store *s, const char *id, json_t *messages)
{
    if (!s || !messages) {
        json_decref(messages);
        return;
    }
    pthread_mutex_lock(&s->lock);
    uint32_t i = s->next++ % KVR_RESPONSES_STORE;
    json_decref(s->slot[i].messages);
    snprintf(s->slot[i].id, sizeof s->slot[i].id, "%s", id);
    s->slot[i].messages = messages;
    pthread_mutex_unlock(&s->lock);
}

/* A copy of the stored conversation, or NULL. */
static json_t *store_get(struct kvr_responses_store *s, const char *id)
{
    json_t *m = NULL;
    if (!s)
        return NULL;
    pthread_mutex_lock(&s->lock);
    for (uint32_t i = 0; i < KVR_RESPONSES_STORE && !m; i++)
        if (s->slot[i].messages && !strcmp(s->slot[i].id, id))
            m = json_deep_copy(s->slot[i].messages);
    pthread_mutex_unlock(&s->lock);
    return m;
}

/* ---- the request ------------------------------------------------------------------------- */

static int bad(struct kvr_openai_error *e, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int bad(struct kvr_openai_error *e, const char *param, const char *fmt, ...)
{
    char msg[KVR_OPENAI_ERR_MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvr_openai_error_set(e, 400, "invalid_request_error", param, "invalid_value", "%s", msg);
}

static json_t *field(const json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return json_is_null(v) ? NULL : v;
}

/* A message's content: a string, or text parts joined. NULL when it is neither. */
static json_t *item_text(const json_t *c)
{
    if (json_is_string(c))
        return json_incref((json_t *)c);
    if (!json_is_array(c))
        return NULL;
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    size_t i;
    json_t *p;
    bool ok = true;
    json_array_foreach(c, i, p)
    {
        const char *t = json_string_value(json_object_get(p, "type"));
        json_t *text = json_object_get(p, "text");
        ok = ok && t && json_is_string(text) &&
             (!strcmp(t, "input_text") || !strcmp(t, "output_text") || !strcmp(t, "text"));
        if (ok)
            kvr_sbuf_append(&b, json_string_value(text), json_string_length(text));
    }
    json_t *j = ok && !b.failed ? json_stringn(b.data ? b.data : "", b.len) : NULL;
    kvr_sbuf_fini(&b);
    return j;
}

/* One input item appended to `msgs` as chat messages; function calls join the assistant
 * message before them when it has calls already. */
static int add_item(json_t *msgs, const json_t *it, size_t i, struct kvr_openai_error *e)
{
    char param[64];
    snprintf(param, sizeof param, "input[%zu]", i);
    if (!json_is_object(it))
        return bad(e, param, "'%s' must be an object", param);
    const char *type = json_string_value(field(it, "type"));
    const char *role = json_string_value(field(it, "role"));
    if (!type || !strcmp(type, "message")) {
        json_t *text = item_text(field(it, "content"));
        if (!role || !text) {
            json_decref(text);
            return bad(e, param, "'%s' must be a message with a role and text content", param);
        }
        if (strcmp(role, "user") && strcmp(role, "system") && strcmp(role, "developer") &&
            strcmp(role, "assistant")) {
            json_decref(text);
            return bad(e, param, "'%s.role' must be user, system, developer or assistant", param);
        }
        return json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", role, "content", text))
                   ? KVR_ENOMEM
                   : KVR_OK;
    }
    if (!strcmp(type, "reasoning"))
        return KVR_OK;
    const char *call_id = json_string_value(field(it, "call_id"));
    if (!strcmp(type, "function_call")) {
        const char *name = json_string_value(field(it, "name"));
        const char *args = json_string_value(field(it, "arguments"));
        if (!call_id || !name || !args)
            return bad(e, param, "'%s' (function_call) needs call_id, name and arguments", param);
        json_t *call = json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", call_id, "type", "function",
                                 "function", "name", name, "arguments", args);
        json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
        json_t *calls = json_object_get(last, "tool_calls");
        if (json_is_array(calls))
            return json_array_append_new(calls, call) ? KVR_ENOMEM : KVR_OK;
        return json_array_append_new(msgs, json_pack("{s:s,s:n,s:[o]}", "role", "assistant",
                                                     "content", "tool_calls", call))
                   ? KVR_ENOMEM
                   : KVR_OK;
    }
    if (!strcmp(type, "function_call_output")) {
        json_t *out = field(it, "output");
        json_t *text = json_is_string(out) ? json_incref(out) : item_text(out);
        if (!call_id || !text) {
            json_decref(text);
            return bad(e, param, "'%s' (function_call_output) needs call_id and output", param);
        }
        return json_array_append_new(msgs, json_pack("{s:s,s:s,s:o}", "role", "tool",
                                                     "tool_call_id", call_id, "content", text))
                   ? KVR_ENOMEM
                   : KVR_OK;
    }
    return bad(e, param, "'%s': items of type '%.32s' are not supported", param, type);
}

/* Function tools from Responses' flat shape to chat's nested one. */
static int convert_tools(const json_t *in, json_t *chat, struct kvr_openai_error *e)
{
    json_t *tools = field(in, "tools");
    if (!tools)
        return KVR_OK;
    if (!json_is_array(tools))
        return bad(e, "tools", "'tools' must be an array");
    json_t *list = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        const char *type = json_string_value(json_object_get(t, "type"));
        if (!type || strcmp(type, "function") != 0) {
            json_decref(list);
            return bad(e, "tools", "tools[%zu]: only function tools are supported", i);
        }
        json_t *fn = json_deep_copy(t);
        json_object_del(fn, "type");
        json_array_append_new(list, json_pack("{s:s,s:o}", "type", "function", "function", fn));
    }
    json_object_set_new(chat, "tools", list);
    json_t *c = field(in, "tool_choice");
    if (json_is_object(c)) {
        const char *n = json_string_value(json_object_get(c, "name"));
        if (!n)
            return bad(e, "tool_choice", "'tool_choice' must name a function");
        json_object_set_new(chat, "tool_choice",
                            json_pack("{s:s,s:{s:s}}", "type", "function", "function", "name", n));
    } else if (c) {
        json_object_set(chat, "tool_choice", c);
    }
    return KVR_OK;
}

/* Fields read here, fields copied as they are, fields accepted only neutral. */
static int check_fields(const json_t *in, struct kvr_openai_error *e)
{
    static const char *const known[] = {"model",
                                        "input",
                                        "instructions",
                                        "tools",
                                        "tool_choice",
                                        "temperature",
                                        "top_p",
                                        "max_output_tokens",
                                        "stream",
                                        "previous_response_id",
                                        "parallel_tool_calls",
                                        "store",
                                        "metadata",
                                        "user",
                                        "truncation",
                                        "text",
                                        "include",
                                        "reasoning",
                                        "seed",
                                        "stream_options",
                                        "service_tier",
                                        "safety_identifier",
                                        "prompt_cache_key",
                                        "logit_bias",
                                        NULL};
    int rc = kvr_openai_check_keys(in, NULL, known, e);
    if (rc)
        return rc;
    json_t *v;
    if ((v = field(in, "truncation")) &&
        !(json_is_string(v) && !strcmp(json_string_value(v), "disabled")))
        return bad(e, "truncation", "'truncation' is accepted only as \"disabled\"");
    if ((v = field(in, "include")) && !(json_is_array(v) && json_array_size(v) == 0))
        return bad(e, "include", "'include' is accepted only as []");
    v = field(field(in, "text"), "format");
    const char *ft = json_string_value(field(v, "type"));
    if (v && !(ft && !strcmp(ft, "text")))
        return bad(e, "text.format", "'text.format' is accepted only as {\"type\": \"text\"}");
    if ((v = field(in, "reasoning")) && json_object_size(v) > 0 &&
        !(json_object_size(v) == 1 && field(v, "summary") == NULL && field(v, "effort") == NULL))
        return bad(e, "reasoning", "reasoning controls are not supported");
    return KVR_OK;
}

static int build_messages(const json_t *in, json_t *msgs, struct kvr_responses_store *store,
                          struct kvr_openai_error *e)
{
    json_t *v = field(in, "instructions");
    if (v && !json_is_string(v))
        return bad(e, "instructions", "'instructions' must be a string");
    if (v)
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "system", "content", v));
    if ((v = field(in, "previous_response_id"))) {
        json_t *prev = json_is_string(v) ? store_get(store, json_string_value(v)) : NULL;
        if (!prev)
            return kvr_openai_error_set(e, 400, "invalid_request_error", "previous_response_id",
                                        "previous_response_not_found",
                                        "Previous response with id '%.64s' not found",
                                        json_is_string(v) ? json_string_value(v) : "");
        json_array_extend(msgs, prev);
        json_decref(prev);
    }
    v = field(in, "input");
    if (json_is_string(v))
        return json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "user", "content", v))
                   ? KVR_ENOMEM
                   : KVR_OK;
    if (!json_is_array(v))
        return bad(e, "input", "'input' must be a string or an array of items");
    size_t i;
    json_t *it;
    json_array_foreach(v, i, it)
    {
        int rc = add_item(msgs, it, i, e);
        if (rc)
            return rc;
    }
    return KVR_OK;
}

int kvr_responses_to_chat(const char *body, size_t len, struct kvr_responses_store *store,
                          char **out, size_t *out_len, bool *keep, struct kvr_openai_error *e)
{
    *out = NULL;
    *keep = true;
    json_error_t je;
    json_t *in = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!json_is_object(in)) {
        json_decref(in);
        return kvr_openai_error_set(e, 400, "invalid_request_error", NULL, "invalid_json",
                                    "the request body must be a JSON object (%s)", je.text);
    }
    json_t *chat = json_object(), *msgs = json_array();
    json_object_set_new(chat, "messages", msgs);
    int rc = check_fields(in, e);
    json_t *st = field(in, "store");
    if (!rc && st && !json_is_boolean(st))
        rc = bad(e, "store", "'store' must be a boolean");
    *keep = !json_is_false(st);
    if (!rc)
        rc = build_messages(in, msgs, store, e);
    if (!rc)
        rc = convert_tools(in, chat, e);
    static const char *const same[] = {
        "model",          "temperature", "top_p",      "stream", "seed", "parallel_tool_calls",
        "stream_options", "user",        "logit_bias", NULL};
    for (size_t i = 0; !rc && same[i]; i++)
        if (field(in, same[i]))
            json_object_set(chat, same[i], field(in, same[i]));
    if (!rc && field(in, "max_output_tokens"))
        json_object_set(chat, "max_tokens", field(in, "max_output_tokens"));
    if (!rc) {
        *out = json_dumps(chat, JSON_COMPACT);
        if (!*out)
            rc = kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        else {
            /* json_dumps allocates with malloc: the caller frees with kvr_free. */
            size_t n = strlen(*out);
            char *copy = kvr_malloc(n + 1);
            if (copy)
                memcpy(copy, *out, n + 1);
            free(*out);
            *out = copy;
            *out_len = n;
            if (!copy)
                rc = kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        }
    }
    json_decref(chat);
    json_decref(in);
    return rc;
}

int kvr_responses_prepare(struct kvr_generation *g, struct kvr_responses_store *store,
                          const char *body, size_t len, const char *budget_header,
                          struct kvr_openai_error *e)
{
    char *chat = NULL;
    size_t n = 0;
    bool keep = true;
    int rc = kvr_responses_to_chat(body, len, store, &chat, &n, &keep, e);
    if (rc)
        return rc;
    kvr_generation_use_responses(g, keep ? store : NULL);
    rc = kvr_generation_prepare(g, chat, n, budget_header, e);
    kvr_free(chat);
    return rc;
}

/* ---- the answer -------------------------------------------------------------------------- */

static json_t *text_of(const struct kvr_sbuf *b)
{
    return json_stringn(b->data ? b->data : "", b->len);
}

/* Text worth a message item: more than the whitespace around calls. */
static bool has_text(const struct kvr_sbuf *b)
{
    for (size_t i = 0; i < b->len; i++)
        if (!strchr(" \n\r\t", b->data[i]))
            return true;
    return false;
}

static json_t *reasoning_item(const struct kvr_reply *r, bool done)
{
    char id[64];
    snprintf(id, sizeof id, "rs_%s", r->resp_id + 5);
    return json_pack("{s:s,s:s,s:[],s:[{s:s,s:o}],s:s}", "type", "reasoning", "id", id, "summary",
                     "content", "type", "reasoning_text", "text",
                     done ? text_of(&r->cur.reasoning) : json_string(""), "status",
                     done ? "completed" : "in_progress");
}

static json_t *text_part(const struct kvr_reply *r, bool done)
{
    return json_pack("{s:s,s:o,s:[]}", "type", "output_text", "text",
                     done ? text_of(&r->cur.content) : json_string(""), "annotations");
}

static json_t *message_item(const struct kvr_reply *r, bool done)
{
    char id[64];
    snprintf(id, sizeof id, "msg_%s", r->resp_id + 5);
    json_t *content = done ? json_pack("[o]", text_part(r, true)) : json_array();
    return json_pack("{s:s,s:s,s:s,s:s,s:o}", "type", "message", "id", id, "status",
                     done ? "completed" : "in_progress", "role", "assistant", "content", content);
}

static json_t *call_item(const struct kvr_reply *r, uint32_t i, bool done)
{
    char id[64];
    snprintf(id, sizeof id, "fc_%s_%u", r->resp_id + 5, i);
    return json_pack("{s:s,s:s,s:s,s:s,s:s,s:s}", "type", "function_call", "id", id, "call_id",
                     r->call_id[i], "name", r->cur.calls[i].name, "arguments",
                     done ? r->cur.calls[i].arguments : "", "status",
                     done ? "completed" : "in_progress");
}

/* The items in the order they were opened (a whole answer: reasoning, text, calls). */
static json_t *output_items(const struct kvr_reply *r)
{
    json_t *out = json_array();
    for (int k = 0; k < (int)r->resp_items; k++) {
        if (k == r->resp_reasoning_at)
            json_array_append_new(out, reasoning_item(r, true));
        else if (k == r->resp_text_at)
            json_array_append_new(out, message_item(r, true));
        for (uint32_t i = 0; i < r->cur.n_calls; i++)
            if (r->resp_call_at[i] == k)
                json_array_append_new(out, call_item(r, i, true));
    }
    return out;
}

static json_t *response_object(const struct kvr_reply *r, const struct kvr_reply_info *in,
                               const char *status, bool done)
{
    bool cut = done && in->finish == KVR_OPENAI_FINISH_LENGTH;
    json_t *o = json_pack(
        "{s:s,s:s,s:I,s:s,s:s,s:o,s:n,s:n,s:s,s:{s:{s:s}},s:b}", "id", r->resp_id, "object",
        "response", "created_at", (json_int_t)in->meta->created, "status",
        cut ? "incomplete" : status, "model", in->meta->model ? in->meta->model : "", "output",
        done ? output_items(r) : json_array(), "error", "previous_response_id", "truncation",
        "disabled", "text", "format", "type", "text", "store", r->store != NULL);
    if (!o)
        return NULL;
    json_object_set_new(o, "incomplete_details",
                        cut ? json_pack("{s:s}", "reason", "max_output_tokens") : json_null());
    json_object_set_new(o, "usage",
                        done ? json_pack("{s:I,s:{s:i},s:I,s:{s:i},s:I}", "input_tokens",
                                         (json_int_t)in->prompt_tokens, "input_tokens_details",
                                         "cached_tokens", 0, "output_tokens",
                                         (json_int_t)in->completion_tokens, "output_tokens_details",
                                         "reasoning_tokens", 0, "total_tokens",
                                         (json_int_t)in->prompt_tokens + in->completion_tokens)
                             : json_null());
    return o;
}

/* The conversation so far, the answer included, for a follow-up's previous_response_id.
 * A leading system message came from this request's instructions, which do not carry over. */
static void store_answer(struct kvr_reply *r)
{
    if (!r->store)
        return;
    json_t *msgs = json_deep_copy(r->resp_request);
    json_t *first = json_array_get(msgs, 0);
    const char *role = json_string_value(json_object_get(first, "role"));
    if (role && !strcmp(role, "system"))
        json_array_remove(msgs, 0);
    json_t *a = json_pack("{s:s,s:o}", "role", "assistant", "content",
                          has_text(&r->cur.content) ? text_of(&r->cur.content) : json_null());
    if (a && r->cur.n_calls) {
        json_t *calls = json_array();
        for (uint32_t i = 0; i < r->cur.n_calls; i++)
            json_array_append_new(calls,
                                  json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", r->call_id[i], "type",
                                            "function", "function", "name", r->cur.calls[i].name,
                                            "arguments", r->cur.calls[i].arguments));
        json_object_set_new(a, "tool_calls", calls);
    }
    if (!msgs || !a || json_array_append_new(msgs, a)) {
        json_decref(msgs);
        return;
    }
    store_put(r->store, r->resp_id, msgs);
}

static void order_whole(struct kvr_reply *r)
{
    r->resp_items = 0;
    r->resp_reasoning_at = r->cur.reasoning.len ? (int)r->resp_items++ : -1;
    bool text = has_text(&r->cur.content) || r->cur.n_calls == 0;
    r->resp_text_at = text ? (int)r->resp_items++ : -1;
    for (uint32_t i = 0; i < r->cur.n_calls; i++)
        r->resp_call_at[i] = (int)r->resp_items++;
}

char *kvr_responses_json(struct kvr_reply *r, const struct kvr_reply_info *in, size_t *out_len)
{
    order_whole(r);
    store_answer(r);
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    if (kvr_reply_dump(&out, response_object(r, in, "completed", true))) {
        kvr_sbuf_fini(&out);
        return NULL;
    }
    return kvr_sbuf_take(&out, out_len);
}

/* "event: TYPE\ndata: {"type": TYPE, "sequence_number": n, ...}\n\n"; takes `j`. */
static int event(struct kvr_reply *r, struct kvr_sbuf *out, const char *type, json_t *j)
{
    if (!j || json_object_set_new(j, "type", json_string(type)) ||
        json_object_set_new(j, "sequence_number", json_integer(r->resp_seq++))) {
        json_decref(j);
        return KVR_ENOMEM;
    }
    kvr_sbuf_printf(out, "event: %s\ndata: ", type);
    int rc = kvr_reply_dump(out, j);
    kvr_sbuf_puts(out, "\n\n");
    return rc || out->failed ? KVR_ENOMEM : KVR_OK;
}

static json_t *item_of(const struct kvr_reply *r, int k, bool done)
{
    if (k == r->resp_reasoning_at)
        return reasoning_item(r, done);
    if (k == r->resp_text_at)
        return message_item(r, done);
    for (uint32_t i = 0; i < r->cur.n_calls; i++)
        if (r->resp_call_at[i] == k)
            return call_item(r, i, done);
    return NULL;
}

static const char *item_id(json_t *item)
{
    return json_string_value(json_object_get(item, "id"));
}

int kvr_responses_sse_start(struct kvr_reply *r, struct kvr_sbuf *out,
                            const struct kvr_reply_info *in)
{
    r->resp_reasoning_at = r->resp_text_at = -1;
    int rc = event(r, out, "response.created",
                   json_pack("{s:o}", "response", response_object(r, in, "in_progress", false)));
    if (!rc)
        rc = event(r, out, "response.in_progress",
                   json_pack("{s:o}", "response", response_object(r, in, "in_progress", false)));
    return rc;
}

/* Open output item k (added; and for text its content part). */
static int open_item(struct kvr_reply *r, struct kvr_sbuf *out, int k)
{
    json_t *item = item_of(r, k, false);
    const char *id = item_id(item);
    char idc[80];
    snprintf(idc, sizeof idc, "%s", id ? id : "");
    int rc = event(r, out, "response.output_item.added",
                   json_pack("{s:i,s:o}", "output_index", k, "item", item));
    if (!rc && k == r->resp_text_at)
        rc = event(r, out, "response.content_part.added",
                   json_pack("{s:s,s:i,s:i,s:o}", "item_id", idc, "output_index", k,
                             "content_index", 0, "part", text_part(r, false)));
    return rc;
}

/* A text or reasoning delta of item k. */
static int delta(struct kvr_reply *r, struct kvr_sbuf *out, int k, const char *type,
                 const struct kvr_sbuf *b, size_t from)
{
    json_t *item = item_of(r, k, false);
    json_t *ev =
        json_pack("{s:O,s:i,s:i,s:s%}", "item_id", json_object_get(item, "id"), "output_index", k,
                  "content_index", 0, "delta", b->data ? b->data + from : "", b->len - from);
    json_decref(item);
    return event(r, out, type, ev);
}

/* Close every open item in order (an answer with neither text nor calls still gets its
 * empty message), then response.completed. */
static int finish_stream(struct kvr_reply *r, struct kvr_sbuf *out, const struct kvr_reply_info *in)
{
    int rc = KVR_OK;
    if (r->resp_text_at < 0 && r->cur.n_calls == 0) {
        r->resp_text_at = (int)r->resp_items++;
        rc = open_item(r, out, r->resp_text_at);
    }
    for (int k = 0; !rc && k < (int)r->resp_items; k++) {
        json_t *item = item_of(r, k, true);
        const char *id = item_id(item);
        if (k == r->resp_text_at) {
            rc = event(r, out, "response.output_text.done",
                       json_pack("{s:s,s:i,s:i,s:o}", "item_id", id, "output_index", k,
                                 "content_index", 0, "text", text_of(&r->cur.content)));
            if (!rc)
                rc = event(r, out, "response.content_part.done",
                           json_pack("{s:s,s:i,s:i,s:o}", "item_id", id, "output_index", k,
                                     "content_index", 0, "part", text_part(r, true)));
        } else if (k == r->resp_reasoning_at) {
            rc = event(r, out, "response.reasoning_text.done",
                       json_pack("{s:s,s:i,s:i,s:o}", "item_id", id, "output_index", k,
                                 "content_index", 0, "text", text_of(&r->cur.reasoning)));
        }
        if (!rc)
            rc = event(r, out, "response.output_item.done",
                       json_pack("{s:i,s:O}", "output_index", k, "item", item));
        json_decref(item);
    }
    store_answer(r);
    /* A cut answer ends with response.incomplete, as OpenAI's does. */
    bool cut = in->finish == KVR_OPENAI_FINISH_LENGTH;
    if (!rc)
        rc = event(r, out, cut ? "response.incomplete" : "response.completed",
                   json_pack("{s:o}", "response", response_object(r, in, "completed", true)));
    return rc;
}

int kvr_responses_sse(struct kvr_reply *r, struct kvr_sbuf *out, const struct kvr_reply_info *in,
                      bool done)
{
    const struct kvr_toolcall_result *c = &r->cur;
    int rc = KVR_OK;
    if (c->reasoning.len > r->sent_reasoning) {
        if (r->resp_reasoning_at < 0) {
            r->resp_reasoning_at = (int)r->resp_items++;
            rc = open_item(r, out, r->resp_reasoning_at);
        }
        if (!rc)
            rc = delta(r, out, r->resp_reasoning_at, "response.reasoning_text.delta", &c->reasoning,
                       r->sent_reasoning);
        r->sent_reasoning = c->reasoning.len;
    }
    if (!rc && c->content.len > r->sent_content &&
        (r->resp_text_at >= 0 || has_text(&c->content))) {
        if (r->resp_text_at < 0) {
            r->resp_text_at = (int)r->resp_items++;
            rc = open_item(r, out, r->resp_text_at);
        }
        if (!rc)
            rc = delta(r, out, r->resp_text_at, "response.output_text.delta", &c->content,
                       r->sent_content);
        r->sent_content = c->content.len;
    }
    for (; !rc && r->sent_calls < c->n_calls; r->sent_calls++) {
        uint32_t i = r->sent_calls;
        int k = r->resp_call_at[i] = (int)r->resp_items++;
        rc = open_item(r, out, k);
        char id[64];
        snprintf(id, sizeof id, "fc_%s_%u", r->resp_id + 5, i);
        if (!rc)
            rc = event(r, out, "response.function_call_arguments.delta",
                       json_pack("{s:s,s:i,s:s}", "item_id", id, "output_index", k, "delta",
                                 c->calls[i].arguments));
        if (!rc)
            rc = event(r, out, "response.function_call_arguments.done",
                       json_pack("{s:s,s:i,s:s}", "item_id", id, "output_index", k, "arguments",
                                 c->calls[i].arguments));
    }
    return rc || !done ? rc : finish_stream(r, out, in);
}

int kvr_responses_sse_error(struct kvr_reply *r, struct kvr_sbuf *out,
                            const struct kvr_reply_info *in, const struct kvr_openai_error *err)
{
    const char *code = err->code ? err->code : "server_error";
    int rc = event(r, out, "error",
                   json_pack("{s:s,s:s,s:o}", "code", code, "message", err->message, "param",
                             err->param ? json_string(err->param) : json_null()));
    json_t *resp = response_object(r, in, "failed", false);
    if (resp)
        json_object_set_new(resp, "error",
                            json_pack("{s:s,s:s}", "code", code, "message", err->message));
    if (!rc)
        rc = event(r, out, "response.failed", json_pack("{s:o}", "response", resp));
    return rc;
}
