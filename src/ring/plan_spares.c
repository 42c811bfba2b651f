/* plan_spares.c - the plan's spare stages: the optional "spares" key (docs/PLAN.md "Spare
 * stages"). Parsed, validated, hashed and written like the rest of the plan (plan.c calls
 * in here through plan_int.h). A spare is an address (and a thread count); it holds no
 * layers until a re-plan gives it a lost stage's slice (propose.h kvr_plan_replan). */
#include "ring/addr.h"
#include "ring/plan_int.h"

#include <stdio.h>
#include <string.h>

int kvr_plan_spares_parse(struct kvr_plan *p, json_t *v, struct kvr_err *err)
{
    static const char *const keys[] = {"addr", "threads", NULL};
    p->n_spares = 0;
    if (!v)
        return KVR_OK;
    if (!json_is_array(v))
        return kvr_err_set(err, KVR_EINVAL, "plan: \"spares\" must be an array of {\"addr\"}");
    size_t n = json_array_size(v);
    if (n > KVR_PLAN_MAX_SPARES)
        return kvr_err_set(err, KVR_ERANGE, "plan: %zu spare stages; at most %d are supported", n,
                           KVR_PLAN_MAX_SPARES);
    p->n_spares = (uint32_t)n;
    for (uint32_t j = 0; j < p->n_spares; j++) {
        json_t *o = json_array_get(v, j);
        struct kvr_plan_spare *sp = &p->spares[j];
        char where[32], what[48];
        snprintf(where, sizeof where, "spares[%u]", j);
        if (!json_is_object(o))
            return kvr_err_set(err, KVR_EINVAL, "plan: %s must be an object {\"addr\": ...}",
                               where);
        int rc = kvr_plan_json_keys(o, keys, where, err);
        if (rc)
            return rc;
        json_t *addr = json_object_get(o, "addr");
        if (!addr)
            return kvr_err_set(err, KVR_EINVAL, "plan: %s has no \"addr\"", where);
        snprintf(what, sizeof what, "%s.addr", where);
        if ((rc = kvr_plan_json_str(addr, what, sp->addr, sizeof sp->addr, err)))
            return rc;
        json_t *threads = json_object_get(o, "threads");
        snprintf(what, sizeof what, "%s.threads", where);
        if (threads && (rc = kvr_plan_json_u32(threads, what, &sp->n_threads, err)))
            return rc;
    }
    return KVR_OK;
}

int kvr_plan_spares_validate(const struct kvr_plan *p, struct kvr_err *err)
{
    if (p->n_spares > KVR_PLAN_MAX_SPARES)
        return kvr_err_set(err, KVR_ERANGE, "plan: %u spare stages; at most %d", p->n_spares,
                           KVR_PLAN_MAX_SPARES);
    /* A re-plan's mask has one bit per stage and per spare (propose.h). */
    if (p->n_stages + p->n_spares > 64)
        return kvr_err_set(err, KVR_ERANGE,
                           "plan: %u stages and %u spares; at most 64 together are supported",
                           p->n_stages, p->n_spares);
    for (uint32_t j = 0; j < p->n_spares; j++) {
        const struct kvr_plan_spare *sp = &p->spares[j];
        char host[KVR_ADDR_HOST_BYTES];
        uint16_t port;
        struct kvr_err e = {0};
        if (kvr_addr_parse(sp->addr, host, sizeof host, &port, false, &e))
            return kvr_err_set(err, KVR_EINVAL, "plan: spares[%u] address \"%s\": %s", j, sp->addr,
                               e.msg);
        const char *clash = NULL;
        char other[32];
        if (kvr_addr_equal(sp->addr, p->bridge_addr))
            clash = "the bridge";
        for (uint32_t i = 0; !clash && i < p->n_stages && i < KVR_PLAN_MAX_STAGES; i++)
            if (kvr_addr_equal(sp->addr, p->stages[i].addr))
                snprintf(other, sizeof other, "stage %u", i), clash = other;
        for (uint32_t a = 0; !clash && a < p->n_agents && a < KVR_PLAN_MAX_AGENTS; a++)
            if (kvr_addr_equal(sp->addr, p->agents[a].addr))
                snprintf(other, sizeof other, "experts[%u]", a), clash = other;
        for (uint32_t k = 0; !clash && k < j; k++)
            if (kvr_addr_equal(sp->addr, p->spares[k].addr))
                snprintf(other, sizeof other, "spares[%u]", k), clash = other;
        if (clash)
            return kvr_err_set(err, KVR_EINVAL,
                               "plan: spares[%u] and %s both use address %s: every process "
                               "listens on its own address",
                               j, clash, sp->addr);
        if (sp->n_threads > KVR_PLAN_MAX_THREADS)
            return kvr_err_set(err, KVR_ERANGE, "plan: spares[%u] has threads %u, beyond %d", j,
                               sp->n_threads, KVR_PLAN_MAX_THREADS);
    }
    return KVR_OK;
}

void kvr_plan_spares_hash(const struct kvr_plan *p, crypto_generichash_state *st)
{
    uint32_t n = p->n_spares > KVR_PLAN_MAX_SPARES ? KVR_PLAN_MAX_SPARES : p->n_spares;
    if (n == 0)
        return;
    kvr_plan_hash_u32(st, n);
    for (uint32_t j = 0; j < n; j++)
        kvr_plan_hash_str(st, p->spares[j].addr);
}

int kvr_plan_spares_to_json(const struct kvr_plan *p, json_t *root)
{
    if (p->n_spares == 0)
        return 0;
    json_t *spares = json_array();
    bool ok = spares != NULL;
    for (uint32_t j = 0; ok && j < p->n_spares && j < KVR_PLAN_MAX_SPARES; j++) {
        const struct kvr_plan_spare *sp = &p->spares[j];
        json_t *o = json_pack("{s:s}", "addr", sp->addr);
        ok = o && !json_array_append_new(spares, o); /* spares owns o from here on */
        ok = ok &&
             (!sp->n_threads || !json_object_set_new(o, "threads", json_integer(sp->n_threads)));
    }
    if (!ok) {
        json_decref(spares);
        return -1;
    }
    return json_object_set_new(root, "spares", spares) ? -1 : 0; /* steals spares */
}
