#!/usr/bin/env python3
"""bench/burst.py - a burst of concurrent chat requests against admission, and without it.

    bench/burst.py [--kvasir BIN] [-m MODEL] [--stages 2] [-n 40] [--max-tokens 64]
                   [--runs 3] [--threads N] [--no-warmup]

For each of RUNS rounds, starts `kvasir serve` on 127.0.0.1 twice, with admission (the
default) and with --no-admission, and sends N chat completions at once (each a different
short question, max_tokens MAX_TOKENS, default budgets). Prints per server: refused (429
with their reasons), finished, first-token and whole-answer times (median, max) and the
wall time of the burst. Before the burst each server answers one short chat, as a server in
use has: admission estimates nothing until its cost model has seen a few batches, so a burst
at a server that never ran one is admitted whole (--no-warmup sends it all the same).
--max-tokens 0 sends no max_tokens (the rest of the context). Admission is right when it refuses nothing that --no-admission
finishes within the default budgets (first token 60 s, whole answer 600 s). The default
model is the README's (scripts/serve.sh's): models/tinyllama-1.1b-q4_0.gguf, synthesised
when missing. Stops every server it started.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import serve_util

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIRST_BUDGET_S, TOTAL_BUDGET_S = 60.0, 600.0


def start_server(args, log_path, extra):
    serve = ["-m", args.model, "--stages", str(args.stages)]
    if args.threads:
        serve += ["--threads", str(args.threads)]
    return serve_util.start_server(args.kvasir, serve + extra, log_path, who="burst")


def one_chat(url, i, max_tokens, out):
    msg = {"messages": [{"role": "user", "content": "Question %d: what is %d + %d?" % (i, i, 7 * i)}],
           "stream": True}
    if max_tokens > 0:
        msg["max_tokens"] = max_tokens
    body = json.dumps(msg).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    rec = {"status": None, "first": None, "total": None, "reason": None, "message": None,
           "retry_after": None}
    try:
        with urllib.request.urlopen(req, timeout=TOTAL_BUDGET_S + 60) as r:
            rec["status"] = r.status
            for line in r:
                if line.startswith(b"data: {") and rec["first"] is None:
                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                    if delta.get("content"):  # the first chunk only names the role
                        rec["first"] = time.monotonic() - t0
                if line.startswith(b"data: [DONE]"):
                    break
        rec["total"] = time.monotonic() - t0
    except urllib.error.HTTPError as e:
        rec["status"] = e.code
        rec["retry_after"] = e.headers.get("Retry-After")
        try:
            err = json.loads(e.read())["error"]
            rec["reason"], rec["message"] = err.get("code"), err.get("message")
        except Exception:
            rec["reason"] = "?"
    except Exception as e:  # a dropped connection is a failure, not a refusal
        rec["status"] = -1
        rec["reason"] = str(e)
    out[i] = rec


def burst(url, n, max_tokens):
    out = [None] * n
    threads = [threading.Thread(target=one_chat, args=(url, i, max_tokens, out)) for i in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.monotonic() - t0


def summary(name, out, wall):
    done = [r for r in out if r["status"] == 200 and r["total"] is not None]
    refused = [r for r in out if r["status"] == 429 or r["status"] == 503]
    failed = [r for r in out if r not in done and r not in refused]
    late = [r for r in done if r["first"] is None or r["first"] > FIRST_BUDGET_S or r["total"] > TOTAL_BUDGET_S]
    reasons = {}
    for r in refused:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    firsts = [r["first"] for r in done if r["first"] is not None]
    totals = [r["total"] for r in done]
    print("  %-13s finished %2d (late %d), refused %2d %s, failed %d; first token median %.1f s max %.1f s;"
          " whole median %.1f s max %.1f s; burst %.1f s"
          % (name, len(done), len(late), len(refused), reasons or "", len(failed),
             statistics.median(firsts) if firsts else 0, max(firsts) if firsts else 0,
             statistics.median(totals) if totals else 0, max(totals) if totals else 0, wall), flush=True)
    for r in refused[:3]:
        print("    refused: %s (Retry-After %s)" % (r["message"], r["retry_after"]), flush=True)
    return len(done), len(late), len(refused)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvasir", default=os.path.join(ROOT, "build", "kvasir"))
    ap.add_argument("-m", "--model", default=serve_util.DEFAULT_MODEL)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("-n", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true")
    args = ap.parse_args()
    serve_util.ensure_model(args.kvasir, args.model)
    tmp = tempfile.mkdtemp(prefix="kvr-burst.")
    verdicts = []
    for run in range(1, args.runs + 1):
        print("run %d: %d chats at once, max_tokens %d" % (run, args.n, args.max_tokens), flush=True)
        res = {}
        for name, extra in (("admission", []), ("no-admission", ["--no-admission"])):
            proc, url = start_server(args, os.path.join(tmp, "serve-%s.log" % name), extra)
            try:
                if not args.no_warmup:
                    warm = [None]
                    one_chat(url, 0, 8, warm)
                    if warm[0]["status"] != 200:
                        sys.exit("burst: the warm-up request failed: %s" % warm[0])
                out, wall = burst(url, args.n, args.max_tokens)
                res[name] = summary(name, out, wall)
            finally:
                serve_util.stop_server(proc)
        done_na, late_na, _ = res["no-admission"]
        _, _, refused = res["admission"]
        ok = not (done_na == args.n and late_na == 0 and refused > 0)
        verdicts.append(ok)
        print("  verdict: %s" % ("ok" if ok else "admission refused requests that --no-admission served on budget"))
    print("burst: %d of %d runs ok" % (sum(verdicts), len(verdicts)))
    sys.exit(0 if all(verdicts) else 1)


main()
