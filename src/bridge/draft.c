/* draft.c - drafted tokens from lookups (see draft.h). Reading order: the text in two
 * parts, the n-gram matcher, the three sources. */
#include "bridge/draft.h"

#include "core/alloc.h"

#include <stdbool.h>
#include <string.h>

const char *kvr_draft_source_name(enum kvr_draft_source src)
{
    static const char *const names[KVR_DRAFT_SOURCE_COUNT] = {"prediction", "prompt_lookup",
                                                              "suffix"};
    return src < KVR_DRAFT_SOURCE_COUNT ? names[src] : "unknown";
}

static inline uint32_t text_len(const struct kvr_draft_text *t)
{
    return t->n_a + t->n_b;
}

static inline int32_t text_at(const struct kvr_draft_text *t, uint32_t i)
{
    return i < t->n_a ? t->a[i] : t->b[i - t->n_a];
}

/* ---- the matcher ------------------------------------------------------------------------ */

/* Whether hay[e - m .. e) equals the key's last m tokens. */
static bool match_at(const struct kvr_draft_text *hay, uint32_t e, const struct kvr_draft_text *key,
                     uint32_t m)
{
    uint32_t nk = text_len(key);
    for (uint32_t i = 1; i <= m; i++)
        if (text_at(hay, e - i) != text_at(key, nk - i))
            return false;
    return true;
}

/* The end e (m <= e < limit) of an occurrence in hay of the key's last m tokens, for the
 * longest m in [KVR_DRAFT_MIN_N, KVR_DRAFT_MAX_N] that has one (shorter keys only when the
 * key itself is shorter), the one nearest `near`. Returns false when none occurs. */
static bool find_ngram(const struct kvr_draft_text *hay, uint32_t limit,
                       const struct kvr_draft_text *key, uint32_t near, uint32_t *end)
{
    uint32_t nk = text_len(key);
    uint32_t hi = nk < KVR_DRAFT_MAX_N ? nk : KVR_DRAFT_MAX_N;
    uint32_t lo = nk < KVR_DRAFT_MIN_N ? nk : KVR_DRAFT_MIN_N;
    for (uint32_t m = hi; m >= lo && m > 0; m--) {
        bool found = false;
        uint32_t best = 0, best_d = UINT32_MAX;
        for (uint32_t e = m; e < limit; e++) {
            if (!match_at(hay, e, key, m))
                continue;
            uint32_t d = e > near ? e - near : near - e;
            if (d <= best_d) { /* ties: the later one */
                best = e;
                best_d = d;
                found = true;
            }
        }
        if (found) {
            *end = best;
            return true;
        }
    }
    return false;
}

static uint32_t copy_from(const struct kvr_draft_text *hay, uint32_t e, uint32_t max_k,
                          int32_t *out)
{
    uint32_t n = 0;
    for (; n < max_k && e + n < text_len(hay); n++)
        out[n] = text_at(hay, e + n);
    return n;
}

/* ---- the sources ------------------------------------------------------------------------ */

uint32_t kvr_draft_prediction(const int32_t *pred, uint32_t n_pred, const int32_t *answer,
                              uint32_t n_answer, uint32_t max_k, int32_t *out)
{
    const struct kvr_draft_text hay = {pred, n_pred, NULL, 0};
    if (n_answer == 0)
        return copy_from(&hay, 0, max_k, out);
    const struct kvr_draft_text key = {answer, n_answer, NULL, 0};
    uint32_t e;
    if (!find_ngram(&hay, n_pred, &key, n_answer, &e))
        return 0;
    return copy_from(&hay, e, max_k, out);
}

uint32_t kvr_draft_prompt(const struct kvr_draft_text *t, uint32_t max_k, int32_t *out)
{
    uint32_t n = text_len(t), e;
    /* An occurrence must end before the text does: the key itself is not one. */
    if (n < 2 || !find_ngram(t, n, t, n, &e))
        return 0;
    return copy_from(t, e, max_k, out);
}

int kvr_draft_suffix_init(struct kvr_draft_suffix *sx, uint32_t cap_tokens, uint32_t index_slots,
                          struct kvr_err *err)
{
    memset(sx, 0, sizeof *sx);
    if (cap_tokens < 16 || (cap_tokens & (cap_tokens - 1)) || index_slots == 0)
        return kvr_err_set(err, KVR_EINVAL, "suffix drafts: %u tokens (a power of two >= 16)",
                           cap_tokens);
    sx->toks = kvr_malloc((size_t)cap_tokens * sizeof *sx->toks);
    sx->index = kvr_calloc(index_slots, sizeof *sx->index);
    if (!sx->toks || !sx->index) {
        kvr_draft_suffix_fini(sx);
        return kvr_err_set(err, KVR_ENOMEM, "suffix drafts: out of memory");
    }
    sx->cap = cap_tokens;
    sx->index_slots = index_slots;
    return KVR_OK;
}

void kvr_draft_suffix_fini(struct kvr_draft_suffix *sx)
{
    kvr_free(sx->toks);
    kvr_free(sx->index);
    memset(sx, 0, sizeof *sx);
}

static uint32_t ngram_hash(const int32_t *g, uint32_t slots)
{
    uint64_t h = 1469598103934665603ull;
    for (uint32_t i = 0; i < KVR_DRAFT_MIN_N; i++)
        h = (h ^ (uint32_t)g[i]) * 1099511628211ull;
    return (uint32_t)((h ^ (h >> 29)) % slots);
}

static int32_t ring_at(const struct kvr_draft_suffix *sx, uint64_t i)
{
    return sx->toks[i & (sx->cap - 1)];
}

void kvr_draft_suffix_add(struct kvr_draft_suffix *sx, const int32_t *answer, uint32_t n)
{
    if (!sx->toks || n == 0)
        return;
    uint32_t most = sx->cap / 4;
    if (n > most) {
        answer += n - most;
        n = most;
    }
    int32_t g[KVR_DRAFT_MIN_N];
    for (uint32_t i = 0; i < n; i++) {
        sx->toks[sx->n++ & (sx->cap - 1)] = answer[i];
        if (i + 1 < KVR_DRAFT_MIN_N)
            continue;
        memcpy(g, answer + i + 1 - KVR_DRAFT_MIN_N, sizeof g);
        sx->index[ngram_hash(g, sx->index_slots)] = sx->n + 1; /* 1 + the position after */
    }
    sx->toks[sx->n++ & (sx->cap - 1)] = -1;
}

uint32_t kvr_draft_suffix_propose(const struct kvr_draft_suffix *sx, const struct kvr_draft_text *t,
                                  uint32_t max_k, int32_t *out)
{
    uint32_t nt = text_len(t);
    if (!sx->toks || nt < KVR_DRAFT_MIN_N)
        return 0;
    int32_t g[KVR_DRAFT_MIN_N];
    for (uint32_t i = 0; i < KVR_DRAFT_MIN_N; i++)
        g[i] = text_at(t, nt - KVR_DRAFT_MIN_N + i);
    uint64_t at = sx->index[ngram_hash(g, sx->index_slots)];
    if (at == 0)
        return 0;
    uint64_t e = at - 1, oldest = sx->n > sx->cap ? sx->n - sx->cap : 0;
    if (e < oldest + KVR_DRAFT_MIN_N || e > sx->n)
        return 0; /* overwritten since */
    for (uint32_t i = 0; i < KVR_DRAFT_MIN_N; i++)
        if (ring_at(sx, e - KVR_DRAFT_MIN_N + i) != g[i])
            return 0; /* another n-gram with the same hash */
    uint32_t n = 0;
    for (; n < max_k && e + n < sx->n && ring_at(sx, e + n) >= 0; n++)
        out[n] = ring_at(sx, e + n);
    return n;
}
