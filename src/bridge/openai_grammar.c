/* openai_grammar.c - the request fields that constrain the output (see openai.h):
 * OpenAI's response_format ({"type": "text" | "json_object" | "json_schema"}) and
 * llama.cpp's "grammar" (GBNF) and "json_schema" (a schema), all turned into one GBNF text
 * that is compiled here once, so a bad grammar or schema is a 400 before anything is
 * queued, and the tail receives only text that compiles. */
#include "bridge/openai.h"

#include "bridge/json_schema.h"
#include "core/alloc.h"
#include "model/grammar.h"

#include <string.h>

static int bad(struct kvr_openai_error *e, const char *param, const char *msg)
{
    return kvr_openai_error_set(e, 400, "invalid_request_error", param, "invalid_value", "%s", msg);
}

/* The schema of a response_format: {"type": "json_schema", "json_schema": {"name",
 * "schema", "strict", "description"}}, or llama.cpp's {"type": "json_object", "schema"}. */
static int response_format(const json_t *rf, const json_t **schema, bool *any_object,
                           struct kvr_openai_error *e)
{
    static const char *const rf_keys[] = {"type", "json_schema", "schema", NULL};
    static const char *const js_keys[] = {"name", "schema", "strict", "description", NULL};
    if (!json_is_object(rf))
        return bad(e, "response_format", "'response_format' must be an object");
    int rc = kvr_openai_check_keys(rf, "response_format", rf_keys, e);
    if (rc)
        return rc;
    const json_t *t = json_object_get(rf, "type");
    const char *type = json_is_string(t) ? json_string_value(t) : "";
    if (!strcmp(type, "text"))
        return KVR_OK;
    if (!strcmp(type, "json_object")) {
        *schema = json_object_get(rf, "schema");
        *any_object = !*schema;
        return KVR_OK;
    }
    if (strcmp(type, "json_schema"))
        return bad(e, "response_format.type",
                   "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"");
    const json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js))
        return bad(e, "response_format.json_schema",
                   "'response_format.json_schema' must be an object with a 'schema'");
    if ((rc = kvr_openai_check_keys(js, "response_format.json_schema", js_keys, e)))
        return rc;
    const json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict");
    if (name && !json_is_string(name))
        return bad(e, "response_format.json_schema.name", "'name' must be a string");
    if (strict && !json_is_boolean(strict))
        return bad(e, "response_format.json_schema.strict", "'strict' must be a boolean");
    *schema = json_object_get(js, "schema");
    *any_object = !*schema; /* OpenAI: no schema means any JSON object */
    return KVR_OK;
}

/* Keep `text` as the request's grammar if it compiles. */
static int take_grammar(struct kvr_openai_req *r, char *text, size_t len, const char *param,
                        struct kvr_openai_error *e)
{
    struct kvr_grammar *g = NULL;
    struct kvr_err err = {0};
    if (kvr_grammar_compile(&g, text, len, &err)) {
        kvr_free(text);
        if (err.code == KVR_ENOMEM)
            return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return bad(e, param, err.msg);
    }
    kvr_grammar_destroy(g);
    r->grammar = text;
    r->grammar_len = len;
    return KVR_OK;
}

int kvr_openai_parse_grammar(struct kvr_openai_req *r, struct kvr_openai_error *e)
{
    const json_t *rf = json_object_get(r->root, "response_format");
    const json_t *gr = json_object_get(r->root, "grammar");
    const json_t *js = json_object_get(r->root, "json_schema");
    rf = json_is_null(rf) ? NULL : rf;
    gr = json_is_null(gr) ? NULL : gr;
    js = json_is_null(js) ? NULL : js;
    const json_t *schema = js;
    bool any_object = false;
    int rc;
    if ((!!rf + !!gr + !!js) > 1)
        return bad(e, gr ? "grammar" : "json_schema",
                   "give at most one of 'response_format', 'grammar' and 'json_schema'");
    if (rf && (rc = response_format(rf, &schema, &any_object, e)))
        return rc;
    const char *param = rf ? "response_format.json_schema.schema" : "json_schema";
    if (gr) {
        if (!json_is_string(gr))
            return bad(e, "grammar", "'grammar' must be a string of GBNF");
        size_t n = json_string_length(gr);
        char *text = kvr_malloc(n ? n : 1);
        if (!text)
            return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        memcpy(text, json_string_value(gr), n);
        return take_grammar(r, text, n, "grammar", e);
    }
    if (!schema && !any_object)
        return KVR_OK;
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    struct kvr_err err = {0};
    if (any_object) {
        kvr_json_object_gbnf(&out);
    } else if ((rc = kvr_json_schema_gbnf(schema, &out, &err))) {
        kvr_sbuf_fini(&out);
        if (rc == KVR_ENOMEM)
            return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
        return kvr_openai_error_set(e, 400, "invalid_request_error", param,
                                    rc == KVR_ENOTSUP ? "unsupported_schema" : "invalid_schema",
                                    "%s: %s", param, err.msg);
    }
    size_t len;
    char *text = kvr_sbuf_take(&out, &len);
    if (!text)
        return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return take_grammar(r, text, len, param, e);
}
