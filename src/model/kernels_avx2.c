/* kernels_avx2.c - AVX2 + FMA + F16C kernels (this file is compiled with -mavx2 -mfma -mf16c;
 * matmul.c calls it only after kvr_kernels_init has checked the CPU).
 *
 * Every kernel reproduces the reference operation sequence of dtype.c bit for bit, so the
 * result of an output element never depends on which path, tile or slice computed it:
 *
 *   Q8_0 / Q4_0 / Q4_K / Q6_K: the integer dot of each block is exact (any summation order
 *   gives the same int32), then it goes through the same cvt / mul / fma as the reference,
 *   one block after the other, each (o, r) pair in its own SIMD lane.
 *   F32 / F16 / BF16: each (o, r) pair has its own 8-lane accumulator, reduced by the same
 *   fixed tree as the reference, then the scalar tail.
 *
 * Integer paths and their ranges (all exact, no saturation):
 *   _mm256_maddubs_epi16(u8 a, s8 b) sums two u8*s8 products into a saturating int16.
 *   Q4_0: a = q in 0..15, b = x in [-127,127]: pairs <= 3810, eight of them summed in int16
 *         stay <= 30480 < 32767. The -8 offset is removed by subtracting 8*sum(x) (s8).
 *   Q8_0: a = |w| <= 128, b = sign(x, w): pairs <= 2*128*127 = 32512, widened at once.
 *   Q4_K: a = q in 0..15, pairs <= 3810, widened by _mm256_madd_epi16 with the 6-bit scale.
 *   Q6_K: a = q in 0..63, pairs <= 16002, widened by madd with the int8 scale; the -32
 *         offset comes off through the Q8_K block sums.
 *
 * Paths. Output rows go in tiles of 8 (one per 32-bit lane); a ragged last tile repeats its
 * last row in the spare lanes and stores only the valid ones.
 *   GEMV (n_rows < GEMM_MIN_ROWS, i.e. decode): weights are read in place. Q8_0/Q4_0 put
 *   rows k and k+4 of a tile in the two 128-bit halves of a vector and reduce the tile with
 *   a short transpose-and-add tree; K-quants reduce per-row int32 partials the same way.
 *   GEMM (more rows, i.e. prefill): Q8_0/Q4_0 unpack and transpose a tile into a stack
 *   buffer (per K chunk of KB blocks) so that each 32-byte vector holds 4 consecutive
 *   quants of each of the 8 rows; 4 bytes of an activation row are broadcast to all lanes,
 *   so one maddubs serves 8 outputs and the accumulator lanes are outputs (no horizontal
 *   sums). K-quants unpack a tile's super-block once for all activation rows. Between K
 *   chunks / super-blocks the running sums wait in y (exact f32 values).
 *   Packed GEMM (w->packed set, see kvr_matrix_pack and kernels.h): Q8_0/Q4_0 read that
 *   transposed layout straight from the caller's copy, made once per matrix, instead of
 *   building it per call; same products and float steps, so the same bits.
 *   Every path prefetches the next tile (see next_tile). */
#include "model/kernels.h"

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

#define ALWAYS_INLINE inline __attribute__((always_inline))
/* Fixed-trip loops over tile rows and groups must be unrolled so their arrays of vectors
 * live in registers; -O2 does not do it by itself. */
#define UNROLL _Pragma("GCC unroll 16")
/* An empty asm that "modifies" v: it pins a running sum in a register in program order, so
 * the compiler does not rebalance a chain of integer adds into a tree that needs every
 * product live at once (and spills them). Integer sums are exact, so this is only speed. */
#define KEEP(v) __asm__("" : "+x"(v))

enum {
    OT = 8,             /* output rows per tile (one per dword / float lane) */
    RT = 4,             /* activation rows per tile */
    KB = 64,            /* blocks per K chunk of the repacked GEMM tile (16 KiB per buffer) */
    GEMM_MIN_ROWS = 4,  /* from this many rows on, Q8_0/Q4_0 use the repacked GEMM */
    GEMV_RT = 3,        /* activation rows per GEMV tile (below GEMM_MIN_ROWS) */
    PACKED_MIN_ROWS = 4, /* from this many rows on, packed Q8_0/Q4_0 weights are used */
    Q8_0_PF = 16,       /* Q8_0 GEMV: blocks each row is prefetched ahead (measured best) */
    F_OT = 4,           /* f32 family: output rows per tile */
    F_RT = 3,           /* f32 family: activation rows per tile */
};

/* ---------------------------------------------------------------------------------------
 * Helpers
 * --------------------------------------------------------------------------------------- */

static ALWAYS_INLINE int32_t load_i32(const void *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE float load_f32(const void *p)
{
    float v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE uint16_t load_u16(const void *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The fp16 field at byte offset `off` of each of the 8 rows, widened to f32. */
static ALWAYS_INLINE __m256 load_f16x8(const uint8_t *const rows[OT], size_t off)
{
    __m128i h = _mm_cvtsi32_si128(load_u16(rows[0] + off));
    h = _mm_insert_epi16(h, load_u16(rows[1] + off), 1);
    h = _mm_insert_epi16(h, load_u16(rows[2] + off), 2);
    h = _mm_insert_epi16(h, load_u16(rows[3] + off), 3);
    h = _mm_insert_epi16(h, load_u16(rows[4] + off), 4);
    h = _mm_insert_epi16(h, load_u16(rows[5] + off), 5);
    h = _mm_insert_epi16(h, load_u16(rows[6] + off), 6);
    h = _mm_insert_epi16(h, load_u16(rows[7] + off), 7);
    return _mm256_cvtph_ps(h);
}

/* 8 vectors of 8 int32 -> one vector whose lane i is the (exact) sum of v[i]'s lanes. */
static ALWAYS_INLINE __m256i reduce8_epi32(const __m256i v[8])
{
    __m256i t[4], u[2];
    UNROLL
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    UNROLL
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm256_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20),
                            _mm256_permute2x128_si256(u[0], u[1], 0x31));
}

/* Q4_0 GEMV tree. v[k] holds, as 16 int16, row k's partial sums in its low 128-bit lane
 * and row k+4's in its high one (each a sum of 4 products, |.| <= 7620). Two levels of
 * transpose-and-add in int16 (|.| <= 30480, exact), then a byte shuffle pairs each row's
 * two remaining partials so one madd widens and adds them: lane i = row i's total. */
static ALWAYS_INLINE __m256i reduce_pairs_q4(const __m256i v[4])
{
    const __m256i pair = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                          0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    __m256i t0 = _mm256_add_epi16(_mm256_unpacklo_epi16(v[0], v[1]), _mm256_unpackhi_epi16(v[0], v[1]));
    __m256i t1 = _mm256_add_epi16(_mm256_unpacklo_epi16(v[2], v[3]), _mm256_unpackhi_epi16(v[2], v[3]));
    __m256i u = _mm256_add_epi16(_mm256_unpacklo_epi32(t0, t1), _mm256_unpackhi_epi32(t0, t1));
    return _mm256_madd_epi16(_mm256_shuffle_epi8(u, pair), _mm256_set1_epi16(1));
}

/* Q8_0 GEMV tree. v[k] holds 4 int32 partial sums of row k in its low 128-bit lane and of
 * row k+4 in its high one; two levels of transpose-and-add leave lane i = row i's total. */
static ALWAYS_INLINE __m256i reduce_pairs_q8(const __m256i v[4])
{
    __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
    __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
}

/* In-place transpose of an 8x8 matrix of dwords (v[i] lane j -> v[j] lane i). */
static ALWAYS_INLINE void transpose8_epi32(__m256i v[8])
{
    __m256i t[8], s[8];
    UNROLL
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    UNROLL
    for (int h = 0; h < 2; h++) {
        s[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h + 0], t[4 * h + 2]);
        s[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h + 0], t[4 * h + 2]);
        s[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        s[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    UNROLL
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x20);
        v[j + 4] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x31);
    }
}

/* The 32 quants of a Q4_0 block as bytes 0..15 in element order (low nibbles = elements
 * 0..15, high nibbles = 16..31). */
static ALWAYS_INLINE __m256i unpack_q4_0(const uint8_t *qs)
{
    /* both halves get the 16 bytes; the upper one is shifted down a nibble per byte */
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* Software prefetch of the next tile. A tile's rows are contiguous in memory but each is
 * short (a 2048-wide Q4_0 row is 18 cache lines), too short for the hardware prefetcher to
 * ramp up on 8 interleaved streams. So while a tile computes, the kernels stream the next
 * tile's bytes in sequentially: step k of n prefetches the k-th n-th of it. */
static ALWAYS_INLINE const uint8_t *next_tile(const struct kvr_matrix *w, int64_t o0, int tile)
{
    if (o0 + 2 * tile > w->n_out)
        return NULL;
    return (const uint8_t *)w->data + (size_t)(o0 + tile) * w->row_bytes;
}

static ALWAYS_INLINE void prefetch_span(const uint8_t *p, size_t bytes)
{
    for (size_t k = 0; k < bytes; k += 64)
        _mm_prefetch((const char *)p + k, _MM_HINT_T0);
}

/* Rows o0 .. o0+7 of w, repeating the last valid row past o_end (its lanes are computed and
 * dropped, so every lane runs the same code whatever the tile's fill). */
static ALWAYS_INLINE int tile_rows(const struct kvr_matrix *w, int64_t o0, int64_t o_end,
                                   const uint8_t *rows[OT])
{
    int n_valid = o_end - o0 < OT ? (int)(o_end - o0) : OT;
    UNROLL
    for (int i = 0; i < OT; i++) {
        int64_t o = o0 + (i < n_valid ? i : n_valid - 1);
        rows[i] = (const uint8_t *)w->data + (size_t)o * w->row_bytes;
    }
    return n_valid;
}

static ALWAYS_INLINE __m256i lane_mask(int n_valid)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n_valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static ALWAYS_INLINE void store_tile(float *y, __m256 v, int n_valid)
{
    if (n_valid == OT)
        _mm256_storeu_ps(y, v);
    else
        _mm256_maskstore_ps(y, lane_mask(n_valid), v);
}

static ALWAYS_INLINE __m256 load_tile(const float *y, int n_valid)
{
    if (n_valid == OT)
        return _mm256_loadu_ps(y);
    return _mm256_maskload_ps(y, lane_mask(n_valid));
}

/* ---------------------------------------------------------------------------------------
 * Activation quantizers (bit-identical to the reference ones in dtype.c / matmul.c)
 * --------------------------------------------------------------------------------------- */

static ALWAYS_INLINE float hmax_ps(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static ALWAYS_INLINE int32_t hsum_epi32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* Quantize 32 floats with scale 1/id into 32 int8 (round to nearest even, like nearbyintf
 * in the default rounding mode); returns the 32 quants and their sum. */
static ALWAYS_INLINE __m256i quantize32(const float *x, __m256 id, int32_t *sum)
{
    __m256i q[4];
    UNROLL
    for (int k = 0; k < 4; k++) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), id);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[k] = _mm256_cvtps_epi32(v);
    }
    *sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    /* packs interleave the 128-bit halves; the permute puts the 8 dwords back in order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static ALWAYS_INLINE float amax32(const float *x, int n)
{
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < n; k += 8)
        m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
    return hmax_ps(m);
}

static void quantize_row_q8_0_act(const float *x, void *dst, int64_t n)
{
    int64_t nb = n / KVR_QK;
    struct kvr_block_q8_0 *blk = dst;
    uint8_t *pad = (uint8_t *)dst + (size_t)nb * sizeof *blk;
    struct kvr_q8_0_ext *ext = (void *)((uint8_t *)dst + kvr_q8_0_ext_offset(nb));
    memset(pad, 0, (size_t)((uint8_t *)ext - pad));
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * KVR_QK;
        float d = amax32(xb, KVR_QK) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        int32_t sum;
        __m256i q = quantize32(xb, _mm256_set1_ps(id), &sum);
        memcpy(&blk[b].d, &dh, sizeof dh);
        _mm256_storeu_si256((__m256i *)blk[b].qs, q);
        struct kvr_q8_0_ext e = {_cvtsh_ss(dh), 8 * sum};
        memcpy(&ext[b], &e, sizeof e);
    }
}

static void quantize_row_q8_k(const float *x, void *dst, int64_t n)
{
    struct kvr_block_q8_k *blk = dst;
    for (int64_t b = 0; b < n / KVR_QK_K; b++) {
        const float *xb = x + b * KVR_QK_K;
        float d = amax32(xb, KVR_QK_K) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        blk[b].d = d;
        for (int k = 0; k < KVR_QK_K / 32; k++) {
            int32_t sum;
            __m256i q = quantize32(xb + 32 * k, _mm256_set1_ps(id), &sum);
            _mm256_storeu_si256((__m256i *)(blk[b].qs + 32 * k), q);
            /* the two 16-element sums of this 32: widen, pair-add, fold within each half */
            __m256i w = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)),
                                          _mm256_set1_epi16(1));
            __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
            lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4E));
            lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0xB1));
            blk[b].bsums[2 * k] = (int16_t)_mm_cvtsi128_si32(lo);
            blk[b].bsums[2 * k + 1] = (int16_t)(sum - _mm_cvtsi128_si32(lo));
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * Q4_0 and Q8_0 x Q8_0 activations
 * --------------------------------------------------------------------------------------- */

struct act {
    const uint8_t *row[RT];              /* Q8_0 blocks of each activation row */
    const struct kvr_q8_0_ext *ext[RT];  /* its per-block extension */
};

static ALWAYS_INLINE void act_rows(const void *xq, size_t stride, int64_t nb, int64_t r0,
                                   int nr, struct act *a)
{
    for (int r = 0; r < RT; r++) { /* slots past nr repeat the last row, never read */
        a->row[r] = (const uint8_t *)xq + (size_t)(r0 + (r < nr ? r : nr - 1)) * stride;
        a->ext[r] = (const void *)(a->row[r] + kvr_q8_0_ext_offset(nb));
    }
}

/* GEMV tile: 8 weight rows x nr (<= RT) activation rows, all blocks, weights read in place.
 * IS_Q4: Q4_0 weights (18-byte blocks) else Q8_0 (34-byte blocks). */
static ALWAYS_INLINE void gemv_q_tile(const uint8_t *const rows[OT], int64_t nb, const struct act *a,
                                      int nr, int is_q4, __m256 acc[RT], const uint8_t *pf)
{
    const size_t wb = is_q4 ? sizeof(struct kvr_block_q4_0) : sizeof(struct kvr_block_q8_0);
    const __m256i ones = _mm256_set1_epi16(1);
    UNROLL
    for (int r = 0; r < nr; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        /* Rows k and k+4 share a vector: elements 0..15 in lo[k] (Q4_0: the low nibbles),
         * elements 16..31 in hi[k]; the activation halves are broadcast to match. */
        __m256i lo[4], hi[4];
        size_t off = (size_t)b * wb;
        if (is_q4) {
            const __m256i low = _mm256_set1_epi8(0x0F);
            UNROLL
            for (int k = 0; k < 4; k++) {
                __m256i v = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rows[k] + off + 2))),
                    _mm_loadu_si128((const __m128i *)(rows[k + 4] + off + 2)), 1);
                lo[k] = _mm256_and_si256(v, low);
                hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
        } else {
            UNROLL
            for (int k = 0; k < 4; k++) {
                const uint8_t *p0 = rows[k] + off + 2, *p1 = rows[k + 4] + off + 2;
                lo[k] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                                _mm_loadu_si128((const __m128i *)p1), 1);
                hi[k] = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + 16))),
                    _mm_loadu_si128((const __m128i *)(p1 + 16)), 1);
            }
        }
        if (is_q4) {
            if (pf)
                prefetch_span(pf + off * OT, wb * OT);
        } else {
            /* Q8_0 tiles (17 KiB for 2048-wide rows) are too big to stage a whole next tile
             * in L1 next to the current one: prefetch each row Q8_0_PF blocks ahead instead,
             * running on into the next tile's rows at the end. */
            UNROLL
            for (int i = 0; i < OT; i++) {
                const uint8_t *p = b + Q8_0_PF < nb ? rows[i] + off + Q8_0_PF * wb
                                 : pf ? pf + ((size_t)i * nb + (size_t)(b + Q8_0_PF - nb)) * wb
                                      : NULL;
                if (p)
                    _mm_prefetch((const char *)p, _MM_HINT_T0);
            }
        }
        __m256 dw = load_f16x8(rows, off);
        UNROLL
        for (int r = 0; r < nr; r++) {
            const uint8_t *xb = a->row[r] + (size_t)b * sizeof(struct kvr_block_q8_0) + 2;
            __m256i isum;
            if (is_q4) {
                __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xb));
                __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xb + 16)));
                __m256i v[4];
                UNROLL
                for (int k = 0; k < 4; k++)
                    v[k] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[k], xlo),
                                            _mm256_maddubs_epi16(hi[k], xhi));
                isum = _mm256_sub_epi32(reduce_pairs_q4(v), _mm256_set1_epi32(a->ext[r][b].s8));
            } else {
                __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xb));
                __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xb + 16)));
                __m256i v[4];
                UNROLL
                for (int k = 0; k < 4; k++) { /* |w| as u8 (128 for -128) times sign(x, w) */
                    __m256i pl = _mm256_maddubs_epi16(_mm256_sign_epi8(lo[k], lo[k]),
                                                      _mm256_sign_epi8(xlo, lo[k]));
                    __m256i ph = _mm256_maddubs_epi16(_mm256_sign_epi8(hi[k], hi[k]),
                                                      _mm256_sign_epi8(xhi, hi[k]));
                    v[k] = _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones));
                }
                isum = reduce_pairs_q8(v);
            }
            __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(a->ext[r][b].d));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[r]);
        }
    }
}

static ALWAYS_INLINE void gemv_q(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                                 int64_t n_rows, float *y, int64_t ldy, int64_t o_begin,
                                 int64_t o_end, int is_q4)
{
    int64_t nb = w->n_in / KVR_QK;
    for (int64_t o0 = o_begin; o0 < o_end; o0 += OT) {
        const uint8_t *rows[OT];
        int n_valid = tile_rows(w, o0, o_end, rows);
        const uint8_t *pf = next_tile(w, o0, OT);
        for (int64_t r0 = 0; r0 < n_rows; r0 += GEMV_RT) {
            int nr = n_rows - r0 < GEMV_RT ? (int)(n_rows - r0) : GEMV_RT;
            struct act a;
            __m256 acc[RT] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                              _mm256_setzero_ps()};
            act_rows(xq, x_stride, nb, r0, nr, &a);
            switch (nr) { /* constant nr so the tile's accumulators stay in registers */
            case 1: gemv_q_tile(rows, nb, &a, 1, is_q4, acc, pf); break;
            case 2: gemv_q_tile(rows, nb, &a, 2, is_q4, acc, pf); break;
            default: gemv_q_tile(rows, nb, &a, 3, is_q4, acc, pf); break;
            }
            UNROLL
            for (int r = 0; r < nr; r++)
                store_tile(y + (r0 + r) * ldy + o0, acc[r], n_valid);
        }
    }
}

/* Repack blocks [b0, b0+kn) of 8 weight rows: wq[b][g] lane i = quants 4g..4g+3 of row i
 * (Q4_0: q in 0..15; Q8_0: |w|), ws[b][g] likewise the signed Q8_0 weights (Q8_0 only),
 * dw[b] lane i = row i's scale. */
static ALWAYS_INLINE void repack_q(const uint8_t *const rows[OT], int64_t b0, int kn, int is_q4,
                                   __m256i *wq, __m256i *ws, __m256 *dw)
{
    const size_t wb = is_q4 ? sizeof(struct kvr_block_q4_0) : sizeof(struct kvr_block_q8_0);
    for (int b = 0; b < kn; b++) {
        size_t off = (size_t)(b0 + b) * wb;
        __m256i v[OT];
        UNROLL
        for (int i = 0; i < OT; i++) {
            if (is_q4)
                v[i] = unpack_q4_0(rows[i] + off + 2);
            else
                v[i] = _mm256_loadu_si256((const __m256i *)(rows[i] + off + 2));
        }
        transpose8_epi32(v);
        UNROLL
        for (int g = 0; g < 8; g++) {
            if (is_q4) {
                _mm256_store_si256(&wq[8 * b + g], v[g]);
            } else {
                _mm256_store_si256(&ws[8 * b + g], v[g]);
                _mm256_store_si256(&wq[8 * b + g], _mm256_sign_epi8(v[g], v[g]));
            }
        }
        dw[b] = load_f16x8(rows, off);
    }
}

/* GEMM micro-kernel: the repacked 8-row tile (kn blocks) x nr activation rows. */
static ALWAYS_INLINE void gemm_q_tile(const __m256i *wq, const __m256i *ws, const __m256 *dw,
                                      int64_t b0, int kn, const struct act *a, int nr, int is_q4,
                                      __m256 acc[RT])
{
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < kn; b++) {
        size_t xoff = (size_t)(b0 + b) * sizeof(struct kvr_block_q8_0) + 2;
        __m256i isum[RT];
        UNROLL
        for (int g = 0; g < 8; g++) {
            __m256i wg = _mm256_load_si256(&wq[8 * b + g]);
            __m256i sg = is_q4 ? wg : _mm256_load_si256(&ws[8 * b + g]);
            UNROLL
            for (int r = 0; r < nr; r++) {
                __m256i xb = _mm256_set1_epi32(load_i32(a->row[r] + xoff + 4 * g));
                if (is_q4) {
                    __m256i p = _mm256_maddubs_epi16(wg, xb);
                    isum[r] = g ? _mm256_add_epi16(isum[r], p) : p; /* <= 30480: exact */
                    KEEP(isum[r]);
                } else {
                    __m256i p = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(wg, _mm256_sign_epi8(xb, sg)), ones);
                    isum[r] = g ? _mm256_add_epi32(isum[r], p) : p;
                    KEEP(isum[r]);
                }
            }
        }
        __m256 dwb = dw[b];
        UNROLL
        for (int r = 0; r < nr; r++) {
            __m256i s = isum[r];
            if (is_q4)
                s = _mm256_sub_epi32(_mm256_madd_epi16(s, ones),
                                     _mm256_set1_epi32(a->ext[r][b0 + b].s8));
            __m256 d = _mm256_mul_ps(dwb, _mm256_set1_ps(a->ext[r][b0 + b].d));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[r]);
        }
    }
}

static ALWAYS_INLINE void gemm_q(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                                 int64_t n_rows, float *y, int64_t ldy, int64_t o_begin,
                                 int64_t o_end, int is_q4)
{
    _Alignas(32) __m256i wq[KB * 8];
    _Alignas(32) __m256i ws[KB * 8]; /* Q8_0 only */
    _Alignas(32) __m256 dw[KB];
    int64_t nb = w->n_in / KVR_QK;
    for (int64_t o0 = o_begin; o0 < o_end; o0 += OT) {
        const uint8_t *rows[OT];
        int n_valid = tile_rows(w, o0, o_end, rows);
        for (int64_t b0 = 0; b0 < nb; b0 += KB) {
            int kn = nb - b0 < KB ? (int)(nb - b0) : KB;
            repack_q(rows, b0, kn, is_q4, wq, ws, dw);
            /* Partial sums wait in y between K chunks: exact f32 values, so reloading them
             * changes nothing. */
            for (int64_t r0 = 0; r0 < n_rows; r0 += RT) {
                int nr = n_rows - r0 < RT ? (int)(n_rows - r0) : RT;
                struct act a;
                __m256 acc[RT] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                                  _mm256_setzero_ps()};
                act_rows(xq, x_stride, nb, r0, nr, &a);
                if (b0)
                    for (int r = 0; r < nr; r++)
                        acc[r] = load_tile(y + (r0 + r) * ldy + o0, n_valid);
                switch (nr) {
                case 1: gemm_q_tile(wq, ws, dw, b0, kn, &a, 1, is_q4, acc); break;
                case 2: gemm_q_tile(wq, ws, dw, b0, kn, &a, 2, is_q4, acc); break;
                case 3: gemm_q_tile(wq, ws, dw, b0, kn, &a, 3, is_q4, acc); break;
                default: gemm_q_tile(wq, ws, dw, b0, kn, &a, 4, is_q4, acc); break;
                }
                UNROLL
                for (int r = 0; r < nr; r++)
                    store_tile(y + (r0 + r) * ldy + o0, acc[r], n_valid);
            }
        }
    }
}

/* GEMM micro-kernel on pre-packed weights (layout in kernels.h): kn units from u, the same
 * integer products and float steps as gemm_q_tile. Q8_0 takes |w| here (one vpsignb per
 * vector, shared by the nr rows) instead of storing it, which keeps the packed copy at the
 * size of the weights; Q4_0 splits each stored vector into its two nibble vectors. */
static ALWAYS_INLINE void gemm_p_tile(const uint8_t *u, int64_t b0, int kn, const struct act *a,
                                      int nr, int is_q4, __m256 acc[RT])
{
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const size_t unit = is_q4 ? KVR_PACK_UNIT_Q4_0 : KVR_PACK_UNIT_Q8_0;
    for (int b = 0; b < kn; b++, u += unit) {
        size_t xoff = (size_t)(b0 + b) * sizeof(struct kvr_block_q8_0) + 2;
        const __m256i *q = (const __m256i *)(u + 32);
        __m256i isum[RT];
        UNROLL
        for (int g = 0; g < 8; g++) {
            __m256i wg, sg;
            if (is_q4) {
                __m256i raw = _mm256_load_si256(&q[g % 4]);
                wg = g < 4 ? _mm256_and_si256(raw, low)
                           : _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                sg = wg;
            } else {
                sg = _mm256_load_si256(&q[g]);
                wg = _mm256_sign_epi8(sg, sg);
            }
            /* vector g holds elements 4g..4g+3 in both types (Q4_0: the high nibbles of
             * stored vector g - 4 are elements 16 + 4(g - 4) = 4g) */
            int xg = 4 * g;
            UNROLL
            for (int r = 0; r < nr; r++) {
                __m256i xb = _mm256_set1_epi32(load_i32(a->row[r] + xoff + xg));
                if (is_q4) {
                    __m256i p = _mm256_maddubs_epi16(wg, xb);
                    isum[r] = g ? _mm256_add_epi16(isum[r], p) : p; /* <= 30480: exact */
                    KEEP(isum[r]);
                } else {
                    __m256i p = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(wg, _mm256_sign_epi8(xb, sg)), ones);
                    isum[r] = g ? _mm256_add_epi32(isum[r], p) : p;
                    KEEP(isum[r]);
                }
            }
        }
        __m256 dwb = _mm256_load_ps((const float *)u);
        UNROLL
        for (int r = 0; r < nr; r++) {
            __m256i s = isum[r];
            if (is_q4)
                s = _mm256_sub_epi32(_mm256_madd_epi16(s, ones),
                                     _mm256_set1_epi32(a->ext[r][b0 + b].s8));
            __m256 d = _mm256_mul_ps(dwb, _mm256_set1_ps(a->ext[r][b0 + b].d));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[r]);
        }
    }
}

/* GEMM over pre-packed weights; o_begin is a multiple of OT (the caller checks). Same
 * K chunking as gemm_q, so a chunk of the tile stays in L1 for all activation rows. */
static ALWAYS_INLINE void gemm_p(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                                 int64_t n_rows, float *y, int64_t ldy, int64_t o_begin,
                                 int64_t o_end, int is_q4)
{
    const size_t unit = is_q4 ? KVR_PACK_UNIT_Q4_0 : KVR_PACK_UNIT_Q8_0;
    int64_t nb = w->n_in / KVR_QK;
    for (int64_t o0 = o_begin; o0 < o_end; o0 += OT) {
        int n_valid = o_end - o0 < OT ? (int)(o_end - o0) : OT;
        const uint8_t *tile = (const uint8_t *)w->packed + (size_t)(o0 / OT) * (size_t)nb * unit;
        for (int64_t b0 = 0; b0 < nb; b0 += KB) {
            int kn = nb - b0 < KB ? (int)(nb - b0) : KB;
            const uint8_t *u = tile + (size_t)b0 * unit;
            for (int64_t r0 = 0; r0 < n_rows; r0 += RT) {
                int nr = n_rows - r0 < RT ? (int)(n_rows - r0) : RT;
                struct act a;
                __m256 acc[RT] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                                  _mm256_setzero_ps()};
                act_rows(xq, x_stride, nb, r0, nr, &a);
                if (b0)
                    for (int r = 0; r < nr; r++)
                        acc[r] = load_tile(y + (r0 + r) * ldy + o0, n_valid);
                switch (nr) {
                case 1: gemm_p_tile(u, b0, kn, &a, 1, is_q4, acc); break;
                case 2: gemm_p_tile(u, b0, kn, &a, 2, is_q4, acc); break;
                case 3: gemm_p_tile(u, b0, kn, &a, 3, is_q4, acc); break;
                default: gemm_p_tile(u, b0, kn, &a, 4, is_q4, acc); break;
                }
                UNROLL
                for (int r = 0; r < nr; r++)
                    store_tile(y + (r0 + r) * ldy + o0, acc[r], n_valid);
            }
        }
    }
}

/* The packed layout is tiled from row 0, so only slices starting on a tile can use it; the
 * packed copy must be 32-byte aligned (kvr_matrix_pack's contract) for the aligned loads. */
static ALWAYS_INLINE int use_packed(const struct kvr_matrix *w, int64_t n_rows, int64_t o_begin)
{
    return w->packed && n_rows >= PACKED_MIN_ROWS && o_begin % OT == 0 &&
           ((uintptr_t)w->packed & 31) == 0;
}

static void matmul_q4_0(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    if (use_packed(w, n_rows, o_begin))
        gemm_p(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, 1);
    else if (n_rows >= GEMM_MIN_ROWS)
        gemm_q(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, 1);
    else
        gemv_q(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, 1);
}

static void matmul_q8_0(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    if (use_packed(w, n_rows, o_begin))
        gemm_p(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, 0);
    else if (n_rows >= GEMM_MIN_ROWS)
        gemm_q(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, 0);
    else
        gemv_q(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, 0);
}

/* ---------------------------------------------------------------------------------------
 * K-quants x Q8_K. A tile of 8 weight rows is unpacked per super-block into a small buffer
 * (quants as bytes in element order, plus per-row scale vectors), then dotted with up to RT
 * activation rows; each row's int32 partials are reduced across the tile with reduce8.
 * --------------------------------------------------------------------------------------- */

/* Q4_K scales of one super-block: the 8 six-bit scales as int16 in both 128-bit lanes
 * (`sc_both`, for q4_k_pick), and the 8 mins each repeated twice to line up with the 16
 * Q8_K block sums (`mins`). The fields are taken 4 at a time in 32-bit words: bits 6-7 of
 * bytes 0..7 become bits 4-5 of the upper four scales and mins (layout in dtype.c). */
static ALWAYS_INLINE void q4_k_scales(const struct kvr_block_q4_k *blk, __m256i *sc_both,
                                      __m256i *mins)
{
    uint32_t u[3];
    memcpy(u, blk->scales, sizeof u);
    uint64_t sc8 = (u[0] & 0x3F3F3F3Fu) |
                   (uint64_t)((u[2] & 0x0F0F0F0Fu) | ((u[0] >> 2) & 0x30303030u)) << 32;
    uint64_t mn8 = (u[1] & 0x3F3F3F3Fu) |
                   (uint64_t)(((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 2) & 0x30303030u)) << 32;
    __m128i sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8));
    __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8));
    *sc_both = _mm256_broadcastsi128_si256(sc16);
    _mm256_storeu_si256(mins, _mm256_set_m128i(_mm_unpackhi_epi16(mn16, mn16),
                                               _mm_unpacklo_epi16(mn16, mn16)));
}

/* pshufb control broadcasting int16 lane j of each 128-bit half */
static ALWAYS_INLINE __m256i q4_k_pick(int j)
{
    return _mm256_set1_epi16((short)(0x0100 + 0x0202 * j));
}

/* Q6_K scales: all 16 as int16 times 32 (`aux`, for the bsum term), and the two 128-bit
 * halves of the int16 scales broadcast (`halves`, for q6_k_pick). */
static ALWAYS_INLINE void q6_k_scales(const struct kvr_block_q6_k *blk, __m256i *aux,
                                      __m256i halves[2])
{
    __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->scales));
    _mm256_storeu_si256(aux, _mm256_slli_epi16(s16, 5));
    halves[0] = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(s16));
    halves[1] = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(s16, 1));
}

/* pshufb control for 32-quant vector 4h+k: scale 8h+2k in the low lane, 8h+2k+1 in the high */
static ALWAYS_INLINE __m256i q6_k_pick(int k)
{
    return _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * k)),
                            _mm_set1_epi16((short)(0x0100 + 0x0404 * k)));
}

/* The 128 quants of half h of a Q6_K super-block as bytes 0..63, in element order. */
static ALWAYS_INLINE void q6_k_quants(const struct kvr_block_q6_k *blk, int h, __m256i e[4])
{
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h));
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h + 32));
    __m256i hb = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * h));
    e[0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
    e[1] = _mm256_or_si256(_mm256_and_si256(l1, low),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), two), 4));
    e[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), two), 4));
    e[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), two), 4));
}

struct kq_tile {
    _Alignas(32) uint8_t q[OT][KVR_QK_K]; /* quants 0..15 (Q4_K) or 0..63 (Q6_K) */
    _Alignas(32) int16_t sc[OT][8][16];   /* madd factor for each 32-quant vector j */
    _Alignas(32) int16_t aux[OT][16];     /* Q4_K: min of each bsum; Q6_K: 32 * scale */
};

static ALWAYS_INLINE void unpack_q4_k(const uint8_t *const rows[OT], int64_t sb, struct kq_tile *t,
                                      __m256 *dw, __m256 *dmin)
{
    const __m256i low = _mm256_set1_epi8(0x0F);
    size_t off = (size_t)sb * sizeof(struct kvr_block_q4_k);
    UNROLL
    for (int i = 0; i < OT; i++) {
        const struct kvr_block_q4_k *blk = (const void *)(rows[i] + off);
        UNROLL
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * c));
            _mm256_store_si256((__m256i *)&t->q[i][64 * c], _mm256_and_si256(v, low));
            _mm256_store_si256((__m256i *)&t->q[i][64 * c + 32],
                               _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        }
        __m256i sc_both;
        q4_k_scales(blk, &sc_both, (__m256i *)t->aux[i]);
        UNROLL
        for (int j = 0; j < 8; j++) /* int16 scale j in every lane */
            _mm256_store_si256((__m256i *)t->sc[i][j], _mm256_shuffle_epi8(sc_both, q4_k_pick(j)));
    }
    *dw = load_f16x8(rows, off + offsetof(struct kvr_block_q4_k, d));
    *dmin = load_f16x8(rows, off + offsetof(struct kvr_block_q4_k, dmin));
}

static ALWAYS_INLINE void unpack_q6_k(const uint8_t *const rows[OT], int64_t sb, struct kq_tile *t,
                                      __m256 *dw)
{
    size_t off = (size_t)sb * sizeof(struct kvr_block_q6_k);
    UNROLL
    for (int i = 0; i < OT; i++) {
        const struct kvr_block_q6_k *blk = (const void *)(rows[i] + off);
        UNROLL
        for (int h = 0; h < 2; h++) {
            __m256i e[4];
            q6_k_quants(blk, h, e);
            UNROLL
            for (int k = 0; k < 4; k++)
                _mm256_store_si256((__m256i *)&t->q[i][128 * h + 32 * k], e[k]);
        }
        __m256i halves[2];
        q6_k_scales(blk, (__m256i *)t->aux[i], halves);
        UNROLL
        for (int j = 0; j < 8; j++)
            _mm256_store_si256((__m256i *)t->sc[i][j], _mm256_shuffle_epi8(halves[j / 4], q6_k_pick(j % 4)));
    }
    *dw = load_f16x8(rows, off + offsetof(struct kvr_block_q6_k, d));
}

/* One super-block of the tile against one Q8_K block: the exact integer dot of each of the
 * 8 rows (lane i), and the bsum term (Q4_K: sum of min * bsum; Q6_K: 32 * sum of scale *
 * bsum), also exact. */
static ALWAYS_INLINE void kq_dot(const struct kq_tile *t, const struct kvr_block_q8_k *x,
                                 __m256i *isum, __m256i *iaux)
{
    __m256i v[OT], m[OT];
    /* quant vector j outer, tile row inner: 8 running sums and one activation vector live */
    UNROLL
    for (int j = 0; j < 8; j++) {
        __m256i xj = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * j));
        UNROLL
        for (int i = 0; i < OT; i++) {
            __m256i p = _mm256_maddubs_epi16(_mm256_load_si256((const __m256i *)&t->q[i][32 * j]), xj);
            p = _mm256_madd_epi16(p, _mm256_load_si256((const __m256i *)t->sc[i][j]));
            v[i] = j ? _mm256_add_epi32(v[i], p) : p;
            KEEP(v[i]);
        }
    }
    *isum = reduce8_epi32(v);
    __m256i bs = _mm256_loadu_si256((const __m256i *)x->bsums);
    UNROLL
    for (int i = 0; i < OT; i++)
        m[i] = _mm256_madd_epi16(bs, _mm256_load_si256((const __m256i *)t->aux[i]));
    *iaux = reduce8_epi32(m);
}

/* The float step of a K-quant super-block, shared by the GEMV and the GEMM so both give the
 * reference's bits: acc += isum * (dw * dx), and for Q4_K acc += -imin * (dmin * dx). */
static ALWAYS_INLINE __m256 kq_accumulate(__m256 acc, __m256i isum, __m256i iaux, __m256 dw,
                                          __m256 dmin, float dx, int is_q4k)
{
    __m256 vdx = _mm256_set1_ps(dx);
    if (is_q4k) {
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, vdx), acc);
        __m256 neg_min = _mm256_xor_ps(_mm256_cvtepi32_ps(iaux), _mm256_set1_ps(-0.0f));
        return _mm256_fmadd_ps(neg_min, _mm256_mul_ps(dmin, vdx), acc);
    }
    isum = _mm256_sub_epi32(isum, iaux);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, vdx), acc);
}

/* GEMV row step: one weight row's super-block against one Q8_K block, straight from the
 * weights: 8 int32 partials of the scaled dot (v) and of the bsum term (m). */
static ALWAYS_INLINE void kq_row(const uint8_t *wblk, const struct kvr_block_q8_k *x, int is_q4k,
                                 __m256i *v, __m256i *m)
{
    __m256i s = _mm256_setzero_si256(), aux;
    if (is_q4k) {
        const struct kvr_block_q4_k *blk = (const void *)wblk;
        const __m256i low = _mm256_set1_epi8(0x0F);
        __m256i sc_both;
        q4_k_scales(blk, &sc_both, &aux);
        UNROLL
        for (int c = 0; c < 4; c++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * c));
            __m256i plo = _mm256_maddubs_epi16(_mm256_and_si256(q, low),
                                               _mm256_loadu_si256((const __m256i *)(x->qs + 64 * c)));
            __m256i phi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q, 4), low),
                                               _mm256_loadu_si256((const __m256i *)(x->qs + 64 * c + 32)));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(plo, _mm256_shuffle_epi8(sc_both, q4_k_pick(2 * c))));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(phi, _mm256_shuffle_epi8(sc_both, q4_k_pick(2 * c + 1))));
        }
    } else {
        const struct kvr_block_q6_k *blk = (const void *)wblk;
        __m256i halves[2];
        q6_k_scales(blk, &aux, halves);
        UNROLL
        for (int h = 0; h < 2; h++) {
            __m256i e[4];
            q6_k_quants(blk, h, e);
            UNROLL
            for (int k = 0; k < 4; k++) {
                __m256i p = _mm256_maddubs_epi16(
                    e[k], _mm256_loadu_si256((const __m256i *)(x->qs + 128 * h + 32 * k)));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_shuffle_epi8(halves[h], q6_k_pick(k))));
            }
        }
    }
    *v = s;
    *m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x->bsums), aux);
}

static ALWAYS_INLINE void gemv_kq(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                                  int64_t n_rows, float *y, int64_t ldy, int64_t o_begin,
                                  int64_t o_end, int is_q4k)
{
    int64_t nsb = w->n_in / KVR_QK_K;
    const size_t sbb = is_q4k ? sizeof(struct kvr_block_q4_k) : sizeof(struct kvr_block_q6_k);
    for (int64_t o0 = o_begin; o0 < o_end; o0 += OT) {
        const uint8_t *rows[OT];
        int n_valid = tile_rows(w, o0, o_end, rows);
        const uint8_t *pf = next_tile(w, o0, OT);
        for (int64_t r = 0; r < n_rows; r++) {
            const struct kvr_block_q8_k *xr =
                (const struct kvr_block_q8_k *)((const uint8_t *)xq + (size_t)r * x_stride);
            __m256 acc = _mm256_setzero_ps();
            for (int64_t sb = 0; sb < nsb; sb++) {
                size_t off = (size_t)sb * sbb;
                if (pf && r == 0)
                    prefetch_span(pf + off * OT, sbb * OT);
                __m256i v[OT], m[OT];
                UNROLL
                for (int i = 0; i < OT; i++)
                    kq_row(rows[i] + off, &xr[sb], is_q4k, &v[i], &m[i]);
                __m256i isum = reduce8_epi32(v), iaux = reduce8_epi32(m);
                __m256 dw, dmin = _mm256_setzero_ps();
                if (is_q4k) {
                    dw = load_f16x8(rows, off + offsetof(struct kvr_block_q4_k, d));
                    dmin = load_f16x8(rows, off + offsetof(struct kvr_block_q4_k, dmin));
                } else {
                    dw = load_f16x8(rows, off + offsetof(struct kvr_block_q6_k, d));
                }
                acc = kq_accumulate(acc, isum, iaux, dw, dmin, xr[sb].d, is_q4k);
            }
            store_tile(y + r * ldy + o0, acc, n_valid);
        }
    }
}

static ALWAYS_INLINE void matmul_kq(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                                    int64_t n_rows, float *y, int64_t ldy, int64_t o_begin,
                                    int64_t o_end, int is_q4k)
{
    if (n_rows < GEMM_MIN_ROWS) {
        gemv_kq(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, is_q4k);
        return;
    }
    int64_t nsb = w->n_in / KVR_QK_K;
    const size_t sbb = is_q4k ? sizeof(struct kvr_block_q4_k) : sizeof(struct kvr_block_q6_k);
    struct kq_tile t;
    for (int64_t o0 = o_begin; o0 < o_end; o0 += OT) {
        const uint8_t *rows[OT];
        int n_valid = tile_rows(w, o0, o_end, rows);
        const uint8_t *pf = next_tile(w, o0, OT);
        /* Each super-block of the tile is unpacked once and used by every activation row;
         * the rows' running sums wait in y in between (exact f32 values). */
        for (int64_t sb = 0; sb < nsb; sb++) {
            __m256 dw, dmin = _mm256_setzero_ps();
            if (pf)
                prefetch_span(pf + (size_t)sb * sbb * OT, sbb * OT);
            if (is_q4k)
                unpack_q4_k(rows, sb, &t, &dw, &dmin);
            else
                unpack_q6_k(rows, sb, &t, &dw);
            for (int64_t r = 0; r < n_rows; r++) {
                const struct kvr_block_q8_k *x =
                    (const struct kvr_block_q8_k *)((const uint8_t *)xq + (size_t)r * x_stride) + sb;
                float *yr = y + r * ldy + o0;
                __m256 acc = sb ? load_tile(yr, n_valid) : _mm256_setzero_ps();
                __m256i isum, iaux;
                kq_dot(&t, x, &isum, &iaux);
                store_tile(yr, kq_accumulate(acc, isum, iaux, dw, dmin, x->d, is_q4k), n_valid);
            }
        }
    }
}

static void matmul_q4_k(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_kq(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, 1);
}

static void matmul_q6_k(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_kq(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, 0);
}

/* ---------------------------------------------------------------------------------------
 * Q2_K, Q3_K, Q5_K, IQ4_XS x Q8_K through the same tile: every path (GEMV and GEMM) unpacks
 * a tile's super-block into struct kq_tile and dots it with each activation row (kq_dot).
 *   Q2_K: q 0..3, a scale per 16 and a min per 16 (float step with dmin, as Q4_K).
 *   Q5_K: q 0..31 (maddubs pairs <= 7874), Q4_K's scales and mins.
 *   Q3_K: q + 4 in 0..7 stored, signed scale per 16; aux = 4 * scale takes the offset off
 *         through the block sums, as Q6_K's 32 * scale does.
 *   IQ4_XS: the signed grid values (-127..113) stored; kq_dot_signed multiplies |w| by
 *         sign(x, w) (pairs <= 2 * 127 * 127 = 32258, no saturation); aux = 0.
 * --------------------------------------------------------------------------------------- */

enum kq_kind { KQ_Q2_K, KQ_Q3_K, KQ_Q5_K, KQ_IQ4_XS };

static ALWAYS_INLINE size_t kq_bytes(enum kq_kind k)
{
    switch (k) {
    case KQ_Q2_K: return sizeof(struct kvr_block_q2_k);
    case KQ_Q3_K: return sizeof(struct kvr_block_q3_k);
    case KQ_Q5_K: return sizeof(struct kvr_block_q5_k);
    default: return sizeof(struct kvr_block_iq4_xs);
    }
}

static ALWAYS_INLINE int kq_has_min(enum kq_kind k)
{
    return k == KQ_Q2_K || k == KQ_Q5_K;
}

/* Byte l of the result: 0xFF where bit `bit` of byte l of v is set. */
static ALWAYS_INLINE __m256i bit_mask8(__m256i v, int bit)
{
    const __m256i b = _mm256_set1_epi8((char)(1 << bit));
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, b), b);
}

static ALWAYS_INLINE __m256i iq4_table(void)
{
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvr_iq4_values));
}

/* madd factors of 16 int16 per-16-element scales s16: vector j gets s[2j] in its low
 * 128-bit lane and s[2j + 1] in its high one (q6_k_pick on the broadcast halves). */
static ALWAYS_INLINE void store_scales16(__m256i s16, int16_t sc[8][16])
{
    __m256i halves[2] = {_mm256_broadcastsi128_si256(_mm256_castsi256_si128(s16)),
                         _mm256_broadcastsi128_si256(_mm256_extracti128_si256(s16, 1))};
    UNROLL
    for (int j = 0; j < 8; j++)
        _mm256_store_si256((__m256i *)sc[j], _mm256_shuffle_epi8(halves[j / 4], q6_k_pick(j % 4)));
}

static ALWAYS_INLINE void unpack_kq(const uint8_t *const rows[OT], int64_t sb, enum kq_kind kind,
                                    struct kq_tile *t, __m256 *dw, __m256 *dmin)
{
    const __m256i low = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    size_t off = (size_t)sb * kq_bytes(kind);
    UNROLL
    for (int i = 0; i < OT; i++) {
        const uint8_t *p = rows[i] + off;
        if (kind == KQ_Q2_K || kind == KQ_Q3_K) {
            const uint8_t *qs = kind == KQ_Q2_K ? ((const struct kvr_block_q2_k *)(const void *)p)->qs
                                                : ((const struct kvr_block_q3_k *)(const void *)p)->qs;
            __m256i hm = _mm256_setzero_si256();
            if (kind == KQ_Q3_K)
                hm = _mm256_loadu_si256((const __m256i *)((const struct kvr_block_q3_k *)(const void *)p)->hmask);
            UNROLL
            for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
                UNROLL
                for (int j = 0; j < 4; j++) {
                    __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), three);
                    if (kind == KQ_Q3_K)
                        q = _mm256_or_si256(q, _mm256_and_si256(bit_mask8(hm, 4 * h + j),
                                                                _mm256_set1_epi8(4)));
                    _mm256_store_si256((__m256i *)&t->q[i][128 * h + 32 * j], q);
                }
            }
            if (kind == KQ_Q2_K) {
                __m128i s = _mm_loadu_si128((const __m128i *)p);
                store_scales16(_mm256_cvtepu8_epi16(_mm_and_si128(s, _mm_set1_epi8(0x0F))), t->sc[i]);
                _mm256_store_si256((__m256i *)t->aux[i],
                                   _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4),
                                                                      _mm_set1_epi8(0x0F))));
            } else {
                const struct kvr_block_q3_k *b = (const void *)p;
                _Alignas(32) int16_t s[16];
                for (int k = 0; k < 16; k++)
                    s[k] = (int16_t)kvr_q3_k_scale(b->scales, k);
                __m256i s16 = _mm256_load_si256((const __m256i *)s);
                store_scales16(s16, t->sc[i]);
                _mm256_store_si256((__m256i *)t->aux[i], _mm256_slli_epi16(s16, 2));
            }
        } else if (kind == KQ_Q5_K) {
            const struct kvr_block_q5_k *b = (const void *)p;
            __m256i qh = _mm256_loadu_si256((const __m256i *)b->qh);
            const __m256i sixteen = _mm256_set1_epi8(16);
            UNROLL
            for (int c = 0; c < 4; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * c));
                __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low),
                                             _mm256_and_si256(bit_mask8(qh, 2 * c), sixteen));
                __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                             _mm256_and_si256(bit_mask8(qh, 2 * c + 1), sixteen));
                _mm256_store_si256((__m256i *)&t->q[i][64 * c], lo);
                _mm256_store_si256((__m256i *)&t->q[i][64 * c + 32], hi);
            }
            __m256i sc_both;
            q4_k_scales((const struct kvr_block_q4_k *)(const void *)b, &sc_both, (__m256i *)t->aux[i]);
            UNROLL
            for (int j = 0; j < 8; j++)
                _mm256_store_si256((__m256i *)t->sc[i][j], _mm256_shuffle_epi8(sc_both, q4_k_pick(j)));
        } else {
            const struct kvr_block_iq4_xs *b = (const void *)p;
            UNROLL
            for (int j = 0; j < 8; j++) {
                _mm256_store_si256((__m256i *)&t->q[i][32 * j],
                                   _mm256_shuffle_epi8(iq4_table(), unpack_q4_0(b->qs + 16 * j)));
                _mm256_store_si256((__m256i *)t->sc[i][j],
                                   _mm256_set1_epi16((short)kvr_iq4_xs_scale(b, j)));
            }
            _mm256_store_si256((__m256i *)t->aux[i], _mm256_setzero_si256());
        }
    }
    if (kind == KQ_Q2_K) {
        *dw = load_f16x8(rows, off + offsetof(struct kvr_block_q2_k, d));
        *dmin = load_f16x8(rows, off + offsetof(struct kvr_block_q2_k, dmin));
    } else if (kind == KQ_Q5_K) {
        *dw = load_f16x8(rows, off + offsetof(struct kvr_block_q5_k, d));
        *dmin = load_f16x8(rows, off + offsetof(struct kvr_block_q5_k, dmin));
    } else {
        *dw = load_f16x8(rows, off + (kind == KQ_Q3_K ? offsetof(struct kvr_block_q3_k, d)
                                                      : offsetof(struct kvr_block_iq4_xs, d)));
        *dmin = _mm256_setzero_ps();
    }
}

/* kq_dot for signed stored quants (IQ4_XS): |w| * sign(x, w), then the same madd. */
static ALWAYS_INLINE void kq_dot_signed(const struct kq_tile *t, const struct kvr_block_q8_k *x,
                                        __m256i *isum)
{
    __m256i v[OT];
    UNROLL
    for (int j = 0; j < 8; j++) {
        __m256i xj = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * j));
        UNROLL
        for (int i = 0; i < OT; i++) {
            __m256i w = _mm256_load_si256((const __m256i *)&t->q[i][32 * j]);
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xj, w));
            p = _mm256_madd_epi16(p, _mm256_load_si256((const __m256i *)t->sc[i][j]));
            v[i] = j ? _mm256_add_epi32(v[i], p) : p;
            KEEP(v[i]);
        }
    }
    *isum = reduce8_epi32(v);
}

static ALWAYS_INLINE void matmul_kq2(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                                     int64_t n_rows, float *y, int64_t ldy, int64_t o_begin,
                                     int64_t o_end, enum kq_kind kind)
{
    int64_t nsb = w->n_in / KVR_QK_K;
    const size_t sbb = kq_bytes(kind);
    struct kq_tile t;
    for (int64_t o0 = o_begin; o0 < o_end; o0 += OT) {
        const uint8_t *rows[OT];
        int n_valid = tile_rows(w, o0, o_end, rows);
        const uint8_t *pf = next_tile(w, o0, OT);
        for (int64_t sb = 0; sb < nsb; sb++) {
            __m256 dw, dmin;
            if (pf)
                prefetch_span(pf + (size_t)sb * sbb * OT, sbb * OT);
            unpack_kq(rows, sb, kind, &t, &dw, &dmin);
            for (int64_t r = 0; r < n_rows; r++) {
                const struct kvr_block_q8_k *x =
                    (const struct kvr_block_q8_k *)((const uint8_t *)xq + (size_t)r * x_stride) + sb;
                float *yr = y + r * ldy + o0;
                __m256 acc = sb ? load_tile(yr, n_valid) : _mm256_setzero_ps();
                __m256i isum, iaux = _mm256_setzero_si256();
                if (kind == KQ_IQ4_XS)
                    kq_dot_signed(&t, x, &isum);
                else
                    kq_dot(&t, x, &isum, &iaux);
                acc = kq_accumulate(acc, isum, iaux, dw, dmin, x->d, kq_has_min(kind));
                store_tile(yr, acc, n_valid);
            }
        }
    }
}

static void matmul_q2_k(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_kq2(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, KQ_Q2_K);
}

static void matmul_q3_k(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_kq2(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, KQ_Q3_K);
}

static void matmul_q5_k(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_kq2(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, KQ_Q5_K);
}

static void matmul_iq4_xs(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                          int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_kq2(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, KQ_IQ4_XS);
}

/* ---------------------------------------------------------------------------------------
 * Q4_1, Q5_0, Q5_1, IQ4_NL x Q8_0. Each block decodes to 32 signed weights in element order
 * (Q4_1/Q5_1: q; Q5_0: q - 16; IQ4_NL: the grid value; all in [-127, 127]) held in a
 * chunk buffer with their absolute values; every activation row then takes |w| * sign(x, w)
 * (maddubs pairs <= 32258), widens with madd, and reduce8 gives each row's exact isum. The
 * float steps are the reference's: isum * (d_w * d_x), then for Q4_1/Q5_1 xsum * (m_w * d_x)
 * with xsum = s8 / 8 from the activation's block extension.
 * --------------------------------------------------------------------------------------- */

enum lk_kind { LK_Q4_1, LK_Q5_0, LK_Q5_1, LK_IQ4_NL };

enum { LKB = 32 }; /* blocks per chunk: 2 x 8 KiB of decoded weights */

static ALWAYS_INLINE size_t lk_bytes(enum lk_kind k)
{
    switch (k) {
    case LK_Q4_1: return sizeof(struct kvr_block_q4_1);
    case LK_Q5_0: return sizeof(struct kvr_block_q5_0);
    case LK_Q5_1: return sizeof(struct kvr_block_q5_1);
    default: return sizeof(struct kvr_block_iq4_nl);
    }
}

static ALWAYS_INLINE int lk_has_min(enum lk_kind k)
{
    return k == LK_Q4_1 || k == LK_Q5_1;
}

/* The 32 high bits of a Q5 block (qh, little-endian) as bytes: 16 where bit j is set. */
static ALWAYS_INLINE __m256i q5_high(const uint8_t *qh)
{
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bits = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(load_i32(qh)), spread);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits), _mm256_set1_epi8(16));
}

static ALWAYS_INLINE __m256i lk_decode(const uint8_t *p, enum lk_kind k)
{
    switch (k) {
    case LK_Q4_1: return unpack_q4_0(p + 4);
    case LK_Q5_0: return _mm256_sub_epi8(_mm256_or_si256(unpack_q4_0(p + 6), q5_high(p + 2)),
                                         _mm256_set1_epi8(16));
    case LK_Q5_1: return _mm256_or_si256(unpack_q4_0(p + 8), q5_high(p + 4));
    default: return _mm256_shuffle_epi8(iq4_table(), unpack_q4_0(p + 2));
    }
}

static ALWAYS_INLINE void matmul_lk(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                                    int64_t n_rows, float *y, int64_t ldy, int64_t o_begin,
                                    int64_t o_end, enum lk_kind kind)
{
    _Alignas(32) __m256i wa[LKB][OT], ws[LKB][OT];
    _Alignas(32) __m256 dw[LKB], mw[LKB];
    const __m256i ones = _mm256_set1_epi16(1);
    const size_t wb = lk_bytes(kind);
    int64_t nb = w->n_in / KVR_QK;
    for (int64_t o0 = o_begin; o0 < o_end; o0 += OT) {
        const uint8_t *rows[OT];
        int n_valid = tile_rows(w, o0, o_end, rows);
        const uint8_t *pf = next_tile(w, o0, OT);
        for (int64_t b0 = 0; b0 < nb; b0 += LKB) {
            int kn = nb - b0 < LKB ? (int)(nb - b0) : LKB;
            for (int b = 0; b < kn; b++) {
                size_t off = (size_t)(b0 + b) * wb;
                if (pf)
                    prefetch_span(pf + off * OT, wb * OT);
                UNROLL
                for (int i = 0; i < OT; i++) {
                    __m256i v = lk_decode(rows[i] + off, kind);
                    ws[b][i] = v;
                    wa[b][i] = _mm256_abs_epi8(v);
                }
                dw[b] = load_f16x8(rows, off);
                if (lk_has_min(kind))
                    mw[b] = load_f16x8(rows, off + 2);
            }
            for (int64_t r = 0; r < n_rows; r++) {
                const uint8_t *xr = (const uint8_t *)xq + (size_t)r * x_stride;
                const struct kvr_q8_0_ext *ext = (const void *)(xr + kvr_q8_0_ext_offset(nb));
                float *yr = y + r * ldy + o0;
                __m256 acc = b0 ? load_tile(yr, n_valid) : _mm256_setzero_ps();
                for (int b = 0; b < kn; b++) {
                    __m256i x = _mm256_loadu_si256(
                        (const __m256i *)(xr + (size_t)(b0 + b) * sizeof(struct kvr_block_q8_0) + 2));
                    __m256i p[OT];
                    UNROLL
                    for (int i = 0; i < OT; i++)
                        p[i] = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(wa[b][i], _mm256_sign_epi8(x, ws[b][i])), ones);
                    __m256i isum = reduce8_epi32(p);
                    __m256 dx = _mm256_set1_ps(ext[b0 + b].d);
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw[b], dx), acc);
                    if (lk_has_min(kind))
                        acc = _mm256_fmadd_ps(_mm256_set1_ps((float)(ext[b0 + b].s8 / 8)),
                                              _mm256_mul_ps(mw[b], dx), acc);
                }
                store_tile(yr, acc, n_valid);
            }
        }
    }
}

static void matmul_q4_1(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_lk(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, LK_Q4_1);
}

static void matmul_q5_0(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_lk(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, LK_Q5_0);
}

static void matmul_q5_1(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_lk(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, LK_Q5_1);
}

static void matmul_iq4_nl(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                          int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_lk(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, LK_IQ4_NL);
}

/* ---------------------------------------------------------------------------------------
 * F32 / F16 / BF16 x F32: tiles of F_OT weight rows x F_RT activation rows, one 8-lane
 * accumulator per pair, reduced like the reference.
 * --------------------------------------------------------------------------------------- */

enum fkind { FK_F32, FK_F16, FK_BF16 };

static ALWAYS_INLINE __m256 load8_w(const uint8_t *row, int64_t k, enum fkind kind)
{
    switch (kind) {
    case FK_F32: return _mm256_loadu_ps((const float *)row + k);
    case FK_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
    default: {
        __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    }
    }
}

static ALWAYS_INLINE float load1_w(const uint8_t *row, int64_t k, enum fkind kind)
{
    switch (kind) {
    case FK_F32: return load_f32(row + 4 * k);
    case FK_F16: return _cvtsh_ss(load_u16(row + 2 * k));
    default: {
        uint32_t u = (uint32_t)load_u16(row + 2 * k) << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    }
}

static ALWAYS_INLINE float hsum_tree(__m256 v)
{
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l, l+4 */
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));                                       /* +2 */
    t = _mm_add_ss(t, _mm_movehdup_ps(t));                                         /* +1 */
    return _mm_cvtss_f32(t);
}

static ALWAYS_INLINE void f_tile(const uint8_t *const rows[F_OT], int no, const float *const xr[F_RT],
                                 int nr, int64_t n, enum fkind kind, float *y, int64_t ldy,
                                 const uint8_t *pf)
{
    __m256 acc[F_OT][F_RT];
    UNROLL
    for (int i = 0; i < F_OT; i++)
        UNROLL
        for (int r = 0; r < F_RT; r++)
            acc[i][r] = _mm256_setzero_ps();
    int64_t n8 = n - n % 8;
    const size_t esz = kind == FK_F32 ? 4 : 2;
    for (int64_t k = 0; k < n8; k += 8) {
        __m256 xv[F_RT];
        if (pf)
            prefetch_span(pf + (size_t)k * esz * F_OT, 8 * esz * F_OT);
        UNROLL
        for (int r = 0; r < nr; r++)
            xv[r] = _mm256_loadu_ps(xr[r] + k);
        UNROLL
        for (int i = 0; i < F_OT; i++) {
            __m256 wv = load8_w(rows[i], k, kind);
            UNROLL
            for (int r = 0; r < nr; r++)
                acc[i][r] = _mm256_fmadd_ps(wv, xv[r], acc[i][r]);
        }
    }
    UNROLL
    for (int i = 0; i < no; i++) {
        UNROLL
        for (int r = 0; r < nr; r++) {
            float s = hsum_tree(acc[i][r]);
            for (int64_t k = n8; k < n; k++)
                s = fmaf(load1_w(rows[i], k, kind), xr[r][k], s);
            y[r * ldy + i] = s;
        }
    }
}

static ALWAYS_INLINE void matmul_f(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                                   int64_t n_rows, float *y, int64_t ldy, int64_t o_begin,
                                   int64_t o_end, enum fkind kind)
{
    for (int64_t o0 = o_begin; o0 < o_end; o0 += F_OT) {
        int no = o_end - o0 < F_OT ? (int)(o_end - o0) : F_OT;
        const uint8_t *rows[F_OT];
        UNROLL
        for (int i = 0; i < F_OT; i++)
            rows[i] = (const uint8_t *)w->data + (size_t)(o0 + (i < no ? i : no - 1)) * w->row_bytes;
        const uint8_t *pf = next_tile(w, o0, F_OT);
        for (int64_t r0 = 0; r0 < n_rows; r0 += F_RT) {
            int nr = n_rows - r0 < F_RT ? (int)(n_rows - r0) : F_RT;
            const float *xr[F_RT];
            UNROLL
            for (int r = 0; r < F_RT; r++)
                xr[r] = (const float *)((const uint8_t *)xq + (size_t)(r0 + (r < nr ? r : 0)) * x_stride);
            float *yt = y + r0 * ldy + o0;
            switch (nr) {
            case 1: f_tile(rows, no, xr, 1, w->n_in, kind, yt, ldy, r0 ? NULL : pf); break;
            case 2: f_tile(rows, no, xr, 2, w->n_in, kind, yt, ldy, r0 ? NULL : pf); break;
            default: f_tile(rows, no, xr, 3, w->n_in, kind, yt, ldy, r0 ? NULL : pf); break;
            }
        }
    }
}

static void matmul_f32(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                       int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_f(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, FK_F32);
}

static void matmul_f16(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                       int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_f(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, FK_F16);
}

static void matmul_bf16(const struct kvr_matrix *w, const void *xq, size_t x_stride,
                        int64_t n_rows, float *y, int64_t ldy, int64_t o_begin, int64_t o_end)
{
    matmul_f(w, xq, x_stride, n_rows, y, ldy, o_begin, o_end, FK_BF16);
}

const struct kvr_kernel_set kvr_kernels_avx2 = {
    .name = "avx2",
    .quantize_row = {[KVR_DTYPE_Q8_0] = quantize_row_q8_0_act, [KVR_DTYPE_Q8_K] = quantize_row_q8_k},
    .matmul = {[KVR_DTYPE_F32] = matmul_f32,
               [KVR_DTYPE_F16] = matmul_f16,
               [KVR_DTYPE_BF16] = matmul_bf16,
               [KVR_DTYPE_Q8_0] = matmul_q8_0,
               [KVR_DTYPE_Q4_0] = matmul_q4_0,
               [KVR_DTYPE_Q4_K] = matmul_q4_k,
               [KVR_DTYPE_Q6_K] = matmul_q6_k,
               [KVR_DTYPE_Q4_1] = matmul_q4_1,
               [KVR_DTYPE_Q5_0] = matmul_q5_0,
               [KVR_DTYPE_Q5_1] = matmul_q5_1,
               [KVR_DTYPE_IQ4_NL] = matmul_iq4_nl,
               [KVR_DTYPE_Q2_K] = matmul_q2_k,
               [KVR_DTYPE_Q3_K] = matmul_q3_k,
               [KVR_DTYPE_Q5_K] = matmul_q5_k,
               [KVR_DTYPE_IQ4_XS] = matmul_iq4_xs},
    .o_tile = OT,
};
