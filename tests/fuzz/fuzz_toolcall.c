/* fuzz_toolcall.c - libFuzzer target for the tool-call parsers (bridge/toolcall.h).
 *
 * Input: one mode byte, then an answer.
 *   bits 0-2: family (mod KVR_TOOLCALL_FAMILY_COUNT)
 *   bit 3: think; bit 4: in_think; bit 5: look for calls
 * The answer is parsed whole (final) and as prefixes (not final). Invariants checked (a
 * violation traps): every call has a name and arguments that are a JSON object; what a
 * prefix shows (text, reasoning, calls) is a prefix of what the whole answer shows, so a
 * stream never sends what it must take back; bytes kvr_toolcall_plain calls plain extend
 * the text or reasoning by exactly themselves, as the next parse finds. */
#include "bridge/toolcall.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "fuzz_toolcall: %s failed at line %d\n", #c, __LINE__);                \
            __builtin_trap();                                                                      \
        }                                                                                          \
    } while (0)

static bool is_prefix(const struct kvr_sbuf *a, const struct kvr_sbuf *b)
{
    return a->len <= b->len && (a->len == 0 || !memcmp(a->data, b->data, a->len));
}

static void check_calls(const struct kvr_toolcall_result *r)
{
    for (uint32_t i = 0; i < r->n_calls; i++) {
        CHECK(r->calls[i].name[0] != 0);
        json_t *a = json_loads(r->calls[i].arguments, JSON_ALLOW_NUL, NULL);
        CHECK(json_is_object(a));
        json_decref(a);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 4096)
        return 0;
    uint8_t mode = data[0];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    struct kvr_toolcall_opts o = {
        .family = (enum kvr_toolcall_family)((mode & 7) % KVR_TOOLCALL_FAMILY_COUNT),
        .think = (mode >> 3) & 1,
        .in_think = (mode >> 4) & 1,
        .calls = (mode >> 5) & 1};
    struct kvr_toolcall_result whole, part, prev;
    kvr_toolcall_result_init(&whole);
    kvr_toolcall_result_init(&part);
    kvr_toolcall_result_init(&prev);
    size_t prev_k = 0;
    bool have_prev = false;
    if (kvr_toolcall_parse(&o, text, len, true, &whole) == 0) {
        check_calls(&whole);
        /* Every prefix when short, else a spread of them. */
        size_t step = len < 64 ? 1 : len / 61;
        for (size_t k = 0; k <= len; k += step) {
            if (kvr_toolcall_parse(&o, text, k, false, &part) != 0)
                break;
            check_calls(&part);
            CHECK(is_prefix(&part.content, &whole.content));
            CHECK(is_prefix(&part.reasoning, &whole.reasoning));
            CHECK(part.n_calls <= whole.n_calls);
            for (uint32_t i = 0; i < part.n_calls; i++) {
                CHECK(!strcmp(part.calls[i].name, whole.calls[i].name));
                CHECK(!strcmp(part.calls[i].arguments, whole.calls[i].arguments));
            }
            if (have_prev && kvr_toolcall_plain(&o, prev.tail, text + prev_k, k - prev_k)) {
                bool in_text = prev.tail == KVR_TOOLCALL_TAIL_CONTENT;
                const struct kvr_sbuf *grew = in_text ? &part.content : &part.reasoning;
                const struct kvr_sbuf *was = in_text ? &prev.content : &prev.reasoning;
                const struct kvr_sbuf *same = in_text ? &part.reasoning : &part.content;
                const struct kvr_sbuf *same_was = in_text ? &prev.reasoning : &prev.content;
                CHECK(grew->len == was->len + (k - prev_k) && is_prefix(was, grew));
                CHECK(k == prev_k || !memcmp(grew->data + was->len, text + prev_k, k - prev_k));
                CHECK(same->len == same_was->len && part.n_calls == prev.n_calls);
            }
            struct kvr_toolcall_result t = prev;
            prev = part;
            part = t;
            prev_k = k;
            have_prev = true;
        }
    }
    kvr_toolcall_result_fini(&prev);
    kvr_toolcall_result_fini(&part);
    kvr_toolcall_result_fini(&whole);
    return 0;
}
