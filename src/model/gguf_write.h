/* gguf_write.h - a streaming GGUF v3 writer (the layout gguf.c documents and reads).
 *
 * Usage: create a writer, add key/value pairs and tensors in the order they should appear
 * in the file, then kvr_gguf_writer_write() streams header, metadata, tensor infos, padding
 * and tensor data to a FILE*. Tensor data is never gathered in memory: each tensor is
 * either a borrowed pointer or produced on demand by a fill callback into one reusable
 * buffer (the size of the largest such tensor), so a multi-gigabyte model can be written
 * with little memory.
 *
 * The alignment is that of a uint32 `general.alignment` kv if one was added (it must be a
 * power of two), else 32. Each tensor's data starts at a multiple of it and is followed by
 * zero padding up to the next multiple, as llama.cpp writes it.
 *
 * Errors: the add functions validate their arguments (non-empty unique keys and tensor
 * names, names of at most 63 bytes as llama.cpp requires, known types, dims 1..4, ne[0] a
 * multiple of the type's block). The first failure is
 * returned and also remembered: kvr_gguf_writer_write() then refuses to write and reports
 * it, so a sequence of adds can be checked once at the end.
 *
 * Ownership: the writer copies keys, names, strings and metadata arrays. Tensor data
 * pointers and fill contexts are borrowed and must stay valid until write returns.
 * A writer is used by one thread at a time. */
#ifndef KVR_MODEL_GGUF_WRITE_H
#define KVR_MODEL_GGUF_WRITE_H

#include "core/err.h"
#include "model/gguf.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

struct kvr_gguf_writer;

/* Produce the n_bytes of a tensor's data into dst (the tensor's type layout). Returns 0 or
 * a negative status (the write then fails with it). */
typedef int (*kvr_gguf_fill_fn)(void *ctx, void *dst, size_t n_bytes);

/* Called after each tensor's data is written: bytes written so far out of the total. */
typedef void (*kvr_gguf_progress_fn)(void *ctx, uint64_t done_bytes, uint64_t total_bytes);

struct kvr_gguf_writer *kvr_gguf_writer_create(void); /* NULL on out of memory */
void kvr_gguf_writer_destroy(struct kvr_gguf_writer *w);

/* Metadata. add_scalar takes one value of a numeric or bool type (value points to it). */
int kvr_gguf_writer_add_scalar(struct kvr_gguf_writer *w, const char *key, enum kvr_gguf_type type,
                               const void *value);
int kvr_gguf_writer_add_u32(struct kvr_gguf_writer *w, const char *key, uint32_t v);
int kvr_gguf_writer_add_i32(struct kvr_gguf_writer *w, const char *key, int32_t v);
int kvr_gguf_writer_add_f32(struct kvr_gguf_writer *w, const char *key, float v);
int kvr_gguf_writer_add_bool(struct kvr_gguf_writer *w, const char *key, bool v);
int kvr_gguf_writer_add_str(struct kvr_gguf_writer *w, const char *key, const char *s);
int kvr_gguf_writer_add_strn(struct kvr_gguf_writer *w, const char *key, const char *s, size_t len);
/* Numeric/bool array: n packed little-endian elements of type `elem`. */
int kvr_gguf_writer_add_arr(struct kvr_gguf_writer *w, const char *key, enum kvr_gguf_type elem,
                            uint64_t n, const void *data);
int kvr_gguf_writer_add_str_arr(struct kvr_gguf_writer *w, const char *key, uint64_t n,
                                const struct kvr_gguf_str *strs);
/* Copy key/value pair i of an open reader (any type) under the same key. */
int kvr_gguf_writer_copy_kv(struct kvr_gguf_writer *w, const struct kvr_gguf *src, int64_t i);

/* Tensors: ne[0..n_dims) elements per dim, ne[0] fastest; `type` an enum kvr_dtype id. */
int kvr_gguf_writer_add_tensor(struct kvr_gguf_writer *w, const char *name, uint32_t n_dims,
                               const int64_t *ne, int type, const void *data);
int kvr_gguf_writer_add_tensor_fn(struct kvr_gguf_writer *w, const char *name, uint32_t n_dims,
                                  const int64_t *ne, int type, kvr_gguf_fill_fn fill, void *ctx);

void kvr_gguf_writer_set_progress(struct kvr_gguf_writer *w, kvr_gguf_progress_fn fn, void *ctx);

/* Size of the file write() will produce, and the sum of the tensors' data bytes. */
uint64_t kvr_gguf_writer_file_bytes(const struct kvr_gguf_writer *w);
uint64_t kvr_gguf_writer_tensor_bytes(const struct kvr_gguf_writer *w);

/* Stream the whole file to f (from its current position). Does not fclose or fflush. */
int kvr_gguf_writer_write(struct kvr_gguf_writer *w, FILE *f, struct kvr_err *err);

#endif
