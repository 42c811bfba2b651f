/* test_console.c - the embedded console: every file of web/console/ is there and typed, "/"
 * is the page, and the page names only its own assets (no CDN, no inline script or style,
 * which the Content-Security-Policy would refuse anyway). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "bridge/console.h"

#include <stdio.h>
#include <string.h>

static const char *const required[] = {"/index.html", "/console.js", "/console.css",
                                       "/favicon.svg"};

static void test_assets_present_and_typed(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        const void *data = NULL;
        size_t len = 0;
        const char *type = NULL;
        if (kvr_console_asset(required[i], &data, &len, &type) != 0)
            fail_msg("%s is not embedded", required[i]);
        assert_true(len > 0);
        assert_non_null(data);
        assert_string_not_equal(type, "application/octet-stream");
    }
    const void *d1, *d2;
    size_t l1, l2;
    const char *t1, *t2;
    assert_int_equal(kvr_console_asset("/", &d1, &l1, &t1), 0);
    assert_int_equal(kvr_console_asset("/index.html", &d2, &l2, &t2), 0);
    assert_ptr_equal(d1, d2);
    assert_string_equal(t1, "text/html; charset=utf-8");
    assert_int_equal(kvr_console_asset("/console.js", &d1, &l1, &t1), 0);
    assert_string_equal(t1, "text/javascript; charset=utf-8");
    assert_int_equal(kvr_console_asset("/console.css", &d1, &l1, &t1), 0);
    assert_string_equal(t1, "text/css; charset=utf-8");
    assert_int_equal(kvr_console_asset("/favicon.svg", &d1, &l1, &t1), 0);
    assert_string_equal(t1, "image/svg+xml");
    /* Every embedded file has a known type and its bytes end in the NUL the generator adds. */
    assert_true(kvr_console_n_files >= 4);
    for (size_t i = 0; i < kvr_console_n_files; i++) {
        const struct kvr_console_file *f = &kvr_console_files[i];
        assert_true(f->path[0] == '/');
        assert_string_not_equal(kvr_console_content_type(f->path), "application/octet-stream");
        assert_int_equal(f->data[f->len], 0);
        assert_int_equal(strlen((const char *)f->data), f->len); /* text, no NUL inside */
        if (i > 0)
            assert_true(strcmp(kvr_console_files[i - 1].path, f->path) < 0);
    }
}

static void test_unknown_paths_refused(void **state)
{
    (void)state;
    const char *bad[] = {"",
                         "/index",
                         "/../CMakeLists.txt",
                         "/console.js?x",
                         "//console.js",
                         "/CONSOLE.JS",
                         "/console.js/",
                         "index.html",
                         "/v1/telemetry"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const void *d;
        size_t l;
        const char *t;
        if (kvr_console_asset(bad[i], &d, &l, &t) == 0)
            fail_msg("'%s' should not be an asset", bad[i]);
    }
    const void *d;
    size_t l;
    const char *t;
    assert_int_equal(kvr_console_asset(NULL, &d, &l, &t), -1);
}

static void test_csp(void **state)
{
    (void)state;
    assert_non_null(strstr(kvr_console_csp, "default-src 'none'"));
    assert_non_null(strstr(kvr_console_csp, "script-src 'self'"));
    assert_non_null(strstr(kvr_console_csp, "connect-src 'self'"));
    assert_non_null(strstr(kvr_console_csp, "style-src 'self'"));
    assert_null(strstr(kvr_console_csp, "unsafe"));
    assert_null(strchr(kvr_console_csp, '\n'));
}

/* The value of every `attr="..."` in the page must be an embedded asset. */
static void check_refs(const char *html, const char *attr)
{
    char pat[16];
    snprintf(pat, sizeof pat, " %s=\"", attr);
    for (const char *p = strstr(html, pat); p; p = strstr(p + 1, pat)) {
        const char *v = p + strlen(pat);
        const char *end = strchr(v, '"');
        assert_non_null(end);
        char ref[256];
        size_t n = (size_t)(end - v);
        assert_true(n > 0 && n < sizeof ref);
        memcpy(ref, v, n);
        ref[n] = 0;
        if (strcmp(attr, "href") == 0 && ref[0] == '#')
            continue; /* in-page anchors */
        const void *d;
        size_t l;
        const char *t;
        if (ref[0] != '/' || kvr_console_asset(ref, &d, &l, &t) != 0)
            fail_msg("the page refers to %s=\"%s\", which is not an embedded asset", attr, ref);
    }
}

static void test_page_is_self_contained(void **state)
{
    (void)state;
    const void *d;
    size_t l;
    const char *t;
    assert_int_equal(kvr_console_asset("/", &d, &l, &t), 0);
    const char *html = d;
    check_refs(html, "src");
    check_refs(html, "href");
    assert_non_null(strstr(html, "<script src=\"/console.js\""));
    /* No inline script, no inline style, no event-handler attributes. */
    for (const char *p = strstr(html, "<script"); p; p = strstr(p + 1, "<script")) {
        const char *close = strchr(p, '>');
        assert_non_null(close);
        assert_true(strstr(p, " src=\"") && strstr(p, " src=\"") < close);
        assert_true(strncmp(close, "></script>", 10) == 0);
    }
    assert_null(strstr(html, "<style"));
    assert_null(strstr(html, " style=\""));
    assert_null(strstr(html, " onclick="));
    assert_null(strstr(html, " onload="));
    /* Nothing in any asset points off the server. */
    for (size_t i = 0; i < kvr_console_n_files; i++) {
        const char *text = (const char *)kvr_console_files[i].data;
        const char *off[] = {"http://", "https://", "url(//", "src=\"//", "href=\"//", "@import"};
        for (size_t k = 0; k < sizeof off / sizeof off[0]; k++) {
            const char *hit = strstr(text, off[k]);
            /* SVG's namespace is a name, not a request. */
            while (hit && strncmp(hit, "http://www.w3.org/2000/svg", 26) == 0)
                hit = strstr(hit + 1, off[k]);
            if (hit)
                fail_msg("%s contains \"%.40s\"", kvr_console_files[i].path, hit);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_assets_present_and_typed),
        cmocka_unit_test(test_unknown_paths_refused),
        cmocka_unit_test(test_csp),
        cmocka_unit_test(test_page_is_self_contained),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
