/* tokenizer_unicode.h - the Unicode character classes the BPE pre-tokenizer needs.
 *
 * The GPT-2 pre-tokenizer pattern only asks three questions of a code point: is it a letter
 * (\p{L}), a number (\p{N}), or white space (\s). Internal to the tokenizer; pure tables,
 * no state, thread-safe. */
#ifndef KVR_MODEL_TOKENIZER_UNICODE_H
#define KVR_MODEL_TOKENIZER_UNICODE_H

#include <stdint.h>

enum kvr_cp_class {
    KVR_CP_OTHER = 0,  /* anything else, including unassigned code points */
    KVR_CP_LETTER = 1, /* general category L* */
    KVR_CP_NUMBER = 2, /* general category N* */
    KVR_CP_SPACE = 3,  /* the White_Space property */
    KVR_CP_CLASS_COUNT = 4
};

enum kvr_cp_class kvr_cp_class(uint32_t cp);

#endif
