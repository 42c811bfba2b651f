/* http.h - the bridge's OpenAI-compatible HTTP API, served by libmicrohttpd.
 *
 * Endpoints (docs/API.md has the details):
 *   POST /v1/completions, POST /v1/chat/completions   JSON or SSE streaming
 *   GET  /v1/models                                    the one model
 *   GET  /health                                       200 when the ring can serve, else 503
 *   GET  /metrics                                      Prometheus text
 *   OPTIONS on any of them                             a CORS preflight: 204
 * http.c is the transport: routes, API key, bodies, responses and SSE. A generation request
 * goes to generation.c, which parses it (openai.c), renders a chat (chat.c), tokenizes the
 * prompt with the service's tokenizer, submits it to a struct kvr_service and turns its
 * events into text; http_metrics.c keeps the metrics.
 *
 * Threading: libmicrohttpd runs one listening thread plus one thread per connection
 * (MHD_USE_THREAD_PER_CONNECTION), so a request's thread may block: it waits on the
 * service's next() in slices of at most 100 ms and between slices checks whether the
 * client has gone (peer closed or reset the socket), cancelling the stream if so. The
 * number of connections (hence threads) is bounded by max_connections, and the door
 * (http_door.h) keeps idle and slow ones from holding them. All state shared between
 * connections (the metrics, the door) is behind a mutex each.
 *
 * Ownership: kvr_http_create borrows `svc` (and everything it points to) and copies the
 * configuration's strings; both must stay valid until kvr_http_destroy returns. */
#ifndef KVR_BRIDGE_HTTP_H
#define KVR_BRIDGE_HTTP_H

#include "bridge/service.h"
#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvr_http_config {
    const char *host; /* IPv4 address to listen on; default "127.0.0.1" */
    uint16_t port;    /* default 8080; 0 picks a free port (see kvr_http_port) */
    /* Bearer token required on every endpoint but /health; NULL or "" = no auth. Defaults
     * to the KVASIR_API_KEY environment variable. */
    const char *api_key;
    size_t max_body_bytes; /* larger request bodies get 413; default 1 MiB */
    /* The door (http_door.h, docs/API.md "Connection limits"): connections held at once
     * (1/8 of them kept for requests whose headers are in; default 512), per client
     * address (default 64; 0 = no limit), and the deadlines: request headers within
     * header_timeout_s of connecting (10), the body within body_timeout_s of the headers
     * (30), a keep-alive connection's next request within idle_timeout_s (60). */
    uint32_t max_connections;
    uint32_t max_per_client;
    uint32_t header_timeout_s, body_timeout_s, idle_timeout_s;
    /* Access-Control-Allow-Origin on every response, and OPTIONS preflights answered
     * without the key; default "*"; NULL, "" or "none" = no CORS headers. */
    const char *cors_origin;
    bool metrics_public; /* GET /metrics without the API key */
    /* A generation the service sends nothing for during this long is cancelled and
     * answered with 504; a safety net under the service's own budgets. Default 300. */
    uint32_t stall_timeout_s;
    /* Tokens to generate when a request gives no max_tokens; 0 = OpenAI's defaults
     * (completions 16, chat the rest of the context). */
    uint32_t default_max_tokens;
    /* The chat template: a built-in by name (chat.h), else Jinja source (e.g. a file
     * given with --chat-template; need not be NUL-terminated), else the service's
     * chat_template, else the plain "role: content" form. */
    const char *chat_template;
    const char *chat_template_src;
    size_t chat_template_src_len;
    /* HTTPS: PEM files of the certificate (chain) and its private key, both or neither;
     * NULL = plain HTTP. Read once by kvr_http_create (libmicrohttpd with GnuTLS). */
    const char *tls_cert_file;
    const char *tls_key_file;
};

/* Fill the defaults above (reads KVASIR_API_KEY). */
void kvr_http_config_init(struct kvr_http_config *cfg);

/* The command-line options of the door, CORS and metrics (--max-connections N,
 * --max-per-client N, --header-timeout S, --body-timeout S, --idle-timeout S,
 * --cors-origin ORIGIN, --metrics-public): argv[0] is the option, argv[1] its value if it
 * takes one. Returns how many arguments it used (1 or 2), 0 when argv[0] is none of them,
 * or KVR_EINVAL with a message in err (a missing or bad value). Values are borrowed. */
int kvr_http_config_arg(struct kvr_http_config *cfg, int argc, char **argv, struct kvr_err *err);
/* Their help lines, for a usage text. */
extern const char kvr_http_config_help[];

struct kvr_http;

/* Start serving. Fails with KVR_EINVAL for a bad configuration or service (missing ops,
 * n_ctx 0, no tokenizer, unknown template name, only one of the TLS files), KVR_ENOTSUP
 * when TLS is asked of a libmicrohttpd built without it, and KVR_EIO when a TLS file cannot
 * be read or the address cannot be bound (or GnuTLS refuses the certificate or key). */
int kvr_http_create(struct kvr_http **out, const struct kvr_http_config *cfg,
                    const struct kvr_service *svc, struct kvr_err *err);
/* The port actually listened on. */
uint16_t kvr_http_port(const struct kvr_http *h);
/* Stop accepting; give generations in progress up to 1.5 s to answer their clients with
 * 503 "shutting_down" (in a stream: an error event, then [DONE]); then close every
 * connection (their streams are cancelled and released), join all threads and free
 * everything. NULL is allowed. */
void kvr_http_destroy(struct kvr_http *h);

#endif
