#!/usr/bin/env bash
# bench/ring.sh - push K concurrent sequences through a ring and report aggregate tokens/s
# and per-stage held/starved/blocked fractions and CPU use; compare in flight with drained.
#
#   bench/ring.sh -m MODEL [-s STAGES] [-k SEQS] [-n TOKENS] [-r REPEATS] [-t THREADS]
#                 [--quota FRACTION] [--period US] [--netns] [--pin] [--baseline]
#                 [--layers "0-10,11-44"] [--trace]
#
#   --quota F    run each stage in its own cgroup (v1 cpu controller) limited to F of one
#                core (cpu.cfs_quota_us = F x cpu.cfs_period_us, period 2 ms, or longer
#                when F x 2 ms is under the kernel's 1 ms minimum); needs root
#   --period US  the CFS period of --quota instead (the quota stays F of it)
#   --netns      run each stage in its own network namespace, joined to this one by a veth
#                pair on a Linux bridge (10.78.0.0/24); needs root and iproute2
#   --pin        put stage i on CPU (i mod nproc) with taskset (with -t T: T CPUs from
#                i x T on): a stage's threads share its CPU, as on a machine of its own
#   --trace      log every batch's trip (KVR_LOG=debug in the bridge) and print, per
#                run, the batches in flight on average (so the bridge's turnaround), the
#                round trip and each stage's held time (p10/p50/p90), and what a loop of
#                that many batches with those held times would reach (a model, no hops)
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
mbs="" layers="" crypto=0 peer=0 period="" trace=0
while [ $# -gt 0 ]; do
    case $1 in
    -m) model=$2; shift ;;
    -s) stages=$2; shift ;;
    -k) seqs=$2; shift ;;
    -n) tokens=$2; shift ;;
    -r) repeats=$2; shift ;;
    -t) threads=$2; shift ;;
    --quota) quota=$2; shift ;;
    --period) period=$2; shift ;;
    --trace) trace=1 ;;
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
emu_setup "$stages" "$quota" "$netns" "$pin" "$threads" "$period"
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
# records, CPU use, quota throttling) and a machine line (the bridge's CPU, each CPU's
# busy / idle / softirq / steal share of the run) in $TMP/stages.
run_ring() {
    start_stages "$1"
    local cpu0=() cpu1=() cg0=() cg1=() p i secs st0 st1 log_env=()
    [ $trace = 0 ] || log_env=(env KVR_LOG=debug)
    for p in "${RING[@]}"; do cpu0+=("$(cpu_ns "$p")"); done
    for ((i = 0; i < stages; i++)); do cg0+=("$(cg_stat "$i")"); done
    st0=$(cpu_stat)
    # bash's time: the bridge's (kvasir run's) user and system CPU seconds, all its threads.
    local TIMEFORMAT='%U %S'
    { time timeout 600 "${log_env[@]}" "$KVASIR" run --plan "$1" --prompts "$2" \
        --ignore-eos -q --json >/dev/null 2>"$TMP/run.log"; } 2>"$TMP/bridge.time" ||
        { cat "$TMP/run.log"; exit 1; }
    st1=$(cpu_stat)
    for ((i = 0; i < stages; i++)); do cg1+=("$(cg_stat "$i")"); done
    for p in "${RING[@]}"; do cpu1+=("$(cpu_ns "$p")"); done
    stop_stages
    tps=$(sed -n 's/^ring: .* \([0-9.]*\) tokens\/s.*/\1/p' "$TMP/run.log")
    # Each stage's CPU time over the run, against the run's wall time (x quota, if set):
    # a stage that held batches but used little CPU was throttled or preempted. "throttled"
    # is the share of its quota periods the kernel throttled it in, and the wall time it
    # spent throttled per second of the run (cgroup cpu.stat).
    secs=$(sed -n 's/^ring: .* in \([0-9.]*\) s,.*/\1/p' "$TMP/run.log")
    for ((i = 0; i < stages; i++)); do
        awk -v a="${cpu0[$i]}" -v b="${cpu1[$i]}" -v s="$secs" -v q="${quota:-$threads}" \
            -v c0="${cg0[$i]}" -v c1="${cg1[$i]}" 'BEGIN {
                printf "cpu %5.1f%% of %s core(s)", 100 * (b - a) / 1e9 / s / q, q
                split(c0, x, " "); split(c1, y, " ")
                if (y[1] > x[1])
                    printf "  throttled %4.1f%% of periods, %3.0f ms/s", 100 * (y[2] - x[2]) / (y[1] - x[1]),
                        (y[3] - x[3]) / 1e6 / s
                printf "\n" }'
    done >"$TMP/cpu"
    grep -E "^  stage" "$TMP/run.log" | paste -d' ' - "$TMP/cpu" >"$TMP/stages"
    # "others": the CPUs' busy time less the stages' and the bridge's, i.e. the kernel's
    # work outside those processes (softirqs are mostly inside them) and any other process:
    # a run where it is large was not taken on a quiet machine. /proc/stat is sampled at the
    # tick on a kernel with tick CPU accounting, and a stage throttled at the tick was seen
    # running by it, so under a short quota period the busy shares (and "others") read high;
    # the stages' own CPU times (schedstat) are exact.
    local ours=0
    for ((i = 0; i < stages; i++)); do ours=$((ours + ${cpu1[$i]} - ${cpu0[$i]})); done
    paste -d' ' <(echo "$st0") <(echo "$st1") |
        awk -v s="$secs" -v t="$(cat "$TMP/bridge.time")" -v o="$ours" -v hz="$(getconf CLK_TCK)" '
            BEGIN { split(t, u, " "); printf "  bridge %.1f%% of a core;", 100 * (u[1] + u[2]) / s }
            { n = ($7 - $2) + ($8 - $3) + ($10 - $5); if (n <= 0) n = 1
              busy += $7 - $2; all += n
              printf " %s busy %.1f%% idle %.1f%% (softirq %.1f%%, steal %.1f%%);", $1,
                  100 * ($7 - $2) / n, 100 * ($8 - $3) / n, 100 * ($9 - $4) / n, 100 * ($10 - $5) / n }
            END { w = all / NR / hz; printf " others %.1f%% of a core\n",
                  100 * (busy / hz - o / 1e9 - u[1] - u[2]) / w }' >>"$TMP/stages"
    # Pinned without quotas, a CPU is the machine its stages share, so its bound is that CPU:
    # the stages' CPU on the busiest one over the wall time is the share of it reached.
    if [ $pin = 1 ] && [ -z "$quota" ]; then
        for ((i = 0; i < stages; i++)); do
            echo "$(((i * threads) % $(nproc))) $((${cpu1[$i]} - ${cpu0[$i]}))"
        done | awk -v s="$secs" -v t="$threads" '{ c[$1] += $2 } END {
            l = ""; m = 0
            for (k in c) { v = 100 * c[k] / 1e9 / s / t; l = l sprintf(" cpu%s %.1f%%", k, v); if (v > m) m = v }
            printf "  stages per pinned CPU:%s (busiest %.1f%%)\n", l, m }' >>"$TMP/stages"
    fi
    [ $trace = 0 ] || cp "$TMP/run.log" "$TMP/trace.$(basename "$1").$(date +%s%N)"
}

# trace_summary LOG...: the bridge's per-batch trips (KVR_LOG=debug) of every run of one
# setting. "in flight" is the batches the ring held on average over the run (the sum of
# round trips over the span from the first send to the last result: Little's law), so it
# shows the ramp and the bridge's turnaround at once; the quantiles are over the batches of
# the most common size (the steady state's).
trace_summary() {
    python3 - "$@" <<'PY'
import random, re, sys
pat = re.compile(r"^\[\s*([0-9.]+) .*bridge: batch (\d+), (\d+) rows, round trip ([0-9.]+) ms;"
                 r" per stage starved/blocked/held ms:(.*)$")
def q(v, f):
    v = sorted(v)
    return v[min(len(v) - 1, int(f * len(v)))] if v else 0.0
for path in sys.argv[1:]:
    trips = []
    for line in open(path):
        m = pat.match(line)
        if m:
            st = [tuple(float(x) for x in t.split("/")) for t in m.group(5).split()]
            trips.append((float(m.group(1)) * 1e3, int(m.group(3)), float(m.group(4)), st))
    if not trips:
        print("    trace: no batch trips logged")
        continue
    span = max(t for t, _, _, _ in trips) - min(t - rt for t, _, rt, _ in trips)
    counts = {}
    for _, r, _, _ in trips:
        counts[r] = counts.get(r, 0) + 1
    rows = max(counts, key=lambda r: (counts[r], r))  # the steady state's batch
    full = [x for x in trips if x[1] == rows]
    rt = [x[2] for x in full]
    print(f"    trace: {len(trips)} batches, {len(full)} of {rows} rows; in flight "
          f"{sum(x[2] for x in trips) / span:.2f} on average; round trip of a {rows}-row batch "
          f"p10/p50/p90 {q(rt, .1):.1f}/{q(rt, .5):.1f}/{q(rt, .9):.1f} ms")
    for i in range(len(full[0][3])):
        h = [x[3][i][2] for x in full]
        w = [x[3][i][0] for x in full]
        print(f"      stage {i}: held p10/p50/p90 {q(h, .1):.2f}/{q(h, .5):.2f}/{q(h, .9):.2f} ms,"
              f" mean {sum(h) / len(h):.2f}; starved before it mean {sum(w) / len(w):.2f} ms")
    # The same loop in a model: W batches go round stations that keep them in order, each
    # batch holding stage k for a time drawn from stage k's own held times (no hops, no
    # bridge), against the slowest stage's mean. With every hold at its stage's mean it
    # reaches the bound when the loop has room; the gap between the two is what the spread
    # of held times alone costs a closed loop of W batches.
    W = round(sum(x[2] for x in trips) / span)
    K = len(full[0][3])
    held = [[x[3][k][2] for x in full] for k in range(K)]
    bound = max(sum(h) / len(h) for h in held)
    def loop(draw, n=20000):
        rng = random.Random(1)
        d = [[0.0] * n for _ in range(K)]
        for i in range(n):
            for k in range(K):
                came = d[k - 1][i] if k else (d[K - 1][i - W] if i >= W else 0.0)
                free = d[k][i - 1] if i else 0.0
                d[k][i] = max(came, free) + draw(rng, k)
        return (n / 2) / (d[K - 1][n - 1] - d[K - 1][n // 2 - 1]) * bound
    spread = loop(lambda r, k: r.choice(held[k]))
    steady = loop(lambda r, k: sum(held[k]) / len(held[k]))
    print(f"      a model of {W} batches in a loop of these stages (hops left out): held times "
          f"drawn from the trace {100 * spread:.1f}% of the slowest stage's pace, every hold "
          f"at its mean {100 * steady:.1f}%")
    sh = [sum(s[2] for s in x[3]) for x in full]
    print(f"      sum of held per trip mean {sum(sh) / len(sh):.1f} ms: the rest of the round trip"
          f" ({sum(rt) / len(rt) - sum(sh) / len(sh):.1f} ms) is queueing, blocked and the hops")
PY
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
    grep -q 'stages per pinned CPU' "$TMP/stages.$mb" && sed -n 's/.*(busiest \(.*\))/\1/p' "$TMP/stages.$mb" |
        tr '\n' ' ' | sed 's/^/    busiest pinned CPU, its stages CPU \/ the CPU, per run: /; s/$/\n/'
    [ $trace = 0 ] || trace_summary "$TMP"/trace.plan."$mb".json.*
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
