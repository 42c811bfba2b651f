#!/usr/bin/env bash
# bench/forward.sh - the engine against physics: measure the machine's read bandwidth, then
# prefill and decode tokens/s of each model given, and the fraction of the bandwidth bound
# decode reaches. Medians of repeated runs (the machine is shared and noisy).
#
#   bench/forward.sh [--threads 2] [--reps 3] MODEL.gguf...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
BUILD=${KVR_BUILD:-$here/../build}
threads=2 reps=3
while [ $# -gt 0 ]; do
    case $1 in
    --threads) threads=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    *) break ;;
    esac
done
[ $# -gt 0 ] || { echo "usage: bench/forward.sh [--threads N] [--reps N] MODEL.gguf..." >&2; exit 2; }
bw=$("$BUILD/bench_bandwidth" --threads "$threads" --reps 7 | sed -n 's/.*median[^0-9]*\([0-9.]*\) GB\/s.*/\1/p')
echo "read bandwidth, $threads threads: $bw GB/s (median of 7)"
for m in "$@"; do
    "$BUILD/bench_forward" "$m" --threads "$threads" --reps "$reps" --bandwidth "$bw"
done
