/* multiturn.c - `kvasir bench --multi-turn`'s conversations (see multiturn.h). */
#include "client/multiturn.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/sbuf.h"

#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const mt_words[] = {
    "story",  "river",  "light",  "friend", "garden", "little",   "morning", "happy",
    "bright", "forest", "window", "music",  "stone",  "dream",    "green",   "quiet",
    "walk",   "bird",   "table",  "summer", "winter", "road",     "house",   "apple",
    "cloud",  "paper",  "child",  "sea",    "song",   "mountain", "yellow",  "warm",
    "old",    "new",    "city",   "book",   "door",   "night",    "star",    "water",
    "fire",   "bread",  "horse",  "boat",   "letter", "market",   "teacher", "rain",
};
#define MT_N_WORDS (sizeof mt_words / sizeof mt_words[0])

struct conv {
    const struct kvr_multiturn_spec *spec;
    uint32_t index;
    struct kvr_multiturn_conv *out;
};

struct sse {
    uint64_t t_start;
    double ttft_s;
    bool got_text, done;
    struct kvr_sbuf *answer;
    int64_t usage_prompt;
};

static uint64_t mt_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void add_words(struct kvr_sbuf *b, uint64_t *rng, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        kvr_sbuf_append(b, " ", 1);
        kvr_sbuf_puts(b, mt_words[mt_next(rng) % MT_N_WORDS]);
    }
}

static int on_event(void *ud, const char *data, size_t len, uint64_t t_ns)
{
    struct sse *st = ud;
    if (len == 6 && !memcmp(data, "[DONE]", 6)) {
        st->done = true;
        return 0;
    }
    json_t *j = json_loadb(data, len, JSON_ALLOW_NUL, NULL);
    json_t *t = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text");
    if (json_is_string(t) && json_string_length(t) > 0) {
        if (!st->got_text) {
            st->got_text = true;
            st->ttft_s = (double)(t_ns - st->t_start) / 1e9;
        }
        kvr_sbuf_append(st->answer, json_string_value(t), json_string_length(t));
    }
    json_t *pt = json_object_get(json_object_get(j, "usage"), "prompt_tokens");
    if (json_is_integer(pt))
        st->usage_prompt = json_integer_value(pt);
    json_decref(j);
    return 0;
}

/* One completion: the answer's text is appended to `answer`. */
static int ask(const struct kvr_multiturn_spec *sp, const char *prompt, uint32_t seed,
               struct kvr_sbuf *answer, double *ttft_s, uint32_t *prompt_tokens)
{
    json_t *b =
        json_pack("{s:s, s:s, s:i, s:b, s:b, s:{s:b}, s:i, s:f}", "model", sp->model, "prompt",
                  prompt, "max_tokens", (int)sp->output_tokens, "stream", 1, "ignore_eos", 1,
                  "stream_options", "include_usage", 1, "seed", (int)seed, "temperature", 0.0);
    char *body = b ? json_dumps(b, JSON_COMPACT) : NULL;
    json_decref(b);
    if (!body)
        return -1;
    struct sse st = {.t_start = kvr_now_ns(), .answer = answer, .usage_prompt = -1};
    struct kvr_httpc_req req = {.method = "POST",
                                .path = "/v1/completions",
                                .api_key = sp->api_key,
                                .body = body,
                                .body_len = strlen(body),
                                .io_timeout_ms = sp->timeout_s * 1000u,
                                .deadline_ns = st.t_start + sp->timeout_s * 1000000000ull,
                                .on_event = on_event,
                                .ud = &st};
    struct kvr_httpc_resp resp = {0};
    struct kvr_err err = {0};
    int rc = kvr_httpc_do(sp->url, &req, &resp, &err);
    int status = resp.status;
    free(body);
    if (rc || status != 200 || !st.done || !st.got_text) {
        if (sp->on_failure)
            sp->on_failure(sp->ud, status, rc ? err.msg : "", resp.body ? resp.body : "");
        kvr_httpc_resp_fini(&resp);
        return -1;
    }
    kvr_httpc_resp_fini(&resp);
    *ttft_s = st.ttft_s;
    *prompt_tokens = st.usage_prompt > 0 ? (uint32_t)st.usage_prompt : 0;
    return 0;
}

static void *conversation(void *arg)
{
    struct conv *c = arg;
    const struct kvr_multiturn_spec *sp = c->spec;
    struct kvr_sbuf prompt;
    kvr_sbuf_init(&prompt);
    uint64_t sys_rng = sp->seed; /* the same system prompt for every conversation */
    kvr_sbuf_puts(&prompt, "System:");
    add_words(&prompt, &sys_rng, sp->system_words);
    uint64_t rng = sp->seed * 1000003u + c->index + 1;
    for (uint32_t t = 0; t < sp->n_turns && !c->out->failed; t++) {
        kvr_sbuf_puts(&prompt, "\nUser:");
        add_words(&prompt, &rng,
                  sp->turn_lo + (uint32_t)(mt_next(&rng) % (sp->turn_hi - sp->turn_lo + 1)));
        kvr_sbuf_puts(&prompt, "\nAssistant:");
        if (prompt.failed || ask(sp, prompt.data, c->index * 100 + t, &prompt, &c->out->ttft_s[t],
                                 &c->out->prompt_tokens[t]))
            c->out->failed = true;
    }
    kvr_sbuf_fini(&prompt);
    return NULL;
}

/* kvasir:prompt_tokens_computed_total from /metrics, or -1. */
static double computed_tokens(const struct kvr_multiturn_spec *sp)
{
    struct kvr_httpc_resp resp;
    struct kvr_err err = {0};
    double v = -1;
    if (kvr_httpc_get(sp->url, "/metrics", sp->api_key, 5000, &resp, &err) == 0 && resp.body) {
        /* The sample carries the model_name label: its value follows the "} ". */
        const char *k = strstr(resp.body, "\nkvasir:prompt_tokens_computed_total{");
        k = k ? strstr(k, "} ") : NULL;
        if (k)
            v = strtod(k + 2, NULL);
    }
    kvr_httpc_resp_fini(&resp);
    return v;
}

int kvr_multiturn_run(const struct kvr_multiturn_spec *sp, struct kvr_multiturn_result *res)
{
    uint32_t nc = sp->n_conversations, nt = sp->n_turns;
    memset(res, 0, sizeof *res);
    struct conv *cv = kvr_calloc(nc, sizeof *cv);
    pthread_t *th = kvr_calloc(nc, sizeof *th);
    res->conv = kvr_calloc(nc, sizeof *res->conv);
    if (!cv || !th || !res->conv) {
        kvr_free(cv);
        kvr_free(th);
        kvr_free(res->conv);
        res->conv = NULL;
        return KVR_ENOMEM;
    }
    res->computed_before = computed_tokens(sp);
    uint64_t t0 = kvr_now_ns();
    for (uint32_t i = 0; i < nc; i++) {
        struct kvr_multiturn_conv *out = &res->conv[i];
        out->ttft_s = kvr_calloc(nt, sizeof(double));
        out->prompt_tokens = kvr_calloc(nt, sizeof(uint32_t));
        cv[i] = (struct conv){.spec = sp, .index = i, .out = out};
        if (!out->ttft_s || !out->prompt_tokens ||
            pthread_create(&th[i], NULL, conversation, &cv[i]))
            break;
        res->n_started++;
    }
    for (uint32_t i = 0; i < res->n_started; i++)
        pthread_join(th[i], NULL);
    res->wall_s = (kvr_now_ns() - t0) / 1e9;
    res->computed_after = computed_tokens(sp);
    kvr_free(cv);
    kvr_free(th);
    return 0;
}

void kvr_multiturn_result_fini(struct kvr_multiturn_result *res, uint32_t n_conversations)
{
    for (uint32_t i = 0; res->conv && i < n_conversations; i++) {
        kvr_free(res->conv[i].ttft_s);
        kvr_free(res->conv[i].prompt_tokens);
    }
    kvr_free(res->conv);
    res->conv = NULL;
}
