/* test_reply.c - answers in Chat Completions' and the Responses API's shapes: tool calls
 * with ids and finish_reason "tool_calls", streamed deltas that add up to the whole answer,
 * reasoning apart from text, answers cut inside a call; and the Responses request mapping
 * (items, tools, previous_response_id). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/reply.h"
#include "bridge/responses.h"
#include "core/alloc.h"

#include <string.h>

static const char hermes_tmpl[] =
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}{# <tool_call> #}";
static const char think_tmpl[] =
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}{# <tool_call> #}";

static const char tools_body[] =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"weather in Oslo?\"}], \"tools\": [{"
    "\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}]}";

static const char answer[] = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", "
                             "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";

struct fixture {
    struct kvr_chat *chat;
    struct kvr_openai_req req;
    struct kvr_reply reply;
    struct kvr_openai_meta meta;
};

static void setup(struct fixture *f, const char *tmpl, const char *body, const char *prompt,
                  enum kvr_reply_format format)
{
    memset(f, 0, sizeof *f);
    struct kvr_chat_config cfg = {.jinja = tmpl, .jinja_len = strlen(tmpl)};
    struct kvr_err err = {0};
    assert_int_equal(kvr_chat_create(&f->chat, &cfg, &err), KVR_OK);
    struct kvr_openai_limits lim = {.n_ctx = 4096, .n_vocab = 1000};
    struct kvr_openai_error e = {0};
    assert_int_equal(kvr_openai_parse(&f->req, KVR_OPENAI_CHAT, body, strlen(body), &lim, &e), 0);
    assert_true(format == KVR_REPLY_RESPONSES || kvr_reply_wanted(f->chat, &f->req));
    assert_int_equal(kvr_reply_init(&f->reply, format, f->chat, &f->req, prompt, strlen(prompt),
                                    "chatcmpl-0123456789abcdef01234567"),
                     KVR_OK);
    f->reply.resp_request = f->req.msgs_json;
    f->meta = (struct kvr_openai_meta){.api = KVR_OPENAI_CHAT, .id = "chatcmpl-x", .model = "m"};
}

static void teardown(struct fixture *f)
{
    kvr_reply_fini(&f->reply);
    kvr_openai_req_fini(&f->req);
    kvr_chat_destroy(f->chat);
}

static void test_chat_json_tool_call(void **state)
{
    struct fixture f;
    setup(&f, hermes_tmpl, tools_body, "", KVR_REPLY_CHAT);
    struct kvr_reply_info in = {&f.meta, KVR_OPENAI_FINISH_STOP, 10, 20, NULL};
    size_t len;
    char *body = kvr_reply_json(&f.reply, &in, answer, strlen(answer), &len);
    assert_non_null(body);
    json_t *j = json_loads(body, 0, NULL);
    json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "tool_calls");
    json_t *msg = json_object_get(choice, "message");
    assert_string_equal(json_string_value(json_object_get(msg, "content")), "Let me check.");
    json_t *call = json_array_get(json_object_get(msg, "tool_calls"), 0);
    assert_string_equal(json_string_value(json_object_get(call, "type")), "function");
    assert_true(!strncmp(json_string_value(json_object_get(call, "id")), "call_", 5));
    json_t *fn = json_object_get(call, "function");
    assert_string_equal(json_string_value(json_object_get(fn, "name")), "get_weather");
    assert_string_equal(json_string_value(json_object_get(fn, "arguments")), "{\"city\":\"Oslo\"}");
    json_decref(j);
    kvr_free(body);
    teardown(&f);

    /* Without parallel_tool_calls, a second call in the answer is dropped. */
    char b2[1024];
    snprintf(b2, sizeof b2, "%.*s, \"parallel_tool_calls\": false}", (int)strlen(tools_body) - 1,
             tools_body);
    setup(&f, hermes_tmpl, b2, "", KVR_REPLY_CHAT);
    char two[512];
    snprintf(two, sizeof two, "%s\n%s", answer, answer + strlen("Let me check.\n"));
    body = kvr_reply_json(&f.reply, &in, two, strlen(two), &len);
    j = json_loads(body, 0, NULL);
    msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    assert_int_equal(json_array_size(json_object_get(msg, "tool_calls")), 1);
    json_decref(j);
    kvr_free(body);
    teardown(&f);
}

/* Fed one byte at a time, the chunks' text and tool-call deltas add up, by index, to the
 * whole answer, as the OpenAI SDK assembles them; the first delta of a call carries id,
 * type and name. */
static void test_chat_stream_deltas(void **state)
{
    struct fixture f;
    setup(&f, hermes_tmpl, tools_body, "", KVR_REPLY_CHAT);
    struct kvr_reply_info in = {&f.meta, KVR_OPENAI_FINISH_NONE, 10, 0, NULL};
    struct kvr_sbuf out;
    kvr_sbuf_init(&out);
    assert_int_equal(kvr_reply_sse_start(&f.reply, &out, &in), KVR_OK);
    size_t n = strlen(answer);
    for (size_t i = 0; i < n; i++) {
        in.finish = i + 1 == n ? KVR_OPENAI_FINISH_STOP : KVR_OPENAI_FINISH_NONE;
        assert_int_equal(kvr_reply_sse(&f.reply, &out, &in, answer + i, 1, i + 1 == n), KVR_OK);
    }
    char text[256] = "", args[256] = "", name[64] = "", finish[32] = "";
    bool done = false;
    for (char *p = out.data; (p = strstr(p, "data: ")); p += 6) {
        if (!strncmp(p + 6, "[DONE]", 6)) {
            done = true;
            break;
        }
        json_t *j = json_loadb(p + 6, strcspn(p + 6, "\n"), 0, NULL);
        assert_non_null(j);
        json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
        json_t *d = json_object_get(choice, "delta");
        const char *c = json_string_value(json_object_get(d, "content"));
        if (c)
            strcat(text, c);
        json_t *tc = json_array_get(json_object_get(d, "tool_calls"), 0);
        if (tc) {
            assert_int_equal(json_integer_value(json_object_get(tc, "index")), 0);
            json_t *fn = json_object_get(tc, "function");
            const char *nm = json_string_value(json_object_get(fn, "name"));
            if (nm) {
                assert_string_equal(json_string_value(json_object_get(tc, "type")), "function");
                assert_non_null(json_string_value(json_object_get(tc, "id")));
                strcpy(name, nm);
            }
            strcat(args, json_string_value(json_object_get(fn, "arguments")));
        }
        const char *fr = json_string_value(json_object_get(choice, "finish_reason"));
        if (fr)
            strcpy(finish, fr);
        json_decref(j);
    }
    assert_true(done);
    assert_string_equal(text, "Let me check.\n");
    assert_string_equal(name, "get_weather");
    assert_string_equal(args, "{\"city\":\"Oslo\"}");
    assert_string_equal(finish, "tool_calls");
    kvr_sbuf_fini(&out);
    teardown(&f);
}

/* A prompt that opens <think>: reasoning_content, then text; a call cut by max_tokens is
 * "length" and no call. */
static void test_reasoning_and_cut(void **state)
{
    struct fixture f;
    const char *body = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}";
    setup(&f, think_tmpl, body, "<|im_start|>assistant\n<think>\n", KVR_REPLY_CHAT);
    struct kvr_reply_info in = {&f.meta, KVR_OPENAI_FINISH_STOP, 1, 2, NULL};
    const char *a = "I should greet.\n</think>\n\nHello!";
    size_t len;
    char *out = kvr_reply_json(&f.reply, &in, a, strlen(a), &len);
    json_t *j = json_loads(out, 0, NULL);
    json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    assert_string_equal(json_string_value(json_object_get(msg, "reasoning_content")),
                        "I should greet.\n");
    assert_string_equal(json_string_value(json_object_get(msg, "content")), "Hello!");
    json_decref(j);
    kvr_free(out);
    teardown(&f);

    setup(&f, hermes_tmpl, tools_body, "", KVR_REPLY_CHAT);
    in.finish = KVR_OPENAI_FINISH_LENGTH;
    const char *cut = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci";
    out = kvr_reply_json(&f.reply, &in, cut, strlen(cut), &len);
    j = json_loads(out, 0, NULL);
    json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "length");
    assert_null(json_object_get(json_object_get(choice, "message"), "tool_calls"));
    json_decref(j);
    kvr_free(out);
    teardown(&f);
}

/* ---- the Responses API ------------------------------------------------------------------ */

static json_t *to_chat(struct kvr_responses_store *st, const char *body, int want_rc,
                       const char *want_param)
{
    char *out = NULL;
    size_t len = 0;
    struct kvr_openai_error e = {0};
    bool keep;
    int rc = kvr_responses_to_chat(body, strlen(body), st, &out, &len, &keep, &e);
    if (rc != want_rc)
        print_message("%s: %s\n", body, e.message);
    assert_int_equal(rc, want_rc);
    if (rc) {
        assert_int_equal(e.status, 400);
        assert_string_equal(e.param, want_param);
        return NULL;
    }
    json_t *j = json_loadb(out, len, 0, NULL);
    kvr_free(out);
    return j;
}

static void test_responses_request(void **state)
{
    json_t *j = to_chat(NULL,
                        "{\"input\": \"hi\", \"instructions\": \"Be brief.\", "
                        "\"max_output_tokens\": 7, \"temperature\": 0}",
                        0, NULL);
    json_t *m = json_object_get(j, "messages");
    assert_int_equal(json_array_size(m), 2);
    assert_string_equal(json_string_value(json_object_get(json_array_get(m, 0), "role")), "system");
    assert_int_equal(json_integer_value(json_object_get(j, "max_tokens")), 7);
    json_decref(j);
    /* Items: a message with parts, two calls (one assistant message), their outputs; a
     * flat function tool and a named choice become chat's nested shapes. */
    j = to_chat(NULL,
                "{\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_text\", "
                "\"text\": \"a\"}, {\"type\": \"input_text\", \"text\": \"b\"}]}, {\"type\": "
                "\"function_call\", \"call_id\": \"c1\", \"name\": \"f\", \"arguments\": \"{}\"}, "
                "{\"type\": \"function_call\", \"call_id\": \"c2\", \"name\": \"f\", "
                "\"arguments\": \"{}\"}, {\"type\": \"function_call_output\", \"call_id\": \"c1\", "
                "\"output\": \"x\"}], \"tools\": [{\"type\": \"function\", \"name\": \"f\", "
                "\"parameters\": {\"type\": \"object\"}}], \"tool_choice\": {\"type\": "
                "\"function\", \"name\": \"f\"}}",
                0, NULL);
    m = json_object_get(j, "messages");
    assert_int_equal(json_array_size(m), 3);
    assert_string_equal(json_string_value(json_object_get(json_array_get(m, 0), "content")), "ab");
    assert_int_equal(json_array_size(json_object_get(json_array_get(m, 1), "tool_calls")), 2);
    assert_string_equal(json_string_value(json_object_get(json_array_get(m, 2), "tool_call_id")),
                        "c1");
    json_t *fn = json_object_get(json_array_get(json_object_get(j, "tools"), 0), "function");
    assert_string_equal(json_string_value(json_object_get(fn, "name")), "f");
    assert_string_equal(
        json_string_value(json_object_get(
            json_object_get(json_object_get(j, "tool_choice"), "function"), "name")),
        "f");
    json_decref(j);
    /* "store": false keeps nothing. */
    char *out = NULL;
    size_t len;
    bool keep = true;
    struct kvr_openai_error e = {0};
    const char *nostore = "{\"input\": \"x\", \"store\": false}";
    assert_int_equal(kvr_responses_to_chat(nostore, strlen(nostore), NULL, &out, &len, &keep, &e),
                     0);
    assert_false(keep);
    kvr_free(out);
    /* Bad input names its field. */
    to_chat(NULL, "{\"input\": \"x\", \"store\": 1}", KVR_EINVAL, "store");
    to_chat(NULL, "{\"input\": 5}", KVR_EINVAL, "input");
    to_chat(NULL, "{\"input\": \"x\", \"temprature\": 1}", KVR_EINVAL, "temprature");
    to_chat(NULL, "{\"input\": [{\"type\": \"image\"}]}", KVR_EINVAL, "input[0]");
    to_chat(NULL, "{\"input\": \"x\", \"tools\": [{\"type\": \"web_search\"}]}", KVR_EINVAL,
            "tools");
    to_chat(NULL, "{\"input\": \"x\", \"previous_response_id\": \"resp_nope\"}", KVR_EINVAL,
            "previous_response_id");
}

/* A finished response is stored; a follow-up's previous_response_id brings its
 * conversation, the answer's tool call included, before the new input. */
static void test_responses_answer_and_store(void **state)
{
    struct kvr_responses_store *st = kvr_responses_store_create();
    assert_non_null(st);
    struct fixture f;
    setup(&f, hermes_tmpl, tools_body, "", KVR_REPLY_RESPONSES);
    f.reply.store = st;
    struct kvr_reply_info in = {&f.meta, KVR_OPENAI_FINISH_STOP, 10, 20, NULL};
    size_t len;
    char *out = kvr_reply_json(&f.reply, &in, answer, strlen(answer), &len);
    json_t *j = json_loads(out, 0, NULL);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "response");
    assert_string_equal(json_string_value(json_object_get(j, "status")), "completed");
    json_t *items = json_object_get(j, "output");
    assert_int_equal(json_array_size(items), 2);
    assert_string_equal(json_string_value(json_object_get(json_array_get(items, 0), "type")),
                        "message");
    json_t *call = json_array_get(items, 1);
    assert_string_equal(json_string_value(json_object_get(call, "type")), "function_call");
    assert_string_equal(json_string_value(json_object_get(call, "arguments")),
                        "{\"city\":\"Oslo\"}");
    char body[256];
    snprintf(body, sizeof body,
             "{\"previous_response_id\": \"%s\", \"input\": [{\"type\": "
             "\"function_call_output\", \"call_id\": \"%s\", \"output\": \"sunny\"}]}",
             json_string_value(json_object_get(j, "id")),
             json_string_value(json_object_get(call, "call_id")));
    json_t *chat = to_chat(st, body, 0, NULL);
    json_t *m = json_object_get(chat, "messages");
    assert_int_equal(json_array_size(m), 3); /* user, assistant with the call, tool */
    assert_non_null(json_object_get(json_array_get(m, 1), "tool_calls"));
    json_decref(chat);
    json_decref(j);
    kvr_free(out);
    teardown(&f);

    /* Streaming: created first, completed last, argument deltas adding up. */
    setup(&f, hermes_tmpl, tools_body, "", KVR_REPLY_RESPONSES);
    struct kvr_sbuf s;
    kvr_sbuf_init(&s);
    assert_int_equal(kvr_reply_sse_start(&f.reply, &s, &in), KVR_OK);
    for (size_t i = 0; answer[i]; i++)
        assert_int_equal(kvr_reply_sse(&f.reply, &s, &in, answer + i, 1, !answer[i + 1]), KVR_OK);
    assert_non_null(strstr(s.data, "event: response.created\n"));
    assert_non_null(strstr(s.data, "\"delta\":\"{\\\"city\\\":\\\"Oslo\\\"}\""));
    assert_non_null(strstr(s.data, "event: response.output_text.delta"));
    const char *last = strstr(s.data, "event: response.completed\n");
    assert_non_null(last);
    assert_null(strstr(last + 1, "event: "));
    /* A failed stream ends with an error event and response.failed. */
    kvr_sbuf_clear(&s);
    struct kvr_openai_error err = {.status = 503, .code = "shutting_down"};
    strcpy(err.message, "the server is shutting down");
    assert_int_equal(kvr_responses_sse_error(&f.reply, &s, &in, &err), KVR_OK);
    assert_non_null(strstr(s.data, "event: error\ndata: {\"code\":\"shutting_down\""));
    assert_non_null(strstr(s.data, "event: response.failed\n"));
    assert_non_null(strstr(s.data, "\"status\":\"failed\""));
    kvr_sbuf_fini(&s);
    teardown(&f);
    kvr_responses_store_destroy(st);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_json_tool_call),
        cmocka_unit_test(test_chat_stream_deltas),
        cmocka_unit_test(test_reasoning_and_cut),
        cmocka_unit_test(test_responses_request),
        cmocka_unit_test(test_responses_answer_and_store),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
