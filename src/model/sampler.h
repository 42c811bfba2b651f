/* sampler.h - choosing the next token from a row of logits.
 *
 * One struct kvr_sampler per sequence (the tail keeps it from the sequence's "open" record
 * to its "free"). It holds the sampling parameters, the sequence's own random generator and
 * the recent tokens that repetition penalties look at. Sampling runs this fixed chain,
 * the order of llama.cpp's default sampler chain:
 *
 *   0. logit bias   l[id] += bias for each of the sequence's (id, bias) pairs, as OpenAI's
 *                   logit_bias: -100 all but bans a token, +100 all but forces it
 *   1. penalties    over the last repeat_last_n accepted tokens, each distinct token t with
 *                   c occurrences there:  l = l > 0 ? l / repeat_penalty : l * repeat_penalty
 *                                         l -= c * frequency_penalty + presence_penalty
 *   2. top-k        keep the k largest logits (k <= 0: off)
 *   3. top-p        keep the smallest set of most likely tokens whose probabilities (softmax
 *                   at temperature 1 over what is left) add up to at least top_p (>= 1: off)
 *   4. min-p        keep tokens with probability >= min_p times the top one's, i.e. logit
 *                   >= max logit + ln(min_p) (<= 0: off)
 *   5. temperature  probabilities softmax(l / temperature) over what is left
 *   6. draw         one uniform number u in [0, 1) from the generator; the token is the
 *                   first whose cumulative probability exceeds u (candidates in the order
 *                   step 2/3 sorted them, else by id)
 *
 * temperature <= 0 means greedy: after the penalties, the largest logit wins (ties: the
 * lowest id) and no random number is drawn. Ties in sorting are always broken by lower id,
 * so the result is a pure function of (parameters, seed, accepted tokens, draws so far,
 * logits). Every non-greedy sample draws exactly one number, so a sequence's generator
 * state after n samples can be rebuilt by seeding and sampling again (or re-accepting
 * the same tokens, for the penalty window).
 *
 * Generator: xoshiro256** seeded by four successive outputs of splitmix64(seed). Floating
 * point: exp() from the C library in double precision; results are identical for one build
 * on one C library, which is what the ring needs (every stage runs the same binary).
 *
 * Memory: struct kvr_sampler is fixed-size and caller-owned (init/fini). Sampling works
 * in a struct kvr_sample_scratch sized for the vocabulary once; nothing is allocated per
 * call. Pure: no I/O, no globals. A sampler and a scratch belong to one thread at a time. */
#ifndef KVR_MODEL_SAMPLER_H
#define KVR_MODEL_SAMPLER_H

#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The penalty window's capacity: repeat_last_n may be at most this. */
#define KVR_SAMPLER_MAX_LAST_N 256
/* Logit biases one sequence may have. */
#define KVR_SAMPLER_MAX_BIAS 8

struct kvr_logit_bias {
    int32_t id; /* token id; ids at or past n_vocab are ignored when sampling */
    float bias; /* finite, [-100, 100] */
};

/* A sequence's sampling parameters: the one type from the API request to the sampler (a
 * ring's OPEN record carries it to the tail, all but the biases, which follow it). */
struct kvr_sample_params {
    float temperature;       /* <= 0: greedy */
    int32_t top_k;           /* <= 0: off */
    float top_p;             /* in (0, 1]; 1: off */
    float min_p;             /* in [0, 1]; 0: off */
    float repeat_penalty;    /* > 0; 1: off */
    float frequency_penalty; /* 0: off */
    float presence_penalty;  /* 0: off */
    int32_t repeat_last_n;   /* 0..KVR_SAMPLER_MAX_LAST_N accepted tokens; 0: off;
                                -1: KVR_SAMPLER_MAX_LAST_N */
    uint64_t seed;
    uint32_t n_bias; /* <= KVR_SAMPLER_MAX_BIAS; distinct ids */
    struct kvr_logit_bias bias[KVR_SAMPLER_MAX_BIAS];
};

/* llama.cpp's common defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, no
 * penalties, window 64; seed 0 (a fixed seed: callers choose one per request). */
void kvr_sample_params_default(struct kvr_sample_params *p);
/* KVR_EINVAL with a message naming the field for NaN or out-of-range values. */
int kvr_sample_params_check(const struct kvr_sample_params *p, struct kvr_err *err);

struct kvr_sampler {
    struct kvr_sample_params params;
    uint64_t rng[4];                        /* xoshiro256** state */
    uint64_t n_draws;                       /* random numbers drawn so far */
    int32_t recent[KVR_SAMPLER_MAX_LAST_N]; /* ring of accepted tokens */
    uint32_t n_recent;                      /* valid entries, <= KVR_SAMPLER_MAX_LAST_N */
    uint32_t head;                          /* next write position */
};

/* Checks the parameters (see kvr_sample_params_check) and seeds the generator. */
int kvr_sampler_init(struct kvr_sampler *s, const struct kvr_sample_params *p, struct kvr_err *err);
void kvr_sampler_fini(struct kvr_sampler *s);
/* Add a logit bias after init (how a ring's tail receives them, after the sequence's OPEN):
 * replaces the bias of the same id. KVR_EINVAL for a bias outside [-100, 100] or a
 * negative id, KVR_EFULL when KVR_SAMPLER_MAX_BIAS are set. */
int kvr_sampler_add_bias(struct kvr_sampler *s, int32_t id, float bias);
/* Record a token in the penalty window (generated tokens, and prompt tokens if they should
 * be penalised too). Sampling does not accept by itself. */
void kvr_sampler_accept(struct kvr_sampler *s, int32_t token);
/* The next random number in [0, 1) (what step 6 draws). */
double kvr_sampler_uniform(struct kvr_sampler *s);

/* Working memory for a vocabulary of n_vocab tokens (12 bytes per token). */
struct kvr_sample_scratch;
int kvr_sample_scratch_create(struct kvr_sample_scratch **out, int32_t n_vocab);
void kvr_sample_scratch_destroy(struct kvr_sample_scratch *sc);

/* A candidate that survived steps 1-4, with its step-5 probability. */
struct kvr_sample_cand {
    int32_t id;
    float logit; /* after penalties */
    float prob;  /* after truncation and temperature; the candidates' probs sum to 1 */
};

/* Run steps 1-5 on logits[0..n_vocab) and point *out at the surviving candidates (inside
 * the scratch, valid until its next use). Returns their count (>= 1), or KVR_EINVAL if
 * n_vocab exceeds the scratch or is < 1, or if no logit is finite. For greedy sampling
 * the one candidate is the argmax with prob 1. Does not draw. */
int32_t kvr_sampler_candidates(const struct kvr_sampler *s, const float *logits, int32_t n_vocab,
                               struct kvr_sample_scratch *sc, const struct kvr_sample_cand **out);

/* Choose a token (steps 1-6). `logits` is not modified. If logprob_out is non-NULL it
 * receives the chosen token's log-probability under the model's own distribution: the
 * log-softmax of the penalised logits over the whole vocabulary at temperature 1, before
 * truncation (defined for greedy too; the API reports model/logprobs.h's, before penalties).
 * Returns the token id, or KVR_EINVAL as kvr_sampler_candidates. */
int32_t kvr_sampler_sample(struct kvr_sampler *s, const float *logits, int32_t n_vocab,
                           struct kvr_sample_scratch *sc, float *logprob_out);

#endif
