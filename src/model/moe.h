/* moe.h - the mixture-of-experts feed-forward of one layer over a batch of rows
 * (DESIGN.md 7, 11).
 *
 * A MoE layer replaces the dense SwiGLU feed-forward with n_expert smaller ones and a
 * router. For each token row x (already RMS-normed by the caller):
 *
 *   1. route    logits = x . ffn_gate_inp (n_expert values); the n_used best experts are
 *               picked (kvr_moe_select: highest logit first, equal logits by lower expert
 *               id, NaN counts as -inf) and given routing weights by the architecture's
 *               gating (enum kvr_moe_gating).
 *   2. experts  for every (row, slot) pair: weight * down_e(SiLU(gate_e x) * up_e x), where
 *               e is the slot's expert. Rows are grouped per expert and each group runs
 *               through kvr_matmul on the expert's 2D slice of the 3D tensors.
 *   3. combine  y = pair(slot 0) + pair(slot 1) + ... in slot order, then, where the
 *               architecture has one, + sigmoid(x . ffn_gate_inp_shexp) * shared FFN(x).
 *
 * GGUF layout (per layer blk.N.): ffn_gate_inp.weight [n_embd, n_expert];
 * ffn_gate_exps.weight and ffn_up_exps.weight [n_embd, n_ff_exp, n_expert];
 * ffn_down_exps.weight [n_ff_exp, n_embd, n_expert]. ne[0] is the fastest dimension, so
 * expert e's matrix is n_ff_exp (or n_embd) contiguous rows starting at byte e * (rows *
 * row_bytes): a plain struct kvr_matrix view into the mmapped tensor. Shared expert
 * (qwen2moe): ffn_{gate,up}_shexp.weight [n_embd, n_ff_shexp], ffn_down_shexp.weight
 * [n_ff_shexp, n_embd], ffn_gate_inp_shexp.weight [n_embd]. Keys: <arch>.expert_count,
 * <arch>.expert_used_count, <arch>.expert_feed_forward_length (absent in Mixtral-style
 * llama files, whose experts are feed_forward_length wide),
 * <arch>.expert_shared_feed_forward_length. Whether the selected weights are renormalised
 * is the architecture's (qwen3moe yes, qwen2moe no), not <arch>.expert_weights_norm's:
 * llama.cpp ignores that key for both (a qwen3moe file with it false and a qwen2moe file
 * with it true give its usual ids), so Kvasir does too. DeepSeek-V3-style architectures
 * (deepseek2, glm4moe) read it and their other keys through model/moe_route.h.
 *
 * Batch invariance, and placement invariance: every pair's output depends only on its own
 * row, expert and weight (kvr_matmul reduces each element in one fixed order whatever the
 * rows around it), and the combine step adds a row's pairs in slot order. So a row's result
 * is bit-identical whatever else is in the batch, however many threads run, and whichever
 * process computed each pair: kvr_moe_experts over a subset of the experts (an expert
 * agent's, `held`) fills exactly the pairs a full call would, with the same bits, and the
 * owning stage combines them as if it had computed them itself (docs/EXPERTS.md).
 *
 * Ownership: a struct kvr_moe_layer views the caller's GGUF mapping (it must outlive it).
 * A struct kvr_moe_work owns all scratch, sized at create for max_rows rows; nothing is
 * allocated per call. Thread-safety: one thread calls into a work at a time; the pool
 * passed in (or NULL: the calling thread alone) runs the parallel parts. */
#ifndef KVR_MODEL_MOE_H
#define KVR_MODEL_MOE_H

#include "core/err.h"
#include "core/pool.h"
#include "model/dtype.h"
#include "model/gguf.h"

#include <stdbool.h>
#include <stdint.h>

#define KVR_MOE_MAX_EXPERTS 1024 /* most experts per layer we accept */
#define KVR_MOE_MAX_USED 32      /* most experts per token row */

/* How router logits become routing weights. */
enum kvr_moe_gating {
    /* Softmax over the n_used selected logits only (Mixtral). Equal, in exact arithmetic,
     * to a softmax over all experts renormalised over the selected ones. */
    KVR_MOE_GATING_SOFTMAX_TOPK = 0,
    /* Softmax over all n_expert logits; the selected experts keep their probabilities
     * (qwen2moe), renormalised to sum 1 over the selection when norm_topk (qwen3moe). */
    KVR_MOE_GATING_SOFTMAX = 1,
    /* Each expert's probability is sigmoid(logit) on its own (DeepSeek V3, GLM-4.5); the
     * selected keep theirs, renormalised when norm_topk (model/moe_route.h). */
    KVR_MOE_GATING_SIGMOID = 2,
    KVR_MOE_GATING_COUNT
};

struct kvr_moe_hparams {
    uint32_t n_expert;   /* experts per layer; 0 = a dense model */
    uint32_t n_used;     /* experts per token row (k), 1..min(n_expert, KVR_MOE_MAX_USED) */
    uint32_t n_ff_exp;   /* hidden width of one expert */
    uint32_t n_ff_shexp; /* hidden width of the shared expert; 0 = none */
    enum kvr_moe_gating gating;
    bool norm_topk;  /* SOFTMAX or SIGMOID gating: renormalise the selected probabilities */
    bool biases;     /* the router and each expert matrix add a bias (gpt-oss), set by arch.c */
    bool swiglu_oai; /* experts use gpt-oss's clamped SwiGLU (gptoss.h), set by arch.c */
    /* DeepSeek-V3-style routing (model/moe_route.h; all zero for the other architectures) */
    float w_scale;            /* routing weights multiplied by it after norm_topk; 0 = 1 */
    uint32_t n_group;         /* group-limited routing: experts in n_group equal groups (0, 1:
                                 none), the selection from the best n_group_used of them */
    uint32_t n_group_used;    /* groups a row may use */
    uint32_t n_dense_lead;    /* layers 0..n_dense_lead-1 have a dense feed-forward */
    bool shared_plain;        /* the shared expert is added ungated (no ffn_gate_inp_shexp) */
    bool probs_bias;          /* MoE layers may have exp_probs_b.bias (selection-only bias) */
    bool probs_bias_required; /* and must */
};

/* Read the expert keys of architecture `arch` ("llama", "qwen3moe"). With no
 * <arch>.expert_count key, or a count of 0, the model is dense: n_expert = 0, KVR_OK.
 * `gating` and `norm_default` (norm_topk) are the architecture's, from its table entry.
 * n_ff is the model's
 * feed_forward_length, the experts' width when <arch>.expert_feed_forward_length is absent.
 * `shared` says whether the architecture has a shared expert (its width is then read from
 * <arch>.expert_shared_feed_forward_length, required). Bounds are checked with a message. */
int kvr_moe_hparams_read(struct kvr_moe_hparams *mp, const struct kvr_gguf *g, const char *arch,
                         enum kvr_moe_gating gating, bool norm_default, bool shared, uint32_t n_ff,
                         struct kvr_err *err);

/* Views of one layer's MoE tensors. */
struct kvr_moe_layer {
    struct kvr_matrix router;   /* ffn_gate_inp: [n_embd] -> [n_expert] logits */
    struct kvr_matrix gate, up; /* expert 0 of ffn_{gate,up}_exps: [n_embd] -> [n_ff_exp] */
    struct kvr_matrix down;     /* expert 0 of ffn_down_exps: [n_ff_exp] -> [n_embd] */
    size_t gate_stride, up_stride, down_stride; /* bytes from one expert to the next */
    /* shared expert, when n_ff_shexp > 0 (all zero otherwise) */
    struct kvr_matrix sh_gate_inp;    /* ffn_gate_inp_shexp: [n_embd] -> [1] */
    struct kvr_matrix sh_gate, sh_up; /* [n_embd] -> [n_ff_shexp] */
    struct kvr_matrix sh_down;        /* [n_ff_shexp] -> [n_embd] */
    const float *probs_b; /* exp_probs_b.bias [n_expert] when mp->probs_bias, else NULL */
    /* biases, when mp->biases (NULL otherwise; moe_oai.c views them) */
    const float *router_b;      /* ffn_gate_inp.bias [n_expert] */
    const float *gate_b, *up_b; /* ffn_{gate,up}_exps.bias [n_ff_exp] per expert */
    const float *down_b;        /* ffn_down_exps.bias [n_embd] per expert */
};

/* View layer il's MoE tensors (blk.<il>.*) with every shape and type checked. */
int kvr_moe_layer_view(struct kvr_moe_layer *l, const struct kvr_gguf *g, uint32_t il,
                       uint32_t n_embd, const struct kvr_moe_hparams *mp, struct kvr_err *err);

/* The router's and experts' biases of layer il (mp->biases; moe_oai.c), f32 and
 * shape-checked: ffn_gate_inp.bias [n_expert], ffn_{gate,up}_exps.bias [n_ff_exp, n_expert],
 * ffn_down_exps.bias [n_embd, n_expert]. kvr_moe_layer_view calls it. */
int kvr_moe_view_biases(struct kvr_moe_layer *l, const struct kvr_gguf *g, uint32_t il,
                        uint32_t n_embd, const struct kvr_moe_hparams *mp, struct kvr_err *err);
/* rows[r * width + i] += bias[i] for n_rows rows. */
void kvr_moe_add_bias(float *rows, uint32_t n_rows, uint32_t width, const float *bias);

/* Expert e's matrix: which = 0 gate, 1 up, 2 down. e < n_expert. */
struct kvr_matrix kvr_moe_expert_matrix(const struct kvr_moe_layer *l, int which, uint32_t e);

/* Weight bytes one token row reads in this layer's feed-forward: the router, n_used
 * average experts and the shared expert (for the plan balancer: a MoE layer costs what a
 * token reads, not all its experts). */
double kvr_moe_layer_bytes_per_token(const struct kvr_moe_layer *l,
                                     const struct kvr_moe_hparams *mp);

/* Top-k of one row's router logits and its routing weights: ids[0..n_used) best first
 * (highest logit; equal logits: lower id first; NaN ranks below everything, as -inf),
 * weights[s] the weight of ids[s]. Pure; the same bits on any thread. */
void kvr_moe_select(const struct kvr_moe_hparams *mp, const float *logits, uint32_t *ids,
                    float *weights);
/* kvr_moe_select with a layer's selection bias (probs_b: n_expert values or NULL); sigmoid
 * gating, a bias or expert groups go through kvr_moe_select_scored (model/moe_route.h). */
void kvr_moe_select_b(const struct kvr_moe_hparams *mp, const float *logits, const float *probs_b,
                      uint32_t *ids, float *weights);

struct kvr_moe_work;

/* Scratch for up to max_rows rows of any of the n_layers layers given (their weight types
 * size the converted-activation buffers). The layers are only read here. */
int kvr_moe_work_create(struct kvr_moe_work **out, uint32_t n_embd,
                        const struct kvr_moe_hparams *mp, const struct kvr_moe_layer *layers,
                        uint32_t n_layers, uint32_t max_rows, struct kvr_err *err);
void kvr_moe_work_destroy(struct kvr_moe_work *w);

/* Step 1: router logits and kvr_moe_select for n_rows rows of x (n_rows x n_embd):
 * ids and weights get n_rows x n_used entries, row-major. */
void kvr_moe_route(struct kvr_moe_work *w, const struct kvr_moe_layer *l, const float *x,
                   uint32_t n_rows, uint32_t *ids, float *weights, struct kvr_pool *pool);

/* Step 2, the function an expert agent runs for the experts it holds: for every pair
 * p = r * n_used + s (r < n_rows) whose expert ids[p] is held (held[ids[p]] != 0; held
 * NULL: every expert), out[p * n_embd ...] = weights[p] * FFN_{ids[p]}(x[r]). The rows of
 * other pairs are left untouched. x: n_rows x n_embd; out: n_rows x n_used x n_embd.
 * ids must be < n_expert (callers check untrusted ones). */
void kvr_moe_experts(struct kvr_moe_work *w, const struct kvr_moe_layer *l, const float *x,
                     uint32_t n_rows, const uint32_t *ids, const float *weights,
                     const uint8_t *held, float *out, struct kvr_pool *pool);

/* Step 3: y[r] = pairs[r * n_used + 0] + pairs[r * n_used + 1] + ..., in slot order
 * (y: n_rows x n_embd, overwritten). */
void kvr_moe_combine(const float *pairs, uint32_t n_rows, uint32_t n_used, uint32_t n_embd,
                     float *y);

/* The shared expert, when the layer has one: y[r] += sigmoid(x[r] . gate_inp_shexp) *
 * down_shexp(SiLU(gate_shexp x[r]) * up_shexp x[r]). */
void kvr_moe_shared(struct kvr_moe_work *w, const struct kvr_moe_layer *l, const float *x,
                    uint32_t n_rows, float *y, struct kvr_pool *pool);

/* Steps 1-3 and the shared expert in one call, all in this process: y = the layer's
 * feed-forward output for n_rows rows of x (y is overwritten; the caller adds it to the
 * residual stream). */
void kvr_moe_forward(struct kvr_moe_work *w, const struct kvr_moe_layer *l, const float *x,
                     uint32_t n_rows, float *y, struct kvr_pool *pool);

/* The expert step handed to someone else (ring/experts.h: expert agents). It must fill
 * every pair row of `pairs` (n_rows x n_used x n_embd) for the routing ids/weights, with
 * exactly the bits kvr_moe_experts would give (it may call kvr_moe_experts with w and pool
 * for the pairs it computes here). `layer` is the model's layer index. */
typedef void (*kvr_moe_dispatch_fn)(void *ctx, uint32_t layer, struct kvr_moe_work *w,
                                    const struct kvr_moe_layer *l, const float *x, uint32_t n_rows,
                                    const uint32_t *ids, const float *weights, float *pairs,
                                    struct kvr_pool *pool);

/* kvr_moe_forward with step 2 done by fn(ctx, ...): routing, then fn, then the combine in
 * slot order and the shared expert, exactly as kvr_moe_forward. */
void kvr_moe_forward_dispatch(struct kvr_moe_work *w, const struct kvr_moe_layer *l, uint32_t layer,
                              const float *x, uint32_t n_rows, float *y, struct kvr_pool *pool,
                              kvr_moe_dispatch_fn fn, void *ctx);

/* The plain reference of kvr_moe_forward for one row: weights dequantized row by row to
 * floats, dots in double, the same selection rule. ids (n_used entries) may be NULL.
 * scratch: kvr_moe_ref_scratch_floats(n_embd, mp) floats. For tests. */
size_t kvr_moe_ref_scratch_floats(uint32_t n_embd, const struct kvr_moe_hparams *mp);
void kvr_moe_forward_ref(const struct kvr_moe_layer *l, const struct kvr_moe_hparams *mp,
                         uint32_t n_embd, const float *x, float *y, uint32_t *ids, float *scratch);

#endif
