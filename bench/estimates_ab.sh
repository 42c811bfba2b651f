#!/usr/bin/env bash
# bench/estimates_ab.sh - two builds' estimates side by side (issue 15, acceptance 4).
#
#   bench/estimates_ab.sh [--rounds 3] [--requests 30] OLD_KVASIR NEW_KVASIR
#
# Runs bench/estimates.sh (with --log, so the exact p90s are printed) with OLD_KVASIR and
# NEW_KVASIR alternately, ROUNDS times each (old, new, old, new, ...: the machine's slow and
# fast spells fall on both), each run with its own capacity probe and under the benchmark
# lock (flock /work/bench.lock when that file's directory exists). Prints every run's
# output, then a table: per level, each build's refusals and exact p90 of |estimate /
# actual - 1| for the first token and the whole answer, one number per round.
# An old build: git archive REV | tar -x -C /tmp/old, then cmake and ninja there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rounds=3 requests=30
while [ $# -gt 2 ]; do
    case $1 in
    --rounds) rounds=$2; shift ;;
    --requests) requests=$2; shift ;;
    *) echo "estimates_ab.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[ $# -eq 2 ] || { sed -n '2,13p' "$0"; exit 2; }
for k in "$1" "$2"; do
    [ -x "$k" ] || { echo "estimates_ab.sh: $k is not an executable" >&2; exit 2; }
done
lock=()
[ -d /work ] && lock=(flock /work/bench.lock)
out=$(mktemp /tmp/kvr-estab.XXXXXX)
logs=$(mktemp -d /tmp/kvr-estab-logs.XXXXXX)
trap 'rm -rf "$out" "$logs"' EXIT
for r in $(seq 1 "$rounds"); do
    for side in old new; do
        if [ $side = old ]; then k=$1; else k=$2; fi
        echo "=== round $r $side $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)" | tee -a "$out"
        KVASIR=$k "${lock[@]}" "$here/estimates.sh" --requests "$requests" \
            --log "$logs/$side-$r.log" 2>&1 | tee -a "$out"
    done
done
python3 - "$out" <<'EOF'
import collections, re, sys
side = lvl = None
ref = 0
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m = re.match(r"=== round \d+ (\w+)", line)
    if m:
        side = m.group(1)
        continue
    m = re.match(r"([0-9.]+) x capacity .*: \d+ ok, (\d+) refused", line)
    if m:
        lvl, ref = m.group(1), int(m.group(2))
        continue
    m = re.search(r"exact \(log\): \d+ answers, .* first token ([0-9.]+), whole answer ([0-9.]+)", line)
    if m and side and lvl:
        rows[(lvl, side)].append((ref, m.group(1), m.group(2)))
print("\n| x capacity | old: refused | old: p90 first | old: p90 whole "
      "| new: refused | new: p90 first | new: p90 whole |")
print("|---|---|---|---|---|---|---|")
for lvl in sorted({k[0] for k in rows}, key=float):
    cells = []
    for side in ("old", "new"):
        v = rows[(lvl, side)]
        cells += [", ".join(str(x[0]) for x in v), ", ".join(x[1] for x in v),
                  ", ".join(x[2] for x in v)]
    print("| %s | %s |" % (lvl, " | ".join(cells)))
EOF
