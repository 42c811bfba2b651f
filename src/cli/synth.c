/* synth.c - `kvasir synth`: write a GGUF model of any supported architecture with random
 * weights (model/synth.h).
 *
 * The file is written to OUT.part and renamed to OUT only once complete, so an interrupted
 * run never leaves a truncated model under the final name. */
#include "cli/cmd.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "model/dtype.h"
#include "model/gguf.h"
#include "model/synth.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvasir synth --shape NAME|custom -o OUT.gguf [options]\n"
            "\n"
            "Write a GGUF model with random weights.\n"
            "\n"
            "  --arch A           architecture: %s, or mixtral (llama with\n"
            "                     experts; default llama)\n",
            kvr_arch_list());
    fprintf(f, "  --shape NAME       a named shape (");
    for (int i = 0; kvr_synth_shape_name(i); i++)
        fprintf(f, "%s%s", i ? ", " : "", kvr_synth_shape_name(i));
    fprintf(f, ") or custom\n"
               "  -o, --out FILE     output file\n"
               "  --type T           matrix type, any weight type by name: f32, f16, bf16,\n"
               "                     q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k,\n"
               "                     q6_k, iq4_nl, iq4_xs, mxfp4 (experts only, the rest\n"
               "                     q8_0, as MXFP4_MOE; default q8_0)\n"
               "  --seed N           PRNG seed (default 1); same seed, same bytes\n"
               "  --vocab FILE       copy the tokenizer (tokenizer.* keys) from another GGUF\n"
               "  --threads N        generator threads (default: online CPUs)\n"
               "  --logit-scale F    multiply the final norm's weights, so every logit, by\n"
               "                     F (separates the top logits of a random model)\n"
               "  --tied             no output.weight: the head reads token_embd (gemma\n"
               "                     always ties)\n"
               "  --rope-freqs       llama: write rope_freqs.weight (Llama 3.1 factors)\n"
               "  --rope-scale F     llama: linear RoPE scaling by F\n"
               "  --rope-base F      RoPE frequency base (default 10000)\n"
               "  --head-dim N       attention head width (default dim / heads)\n"
               "  --swa N            sliding window of N positions (gemma2, gemma3, gpt-oss)\n"
               "  --layers N --dim N --ff N --heads N --kv-heads N --vocab-size N --ctx N\n"
               "                     set or override shape fields (custom needs layers, dim,\n"
               "                     ff and heads; kv-heads defaults to heads, vocab-size to\n"
               "                     512, ctx to 2048)\n"
               "  --experts N --experts-used K --expert-ff N --shared-ff N\n"
               "                     a mixture of experts, each ff wide unless --expert-ff\n"
               "                     (llama: Mixtral-style). Defaults: mixtral and qwen2moe\n"
               "                     8 experts, top-2; qwen3moe and glm4moe 16, top-4\n"
               "  --q-lora N --kv-lora N --qk-rope N --qk-nope N --v-head N\n"
               "                     deepseek2's latent attention widths (q-lora 0 or absent:\n"
               "                     a plain attn_q; defaults kv-lora dim/2, qk-nope and\n"
               "                     v-head dim/heads, qk-rope half of that)\n"
               "  --kv-b-fused       deepseek2: the older fused attn_kv_b\n"
               "  --shared-experts N --dense-layers N --expert-groups N --groups-used N\n"
               "  --expert-scale F   DeepSeek-V3-style routing (glm4moe, deepseek2): shared\n"
               "                     experts, leading dense layers, expert groups, weight\n"
               "                     scale (glm4moe defaults: 1 shared, 1 dense, no groups, 1)\n"
               "  --rope-dim N       rotary dimensions per head (glm4moe: half the head)\n"
               "  --nextn N          glm4moe: NextN blocks after the layers (default 1)\n"
               "  --qk-norm          glm4moe: write the optional per-head q/k norms\n"
               "  --yarn F --yarn-log-mul F\n"
               "                     deepseek2: YaRN scaling by F from ctx / F positions\n");
}

static bool parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static double now_s(void)
{
    return (double)kvr_now_ns() * 1e-9;
}

struct progress {
    double t0;
    int last_pct;
};

static void show_progress(void *ctx, uint64_t done, uint64_t total)
{
    struct progress *p = ctx;
    int pct = total ? (int)(done * 100 / total) : 100;
    if (pct == p->last_pct)
        return;
    p->last_pct = pct;
    fprintf(stderr, "\rsynth: %3d%% (%" PRIu64 " / %" PRIu64 " MB)", pct, done >> 20, total >> 20);
    if (done == total)
        fputc('\n', stderr);
}

enum {
    OPT_SHAPE = 256,
    OPT_TYPE,
    OPT_SEED,
    OPT_VOCAB,
    OPT_THREADS,
    OPT_ARCH,
    OPT_LOGIT,
    OPT_TIED,
    OPT_ROPE_FREQS,
    OPT_ROPE_SCALE,
    OPT_ROPE_BASE,
    OPT_FIELD
};
#define N_FIELDS 9
enum { OPT_MOE = 512, N_MOE = 4 }; /* --experts, --experts-used, --expert-ff, --shared-ff */
/* DeepSeek-V3-style routing and glm4moe's shape (v3_names order), --qk-norm and
 * --expert-scale */
enum { OPT_V3 = 600, N_V3 = 6, OPT_QK_NORM = 620, OPT_EXPERT_SCALE };
/* deepseek2's latent attention (mla_names order), its kv_b form and YaRN */
enum { OPT_MLA = 640, N_MLA = 5, OPT_FUSED = 700, OPT_YARN, OPT_YARN_LOG };
static const char *const mla_names[N_MLA] = {"q-lora", "kv-lora", "qk-rope", "qk-nope", "v-head"};
static const char *const v3_names[N_V3] = {"shared-experts", "dense-layers", "expert-groups",
                                           "groups-used",    "rope-dim",     "nextn"};

static const struct option long_opts[] = {
    {"shape", required_argument, NULL, OPT_SHAPE},
    {"out", required_argument, NULL, 'o'},
    {"type", required_argument, NULL, OPT_TYPE},
    {"seed", required_argument, NULL, OPT_SEED},
    {"vocab", required_argument, NULL, OPT_VOCAB},
    {"threads", required_argument, NULL, OPT_THREADS},
    {"layers", required_argument, NULL, OPT_FIELD + 0},
    {"dim", required_argument, NULL, OPT_FIELD + 1},
    {"ff", required_argument, NULL, OPT_FIELD + 2},
    {"heads", required_argument, NULL, OPT_FIELD + 3},
    {"kv-heads", required_argument, NULL, OPT_FIELD + 4},
    {"vocab-size", required_argument, NULL, OPT_FIELD + 5},
    {"ctx", required_argument, NULL, OPT_FIELD + 6},
    {"head-dim", required_argument, NULL, OPT_FIELD + 7},
    {"swa", required_argument, NULL, OPT_FIELD + 8},
    {"arch", required_argument, NULL, OPT_ARCH},
    {"logit-scale", required_argument, NULL, OPT_LOGIT},
    {"tied", no_argument, NULL, OPT_TIED},
    {"rope-freqs", no_argument, NULL, OPT_ROPE_FREQS},
    {"rope-scale", required_argument, NULL, OPT_ROPE_SCALE},
    {"rope-base", required_argument, NULL, OPT_ROPE_BASE},
    {"experts", required_argument, NULL, OPT_MOE + 0},
    {"experts-used", required_argument, NULL, OPT_MOE + 1},
    {"expert-ff", required_argument, NULL, OPT_MOE + 2},
    {"shared-ff", required_argument, NULL, OPT_MOE + 3},
    {"q-lora", required_argument, NULL, OPT_MLA + 0},
    {"kv-lora", required_argument, NULL, OPT_MLA + 1},
    {"qk-rope", required_argument, NULL, OPT_MLA + 2},
    {"qk-nope", required_argument, NULL, OPT_MLA + 3},
    {"v-head", required_argument, NULL, OPT_MLA + 4},
    {"kv-b-fused", no_argument, NULL, OPT_FUSED},
    {"shared-experts", required_argument, NULL, OPT_V3 + 0},
    {"dense-layers", required_argument, NULL, OPT_V3 + 1},
    {"expert-groups", required_argument, NULL, OPT_V3 + 2},
    {"groups-used", required_argument, NULL, OPT_V3 + 3},
    {"rope-dim", required_argument, NULL, OPT_V3 + 4},
    {"nextn", required_argument, NULL, OPT_V3 + 5},
    {"qk-norm", no_argument, NULL, OPT_QK_NORM},
    {"expert-scale", required_argument, NULL, OPT_EXPERT_SCALE},
    {"yarn", required_argument, NULL, OPT_YARN},
    {"yarn-log-mul", required_argument, NULL, OPT_YARN_LOG},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* What the command line asked for; the shape is built from it after parsing. */
struct synth_args {
    const char *shape_name, *out, *vocab_path;
    long fields[N_FIELDS]; /* --layers ... --swa in long_opts order; 0 = not given */
    long moe[N_MOE];       /* --experts, --experts-used, --expert-ff, --shared-ff; -1: not
                              given */
    long v3[N_V3];         /* v3_names' options; -1 = not given */
    long mla[N_MLA];       /* --q-lora ... --v-head; -1 = not given */
    float w_scale;         /* --expert-scale; 0 = not given (applied after the shape) */
    bool mixtral;          /* --arch mixtral: a llama file with experts */
    double rope_base;      /* 0 = the shape's */
    struct kvr_synth_opts opts;
};

/* A number option: --logit-scale, --rope-scale or --rope-base. Returns 0 or 2. */
static int parse_real(int c, struct synth_args *a)
{
    char *end;
    errno = 0;
    double d = strtod(optarg, &end);
    if (c == OPT_ROPE_BASE) {
        a->rope_base = d;
        if (errno || end == optarg || *end || !(d >= 1.0) || d > 1e9) {
            fprintf(stderr, "kvasir synth: --rope-base wants a number in [1, 1e9]\n");
            return 2;
        }
        return 0;
    }
    if (errno || end == optarg || *end || !(d > 0.0) || d > 1e4) {
        fprintf(stderr, "kvasir synth: --%s wants a number in (0, 10000]\n",
                c == OPT_LOGIT          ? "logit-scale"
                : c == OPT_YARN         ? "yarn"
                : c == OPT_YARN_LOG     ? "yarn-log-mul"
                : c == OPT_EXPERT_SCALE ? "expert-scale"
                : c == OPT_YARN         ? "yarn"
                : c == OPT_YARN_LOG     ? "yarn-log-mul"
                                        : "rope-scale");
        return 2;
    }
    float *dst = c == OPT_LOGIT          ? &a->opts.logit_scale
                 : c == OPT_YARN         ? &a->opts.yarn_factor
                 : c == OPT_YARN_LOG     ? &a->opts.yarn_log_mul
                 : c == OPT_EXPERT_SCALE ? &a->w_scale
                                         : &a->opts.rope_scale;
    *dst = (float)d;
    return 0;
}

/* A shape field or MoE count (--layers ... --shared-ff). Returns 0, 2, or 1 when c is
 * none of them. */
static int parse_count(int c, struct synth_args *a)
{
    if (c >= OPT_MLA && c < OPT_MLA + N_MLA) {
        if (!parse_int(optarg, c == OPT_MLA ? 0 : 2, 1L << 16, &a->mla[c - OPT_MLA])) {
            fprintf(stderr, "kvasir synth: --%s must be a positive integer\n",
                    mla_names[c - OPT_MLA]);
            return 2;
        }
        return 0;
    }
    if (c >= OPT_MOE && c < OPT_MOE + N_MOE) {
        if (!parse_int(optarg, c == OPT_MOE ? 0 : 1, 1L << 18, &a->moe[c - OPT_MOE])) {
            fprintf(stderr, "kvasir synth: --%s must be a positive integer\n",
                    c == OPT_MOE       ? "experts"
                    : c == OPT_MOE + 1 ? "experts-used"
                    : c == OPT_MOE + 2 ? "expert-ff"
                                       : "shared-ff");
            return 2;
        }
        return 0;
    }
    if (c >= OPT_V3 && c < OPT_V3 + N_V3) {
        if (!parse_int(optarg, 0, 1L << 18, &a->v3[c - OPT_V3])) {
            fprintf(stderr, "kvasir synth: --%s must be an integer >= 0\n", v3_names[c - OPT_V3]);
            return 2;
        }
        return 0;
    }
    if (c >= OPT_FIELD && c < OPT_FIELD + N_FIELDS) {
        if (!parse_int(optarg, 1, 1L << 24, &a->fields[c - OPT_FIELD])) {
            fprintf(stderr, "kvasir synth: --%s must be a positive integer\n",
                    long_opts[6 + c - OPT_FIELD].name);
            return 2;
        }
        return 0;
    }
    return 1;
}

/* One option from getopt_long. Returns 0, 1 after --help, or 2 after printing why not. */
static int parse_one(int c, struct synth_args *a)
{
    long v;
    switch (c) {
    case OPT_SHAPE:
        a->shape_name = optarg;
        return 0;
    case 'o':
        a->out = optarg;
        return 0;
    case OPT_VOCAB:
        a->vocab_path = optarg;
        return 0;
    case OPT_TYPE:
        if ((a->opts.type = kvr_dtype_by_name(optarg)) < 0) {
            fprintf(stderr, "kvasir synth: unknown --type %s\n", optarg);
            return 2;
        }
        return 0;
    case OPT_SEED: {
        char *end;
        errno = 0;
        a->opts.seed = strtoull(optarg, &end, 0);
        if (errno || end == optarg || *end) {
            fprintf(stderr, "kvasir synth: bad --seed %s\n", optarg);
            return 2;
        }
        return 0;
    }
    case OPT_THREADS:
        if (!parse_int(optarg, 1, 256, &v)) {
            fprintf(stderr, "kvasir synth: --threads must be 1..256\n");
            return 2;
        }
        a->opts.n_threads = (int)v;
        return 0;
    case OPT_ARCH:
        a->mixtral = !strcmp(optarg, "mixtral");
        if (!(a->opts.arch =
                  kvr_arch_find(a->mixtral ? "llama" : optarg, a->mixtral ? 5 : strlen(optarg)))) {
            fprintf(stderr, "kvasir synth: unknown --arch %s (supported: %s)\n", optarg,
                    kvr_arch_list());
            return 2;
        }
        return 0;
    case OPT_LOGIT:
    case OPT_EXPERT_SCALE:
    case OPT_YARN:
    case OPT_YARN_LOG:
    case OPT_ROPE_SCALE:
    case OPT_ROPE_BASE:
        return parse_real(c, a);
    case OPT_TIED:
        a->opts.tied = true;
        return 0;
    case OPT_ROPE_FREQS:
        a->opts.rope_freqs = true;
        return 0;
    case OPT_QK_NORM:
        a->opts.qk_norm = true;
        return 0;
    case OPT_FUSED:
        a->opts.kv_b_fused = true;
        return 0;
    case 'h':
        usage(stdout);
        return 1;
    default: {
        int rc = parse_count(c, a);
        if (rc == 1) {
            usage(stderr);
            return 2;
        }
        return rc;
    }
    }
}

/* Returns 0, 1 after --help, or 2 after printing what is wrong. */
static int parse(int argc, char **argv, struct synth_args *a)
{
    memset(a, 0, sizeof *a);
    for (int i = 0; i < N_MLA; i++)
        a->mla[i] = -1;
    for (int i = 0; i < N_V3; i++)
        a->v3[i] = -1;
    for (int i = 0; i < N_MOE; i++)
        a->moe[i] = -1;
    a->opts = (struct kvr_synth_opts){.type = KVR_DTYPE_Q8_0, .seed = 1};
    long n_cpus = sysconf(_SC_NPROCESSORS_ONLN);
    a->opts.n_threads = n_cpus > 0 ? (int)(n_cpus < 64 ? n_cpus : 64) : 1;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "o:h", long_opts, NULL)) != -1) {
        int rc = parse_one(c, a);
        if (rc)
            return rc;
    }
    if (optind < argc || !a->shape_name || !a->out) {
        fprintf(stderr, "kvasir synth: %s\n\n",
                optind < argc ? "unexpected argument" : "--shape and -o are required");
        usage(stderr);
        return 2;
    }
    return 0;
}

/* GLM-4.5's layout unless the shape says otherwise: one shared expert, one leading dense
 * layer, one NextN block, RoPE on half of each head. */
static void glm4moe_defaults(struct kvr_synth_shape *s)
{
    if (!strcmp(s->name, "glm4.5-air-lite"))
        return; /* its own numbers */
    int hd = s->head_dim ? s->head_dim : s->dim / s->n_heads;
    s->n_shared_exp = 1;
    s->n_dense_lead = s->n_layers > 1 ? 1 : 0;
    s->n_nextn = 1;
    s->rope_dim = hd / 2 % 2 ? hd : hd / 2;
}

/* The named (or custom) shape with the command line's overrides. Returns 0 or 2. */
static int build_shape(struct synth_args *a)
{
    struct kvr_synth_shape *s = &a->opts.shape;
    const long *fields = a->fields, *moe = a->moe;
    if (!strcmp(a->shape_name, "custom")) {
        if (!fields[0] || !fields[1] || !fields[2] || !fields[3]) {
            fprintf(stderr, "kvasir synth: custom needs --layers, --dim, --ff and --heads\n");
            return 2;
        }
        *s = (struct kvr_synth_shape){.name = "custom",
                                      .vocab_size = 512,
                                      .ctx = 2048,
                                      .rope_base = 10000.0f,
                                      .rms_eps = 1e-5f};
        s->n_kv_heads = (int)fields[3];
    } else if (kvr_synth_shape_by_name(a->shape_name, s)) {
        fprintf(stderr, "kvasir synth: unknown shape %s\n", a->shape_name);
        return 2;
    }
    int *targets[N_FIELDS] = {&s->n_layers,   &s->dim, &s->ff,       &s->n_heads, &s->n_kv_heads,
                              &s->vocab_size, &s->ctx, &s->head_dim, &s->n_swa};
    for (int i = 0; i < N_FIELDS; i++)
        if (fields[i])
            *targets[i] = (int)fields[i];
    if (a->rope_base > 0)
        s->rope_base = (float)a->rope_base;
    const struct kvr_synth_opts *o = &a->opts;
    bool wide = o->arch && (!strcmp(o->arch->name, "qwen3moe") || o->arch->moe_v3);
    if (moe[0] > 0 || moe[1] > 0 || a->mixtral || (o->arch && o->arch->moe_always)) {
        s->n_expert = moe[0] > 0 ? (int)moe[0] : s->n_expert ? s->n_expert : wide ? 16 : 8;
        s->n_expert_used = moe[1] > 0         ? (int)moe[1]
                           : s->n_expert_used ? s->n_expert_used
                           : wide             ? 4
                                              : 2;
    }
    if (moe[0] == 0) /* --experts 0: a dense model, also of a named MoE shape */
        s->n_expert = s->n_expert_used = 0;
    if (moe[2] >= 0)
        s->expert_ff = (int)moe[2];
    if (moe[3] >= 0)
        s->shared_ff = (int)moe[3];
    if (o->arch && !strcmp(o->arch->name, "glm4moe"))
        glm4moe_defaults(s);
    int *v3[N_V3] = {&s->n_shared_exp, &s->n_dense_lead, &s->n_group,
                     &s->n_group_used, &s->rope_dim,     &s->n_nextn};
    for (int i = 0; i < N_V3; i++)
        if (a->v3[i] >= 0)
            *v3[i] = (int)a->v3[i];
    int *mla[N_MLA] = {&s->q_lora, &s->kv_lora, &s->qk_rope, &s->qk_nope, &s->v_head};
    for (int i = 0; i < N_MLA; i++)
        if (a->mla[i] >= 0)
            *mla[i] = (int)a->mla[i];
    if (a->w_scale > 0.0f)
        s->w_scale = a->w_scale;
    return 0;
}

/* Write OUT.part, then rename it to OUT. Returns 0 or 1 after printing why not. */
static int write_model(struct kvr_synth_opts *opts, const char *out, double t0)
{
    struct kvr_err err = {0};
    size_t path_len = strlen(out) + 6;
    char *tmp = kvr_malloc(path_len);
    if (!tmp)
        return 1;
    snprintf(tmp, path_len, "%s.part", out);
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        fprintf(stderr, "kvasir synth: cannot create %s: %s\n", tmp, strerror(errno));
        kvr_free(tmp);
        return 1;
    }
    setvbuf(f, NULL, _IOFBF, 1 << 20);
    struct kvr_synth_stats stats;
    int wrc = kvr_synth_write(opts, f, &stats, &err);
    if (fclose(f) != 0 && !wrc)
        wrc = kvr_err_set(&err, KVR_EIO, "closing %s: %s", tmp, strerror(errno));
    if (!wrc && rename(tmp, out) != 0)
        wrc = kvr_err_set(&err, KVR_EIO, "renaming %s to %s: %s", tmp, out, strerror(errno));
    if (wrc) {
        fprintf(stderr, "kvasir synth: %s\n", err.msg);
        remove(tmp);
        kvr_free(tmp);
        return 1;
    }
    const struct kvr_synth_shape *s = &opts->shape;
    printf("synth: wrote %s: %s, shape %s, %s, %d layers, vocab %d, %" PRIu64 " tensors, %" PRIu64
           " params, %" PRIu64 " bytes in %.1f s\n",
           out, opts->arch ? opts->arch->name : "llama", s->name,
           kvr_dtype_traits(opts->type)->name, s->n_layers, stats.vocab_size, stats.n_tensors,
           stats.n_params, stats.file_bytes, now_s() - t0);
    kvr_free(tmp);
    return 0;
}

int kvr_cmd_synth(int argc, char **argv)
{
    struct synth_args a;
    int rc = parse(argc, argv, &a);
    if (rc)
        return rc == 1 ? 0 : rc;
    if ((rc = build_shape(&a)) != 0)
        return rc;
    struct kvr_err err = {0};
    struct kvr_gguf *vocab = NULL;
    if (a.vocab_path && kvr_gguf_open(&vocab, a.vocab_path, &err)) {
        fprintf(stderr, "kvasir synth: --vocab %s: %s\n", a.vocab_path, err.msg);
        return 1;
    }
    a.opts.vocab = vocab;
    struct progress prog = {now_s(), -1};
    if (isatty(STDERR_FILENO)) {
        a.opts.progress = show_progress;
        a.opts.progress_ctx = &prog;
    }
    rc = write_model(&a.opts, a.out, prog.t0);
    kvr_gguf_close(vocab);
    return rc;
}
