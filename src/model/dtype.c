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
 *     values, then acc = fmaf((float)isum, d_w * d_x, acc). Q4_K adds a second step for its
 *     mins, acc = fmaf(-(float)imin, dmin_w * d_x, acc).
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
    if (x < 0x38800000) { /* below 2^-14: subnormal half (or zero) */
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
#define F32_FAMILY_DOT(name, wtype, load)                                                     \
    static float name(int64_t n, const void *w, const void *x)                                \
    {                                                                                         \
        const wtype *a = w;                                                                   \
        const float *b = x;                                                                   \
        float lane[8] = {0};                                                                  \
        int64_t n8 = n - n % 8;                                                               \
        for (int64_t i = 0; i < n8; i += 8)                                                   \
            for (int l = 0; l < 8; l++)                                                       \
                lane[l] = fmaf(load(a[i + l]), b[i + l], lane[l]);                            \
        float sum = ((lane[0] + lane[4]) + (lane[2] + lane[6])) +                             \
                    ((lane[1] + lane[5]) + (lane[3] + lane[7]));                              \
        for (int64_t i = n8; i < n; i++)                                                      \
            sum = fmaf(load(a[i]), b[i], sum);                                                \
        return sum;                                                                           \
    }

static inline float load_f32(float v) { return v; }
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

static void q8_0_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / KVR_QK; i++) {
        const float *x = src + i * KVR_QK;
        float amax = 0.0f;
        for (int j = 0; j < KVR_QK; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = kvr_f32_to_f16(d);
        for (int j = 0; j < KVR_QK; j++)
            b[i].qs[j] = (int8_t)nearbyintf(x[j] * id);
    }
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

/* Fit x[0..31] ~ scale * q - mn with q in 0..15, mn >= 0: start from the min/max range, then
 * refine scale and offset by least squares on the chosen q a few times (the error can only
 * go down or the previous fit is kept). */
static void q4_k_fit(const float *x, float *out_scale, float *out_min)
{
    float lo = x[0], hi = x[0];
    for (int l = 1; l < 32; l++) {
        lo = fminf(lo, x[l]);
        hi = fmaxf(hi, x[l]);
    }
    lo = fminf(lo, 0.0f); /* the format subtracts a non-negative min */
    if (hi <= lo) {
        *out_scale = 0.0f;
        *out_min = -lo;
        return;
    }
    float scale = (hi - lo) / 15.0f, off = lo; /* x ~ scale * q + off */
    float best_err = INFINITY, best_scale = scale, best_off = off;
    for (int iter = 0; iter < 5; iter++) {
        float err = 0.0f;
        double sq = 0, sqq = 0, sx = 0, sqx = 0;
        for (int l = 0; l < 32; l++) {
            float q = fminf(15.0f, fmaxf(0.0f, nearbyintf((x[l] - off) / scale)));
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
        double det = 32.0 * sqq - sq * sq;
        if (det <= 0)
            break;
        double ns = (32.0 * sqx - sq * sx) / det;
        double no = (sx - ns * sq) / 32.0;
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

static void q4_k_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q4_k *b = dst;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        const float *x = src + i * KVR_QK_K;
        float scale[8], mn[8], max_scale = 0.0f, max_min = 0.0f;
        for (int j = 0; j < 8; j++) {
            q4_k_fit(x + 32 * j, &scale[j], &mn[j]);
            max_scale = fmaxf(max_scale, scale[j]);
            max_min = fmaxf(max_min, mn[j]);
        }
        float d = max_scale / 63.0f, dmin = max_min / 63.0f;
        b[i].d = kvr_f32_to_f16(d);
        b[i].dmin = kvr_f32_to_f16(dmin);
        float id = d > 0.0f ? 1.0f / d : 0.0f, idmin = dmin > 0.0f ? 1.0f / dmin : 0.0f;
        int sc[8], m[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = (int)fminf(63.0f, nearbyintf(scale[j] * id));
            m[j] = (int)fminf(63.0f, nearbyintf(mn[j] * idmin));
        }
        for (int j = 0; j < 4; j++) {
            b[i].scales[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
            b[i].scales[j + 4] = (uint8_t)(m[j] | ((m[j + 4] >> 4) << 6));
            b[i].scales[j + 8] = (uint8_t)((sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4));
        }
        /* Quantize against the scales as they will be decoded (fp16 d, 6-bit factors). */
        float dd = kvr_f16_to_f32(b[i].d), ddmin = kvr_f16_to_f32(b[i].dmin);
        uint8_t q[KVR_QK_K];
        for (int j = 0; j < 8; j++) {
            float s = dd * (float)sc[j], o = ddmin * (float)m[j];
            float is = s > 0.0f ? 1.0f / s : 0.0f;
            for (int l = 0; l < 32; l++) {
                float v = nearbyintf((x[32 * j + l] + o) * is);
                q[32 * j + l] = (uint8_t)fminf(15.0f, fmaxf(0.0f, v));
            }
        }
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

static void q6_k_unpack(const struct kvr_block_q6_k *b, int8_t q[KVR_QK_K])
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

static void q6_k_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q6_k *b = src;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        int8_t q[KVR_QK_K];
        q6_k_unpack(&b[i], q);
        float d = kvr_f16_to_f32(b[i].d);
        for (int k = 0; k < KVR_QK_K; k++)
            dst[i * KVR_QK_K + k] = d * (float)b[i].scales[k / 16] * (float)q[k];
    }
}

/* Per 16-element sub-block: scale s_j = m_j / -32 where m_j is its element of largest
 * magnitude (so m_j maps to q - 32 = -32, the full end of the range); the 16 scales are
 * stored as int8 multiples of d = s_max / -128, s_max being the scale of largest magnitude. */
static void q6_k_from_float(const float *src, void *dst, int64_t n)
{
    struct kvr_block_q6_k *b = dst;
    for (int64_t i = 0; i < n / KVR_QK_K; i++) {
        const float *x = src + i * KVR_QK_K;
        float s[16], smax = 0.0f, sabs = 0.0f;
        for (int j = 0; j < 16; j++) {
            float amax = 0.0f, m = 0.0f;
            for (int l = 0; l < 16; l++) {
                if (fabsf(x[16 * j + l]) > amax) {
                    amax = fabsf(x[16 * j + l]);
                    m = x[16 * j + l];
                }
            }
            s[j] = m / -32.0f;
            if (fabsf(s[j]) > sabs) {
                sabs = fabsf(s[j]);
                smax = s[j];
            }
        }
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
        q6_k_unpack(&a[i], q);
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
 * The table.
 * --------------------------------------------------------------------------------------- */

static const struct kvr_dtype_traits traits_f32 = {
    "f32", 1, 4, KVR_DTYPE_F32, f32_to_float, f32_from_float, f32_dot};
static const struct kvr_dtype_traits traits_f16 = {
    "f16", 1, 2, KVR_DTYPE_F32, f16_to_float, f16_from_float, f16_dot};
static const struct kvr_dtype_traits traits_bf16 = {
    "bf16", 1, 2, KVR_DTYPE_F32, bf16_to_float, bf16_from_float, bf16_dot};
static const struct kvr_dtype_traits traits_q8_0 = {
    "q8_0", KVR_QK, sizeof(struct kvr_block_q8_0), KVR_DTYPE_Q8_0,
    q8_0_to_float, q8_0_from_float, q8_0_dot};
static const struct kvr_dtype_traits traits_q4_0 = {
    "q4_0", KVR_QK, sizeof(struct kvr_block_q4_0), KVR_DTYPE_Q8_0,
    q4_0_to_float, q4_0_from_float, q4_0_dot};
static const struct kvr_dtype_traits traits_q4_k = {
    "q4_K", KVR_QK_K, sizeof(struct kvr_block_q4_k), KVR_DTYPE_Q8_K,
    q4_k_to_float, q4_k_from_float, q4_k_dot};
static const struct kvr_dtype_traits traits_q6_k = {
    "q6_K", KVR_QK_K, sizeof(struct kvr_block_q6_k), KVR_DTYPE_Q8_K,
    q6_k_to_float, q6_k_from_float, q6_k_dot};
/* Q8_K is an activation type: kvr_matmul refuses it as a weight type. */
static const struct kvr_dtype_traits traits_q8_k = {
    "q8_K", KVR_QK_K, sizeof(struct kvr_block_q8_k), KVR_DTYPE_Q8_K,
    q8_k_to_float, q8_k_from_float, q8_k_dot};

const struct kvr_dtype_traits *kvr_dtype_traits(int type)
{
    switch (type) {
    case KVR_DTYPE_F32: return &traits_f32;
    case KVR_DTYPE_F16: return &traits_f16;
    case KVR_DTYPE_BF16: return &traits_bf16;
    case KVR_DTYPE_Q8_0: return &traits_q8_0;
    case KVR_DTYPE_Q4_0: return &traits_q4_0;
    case KVR_DTYPE_Q4_K: return &traits_q4_k;
    case KVR_DTYPE_Q6_K: return &traits_q6_k;
    case KVR_DTYPE_Q8_K: return &traits_q8_k;
    default: return NULL;
    }
}

bool kvr_dtype_row_bytes(int type, int64_t n, size_t *out_bytes)
{
    const struct kvr_dtype_traits *t = kvr_dtype_traits(type);
    if (!t || n < 0 || n % t->block_elems != 0)
        return false;
    return kvr_mul_size((size_t)(n / t->block_elems), t->block_bytes, out_bytes);
}
