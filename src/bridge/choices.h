/* choices.h - the n > 1 choices of one generation request (OpenAI's "n").
 *
 * Each choice is a generation of its own (kvr_generation_prepare_choice), parsed from the
 * same body, with the same prompt ids and response id. Seeds: choice i samples with the
 * request's seed + i (the client's "seed", or the one drawn for the request), so one seed
 * reproduces all n choices, and choice 0 is what the same request with n = 1 gives.
 *
 * The prompt is computed once: choice 0 is submitted first and choices 1..n-1 name it as
 * same_prompt_as (request.h), so the scheduler starts them only once choice 0's prompt has
 * all gone into the ring, and they map the prompt's whole KV blocks from the prefix cache
 * (kvpool.h). Each choice still computes the prompt's last partial block, fewer than
 * kv_block_tokens positions (and at least the last token, whose logits it samples its
 * first token from). With the prefix cache off (--no-prefix-cache) every choice computes
 * the whole prompt.
 *
 * Admission is all or none: a refused choice cancels the ones admitted before it and the
 * request is refused with its reason. A client that goes away, a shutdown, or one choice
 * that fails ends them all. Answers: one JSON body whose choices[] are the n choices in
 * index order, usage counting the prompt once and every choice's completion tokens; or
 * SSE: each choice's chunks with its "index", as they come, then one usage chunk (when
 * asked for) and one [DONE].
 *
 * Ownership: the request's generation owns its kvr_choices (created by its prepare, freed
 * by its destroy), which owns the choices' generations. Threads: as generation.h. */
#ifndef KVR_BRIDGE_CHOICES_H
#define KVR_BRIDGE_CHOICES_H

#include "bridge/generation.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvr_choices;

/* Prepare the n (2 ..= KVR_OPENAI_MAX_N) choices of the request whose generation `first`
 * (of `api`, arrived at t_start_ns) was just prepared from `body`. 0, or a negative status
 * with e filled. */
int kvr_choices_create(struct kvr_choices **out, const struct kvr_generation_env *env,
                       enum kvr_openai_api api, uint64_t t_start_ns,
                       const struct kvr_generation *first, uint32_t n, const char *body, size_t len,
                       const char *budget_header, struct kvr_openai_error *e);
/* Submit every choice, choice 0 first; all or none (as kvr_generation_submit). */
int kvr_choices_submit(struct kvr_choices *c, struct kvr_openai_error *e, uint32_t *retry_after_s);
bool kvr_choices_done(const struct kvr_choices *c);
/* Run events of any choice for up to timeout_ms (in turns of a few ms between choices:
 * the service has one stream per choice). Returns whether anything happened. */
bool kvr_choices_pump(struct kvr_choices *c, uint32_t timeout_ms);
void kvr_choices_shut_down(struct kvr_choices *c);
void kvr_choices_abandon(struct kvr_choices *c);
/* The first failed choice's error, or NULL. */
const struct kvr_openai_error *kvr_choices_error(const struct kvr_choices *c);
/* The whole response body (kvr_free), or NULL when out of memory. */
char *kvr_choices_json(const struct kvr_choices *c, uint32_t prompt_tokens, size_t *out_len);
/* Streaming: the choices' chunks, whole events at a time, then usage (with the request's
 * meta m) and [DONE]. */
enum kvr_generation_sse kvr_choices_sse_read(struct kvr_choices *c, const struct kvr_openai_meta *m,
                                             uint32_t prompt_tokens, char *buf, size_t max,
                                             size_t *out_n);
/* Choice 0's estimate (generation.h). */
bool kvr_choices_estimate(const struct kvr_choices *c, double *first_ms, double *total_ms,
                          uint64_t *request_id);
/* Destroy the choices after adding each one's account to the request's generation. */
void kvr_choices_destroy(struct kvr_choices *c, struct kvr_generation *request);

#endif
