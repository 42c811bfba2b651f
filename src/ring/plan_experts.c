/* plan_experts.c - the plan's expert placement: the optional "experts" key (docs/PLAN.md,
 * docs/EXPERTS.md). Parsed, validated, hashed and written like the rest of the plan
 * (plan.c calls in here through plan_int.h); the rules that need the model (experts
 * < n_expert, layers that are MoE) are checked by the processes that load it (experts.c). */
#include "ring/addr.h"
#include "ring/plan_int.h"

#include <stdio.h>
#include <string.h>

static int get_range(json_t *v, const char *what, uint32_t *first, uint32_t *last,
                     struct kvr_err *err)
{
    if (!json_is_array(v) || json_array_size(v) != 2)
        return kvr_err_set(err, KVR_EINVAL, "plan: %s must be [first, last] (an inclusive range)",
                           what);
    char w[160];
    snprintf(w, sizeof w, "%s[0]", what);
    int rc = kvr_plan_json_u32(json_array_get(v, 0), w, first, err);
    snprintf(w, sizeof w, "%s[1]", what);
    return rc ? rc : kvr_plan_json_u32(json_array_get(v, 1), w, last, err);
}

static int parse_agent(json_t *v, uint32_t j, struct kvr_plan_agent *a, struct kvr_err *err)
{
    static const char *const keys[] = {"addr", "threads", "holds", NULL};
    static const char *const hold_keys[] = {"layers", "experts", NULL};
    char where[48], what[128];
    snprintf(where, sizeof where, "experts[%u]", j);
    if (!json_is_object(v))
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: %s must be an object {\"addr\": ..., \"holds\": [...]}", where);
    int rc = kvr_plan_json_keys(v, keys, where, err);
    if (rc)
        return rc;
    json_t *addr = json_object_get(v, "addr");
    if (!addr)
        return kvr_err_set(err, KVR_EINVAL, "plan: %s has no \"addr\"", where);
    snprintf(what, sizeof what, "%s.addr", where);
    if ((rc = kvr_plan_json_str(addr, what, a->addr, sizeof a->addr, err)))
        return rc;
    json_t *threads = json_object_get(v, "threads");
    snprintf(what, sizeof what, "%s.threads", where);
    if (threads && (rc = kvr_plan_json_u32(threads, what, &a->n_threads, err)))
        return rc;
    json_t *holds = json_object_get(v, "holds");
    size_t n = json_is_array(holds) ? json_array_size(holds) : 0;
    if (n == 0 || n > KVR_PLAN_MAX_HOLDS)
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: %s.holds must be an array of 1 to %d {\"layers\": [a, b], "
                           "\"experts\": [c, d]}",
                           where, KVR_PLAN_MAX_HOLDS);
    a->n_holds = (uint32_t)n;
    for (uint32_t h = 0; h < a->n_holds; h++) {
        json_t *o = json_array_get(holds, h);
        char hw[80];
        snprintf(hw, sizeof hw, "%s.holds[%u]", where, h);
        if (!json_is_object(o))
            return kvr_err_set(err, KVR_EINVAL, "plan: %s must be an object", hw);
        if ((rc = kvr_plan_json_keys(o, hold_keys, hw, err)))
            return rc;
        struct kvr_plan_hold *hd = &a->holds[h];
        snprintf(what, sizeof what, "%s.layers", hw);
        if ((rc = get_range(json_object_get(o, "layers"), what, &hd->first_layer, &hd->last_layer,
                            err)))
            return rc;
        snprintf(what, sizeof what, "%s.experts", hw);
        if ((rc = get_range(json_object_get(o, "experts"), what, &hd->first_expert,
                            &hd->last_expert, err)))
            return rc;
    }
    return KVR_OK;
}

int kvr_plan_experts_parse(struct kvr_plan *p, json_t *v, struct kvr_err *err)
{
    p->n_agents = 0;
    if (!v)
        return KVR_OK;
    if (!json_is_array(v))
        return kvr_err_set(err, KVR_EINVAL,
                           "plan: \"experts\" must be an array of {\"addr\", \"holds\"}");
    size_t n = json_array_size(v);
    if (n > KVR_PLAN_MAX_AGENTS)
        return kvr_err_set(err, KVR_ERANGE, "plan: %zu expert agents; at most %d are supported", n,
                           KVR_PLAN_MAX_AGENTS);
    p->n_agents = (uint32_t)n;
    for (uint32_t j = 0; j < p->n_agents; j++) {
        int rc = parse_agent(json_array_get(v, j), j, &p->agents[j], err);
        if (rc)
            return rc;
    }
    return KVR_OK;
}

static bool overlap(uint32_t a0, uint32_t a1, uint32_t b0, uint32_t b1)
{
    return a0 <= b1 && b0 <= a1;
}

int kvr_plan_experts_validate(const struct kvr_plan *p, uint32_t n_layer, struct kvr_err *err)
{
    if (p->n_agents > KVR_PLAN_MAX_AGENTS)
        return kvr_err_set(err, KVR_ERANGE, "plan: %u expert agents; at most %d", p->n_agents,
                           KVR_PLAN_MAX_AGENTS);
    uint32_t last = 0; /* the plan's last layer (the stages are checked to be contiguous) */
    for (uint32_t i = 0; i < p->n_stages && i < KVR_PLAN_MAX_STAGES; i++)
        last = p->stages[i].last_layer > last ? p->stages[i].last_layer : last;
    if (n_layer)
        last = n_layer - 1;
    for (uint32_t j = 0; j < p->n_agents; j++) {
        const struct kvr_plan_agent *a = &p->agents[j];
        char host[KVR_ADDR_HOST_BYTES];
        uint16_t port;
        struct kvr_err e = {0};
        if (kvr_addr_parse(a->addr, host, sizeof host, &port, false, &e))
            return kvr_err_set(err, KVR_EINVAL, "plan: experts[%u] address \"%s\": %s", j, a->addr,
                               e.msg);
        if (kvr_addr_equal(a->addr, p->bridge_addr))
            return kvr_err_set(err, KVR_EINVAL,
                               "plan: experts[%u] and the bridge both use address %s: every "
                               "process listens on its own address",
                               j, a->addr);
        for (uint32_t i = 0; i < p->n_stages && i < KVR_PLAN_MAX_STAGES; i++)
            if (kvr_addr_equal(a->addr, p->stages[i].addr))
                return kvr_err_set(err, KVR_EINVAL,
                                   "plan: experts[%u] and stage %u both use address %s: every "
                                   "process listens on its own address",
                                   j, i, a->addr);
        for (uint32_t k = 0; k < j; k++)
            if (kvr_addr_equal(a->addr, p->agents[k].addr))
                return kvr_err_set(err, KVR_EINVAL,
                                   "plan: experts[%u] and experts[%u] both use address %s", k, j,
                                   a->addr);
        if (a->n_threads > KVR_PLAN_MAX_THREADS)
            return kvr_err_set(err, KVR_ERANGE, "plan: experts[%u] has threads %u, beyond %d", j,
                               a->n_threads, KVR_PLAN_MAX_THREADS);
        if (a->n_holds == 0 || a->n_holds > KVR_PLAN_MAX_HOLDS)
            return kvr_err_set(err, KVR_EINVAL, "plan: experts[%u] holds %u ranges; 1 to %d", j,
                               a->n_holds, KVR_PLAN_MAX_HOLDS);
        for (uint32_t h = 0; h < a->n_holds; h++) {
            const struct kvr_plan_hold *hd = &a->holds[h];
            if (hd->first_layer > hd->last_layer || hd->first_expert > hd->last_expert)
                return kvr_err_set(err, KVR_EINVAL,
                                   "plan: experts[%u].holds[%u] has a range whose first is past "
                                   "its last: write [first, last]",
                                   j, h);
            if (hd->last_layer > last)
                return kvr_err_set(err, KVR_EINVAL,
                                   "plan: experts[%u].holds[%u] names layer %u; the model's "
                                   "last layer is %u",
                                   j, h, hd->last_layer, last);
            if (hd->last_expert >= KVR_PLAN_MAX_EXPERTS)
                return kvr_err_set(err, KVR_ERANGE,
                                   "plan: experts[%u].holds[%u] names expert %u; at most %d "
                                   "experts per layer",
                                   j, h, hd->last_expert, KVR_PLAN_MAX_EXPERTS);
        }
    }
    /* Every (layer, expert) held by at most one agent (and once by it). */
    for (uint32_t j = 0; j < p->n_agents; j++)
        for (uint32_t h = 0; h < p->agents[j].n_holds; h++)
            for (uint32_t k = j; k < p->n_agents; k++)
                for (uint32_t g = k == j ? h + 1 : 0; g < p->agents[k].n_holds; g++) {
                    const struct kvr_plan_hold *x = &p->agents[j].holds[h];
                    const struct kvr_plan_hold *y = &p->agents[k].holds[g];
                    if (overlap(x->first_layer, x->last_layer, y->first_layer, y->last_layer) &&
                        overlap(x->first_expert, x->last_expert, y->first_expert, y->last_expert))
                        return kvr_err_set(err, KVR_EINVAL,
                                           "plan: experts[%u].holds[%u] and experts[%u]."
                                           "holds[%u] overlap: every expert of a layer is held "
                                           "by at most one agent",
                                           j, h, k, g);
                }
    return KVR_OK;
}

void kvr_plan_experts_hash(const struct kvr_plan *p, crypto_generichash_state *st)
{
    uint32_t n = p->n_agents > KVR_PLAN_MAX_AGENTS ? KVR_PLAN_MAX_AGENTS : p->n_agents;
    if (n == 0)
        return;
    kvr_plan_hash_u32(st, n);
    for (uint32_t j = 0; j < n; j++) {
        const struct kvr_plan_agent *a = &p->agents[j];
        uint32_t nh = a->n_holds > KVR_PLAN_MAX_HOLDS ? KVR_PLAN_MAX_HOLDS : a->n_holds;
        kvr_plan_hash_str(st, a->addr);
        kvr_plan_hash_u32(st, nh);
        for (uint32_t h = 0; h < nh; h++) {
            kvr_plan_hash_u32(st, a->holds[h].first_layer);
            kvr_plan_hash_u32(st, a->holds[h].last_layer);
            kvr_plan_hash_u32(st, a->holds[h].first_expert);
            kvr_plan_hash_u32(st, a->holds[h].last_expert);
        }
    }
}

void kvr_plan_experts_link_hash(const struct kvr_plan *p, uint8_t hash[KVR_PLAN_HASH_BYTES])
{
    static const char domain[] = "kvasir-experts-link-1";
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, KVR_PLAN_HASH_BYTES);
    crypto_generichash_update(&st, (const unsigned char *)domain, sizeof domain - 1);
    kvr_plan_hash_u32(&st, (uint32_t)p->model_fingerprint);
    kvr_plan_hash_u32(&st, (uint32_t)(p->model_fingerprint >> 32));
    kvr_plan_hash_u32(&st, p->row_width);
    kvr_plan_hash_u32(&st, p->encrypt ? 1 : 0);
    kvr_plan_hash_u32(&st, p->n_agents); /* 0 too: kvr_plan_experts_hash skips it then */
    kvr_plan_experts_hash(p, &st);
    crypto_generichash_final(&st, hash, KVR_PLAN_HASH_BYTES);
}

int kvr_plan_experts_to_json(const struct kvr_plan *p, json_t *root)
{
    if (p->n_agents == 0)
        return 0;
    json_t *agents = json_array();
    bool ok = agents != NULL;
    for (uint32_t j = 0; ok && j < p->n_agents && j < KVR_PLAN_MAX_AGENTS; j++) {
        const struct kvr_plan_agent *a = &p->agents[j];
        json_t *holds = json_array();
        ok = holds != NULL;
        for (uint32_t h = 0; ok && h < a->n_holds && h < KVR_PLAN_MAX_HOLDS; h++) {
            const struct kvr_plan_hold *hd = &a->holds[h];
            json_t *o = json_pack("{s:[I, I], s:[I, I]}", "layers", (json_int_t)hd->first_layer,
                                  (json_int_t)hd->last_layer, "experts",
                                  (json_int_t)hd->first_expert, (json_int_t)hd->last_expert);
            ok = o && !json_array_append_new(holds, o);
        }
        json_t *o = NULL;
        if (ok) /* "o" steals holds, also when the pack fails */
            o = json_pack("{s:s, s:o}", "addr", a->addr, "holds", holds);
        else
            json_decref(holds);
        ok = o && (!a->n_threads || !json_object_set_new(o, "threads", json_integer(a->n_threads)));
        ok = ok && !json_array_append_new(agents, o);
    }
    if (!ok) {
        json_decref(agents);
        return -1;
    }
    return json_object_set_new(root, "experts", agents) ? -1 : 0; /* steals agents */
}

bool kvr_plan_agent_holds(const struct kvr_plan_agent *a, uint32_t il, uint32_t e)
{
    for (uint32_t h = 0; h < a->n_holds && h < KVR_PLAN_MAX_HOLDS; h++) {
        const struct kvr_plan_hold *hd = &a->holds[h];
        if (il >= hd->first_layer && il <= hd->last_layer && e >= hd->first_expert &&
            e <= hd->last_expert)
            return true;
    }
    return false;
}

bool kvr_plan_agent_holds_layer(const struct kvr_plan_agent *a, uint32_t il)
{
    for (uint32_t h = 0; h < a->n_holds && h < KVR_PLAN_MAX_HOLDS; h++)
        if (il >= a->holds[h].first_layer && il <= a->holds[h].last_layer)
            return true;
    return false;
}

int kvr_plan_place_experts(struct kvr_plan *plan, uint32_t n_agents, uint32_t n_layer,
                           uint32_t n_expert, const char *host, uint32_t port0, struct kvr_err *err)
{
    if (n_agents == 0 || n_agents > n_expert || n_agents > KVR_PLAN_MAX_AGENTS || n_layer == 0)
        return kvr_err_set(err, KVR_EINVAL,
                           "%u expert agents for %u experts per layer: each agent needs at "
                           "least one expert (and at most %d agents)",
                           n_agents, n_expert, KVR_PLAN_MAX_AGENTS);
    if (port0 + n_agents > 65536)
        return kvr_err_set(err, KVR_ERANGE, "port %u leaves no room for %u expert agents", port0,
                           n_agents);
    plan->n_agents = n_agents;
    for (uint32_t j = 0; j < n_agents; j++) {
        struct kvr_plan_agent *a = &plan->agents[j];
        memset(a, 0, sizeof *a);
        int n = snprintf(a->addr, sizeof a->addr, "%s:%u", host, port0 + j);
        if (n < 0 || (size_t)n >= sizeof a->addr)
            return kvr_err_set(err, KVR_ERANGE, "host name too long: %s", host);
        a->n_holds = 1;
        a->holds[0] = (struct kvr_plan_hold){0, n_layer - 1, j * n_expert / n_agents,
                                             (j + 1) * n_expert / n_agents - 1};
    }
    return KVR_OK;
}

int kvr_plan_place_experts_kept(struct kvr_plan *plan, uint32_t n_agents, uint32_t n_expert,
                                const uint32_t *keep, const double *agent_speed, const char *host,
                                uint32_t port0, struct kvr_err *err)
{
    uint32_t ns = plan->n_stages;
    if (ns == 0 || ns > KVR_PLAN_MAX_STAGES)
        return kvr_err_set(err, KVR_EINVAL, "expert placement: the plan has %u stages", ns);
    int rc = kvr_plan_place_experts(plan, n_agents, plan->stages[ns - 1].last_layer + 1, n_expert,
                                    host, port0, err);
    if (rc)
        return rc;
    double total = 0;
    for (uint32_t j = 0; j < n_agents; j++) {
        double u = agent_speed ? agent_speed[j] : 1.0;
        if (!(u > 0) || u > 1e9)
            return kvr_err_set(err, KVR_EINVAL, "expert agent %u has speed %g: want > 0", j, u);
        total += u;
    }
    for (uint32_t s = 0; s < ns; s++)
        if (keep[s] + n_agents > n_expert)
            return kvr_err_set(err, KVR_EINVAL,
                               "stage %u keeps %u of %u experts: that leaves fewer than one "
                               "for each of %u agents",
                               s, keep[s], n_expert, n_agents);
    for (uint32_t j = 0; j < n_agents; j++)
        plan->agents[j].n_holds = 0;
    /* Stage s's layers: experts [0, n_expert - keep[s]) in blocks proportional to the
     * agents' speeds (each at least one expert), the last keep[s] computed by the stage. */
    for (uint32_t s = 0; s < ns; s++) {
        uint32_t m = n_expert - keep[s], lo = 0;
        double cum = 0;
        for (uint32_t j = 0; j < n_agents; j++) {
            cum += agent_speed ? agent_speed[j] : 1.0;
            uint32_t hi = j + 1 == n_agents ? m : (uint32_t)(cum / total * m + 0.5);
            if (hi < lo + 1)
                hi = lo + 1; /* at least one expert... */
            if (hi > m - (n_agents - 1 - j))
                hi = m - (n_agents - 1 - j); /* ...and one left for every agent after it */
            struct kvr_plan_agent *a = &plan->agents[j];
            struct kvr_plan_hold h = {plan->stages[s].first_layer, plan->stages[s].last_layer, lo,
                                      hi - 1};
            struct kvr_plan_hold *prev = a->n_holds ? &a->holds[a->n_holds - 1] : NULL;
            if (prev && prev->first_expert == h.first_expert &&
                prev->last_expert == h.last_expert && prev->last_layer + 1 == h.first_layer)
                prev->last_layer = h.last_layer;
            else if (a->n_holds < KVR_PLAN_MAX_HOLDS)
                a->holds[a->n_holds++] = h;
            else
                return kvr_err_set(err, KVR_ERANGE,
                                   "expert placement: agent %u would need more than %d holds "
                                   "(one per run of stages keeping the same experts)",
                                   j, KVR_PLAN_MAX_HOLDS);
            lo = hi;
        }
    }
    return KVR_OK;
}

void kvr_plan_experts_describe(const struct kvr_plan *plan, uint32_t n_expert, char *out,
                               size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (uint32_t s = 0; s < plan->n_stages && s < KVR_PLAN_MAX_STAGES && o < cap; s++) {
        const struct kvr_plan_stage *st = &plan->stages[s];
        uint32_t held = 0; /* of the stage's first layer: the holds are per run of stages */
        for (uint32_t e = 0; e < n_expert; e++)
            for (uint32_t j = 0; j < plan->n_agents && j < KVR_PLAN_MAX_AGENTS; j++)
                if (kvr_plan_agent_holds(&plan->agents[j], st->first_layer, e)) {
                    held++;
                    break;
                }
        int n =
            snprintf(out + o, cap - o, "%sstage %u computes %u of %u experts of layers %u-%u",
                     s ? "; " : "", s, n_expert - held, n_expert, st->first_layer, st->last_layer);
        o = n < 0 ? cap : o + (size_t)n;
    }
    for (uint32_t j = 0; j < plan->n_agents && j < KVR_PLAN_MAX_AGENTS && o < cap; j++) {
        const struct kvr_plan_agent *a = &plan->agents[j];
        int n = snprintf(out + o, cap - o, "; agent %u", j);
        o = n < 0 ? cap : o + (size_t)n;
        for (uint32_t h = 0; h < a->n_holds && h < KVR_PLAN_MAX_HOLDS && o < cap; h++) {
            const struct kvr_plan_hold *hd = &a->holds[h];
            n = snprintf(out + o, cap - o, "%s experts %u-%u of layers %u-%u", h ? "," : "",
                         hd->first_expert, hd->last_expert, hd->first_layer, hd->last_layer);
            o = n < 0 ? cap : o + (size_t)n;
        }
    }
}
