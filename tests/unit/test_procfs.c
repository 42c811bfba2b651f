/* test_procfs.c - core/procfs.h on files shaped like /proc/meminfo. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/procfs.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void test_reads_the_named_line(void **state)
{
    (void)state;
    char path[] = "/tmp/kvr-procfs.XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("MemTotal:       32 kB\nMemAvailableX:   99 kB\nMemAvailable:     7 kB\n", f);
    fclose(f);
    assert_int_equal(kvr_procfs_bytes(path, "MemAvailable"), 7 * 1024);
    assert_int_equal(kvr_procfs_bytes(path, "MemTotal"), 32 * 1024);
    assert_int_equal(kvr_procfs_bytes(path, "Rss"), 0); /* no such line */
    unlink(path);
    assert_int_equal(kvr_procfs_bytes(path, "MemAvailable"), 0); /* no such file */
    assert_true(kvr_procfs_bytes("/proc/meminfo", "MemAvailable") > 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_reads_the_named_line)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
