/* common.h - small helpers shared by the subcommands: checked option parsing and a
 * terminal progress line. Each prints its own error to stderr. */
#ifndef KVR_CLI_COMMON_H
#define KVR_CLI_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Parse `v` as an integer in [lo, hi] for option `opt`; 0, or -1 after printing why. */
int kvr_cli_u32(const char *opt, const char *v, uint32_t lo, uint32_t hi, uint32_t *out);
int kvr_cli_float(const char *opt, const char *v, float lo, float hi, float *out);

/* SIGINT and SIGTERM call `handler` (which should only set a lock-free flag); SIGPIPE is
 * ignored, so a peer that goes away shows up as a write error instead. */
void kvr_cli_on_stop(void (*handler)(int));

struct kvr_gguf;

/* Read every page of the model's tensors once, so the first forward pass does not stall on
 * the disk; with a terminal on stderr, show the progress. */
void kvr_cli_load_weights(struct kvr_gguf *g);

/* --chat-template NAME|FILE: a built-in template's name sets *builtin (to `arg`); anything
 * else is read as a Jinja template file into *src (kvr_free; at most 1 MiB). 0, or -1
 * after printing why. */
int kvr_cli_chat_template(const char *arg, const char **builtin, char **src, size_t *src_len);

#endif
