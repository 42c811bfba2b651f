/* propose.h - write a valid plan for a model: split its layers over N stages so that no
 * stage is the slow one (DESIGN.md 2), and fill the widths with sane defaults.
 *
 * Costs come from the model file itself: a layer costs the bytes of its weights (decode
 * reads every weight once per step), the head also reads one embedding row per token, and
 * the tail also reads the whole output head (n_vocab x n_embd), which is why the tail gets
 * fewer layers. Stage speeds (e.g. measured tokens/s of each machine) weight the split. */
#ifndef KVR_RING_PROPOSE_H
#define KVR_RING_PROPOSE_H

#include "core/err.h"
#include "model/gguf.h"
#include "ring/plan.h"

struct kvr_plan_spec {
    uint32_t n_stages;         /* >= 2 */
    const char *hosts;         /* comma-separated hosts (one, or one per stage);
                                  NULL = 127.0.0.1 */
    uint32_t base_port;        /* stage i listens on base_port + i (default 7001) */
    const char *bridge_addr;   /* default "<first host>:<base_port - 1>" */
    const char *model_path;    /* written into the plan as given */
    const double *stage_speed; /* n_stages relative speeds, or NULL */
    uint32_t row_width;        /* 0 = 64 */
    uint32_t microbatches;     /* 0 = n_stages */
    uint32_t max_seqs;         /* 0 = 32 */
    uint32_t n_ctx;            /* 0 = min(2048, the model's) */
    uint32_t kv_block_tokens;  /* 0 = 16 */
    uint32_t kv_blocks;        /* 0 = max_seqs * n_ctx worth, or what kv_mib holds */
    uint32_t kv_mib;           /* KV memory per stage in MiB (K and V): kv_blocks is what
                                  the stage with the most layers fits of kv_type; 0 = none */
    const char *kv_type;       /* "f32", "f16" or "q8_0"; NULL = KVR_PLAN_DEFAULT_KV_TYPE */
    enum kvr_dtype wire_dtype; /* F32 (0) or F16 */
    uint32_t n_threads;        /* per stage; 0 = 1 */
    bool no_encrypt;           /* plain frames ("encrypt": false); default sealed */
    uint64_t fingerprint;      /* the model's kvr_gguf_fingerprint, or 0 (no check) */
    uint32_t n_agents;         /* expert agents (MoE models), agent j on the first host,
                                  port base_port + n_stages + j; 0 = none. Each stage keeps
                                  the share of its layers' experts that balances its work
                                  with the agents' (kvr_plan_propose), the agents split the
                                  rest in blocks sized by agent_speed */
    const double *agent_speed; /* n_agents relative speeds (stage_speed's unit), or NULL */
    bool keep_fixed;           /* every stage keeps `keep` experts of each of its layers
                                  instead of the balanced share (0: all on the agents) */
    uint32_t keep;
};

/* Fill `plan` (with a fresh random secret) and validate it against the model. */
int kvr_plan_propose(struct kvr_plan *plan, const struct kvr_gguf *g,
                     const struct kvr_plan_spec *spec, struct kvr_err *err);

/* A re-planned ring (DESIGN.md 8, docs/PLAN.md "Re-planning" and "Spare stages"). `keep`
 * has a bit per stage and per spare: bit i (< n_stages) = old stage i is kept, bit
 * n_stages + j = spare j steps in. The new ring has, in the old order, every kept stage and,
 * in the place of each stage not kept, the next spare taken (in spare order), with that
 * stage's layers, its own address and threads; spares not taken stay spares. When a lost
 * stage has no spare to take its place (fewer spares taken than stages lost), it is left
 * out and the model's layers are balanced over the stages left as kvr_plan_propose does
 * (uniform speeds, costs from the file); otherwise every layer range stays as it was.
 * Every other field is kept, and epoch = old->epoch + 1, so its hash differs from every
 * earlier plan's and old links are refused. Deterministic: every process holding the same
 * model file computes the same plan from the same (old, keep). KVR_EINVAL if fewer than
 * two stages are left, keep names stages or spares the plan does not have, or takes more
 * spares than stages are lost. */
int kvr_plan_replan(const struct kvr_plan *old, const struct kvr_gguf *g, uint64_t keep,
                    struct kvr_plan *out, struct kvr_err *err);

/* Where `who` (old stage who < n_stages, or spare who - n_stages) is in kvr_plan_replan(old,
 * keep)'s plan: true with *index its stage index there, false when it is not in the new
 * ring (or keep is invalid). */
bool kvr_plan_replan_index(const struct kvr_plan *old, uint64_t keep, uint32_t who,
                           uint32_t *index);

#endif
