/* procfs.c - see procfs.h. */
#include "core/procfs.h"

#include <stdio.h>
#include <string.h>

uint64_t kvr_procfs_bytes(const char *path, const char *key)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[256];
    size_t n = strlen(key);
    unsigned long long kib = 0;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, n) && line[n] == ':' && sscanf(line + n + 1, "%llu kB", &kib) == 1)
            break;
    fclose(f);
    return (uint64_t)kib << 10;
}
