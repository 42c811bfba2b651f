/* service.h - the contract between the HTTP API (http.c, generation.c) and whatever
 * generates tokens: the bridge's scheduler in production, a fake in tests/unit/test_http.c.
 *
 * The HTTP layer validates and tokenizes a request, then hands the service prompt ids, a
 * token budget, sampling parameters and a latency budget (submit). The service either
 * admits the request at once and returns a stream, or refuses it at once with a reason, a
 * message and a retry hint (the HTTP layer picks the status): it never queues work it
 * expects to be late. The HTTP layer then pulls one event per generated token (next) and
 * turns them into text, stop strings, SSE chunks and metrics. A client that goes away, or
 * a stop string that appears in the text, ends the stream early (cancel). Every admitted
 * stream is released exactly once (release).
 *
 * Sequence of calls for one request (all from one HTTP connection thread):
 *
 *   submit ──refused──▶ (nothing to release)
 *      │admitted
 *      ▼
 *   next, next, ... (each returns one event; the last one has finish != NONE)
 *      │              ╲ at any point: cancel (stop string hit, client gone, shutdown)
 *      ▼
 *   release
 *
 * Threads: submit, health and metrics may be called from many threads at once (one per
 * HTTP connection, plus /health and /metrics). The calls on one stream (next, cancel,
 * release) come from one thread at a time, never concurrently, though not always the same
 * thread. The service must make next() return within about its timeout whatever the ring
 * is doing, so that the HTTP layer can notice a client that disconnected.
 *
 * Ownership: the service owns its streams; `struct kvr_gen_stream` is opaque to the HTTP
 * layer and stays valid until release. Everything a request points at (prompt ids) is
 * borrowed only for the duration of submit: the service copies what it keeps. The
 * struct kvr_service and everything it points to (tokenizer, name, template) is owned by
 * the caller of kvr_http_create and must outlive the HTTP server. */
#ifndef KVR_BRIDGE_SERVICE_H
#define KVR_BRIDGE_SERVICE_H

#include "bridge/request.h"
#include "core/sbuf.h"
#include "core/err.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvr_gen_stream; /* opaque, owned by the service */
struct kvr_telemetry_reader;
struct kvr_telemetry_snapshot;

struct kvr_service_ops {
    /* Admit a request or refuse it immediately. Returns 0 and sets *out to a new stream,
     * or a negative status with *refusal filled (request.h; no stream to release). Either
     * way *refusal's estimates may be set (0 when the service has none). Never blocks on
     * the ring. */
    int (*submit)(void *ctx, const struct kvr_gen_request *req, struct kvr_gen_stream **out,
                  struct kvr_refusal *refusal);
    /* Wait up to timeout_ms for the stream's next event. Returns 0 with *ev filled;
     * KVR_ETIMEDOUT when nothing arrived in time (call again); KVR_ECLOSED after the
     * event carrying a finish, or after cancel. */
    int (*next)(struct kvr_gen_stream *s, struct kvr_gen_event *ev, uint32_t timeout_ms);
    /* The client no longer wants tokens: stop generating and free the sequence in the
     * ring. Returns at once; idempotent; harmless after the stream finished. */
    void (*cancel)(struct kvr_gen_stream *s);
    /* Forget the stream (cancelling it first if it has not finished). Called exactly once
     * per admitted stream; `s` is invalid afterwards. */
    void (*release)(struct kvr_gen_stream *s);
    /* Is the ring able to serve? May add fields to `detail` (a JSON object), e.g.
     * "stages": [{"index": 0, "addr": "10.0.0.1:7000", "layers": [0, 11], "up": true}].
     * GET /health answers 200 with {"status": "ok", ...detail} when true, 503 with
     * {"status": "unavailable", ...detail} when false. */
    bool (*health)(void *ctx, json_t *detail);
    /* Append the service's metrics in Prometheus text format (HELP/TYPE lines and
     * samples; names prefixed "kvasir:"). GET /metrics returns the HTTP layer's own
     * metrics followed by these. May be NULL. */
    void (*metrics)(void *ctx, struct kvr_sbuf *out);
    /* POST /reset_prefix_cache: forget every cached KV block no sequence uses; returns how
     * many. May be NULL (nothing cached). */
    long (*reset_prefix_cache)(void *ctx);
    /* The console (docs/API.md). Admission's estimate for an admitted stream, in ms from
     * submit: its first token, and its last if all max_tokens come; and the id the
     * telemetry names the request by. False when there is none. Called right after submit,
     * on the same thread. May be NULL (no estimate headers). */
    bool (*estimate)(struct kvr_gen_stream *s, double *first_ms, double *total_ms, uint64_t *id);
    /* GET /v1/telemetry: fill `snap` with what `reader` has not seen yet (telemetry.h).
     * Called from the stream's connection thread, once per interval. May be NULL (404). */
    void (*telemetry)(void *ctx, struct kvr_telemetry_reader *reader,
                      struct kvr_telemetry_snapshot *snap);
    /* The access log: a stream's speculation so far (sched.h spec_*): drafted tokens, the
     * ones kept, decode rows that carried drafts. Called before release, on the stream's
     * thread. May be NULL (no speculation). */
    void (*spec)(struct kvr_gen_stream *s, uint32_t *drafted, uint32_t *accepted, uint32_t *steps);
};

/* What the HTTP layer is given. All pointers borrowed; see the ownership note above. */
struct kvr_service {
    const struct kvr_service_ops *ops;
    void *ctx;                 /* passed to submit, health and metrics */
    const char *model_name;    /* "id" in /v1/models and "model" in responses */
    uint32_t n_ctx;            /* most tokens per sequence, prompt + completion */
    const struct kvr_tok *tok; /* encodes prompts, decodes tokens; thread-safe */
    const char *chat_template; /* the GGUF's tokenizer.chat_template, or NULL */
    size_t chat_template_len;
};

#endif
