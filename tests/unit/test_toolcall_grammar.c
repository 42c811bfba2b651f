/* test_toolcall_grammar.c - the GBNF that forces tool calls, run by model/grammar.h: the
 * named tool alone, one call or several, the arguments' schema, each family's syntax, a
 * thinking prefix, a refused schema naming its tool. (test_toolcall checks that it accepts
 * each template's own rendering of calls.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/openai.h"
#include "bridge/toolcall_grammar.h"
#include "core/alloc.h"
#include "model/grammar.h"

#include <string.h>

static const char body[] =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": "
    "\"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"city\": {\"type\": \"string\", \"maxLength\": 12}, \"unit\": "
    "{\"type\": \"string\", \"enum\": [\"celsius\", \"fahrenheit\"]}, \"days\": {\"type\": "
    "\"integer\", \"minimum\": 1, \"maximum\": 3}, \"tags\": {\"type\": \"array\", \"items\": "
    "{\"type\": \"string\"}, \"minItems\": 1, \"maxItems\": 2}}, \"required\": [\"city\", "
    "\"unit\"]}}}, {\"type\": \"function\", \"function\": {\"name\": \"lookup\", \"parameters\": "
    "{\"type\": \"object\", \"properties\": {\"id\": {\"anyOf\": [{\"type\": \"integer\"}, "
    "{\"const\": \"none\"}]}}}}}]";

static char *grammar(enum kvr_toolcall_family f, const char *more, bool in_think)
{
    char b[2048];
    snprintf(b, sizeof b, "%s, %s}", body, more);
    struct kvr_openai_req r;
    struct kvr_openai_error e = {0};
    struct kvr_openai_limits lim = {4096, 1000};
    assert_int_equal(kvr_openai_parse(&r, KVR_OPENAI_CHAT, b, strlen(b), &lim, &e), 0);
    struct kvr_toolcall_opts o = {
        .family = f, .calls = true, .in_think = in_think, .tools = r.tools.list};
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    struct kvr_err err = {0};
    size_t bad = 99;
    assert_int_equal(kvr_toolcall_grammar(&o, &r.tools, &out, &bad, &err), KVR_OK);
    struct kvr_grammar *g = NULL;
    if (kvr_grammar_compile(&g, out.data, out.len, &err))
        fail_msg("%s: %s\n%.*s", kvr_toolcall_family_name(f), err.msg, (int)out.len, out.data);
    kvr_grammar_destroy(g);
    kvr_openai_req_fini(&r);
    return kvr_sbuf_take(&out, NULL);
}

/* Whether grammar text `g` takes `text` whole. */
static bool accepts(const char *g, const char *text)
{
    struct kvr_grammar *gr = NULL;
    struct kvr_grammar_match *m = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_grammar_compile(&gr, g, strlen(g), &err), KVR_OK);
    assert_int_equal(kvr_grammar_match_create(&m, gr), KVR_OK);
    bool ok =
        kvr_grammar_match_bytes(m, text, strlen(text)) == KVR_OK && kvr_grammar_match_complete(m);
    kvr_grammar_match_destroy(m);
    kvr_grammar_destroy(gr);
    return ok;
}

static void test_named_and_parallel(void **state)
{
    const char *named = "\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
                        "\"lookup\"}}";
    char *g = grammar(KVR_TOOLCALL_HERMES, named, false);
    assert_true(accepts(g, "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"id\": 3}}\n"
                           "</tool_call>"));
    assert_false(accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                            "\"x\", \"unit\": \"celsius\"}}\n</tool_call>"));
    /* One call only; the arguments follow the schema (the anyOf's const). */
    assert_false(accepts(g,
                         "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {}}\n</tool_call>"
                         "\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {}}\n</tool_call>"));
    assert_true(accepts(g, "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"id\": \"none\"}}"
                           "\n</tool_call>"));
    assert_false(accepts(g, "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"id\": \"x\"}}"
                            "\n</tool_call>"));
    kvr_free(g);
    g = grammar(KVR_TOOLCALL_HERMES, "\"tool_choice\": \"required\"", false);
    assert_true(accepts(g,
                        "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {}}\n</tool_call>"
                        "\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {}}\n</tool_call>"));
    /* The schema: a required property missing, an enum broken, a string too long. */
    assert_false(accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                            "\"x\"}}\n</tool_call>"));
    assert_false(accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                            "\"x\", \"unit\": \"kelvin\"}}\n</tool_call>"));
    assert_false(accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                            "\"abcdefghijklm\", \"unit\": \"celsius\"}}\n</tool_call>"));
    kvr_free(g);
}

static void test_families_and_think(void **state)
{
    static const struct {
        enum kvr_toolcall_family f;
        const char *text;
    } cases[] = {
        {KVR_TOOLCALL_LLAMA3, "{\"name\": \"lookup\", \"parameters\": {\"id\": 1}}"},
        {KVR_TOOLCALL_MISTRAL,
         "[TOOL_CALLS][{\"name\": \"lookup\", \"arguments\": {\"id\": 1}, \"id\": \"abcDEF123\"}]"},
        {KVR_TOOLCALL_QWEN3_CODER, "<tool_call>\n<function=lookup>\n<parameter=id>\n1\n"
                                   "</parameter>\n</function>\n</tool_call>"},
        {KVR_TOOLCALL_GLM45, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo"
                             "</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius"
                             "</arg_value>\n</tool_call>"},
        {KVR_TOOLCALL_HARMONY,
         "<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{\"id\": 1}"},
        {KVR_TOOLCALL_GENERIC, "{\"tool_calls\": [{\"name\": \"lookup\", \"arguments\": {}}]}"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *g = grammar(cases[i].f, "\"tool_choice\": \"required\"", false);
        if (!accepts(g, cases[i].text))
            fail_msg("%s refuses %s", kvr_toolcall_family_name(cases[i].f), cases[i].text);
        kvr_free(g);
    }
    /* A prompt that opened <think> lets the thinking end first. */
    char *g = grammar(KVR_TOOLCALL_HERMES, "\"tool_choice\": \"required\"", true);
    assert_true(accepts(g, "so a call.</think>\n<tool_call>\n{\"name\": \"lookup\", "
                           "\"arguments\": {}}\n</tool_call>"));
    kvr_free(g);
}

/* A schema the compiler refuses names its tool. */
static void test_bad_schema(void **state)
{
    const char *b = "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{"
                    "\"type\": \"function\", \"function\": {\"name\": \"a\"}}, {\"type\": "
                    "\"function\", \"function\": {\"name\": \"b\", \"parameters\": {\"type\": "
                    "\"object\", \"properties\": {\"x\": {\"not\": {}}}}}}], \"tool_choice\": "
                    "\"required\"}";
    struct kvr_openai_req r;
    struct kvr_openai_error e = {0};
    struct kvr_openai_limits lim = {4096, 1000};
    assert_int_equal(kvr_openai_parse(&r, KVR_OPENAI_CHAT, b, strlen(b), &lim, &e), 0);
    struct kvr_toolcall_opts o = {.family = KVR_TOOLCALL_HERMES, .calls = true};
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    struct kvr_err err = {0};
    size_t bad = 0;
    assert_int_equal(kvr_toolcall_grammar(&o, &r.tools, &out, &bad, &err), KVR_ENOTSUP);
    assert_int_equal(bad, 1);
    assert_non_null(strstr(err.msg, "/properties/x/not"));
    kvr_sbuf_fini(&out);
    kvr_openai_req_fini(&r);
}

static char *lazy(const char *more)
{
    char b[2048];
    snprintf(b, sizeof b, "%s, %s}", body, more);
    struct kvr_openai_req r;
    struct kvr_openai_error e = {0};
    struct kvr_openai_limits lim = {4096, 1000};
    assert_int_equal(kvr_openai_parse(&r, KVR_OPENAI_CHAT, b, strlen(b), &lim, &e), 0);
    struct kvr_toolcall_opts o = {.family = KVR_TOOLCALL_HERMES, .calls = true};
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    struct kvr_err err = {0};
    assert_int_equal(kvr_toolcall_grammar_lazy(&o, &r.tools, &out, NULL, &err), KVR_OK);
    kvr_openai_req_fini(&r);
    return kvr_sbuf_take(&out, NULL);
}

/* auto: any text without the trigger, calls valid from the trigger on, text after them. */
static void test_lazy(void **state)
{
    static const char call[] = "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"id\": 1}}"
                               "\n</tool_call>";
    char *g = lazy("\"tool_choice\": \"auto\"");
    assert_true(accepts(g, ""));
    assert_true(accepts(g, "Hello <b>there</b> a < b <tool"));
    char text[512];
    snprintf(text, sizeof text, "Let me look.\n%s\nand <<%s done", call, call);
    assert_true(accepts(g, text));
    assert_false(
        accepts(g, "x <tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>"));
    assert_false(accepts(g, "<tool_call>garbage"));
    assert_false(accepts(g, "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"id\": \"x\"}}"
                            "\n</tool_call>"));
    kvr_free(g);
    /* Without parallel calls, one call and then no trigger. */
    g = lazy("\"tool_choice\": \"auto\", \"parallel_tool_calls\": false");
    snprintf(text, sizeof text, "a %s b", call);
    assert_true(accepts(g, text));
    snprintf(text, sizeof text, "%s %s", call, call);
    assert_false(accepts(g, text));
    kvr_free(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_named_and_parallel),
        cmocka_unit_test(test_families_and_think),
        cmocka_unit_test(test_bad_schema),
        cmocka_unit_test(test_lazy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
