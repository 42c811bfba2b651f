/* json_schema.h - JSON Schema to a GBNF grammar (model/grammar.h), for response_format
 * json_schema and llama.cpp's json_schema field: every text the grammar allows parses as
 * JSON and validates against the schema.
 *
 * Supported: type (one or a list), enum, const, anyOf, oneOf (as anyOf: keep the branches
 * disjoint), allOf of one schema, $ref to "#", "#/$defs/..." or "#/definitions/..."
 * (recursion included); objects: properties, required, additionalProperties (false, true
 * or a schema; with properties, only the listed ones are generated, which always
 * validates); arrays: items, minItems, maxItems; strings: minLength, maxLength, pattern (an
 * ECMAScript subset: literals, escapes \d \w \s and the like, classes, groups (?:), |, * + ?
 * {m,n}, anchors ^ $), format (date, time, date-time, uuid, email, ipv4); integers and
 * numbers: minimum, maximum, exclusiveMinimum, exclusiveMaximum (a number with bounds is
 * generated as an integer, or a decimal whose integer part lies safely inside). Annotations
 * (title, description, default, examples, $schema, $id, $comment, deprecated, readOnly,
 * writeOnly) are accepted. Anything else is refused, never ignored: KVR_ENOTSUP with
 * "<JSON pointer>: unsupported keyword" (e.g. "/properties/x/not: unsupported keyword").
 *
 * Generated text is compact: at most one space between tokens, no \u escapes in strings,
 * properties in the schema's order, at most 16 digits in an unbounded integer.
 *
 * Limits: nesting KVR_JSON_SCHEMA_MAX_DEPTH, the grammar's text
 * KVR_GRAMMAR_MAX_TEXT_BYTES (KVR_ERANGE). Pure: no I/O, no globals; any thread. */
#ifndef KVR_BRIDGE_JSON_SCHEMA_H
#define KVR_BRIDGE_JSON_SCHEMA_H

#include "core/err.h"
#include "core/sbuf.h"

#include <jansson.h>

#define KVR_JSON_SCHEMA_MAX_DEPTH 64
#define KVR_JSON_SCHEMA_MAX_LENGTH 4096 /* minLength, maxLength, minItems, maxItems above it */

/* Append the grammar of `schema` to out. KVR_ENOTSUP (unsupported keyword), KVR_EINVAL (a
 * keyword with a value of the wrong kind, a $ref that does not resolve, a schema no value
 * satisfies), KVR_ERANGE (limits), KVR_ENOMEM; err says where. */
int kvr_json_schema_gbnf(const json_t *schema, struct kvr_sbuf *out, struct kvr_err *err);

/* Append the grammar of any JSON object (response_format json_object). */
void kvr_json_object_gbnf(struct kvr_sbuf *out);

/* ---- shared by json_schema.c and json_schema_str.c ------------------------------------------ */

/* Append a GBNF literal for the bytes s[0..n) (quoted and escaped). */
void kvr_gbnf_literal(struct kvr_sbuf *out, const char *s, size_t n);
/* Append the body of a rule for integers in [lo, hi] (INT64_MIN / INT64_MAX: unbounded). */
void kvr_gbnf_int_range(struct kvr_sbuf *out, int64_t lo, int64_t hi);
/* Append the body of a rule for JSON strings (with their quotes) whose content matches the
 * ECMAScript regex `pattern` (unanchored ends match anything). KVR_ENOTSUP with `why` (a
 * static message) for a construct outside the subset. */
int kvr_gbnf_pattern(struct kvr_sbuf *out, const char *pattern, const char **why);
/* Append the body of a rule for a string `format`, or return KVR_ENOTSUP. */
int kvr_gbnf_format(struct kvr_sbuf *out, const char *format);

#endif
