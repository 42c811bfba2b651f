/* nextn.c - the NextN blocks' own tensors, checked and never run (see nextn.h). */
#include "model/nextn.h"

#include "model/dtype.h"

#include <stdbool.h>
#include <stdio.h>

/* The table of nextn.h, in file order. */
static const struct {
    const char *name;
    int ne0_embd; /* ne0 in units of n_embd */
    int ne1;      /* 0 vector, 1 n_embd, 2 n_vocab */
    bool required;
} nextn_tensors[] = {
    {"nextn.eh_proj.weight", 2, 1, true},
    {"nextn.embed_tokens.weight", 1, 2, false},
    {"nextn.enorm.weight", 1, 0, true},
    {"nextn.hnorm.weight", 1, 0, true},
    {"nextn.shared_head_head.weight", 1, 2, false},
    {"nextn.shared_head_norm.weight", 1, 0, false},
};
#define N_NEXTN ((int)(sizeof nextn_tensors / sizeof nextn_tensors[0]))

const char *kvr_nextn_tensor(const struct kvr_hparams *hp, int i, int64_t *ne0, int64_t *ne1)
{
    if (i < 0 || i >= N_NEXTN)
        return NULL;
    *ne0 = (int64_t)nextn_tensors[i].ne0_embd * hp->n_embd;
    *ne1 = nextn_tensors[i].ne1 == 0   ? 0
           : nextn_tensors[i].ne1 == 1 ? (int64_t)hp->n_embd
                                       : (int64_t)hp->n_vocab;
    return nextn_tensors[i].name;
}

int kvr_nextn_check(const struct kvr_gguf *g, const struct kvr_hparams *hp, uint32_t il,
                    struct kvr_err *err)
{
    char name[96];
    for (int i = 0; i < N_NEXTN; i++) {
        int64_t ne0, ne1;
        const char *suffix = kvr_nextn_tensor(hp, i, &ne0, &ne1);
        snprintf(name, sizeof name, "blk.%u.%s", il, suffix);
        const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
        if (!t) {
            if (nextn_tensors[i].required)
                return kvr_err_set(err, KVR_EFORMAT, "model: missing tensor %s", name);
            continue;
        }
        bool shape_ok = ne1 ? t->n_dims == 2 && t->ne[0] == ne0 && t->ne[1] == ne1
                            : t->n_dims == 1 && t->ne[0] == ne0;
        bool type_ok = ne1 ? kvr_dtype_is_weight(t->type) : t->type == KVR_DTYPE_F32;
        if (!shape_ok || !type_ok)
            return kvr_err_set(err, KVR_EFORMAT,
                               "model: tensor %s has shape [%lld, %lld] type %d, expected "
                               "[%lld, %lld] %s",
                               name, (long long)t->ne[0], (long long)t->ne[1], t->type,
                               (long long)ne0, (long long)(ne1 ? ne1 : 1),
                               ne1 ? "(a weight type)" : "f32");
    }
    return KVR_OK;
}
