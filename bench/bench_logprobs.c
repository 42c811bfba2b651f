/* bench_logprobs.c - what logprobs cost the tail per sampled token (src/model/logprobs.h):
 * kvr_logprobs_top over one logits row with 0 and 20 alternatives, beside the sampler's own
 * cost on the same row (kvr_sampler_sample at OpenAI's defaults: temperature 1, no top-k or
 * top-p, so it softmaxes the whole row, and at llama.cpp's defaults: top-k 40 first).
 * Rows are random logits of each vocabulary size. Times are process CPU time per row (one
 * thread: a loaded machine slows the wall clock, not this), median of --reps repeats
 * (default 9) of enough rows to take ~20 ms.
 *   bench_logprobs [--reps N] [--vocab 32000,128256,151936] */
#include "core/rng.h"
#include "model/logprobs.h"
#include "model/sampler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_LIST = 8, N_KINDS = 4 };

static double cpu_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One call of kind k on the row: 0 top-0, 1 top-20, 2 sampler (OpenAI), 3 sampler (llama.cpp). */
static void call(int k, const float *row, int32_t n, struct kvr_sampler *sm,
                 struct kvr_sample_scratch *sc)
{
    struct kvr_token_logprob top[KVR_LOGPROBS_MAX_TOP];
    double lse;
    if (k < 2 && kvr_logprobs_top(row, n, k ? KVR_LOGPROBS_MAX_TOP : 0, top, &lse) < 0)
        abort();
    if (k >= 2 && kvr_sampler_sample(&sm[k - 2], row, n, sc, NULL) < 0)
        abort();
}

int main(int argc, char **argv)
{
    int32_t vocab[MAX_LIST] = {32000, 128256, 151936};
    int n_vocab = 3, reps = 9;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--reps")) {
            reps = atoi(argv[i + 1]);
        } else if (!strcmp(argv[i], "--vocab")) {
            n_vocab = 0;
            for (char *s = argv[i + 1], *end; *s && n_vocab < MAX_LIST; s = *end ? end + 1 : end) {
                vocab[n_vocab++] = (int32_t)strtol(s, &end, 10);
                if (end == s || vocab[n_vocab - 1] < 2)
                    return fprintf(stderr, "bench_logprobs: bad --vocab\n"), 2;
            }
        } else {
            reps = 0;
        }
    }
    if (reps < 1 || reps > 99 || n_vocab < 1)
        return fprintf(stderr, "usage: bench_logprobs [--reps N] [--vocab A,B]\n"), 2;
    static const char *const names[N_KINDS] = {"top 0", "top 20", "sampler oai", "sampler lcpp"};
    printf("%8s %12s %12s %12s %12s   (us per row, CPU time)\n", "vocab", names[0], names[1],
           names[2], names[3]);
    for (int v = 0; v < n_vocab; v++) {
        int32_t n = vocab[v];
        float *row = malloc((size_t)n * sizeof *row);
        struct kvr_sample_scratch *sc = NULL;
        struct kvr_sampler sm[2];
        struct kvr_sample_params p[2];
        if (!row || kvr_sample_scratch_create(&sc, n))
            return 1;
        uint64_t rng[4];
        kvr_xoshiro_seed(rng, 1);
        for (int32_t i = 0; i < n; i++) /* a peaked row, as a trained model's */
            row[i] = (float)((double)(kvr_xoshiro_next(rng) >> 11) * 0x1p-53 * 12.0) - 6.0f +
                     (i % 97 == 0 ? 8.0f : 0.0f);
        kvr_sample_params_default(&p[1]);
        p[0] = p[1];
        p[0].temperature = 1.0f, p[0].top_k = 0, p[0].top_p = 1.0f, p[0].min_p = 0.0f;
        for (int s = 0; s < 2; s++)
            if (kvr_sampler_init(&sm[s], &p[s], NULL))
                return 1;
        printf("%8d", n);
        for (int k = 0; k < N_KINDS; k++) {
            double t0 = cpu_ns(), med[99];
            call(k, row, n, sm, sc);
            double one = cpu_ns() - t0;
            int per = one > 2e7 ? 1 : (int)(2e7 / (one > 1 ? one : 1)); /* ~20 ms a repeat */
            for (int r = 0; r < reps; r++) {
                double a = cpu_ns();
                for (int c = 0; c < per; c++)
                    call(k, row, n, sm, sc);
                med[r] = (cpu_ns() - a) / per / 1e3;
            }
            qsort(med, (size_t)reps, sizeof *med, cmp_double);
            printf(" %12.1f", med[reps / 2]);
        }
        printf("\n");
        kvr_sample_scratch_destroy(sc);
        free(row);
    }
    return 0;
}
