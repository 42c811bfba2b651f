/* chat.h - chat templates: turn a list of chat messages into the one prompt string a
 * chat-tuned model was trained on.
 *
 * A server formats chats with a struct kvr_chat, which renders one of:
 *   - a Jinja template (jinja.h): the GGUF's `tokenizer.chat_template`, or a file given with
 *     --chat-template, with the variables Hugging Face passes: messages (role, content),
 *     add_generation_prompt, bos_token, eos_token, and tools/documents as None;
 *   - one of five built-in templates, chosen by name (--chat-template chatml|llama2|...);
 *   - without either, a plain "role: content" form (one line per message, then
 *     "assistant:"), so that a model without a template is not fed markers its vocabulary
 *     lacks.
 * A Jinja template may refuse a conversation (raise_exception, e.g. roles that do not
 * alternate) or fail at run time; kvr_chat_apply then returns an error whose message the
 * caller can give the client as it is.
 *
 * The built-in renderers (kvr_chat_render) never include the leading BOS token: the
 * tokenizer adds it. A Jinja template usually writes bos_token itself; the caller strips it
 * before tokenizing with add_special (generation.c) so that the prompt has exactly one BOS.
 * Control tokens inside the text ("<|im_start|>", "[INST]", "</s>", ...) are written as
 * their text and become single tokens because the caller tokenizes the result with
 * special-token parsing on. A consequence worth knowing: control-token text inside a
 * message's content is parsed as a control token too (the same as llama.cpp's server).
 *
 * The built-in layouts are documented next to each renderer in chat.c and pinned by
 * tests/unit/test_chat.c. Pure module: no I/O, no globals; a struct kvr_chat is immutable
 * after creation and may be used by any number of threads at once. */
#ifndef KVR_BRIDGE_CHAT_H
#define KVR_BRIDGE_CHAT_H

#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <time.h>

enum kvr_chat_role {
    KVR_CHAT_ROLE_SYSTEM,
    KVR_CHAT_ROLE_USER,
    KVR_CHAT_ROLE_ASSISTANT,
    KVR_CHAT_ROLE_TOOL, /* a tool's result; only a Jinja template renders it */
    KVR_CHAT_ROLE_COUNT
};

/* One message. `content` need not be NUL-terminated; it is borrowed. */
struct kvr_chat_msg {
    enum kvr_chat_role role;
    const char *content;
    size_t content_len;
};

struct json_t;

enum kvr_chat_tmpl {
    KVR_CHAT_TMPL_CHATML,  /* <|im_start|>role\n...<|im_end|>\n */
    KVR_CHAT_TMPL_LLAMA2,  /* [INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] */
    KVR_CHAT_TMPL_LLAMA3,  /* <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    KVR_CHAT_TMPL_MISTRAL, /* [INST] ... [/INST], system text prepended to the first user turn */
    KVR_CHAT_TMPL_ZEPHYR,  /* <|role|>\n...</s>\n */
    KVR_CHAT_TMPL_COUNT
};

/* Short lower-case name ("chatml", "llama2", ...); "?" for an out-of-range value. */
const char *kvr_chat_tmpl_name(enum kvr_chat_tmpl t);

/* Look a template up by its name (as accepted on the command line). Returns 0 or
 * KVR_ENOTFOUND. */
int kvr_chat_tmpl_from_name(const char *name, enum kvr_chat_tmpl *out);

/* Detect the family of a GGUF `tokenizer.chat_template` string (`jinja` may be NULL when
 * the model has none; it need not be NUL-terminated, `len` bytes are examined). Returns
 * true when a family was recognised; false means *out was set to the ChatML fallback. */
bool kvr_chat_tmpl_detect(const char *jinja, size_t len, enum kvr_chat_tmpl *out);

/* The text that closes an assistant turn in this template ("<|im_end|>", "<|eot_id|>",
 * "</s>"). The HTTP layer adds it as a hidden stop string, so a model whose end-of-turn
 * token is not its EOS token still stops after its reply. Static string. */
const char *kvr_chat_tmpl_end_of_turn(enum kvr_chat_tmpl t);

/* Render `n_msgs` (>= 1) messages into a new NUL-terminated string (*out, length *out_len,
 * free with kvr_free). Fails with KVR_EINVAL for no messages or an unknown role/template,
 * KVR_ENOMEM on allocation failure or size overflow. */
int kvr_chat_render(enum kvr_chat_tmpl t, const struct kvr_chat_msg *msgs, size_t n_msgs,
                    char **out, size_t *out_len, struct kvr_err *err);

/* ---- the formatter a server uses ------------------------------------------------------ */

enum kvr_chat_source {
    KVR_CHAT_SOURCE_JINJA,   /* a Jinja template */
    KVR_CHAT_SOURCE_BUILTIN, /* a built-in template by name */
    KVR_CHAT_SOURCE_PLAIN,   /* no template: "role: content" lines */
    KVR_CHAT_SOURCE_COUNT
};

struct kvr_chat_config {
    const char *builtin; /* a built-in template's name, or NULL; wins over jinja */
    const char *jinja;   /* Jinja source (need not be NUL-terminated), or NULL */
    size_t jinja_len;
    const char *bos_token; /* the vocabulary's BOS and EOS text (NUL-terminated), or NULL */
    const char *eos_token;
};

struct kvr_chat;

/* Copies what it needs from `cfg`. Fails with KVR_ENOTFOUND for an unknown built-in name,
 * the parse error of a Jinja template (KVR_EFORMAT, KVR_ERANGE; the message names the
 * line), or KVR_ENOMEM. */
int kvr_chat_create(struct kvr_chat **out, const struct kvr_chat_config *cfg, struct kvr_err *err);
void kvr_chat_destroy(struct kvr_chat *c);
enum kvr_chat_source kvr_chat_source(const struct kvr_chat *c);
/* "the Jinja template", "built-in template llama3", "plain role: content" (static). */
const char *kvr_chat_describe(const struct kvr_chat *c);

/* Render `n_msgs` messages. add_generation_prompt opens the assistant's turn (built-ins
 * always do). `now` is the local time strftime_now formats, or NULL. On success *out is a
 * new string (kvr_free). Errors: KVR_EINVAL when the template refuses the conversation
 * (raise_exception) or there are no messages, KVR_EFORMAT for a template error at run time,
 * KVR_ERANGE for a template over its limits, KVR_ENOMEM; `err` says which and where. */
int kvr_chat_apply(const struct kvr_chat *c, const struct kvr_chat_msg *msgs, size_t n_msgs,
                   bool add_generation_prompt, const struct tm *now, char **out, size_t *out_len,
                   struct kvr_err *err);

/* kvr_chat_apply with the request's JSON beside it (both borrowed, may be NULL): `tools` (an
 * array of function tools) is passed to a Jinja template as `tools`, and from `msgs_json`
 * (the request's messages, one object per message in msgs) each message's tool_calls (each
 * function's arguments as an object, or as the JSON text for templates that add them to
 * strings), tool_call_id, name and reasoning_content, as Hugging Face passes them.
 * Built-in templates and the plain form cannot render tools, tool calls or tool messages:
 * KVR_EINVAL saying so. */
int kvr_chat_apply_tools(const struct kvr_chat *c, const struct kvr_chat_msg *msgs, size_t n_msgs,
                         const struct json_t *msgs_json, const struct json_t *tools,
                         bool add_generation_prompt, const struct tm *now, char **out,
                         size_t *out_len, struct kvr_err *err);

/* The Jinja template's source (borrowed for the chat's lifetime), or NULL for a built-in or
 * the plain form: tool-call parsers are chosen from it (toolcall.h). */
const char *kvr_chat_jinja_source(const struct kvr_chat *c, size_t *len);

/* How many bytes at the start of a rendered prompt to leave out before tokenizing it with
 * add_special: the BOS token's text when the template wrote it and the tokenizer adds BOS
 * itself (so the prompt has exactly one BOS), else 0. */
size_t kvr_chat_bos_skip(const char *text, size_t len, const char *bos_text, bool tok_adds_bos);

/* The text that ends an assistant turn, added as a hidden stop string: the built-in's, a
 * Jinja template's recognised family's (kvr_chat_tmpl_detect), else the EOS text; NULL
 * when there is none. */
const char *kvr_chat_end_of_turn(const struct kvr_chat *c);

#endif
