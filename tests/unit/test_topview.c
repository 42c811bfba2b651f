/* test_topview.c - `kvasir top`'s view (client/topview.h): a metrics text as the bridge
 * writes it (per stage and per expert agent) read into a snapshot, and the frames drawn
 * from one snapshot (no rates yet) and from two (fractions of the interval, rates), with the
 * expert agents' rows, their load share, and the series a frame leaves out when absent. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "client/topview.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* The bridge's series (service_ring.c) for 2 stages and 2 agents at time t; agent 0 has
 * held h0 seconds and computed p0 pairs, agent 1 a third of them. Plus lines a reader must
 * ignore: an agent label that is not a number, one beyond the table, an unknown series. */
static void metrics_text(char *out, size_t cap, double h0, double p0)
{
    snprintf(out, cap,
             "# HELP kvasir:ring_up 1 when every link of the ring is up.\n"
             "# TYPE kvasir:ring_up gauge\n"
             "kvasir:ring_up 1\n"
             "kvasir:num_requests_running 3\n"
             "kvasir:num_requests_waiting 0\n"
             "kvasir:generation_tokens_total 1000\n"
             "kvasir:stage_utilization{stage=\"0\"} 0.5\n"
             "kvasir:stage_utilization{stage=\"1\"} 0.25\n"
             "kvasir:stage_starved_fraction{stage=\"0\"} 0.1\n"
             "kvasir:stage_blocked_fraction{stage=\"1\"} 0\n"
             "# TYPE kvasir:expert_held_seconds_total counter\n"
             "kvasir:expert_held_seconds_total{agent=\"0\"} %.9g\n"
             "kvasir:expert_held_seconds_total{agent=\"1\"} %.9g\n"
             "kvasir:expert_starved_seconds_total{agent=\"0\"} 4\n"
             "kvasir:expert_starved_seconds_total{agent=\"1\"} 5\n"
             "kvasir:expert_blocked_seconds_total{agent=\"0\"} 0\n"
             "kvasir:expert_blocked_seconds_total{agent=\"1\"} 0\n"
             "kvasir:expert_pairs_total{agent=\"0\"} %.9g\n"
             "kvasir:expert_pairs_total{agent=\"1\"} %.9g\n"
             "kvasir:expert_pairs_total{agent=\"x\"} 7\n"
             "kvasir:expert_pairs_total{agent=\"64\"} 7\n"
             "kvasir:expert_lunch_total{agent=\"9\"} 7\n",
             h0, h0 / 3, p0, p0 / 3);
}

static void read_text(struct kvr_top_snapshot *s, const char *text, uint64_t t_ns)
{
    struct kvr_prom p;
    assert_int_equal(kvr_prom_parse(&p, text, strlen(text)), 0);
    memset(s, 0, sizeof *s);
    kvr_top_read(&p, s);
    s->t_ns = t_ns;
    s->ok = true;
    kvr_prom_fini(&p);
}

/* The frame's line that starts with `prefix`, copied to line (without its newline). */
static bool line_of(const char *frame, const char *prefix, char *line, size_t cap)
{
    for (const char *l = frame; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        if (strncmp(l, prefix, strlen(prefix)))
            continue;
        const char *e = strchr(l, '\n');
        size_t n = e ? (size_t)(e - l) : strlen(l);
        snprintf(line, cap, "%.*s", (int)(n < cap ? n : cap - 1), l);
        return true;
    }
    return false;
}

static void test_read_agents(void **state)
{
    (void)state;
    static char text[4096];
    static struct kvr_top_snapshot s;
    metrics_text(text, sizeof text, 3, 300);
    read_text(&s, text, 0);
    assert_int_equal(s.n_stages, 2);
    assert_int_equal(s.n_agents, 2); /* "x", "64" and the unknown series are ignored */
    assert_true(s.agent_held_s[0] == 3 && s.agent_held_s[1] == 1);
    assert_true(s.agent_starved_s[0] == 4 && s.agent_starved_s[1] == 5);
    assert_true(s.agent_pairs[0] == 300 && s.agent_pairs[1] == 100);
    assert_true(isnan(s.agent_pairs[2]));
    assert_true(s.held[1] == 0.25 && isnan(s.blocked[0]));
}

static void test_render_first(void **state)
{
    (void)state;
    static char text[4096];
    static struct kvr_top_snapshot s;
    metrics_text(text, sizeof text, 3, 300);
    read_text(&s, text, 0);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    kvr_top_render(&b, false, "http://h:1", "12:00:00", &s, NULL);
    kvr_sbuf_puts(&b, "");
    assert_false(b.failed);
    const char *f = b.data;
    assert_non_null(strstr(f, "ring UP  2 stages  2 expert agents  12:00:00"));
    assert_null(strchr(f, '\033')); /* plain: no escapes */
    char line[256];
    assert_true(line_of(f, "agent  held (busy)", line, sizeof line));
    assert_non_null(strstr(line, "starved (no work)"));
    assert_non_null(strstr(line, "pairs"));
    /* No previous poll: no fractions of an interval, the totals and the load share. */
    assert_true(line_of(f, "    0  [", line, sizeof line)); /* stage 0 */
    assert_true(line_of(strstr(f, "agent  held"), "    0  [", line, sizeof line));
    assert_non_null(strstr(line, "]     -"));
    assert_non_null(strstr(line, "300  share 75.0%"));
    assert_true(line_of(strstr(f, "agent  held"), "    1  [", line, sizeof line));
    assert_non_null(strstr(line, "100  share 25.0%"));
    assert_null(strstr(strstr(f, "agent  held"), "    2  ["));
    kvr_sbuf_fini(&b);
}

static void test_render_interval(void **state)
{
    (void)state;
    static char text[4096];
    static struct kvr_top_snapshot before, now;
    metrics_text(text, sizeof text, 3, 300);
    read_text(&before, text, 1000000000ull);
    /* 2 s later: agent 0 held 1 s more (50% of the interval), 100 pairs more (50/s);
     * agent 1 a third of that; neither starved nor blocked in between. */
    metrics_text(text, sizeof text, 4, 400);
    read_text(&now, text, 3000000000ull);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    kvr_top_render(&b, false, "http://h:1", "12:00:01", &now, &before);
    kvr_sbuf_puts(&b, "");
    assert_false(b.failed);
    const char *agents = strstr(b.data, "agent  held");
    assert_non_null(agents);
    char line[256];
    assert_true(line_of(agents, "    0  [", line, sizeof line));
    assert_string_equal(line, "    0  [########........]  50.0%  [................]   0.0%  "
                              "[................]   0.0%  400 (50.0/s)  share 75.0%");
    assert_true(line_of(agents, "    1  [", line, sizeof line));
    assert_non_null(strstr(line, "[###.............]  16.7%"));
    assert_non_null(strstr(line, "(16.7/s)  share 25.0%"));
    kvr_sbuf_fini(&b);
    /* With ANSI: the busy part coloured, every line ends by clearing the rest of it. */
    kvr_sbuf_init(&b);
    kvr_top_render(&b, true, "http://h:1", "12:00:01", &now, &before);
    kvr_sbuf_puts(&b, "");
    assert_non_null(strstr(b.data, "[\033[32m########\033[0m........]  50.0%"));
    assert_null(strstr(b.data, "%\n"));
    kvr_sbuf_fini(&b);
}

static void test_render_no_agents(void **state)
{
    (void)state;
    static struct kvr_top_snapshot s;
    read_text(&s, "kvasir:ring_up 0\nkvasir:stage_utilization{stage=\"0\"} 1\n", 0);
    assert_int_equal(s.n_agents, 0);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    kvr_top_render(&b, false, "http://h:1", "12:00:00", &s, NULL);
    kvr_sbuf_puts(&b, "");
    assert_non_null(strstr(b.data, "ring DOWN  1 stages  12:00:00"));
    assert_null(strstr(b.data, "expert agents"));
    assert_null(strstr(b.data, "agent  held"));
    kvr_sbuf_fini(&b);
    /* Unreachable: the error, nothing else. */
    memset(&s, 0, sizeof s);
    snprintf(s.error, sizeof s.error, "connect: refused");
    kvr_sbuf_init(&b);
    kvr_top_render(&b, false, "http://h:1", "12:00:00", &s, NULL);
    kvr_sbuf_puts(&b, "");
    assert_string_equal(b.data,
                        "kvasir top  http://h:1  UNREACHABLE  12:00:00\n  connect: refused\n");
    kvr_sbuf_fini(&b);
    /* A 401 is named as such: the server is there, the key is not right. */
    s.status = 401;
    snprintf(s.error, sizeof s.error, "unauthorized: give --api-key");
    kvr_sbuf_init(&b);
    kvr_top_render(&b, false, "http://h:1", "12:00:00", &s, NULL);
    kvr_sbuf_puts(&b, "");
    assert_string_equal(
        b.data, "kvasir top  http://h:1  UNAUTHORIZED  12:00:00\n  unauthorized: give --api-key\n");
    kvr_sbuf_fini(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read_agents),
        cmocka_unit_test(test_render_first),
        cmocka_unit_test(test_render_interval),
        cmocka_unit_test(test_render_no_agents),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
