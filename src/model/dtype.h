/* dtype.h - weight and activation types as a table of traits, plus the matmul entry points.
 *
 * Type ids are GGUF's (ggml_type) so a tensor's type field maps directly. Block layouts
 * follow GGUF; each quantized type documents its byte table in dtype.c.
 *
 * A matmul multiplies a weight matrix W [n_out rows x n_in] (one GGUF tensor, ne0 = n_in)
 * by activation rows X [n_rows x n_in]. Activations are first converted, row by row, into
 * the weight type's `dot_type` (e.g. Q8_0 for Q4_0/Q8_0 weights, Q8_K for K-quants) with
 * kvr_quantize_rows; then kvr_matmul computes Y[r][o] = dot(W[o], Xq[r]).
 *
 * Batch invariance (DESIGN.md 7): every Y[r][o] is bit-identical whatever n_rows, whatever
 * [o_begin, o_end) slice it is computed in, and whichever tile path computes it. Kernels
 * reduce each (o, r) pair in one fixed order.
 *
 * Kernels are chosen once at start-up from the CPU's features (kvr_kernels_init); tests can
 * force the plain reference kernels. Pure module: no I/O. Thread-safe after init. */
#ifndef KVR_MODEL_DTYPE_H
#define KVR_MODEL_DTYPE_H

#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum kvr_dtype {
    KVR_DTYPE_F32 = 0,
    KVR_DTYPE_F16 = 1,
    KVR_DTYPE_Q4_0 = 2,
    KVR_DTYPE_Q4_1 = 3,
    KVR_DTYPE_Q5_0 = 6,
    KVR_DTYPE_Q5_1 = 7,
    KVR_DTYPE_Q8_0 = 8,
    KVR_DTYPE_Q8_1 = 9, /* activations only (dot type of Q4_1 and Q5_1) */
    KVR_DTYPE_Q2_K = 10,
    KVR_DTYPE_Q3_K = 11,
    KVR_DTYPE_Q4_K = 12,
    KVR_DTYPE_Q5_K = 13,
    KVR_DTYPE_Q6_K = 14,
    KVR_DTYPE_Q8_K = 15, /* activations only (dot type of the K-quants) */
    KVR_DTYPE_IQ4_NL = 20,
    KVR_DTYPE_IQ4_XS = 23,
    KVR_DTYPE_BF16 = 30,
    KVR_DTYPE_MXFP4 = 39, /* OCP microscaling FP4: E8M0 scale, E2M1 values (gpt-oss experts) */
    KVR_DTYPE_COUNT = 40  /* ids are sparse; unknown ids have no traits */
};

struct kvr_dtype_traits {
    const char *name;        /* "q8_0" */
    int64_t block_elems;     /* elements per block (1 for f32/f16/bf16) */
    size_t block_bytes;      /* bytes per block */
    enum kvr_dtype dot_type; /* activation type a weight row of this type is dotted with */
    /* Reference (scalar) kernels. n is a multiple of block_elems. */
    void (*to_float)(const void *src, float *dst, int64_t n);
    void (*from_float)(const float *src, void *dst, int64_t n); /* quantize; NULL if none */
    /* dot of one weight row (this type) with one activation row (dot_type), n elements */
    float (*dot)(int64_t n, const void *w, const void *x);
    /* llama.cpp's general.file_type (llama_ftype) of a file whose matrices all have this
     * type (the K-quants: their _S preset), or -1 for an activation-only type */
    int file_type;
};

/* Traits of a type, or NULL for an unknown or unsupported id. */
const struct kvr_dtype_traits *kvr_dtype_traits(int type);

/* The type named `name` (the traits' name, any case: "q8_0", "Q4_K"), or -1. */
int kvr_dtype_by_name(const char *name);

/* True for a type a weight matrix may have: known, and not an activation-only type. */
bool kvr_dtype_is_weight(int type);

/* Bytes of a row of n elements; false if n is not a multiple of the block or overflows. */
bool kvr_dtype_row_bytes(int type, int64_t n, size_t *out_bytes);

/* A weight matrix viewed in place (usually inside the mmapped GGUF). */
struct kvr_matrix {
    enum kvr_dtype type;
    int64_t n_in;     /* elements per row (GGUF ne0) */
    int64_t n_out;    /* rows (GGUF ne1) */
    size_t row_bytes; /* bytes per row */
    const void *data; /* n_out * row_bytes bytes, borrowed */
    /* Optional copy of the weights in the layout the batched (GEMM) kernels read, made by
     * kvr_matrix_pack; borrowed, NULL to use `data` only. It must stay unchanged and alive
     * while the matrix is used. Results are bit-identical with or without it. */
    const void *packed;
};

/* Bytes of the packed copy of w (see struct kvr_matrix.packed), or 0 if w's type has no
 * packed layout (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and IQ4_XS have one) or the size overflows.
 * Exactly the size of the weights (Q8_0: 272 bytes per 8 rows x 32 columns, Q4_0: 144; the
 * K-quants their blocks' bytes), the last tile padded to 8 rows, rounded up to 64 bytes. The fast
 * kernels use it for every row count, so the mapped weights are not read once packed (the engine
 * gives those pages back, see kvr_gguf_release). */
size_t kvr_matrix_pack_bytes(const struct kvr_matrix *w);
/* Write the packed copy of w into dst (kvr_matrix_pack_bytes(w) bytes, 32-byte aligned),
 * then point w->packed at it to use it. Pure function of w's data; thread-safe on distinct
 * dst. */
void kvr_matrix_pack(const struct kvr_matrix *w, void *dst);
/* True if, once w->packed is set, the fast kernels never read w->data for slices starting
 * at a multiple of 8 rows, whatever the row count (every packable type), so its pages may be
 * released. The reference kernels and kvr_matrix_get_row still read w->data. */
bool kvr_matrix_packed_only(const struct kvr_matrix *w);

/* How the kernels are chosen. The model reads no environment: cli/ fills this from the
 * variables named below once at start-up, tests and benches the same way. The strings are
 * borrowed and must stay valid while kernels are chosen (getenv's do). */
struct kvr_kernel_options {
    const char *isa;      /* KVR_ISA: "avx512", "avx2" or "reference" forces that set (refused
                           * if the CPU cannot run it); NULL or "": the best this CPU runs */
    const char *prefetch; /* KVR_PREFETCH: bytes the packed kernels prefetch ahead, 0 to
                           * 1048576; NULL or "": by CPU vendor and thread count */
};

/* Keep *opt (NULL: the defaults) for every later kernel choice (kvr_kernels_init,
 * kvr_kernels_setup). Nothing is checked here: setup reports bad options. Call before threads
 * start. */
void kvr_kernels_configure(const struct kvr_kernel_options *opt);
/* Pick the fastest kernels this CPU supports, or the lower set the isa option names;
 * idempotent, call before threads start. Returns the name of the chosen kernel set. An isa
 * option naming an unknown set or one the CPU cannot run is ignored here: callers that can
 * report errors use kvr_kernels_setup. */
const char *kvr_kernels_init(void);
/* Choose the kernel set as kvr_kernels_init does, but fail with KVR_EINVAL (unknown name)
 * or KVR_ENOTSUP (a set this CPU or OS cannot run) and a message if the isa option asks for
 * one. The packed kernels' prefetch distances are chosen for n_threads compute threads (0:
 * not known), unless the prefetch option sets them (KVR_EINVAL if it is not a byte count up
 * to 1 MiB). Call before compute threads start (engines do, in kvr_engine_create). */
int kvr_kernels_setup(int n_threads, struct kvr_err *err);
/* True if the active kernel set needs (so the CPU has) AVX2, FMA and F16C. */
bool kvr_kernels_avx2_ok(void);
/* Tests: use the scalar reference kernels (true) or the best ones (false). Every kernel set
 * follows the operation order of the reference (documented in dtype.c), so the results of
 * kvr_quantize_rows and kvr_matmul are bit-identical whichever set runs. */
void kvr_kernels_force_reference(bool on);
const char *kvr_kernels_name(void);

/* Bytes of one activation row of n_in elements converted for a weight of type `wtype`.
 * Always use this as the row stride of quantized activations: it can exceed the dot_type
 * row (rows for Q8_0/Q4_0 weights carry a per-block extension after their Q8_0 blocks, see
 * model/kernels.h), and it is 0 if n_in is not a whole number of blocks. */
size_t kvr_act_row_bytes(enum kvr_dtype wtype, int64_t n_in);

/* Convert rows [r_begin, r_end) of x (n_rows x n_in floats, row stride n_in) into dst
 * (row stride kvr_act_row_bytes) in wtype's dot_type. Row-wise: the result of a row
 * never depends on other rows. */
void kvr_quantize_rows(enum kvr_dtype wtype, const float *x, int64_t n_in, int64_t r_begin,
                       int64_t r_end, void *dst);

/* Y[r * ldy + o] = dot(W[o], Xq[r]) for r in [0, n_rows), o in [o_begin, o_end).
 * xq holds n_rows activation rows from kvr_quantize_rows. Single-threaded: callers split
 * [0, n_out) across the pool. Uses blocked matrix-matrix tiles when n_rows > 1. */
void kvr_matmul(const struct kvr_matrix *w, const void *xq, int64_t n_rows, float *y, int64_t ldy,
                int64_t o_begin, int64_t o_end);

/* Split [0, n_out) among nth threads for kvr_matmul: thread ith gets [*begin, *end).
 * Ranges are contiguous and deterministic, and start at multiples of the active kernels'
 * output tile so no thread runs a ragged tile in the middle of the matrix. Any other split
 * gives the same bits, only slower. */
void kvr_matmul_split(int64_t n_out, int ith, int nth, int64_t *begin, int64_t *end);

/* Dequantize weight row `row` of w into dst (n_in floats), e.g. an embedding lookup. */
void kvr_matrix_get_row(const struct kvr_matrix *w, int64_t row, float *dst);

/* fp16 / bf16 scalar conversions (exact, round-to-nearest-even). */
float kvr_f16_to_f32(uint16_t h);
uint16_t kvr_f32_to_f16(float f);
float kvr_bf16_to_f32(uint16_t h);
uint16_t kvr_f32_to_bf16(float f);

#endif
