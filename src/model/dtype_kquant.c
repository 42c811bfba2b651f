/* dtype_kquant.c - the scalar reference kernels of the K-quants (Q2_K, Q3_K, Q4_K, Q5_K,
 * Q6_K) and of their activation type Q8_K: the byte table of each block, its dequantizer,
 * quantizer and dot. They follow the operation order fixed at the top of dtype.c, whose
 * trait table points at them (IQ4_XS, which shares the IQ4_NL grid, is in dtype.c). Plain
 * C11, no SIMD; pure functions, no state. */
#include "model/dtype_kquant.h"
#include "model/kernels.h"

#include <math.h>
#include <string.h>

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

void kvr_q8_k_to_float(const void *src, float *dst, int64_t n)
{
    const struct kvr_block_q8_k *b = src;
    for (int64_t i = 0; i < n / KVR_QK_K; i++)
        for (int j = 0; j < KVR_QK_K; j++)
            dst[i * KVR_QK_K + j] = (float)b[i].qs[j] * b[i].d;
}

void kvr_q8_k_from_float(const float *src, void *dst, int64_t n)
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
float kvr_q8_k_dot(int64_t n, const void *w, const void *x)
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

void kvr_q4_k_to_float(const void *src, float *dst, int64_t n)
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

void kvr_q4_k_from_float(const float *src, void *dst, int64_t n)
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

float kvr_q4_k_dot(int64_t n, const void *w, const void *x)
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

void kvr_q6_k_to_float(const void *src, float *dst, int64_t n)
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
void kvr_q6_k_from_float(const float *src, void *dst, int64_t n)
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

float kvr_q6_k_dot(int64_t n, const void *w, const void *x)
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

void kvr_q2_k_to_float(const void *src, float *dst, int64_t n)
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

void kvr_q3_k_to_float(const void *src, float *dst, int64_t n)
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
void kvr_q2_k_from_float(const float *src, void *dst, int64_t n)
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
void kvr_q3_k_from_float(const float *src, void *dst, int64_t n)
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

float kvr_q2_k_dot(int64_t n, const void *w, const void *x)
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

float kvr_q3_k_dot(int64_t n, const void *w, const void *x)
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

void kvr_q5_k_to_float(const void *src, float *dst, int64_t n)
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

void kvr_q5_k_from_float(const float *src, void *dst, int64_t n)
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

float kvr_q5_k_dot(int64_t n, const void *w, const void *x)
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
