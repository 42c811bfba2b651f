/* procfs.h - one number from a Linux /proc file of "Key: N kB" lines (meminfo,
 * smaps_rollup): what serve's sizing and a stage's memory log read. No state; any thread. */
#ifndef KVR_CORE_PROCFS_H
#define KVR_CORE_PROCFS_H

#include <stdint.h>

/* The bytes of the first line "KEY: N kB" of `path` (KEY without its colon), or 0 when the
 * file or the line is missing. */
uint64_t kvr_procfs_bytes(const char *path, const char *key);

#endif
