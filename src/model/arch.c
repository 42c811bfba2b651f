/* arch.c - the architecture table and the hyperparameters read from `ARCH.*` keys. */
#include "model/arch.h"

#include "model/dtype.h"
#include "model/moe_route.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- the table --------------------------------------------------------------------------- */

#define B(t) KVR_LT_BIT(KVR_LT_##t)
#define PRE_NORMS (B(ATTN_NORM) | B(FFN_NORM))
#define QKV_SPLIT (B(ATTN_Q) | B(ATTN_K) | B(ATTN_V))
#define QKV_BIAS (B(ATTN_Q_BIAS) | B(ATTN_K_BIAS) | B(ATTN_V_BIAS))
#define QK_NORM (B(ATTN_Q_NORM) | B(ATTN_K_NORM))
#define POST_NORMS (B(ATTN_POST_NORM) | B(FFN_POST_NORM))
#define GATED_FFN (B(FFN_GATE) | B(FFN_UP) | B(FFN_DOWN))

static const struct kvr_arch archs[] = {
    {.name = "llama",
     .has = PRE_NORMS | QKV_SPLIT | QKV_BIAS | B(ATTN_OUT) | GATED_FFN,
     .optional = QKV_BIAS,
     .act = KVR_ACT_SILU,
     .rope = KVR_ROPE_NORMAL},
    {.name = "qwen2",
     .has = PRE_NORMS | QKV_SPLIT | QKV_BIAS | B(ATTN_OUT) | GATED_FFN,
     .act = KVR_ACT_SILU,
     .rope = KVR_ROPE_NEOX},
    {.name = "qwen3",
     .has = PRE_NORMS | QKV_SPLIT | QK_NORM | B(ATTN_OUT) | GATED_FFN,
     .act = KVR_ACT_SILU,
     .rope = KVR_ROPE_NEOX},
    {.name = "gemma2",
     .has = PRE_NORMS | POST_NORMS | QKV_SPLIT | B(ATTN_OUT) | GATED_FFN,
     .act = KVR_ACT_GELU_TANH,
     .rope = KVR_ROPE_NEOX,
     .embd_scale = true,
     .sliding = true,
     .swa_period = 2},
    {.name = "gemma3",
     .has = PRE_NORMS | POST_NORMS | QKV_SPLIT | QK_NORM | B(ATTN_OUT) | GATED_FFN,
     .act = KVR_ACT_GELU_TANH,
     .rope = KVR_ROPE_NEOX,
     .embd_scale = true,
     .sliding = true,
     .swa_period = 6,
     .swa_rope_base = 10000.0f,
     .big_scale_layers = 62},
    {.name = "phi3",
     .has = PRE_NORMS | B(ATTN_QKV) | B(ATTN_OUT) | B(FFN_UP) | B(FFN_DOWN),
     .fused_gate_up = true,
     .act = KVR_ACT_SILU,
     .rope = KVR_ROPE_NEOX},
    {.name = "qwen3moe",
     .has = PRE_NORMS | QKV_SPLIT | QK_NORM | B(ATTN_OUT),
     .act = KVR_ACT_SILU,
     .rope = KVR_ROPE_NEOX,
     .moe_always = true,
     .moe_gating = KVR_MOE_GATING_SOFTMAX,
     .moe_norm = true},
    {.name = "qwen2moe",
     .has = PRE_NORMS | QKV_SPLIT | QKV_BIAS | B(ATTN_OUT),
     .act = KVR_ACT_SILU,
     .rope = KVR_ROPE_NEOX,
     .moe_always = true,
     .moe_gating = KVR_MOE_GATING_SOFTMAX,
     .moe_shared = true},
    {.name = "glm4moe",
     .has = PRE_NORMS | QKV_SPLIT | QKV_BIAS | QK_NORM | B(ATTN_OUT) | GATED_FFN,
     .optional = QK_NORM, /* GLM-4.5 has them, GLM-4.5-Air not */
     .act = KVR_ACT_SILU,
     .rope = KVR_ROPE_NEOX,
     .moe_always = true,
     .moe_gating = KVR_MOE_GATING_SIGMOID,
     .moe_v3 = true,
     .moe_bias = KVR_MOE_BIAS_REQUIRED,
     .ffn_norm_name = "post_attention_norm.weight",
     .nextn = true},
    {.name = "deepseek2",
     .has = PRE_NORMS | B(ATTN_OUT) | GATED_FFN,
     .act = KVR_ACT_SILU,
     .rope = KVR_ROPE_NORMAL,
     .moe_gating = KVR_MOE_GATING_SOFTMAX,
     .moe_v3 = true,
     .moe_bias = KVR_MOE_BIAS_OPTIONAL,
     .mla = true},
    {.name = "gpt-oss",
     .has = B(ATTN_NORM) | B(ATTN_POST_NORM) | QKV_SPLIT | QKV_BIAS | B(ATTN_OUT) |
            B(ATTN_OUT_BIAS) | B(ATTN_SINKS),
     .act = KVR_ACT_SWIGLU_OAI,
     .rope = KVR_ROPE_NEOX,
     .sliding = true,
     .swa_period = 2,
     .moe_always = true,
     .moe_gating = KVR_MOE_GATING_SOFTMAX_TOPK,
     .moe_biases = true,
     .ffn_norm_post_attn = true,
     .swa_rope_scaled = true},
};
#define N_ARCHS ((int)(sizeof archs / sizeof archs[0]))

static const char *const lt_names[KVR_LT_COUNT] = {
    [KVR_LT_ATTN_NORM] = "attn_norm.weight",
    [KVR_LT_ATTN_Q] = "attn_q.weight",
    [KVR_LT_ATTN_K] = "attn_k.weight",
    [KVR_LT_ATTN_V] = "attn_v.weight",
    [KVR_LT_ATTN_QKV] = "attn_qkv.weight",
    [KVR_LT_ATTN_Q_BIAS] = "attn_q.bias",
    [KVR_LT_ATTN_K_BIAS] = "attn_k.bias",
    [KVR_LT_ATTN_V_BIAS] = "attn_v.bias",
    [KVR_LT_ATTN_Q_NORM] = "attn_q_norm.weight",
    [KVR_LT_ATTN_K_NORM] = "attn_k_norm.weight",
    [KVR_LT_ATTN_OUT] = "attn_output.weight",
    [KVR_LT_ATTN_POST_NORM] = "post_attention_norm.weight",
    [KVR_LT_FFN_NORM] = "ffn_norm.weight",
    [KVR_LT_FFN_GATE] = "ffn_gate.weight",
    [KVR_LT_FFN_UP] = "ffn_up.weight",
    [KVR_LT_FFN_DOWN] = "ffn_down.weight",
    [KVR_LT_FFN_POST_NORM] = "post_ffw_norm.weight",
    [KVR_LT_ATTN_OUT_BIAS] = "attn_output.bias",
    [KVR_LT_ATTN_SINKS] = "attn_sinks.weight",
};

const struct kvr_arch *kvr_arch_find(const char *name, size_t len)
{
    for (int i = 0; i < N_ARCHS; i++)
        if (strlen(archs[i].name) == len && !memcmp(archs[i].name, name, len))
            return &archs[i];
    return NULL;
}

const struct kvr_arch *kvr_arch_at(int i)
{
    return i >= 0 && i < N_ARCHS ? &archs[i] : NULL;
}

const char *kvr_arch_list(void)
{
    return "llama, qwen2, qwen3, gemma2, gemma3, phi3, qwen3moe, qwen2moe, glm4moe, deepseek2, "
           "gpt-oss";
}

const char *kvr_lt_name(enum kvr_lt t)
{
    return (unsigned)t < KVR_LT_COUNT ? lt_names[t] : "?";
}

const char *kvr_arch_lt_name(const struct kvr_arch *a, enum kvr_lt t)
{
    return t == KVR_LT_FFN_NORM && a->ffn_norm_name ? a->ffn_norm_name : kvr_lt_name(t);
}

void kvr_lt_shape(const struct kvr_hparams *hp, enum kvr_lt t, int64_t *ne0, int64_t *ne1)
{
    int64_t d = hp->n_embd, q = hp->q_dim, kv = hp->kv_dim, ff = hp->n_ff;
    *ne1 = 0;
    switch (t) {
    case KVR_LT_ATTN_Q:
        *ne0 = d, *ne1 = q;
        break;
    case KVR_LT_ATTN_K:
    case KVR_LT_ATTN_V:
        *ne0 = d, *ne1 = kv;
        break;
    case KVR_LT_ATTN_QKV:
        *ne0 = d, *ne1 = q + 2 * kv;
        break;
    case KVR_LT_ATTN_Q_BIAS:
        *ne0 = q;
        break;
    case KVR_LT_ATTN_K_BIAS:
    case KVR_LT_ATTN_V_BIAS:
        *ne0 = kv;
        break;
    case KVR_LT_ATTN_Q_NORM:
    case KVR_LT_ATTN_K_NORM:
        *ne0 = hp->head_dim;
        break;
    case KVR_LT_ATTN_OUT:
        *ne0 = q, *ne1 = d;
        break;
    case KVR_LT_ATTN_SINKS:
        *ne0 = hp->n_head;
        break;
    case KVR_LT_FFN_GATE:
        *ne0 = d, *ne1 = ff;
        break;
    case KVR_LT_FFN_UP:
        *ne0 = d, *ne1 = hp->arch->fused_gate_up ? 2 * ff : ff;
        break;
    case KVR_LT_FFN_DOWN:
        *ne0 = ff, *ne1 = d;
        break;
    default: /* the norms of the residual width */
        *ne0 = d;
        break;
    }
}

bool kvr_hparams_has(const struct kvr_hparams *hp, enum kvr_lt t)
{
    if (!(hp->arch->has & KVR_LT_BIT(t)))
        return false;
    return !hp->moe.n_expert ||
           (t != KVR_LT_FFN_GATE && t != KVR_LT_FFN_UP && t != KVR_LT_FFN_DOWN);
}

bool kvr_hparams_layer_moe(const struct kvr_hparams *hp, uint32_t il)
{
    return hp->moe.n_expert && il >= hp->moe.n_dense_lead;
}

bool kvr_hparams_layer_has(const struct kvr_hparams *hp, uint32_t il, enum kvr_lt t)
{
    if (!(hp->arch->has & KVR_LT_BIT(t)))
        return false;
    return !kvr_hparams_layer_moe(hp, il) ||
           (t != KVR_LT_FFN_GATE && t != KVR_LT_FFN_UP && t != KVR_LT_FFN_DOWN);
}

bool kvr_hparams_layer_swa(const struct kvr_hparams *hp, uint32_t il)
{
    if (!hp->n_swa)
        return false;
    return hp->swa_period == 0 || (il + 1) % hp->swa_period != 0;
}

/* ---- hyperparameters ---------------------------------------------------------------------- */

enum {
    MAX_ROT = 1024, /* most rotary dimensions per head (engine.c keeps tables on the stack) */
    MAX_GROUP = 64, /* most query heads sharing one KV head */
};

/* `ARCH.suffix` */
static const char *key(char *buf, size_t cap, const struct kvr_arch *a, const char *suffix)
{
    snprintf(buf, cap, "%s.%s", a->name, suffix);
    return buf;
}

static int get_u32(const struct kvr_gguf *g, const struct kvr_arch *a, const char *suffix,
                   bool required, uint32_t *out, struct kvr_err *err)
{
    char k[96];
    int rc = kvr_gguf_get_u32(g, key(k, sizeof k, a, suffix), out, err);
    if (rc == KVR_ENOTFOUND)
        return required ? kvr_err_set(err, KVR_EFORMAT, "model: missing metadata key %s", k)
                        : KVR_OK;
    return rc;
}

static int get_f32(const struct kvr_gguf *g, const struct kvr_arch *a, const char *suffix,
                   float *out, struct kvr_err *err)
{
    char k[96];
    int rc = kvr_gguf_get_f32(g, key(k, sizeof k, a, suffix), out, err);
    return rc == KVR_ENOTFOUND ? KVR_OK : rc;
}

/* rope.scaling.type / factor: "none" or "linear" (a factor without a type is linear). */
static int read_rope_scaling(struct kvr_hparams *hp, const struct kvr_gguf *g, struct kvr_err *err)
{
    char k[96];
    float factor = 1.0f;
    int rc = get_f32(g, hp->arch, "rope.scaling.factor", &factor, err);
    if (rc)
        return rc;
    struct kvr_gguf_str type = {4, "none"};
    rc = kvr_gguf_get_str(g, key(k, sizeof k, hp->arch, "rope.scaling.type"), &type, err);
    if (rc == KVR_ENOTFOUND) {
        type =
            factor != 1.0f ? (struct kvr_gguf_str){6, "linear"} : (struct kvr_gguf_str){4, "none"};
    } else if (rc) {
        return rc;
    }
    if (type.len == 4 && !memcmp(type.ptr, "none", 4))
        return KVR_OK;
    if (type.len == 4 && !memcmp(type.ptr, "yarn", 4)) {
        return kvr_yarn_read(&hp->yarn, g, hp->arch->name, factor, hp->n_ctx_train, err);
    }
    if (type.len != 6 || memcmp(type.ptr, "linear", 6))
        return kvr_err_set(err, KVR_ENOTSUP,
                           "model: rope scaling '%.*s' is not supported "
                           "(none, linear, yarn, or Llama 3's rope_freqs.weight)",
                           (int)(type.len > 32 ? 32 : type.len), type.ptr);
    if (!(factor > 0.0f) || factor > 1024.0f)
        return kvr_err_set(err, KVR_EFORMAT, "model: rope scaling factor %g", (double)factor);
    hp->rope_freq_scale = 1.0f / factor;
    return KVR_OK;
}

/* block_count, less the NextN layers (an architecture with `nextn`). */
static int read_blocks(struct kvr_hparams *hp, const struct kvr_gguf *g, const struct kvr_arch *a,
                       struct kvr_err *err)
{
    int rc = get_u32(g, a, "block_count", true, &hp->n_layer, err);
    if (rc || !a->nextn || (rc = get_u32(g, a, "nextn_predict_layers", false, &hp->n_nextn, err)))
        return rc;
    if (hp->n_nextn >= hp->n_layer)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: %s.nextn_predict_layers %u leaves none of the %u blocks to "
                           "run",
                           a->name, hp->n_nextn, hp->n_layer);
    hp->n_layer -= hp->n_nextn;
    return KVR_OK;
}

/* The shape: layer count, widths and heads (required), then the optional keys with their
 * defaults, checked for plausibility. */
static int read_shape(struct kvr_hparams *hp, const struct kvr_gguf *g, const struct kvr_arch *a,
                      struct kvr_err *err)
{
    int rc;
    if ((rc = read_blocks(hp, g, a, err)) ||
        (rc = get_u32(g, a, "embedding_length", true, &hp->n_embd, err)) ||
        (rc = get_u32(g, a, "feed_forward_length", true, &hp->n_ff, err)) ||
        (rc = get_u32(g, a, "attention.head_count", true, &hp->n_head, err)))
        return rc;
    hp->n_head_kv = hp->n_head;
    hp->n_ctx_train = 2048;
    hp->rope_freq_base = 10000.0f;
    hp->rope_freq_scale = 1.0f;
    hp->norm_eps = 1e-5f;
    if ((rc = get_u32(g, a, "attention.head_count_kv", false, &hp->n_head_kv, err)) ||
        (rc = get_u32(g, a, "context_length", false, &hp->n_ctx_train, err)) ||
        (rc = get_f32(g, a, "rope.freq_base", &hp->rope_freq_base, err)) ||
        (rc = get_f32(g, a, "attention.layer_norm_rms_epsilon", &hp->norm_eps, err)) ||
        (rc = get_f32(g, a, "attn_logit_softcapping", &hp->attn_softcap, err)) ||
        (rc = get_f32(g, a, "final_logit_softcapping", &hp->final_softcap, err)) ||
        (rc = read_rope_scaling(hp, g, err)))
        return rc;

    if (hp->n_layer == 0 || hp->n_layer > 4096 || hp->n_embd == 0 || hp->n_embd > 65536 ||
        hp->n_ff == 0 || hp->n_ff > 262144 || hp->n_head == 0 || hp->n_head > 1024 ||
        hp->n_head_kv == 0)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: implausible shape (layers %u, dim %u, "
                           "ff %u, heads %u/%u)",
                           hp->n_layer, hp->n_embd, hp->n_ff, hp->n_head, hp->n_head_kv);
    if (hp->n_head % hp->n_head_kv || hp->n_head / hp->n_head_kv > MAX_GROUP)
        return kvr_err_set(err, KVR_EFORMAT, "model: heads %u / kv heads %u do not divide",
                           hp->n_head, hp->n_head_kv);
    return KVR_OK;
}

/* Head widths (key_length, value_length) and the rotary dimensions. */
static int read_heads(struct kvr_hparams *hp, const struct kvr_gguf *g, const struct kvr_arch *a,
                      struct kvr_err *err)
{
    int rc;
    hp->head_dim = hp->n_embd % hp->n_head ? 0 : hp->n_embd / hp->n_head;
    uint32_t v_dim = 0;
    if ((rc = get_u32(g, a, "attention.key_length", false, &hp->head_dim, err)) ||
        (rc = get_u32(g, a, "attention.value_length", false, &v_dim, err)))
        return rc;
    if (hp->head_dim == 0 || hp->head_dim > 4096 || (v_dim && v_dim != hp->head_dim))
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: head dim %u (value %u) invalid for dim "
                           "%u and %u heads",
                           hp->head_dim, v_dim, hp->n_embd, hp->n_head);
    hp->q_dim = hp->n_head * hp->head_dim;
    hp->kv_dim = hp->n_head_kv * hp->head_dim;
    hp->n_rot = hp->head_dim;
    if ((rc = get_u32(g, a, "rope.dimension_count", false, &hp->n_rot, err)))
        return rc;
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2 || hp->n_rot > MAX_ROT)
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: rope dimension %u invalid for head "
                           "dim %u",
                           hp->n_rot, hp->head_dim);
    if (!(hp->rope_freq_base > 0.0f) || !(hp->norm_eps > 0.0f) || hp->norm_eps > 1.0f ||
        !(hp->attn_softcap >= 0.0f) || !(hp->final_softcap >= 0.0f))
        return kvr_err_set(err, KVR_EFORMAT, "model: bad rope base, norm epsilon or soft-cap");
    return KVR_OK;
}

/* The sliding window (its period and rope base) and the attention scale. */
static int read_swa_and_scale(struct kvr_hparams *hp, const struct kvr_gguf *g,
                              const struct kvr_arch *a, struct kvr_err *err)
{
    int rc;
    if (a->sliding && (rc = get_u32(g, a, "attention.sliding_window", false, &hp->n_swa, err)))
        return rc;
    hp->swa_period = a->swa_period;
    hp->rope_base_swa = a->swa_rope_base > 0.0f ? a->swa_rope_base : hp->rope_freq_base;
    if ((rc = get_u32(g, a, "attention.sliding_window_pattern", false, &hp->swa_period, err)) ||
        (rc = get_f32(g, a, "rope.freq_base_swa", &hp->rope_base_swa, err)))
        return rc;
    if (!(hp->rope_base_swa > 0.0f))
        return kvr_err_set(err, KVR_EFORMAT, "model: bad sliding-window rope base");

    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    if (a->big_scale_layers && hp->n_layer == a->big_scale_layers)
        hp->attn_scale = 1.0f / sqrtf((float)(hp->n_embd / hp->n_head));
    if ((rc = get_f32(g, a, "attention.scale", &hp->attn_scale, err)))
        return rc;
    if (!(hp->attn_scale > 0.0f))
        return kvr_err_set(err, KVR_EFORMAT, "model: bad attention scale");
    return KVR_OK;
}

/* Llama 3's per-dimension rope factors, if the file has rope_freqs.weight. */
static int read_rope_freqs(struct kvr_hparams *hp, const struct kvr_gguf *g, struct kvr_err *err)
{
    const struct kvr_gguf_tensor *ff = kvr_gguf_find_tensor(g, "rope_freqs.weight");
    if (ff) {
        if (ff->type != KVR_DTYPE_F32 || ff->n_dims != 1 || ff->ne[0] != hp->n_rot / 2 ||
            (uintptr_t)ff->data % sizeof(float))
            return kvr_err_set(err, KVR_EFORMAT, "model: rope_freqs.weight must be f32 [%u]",
                               hp->n_rot / 2);
        hp->rope_freqs = ff->data;
        for (uint32_t i = 0; i < hp->n_rot / 2; i++)
            if (!(hp->rope_freqs[i] > 0.0f))
                return kvr_err_set(err, KVR_EFORMAT,
                                   "model: rope_freqs.weight[%u] is not "
                                   "positive",
                                   i);
    }
    return KVR_OK;
}

int kvr_hparams_read(struct kvr_hparams *hp, const struct kvr_gguf *g, struct kvr_err *err)
{
    memset(hp, 0, sizeof *hp);
    struct kvr_gguf_str name;
    int rc = kvr_gguf_get_str(g, "general.architecture", &name, err);
    if (rc == KVR_ENOTFOUND)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing general.architecture");
    if (rc)
        return rc;
    const struct kvr_arch *a = kvr_arch_find(name.ptr, name.len);
    if (!a)
        return kvr_err_set(err, KVR_ENOTSUP,
                           "model: architecture '%.*s' is not supported "
                           "(supported: %s)",
                           (int)(name.len > 64 ? 64 : name.len), name.ptr, kvr_arch_list());
    hp->arch = a;
    if ((rc = read_shape(hp, g, a, err)) ||
        (rc = a->mla ? kvr_mla_hparams_read(hp, g, err) : read_heads(hp, g, a, err)) ||
        (rc = read_swa_and_scale(hp, g, a, err)) || (rc = read_rope_freqs(hp, g, err)))
        return rc;

    if ((rc = kvr_moe_hparams_read(&hp->moe, g, a->name, a->moe_gating, a->moe_norm, a->moe_shared,
                                   hp->n_ff, err)))
        return rc;
    if (a->moe_v3 && hp->moe.n_expert &&
        (rc = kvr_moe_hparams_read_v3(&hp->moe, g, a->name, (enum kvr_moe_bias)a->moe_bias,
                                      hp->n_layer, err)))
        return rc;
    hp->moe.biases = a->moe_biases;
    hp->moe.swiglu_oai = a->act == KVR_ACT_SWIGLU_OAI;
    if (a->moe_always && !hp->moe.n_expert)
        return kvr_err_set(err, KVR_EFORMAT, "model: %s needs %s.expert_count", a->name, a->name);

    const struct kvr_gguf_tensor *emb = kvr_gguf_find_tensor(g, "token_embd.weight");
    if (!emb)
        return kvr_err_set(err, KVR_EFORMAT, "model: missing tensor token_embd.weight");
    if (emb->n_dims != 2 || emb->ne[0] != hp->n_embd || emb->ne[1] < 1 || emb->ne[1] > (1 << 22))
        return kvr_err_set(err, KVR_EFORMAT,
                           "model: token_embd.weight has shape [%lld, %lld]"
                           ", expected [%u, n_vocab]",
                           (long long)emb->ne[0], (long long)emb->ne[1], hp->n_embd);
    hp->n_vocab = (uint32_t)emb->ne[1];
    return KVR_OK;
}
