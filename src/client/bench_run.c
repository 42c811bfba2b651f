/* bench_run.c - one load level of `kvasir bench` (see bench_run.h): prompts, one streamed
 * request, the worker threads of the open and closed loops, and the level's dispatcher. */
#include "client/bench_run.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/sbuf.h"

#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RECORD_BLOCK 1024
#define WORKER_STACK_BYTES (512u << 10)
#define PROGRESS_NS (200 * 1000000ull)

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
static int encode(const struct kvr_bench_tokenizer *tok, struct prompt *p, bool add_special)
{
    if (p->text.failed)
        return KVR_ENOMEM;
    size_t len = p->text.len;
    int n = 0;
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
        n = tok->encode(tok->ud, p->text.data ? p->text.data : "", len, add_special, p->ids,
                        p->ids_cap);
        if (n == KVR_EFULL)
            n = 0;
        else if (n == 0)
            break; /* an empty encoding */
    }
    return n;
}

/* Random words making `target` tokens. Without a tokenizer one word stands for one token
 * (the server's usage count then says what it really was). */
static int build_prompt(struct prompt *p, const struct kvr_bench_tokenizer *tok, bool chat,
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
    const struct kvr_bench_spec *s;
    /* open loop */
    double rate;
    double *arrivals; /* seconds after t0_ns, one per request; owned */
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
    uint64_t progress_ns; /* when the progress hook last ran (dispatching thread only) */
};

static bool cancelled(const struct run *r)
{
    return r->s->cancel && *r->s->cancel;
}

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
    const struct kvr_bench_spec *s = r->s;
    json_t *b = json_object();
    if (!b)
        return NULL;
    json_object_set_new(b, "model", json_string(s->model));
    if (s->endpoint == KVR_BENCH_CHAT) {
        json_t *msg =
            json_pack("{s:s, s:s}", "role", "user", "content", p->text.data ? p->text.data : "");
        json_object_set_new(b, "messages", json_pack("[o]", msg));
        json_object_set_new(b, "max_completion_tokens", json_integer(max_tokens));
    } else if (s->tok) {
        json_t *ids = json_array();
        for (uint32_t i = 0; i < p->n_tokens; i++)
            json_array_append_new(ids, json_integer(p->ids[i]));
        json_object_set_new(b, "prompt", ids);
    } else {
        json_object_set_new(b, "prompt", json_string(p->text.data ? p->text.data : ""));
    }
    if (s->endpoint != KVR_BENCH_CHAT)
        json_object_set_new(b, "max_tokens", json_integer(max_tokens));
    json_object_set_new(b, "stream", json_true());
    json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
    /* vLLM's name for "generate max_tokens whatever the model says"; servers that do not
     * know it ignore it (Kvasir does), and then answers may be shorter. */
    json_object_set_new(b, "ignore_eos", json_true());
    json_object_set_new(b, "seed",
                        json_integer((json_int_t)((s->seed * 1000003u + index) & 0x7fffffff)));
    if (!isnan(s->temperature))
        json_object_set_new(b, "temperature", json_real(s->temperature));
    if (s->ttft_budget_ms || s->total_budget_ms) {
        json_t *lb = json_object();
        if (s->ttft_budget_ms)
            json_object_set_new(lb, "first_token_ms", json_integer(s->ttft_budget_ms));
        if (s->total_budget_ms)
            json_object_set_new(lb, "total_ms", json_integer(s->total_budget_ms));
        json_object_set_new(b, "latency_budget", lb);
    }
    char *text = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return text;
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

/* Fill the record's outcome, reason and stream numbers from what kvr_httpc_do returned
 * (rc) and what the stream said; the ITL array moves from the stream to the record. */
static void judge(struct run *r, struct kvr_lg_record *rec, int rc,
                  const struct kvr_httpc_resp *resp, struct stream *st, const struct kvr_err *err)
{
    if (rc) {
        rec->outcome = rc == KVR_ETIMEDOUT ? KVR_LG_TIMEOUT : KVR_LG_ERROR;
        set_reason(rec, cancelled(r) && rc == KVR_ECLOSED ? "interrupted" : client_reason(rc),
                   err->msg);
        return;
    }
    if (resp->status == 429 || resp->status == 503 || resp->status < 200 || resp->status >= 300) {
        char code[KVR_LG_REASON_BYTES], msg[KVR_LG_MESSAGE_BYTES] = "";
        snprintf(code, sizeof code, "http_%d", resp->status);
        json_t *j = resp->body ? json_loadb(resp->body, resp->body_len, 0, NULL) : NULL;
        if (json_is_object(json_object_get(j, "error")))
            copy_error(json_object_get(j, "error"), code, sizeof code, msg, sizeof msg);
        json_decref(j);
        rec->outcome = resp->status == 429 || resp->status == 503 ? KVR_LG_REFUSED : KVR_LG_ERROR;
        set_reason(rec, code, msg);
        return;
    }
    if (!resp->is_sse) {
        rec->outcome = KVR_LG_ERROR;
        set_reason(rec, "not_streamed", "a 2xx answer that is not text/event-stream");
    } else if (st->error) {
        rec->outcome = KVR_LG_ERROR;
        set_reason(rec, st->err_code, st->err_msg);
    } else if (!st->done) {
        rec->outcome = KVR_LG_ERROR;
        set_reason(rec, "truncated", "the stream ended without [DONE]");
    } else if (!st->got_text) {
        rec->outcome = KVR_LG_ERROR;
        set_reason(rec, "no_text", "the stream carried no text");
    } else {
        rec->outcome = KVR_LG_OK;
    }
    rec->ttft_s = st->got_text ? st->ttft_s : NAN;
    rec->itl_s = st->itl;
    rec->n_itl = st->n_itl;
    st->itl = NULL;
    if (st->usage_prompt > 0 && st->usage_prompt <= UINT32_MAX)
        rec->prompt_tokens = (uint32_t)st->usage_prompt;
    rec->output_tokens = st->usage_completion >= 0 && st->usage_completion <= UINT32_MAX
                             ? (uint32_t)st->usage_completion
                             : st->n_text_chunks;
}

/* Tally a finished request for the progress line and note when the last one ended. */
static void count_outcome(struct run *r, const struct kvr_lg_record *rec)
{
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

static void do_request(struct run *r, size_t index, double scheduled_s)
{
    const struct kvr_bench_spec *s = r->s;
    struct kvr_lg_record *rec = store_get(&r->store, index);
    if (!rec)
        return;
    rec->index = (uint32_t)index;
    rec->scheduled_s = scheduled_s;
    rec->ttft_s = rec->e2e_s = rec->response_s = NAN;
    /* Each request's lengths and words come from its own generator, so they do not depend
     * on which thread ran it or when. */
    struct kvr_lg_rng rng;
    kvr_lg_rng_seed(&rng, s->seed * 0x9E3779B97F4A7C15ull + index + 1);
    uint32_t n_prompt = kvr_lg_range_draw(&s->prompt_len, &rng);
    rec->max_tokens = kvr_lg_range_draw(&s->output_len, &rng);
    struct prompt p = {0};
    kvr_sbuf_init(&p.text);
    struct stream st = {
        .chat = s->endpoint == KVR_BENCH_CHAT, .usage_prompt = -1, .usage_completion = -1};
    struct kvr_httpc_resp resp = {0};
    struct kvr_err err = {0};
    char *body = NULL;
    int rc = build_prompt(&p, s->tok, st.chat, &rng, n_prompt);
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
                                .path = s->path,
                                .api_key = s->api_key,
                                .body = body,
                                .body_len = strlen(body),
                                .io_timeout_ms = s->timeout_s * 1000u,
                                .deadline_ns = st.t_start + (uint64_t)s->timeout_s * 1000000000ull,
                                .on_event = on_chunk,
                                .ud = &st,
                                .cancel = s->cancel};
    rc = kvr_httpc_do(s->url, &req, &resp, &err);
    rec->http_status = resp.status;
    if (resp.t_head_ns)
        rec->response_s = (double)(resp.t_head_ns - st.t_start) / 1e9;
    rec->e2e_s = (double)((st.done ? st.t_done : resp.t_end_ns) - st.t_start) / 1e9;
    judge(r, rec, rc, &resp, &st, &err);
done:
    kvr_free(st.itl);
    kvr_httpc_resp_fini(&resp);
    free(body); /* from json_dumps: jansson's allocator */
    kvr_sbuf_fini(&p.text);
    kvr_free(p.ids);
    count_outcome(r, rec);
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
        if (cancelled(r) || (r->limit && r->next_index >= r->limit) ||
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

/* Hand the progress hook a snapshot, at most every PROGRESS_NS unless final. Called only
 * from the level's own (dispatching) thread. */
static void progress(struct run *r, bool final)
{
    const struct kvr_bench_spec *s = r->s;
    if (!s->on_progress)
        return;
    uint64_t now = kvr_now_ns();
    if (!final && now - r->progress_ns < PROGRESS_NS)
        return;
    r->progress_ns = now;
    struct kvr_bench_progress p;
    pthread_mutex_lock(&r->mu);
    p.done = r->n_done;
    p.total = r->n_sched ? r->n_sched : r->limit;
    p.inflight = r->n_inflight;
    p.ok = r->n_ok;
    p.refused = r->n_refused;
    p.failed = r->n_failed;
    pthread_mutex_unlock(&r->mu);
    p.elapsed_s = (double)(now - r->t0_ns) / 1e9;
    s->on_progress(s->progress_ud, &p, final);
}

/* Wait on r->done for at most ms (called with r->mu held). */
static void wait_done(struct run *r, uint32_t ms)
{
    struct timespec ts = kvr_deadline_after_ms(ms);
    pthread_cond_timedwait(&r->done, &r->mu, &ts);
}

/* ---- one load level -------------------------------------------------------------------------- */

/* Open loop: draw the arrival times up front and make room for the queue. */
static int plan_open(struct run *r, double rate, struct kvr_err *err)
{
    const struct kvr_bench_spec *s = r->s;
    struct kvr_lg_schedule_spec spec = {.rate_per_s = rate,
                                        .burstiness = s->burstiness,
                                        .seed = s->seed,
                                        .max_requests = s->num_requests,
                                        .duration_s = s->duration_s};
    double *arrivals = NULL;
    size_t n = 0;
    int rc = kvr_lg_schedule(&spec, &arrivals, &n, err);
    if (rc)
        return rc;
    r->arrivals = arrivals;
    r->n_sched = n;
    r->queue = kvr_malloc((n ? n : 1) * sizeof *r->queue);
    return r->queue ? 0 : KVR_ENOMEM;
}

/* Queue request i for a worker, adding a worker when more requests wait than workers are
 * free. Called with r->mu held. */
static int dispatch_one(struct run *r, size_t i, struct kvr_err *err)
{
    r->queue[r->q_tail++] = i;
    r->n_dispatched++;
    if (r->q_tail - r->q_head > r->n_free) {
        r->n_free++;
        if (spawn_worker(r, open_worker)) {
            r->n_free--;
            if (r->n_workers == 0)
                return kvr_err_set(err, KVR_EIO, "cannot start a thread");
            /* The queued request waits for a busy worker: the schedule slips. */
        }
    }
    pthread_cond_signal(&r->work);
    return 0;
}

/* Open loop: release each request at its arrival time, then tell the workers to finish. */
static int run_open(struct run *r, struct kvr_err *err)
{
    for (size_t i = 0; i < r->n_sched && !cancelled(r); i++) {
        uint64_t due = r->t0_ns + (uint64_t)(r->arrivals[i] * 1e9);
        for (uint64_t now = kvr_now_ns(); now < due && !cancelled(r); now = kvr_now_ns()) {
            uint64_t left = due - now;
            kvr_sleep_ns(left < PROGRESS_NS / 2 ? left : PROGRESS_NS / 2);
            progress(r, false);
        }
        pthread_mutex_lock(&r->mu);
        while (r->max_concurrency && !cancelled(r) &&
               r->n_inflight + (r->q_tail - r->q_head) >= r->max_concurrency) {
            wait_done(r, 100);
            pthread_mutex_unlock(&r->mu);
            progress(r, false);
            pthread_mutex_lock(&r->mu);
        }
        if (cancelled(r)) {
            pthread_mutex_unlock(&r->mu);
            break;
        }
        int rc = dispatch_one(r, i, err);
        pthread_mutex_unlock(&r->mu);
        if (rc)
            return rc;
    }
    pthread_mutex_lock(&r->mu);
    r->quit = true;
    pthread_cond_broadcast(&r->work);
    pthread_mutex_unlock(&r->mu);
    return 0;
}

/* Closed loop: start the workers; each sends until the count or the time is used up. */
static int run_closed(struct run *r, struct kvr_err *err)
{
    const struct kvr_bench_spec *s = r->s;
    if (s->duration_s > 0)
        r->end_ns = r->t0_ns + (uint64_t)(s->duration_s * 1e9);
    int rc = 0;
    pthread_mutex_lock(&r->mu);
    for (uint32_t i = 0; i < r->concurrency; i++)
        if (spawn_worker(r, closed_worker)) {
            if (r->n_workers == 0)
                rc = kvr_err_set(err, KVR_EIO, "cannot start a thread");
            break;
        }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

/* Wait for every worker to exit; every request has a deadline, so this ends. */
static void wait_workers(struct run *r)
{
    pthread_mutex_lock(&r->mu);
    while (r->n_exited < r->n_workers) {
        wait_done(r, 100);
        pthread_mutex_unlock(&r->mu);
        progress(r, false);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    progress(r, true);
}

int kvr_bench_run_level(const struct kvr_bench_spec *s, struct kvr_bench_level *lv,
                        struct kvr_err *err)
{
    struct run *r = kvr_calloc(1, sizeof *r);
    if (!r)
        return KVR_ENOMEM;
    r->s = s;
    r->rate = lv->rate;
    r->concurrency = lv->concurrency;
    r->max_concurrency = s->max_concurrency;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->store.mu, NULL);
    pthread_cond_init(&r->work, NULL);
    pthread_cond_init(&r->done, NULL);
    int rc = 0;
    if (lv->rate > 0)
        rc = plan_open(r, lv->rate, err);
    else
        r->limit = s->num_requests;
    if (rc == 0) {
        r->t0_ns = kvr_now_ns();
        lv->t0_unix_s = (double)kvr_wall_ms() / 1e3;
        rc = lv->rate > 0 ? run_open(r, err) : run_closed(r, err);
        if (rc == 0)
            wait_workers(r);
    }
    for (size_t i = 0; i < r->n_workers; i++)
        pthread_join(r->workers[i], NULL);
    if (rc == 0) {
        uint64_t last = r->t_last_end_ns > r->t0_ns ? r->t_last_end_ns : r->t0_ns;
        lv->wall_s = (double)(last - r->t0_ns) / 1e9;
        lv->rec = store_gather(&r->store, &lv->n_rec);
        if (!lv->rec)
            rc = KVR_ENOMEM;
        else
            rc = kvr_lg_aggregate(lv->rec, lv->n_rec, lv->wall_s, s->ttft_budget_ms / 1e3,
                                  s->total_budget_ms / 1e3, &lv->res);
    }
    store_fini(&r->store);
    pthread_cond_destroy(&r->work);
    pthread_cond_destroy(&r->done);
    pthread_mutex_destroy(&r->mu);
    kvr_free(r->workers);
    kvr_free(r->queue);
    kvr_free(r->arrivals);
    kvr_free(r);
    return rc;
}

void kvr_bench_level_fini(struct kvr_bench_level *lv)
{
    free_records(lv->rec, lv->n_rec);
    lv->rec = NULL;
    lv->n_rec = 0;
}
