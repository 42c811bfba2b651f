/* toolcall_grammar.c - the GBNF that forces a tool call (see toolcall_grammar.h).
 *
 * Sections: literals, schemas (json_schema.h's grammars, renamed per tool), each family's
 * call syntax, the root. */
#include "bridge/toolcall_grammar.h"

#include "bridge/json_schema.h"
#include "core/alloc.h"
#include "core/err.h"

#include <stdio.h>
#include <string.h>

/* A GBNF string literal of `n` bytes: quotes, backslashes and control bytes escaped, other
 * bytes (UTF-8 included) as they are. */
static void lit(struct kvr_sbuf *b, const char *s, size_t n)
{
    kvr_sbuf_puts(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            kvr_sbuf_printf(b, "\\%c", c);
        else if (c == '\n')
            kvr_sbuf_puts(b, "\\n");
        else if (c < 0x20)
            kvr_sbuf_printf(b, "\\x%02X", c);
        else
            kvr_sbuf_append(b, s + i, 1);
    }
    kvr_sbuf_puts(b, "\"");
}

static void lits(struct kvr_sbuf *b, const char *s)
{
    lit(b, s, strlen(s));
}

/* ---- schemas ------------------------------------------------------------------------------ */

static bool name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
}

/* Copy a grammar with every rule name prefixed, so that the grammars of several schemas
 * (each with its own root and helper rules) live in one: names are the runs of
 * [A-Za-z0-9_-] outside literals, classes, repetition braces and comments. */
static void append_prefixed(struct kvr_sbuf *out, const char *t, size_t n, const char *prefix)
{
    for (size_t i = 0; i < n;) {
        char c = t[i];
        if (c == '"' || c == '[' || c == '{' || c == '#') {
            char close = c == '"' ? '"' : c == '[' ? ']' : c == '{' ? '}' : '\n';
            size_t j = i + 1;
            while (j < n && t[j] != close)
                j += t[j] == '\\' && c != '#' ? 2 : 1;
            j = j < n ? j + 1 : n;
            kvr_sbuf_append(out, t + i, j - i);
            i = j;
        } else if (name_char(c)) {
            size_t j = i;
            while (j < n && name_char(t[j]))
                j++;
            kvr_sbuf_puts(out, prefix);
            kvr_sbuf_append(out, t + i, j - i);
            i = j;
        } else {
            kvr_sbuf_append(out, t + i, 1);
            i++;
        }
    }
    kvr_sbuf_puts(out, "\n");
}

/* Rules `<prefix>root` and its helpers for the JSON text of `schema` (json_schema.h; any
 * object when there is none). */
static int schema_rules(const json_t *schema, const char *prefix, struct kvr_sbuf *out,
                        struct kvr_err *err)
{
    struct kvr_sbuf g;
    kvr_sbuf_init(&g);
    int rc = KVR_OK;
    if (schema)
        rc = kvr_json_schema_gbnf(schema, &g, err);
    else
        kvr_json_object_gbnf(&g);
    if (!rc && g.failed)
        rc = KVR_ENOMEM;
    if (!rc)
        append_prefixed(out, g.data, g.len, prefix);
    kvr_sbuf_fini(&g);
    return rc;
}

/* What the call syntax needs while it is written: helper rules go to `rules` (each tool's
 * prefixed "tN-"); `tool` is the index of the tool being written, for errors. */
struct gen {
    struct kvr_sbuf *rules;
    struct kvr_err *err;
    size_t tool;
};

/* ---- the families' call syntax ---------------------------------------------------------- */

/* XML-style parameters (Qwen3-Coder, GLM-4.5): each property as its family writes it, a
 * string's value as raw text without '<' (one of its enum values when it has them), any
 * other as JSON under its schema. */
static int xml_params(struct gen *g, const json_t *params, bool coder, struct kvr_sbuf *expr)
{
    const json_t *props = json_object_get(params, "properties");
    const json_t *req = json_object_get(params, "required");
    const char *key;
    json_t *p;
    unsigned k = 0;
    json_object_foreach((json_t *)props, key, p)
    {
        char val[64] = "xml-text";
        const char *t = json_string_value(json_object_get(p, "type"));
        const json_t *en = json_object_get(p, "enum");
        if (t && !strcmp(t, "string") && json_is_array(en) && json_array_size(en)) {
            snprintf(val, sizeof val, "t%zu-p%u", g->tool, k);
            kvr_sbuf_printf(g->rules, "%s ::= ", val);
            size_t j;
            json_t *x;
            json_array_foreach(en, j, x)
            {
                kvr_sbuf_puts(g->rules, j ? " | " : "");
                if (json_is_string(x))
                    lit(g->rules, json_string_value(x), json_string_length(x));
            }
            kvr_sbuf_puts(g->rules, "\n");
        } else if (!t || strcmp(t, "string") != 0) {
            char prefix[48];
            snprintf(prefix, sizeof prefix, "t%zu-p%u-", g->tool, k);
            int rc = schema_rules(p, prefix, g->rules, g->err);
            if (rc)
                return rc;
            snprintf(val, sizeof val, "%sroot", prefix);
        }
        k++;
        bool required = false;
        size_t j;
        json_t *r;
        json_array_foreach(req, j, r) required |=
            json_is_string(r) && !strcmp(json_string_value(r), key);
        char open[320], close[32];
        snprintf(open, sizeof open,
                 coder ? "<parameter=%.256s>\n"
                       : "<arg_key>%.256s</arg_key>\n"
                         "<arg_value>",
                 key);
        snprintf(close, sizeof close, coder ? "\n</parameter>\n" : "</arg_value>\n");
        kvr_sbuf_puts(expr, "(");
        lits(expr, open);
        kvr_sbuf_printf(expr, " %s ", val);
        lits(expr, close);
        kvr_sbuf_puts(expr, required ? ") " : ")? ");
    }
    return KVR_OK;
}

/* One call of function `fn` (its arguments rule is `args`) in the family's syntax. */
static int call_expr(struct gen *g, enum kvr_toolcall_family f, const char *fn,
                     const json_t *params, const char *args, struct kvr_sbuf *e)
{
    char head[192];
    switch (f) {
    case KVR_TOOLCALL_HERMES:
        snprintf(head, sizeof head, "<tool_call>\n{\"name\": \"%s\", \"arguments\": ", fn);
        lits(e, head);
        kvr_sbuf_printf(e, " %s ", args);
        lits(e, "}\n</tool_call>");
        return KVR_OK;
    case KVR_TOOLCALL_LLAMA3:
    case KVR_TOOLCALL_MISTRAL:
    case KVR_TOOLCALL_GENERIC:
        snprintf(head, sizeof head, "{\"name\": \"%s\", \"%s\": ", fn,
                 f == KVR_TOOLCALL_LLAMA3 ? "parameters" : "arguments");
        lits(e, head);
        kvr_sbuf_printf(e, " %s ", args);
        /* Mistral's calls may carry their 9-character id. */
        if (f == KVR_TOOLCALL_MISTRAL)
            kvr_sbuf_puts(e, "(\", \\\"id\\\": \\\"\" [a-zA-Z0-9]{9} \"\\\"\")? ");
        kvr_sbuf_puts(e, "\"}\"");
        return KVR_OK;
    case KVR_TOOLCALL_QWEN3_CODER:
    case KVR_TOOLCALL_GLM45: {
        bool coder = f == KVR_TOOLCALL_QWEN3_CODER;
        snprintf(head, sizeof head, coder ? "<tool_call>\n<function=%s>\n" : "<tool_call>%s\n", fn);
        lits(e, head);
        kvr_sbuf_puts(e, " ");
        int rc = xml_params(g, params, coder, e);
        lits(e, coder ? "</function>\n</tool_call>" : "</tool_call>");
        return rc;
    }
    case KVR_TOOLCALL_HARMONY:
        snprintf(head, sizeof head,
                 "<|channel|>commentary to=functions.%s <|constrain|>json<|message|>", fn);
        lits(e, head);
        kvr_sbuf_printf(e, " %s", args);
        return KVR_OK;
    case KVR_TOOLCALL_DEEPSEEK_V3:
        snprintf(head, sizeof head,
                 KVR_TOOLCALL_DS_CALL_BEGIN "function" KVR_TOOLCALL_DS_SEP "%s\n```json\n", fn);
        lits(e, head);
        kvr_sbuf_printf(e, " %s ", args);
        lits(e, "\n```" KVR_TOOLCALL_DS_CALL_END);
        return KVR_OK;
    default:
        return KVR_EINVAL;
    }
}

/* call ::= one alternative per function that may be called. */
static int call_rule(struct gen *g, const struct kvr_toolcall_opts *o, const struct kvr_tools *t)
{
    struct kvr_sbuf alts;
    kvr_sbuf_init(&alts);
    size_t i, n = 0;
    json_t *tool;
    int rc = KVR_OK;
    json_array_foreach(t->list, i, tool)
    {
        const json_t *fn = json_object_get(tool, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!name || (t->choice == KVR_TOOL_CHOICE_NAMED && strcmp(name, t->named) != 0))
            continue;
        const json_t *params = json_object_get(fn, "parameters");
        params = json_is_null(params) ? NULL : params;
        char prefix[32], args[48];
        snprintf(prefix, sizeof prefix, "t%zu-", i);
        snprintf(args, sizeof args, "t%zu-root", i);
        g->tool = i;
        bool xml = o->family == KVR_TOOLCALL_QWEN3_CODER || o->family == KVR_TOOLCALL_GLM45;
        if (!xml && (rc = schema_rules(params, prefix, g->rules, g->err)))
            break;
        kvr_sbuf_puts(&alts, n++ ? " | " : "");
        kvr_sbuf_puts(&alts, "(");
        if ((rc = call_expr(g, o->family, name, params, args, &alts)))
            break;
        kvr_sbuf_puts(&alts, ")");
    }
    if (!rc && n == 0)
        rc = KVR_EINVAL;
    if (!rc)
        kvr_sbuf_printf(g->rules, "call ::= %s\n", alts.data ? alts.data : "");
    kvr_sbuf_fini(&alts);
    return rc;
}

int kvr_toolcall_grammar(const struct kvr_toolcall_opts *o, const struct kvr_tools *t,
                         struct kvr_sbuf *out, size_t *bad_tool, struct kvr_err *err)
{
    if (!t->list || (t->choice != KVR_TOOL_CHOICE_REQUIRED && t->choice != KVR_TOOL_CHOICE_NAMED))
        return KVR_EINVAL;
    /* With parallel calls, up to 8 in one answer, between the family's separators. */
    bool many = t->parallel && t->choice == KVR_TOOL_CHOICE_REQUIRED;
    const char *open = "", *sep = "\n", *close = "";
    switch (o->family) {
    case KVR_TOOLCALL_MISTRAL:
        open = "[TOOL_CALLS][", sep = ", ", close = "]";
        break;
    case KVR_TOOLCALL_GENERIC:
        open = "{\"tool_calls\": [", sep = ", ", close = "]}";
        break;
    case KVR_TOOLCALL_LLAMA3:
        sep = "; ";
        break;
    case KVR_TOOLCALL_DEEPSEEK_V3:
        open = KVR_TOOLCALL_DS_CALLS_BEGIN, close = KVR_TOOLCALL_DS_CALLS_END;
        break;
    case KVR_TOOLCALL_HARMONY:
        sep = "<|call|><|start|>assistant";
        break;
    default:
        break;
    }
    kvr_sbuf_puts(out, "root ::= ");
    if (o->in_think)
        kvr_sbuf_puts(out, "think ");
    else if (o->think)
        kvr_sbuf_puts(out, "(\"<think>\" think)? ");
    if (*open)
        lits(out, open);
    kvr_sbuf_puts(out, " call ");
    if (many) {
        kvr_sbuf_puts(out, "(");
        lits(out, sep);
        kvr_sbuf_puts(out, " call){0,7} ");
    }
    if (*close)
        lits(out, close);
    kvr_sbuf_puts(out, "\n");
    if (o->in_think || o->think)
        kvr_sbuf_puts(out, "think ::= ([^<] | \"<\" [^/] | \"</\" [^t]){0,4096} \"</think>\" "
                           "[ \\n]{0,2}\n");
    kvr_sbuf_puts(out, "xml-text ::= [^<]{0,2048}\n");
    struct gen g = {out, err, 0};
    int rc = call_rule(&g, o, t);
    if (bad_tool)
        *bad_tool = g.tool;
    return rc ? rc : out->failed ? KVR_ENOMEM : KVR_OK;
}

/* ---- auto: constrained from the trigger on --------------------------------------------------- */

const char *kvr_toolcall_trigger(enum kvr_toolcall_family f)
{
    switch (f) {
    case KVR_TOOLCALL_HERMES:
    case KVR_TOOLCALL_QWEN3_CODER:
    case KVR_TOOLCALL_GLM45:
        return "<tool_call>";
    case KVR_TOOLCALL_MISTRAL:
        return "[TOOL_CALLS]";
    case KVR_TOOLCALL_DEEPSEEK_V3:
        return KVR_TOOLCALL_DS_CALLS_BEGIN;
    default:
        return NULL;
    }
}

/* One code point of the trigger as a GBNF escape (\uHHHH), for literals and classes. */
static void cp_escape(struct kvr_sbuf *b, uint32_t cp)
{
    kvr_sbuf_printf(b, cp > 0xFFFF ? "\\U%08X" : "\\u%04X", (unsigned)cp);
}

/* The trigger's code points (ASCII and the BMP characters triggers use). */
static size_t trigger_cps(const char *t, uint32_t *cp, size_t cap)
{
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)t; *p && n < cap; n++) {
        if (*p < 0x80) {
            cp[n] = *p++;
        } else if ((*p & 0xE0) == 0xC0) {
            cp[n] = (uint32_t)(p[0] & 0x1F) << 6 | (p[1] & 0x3F);
            p += 2;
        } else {
            cp[n] = (uint32_t)(p[0] & 0x0F) << 12 | (uint32_t)(p[1] & 0x3F) << 6 | (p[2] & 0x3F);
            p += 3;
        }
    }
    return n;
}

/* Text that never completes the trigger, as states <name>K (K characters of it matched),
 * each able to end; with `block`, the trigger may instead begin that rule, then `after`.
 * The trigger's first character occurs in it only once, so a mismatch goes back to state
 * 0, or to 1 on that character. */
static void free_text(struct kvr_sbuf *b, const char *name, const uint32_t *cp, size_t n,
                      const char *block, const char *after)
{
    for (size_t k = 0; k < n; k++) {
        kvr_sbuf_printf(b, "%s%zu ::= \"\" | ", name, k);
        if (block)
            kvr_sbuf_printf(b, "%s %s0 | ", block, after);
        kvr_sbuf_puts(b, "\"");
        cp_escape(b, cp[0]);
        kvr_sbuf_printf(b, "\" %s1 | [^", name);
        cp_escape(b, cp[0]);
        if (k > 0)
            cp_escape(b, cp[k]);
        kvr_sbuf_printf(b, "] %s0", name);
        if (k > 0 && k + 1 < n) {
            kvr_sbuf_puts(b, " | \"");
            cp_escape(b, cp[k]);
            kvr_sbuf_printf(b, "\" %s%zu", name, k + 1);
        }
        kvr_sbuf_puts(b, "\n");
    }
}

int kvr_toolcall_grammar_lazy(const struct kvr_toolcall_opts *o, const struct kvr_tools *t,
                              struct kvr_sbuf *out, size_t *bad_tool, struct kvr_err *err)
{
    const char *trigger = kvr_toolcall_trigger(o->family);
    uint32_t cp[32];
    size_t n = trigger ? trigger_cps(trigger, cp, 32) : 0;
    if (!t->list || t->choice != KVR_TOOL_CHOICE_AUTO || n < 2)
        return KVR_EINVAL;
    /* The block a trigger opens: one call, or the family's list of them. */
    kvr_sbuf_puts(out, "root ::= free0\nblock ::= ");
    if (o->family == KVR_TOOLCALL_MISTRAL)
        kvr_sbuf_printf(out, "\"[TOOL_CALLS][\" call %s\"]\"\n",
                        t->parallel ? "(\", \" call){0,7} " : "");
    else if (o->family == KVR_TOOLCALL_DEEPSEEK_V3) {
        lits(out, KVR_TOOLCALL_DS_CALLS_BEGIN);
        kvr_sbuf_printf(out, " call %s", t->parallel ? "(\"\\n\" call){0,7} " : "");
        lits(out, KVR_TOOLCALL_DS_CALLS_END);
        kvr_sbuf_puts(out, "\n");
    } else {
        kvr_sbuf_puts(out, "call\n");
    }
    /* After a block: more text and blocks (parallel calls), or text without the trigger. */
    free_text(out, "free", cp, n, "block", t->parallel ? "free" : "plain");
    if (!t->parallel)
        free_text(out, "plain", cp, n, NULL, NULL);
    kvr_sbuf_puts(out, "xml-text ::= [^<]{0,2048}\n");
    struct gen g = {out, err, 0};
    int rc = call_rule(&g, o, t);
    if (bad_tool)
        *bad_tool = g.tool;
    return rc ? rc : out->failed ? KVR_ENOMEM : KVR_OK;
}
