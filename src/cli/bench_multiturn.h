/* bench_multiturn.h - `kvasir bench --multi-turn`: chat-like conversations against a
 * server, to measure what a prefix cache saves (bench_multiturn.c). */
#ifndef KVR_CLI_BENCH_MULTITURN_H
#define KVR_CLI_BENCH_MULTITURN_H

#include "client/httpc.h"

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
};

/* Run it and print, per turn and for the later turns (2..n), TTFT p50/p90 and the prompt
 * tokens sent, and the prompt tokens the server computed (kvasir:prompt_tokens_computed_total
 * before and after). 0, or 1 when a request failed. */
int kvr_bench_multiturn(const struct kvr_multiturn_spec *spec);

#endif
