/* test_http.c - the real HTTP server on 127.0.0.1 with a fake service, spoken to over plain
 * sockets: every kind of bad input gets its status and an OpenAI JSON error, and the server
 * still answers normally afterwards; completions and chat, JSON and SSE; stop strings,
 * logprobs, budgets, refusals with Retry-After, health, metrics, API keys; a client that
 * disconnects mid-stream is cancelled within a second; shutdown with streams running.
 *
 * The fake service (below) replays a fixed script of token ids from a tiny in-memory
 * SentencePiece vocabulary, with a configurable delay per token, and records what it was
 * asked and whether it was cancelled and released. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/http.h"
#include "bridge/telemetry.h"
#include "bridge/http_metrics.h"
#include "core/alloc.h"
#include "core/clock.h"
#include "model/tokenizer.h"

#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

/* ---- a tiny vocabulary ------------------------------------------------------------- */

/* ids: 0 <unk>, 1 <s>, 2 </s>, 3..258 <0x00>..<0xFF>, 259 "▁", 260.. printable ASCII
 * '!'..'~' (94), then the words and chat control tokens below. */
#define ID_BYTE(b) (3 + (b))
#define ID_SPACE 259
#define ID_ASCII(ch) (260 + ((ch) - '!'))
#define ID_WORDS (260 + 94)
static const char *const words[] = {"\xE2\x96\x81Once",
                                    "\xE2\x96\x81upon",
                                    "\xE2\x96\x81"
                                    "a",
                                    "\xE2\x96\x81time",
                                    "\xE2\x96\x81The",
                                    "\xE2\x96\x81"
                                    "end",
                                    "<|im_start|>",
                                    "<|im_end|>"};
enum { W_ONCE = ID_WORDS, W_UPON, W_A, W_TIME, W_THE, W_END, W_IM_START, W_IM_END, N_VOCAB };

static struct kvr_tok *make_tok(void)
{
    static char bytes[256][8];
    static char ascii[94][2];
    struct kvr_gguf_str toks[N_VOCAB];
    int32_t types[N_VOCAB];
    int n = 0;
    toks[n] = (struct kvr_gguf_str){5, "<unk>"}, types[n++] = KVR_TOK_TYPE_UNKNOWN;
    toks[n] = (struct kvr_gguf_str){3, "<s>"}, types[n++] = KVR_TOK_TYPE_CONTROL;
    toks[n] = (struct kvr_gguf_str){4, "</s>"}, types[n++] = KVR_TOK_TYPE_CONTROL;
    for (int b = 0; b < 256; b++) {
        snprintf(bytes[b], sizeof bytes[b], "<0x%02X>", b);
        toks[n] = (struct kvr_gguf_str){6, bytes[b]}, types[n++] = KVR_TOK_TYPE_BYTE;
    }
    toks[n] = (struct kvr_gguf_str){3, "\xE2\x96\x81"}, types[n++] = KVR_TOK_TYPE_NORMAL;
    for (int ch = '!'; ch <= '~'; ch++) {
        ascii[ch - '!'][0] = (char)ch;
        toks[n] = (struct kvr_gguf_str){1, ascii[ch - '!']}, types[n++] = KVR_TOK_TYPE_NORMAL;
    }
    for (size_t w = 0; w < sizeof words / sizeof words[0]; w++) {
        toks[n] = (struct kvr_gguf_str){strlen(words[w]), words[w]};
        types[n++] = words[w][0] == '<' ? KVR_TOK_TYPE_CONTROL : KVR_TOK_TYPE_NORMAL;
    }
    assert_int_equal(n, N_VOCAB);
    struct kvr_tok_vocab v;
    kvr_tok_vocab_init(&v, KVR_TOK_SPM);
    v.n_tokens = n;
    v.tokens = toks;
    v.types = types;
    struct kvr_tok *t = NULL;
    struct kvr_err err = {0};
    if (kvr_tok_create_from_vocab(&t, &v, &err))
        fail_msg("vocab: %s", err.msg);
    return t;
}

/* ---- the fake service --------------------------------------------------------------- */

struct fake {
    pthread_mutex_t mu;
    /* Behaviour, set by tests between requests. */
    const int32_t *script;
    uint32_t n_script;
    bool eos_after_script;                 /* after the script: EOS; otherwise repeat it */
    uint32_t delay_ms;                     /* before each token */
    enum kvr_refusal_reason refuse_reason; /* != NONE: refuse every submit */
    uint32_t refuse_retry_ms;
    bool refuse_never; /* the refusal says no retry can help */
    int fail_after;    /* >= 0: an error event after this many tokens */
    int fail_status;
    bool healthy;
    /* Observations. */
    int n_submit, n_cancel, n_release;
    uint64_t t_cancel_ns;
    int32_t last_prompt[4096];
    uint32_t last_n_prompt;
    struct kvr_gen_request last_req;
    char last_grammar[64]; /* the start of last_req's grammar ("" for none): it is borrowed */
};

struct kvr_gen_stream {
    struct fake *f;
    uint32_t pos, max_tokens;
    uint32_t n_top; /* alternatives per token: the script's next ids */
    bool cancelled, finished;
    uint64_t t_next_ns;
};

static int fake_submit(void *ctx, const struct kvr_gen_request *req, struct kvr_gen_stream **out,
                       struct kvr_refusal *refusal)
{
    struct fake *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->last_req = *req;
    f->last_n_prompt = req->n_prompt < 4096 ? req->n_prompt : 4096;
    memcpy(f->last_prompt, req->prompt, f->last_n_prompt * sizeof *req->prompt);
    f->last_req.prompt = NULL;
    snprintf(f->last_grammar, sizeof f->last_grammar, "%.*s",
             req->grammar ? (int)req->grammar_bytes : 0, req->grammar ? req->grammar : "");
    f->last_req.grammar = NULL;
    if (f->refuse_reason != KVR_REFUSE_NONE) {
        refusal->retry_after_ms = f->refuse_retry_ms;
        refusal->reason = f->refuse_reason;
        refusal->never = f->refuse_never;
        snprintf(refusal->message, sizeof refusal->message,
                 "would miss first-token budget: estimated 812 ms > 500 ms");
        pthread_mutex_unlock(&f->mu);
        return KVR_EAGAIN;
    }
    f->n_submit++;
    uint32_t delay = f->delay_ms;
    pthread_mutex_unlock(&f->mu);
    struct kvr_gen_stream *s = calloc(1, sizeof *s);
    s->f = f;
    s->max_tokens = req->max_tokens;
    s->n_top = req->logprobs ? req->top_logprobs : 0;
    s->t_next_ns = kvr_now_ns() + (uint64_t)delay * 1000000;
    *out = s;
    return 0;
}

static int fake_next(struct kvr_gen_stream *s, struct kvr_gen_event *ev, uint32_t timeout_ms)
{
    struct fake *f = s->f;
    if (s->cancelled || s->finished)
        return KVR_ECLOSED;
    uint64_t now = kvr_now_ns();
    if (now < s->t_next_ns) {
        uint64_t wait = s->t_next_ns - now;
        if (wait > (uint64_t)timeout_ms * 1000000) {
            kvr_sleep_ns((uint64_t)timeout_ms * 1000000);
            return KVR_ETIMEDOUT;
        }
        kvr_sleep_ns(wait);
    }
    pthread_mutex_lock(&f->mu);
    memset(ev, 0, sizeof *ev);
    ev->logprob = -0.25f * (float)(s->pos + 1);
    ev->n_top = s->n_top;
    for (uint32_t k = 0; k < s->n_top; k++)
        ev->top[k] = (struct kvr_token_logprob){f->script[(s->pos + k) % f->n_script],
                                                -0.25f * (float)(s->pos + 1 + k)};
    if (f->fail_after >= 0 && s->pos == (uint32_t)f->fail_after) {
        ev->token = -1;
        ev->finish = KVR_GEN_FINISH_ERROR;
        ev->error_status = f->fail_status;
        snprintf(ev->error, sizeof ev->error, "stage 1 went away and did not come back");
        s->finished = true;
    } else if (s->pos >= f->n_script && f->eos_after_script) {
        ev->token = 2;
        ev->finish = KVR_GEN_FINISH_EOS;
        s->finished = true;
        s->pos++;
    } else {
        ev->token = f->script[s->pos % f->n_script];
        s->pos++;
        if (s->pos >= s->max_tokens) {
            ev->finish = KVR_GEN_FINISH_LENGTH;
            s->finished = true;
        }
    }
    s->t_next_ns = kvr_now_ns() + (uint64_t)f->delay_ms * 1000000;
    pthread_mutex_unlock(&f->mu);
    return 0;
}

static void fake_cancel(struct kvr_gen_stream *s)
{
    if (s->cancelled)
        return;
    s->cancelled = true;
    pthread_mutex_lock(&s->f->mu);
    s->f->n_cancel++;
    s->f->t_cancel_ns = kvr_now_ns();
    pthread_mutex_unlock(&s->f->mu);
}

static void fake_release(struct kvr_gen_stream *s)
{
    pthread_mutex_lock(&s->f->mu);
    s->f->n_release++;
    pthread_mutex_unlock(&s->f->mu);
    free(s);
}

static bool fake_health(void *ctx, json_t *detail)
{
    struct fake *f = ctx;
    pthread_mutex_lock(&f->mu);
    bool up = f->healthy;
    pthread_mutex_unlock(&f->mu);
    json_object_set_new(
        detail, "stages",
        json_pack("[{s:i,s:b},{s:i,s:b}]", "index", 0, "up", 1, "index", 1, "up", up));
    return up;
}

static void fake_metrics(void *ctx, struct kvr_sbuf *out)
{
    kvr_sbuf_puts(out, "# TYPE kvasir:fake_queue_depth gauge\nkvasir:fake_queue_depth 3\n");
}

/* Every stream: first token in 120 ms, the whole answer in 480, request 7. */
static bool fake_estimate(struct kvr_gen_stream *s, double *first_ms, double *total_ms,
                          uint64_t *id)
{
    (void)s;
    *first_ms = 120;
    *total_ms = 480;
    *id = 7;
    return true;
}

/* An empty ring: no stage, no batch (the JSON's shape is test_telemetry.c's). */
static void fake_telemetry(void *ctx, struct kvr_telemetry_reader *reader,
                           struct kvr_telemetry_snapshot *snap)
{
    (void)ctx;
    (void)reader;
    memset(snap, 0, sizeof *snap);
    snap->now_ns = kvr_now_ns();
}

static const struct kvr_service_ops fake_ops = {
    fake_submit,  fake_next, fake_cancel,   fake_release,   fake_health,
    fake_metrics, NULL,      fake_estimate, fake_telemetry, NULL,
};

/* " Once upon a time.é The end." then EOS. */
static const int32_t story[] = {W_ONCE,        W_UPON,        W_A,   W_TIME, ID_ASCII('.'),
                                ID_BYTE(0xC3), ID_BYTE(0xA9), W_THE, W_END,  ID_ASCII('.')};
#define STORY_TEXT " Once upon a time.\xC3\xA9 The end."
#define N_STORY (sizeof story / sizeof story[0])

static void fake_reset(struct fake *f)
{
    pthread_mutex_lock(&f->mu);
    f->script = story;
    f->n_script = N_STORY;
    f->eos_after_script = true;
    f->delay_ms = 1;
    f->refuse_reason = KVR_REFUSE_NONE;
    f->refuse_never = false;
    f->fail_after = -1;
    f->healthy = true;
    pthread_mutex_unlock(&f->mu);
}

/* ---- fixture ------------------------------------------------------------------------ */

#define API_KEY "sekret-key"
#define N_CTX 64

struct fixture {
    struct fake fake;
    struct kvr_tok *tok;
    struct kvr_service svc;
    struct kvr_http *http;
    uint16_t port;
};

/* The model's chat template: ChatML, as a Jinja program (rendered by jinja.c). */
static const char chatml_jinja[] =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/* Set by a test before it starts its own server: changes the configuration. */
static void (*tweak_cfg)(struct kvr_http_config *cfg);

static struct fixture *start_cfg(size_t max_body, uint32_t stall_timeout_s)
{
    struct fixture *fx = calloc(1, sizeof *fx);
    pthread_mutex_init(&fx->fake.mu, NULL);
    fake_reset(&fx->fake);
    fx->tok = make_tok();
    fx->svc = (struct kvr_service){.ops = &fake_ops,
                                   .ctx = &fx->fake,
                                   .model_name = "fake-stories",
                                   .n_ctx = N_CTX,
                                   .tok = fx->tok,
                                   .chat_template = chatml_jinja,
                                   .chat_template_len = sizeof chatml_jinja - 1};
    struct kvr_http_config cfg;
    kvr_http_config_init(&cfg);
    cfg.port = 0;
    cfg.api_key = API_KEY;
    cfg.max_body_bytes = max_body;
    if (stall_timeout_s)
        cfg.stall_timeout_s = stall_timeout_s;
    if (tweak_cfg)
        tweak_cfg(&cfg);
    struct kvr_err err = {0};
    if (kvr_http_create(&fx->http, &cfg, &fx->svc, &err))
        fail_msg("server: %s", err.msg);
    fx->port = kvr_http_port(fx->http);
    assert_true(fx->port != 0);
    return fx;
}

static struct fixture *start(size_t max_body)
{
    return start_cfg(max_body, 0);
}

static void stop(struct fixture *fx)
{
    kvr_http_destroy(fx->http);
    kvr_tok_destroy(fx->tok);
    pthread_mutex_destroy(&fx->fake.mu);
    free(fx);
}

static int setup(void **state)
{
    *state = start(1u << 20);
    return 0;
}

static int teardown(void **state)
{
    stop(*state);
    return 0;
}

/* ---- a minimal HTTP client ---------------------------------------------------------- */

static int dial(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = {.tv_sec = 10};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

static bool send_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
        if (k <= 0)
            return false;
        c += k;
        n -= (size_t)k;
    }
    return true;
}

struct resp {
    int status;
    char *head; /* status line and headers, NUL-terminated */
    char *body; /* de-chunked, NUL-terminated */
    size_t body_len;
};

static void resp_free(struct resp *r)
{
    free(r->head);
    free(r->body);
    memset(r, 0, sizeof *r);
}

/* The value of a header (case-insensitive name) in r->head, copied into buf. */
static const char *header(const struct resp *r, const char *name, char *buf, size_t cap)
{
    size_t n = strlen(name);
    for (const char *p = strstr(r->head, "\r\n"); p && p[2]; p = strstr(p + 2, "\r\n")) {
        const char *line = p + 2;
        if (!strncasecmp(line, name, n) && line[n] == ':') {
            const char *v = line + n + 1;
            while (*v == ' ')
                v++;
            size_t len = strcspn(v, "\r");
            snprintf(buf, cap, "%.*s", (int)len, v);
            return buf;
        }
    }
    return NULL;
}

/* Read a whole response from a connection the server will close (we send
 * "Connection: close"), undoing chunked transfer coding. */
static void read_resp(int fd, struct resp *r)
{
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap)
            buf = realloc(buf, cap *= 2);
        ssize_t k = recv(fd, buf + len, cap - len - 1, 0);
        if (k <= 0)
            break;
        len += (size_t)k;
    }
    buf[len] = 0;
    memset(r, 0, sizeof *r);
    char *end = strstr(buf, "\r\n\r\n");
    if (!end)
        fail_msg("no HTTP response head in %zu bytes: %.200s", len, buf);
    r->head = strndup(buf, (size_t)(end - buf + 2));
    assert_int_equal(sscanf(r->head, "HTTP/1.%*d %d", &r->status), 1);
    char *body = end + 4;
    size_t body_len = len - (size_t)(body - buf);
    char te[64];
    r->body = malloc(body_len + 1);
    if (header(r, "Transfer-Encoding", te, sizeof te) && strstr(te, "chunked")) {
        size_t out = 0;
        char *p = body;
        for (;;) {
            unsigned long n = strtoul(p, &p, 16);
            p = strstr(p, "\r\n");
            assert_non_null(p);
            p += 2;
            if (n == 0)
                break;
            assert_true(p + n <= body + body_len);
            memcpy(r->body + out, p, n);
            out += n;
            p += n + 2;
        }
        r->body_len = out;
    } else {
        memcpy(r->body, body, body_len);
        r->body_len = body_len;
    }
    r->body[r->body_len] = 0;
    free(buf);
}

/* One request on its own connection. `headers` are extra header lines, each ending in
 * "\r\n". A NULL body sends none; body_len 0 means strlen. */
static void request(uint16_t port, const char *method, const char *path, const char *headers,
                    const char *body, size_t body_len, struct resp *r)
{
    if (body && !body_len)
        body_len = strlen(body);
    char head[1024];
    int n =
        snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s",
                 method, path, headers ? headers : "");
    if (body)
        n += snprintf(head + n, sizeof head - (size_t)n,
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n", body_len);
    n += snprintf(head + n, sizeof head - (size_t)n, "\r\n");
    int fd = dial(port);
    assert_true(send_all(fd, head, (size_t)n));
    if (body)
        send_all(fd, body, body_len);
    read_resp(fd, r);
    close(fd);
}

#define AUTH "Authorization: Bearer " API_KEY "\r\n"

static void post(uint16_t port, const char *path, const char *body, struct resp *r)
{
    request(port, "POST", path, AUTH, body, 0, r);
}

static json_t *body_json(const struct resp *r)
{
    json_error_t je;
    json_t *j = json_loadb(r->body, r->body_len, 0, &je);
    if (!j)
        fail_msg("body is not JSON (%s): %.300s", je.text, r->body);
    return j;
}

/* The body must be an OpenAI error whose message contains `msg`. */
static void expect_error(const struct resp *r, int status, const char *msg)
{
    if (r->status != status)
        fail_msg("status %d, want %d; body %.300s", r->status, status, r->body);
    char ct[128];
    assert_non_null(header(r, "Content-Type", ct, sizeof ct));
    assert_string_equal(ct, "application/json");
    json_t *j = body_json(r);
    json_t *e = json_object_get(j, "error");
    assert_true(json_is_object(e));
    const char *m = json_string_value(json_object_get(e, "message"));
    assert_non_null(m);
    if (!strstr(m, msg))
        fail_msg("message '%s' lacks '%s'", m, msg);
    assert_true(json_is_string(json_object_get(e, "type")));
    assert_non_null(json_object_get(e, "param"));
    assert_non_null(json_object_get(e, "code"));
    json_decref(j);
}

static const char *choice_text(json_t *j)
{
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *t = json_object_get(c, "text");
    if (!t)
        t = json_object_get(json_object_get(c, "message"), "content");
    return json_string_value(t);
}

static const char *choice_finish(json_t *j)
{
    return json_string_value(
        json_object_get(json_array_get(json_object_get(j, "choices"), 0), "finish_reason"));
}

/* A normal request must still work: used after every bad input. */
static void expect_alive(uint16_t port)
{
    struct resp r;
    post(port, "/v1/completions", "{\"prompt\": \"hi\", \"max_tokens\": 4}", &r);
    assert_int_equal(r.status, 200);
    json_t *j = body_json(&r);
    assert_string_equal(choice_text(j), " Once upon a time");
    json_decref(j);
    resp_free(&r);
}

/* ---- bad input over the wire --------------------------------------------------------- */

static void test_bad_inputs(void **state)
{
    struct fixture *fx = *state;
    static const struct {
        const char *method, *path, *headers, *body;
        size_t body_len;
        int status;
        const char *msg;
    } cases[] = {
        {"POST", "/v1/completions", AUTH, "{\"prompt\": ", 0, 400, "not valid JSON"},
        {"POST", "/v1/completions", AUTH, "{\"prompt\": \"hi\", \"max_tokens\": \"ten\"}", 0, 400,
         "'max_tokens' must be an integer"},
        {"POST", "/v1/completions", AUTH, "{\"max_tokens\": 5}", 0, 400,
         "you must provide a 'prompt'"},
        {"POST", "/v1/chat/completions", AUTH, "{\"max_tokens\": 5}", 0, 400,
         "you must provide 'messages'"},
        {"POST", "/v1/completions", AUTH, "{\"prompt\": \"caf\xC3\"}", 0, 400, "not valid UTF-8"},
        {"POST", "/v1/completions", AUTH, "{\"prompt\": \"hi\", \"n\": 17}", 0, 400,
         "'n' must be 1 to 16"},
        {"POST", "/v1/completions", AUTH, "{\"prompt\": \"hi\", \"max_tokens\": 0}", 0, 400,
         "'max_tokens' must be between 1 and 64"},
        {"POST", "/v1/completions", AUTH, "{\"prompt\": \"hi\", \"max_tokens\": 65}", 0, 400,
         "between 1 and 64"},
        /* 70 characters become 71 tokens with BOS: longer than the context of 64. */
        {"POST", "/v1/completions", AUTH,
         "{\"prompt\": \"abcdefghijabcdefghijabcdefghijabcdefghijabcdefghijabcdefghijabcdefghij\"}",
         0, 400, "maximum context length is 64 tokens, but the prompt is 71 tokens"},
        {"POST", "/v1/completions", AUTH,
         "{\"prompt\": \"abcdefghijabcdefghijabcdefghijabcdefghij\", \"max_tokens\": 30}", 0, 400,
         "you requested 71 tokens (41 in the prompt, 30 for the completion)"},
        {"POST", "/v1/completions", AUTH, "", 0, 400, "body is empty"},
        {"POST", "/v1/completions", AUTH, NULL, 0, 400, "body is empty"},
        {"POST", "/v1/completions", AUTH "X-Latency-Budget-Ms: soon\r\n", "{\"prompt\": \"hi\"}", 0,
         400, "X-Latency-Budget-Ms header must be"},
        {"GET", "/v1/nothing", AUTH, NULL, 0, 404, "no such endpoint: GET /v1/nothing"},
        {"POST", "/nothing", AUTH, "{}", 0, 404, "no such endpoint"},
        {"POST", "/", AUTH, "{}", 0, 405, "method POST is not allowed on /"},
        {"GET", "/v1/completions", AUTH, NULL, 0, 405, "method GET is not allowed"},
        {"DELETE", "/v1/models", AUTH, NULL, 0, 405, "method DELETE is not allowed"},
        {"POST", "/v1/completions", NULL, "{\"prompt\": \"hi\"}", 0, 401,
         "missing or invalid API key"},
        {"POST", "/v1/completions", "Authorization: Bearer sekret-kez\r\n", "{\"prompt\": \"hi\"}",
         0, 401, "invalid API key"},
        {"POST", "/v1/completions", "Authorization: Bearer sekret-key2\r\n", "{\"prompt\": \"hi\"}",
         0, 401, "invalid API key"},
        {"POST", "/v1/completions", "Authorization: Basic c2VrcmV0LWtleQ==\r\n",
         "{\"prompt\": \"hi\"}", 0, 401, "invalid API key"},
        {"GET", "/v1/models", NULL, NULL, 0, 401, "API key"},
        {"GET", "/metrics", NULL, NULL, 0, 401, "API key"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct resp r;
        request(fx->port, cases[i].method, cases[i].path, cases[i].headers, cases[i].body,
                cases[i].body_len, &r);
        print_message("case %zu: %s %s -> %d\n", i, cases[i].method, cases[i].path, r.status);
        expect_error(&r, cases[i].status, cases[i].msg);
        char v[64];
        if (cases[i].status == 405)
            assert_non_null(header(&r, "Allow", v, sizeof v));
        if (cases[i].status == 401)
            assert_non_null(header(&r, "WWW-Authenticate", v, sizeof v));
        resp_free(&r);
        expect_alive(fx->port);
    }
    /* Nothing was submitted for any of them except the liveness checks. */
    pthread_mutex_lock(&fx->fake.mu);
    int n_submit = fx->fake.n_submit;
    pthread_mutex_unlock(&fx->fake.mu);
    assert_true(n_submit >= (int)(sizeof cases / sizeof cases[0]));
}

static void test_body_too_large(void **state)
{
    struct fixture *fx = *state;
    /* Declared too large: refused from the headers, before any body is sent. */
    int fd = dial(fx->port);
    const char *head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" AUTH
                       "Content-Type: application/json\r\nContent-Length: 2097152\r\n\r\n";
    assert_true(send_all(fd, head, strlen(head)));
    struct resp r;
    read_resp(fd, &r);
    close(fd);
    expect_error(&r, 413, "larger than the limit of 1048576 bytes");
    resp_free(&r);
    expect_alive(fx->port);

    /* Chunked, no length given: counted while it arrives, the excess dropped, then 413. */
    fd = dial(fx->port);
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" AUTH
           "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
    assert_true(send_all(fd, head, strlen(head)));
    static char chunk[65536];
    memset(chunk, ' ', sizeof chunk);
    char size_line[32];
    snprintf(size_line, sizeof size_line, "%zx\r\n", sizeof chunk);
    for (int i = 0; i < 24; i++) { /* 1.5 MiB */
        if (!send_all(fd, size_line, strlen(size_line)) || !send_all(fd, chunk, sizeof chunk) ||
            !send_all(fd, "\r\n", 2))
            break;
    }
    send_all(fd, "0\r\n\r\n", 5);
    read_resp(fd, &r);
    close(fd);
    expect_error(&r, 413, "larger than the limit");
    resp_free(&r);
    expect_alive(fx->port);

    /* A text prompt so long that it cannot fit the context whatever its tokens (the longest
     * piece, "<|im_start|>", is 12 bytes) is refused before it is tokenized. */
    char *long_prompt = malloc(4096);
    int len = snprintf(long_prompt, 4096, "{\"prompt\": \"");
    memset(long_prompt + len, 'x', 2000);
    len += 2000;
    len += snprintf(long_prompt + len, 4096 - (size_t)len, "\"}");
    request(fx->port, "POST", "/v1/completions", AUTH, long_prompt, (size_t)len, &r);
    expect_error(&r, 400,
                 "maximum context length is 64 tokens, but the prompt (2000 bytes) is "
                 "at least 166 tokens");
    resp_free(&r);
    free(long_prompt);

    /* Just under the limit is read and parsed (and refused for what it says, not its size). */
    size_t n = (1u << 20) - 64;
    char *big = malloc(n + 1);
    memset(big, ' ', n);
    memcpy(big, "{\"prompt\": 5", 12);
    big[n - 1] = '}';
    big[n] = 0;
    request(fx->port, "POST", "/v1/completions", AUTH, big, n, &r);
    expect_error(&r, 400, "'prompt' must be a string");
    resp_free(&r);
    free(big);
}

/* ---- normal requests ---------------------------------------------------------------- */

static void test_completion(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    struct resp r;
    post(fx->port, "/v1/completions",
         "{\"model\": \"whatever\", \"prompt\": \"Hi there\", \"max_tokens\": 20, "
         "\"temperature\": 0.5, \"seed\": 42, \"top_k\": 5, "
         "\"latency_budget\": {\"first_token_ms\": 300, \"total_ms\": 4000}}",
         &r);
    assert_int_equal(r.status, 200);
    json_t *j = body_json(&r);
    assert_string_equal(choice_text(j), STORY_TEXT);
    assert_string_equal(choice_finish(j), "stop"); /* EOS */
    assert_string_equal(json_string_value(json_object_get(j, "object")), "text_completion");
    assert_string_equal(json_string_value(json_object_get(j, "model")), "fake-stories");
    assert_memory_equal(json_string_value(json_object_get(j, "id")), "cmpl-", 5);
    json_t *u = json_object_get(j, "usage");
    /* "Hi there" with SentencePiece's added space: BOS ▁ H i ▁ t h e r e = 10 tokens. */
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), 10);
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), N_STORY + 1);
    json_decref(j);
    resp_free(&r);

    pthread_mutex_lock(&fx->fake.mu);
    struct kvr_gen_request q = fx->fake.last_req;
    assert_int_equal(fx->fake.last_n_prompt, 10);
    assert_int_equal(fx->fake.last_prompt[0], 1); /* BOS */
    assert_int_equal(fx->fake.last_prompt[1], ID_SPACE);
    assert_int_equal(fx->fake.last_prompt[2], ID_ASCII('H'));
    assert_int_equal(fx->fake.last_prompt[4], ID_SPACE);
    pthread_mutex_unlock(&fx->fake.mu);
    assert_int_equal(q.max_tokens, 20);
    assert_true(q.sampling.temperature == 0.5f);
    assert_int_equal(q.sampling.top_k, 5);
    assert_true(q.sampling.seed == 42);
    assert_int_equal(q.first_token_ms, 300);
    assert_int_equal(q.total_ms, 4000);
    assert_false(q.logprobs);
    assert_false(q.ignore_eos);

    /* max_tokens cuts it short: finish_reason length. */
    post(fx->port, "/v1/completions", "{\"prompt\": [1, 5, 6], \"max_tokens\": 3}", &r);
    assert_int_equal(r.status, 200);
    j = body_json(&r);
    assert_string_equal(choice_text(j), " Once upon a");
    assert_string_equal(choice_finish(j), "length");
    json_decref(j);
    resp_free(&r);
    pthread_mutex_lock(&fx->fake.mu);
    assert_int_equal(fx->fake.last_n_prompt, 3); /* token ids pass through as given */
    assert_int_equal(fx->fake.last_prompt[2], 6);
    pthread_mutex_unlock(&fx->fake.mu);

    /* The header budget applies when the body gives no total. */
    request(fx->port, "POST", "/v1/completions", AUTH "X-Latency-Budget-Ms: 1500\r\n",
            "{\"prompt\": \"a\", \"max_tokens\": 1, \"ignore_eos\": true}", 0, &r);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    pthread_mutex_lock(&fx->fake.mu);
    assert_true(fx->fake.last_req.ignore_eos); /* passed through to the service */
    assert_int_equal(fx->fake.last_req.total_ms, 1500);
    assert_int_equal(fx->fake.last_req.first_token_ms, 0);
    pthread_mutex_unlock(&fx->fake.mu);
}

static void test_stop_strings(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    struct resp r;
    int cancels_before = fx->fake.n_cancel;
    /* "ce up" spans the tokens " Once" and " upon". */
    post(fx->port, "/v1/completions",
         "{\"prompt\": \"x\", \"max_tokens\": 20, \"stop\": \"ce up\"}", &r);
    assert_int_equal(r.status, 200);
    json_t *j = body_json(&r);
    assert_string_equal(choice_text(j), " On");
    assert_string_equal(choice_finish(j), "stop");
    json_decref(j);
    resp_free(&r);
    pthread_mutex_lock(&fx->fake.mu);
    assert_int_equal(fx->fake.n_cancel, cancels_before + 1); /* the stream was stopped */
    pthread_mutex_unlock(&fx->fake.mu);

    /* A stop string made of two byte tokens' character, and one that never comes. */
    post(fx->port, "/v1/completions",
         "{\"prompt\": \"x\", \"max_tokens\": 20, \"stop\": [\"zzz\", \"\\u00e9 T\"]}", &r);
    j = body_json(&r);
    assert_string_equal(choice_text(j), " Once upon a time.");
    json_decref(j);
    resp_free(&r);

    /* A partial match at the very end is released when the generation ends. */
    post(fx->port, "/v1/completions",
         "{\"prompt\": \"x\", \"max_tokens\": 20, \"stop\": \"end. And\"}", &r);
    j = body_json(&r);
    assert_string_equal(choice_text(j), STORY_TEXT);
    json_decref(j);
    resp_free(&r);
}

static void test_chat(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    struct resp r;
    post(fx->port, "/v1/chat/completions",
         "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, "
         "{\"role\": \"user\", \"content\": \"u\"}], \"max_completion_tokens\": 4, "
         "\"logprobs\": true}",
         &r);
    assert_int_equal(r.status, 200);
    json_t *j = body_json(&r);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion");
    assert_memory_equal(json_string_value(json_object_get(j, "id")), "chatcmpl-", 9);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(c, "message"), "role")),
                        "assistant");
    assert_string_equal(choice_text(j), " Once upon a time");
    assert_string_equal(choice_finish(j), "length");
    json_t *content = json_object_get(json_object_get(c, "logprobs"), "content");
    assert_int_equal(json_array_size(content), 4);
    assert_string_equal(json_string_value(json_object_get(json_array_get(content, 1), "token")),
                        " upon");
    assert_true(json_real_value(json_object_get(json_array_get(content, 1), "logprob")) == -0.5);
    json_decref(j);
    resp_free(&r);

    /* The prompt was rendered with ChatML and its control tokens parsed into single ids:
     * BOS, then three <|im_start|> (system, user, assistant) and two <|im_end|>. */
    pthread_mutex_lock(&fx->fake.mu);
    assert_int_equal(fx->fake.last_prompt[0], 1);
    assert_int_equal(fx->fake.last_prompt[1], W_IM_START);
    int n_start = 0, n_end = 0;
    for (uint32_t i = 0; i < fx->fake.last_n_prompt; i++) {
        n_start += fx->fake.last_prompt[i] == W_IM_START;
        n_end += fx->fake.last_prompt[i] == W_IM_END;
    }
    assert_int_equal(n_start, 3);
    assert_int_equal(n_end, 2);
    assert_true(fx->fake.last_req.logprobs);
    pthread_mutex_unlock(&fx->fake.mu);

    /* Completions logprobs. */
    post(fx->port, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 2, \"logprobs\": 1}",
         &r);
    j = body_json(&r);
    json_t *lp = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    assert_int_equal(json_array_size(json_object_get(lp, "tokens")), 2);
    assert_string_equal(json_string_value(json_array_get(json_object_get(lp, "tokens"), 0)),
                        " Once");
    assert_int_equal(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 1)), 5);
    json_decref(j);
    resp_free(&r);
}

/* Split an SSE body into its data payloads; returns how many. */
static int sse_events(char *body, char **events, int max)
{
    int n = 0;
    for (char *p = body; *p && n < max;) {
        if (strncmp(p, "data: ", 6) != 0)
            fail_msg("SSE event does not start with 'data: ': %.60s", p);
        char *end = strstr(p, "\n\n");
        if (!end)
            fail_msg("SSE event not terminated: %.60s", p);
        *end = 0;
        events[n++] = p + 6;
        p = end + 2;
    }
    return n;
}

static void test_streaming(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    struct resp r;
    post(fx->port, "/v1/completions",
         "{\"prompt\": \"x\", \"max_tokens\": 30, \"stream\": true, "
         "\"stream_options\": {\"include_usage\": true}}",
         &r);
    assert_int_equal(r.status, 200);
    char ct[64];
    assert_string_equal(header(&r, "Content-Type", ct, sizeof ct), "text/event-stream");
    char *ev[64];
    int n = sse_events(r.body, ev, 64);
    assert_true(n >= 4);
    assert_string_equal(ev[n - 1], "[DONE]");
    char text[256] = "";
    const char *finish = NULL;
    for (int i = 0; i < n - 2; i++) {
        json_t *j = json_loads(ev[i], 0, NULL);
        assert_non_null(j);
        assert_true(json_is_null(json_object_get(j, "usage")));
        strcat(text, choice_text(j));
        if (choice_finish(j)) {
            assert_int_equal(i, n - 3); /* only the last content chunk finishes */
            finish = "stop";
            assert_string_equal(choice_finish(j), "stop");
        }
        json_decref(j);
    }
    assert_non_null(finish);
    assert_string_equal(text, STORY_TEXT);
    json_t *u = json_loads(ev[n - 2], 0, NULL);
    assert_int_equal(json_array_size(json_object_get(u, "choices")), 0);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(u, "usage"), "completion_tokens")),
        N_STORY + 1);
    json_decref(u);
    resp_free(&r);

    /* Chat streaming: a role chunk first, deltas, a finish, [DONE]; a stop string is never
     * shown, even in part. */
    post(fx->port, "/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"stream\": true, "
         "\"stop\": \"time.\"}",
         &r);
    assert_int_equal(r.status, 200);
    n = sse_events(r.body, ev, 64);
    assert_string_equal(ev[n - 1], "[DONE]");
    json_t *first = json_loads(ev[0], 0, NULL);
    json_t *delta = json_object_get(json_array_get(json_object_get(first, "choices"), 0), "delta");
    assert_string_equal(json_string_value(json_object_get(delta, "role")), "assistant");
    assert_string_equal(json_string_value(json_object_get(first, "object")),
                        "chat.completion.chunk");
    json_decref(first);
    text[0] = 0;
    for (int i = 1; i < n - 1; i++) {
        json_t *j = json_loads(ev[i], 0, NULL);
        json_t *d = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "delta");
        const char *c = json_string_value(json_object_get(d, "content"));
        if (c)
            strcat(text, c);
        if (i == n - 2)
            assert_string_equal(choice_finish(j), "stop");
        json_decref(j);
    }
    assert_string_equal(text, " Once upon a ");
    resp_free(&r);
}

/* kvasir:request_refused_total by reason label, in the order the server prints them. */
static void refused_counts(uint16_t port, unsigned long long n[6])
{
    static const char *const labels[6] = {"over_budget", "kv_full", "queue_full",
                                          "ring_down",   "invalid", "internal"};
    struct resp r;
    request(port, "GET", "/metrics", AUTH, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    for (int i = 0; i < 6; i++) {
        char key[96];
        snprintf(key, sizeof key,
                 "kvasir:request_refused_total{model_name=\"fake-stories\",reason=\"%s\"} ",
                 labels[i]);
        const char *at = strstr(r.body, key);
        assert_non_null(at);
        n[i] = strtoull(at + strlen(key), NULL, 10);
    }
    resp_free(&r);
}

/* top_logprobs: the service's alternatives as each API shows them. */
static void test_top_logprobs(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    struct resp r;
    post(fx->port, "/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"u\"}], \"max_tokens\": 3, "
         "\"logprobs\": true, \"top_logprobs\": 2}",
         &r);
    assert_int_equal(r.status, 200);
    json_t *j = body_json(&r);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *e1 = json_array_get(json_object_get(json_object_get(c, "logprobs"), "content"), 1);
    json_t *alts = json_object_get(e1, "top_logprobs");
    assert_int_equal(json_array_size(alts), 2);
    /* token 1's alternatives are the script's tokens 1 and 2 (the fake's), -0.5 and -0.75 */
    assert_string_equal(json_string_value(json_object_get(json_array_get(alts, 1), "token")), " a");
    assert_true(json_real_value(json_object_get(json_array_get(alts, 1), "logprob")) == -0.75);
    assert_int_equal(json_array_size(json_object_get(json_array_get(alts, 0), "bytes")), 5);
    json_decref(j);
    resp_free(&r);
    pthread_mutex_lock(&fx->fake.mu);
    assert_int_equal(fx->fake.last_req.top_logprobs, 2);
    pthread_mutex_unlock(&fx->fake.mu);

    /* Completions: one dict per token, alternatives by their text. */
    post(fx->port, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 2, \"logprobs\": 3}",
         &r);
    j = body_json(&r);
    json_t *lp = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "logprobs");
    json_t *d0 = json_array_get(json_object_get(lp, "top_logprobs"), 0);
    assert_int_equal(json_object_size(d0), 3);
    assert_true(json_real_value(json_object_get(d0, " upon")) == -0.5);
    json_decref(j);
    resp_free(&r);
}

/* n > 1: one submit per choice (seed + i, all but the first sharing its prompt), the choices
 * in index order, usage counting the prompt once; streamed, every index and one [DONE]. */
static void test_choices(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    int before = fx->fake.n_submit;
    struct resp r;
    post(fx->port, "/v1/completions",
         "{\"prompt\": \"Hi there\", \"max_tokens\": 20, \"seed\": 42, \"n\": 3}", &r);
    assert_int_equal(r.status, 200);
    json_t *j = body_json(&r);
    json_t *cs = json_object_get(j, "choices");
    assert_int_equal(json_array_size(cs), 3);
    for (int i = 0; i < 3; i++) {
        json_t *c = json_array_get(cs, (size_t)i);
        assert_int_equal(json_integer_value(json_object_get(c, "index")), i);
        assert_string_equal(json_string_value(json_object_get(c, "text")), STORY_TEXT);
    }
    json_t *u = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), 10);
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")),
                     3 * (N_STORY + 1));
    json_decref(j);
    resp_free(&r);
    pthread_mutex_lock(&fx->fake.mu);
    assert_int_equal(fx->fake.n_submit - before, 3);
    assert_true(fx->fake.last_req.sampling.seed == 44);
    assert_non_null(fx->fake.last_req.same_prompt_as);
    assert_int_equal(fx->fake.last_n_prompt, 10);
    pthread_mutex_unlock(&fx->fake.mu);

    post(fx->port, "/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"u\"}], \"max_tokens\": 4, "
         "\"n\": 2, \"stream\": true, \"stream_options\": {\"include_usage\": true}}",
         &r);
    assert_int_equal(r.status, 200);
    char *ev[64];
    int n = sse_events(r.body, ev, 64);
    int roles[2] = {0, 0}, finished[2] = {0, 0}, usage = 0;
    char text[2][64] = {"", ""};
    for (int i = 0; i < n - 1; i++) {
        j = json_loads(ev[i], 0, NULL);
        assert_non_null(j);
        json_t *c = json_array_get(json_object_get(j, "choices"), 0);
        if (!c) {
            usage++;
            assert_int_equal(json_integer_value(
                                 json_object_get(json_object_get(j, "usage"), "completion_tokens")),
                             8);
        } else {
            int k = (int)json_integer_value(json_object_get(c, "index"));
            assert_true(k == 0 || k == 1);
            json_t *delta = json_object_get(c, "delta");
            roles[k] += json_object_get(delta, "role") != NULL;
            finished[k] += json_is_string(json_object_get(c, "finish_reason"));
            if (json_is_string(json_object_get(delta, "content")))
                strcat(text[k], json_string_value(json_object_get(delta, "content")));
        }
        json_decref(j);
    }
    assert_string_equal(ev[n - 1], "[DONE]");
    assert_int_equal(usage, 1);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(roles[k], 1);
        assert_int_equal(finished[k], 1);
        assert_string_equal(text[k], " Once upon a time");
    }
    resp_free(&r);

    /* All or none: a refused choice refuses the request. */
    pthread_mutex_lock(&fx->fake.mu);
    fx->fake.refuse_reason = KVR_REFUSE_QUEUE_FULL;
    pthread_mutex_unlock(&fx->fake.mu);
    post(fx->port, "/v1/completions", "{\"prompt\": \"x\", \"n\": 2}", &r);
    assert_int_equal(r.status, 503);
    resp_free(&r);
    fake_reset(&fx->fake);
}

static void test_refusal_and_errors(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    unsigned long long before[6], after[6];
    refused_counts(fx->port, before);
    pthread_mutex_lock(&fx->fake.mu);
    fx->fake.refuse_retry_ms = 1500; /* rounded up to whole seconds */
    fx->fake.refuse_reason = KVR_REFUSE_FIRST_TOKEN_BUDGET;
    pthread_mutex_unlock(&fx->fake.mu);
    struct resp r;
    post(fx->port, "/v1/completions", "{\"prompt\": \"x\"}", &r);
    expect_error(&r, 429, "would miss first-token budget: estimated 812 ms > 500 ms");
    char v[32];
    assert_string_equal(header(&r, "Retry-After", v, sizeof v), "2");
    json_t *j = body_json(&r);
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "error"), "code")),
                        "over_budget");
    json_decref(j);
    resp_free(&r);

    pthread_mutex_lock(&fx->fake.mu);
    fx->fake.refuse_reason = KVR_REFUSE_QUEUE_FULL;
    pthread_mutex_unlock(&fx->fake.mu);
    post(fx->port, "/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stream\": true}", &r);
    expect_error(&r, 503, "estimated 812 ms");
    assert_non_null(header(&r, "Retry-After", v, sizeof v));
    resp_free(&r);

    /* The rest of the reasons: the status and code each gets; a KV-full refusal says when
     * to retry even without a hint; both budgets count as over_budget in the metrics. */
    static const struct {
        enum kvr_refusal_reason reason;
        int status;
        const char *code, *retry;
    } more[] = {{KVR_REFUSE_TOTAL_BUDGET, 429, "over_budget", NULL},
                {KVR_REFUSE_KV_FULL, 429, "kv_full", "1"},
                {KVR_REFUSE_RING_DOWN, 503, "ring_down", NULL},
                {KVR_REFUSE_TOO_LONG, 400, "invalid", NULL},
                {KVR_REFUSE_INTERNAL, 500, "internal", NULL}};
    for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) {
        pthread_mutex_lock(&fx->fake.mu);
        fx->fake.refuse_reason = more[i].reason;
        fx->fake.refuse_retry_ms = 0;
        pthread_mutex_unlock(&fx->fake.mu);
        post(fx->port, "/v1/completions", "{\"prompt\": \"x\"}", &r);
        expect_error(&r, more[i].status, "estimated 812 ms");
        j = body_json(&r);
        assert_string_equal(json_string_value(json_object_get(json_object_get(j, "error"), "code")),
                            more[i].code);
        json_decref(j);
        const char *ra = header(&r, "Retry-After", v, sizeof v);
        if (more[i].retry)
            assert_string_equal(ra, more[i].retry);
        else
            assert_null(ra);
        resp_free(&r);
    }
    refused_counts(fx->port, after);
    assert_true(after[0] - before[0] == 2 && after[1] - before[1] == 1); /* both budgets */
    assert_true(after[2] - before[2] == 1 && after[3] - before[3] == 1);
    assert_true(after[4] - before[4] == 1 && after[5] - before[5] == 1);

    /* A refusal no retry can help sends no Retry-After, whatever its hint or reason. */
    for (int k = 0; k < 2; k++) {
        pthread_mutex_lock(&fx->fake.mu);
        fx->fake.refuse_reason = k ? KVR_REFUSE_KV_FULL : KVR_REFUSE_FIRST_TOKEN_BUDGET;
        fx->fake.refuse_retry_ms = 1500;
        fx->fake.refuse_never = true;
        pthread_mutex_unlock(&fx->fake.mu);
        post(fx->port, "/v1/completions", "{\"prompt\": \"x\"}", &r);
        expect_error(&r, 429, "estimated 812 ms");
        assert_null(header(&r, "Retry-After", v, sizeof v));
        resp_free(&r);
    }

    /* The service fails mid-generation: JSON gets the service's status, SSE an error event
     * and [DONE]. */
    fake_reset(&fx->fake);
    pthread_mutex_lock(&fx->fake.mu);
    fx->fake.fail_after = 2;
    fx->fake.fail_status = 503;
    pthread_mutex_unlock(&fx->fake.mu);
    post(fx->port, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 10}", &r);
    expect_error(&r, 503, "stage 1 went away");
    resp_free(&r);
    post(fx->port, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 10, \"stream\": true}",
         &r);
    assert_int_equal(r.status, 200);
    char *ev[16];
    int n = sse_events(r.body, ev, 16);
    assert_string_equal(ev[n - 1], "[DONE]");
    assert_non_null(strstr(ev[n - 2], "\"error\""));
    assert_non_null(strstr(ev[n - 2], "stage 1 went away"));
    resp_free(&r);
    fake_reset(&fx->fake);
    expect_alive(fx->port);
}

static void test_models_health_metrics(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    struct resp r;
    request(fx->port, "GET", "/v1/models", AUTH, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    json_t *j = body_json(&r);
    json_t *m = json_array_get(json_object_get(j, "data"), 0);
    assert_string_equal(json_string_value(json_object_get(m, "id")), "fake-stories");
    assert_int_equal(json_integer_value(json_object_get(m, "max_model_len")), N_CTX);
    json_decref(j);
    resp_free(&r);

    /* One model by id (the SDKs' models.retrieve); another id is 404; the key applies. */
    request(fx->port, "GET", "/v1/models/fake-stories", AUTH, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    j = body_json(&r);
    assert_string_equal(json_string_value(json_object_get(j, "id")), "fake-stories");
    assert_string_equal(json_string_value(json_object_get(j, "object")), "model");
    json_decref(j);
    resp_free(&r);
    request(fx->port, "GET", "/v1/models/gpt-4o", AUTH, NULL, 0, &r);
    expect_error(&r, 404, "'gpt-4o' does not exist");
    resp_free(&r);
    request(fx->port, "GET", "/v1/models/fake-stories", NULL, NULL, 0, &r);
    expect_error(&r, 401, "API key");
    resp_free(&r);
    request(fx->port, "POST", "/v1/models/fake-stories", AUTH, "{}", 0, &r);
    expect_error(&r, 405, "use GET");
    resp_free(&r);

    /* /health needs no key. */
    request(fx->port, "GET", "/health", NULL, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    j = body_json(&r);
    assert_string_equal(json_string_value(json_object_get(j, "status")), "ok");
    assert_int_equal(json_array_size(json_object_get(j, "stages")), 2);
    json_decref(j);
    resp_free(&r);
    pthread_mutex_lock(&fx->fake.mu);
    fx->fake.healthy = false;
    pthread_mutex_unlock(&fx->fake.mu);
    request(fx->port, "GET", "/health", NULL, NULL, 0, &r);
    assert_int_equal(r.status, 503);
    j = body_json(&r);
    assert_string_equal(json_string_value(json_object_get(j, "status")), "unavailable");
    json_decref(j);
    resp_free(&r);
    fake_reset(&fx->fake);

    request(fx->port, "GET", "/metrics", AUTH, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    static const char *const want[] = {
        "kvasir:http_requests_total{endpoint=\"/v1/completions\",code=\"200\"} ",
        "kvasir:http_requests_total{endpoint=\"/health\",code=\"503\"} 1\n",
        "kvasir:request_success_total{model_name=\"fake-stories\",finished_reason=\"stop\"} ",
        "kvasir:time_to_first_token_seconds_bucket{model_name=\"fake-stories\",le=\"+Inf\"} ",
        "kvasir:inter_token_latency_seconds_count{model_name=\"fake-stories\"} ",
        "kvasir:e2e_request_latency_seconds_sum{model_name=\"fake-stories\"} ",
        "kvasir:prompt_tokens_total{model_name=\"fake-stories\"} ",
        "kvasir:generation_tokens_total{model_name=\"fake-stories\"} ",
        "kvasir:fake_queue_depth{model_name=\"fake-stories\"} 3\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(r.body, want[i]))
            fail_msg("metrics lack '%s':\n%s", want[i], r.body);
    resp_free(&r);
}

/* Wait up to `ms` for the fake to have seen `n` cancels; returns the time it took. */
static double wait_cancels(struct fake *f, int n, uint64_t since_ns, double ms)
{
    uint64_t deadline = kvr_now_ns() + (uint64_t)(ms * 1e6);
    for (;;) {
        pthread_mutex_lock(&f->mu);
        int c = f->n_cancel;
        uint64_t t = f->t_cancel_ns;
        pthread_mutex_unlock(&f->mu);
        if (c >= n)
            return (double)(t - since_ns) * 1e-6;
        if (kvr_now_ns() > deadline)
            return -1;
        kvr_sleep_ns(5 * 1000000);
    }
}

static void test_disconnect_cancels(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    static const int32_t slow[] = {W_THE, W_END};
    pthread_mutex_lock(&fx->fake.mu);
    fx->fake.script = slow;
    fx->fake.n_script = 2;
    fx->fake.eos_after_script = false;
    fx->fake.delay_ms = 150; /* a token every 150 ms: the stream would take 9 s */
    int cancels = fx->fake.n_cancel, releases = fx->fake.n_release;
    pthread_mutex_unlock(&fx->fake.mu);

    for (int streaming = 1; streaming >= 0; streaming--) {
        int fd = dial(fx->port);
        char req[512];
        const char *body = streaming ? "{\"prompt\": \"x\", \"max_tokens\": 60, \"stream\": true}"
                                     : "{\"prompt\": \"x\", \"max_tokens\": 60}";
        int n = snprintf(req, sizeof req,
                         "POST /v1/completions HTTP/1.1\r\nHost: x\r\n" AUTH
                         "Content-Length: %zu\r\n\r\n%s",
                         strlen(body), body);
        assert_true(send_all(fd, req, (size_t)n));
        if (streaming) {
            /* Read until the first token's chunk has arrived, then hang up. */
            char buf[4096];
            size_t got = 0;
            while (got < sizeof buf - 1) {
                ssize_t k = recv(fd, buf + got, sizeof buf - 1 - got, 0);
                assert_true(k > 0);
                got += (size_t)k;
                buf[got] = 0;
                if (strstr(buf, " The"))
                    break;
            }
        } else {
            kvr_sleep_ns(300 * 1000000ull);
        }
        uint64_t t_close = kvr_now_ns();
        close(fd);
        cancels++;
        releases++;
        double ms = wait_cancels(&fx->fake, cancels, t_close, 1000);
        print_message("%s: cancel seen %.1f ms after the client closed\n",
                      streaming ? "stream" : "json", ms);
        assert_true(ms >= 0 && ms < 1000);
        /* And the stream is released soon after. */
        uint64_t deadline = kvr_now_ns() + 1000000000ull;
        for (;;) {
            pthread_mutex_lock(&fx->fake.mu);
            int rel = fx->fake.n_release;
            pthread_mutex_unlock(&fx->fake.mu);
            if (rel >= releases)
                break;
            assert_true(kvr_now_ns() < deadline);
            kvr_sleep_ns(5 * 1000000);
        }
    }
    fake_reset(&fx->fake);
    expect_alive(fx->port);
}

static void test_every_stream_released(void **state)
{
    struct fixture *fx = *state;
    /* By now every admitted stream has been released exactly once. */
    pthread_mutex_lock(&fx->fake.mu);
    assert_int_equal(fx->fake.n_submit, fx->fake.n_release);
    pthread_mutex_unlock(&fx->fake.mu);
}

/* Send a POST on a new connection and leave the answer unread. */
static int post_async(uint16_t port, const char *body)
{
    int fd = dial(port);
    char req[512];
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" AUTH
                     "Content-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    assert_true(send_all(fd, req, (size_t)n));
    return fd;
}

/* A server stopped while generations run answers them 503 "shutting_down" (a stream: an
 * error event and [DONE], well-formed to the last chunk), cancels and releases them, and
 * returns promptly. */
/* Waits (5 s at most) until what the server has sent on fd contains `needle`, without
 * consuming it (MSG_PEEK), so read_resp still reads the whole response afterwards. */
static void peek_until(int fd, const char *needle)
{
    static char buf[1 << 16];
    uint64_t t0 = kvr_now_ns();
    for (;;) {
        ssize_t k = recv(fd, buf, sizeof buf - 1, MSG_PEEK | MSG_DONTWAIT);
        if (k > 0) {
            buf[k] = 0;
            if (strstr(buf, needle))
                return;
        }
        assert_true(kvr_now_ns() - t0 < 5000000000ull);
        kvr_sleep_ns(5000000);
    }
}

static void test_shutdown_with_stream(void **state)
{
    struct fixture *fx = start(1u << 20);
    static const int32_t slow[] = {W_THE};
    pthread_mutex_lock(&fx->fake.mu);
    fx->fake.script = slow;
    fx->fake.n_script = 1;
    fx->fake.eos_after_script = false;
    fx->fake.delay_ms = 200;
    pthread_mutex_unlock(&fx->fake.mu);
    int streaming =
        post_async(fx->port, "{\"prompt\": \"x\", \"max_tokens\": 60, \"stream\": true}");
    int whole = post_async(fx->port, "{\"prompt\": \"x\", \"max_tokens\": 60}");
    /* Both admitted, and the stream has produced a token or two. */
    uint64_t t0 = kvr_now_ns();
    for (;;) {
        pthread_mutex_lock(&fx->fake.mu);
        uint32_t n = fx->fake.n_submit;
        pthread_mutex_unlock(&fx->fake.mu);
        if (n == 2)
            break;
        assert_true(kvr_now_ns() - t0 < 2000000000ull);
        kvr_sleep_ns(5000000);
    }
    /* The stream's first token has reached the client (waiting a fixed 300 ms instead
     * failed under load: the server had not even sent the response head). */
    peek_until(streaming, "\"text\":\" The\"");

    t0 = kvr_now_ns();
    kvr_http_destroy(fx->http);
    double ms = (double)(kvr_now_ns() - t0) * 1e-6;
    print_message("shutdown with two running generations took %.1f ms\n", ms);
    assert_true(ms < 2000);
    assert_int_equal(fx->fake.n_submit, 2);
    assert_int_equal(fx->fake.n_cancel, 2);
    assert_int_equal(fx->fake.n_release, 2);

    struct resp r;
    read_resp(streaming, &r); /* de-chunks: fails on a truncated chunked body */
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"text\":\" The\"")); /* a token came first */
    assert_non_null(strstr(r.body, "data: {\"error\":"));
    assert_non_null(strstr(r.body, "\"code\":\"shutting_down\""));
    assert_true(r.body_len > 14);
    assert_string_equal(r.body + r.body_len - 14, "data: [DONE]\n\n");
    resp_free(&r);
    read_resp(whole, &r);
    expect_error(&r, 503, "shutting down");
    resp_free(&r);
    close(streaming);
    close(whole);
    fx->http = NULL;
    stop(fx);
}

/* A service that goes quiet is cut off by the stall timeout with a 504. */
static void test_stall_timeout(void **state)
{
    struct fixture *fx = start_cfg(1u << 20, 1);
    pthread_mutex_lock(&fx->fake.mu);
    fx->fake.delay_ms = 5000;
    pthread_mutex_unlock(&fx->fake.mu);
    uint64_t t0 = kvr_now_ns();
    struct resp r;
    post(fx->port, "/v1/completions", "{\"prompt\": \"x\"}", &r);
    double ms = (double)(kvr_now_ns() - t0) * 1e-6;
    expect_error(&r, 504, "no token for 1000 ms");
    resp_free(&r);
    assert_true(ms >= 1000 && ms < 2500);
    assert_int_equal(fx->fake.n_cancel, 1);
    assert_int_equal(fx->fake.n_release, 1);
    stop(fx);
}

/* HEAD is answered like GET, without a body. */
static void test_head(void **state)
{
    struct fixture *fx = *state;
    struct resp r;
    request(fx->port, "HEAD", "/health", NULL, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    assert_int_equal(r.body_len, 0);
    resp_free(&r);
}

/* The console (console.h): open even with an API key, typed, with its CSP; the estimate
 * headers on a streamed chat. */
static void test_console_routes(void **state)
{
    struct fixture *fx = *state;
    struct resp r;
    char v[512];
    request(fx->port, "GET", "/", NULL, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(header(&r, "Content-Type", v, sizeof v));
    assert_string_equal(v, "text/html; charset=utf-8");
    assert_non_null(header(&r, "Content-Security-Policy", v, sizeof v));
    assert_non_null(strstr(v, "script-src 'self'"));
    assert_non_null(strstr(r.body, "/console.js"));
    resp_free(&r);
    request(fx->port, "GET", "/console.js", NULL, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(header(&r, "Content-Type", v, sizeof v));
    assert_string_equal(v, "text/javascript; charset=utf-8");
    resp_free(&r);
    request(fx->port, "GET", "/nope.js", NULL, NULL, 0, &r);
    expect_error(&r, 404, "no such endpoint");
    resp_free(&r);
    request(fx->port, "GET", "/../console.js", NULL, NULL, 0, &r);
    assert_int_not_equal(r.status, 200);
    resp_free(&r);
    post(fx->port, "/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"stream\": true, "
         "\"max_tokens\": 3}",
         &r);
    assert_int_equal(r.status, 200);
    assert_non_null(header(&r, "X-Kvasir-Estimate-First-Token-Ms", v, sizeof v));
    assert_string_equal(v, "120.0");
    assert_non_null(header(&r, "X-Kvasir-Estimate-Total-Ms", v, sizeof v));
    assert_string_equal(v, "480.0");
    assert_non_null(header(&r, "X-Kvasir-Request-Id", v, sizeof v));
    assert_string_equal(v, "7");
    resp_free(&r);
}

/* Read from fd until `what` has arrived (10 s at most, the socket's timeout). */
static bool recv_until(int fd, const char *what)
{
    char buf[8192];
    size_t len = 0;
    while (len < sizeof buf - 1) {
        ssize_t k = recv(fd, buf + len, sizeof buf - 1 - len, 0);
        if (k <= 0)
            return false;
        len += (size_t)k;
        buf[len] = 0;
        if (strstr(buf, what))
            return true;
    }
    return false;
}

/* GET /v1/telemetry: the key is needed; snapshots come as SSE; at most 8 streams at once,
 * and a stream whose client went away frees its place. */
static void test_telemetry_streams(void **state)
{
    struct fixture *fx = *state;
    struct resp r;
    request(fx->port, "GET", "/v1/telemetry", NULL, NULL, 0, &r);
    expect_error(&r, 401, "API key");
    resp_free(&r);
    static const char get[] = "GET /v1/telemetry?interval_ms=100 HTTP/1.1\r\nHost: x\r\n"
                              "Connection: close\r\n" AUTH "\r\n";
    int fds[8];
    for (int i = 0; i < 8; i++) {
        fds[i] = dial(fx->port);
        assert_true(send_all(fds[i], get, sizeof get - 1));
        assert_true(recv_until(fds[i], "event: snapshot\ndata: {\"v\":1,"));
    }
    assert_true(recv_until(fds[0], "event: snapshot")); /* and the next one */
    request(fx->port, "GET", "/v1/telemetry", AUTH, NULL, 0, &r);
    expect_error(&r, 503, "8 telemetry streams are open already");
    resp_free(&r);
    /* What the streams cost is counted: their threads' CPU time, above zero by now. */
    request(fx->port, "GET", "/metrics", AUTH, NULL, 0, &r);
    static const char cpu_name[] =
        "kvasir:telemetry_cpu_seconds_total{model_name=\"fake-stories\"} ";
    const char *cpu = r.body ? strstr(r.body, cpu_name) : NULL;
    assert_non_null(cpu);
    assert_true(strtod(cpu + sizeof cpu_name - 1, NULL) > 0);
    resp_free(&r);
    for (int i = 0; i < 8; i++)
        close(fds[i]);
    /* The server notices within a poll slice or two. */
    bool ok = false;
    for (int i = 0; i < 50 && !ok; i++) {
        int fd = dial(fx->port);
        assert_true(send_all(fd, get, sizeof get - 1));
        ok = recv_until(fd, " 200 ");
        close(fd);
        if (!ok)
            kvr_sleep_ns(100 * 1000000ull);
    }
    assert_true(ok);
}

static void test_config_errors(void **state)
{
    struct kvr_tok *tok = make_tok();
    struct fake f;
    memset(&f, 0, sizeof f);
    struct kvr_service svc = {
        .ops = &fake_ops, .ctx = &f, .model_name = "m", .n_ctx = 64, .tok = tok};
    struct kvr_http_config cfg;
    kvr_http_config_init(&cfg);
    cfg.port = 0;
    struct kvr_http *h = NULL;
    struct kvr_err err = {0};
    cfg.chat_template = "vicuna";
    assert_int_equal(kvr_http_create(&h, &cfg, &svc, &err), KVR_EINVAL);
    assert_non_null(strstr(err.msg, "unknown chat template"));
    cfg.chat_template = NULL;
    cfg.host = "localhost:80";
    assert_int_equal(kvr_http_create(&h, &cfg, &svc, &err), KVR_EINVAL);
    cfg.host = "127.0.0.1";
    svc.tok = NULL;
    assert_int_equal(kvr_http_create(&h, &cfg, &svc, &err), KVR_EINVAL);
    svc.tok = tok;
    /* A port already in use. */
    assert_int_equal(kvr_http_create(&h, &cfg, &svc, &err), KVR_OK);
    cfg.port = kvr_http_port(h);
    struct kvr_http *h2 = NULL;
    assert_int_equal(kvr_http_create(&h2, &cfg, &svc, &err), KVR_EIO);
    kvr_http_destroy(h);
    kvr_tok_destroy(tok);
}

static json_t *post_json(uint16_t port, const char *path, const char *body)
{
    struct resp r;
    post(port, path, body, &r);
    if (r.status != 200)
        fail_msg("%s: status %d: %.300s", path, r.status, r.body);
    json_t *j = body_json(&r);
    resp_free(&r);
    return j;
}

/* /apply-template gives the chat prompt, /tokenize its ids (the chat request sends the
 * same ids, BOS added as add_special adds it), /detokenize the text back. */
static void test_tokenize_endpoints(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    static const char msgs[] = "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, "
                               "{\"role\": \"user\", \"content\": \"Once upon\"}]";
    char body[512];
    snprintf(body, sizeof body, "%s}", msgs);
    json_t *j = post_json(fx->port, "/apply-template", body);
    const char *prompt = json_string_value(json_object_get(j, "prompt"));
    assert_string_equal(prompt, "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nOnce upon"
                                "<|im_end|>\n<|im_start|>assistant\n");
    json_t *req = json_pack("{s:s,s:b}", "content", prompt, "add_special", 1);
    char *tb = json_dumps(req, 0);
    json_decref(req);
    json_t *t = post_json(fx->port, "/tokenize", tb);
    free(tb);
    json_t *ids = json_object_get(t, "tokens");
    assert_true(json_array_size(ids) > 6);
    assert_int_equal(json_integer_value(json_array_get(ids, 0)), 1); /* BOS */
    assert_int_equal(json_integer_value(json_array_get(ids, 1)), W_IM_START);

    snprintf(body, sizeof body, "%s, \"max_tokens\": 1}", msgs);
    struct resp r;
    post(fx->port, "/v1/chat/completions", body, &r);
    assert_int_equal(r.status, 200);
    json_t *cj = body_json(&r);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(cj, "usage"), "prompt_tokens")),
        json_array_size(ids));
    json_decref(cj);
    resp_free(&r);
    pthread_mutex_lock(&fx->fake.mu);
    assert_int_equal(fx->fake.last_n_prompt, json_array_size(ids));
    for (uint32_t i = 0; i < fx->fake.last_n_prompt; i++)
        assert_int_equal(fx->fake.last_prompt[i], json_integer_value(json_array_get(ids, i)));
    pthread_mutex_unlock(&fx->fake.mu);

    /* Back to text: control tokens print as their text. */
    json_t *dreq = json_pack("{s:O}", "tokens", ids);
    char *db = json_dumps(dreq, 0);
    json_decref(dreq);
    json_t *d = post_json(fx->port, "/detokenize", db);
    free(db);
    const char *content = json_string_value(json_object_get(d, "content"));
    if (!strstr(content, "user\nOnce upon<|im_end|>"))
        fail_msg("detokenized: %s", content);
    json_decref(d);
    json_decref(t);
    json_decref(j);

    /* Without add_special there is no BOS; with pieces, each id comes with its text. */
    t = post_json(fx->port, "/tokenize",
                  "{\"content\": \"<|im_end|>\\u00e9\", \"with_pieces\": true}");
    ids = json_object_get(t, "tokens");
    json_t *first = json_array_get(ids, 0);
    assert_int_equal(json_integer_value(json_object_get(first, "id")), W_IM_END);
    assert_string_equal(json_string_value(json_object_get(first, "piece")), "<|im_end|>");
    /* é is two byte tokens here: each piece is one byte, not valid UTF-8 alone. */
    json_t *last = json_array_get(ids, json_array_size(ids) - 1);
    assert_true(json_is_array(json_object_get(last, "piece")));
    assert_int_equal(json_integer_value(json_array_get(json_object_get(last, "piece"), 0)), 0xA9);
    json_decref(t);

    /* Bad input is refused with the field named. */
    static const struct {
        const char *path, *body, *msg;
    } bad[] = {
        {"/tokenize", "{}", "'content'"},
        {"/tokenize", "{\"content\": 5}", "'content' must be a string"},
        {"/tokenize", "{\"content\": \"x\", \"add_special\": 1}",
         "'add_special' must be a boolean"},
        {"/tokenize", "[\"x\"]", "must be a JSON object"},
        {"/tokenize", "{\"content\": ", "not valid JSON"},
        {"/detokenize", "{}", "'tokens'"},
        {"/detokenize", "{\"tokens\": \"1 2\"}", "'tokens' must be an array"},
        {"/detokenize", "{\"tokens\": [1, 1.5]}", "'tokens[1]' must be an integer"},
        {"/detokenize", "{\"tokens\": [1, 100000]}", "outside the vocabulary"},
        {"/detokenize", "{\"tokens\": [-1]}", "outside the vocabulary"},
        {"/apply-template", "{}", "messages"},
        {"/apply-template", "{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}", "role"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        post(fx->port, bad[i].path, bad[i].body, &r);
        expect_error(&r, 400, bad[i].msg);
        resp_free(&r);
    }
    request(fx->port, "GET", "/tokenize", AUTH, NULL, 0, &r);
    expect_error(&r, 405, "use POST");
    resp_free(&r);
    request(fx->port, "POST", "/detokenize", "", "{\"tokens\": []}", 14, &r);
    expect_error(&r, 401, "API key");
    resp_free(&r);
    expect_alive(fx->port);
}

/* --chat-template FILE's source replaces the model's template; a template that refuses
 * the conversation or fails on it is a 400 with its message, and the server goes on. */
static void test_chat_template_errors(void **state)
{
    struct kvr_tok *tok = make_tok();
    struct fake f;
    memset(&f, 0, sizeof f);
    pthread_mutex_init(&f.mu, NULL);
    fake_reset(&f);
    struct kvr_service svc = {.ops = &fake_ops,
                              .ctx = &f,
                              .model_name = "m",
                              .n_ctx = N_CTX,
                              .tok = tok,
                              .chat_template = "{{ nonsense",
                              .chat_template_len = 11};
    static const char tmpl[] =
        "{% if messages[-1].role != 'user' %}{{ raise_exception('the last message must be "
        "from the user') }}{% endif %}{% if messages[0].content == 'boom' %}"
        "{{ messages[0].content + 1 }}{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
    struct kvr_http_config cfg;
    kvr_http_config_init(&cfg);
    cfg.port = 0;
    cfg.api_key = API_KEY;
    cfg.chat_template_src = tmpl;
    cfg.chat_template_src_len = sizeof tmpl - 1;
    struct kvr_http *h = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_http_create(&h, &cfg, &svc, &err), KVR_OK);
    uint16_t port = kvr_http_port(h);
    struct resp r;
    post(port, "/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"u\"}, "
         "{\"role\": \"assistant\", \"content\": \"a\"}], \"max_tokens\": 2}",
         &r);
    expect_error(&r, 400, "refused the conversation: line 1: the last message must be from");
    resp_free(&r);
    post(port, "/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"boom\"}], \"max_tokens\": 2}", &r);
    expect_error(&r, 400, "the chat template failed on this conversation: line 1:");
    resp_free(&r);
    expect_alive(port);
    kvr_http_destroy(h);

    /* The model's own template is parsed at start-up: a broken one is refused there. */
    cfg.chat_template_src = NULL;
    assert_int_equal(kvr_http_create(&h, &cfg, &svc, &err), KVR_EFORMAT);
    assert_non_null(strstr(err.msg, "chat template: line 1:"));
    kvr_tok_destroy(tok);
    pthread_mutex_destroy(&f.mu);
}

/* ---- metrics: labels, buckets, histograms, --metrics-public ------------------------------- */

/* Every kvasir: sample about the model carries model_name first; the server's own request
 * and connection counts do not. */
static void expect_model_labels(const char *body)
{
    for (const char *line = body; line && *line;
         line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
        if (strncmp(line, "kvasir:", 7) != 0)
            continue;
        bool server = !strncmp(line, "kvasir:http_requests_total", 26) ||
                      !strncmp(line, "kvasir:http_connections_", 24);
        size_t name = strcspn(line, "{ ");
        bool labelled = !strncmp(line + name, "{model_name=\"fake-stories\"", 26);
        if (server == labelled)
            fail_msg("model_name label %s in: %.*s", server ? "unexpected" : "missing",
                     (int)strcspn(line, "\n"), line);
    }
}

static void test_metrics_labels_and_buckets(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    expect_alive(fx->port); /* at least one observation in each histogram */
    struct resp r;
    request(fx->port, "GET", "/metrics", AUTH, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    expect_model_labels(r.body);
    /* Complete histograms: every one has _sum and _count beside its buckets. */
    int n_hist = 0;
    for (const char *t = strstr(r.body, "# TYPE "); t; t = strstr(t + 1, "# TYPE ")) {
        char name[128], type[32];
        if (sscanf(t, "# TYPE %127s %31s", name, type) != 2 || strcmp(type, "histogram"))
            continue;
        n_hist++;
        char want[160];
        snprintf(want, sizeof want, "\n%s_sum{model_name=", name);
        if (!strstr(r.body, want))
            fail_msg("histogram %s lacks _sum", name);
        snprintf(want, sizeof want, "\n%s_count{model_name=", name);
        if (!strstr(r.body, want))
            fail_msg("histogram %s lacks _count", name);
    }
    assert_true(n_hist >= 3);
    /* Buckets cover the default budgets: 60 s to the first token, 600 s in all. */
    static const char *const bounds[] = {
        "kvasir:time_to_first_token_seconds_bucket{model_name=\"fake-stories\",le=\"60\"} ",
        "kvasir:time_to_first_token_seconds_bucket{model_name=\"fake-stories\",le=\"600\"} ",
        "kvasir:e2e_request_latency_seconds_bucket{model_name=\"fake-stories\",le=\"600\"} ",
        "kvasir:http_connections_open ",
        "kvasir:http_connections_closed_total{reason=\"header_timeout\"} ",
    };
    for (size_t i = 0; i < sizeof bounds / sizeof bounds[0]; i++)
        if (!strstr(r.body, bounds[i]))
            fail_msg("metrics lack '%s'", bounds[i]);
    resp_free(&r);
    /* By default /metrics wants the key. */
    request(fx->port, "GET", "/metrics", NULL, NULL, 0, &r);
    expect_error(&r, 401, "API key");
    resp_free(&r);
}

/* The label's value is escaped as the text format wants. */
static void test_metrics_label_escaping(void **state)
{
    (void)state;
    const char text[] = "# TYPE kvasir:a gauge\nkvasir:a 1\nkvasir:b{x=\"y\"} 2\nkvasir:c{} 3\n"
                        "kvasir:http_requests_total{code=\"200\"} 4\nother 5\n";
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    kvr_http_metrics_label_model(text, sizeof text - 1, "a\"b\\c", &out);
    assert_false(out.failed);
    assert_string_equal(out.data, "# TYPE kvasir:a gauge\n"
                                  "kvasir:a{model_name=\"a\\\"b\\\\c\"} 1\n"
                                  "kvasir:b{model_name=\"a\\\"b\\\\c\",x=\"y\"} 2\n"
                                  "kvasir:c{model_name=\"a\\\"b\\\\c\"} 3\n"
                                  "kvasir:http_requests_total{code=\"200\"} 4\nother 5\n");
    kvr_sbuf_fini(&out);
}

static void metrics_public(struct kvr_http_config *cfg)
{
    cfg->metrics_public = true;
}

static void test_metrics_public(void **state)
{
    (void)state;
    tweak_cfg = metrics_public;
    struct fixture *fx = start(1u << 20);
    tweak_cfg = NULL;
    struct resp r;
    request(fx->port, "GET", "/metrics", NULL, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "kvasir:prompt_tokens_total{model_name=\"fake-stories\"} "));
    resp_free(&r);
    request(fx->port, "GET", "/v1/models", NULL, NULL, 0, &r); /* the rest still wants it */
    expect_error(&r, 401, "API key");
    resp_free(&r);
    stop(fx);
}

/* ---- CORS ------------------------------------------------------------------------------- */

/* A browser's preflight for the OpenAI SDK's chat call: 204 without the key, with the
 * methods, the headers it asked for, and a max age; every answer names the origin. */
static void test_cors(void **state)
{
    struct fixture *fx = *state;
    fake_reset(&fx->fake);
    struct resp r;
    char v[512];
    request(fx->port, "OPTIONS", "/v1/chat/completions",
            "Origin: http://localhost:3000\r\nAccess-Control-Request-Method: POST\r\n"
            "Access-Control-Request-Headers: authorization, content-type, x-stainless-os\r\n",
            NULL, 0, &r);
    assert_int_equal(r.status, 204);
    assert_string_equal(header(&r, "Access-Control-Allow-Origin", v, sizeof v), "*");
    assert_non_null(strstr(header(&r, "Access-Control-Allow-Methods", v, sizeof v), "POST"));
    assert_string_equal(header(&r, "Access-Control-Allow-Headers", v, sizeof v),
                        "authorization, content-type, x-stainless-os");
    assert_string_equal(header(&r, "Access-Control-Max-Age", v, sizeof v), "86400");
    assert_int_equal(r.body_len, 0);
    resp_free(&r);
    /* Without a list asked for: ours, with Authorization and the SDK's. */
    request(fx->port, "OPTIONS", "/v1/models", "Origin: http://x\r\n", NULL, 0, &r);
    assert_int_equal(r.status, 204);
    assert_non_null(strstr(header(&r, "Access-Control-Allow-Headers", v, sizeof v),
                           "Authorization, Content-Type"));
    assert_non_null(strstr(v, "X-Stainless-Retry-Count"));
    assert_non_null(strstr(header(&r, "Access-Control-Allow-Methods", v, sizeof v), "GET"));
    resp_free(&r);
    /* Answers, errors and streams carry the origin too. */
    request(fx->port, "GET", "/health", "Origin: http://x\r\n", NULL, 0, &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(header(&r, "Access-Control-Allow-Origin", v, sizeof v), "*");
    resp_free(&r);
    request(fx->port, "GET", "/v1/models", NULL, NULL, 0, &r);
    assert_int_equal(r.status, 401);
    assert_string_equal(header(&r, "Access-Control-Allow-Origin", v, sizeof v), "*");
    resp_free(&r);
    post(fx->port, "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 2, \"stream\": true}",
         &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(header(&r, "Access-Control-Allow-Origin", v, sizeof v), "*");
    resp_free(&r);
}

static void cors_one(struct kvr_http_config *cfg)
{
    cfg->cors_origin = "https://app.example";
}

static void cors_none(struct kvr_http_config *cfg)
{
    cfg->cors_origin = "none";
}

static void test_cors_configured(void **state)
{
    (void)state;
    struct resp r;
    char v[256];
    tweak_cfg = cors_one;
    struct fixture *fx = start(1u << 20);
    request(fx->port, "GET", "/health", NULL, NULL, 0, &r);
    assert_string_equal(header(&r, "Access-Control-Allow-Origin", v, sizeof v),
                        "https://app.example");
    assert_string_equal(header(&r, "Vary", v, sizeof v), "Origin");
    resp_free(&r);
    stop(fx);
    tweak_cfg = cors_none;
    fx = start(1u << 20);
    tweak_cfg = NULL;
    request(fx->port, "GET", "/health", NULL, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    assert_null(header(&r, "Access-Control-Allow-Origin", v, sizeof v));
    resp_free(&r);
    request(fx->port, "OPTIONS", "/v1/completions", NULL, NULL, 0, &r);
    assert_int_equal(r.status, 204); /* still says what it allows, but no CORS */
    assert_string_equal(header(&r, "Allow", v, sizeof v), "POST, OPTIONS");
    assert_null(header(&r, "Access-Control-Allow-Methods", v, sizeof v));
    resp_free(&r);
    stop(fx);
}

/* ---- the door ------------------------------------------------------------------------------ */

static void small_door(struct kvr_http_config *cfg)
{
    cfg->max_connections = 8; /* 7 may wait for headers; 1 is kept for requests */
    cfg->max_per_client = 0;
    cfg->header_timeout_s = 1;
}

/* Milliseconds until the server closes `fd` (recv sees the end), or -1 after `ms`. */
static double ms_until_closed(int fd, int ms, const char *trickle, int every_ms)
{
    uint64_t t0 = kvr_now_ns(), next = t0;
    for (;;) {
        uint64_t now = kvr_now_ns();
        double el = (double)(now - t0) * 1e-6;
        if (el > ms)
            return -1;
        if (trickle && now >= next) {
            if (!send_all(fd, trickle, strlen(trickle)))
                return el;
            next = now + (uint64_t)every_ms * 1000000;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 20) > 0) {
            char buf[256];
            ssize_t k = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
            if (k <= 0 && !(k < 0 && errno == EAGAIN))
                return el;
        }
    }
}

static unsigned long long metric_value(uint16_t port, const char *key)
{
    struct resp r;
    request(port, "GET", "/metrics", AUTH, NULL, 0, &r);
    assert_int_equal(r.status, 200);
    const char *at = strstr(r.body, key);
    if (!at)
        fail_msg("metrics lack '%s'", key);
    unsigned long long v = strtoull(at + strlen(key), NULL, 10);
    resp_free(&r);
    return v;
}

/* A client trickling a header line every 300 ms is closed at the 1 s header deadline
 * (libmicrohttpd's inactivity timeout alone would keep it forever); so is one that sends
 * nothing. A full house of idle connections cannot keep /health or an authenticated
 * request out: the oldest waiting ones are closed to make room. */
static void test_door(void **state)
{
    (void)state;
    tweak_cfg = small_door;
    struct fixture *fx = start(1u << 20);
    tweak_cfg = NULL;
    int fd = dial(fx->port);
    assert_true(send_all(fd, "GET /health HTTP/1.1\r\n", 22));
    double el = ms_until_closed(fd, 4000, "X-Slow: 1\r\n", 300);
    close(fd);
    if (el < 800 || el > 2500)
        fail_msg("the trickling client was closed after %.0f ms, want about 1000", el);
    fd = dial(fx->port);
    el = ms_until_closed(fd, 4000, NULL, 0);
    close(fd);
    if (el < 800 || el > 2500)
        fail_msg("the silent client was closed after %.0f ms, want about 1000", el);
    assert_true(metric_value(fx->port,
                             "kvasir:http_connections_closed_total{reason=\"header_timeout\"} ") >=
                2);

    int idle[24];
    for (int i = 0; i < 24; i++)
        idle[i] = dial(fx->port);
    kvr_sleep_ns(100 * 1000000ull);
    for (int round = 0; round < 3; round++) {
        struct resp r;
        uint64_t t0 = kvr_now_ns();
        request(fx->port, "GET", "/health", NULL, NULL, 0, &r);
        assert_int_equal(r.status, 200);
        resp_free(&r);
        expect_alive(fx->port);
        double ms = (double)(kvr_now_ns() - t0) * 1e-6;
        if (ms > 500)
            fail_msg("/health and a completion took %.0f ms behind 24 idle connections", ms);
    }
    unsigned long long evicted =
        metric_value(fx->port, "kvasir:http_connections_closed_total{reason=\"evicted\"} ");
    if (evicted < 8) {
        struct resp r;
        request(fx->port, "GET", "/metrics", AUTH, NULL, 0, &r);
        fail_msg("%llu idle connections were closed to make room, want >= 8:\n%s", evicted,
                 strstr(r.body, "kvasir:http_connections_open"));
    }
    for (int i = 0; i < 24; i++)
        close(idle[i]);
    stop(fx);
}

static void per_client(struct kvr_http_config *cfg)
{
    cfg->max_per_client = 3;
}

/* The fourth connection from one address is refused at once, and counted. */
static void test_door_per_client(void **state)
{
    (void)state;
    tweak_cfg = per_client;
    struct fixture *fx = start(1u << 20);
    tweak_cfg = NULL;
    int fds[3];
    for (int i = 0; i < 3; i++)
        fds[i] = dial(fx->port);
    int extra = dial(fx->port);
    double el = ms_until_closed(extra, 2000, NULL, 0);
    close(extra);
    if (el < 0 || el > 500)
        fail_msg("the 4th connection was closed after %.0f ms", el);
    for (int i = 0; i < 3; i++)
        close(fds[i]);
    kvr_sleep_ns(100 * 1000000ull);
    assert_true(
        metric_value(fx->port,
                     "kvasir:http_connections_closed_total{reason=\"refused_per_client\"} ") >= 1);
    stop(fx);
}

/* Tools through the whole HTTP path with a Hermes-style template: the answer the service
 * sends is read back as a tool call (chat, streamed chat, /v1/responses); "auto" sends the
 * lazy grammar, "required" the forcing one, "none" none and leaves the text alone. */
static void test_tools_http(void **state)
{
    struct kvr_tok *tok = make_tok();
    struct fake f;
    memset(&f, 0, sizeof f);
    pthread_mutex_init(&f.mu, NULL);
    fake_reset(&f);
    static const char answer[] =
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
    int32_t ids[256];
    struct kvr_tok_scratch *scratch = NULL;
    assert_int_equal(kvr_tok_scratch_create(&scratch, tok, sizeof answer), 0);
    int n = kvr_tok_encode(tok, scratch, answer, sizeof answer - 1, false, false, ids, 256);
    kvr_tok_scratch_destroy(scratch);
    assert_true(n > 0);
    f.script = ids;
    f.n_script = (uint32_t)n;
    /* A context that holds the answer, spelled mostly one character per token. */
    struct kvr_service svc = {
        .ops = &fake_ops, .ctx = &f, .model_name = "m", .n_ctx = 1024, .tok = tok};
    static const char tmpl[] = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                               "<|im_end|>\n{% endfor %}{% if tools %}<tool_call>{% endif %}"
                               "<|im_start|>assistant\n";
    struct kvr_http_config cfg;
    kvr_http_config_init(&cfg);
    cfg.port = 0;
    cfg.chat_template_src = tmpl;
    cfg.chat_template_src_len = sizeof tmpl - 1;
    struct kvr_http *h = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_http_create(&h, &cfg, &svc, &err), KVR_OK);
    uint16_t port = kvr_http_port(h);
    char body[1024];
#define TOOLS_REQ(choice, stream)                                                                  \
    snprintf(                                                                                      \
        body, sizeof body,                                                                         \
        "{\"messages\": [{\"role\": \"user\", \"content\": \"go\"}], \"max_tokens\": 200, "        \
        "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": "    \
        "{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}}}}], "            \
        "\"tool_choice\": %s, \"stream\": %s}",                                                    \
        choice, stream)
    TOOLS_REQ("\"auto\"", "false");
    json_t *j = post_json(port, "/v1/chat/completions", body);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "tool_calls");
    json_t *fn = json_object_get(
        json_array_get(json_object_get(json_object_get(c, "message"), "tool_calls"), 0),
        "function");
    assert_string_equal(json_string_value(json_object_get(fn, "name")), "f");
    assert_string_equal(json_string_value(json_object_get(fn, "arguments")), "{\"a\":1}");
    json_decref(j);
    static const char lazy[] = "root ::= free0\nblock ::= call\nfree0 ::= \"\" | block free0";
    assert_true(!strncmp(f.last_grammar, lazy, sizeof lazy - 1)); /* the lazy grammar */
    TOOLS_REQ("\"required\"", "true");
    struct resp r;
    post(port, "/v1/chat/completions", body, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"tool_calls\":[{\"id\":\"call_"));
    assert_non_null(strstr(r.body, "\"arguments\":\"{\\\"a\\\":1}\"}}]}"));
    assert_non_null(strstr(r.body, "\"finish_reason\":\"tool_calls\""));
    resp_free(&r);
    assert_true(!strncmp(f.last_grammar, "root ::=  call (\"\\n\" call){0,7}", 30)); /* forced */
    TOOLS_REQ("\"none\"", "false");
    j = post_json(port, "/v1/chat/completions", body);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_non_null(
        strstr(json_string_value(json_object_get(json_object_get(c, "message"), "content")),
               "<tool_call>"));
    json_decref(j);
    assert_string_equal(f.last_grammar, "");
    j = post_json(port, "/v1/responses",
                  "{\"input\": \"go\", \"tools\": [{\"type\": \"function\", \"name\": \"f\"}]}");
    json_t *item = json_array_get(json_object_get(j, "output"), 0);
    assert_string_equal(json_string_value(json_object_get(item, "type")), "function_call");
    assert_string_equal(json_string_value(json_object_get(item, "arguments")), "{\"a\":1}");
    json_decref(j);
#undef TOOLS_REQ
    kvr_http_destroy(h);
    kvr_tok_destroy(tok);
    pthread_mutex_destroy(&f.mu);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_body_too_large),
        cmocka_unit_test(test_completion),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_tokenize_endpoints),
        cmocka_unit_test(test_streaming),
        cmocka_unit_test(test_top_logprobs),
        cmocka_unit_test(test_choices),
        cmocka_unit_test(test_refusal_and_errors),
        cmocka_unit_test(test_models_health_metrics),
        cmocka_unit_test(test_disconnect_cancels),
        cmocka_unit_test(test_head),
        cmocka_unit_test(test_console_routes),
        cmocka_unit_test(test_telemetry_streams),
        cmocka_unit_test(test_every_stream_released),
        cmocka_unit_test(test_metrics_labels_and_buckets),
        cmocka_unit_test(test_cors),
    };
    const struct CMUnitTest solo[] = {
        cmocka_unit_test(test_shutdown_with_stream),   cmocka_unit_test(test_stall_timeout),
        cmocka_unit_test(test_config_errors),          cmocka_unit_test(test_chat_template_errors),
        cmocka_unit_test(test_metrics_label_escaping), cmocka_unit_test(test_metrics_public),
        cmocka_unit_test(test_cors_configured),        cmocka_unit_test(test_door),
        cmocka_unit_test(test_door_per_client),        cmocka_unit_test(test_tools_http),
    };
    int failed = cmocka_run_group_tests_name("http", tests, setup, teardown);
    failed += cmocka_run_group_tests_name("http_lifecycle", solo, NULL, NULL);
    return failed;
}
