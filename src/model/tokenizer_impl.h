/* tokenizer_impl.h - internal to the tokenizer (tokenizer.c builds it, tokenizer_encode.c
 * encodes, tokenizer_decode.c decodes): the layout of struct kvr_tok and the small helpers
 * all three use (the piece -> id map, the merge table, the GPT-2 byte alphabet).
 * Not part of the API (tokenizer.h is). A built struct kvr_tok is immutable. */
#ifndef KVR_MODEL_TOKENIZER_IMPL_H
#define KVR_MODEL_TOKENIZER_IMPL_H

#include "model/tokenizer.h"
#include "model/tokenizer_pre.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ---- piece -> id map ------------------------------------------------------------------
 * Open addressing with linear probing over a power-of-two table at most half full. Each
 * slot keeps the piece's 32-bit hash so most probes never touch the piece bytes. */

struct kvr_tok_slot {
    uint32_t hash;
    int32_t id; /* -1: empty */
};

/* A merge rule of the BPE model: the pair (left, right) of token ids merges into `result`
 * with priority `rank` (lower first). */
struct kvr_tok_merge_slot {
    int32_t left, right; /* -1: empty */
    int32_t rank;
    int32_t result;
};

struct kvr_tok {
    enum kvr_tok_kind kind;
    int32_t n_vocab;

    /* Pieces as stored in the file, back to back: piece i is text[off[i] .. off[i+1]). */
    char *text;
    uint32_t *off; /* [n_vocab + 1] */
    /* Decoded pieces (what a token prints as; see kvr_tok_decode_piece). */
    char *dec;
    uint32_t *dec_off;    /* [n_vocab + 1] */
    float *scores;        /* [n_vocab] SPM merge priority (higher merges first) */
    uint8_t *types;       /* [n_vocab] enum kvr_tok_type */
    size_t max_out_bytes; /* longest decoded or raw piece */

    struct kvr_tok_slot *map;
    uint32_t map_mask;

    /* Token for each raw byte when no piece covers it: SPM "<0xXX>" byte tokens (or the
     * single-byte piece, or <unk>), BPE the piece of the byte's code point. -1: none. */
    int32_t byte_id[256];

    /* Tokens split out of the text before the model runs (control, unknown, user-defined),
     * longest piece first, then lowest id. */
    int32_t *specials;
    int32_t n_specials;

    int32_t bos, eos, unk, pad, eot, eom;
    int32_t eog[KVR_TOK_MAX_EOG];
    int n_eog;
    bool add_bos, add_eos, add_space_prefix;

    /* BPE only. */
    struct kvr_tok_merge_slot *merges;
    uint32_t merge_mask;
    const struct kvr_pre *pre; /* how text is split into words before merging */
};

static inline uint32_t kvr_tok_hash_bytes(const char *p, size_t n)
{
    /* FNV-1a, folded to 32 bits. */
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)p[i];
        h *= 0x100000001b3ull;
    }
    return (uint32_t)(h ^ (h >> 32));
}

static inline int32_t kvr_tok_map_find(const struct kvr_tok *t, const char *p, size_t n)
{
    uint32_t h = kvr_tok_hash_bytes(p, n);
    for (uint32_t i = h & t->map_mask;; i = (i + 1) & t->map_mask) {
        const struct kvr_tok_slot *s = &t->map[i];
        if (s->id < 0)
            return -1;
        if (s->hash == h) {
            uint32_t a = t->off[s->id], b = t->off[s->id + 1];
            if (b - a == n && memcmp(t->text + a, p, n) == 0)
                return s->id;
        }
    }
}

static inline uint32_t kvr_tok_pair_hash(int32_t a, int32_t b)
{
    uint64_t h = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) * 0x9e3779b97f4a7c15ull;
    return (uint32_t)(h >> 32);
}

static inline const struct kvr_tok_merge_slot *kvr_tok_merge_find(const struct kvr_tok *t,
                                                                  int32_t a, int32_t b)
{
    for (uint32_t i = kvr_tok_pair_hash(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const struct kvr_tok_merge_slot *s = &t->merges[i];
        if (s->left < 0)
            return NULL;
        if (s->left == a && s->right == b)
            return s;
    }
}

/* ---- GPT-2 byte <-> code point map ----------------------------------------------------
 * Byte-level BPE works on text where every byte is replaced by one printable code point:
 * the printable Latin-1 bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for themselves and
 * the other 68 bytes take U+0100, U+0101, ... in byte order (so ' ' is U+0120 "Ġ"). */

static inline bool kvr_tok_byte_is_printable(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

static inline uint32_t kvr_tok_byte_to_cp(unsigned b)
{
    if (kvr_tok_byte_is_printable(b))
        return b;
    uint32_t n = 0;
    for (unsigned i = 0; i < b; i++)
        n += !kvr_tok_byte_is_printable(i);
    return 0x100 + n;
}

#endif
