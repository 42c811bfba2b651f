/* toolcall_grammar.h - the grammar (GBNF, as model/grammar.h reads it) that forces a tool
 * call: tool_choice "required" (any tool, one call or, with parallel_tool_calls, several)
 * or a named function (one call of it), in the call syntax of the template's family
 * (toolcall.h) with each function's arguments constrained by its parameters schema.
 *
 * A parsed answer of that grammar is a finished call (toolcall.h reads it back); the
 * grammar ends there, so the only token left is end-of-generation. A template that opens
 * <think> in the prompt gets the rest of the thinking first (text without "</think>"), one
 * that writes <think> blocks may open one first.
 *
 * Arguments follow the function's parameters schema as json_schema.h compiles it (its
 * grammar renamed "tN-..." for tool N); a schema it refuses is the request's 400. The
 * XML-style families write a string parameter as raw text without '<' (one of its enum
 * values when it has them) and any other as JSON under its schema.
 * Pure; any thread. */
#ifndef KVR_BRIDGE_TOOLCALL_GRAMMAR_H
#define KVR_BRIDGE_TOOLCALL_GRAMMAR_H

#include "bridge/toolcall.h"
#include "bridge/tools.h"
#include "core/err.h"
#include "core/sbuf.h"

/* Append the GBNF to `out` (rule `root` first). 0; KVR_EINVAL (no tool to call, or a
 * family without a forcing syntax); a schema's error from json_schema.h (KVR_ENOTSUP,
 * KVR_EINVAL, KVR_ERANGE) with `err` filled and *bad_tool the tool's index; KVR_ENOMEM. */
int kvr_toolcall_grammar(const struct kvr_toolcall_opts *o, const struct kvr_tools *t,
                         struct kvr_sbuf *out, size_t *bad_tool, struct kvr_err *err);

/* tool_choice "auto" in a family whose calls open with a trigger text (Hermes, Qwen3-Coder,
 * GLM-4.5: "<tool_call>"; Mistral: "[TOOL_CALLS]"; DeepSeek V3: its calls-begin marker):
 * any text that does not contain the trigger, and from a trigger on, the calls as the
 * forced grammar has them (the rest of the answer again text; without parallel calls, text
 * without the trigger). The end of generation may come anywhere outside a call. KVR_EINVAL
 * for other families or choices; otherwise as kvr_toolcall_grammar. */
int kvr_toolcall_grammar_lazy(const struct kvr_toolcall_opts *o, const struct kvr_tools *t,
                              struct kvr_sbuf *out, size_t *bad_tool, struct kvr_err *err);
/* The text that opens a family's calls, or NULL (static). */
const char *kvr_toolcall_trigger(enum kvr_toolcall_family f);

#endif
