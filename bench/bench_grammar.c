/* bench_grammar.c - what a grammar costs per token at the tail: the vocabulary trie's
 * build time, then the mask time per token while a random walk generates under a JSON
 * schema (or a GBNF file) with a real vocabulary.
 *
 *   bench_grammar VOCAB.gguf SCHEMA.json|GRAMMAR.gbnf [--tokens 256] [--seed 1]
 *                 [--request N] [--plain] [--gbnf] [--echo]
 *
 * Each step masks random logits (kvr_grammar_apply, what step_grammar.c does), takes the
 * largest allowed one and advances by it, as greedy sampling under the grammar would; the
 * walk restarts when the grammar is complete (or a token ends the text), and with --request
 * N every N tokens, as the tail's kept matcher starts each request with the same schema
 * (ring/step_grammar.h); --plain walks the whole trie for every uncached mask (no top-part
 * masks, grammar_top.c), for comparison. Reports the trie's build
 * time, the mask's median, p90, p99 and mean per token, and how many masks came from the per-state
 * cache. */
#include "bridge/json_schema.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "core/rng.h"
#include "model/gguf.h"
#include "model/grammar.h"
#include "model/grammar_int.h"
#include "model/tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

/* This thread's CPU time: on a shared machine wall time also counts other programs' turns. */
static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = n >= 0 ? kvr_malloc((size_t)n + 1) : NULL;
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        kvr_free(s);
        s = NULL;
    }
    fclose(f);
    if (s) {
        s[n] = 0;
        *len = (size_t)n;
    }
    return s;
}

/* GBNF from a .gbnf file as it is, or from a JSON schema. */
static char *grammar_text(const char *path, size_t *len)
{
    char *src = read_all(path, len);
    if (!src || strstr(path, ".gbnf"))
        return src;
    json_t *schema = json_loads(src, JSON_DECODE_ANY, NULL);
    kvr_free(src);
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    struct kvr_err err = {0};
    if (!schema || kvr_json_schema_gbnf(schema, &out, &err)) {
        fprintf(stderr, "bench_grammar: %s: %s\n", path, schema ? err.msg : "not JSON");
        json_decref(schema);
        return NULL;
    }
    json_decref(schema);
    return kvr_sbuf_take(&out, len);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_grammar VOCAB.gguf SCHEMA.json|G.gbnf [--tokens N] "
                        "[--seed S]\n");
        return 2;
    }
    uint32_t n_tokens = 256;
    uint64_t seed = 1;
    bool echo = false;        /* --echo: the generated text to stderr */
    uint32_t per_request = 0; /* --request N: back to the start every N tokens */
    bool plain = false;       /* --plain: every mask walks the whole trie (the old engine) */
    for (int i = 3; i < argc; i++) {
        echo |= !strcmp(argv[i], "--echo"), plain |= !strcmp(argv[i], "--plain");
        if (i + 1 == argc)
            break;
        if (!strcmp(argv[i], "--tokens"))
            n_tokens = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--request"))
            per_request = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seed"))
            seed = (uint64_t)atoll(argv[++i]);
    }
    struct kvr_err err = {0};
    struct kvr_gguf *gg = NULL;
    struct kvr_tok *tok = NULL;
    if (kvr_gguf_open(&gg, argv[1], &err) || kvr_tok_create(&tok, gg, &err)) {
        fprintf(stderr, "bench_grammar: %s: %s\n", argv[1], err.msg);
        return 1;
    }
    size_t len = 0;
    char *text = grammar_text(argv[2], &len);
    for (int i = 3; text && i < argc; i++)
        if (!strcmp(argv[i], "--gbnf")) { /* the grammar as compiled, nothing timed */
            fwrite(text, 1, len, stdout);
            return 0;
        }
    struct kvr_grammar *g = NULL;
    if (!text || kvr_grammar_compile(&g, text, len, &err)) {
        fprintf(stderr, "bench_grammar: %s\n", text ? err.msg : "no grammar");
        return 1;
    }
    uint64_t t0 = kvr_now_ns(), c0 = cpu_ns();
    struct kvr_grammar_vocab *v = NULL;
    if (kvr_grammar_vocab_create(&v, tok, &err)) {
        fprintf(stderr, "bench_grammar: %s\n", err.msg);
        return 1;
    }
    double build_ms = (double)(kvr_now_ns() - t0) / 1e6,
           build_cpu_ms = (double)(cpu_ns() - c0) / 1e6;
    int32_t n_vocab = kvr_tok_n_vocab(tok);
    float *logits = malloc((size_t)n_vocab * sizeof *logits);
    uint64_t *ns = calloc(n_tokens, sizeof *ns);
    struct kvr_grammar_match *m = NULL;
    if (!logits || !ns || kvr_grammar_match_create(&m, g))
        return 1;
    kvr_grammar_match_set_plain(m, plain);
    uint64_t rng = seed, total = 0, cpu_total = 0;
    uint32_t n_docs = 0;
    for (uint32_t k = 0; k < n_tokens; k++) {
        if (per_request && k && k % per_request == 0) /* a new request, the same matcher */
            kvr_grammar_match_reset(m);
        for (int32_t i = 0; i < n_vocab; i++)
            logits[i] = (float)(kvr_splitmix64(&rng) >> 40) / (float)(1 << 24);
        uint64_t a = kvr_now_ns(), ca = cpu_ns();
        int32_t n = kvr_grammar_apply(m, v, logits, n_vocab);
        ns[k] = kvr_now_ns() - a;
        cpu_total += cpu_ns() - ca;
        total += ns[k];
        int32_t best = -1;
        for (int32_t i = 0; n > 0 && i < n_vocab; i++)
            if (!isinf(logits[i]) && (best < 0 || logits[i] > logits[best]))
                best = i;
        const char *piece;
        size_t n_piece;
        if (echo && best >= 0 && !kvr_tok_decode_piece(tok, best, false, &piece, &n_piece))
            fwrite(piece, 1, n_piece, stderr);
        if (best < 0 || kvr_tok_is_eog(tok, best) || kvr_grammar_accept_token(m, v, best)) {
            kvr_grammar_match_reset(m); /* a document ended: start the next */
            n_docs++;
        }
    }
    struct kvr_grammar_stats st;
    kvr_grammar_match_stats(m, &st);
    qsort(ns, n_tokens, sizeof *ns, cmp_u64);
    printf("vocab %d tokens: trie built in %.1f ms (%.1f ms CPU); grammar %zu bytes, %u rules\n",
           n_vocab, build_ms, build_cpu_ms, len, kvr_grammar_n_rules(g));
    printf("mask per token over %u tokens (%u documents): wall median %.3f ms, p90 %.3f ms, "
           "p99 %.3f ms, mean %.3f ms; CPU mean %.3f ms; %llu of %llu from the cache\n",
           n_tokens, n_docs, (double)ns[n_tokens / 2] / 1e6, (double)ns[n_tokens * 9 / 10] / 1e6,
           (double)ns[n_tokens * 99 / 100] / 1e6, (double)total / n_tokens / 1e6,
           (double)cpu_total / n_tokens / 1e6, (unsigned long long)st.n_cached,
           (unsigned long long)st.n_masks);
    printf("masks not cached: %llu by top parts (%llu top parts walked, %llu found walked), "
           "%llu by plain walks\n",
           (unsigned long long)(st.n_masks - st.n_cached - st.n_plain),
           (unsigned long long)st.n_top_walks, (unsigned long long)st.n_top_cached,
           (unsigned long long)st.n_plain);
    kvr_grammar_match_destroy(m);
    kvr_grammar_vocab_destroy(v);
    kvr_grammar_destroy(g);
    kvr_tok_destroy(tok);
    kvr_gguf_close(gg);
    kvr_free(text);
    free(logits);
    free(ns);
    return 0;
}
