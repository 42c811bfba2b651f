#!/usr/bin/env python3
"""bench/spec.py - speculation through the ring (issue 37): tokens/s of one sequence with
`--spec auto` against `--spec off`, by how good its prediction is, and the aggregate of many
sequences at once (the policy must back off).

    bench/spec.py [--kvasir BIN] [-m MODEL] [--stages 2] [-n 256] [--streams 32]
                  [--stream-tokens 64] [--runs 3] [--ctx 1024]

Starts one ring (`kvasir plan`, one `kvasir stage` per stage, 1 thread each) and sends
prompts through it with `kvasir run --plan` (a bridge of its own per run, so no run learns
from another's answers). One greedy sequence of N tokens with --spec off gives the true
answer's token ids and the baseline; then the same sequence with --spec auto and, as its
prediction (`prediction_ids`, what the HTTP API's `prediction` text becomes once
tokenized), the true answer, the true answer with its second half replaced by other ids,
and a useless one (unrelated ids); every answer must be the true one. Then STREAMS
sequences of STREAM_TOKENS tokens at once, no prediction, off and auto. Rates are what
`kvasir run` reports (generated tokens over the run's wall time); each setting runs RUNS
times, alternating, and the median is printed with every run's number. The default model
is the README's (models/tinyllama-1.1b-q4_0.gguf, synthesised when missing). Run it under
the bench lock: flock /work/bench.lock bench/spec.py

    bench/spec.py --lookup [-m MODEL] [--stages 2] [-n 48] [--runs 3]

The sources without a prediction, over HTTP (`kvasir serve`, --spec off then auto): an
input-grounded prompt (a story, then its first words again: the answer copies it) and one
prompt sent four times in a row (the suffix source learns the first answer). Prints the
decode rates (tokens after the first over the time after the first) and each source's kept
/ drafted tokens from /metrics.
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request

import serve_util

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def start_ring(args, tmp):
    plan = os.path.join(tmp, "plan.json")
    base = 10000 + random.randrange(22000)
    subprocess.run([args.kvasir, "plan", "-m", args.model, "--stages", str(args.stages),
                    "--base-port", str(base), "--ctx", str(args.ctx),
                    "--max-seqs", str(max(32, args.streams)), "-o", plan],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [subprocess.Popen([args.kvasir, "stage", "--plan", plan, "--index", str(i)],
                              stdout=open(os.path.join(tmp, "stage%d.log" % i), "w"),
                              stderr=subprocess.STDOUT) for i in range(args.stages)]
    return plan, procs


def run(args, plan, tmp, jobs, mode):
    """The jobs (dicts for --prompts) through the ring: (answers' ids, tokens/s, stderr)."""
    path = os.path.join(tmp, "prompts.jsonl")
    with open(path, "w") as f:
        for j in jobs:
            f.write(json.dumps(j) + "\n")
    p = subprocess.run([args.kvasir, "run", "--plan", plan, "--prompts", path, "--json",
                        "--ignore-eos", "-q", "--spec", mode],
                       capture_output=True, text=True, timeout=3600)
    if p.returncode:
        raise SystemExit("spec: kvasir run failed:\n" + p.stderr)
    ids = [json.loads(line)["ids"] for line in p.stdout.splitlines() if line.startswith("{")]
    rate = float(re.search(r"([0-9.]+) tokens/s", p.stderr).group(1))
    return ids, rate, p.stderr


def kept(log):
    """(kept, drafted, decode rows with drafts) over every source, from kvasir run's
    summary."""
    k = d = r = 0
    for m in re.finditer(r"speculation, \w+: (\d+) drafted tokens on (\d+) rows, (\d+) kept", log):
        d, r, k = d + int(m.group(1)), r + int(m.group(2)), k + int(m.group(3))
    return k, d, r


def http_complete(url, prompt, n):
    """A streamed greedy completion over HTTP: decode tokens/s after the first token."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    first = last = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                d = json.loads(line[6:])
                if d.get("usage"):
                    tokens = d["usage"]["completion_tokens"]
                elif d.get("choices"):
                    last = time.monotonic()
                    first = first or last
    return (tokens - 1) / (last - first) if first and last > first else 0.0


def counters(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^kvasir:spec_decode_num_(draft|accepted)_tokens_total\{.*source="(\w+)"\} (\d+)',
                         text, re.M):
        out[(m.group(1), m.group(2))] = int(m.group(3))
    return out


def lookup(args):
    """The lookup sources over HTTP: an input-grounded prompt, and one prompt four times."""
    story = ("Once upon a time, there was a little girl named Lily. She loved to play in the "
             "park with her dog Max. One day, Lily and Max found a big red ball under a tree. ")
    grounded = story + "\n" + story[:40]
    res = {}
    for mode in ("off", "auto"):
        tmp = tempfile.mkdtemp(prefix="kvr-spec-lookup.")
        proc, url = serve_util.start_server(
            args.kvasir, ["-m", args.model, "--stages", str(args.stages), "--spec", mode],
            os.path.join(tmp, "serve.log"), who="spec")
        try:
            http_complete(url, "Hello", 8)
            for r in range(args.runs):
                res.setdefault((mode, "grounded"), []).append(http_complete(url, grounded, args.n))
            for r in range(4):
                res.setdefault((mode, "repeat %d" % (r + 1)), []).append(
                    http_complete(url, "The little dog ran to the", args.n))
            c = counters(url)
        finally:
            serve_util.stop_server(proc)
    print("lookup sources, %s, %d stages, %d tokens, decode tokens/s (median; runs):"
          % (os.path.basename(args.model), args.stages, args.n))
    for case in ["grounded"] + ["repeat %d" % (r + 1) for r in range(4)]:
        off, auto = statistics.median(res[("off", case)]), statistics.median(res[("auto", case)])
        print("  %-10s off %8.1f  auto %8.1f  x%.2f" % (case, off, auto, auto / off))
    for src in ("prompt_lookup", "suffix"):
        print("  %s: kept %d of %d drafted" % (src, c.get(("accepted", src), 0),
                                               c.get(("draft", src), 0)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kvasir", default=os.path.join(HERE, "..", "build", "kvasir"))
    p.add_argument("-m", "--model", default=serve_util.DEFAULT_MODEL)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("-n", type=int, default=256)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--lookup", action="store_true")
    args = p.parse_args()
    if args.lookup:
        return lookup(args)
    serve_util.ensure_model(args.kvasir, args.model)
    tmp = tempfile.mkdtemp(prefix="kvr-spec.")
    plan, procs = start_ring(args, tmp)
    try:
        time.sleep(2)
        one = {"prompt": PROMPT, "max_tokens": args.n, "temperature": 0}
        truth = run(args, plan, tmp, [one], "off")[0][0]
        rng = random.Random(7)
        half = truth[: len(truth) // 2] + [(t * 7 + 13) % 32000 for t in truth[len(truth) // 2:]]
        useless = [rng.randrange(3, 32000) for _ in truth]
        many = [{"prompt": "Story %d: the %d little robots" % (i, i),
                 "max_tokens": args.stream_tokens, "temperature": 0} for i in range(args.streams)]
        rates, acc = {}, {}
        for r in range(args.runs):
            rates.setdefault("off", []).append(run(args, plan, tmp, [one], "off")[1])
            for name, pred in (("true", truth), ("half", half), ("useless", useless)):
                ids, rate, log = run(args, plan, tmp, [dict(one, prediction_ids=pred)], "auto")
                if ids[0] != truth:
                    raise SystemExit("spec: the %s prediction changed the answer" % name)
                rates.setdefault(name, []).append(rate)
                acc[name] = [x + y for x, y in zip(acc.get(name, (0, 0, 0)), kept(log))]
            for mode in ("off", "auto"):
                ids, rate, _ = run(args, plan, tmp, many, mode)
                rates.setdefault("agg_" + mode, []).append(rate)
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            pr.wait()
    med = {k: statistics.median(v) for k, v in rates.items()}
    runs = lambda k: " ".join("%.2f" % x for x in rates[k])
    print("one sequence, %d tokens, %d stages, tokens/s (median of %d; runs):"
          % (args.n, args.stages, args.runs))
    print("  spec off            %7.2f           (%s)" % (med["off"], runs("off")))
    for name in ("true", "half", "useless"):
        a, d, r = acc[name]
        print("  prediction %-8s %7.2f  x%.2f    (%s)  kept %d of %d drafted, %.1f a row"
              % (name, med[name], med[name] / med["off"], runs(name), a, d, d / r if r else 0))
    print("%d sequences x %d tokens at once, tokens/s: off %.2f (%s), auto %.2f (%s): x%.3f"
          % (args.streams, args.stream_tokens, med["agg_off"], runs("agg_off"), med["agg_auto"],
             runs("agg_auto"), med["agg_auto"] / med["agg_off"]))


if __name__ == "__main__":
    main()
