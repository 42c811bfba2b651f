/* reply.h - a chat answer split into reasoning, text and tool calls while it is generated,
 * and written as Chat Completions JSON and SSE chunks (or, format RESPONSES, as the
 * Responses API's objects and events, responses.h).
 *
 * generation.c feeds it the text the stop-string cutter releases (kvr_reply_sse while
 * streaming, or everything at once for kvr_reply_json). Each push parses the whole answer
 * so far (toolcall.h) and sends only what is new: text and reasoning grow, calls are
 * appended once closed, each as the OpenAI SDK reads a tool call delta: {"index", "id",
 * "type": "function", "function": {"name", "arguments": ""}} and then the arguments.
 * A finished answer with calls has finish_reason "tool_calls"; one that ran out of tokens
 * inside a call has "length" and no call.
 * Owned by one generation, used by its thread only. */
#ifndef KVR_BRIDGE_REPLY_H
#define KVR_BRIDGE_REPLY_H

#include "bridge/openai.h"
#include "bridge/toolcall.h"
#include "core/sbuf.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_responses_store;

enum kvr_reply_format {
    KVR_REPLY_CHAT,      /* /v1/chat/completions */
    KVR_REPLY_RESPONSES, /* /v1/responses */
    KVR_REPLY_FORMAT_COUNT
};

/* What every write needs from the generation. */
struct kvr_reply_info {
    const struct kvr_openai_meta *meta;
    enum kvr_openai_finish finish; /* at the end */
    uint32_t prompt_tokens, completion_tokens;
    const json_t *logprobs; /* may be NULL */
};

struct kvr_reply {
    enum kvr_reply_format format;
    struct kvr_toolcall_opts opts;
    uint32_t max_calls;  /* 1 without parallel_tool_calls: later calls are dropped */
    struct kvr_sbuf all; /* the answer so far */
    struct kvr_toolcall_result cur;
    size_t sent_content, sent_reasoning;
    uint32_t sent_calls;
    char call_id[KVR_TOOLCALL_MAX_CALLS][40];
    /* RESPONSES only (responses.c): the request's input items and its store, borrowed. */
    const json_t *resp_request;
    struct kvr_responses_store *store;
    char resp_id[48];                    /* "resp_..." */
    uint32_t resp_seq;                   /* sequence_number of the next event */
    int resp_reasoning_at, resp_text_at; /* their output_index once opened, else -1 */
    uint32_t resp_items;                 /* output items opened so far */
    int resp_call_at[KVR_TOOLCALL_MAX_CALLS];
};

/* Whether a chat request needs a reply at all: tools to parse, or a template that writes
 * reasoning (<think>, harmony). Without one, the answer is plain text as before. */
bool kvr_reply_wanted(const struct kvr_chat *chat, const struct kvr_openai_req *req);

/* `prompt` (len bytes) is the rendered prompt: one that ends inside <think> starts the
 * answer in reasoning. `id` seeds the call ids. 0 or KVR_ENOMEM. */
int kvr_reply_init(struct kvr_reply *r, enum kvr_reply_format format, const struct kvr_chat *chat,
                   const struct kvr_openai_req *req, const char *prompt, size_t len,
                   const char *id);
void kvr_reply_fini(struct kvr_reply *r);

/* A forced tool choice ("required" or a named function): req->grammar becomes the call
 * syntax with the tools' schemas (toolcall_grammar.h), compiled once to check it, which the
 * tail then decodes under. A schema the compiler refuses is a 400 naming the tool; so is
 * an output grammar given beside it. "auto": the lazy grammar (free text until the
 * family's trigger, then the calls) when `tok` can write the trigger as text and the grammar
 * compiles; else no grammar. 0 or KVR_EINVAL / KVR_ENOMEM with `e` filled. */
struct kvr_tok;
int kvr_reply_constrain(struct kvr_reply *r, struct kvr_openai_req *req, const struct kvr_tok *tok,
                        struct kvr_openai_error *e);

/* Streaming: the first events (chat: the role chunk; responses: created, in_progress). */
int kvr_reply_sse_start(struct kvr_reply *r, struct kvr_sbuf *out, const struct kvr_reply_info *in);
/* Streaming: `len` more bytes of answer, and with `done` the end (chat: the finish chunk,
 * usage when asked, [DONE]; responses: the items' done events and response.completed). */
int kvr_reply_sse(struct kvr_reply *r, struct kvr_sbuf *out, const struct kvr_reply_info *in,
                  const char *text, size_t len, bool done);
/* The whole answer (`text`, len bytes) as one JSON body (kvr_free), or NULL. */
char *kvr_reply_json(struct kvr_reply *r, const struct kvr_reply_info *in, const char *text,
                     size_t len, size_t *out_len);

/* Append `j` (stolen) as compact JSON. 0 or KVR_ENOMEM. */
int kvr_reply_dump(struct kvr_sbuf *out, json_t *j);

/* The finish reason after the last push: tool_calls beats stop; an unfinished call is
 * length. */
const char *kvr_reply_finish(const struct kvr_reply *r, enum kvr_openai_finish f);

#endif
