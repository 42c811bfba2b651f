/* emit.c - unit, compose and manifest files for a plan (see emit.h). */
#include "cli/emit.h"

#include "core/alloc.h"
#include "ring/addr.h"
#include "ring/net.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PATH_BYTES 4096
#define HTTP_PORT 8080
#define K8S_STAGE "kvasir-stage"
#define K8S_BRIDGE "kvasir-bridge"

struct paths {
    char self[PATH_BYTES]; /* the kvasir binary */
    char plan[PATH_BYTES]; /* the plan, absolute */
    char plan_dir[PATH_BYTES];
    char model[PATH_BYTES]; /* the model file, absolute */
    char model_dir[PATH_BYTES];
    char model_base[PATH_BYTES];
    char secret[PATH_BYTES]; /* the secret file, absolute; "" if the plan holds it inline */
};

static void split(const char *path, char *dir, char *base)
{
    const char *s = strrchr(path, '/');
    snprintf(dir, PATH_BYTES, "%.*s", s && s != path ? (int)(s - path) : 1, s ? path : ".");
    snprintf(base, PATH_BYTES, "%s", s ? s + 1 : path);
}

/* dir/rel, or rel itself when it is absolute, into out (PATH_BYTES); -1 if too long. */
static int join(const char *dir, const char *rel, char *out)
{
    size_t nd = rel[0] == '/' ? 0 : strlen(dir), nr = strlen(rel);
    if (nd + 1 + nr >= PATH_BYTES)
        return -1;
    memcpy(out, dir, nd);
    if (nd)
        out[nd++] = '/';
    memcpy(out + nd, rel, nr + 1);
    return 0;
}

static int find_paths(const struct kvr_plan *plan, const char *plan_path, struct paths *p,
                      struct kvr_err *err)
{
    char tmp[PATH_BYTES], base[PATH_BYTES];
    memset(p, 0, sizeof *p);
    ssize_t n = readlink("/proc/self/exe", p->self, sizeof p->self - 1);
    if (n <= 0)
        return kvr_err_set(err, KVR_EIO, "cannot find the kvasir binary: %s", strerror(errno));
    p->self[n] = 0;
    if (!realpath(plan_path, p->plan))
        return kvr_err_set(err, KVR_EIO, "%s: %s", plan_path, strerror(errno));
    split(p->plan, p->plan_dir, base);
    /* Relative paths in the plan are relative to its folder, as for every process that
     * loads it. */
    if (join(p->plan_dir, plan->model_path, tmp))
        return kvr_err_set(err, KVR_ERANGE, "model path too long");
    if (!realpath(tmp, p->model))
        return kvr_err_set(err, KVR_EIO, "model %s: %s", tmp, strerror(errno));
    split(p->model, p->model_dir, p->model_base);
    if (plan->secret_file[0]) {
        if (join(p->plan_dir, plan->secret_file, tmp))
            return kvr_err_set(err, KVR_ERANGE, "secret_file path too long");
        if (!realpath(tmp, p->secret))
            return kvr_err_set(err, KVR_EIO, "secret_file %s: %s", tmp, strerror(errno));
    }
    return KVR_OK;
}

static FILE *create(const char *dir, const char *name, int mode, char *path, struct kvr_err *err)
{
    snprintf(path, PATH_BYTES, "%s/%s", dir, name);
    unlink(path);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        kvr_err_set(err, KVR_EIO, "%s: %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
    }
    return f;
}

static int finish(FILE *f, const char *path, struct kvr_err *err)
{
    bool bad = ferror(f) != 0;
    if (fclose(f) != 0 || bad)
        return kvr_err_set(err, KVR_EIO, "%s: write failed", path);
    fprintf(stderr, "kvasir plan: wrote %s\n", path);
    return KVR_OK;
}

/* ---- systemd ---------------------------------------------------------------------------- */

static int emit_systemd(const struct kvr_plan *plan, const struct paths *p, const char *dir,
                        struct kvr_err *err)
{
    char path[PATH_BYTES];
    static const char hardening[] = "Restart=always\n"
                                    "RestartSec=1\n"
                                    "NoNewPrivileges=yes\n"
                                    "PrivateTmp=yes\n"
                                    "ProtectSystem=strict\n"
                                    "ProtectHome=read-only\n"
                                    "ProtectKernelTunables=yes\n"
                                    "ProtectControlGroups=yes\n"
                                    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX\n";
    FILE *f = create(dir, "kvasir-stage@.service", 0644, path, err);
    if (!f)
        return KVR_EIO;
    fprintf(f,
            "# One stage of the Kvasir ring of %s (written by `kvasir plan --emit systemd`).\n"
            "# The instance is the stage index: on the machine of stage I,\n"
            "#   systemctl enable --now kvasir-stage@I\n"
            "# The kvasir binary, plan, secret file and model must be at these paths on every\n"
            "# machine. Run it as the user that owns the secret file (mode 0600): add User=\n"
            "# below if that is not root.\n"
            "[Unit]\n"
            "Description=Kvasir ring stage %%i (%u stages)\n"
            "Wants=network-online.target\n"
            "After=network-online.target\n"
            "\n"
            "[Service]\n"
            "Type=simple\n"
            "ExecStart=%s stage --plan %s --index %%i\n"
            "%s"
            "\n"
            "[Install]\n"
            "WantedBy=multi-user.target\n",
            p->plan, plan->n_stages, p->self, p->plan, hardening);
    int rc = finish(f, path, err);
    if (rc)
        return rc;
    if (!(f = create(dir, "kvasir-bridge.service", 0644, path, err)))
        return KVR_EIO;
    fprintf(f,
            "# The bridge and HTTP API of the Kvasir ring of %s (written by\n"
            "# `kvasir plan --emit systemd`), on the machine of the plan's bridge address.\n"
            "[Unit]\n"
            "Description=Kvasir bridge and OpenAI-compatible API (%u stages)\n"
            "Wants=network-online.target\n"
            "After=network-online.target\n"
            "\n"
            "[Service]\n"
            "Type=simple\n"
            "ExecStart=%s bridge --plan %s --host 0.0.0.0 --port %d\n"
            "%s"
            "\n"
            "[Install]\n"
            "WantedBy=multi-user.target\n",
            p->plan, plan->n_stages, p->self, p->plan, HTTP_PORT, hardening);
    return finish(f, path, err);
}

/* ---- compose ------------------------------------------------------------------------------ */

static int emit_compose(const struct kvr_plan *plan, const struct paths *p, const char *dir,
                        struct kvr_err *err)
{
    char path[PATH_BYTES];
    FILE *f = create(dir, "compose.yaml", 0644, path, err);
    if (!f)
        return KVR_EIO;
    fprintf(f,
            "# The Kvasir ring of %s on one Docker host (written by\n"
            "# `kvasir plan --emit compose`): one service per stage and one for the bridge, on\n"
            "# the host's network so that the plan's addresses hold as they are. The image is\n"
            "# any with the kvasir binary at /usr/local/bin/kvasir (set KVASIR_IMAGE).\n"
            "version: \"3.8\"\n"
            "x-kvasir: &kvasir\n"
            "  image: ${KVASIR_IMAGE:-kvasir:latest}\n"
            "  entrypoint: [\"/usr/local/bin/kvasir\"]\n"
            "  network_mode: host\n"
            "  restart: unless-stopped\n"
            "  volumes:\n"
            "    - \"%s:%s:ro\"\n"
            "    - \"%s:%s:ro\"\n"
            "%s"
            "services:\n",
            p->plan, p->plan_dir, p->plan_dir, p->model_dir, p->model_dir,
            p->secret[0] ? "  secrets: [cluster_key]\n" : "");
    const char *secret_arg =
        p->secret[0] ? ", \"--secret-file\", \"/run/secrets/cluster_key\"" : "";
    for (uint32_t i = 0; i < plan->n_stages; i++)
        fprintf(f,
                "  stage%u:\n"
                "    <<: *kvasir\n"
                "    command: [\"stage\", \"--plan\", \"%s\", \"--index\", \"%u\"%s]\n",
                i, p->plan, i, secret_arg);
    fprintf(f,
            "  bridge:\n"
            "    <<: *kvasir\n"
            "    command: [\"bridge\", \"--plan\", \"%s\", \"--host\", \"0.0.0.0\", \"--port\", "
            "\"%d\"%s]\n",
            p->plan, HTTP_PORT, secret_arg);
    if (p->secret[0])
        fprintf(f,
                "secrets:\n"
                "  cluster_key:\n"
                "    file: \"%s\"\n",
                p->secret);
    return finish(f, path, err);
}

/* ---- Kubernetes ----------------------------------------------------------------------- */

static void print_indented(FILE *f, const char *text, int spaces)
{
    for (const char *line = text; *line;) {
        const char *nl = strchr(line, '\n');
        size_t n = nl ? (size_t)(nl - line) : strlen(line);
        if (n)
            fprintf(f, "%*s%.*s\n", spaces, "", (int)n, line);
        else
            fputc('\n', f);
        line += n + (nl ? 1 : 0);
    }
}

/* The plan as the pods see it: each stage at its pod's stable name (the headless Service
 * resolves it to the pod's own address, which it can listen on), the model and secret where
 * the pod mounts them. *kp is the caller's to wipe and free. */
static int pod_plan(const struct kvr_plan *plan, const struct paths *p, struct kvr_plan *kp,
                    struct kvr_err *err)
{
    char host[KVR_ADDR_HOST_BYTES];
    uint16_t port;
    *kp = *plan;
    int nb = snprintf(kp->model_path, sizeof kp->model_path, "/models/%.1000s", p->model_base);
    if (nb < 0 || (size_t)nb >= sizeof kp->model_path)
        return kvr_err_set(err, KVR_ERANGE, "model file name too long: %s", p->model_base);
    snprintf(kp->secret_file, sizeof kp->secret_file, "/etc/kvasir-secret/cluster.key");
    kp->dir[0] = 0;
    for (uint32_t i = 0; i <= plan->n_stages; i++) {
        const char *addr = i < plan->n_stages ? plan->stages[i].addr : plan->bridge_addr;
        int rc = kvr_addr_parse(addr, host, sizeof host, &port, false, err);
        if (rc)
            return rc;
        if (i < plan->n_stages)
            snprintf(kp->stages[i].addr, sizeof kp->stages[i].addr, "%s-%u.%s:%u", K8S_STAGE, i,
                     K8S_STAGE, port);
        else
            snprintf(kp->bridge_addr, sizeof kp->bridge_addr, "%s-0.%s:%u", K8S_BRIDGE, K8S_BRIDGE,
                     port);
    }
    return KVR_OK;
}

/* The manifest's head: the plan as a ConfigMap and the secret (hex) as a Secret. */
static void write_plan_and_secret(FILE *f, const struct kvr_plan *plan, const struct paths *p,
                                  const char *json)
{
    char hex[2 * KVR_PLAN_SECRET_MAX_BYTES + 1];
    static const char digits[] = "0123456789abcdef";
    uint32_t n = plan->secret_bytes < KVR_PLAN_SECRET_MAX_BYTES ? plan->secret_bytes
                                                                : KVR_PLAN_SECRET_MAX_BYTES;
    for (uint32_t i = 0; i < n; i++) {
        hex[2 * i] = digits[plan->secret[i] >> 4];
        hex[2 * i + 1] = digits[plan->secret[i] & 15];
    }
    hex[2 * n] = 0;
    fprintf(f,
            "# The Kvasir ring of %s on Kubernetes (written by `kvasir plan --emit\n"
            "# kubernetes`; it holds the cluster secret: keep it private). Every pod needs the\n"
            "# model at /models/%s: here a hostPath of %s on each node; use a\n"
            "# volume of your own if the nodes keep it elsewhere. The image is any with the\n"
            "# kvasir binary at /usr/local/bin/kvasir.\n"
            "apiVersion: v1\n"
            "kind: ConfigMap\n"
            "metadata:\n"
            "  name: kvasir-plan\n"
            "data:\n"
            "  plan.json: |\n",
            p->plan, p->model_base, p->model_dir);
    print_indented(f, json, 4);
    fprintf(f,
            "---\n"
            "apiVersion: v1\n"
            "kind: Secret\n"
            "metadata:\n"
            "  name: kvasir-secret\n"
            "type: Opaque\n"
            "stringData:\n"
            "  cluster.key: \"%s\"\n",
            hex);
    memset(hex, 0, sizeof hex);
}

/* A headless Service and a StatefulSet of one role. Arguments, in order: the name twice,
 * the ports lines, the name twice, the replica count, the name twice, the container name,
 * its shell command, the model's host folder. */
static const char k8s_workload[] =
    "---\n"
    "apiVersion: v1\n"
    "kind: Service\n"
    "metadata:\n"
    "  name: %s\n"
    "spec:\n"
    "  clusterIP: None\n"
    "  publishNotReadyAddresses: true\n"
    "  selector: {app: %s}\n"
    "  ports:\n"
    "%s"
    "---\n"
    "apiVersion: apps/v1\n"
    "kind: StatefulSet\n"
    "metadata:\n"
    "  name: %s\n"
    "spec:\n"
    "  serviceName: %s\n"
    "  replicas: %u\n"
    "  podManagementPolicy: Parallel\n"
    "  selector:\n"
    "    matchLabels: {app: %s}\n"
    "  template:\n"
    "    metadata:\n"
    "      labels: {app: %s}\n"
    "    spec:\n"
    "      containers:\n"
    "        - name: %s\n"
    "          image: kvasir:latest\n"
    "          command: [\"/bin/sh\", \"-c\", \"%s\"]\n"
    "          volumeMounts:\n"
    "            - {name: plan, mountPath: /etc/kvasir, readOnly: true}\n"
    "            - {name: secret, mountPath: /etc/kvasir-secret, readOnly: true}\n"
    "            - {name: model, mountPath: /models, readOnly: true}\n"
    "      volumes:\n"
    "        - name: plan\n"
    "          configMap: {name: kvasir-plan}\n"
    "        - name: secret\n"
    "          secret: {secretName: kvasir-secret, defaultMode: 256}\n"
    "        - name: model\n"
    "          hostPath: {path: \"%s\", type: Directory}\n";

/* The stages' (bridge false) or the bridge's Service and StatefulSet. */
static int write_workload(FILE *f, const struct kvr_plan *plan, const struct paths *p, bool bridge,
                          struct kvr_err *err)
{
    char host[KVR_ADDR_HOST_BYTES], ports[256];
    uint16_t port;
    int rc;
    const char *name = bridge ? K8S_BRIDGE : K8S_STAGE;
    if (bridge) {
        if ((rc = kvr_addr_parse(plan->bridge_addr, host, sizeof host, &port, false, err)))
            return rc;
        snprintf(ports, sizeof ports,
                 "    - {name: ring, port: %u}\n"
                 "    - {name: http, port: %d}\n",
                 port, HTTP_PORT);
    } else {
        int n = 0;
        ports[0] = 0;
        for (uint32_t i = 0; i < plan->n_stages && n < (int)sizeof ports - 64; i++) {
            if ((rc = kvr_addr_parse(plan->stages[i].addr, host, sizeof host, &port, false, err)))
                return rc;
            n += snprintf(ports + n, sizeof ports - (size_t)n, "    - {name: ring-%u, port: %u}\n",
                          i, port);
        }
    }
    fprintf(f, k8s_workload, name, name, ports, name, name, bridge ? 1 : plan->n_stages, name, name,
            bridge ? "bridge" : "stage",
            bridge ? "exec /usr/local/bin/kvasir bridge --plan /etc/kvasir/plan.json --host "
                     "0.0.0.0 --port 8080"
                   : "exec /usr/local/bin/kvasir stage --plan /etc/kvasir/plan.json --index "
                     "${HOSTNAME##*-}",
            p->model_dir);
    return KVR_OK;
}

static int emit_kubernetes(const struct kvr_plan *plan, const struct paths *p, const char *dir,
                           struct kvr_err *err)
{
    struct kvr_plan *kp = kvr_malloc(sizeof *kp);
    char *json = NULL, path[PATH_BYTES];
    if (!kp)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    int rc = pod_plan(plan, p, kp, err);
    if (rc == KVR_OK)
        rc = kvr_plan_to_json(kp, &json, err);
    FILE *f = rc == KVR_OK ? create(dir, "kvasir.yaml", 0600, path, err) : NULL;
    if (rc == KVR_OK && !f)
        rc = KVR_EIO;
    if (rc == KVR_OK) {
        write_plan_and_secret(f, plan, p, json);
        rc = write_workload(f, plan, p, false, err);
    }
    if (rc == KVR_OK)
        rc = write_workload(f, plan, p, true, err);
    if (rc == KVR_OK) {
        fprintf(f,
                "---\n"
                "apiVersion: v1\n"
                "kind: Service\n"
                "metadata:\n"
                "  name: kvasir-api\n"
                "spec:\n"
                "  selector: {app: %s}\n"
                "  ports:\n"
                "    - {name: http, port: %d, targetPort: %d}\n",
                K8S_BRIDGE, HTTP_PORT, HTTP_PORT);
        rc = finish(f, path, err);
    } else if (f) {
        fclose(f);
    }
    if (json) {
        memset(json, 0, strlen(json));
        kvr_free(json);
    }
    kvr_plan_wipe(kp);
    kvr_free(kp);
    return rc;
}

int kvr_cli_emit(const struct kvr_plan *plan, const char *plan_path, const char *kind,
                 const char *dir, struct kvr_err *err)
{
    struct paths *p = kvr_malloc(sizeof *p);
    if (!p)
        return kvr_err_set(err, KVR_ENOMEM, "out of memory");
    int rc = find_paths(plan, plan_path, p, err);
    if (rc == KVR_OK && mkdir(dir, 0755) != 0 && errno != EEXIST)
        rc = kvr_err_set(err, KVR_EIO, "%s: %s", dir, strerror(errno));
    if (rc == KVR_OK) {
        if (!strcmp(kind, "systemd"))
            rc = emit_systemd(plan, p, dir, err);
        else if (!strcmp(kind, "compose"))
            rc = emit_compose(plan, p, dir, err);
        else if (!strcmp(kind, "kubernetes"))
            rc = emit_kubernetes(plan, p, dir, err);
        else
            rc = kvr_err_set(err, KVR_EINVAL, "unknown kind '%s'", kind);
    }
    kvr_free(p);
    return rc;
}
