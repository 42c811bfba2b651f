/* tiny_model.h - a tiny llama network synthesised in memory (2 layers, dim 64, 4 heads of
 * which 2 KV, vocabulary 300, context 64, F32 weights) for unit tests that need a real
 * forward pass but no file. The GGUF image is writable, so a test may poison a tensor.
 * Fails the running cmocka test on any error. */
#ifndef KVR_TESTS_TINY_MODEL_H
#define KVR_TESTS_TINY_MODEL_H

#include "model/arch.h"
#include "model/gguf.h"

#include <stddef.h>
#include <stdint.h>

/* *buf (free it after kvr_gguf_close) holds *len bytes of GGUF, *g reads it, *hp is filled. */
void kvr_test_tiny_model(const char *name, uint64_t seed, char **buf, size_t *len,
                         struct kvr_gguf **g, struct kvr_hparams *hp);
/* The same with n_layers layers (a ring of up to n_layers stages). */
void kvr_test_tiny_model_layers(const char *name, uint64_t seed, uint32_t n_layers, char **buf,
                                size_t *len, struct kvr_gguf **g, struct kvr_hparams *hp);

#endif
