/* propose.c - plans from a model file (see propose.h). Reading order: the costs the
 * balancer weighs (per layer, head and tail, the experts' share), the proposal itself, then
 * re-planning after a lost stage. */
#include "ring/propose.h"

#include "core/alloc.h"
#include "model/engine.h"
#include "model/kv.h"
#include "model/moe.h"

#include <sodium.h>
#include <stdio.h>
#include <string.h>

/* A layer's time per weight byte, relative to a bare matmul's (see model_costs). */
#define LAYER_NON_MATMUL 2.0
/* The same for the routed experts' share of a MoE layer, on the owning stage or an agent
 * (expert_keep). */
#define EXPERT_NON_MATMUL 2.0

static double tensor_bytes(const struct kvr_gguf *g, const char *name)
{
    const struct kvr_gguf_tensor *t = kvr_gguf_find_tensor(g, name);
    return t ? (double)t->n_bytes : 0.0;
}

/* Bytes of layer il's tensors a token reads, named by the architecture table (a fused QKV
 * or gate/up tensor counts once, under its own name). A mixture-of-experts layer counts
 * its router, expert_used_count experts and any shared expert, not all its experts: that
 * is what a decode step reads. *routed (may be NULL) gets the part of it in the routed
 * experts, which expert agents can take over; the rest stays with the owning stage. A
 * layer whose tensors do not view counts 0 here; the engine refuses the file with the
 * reason when a stage loads it. */
static double layer_bytes(const struct kvr_gguf *g, const struct kvr_hparams *hp, uint32_t il,
                          double *routed)
{
    double sum = 0;
    char name[96];
    for (int t = 0; t < KVR_LT_COUNT; t++) {
        if (!kvr_hparams_layer_has(hp, il, (enum kvr_lt)t))
            continue;
        snprintf(name, sizeof name, "blk.%u.%s", il, kvr_arch_lt_name(hp->arch, (enum kvr_lt)t));
        sum += tensor_bytes(g, name);
    }
    if (hp->mla.kv_lora_rank) /* latent attention's tensors are not in the table */
        sum += kvr_mla_layer_file_bytes(g, il);
    struct kvr_moe_layer moe;
    if (routed)
        *routed = 0;
    if (kvr_hparams_layer_moe(hp, il) &&
        !kvr_moe_layer_view(&moe, g, il, hp->n_embd, &hp->moe, NULL)) {
        sum += kvr_moe_layer_bytes_per_token(&moe, &hp->moe);
        if (routed)
            *routed = (double)hp->moe.n_used *
                      ((double)moe.gate_stride + (double)moe.up_stride + (double)moe.down_stride);
    }
    return sum;
}

/* The balancer's costs, from the model file alone (so every process holding the same file
 * computes the same ones): *cost (n_layer values, the caller frees it with kvr_free), the
 * head's and the tail's extra cost. Costs are in weight bytes read per step. A layer spends
 * about as long again on what is not a matmul (attention over the KV cache, norms, RoPE,
 * SwiGLU), so its bytes weigh LAYER_NON_MATMUL times a bare matmul's. The output head is a
 * matmul alone, and the embedding a row copy per token. */
static int model_costs(const struct kvr_gguf *g, const struct kvr_hparams *hp, double **cost,
                       double *head_cost, double *tail_cost, struct kvr_err *err)
{
    *cost = kvr_calloc(hp->n_layer, sizeof **cost);
    if (!*cost)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < hp->n_layer; i++)
        (*cost)[i] = LAYER_NON_MATMUL * layer_bytes(g, hp, i, NULL);
    const struct kvr_gguf_tensor *emb = kvr_gguf_find_tensor(g, "token_embd.weight");
    *head_cost = emb && emb->ne[1] ? (double)emb->n_bytes / (double)emb->ne[1] : 0;
    *tail_cost = tensor_bytes(g, "output_norm.weight") +
                 (kvr_gguf_find_tensor(g, "output.weight") ? tensor_bytes(g, "output.weight")
                                                           : tensor_bytes(g, "token_embd.weight"));
    return KVR_OK;
}

/* How many experts of its layers each stage keeps (docs/PLAN.md "Expert placement"): the
 * share that makes every machine's work per token, over its speed, the same. Stage s has
 * A_s (its layers without their routed experts, the head's or tail's extra) and E_s (the
 * routed experts of its layers a token uses); the agents, of total speed U, share what the
 * stages leave. With T = sum(A_s + E_s) / (sum v_s + U), stage s keeps the fraction
 * f_s = (T v_s - A_s) / E_s of its experts, rounded to whole experts. A share outside
 * 0 .. 1 - K/n (each agent keeps at least one) is held at the bound and T found again for
 * the other stages. Costs are the balancer's (model_costs): the routed experts'
 * bytes count EXPERT_NON_MATMUL times, like a layer's. */
static void expert_keep(const struct kvr_gguf *g, const struct kvr_hparams *hp,
                        const struct kvr_plan *plan, const struct kvr_plan_spec *spec,
                        double head_cost, double tail_cost, uint32_t *keep)
{
    uint32_t ns = plan->n_stages, n = hp->moe.n_expert, k = spec->n_agents;
    double a[KVR_PLAN_MAX_STAGES], e[KVR_PLAN_MAX_STAGES];
    for (uint32_t s = 0; s < ns; s++) {
        a[s] = (s == 0 ? head_cost : 0) + (s + 1 == ns ? tail_cost : 0);
        e[s] = 0;
        for (uint32_t il = plan->stages[s].first_layer; il <= plan->stages[s].last_layer; il++) {
            double routed, all = layer_bytes(g, hp, il, &routed);
            a[s] += LAYER_NON_MATMUL * (all - routed);
            e[s] += EXPERT_NON_MATMUL * routed;
        }
    }
    double agents = 0, most = (double)(n - k) / n, f[KVR_PLAN_MAX_STAGES];
    for (uint32_t j = 0; j < k; j++)
        agents += spec->agent_speed ? spec->agent_speed[j] : 1.0;
    bool fixed[KVR_PLAN_MAX_STAGES] = {false};
    /* A stage whose share falls outside 0 .. most keeps the bound, and T is found again
     * for the others: the agents take what the fixed stages leave (at most ns rounds). */
    for (bool again = true; again;) {
        again = false;
        double work = 0, speed = agents;
        for (uint32_t s = 0; s < ns; s++) {
            if (fixed[s]) {
                work += (1 - f[s]) * e[s];
            } else {
                work += a[s] + e[s];
                speed += spec->stage_speed ? spec->stage_speed[s] : 1.0;
            }
        }
        double t = work / speed;
        for (uint32_t s = 0; s < ns; s++) {
            if (fixed[s])
                continue;
            double v = spec->stage_speed ? spec->stage_speed[s] : 1.0;
            f[s] = e[s] > 0 ? (t * v - a[s]) / e[s] : 0;
            if (f[s] < 0 || f[s] > most || e[s] <= 0) {
                f[s] = f[s] < 0 || e[s] <= 0 ? 0 : most;
                fixed[s] = again = true;
            }
        }
    }
    for (uint32_t s = 0; s < ns; s++) {
        keep[s] = (uint32_t)(f[s] * n + 0.5);
        if (keep[s] + k > n)
            keep[s] = n - k;
    }
}

/* The i-th comma-separated host of `hosts` (the last one repeats). */
static void nth_host(const char *hosts, uint32_t i, char *out, size_t cap)
{
    const char *p = hosts;
    for (uint32_t k = 0; k < i; k++) {
        const char *c = strchr(p, ',');
        if (!c)
            break;
        p = c + 1;
    }
    size_t n = strcspn(p, ",");
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), p);
}

/* Stage i listens on host i (or the only host) at base port + i; the bridge, unless
 * given, on the first host one port below. */
static int place_stages(struct kvr_plan *plan, const struct kvr_plan_spec *spec, const char *hosts,
                        uint32_t port, const struct kvr_balance_result *res, struct kvr_err *err)
{
    char host[KVR_PLAN_ADDR_BYTES - 8];
    for (uint32_t i = 0; i < spec->n_stages; i++) {
        nth_host(hosts, i, host, sizeof host);
        int n =
            snprintf(plan->stages[i].addr, sizeof plan->stages[i].addr, "%s:%u", host, port + i);
        if (n < 0 || (size_t)n >= sizeof plan->stages[i].addr)
            return kvr_err_set(err, KVR_ERANGE, "host name too long: %s", host);
        plan->stages[i].first_layer = res->first_layer[i];
        plan->stages[i].last_layer = res->last_layer[i];
    }
    if (spec->bridge_addr) {
        snprintf(plan->bridge_addr, sizeof plan->bridge_addr, "%s", spec->bridge_addr);
    } else {
        nth_host(hosts, 0, host, sizeof host);
        int n = snprintf(plan->bridge_addr, sizeof plan->bridge_addr, "%s:%u", host, port - 1);
        if (n < 0 || (size_t)n >= sizeof plan->bridge_addr)
            return kvr_err_set(err, KVR_ERANGE, "host name too long: %s", host);
    }
    return KVR_OK;
}

/* The KV cache: its number type, and its blocks given, or as many as kv_mib holds in the
 * stage with the most layers, or by default a full context for every slot. */
static int size_kv(struct kvr_plan *plan, const struct kvr_plan_spec *spec,
                   const struct kvr_hparams *hp, const struct kvr_balance_result *res,
                   struct kvr_err *err)
{
    uint64_t per_seq = (plan->n_ctx + plan->kv_block_tokens - 1) / plan->kv_block_tokens;
    plan->kv_type = KVR_PLAN_DEFAULT_KV_TYPE;
    if (spec->kv_type && kvr_plan_kv_type_parse(spec->kv_type, &plan->kv_type))
        return kvr_err_set(err, KVR_EINVAL, "KV type '%s' is not f32, f16 or q8_0", spec->kv_type);
    if (plan->kv_type == KVR_DTYPE_Q8_0 && hp->head_dim % 32)
        return kvr_err_set(err, KVR_EINVAL,
                           "a q8_0 KV cache needs a head width that is a multiple of 32 (this "
                           "model's is %u); use f16 or f32",
                           hp->head_dim);
    uint64_t blocks = spec->kv_blocks ? spec->kv_blocks : per_seq * plan->max_seqs;
    if (spec->kv_mib && spec->kv_blocks)
        return kvr_err_set(err, KVR_EINVAL, "give the KV cache in blocks or in MiB, not both");
    if (spec->kv_mib) {
        /* A block holds block_tokens rows of K and of V in every layer of a stage. */
        uint32_t most = 0;
        for (uint32_t i = 0; i < spec->n_stages; i++) {
            uint32_t n = res->last_layer[i] - res->first_layer[i] + 1;
            most = n > most ? n : most;
        }
        uint64_t block_bytes =
            2ull * most * plan->kv_block_tokens * kvr_kv_bytes(plan->kv_type, hp->kv_dim);
        if (!block_bytes)
            return kvr_err_set(err, KVR_EINVAL, "KV type %s cannot hold rows of %u values",
                               kvr_plan_kv_type_name(plan->kv_type), hp->kv_dim);
        blocks = ((uint64_t)spec->kv_mib << 20) / block_bytes;
    }
    if (blocks > UINT32_MAX)
        return kvr_err_set(err, KVR_ERANGE, "too many KV blocks (%llu)",
                           (unsigned long long)blocks);
    plan->kv_blocks = (uint32_t)blocks;
    return KVR_OK;
}

/* Expert agents on the first host, after the stages' ports: each stage keeps the share of
 * its experts that balances its work with the agents' (or the share the spec fixes). */
static int place_agents(struct kvr_plan *plan, const struct kvr_gguf *g,
                        const struct kvr_hparams *hp, const struct kvr_plan_spec *spec,
                        const char *hosts, uint32_t port, double head_cost, double tail_cost,
                        struct kvr_err *err)
{
    char host[KVR_PLAN_ADDR_BYTES - 8];
    nth_host(hosts, 0, host, sizeof host);
    uint32_t keep[KVR_PLAN_MAX_STAGES];
    if (spec->keep_fixed) {
        for (uint32_t s = 0; s < plan->n_stages; s++)
            keep[s] = spec->keep;
    } else {
        expert_keep(g, hp, plan, spec, head_cost, tail_cost, keep);
    }
    int rc = kvr_plan_place_experts_kept(plan, spec->n_agents, hp->moe.n_expert, keep,
                                         spec->agent_speed, host, port + spec->n_stages, err);
    if (rc == KVR_ERANGE && !spec->keep_fixed) {
        /* more runs of different shares than an agent has holds: one share for all */
        double sum = 0;
        for (uint32_t s = 0; s < plan->n_stages; s++)
            sum += keep[s];
        for (uint32_t s = 0; s < plan->n_stages; s++)
            keep[s] = (uint32_t)(sum / plan->n_stages + 0.5);
        rc = kvr_plan_place_experts_kept(plan, spec->n_agents, hp->moe.n_expert, keep,
                                         spec->agent_speed, host, port + spec->n_stages, err);
    }
    return rc;
}

int kvr_plan_propose(struct kvr_plan *plan, const struct kvr_gguf *g,
                     const struct kvr_plan_spec *spec, struct kvr_err *err)
{
    memset(plan, 0, sizeof *plan);
    struct kvr_hparams hp;
    int rc = kvr_hparams_read(&hp, g, err);
    if (rc)
        return rc;
    if (spec->n_stages < 2)
        return kvr_err_set(err, KVR_EINVAL,
                           "a pipeline needs at least two stages: head and "
                           "tail are different roles (asked for %u)",
                           spec->n_stages);
    if (spec->n_stages > hp.n_layer || spec->n_stages > KVR_PLAN_MAX_STAGES)
        return kvr_err_set(err, KVR_EINVAL,
                           "%u stages for a model of %u layers: each stage "
                           "needs at least one layer",
                           spec->n_stages, hp.n_layer);
    double *cost = NULL, head_cost, tail_cost;
    if ((rc = model_costs(g, &hp, &cost, &head_cost, &tail_cost, err)))
        return rc;
    struct kvr_balance_input in = {.n_layer = hp.n_layer,
                                   .n_stages = spec->n_stages,
                                   .layer_cost = cost,
                                   .head_cost = head_cost,
                                   .tail_cost = tail_cost,
                                   .stage_speed = spec->stage_speed};
    struct kvr_balance_result res;
    rc = kvr_plan_balance(&in, &res, err);
    kvr_free(cost);
    if (rc)
        return rc;

    const char *hosts = spec->hosts && spec->hosts[0] ? spec->hosts : "127.0.0.1";
    uint32_t port = spec->base_port ? spec->base_port : 7001;
    if (port < 2 || port + spec->n_stages > 65535)
        return kvr_err_set(err, KVR_ERANGE, "base port %u leaves no room for %u stages", port,
                           spec->n_stages);
    snprintf(plan->model_path, sizeof plan->model_path, "%s", spec->model_path);
    plan->n_stages = spec->n_stages;
    if ((rc = place_stages(plan, spec, hosts, port, &res, err)))
        return rc;
    plan->row_width = spec->row_width ? spec->row_width : 64;
    plan->microbatches = spec->microbatches ? spec->microbatches : spec->n_stages;
    plan->max_seqs = spec->max_seqs ? spec->max_seqs : 32;
    plan->n_ctx = spec->n_ctx ? spec->n_ctx : (hp.n_ctx_train < 2048 ? hp.n_ctx_train : 2048);
    plan->kv_block_tokens =
        spec->kv_block_tokens ? spec->kv_block_tokens : KVR_PLAN_DEFAULT_KV_BLOCK_TOKENS;
    if ((rc = size_kv(plan, spec, &hp, &res, err)))
        return rc;
    plan->wire_dtype = spec->wire_dtype;
    plan->n_threads = spec->n_threads ? spec->n_threads : 1;
    plan->encrypt = !spec->no_encrypt;
    plan->model_fingerprint = spec->fingerprint;
    if (sodium_init() < 0)
        return kvr_err_set(err, KVR_EIO, "libsodium failed to initialise");
    plan->secret_bytes = 32;
    randombytes_buf(plan->secret, plan->secret_bytes);
    if (spec->n_agents &&
        (rc = place_agents(plan, g, &hp, spec, hosts, port, head_cost, tail_cost, err)))
        return rc;
    return kvr_plan_validate(plan, hp.n_layer, err);
}

/* The stages of the re-planned ring, in order: src[k] = the old stage it is (< n_stages)
 * or n_stages + j for spare j, which takes the lost stage's place; *n_out of them;
 * *dropped = some lost stage had no spare to take its place (the layers are re-balanced). */
static int replan_slots(const struct kvr_plan *old, uint64_t keep, uint32_t src[64],
                        uint32_t *n_out, bool *dropped, struct kvr_err *err)
{
    uint32_t ns = old->n_stages, nsp = old->n_spares;
    if (ns > 64 || ns + nsp > 64)
        return kvr_err_set(err, KVR_EINVAL, "re-plan: %u stages and %u spares", ns, nsp);
    if (ns + nsp < 64 && keep >> (ns + nsp))
        return kvr_err_set(err, KVR_EINVAL,
                           "re-plan: stage mask 0x%llx names stages beyond the "
                           "plan's %u (and %u spares)",
                           (unsigned long long)keep, ns, nsp);
    uint32_t n_dead = 0, n_taken = 0;
    for (uint32_t i = 0; i < ns; i++)
        n_dead += !((keep >> i) & 1);
    for (uint32_t j = 0; j < nsp; j++)
        n_taken += (keep >> (ns + j)) & 1;
    if (n_taken > n_dead)
        return kvr_err_set(err, KVR_EINVAL,
                           "re-plan: mask 0x%llx takes %u spares for %u lost stages",
                           (unsigned long long)keep, n_taken, n_dead);
    uint32_t n = 0, j = 0;
    *dropped = false;
    for (uint32_t i = 0; i < ns; i++) {
        if ((keep >> i) & 1) {
            src[n++] = i;
            continue;
        }
        while (j < nsp && !((keep >> (ns + j)) & 1))
            j++;
        if (j < nsp)
            src[n++] = ns + j++; /* the next spare taken steps in */
        else
            *dropped = true;
    }
    *n_out = n;
    return KVR_OK;
}

bool kvr_plan_replan_index(const struct kvr_plan *old, uint64_t keep, uint32_t who, uint32_t *index)
{
    uint32_t src[64], n;
    bool dropped;
    struct kvr_err e = {0};
    if (replan_slots(old, keep, src, &n, &dropped, &e))
        return false;
    for (uint32_t k = 0; k < n; k++) {
        if (src[k] == who) {
            *index = k;
            return true;
        }
    }
    return false;
}

int kvr_plan_replan(const struct kvr_plan *old, const struct kvr_gguf *g, uint64_t keep,
                    struct kvr_plan *out, struct kvr_err *err)
{
    struct kvr_hparams hp;
    int rc = kvr_hparams_read(&hp, g, err);
    if (rc)
        return rc;
    uint32_t src[64], n;
    bool dropped;
    if ((rc = replan_slots(old, keep, src, &n, &dropped, err)))
        return rc;
    if (n < 2)
        return kvr_err_set(err, KVR_EINVAL,
                           "re-plan: %u stage%s left; a ring needs at least two (head and tail)", n,
                           n == 1 ? "" : "s");
    if (n > hp.n_layer)
        return kvr_err_set(err, KVR_EINVAL, "re-plan: %u stages for %u layers", n, hp.n_layer);
    if (old->epoch == UINT16_MAX) /* the epoch travels in a REPLAN frame's 16-bit arg */
        return kvr_err_set(err, KVR_ERANGE, "re-plan: epoch %u is the last one", old->epoch);
    struct kvr_balance_result res;
    if (dropped) {
        double *cost = NULL, head_cost, tail_cost;
        if ((rc = model_costs(g, &hp, &cost, &head_cost, &tail_cost, err)))
            return rc;
        struct kvr_balance_input in = {.n_layer = hp.n_layer,
                                       .n_stages = n,
                                       .layer_cost = cost,
                                       .head_cost = head_cost,
                                       .tail_cost = tail_cost};
        rc = kvr_plan_balance(&in, &res, err);
        kvr_free(cost);
        if (rc)
            return rc;
    }
    uint32_t ns = old->n_stages;
    *out = *old;
    out->epoch = old->epoch + 1;
    out->n_stages = n;
    uint32_t i_prev = 0; /* the old stage whose place slot k takes */
    for (uint32_t k = 0; k < n; k++) {
        struct kvr_plan_stage *st = &out->stages[k];
        if (src[k] < ns) {
            *st = old->stages[src[k]];
            i_prev = src[k];
        } else { /* a spare in the first lost place after the previous slot's */
            const struct kvr_plan_spare *sp = &old->spares[src[k] - ns];
            uint32_t i = k == 0 ? 0 : i_prev + 1;
            while (i < ns && ((keep >> i) & 1))
                i++;
            memset(st, 0, sizeof *st);
            snprintf(st->addr, sizeof st->addr, "%s", sp->addr);
            st->n_threads = sp->n_threads;
            st->first_layer = old->stages[i].first_layer;
            st->last_layer = old->stages[i].last_layer;
            i_prev = i;
        }
        if (dropped) {
            st->first_layer = res.first_layer[k];
            st->last_layer = res.last_layer[k];
        }
    }
    for (uint32_t k = n; k < KVR_PLAN_MAX_STAGES; k++)
        memset(&out->stages[k], 0, sizeof out->stages[k]);
    out->n_spares = 0; /* the spares not taken stay spares */
    for (uint32_t j = 0; j < old->n_spares; j++)
        if (!((keep >> (ns + j)) & 1))
            out->spares[out->n_spares++] = old->spares[j];
    for (uint32_t j = out->n_spares; j < KVR_PLAN_MAX_SPARES; j++)
        memset(&out->spares[j], 0, sizeof out->spares[j]);
    return kvr_plan_validate(out, hp.n_layer, err);
}
