/* generation.h - one text generation, from an OpenAI request body to the bytes of its answer.
 *
 * The steps, in order: parse the body (openai.c), render a chat with the server's template
 * (chat.c), tokenize the prompt, check its length, submit it to the service (service.h);
 * then run each event the service sends through the detokenizer, the stop-string cutter
 * and the logprobs, into one JSON body or a series of SSE chunks.
 *
 * No sockets and no libmicrohttpd here: http.c owns the connection and drives a generation
 * through these calls:
 *
 *   kvr_generation_create    an empty generation
 *   kvr_generation_prepare   parse .. build the service's request; or the client's error
 *   kvr_generation_submit    admitted; or refused, with the error and a Retry-After
 *   until kvr_generation_done, between checks of the client socket and of shutdown:
 *       kvr_generation_pump       wait (at most timeout_ms) for one event, run it through
 *       kvr_generation_shut_down  the server is stopping: end with a 503
 *       kvr_generation_abandon    the client went away
 *   the answer: kvr_generation_error or kvr_generation_json (whole), or
 *               kvr_generation_sse_read (streaming: each pump adds SSE chunks)
 *   kvr_generation_destroy   cancel and release the stream, count how it ended, and log
 *                            the request's access line (docs/API.md, "Access log")
 *
 * Threads: one generation is used by one thread at a time (its connection's thread, which
 * for a stream is the one libmicrohttpd calls the content reader on). The env is shared by
 * all generations and read-only (the metrics lock themselves). */
#ifndef KVR_BRIDGE_GENERATION_H
#define KVR_BRIDGE_GENERATION_H

#include "bridge/chat.h"
#include "bridge/http_metrics.h"
#include "bridge/openai.h"
#include "bridge/service.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What every generation of one server uses. All borrowed; they outlive the generations. */
struct kvr_generation_env {
    const struct kvr_service *svc;
    const struct kvr_chat *chat;
    const char *bos_text; /* the BOS token's text, or NULL */
    int32_t n_vocab;
    size_t max_piece_bytes;      /* the longest text one token stands for, >= 1 */
    uint32_t stall_timeout_ms;   /* no event for this long fails with 504; 0 = never */
    uint32_t default_max_tokens; /* without max_tokens (kvr_openai_check_length) */
    struct kvr_http_metrics *metrics;
};

struct kvr_generation;

/* A generation of `api` for a request that arrived at t_start_ns (kvr_now_ns): the start of
 * its latency metrics. NULL when out of memory. */
struct kvr_generation *kvr_generation_create(const struct kvr_generation_env *env,
                                             enum kvr_openai_api api, uint64_t t_start_ns);

/* Everything up to submit: parse `len` bytes of `body`, apply the X-Latency-Budget-Ms
 * header's value (NULL when absent), render and tokenize the prompt, check its length and
 * the sampling parameters, and set up the text pipeline. Returns 0, or a negative status
 * with `e` filled with what to answer (400 for the client's mistakes, 500 otherwise). */
int kvr_generation_prepare(struct kvr_generation *g, const char *body, size_t len,
                           const char *budget_header, struct kvr_openai_error *e);

/* Hand the prepared request to the service. Returns 0 when admitted. When refused, returns
 * the service's negative status with `e` filled (429, 503, 400 or 500 by the refusal's
 * reason) and *retry_after_s set (0: send no Retry-After). */
int kvr_generation_submit(struct kvr_generation *g, struct kvr_openai_error *e,
                          uint32_t *retry_after_s);

/* The client asked for SSE ("stream": true). */
bool kvr_generation_streams(const struct kvr_generation *g);
/* Finished, failed or abandoned: no more events are wanted. */
bool kvr_generation_done(const struct kvr_generation *g);

/* Wait up to timeout_ms for the service's next event and run it through the pipeline
 * (text, stop strings, logprobs, metrics; SSE chunks when streaming). A generation with no
 * event for stall_timeout_ms fails with 504. Returns whether anything happened (an event,
 * or the end) rather than a quiet timeout. */
bool kvr_generation_pump(struct kvr_generation *g, uint32_t timeout_ms);
/* The server is stopping: cancel, and fail with 503 "shutting_down" (streaming: an error
 * event, then [DONE]). */
void kvr_generation_shut_down(struct kvr_generation *g);
/* The client went away: cancel, and count the generation as client_gone. */
void kvr_generation_abandon(struct kvr_generation *g);

/* After done, not streaming: the error to answer with, or NULL when it finished. */
const struct kvr_openai_error *kvr_generation_error(const struct kvr_generation *g);
/* After done without an error, not streaming: the whole response body (kvr_free), or NULL
 * when out of memory. */
char *kvr_generation_json(struct kvr_generation *g, size_t *out_len);

/* What kvr_generation_sse_read has for the response. */
enum kvr_generation_sse {
    KVR_GENERATION_SSE_BYTES,  /* *out_n > 0 bytes were copied */
    KVR_GENERATION_SSE_EMPTY,  /* nothing to send yet: pump (or check the client) */
    KVR_GENERATION_SSE_END,    /* everything up to [DONE] was sent: end the response */
    KVR_GENERATION_SSE_BROKEN, /* out of memory building the chunks: end with an error */
    KVR_GENERATION_SSE_COUNT
};

/* Streaming: copy up to `max` bytes of the SSE chunks not yet sent into `buf`. */
enum kvr_generation_sse kvr_generation_sse_read(struct kvr_generation *g, char *buf, size_t max,
                                                size_t *out_n);

/* Cancel and release the stream if it was admitted (one not done counts as client_gone),
 * record how it ended, log one access line at info level for a generation that was
 * prepared (answered, failed, refused or invalid), free everything. NULL is allowed. */
void kvr_generation_destroy(struct kvr_generation *g);

/* After a successful submit: admission's estimate of the answer (service.h estimate), for
 * the console's headers. False when the service gives none. */
bool kvr_generation_estimate(const struct kvr_generation *g, double *first_ms, double *total_ms,
                             uint64_t *request_id);

/* Before prepare: answer in the Responses API's shapes (responses.h) rather than chat's;
 * `store` (borrowed, may be NULL) keeps finished answers for previous_response_id. */
struct kvr_responses_store;
void kvr_generation_use_responses(struct kvr_generation *g, struct kvr_responses_store *store);

/* ---- n > 1 (choices.h) ---------------------------------------------------------------- */

/* Prepare choice `index` (1 .. n-1) of the request whose generation `first` was prepared
 * from the same body: the same parse, prompt ids (copied, not tokenized again), id and
 * creation time; the seed is first's + index. The choice is a part of the request: it
 * sends no usage or [DONE], and counts and logs nothing as a request (the request does).
 * `first` must stay prepared and unsubmitted while its choices are prepared. */
int kvr_generation_prepare_choice(struct kvr_generation *g, const struct kvr_generation *first,
                                  uint32_t index, const char *body, size_t len,
                                  const char *budget_header, struct kvr_openai_error *e);
/* A choice shares the prompt of `lead` (choice 0, submitted first): submit passes lead's
 * stream as the request's same_prompt_as (request.h). */
void kvr_generation_follow(struct kvr_generation *g, const struct kvr_generation *lead);
/* Tokens the service sent so far (usage's completion_tokens). */
uint32_t kvr_generation_completion_tokens(const struct kvr_generation *g);
/* Add a finished choice's account to the request's generation `g` before the choice is
 * destroyed: its tokens, its first token's time, and its outcome when worse than g's
 * (error, then client gone, then length, then stop). */
void kvr_generation_absorb(struct kvr_generation *g, const struct kvr_generation *choice);

/* Format a chat request's conversation, with its tools, with the server's chat template
 * (also POST /apply-template). A template that refuses the conversation (raise_exception)
 * or fails on it is the client's 400, with the template's message. *out is kvr_malloc'd. */
int kvr_generation_render_chat(const struct kvr_generation_env *env, const struct kvr_openai_req *r,
                               char **out, size_t *out_len, struct kvr_openai_error *e);

#endif
