/* http_int.h - what http.c (transport and routing) shares with http_endpoints.c (the
 * endpoints other than generation): the server, one request's state, and the reply
 * helpers. Private to those two files. */
#ifndef KVR_BRIDGE_HTTP_INT_H
#define KVR_BRIDGE_HTTP_INT_H

#include "bridge/generation.h"
#include "bridge/http.h"
#include "bridge/http_door.h"
#include "bridge/http_metrics.h"
#include "bridge/openai.h"
#include "core/sbuf.h"

#include <jansson.h>
#include <microhttpd.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

/* How long one wait on the service may last before we look at the client socket again. */
#define POLL_SLICE_MS 100
/* At shutdown, how long generations in progress get to tell their clients (a 503, or an
 * error event and [DONE]) before every connection is closed. */
#define SHUTDOWN_GRACE_MS 1500
/* GET /v1/telemetry streams open at once (each costs at most 10 snapshots a second). */
#define MAX_TELEMETRY_STREAMS 8
/* A connection's thread runs the request's parsing, chat template and JSON: 512 KiB is
 * several times what they use (the Jinja and JSON depths are bounded), and keeps a full
 * house of threads small. */
#define THREAD_STACK_BYTES (512u * 1024)

/* ---- the server --------------------------------------------------------------------- */

struct kvr_http {
    struct MHD_Daemon *daemon;
    const struct kvr_service *svc;
    uint16_t port;
    char *api_key; /* NULL: no auth */
    size_t api_key_len;
    char *tls_cert, *tls_key; /* PEM text for HTTPS (owned), or NULL */
    size_t max_body_bytes;
    struct kvr_http_door *door;
    uint32_t idle_timeout_s;     /* a connection's inactivity limit between requests */
    uint32_t generate_timeout_s; /* ... while a generation may be silent (first token) */
    char *cors_origin;           /* Access-Control-Allow-Origin, or NULL (owned) */
    bool metrics_public;
    struct kvr_chat *chat;
    char *bos_text; /* the BOS token's text, or NULL */
    int32_t n_vocab;
    int64_t started_s; /* "created" of the model in /v1/models */
    atomic_bool stopping;
    struct kvr_http_metrics metrics;
    struct kvr_generation_env gen;         /* points at svc, chat, bos_text and metrics */
    struct kvr_responses_store *responses; /* /v1/responses' previous_response_id (owned) */
    atomic_int n_telemetry;                /* open /v1/telemetry streams */
};

/* Per-request state (MHD's con_cls), from the first call of on_request to on_completed. */
struct request {
    enum kvr_http_endpoint ep;
    char *model_id; /* GET /v1/models/{id}: the id asked for (owned); NULL for the list */
    uint64_t t_start_ns;
    struct kvr_sbuf body;
    bool too_large; /* the body passed max_body_bytes; the rest was dropped */
    bool answered;  /* a response was queued early (before the body was read) */
    /* The URL's path (libmicrohttpd's, valid until on_completed). */
    const char *url;
};

/* ---- replies (http.c) ---------------------------------------------------------------- */

enum MHD_Result kvr_http_reply(struct kvr_http *h, struct request *rq, struct MHD_Connection *c,
                               int status, const char *ctype, char *body, size_t len,
                               const char *const *headers);
enum MHD_Result kvr_http_reply_json(struct kvr_http *h, struct request *rq,
                                    struct MHD_Connection *c, int status, json_t *j,
                                    const char *const *headers);
enum MHD_Result kvr_http_reply_error(struct kvr_http *h, struct request *rq,
                                     struct MHD_Connection *c, const struct kvr_openai_error *e,
                                     const char *const *headers);
enum MHD_Result kvr_http_reply_simple_error(struct kvr_http *h, struct request *rq,
                                            struct MHD_Connection *c, int status, const char *type,
                                            const char *code, const char *const *headers,
                                            const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));
int kvr_http_connection_fd(struct MHD_Connection *c);

/* ---- endpoints (http_endpoints.c) ------------------------------------------------------ */

enum MHD_Result kvr_http_handle_models(struct kvr_http *h, struct request *rq,
                                       struct MHD_Connection *c);
enum MHD_Result kvr_http_handle_health(struct kvr_http *h, struct request *rq,
                                       struct MHD_Connection *c);
enum MHD_Result kvr_http_handle_metrics(struct kvr_http *h, struct request *rq,
                                        struct MHD_Connection *c);
enum MHD_Result kvr_http_handle_tokenize(struct kvr_http *h, struct request *rq,
                                         struct MHD_Connection *c);
enum MHD_Result kvr_http_handle_detokenize(struct kvr_http *h, struct request *rq,
                                           struct MHD_Connection *c);
enum MHD_Result kvr_http_handle_apply_template(struct kvr_http *h, struct request *rq,
                                               struct MHD_Connection *c);
enum MHD_Result kvr_http_handle_console(struct kvr_http *h, struct request *rq,
                                        struct MHD_Connection *c);
enum MHD_Result kvr_http_handle_telemetry(struct kvr_http *h, struct request *rq,
                                          struct MHD_Connection *c);

#endif
