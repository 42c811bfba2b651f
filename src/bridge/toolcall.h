/* toolcall.h - a model's answer split into reasoning, text and tool calls, per model family.
 *
 * Each family writes tool calls in the syntax its chat template renders them in (the
 * template is how the family is chosen, kvr_toolcall_detect):
 *   LLAMA3       {"name": "f", "parameters": {...}} as the whole answer, or after
 *                <|python_tag|>; several separated by ';'
 *   HERMES       <tool_call>{"name": "f", "arguments": {...}}</tool_call> (Hermes, Qwen 2.5,
 *                Qwen 3)
 *   MISTRAL      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...], or
 *                [TOOL_CALLS]f[ARGS]{...} (the newer tokenizers)
 *   QWEN3_CODER  <tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>\n</function>\n
 *                </tool_call>
 *   GLM45        <tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>
 *   HARMONY      gpt-oss: messages <|channel|>C [to=functions.f] ...<|message|>body, ended by
 *                <|end|>, <|call|> or <|return|>, the next one opened by <|start|>assistant;
 *                analysis is reasoning, a message to=functions.f a call, the rest text
 *   DEEPSEEK_V3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n
 *                {...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜> (and V3.1's
 *                <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>)
 *   GENERIC      the whole answer is {"tool_calls": [{"name", "arguments"}]},
 *                {"tool_call": {...}} or {"name", "arguments"}
 * XML-style values (QWEN3_CODER, GLM45) are strings when the function's schema says the
 * parameter is a string, else JSON when they parse as JSON, else strings.
 * Reasoning: with `think`, a leading <think>...</think> is reasoning (also when the prompt
 * already opened it: `in_think`).
 *
 * kvr_toolcall_parse reads the whole answer so far. Not `final`, it decides only what can
 * no longer change: text that may still begin a call, and a call not yet closed, are held
 * back; so successive parses of a growing answer give text and reasoning that only grow
 * and calls that are only appended (what streaming needs). `final`, everything is decided;
 * a call still open is text, and `unfinished` says so (the answer ran out of tokens inside
 * a call: finish_reason "length", never a call).
 * Pure functions; a result is owned by its caller (init/fini). Any thread. */
#ifndef KVR_BRIDGE_TOOLCALL_H
#define KVR_BRIDGE_TOOLCALL_H

#include "core/sbuf.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* DeepSeek V3's call markers (full-width bars, U+2581 for the spaces), for the parser and
 * the grammar that forces a call. */
#define KVR_TOOLCALL_DS_CALLS_BEGIN                                                                \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "begin\xef\xbd\x9c>"
#define KVR_TOOLCALL_DS_CALLS_END                                                                  \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "calls\xe2\x96\x81"                                                                            \
    "end\xef\xbd\x9c>"
#define KVR_TOOLCALL_DS_CALL_BEGIN                                                                 \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "begin\xef\xbd\x9c>"
#define KVR_TOOLCALL_DS_CALL_END                                                                   \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "call\xe2\x96\x81"                                                                             \
    "end\xef\xbd\x9c>"
#define KVR_TOOLCALL_DS_SEP                                                                        \
    "<\xef\xbd\x9ctool\xe2\x96\x81"                                                                \
    "sep\xef\xbd\x9c>"

enum kvr_toolcall_family {
    KVR_TOOLCALL_GENERIC,
    KVR_TOOLCALL_LLAMA3,
    KVR_TOOLCALL_HERMES,
    KVR_TOOLCALL_MISTRAL,
    KVR_TOOLCALL_QWEN3_CODER,
    KVR_TOOLCALL_GLM45,
    KVR_TOOLCALL_HARMONY,
    KVR_TOOLCALL_DEEPSEEK_V3,
    KVR_TOOLCALL_FAMILY_COUNT
};

#define KVR_TOOLCALL_MAX_CALLS 64

/* "generic", "llama3", ... */
const char *kvr_toolcall_family_name(enum kvr_toolcall_family f);

/* The family of a chat template's source (NULL: GENERIC), and whether it writes <think>
 * blocks (*think, may be NULL). */
enum kvr_toolcall_family kvr_toolcall_detect(const char *tmpl, size_t len, bool *think);

struct kvr_toolcall_opts {
    enum kvr_toolcall_family family;
    bool calls;          /* look for tool calls (false: tool_choice none, or no tools) */
    bool think;          /* a leading <think>...</think> is reasoning */
    bool in_think;       /* the prompt ended inside <think>: the answer starts in reasoning */
    const json_t *tools; /* the request's tools (borrowed, may be NULL): XML value types */
};

struct kvr_toolcall {
    char *name;      /* owned, NUL-terminated */
    char *arguments; /* owned: a compact JSON object */
};

/* Where a parse that was not final left the answer's last byte: decided text (or reasoning)
 * with nothing held back, so more bytes that cannot begin a marker (kvr_toolcall_plain)
 * only extend it; or anything else. */
enum kvr_toolcall_tail {
    KVR_TOOLCALL_TAIL_OTHER,
    KVR_TOOLCALL_TAIL_CONTENT,
    KVR_TOOLCALL_TAIL_REASONING,
    KVR_TOOLCALL_TAIL_COUNT
};

struct kvr_toolcall_result {
    struct kvr_sbuf content;
    struct kvr_sbuf reasoning;
    enum kvr_toolcall_tail tail;
    struct kvr_toolcall calls[KVR_TOOLCALL_MAX_CALLS];
    uint32_t n_calls;
    bool unfinished; /* final: the answer ended inside a call */
};

void kvr_toolcall_result_init(struct kvr_toolcall_result *r);
void kvr_toolcall_result_fini(struct kvr_toolcall_result *r);

/* Parse `len` bytes of answer into `r` (cleared first). 0, or KVR_ENOMEM. */
int kvr_toolcall_parse(const struct kvr_toolcall_opts *o, const char *text, size_t len, bool final,
                       struct kvr_toolcall_result *r);

/* After a parse that left `tail`, whether `n` more bytes only extend the content or the
 * reasoning (no byte that may begin a marker there), so a stream can append them without
 * parsing the answer again: the next parse would find the same. */
bool kvr_toolcall_plain(const struct kvr_toolcall_opts *o, enum kvr_toolcall_tail tail,
                        const char *p, size_t n);

/* The length of the longest suffix of `text` that is a proper prefix of `marker` (text
 * held back because it may still become the marker). */
size_t kvr_toolcall_partial(const char *text, size_t len, const char *marker);

#endif
