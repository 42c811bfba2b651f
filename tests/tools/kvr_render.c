/* kvr_render.c - render one Jinja template over many variable sets, for
 * tests/integration/chat_template_jinja2.sh (which renders the same with jinja2).
 *
 *   kvr_render TEMPLATE_FILE CASES_JSON
 *
 * CASES_JSON is a JSON array of objects (the variables of each render). The output, on
 * stdout, is a JSON array with one entry per case: {"ok": true, "text": "..."} or
 * {"ok": false, "error": "...", "status": "..."}. strftime_now formats the fixed time
 * 2024-07-26 12:00:00 so that both renderers agree. Exit status 0 unless the files
 * cannot be read or the template does not parse (then 2, with the message on stderr). */
#include "jinja/jinja.h"
#include "core/alloc.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    *len = n;
    return buf;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: kvr_jinja TEMPLATE_FILE CASES_JSON\n");
        return 2;
    }
    size_t len;
    char *src = slurp(argv[1], &len);
    if (!src) {
        fprintf(stderr, "kvr_jinja: cannot read %s\n", argv[1]);
        return 2;
    }
    json_error_t jerr;
    json_t *cases = json_load_file(argv[2], 0, &jerr);
    if (!cases || !json_is_array(cases)) {
        fprintf(stderr, "kvr_jinja: %s: %s\n", argv[2], cases ? "not an array" : jerr.text);
        return 2;
    }
    struct kvr_err err = {0};
    struct kvr_jinja *t;
    json_t *results = json_array();
    if (kvr_jinja_parse(&t, src, len, NULL, &err) != 0) {
        /* jinja2 refuses such a template when it compiles it: every case is an error. */
        for (size_t i = 0; i < json_array_size(cases); i++)
            json_array_append_new(results, json_pack("{s:b,s:s,s:s}", "ok", 0, "error", err.msg,
                                                     "status", kvr_strerror(err.code)));
        t = NULL;
    }
    struct tm now = {
        .tm_year = 124, .tm_mon = 6, .tm_mday = 26, .tm_hour = 12, .tm_wday = 5, .tm_yday = 207};
    for (size_t i = 0; t && i < json_array_size(cases); i++) {
        char *out;
        size_t out_len;
        int rc = kvr_jinja_render(t, json_array_get(cases, i), &now, &out, &out_len, &err);
        if (rc == 0) {
            json_array_append_new(results, json_pack("{s:b,s:s%}", "ok", 1, "text", out, out_len));
            kvr_free(out);
        } else {
            json_array_append_new(results, json_pack("{s:b,s:s,s:s}", "ok", 0, "error", err.msg,
                                                     "status", kvr_strerror(rc)));
        }
    }
    char *dump = json_dumps(results, JSON_ENSURE_ASCII);
    puts(dump);
    free(dump);
    json_decref(results);
    json_decref(cases);
    kvr_jinja_destroy(t);
    free(src);
    return 0;
}
