#!/usr/bin/env bash
# The first hour at the command line: `kvasir --version`; llama.cpp and vLLM spellings
# (`kvasir serve MODEL`, -c/--ctx-size/--max-model-len, -t, --parallel,
# --served-model-name, --opt=value); GPU options answered with one line each and their
# values consumed; an unknown option answered with the nearest known one, not the whole
# help, in serve, bridge, run and stage; the context (the trained length by default, --ctx
# beyond it refused without RoPE scaling and warned with it) and the threads in the start
# line, and no "Connection refused" on a healthy start; the API key kept out of `ps` and read from --api-key-file; `kvasir top` naming a
# 401 and quitting on q; serve's plan and key in the per-user runtime directory, and a
# killed server's directory removed by the next start.
set -euo pipefail
source "$(dirname "$0")/lib.bash"

# expect STATUS PATTERN CMD...: the command exits with STATUS and its stderr matches PATTERN.
expect() {
    local want=$1 pattern=$2 rc=0
    shift 2
    timeout 20 "$@" >"$TMP/stdout" 2>"$TMP/stderr" || rc=$?
    [ "$rc" -eq "$want" ] || fail "$* exited $rc, want $want: $(cat "$TMP/stderr")"
    grep -q -- "$pattern" "$TMP/stderr" || fail "$*: stderr lacks '$pattern': $(cat "$TMP/stderr")"
}

"$KVASIR" synth --shape tiny --seed 3 -o "$TMP/tiny.gguf" >/dev/null 2>&1 || fail "synth tiny"
"$KVASIR" synth --shape tiny --seed 3 --rope-scale 4 -o "$TMP/scaled.gguf" >/dev/null 2>&1 ||
    fail "synth scaled"
m=$TMP/tiny.gguf

# --version, at the top and in a subcommand.
for cmd in "--version" "serve --version" "run --version"; do
    # shellcheck disable=SC2086
    out=$("$KVASIR" $cmd) || fail "kvasir $cmd failed"
    [[ $out == "kvasir "[0-9]*" (CPU build)" ]] || fail "kvasir $cmd: '$out'"
done
echo "ok: --version: $out"

# Did you mean: one line, the nearest option, no help text.
expect 2 "unknown option '--ctx-sise'; did you mean '--ctx-size'?" "$KVASIR" serve "$m" --ctx-sise 5
[ "$(wc -l <"$TMP/stderr")" = 1 ] || fail "an unknown option printed more than one line"
expect 2 "unknown option '--treads'; did you mean '--threads'?" "$KVASIR" serve "$m" --treads 2
expect 2 "unknown option '--replan-aftr'; did you mean '--replan-after'?" "$KVASIR" bridge \
    --replan-aftr 3
expect 2 "unknown option '--prmpt'; did you mean '--prompt'?" "$KVASIR" run -m "$m" --prmpt x
expect 2 "unknown option '--indx'; did you mean '--index'?" "$KVASIR" stage --indx 0
expect 2 "unknown option '--frobnicate' (kvasir serve --help lists" "$KVASIR" serve "$m" \
    --frobnicate 1
echo "ok: unknown options answered with one line and the nearest option"

# GPU options: one line each, the value consumed (the next option still parses).
expect 0 "this build runs on the CPU; -ngl 99 is ignored" "$KVASIR" serve "$m" -ngl 99 \
    --n-gpu-layers=33 --tensor-parallel-size 2 --device cuda:0 --help
grep -q -- "--n-gpu-layers 33 is ignored" "$TMP/stderr" || fail "--n-gpu-layers=33: $(cat "$TMP/stderr")"
[ "$(wc -l <"$TMP/stderr")" = 4 ] || fail "GPU options: $(cat "$TMP/stderr")"
grep -q "^usage: kvasir serve" "$TMP/stdout" || fail "the option after the GPU options was lost"
expect 0 "this build runs on the CPU; --gpu-layers 10 is ignored" "$KVASIR" run -m "$m" -p hi \
    -n 2 -q --gpu-layers 10 --ctx-size 64
echo "ok: GPU options ignored with one line each"

# Context honesty: beyond the trained length (512) without RoPE scaling: refused; with
# linear scaling by 4: a warning up to 4 x 512, refused beyond.
export XDG_RUNTIME_DIR=$TMP/run
mkdir -m 0700 "$XDG_RUNTIME_DIR"
expect 1 "--ctx 100000 is beyond the 512 positions this model was trained for" "$KVASIR" serve \
    "$m" --ctx 100000 --port 0
expect 1 "give --ctx 2048 or less" "$KVASIR" serve "$TMP/scaled.gguf" --max-model-len 4096 \
    --port 0
expect 1 "give --ctx 512 or less" "$KVASIR" plan -m "$m" --stages 2 --ctx 100000 \
    -o "$TMP/plan.json"
[ ! -e "$TMP/plan.json" ] || fail "kvasir plan wrote a plan with --ctx 100000"
# ... unless asked for knowingly (as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN): then a warning.
KVASIR_ALLOW_LONG_CONTEXT=1 expect 0 "positions past them are untrained" "$KVASIR" plan -m "$m" \
    --stages 2 --ctx 1024 -o "$TMP/plan.json"
echo "ok: --ctx beyond the trained length refused"

base=$(reserve_base_port)
# start NAME ARGS...: `kvasir serve` in the background until its ready line; sets PID, URL.
start() {
    local name=$1 i
    shift
    "$KVASIR" serve "$@" --port 0 >"$TMP/$name.out" 2>"$TMP/$name.log" &
    PID=$!
    PIDS+=("$PID")
    for i in $(seq 300); do
        grep -q '^kvasir: ready on ' "$TMP/$name.out" && break
        kill -0 "$PID" 2>/dev/null || { cat "$TMP/$name.log"; fail "$name: serve exited"; }
        sleep 0.1
    done
    URL=$(sed -n 's/^kvasir: ready on //p' "$TMP/$name.out")
    [ -n "$URL" ] || { tail "$TMP/$name.log"; fail "$name: not ready in 30 s"; }
}
stop() { kill "$PID" && wait "$PID" 2>/dev/null || true; }

# Positional model, vLLM's and llama.cpp's spellings, a scaled context (warned), an inline
# key that `ps` does not show.
key=sk-test-$RANDOM$RANDOM
start a "$TMP/scaled.gguf" --max-model-len=1024 --parallel 4 --served-model-name tiny-x -t 1 \
    --api-key "$key" --base-port "$base"
grep -q "serve warn\] --ctx 1024 is beyond the 512 positions .* RoPE scaling (factor 4)" \
    "$TMP/a.log" || fail "no warning for a scaled context: $(grep warn "$TMP/a.log")"
grep -q "serving tiny-x on .* (2 stages, 1 thread each, context 1024 (--ctx; trained 512)" \
    "$TMP/a.log" || fail "start line: $(grep serving "$TMP/a.log")"
! tr '\0' ' ' <"/proc/$PID/cmdline" | grep -q -- "$key" || fail "the API key shows in ps"
curl -s -H "Authorization: Bearer $key" "$URL/v1/models" >"$TMP/models.json"
python3 - "$TMP/models.json" <<'EOF' || fail "/v1/models: $(cat "$TMP/models.json")"
import json, sys
m = json.load(open(sys.argv[1]))["data"][0]
assert m["id"] == "tiny-x" and m["max_model_len"] == 1024, m
EOF
python3 -c "import json,sys; p=json.load(open(sys.argv[1])); assert p['max_seqs'] == 4, p['max_seqs']" \
    "$XDG_RUNTIME_DIR/kvasir/serve-$PID/plan.json" || fail "--parallel 4 is not max_seqs 4"
echo "ok: serve MODEL --max-model-len=1024 --parallel 4 --served-model-name -t 1; key not in ps"

# kvasir top: a 401 is named; with the key it reads the ring.
rc=0
timeout 10 "$KVASIR" top --url "$URL" --once >"$TMP/top.txt" 2>&1 || rc=$?
[ "$rc" = 1 ] && grep -q "UNAUTHORIZED" "$TMP/top.txt" && grep -q "give --api-key" "$TMP/top.txt" ||
    fail "top without the key: rc $rc: $(cat "$TMP/top.txt")"
KVASIR_API_KEY=$key timeout 10 "$KVASIR" top --url "$URL" --once >"$TMP/top.txt" ||
    fail "top with the key: $(cat "$TMP/top.txt")"
# (Not under timeout, whose own command line would show the key: --count bounds it.)
"$KVASIR" top --url "$URL" --api-key "$key" --count 3 --interval 0.3 >"$TMP/top.txt" 2>&1 &
tp=$!
PIDS+=("$tp")
sleep 0.3
! tr '\0' ' ' <"/proc/$tp/cmdline" | grep -q -- "$key" || fail "top's --api-key shows in ps"
wait "$tp" || fail "top --api-key: $(cat "$TMP/top.txt")"
! grep -q UNAUTHORIZED "$TMP/top.txt" || fail "top's --api-key was not used as given"
# The live view on a terminal quits on q and leaves the terminal as it found it.
python3 - "$KVASIR" "$URL" "$key" <<'EOF' || fail "top did not quit on q"
import os, pty, select, sys, termios, time
kvasir, url, key = sys.argv[1:]
pid, fd = pty.fork()
if pid == 0:
    os.environ["KVASIR_API_KEY"] = key
    os.execv(kvasir, [kvasir, "top", "--url", url, "--interval", "0.2"])
out = b""
deadline = time.time() + 10
while b"ring" not in out and time.time() < deadline:  # the first frame
    if select.select([fd], [], [], 0.2)[0]:
        out += os.read(fd, 65536)
os.write(fd, b"q")
t0 = time.time()
while time.time() - t0 < 5:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    if select.select([fd], [], [], 0.1)[0]:
        try:
            os.read(fd, 65536)
        except OSError:
            pass
else:
    os.kill(pid, 9)
    sys.exit("still running 5 s after q")
lflag = termios.tcgetattr(fd)[3]
assert lflag & termios.ECHO and lflag & termios.ICANON, "terminal left raw"
assert os.WEXITSTATUS(status) == 0, status
print("ok: top quit %.0f ms after q; the terminal is restored" % ((time.time() - t0) * 1000))
EOF
stop

# A KV cache that holds fewer positions than the model was trained for sets the context.
start c "$m" --kv-blocks 8 --base-port "$base"
grep -q "context 128 (KV memory; trained 512)" "$TMP/c.log" ||
    fail "KV-capped start line: $(grep serving "$TMP/c.log")"
stop
echo "ok: context 128 (KV memory; trained 512) with --kv-blocks 8"

# --api-key-file; default threads (the cores over the stages) and context (trained length);
# then SIGKILL: the plan and its key stay behind in the runtime directory ...
printf '%s\n' "$key" >"$TMP/key"
start b -m "$m" --api-key-file "$TMP/key" --base-port "$base"
cores=$(nproc)
want=$((cores / 2 > 1 ? cores / 2 : 1))
grep -q "serving tiny.gguf on .* (2 stages, $want thread.* each, context 512 (trained length)" \
    "$TMP/b.log" || fail "default start line ($cores cores): $(grep serving "$TMP/b.log")"
# A healthy start logs no failed dial (the bridge dials stage 0 before it listens).
! grep -q "Connection refused" "$TMP/b.log" || fail "a healthy start logged: $(grep refused "$TMP/b.log")"
[ "$(curl -s -o /dev/null -w '%{http_code}' "$URL/v1/models")" = 401 ] || fail "no key: not 401"
[ "$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $key" "$URL/v1/models")" = 200 ] ||
    fail "the key from --api-key-file is refused"
dir=$XDG_RUNTIME_DIR/kvasir/serve-$PID
[ "$(stat -c %a "$XDG_RUNTIME_DIR/kvasir")" = 700 ] || fail "runtime directory not 0700"
[ -f "$dir/plan.key" ] || fail "no plan key in $dir: $(ls -la "$XDG_RUNTIME_DIR/kvasir")"
kill -9 "$PID"
wait "$PID" 2>/dev/null || true
[ -f "$dir/plan.key" ] || fail "the killed server's key is already gone?"
# ... and the next start removes them (here one that is then refused).
expect 1 "removed $dir, left by a server that no longer runs" "$KVASIR" serve "$m" --ctx 9999 \
    --port 0
[ ! -e "$dir" ] || fail "$dir is still there"
[ -z "$(ls "$XDG_RUNTIME_DIR/kvasir")" ] || fail "left: $(ls "$XDG_RUNTIME_DIR/kvasir")"
echo "ok: --api-key-file; default threads $want and context 512; a killed server's plan key removed by the next start"
echo "cli_options: ok"
