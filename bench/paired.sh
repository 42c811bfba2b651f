#!/usr/bin/env bash
# bench/paired.sh - two builds of kvasir measured in turns on one machine: a regression check
# by ratio (the machine is shared and noisy, so only numbers taken side by side compare).
#
#   bench/paired.sh -a KVASIR_A -b KVASIR_B -m MODEL [-r PAIRS] [--plain-b] ring2|ring4|spike ...
#
#   --plain-b  B runs with plain links (plan and serve --no-encrypt), for an A that predates
#              sealed links
#
#   ring2   bench/ring.sh -s 2 -k 32 -n 64 --mb 2 -r 1: 2 stages x 1 thread on 127.0.0.1,
#           in flight (2 micro-batches); tokens/s
#   ring4   bench/ring.sh -s 4 -k 32 -n 48 --mb 4 -r 1 --quota 0.5 --netns --pin: 4 stages,
#           each half a core, its own network namespace and CPU (needs root); tokens/s
#   single  the single-process engine on ring2's sequences (`kvasir run --batched -t 2`):
#           tells the engine's share of a difference from the ring's
#   spike   bench/spike.sh's first two steps, shorter: `kvasir serve --stages 2` (admission
#           on), capacity = completed req/s of a 15 s closed loop with 32 clients, then 3x
#           that rate (Poisson) for 30 s with budgets of 2 s (first token) / 5 s (total);
#           64-token prompts, 32 output tokens
#
# Each pair runs A then B, the next pair B then A, so a slow spell hits both alike. Prints
# every run, the median of each build and the median of the per-pair ratios B / A.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
A="" B="" model="" pairs=3 plain_b=0
while [ $# -gt 0 ]; do
    case $1 in
    -a) A=$2; shift ;;
    -b) B=$2; shift ;;
    -m) model=$2; shift ;;
    -r) pairs=$2; shift ;;
    --plain-b) plain_b=1 ;;
    -h|--help) sed -n '2,${/^#/!q;p}' "$0"; exit 0 ;;
    ring2|ring4|single|spike) break ;;
    *) echo "paired.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$A" ] && [ -n "$B" ] && [ -n "$model" ] && [ $# -gt 0 ] ||
    { echo "paired.sh: -a, -b, -m and a test are required" >&2; exit 2; }
A=$(realpath "$A") B=$(realpath "$B") model=$(realpath "$model") # plans name the model
TMP=$(mktemp -d /tmp/kvr-paired.XXXXXX)
SERVER=""
cleanup() {
    if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
    rm -rf "$TMP"
}
trap cleanup EXIT

median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

ring() { # KVASIR STAGES PLAIN: prints the in-flight tokens/s of one run
    local args=(-m "$model" -k 32 -r 1) mb=$2
    [ "$3" = 0 ] || mb=$2-plain
    if [ "$2" = 2 ]; then args+=(-s 2 -n 64 --mb "$mb"); else args+=(-s 4 -n 48 --mb "$mb" --quota 0.5 --netns --pin); fi
    KVASIR=$1 "$here/ring.sh" "${args[@]}" >"$TMP/ring.out" 2>&1 || { cat "$TMP/ring.out" >&2; return 1; }
    grep -E "^ *stage [0-9]" "$TMP/ring.out" >&2 # held/starved/blocked, CPU
    sed -n 's/^  micro-batches [0-9a-z-]* *tokens\/s median *\([0-9.]*\).*/\1/p' "$TMP/ring.out"
}

single() { # KVASIR: tokens/s of the single-process engine, batched, 2 threads
    for i in $(seq 0 31); do
        echo "{\"prompt\": \"Once upon a time there was a little robot number $i who\", \"max_tokens\": 64, \"temperature\": 0}"
    done >"$TMP/prompts.jsonl"
    "$1" run -m "$model" --prompts "$TMP/prompts.jsonl" --batched -t 2 --ignore-eos -q --json \
        >/dev/null 2>"$TMP/single.log" || { cat "$TMP/single.log" >&2; return 1; }
    sed -n 's/^batched: .* \([0-9.]*\) tokens\/s.*/\1/p' "$TMP/single.log"
}

start_server() { # KVASIR PLAIN
    rm -f "$TMP/serve.log"
    local extra=()
    [ "$2" = 0 ] || extra=(--no-encrypt)
    "$1" serve -m "$model" --stages 2 --port 0 --max-seqs 32 --ctx 512 "${extra[@]}" >"$TMP/serve.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 150); do
        URL=$(sed -n 's/^kvasir: ready on \(http:[^ ]*\)$/\1/p' "$TMP/serve.log" 2>/dev/null)
        [ -n "$URL" ] && return 0
        kill -0 "$SERVER" 2>/dev/null || break
        sleep 0.2
    done
    cat "$TMP/serve.log" >&2
    echo "paired.sh: server did not start" >&2
    exit 1
}

spike() { # KVASIR PLAIN: prints "capacity on_time% admitted refused refusal_p99_ms ttft_p99_ms goodput"
    local load=(-m "$model" --prompt-len 64 --output-len 32 --quiet)
    start_server "$1" "$2"
    "$1" bench --url "$URL" "${load[@]}" --concurrency 32 --duration 15 --json "$TMP/cap.json" >/dev/null
    local cap rate
    cap=$(python3 -c "import json;print(json.load(open('$TMP/cap.json'))['runs'][0]['summary']['throughput']['requests_per_s'])")
    rate=$(awk -v c="$cap" 'BEGIN { printf "%.2f", 3 * c }')
    "$1" bench --url "$URL" "${load[@]}" --ttft-budget-ms 2000 --total-budget-ms 5000 --rate "$rate" \
        --duration 30 --json "$TMP/spike.json" >/dev/null
    kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=""
    python3 - "$TMP/spike.json" "$cap" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))['runs'][0]['summary']
r = s['requests']
print('%.2f %.1f %d %d %.1f %.0f %.2f' % (float(sys.argv[2]), 100.0 * r['met_budget'] / max(r['ok'], 1),
      r['ok'], r['refused'], s['refusal_ms']['p99'] or 0, s['ttft_ms']['p99'] or 0,
      s['throughput']['goodput_requests_per_s']))
EOF
}

for test in "$@"; do
    echo "== $test: A=$A B=$B, $pairs pairs, load $(cut -d' ' -f1-3 /proc/loadavg)"
    ra=() rb=() ratios=()
    for ((p = 0; p < pairs; p++)); do
        order="A B"
        [ $((p % 2)) = 0 ] || order="B A"
        for w in $order; do
            bin=$A plain=0
            [ $w = B ] && bin=$B plain=$plain_b
            case $test in
            ring2) v=$(ring "$bin" 2 $plain) || exit 1 ;;
            ring4) v=$(ring "$bin" 4 $plain) || exit 1 ;;
            spike) v=$(spike "$bin" $plain) || exit 1 ;;
            single) v=$(single "$bin") || exit 1 ;;
            *) echo "paired.sh: unknown test $test" >&2; exit 2 ;;
            esac
            [ -n "$v" ] || { echo "paired.sh: no number from $test with $bin" >&2; exit 1; }
            echo "  pair $p $w: $v"
            if [ $w = A ]; then a=$v; else b=$v; fi
        done
        ra+=("${a%% *}") rb+=("${b%% *}")
        ratios+=("$(awk -v a="${a%% *}" -v b="${b%% *}" 'BEGIN { printf "%.3f", b / a }')")
    done
    [ $test = spike ] && echo "  (columns: capacity req/s, % of admitted on time, admitted, refused," \
        "refusal p99 ms, TTFT p99 ms, goodput req/s; the ratio is of capacity)"
    printf '  A median %s, B median %s; per-pair B/A: %s -> median %.3f; load %s\n' \
        "$(printf '%s\n' "${ra[@]}" | median)" "$(printf '%s\n' "${rb[@]}" | median)" "${ratios[*]}" \
        "$(printf '%s\n' "${ratios[@]}" | median)" "$(cut -d' ' -f1-3 /proc/loadavg)"
done
