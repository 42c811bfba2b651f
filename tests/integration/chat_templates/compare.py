#!/usr/bin/env python3
"""Render the chat templates of real models with jinja2 the way Hugging Face transformers
does, and with Kvasir's interpreter (tests/tools/kvr_render), over the same deterministic
conversations; every render must be byte-identical, and a template that raises for a
conversation must raise in both.

    compare.py KVR_JINJA_BINARY NODE_MODULES_DIR PACKAGE...

A PACKAGE ending in .jinja is a template file in NODE_MODULES_DIR, rendered without BOS
and EOS tokens.

The jinja2 environment is Hugging Face's: an immutable sandbox with trim_blocks,
lstrip_blocks and the loop controls, raise_exception() and strftime_now() as globals, and a
tojson filter that is json.dumps(ensure_ascii=False) with Python's default separators.
strftime_now formats a fixed time (2024-07-26 12:00) so that both renderers agree."""
import datetime
import json
import os
import subprocess
import sys
import tempfile

import jinja2
import jinja2.ext
import jinja2.sandbox

FIXED_NOW = datetime.datetime(2024, 7, 26, 12, 0, 0)


def make_env():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: FIXED_NOW.strftime(fmt)
    return env


def token_text(tok):
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


# Ten conversations, each rendered with and without add_generation_prompt: 20 cases.
LONG = " ".join("word%d" % i for i in range(300))
CONVERSATIONS = [
    [("user", "Hello!")],
    [("system", "You are a helpful assistant."), ("user", "What is 2+2?")],
    [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello! How can I help?"),
     ("user", "Tell me a joke.")],
    [("user", "First question"), ("assistant", "First answer"), ("user", "Second question"),
     ("assistant", "Second answer")],
    [("user", ""), ("assistant", ""), ("user", "   ")],
    [("system", "Line one\nLine two\n\n  indented line\n"),
     ("user", "multi\nline\r\nquestion\n\n"), ("assistant", "  leading and trailing  \n"),
     ("user", "\ttabs\tand\nnewlines\n")],
    [("system", "Réponds en français, s'il te plaît."), ("user", "日本語で答えてください。🙂"),
     ("assistant", "はい！ Ελληνικά, кириллица, עברית, e\u0301"), ("user", "Straße, ÆØÅ, İı")],
    [("user", "Quotes ' \" and backslashes \\ \\n {{ not a tag }} {% raw %} <|im_end|> </s>"),
     ("assistant", "<think>\nreasoning here\n</think>\n\nThe answer."), ("user", LONG)],
    [("assistant", "I speak first."), ("user", "Then me.")],
    [("system", "sys"), ("user", "one"), ("user", "two in a row")],
]


# Ten more with tools, tool calls and tool results, as Hugging Face passes them:
# tools as JSON schemas ({"type": "function", "function": {...}}), an assistant turn's
# tool_calls with arguments as an object (the documented form) or as a JSON string (what
# DeepSeek V3's template concatenates), content None or text beside them, "tool" turns, and
# the keyword arguments of gpt-oss's and GLM's templates (reasoning_effort, builtin_tools,
# model_identity, enable_thinking).
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "description": "Forecast days", "default": 1}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search_docs", "description": "Search the documentation.",
    "parameters": {"type": "object", "required": ["query", "filters"], "properties": {
        "query": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "limit": {"type": "number", "nullable": True},
        "exact": {"type": "boolean", "default": False},
        "filters": {"type": "object", "properties": {
            "lang": {"type": "string"}, "since": {"type": ["string", "null"]}},
            "required": ["lang"]},
        "pages": {"type": "array", "items": {"type": "object", "properties": {
            "n": {"type": "integer"}}}},
        "mode": {"oneOf": [{"type": "string", "description": "by name"},
                           {"type": "integer"}], "default": "fast"}}}}}
NOARGS = {"type": "function", "function": {"name": "now", "description": "The time.",
                                           "parameters": {"type": "object", "properties": {}}}}


def call(name, args, content=None, **extra):
    m = {"role": "assistant", "content": content,
         "tool_calls": [{"id": "call_%s" % name, "type": "function",
                         "function": {"name": name, "arguments": args}}]}
    m.update(extra)
    return m


def tool(content, name="get_weather"):
    return {"role": "tool", "tool_call_id": "call_%s" % name, "name": name, "content": content}


TOOL_CONVERSATIONS = [
    ([WEATHER], [
        {"role": "system", "content": "You can look up the weather."},
        {"role": "user", "content": "Weather in Paris?"},
        call("get_weather", '{"city": "Paris"}'),
        tool('{"temp_c": 21, "sky": "clear"}'),
        {"role": "assistant", "content": "It is 21 °C and clear in Paris."}]),
    ([WEATHER, SEARCH], [
        {"role": "user", "content": "Weather in Zürich, and the docs on \"rings\"?"},
        call("get_weather", {"city": "Zürich", "unit": "celsius", "days": 2}, content=""),
        tool("{\"temp_c\": -3}"),
        call("search_docs", {"query": "rings", "tags": ["a", "b"], "limit": None,
                             "filters": {"lang": "en", "since": "2024"}}, content=""),
        tool("found 2 pages: ring.md, plan.md", "search_docs"),
        {"role": "user", "content": "Thanks. Summarise."}]),
    ([SEARCH, NOARGS], [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "What time is it?"},
        call("now", {}, content="Let me check the clock."),
        tool("12:00", "now")]),
    ([WEATHER, SEARCH, NOARGS], [
        {"role": "user", "content": "Hi, no tools needed."}],
     {"reasoning_effort": "high", "builtin_tools": ["browser", "python"],
      "model_identity": "You are a test.", "enable_thinking": False}),
    ([WEATHER], [
        {"role": "user", "content": "東京の天気は？"},
        call("get_weather", {"city": "東京", "days": 3, "note": "a \"quoted\" \\ value\n"},
             content="", reasoning_content="The user wants Tokyo.", thinking="Tokyo, 3 days."),
        tool("晴れ 🌞"),
        {"role": "assistant", "content": "<think>\nsunny\n</think>\n\n東京は晴れです。",
         "reasoning_content": "It is sunny."},
        {"role": "user", "content": "ありがとう"}],
     {"enable_thinking": True, "builtin_tools": ["python"]}),
    ([WEATHER], [
        {"role": "user", "content": "Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        tool("18"), tool("4"),
        {"role": "assistant", "content": "Paris 18, Oslo 4."}]),
    ([SEARCH], [
        {"role": "system", "content": "Cite pages."},
        {"role": "user", "content": "Find 'ring'"},
        call("search_docs", {"query": "ring", "filters": {"lang": "en"}, "pages": [{"n": 1}]},
             content="<think>\nsearch first\n</think>\n\nSearching."),
        tool("ring.md: 'a ring of stages'", "search_docs")]),
    ([WEATHER, NOARGS], [
        {"role": "user", "content": "Time, then weather in Rome."},
        call("now", "{}"),
        tool("12:00", "now"),
        call("get_weather", '{"city": "Rome", "unit": "celsius"}'),
        tool('{"temp_c": 25}'),
        {"role": "assistant", "content": "12:00, 25 °C in Rome."},
        {"role": "user", "content": "And tomorrow?"}]),
    ([NOARGS], [
        {"role": "user", "content": [{"type": "text", "text": "Parts: "}, {"type": "text", "text": "what time?"}]},
        call("now", {}, content=None),
        tool("noon", "now")]),
    ([], [
        {"role": "system", "content": "No tools today."},
        {"role": "user", "content": "Empty tool list."},
        {"role": "assistant", "content": "OK."},
        {"role": "user", "content": "Bye"}],
     {"reasoning_effort": "low"}),
]


def with_tokens(v, bos, eos):
    if bos is not None:
        v["bos_token"] = bos
    if eos is not None:
        v["eos_token"] = eos
    return v


def cases_for(config):
    bos = token_text(config.get("bos_token"))
    eos = token_text(config.get("eos_token"))
    cases = []
    for conv in CONVERSATIONS:
        for gen in (True, False):
            v = {"messages": [{"role": r, "content": c} for r, c in conv], "tools": None,
                 "documents": None, "add_generation_prompt": gen}
            cases.append(with_tokens(v, bos, eos))
    for tools, messages, *extra in TOOL_CONVERSATIONS:
        for gen in (True, False):
            v = {"messages": messages, "tools": tools, "documents": None,
                 "add_generation_prompt": gen}
            v.update(*extra)  # the keyword arguments some templates read
            cases.append(with_tokens(v, bos, eos))
    return cases


def render_jinja2(env, source, cases):
    try:
        tmpl = env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        return [{"ok": False, "error": "compile: %s" % e}] * len(cases)
    out = []
    for v in cases:
        try:
            out.append({"ok": True, "text": tmpl.render(**v)})
        except Exception as e:  # a template's raise_exception, or any runtime error
            out.append({"ok": False, "error": "%s: %s" % (type(e).__name__, e)})
    return out


def main():
    binary, modules = sys.argv[1], sys.argv[2]
    env = make_env()
    failures = 0
    total = 0
    for pkg in sys.argv[3:]:
        path = os.path.join(modules, pkg, "models", "tokenizer_config.json")
        if pkg.endswith(".jinja"):  # a template file of its own, no special tokens
            path = os.path.join(modules, pkg)
            with open(path, encoding="utf-8") as f:
                config = {"chat_template": f.read()}
        else:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        source = config.get("chat_template")
        if isinstance(source, list):
            source = next(t["template"] for t in source if t.get("name") == "default")
        if not isinstance(source, str):
            print("FAIL %s: no chat_template in %s" % (pkg, path))
            failures += 1
            continue
        cases = cases_for(config)
        want = render_jinja2(env, source, cases)
        with tempfile.TemporaryDirectory() as tmp:
            tpath = os.path.join(tmp, "template.jinja")
            cpath = os.path.join(tmp, "cases.json")
            with open(tpath, "w", encoding="utf-8") as f:
                f.write(source)
            with open(cpath, "w", encoding="utf-8") as f:
                json.dump(cases, f)
            run = subprocess.run([binary, tpath, cpath], capture_output=True, timeout=60)
        if run.returncode != 0:
            print("FAIL %s: kvr_render exited %d: %s" % (pkg, run.returncode,
                                                        run.stderr.decode(errors="replace")))
            failures += 1
            continue
        got = json.loads(run.stdout)
        n_same = n_raise = 0
        for i, (w, g) in enumerate(zip(want, got)):
            total += 1
            if w["ok"] and g["ok"] and w["text"] == g["text"]:
                n_same += 1
                continue
            if not w["ok"] and not g["ok"]:
                n_same += 1
                n_raise += 1
                continue
            failures += 1
            print("FAIL %s case %d (add_generation_prompt=%s):" % (pkg, i,
                                                                  cases[i]["add_generation_prompt"]))
            print("  jinja2: %r" % (w.get("text") if w["ok"] else "ERROR " + w["error"]))
            print("  kvasir: %r" % (g.get("text") if g["ok"] else "ERROR " + g["error"]))
        print("%-28s %2d/%d identical (%d raise in both)" % (pkg, n_same, len(cases), n_raise))
    print("%d renders compared, %d differ" % (total, failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
