/* attn.h - internal to src/model: attention's inner loops over one KV block (query-key
 * scores, and the probability-weighted sum of values), the softmax between them, and the
 * feed-forward's gated activations, with a plain version and an AVX2 one. The engine picks one set
 * for the whole process together with the matmul kernels (kvr_kernels_name), so every
 * row of every batch uses the same arithmetic: batch invariance holds within a process.
 * Within a set, a call over n positions gives exactly what n calls over one position give
 * (tests/unit/test_attn.c), so how a sequence's positions fall into blocks never changes a
 * bit. */
#ifndef KVR_MODEL_ATTN_H
#define KVR_MODEL_ATTN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvr_attn_ops {
    /* scores[g * stride + j] = scale * sum_i q[g * hd + i] * k[j * k_step + i]
     * for the group's query heads g < group and positions j < n. */
    void (*scores)(float *scores, size_t stride, const float *q, uint32_t group, uint32_t hd,
                   const float *k, size_t k_step, uint32_t n, float scale);
    /* out[g * hd + i] += p[g * stride + j] * v[j * v_step + i], positions j in order. */
    void (*mix)(float *out, const float *p, size_t stride, uint32_t group, uint32_t hd,
                const float *v, size_t v_step, uint32_t n);
    /* scores over the keys of a half-precision cache (k holds halves, k_step halves
     * apart): the same bits as scores over the keys converted to floats (the conversion is
     * exact), without the copy. */
    void (*scores_f16)(float *scores, size_t stride, const float *q, uint32_t group, uint32_t hd,
                       const uint16_t *k, size_t k_step, uint32_t n, float scale);
    /* The softmax-weighted sum of a half-precision cache for the group's query heads g <
     * group, one position at a time with a running maximum st[2g] and sum st[2g + 1]
     * (start at -INFINITY and 0): at score p[g * stride + j] above the maximum,
     * acc[g * hd + i] = half(acc[g * hd + i] * exp(old max - p)) and the weight is 1, else
     * the weight is exp(p - max); then acc[g * hd + i] = half(fma(v[j * v_step + i], weight,
     * acc[g * hd + i])) and sum = sum * rescale + weight (kvr_online_step). v holds halves;
     * acc holds group x hd halves; the result is acc / sum. Each head's bits are those of a
     * call for that head alone. This is the rounding of llama.cpp's default attention over
     * its f16 cache, which Kvasir's f16 cache copies (docs/QUANT.md). */
    void (*mix_online_f16)(uint16_t *acc, float *st, const float *p, size_t stride, uint32_t group,
                           uint32_t hd, const uint16_t *v, size_t v_step, uint32_t n);
    /* x[i] = x[i] rounded to half (to nearest even) and back: the query of an f16 cache. */
    void (*round_half)(float *x, size_t n);
    /* x[t] = exp(x[t] - max x) / sum, in place. */
    void (*softmax)(float *x, uint32_t n);
    /* gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i]: SiLU(gate) times up. Each element
     * gives the same bits wherever it falls in the range (threads split it anywhere). */
    void (*swiglu)(float *gate, const float *up, size_t n);
    /* gate[i] = kvr_gelu_half(gate[i]) * up[i]: GeGLU (gemma). Both sets use the plain
     * loop (tanhf per element), so it is the same bits everywhere. */
    void (*geglu)(float *gate, const float *up, size_t n);
};

/* The tanh form of GELU, 0.5 h (1 + tanh(sqrt(2/pi) h (1 + 0.044715 h^2))), at half
 * precision: the input rounded to half (h), the formula in f32, the result rounded to half;
 * g itself at g >= 10 and 0 at g <= -10. That is what llama.cpp's GELU gives (a table
 * of halves); docs/QUANT.md has the measurements. */
float kvr_gelu_half(float g);
void kvr_geglu_plain(float *gate, const float *up, size_t n);
/* The running maximum, sum and rescale of one position for mix_online_f16 (both sets). */
void kvr_online_step(float *st, float p, float *rescale, float *weight);
/* kvr_online_step over positions j < m (rescale ms[j], weight vs[j]), and whether the
 * maximum grew there (grew[j]): one call per block instead of one per position. */
void kvr_online_steps(float *st, const float *p, uint32_t m, float *ms, float *vs, bool *grew);

extern const struct kvr_attn_ops kvr_attn_ops_plain;
extern const struct kvr_attn_ops kvr_attn_ops_avx2;

#endif
