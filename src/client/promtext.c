/* promtext.c - Prometheus text format reader (see promtext.h). */
#include "client/promtext.h"

#include "core/alloc.h"
#include "core/err.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_LABELS 32

static bool name_start(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
}

static bool name_char(char c)
{
    return name_start(c) || (c >= '0' && c <= '9');
}

static void skip_blank(const char **p, const char *end)
{
    while (*p < end && (**p == ' ' || **p == '\t'))
        (*p)++;
}

static char *dup_range(const char *s, size_t n)
{
    char *d = kvr_malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static void free_sample(struct kvr_prom_sample *s)
{
    kvr_free(s->name);
    for (size_t i = 0; i < s->n_labels; i++) {
        kvr_free(s->labels[i].key);
        kvr_free(s->labels[i].value);
    }
    kvr_free(s->labels);
    memset(s, 0, sizeof *s);
}

/* A float as the format writes it: a C number, or [+-]Inf, NaN (any case). */
static bool parse_value(const char *s, const char *end, double *out)
{
    char tmp[64];
    size_t n = (size_t)(end - s);
    if (n == 0 || n >= sizeof tmp)
        return false;
    memcpy(tmp, s, n);
    tmp[n] = 0;
    const char *t = tmp;
    int sign = 1;
    if (*t == '+' || *t == '-')
        sign = *t++ == '-' ? -1 : 1;
    if (!strcasecmp(t, "inf")) {
        *out = sign * INFINITY;
        return true;
    }
    if (!strcasecmp(t, "nan")) {
        *out = NAN;
        return true;
    }
    char *e;
    *out = strtod(tmp, &e);
    return *e == 0;
}

/* Parse one line into *s. Returns 1 for a sample, 0 to skip the line, KVR_ENOMEM. */
static int parse_line(const char *p, const char *end, struct kvr_prom_sample *s)
{
    memset(s, 0, sizeof *s);
    skip_blank(&p, end);
    if (p == end || *p == '#' || !name_start(*p))
        return 0;
    const char *name = p;
    while (p < end && name_char(*p))
        p++;
    struct kvr_prom_label tmp[MAX_LABELS];
    size_t n_labels = 0;
    int rc = 0;
    if ((s->name = dup_range(name, (size_t)(p - name))) == NULL)
        return KVR_ENOMEM;
    if (p < end && *p == '{') {
        p++;
        for (;;) {
            skip_blank(&p, end);
            if (p < end && *p == '}') {
                p++;
                break;
            }
            if (p == end || !name_start(*p) || n_labels == MAX_LABELS)
                goto skip;
            const char *k = p;
            while (p < end && name_char(*p))
                p++;
            size_t klen = (size_t)(p - k);
            skip_blank(&p, end);
            if (p + 1 >= end || *p != '=' || p[1] != '"')
                goto skip;
            p += 2;
            /* The value with its escapes undone, into a buffer as long as the raw text. */
            const char *v = p;
            while (p < end && *p != '"')
                p += (*p == '\\' && p + 1 < end) ? 2 : 1;
            if (p >= end)
                goto skip;
            char *val = kvr_malloc((size_t)(p - v) + 1), *key = dup_range(k, klen);
            if (!val || !key) {
                kvr_free(val);
                kvr_free(key);
                rc = KVR_ENOMEM;
                goto skip;
            }
            size_t vn = 0;
            for (const char *q = v; q < p; q++) {
                if (*q == '\\' && q + 1 < p) {
                    q++;
                    val[vn++] = *q == 'n' ? '\n' : *q;
                } else {
                    val[vn++] = *q;
                }
            }
            val[vn] = 0;
            tmp[n_labels].key = key;
            tmp[n_labels].value = val;
            n_labels++;
            p++; /* closing quote */
            skip_blank(&p, end);
            if (p < end && *p == ',')
                p++;
            else if (p < end && *p != '}')
                goto skip;
        }
    }
    if (p == end || (*p != ' ' && *p != '\t'))
        goto skip;
    skip_blank(&p, end);
    const char *v = p;
    while (p < end && *p != ' ' && *p != '\t')
        p++;
    if (!parse_value(v, p, &s->value))
        goto skip;
    /* An optional integer timestamp may follow; anything else makes the line suspect. */
    skip_blank(&p, end);
    if (p < end && *p != '-' && (*p < '0' || *p > '9'))
        goto skip;
    if (n_labels) {
        s->labels = kvr_malloc(n_labels * sizeof *s->labels);
        if (!s->labels) {
            rc = KVR_ENOMEM;
            goto skip;
        }
        memcpy(s->labels, tmp, n_labels * sizeof *tmp);
        s->n_labels = n_labels;
    }
    return 1;
skip:
    for (size_t i = 0; i < n_labels; i++) {
        kvr_free(tmp[i].key);
        kvr_free(tmp[i].value);
    }
    free_sample(s);
    return rc;
}

int kvr_prom_parse(struct kvr_prom *p, const char *text, size_t len)
{
    memset(p, 0, sizeof *p);
    const char *end = text + len;
    for (const char *line = text; line < end;) {
        const char *nl = memchr(line, '\n', (size_t)(end - line));
        const char *le = nl ? nl : end;
        const char *trimmed = le;
        if (trimmed > line && trimmed[-1] == '\r')
            trimmed--;
        struct kvr_prom_sample s;
        int rc = parse_line(line, trimmed, &s);
        if (rc < 0)
            return rc;
        const char *q = line;
        skip_blank(&q, trimmed);
        if (rc == 0 && q < trimmed && *q != '#')
            p->n_skipped++;
        if (rc == 1) {
            if (p->n_samples == p->cap) {
                size_t ncap = p->cap ? p->cap * 2 : 64;
                struct kvr_prom_sample *ns = kvr_realloc(p->samples, ncap * sizeof *ns);
                if (!ns) {
                    free_sample(&s);
                    return KVR_ENOMEM;
                }
                p->samples = ns;
                p->cap = ncap;
            }
            p->samples[p->n_samples++] = s;
        }
        line = nl ? nl + 1 : end;
    }
    return 0;
}

void kvr_prom_fini(struct kvr_prom *p)
{
    for (size_t i = 0; i < p->n_samples; i++)
        free_sample(&p->samples[i]);
    kvr_free(p->samples);
    memset(p, 0, sizeof *p);
}

const char *kvr_prom_label(const struct kvr_prom_sample *s, const char *key)
{
    for (size_t i = 0; i < s->n_labels; i++)
        if (!strcmp(s->labels[i].key, key))
            return s->labels[i].value;
    return NULL;
}

const struct kvr_prom_sample *kvr_prom_find(const struct kvr_prom *p, const char *name,
                                            const char *const *kv)
{
    for (size_t i = 0; i < p->n_samples; i++) {
        const struct kvr_prom_sample *s = &p->samples[i];
        if (strcmp(s->name, name))
            continue;
        bool match = true;
        for (size_t k = 0; kv && kv[k] && kv[k + 1] && match; k += 2) {
            const char *v = kvr_prom_label(s, kv[k]);
            match = v && !strcmp(v, kv[k + 1]);
        }
        if (match)
            return s;
    }
    return NULL;
}

double kvr_prom_value(const struct kvr_prom *p, const char *name, const char *const *kv,
                      double dflt)
{
    const struct kvr_prom_sample *s = kvr_prom_find(p, name, kv);
    return s ? s->value : dflt;
}
