/* promtext.h - a reader for the Prometheus text exposition format (version 0.0.4), enough
 * for `kvasir top` and tests to read GET /metrics.
 *
 * Each sample line is   name[{label="value",...}] value [timestamp]
 * Comment lines (# HELP, # TYPE, anything after '#'), blank lines and lines that do not
 * parse are skipped (counted in n_skipped), so a newer server with more or odd series never
 * breaks a reader. Label values may use the escapes \\ \" and \n. Values are floats,
 * including +Inf, -Inf and NaN.
 *
 * Ownership: kvr_prom_parse fills a caller-owned struct kvr_prom whose samples own their
 * strings; kvr_prom_fini frees them. Pure: no I/O, no globals; one thread per struct. */
#ifndef KVR_CLIENT_PROMTEXT_H
#define KVR_CLIENT_PROMTEXT_H

#include <stdbool.h>
#include <stddef.h>

struct kvr_prom_label {
    char *key, *value;
};

struct kvr_prom_sample {
    char *name;
    struct kvr_prom_label *labels;
    size_t n_labels;
    double value;
};

struct kvr_prom {
    struct kvr_prom_sample *samples;
    size_t n_samples, cap;
    size_t n_skipped; /* malformed lines ignored */
};

/* Parse `len` bytes of text (need not be NUL-terminated). Returns 0, or KVR_ENOMEM (the
 * struct then holds what was parsed so far and must still be finalized). */
int kvr_prom_parse(struct kvr_prom *p, const char *text, size_t len);
void kvr_prom_fini(struct kvr_prom *p);

/* The first sample named `name` whose labels include every pair of the NULL-terminated
 * list kv ("stage", "0", NULL), or NULL. kv may be NULL (any labels). */
const struct kvr_prom_sample *kvr_prom_find(const struct kvr_prom *p, const char *name,
                                            const char *const *kv);
/* Its value, or `dflt` when there is none. */
double kvr_prom_value(const struct kvr_prom *p, const char *name, const char *const *kv,
                      double dflt);
/* A label's value in a sample, or NULL. */
const char *kvr_prom_label(const struct kvr_prom_sample *s, const char *key);

#endif
