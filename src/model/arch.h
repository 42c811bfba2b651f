/* arch.h - model architectures as a table (DESIGN.md 7): what a layer holds and how the
 * forward pass treats it, one description per `general.architecture`.
 *
 * The engine's forward pass (engine.c) is one function that reads the description instead
 * of branching on names: which tensors a layer has (and which may be missing), the norm
 * placement (pre-norms always; post-norms when the layer has them), the activation of the
 * gated feed-forward, the RoPE pairing, embedding scale and sliding-window pattern. The
 * per-model numbers (widths, heads, RoPE base and scaling, window, soft-caps) come from the
 * GGUF keys `ARCH.*` into struct kvr_hparams. Synthesis (synth.c) and the plan balancer
 * (ring/propose.c) use the same table for tensor names and shapes, so a new architecture
 * is one row here plus, at most, one new step in the forward pass.
 *
 * | arch   | layer tensors beyond llama's            | act   | rope   | other                 |
 * |--------|-----------------------------------------|-------|--------|-----------------------|
 * | llama  | (optional q/k/v/o biases)               | SiLU  | normal | rope_freqs, linear    |
 * | qwen2  | q/k/v biases                            | SiLU  | neox   |                       |
 * | qwen3  | per-head q/k RMSNorm                    | SiLU  | neox   | key_length head dim   |
 * | gemma2 | post-attention and post-ffn norms       | GELU  | neox   | x sqrt(d), soft-caps, |
 * |        |                                         |       |        | sliding every 2nd     |
 * | gemma3 | q/k norms, post-norms                   | GELU  | neox   | x sqrt(d), sliding 5  |
 * |        |                                         |       |        | of 6, local rope base |
 * | phi3   | fused attn_qkv, fused gate|up in ffn_up | SiLU  | neox   |                       |
 * | qwen3moe | qwen3's, experts instead of ffn_*     | SiLU  | neox   | softmax, top-k normed |
 * | qwen2moe | qwen2's, experts + a shared expert    | SiLU  | neox   | softmax, not normed   |
 * | glm4moe  | q/k/v biases, optional q/k norms, the  | SiLU  | neox,  | sigmoid + bias, norm, |
 * |          | ffn norm post_attention_norm, experts  |       | partial| scale; leading dense, |
 * |          | + ungated shared, leading dense layers |       |        | NextN blocks not run  |
 * | deepseek2 | MLA attention (model/mla.h)          | SiLU  | normal | latent KV, YaRN       |
 * | gpt-oss | q/k/v/o biases, attention sinks, experts | OAI   | neox   | softmax of the top-k, |
 * |         | and router with biases; its ffn norm is  |       | YaRN   | sliding every 2nd     |
 * |         | named post_attention_norm                |       |        | (model/gptoss.h)      |
 *
 * Mixture-of-experts layers (model/moe.h) replace the dense ffn_gate/up/down with a router
 * and experts; the arch row gives the gating and whether the architecture always has them
 * (qwen3moe, qwen2moe) or only when the file sets ARCH.expert_count (llama: Mixtral).
 *
 * Pure data and pure functions: no globals beyond the const table, no I/O. */
#ifndef KVR_MODEL_ARCH_H
#define KVR_MODEL_ARCH_H

#include "core/err.h"
#include "model/gguf.h"
#include "model/mla.h"
#include "model/gptoss.h"
#include "model/moe.h"

#include <stdbool.h>
#include <stdint.h>

/* The tensors of one layer, `blk.N.<name>`. Shapes are GGUF {ne0 = in, ne1 = out}. */
enum kvr_lt {
    KVR_LT_ATTN_NORM,      /* attn_norm.weight          [n_embd] */
    KVR_LT_ATTN_Q,         /* attn_q.weight             [n_embd] -> [q_dim] */
    KVR_LT_ATTN_K,         /* attn_k.weight             [n_embd] -> [kv_dim] */
    KVR_LT_ATTN_V,         /* attn_v.weight             [n_embd] -> [kv_dim] */
    KVR_LT_ATTN_QKV,       /* attn_qkv.weight           [n_embd] -> [q_dim + 2 kv_dim] */
    KVR_LT_ATTN_Q_BIAS,    /* attn_q.bias               [q_dim] */
    KVR_LT_ATTN_K_BIAS,    /* attn_k.bias               [kv_dim] */
    KVR_LT_ATTN_V_BIAS,    /* attn_v.bias               [kv_dim] */
    KVR_LT_ATTN_Q_NORM,    /* attn_q_norm.weight        [head_dim], per query head */
    KVR_LT_ATTN_K_NORM,    /* attn_k_norm.weight        [head_dim], per KV head */
    KVR_LT_ATTN_OUT,       /* attn_output.weight        [q_dim] -> [n_embd] */
    KVR_LT_ATTN_POST_NORM, /* post_attention_norm.weight [n_embd] */
    KVR_LT_FFN_NORM,       /* ffn_norm.weight           [n_embd] */
    KVR_LT_FFN_GATE,       /* ffn_gate.weight           [n_embd] -> [n_ff] */
    KVR_LT_FFN_UP,         /* ffn_up.weight             [n_embd] -> [n_ff] (fused: 2 n_ff,
                              gate first) */
    KVR_LT_FFN_DOWN,       /* ffn_down.weight           [n_ff] -> [n_embd] */
    KVR_LT_FFN_POST_NORM,  /* post_ffw_norm.weight      [n_embd] */
    KVR_LT_ATTN_OUT_BIAS,  /* attn_output.bias          [n_embd] */
    KVR_LT_ATTN_SINKS,     /* attn_sinks.weight         [n_head]: one extra softmax logit
                              per query head, with no value (gpt-oss) */
    KVR_LT_COUNT
};

#define KVR_LT_BIT(t) (1u << (t))

enum kvr_act {
    KVR_ACT_SILU,       /* SwiGLU: silu(gate) * up */
    KVR_ACT_GELU_TANH,  /* GeGLU: gelu_tanh(gate) * up */
    KVR_ACT_SWIGLU_OAI, /* gpt-oss's clamped SwiGLU (model/gptoss.h kvr_swiglu_oai) */
    KVR_ACT_COUNT
};

enum kvr_rope_style {
    KVR_ROPE_NORMAL, /* rotate adjacent pairs (2i, 2i+1): llama */
    KVR_ROPE_NEOX,   /* rotate halves (i, i + n_rot/2): GPT-NeoX, qwen, gemma, phi3 */
    KVR_ROPE_COUNT
};

struct kvr_arch {
    const char *name;   /* general.architecture, also the prefix of its keys */
    uint32_t has;       /* KVR_LT_BIT of every tensor a layer has */
    uint32_t optional;  /* the subset of `has` a file may leave out */
    bool fused_gate_up; /* ffn_up holds [gate | up]; there is no ffn_gate */
    enum kvr_act act;
    enum kvr_rope_style rope;
    bool embd_scale;                /* embeddings are multiplied by sqrt(n_embd) */
    bool sliding;                   /* reads attention.sliding_window (others ignore the key, as
                                       llama.cpp does for llama and qwen2 files that carry it) */
    uint32_t swa_period;            /* with a sliding window: layer il slides unless (il + 1) %
                                       period == 0 (0: every layer slides) */
    float swa_rope_base;            /* RoPE base of sliding layers when the file names none (0:
                                       the global base) */
    uint32_t big_scale_layers;      /* gemma3: a model of this many layers (27B) scales queries
                                       by 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim) */
    bool moe_always;                /* every layer is a mixture of experts (else: when the file
                                       sets ARCH.expert_count) */
    enum kvr_moe_gating moe_gating; /* how router logits become routing weights */
    bool moe_norm;                  /* SOFTMAX gating: renormalise the selected weights */
    bool moe_shared;                /* layers also have a shared expert */
    bool moe_v3;                    /* DeepSeek-V3-style routing and its keys: gating func,
                                       weights norm and scale, groups, an ungated shared
                                       expert, leading dense layers (model/moe_route.h) */
    uint8_t moe_bias;               /* enum kvr_moe_bias: MoE layers' exp_probs_b.bias */
    const char *ffn_norm_name;      /* the pre-feed-forward norm's tensor when it is not
                                       ffn_norm.weight (glm4moe: post_attention_norm.weight) */
    bool nextn;                     /* reads ARCH.nextn_predict_layers: the file's last blocks
                                       are NextN/MTP layers, checked and never run */
    bool mla;                /* multi-head latent attention (model/mla.h) replaces attn_q/k/v */
    bool moe_biases;         /* the router and every expert matrix have biases */
    bool ffn_norm_post_attn; /* the pre-FFN norm is post_attention_norm.weight (gpt-oss:
                                KVR_LT_ATTN_POST_NORM read as the ffn norm) */
    bool swa_rope_scaled;    /* sliding layers keep the rope scaling (gemma's do not) */
};

/* The table's row for an architecture name (len bytes, not NUL-terminated), or NULL. */
const struct kvr_arch *kvr_arch_find(const char *name, size_t len);
/* The i-th supported architecture, NULL past the end. */
const struct kvr_arch *kvr_arch_at(int i);
/* "llama, qwen2, ..." for messages. */
const char *kvr_arch_list(void);
/* "attn_q.weight" and so on. */
const char *kvr_lt_name(enum kvr_lt t);
/* The name of tensor t in architecture a's files (kvr_lt_name unless the row renames it). */
const char *kvr_arch_lt_name(const struct kvr_arch *a, enum kvr_lt t);

/* Hyperparameters of a model, from the GGUF keys `ARCH.*` and the embedding's shape. */
struct kvr_hparams {
    const struct kvr_arch *arch;
    uint32_t n_layer; /* layers that run: block_count less the NextN layers */
    uint32_t n_nextn; /* NextN/MTP blocks after them (blk.n_layer .. n_layer + n_nextn - 1) */
    uint32_t n_embd;  /* model width (dim) */
    uint32_t n_ff;    /* feed-forward width */
    uint32_t n_head;
    uint32_t n_head_kv;
    uint32_t head_dim; /* attention.key_length, default n_embd / n_head */
    uint32_t q_dim;    /* n_head * head_dim */
    uint32_t kv_dim;   /* n_head_kv * head_dim */
    uint32_t n_rot;    /* rope dimensions (rope.dimension_count, default head_dim) */
    uint32_t n_vocab;
    uint32_t n_ctx_train;
    float rope_freq_base;       /* default 10000 */
    float rope_freq_scale;      /* positions are multiplied by it: 1 / rope.scaling.factor for
                                   linear scaling, else 1 */
    float rope_base_swa;        /* RoPE base of sliding-window layers */
    const float *rope_freqs;    /* optional rope_freqs.weight [n_rot / 2]: each pair's angle
                                   is divided by it (Llama 3.x), borrowed from the GGUF */
    float norm_eps;             /* layer_norm_rms_epsilon, default 1e-5 */
    float attn_scale;           /* query-key scale, default 1 / sqrt(head_dim) */
    float attn_softcap;         /* attn_logit_softcapping: s = c tanh(s / c); 0 none */
    float final_softcap;        /* final_logit_softcapping, the same on logits; 0 none */
    uint32_t n_swa;             /* attention.sliding_window in positions; 0 none */
    uint32_t swa_period;        /* attention.sliding_window_pattern or the arch's default */
    struct kvr_moe_hparams moe; /* experts (ARCH.expert_*); moe.n_expert == 0: dense */
    struct kvr_mla_hparams mla; /* latent attention; mla.kv_lora_rank == 0: none */
    struct kvr_yarn yarn;       /* YaRN rope scaling (model/yarn.h); factor 0: none */
};

/* Read and check a model's hyperparameters. An unknown architecture is refused with a
 * message listing the supported ones. */
int kvr_hparams_read(struct kvr_hparams *hp, const struct kvr_gguf *g, struct kvr_err *err);

/* Does a layer of this model have tensor t? The arch's `has`, less the dense feed-forward
 * of a mixture-of-experts model (whose expert tensors moe.h views). */
bool kvr_hparams_has(const struct kvr_hparams *hp, enum kvr_lt t);

/* Is layer il a mixture of experts (a MoE model past its leading dense layers)? */
bool kvr_hparams_layer_moe(const struct kvr_hparams *hp, uint32_t il);

/* Does layer il have tensor t? kvr_hparams_has, except that the leading dense layers of a
 * MoE model (moe.n_dense_lead) have the dense feed-forward. */
bool kvr_hparams_layer_has(const struct kvr_hparams *hp, uint32_t il, enum kvr_lt t);

/* Does layer il use the sliding window? */
bool kvr_hparams_layer_swa(const struct kvr_hparams *hp, uint32_t il);

/* The GGUF shape of layer tensor t for these hyperparameters: ne1 = 0 for a vector. */
void kvr_lt_shape(const struct kvr_hparams *hp, enum kvr_lt t, int64_t *ne0, int64_t *ne1);

#endif
