/* test_log.c - the log level: named as KVR_LOG names it (the program sets it from the
 * environment at the start of main), changed by kvr_log_set_level, and safe to race (run
 * under ThreadSanitizer: several threads log while another sets the level); and each
 * line's wall-clock stamp, ISO 8601 in UTC with milliseconds. */
#define _GNU_SOURCE /* strptime */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/log.h"

#include <pthread.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { N_THREADS = 4, N_CALLS = 2000 };

struct probe {
    pthread_barrier_t *start;
    int info_on, warn_on; /* how many calls saw the level enabled */
};

static void *probe_main(void *arg)
{
    struct probe *p = arg;
    pthread_barrier_wait(p->start);
    for (int i = 0; i < N_CALLS; i++) {
        p->info_on += kvr_log_enabled(KVR_LOG_INFO);
        p->warn_on += kvr_log_enabled(KVR_LOG_WARN);
        KVR_DEBUG("never printed at level warn (%d)", i);
    }
    return NULL;
}

static void run_probes(struct probe *probes)
{
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, N_THREADS);
    pthread_t th[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) {
        probes[i] = (struct probe){.start = &start};
        assert_int_equal(pthread_create(&th[i], NULL, probe_main, &probes[i]), 0);
    }
    for (int i = 0; i < N_THREADS; i++)
        pthread_join(th[i], NULL);
    pthread_barrier_destroy(&start);
}

/* The level set from KVR_LOG as cli/main.c sets it: every thread sees it. */
static void test_level_from_env_many_threads(void **state)
{
    (void)state;
    setenv("KVR_LOG", "warn", 1);
    kvr_log_set_level(kvr_log_level_from_name(getenv("KVR_LOG")));
    struct probe probes[N_THREADS];
    run_probes(probes);
    for (int i = 0; i < N_THREADS; i++) {
        assert_int_equal(probes[i].info_on, 0);
        assert_int_equal(probes[i].warn_on, N_CALLS);
    }
}

/* An explicit level wins over the environment, and a later change is seen by every
 * thread that starts after it. */
static void test_set_level_overrides(void **state)
{
    (void)state;
    kvr_log_set_level(KVR_LOG_DEBUG);
    assert_true(kvr_log_enabled(KVR_LOG_DEBUG));
    kvr_log_set_level(KVR_LOG_ERROR);
    struct probe probes[N_THREADS];
    run_probes(probes);
    for (int i = 0; i < N_THREADS; i++) {
        assert_int_equal(probes[i].info_on, 0);
        assert_int_equal(probes[i].warn_on, 0);
    }
    assert_true(kvr_log_enabled(KVR_LOG_ERROR));
    kvr_log_set_level(KVR_LOG_INFO);
}

/* The names KVR_LOG accepts; anything else (or no variable) is info. */
static void test_level_names(void **state)
{
    (void)state;
    assert_int_equal(kvr_log_level_from_name("error"), KVR_LOG_ERROR);
    assert_int_equal(kvr_log_level_from_name("warn"), KVR_LOG_WARN);
    assert_int_equal(kvr_log_level_from_name("info"), KVR_LOG_INFO);
    assert_int_equal(kvr_log_level_from_name("debug"), KVR_LOG_DEBUG);
    assert_int_equal(kvr_log_level_from_name(NULL), KVR_LOG_INFO);
    assert_int_equal(kvr_log_level_from_name("DEBUG"), KVR_LOG_INFO);
    assert_int_equal(kvr_log_level_from_name(""), KVR_LOG_INFO);
}

/* Stamps are ISO 8601 in UTC with milliseconds: a known instant, the epoch, a leap day. */
static void test_stamp_format(void **state)
{
    (void)state;
    char b[KVR_LOG_STAMP_BYTES];
    assert_int_equal(kvr_log_stamp(b, 1796675101123LL), 24);
    assert_string_equal(b, "2026-12-07T20:25:01.123Z");
    kvr_log_stamp(b, 0);
    assert_string_equal(b, "1970-01-01T00:00:00.000Z");
    kvr_log_stamp(b, 951782400007LL);
    assert_string_equal(b, "2000-02-29T00:00:00.007Z");
}

/* A line on stderr starts with the wall-clock stamp (not seconds since boot), then the tag
 * and the level; its stamp is within a few seconds of time(). */
static void test_line_has_wall_clock(void **state)
{
    (void)state;
    char path[] = "/tmp/kvr-test-log.XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    kvr_log_set_tag("probe");
    KVR_INFO("hello %d", 7);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char line[256] = "";
    FILE *f = fdopen(fd, "r");
    rewind(f);
    assert_non_null(fgets(line, sizeof line, f));
    fclose(f);
    unlink(path);
    regex_t re;
    assert_int_equal(
        regcomp(&re,
                "^\\[[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z "
                "probe info\\] hello 7$",
                REG_EXTENDED | REG_NEWLINE),
        0);
    assert_int_equal(regexec(&re, line, 0, NULL, 0), 0);
    regfree(&re);
    struct tm tm = {0};
    assert_non_null(strptime(line + 1, "%Y-%m-%dT%H:%M:%S", &tm));
    long long diff = (long long)timegm(&tm) - (long long)time(NULL);
    assert_true(diff > -5 && diff < 5);
}

int main(void)
{
    /* Before anything sets it, the level is info. */
    if (!kvr_log_enabled(KVR_LOG_INFO) || kvr_log_enabled(KVR_LOG_DEBUG))
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_level_from_env_many_threads), cmocka_unit_test(test_level_names),
        cmocka_unit_test(test_set_level_overrides),         cmocka_unit_test(test_stamp_format),
        cmocka_unit_test(test_line_has_wall_clock),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
