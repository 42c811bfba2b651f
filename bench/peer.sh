#!/usr/bin/env bash
# bench/peer.sh - Kvasir's engine side by side with llama.cpp's llama-bench on the same files.
#
#   flock /work/bench.lock bench/peer.sh [--threads 2,1] [--pairs 3] [--reps 3] [--busy LOAD] MODEL.gguf...
#
# For every model and thread count it runs pairs, ours then theirs, --pairs times in a row
# (ours, theirs, ours, theirs, ...): ours is bench_forward (one 128-token prefill in one
# pass, then 64 greedy decode steps in a new sequence, from an empty context as llama-bench's
# tg test; one warm-up pass first, then --reps repeats), theirs is
# `llama-bench -p 128 -n 64 -r REPS -o json` (its pp128 and tg64, each repeated). A side's
# figure in a pair is the best of its repeats (llama-bench's `samples_ts`, ours' runs): this
# machine's host slows memory and CPU in spells of seconds (per-token times of one decode
# run moved between 33 and 110 ms), and a mean then measures the spells as much as the
# code; the best repeat of each side is the least disturbed one, taken minutes apart at
# most. --reps 1 gives the single-run comparison of before. Each pair prints prefill and
# decode tokens/s of both, the ratios (ours / theirs), and the fraction of the bandwidth bound
# decode reaches (weight bytes per decoded token, from bench_forward, times tokens/s, over
# the read bandwidth bench_bandwidth measures right before and right after that pair,
# column `bw`: the highest of the 4 KiB page and transparent-huge-page readings of both
# moments, since the engine's packed copy asks for huge pages and the peer's mapped file
# has 4 KiB ones). The bound is taken per pair because a shared machine's bandwidth moves by
# a factor of two within minutes: one reading per run made the fractions of later pairs
# meaningless, and one reading per pair could catch a dip (a fraction over 100 %). The
# summary adds the median fraction of the quiet pairs.
#
# Each pair records the 1-minute load average before and after it, and what the rest of
# the machine used while it ran: the CPU time /proc/stat counts as busy (user, nice,
# system, irq, softirq, and steal, the time the hypervisor gave our vCPUs to someone
# else) minus the CPU time of this script's own children, over the pair's wall time, in
# cores (`other`). A pair where that exceeds --busy (default 0.25 cores) is marked `busy`
# and left out of the summary line, which gives the medians of the quiet pairs only (or
# says there were none). The load average is only printed: it lags by a minute, so right
# after other work stops it still reads high on a quiet machine. Numbers from a shared
# machine are provisional: compare ratios, not absolute speeds.
#
# The peer is $KVR_PEER (default ../shared/peers/llama.cpp beside the source tree). If its
# library symlinks were flattened into small text files by a copy, a repaired copy is made
# under ${TMPDIR:-/tmp}/kvr-peer-kit and used instead. --peer-cpu NAME (e.g. haswell, the
# peer's AVX2 build) runs the peer from a copy holding only libggml-cpu-NAME.so of its CPU
# backends, to compare like with like beside KVR_ISA=avx2.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
BUILD=${KVR_BUILD:-$here/../build}
PEER=${KVR_PEER:-$here/../../shared/peers/llama.cpp}
threads_list=2 pairs=3 reps=3 busy=0.25 peer_cpu=
while [ $# -gt 0 ]; do
    case $1 in
    --threads) threads_list=$2; shift 2 ;;
    --pairs) pairs=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --busy) busy=$2; shift 2 ;;
    --peer-cpu) peer_cpu=$2; shift 2 ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    *) break ;;
    esac
done
[ $# -gt 0 ] || { echo "usage: bench/peer.sh [--threads 2,1] [--pairs N] [--reps N] [--busy LOAD] [--peer-cpu NAME] MODEL.gguf..." >&2; exit 2; }
[ "$pairs" -ge 1 ] || { echo "peer.sh: --pairs must be >= 1" >&2; exit 2; }
case $reps in ''|*[!0-9]*|0) echo "peer.sh: --reps must be a whole number >= 1" >&2; exit 2 ;; esac
for tool in bench_forward bench_bandwidth; do
    [ -x "$BUILD/$tool" ] || { echo "peer.sh: $BUILD/$tool not built" >&2; exit 2; }
done
[ -x "$PEER/bin/llama-bench" ] || { echo "peer.sh: no llama-bench in $PEER/bin" >&2; exit 2; }

# A copy that turned symlinks into files holding the target's name breaks the loader.
if [ -f "$PEER/lib/libllama.so.0" ] && [ "$(stat -c %s "$PEER/lib/libllama.so.0")" -lt 64 ]; then
    kit=${TMPDIR:-/tmp}/kvr-peer-kit
    if [ ! -x "$kit/bin/llama-bench" ] || [ ! -L "$kit/lib/libllama.so.0" ]; then
        rm -rf "$kit"
        cp -r "$PEER" "$kit"
        chmod -R u+w "$kit"
        for f in "$kit"/lib/* "$kit"/bin/*; do
            [ -f "$f" ] && [ ! -L "$f" ] && [ "$(stat -c %s "$f")" -lt 64 ] || continue
            target=$(cat "$f")
            [ -e "$(dirname "$f")/$target" ] && ln -sf "$target" "$f"
        done
    fi
    PEER=$kit
fi

# Only one of the peer's CPU backends: ggml loads the best one the CPU can run, so the
# others are left out of a copy.
if [ -n "$peer_cpu" ]; then
    case $peer_cpu in *[!a-z0-9_]*) echo "peer.sh: --peer-cpu $peer_cpu: not a backend name" >&2; exit 2 ;; esac
    [ -e "$PEER/bin/libggml-cpu-$peer_cpu.so" ] || [ -e "$PEER/lib/libggml-cpu-$peer_cpu.so" ] ||
        { echo "peer.sh: no libggml-cpu-$peer_cpu.so in $PEER/bin or $PEER/lib" >&2; exit 2; }
    one=${TMPDIR:-/tmp}/kvr-peer-kit-$peer_cpu
    rm -rf "$one"
    cp -a "$PEER" "$one"
    chmod -R u+w "$one"
    for f in "$one"/bin/libggml-cpu-*.so "$one"/lib/libggml-cpu-*.so; do
        if [ -e "$f" ] && [ "$(basename "$f")" != "libggml-cpu-$peer_cpu.so" ]; then
            rm -f "$f"
        fi
    done
    PEER=$one
fi

load1() { cut -d' ' -f1 /proc/loadavg; }
# busy jiffies of the whole machine (user nice system irq softirq steal)
stat_busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8 + $9; exit}' /proc/stat; }
# CPU seconds of this shell's finished children: the second line of `times`, which must run
# in this shell itself (a subshell has its own, empty, counts), saved to the file $1
cpu_of() { awk 'NR == 2 {n = 0; for (i = 1; i <= 2; i++) {
    split($i, a, "m"); sub("s", "", a[2]); n += a[1] * 60 + a[2] } print n}' "$1"; }
hz=$(getconf CLK_TCK)
median() { sort -g | awk '{v[NR]=$1} END {if (NR == 0) print "-"; else if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }

echo "kvasir: $BUILD (kernels ${KVR_ISA:-best}), peer: $PEER/bin/llama-bench (CPU backend ${peer_cpu:-best})"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) CPUs"
IFS=, read -r -a tlist <<< "$threads_list"
# The read bandwidth on $1 threads now: the higher of the 4 KiB and 2 MiB page medians.
probe() {
    local h r best=0
    for h in 0 1; do
        r=$("$BUILD/bench_bandwidth" --threads "$1" --reps "$2" --mib 512 --huge $h |
            sed -n 's/.*median[^0-9]*\([0-9.]*\) GB\/s.*/\1/p')
        best=$(awk -v a="$best" -v b="$r" 'BEGIN {print (a > b ? a : b)}')
    done
    echo "$best"
}
for t in "${tlist[@]}"; do
    echo "read bandwidth, $t threads: $(probe "$t" 5) GB/s (the better of 4 KiB and 2 MiB pages, medians of 5); each pair below is bounded by its own reading (medians of 3)"
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for m in "$@"; do
    for t in "${tlist[@]}"; do
        echo
        echo "$(basename "$m"), $t threads"
        printf '%-5s %-11s %5s %9s %9s %6s %8s %8s %6s %5s %6s %6s  %s\n' pair load other pp.ours \
            pp.peer ratio tg.ours tg.peer ratio bw bw.our bw.peer note
        : > "$tmp/quiet"
        for p in $(seq 1 "$pairs"); do
            bwp=$(probe "$t" 3)
            times > "$tmp/times"
            l0=$(load1) s0=$(stat_busy) c0=$(cpu_of "$tmp/times") w0=$(date +%s.%N)
            "$BUILD/bench_forward" "$m" --threads "$t" --prompt 128 --decode 64 --reps "$reps" \
                --fresh-decode 1 > "$tmp/ours"
            "$PEER/bin/llama-bench" -m "$m" -p 128 -n 64 -r "$reps" -t "$t" -o json > "$tmp/peer" 2> "$tmp/peer.err" || {
                echo "peer.sh: llama-bench failed:" >&2; tail -3 "$tmp/peer.err" >&2; exit 1; }
            times > "$tmp/times"
            l1=$(load1) s1=$(stat_busy) c1=$(cpu_of "$tmp/times") w1=$(date +%s.%N)
            bwp=$(awk -v a="$bwp" -v b="$(probe "$t" 3)" 'BEGIN {print (a > b ? a : b)}')
            other=$(awk -v s0="$s0" -v s1="$s1" -v c0="$c0" -v c1="$c1" -v w0="$w0" -v w1="$w1" \
                -v hz="$hz" 'BEGIN {o = ((s1 - s0) / hz - (c1 - c0)) / (w1 - w0);
                printf "%.2f", o < 0 ? 0 : o}')
            mb=$(sed -n 's/.* \([0-9.]*\) MB read per decoded token.*/\1/p' "$tmp/ours")
            read -r opp otg < <(sed -n 's/^  run [0-9]*: prefill [0-9]* tokens \([0-9.]*\) tokens\/s, decode [0-9]* tokens \([0-9.]*\) tokens\/s.*/\1 \2/p' "$tmp/ours" |
                awk '$1 > p {p = $1} $2 > d {d = $2} END {print p, d}')
            read -r tpp ttg < <(python3 -c '
import json, sys
pp = tg = 0.0
for r in json.load(open(sys.argv[1])):
    best = max(r.get("samples_ts") or [r["avg_ts"]])
    if r["n_prompt"] == 128 and r["n_gen"] == 0: pp = best
    if r["n_prompt"] == 0 and r["n_gen"] == 64: tg = best
print(pp, tg)' "$tmp/peer")
            note=""
            if awk -v o="$other" -v x="$busy" 'BEGIN {exit !(o > x)}'; then
                note=busy
            else
                echo "$opp $tpp $otg $ttg $mb $bwp" >> "$tmp/quiet"
            fi
            awk -v p="$p" -v l0="$l0" -v l1="$l1" -v other="$other" -v opp="$opp" -v tpp="$tpp" -v otg="$otg" \
                -v ttg="$ttg" -v mb="$mb" -v bw="$bwp" -v note="$note" 'BEGIN {
                printf "%-5s %-11s %5s %9.1f %9.1f %6.2f %8.2f %8.2f %6.2f %5.1f %5.0f%% %5.0f%%  %s\n",
                    p, l0 "-" l1, other, opp, tpp, opp / tpp, otg, ttg, otg / ttg, bw,
                    100 * otg * mb / 1000 / bw, 100 * ttg * mb / 1000 / bw, note }'
        done
        n=$(wc -l < "$tmp/quiet")
        if [ "$n" -eq 0 ]; then
            echo "summary: no quiet pair (others used more than $busy cores during every pair); nothing to report"
        else
            ppr=$(awk '{print $1 / $2}' "$tmp/quiet" | median)
            tgr=$(awk '{print $3 / $4}' "$tmp/quiet" | median)
            fr=$(awk '{printf "%.0f\n", 100 * $3 * $5 / 1000 / $6}' "$tmp/quiet" | median)
            echo "summary ($n quiet of $pairs pairs, each side the best of $reps repeats a pair, medians of the per-pair ratios): pp128 ${ppr}x, tg64 ${tgr}x; ours' decode ${fr}% of the bound"
        fi
    done
done
