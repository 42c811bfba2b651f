#!/usr/bin/env bash
# HTTPS for the API (issue 13): `kvasir serve --tls-cert --tls-key` with a self-signed
# certificate made here by openssl. curl trusting that certificate gets /health and a
# completion; curl trusting nothing refuses the server; plain HTTP to the port gets no
# answer; one of the two options alone is refused.
set -euo pipefail
source "$(dirname "$0")/lib.bash"
source "$(dirname "$0")/serve_lib.bash"

for t in openssl curl; do
    command -v $t >/dev/null && continue
    [ "${CI:-}" = true ] && fail "$t is missing (required under CI: .ci/run installs it)"
    echo "SKIP: $t is not installed"; exit 77
done
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 \
    -keyout "$TMP/key.pem" -out "$TMP/cert.pem" >/dev/null 2>&1 || fail "openssl req"

"$KVASIR" synth --shape tiny --type q8_0 --seed 31 -o "$TMP/tiny.gguf" >/dev/null 2>&1 || fail synth
set +e; "$KVASIR" serve -m "$TMP/tiny.gguf" --tls-cert "$TMP/cert.pem" >"$TMP/half.out" 2>&1; rc=$?; set -e
[ $rc = 2 ] && grep -q "go together" "$TMP/half.out" || { cat "$TMP/half.out"; fail "--tls-cert alone"; }

start_serve tls "$TMP/tiny.gguf" --stages 2 --tls-cert "$TMP/cert.pem" --tls-key "$TMP/key.pem"
case "$SERVE_URL" in https://*) ;; *) fail "serve did not announce https: $SERVE_URL" ;; esac
code=$(curl -s -o "$TMP/health" -w '%{http_code}' --cacert "$TMP/cert.pem" "$SERVE_URL/health")
[ "$code" = 200 ] || { cat "$TMP/health"; fail "/health over HTTPS: $code"; }
curl -sf --cacert "$TMP/cert.pem" "$SERVE_URL/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "Once", "max_tokens": 4, "temperature": 0}' >"$TMP/completion" ||
    fail "completion over HTTPS"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["usage"]["completion_tokens"] == 4, d' \
    "$TMP/completion" || fail "completion body"
echo "ok: /health and a completion over HTTPS with the self-signed certificate"
set +e; curl -s -o /dev/null --max-time 10 "$SERVE_URL/health"; rc=$?; set -e
[ $rc = 60 ] || fail "curl without the certificate: exit $rc, expected 60 (not verified)"
plain=${SERVE_URL/https:/http:}
set +e; code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$plain/health"); set -e
[ "$code" != 200 ] || fail "plain HTTP got an answer on the HTTPS port"
echo "ok: an unverified certificate is refused by curl; plain HTTP gets no answer"
echo PASS
