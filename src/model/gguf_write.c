/* gguf_write.c - a streaming GGUF v3 writer. The byte layout is documented in gguf.c.
 *
 * Each key/value pair is serialised when it is added (into `blob`: the uint32 type followed
 * by the encoded value), so writing metadata is a sequence of fwrite calls. Tensors keep
 * only their shape and a data source until write time; offsets are assigned then. */
#include "model/gguf_write.h"

#include "core/alloc.h"
#include "model/dtype.h"

#include <errno.h>
#include <string.h>

#define DEFAULT_ALIGNMENT 32
#define ZERO_BYTES 4096
/* llama.cpp keeps tensor names in 64-byte buffers (GGML_MAX_NAME), NUL included. */
#define MAX_TENSOR_NAME 64

/* Bytes of one scalar of each metadata type; 0 for string and array. */
static const uint8_t scalar_bytes[KVR_GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

struct wkv {
    char *key;     /* owned, NUL-terminated */
    uint8_t *blob; /* owned: uint32 type + encoded value, exactly as written */
    size_t blob_bytes;
};

struct wtensor {
    char *name; /* owned */
    uint32_t n_dims;
    int64_t ne[KVR_GGUF_MAX_DIMS];
    int type;
    size_t n_bytes;
    const void *data; /* borrowed; NULL when fill is used */
    kvr_gguf_fill_fn fill;
    void *fill_ctx;
    uint64_t offset; /* from the data section start, assigned by write() */
};

struct kvr_gguf_writer {
    struct wkv *kvs;
    size_t n_kv, cap_kv;
    struct wtensor *tensors;
    size_t n_tensors, cap_tensors;
    kvr_gguf_progress_fn progress;
    void *progress_ctx;
    struct kvr_err first_err; /* first failed add; code 0 if none */
};

struct kvr_gguf_writer *kvr_gguf_writer_create(void)
{
    return kvr_calloc(1, sizeof(struct kvr_gguf_writer));
}

void kvr_gguf_writer_destroy(struct kvr_gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        kvr_free(w->kvs[i].key);
        kvr_free(w->kvs[i].blob);
    }
    for (size_t i = 0; i < w->n_tensors; i++)
        kvr_free(w->tensors[i].name);
    kvr_free(w->kvs);
    kvr_free(w->tensors);
    kvr_free(w);
}

/* Record the first failure (later ones are usually consequences of it). */
static int fail(struct kvr_gguf_writer *w, int code, const char *what, const char *name)
{
    if (!w->first_err.code)
        kvr_err_set(&w->first_err, code, "gguf writer: %s: %s", name ? name : "", what);
    return code;
}

static bool grow(void **arr, size_t *cap, size_t n, size_t elem_bytes)
{
    if (n < *cap)
        return true;
    size_t new_cap = *cap ? *cap * 2 : 16, bytes;
    if (!kvr_mul_size(new_cap, elem_bytes, &bytes))
        return false;
    void *p = kvr_realloc(*arr, bytes);
    if (!p)
        return false;
    *arr = p;
    *cap = new_cap;
    return true;
}

/* ---- metadata ---------------------------------------------------------------------- */

static void put_u32(uint8_t **p, uint32_t v)
{
    memcpy(*p, &v, 4);
    *p += 4;
}

static void put_u64(uint8_t **p, uint64_t v)
{
    memcpy(*p, &v, 8);
    *p += 8;
}

static void put_str(uint8_t **p, const char *s, uint64_t len)
{
    put_u64(p, len);
    if (len)
        memcpy(*p, s, (size_t)len);
    *p += len;
}

/* Check the key and reserve a blob of `bytes` for a new kv; returns its value area. */
static uint8_t *new_kv(struct kvr_gguf_writer *w, const char *key, size_t bytes, int *rc)
{
    *rc = 0;
    if (!key || !*key) {
        *rc = fail(w, KVR_EINVAL, "empty key", key);
        return NULL;
    }
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kvs[i].key, key)) {
            *rc = fail(w, KVR_EINVAL, "duplicate key", key);
            return NULL;
        }
    if (!grow((void **)&w->kvs, &w->cap_kv, w->n_kv, sizeof *w->kvs)) {
        *rc = fail(w, KVR_ENOMEM, "out of memory", key);
        return NULL;
    }
    struct wkv *kv = &w->kvs[w->n_kv];
    kv->key = kvr_strdup(key);
    kv->blob = kvr_malloc(bytes ? bytes : 1);
    if (!kv->key || !kv->blob) {
        kvr_free(kv->key);
        kvr_free(kv->blob);
        *rc = fail(w, KVR_ENOMEM, "out of memory", key);
        return NULL;
    }
    kv->blob_bytes = bytes;
    w->n_kv++;
    return kv->blob;
}

int kvr_gguf_writer_add_scalar(struct kvr_gguf_writer *w, const char *key, enum kvr_gguf_type type,
                               const void *value)
{
    if ((unsigned)type >= KVR_GGUF_TYPE_COUNT || !scalar_bytes[type])
        return fail(w, KVR_EINVAL, "not a scalar type", key);
    if (type == KVR_GGUF_TYPE_BOOL && *(const uint8_t *)value > 1)
        return fail(w, KVR_EINVAL, "bool value is not 0 or 1", key);
    int rc;
    uint8_t *p = new_kv(w, key, 4 + (size_t)scalar_bytes[type], &rc);
    if (!p)
        return rc;
    put_u32(&p, (uint32_t)type);
    memcpy(p, value, scalar_bytes[type]);
    return 0;
}

int kvr_gguf_writer_add_u32(struct kvr_gguf_writer *w, const char *key, uint32_t v)
{
    return kvr_gguf_writer_add_scalar(w, key, KVR_GGUF_TYPE_UINT32, &v);
}

int kvr_gguf_writer_add_i32(struct kvr_gguf_writer *w, const char *key, int32_t v)
{
    return kvr_gguf_writer_add_scalar(w, key, KVR_GGUF_TYPE_INT32, &v);
}

int kvr_gguf_writer_add_f32(struct kvr_gguf_writer *w, const char *key, float v)
{
    return kvr_gguf_writer_add_scalar(w, key, KVR_GGUF_TYPE_FLOAT32, &v);
}

int kvr_gguf_writer_add_bool(struct kvr_gguf_writer *w, const char *key, bool v)
{
    uint8_t b = v ? 1 : 0;
    return kvr_gguf_writer_add_scalar(w, key, KVR_GGUF_TYPE_BOOL, &b);
}

int kvr_gguf_writer_add_strn(struct kvr_gguf_writer *w, const char *key, const char *s, size_t len)
{
    size_t bytes;
    if (!kvr_add_size(12, len, &bytes))
        return fail(w, KVR_ENOMEM, "string too long", key);
    int rc;
    uint8_t *p = new_kv(w, key, bytes, &rc);
    if (!p)
        return rc;
    put_u32(&p, KVR_GGUF_TYPE_STRING);
    put_str(&p, s, len);
    return 0;
}

int kvr_gguf_writer_add_str(struct kvr_gguf_writer *w, const char *key, const char *s)
{
    return kvr_gguf_writer_add_strn(w, key, s, strlen(s));
}

int kvr_gguf_writer_add_arr(struct kvr_gguf_writer *w, const char *key, enum kvr_gguf_type elem,
                            uint64_t n, const void *data)
{
    if ((unsigned)elem >= KVR_GGUF_TYPE_COUNT || !scalar_bytes[elem])
        return fail(w, KVR_EINVAL, "array element type is not a scalar type", key);
    size_t data_bytes, bytes;
    if (n > SIZE_MAX || !kvr_mul_size((size_t)n, scalar_bytes[elem], &data_bytes) ||
        !kvr_add_size(16, data_bytes, &bytes))
        return fail(w, KVR_ENOMEM, "array too large", key);
    if (elem == KVR_GGUF_TYPE_BOOL)
        for (size_t i = 0; i < data_bytes; i++)
            if (((const uint8_t *)data)[i] > 1)
                return fail(w, KVR_EINVAL, "bool value is not 0 or 1", key);
    int rc;
    uint8_t *p = new_kv(w, key, bytes, &rc);
    if (!p)
        return rc;
    put_u32(&p, KVR_GGUF_TYPE_ARRAY);
    put_u32(&p, (uint32_t)elem);
    put_u64(&p, n);
    if (data_bytes)
        memcpy(p, data, data_bytes);
    return 0;
}

int kvr_gguf_writer_add_str_arr(struct kvr_gguf_writer *w, const char *key, uint64_t n,
                                const struct kvr_gguf_str *strs)
{
    size_t bytes = 16;
    for (uint64_t i = 0; i < n; i++)
        if (strs[i].len > SIZE_MAX || !kvr_add_size(bytes, 8, &bytes) ||
            !kvr_add_size(bytes, (size_t)strs[i].len, &bytes))
            return fail(w, KVR_ENOMEM, "string array too large", key);
    int rc;
    uint8_t *p = new_kv(w, key, bytes, &rc);
    if (!p)
        return rc;
    put_u32(&p, KVR_GGUF_TYPE_ARRAY);
    put_u32(&p, KVR_GGUF_TYPE_STRING);
    put_u64(&p, n);
    for (uint64_t i = 0; i < n; i++)
        put_str(&p, strs[i].ptr, strs[i].len);
    return 0;
}

int kvr_gguf_writer_copy_kv(struct kvr_gguf_writer *w, const struct kvr_gguf *src, int64_t i)
{
    const char *key = kvr_gguf_kv_key(src, i);
    enum kvr_gguf_type type = kvr_gguf_kv_type(src, i);
    struct kvr_gguf_str s;
    struct kvr_gguf_arr a;
    const void *val;
    if (!key)
        return fail(w, KVR_EINVAL, "kv index out of range", "copy");
    if (type == KVR_GGUF_TYPE_STRING && !kvr_gguf_kv_str(src, i, &s))
        return kvr_gguf_writer_add_strn(w, key, s.ptr, (size_t)s.len);
    if (type == KVR_GGUF_TYPE_ARRAY && !kvr_gguf_kv_arr(src, i, &a))
        return a.type == KVR_GGUF_TYPE_STRING
                   ? kvr_gguf_writer_add_str_arr(w, key, a.n, a.strs)
                   : kvr_gguf_writer_add_arr(w, key, a.type, a.n, a.data);
    if (!kvr_gguf_kv_scalar(src, i, &val))
        return kvr_gguf_writer_add_scalar(w, key, type, val);
    return fail(w, KVR_EINVAL, "cannot copy value", key);
}

/* ---- tensors ----------------------------------------------------------------------- */

static int add_tensor(struct kvr_gguf_writer *w, const char *name, uint32_t n_dims,
                      const int64_t *ne, int type, const void *data, kvr_gguf_fill_fn fill,
                      void *ctx)
{
    if (!name || !*name)
        return fail(w, KVR_EINVAL, "empty tensor name", name);
    if (strlen(name) >= MAX_TENSOR_NAME)
        return fail(w, KVR_EINVAL, "tensor name longer than 63 bytes", name);
    if (n_dims < 1 || n_dims > KVR_GGUF_MAX_DIMS)
        return fail(w, KVR_EINVAL, "n_dims not in 1..4", name);
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(type);
    if (!tr)
        return fail(w, KVR_EINVAL, "unknown tensor type", name);
    size_t row_bytes, bytes = 0;
    uint64_t n_rows = 1;
    for (uint32_t d = 0; d < n_dims; d++)
        if (ne[d] < 1 || (d > 0 && !kvr_mul_u64(n_rows, (uint64_t)ne[d], &n_rows)))
            return fail(w, KVR_EINVAL, "bad dimension", name);
    if (!kvr_dtype_row_bytes(type, ne[0], &row_bytes))
        return fail(w, KVR_EINVAL, "ne[0] is not a multiple of the type's block size", name);
    if (n_rows > SIZE_MAX || !kvr_mul_size(row_bytes, (size_t)n_rows, &bytes))
        return fail(w, KVR_ENOMEM, "tensor too large", name);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (!strcmp(w->tensors[i].name, name))
            return fail(w, KVR_EINVAL, "duplicate tensor name", name);
    if (!grow((void **)&w->tensors, &w->cap_tensors, w->n_tensors, sizeof *w->tensors))
        return fail(w, KVR_ENOMEM, "out of memory", name);
    struct wtensor *t = &w->tensors[w->n_tensors];
    memset(t, 0, sizeof *t);
    if (!(t->name = kvr_strdup(name)))
        return fail(w, KVR_ENOMEM, "out of memory", name);
    t->n_dims = n_dims;
    for (int d = 0; d < KVR_GGUF_MAX_DIMS; d++)
        t->ne[d] = (uint32_t)d < n_dims ? ne[d] : 1;
    t->type = type;
    t->n_bytes = bytes;
    t->data = data;
    t->fill = fill;
    t->fill_ctx = ctx;
    w->n_tensors++;
    return 0;
}

int kvr_gguf_writer_add_tensor(struct kvr_gguf_writer *w, const char *name, uint32_t n_dims,
                               const int64_t *ne, int type, const void *data)
{
    return add_tensor(w, name, n_dims, ne, type, data, NULL, NULL);
}

int kvr_gguf_writer_add_tensor_fn(struct kvr_gguf_writer *w, const char *name, uint32_t n_dims,
                                  const int64_t *ne, int type, kvr_gguf_fill_fn fill, void *ctx)
{
    if (!fill)
        return fail(w, KVR_EINVAL, "NULL fill callback", name);
    return add_tensor(w, name, n_dims, ne, type, NULL, fill, ctx);
}

void kvr_gguf_writer_set_progress(struct kvr_gguf_writer *w, kvr_gguf_progress_fn fn, void *ctx)
{
    w->progress = fn;
    w->progress_ctx = ctx;
}

/* ---- layout and output ------------------------------------------------------------- */

static uint64_t align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) & ~(a - 1);
}

/* The alignment from a uint32 general.alignment kv, or the default; 0 if it is invalid. */
static uint64_t alignment_of(const struct kvr_gguf_writer *w)
{
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, "general.alignment"))
            continue;
        uint32_t type, a;
        memcpy(&type, w->kvs[i].blob, 4);
        if (type != KVR_GGUF_TYPE_UINT32)
            return 0;
        memcpy(&a, w->kvs[i].blob + 4, 4);
        return (a && !(a & (a - 1))) ? a : 0;
    }
    return DEFAULT_ALIGNMENT;
}

/* File offset of the data section (0 if the alignment is invalid), and through data_bytes
 * its size; if assign, also store each tensor's offset in it. Sizes are bounded by what the
 * add functions accepted, far below 2^64. */
static uint64_t layout(const struct kvr_gguf_writer *w, uint64_t *data_bytes, bool assign)
{
    uint64_t align = alignment_of(w);
    if (!align)
        return 0;
    uint64_t off = 24;
    for (size_t i = 0; i < w->n_kv; i++)
        off += 8 + strlen(w->kvs[i].key) + w->kvs[i].blob_bytes;
    uint64_t data = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        struct wtensor *t = &w->tensors[i];
        off += 8 + strlen(t->name) + 4 + 8ull * t->n_dims + 4 + 8;
        if (assign)
            t->offset = data;
        data = align_up(data + t->n_bytes, align);
    }
    *data_bytes = data;
    return align_up(off, align);
}

uint64_t kvr_gguf_writer_file_bytes(const struct kvr_gguf_writer *w)
{
    uint64_t data_bytes = 0;
    uint64_t start = layout(w, &data_bytes, false);
    return start + data_bytes;
}

uint64_t kvr_gguf_writer_tensor_bytes(const struct kvr_gguf_writer *w)
{
    uint64_t sum = 0;
    for (size_t i = 0; i < w->n_tensors; i++)
        sum += w->tensors[i].n_bytes;
    return sum;
}

static int put(FILE *f, const void *p, size_t n, struct kvr_err *err)
{
    if (n && fwrite(p, 1, n, f) != n)
        return kvr_err_set(err, KVR_EIO, "gguf writer: write failed: %s", strerror(errno));
    return 0;
}

static int put_zeros(FILE *f, uint64_t n, struct kvr_err *err)
{
    static const uint8_t zeros[ZERO_BYTES];
    int rc = 0;
    while (n && !rc) {
        size_t k = n < ZERO_BYTES ? (size_t)n : ZERO_BYTES;
        rc = put(f, zeros, k, err);
        n -= k;
    }
    return rc;
}

static int put_name(FILE *f, const char *s, struct kvr_err *err)
{
    uint64_t len = strlen(s);
    int rc = put(f, &len, 8, err);
    return rc ? rc : put(f, s, (size_t)len, err);
}

static int write_header(struct kvr_gguf_writer *w, FILE *f, uint64_t data_start,
                        struct kvr_err *err)
{
    uint32_t version = 3;
    uint64_t n_tensors = w->n_tensors, n_kv = w->n_kv, off = 24;
    int rc = put(f, "GGUF", 4, err);
    if (!rc)
        rc = put(f, &version, 4, err);
    if (!rc)
        rc = put(f, &n_tensors, 8, err);
    if (!rc)
        rc = put(f, &n_kv, 8, err);
    for (size_t i = 0; i < w->n_kv && !rc; i++) {
        rc = put_name(f, w->kvs[i].key, err);
        if (!rc)
            rc = put(f, w->kvs[i].blob, w->kvs[i].blob_bytes, err);
        off += 8 + strlen(w->kvs[i].key) + w->kvs[i].blob_bytes;
    }
    for (size_t i = 0; i < w->n_tensors && !rc; i++) {
        const struct wtensor *t = &w->tensors[i];
        uint32_t type = (uint32_t)t->type;
        rc = put_name(f, t->name, err);
        if (!rc)
            rc = put(f, &t->n_dims, 4, err);
        if (!rc)
            rc = put(f, t->ne, 8 * (size_t)t->n_dims, err);
        if (!rc)
            rc = put(f, &type, 4, err);
        if (!rc)
            rc = put(f, &t->offset, 8, err);
        off += 8 + strlen(t->name) + 4 + 8ull * t->n_dims + 4 + 8;
    }
    return rc ? rc : put_zeros(f, data_start - off, err);
}

int kvr_gguf_writer_write(struct kvr_gguf_writer *w, FILE *f, struct kvr_err *err)
{
    if (w->first_err.code)
        return kvr_err_set(err, w->first_err.code, "%s", w->first_err.msg);
    uint64_t data_bytes = 0, done = 0;
    uint64_t data_start = layout(w, &data_bytes, true);
    if (!data_start)
        return kvr_err_set(err, KVR_EINVAL,
                           "gguf writer: general.alignment must be a uint32 power of two");
    int rc = write_header(w, f, data_start, err);
    size_t buf_bytes = 0;
    for (size_t i = 0; i < w->n_tensors; i++)
        if (w->tensors[i].fill && w->tensors[i].n_bytes > buf_bytes)
            buf_bytes = w->tensors[i].n_bytes;
    uint8_t *buf = NULL;
    if (!rc && buf_bytes && !(buf = kvr_malloc(buf_bytes)))
        rc = kvr_err_set(err, KVR_ENOMEM, "gguf writer: out of memory for a %zu-byte tensor",
                         buf_bytes);
    for (size_t i = 0; i < w->n_tensors && !rc; i++) {
        const struct wtensor *t = &w->tensors[i];
        const void *src = t->data;
        if (t->fill) {
            if ((rc = t->fill(t->fill_ctx, buf, t->n_bytes))) {
                rc = kvr_err_set(err, rc, "gguf writer: producing tensor %s failed: %s", t->name,
                                 kvr_strerror(rc));
                break;
            }
            src = buf;
        }
        uint64_t end = i + 1 < w->n_tensors ? w->tensors[i + 1].offset : data_bytes;
        rc = put(f, src, t->n_bytes, err);
        if (!rc)
            rc = put_zeros(f, end - t->offset - t->n_bytes, err);
        done = data_start + end;
        if (!rc && w->progress)
            w->progress(w->progress_ctx, done, data_start + data_bytes);
    }
    kvr_free(buf);
    return rc;
}
