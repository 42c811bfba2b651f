/* test_openai.c - the OpenAI request parser (a table of bad inputs, each with the status
 * and message it must produce), the length check, UTF-8 helpers, stop strings across
 * token boundaries, and the response/SSE formats. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#include "bridge/openai.h"
#include "core/alloc.h"
#include "core/utf8.h"

#include <stdio.h>
#include <string.h>

static const struct kvr_openai_limits lim = {.n_ctx = 128, .n_vocab = 512};

#define C KVR_OPENAI_COMPLETIONS
#define H KVR_OPENAI_CHAT
/* A chat body with one tool "f" and more fields. */
#define TOOLS_BODY(more)                                                                           \
    "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"type\": "          \
    "\"function\", \"function\": {\"name\": \"f\"}}], " more "}"

/* Bytes of a body with embedded NULs or invalid UTF-8 are given with an explicit length. */
struct bad_case {
    enum kvr_openai_api api;
    const char *body;
    size_t len; /* 0: strlen(body) */
    int status;
    const char *msg;   /* substring of the message */
    const char *param; /* expected param, NULL for JSON null */
};

static const struct bad_case bad_cases[] = {
    /* logit_bias: token ids of the model, biases in [-100, 100], a few of them. */
    {C, "{\"prompt\": \"x\", \"logit_bias\": [1]}", 0, 400, "must be an object", "logit_bias"},
    {C, "{\"prompt\": \"x\", \"logit_bias\": {\"512\": 1}}", 0, 400, "not a token id",
     "logit_bias"},
    {C, "{\"prompt\": \"x\", \"logit_bias\": {\"-1\": 1}}", 0, 400, "not a token id", "logit_bias"},
    {C, "{\"prompt\": \"x\", \"logit_bias\": {\"a\": 1}}", 0, 400, "not a token id", "logit_bias"},
    {C, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": 101}}", 0, 400, "[-100, 100]", "logit_bias"},
    {C, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": \"1\"}}", 0, 400, "[-100, 100]", "logit_bias"},
    {C, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": 1, \"05\": 2}}", 0, 400, "twice",
     "logit_bias"},
    {C,
     "{\"prompt\": \"x\", \"logit_bias\": {\"1\": 1, \"2\": 1, \"3\": 1, \"4\": 1, "
     "\"5\": 1, \"6\": 1, \"7\": 1, \"8\": 1, \"9\": 1}}",
     0, 400, "at most 8", "logit_bias"},
    /* Not JSON, or not an object. */
    {C, "", 0, 400, "body is empty", NULL},
    {C, "{\"prompt\": \"hi\"", 0, 400, "not valid JSON", NULL},
    {C, "{\"prompt\": \"hi\",}", 0, 400, "not valid JSON", NULL},
    {C, "[1, 2]", 0, 400, "must be a JSON object, got an array", NULL},
    {C, "\"hi\"", 0, 400, "not valid JSON", NULL},
    {C, "{\"prompt\": \"a\", \"prompt\": \"b\"}", 0, 400, "duplicate", NULL},
    {C, "{\"prompt\": \"a\\u0000b\"}", 0, 400, "not valid JSON", NULL},
    {C, "{\"prompt\": 1e999}", 0, 400, "not valid JSON", NULL},
    {C, "{\"prompt\": \"\xC3\x28\"}", 0, 400, "not valid UTF-8 (invalid byte 0xC3 at offset 12)",
     NULL},
    {C, "{\"prompt\": \"\xED\xA0\x80\"}", 0, 400, "not valid UTF-8", NULL},
    {C, "{\"prompt\": \"\xC0\xAF\"}", 0, 400, "not valid UTF-8", NULL},
    {C, "{\"prompt\": \"\xF4\x90\x80\x80\"}", 0, 400, "not valid UTF-8", NULL},
    {C, "{\"prompt\": \"x\"}\0", 16, 400, "not valid JSON", NULL},
    /* Missing required fields. */
    {C, "{}", 0, 400, "you must provide a 'prompt'", "prompt"},
    {C, "{\"prompt\": null}", 0, 400, "you must provide a 'prompt'", "prompt"},
    {H, "{\"prompt\": \"hi\"}", 0, 400, "you must provide 'messages'", "messages"},
    {H, "{\"messages\": []}", 0, 400, "'messages' must not be empty", "messages"},
    {H, "{\"messages\": [{\"content\": \"hi\"}]}", 0, 400, "'messages[0].role' is required",
     "messages[0].role"},
    {H, "{\"messages\": [{\"role\": \"user\"}]}", 0, 400, "'messages[0].content' is required",
     "messages[0].content"},
    /* Wrong types. */
    {C, "{\"prompt\": 12}", 0, 400, "'prompt' must be a string", "prompt"},
    {C, "{\"prompt\": {}}", 0, 400, "'prompt' must be a string", "prompt"},
    {C, "{\"prompt\": \"hi\", \"max_tokens\": \"ten\"}", 0, 400,
     "'max_tokens' must be an integer, got a string", "max_tokens"},
    {C, "{\"prompt\": \"hi\", \"max_tokens\": 10.5}", 0, 400,
     "'max_tokens' must be an integer, got a number", "max_tokens"},
    {C, "{\"prompt\": \"hi\", \"temperature\": \"hot\"}", 0, 400,
     "'temperature' must be a number, got a string", "temperature"},
    {C, "{\"prompt\": \"hi\", \"stream\": \"yes\"}", 0, 400, "'stream' must be a boolean",
     "stream"},
    {C, "{\"prompt\": \"hi\", \"stop\": 5}", 0, 400, "'stop' must be a string or an array", "stop"},
    {C, "{\"prompt\": \"hi\", \"stop\": [\"a\", 5]}", 0, 400, "'stop[1]' must be a string",
     "stop[1]"},
    {C, "{\"prompt\": \"hi\", \"model\": 3}", 0, 400, "'model' must be a string", "model"},
    {C, "{\"prompt\": \"hi\", \"seed\": 1.5}", 0, 400, "'seed' must be an integer", "seed"},
    {C, "{\"prompt\": \"hi\", \"top_k\": \"4\"}", 0, 400, "'top_k' must be an integer", "top_k"},
    {C, "{\"prompt\": \"hi\", \"logprobs\": true}", 0, 400, "'logprobs' must be an integer",
     "logprobs"},
    {H, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"logprobs\": 1}", 0, 400,
     "'logprobs' must be a boolean", "logprobs"},
    {H, "{\"messages\": {\"role\": \"user\"}}", 0, 400, "'messages' must be an array", "messages"},
    {H, "{\"messages\": [\"hi\"]}", 0, 400, "'messages[0]' must be an object", "messages[0]"},
    {H, "{\"messages\": [{\"role\": 1, \"content\": \"hi\"}]}", 0, 400,
     "'messages[0].role' must be a string", "messages[0].role"},
    {H, "{\"messages\": [{\"role\": \"user\", \"content\": 7}]}", 0, 400,
     "'messages[0].content' must be a string or an array of text parts", "messages[0].content"},
    {H, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", 0, 400,
     "other content types are not supported", "messages[0].content[0]"},
    {H, "{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}", 0, 400,
     "is required on tool messages", "messages[0].tool_call_id"},
    {H, "{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", 0, 400,
     "'robot' is not supported", "messages[0].role"},
    {C, "{\"prompt\": \"hi\", \"stream\": true, \"stream_options\": 1}", 0, 400,
     "'stream_options' must be an object", "stream_options"},
    {C, "{\"prompt\": \"hi\", \"stream\": true, \"stream_options\": {\"include_usage\": 1}}", 0,
     400, "'stream_options.include_usage' must be a boolean", "stream_options.include_usage"},
    {C, "{\"prompt\": \"hi\", \"ignore_eos\": 1}", 0, 400, "'ignore_eos' must be a boolean",
     "ignore_eos"},
    {C, "{\"prompt\": \"hi\", \"latency_budget\": 500}", 0, 400,
     "'latency_budget' must be an object", "latency_budget"},
    {C, "{\"prompt\": \"hi\", \"latency_budget\": {\"total_ms\": \"1s\"}}", 0, 400,
     "'latency_budget.total_ms' must be an integer", "latency_budget.total_ms"},
    /* Out of range. */
    {C, "{\"prompt\": \"hi\", \"max_tokens\": 0}", 0, 400, "'max_tokens' must be between 1 and 128",
     "max_tokens"},
    {C, "{\"prompt\": \"hi\", \"max_tokens\": -5}", 0, 400,
     "'max_tokens' must be between 1 and 128", "max_tokens"},
    {C, "{\"prompt\": \"hi\", \"max_tokens\": 129}", 0, 400, "got 129", "max_tokens"},
    {C, "{\"prompt\": \"hi\", \"max_tokens\": 99999999999999999999}", 0, 400, "not valid JSON",
     NULL},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
     "\"max_completion_tokens\": 1000}",
     0, 400, "'max_completion_tokens' must be between 1 and 128", "max_completion_tokens"},
    {C, "{\"prompt\": \"hi\", \"temperature\": 2.5}", 0, 400, "'temperature' must be at least 0",
     "temperature"},
    {C, "{\"prompt\": \"hi\", \"temperature\": -0.1}", 0, 400, "got -0.1", "temperature"},
    {C, "{\"prompt\": \"hi\", \"top_p\": 1.5}", 0, 400, "'top_p'", "top_p"},
    {C, "{\"prompt\": \"hi\", \"min_p\": -1}", 0, 400, "'min_p'", "min_p"},
    {C, "{\"prompt\": \"hi\", \"top_k\": -2}", 0, 400, "'top_k' must be between -1", "top_k"},
    {C, "{\"prompt\": \"hi\", \"repetition_penalty\": 0}", 0, 400,
     "'repetition_penalty' must be above 0", "repetition_penalty"},
    {C, "{\"prompt\": \"hi\", \"frequency_penalty\": 3}", 0, 400, "'frequency_penalty'",
     "frequency_penalty"},
    {C, "{\"prompt\": \"hi\", \"presence_penalty\": -2.5}", 0, 400, "'presence_penalty'",
     "presence_penalty"},
    {C, "{\"prompt\": \"hi\", \"stop\": [\"a\", \"b\", \"c\", \"d\", \"e\"]}", 0, 400,
     "at most 4 strings, got 5", "stop"},
    {C, "{\"prompt\": \"hi\", \"stop\": \"\"}", 0, 400, "'stop' must not be empty", "stop"},
    {C, "{\"prompt\": \"hi\", \"stop\": [\"ok\", \"\"]}", 0, 400, "'stop[1]' must not be empty",
     "stop[1]"},
    {C, "{\"prompt\": \"hi\", \"logprobs\": 21}", 0, 400, "'logprobs' must be 0 to 20, got 21",
     "logprobs"},
    {C, "{\"prompt\": \"hi\", \"logprobs\": -1}", 0, 400, "'logprobs' must be 0 to 20, got -1",
     "logprobs"},
    {H, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"top_logprobs\": 2}", 0, 400,
     "needs 'logprobs': true", "top_logprobs"},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"logprobs\": true, "
     "\"top_logprobs\": 21}",
     0, 400, "'top_logprobs' must be between 0 and 20, got 21", "top_logprobs"},
    {C, "{\"prompt\": \"hi\", \"latency_budget\": {\"first_token_ms\": 0}}", 0, 400,
     "must be between 1 and 3600000 milliseconds, got 0", "latency_budget.first_token_ms"},
    {C, "{\"prompt\": \"hi\", \"latency_budget\": {\"total_ms\": 3600001}}", 0, 400, "got 3600001",
     "latency_budget.total_ms"},
    {C, "{\"prompt\": \"hi\", \"latency_budget\": {\"first_token_ms\": 900, \"total_ms\": 500}}", 0,
     400, "(900 ms) exceeds 'latency_budget.total_ms' (500 ms)", "latency_budget.first_token_ms"},
    {C, "{\"prompt\": [1, 2, 512]}", 0, 400, "token id 512 is outside the vocabulary (0 .. 511)",
     "prompt[2]"},
    {C, "{\"prompt\": [1, -1]}", 0, 400, "token id -1 is outside", "prompt[1]"},
    {C, "{\"prompt\": [1, \"a\"]}", 0, 400, "'prompt[1]' must be a token id", "prompt[1]"},
    {C, "{\"prompt\": []}", 0, 400, "'prompt' must not be an empty array", "prompt"},
    {C, "{\"prompt\": [[]]}", 0, 400, "'prompt' must not be an empty array", "prompt"},
    /* Unsupported features. */
    {C, "{\"prompt\": \"hi\", \"n\": 17}", 0, 400, "'n' must be 1 to 16, got 17", "n"},
    {H, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n\": 99}", 0, 400,
     "'n' must be 1 to 16, got 99", "n"},
    {C, "{\"prompt\": \"hi\", \"n\": 0}", 0, 400, "'n' must be 1 to 16, got 0", "n"},
    {C, "{\"prompt\": \"hi\", \"n\": \"1\"}", 0, 400, "'n' must be an integer", "n"},
    {C, "{\"prompt\": [\"a\", \"b\"]}", 0, 400, "batched prompts are not supported (got 2)",
     "prompt"},
    {C, "{\"prompt\": \"hi\", \"echo\": true}", 0, 400, "'echo' is not supported", "echo"},
    {C, "{\"prompt\": \"hi\", \"best_of\": 2}", 0, 400, "'best_of' other than 1", "best_of"},
    {C, "{\"prompt\": \"hi\", \"suffix\": \"end\"}", 0, 400, "'suffix' is not supported", "suffix"},
    {H, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{}]}", 0, 400,
     "other tool types are not supported", "tools[0]"},
    {H, TOOLS_BODY("\"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"g\"}}"), 0,
     400, "names 'g', which is not in 'tools'", "tool_choice"},
    {H, TOOLS_BODY("\"parallel_tool_calls\": false, \"tool_choice\": \"sometimes\""), 0, 400,
     "'tool_choice' must be", "tool_choice"},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"type\": "
     "\"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\", "
     "\"properties\": {\"a\": {\"type\": \"strin\"}}}}}]}",
     0, 400, "must be one of object", "tools[0].function.parameters.properties.a"},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"type\": "
     "\"function\", \"function\": {\"name\": \"f g\"}}]}",
     0, 400, "must be 1 to 64 letters", "tools[0].function.name"},
    {H,
     "{\"messages\": [{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": "
     "\"c1\", \"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": "
     "\"{oops\"}}]}]}",
     0, 400, "must be a string holding a JSON object",
     "messages[0].tool_calls[0].function.arguments"},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
     "\"response_format\": {\"type\": \"xml\"}}",
     0, 400, "'response_format.type' must be", "response_format.type"},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
     "\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"x\", "
     "\"schema\": {\"properties\": {\"a\": {\"not\": {}}}}}}}",
     0, 400, "response_format.json_schema.schema: /properties/a/not: unsupported keyword",
     "response_format.json_schema.schema"},
    {C, "{\"prompt\": \"hi\", \"grammar\": \"root ::= \\\"a\\\"\", \"json_schema\": {}}", 0, 400,
     "at most one of", "grammar"},
    {C, "{\"prompt\": \"hi\", \"stream_options\": {\"include_usage\": true}}", 0, 400,
     "only allowed when 'stream' is true",
     "stream_options"}, /* Fields that were once ignored: each refused, naming itself
                           (openai_fields.c). */
    {C, "{\"prompt\": \"hi\", \"guided_json\": {\"type\": \"object\"}}", 0, 400,
     "guided decoding is not supported yet", "guided_json"},
    {C, "{\"prompt\": \"hi\", \"grammar\": \"root ::= \\\"a\\\" b\"}", 0, 400,
     "grammar: line 1 col 14: rule 'b' is not defined", "grammar"},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"json_schema\": "
     "{\"if\": {}}}",
     0, 400, "json_schema: /if: unsupported keyword", "json_schema"},
    {C, "{\"prompt\": \"hi\", \"min_tokens\": 5}", 0, 400, "a minimum length is not supported",
     "min_tokens"},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
     "\"modalities\": [\"text\", \"audio\"]}",
     0, 400, "only text output is supported", "modalities"},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
     "\"prediction\": {\"type\": \"text\", \"content\": \"x\"}}",
     0, 400, "'prediction.type' must be \"content\"", "prediction.type"},
    {C, "{\"prompt\": \"hi\", \"prediction\": {\"type\": \"content\", \"content\": 3}}", 0, 400,
     "a string or an array of text parts", "prediction.content"},
    {C,
     "{\"prompt\": \"hi\", \"prediction\": {\"type\": \"content\", \"content\": "
     "[{\"type\": \"image\", \"text\": \"x\"}]}}",
     0, 400, "each part of 'prediction.content'", "prediction.content"},
    {C,
     "{\"prompt\": \"hi\", \"prediction\": {\"type\": \"content\", \"content\": \"x\", \"n\": 1}}",
     0, 400, "n", "prediction.n"},
    {H, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"store\": true}", 0, 400,
     "stored completions", "store"},
    {C, "{\"prompt\": \"hi\", \"typical_p\": 0.5}", 0, 400, "typical sampling", "typical_p"},
    {C, "{\"prompt\": \"hi\", \"cache_prompt\": false}", 0, 400, "prefix cache", "cache_prompt"},
    {C, "{\"prompt\": \"hi\", \"stop_token_ids\": [2]}", 0, 400, "token ids", "stop_token_ids"},
    {C, "{\"prompt\": \"hi\", \"temprature\": 0}", 0, 400,
     "'temprature' is not a field of /v1/completions", "temprature"},
    {C, "{\"prompt\": \"hi\", \"messages\": []}", 0, 400,
     "'messages' is not a field of /v1/completions", "messages"},
    {H, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"prompt\": \"x\"}", 0, 400,
     "'prompt' is not a field of /v1/chat/completions", "prompt"},
    {C, "{\"prompt\": \"hi\", \"stream\": true, \"stream_options\": {\"usage\": true}}", 0, 400,
     "'stream_options.usage' is not a known field", "stream_options.usage"},
    {C, "{\"prompt\": \"hi\", \"latency_budget\": {\"ttft_ms\": 5}}", 0, 400,
     "'latency_budget.ttft_ms' is not a known field", "latency_budget.ttft_ms"},
    {H, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\", \"tool_calls\": [{}]}]}", 0, 400,
     "only allowed on assistant messages", "messages[0].tool_calls"},
    /* Aliases: one name per field. */
    {C, "{\"prompt\": \"hi\", \"n_predict\": 4, \"max_tokens\": 4}", 0, 400,
     "'n_predict' is another name for 'max_tokens'", "n_predict"},
    {H,
     "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"n_predict\": 4, "
     "\"max_completion_tokens\": 4}",
     0, 400, "another name for 'max_completion_tokens'", "n_predict"},
    {C, "{\"prompt\": \"hi\", \"n_predict\": 0}", 0, 400, "or -1 (to the end), got 0", "n_predict"},
    {C, "{\"prompt\": \"hi\", \"repeat_penalty\": 1.1, \"repetition_penalty\": 1.1}", 0, 400,
     "'repeat_penalty' is another name for 'repetition_penalty'", "repeat_penalty"},
    {C, "{\"prompt\": \"hi\", \"repeat_penalty\": 0}", 0, 400, "'repeat_penalty' must be above 0",
     "repeat_penalty"},
    {C, "{\"prompt\": \"hi\", \"repeat_last_n\": 257}", 0, 400, "'repeat_last_n' must be between",
     "repeat_last_n"},
    /* Seeds: -1 or 0 .. 2^64-1. */
    {C, "{\"prompt\": \"hi\", \"seed\": -2}", 0, 400,
     "'seed' must be -1 (random) or between 0 and 18446744073709551615", "seed"},
    {C, "{\"prompt\": \"hi\", \"seed\": -9223372036854775808}", 0, 400, "'seed' must be -1",
     "seed"},
    {C, "{\"prompt\": \"hi\", \"seed\": -9223372036854775809}", 0, 400, "'seed' must be -1",
     "seed"},
    {C, "{\"prompt\": \"hi\", \"seed\": 18446744073709551616}", 0, 400, "'seed' must be -1",
     "seed"},
    {C, "{\"prompt\": \"hi\", \"seed\": 1e30}", 0, 400, "'seed' must be an integer", "seed"},
    {C, "{\"prompt\": \"hi\", \"seed\": 9223372036854775808, \"n\": 99999999999999999999}", 0, 400,
     "not valid JSON", NULL},
};

static void test_bad_requests(void **state)
{
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        const struct bad_case *c = &bad_cases[i];
        struct kvr_openai_req r;
        struct kvr_openai_error e;
        memset(&e, 0, sizeof e);
        size_t len = c->len ? c->len : strlen(c->body);
        int rc = kvr_openai_parse(&r, c->api, c->body, len, &lim, &e);
        if (rc != KVR_EINVAL || e.status != c->status || !strstr(e.message, c->msg))
            fail_msg("case %zu (%s): rc %d status %d message '%s'; want status %d and '%s'", i,
                     c->body, rc, e.status, e.message, c->status, c->msg);
        if (strcmp(e.type, "invalid_request_error") != 0)
            fail_msg("case %zu: type %s", i, e.type);
        if ((c->param == NULL) != (e.param == NULL) || (c->param && strcmp(c->param, e.param) != 0))
            fail_msg("case %zu: param '%s', want '%s'", i, e.param ? e.param : "(null)",
                     c->param ? c->param : "(null)");
        /* A failed parse leaves nothing behind. */
        assert_null(r.root);
        assert_null(r.msgs);
        assert_null(r.prompt_ids);
        kvr_openai_req_fini(&r);

        /* And its error renders as an OpenAI error body that is valid JSON. */
        size_t jlen = 0;
        char *j = kvr_openai_error_json(&e, &jlen);
        assert_non_null(j);
        json_error_t je;
        json_t *root = json_loads(j, 0, &je);
        if (!root)
            fail_msg("case %zu: error body is not JSON: %s (%s)", i, j, je.text);
        json_t *err = json_object_get(root, "error");
        assert_true(json_is_object(err));
        assert_string_equal(json_string_value(json_object_get(err, "message")), e.message);
        assert_string_equal(json_string_value(json_object_get(err, "type")),
                            "invalid_request_error");
        assert_true(json_object_get(err, "param") != NULL);
        assert_true(json_object_get(err, "code") != NULL);
        json_decref(root);
        kvr_free(j);
    }
}

static void parse_ok(struct kvr_openai_req *r, enum kvr_openai_api api, const char *body)
{
    struct kvr_openai_error e = {0};
    int rc = kvr_openai_parse(r, api, body, strlen(body), &lim, &e);
    if (rc)
        fail_msg("parse failed for %s: %s", body, e.message);
}

static void test_good_completion(void **state)
{
    struct kvr_openai_req r;
    parse_ok(&r, C,
             "{\"model\": \"m\", \"prompt\": [\"Once upon\"], \"max_tokens\": 7, "
             "\"temperature\": 0, \"top_p\": 0.9, \"top_k\": 40, \"min_p\": 0.05, "
             "\"repetition_penalty\": 1.1, \"frequency_penalty\": 0.5, "
             "\"presence_penalty\": -0.5, \"seed\": -1, \"stop\": [\"\\n\", \"The end\"], "
             "\"n\": 1, \"best_of\": 1, \"echo\": false, \"logprobs\": 1, \"stream\": true, "
             "\"stream_options\": {\"include_usage\": true}, \"user\": \"ignored\", "
             "\"ignore_eos\": true, "
             "\"latency_budget\": {\"first_token_ms\": 500, \"total_ms\": 2000}}");
    assert_string_equal(r.model, "m");
    assert_int_equal(r.prompt_len, 9);
    assert_memory_equal(r.prompt, "Once upon", 9);
    assert_true(r.has_max_tokens);
    assert_int_equal(r.max_tokens, 7);
    assert_true(r.sampling.temperature == 0.0f);
    assert_true(r.sampling.top_p == 0.9f);
    assert_int_equal(r.sampling.top_k, 40);
    assert_true(r.sampling.min_p == 0.05f);
    assert_true(r.sampling.repeat_penalty == 1.1f);
    assert_true(r.sampling.frequency_penalty == 0.5f);
    assert_true(r.sampling.presence_penalty == -0.5f);
    assert_false(r.has_seed); /* -1: random, drawn by the HTTP layer */
    assert_true(r.sampling.seed == 0);
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[0], "\n");
    assert_int_equal(r.stop_len[1], 7);
    assert_true(r.logprobs);
    assert_true(r.stream);
    assert_true(r.include_usage);
    assert_true(r.ignore_eos);
    assert_int_equal(r.first_token_ms, 500);
    assert_int_equal(r.total_ms, 2000);
    kvr_openai_req_fini(&r);

    /* Defaults. */
    parse_ok(&r, C, "{\"prompt\": \"x\", \"stop\": \"END\", \"top_k\": -1, \"seed\": null}");
    assert_false(r.has_max_tokens);
    assert_true(r.sampling.temperature == 1.0f);
    assert_true(r.sampling.top_p == 1.0f);
    assert_int_equal(r.sampling.top_k, 0);
    assert_true(r.sampling.repeat_penalty == 1.0f);
    assert_false(r.has_seed);
    assert_int_equal(r.n_stop, 1);
    assert_false(r.stream);
    assert_false(r.logprobs);
    assert_false(r.ignore_eos);
    assert_int_equal(r.total_ms, 0);
    kvr_openai_req_fini(&r);

    /* Token-id prompts, bare or nested. */
    parse_ok(&r, C, "{\"prompt\": [1, 300, 511]}");
    assert_null(r.prompt);
    assert_int_equal(r.n_prompt_ids, 3);
    assert_int_equal(r.prompt_ids[1], 300);
    kvr_openai_req_fini(&r);
    parse_ok(&r, C, "{\"prompt\": [[5, 6]]}");
    assert_int_equal(r.n_prompt_ids, 2);
    assert_int_equal(r.prompt_ids[0], 5);
    kvr_openai_req_fini(&r);
}

/* Seeds are unsigned 64-bit, though jansson's integers are signed: both ends, and the
 * numbers on either side of jansson's limit. */
static void test_seeds(void **state)
{
    static const struct {
        const char *body;
        uint64_t seed;
    } cases[] = {
        {"{\"prompt\": \"x\", \"seed\": 0}", 0},
        {"{\"prompt\": \"x\", \"seed\": 9223372036854775807}", 9223372036854775807ull},
        {"{\"prompt\": \"x\", \"seed\": 9223372036854775808}", 9223372036854775808ull},
        {"{\"seed\":18446744073709551615,\"prompt\": \"x\"}", UINT64_MAX},
        {"{\"prompt\": \"x\", \"logit_bias\": {\"5\": 1}, \"stop\": [\"}\\\"\", \"seed\"], "
         "\"seed\": 18446744073709551614 }",
         UINT64_MAX - 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct kvr_openai_req r;
        parse_ok(&r, C, cases[i].body);
        if (!r.has_seed || r.sampling.seed != cases[i].seed)
            fail_msg("case %zu: has_seed %d seed %llu", i, r.has_seed,
                     (unsigned long long)r.sampling.seed);
        kvr_openai_req_fini(&r);
    }
    struct kvr_openai_req r;
    parse_ok(&r, C, "{\"prompt\": \"x\", \"seed\": -1}");
    assert_false(r.has_seed);
    kvr_openai_req_fini(&r);

    /* A big seed's error columns stay right for what follows it. */
    struct kvr_openai_error e = {0};
    const char *bad = "{\"seed\": 18446744073709551615, \"prompt\": \"x\", \"top_k\": \"4\"}";
    assert_int_equal(kvr_openai_parse(&r, C, bad, strlen(bad), &lim, &e), KVR_EINVAL);
    assert_string_equal(e.param, "top_k");
    kvr_openai_req_fini(&r);
}

/* Aliases, and fields accepted at the values that change nothing (what SDKs and other
 * servers' clients send by default). */
static void test_aliases_and_defaults(void **state)
{
    struct kvr_openai_req r;
    parse_ok(&r, C,
             "{\"prompt\": \"x\", \"n_predict\": 7, \"repeat_penalty\": 1.2, "
             "\"repeat_last_n\": 64}");
    assert_true(r.has_max_tokens);
    assert_int_equal(r.max_tokens, 7);
    assert_true(r.sampling.repeat_penalty == 1.2f);
    assert_int_equal(r.sampling.repeat_last_n, 64);
    kvr_openai_req_fini(&r);

    /* n_predict -1: the rest of the context, where a completion's default would be 16. */
    parse_ok(&r, C, "{\"prompt\": \"x\", \"n_predict\": -1}");
    assert_true(r.max_tokens_rest);
    uint32_t mt = 0;
    struct kvr_openai_error e = {0};
    assert_int_equal(kvr_openai_check_length(&r, 28, 128, 0, &mt, &e), 0);
    assert_int_equal(mt, 100);
    kvr_openai_req_fini(&r);

    parse_ok(&r, H,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\", \"name\": \"ann\"}], "
             "\"n\": 1, \"user\": \"u1\", \"store\": false, \"metadata\": {\"k\": \"v\"}, "
             "\"modalities\": [\"text\"], \"service_tier\": \"auto\", "
             "\"parallel_tool_calls\": true, \"tool_choice\": \"none\", \"tools\": [], "
             "\"function_call\": \"auto\", \"response_format\": {\"type\": \"text\"}, "
             "\"min_tokens\": 0, \"cache_prompt\": true, \"typical_p\": 1, \"mirostat\": 0, "
             "\"safety_identifier\": \"s\", \"prompt_cache_key\": \"p\", "
             "\"grammar\": null, \"guided_json\": null, \"no_such_field\": null}");
    assert_int_equal(r.n_msgs, 1);
    kvr_openai_req_fini(&r);
}

/* Every field docs/API.md lists as refused, or as accepted only at a neutral value, sent
 * with a value that is not neutral: a 400 whose param names it. */
static void test_every_refused_field(void **state)
{
    static const struct {
        const char *name, *value;
    } refused[] = {
        {"grammar", "\"root ::= x\""},
        {"json_schema", "{\"not\": {}}"},
        {"guided_json", "{}"},
        {"guided_regex", "\"a+\""},
        {"guided_choice", "[\"a\"]"},
        {"guided_grammar", "\"x\""},
        {"structured_outputs", "{}"},
        {"audio", "{}"},
        {"reasoning_effort", "\"low\""},
        {"verbosity", "\"low\""},
        {"web_search_options", "{}"},
        {"n_probs", "2"},
        {"stop_token_ids", "[2]"},
        {"min_tokens", "1"},
        {"typical_p", "0.9"},
        {"tfs_z", "0.9"},
        {"mirostat", "2"},
        {"dry_multiplier", "0.8"},
        {"xtc_probability", "0.5"},
        {"cache_prompt", "false"},
        {"store", "true"},
        {"modalities", "[\"text\", \"audio\"]"},
        {"service_tier", "\"flex\""},
        {"tool_choice", "\"required\""},
        {"function_call", "{\"name\": \"f\"}"},
        {"parallel_tool_calls", "1"},
        {"user", "7"},
        {"safety_identifier", "7"},
        {"prompt_cache_key", "[]"},
        {"metadata", "\"m\""},
        {"no_such_field", "1"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        char body[256];
        snprintf(body, sizeof body,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"%s\": %s}",
                 refused[i].name, refused[i].value);
        struct kvr_openai_req r;
        struct kvr_openai_error e = {0};
        int rc = kvr_openai_parse(&r, H, body, strlen(body), &lim, &e);
        if (rc != KVR_EINVAL || e.status != 400 || !e.param ||
            strcmp(e.param, refused[i].name) != 0 || !strstr(e.message, refused[i].name))
            fail_msg("%s: rc %d status %d param %s message '%s'", body, rc, e.status,
                     e.param ? e.param : "(null)", e.message);
        kvr_openai_req_fini(&r);
    }
}

/* A conversation with tools, a call and its result parses; the choice is read. */
static void test_tools(void **state)
{
    struct kvr_openai_req r;
    parse_ok(&r, H,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"weather?\"}, "
             "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"c1\", "
             "\"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": "
             "\"{\\\"a\\\": 1}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c1\", "
             "\"content\": \"sunny\"}], \"tools\": [{\"type\": \"function\", \"function\": "
             "{\"name\": \"f\", \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": "
             "{\"type\": \"integer\"}}, \"required\": [\"a\"]}}}], \"tool_choice\": {\"type\": "
             "\"function\", \"function\": {\"name\": \"f\"}}, \"parallel_tool_calls\": false}");
    assert_int_equal(r.n_msgs, 3);
    assert_int_equal(r.msgs[2].role, KVR_CHAT_ROLE_TOOL);
    assert_int_equal(r.tools.n, 1);
    assert_int_equal(r.tools.choice, KVR_TOOL_CHOICE_NAMED);
    assert_string_equal(r.tools.named, "f");
    assert_false(r.tools.parallel);
    assert_non_null(kvr_tools_params(&r.tools, "f"));
    assert_true(json_is_array(r.msgs_json));
    kvr_openai_req_fini(&r);
    parse_ok(&r, H, TOOLS_BODY("\"tool_choice\": \"required\""));
    assert_int_equal(r.tools.choice, KVR_TOOL_CHOICE_REQUIRED);
    kvr_openai_req_fini(&r);
    parse_ok(&r, H, TOOLS_BODY("\"tool_choice\": \"none\""));
    assert_int_equal(r.tools.choice, KVR_TOOL_CHOICE_NONE);
    kvr_openai_req_fini(&r);
}

/* "prediction": a string or text parts, its text in order (speculation drafts from it). */
static void test_prediction(void **state)
{
    (void)state;
    struct kvr_openai_req r;
    struct kvr_sbuf text;
    parse_ok(&r, KVR_OPENAI_CHAT,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"prediction\": "
             "{\"type\": \"content\", \"content\": \"abc\"}}");
    assert_non_null(r.prediction);
    kvr_sbuf_init(&text);
    kvr_openai_prediction_text(&r, &text);
    assert_int_equal(text.len, 3);
    assert_memory_equal(text.data, "abc", 3);
    kvr_sbuf_fini(&text);
    kvr_openai_req_fini(&r);
    parse_ok(&r, KVR_OPENAI_COMPLETIONS,
             "{\"prompt\": \"hi\", \"prediction\": {\"type\": \"content\", \"content\": "
             "[{\"type\": \"text\", \"text\": \"ab\"}, {\"type\": \"text\", \"text\": \"cd\"}]}}");
    kvr_sbuf_init(&text);
    kvr_openai_prediction_text(&r, &text);
    assert_int_equal(text.len, 4);
    assert_memory_equal(text.data, "abcd", 4);
    kvr_sbuf_fini(&text);
    kvr_openai_req_fini(&r);
    parse_ok(&r, KVR_OPENAI_COMPLETIONS, "{\"prompt\": \"hi\", \"prediction\": null}");
    assert_null(r.prediction);
    kvr_openai_req_fini(&r);
}

static void test_tokenize_fields(void **state)
{
    struct kvr_openai_tokenize_req t;
    struct kvr_openai_error e = {0};
    const char *vllm = "{\"model\": \"m\", \"prompt\": \"hi\", \"add_special_tokens\": true}";
    assert_int_equal(kvr_openai_parse_tokenize(&t, vllm, strlen(vllm), &e), 0);
    assert_int_equal(t.content_len, 2);
    assert_true(t.add_special);
    kvr_openai_tokenize_req_fini(&t);
    static const struct {
        const char *body, *param;
    } bad[] = {
        {"{\"content\": \"hi\", \"parse_special\": true}", "parse_special"},
        {"{\"content\": \"hi\", \"prompt\": \"hi\"}", "prompt"},
        {"{\"content\": \"hi\", \"add_special\": true, \"add_special_tokens\": true}",
         "add_special_tokens"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&e, 0, sizeof e);
        assert_int_equal(kvr_openai_parse_tokenize(&t, bad[i].body, strlen(bad[i].body), &e),
                         KVR_EINVAL);
        assert_string_equal(e.param, bad[i].param);
    }
    int32_t *ids = NULL;
    uint32_t n = 0;
    const char *dt = "{\"tokens\": [1], \"skip_special\": true}";
    assert_int_equal(kvr_openai_parse_detokenize(dt, strlen(dt), 512, &ids, &n, &e), KVR_EINVAL);
    assert_string_equal(e.param, "skip_special");
    assert_null(ids);
}

static void test_logit_bias(void **state)
{
    struct kvr_openai_req r;
    parse_ok(&r, H,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
             "\"logit_bias\": {\"7\": 100, \"511\": -100, \"0\": 0.5}}");
    assert_int_equal(r.sampling.n_bias, 3);
    assert_int_equal(r.sampling.bias[0].id, 7);
    assert_true(r.sampling.bias[0].bias == 100.0f);
    assert_int_equal(r.sampling.bias[1].id, 511);
    assert_true(r.sampling.bias[1].bias == -100.0f);
    assert_true(r.sampling.bias[2].bias == 0.5f);
    kvr_openai_req_fini(&r);
    parse_ok(&r, C, "{\"prompt\": \"x\", \"logit_bias\": {}}");
    assert_int_equal(r.sampling.n_bias, 0);
    kvr_openai_req_fini(&r);
}

static void test_good_chat(void **state)
{
    struct kvr_openai_req r;
    parse_ok(&r, H,
             "{\"messages\": [{\"role\": \"developer\", \"content\": \"Be nice.\"}, "
             "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Hel\"}, "
             "{\"type\": \"text\", \"text\": \"lo\"}]}, "
             "{\"role\": \"assistant\", \"content\": null}, "
             "{\"role\": \"user\", \"content\": \"caf\\u00e9\", \"name\": \"bob\"}], "
             "\"max_tokens\": 5, \"max_completion_tokens\": 9, \"logprobs\": true, "
             "\"top_logprobs\": 7, \"n\": 3}");
    assert_int_equal(r.n_msgs, 4);
    assert_int_equal(r.msgs[0].role, KVR_CHAT_ROLE_SYSTEM);
    assert_int_equal(r.msgs[1].role, KVR_CHAT_ROLE_USER);
    assert_int_equal(r.msgs[1].content_len, 5);
    assert_memory_equal(r.msgs[1].content, "Hello", 5);
    assert_int_equal(r.msgs[2].role, KVR_CHAT_ROLE_ASSISTANT);
    assert_int_equal(r.msgs[2].content_len, 0);
    assert_int_equal(r.msgs[3].content_len, 5);
    assert_memory_equal(r.msgs[3].content, "caf\xC3\xA9", 5);
    /* max_completion_tokens wins over the deprecated max_tokens. */
    assert_int_equal(r.max_tokens, 9);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 7);
    assert_int_equal(r.n, 3);
    kvr_openai_req_fini(&r);
}

static void test_parse_out_of_memory(void **state)
{
    /* Every allocation the parser makes through kvr_malloc may fail; none may crash. */
    const char *body = "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": "
                       "\"text\", \"text\": \"a\"}]}]}";
    for (long n = 0; n < 4; n++) {
        struct kvr_openai_req r;
        struct kvr_openai_error e = {0};
        kvr_alloc_fail_after(n);
        int rc = kvr_openai_parse(&r, H, body, strlen(body), &lim, &e);
        kvr_alloc_fail_after(-1);
        if (rc) {
            assert_int_equal(rc, KVR_ENOMEM);
            assert_int_equal(e.status, 500);
        }
        kvr_openai_req_fini(&r);
    }
}

static void test_check_length(void **state)
{
    struct kvr_openai_req r;
    struct kvr_openai_error e = {0};
    uint32_t mt = 0;

    parse_ok(&r, C, "{\"prompt\": \"x\"}");
    assert_int_equal(kvr_openai_check_length(&r, 10, 128, 0, &mt, &e), KVR_OK);
    assert_int_equal(mt, 16); /* OpenAI's completions default */
    assert_int_equal(kvr_openai_check_length(&r, 120, 128, 0, &mt, &e), KVR_OK);
    assert_int_equal(mt, 8); /* cut to what the context has left */
    assert_int_equal(kvr_openai_check_length(&r, 10, 128, 50, &mt, &e), KVR_OK);
    assert_int_equal(mt, 50);
    assert_int_equal(kvr_openai_check_length(&r, 128, 128, 0, &mt, &e), KVR_EINVAL);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "maximum context length is 128 tokens, but the prompt is "
                                      "128 tokens"));
    assert_string_equal(e.code, "context_length_exceeded");
    assert_string_equal(e.param, "prompt");
    assert_int_equal(kvr_openai_check_length(&r, 5000, 128, 0, &mt, &e), KVR_EINVAL);
    assert_non_null(strstr(e.message, "5000"));
    assert_int_equal(kvr_openai_check_length(&r, 0, 128, 0, &mt, &e), KVR_EINVAL);
    assert_non_null(strstr(e.message, "empty"));
    kvr_openai_req_fini(&r);

    parse_ok(&r, C, "{\"prompt\": \"x\", \"max_tokens\": 100}");
    assert_int_equal(kvr_openai_check_length(&r, 28, 128, 0, &mt, &e), KVR_OK);
    assert_int_equal(mt, 100);
    assert_int_equal(kvr_openai_check_length(&r, 29, 128, 0, &mt, &e), KVR_EINVAL);
    assert_non_null(strstr(e.message, "you requested 129 tokens (29 in the prompt, 100 for the "
                                      "completion)"));
    kvr_openai_req_fini(&r);

    parse_ok(&r, H, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}");
    assert_int_equal(kvr_openai_check_length(&r, 28, 128, 0, &mt, &e), KVR_OK);
    assert_int_equal(mt, 100); /* chat: the rest of the context */
    assert_int_equal(kvr_openai_check_length(&r, 200, 128, 0, &mt, &e), KVR_EINVAL);
    assert_string_equal(e.param, "messages");
    kvr_openai_req_fini(&r);
}

static void test_budget_header(void **state)
{
    uint32_t ms = 0;
    struct kvr_openai_error e = {0};
    assert_int_equal(kvr_openai_parse_budget_header("750", &ms, &e), KVR_OK);
    assert_int_equal(ms, 750);
    assert_int_equal(kvr_openai_parse_budget_header("3600000", &ms, &e), KVR_OK);
    static const char *const bad[] = {"",     "0",   "-5",      "1.5",
                                      "12ms", " 12", "3600001", "99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&e, 0, sizeof e);
        if (kvr_openai_parse_budget_header(bad[i], &ms, &e) != KVR_EINVAL)
            fail_msg("header '%s' accepted", bad[i]);
        assert_int_equal(e.status, 400);
        assert_non_null(strstr(e.message, "X-Latency-Budget-Ms"));
    }
}

static void test_utf8(void **state)
{
    assert_int_equal(kvr_utf8_valid_len("abc", 3), 3);
    assert_int_equal(kvr_utf8_valid_len("a\xC3\xA9z", 4), 4);
    assert_int_equal(kvr_utf8_valid_len("\xF0\x9F\x98\x80", 4), 4);
    assert_int_equal(kvr_utf8_valid_len("ab\xC3", 3), 2);        /* truncated */
    assert_int_equal(kvr_utf8_valid_len("a\x80", 2), 1);         /* lone continuation */
    assert_int_equal(kvr_utf8_valid_len("\xE0\x80\xAF", 3), 0);  /* overlong */
    assert_int_equal(kvr_utf8_valid_len("x\xED\xA0\x80", 4), 1); /* surrogate */
    assert_int_equal(kvr_utf8_valid_len("\xFF", 1), 0);

    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    /* One U+FFFD per maximal invalid subpart: "\xE2\x82" is one, "\x80" another. */
    kvr_utf8_sanitize_to(&b,
                         "a\xE2\x82"
                         "b\x80\xC3\xA9",
                         7);
    assert_string_equal(b.data, "a\xEF\xBF\xBD"
                                "b\xEF\xBF\xBD\xC3\xA9");
    kvr_sbuf_clear(&b);
    kvr_utf8_sanitize_to(&b, "\xF0\x9F\x98", 3);
    assert_string_equal(b.data, "\xEF\xBF\xBD");
    kvr_sbuf_fini(&b);
}

/* Feed pieces through a stop-string cutter, collecting what is released after each. */
static bool run_text(const char *const *stop, uint32_t n_stop, const char *extra,
                     const char *const *pieces, size_t n_pieces, bool flush, char *out, size_t cap)
{
    size_t lens[KVR_OPENAI_MAX_STOP] = {0};
    for (uint32_t i = 0; i < n_stop; i++)
        lens[i] = strlen(stop[i]);
    struct kvr_openai_text t;
    kvr_openai_text_init(&t, stop, lens, n_stop, extra);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    bool stopped = false;
    for (size_t i = 0; i < n_pieces && !stopped; i++)
        stopped = kvr_openai_text_push(&t, pieces[i], strlen(pieces[i]), &b);
    if (flush)
        kvr_openai_text_flush(&t, &b);
    snprintf(out, cap, "%s", b.data ? b.data : "");
    kvr_sbuf_fini(&b);
    kvr_openai_text_fini(&t);
    return stopped;
}

static void test_stop_strings(void **state)
{
    char out[256];
    static const char *const stop1[] = {"The end"};
    /* A stop string split across three tokens: nothing of it is released. */
    static const char *const p1[] = {"And so. Th", "e e", "nd of it", " more"};
    assert_true(run_text(stop1, 1, NULL, p1, 4, false, out, sizeof out));
    assert_string_equal(out, "And so. ");

    /* A near miss is held only while it could still match, then released in order. */
    struct kvr_openai_text t;
    size_t len1 = 7;
    kvr_openai_text_init(&t, stop1, &len1, 1, NULL);
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    assert_false(kvr_openai_text_push(&t, "x The", 5, &b));
    assert_string_equal(b.data, "x ");
    assert_false(kvr_openai_text_push(&t, " e", 2, &b));
    assert_string_equal(b.data, "x ");
    assert_false(kvr_openai_text_push(&t, "ar", 2, &b));
    assert_string_equal(b.data, "x The ear");
    kvr_openai_text_fini(&t);
    kvr_sbuf_fini(&b);

    /* Several stop strings: the earliest occurrence wins. */
    static const char *const stop2[] = {"cat", "a"};
    static const char *const p2[] = {"the ca", "t"};
    assert_true(run_text(stop2, 2, NULL, p2, 2, false, out, sizeof out));
    assert_string_equal(out, "the c");

    /* Held text is released when the generation ends for another reason. */
    static const char *const p3[] = {"hello Th"};
    assert_false(run_text(stop1, 1, NULL, p3, 1, true, out, sizeof out));
    assert_string_equal(out, "hello Th");

    /* The extra (end-of-turn) stop string works like the others. */
    static const char *const p4[] = {"Hi!<|im_", "end|>junk"};
    assert_true(run_text(NULL, 0, "<|im_end|>", p4, 2, true, out, sizeof out));
    assert_string_equal(out, "Hi!");

    /* No stop strings: everything passes straight through. */
    static const char *const p5[] = {"a", "b"};
    assert_false(run_text(NULL, 0, NULL, p5, 2, false, out, sizeof out));
    assert_string_equal(out, "ab");

    /* A stop string at the very start gives empty text; multi-byte text stays whole. */
    static const char *const stop3[] = {"\xC3\xA9t\xC3\xA9"};
    static const char *const p6[] = {"\xC3\xA9", "t", "\xC3\xA9 suite"};
    assert_true(run_text(stop3, 1, NULL, p6, 3, false, out, sizeof out));
    assert_string_equal(out, "");
    static const char *const p7[] = {"caf\xC3\xA9", "t", "x"};
    assert_false(run_text(stop3, 1, NULL, p7, 3, false, out, sizeof out));
    assert_string_equal(out, "caf\xC3\xA9tx");
}

static json_t *load(const char *s, size_t len)
{
    json_error_t je;
    json_t *j = json_loadb(s, len, 0, &je);
    if (!j)
        fail_msg("not JSON: %.*s (%s)", (int)len, s, je.text);
    return j;
}

static void test_response_completion(void **state)
{
    struct kvr_openai_meta m = {
        KVR_OPENAI_COMPLETIONS, "cmpl-abc", 1700000000, "stories", false, 0};
    json_t *lp = kvr_openai_logprobs_new(KVR_OPENAI_COMPLETIONS);
    assert_int_equal(
        kvr_openai_logprobs_add(lp, KVR_OPENAI_COMPLETIONS, " Once", 5, -0.5f, 0, NULL, 0), KVR_OK);
    assert_int_equal(
        kvr_openai_logprobs_add(lp, KVR_OPENAI_COMPLETIONS, "\xE2", 1, -1.25f, 5, NULL, 0), KVR_OK);
    size_t len = 0;
    char *s = kvr_openai_response_json(&m, " Once", 5, KVR_OPENAI_FINISH_LENGTH, 3, 2, lp, &len);
    assert_non_null(s);
    json_t *j = load(s, len);
    assert_string_equal(json_string_value(json_object_get(j, "id")), "cmpl-abc");
    assert_string_equal(json_string_value(json_object_get(j, "object")), "text_completion");
    assert_int_equal(json_integer_value(json_object_get(j, "created")), 1700000000);
    assert_string_equal(json_string_value(json_object_get(j, "model")), "stories");
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), " Once");
    assert_int_equal(json_integer_value(json_object_get(c, "index")), 0);
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "length");
    json_t *l = json_object_get(c, "logprobs");
    assert_string_equal(json_string_value(json_array_get(json_object_get(l, "tokens"), 1)),
                        "\xEF\xBF\xBD");
    assert_true(json_real_value(json_array_get(json_object_get(l, "token_logprobs"), 0)) == -0.5);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(l, "text_offset"), 1)), 5);
    json_t *u = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), 3);
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), 2);
    assert_int_equal(json_integer_value(json_object_get(u, "total_tokens")), 5);
    json_decref(j);
    json_decref(lp);
    kvr_free(s);
}

/* Alternatives: chat lists them (token, logprob, bytes); completions keys them by text, the
 * more likely of two same texts, and adds the sampled token when it is not among them. */
static void test_logprobs_alternatives(void **state)
{
    (void)state;
    const struct kvr_openai_alt alt[3] = {{" a", 2, -1.0f}, {" a", 2, -2.0f}, {"\xE2", 1, -3.0f}};
    json_t *lp = kvr_openai_logprobs_new(KVR_OPENAI_COMPLETIONS);
    assert_int_equal(kvr_openai_logprobs_add(lp, KVR_OPENAI_COMPLETIONS, " c", 2, -4.0f, 0, alt, 3),
                     KVR_OK);
    assert_int_equal(kvr_openai_logprobs_add(lp, KVR_OPENAI_COMPLETIONS, " a", 2, -1.0f, 2, alt, 1),
                     KVR_OK);
    json_t *tops = json_object_get(lp, "top_logprobs");
    json_t *d0 = json_array_get(tops, 0), *d1 = json_array_get(tops, 1);
    assert_int_equal(json_object_size(d0), 3);
    assert_true(json_real_value(json_object_get(d0, " a")) == -1.0);
    assert_true(json_real_value(json_object_get(d0, "\xEF\xBF\xBD")) == -3.0); /* U+FFFD */
    assert_true(json_real_value(json_object_get(d0, " c")) == -4.0); /* the sampled token */
    assert_int_equal(json_object_size(d1), 1);                       /* it is the top one */
    json_decref(lp);

    lp = kvr_openai_logprobs_new(KVR_OPENAI_CHAT);
    assert_int_equal(kvr_openai_logprobs_add(lp, KVR_OPENAI_CHAT, " c", 2, -4.0f, 0, alt, 3),
                     KVR_OK);
    json_t *e0 = json_array_get(json_object_get(lp, "content"), 0);
    json_t *a = json_object_get(e0, "top_logprobs");
    assert_int_equal(json_array_size(a), 3); /* chat lists every alternative, as given */
    assert_string_equal(json_string_value(json_object_get(json_array_get(a, 1), "token")), " a");
    assert_true(json_real_value(json_object_get(json_array_get(a, 1), "logprob")) == -2.0);
    json_t *bytes = json_object_get(json_array_get(a, 2), "bytes");
    assert_int_equal(json_array_size(bytes), 1);
    assert_int_equal(json_integer_value(json_array_get(bytes, 0)), 0xE2);
    json_decref(lp);
}

static void test_response_chat(void **state)
{
    struct kvr_openai_meta m = {KVR_OPENAI_CHAT, "chatcmpl-x", 1, "stories", false, 0};
    json_t *lp = kvr_openai_logprobs_new(KVR_OPENAI_CHAT);
    assert_int_equal(
        kvr_openai_logprobs_add(lp, KVR_OPENAI_CHAT, "\xC3\xA9", 2, -0.25f, 0, NULL, 0), KVR_OK);
    size_t len = 0;
    char *s = kvr_openai_response_json(&m, "\xC3\xA9", 2, KVR_OPENAI_FINISH_STOP, 4, 1, lp, &len);
    json_t *j = load(s, len);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion");
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    json_t *msg = json_object_get(c, "message");
    assert_string_equal(json_string_value(json_object_get(msg, "role")), "assistant");
    assert_string_equal(json_string_value(json_object_get(msg, "content")), "\xC3\xA9");
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
    json_t *e0 = json_array_get(json_object_get(json_object_get(c, "logprobs"), "content"), 0);
    assert_string_equal(json_string_value(json_object_get(e0, "token")), "\xC3\xA9");
    assert_true(json_real_value(json_object_get(e0, "logprob")) == -0.25);
    json_t *bytes = json_object_get(e0, "bytes");
    assert_int_equal(json_array_size(bytes), 2);
    assert_int_equal(json_integer_value(json_array_get(bytes, 0)), 0xC3);
    assert_int_equal(json_array_size(json_object_get(e0, "top_logprobs")), 0);
    json_decref(j);
    json_decref(lp);
    kvr_free(s);

    /* No logprobs asked for: null. */
    s = kvr_openai_response_json(&m, "", 0, KVR_OPENAI_FINISH_STOP, 4, 0, NULL, &len);
    j = load(s, len);
    c = json_array_get(json_object_get(j, "choices"), 0);
    assert_true(json_is_null(json_object_get(c, "logprobs")));
    json_decref(j);
    kvr_free(s);
}

static void test_sse(void **state)
{
    struct kvr_openai_meta m = {KVR_OPENAI_CHAT, "chatcmpl-x", 1, "stories", true, 0};
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    assert_int_equal(kvr_openai_sse_chunk(&b, &m, true, "", 0, KVR_OPENAI_FINISH_NONE, NULL), 0);
    assert_int_equal(kvr_openai_sse_chunk(&b, &m, false, "Hi", 2, KVR_OPENAI_FINISH_NONE, NULL), 0);
    assert_int_equal(kvr_openai_sse_chunk(&b, &m, false, "", 0, KVR_OPENAI_FINISH_STOP, NULL), 0);
    assert_int_equal(kvr_openai_sse_usage(&b, &m, 3, 1), 0);
    kvr_openai_sse_done(&b);
    assert_false(b.failed);

    /* Split into events and check each. */
    const char *want_delta[] = {"{\"role\":\"assistant\",\"content\":\"\"}", "{\"content\":\"Hi\"}",
                                "{}"};
    char *p = b.data;
    for (int i = 0; i < 5; i++) {
        assert_memory_equal(p, "data: ", 6);
        char *end = strstr(p, "\n\n");
        assert_non_null(end);
        if (i == 4) {
            assert_memory_equal(p, "data: [DONE]\n\n", 14);
            assert_int_equal(end + 2 - b.data, (long)b.len);
            break;
        }
        json_t *j = load(p + 6, (size_t)(end - p - 6));
        assert_string_equal(json_string_value(json_object_get(j, "object")),
                            "chat.completion.chunk");
        json_t *choices = json_object_get(j, "choices");
        if (i < 3) {
            json_t *c = json_array_get(choices, 0);
            char *d = json_dumps(json_object_get(c, "delta"), JSON_COMPACT);
            assert_string_equal(d, want_delta[i]);
            free(d);
            assert_true(json_is_null(json_object_get(j, "usage")));
            if (i == 2)
                assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "stop");
            else
                assert_true(json_is_null(json_object_get(c, "finish_reason")));
        } else {
            assert_int_equal(json_array_size(choices), 0);
            json_t *u = json_object_get(j, "usage");
            assert_int_equal(json_integer_value(json_object_get(u, "total_tokens")), 4);
        }
        json_decref(j);
        p = end + 2;
    }

    /* Completions chunks carry "text"; without include_usage there is no usage key. */
    kvr_sbuf_clear(&b);
    struct kvr_openai_meta mc = {KVR_OPENAI_COMPLETIONS, "cmpl-x", 1, "stories", false, 0};
    assert_int_equal(kvr_openai_sse_chunk(&b, &mc, true, "a\"b", 3, KVR_OPENAI_FINISH_LENGTH, NULL),
                     0);
    json_t *j = load(b.data + 6, b.len - 8);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(c, "text")), "a\"b");
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "length");
    assert_null(json_object_get(j, "usage"));
    json_decref(j);

    /* Errors inside a stream. */
    kvr_sbuf_clear(&b);
    struct kvr_openai_error e = {0};
    kvr_openai_error_set(&e, 500, "server_error", NULL, "ring_down", "the ring went down");
    assert_int_equal(kvr_openai_sse_error(&b, &e), 0);
    j = load(b.data + 6, b.len - 8);
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "error"), "message")),
                        "the ring went down");
    json_decref(j);
    kvr_sbuf_fini(&b);
}

/* response_format, grammar and json_schema give the request a grammar that compiles. */
static void test_grammar_fields(void **state)
{
    (void)state;
    const char *bodies[] = {
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"response_format\": "
        "{\"type\": \"json_object\"}}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"response_format\": "
        "{\"type\": \"json_schema\", \"json_schema\": {\"name\": \"n\", \"strict\": true, "
        "\"schema\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}}}}}",
        "{\"prompt\": \"hi\", \"grammar\": \"root ::= [0-9]+\"}",
        "{\"prompt\": \"hi\", \"json_schema\": {\"enum\": [1, 2]}}",
        "{\"prompt\": \"hi\", \"response_format\": {\"type\": \"json_object\", \"schema\": "
        "{\"type\": \"array\"}}}",
    };
    for (size_t i = 0; i < sizeof bodies / sizeof *bodies; i++) {
        struct kvr_openai_req r;
        struct kvr_openai_error e = {0};
        enum kvr_openai_api api = bodies[i][2] == 'm' ? H : C;
        if (kvr_openai_parse(&r, api, bodies[i], strlen(bodies[i]), &lim, &e))
            fail_msg("%s: %s", bodies[i], e.message);
        assert_non_null(r.grammar);
        assert_true(r.grammar_len > 0);
        kvr_openai_req_fini(&r);
    }
    struct kvr_openai_req r;
    const char *text = "{\"prompt\": \"hi\", \"response_format\": {\"type\": \"text\"}}";
    assert_int_equal(kvr_openai_parse(&r, C, text, strlen(text), &lim, NULL), 0);
    assert_null(r.grammar);
    kvr_openai_req_fini(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_good_completion),
        cmocka_unit_test(test_good_chat),
        cmocka_unit_test(test_parse_out_of_memory),
        cmocka_unit_test(test_check_length),
        cmocka_unit_test(test_budget_header),
        cmocka_unit_test(test_utf8),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_response_completion),
        cmocka_unit_test(test_response_chat),
        cmocka_unit_test(test_logprobs_alternatives),
        cmocka_unit_test(test_sse),
        cmocka_unit_test(test_logit_bias),
        cmocka_unit_test(test_seeds),
        cmocka_unit_test(test_aliases_and_defaults),
        cmocka_unit_test(test_tokenize_fields),
        cmocka_unit_test(test_every_refused_field),
        cmocka_unit_test(test_grammar_fields),
        cmocka_unit_test(test_tools),
        cmocka_unit_test(test_prediction),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
