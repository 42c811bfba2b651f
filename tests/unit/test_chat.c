/* test_chat.c - every chat template against exact expected strings, and detection. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/chat.h"
#include "core/alloc.h"

#include <string.h>

#define MSG(r, s)                                                                                  \
    {                                                                                              \
        KVR_CHAT_ROLE_##r, s, sizeof(s) - 1                                                        \
    }

/* system, user, assistant, user: the conversation every template is checked with. */
static const struct kvr_chat_msg convo[] = {
    MSG(SYSTEM, "Be brief."),
    MSG(USER, "Hi"),
    MSG(ASSISTANT, "Hello!"),
    MSG(USER, "Name a colour."),
};
#define N_CONVO (sizeof convo / sizeof convo[0])

static void expect_render(enum kvr_chat_tmpl t, const struct kvr_chat_msg *m, size_t n,
                          const char *want)
{
    char *out = NULL;
    size_t len = 0;
    struct kvr_err err = {0};
    assert_int_equal(kvr_chat_render(t, m, n, &out, &len, &err), KVR_OK);
    assert_non_null(out);
    assert_string_equal(out, want);
    assert_int_equal(len, strlen(want));
    kvr_free(out);
}

static void test_chatml(void **state)
{
    expect_render(KVR_CHAT_TMPL_CHATML, convo, N_CONVO,
                  "<|im_start|>system\nBe brief.<|im_end|>\n"
                  "<|im_start|>user\nHi<|im_end|>\n"
                  "<|im_start|>assistant\nHello!<|im_end|>\n"
                  "<|im_start|>user\nName a colour.<|im_end|>\n"
                  "<|im_start|>assistant\n");
    expect_render(KVR_CHAT_TMPL_CHATML, convo + 1, 1,
                  "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

static void test_llama2(void **state)
{
    expect_render(KVR_CHAT_TMPL_LLAMA2, convo, N_CONVO,
                  "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s>"
                  "<s>[INST] Name a colour. [/INST]");
    expect_render(KVR_CHAT_TMPL_LLAMA2, convo + 1, 1, "[INST] Hi [/INST]");
    /* Ending on an assistant message still ends where an answer begins. */
    expect_render(KVR_CHAT_TMPL_LLAMA2, convo + 1, 2,
                  "[INST] Hi [/INST] Hello! </s><s>[INST]  [/INST]");
}

static void test_llama3(void **state)
{
    expect_render(KVR_CHAT_TMPL_LLAMA3, convo, N_CONVO,
                  "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nName a colour.<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

static void test_mistral(void **state)
{
    expect_render(KVR_CHAT_TMPL_MISTRAL, convo, N_CONVO,
                  "[INST] Be brief.\n\nHi [/INST] Hello!</s>[INST] Name a colour. [/INST]");
    expect_render(KVR_CHAT_TMPL_MISTRAL, convo + 1, 1, "[INST] Hi [/INST]");
    /* Two user messages in a row become one turn. */
    static const struct kvr_chat_msg two[] = {MSG(USER, "a"), MSG(USER, "b")};
    expect_render(KVR_CHAT_TMPL_MISTRAL, two, 2, "[INST] a\n\nb [/INST]");
}

static void test_zephyr(void **state)
{
    expect_render(KVR_CHAT_TMPL_ZEPHYR, convo, N_CONVO,
                  "<|system|>\nBe brief.</s>\n"
                  "<|user|>\nHi</s>\n"
                  "<|assistant|>\nHello!</s>\n"
                  "<|user|>\nName a colour.</s>\n"
                  "<|assistant|>\n");
}

static void test_content_not_nul_terminated(void **state)
{
    /* Content is a (pointer, length) pair: bytes after the length must not leak in. */
    const struct kvr_chat_msg m = {KVR_CHAT_ROLE_USER, "HiXXXX", 2};
    expect_render(KVR_CHAT_TMPL_CHATML, &m, 1,
                  "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    const struct kvr_chat_msg empty = {KVR_CHAT_ROLE_USER, NULL, 0};
    expect_render(KVR_CHAT_TMPL_ZEPHYR, &empty, 1, "<|user|>\n</s>\n<|assistant|>\n");
}

static void test_render_errors(void **state)
{
    char *out = (char *)1;
    struct kvr_err err = {0};
    assert_int_equal(kvr_chat_render(KVR_CHAT_TMPL_CHATML, convo, 0, &out, NULL, &err), KVR_EINVAL);
    assert_null(out);
    assert_non_null(strstr(err.msg, "no messages"));
    const struct kvr_chat_msg bad = {(enum kvr_chat_role)7, "x", 1};
    assert_int_equal(kvr_chat_render(KVR_CHAT_TMPL_CHATML, &bad, 1, &out, NULL, &err), KVR_EINVAL);
    assert_int_equal(kvr_chat_render(KVR_CHAT_TMPL_COUNT, convo, 1, &out, NULL, &err), KVR_EINVAL);

    /* Allocation failure is reported, not crashed on. */
    kvr_alloc_fail_after(0);
    int rc = kvr_chat_render(KVR_CHAT_TMPL_CHATML, convo, N_CONVO, &out, NULL, &err);
    kvr_alloc_fail_after(-1);
    assert_int_equal(rc, KVR_ENOMEM);
    assert_null(out);
}

static void test_detect(void **state)
{
    static const struct {
        const char *jinja;
        enum kvr_chat_tmpl want;
        bool known;
    } cases[] = {
        {"{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n'}}", KVR_CHAT_TMPL_CHATML,
         true},
        {"{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}",
         KVR_CHAT_TMPL_LLAMA3, true},
        {"{{ bos_token + '[INST] ' + '<<SYS>>\\n' + system }}", KVR_CHAT_TMPL_LLAMA2, true},
        {"{{ bos_token }}{% for m in messages %}{{ '[INST] ' + m['content'] + ' [/INST]' }}",
         KVR_CHAT_TMPL_MISTRAL, true},
        {"{% if m['role'] == 'user' %}{{ '<|user|>\\n' + m['content'] + eos_token }}",
         KVR_CHAT_TMPL_ZEPHYR, true},
        {"{{ messages }}", KVR_CHAT_TMPL_CHATML, false},
        {"", KVR_CHAT_TMPL_CHATML, false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        enum kvr_chat_tmpl t = KVR_CHAT_TMPL_COUNT;
        bool known = kvr_chat_tmpl_detect(cases[i].jinja, strlen(cases[i].jinja), &t);
        assert_int_equal(known, cases[i].known);
        assert_int_equal(t, cases[i].want);
    }
    enum kvr_chat_tmpl t = KVR_CHAT_TMPL_COUNT;
    assert_false(kvr_chat_tmpl_detect(NULL, 0, &t));
    assert_int_equal(t, KVR_CHAT_TMPL_CHATML);
    /* Only `len` bytes are examined. */
    assert_false(kvr_chat_tmpl_detect("<|im_start|>", 5, &t));
}

static void test_names(void **state)
{
    for (int i = 0; i < KVR_CHAT_TMPL_COUNT; i++) {
        enum kvr_chat_tmpl t = KVR_CHAT_TMPL_COUNT;
        assert_int_equal(kvr_chat_tmpl_from_name(kvr_chat_tmpl_name((enum kvr_chat_tmpl)i), &t),
                         KVR_OK);
        assert_int_equal(t, i);
    }
    enum kvr_chat_tmpl t;
    assert_int_equal(kvr_chat_tmpl_from_name("vicuna", &t), KVR_ENOTFOUND);
    assert_string_equal(kvr_chat_tmpl_name(KVR_CHAT_TMPL_COUNT), "?");
    assert_string_equal(kvr_chat_tmpl_end_of_turn(KVR_CHAT_TMPL_CHATML), "<|im_end|>");
    assert_string_equal(kvr_chat_tmpl_end_of_turn(KVR_CHAT_TMPL_LLAMA3), "<|eot_id|>");
    assert_string_equal(kvr_chat_tmpl_end_of_turn(KVR_CHAT_TMPL_ZEPHYR), "</s>");
}

/* ---- struct kvr_chat ------------------------------------------------------------------ */

static char *apply(const struct kvr_chat *c, const struct kvr_chat_msg *m, size_t n, bool gen)
{
    char *out = NULL;
    size_t len = 0;
    struct kvr_err err = {0};
    if (kvr_chat_apply(c, m, n, gen, NULL, &out, &len, &err) != KVR_OK)
        fail_msg("apply: %s", err.msg);
    assert_int_equal(len, strlen(out));
    return out;
}

static void test_chat_jinja(void **state)
{
    static const char src[] =
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
        "\n\n{{ m.content | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}";
    struct kvr_chat_config cfg = {.jinja = src,
                                  .jinja_len = sizeof src - 1,
                                  .bos_token = "<|begin_of_text|>",
                                  .eos_token = "<|eot_id|>"};
    struct kvr_chat *c = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_chat_create(&c, &cfg, &err), KVR_OK);
    assert_int_equal(kvr_chat_source(c), KVR_CHAT_SOURCE_JINJA);
    assert_string_equal(kvr_chat_end_of_turn(c), "<|eot_id|>");
    char *out = apply(c, convo + 1, 1, true);
    assert_string_equal(out, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi"
                             "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    kvr_free(out);
    out = apply(c, convo + 1, 2, false);
    assert_string_equal(out, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi"
                             "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                             "Hello!<|eot_id|>");
    kvr_free(out);
    kvr_chat_destroy(c);

    /* A template of no known family stops at the EOS text. */
    cfg.jinja = "{% for m in messages %}{{ m.content }}{% endfor %}";
    cfg.jinja_len = strlen(cfg.jinja);
    assert_int_equal(kvr_chat_create(&c, &cfg, &err), KVR_OK);
    assert_string_equal(kvr_chat_end_of_turn(c), "<|eot_id|>");
    kvr_chat_destroy(c);

    /* Parse errors at creation, refusals and runtime errors when applied. */
    cfg.jinja = "{% for m in messages %}";
    cfg.jinja_len = strlen(cfg.jinja);
    assert_int_equal(kvr_chat_create(&c, &cfg, &err), KVR_EFORMAT);
    assert_null(c);
    cfg.jinja = "{% if messages|length > 1 %}{{ raise_exception('only one message') }}"
                "{% endif %}{{ messages[0].content.nosuch() }}";
    cfg.jinja_len = strlen(cfg.jinja);
    assert_int_equal(kvr_chat_create(&c, &cfg, &err), KVR_OK);
    char *o = NULL;
    assert_int_equal(kvr_chat_apply(c, convo, 2, true, NULL, &o, NULL, &err), KVR_EINVAL);
    assert_string_equal(err.msg, "line 1: only one message");
    assert_int_equal(kvr_chat_apply(c, convo, 1, true, NULL, &o, NULL, &err), KVR_EFORMAT);
    assert_null(o);
    assert_int_equal(kvr_chat_apply(c, convo, 0, true, NULL, &o, NULL, &err), KVR_EINVAL);
    kvr_chat_destroy(c);
}

static void test_chat_builtin_and_plain(void **state)
{
    struct kvr_chat_config cfg = {.builtin = "chatml", .jinja = "{{ ignored }}", .jinja_len = 13};
    struct kvr_chat *c = NULL;
    struct kvr_err err = {0};
    assert_int_equal(kvr_chat_create(&c, &cfg, &err), KVR_OK);
    assert_int_equal(kvr_chat_source(c), KVR_CHAT_SOURCE_BUILTIN);
    assert_string_equal(kvr_chat_describe(c), "built-in template chatml");
    char *out = apply(c, convo + 1, 1, true);
    assert_string_equal(out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    kvr_free(out);
    kvr_chat_destroy(c);

    cfg.builtin = "vicuna";
    assert_int_equal(kvr_chat_create(&c, &cfg, &err), KVR_ENOTFOUND);

    struct kvr_chat_config plain = {.eos_token = "</s>"};
    assert_int_equal(kvr_chat_create(&c, &plain, &err), KVR_OK);
    assert_int_equal(kvr_chat_source(c), KVR_CHAT_SOURCE_PLAIN);
    assert_null(kvr_chat_end_of_turn(c));
    out = apply(c, convo, N_CONVO, true);
    assert_string_equal(out, "system: Be brief.\nuser: Hi\nassistant: Hello!\n"
                             "user: Name a colour.\nassistant:");
    kvr_free(out);
    out = apply(c, convo + 1, 1, false);
    assert_string_equal(out, "user: Hi\n");
    kvr_free(out);
    kvr_chat_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chatml),
        cmocka_unit_test(test_llama2),
        cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_mistral),
        cmocka_unit_test(test_zephyr),
        cmocka_unit_test(test_content_not_nul_terminated),
        cmocka_unit_test(test_render_errors),
        cmocka_unit_test(test_detect),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_chat_jinja),
        cmocka_unit_test(test_chat_builtin_and_plain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
