/* synth.c - random-weight GGUF models of every architecture (see synth.h for what the file
 * contains). */
#include "model/synth.h"

#include "core/rng.h"

#include "core/alloc.h"
#include "core/pool.h"
#include "model/dtype.h"
#include "model/nextn.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define BUILTIN_VOCAB_MIN 260
#define BUILTIN_VOCAB_MAX 500000
#define MAX_PIECE_BYTES 32

/* ---- shapes ------------------------------------------------------------------------ */

static const struct kvr_synth_shape named_shapes[] = {
    {.name = "tinyllama-1.1b",
     .n_layers = 22,
     .dim = 2048,
     .ff = 5632,
     .n_heads = 32,
     .n_kv_heads = 4,
     .vocab_size = 32000,
     .ctx = 2048,
     .rope_base = 10000.0f,
     .rms_eps = 1e-5f},
    {.name = "ring-45",
     .n_layers = 45,
     .dim = 256,
     .ff = 768,
     .n_heads = 8,
     .n_kv_heads = 4,
     .vocab_size = 4096,
     .ctx = 2048,
     .rope_base = 10000.0f,
     .rms_eps = 1e-5f},
    {.name = "tiny",
     .n_layers = 4,
     .dim = 64,
     .ff = 192,
     .n_heads = 4,
     .n_kv_heads = 2,
     .vocab_size = 512,
     .ctx = 512,
     .rope_base = 10000.0f,
     .rms_eps = 1e-5f},
    {.name = "glm4.5-air-lite",
     .n_layers = 16,
     .dim = 1024,
     .ff = 2816,
     .n_heads = 16,
     .n_kv_heads = 2,
     .vocab_size = 32000,
     .ctx = 4096,
     .rope_base = 1000000.0f,
     .rms_eps = 1e-5f,
     .head_dim = 128,
     .n_expert = 64,
     .n_expert_used = 8,
     .expert_ff = 352,
     .n_shared_exp = 1,
     .n_dense_lead = 1,
     .w_scale = 1.0f,
     .rope_dim = 64,
     .n_nextn = 1},
    {.name = "deepseek-v2-lite",
     .n_layers = 27,
     .dim = 2048,
     .ff = 10944,
     .n_heads = 16,
     .n_kv_heads = 16,
     .vocab_size = 102400,
     .ctx = 32768,
     .rope_base = 10000.0f,
     .rms_eps = 1e-6f,
     .kv_lora = 512,
     .qk_rope = 64,
     .qk_nope = 128,
     .v_head = 128,
     .n_expert = 64,
     .n_expert_used = 6,
     .expert_ff = 1408,
     .n_shared_exp = 2,
     .n_dense_lead = 1},
    {.name = "gpt-oss-20b",
     .n_layers = 24,
     .dim = 2880,
     .ff = 2880,
     .n_heads = 64,
     .n_kv_heads = 8,
     .vocab_size = 201088,
     .ctx = 131072,
     .rope_base = 150000.0f,
     .rms_eps = 1e-5f,
     .head_dim = 64,
     .n_swa = 128,
     .n_expert = 32,
     .n_expert_used = 4,
     .expert_ff = 2880},
};
#define N_NAMED_SHAPES ((int)(sizeof named_shapes / sizeof named_shapes[0]))

int kvr_synth_shape_by_name(const char *name, struct kvr_synth_shape *out)
{
    for (int i = 0; i < N_NAMED_SHAPES; i++)
        if (!strcmp(named_shapes[i].name, name)) {
            *out = named_shapes[i];
            return 0;
        }
    return KVR_ENOTFOUND;
}

const char *kvr_synth_shape_name(int i)
{
    return (i >= 0 && i < N_NAMED_SHAPES) ? named_shapes[i].name : NULL;
}

static int check_range(const char *what, int v, int lo, int hi, struct kvr_err *err)
{
    if (v < lo || v > hi)
        return kvr_err_set(err, KVR_EINVAL, "shape: %s = %d is not in %d..%d", what, v, lo, hi);
    return 0;
}

int kvr_synth_check_shape(const struct kvr_synth_shape *s, struct kvr_err *err)
{
    int rc;
    if ((rc = check_range("layers", s->n_layers, 1, 4096, err)) ||
        (rc = check_range("dim", s->dim, 2, 1 << 16, err)) ||
        (rc = check_range("ff", s->ff, 1, 1 << 18, err)) ||
        (rc = check_range("heads", s->n_heads, 1, s->dim, err)) ||
        (rc = check_range("kv-heads", s->n_kv_heads, 1, s->n_heads, err)) ||
        (rc = check_range("vocab-size", s->vocab_size, 1, 1 << 24, err)) ||
        (rc = check_range("ctx", s->ctx, 1, 1 << 24, err)))
        return rc;
    if ((rc = check_range("head-dim", s->head_dim, 0, 1024, err)) ||
        (rc = check_range("nextn", s->n_nextn, 0, 8, err)) ||
        (rc = check_range("rope-dim", s->rope_dim, 0,
                          s->head_dim ? s->head_dim : s->dim / s->n_heads, err)) ||
        (rc = check_range("swa", s->n_swa, 0, 1 << 24, err)))
        return rc;
    if (!s->head_dim && s->dim % s->n_heads)
        return kvr_err_set(err, KVR_EINVAL, "shape: dim %d is not a multiple of heads %d", s->dim,
                           s->n_heads);
    int hd = s->head_dim ? s->head_dim : s->dim / s->n_heads;
    if (hd % 2)
        return kvr_err_set(err, KVR_EINVAL, "shape: head dim %d is odd (rope needs pairs)", hd);
    if (s->n_heads % s->n_kv_heads)
        return kvr_err_set(err, KVR_EINVAL, "shape: heads %d is not a multiple of kv-heads %d",
                           s->n_heads, s->n_kv_heads);
    if (!(s->rope_base > 0.0f) || !(s->rms_eps > 0.0f))
        return kvr_err_set(err, KVR_EINVAL, "shape: rope base and rms epsilon must be > 0");
    if (s->n_expert &&
        ((rc = check_range("experts", s->n_expert, 2,
                           s->dim < KVR_MOE_MAX_EXPERTS ? s->dim : KVR_MOE_MAX_EXPERTS, err)) ||
         (rc = check_range("experts-used", s->n_expert_used, 1,
                           s->n_expert < KVR_MOE_MAX_USED ? s->n_expert : KVR_MOE_MAX_USED, err)) ||
         (rc = check_range("expert-ff", s->expert_ff, 0, 1 << 18, err)) ||
         (rc = check_range("shared-ff", s->shared_ff, 0, 1 << 18, err)) ||
         (rc = check_range("shared-experts", s->n_shared_exp, 0, 64, err)) ||
         (rc = check_range("dense-layers", s->n_dense_lead, 0, s->n_layers - 1, err)) ||
         (rc = check_range("expert-groups", s->n_group, 0, s->n_expert / 2, err))))
        return rc;
    if (s->n_expert && s->n_group > 1 &&
        (s->n_expert % s->n_group || s->n_group_used < 1 || s->n_group_used > s->n_group ||
         s->n_expert_used > s->n_group_used * (s->n_expert / s->n_group)))
        return kvr_err_set(err, KVR_EINVAL,
                           "shape: %d expert groups, %d used, must divide %d experts and hold "
                           "the %d used",
                           s->n_group, s->n_group_used, s->n_expert, s->n_expert_used);
    return 0;
}

/* ---- tensors and their weights ----------------------------------------------------- */

/* What a tensor's rows hold beyond their random values: the routing design of MoE models
 * (synth.h), on the first `reserved` coordinates of the residual stream. */
enum role {
    ROLE_RANDOM,    /* uniform values only */
    ROLE_LEVELS,    /* token_embd: a permutation of evenly spaced levels on the reserved */
    ROLE_ROUTER,    /* ffn_gate_inp: row e one-hot on reserved perm(e), value `gain` */
    ROLE_ZERO_OUT,  /* output rows (row % ne1) < reserved are zero */
    ROLE_NORM_ONE,  /* ffn_norm: exactly 1 on the reserved coordinates */
    ROLE_BIAS,      /* exp_probs_b: 2 u_e, u from groups (synth.h); ne[1] = n_group */
    ROLE_ZERO_HEAD, /* a bias added to the stream: zero on the reserved coordinates */
    ROLE_COUNT
};

/* One tensor of the model: GGUF shape {ne0 = n_in, ne1 = rows, ne2 = matrices (3D expert
 * stacks; 1 otherwise)} and its value range. */
struct tspec {
    char name[48];
    uint32_t n_dims;
    int64_t ne[3];
    int type;
    float lo, hi;    /* values are uniform in [lo, hi) */
    uint64_t stream; /* PRNG stream of the tensor, from the seed and the name */
    float rope_base; /* > 0: not random, Llama 3.1's rope_freqs for this base */
    enum role role;
    uint32_t reserved; /* routing coordinates (MoE: n_expert) */
    float gain;        /* ROLE_ROUTER's value; ROLE_LEVELS' spacing */
};

static int64_t n_rows_of(const struct tspec *t)
{
    return t->ne[1] * t->ne[2];
}

static uint64_t stream_of(uint64_t seed, const char *name)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a of the name, then mixed with the seed */
    for (const char *p = name; *p; p++)
        h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
    uint64_t st = seed ^ h;
    return kvr_splitmix64(&st);
}

/* Llama 3.1's per-pair RoPE factors (its published scaling: factor 8, low and high
 * frequency factors 1 and 4, original context 8192): long wavelengths are slowed by the
 * factor, short ones kept, the band between interpolated. */
static void llama3_rope_freqs(float base, int64_t n_pairs, float *dst)
{
    const float factor = 8.0f, low = 1.0f, high = 4.0f, ctx = 8192.0f;
    const float low_wl = ctx / low, high_wl = ctx / high;
    for (int64_t i = 0; i < n_pairs; i++) {
        float freq = powf(base, -2.0f * (float)i / (float)(2 * n_pairs));
        float wl = 6.2831853f / freq;
        if (wl < high_wl) {
            dst[i] = 1.0f;
        } else if (wl > low_wl) {
            dst[i] = factor;
        } else {
            float smooth = (ctx / wl - low) / (high - low);
            dst[i] = 1.0f / ((1.0f - smooth) / factor + smooth);
        }
    }
}

/* perm[0..n) = a permutation of 0..n-1 drawn from *st (Fisher-Yates). */
static void draw_perm(uint64_t st, uint32_t *perm, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        perm[i] = i;
    for (uint32_t i = n; i > 1; i--) {
        uint32_t j = (uint32_t)(kvr_splitmix64(&st) % i);
        uint32_t tmp = perm[i - 1];
        perm[i - 1] = perm[j];
        perm[j] = tmp;
    }
}

/* exp_probs_b's 2 u_e (synth.h): t->reserved experts in t->gain groups (0: none). */
static void selection_bias(const struct tspec *t, float *dst)
{
    uint32_t perm[KVR_MOE_MAX_EXPERTS], n = t->reserved, n_group = (uint32_t)t->gain;
    draw_perm(t->stream, perm, n_group > 1 ? n_group : n);
    if (n_group <= 1) {
        for (uint32_t e = 0; e < n; e++)
            dst[e] = perm[e] < n / 2 ? 2.0f : 0.0f;
        return;
    }
    uint32_t per = n / n_group;
    for (uint32_t e = 0; e < n; e++) {
        uint32_t rank = perm[e / per];
        float u = (float)rank;
        if (rank == 0) /* the decoy group */
            u = e % per == 0 ? (float)n_group : -2.0f * (float)n_group;
        if (rank == n_group - 1 && e % per >= 2) /* the best group's tail: low total */
            u = -2.0f * (float)n_group;
        dst[e] = 2.0f * u;
    }
}

/* The routing design of MoE models (synth.h) over a row's random values. */
static void apply_role(const struct tspec *t, int64_t row, float *dst)
{
    uint32_t perm[KVR_MOE_MAX_EXPERTS], r = t->reserved;
    switch (t->role) {
    case ROLE_LEVELS: /* this token's own permutation of the levels */
        draw_perm(t->stream ^ 0x5bd1e995u ^ ((uint64_t)row * 0x9e3779b97f4a7c15ull), perm, r);
        for (uint32_t i = 0; i < r; i++)
            dst[i] = ((float)perm[i] - 0.5f * (float)(r - 1)) * t->gain;
        break;
    case ROLE_ROUTER: /* this layer's permutation of experts onto coordinates */
        draw_perm(t->stream, perm, r);
        memset(dst, 0, (size_t)t->ne[0] * sizeof *dst);
        dst[perm[row]] = t->gain;
        break;
    case ROLE_ZERO_OUT:
        if (row % t->ne[1] < r)
            memset(dst, 0, (size_t)t->ne[0] * sizeof *dst);
        break;
    case ROLE_NORM_ONE:
        for (uint32_t i = 0; i < r; i++)
            dst[i] = 1.0f;
        break;
    case ROLE_BIAS:
        selection_bias(t, dst);
        break;
    case ROLE_ZERO_HEAD:
        memset(dst, 0, r * sizeof *dst);
        break;
    default:
        break;
    }
}

/* Row `row` of a tensor: a splitmix64 stream per row, two 24-bit uniforms per draw. */
static void gen_row(const struct tspec *t, int64_t row, float *dst)
{
    if (t->rope_base > 0.0f) {
        llama3_rope_freqs(t->rope_base, t->ne[0], dst);
        return;
    }
    uint64_t st = t->stream ^ ((uint64_t)row * 0xd6e8feb86659fd93ull);
    float span = t->hi - t->lo;
    int64_t n = t->ne[0], i = 0;
    for (; i + 2 <= n; i += 2) {
        uint64_t z = kvr_splitmix64(&st);
        dst[i] = t->lo + span * ((float)(z >> 40) * 0x1p-24f);
        dst[i + 1] = t->lo + span * ((float)((z >> 8) & 0xFFFFFF) * 0x1p-24f);
    }
    if (i < n)
        dst[i] = t->lo + span * ((float)(kvr_splitmix64(&st) >> 40) * 0x1p-24f);
    apply_role(t, row, dst);
}

/* The type a matrix with n_in columns is stored in: the chosen one if its block divides
 * n_in, else Q8_0, else F16. */
static int matrix_type(int want, int64_t n_in)
{
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(want);
    if (n_in % tr->block_elems == 0)
        return want;
    return n_in % 32 == 0 ? KVR_DTYPE_Q8_0 : KVR_DTYPE_F16;
}

static void add_spec(struct tspec *t, const char *name, int64_t ne0, int64_t ne1, int type,
                     float std, uint64_t seed)
{
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = ne1 > 0 ? 2 : 1;
    t->ne[0] = ne0;
    t->ne[1] = ne1 > 0 ? ne1 : 1;
    t->ne[2] = 1;
    if (ne1 > 0) {
        t->type = matrix_type(type, ne0);
        t->hi = std * 1.7320508f; /* uniform on [-a, a] has std a / sqrt(3) */
        t->lo = -t->hi;
    } else { /* a norm weight */
        t->type = KVR_DTYPE_F32;
        t->lo = 0.9f;
        t->hi = 1.1f;
    }
    t->stream = stream_of(seed, t->name);
    t->rope_base = 0.0f;
    t->role = ROLE_RANDOM;
    t->reserved = 0;
    t->gain = 0.0f;
}

static const struct kvr_arch *arch_of(const struct kvr_synth_opts *o)
{
    return o->arch ? o->arch : kvr_arch_find("llama", 5);
}

static bool is_tied(const struct kvr_synth_opts *o)
{
    return o->tied || arch_of(o)->embd_scale; /* gemma files always tie */
}

/* Latent attention's widths, with synth.h's defaults. */
static void mla_hparams_of(const struct kvr_synth_shape *s, struct kvr_hparams *hp)
{
    struct kvr_mla_hparams *m = &hp->mla;
    uint32_t hd = hp->head_dim;
    m->q_lora_rank = (uint32_t)s->q_lora;
    m->kv_lora_rank = (uint32_t)(s->kv_lora ? s->kv_lora : s->dim / 2);
    m->n_nope = (uint32_t)(s->qk_nope ? s->qk_nope : (int)hd);
    m->n_rope = (uint32_t)(s->qk_rope ? s->qk_rope : (int)hd / 2);
    m->n_v = (uint32_t)(s->v_head ? s->v_head : (int)hd);
    hp->n_rot = m->n_rope;
    hp->q_dim = hp->n_head * m->n_v;
}

/* The hyperparameters the table's shapes are computed from. */
static struct kvr_hparams hparams_of(const struct kvr_synth_opts *o)
{
    const struct kvr_synth_shape *s = &o->shape;
    struct kvr_hparams hp = {.arch = arch_of(o)};
    hp.n_layer = (uint32_t)s->n_layers;
    hp.n_embd = (uint32_t)s->dim;
    hp.n_ff = (uint32_t)s->ff;
    hp.n_head = (uint32_t)s->n_heads;
    hp.n_head_kv = (uint32_t)s->n_kv_heads;
    hp.head_dim = (uint32_t)(s->head_dim ? s->head_dim : s->dim / s->n_heads);
    hp.q_dim = hp.n_head * hp.head_dim;
    hp.kv_dim = hp.n_head_kv * hp.head_dim;
    hp.n_rot = s->rope_dim ? (uint32_t)s->rope_dim : hp.head_dim;
    hp.n_nextn = hp.arch->nextn ? (uint32_t)s->n_nextn : 0;
    if (hp.arch->mla)
        mla_hparams_of(s, &hp);
    if (s->n_expert > 0) {
        hp.moe.n_expert = (uint32_t)s->n_expert;
        hp.moe.n_used = (uint32_t)s->n_expert_used;
        hp.moe.n_ff_exp = (uint32_t)(s->expert_ff ? s->expert_ff : s->ff);
        hp.moe.n_ff_shexp = hp.arch->moe_shared
                                ? (uint32_t)(s->shared_ff ? s->shared_ff : (int)hp.moe.n_ff_exp)
                                : 0;
        hp.moe.biases = hp.arch->moe_biases;
    }
    if (s->n_expert > 0 && hp.arch->moe_v3) {
        hp.moe.n_ff_shexp = (uint32_t)s->n_shared_exp * hp.moe.n_ff_exp;
        hp.moe.shared_plain = true;
        hp.moe.n_dense_lead = (uint32_t)s->n_dense_lead;
        hp.moe.n_group = s->n_group > 1 ? (uint32_t)s->n_group : 0;
        hp.moe.n_group_used = s->n_group > 1 ? (uint32_t)s->n_group_used : 0;
        hp.moe.probs_bias = hp.arch->moe_bias != 0;
    }
    return hp;
}

/* Most tensors a model of these options has. */
static size_t max_tensors(const struct kvr_synth_shape *s)
{
    /* + router, experts, shared, biases, MLA's projections; NextN's own */
    return (size_t)(s->n_layers + s->n_nextn) * (KVR_LT_COUNT + 24) + 4;
}

/* gpt-oss's router and expert biases, f32: the router's small beside the routing design's
 * one-logit gaps, the down one zero on the reserved coordinates like the down rows. */
static int64_t add_moe_bias_specs(struct tspec *out, const struct kvr_hparams *hp, uint32_t l,
                                  uint64_t seed, float s_res)
{
    const struct kvr_moe_hparams *mp = &hp->moe;
    static const char *const names[4] = {"ffn_gate_inp.bias", "ffn_gate_exps.bias",
                                         "ffn_up_exps.bias", "ffn_down_exps.bias"};
    const int64_t ne0[4] = {mp->n_expert, mp->n_ff_exp, mp->n_ff_exp, hp->n_embd};
    const float half[4] = {0.1f, 0.5f, 0.5f, 0.5f * s_res};
    char name[48];
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof name, "blk.%u.%s", l, names[i]);
        add_spec(&out[i], name, ne0[i], i ? mp->n_expert : 0, KVR_DTYPE_F32, 0, seed);
        out[i].type = KVR_DTYPE_F32;
        out[i].lo = -half[i];
        out[i].hi = half[i];
        if (i == 3) {
            out[i].role = ROLE_ZERO_HEAD;
            out[i].reserved = mp->n_expert;
        }
    }
    return 4;
}

/* A MoE layer's router, experts and shared expert (synth.h: the routing design). */
static int64_t add_moe_specs(struct tspec *out, const struct kvr_hparams *hp, uint32_t l, int type,
                             uint64_t seed, float s_res)
{
    const struct kvr_moe_hparams *mp = &hp->moe;
    int64_t n = 0, d = hp->n_embd, ff = mp->n_ff_exp, sh = mp->n_ff_shexp;
    float spacing = 3.4f / (float)(mp->n_expert - 1);
    char name[48];
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%u." suffix, l), name)
    add_spec(&out[n], NAME("ffn_gate_inp.weight"), d, mp->n_expert, KVR_DTYPE_F32, 0, seed);
    out[n].role = ROLE_ROUTER;
    out[n].gain = 1.2f / spacing;
    out[n++].reserved = mp->n_expert;
    static const char *const exps[3] = {"ffn_gate_exps.weight", "ffn_up_exps.weight",
                                        "ffn_down_exps.weight"};
    for (int i = 0; i < 3; i++) {
        snprintf(name, sizeof name, "blk.%u.%s", l, exps[i]);
        add_spec(&out[n], name, i < 2 ? d : ff, i < 2 ? ff : d, type,
                 i < 2 ? 1.0f / sqrtf((float)d) : s_res / sqrtf((float)ff), seed);
        out[n].n_dims = 3;
        out[n].ne[2] = mp->n_expert;
        if (i == 2) {
            out[n].role = ROLE_ZERO_OUT;
            out[n].reserved = mp->n_expert;
        }
        n++;
    }
    if (mp->probs_bias) {
        add_spec(&out[n], NAME("exp_probs_b.bias"), mp->n_expert, 0, KVR_DTYPE_F32, 0, seed);
        out[n].role = ROLE_BIAS;
        out[n].reserved = mp->n_expert;
        out[n++].gain = (float)mp->n_group;
    }
    if (mp->biases)
        n += add_moe_bias_specs(out + n, hp, l, seed, s_res);
    if (sh && !mp->shared_plain) {
        add_spec(&out[n], NAME("ffn_gate_inp_shexp.weight"), d, 0, KVR_DTYPE_F32, 0, seed);
        out[n].hi = 1.7320508f / sqrtf((float)d); /* a gate around sigmoid(0), not a norm */
        out[n++].lo = -1.7320508f / sqrtf((float)d);
    }
    if (sh) {
        add_spec(&out[n++], NAME("ffn_gate_shexp.weight"), d, sh, type, 1.0f / sqrtf((float)d),
                 seed);
        add_spec(&out[n++], NAME("ffn_up_shexp.weight"), d, sh, type, 1.0f / sqrtf((float)d), seed);
        add_spec(&out[n], NAME("ffn_down_shexp.weight"), sh, d, type, s_res / sqrtf((float)sh),
                 seed);
        out[n].role = ROLE_ZERO_OUT;
        out[n++].reserved = mp->n_expert;
    }
#undef NAME
    return n;
}

/* A latent attention layer's projections (model/mla.h); std 1/sqrt(n_in), the keys'
 * and values' projections by the latent they read. */
static int64_t add_mla_specs(struct tspec *out, const struct kvr_hparams *hp,
                             const struct kvr_synth_opts *o, uint32_t l, int type, uint64_t seed)
{
    const struct kvr_mla_hparams *m = &hp->mla;
    int64_t n = 0, d = hp->n_embd, H = hp->n_head, L = m->kv_lora_rank, ql = m->q_lora_rank;
    int64_t qk = m->n_nope + m->n_rope;
    char name[48];
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%u." suffix, l), name)
    if (ql) {
        add_spec(&out[n++], NAME("attn_q_a.weight"), d, ql, type, 1.0f / sqrtf((float)d), seed);
        add_spec(&out[n++], NAME("attn_q_a_norm.weight"), ql, 0, type, 0, seed);
        add_spec(&out[n++], NAME("attn_q_b.weight"), ql, H * qk, type, 1.0f / sqrtf((float)ql),
                 seed);
    } else {
        add_spec(&out[n++], NAME("attn_q.weight"), d, H * qk, type, 1.0f / sqrtf((float)d), seed);
    }
    add_spec(&out[n++], NAME("attn_kv_a_mqa.weight"), d, L + m->n_rope, type,
             1.0f / sqrtf((float)d), seed);
    add_spec(&out[n++], NAME("attn_kv_a_norm.weight"), L, 0, type, 0, seed);
    float std = 1.0f / sqrtf((float)L);
    if (o->kv_b_fused) {
        add_spec(&out[n++], NAME("attn_kv_b.weight"), L, H * (m->n_nope + m->n_v), type, std, seed);
    } else {
        add_spec(&out[n], NAME("attn_k_b.weight"), m->n_nope, L, type, std, seed);
        out[n].n_dims = 3;
        out[n++].ne[2] = H;
        add_spec(&out[n], NAME("attn_v_b.weight"), L, m->n_v, type, std, seed);
        out[n].n_dims = 3;
        out[n++].ne[2] = H;
    }
#undef NAME
    return n;
}

/* Layer l's tensors (the table's, then any experts); returns how many. */
static int64_t add_layer_specs(struct tspec *out, const struct kvr_synth_opts *o,
                               const struct kvr_hparams *hp, uint32_t l, int type, int expert_type,
                               float s_res)
{
    const struct kvr_arch *a = hp->arch;
    int64_t n = 0;
    char name[48];
    for (int t = 0; t < KVR_LT_COUNT; t++) {
        uint32_t bit = KVR_LT_BIT(t);
        bool opt_written =
            o->qk_norm && (bit & (KVR_LT_BIT(KVR_LT_ATTN_Q_NORM) | KVR_LT_BIT(KVR_LT_ATTN_K_NORM)));
        if (!kvr_hparams_layer_has(hp, l, (enum kvr_lt)t) || ((a->optional & bit) && !opt_written))
            continue;
        int64_t ne0, ne1;
        kvr_lt_shape(hp, (enum kvr_lt)t, &ne0, &ne1);
        snprintf(name, sizeof name, "blk.%u.%s", l, kvr_arch_lt_name(a, (enum kvr_lt)t));
        float std = 1.0f / sqrtf((float)ne0);
        if (t == KVR_LT_ATTN_OUT || t == KVR_LT_FFN_DOWN)
            std *= s_res;
        add_spec(&out[n], name, ne0, ne1, type, std, o->seed);
        bool ffn_norm =
            t == KVR_LT_FFN_NORM || (t == KVR_LT_ATTN_POST_NORM && a->ffn_norm_post_attn);
        if (!ffn_norm && (t == KVR_LT_ATTN_POST_NORM || t == KVR_LT_FFN_POST_NORM)) {
            out[n].lo = 0.2f;
            out[n].hi = 0.3f;
        }
        if (t == KVR_LT_ATTN_Q_BIAS || t == KVR_LT_ATTN_K_BIAS || t == KVR_LT_ATTN_V_BIAS) {
            out[n].hi = 0.3f * 1.7320508f;
            out[n].lo = -out[n].hi;
        }
        if (t == KVR_LT_ATTN_OUT_BIAS || t == KVR_LT_ATTN_SINKS) { /* sinks: logits */
            out[n].lo = t == KVR_LT_ATTN_SINKS ? 0.0f : -0.3f * s_res;
            out[n].hi = t == KVR_LT_ATTN_SINKS ? 2.0f : 0.3f * s_res;
        }
        if (hp->moe.n_expert && (t == KVR_LT_ATTN_OUT || t == KVR_LT_FFN_DOWN || ffn_norm ||
                                 t == KVR_LT_ATTN_OUT_BIAS)) {
            out[n].role = ffn_norm                    ? ROLE_NORM_ONE
                          : t == KVR_LT_ATTN_OUT_BIAS ? ROLE_ZERO_HEAD
                                                      : ROLE_ZERO_OUT;
            out[n].reserved = hp->moe.n_expert;
        }
        n++;
    }
    if (a->mla)
        n += add_mla_specs(out + n, hp, o, l, type, o->seed);
    if (kvr_hparams_layer_moe(hp, l))
        n += add_moe_specs(out + n, hp, l, expert_type, o->seed, s_res);
    return n;
}

/* A NextN block's own tensors (model/nextn.h), every one of them. */
static int64_t add_nextn_specs(struct tspec *out, const struct kvr_hparams *hp, uint32_t l,
                               int type, uint64_t seed)
{
    int64_t n = 0, ne0, ne1;
    char name[64];
    const char *suffix;
    for (int i = 0; (suffix = kvr_nextn_tensor(hp, i, &ne0, &ne1)); i++) {
        snprintf(name, sizeof name, "blk.%u.%s", l, suffix);
        add_spec(&out[n++], name, ne0, ne1, type, 1.0f / sqrtf((float)ne0), seed);
    }
    return n;
}

/* The model's tensors in file order; returns how many. */
static int64_t plan_tensors(const struct kvr_synth_opts *o, int vocab, struct tspec *out)
{
    struct kvr_hparams hp = hparams_of(o);
    const struct kvr_arch *a = hp.arch;
    /* MXFP4_MOE: experts in MXFP4, every other matrix Q8_0 */
    const int expert_type = o->type;
    const int type = expert_type == KVR_DTYPE_MXFP4 ? KVR_DTYPE_Q8_0 : expert_type;
    uint64_t seed = o->seed;
    int64_t n = 0, dim = hp.n_embd;
    hp.n_vocab = (uint32_t)vocab;
    float s_res = 1.0f / sqrtf(2.0f * (float)hp.n_layer); /* for the residual branches */
    if (is_tied(o) && !a->embd_scale) /* the stream starts 1/sqrt(dim) smaller: keep the
                                         branches in proportion */
        s_res /= sqrtf((float)dim);
    float logit = o->logit_scale > 0.0f ? o->logit_scale : 1.0f;
    /* Tied embeddings are also the output head, so they are drawn at its scale
     * 1/sqrt(dim) (as in real checkpoints; at 1 the input token's own logit would be about
     * dim). Gemma's, scaled by sqrt(dim) in the model, are then O(1) like a block's output. */
    add_spec(&out[n], "token_embd.weight", dim, vocab, type,
             is_tied(o) ? 1.0f / sqrtf((float)dim) : 1.0f, seed);
    if (hp.moe.n_expert) {
        out[n].role = ROLE_LEVELS;
        out[n].reserved = hp.moe.n_expert;
        out[n].gain = 3.4f / (float)(hp.moe.n_expert - 1);
    }
    n++;
    if (o->rope_freqs) {
        add_spec(&out[n], "rope_freqs.weight", hp.n_rot / 2, 0, type, 0, seed);
        out[n++].rope_base = o->shape.rope_base;
    }
    for (uint32_t l = 0; l < hp.n_layer + hp.n_nextn; l++) {
        n += add_layer_specs(out + n, o, &hp, l, type, expert_type, s_res);
        if (l >= hp.n_layer)
            n += add_nextn_specs(out + n, &hp, l, type, seed);
    }
    add_spec(&out[n], "output_norm.weight", dim, 0, type, 0, seed);
    out[n].lo *= logit; /* scales every logit, tied or not */
    out[n++].hi *= logit;
    if (!is_tied(o))
        add_spec(&out[n++], "output.weight", dim, vocab, type, 1.0f / sqrtf((float)dim), seed);
    return n;
}

/* ---- the built-in vocabulary ------------------------------------------------------- */

/* Common English words (TinyStories-flavoured), added with "▁" and all their prefixes. */
static const char *const common_words[] = {
    "the",   "and",   "a",        "to",     "was",     "he",     "she",     "it",    "of",
    "in",    "that",  "his",      "her",    "with",    "for",    "on",      "they",  "you",
    "said",  "had",   "is",       "at",     "but",     "be",     "not",     "one",   "day",
    "there", "were",  "so",       "all",    "we",      "little", "big",     "time",  "once",
    "upon",  "very",  "happy",    "him",    "play",    "friend", "friends", "mom",   "dad",
    "went",  "saw",   "wanted",   "could",  "would",   "like",   "what",    "from",  "this",
    "have",  "can",   "do",       "go",     "are",     "when",   "up",      "out",   "about",
    "into",  "them",  "then",     "their",  "did",     "made",   "make",    "over",  "more",
    "some",  "see",   "look",     "looked", "ran",     "run",    "tree",    "park",  "ball",
    "dog",   "cat",   "bird",     "sun",    "home",    "house",  "girl",    "boy",   "named",
    "love",  "good",  "new",      "old",    "because", "after",  "before",  "where", "who",
    "how",   "why",   "every",    "know",   "think",   "help",   "asked",   "toy",   "fun",
    "nice",  "sad",   "felt",     "feel",   "find",    "found",  "took",    "came",  "come",
    "back",  "again", "together", "other",  "each",    "just",   "now",     "too",   "also",
    "no",    "yes",   "my",       "your",   "our",     "its",    "an",      "as",    "by",
    "or",    "if",    "has",      "been",   "will",    "The",    "Once",    "She",   "He",
    "They",  "It",    "One",      "Lily",   "Tom",     "Ben",    "Sue",     "I",     "But",
};

/* Builds the piece list in order, skipping duplicates (an open-addressing set over the
 * pieces added so far). */
struct vocab_builder {
    struct kvr_gguf_str *pieces; /* n entries, pointing into text */
    float *scores;
    int32_t *types;
    char *text;
    size_t text_used;
    int n, cap;
    uint32_t *set; /* slot = piece index + 1, 0 empty */
    size_t set_mask;
    int n_normal; /* normal pieces so far: their score is -n_normal */
};

static uint64_t hash_piece(const char *s, size_t len)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    return h;
}

/* Add a piece unless present or full; returns true while there is room for more. */
static bool vb_add(struct vocab_builder *vb, const char *s, size_t len, int32_t type)
{
    if (vb->n >= vb->cap)
        return false;
    size_t slot = hash_piece(s, len) & vb->set_mask;
    for (; vb->set[slot]; slot = (slot + 1) & vb->set_mask) {
        const struct kvr_gguf_str *p = &vb->pieces[vb->set[slot] - 1];
        if (p->len == len && !memcmp(p->ptr, s, len))
            return true;
    }
    char *dst = vb->text + vb->text_used;
    memcpy(dst, s, len);
    vb->text_used += len;
    vb->set[slot] = (uint32_t)vb->n + 1;
    vb->pieces[vb->n] = (struct kvr_gguf_str){len, dst};
    vb->types[vb->n] = type;
    vb->scores[vb->n] = type == 1 ? -(float)vb->n_normal++ : 0.0f;
    vb->n++;
    return vb->n < vb->cap;
}

static const char spm_space[] = "\xe2\x96\x81"; /* U+2581 "▁" */

/* All n-letter lowercase strings in order, each with or without the "▁" prefix. */
static bool vb_add_ngrams(struct vocab_builder *vb, int n, bool with_space)
{
    char buf[MAX_PIECE_BYTES];
    size_t off = with_space ? 3 : 0;
    memcpy(buf, spm_space, 3);
    int idx[8] = {0};
    for (;;) {
        for (int i = 0; i < n; i++)
            buf[off + (size_t)i] = (char)('a' + idx[i]);
        if (!vb_add(vb, buf, off + (size_t)n, 1))
            return false;
        int i = n - 1;
        while (i >= 0 && ++idx[i] == 26)
            idx[i--] = 0;
        if (i < 0)
            return true;
    }
}

static void vb_fill(struct vocab_builder *vb)
{
    static const char *const specials[3] = {"<unk>", "<s>", "</s>"};
    static const int32_t special_types[3] = {2, 3, 3};
    char buf[MAX_PIECE_BYTES];
    for (int i = 0; i < 3; i++)
        vb_add(vb, specials[i], strlen(specials[i]), special_types[i]);
    for (int b = 0; b < 256; b++) {
        snprintf(buf, sizeof buf, "<0x%02X>", b);
        vb_add(vb, buf, 6, 6);
    }
    if (!vb_add(vb, spm_space, 3, 1))
        return;
    for (char c = 0x21; c < 0x7F; c++)
        if (!vb_add(vb, &c, 1, 1))
            return;
    memcpy(buf, spm_space, 3);
    for (size_t w = 0; w < sizeof common_words / sizeof common_words[0]; w++) {
        size_t len = strlen(common_words[w]);
        memcpy(buf + 3, common_words[w], len);
        for (size_t k = 1; k <= len; k++)
            if (!vb_add(vb, buf, 3 + k, 1))
                return;
    }
    for (int n = 2; n <= 4; n++)
        if (!vb_add_ngrams(vb, n, false) || !vb_add_ngrams(vb, n, true))
            return;
}

static int add_builtin_vocab(struct kvr_gguf_writer *w, int vocab, struct kvr_err *err)
{
    if (vocab < BUILTIN_VOCAB_MIN || vocab > BUILTIN_VOCAB_MAX)
        return kvr_err_set(err, KVR_EINVAL,
                           "vocab size %d is outside %d..%d for the built-in vocabulary", vocab,
                           BUILTIN_VOCAB_MIN, BUILTIN_VOCAB_MAX);
    struct vocab_builder vb = {0};
    size_t cap = 16;
    while (cap < (size_t)vocab * 2)
        cap *= 2;
    vb.cap = vocab;
    vb.set_mask = cap - 1;
    vb.pieces = kvr_malloc((size_t)vocab * sizeof *vb.pieces);
    vb.scores = kvr_malloc((size_t)vocab * sizeof *vb.scores);
    vb.types = kvr_malloc((size_t)vocab * sizeof *vb.types);
    vb.text = kvr_malloc((size_t)vocab * MAX_PIECE_BYTES);
    vb.set = kvr_calloc(cap, sizeof *vb.set);
    int rc = 0;
    if (!vb.pieces || !vb.scores || !vb.types || !vb.text || !vb.set) {
        rc = kvr_err_set(err, KVR_ENOMEM, "out of memory for the vocabulary");
        goto free_vocab;
    }
    vb_fill(&vb);
    if (vb.n != vocab) { /* cannot happen below BUILTIN_VOCAB_MAX; checked all the same */
        rc = kvr_err_set(err, KVR_EINVAL, "built-in vocabulary ran out at %d pieces", vb.n);
        goto free_vocab;
    }
    kvr_gguf_writer_add_str(w, "tokenizer.ggml.model", "llama");
    kvr_gguf_writer_add_str_arr(w, "tokenizer.ggml.tokens", (uint64_t)vocab, vb.pieces);
    kvr_gguf_writer_add_arr(w, "tokenizer.ggml.scores", KVR_GGUF_TYPE_FLOAT32, (uint64_t)vocab,
                            vb.scores);
    kvr_gguf_writer_add_arr(w, "tokenizer.ggml.token_type", KVR_GGUF_TYPE_INT32, (uint64_t)vocab,
                            vb.types);
    kvr_gguf_writer_add_u32(w, "tokenizer.ggml.bos_token_id", 1);
    kvr_gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", 2);
    kvr_gguf_writer_add_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    kvr_gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", true);
    kvr_gguf_writer_add_bool(w, "tokenizer.ggml.add_eos_token", false);
free_vocab:
    kvr_free(vb.pieces);
    kvr_free(vb.scores);
    kvr_free(vb.types);
    kvr_free(vb.text);
    kvr_free(vb.set);
    return rc;
}

/* The vocab size of another GGUF: the length of its tokenizer.ggml.tokens. */
static int vocab_size_of(const struct kvr_gguf *src, int *vocab, struct kvr_err *err)
{
    struct kvr_gguf_arr tokens;
    int rc = kvr_gguf_get_arr(src, "tokenizer.ggml.tokens", &tokens, err);
    if (rc)
        return rc;
    if (tokens.type != KVR_GGUF_TYPE_STRING || tokens.n < 1 || tokens.n > (1u << 24))
        return kvr_err_set(err, KVR_EFORMAT,
                           "vocab file: tokenizer.ggml.tokens must be 1..16777216 strings");
    *vocab = (int)tokens.n;
    return 0;
}

/* Copy every tokenizer.* key of another GGUF (vocab, scores, types, merges, special ids,
 * add_bos/add_eos flags, chat template). */
static int copy_vocab(struct kvr_gguf_writer *w, const struct kvr_gguf *src, struct kvr_err *err)
{
    for (int64_t i = 0; i < kvr_gguf_n_kv(src); i++) {
        if (strncmp(kvr_gguf_kv_key(src, i), "tokenizer.", 10))
            continue;
        int rc = kvr_gguf_writer_copy_kv(w, src, i);
        if (rc)
            return kvr_err_set(err, rc, "copying %s from the vocab file failed",
                               kvr_gguf_kv_key(src, i));
    }
    return 0;
}

/* ---- writing ----------------------------------------------------------------------- */

struct fill_job {
    const struct tspec *t;
    const struct kvr_dtype_traits *tr;
    uint8_t *dst;
    size_t row_bytes;
    float *scratch; /* n_threads rows of max ne0 floats */
    int64_t scratch_stride;
};

struct fill_ctx {
    struct kvr_pool *pool;
    const struct tspec *t;
    float *scratch;
    int64_t scratch_stride;
};

static void fill_rows(void *arg, int ith, int nth)
{
    const struct fill_job *j = arg;
    float *row = j->scratch + (int64_t)ith * j->scratch_stride;
    long begin, end;
    kvr_split_range((long)n_rows_of(j->t), ith, nth, &begin, &end);
    for (long r = begin; r < end; r++) {
        gen_row(j->t, r, row);
        j->tr->from_float(row, j->dst + (size_t)r * j->row_bytes, j->t->ne[0]);
    }
}

static int fill_tensor(void *ctx, void *dst, size_t n_bytes)
{
    const struct fill_ctx *c = ctx;
    struct fill_job job = {c->t,       kvr_dtype_traits(c->t->type),
                           dst,        n_bytes / (size_t)n_rows_of(c->t),
                           c->scratch, c->scratch_stride};
    kvr_pool_run(c->pool, fill_rows, &job);
    return 0;
}

static void add_arch_u32(struct kvr_gguf_writer *w, const char *arch, const char *suffix,
                         uint32_t v)
{
    char key[96];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    kvr_gguf_writer_add_u32(w, key, v);
}

static void add_arch_f32(struct kvr_gguf_writer *w, const char *arch, const char *suffix, float v)
{
    char key[96];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    kvr_gguf_writer_add_f32(w, key, v);
}

/* deepseek2's keys: the MLA widths in the form the tensors take (split: the cache's MQA
 * head as key/value_length and the per-head widths as *_mla; fused: per-head widths), the
 * keys llama.cpp requires of every deepseek2 file (all layers dense unless experts are
 * asked for), and YaRN's. */
static void add_mla_kvs(struct kvr_gguf_writer *w, const struct kvr_synth_opts *o,
                        const struct kvr_hparams *hp)
{
    const struct kvr_mla_hparams *m = &hp->mla;
    const char *a = hp->arch->name;
    if (m->q_lora_rank)
        add_arch_u32(w, a, "attention.q_lora_rank", m->q_lora_rank);
    add_arch_u32(w, a, "attention.kv_lora_rank", m->kv_lora_rank);
    if (o->kv_b_fused) {
        add_arch_u32(w, a, "attention.head_count_kv", hp->n_head);
        add_arch_u32(w, a, "attention.key_length", m->n_nope + m->n_rope);
        add_arch_u32(w, a, "attention.value_length", m->n_v);
    } else {
        add_arch_u32(w, a, "attention.head_count_kv", 1);
        add_arch_u32(w, a, "attention.key_length", m->kv_lora_rank + m->n_rope);
        add_arch_u32(w, a, "attention.value_length", m->kv_lora_rank);
        add_arch_u32(w, a, "attention.key_length_mla", m->n_nope + m->n_rope);
        add_arch_u32(w, a, "attention.value_length_mla", m->n_v);
    }
    if (!hp->moe.n_expert) { /* with experts, add_v3_kvs writes these */
        add_arch_u32(w, a, "leading_dense_block_count", hp->n_layer);
        add_arch_u32(w, a, "expert_feed_forward_length", hp->n_ff);
        add_arch_u32(w, a, "expert_shared_count", 0);
        add_arch_f32(w, a, "expert_weights_scale", 1.0f);
    }
    if (o->yarn_factor > 1.0f) {
        char key[96];
        snprintf(key, sizeof key, "%s.rope.scaling.type", a);
        kvr_gguf_writer_add_str(w, key, "yarn");
        add_arch_f32(w, a, "rope.scaling.factor", o->yarn_factor);
        add_arch_u32(w, a, "rope.scaling.original_context_length",
                     (uint32_t)((float)o->shape.ctx / o->yarn_factor));
        add_arch_f32(w, a, "rope.scaling.yarn_log_multiplier", o->yarn_log_mul);
    }
}

/* The keys of DeepSeek-V3-style routing (model/moe_route.h). */
static void add_v3_kvs(struct kvr_gguf_writer *w, const struct kvr_synth_shape *s, const char *a)
{
    char key[96];
    add_arch_u32(w, a, "expert_shared_count", (uint32_t)s->n_shared_exp);
    add_arch_u32(w, a, "leading_dense_block_count", (uint32_t)s->n_dense_lead);
    add_arch_u32(w, a, "expert_gating_func", 2); /* sigmoid */
    snprintf(key, sizeof key, "%s.expert_weights_norm", a);
    kvr_gguf_writer_add_bool(w, key, true);
    add_arch_f32(w, a, "expert_weights_scale", s->w_scale > 0.0f ? s->w_scale : 1.0f);
    if (s->n_group > 1) {
        add_arch_u32(w, a, "expert_group_count", (uint32_t)s->n_group);
        add_arch_u32(w, a, "expert_group_used_count", (uint32_t)s->n_group_used);
    }
}

static void add_model_kvs(struct kvr_gguf_writer *w, const struct kvr_synth_opts *o, int vocab,
                          uint32_t file_type)
{
    const struct kvr_synth_shape *s = &o->shape;
    const struct kvr_hparams hp = hparams_of(o);
    const char *a = hp.arch->name;
    char name[64];
    snprintf(name, sizeof name, "kvasir-synth %s", s->name);
    kvr_gguf_writer_add_str(w, "general.architecture", a);
    kvr_gguf_writer_add_str(w, "general.name", name);
    kvr_gguf_writer_add_u32(w, "general.alignment", 32);
    kvr_gguf_writer_add_u32(w, "general.file_type", file_type);
    add_arch_u32(w, a, "context_length", (uint32_t)s->ctx);
    add_arch_u32(w, a, "embedding_length", (uint32_t)s->dim);
    add_arch_u32(w, a, "block_count", hp.n_layer + hp.n_nextn);
    if (hp.arch->nextn)
        add_arch_u32(w, a, "nextn_predict_layers", hp.n_nextn);
    add_arch_u32(w, a, "feed_forward_length", (uint32_t)s->ff);
    add_arch_u32(w, a, "attention.head_count", (uint32_t)s->n_heads);
    if (hp.arch->mla)
        add_mla_kvs(w, o, &hp);
    else
        add_arch_u32(w, a, "attention.head_count_kv", (uint32_t)s->n_kv_heads);
    if (s->head_dim && !hp.arch->mla) {
        add_arch_u32(w, a, "attention.key_length", hp.head_dim);
        add_arch_u32(w, a, "attention.value_length", hp.head_dim);
    }
    add_arch_u32(w, a, "rope.dimension_count", hp.n_rot);
    add_arch_f32(w, a, "rope.freq_base", s->rope_base);
    if (o->rope_scale > 0.0f && o->rope_scale != 1.0f) {
        char key[96];
        snprintf(key, sizeof key, "%s.rope.scaling.type", a);
        kvr_gguf_writer_add_str(w, key, "linear");
        add_arch_f32(w, a, "rope.scaling.factor", o->rope_scale);
    }
    if (!strcmp(a, "gpt-oss")) { /* YaRN as its real files have it (factor 32 over 4096) */
        char key[96];
        snprintf(key, sizeof key, "%s.rope.scaling.type", a);
        kvr_gguf_writer_add_str(w, key, "yarn");
        add_arch_f32(w, a, "rope.scaling.factor", 32.0f);
        add_arch_u32(w, a, "rope.scaling.original_context_length", 4096);
    }
    add_arch_f32(w, a, "attention.layer_norm_rms_epsilon", s->rms_eps);
    if (s->n_swa)
        add_arch_u32(w, a, "attention.sliding_window", (uint32_t)s->n_swa);
    if (!strcmp(a, "gemma2")) {
        add_arch_f32(w, a, "attn_logit_softcapping", 50.0f);
        add_arch_f32(w, a, "final_logit_softcapping", 30.0f);
    }
    if (hp.moe.n_expert) {
        add_arch_u32(w, a, "expert_count", hp.moe.n_expert);
        add_arch_u32(w, a, "expert_used_count", hp.moe.n_used);
        if (strcmp(a, "llama")) /* Mixtral-style files size experts by feed_forward_length */
            add_arch_u32(w, a, "expert_feed_forward_length", hp.moe.n_ff_exp);
        if (hp.moe.n_ff_shexp && !hp.arch->moe_v3)
            add_arch_u32(w, a, "expert_shared_feed_forward_length", hp.moe.n_ff_shexp);
    }
    if (hp.moe.n_expert && hp.arch->moe_v3)
        add_v3_kvs(w, s, a);
    add_arch_u32(w, a, "vocab_size", (uint32_t)vocab);
}

static int check_type(int type, uint32_t *file_type, struct kvr_err *err)
{
    const struct kvr_dtype_traits *tr = kvr_dtype_traits(type);
    if (!tr || !tr->from_float || tr->file_type < 0)
        return kvr_err_set(err, KVR_ENOTSUP, "weight type %d (%s) cannot be synthesised", type,
                           tr ? tr->name : "unknown");
    *file_type = (uint32_t)tr->file_type;
    return 0;
}

int kvr_synth_write(const struct kvr_synth_opts *opts, FILE *f, struct kvr_synth_stats *stats,
                    struct kvr_err *err)
{
    const struct kvr_synth_shape *s = &opts->shape;
    uint32_t file_type = 0;
    int rc, vocab = s->vocab_size;
    if ((rc = check_type(opts->type, &file_type, err)) || (rc = kvr_synth_check_shape(s, err)))
        return rc;
    const struct kvr_arch *arch = arch_of(opts);
    if (arch->moe_always && !s->n_expert)
        return kvr_err_set(err, KVR_EINVAL, "shape: %s needs experts", arch->name);
    if (s->n_expert && !arch->moe_always && !arch->moe_v3 && strcmp(arch->name, "llama"))
        return kvr_err_set(err, KVR_EINVAL,
                           "shape: %s has no experts (llama, qwen3moe, "
                           "qwen2moe and gpt-oss do)",
                           arch->name);
    if (s->n_expert && !arch->moe_always && !arch->moe_v3 && s->expert_ff && s->expert_ff != s->ff)
        return kvr_err_set(err, KVR_EINVAL, "shape: llama's experts are ff wide (%d), not %d",
                           s->ff, s->expert_ff);
    if (opts->n_threads < 1)
        return kvr_err_set(err, KVR_EINVAL, "n_threads must be >= 1");
    if ((s->n_nextn && !arch->nextn) ||
        (opts->qk_norm && !(arch->optional & KVR_LT_BIT(KVR_LT_ATTN_Q_NORM))))
        return kvr_err_set(err, KVR_EINVAL, "architecture %s has no optional %s", arch->name,
                           s->n_nextn ? "NextN layers" : "q/k norms");
    if (s->n_swa && !arch_of(opts)->sliding)
        return kvr_err_set(err, KVR_EINVAL, "architecture %s has no sliding window",
                           arch_of(opts)->name);
    if ((opts->rope_freqs || (opts->rope_scale > 0.0f && opts->rope_scale != 1.0f)) &&
        strcmp(arch_of(opts)->name, "llama"))
        return kvr_err_set(err, KVR_EINVAL,
                           "rope_freqs and rope scaling are written for "
                           "llama only");

    struct kvr_gguf_writer *w = kvr_gguf_writer_create();
    struct tspec *specs = kvr_malloc(max_tensors(s) * sizeof *specs);
    struct fill_ctx *ctxs = kvr_malloc(max_tensors(s) * sizeof *ctxs);
    int64_t q_dim = (int64_t)hparams_of(opts).q_dim;
    int64_t max_ne0 = 2 * (int64_t)s->dim > s->ff ? 2 * (int64_t)s->dim : s->ff; /* eh_proj */
    max_ne0 = q_dim > max_ne0 ? q_dim : max_ne0;
    max_ne0 = s->expert_ff > max_ne0 ? s->expert_ff : max_ne0;
    max_ne0 = s->shared_ff > max_ne0 ? s->shared_ff : max_ne0;
    max_ne0 = s->kv_lora > max_ne0 ? s->kv_lora : max_ne0;
    max_ne0 = s->q_lora > max_ne0 ? s->q_lora : max_ne0;
    int64_t shexp = (int64_t)hparams_of(opts).moe.n_ff_shexp;
    max_ne0 = shexp > max_ne0 ? shexp : max_ne0;
    float *scratch = kvr_malloc((size_t)opts->n_threads * (size_t)max_ne0 * sizeof(float));
    struct kvr_pool *pool = kvr_pool_create(opts->n_threads);
    if (!w || !specs || !ctxs || !scratch || !pool) {
        rc = kvr_err_set(err, KVR_ENOMEM, "out of memory");
        goto cleanup;
    }

    if (opts->vocab && (rc = vocab_size_of(opts->vocab, &vocab, err)))
        goto cleanup;
    add_model_kvs(w, opts, vocab, file_type);
    rc = opts->vocab ? copy_vocab(w, opts->vocab, err) : add_builtin_vocab(w, vocab, err);
    if (rc)
        goto cleanup;

    int64_t n_tensors = plan_tensors(opts, vocab, specs);
    uint64_t n_params = 0;
    for (int64_t i = 0; i < n_tensors; i++) {
        ctxs[i] = (struct fill_ctx){pool, &specs[i], scratch, max_ne0};
        kvr_gguf_writer_add_tensor_fn(w, specs[i].name, specs[i].n_dims, specs[i].ne, specs[i].type,
                                      fill_tensor, &ctxs[i]);
        n_params += (uint64_t)specs[i].ne[0] * (uint64_t)n_rows_of(&specs[i]);
    }
    kvr_gguf_writer_set_progress(w, opts->progress, opts->progress_ctx);
    if (stats)
        *stats = (struct kvr_synth_stats){n_params, (uint64_t)n_tensors,
                                          kvr_gguf_writer_file_bytes(w), vocab};
    rc = kvr_gguf_writer_write(w, f, err);

cleanup:
    kvr_pool_destroy(pool);
    kvr_free(scratch);
    kvr_free(ctxs);
    kvr_free(specs);
    kvr_gguf_writer_destroy(w);
    return rc;
}

int kvr_synth_row(const struct kvr_synth_opts *opts, const char *name, int64_t row, float *dst)
{
    const struct kvr_synth_shape *s = &opts->shape;
    if (kvr_synth_check_shape(s, NULL))
        return KVR_EINVAL;
    int vocab = s->vocab_size;
    if (opts->vocab && vocab_size_of(opts->vocab, &vocab, NULL))
        return KVR_EINVAL;
    struct tspec *specs = kvr_malloc(max_tensors(s) * sizeof *specs);
    if (!specs)
        return KVR_ENOMEM;
    int64_t n = plan_tensors(opts, vocab, specs);
    int rc = KVR_ENOTFOUND;
    for (int64_t i = 0; i < n; i++) {
        if (strcmp(specs[i].name, name))
            continue;
        rc = (row < 0 || row >= n_rows_of(&specs[i])) ? KVR_ERANGE : 0;
        if (!rc)
            gen_row(&specs[i], row, dst);
        break;
    }
    kvr_free(specs);
    return rc;
}
