/* moe_oai.c - the biases of gpt-oss's router and experts (moe.h: struct kvr_moe_layer's
 * router_b, gate_b, up_b, down_b). Where they are added is moe.c's: the router's to the
 * logits before the top-k, the gate and up ones before the activation, the down one before
 * the routing weight multiplies the expert's output (as llama.cpp adds them). */
#include "model/moe.h"

#include <stdio.h>

/* An f32 tensor of shape [n0] (n1 = 0) or [n0, n1], 4-byte aligned. */
static int view_bias(const struct kvr_gguf *g, const char *name, int64_t n0, int64_t n1,
                     const float **out, struct kvr_err *err)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
    if (!t)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing tensor %s", name);
    if (t->type != KVR_DTYPE_F32 || t->n_dims != (n1 ? 2u : 1u) || t->ne[0] != n0 ||
        (n1 && t->ne[1] != n1) || (uintptr_t)t->data % sizeof(float))
        return kvr_err_set(err, KVR_EFORMAT, "model: tensor %s must be f32 [%lld%s%lld]", name,
                           (long long)n0, n1 ? ", " : "", (long long)(n1 ? n1 : 0));
    *out = t->data;
    return KVR_OK;
}

int kvr_moe_view_biases(struct kvr_moe_layer *l, const struct kvr_gguf *g, uint32_t il,
                        uint32_t n_embd, const struct kvr_moe_hparams *mp, struct kvr_err *err)
{
    char name[96];
    int64_t ne = mp->n_expert, ff = mp->n_ff_exp;
    int rc;
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%u." suffix, il), name)
    if ((rc = view_bias(g, NAME("ffn_gate_inp.bias"), ne, 0, &l->router_b, err)) ||
        (rc = view_bias(g, NAME("ffn_gate_exps.bias"), ff, ne, &l->gate_b, err)) ||
        (rc = view_bias(g, NAME("ffn_up_exps.bias"), ff, ne, &l->up_b, err)) ||
        (rc = view_bias(g, NAME("ffn_down_exps.bias"), n_embd, ne, &l->down_b, err)))
        return rc;
#undef NAME
    return KVR_OK;
}

void kvr_moe_add_bias(float *rows, uint32_t n_rows, uint32_t width, const float *bias)
{
    for (uint32_t r = 0; r < n_rows; r++) {
        float *x = rows + (size_t)r * width;
        for (uint32_t i = 0; i < width; i++)
            x[i] += bias[i];
    }
}
