/* fuzz_jinja.c - libFuzzer target for the Jinja interpreter.
 *
 * Input: a template, optionally followed by a NUL byte and a JSON object of variables (a
 * fixed chat conversation when absent or not an object). The template is parsed and
 * rendered twice under small limits. Invariants checked (a violation traps): parse and
 * render end with 0 or one of the documented statuses and a message; a render never
 * exceeds the output limit, its length matches the string, and rendering again gives the
 * same bytes or the same error. ASan/UBSan catch the rest. */
#include "jinja/jinja.h"
#include "core/alloc.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "fuzz_jinja: %s failed at line %d\n", #c, __LINE__);                   \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

static const char default_vars[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
    "{\"role\": \"user\", \"content\": \" Hi \\u00e9\\n\"}, "
    "{\"role\": \"assistant\", \"content\": \"<think>x</think>Hello\"}, "
    "{\"role\": \"user\", \"content\": \"\"}], \"add_generation_prompt\": true, "
    "\"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"tools\": null, \"n\": 3, "
    "\"f\": 2.5, \"d\": {\"k\": [1, 2, {\"x\": null}]}}";

static bool known_status(int rc)
{
    return rc == KVR_EFORMAT || rc == KVR_EINVAL || rc == KVR_ERANGE || rc == KVR_ENOMEM ||
           rc == KVR_ENOTSUP;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *src = (const char *)data;
    const uint8_t *nul = memchr(data, 0, size);
    size_t tlen = nul ? (size_t)(nul - data) : size;
    json_t *vars = NULL;
    if (nul)
        vars = json_loadb((const char *)nul + 1, size - tlen - 1, 0, NULL);
    if (!json_is_object(vars)) {
        json_decref(vars);
        vars = json_loads(default_vars, 0, NULL);
        CHECK(vars != NULL);
    }
    struct kvr_jinja_limits lim;
    kvr_jinja_limits_default(&lim);
    lim.max_template_bytes = 64 << 10;
    lim.max_nodes = 20000;
    lim.max_depth = 40;
    lim.max_steps = 200000;
    lim.max_output_bytes = 64 << 10;
    lim.max_memory_bytes = 8 << 20;

    struct kvr_jinja *t = NULL;
    struct kvr_err err = {0};
    int rc = kvr_jinja_parse(&t, src, tlen, &lim, &err);
    if (rc) {
        CHECK(known_status(rc));
        CHECK(t == NULL && err.msg[0]);
        json_decref(vars);
        return 0;
    }
    struct tm now = {.tm_year = 124, .tm_mon = 6, .tm_mday = 26};
    char *out[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    int rcs[2];
    char msg[KVR_ERR_MSG_BYTES];
    for (int k = 0; k < 2; k++) {
        struct kvr_err e = {0};
        rcs[k] = kvr_jinja_render(t, vars, &now, &out[k], &len[k], &e);
        if (rcs[k] == 0) {
            CHECK(out[k] != NULL && len[k] <= lim.max_output_bytes);
            CHECK(out[k][len[k]] == 0 && strlen(out[k]) <= len[k]);
        } else {
            CHECK(known_status(rcs[k]) && out[k] == NULL && e.msg[0]);
            if (k == 0)
                memcpy(msg, e.msg, sizeof msg);
            else
                CHECK(!strcmp(msg, e.msg));
        }
    }
    CHECK(rcs[0] == rcs[1]);
    if (rcs[0] == 0)
        CHECK(len[0] == len[1] && !memcmp(out[0], out[1], len[0]));
    kvr_free(out[0]);
    kvr_free(out[1]);
    kvr_jinja_destroy(t);
    json_decref(vars);
    return 0;
}
