/* fuzz_gguf.c - libFuzzer target for the GGUF reader: open any bytes, and if they open, walk
 * every accessor and touch every byte the reader hands out (ASan catches a pointer that
 * escapes the image). */
#include "model/gguf.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint8_t sink;

static void touch(const void *p, uint64_t n)
{
    const uint8_t *b = p;
    uint8_t acc = 0;
    for (uint64_t i = 0; i < n; i++)
        acc ^= b[i];
    sink = acc;
}

static void walk_kv(struct kvr_gguf *g, int64_t i)
{
    static const uint8_t type_bytes[KVR_GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    const char *key = kvr_gguf_kv_key(g, i);
    enum kvr_gguf_type type = kvr_gguf_kv_type(g, i);
    if (!key || kvr_gguf_find_kv(g, key) != i || (unsigned)type >= KVR_GGUF_TYPE_COUNT)
        __builtin_trap();
    touch(key, strlen(key));
    struct kvr_err err;
    uint32_t u;
    float f;
    bool b;
    double d;
    const void *raw;
    struct kvr_gguf_str s;
    struct kvr_gguf_arr a;
    (void)kvr_gguf_get_u32(g, key, &u, &err);
    (void)kvr_gguf_get_f32(g, key, &f, &err);
    (void)kvr_gguf_get_bool(g, key, &b, &err);
    (void)kvr_gguf_kv_num(g, i, &d);
    if (kvr_gguf_kv_scalar(g, i, &raw) == 0)
        touch(raw, type_bytes[type]);
    if (kvr_gguf_get_str(g, key, &s, &err) == 0)
        touch(s.ptr, s.len);
    if (kvr_gguf_kv_str(g, i, &s) == 0)
        touch(s.ptr, s.len);
    if (kvr_gguf_get_arr(g, key, &a, &err) == 0) {
        if (a.type == KVR_GGUF_TYPE_ARRAY || (unsigned)a.type >= KVR_GGUF_TYPE_COUNT)
            __builtin_trap();
        if (a.type == KVR_GGUF_TYPE_STRING)
            for (uint64_t j = 0; j < a.n; j++)
                touch(a.strs[j].ptr, a.strs[j].len);
        else
            touch(a.data, a.n * type_bytes[a.type]);
    }
    (void)kvr_gguf_kv_arr(g, i, &a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvr_gguf *g = NULL;
    struct kvr_err err;
    if (kvr_gguf_open_mem(&g, data, size, &err) != 0) {
        if (g || !err.msg[0])
            __builtin_trap();
        return 0;
    }
    (void)kvr_gguf_version(g);
    if (kvr_gguf_alignment(g) == 0 || kvr_gguf_file_bytes(g) != size)
        __builtin_trap();
    (void)kvr_gguf_data_offset(g);
    for (int64_t i = 0; i < kvr_gguf_n_kv(g); i++)
        walk_kv(g, i);
    (void)kvr_gguf_find_kv(g, "general.architecture");
    for (int64_t i = 0; i < kvr_gguf_n_tensors(g); i++) {
        const struct kvr_gguf_tensor *t = kvr_gguf_tensor(g, i);
        if (kvr_gguf_find_tensor(g, t->name) != t || t->n_dims < 1 ||
            t->n_dims > KVR_GGUF_MAX_DIMS || t->n_bytes == 0)
            __builtin_trap();
        touch(t->name, strlen(t->name));
        touch(t->data, t->n_bytes);
    }
    (void)kvr_gguf_tensor(g, -1);
    (void)kvr_gguf_find_tensor(g, "token_embd.weight");
    (void)kvr_gguf_fingerprint(g);
    kvr_gguf_close(g);
    return 0;
}
