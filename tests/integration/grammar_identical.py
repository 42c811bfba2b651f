#!/usr/bin/env python3
"""A grammar that allows the greedy token at every step changes nothing (issue 36,
acceptance 5): for several prompts, the greedy answer with `grammar` set to exactly that
answer (a GBNF literal) has the same text, token count and finish reason as without one,
both alone and when sent all at once beside free, sampled and other constrained requests
(batch invariance). A random model soon picks byte tokens that are not UTF-8, which no
grammar can spell, so each prompt's answer is cut to its longest well-formed start.
Usage: grammar_identical.py BASE_URL."""
import concurrent.futures
import json
import sys
import urllib.request

BASE = sys.argv[1]


def complete(prompt, max_tokens, grammar=None, temperature=0.0, seed=1):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed}
    if grammar is not None:
        body["grammar"] = grammar
    req = urllib.request.Request(BASE + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        d = json.load(r)
    c = d["choices"][0]
    return c["text"], d["usage"]["completion_tokens"], c["finish_reason"]


def literal(text):
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20:
            out.append("\\x%02x" % ord(ch))
        else:
            out.append(ch)
    return 'root ::= "' + "".join(out) + '"'


def main():
    prompts = [f"Story {i}: once upon a time" for i in range(40)]
    cases = []
    for p in prompts:
        best = None
        for k in range(1, 49):  # the longest greedy start that is well-formed UTF-8
            free = complete(p, k)
            if "\ufffd" in free[0]:
                break
            best = (k, free)
        if best and best[0] >= 3:
            cases.append((p, best[0], best[1], literal(best[1][0])))
    if len(cases) < 8:
        print(f"FAIL: only {len(cases)} prompts with a UTF-8 greedy answer")
        return 1
    bad = []
    for p, k, free, g in cases:
        got = complete(p, k, g)
        if got != free:
            bad.append(f"alone: {p!r}: free {free!r}, constrained {got!r}")
    # All at once: constrained, free greedy and free sampled requests share batches.
    jobs = [("c", p, k, free, g) for p, k, free, g in cases]
    jobs += [("f", p, k, free, None) for p, k, free, _ in cases]
    sampled = {p: complete(p, 48, None, 0.9, 7) for p, _, _, _ in cases[:4]}
    jobs += [("s", p, 48, sampled[p], None) for p in sampled]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        futs = [(kind, p, want, ex.submit(complete, p, k, g, 0.9 if kind == "s" else 0.0,
                                          7 if kind == "s" else 1))
                for kind, p, k, want, g in jobs]
        for kind, p, want, f in futs:
            if f.result() != want:
                bad.append(f"batched {kind}: {p!r}: want {want!r}, got {f.result()!r}")
    n_tok = sum(k for _, k, _, _ in cases)
    print(f"{len(cases)} prompts ({n_tok} tokens): greedy answers identical with and without "
          f"a grammar, alone and batched with {len(jobs)} requests" if not bad else "")
    for b in bad:
        print("FAIL:", b)
    return 1 if bad else 0


sys.exit(main())
