/* tools.h - the tool fields of a chat request: `tools`, `tool_choice`,
 * `parallel_tool_calls`, and the tool fields of the messages (an assistant's `tool_calls`,
 * a tool message's `tool_call_id`), checked before the template sees them.
 *
 * Checks, each a 400 naming the field:
 *   tools[i]            {"type": "function", "function": {"name", "description"?,
 *                       "parameters"?, "strict"?}}; names 1..64 of [A-Za-z0-9_.-], distinct;
 *                       at most KVR_TOOLS_MAX tools
 *   ...parameters       a JSON schema object (kvr_tools_check_schema): known types, objects
 *                       for properties / items / $defs, required a list of strings, nesting
 *                       at most KVR_TOOLS_MAX_SCHEMA_DEPTH deep
 *   tool_choice         "none", "auto", "required" or {"type": "function", "function":
 *                       {"name"}} naming one of the tools; "required" and a name need tools
 *   messages[i].tool_calls   on assistant messages: [{"id", "type": "function",
 *                       "function": {"name", "arguments"}}], arguments a string holding a
 *                       JSON object
 *   messages[i].tool_call_id on tool messages: a non-empty string
 * Pure functions over jansson values; strings point into the request's JSON (borrowed for
 * its lifetime). Any thread. */
#ifndef KVR_BRIDGE_TOOLS_H
#define KVR_BRIDGE_TOOLS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#define KVR_TOOLS_MAX 128             /* tools in one request */
#define KVR_TOOLS_MAX_SCHEMA_DEPTH 32 /* nesting of a parameters schema */
#define KVR_TOOLS_MAX_CALLS 64        /* tool calls in one assistant message */
#define KVR_TOOLS_MAX_NAME 64         /* bytes of a function's name */

struct kvr_openai_error;

enum kvr_tool_choice {
    KVR_TOOL_CHOICE_NONE,     /* no tools, or "none": the output is text */
    KVR_TOOL_CHOICE_AUTO,     /* the model may call tools */
    KVR_TOOL_CHOICE_REQUIRED, /* the model must call at least one tool */
    KVR_TOOL_CHOICE_NAMED,    /* the model must call `named` */
    KVR_TOOL_CHOICE_COUNT
};

struct kvr_tools {
    const json_t *list; /* the request's "tools" array, NULL when absent or empty */
    size_t n;
    enum kvr_tool_choice choice;
    const char *named; /* NAMED: the function's name */
    bool parallel;     /* parallel_tool_calls (default true) */
};

/* Read tools, tool_choice and parallel_tool_calls from the request object `root`. 0 or
 * KVR_EINVAL with `e` filled. */
int kvr_tools_parse(const json_t *root, struct kvr_tools *out, struct kvr_openai_error *e);

/* The "parameters" schema of one function, found by name; NULL when there is none. */
const json_t *kvr_tools_params(const struct kvr_tools *t, const char *name);

/* A parameters schema's structure (see above); `path` names it in the error. */
int kvr_tools_check_schema(const json_t *schema, const char *path, struct kvr_openai_error *e);

/* The tool fields of message `i` (an object whose role is `role`, "assistant" or "tool"
 * or another): tool_calls only on assistant messages, tool_call_id only (and always) on
 * tool messages. 0 or KVR_EINVAL. */
int kvr_tools_check_message(const json_t *msg, size_t i, const char *role,
                            struct kvr_openai_error *e);

#endif
