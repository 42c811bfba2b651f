/* emit.h - `kvasir plan --emit KIND DIR`: the files an orchestrator needs to run the ring of a
 * plan (DESIGN.md 10: launched by an existing orchestrator, never a home-made one).
 *
 *   systemd     kvasir-stage@.service (instance %i = stage index) and kvasir-bridge.service,
 *               for the plan where it was written (copy plan, secret and model to every
 *               machine at the same paths, then `systemctl enable --now kvasir-stage@I`)
 *   compose     compose.yaml: one service per stage and one for the bridge, host network,
 *               the plan's folder and the model's mounted read-only, the secret as a
 *               compose secret
 *   kubernetes  kvasir.yaml: a ConfigMap with the plan (its addresses rewritten to the pods'
 *               stable names), a Secret with the cluster secret, a headless Service and a
 *               StatefulSet with one pod per stage, a StatefulSet of one bridge with its
 *               own headless Service, and a Service for the bridge's HTTP API
 *
 * Files are written with mode 0644, except the Kubernetes manifest, which holds the secret
 * (0600). Paths in them are absolute (the kvasir binary running, the plan, the model). */
#ifndef KVR_CLI_EMIT_H
#define KVR_CLI_EMIT_H

#include "core/err.h"
#include "ring/plan.h"

/* kind: "systemd", "compose" or "kubernetes"; plan_path: where `plan` was just written;
 * dir: created if missing. */
int kvr_cli_emit(const struct kvr_plan *plan, const char *plan_path, const char *kind,
                 const char *dir, struct kvr_err *err);

#endif
