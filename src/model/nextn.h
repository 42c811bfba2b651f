/* nextn.h - the NextN (multi-token prediction) blocks some files end with (glm4moe's
 * ARCH.nextn_predict_layers): checked as llama.cpp checks them, never run (DESIGN.md 7).
 *
 * A NextN block blk.N (N >= the layers that run, hparams.n_layer) holds a whole layer's
 * tensors (the engine views them with the layer rules, then drops the views) and these,
 * GGUF shapes {ne0, ne1}:
 *
 * | tensor                            | shape              | required |
 * |-----------------------------------|--------------------|----------|
 * | nextn.eh_proj.weight              | [2 n_embd, n_embd] | yes      |
 * | nextn.enorm.weight                | [n_embd] f32       | yes      |
 * | nextn.hnorm.weight                | [n_embd] f32       | yes      |
 * | nextn.embed_tokens.weight         | [n_embd, n_vocab]  | no       |
 * | nextn.shared_head_head.weight     | [n_embd, n_vocab]  | no       |
 * | nextn.shared_head_norm.weight     | [n_embd] f32       | no       |
 *
 * Nothing is read from their data, so their pages are never touched, and the plan
 * (ring/propose.c) counts only the layers that run. Pure: no allocation, no I/O. */
#ifndef KVR_MODEL_NEXTN_H
#define KVR_MODEL_NEXTN_H

#include "core/err.h"
#include "model/arch.h"
#include "model/gguf.h"

#include <stdint.h>

/* Check block il's nextn.* tensors (the table above) with a message naming the bad one. */
int kvr_nextn_check(const struct kvr_gguf *g, const struct kvr_hparams *hp, uint32_t il,
                    struct kvr_err *err);

/* Tensors and their GGUF shapes, for synthesis (model/synth.c): entry i of n, NULL past the
 * end. ne1 = 0 for a vector. */
const char *kvr_nextn_tensor(const struct kvr_hparams *hp, int i, int64_t *ne0, int64_t *ne1);

#endif
