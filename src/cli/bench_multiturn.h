/* bench_multiturn.h - `kvasir bench --multi-turn`: chat-like conversations against a
 * server (client/multiturn.h), to measure what a prefix cache saves. */
#ifndef KVR_CLI_BENCH_MULTITURN_H
#define KVR_CLI_BENCH_MULTITURN_H

#include "client/multiturn.h"

/* Run it and print, per turn and for the later turns (2..n), TTFT p50/p90 and the prompt
 * tokens sent, and the prompt tokens the server computed (kvasir:prompt_tokens_computed_total
 * before and after). 0, or 1 when a request failed. The spec's failure hook is replaced by
 * one that prints. */
int kvr_bench_multiturn(const struct kvr_multiturn_spec *spec);

#endif
