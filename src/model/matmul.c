/* matmul.c - kernel dispatch and the matmul entry points of dtype.h.
 *
 * The kernel set is chosen once by kvr_kernels_init from the CPU's features: avx512
 * (kernels/set_avx512.c) if CPUID has AVX-512 F/BW/VL/DQ + VNNI and the OS saves the zmm and
 * opmask state, else avx2 (kernels/set_avx2.c) with AVX2 + FMA + F16C, else the reference
 * set, the scalar code of dtype.c (one trait dot per output element). The options given to
 * kvr_kernels_configure (cli/ reads them from KVR_ISA and KVR_PREFETCH) can force a lower set
 * (kvr_kernels_setup refuses one the CPU lacks) and the prefetch distances. Every set follows the
 * operation order fixed in dtype.c, so an output element gets the same bits whatever the kernel
 * set, row count, slice or tile that computes it (batch invariance, DESIGN.md 7). The choice is
 * global and made before threads start. */
#include "model/dtype.h"
#include "model/kernels.h"

#include "core/alloc.h"
#include "core/err.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* The kernel choice, global to the process: which kernel set runs, and the options it is
 * chosen by. g_options is written by kvr_kernels_configure at start-up. g_chosen is a copy of the
 * chosen ISA's table with its prefetch distances, published through g_best; kvr_kernels_init
 * and kvr_kernels_setup rewrite it only when the choice changes, which happens before compute
 * threads start (a repeated setup with the same options writes nothing). */
static struct kvr_kernel_options g_options;
static struct kvr_kernel_set g_chosen;
static _Atomic(const struct kvr_kernel_set *) g_best;
static atomic_bool g_force_reference;

static const struct kvr_kernel_set kernels_reference = {.name = "reference", .o_tile = 1};

/* F16C is read from CPUID directly: clang 14's __builtin_cpu_supports does not know it. The
 * builtin's "avx2" check already covers the OS saving ymm state (XGETBV). */
static bool cpu_has_avx2(void)
{
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax, ebx, ecx, edx;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return false;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return false;
    return (ecx & bit_F16C) != 0;
#else
    return false;
#endif
}

/* AVX-512 F, BW, VL, DQ and VNNI in CPUID leaf 7, and XCR0 (read with XGETBV, which CPUID
 * leaf 1 says the OS enabled) with the SSE, AVX, opmask, ZMM_Hi256 and Hi16_ZMM state bits
 * (1, 2, 5, 6, 7): without the OS saving that state the instructions would fault. */
static bool cpu_has_avx512(void)
{
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax, ebx, ecx, edx;
    if (!cpu_has_avx2() || !__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE))
        return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xE6) != 0xE6)
        return false;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        return false;
    const unsigned need_ebx = bit_AVX512F | bit_AVX512DQ | bit_AVX512BW | bit_AVX512VL;
    return (ebx & need_ebx) == need_ebx && (ecx & bit_AVX512VNNI);
#else
    return false;
#endif
}

static const struct kvr_kernel_set *best_available(void)
{
    return cpu_has_avx512() ? &kvr_kernels_avx512
           : cpu_has_avx2() ? &kvr_kernels_avx2
                            : &kernels_reference;
}

/* The set the isa option (KVR_ISA) asks for (the best available one if it is unset or empty)
 * into *out; an error if it names no set or one this CPU lacks. */
static int requested(const struct kvr_kernel_set **out, struct kvr_err *err)
{
    static const struct kvr_kernel_set *const sets[] = {&kvr_kernels_avx512, &kvr_kernels_avx2,
                                                        &kernels_reference}; /* best first */
    const size_t n_sets = sizeof sets / sizeof sets[0];
    const char *isa = g_options.isa;
    const struct kvr_kernel_set *best = best_available();
    *out = best;
    if (!isa || !*isa)
        return KVR_OK;
    size_t want = n_sets, have = 0;
    for (size_t i = 0; i < n_sets; i++) {
        if (!strcmp(isa, sets[i]->name))
            want = i;
        if (sets[i] == best)
            have = i;
    }
    if (want == n_sets)
        return kvr_err_set(err, KVR_EINVAL,
                           "KVR_ISA=%s: unknown kernel set (avx512, avx2, "
                           "reference)",
                           isa);
    if (want < have)
        return kvr_err_set(err, KVR_ENOTSUP,
                           "KVR_ISA=%s: this CPU (or its OS) cannot run the "
                           "%s kernels; the best it can run is %s",
                           isa, isa, best->name);
    *out = sets[want];
    return KVR_OK;
}

static bool cpu_is_amd(void)
{
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax, ebx, ecx, edx;
    /* the vendor string is ebx, edx, ecx: "Auth" "enti" "cAMD" */
    return __get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x68747541u && edx == 0x69746e65u &&
           ecx == 0x444d4163u;
#else
    return false;
#endif
}

/* The packed-copy kernels' prefetch distances (kernels.h). */
struct prefetch {
    size_t kquant, legacy; /* legacy: Q4_0 and Q8_0 */
};

/* The prefetch option (KVR_PREFETCH) for both if it is set, else the distances that decode
 * fastest on the CPU's vendor for n_threads compute threads (0: not known), as bench_forward
 * measured them: on Intel 24 KiB for the K-quants and none for Q4_0 / Q8_0; on AMD none for
 * Q4_0 / Q8_0, and for the K-quants, whose chunks are read front to back, none at one thread
 * and 8 KiB at more. An error if the option is not a byte count up to 1 MiB, with the
 * vendor's distances in *pf. */
static int prefetch_distances(struct prefetch *pf, int n_threads, struct kvr_err *err)
{
    bool amd = cpu_is_amd();
    size_t kq_amd = n_threads == 1 ? 0 : 8 * 1024;
    *pf = (struct prefetch){.kquant = amd ? kq_amd : 24 * 1024};
    const char *env = g_options.prefetch;
    if (!env || !*env)
        return KVR_OK;
    char *end;
    unsigned long long v = strtoull(env, &end, 10);
    if (*end || env[0] == '-' || v > 1024 * 1024)
        return kvr_err_set(err, KVR_EINVAL,
                           "KVR_PREFETCH=%s: not a prefetch distance in bytes (0 to 1048576)", env);
    pf->kquant = pf->legacy = (size_t)v;
    return KVR_OK;
}

/* Make k, with the distances pf, the active set (g_chosen); nothing is written if it already
 * is. */
static void choose(const struct kvr_kernel_set *k, const struct prefetch *pf)
{
    const struct kvr_kernel_set *cur = atomic_load_explicit(&g_best, memory_order_acquire);
    if (cur && cur->name == k->name && cur->prefetch_kquant == pf->kquant &&
        cur->prefetch_legacy == pf->legacy)
        return;
    g_chosen = *k;
    g_chosen.prefetch_kquant = pf->kquant;
    g_chosen.prefetch_legacy = pf->legacy;
    atomic_store_explicit(&g_best, &g_chosen, memory_order_release);
}

void kvr_kernels_configure(const struct kvr_kernel_options *opt)
{
    g_options = opt ? *opt : (struct kvr_kernel_options){0};
}

int kvr_kernels_setup(int n_threads, struct kvr_err *err)
{
    const struct kvr_kernel_set *k;
    struct prefetch pf;
    int rc = requested(&k, err);
    if (rc || (rc = prefetch_distances(&pf, n_threads, err)))
        return rc;
    choose(k, &pf);
    return KVR_OK;
}

const char *kvr_kernels_init(void)
{
    if (!atomic_load_explicit(&g_best, memory_order_acquire)) {
        const struct kvr_kernel_set *k;
        requested(&k, NULL); /* a bad isa option leaves k at the best set; setup reports it */
        struct prefetch pf;  /* a bad prefetch option leaves the vendor's; setup says so */
        (void)prefetch_distances(&pf, 0, NULL);
        choose(k, &pf);
    }
    return kvr_kernels_name();
}

void kvr_kernels_force_reference(bool on)
{
    atomic_store_explicit(&g_force_reference, on, memory_order_relaxed);
}

static const struct kvr_kernel_set *active(void)
{
    if (atomic_load_explicit(&g_force_reference, memory_order_relaxed))
        return &kernels_reference;
    const struct kvr_kernel_set *k = atomic_load_explicit(&g_best, memory_order_acquire);
    if (!k) {
        kvr_kernels_init();
        k = atomic_load_explicit(&g_best, memory_order_acquire);
    }
    return k;
}

const struct kvr_kernel_set *kvr_kernels_active(void)
{
    return active();
}

bool kvr_kernels_avx2_ok(void)
{
    const char *name = active()->name; /* g_chosen copies the ISA table's name pointer */
    return name == kvr_kernels_avx2.name || name == kvr_kernels_avx512.name;
}

const char *kvr_kernels_name(void)
{
    return active()->name;
}

void kvr_matmul_split(int64_t n_out, int ith, int nth, int64_t *begin, int64_t *end)
{
    int64_t tile = active()->o_tile;
    int64_t n_tiles = (n_out + tile - 1) / tile;
    int64_t per = n_tiles / nth, rem = n_tiles % nth;
    int64_t b = ith * per + (ith < rem ? ith : rem);
    int64_t e = b + per + (ith < rem ? 1 : 0);
    *begin = b * tile < n_out ? b * tile : n_out;
    *end = e * tile < n_out ? e * tile : n_out;
}

size_t kvr_act_row_bytes(enum kvr_dtype wtype, int64_t n_in)
{
    const struct kvr_dtype_traits *t = kvr_dtype_traits(wtype);
    size_t bytes = 0, ext = 0;
    if (!t || !kvr_dtype_row_bytes(t->dot_type, n_in, &bytes))
        return 0;
    if (t->dot_type == KVR_DTYPE_Q8_0) { /* Q8_0 blocks + per-block extension (kernels.h) */
        int64_t nb = n_in / KVR_QK;
        if (!kvr_mul_size((size_t)nb, sizeof(struct kvr_q8_0_ext), &ext) ||
            !kvr_add_size(kvr_q8_0_ext_offset(nb), ext, &bytes))
            return 0;
    }
    return bytes;
}

/* The reference activation converter for Q8_0-dotted weights: the trait's Q8_0 quantizer,
 * then the per-block extension the kernels read. */
static void quantize_row_q8_0_act(const float *x, void *dst, int64_t n)
{
    int64_t nb = n / KVR_QK;
    kvr_dtype_traits(KVR_DTYPE_Q8_0)->from_float(x, dst, n);
    const struct kvr_block_q8_0 *blk = dst;
    char *ext = (char *)dst + kvr_q8_0_ext_offset(nb);
    memset((char *)dst + (size_t)nb * sizeof *blk, 0,
           kvr_q8_0_ext_offset(nb) - (size_t)nb * sizeof *blk);
    for (int64_t b = 0; b < nb; b++) {
        struct kvr_q8_0_ext e = {kvr_f16_to_f32(blk[b].d), 0};
        for (int j = 0; j < KVR_QK; j++)
            e.s8 += 8 * blk[b].qs[j];
        memcpy(ext + (size_t)b * sizeof e, &e, sizeof e);
    }
}

void kvr_quantize_rows(enum kvr_dtype wtype, const float *x, int64_t n_in, int64_t r_begin,
                       int64_t r_end, void *dst)
{
    const struct kvr_dtype_traits *wt = kvr_dtype_traits(wtype);
    if (!wt)
        abort(); /* an unknown type here is a broken invariant, not bad input */
    enum kvr_dtype at = wt->dot_type;
    size_t stride = kvr_act_row_bytes(wtype, n_in);
    kvr_quantize_row_fn fn = active()->quantize_row[at];
    if (!fn)
        fn = at == KVR_DTYPE_Q8_0 ? quantize_row_q8_0_act : kvr_dtype_traits(at)->from_float;
    for (int64_t r = r_begin; r < r_end; r++)
        fn(x + r * n_in, (char *)dst + (size_t)r * stride, n_in);
}

static void matmul_reference(const struct kvr_kernel_set *ks, const struct kvr_matrix *w,
                             const void *xq, size_t x_stride, int64_t n_rows, float *y, int64_t ldy,
                             int64_t o_begin, int64_t o_end)
{
    const struct kvr_dtype_traits *t = kvr_dtype_traits(w->type);
    for (int64_t o = o_begin; o < o_end; o++) {
        const char *wrow = (const char *)w->data + (size_t)o * w->row_bytes;
        for (int64_t r = 0; r < n_rows; r++)
            y[r * ldy + o] = t->dot(w->n_in, wrow, (const char *)xq + (size_t)r * x_stride);
    }
}

void kvr_matmul(const struct kvr_matrix *w, const void *xq, int64_t n_rows, float *y, int64_t ldy,
                int64_t o_begin, int64_t o_end)
{
    if (!kvr_dtype_is_weight(w->type))
        abort(); /* the loader only builds matrices of weight types */
    if (n_rows <= 0 || o_begin >= o_end)
        return;
    size_t x_stride = kvr_act_row_bytes(w->type, w->n_in);
    if (w->n_in % kvr_dtype_traits(w->type)->block_elems != 0)
        abort();
    const struct kvr_kernel_set *ks = active();
    kvr_matmul_fn fn = ks->matmul[w->type];
    if (!fn)
        fn = matmul_reference;
    fn(ks, w, xq, x_stride, n_rows, y, ldy, o_begin, o_end);
}

static size_t pack_unit(enum kvr_dtype type)
{
    switch (type) {
    case KVR_DTYPE_Q8_0:
        return KVR_PACK_UNIT_Q8_0;
    case KVR_DTYPE_Q4_0:
        return KVR_PACK_UNIT_Q4_0;
    case KVR_DTYPE_Q4_K:
        return KVR_PACK_UNIT_Q4_K;
    case KVR_DTYPE_Q5_K:
        return KVR_PACK_UNIT_Q5_K;
    case KVR_DTYPE_Q6_K:
        return KVR_PACK_UNIT_Q6_K;
    case KVR_DTYPE_IQ4_XS:
        return KVR_PACK_UNIT_IQ4_XS;
    default:
        return 0;
    }
}

/* Tiles of a packed copy: whole pairs (kernels.h), the padding rows repeating the last. */
static int64_t pack_tiles(int64_t n_out)
{
    return (n_out + 2 * KVR_PACK_ROWS - 1) / (2 * KVR_PACK_ROWS) * 2;
}

size_t kvr_matrix_pack_bytes(const struct kvr_matrix *w)
{
    size_t unit = pack_unit(w->type), bytes = 0;
    const struct kvr_dtype_traits *t = kvr_dtype_traits(w->type);
    if (!unit || w->n_in <= 0 || w->n_out <= 0 || w->n_in % t->block_elems != 0)
        return 0;
    int64_t n_tiles = pack_tiles(w->n_out);
    if (!kvr_mul_size((size_t)n_tiles, (size_t)(w->n_in / t->block_elems), &bytes) ||
        !kvr_mul_size(bytes, unit, &bytes) || !kvr_add_size(bytes, 63, &bytes))
        return 0;
    return bytes & ~(size_t)63; /* whole 64-byte lines, so copies can sit back to back */
}

bool kvr_matrix_packed_only(const struct kvr_matrix *w)
{
    return kvr_matrix_pack_bytes(w) != 0;
}

/* The Q8_0 / Q4_0 unit (kernels.h): the fp16 scales, then the quants by dword. */
static void pack_unit_q(const struct kvr_matrix *w, const uint8_t *const rows[KVR_PACK_ROWS],
                        int64_t b, uint8_t *out)
{
    size_t wb =
        w->type == KVR_DTYPE_Q8_0 ? sizeof(struct kvr_block_q8_0) : sizeof(struct kvr_block_q4_0);
    int n_g = w->type == KVR_DTYPE_Q8_0 ? 8 : 4;
    for (int i = 0; i < KVR_PACK_ROWS; i++) {
        const uint8_t *blk = rows[i] + (size_t)b * wb;
        memcpy(out + 2 * i, blk, 2); /* both block types start with the fp16 d */
        for (int g = 0; g < n_g; g++)
            memcpy(out + 16 + 32 * g + 4 * i, blk + 2 + 4 * g, 4);
    }
}

/* A K-quant unit in the block's field order, each field interleaved by row. */
static void fill_unit_k(const struct kvr_matrix *w, const uint8_t *const rows[KVR_PACK_ROWS],
                        int64_t b, uint8_t *out)
{
    static const uint8_t q4_k[] = {2, 2, 12, 128}, q5_k[] = {2, 2, 12, 32, 128},
                         q6_k[] = {128, 64, 16, 2}, iq4_xs[] = {2, 2, 4, 128};
    const uint8_t *fields = w->type == KVR_DTYPE_Q4_K   ? q4_k
                            : w->type == KVR_DTYPE_Q5_K ? q5_k
                            : w->type == KVR_DTYPE_Q6_K ? q6_k
                                                        : iq4_xs;
    int n_fields = w->type == KVR_DTYPE_Q5_K ? 5 : 4;
    size_t wb = kvr_dtype_traits(w->type)->block_bytes, at = 0;
    for (int f = 0; f < n_fields; f++) {
        size_t n = fields[f], step = n == 2 ? 2 : 4;
        for (size_t g = 0; g < n; g += step)
            for (int i = 0; i < KVR_PACK_ROWS; i++)
                memcpy(out + KVR_PACK_ROWS * (at + g) + step * (size_t)i,
                       rows[i] + (size_t)b * wb + at + g, step);
        at += n;
    }
}

/* Q6_K's quant vectors of block b's unit as kernels.h stores them (over those fill_unit_k
 * copied in field order into `lu`): for half h and dword group g, byte j of row i names
 * the quants q0..q3 of elements 128h + 32k + 4g + j (k = 0..3), and the ql vectors 16h + g,
 * 16h + 8 + g and the qh vector 8h + g hold A = q0 | (q3 & 3) << 6, B = q1 | (q3 >> 2 & 3)
 * << 6 and C = q2 | (q3 >> 4) << 6 there. */
static void q6_k_abc(const uint8_t *const rows[KVR_PACK_ROWS], int64_t b, uint8_t *lu)
{
    for (int i = 0; i < KVR_PACK_ROWS; i++) {
        int8_t q[KVR_QK_K];
        kvr_q6_k_unpack((const struct kvr_block_q6_k *)(const void *)rows[i] + b, q);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 8; g++)
                for (int j = 0; j < 4; j++) {
                    const int8_t *e = q + 128 * h + 4 * g + j;
                    unsigned q0 = (unsigned)(e[0] + 32), q1 = (unsigned)(e[32] + 32);
                    unsigned q2 = (unsigned)(e[64] + 32), q3 = (unsigned)(e[96] + 32);
                    size_t at = 4 * (size_t)i + (size_t)j;
                    lu[32 * (16 * h + g) + at] = (uint8_t)(q0 | (q3 & 3u) << 6);
                    lu[32 * (16 * h + 8 + g) + at] = (uint8_t)(q1 | (q3 >> 2 & 3u) << 6);
                    lu[32 * (32 + 8 * h + g) + at] = (uint8_t)(q2 | (q3 >> 4) << 6);
                }
    }
}

/* The K-quant unit (kernels.h) of tile 2p + k into its pair's chunk: every field of the
 * block, in order, interleaved by row (into `lu`), then each 32-byte slot to its place in the
 * chunk (Q6_K's quant slots in reading order first). */
static void pack_unit_k(const struct kvr_matrix *w, const uint8_t *const rows[KVR_PACK_ROWS],
                        int64_t b, int k, uint8_t *chunk)
{
    _Static_assert(KVR_PACK_UNIT_Q6_K >= KVR_PACK_UNIT_Q5_K &&
                       KVR_PACK_UNIT_Q6_K >= KVR_PACK_UNIT_Q4_K &&
                       KVR_PACK_UNIT_Q6_K >= KVR_PACK_UNIT_IQ4_XS,
                   "lu holds the largest K-quant unit");
    uint8_t lu[KVR_PACK_UNIT_Q6_K];
    size_t unit = pack_unit(w->type);
    fill_unit_k(w, rows, b, lu);
    if (w->type == KVR_DTYPE_Q6_K)
        q6_k_abc(rows, b, lu);
    for (size_t off = 0; off < unit; off += 32) {
        size_t to = off;
        if (w->type == KVR_DTYPE_Q6_K && off < 48 * 32)
            to = 32 * (size_t)kvr_pack_q6_k_slot((int)(off / 32));
        size_t n = unit - off < 32 ? unit - off : 32;
        memcpy(chunk + kvr_pack_kq_at(unit, k, to), lu + off, n);
    }
}

/* Plain C: packing runs once per matrix, and the layout (kernels.h) is kernel-independent. */
void kvr_matrix_pack(const struct kvr_matrix *w, void *dst)
{
    size_t unit = pack_unit(w->type);
    if (!unit)
        abort(); /* callers check kvr_matrix_pack_bytes first */
    int is_q = w->type == KVR_DTYPE_Q8_0 || w->type == KVR_DTYPE_Q4_0;
    int64_t nb = w->n_in / kvr_dtype_traits(w->type)->block_elems;
    int64_t n_tiles = pack_tiles(w->n_out);
    uint8_t *out = dst;
    for (int64_t t = 0; t < n_tiles; t++) {
        const uint8_t *rows[KVR_PACK_ROWS];
        for (int i = 0; i < KVR_PACK_ROWS; i++) {
            int64_t o = t * KVR_PACK_ROWS + i < w->n_out ? t * KVR_PACK_ROWS + i : w->n_out - 1;
            rows[i] = (const uint8_t *)w->data + (size_t)o * w->row_bytes;
        }
        for (int64_t b = 0; b < nb; b++) {
            if (is_q)
                pack_unit_q(w, rows, b, out + kvr_pack_unit_at(t, b, nb, unit));
            else
                pack_unit_k(w, rows, b, (int)(t % 2),
                            out + kvr_pack_unit_at(t - t % 2, b, nb, unit));
        }
    }
    size_t used = (size_t)n_tiles * (size_t)nb * unit;
    memset(out + used, 0, kvr_matrix_pack_bytes(w) - used);
}

void kvr_matrix_get_row(const struct kvr_matrix *w, int64_t row, float *dst)
{
    const struct kvr_dtype_traits *t = kvr_dtype_traits(w->type);
    t->to_float((const char *)w->data + (size_t)row * w->row_bytes, dst, w->n_in);
}
