/* serve_env.h - what `kvasir serve` decides from the machine before it writes its plan:
 * the context a sequence gets (the model's trained length, the KV memory this machine can
 * give, --ctx; `kvasir plan` checks its --ctx the same way) and the per-user runtime
 * directory that holds the plan and its key. Main thread only; messages go to the log
 * (core/log.h). */
#ifndef KVR_CLI_SERVE_ENV_H
#define KVR_CLI_SERVE_ENV_H

#include "model/arch.h"
#include "ring/propose.h"

#include <stddef.h>
#include <stdint.h>

/* Set spec->n_ctx (and spec->kv_blocks when the machine cannot hold a full context for
 * every sequence: they then share what it holds). spec->n_ctx given (--ctx): kept, with a
 * warning beyond the trained length, refused beyond what the model's RoPE scaling
 * stretches it to. Not given: the trained length, capped by the tokens the KV memory
 * holds (--kv-blocks, --kv-mem, or else half of MemAvailable after the weights'
 * weight_bytes, over the spec's stages). `why` gets the limit that applied, e.g.
 * "trained length" or "KV memory; trained 131072". 0, or -1 after logging why. */
int kvr_cli_context(struct kvr_plan_spec *spec, const struct kvr_hparams *hp, uint64_t weight_bytes,
                    char *why, size_t why_cap);

/* A --ctx of n_ctx positions: 0 within the trained length; 0 after a warning beyond it
 * when the model's linear RoPE scaling stretches it that far, or when the environment says
 * KVASIR_ALLOW_LONG_CONTEXT=1; else -1 after logging why. */
int kvr_cli_ctx_check(uint32_t n_ctx, const struct kvr_hparams *hp);

/* The per-user runtime directory: $XDG_RUNTIME_DIR/kvasir, else /tmp/kvasir-UID, created
 * with mode 0700 and refused if another user owns it or others may enter it. Before
 * returning, it removes the serve-PID directories in it whose PID no longer runs this
 * program (a server killed with SIGKILL leaves its plan key behind). 0, or -1 after logging
 * why. */
int kvr_cli_runtime_dir(char *out, size_t cap);

#endif
