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
#                one sequence alone on each side for the per-token latency. The peer starts
#                once and serves every repeat. The kit is KVR_PEER (default
#                ../shared/peers/llama.cpp beside the source tree)
#
# The machines are bench/emu.bash's. Each setting runs REPEATS times (default 3); the median
# is reported, with every run's number, because this machine is shared and noisy. Everything
# runs on 127.0.0.1 (or in namespaces this script makes and removes) and stops by itself.
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
# shellcheck source=bench/emu.bash
. "$here/emu.bash"
# KVR_BENCH_KEEP=DIR keeps every process's log there.
trap 'emu_cleanup; [ -z "${KVR_BENCH_KEEP:-}" ] || cp -r "$TMP/." "$KVR_BENCH_KEEP/"; rm -rf "$TMP"' EXIT

# ---- machines: cgroups and namespaces (bench/emu.bash) --------------------------------------
emu_setup "$stages" "$quota" "$netns" "$pin" "$threads"
hosts=$EMU_HOSTS bridge_addr=""
# Below the ephemeral range (32768-60999), where another connection's source port could
# take a listener's port.
base=$((10000 + RANDOM % 22000))
[ $netns = 0 ] || bridge_addr="$EMU_BRIDGE_HOST:$((base - 1))"

# ---- workload ---------------------------------------------------------------------------------
for i in $(seq 0 $((seqs - 1))); do
    echo "{\"prompt\": \"Once upon a time there was a little robot number $i who\", \"max_tokens\": $tokens, \"temperature\": 0}"
done >"$TMP/prompts.jsonl"
head -1 "$TMP/prompts.jsonl" >"$TMP/prompt1.jsonl"

start_stages() { # PLAN
    RING=()
    for ((i = 0; i < stages; i++)); do
        emu_spawn "$i" "$TMP/stage$i.log" "$KVASIR" stage --plan "$1" --index "$i" --threads "$threads"
        RING+=("$EMU_PID")
    done
    # The stages load their slices first; that CPU time is not the run's.
    for ((i = 0; i < stages; i++)); do emu_wait_log "listening on" "$TMP/stage$i.log" || exit 1; done
}

stop_stages() { emu_stop "${RING[@]}"; }

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
# with every layer on those devices, split by layers in order (as the ring's stages). It
# stays up over all repeats (an idle rpc-server waits in a socket read and uses no CPU), so
# the weights cross the emulated network once.
start_peer() {
    PEER_RPC=()
    local devs="" rpcs="" i h
    for ((i = 0; i < stages; i++)); do
        h=$(emu_host "$i")
        emu_spawn "$i" "$TMP/rpc$i.log" env LD_LIBRARY_PATH="$PEER_LD" "$PEER/bin/ggml-rpc-server" \
            -H "$h" -p "$((base + 100 + i))" -t "$threads"
        PEER_RPC+=("$EMU_PID")
        rpcs="$rpcs${rpcs:+,}$h:$((base + 100 + i))"
        devs="$devs${devs:+,}RPC$i"
    done
    for ((i = 0; i < stages; i++)); do emu_wait_port "$i" "$((base + 100 + i))" || exit 1; done
    env LD_LIBRARY_PATH="$PEER_LD" "$PEER/bin/llama-server" -m "$model" --rpc "$rpcs" \
        --device "$devs" -ngl 999 -sm layer -np "$seqs" -c "$((seqs * 256))" -t 2 \
        --host 127.0.0.1 --port "$((base + 200))" >"$TMP/peer-server.log" 2>&1 &
    PEER_SERVER=$!
    PIDS+=("$PEER_SERVER")
    local w
    for ((w = 0; w < 3000; w++)); do
        curl -sf "http://127.0.0.1:$((base + 200))/health" >/dev/null 2>&1 && return 0
        kill -0 "$PEER_SERVER" 2>/dev/null || break
        sleep 0.1
    done
    tail -5 "$TMP/peer-server.log" >&2
    echo "ring.sh: llama-server did not come up" >&2
    exit 1
}

stop_peer() { emu_stop "$PEER_SERVER" "${PEER_RPC[@]}"; }

# peer_run PROMPTS: send every prompt of the file at once (no prompt cache); prints the
# aggregate "tokens/s seconds ms_per_token", the last the median of llama-server's own
# predicted_per_token_ms (decode only) over the requests.
peer_run() {
    python3 - "$1" "http://127.0.0.1:$((base + 200))/completion" <<'PY'
import json, statistics, sys, threading, time, urllib.error, urllib.request
prompts = [json.loads(l) for l in open(sys.argv[1])]
done, per_tok = [], []
def one(p):
    # The byte pieces <0x00>..<0xFF> (ids 3-258 in SentencePiece vocabularies, the project's
    # synthesized one too) are banned: a random model emits stray bytes that are not UTF-8,
    # and llama-server then fails the request. Every token costs the same work.
    body = json.dumps({"prompt": p["prompt"], "n_predict": p["max_tokens"], "temperature": 0,
                       "ignore_eos": True, "cache_prompt": False,
                       "logit_bias": [[t, False] for t in range(3, 259)]}).encode()
    req = urllib.request.Request(sys.argv[2], body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            a = json.load(r)
            done.append(a["tokens_predicted"])
            per_tok.append(a.get("timings", {}).get("predicted_per_token_ms", 0.0))
    except urllib.error.HTTPError as e:
        print(f"peer: HTTP {e.code}: {e.read()[:300]!r}", file=sys.stderr)
t0 = time.monotonic()
th = [threading.Thread(target=one, args=(p,)) for p in prompts]
for t in th:
    t.start()
for t in th:
    t.join()
secs = time.monotonic() - t0
if len(done) != len(prompts):
    sys.exit(f"peer: {len(prompts) - len(done)} requests failed")
print(f"{sum(done) / secs:.2f} {secs:.2f} {statistics.median(per_tok):.2f}")
PY
}

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
# run_ring PLAN PROMPTS: one run on a fresh ring; sets tps, and the per-stage lines (timing
# records and CPU use) in $TMP/stages.
run_ring() {
    start_stages "$1"
    local cpu0=() cpu1=() p i secs
    for p in "${RING[@]}"; do cpu0+=("$(cpu_ns "$p")"); done
    timeout 600 "$KVASIR" run --plan "$1" --prompts "$2" \
        --ignore-eos -q --json >/dev/null 2>"$TMP/run.log" || { cat "$TMP/run.log"; exit 1; }
    for p in "${RING[@]}"; do cpu1+=("$(cpu_ns "$p")"); done
    stop_stages
    tps=$(sed -n 's/^ring: .* \([0-9.]*\) tokens\/s.*/\1/p' "$TMP/run.log")
    # Each stage's CPU time over the run, against the run's wall time (x quota, if set):
    # a stage that held batches but used little CPU was throttled or preempted.
    secs=$(sed -n 's/^ring: .* in \([0-9.]*\) s,.*/\1/p' "$TMP/run.log")
    for ((i = 0; i < stages; i++)); do
        awk -v a="${cpu0[$i]}" -v b="${cpu1[$i]}" -v s="$secs" -v q="${quota:-$threads}" \
            'BEGIN { printf "cpu %5.1f%% of %s core(s)\n", 100 * (b - a) / 1e9 / s / q, q }'
    done >"$TMP/cpu"
    grep -E "^  stage" "$TMP/run.log" | paste -d' ' - "$TMP/cpu" >"$TMP/stages"
}

[ $peer = 0 ] || start_peer
loads=""
for ((r = 0; r < repeats; r++)); do
    loads="$loads $(cut -d' ' -f1 /proc/loadavg)"
    for mb in $mbs; do
        run_ring "$TMP/plan.$mb.json" "$TMP/prompts.jsonl"
        runs_of[$mb]="${runs_of[$mb]} $tps"
        cat "$TMP/stages" >>"$TMP/stages.$mb"
        echo >>"$TMP/stages.$mb"
    done
    if [ $peer = 1 ]; then
        # The peer at SEQS sequences, Kvasir with one sequence on the last setting's ring,
        # then the peer with one.
        read -r tps _ _ < <(peer_run "$TMP/prompts.jsonl") || { tail -20 "$TMP/peer-server.log"; exit 1; }
        runs_of[peer]="${runs_of[peer]:-} $tps"
        last_mb=${mbs##* }
        run_ring "$TMP/plan.$last_mb.json" "$TMP/prompt1.jsonl"
        runs_of[ring1]="${runs_of[ring1]:-} $tps"
        read -r tps _ ms < <(peer_run "$TMP/prompt1.jsonl") || exit 1
        runs_of[peer1]="${runs_of[peer1]:-} $tps"
        runs_of[peer1ms]="${runs_of[peer1ms]:-} $ms"
    fi
done
[ $peer = 0 ] || stop_peer
echo "  load average (1 min) at the start of each repeat:$loads"
for mb in $mbs; do
    med=$(printf '%s\n' ${runs_of[$mb]} | median)
    result[$mb]=$med
    printf '  micro-batches %-3s tokens/s median %8.1f   runs:%s\n' "$mb" "$med" "${runs_of[$mb]}"
    sed -n '/./s/^/    /p' "$TMP/stages.$mb"
    # Against the ring's own bound: a stage that needs C CPU seconds on a quota q needs C / q
    # of wall time, so the busiest stage's CPU share of its quota is the share of that
    # bound the run reached (the rest is that stage idle or waiting with quota in hand).
    awk '/cpu/ { for (i = 1; i <= NF; i++) if ($i == "cpu") { v = $(i + 1); sub("%", "", v); if (v > m) m = v } }
         /^$/ { if (m) l = l sprintf(" %.1f%%", m); m = 0 }
         END { if (l) print "    busiest stage CPU / its quota (= share of the CPU bound reached), per run:" l }' \
        "$TMP/stages.$mb"
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
    for k in peer ring1 peer1 peer1ms; do result[$k]=$(printf '%s\n' ${runs_of[$k]} | median); done
    printf '  llama.cpp RPC, %s slots: tokens/s median %8.1f   runs:%s\n' "$seqs" "${result[peer]}" "${runs_of[peer]}"
    awk -v a="${result[$last_mb]}" -v b="${result[peer]}" -v k="$seqs" -v m="$last_mb" \
        'BEGIN { printf "  aggregate at %d sequences, ring (%s micro-batches) / llama.cpp RPC: %.2fx\n", k, m, a / b }'
    paste <(printf '%s\n' ${runs_of[$last_mb]}) <(printf '%s\n' ${runs_of[peer]}) |
        awk '{ printf "%.2f\n", $1 / $2 }' >"$TMP/ratios"
    printf '    per repeat: %s -> median %.2fx\n' "$(tr '\n' ' ' <"$TMP/ratios")" "$(median <"$TMP/ratios")"
    printf '  one sequence: ring tokens/s median %.2f (runs:%s), llama.cpp RPC %.2f (runs:%s)\n' \
        "${result[ring1]}" "${runs_of[ring1]}" "${result[peer1]}" "${runs_of[peer1]}"
    awk -v a="${result[ring1]}" -v b="${result[peer1]}" \
        'BEGIN { printf "  latency per token (wall time / tokens, prompt included), ring / llama.cpp RPC: %.2fx (%.1f ms vs %.1f ms)\n", b / a, 1000 / a, 1000 / b }'
    printf '  llama.cpp RPC decode only (its predicted_per_token_ms): median %.1f ms (runs:%s)\n' \
        "${result[peer1ms]}" "${runs_of[peer1ms]}"
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
