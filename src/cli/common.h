/* common.h - small helpers shared by the subcommands: checked option parsing and a
 * terminal progress line. Each prints its own error to stderr. */
#ifndef KVR_CLI_COMMON_H
#define KVR_CLI_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

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

/* `kvasir --version` and every subcommand's --version: one line to stdout. */
void kvr_cli_version(void);

/* An option the subcommand `cmd` does not know: one line naming it, the nearest option
 * that `help` (the subcommand's usage text) names when one is close (edit distance), and
 * a pointer to --help; never the whole help, which would bury the line that matters. */
void kvr_cli_unknown(const char *cmd, const char *opt, const char *help);
/* The same, with the help that `usage` prints. */
void kvr_cli_unknown_usage(const char *cmd, const char *opt, void (*usage)(FILE *));

/* llama.cpp's and vLLM's GPU options (-ngl N, --n-gpu-layers N, --device D,
 * --tensor-parallel-size N, ...): this build runs on the CPU, so such an option is
 * answered with one line saying it is ignored. Returns how many words of argv it takes
 * (1, or 2 with its value `v`), or 0 when `a` is not one. */
int kvr_cli_gpu_option(const char *cmd, const char *a, const char *v);

/* The CPUs this process may run on (sched_getaffinity), at least 1. */
uint32_t kvr_cli_cores(void);

/* Read an API key from the first line of `path` into a new string (kvr_free); NULL after
 * printing why (unreadable, empty, longer than 4 KiB). */
char *kvr_cli_read_key_file(const char *path);

/* Overwrite a secret's bytes in argv (so `ps` does not show it) after copying it; returns
 * the copy (kvr_free) or NULL when out of memory. */
char *kvr_cli_take_secret(char *arg);

#endif
