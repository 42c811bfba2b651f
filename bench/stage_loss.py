#!/usr/bin/env python3
"""bench/stage_loss.py - the pause a streaming client sees when a stage is SIGKILLed.

    bench/stage_loss.py [--kvasir BIN] [-m MODEL] [--stages 3] [--kill 1] [--runs 10]
                        [--tokens 160] [--threads N]

Starts `kvasir serve` (which restarts a stage that dies) on 127.0.0.1, then RUNS times:
streams one greedy completion (ignore_eos, TOKENS tokens), SIGKILLs stage KILL (a middle
stage by default) once 40 tokens have arrived, and measures on the client's clock the
longest silence between tokens after the kill (tokens already past the dead stage may still
arrive first), beside the stream's median gap between tokens before the kill. Between runs it waits until /health says the ring is whole. Prints each run, then the
median and the largest pause. The default model is the README's (scripts/serve.sh's):
models/tinyllama-1.1b-q4_0.gguf, synthesised when missing. Stops everything it started.
"""
import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def start_server(args, log_path):
    cmd = [args.kvasir, "serve", "-m", args.model, "--stages", str(args.stages), "--port", "0",
           "--no-admission"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(log_path) as f:
            m = re.search(r"^kvasir: ready on (http://\S+)$", f.read(), re.M)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    sys.exit("stage_loss: the server did not start:\n" + open(log_path).read())


def stage_pid(server_pid, index):
    out = subprocess.run(["pgrep", "-P", str(server_pid), "-f", r"stage --plan .* --index %d( |$)" % index],
                         capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def wait_whole(url, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except Exception:
            pass
        time.sleep(0.1)
    return False


def stream_once(url, tokens, on_token):
    """Streams one completion; calls on_token(n) after each token event; returns the
    arrival times (time.monotonic()) of the token events."""
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(body)) + body)
    times, buf = [], b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        now = time.monotonic()
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.startswith(b"data: {"):
                times.append(now)
                on_token(len(times))
            elif line.startswith(b"data: [DONE]"):
                s.close()
                return times
    s.close()
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvasir", default=os.path.join(ROOT, "build", "kvasir"))
    ap.add_argument("-m", "--model", default=os.path.join(ROOT, "models", "tinyllama-1.1b-q4_0.gguf"))
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--kill", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if not os.path.exists(args.model):
        os.makedirs(os.path.dirname(args.model), exist_ok=True)
        subprocess.run([args.kvasir, "synth", "--shape", "tinyllama-1.1b", "--type", "q4_0",
                        "-o", args.model], check=True, stdout=subprocess.DEVNULL)
    tmp = tempfile.mkdtemp(prefix="kvr-stage-loss.")
    proc, url = start_server(args, os.path.join(tmp, "serve.log"))
    pauses = []
    try:
        for run in range(1, args.runs + 1):
            if not wait_whole(url):
                sys.exit("stage_loss: the ring was not whole within 60 s")
            kill = {}

            def on_token(n):
                if n == 40 and not kill:
                    pid = stage_pid(proc.pid, args.kill)
                    if pid is None:
                        sys.exit("stage_loss: no stage %d under the server" % args.kill)
                    kill["t"] = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
            times = stream_once(url, args.tokens, on_token)
            if len(times) != args.tokens or "t" not in kill:
                sys.exit("stage_loss: run %d: %d of %d tokens, kill %s" % (run, len(times), args.tokens, kill))
            after = [t for t in times if t > kill["t"]]
            before = times[:40]
            gap = statistics.median(b - a for a, b in zip(before, before[1:]))
            # The pause is the longest silence after the kill: tokens already past the dead
            # stage may still arrive at once, the stall comes after them.
            marks = [kill["t"]] + after
            pause = max(b - a for a, b in zip(marks, marks[1:]))
            pauses.append(pause)
            print("run %2d: longest silence after the kill %6.0f ms (median gap before %.0f ms)"
                  % (run, pause * 1e3, gap * 1e3), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log = open(os.path.join(tmp, "serve.log")).read()
        wholes = re.findall(r"ring whole again.*", log)
        if wholes:
            print("server: " + wholes[-1])
    print("stage %d of %d killed %d times: pause median %.0f ms, max %.0f ms"
          % (args.kill, args.stages, len(pauses), statistics.median(pauses) * 1e3, max(pauses) * 1e3))


main()
