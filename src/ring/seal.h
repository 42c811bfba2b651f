/* seal.h - sealed frames: every frame of a link encrypted and authenticated with the
 * session key of its direction (docs/PROTOCOL.md section 3a; keys from auth.h).
 *
 * A sealed frame is two AEAD records, each with its own nonce:
 *
 *   header ciphertext (40) | header tag (16) | body ciphertext (body_bytes) | body tag (16)
 *
 * The body record is absent when the header says body_bytes = 0. The receiver opens the
 * header record first (56 bytes, a fixed size), so no length in it is trusted before it is
 * authenticated; then it reads and opens exactly body_bytes + 16 bytes.
 *
 * Cipher: ChaCha20-Poly1305 (RFC 8439, libsodium's crypto_aead_chacha20poly1305_ietf),
 * no associated data, nonce = the record's number as u64 little-endian followed by four
 * zero bytes. Each direction of each link has its own key (a fresh one per handshake) and
 * numbers its records 0, 1, 2, ... in the order sent; the number is never sent. So a
 * frame that is altered, replayed, reordered, dropped or injected fails its tag on the
 * receiver, which then closes the link (net.c logs the reason).
 *
 * kvr_seal_frame seals a frame given as iovecs (as kvr_wire_encode lays it out: the
 * header, then the records in scratch, the payload straight from the caller's buffer, the
 * timing records) into one contiguous output buffer in a single pass: the cipher reads each
 * piece where it is and writes the ciphertext to its place in the output, so sealing costs
 * no copy beyond the encryption itself. kvr_seal_open_* decrypt in place.
 *
 * Pure: keys in, bytes in and out; no I/O, no allocation, no globals. One struct kvr_seal
 * per direction of a link, used by that direction's thread only. kvr_seal_wipe erases it.
 * libsodium must have been initialised (sodium_init; kvr_auth_init does it), which also
 * picks its fastest ChaCha20 and Poly1305 for the CPU: bench/bench_seal measures them. */
#ifndef KVR_RING_SEAL_H
#define KVR_RING_SEAL_H

#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define KVR_SEAL_KEY_BYTES 32
#define KVR_SEAL_TAG_BYTES 16
#define KVR_SEAL_HEADER_BYTES 40 /* = KVR_WIRE_HEADER_BYTES: the first record's plaintext */
#define KVR_SEAL_SEALED_HEADER_BYTES (KVR_SEAL_HEADER_BYTES + KVR_SEAL_TAG_BYTES)
/* Bytes a sealed frame adds to its plain form: two tags (one when the body is empty). */
#define KVR_SEAL_OVERHEAD_BYTES (2 * KVR_SEAL_TAG_BYTES)

struct kvr_seal {
    uint8_t key[KVR_SEAL_KEY_BYTES];
    uint64_t next; /* number of the next record to seal or open */
    bool failed;   /* a record failed to open: every later call fails too */
};

/* Start one direction with its session key (auth.h, kvr_auth_session_keys). */
void kvr_seal_init(struct kvr_seal *s, const uint8_t key[KVR_SEAL_KEY_BYTES]);
void kvr_seal_wipe(struct kvr_seal *s);

/* Bytes kvr_seal_frame writes for a frame of `frame_bytes` plain bytes (header + body). */
static inline size_t kvr_seal_frame_bytes(size_t frame_bytes)
{
    return frame_bytes + (frame_bytes > KVR_SEAL_HEADER_BYTES ? 2 : 1) * KVR_SEAL_TAG_BYTES;
}

/* Seal one frame: the concatenation of iov[0..n_iov) (frame_bytes in all, at least the
 * 40-byte header; n_iov <= 16; the pieces may have any lengths) is written, encrypted and
 * tagged, to out (cap >= kvr_seal_frame_bytes(frame_bytes); out must not overlap the
 * input). *out_bytes gets the sealed size. Uses two record numbers (one if the body is
 * empty). KVR_EINVAL if the sizes are inconsistent (nothing is sealed then). */
int kvr_seal_frame(struct kvr_seal *s, const struct iovec *iov, int n_iov, size_t frame_bytes,
                   uint8_t *out, size_t cap, size_t *out_bytes, struct kvr_err *err);

/* Open a sealed header in place: `in` holds KVR_SEAL_SEALED_HEADER_BYTES bytes as received;
 * on success its first 40 bytes are the plain header. KVR_EAUTH ("frame header N failed
 * authentication ...") if the tag does not verify; the seal is then dead. */
int kvr_seal_open_header(struct kvr_seal *s, uint8_t in[KVR_SEAL_SEALED_HEADER_BYTES],
                         struct kvr_err *err);

/* Open a sealed body in place: `in` holds body_bytes of ciphertext followed by the 16-byte
 * tag; on success in[0..body_bytes) is the plain body. body_bytes > 0. KVR_EAUTH as above. */
int kvr_seal_open_body(struct kvr_seal *s, uint8_t *in, size_t body_bytes, struct kvr_err *err);

#endif
