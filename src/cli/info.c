/* info.c - `kvasir info MODEL.gguf`: print a GGUF file's header, metadata and tensor table,
 * then the architecture as the engine reads it (or why it cannot) and the tensor bytes per
 * weight type. A file the reader rejects is reported with the reader's message and exit
 * status 1; a valid GGUF the engine cannot run is still described (exit 0).
 * `kvasir info --plan PLAN` prints each stage's expected resident bytes instead
 * (kvr_engine_expected_bytes, the numbers each stage logs beside its measured Rss). */
#include "cli/cmd.h"

#include "core/alloc.h"
#include "model/arch.h"
#include "model/dtype.h"
#include "model/engine.h"
#include "model/gguf.h"
#include "ring/plan.h"
#include "ring/stage.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#define STR_SHOW_BYTES 60 /* longer strings (chat templates) are cut */
#define ARR_SHOW 5        /* array elements shown */

/* A string quoted, with control characters, quotes and backslashes escaped, cut at a UTF-8
 * character boundary after STR_SHOW_BYTES. */
static void print_str(const struct kvr_gguf_str *s)
{
    size_t n = s->len > STR_SHOW_BYTES ? STR_SHOW_BYTES : (size_t)s->len;
    while (n < s->len && n > 0 && ((uint8_t)s->ptr[n] & 0xC0) == 0x80)
        n--;
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        uint8_t c = (uint8_t)s->ptr[i];
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c == '\n')
            fputs("\\n", stdout);
        else if (c < 0x20 || c == 0x7F)
            printf("\\x%02x", c);
        else
            putchar(c);
    }
    putchar('"');
    if (n < s->len)
        printf("... (%" PRIu64 " bytes)", s->len);
}

/* One scalar element of `type` at p (little-endian, possibly unaligned). */
static void print_scalar(enum kvr_gguf_type type, const uint8_t *p)
{
    union {
        uint8_t u8;
        int8_t i8;
        uint16_t u16;
        int16_t i16;
        uint32_t u32;
        int32_t i32;
        float f32;
        uint64_t u64;
        int64_t i64;
        double f64;
    } v;
    static const uint8_t bytes[KVR_GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    memcpy(&v, p, bytes[type]);
    switch (type) {
    case KVR_GGUF_TYPE_UINT8:
        printf("%u", v.u8);
        break;
    case KVR_GGUF_TYPE_INT8:
        printf("%d", v.i8);
        break;
    case KVR_GGUF_TYPE_UINT16:
        printf("%u", v.u16);
        break;
    case KVR_GGUF_TYPE_INT16:
        printf("%d", v.i16);
        break;
    case KVR_GGUF_TYPE_UINT32:
        printf("%" PRIu32, v.u32);
        break;
    case KVR_GGUF_TYPE_INT32:
        printf("%" PRId32, v.i32);
        break;
    case KVR_GGUF_TYPE_FLOAT32:
        printf("%g", (double)v.f32);
        break;
    case KVR_GGUF_TYPE_BOOL:
        fputs(v.u8 ? "true" : "false", stdout);
        break;
    case KVR_GGUF_TYPE_UINT64:
        printf("%" PRIu64, v.u64);
        break;
    case KVR_GGUF_TYPE_INT64:
        printf("%" PRId64, v.i64);
        break;
    case KVR_GGUF_TYPE_FLOAT64:
        printf("%g", v.f64);
        break;
    default:
        break;
    }
}

static void print_kv(const struct kvr_gguf *g, int64_t i)
{
    enum kvr_gguf_type type = kvr_gguf_kv_type(g, i);
    struct kvr_gguf_str s;
    struct kvr_gguf_arr a;
    const void *raw;
    printf("  %-42s ", kvr_gguf_kv_key(g, i));
    if (!kvr_gguf_kv_str(g, i, &s)) {
        printf("%-14s ", "string");
        print_str(&s);
    } else if (!kvr_gguf_kv_arr(g, i, &a)) {
        char t[32];
        snprintf(t, sizeof t, "%s[%" PRIu64 "]", kvr_gguf_type_name(a.type), a.n);
        printf("%-14s ", t);
        static const uint8_t bytes[KVR_GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
        for (uint64_t j = 0; j < a.n && j < ARR_SHOW; j++) {
            fputs(j ? ", " : "", stdout);
            if (a.type == KVR_GGUF_TYPE_STRING)
                print_str(&a.strs[j]);
            else
                print_scalar(a.type, (const uint8_t *)a.data + j * bytes[a.type]);
        }
        if (a.n > ARR_SHOW)
            fputs(", ...", stdout);
    } else if (!kvr_gguf_kv_scalar(g, i, &raw)) {
        printf("%-14s ", kvr_gguf_type_name(type));
        print_scalar(type, raw);
    }
    putchar('\n');
}

/* What DeepSeek-V3-style routing and glm4moe add (model/moe_route.h, model/nextn.h). */
static void describe_v3(const struct kvr_hparams *hp)
{
    const struct kvr_moe_hparams *mp = &hp->moe;
    if (mp->n_ff_shexp && mp->shared_plain)
        printf(" of width %u (ungated)", mp->n_ff_shexp);
    if (mp->w_scale != 0.0f && mp->w_scale != 1.0f)
        printf(", weights x %g", (double)mp->w_scale);
    if (mp->n_group > 1)
        printf(", %u expert groups, %u used", mp->n_group, mp->n_group_used);
    if (mp->n_expert && mp->n_dense_lead)
        printf(", %u leading dense layer%s", mp->n_dense_lead, mp->n_dense_lead > 1 ? "s" : "");
    if (hp->n_rot < hp->head_dim && !hp->mla.kv_lora_rank) /* MLA: describe_mla */
        printf(", rope on %u of %u dims", hp->n_rot, hp->head_dim);
    if (hp->n_nextn)
        printf(", %u NextN layer%s (not run)", hp->n_nextn, hp->n_nextn > 1 ? "s" : "");
}

/* Latent attention's ranks and widths (model/mla.h), the kv_b form and YaRN. */
static void describe_mla(const struct kvr_gguf *g, const struct kvr_hparams *hp)
{
    const struct kvr_mla_hparams *m = &hp->mla;
    char q[32] = "none";
    if (m->q_lora_rank)
        snprintf(q, sizeof q, "%u", m->q_lora_rank);
    printf(", latent attention (MLA): kv_lora_rank %u, q_lora_rank %s, qk nope %u + rope %u, "
           "value %u, %s kv_b, KV cache %u values per token and layer",
           m->kv_lora_rank, q, m->n_nope, m->n_rope, m->n_v,
           kvr_gguf_find_tensor(g, "blk.0.attn_kv_b.weight") ? "fused" : "split",
           m->kv_lora_rank + m->n_rope);
    if (hp->yarn.factor > 0.0f)
        printf(", YaRN x%g from %u (log multiplier %g)", (double)hp->yarn.factor,
               hp->yarn.n_ctx_orig, (double)hp->yarn.log_mul);
}

/* The architecture as the engine reads it: a line for the model's shape, or the reason the
 * engine refuses it. */
static void describe_arch(const struct kvr_gguf *g)
{
    struct kvr_hparams hp;
    struct kvr_err err = {0};
    if (kvr_hparams_read(&hp, g, &err)) {
        printf("architecture: not runnable by this engine: %s\n", err.msg);
        return;
    }
    const struct kvr_arch *a = hp.arch;
    printf("architecture: %s, %u layers, dim %u, ff %u, heads %u/%u of %u, vocab %u, rope %s "
           "base %g%s%s, %s",
           a->name, hp.n_layer, hp.n_embd, hp.n_ff, hp.n_head, hp.n_head_kv, hp.head_dim,
           hp.n_vocab, a->rope == KVR_ROPE_NEOX ? "neox" : "normal", (double)hp.rope_freq_base,
           hp.rope_freqs ? " with rope_freqs" : "", hp.rope_freq_scale != 1.0f ? " scaled" : "",
           a->act == KVR_ACT_GELU_TANH    ? "GeGLU"
           : a->act == KVR_ACT_SWIGLU_OAI ? "clamped SwiGLU"
                                          : "SwiGLU");
    if (hp.n_swa)
        printf(", sliding window %u (period %u)", hp.n_swa, hp.swa_period);
    if (a->has & KVR_LT_BIT(KVR_LT_ATTN_SINKS))
        fputs(", attention sinks", stdout);
    if (hp.yarn.factor > 0.0f && !a->mla) /* describe_mla says it with its log multiplier */
        printf(", YaRN x%g over %u", (double)hp.yarn.factor, hp.yarn.n_ctx_orig);
    if (hp.attn_softcap > 0.0f || hp.final_softcap > 0.0f)
        printf(", soft-caps %g/%g", (double)hp.attn_softcap, (double)hp.final_softcap);
    if (hp.moe.n_expert)
        printf(", %u experts of width %u, top-%u (%s%s%s)%s", hp.moe.n_expert, hp.moe.n_ff_exp,
               hp.moe.n_used,
               hp.moe.gating == KVR_MOE_GATING_SOFTMAX_TOPK ? "softmax of the top-k"
               : hp.moe.gating == KVR_MOE_GATING_SIGMOID    ? "sigmoid"
                                                            : "softmax",
               hp.moe.norm_topk && hp.moe.gating != KVR_MOE_GATING_SOFTMAX_TOPK
                   ? ", top-k renormalised"
                   : "",
               hp.moe.probs_bias ? ", selection bias" : "",
               hp.moe.n_ff_shexp ? ", a shared expert" : "");
    describe_v3(&hp);
    if (hp.mla.kv_lora_rank)
        describe_mla(g, &hp);
    printf(", output %s\n", kvr_gguf_find_tensor(g, "output.weight") ? "own" : "tied");
}

/* `kvasir info --plan PLAN`: each stage's expected resident bytes. */
static int info_plan(const char *plan_path)
{
    struct kvr_err err = {0};
    struct kvr_plan *plan = kvr_malloc(sizeof *plan);
    struct kvr_gguf *g = NULL;
    char path[KVR_PLAN_PATH_BYTES];
    int rc = 1;
    if (!plan) {
        fprintf(stderr, "kvasir info: out of memory\n");
        return 1;
    }
    if (kvr_plan_load(plan, plan_path, &err) || kvr_plan_validate(plan, 0, &err) ||
        kvr_plan_path(plan, plan->model_path, path, sizeof path, &err) ||
        kvr_gguf_open(&g, path, &err)) {
        fprintf(stderr, "kvasir info: %s: %s\n", plan_path, err.msg);
        goto out;
    }
    printf("%s: %u stages of %s; expected resident bytes (weights + KV + scratch):\n", plan_path,
           plan->n_stages, path);
    for (uint32_t i = 0; i < plan->n_stages; i++) {
        struct kvr_engine_config cfg;
        struct kvr_engine_bytes b;
        kvr_stage_engine_config(plan, i, &cfg);
        if (kvr_engine_expected_bytes(g, &cfg, &b, &err)) {
            fprintf(stderr, "kvasir info: stage %u: %s\n", i, err.msg);
            goto out;
        }
        printf("  stage %u: layers %u-%u: %zu bytes (weights %zu, kv %zu, scratch %zu)\n", i,
               cfg.first_layer, cfg.last_layer, b.weights + b.kv + b.scratch, b.weights, b.kv,
               b.scratch);
    }
    rc = 0;
out:
    kvr_gguf_close(g);
    kvr_plan_wipe(plan);
    kvr_free(plan);
    return rc;
}

int kvr_cmd_info(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "--plan"))
        return info_plan(argv[2]);
    if (argc != 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fprintf(argc == 2 ? stdout : stderr,
                "usage: kvasir info MODEL.gguf | kvasir info --plan PLAN\n\n"
                "Print a GGUF file's version, metadata and tensor table; with --plan,\n"
                "each stage's expected resident bytes (weights + KV + scratch).\n");
        return argc == 2 ? 0 : 2;
    }
    const char *path = argv[1];
    struct kvr_gguf *g = NULL;
    struct kvr_err err = {0};
    if (kvr_gguf_open(&g, path, &err)) {
        fprintf(stderr, "kvasir info: %s: %s\n", path, err.msg);
        return 1;
    }
    printf("%s: GGUF v%" PRIu32 ", %zu bytes, alignment %zu, data at offset %zu, "
           "fingerprint %016" PRIx64 "\n",
           path, kvr_gguf_version(g), kvr_gguf_file_bytes(g), kvr_gguf_alignment(g),
           kvr_gguf_data_offset(g), kvr_gguf_fingerprint(g));

    printf("\n%" PRId64 " key/value pairs:\n", kvr_gguf_n_kv(g));
    for (int64_t i = 0; i < kvr_gguf_n_kv(g); i++)
        print_kv(g, i);

    int64_t n_tensors = kvr_gguf_n_tensors(g);
    uint64_t n_params = 0, n_bytes = 0;
    printf("\n%" PRId64 " tensors:\n", n_tensors);
    if (n_tensors)
        printf("  %-32s %-6s %-24s %12s %12s\n", "name", "type", "dims", "offset", "bytes");
    for (int64_t i = 0; i < n_tensors; i++) {
        const struct kvr_gguf_tensor *t = kvr_gguf_tensor(g, i);
        char dims[96];
        size_t used = 0;
        uint64_t n = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            used += (size_t)snprintf(dims + used, sizeof dims - used, "%s%" PRId64, d ? " x " : "",
                                     t->ne[d]);
            n *= (uint64_t)t->ne[d];
        }
        printf("  %-32s %-6s %-24s %12" PRIu64 " %12zu\n", t->name, kvr_dtype_traits(t->type)->name,
               dims, t->offset, t->n_bytes);
        n_params += n;
        n_bytes += t->n_bytes;
    }
    printf("\ntotal: %" PRId64 " tensors, %" PRIu64 " params, %" PRIu64 " tensor bytes, %zu "
           "file bytes\n",
           n_tensors, n_params, n_bytes, kvr_gguf_file_bytes(g));

    uint64_t type_bytes[KVR_DTYPE_COUNT] = {0}, type_count[KVR_DTYPE_COUNT] = {0};
    for (int64_t i = 0; i < n_tensors; i++) {
        const struct kvr_gguf_tensor *t = kvr_gguf_tensor(g, i);
        if (t->type >= 0 && t->type < KVR_DTYPE_COUNT) {
            type_bytes[t->type] += t->n_bytes;
            type_count[t->type]++;
        }
    }
    printf("by type:");
    for (int ty = 0; ty < KVR_DTYPE_COUNT; ty++)
        if (type_count[ty])
            printf(" %s %" PRIu64 " bytes (%" PRIu64 " tensors);", kvr_dtype_traits(ty)->name,
                   type_bytes[ty], type_count[ty]);
    printf("\n");
    describe_arch(g);
    kvr_gguf_close(g);
    return 0;
}
