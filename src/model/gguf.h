/* gguf.h - a bounded reader for GGUF v2 and v3 files.
 *
 * kvr_gguf_open maps the file read-only and validates all of it before returning: every
 * count, string length, array length, tensor dimension, type, offset, size and alignment is
 * checked against the file's size, and tensors may not overlap. After a successful open
 * every accessor below is safe and cheap (no parsing, no allocation). Failures fill `err`
 * with a precise message and never crash, whatever the bytes.
 *
 * Ownership: the struct kvr_gguf owns the mapping (or borrows the caller's buffer for
 * kvr_gguf_open_mem, which must outlive it). Every pointer returned by an accessor points
 * into it and lives until kvr_gguf_close. Strings from the file are NOT NUL-terminated in
 * the file; the reader keeps a NUL-terminated copy of keys and tensor names only.
 * Thread-safe for concurrent reads after open. */
#ifndef KVR_MODEL_GGUF_H
#define KVR_MODEL_GGUF_H

#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Metadata value types, as numbered in the GGUF format. */
enum kvr_gguf_type {
    KVR_GGUF_TYPE_UINT8 = 0,
    KVR_GGUF_TYPE_INT8 = 1,
    KVR_GGUF_TYPE_UINT16 = 2,
    KVR_GGUF_TYPE_INT16 = 3,
    KVR_GGUF_TYPE_UINT32 = 4,
    KVR_GGUF_TYPE_INT32 = 5,
    KVR_GGUF_TYPE_FLOAT32 = 6,
    KVR_GGUF_TYPE_BOOL = 7,
    KVR_GGUF_TYPE_STRING = 8,
    KVR_GGUF_TYPE_ARRAY = 9,
    KVR_GGUF_TYPE_UINT64 = 10,
    KVR_GGUF_TYPE_INT64 = 11,
    KVR_GGUF_TYPE_FLOAT64 = 12,
    KVR_GGUF_TYPE_COUNT = 13
};

#define KVR_GGUF_MAX_DIMS 4

/* Static name of a metadata value type ("uint32", "string", ...; "unknown" if invalid). */
const char *kvr_gguf_type_name(enum kvr_gguf_type type);

struct kvr_gguf;

struct kvr_gguf_str {
    uint64_t len;
    const char *ptr; /* len bytes, not NUL-terminated */
};

struct kvr_gguf_arr {
    enum kvr_gguf_type type;         /* element type (never ARRAY: nested arrays are rejected) */
    uint64_t n;                      /* element count */
    const void *data;                /* numeric arrays: n packed little-endian elements, NOT
                                        aligned (read them with memcpy) */
    const struct kvr_gguf_str *strs; /* string arrays: n entries (index built at open) */
};

struct kvr_gguf_tensor {
    const char *name;              /* NUL-terminated */
    uint32_t n_dims;               /* 1..4 */
    int64_t ne[KVR_GGUF_MAX_DIMS]; /* elements per dim, ne[0] fastest; unused dims are 1 */
    int type;                      /* enum kvr_dtype id (known to dtype.h) */
    uint64_t offset;               /* from the start of the data section */
    size_t n_bytes;
    const void *data; /* n_bytes inside the mapping */
};

int kvr_gguf_open(struct kvr_gguf **out, const char *path, struct kvr_err *err);
/* Parse an in-memory image (for tests and fuzzing). `data` is borrowed. */
int kvr_gguf_open_mem(struct kvr_gguf **out, const void *data, size_t size, struct kvr_err *err);
void kvr_gguf_close(struct kvr_gguf *g);
/* Tell the OS that the mapped bytes [p, p + n) are not needed for now: the whole pages
 * inside the range leave the process's resident set (e.g. weights the engine has copied
 * into a packed layout). They are read back from the file if touched again, so the bytes
 * never change. A no-op for images from kvr_gguf_open_mem and for ranges outside the
 * mapping. Thread-safe. */
void kvr_gguf_release(const struct kvr_gguf *g, const void *p, size_t n);

uint32_t kvr_gguf_version(const struct kvr_gguf *g);
size_t kvr_gguf_alignment(const struct kvr_gguf *g);
size_t kvr_gguf_file_bytes(const struct kvr_gguf *g);
/* File offset of the data section (tensor offsets are relative to it). */
size_t kvr_gguf_data_offset(const struct kvr_gguf *g);
/* A 64-bit fingerprint of the whole file (computed lazily, cached). Reading it releases
 * the file's mapped pages as it goes (kvr_gguf_release): later reads fault them in again. */
uint64_t kvr_gguf_fingerprint(struct kvr_gguf *g);

/* Metadata. Keys are looked up by exact name. */
int64_t kvr_gguf_n_kv(const struct kvr_gguf *g);
const char *kvr_gguf_kv_key(const struct kvr_gguf *g, int64_t i);
enum kvr_gguf_type kvr_gguf_kv_type(const struct kvr_gguf *g, int64_t i);
int64_t kvr_gguf_find_kv(const struct kvr_gguf *g, const char *key); /* -1 if absent */

/* Typed getters: KVR_ENOTFOUND if absent, KVR_EFORMAT (with message) on a type that cannot
 * be represented (get_u32 accepts any integer type whose value fits; get_f32 accepts
 * float32/float64 and integers). */
int kvr_gguf_get_u32(const struct kvr_gguf *g, const char *key, uint32_t *out, struct kvr_err *err);
int kvr_gguf_get_f32(const struct kvr_gguf *g, const char *key, float *out, struct kvr_err *err);
int kvr_gguf_get_bool(const struct kvr_gguf *g, const char *key, bool *out, struct kvr_err *err);
int kvr_gguf_get_str(const struct kvr_gguf *g, const char *key, struct kvr_gguf_str *out,
                     struct kvr_err *err);
int kvr_gguf_get_arr(const struct kvr_gguf *g, const char *key, struct kvr_gguf_arr *out,
                     struct kvr_err *err);
/* Same, by index (for `kvasir info`). */
int kvr_gguf_kv_str(const struct kvr_gguf *g, int64_t i, struct kvr_gguf_str *out);
int kvr_gguf_kv_arr(const struct kvr_gguf *g, int64_t i, struct kvr_gguf_arr *out);
/* The raw little-endian bytes of a scalar (numeric or bool) value, exactly as stored
 * (kvr_gguf_kv_type says how to read them); KVR_EINVAL for strings and arrays. */
int kvr_gguf_kv_scalar(const struct kvr_gguf *g, int64_t i, const void **out);
/* Numeric scalar of any numeric/bool type as double; KVR_EINVAL if not numeric. */
int kvr_gguf_kv_num(const struct kvr_gguf *g, int64_t i, double *out);

/* Tensors. */
int64_t kvr_gguf_n_tensors(const struct kvr_gguf *g);
const struct kvr_gguf_tensor *kvr_gguf_tensor(const struct kvr_gguf *g, int64_t i);
const struct kvr_gguf_tensor *kvr_gguf_find_tensor(const struct kvr_gguf *g,
                                                   const char *name); /* NULL if absent */

#endif
