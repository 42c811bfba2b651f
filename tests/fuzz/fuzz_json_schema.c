/* fuzz_json_schema.c - libFuzzer target for JSON Schema to GBNF.
 *
 * Input: a JSON document used as a schema. Invariants checked (a violation traps): the
 * compiler fails with a message, or its grammar compiles, unless the only fault is one the
 * grammar compiler finds itself (a pattern whose repeated group can match the empty text is
 * left recursion) or a size limit. */
#include "bridge/json_schema.h"
#include "core/alloc.h"
#include "model/grammar.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "fuzz_json_schema: %s failed at line %d\n", #c, __LINE__);             \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    json_t *schema = json_loadb((const char *)data, size, JSON_DECODE_ANY, NULL);
    if (!schema)
        return 0;
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    struct kvr_err err = {0};
    int rc = kvr_json_schema_gbnf(schema, &out, &err);
    if (rc) {
        CHECK(err.msg[0] != 0);
    } else {
        struct kvr_grammar *g = NULL;
        int grc = kvr_grammar_compile(&g, out.data, out.len, &err);
        if (grc) {
            if (!(grc == KVR_ERANGE || grc == KVR_ENOMEM || strstr(err.msg, "left-recursive")))
                fprintf(stderr, "fuzz_json_schema: %s\n%s\n", err.msg, out.data);
            CHECK(grc == KVR_ERANGE || grc == KVR_ENOMEM || strstr(err.msg, "left-recursive"));
        }
        kvr_grammar_destroy(g);
    }
    kvr_sbuf_fini(&out);
    json_decref(schema);
    return 0;
}
