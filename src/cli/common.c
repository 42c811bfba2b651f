#include "cli/common.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

int kvr_cli_u32(const char *opt, const char *v, uint32_t lo, uint32_t hi, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (errno || end == v || *end || v[0] == '-' || x < lo || x > hi) {
        fprintf(stderr, "kvasir: %s wants a whole number in [%u, %u], not '%s'\n", opt, lo, hi,
                v);
        return -1;
    }
    *out = (uint32_t)x;
    return 0;
}

int kvr_cli_float(const char *opt, const char *v, float lo, float hi, float *out)
{
    char *end;
    errno = 0;
    float x = strtof(v, &end);
    if (errno || end == v || *end || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "kvasir: %s wants a number in [%g, %g], not '%s'\n", opt, lo, hi, v);
        return -1;
    }
    *out = x;
    return 0;
}
