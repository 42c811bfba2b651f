/* testutil.h - helpers shared by the unit tests. Include after <cmocka.h>'s prerequisites. */
#ifndef KVR_TESTUTIL_H
#define KVR_TESTUTIL_H

#include <stdbool.h>
#include <stddef.h>

/* Path of a file under ../shared (KVR_SHARED overrides the folder). If it is missing:
 * under CI (CI=true) the test fails; elsewhere it is skipped with a message saying so.
 * Returns a static buffer valid until the next call. Call only from inside a cmocka test. */
const char *kvr_test_shared(const char *rel_path);

/* Read a whole file into a malloc'd buffer (NUL-terminated); NULL on failure. */
char *kvr_test_read_file(const char *path, size_t *out_len);

#endif
