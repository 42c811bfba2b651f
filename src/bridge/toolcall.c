/* toolcall.c - reasoning, text and tool calls out of a model's answer (see toolcall.h).
 *
 * Sections: detection, small scanners, building a call, one reader per family, the
 * driver (reasoning, then text and calls in order). Every reader takes the answer and a
 * position where its family's trigger begins and says whether a whole call (or run of
 * calls) is there, one is still being written, or the text is not a call after all. */
#include "bridge/toolcall.h"

#include "core/alloc.h"
#include "core/err.h"

#include <string.h>

static const char *const family_names[KVR_TOOLCALL_FAMILY_COUNT] = {
    [KVR_TOOLCALL_GENERIC] = "generic",         [KVR_TOOLCALL_LLAMA3] = "llama3",
    [KVR_TOOLCALL_HERMES] = "hermes",           [KVR_TOOLCALL_MISTRAL] = "mistral",
    [KVR_TOOLCALL_QWEN3_CODER] = "qwen3_coder", [KVR_TOOLCALL_GLM45] = "glm45",
    [KVR_TOOLCALL_HARMONY] = "harmony",         [KVR_TOOLCALL_DEEPSEEK_V3] = "deepseek_v3",
};

const char *kvr_toolcall_family_name(enum kvr_toolcall_family f)
{
    return (unsigned)f < KVR_TOOLCALL_FAMILY_COUNT ? family_names[f] : "?";
}

static const char *find(const char *hay, size_t len, const char *needle)
{
    size_t n = strlen(needle);
    for (size_t i = 0; hay && i + n <= len; i++)
        if (!memcmp(hay + i, needle, n))
            return hay + i;
    return NULL;
}

/* The most specific marker first: Qwen3-Coder and GLM-4.5 also say <tool_call>. */
enum kvr_toolcall_family kvr_toolcall_detect(const char *t, size_t len, bool *think)
{
    if (think)
        *think = find(t, len, "<think>") != NULL;
    if (find(t, len, "<|channel|>"))
        return KVR_TOOLCALL_HARMONY;
    if (find(t, len,
             "tool\xe2\x96\x81"
             "calls\xe2\x96\x81"
             "begin"))
        return KVR_TOOLCALL_DEEPSEEK_V3;
    if (find(t, len, "<arg_key>"))
        return KVR_TOOLCALL_GLM45;
    if (find(t, len, "<function=") && find(t, len, "<parameter="))
        return KVR_TOOLCALL_QWEN3_CODER;
    if (find(t, len, "<tool_call>"))
        return KVR_TOOLCALL_HERMES;
    if (find(t, len, "[TOOL_CALLS]"))
        return KVR_TOOLCALL_MISTRAL;
    if (find(t, len, "<|python_tag|>") || find(t, len, "<|start_header_id|>"))
        return KVR_TOOLCALL_LLAMA3;
    return KVR_TOOLCALL_GENERIC;
}

void kvr_toolcall_result_init(struct kvr_toolcall_result *r)
{
    memset(r, 0, sizeof *r);
    kvr_sbuf_init(&r->content);
    kvr_sbuf_init(&r->reasoning);
}

static void clear_calls(struct kvr_toolcall_result *r)
{
    for (uint32_t i = 0; i < r->n_calls; i++) {
        kvr_free(r->calls[i].name);
        kvr_free(r->calls[i].arguments);
    }
    r->n_calls = 0;
}

void kvr_toolcall_result_fini(struct kvr_toolcall_result *r)
{
    clear_calls(r);
    kvr_sbuf_fini(&r->content);
    kvr_sbuf_fini(&r->reasoning);
}

/* ---- scanners ---------------------------------------------------------------------- */

size_t kvr_toolcall_partial(const char *text, size_t len, const char *marker)
{
    size_t m = strlen(marker);
    for (size_t k = m - 1 < len ? m - 1 : len; k > 0; k--)
        if (!memcmp(text + len - k, marker, k))
            return k;
    return 0;
}

static bool at(const char *s, size_t len, size_t pos, const char *lit)
{
    size_t n = strlen(lit);
    return pos + n <= len && !memcmp(s + pos, lit, n);
}

static size_t skip_ws(const char *s, size_t len, size_t pos)
{
    while (pos < len && (s[pos] == ' ' || s[pos] == '\n' || s[pos] == '\r' || s[pos] == '\t'))
        pos++;
    return pos;
}

/* Where `lit` next starts at or after pos, or len. */
static size_t index_of(const char *s, size_t len, size_t pos, const char *lit)
{
    if (pos >= len)
        return len;
    const char *p = find(s + pos, len - pos, lit);
    return p ? (size_t)(p - s) : len;
}

enum scan { SCAN_OK, SCAN_MORE, SCAN_BAD };

/* The end of the JSON value at pos: strings and nesting followed, the value's text not
 * checked (jansson does that). SCAN_MORE when the text ends inside it. */
static enum scan json_end(const char *s, size_t len, size_t pos, size_t *end)
{
    if (pos >= len)
        return SCAN_MORE;
    if (s[pos] != '{' && s[pos] != '[')
        return SCAN_BAD;
    int depth = 0;
    bool str = false;
    for (size_t i = pos; i < len; i++) {
        char c = s[i];
        if (str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                str = false;
            continue;
        }
        if (c == '"')
            str = true;
        else if (c == '{' || c == '[')
            depth++;
        else if ((c == '}' || c == ']') && --depth == 0) {
            *end = i + 1;
            return SCAN_OK;
        }
        if (depth > 512)
            return SCAN_BAD;
    }
    return SCAN_MORE;
}

/* ---- building calls ------------------------------------------------------------------- */

static char *dupn(const char *s, size_t n)
{
    char *p = kvr_malloc(n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}

/* Append a call; `args` is borrowed (an object). False when full, out of memory, or the
 * name is not a word of at most 64 bytes. */
static bool add_call(struct kvr_toolcall_result *r, const char *name, size_t name_len,
                     const json_t *args)
{
    if (r->n_calls >= KVR_TOOLCALL_MAX_CALLS || !json_is_object(args) || name_len == 0 ||
        name_len > 64)
        return false;
    for (size_t i = 0; i < name_len; i++)
        if ((unsigned char)name[i] <= ' ' || name[i] == '<' || name[i] == '"')
            return false; /* a name is one word of text */
    char *a = json_dumps(args, JSON_COMPACT | JSON_PRESERVE_ORDER);
    char *n = dupn(name, name_len);
    char *ak = a ? dupn(a, strlen(a)) : NULL;
    free(a);
    if (!n || !ak) {
        kvr_free(n);
        kvr_free(ak);
        return false;
    }
    r->calls[r->n_calls++] = (struct kvr_toolcall){n, ak};
    return true;
}

/* {"name": "f", "arguments"|"parameters": {...} or a string holding one}. */
static bool add_json_call(struct kvr_toolcall_result *r, const json_t *o)
{
    const json_t *n = json_object_get(o, "name");
    const json_t *a = json_object_get(o, "arguments");
    if (!a)
        a = json_object_get(o, "parameters");
    if (!json_is_string(n))
        return false;
    json_t *own = NULL;
    if (json_is_string(a))
        a = own = json_loads(json_string_value(a), 0, NULL);
    json_t *empty = a ? NULL : json_object();
    bool ok = add_call(r, json_string_value(n), json_string_length(n), a ? a : empty);
    json_decref(own);
    json_decref(empty);
    return ok;
}

static json_t *load(const char *s, size_t n)
{
    return json_loadb(s, n, 0, NULL);
}

/* The type a function's schema gives parameter `key`, or NULL. */
static const char *param_type(const json_t *tools, const char *fn, size_t fn_len, const char *key,
                              size_t key_len)
{
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        const json_t *f = json_object_get(t, "function");
        const json_t *n = json_object_get(f, "name");
        if (!json_is_string(n) || json_string_length(n) != fn_len ||
            memcmp(json_string_value(n), fn, fn_len) != 0)
            continue;
        const json_t *props = json_object_get(json_object_get(f, "parameters"), "properties");
        const char *k;
        json_t *p;
        json_object_foreach((json_t *)props, k,
                            p) if (strlen(k) == key_len && !memcmp(k, key, key_len))
        {
            return json_string_value(json_object_get(p, "type"));
        }
    }
    return NULL;
}

/* An XML-style value: a string when the schema says so, else JSON if it parses. */
static json_t *xml_value(const json_t *tools, const char *fn, size_t fn_len, const char *key,
                         size_t key_len, const char *v, size_t n)
{
    const char *type = param_type(tools, fn, fn_len, key, key_len);
    if (!type || strcmp(type, "string") != 0) {
        json_t *j = json_loadb(v, n, JSON_DECODE_ANY, NULL);
        if (j)
            return j;
    }
    return json_stringn(v, n);
}

static size_t trim_nl(const char *s, size_t *b, size_t e)
{
    if (*b < e && s[*b] == '\n')
        (*b)++;
    if (e > *b && s[e - 1] == '\n')
        e--;
    return e;
}

/* ---- readers, one per family ------------------------------------------------------------ */

/* Each reads from `pos` (where its trigger starts) and sets *next past what it took. */
struct reader {
    const struct kvr_toolcall_opts *o;
    const char *s;
    size_t len;
    bool final;
    struct kvr_toolcall_result *r;
};

/* A JSON object at pos holding one call, or an array of them. */
static enum scan read_json_calls(struct reader *d, size_t pos, size_t *next)
{
    size_t end;
    enum scan sc = json_end(d->s, d->len, pos, &end);
    if (sc != SCAN_OK)
        return sc;
    json_t *j = load(d->s + pos, end - pos);
    bool ok = j != NULL;
    if (json_is_array(j)) {
        size_t i;
        json_t *x;
        ok = json_array_size(j) > 0;
        json_array_foreach(j, i, x) ok = ok && add_json_call(d->r, x);
    } else if (j) {
        ok = add_json_call(d->r, j);
    }
    json_decref(j);
    *next = end;
    return ok ? SCAN_OK : SCAN_BAD;
}

/* HERMES: <tool_call> JSON </tool_call>. */
static enum scan read_hermes(struct reader *d, size_t pos, size_t *next)
{
    size_t p = skip_ws(d->s, d->len, pos + strlen("<tool_call>")), end;
    enum scan sc = read_json_calls(d, p, &end);
    if (sc != SCAN_OK)
        return sc;
    p = skip_ws(d->s, d->len, end);
    if (at(d->s, d->len, p, "</tool_call>")) {
        *next = p + strlen("</tool_call>");
        return SCAN_OK;
    }
    if (p >= d->len || kvr_toolcall_partial(d->s + p, d->len - p, "</tool_call>") == d->len - p) {
        *next = p;
        return d->final ? SCAN_OK : SCAN_MORE; /* the end of the answer closes it */
    }
    return SCAN_BAD;
}

/* <tool_call> ... </tool_call> around XML-style parameters: Qwen3-Coder's <function=f>
 * <parameter=k>v</parameter> or GLM-4.5's f <arg_key>k</arg_key><arg_value>v</arg_value>. */
static enum scan read_xml(struct reader *d, size_t pos, size_t *next)
{
    const char *s = d->s;
    size_t b = pos + strlen("<tool_call>");
    size_t close = index_of(s, d->len, b, "</tool_call>");
    if (close == d->len)
        return SCAN_MORE;
    bool coder = d->o->family == KVR_TOOLCALL_QWEN3_CODER;
    size_t p = skip_ws(s, close, b), name_b, name_e;
    if (coder) {
        if (!at(s, close, p, "<function="))
            return SCAN_BAD;
        name_b = p + strlen("<function=");
        name_e = index_of(s, close, name_b, ">");
        p = name_e + 1;
    } else {
        name_b = p;
        name_e = index_of(s, close, p, "<arg_key>");
        p = name_e;
    }
    while (name_e > name_b && (s[name_e - 1] == '\n' || s[name_e - 1] == ' '))
        name_e--;
    if (name_e >= close || name_e == name_b)
        return SCAN_BAD;
    const char *kopen = coder ? "<parameter=" : "<arg_key>";
    const char *kclose = coder ? ">" : "</arg_key>";
    const char *vclose = coder ? "</parameter>" : "</arg_value>";
    json_t *args = json_object();
    bool ok = args != NULL;
    for (p = skip_ws(s, close, p); ok && at(s, close, p, kopen); p = skip_ws(s, close, p)) {
        size_t kb = p + strlen(kopen), ke = index_of(s, close, kb, kclose);
        if (ke >= close) {
            ok = false;
            break;
        }
        size_t vb = ke + strlen(kclose);
        if (!coder) {
            vb = skip_ws(s, close, vb);
            ok = at(s, close, vb, "<arg_value>");
            vb += strlen("<arg_value>");
        }
        size_t ve = index_of(s, close, vb, vclose);
        ok = ok && ke < close && ve < close;
        if (!ok)
            break;
        p = ve + strlen(vclose);
        ve = trim_nl(s, &vb, ve);
        char key[256];
        ok = ke - kb < sizeof key;
        if (ok) {
            memcpy(key, s + kb, ke - kb);
            key[ke - kb] = 0;
            json_t *v =
                xml_value(d->o->tools, s + name_b, name_e - name_b, key, ke - kb, s + vb, ve - vb);
            ok = v && !json_object_set_new(args, key, v);
        }
    }
    if (ok && coder) {
        ok = at(s, close, p, "</function>");
        p += strlen("</function>");
    }
    ok = ok && skip_ws(s, close, p) == close && add_call(d->r, s + name_b, name_e - name_b, args);
    json_decref(args);
    *next = close + strlen("</tool_call>");
    return ok ? SCAN_OK : SCAN_BAD;
}

/* MISTRAL: [TOOL_CALLS] then a JSON array, or name[ARGS]{...}. */
static enum scan read_mistral(struct reader *d, size_t pos, size_t *next)
{
    size_t p = skip_ws(d->s, d->len, pos + strlen("[TOOL_CALLS]"));
    if (p < d->len && d->s[p] == '[')
        return read_json_calls(d, p, next);
    /* The name is at most 64 bytes, so "[ARGS]" is looked for only that far: the same
     * answer then decides the same way however much of it has come. */
    size_t window = p + 64 + strlen("[ARGS]"), end_w = window < d->len ? window : d->len;
    size_t args = index_of(d->s, end_w, p, "[ARGS]");
    if (args == end_w)
        return end_w == window ? SCAN_BAD : SCAN_MORE;
    size_t b = args + strlen("[ARGS]"), end;
    enum scan sc = json_end(d->s, d->len, b, &end);
    if (sc != SCAN_OK)
        return sc;
    json_t *j = load(d->s + b, end - b);
    bool ok = add_call(d->r, d->s + p, args - p, j);
    json_decref(j);
    *next = end;
    return ok ? SCAN_OK : SCAN_BAD;
}

/* LLAMA3: <|python_tag|> or a leading '{', then JSON calls separated by ';'. */
static enum scan read_llama3(struct reader *d, size_t pos, size_t *next)
{
    size_t p = pos;
    if (at(d->s, d->len, p, "<|python_tag|>"))
        p += strlen("<|python_tag|>");
    for (;;) {
        size_t end;
        enum scan sc = read_json_calls(d, skip_ws(d->s, d->len, p), &end);
        if (sc != SCAN_OK)
            return sc;
        p = skip_ws(d->s, d->len, end);
        if (p < d->len && d->s[p] == ';') {
            p++;
            continue;
        }
        if (p == d->len && !d->final)
            return SCAN_MORE; /* a ';' and another call may still come */
        *next = p;
        return SCAN_OK;
    }
}

/* One DeepSeek call from <｜tool▁call▁begin｜> to <｜tool▁call▁end｜>. */
static enum scan read_ds_call(struct reader *d, size_t p, size_t *next)
{
    const char *s = d->s;
    size_t end = index_of(s, d->len, p, KVR_TOOLCALL_DS_CALL_END);
    if (end == d->len)
        return SCAN_MORE;
    size_t b = p + strlen(KVR_TOOLCALL_DS_CALL_BEGIN),
           sep = index_of(s, end, b, KVR_TOOLCALL_DS_SEP);
    if (sep == end)
        return SCAN_BAD;
    size_t nb = sep + strlen(KVR_TOOLCALL_DS_SEP), ne, ab, ae = end;
    if (sep - b == 8 && !memcmp(s + b, "function", 8)) {
        ne = index_of(s, end, nb, "\n");
        ab = ne;
        if (at(s, end, ab, "\n```json"))
            ab += strlen("\n```json");
        while (ae > ab && (s[ae - 1] == '\n' || s[ae - 1] == '`'))
            ae--;
    } else {
        ne = sep;
        nb = b;
        ab = sep + strlen(KVR_TOOLCALL_DS_SEP);
    }
    json_t *j = load(s + ab, ae - ab);
    bool ok = add_call(d->r, s + nb, ne - nb, j);
    json_decref(j);
    *next = end + strlen(KVR_TOOLCALL_DS_CALL_END);
    return ok ? SCAN_OK : SCAN_BAD;
}

static enum scan read_deepseek(struct reader *d, size_t pos, size_t *next)
{
    size_t p = skip_ws(d->s, d->len, pos + strlen(KVR_TOOLCALL_DS_CALLS_BEGIN));
    bool any = false;
    while (at(d->s, d->len, p, KVR_TOOLCALL_DS_CALL_BEGIN)) {
        enum scan sc = read_ds_call(d, p, &p);
        if (sc != SCAN_OK)
            return sc;
        any = true;
        p = skip_ws(d->s, d->len, p);
    }
    if (at(d->s, d->len, p, KVR_TOOLCALL_DS_CALLS_END)) {
        *next = p + strlen(KVR_TOOLCALL_DS_CALLS_END);
        return any ? SCAN_OK : SCAN_BAD;
    }
    size_t rest = d->len - p;
    bool partial = kvr_toolcall_partial(d->s + p, rest, KVR_TOOLCALL_DS_CALLS_END) == rest ||
                   kvr_toolcall_partial(d->s + p, rest, KVR_TOOLCALL_DS_CALL_BEGIN) == rest;
    if (p >= d->len || partial) {
        *next = d->len;
        return d->final && any ? SCAN_OK : d->final ? SCAN_BAD : SCAN_MORE;
    }
    return SCAN_BAD;
}

/* GENERIC: the whole answer is one JSON object naming calls. */
static enum scan read_generic(struct reader *d, size_t pos, size_t *next)
{
    size_t end;
    enum scan sc = json_end(d->s, d->len, pos, &end);
    if (sc != SCAN_OK)
        return sc;
    if (skip_ws(d->s, d->len, end) != d->len)
        return SCAN_BAD;
    if (!d->final)
        return SCAN_MORE; /* the whole answer: text may still follow the object */
    json_t *j = load(d->s + pos, end - pos);
    const json_t *many = json_object_get(j, "tool_calls"), *one = json_object_get(j, "tool_call");
    bool ok = j != NULL;
    if (json_is_array(many)) {
        size_t i;
        json_t *x;
        ok = json_array_size(many) > 0;
        json_array_foreach(many, i, x)
        {
            const json_t *f = json_object_get(x, "function");
            ok = ok && add_json_call(d->r, f ? f : x);
        }
    } else {
        ok = ok && add_json_call(d->r, one ? one : j);
    }
    json_decref(j);
    *next = d->len;
    return ok ? SCAN_OK : SCAN_BAD;
}

/* HARMONY: a run of messages. Channel "analysis" is reasoning, a recipient
 * "functions.NAME" a call whose body is its arguments, anything else text. A message with
 * no end yet is shown as far as it can be (bodies of text and reasoning grow in place). */
static const char *const harmony_ends[] = {"<|end|>", "<|call|>", "<|return|>", NULL};

static size_t harmony_end(const char *s, size_t len, size_t b, size_t *mark_len)
{
    size_t best = len;
    *mark_len = 0;
    for (size_t i = 0; harmony_ends[i]; i++) {
        size_t e = index_of(s, len, b, harmony_ends[i]);
        if (e < best) {
            best = e;
            *mark_len = strlen(harmony_ends[i]);
        }
    }
    return best;
}

static size_t harmony_held(const char *s, size_t len)
{
    size_t h = 0;
    for (size_t i = 0; harmony_ends[i]; i++) {
        size_t k = kvr_toolcall_partial(s, len, harmony_ends[i]);
        h = k > h ? k : h;
    }
    return h;
}

/* The header's channel and recipient ("to=functions.f": f). */
static void harmony_header(const char *s, size_t b, size_t e, const char **ch, size_t *ch_len,
                           const char **fn, size_t *fn_len)
{
    *ch = NULL, *ch_len = 0, *fn = NULL, *fn_len = 0;
    size_t c = index_of(s, e, b, "<|channel|>");
    if (c < e) {
        size_t q = c + strlen("<|channel|>"), r = q;
        while (r < e && s[r] != ' ' && s[r] != '<')
            r++;
        *ch = s + q, *ch_len = r - q;
    }
    size_t t = index_of(s, e, b, "to=functions.");
    if (t < e) {
        size_t q = t + strlen("to=functions."), r = q;
        while (r < e && s[r] != ' ' && s[r] != '<')
            r++;
        *fn = s + q, *fn_len = r - q;
    }
}

static void harmony(struct reader *d)
{
    const char *s = d->s;
    size_t len = d->len, p = 0;
    struct kvr_toolcall_result *r = d->r;
    /* " to=" when the answer goes on the prompt's "<|start|>assistant" header. */
    bool opens =
        at(s, len, 0, "<|channel|>") || at(s, len, 0, "<|start|>") || at(s, len, 0, " to=");
    bool maybe = kvr_toolcall_partial(s, len, "<|channel|>") == len ||
                 kvr_toolcall_partial(s, len, "<|start|>") == len ||
                 kvr_toolcall_partial(s, len, " to=") == len;
    if (!opens) {
        if (!maybe || d->final)
            kvr_sbuf_append(&r->content, s, len);
        return;
    }
    while (p < len) {
        if (at(s, len, p, "<|start|>"))
            p += strlen("<|start|>");
        size_t m = index_of(s, len, p, "<|message|>");
        if (m == len) {
            if (d->final)
                kvr_sbuf_append(&r->content, s + p, len - p);
            return;
        }
        const char *ch, *fn;
        size_t ch_len, fn_len, mark;
        harmony_header(s, p, m, &ch, &ch_len, &fn, &fn_len);
        size_t b = m + strlen("<|message|>"), e = harmony_end(s, len, b, &mark);
        bool closed = e < len || d->final;
        if (fn && d->o->calls) {
            if (!closed)
                return;
            json_t *j = load(s + b, e - b);
            if (!json_is_object(j) || !add_call(r, fn, fn_len, j)) {
                if (!j)
                    r->unfinished = e == len;
                kvr_sbuf_append(&r->content, s + b, e - b);
            }
            json_decref(j);
        } else {
            bool analysis = ch && ch_len == 8 && !memcmp(ch, "analysis", 8);
            size_t shown = closed ? e : len - harmony_held(s + b, len - b);
            kvr_sbuf_append(analysis ? &r->reasoning : &r->content, s + b, shown - b);
            if (!closed) {
                r->tail = shown < len ? KVR_TOOLCALL_TAIL_OTHER
                          : analysis  ? KVR_TOOLCALL_TAIL_REASONING
                                      : KVR_TOOLCALL_TAIL_CONTENT;
                return;
            }
        }
        p = e + mark;
    }
}

/* ---- the driver ------------------------------------------------------------------------ */

typedef enum scan (*read_fn)(struct reader *d, size_t pos, size_t *next);

struct family_rule {
    const char *trigger; /* NULL: only a leading JSON object */
    read_fn read;
    bool leading_json; /* an answer that starts with '{' may be a call */
};

static const struct family_rule rules[KVR_TOOLCALL_FAMILY_COUNT] = {
    [KVR_TOOLCALL_GENERIC] = {NULL, read_generic, true},
    [KVR_TOOLCALL_LLAMA3] = {"<|python_tag|>", read_llama3, true},
    [KVR_TOOLCALL_HERMES] = {"<tool_call>", read_hermes, false},
    [KVR_TOOLCALL_MISTRAL] = {"[TOOL_CALLS]", read_mistral, false},
    [KVR_TOOLCALL_QWEN3_CODER] = {"<tool_call>", read_xml, false},
    [KVR_TOOLCALL_GLM45] = {"<tool_call>", read_xml, false},
    [KVR_TOOLCALL_HARMONY] = {NULL, NULL, false},
    [KVR_TOOLCALL_DEEPSEEK_V3] = {KVR_TOOLCALL_DS_CALLS_BEGIN, read_deepseek, false},
};

/* A call the reader could not finish: held, or (final) text and unfinished. */
static void open_call(struct reader *d, size_t from)
{
    if (!d->final)
        return;
    kvr_sbuf_append(&d->r->content, d->s + from, d->len - from);
    d->r->unfinished = true;
}

static void body(struct reader *d, size_t p)
{
    const struct family_rule *fr = &rules[d->o->family];
    const char *s = d->s;
    size_t len = d->len, next;
    if (!d->o->calls) {
        kvr_sbuf_append(&d->r->content, s + p, len - p);
        d->r->tail = d->r->content.len ? KVR_TOOLCALL_TAIL_CONTENT : d->r->tail;
        return;
    }
    size_t q = skip_ws(s, len, p);
    if (fr->leading_json && q == len && !d->final)
        return;
    if (fr->leading_json && q < len && s[q] == '{') {
        enum scan sc = (fr->trigger ? read_llama3 : read_generic)(d, q, &next);
        if (sc != SCAN_OK)
            clear_calls(d->r); /* a run of calls counts once all of it is decided */
        if (sc == SCAN_MORE) {
            open_call(d, p);
            return;
        }
        if (sc == SCAN_OK)
            p = next;
    }
    while (fr->trigger) {
        size_t k = index_of(s, len, p, fr->trigger);
        if (k == len) {
            size_t held = d->final ? 0 : kvr_toolcall_partial(s + p, len - p, fr->trigger);
            kvr_sbuf_append(&d->r->content, s + p, len - p - held);
            if (!held && d->r->content.len)
                d->r->tail = KVR_TOOLCALL_TAIL_CONTENT;
            return;
        }
        kvr_sbuf_append(&d->r->content, s + p, k - p);
        uint32_t n0 = d->r->n_calls;
        enum scan sc = fr->read(d, k, &next);
        while (sc != SCAN_OK && d->r->n_calls > n0) {
            d->r->n_calls--;
            kvr_free(d->r->calls[d->r->n_calls].name);
            kvr_free(d->r->calls[d->r->n_calls].arguments);
        }
        if (sc == SCAN_MORE) {
            open_call(d, k);
            return;
        }
        if (sc == SCAN_BAD) {
            next = k + strlen(fr->trigger);
            kvr_sbuf_append(&d->r->content, s + k, next - k);
        }
        p = next;
    }
    kvr_sbuf_append(&d->r->content, s + p, len - p);
    d->r->tail = d->r->content.len ? KVR_TOOLCALL_TAIL_CONTENT : d->r->tail;
}

/* A leading <think>...</think> (or the rest of one the prompt opened) into reasoning;
 * returns where the answer proper starts, or len when it is all reasoning so far. */
static size_t think(struct reader *d)
{
    const char *s = d->s;
    size_t len = d->len, q = skip_ws(s, len, 0), b = 0;
    bool open = d->o->in_think;
    if (!open && at(s, len, q, "<think>")) {
        open = true;
        b = q + strlen("<think>");
    } else if (!open && !d->final && kvr_toolcall_partial(s + q, len - q, "<think>") == len - q) {
        return len; /* only blanks, or the start of "<think>": it may still come */
    }
    if (!open)
        return 0;
    size_t e = index_of(s, len, b, "</think>");
    if (e == len) {
        size_t held = d->final ? 0 : kvr_toolcall_partial(s + b, len - b, "</think>");
        kvr_sbuf_append(&d->r->reasoning, s + b, len - b - held);
        d->r->tail = held ? KVR_TOOLCALL_TAIL_OTHER : KVR_TOOLCALL_TAIL_REASONING;
        return len;
    }
    kvr_sbuf_append(&d->r->reasoning, s + b, e - b);
    return skip_ws(s, len, e + strlen("</think>"));
}

int kvr_toolcall_parse(const struct kvr_toolcall_opts *o, const char *text, size_t len, bool final,
                       struct kvr_toolcall_result *r)
{
    clear_calls(r);
    kvr_sbuf_clear(&r->content);
    kvr_sbuf_clear(&r->reasoning);
    r->unfinished = false;
    r->tail = KVR_TOOLCALL_TAIL_OTHER;
    struct reader d = {o, text ? text : "", len, final, r};
    if ((unsigned)o->family >= KVR_TOOLCALL_FAMILY_COUNT)
        return KVR_EINVAL;
    if (o->family == KVR_TOOLCALL_HARMONY) {
        harmony(&d);
    } else {
        body(&d, o->think || o->in_think ? think(&d) : 0);
    }
    return r->content.failed || r->reasoning.failed ? KVR_ENOMEM : KVR_OK;
}

bool kvr_toolcall_plain(const struct kvr_toolcall_opts *o, enum kvr_toolcall_tail tail,
                        const char *p, size_t n)
{
    if (tail == KVR_TOOLCALL_TAIL_OTHER || (unsigned)o->family >= KVR_TOOLCALL_FAMILY_COUNT)
        return false;
    /* Reasoning ends at "</think>" or a harmony marker; text at the family's trigger (a
     * leading '{' was decided when the text began). */
    const char *trigger = rules[o->family].trigger;
    char stop = '<';
    if (tail == KVR_TOOLCALL_TAIL_CONTENT && o->family != KVR_TOOLCALL_HARMONY)
        stop = o->calls && trigger ? trigger[0] : 0;
    return !stop || !memchr(p, stop, n);
}
