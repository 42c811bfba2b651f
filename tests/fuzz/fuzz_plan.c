/* fuzz_plan.c - libFuzzer target for the plan parser and validator (src/ring/plan.c).
 *
 * Input: JSON text. Whatever the bytes, parsing and validation never crash. A plan that
 * parses is written back as JSON, and that text must parse to a plan with the same hash
 * and serialize to the same text (writing is a faithful, stable inverse of parsing). A plan
 * that validates must also give wire limits for every receiver without overflow, and small
 * ones are run through the planner.
 *
 * Seeds: tests/fuzz/corpus/fuzz_plan/, written by test_plan (KVR_WRITE_CORPUS=dir). */
#include "core/alloc.h"
#include "ring/plan.h"
#include "ring/wire.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct kvr_plan p, q;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (kvr_plan_parse(&p, (const char *)data, size, NULL, NULL))
        return 0;
    uint32_t n_layer = p.n_stages ? p.stages[p.n_stages - 1].last_layer + 1 : 0;
    kvr_plan_validate(&p, 0, NULL);
    int valid = kvr_plan_validate(&p, n_layer, NULL) == 0;

    uint8_t h1[KVR_PLAN_HASH_BYTES], h2[KVR_PLAN_HASH_BYTES];
    kvr_plan_hash(&p, h1);
    char *t1 = NULL, *t2 = NULL;
    if (kvr_plan_to_json(&p, &t1, NULL))
        abort();
    if (kvr_plan_parse(&q, t1, strlen(t1), NULL, NULL))
        abort();
    kvr_plan_hash(&q, h2);
    if (memcmp(h1, h2, sizeof h1) != 0)
        abort();
    if (kvr_plan_to_json(&q, &t2, NULL) || strcmp(t1, t2) != 0)
        abort();
    kvr_free(t1);
    kvr_free(t2);

    if (valid) {
        for (int r = KVR_WIRE_RECV_ANY; r < (int)p.n_stages; r++) {
            struct kvr_wire_limits lim;
            if (kvr_wire_limits_init(&lim, &p, 64, 1000, r, NULL) == 0 &&
                lim.max_frame_bytes < KVR_WIRE_HEADER_BYTES)
                abort();
        }
        if (n_layer <= 64) {
            struct kvr_balance_input in = {.n_layer = n_layer, .n_stages = p.n_stages};
            struct kvr_balance_result res;
            if (n_layer >= p.n_stages && kvr_plan_balance(&in, &res, NULL))
                abort();
        }
    }
    return 0;
}
