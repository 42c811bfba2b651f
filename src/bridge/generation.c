/* generation.c - one text generation, from request body to answer bytes (see generation.h).
 *
 * Sections follow the request: prepare (parse, template, tokenize, length, sampling, text
 * pipeline), submit (admission or refusal), events (pump: detokenize, stop strings,
 * logprobs, metrics), answers (one JSON body, or SSE chunks), and the end (destroy). */
#include "bridge/generation.h"

#include "bridge/choices.h"
#include "bridge/reply.h"
#include "bridge/responses.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"

#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

/* One generation: the parsed request, the service's stream, and the text pipeline
 * (detokenizer -> stop-string cutter -> text or SSE). */
struct kvr_generation {
    const struct kvr_generation_env *env;
    enum kvr_openai_api api;
    struct kvr_openai_req req;   /* keeps the stop strings alive for `cut` */
    struct kvr_gen_request greq; /* built by prepare, handed to the service by submit */
    int32_t *prompt_ids;         /* greq.prompt (n_prompt ids), owned until submit */
    int32_t *prediction_ids;     /* greq.prediction, owned until submit (or NULL) */
    struct kvr_gen_stream *stream;
    char id[48]; /* "cmpl-..." / "chatcmpl-..." */
    struct kvr_openai_meta meta;
    uint32_t n_prompt;
    uint32_t max_tokens;
    uint32_t n_gen; /* tokens received, EOS included */

    struct kvr_detok detok;
    char *piece; /* detokenizer output for one token */
    size_t piece_cap;
    size_t text_bytes; /* detokenized bytes so far: logprobs' text_offset */
    struct kvr_openai_text cut;
    struct kvr_sbuf text; /* released text: all of it (JSON) or the next chunk's (SSE) */
    /* Chat with tools or a reasoning template, and every Responses request: the answer's
     * text, reasoning and tool calls (reply.h); otherwise the text is the answer. */
    bool has_reply;
    enum kvr_reply_format format;
    struct kvr_responses_store *store; /* RESPONSES: previous_response_id's memory */
    struct kvr_reply reply;
    json_t *lp; /* logprobs not yet sent, or NULL when not asked for */

    uint64_t t_start_ns; /* the request's arrival */
    uint64_t t_first_ns; /* the first token's arrival; 0 before it */
    uint64_t t_prev_ns;  /* the previous token's arrival */
    uint64_t t_event_ns; /* the last event (or submit): the stall timer's start */

    /* For the access log: how prepare or submit answered when they did not go on (status
     * 0 otherwise), and admission's estimates (struct kvr_refusal). */
    int early_status;
    bool early_refused; /* submit refused it (else prepare found it invalid) */
    struct kvr_openai_error early;
    double est_first_ms, est_period_ms;
    uint32_t spec_drafted, spec_accepted, spec_steps; /* the service's spec counters */

    bool done;         /* finished, failed or abandoned: no more events wanted */
    bool svc_finished; /* the service sent its last event; no cancel needed */
    bool released;
    enum kvr_openai_finish finish;
    enum kvr_http_outcome outcome;
    struct kvr_openai_error fail; /* when outcome == KVR_HTTP_OUTCOME_ERROR */

    /* Streaming only. */
    struct kvr_sbuf sse; /* bytes produced but not yet read */
    size_t sse_pos;
    bool sse_first; /* the next chunk is the first (chat: carries the role) */
    bool sse_ended; /* [DONE] has been produced */

    /* n > 1 (choices.h): the request's generation holds the choices and answers for them;
     * each choice is a generation of its own, a part: it sends no usage or [DONE], counts
     * no request in the metrics and logs no access line (the request does). */
    struct kvr_choices *choices;
    bool choices_admitted;
    bool part;
    const struct kvr_generation *first; /* a part: the request's generation */
    const struct kvr_generation *lead;  /* a part but choice 0: choice 0, whose prompt it
                                           shares (request.h same_prompt_as) */
};

static uint64_t random_u64(void)
{
    uint64_t x = 0;
    if (getrandom(&x, sizeof x, 0) != (ssize_t)sizeof x) {
        /* No entropy source: fall back to the clocks, which still differ per request. */
        x = kvr_now_ns() * 0x9E3779B97F4A7C15ull ^ kvr_wall_ms();
    }
    return x;
}

static void make_id(char *out, size_t cap, const char *prefix)
{
    uint64_t a = random_u64(), b = random_u64();
    snprintf(out, cap, "%s%016llx%08llx", prefix, (unsigned long long)a,
             (unsigned long long)(b & 0xffffffffu));
}

struct kvr_generation *kvr_generation_create(const struct kvr_generation_env *env,
                                             enum kvr_openai_api api, uint64_t t_start_ns)
{
    struct kvr_generation *g = kvr_calloc(1, sizeof *g);
    if (!g)
        return NULL;
    g->env = env;
    g->api = api;
    g->t_start_ns = t_start_ns;
    make_id(g->id, sizeof g->id, api == KVR_OPENAI_CHAT ? "chatcmpl-" : "cmpl-");
    kvr_sbuf_init(&g->text);
    kvr_sbuf_init(&g->sse);
    kvr_openai_text_init(&g->cut, NULL, NULL, 0, NULL);
    return g;
}

/* ---- prepare -------------------------------------------------------------------------- */

/* The body, then the X-Latency-Budget-Ms header: a total budget the body did not give. */
static int parse_request(struct kvr_generation *g, const char *body, size_t len,
                         const char *budget_header, struct kvr_openai_error *e)
{
    const struct kvr_generation_env *env = g->env;
    struct kvr_openai_limits lim = {.n_ctx = env->svc->n_ctx, .n_vocab = (uint32_t)env->n_vocab};
    int rc = kvr_openai_parse(&g->req, g->api, body, len, &lim, e);
    if (rc || !budget_header)
        return rc;
    uint32_t ms = 0;
    if ((rc = kvr_openai_parse_budget_header(budget_header, &ms, e)))
        return rc;
    if (!g->req.total_ms)
        g->req.total_ms = ms;
    if (g->req.first_token_ms > g->req.total_ms)
        return kvr_openai_error_set(e, 400, "invalid_request_error", "X-Latency-Budget-Ms",
                                    "invalid_value",
                                    "'latency_budget.first_token_ms' (%u ms) exceeds the "
                                    "X-Latency-Budget-Ms total (%u ms)",
                                    g->req.first_token_ms, g->req.total_ms);
    return KVR_OK;
}

int kvr_generation_render_chat(const struct kvr_generation_env *env, const struct kvr_openai_req *r,
                               char **out, size_t *out_len, struct kvr_openai_error *e)
{
    struct kvr_err err = {0};
    time_t now_s = time(NULL);
    struct tm now;
    int rc = kvr_chat_apply_tools(env->chat, r->msgs, r->n_msgs, r->msgs_json, r->tools.list, true,
                                  localtime_r(&now_s, &now), out, out_len, &err);
    if (rc == KVR_ENOMEM)
        return kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    if (rc == KVR_EINVAL)
        return kvr_openai_error_set(
            e, 400, "invalid_request_error", "messages", "chat_template_refused",
            "the model's chat template refused the conversation: %s", err.msg);
    if (rc)
        return kvr_openai_error_set(
            e, 400, "invalid_request_error", "messages", "chat_template_error",
            "the chat template failed on this conversation: %s (%s)", err.msg, kvr_strerror(rc));
    return KVR_OK;
}

static int out_of_memory(struct kvr_openai_error *e)
{
    kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "out of memory");
    return KVR_ENOMEM;
}

/* Tokenize `len` bytes of prompt text into g->prompt_ids. Completion prompts are plain
 * text: "<s>" typed by a user is not BOS. Chat templates write control tokens as text, so
 * a rendered chat is parsed for them. */
static int encode_text(struct kvr_generation *g, const char *text, size_t len,
                       struct kvr_openai_error *e)
{
    const struct kvr_generation_env *env = g->env;
    const struct kvr_tok *tok = env->svc->tok;
    bool chat = g->api == KVR_OPENAI_CHAT;
    /* Each token stands for at most max_piece_bytes of text, so a text this long cannot
     * fit the context whatever it says; refuse before spending memory on tokenizing it. */
    size_t at_least = len / env->max_piece_bytes;
    if (at_least > (size_t)env->svc->n_ctx + 2)
        return kvr_openai_error_set(e, 400, "invalid_request_error", chat ? "messages" : "prompt",
                                    "context_length_exceeded",
                                    "This model's maximum context length is %u tokens, but the "
                                    "prompt (%zu bytes) is at least %zu tokens",
                                    env->svc->n_ctx, len, at_least);
    /* Enough room for any tokenization: at most one token per byte, plus BOS, EOS and
     * SentencePiece's added space. */
    size_t cap = len + 4;
    struct kvr_tok_scratch *scratch = NULL;
    g->prompt_ids = kvr_malloc(cap * sizeof *g->prompt_ids);
    if (!g->prompt_ids || kvr_tok_scratch_create(&scratch, tok, len ? len : 1) != 0)
        return out_of_memory(e);
    int n = kvr_tok_encode(tok, scratch, text, len, true, chat, g->prompt_ids, cap);
    kvr_tok_scratch_destroy(scratch);
    if (n < 0)
        return kvr_openai_error_set(e, 400, "invalid_request_error", chat ? "messages" : "prompt",
                                    "invalid_value", "the prompt cannot be tokenized: %s",
                                    kvr_strerror(n));
    g->n_prompt = (uint32_t)n;
    return KVR_OK;
}

/* The prompt's token ids: given directly, or the prompt text (a chat rendered with the
 * template first) tokenized. */
static int tokenize_prompt(struct kvr_generation *g, struct kvr_openai_error *e)
{
    const struct kvr_openai_req *r = &g->req;
    if (g->api != KVR_OPENAI_CHAT && r->prompt_ids) {
        g->prompt_ids = kvr_malloc((size_t)r->n_prompt_ids * sizeof *g->prompt_ids);
        if (!g->prompt_ids)
            return out_of_memory(e);
        memcpy(g->prompt_ids, r->prompt_ids, (size_t)r->n_prompt_ids * sizeof *g->prompt_ids);
        g->n_prompt = r->n_prompt_ids;
        return KVR_OK;
    }
    if (g->api != KVR_OPENAI_CHAT)
        return encode_text(g, r->prompt, r->prompt_len, e);
    char *rendered = NULL;
    size_t len = 0;
    int rc = kvr_generation_render_chat(g->env, r, &rendered, &len, e);
    if (rc)
        return rc;
    if (g->format != KVR_REPLY_CHAT || kvr_reply_wanted(g->env->chat, r)) {
        kvr_reply_init(&g->reply, g->format, g->env->chat, r, rendered, len, g->id);
        g->reply.store = g->store;
        g->reply.resp_request = r->msgs_json;
        g->has_reply = true;
        if (r->n > 1) { /* choices.c writes plain text choices, not tool calls */
            kvr_free(rendered);
            return kvr_openai_error_set(e, 400, "invalid_request_error", "n", NULL,
                                        "'n' above 1 is not supported with tools or a reasoning "
                                        "model's template");
        }
        if ((rc = kvr_reply_constrain(&g->reply, &g->req, g->env->svc->tok, e))) {
            kvr_free(rendered);
            return rc;
        }
    }
    /* A template that writes bos_token itself gets it from the text, not twice. */
    size_t skip =
        kvr_chat_bos_skip(rendered, len, g->env->bos_text, kvr_tok_add_bos(g->env->svc->tok));
    rc = encode_text(g, rendered + skip, len - skip, e);
    kvr_free(rendered);
    return rc;
}

/* The client's prediction tokenized as answer text (no BOS, control tokens as text), for
 * speculation's drafts (draft.h); cut to max_tokens + 1, more could never be drafted. */
static int tokenize_prediction(struct kvr_generation *g, struct kvr_openai_error *e)
{
    if (!g->req.prediction)
        return KVR_OK;
    struct kvr_sbuf text;
    kvr_sbuf_init(&text);
    kvr_openai_prediction_text(&g->req, &text);
    struct kvr_tok_scratch *scratch = NULL;
    size_t cap = text.len + 4;
    g->prediction_ids = kvr_malloc(cap * sizeof *g->prediction_ids);
    if (text.failed || !g->prediction_ids ||
        kvr_tok_scratch_create(&scratch, g->env->svc->tok, text.len ? text.len : 1) != 0) {
        kvr_sbuf_fini(&text);
        return out_of_memory(e);
    }
    int n = kvr_tok_encode(g->env->svc->tok, scratch, text.data ? text.data : "", text.len, false,
                           false, g->prediction_ids, cap);
    kvr_tok_scratch_destroy(scratch);
    kvr_sbuf_fini(&text);
    if (n < 0)
        return kvr_openai_error_set(e, 400, "invalid_request_error", "prediction", "invalid_value",
                                    "the prediction cannot be tokenized: %s", kvr_strerror(n));
    g->greq.prediction = g->prediction_ids;
    g->greq.n_prediction = (uint32_t)n < g->max_tokens + 1 ? (uint32_t)n : g->max_tokens + 1;
    return KVR_OK;
}

/* The service's request. The sampling parameters come from the parser as they are; only a
 * seed the client did not give is drawn here, so two such requests differ. */
static int build_request(struct kvr_generation *g, struct kvr_openai_error *e)
{
    g->greq = (struct kvr_gen_request){
        .prompt = g->prompt_ids,
        .n_prompt = g->n_prompt,
        .max_tokens = g->max_tokens,
        .sampling = g->req.sampling,
        .logprobs = g->req.logprobs,
        .top_logprobs = g->req.top_logprobs,
        .ignore_eos = g->req.ignore_eos,
        .grammar = g->req.grammar,
        .grammar_bytes = (uint32_t)g->req.grammar_len,
        .first_token_ms = g->req.first_token_ms,
        .total_ms = g->req.total_ms,
    };
    if (g->first) /* choice i of n: the seed after the first's i times (choices.h) */
        g->greq.sampling.seed = g->first->greq.sampling.seed + g->meta.choice;
    else if (!g->req.has_seed)
        g->greq.sampling.seed = random_u64();
    int rc = tokenize_prediction(g, e);
    if (rc)
        return rc;
    struct kvr_err serr = {0};
    if (kvr_sample_params_check(&g->greq.sampling, &serr))
        return kvr_openai_error_set(e, 400, "invalid_request_error", NULL, "invalid_value", "%s",
                                    serr.msg);
    return KVR_OK;
}

/* The text pipeline, before submit so that nothing can fail once the stream exists. A chat
 * also stops at the template's end-of-turn text. */
static int start_text(struct kvr_generation *g, struct kvr_openai_error *e)
{
    const struct kvr_generation_env *env = g->env;
    g->piece_cap = kvr_detok_max_bytes(env->svc->tok);
    g->piece = kvr_malloc(g->piece_cap);
    if (g->req.logprobs)
        g->lp = kvr_openai_logprobs_new(g->api);
    if (!g->piece || (g->req.logprobs && !g->lp))
        return out_of_memory(e);
    bool chat = g->api == KVR_OPENAI_CHAT;
    kvr_openai_text_fini(&g->cut);
    kvr_openai_text_init(&g->cut, g->req.stop, g->req.stop_len, g->req.n_stop,
                         chat ? kvr_chat_end_of_turn(env->chat) : NULL);
    kvr_detok_init(&g->detok, false, g->has_reply); /* parsers read control tokens' text */
    g->meta = (struct kvr_openai_meta){.api = g->api,
                                       .id = g->id,
                                       .created = (int64_t)(kvr_wall_ms() / 1000),
                                       .model = env->svc->model_name,
                                       .include_usage = g->req.include_usage,
                                       .choice = g->meta.choice};
    return KVR_OK;
}

int kvr_generation_prepare(struct kvr_generation *g, const char *body, size_t len,
                           const char *budget_header, struct kvr_openai_error *e)
{
    const struct kvr_generation_env *env = g->env;
    int rc;
    if ((rc = parse_request(g, body, len, budget_header, e)) || (rc = tokenize_prompt(g, e)) ||
        (rc = kvr_openai_check_length(&g->req, g->n_prompt, env->svc->n_ctx,
                                      env->default_max_tokens, &g->max_tokens, e)) ||
        (rc = build_request(g, e)) || (rc = start_text(g, e)) ||
        (g->req.n > 1 && (rc = kvr_choices_create(&g->choices, env, g->api, g->t_start_ns, g,
                                                  g->req.n, body, len, budget_header, e)))) {
        if (e->status == 0)
            kvr_openai_error_set(e, 500, "server_error", NULL, NULL, "internal error");
        g->early = *e;
        g->early_status = e->status;
        return rc;
    }
    return KVR_OK;
}

int kvr_generation_prepare_choice(struct kvr_generation *g, const struct kvr_generation *first,
                                  uint32_t index, const char *body, size_t len,
                                  const char *budget_header, struct kvr_openai_error *e)
{
    g->part = true;
    g->first = first;
    g->meta.choice = index;
    memcpy(g->id, first->id, sizeof g->id);
    int rc = parse_request(g, body, len, budget_header, e);
    if (rc)
        return rc;
    if (!(g->prompt_ids = kvr_malloc((size_t)first->n_prompt * sizeof *g->prompt_ids)))
        return out_of_memory(e);
    memcpy(g->prompt_ids, first->prompt_ids, (size_t)first->n_prompt * sizeof *g->prompt_ids);
    g->n_prompt = first->n_prompt;
    if ((rc = kvr_openai_check_length(&g->req, g->n_prompt, g->env->svc->n_ctx,
                                      g->env->default_max_tokens, &g->max_tokens, e)) ||
        (rc = build_request(g, e)) || (rc = start_text(g, e)))
        return rc;
    g->meta.created = first->meta.created;
    return KVR_OK;
}

void kvr_generation_follow(struct kvr_generation *g, const struct kvr_generation *lead)
{
    g->lead = lead;
}

/* ---- submit --------------------------------------------------------------------------- */

/* What the client is told of a refusal (request.h): the HTTP status and the error code,
 * which is also the metric's reason label. A KV-full refusal says when to try again (1 s
 * at least), because the blocks free up as other requests finish, unless no retry can
 * help (struct kvr_refusal never). */
static const struct {
    int status;
    enum kvr_http_refused code;
    uint32_t min_retry_s;
} refusal_answers[KVR_REFUSE_REASON_COUNT] = {
    [KVR_REFUSE_NONE] = {500, KVR_HTTP_REFUSED_INTERNAL, 0},
    [KVR_REFUSE_FIRST_TOKEN_BUDGET] = {429, KVR_HTTP_REFUSED_OVER_BUDGET, 0},
    [KVR_REFUSE_TOTAL_BUDGET] = {429, KVR_HTTP_REFUSED_OVER_BUDGET, 0},
    [KVR_REFUSE_KV_FULL] = {429, KVR_HTTP_REFUSED_KV_FULL, 1},
    [KVR_REFUSE_QUEUE_FULL] = {503, KVR_HTTP_REFUSED_QUEUE_FULL, 0},
    [KVR_REFUSE_RING_DOWN] = {503, KVR_HTTP_REFUSED_RING_DOWN, 0},
    [KVR_REFUSE_TOO_LONG] = {400, KVR_HTTP_REFUSED_INVALID, 0},
    [KVR_REFUSE_INTERNAL] = {500, KVR_HTTP_REFUSED_INTERNAL, 0},
};

static void refused(struct kvr_generation *g, struct kvr_refusal *refusal,
                    struct kvr_openai_error *e, uint32_t *retry_after_s)
{
    refusal->message[sizeof refusal->message - 1] = 0;
    unsigned why =
        (unsigned)refusal->reason < KVR_REFUSE_REASON_COUNT ? refusal->reason : KVR_REFUSE_INTERNAL;
    int status = refusal_answers[why].status;
    kvr_http_metrics_refused(g->env->metrics, refusal_answers[why].code);
    const char *type = status == 429   ? "rate_limit_error"
                       : status == 400 ? "invalid_request_error"
                                       : "server_error";
    kvr_openai_error_set(e, status, type, NULL, kvr_http_refused_name(refusal_answers[why].code),
                         "%s", refusal->message[0] ? refusal->message : "the request was refused");
    uint32_t retry_s = (uint32_t)(((uint64_t)refusal->retry_after_ms + 999) / 1000);
    if (retry_s < refusal_answers[why].min_retry_s)
        retry_s = refusal_answers[why].min_retry_s;
    /* A refusal no retry can help says so by sending no Retry-After. */
    *retry_after_s = refusal->never ? 0 : retry_s;
}

int kvr_generation_submit(struct kvr_generation *g, struct kvr_openai_error *e,
                          uint32_t *retry_after_s)
{
    const struct kvr_service *svc = g->env->svc;
    struct kvr_refusal refusal;
    memset(&refusal, 0, sizeof refusal);
    *retry_after_s = 0;
    g->greq.same_prompt_as = g->lead ? g->lead->stream : NULL;
    int rc = g->choices ? kvr_choices_submit(g->choices, e, retry_after_s)
                        : svc->ops->submit(svc->ctx, &g->greq, &g->stream, &refusal);
    /* The service copied what it keeps of the prompt (and of the prediction). */
    kvr_free(g->prompt_ids);
    g->prompt_ids = NULL;
    g->greq.prompt = NULL;
    kvr_free(g->prediction_ids);
    g->prediction_ids = NULL;
    g->greq.prediction = NULL;
    g->est_first_ms = refusal.est_first_ms;
    g->est_period_ms = refusal.est_period_ms;
    if (rc != 0) {
        g->stream = NULL;
        if (!g->choices) /* else the refused choice told e, and counted it */
            refused(g, &refusal, e, retry_after_s);
        g->early = *e;
        g->early_status = e->status;
        g->early_refused = true;
        return rc;
    }
    g->t_event_ns = kvr_now_ns();
    g->choices_admitted = g->choices != NULL;
    if (!g->part)
        kvr_http_metrics_admitted(g->env->metrics, g->n_prompt);
    if (g->req.stream && !g->choices && g->has_reply) {
        struct kvr_reply_info in = {.meta = &g->meta};
        kvr_reply_sse_start(&g->reply, &g->sse, &in);
        g->sse_first = false;
    } else if (g->req.stream && !g->choices) {
        g->sse_first = true;
        if (g->api == KVR_OPENAI_CHAT) {
            /* The role chunk goes out at once, as OpenAI's does. */
            kvr_openai_sse_chunk(&g->sse, &g->meta, true, "", 0, KVR_OPENAI_FINISH_NONE, NULL);
            g->sse_first = false;
        }
    }
    return KVR_OK;
}

bool kvr_generation_streams(const struct kvr_generation *g)
{
    return g->req.stream;
}

bool kvr_generation_done(const struct kvr_generation *g)
{
    return g->done || (g->choices && kvr_choices_done(g->choices));
}

/* ---- events --------------------------------------------------------------------------- */

/* Tell the service we want no more tokens (stop string, client gone, failure). */
static void cancel(struct kvr_generation *g)
{
    if (g->stream && !g->released && !g->svc_finished) {
        g->env->svc->ops->cancel(g->stream);
        g->svc_finished = true;
    }
}

static void fail(struct kvr_generation *g, int status, const char *code, const char *msg)
{
    g->done = true;
    g->outcome = KVR_HTTP_OUTCOME_ERROR;
    kvr_openai_error_set(&g->fail, status ? status : 500,
                         status == 504 ? "timeout_error" : "server_error", NULL, code, "%s", msg);
    cancel(g);
}

static void finish(struct kvr_generation *g, enum kvr_openai_finish f)
{
    g->done = true;
    g->finish = f;
    g->outcome = f == KVR_OPENAI_FINISH_LENGTH ? KVR_HTTP_OUTCOME_LENGTH : KVR_HTTP_OUTCOME_STOP;
}

/* Text of one token into the cutter; logprobs recorded. Returns false on a bad token. */
static bool take_token(struct kvr_generation *g, const struct kvr_gen_event *ev)
{
    const struct kvr_tok *tok = g->env->svc->tok;
    int n = kvr_detok_push(tok, &g->detok, ev->token, g->piece, g->piece_cap);
    if (n < 0)
        return false;
    if (g->lp) {
        const char *p = NULL;
        size_t len = 0;
        struct kvr_openai_alt top[KVR_LOGPROBS_MAX_TOP];
        uint32_t n_top = 0;
        for (uint32_t k = 0; k < ev->n_top && k < KVR_LOGPROBS_MAX_TOP; k++)
            if (kvr_tok_decode_piece(tok, ev->top[k].id, false, &top[n_top].piece,
                                     &top[n_top].len) == 0)
                top[n_top++].logprob = ev->top[k].logprob;
        if (kvr_tok_decode_piece(tok, ev->token, false, &p, &len) == 0)
            kvr_openai_logprobs_add(g->lp, g->api, p, len, ev->logprob, g->text_bytes, top, n_top);
    }
    g->text_bytes += (size_t)n;
    if (kvr_openai_text_push(&g->cut, g->piece, (size_t)n, &g->text)) {
        finish(g, KVR_OPENAI_FINISH_STOP);
        cancel(g); /* a stop string: the rest of the ring's work is wasted */
    }
    return true;
}

/* The last token came: release the text the detokenizer and the cutter still hold, unless
 * it completes a stop string. */
static void finish_text(struct kvr_generation *g, enum kvr_gen_finish why)
{
    int n = kvr_detok_flush(&g->detok, g->piece, g->piece_cap);
    if (n > 0 && kvr_openai_text_push(&g->cut, g->piece, (size_t)n, &g->text)) {
        finish(g, KVR_OPENAI_FINISH_STOP);
    } else {
        kvr_openai_text_flush(&g->cut, &g->text);
        finish(g, why == KVR_GEN_FINISH_EOS ? KVR_OPENAI_FINISH_STOP : KVR_OPENAI_FINISH_LENGTH);
    }
    cancel(g); /* only does something if the service would send more */
}

/* Nothing came in time: fail once no event has come for stall_timeout_ms. */
static bool check_stall(struct kvr_generation *g, uint64_t now)
{
    uint32_t stall_ms = g->env->stall_timeout_ms;
    if (!stall_ms || now - g->t_event_ns <= (uint64_t)stall_ms * 1000000)
        return false;
    char msg[128];
    snprintf(msg, sizeof msg, "no token for %u ms; the generation was cancelled", stall_ms);
    fail(g, 504, "stalled", msg);
    return true;
}

/* Wait up to timeout_ms for one event and run it through the pipeline. Returns true when
 * something happened (an event, or the generation ended), false on a quiet timeout. */
static bool pump_event(struct kvr_generation *g, uint32_t timeout_ms)
{
    const struct kvr_generation_env *env = g->env;
    struct kvr_gen_event ev;
    memset(&ev, 0, sizeof ev);
    int rc = env->svc->ops->next(g->stream, &ev, timeout_ms);
    uint64_t now = kvr_now_ns();
    if (rc == KVR_ETIMEDOUT)
        return check_stall(g, now);
    if (rc != 0) {
        g->svc_finished = true;
        fail(g, 500, "stream_closed", "the generation ended without a finish reason");
        return true;
    }
    g->t_event_ns = now;
    if (ev.finish != KVR_GEN_FINISH_NONE)
        g->svc_finished = true;
    if (ev.finish == KVR_GEN_FINISH_ERROR) {
        ev.error[sizeof ev.error - 1] = 0;
        fail(g, ev.error_status, "generation_failed",
             ev.error[0] ? ev.error : "the generation failed");
        return true;
    }
    if (ev.token < 0 || ev.token >= env->n_vocab || ev.finish >= KVR_GEN_FINISH_COUNT) {
        fail(g, 500, "bad_token", "the service returned an invalid token");
        return true;
    }

    g->n_gen++;
    bool first = g->n_gen == 1;
    if (first)
        g->t_first_ns = now;
    kvr_http_metrics_token(env->metrics, first,
                           (double)(now - (first ? g->t_start_ns : g->t_prev_ns)) * 1e-9);
    g->t_prev_ns = now;

    /* The end-of-generation token is counted but has no text. */
    if (ev.finish != KVR_GEN_FINISH_EOS && !take_token(g, &ev)) {
        fail(g, 500, "bad_token", "the service returned an invalid token");
        return true;
    }
    if (g->done)
        return true; /* a stop string */
    if (ev.finish == KVR_GEN_FINISH_LENGTH || ev.finish == KVR_GEN_FINISH_EOS ||
        g->n_gen >= g->max_tokens)
        finish_text(g, ev.finish);
    return true;
}

/* ---- answers -------------------------------------------------------------------------- */

/* Turn whatever the last pump produced into SSE bytes: a chunk of text (with its logprobs),
 * the finish, the usage and [DONE]; or an error event and [DONE]. */
static void sse_emit(struct kvr_generation *g)
{
    if (g->done && g->outcome == KVR_HTTP_OUTCOME_ERROR) {
        struct kvr_reply_info in = {&g->meta, g->finish, g->n_prompt, g->n_gen, NULL};
        if (g->has_reply && g->format == KVR_REPLY_RESPONSES) {
            kvr_responses_sse_error(&g->reply, &g->sse, &in, &g->fail);
        } else {
            kvr_openai_sse_error(&g->sse, &g->fail);
            if (!g->part)
                kvr_openai_sse_done(&g->sse);
        }
        g->sse_ended = true;
        return;
    }
    if (g->has_reply) {
        struct kvr_reply_info in = {&g->meta, g->finish, g->n_prompt, g->n_gen, g->lp};
        kvr_reply_sse(&g->reply, &g->sse, &in, g->text.data ? g->text.data : "", g->text.len,
                      g->done);
        kvr_sbuf_clear(&g->text);
        if (g->lp) {
            json_decref(g->lp);
            g->lp = kvr_openai_logprobs_new(g->api);
        }
        g->sse_ended = g->done;
        return;
    }
    if (g->text.len > 0 || g->done) {
        enum kvr_openai_finish f = g->done ? g->finish : KVR_OPENAI_FINISH_NONE;
        kvr_openai_sse_chunk(&g->sse, &g->meta, g->sse_first, g->text.data ? g->text.data : "",
                             g->text.len, f, g->lp);
        g->sse_first = false;
        kvr_sbuf_clear(&g->text);
        if (g->lp) {
            json_decref(g->lp);
            g->lp = kvr_openai_logprobs_new(g->api);
        }
    }
    if (g->done) {
        if (g->meta.include_usage && !g->part)
            kvr_openai_sse_usage(&g->sse, &g->meta, g->n_prompt, g->n_gen);
        if (!g->part)
            kvr_openai_sse_done(&g->sse);
        g->sse_ended = true;
    }
}

bool kvr_generation_pump(struct kvr_generation *g, uint32_t timeout_ms)
{
    if (g->choices)
        return kvr_choices_pump(g->choices, timeout_ms);
    bool any = pump_event(g, timeout_ms);
    if (any && g->req.stream)
        sse_emit(g);
    return any;
}

void kvr_generation_shut_down(struct kvr_generation *g)
{
    if (g->choices) {
        kvr_choices_shut_down(g->choices);
        return;
    }
    fail(g, 503, "shutting_down", "the server is shutting down");
    if (g->req.stream)
        sse_emit(g); /* end the stream properly: an error event and [DONE] */
}

void kvr_generation_abandon(struct kvr_generation *g)
{
    if (g->choices)
        kvr_choices_abandon(g->choices);
    g->done = true;
    g->outcome = KVR_HTTP_OUTCOME_CLIENT_GONE;
    cancel(g);
}

const struct kvr_openai_error *kvr_generation_error(const struct kvr_generation *g)
{
    if (g->choices)
        return kvr_choices_error(g->choices);
    return g->outcome == KVR_HTTP_OUTCOME_ERROR ? &g->fail : NULL;
}

uint32_t kvr_generation_completion_tokens(const struct kvr_generation *g)
{
    return g->n_gen;
}

char *kvr_generation_json(struct kvr_generation *g, size_t *out_len)
{
    if (g->choices)
        return kvr_choices_json(g->choices, g->n_prompt, out_len);
    if (g->has_reply) {
        struct kvr_reply_info in = {&g->meta, g->finish, g->n_prompt, g->n_gen, g->lp};
        return kvr_reply_json(&g->reply, &in, g->text.data ? g->text.data : "", g->text.len,
                              out_len);
    }
    return kvr_openai_response_json(&g->meta, g->text.data ? g->text.data : "", g->text.len,
                                    g->finish, g->n_prompt, g->n_gen, g->lp, out_len);
}

enum kvr_generation_sse kvr_generation_sse_read(struct kvr_generation *g, char *buf, size_t max,
                                                size_t *out_n)
{
    *out_n = 0;
    if (g->choices)
        return kvr_choices_sse_read(g->choices, &g->meta, g->n_prompt, buf, max, out_n);
    if (g->sse.failed)
        return KVR_GENERATION_SSE_BROKEN;
    if (g->sse_pos < g->sse.len) {
        size_t n = g->sse.len - g->sse_pos;
        if (n > max)
            n = max;
        memcpy(buf, g->sse.data + g->sse_pos, n);
        g->sse_pos += n;
        if (g->sse_pos == g->sse.len) {
            kvr_sbuf_clear(&g->sse);
            g->sse_pos = 0;
        }
        *out_n = n;
        return KVR_GENERATION_SSE_BYTES;
    }
    return g->sse_ended ? KVR_GENERATION_SSE_END : KVR_GENERATION_SSE_EMPTY;
}

/* ---- the end -------------------------------------------------------------------------- */

/* `s` for a log line: quotes become apostrophes and control bytes '?', so that a client's
 * text in an error message cannot end the field or the line. */
static void log_text(char *out, size_t cap, const char *s)
{
    size_t i = 0;
    for (; s && *s && i + 1 < cap; s++)
        out[i++] = *s == '"' ? '\'' : (unsigned char)*s < 0x20 || *s == 0x7f ? '?' : *s;
    out[i] = 0;
}

static const char *const outcome_names[KVR_HTTP_OUTCOME_COUNT] = {
    [KVR_HTTP_OUTCOME_STOP] = "stop",
    [KVR_HTTP_OUTCOME_LENGTH] = "length",
    [KVR_HTTP_OUTCOME_ERROR] = "error",
    [KVR_HTTP_OUTCOME_CLIENT_GONE] = "client_gone",
};

/* One line per request at info level (docs/API.md, "Access log"): what it asked, how it
 * ended, when its tokens came, and admission's estimate beside it. Times are from the
 * request's arrival; the estimates from submit, a tokenization later. A whole answer
 * whose client left before it is logged with nginx's 499. */
static void log_access(const struct kvr_generation *g)
{
    if (!kvr_log_enabled(KVR_LOG_INFO))
        return;
    const struct kvr_openai_error *err = g->early_status ? &g->early : NULL;
    const char *outcome = g->early_refused         ? "refused"
                          : g->early_status >= 500 ? "error"
                          : g->early_status        ? "invalid"
                                                   : NULL;
    int status = g->early_status;
    if (!err) {
        outcome = outcome_names[g->outcome];
        err = g->outcome == KVR_HTTP_OUTCOME_ERROR ? &g->fail : NULL;
        status = g->req.stream                                ? 200
                 : err                                        ? err->status
                 : g->outcome == KVR_HTTP_OUTCOME_CLIENT_GONE ? 499
                                                              : 200;
    }
    uint64_t now = kvr_now_ns();
    char first[24] = "-", est_first[24] = "-", est_total[24] = "-", why[KVR_GEN_MSG_BYTES + 96];
    if (g->t_first_ns)
        snprintf(first, sizeof first, "%.0f", (double)(g->t_first_ns - g->t_start_ns) / 1e6);
    if (g->est_first_ms > 0) {
        uint32_t n = g->n_gen ? g->n_gen : g->max_tokens;
        snprintf(est_first, sizeof est_first, "%.0f", g->est_first_ms);
        snprintf(est_total, sizeof est_total, "%.0f",
                 g->est_first_ms + (n > 1 ? n - 1 : 0) * g->est_period_ms);
    }
    why[0] = 0;
    if (err) {
        char msg[KVR_GEN_MSG_BYTES];
        log_text(msg, sizeof msg, err->message);
        snprintf(why, sizeof why, " code=%s%s%.64s reason=\"%s\"", err->code ? err->code : "-",
                 err->param ? " param=" : "", err->param ? err->param : "", msg);
    }
    /* Speculation: drafted and kept tokens, and the mean k of the rows that had drafts. */
    char spec[80] = "";
    if (g->spec_steps)
        snprintf(spec, sizeof spec, " spec_draft_tokens=%u spec_accepted_tokens=%u spec_k=%.1f",
                 g->spec_drafted, g->spec_accepted, (double)g->spec_drafted / g->spec_steps);
    KVR_INFO("access: id=%s endpoint=%s status=%d outcome=%s prompt_tokens=%u "
             "completion_tokens=%u max_tokens=%u first_token_ms=%s total_ms=%.0f "
             "est_first_token_ms=%s est_total_ms=%s%s%s",
             g->id,
             g->format == KVR_REPLY_RESPONSES ? "/v1/responses"
             : g->api == KVR_OPENAI_CHAT      ? "/v1/chat/completions"
                                              : "/v1/completions",
             status, outcome, g->n_prompt, g->n_gen, g->max_tokens, first,
             (double)(now - g->t_start_ns) / 1e6, est_first, est_total, spec, why);
}

void kvr_generation_destroy(struct kvr_generation *g)
{
    if (!g)
        return;
    if (g->choices) { /* the request ends with its choices, as the worst of them did */
        kvr_choices_destroy(g->choices, g);
        g->done = true;
    }
    if (g->stream || g->choices_admitted) {
        if (!g->done) {
            g->done = true;
            g->outcome = KVR_HTTP_OUTCOME_CLIENT_GONE;
        }
        if (!g->released && g->stream) {
            cancel(g);
            if (g->env->svc->ops->spec)
                g->env->svc->ops->spec(g->stream, &g->spec_drafted, &g->spec_accepted,
                                       &g->spec_steps);
            g->env->svc->ops->release(g->stream);
            g->released = true;
        }
        if (!g->part)
            kvr_http_metrics_ended(g->env->metrics, g->outcome,
                                   (double)(kvr_now_ns() - g->t_start_ns) * 1e-9);
    }
    if ((g->stream || g->choices_admitted || g->early_status) && !g->part)
        log_access(g);
    kvr_openai_text_fini(&g->cut);
    if (g->has_reply)
        kvr_reply_fini(&g->reply);
    kvr_sbuf_fini(&g->text);
    kvr_sbuf_fini(&g->sse);
    json_decref(g->lp);
    kvr_free(g->piece);
    kvr_free(g->prompt_ids);
    kvr_free(g->prediction_ids);
    kvr_openai_req_fini(&g->req);
    kvr_free(g);
}

void kvr_generation_use_responses(struct kvr_generation *g, struct kvr_responses_store *store)
{
    g->format = KVR_REPLY_RESPONSES;
    g->store = store;
}

void kvr_generation_absorb(struct kvr_generation *g, const struct kvr_generation *choice)
{
    static const int rank[KVR_HTTP_OUTCOME_COUNT] = {
        [KVR_HTTP_OUTCOME_STOP] = 0,
        [KVR_HTTP_OUTCOME_LENGTH] = 1,
        [KVR_HTTP_OUTCOME_CLIENT_GONE] = 2,
        [KVR_HTTP_OUTCOME_ERROR] = 3,
    };
    g->n_gen += choice->n_gen;
    if (choice->t_first_ns && (!g->t_first_ns || choice->t_first_ns < g->t_first_ns))
        g->t_first_ns = choice->t_first_ns;
    if (rank[choice->outcome] > rank[g->outcome]) {
        g->outcome = choice->outcome;
        g->fail = choice->fail;
    }
    if (!g->est_first_ms) {
        g->est_first_ms = choice->est_first_ms;
        g->est_period_ms = choice->est_period_ms;
    }
}

bool kvr_generation_estimate(const struct kvr_generation *g, double *first_ms, double *total_ms,
                             uint64_t *request_id)
{
    if (g->choices)
        return kvr_choices_estimate(g->choices, first_ms, total_ms, request_id);
    const struct kvr_service_ops *ops = g->env->svc->ops;
    return g->stream && ops->estimate && ops->estimate(g->stream, first_ms, total_ms, request_id);
}
