#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A test binary is a program like kvasir: it reads KVR_LOG once, before main, as
 * cli/main.c does (the library never reads the environment). */
__attribute__((constructor)) static void log_level_from_env(void)
{
    kvr_log_set_level(kvr_log_level_from_name(getenv("KVR_LOG")));
}

const char *kvr_test_shared(const char *rel_path)
{
    static char path[4096];
    const char *dir = getenv("KVR_SHARED");
    snprintf(path, sizeof path, "%s/%s", dir ? dir : "../shared", rel_path);
    if (access(path, R_OK) == 0)
        return path;
    const char *ci = getenv("CI");
    if (ci && !strcmp(ci, "true"))
        fail_msg("required test data missing under CI: %s", path);
    print_message("SKIP: test data not found: %s (set KVR_SHARED)\n", path);
    skip();
    return NULL;
}

char *kvr_test_read_file(const char *path, size_t *out_len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)len + 1);
    if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[len] = 0;
        if (out_len)
            *out_len = (size_t)len;
    }
    return buf;
}
