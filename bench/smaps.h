/* smaps.h - AnonHugePages of /proc/self/smaps_rollup, shared by bench_forward and
 * bench_kernels (a header of one static inline function: each bench is one file and one
 * executable). */
#ifndef KVR_BENCH_SMAPS_H
#define KVR_BENCH_SMAPS_H

#include <stdio.h>

/* This process's anonymous memory in transparent huge pages, in MiB (-1 if unreadable):
 * whether an madvise(MADV_HUGEPAGE) got huge pages from the kernel. */
static inline long anon_huge_mib(void)
{
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb < 0 ? -1 : kb / 1024;
}

#endif
