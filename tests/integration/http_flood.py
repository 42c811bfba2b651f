#!/usr/bin/env python3
"""http_flood.py - hold a server's door with idle and trickling connections while checking
that /health and an authenticated chat request still get through (issue 34, acceptance 2).

usage: http_flood.py PORT KEY OUT_JSON [--idle N] [--trickle N] [--addrs N]
                     [--trickle-every S] [--seconds S] [--every S]

The flooder holds N idle connections (connect, send nothing) and N trickling ones (a
request line, then one header line every S seconds, never the blank line) from source
addresses 127.0.0.2 .. 127.0.0.(1+addrs) (all of 127/8 is loopback on Linux), and reopens
any the server closes, at most 200 a second. Meanwhile, every `every` seconds for `seconds`
seconds, it asks GET /health and POST /v1/chat/completions (max_tokens 2, the key) from
127.0.0.1, each with a 1 s timeout, and records how long each took. It writes the numbers
to OUT_JSON and exits 0; the caller judges them. Bounded: it stops by itself.
"""
import argparse
import http.client
import json
import resource
import selectors
import socket
import sys
import threading
import time

REOPEN_PER_S = 200


class Flood:
    def __init__(self, port, n_idle, n_trickle, n_addrs, trickle_every):
        self.port = port
        self.trickle_every = trickle_every
        self.sel = selectors.DefaultSelector()
        # slot -> (socket or None, kind, next time to act)
        self.slots = [["idle", None, 0.0] for _ in range(n_idle)]
        self.slots += [["trickle", None, 0.0] for _ in range(n_trickle)]
        self.addrs = [f"127.0.0.{2 + i}" for i in range(n_addrs)]
        self.opened = self.closed_by_server = self.failed = 0
        self.stop = False

    def open(self, i, now):
        kind = self.slots[i][0]
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((self.addrs[i % len(self.addrs)], 0))
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", self.port))
        except OSError:
            s.close()
            self.failed += 1
            self.slots[i][2] = now + 0.5
            return
        self.slots[i][1] = s
        self.slots[i][2] = now + (self.trickle_every if kind == "trickle" else 1e9)
        self.sel.register(s, selectors.EVENT_READ, i)
        self.opened += 1
        if kind == "trickle":
            try:
                s.send(b"GET /health HTTP/1.1\r\n")
            except OSError:
                pass

    def drop(self, i, now):
        s = self.slots[i][1]
        if s is not None:
            self.sel.unregister(s)
            s.close()
        self.slots[i][1] = None
        self.slots[i][2] = now + 0.5  # reopen it in half a second

    def run(self):
        budget, budget_t = REOPEN_PER_S, time.monotonic()
        while not self.stop:
            now = time.monotonic()
            if now - budget_t >= 1:
                budget, budget_t = REOPEN_PER_S, now
            for i, (kind, s, t) in enumerate(self.slots):
                if now < t:
                    continue
                if s is None:
                    if budget > 0:
                        budget -= 1
                        self.open(i, now)
                elif kind == "trickle":
                    try:
                        s.send(b"X-Trickle: %d\r\n" % int(now))
                    except OSError:
                        pass
                    self.slots[i][2] = now + self.trickle_every
            for key, _ in self.sel.select(timeout=0.05):
                i = key.data
                try:
                    data = key.fileobj.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # closed by the server
                    self.closed_by_server += 1
                    self.drop(i, now)
        for i in range(len(self.slots)):
            self.drop(i, time.monotonic())

    def held(self):
        return sum(1 for slot in self.slots if slot[1] is not None)


def timed(fn):
    t0 = time.monotonic()
    try:
        ok = fn()
    except Exception as e:  # a refused or reset connection, a timeout
        ok = f"{type(e).__name__}: {e}"
    return ok, (time.monotonic() - t0) * 1000


def health(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    c.request("GET", "/health")
    r = c.getresponse()
    r.read()
    c.close()
    return True if r.status == 200 else f"status {r.status}"


def chat(port, key):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    c.request("POST", "/v1/chat/completions", body,
              {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        return f"status {r.status}: {data[:200]!r}"
    return True if json.loads(data)["choices"][0]["message"]["content"] is not None else "no text"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("key")
    ap.add_argument("out")
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--trickle", type=int, default=256)
    ap.add_argument("--addrs", type=int, default=40)
    ap.add_argument("--trickle-every", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--every", type=float, default=0.2)
    ap.add_argument("--warmup", type=float, default=3)
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = a.idle + a.trickle + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))

    flood = Flood(a.port, a.idle, a.trickle, a.addrs, a.trickle_every)
    th = threading.Thread(target=flood.run)
    th.start()
    time.sleep(a.warmup)  # every connection opened once before the checks start
    held_at_start = flood.held()
    checks = []
    t_end = time.monotonic() + a.seconds
    next_t = time.monotonic()
    while time.monotonic() < t_end:
        h_ok, h_ms = timed(lambda: health(a.port))
        c_ok, c_ms = timed(lambda: chat(a.port, a.key))
        checks.append({"health_ok": h_ok, "health_ms": h_ms, "chat_ok": c_ok, "chat_ms": c_ms,
                       "held": flood.held()})
        next_t += a.every
        time.sleep(max(0.0, next_t - time.monotonic()))
    flood.stop = True
    th.join()
    bad = [c for c in checks
           if c["health_ok"] is not True or c["chat_ok"] is not True
           or c["health_ms"] > 1000 or c["chat_ms"] > 1000]
    res = {
        "checks": len(checks),
        "bad": bad[:10],
        "n_bad": len(bad),
        "worst_health_ms": max(c["health_ms"] for c in checks),
        "worst_chat_ms": max(c["chat_ms"] for c in checks),
        "median_health_ms": sorted(c["health_ms"] for c in checks)[len(checks) // 2],
        "median_chat_ms": sorted(c["chat_ms"] for c in checks)[len(checks) // 2],
        "held_at_start": held_at_start,
        "min_held": min(c["held"] for c in checks),
        "opened": flood.opened,
        "closed_by_server": flood.closed_by_server,
        "connect_failures": flood.failed,
    }
    json.dump(res, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
