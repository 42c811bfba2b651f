/* kernels.h - internal to src/model: block structs of the quantized types and the kernel-set
 * table that matmul.c dispatches through. Not part of the public API (dtype.h is).
 *
 * Every struct below mirrors a GGUF block byte for byte; the byte tables are in dtype.c
 * (dtype_kquant.c for the K-quants and Q8_K). The blocks are read in place from the mmapped
 * file, where rows are only 2-byte aligned, so kernels load them with unaligned loads. No I/O
 * and no globals: a kernel reads its prefetch distances from the kernel set it is called
 * with. */
#ifndef KVR_MODEL_KERNELS_H
#define KVR_MODEL_KERNELS_H

#include "model/dtype.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define KVR_QK 32    /* elements per Q8_0 / Q4_0 block */
#define KVR_QK_K 256 /* elements per K-quant super-block */

struct kvr_block_q8_0 {
    uint16_t d;        /* scale, fp16 */
    int8_t qs[KVR_QK]; /* value = qs[i] * d */
};

struct kvr_block_q4_0 {
    uint16_t d;             /* scale, fp16 */
    uint8_t qs[KVR_QK / 2]; /* byte i: element i in the low nibble, i+16 in the high one */
};

struct kvr_block_q4_1 {
    uint16_t d;             /* scale, fp16 */
    uint16_t m;             /* offset (the block's minimum), fp16 */
    uint8_t qs[KVR_QK / 2]; /* as Q4_0; element = q * d + m */
};

struct kvr_block_q5_0 {
    uint16_t d;             /* scale, fp16 */
    uint8_t qh[4];          /* bit j of the little-endian word: bit 4 of element j's q */
    uint8_t qs[KVR_QK / 2]; /* low 4 bits, as Q4_0; element = (q - 16) * d */
};

struct kvr_block_q5_1 {
    uint16_t d;             /* scale, fp16 */
    uint16_t m;             /* offset, fp16 */
    uint8_t qh[4];          /* as Q5_0 */
    uint8_t qs[KVR_QK / 2]; /* as Q5_0; element = q * d + m */
};

struct kvr_block_iq4_nl {
    uint16_t d;             /* scale, fp16 */
    uint8_t qs[KVR_QK / 2]; /* 4-bit indices into kvr_iq4_values, laid out as Q4_0 */
};

struct kvr_block_mxfp4 {
    uint8_t e;              /* E8M0 exponent: the block's scale (see kvr_e8m0_half) */
    uint8_t qs[KVR_QK / 2]; /* 4-bit E2M1 codes into kvr_mxfp4_values, laid out as Q4_0 */
};

struct kvr_block_q2_k {
    uint8_t scales[KVR_QK_K / 16]; /* per 16 elements: low nibble scale, high nibble min */
    uint8_t qs[KVR_QK_K / 4];      /* 2-bit quants (see dtype_kquant.c) */
    uint16_t d;                    /* fp16 scale of the scales */
    uint16_t dmin;                 /* fp16 scale of the mins */
};

struct kvr_block_q3_k {
    uint8_t hmask[KVR_QK_K / 8]; /* bit 2 of each quant */
    uint8_t qs[KVR_QK_K / 4];    /* low 2 bits, laid out as Q2_K */
    uint8_t scales[12];          /* 16 six-bit scales, packed (see dtype_kquant.c) */
    uint16_t d;                  /* fp16 */
};

struct kvr_block_q5_k {
    uint16_t d; /* as Q4_K */
    uint16_t dmin;
    uint8_t scales[12];       /* as Q4_K */
    uint8_t qh[KVR_QK_K / 8]; /* bit 4 of each quant */
    uint8_t qs[KVR_QK_K / 2]; /* low 4 bits, laid out as Q4_K */
};

struct kvr_block_iq4_xs {
    uint16_t d;                      /* fp16 */
    uint16_t scales_h;               /* bits 4-5 of the 8 six-bit scales, 2 bits each */
    uint8_t scales_l[KVR_QK_K / 64]; /* bits 0-3 of the scales, a nibble each */
    uint8_t qs[KVR_QK_K / 2];        /* indices into kvr_iq4_values, 16 bytes per 32 */
};

struct kvr_block_q4_k {
    uint16_t d;         /* fp16 scale of the 6-bit sub-block scales */
    uint16_t dmin;      /* fp16 scale of the 6-bit sub-block mins */
    uint8_t scales[12]; /* 8 scales + 8 mins, 6 bits each, packed (see dtype_kquant.c) */
    uint8_t qs[KVR_QK_K / 2];
};

struct kvr_block_q6_k {
    uint8_t ql[KVR_QK_K / 2]; /* low 4 bits */
    uint8_t qh[KVR_QK_K / 4]; /* high 2 bits */
    int8_t scales[KVR_QK_K / 16];
    uint16_t d; /* fp16 */
};

struct kvr_block_q8_1 {
    uint16_t d;        /* scale, fp16 */
    uint16_t s;        /* d * sum(qs) with d before its fp16 rounding, fp16 */
    int8_t qs[KVR_QK]; /* value = qs[i] * d */
};

struct kvr_block_q8_k {
    float d;                      /* scale, f32 */
    int8_t qs[KVR_QK_K];          /* in [-127, 127]: never -128 (see dtype.c) */
    int16_t bsums[KVR_QK_K / 16]; /* sum of each 16 consecutive qs */
};

_Static_assert(sizeof(struct kvr_block_q8_0) == 34, "q8_0 block is 34 bytes");
_Static_assert(sizeof(struct kvr_block_q8_1) == 36, "q8_1 block is 36 bytes");
_Static_assert(sizeof(struct kvr_block_q4_0) == 18, "q4_0 block is 18 bytes");
_Static_assert(sizeof(struct kvr_block_q4_1) == 20, "q4_1 block is 20 bytes");
_Static_assert(sizeof(struct kvr_block_q5_0) == 22, "q5_0 block is 22 bytes");
_Static_assert(sizeof(struct kvr_block_q5_1) == 24, "q5_1 block is 24 bytes");
_Static_assert(sizeof(struct kvr_block_iq4_nl) == 18, "iq4_nl block is 18 bytes");
_Static_assert(sizeof(struct kvr_block_mxfp4) == 17, "mxfp4 block is 17 bytes");
_Static_assert(sizeof(struct kvr_block_q2_k) == 84, "q2_K block is 84 bytes");
_Static_assert(sizeof(struct kvr_block_q3_k) == 110, "q3_K block is 110 bytes");
_Static_assert(sizeof(struct kvr_block_q5_k) == 176, "q5_K block is 176 bytes");
_Static_assert(sizeof(struct kvr_block_iq4_xs) == 136, "iq4_xs block is 136 bytes");
_Static_assert(sizeof(struct kvr_block_q4_k) == 144, "q4_K block is 144 bytes");
_Static_assert(sizeof(struct kvr_block_q6_k) == 210, "q6_K block is 210 bytes");
_Static_assert(sizeof(struct kvr_block_q8_k) == 292, "q8_K block is 292 bytes");

/* Activation rows for the weight types dotted with Q8_0 (Q8_0 and Q4_0) carry, after their
 * n/32 Q8_0 blocks and zero padding to a multiple of 8 bytes, one extension per block:
 *
 *   offset  size  field
 *   0       4     d    the block's fp16 scale widened to f32 (saves a conversion per use)
 *   4       4     s8   8 * sum of the block's 32 quants
 *
 * Q4_0 quants are q - 8 with q in 0..15; a kernel multiplies the unsigned q (which is what
 * _mm256_maddubs_epi16 wants) and subtracts s8 to get the exact same integer. The prefix of
 * the row is a plain Q8_0 row, so the trait dot works on it unchanged. */
struct kvr_q8_0_ext {
    float d;
    int32_t s8;
};

static inline size_t kvr_q8_0_ext_offset(int64_t n_blocks)
{
    return ((size_t)n_blocks * sizeof(struct kvr_block_q8_0) + 7) & ~(size_t)7;
}

/* Packed weights (struct kvr_matrix.packed) of Q8_0 and Q4_0: the tiles the kernels read,
 * transposed so one vector holds 4 bytes of each of 8 rows, built once per matrix. Output rows
 * go in tiles of KVR_PACK_ROWS (the last tile repeats the matrix's last row); tile t holds
 * rows 8t..8t+7. Within a tile, block b (32 columns) is one `unit`, at the byte
 * kvr_pack_unit_at (below) gives:
 *
 *   offset  size       field
 *   0       16         d     8 x fp16: lane i = row i's block scale, as in the file
 *   16      32 * n_g   q     n_g vectors of 8 dwords: vector g, dword i = bytes 4g..4g+3
 *                            of row i's qs (Q8_0: n_g = 8, signed quants; Q4_0: n_g = 4,
 *                            the raw nibble bytes, so vector g's low nibbles are elements
 *                            4g..4g+3 and its high nibbles elements 4g+16..4g+19)
 *
 * unit = 272 bytes for Q8_0 and 144 for Q4_0, exactly 8 blocks of the file: decode streams
 * the copy once per token, so every byte more in it is time (hence fp16 scales, as in the
 * file). Units are multiples of 16
 * bytes, not 32, so kernels load them unaligned. */
#define KVR_PACK_ROWS 8
#define KVR_PACK_UNIT_Q8_0 272
#define KVR_PACK_UNIT_Q4_0 144

/* Both layouts store tiles in pairs: the units of tiles 2p and 2p + 1 alternate (unit b of
 * tile 2p, then unit b of tile 2p + 1, for every b), so a kernel computing both tiles of a
 * pair at once (the AVX-512 ones, 16 rows per vector) reads one ascending stream (the
 * K-quants interleave the two units of a super-block further, below). The tile count is
 * rounded up to even (the padding rows repeat the matrix's last row). Tile t's unit b of n_b
 * units per row starts at byte (for the K-quants: t even, the pair's chunk): */
static inline size_t kvr_pack_unit_at(int64_t t, int64_t b, int64_t n_b, size_t unit)
{
    return ((size_t)(t / 2) * 2 * (size_t)n_b + 2 * (size_t)b + (size_t)(t % 2)) * unit;
}

/* Packed K-quants (Q4_K, Q5_K, Q6_K, IQ4_XS), read by their GEMV and GEMM alike: the same
 * tiles of KVR_PACK_ROWS rows, and within a tile super-block s is one unit of exactly 8 x
 * the block's bytes (so the copy is as large as the weights). A unit holds the block's
 * fields, each interleaved across the 8 rows: a 2-byte field as 8 consecutive u16 (row i at
 * 2i), a field of 4n bytes as n vectors of 8 dwords (vector g, dword i = bytes 4g..4g+3 of
 * row i's field). So one dword lane is one output row everywhere, and one vpdpbusd with 4
 * broadcast activation bytes serves 8 rows. Offsets in the unit:
 *
 *   type    unit   fields (offset in the unit)
 *   Q4_K    1152   d 0, dmin 16, scales 32 (3 vectors), qs 128 (32 vectors)
 *   Q5_K    1408   d 0, dmin 16, scales 32 (3), qh 128 (8), qs 384 (32)
 *   Q6_K    1680   quants 0 (48 vectors, in the order the kernels read them: for h = 0, 1
 *                  and g = 0..7, ql vector 16h + g, ql vector 16h + 8 + g, qh vector
 *                  8h + g, kvr_pack_q6_k_slot; recoded, below), scales 1536 (4), d 1664
 *   IQ4_XS  1088   d 0, scales_h 16, scales_l 32 (1), qs 64 (32)
 *
 * The two units of super-block s of a tile pair (2p, 2p + 1) form one chunk of 2 x unit bytes
 * at kvr_pack_unit_at(2p, s, ...), interleaved by 32-byte slot: bytes 32j..32j+31 of tile
 * 2p + k's unit sit at 64j + 32k of the chunk (kvr_pack_kq_at), and a unit's last half slot
 * (Q6_K's d) at 64j + 16k. So a 64-byte load is the same vector of both tiles (the AVX-512
 * kernels compute 16 rows at once), and a kernel reading its unit front to back reads the
 * chunk front to back: one ascending stream, which the hardware prefetchers follow (Q6_K's
 * fields in block order would be three streams per unit). One-tile kernels read their
 * tile's slots 64 bytes apart.
 *
 * Q6_K's quants are recoded as they are packed. Byte l of the three vectors of step (h, g)
 * names the same four quants q0..q3 (0..63) of element groups 0..3 of the half (elements
 * 128h + 32k + 4g + l % 4 of row l / 4, k = 0..3): the block keeps them as ql nibbles and qh bit
 * pairs, the packed copy as A = q0 | (q3 & 3) << 6, B = q1 | (q3 >> 2 & 3) << 6 and C = q2 |
 * (q3 >> 4) << 6 (same size). Three of the four are then one mask each, and the fourth two
 * bit selects, fewer instructions than the block's nibbles and bit pairs. */
#define KVR_PACK_UNIT_Q4_K (8 * 144)
#define KVR_PACK_UNIT_Q5_K (8 * 176)
#define KVR_PACK_UNIT_Q6_K (8 * 210)
#define KVR_PACK_UNIT_IQ4_XS (8 * 136)

/* Where byte `off` of tile 2p's unit sits in its packed K-quant chunk; tile 2p + 1's is 32
 * bytes on in a whole slot, 16 in the last half slot (kvr_pack_kq_at). */
static inline size_t kvr_pack_kq_slot(size_t off)
{
    return 2 * (off & ~(size_t)31) + (off & 31);
}

/* Where byte `off` of tile 2p + k's unit (unit bytes) sits in its packed K-quant chunk. */
static inline size_t kvr_pack_kq_at(size_t unit, int k, size_t off)
{
    size_t full = unit & ~(size_t)31;
    return kvr_pack_kq_slot(off) + (size_t)k * (off < full ? 32 : 16);
}

/* The slot (32-byte vector) of a Q6_K unit that holds ql vector v (0..31) of the block's
 * field order, or qh vector 32 + w (w 0..15): the reading order of kernels.h. */
static inline int kvr_pack_q6_k_slot(int v)
{
    if (v < 32)
        return 3 * (8 * (v / 16) + v % 8) + (v % 16) / 8;
    return 3 * (v - 32) + 2;
}

/* The 256 quants of a Q6_K super-block, less 32 (-32..31), in element order (dtype_kquant.c has
 * the bit layout). */
static inline void kvr_q6_k_unpack(const struct kvr_block_q6_k *b, int8_t q[KVR_QK_K])
{
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        int8_t *y = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            y[l] = (int8_t)(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
            y[l + 32] = (int8_t)(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
            y[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            y[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

/* Unpack the 6-bit scale and min of sub-block j (0..7) of a Q4_K super-block. */
static inline void kvr_q4_k_scale_min(const uint8_t *scales, int j, int *sc, int *mn)
{
    if (j < 4) {
        *sc = scales[j] & 63;
        *mn = scales[j + 4] & 63;
    } else {
        *sc = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        *mn = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

/* The 16 values a 4-bit IQ4_NL / IQ4_XS index selects (a fixed non-linear grid of the
 * format, denser near zero). */
static const int8_t kvr_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

/* The E2M1 values of the 16 MXFP4 codes, doubled so they are integers (0, 0.5, 1, 1.5, 2,
 * 3, 4, 6, then the same negated); kvr_e8m0_half halves the scale to match. */
static const int8_t kvr_mxfp4_values[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                            0, -1, -2, -3, -4, -6, -8, -12};

/* Half the E8M0 scale e, 2^(e - 127) / 2 = 2^(e - 128), exact in f32 for every e (e 0 and 1
 * are the subnormals 2^-128 and 2^-127). */
static inline float kvr_e8m0_half(uint8_t e)
{
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Q3_K scale j (0..15), signed (-32..31): bits 0-3 from the low nibble of byte j (j < 8) or
 * the high nibble of byte j - 8, bits 4-5 from byte 8 + j % 4 at bit 2 * (j / 4). */
static inline int kvr_q3_k_scale(const uint8_t *scales, int j)
{
    int lo = j < 8 ? scales[j] & 0x0F : scales[j - 8] >> 4;
    int hi = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | hi << 4) - 32;
}

/* IQ4_XS scale of sub-block j (0..7), signed (-32..31). */
static inline int kvr_iq4_xs_scale(const struct kvr_block_iq4_xs *b, int j)
{
    int lo = (b->scales_l[j / 2] >> (4 * (j % 2))) & 0x0F;
    int hi = (b->scales_h >> (2 * j)) & 3;
    return (lo | hi << 4) - 32;
}

/* A kernel set: one implementation of the hot paths for every supported type.
 *
 * quantize_row converts one activation row of n floats into `dot_type` (the activation type
 * of some weight type). matmul has the contract of kvr_matmul with the arguments already
 * checked; `ks` is the set it was found in, whose prefetch distances it reads. A NULL entry
 * means "use the reference". */
struct kvr_kernel_set;
typedef void (*kvr_quantize_row_fn)(const float *x, void *dst, int64_t n);
typedef void (*kvr_matmul_fn)(const struct kvr_kernel_set *ks, const struct kvr_matrix *w,
                              const void *xq, size_t x_stride, int64_t n_rows, float *y,
                              int64_t ldy, int64_t o_begin, int64_t o_end);

struct kvr_kernel_set {
    const char *name;
    kvr_quantize_row_fn quantize_row[KVR_DTYPE_COUNT]; /* indexed by activation type */
    kvr_matmul_fn matmul[KVR_DTYPE_COUNT];             /* indexed by weight type */
    int o_tile; /* output rows per tile: slices starting at multiples of it run fastest */
    /* How far ahead of the unit it computes a kernel on a packed copy prefetches (bytes; 0 =
     * none): the K-quant and IQ4_XS kernels (prefetch_kquant) and the Q4_0 / Q8_0 ones
     * (prefetch_legacy). The ISA tables below leave them 0; matmul.c fills them in the set it
     * chooses (kvr_kernels_setup). Only a speed: the bits of every result are the same
     * whatever they are. */
    size_t prefetch_kquant;
    size_t prefetch_legacy;
};

/* The ISA tables (kernels/set_avx2.c, kernels/set_avx512.c): templates of the chosen set. */
extern const struct kvr_kernel_set kvr_kernels_avx2;
extern const struct kvr_kernel_set kvr_kernels_avx512;

/* The set kvr_matmul runs now (with its prefetch distances); for tests that check them. */
const struct kvr_kernel_set *kvr_kernels_active(void);

#endif
