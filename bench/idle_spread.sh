#!/usr/bin/env bash
# bench/idle_spread.sh - how much the same request's times vary on an idle ring (issue 15,
# acceptance 4): the part of an estimate's error that no estimator can remove here.
#
#   bench/idle_spread.sh [-m MODEL] [--stages 2] [--requests 80] [--prompt-len 200]
#       [--output-len 64] [--log FILE]
#
# Starts `kvasir serve` (ring-45 Q8_0 unless -m) and sends REQUESTS requests of one shape
# (PROMPT_LEN prompt tokens, OUTPUT_LEN answer tokens) one at a time, so nothing else is
# ever on the ring. Then, over all but the first 10 (the cost model learning), for the first
# token and for the whole answer: the outcomes' range, the p90 of |outcome / median - 1|
# (the best any single estimate could do for these requests: they are all alike) and the
# p90 of admission's own |estimate / outcome - 1| (from the serve log's estimate lines).
# --log FILE keeps the serve log (debug: every estimate and every batch's trip).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
KVASIR=${KVASIR:-$here/../build/kvasir}
model="" stages=2 requests=80 prompt=200 output=64 log=""
while [ $# -gt 0 ]; do
    case $1 in
    -m) model=$2; shift ;;
    --stages) stages=$2; shift ;;
    --requests) requests=$2; shift ;;
    --prompt-len) prompt=$2; shift ;;
    --output-len) output=$2; shift ;;
    --log) log=$2; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "idle_spread.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[ "$requests" -gt 20 ] || { echo "idle_spread.sh: --requests must be above 20" >&2; exit 2; }
# shellcheck source=bench/serve.bash
. "$here/serve.bash"
serve_tmp kvr-idle "$log"
[ -n "$model" ] || { model=$TMP/ring45.gguf; ring45 "$model"; }
KVR_LOG=debug serve_start "$TMP/serve.log" -m "$model" --stages "$stages" --max-seqs 32 --ctx 1024
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$KVASIR" bench --url "$URL" -m "$model" --prompt-len "$prompt" --output-len "$output" \
    --concurrency 1 --num-requests "$requests" --quiet >"$TMP/bench.txt"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
estimate_outcomes <"$TMP/serve.log" | tail -n +11 >"$TMP/out.txt"
echo "$requests requests of $prompt + $output tokens one at a time; the first 10 left out:"
# spread COL_ACTUAL COL_ESTIMATE NAME
spread() {
    awk -v a="$1" -v e="$2" -v name="$3" "$P90_AWK"'
        { n++; x[n] = $a; r[n] = $e / $a - 1; if (r[n] < 0) r[n] = -r[n] }
        END {
            if (n < 5) { print "  " name ": too few answers"; exit 1 }
            for (i = 1; i <= n; i++) s[i] = x[i]
            sort(s); med = n % 2 ? s[(n + 1) / 2] : (s[n / 2] + s[n / 2 + 1]) / 2
            for (i = 1; i <= n; i++) { d[i] = x[i] / med - 1; if (d[i] < 0) d[i] = -d[i] }
            printf "  %s: %d answers, %.0f-%.0f ms (median %.0f); p90 |outcome / median - 1| %.3f; admission p90 |estimate / outcome - 1| %.3f\n",
                name, n, s[1], s[n], med, p90(d), p90(r)
        }' "$TMP/out.txt"
}
spread 1 2 "first token"
spread 3 4 "whole answer"
