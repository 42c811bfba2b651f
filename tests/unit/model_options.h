/* model_options.h - the model layer's options from the environment, read as cli/main.c reads
 * them (KVR_ISA, KVR_PREFETCH, KVR_NO_PACK): the model reads no environment, and CTest runs
 * the kernel tests again with KVR_ISA=avx2. Call kvr_test_model_options first in main, and
 * again after changing one of the variables. */
#ifndef KVR_TEST_MODEL_OPTIONS_H
#define KVR_TEST_MODEL_OPTIONS_H

#include "model/engine.h"

#include <stdlib.h>
#include <string.h>

static inline void kvr_test_model_options(void)
{
    const char *no_pack = getenv("KVR_NO_PACK");
    struct kvr_model_options o = {
        .kernels = {.isa = getenv("KVR_ISA"), .prefetch = getenv("KVR_PREFETCH")},
        .no_pack = no_pack && !strcmp(no_pack, "1"),
    };
    kvr_model_configure(&o);
}

#endif
