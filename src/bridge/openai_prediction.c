/* openai_prediction.c - OpenAI's "Predicted Outputs" field (see openai.h, "prediction"):
 *
 *   "prediction": {"type": "content", "content": "text" | [{"type": "text", "text": "..."}]}
 *
 * The text is what the client expects the answer to be, mostly; Kvasir drafts from it
 * (bridge/draft.h), so a good prediction makes the answer come sooner and a bad one costs
 * little. The answer itself is never changed by it. */
#include "bridge/openai.h"

#include <string.h>

static int bad(struct kvr_openai_error *e, const char *param, const char *msg)
{
    return kvr_openai_error_set(e, 400, "invalid_request_error", param, "invalid_type", "%s", msg);
}

int kvr_openai_parse_prediction(struct kvr_openai_req *r, struct kvr_openai_error *e)
{
    json_t *v = json_object_get(r->root, "prediction");
    if (!v || json_is_null(v))
        return KVR_OK;
    static const char *const known[] = {"type", "content", NULL};
    if (!json_is_object(v))
        return bad(e, "prediction", "'prediction' must be an object");
    int rc = kvr_openai_check_keys(v, "prediction", known, e);
    if (rc)
        return rc;
    json_t *type = json_object_get(v, "type"), *content = json_object_get(v, "content");
    if (!json_is_string(type) || strcmp(json_string_value(type), "content") != 0)
        return bad(e, "prediction.type", "'prediction.type' must be \"content\"");
    if (json_is_array(content)) {
        static const char *const part_keys[] = {"type", "text", NULL};
        size_t i;
        json_t *part;
        json_array_foreach(content, i, part)
        {
            if (!json_is_object(part) ||
                kvr_openai_check_keys(part, "prediction.content", part_keys, e))
                return bad(e, "prediction.content",
                           "each part of 'prediction.content' must be "
                           "{\"type\": \"text\", \"text\": string}");
            json_t *pt = json_object_get(part, "type"), *tx = json_object_get(part, "text");
            if (!json_is_string(pt) || strcmp(json_string_value(pt), "text") != 0 ||
                !json_is_string(tx))
                return bad(e, "prediction.content",
                           "each part of 'prediction.content' must be "
                           "{\"type\": \"text\", \"text\": string}");
        }
    } else if (!json_is_string(content)) {
        return bad(e, "prediction.content",
                   "'prediction.content' must be a string or an array of text parts");
    }
    r->prediction = content;
    return KVR_OK;
}

void kvr_openai_prediction_text(const struct kvr_openai_req *r, struct kvr_sbuf *out)
{
    const json_t *c = r->prediction;
    if (json_is_string(c)) {
        kvr_sbuf_append(out, json_string_value(c), json_string_length(c));
        return;
    }
    size_t i;
    const json_t *part;
    json_array_foreach(c, i, part)
    {
        const json_t *tx = json_object_get(part, "text");
        kvr_sbuf_append(out, json_string_value(tx), json_string_length(tx));
    }
}
