/* request.h - what a client asks the bridge for, why it may be refused, and how its stream
 * ends: the one request, refusal and event type shared by the HTTP layer (service.h), the
 * bridge (bridge.h) and its scheduler (sched.h). Plain data, no functions. */
#ifndef KVR_BRIDGE_REQUEST_H
#define KVR_BRIDGE_REQUEST_H

#include "model/logprobs.h"
#include "model/sampler.h"

#include <stdbool.h>
#include <stdint.h>

/* One request. The HTTP layer has already checked that 1 <= n_prompt, 1 <= max_tokens and
 * n_prompt + max_tokens <= n_ctx, and that every prompt id is < the vocabulary size; the
 * bridge checks the context again (kvr_run and tests submit directly). */
struct kvr_gen_request {
    const int32_t *prompt; /* n_prompt token ids (BOS included when the model wants it);
                              borrowed for the call that takes the request */
    uint32_t n_prompt;
    uint32_t max_tokens;               /* generate at most this many tokens (EOS counts as one) */
    struct kvr_sample_params sampling; /* seed always set: the HTTP layer draws one when the
                                          client gave none */
    bool logprobs;                     /* fill the events' logprob */
    uint32_t top_logprobs;             /* ... and this many alternatives (model/logprobs.h),
                                          0 ..= KVR_LOGPROBS_MAX_TOP; only with logprobs */
    /* NULL, or an earlier admitted stream of the same prompt and service (the choices of
     * a request with n > 1): this one starts only once that one's prompt has all gone
     * into the ring, so its prompt's whole KV blocks come from the prefix cache and the
     * prompt is computed once. Borrowed for the call that takes the request. */
    struct kvr_gen_stream *same_prompt_as;
    bool ignore_eos;           /* an end-of-generation token does not end the stream: it comes
                                  as an ordinary token (FINISH_NONE) until max_tokens */
    const char *grammar;       /* GBNF (model/grammar.h) the tokens must follow, NULL: none; the
                                  HTTP layer compiled it once; the bridge keeps a copy */
    uint32_t grammar_bytes;    /* <= KVR_WIRE_GRAMMAR_MAX_TOTAL */
    uint32_t first_token_ms;   /* latency budget from submit to the first token; 0 = default
                                  (the service's) or none (the bridge's) */
    uint32_t total_ms;         /* ... from submit to the last token */
    const int32_t *prediction; /* n_prediction token ids of the client's expected output
                                  (OpenAI's `prediction`), drafted from (bridge/draft.h);
                                  borrowed like `prompt`; never drafted from with a grammar
                                  or alternatives */
    uint32_t n_prediction;
};

/* Why a request was refused at once (nothing is queued to be late). The HTTP layer answers
 * each with its own status and error code (generation.c refusal_answers: 429 for the budgets and
 * KV, 503 for the queue and the ring, 400 for TOO_LONG, 500 for INTERNAL). */
enum kvr_refusal_reason {
    KVR_REFUSE_NONE = 0,
    KVR_REFUSE_FIRST_TOKEN_BUDGET, /* the first token would come too late */
    KVR_REFUSE_TOTAL_BUDGET,       /* the answer would finish too late */
    KVR_REFUSE_KV_FULL,            /* the KV blocks it needs are not free */
    KVR_REFUSE_QUEUE_FULL,         /* the wait queue is full */
    KVR_REFUSE_TOO_LONG,           /* empty, or prompt + max_tokens beyond the context */
    KVR_REFUSE_RING_DOWN,          /* the ring is not connected */
    KVR_REFUSE_INTERNAL,           /* anything else (out of memory, ...) */
    KVR_REFUSE_REASON_COUNT
};

#define KVR_GEN_MSG_BYTES 256

struct kvr_refusal {
    enum kvr_refusal_reason reason;
    /* No retry can succeed: the request would miss its budget even alone on an idle ring,
     * needs more KV blocks than the ring has, or does not fit the context. Such a refusal
     * carries no retry hint, and the HTTP layer sends no Retry-After (a client that
     * retries would only be refused again). */
    bool never;
    uint32_t retry_after_ms; /* when to try again (0: no hint); sent as Retry-After */
    /* Shown to the client, e.g. "would miss first-token budget: estimated 812 ms > 500 ms",
     * "kv cache full: need 12 blocks, 3 free", "queue full (64 requests)". */
    char message[KVR_GEN_MSG_BYTES];
    /* Admission's estimates, filled whether the request was admitted or refused (0: none,
     * e.g. before the cost model is ready): the first token's time from submit and the
     * gap after it, so n tokens are estimated at est_first_ms + (n - 1) x est_period_ms.
     * The access log sets them beside what happened. */
    double est_first_ms;
    double est_period_ms;
};

/* How a stream ends; carried by its last event. */
enum kvr_gen_finish {
    KVR_GEN_FINISH_NONE,      /* a token; more will follow */
    KVR_GEN_FINISH_LENGTH,    /* the last token: max_tokens reached */
    KVR_GEN_FINISH_EOS,       /* the token is an end-of-generation token (kvr_tok_is_eog); it
                                 is counted but not shown */
    KVR_GEN_FINISH_ERROR,     /* no token; the request failed (the event's message says why) */
    KVR_GEN_FINISH_CANCELLED, /* the consumer cancelled it (the scheduler's: a stream's
                                 next() ends a cancelled stream with KVR_ECLOSED instead) */
    KVR_GEN_FINISH_COUNT
};

/* One event of a stream: a token, the end, or both (the last token carries LENGTH or
 * EOS). */
struct kvr_gen_event {
    int32_t token;  /* the generated token id; -1 when the event carries none (ERROR) */
    float logprob;  /* natural log of the token's probability under the model's own
                       distribution (model/logprobs.h); set only when the request asked for
                       logprobs */
    uint32_t n_top; /* alternatives in top[], <= the request's top_logprobs */
    struct kvr_token_logprob top[KVR_LOGPROBS_MAX_TOP]; /* most likely first */
    bool eog; /* the token ends generation in the model's vocabulary */
    enum kvr_gen_finish finish;
    uint64_t t_ns; /* when the bridge received it (kvr_now_ns); 0 from other services */
    /* FINISH_ERROR only: the HTTP status to report (500 internal, 503 ring lost and not
     * recovered, 504 the request could not finish within its total budget) and why. */
    int error_status;
    char error[KVR_GEN_MSG_BYTES];
};

#endif
