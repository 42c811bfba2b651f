# lib.bash - helpers for the multi-process tests (sourced, not run; only *.sh are tests).
# Every process a test starts is killed on exit; every wait is bounded.

KVASIR=${KVASIR:?set KVASIR to the kvasir binary (CTest does)}
SHARED=${KVR_SHARED:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)/shared}
TMP=$(mktemp -d /tmp/kvr-test.XXXXXX)
PIDS=()

cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    release_ports
    if [ "${KEEP_TMP:-}" = 1 ]; then echo "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }
# count PATTERN FILE: how many lines of FILE match so far (grep -c exits 1 on none).
count() { grep -c -- "$1" "$2" || true; }

# reserve_base_port: the first port of a block of 31 listening ports that this test holds
# until it exits (the block's port below it too: `kvasir serve --base-port` puts its bridge
# there). Blocks of 32 from 10000 up to 32000, below Linux's ephemeral range (32768-60999 by
# default): a listener inside it can find its port taken by the source port of another
# test's outgoing connection (ring_archs failed that way under ctest -j4: "cannot listen on
# 127.0.0.1:35686: Address already in use"). A block is taken by making its directory under
# PORT_LOCKS (mkdir is atomic), so no two tests running at once share a port, not even while
# one restarts a stage on its plan's port: random ranges alone met under ctest -j4 (a
# 3-stage ring of ring_identical found ring_recover's restarted stage 2 on its head's port,
# "different plan hash"). A block whose test died without its exit trap (SIGKILL) is freed
# once it is 10 minutes old.
PORT_LOCKS=${KVR_PORT_LOCKS:-/tmp/kvr-test-ports}
reserve_base_port() {
    local i block lock owner
    mkdir -p "$PORT_LOCKS"
    for lock in $(find "$PORT_LOCKS" -mindepth 1 -maxdepth 1 -mmin +10 2>/dev/null); do
        read -r owner <"$lock/pid" 2>/dev/null || continue
        kill -0 "$owner" 2>/dev/null || rm -rf "$lock"
    done
    for i in $(seq 1 500); do
        block=$((10000 + 32 * (RANDOM % 688)))
        lock=$PORT_LOCKS/$block
        if mkdir "$lock" 2>/dev/null; then
            echo $$ >"$lock/pid" # the test's own shell, also from a $(...) subshell
            echo $((block + 1))
            return 0
        fi
    done
    fail "no free block of ports under $PORT_LOCKS"
}
release_ports() { # the blocks this test holds (cleanup)
    local lock owner
    for lock in "$PORT_LOCKS"/*; do
        read -r owner <"$lock/pid" 2>/dev/null || continue
        [ "$owner" = $$ ] && rm -rf "$lock"
    done
    return 0
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
        base=$(reserve_base_port)
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

# mono_now VAR: set VAR to the seconds of the boot-time clock (/proc/uptime), for intervals
# the test measures itself, read without starting a process: python's start-up took over a
# second under a loaded ctest, so a kill stamped by it came after the run it was meant to
# interrupt had ended.
mono_now() {
    local up _
    read -r up _ </proc/uptime
    printf -v "$1" %s "$up"
}

# log_now VAR: set VAR to the clock kvasir's log lines carry (wall-clock seconds since 1970,
# core/log.h), read without starting a process, so that a kill stamped by it is compared
# with the log's stamps.
log_now() { printf -v "$1" %s "${EPOCHREALTIME/,/.}"; }
# log_ts LINE: the seconds since 1970 of a kvasir log line's stamp
# ("[2026-12-07T20:45:01.123Z tag level] ...").
log_ts() {
    local s
    s=$(sed -n 's/^\[\([0-9T:.-]*Z\) .*/\1/p' <<<"$1")
    [ -n "$s" ] && date -u -d "$s" +%s.%3N
}

# mid_run TAG: wait until the background run RUN_PID, started with KVR_LOG=debug and logging
# to $TMP/TAG.log, has had MID_BATCHES batches back (default 60; its sequences are all
# decoding, a long way from their ends): a failure is caused at an observed point of the
# run, not after a time that a loaded machine would stretch or a fast one shrink (the
# bridge logs every batch that comes back at debug level).
mid_run() {
    local i mid=${MID_BATCHES:-60}
    for i in $(seq 1 600); do
        [ "$(grep -c "bridge: batch" "$TMP/$1.log" 2>/dev/null)" -ge "$mid" ] && return 0
        kill -0 "$RUN_PID" 2>/dev/null || fail "$1: the run ended before $mid batches"
        sleep 0.05
    done
    fail "$1: fewer than $mid batches in 30 s"
}

# wait_ready FILE PID WHAT: wait (at most 30 s) until the helper PID, started in the
# background, has created FILE to say it is running; fail if it exits first.
wait_ready() {
    local i
    for i in $(seq 1 600); do
        [ -e "$1" ] && return 0
        kill -0 "$2" 2>/dev/null || fail "$3 exited before it was ready"
        sleep 0.05
    done
    fail "$3 was not ready within 30 s"
}

# watch_and_kill KILL_AT PID FILE...: start kill_mid_stream.py (SIGKILL PID once every
# streamed FILE has delivered KILL_AT tokens; it fails if a stream ended first) in the
# background and return once it watches, so the caller starts the streams only then:
# python's start-up took over a second under a loaded ctest, and a 256-token stream had
# ended before a watcher started beside it could look. Sets WATCHER (its pid; wait for it)
# and writes its report (the kill's time and each stream's token count) to $TMP/kill.out.
watch_and_kill() {
    local kill_at=$1 pid=$2
    shift 2
    rm -f "$TMP/kill.ready"
    KILL_READY=$TMP/kill.ready python3 "$(dirname "${BASH_SOURCE[0]}")/kill_mid_stream.py" \
        "$kill_at" "$pid" "$@" >"$TMP/kill.out" &
    WATCHER=$!
    wait_ready "$TMP/kill.ready" "$WATCHER" "the kill watcher"
}

# start_streams TAG URL MAX_S BODY_FN I...: one streamed completion per I, sent at once,
# each a curl (at most MAX_S seconds) whose request is `BODY_FN I` (a JSON body on stdout):
# its events go to $TMP/sse.TAG.I, its text (sse_text) to $TMP/http.TAG.I; their pids are in
# STREAM_PIDS. Each curl reads its body from a FIFO (-d @FILE: curl reads its body before it
# connects); once every curl has its FIFO open (opening one for writing waits for that),
# each gets its body, and then all of them its end. Streams started one after another
# began seconds apart under a loaded ctest -j4 (a fork and exec of curl, tee and python
# each): one had ended before another had its 40th token, and a kill mid-stream could not
# find a point where all were running.
start_streams() {
    local tag=$1 url=$2 max_s=$3 fn=$4 i fd fds=()
    local -A body
    shift 4
    STREAM_PIDS=()
    for i; do
        body[$i]=$("$fn" "$i")
        rm -f "$TMP/body.$tag.$i"
        mkfifo "$TMP/body.$tag.$i"
    done
    for i; do
        curl -s -N -m "$max_s" "$url/v1/completions" -H 'Content-Type: application/json' \
            -d @"$TMP/body.$tag.$i" -o "$TMP/sse.$tag.$i" &&
            sse_text <"$TMP/sse.$tag.$i" >"$TMP/http.$tag.$i" &
        STREAM_PIDS+=($!)
    done
    for i; do
        exec {fd}>"$TMP/body.$tag.$i"
        printf '%s' "${body[$i]}" >&"$fd"
        fds+=("$fd")
    done
    for fd in "${fds[@]}"; do exec {fd}>&-; done
}

# mixed_prompts FILE: 12 prompts of different lengths (1 to 17 words) for `kvasir run
# --prompts`; even ones greedy, odd ones sampled (top-k, top-p) with their own seed, each
# with its own max_tokens (12 + i).
mixed_prompts() {
    local words=(Once upon a time there was a little girl who loved to play in the park with her dog)
    local i n text
    for i in $(seq 0 11); do
        n=$(( (i * 5) % 17 + 1 ))
        text="${words[*]:0:$n}"
        if [ $((i % 2)) = 0 ]; then
            echo "{\"prompt\": \"$text\", \"temperature\": 0, \"max_tokens\": $((12 + i))}"
        else
            echo "{\"prompt\": \"$text\", \"temperature\": 0.9, \"top_k\": 40, \"top_p\": 0.95, \"seed\": $((1000 + i)), \"max_tokens\": $((12 + i))}"
        fi
    done >"$1"
}

# sse_text: read a streamed completion's server-sent events on stdin and print its text as
# one JSON string; fails on an error event or a stream without text.
sse_text() {
    python3 -c '
import json, sys
text = []
for line in sys.stdin:
    if line.startswith("data: {"):
        d = json.loads(line[6:])
        if "error" in d:
            sys.exit("error event: %s" % d["error"])
        text.append(d["choices"][0]["text"])
if not text:
    sys.exit("no text")
print(json.dumps("".join(text)))'
}

# start_agents N: start the N expert agents of $RING_PLAN (logs agentJ.log beside it; pids
# in PIDS and AGENT_PIDS) and wait (10 s at most) until each has authenticated both stages.
start_agents() {
    local n=$1 j i dir
    dir=$(dirname "$RING_PLAN")
    AGENT_PIDS=()
    for ((j = 0; j < n; j++)); do
        "$KVASIR" experts --plan "$RING_PLAN" --index "$j" >"$dir/agent$j.log" 2>&1 &
        PIDS+=($!)
        AGENT_PIDS+=($!)
    done
    for ((j = 0; j < n; j++)); do
        for i in $(seq 100); do
            [ "$(grep -c linked "$dir/agent$j.log" 2>/dev/null)" -ge 2 ] && break
            sleep 0.1
        done
        [ "$(grep -c linked "$dir/agent$j.log" 2>/dev/null)" -ge 2 ] ||
            { cat "$dir/agent$j.log"; fail "agent $j did not link both stages"; }
    done
}

# stop_agents N WHAT: stop the ring and its N agents; each agent must have computed pairs,
# and no stage may have lost one (else the stages computed those pairs themselves).
stop_agents() {
    local n=$1 what=$2 j dir pairs
    dir=$(dirname "$RING_PLAN")
    stop_ring
    for p in "${AGENT_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${AGENT_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    for ((j = 0; j < n; j++)); do
        pairs=$(sed -n 's/.*stopping after [0-9]* frames, \([0-9]*\) pairs.*/\1/p' "$dir/agent$j.log")
        [ -n "$pairs" ] && [ "$pairs" -gt 0 ] ||
            { tail -5 "$dir/agent$j.log"; fail "$what: agent $j computed no pairs"; }
        echo "   agent $j computed $pairs pairs"
    done
    ! grep -h "expert agent .* lost" "$dir"/stage*.log || fail "$what: a stage lost an agent"
}

# run_prompts TAG: $TMP/prompts.jsonl through the ring of $RING_PLAN (60 s at most), the
# answers to $TMP/TAG.jsonl.
run_prompts() {
    timeout 60 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
        --ignore-eos >"$TMP/$1.jsonl" 2>"$TMP/$1.log" || { cat "$TMP/$1.log"; fail "$1: ring run"; }
}

# start_silent_peers HOST:PORT: from now on a new connection to it every 200 ms, each held
# open for 5 s without sending a byte (a would-be peer that never does its handshake), until
# stop_silent_peers.
start_silent_peers() {
    local host=${1%:*} port=${1##*:}
    rm -f "$TMP/stop-peers"
    (
        while [ ! -e "$TMP/stop-peers" ]; do
            (exec 3<>"/dev/tcp/$host/$port" && sleep 5) 2>/dev/null &
            sleep 0.2
        done
        wait
    ) &
    SILENT_PID=$!
    PIDS+=("$SILENT_PID")
}
stop_silent_peers() {
    touch "$TMP/stop-peers"
    wait "$SILENT_PID" || true
}

# run_with_silent_peers HOST:PORT: the prompts again (run_prompts during) while silent peers
# keep connecting to HOST:PORT (from a second before the run to its end); the answers must
# be exactly those of run_prompts before. Prints how long the run took.
run_with_silent_peers() {
    start_silent_peers "$1"
    sleep 1 # a few peers are waiting in handshakes before the run starts
    local t0 ms
    t0=$(date +%s%N)
    run_prompts during
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    stop_silent_peers
    cmp -s "$TMP/before.jsonl" "$TMP/during.jsonl" ||
        { diff "$TMP/before.jsonl" "$TMP/during.jsonl" | head; fail "tokens differ with silent peers"; }
    echo "run with silent peers connecting to $1: $ms ms"
}

# skip_or_fail WHY: skip the test (exit 77), or fail it under CI=true, where every tool the
# test needs is installed.
skip_or_fail() {
    [ "${CI:-}" = true ] && fail "$* (required under CI)"
    echo "SKIP: $*"
    exit 77
}

# npm_pinned DIR PACKAGE: Node.js >= 18 is there and DIR/node_modules holds PACKAGE at the
# version DIR/package-lock.json pins (installed with `npm ci` when it does not), or the test
# is skipped (failed under CI).
npm_pinned() {
    local dir=$1 pkg=$2 pinned installed
    command -v node >/dev/null || skip_or_fail "node is not installed"
    [ "$(node -p 'process.versions.node.split(".")[0]')" -ge 18 ] ||
        skip_or_fail "Node.js $(node --version) is older than 18"
    pinned=$(node -p "require(process.argv[1]).packages['node_modules/$pkg'].version" \
        "$dir/package-lock.json")
    installed=$(node -p 'try { require(process.argv[1]).version } catch { "" }' \
        "$dir/node_modules/$pkg/package.json" 2>/dev/null || true)
    [ "$installed" = "$pinned" ] && return 0
    command -v npm >/dev/null || skip_or_fail "npm is not installed (needed for $pkg)"
    echo "installing $pkg $pinned with npm ci"
    (cd "$dir" && timeout 300 npm ci --no-audit --no-fund >"$TMP/npm.log" 2>&1) || {
        tail -20 "$TMP/npm.log"
        skip_or_fail "npm ci failed (no registry?)"
    }
}

# peer_tool NAME: the path of the peer's llama.cpp program NAME (need_shared: skip or fail
# without it), with its libraries made loadable: the shared copy stores their symlinks as
# small text files naming the target, rebuilt here as links in $TMP/peerlib, which goes
# first on LD_LIBRARY_PATH. Run it in the test's shell, not in $(...), for the export.
peer_tool() {
    local bin dir f b
    bin=$SHARED/peers/llama.cpp/bin/$1
    [ -r "$bin" ] || need_shared "peers/llama.cpp/bin/$1" # skips or fails
    dir=$(dirname "$bin")/..
    if [ ! -d "$TMP/peerlib" ]; then
        mkdir -p "$TMP/peerlib"
        for f in "$dir"/lib/*; do
            b=$(basename "$f")
            if [ "$(stat -c %s "$f")" -lt 256 ] && ! LC_ALL=C grep -q $'\x7fELF' "$f"; then
                ln -s "$dir/lib/$(cat "$f")" "$TMP/peerlib/$b"
            else
                ln -s "$f" "$TMP/peerlib/$b"
            fi
        done
        export LD_LIBRARY_PATH="$TMP/peerlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    PEER_TOOL=$bin
}
