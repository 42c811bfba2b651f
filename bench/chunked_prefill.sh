#!/usr/bin/env bash
# bench/chunked_prefill.sh - a long prompt must not stall the streams that are decoding.
#
#   bench/chunked_prefill.sh [-m MODEL] [--stages 2] [--prompt 1500] [--streams 8] [--reps 3]
#
# Eight streams decode (closed loop, short prompts, long answers). Run A: nothing else.
# Run B: the same, and every few seconds a request with a PROMPT-token prompt arrives. The
# inter-token latencies of the eight streams are compared: in B only the gaps that fall
# while a long prompt is being prefilled (from its arrival to its first token) count, so
# the spike is not diluted. Reported: p99 ITL of A, p99 ITL of B's windows, the ratio.
# Needs python3 (to read the JSON of kvasir bench).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
KVASIR=${KVASIR:-$here/../build/kvasir}
model="" stages=2 long=1500 streams=8 reps=3
while [ $# -gt 0 ]; do
    case $1 in
    -m) model=$2; shift ;;
    --stages) stages=$2; shift ;;
    --prompt) long=$2; shift ;;
    --streams) streams=$2; shift ;;
    --reps) reps=$2; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "chunked_prefill.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
TMP=$(mktemp -d /tmp/kvr-chunk.XXXXXX)
SERVER=""
cleanup() {
    [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null
    rm -rf "$TMP"
}
trap cleanup EXIT
if [ -z "$model" ]; then
    model=$TMP/ring45.gguf
    "$KVASIR" synth --shape ring-45 --type q8_0 -o "$model" >/dev/null 2>&1
fi
"$KVASIR" serve -m "$model" --stages "$stages" --port 0 --max-seqs 16 --ctx 2048 \
    --no-admission >"$TMP/serve.log" 2>&1 &
SERVER=$!
URL=""
for _ in $(seq 150); do
    URL=$(sed -n 's/^kvasir: ready on \(http:[^ ]*\)$/\1/p' "$TMP/serve.log")
    [ -n "$URL" ] && break
    sleep 0.2
done
[ -n "$URL" ] || { cat "$TMP/serve.log"; echo "chunked_prefill.sh: server did not start" >&2; exit 1; }
dur=12
decode=(--url "$URL" -m "$model" --concurrency "$streams" --duration "$dur" --prompt-len 16
    --output-len 400 --quiet)

for r in $(seq "$reps"); do
    "$KVASIR" bench "${decode[@]}" --json "$TMP/a$r.json" >/dev/null
    "$KVASIR" bench "${decode[@]}" --json "$TMP/b$r.json" >/dev/null &
    bg=$!
    sleep 2
    # Three long prompts, 3 s apart, while the streams decode; new ones each run (a seed of
    # its own): the same prompts again would come from the prefix cache in a few batches.
    "$KVASIR" bench --url "$URL" -m "$model" --rate 0.33 --num-requests 3 --prompt-len "$long" \
        --output-len 1 --seed "$((100 + r))" --quiet --json "$TMP/long$r.json" >/dev/null
    wait $bg
done

python3 - "$TMP" "$reps" <<'EOF'
import json, sys
tmp, reps = sys.argv[1], int(sys.argv[2])

def token_times(req, t0):
    # absolute times (s) of a request's tokens: start + ttft, then the gaps
    if req.get("ttft_ms") is None:
        return []
    t = t0 + req["start_s"] + req["ttft_ms"] / 1e3
    out = [t]
    for g in req.get("itl_ms") or []:
        t += g / 1e3
        out.append(t)
    return out

def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")

ratios = []
for r in range(1, reps + 1):
    a = json.load(open(f"{tmp}/a{r}.json"))["runs"][0]["requests"]
    base = [g for q in a for g in (q.get("itl_ms") or [])]
    b_doc = json.load(open(f"{tmp}/b{r}.json"))
    l_doc = json.load(open(f"{tmp}/long{r}.json"))
    b0 = b_doc["runs"][0]["t0_unix_s"]
    l0 = l_doc["runs"][0]["t0_unix_s"]
    windows = []
    for q in l_doc["runs"][0]["requests"]:
        if q.get("ttft_ms") is not None:
            s = l0 + q["start_s"]
            windows.append((s, s + q["ttft_ms"] / 1e3))
    during = []
    for q in b_doc["runs"][0]["requests"]:
        ts = token_times(q, b0)
        for i in range(1, len(ts)):
            if any(s <= ts[i] <= e for s, e in windows):
                during.append((ts[i] - ts[i - 1]) * 1e3)
    pa, pb = p99(base), p99(during)
    ratios.append(pb / pa)
    print(f"run {r}: ITL p99 without the long prompt {pa:.1f} ms ({len(base)} gaps); "
          f"while {len(windows)} prompts of its length prefill {pb:.1f} ms ({len(during)} gaps); "
          f"ratio {pb / pa:.2f}; long prompt TTFT "
          + ", ".join(f"{(e - s) * 1e3:.0f} ms" for s, e in windows))
ratios.sort()
print(f"median ratio over {reps} runs: {ratios[len(ratios) // 2]:.2f} (must be <= 2)")
EOF
