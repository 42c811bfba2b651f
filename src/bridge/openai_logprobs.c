/* openai_logprobs.c - the logprobs object of a choice, in the shape of each API (see
 * openai.h). Pure formatting: the values come from the tail (model/logprobs.h). */
#include "bridge/openai.h"

#include "core/err.h"
#include "core/utf8.h"

/* A JSON string of any bytes: invalid UTF-8 becomes U+FFFD (jansson wants UTF-8). */
static json_t *text_of(const char *s, size_t len)
{
    if (kvr_utf8_valid_len(s, len) == len)
        return json_stringn(s, len);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    kvr_utf8_sanitize_to(&b, s, len);
    json_t *j = b.failed ? NULL : json_stringn(b.data ? b.data : "", b.len);
    kvr_sbuf_fini(&b);
    return j;
}

json_t *kvr_openai_logprobs_new(enum kvr_openai_api api)
{
    if (api == KVR_OPENAI_CHAT)
        return json_pack("{s:[]}", "content");
    return json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs",
                     "text_offset");
}

/* Chat: {"token", "logprob", "bytes"} of one token (json_pack steals "o" arguments, even
 * when it fails). */
static json_t *chat_entry(const char *piece, size_t len, float logprob)
{
    json_t *bytes = json_array();
    for (size_t i = 0; bytes && i < len; i++)
        if (json_array_append_new(bytes, json_integer((unsigned char)piece[i]))) {
            json_decref(bytes);
            bytes = NULL;
        }
    json_t *tok = text_of(piece, len);
    if (!bytes || !tok) {
        json_decref(bytes);
        json_decref(tok);
        return NULL;
    }
    return json_pack("{s:o,s:f,s:o}", "token", tok, "logprob", (double)logprob, "bytes", bytes);
}

static int add_chat(json_t *lp, const char *piece, size_t len, float logprob,
                    const struct kvr_openai_alt *top, uint32_t n_top)
{
    json_t *entry = chat_entry(piece, len, logprob);
    json_t *alts = json_array();
    for (uint32_t k = 0; alts && k < n_top; k++)
        if (json_array_append_new(alts, chat_entry(top[k].piece, top[k].len, top[k].logprob))) {
            json_decref(alts);
            alts = NULL;
        }
    if (!entry || !alts || json_object_set_new(entry, "top_logprobs", alts)) {
        json_decref(entry);
        if (!entry)
            json_decref(alts);
        return KVR_ENOMEM;
    }
    return json_array_append_new(json_object_get(lp, "content"), entry) ? KVR_ENOMEM : KVR_OK;
}

/* Completions: {text: logprob} of the alternatives, the more likely of two same texts, then
 * the sampled token if it is not among them (OpenAI's "up to logprobs + 1" entries). */
static json_t *completion_dict(const struct kvr_openai_alt *top, uint32_t n_top,
                               const struct kvr_openai_alt *chosen)
{
    json_t *d = json_object();
    for (uint32_t k = 0; d && k <= n_top; k++) {
        const struct kvr_openai_alt *a = k < n_top ? &top[k] : chosen;
        json_t *key = text_of(a->piece, a->len);
        const char *kv = key ? json_string_value(key) : NULL;
        size_t kn = key ? json_string_length(key) : 0;
        int rc = !key || (!json_object_getn(d, kv, kn) &&
                          json_object_setn_new(d, kv, kn, json_real(a->logprob)));
        json_decref(key);
        if (rc) {
            json_decref(d);
            d = NULL;
        }
    }
    return d;
}

int kvr_openai_logprobs_add(json_t *lp, enum kvr_openai_api api, const char *piece,
                            size_t piece_len, float logprob, size_t text_offset,
                            const struct kvr_openai_alt *top, uint32_t n_top)
{
    if (api == KVR_OPENAI_CHAT)
        return add_chat(lp, piece, piece_len, logprob, top, n_top);
    json_t *tok = text_of(piece, piece_len);
    if (!tok)
        return KVR_ENOMEM;
    if (json_array_append_new(json_object_get(lp, "tokens"), tok) ||
        json_array_append_new(json_object_get(lp, "token_logprobs"), json_real(logprob)) ||
        json_array_append_new(
            json_object_get(lp, "top_logprobs"),
            completion_dict(top, n_top, &(struct kvr_openai_alt){piece, piece_len, logprob})) ||
        json_array_append_new(json_object_get(lp, "text_offset"),
                              json_integer((json_int_t)text_offset)))
        return KVR_ENOMEM;
    return KVR_OK;
}
