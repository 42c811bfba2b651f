#!/usr/bin/env bash
# bench/experts.sh - the latency floor of expert sharding (issue 11): on a MoE model, the same
# emulated machines run (a) a ring of RING stages and (b) STAGES stages + K expert agents
# (STAGES + K = RING machines), one sequence alone and SEQS sequences at once, and print
# the latency per token, the aggregate tokens/s, their ratios (b / a) and each stage's and
# agent's held/starved/blocked share and CPU use.
#
#   bench/experts.sh -m MODEL [-s STAGES] [-e K] [-k SEQS] [-n TOKENS] [-r REPEATS]
#                    [--ring RING] [--stage-experts E] [--quota F] [--netns] [--pin]
#
#   -s STAGES        stages with agents (default 2); -e K agents (default 2)
#   --ring RING      stages of the plain ring (default STAGES + K)
#   --stage-experts "P1 P2 .."  the expert placements to run, each against the same ring
#                    runs, in turns within every repeat: "auto" is the placement `kvasir
#                    plan`/`serve --experts K` make (each stage keeps the share of its layers'
#                    experts that balances its work with the agents'); a number E is
#                    `kvasir plan --stage-experts E` (every stage keeps the last E experts of
#                    its layers, the agents split the rest; 0 = all on the agents). Default auto
#   --quota F, --netns, --pin   the emulated machines of bench/ring.sh (bench/emu.bash):
#                    machine i holds stage i of the ring, and stage i or agent i - STAGES
#                    of the expert plan
#
# Both plans run in flight (micro-batches = stages). Each setting runs REPEATS times
# (default 3), the settings in turns within a repeat; medians are reported with every run.
# Everything runs on 127.0.0.1 or in namespaces this script makes and removes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
KVASIR=${KVASIR:-$here/../build/kvasir}
model="" stages=2 agents=2 ring="" seqs=16 tokens=64 repeats=3 quota="" netns=0 pin=0 sexp=auto
while [ $# -gt 0 ]; do
    case $1 in
    -m) model=$2; shift ;;
    -s) stages=$2; shift ;;
    -e) agents=$2; shift ;;
    -k) seqs=$2; shift ;;
    -n) tokens=$2; shift ;;
    -r) repeats=$2; shift ;;
    --ring) ring=$2; shift ;;
    --stage-experts) sexp=$2; shift ;;
    --quota) quota=$2; shift ;;
    --netns) netns=1 ;;
    --pin) pin=1 ;;
    -h|--help) sed -n '2,${/^#/!q;p}' "$0"; exit 0 ;;
    *) echo "experts.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$model" ] || { echo "experts.sh: -m MODEL is required" >&2; exit 2; }
[ -n "$ring" ] || ring=$((stages + agents))
machines=$((stages + agents > ring ? stages + agents : ring))
TMP=$(mktemp -d /tmp/kvr-experts.XXXXXX)
# shellcheck source=bench/emu.bash
. "$here/emu.bash"
# KVR_BENCH_KEEP=DIR keeps every process's log there.
trap 'emu_cleanup; [ -z "${KVR_BENCH_KEEP:-}" ] || cp -r "$TMP/." "$KVR_BENCH_KEEP/"; rm -rf "$TMP"' EXIT
emu_setup "$machines" "$quota" "$netns" "$pin" 1
base=$((10000 + RANDOM % 22000))
bridge=()
[ $netns = 0 ] || bridge=(--bridge "$EMU_BRIDGE_HOST:$((base - 1))")
hosts_of() { # FIRST COUNT: the machines' addresses, comma-separated
    local i h=""
    for ((i = $1; i < $1 + $2; i++)); do h="$h${h:+,}$(emu_host "$i")"; done
    echo "$h"
}

# ---- plans ----------------------------------------------------------------------------
common=(--max-seqs "$seqs" --ctx 256 --row-width 64 --base-port "$base" "${bridge[@]}")
"$KVASIR" plan -m "$model" --stages "$ring" --microbatches "$ring" --hosts "$(hosts_of 0 "$ring")" \
    "${common[@]}" -o "$TMP/ring.json" 2>/dev/null
# One expert plan per placement; kvasir plan puts every agent on the first host: agent j
# moves to machine STAGES + j.
placements=$(tr ',' ' ' <<<"$sexp")
for pl in $placements; do
    keep=()
    [ "$pl" = auto ] || keep=(--stage-experts "$pl")
    "$KVASIR" plan -m "$model" --stages "$stages" --microbatches "$stages" --experts "$agents" \
        "${keep[@]}" --hosts "$(hosts_of 0 "$stages")" "${common[@]}" -o "$TMP/experts-$pl.json" \
        2>"$TMP/plan.log" || { cat "$TMP/plan.log" >&2; exit 1; }
    echo "placement $pl: $(sed -n 's/^kvasir plan: experts: //p' "$TMP/plan.log")"
    python3 - "$TMP/experts-$pl.json" "$(hosts_of "$stages" "$agents")" <<'PY'
import json, sys
path, hosts = sys.argv[1], sys.argv[2].split(",")
plan = json.load(open(path))
for j, a in enumerate(plan["experts"]):
    a["addr"] = f"{hosts[j]}:{a['addr'].rsplit(':', 1)[1]}"
json.dump(plan, open(path, "w"), indent=2)
PY
done

for i in $(seq 0 $((seqs - 1))); do
    echo "{\"prompt\": \"Once upon a time there was a little robot number $i who\", \"max_tokens\": $tokens, \"temperature\": 0}"
done >"$TMP/prompts.jsonl"
head -1 "$TMP/prompts.jsonl" >"$TMP/prompt1.jsonl"

# run PLAN N_STAGES N_AGENTS PROMPTS: start the plan's processes on machines 0.., run the
# prompts through `kvasir run --plan`, stop them; sets tps and writes the per-process lines
# (timing records and CPU use over the run) to $TMP/procs.
run() {
    local plan=$1 ns=$2 na=$3 i p secs procs=()
    for ((i = 0; i < ns; i++)); do
        emu_spawn "$i" "$TMP/p$i.log" "$KVASIR" stage --plan "$plan" --index "$i" --threads 1
        procs+=("$EMU_PID")
    done
    for ((i = 0; i < na; i++)); do
        emu_spawn "$((ns + i))" "$TMP/p$((ns + i)).log" "$KVASIR" experts --plan "$plan" --index "$i"
        procs+=("$EMU_PID")
    done
    for ((i = 0; i < ns + na; i++)); do emu_wait_log "listening on" "$TMP/p$i.log" || exit 1; done
    # Every agent has accepted every stage's link before the clock starts (a stage takes
    # the link its dialler made at its first MoE layer).
    for ((i = ns; i < ns + na; i++)); do
        for ((p = 0; p < 100; p++)); do
            [ "$(grep -c " linked" "$TMP/p$i.log")" -ge "$ns" ] && break
            sleep 0.1
        done
        [ "$(grep -c " linked" "$TMP/p$i.log")" -ge "$ns" ] || { echo "experts.sh: agent $((i - ns)) not linked:" >&2; tail -5 "$TMP/p$i.log" >&2; exit 1; }
    done
    local cpu0=() cpu1=()
    for p in "${procs[@]}"; do cpu0+=("$(cpu_ns "$p")"); done
    timeout 600 "$KVASIR" run --plan "$plan" --prompts "$4" --ignore-eos -q --json \
        >/dev/null 2>"$TMP/run.log" || { cat "$TMP/run.log" "$TMP"/p*.log; exit 1; }
    for p in "${procs[@]}"; do cpu1+=("$(cpu_ns "$p")"); done
    emu_stop "${procs[@]}"
    tps=$(sed -n 's/^ring: .* \([0-9.]*\) tokens\/s.*/\1/p' "$TMP/run.log")
    secs=$(sed -n 's/^ring: .* in \([0-9.]*\) s,.*/\1/p' "$TMP/run.log")
    for ((i = 0; i < ns + na; i++)); do
        awk -v a="${cpu0[$i]}" -v b="${cpu1[$i]}" -v s="$secs" -v q="${quota:-1}" \
            'BEGIN { printf "cpu %5.1f%% of %s core(s)\n", 100 * (b - a) / 1e9 / s / q, q }'
    done >"$TMP/cpu"
    # An agent's starved share counts from its start (its first frame's wait includes the
    # start-up), so its held seconds over the run's wall time say more: "busy".
    grep -E "^  (stage|agent)" "$TMP/run.log" | paste -d' ' - "$TMP/cpu" |
        awk -v s="$secs" '/agent/ { for (i = 1; i <= NF; i++) if ($i == "held" && $(i + 2) == "s") h = $(i + 1)
                                     $0 = $0 sprintf(" busy %.1f%% of the run", 100 * h / s) } { print }' >"$TMP/procs"
}

echo "model $(basename "$model"): ring of $ring stages vs $stages stages + $agents expert agents;" \
    "$seqs sequences x $tokens tokens; quota ${quota:-none}, netns $([ $netns = 1 ] && echo yes || echo no)," \
    "pin $([ $pin = 1 ] && echo yes || echo no); $repeats runs each"
declare -A runs_of
loads=""
for ((r = 0; r < repeats; r++)); do
    loads="$loads $(cut -d' ' -f1 /proc/loadavg)"
    for k in 1 "$seqs"; do
        prompts=$TMP/prompts.jsonl
        [ "$k" != 1 ] || prompts=$TMP/prompt1.jsonl
        run "$TMP/ring.json" "$ring" 0 "$prompts"
        runs_of[ring$k]="${runs_of[ring$k]:-} $tps"
        { echo "run $r, ring, $k sequence(s), $tps tok/s"; cat "$TMP/procs"; } >>"$TMP/detail"
        for pl in $placements; do
            run "$TMP/experts-$pl.json" "$stages" "$agents" "$prompts"
            runs_of[exp$pl.$k]="${runs_of[exp$pl.$k]:-} $tps"
            { echo "run $r, experts ($pl), $k sequence(s), $tps tok/s"; cat "$TMP/procs"; } >>"$TMP/detail"
        done
    done
done
echo "  load average (1 min) at the start of each repeat:$loads"
sed 's/^/  /' "$TMP/detail"
declare -A med
for key in "${!runs_of[@]}"; do med[$key]=$(printf '%s\n' ${runs_of[$key]} | median); done
ratios() { paste <(printf '%s\n' ${runs_of[$1]}) <(printf '%s\n' ${runs_of[$2]}) | awk "{ printf \"%.3f\\n\", $3 }"; }
printf '  one sequence: ring %.2f tok/s (%.1f ms/token; runs:%s)\n' "${med[ring1]}" \
    "$(awk -v t="${med[ring1]}" 'BEGIN { print 1000 / t }')" "${runs_of[ring1]}"
printf '  %s sequences: ring %.1f tok/s (runs:%s)\n' "$seqs" "${med[ring$seqs]}" "${runs_of[ring$seqs]}"
for pl in $placements; do
    printf '  placement %s, one sequence: experts %.2f tok/s (%.1f ms/token; runs:%s)\n' "$pl" \
        "${med[exp$pl.1]}" "$(awk -v t="${med[exp$pl.1]}" 'BEGIN { print 1000 / t }')" "${runs_of[exp$pl.1]}"
    ratios ring1 "exp$pl.1" '$1 / $2' >"$TMP/r1"
    printf '  placement %s, latency per token, experts / ring: %.3fx (ratio of medians); per repeat %s-> median %.3fx\n' \
        "$pl" "$(awk -v a="${med[ring1]}" -v b="${med[exp$pl.1]}" 'BEGIN { print a / b }')" \
        "$(tr '\n' ' ' <"$TMP/r1")" "$(median <"$TMP/r1")"
    printf '  placement %s, %s sequences: experts %.1f tok/s (runs:%s)\n' "$pl" "$seqs" \
        "${med[exp$pl.$seqs]}" "${runs_of[exp$pl.$seqs]}"
    ratios "exp$pl.$seqs" "ring$seqs" '$1 / $2' >"$TMP/rk"
    printf '  placement %s, aggregate tokens/s, experts / ring: %.3fx (ratio of medians); per repeat %s-> median %.3fx\n' \
        "$pl" "$(awk -v a="${med[exp$pl.$seqs]}" -v b="${med[ring$seqs]}" 'BEGIN { print a / b }')" \
        "$(tr '\n' ' ' <"$TMP/rk")" "$(median <"$TMP/rk")"
done
