/* seal.c - sealed frames (see seal.h).
 *
 * Sealed frame on the wire (docs/PROTOCOL.md 3a):
 *   off        size        field
 *     0          40        header ciphertext   record n:   ChaCha20 of the 40-byte header
 *    40          16        header tag          Poly1305 tag of record n
 *    56           B        body ciphertext     record n+1: ChaCha20 of the B-byte body
 *    56+B        16        body tag            Poly1305 tag of record n+1 (absent if B = 0)
 * B is the decrypted header's body_bytes. Record r's nonce is u64le(r) | 00 00 00 00.
 *
 * The body is sealed straight from the frame's iovecs: it is RFC 8439's AEAD (the same bytes
 * as crypto_aead_chacha20poly1305_ietf_encrypt_detached over the concatenation, which
 * test_seal checks), computed piece by piece. ChaCha20 block 0 gives the Poly1305 key; the
 * body is XORed with the key stream from block 1 on; a piece that starts inside a 64-byte
 * block takes that block's key stream separately, and everything from the next block
 * boundary on is one crypto_stream_chacha20_ietf_xor_ic call. Receivers use libsodium's
 * one-shot decryption in place. */
#include "ring/seal.h"

#include <sodium.h>
#include <string.h>

#define BLOCK 64
#define MAX_IOV 16

void kvr_seal_init(struct kvr_seal *s, const uint8_t key[KVR_SEAL_KEY_BYTES])
{
    memset(s, 0, sizeof *s);
    memcpy(s->key, key, KVR_SEAL_KEY_BYTES);
}

void kvr_seal_wipe(struct kvr_seal *s)
{
    sodium_memzero(s, sizeof *s);
}

static void nonce_of(uint64_t record, uint8_t n[crypto_aead_chacha20poly1305_IETF_NPUBBYTES])
{
    memset(n, 0, crypto_aead_chacha20poly1305_IETF_NPUBBYTES);
    for (int i = 0; i < 8; i++)
        n[i] = (uint8_t)(record >> (8 * i));
}

/* Encrypt and tag the body pieces into dst (B bytes) and tag, as record `record`. The pieces
 * are iov[first..n_iov) with `skip` bytes of iov[first] already used by the header. */
static void seal_body(const struct kvr_seal *s, uint64_t record, const struct iovec *iov, int first,
                      size_t skip, int n_iov, uint8_t *dst, size_t body_bytes,
                      uint8_t tag[KVR_SEAL_TAG_BYTES])
{
    uint8_t nonce[crypto_aead_chacha20poly1305_IETF_NPUBBYTES];
    nonce_of(record, nonce);
    size_t off = 0;
    for (int i = first; i < n_iov; i++) {
        const uint8_t *src = (const uint8_t *)iov[i].iov_base + (i == first ? skip : 0);
        size_t len = iov[i].iov_len - (i == first ? skip : 0);
        size_t r = off % BLOCK;
        if (r && len) { /* the rest of a block another piece began */
            static const uint8_t zero[BLOCK];
            uint8_t ks[BLOCK];
            crypto_stream_chacha20_ietf_xor_ic(ks, zero, BLOCK, nonce, (uint32_t)(off / BLOCK + 1),
                                               s->key);
            size_t t = BLOCK - r < len ? BLOCK - r : len;
            for (size_t k = 0; k < t; k++)
                dst[off + k] = src[k] ^ ks[r + k];
            sodium_memzero(ks, sizeof ks);
            src += t, len -= t, off += t;
        }
        if (len) {
            crypto_stream_chacha20_ietf_xor_ic(dst + off, src, len, nonce,
                                               (uint32_t)(off / BLOCK + 1), s->key);
            off += len;
        }
    }
    uint8_t poly_key[crypto_onetimeauth_poly1305_KEYBYTES];
    crypto_stream_chacha20_ietf(poly_key, sizeof poly_key, nonce, s->key);
    crypto_onetimeauth_poly1305_state st;
    crypto_onetimeauth_poly1305_init(&st, poly_key);
    crypto_onetimeauth_poly1305_update(&st, dst, body_bytes);
    static const uint8_t pad[16];
    if (body_bytes % 16)
        crypto_onetimeauth_poly1305_update(&st, pad, 16 - body_bytes % 16);
    uint8_t lens[16] = {0}; /* u64le(associated data bytes = 0) | u64le(ciphertext bytes) */
    for (int k = 0; k < 8; k++)
        lens[8 + k] = (uint8_t)((uint64_t)body_bytes >> (8 * k));
    crypto_onetimeauth_poly1305_update(&st, lens, sizeof lens);
    crypto_onetimeauth_poly1305_final(&st, tag);
    sodium_memzero(&st, sizeof st);
    sodium_memzero(poly_key, sizeof poly_key);
}

int kvr_seal_frame(struct kvr_seal *s, const struct iovec *iov, int n_iov, size_t frame_bytes,
                   uint8_t *out, size_t cap, size_t *out_bytes, struct kvr_err *err)
{
    if (s->failed)
        return kvr_err_set(err, KVR_EINVAL, "seal: this direction has failed");
    if (n_iov < 1 || n_iov > MAX_IOV || frame_bytes < KVR_SEAL_HEADER_BYTES ||
        cap < kvr_seal_frame_bytes(frame_bytes))
        return kvr_err_set(err, KVR_EINVAL,
                           "seal: a %zu-byte frame in %d pieces does not fit %zu bytes",
                           frame_bytes, n_iov, cap);
    size_t sum = 0;
    for (int i = 0; i < n_iov; i++)
        sum += iov[i].iov_len;
    if (sum != frame_bytes)
        return kvr_err_set(err, KVR_EINVAL, "seal: the pieces hold %zu bytes, not %zu", sum,
                           frame_bytes);

    /* Header: gather its 40 bytes, then encrypt them in place. */
    int i = 0;
    size_t got = 0, skip = 0;
    while (got < KVR_SEAL_HEADER_BYTES) {
        size_t t = iov[i].iov_len - skip;
        if (t > KVR_SEAL_HEADER_BYTES - got)
            t = KVR_SEAL_HEADER_BYTES - got;
        memcpy(out + got, (const uint8_t *)iov[i].iov_base + skip, t);
        got += t, skip += t;
        if (skip == iov[i].iov_len)
            i++, skip = 0;
    }
    uint8_t nonce[crypto_aead_chacha20poly1305_IETF_NPUBBYTES];
    nonce_of(s->next, nonce);
    crypto_aead_chacha20poly1305_ietf_encrypt_detached(out, out + KVR_SEAL_HEADER_BYTES, NULL, out,
                                                       KVR_SEAL_HEADER_BYTES, NULL, 0, NULL, nonce,
                                                       s->key);
    s->next++;

    size_t body = frame_bytes - KVR_SEAL_HEADER_BYTES;
    if (body) {
        uint8_t *dst = out + KVR_SEAL_SEALED_HEADER_BYTES;
        seal_body(s, s->next, iov, i, skip, n_iov, dst, body, dst + body);
        s->next++;
    }
    *out_bytes = kvr_seal_frame_bytes(frame_bytes);
    return KVR_OK;
}

static int open_record(struct kvr_seal *s, uint8_t *in, size_t n, const char *what,
                       struct kvr_err *err)
{
    if (s->failed)
        return kvr_err_set(err, KVR_EAUTH, "seal: an earlier frame failed authentication");
    uint8_t nonce[crypto_aead_chacha20poly1305_IETF_NPUBBYTES];
    nonce_of(s->next, nonce);
    if (crypto_aead_chacha20poly1305_ietf_decrypt_detached(in, NULL, in, n, in + n, NULL, 0, nonce,
                                                           s->key) != 0) {
        s->failed = true;
        return kvr_err_set(err, KVR_EAUTH,
                           "sealed %s (record %llu, %zu bytes) failed authentication: the "
                           "bytes were altered, replayed, reordered or forged on the way",
                           what, (unsigned long long)s->next, n);
    }
    s->next++;
    return KVR_OK;
}

int kvr_seal_open_header(struct kvr_seal *s, uint8_t in[KVR_SEAL_SEALED_HEADER_BYTES],
                         struct kvr_err *err)
{
    return open_record(s, in, KVR_SEAL_HEADER_BYTES, "frame header", err);
}

int kvr_seal_open_body(struct kvr_seal *s, uint8_t *in, size_t body_bytes, struct kvr_err *err)
{
    if (body_bytes == 0)
        return kvr_err_set(err, KVR_EINVAL, "seal: an empty body has no record");
    return open_record(s, in, body_bytes, "frame body", err);
}
