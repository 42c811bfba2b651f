/* gguf.c - a bounded reader for GGUF v2 and v3 files.
 *
 * File layout (every integer little-endian; this reader runs on little-endian hosts only):
 *
 *   offset   bytes  field
 *   0        4      magic "GGUF" = 47 47 55 46
 *   4        4      version, uint32: 2 or 3 (v1 used 32-bit counts and is rejected)
 *   8        8      n_tensors, uint64
 *   16       8      n_kv, uint64
 *   24       ...    n_kv key/value pairs, each:
 *                     key     string
 *                     type    uint32 (enum kvr_gguf_type)
 *                     value   a scalar of that type, a string, or an array
 *   ...      ...    n_tensors tensor infos, each:
 *                     name    string
 *                     n_dims  uint32, 1..4
 *                     ne      n_dims x uint64, elements per dim, ne[0] fastest
 *                     type    uint32, ggml type id (= enum kvr_dtype)
 *                     offset  uint64, from the data section start, a multiple of alignment
 *   ...      ...    padding up to the next multiple of the alignment
 *   data     ...    tensor data (the data section)
 *
 *   string = uint64 length, then that many bytes (UTF-8, no NUL terminator)
 *   array  = uint32 element type, uint64 count, then count elements (strings or scalars;
 *            arrays of arrays are rejected)
 *   scalar sizes: (u)int8 and bool 1, (u)int16 2, (u)int32 and float32 4,
 *            (u)int64 and float64 8 bytes; a bool byte is 0 or 1
 *
 * The alignment is the uint32 metadata value `general.alignment` (a power of two), 32 if
 * absent.
 *
 * Every read goes through a cursor that checks the bytes exist before touching them, and
 * every count is checked against the bytes left before anything is allocated for it, so a
 * hostile file costs at most a few times its own size in memory and never crashes. */
#include "model/gguf.h"

#include "core/alloc.h"
#include "model/dtype.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_HEADER_BYTES 24
#define GGUF_DEFAULT_ALIGNMENT 32
/* The smallest a key/value pair can be: key length (8) + a 1-byte key (empty keys are
 * rejected) + type (4) + a 1-byte scalar. Used to reject absurd counts before allocating. */
#define GGUF_MIN_KV_BYTES 14
/* The smallest a tensor info can be: name length (8) + a 1-byte name + n_dims (4) + one
 * dimension (8) + type (4) + offset (8). */
#define GGUF_MIN_TENSOR_BYTES 33
/* Counts are stored as int64_t in the API and as uint32_t in the hash tables. */
#define GGUF_MAX_COUNT ((uint64_t)INT32_MAX)

static const char *const type_names[KVR_GGUF_TYPE_COUNT] = {
    "uint8", "int8",   "uint16", "int16",  "uint32", "int32",   "float32",
    "bool",  "string", "array",  "uint64", "int64",  "float64",
};

/* Bytes of one scalar of each type; 0 for string and array (variable size). */
static const uint8_t type_bytes[KVR_GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

const char *kvr_gguf_type_name(enum kvr_gguf_type type)
{
    return (unsigned)type < KVR_GGUF_TYPE_COUNT ? type_names[type] : "unknown";
}

struct kv {
    char *key; /* NUL-terminated copy, owned */
    enum kvr_gguf_type type;
    const uint8_t *val;      /* scalars: the value's bytes inside the image */
    struct kvr_gguf_str str; /* strings */
    struct kvr_gguf_arr arr; /* arrays; arr.strs is owned for string arrays */
};

/* Open-addressing hash table from a name to an index. Slots hold index + 1 (0 = empty);
 * capacity is a power of two at least twice the count, so probes stay short. */
struct name_table {
    uint32_t *slots;
    size_t mask;
};

struct kvr_gguf {
    const uint8_t *data; /* the whole file */
    size_t size;
    void *map; /* our mapping (kvr_gguf_open), NULL when the image is borrowed */

    uint32_t version;
    size_t alignment;
    size_t data_start; /* offset of the data section in the file */

    int64_t n_kv;
    struct kv *kvs; /* n_kv, in file order */
    struct name_table kv_index;

    int64_t n_tensors;
    struct kvr_gguf_tensor *tensors; /* n_tensors, in file order; names owned */
    struct name_table tensor_index;

    uint64_t fingerprint; /* valid once fingerprint_done is set (atomically) */
    int fingerprint_done;
};

/* ---- bounded cursor ---------------------------------------------------------------- */

struct cursor {
    const uint8_t *base;
    size_t size;
    size_t off;
    struct kvr_err *err;
};

static size_t left(const struct cursor *c)
{
    return c->size - c->off;
}

static int need(struct cursor *c, uint64_t n, const char *what)
{
    if (n > left(c))
        return kvr_err_set(c->err, KVR_EFORMAT,
                           "truncated: %s needs %llu bytes at offset %zu, file is %zu bytes", what,
                           (unsigned long long)n, c->off, c->size);
    return 0;
}

static int read_u32(struct cursor *c, uint32_t *out, const char *what)
{
    int rc = need(c, 4, what);
    if (rc)
        return rc;
    memcpy(out, c->base + c->off, 4);
    c->off += 4;
    return 0;
}

static int read_u64(struct cursor *c, uint64_t *out, const char *what)
{
    int rc = need(c, 8, what);
    if (rc)
        return rc;
    memcpy(out, c->base + c->off, 8);
    c->off += 8;
    return 0;
}

static int read_str(struct cursor *c, struct kvr_gguf_str *out, const char *what)
{
    uint64_t len;
    int rc = read_u64(c, &len, what);
    if (rc)
        return rc;
    if (len > left(c))
        return kvr_err_set(c->err, KVR_EFORMAT,
                           "%s: string length %llu at offset %zu runs past the end of the "
                           "file (%zu bytes)",
                           what, (unsigned long long)len, c->off - 8, c->size);
    out->len = len;
    out->ptr = (const char *)c->base + c->off;
    c->off += (size_t)len;
    return 0;
}

/* A NUL-terminated copy of a key or tensor name, which must be non-empty and NUL-free so
 * that lookups by C string find exactly it. */
static int copy_name(struct cursor *c, const struct kvr_gguf_str *s, char **out, const char *what,
                     int64_t i)
{
    if (s->len == 0)
        return kvr_err_set(c->err, KVR_EFORMAT, "%s %lld: empty name", what, (long long)i);
    if (memchr(s->ptr, 0, (size_t)s->len))
        return kvr_err_set(c->err, KVR_EFORMAT, "%s %lld: name contains a NUL byte", what,
                           (long long)i);
    char *p = kvr_malloc((size_t)s->len + 1);
    if (!p)
        return kvr_err_set(c->err, KVR_ENOMEM, "out of memory copying %s name", what);
    memcpy(p, s->ptr, (size_t)s->len);
    p[s->len] = 0;
    *out = p;
    return 0;
}

/* ---- name tables ------------------------------------------------------------------- */

static uint64_t hash_name(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

static int table_init(struct name_table *t, int64_t n)
{
    size_t cap = 16;
    while (cap < (size_t)n * 2)
        cap *= 2;
    t->slots = kvr_calloc(cap, sizeof *t->slots);
    t->mask = cap - 1;
    return t->slots ? 0 : KVR_ENOMEM;
}

/* Index stored under `name`, or -1. name_of(ctx, i) is the name of entry i. */
static int64_t table_find(const struct name_table *t, const char *name,
                          const char *(*name_of)(const void *, uint32_t), const void *ctx)
{
    for (size_t slot = hash_name(name) & t->mask;; slot = (slot + 1) & t->mask) {
        uint32_t v = t->slots[slot];
        if (v == 0)
            return -1;
        if (!strcmp(name_of(ctx, v - 1), name))
            return (int64_t)(v - 1);
    }
}

/* Insert index i under `name`; returns the index already there for a duplicate, else -1. */
static int64_t table_insert(struct name_table *t, const char *name, uint32_t i,
                            const char *(*name_of)(const void *, uint32_t), const void *ctx)
{
    size_t slot = hash_name(name) & t->mask;
    for (;; slot = (slot + 1) & t->mask) {
        uint32_t v = t->slots[slot];
        if (v == 0) {
            t->slots[slot] = i + 1;
            return -1;
        }
        if (!strcmp(name_of(ctx, v - 1), name))
            return (int64_t)(v - 1);
    }
}

static const char *kv_name_of(const void *ctx, uint32_t i)
{
    return ((const struct kv *)ctx)[i].key;
}

static const char *tensor_name_of(const void *ctx, uint32_t i)
{
    return ((const struct kvr_gguf_tensor *)ctx)[i].name;
}

/* ---- metadata ---------------------------------------------------------------------- */

static int check_bools(struct cursor *c, const uint8_t *p, uint64_t n, const char *key)
{
    for (uint64_t j = 0; j < n; j++)
        if (p[j] > 1)
            return kvr_err_set(c->err, KVR_EFORMAT, "key %s: bool value %u is not 0 or 1", key,
                               p[j]);
    return 0;
}

static int parse_array(struct cursor *c, struct kv *kv)
{
    uint32_t et;
    uint64_t n;
    int rc = read_u32(c, &et, "array element type");
    if (rc)
        return rc;
    if (et == KVR_GGUF_TYPE_ARRAY)
        return kvr_err_set(c->err, KVR_EFORMAT, "key %s: nested arrays are not supported", kv->key);
    if (et >= KVR_GGUF_TYPE_COUNT)
        return kvr_err_set(c->err, KVR_EFORMAT, "key %s: unknown array element type %u", kv->key,
                           et);
    if ((rc = read_u64(c, &n, "array length")))
        return rc;
    kv->arr.type = (enum kvr_gguf_type)et;
    kv->arr.n = n;
    if (et == KVR_GGUF_TYPE_STRING) {
        /* Each string takes at least its 8-byte length: bound n before allocating. */
        if (n > left(c) / 8)
            return kvr_err_set(c->err, KVR_EFORMAT,
                               "key %s: array of %llu strings cannot fit in the %zu bytes left",
                               kv->key, (unsigned long long)n, left(c));
        struct kvr_gguf_str *strs = kvr_malloc(n ? (size_t)n * sizeof *strs : 1);
        if (!strs)
            return kvr_err_set(c->err, KVR_ENOMEM, "key %s: out of memory for %llu strings",
                               kv->key, (unsigned long long)n);
        kv->arr.strs = strs;
        for (uint64_t j = 0; j < n; j++)
            if ((rc = read_str(c, &strs[j], kv->key)))
                return rc;
        return 0;
    }
    uint64_t bytes;
    if (!kvr_mul_u64(n, type_bytes[et], &bytes) || bytes > left(c))
        return kvr_err_set(c->err, KVR_EFORMAT,
                           "key %s: array of %llu %s runs past the end of the file (%zu bytes "
                           "left)",
                           kv->key, (unsigned long long)n, type_names[et], left(c));
    kv->arr.data = c->base + c->off;
    if (et == KVR_GGUF_TYPE_BOOL && (rc = check_bools(c, c->base + c->off, n, kv->key)))
        return rc;
    c->off += (size_t)bytes;
    return 0;
}

static int parse_kv(struct cursor *c, struct kv *kv, int64_t i)
{
    struct kvr_gguf_str key = {0};
    uint32_t type;
    int rc = read_str(c, &key, "key");
    if (rc || (rc = copy_name(c, &key, &kv->key, "kv", i)))
        return rc;
    if ((rc = read_u32(c, &type, "value type")))
        return rc;
    if (type >= KVR_GGUF_TYPE_COUNT)
        return kvr_err_set(c->err, KVR_EFORMAT, "key %s: unknown value type %u", kv->key, type);
    kv->type = (enum kvr_gguf_type)type;
    if (type == KVR_GGUF_TYPE_ARRAY)
        return parse_array(c, kv);
    if (type == KVR_GGUF_TYPE_STRING)
        return read_str(c, &kv->str, kv->key);
    if ((rc = need(c, type_bytes[type], kv->key)))
        return rc;
    kv->val = c->base + c->off;
    if (type == KVR_GGUF_TYPE_BOOL && (rc = check_bools(c, kv->val, 1, kv->key)))
        return rc;
    c->off += type_bytes[type];
    return 0;
}

static int find_alignment(struct kvr_gguf *g, struct kvr_err *err)
{
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = kvr_gguf_find_kv(g, "general.alignment");
    if (i < 0)
        return 0;
    const struct kv *kv = &g->kvs[i];
    if (kv->type != KVR_GGUF_TYPE_UINT32)
        return kvr_err_set(err, KVR_EFORMAT, "general.alignment: expected uint32, got %s",
                           type_names[kv->type]);
    uint32_t a;
    memcpy(&a, kv->val, 4);
    if (a == 0 || (a & (a - 1)))
        return kvr_err_set(err, KVR_EFORMAT, "general.alignment %u is not a power of two", a);
    g->alignment = a;
    return 0;
}

/* ---- tensors ----------------------------------------------------------------------- */

static int parse_tensor(struct cursor *c, struct kvr_gguf_tensor *t, size_t alignment, int64_t i)
{
    struct kvr_gguf_str name = {0};
    char *copy = NULL;
    uint32_t n_dims, type;
    int rc = read_str(c, &name, "tensor name");
    if (rc || (rc = copy_name(c, &name, &copy, "tensor", i)))
        return rc;
    t->name = copy;
    if ((rc = read_u32(c, &n_dims, t->name)))
        return rc;
    if (n_dims < 1 || n_dims > KVR_GGUF_MAX_DIMS)
        return kvr_err_set(c->err, KVR_EFORMAT, "tensor %s: n_dims %u is not in 1..%d", t->name,
                           n_dims, KVR_GGUF_MAX_DIMS);
    t->n_dims = n_dims;
    uint64_t n_rows = 1; /* product of ne[1..] */
    for (int d = 0; d < KVR_GGUF_MAX_DIMS; d++) {
        uint64_t ne = 1;
        if ((uint32_t)d < n_dims && (rc = read_u64(c, &ne, t->name)))
            return rc;
        if (ne < 1 || ne > (uint64_t)INT64_MAX)
            return kvr_err_set(c->err, KVR_EFORMAT, "tensor %s: ne[%d] = %llu is out of range",
                               t->name, d, (unsigned long long)ne);
        if (d > 0 && !kvr_mul_u64(n_rows, ne, &n_rows))
            return kvr_err_set(c->err, KVR_EFORMAT, "tensor %s: element count overflows", t->name);
        t->ne[d] = (int64_t)ne;
    }
    if ((rc = read_u32(c, &type, t->name)) || (rc = read_u64(c, &t->offset, t->name)))
        return rc;
    const struct kvr_dtype_traits *tr = kvr_dtype_traits((int)type);
    if (!tr)
        return kvr_err_set(c->err, KVR_EFORMAT, "tensor %s: unknown type %u", t->name, type);
    t->type = (int)type;
    if (t->ne[0] % tr->block_elems)
        return kvr_err_set(c->err, KVR_EFORMAT,
                           "tensor %s: ne[0] = %lld is not a multiple of the %s block size %lld",
                           t->name, (long long)t->ne[0], tr->name, (long long)tr->block_elems);
    size_t row_bytes;
    uint64_t bytes;
    if (!kvr_dtype_row_bytes((int)type, t->ne[0], &row_bytes) ||
        !kvr_mul_u64(row_bytes, n_rows, &bytes) || bytes > SIZE_MAX)
        return kvr_err_set(c->err, KVR_EFORMAT, "tensor %s: byte size overflows", t->name);
    t->n_bytes = (size_t)bytes;
    if (t->offset % alignment)
        return kvr_err_set(c->err, KVR_EFORMAT, "tensor %s: offset %llu not aligned to %zu",
                           t->name, (unsigned long long)t->offset, alignment);
    return 0;
}

static int compare_offsets(const void *a, const void *b)
{
    const struct kvr_gguf_tensor *x = *(const struct kvr_gguf_tensor *const *)a;
    const struct kvr_gguf_tensor *y = *(const struct kvr_gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Place every tensor inside the file and check no two share a byte. */
static int place_tensors(struct kvr_gguf *g, struct kvr_err *err)
{
    for (int64_t i = 0; i < g->n_tensors; i++) {
        struct kvr_gguf_tensor *t = &g->tensors[i];
        uint64_t start, end;
        if (!kvr_add_u64(g->data_start, t->offset, &start) ||
            !kvr_add_u64(start, t->n_bytes, &end) || end > g->size)
            return kvr_err_set(err, KVR_EFORMAT,
                               "tensor %s: data at offset %llu (+%zu bytes) runs past the end "
                               "of the file (%zu bytes, data section at %zu)",
                               t->name, (unsigned long long)t->offset, t->n_bytes, g->size,
                               g->data_start);
        t->data = g->data + start;
    }
    if (g->n_tensors < 2)
        return 0;
    const struct kvr_gguf_tensor **order = kvr_malloc((size_t)g->n_tensors * sizeof *order);
    if (!order)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory sorting tensors");
    for (int64_t i = 0; i < g->n_tensors; i++)
        order[i] = &g->tensors[i];
    qsort(order, (size_t)g->n_tensors, sizeof *order, compare_offsets);
    int rc = 0;
    for (int64_t i = 1; i < g->n_tensors && !rc; i++) {
        const struct kvr_gguf_tensor *a = order[i - 1], *b = order[i];
        if (a->offset + a->n_bytes > b->offset)
            rc = kvr_err_set(
                err, KVR_EFORMAT, "tensors %s [%llu, %llu) and %s [%llu, %llu) overlap", a->name,
                (unsigned long long)a->offset, (unsigned long long)(a->offset + a->n_bytes),
                b->name, (unsigned long long)b->offset,
                (unsigned long long)(b->offset + b->n_bytes));
    }
    kvr_free(order);
    return rc;
}

/* ---- open / close ------------------------------------------------------------------ */

static int parse(struct kvr_gguf *g, struct kvr_err *err)
{
    struct cursor c = {g->data, g->size, 0, err};
    int rc;
    if (g->size < 4 || memcmp(g->data, GGUF_MAGIC, 4))
        return kvr_err_set(err, KVR_EFORMAT, "not a GGUF file (bad magic)");
    c.off = 4;
    if ((rc = read_u32(&c, &g->version, "version")))
        return rc;
    if (g->version == 1)
        return kvr_err_set(err, KVR_ENOTSUP,
                           "GGUF version 1 is not supported (only versions 2 and 3)");
    if (g->version == 0x02000000u || g->version == 0x03000000u)
        return kvr_err_set(err, KVR_ENOTSUP, "big-endian GGUF files are not supported");
    if (g->version != 2 && g->version != 3)
        return kvr_err_set(err, KVR_ENOTSUP, "unknown GGUF version %u (only 2 and 3)", g->version);
    uint64_t n_tensors, n_kv;
    if ((rc = read_u64(&c, &n_tensors, "tensor count")) || (rc = read_u64(&c, &n_kv, "kv count")))
        return rc;
    /* Reject absurd counts before allocating anything for them. */
    uint64_t min_bytes, kv_bytes;
    if (n_tensors > GGUF_MAX_COUNT || n_kv > GGUF_MAX_COUNT ||
        !kvr_mul_u64(n_tensors, GGUF_MIN_TENSOR_BYTES, &min_bytes) ||
        !kvr_mul_u64(n_kv, GGUF_MIN_KV_BYTES, &kv_bytes) ||
        !kvr_add_u64(min_bytes, kv_bytes, &min_bytes) || min_bytes > left(&c))
        return kvr_err_set(err, KVR_EFORMAT,
                           "tensor count %llu and kv count %llu cannot fit in a %zu-byte file",
                           (unsigned long long)n_tensors, (unsigned long long)n_kv, g->size);

    g->kvs = kvr_calloc(n_kv ? (size_t)n_kv : 1, sizeof *g->kvs);
    g->tensors = kvr_calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *g->tensors);
    if (!g->kvs || !g->tensors || table_init(&g->kv_index, (int64_t)n_kv) ||
        table_init(&g->tensor_index, (int64_t)n_tensors))
        return kvr_err_set(err, KVR_ENOMEM, "out of memory for %llu kvs and %llu tensors",
                           (unsigned long long)n_kv, (unsigned long long)n_tensors);

    for (uint64_t i = 0; i < n_kv; i++) {
        g->n_kv = (int64_t)i + 1; /* so close() frees what this entry owns */
        struct kv *kv = &g->kvs[i];
        if ((rc = parse_kv(&c, kv, (int64_t)i)))
            return rc;
        int64_t dup = table_insert(&g->kv_index, kv->key, (uint32_t)i, kv_name_of, g->kvs);
        if (dup >= 0)
            return kvr_err_set(err, KVR_EFORMAT, "duplicate key %s (kv %lld and %llu)", kv->key,
                               (long long)dup, (unsigned long long)i);
    }
    if ((rc = find_alignment(g, err)))
        return rc;

    for (uint64_t i = 0; i < n_tensors; i++) {
        g->n_tensors = (int64_t)i + 1;
        struct kvr_gguf_tensor *t = &g->tensors[i];
        if ((rc = parse_tensor(&c, t, g->alignment, (int64_t)i)))
            return rc;
        int64_t dup =
            table_insert(&g->tensor_index, t->name, (uint32_t)i, tensor_name_of, g->tensors);
        if (dup >= 0)
            return kvr_err_set(err, KVR_EFORMAT,
                               "duplicate tensor name %s (tensors %lld and "
                               "%llu)",
                               t->name, (long long)dup, (unsigned long long)i);
    }

    /* The data section starts at the next multiple of the alignment. A file without
     * tensors (a vocab-only file) may end before that padding. */
    size_t rem = c.off % g->alignment;
    if (!kvr_add_size(c.off, rem ? g->alignment - rem : 0, &g->data_start))
        return kvr_err_set(err, KVR_EFORMAT, "data section offset overflows");
    if (n_tensors > 0 && g->data_start > g->size)
        return kvr_err_set(err, KVR_EFORMAT,
                           "data section at %zu (aligned to %zu) starts past the end of the "
                           "file (%zu bytes)",
                           g->data_start, g->alignment, g->size);
    return place_tensors(g, err);
}

static int open_image(struct kvr_gguf **out, const void *data, size_t size, void *map,
                      struct kvr_err *err)
{
    *out = NULL;
    struct kvr_gguf *g = kvr_calloc(1, sizeof *g);
    if (!g) {
        if (map)
            munmap(map, size);
        return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    }
    g->data = data;
    g->size = size;
    g->map = map;
    int rc = parse(g, err);
    if (rc) {
        kvr_gguf_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

int kvr_gguf_open_mem(struct kvr_gguf **out, const void *data, size_t size, struct kvr_err *err)
{
    if (!data && size)
        return kvr_err_set(err, KVR_EINVAL, "NULL image");
    return open_image(out, data ? data : "", size, NULL, err);
}

int kvr_gguf_open(struct kvr_gguf **out, const char *path, struct kvr_err *err)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kvr_err_set(err, KVR_EIO, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kvr_err_set(err, KVR_EIO, "cannot stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kvr_err_set(err, KVR_EINVAL, "%s is not a regular file", path);
    }
    if (st.st_size < GGUF_HEADER_BYTES) {
        close(fd);
        return kvr_err_set(err, KVR_EFORMAT, "%s: %lld bytes is too small for a GGUF file", path,
                           (long long)st.st_size);
    }
    size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file alive */
    if (map == MAP_FAILED)
        return kvr_err_set(err, KVR_EIO, "cannot map %s: %s", path, strerror(e));
    return open_image(out, map, size, map, err);
}

void kvr_gguf_release(const struct kvr_gguf *g, const void *p, size_t n)
{
    uintptr_t base = (uintptr_t)g->map, lo = (uintptr_t)p, hi = lo + n;
    long page = sysconf(_SC_PAGESIZE);
    if (!g->map || page <= 0 || hi < lo || lo < base || hi > base + g->size)
        return;
    lo = (lo + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
    hi &= ~((uintptr_t)page - 1);
    if (lo < hi) /* a private, never written file mapping: refaults read the file again */
        madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void kvr_gguf_close(struct kvr_gguf *g)
{
    if (!g)
        return;
    for (int64_t i = 0; i < g->n_kv; i++) {
        kvr_free(g->kvs[i].key);
        kvr_free((void *)g->kvs[i].arr.strs);
    }
    for (int64_t i = 0; i < g->n_tensors; i++)
        kvr_free((void *)g->tensors[i].name);
    kvr_free(g->kvs);
    kvr_free(g->tensors);
    kvr_free(g->kv_index.slots);
    kvr_free(g->tensor_index.slots);
    if (g->map)
        munmap(g->map, g->size);
    kvr_free(g);
}

/* ---- file-level accessors ---------------------------------------------------------- */

uint32_t kvr_gguf_version(const struct kvr_gguf *g)
{
    return g->version;
}

size_t kvr_gguf_alignment(const struct kvr_gguf *g)
{
    return g->alignment;
}

size_t kvr_gguf_file_bytes(const struct kvr_gguf *g)
{
    return g->size;
}

size_t kvr_gguf_data_offset(const struct kvr_gguf *g)
{
    return g->data_start;
}

static uint64_t rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static uint64_t load64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* A multiply-rotate hash over 64-bit words in four independent lanes (so the CPU overlaps
 * the multiplies), folded together with the length and finished with a full avalanche.
 * Not cryptographic: it identifies a model file, it does not authenticate it. */
static uint64_t hash_bytes(const struct kvr_gguf *g, const uint8_t *p, size_t n)
{
    const uint64_t m1 = 0x9e3779b97f4a7c15ull, m2 = 0xd6e8feb86659fd93ull;
    /* Hashed in chunks whose pages are given back (kvr_gguf_release) once read, so a stage
     * checking the file does not keep the other stages' weights resident. A multiple of 32,
     * so the lanes see the same words as one pass would (the tail below refaults a page). */
    const size_t chunk = (size_t)4 << 20;
    uint64_t lane[4] = {m1, m2, ~m1, ~m2};
    size_t i = 0;
    for (size_t c0 = 0; c0 < n; c0 += chunk) {
        size_t end = n - c0 < chunk ? n : c0 + chunk;
        for (; i + 32 <= end; i += 32)
            for (int j = 0; j < 4; j++)
                lane[j] = rotl64(lane[j] ^ (load64(p + i + 8 * j) * m2), 29) * m1;
        kvr_gguf_release(g, p + c0, end - c0);
    }
    uint64_t h = (uint64_t)n * m1;
    for (int j = 0; j < 4; j++)
        h = rotl64(h ^ lane[j], 23) * m2 + m1;
    for (; i + 8 <= n; i += 8)
        h = rotl64(h ^ (load64(p + i) * m2), 27) * m1;
    for (; i < n; i++)
        h = rotl64(h ^ (p[i] * m1), 11) * m2;
    h ^= h >> 32;
    h *= m2;
    h ^= h >> 29;
    h *= m1;
    h ^= h >> 32;
    return h;
}

uint64_t kvr_gguf_fingerprint(struct kvr_gguf *g)
{
    /* Two threads may race to compute it: both store the same value, so the race is
     * benign; the flag is published with release order after the value. */
    if (__atomic_load_n(&g->fingerprint_done, __ATOMIC_ACQUIRE))
        return __atomic_load_n(&g->fingerprint, __ATOMIC_RELAXED);
    uint64_t h = hash_bytes(g, g->data, g->size);
    __atomic_store_n(&g->fingerprint, h, __ATOMIC_RELAXED);
    __atomic_store_n(&g->fingerprint_done, 1, __ATOMIC_RELEASE);
    return h;
}

/* ---- metadata accessors ------------------------------------------------------------ */

int64_t kvr_gguf_n_kv(const struct kvr_gguf *g)
{
    return g->n_kv;
}

const char *kvr_gguf_kv_key(const struct kvr_gguf *g, int64_t i)
{
    return (i >= 0 && i < g->n_kv) ? g->kvs[i].key : NULL;
}

enum kvr_gguf_type kvr_gguf_kv_type(const struct kvr_gguf *g, int64_t i)
{
    return (i >= 0 && i < g->n_kv) ? g->kvs[i].type : KVR_GGUF_TYPE_COUNT;
}

int64_t kvr_gguf_find_kv(const struct kvr_gguf *g, const char *key)
{
    return table_find(&g->kv_index, key, kv_name_of, g->kvs);
}

/* A scalar integer value of any width; false if the kv is not an integer. The value is
 * read into the low bytes of a uint64 (little-endian host) and sign-extended if signed. */
static bool kv_int(const struct kv *kv, bool *is_signed, uint64_t *u, int64_t *s)
{
    switch (kv->type) {
    case KVR_GGUF_TYPE_UINT8:
    case KVR_GGUF_TYPE_UINT16:
    case KVR_GGUF_TYPE_UINT32:
    case KVR_GGUF_TYPE_UINT64:
        *is_signed = false;
        break;
    case KVR_GGUF_TYPE_INT8:
    case KVR_GGUF_TYPE_INT16:
    case KVR_GGUF_TYPE_INT32:
    case KVR_GGUF_TYPE_INT64:
        *is_signed = true;
        break;
    default:
        return false;
    }
    unsigned shift = 64 - 8u * type_bytes[kv->type];
    uint64_t v = 0;
    memcpy(&v, kv->val, type_bytes[kv->type]);
    *u = v;
    *s = (int64_t)(v << shift) >> shift;
    return true;
}

static const struct kv *lookup(const struct kvr_gguf *g, const char *key, struct kvr_err *err)
{
    int64_t i = kvr_gguf_find_kv(g, key);
    if (i < 0) {
        kvr_err_set(err, KVR_ENOTFOUND, "key %s not found", key);
        return NULL;
    }
    return &g->kvs[i];
}

static int wrong_type(const struct kv *kv, const char *want, struct kvr_err *err)
{
    return kvr_err_set(err, KVR_EFORMAT, "key %s: expected %s, got %s", kv->key, want,
                       type_names[kv->type]);
}

int kvr_gguf_get_u32(const struct kvr_gguf *g, const char *key, uint32_t *out, struct kvr_err *err)
{
    const struct kv *kv = lookup(g, key, err);
    if (!kv)
        return KVR_ENOTFOUND;
    bool is_signed;
    uint64_t u = 0;
    int64_t s = 0;
    if (!kv_int(kv, &is_signed, &u, &s))
        return wrong_type(kv, "an integer", err);
    if (is_signed) {
        if (s < 0 || s > (int64_t)UINT32_MAX)
            return kvr_err_set(err, KVR_EFORMAT, "key %s: value %lld does not fit in uint32", key,
                               (long long)s);
        u = (uint64_t)s;
    } else if (u > UINT32_MAX) {
        return kvr_err_set(err, KVR_EFORMAT, "key %s: value %llu does not fit in uint32", key,
                           (unsigned long long)u);
    }
    *out = (uint32_t)u;
    return 0;
}

int kvr_gguf_get_f32(const struct kvr_gguf *g, const char *key, float *out, struct kvr_err *err)
{
    const struct kv *kv = lookup(g, key, err);
    if (!kv)
        return KVR_ENOTFOUND;
    if (kv->type == KVR_GGUF_TYPE_FLOAT32) {
        memcpy(out, kv->val, 4);
        return 0;
    }
    if (kv->type == KVR_GGUF_TYPE_FLOAT64) {
        double d;
        memcpy(&d, kv->val, 8);
        *out = (float)d;
        return 0;
    }
    bool is_signed;
    uint64_t u = 0;
    int64_t s = 0;
    if (!kv_int(kv, &is_signed, &u, &s))
        return wrong_type(kv, "a number", err);
    *out = is_signed ? (float)s : (float)u;
    return 0;
}

int kvr_gguf_get_bool(const struct kvr_gguf *g, const char *key, bool *out, struct kvr_err *err)
{
    const struct kv *kv = lookup(g, key, err);
    if (!kv)
        return KVR_ENOTFOUND;
    if (kv->type != KVR_GGUF_TYPE_BOOL)
        return wrong_type(kv, "bool", err);
    *out = kv->val[0] != 0;
    return 0;
}

int kvr_gguf_get_str(const struct kvr_gguf *g, const char *key, struct kvr_gguf_str *out,
                     struct kvr_err *err)
{
    const struct kv *kv = lookup(g, key, err);
    if (!kv)
        return KVR_ENOTFOUND;
    if (kv->type != KVR_GGUF_TYPE_STRING)
        return wrong_type(kv, "string", err);
    *out = kv->str;
    return 0;
}

int kvr_gguf_get_arr(const struct kvr_gguf *g, const char *key, struct kvr_gguf_arr *out,
                     struct kvr_err *err)
{
    const struct kv *kv = lookup(g, key, err);
    if (!kv)
        return KVR_ENOTFOUND;
    if (kv->type != KVR_GGUF_TYPE_ARRAY)
        return wrong_type(kv, "array", err);
    *out = kv->arr;
    return 0;
}

int kvr_gguf_kv_str(const struct kvr_gguf *g, int64_t i, struct kvr_gguf_str *out)
{
    if (i < 0 || i >= g->n_kv || g->kvs[i].type != KVR_GGUF_TYPE_STRING)
        return KVR_EINVAL;
    *out = g->kvs[i].str;
    return 0;
}

int kvr_gguf_kv_arr(const struct kvr_gguf *g, int64_t i, struct kvr_gguf_arr *out)
{
    if (i < 0 || i >= g->n_kv || g->kvs[i].type != KVR_GGUF_TYPE_ARRAY)
        return KVR_EINVAL;
    *out = g->kvs[i].arr;
    return 0;
}

int kvr_gguf_kv_scalar(const struct kvr_gguf *g, int64_t i, const void **out)
{
    if (i < 0 || i >= g->n_kv || !g->kvs[i].val)
        return KVR_EINVAL;
    *out = g->kvs[i].val;
    return 0;
}

int kvr_gguf_kv_num(const struct kvr_gguf *g, int64_t i, double *out)
{
    if (i < 0 || i >= g->n_kv)
        return KVR_EINVAL;
    const struct kv *kv = &g->kvs[i];
    bool is_signed;
    uint64_t u = 0;
    int64_t s = 0;
    if (kv->type == KVR_GGUF_TYPE_FLOAT32) {
        float f;
        memcpy(&f, kv->val, 4);
        *out = f;
    } else if (kv->type == KVR_GGUF_TYPE_FLOAT64) {
        memcpy(out, kv->val, 8);
    } else if (kv->type == KVR_GGUF_TYPE_BOOL) {
        *out = kv->val[0];
    } else if (kv_int(kv, &is_signed, &u, &s)) {
        *out = is_signed ? (double)s : (double)u;
    } else {
        return KVR_EINVAL;
    }
    return 0;
}

/* ---- tensor accessors -------------------------------------------------------------- */

int64_t kvr_gguf_n_tensors(const struct kvr_gguf *g)
{
    return g->n_tensors;
}

const struct kvr_gguf_tensor *kvr_gguf_tensor(const struct kvr_gguf *g, int64_t i)
{
    return (i >= 0 && i < g->n_tensors) ? &g->tensors[i] : NULL;
}

const struct kvr_gguf_tensor *kvr_gguf_find_tensor(const struct kvr_gguf *g, const char *name)
{
    int64_t i = table_find(&g->tensor_index, name, tensor_name_of, g->tensors);
    return i >= 0 ? &g->tensors[i] : NULL;
}
