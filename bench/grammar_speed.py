#!/usr/bin/env python3
"""bench/grammar_speed.py - decode under a JSON schema, beside free decode and beside
llama.cpp's llama-server with the same schema on the same file (issue 36, acceptance 2).

    flock /work/bench.lock python3 bench/grammar_speed.py [--model M.gguf] [--tokens 64]
        [--rounds 3] [--schema bench/grammar_schema.json]

The model (default models/tinyllama-1.1b-llama3-q4_0.gguf: TinyLlama-1.1B's shape, Q4_0,
random weights, the Llama 3 vocabulary of 128,256 tokens) is synthesised when missing.
Kvasir runs as `kvasir serve` with 2 stages of --stage-threads threads (default 1: 2 in
all), the peer as `llama-server -t 2`. Each round sends, greedy with the same prompt, a free completion and
a constrained one (the schema as llama.cpp's json_schema field) to each server, in the order
ours-free, ours-json, peer-free, peer-json. Decode tokens/s: ours from the streamed tokens'
arrival (tokens after the first over the time from the first to the last), the peer's from
its own timings (predicted_per_second). The schema asks for 100 records, so an answer never
ends before --tokens. Medians over the rounds; the mask's own cost per token comes from
bench_grammar (CPU time, the same schema and vocabulary; a first request's, and requests
through a kept matcher). --spec off|auto is passed to kvasir serve (auto: its default;
constrained sequences draft too). The machine is shared with other
work: compare the ratios of one run, not absolute speeds."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve_util  # noqa: E402

ROOT = serve_util.ROOT
PEER = os.environ.get("KVR_PEER", os.path.join(ROOT, "..", "shared", "peers", "llama.cpp"))
VOCAB = os.path.join(ROOT, "..", "shared", "vocab", "ggml-vocab-llama-bpe.gguf")
PROMPT = "Here is the list of people as JSON:"


def post(url, body, stream=False):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)


def ours(url, n, schema):
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "stream": True}
    if schema is not None:
        body["json_schema"] = schema
    else:
        body["ignore_eos"] = True
    times = []
    with post(url + "/v1/completions", body) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"text"' in line:
                times.append(time.monotonic())
    if len(times) < n // 2:
        sys.exit(f"ours: only {len(times)} chunks")
    return (len(times) - 1) / (times[-1] - times[0])


def peer(url, n, schema):
    body = {"prompt": PROMPT, "n_predict": n, "temperature": 0, "cache_prompt": False}
    if schema is not None:
        body["json_schema"] = schema
    else:
        body["ignore_eos"] = True
    with post(url + "/completion", body) as r:
        d = json.load(r)
    return d["timings"]["predicted_per_second"]


def start_peer(model, port, log):
    proc = subprocess.Popen([os.path.join(PEER, "bin", "llama-server"), "-m", model, "-t", "2",
                             "-c", "2048", "--port", str(port), "--host", "127.0.0.1", "-np", "1"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    sys.exit("peer did not start:\n" + open(log).read()[-2000:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tinyllama-1.1b-llama3-q4_0.gguf"))
    ap.add_argument("--schema", default=os.path.join(ROOT, "bench", "grammar_schema.json"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--stage-threads", type=int, default=1,
                    help="threads per stage: 1 keeps 2 in all; 2 lets the stage whose turn it is "
                         "use both cores (one request: the stages take turns)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec", default="auto", help="kvasir serve --spec (auto: the default)")
    ap.add_argument("--kvasir", default=os.path.join(ROOT, "build", "kvasir"))
    ap.add_argument("--peer-port", type=int, default=18931)
    a = ap.parse_args()
    if not os.path.exists(a.model):
        os.makedirs(os.path.dirname(os.path.abspath(a.model)), exist_ok=True)
        subprocess.run([a.kvasir, "synth", "--shape", "tinyllama-1.1b", "--type", "q4_0",
                        "--vocab", VOCAB, "-o", a.model], check=True)
    schema = json.load(open(a.schema))
    # the mask alone: a first request's 64 tokens (nothing walked yet), then 1000 tokens in
    # requests of 64 through one kept matcher, as the tail keeps one per grammar text
    for extra in (["--tokens", "64"], ["--tokens", "1000", "--request", "64"]):
        mask = subprocess.run([os.path.join(ROOT, "build", "bench_grammar"), a.model, a.schema]
                              + extra, capture_output=True, text=True, check=True).stdout
        print(" ".join(extra) + ": " + mask.strip())
    proc, url = serve_util.start_server(a.kvasir, ["-m", a.model, "--stages", "2", "--threads",
                                                   str(a.stage_threads), "--ctx", "2048",
                                                   "--max-seqs", "2", "--spec", a.spec,
                                                   "--no-standby"], "/tmp/grammar_speed.serve.log")
    pproc, purl = start_peer(a.model, a.peer_port, "/tmp/grammar_speed.peer.log")
    res = {"ours_free": [], "ours_json": [], "peer_free": [], "peer_json": []}
    try:
        ours(url, 8, schema), peer(purl, 8, schema)  # warm-up: trie, caches, pages
        for r in range(a.rounds):
            res["ours_free"].append(ours(url, a.tokens, None))
            res["ours_json"].append(ours(url, a.tokens, schema))
            res["peer_free"].append(peer(purl, a.tokens, None))
            res["peer_json"].append(peer(purl, a.tokens, schema))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in res.items())
                  + " tokens/s")
    finally:
        serve_util.stop_server(proc)
        pproc.terminate()
        pproc.wait()
    med = {k: statistics.median(v) for k, v in res.items()}
    print("medians (tokens/s): " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    print(f"json / free (ours): {med['ours_json'] / med['ours_free']:.3f} (target >= 0.95); "
          f"ours / peer under the schema: {med['ours_json'] / med['peer_json']:.3f} "
          f"(target >= 1.2); peer json / free: {med['peer_json'] / med['peer_free']:.3f}")


main()
