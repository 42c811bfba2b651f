# lib.bash - helpers for the multi-process tests (sourced, not run; only *.sh are tests).
# Every process a test starts is killed on exit; every wait is bounded.

KVASIR=${KVASIR:?set KVASIR to the kvasir binary (CTest does)}
SHARED=${KVR_SHARED:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/shared}
TMP=$(mktemp -d /tmp/kvr-test.XXXXXX)
PIDS=()

cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    if [ "${KEEP_TMP:-}" = 1 ]; then echo "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

# random_base_port: the first of a random range of listening ports, from 10000 up to 32000
# so that a range of a few dozen stays below Linux's ephemeral range (32768-60999 by
# default). A listener inside the ephemeral range can find its port taken by the source port
# of another test's outgoing connection: ring_archs failed that way under ctest -j4
# ("cannot listen on 127.0.0.1:35686: Address already in use").
random_base_port() {
    echo $((10000 + RANDOM % 22000))
}

# need_shared FILE: the path of a shared test file; skip (exit 77) or, under CI, fail.
need_shared() {
    local f="$SHARED/$1"
    if [ ! -r "$f" ]; then
        [ "${CI:-}" = true ] && fail "required test data missing under CI: $f"
        echo "SKIP: test data not found: $f (set KVR_SHARED)"
        exit 77
    fi
    echo "$f"
}

# start_ring MODEL N_STAGES MICROBATCHES NAME [extra kvasir plan args...]
# Writes $TMP/NAME/plan.json with a random free port range and starts every stage.
# Sets RING_PLAN and appends the stage pids to PIDS and RING_PIDS.
start_ring() {
    local model=$1 n=$2 mb=$3 name=$4
    shift 4
    local dir=$TMP/$name
    mkdir -p "$dir"
    local attempt
    for attempt in 1 2 3 4 5; do
        local base
        base=$(random_base_port)
        "$KVASIR" plan -m "$model" --stages "$n" --microbatches "$mb" --base-port "$base" \
            -o "$dir/plan.json" "$@" 2>/dev/null || fail "kvasir plan failed"
        RING_PIDS=()
        local i ok=1
        for ((i = 0; i < n; i++)); do
            "$KVASIR" stage --plan "$dir/plan.json" --index "$i" >"$dir/stage$i.log" 2>&1 &
            PIDS+=($!)
            RING_PIDS+=($!)
        done
        sleep 0.3
        for p in "${RING_PIDS[@]}"; do kill -0 "$p" 2>/dev/null || ok=0; done
        if [ $ok = 1 ]; then
            RING_PLAN=$dir/plan.json
            return 0
        fi
        stop_ring # a port was taken: try another range
    done
    fail "could not start a $n-stage ring"
}

stop_ring() {
    for p in "${RING_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${RING_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    RING_PIDS=()
}
