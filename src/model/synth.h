/* synth.h - write a GGUF model of any architecture of arch.h with random weights.
 *
 * The file looks to any GGUF loader (ours, llama.cpp's) like a real checkpoint: the
 * metadata keys `ARCH.*` and the tensor names of arch.h's table, an SPM vocabulary
 * (built in, or copied from another GGUF), F32 norm weights near 1 and matrices in the
 * chosen type, quantized with the reference from_float of dtype.h. It exists so benchmarks
 * and ring tests can run at realistic sizes on machines that cannot download a model.
 *
 * Weights: every row of every tensor comes from its own PRNG stream, seeded from (seed,
 * tensor name, row), so the file is a pure function of the options: the same seed gives a
 * byte-identical file whatever the thread count, and kvr_synth_row() regenerates any row's
 * float values for tests. Matrices are uniform with standard deviation 1/sqrt(n_in)
 * (attn_output and ffn_down additionally divided by sqrt(2 * n_layers), so the residual
 * stream stays O(1) through deep stacks); token embeddings have standard deviation 1; norm
 * weights (also q/k norms) are uniform in [0.9, 1.1], post-norms (gemma) in [0.2, 0.3]
 * so that a block adds to the residual about what a llama block of these models adds
 * (with unit post-norms, llama.cpp and Kvasir drift apart 4x more per layer); biases have
 * standard
 * deviation 0.3; tied embeddings (always gemma's) are drawn with the output head's
 * 1/sqrt(dim), and, unless the model scales them back up (gemma), the residual branches
 * are drawn 1/sqrt(dim) smaller with them, so the stream keeps the proportions of an
 * untied model. The final norm's weights are multiplied by logit_scale, which scales
 * every logit (tied output or not): random networks have nearly equal top logits, and a
 * larger scale separates them so comparisons with another engine are not decided by
 * rounding.
 *
 * Architectures: the layer tensors are the table's `has` minus its `optional` ones;
 * gemma2/gemma3 always tie the output to the embedding (as their real files do), others
 * when `tied` is set. gemma2 gets its usual soft-caps (attention 50, final 30). A shape's
 * head_dim (when set) is written as attention.key_length/value_length, its n_swa as
 * attention.sliding_window. For llama, rope_freqs writes a rope_freqs.weight with Llama
 * 3.1's factors (factor 8, low/high frequency factors 1 and 4, original context 8192) and
 * rope_scale != 1 writes linear rope.scaling.
 *
 * Mixture of experts (n_expert > 0; required by qwen3moe and qwen2moe, and makes a llama
 * file Mixtral-style): each layer's dense ffn_gate/up/down become ffn_gate_inp (the router)
 * and the 3D ffn_{gate,up,down}_exps (plus qwen2moe's shared expert, see model/moe.h),
 * with the keys ARCH.expert_count / expert_used_count / expert_feed_forward_length (not for
 * llama, whose experts are feed_forward_length wide) / expert_shared_feed_forward_length.
 * The router is built so that no token is ever near a tie between its k-th and (k+1)-th
 * expert, since two engines whose arithmetic differs by rounding would then route it
 * differently and their answers part for a reason that is not a bug. The first n_expert
 * coordinates of the residual stream are reserved for routing: every token embedding holds
 * a permutation of n_expert evenly spaced levels there (spacing 3.4 / (n_expert - 1)), no
 * layer writes them (those output rows of attn_output, ffn_down_exps and ffn_down_shexp
 * are zero, so the stream keeps the embedding's values exactly), ffn_norm is exactly 1 on
 * them, and layer l's router row e is one-hot on reserved coordinate perm_l(e) with gain
 * 1.2 / spacing. A token's router logits in every layer are then its levels times one
 * positive RMSNorm factor: distinct ranks at least about one logit apart whatever the
 * engine's rounding, routing weights like 0.7 / 0.3 for the top two, and each layer
 * routing a token to different experts (perm_l differs per layer).
 *
 * DeepSeek-V3-style routing (moe_v3 architectures): sigmoid gating with expert_weights_norm
 * true, the shape's scale, shared expert count, leading dense layers (their dense
 * ffn_down also leaves the reserved coordinates alone) and expert groups. The selection
 * bias exp_probs_b keeps routing decided by wide margins: expert e's bias is 2 u_e with an
 * integer u_e, so selection is by u first and by the probability (in (0, 1)) within equal
 * u. Without groups u_e is 1 for half the experts (a permutation per layer), else 0. With
 * groups, group g's experts all have u = its rank r_g (a permutation per layer), so the
 * groups' top-2 sums are 4 r_g apart; one "decoy" group of the lowest rank gives its first
 * expert u = n_group (the best score of all) and the others u = -2 n_group, so its top-2
 * sum is last and the decoy is chosen only if groups were not applied; and the best group's
 * experts past its first two get u = -2 n_group, so it ranks first by its top-2 sum but
 * would rank last by the sum of all its scores.
 *
 * NextN (glm4moe): n_nextn blocks after the n_layers, each a MoE layer's tensors and
 * model/nextn.h's, block_count n_layers + n_nextn. A shape's rope_dim < head width writes
 * a partial rotary rope.dimension_count.
 *
 * Types: a matrix whose ne[0] is not a multiple of the chosen type's block (e.g. dim 64 for
 * Q4_K's 256-element blocks) falls back to Q8_0, or to F16 if ne[0] is not a multiple of 32.
 *
 * Built-in vocabulary (no --vocab): SentencePiece-style, tokenizer.ggml.model "llama":
 *   0 <unk> (type 2), 1 <s>, 2 </s> (type 3), 3..258 the byte tokens <0x00>..<0xFF>
 *   (type 6), then normal pieces (type 1) with decreasing scores: "▁" (U+2581) and the
 *   printable ASCII characters, common English words with "▁" and all their prefixes,
 *   then letter bigrams, "▁"+bigram, trigrams and so on until the vocab size is reached.
 * Every piece is reachable by pairwise merges (its prefixes come first), and byte fallback
 * covers everything else, so the SPM tokenizer round-trips any text. The built-in vocab
 * takes sizes 260 (specials, bytes and "▁") to 500000.
 *
 * Threads: kvr_synth_write generates each tensor's rows on n_threads threads (its own
 * pool) while the caller's thread writes; the result does not depend on n_threads. */
#ifndef KVR_MODEL_SYNTH_H
#define KVR_MODEL_SYNTH_H

#include "core/err.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/gguf_write.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

struct kvr_synth_shape {
    char name[32];     /* the shape's name, used in general.name */
    int n_layers;      /* transformer blocks */
    int dim;           /* embedding width (n_heads * head_dim) */
    int ff;            /* feed-forward hidden width */
    int n_heads;       /* query heads */
    int n_kv_heads;    /* key/value heads (divides n_heads) */
    int vocab_size;    /* ignored when a vocab file is given */
    int ctx;           /* llama.context_length */
    float rope_base;   /* llama.rope.freq_base */
    float rms_eps;     /* llama.attention.layer_norm_rms_epsilon */
    int head_dim;      /* 0: dim / n_heads; else attention.key_length (q width n_heads x it) */
    int n_swa;         /* attention.sliding_window (0: none), for architectures that slide */
    int n_expert;      /* mixture of experts: experts per layer (0: a dense feed-forward) */
    int n_expert_used; /* experts per token row */
    int expert_ff;     /* one expert's hidden width (0: ff); llama files use ff */
    int shared_ff;     /* qwen2moe's shared expert width (0: expert_ff) */
    /* DeepSeek-V3-style routing (architectures with moe_v3: model/moe_route.h) */
    int n_shared_exp; /* expert_shared_count (0: none) */
    int n_dense_lead; /* leading_dense_block_count */
    int n_group;      /* expert_group_count (0: no groups) */
    int n_group_used; /* expert_group_used_count */
    float w_scale;    /* expert_weights_scale (0: 1) */
    int rope_dim;     /* rope.dimension_count (0: the head width; less: partial rotary) */
    int n_nextn;      /* NextN blocks after the n_layers (glm4moe's nextn_predict_layers) */
    /* Latent attention (deepseek2, model/mla.h); zeros take the defaults kv_lora dim / 2,
     * qk_nope and v_head the head width (dim / heads), qk_rope half of it. */
    int q_lora;  /* attention.q_lora_rank; 0: a plain attn_q */
    int kv_lora; /* attention.kv_lora_rank */
    int qk_rope, qk_nope, v_head;
};

/* Named shapes:
 *   tinyllama-1.1b  22 layers, dim 2048, ff 5632, 32/4 heads, vocab 32000, ctx 2048
 *   ring-45         45 layers, dim 256, ff 768, 8/4 heads, vocab 4096, ctx 2048 (deep and
 *                   narrow: many layers to split across ring stages, cheap per layer; the
 *                   4096-piece vocab lets the built-in tokenizer merge real words)
 *   tiny            4 layers, dim 64, ff 192, 4/2 heads, vocab 512, ctx 512 (fast tests)
 *   deepseek-v2-lite  DeepSeek-V2-Lite's: 27 layers, dim 2048, ff 10944, 16 heads, latent
 *                   512, rope 64, nope 128, value 128, no q_lora, vocab 102400, ctx 32768,
 *                   64 experts of width 1408, top-6, 2 shared, 1 leading dense layer (for
 *                   --arch deepseek2; V3-style routing, synth's only)
 *   glm4.5-air-lite GLM-4.5-Air's layout at a sixth of its depth and a quarter of its width
 *                   (--arch glm4moe): 16 layers + 1 NextN, dim 1024, 16/2 heads of 128 with
 *                   RoPE on 64, 1 dense layer (ff 2816), 64 experts of 352 top-8 + 1
 *                   shared, vocab 32000, rope base 1e6
 * The others use rope base 10000; rms epsilon 1e-5 (deepseek-v2-lite 1e-6). KVR_ENOTFOUND for an
 * unknown name. */
int kvr_synth_shape_by_name(const char *name, struct kvr_synth_shape *out);
/* Name of the i-th named shape, NULL past the end (for --help). */
const char *kvr_synth_shape_name(int i);

struct kvr_synth_opts {
    struct kvr_synth_shape shape;
    const struct kvr_arch *arch; /* NULL: llama */
    float logit_scale;           /* 0: 1 */
    bool tied;                   /* no output.weight: the head reads token_embd */
    bool rope_freqs;             /* llama: write rope_freqs.weight (Llama 3.1 factors) */
    float rope_scale;            /* llama: linear rope scaling factor (0 or 1: none) */
    bool qk_norm;                /* write the optional per-head q/k norms (glm4moe) */
    int type;                    /* enum kvr_dtype of the matrices: F32, F16, Q8_0, Q4_0,
                                    Q4_K (or any type with from_float) */
    uint64_t seed;
    const struct kvr_gguf *vocab;  /* optional, borrowed: copy its tokenizer.* keys */
    int n_threads;                 /* >= 1 */
    kvr_gguf_progress_fn progress; /* optional: called after each tensor is written */
    void *progress_ctx;
    bool kv_b_fused;    /* deepseek2: the older fused attn_kv_b instead of attn_k_b/v_b */
    float yarn_factor;  /* deepseek2: YaRN scaling by this factor (0 or 1: none), from an
                           original context of ctx / factor */
    float yarn_log_mul; /* and its rope.scaling.yarn_log_multiplier */
};

struct kvr_synth_stats {
    uint64_t n_params; /* elements of all tensors */
    uint64_t n_tensors;
    uint64_t file_bytes;
    int vocab_size;
};

/* Check the shape (positive sizes, heads divide dim unless head_dim is given, kv heads
 * divide heads, even head dim, sizes small enough for 32-bit counts) with a message naming
 * the bad field. */
int kvr_synth_check_shape(const struct kvr_synth_shape *s, struct kvr_err *err);

/* Write the model to f (from its current position). stats may be NULL. */
int kvr_synth_write(const struct kvr_synth_opts *opts, FILE *f, struct kvr_synth_stats *stats,
                    struct kvr_err *err);

/* The float values (before quantization) of row `row` of tensor `name` as kvr_synth_write
 * generates them for these options: ne[0] floats into dst. KVR_ENOTFOUND if the shape has
 * no such tensor, KVR_ERANGE if row is out of range. */
int kvr_synth_row(const struct kvr_synth_opts *opts, const char *name, int64_t row, float *dst);

#endif
