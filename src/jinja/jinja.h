/* jinja.h - a small, bounded interpreter for the Jinja subset that chat templates use.
 *
 * A model's GGUF carries its chat template (tokenizer.chat_template) as a Jinja program;
 * Hugging Face transformers renders it with jinja2 in a sandbox with trim_blocks and
 * lstrip_blocks on, the loop-controls extension (break/continue), `raise_exception(msg)`,
 * `strftime_now(fmt)` and a `tojson` that keeps non-ASCII text and uses Python's
 * json.dumps separators. This module renders the same programs to the same bytes.
 * It follows the Jinja documentation (no other implementation's code), and
 * tests/integration/chat_template_jinja2.sh compares its output with jinja2's.
 *
 * What is supported:
 *   {{ }}, {% %}, {# #}, the whitespace controls `-` and `+`, trim_blocks, lstrip_blocks,
 *   newline normalisation and the dropped trailing newline of jinja2's defaults;
 *   if/elif/else, for (with `if` filter, `else`, tuple targets, loop.index/index0/
 *   revindex/revindex0/first/last/length/previtem/nextitem/depth/cycle), break,
 *   continue, set (names, tuples, namespace attributes, block set), macro, filter
 *   blocks, raw, generation (HF's tag: renders its body); expressions with Python's
 *   operators (+ - * / // % ** ~, comparisons incl. chains, in / not in, and/or/not,
 *   is / is not, inline if-else), literals (strings, numbers, lists, tuples, dicts,
 *   true/false/none), attribute and item access, slices with steps, calls with keyword
 *   arguments; the globals range, namespace, dict, raise_exception and strftime_now;
 *   the filters, tests and str/dict methods listed at the top of jinja_filters.c.
 * Values behave as in Python: strings are indexed, sliced and measured in code points;
 * integers are 64-bit (overflow is an error, not a big integer); undefined names behave
 * as jinja2's default Undefined (print as "", iterate as empty, are false, and raise
 * when used in arithmetic, called or looked into).
 * Case mapping (upper, lower, title, capitalize) covers ASCII, Latin-1, Latin
 * Extended-A, Greek and Cyrillic; other characters are left as they are.
 *
 * Bounds: templates are untrusted input. Parsing and rendering are limited in template
 * size, AST nodes, nesting depth (parse and evaluation recursion), evaluation steps
 * (every node evaluated and every loop iteration counts), output bytes and working
 * memory (all values of one render live in one arena with a cap, so no string, list or
 * repetition can grow past it). Any limit reached, like any template error, ends the
 * render with a status and a message naming the template line.
 *
 * Errors: parse errors are KVR_EFORMAT ("line 3: expected '%}'"). When rendering,
 * raise_exception(msg) is KVR_EINVAL with msg (the template refuses the input, e.g.
 * roles that do not alternate), a limit is KVR_ERANGE, out of memory KVR_ENOMEM, and
 * any other runtime error (undefined used, type error) KVR_EFORMAT.
 * Inside the evaluator an error unwinds with longjmp to the entry point: every
 * allocation of a render is in its arena, so unwinding leaks nothing.
 *
 * Ownership and threads: a parsed struct kvr_jinja owns a normalised copy of the source
 * and its AST and is immutable, so any number of threads may render it at once; each
 * render allocates its own arena and frees it before returning. Pure module: no I/O,
 * no globals, no clock (the caller passes the time for strftime_now). */
#ifndef KVR_JINJA_JINJA_H
#define KVR_JINJA_JINJA_H

#include "core/err.h"

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

struct kvr_jinja_limits {
    size_t max_template_bytes; /* source size; default 1 MiB */
    uint32_t max_nodes;        /* AST nodes (tokens, too); default 200000 */
    uint32_t max_depth;        /* nesting of blocks/expressions and macro calls; 100 */
    uint64_t max_steps;        /* evaluation steps per render; default 10 million */
    size_t max_output_bytes;   /* rendered text (and any captured block); 8 MiB */
    size_t max_memory_bytes;   /* working memory per render; default 64 MiB */
};

void kvr_jinja_limits_default(struct kvr_jinja_limits *lim);

struct kvr_jinja;

/* Parse `len` bytes of template source. `lim` may be NULL (defaults); it is copied and
 * also bounds every render of this template. */
int kvr_jinja_parse(struct kvr_jinja **out, const char *src, size_t len,
                    const struct kvr_jinja_limits *lim, struct kvr_err *err);
void kvr_jinja_destroy(struct kvr_jinja *t);

/* Render with the variables of the JSON object `vars` (borrowed; JSON null is None,
 * objects are dicts in their key order). `now` is the broken-down local time that
 * strftime_now formats, or NULL to leave strftime_now undefined. On success *out is a new
 * NUL-terminated string (kvr_free) of *out_len bytes. */
int kvr_jinja_render(const struct kvr_jinja *t, const json_t *vars, const struct tm *now,
                     char **out, size_t *out_len, struct kvr_err *err);

#endif
