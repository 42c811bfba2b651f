/* plan.h - the deployment plan: one JSON file every process of a ring loads and validates
 * identically (DESIGN.md 2; the format, with an example, is in docs/PLAN.md).
 *
 * A plan fixes the ring's shape (stages in order, each an address and an inclusive layer
 * range; the bridge's address) and its widths (rows per micro-batch, micro-batches in
 * flight, live sequences, context, KV blocks, wire dtype). Those widths size every buffer at
 * start-up and bound every frame, so a plan is validated once, before anything is
 * allocated, and never changes while the process runs.
 *
 * Life of a plan:
 *   kvr_plan_load(&plan, path, err)          read + parse + read the secret file
 *   kvr_plan_validate(&plan, n_layer, err)   every rule of docs/PLAN.md; n_layer once known
 *   kvr_plan_hash(&plan, hash)               exchanged at every handshake (auth.h)
 * kvr_plan_parse is the pure part of kvr_plan_load (no file is opened), for tests and fuzzing.
 *
 * Ownership: struct kvr_plan is a plain value with fixed-capacity arrays and no pointers;
 * it can be copied with `=` and needs no cleanup. It is about 40 KiB: keep it in static or
 * heap storage rather than on a small thread stack. It holds the cluster secret: callers
 * should call kvr_plan_wipe before freeing memory that held one.
 *
 * Threads: every function is reentrant; a loaded plan is read-only and may be shared. */
#ifndef KVR_RING_PLAN_H
#define KVR_RING_PLAN_H

#include "core/err.h"
#include "model/dtype.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVR_PLAN_MAX_STAGES 64
#define KVR_PLAN_ADDR_BYTES 264 /* "host:port" + NUL; DNS names are <= 253 bytes */
#define KVR_PLAN_PATH_BYTES 1024
#define KVR_PLAN_SECRET_MIN_BYTES 16 /* a shorter secret is guessable */
#define KVR_PLAN_SECRET_MAX_BYTES 64
#define KVR_PLAN_HASH_BYTES 32

/* Sanity bounds on the widths. They are far beyond any deployment this code targets and
 * exist so that a typo ("row_width": 1000000) fails at validation, not at allocation, and
 * so that every product below fits the wire format's 16-bit counts and 32-bit lengths. */
#define KVR_PLAN_MAX_ROW_WIDTH 16384
#define KVR_PLAN_MAX_MICROBATCHES 256
#define KVR_PLAN_MAX_SEQS 16384
#define KVR_PLAN_MAX_CTX (1u << 20)
#define KVR_PLAN_MAX_KV_BLOCK_TOKENS 65536
#define KVR_PLAN_MAX_KV_TOKENS (1ull << 32) /* kv_blocks * kv_block_tokens, per stage */
#define KVR_PLAN_MAX_THREADS 1024
#define KVR_PLAN_MAX_LAYERS 4096

#define KVR_PLAN_DEFAULT_KV_BLOCK_TOKENS 16
#define KVR_PLAN_DEFAULT_KV_TYPE KVR_DTYPE_F16 /* a plan without "kv_type" (docs/PLAN.md) */

struct kvr_plan_stage {
    char addr[KVR_PLAN_ADDR_BYTES]; /* "host:port" the stage listens on (for its upstream) */
    uint32_t first_layer;           /* inclusive range [first_layer, last_layer] */
    uint32_t last_layer;
    uint32_t n_threads; /* compute threads; 0 = the plan's n_threads */
};

/* Expert placement (docs/EXPERTS.md, docs/PLAN.md "experts"): agent j holds experts
 * [first_expert, last_expert] of layers [first_layer, last_layer] for every hold. A
 * (layer, expert) no agent holds is computed by the stage that owns the layer. */
#define KVR_PLAN_MAX_AGENTS 64
#define KVR_PLAN_MAX_HOLDS 8
#define KVR_PLAN_MAX_EXPERTS 1024 /* model/moe.h KVR_MOE_MAX_EXPERTS */

struct kvr_plan_hold {
    uint32_t first_layer, last_layer;   /* inclusive */
    uint32_t first_expert, last_expert; /* inclusive */
};

struct kvr_plan_agent {
    char addr[KVR_PLAN_ADDR_BYTES]; /* "host:port" the agent listens on for stages */
    uint32_t n_threads;             /* compute threads; 0 = the plan's n_threads */
    uint32_t n_holds;               /* 1 .. KVR_PLAN_MAX_HOLDS */
    struct kvr_plan_hold holds[KVR_PLAN_MAX_HOLDS];
};

/* Spare stages ("spares", optional; docs/PLAN.md "Spare stages"): processes that hold no
 * layers, wait on their address, and take the slice of a stage lost for good when the
 * bridge re-plans (propose.h kvr_plan_replan). */
#define KVR_PLAN_MAX_SPARES 8

struct kvr_plan_spare {
    char addr[KVR_PLAN_ADDR_BYTES]; /* "host:port" the spare listens on */
    uint32_t n_threads;             /* compute threads once it is a stage; 0 = the plan's */
};

struct kvr_plan {
    /* Model. model_path is as written in the file; kvr_plan_path resolves it. */
    char model_path[KVR_PLAN_PATH_BYTES];
    uint64_t model_fingerprint; /* kvr_gguf_fingerprint of the file; 0 = do not check */

    /* Shape: stage 0 is the head, stage n_stages-1 the tail. The bridge listens on
     * bridge_addr for the tail's results and connects to stage 0. */
    uint32_t n_stages;
    struct kvr_plan_stage stages[KVR_PLAN_MAX_STAGES];
    char bridge_addr[KVR_PLAN_ADDR_BYTES];

    /* Widths. */
    uint32_t row_width;        /* most token rows in one micro-batch */
    uint32_t microbatches;     /* micro-batches in flight in the ring */
    uint32_t max_seqs;         /* live sequence slots; seq ids are < max_seqs */
    uint32_t n_ctx;            /* most positions per sequence */
    uint32_t kv_block_tokens;  /* KV block size, tokens */
    uint32_t kv_blocks;        /* KV blocks per layer, on every stage */
    enum kvr_dtype wire_dtype; /* boundary rows on the wire: F32, F16 or BF16 */
    enum kvr_dtype kv_type;    /* KV cache values on every stage: F32, F16 or Q8_0 (kv.h) */
    uint32_t n_threads;        /* default compute threads per stage; 0 = the stage decides */
    bool encrypt;              /* seal every frame (seal.h); "encrypt", default true */
    uint32_t epoch;            /* 0 as loaded; +1 at each re-plan (propose.h kvr_plan_replan).
                                  Not in the JSON; in the hash when not 0 */

    /* Expert agents ("experts", optional; 0 = every stage computes its own experts). */
    uint32_t n_agents;
    struct kvr_plan_agent agents[KVR_PLAN_MAX_AGENTS];

    /* Spare stages, in the order they are taken (n_stages + n_spares <= 64). */
    uint32_t n_spares;
    struct kvr_plan_spare spares[KVR_PLAN_MAX_SPARES];

    /* Cluster secret: exactly one of "secret" (hex) and "secret_file" appears in the JSON.
     * secret_file is kept as written; kvr_plan_load (or kvr_plan_read_secret) fills
     * secret/secret_bytes from it. */
    char secret_file[KVR_PLAN_PATH_BYTES];
    uint8_t secret[KVR_PLAN_SECRET_MAX_BYTES];
    uint32_t secret_bytes;
    bool secret_inline; /* the JSON held "secret" itself (kvr_plan_load warns) */

    /* Folder the plan was loaded from ("" = the working directory): relative paths in the
     * plan (model, secret_file) are relative to it. Not part of the hash. */
    char dir[KVR_PLAN_PATH_BYTES];
};

/* KV cache types by name ("f32", "f16", "q8_0"): parse (KVR_EINVAL for another name) and
 * name (NULL for a type that is not one). */
int kvr_plan_kv_type_parse(const char *s, enum kvr_dtype *out);
const char *kvr_plan_kv_type_name(enum kvr_dtype t);

/* Parse a plan from JSON text (`len` bytes, need not be NUL-terminated). Pure: no file is
 * read, so "secret_file" is recorded but not read (see kvr_plan_read_secret). `dir` (may
 * be NULL) is the folder relative paths are resolved against. Fills defaults for optional
 * keys. Rejects malformed JSON, unknown or duplicate keys, wrong types, negative or
 * oversized integers, more than KVR_PLAN_MAX_STAGES stages, over-long strings and bad hex.
 * It does NOT apply the cross-field rules: call kvr_plan_validate. On failure *plan is
 * zeroed. */
int kvr_plan_parse(struct kvr_plan *plan, const char *json, size_t len, const char *dir,
                   struct kvr_err *err);

/* Read `path`, parse it (relative paths resolve against path's folder) and read the secret
 * file if the plan names one. Does not validate. */
int kvr_plan_load(struct kvr_plan *plan, const char *path, struct kvr_err *err);
/* The same, with the secret from `secret_file` (a command line's --secret-file, relative to
 * the working directory) instead of the plan's own: the plan's secret_file is not read. */
int kvr_plan_load_with_secret(struct kvr_plan *plan, const char *path, const char *secret_file,
                              struct kvr_err *err);

/* Read plan->secret_file (hex digits; surrounding whitespace ignored) into plan->secret.
 * No-op when the plan has no secret_file. The file must be a regular file that neither its
 * group nor others may read or write (mode 0600 or 0400): KVR_EINVAL otherwise, naming
 * the mode and the chmod that fixes it. */
int kvr_plan_read_secret(struct kvr_plan *plan, struct kvr_err *err);

/* Use the secret in `path` (a command line's --secret-file: relative to the working
 * directory, not the plan's folder) instead of the plan's own; same checks as above. */
int kvr_plan_use_secret_file(struct kvr_plan *plan, const char *path, struct kvr_err *err);

/* Write plan->secret as hex to a new file `path` (mode 0600; KVR_EIO if it exists or
 * cannot be made) and record `ref` (the name the plan will use for it, e.g. relative to
 * the plan's folder) as plan->secret_file, so kvr_plan_write names the file instead of
 * writing the secret. */
int kvr_plan_write_secret_file(struct kvr_plan *plan, const char *path, const char *ref,
                               struct kvr_err *err);

/* Check every rule of docs/PLAN.md, reporting the first broken one in `err` with a message
 * naming the stage, the field and the fix. n_layer is the model's layer count when known
 * (then the stages must cover exactly layers 0..n_layer-1), or 0 (ranges are only checked
 * to be contiguous from layer 0). Returns KVR_OK, KVR_EINVAL or KVR_ERANGE. */
int kvr_plan_validate(const struct kvr_plan *plan, uint32_t n_layer, struct kvr_err *err);

/* KVR_EINVAL with a message if the plan names a fingerprint and `fingerprint` (of the
 * model file actually opened, kvr_gguf_fingerprint) differs. */
int kvr_plan_check_fingerprint(const struct kvr_plan *plan, uint64_t fingerprint,
                               struct kvr_err *err);

/* The plan's identity: BLAKE2b-256 (crypto_generichash) of a canonical binary
 * serialization of every field that the processes of one ring must agree on (see
 * docs/PLAN.md "Plan hash"). Independent of JSON key order, whitespace and defaults written
 * out or left implicit. Excludes the secret (the handshake proves it separately), the
 * model path, the thread counts and the folder, which may differ between machines. */
void kvr_plan_hash(const struct kvr_plan *plan, uint8_t hash[KVR_PLAN_HASH_BYTES]);

/* The identity an expert link (stage <-> agent) is bound to instead (docs/PLAN.md "Plan
 * hash"): the model fingerprint, row_width, encrypt and the whole expert placement, not the
 * stages, spares, epoch or bridge. A re-plan (kvr_plan_replan) keeps the placement, so the
 * stages of the new epoch link the agents started with the old plan; a placement that
 * differs is still refused at the handshake. */
void kvr_plan_experts_link_hash(const struct kvr_plan *plan, uint8_t hash[KVR_PLAN_HASH_BYTES]);

/* The first `n_bytes` (1..32) of a hash as lowercase hex, for log and error messages. */
void kvr_plan_hash_hex(const uint8_t hash[KVR_PLAN_HASH_BYTES], size_t n_bytes, char *out,
                       size_t out_cap);

/* Serialize a plan as JSON (keys in a fixed order, 2-space indent, every optional field
 * written out). The secret is written the way it was given: as "secret_file" if the plan
 * has one, else as "secret" hex. kvr_plan_to_json returns a NUL-terminated heap string the
 * caller frees with kvr_free; kvr_plan_write writes it to `path` (mode 0600, since it may
 * hold the secret; replaced atomically via a temporary file in the same folder). Parsing
 * the output gives back an equal plan. */
int kvr_plan_to_json(const struct kvr_plan *plan, char **out, struct kvr_err *err);
int kvr_plan_write(const struct kvr_plan *plan, const char *path, struct kvr_err *err);

/* Resolve a path from the plan (model_path or secret_file) against plan->dir into out.
 * Absolute paths are copied. KVR_ERANGE if it does not fit. */
int kvr_plan_path(const struct kvr_plan *plan, const char *rel, char *out, size_t out_cap,
                  struct kvr_err *err);

/* Whether agent `a` holds expert e of layer il. */
bool kvr_plan_agent_holds(const struct kvr_plan_agent *a, uint32_t il, uint32_t e);
/* Whether agent `a` holds any expert of layer il. */
bool kvr_plan_agent_holds_layer(const struct kvr_plan_agent *a, uint32_t il);

/* Place the experts of every layer (0..n_layer-1, n_expert each) on n_agents agents in
 * contiguous, equal blocks (agent j: experts [j*E/K, (j+1)*E/K)), agent j listening on
 * host:port0+j; so every agent serves every stage. KVR_EINVAL unless 1 <= n_agents <=
 * min(n_expert, KVR_PLAN_MAX_AGENTS). */
int kvr_plan_place_experts(struct kvr_plan *plan, uint32_t n_agents, uint32_t n_layer,
                           uint32_t n_expert, const char *host, uint32_t port0,
                           struct kvr_err *err);

/* The same with a share kept by each stage (docs/PLAN.md "Expert placement"): for the
 * layers of stage s (plan->stages must be set), the last keep[s] experts are computed by
 * the stage itself and experts [0, n_expert - keep[s]) go to the agents in contiguous
 * blocks sized by agent_speed (NULL: equal), each agent at least one. Runs of stages that
 * keep the same count share one hold. KVR_EINVAL if a stage keeps more than n_expert -
 * n_agents or a speed is not positive, KVR_ERANGE if an agent would need more than
 * KVR_PLAN_MAX_HOLDS holds. */
int kvr_plan_place_experts_kept(struct kvr_plan *plan, uint32_t n_agents, uint32_t n_expert,
                                const uint32_t *keep, const double *agent_speed, const char *host,
                                uint32_t port0, struct kvr_err *err);

/* One line for logs: what each stage computes of its layers' experts (n_expert of them)
 * and each agent's holds. Truncated to cap. */
void kvr_plan_experts_describe(const struct kvr_plan *plan, uint32_t n_expert, char *out,
                               size_t cap);

/* Overwrite the secret in memory. */
void kvr_plan_wipe(struct kvr_plan *plan);

/* ---- Planner ---------------------------------------------------------------------------
 *
 * Split n_layer layers into n_stages contiguous, non-empty ranges so that the slowest stage
 * is as fast as possible. A stage's time is (sum of its layers' costs + head_cost if it is
 * stage 0 + tail_cost if it is the last stage) / its speed. Costs are in any one unit; for
 * decode, which is bound by memory bandwidth, use the bytes of weights each part reads per
 * step: head_cost ~ one embedding row (tiny), tail_cost ~ n_vocab * n_embd weights of the
 * output head, which is why the tail usually gets fewer layers.
 *
 * Optionally each stage has a memory budget: a stage's memory is the sum of its layers'
 * bytes (+ head_bytes on stage 0, + tail_bytes on the last), and must not exceed it.
 *
 * Among the splits that reach the smallest maximum time, the planner returns the one with
 * the smallest sum of squared stage times (so stages that are not the bottleneck are
 * balanced too), and among those the one that gives earlier stages more layers; the result
 * is therefore deterministic. Exact dynamic programming, O(n_stages * n_layer^2). */
struct kvr_balance_input {
    uint32_t n_layer;
    uint32_t n_stages;         /* 2 .. min(n_layer, KVR_PLAN_MAX_STAGES) */
    const double *layer_cost;  /* n_layer costs >= 0, or NULL: every layer costs 1 */
    double head_cost;          /* extra cost of stage 0, >= 0 */
    double tail_cost;          /* extra cost of the last stage, >= 0 */
    const double *stage_speed; /* n_stages speeds > 0, or NULL: all 1 */
    const double *layer_bytes; /* n_layer sizes, or NULL: no memory limit */
    double head_bytes;
    double tail_bytes;
    const double *stage_mem; /* n_stages budgets (same unit), or NULL: no limit */
};

struct kvr_balance_result {
    uint32_t first_layer[KVR_PLAN_MAX_STAGES]; /* inclusive ranges, stage by stage */
    uint32_t last_layer[KVR_PLAN_MAX_STAGES];
    double stage_time[KVR_PLAN_MAX_STAGES]; /* cost / speed of each stage */
    double max_time;                        /* the bottleneck */
};

/* KVR_EINVAL for bad inputs (fewer layers than stages, negative or non-finite costs,
 * non-positive speeds), KVR_ERANGE when no split fits the memory budgets, KVR_ENOMEM. */
int kvr_plan_balance(const struct kvr_balance_input *in, struct kvr_balance_result *out,
                     struct kvr_err *err);

#endif
