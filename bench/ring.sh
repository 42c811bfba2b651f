#!/usr/bin/env bash
# bench/ring.sh - push K concurrent sequences through a ring and report aggregate tokens/s
# and per-stage held/starved/blocked fractions and CPU use; compare in flight with drained.
#
#   bench/ring.sh -m MODEL [-s STAGES] [-k SEQS] [-n TOKENS] [-r REPEATS] [-t THREADS]
#                 [--quota FRACTION] [--netns] [--pin] [--baseline] [--layers "0-10,11-44"]
#
#   --quota F    run each stage in its own cgroup (v1 cpu controller) limited to F of one
#                core (cpu.cfs_quota_us = F x cpu.cfs_period_us, period 2 ms, or longer
#                when F x 2 ms is under the kernel's 1 ms minimum); needs root
#   --netns      run each stage in its own network namespace, joined to this one by a veth
#                pair on a Linux bridge (10.78.0.0/24); needs root and iproute2
#   --pin        put stage i on CPU (i mod nproc) with taskset (with -t T: T CPUs from
#                i x T on): a stage's threads share its CPU, as on a machine of its own
#   --baseline   also run the single-process engine (--batched, 2 threads) on the same
#                sequences, the "no ring tax" comparison
#   --mb "1 4"   micro-batch settings to compare (default: "1 STAGES": drained, in flight);
#                a setting "N-plain" is N micro-batches with plain links ("encrypt": false)
#   --crypto     compare sealed links with plain ones, in flight: the settings are
#                "STAGES-plain STAGES" and the ratio is sealed / plain
#   --peer       also run llama.cpp's RPC backend on the same emulated machines (issue 14):
#                one ggml-rpc-server per stage (same cgroup, namespace and CPUs as that
#                stage), a llama-server in this namespace with every layer on the RPC
#                devices, split by layers, SEQS slots, the same prompts sent at once; then
#                one sequence alone on each side for the per-token latency. The kit is
#                KVR_PEER (default ../shared/peers/llama.cpp beside the source tree)
#
# Each setting runs REPEATS times (default 3); the median is reported, with every run's
# number, because this machine is shared and noisy. Everything runs on 127.0.0.1 (or in
# namespaces this script makes and removes) and stops by itself.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
KVASIR=${KVASIR:-$here/../build/kvasir}
model="" stages=2 seqs=32 tokens=64 repeats=3 threads=1 quota="" netns=0 baseline=0 pin=0
mbs="" layers="" crypto=0 peer=0
while [ $# -gt 0 ]; do
    case $1 in
    -m) model=$2; shift ;;
    -s) stages=$2; shift ;;
    -k) seqs=$2; shift ;;
    -n) tokens=$2; shift ;;
    -r) repeats=$2; shift ;;
    -t) threads=$2; shift ;;
    --quota) quota=$2; shift ;;
    --netns) netns=1 ;;
    --pin) pin=1 ;;
    --baseline) baseline=1 ;;
    --mb) mbs=$2; shift ;;
    --crypto) crypto=1 ;;
    --peer) peer=1 ;;
    --layers) layers=$2; shift ;;
    -h|--help) sed -n '2,${/^#/!q;p}' "$0"; exit 0 ;;
    *) echo "ring.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$model" ] || { echo "ring.sh: -m MODEL is required" >&2; exit 2; }
[ $crypto = 0 ] || mbs="$stages-plain $stages"
[ -n "$mbs" ] || mbs="1 $stages"
TMP=$(mktemp -d /tmp/kvr-bench.XXXXXX)
PIDS=()
NETNS_MADE=0

cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    if [ -n "$quota" ]; then
        for ((i = 0; i < stages; i++)); do rmdir "/sys/fs/cgroup/cpu/kvr-bench-$i" 2>/dev/null || true; done
    fi
    if [ $NETNS_MADE = 1 ]; then
        for ((i = 0; i < stages; i++)); do
            ip netns del "kvr-b$i" 2>/dev/null || true
            ip link del "kvr-h$i" 2>/dev/null || true
        done
        ip link del kvr-br 2>/dev/null || true
    fi
    rm -rf "$TMP"
}
trap cleanup EXIT

# ---- machines: cgroups and namespaces -------------------------------------------------------
if [ -n "$quota" ]; then
    for ((i = 0; i < stages; i++)); do
        cg=/sys/fs/cgroup/cpu/kvr-bench-$i
        mkdir -p "$cg"
        # A short period (2 ms) makes the quota a steady half core: with the default 100 ms a
        # stage that is idle most of the time (a drained ring) would burst at full speed.
        # The kernel's smallest quota is 1 ms, so fractions under a half stretch the period.
        period=$(awk -v q="$quota" 'BEGIN { p = 2000; if (q * p < 1000) p = int(1000 / q + 0.5); print p }')
        echo "$period" >"$cg/cpu.cfs_period_us"
        awk -v q="$quota" -v p="$period" 'BEGIN { printf "%d\n", q * p }' >"$cg/cpu.cfs_quota_us"
    done
fi
hosts="127.0.0.1" bridge_addr=""
# Below the ephemeral range (32768-60999), where another connection's source port could
# take a listener's port.
base=$((10000 + RANDOM % 22000))
if [ $netns = 1 ]; then
    NETNS_MADE=1
    ip link add kvr-br type bridge
    ip addr add 10.78.0.254/24 dev kvr-br
    ip link set kvr-br up
    hosts=""
    for ((i = 0; i < stages; i++)); do
        ip netns add "kvr-b$i"
        ip link add "kvr-h$i" type veth peer name "kvr-n$i"
        ip link set "kvr-n$i" netns "kvr-b$i"
        ip link set "kvr-h$i" master kvr-br
        ip link set "kvr-h$i" up
        ip -n "kvr-b$i" addr add "10.78.0.$((i + 1))/24" dev "kvr-n$i"
        ip -n "kvr-b$i" link set "kvr-n$i" up
        ip -n "kvr-b$i" link set lo up
        hosts="$hosts${hosts:+,}10.78.0.$((i + 1))"
    done
    bridge_addr="10.78.0.254:$((base - 1))"
fi

# ---- workload ---------------------------------------------------------------------------------
for i in $(seq 0 $((seqs - 1))); do
    echo "{\"prompt\": \"Once upon a time there was a little robot number $i who\", \"max_tokens\": $tokens, \"temperature\": 0}"
done >"$TMP/prompts.jsonl"
head -1 "$TMP/prompts.jsonl" >"$TMP/prompt1.jsonl"

start_stages() { # PLAN
    RING=()
    for ((i = 0; i < stages; i++)); do
        local cmd=("$KVASIR" stage --plan "$1" --index "$i" --threads "$threads")
        if [ $pin = 1 ]; then # stage i's THREADS CPUs, from CPU i x THREADS on, wrapping
            local cpus="" k
            for ((k = 0; k < threads; k++)); do cpus="$cpus${cpus:+,}$(((i * threads + k) % $(nproc)))"; done
            cmd=(taskset -c "$cpus" "${cmd[@]}")
        fi
        if [ $netns = 1 ]; then cmd=(ip netns exec "kvr-b$i" "${cmd[@]}"); fi
        "${cmd[@]}" >"$TMP/stage$i.log" 2>&1 &
        local pid=$!
        PIDS+=("$pid")
        RING+=("$pid")
        if [ -n "$quota" ]; then echo "$pid" >"/sys/fs/cgroup/cpu/kvr-bench-$i/cgroup.procs"; fi
    done
}

stop_stages() {
    for p in "${RING[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${RING[@]}"; do wait "$p" 2>/dev/null || true; done
}

# ---- the peer: llama.cpp's RPC backend on the same machines (--peer) -----------------------
PEER=${KVR_PEER:-$here/../../shared/peers/llama.cpp}
if [ $peer = 1 ]; then
    [ -x "$PEER/bin/ggml-rpc-server" ] && [ -x "$PEER/bin/llama-server" ] ||
        { echo "ring.sh: no llama.cpp kit with ggml-rpc-server at $PEER (set KVR_PEER)" >&2; exit 2; }
    # A kit copied without symlinks holds lib/libX.so.0 as a small text file naming the
    # target: a private dir of real links goes first on the search path.
    mkdir -p "$TMP/peerlib"
    for f in "$PEER"/lib/*.so*; do
        if [ "$(stat -c %s "$f")" -lt 256 ] && head -c 4 "$f" | grep -q '^lib'; then
            ln -sf "$PEER/lib/$(cat "$f")" "$TMP/peerlib/$(basename "$f")"
        fi
    done
    PEER_LD="$TMP/peerlib:$PEER/lib"
fi

# start_peer: one ggml-rpc-server per stage on that stage's machine, then llama-server here
# with every layer on those devices, split by layers in order (as the ring's stages).
start_peer() {
    RING=()
    local devs="" rpcs="" i h
    for ((i = 0; i < stages; i++)); do
        h=$(echo "$hosts" | cut -d, -f$((i + 1)))
        [ -n "$h" ] || h=127.0.0.1
        local cmd=(env LD_LIBRARY_PATH="$PEER_LD" "$PEER/bin/ggml-rpc-server" -H "$h"
            -p "$((base + 100 + i))" -t "$threads")
        if [ $pin = 1 ]; then
            local cpus="" k
            for ((k = 0; k < threads; k++)); do cpus="$cpus${cpus:+,}$(((i * threads + k) % $(nproc)))"; done
            cmd=(taskset -c "$cpus" "${cmd[@]}")
        fi
        if [ $netns = 1 ]; then cmd=(ip netns exec "kvr-b$i" "${cmd[@]}"); fi
        "${cmd[@]}" >"$TMP/rpc$i.log" 2>&1 &
        local pid=$!
        PIDS+=("$pid")
        RING+=("$pid")
        if [ -n "$quota" ]; then echo "$pid" >"/sys/fs/cgroup/cpu/kvr-bench-$i/cgroup.procs"; fi
        rpcs="$rpcs${rpcs:+,}$h:$((base + 100 + i))"
        devs="$devs${devs:+,}RPC$i"
    done
    sleep 1
    env LD_LIBRARY_PATH="$PEER_LD" "$PEER/bin/llama-server" -m "$model" --rpc "$rpcs" \
        --device "$devs" -ngl 999 -sm layer -np "$seqs" -c "$((seqs * 256))" -t 2 \
        --host 127.0.0.1 --port "$((base + 200))" >"$TMP/peer-server.log" 2>&1 &
    PEER_SERVER=$!
    PIDS+=("$PEER_SERVER")
    local w
    for ((w = 0; w < 1200; w++)); do
        curl -sf "http://127.0.0.1:$((base + 200))/health" >/dev/null 2>&1 && return 0
        kill -0 "$PEER_SERVER" 2>/dev/null || break
        sleep 0.1
    done
    tail -5 "$TMP/peer-server.log" >&2
    echo "ring.sh: llama-server did not come up" >&2
    exit 1
}

stop_peer() {
    kill "$PEER_SERVER" 2>/dev/null || true
    wait "$PEER_SERVER" 2>/dev/null || true
    stop_stages
}

# peer_run PROMPTS: send every prompt of the file at once (no prompt cache); prints the
# aggregate "tokens/s seconds".
peer_run() {
    python3 - "$1" "http://127.0.0.1:$((base + 200))/completion" <<'PY'
import json, sys, threading, time, urllib.request
prompts = [json.loads(l) for l in open(sys.argv[1])]
done = []
def one(p):
    body = json.dumps({"prompt": p["prompt"], "n_predict": p["max_tokens"], "temperature": 0,
                       "ignore_eos": True, "cache_prompt": False}).encode()
    req = urllib.request.Request(sys.argv[2], body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        done.append(json.load(r)["tokens_predicted"])
t0 = time.monotonic()
th = [threading.Thread(target=one, args=(p,)) for p in prompts]
for t in th:
    t.start()
for t in th:
    t.join()
secs = time.monotonic() - t0
if len(done) != len(prompts):
    sys.exit(f"peer: {len(prompts) - len(done)} requests failed")
print(f"{sum(done) / secs:.1f} {secs:.2f}")
PY
}

# CPU time (ns) every thread of process $1 has run: what the stage spent of its quota.
cpu_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ t += $1 } END { printf "%.0f\n", t }'; }

median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

echo "model $(basename "$model"), $stages stages x $threads thread(s), $seqs sequences x $tokens tokens," \
    "quota ${quota:-none}, netns $([ $netns = 1 ] && echo yes || echo no), $repeats runs each"
declare -A result runs_of
# Settings take turns within each repeat (drained, in flight, drained, ...), so a slow spell
# on this shared machine hits every setting alike instead of one setting's whole series.
for mb in $mbs; do
    plan_args=(--stages "$stages" --microbatches "${mb%-plain}" --base-port "$base"
        --hosts "$hosts" --max-seqs "$seqs" --ctx 256 --row-width 64)
    [ "$mb" = "${mb%-plain}" ] || plan_args+=(--no-encrypt)
    [ -n "$bridge_addr" ] && plan_args+=(--bridge "$bridge_addr")
    [ -n "$layers" ] && plan_args+=(--layers "$layers")
    "$KVASIR" plan -m "$model" "${plan_args[@]}" -o "$TMP/plan.$mb.json" 2>/dev/null
    runs_of[$mb]=""
done
for ((r = 0; r < repeats; r++)); do
    for mb in $mbs; do
        start_stages "$TMP/plan.$mb.json"
        # The stages load their slices first; that CPU time is not the run's.
        for ((i = 0, w = 0; i < stages && w < 600; w++)); do
            if grep -q "listening on" "$TMP/stage$i.log"; then i=$((i + 1)); else sleep 0.1; fi
        done
        cpu0=()
        for p in "${RING[@]}"; do cpu0+=("$(cpu_ns "$p")"); done
        timeout 600 "$KVASIR" run --plan "$TMP/plan.$mb.json" --prompts "$TMP/prompts.jsonl" \
            --ignore-eos -q --json >/dev/null 2>"$TMP/run.log" || { cat "$TMP/run.log"; exit 1; }
        cpu1=()
        for p in "${RING[@]}"; do cpu1+=("$(cpu_ns "$p")"); done
        stop_stages
        tps=$(sed -n 's/^ring: .* \([0-9.]*\) tokens\/s.*/\1/p' "$TMP/run.log")
        runs_of[$mb]="${runs_of[$mb]} $tps"
        # Each stage's CPU time over the run, against the run's wall time (x quota, if set):
        # a stage that held batches but used little CPU was throttled or preempted.
        secs=$(sed -n 's/^ring: .* in \([0-9.]*\) s,.*/\1/p' "$TMP/run.log")
        for ((i = 0; i < stages; i++)); do
            awk -v a="${cpu0[$i]}" -v b="${cpu1[$i]}" -v s="$secs" -v q="${quota:-$threads}" \
                'BEGIN { printf "cpu %5.1f%% of %s core(s)\n", 100 * (b - a) / 1e9 / s / q, q }'
        done >"$TMP/cpu"
        grep -E "^  stage" "$TMP/run.log" | paste -d' ' - "$TMP/cpu" >"$TMP/stages.$mb"
    done
    if [ $peer = 1 ]; then
        # Kvasir with one sequence on the last setting's ring, then the peer both ways.
        last_mb=${mbs##* }
        start_stages "$TMP/plan.$last_mb.json"
        for ((i = 0, w = 0; i < stages && w < 600; w++)); do
            if grep -q "listening on" "$TMP/stage$i.log"; then i=$((i + 1)); else sleep 0.1; fi
        done
        timeout 600 "$KVASIR" run --plan "$TMP/plan.$last_mb.json" --prompts "$TMP/prompt1.jsonl" \
            --ignore-eos -q --json >/dev/null 2>"$TMP/run.log" || { cat "$TMP/run.log"; exit 1; }
        stop_stages
        runs_of[ring1]="${runs_of[ring1]:-} $(sed -n 's/^ring: .* \([0-9.]*\) tokens\/s.*/\1/p' "$TMP/run.log")"
        start_peer
        read -r tps _ < <(peer_run "$TMP/prompts.jsonl") || exit 1
        runs_of[peer]="${runs_of[peer]:-} $tps"
        read -r tps _ < <(peer_run "$TMP/prompt1.jsonl") || exit 1
        runs_of[peer1]="${runs_of[peer1]:-} $tps"
        stop_peer
    fi
done
for mb in $mbs; do
    med=$(printf '%s\n' ${runs_of[$mb]} | median)
    result[$mb]=$med
    printf '  micro-batches %-3s tokens/s median %8.1f   runs:%s\n' "$mb" "$med" "${runs_of[$mb]}"
    sed 's/^/    /' "$TMP/stages.$mb"
done
set -- $mbs
if [ $# -ge 2 ]; then
    label="in flight ($2) / drained ($1)"
    [ $crypto = 0 ] || label="sealed ($2) / plain ($1)"
    awk -v a="${result[$2]}" -v b="${result[$1]}" -v l="$label" \
        'BEGIN { printf "  %s: %.3fx (ratio of medians)\n", l, a / b }'
    # The same ratio within each repeat (the runs were back to back), and its median.
    paste <(printf '%s\n' ${runs_of[$2]}) <(printf '%s\n' ${runs_of[$1]}) |
        awk '{ printf "%.3f\n", $1 / $2 }' >"$TMP/ratios"
    printf '  per repeat: %s -> median %.3fx\n' "$(tr '\n' ' ' <"$TMP/ratios")" "$(median <"$TMP/ratios")"
fi
if [ $peer = 1 ]; then
    last_mb=${mbs##* }
    for k in peer ring1 peer1; do result[$k]=$(printf '%s\n' ${runs_of[$k]} | median); done
    printf '  llama.cpp RPC, %s slots: tokens/s median %8.1f   runs:%s\n' "$seqs" "${result[peer]}" "${runs_of[peer]}"
    awk -v a="${result[$last_mb]}" -v b="${result[peer]}" -v k="$seqs" -v m="$last_mb" \
        'BEGIN { printf "  aggregate at %d sequences, ring (%s micro-batches) / llama.cpp RPC: %.2fx\n", k, m, a / b }'
    printf '  one sequence: ring tokens/s median %.1f (runs:%s), llama.cpp RPC %.1f (runs:%s)\n' \
        "${result[ring1]}" "${runs_of[ring1]}" "${result[peer1]}" "${runs_of[peer1]}"
    awk -v a="${result[ring1]}" -v b="${result[peer1]}" \
        'BEGIN { printf "  latency per token, ring / llama.cpp RPC: %.2fx (%.1f ms vs %.1f ms)\n", b / a, 1000 / a, 1000 / b }'
fi
if [ $baseline = 1 ]; then
    runs=()
    for ((r = 0; r < repeats; r++)); do
        "$KVASIR" run -m "$model" --prompts "$TMP/prompts.jsonl" --batched -t 2 --ignore-eos \
            -q --json >/dev/null 2>"$TMP/base.log"
        runs+=("$(sed -n 's/^batched: .* \([0-9.]*\) tokens\/s.*/\1/p' "$TMP/base.log")")
    done
    med=$(printf '%s\n' "${runs[@]}" | median)
    printf '  single process, 2 threads, batched: tokens/s median %8.1f   runs: %s\n' "$med" "${runs[*]}"
    last=${!#}
    awk -v a="${result[$last]}" -v b="$med" \
        'BEGIN { printf "  ring (in flight) / single process: %.0f%%\n", 100 * a / b }'
fi
