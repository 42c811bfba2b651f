/* toolcall_grammar.h - the grammar (GBNF, as model/grammar.h reads it) that forces a tool
 * call: tool_choice "required" (any tool, one call or, with parallel_tool_calls, several)
 * or a named function (one call of it), in the call syntax of the template's family
 * (toolcall.h) with each function's arguments constrained by its parameters schema.
 *
 * A parsed answer of that grammar is a finished call (toolcall.h reads it back); the
 * grammar ends there, so the only token left is end-of-generation. A template that opens
 * <think> in the prompt gets the rest of the thinking first (text without "</think>").
 *
 * Schemas: objects with properties (required ones always, optional ones in schema order),
 * strings (minLength / maxLength), integers (a range of at most 64 values is listed, else
 * any integer), numbers, booleans, null, arrays (items, minItems, maxItems), enum, const,
 * anyOf / oneOf; anything else (no type, $ref, pattern, format) is any JSON value of the
 * type given, so such arguments are JSON but not checked against those keywords.
 * Pure; any thread. */
#ifndef KVR_BRIDGE_TOOLCALL_GRAMMAR_H
#define KVR_BRIDGE_TOOLCALL_GRAMMAR_H

#include "bridge/toolcall.h"
#include "bridge/tools.h"
#include "core/sbuf.h"

/* Append the GBNF to `out` (rule `root` first). 0, KVR_EINVAL (no tool to call, or a family
 * without a forcing syntax), or KVR_ENOMEM. */
int kvr_toolcall_grammar(const struct kvr_toolcall_opts *o, const struct kvr_tools *t,
                         struct kvr_sbuf *out);

/* The GBNF of one JSON schema as rule `name` (its helper rules prefixed by `name`), with
 * the JSON primitives of kvr_toolcall_grammar_json_rules. 0 or KVR_ENOMEM. */
int kvr_toolcall_grammar_schema(const json_t *schema, const char *name, struct kvr_sbuf *out);
/* The shared primitives: ws, json-string, json-number, json-integer, json-value, ... */
void kvr_toolcall_grammar_json_rules(struct kvr_sbuf *out);

#endif
