/* tools.c - the tool fields of a chat request (see tools.h). */
#include "bridge/tools.h"

#include "bridge/openai.h"
#include "core/err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static int bad(struct kvr_openai_error *e, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int bad(struct kvr_openai_error *e, const char *param, const char *fmt, ...)
{
    char msg[KVR_OPENAI_ERR_MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvr_openai_error_set(e, 400, "invalid_request_error", param, "invalid_value", "%s", msg);
}

/* Function names as OpenAI takes them: 1..64 of [A-Za-z0-9_-], and '.' for harmony's
 * namespaced names. */
static bool name_ok(const char *s, size_t n)
{
    if (n == 0 || n > KVR_TOOLS_MAX_NAME)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-' || c == '.'))
            return false;
    }
    return true;
}

static const char *const schema_types[] = {"object",  "array",   "string", "number",
                                           "integer", "boolean", "null",   NULL};

static bool type_known(const json_t *t)
{
    if (!json_is_string(t))
        return false;
    for (size_t i = 0; schema_types[i]; i++)
        if (!strcmp(json_string_value(t), schema_types[i]))
            return true;
    return false;
}

static int check_schema_at(const json_t *s, char *path, size_t cap, int depth,
                           struct kvr_openai_error *e);

/* Each value of an object of schemas (properties, $defs, definitions). */
static int check_schema_map(const json_t *m, const char *key, char *path, size_t cap, int depth,
                            struct kvr_openai_error *e)
{
    size_t at = strlen(path);
    snprintf(path + at, cap - at, ".%s", key);
    if (!json_is_object(m))
        return bad(e, path, "'%s' must be an object of schemas", path);
    const char *k;
    json_t *v;
    size_t at2 = strlen(path);
    json_object_foreach((json_t *)m, k, v)
    {
        snprintf(path + at2, cap - at2, ".%.24s", k);
        int rc = check_schema_at(v, path, cap, depth + 1, e);
        if (rc)
            return rc;
    }
    path[at] = 0;
    return KVR_OK;
}

static int check_schema_at(const json_t *s, char *path, size_t cap, int depth,
                           struct kvr_openai_error *e)
{
    if (json_is_boolean(s))
        return KVR_OK;
    if (!json_is_object(s))
        return bad(e, path, "'%s' must be a JSON schema (an object)", path);
    if (depth > KVR_TOOLS_MAX_SCHEMA_DEPTH)
        return bad(e, path, "'%s' nests deeper than the limit", path);
    const json_t *t = json_object_get(s, "type");
    if (json_is_array(t)) {
        size_t i;
        json_t *x;
        json_array_foreach(t, i, x) if (!type_known(x)) t = x;
    }
    if (t && !json_is_array(t) && !type_known(t))
        return bad(e, path,
                   "'%s.type' must be one of object, array, string, number, integer, "
                   "boolean, null",
                   path);
    const json_t *req = json_object_get(s, "required");
    if (req) {
        size_t i;
        json_t *x;
        bool ok = json_is_array(req);
        json_array_foreach(req, i, x) ok = ok && json_is_string(x);
        if (!ok)
            return bad(e, path, "'%s.required' must be an array of property names", path);
    }
    static const char *const maps[] = {"properties", "$defs", "definitions", NULL};
    for (size_t i = 0; maps[i]; i++) {
        const json_t *m = json_object_get(s, maps[i]);
        int rc = m ? check_schema_map(m, maps[i], path, cap, depth, e) : KVR_OK;
        if (rc)
            return rc;
    }
    static const char *const subs[] = {"items", "additionalProperties", "not", NULL};
    size_t at = strlen(path);
    for (size_t i = 0; subs[i]; i++) {
        const json_t *m = json_object_get(s, subs[i]);
        if (!m)
            continue;
        snprintf(path + at, cap - at, ".%s", subs[i]);
        int rc = check_schema_at(m, path, cap, depth + 1, e);
        if (rc)
            return rc;
        path[at] = 0;
    }
    static const char *const lists[] = {"anyOf", "oneOf", "allOf", NULL};
    for (size_t i = 0; lists[i]; i++) {
        const json_t *m = json_object_get(s, lists[i]);
        if (!m)
            continue;
        snprintf(path + at, cap - at, ".%s", lists[i]);
        if (!json_is_array(m) || json_array_size(m) == 0)
            return bad(e, path, "'%s' must be a non-empty array of schemas", path);
        size_t j;
        json_t *x;
        json_array_foreach(m, j, x)
        {
            int rc = check_schema_at(x, path, cap, depth + 1, e);
            if (rc)
                return rc;
        }
        path[at] = 0;
    }
    return KVR_OK;
}

int kvr_tools_check_schema(const json_t *schema, const char *path, struct kvr_openai_error *e)
{
    char p[256];
    snprintf(p, sizeof p, "%s", path);
    return check_schema_at(schema, p, sizeof p, 0, e);
}

static int check_tool(const json_t *tool, size_t i, const char **name, struct kvr_openai_error *e)
{
    char param[64];
    snprintf(param, sizeof param, "tools[%zu]", i);
    const json_t *type = json_object_get(tool, "type");
    const json_t *fn = json_object_get(tool, "function");
    if (!json_is_object(tool) || !json_is_string(type) ||
        strcmp(json_string_value(type), "function") != 0 || !json_is_object(fn))
        return bad(e, param,
                   "'%s' must be {\"type\": \"function\", \"function\": {...}}; other tool types "
                   "are not supported",
                   param);
    static const char *const known[] = {"name", "description", "parameters", "strict", NULL};
    snprintf(param, sizeof param, "tools[%zu].function", i);
    int rc = kvr_openai_check_keys(fn, param, known, e);
    if (rc)
        return rc;
    const json_t *n = json_object_get(fn, "name");
    snprintf(param, sizeof param, "tools[%zu].function.name", i);
    if (!json_is_string(n) || !name_ok(json_string_value(n), json_string_length(n)))
        return bad(e, param, "'%s' must be 1 to 64 letters, digits, '_', '-' or '.'", param);
    *name = json_string_value(n);
    const json_t *d = json_object_get(fn, "description");
    if (d && !json_is_string(d) && !json_is_null(d))
        return bad(e, param, "'tools[].function.description' must be a string");
    const json_t *p = json_object_get(fn, "parameters");
    snprintf(param, sizeof param, "tools[%zu].function.parameters", i);
    if (p && !json_is_null(p)) {
        if (!json_is_object(p))
            return bad(e, param, "'%s' must be a JSON schema object", param);
        if ((rc = kvr_tools_check_schema(p, param, e)))
            return rc;
    }
    return KVR_OK;
}

static int parse_choice(const json_t *root, struct kvr_tools *t, struct kvr_openai_error *e)
{
    const json_t *c = json_object_get(root, "tool_choice");
    t->choice = t->n ? KVR_TOOL_CHOICE_AUTO : KVR_TOOL_CHOICE_NONE;
    if (!c || json_is_null(c))
        return KVR_OK;
    if (json_is_string(c)) {
        const char *s = json_string_value(c);
        if (!strcmp(s, "none"))
            t->choice = KVR_TOOL_CHOICE_NONE;
        else if (!strcmp(s, "auto"))
            ;
        else if (!strcmp(s, "required"))
            t->choice = KVR_TOOL_CHOICE_REQUIRED;
        else
            return bad(e, "tool_choice",
                       "'tool_choice' must be \"none\", \"auto\", \"required\" or a named "
                       "function, got '%.32s'",
                       s);
    } else {
        const json_t *type = json_object_get(c, "type");
        const json_t *fn = json_object_get(c, "function");
        const json_t *n = json_object_get(fn, "name");
        if (!json_is_object(c) || !json_is_string(type) ||
            strcmp(json_string_value(type), "function") != 0 || !json_is_string(n))
            return bad(e, "tool_choice",
                       "'tool_choice' as an object must be {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}");
        t->choice = KVR_TOOL_CHOICE_NAMED;
        t->named = json_string_value(n);
    }
    if (t->choice != KVR_TOOL_CHOICE_NONE && !t->n)
        return bad(e, "tool_choice", "'tool_choice' %s needs 'tools'",
                   t->choice == KVR_TOOL_CHOICE_NAMED ? "naming a function" : "other than none");
    if (t->choice == KVR_TOOL_CHOICE_NAMED) {
        size_t i;
        json_t *tool;
        json_array_foreach(t->list, i, tool)
        {
            const char *nm =
                json_string_value(json_object_get(json_object_get(tool, "function"), "name"));
            if (nm && !strcmp(nm, t->named))
                return KVR_OK;
        }
        return bad(e, "tool_choice", "'tool_choice' names '%.64s', which is not in 'tools'",
                   t->named);
    }
    return KVR_OK;
}

int kvr_tools_parse(const json_t *root, struct kvr_tools *t, struct kvr_openai_error *e)
{
    memset(t, 0, sizeof *t);
    t->parallel = true;
    const json_t *list = json_object_get(root, "tools");
    if (list && !json_is_null(list)) {
        if (!json_is_array(list))
            return bad(e, "tools", "'tools' must be an array of function tools");
        if (json_array_size(list) > KVR_TOOLS_MAX)
            return bad(e, "tools", "'tools' holds more than %d tools", KVR_TOOLS_MAX);
        const char *names[KVR_TOOLS_MAX];
        size_t i;
        json_t *tool;
        json_array_foreach(list, i, tool)
        {
            int rc = check_tool(tool, i, &names[i], e);
            if (rc)
                return rc;
            for (size_t j = 0; j < i; j++)
                if (!strcmp(names[j], names[i]))
                    return bad(e, "tools", "'tools' names the function '%.64s' twice", names[i]);
        }
        t->n = json_array_size(list);
        t->list = t->n ? list : NULL;
    }
    const json_t *p = json_object_get(root, "parallel_tool_calls");
    if (p && !json_is_null(p)) {
        if (!json_is_boolean(p))
            return bad(e, "parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
        t->parallel = json_is_true(p);
    }
    return parse_choice(root, t, e);
}

const json_t *kvr_tools_params(const struct kvr_tools *t, const char *name)
{
    size_t i;
    json_t *tool;
    json_array_foreach(t->list, i, tool)
    {
        const json_t *fn = json_object_get(tool, "function");
        const char *nm = json_string_value(json_object_get(fn, "name"));
        if (nm && !strcmp(nm, name))
            return json_object_get(fn, "parameters");
    }
    return NULL;
}

static int check_call(const json_t *c, const char *base, size_t j, struct kvr_openai_error *e)
{
    char param[160];
    snprintf(param, sizeof param, "%.64s[%zu]", base, j);
    const json_t *fn = json_object_get(c, "function");
    const json_t *id = json_object_get(c, "id");
    const json_t *type = json_object_get(c, "type");
    if (!json_is_object(c) || !json_is_object(fn) || (id && !json_is_string(id)) ||
        (type && !(json_is_string(type) && !strcmp(json_string_value(type), "function"))))
        return bad(e, param,
                   "'%s' must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                   "\"arguments\"}}",
                   param);
    const json_t *n = json_object_get(fn, "name");
    const json_t *a = json_object_get(fn, "arguments");
    snprintf(param, sizeof param, "%.64s[%zu].function.name", base, j);
    if (!json_is_string(n) || !name_ok(json_string_value(n), json_string_length(n)))
        return bad(e, param, "'%s' must be a function name", param);
    snprintf(param, sizeof param, "%.64s[%zu].function.arguments", base, j);
    json_t *parsed =
        json_is_string(a) ? json_loadb(json_string_value(a), json_string_length(a), 0, NULL) : NULL;
    bool ok = json_is_object(parsed);
    json_decref(parsed);
    if (!ok)
        return bad(e, param, "'%s' must be a string holding a JSON object", param);
    return KVR_OK;
}

int kvr_tools_check_message(const json_t *msg, size_t i, const char *role,
                            struct kvr_openai_error *e)
{
    char param[64];
    const json_t *calls = json_object_get(msg, "tool_calls");
    const json_t *id = json_object_get(msg, "tool_call_id");
    bool assistant = !strcmp(role, "assistant"), tool = !strcmp(role, "tool");
    if (calls && !json_is_null(calls)) {
        snprintf(param, sizeof param, "messages[%zu].tool_calls", i);
        if (!assistant)
            return bad(e, param, "'%s' is only allowed on assistant messages", param);
        if (!json_is_array(calls) || json_array_size(calls) > KVR_TOOLS_MAX_CALLS)
            return bad(e, param, "'%s' must be an array of at most 64 tool calls", param);
        size_t j;
        json_t *c;
        json_array_foreach(calls, j, c)
        {
            int rc = check_call(c, param, j, e);
            if (rc)
                return rc;
        }
    }
    snprintf(param, sizeof param, "messages[%zu].tool_call_id", i);
    if (tool && (!json_is_string(id) || json_string_length(id) == 0))
        return bad(e, param, "'%s' is required on tool messages (the id of the call answered)",
                   param);
    if (!tool && id && !json_is_null(id))
        return bad(e, param, "'%s' is only allowed on tool messages", param);
    return KVR_OK;
}
