/* openai_stop.c - stop strings cut out of generated text (see openai.h, "stop strings"):
 * text is held back while it could still be the start of one. */
#include "bridge/openai.h"

#include <string.h>

void kvr_openai_text_init(struct kvr_openai_text *t, const char *const *stop,
                          const size_t *stop_len, uint32_t n_stop, const char *extra)
{
    memset(t, 0, sizeof *t);
    kvr_sbuf_init(&t->held);
    for (uint32_t i = 0; i < n_stop && i < KVR_OPENAI_MAX_STOP; i++) {
        if (stop_len[i] == 0)
            continue;
        t->stop[t->n_stop] = stop[i];
        t->stop_len[t->n_stop] = stop_len[i];
        t->n_stop++;
    }
    if (extra && *extra) {
        t->stop[t->n_stop] = extra;
        t->stop_len[t->n_stop] = strlen(extra);
        t->n_stop++;
    }
}

void kvr_openai_text_fini(struct kvr_openai_text *t)
{
    kvr_sbuf_fini(&t->held);
}

bool kvr_openai_text_push(struct kvr_openai_text *t, const char *p, size_t n, struct kvr_sbuf *out)
{
    if (t->stopped)
        return true;
    kvr_sbuf_append(&t->held, p, n);
    const char *h = t->held.data;
    size_t len = t->held.len;
    if (!h || t->held.failed) {
        /* Out of memory: release what we have rather than lose it. */
        kvr_sbuf_append(out, p, n);
        kvr_sbuf_clear(&t->held);
        return false;
    }

    /* Earliest complete stop string: everything before it is the answer. */
    for (size_t pos = 0; pos < len; pos++) {
        for (uint32_t s = 0; s < t->n_stop; s++) {
            if (t->stop_len[s] <= len - pos && !memcmp(h + pos, t->stop[s], t->stop_len[s])) {
                kvr_sbuf_append(out, h, pos);
                kvr_sbuf_clear(&t->held);
                t->stopped = true;
                return true;
            }
        }
    }

    /* Otherwise keep the longest tail that is the beginning of some stop string. It starts
     * where a stop string starts, so the released text ends on a character boundary. */
    size_t keep_from = len;
    for (size_t pos = 0; pos < len && keep_from == len; pos++) {
        for (uint32_t s = 0; s < t->n_stop; s++) {
            if (len - pos < t->stop_len[s] && !memcmp(h + pos, t->stop[s], len - pos)) {
                keep_from = pos;
                break;
            }
        }
    }
    kvr_sbuf_append(out, h, keep_from);
    memmove(t->held.data, h + keep_from, len - keep_from);
    t->held.len = len - keep_from;
    t->held.data[t->held.len] = 0;
    return false;
}

void kvr_openai_text_flush(struct kvr_openai_text *t, struct kvr_sbuf *out)
{
    if (!t->stopped && t->held.len)
        kvr_sbuf_append(out, t->held.data, t->held.len);
    kvr_sbuf_clear(&t->held);
}
