/* responses.h - POST /v1/responses, OpenAI's Responses API, mapped onto the chat path.
 *
 * A request is rewritten as a Chat Completions body (kvr_responses_to_chat) and then
 * generated as any chat is (generation.h), with the answer written in the Responses shapes
 * (a reply of format RESPONSES, reply.h):
 *   input                 a string (one user message) or items: messages ({"role", "content":
 *                         string or input_text / output_text parts}), function_call ({"call_id",
 *                         "name", "arguments"}: an assistant tool call, consecutive ones in one
 *                         message), function_call_output ({"call_id", "output"}: a tool
 *                         message); reasoning items are dropped
 *   instructions          a system message first
 *   tools                 function tools ({"type": "function", "name", "parameters", ...})
 *   tool_choice           "none" | "auto" | "required" | {"type": "function", "name"}
 *   max_output_tokens     max_tokens; temperature, top_p, parallel_tool_calls, stream as in chat
 *   previous_response_id  the stored conversation of an earlier response goes first
 * Other fields are refused unless neutral (store, metadata, user, truncation "disabled", text
 * format "text", include []). Output items: reasoning, message (output_text), function_call;
 * events: response.created, response.in_progress, response.output_item.added / .done,
 * response.content_part.added / .done, response.output_text.delta / .done,
 * response.reasoning_text.delta / .done, response.function_call_arguments.delta / .done,
 * response.completed.
 *
 * The store keeps the last KVR_RESPONSES_STORE finished responses' conversations in memory
 * (oldest forgotten first); it locks itself, any thread. The conversion is pure. */
#ifndef KVR_BRIDGE_RESPONSES_H
#define KVR_BRIDGE_RESPONSES_H

#include "bridge/openai.h"
#include "bridge/reply.h"

#include <jansson.h>

#define KVR_RESPONSES_STORE 256

struct kvr_responses_store;

struct kvr_responses_store *kvr_responses_store_create(void);
void kvr_responses_store_destroy(struct kvr_responses_store *s);

/* The Responses body (`len` bytes) as a chat body (*out, kvr_malloc'd, *out_len bytes).
 * `store` (may be NULL) answers previous_response_id; *keep is false when the body says
 * "store": false (the answer is then not kept). 0, or KVR_EINVAL / KVR_ENOMEM with `e`
 * filled. */
int kvr_responses_to_chat(const char *body, size_t len, struct kvr_responses_store *store,
                          char **out, size_t *out_len, bool *keep, struct kvr_openai_error *e);

/* kvr_generation_prepare for a Responses body: converted, then prepared as a chat whose
 * answer is written in the Responses shapes. Errors as kvr_generation_prepare's. */
struct kvr_generation;
int kvr_responses_prepare(struct kvr_generation *g, struct kvr_responses_store *store,
                          const char *body, size_t len, const char *budget_header,
                          struct kvr_openai_error *e);

/* The reply's Responses shapes (called by reply.c). */
int kvr_responses_sse_start(struct kvr_reply *r, struct kvr_sbuf *out,
                            const struct kvr_reply_info *in);
int kvr_responses_sse(struct kvr_reply *r, struct kvr_sbuf *out, const struct kvr_reply_info *in,
                      bool done);
char *kvr_responses_json(struct kvr_reply *r, const struct kvr_reply_info *in, size_t *out_len);
/* A stream that failed: an "error" event, then response.failed. */
int kvr_responses_sse_error(struct kvr_reply *r, struct kvr_sbuf *out,
                            const struct kvr_reply_info *in, const struct kvr_openai_error *err);

#endif
