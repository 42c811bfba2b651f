/* test_log.c - the log level: named as KVR_LOG names it (the program sets it from the
 * environment at the start of main), changed by kvr_log_set_level, and safe to race (run
 * under ThreadSanitizer: several threads log while another sets the level). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "core/log.h"

#include <pthread.h>
#include <stdlib.h>

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

int main(void)
{
    /* Before anything sets it, the level is info. */
    if (!kvr_log_enabled(KVR_LOG_INFO) || kvr_log_enabled(KVR_LOG_DEBUG))
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_level_from_env_many_threads),
        cmocka_unit_test(test_level_names),
        cmocka_unit_test(test_set_level_overrides),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
