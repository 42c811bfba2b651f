/* tiny_model.c - see tiny_model.h. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tiny_model.h"

#include "core/err.h"
#include "model/synth.h"

#include <stdio.h>

void kvr_test_tiny_model(const char *name, uint64_t seed, char **buf, size_t *len,
                         struct kvr_gguf **g, struct kvr_hparams *hp)
{
    kvr_test_tiny_model_layers(name, seed, 2, buf, len, g, hp);
}

void kvr_test_tiny_model_layers(const char *name, uint64_t seed, uint32_t n_layers, char **buf,
                                size_t *len, struct kvr_gguf **g, struct kvr_hparams *hp)
{
    struct kvr_synth_opts o = {
        .arch = kvr_arch_find("llama", 5), .type = KVR_DTYPE_F32, .seed = seed, .n_threads = 1};
    o.shape = (struct kvr_synth_shape){.n_layers = n_layers,
                                       .dim = 64,
                                       .ff = 96,
                                       .n_heads = 4,
                                       .n_kv_heads = 2,
                                       .vocab_size = 300,
                                       .ctx = 64,
                                       .rope_base = 10000.0f,
                                       .rms_eps = 1e-5f};
    snprintf(o.shape.name, sizeof o.shape.name, "%s", name);
    assert_non_null(o.arch);
    FILE *f = open_memstream(buf, len);
    assert_non_null(f);
    struct kvr_err err = {0};
    if (kvr_synth_write(&o, f, NULL, &err))
        fail_msg("synth: %s", err.msg);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(kvr_gguf_open_mem(g, *buf, *len, &err), 0);
    if (kvr_hparams_read(hp, *g, &err))
        fail_msg("hparams: %s", err.msg);
}
