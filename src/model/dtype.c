/* dtype.c - the table of weight/activation type traits and the scalar reference kernels.
 *
 * Everything here is plain C11 with no SIMD: it is the definition the fast kernels
 * (kernels_avx2.c) are tested against. Each quantized type's GGUF block layout is given as a
 * byte table next to its code. All multi-byte fields are little-endian, like GGUF itself
 * (this code assumes a little-endian host, as the mmapped reader does).
 *
 * The reference dot products fix the exact floating-point operation sequence that every
 * kernel set reproduces bit for bit (that is what makes results batch-invariant and lets the
 * tests compare SIMD against reference with memcmp):
 *
 *   block types: for each block in order, an exact integer dot `isum` of the quantized
 *     values, then acc = fmaf((float)isum, d_w * d_x, acc). Q2_K, Q4_K and Q5_K add a
 *     second step for their mins, acc = fmaf(-(float)imin, dmin_w * d_x, acc); Q4_1 and Q5_1
 *     one for their offsets, acc = fmaf((float)xsum, m_w * d_x, acc). A K-quant's isum and
 *     imin cover its whole super-block (sub-block scales are integers inside the sum).
 *   f32/f16/bf16 (dotted with f32): eight lane sums, lane l taking elements 8j + l with
 *     lane = fmaf(w, x, lane); then the fixed tree ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7));
 *     then the n % 8 tail elements, in order, with sum = fmaf(w, x, sum).
 *
 * fmaf is spelled out (never `a * b + c`) so no compiler contraction setting can change it. */
#include "model/dtype.h"
#include "model/kernels.h"

#include "core/alloc.h"

#include <math.h>
#include <string.h>
#include <strings.h>

/* ---------------------------------------------------------------------------------------
 * fp16 and bf16
 *
 * IEEE binary16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits. bfloat16: the top
 * 16 bits of a binary32. Conversions to the narrow types round to nearest, ties to even,
 * overflow to infinity, keep the sign of zero and infinities, and turn NaNs into quiet NaNs
 * that keep the top mantissa bits (the same results as the F16C instruction vcvtps2ph).
 * --------------------------------------------------------------------------------------- */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float kvr_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F;
    uint32_t mant = h & 0x3FF;
    if (exp == 0x1F) /* inf or NaN */
        return bits_f32(sign | 0x7F800000 | (mant << 13));
    if (exp == 0) { /* zero or subnormal: mant * 2^-24, exact in binary32 */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (mant << 13)); /* rebias 15 -> 127 */
}

uint16_t kvr_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7FFFFFFF;
    if (x >= 0x7F800000) { /* inf, or NaN made quiet */
        if (x == 0x7F800000)
            return sign | 0x7C00;
        return (uint16_t)(sign | 0x7E00 | ((x >> 13) & 0x3FF));
    }
    if (x >= 0x477FF000) /* >= 65520: rounds past the largest half, 65504 */
        return sign | 0x7C00;
    if (x < 0x38800000) {   /* below 2^-14: subnormal half (or zero) */
        if (x < 0x33000000) /* <= 2^-25 rounds to zero (2^-25 itself is a tie to even 0) */
            return sign;
        uint32_t e = x >> 23;
        uint32_t m = (x & 0x7FFFFF) | 0x800000;
        uint32_t shift = 126 - e; /* value = m * 2^(e-150); in units of 2^-24: m >> shift */
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1)))
            r++; /* may carry into the smallest normal, which is the right encoding */
        return (uint16_t)(sign | r);
    }
    uint32_t r = (x - 0x38000000) >> 13; /* rebias 127 -> 15, drop 13 mantissa bits */
    uint32_t rem = x & 0x1FFF;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1)))
        r++; /* a carry into the exponent is still correct */
    return (uint16_t)(sign | r);
}

float kvr_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t kvr_f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFF) > 0x7F800000) /* NaN: keep it a (quiet) NaN, never round to inf */
        return (uint16_t)((x >> 16) | 0x40);
    x += 0x7FFF + ((x >> 16) & 1); /* round to nearest even; overflow correctly gives inf */
    return (uint16_t)(x >> 16);
}

/* ---------------------------------------------------------------------------------------
 * F32 / F16 / BF16: one element per "block". All three are dotted with F32 activations, so
 * F32 x F32 stays in single precision end to end.
 * --------------------------------------------------------------------------------------- */

static void f32_to_float(const void *src, float *dst, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void f32_from_float(const float *src, void *dst, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}

/* The f32-family dot with the 8-lane order described at the top; `load` widens element i
 * of the weight row to f32 (exact for all three types). */
#define F32_FAMILY_DOT(name, wtype, load)                                                          \
    static float name(int64_t n, const void *w, const void *x)                                     \
    {                                                                                              \
        const wtype *a = w;                                                                        \
        const float *b = x;                                                                        \
        float lane[8] = {0};                                                                       \
        int64_t n8 = n - n % 8;                                                                    \
        for (int64_t i = 0; i < n8; i += 8)                                                        \
            for (int l = 0; l < 8; l++)                                                            \
                lane[l] = fmaf(load(a[i + l]), b[i + l], lane[l]);                                 \
        float sum = ((lane[0] + lane[4]) + (lane[2] + lane[6])) +                                  \
                    ((lane[1] + lane[5]) + (lane[3] + lane[7]));                                   \
        for (int64_t i = n8; i < n; i++)                                                           \
            sum = fmaf(load(a[i]), b[i], sum);                                                     \
        return sum;                                                                                \
    }

static inline float load_f32(float v)
{
    return v;
}
F32_FAMILY_DOT(f32_dot, float, load_f32)
F32_FAMILY_DOT(f16_dot, uint16_t, kvr_f16_to_f32)
F32_FAMILY_DOT(bf16_dot, uint16_t, kvr_bf16_to_f32)

static void f16_to_float(const void *src, float *dst, int64_t n)
{
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++)
        dst[i] = kvr_f16_to_f32(s[i]);
}

static void f16_from_float(const float *src, void *dst, int64_t n)
{
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++)
        d[i] = kvr_f32_to_f16(src[i]);
}

static void bf16_to_float(const void *src, float *dst, int64_t n)
{
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++)
        dst[i] = kvr_bf16_to_f32(s[i]);
}

static void bf16_from_float(const float *src, void *dst, int64_t n)
{
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++)
        d[i] = kvr_f32_to_bf16(src[i]);
}

/* ---------------------------------------------------------------------------------------
 * Q8_0: blocks of 32 elements, 34 bytes.
 *
 *   offset  size  field
 *   0       2     d      fp16 scale
 *   2       32    qs     int8 quants; element i = qs[i] * d
 *
 * Quantization: d = max|x| / 127 and qs = round-to-nearest-even(x / d), so qs never holds
 * -128. That matters to the SIMD kernels: an activation in [-127, 127] lets them multiply
 * with _mm256_maddubs_epi16 (unsigned x signed bytes, pairs summed in saturating int16)
 * without ever saturating. Weights from a file may hold -128; that is still exact because
 * the activation side never does.
 * --------------------------------------------------------------------------------------- */

static void q8_0_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q8_0 *b = src;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        float d = kvr_f16_to_f32(b[i].d);
        for (int j = 0; j < KVR_QK; j++)
            dst[i * KVR_QK + j] = (float)b[i].qs[j] * d;
    }
}

/* One block of 32 activations to int8 with d = max|x| / 127 (the rule above), shared by
 * Q8_0 and Q8_1; returns d in f32, before the caller stores it as fp16. */
static float q8_block_quantize(const float *x, int8_t *qs)
{
    float amax = 0.0f;
    for (int j = 0; j < KVR_QK; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < KVR_QK; j++)
        qs[j] = (int8_t)nearbyintf(x[j] * id);
    return d;
}

static void q8_0_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / KVR_QK; i++)
        b[i].d = kvr_f32_to_f16(q8_block_quantize(src + i * KVR_QK, b[i].qs));
}

static float q8_0_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q8_0 *a = w, *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < KVR_QK; j++)
            isum += a[i].qs[j] * b[i].qs[j];
        float d = kvr_f16_to_f32(a[i].d) * kvr_f16_to_f32(b[i].d);
        sum = fmaf((float)isum, d, sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * Q4_0: blocks of 32 elements, 18 bytes.
 *
 *   offset  size  field
 *   0       2     d      fp16 scale
 *   2       16    qs     byte j: low nibble = q of element j, high nibble = q of element j+16
 *
 * Element = (q - 8) * d with q in 0..15. Quantization picks the element of largest
 * magnitude m and sets d = m / -8, so that element maps exactly to q = 0 (the full -8 end
 * of the range) and the rest round to nearest within [0, 15].
 * --------------------------------------------------------------------------------------- */

static void q4_0_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q4_0 *b = src;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        float d = kvr_f16_to_f32(b[i].d);
        float *y = dst + i * KVR_QK;
        for (int j = 0; j < KVR_QK / 2; j++) {
            y[j] = (float)((b[i].qs[j] & 0x0F) - 8) * d;
            y[j + KVR_QK / 2] = (float)((b[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static void q4_0_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q4_0 *b = dst;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        const float *x = src + i * KVR_QK;
        float amax = 0.0f, m = 0.0f;
        for (int j = 0; j < KVR_QK; j++) {
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                m = x[j];
            }
        }
        float d = m / -8.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = kvr_f32_to_f16(d);
        for (int j = 0; j < KVR_QK / 2; j++) {
            float q0 = fminf(15.0f, fmaxf(0.0f, nearbyintf(x[j] * id) + 8.0f));
            float q1 = fminf(15.0f, fmaxf(0.0f, nearbyintf(x[j + KVR_QK / 2] * id) + 8.0f));
            b[i].qs[j] = (uint8_t)((int)q0 | ((int)q1 << 4));
        }
    }
}

static float q4_0_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q4_0 *a = w;
    const struct kvr_block_q8_0 *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < KVR_QK / 2; j++) {
            isum += ((a[i].qs[j] & 0x0F) - 8) * b[i].qs[j];
            isum += ((a[i].qs[j] >> 4) - 8) * b[i].qs[j + KVR_QK / 2];
        }
        float d = kvr_f16_to_f32(a[i].d) * kvr_f16_to_f32(b[i].d);
        sum = fmaf((float)isum, d, sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * Q8_1: the activation type of Q4_1 and Q5_1 (never stored in files by Kvasir). Blocks of
 * 32 elements, 36 bytes.
 *
 *   offset  size  field
 *   0       2     d      fp16 scale
 *   2       2     s      fp16 of d * sum(qs), d taken before its own fp16 rounding
 *   4       32    qs     int8 quants; element i = qs[i] * d
 *
 * Quantization as Q8_0's (d = max|x| / 127, so qs is in [-127, 127]). s lets a dot with
 * a min add m_w * s in one step. It is rounded to fp16 as the format stores it: llama.cpp
 * dots with this value, and an exact integer sum times the fp16 d (what Kvasir did first)
 * moves a Q4_1 or Q5_1 model's logits by up to 7e-4 against it (models_ref_quant.sh).
 * --------------------------------------------------------------------------------------- */

static void q8_1_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q8_1 *b = src;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        float d = kvr_f16_to_f32(b[i].d);
        for (int j = 0; j < KVR_QK; j++)
            dst[i * KVR_QK + j] = (float)b[i].qs[j] * d;
    }
}

static void q8_1_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q8_1 *b = dst;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        float d = q8_block_quantize(src + i * KVR_QK, b[i].qs);
        int32_t sum = 0;
        for (int j = 0; j < KVR_QK; j++)
            sum += b[i].qs[j];
        b[i].d = kvr_f32_to_f16(d);
        b[i].s = kvr_f32_to_f16((float)sum * d);
    }
}

/* Q8_1 x Q8_1 is not needed by any weight type; it exists so the trait's dot is never NULL. */
static float q8_1_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q8_1 *a = w, *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < KVR_QK; j++)
            isum += a[i].qs[j] * b[i].qs[j];
        sum = fmaf((float)isum, kvr_f16_to_f32(a[i].d) * kvr_f16_to_f32(b[i].d), sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * Q4_1, Q5_0, Q5_1, IQ4_NL: the other legacy blocks of 32 elements. Q5_0 and IQ4_NL are
 * dotted with Q8_0 activations like Q4_0, Q4_1 and Q5_1 (the types with a min) with Q8_1;
 * quant byte j always holds element j in its low nibble and element j + 16 in its high one.
 *
 *   Q4_1 (20 bytes)           Q5_0 (22 bytes)           Q5_1 (24 bytes)
 *   offset size field         offset size field         offset size field
 *   0      2    d  fp16       0      2    d  fp16       0      2    d  fp16
 *   2      2    m  fp16       2      4    qh            2      2    m  fp16
 *   4      16   qs            6      16   qs            4      4    qh
 *                                                       8      16   qs
 *   IQ4_NL (18 bytes): 0 2 d fp16, 2 16 qs.
 *
 * qh is a little-endian 32-bit word; its bit j is bit 4 of element j's q (Q5: q in 0..31).
 * Elements: Q4_1 q * d + m (q in 0..15); Q5_0 (q - 16) * d; Q5_1 q * d + m; IQ4_NL
 * kvr_iq4_values[q] * d.
 *
 * Dots (the fixed order of the top of this file): the exact integer isum = sum of w_q * x_q
 * per block with w_q = q (Q4_1, Q5_1), q - 16 (Q5_0) or the table value (IQ4_NL), then
 * acc = fmaf((float)isum, d_w * d_x, acc); Q4_1 and Q5_1 add acc = fmaf(m_w, s_x, acc)
 * with s_x the activation block's fp16 d * sum(qs) (Q8_1, below).
 * --------------------------------------------------------------------------------------- */

/* Quant q (0..31) of element j of a Q5 block from its nibble byte array and qh word. */
static inline int q5_quant(const uint8_t *qs, uint32_t qh, int j)
{
    int lo = j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
    return lo | (int)((qh >> j) & 1) << 4;
}

static uint32_t load_qh(const uint8_t qh[4])
{
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

static void store_qh(uint8_t qh[4], uint32_t v)
{
    for (int k = 0; k < 4; k++)
        qh[k] = (uint8_t)(v >> (8 * k));
}

static inline int q4_quant(const uint8_t *qs, int j)
{
    return j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
}

static void q4_1_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q4_1 *b = src;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        float d = kvr_f16_to_f32(b[i].d), m = kvr_f16_to_f32(b[i].m);
        for (int j = 0; j < KVR_QK; j++)
            dst[i * KVR_QK + j] = (float)q4_quant(b[i].qs, j) * d + m;
    }
}

static void q5_0_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q5_0 *b = src;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        float d = kvr_f16_to_f32(b[i].d);
        uint32_t qh = load_qh(b[i].qh);
        for (int j = 0; j < KVR_QK; j++)
            dst[i * KVR_QK + j] = (float)(q5_quant(b[i].qs, qh, j) - 16) * d;
    }
}

static void q5_1_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q5_1 *b = src;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        float d = kvr_f16_to_f32(b[i].d), m = kvr_f16_to_f32(b[i].m);
        uint32_t qh = load_qh(b[i].qh);
        for (int j = 0; j < KVR_QK; j++)
            dst[i * KVR_QK + j] = (float)q5_quant(b[i].qs, qh, j) * d + m;
    }
}

static void iq4_nl_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_iq4_nl *b = src;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        float d = kvr_f16_to_f32(b[i].d);
        for (int j = 0; j < KVR_QK; j++)
            dst[i * KVR_QK + j] = (float)kvr_iq4_values[q4_quant(b[i].qs, j)] * d;
    }
}

/* Min/max quantizer of Q4_1 / Q5_1: d = (max - min) / nmax, m = min, q rounded against the
 * stored (fp16) d and m. */
static void minmax_block(const float *x, int nmax, uint16_t *dh, uint16_t *mh, uint8_t q[32])
{
    float lo = x[0], hi = x[0];
    for (int j = 1; j < KVR_QK; j++) {
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
    }
    *dh = kvr_f32_to_f16((hi - lo) / (float)nmax);
    *mh = kvr_f32_to_f16(lo);
    float d = kvr_f16_to_f32(*dh), m = kvr_f16_to_f32(*mh);
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < KVR_QK; j++)
        q[j] = (uint8_t)fminf((float)nmax, fmaxf(0.0f, nearbyintf((x[j] - m) * id)));
}

static void pack_nibbles(uint8_t qs[16], const uint8_t q[32])
{
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)((q[j] & 0x0F) | (q[j + 16] & 0x0F) << 4);
}

static uint32_t high_bits(const uint8_t q[32])
{
    uint32_t qh = 0;
    for (int j = 0; j < KVR_QK; j++)
        qh |= (uint32_t)(q[j] >> 4) << j;
    return qh;
}

static void q4_1_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q4_1 *b = dst;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        uint8_t q[KVR_QK];
        minmax_block(src + i * KVR_QK, 15, &b[i].d, &b[i].m, q);
        pack_nibbles(b[i].qs, q);
    }
}

static void q5_1_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q5_1 *b = dst;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        uint8_t q[KVR_QK];
        minmax_block(src + i * KVR_QK, 31, &b[i].d, &b[i].m, q);
        pack_nibbles(b[i].qs, q);
        store_qh(b[i].qh, high_bits(q));
    }
}

/* Q5_0: as Q4_0 with 16 levels each side: the element of largest magnitude maps to q = 0. */
static void q5_0_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q5_0 *b = dst;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        const float *x = src + i * KVR_QK;
        float amax = 0.0f, m = 0.0f;
        for (int j = 0; j < KVR_QK; j++) {
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                m = x[j];
            }
        }
        float d = m / -16.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = kvr_f32_to_f16(d);
        uint8_t q[KVR_QK];
        for (int j = 0; j < KVR_QK; j++)
            q[j] = (uint8_t)fminf(31.0f, fmaxf(0.0f, nearbyintf(x[j] * id) + 16.0f));
        pack_nibbles(b[i].qs, q);
        store_qh(b[i].qh, high_bits(q));
    }
}

/* Index of the grid value nearest to v (ties to the lower index). */
static int iq4_nearest(float v)
{
    int best = 0;
    float best_e = fabsf(v - (float)kvr_iq4_values[0]);
    for (int k = 1; k < 16; k++) {
        float e = fabsf(v - (float)kvr_iq4_values[k]);
        if (e < best_e) {
            best_e = e;
            best = k;
        }
    }
    return best;
}

/* Quantize x[0..n-1] on the grid with step d: the indices, and the squared error. */
static float iq4_quantize(const float *x, int n, float d, uint8_t *q)
{
    float id = d != 0.0f ? 1.0f / d : 0.0f, err = 0.0f;
    for (int j = 0; j < n; j++) {
        q[j] = (uint8_t)iq4_nearest(x[j] * id);
        float e = (float)kvr_iq4_values[q[j]] * d - x[j];
        err += e * e;
    }
    return err;
}

/* The step of a grid block: the element of largest magnitude m goes to one end of the grid
 * or near it; of a few such candidates the one with the least squared error wins. */
static float iq4_best_step(const float *x, int n)
{
    static const float ends[] = {-127.0f, -120.0f, -113.0f, 113.0f, 106.0f, 100.0f};
    float amax = 0.0f, m = 0.0f;
    for (int j = 0; j < n; j++) {
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            m = x[j];
        }
    }
    if (amax == 0.0f)
        return 0.0f;
    uint8_t q[32];
    float best = m / ends[0], best_err = INFINITY;
    for (size_t k = 0; k < sizeof ends / sizeof ends[0]; k++) {
        float d = m / ends[k];
        float err = iq4_quantize(x, n, d, q);
        if (err < best_err) {
            best_err = err;
            best = d;
        }
    }
    return best;
}

static void iq4_nl_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_iq4_nl *b = dst;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        const float *x = src + i * KVR_QK;
        b[i].d = kvr_f32_to_f16(iq4_best_step(x, KVR_QK));
        uint8_t q[KVR_QK];
        iq4_quantize(x, KVR_QK, kvr_f16_to_f32(b[i].d), q);
        pack_nibbles(b[i].qs, q);
    }
}

static float q4_1_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q4_1 *a = w;
    const struct kvr_block_q8_1 *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < KVR_QK; j++)
            isum += q4_quant(a[i].qs, j) * b[i].qs[j];
        float dx = kvr_f16_to_f32(b[i].d);
        sum = fmaf((float)isum, kvr_f16_to_f32(a[i].d) * dx, sum);
        sum = fmaf(kvr_f16_to_f32(a[i].m), kvr_f16_to_f32(b[i].s), sum);
    }
    return sum;
}

static float q5_0_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q5_0 *a = w;
    const struct kvr_block_q8_0 *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        uint32_t qh = load_qh(a[i].qh);
        int32_t isum = 0;
        for (int j = 0; j < KVR_QK; j++)
            isum += (q5_quant(a[i].qs, qh, j) - 16) * b[i].qs[j];
        float d = kvr_f16_to_f32(a[i].d) * kvr_f16_to_f32(b[i].d);
        sum = fmaf((float)isum, d, sum);
    }
    return sum;
}

static float q5_1_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q5_1 *a = w;
    const struct kvr_block_q8_1 *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        uint32_t qh = load_qh(a[i].qh);
        int32_t isum = 0;
        for (int j = 0; j < KVR_QK; j++)
            isum += q5_quant(a[i].qs, qh, j) * b[i].qs[j];
        float dx = kvr_f16_to_f32(b[i].d);
        sum = fmaf((float)isum, kvr_f16_to_f32(a[i].d) * dx, sum);
        sum = fmaf(kvr_f16_to_f32(a[i].m), kvr_f16_to_f32(b[i].s), sum);
    }
    return sum;
}

static float iq4_nl_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_iq4_nl *a = w;
    const struct kvr_block_q8_0 *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < KVR_QK; j++)
            isum += kvr_iq4_values[q4_quant(a[i].qs, j)] * b[i].qs[j];
        float d = kvr_f16_to_f32(a[i].d) * kvr_f16_to_f32(b[i].d);
        sum = fmaf((float)isum, d, sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * Q8_K: the activation type of the K-quants (never stored in files by Kvasir). Super-blocks
 * of 256 elements, 292 bytes.
 *
 *   offset  size  field
 *   0       4     d      f32 scale
 *   4       256   qs     int8 quants in [-127, 127]; element i = qs[i] * d
 *   260     32    bsums  16 x int16: bsums[k] = sum of qs[16k .. 16k+15]
 *
 * bsums let a K-quant dot subtract its sub-block minimums without touching qs again.
 * --------------------------------------------------------------------------------------- */

static void q8_k_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q8_k *b = src;
    for (int64_t i = 0; i < n / KVR_QK_K; i++)
        for (int j = 0; j < KVR_QK_K; j++)
            dst[i * KVR_QK_K + j] = (float)b[i].qs[j] * b[i].d;
}

static void q8_k_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q8_k *b = dst;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        const float *x = src + i * KVR_QK_K;
        float amax = 0.0f;
        for (int j = 0; j < KVR_QK_K; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = d;
        for (int k = 0; k < KVR_QK_K / 16; k++) {
            int sum = 0;
            for (int j = 16 * k; j < 16 * k + 16; j++) {
                b[i].qs[j] = (int8_t)nearbyintf(x[j] * id);
                sum += b[i].qs[j];
            }
            b[i].bsums[k] = (int16_t)sum;
        }
    }
}

/* Q8_K x Q8_K is not needed by any weight type; it exists so the trait's dot is never NULL. */
static float q8_k_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q8_k *a = w, *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        int32_t isum = 0;
        for (int j = 0; j < KVR_QK_K; j++)
            isum += a[i].qs[j] * b[i].qs[j];
        sum = fmaf((float)isum, a[i].d * b[i].d, sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * Q4_K: super-blocks of 256 elements, 144 bytes, made of 8 sub-blocks of 32.
 *
 *   offset  size  field
 *   0       2     d       fp16 scale of the sub-block scales
 *   2       2     dmin    fp16 scale of the sub-block mins
 *   4       12    scales  8 six-bit scales sc[j] and 8 six-bit mins m[j], packed:
 *                           byte j   (j<4): bits 0-5 sc[j],   bits 6-7 = sc[j+4] >> 4
 *                           byte j+4 (j<4): bits 0-5 m[j],    bits 6-7 = m[j+4]  >> 4
 *                           byte j+8 (j<4): bits 0-3 sc[j+4] & 15, bits 4-7 m[j+4] & 15
 *   16      128   qs      4 chunks of 32 bytes; chunk c byte l holds element 64c+l in its
 *                         low nibble (sub-block 2c) and element 64c+32+l in its high one
 *
 * Element of sub-block j = d * sc[j] * q - dmin * m[j], with q in 0..15.
 * --------------------------------------------------------------------------------------- */

static void q4_k_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q4_k *b = src;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        float d = kvr_f16_to_f32(b[i].d), dmin = kvr_f16_to_f32(b[i].dmin);
        float *y = dst + i * KVR_QK_K;
        for (int c = 0; c < 4; c++) {
            int sc0, m0, sc1, m1;
            kvr_q4_k_scale_min(b[i].scales, 2 * c, &sc0, &m0);
            kvr_q4_k_scale_min(b[i].scales, 2 * c + 1, &sc1, &m1);
            float d0 = d * (float)sc0, mm0 = dmin * (float)m0;
            float d1 = d * (float)sc1, mm1 = dmin * (float)m1;
            const uint8_t *q = b[i].qs + 32 * c;
            for (int l = 0; l < 32; l++) {
                y[64 * c + l] = d0 * (float)(q[l] & 0x0F) - mm0;
                y[64 * c + 32 + l] = d1 * (float)(q[l] >> 4) - mm1;
            }
        }
    }
}

/* Fit x[0..n-1] ~ scale * q - mn with q in 0..nmax, mn >= 0: start from the min/max range,
 * then refine scale and offset by least squares on the chosen q a few times (the error can
 * only go down or the previous fit is kept). Q2_K (n 16, nmax 3), Q4_K (32, 15), Q5_K (32, 31). */
static void fit_scale_min(const float *x, int n, int nmax, float *out_scale, float *out_min)
{
    float lo = x[0], hi = x[0];
    for (int l = 1; l < n; l++) {
        lo = fminf(lo, x[l]);
        hi = fmaxf(hi, x[l]);
    }
    lo = fminf(lo, 0.0f); /* the format subtracts a non-negative min */
    if (hi <= lo) {
        *out_scale = 0.0f;
        *out_min = -lo;
        return;
    }
    float fmax = (float)nmax;
    float scale = (hi - lo) / fmax, off = lo; /* x ~ scale * q + off */
    float best_err = INFINITY, best_scale = scale, best_off = off;
    for (int iter = 0; iter < 5; iter++) {
        float err = 0.0f;
        double sq = 0, sqq = 0, sx = 0, sqx = 0;
        for (int l = 0; l < n; l++) {
            float q = fminf(fmax, fmaxf(0.0f, nearbyintf((x[l] - off) / scale)));
            float e = scale * q + off - x[l];
            err += e * e;
            sq += q;
            sqq += (double)q * q;
            sx += x[l];
            sqx += (double)q * x[l];
        }
        if (err < best_err) {
            best_err = err;
            best_scale = scale;
            best_off = off;
        }
        double det = (double)n * sqq - sq * sq;
        if (det <= 0)
            break;
        double ns = ((double)n * sqx - sq * sx) / det;
        double no = (sx - ns * sq) / (double)n;
        if (no > 0) { /* offset must stay <= 0: refit the scale alone with offset 0 */
            no = 0;
            ns = sqq > 0 ? sqx / sqq : 0;
        }
        if (!(ns > 0))
            break;
        scale = (float)ns;
        off = (float)no;
    }
    *out_scale = best_scale;
    *out_min = -best_off;
}

/* Pack 8 six-bit scales and 8 six-bit mins into the 12-byte Q4_K / Q5_K field. */
static void pack_scales_mins(uint8_t scales[12], const int sc[8], const int m[8])
{
    for (int j = 0; j < 4; j++) {
        scales[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        scales[j + 4] = (uint8_t)(m[j] | ((m[j + 4] >> 4) << 6));
        scales[j + 8] = (uint8_t)((sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4));
    }
}

/* The Q4_K / Q5_K quantizer: fit each 32-element sub-block, store the factors as 6-bit
 * multiples of d and dmin, then quantize against the decoded scales into q[256] (0..nmax). */
static void kq_quantize_sb(const float *x, int nmax, uint16_t *d_out, uint16_t *dmin_out,
                           uint8_t scales[12], uint8_t q[KVR_QK_K])
{
    float scale[8], mn[8], max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 8; j++) {
        fit_scale_min(x + 32 * j, 32, nmax, &scale[j], &mn[j]);
        max_scale = fmaxf(max_scale, scale[j]);
        max_min = fmaxf(max_min, mn[j]);
    }
    float d = max_scale / 63.0f, dmin = max_min / 63.0f;
    *d_out = kvr_f32_to_f16(d);
    *dmin_out = kvr_f32_to_f16(dmin);
    float id = d > 0.0f ? 1.0f / d : 0.0f, idmin = dmin > 0.0f ? 1.0f / dmin : 0.0f;
    int sc[8], m[8];
    for (int j = 0; j < 8; j++) {
        sc[j] = (int)fminf(63.0f, nearbyintf(scale[j] * id));
        m[j] = (int)fminf(63.0f, nearbyintf(mn[j] * idmin));
    }
    pack_scales_mins(scales, sc, m);
    /* Quantize against the scales as they will be decoded (fp16 d, 6-bit factors). */
    float dd = kvr_f16_to_f32(*d_out), ddmin = kvr_f16_to_f32(*dmin_out);
    for (int j = 0; j < 8; j++) {
        float s = dd * (float)sc[j], o = ddmin * (float)m[j];
        float is = s > 0.0f ? 1.0f / s : 0.0f;
        for (int l = 0; l < 32; l++) {
            float v = nearbyintf((x[32 * j + l] + o) * is);
            q[32 * j + l] = (uint8_t)fminf((float)nmax, fmaxf(0.0f, v));
        }
    }
}

static void q4_k_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q4_k *b = dst;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        uint8_t q[KVR_QK_K];
        kq_quantize_sb(src + i * KVR_QK_K, 15, &b[i].d, &b[i].dmin, b[i].scales, q);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                b[i].qs[32 * c + l] = (uint8_t)(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
    }
}

static float q4_k_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q4_k *a = w;
    const struct kvr_block_q8_k *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        int32_t isum = 0, imin = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m;
            kvr_q4_k_scale_min(a[i].scales, j, &sc, &m);
            const uint8_t *q = a[i].qs + 32 * (j / 2);
            int shift = 4 * (j % 2);
            int32_t dot = 0;
            for (int l = 0; l < 32; l++)
                dot += ((q[l] >> shift) & 0x0F) * b[i].qs[32 * j + l];
            isum += sc * dot;
            imin += m * (b[i].bsums[2 * j] + b[i].bsums[2 * j + 1]);
        }
        float d = kvr_f16_to_f32(a[i].d) * b[i].d;
        float dmin = kvr_f16_to_f32(a[i].dmin) * b[i].d;
        sum = fmaf((float)isum, d, sum);
        sum = fmaf(-(float)imin, dmin, sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * Q6_K: super-blocks of 256 elements, 210 bytes, made of 16 sub-blocks of 16.
 *
 *   offset  size  field
 *   0       128   ql      low 4 bits of q, two halves of 64 bytes (one per 128 elements)
 *   128     64    qh      high 2 bits of q, two halves of 32 bytes
 *   192     16    scales  int8 scale of each 16-element sub-block
 *   208     2     d       fp16 super-block scale
 *
 * Inside half h (elements 128h .. 128h+127), for l in 0..31 with L = ql + 64h, H = qh + 32h:
 *   element 128h +      l : low bits L[l]      & 15, high bits (H[l] >> 0) & 3
 *   element 128h + 32 + l : low bits L[l + 32] & 15, high bits (H[l] >> 2) & 3
 *   element 128h + 64 + l : low bits L[l]      >> 4, high bits (H[l] >> 4) & 3
 *   element 128h + 96 + l : low bits L[l + 32] >> 4, high bits (H[l] >> 6) & 3
 * q = low | high << 4 in 0..63; element k = d * scales[k / 16] * (q - 32).
 * --------------------------------------------------------------------------------------- */

static void q6_k_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q6_k *b = src;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        int8_t q[KVR_QK_K];
        kvr_q6_k_unpack(&b[i], q);
        float d = kvr_f16_to_f32(b[i].d);
        for (int k = 0; k < KVR_QK_K; k++)
            dst[i * KVR_QK_K + k] = d * (float)b[i].scales[k / 16] * (float)q[k];
    }
}

/* The scales of a super-block's 16 sub-blocks of 16 elements: s[j] = m_j / q_end, m_j the
 * sub-block's element of largest magnitude (first on ties), so m_j maps to the end q_end of
 * the quant range. Returns the s[j] of largest magnitude (first on ties), sign kept. */
static float sub16_scales(const float *x, float q_end, float s[16])
{
    float smax = 0.0f, sabs = 0.0f;
    for (int j = 0; j < 16; j++) {
        float amax = 0.0f, m = 0.0f;
        for (int l = 0; l < 16; l++) {
            if (fabsf(x[16 * j + l]) > amax) {
                amax = fabsf(x[16 * j + l]);
                m = x[16 * j + l];
            }
        }
        s[j] = m / q_end;
        if (fabsf(s[j]) > sabs) {
            sabs = fabsf(s[j]);
            smax = s[j];
        }
    }
    return smax;
}

/* Per 16-element sub-block: scale s_j = m_j / -32 where m_j is its element of largest
 * magnitude (so m_j maps to q - 32 = -32, the full end of the range); the 16 scales are
 * stored as int8 multiples of d = s_max / -128, s_max being the scale of largest magnitude. */
static void q6_k_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q6_k *b = dst;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        const float *x = src + i * KVR_QK_K;
        float s[16];
        float smax = sub16_scales(x, -32.0f, s);
        float d = smax / -128.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = kvr_f32_to_f16(d);
        float dd = kvr_f16_to_f32(b[i].d);
        uint8_t q[KVR_QK_K];
        for (int j = 0; j < 16; j++) {
            float sc = fminf(127.0f, fmaxf(-128.0f, nearbyintf(s[j] * id)));
            b[i].scales[j] = (int8_t)sc;
            float step = dd * sc;
            float is = step != 0.0f ? 1.0f / step : 0.0f;
            for (int l = 0; l < 16; l++) {
                float v = nearbyintf(x[16 * j + l] * is);
                q[16 * j + l] = (uint8_t)(fminf(31.0f, fmaxf(-32.0f, v)) + 32.0f);
            }
        }
        for (int h = 0; h < 2; h++) {
            uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const uint8_t *y = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                ql[l] = (uint8_t)((y[l] & 0x0F) | ((y[l + 64] & 0x0F) << 4));
                ql[l + 32] = (uint8_t)((y[l + 32] & 0x0F) | ((y[l + 96] & 0x0F) << 4));
                qh[l] = (uint8_t)((y[l] >> 4) | ((y[l + 32] >> 4) << 2) | ((y[l + 64] >> 4) << 4) |
                                  ((y[l + 96] >> 4) << 6));
            }
        }
    }
}

static float q6_k_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q6_k *a = w;
    const struct kvr_block_q8_k *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        int8_t q[KVR_QK_K];
        kvr_q6_k_unpack(&a[i], q);
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            int32_t dot = 0;
            for (int l = 16 * j; l < 16 * j + 16; l++)
                dot += q[l] * b[i].qs[l];
            isum += a[i].scales[j] * dot;
        }
        float d = kvr_f16_to_f32(a[i].d) * b[i].d;
        sum = fmaf((float)isum, d, sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * Q2_K: super-blocks of 256 elements, 84 bytes, made of 16 sub-blocks of 16.
 *
 *   offset  size  field
 *   0       16    scales  byte k: bits 0-3 scale sc[k], bits 4-7 min m[k] of sub-block k
 *   16      64    qs      2-bit quants: element 128h + 32j + l (h 0..1, j 0..3, l 0..31)
 *                         is bits 2j..2j+1 of byte 32h + l
 *   80      2     d       fp16 scale of the scales
 *   82      2     dmin    fp16 scale of the mins
 *
 * Element e of sub-block k = e / 16: d * sc[k] * q - dmin * m[k], q in 0..3. Dot: as Q4_K
 * (isum of sc * q * x, imin of m * bsum, per 16 elements).
 *
 * Q3_K: super-blocks of 256 elements, 110 bytes, 16 sub-blocks of 16.
 *
 *   offset  size  field
 *   0       32    hmask   bit 2 of q: element 128h + 32j + l is bit 4h + j of byte l
 *   32      64    qs      bits 0-1 of q, laid out as Q2_K's
 *   96      12    scales  16 six-bit scales (stored + 32), packed: bits 0-3 of scale k in
 *                         the low nibble of byte k (k < 8) or the high nibble of byte k - 8;
 *                         bits 4-5 in byte 8 + k % 4 at bit 2 * (k / 4)
 *   108     2     d       fp16
 *
 * Element e = d * s[e / 16] * (q - 4), q in 0..7, s in -32..31. Dot: isum of s * (q - 4) * x.
 * --------------------------------------------------------------------------------------- */

static inline int q2_bits(const uint8_t *qs, int e)
{
    return (qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3;
}

static inline int q3_quant(const struct kvr_block_q3_k *b, int e)
{
    int hbit = (b->hmask[e % 32] >> (4 * (e / 128) + (e / 32) % 4)) & 1;
    return (q2_bits(b->qs, e) | hbit << 2) - 4;
}

static void q2_k_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q2_k *b = src;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        float d = kvr_f16_to_f32(b[i].d), dmin = kvr_f16_to_f32(b[i].dmin);
        for (int e = 0; e < KVR_QK_K; e++) {
            int k = e / 16;
            float dl = d * (float)(b[i].scales[k] & 0x0F), ml = dmin * (float)(b[i].scales[k] >> 4);
            dst[i * KVR_QK_K + e] = dl * (float)q2_bits(b[i].qs, e) - ml;
        }
    }
}

static void q3_k_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q3_k *b = src;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        float d = kvr_f16_to_f32(b[i].d);
        for (int e = 0; e < KVR_QK_K; e++) {
            float dl = d * (float)kvr_q3_k_scale(b[i].scales, e / 16);
            dst[i * KVR_QK_K + e] = dl * (float)q3_quant(&b[i], e);
        }
    }
}

/* Per 16: a min/scale fit with q in 0..3; the 16 factors as 4-bit multiples of d, dmin. */
static void q2_k_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q2_k *b = dst;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        const float *x = src + i * KVR_QK_K;
        float scale[16], mn[16], max_scale = 0.0f, max_min = 0.0f;
        for (int k = 0; k < 16; k++) {
            fit_scale_min(x + 16 * k, 16, 3, &scale[k], &mn[k]);
            max_scale = fmaxf(max_scale, scale[k]);
            max_min = fmaxf(max_min, mn[k]);
        }
        b[i].d = kvr_f32_to_f16(max_scale / 15.0f);
        b[i].dmin = kvr_f32_to_f16(max_min / 15.0f);
        float dd = kvr_f16_to_f32(b[i].d), ddmin = kvr_f16_to_f32(b[i].dmin);
        float id = dd > 0.0f ? 1.0f / dd : 0.0f, idmin = ddmin > 0.0f ? 1.0f / ddmin : 0.0f;
        memset(b[i].qs, 0, sizeof b[i].qs);
        for (int k = 0; k < 16; k++) {
            int sc = (int)fminf(15.0f, nearbyintf(scale[k] * id));
            int m = (int)fminf(15.0f, nearbyintf(mn[k] * idmin));
            b[i].scales[k] = (uint8_t)(sc | m << 4);
            float s = dd * (float)sc, o = ddmin * (float)m;
            float is = s > 0.0f ? 1.0f / s : 0.0f;
            for (int e = 16 * k; e < 16 * k + 16; e++) {
                int q = (int)fminf(3.0f, fmaxf(0.0f, nearbyintf((x[e] + o) * is)));
                b[i].qs[32 * (e / 128) + e % 32] |= (uint8_t)(q << (2 * ((e / 32) % 4)));
            }
        }
    }
}

/* Per 16: scale s = m / -4 for the element m of largest magnitude (it maps to q - 4 = -4);
 * the scales as six-bit multiples of d = s_max / -32. */
static void q3_k_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q3_k *b = dst;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        const float *x = src + i * KVR_QK_K;
        float s[16];
        float smax = sub16_scales(x, -4.0f, s);
        b[i].d = kvr_f32_to_f16(smax / -32.0f);
        float dd = kvr_f16_to_f32(b[i].d);
        float id = dd != 0.0f ? 1.0f / dd : 0.0f;
        memset(b[i].hmask, 0, sizeof b[i].hmask);
        memset(b[i].qs, 0, sizeof b[i].qs);
        memset(b[i].scales, 0, sizeof b[i].scales);
        for (int k = 0; k < 16; k++) {
            int sc = (int)fminf(31.0f, fmaxf(-32.0f, nearbyintf(s[k] * id)));
            int v = sc + 32;
            if (k < 8)
                b[i].scales[k] |= (uint8_t)(v & 0x0F);
            else
                b[i].scales[k - 8] |= (uint8_t)((v & 0x0F) << 4);
            b[i].scales[8 + k % 4] |= (uint8_t)((v >> 4) << (2 * (k / 4)));
            float step = dd * (float)sc;
            float is = step != 0.0f ? 1.0f / step : 0.0f;
            for (int e = 16 * k; e < 16 * k + 16; e++) {
                int q = (int)fminf(3.0f, fmaxf(-4.0f, nearbyintf(x[e] * is))) + 4;
                b[i].qs[32 * (e / 128) + e % 32] |= (uint8_t)((q & 3) << (2 * ((e / 32) % 4)));
                b[i].hmask[e % 32] |= (uint8_t)((q >> 2) << (4 * (e / 128) + (e / 32) % 4));
            }
        }
    }
}

static float q2_k_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q2_k *a = w;
    const struct kvr_block_q8_k *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        int32_t isum = 0, imin = 0;
        for (int k = 0; k < 16; k++) {
            int32_t dot = 0;
            for (int e = 16 * k; e < 16 * k + 16; e++)
                dot += q2_bits(a[i].qs, e) * b[i].qs[e];
            isum += (a[i].scales[k] & 0x0F) * dot;
            imin += (a[i].scales[k] >> 4) * b[i].bsums[k];
        }
        sum = fmaf((float)isum, kvr_f16_to_f32(a[i].d) * b[i].d, sum);
        sum = fmaf(-(float)imin, kvr_f16_to_f32(a[i].dmin) * b[i].d, sum);
    }
    return sum;
}

static float q3_k_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q3_k *a = w;
    const struct kvr_block_q8_k *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        int32_t isum = 0;
        for (int k = 0; k < 16; k++) {
            int32_t dot = 0;
            for (int e = 16 * k; e < 16 * k + 16; e++)
                dot += q3_quant(&a[i], e) * b[i].qs[e];
            isum += kvr_q3_k_scale(a[i].scales, k) * dot;
        }
        sum = fmaf((float)isum, kvr_f16_to_f32(a[i].d) * b[i].d, sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * Q5_K: super-blocks of 256 elements, 176 bytes: Q4_K plus a fifth bit.
 *
 *   offset  size  field
 *   0       2     d       as Q4_K
 *   2       2     dmin
 *   4       12    scales  as Q4_K
 *   16      32    qh      bit 4 of q: element 32j + l (sub-block j) is bit j of byte l
 *   48      128   qs      bits 0-3 of q, laid out as Q4_K's
 *
 * Element of sub-block j = d * sc[j] * q - dmin * m[j], q in 0..31. Dot: as Q4_K.
 * --------------------------------------------------------------------------------------- */

static inline int q5_k_quant(const struct kvr_block_q5_k *b, int e)
{
    int j = e / 32, l = e % 32;
    int lo = (b->qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
    return lo | ((b->qh[l] >> j) & 1) << 4;
}

static void q5_k_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q5_k *b = src;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        float d = kvr_f16_to_f32(b[i].d), dmin = kvr_f16_to_f32(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            kvr_q4_k_scale_min(b[i].scales, j, &sc, &m);
            float dl = d * (float)sc, ml = dmin * (float)m;
            for (int l = 0; l < 32; l++)
                dst[i * KVR_QK_K + 32 * j + l] = dl * (float)q5_k_quant(&b[i], 32 * j + l) - ml;
        }
    }
}

static void q5_k_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q5_k *b = dst;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        uint8_t q[KVR_QK_K];
        kq_quantize_sb(src + i * KVR_QK_K, 31, &b[i].d, &b[i].dmin, b[i].scales, q);
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int c = 0; c < 4; c++) {
            for (int l = 0; l < 32; l++) {
                uint8_t lo = q[64 * c + l], hi = q[64 * c + 32 + l];
                b[i].qs[32 * c + l] = (uint8_t)((lo & 0x0F) | (hi & 0x0F) << 4);
                b[i].qh[l] |= (uint8_t)((lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1));
            }
        }
    }
}

static float q5_k_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_q5_k *a = w;
    const struct kvr_block_q8_k *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        int32_t isum = 0, imin = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m;
            kvr_q4_k_scale_min(a[i].scales, j, &sc, &m);
            int32_t dot = 0;
            for (int l = 0; l < 32; l++)
                dot += q5_k_quant(&a[i], 32 * j + l) * b[i].qs[32 * j + l];
            isum += sc * dot;
            imin += m * (b[i].bsums[2 * j] + b[i].bsums[2 * j + 1]);
        }
        sum = fmaf((float)isum, kvr_f16_to_f32(a[i].d) * b[i].d, sum);
        sum = fmaf(-(float)imin, kvr_f16_to_f32(a[i].dmin) * b[i].d, sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * IQ4_XS: super-blocks of 256 elements, 136 bytes, 8 sub-blocks of 32.
 *
 *   offset  size  field
 *   0       2     d         fp16
 *   2       2     scales_h  bits 4-5 of scale j at bits 2j..2j+1 (little-endian)
 *   4       4     scales_l  bits 0-3 of scale j in the low (j even) or high nibble of byte j/2
 *   8       128   qs        sub-block j in bytes 16j..16j+15, laid out as an IQ4_NL block
 *
 * Element l of sub-block j = d * s[j] * kvr_iq4_values[q], s = stored scale - 32.
 * Dot: isum of s * value * x over the super-block, then one fmaf with d_w * d_x.
 * --------------------------------------------------------------------------------------- */

static void iq4_xs_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_iq4_xs *b = src;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        float d = kvr_f16_to_f32(b[i].d);
        for (int j = 0; j < 8; j++) {
            float dl = d * (float)kvr_iq4_xs_scale(&b[i], j);
            for (int l = 0; l < 32; l++)
                dst[i * KVR_QK_K + 32 * j + l] =
                    dl * (float)kvr_iq4_values[q4_quant(b[i].qs + 16 * j, l)];
        }
    }
}

static void iq4_xs_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_iq4_xs *b = dst;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        const float *x = src + i * KVR_QK_K;
        float s[8], smax = 0.0f, sabs = 0.0f;
        for (int j = 0; j < 8; j++) {
            s[j] = iq4_best_step(x + 32 * j, 32);
            if (fabsf(s[j]) > sabs) {
                sabs = fabsf(s[j]);
                smax = s[j];
            }
        }
        b[i].d = kvr_f32_to_f16(smax / -32.0f);
        float dd = kvr_f16_to_f32(b[i].d);
        float id = dd != 0.0f ? 1.0f / dd : 0.0f;
        uint16_t sh = 0;
        memset(b[i].scales_l, 0, sizeof b[i].scales_l);
        for (int j = 0; j < 8; j++) {
            int sc = (int)fminf(31.0f, fmaxf(-32.0f, nearbyintf(s[j] * id)));
            int v = sc + 32;
            b[i].scales_l[j / 2] |= (uint8_t)((v & 0x0F) << (4 * (j % 2)));
            sh |= (uint16_t)((v >> 4) << (2 * j));
            uint8_t q[32];
            iq4_quantize(x + 32 * j, 32, dd * (float)sc, q);
            pack_nibbles(b[i].qs + 16 * j, q);
        }
        b[i].scales_h = sh;
    }
}

static float iq4_xs_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_iq4_xs *a = w;
    const struct kvr_block_q8_k *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        int32_t isum = 0;
        for (int j = 0; j < 8; j++) {
            int32_t dot = 0;
            for (int l = 0; l < 32; l++)
                dot += kvr_iq4_values[q4_quant(a[i].qs + 16 * j, l)] * b[i].qs[32 * j + l];
            isum += kvr_iq4_xs_scale(&a[i], j) * dot;
        }
        sum = fmaf((float)isum, kvr_f16_to_f32(a[i].d) * b[i].d, sum);
    }
    return sum;
}

/* ---------------------------------------------------------------------------------------
 * The table.
 * --------------------------------------------------------------------------------------- */

/* One row per type: its name, block, dot type, reference kernels and llama_ftype. */
/* clang-format off */
#define PLAIN(ID, NAME, BYTES, FN, FTYPE) \
    [KVR_DTYPE_##ID] = {NAME, 1, BYTES, KVR_DTYPE_F32, FN##_to_float, FN##_from_float, \
                        FN##_dot, FTYPE}
#define BLOCK(ID, NAME, QK, FN, DOT, FTYPE) \
    [KVR_DTYPE_##ID] = {NAME, QK, sizeof(struct kvr_block_##FN), KVR_DTYPE_##DOT, \
                        FN##_to_float, FN##_from_float, FN##_dot, FTYPE}
/* clang-format on */

static const struct kvr_dtype_traits table[KVR_DTYPE_COUNT] = {
    PLAIN(F32, "f32", 4, f32, 0),
    PLAIN(F16, "f16", 2, f16, 1),
    PLAIN(BF16, "bf16", 2, bf16, 32),
    BLOCK(Q4_0, "q4_0", KVR_QK, q4_0, Q8_0, 2),
    BLOCK(Q4_1, "q4_1", KVR_QK, q4_1, Q8_1, 3),
    BLOCK(Q5_0, "q5_0", KVR_QK, q5_0, Q8_0, 8),
    BLOCK(Q5_1, "q5_1", KVR_QK, q5_1, Q8_1, 9),
    BLOCK(Q8_0, "q8_0", KVR_QK, q8_0, Q8_0, 7),
    BLOCK(IQ4_NL, "iq4_nl", KVR_QK, iq4_nl, Q8_0, 25),
    /* the K-quants: the file type of their _S preset (every matrix this type) */
    BLOCK(Q2_K, "q2_K", KVR_QK_K, q2_k, Q8_K, 10),
    BLOCK(Q3_K, "q3_K", KVR_QK_K, q3_k, Q8_K, 11),
    BLOCK(Q4_K, "q4_K", KVR_QK_K, q4_k, Q8_K, 14),
    BLOCK(Q5_K, "q5_K", KVR_QK_K, q5_k, Q8_K, 16),
    BLOCK(Q6_K, "q6_K", KVR_QK_K, q6_k, Q8_K, 18),
    BLOCK(IQ4_XS, "iq4_xs", KVR_QK_K, iq4_xs, Q8_K, 30),
    /* activation types: kvr_matmul refuses them as weight types; no file has them */
    BLOCK(Q8_1, "q8_1", KVR_QK, q8_1, Q8_1, -1),
    BLOCK(Q8_K, "q8_K", KVR_QK_K, q8_k, Q8_K, -1),
};

#undef PLAIN
#undef BLOCK

const struct kvr_dtype_traits *kvr_dtype_traits(int type)
{
    return type >= 0 && type < KVR_DTYPE_COUNT && table[type].name ? &table[type] : NULL;
}

int kvr_dtype_by_name(const char *name)
{
    for (int t = 0; t < KVR_DTYPE_COUNT; t++)
        if (table[t].name && !strcasecmp(table[t].name, name))
            return t;
    return -1;
}

bool kvr_dtype_is_weight(int type)
{
    return kvr_dtype_traits(type) && type != KVR_DTYPE_Q8_1 && type != KVR_DTYPE_Q8_K;
}

bool kvr_dtype_row_bytes(int type, int64_t n, size_t *out_bytes)
{
    const struct kvr_dtype_traits *t = kvr_dtype_traits(type);
    if (!t || n < 0 || n % t->block_elems != 0)
        return false;
    return kvr_mul_size((size_t)(n / t->block_elems), t->block_bytes, out_bytes);
}
