/* test_jsonw.c - core/jsonw.h: commas, nesting, numbers and string escapes, checked as text
 * and by parsing the result with jansson. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/jsonw.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

static void test_structure_and_numbers(void **state)
{
    (void)state;
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    struct kvr_jsonw w;
    kvr_jsonw_init(&w, &b);
    kvr_jsonw_obj(&w);
    kvr_jsonw_key(&w, "a");
    kvr_jsonw_arr(&w);
    kvr_jsonw_uint(&w, 0);
    kvr_jsonw_int(&w, -12);
    kvr_jsonw_int(&w, INT64_MIN);
    kvr_jsonw_uint(&w, UINT64_MAX);
    kvr_jsonw_end(&w);
    kvr_jsonw_key(&w, "f");
    kvr_jsonw_arr(&w);
    kvr_jsonw_fixed(&w, 12340, 3);
    kvr_jsonw_fixed(&w, -5, 1);
    kvr_jsonw_fixed(&w, 7000, 3);
    kvr_jsonw_fixed(&w, 1, 4);
    kvr_jsonw_fixed(&w, 0, 3);
    kvr_jsonw_end(&w);
    kvr_jsonw_key(&w, "o");
    kvr_jsonw_obj(&w);
    kvr_jsonw_end(&w);
    kvr_jsonw_key(&w, "t");
    kvr_jsonw_bool(&w, true);
    kvr_jsonw_key(&w, "n");
    kvr_jsonw_null(&w);
    kvr_jsonw_end(&w);
    assert_false(b.failed);
    assert_int_equal(w.depth, 0);
    assert_string_equal(b.data, "{\"a\":[0,-12,-9223372036854775808,18446744073709551615],"
                                "\"f\":[12.34,-0.5,7.0,0.0001,0.0],\"o\":{},\"t\":true,"
                                "\"n\":null}");
    kvr_sbuf_fini(&b);
}

/* The fast paths a telemetry snapshot uses: literal keys, values built whole, and the
 * number text, which must be what snprintf gives at every digit count. */
static void test_plain_keys_raw_values_and_number_text(void **state)
{
    (void)state;
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    struct kvr_jsonw w;
    kvr_jsonw_init(&w, &b);
    kvr_jsonw_obj(&w);
    KVR_JSONW_KEY(&w, "seqs");
    kvr_jsonw_arr(&w);
    kvr_jsonw_raw(&w, "{\"seq\":1}", 9);
    kvr_jsonw_raw(&w, "[2,3]", 5);
    kvr_jsonw_end(&w);
    KVR_JSONW_KEY(&w, "n");
    kvr_jsonw_uint(&w, 4);
    kvr_jsonw_end(&w);
    assert_false(b.failed);
    assert_string_equal(b.data, "{\"seqs\":[{\"seq\":1},[2,3]],\"n\":4}");
    kvr_sbuf_fini(&b);

    char got[48], want[48];
    uint64_t v = 1;
    for (int k = 0; k < 20; k++, v *= 10) {
        uint64_t cases[3] = {v - 1, v, v + v / 3};
        for (int c = 0; c < 3; c++) {
            *kvr_jsonw_uint_text(got, cases[c]) = 0;
            snprintf(want, sizeof want, "%llu", (unsigned long long)cases[c]);
            assert_string_equal(got, want);
        }
    }
    *kvr_jsonw_uint_text(got, UINT64_MAX) = 0;
    assert_string_equal(got, "18446744073709551615");
    *kvr_jsonw_fixed_text(got, 628438477, 3) = 0;
    assert_string_equal(got, "628438.477");
    *kvr_jsonw_fixed_text(got, -1200, 4) = 0;
    assert_string_equal(got, "-0.12");
    *kvr_jsonw_fixed_text(got, 99990000, 4) = 0;
    assert_string_equal(got, "9999.0");
    *kvr_jsonw_fixed_text(got, INT64_MIN, 9) = 0;
    assert_string_equal(got, "-9223372036.854775808");
}

static void test_strings_are_always_valid_json(void **state)
{
    (void)state;
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    struct kvr_jsonw w;
    kvr_jsonw_init(&w, &b);
    kvr_jsonw_arr(&w);
    kvr_jsonw_str(&w, "q\"b\\n\nt\t\x01 \xc3\xa9");
    kvr_jsonw_str(&w, "cut \xe2\x82");        /* a character cut short */
    kvr_jsonw_str(&w, "bad \xff x \xc0\xaf"); /* bytes no character starts with */
    kvr_jsonw_str(&w, NULL);
    kvr_jsonw_end(&w);
    assert_false(b.failed);
    assert_string_equal(b.data, "[\"q\\\"b\\\\n\\nt\\u0009\\u0001 \xc3\xa9\",\"cut \xef\xbf\xbd\","
                                "\"bad \xef\xbf\xbd x \xef\xbf\xbd\xef\xbf\xbd\",\"\"]");
    json_error_t je;
    json_t *j = json_loads(b.data, 0, &je);
    assert_non_null(j);
    assert_string_equal(json_string_value(json_array_get(j, 0)), "q\"b\\n\nt\t\x01 \xc3\xa9");
    json_decref(j);
    kvr_sbuf_fini(&b);
}

/* Text past the staging buffer (long strings, many values) arrives whole and in order; a
 * top-level scalar needs a flush. */
static void test_long_documents(void **state)
{
    (void)state;
    static char big[3 * KVR_JSONW_BUF_BYTES];
    memset(big, 'x', sizeof big - 1);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    struct kvr_jsonw w;
    kvr_jsonw_init(&w, &b);
    kvr_jsonw_arr(&w);
    for (uint32_t i = 0; i < 2000; i++)
        kvr_jsonw_uint(&w, i);
    kvr_jsonw_str(&w, big);
    kvr_jsonw_end(&w);
    assert_false(b.failed);
    json_error_t je;
    json_t *j = json_loads(b.data, 0, &je);
    assert_non_null(j);
    assert_int_equal(json_array_size(j), 2001);
    assert_int_equal(json_integer_value(json_array_get(j, 1999)), 1999);
    assert_int_equal(strlen(json_string_value(json_array_get(j, 2000))), sizeof big - 1);
    json_decref(j);
    kvr_sbuf_clear(&b);
    kvr_jsonw_init(&w, &b);
    kvr_jsonw_fixed(&w, 25, 1);
    assert_int_equal(b.len, 0); /* still staged */
    kvr_jsonw_flush(&w);
    assert_string_equal(b.data, "2.5");
    kvr_sbuf_fini(&b);
}

static void test_misuse_marks_the_buffer_failed(void **state)
{
    (void)state;
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    struct kvr_jsonw w;
    kvr_jsonw_init(&w, &b);
    kvr_jsonw_end(&w); /* nothing open */
    assert_true(b.failed);
    kvr_sbuf_fini(&b);

    kvr_sbuf_init(&b);
    kvr_jsonw_init(&w, &b);
    for (int i = 0; i <= KVR_JSONW_MAX_DEPTH; i++)
        kvr_jsonw_arr(&w);
    assert_true(b.failed);
    kvr_sbuf_fini(&b);

    kvr_sbuf_init(&b);
    kvr_jsonw_init(&w, &b);
    kvr_jsonw_fixed(&w, 1, 10); /* more decimals than the writer keeps */
    assert_true(b.failed);
    kvr_sbuf_fini(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_structure_and_numbers),
        cmocka_unit_test(test_plain_keys_raw_values_and_number_text),
        cmocka_unit_test(test_strings_are_always_valid_json),
        cmocka_unit_test(test_long_documents),
        cmocka_unit_test(test_misuse_marks_the_buffer_failed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
