/* multiturn.h - the runner behind `kvasir bench --multi-turn`: chat-like conversations
 * against a server, to measure what a prefix cache saves.
 *
 * Every conversation is one thread. Turn t sends, as a completion prompt, the shared system
 * prompt, then every earlier user turn and the answer it got, then a new user turn; so each
 * prompt starts with the previous one, and a server with a prefix cache computes only what
 * is new. Words are drawn from the seed (the same run on every machine). TTFT is the time
 * from sending to the first SSE chunk with text. Conversations start together.
 *
 * Ownership: the spec is the caller's; a result's arrays are allocated here and freed by
 * kvr_multiturn_result_fini. Threads: one caller; the runner starts one thread per
 * conversation and joins them all before it returns. Nothing here prints. */
#ifndef KVR_CLIENT_MULTITURN_H
#define KVR_CLIENT_MULTITURN_H

#include "client/httpc.h"

#include <stdbool.h>
#include <stdint.h>

struct kvr_multiturn_spec {
    const struct kvr_httpc_url *url;
    const char *api_key, *model;
    uint32_t n_conversations, n_turns;
    uint32_t system_words;     /* the shared system prompt */
    uint32_t turn_lo, turn_hi; /* words a user turn adds, uniform */
    uint32_t output_tokens;    /* max_tokens of each answer (ignore_eos) */
    uint64_t seed;
    uint32_t timeout_s;
    /* Called from a conversation's thread when a request fails (several may call at once):
     * the HTTP status (0 if none), the client's error message ("" if the exchange itself
     * worked) and the response body ("" if none). NULL for none. */
    void (*on_failure)(void *ud, int status, const char *msg, const char *body);
    void *ud;
};

/* What one conversation saw; a failed one stopped at its first failed turn. */
struct kvr_multiturn_conv {
    double *ttft_s;          /* [n_turns] seconds */
    uint32_t *prompt_tokens; /* [n_turns] as the server counted them (0 if it did not say) */
    bool failed;
};

struct kvr_multiturn_result {
    struct kvr_multiturn_conv *conv; /* [n_conversations]; the first n_started ran */
    uint32_t n_started;
    double wall_s; /* first send to the last answer */
    /* kvasir:prompt_tokens_computed_total from /metrics before and after, or -1 when the
     * server does not export it. */
    double computed_before, computed_after;
};

/* Run every conversation to its end. Returns 0 (some may still have failed: see each
 * conversation and n_started), or KVR_ENOMEM before anything was sent. */
int kvr_multiturn_run(const struct kvr_multiturn_spec *spec, struct kvr_multiturn_result *res);
void kvr_multiturn_result_fini(struct kvr_multiturn_result *res, uint32_t n_conversations);

#endif
