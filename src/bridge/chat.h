/* chat.h - chat templates: turn a list of chat messages into the one prompt string a
 * chat-tuned model was trained on.
 *
 * Five template families are built in. Which one a model uses is detected from the GGUF's
 * `tokenizer.chat_template` (a Jinja program we do not run) by distinctive substrings; a
 * model without a recognisable template falls back to ChatML and the caller logs that.
 *
 * The rendered text never includes the leading BOS token: the tokenizer adds it (when the
 * vocabulary asks for one), exactly as for a plain completion prompt. Control tokens inside
 * the text ("<|im_start|>", "[INST]", "</s>", ...) are written as their text and become
 * single tokens because the caller tokenizes the result with special-token parsing on.
 * A consequence worth knowing: control-token text inside a message's content is parsed as a
 * control token too (the same as llama.cpp's server).
 *
 * Every template ends with the opening of an assistant turn, so the model's continuation
 * is the assistant's reply. The exact layouts are documented next to each renderer in
 * chat.c and pinned by tests/unit/test_chat.c.
 *
 * Pure module: no I/O, no globals, thread-safe. */
#ifndef KVR_BRIDGE_CHAT_H
#define KVR_BRIDGE_CHAT_H

#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>

enum kvr_chat_role {
    KVR_CHAT_ROLE_SYSTEM,
    KVR_CHAT_ROLE_USER,
    KVR_CHAT_ROLE_ASSISTANT,
    KVR_CHAT_ROLE_COUNT
};

/* One message. `content` need not be NUL-terminated; it is borrowed. */
struct kvr_chat_msg {
    enum kvr_chat_role role;
    const char *content;
    size_t content_len;
};

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

#endif
