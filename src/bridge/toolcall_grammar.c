/* toolcall_grammar.c - the GBNF that forces a tool call (see toolcall_grammar.h).
 *
 * Sections: literals, JSON schemas as rules, each family's call syntax, the root. */
#include "bridge/toolcall_grammar.h"

#include "core/alloc.h"
#include "core/err.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_SCHEMA_DEPTH 16
#define MAX_PROPERTIES 32
#define MAX_ENUM_RANGE 64

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

/* A JSON value written as jansson writes it (", " and ": " between items, as Python's
 * json.dumps and templates' tojson do), as a literal. */
static void json_lit(struct kvr_sbuf *b, const json_t *v)
{
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!s) {
        b->failed = true;
        return;
    }
    lits(b, s);
    free(s);
}

void kvr_toolcall_grammar_json_rules(struct kvr_sbuf *b)
{
    kvr_sbuf_puts(b, "ws ::= [ \\t\\n]{0,4}\n"
                     "json-char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" "
                     "[0-9a-fA-F]{4})\n"
                     "json-string ::= \"\\\"\" json-char{0,512} \"\\\"\"\n"
                     "json-integer ::= \"-\"? ([0-9] | [1-9] [0-9]{1,15})\n"
                     "json-number ::= json-integer (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?\n"
                     "json-boolean ::= \"true\" | \"false\"\n"
                     "json-value ::= json-object | json-array | json-string | json-number | "
                     "json-boolean | \"null\"\n"
                     "json-object ::= \"{\" ws (json-string ws \":\" ws json-value (ws \",\" ws "
                     "json-string ws \":\" ws json-value){0,32})? ws \"}\"\n"
                     "json-array ::= \"[\" ws (json-value (ws \",\" ws json-value){0,64})? ws "
                     "\"]\"\n");
}

/* ---- schemas ------------------------------------------------------------------------------ */

struct gen {
    struct kvr_sbuf *out;
    const char *prefix;
    unsigned n; /* rules made so far */
};

static int schema_rule(struct gen *g, const json_t *s, int depth, char *name, size_t cap);

/* Start rule `name` (a fresh one): "name ::= ". */
static void new_rule(struct gen *g, char *name, size_t cap)
{
    snprintf(name, cap, "%s-%u", g->prefix, g->n++);
    kvr_sbuf_printf(g->out, "%s ::= ", name);
}

static long long int_of(const json_t *s, const char *key, long long dflt)
{
    const json_t *v = json_object_get(s, key);
    return json_is_number(v) ? (long long)json_number_value(v) : dflt;
}

/* "key" ws ":" ws value, with the value's rule made first. */
static int key_value(struct gen *g, const char *key, const json_t *s, int depth, char *expr,
                     size_t cap)
{
    char val[64];
    int rc = schema_rule(g, s, depth + 1, val, sizeof val);
    if (rc)
        return rc;
    struct kvr_sbuf k;
    kvr_sbuf_init(&k);
    json_t *ks = json_string(key);
    json_lit(&k, ks);
    json_decref(ks);
    int n = snprintf(expr, cap, "%s ws \":\" ws %s", k.data ? k.data : "\"\"", val);
    kvr_sbuf_fini(&k);
    return n > 0 && (size_t)n < cap ? KVR_OK : KVR_ENOMEM;
}

/* Objects with properties: required ones in schema order, each optional one after them
 * optional; with none required, any one of them may come first. */
static int object_rule(struct gen *g, const json_t *s, int depth, char *name, size_t cap)
{
    const json_t *props = json_object_get(s, "properties");
    const json_t *req = json_object_get(s, "required");
    size_t n = json_object_size(props);
    if (n == 0 || n > MAX_PROPERTIES) {
        snprintf(name, cap, "json-object");
        return KVR_OK;
    }
    bool required[MAX_PROPERTIES] = {false};
    const char *key;
    json_t *p;
    size_t i = 0, n_req = 0;
    char (*own)[512] = kvr_malloc(MAX_PROPERTIES * sizeof *own);
    if (!own)
        return KVR_ENOMEM;
    json_object_foreach((json_t *)props, key, p)
    {
        size_t j;
        json_t *r;
        json_array_foreach(req, j, r) if (json_is_string(r) && !strcmp(json_string_value(r), key))
            required[i] = true;
        n_req += required[i];
        int rc = key_value(g, key, p, depth, own[i], sizeof own[i]);
        if (rc) {
            kvr_free(own);
            return rc;
        }
        i++;
    }
    new_rule(g, name, cap);
    kvr_sbuf_puts(g->out, "\"{\" ws ");
    if (n_req) {
        bool first = true;
        for (i = 0; i < n; i++)
            if (required[i]) {
                kvr_sbuf_printf(g->out, "%s%s ", first ? "" : "ws \",\" ws ", own[i]);
                first = false;
            }
        for (i = 0; i < n; i++)
            if (!required[i])
                kvr_sbuf_printf(g->out, "(ws \",\" ws %s)? ", own[i]);
    } else {
        kvr_sbuf_puts(g->out, "(");
        for (i = 0; i < n; i++) {
            kvr_sbuf_printf(g->out, "%s%s ", i ? "| " : "", own[i]);
            for (size_t k = i + 1; k < n; k++)
                kvr_sbuf_printf(g->out, "(ws \",\" ws %s)? ", own[k]);
        }
        kvr_sbuf_puts(g->out, ")? ");
    }
    kvr_sbuf_puts(g->out, "ws \"}\"\n");
    kvr_free(own);
    return KVR_OK;
}

static int array_rule(struct gen *g, const json_t *s, int depth, char *name, size_t cap)
{
    char item[64] = "json-value";
    const json_t *items = json_object_get(s, "items");
    int rc = json_is_object(items) ? schema_rule(g, items, depth + 1, item, sizeof item) : KVR_OK;
    if (rc)
        return rc;
    long long lo = int_of(s, "minItems", 0), hi = int_of(s, "maxItems", -1);
    lo = lo < 0 ? 0 : lo > 64 ? 64 : lo;
    new_rule(g, name, cap);
    kvr_sbuf_printf(g->out, "\"[\" ws %s%s (ws \",\" ws %s)", lo ? "" : "(", item, item);
    if (hi >= 0)
        kvr_sbuf_printf(g->out, "{%lld,%lld}", lo ? lo - 1 : 0, hi > 0 ? hi - 1 : 0);
    else
        kvr_sbuf_printf(g->out, "{%lld,}", lo ? lo - 1 : 0);
    kvr_sbuf_printf(g->out, "%s ws \"]\"\n", lo ? "" : ")?");
    return KVR_OK;
}

static void string_rule(struct gen *g, const json_t *s, char *name, size_t cap)
{
    long long lo = int_of(s, "minLength", 0), hi = int_of(s, "maxLength", -1);
    if (lo <= 0 && hi < 0) {
        snprintf(name, cap, "json-string");
        return;
    }
    lo = lo < 0 ? 0 : lo > 10000 ? 10000 : lo;
    hi = hi > 10000 ? 10000 : hi;
    new_rule(g, name, cap);
    if (hi >= 0)
        kvr_sbuf_printf(g->out, "\"\\\"\" json-char{%lld,%lld} \"\\\"\"\n", lo, hi < lo ? lo : hi);
    else
        kvr_sbuf_printf(g->out, "\"\\\"\" json-char{%lld,} \"\\\"\"\n", lo);
}

static void integer_rule(struct gen *g, const json_t *s, char *name, size_t cap)
{
    const json_t *mn = json_object_get(s, "minimum"), *mx = json_object_get(s, "maximum");
    if (json_is_integer(mn) && json_is_integer(mx) &&
        json_integer_value(mx) >= json_integer_value(mn) &&
        json_integer_value(mx) - json_integer_value(mn) < MAX_ENUM_RANGE) {
        new_rule(g, name, cap);
        for (json_int_t v = json_integer_value(mn); v <= json_integer_value(mx); v++)
            kvr_sbuf_printf(g->out, "%s\"%lld\"", v == json_integer_value(mn) ? "" : " | ",
                            (long long)v);
        kvr_sbuf_puts(g->out, "\n");
    } else if (json_is_number(mn) && json_number_value(mn) >= 0) {
        new_rule(g, name, cap);
        kvr_sbuf_puts(g->out, "[0-9] | [1-9] [0-9]{1,15}\n");
    } else {
        snprintf(name, cap, "json-integer");
    }
}

/* Alternatives: enum values, or anyOf / oneOf schemas, or the types of a type list. */
static int alternatives(struct gen *g, const json_t *s, const json_t *list, int kind, int depth,
                        char *name, size_t cap)
{
    size_t n = json_array_size(list), i;
    char (*sub)[64] = kvr_calloc(n ? n : 1, sizeof *sub);
    if (!sub)
        return KVR_ENOMEM;
    int rc = KVR_OK;
    for (i = 0; i < n && !rc && kind != 0; i++) {
        json_t *x = json_array_get(list, i);
        if (kind == 1) {
            rc = schema_rule(g, x, depth + 1, sub[i], sizeof sub[i]);
        } else {
            json_t *one = json_deep_copy(s);
            json_object_set(one, "type", x);
            rc = one ? schema_rule(g, one, depth + 1, sub[i], sizeof sub[i]) : KVR_ENOMEM;
            json_decref(one);
        }
    }
    if (!rc) {
        new_rule(g, name, cap);
        for (i = 0; i < n; i++) {
            kvr_sbuf_puts(g->out, i ? " | " : "");
            if (kind == 0)
                json_lit(g->out, json_array_get(list, i));
            else
                kvr_sbuf_puts(g->out, sub[i]);
        }
        kvr_sbuf_puts(g->out, "\n");
    }
    kvr_free(sub);
    return rc;
}

static int schema_rule(struct gen *g, const json_t *s, int depth, char *name, size_t cap)
{
    if (!json_is_object(s) || depth > MAX_SCHEMA_DEPTH) {
        snprintf(name, cap, "json-value");
        return KVR_OK;
    }
    const json_t *v;
    if (json_is_array(v = json_object_get(s, "enum")) && json_array_size(v))
        return alternatives(g, s, v, 0, depth, name, cap);
    if ((v = json_object_get(s, "const"))) {
        new_rule(g, name, cap);
        json_lit(g->out, v);
        kvr_sbuf_puts(g->out, "\n");
        return KVR_OK;
    }
    if ((json_is_array(v = json_object_get(s, "anyOf")) ||
         json_is_array(v = json_object_get(s, "oneOf"))) &&
        json_array_size(v))
        return alternatives(g, s, v, 1, depth, name, cap);
    v = json_object_get(s, "type");
    if (json_is_array(v) && json_array_size(v))
        return alternatives(g, s, v, 2, depth, name, cap);
    const char *t = json_string_value(v);
    if (!t || (!strcmp(t, "object") && !json_object_get(s, "properties")))
        snprintf(name, cap, t ? "json-object" : "json-value");
    else if (!strcmp(t, "object"))
        return object_rule(g, s, depth, name, cap);
    else if (!strcmp(t, "array"))
        return array_rule(g, s, depth, name, cap);
    else if (!strcmp(t, "string"))
        string_rule(g, s, name, cap);
    else if (!strcmp(t, "integer"))
        integer_rule(g, s, name, cap);
    else if (!strcmp(t, "number"))
        snprintf(name, cap, "json-number");
    else if (!strcmp(t, "boolean"))
        snprintf(name, cap, "json-boolean");
    else if (!strcmp(t, "null"))
        snprintf(name, cap, "\"null\"");
    else
        snprintf(name, cap, "json-value");
    return KVR_OK;
}

int kvr_toolcall_grammar_schema(const json_t *schema, const char *name, struct kvr_sbuf *out)
{
    struct gen g = {out, name, 0};
    char top[64];
    int rc = schema_rule(&g, schema, 0, top, sizeof top);
    if (!rc)
        kvr_sbuf_printf(out, "%s ::= %s\n", name, top);
    return rc || out->failed ? KVR_ENOMEM : KVR_OK;
}

/* ---- the families' call syntax ---------------------------------------------------------- */

#define DS_CALLS_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CALLS_END "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_CALL_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CALL_END "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_SEP "<\xef\xbd\x9ctool\xe2\x96\x81" "sep\xef\xbd\x9c>"

/* XML-style parameters (Qwen3-Coder, GLM-4.5): each property as its family writes it, a
 * string's value as raw text without '<', any other as JSON. */
static int xml_params(struct gen *g, const json_t *params, bool coder, struct kvr_sbuf *expr)
{
    const json_t *props = json_object_get(params, "properties");
    const json_t *req = json_object_get(params, "required");
    const char *key;
    json_t *p;
    json_object_foreach((json_t *)props, key, p)
    {
        char val[64] = "xml-text";
        const char *t = json_string_value(json_object_get(p, "type"));
        if (!t || strcmp(t, "string") != 0) {
            int rc = schema_rule(g, p, 1, val, sizeof val);
            if (rc)
                return rc;
        }
        bool required = false;
        size_t j;
        json_t *r;
        json_array_foreach(req, j, r) required |= json_is_string(r) &&
                                                  !strcmp(json_string_value(r), key);
        char open[320], close[32];
        snprintf(open, sizeof open, coder ? "<parameter=%.256s>\n" : "<arg_key>%.256s</arg_key>\n"
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
        kvr_sbuf_printf(e, " %s \"}\"", args);
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
        snprintf(head, sizeof head, DS_CALL_BEGIN "function" DS_SEP "%s\n```json\n", fn);
        lits(e, head);
        kvr_sbuf_printf(e, " %s ", args);
        lits(e, "\n```" DS_CALL_END);
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
        char args[64];
        if ((rc = schema_rule(g, params ? params : json_object_get(fn, "parameters"), 0, args,
                              sizeof args)))
            break;
        if (!params)
            snprintf(args, sizeof args, "json-object");
        kvr_sbuf_puts(&alts, n++ ? " | " : "");
        kvr_sbuf_puts(&alts, "(");
        if ((rc = call_expr(g, o->family, name, params, args, &alts)))
            break;
        kvr_sbuf_puts(&alts, ")");
    }
    if (!rc && n == 0)
        rc = KVR_EINVAL;
    if (!rc)
        kvr_sbuf_printf(g->out, "call ::= %s\n", alts.data ? alts.data : "");
    kvr_sbuf_fini(&alts);
    return rc;
}

int kvr_toolcall_grammar(const struct kvr_toolcall_opts *o, const struct kvr_tools *t,
                         struct kvr_sbuf *out)
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
        open = DS_CALLS_BEGIN, close = DS_CALLS_END;
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
    if (o->in_think)
        kvr_sbuf_puts(out, "think ::= ([^<] | \"<\" [^/] | \"</\" [^t]){0,4096} \"</think>\" "
                           "[ \\n]{0,2}\n");
    kvr_sbuf_puts(out, "xml-text ::= [^<]{0,2048}\n");
    kvr_toolcall_grammar_json_rules(out);
    struct gen g = {out, "arg", 0};
    int rc = call_rule(&g, o, t);
    return rc ? rc : out->failed ? KVR_ENOMEM : KVR_OK;
}
