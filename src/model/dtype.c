/* dtype.c - the table of weight/activation type traits and the scalar reference kernels (those
 * of the K-quants are in dtype_kquant.c).
 *
 * Everything here is plain C11 with no SIMD: it is the definition the fast kernels
 * (kernels/) are tested against. Each quantized type's GGUF block layout is given as a
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
#include "model/dtype_kquant.h"
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
 * MXFP4 (OCP microscaling FP4, gpt-oss's experts): blocks of 32 elements, 17 bytes.
 *
 *   offset  size  field
 *   0       1     e      E8M0 scale: 2^(e - 127), no sign or mantissa
 *   1       16    qs     E2M1 codes laid out as Q4_0 (byte j: element j low, j + 16 high)
 *
 * Element = kvr_mxfp4_values[q] * kvr_e8m0_half(e): the E2M1 value doubled to an integer
 * (code 7 = 6.0 -> 12) times half the scale, which is the same number. Dotted with Q8_0 like
 * IQ4_NL: isum of the doubled values times the quants, acc = fmaf((float)isum, d_w * d_x,
 * acc) with d_w the half scale (a power of two, so the product is exact). Quantization: e =
 * floor(log2(max|x|)) - 2 + 127, so the largest element lands in [8, 16) halves, codes the
 * nearest value (ties to the lower code; above 12 clamps to 12).
 * --------------------------------------------------------------------------------------- */

static void mxfp4_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_mxfp4 *b = src;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        float d = kvr_e8m0_half(b[i].e);
        for (int j = 0; j < KVR_QK; j++)
            dst[i * KVR_QK + j] = (float)kvr_mxfp4_values[q4_quant(b[i].qs, j)] * d;
    }
}

static int mxfp4_nearest(float v)
{
    int best = 0;
    float best_e = fabsf(v - (float)kvr_mxfp4_values[0]);
    for (int k = 1; k < 16; k++) {
        float e = fabsf(v - (float)kvr_mxfp4_values[k]);
        if (e < best_e) {
            best_e = e;
            best = k;
        }
    }
    return best;
}

static void mxfp4_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_mxfp4 *b = dst;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        const float *x = src + i * KVR_QK;
        float amax = 0.0f;
        for (int j = 0; j < KVR_QK; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        int e = amax > 0.0f ? (int)floorf(log2f(amax)) - 2 + 127 : 0;
        b[i].e = (uint8_t)(e < 0 ? 0 : e > 254 ? 254 : e);
        float id = 1.0f / kvr_e8m0_half(b[i].e);
        uint8_t q[KVR_QK];
        for (int j = 0; j < KVR_QK; j++)
            q[j] = (uint8_t)mxfp4_nearest(x[j] * id);
        pack_nibbles(b[i].qs, q);
    }
}

static float mxfp4_dot(int64_t n, const void *w, const void *x)
{
    const struct kvr_block_mxfp4 *a = w;
    const struct kvr_block_q8_0 *b = x;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < KVR_QK; j++)
            isum += kvr_mxfp4_values[q4_quant(a[i].qs, j)] * b[i].qs[j];
        float d = kvr_e8m0_half(a[i].e) * kvr_f16_to_f32(b[i].d);
        sum = fmaf((float)isum, d, sum);
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
#define KQUANT(ID, NAME, FN, FTYPE) \
    [KVR_DTYPE_##ID] = {NAME, KVR_QK_K, sizeof(struct kvr_block_##FN), KVR_DTYPE_Q8_K, \
                        kvr_##FN##_to_float, kvr_##FN##_from_float, kvr_##FN##_dot, FTYPE}
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
    BLOCK(MXFP4, "mxfp4", KVR_QK, mxfp4, Q8_0, 38), /* file type: MXFP4_MOE */
    /* the K-quants: the file type of their _S preset (every matrix this type) */
    KQUANT(Q2_K, "q2_K", q2_k, 10),
    KQUANT(Q3_K, "q3_K", q3_k, 11),
    KQUANT(Q4_K, "q4_K", q4_k, 14),
    KQUANT(Q5_K, "q5_K", q5_k, 16),
    KQUANT(Q6_K, "q6_K", q6_k, 18),
    BLOCK(IQ4_XS, "iq4_xs", KVR_QK_K, iq4_xs, Q8_K, 30),
    /* activation types: kvr_matmul refuses them as weight types; no file has them */
    BLOCK(Q8_1, "q8_1", KVR_QK, q8_1, Q8_1, -1),
    KQUANT(Q8_K, "q8_K", q8_k, -1),
};

#undef PLAIN
#undef BLOCK
#undef KQUANT

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
