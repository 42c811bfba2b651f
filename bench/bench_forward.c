/* bench_forward.c - prefill and decode tokens/s of the single-process engine on a model
 * file, and the fraction of the memory-bandwidth bound that decode reaches.
 *
 *   bench_forward MODEL [--threads 2] [--prompt 128] [--decode 64] [--reps 3]
 *                       [--bandwidth GBPS] [--fresh-decode 0|1]
 *
 * Each repeat prefills a fresh sequence of `prompt` tokens in one forward pass (one
 * 128-row batch, the blocked matrix-matrix path) and then decodes `decode` tokens one at a
 * time (greedy). The median of the repeats is reported, with every repeat's number. With
 * --fresh-decode 1 the decode starts a new sequence at position 0 (from the prefill's
 * greedy token), as llama-bench's tg test does: its attention then covers 1..decode
 * positions instead of prompt+1..prompt+decode.
 *
 * Decode reads every weight once per token, so tokens/s <= bandwidth / bytes per token.
 * Bytes per token = every tensor of the model except the token embedding, of which only
 * one row is read (unless the output head is tied to it, then all of it), and of a
 * mixture's experts only the k a token uses. Give the
 * machine's read bandwidth (bench_bandwidth --threads N, same N) with --bandwidth to get
 * the fraction; bench/forward.sh does both. */
#include "core/alloc.h"
#include "core/clock.h"
#include "model/dtype.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "smaps.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Weight bytes one decoded token reads: every tensor, except that of the token embedding
 * only one row is read (unless the head is tied to it), of a mixture's expert tensors
 * (`*_exps`, all experts of a layer in one tensor) only the k of n experts a row uses, and
 * none of the blocks past the last layer the forward runs (glm4moe's NextN block). */
static double bytes_per_token(const struct kvr_gguf *g, const struct kvr_hparams *hp)
{
    double sum = 0;
    bool tied = kvr_gguf_find_tensor(g, "output.weight") == NULL;
    for (int64_t i = 0; i < kvr_gguf_n_tensors(g); i++) {
        const struct kvr_gguf_tensor *t = kvr_gguf_tensor(g, i);
        unsigned blk;
        if (sscanf(t->name, "blk.%u.", &blk) == 1 && blk >= hp->n_layer)
            continue;
        if (!strcmp(t->name, "token_embd.weight") && !tied)
            sum += (double)t->n_bytes / (double)t->ne[1];
        else if (strstr(t->name, "_exps") && hp->moe.n_expert)
            sum += (double)t->n_bytes * hp->moe.n_used / hp->moe.n_expert;
        else
            sum += (double)t->n_bytes;
    }
    return sum;
}

/* The model layer's options from the environment (KVR_ISA, KVR_PREFETCH, KVR_NO_PACK), read
 * as kvasir reads them: the model reads none. */
static void configure_model(void)
{
    const char *no_pack = getenv("KVR_NO_PACK");
    struct kvr_model_options o = {
        .kernels = {.isa = getenv("KVR_ISA"), .prefetch = getenv("KVR_PREFETCH")},
        .no_pack = no_pack && !strcmp(no_pack, "1"),
    };
    kvr_model_configure(&o);
}

int main(int argc, char **argv)
{
    configure_model();
    if (argc < 2 || argv[1][0] == '-') {
        fprintf(stderr, "usage: bench_forward MODEL [--threads N] [--prompt N] [--decode N] "
                        "[--reps N] [--bandwidth GBPS] [--fresh-decode 0|1]\n");
        return 2;
    }
    const char *path = argv[1];
    long threads = 2, n_prompt = 128, n_decode = 64, reps = 3;
    double bandwidth = 0;
    long fresh = 0;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads"))
            threads = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--prompt"))
            n_prompt = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--decode"))
            n_decode = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps"))
            reps = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--bandwidth"))
            bandwidth = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--fresh-decode"))
            fresh = atol(argv[i + 1]);
        else {
            fprintf(stderr, "bench_forward: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (threads < 1 || n_prompt < 1 || n_decode < 1 || reps < 1 || reps > 100 || n_prompt > 4096 ||
        n_decode > 4096 || fresh < 0 || fresh > 1) {
        fprintf(stderr, "bench_forward: bad option value\n");
        return 2;
    }
    struct kvr_err err = {0};
    struct kvr_gguf *g = NULL;
    if (kvr_gguf_open(&g, path, &err)) {
        fprintf(stderr, "bench_forward: %s: %s\n", path, err.msg);
        return 1;
    }
    struct kvr_hparams hp;
    if (kvr_hparams_read(&hp, g, &err)) {
        fprintf(stderr, "bench_forward: %s\n", err.msg);
        return 1;
    }
    struct kvr_engine_config cfg = {.first_layer = 0,
                                    .last_layer = hp.n_layer - 1,
                                    .max_rows = (uint32_t)n_prompt,
                                    .max_seqs = 1,
                                    .n_ctx = (uint32_t)(n_prompt + n_decode),
                                    .kv_block_tokens = 16,
                                    .n_threads = (uint32_t)threads};
    struct kvr_engine *e = NULL;
    if (kvr_engine_create(&e, g, &cfg, &err)) {
        fprintf(stderr, "bench_forward: %s\n", err.msg);
        return 1;
    }
    int32_t *tokens = kvr_calloc((size_t)n_prompt, sizeof *tokens);
    float *logits = kvr_malloc((size_t)hp.n_vocab * sizeof(float));
    double *prefill = kvr_calloc((size_t)reps, sizeof(double));
    double *decode = kvr_calloc((size_t)reps, sizeof(double));
    double *step_ms = kvr_calloc((size_t)(reps * n_decode), sizeof(double)); /* every token */
    if (!tokens || !logits || !prefill || !decode || !step_ms)
        return 1;
    double bpt = bytes_per_token(g, &hp);
    printf("model %s: %u layers, dim %u, vocab %u, %.1f MB read per decoded token, %s "
           "kernels, %ld threads\n",
           path, hp.n_layer, hp.n_embd, hp.n_vocab, bpt / 1e6, kvr_kernels_name(), threads);

    /* One untimed pass pages the weights in from the file. */
    for (long r = -1; r < reps; r++) {
        for (long i = 0; i < n_prompt; i++)
            tokens[i] = (int32_t)(((uint64_t)i * 7919 + (uint64_t)(r + 1) * 31 + 11) % hp.n_vocab);
        struct kvr_seg seg = {0, 0, (uint32_t)n_prompt,
                              KVR_SEG_PREFILL | KVR_SEG_LAST_CHUNK | KVR_SEG_WANTS_TOKEN};
        uint64_t t0 = kvr_now_ns();
        if (kvr_engine_forward(e, &seg, 1, tokens, NULL, logits, &err)) {
            fprintf(stderr, "bench_forward: %s\n", err.msg);
            return 1;
        }
        uint64_t t1 = kvr_now_ns();
        uint32_t pos0 = (uint32_t)n_prompt;
        if (fresh) { /* inside the timed span, as llama-bench clears its cache before tg */
            kvr_engine_seq_free(e, 0);
            pos0 = 0;
        }
        for (long k = 0; k < n_decode; k++) {
            int32_t best = 0;
            for (uint32_t v = 1; v < hp.n_vocab; v++)
                if (logits[v] > logits[best])
                    best = (int32_t)v;
            struct kvr_seg d = {0, pos0 + (uint32_t)k, 1, KVR_SEG_DECODE | KVR_SEG_WANTS_TOKEN};
            uint64_t ts = kvr_now_ns();
            if (kvr_engine_forward(e, &d, 1, &best, NULL, logits, &err)) {
                fprintf(stderr, "bench_forward: %s\n", err.msg);
                return 1;
            }
            if (r >= 0)
                step_ms[r * n_decode + k] = (double)(kvr_now_ns() - ts) / 1e6;
        }
        uint64_t t2 = kvr_now_ns();
        kvr_engine_seq_free(e, 0);
        if (r < 0)
            continue;
        prefill[r] = n_prompt / ((t1 - t0) / 1e9);
        decode[r] = n_decode / ((t2 - t1) / 1e9);
        printf("  run %ld: prefill %ld tokens %.1f tokens/s, decode %ld tokens %.2f tokens/s\n",
               r + 1, n_prompt, prefill[r], n_decode, decode[r]);
        fflush(stdout);
    }
    long huge_mib = anon_huge_mib(); /* did the packed copy get huge pages? */
    if (huge_mib >= 0)
        printf("anonymous memory in huge pages: %ld MiB\n", huge_mib);
    double mp = median(prefill, (int)reps), md = median(decode, (int)reps);
    printf("median: prefill %.1f tokens/s, decode %.2f tokens/s (%.1f GB/s of weights)\n", mp, md,
           md * bpt / 1e9);
    /* Per token, over every repeat: on a machine whose speed moves from second to second,
     * the 10th percentile is the steadiest figure for comparing two builds. */
    size_t n_steps = (size_t)(reps * n_decode);
    qsort(step_ms, n_steps, sizeof *step_ms, cmp_double);
    printf("decode per token: p10 %.3f ms, p50 %.3f ms, p90 %.3f ms (%zu tokens)\n",
           step_ms[n_steps / 10], step_ms[n_steps / 2], step_ms[n_steps * 9 / 10], n_steps);
    if (bandwidth > 0)
        printf("bandwidth bound %.2f tokens/s at %.1f GB/s: decode reaches %.0f%%\n",
               bandwidth * 1e9 / bpt, bandwidth, 100.0 * md * bpt / (bandwidth * 1e9));
    kvr_engine_destroy(e);
    kvr_gguf_close(g);
    return 0;
}
