/* test_svg.c - the SVG line-plot writer of `kvasir bench`'s sweep plot: well-formed XML
 * (checked by a small checker that is itself shown to fail on bad input) that contains every
 * series, escaped text, lines broken at NaN, log-axis decade labels, and nice tick positions. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "client/svg.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- SVG ------------------------------------------------------------------------------- */

/* A small XML well-formedness check: balanced, properly nested tags, quoted attributes,
 * only known entities, no stray '<' or '&'. Returns NULL or what is wrong. */
static const char *xml_check(const char *s)
{
    const char *stack[64];
    size_t depth = 0, lens[64];
    bool root_seen = false;
    while (*s) {
        if (*s == '&') {
            const char *ents[] = {"&lt;", "&gt;", "&amp;", "&quot;", "&apos;"};
            bool ok = false;
            for (size_t i = 0; i < 5 && !ok; i++)
                ok = !strncmp(s, ents[i], strlen(ents[i]));
            if (!ok)
                return "bad entity";
            s++;
            continue;
        }
        if (*s != '<') {
            if (depth == 0 && *s != '\n' && *s != ' ')
                return "text outside the root";
            s++;
            continue;
        }
        if (s[1] == '?') {
            const char *e = strstr(s, "?>");
            if (!e)
                return "unclosed <?";
            s = e + 2;
            continue;
        }
        bool closing = s[1] == '/';
        const char *name = s + (closing ? 2 : 1);
        size_t nlen = strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-:");
        if (nlen == 0)
            return "tag without name";
        const char *p = name + nlen;
        if (closing) {
            if (*p != '>' || depth == 0 || lens[depth - 1] != nlen ||
                strncmp(stack[depth - 1], name, nlen))
                return "mismatched closing tag";
            depth--;
            s = p + 1;
            continue;
        }
        /* Attributes: name="value" with no '<' inside values. */
        for (;;) {
            while (*p == ' ' || *p == '\n')
                p++;
            if (*p == '>' || (p[0] == '/' && p[1] == '>'))
                break;
            size_t an =
                strspn(p, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-:");
            if (an == 0 || p[an] != '=' || p[an + 1] != '"')
                return "bad attribute";
            p += an + 2;
            while (*p && *p != '"') {
                if (*p == '<')
                    return "'<' in an attribute";
                p++;
            }
            if (!*p)
                return "unclosed attribute";
            p++;
        }
        if (*p == '/') {
            s = p + 2;
            if (depth == 0)
                return "empty root";
            continue;
        }
        if (depth == 0 && root_seen)
            return "two roots";
        if (depth == 64)
            return "too deep";
        root_seen = true;
        stack[depth] = name;
        lens[depth++] = nlen;
        s = p + 1;
    }
    return depth == 0 && root_seen ? NULL : "unclosed element";
}

static void test_xml_checker_fails(void **state)
{
    (void)state;
    /* The checker itself must be able to fail. */
    assert_non_null(xml_check("<a><b></a></b>"));
    assert_non_null(xml_check("<a x=1></a>"));
    assert_non_null(xml_check("<a>&nope;</a>"));
    assert_non_null(xml_check("<a>"));
    assert_non_null(xml_check("<a/><b/>"));
    assert_null(xml_check("<?xml version=\"1.0\"?>\n<a x=\"1\"><b/>t &amp; u</a>\n"));
}

static void test_svg(void **state)
{
    (void)state;
    double x[] = {1, 2, 4, 8}, y1[] = {12, 15, NAN, 400}, y2[] = {30, 45, 80, 1200};
    double g[] = {1, 2, 3.5, 4};
    struct kvr_svg_series lat[] = {
        {.name = "TTFT p50", .color = "#1f77b4", .x = x, .y = y1, .n = 4},
        {.name = "E2E p99 <&\"'>", .color = "#d62728", .dashed = true, .x = x, .y = y2, .n = 4},
    };
    struct kvr_svg_series gp[] = {{.name = "goodput", .color = "#2ca02c", .x = x, .y = g, .n = 4}};
    struct kvr_svg_panel panels[] = {
        {.title = "Latency",
         .x_label = "offered rate (req/s)",
         .y_label = "ms",
         .log_y = true,
         .series = lat,
         .n_series = 2},
        {.title = "Goodput",
         .x_label = "offered rate (req/s)",
         .y_label = "req/s",
         .series = gp,
         .n_series = 1},
    };
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    kvr_svg_write(&b, "kvasir bench & friends", panels, 2);
    assert_false(b.failed);
    const char *why = xml_check(b.data);
    if (why)
        fail_msg("SVG is not well-formed: %s\n%s", why, b.data);
    assert_non_null(strstr(b.data, "<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert_non_null(strstr(b.data, "data-name=\"TTFT p50\""));
    assert_non_null(strstr(b.data, "E2E p99 &lt;&amp;&quot;&apos;&gt;"));
    assert_non_null(strstr(b.data, "data-name=\"goodput\""));
    assert_non_null(strstr(b.data, "kvasir bench &amp; friends"));
    assert_non_null(strstr(b.data, "offered rate (req/s)"));
    /* The NaN splits the TTFT line into two polylines; E2E is one; goodput one. */
    size_t n_poly = 0;
    for (const char *p = b.data; (p = strstr(p, "<polyline")); p++)
        n_poly++;
    assert_int_equal(n_poly, 4);
    /* Log axis: decade ticks 10 and 1000 are labelled. */
    assert_non_null(strstr(b.data, ">10</text>"));
    assert_non_null(strstr(b.data, ">1000</text>"));
    kvr_sbuf_fini(&b);

    /* No data at all still gives a valid document. */
    struct kvr_svg_panel empty = {.title = "none", .x_label = "x", .y_label = "y"};
    kvr_sbuf_init(&b);
    kvr_svg_write(&b, "empty", &empty, 1);
    assert_null(xml_check(b.data));
    kvr_sbuf_fini(&b);
}

static void test_nice_ticks(void **state)
{
    (void)state;
    double t[32];
    size_t n = kvr_svg_nice_ticks(0, 9.3, 8, t, 32);
    assert_true(n >= 5 && n <= 11);
    assert_true(t[0] <= 0 && t[n - 1] >= 9.3);
    double step = t[1] - t[0];
    for (size_t i = 1; i < n; i++)
        assert_true(fabs(t[i] - t[i - 1] - step) < 1e-9);
    n = kvr_svg_nice_ticks(0.1, 0.35, 6, t, 32);
    assert_true(t[0] <= 0.1 && t[n - 1] >= 0.35);
    /* Labels print without float noise: 0.3 exactly. */
    bool found = false;
    for (size_t i = 0; i < n; i++)
        found |= t[i] == 0.3;
    assert_true(found);
    n = kvr_svg_nice_ticks(5, 5, 8, t, 32);
    assert_true(n >= 2 && t[0] <= 5 && t[n - 1] >= 5);
    assert_int_equal(kvr_svg_nice_ticks(NAN, 1, 8, t, 32), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_xml_checker_fails),
        cmocka_unit_test(test_svg),
        cmocka_unit_test(test_nice_ticks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
