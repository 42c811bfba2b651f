#!/usr/bin/env bash
# `kvasir plan --emit systemd|compose|kubernetes DIR` (issue 13, acceptance 3): the files
# pass the linters Debian has. systemd-analyze verify must accept both units (a stage
# instance too) without a word; docker-compose config must accept the compose file; the
# Kubernetes manifest must parse as YAML and every document match a JSON schema (written
# here, for the fields we emit), the plan in its ConfigMap naming the pods' stable names and
# the Secret holding the plan's secret.
set -euo pipefail
source "$(dirname "$0")/lib.bash"

need_tool() {
    command -v "$1" >/dev/null && return 0
    [ "${CI:-}" = true ] && fail "$1 is missing (required under CI: .ci/run installs $2)"
    echo "SKIP: $1 is not installed (Debian package $2)"
    exit 77
}
need_tool systemd-analyze systemd
need_tool docker-compose docker-compose
python3 -c 'import yaml, jsonschema' 2>/dev/null || need_tool no-python3-yaml-jsonschema \
    "python3-yaml python3-jsonschema"

"$KVASIR" synth --shape tiny --type q8_0 --seed 3 -o "$TMP/tiny.gguf" >/dev/null 2>&1 || fail synth
mkdir -p "$TMP/p"
for kind in systemd compose kubernetes; do
    "$KVASIR" plan -m "$TMP/tiny.gguf" --stages 3 -o "$TMP/p/plan.json" \
        --emit "$kind" "$TMP/$kind" 2>"$TMP/$kind.log" || { cat "$TMP/$kind.log"; fail "emit $kind"; }
done

# systemd: the template, one instance of it, and the bridge unit.
cd "$TMP/systemd"
[ -f kvasir-stage@.service ] && [ -f kvasir-bridge.service ] || fail "systemd files missing"
cp kvasir-stage@.service kvasir-stage@2.service
out=$(systemd-analyze verify ./kvasir-stage@.service ./kvasir-stage@2.service \
    ./kvasir-bridge.service 2>&1) || { echo "$out"; fail "systemd-analyze verify refused the units"; }
[ -z "$out" ] || { echo "$out"; fail "systemd-analyze verify complained"; }
grep -q -- "--index %i" kvasir-stage@.service || fail "the template does not pass its instance"
echo "ok: systemd-analyze verify accepts kvasir-stage@.service and kvasir-bridge.service"

# compose: one service per stage and the bridge.
cd "$TMP/compose"
docker-compose -f compose.yaml config -q || fail "docker-compose config refused compose.yaml"
services=$(docker-compose -f compose.yaml config --services | sort | tr '\n' ' ')
[ "$services" = "bridge stage0 stage1 stage2 " ] || fail "compose services: $services"
echo "ok: docker-compose config accepts compose.yaml ($services)"

# Kubernetes.
cd "$TMP"
[ "$(stat -c %a kubernetes/kvasir.yaml)" = 600 ] || fail "the manifest holds the secret: want mode 600"
python3 - "$TMP/kubernetes/kvasir.yaml" "$TMP/p/plan.key" <<'PY'
import json, sys, yaml, jsonschema
docs = list(yaml.safe_load_all(open(sys.argv[1])))
name = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
meta = {"type": "object", "required": ["name"], "properties": {"name": name}}
port = {"type": "object", "required": ["port"], "additionalProperties": False,
        "properties": {"name": name, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                       "targetPort": {"type": "integer"}}}
mount = {"type": "object", "required": ["name", "mountPath"], "additionalProperties": False,
         "properties": {"name": name, "mountPath": {"type": "string", "pattern": "^/"},
                        "readOnly": {"type": "boolean"}}}
container = {"type": "object", "required": ["name", "image", "command"],
             "additionalProperties": False,
             "properties": {"name": name, "image": {"type": "string"},
                            "command": {"type": "array", "items": {"type": "string"}},
                            "volumeMounts": {"type": "array", "items": mount}}}
volume = {"type": "object", "required": ["name"], "maxProperties": 2,
          "properties": {"name": name,
                         "configMap": {"type": "object", "required": ["name"]},
                         "secret": {"type": "object", "required": ["secretName"],
                                    "properties": {"defaultMode": {"type": "integer"}}},
                         "hostPath": {"type": "object", "required": ["path"]}}}
labels = {"type": "object", "additionalProperties": {"type": "string"}}
schemas = {
    "ConfigMap": {"required": ["data"], "properties": {"data": {
        "type": "object", "additionalProperties": {"type": "string"}}}},
    "Secret": {"required": ["stringData"], "properties": {"type": {"const": "Opaque"},
        "stringData": {"type": "object", "additionalProperties": {"type": "string"}}}},
    "Service": {"required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["selector", "ports"], "additionalProperties": False,
        "properties": {"clusterIP": {"const": "None"},
                       "publishNotReadyAddresses": {"type": "boolean"},
                       "selector": labels, "ports": {"type": "array", "items": port,
                                                     "minItems": 1}}}}},
    "StatefulSet": {"required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["serviceName", "replicas", "selector", "template"],
        "additionalProperties": False,
        "properties": {"serviceName": name, "replicas": {"type": "integer", "minimum": 1},
                       "podManagementPolicy": {"enum": ["Parallel", "OrderedReady"]},
                       "selector": {"type": "object", "required": ["matchLabels"],
                                    "properties": {"matchLabels": labels}},
                       "template": {"type": "object", "required": ["metadata", "spec"],
                                    "properties": {
                                        "metadata": {"type": "object", "required": ["labels"],
                                                     "properties": {"labels": labels}},
                                        "spec": {"type": "object",
                                                 "required": ["containers"],
                                                 "additionalProperties": False,
                                                 "properties": {
                                                     "containers": {"type": "array",
                                                                    "items": container,
                                                                    "minItems": 1},
                                                     "volumes": {"type": "array",
                                                                 "items": volume}}}}}}}}},
}
api = {"ConfigMap": "v1", "Secret": "v1", "Service": "v1", "StatefulSet": "apps/v1"}
for d in docs:
    kind = d.get("kind")
    if kind not in schemas:
        sys.exit(f"unexpected kind {kind!r}")
    schema = dict(schemas[kind], type="object",
                  required=["apiVersion", "kind", "metadata"] + schemas[kind]["required"])
    schema["properties"] = dict(schemas[kind]["properties"], apiVersion={"const": api[kind]},
                                kind={"const": kind}, metadata=meta)
    schema["additionalProperties"] = False
    jsonschema.validate(d, schema)
kinds = sorted(d["kind"] for d in docs)
assert kinds == ["ConfigMap", "Secret", "Service", "Service", "Service", "StatefulSet",
                 "StatefulSet"], kinds
by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
stages = by[("StatefulSet", "kvasir-stage")]["spec"]
assert stages["replicas"] == 3 and stages["serviceName"] == "kvasir-stage", stages
assert by[("StatefulSet", "kvasir-bridge")]["spec"]["replicas"] == 1
for (k, n), d in by.items():  # every selector finds pods
    if k == "Service":
        app = d["spec"]["selector"]["app"]
        assert ("StatefulSet", app) in by, (n, app)
plan = json.loads(by[("ConfigMap", "kvasir-plan")]["data"]["plan.json"])
assert [s["addr"].split(":")[0] for s in plan["stages"]] == \
    [f"kvasir-stage-{i}.kvasir-stage" for i in range(3)], plan["stages"]
assert plan["secret_file"] == "/etc/kvasir-secret/cluster.key" and "secret" not in plan
secret = by[("Secret", "kvasir-secret")]["stringData"]["cluster.key"]
assert secret == open(sys.argv[2]).read().strip(), "the Secret is not the plan's secret"
print("ok: kvasir.yaml:", ", ".join(f"{k} {n}" for k, n in by))
PY
echo PASS
