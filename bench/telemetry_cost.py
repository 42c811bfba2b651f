#!/usr/bin/env python3
"""bench/telemetry_cost.py - what the console's telemetry stream costs the bridge.

    bench/telemetry_cost.py [--kvasir BIN] [-m MODEL] [--stages 2] [--streams 32]
                            [--seconds 12] [--pairs 5] [--interval-ms 250]

The bridge is `kvasir serve`'s own process (the scheduler, HTTP and every stream's thread;
the stages are its children, other processes): its CPU time (/proc/PID/stat utime + stime)
is the denominator. Starts serve and keeps STREAMS streaming completions running (`kvasir
bench --concurrency`); then, in turns of SECONDS, with no telemetry client and with one
reading GET /v1/telemetry at the console page's rate (--interval-ms, 250 as the page asks),
it measures serve's CPU time and the tokens generated (kvasir:generation_tokens_total), and
prints two measures of the stream's cost:

  with - without: serve's CPU per 1,000 tokens with the stream over that without, minus 1,
      per pair (phases alternate off/on, on/off), and the median. This is the issue's
      definition, but a shared machine moves a phase's CPU per token by several per cent.
  the stream's thread: the CPU time of the stream's connection thread
      (kvasir:telemetry_cpu_seconds_total: building, sending and sleeping between
      snapshots) over serve's CPU in the same phase, and per snapshot; the machine's noise
      moves it far less.

The default model is ring-45 Q8_0, synthesised into a temporary folder: small, so batches
come fast and the stream has the most to say. Stops everything it started.
"""
import argparse
import os
import re
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

import serve_util

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime, stime (after the state field)


def metric(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r"^kvasir:%s(?:\{[^}]*\})? (\S+)$" % name, text, re.M)
    return float(m.group(1)) if m else 0.0


def tokens(url):
    return metric(url, "generation_tokens_total")


class Reader(threading.Thread):
    """Reads /v1/telemetry until stopped; counts snapshots and bytes."""

    def __init__(self, url, interval_ms):
        super().__init__(daemon=True)
        host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.sendall(b"GET /v1/telemetry?interval_ms=%d HTTP/1.1\r\nHost: %s\r\n\r\n"
                          % (interval_ms, host.encode()))
        self.snapshots = 0
        self.bytes = 0
        self.stop = False

    def run(self):
        while not self.stop:
            try:
                chunk = self.sock.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            self.bytes += len(chunk)
            self.snapshots += chunk.count(b"event: snapshot")

    def close(self):
        self.stop = True
        self.sock.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvasir", default=os.path.join(ROOT, "build", "kvasir"))
    ap.add_argument("-m", "--model", default="")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=12)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--interval-ms", type=int, default=250)  # as the page asks
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvr-telemetry-cost.")
    model = args.model or os.path.join(tmp, "ring45.gguf")
    if not args.model:
        subprocess.run([args.kvasir, "synth", "--shape", "ring-45", "--type", "q8_0", "-o", model],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = os.path.join(tmp, "serve.log")
    serve, url = serve_util.start_server(
        args.kvasir, ["-m", model, "--stages", str(args.stages), "--max-seqs", str(args.streams),
                      "--ctx", "512", "--no-admission"], log, who="telemetry_cost")
    load = None
    try:
        total_s = int(args.seconds * 2 * args.pairs + 30)
        load = subprocess.Popen([args.kvasir, "bench", "--url", url, "-m", model, "--concurrency",
                                 str(args.streams), "--duration", str(total_s), "--prompt-len", "32",
                                 "--output-len", "128", "--quiet"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(8)  # the streams start and the cost model settles
        costs, shares, per_snap = [], [], []
        for p in range(args.pairs):
            res = {}
            for phase in (("off", "on") if p % 2 == 0 else ("on", "off")):
                reader = Reader(url, args.interval_ms) if phase == "on" else None
                if reader:
                    reader.start()
                    time.sleep(1)
                tel0 = metric(url, "telemetry_cpu_seconds_total")
                snaps0 = reader.snapshots if reader else 0
                c0, t0, w0 = cpu_s(serve.pid), tokens(url), time.monotonic()
                time.sleep(args.seconds)
                c1, t1, w1 = cpu_s(serve.pid), tokens(url), time.monotonic()
                tel = metric(url, "telemetry_cpu_seconds_total") - tel0
                snaps = (reader.snapshots - snaps0) if reader else 0
                if reader:
                    reader.close()
                per_k = 1000.0 * (c1 - c0) * 1000.0 / max(t1 - t0, 1.0)
                res[phase] = per_k
                print("pair %d %-3s: serve CPU %.2f s over %.1f s (%.1f %% of a core), %d tokens, "
                      "%.1f CPU ms per 1,000 tokens%s"
                      % (p + 1, phase, c1 - c0, w1 - w0, 100 * (c1 - c0) / (w1 - w0), t1 - t0, per_k,
                         ", %d snapshots read" % snaps if reader else ""), flush=True)
                if reader:
                    shares.append(tel / max(c1 - c0, 1e-9))
                    per_snap.append(tel / max(snaps, 1))
                    print("pair %d on : the stream's thread used %.4f s CPU = %.2f %% of serve's, "
                          "%.0f us per snapshot" % (p + 1, tel, 100 * shares[-1], 1e6 * per_snap[-1]),
                          flush=True)
            costs.append(res["on"] / res["off"] - 1)
            print("pair %d: with / without the stream %+.2f %%" % (p + 1, 100 * costs[-1]), flush=True)
        print("with - without, serve CPU per token, %d streams, one client at %d ms: %s; median "
              "%+.2f %%" % (args.streams, args.interval_ms,
                            ", ".join("%+.1f %%" % (100 * c) for c in costs),
                            100 * statistics.median(costs)))
        print("the stream's thread CPU / serve CPU: %s; median %.2f %% (%.0f us per snapshot)"
              % (", ".join("%.2f %%" % (100 * x) for x in shares), 100 * statistics.median(shares),
                 1e6 * statistics.median(per_snap)))
    finally:
        if load:
            load.kill()
            load.wait()
        serve_util.stop_server(serve)


main()
