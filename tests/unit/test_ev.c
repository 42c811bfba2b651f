/* test_ev.c - the event loop's timers: a timer disarmed with 0 or UINT64_MAX never fires
 * (a disarmed timer that fired at every turn would spin the loop), a past deadline fires
 * once at the next turn, timers fire in deadline order, a callback may re-arm its own
 * timer, and a wake-up from another thread runs the wake callback. Every deadline is fixed
 * from one reading of the clock, so the order asserted is the deadlines' however late a
 * descheduled test's turns come. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/clock.h"
#include "core/ev.h"

#include <pthread.h>
#include <string.h>

#define MS_NS 1000000ull

struct rec {
    struct kvr_ev *ev;
    int order[8], n;
    int fired[4];
    int id_self, rearms;
    uint64_t base; /* the deadlines are base + N ms */
};

static struct rec rec;

static void stop_fn(struct kvr_ev *ev, void *arg)
{
    (void)arg;
    kvr_ev_stop(ev);
}

static void mark(struct kvr_ev *ev, void *arg)
{
    (void)ev;
    int k = (int)(intptr_t)arg;
    rec.fired[k]++;
    if (rec.n < 8)
        rec.order[rec.n++] = k;
}

static void self_rearm(struct kvr_ev *ev, void *arg)
{
    mark(ev, arg);
    if (++rec.rearms < 3)
        kvr_ev_timer_at(ev, rec.id_self, rec.base + (5 + (uint64_t)rec.rearms) * MS_NS);
}

static void test_timers(void **state)
{
    (void)state;
    struct kvr_ev *ev;
    struct kvr_err err = {0};
    assert_int_equal(kvr_ev_create(&ev, &err), 0);
    memset(&rec, 0, sizeof rec);
    int t0 = kvr_ev_timer(ev, mark, (void *)0), t1 = kvr_ev_timer(ev, mark, (void *)1);
    int t2 = kvr_ev_timer(ev, self_rearm, (void *)2), t3 = kvr_ev_timer(ev, mark, (void *)3);
    int stop = kvr_ev_timer(ev, stop_fn, NULL);
    assert_true(t0 >= 0 && t1 >= 0 && t2 >= 0 && t3 >= 0 && stop >= 0);
    rec.id_self = t2;
    uint64_t now = kvr_now_ns();
    rec.base = now;
    kvr_ev_timer_at(ev, t0, now + 20 * MS_NS);
    kvr_ev_timer_at(ev, t1, 1); /* long past: the next turn */
    kvr_ev_timer_at(ev, t2, now + 5 * MS_NS);
    kvr_ev_timer_at(ev, t3, now + 10 * MS_NS);
    kvr_ev_timer_at(ev, t3, 0); /* disarmed again */
    kvr_ev_timer_at(ev, stop, now + 60 * MS_NS);
    assert_int_equal(kvr_ev_run(ev), 0);
    assert_int_equal(rec.fired[1], 1);
    assert_int_equal(rec.fired[0], 1);
    assert_int_equal(rec.fired[2], 3);
    assert_int_equal(rec.fired[3], 0);
    assert_int_equal(rec.order[0], 1);
    assert_int_equal(rec.order[rec.n - 1], 0); /* the 20 ms one after t2's 5, 6, 7 ms */

    /* A timer disarmed with 0 before the loop runs never fires (a fresh loop: a stopped
     * one stays stopped). */
    memset(&rec, 0, sizeof rec);
    kvr_ev_destroy(ev);
    assert_int_equal(kvr_ev_create(&ev, &err), 0);
    t0 = kvr_ev_timer(ev, mark, (void *)0);
    stop = kvr_ev_timer(ev, stop_fn, NULL);
    kvr_ev_timer_at(ev, t0, 0);
    kvr_ev_timer_at(ev, stop, kvr_now_ns() + 30 * MS_NS);
    assert_int_equal(kvr_ev_run(ev), 0);
    assert_int_equal(rec.fired[0], 0);
    kvr_ev_destroy(ev);
}

/* A turn that comes late fires every expired timer in deadline order, not slot order, and a
 * callback's re-arm into the past fires in its place in the same pass. */
static void test_late_turn_order(void **state)
{
    (void)state;
    struct kvr_ev *ev;
    struct kvr_err err = {0};
    assert_int_equal(kvr_ev_create(&ev, &err), 0);
    memset(&rec, 0, sizeof rec);
    int t0 = kvr_ev_timer(ev, mark, (void *)0), t1 = kvr_ev_timer(ev, mark, (void *)1);
    int t2 = kvr_ev_timer(ev, self_rearm, (void *)2), stop = kvr_ev_timer(ev, stop_fn, NULL);
    rec.id_self = t2;
    rec.base = 1000; /* long past: t2 re-arms for 6 and 7 ms after it, still in the past */
    kvr_ev_timer_at(ev, t0, rec.base + 30 * MS_NS);
    kvr_ev_timer_at(ev, t1, rec.base + 2 * MS_NS);
    kvr_ev_timer_at(ev, t2, rec.base + 5 * MS_NS);
    kvr_ev_timer_at(ev, stop, rec.base + 40 * MS_NS);
    assert_int_equal(kvr_ev_run(ev), 0);
    int want[] = {1, 2, 2, 2, 0};
    assert_int_equal(rec.n, 5);
    for (int i = 0; i < 5; i++)
        assert_int_equal(rec.order[i], want[i]);
    kvr_ev_destroy(ev);
}

static void on_wake(struct kvr_ev *ev, void *arg)
{
    (*(int *)arg)++;
    kvr_ev_stop(ev);
}

static void *waker(void *arg)
{
    kvr_ev_wake(arg);
    return NULL;
}

static void test_wake(void **state)
{
    (void)state;
    struct kvr_ev *ev;
    struct kvr_err err = {0};
    assert_int_equal(kvr_ev_create(&ev, &err), 0);
    int woken = 0;
    kvr_ev_on_wake(ev, on_wake, &woken);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, waker, ev), 0);
    assert_int_equal(kvr_ev_run(ev), 0);
    pthread_join(th, NULL);
    assert_int_equal(woken, 1);
    kvr_ev_destroy(ev);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_timers),
        cmocka_unit_test(test_late_turn_order),
        cmocka_unit_test(test_wake),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
