/* test_toolcall_grammar.c - the GBNF that forces tool calls: one rule per schema keyword it
 * supports, the named tool alone, each family's call syntax, parallel calls bounded. (The
 * grammar's sentences are checked against the parsers where a grammar engine runs them.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/openai.h"
#include "bridge/toolcall_grammar.h"
#include "core/alloc.h"

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
    assert_int_equal(kvr_toolcall_grammar(&o, &r.tools, &out), KVR_OK);
    kvr_openai_req_fini(&r);
    return kvr_sbuf_take(&out, NULL);
}

static void test_schema_rules(void **state)
{
    char *g = grammar(KVR_TOOLCALL_HERMES, "\"tool_choice\": \"required\"", false);
    assert_true(!strncmp(g, "root ::= ", 9));
    assert_non_null(strstr(g, "root ::=  call (\"\\n\" call){0,7}"));
    assert_non_null(strstr(g, "json-char{0,12}"));                     /* maxLength */
    assert_non_null(strstr(g, "\"\\\"celsius\\\"\" | \"\\\"fahrenheit\\\"\"")); /* enum */
    assert_non_null(strstr(g, "\"1\" | \"2\" | \"3\""));                 /* a small range */
    assert_non_null(strstr(g, "{0,1}"));                                 /* maxItems 2 */
    assert_non_null(strstr(g, "json-integer | "));                       /* anyOf */
    assert_non_null(strstr(g, "\"\\\"none\\\"\""));                      /* const */
    /* city and unit are required, days and tags optional after them. */
    assert_non_null(strstr(g, "\"\\\"city\\\"\" ws \":\" ws"));
    assert_non_null(strstr(g, "(ws \",\" ws \"\\\"days\\\"\""));
    assert_non_null(strstr(g, "<tool_call>\\n{\\\"name\\\": \\\"lookup\\\""));
    kvr_free(g);
}

static void test_named_and_single(void **state)
{
    char *g = grammar(KVR_TOOLCALL_HERMES,
                      "\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
                      "\"lookup\"}}",
                      false);
    assert_null(strstr(g, "get_weather"));
    assert_non_null(strstr(g, "lookup"));
    assert_null(strstr(g, "{0,7}")); /* one call */
    kvr_free(g);
    g = grammar(KVR_TOOLCALL_HERMES, "\"tool_choice\": \"required\", \"parallel_tool_calls\": false",
                false);
    assert_null(strstr(g, "{0,7}"));
    kvr_free(g);
}

static void test_families(void **state)
{
    static const struct {
        enum kvr_toolcall_family f;
        const char *want;
    } cases[] = {
        {KVR_TOOLCALL_LLAMA3, "{\\\"name\\\": \\\"lookup\\\", \\\"parameters\\\": "},
        {KVR_TOOLCALL_MISTRAL, "\"[TOOL_CALLS][\" call (\", \" call){0,7} \"]\""},
        {KVR_TOOLCALL_QWEN3_CODER, "<function=get_weather>\\n"},
        {KVR_TOOLCALL_GLM45, "<arg_key>city</arg_key>\\n<arg_value>"},
        {KVR_TOOLCALL_HARMONY, "to=functions.lookup <|constrain|>json<|message|>"},
        {KVR_TOOLCALL_DEEPSEEK_V3, "function<\xef\xbd\x9ctool\xe2\x96\x81sep"},
        {KVR_TOOLCALL_GENERIC, "{\\\"tool_calls\\\": ["},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *g = grammar(cases[i].f, "\"tool_choice\": \"required\"", false);
        if (!strstr(g, cases[i].want))
            fail_msg("%s: no '%s' in\n%s", kvr_toolcall_family_name(cases[i].f), cases[i].want, g);
        kvr_free(g);
    }
    /* A prompt that opened <think> lets the thinking end first. */
    char *g = grammar(KVR_TOOLCALL_HERMES, "\"tool_choice\": \"required\"", true);
    assert_non_null(strstr(g, "root ::= think "));
    assert_non_null(strstr(g, "\"</think>\""));
    kvr_free(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_schema_rules),
        cmocka_unit_test(test_named_and_single),
        cmocka_unit_test(test_families),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
