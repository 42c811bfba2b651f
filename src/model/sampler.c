/* sampler.c - penalties, top-k, top-p, min-p, temperature and a seeded draw (see sampler.h
 * for the chain and its exact formulas). */
#include "model/sampler.h"

#include "core/alloc.h"
#include "core/rng.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- parameters ----------------------------------------------------------------------- */

void kvr_sample_params_default(struct kvr_sample_params *p)
{
    memset(p, 0, sizeof *p);
    p->temperature = 0.8f;
    p->top_k = 40;
    p->top_p = 0.95f;
    p->min_p = 0.05f;
    p->repeat_penalty = 1.0f;
    p->frequency_penalty = 0.0f;
    p->presence_penalty = 0.0f;
    p->repeat_last_n = 64;
    p->seed = 0;
}

int kvr_sample_params_check(const struct kvr_sample_params *p, struct kvr_err *err)
{
    if (isnan(p->temperature) || isinf(p->temperature))
        return kvr_err_set(err, KVR_EINVAL, "sampler: temperature %g is not finite",
                           (double)p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return kvr_err_set(err, KVR_EINVAL, "sampler: top_p %g outside (0, 1]", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return kvr_err_set(err, KVR_EINVAL, "sampler: min_p %g outside [0, 1]", (double)p->min_p);
    if (!(p->repeat_penalty > 0.0f) || isinf(p->repeat_penalty))
        return kvr_err_set(err, KVR_EINVAL, "sampler: repeat_penalty %g must be positive",
                           (double)p->repeat_penalty);
    if (!isfinite(p->frequency_penalty))
        return kvr_err_set(err, KVR_EINVAL, "sampler: frequency_penalty is not finite");
    if (!isfinite(p->presence_penalty))
        return kvr_err_set(err, KVR_EINVAL, "sampler: presence_penalty is not finite");
    if (p->repeat_last_n < -1 || p->repeat_last_n > KVR_SAMPLER_MAX_LAST_N)
        return kvr_err_set(err, KVR_EINVAL, "sampler: repeat_last_n %d outside -1..%d",
                           (int)p->repeat_last_n, KVR_SAMPLER_MAX_LAST_N);
    if (p->n_bias > KVR_SAMPLER_MAX_BIAS)
        return kvr_err_set(err, KVR_EINVAL, "sampler: %u logit biases, at most %d",
                           (unsigned)p->n_bias, KVR_SAMPLER_MAX_BIAS);
    for (uint32_t i = 0; i < p->n_bias; i++) {
        if (p->bias[i].id < 0 || !(p->bias[i].bias >= -100.0f && p->bias[i].bias <= 100.0f))
            return kvr_err_set(err, KVR_EINVAL,
                               "sampler: logit bias %u (token %d, %g) needs an "
                               "id >= 0 and a bias in [-100, 100]",
                               (unsigned)i, (int)p->bias[i].id, (double)p->bias[i].bias);
        for (uint32_t k = 0; k < i; k++)
            if (p->bias[k].id == p->bias[i].id)
                return kvr_err_set(err, KVR_EINVAL, "sampler: token %d is biased twice",
                                   (int)p->bias[i].id);
    }
    return 0;
}

int kvr_sampler_add_bias(struct kvr_sampler *s, int32_t id, float bias)
{
    struct kvr_sample_params *p = &s->params;
    if (id < 0 || !(bias >= -100.0f && bias <= 100.0f))
        return KVR_EINVAL;
    for (uint32_t i = 0; i < p->n_bias; i++)
        if (p->bias[i].id == id) {
            p->bias[i].bias = bias;
            return 0;
        }
    if (p->n_bias >= KVR_SAMPLER_MAX_BIAS)
        return KVR_EFULL;
    p->bias[p->n_bias++] = (struct kvr_logit_bias){id, bias};
    return 0;
}

/* ---- generator ------------------------------------------------------------------------- */

double kvr_sampler_uniform(struct kvr_sampler *s)
{
    s->n_draws++;
    /* The top 53 bits as a double in [0, 1), exactly. */
    return (double)(kvr_xoshiro_next(s->rng) >> 11) * 0x1.0p-53;
}

int kvr_sampler_init(struct kvr_sampler *s, const struct kvr_sample_params *p, struct kvr_err *err)
{
    memset(s, 0, sizeof *s);
    int rc = kvr_sample_params_check(p, err);
    if (rc)
        return rc;
    s->params = *p;
    if (s->params.repeat_last_n < 0)
        s->params.repeat_last_n = KVR_SAMPLER_MAX_LAST_N;
    kvr_xoshiro_seed(s->rng, p->seed);
    return 0;
}

void kvr_sampler_fini(struct kvr_sampler *s)
{
    memset(s, 0, sizeof *s);
}

void kvr_sampler_accept(struct kvr_sampler *s, int32_t token)
{
    s->recent[s->head] = token;
    s->head = (s->head + 1) % KVR_SAMPLER_MAX_LAST_N;
    if (s->n_recent < KVR_SAMPLER_MAX_LAST_N)
        s->n_recent++;
}

/* ---- scratch ---------------------------------------------------------------------------- */

struct kvr_sample_scratch {
    int32_t n_vocab;
    struct kvr_sample_cand *cand; /* [n_vocab] */
};

int kvr_sample_scratch_create(struct kvr_sample_scratch **out, int32_t n_vocab)
{
    *out = NULL;
    if (n_vocab < 1)
        return KVR_EINVAL;
    struct kvr_sample_scratch *sc = kvr_calloc(1, sizeof *sc);
    if (!sc)
        return KVR_ENOMEM;
    sc->n_vocab = n_vocab;
    sc->cand = kvr_calloc((size_t)n_vocab, sizeof *sc->cand);
    if (!sc->cand) {
        kvr_free(sc);
        return KVR_ENOMEM;
    }
    *out = sc;
    return 0;
}

void kvr_sample_scratch_destroy(struct kvr_sample_scratch *sc)
{
    if (!sc)
        return;
    kvr_free(sc->cand);
    kvr_free(sc);
}

/* ---- the chain -------------------------------------------------------------------------- */

/* The total order every step uses: larger logit first, then lower id. */
static bool better(const struct kvr_sample_cand *a, const struct kvr_sample_cand *b)
{
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int cmp_better(const void *pa, const void *pb)
{
    const struct kvr_sample_cand *a = pa, *b = pb;
    return better(a, b) ? -1 : better(b, a) ? 1 : 0;
}

static void swap(struct kvr_sample_cand *a, struct kvr_sample_cand *b)
{
    struct kvr_sample_cand t = *a;
    *a = *b;
    *b = t;
}

/* Sift down in a binary heap over c[0..n) whose root is the worst element (root_best
 * false) or the best one (root_best true). */
static void sift(struct kvr_sample_cand *c, int32_t n, int32_t i, bool root_best)
{
    for (;;) {
        int32_t l = 2 * i + 1, w = i;
        for (int32_t k = l; k < l + 2 && k < n; k++)
            if (root_best ? better(&c[k], &c[w]) : better(&c[w], &c[k]))
                w = k;
        if (w == i)
            return;
        swap(&c[i], &c[w]);
        i = w;
    }
}

/* Move the k best of c[0..n) to c[0..k), sorted best first: O(n log k) with a heap of the
 * k best seen so far whose root is the worst of them. */
static void top_k(struct kvr_sample_cand *c, int32_t n, int32_t k)
{
    for (int32_t i = k / 2 - 1; i >= 0; i--)
        sift(c, k, i, false);
    for (int32_t i = k; i < n; i++) {
        if (better(&c[i], &c[0])) {
            swap(&c[i], &c[0]);
            sift(c, k, 0, false);
        }
    }
    qsort(c, (size_t)k, sizeof *c, cmp_better);
}

/* Top-p on unsorted candidates without sorting them all: pop the best one at a time from a
 * heap (O(n + m log n) for m kept) until their weights exp(logit - ref) reach `want`. The
 * kept ones end up in c[0..m), best first, exactly as a full sort would order them. */
static int32_t top_p_heap(struct kvr_sample_cand *c, int32_t n, double ref, double want)
{
    for (int32_t i = n / 2 - 1; i >= 0; i--)
        sift(c, n, i, true);
    int32_t end = n;
    double cum = 0.0;
    while (end > 0) {
        /* The best of c[0..end) moves to c[end - 1]: popped ones collect at the back, the
         * best at n - 1. */
        swap(&c[0], &c[end - 1]);
        end--;
        sift(c, end, 0, true);
        cum += exp((double)c[end].logit - ref);
        if (cum >= want)
            break;
    }
    int32_t m = n - end;
    for (int32_t i = 0; i < m / 2; i++)
        swap(&c[end + i], &c[n - 1 - i]);
    memmove(c, c + end, (size_t)m * sizeof *c);
    return m;
}

/* Step 1, on candidates still indexed by id. */
static void apply_penalties(const struct kvr_sampler *s, struct kvr_sample_cand *c, int32_t n)
{
    const struct kvr_sample_params *p = &s->params;
    uint32_t w = (uint32_t)p->repeat_last_n;
    if (w > s->n_recent)
        w = s->n_recent;
    if (w == 0 ||
        (p->repeat_penalty == 1.0f && p->frequency_penalty == 0.0f && p->presence_penalty == 0.0f))
        return;
    /* The window's tokens, sorted so each distinct token is one run. */
    int32_t win[KVR_SAMPLER_MAX_LAST_N];
    for (uint32_t i = 0; i < w; i++)
        win[i] = s->recent[(s->head + KVR_SAMPLER_MAX_LAST_N - 1 - i) % KVR_SAMPLER_MAX_LAST_N];
    for (uint32_t i = 1; i < w; i++) { /* insertion sort: w <= 256 */
        int32_t v = win[i];
        uint32_t j = i;
        for (; j > 0 && win[j - 1] > v; j--)
            win[j] = win[j - 1];
        win[j] = v;
    }
    for (uint32_t i = 0; i < w;) {
        uint32_t j = i;
        while (j < w && win[j] == win[i])
            j++;
        int32_t id = win[i];
        float count = (float)(j - i);
        i = j;
        if (id < 0 || id >= n)
            continue;
        float l = c[id].logit;
        l = l > 0.0f ? l / p->repeat_penalty : l * p->repeat_penalty;
        l -= count * p->frequency_penalty + p->presence_penalty;
        c[id].logit = l;
    }
}

/* Steps 1-5. *lse receives log(sum(exp(penalised logits))) over the whole vocabulary when
 * lse is non-NULL. */
static int32_t run_chain(const struct kvr_sampler *s, const float *logits, int32_t n,
                         struct kvr_sample_scratch *sc, const struct kvr_sample_cand **out,
                         double *lse)
{
    if (n < 1 || n > sc->n_vocab)
        return KVR_EINVAL;
    const struct kvr_sample_params *p = &s->params;
    struct kvr_sample_cand *c = sc->cand;
    for (int32_t i = 0; i < n; i++) {
        float l = logits[i];
        /* NaN can never be chosen; +inf would poison every softmax below. */
        if (isnan(l))
            l = -INFINITY;
        else if (l == INFINITY)
            l = FLT_MAX;
        c[i] = (struct kvr_sample_cand){i, l, 0.0f};
    }
    for (uint32_t k = 0; k < p->n_bias; k++)
        if (p->bias[k].id < n)
            c[p->bias[k].id].logit += p->bias[k].bias;
    apply_penalties(s, c, n);

    int32_t best = 0;
    for (int32_t i = 1; i < n; i++)
        if (better(&c[i], &c[best]))
            best = i;
    float lmax = c[best].logit;
    if (lmax == -INFINITY)
        return KVR_EINVAL;
    if (lse) {
        double sum = 1.0; /* the best token's own term, exp(0) */
        for (int32_t i = 0; i < n; i++)
            if (i != best)
                sum += exp((double)c[i].logit - (double)lmax);
        *lse = (double)lmax + log(sum);
    }

    if (p->temperature <= 0.0f) {
        swap(&c[0], &c[best]);
        c[0].prob = 1.0f;
        *out = c;
        return 1;
    }

    bool sorted = false;
    if (p->top_k > 0 && p->top_k < n) {
        top_k(c, n, p->top_k);
        n = p->top_k;
        sorted = true;
    }
    if (p->top_p < 1.0f) {
        /* lmax is the best candidate's logit whether or not top-k sorted them. */
        double sum = 0.0;
        for (int32_t i = 0; i < n; i++)
            sum += exp((double)c[i].logit - (double)lmax);
        double cum = 0.0, want = (double)p->top_p * sum;
        if (sorted) {
            for (int32_t i = 0; i < n; i++) {
                cum += exp((double)c[i].logit - (double)lmax);
                if (cum >= want) {
                    n = i + 1;
                    break;
                }
            }
        } else {
            n = top_p_heap(c, n, (double)lmax, want);
        }
    }
    if (p->min_p > 0.0f) {
        float floor_logit = lmax + logf(p->min_p);
        int32_t m = 0;
        for (int32_t i = 0; i < n; i++)
            if (c[i].logit >= floor_logit)
                c[m++] = c[i];
        n = m; /* never 0: the top token passes since ln(min_p) <= 0 */
    }

    /* Step 5. The top logit is still among the candidates (no step removes it). */
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++)
        sum += exp(((double)c[i].logit - (double)lmax) / (double)p->temperature);
    for (int32_t i = 0; i < n; i++)
        c[i].prob =
            (float)(exp(((double)c[i].logit - (double)lmax) / (double)p->temperature) / sum);
    *out = c;
    return n;
}

int32_t kvr_sampler_candidates(const struct kvr_sampler *s, const float *logits, int32_t n_vocab,
                               struct kvr_sample_scratch *sc, const struct kvr_sample_cand **out)
{
    return run_chain(s, logits, n_vocab, sc, out, NULL);
}

int32_t kvr_sampler_sample(struct kvr_sampler *s, const float *logits, int32_t n_vocab,
                           struct kvr_sample_scratch *sc, float *logprob_out)
{
    const struct kvr_sample_cand *c;
    double lse = 0.0;
    int32_t n = run_chain(s, logits, n_vocab, sc, &c, logprob_out ? &lse : NULL);
    if (n < 0)
        return n;
    int32_t pick = 0;
    if (s->params.temperature > 0.0f) {
        /* Walk the cumulative probabilities, recomputed in double from the weights so the
         * float rounding of .prob cannot leave a gap at the end. */
        double lmax = c[0].logit, t = s->params.temperature, sum = 0.0;
        for (int32_t i = 1; i < n; i++)
            if (c[i].logit > lmax)
                lmax = c[i].logit;
        for (int32_t i = 0; i < n; i++)
            sum += exp(((double)c[i].logit - lmax) / t);
        double target = kvr_sampler_uniform(s) * sum, cum = 0.0;
        pick = -1;
        for (int32_t i = 0; i < n; i++) {
            double w = exp(((double)c[i].logit - lmax) / t);
            cum += w;
            if (w > 0.0)
                pick = i; /* the last token that can be chosen, if rounding runs past */
            if (cum > target && w > 0.0)
                break;
        }
    }
    if (logprob_out)
        *logprob_out = (float)((double)c[pick].logit - lse);
    return c[pick].id;
}
