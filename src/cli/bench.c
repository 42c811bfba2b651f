/* bench.c - `kvasir bench`: load a running Kvasir (or any OpenAI-compatible) server and
 * measure what its clients see, in the manner of vLLM's benchmark_serving.
 *
 *   kvasir bench --rate 5 --duration 30 --prompt-len 128 --output-len 64
 *   kvasir bench --concurrency 8 --num-requests 200 --json out.json
 *   kvasir bench --sweep 1,2,4,8 --duration 20 --ttft-budget-ms 500 --svg sweep.svg
 *
 * Every request streams (SSE), so time to first token (TTFT), every inter-token gap (ITL),
 * time per output token (TPOT) and end-to-end latency (E2E) are measured at the client.
 *
 * Load: open loop (--rate: arrival times drawn up front from --seed, Poisson or gamma with
 * --burstiness) or closed loop (--concurrency C: C requests always in flight). In the open
 * loop a request that arrives while every worker thread is busy gets a new thread, so a slow
 * request never delays the schedule. Every socket wait is bounded and every request has a
 * deadline (--timeout-s), so a run always ends by itself; Ctrl-C ends it early and still
 * reports what finished.
 *
 * The measuring and the numbers are split: this file sends requests and fills one
 * struct kvr_lg_record per request; client/loadgen.c turns records into percentiles,
 * throughput and goodput; bench_svg.c draws the sweep plot (with client/svg.c). docs/BENCH.md
 * explains the output. */
#include "cli/bench_multiturn.h"
#include "cli/bench_svg.h"
#include "cli/cmd.h"
#include "cli/common.h"

#include "client/httpc.h"
#include "client/loadgen.h"
#include "core/sbuf.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_SWEEP 16
#define MAX_TOKENS_LIMIT (1u << 20)
#define RECORD_BLOCK 1024
#define WORKER_STACK_BYTES (512u << 10)
#define PROGRESS_NS (200 * 1000000ull)

static volatile int stop_flag; /* raised by SIGINT/SIGTERM: stop sending, cancel in flight */

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

/* ---- options ----------------------------------------------------------------------------- */

enum endpoint { EP_COMPLETIONS, EP_CHAT };

struct opts {
    const char *url, *api_key, *model, *gguf, *json_path, *svg_path;
    enum endpoint endpoint;
    double rate; /* > 0 open loop; INFINITY = all at once; 0 = closed loop */
    double burstiness;
    uint32_t concurrency;     /* closed loop */
    uint32_t max_concurrency; /* open loop cap on requests in flight; 0 = none */
    double duration_s;
    uint32_t num_requests;
    struct kvr_lg_range prompt_len, output_len;
    double temperature;                       /* NAN: the server's default */
    uint32_t ttft_budget_ms, total_budget_ms; /* 0: not sent, not checked */
    uint64_t seed;
    uint32_t timeout_s;
    double sweep[MAX_SWEEP];
    int n_sweep;
    bool sweep_auto, quiet;
    bool multi_turn; /* bench_multiturn.h; its own shape options below */
    uint32_t mt_conversations, mt_turns, mt_system_words;
    struct kvr_lg_range mt_turn_words;
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir bench [options]\n"
               "  Load an OpenAI-compatible server with streaming requests and report TTFT, TPOT,\n"
               "  ITL and E2E latency percentiles, throughput, goodput and refusals.\n"
               "target:\n"
               "  --url URL               server (default http://127.0.0.1:8080)\n"
               "  --api-key KEY           bearer key (default: env KVASIR_API_KEY)\n"
               "  --model NAME            model name to send (default: the first of /v1/models)\n"
               "  --endpoint E            completions (default) or chat\n"
               "load (one of --rate, --concurrency, --sweep, --sweep-auto):\n"
               "  --rate R                open loop: R requests/s on average; 'inf' = all at once\n"
               "  --burstiness B          gamma shape of the gaps: 1 = Poisson (default), <1\n"
               "                          burstier, >1 more even\n"
               "  --max-concurrency C     open loop: at most C in flight (later arrivals wait)\n"
               "  --concurrency C         closed loop: keep C requests in flight\n"
               "  --duration S            send for S seconds\n"
               "  --num-requests N        send N requests (default 100 unless --duration)\n"
               "  --sweep R1,R2,...       one open-loop run per rate, then a table (and --svg)\n"
               "  --sweep-auto            rates found by doubling from a probe until goodput\n"
               "                          falls below half the offered rate\n"
               "requests:\n"
               "  --prompt-len N|LO:HI    prompt tokens (default 128)\n"
               "  --output-len N|LO:HI    max_tokens (default 64; ignore_eos is asked for)\n"
               "  -m, --gguf FILE         the model's GGUF: exact prompt token counts\n"
               "  --temperature T         sampling temperature (default: the server's)\n"
               "  --ttft-budget-ms MS     first-token budget sent with each request and checked\n"
               "  --total-budget-ms MS    whole-answer budget, likewise\n"
               "  --seed S                schedule and prompt seed (default 0)\n"
               "  --timeout-s S           per request deadline and socket timeout (default 300)\n"
               "output:\n"
               "  --json FILE             everything, including every request\n"
               "  --svg FILE              sweep plot (latency and goodput against offered rate)\n"
               "  --quiet                 no progress line\n"
               "multi-turn chat (a prefix cache's case; --output-len gives the answer length):\n"
               "  --multi-turn            conversations of turns, each prompt the previous one\n"
               "                          + its answer + a new turn; TTFT per turn\n"
               "  --conversations N       at once (default 32)   --turns N (default 6)\n"
               "  --system-words N        shared system prompt (default 400)\n"
               "  --turn-words LO:HI      words a turn adds (default 50:150)\n");
}

static int parse_double(const char *opt, const char *v, double lo, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!strcmp(v, "inf")) {
        *out = INFINITY;
        return 0;
    }
    if (errno || end == v || *end || !isfinite(x) || x < lo) {
        fprintf(stderr, "kvasir bench: %s wants a number >= %g, not '%s'\n", opt, lo, v);
        return -1;
    }
    *out = x;
    return 0;
}

static int parse_opts(int argc, char **argv, struct opts *o)
{
    memset(o, 0, sizeof *o);
    o->url = "http://127.0.0.1:8080";
    o->api_key = getenv("KVASIR_API_KEY");
    o->burstiness = 1;
    o->prompt_len = (struct kvr_lg_range){128, 128};
    o->output_len = (struct kvr_lg_range){64, 64};
    o->temperature = NAN;
    o->timeout_s = 300;
    o->mt_conversations = 32;
    o->mt_turns = 6;
    o->mt_system_words = 400;
    o->mt_turn_words = (struct kvr_lg_range){50, 150};
    bool have_rate = false;
    struct kvr_err err = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--sweep-auto")) {
            o->sweep_auto = true;
            continue;
        }
        if (!strcmp(a, "--quiet")) {
            o->quiet = true;
            continue;
        }
        if (!strcmp(a, "--multi-turn")) {
            o->multi_turn = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "kvasir bench: %s needs a value\n", a);
            return 2;
        }
        i++;
        int rc = 0;
        double d;
        if (!strcmp(a, "--conversations"))
            rc = kvr_cli_u32(a, v, 1, 1024, &o->mt_conversations);
        else if (!strcmp(a, "--turns"))
            rc = kvr_cli_u32(a, v, 1, 64, &o->mt_turns);
        else if (!strcmp(a, "--system-words"))
            rc = kvr_cli_u32(a, v, 0, 100000, &o->mt_system_words);
        else if (!strcmp(a, "--turn-words")) {
            if (kvr_lg_range_parse(&o->mt_turn_words, v, 100000, &err))
                rc = -1, fprintf(stderr, "kvasir bench: --turn-words: %s\n", err.msg);
        } else if (!strcmp(a, "--url"))
            o->url = v;
        else if (!strcmp(a, "--api-key"))
            o->api_key = v;
        else if (!strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "-m") || !strcmp(a, "--gguf"))
            o->gguf = v;
        else if (!strcmp(a, "--json"))
            o->json_path = v;
        else if (!strcmp(a, "--svg"))
            o->svg_path = v;
        else if (!strcmp(a, "--endpoint")) {
            if (!strcmp(v, "completions"))
                o->endpoint = EP_COMPLETIONS;
            else if (!strcmp(v, "chat"))
                o->endpoint = EP_CHAT;
            else {
                fprintf(stderr, "kvasir bench: --endpoint is completions or chat\n");
                return 2;
            }
        } else if (!strcmp(a, "--rate")) {
            rc = parse_double(a, v, 0, &o->rate);
            if (!rc && o->rate <= 0) {
                fprintf(stderr, "kvasir bench: --rate must be > 0\n");
                return 2;
            }
            have_rate = true;
        } else if (!strcmp(a, "--burstiness")) {
            rc = parse_double(a, v, 0, &o->burstiness);
            if (!rc && (o->burstiness <= 0 || isinf(o->burstiness))) {
                fprintf(stderr, "kvasir bench: --burstiness must be a number > 0\n");
                return 2;
            }
        } else if (!strcmp(a, "--concurrency"))
            rc = kvr_cli_u32(a, v, 1, 100000, &o->concurrency);
        else if (!strcmp(a, "--max-concurrency"))
            rc = kvr_cli_u32(a, v, 1, 100000, &o->max_concurrency);
        else if (!strcmp(a, "--duration")) {
            rc = parse_double(a, v, 0, &o->duration_s);
            if (!rc && (o->duration_s <= 0 || isinf(o->duration_s))) {
                fprintf(stderr, "kvasir bench: --duration must be a number of seconds > 0\n");
                return 2;
            }
        } else if (!strcmp(a, "--num-requests"))
            rc = kvr_cli_u32(a, v, 1, KVR_LG_MAX_REQUESTS, &o->num_requests);
        else if (!strcmp(a, "--prompt-len") || !strcmp(a, "--output-len")) {
            struct kvr_lg_range *r = a[2] == 'p' ? &o->prompt_len : &o->output_len;
            if (kvr_lg_range_parse(r, v, MAX_TOKENS_LIMIT, &err)) {
                fprintf(stderr, "kvasir bench: %s: %s\n", a, err.msg);
                return 2;
            }
        } else if (!strcmp(a, "--temperature")) {
            rc = parse_double(a, v, 0, &o->temperature);
            if (!rc && o->temperature > 2)
                rc = -1, fprintf(stderr, "kvasir bench: --temperature is at most 2\n");
        } else if (!strcmp(a, "--ttft-budget-ms"))
            rc = kvr_cli_u32(a, v, 1, 3600000, &o->ttft_budget_ms);
        else if (!strcmp(a, "--total-budget-ms"))
            rc = kvr_cli_u32(a, v, 1, 3600000, &o->total_budget_ms);
        else if (!strcmp(a, "--seed")) {
            rc = parse_double(a, v, 0, &d);
            if (!rc && (d != floor(d) || d > 1e18))
                rc = -1, fprintf(stderr, "kvasir bench: --seed wants a whole number\n");
            o->seed = (uint64_t)d;
        } else if (!strcmp(a, "--timeout-s"))
            rc = kvr_cli_u32(a, v, 1, 86400, &o->timeout_s);
        else if (!strcmp(a, "--sweep")) {
            o->n_sweep = kvr_lg_parse_rates(v, o->sweep, MAX_SWEEP, &err);
            if (o->n_sweep < 0) {
                fprintf(stderr, "kvasir bench: --sweep: %s\n", err.msg);
                return 2;
            }
        } else {
            fprintf(stderr, "kvasir bench: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
        if (rc)
            return 2;
    }
    int modes = have_rate + (o->concurrency > 0) + (o->n_sweep > 0) + o->sweep_auto;
    if (o->multi_turn && modes == 0)
        return 0;
    if (modes != 1 || o->multi_turn) {
        fprintf(stderr, "kvasir bench: give exactly one of --rate, --concurrency, --sweep, "
                        "--sweep-auto and --multi-turn\n");
        return 2;
    }
    if (o->max_concurrency && o->concurrency) {
        fprintf(stderr, "kvasir bench: --max-concurrency goes with --rate or --sweep\n");
        return 2;
    }
    if (!o->num_requests && o->duration_s == 0)
        o->num_requests = 100;
    if (have_rate && isinf(o->rate) && !o->num_requests) {
        fprintf(stderr, "kvasir bench: --rate inf needs --num-requests\n");
        return 2;
    }
    if (o->sweep_auto && o->duration_s == 0 && !o->num_requests) {
        fprintf(stderr, "kvasir bench: --sweep-auto needs --duration or --num-requests\n");
        return 2;
    }
    if (o->svg_path && !o->n_sweep && !o->sweep_auto) {
        fprintf(stderr, "kvasir bench: --svg plots a sweep: add --sweep or --sweep-auto\n");
        return 2;
    }
    if (o->ttft_budget_ms && o->total_budget_ms && o->ttft_budget_ms > o->total_budget_ms) {
        fprintf(stderr, "kvasir bench: --ttft-budget-ms exceeds --total-budget-ms\n");
        return 2;
    }
    return 0;
}

/* ---- prompts ------------------------------------------------------------------------------ */

/* Common English words: prompts read like text, so a real tokenizer splits them as it would
 * split real prompts (about one token per word for SentencePiece and GPT-2 vocabularies). */
static const char *const words[] = {
    "the",      "of",        "and",    "to",     "in",     "is",     "you",    "that",
    "it",       "he",        "was",    "for",    "on",     "are",    "as",     "with",
    "his",      "they",      "at",     "be",     "this",   "have",   "from",   "or",
    "one",      "had",       "by",     "word",   "but",    "not",    "what",   "all",
    "were",     "we",        "when",   "your",   "can",    "said",   "there",  "use",
    "an",       "each",      "which",  "she",    "do",     "how",    "their",  "if",
    "will",     "up",        "other",  "about",  "out",    "many",   "then",   "them",
    "these",    "so",        "some",   "her",    "would",  "make",   "like",   "him",
    "into",     "time",      "has",    "look",   "two",    "more",   "write",  "go",
    "see",      "number",    "no",     "way",    "could",  "people", "my",     "than",
    "first",    "water",     "been",   "call",   "who",    "oil",    "its",    "now",
    "find",     "long",      "down",   "day",    "did",    "get",    "come",   "made",
    "may",      "part",      "over",   "new",    "sound",  "take",   "only",   "little",
    "work",     "know",      "place",  "year",   "live",   "me",     "back",   "give",
    "most",     "very",      "after",  "thing",  "our",    "just",   "name",   "good",
    "sentence", "man",       "think",  "say",    "great",  "where",  "help",   "through",
    "much",     "before",    "line",   "right",  "too",    "mean",   "old",    "any",
    "same",     "tell",      "boy",    "follow", "came",   "want",   "show",   "also",
    "around",   "form",      "three",  "small",  "set",    "put",    "end",    "does",
    "another",  "well",      "large",  "must",   "big",    "even",   "such",   "because",
    "turn",     "here",      "why",    "ask",    "went",   "men",    "read",   "need",
    "land",     "different", "home",   "us",     "move",   "try",    "kind",   "hand",
    "picture",  "again",     "change", "off",    "play",   "spell",  "air",    "away",
    "animal",   "house",     "point",  "page",   "letter", "mother", "answer", "found",
    "study",    "still",     "learn",  "should", "world",  "high",
};
#define N_WORDS (sizeof words / sizeof words[0])

struct prompt {
    struct kvr_sbuf text; /* the prompt text, or the chat message's content */
    int32_t *ids;         /* completions with a tokenizer: exactly n_tokens ids (BOS first
                             when the model adds one), sent instead of the text */
    size_t ids_cap;
    uint32_t n_tokens; /* planned prompt tokens: exact with a tokenizer, else words */
};

static void add_words(struct kvr_sbuf *b, struct kvr_lg_rng *rng, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (b->len)
            kvr_sbuf_append(b, " ", 1);
        kvr_sbuf_puts(b, words[kvr_lg_rng_next(rng) % N_WORDS]);
    }
}

/* Tokenize the prompt's text into p->ids; returns the count or a negative status. */
static int encode(const struct kvr_tok *tok, struct prompt *p, bool add_special)
{
    if (p->text.failed)
        return KVR_ENOMEM;
    struct kvr_tok_scratch *sc = NULL;
    size_t len = p->text.len;
    int n = kvr_tok_scratch_create(&sc, tok, len ? len : 1);
    for (int attempt = 0; n == 0 && attempt < 4; attempt++) {
        /* A token per byte, plus the space prefix and BOS/EOS, always fits; grow if not. */
        size_t need = (len + 8) << attempt;
        if (p->ids_cap < need) {
            int32_t *ids = kvr_realloc(p->ids, need * sizeof *ids);
            if (!ids) {
                n = KVR_ENOMEM;
                break;
            }
            p->ids = ids;
            p->ids_cap = need;
        }
        n = kvr_tok_encode(tok, sc, p->text.data ? p->text.data : "", len, add_special, false,
                           p->ids, p->ids_cap);
        if (n == KVR_EFULL)
            n = 0;
        else if (n == 0)
            break; /* an empty encoding */
    }
    kvr_tok_scratch_destroy(sc);
    return n;
}

/* Random words making `target` tokens. Without a tokenizer one word stands for one token
 * (the server's usage count then says what it really was). */
static int build_prompt(struct prompt *p, const struct kvr_tok *tok, bool chat,
                        struct kvr_lg_rng *rng, uint32_t target)
{
    kvr_sbuf_clear(&p->text);
    p->n_tokens = target;
    if (!tok) {
        add_words(&p->text, rng, target);
        return p->text.failed ? KVR_ENOMEM : 0;
    }
    /* Add words until the text has at least `target` tokens; each round adds at least one
     * token, so this ends, but stay bounded against a degenerate vocabulary anyway. */
    int n = 0;
    add_words(&p->text, rng, target);
    for (int round = 0; round < 64; round++) {
        n = encode(tok, p, !chat);
        if (n < 0)
            return n;
        if ((uint32_t)n >= target)
            break;
        add_words(&p->text, rng, target - (uint32_t)n);
    }
    if ((uint32_t)n < target)
        return KVR_ERANGE;
    if (!chat) {
        p->n_tokens = target; /* send the first `target` ids */
        return 0;
    }
    /* Chat content is text: drop trailing words while it is too long. */
    while ((uint32_t)n > target) {
        char *sp = strrchr(p->text.data, ' ');
        if (!sp)
            break;
        *sp = 0;
        p->text.len = (size_t)(sp - p->text.data);
        n = encode(tok, p, false);
        if (n < 0)
            return n;
    }
    p->n_tokens = (uint32_t)n;
    return 0;
}

/* ---- one request --------------------------------------------------------------------------- */

/* Records live in blocks that never move, so a worker can fill its record without a lock
 * while others are handed out. */
struct store {
    pthread_mutex_t mu;
    struct kvr_lg_record *blocks[KVR_LG_MAX_REQUESTS / RECORD_BLOCK + 1];
    size_t n; /* highest index handed out + 1 */
};

static struct kvr_lg_record *store_get(struct store *s, size_t index)
{
    size_t b = index / RECORD_BLOCK;
    if (b >= sizeof s->blocks / sizeof s->blocks[0])
        return NULL;
    pthread_mutex_lock(&s->mu);
    if (!s->blocks[b])
        s->blocks[b] = kvr_calloc(RECORD_BLOCK, sizeof *s->blocks[b]);
    struct kvr_lg_record *r = s->blocks[b] ? &s->blocks[b][index % RECORD_BLOCK] : NULL;
    if (r && index + 1 > s->n)
        s->n = index + 1;
    pthread_mutex_unlock(&s->mu);
    return r;
}

/* Copy the filled records into one new array, in index order; each ITL array moves with its
 * record (the store's pointer is cleared). Records never filled are skipped. */
static struct kvr_lg_record *store_gather(struct store *s, size_t *n_out)
{
    struct kvr_lg_record *all = kvr_calloc(s->n ? s->n : 1, sizeof *all);
    size_t n = 0;
    for (size_t i = 0; all && i < s->n; i++) {
        struct kvr_lg_record *r =
            s->blocks[i / RECORD_BLOCK] ? &s->blocks[i / RECORD_BLOCK][i % RECORD_BLOCK] : NULL;
        if (!r || r->max_tokens == 0) /* never filled */
            continue;
        all[n++] = *r;
        r->itl_s = NULL;
    }
    *n_out = n;
    return all;
}

static void store_fini(struct store *s)
{
    for (size_t b = 0; b < sizeof s->blocks / sizeof s->blocks[0]; b++) {
        if (!s->blocks[b])
            continue;
        for (size_t i = 0; i < RECORD_BLOCK; i++)
            kvr_free(s->blocks[b][i].itl_s);
        kvr_free(s->blocks[b]);
    }
    pthread_mutex_destroy(&s->mu);
}

static void free_records(struct kvr_lg_record *r, size_t n)
{
    for (size_t i = 0; r && i < n; i++)
        kvr_free(r[i].itl_s);
    kvr_free(r);
}

/* One load level: an open-loop schedule or a closed loop. */
struct run {
    const struct opts *o;
    const struct kvr_httpc_url *url;
    const char *model;
    const struct kvr_tok *tok;
    const char *path;
    /* open loop */
    double rate;
    const double *arrivals;
    size_t n_sched;
    uint32_t max_concurrency;
    /* closed loop */
    uint32_t concurrency;
    size_t limit;    /* most requests; 0 = until end_ns */
    uint64_t end_ns; /* closed loop: start no request after this; 0 = none */
    size_t next_index;

    uint64_t t0_ns;
    struct store store;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    size_t *queue, q_head, q_tail; /* open loop: indices waiting for a worker */
    size_t n_dispatched, n_done, n_inflight, n_free, n_exited;
    size_t n_ok, n_refused, n_failed;
    uint64_t t_last_end_ns;
    pthread_t *workers;
    size_t n_workers, cap_workers;
    bool quit;
};

/* What the SSE stream said, as it arrived. */
struct stream {
    bool chat;
    uint64_t t_start, t_last;
    bool got_text, done, error;
    double ttft_s;
    double *itl;
    uint32_t n_itl, cap_itl, n_text_chunks;
    int64_t usage_prompt, usage_completion; /* -1 until a usage chunk came */
    uint64_t t_done;
    char err_code[KVR_LG_REASON_BYTES], err_msg[KVR_LG_MESSAGE_BYTES];
};

#define MAX_ITL (1u << 20)

static void copy_error(json_t *e, char *code, size_t code_cap, char *msg, size_t msg_cap)
{
    json_t *c = json_object_get(e, "code"), *t = json_object_get(e, "type"),
           *m = json_object_get(e, "message");
    if (json_is_string(c))
        snprintf(code, code_cap, "%s", json_string_value(c));
    else if (json_is_string(t))
        snprintf(code, code_cap, "%s", json_string_value(t));
    if (json_is_string(m))
        snprintf(msg, msg_cap, "%s", json_string_value(m));
}

static int on_chunk(void *ud, const char *data, size_t len, uint64_t t_ns)
{
    struct stream *st = ud;
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        st->done = true;
        st->t_done = t_ns;
        return 0;
    }
    /* Generated text may hold any character, U+0000 included (a model can emit the byte
     * token <0x00>), so NUL must be allowed in strings. */
    json_error_t jerr;
    json_t *j = json_loadb(data, len, JSON_ALLOW_NUL, &jerr);
    if (!j) {
        st->error = true;
        snprintf(st->err_code, sizeof st->err_code, "bad_chunk");
        snprintf(st->err_msg, sizeof st->err_msg, "an SSE event that is not JSON: %.100s",
                 jerr.text);
        return 0;
    }
    json_t *e = json_object_get(j, "error");
    if (json_is_object(e)) {
        st->error = true;
        snprintf(st->err_code, sizeof st->err_code, "stream_error");
        copy_error(e, st->err_code, sizeof st->err_code, st->err_msg, sizeof st->err_msg);
    }
    json_t *choices = json_object_get(j, "choices");
    if (json_is_array(choices) && json_array_size(choices) > 0) {
        json_t *c0 = json_array_get(choices, 0);
        json_t *t = st->chat ? json_object_get(json_object_get(c0, "delta"), "content")
                             : json_object_get(c0, "text");
        if (json_is_string(t) && json_string_length(t) > 0) {
            st->n_text_chunks++;
            if (!st->got_text) {
                st->got_text = true;
                st->ttft_s = (double)(t_ns - st->t_start) / 1e9;
            } else if (st->n_itl < MAX_ITL) {
                if (st->n_itl == st->cap_itl) {
                    uint32_t cap = st->cap_itl ? st->cap_itl * 2 : 64;
                    double *itl = kvr_realloc(st->itl, cap * sizeof *itl);
                    if (itl) {
                        st->itl = itl;
                        st->cap_itl = cap;
                    }
                }
                if (st->n_itl < st->cap_itl)
                    st->itl[st->n_itl++] = (double)(t_ns - st->t_last) / 1e9;
            }
            st->t_last = t_ns;
        }
    }
    json_t *u = json_object_get(j, "usage");
    if (json_is_object(u)) {
        json_t *pt = json_object_get(u, "prompt_tokens"),
               *ct = json_object_get(u, "completion_tokens");
        if (json_is_integer(pt))
            st->usage_prompt = json_integer_value(pt);
        if (json_is_integer(ct))
            st->usage_completion = json_integer_value(ct);
    }
    json_decref(j);
    return 0;
}

static char *request_body(const struct run *r, const struct prompt *p, uint32_t max_tokens,
                          uint32_t index)
{
    const struct opts *o = r->o;
    json_t *b = json_object();
    if (!b)
        return NULL;
    json_object_set_new(b, "model", json_string(r->model));
    if (o->endpoint == EP_CHAT) {
        json_t *msg =
            json_pack("{s:s, s:s}", "role", "user", "content", p->text.data ? p->text.data : "");
        json_object_set_new(b, "messages", json_pack("[o]", msg));
        json_object_set_new(b, "max_completion_tokens", json_integer(max_tokens));
    } else if (r->tok) {
        json_t *ids = json_array();
        for (uint32_t i = 0; i < p->n_tokens; i++)
            json_array_append_new(ids, json_integer(p->ids[i]));
        json_object_set_new(b, "prompt", ids);
    } else {
        json_object_set_new(b, "prompt", json_string(p->text.data ? p->text.data : ""));
    }
    if (o->endpoint != EP_CHAT)
        json_object_set_new(b, "max_tokens", json_integer(max_tokens));
    json_object_set_new(b, "stream", json_true());
    json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
    /* vLLM's name for "generate max_tokens whatever the model says"; servers that do not
     * know it ignore it (Kvasir does), and then answers may be shorter. */
    json_object_set_new(b, "ignore_eos", json_true());
    json_object_set_new(b, "seed",
                        json_integer((json_int_t)((o->seed * 1000003u + index) & 0x7fffffff)));
    if (!isnan(o->temperature))
        json_object_set_new(b, "temperature", json_real(o->temperature));
    if (o->ttft_budget_ms || o->total_budget_ms) {
        json_t *lb = json_object();
        if (o->ttft_budget_ms)
            json_object_set_new(lb, "first_token_ms", json_integer(o->ttft_budget_ms));
        if (o->total_budget_ms)
            json_object_set_new(lb, "total_ms", json_integer(o->total_budget_ms));
        json_object_set_new(b, "latency_budget", lb);
    }
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

static const char *client_reason(int rc)
{
    switch (rc) {
    case KVR_ETIMEDOUT:
        return "timeout";
    case KVR_EIO:
        return "connect";
    case KVR_ECLOSED:
        return "closed";
    case KVR_EPROTO:
        return "protocol";
    case KVR_ERANGE:
        return "too_large";
    case KVR_ENOMEM:
        return "client_memory";
    default:
        return "client";
    }
}

/* Copy a string, cutting it to fit (messages are shown, not parsed). */
static void copy_cut(char *dst, size_t cap, const char *src)
{
    size_t n = strlen(src);
    if (n >= cap)
        n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = 0;
}

static void set_reason(struct kvr_lg_record *rec, const char *reason, const char *msg)
{
    copy_cut(rec->reason, sizeof rec->reason, reason);
    if (msg)
        copy_cut(rec->message, sizeof rec->message, msg);
}

static void do_request(struct run *r, size_t index, double scheduled_s)
{
    const struct opts *o = r->o;
    struct kvr_lg_record *rec = store_get(&r->store, index);
    if (!rec)
        return;
    rec->index = (uint32_t)index;
    rec->scheduled_s = scheduled_s;
    rec->ttft_s = rec->e2e_s = rec->response_s = NAN;
    /* Each request's lengths and words come from its own generator, so they do not depend
     * on which thread ran it or when. */
    struct kvr_lg_rng rng;
    kvr_lg_rng_seed(&rng, o->seed * 0x9E3779B97F4A7C15ull + index + 1);
    uint32_t n_prompt = kvr_lg_range_draw(&o->prompt_len, &rng);
    rec->max_tokens = kvr_lg_range_draw(&o->output_len, &rng);
    struct prompt p = {0};
    kvr_sbuf_init(&p.text);
    struct stream st = {.chat = o->endpoint == EP_CHAT, .usage_prompt = -1, .usage_completion = -1};
    struct kvr_httpc_resp resp = {0};
    struct kvr_err err = {0};
    char *body = NULL;
    int rc = build_prompt(&p, r->tok, st.chat, &rng, n_prompt);
    if (rc == 0 && (body = request_body(r, &p, rec->max_tokens, (uint32_t)index)) == NULL)
        rc = KVR_ENOMEM;
    rec->prompt_tokens = p.n_tokens;
    st.t_start = kvr_now_ns();
    rec->start_s = (double)(st.t_start - r->t0_ns) / 1e9;
    if (rc) {
        rec->outcome = KVR_LG_ERROR;
        set_reason(rec, "client_prompt", "could not build the prompt");
        goto done;
    }
    struct kvr_httpc_req req = {.method = "POST",
                                .path = r->path,
                                .api_key = o->api_key,
                                .body = body,
                                .body_len = strlen(body),
                                .io_timeout_ms = o->timeout_s * 1000u,
                                .deadline_ns = st.t_start + (uint64_t)o->timeout_s * 1000000000ull,
                                .on_event = on_chunk,
                                .ud = &st,
                                .cancel = &stop_flag};
    rc = kvr_httpc_do(r->url, &req, &resp, &err);
    rec->http_status = resp.status;
    if (resp.t_head_ns)
        rec->response_s = (double)(resp.t_head_ns - st.t_start) / 1e9;
    rec->e2e_s = (double)((st.done ? st.t_done : resp.t_end_ns) - st.t_start) / 1e9;
    if (rc) {
        rec->outcome = rc == KVR_ETIMEDOUT ? KVR_LG_TIMEOUT : KVR_LG_ERROR;
        set_reason(rec, stop_flag && rc == KVR_ECLOSED ? "interrupted" : client_reason(rc),
                   err.msg);
        goto done;
    }
    if (resp.status == 429 || resp.status == 503 || resp.status < 200 || resp.status >= 300) {
        char code[KVR_LG_REASON_BYTES], msg[KVR_LG_MESSAGE_BYTES] = "";
        snprintf(code, sizeof code, "http_%d", resp.status);
        json_t *j = resp.body ? json_loadb(resp.body, resp.body_len, 0, NULL) : NULL;
        if (json_is_object(json_object_get(j, "error")))
            copy_error(json_object_get(j, "error"), code, sizeof code, msg, sizeof msg);
        json_decref(j);
        rec->outcome = resp.status == 429 || resp.status == 503 ? KVR_LG_REFUSED : KVR_LG_ERROR;
        set_reason(rec, code, msg);
        goto done;
    }
    if (!resp.is_sse) {
        rec->outcome = KVR_LG_ERROR;
        set_reason(rec, "not_streamed", "a 2xx answer that is not text/event-stream");
    } else if (st.error) {
        rec->outcome = KVR_LG_ERROR;
        set_reason(rec, st.err_code, st.err_msg);
    } else if (!st.done) {
        rec->outcome = KVR_LG_ERROR;
        set_reason(rec, "truncated", "the stream ended without [DONE]");
    } else if (!st.got_text) {
        rec->outcome = KVR_LG_ERROR;
        set_reason(rec, "no_text", "the stream carried no text");
    } else {
        rec->outcome = KVR_LG_OK;
    }
    rec->ttft_s = st.got_text ? st.ttft_s : NAN;
    rec->itl_s = st.itl;
    rec->n_itl = st.n_itl;
    st.itl = NULL;
    if (st.usage_prompt > 0 && st.usage_prompt <= UINT32_MAX)
        rec->prompt_tokens = (uint32_t)st.usage_prompt;
    rec->output_tokens = st.usage_completion >= 0 && st.usage_completion <= UINT32_MAX
                             ? (uint32_t)st.usage_completion
                             : st.n_text_chunks;
done:
    kvr_free(st.itl);
    kvr_httpc_resp_fini(&resp);
    free(body); /* from json_dumps: jansson's allocator */
    kvr_sbuf_fini(&p.text);
    kvr_free(p.ids);
    uint64_t t_end = kvr_now_ns();
    pthread_mutex_lock(&r->mu);
    if (t_end > r->t_last_end_ns)
        r->t_last_end_ns = t_end;
    if (rec->outcome == KVR_LG_OK)
        r->n_ok++;
    else if (rec->outcome == KVR_LG_REFUSED)
        r->n_refused++;
    else
        r->n_failed++;
    pthread_mutex_unlock(&r->mu);
}

/* ---- workers ------------------------------------------------------------------------------- */

/* Open loop: workers take scheduled indices from the queue; the dispatcher adds a worker
 * whenever more requests are queued than workers are free, so none ever waits for one. */
static void *open_worker(void *arg)
{
    struct run *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (r->q_head == r->q_tail && !r->quit)
            pthread_cond_wait(&r->work, &r->mu);
        if (r->q_head == r->q_tail)
            break;
        size_t index = r->queue[r->q_head++];
        r->n_free--;
        r->n_inflight++;
        pthread_mutex_unlock(&r->mu);
        do_request(r, index, r->arrivals[index]);
        pthread_mutex_lock(&r->mu);
        r->n_free++;
        r->n_inflight--;
        r->n_done++;
        pthread_cond_broadcast(&r->done);
    }
    r->n_exited++;
    pthread_cond_broadcast(&r->done);
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* Closed loop: each worker sends its next request as soon as the previous one ended. */
static void *closed_worker(void *arg)
{
    struct run *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        if (stop_flag || (r->limit && r->next_index >= r->limit) ||
            (r->end_ns && kvr_now_ns() >= r->end_ns))
            break;
        size_t index = r->next_index++;
        r->n_dispatched++;
        r->n_inflight++;
        pthread_mutex_unlock(&r->mu);
        do_request(r, index, (double)(kvr_now_ns() - r->t0_ns) / 1e9);
        pthread_mutex_lock(&r->mu);
        r->n_inflight--;
        r->n_done++;
        pthread_cond_broadcast(&r->done);
    }
    r->n_exited++;
    pthread_cond_broadcast(&r->done);
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* Start a worker; called with r->mu held. */
static int spawn_worker(struct run *r, void *(*fn)(void *))
{
    if (r->n_workers == r->cap_workers) {
        size_t cap = r->cap_workers ? r->cap_workers * 2 : 16;
        pthread_t *w = kvr_realloc(r->workers, cap * sizeof *w);
        if (!w)
            return KVR_ENOMEM;
        r->workers = w;
        r->cap_workers = cap;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, WORKER_STACK_BYTES);
    int rc = pthread_create(&r->workers[r->n_workers], &attr, fn, r);
    pthread_attr_destroy(&attr);
    if (rc)
        return KVR_EIO;
    r->n_workers++;
    return 0;
}

/* ---- progress -------------------------------------------------------------------------------- */

struct progress {
    bool on;
    uint64_t last_ns;
    const char *label;
};

static void progress_show(struct progress *pg, struct run *r, bool force)
{
    if (!pg->on)
        return;
    uint64_t now = kvr_now_ns();
    if (!force && now - pg->last_ns < PROGRESS_NS)
        return;
    pg->last_ns = now;
    pthread_mutex_lock(&r->mu);
    size_t done = r->n_done, total = r->n_sched ? r->n_sched : r->limit, inflight = r->n_inflight;
    size_t ok = r->n_ok, refused = r->n_refused, failed = r->n_failed;
    pthread_mutex_unlock(&r->mu);
    double elapsed = (double)(now - r->t0_ns) / 1e9, frac;
    if (total)
        frac = (double)done / (double)total;
    else
        frac = r->o->duration_s > 0 ? elapsed / r->o->duration_s : 0;
    frac = frac < 0 ? 0 : frac > 1 ? 1 : frac;
    char bar[25];
    int fill = (int)(frac * 24 + 0.5);
    for (int i = 0; i < 24; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[24] = 0;
    char count[48];
    if (total)
        snprintf(count, sizeof count, "%zu/%zu", done, total);
    else
        snprintf(count, sizeof count, "%zu", done);
    fprintf(stderr,
            "\r%s[%s] %s done  %.1f s  ok %zu  refused %zu  failed %zu  in flight %zu\033[K",
            pg->label, bar, count, elapsed, ok, refused, failed, inflight);
    fflush(stderr);
}

static void progress_end(struct progress *pg)
{
    if (pg->on) {
        fprintf(stderr, "\r\033[K");
        fflush(stderr);
    }
}

/* Wait on r->done for at most ms (called with r->mu held). */
static void wait_done(struct run *r, uint32_t ms)
{
    struct timespec ts = kvr_deadline_after_ms(ms);
    pthread_cond_timedwait(&r->done, &r->mu, &ts);
}

/* ---- one load level -------------------------------------------------------------------------- */

struct level {
    double rate;          /* offered rate (open loop), or 0 */
    uint32_t concurrency; /* closed loop, or 0 */
    struct kvr_lg_record *rec;
    size_t n_rec;
    struct kvr_lg_result res;
    double wall_s;    /* first send to last response */
    double t0_unix_s; /* wall-clock time of the run's start, to line up separate runs */
};

struct env {
    const struct opts *o;
    struct kvr_httpc_url url;
    const char *model;
    const struct kvr_tok *tok;
    const char *path;
    bool tty;
};

/* Run one level: schedule, dispatch, wait for every request, aggregate. */
static int run_level(const struct env *env, struct level *lv, const char *label)
{
    const struct opts *o = env->o;
    struct run *r = kvr_calloc(1, sizeof *r);
    if (!r)
        return KVR_ENOMEM;
    r->o = o;
    r->url = &env->url;
    r->model = env->model;
    r->tok = env->tok;
    r->path = env->path;
    r->rate = lv->rate;
    r->concurrency = lv->concurrency;
    r->max_concurrency = o->max_concurrency;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->store.mu, NULL);
    pthread_cond_init(&r->work, NULL);
    pthread_cond_init(&r->done, NULL);
    struct progress pg = {.on = env->tty && !o->quiet, .label = label};
    double *arrivals = NULL;
    int rc = 0;
    if (lv->rate > 0) {
        struct kvr_lg_schedule_spec spec = {.rate_per_s = lv->rate,
                                            .burstiness = o->burstiness,
                                            .seed = o->seed,
                                            .max_requests = o->num_requests,
                                            .duration_s = o->duration_s};
        struct kvr_err err = {0};
        size_t n = 0;
        if ((rc = kvr_lg_schedule(&spec, &arrivals, &n, &err)) != 0) {
            fprintf(stderr, "kvasir bench: %s\n", err.msg);
            goto out;
        }
        r->arrivals = arrivals;
        r->n_sched = n;
        r->queue = kvr_malloc((n ? n : 1) * sizeof *r->queue);
        if (!r->queue) {
            rc = KVR_ENOMEM;
            goto out;
        }
    } else {
        r->limit = o->num_requests;
    }

    r->t0_ns = kvr_now_ns();
    lv->t0_unix_s = (double)kvr_wall_ms() / 1e3;
    if (lv->rate > 0) {
        for (size_t i = 0; i < r->n_sched && !stop_flag; i++) {
            uint64_t due = r->t0_ns + (uint64_t)(r->arrivals[i] * 1e9);
            for (uint64_t now = kvr_now_ns(); now < due && !stop_flag; now = kvr_now_ns()) {
                uint64_t left = due - now;
                kvr_sleep_ns(left < PROGRESS_NS / 2 ? left : PROGRESS_NS / 2);
                progress_show(&pg, r, false);
            }
            pthread_mutex_lock(&r->mu);
            while (r->max_concurrency && !stop_flag &&
                   r->n_inflight + (r->q_tail - r->q_head) >= r->max_concurrency) {
                wait_done(r, 100);
                pthread_mutex_unlock(&r->mu);
                progress_show(&pg, r, false);
                pthread_mutex_lock(&r->mu);
            }
            if (stop_flag) {
                pthread_mutex_unlock(&r->mu);
                break;
            }
            r->queue[r->q_tail++] = i;
            r->n_dispatched++;
            if (r->q_tail - r->q_head > r->n_free) {
                r->n_free++;
                if (spawn_worker(r, open_worker)) {
                    r->n_free--;
                    if (r->n_workers == 0) {
                        pthread_mutex_unlock(&r->mu);
                        fprintf(stderr, "kvasir bench: cannot start a thread\n");
                        rc = KVR_EIO;
                        goto out;
                    }
                    /* The queued request waits for a busy worker: the schedule slips. */
                }
            }
            pthread_cond_signal(&r->work);
            pthread_mutex_unlock(&r->mu);
        }
        pthread_mutex_lock(&r->mu);
        r->quit = true;
        pthread_cond_broadcast(&r->work);
        pthread_mutex_unlock(&r->mu);
    } else {
        if (o->duration_s > 0)
            r->end_ns = r->t0_ns + (uint64_t)(o->duration_s * 1e9);
        pthread_mutex_lock(&r->mu);
        for (uint32_t i = 0; i < lv->concurrency; i++)
            if (spawn_worker(r, closed_worker)) {
                if (r->n_workers == 0) {
                    pthread_mutex_unlock(&r->mu);
                    fprintf(stderr, "kvasir bench: cannot start a thread\n");
                    rc = KVR_EIO;
                    goto out;
                }
                break;
            }
        pthread_mutex_unlock(&r->mu);
    }
    /* Every request has a deadline, so this wait ends. */
    pthread_mutex_lock(&r->mu);
    while (r->n_exited < r->n_workers) {
        wait_done(r, 100);
        pthread_mutex_unlock(&r->mu);
        progress_show(&pg, r, false);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    progress_show(&pg, r, true);
    progress_end(&pg);

out:
    for (size_t i = 0; i < r->n_workers; i++)
        pthread_join(r->workers[i], NULL);
    if (rc == 0) {
        uint64_t last = r->t_last_end_ns > r->t0_ns ? r->t_last_end_ns : r->t0_ns;
        lv->wall_s = (double)(last - r->t0_ns) / 1e9;
        lv->rec = store_gather(&r->store, &lv->n_rec);
        if (!lv->rec)
            rc = KVR_ENOMEM;
        else
            rc = kvr_lg_aggregate(lv->rec, lv->n_rec, lv->wall_s, o->ttft_budget_ms / 1e3,
                                  o->total_budget_ms / 1e3, &lv->res);
    }
    store_fini(&r->store);
    pthread_cond_destroy(&r->work);
    pthread_cond_destroy(&r->done);
    pthread_mutex_destroy(&r->mu);
    kvr_free(r->workers);
    kvr_free(r->queue);
    kvr_free(arrivals);
    kvr_free(r);
    return rc;
}

/* ---- reporting ------------------------------------------------------------------------------- */

static void describe_load(char *buf, size_t cap, const struct opts *o, const struct level *lv)
{
    char limit[96] = "";
    if (o->num_requests && o->duration_s > 0)
        snprintf(limit, sizeof limit, "up to %u requests within %.4g s", o->num_requests,
                 o->duration_s);
    else if (o->num_requests)
        snprintf(limit, sizeof limit, "%u requests", o->num_requests);
    else
        snprintf(limit, sizeof limit, "for %.4g s", o->duration_s);
    if (lv->concurrency)
        snprintf(buf, cap, "closed loop, %u in flight, %s", lv->concurrency, limit);
    else if (isinf(lv->rate))
        snprintf(buf, cap, "all at once, %s", limit);
    else if (o->burstiness == 1)
        snprintf(buf, cap, "Poisson arrivals at %.4g req/s, %s", lv->rate, limit);
    else
        snprintf(buf, cap, "gamma arrivals (burstiness %.3g) at %.4g req/s, %s", o->burstiness,
                 lv->rate, limit);
    if (o->max_concurrency && !lv->concurrency) {
        size_t used = strlen(buf);
        snprintf(buf + used, cap - used, ", at most %u in flight", o->max_concurrency);
    }
}

static void fmt_range(char *buf, size_t cap, const struct kvr_lg_range *r)
{
    if (r->lo == r->hi)
        snprintf(buf, cap, "%u", r->lo);
    else
        snprintf(buf, cap, "%u..%u (uniform)", r->lo, r->hi);
}

static void print_ms_row(const char *name, const struct kvr_lg_summary *s)
{
    if (s->n == 0) {
        printf("  %-8s %7zu %9s %9s %9s %9s %9s\n", name, s->n, "-", "-", "-", "-", "-");
        return;
    }
    printf("  %-8s %7zu %9.2f %9.2f %9.2f %9.2f %9.2f\n", name, s->n, s->mean * 1e3, s->p50 * 1e3,
           s->p90 * 1e3, s->p99 * 1e3, s->max * 1e3);
}

static void print_reasons(const char *what, const struct kvr_lg_reason_count *t, size_t n)
{
    if (n == 0)
        return;
    printf("  %-14s", what);
    for (size_t i = 0; i < n; i++) {
        if (t[i].http_status)
            printf("%s %d %s x%zu", i ? "," : "", t[i].http_status, t[i].reason, t[i].n);
        else
            printf("%s %s x%zu", i ? "," : "", t[i].reason, t[i].n);
    }
    printf("\n");
}

static void print_level(const struct env *env, const struct level *lv)
{
    const struct opts *o = env->o;
    const struct kvr_lg_result *res = &lv->res;
    char load[192], pl[48], ol[48];
    describe_load(load, sizeof load, o, lv);
    fmt_range(pl, sizeof pl, &o->prompt_len);
    fmt_range(ol, sizeof ol, &o->output_len);
    printf("==================== kvasir bench ====================\n");
    printf("  target        http://%s:%s%s%s (model %s)\n", env->url.host, env->url.port,
           env->url.base_path, env->path, env->model);
    printf("  load          %s\n", load);
    printf("  lengths       prompt %s tokens%s, output %s tokens\n", pl,
           env->tok ? "" : " (as words)", ol);
    if (o->ttft_budget_ms || o->total_budget_ms) {
        printf("  budget        ");
        if (o->ttft_budget_ms)
            printf("first token %u ms%s", o->ttft_budget_ms, o->total_budget_ms ? ", " : "");
        if (o->total_budget_ms)
            printf("total %u ms", o->total_budget_ms);
        printf("\n");
    } else {
        printf("  budget        none sent (the server's defaults apply; goodput = ok)\n");
    }
    printf("  duration      %.2f s (first send to last response)\n", lv->wall_s);
    printf("------------------------------------------------------\n");
    printf("  requests      %zu: %zu ok, %zu refused, %zu errors, %zu timeouts\n", res->n_total,
           res->n_outcome[KVR_LG_OK], res->n_outcome[KVR_LG_REFUSED], res->n_outcome[KVR_LG_ERROR],
           res->n_outcome[KVR_LG_TIMEOUT]);
    print_reasons("refused", res->refused, res->n_refused_reasons);
    print_reasons("errors", res->errors, res->n_error_reasons);
    printf("  throughput    %.2f req/s, %.1f output tok/s, %.1f total tok/s\n", res->req_per_s,
           res->output_tok_per_s, res->total_tok_per_s);
    printf("  goodput       %.2f req/s (%zu of %zu met the budget)\n", res->goodput_req_per_s,
           res->n_met_budget, res->n_total);
    printf("  tokens        %llu prompt, %llu output (ok requests)\n",
           (unsigned long long)res->prompt_tokens, (unsigned long long)res->output_tokens);
    printf("------------------------------------------------------\n");
    printf("  %-8s %7s %9s %9s %9s %9s %9s\n", "ms", "n", "mean", "p50", "p90", "p99", "max");
    print_ms_row("TTFT", &res->ttft_s);
    print_ms_row("TPOT", &res->tpot_s);
    print_ms_row("ITL", &res->itl_s);
    print_ms_row("E2E", &res->e2e_s);
    print_ms_row("refusal", &res->refusal_s);
    if (res->refusal_s.n)
        printf("  refusals within %.0f ms: %s (%zu slower)\n", KVR_LG_REFUSAL_LIMIT_S * 1e3,
               res->n_refusal_over_limit ? "NO" : "all", res->n_refusal_over_limit);
    printf("======================================================\n");
}

static void print_sweep_table(const struct level *lv, size_t n)
{
    printf("\n%8s %6s %6s %7s %6s %9s %9s %9s %9s %8s %8s\n", "rate", "sent", "ok", "refused",
           "failed", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99", "tput", "goodput");
    printf("%8s %6s %6s %7s %6s %9s %9s %9s %9s %8s %8s\n", "req/s", "", "", "", "", "ms", "ms",
           "ms", "ms", "req/s", "req/s");
    for (size_t i = 0; i < n; i++) {
        const struct kvr_lg_result *r = &lv[i].res;
        printf("%8.4g %6zu %6zu %7zu %6zu %9.1f %9.1f %9.1f %9.1f %8.2f %8.2f\n", lv[i].rate,
               r->n_total, r->n_outcome[KVR_LG_OK], r->n_outcome[KVR_LG_REFUSED],
               r->n_outcome[KVR_LG_ERROR] + r->n_outcome[KVR_LG_TIMEOUT], r->ttft_s.p50 * 1e3,
               r->ttft_s.p99 * 1e3, r->e2e_s.p50 * 1e3, r->e2e_s.p99 * 1e3, r->req_per_s,
               r->goodput_req_per_s);
    }
}

/* ---- JSON ------------------------------------------------------------------------------------ */

/* Seconds as milliseconds rounded to the microsecond; NaN (no data) as null. */
static json_t *ms(double s)
{
    return isfinite(s) ? json_real(round(s * 1e6) / 1e3) : json_null();
}

static json_t *secs(double s)
{
    return isfinite(s) ? json_real(round(s * 1e6) / 1e6) : json_null();
}

static json_t *summary_json(const struct kvr_lg_summary *s)
{
    return json_pack("{s:I, s:o, s:o, s:o, s:o, s:o, s:o}", "n", (json_int_t)s->n, "mean",
                     ms(s->mean), "min", ms(s->min), "p50", ms(s->p50), "p90", ms(s->p90), "p99",
                     ms(s->p99), "max", ms(s->max));
}

static json_t *reasons_json(const struct kvr_lg_reason_count *t, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(a, json_pack("{s:i, s:s, s:I}", "status", t[i].http_status, "reason",
                                           t[i].reason, "n", (json_int_t)t[i].n));
    return a;
}

static json_t *level_json(const struct level *lv)
{
    const struct kvr_lg_result *r = &lv->res;
    json_t *refusal = summary_json(&r->refusal_s);
    json_object_set_new(refusal, "over_limit", json_integer((json_int_t)r->n_refusal_over_limit));
    json_object_set_new(refusal, "limit_ms", json_real(KVR_LG_REFUSAL_LIMIT_S * 1e3));
    json_t *summary = json_pack(
        "{s:o, s:{s:I, s:I, s:I, s:I, s:I, s:I}, s:o, s:o, s:{s:o, s:o, s:o, s:o}, "
        "s:{s:I, s:I}, s:o, s:o, s:o, s:o, s:o}",
        "duration_s", secs(lv->wall_s), "requests", "total", (json_int_t)r->n_total, "ok",
        (json_int_t)r->n_outcome[KVR_LG_OK], "refused", (json_int_t)r->n_outcome[KVR_LG_REFUSED],
        "error", (json_int_t)r->n_outcome[KVR_LG_ERROR], "timeout",
        (json_int_t)r->n_outcome[KVR_LG_TIMEOUT], "met_budget", (json_int_t)r->n_met_budget,
        "refused_by", reasons_json(r->refused, r->n_refused_reasons), "errors_by",
        reasons_json(r->errors, r->n_error_reasons), "throughput", "requests_per_s",
        json_real(r->req_per_s), "output_tokens_per_s", json_real(r->output_tok_per_s),
        "total_tokens_per_s", json_real(r->total_tok_per_s), "goodput_requests_per_s",
        json_real(r->goodput_req_per_s), "tokens", "prompt", (json_int_t)r->prompt_tokens, "output",
        (json_int_t)r->output_tokens, "ttft_ms", summary_json(&r->ttft_s), "tpot_ms",
        summary_json(&r->tpot_s), "itl_ms", summary_json(&r->itl_s), "e2e_ms",
        summary_json(&r->e2e_s), "refusal_ms", refusal);
    json_t *reqs = json_array();
    for (size_t i = 0; i < lv->n_rec; i++) {
        const struct kvr_lg_record *q = &lv->rec[i];
        json_t *itl = json_array();
        for (uint32_t k = 0; k < q->n_itl; k++)
            json_array_append_new(itl, ms(q->itl_s[k]));
        json_array_append_new(
            reqs, json_pack("{s:I, s:o, s:o, s:s, s:i, s:s, s:s, s:I, s:I, s:I, s:o, s:o, s:o, "
                            "s:b, s:o}",
                            "index", (json_int_t)q->index, "scheduled_s", secs(q->scheduled_s),
                            "start_s", secs(q->start_s), "outcome", kvr_lg_outcome_name(q->outcome),
                            "status", q->http_status, "reason", q->reason, "message", q->message,
                            "prompt_tokens", (json_int_t)q->prompt_tokens, "output_tokens",
                            (json_int_t)q->output_tokens, "max_tokens", (json_int_t)q->max_tokens,
                            "ttft_ms", ms(q->ttft_s), "e2e_ms", ms(q->e2e_s), "response_ms",
                            ms(q->response_s), "met_budget", q->met_budget, "itl_ms", itl));
    }
    json_t *l = json_object();
    json_object_set_new(l, "offered_rate",
                        lv->concurrency || isinf(lv->rate) ? json_null() : json_real(lv->rate));
    json_object_set_new(l, "concurrency",
                        lv->concurrency ? json_integer(lv->concurrency) : json_null());
    json_object_set_new(l, "t0_unix_s", json_real(lv->t0_unix_s));
    json_object_set_new(l, "summary", summary);
    json_object_set_new(l, "requests", reqs);
    return l;
}

static int write_json(const struct env *env, const struct level *lv, size_t n)
{
    const struct opts *o = env->o;
    json_t *cfg = json_pack(
        "{s:s, s:s, s:s, s:s, s:o, s:f, s:o, s:o, s:o, s:o, s:[i,i], s:[i,i], s:o, s:o, s:I, "
        "s:i, s:o, s:b}",
        "url", o->url, "endpoint", env->path, "model", env->model, "mode",
        o->concurrency                    ? "closed"
        : o->n_sweep > 0 || o->sweep_auto ? "sweep"
                                          : "open",
        "rate",
        o->concurrency || o->n_sweep || o->sweep_auto || isinf(o->rate) ? json_null()
                                                                        : json_real(o->rate),
        "burstiness", o->burstiness, "concurrency",
        o->concurrency ? json_integer(o->concurrency) : json_null(), "max_concurrency",
        o->max_concurrency ? json_integer(o->max_concurrency) : json_null(), "num_requests",
        o->num_requests ? json_integer(o->num_requests) : json_null(), "duration_s",
        o->duration_s > 0 ? json_real(o->duration_s) : json_null(), "prompt_len",
        (int)o->prompt_len.lo, (int)o->prompt_len.hi, "output_len", (int)o->output_len.lo,
        (int)o->output_len.hi, "ttft_budget_ms",
        o->ttft_budget_ms ? json_integer(o->ttft_budget_ms) : json_null(), "total_budget_ms",
        o->total_budget_ms ? json_integer(o->total_budget_ms) : json_null(), "seed",
        (json_int_t)o->seed, "timeout_s", (int)o->timeout_s, "tokenizer",
        o->gguf ? json_string(o->gguf) : json_null(), "exact_prompt_tokens",
        o->gguf != NULL && o->endpoint == EP_COMPLETIONS);
    json_t *runs = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(runs, level_json(&lv[i]));
    json_t *root = json_pack("{s:s, s:i, s:o, s:o}", "tool", "kvasir bench", "version", 1, "config",
                             cfg, "runs", runs);
    int rc = root ? json_dump_file(root, o->json_path, JSON_COMPACT | JSON_REAL_PRECISION(12)) : -1;
    json_decref(root);
    if (rc) {
        fprintf(stderr, "kvasir bench: cannot write %s\n", o->json_path);
        return -1;
    }
    return 0;
}

/* ---- SVG ------------------------------------------------------------------------------------- */

static int write_svg(const struct env *env, const struct level *lv, size_t n)
{
    const struct opts *o = env->o;
    struct kvr_bench_point *pts = kvr_calloc(n, sizeof *pts);
    if (!pts)
        return -1;
    for (size_t i = 0; i < n; i++)
        pts[i] =
            (struct kvr_bench_point){.rate = lv[i].rate, .wall_s = lv[i].wall_s, .res = &lv[i].res};
    char budget[128] = "no latency budget", pl[48], ol[48], load[160];
    if (o->ttft_budget_ms || o->total_budget_ms)
        snprintf(budget, sizeof budget, "budget: first token %u ms, total %u ms", o->ttft_budget_ms,
                 o->total_budget_ms);
    fmt_range(pl, sizeof pl, &o->prompt_len);
    fmt_range(ol, sizeof ol, &o->output_len);
    if (o->num_requests && o->duration_s > 0)
        snprintf(load, sizeof load, "up to %u requests in %.4g s per rate", o->num_requests,
                 o->duration_s);
    else if (o->num_requests)
        snprintf(load, sizeof load, "%u requests per rate", o->num_requests);
    else
        snprintf(load, sizeof load, "%.4g s per rate", o->duration_s);
    struct kvr_sbuf title;
    kvr_sbuf_init(&title);
    kvr_sbuf_printf(&title,
                    "kvasir bench: %s at %s%s\n%s arrivals, %s; prompt %s, output %s tokens; %s",
                    env->model, env->url.host, env->path, o->burstiness == 1 ? "Poisson" : "gamma",
                    load, pl, ol, budget);
    int rc = kvr_bench_svg_write(o->svg_path, title.failed ? "kvasir bench" : title.data,
                                 o->ttft_budget_ms, o->total_budget_ms, pts, n);
    kvr_sbuf_fini(&title);
    kvr_free(pts);
    return rc;
}

/* ---- the command ----------------------------------------------------------------------------- */

/* The served model's name from GET /v1/models (data[0].id). */
static char *fetch_model(const struct env *env, uint32_t timeout_ms)
{
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    char *name = NULL;
    int rc = kvr_httpc_get(&env->url, "/v1/models", env->o->api_key, timeout_ms, &resp, &err);
    if (rc) {
        fprintf(stderr, "kvasir bench: cannot reach %s: %s\n", env->o->url, err.msg);
    } else if (resp.status != 200) {
        fprintf(stderr, "kvasir bench: GET /v1/models answered %d%s%.200s\n", resp.status,
                resp.body ? ": " : "", resp.body ? resp.body : "");
    } else {
        json_t *j = resp.body ? json_loadb(resp.body, resp.body_len, 0, NULL) : NULL;
        json_t *id = json_object_get(json_array_get(json_object_get(j, "data"), 0), "id");
        if (json_is_string(id))
            name = kvr_strdup(json_string_value(id));
        else
            fprintf(stderr, "kvasir bench: GET /v1/models names no model; use --model\n");
        json_decref(j);
    }
    kvr_httpc_resp_fini(&resp);
    return name;
}

static double round3(double x)
{
    if (!(x > 0) || !isfinite(x))
        return x;
    double mag = pow(10, floor(log10(x)) - 2);
    return round(x / mag) * mag;
}

/* --sweep-auto: a short sequential probe gives one request's E2E; rates then double from
 * half of what one stream alone could carry until goodput falls below half the offered
 * rate, or after 8 levels. */
static int auto_rates(const struct env *env, double *rates, int cap)
{
    struct opts po = *env->o;
    po.num_requests = 3;
    po.duration_s = 0;
    po.quiet = true;
    struct env pe = *env;
    pe.o = &po;
    struct level probe = {.concurrency = 1};
    int rc = run_level(&pe, &probe, "probe ");
    double e2e = probe.res.e2e_s.mean;
    size_t ok = probe.res.n_outcome[KVR_LG_OK];
    free_records(probe.rec, probe.n_rec);
    if (rc || ok == 0 || !(e2e > 0)) {
        fprintf(stderr, "kvasir bench: the probe for --sweep-auto got no answer (%zu ok)\n", ok);
        return -1;
    }
    double r0 = round3(0.5 / e2e);
    printf("sweep-auto: one request takes %.1f ms end to end; rates from %.3g req/s\n", e2e * 1e3,
           r0);
    for (int i = 0; i < cap; i++)
        rates[i] = round3(r0 * pow(2, i));
    return cap;
}

int kvr_cmd_bench(int argc, char **argv)
{
    struct opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc)
        return rc == 1 ? 0 : rc;
    struct env env = {.o = &o,
                      .tty = isatty(STDERR_FILENO) != 0,
                      .path = o.endpoint == EP_CHAT ? "/v1/chat/completions" : "/v1/completions"};
    struct kvr_err err = {0};
    if (kvr_httpc_url_parse(&env.url, o.url, &err)) {
        fprintf(stderr, "kvasir bench: --url: %s\n", err.msg);
        return 2;
    }
    kvr_cli_on_stop(on_signal);

    struct kvr_tok *tok = NULL;
    char *model = NULL;
    struct level *lv = NULL;
    size_t n_lv = 0, want = 0;
    rc = 1;
    if (o.gguf) {
        struct kvr_gguf *g = NULL;
        if (kvr_gguf_open(&g, o.gguf, &err) || kvr_tok_create(&tok, g, &err)) {
            fprintf(stderr, "kvasir bench: %s: %s\n", o.gguf, err.msg);
            kvr_gguf_close(g);
            goto out;
        }
        kvr_gguf_close(g);
        env.tok = tok;
    }
    uint32_t probe_ms = o.timeout_s < 30 ? o.timeout_s * 1000 : 30000;
    model = o.model ? kvr_strdup(o.model) : fetch_model(&env, probe_ms);
    if (!model)
        goto out;
    env.model = model;
    if (o.multi_turn) {
        struct kvr_multiturn_spec mt = {.url = &env.url,
                                        .api_key = o.api_key,
                                        .model = model,
                                        .n_conversations = o.mt_conversations,
                                        .n_turns = o.mt_turns,
                                        .system_words = o.mt_system_words,
                                        .turn_lo = o.mt_turn_words.lo,
                                        .turn_hi = o.mt_turn_words.hi,
                                        .output_tokens = o.output_len.lo,
                                        .seed = o.seed,
                                        .timeout_s = o.timeout_s};
        rc = kvr_bench_multiturn(&mt);
        goto out;
    }

    double rates[MAX_SWEEP];
    int n_rates = 0;
    if (o.n_sweep) {
        memcpy(rates, o.sweep, sizeof rates);
        n_rates = o.n_sweep;
    } else if (o.sweep_auto) {
        if ((n_rates = auto_rates(&env, rates, 8)) < 0)
            goto out;
    }
    want = n_rates ? (size_t)n_rates : 1;
    lv = kvr_calloc(want, sizeof *lv);
    if (!lv)
        goto out;
    if (!n_rates) {
        lv[0].rate = o.concurrency ? 0 : o.rate;
        lv[0].concurrency = o.concurrency;
        if (run_level(&env, &lv[0], "") == 0)
            n_lv = 1;
        if (n_lv)
            print_level(&env, &lv[0]);
    } else {
        for (int i = 0; i < n_rates && !stop_flag; i++) {
            lv[i].rate = rates[i];
            if (o.duration_s > 0 && rates[i] * o.duration_s > KVR_LG_MAX_REQUESTS / 2) {
                fprintf(stderr, "kvasir bench: rate %.3g req/s would need too many requests\n",
                        rates[i]);
                break;
            }
            char label[48];
            snprintf(label, sizeof label, "%.3g req/s ", rates[i]);
            if (run_level(&env, &lv[i], label))
                break;
            n_lv++;
            const struct kvr_lg_result *r = &lv[i].res;
            printf("rate %8.4g req/s: %zu sent, %zu ok, %zu refused, %zu failed; TTFT p50 %.1f "
                   "ms, E2E p99 %.1f ms, goodput %.2f req/s\n",
                   rates[i], r->n_total, r->n_outcome[KVR_LG_OK], r->n_outcome[KVR_LG_REFUSED],
                   r->n_outcome[KVR_LG_ERROR] + r->n_outcome[KVR_LG_TIMEOUT], r->ttft_s.p50 * 1e3,
                   r->e2e_s.p99 * 1e3, r->goodput_req_per_s);
            fflush(stdout);
            if (o.sweep_auto && r->goodput_req_per_s < 0.5 * rates[i])
                break; /* saturated: more load only shows more refusals */
        }
        if (n_lv)
            print_sweep_table(lv, n_lv);
    }
    if (n_lv == 0)
        goto out;
    rc = 0;
    if (stop_flag) {
        fprintf(stderr, "kvasir bench: interrupted; the results cover what had finished\n");
        rc = 130; /* as a shell reports SIGINT: the run is not complete */
    }
    if (o.json_path && write_json(&env, lv, n_lv))
        rc = rc ? rc : 1;
    if (o.svg_path && write_svg(&env, lv, n_lv))
        rc = rc ? rc : 1;
    /* A run where no request got any HTTP answer measured nothing about the server. */
    bool any_answer = false;
    for (size_t i = 0; i < n_lv && !any_answer; i++)
        for (size_t k = 0; k < lv[i].n_rec && !any_answer; k++)
            any_answer = lv[i].rec[k].http_status != 0;
    if (!any_answer) {
        fprintf(stderr, "kvasir bench: no request got an answer from %s\n", o.url);
        rc = 1;
    }
out:
    for (size_t i = 0; lv && i < want; i++)
        free_records(lv[i].rec, lv[i].n_rec);
    kvr_free(lv);
    kvr_free(model);
    kvr_tok_destroy(tok);
    return rc;
}
