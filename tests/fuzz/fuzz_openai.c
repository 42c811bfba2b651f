/* fuzz_openai.c - libFuzzer target for the OpenAI request parser and what runs on a parsed
 * request's strings.
 *
 * Input: one mode byte, then a request body.
 *   bit 0: chat (/v1/chat/completions) instead of completions
 *   bits 1-3: chat template (mod KVR_CHAT_TMPL_COUNT) for rendering the messages
 *   bits 4-7: piece length (1..16) for cutting the text into "tokens"
 * A parsed request's prompt (or rendered chat) is fed through the stop-string cutter in
 * pieces of that length, then formatted as a response, a stream chunk and logprobs.
 * Invariants checked (a violation traps): a refusal has status 400 or 500 and renders as an
 * error body; released text never contains a stop string and is a prefix of the input;
 * every formatted body is valid JSON. */
#include "bridge/chat.h"
#include "bridge/openai.h"
#include "core/alloc.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "fuzz_openai: %s failed at line %d\n", #c, __LINE__);                  \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

static bool contains(const char *hay, size_t n, const char *needle, size_t m)
{
    for (size_t i = 0; m && i + m <= n; i++)
        if (!memcmp(hay + i, needle, m))
            return true;
    return false;
}

static void check_json(const char *s, size_t len)
{
    json_error_t je;
    json_t *j = json_loadb(s, len, 0, &je);
    CHECK(j != NULL);
    json_decref(j);
}

static void exercise(const struct kvr_openai_req *r, const char *text, size_t len, size_t piece)
{
    struct kvr_openai_text cut;
    kvr_openai_text_init(&cut, r->stop, r->stop_len, r->n_stop,
                         r->api == KVR_OPENAI_CHAT ? "<|im_end|>" : NULL);
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    json_t *lp = kvr_openai_logprobs_new(r->api);
    CHECK(lp != NULL);
    bool stopped = false;
    for (size_t i = 0; i < len && !stopped; i += piece) {
        size_t n = len - i < piece ? len - i : piece;
        struct kvr_openai_alt alt[2] = {{text + i, n, -1.0f}, {text, i < n ? i : n, -2.0f}};
        CHECK(kvr_openai_logprobs_add(lp, r->api, text + i, n, -1.0f, i, alt, 2) == 0);
        stopped = kvr_openai_text_push(&cut, text + i, n, &out);
    }
    if (!stopped)
        kvr_openai_text_flush(&cut, &out);
    CHECK(!out.failed);
    const char *o = out.data ? out.data : "";
    /* What was released is the input up to (not including) the earliest stop string. */
    CHECK(out.len <= len && memcmp(o, text, out.len) == 0);
    for (uint32_t s = 0; s < cut.n_stop; s++)
        CHECK(!contains(o, out.len, cut.stop[s], cut.stop_len[s]));

    struct kvr_openai_meta m = {r->api, "id-1", 1, "model", r->include_usage, 0};
    size_t blen = 0;
    char *body = kvr_openai_response_json(&m, o, out.len, KVR_OPENAI_FINISH_STOP, 1, 2, lp, &blen);
    CHECK(body != NULL);
    check_json(body, blen);
    kvr_free(body);
    struct kvr_sbuf sse;
    kvr_sbuf_init(&sse);
    CHECK(kvr_openai_sse_chunk(&sse, &m, true, o, out.len, KVR_OPENAI_FINISH_NONE, lp) == 0);
    CHECK(sse.len > 8 && !memcmp(sse.data, "data: ", 6));
    check_json(sse.data + 6, sse.len - 8);
    kvr_sbuf_fini(&sse);
    json_decref(lp);
    kvr_sbuf_fini(&out);
    kvr_openai_text_fini(&cut);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    unsigned mode = data[0];
    enum kvr_openai_api api = (mode & 1) ? KVR_OPENAI_CHAT : KVR_OPENAI_COMPLETIONS;
    enum kvr_chat_tmpl tmpl = (enum kvr_chat_tmpl)(((mode >> 1) & 7) % KVR_CHAT_TMPL_COUNT);
    size_t piece = 1 + (mode >> 4);
    const char *body = (const char *)data + 1;
    size_t len = size - 1;

    static const struct kvr_openai_limits lim = {.n_ctx = 4096, .n_vocab = 32000};
    struct kvr_openai_req r;
    struct kvr_openai_error e;
    memset(&e, 0, sizeof e);
    int rc = kvr_openai_parse(&r, api, body, len, &lim, &e);
    if (rc) {
        CHECK(e.status == 400 || e.status == 500);
        CHECK(r.root == NULL);
        size_t elen = 0;
        char *ej = kvr_openai_error_json(&e, &elen);
        CHECK(ej != NULL);
        check_json(ej, elen);
        kvr_free(ej);
        kvr_openai_req_fini(&r);
        return 0;
    }
    CHECK(r.n_stop <= KVR_OPENAI_MAX_STOP);
    CHECK(!r.has_max_tokens || (r.max_tokens >= 1 && r.max_tokens <= lim.n_ctx));
    uint32_t mt = 0;
    if (kvr_openai_check_length(&r, 10, lim.n_ctx, 0, &mt, &e) == 0)
        CHECK(mt >= 1 && mt + 10 <= lim.n_ctx);

    if (api == KVR_OPENAI_CHAT) {
        char *text = NULL;
        size_t tlen = 0;
        CHECK(kvr_chat_render(tmpl, r.msgs, r.n_msgs, &text, &tlen, NULL) == 0);
        CHECK(strlen(text) == tlen); /* JSON strings hold no NUL */
        exercise(&r, text, tlen, piece);
        kvr_free(text);
    } else if (r.prompt) {
        exercise(&r, r.prompt, r.prompt_len, piece);
    } else {
        CHECK(r.n_prompt_ids >= 1);
        for (uint32_t i = 0; i < r.n_prompt_ids; i++)
            CHECK(r.prompt_ids[i] >= 0 && (uint32_t)r.prompt_ids[i] < lim.n_vocab);
    }
    kvr_openai_req_fini(&r);
    return 0;
}
