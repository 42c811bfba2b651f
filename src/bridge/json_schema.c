/* json_schema.c - JSON Schema to GBNF (see json_schema.h). Reading order: the compiler's
 * state, pointers and errors; the fixed rules every grammar has; then one function per
 * kind of schema (references, unions, enums, objects, arrays, strings, numbers) and the
 * dispatcher that checks every keyword before it is used.
 *
 * Each schema becomes one rule named sN; rules reference each other by name, and a $ref
 * target gets its rule name before its body is compiled, so recursion needs nothing
 * special. Errors carry the JSON pointer of the keyword at fault. */
#include "bridge/json_schema.h"

#include "core/alloc.h"
#include "model/grammar.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_REFS 256

struct jsc {
    const json_t *root;
    struct kvr_sbuf *out; /* the rules */
    struct kvr_err *err;
    uint32_t n_rules;
    uint32_t depth;
    char ptr[512]; /* the JSON pointer of the schema being compiled */
    size_t ptr_len;
    struct {
        const json_t *target;
        uint32_t rule;
    } refs[MAX_REFS];
    uint32_t n_refs;
};

static const char *const common_rules =
    "ws ::= | \" \"\n"
    "char ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" [\"\\\\/bfnrt]\n"
    "string ::= \"\\\"\" char* \"\\\"\"\n"
    "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n"
    "number ::= integer (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?\n"
    "boolean ::= \"true\" | \"false\"\n"
    "null ::= \"null\"\n"
    "value ::= object | array | string | number | boolean | null\n"
    "object ::= \"{\" ws ( string ws \":\" ws value ( ws \",\" ws string ws \":\" ws value )* )? "
    "ws \"}\"\n"
    "array ::= \"[\" ws ( value ( ws \",\" ws value )* )? ws \"]\"\n";

void kvr_json_object_gbnf(struct kvr_sbuf *out)
{
    kvr_sbuf_puts(out, "root ::= object\n");
    kvr_sbuf_puts(out, common_rules);
}

/* ---- pointers and errors --------------------------------------------------------------------- */

/* Append "/<token>" to the pointer (~ and / escaped); returns the length to restore. */
static size_t ptr_push(struct jsc *c, const char *tok)
{
    size_t saved = c->ptr_len;
    char *p = c->ptr + c->ptr_len, *end = c->ptr + sizeof c->ptr - 4;
    if (p < end)
        *p++ = '/';
    for (const char *s = tok; *s && p < end; s++) {
        if (*s == '~' || *s == '/') {
            *p++ = '~';
            *p++ = *s == '~' ? '0' : '1';
        } else {
            *p++ = *s;
        }
    }
    *p = 0;
    c->ptr_len = (size_t)(p - c->ptr);
    return saved;
}

static void ptr_pop(struct jsc *c, size_t saved)
{
    c->ptr_len = saved;
    c->ptr[saved] = 0;
}

static size_t ptr_push_index(struct jsc *c, size_t i)
{
    char t[24];
    snprintf(t, sizeof t, "%zu", i);
    return ptr_push(c, t);
}

/* "<pointer>/<keyword>: <message>" (the keyword may be NULL: the schema itself). */
__attribute__((format(printf, 4, 5))) static int fail(struct jsc *c, int code, const char *kw,
                                                      const char *fmt, ...)
{
    char msg[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvr_err_set(c->err, code, "%s%s%s: %s", c->ptr_len ? c->ptr : "",
                       kw ? "/" : (c->ptr_len ? "" : "/"), kw ? kw : "", msg);
}

static uint32_t new_rule(struct jsc *c)
{
    return c->n_rules++;
}

static void emit_rule(struct jsc *c, uint32_t rule, const struct kvr_sbuf *body)
{
    kvr_sbuf_printf(c->out, "s%u ::= %s\n", rule, body->data ? body->data : "\"\"");
}

static int compile(struct jsc *c, const json_t *schema, uint32_t *rule);

/* ---- literals and enums ------------------------------------------------------------------------
 */

void kvr_gbnf_literal(struct kvr_sbuf *out, const char *s, size_t n)
{
    kvr_sbuf_puts(out, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\')
            kvr_sbuf_printf(out, "\\%c", ch);
        else if (ch < 0x20 || ch == 0x7f)
            kvr_sbuf_printf(out, "\\x%02x", ch);
        else
            kvr_sbuf_append(out, &s[i], 1);
    }
    kvr_sbuf_puts(out, "\"");
}

/* The JSON text of a value as a literal (compact: what the grammar generates). */
static int value_literal(struct jsc *c, struct kvr_sbuf *body, const json_t *v, const char *kw)
{
    char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!text)
        return fail(c, KVR_ENOMEM, kw, "out of memory");
    kvr_gbnf_literal(body, text, strlen(text));
    free(text);
    return KVR_OK;
}

static bool type_matches(const json_t *v, const char *type)
{
    if (!strcmp(type, "string"))
        return json_is_string(v);
    if (!strcmp(type, "integer"))
        return json_is_integer(v) ||
               (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)));
    if (!strcmp(type, "number"))
        return json_is_number(v);
    if (!strcmp(type, "boolean"))
        return json_is_boolean(v);
    if (!strcmp(type, "null"))
        return json_is_null(v);
    if (!strcmp(type, "object"))
        return json_is_object(v);
    if (!strcmp(type, "array"))
        return json_is_array(v);
    return false;
}

/* A value is allowed by the schema's `type` (absent: any). */
static bool allowed_by_type(const json_t *schema, const json_t *v)
{
    const json_t *t = json_object_get(schema, "type");
    if (json_is_string(t))
        return type_matches(v, json_string_value(t));
    if (json_is_array(t)) {
        size_t i;
        const json_t *x;
        json_array_foreach(t, i, x) if (json_is_string(x) &&
                                        type_matches(v, json_string_value(x))) return true;
        return false;
    }
    return true;
}

static int enum_body(struct jsc *c, const json_t *schema, struct kvr_sbuf *body)
{
    const json_t *e = json_object_get(schema, "enum"), *k = json_object_get(schema, "const");
    if (k) {
        if (!allowed_by_type(schema, k))
            return fail(c, KVR_EINVAL, "const", "the value does not have the schema's type");
        return value_literal(c, body, k, "const");
    }
    if (!json_is_array(e) || json_array_size(e) == 0)
        return fail(c, KVR_EINVAL, "enum", "must be a non-empty array");
    size_t i, n = 0;
    const json_t *v;
    json_array_foreach(e, i, v)
    {
        if (!allowed_by_type(schema, v))
            continue; /* the type rules it out: it would not validate */
        if (n++)
            kvr_sbuf_puts(body, " | ");
        int rc = value_literal(c, body, v, "enum");
        if (rc)
            return rc;
    }
    if (!n)
        return fail(c, KVR_EINVAL, "enum", "no value has the schema's type");
    return KVR_OK;
}

/* ---- references and unions ------------------------------------------------------------------- */

/* "#", "#/$defs/x", "#/definitions/x", or any "#/..." pointer into the root. */
static int ref_rule(struct jsc *c, const json_t *ref, uint32_t *rule)
{
    if (!json_is_string(ref))
        return fail(c, KVR_EINVAL, "$ref", "must be a string");
    const char *r = json_string_value(ref);
    if (r[0] != '#')
        return fail(c, KVR_ENOTSUP, "$ref",
                    "only references inside the schema (#...) are supported");
    const json_t *target = r[1] ? NULL : c->root;
    if (r[1] == '/') {
        char *path = kvr_strdup(r + 2);
        if (!path)
            return fail(c, KVR_ENOMEM, "$ref", "out of memory");
        target = c->root;
        for (char *tok = path, *next; target && tok; tok = next) {
            next = strchr(tok, '/');
            if (next)
                *next++ = 0;
            char *w = tok; /* unescape ~1 and ~0 in place */
            for (char *s = tok; *s; s++)
                *w++ =
                    s[0] == '~' && (s[1] == '0' || s[1] == '1') ? (++s, *s == '0' ? '~' : '/') : *s;
            *w = 0;
            target = json_is_object(target) ? json_object_get(target, tok)
                     : json_is_array(target)
                         ? json_array_get(target, (size_t)strtoul(tok, NULL, 10))
                         : NULL;
        }
        kvr_free(path);
    }
    if (!target)
        return fail(c, KVR_EINVAL, "$ref", "'%s' does not resolve", r);
    for (uint32_t i = 0; i < c->n_refs; i++)
        if (c->refs[i].target == target) {
            *rule = c->refs[i].rule;
            return KVR_OK;
        }
    if (c->n_refs == MAX_REFS)
        return fail(c, KVR_ERANGE, "$ref", "more than %d referenced schemas", MAX_REFS);
    /* named before compiled: a recursive reference finds it */
    c->refs[c->n_refs].target = target;
    c->refs[c->n_refs].rule = UINT32_MAX;
    uint32_t slot = c->n_refs++;
    uint32_t inner;
    size_t saved = c->ptr_len;
    char saved_ptr[sizeof c->ptr];
    memcpy(saved_ptr, c->ptr, sizeof saved_ptr);
    snprintf(c->ptr, sizeof c->ptr, "%s", r + 1);
    c->ptr_len = strlen(c->ptr);
    uint32_t r_rule = new_rule(c);
    c->refs[slot].rule = r_rule;
    int rc = compile(c, target, &inner);
    memcpy(c->ptr, saved_ptr, sizeof saved_ptr);
    c->ptr_len = saved;
    if (rc)
        return rc;
    kvr_sbuf_printf(c->out, "s%u ::= s%u\n", r_rule, inner);
    *rule = r_rule;
    return KVR_OK;
}

static int union_body(struct jsc *c, const json_t *arr, const char *kw, struct kvr_sbuf *body)
{
    if (!json_is_array(arr) || json_array_size(arr) == 0)
        return fail(c, KVR_EINVAL, kw, "must be a non-empty array of schemas");
    size_t saved = ptr_push(c, kw), i;
    const json_t *sub;
    json_array_foreach(arr, i, sub)
    {
        size_t s2 = ptr_push_index(c, i);
        uint32_t r;
        int rc = compile(c, sub, &r);
        ptr_pop(c, s2);
        if (rc) {
            ptr_pop(c, saved);
            return rc;
        }
        kvr_sbuf_printf(body, "%ss%u", i ? " | " : "", r);
    }
    ptr_pop(c, saved);
    return KVR_OK;
}

/* ---- objects and arrays ---------------------------------------------------------------------- */

static int get_count(struct jsc *c, const json_t *schema, const char *kw, uint64_t dflt,
                     uint64_t *out)
{
    const json_t *v = json_object_get(schema, kw);
    *out = dflt;
    if (!v)
        return KVR_OK;
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return fail(c, KVR_EINVAL, kw, "must be a non-negative integer");
    if (json_integer_value(v) > KVR_JSON_SCHEMA_MAX_LENGTH)
        return fail(c, KVR_ERANGE, kw, "above %d is not supported", KVR_JSON_SCHEMA_MAX_LENGTH);
    *out = (uint64_t)json_integer_value(v);
    return KVR_OK;
}

static bool is_required(const json_t *req, const char *name)
{
    size_t i;
    const json_t *x;
    json_array_foreach(req, i,
                       x) if (json_is_string(x) && !strcmp(json_string_value(x), name)) return true;
    return false;
}

/* Properties in the schema's order, every required one present: the first property written
 * is any up to the first required one, and each later one follows with its comma (a rule
 * chain tN ::= ("," ws kv)? tN+1, so the grammar grows linearly). */
static int object_props(struct jsc *c, const json_t *props, const json_t *req,
                        struct kvr_sbuf *body)
{
    size_t n = json_object_size(props), k = 0;
    if (n > 256)
        return fail(c, KVR_ERANGE, "properties", "more than 256 properties");
    uint32_t kv[256], tail[257];
    bool reqd[256];
    const char *key;
    const json_t *sub;
    size_t saved = ptr_push(c, "properties");
    json_object_foreach((json_t *)props, key, sub)
    {
        size_t s2 = ptr_push(c, key);
        uint32_t r;
        int rc = compile(c, sub, &r);
        ptr_pop(c, s2);
        if (rc) {
            ptr_pop(c, saved);
            return rc;
        }
        kv[k] = new_rule(c);
        reqd[k] = is_required(req, key);
        json_t *ks = json_string(key);
        char *qk = ks ? json_dumps(ks, JSON_ENCODE_ANY) : NULL; /* the key as JSON */
        json_decref(ks);
        if (!qk) {
            ptr_pop(c, saved);
            return fail(c, KVR_ENOMEM, "properties", "out of memory");
        }
        kvr_sbuf_printf(c->out, "s%u ::= ", kv[k]);
        kvr_gbnf_literal(c->out, qk, strlen(qk));
        free(qk);
        kvr_sbuf_printf(c->out, " ws \":\" ws s%u\n", r);
        k++;
    }
    ptr_pop(c, saved);
    for (size_t i = n + 1; i-- > 0;) {
        tail[i] = new_rule(c);
        if (i == n)
            kvr_sbuf_printf(c->out, "s%u ::= \"\"\n", tail[i]);
        else
            kvr_sbuf_printf(c->out, "s%u ::= %s\",\" ws s%u%s s%u\n", tail[i], reqd[i] ? "" : "(",
                            kv[i], reqd[i] ? "" : ")?", tail[i + 1]);
    }
    kvr_sbuf_puts(body, "\"{\" ws ");
    bool any_required = false;
    kvr_sbuf_puts(body, "(");
    for (size_t i = 0; i < n; i++) {
        kvr_sbuf_printf(body, "%ss%u s%u", i ? " | " : "", kv[i], tail[i + 1]);
        if (reqd[i]) {
            any_required = true;
            break;
        }
    }
    kvr_sbuf_puts(body, any_required ? ")" : ")?");
    kvr_sbuf_puts(body, " ws \"}\"");
    return KVR_OK;
}

static int object_body(struct jsc *c, const json_t *schema, struct kvr_sbuf *body)
{
    const json_t *props = json_object_get(schema, "properties");
    const json_t *req = json_object_get(schema, "required");
    const json_t *add = json_object_get(schema, "additionalProperties");
    if (props && !json_is_object(props))
        return fail(c, KVR_EINVAL, "properties", "must be an object");
    if (req && !json_is_array(req))
        return fail(c, KVR_EINVAL, "required", "must be an array of names");
    size_t i;
    const json_t *x;
    json_array_foreach(req, i,
                       x) if (!json_is_string(x) || !json_object_get(props, json_string_value(x)))
    {
        size_t s = ptr_push(c, "required");
        ptr_push_index(c, i);
        int rc = fail(c, KVR_ENOTSUP, NULL, "a required property without a schema in properties");
        ptr_pop(c, s);
        return rc;
    }
    if (add && !json_is_boolean(add) && !json_is_object(add))
        return fail(c, KVR_EINVAL, "additionalProperties", "must be a boolean or a schema");
    if (props && json_object_size(props))
        return object_props(c, props, req, body);
    if (json_is_false(add)) {
        kvr_sbuf_puts(body, "\"{\" ws \"}\"");
        return KVR_OK;
    }
    uint32_t vr = 0;
    if (json_is_object(add)) { /* a map: any keys, values of one schema */
        size_t s = ptr_push(c, "additionalProperties");
        int rc = compile(c, add, &vr);
        ptr_pop(c, s);
        if (rc)
            return rc;
        kvr_sbuf_printf(body,
                        "\"{\" ws ( string ws \":\" ws s%u ( ws \",\" ws string ws \":\" ws "
                        "s%u )* )? ws \"}\"",
                        vr, vr);
        return KVR_OK;
    }
    kvr_sbuf_puts(body, "object");
    return KVR_OK;
}

static int array_body(struct jsc *c, const json_t *schema, struct kvr_sbuf *body)
{
    uint64_t lo, hi;
    int rc = get_count(c, schema, "minItems", 0, &lo);
    if (!rc)
        rc = get_count(c, schema, "maxItems", UINT64_MAX, &hi);
    if (rc)
        return rc;
    if (hi < lo)
        return fail(c, KVR_EINVAL, "maxItems", "below minItems");
    const json_t *items = json_object_get(schema, "items");
    char item[24] = "value";
    if (items) {
        if (!json_is_object(items) && !json_is_boolean(items))
            return fail(c, KVR_ENOTSUP, "items", "only one schema for every item is supported");
        uint32_t r;
        size_t s = ptr_push(c, "items");
        rc = compile(c, items, &r);
        ptr_pop(c, s);
        if (rc)
            return rc;
        snprintf(item, sizeof item, "s%u", r);
    }
    if (hi == 0) {
        kvr_sbuf_puts(body, "\"[\" ws \"]\"");
        return KVR_OK;
    }
    kvr_sbuf_printf(body, "\"[\" ws %s%s ( ws \",\" ws %s )", lo ? "" : "( ", item, item);
    if (hi == UINT64_MAX)
        kvr_sbuf_printf(body, "{%llu,}", (unsigned long long)(lo ? lo - 1 : 0));
    else
        kvr_sbuf_printf(body, "{%llu,%llu}", (unsigned long long)(lo ? lo - 1 : 0),
                        (unsigned long long)(hi - 1));
    kvr_sbuf_printf(body, "%s ws \"]\"", lo ? "" : " )?");
    return KVR_OK;
}

/* ---- strings and numbers -----------------------------------------------------------------------
 */

static int string_body(struct jsc *c, const json_t *schema, struct kvr_sbuf *body)
{
    const json_t *fmt = json_object_get(schema, "format"),
                 *pat = json_object_get(schema, "pattern");
    bool lens = json_object_get(schema, "minLength") || json_object_get(schema, "maxLength");
    if (fmt) {
        if (pat || lens)
            return fail(c, KVR_ENOTSUP, pat ? "pattern" : "minLength",
                        "together with format is not supported");
        if (!json_is_string(fmt) || kvr_gbnf_format(body, json_string_value(fmt)))
            return fail(c, KVR_ENOTSUP, "format", "unsupported format %s",
                        json_is_string(fmt) ? json_string_value(fmt) : "(not a string)");
        return KVR_OK;
    }
    if (pat) {
        const char *why = NULL;
        if (lens)
            return fail(c, KVR_ENOTSUP, "minLength", "together with pattern is not supported");
        if (!json_is_string(pat))
            return fail(c, KVR_EINVAL, "pattern", "must be a string");
        if (kvr_gbnf_pattern(body, json_string_value(pat), &why))
            return fail(c, KVR_ENOTSUP, "pattern", "%s", why ? why : "unsupported");
        return KVR_OK;
    }
    uint64_t lo, hi;
    int rc = get_count(c, schema, "minLength", 0, &lo);
    if (!rc)
        rc = get_count(c, schema, "maxLength", UINT64_MAX, &hi);
    if (rc)
        return rc;
    if (hi < lo)
        return fail(c, KVR_EINVAL, "maxLength", "below minLength");
    if (!lo && hi == UINT64_MAX)
        kvr_sbuf_puts(body, "string");
    else if (hi == UINT64_MAX)
        kvr_sbuf_printf(body, "\"\\\"\" char{%llu,} \"\\\"\"", (unsigned long long)lo);
    else
        kvr_sbuf_printf(body, "\"\\\"\" char{%llu,%llu} \"\\\"\"", (unsigned long long)lo,
                        (unsigned long long)hi);
    return KVR_OK;
}

#define BOUND_LIMIT 1e15 /* integers beyond this are generated as unbounded on that side */

/* One bound as an integer limit: `up` rounds a lower bound up (and past an exclusive one). */
static int bound(struct jsc *c, const json_t *schema, const char *kw, const char *ex_kw, bool lower,
                 int64_t *out)
{
    const json_t *v = json_object_get(schema, kw), *ex = json_object_get(schema, ex_kw);
    *out = lower ? INT64_MIN : INT64_MAX;
    bool excl = false;
    double x = 0;
    if (ex && json_is_boolean(ex)) { /* draft 4: a flag on the plain bound */
        excl = json_is_true(ex);
        ex = NULL;
    }
    if (v && !json_is_number(v))
        return fail(c, KVR_EINVAL, kw, "must be a number");
    if (ex && !json_is_number(ex))
        return fail(c, KVR_EINVAL, ex_kw, "must be a number or a boolean");
    bool have = v || ex;
    if (v && ex) { /* both: the tighter */
        double a = json_number_value(v), b = json_number_value(ex);
        excl = lower ? b >= a : b <= a;
        x = excl ? b : a;
    } else if (have) {
        x = json_number_value(v ? v : ex);
        excl = excl || ex;
    }
    if (!have || fabs(x) > BOUND_LIMIT)
        return KVR_OK;
    double r = lower ? ceil(x) : floor(x);
    if (excl && r == x)
        r += lower ? 1 : -1;
    *out = (int64_t)r;
    return KVR_OK;
}

static int number_body(struct jsc *c, const json_t *schema, bool integer, struct kvr_sbuf *body)
{
    const json_t *mult = json_object_get(schema, "multipleOf");
    if (mult && !(integer && json_is_number(mult) && json_number_value(mult) == 1.0))
        return fail(c, KVR_ENOTSUP, "multipleOf", "unsupported keyword");
    int64_t lo, hi;
    int rc = bound(c, schema, "minimum", "exclusiveMinimum", true, &lo);
    if (!rc)
        rc = bound(c, schema, "maximum", "exclusiveMaximum", false, &hi);
    if (rc)
        return rc;
    if (lo == INT64_MIN && hi == INT64_MAX) {
        kvr_sbuf_puts(body, integer ? "integer" : "number");
        return KVR_OK;
    }
    if (lo > hi)
        return fail(c, integer ? KVR_EINVAL : KVR_ENOTSUP, "maximum",
                    "no integer lies within the bounds%s",
                    integer ? "" : " (numbers are generated from integers)");
    kvr_sbuf_puts(body, "(");
    kvr_gbnf_int_range(body, lo, hi);
    kvr_sbuf_puts(body, ")");
    int64_t dlo = lo > 0 ? lo : 0, dhi = hi == INT64_MAX ? hi : hi - 1;
    if (!integer && dlo <= dhi) { /* k.ddd with k in [dlo, hi - 1] stays in [lo, hi] */
        kvr_sbuf_puts(body, " | (");
        kvr_gbnf_int_range(body, dlo, dhi);
        kvr_sbuf_puts(body, ") \".\" [0-9]{1,6}");
    }
    return KVR_OK;
}

/* ---- the dispatcher ---------------------------------------------------------------------------
 */

static const char *const annotations[] = {
    "title",      "description", "default",   "examples", "$schema",     "$id", "$comment",
    "deprecated", "readOnly",    "writeOnly", "$defs",    "definitions", NULL};
static const char *const supported[] = {"type",
                                        "enum",
                                        "const",
                                        "anyOf",
                                        "oneOf",
                                        "allOf",
                                        "$ref",
                                        "properties",
                                        "required",
                                        "additionalProperties",
                                        "items",
                                        "minItems",
                                        "maxItems",
                                        "minLength",
                                        "maxLength",
                                        "pattern",
                                        "format",
                                        "minimum",
                                        "maximum",
                                        "exclusiveMinimum",
                                        "exclusiveMaximum",
                                        "multipleOf",
                                        NULL};

static bool in_list(const char *const *list, const char *k)
{
    for (; *list; list++)
        if (!strcmp(*list, k))
            return true;
    return false;
}

/* Every keyword is known; a $ref, a union or allOf stands alone (annotations aside). */
static int check_keywords(struct jsc *c, const json_t *schema)
{
    const char *key, *alone = NULL;
    const json_t *v;
    size_t n_constraints = 0;
    json_object_foreach((json_t *)schema, key, v)
    {
        if (in_list(annotations, key))
            continue;
        if (!in_list(supported, key))
            return fail(c, KVR_ENOTSUP, key, "unsupported keyword");
        n_constraints++;
        if (!strcmp(key, "$ref") || !strcmp(key, "anyOf") || !strcmp(key, "oneOf") ||
            !strcmp(key, "allOf"))
            alone = key;
    }
    if (alone && n_constraints > 1)
        return fail(c, KVR_ENOTSUP, alone, "beside other constraining keywords is not supported");
    return KVR_OK;
}

/* The types a schema without `type` stands for, from the keywords it uses. */
static const char *implied_type(const json_t *s)
{
    if (json_object_get(s, "properties") || json_object_get(s, "additionalProperties") ||
        json_object_get(s, "required"))
        return "object";
    if (json_object_get(s, "items") || json_object_get(s, "minItems") ||
        json_object_get(s, "maxItems"))
        return "array";
    if (json_object_get(s, "minLength") || json_object_get(s, "maxLength") ||
        json_object_get(s, "pattern") || json_object_get(s, "format"))
        return "string";
    if (json_object_get(s, "minimum") || json_object_get(s, "maximum") ||
        json_object_get(s, "exclusiveMinimum") || json_object_get(s, "exclusiveMaximum"))
        return "number";
    return NULL;
}

static int type_body(struct jsc *c, const json_t *schema, const char *t, struct kvr_sbuf *body)
{
    kvr_sbuf_puts(body, "(");
    int rc = KVR_OK;
    if (!strcmp(t, "string"))
        rc = string_body(c, schema, body);
    else if (!strcmp(t, "integer") || !strcmp(t, "number"))
        rc = number_body(c, schema, t[0] == 'i', body);
    else if (!strcmp(t, "boolean") || !strcmp(t, "null"))
        kvr_sbuf_puts(body, t);
    else if (!strcmp(t, "object"))
        rc = object_body(c, schema, body);
    else if (!strcmp(t, "array"))
        rc = array_body(c, schema, body);
    else
        rc = fail(c, KVR_EINVAL, "type", "unknown type '%s'", t);
    kvr_sbuf_puts(body, ")");
    return rc;
}

static int schema_body(struct jsc *c, const json_t *schema, struct kvr_sbuf *body)
{
    const json_t *v;
    if ((v = json_object_get(schema, "$ref"))) {
        uint32_t r;
        int rc = ref_rule(c, v, &r);
        kvr_sbuf_printf(body, "s%u", r);
        return rc;
    }
    if (json_object_get(schema, "enum") || json_object_get(schema, "const"))
        return enum_body(c, schema, body);
    if ((v = json_object_get(schema, "anyOf")))
        return union_body(c, v, "anyOf", body);
    if ((v = json_object_get(schema, "oneOf")))
        return union_body(c, v, "oneOf", body);
    if ((v = json_object_get(schema, "allOf"))) {
        if (!json_is_array(v) || json_array_size(v) != 1)
            return fail(c, KVR_ENOTSUP, "allOf", "only allOf with one schema is supported");
        return union_body(c, v, "allOf", body);
    }
    const json_t *t = json_object_get(schema, "type");
    if (!t) {
        const char *it = implied_type(schema);
        if (!it) {
            kvr_sbuf_puts(body, "value");
            return KVR_OK;
        }
        return type_body(c, schema, it, body);
    }
    if (json_is_string(t))
        return type_body(c, schema, json_string_value(t), body);
    if (!json_is_array(t) || !json_array_size(t))
        return fail(c, KVR_EINVAL, "type", "must be a type name or a non-empty array of them");
    size_t i;
    json_array_foreach(t, i, v)
    {
        if (!json_is_string(v))
            return fail(c, KVR_EINVAL, "type", "must be a type name or a non-empty array of them");
        if (i)
            kvr_sbuf_puts(body, " | ");
        int rc = type_body(c, schema, json_string_value(v), body);
        if (rc)
            return rc;
    }
    return KVR_OK;
}

static int compile(struct jsc *c, const json_t *schema, uint32_t *rule)
{
    if (json_is_boolean(schema) && json_is_false(schema))
        return fail(c, KVR_EINVAL, NULL, "the schema false allows no value");
    if (!json_is_boolean(schema) && !json_is_object(schema))
        return fail(c, KVR_EINVAL, NULL, "a schema must be an object or a boolean");
    if (c->depth >= KVR_JSON_SCHEMA_MAX_DEPTH)
        return fail(c, KVR_ERANGE, NULL, "nested deeper than %d", KVR_JSON_SCHEMA_MAX_DEPTH);
    if (c->out->len > KVR_GRAMMAR_MAX_TEXT_BYTES)
        return fail(c, KVR_ERANGE, NULL, "the grammar grew past %u bytes",
                    KVR_GRAMMAR_MAX_TEXT_BYTES);
    int rc = json_is_object(schema) ? check_keywords(c, schema) : KVR_OK;
    if (rc)
        return rc;
    struct kvr_sbuf body;
    kvr_sbuf_init(&body);
    c->depth++;
    if (json_is_boolean(schema))
        kvr_sbuf_puts(&body, "value");
    else
        rc = schema_body(c, schema, &body);
    c->depth--;
    if (!rc) {
        *rule = new_rule(c);
        emit_rule(c, *rule, &body);
    }
    bool failed = body.failed;
    kvr_sbuf_fini(&body);
    if (!rc && (failed || c->out->failed))
        rc = fail(c, KVR_ENOMEM, NULL, "out of memory");
    return rc;
}

int kvr_json_schema_gbnf(const json_t *schema, struct kvr_sbuf *out, struct kvr_err *err)
{
    struct jsc *c = kvr_calloc(1, sizeof *c);
    if (!c)
        return kvr_err_set(err, KVR_ENOMEM, "json_schema: out of memory");
    c->root = schema;
    c->out = out;
    c->err = err;
    uint32_t r;
    int rc = compile(c, schema, &r);
    if (!rc) {
        kvr_sbuf_printf(out, "root ::= s%u\n", r);
        kvr_sbuf_puts(out, common_rules);
        if (out->failed)
            rc = kvr_err_set(err, KVR_ENOMEM, "json_schema: out of memory");
        else if (out->len > KVR_GRAMMAR_MAX_TEXT_BYTES)
            rc =
                kvr_err_set(err, KVR_ERANGE, "json_schema: the grammar has %zu bytes, more than %u",
                            out->len, KVR_GRAMMAR_MAX_TEXT_BYTES);
    }
    kvr_free(c);
    return rc;
}
