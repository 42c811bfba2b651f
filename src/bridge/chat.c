/* chat.c - chat templates (see chat.h).
 *
 * Each renderer below documents its exact layout with {system}, {user}, {assistant} for a
 * message's content; "\n" is a newline. The text never starts with BOS (the tokenizer adds
 * it) and always ends by opening the assistant's turn. */
#include "bridge/chat.h"

#include "jinja/jinja.h"
#include "core/sbuf.h"
#include "core/alloc.h"

#include <jansson.h>
#include <string.h>

static const char *const tmpl_names[KVR_CHAT_TMPL_COUNT] = {
    [KVR_CHAT_TMPL_CHATML] = "chatml", [KVR_CHAT_TMPL_LLAMA2] = "llama2",
    [KVR_CHAT_TMPL_LLAMA3] = "llama3", [KVR_CHAT_TMPL_MISTRAL] = "mistral",
    [KVR_CHAT_TMPL_ZEPHYR] = "zephyr",
};

static const char *const role_names[KVR_CHAT_ROLE_COUNT] = {
    [KVR_CHAT_ROLE_SYSTEM] = "system",
    [KVR_CHAT_ROLE_USER] = "user",
    [KVR_CHAT_ROLE_ASSISTANT] = "assistant",
    [KVR_CHAT_ROLE_TOOL] = "tool",
};

const char *kvr_chat_tmpl_name(enum kvr_chat_tmpl t)
{
    return (unsigned)t < KVR_CHAT_TMPL_COUNT ? tmpl_names[t] : "?";
}

int kvr_chat_tmpl_from_name(const char *name, enum kvr_chat_tmpl *out)
{
    for (int i = 0; i < KVR_CHAT_TMPL_COUNT; i++) {
        if (!strcmp(name, tmpl_names[i])) {
            *out = (enum kvr_chat_tmpl)i;
            return KVR_OK;
        }
    }
    return KVR_ENOTFOUND;
}

static bool contains(const char *hay, size_t len, const char *needle)
{
    size_t n = strlen(needle);
    if (!hay || n > len)
        return false;
    for (size_t i = 0; i + n <= len; i++)
        if (!memcmp(hay + i, needle, n))
            return true;
    return false;
}

/* The order matters: Llama-2 and Mistral both say "[INST]"; only Llama-2 has a <<SYS>>
 * block. Zephyr's "<|user|>" is checked last because it is the least specific marker. */
bool kvr_chat_tmpl_detect(const char *jinja, size_t len, enum kvr_chat_tmpl *out)
{
    if (contains(jinja, len, "<|im_start|>"))
        *out = KVR_CHAT_TMPL_CHATML;
    else if (contains(jinja, len, "<|start_header_id|>"))
        *out = KVR_CHAT_TMPL_LLAMA3;
    else if (contains(jinja, len, "[INST]") && contains(jinja, len, "<<SYS>>"))
        *out = KVR_CHAT_TMPL_LLAMA2;
    else if (contains(jinja, len, "[INST]"))
        *out = KVR_CHAT_TMPL_MISTRAL;
    else if (contains(jinja, len, "<|user|>"))
        *out = KVR_CHAT_TMPL_ZEPHYR;
    else {
        *out = KVR_CHAT_TMPL_CHATML;
        return false;
    }
    return true;
}

const char *kvr_chat_tmpl_end_of_turn(enum kvr_chat_tmpl t)
{
    switch (t) {
    case KVR_CHAT_TMPL_CHATML:
        return "<|im_end|>";
    case KVR_CHAT_TMPL_LLAMA3:
        return "<|eot_id|>";
    default:
        return "</s>";
    }
}

static void put_content(struct kvr_sbuf *b, const struct kvr_chat_msg *m)
{
    kvr_sbuf_append(b, m->content, m->content_len);
}

/* ChatML, per message:
 *   <|im_start|>{role}\n{content}<|im_end|>\n
 * then the generation prompt:
 *   <|im_start|>assistant\n */
static void render_chatml(struct kvr_sbuf *b, const struct kvr_chat_msg *msgs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        kvr_sbuf_printf(b, "<|im_start|>%s\n", role_names[msgs[i].role]);
        put_content(b, &msgs[i]);
        kvr_sbuf_puts(b, "<|im_end|>\n");
    }
    kvr_sbuf_puts(b, "<|im_start|>assistant\n");
}

/* Llama-3, per message:
 *   <|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>
 * then:
 *   <|start_header_id|>assistant<|end_header_id|>\n\n
 * (<|begin_of_text|> is the vocabulary's BOS and comes from the tokenizer.) */
static void render_llama3(struct kvr_sbuf *b, const struct kvr_chat_msg *msgs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        kvr_sbuf_printf(b, "<|start_header_id|>%s<|end_header_id|>\n\n", role_names[msgs[i].role]);
        put_content(b, &msgs[i]);
        kvr_sbuf_puts(b, "<|eot_id|>");
    }
    kvr_sbuf_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

/* Llama-2 and Mistral share the [INST] turn structure. A turn is the system messages and
 * user messages that come next (in that order) and then at most one assistant answer:
 *
 *   Llama-2:  [INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s>
 *             <s>[INST] {user} [/INST]
 *   Mistral:  [INST] {system}\n\n{user} [/INST] {assistant}</s>[INST] {user} [/INST]
 *
 * The first turn's BOS comes from the tokenizer; Llama-2 writes the BOS of later turns as
 * "<s>" text. Several system messages in a row, or several user messages in a row, are
 * joined with "\n\n". Every assistant answer is followed by a new turn, so a conversation
 * that ends with an assistant message gets an empty instruction ("[INST]  [/INST]") and
 * the text always ends with " [/INST]", where the model's answer begins. */
static void render_inst(struct kvr_sbuf *b, const struct kvr_chat_msg *msgs, size_t n, bool llama2)
{
    size_t i = 0;
    for (bool first = true;; first = false) {
        kvr_sbuf_puts(b, (llama2 && !first) ? "<s>[INST] " : "[INST] ");
        bool any = false;
        for (; i < n && msgs[i].role == KVR_CHAT_ROLE_SYSTEM; i++) {
            kvr_sbuf_puts(b, any ? "\n\n" : (llama2 ? "<<SYS>>\n" : ""));
            put_content(b, &msgs[i]);
            any = true;
        }
        if (any)
            kvr_sbuf_puts(b, llama2 ? "\n<</SYS>>\n\n" : "\n\n");
        any = false;
        for (; i < n && msgs[i].role == KVR_CHAT_ROLE_USER; i++) {
            if (any)
                kvr_sbuf_puts(b, "\n\n");
            put_content(b, &msgs[i]);
            any = true;
        }
        kvr_sbuf_puts(b, " [/INST]");
        if (i < n && msgs[i].role == KVR_CHAT_ROLE_ASSISTANT) {
            kvr_sbuf_puts(b, " ");
            put_content(b, &msgs[i]);
            kvr_sbuf_puts(b, llama2 ? " </s>" : "</s>");
            i++;
            continue;
        }
        if (i == n)
            break;
    }
}

/* Zephyr, per message:
 *   <|{role}|>\n{content}</s>\n
 * then:
 *   <|assistant|>\n */
static void render_zephyr(struct kvr_sbuf *b, const struct kvr_chat_msg *msgs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        kvr_sbuf_printf(b, "<|%s|>\n", role_names[msgs[i].role]);
        put_content(b, &msgs[i]);
        kvr_sbuf_puts(b, "</s>\n");
    }
    kvr_sbuf_puts(b, "<|assistant|>\n");
}

int kvr_chat_render(enum kvr_chat_tmpl t, const struct kvr_chat_msg *msgs, size_t n_msgs,
                    char **out, size_t *out_len, struct kvr_err *err)
{
    *out = NULL;
    if (out_len)
        *out_len = 0;
    if ((unsigned)t >= KVR_CHAT_TMPL_COUNT)
        return kvr_err_set(err, KVR_EINVAL, "unknown chat template %d", (int)t);
    if (n_msgs == 0)
        return kvr_err_set(err, KVR_EINVAL, "no messages to render");
    for (size_t i = 0; i < n_msgs; i++) {
        if ((unsigned)msgs[i].role >= KVR_CHAT_ROLE_COUNT)
            return kvr_err_set(err, KVR_EINVAL, "message %zu: unknown role %d", i,
                               (int)msgs[i].role);
        if (msgs[i].role == KVR_CHAT_ROLE_TOOL)
            return kvr_err_set(err, KVR_EINVAL,
                               "message %zu: the built-in template %s cannot render tool "
                               "results; serve the model with its Jinja template",
                               i, tmpl_names[t]);
        if (!msgs[i].content && msgs[i].content_len)
            return kvr_err_set(err, KVR_EINVAL, "message %zu: no content", i);
    }

    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    switch (t) {
    case KVR_CHAT_TMPL_CHATML:
        render_chatml(&b, msgs, n_msgs);
        break;
    case KVR_CHAT_TMPL_LLAMA2:
        render_inst(&b, msgs, n_msgs, true);
        break;
    case KVR_CHAT_TMPL_LLAMA3:
        render_llama3(&b, msgs, n_msgs);
        break;
    case KVR_CHAT_TMPL_MISTRAL:
        render_inst(&b, msgs, n_msgs, false);
        break;
    case KVR_CHAT_TMPL_ZEPHYR:
        render_zephyr(&b, msgs, n_msgs);
        break;
    default:
        break;
    }
    *out = kvr_sbuf_take(&b, out_len);
    if (!*out)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory rendering %zu chat messages", n_msgs);
    return KVR_OK;
}

/* ---- the formatter a server uses ------------------------------------------------------- */

struct kvr_chat {
    enum kvr_chat_source source;
    enum kvr_chat_tmpl builtin;
    struct kvr_jinja *jinja;
    char *src; /* the Jinja source (owned), or NULL */
    size_t src_len;
    bool args_as_text;     /* the template adds tool calls' arguments to strings (probe_tools) */
    bool content_not_null; /* ... and looks into a tool call's content (probe_tools) */
    char *bos_token, *eos_token; /* owned, or NULL */
    const char *end_of_turn;     /* static, eos_token, or NULL */
};

static void probe_tools(struct kvr_chat *c);

int kvr_chat_create(struct kvr_chat **out, const struct kvr_chat_config *cfg, struct kvr_err *err)
{
    *out = NULL;
    struct kvr_chat *c = kvr_calloc(1, sizeof *c);
    if (!c)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    int rc = KVR_OK;
    if ((cfg->bos_token && !(c->bos_token = kvr_strdup(cfg->bos_token))) ||
        (cfg->eos_token && !(c->eos_token = kvr_strdup(cfg->eos_token)))) {
        rc = kvr_err_set(err, KVR_ENOMEM, "out of memory");
        goto fail;
    }
    if (cfg->builtin) {
        if (kvr_chat_tmpl_from_name(cfg->builtin, &c->builtin) != 0) {
            rc = kvr_err_set(err, KVR_ENOTFOUND, "unknown chat template '%s'", cfg->builtin);
            goto fail;
        }
        c->source = KVR_CHAT_SOURCE_BUILTIN;
        c->end_of_turn = kvr_chat_tmpl_end_of_turn(c->builtin);
    } else if (cfg->jinja) {
        rc = kvr_jinja_parse(&c->jinja, cfg->jinja, cfg->jinja_len, NULL, err);
        if (rc)
            goto fail;
        c->source = KVR_CHAT_SOURCE_JINJA;
        if (!(c->src = kvr_malloc(cfg->jinja_len + 1))) {
            rc = kvr_err_set(err, KVR_ENOMEM, "out of memory");
            goto fail;
        }
        memcpy(c->src, cfg->jinja, cfg->jinja_len);
        c->src[cfg->jinja_len] = 0;
        c->src_len = cfg->jinja_len;
        probe_tools(c);
        enum kvr_chat_tmpl family;
        if (kvr_chat_tmpl_detect(cfg->jinja, cfg->jinja_len, &family))
            c->end_of_turn = kvr_chat_tmpl_end_of_turn(family);
        else
            c->end_of_turn = c->eos_token;
    } else {
        c->source = KVR_CHAT_SOURCE_PLAIN;
    }
    *out = c;
    return KVR_OK;
fail:
    kvr_chat_destroy(c);
    return rc;
}

void kvr_chat_destroy(struct kvr_chat *c)
{
    if (!c)
        return;
    kvr_jinja_destroy(c->jinja);
    kvr_free(c->src);
    kvr_free(c->bos_token);
    kvr_free(c->eos_token);
    kvr_free(c);
}

enum kvr_chat_source kvr_chat_source(const struct kvr_chat *c)
{
    return c->source;
}

const char *kvr_chat_describe(const struct kvr_chat *c)
{
    static const char *const builtin[KVR_CHAT_TMPL_COUNT] = {
        [KVR_CHAT_TMPL_CHATML] = "built-in template chatml",
        [KVR_CHAT_TMPL_LLAMA2] = "built-in template llama2",
        [KVR_CHAT_TMPL_LLAMA3] = "built-in template llama3",
        [KVR_CHAT_TMPL_MISTRAL] = "built-in template mistral",
        [KVR_CHAT_TMPL_ZEPHYR] = "built-in template zephyr",
    };
    switch (c->source) {
    case KVR_CHAT_SOURCE_JINJA:
        return "the Jinja template";
    case KVR_CHAT_SOURCE_BUILTIN:
        return builtin[c->builtin];
    default:
        return "plain role: content";
    }
}

const char *kvr_chat_end_of_turn(const struct kvr_chat *c)
{
    return c->end_of_turn;
}

size_t kvr_chat_bos_skip(const char *text, size_t len, const char *bos_text, bool tok_adds_bos)
{
    size_t bl = bos_text ? strlen(bos_text) : 0;
    return bl && tok_adds_bos && len >= bl && !memcmp(text, bos_text, bl) ? bl : 0;
}

/* Plain form, per message:
 *   {role}: {content}\n
 * then, with add_generation_prompt:
 *   assistant: */
static void render_plain(struct kvr_sbuf *b, const struct kvr_chat_msg *msgs, size_t n, bool gen)
{
    for (size_t i = 0; i < n; i++) {
        kvr_sbuf_printf(b, "%s: ", role_names[msgs[i].role]);
        put_content(b, &msgs[i]);
        kvr_sbuf_puts(b, "\n");
    }
    if (gen)
        kvr_sbuf_puts(b, "assistant:");
}

/* One message as a Jinja template sees it: role and content, and from the request's message
 * its tool fields, the way probe_tools found the template wants them. */
static json_t *jinja_msg(const struct kvr_chat *c, const struct kvr_chat_msg *m, const json_t *mj)
{
    json_t *o = json_pack("{s:s,s:s%}", "role", role_names[m->role], "content",
                          m->content ? m->content : "", m->content_len);
    if (!o || !json_is_object(mj))
        return o;
    /* A null content stays None: some templates (DeepSeek V3's) write tool calls only then. */
    json_t *content = json_object_get(mj, "content");
    if (m->role == KVR_CHAT_ROLE_ASSISTANT && (!content || json_is_null(content)) &&
        !c->content_not_null && json_object_set_new(o, "content", json_null()))
        goto fail;
    static const char *const keys[] = {"tool_call_id", "name", "reasoning_content", NULL};
    for (size_t i = 0; keys[i]; i++) {
        json_t *v = json_object_get(mj, keys[i]);
        if (v && !json_is_null(v) && json_object_set(o, keys[i], v))
            goto fail;
    }
    json_t *calls = json_object_get(mj, "tool_calls");
    if (!json_is_array(calls) || json_array_size(calls) == 0)
        return o;
    json_t *copy = json_deep_copy(calls);
    if (!copy || json_object_set_new(o, "tool_calls", copy))
        goto fail;
    size_t i;
    json_t *call;
    json_array_foreach(copy, i, call)
    {
        json_t *fn = json_object_get(call, "function");
        json_t *args = json_object_get(fn, "arguments");
        if (c->args_as_text || !json_is_string(args))
            continue;
        json_t *obj = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
        if (!obj || json_object_set_new(fn, "arguments", obj))
            goto fail;
    }
    return o;
fail:
    json_decref(o);
    return NULL;
}

/* {"messages": [...], "add_generation_prompt", "bos_token", "eos_token", "tools",
 * "documents": null}: what Hugging Face passes; tools is None without tools. */
static json_t *jinja_vars(const struct kvr_chat *c, const struct kvr_chat_msg *msgs, size_t n,
                          const json_t *msgs_json, const json_t *tools, bool gen)
{
    json_t *vars = json_object(), *list = json_array();
    if (!vars || !list || json_object_set_new(vars, "messages", list)) {
        json_decref(vars);
        return NULL;
    }
    bool ok = true;
    for (size_t i = 0; i < n && ok; i++) {
        json_t *m = jinja_msg(c, &msgs[i], json_array_get(msgs_json, i));
        ok = m && json_array_append_new(list, m) == 0;
    }
    json_t *t = tools ? json_deep_copy(tools) : json_null();
    ok = ok && !json_object_set_new(vars, "add_generation_prompt", json_boolean(gen)) &&
         !json_object_set_new(vars, "tools", t) &&
         !json_object_set_new(vars, "documents", json_null());
    if (ok && c->bos_token)
        ok = !json_object_set_new(vars, "bos_token", json_string(c->bos_token));
    if (ok && c->eos_token)
        ok = !json_object_set_new(vars, "eos_token", json_string(c->eos_token));
    if (!ok) {
        json_decref(vars);
        return NULL;
    }
    return vars;
}

/* How the template wants a tool call: arguments as objects (Hugging Face's convention) or
 * as JSON text (a template that adds them to strings, as DeepSeek V3's does), and a null
 * content as None or as "" (Qwen 3's looks into it). Each way is tried in that order on a
 * probe conversation; the first whose render shows the argument's key, and not as
 * Python's repr of a dict, is kept. A template that shows no call at all keeps the first. */
static void probe_tools(struct kvr_chat *c)
{
    static const struct {
        bool text, empty;
    } ways[] = {{false, false}, {false, true}, {true, false}, {true, true}};
    json_t *tools = json_pack("[{s:s,s:{s:s,s:{s:s}}}]", "type", "function", "function", "name",
                              "probe_fn", "parameters", "type", "object");
    struct kvr_chat_msg m[2] = {{KVR_CHAT_ROLE_USER, "probe", 5}, {KVR_CHAT_ROLE_ASSISTANT, "", 0}};
    for (size_t i = 0; tools && i < sizeof ways / sizeof ways[0]; i++) {
        c->args_as_text = ways[i].text;
        json_t *list = json_pack("[{},{s:s,s:o,s:[{s:s,s:s,s:{s:s,s:s}}]}]", "role", "assistant",
                                 "content", ways[i].empty ? json_string("") : json_null(),
                                 "tool_calls", "id", "call_probe", "type", "function", "function",
                                 "name", "probe_fn", "arguments", "{\"probe_arg\": \"x\"}");
        json_t *vars = list ? jinja_vars(c, m, 2, list, tools, false) : NULL;
        char *out = NULL;
        size_t len = 0;
        bool ok = vars && kvr_jinja_render(c->jinja, vars, NULL, &out, &len, NULL) == KVR_OK &&
                  strstr(out, "probe_arg") && !strstr(out, "'probe_arg'");
        kvr_free(out);
        json_decref(vars);
        json_decref(list);
        if (ok) {
            c->content_not_null = ways[i].empty;
            json_decref(tools);
            return;
        }
    }
    c->args_as_text = false;
    json_decref(tools);
}

int kvr_chat_apply_tools(const struct kvr_chat *c, const struct kvr_chat_msg *msgs, size_t n_msgs,
                         const json_t *msgs_json, const json_t *tools, bool add_generation_prompt,
                         const struct tm *now, char **out, size_t *out_len, struct kvr_err *err)
{
    *out = NULL;
    if (out_len)
        *out_len = 0;
    if (tools && c->source != KVR_CHAT_SOURCE_JINJA)
        return kvr_err_set(err, KVR_EINVAL,
                           "%s cannot render tools; serve the model with its Jinja template",
                           kvr_chat_describe(c));
    if (c->source == KVR_CHAT_SOURCE_BUILTIN)
        return kvr_chat_render(c->builtin, msgs, n_msgs, out, out_len, err);
    if (n_msgs == 0)
        return kvr_err_set(err, KVR_EINVAL, "no messages to render");
    for (size_t i = 0; i < n_msgs; i++)
        if ((unsigned)msgs[i].role >= KVR_CHAT_ROLE_COUNT)
            return kvr_err_set(err, KVR_EINVAL, "message %zu: unknown role %d", i,
                               (int)msgs[i].role);
    if (c->source == KVR_CHAT_SOURCE_PLAIN) {
        for (size_t i = 0; i < n_msgs; i++)
            if (msgs[i].role == KVR_CHAT_ROLE_TOOL ||
                json_object_get(json_array_get(msgs_json, i), "tool_calls"))
                return kvr_err_set(err, KVR_EINVAL,
                                   "message %zu: the plain form cannot render tool calls or tool "
                                   "results; serve the model with its Jinja template",
                                   i);
        struct kvr_sbuf b;
        kvr_sbuf_init(&b);
        render_plain(&b, msgs, n_msgs, add_generation_prompt);
        *out = kvr_sbuf_take(&b, out_len);
        return *out ? KVR_OK : kvr_err_set(err, KVR_ENOMEM, "out of memory");
    }
    json_t *vars = jinja_vars(c, msgs, n_msgs, msgs_json, tools, add_generation_prompt);
    if (!vars)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    int rc = kvr_jinja_render(c->jinja, vars, now, out, out_len, err);
    json_decref(vars);
    return rc;
}

int kvr_chat_apply(const struct kvr_chat *c, const struct kvr_chat_msg *msgs, size_t n_msgs,
                   bool add_generation_prompt, const struct tm *now, char **out, size_t *out_len,
                   struct kvr_err *err)
{
    return kvr_chat_apply_tools(c, msgs, n_msgs, NULL, NULL, add_generation_prompt, now, out,
                                out_len, err);
}

const char *kvr_chat_jinja_source(const struct kvr_chat *c, size_t *len)
{
    if (len)
        *len = c->src_len;
    return c->src;
}
