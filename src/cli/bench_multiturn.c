/* bench_multiturn.c - `kvasir bench --multi-turn` (see bench_multiturn.h): runs the
 * conversations of client/multiturn.h and prints TTFT per turn and the prompt tokens the
 * server computed. */
#include "cli/bench_multiturn.h"

#include "client/multiturn.h"
#include "core/alloc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static void on_failure(void *ud, int status, const char *msg, const char *body)
{
    (void)ud;
    fprintf(stderr, "kvasir bench: multi-turn request failed: HTTP %d %s%.200s\n", status, msg,
            body);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double quantile(double *v, size_t n, double q)
{
    if (!n)
        return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

/* Per turn, TTFT p50/p90 over the conversations that did not fail and their mean prompt
 * tokens; returns the prompt tokens sent in all. */
static uint64_t print_turns(const struct kvr_multiturn_result *res, uint32_t nt, double *all,
                            bool *failed)
{
    uint64_t sent = 0;
    printf("turn  TTFT p50 ms  TTFT p90 ms  prompt tokens (mean)\n");
    for (uint32_t t = 0; t < nt; t++) {
        size_t n = 0;
        uint64_t tok = 0;
        for (uint32_t i = 0; i < res->n_started; i++) {
            *failed |= res->conv[i].failed;
            if (res->conv[i].failed)
                continue;
            all[n++] = res->conv[i].ttft_s[t];
            tok += res->conv[i].prompt_tokens[t];
        }
        sent += tok;
        double p50 = quantile(all, n, 0.5), p90 = quantile(all, n, 0.9);
        printf("%4u  %11.1f  %11.1f  %8.0f\n", t + 1, p50 * 1e3, p90 * 1e3,
               n ? (double)tok / n : 0.0);
    }
    return sent;
}

int kvr_bench_multiturn(const struct kvr_multiturn_spec *spec)
{
    struct kvr_multiturn_spec sp = *spec;
    sp.on_failure = on_failure;
    uint32_t nc = sp.n_conversations, nt = sp.n_turns;
    double *all = kvr_calloc((size_t)nc * nt, sizeof *all);
    struct kvr_multiturn_result res;
    if (!all || kvr_multiturn_run(&sp, &res)) {
        kvr_free(all);
        return 1;
    }
    bool failed = res.n_started < nc;
    printf("multi-turn: %u conversations x %u turns, system prompt %u words, turns %u-%u "
           "words, %u tokens per answer, %.1f s\n",
           nc, nt, sp.system_words, sp.turn_lo, sp.turn_hi, sp.output_tokens, res.wall_s);
    uint64_t sent = print_turns(&res, nt, all, &failed);
    size_t n = 0;
    for (uint32_t i = 0; i < res.n_started; i++)
        for (uint32_t t = 1; t < nt && !res.conv[i].failed; t++)
            all[n++] = res.conv[i].ttft_s[t];
    printf("later turns (2-%u): TTFT p50 %.1f ms, p90 %.1f ms\n", nt, quantile(all, n, 0.5) * 1e3,
           quantile(all, n, 0.9) * 1e3);
    double before = res.computed_before, after = res.computed_after;
    if (before >= 0 && after >= 0)
        printf("prompt tokens: %llu sent, %.0f computed by the server (%.1f%%)\n",
               (unsigned long long)sent, after - before,
               sent ? 100.0 * (after - before) / (double)sent : 0.0);
    else
        printf("prompt tokens: %llu sent (the server exports no "
               "kvasir:prompt_tokens_computed_total)\n",
               (unsigned long long)sent);
    kvr_multiturn_result_fini(&res, nc);
    kvr_free(all);
    return failed ? 1 : 0;
}
