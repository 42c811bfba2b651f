#!/usr/bin/env python3
"""Constrained decoding against a real ring (issue 36, acceptance 1): every schema of
json_schema/suite.json is sent 3 times (seeds 1-3, sampled, alternating /v1/completions with
llama.cpp's json_schema field and /v1/chat/completions with response_format json_schema);
every answer that finished (finish_reason "stop") must parse as JSON and validate against
its schema with python3-jsonschema (formats checked too); answers cut by max_tokens must say
"length". Then every schema of json_schema/unsupported.json must be refused with a 400 whose
message names the keyword's JSON pointer. Usage: json_schema_suite.py BASE_URL SUITE_DIR."""
import concurrent.futures
import json
import sys
import urllib.error
import urllib.request

import jsonschema

BASE, DIR = sys.argv[1], sys.argv[2]
MAX_TOKENS = 600


def post(path, body):
    req = urllib.request.Request(BASE + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def generate(case, seed):
    schema = case["schema"]
    if seed % 2:
        status, d = post("/v1/completions", {"prompt": "JSON:", "max_tokens": MAX_TOKENS,
                                             "seed": seed, "json_schema": schema})
        text = d["choices"][0]["text"] if status == 200 else None
    else:
        rf = {"type": "json_schema",
              "json_schema": {"name": case["name"], "strict": True, "schema": schema}}
        status, d = post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "max_tokens": MAX_TOKENS, "seed": seed, "response_format": rf})
        text = d["choices"][0]["message"]["content"] if status == 200 else None
    if status != 200:
        return case["name"], seed, "error", f"HTTP {status}: {d}"
    finish = d["choices"][0]["finish_reason"]
    if finish == "length":
        return case["name"], seed, "length", text
    if finish != "stop":
        return case["name"], seed, "error", f"finish_reason {finish}"
    try:
        value = json.loads(text)
        cls = jsonschema.validators.validator_for(schema if isinstance(schema, dict) else {})
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
    except Exception as e:  # noqa: BLE001 - any failure is the test's failure
        return case["name"], seed, "invalid", f"{text!r}: {e}"
    return case["name"], seed, "ok", text


def main():
    suite = json.load(open(f"{DIR}/suite.json"))
    assert len(suite) >= 100, len(suite)
    jobs = [(c, s) for c in suite for s in (1, 2, 3)]
    counts = {"ok": 0, "length": 0, "invalid": 0, "error": 0}
    bad = []
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        for name, seed, outcome, detail in ex.map(lambda j: generate(*j), jobs):
            counts[outcome] += 1
            if outcome in ("invalid", "error"):
                bad.append(f"{name} seed {seed}: {outcome}: {detail}")
            if outcome == "ok" and seed == 1:
                print(f"  {name}: {detail[:100]}")
    print(f"{len(suite)} schemas x 3: {counts}")
    refused = 0
    for case in json.load(open(f"{DIR}/unsupported.json")):
        status, d = post("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                             "json_schema": case["schema"]})
        msg = d.get("error", {}).get("message", "") if isinstance(d, dict) else ""
        want = "json_schema: " + case["error"]
        if status != 400 or not msg.startswith(want):
            bad.append(f"unsupported {json.dumps(case['schema'])}: HTTP {status} {msg!r}, "
                       f"want 400 {want!r}")
        else:
            refused += 1
    print(f"unsupported keywords refused with their pointer: {refused}")
    for b in bad:
        print("FAIL:", b)
    # Most answers must finish, or the check above says little.
    if counts["ok"] < 0.6 * len(jobs):
        print(f"FAIL: only {counts['ok']} of {len(jobs)} answers finished")
        return 1
    return 1 if bad else 0


sys.exit(main())
