/* tokenizer_decode.c - token ids -> text: a token's decoded piece (kvr_tok_decode_piece) and
 * the streaming detokenizer (kvr_detok_*), which holds back incomplete UTF-8 across
 * tokens. */
#include "model/tokenizer.h"

#include "core/utf8.h"
#include "model/tokenizer_impl.h"

#include <string.h>

/* ---- decoding --------------------------------------------------------------------------- */

int kvr_tok_decode_piece(const struct kvr_tok *t, int32_t id, bool special, const char **ptr,
                         size_t *len)
{
    if (id < 0 || id >= t->n_vocab)
        return KVR_EINVAL;
    uint8_t ty = t->types[id];
    if (special && (ty == KVR_TOK_TYPE_CONTROL || ty == KVR_TOK_TYPE_UNKNOWN))
        return kvr_tok_piece(t, id, ptr, len);
    *ptr = t->dec + t->dec_off[id];
    *len = t->dec_off[id + 1] - t->dec_off[id];
    return 0;
}

void kvr_detok_init(struct kvr_detok *d, bool text_start, bool special)
{
    memset(d, 0, sizeof *d);
    d->strip_space = text_start;
    d->special = special;
}

size_t kvr_detok_max_bytes(const struct kvr_tok *t)
{
    /* Worst case: every byte (3 pending + the piece) becomes a 3-byte U+FFFD. */
    return 3 * (t->max_out_bytes + 4);
}

struct sink {
    char *out;
    size_t cap, n;
    bool full;
};

static void put(struct sink *k, const char *p, size_t n)
{
    if (k->n + n > k->cap) {
        k->full = true;
        return;
    }
    memcpy(k->out + k->n, p, n);
    k->n += n;
}

static void put_fffd(struct sink *k)
{
    put(k, KVR_UTF8_FFFD, KVR_UTF8_FFFD_BYTES);
}

/* One byte through the UTF-8 validator (the Unicode "maximal subpart" rule: a sequence cut
 * short becomes one U+FFFD and the byte that broke it is looked at afresh). */
static void feed(struct kvr_detok *d, uint8_t b, struct sink *k)
{
    if (d->n_pending > 0) {
        unsigned char lo = 0x80, hi = 0xBF;
        if (d->n_pending == 1)
            kvr_utf8_second_range(d->pending[0], &lo, &hi);
        if (b >= lo && b <= hi) {
            d->pending[d->n_pending++] = b;
            if (d->n_pending == d->need) {
                put(k, (const char *)d->pending, d->need);
                d->n_pending = 0;
            }
            return;
        }
        put_fffd(k);
        d->n_pending = 0;
    }
    size_t need = kvr_utf8_lead_len(b);
    if (need == 1) {
        char c = (char)b;
        put(k, &c, 1);
    } else if (need == 0) {
        put_fffd(k);
    } else {
        d->need = (uint8_t)need;
        d->pending[0] = b;
        d->n_pending = 1;
    }
}

int kvr_detok_push(const struct kvr_tok *t, struct kvr_detok *d, int32_t id, char *out, size_t cap)
{
    const char *p;
    size_t n;
    if (kvr_tok_decode_piece(t, id, d->special, &p, &n) != 0)
        return KVR_EINVAL;
    if (n == 0)
        return 0;
    struct kvr_detok saved = *d;
    if (d->strip_space) {
        d->strip_space = false;
        if (t->add_space_prefix && p[0] == ' ') {
            p++;
            n--;
        }
    }
    struct sink k = {out, cap, 0, false};
    for (size_t i = 0; i < n; i++)
        feed(d, (uint8_t)p[i], &k);
    if (k.full) {
        *d = saved;
        return KVR_EFULL;
    }
    return (int)k.n;
}

int kvr_detok_flush(struct kvr_detok *d, char *out, size_t cap)
{
    if (d->n_pending == 0)
        return 0;
    if (cap < 3)
        return KVR_EFULL;
    memcpy(out, "\xEF\xBF\xBD", 3);
    d->n_pending = 0;
    return 3;
}
