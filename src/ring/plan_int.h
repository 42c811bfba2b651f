/* plan_int.h - what plan.c shares with plan_experts.c (the "experts" key) and
 * plan_spares.c (the "spares" key): the JSON
 * helpers and the four steps of the expert placement. Private to the plan module.
 * Threads: reentrant, like plan.h. */
#ifndef KVR_RING_PLAN_INT_H
#define KVR_RING_PLAN_INT_H

#include "core/err.h"
#include "ring/plan.h"

#include <jansson.h>
#include <sodium.h>

/* plan.c's helpers: a non-negative 32-bit integer, a bounded string, no unknown keys. */
int kvr_plan_json_u32(json_t *v, const char *what, uint32_t *out, struct kvr_err *err);
int kvr_plan_json_str(json_t *v, const char *what, char *dst, size_t cap, struct kvr_err *err);
int kvr_plan_json_keys(json_t *obj, const char *const *allowed, const char *where,
                       struct kvr_err *err);
void kvr_plan_hash_u32(crypto_generichash_state *st, uint32_t v);
void kvr_plan_hash_str(crypto_generichash_state *st, const char *s);

/* plan_experts.c: parse "experts" (v may be NULL: no agents), check its rules (n_layer 0 =
 * unknown), append it to the hash (nothing when there are no agents, so plans without
 * agents keep their hash), write it to JSON. */
int kvr_plan_experts_parse(struct kvr_plan *p, json_t *v, struct kvr_err *err);
int kvr_plan_experts_validate(const struct kvr_plan *p, uint32_t n_layer, struct kvr_err *err);
void kvr_plan_experts_hash(const struct kvr_plan *p, crypto_generichash_state *st);
int kvr_plan_experts_to_json(const struct kvr_plan *p, json_t *root);

/* plan_spares.c: the same four steps for "spares" (nothing hashed or written when the plan
 * has none). */
int kvr_plan_spares_parse(struct kvr_plan *p, json_t *v, struct kvr_err *err);
int kvr_plan_spares_validate(const struct kvr_plan *p, struct kvr_err *err);
void kvr_plan_spares_hash(const struct kvr_plan *p, crypto_generichash_state *st);
int kvr_plan_spares_to_json(const struct kvr_plan *p, json_t *root);

#endif
