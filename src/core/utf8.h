/* utf8.h - the one UTF-8 codec: decode one code point, encode one, validate a span,
 * sanitize a span. Pure (no I/O, no globals); any thread.
 *
 * Well-formed UTF-8 is Unicode's table 3-7: shortest form, no surrogates, at most U+10FFFF.
 *
 *   lead      2nd byte    3rd/4th   code points
 *   00..7F    -           -         U+0000..U+007F
 *   C2..DF    80..BF      -         U+0080..U+07FF
 *   E0        A0..BF      80..BF    U+0800..U+0FFF  (80..9F would be overlong)
 *   E1..EC    80..BF      80..BF
 *   ED        80..9F      80..BF    (A0..BF would be surrogates)
 *   EE..EF    80..BF      80..BF
 *   F0        90..BF      80..BF    (80..8F would be overlong)
 *   F1..F3    80..BF      80..BF
 *   F4        80..8F      80..BF    (90..BF would exceed U+10FFFF)
 *
 * Callers differ in what bad bytes become, and each must keep its own rule (a template
 * renders, a prompt tokenizes, a reply streams exactly as before), so the decoder takes
 * the rule by name (enum kvr_utf8_mode). */
#ifndef KVR_CORE_UTF8_H
#define KVR_CORE_UTF8_H

#include "core/sbuf.h"

#include <stddef.h>
#include <stdint.h>

/* U+FFFD REPLACEMENT CHARACTER, encoded. */
#define KVR_UTF8_FFFD "\xEF\xBF\xBD"
#define KVR_UTF8_FFFD_BYTES 3

enum kvr_utf8_mode {
    /* Well-formed only: a bad sequence returns 0 and leaves *cp alone. */
    KVR_UTF8_STRICT,
    /* A bad sequence reads as U+FFFD and consumes one byte (the Jinja interpreter). */
    KVR_UTF8_REPLACE_BYTE,
    /* A bad sequence reads as U+FFFD and consumes its maximal invalid subpart, Unicode's
     * recommended practice: the lead and the continuation bytes that could still have
     * made a character (at least one byte). */
    KVR_UTF8_REPLACE_SUBPART,
    /* llama.cpp's unicode_cpt_from_utf8, so byte-level BPE splits text as llama.cpp does:
     * the lead's high bits give the length (C0..DF two, E0..EF three, F0..F7 four), the
     * continuation bytes must be 10xxxxxx, overlong forms and surrogates are accepted;
     * a stray continuation byte, a lead F8..FF, a sequence cut short or a value above
     * U+10FFFF reads as U+FFFD and consumes one byte. */
    KVR_UTF8_LLAMA,
    KVR_UTF8_MODE_COUNT
};

/* Decode the code point at s[0..n) (n >= 1) into *cp by `mode`. Returns the bytes it
 * consumed: 1..4, or 0 (STRICT only) when s does not start with a well-formed character. */
size_t kvr_utf8_decode(const char *s, size_t n, uint32_t *cp, enum kvr_utf8_mode mode);

/* Encode cp (<= U+10FFFF; surrogates are encoded as they are) into out[0..4). Returns the
 * bytes written, 1..4. */
size_t kvr_utf8_encode(uint32_t cp, char *out);

/* The length a lead byte announces in well-formed UTF-8: 1 (00..7F), 2 (C2..DF), 3 (E0..EF),
 * 4 (F0..F4), or 0 for a byte no character starts with. */
size_t kvr_utf8_lead_len(unsigned char lead);
/* The range [*lo, *hi] the byte after a lead of length >= 2 must lie in (table above). */
void kvr_utf8_second_range(unsigned char lead, unsigned char *lo, unsigned char *hi);
/* llama.cpp's unicode_len_utf8: the length judged by the lead's high nibble only (00..BF
 * one, C0..DF two, E0..EF three, F0..FF four), whatever follows. */
size_t kvr_utf8_llama_len(unsigned char lead);

/* The length of the longest well-formed prefix of s[0..len): len when all of it is. */
size_t kvr_utf8_valid_len(const char *s, size_t len);

/* Append s[0..len) to out with each maximal invalid subpart replaced by one U+FFFD (the
 * REPLACE_SUBPART rule). A failed append shows in out->failed (core/sbuf.h). */
void kvr_utf8_sanitize_to(struct kvr_sbuf *out, const char *s, size_t len);

#endif
