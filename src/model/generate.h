/* generate.h - text generation in one process: prefill each prompt, then sample and decode
 * one token at a time, over the whole model in one engine (engine.h) with the sampler of
 * sampler.h. This is the single-process reference that `kvasir run -m` uses and that the
 * ring's results are compared against.
 *
 * Two schedules, with the same tokens for the same inputs:
 *   kvr_generate          one sequence after another, each alone in the engine; prompts in
 *                         chunks of the row width, then one decode row per pass
 *   kvr_generate_batched  every sequence at once: each pass carries one decode row per
 *                         running sequence and fills the rest of the row width with prefill
 *                         chunks (the bridge's packing with a single micro-batch)
 * A sequence ends after max_tokens tokens, or at an end-of-generation token unless
 * ignore_eos is set; the end token is kept in its output.
 *
 * Ownership: the model, tokenizer and sequences are the caller's; the engine, samplers and
 * scratch are made and freed inside each call. Nothing here reads the environment or
 * prints: tokens go to the optional on_token callback, timings to struct kvr_generate_stats,
 * failures to the err struct. Threads: one caller thread; the engine's pool computes. */
#ifndef KVR_MODEL_GENERATE_H
#define KVR_MODEL_GENERATE_H

#include "core/err.h"
#include "model/arch.h"
#include "model/dtype.h"
#include "model/gguf.h"
#include "model/grammar.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

#include <stdbool.h>
#include <stdint.h>

enum kvr_generate_end {
    KVR_GENERATE_RUNNING, /* not ended (or the call failed first) */
    KVR_GENERATE_LENGTH,  /* max_tokens reached */
    KVR_GENERATE_STOP,    /* an end-of-generation token */
    KVR_GENERATE_END_COUNT
};

/* One sequence: the caller fills the prompt, the limit and the sampling; the call fills
 * out[0..n_out) and finish. */
struct kvr_generate_seq {
    const int32_t *ids; /* prompt token ids, n_ids >= 1 */
    uint32_t n_ids;
    uint32_t max_tokens; /* tokens to generate, >= 1 */
    struct kvr_sample_params sp;
    const struct kvr_grammar *grammar; /* NULL, or the grammar the output follows (its
                                          logits masked before sampling, grammar.h) */
    int32_t *out;                      /* room for max_tokens ids */
    uint32_t n_out;
    enum kvr_generate_end finish;
};

struct kvr_generate_config {
    uint32_t n_ctx;     /* positions per sequence (enough for prompt + max_tokens) */
    uint32_t row_width; /* most token rows per forward pass */
    enum kvr_dtype kv_type;
    uint32_t n_threads;
    bool ignore_eos; /* keep going after an end-of-generation token */
};

/* Where the time went. kvr_generate fills the prefill and decode fields; kvr_generate_batched
 * fills n_tokens, n_passes and wall_ns. */
struct kvr_generate_stats {
    uint64_t n_prefill, prefill_ns; /* prompt tokens, and the time of their passes */
    uint64_t n_decode, decode_ns;   /* decode passes (one token each), and their time */
    uint64_t n_tokens;              /* tokens generated */
    uint64_t n_passes;              /* forward passes */
    uint64_t wall_ns;               /* first pass to last */
};

/* Called for every generated token, in order within a sequence (seq indexes the array). */
typedef void (*kvr_generate_token_fn)(void *ud, uint32_t seq, int32_t id);

/* hp is kvr_hparams_read of g; tok says which tokens end generation. Returns 0 or a
 * negative status with err filled (an allocation failure may leave err->msg empty). */
int kvr_generate(const struct kvr_gguf *g, const struct kvr_hparams *hp, const struct kvr_tok *tok,
                 const struct kvr_generate_config *cfg, struct kvr_generate_seq *seqs,
                 uint32_t n_seqs, kvr_generate_token_fn on_token, void *ud,
                 struct kvr_generate_stats *stats, struct kvr_err *err);

/* As kvr_generate, all sequences at once (one engine slot each). */
int kvr_generate_batched(const struct kvr_gguf *g, const struct kvr_hparams *hp,
                         const struct kvr_tok *tok, const struct kvr_generate_config *cfg,
                         struct kvr_generate_seq *seqs, uint32_t n_seqs,
                         kvr_generate_token_fn on_token, void *ud, struct kvr_generate_stats *stats,
                         struct kvr_err *err);

#endif
