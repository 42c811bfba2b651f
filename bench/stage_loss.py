#!/usr/bin/env python3
"""bench/stage_loss.py - the pause a streaming client sees when a stage is SIGKILLed.

    bench/stage_loss.py [--kvasir BIN] [-m MODEL] [--stages 3] [--kill 1] [--runs 10]
                        [--tokens 160] [--threads N]

Starts `kvasir serve` (which restarts a stage that dies) on 127.0.0.1, then RUNS times:
streams one greedy completion (ignore_eos, TOKENS tokens), SIGKILLs stage KILL (a middle
stage by default) once 40 tokens have arrived, and measures on the client's clock the
longest silence between tokens after the kill (tokens already past the dead stage may still
arrive first), beside the stream's median gap between tokens before the kill. Between runs
it waits until /health says the ring is whole. The stage killed is the process listening on
the stage's address (a warm standby that took a stage's place is the stage from then on).

Each run's line also splits the pause, from the serve log (KVR_LOG=debug, set for the
server unless KVR_LOG is given), in milliseconds after the kill: when serve saw the stage
die, when a process listened on its address again (a restart's load, or a standby taking
over), when the bridge had the ring whole again, and how long the first batch after that
(the re-prefill of the held sequence, its rows) took to go round. Prints each run, then
the medians and the largest pause. --no-standby passes serve's option (a dead stage is then
restarted and reloads its layers). The default model is the README's (scripts/serve.sh's):
models/tinyllama-1.1b-q4_0.gguf, synthesised when missing. Stops everything it started.
"""
import argparse
import datetime
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

import serve_util

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def start_server(args, log_path):
    serve = ["-m", args.model, "--stages", str(args.stages), "--no-admission"]
    if args.threads:
        serve += ["--threads", str(args.threads)]
    if args.no_standby:
        serve += ["--no-standby"]
    env = dict(os.environ)
    env.setdefault("KVR_LOG", "debug")
    return serve_util.start_server(args.kvasir, serve, log_path, env=env, who="stage_loss")


def stage_pid(server_pid, index):
    """The pid of the process of the server's that listens on stage INDEX's address: the
    server's children that listen are its stages, in the order of their ports (a standby
    listens only once it has taken a stage's place)."""
    children = set(subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True,
                                  text=True).stdout.split())
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    listening = []
    for line in out.splitlines():
        m = re.search(r":(\d+)\s.*pid=(\d+),", line)
        if m and m.group(2) in children:
            listening.append((int(m.group(1)), int(m.group(2))))
    listening.sort()
    return listening[index][1] if index < len(listening) else None


def log_time(line):
    """A log line's time in seconds: "[  2451.964 tag level]" (monotonic) or an ISO
    wall-clock stamp; None if neither."""
    m = re.match(r"\[\s*(\S+)", line)
    if not m:
        return None
    try:
        return float(m.group(1))
    except ValueError:
        pass
    try:
        return datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def breakdown(text, kill_mono, kill_wall, index):
    """The serve log's account of one kill (text: the log from the kill on)."""
    out = {}
    whole_seen = False
    for line in text.splitlines():
        t = log_time(line)
        if t is None:
            continue
        ref = kill_mono if t < 1e8 else kill_wall
        ms = (t - ref) * 1e3
        if "died" not in out and re.search(r"serve warn\] stage %d died" % index, line):
            out["died"] = ms
        elif "listen" not in out and re.search(
                r"stage %d: (layers .* listening on|standby takes over)" % index, line):
            out["listen"] = ms
            out["how"] = "standby" if "standby" in line else "restart"
        elif not whole_seen and "ring whole again" in line:
            whole_seen = True
            out["whole"] = ms
        elif whole_seen and "reprefill" not in out:
            m = re.search(r"batch \d+, (\d+) rows, round trip ([\d.]+) ms", line)
            if m:
                out["rows"], out["reprefill"] = int(m.group(1)), float(m.group(2))
                break
    return out


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
    ap.add_argument("-m", "--model", default=serve_util.DEFAULT_MODEL)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--kill", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-standby", action="store_true")
    args = ap.parse_args()
    serve_util.ensure_model(args.kvasir, args.model)
    tmp = tempfile.mkdtemp(prefix="kvr-stage-loss.")
    log_path = os.path.join(tmp, "serve.log")
    proc, url = start_server(args, log_path)
    pauses, parts = [], []
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
                    kill["log_at"] = os.path.getsize(log_path)
                    kill["wall"] = time.time()
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
            time.sleep(0.2)  # the log lines of the last batches
            with open(log_path) as f:
                f.seek(kill["log_at"])
                b = breakdown(f.read(), kill["t"], kill["wall"], args.kill)
            parts.append(b)
            fmt = lambda k: "%5.0f" % b[k] if k in b else "    ?"
            print("run %2d: longest silence after the kill %6.0f ms (median gap before %.0f ms);"
                  " died %s, listening %s (%s), ring whole %s, re-prefill %s ms (%s rows)"
                  % (run, pause * 1e3, gap * 1e3, fmt("died"), fmt("listen"), b.get("how", "?"),
                     fmt("whole"), fmt("reprefill"), b.get("rows", "?")), flush=True)
    finally:
        serve_util.stop_server(proc)
        log = open(os.path.join(tmp, "serve.log")).read()
        wholes = re.findall(r"ring whole again.*", log)
        if wholes:
            print("server: " + wholes[-1])
    print("stage %d of %d killed %d times: pause median %.0f ms, max %.0f ms"
          % (args.kill, args.stages, len(pauses), statistics.median(pauses) * 1e3, max(pauses) * 1e3))
    med = lambda k: ("%.0f" % statistics.median(p[k] for p in parts if k in p)
                     if any(k in p for p in parts) else "?")
    print("medians after the kill (ms): died %s, listening %s, ring whole %s; re-prefill %s ms"
          % (med("died"), med("listen"), med("whole"), med("reprefill")))


main()
