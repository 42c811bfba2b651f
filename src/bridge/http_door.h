/* http_door.h - the HTTP server's connection guard: deadlines, a cap that keeps a reserve,
 * and one log line per burst of refusals, so that no number of idle or trickling sockets
 * can hold the door shut (docs/API.md "Connection limits").
 *
 * A connection is in one of these states (http.c tells the door when it moves):
 *   fresh    accepted, its first request's headers not yet in: closed header_timeout_s
 *            after it was accepted, however slowly it trickles bytes
 *   body     headers in, the body being read: closed body_timeout_s after the headers
 *   working  the request is complete and being answered: no deadline here (the service's
 *            budgets and the stall timeout bound it)
 *   idle     a keep-alive connection between requests: closed idle_timeout_s after its
 *            last response
 * Fresh and idle connections together ("waiting": no request yet) may hold at most
 * max_connections - max_connections / 8 slots; the rest is the reserve for requests whose
 * headers have arrived (/health, /metrics, an authenticated client). When a new connection
 * would pass that share, or the total, the door closes the oldest idle connection, else
 * the oldest fresh one, to make room: a client that sends its request at once always gets
 * in, while a flood only displaces itself. A connection is closed with shutdown(2), which
 * wakes its thread; libmicrohttpd then closes the socket and reports it (kvr_http_door_closed).
 *
 * Every closing and refusal is counted (kvasir:http_connections_closed_total) and logged as
 * one summary line per 10 s window while they go on, never one line per connection.
 *
 * Threads: every function may be called from any thread; one mutex guards the door. With
 * `thread` set, kvr_http_door_create starts one thread that enforces the deadlines and
 * writes the summaries (tests call kvr_http_door_tick instead). Memory: the connection
 * records are allocated once at create (kvr_http_door_capacity of them). */
#ifndef KVR_BRIDGE_HTTP_DOOR_H
#define KVR_BRIDGE_HTTP_DOOR_H

#include "core/sbuf.h"

#include <stdbool.h>
#include <stdint.h>

/* Why the door closed or refused a connection: the reason label of
 * kvasir:http_connections_closed_total. */
enum kvr_http_door_reason {
    KVR_HTTP_DOOR_HEADER_TIMEOUT, /* no complete request headers within header_timeout_s */
    KVR_HTTP_DOOR_BODY_TIMEOUT,   /* the body not complete within body_timeout_s */
    KVR_HTTP_DOOR_IDLE_TIMEOUT,   /* keep-alive, no new request within idle_timeout_s */
    KVR_HTTP_DOOR_EVICTED,        /* closed to make room for a new connection */
    KVR_HTTP_DOOR_REFUSED_FULL,   /* refused: every slot holds a request being answered */
    KVR_HTTP_DOOR_REFUSED_CLIENT, /* refused: the client address holds max_per_client */
    KVR_HTTP_DOOR_REASON_COUNT
};

struct kvr_http_door_config {
    uint32_t max_connections; /* > 0 */
    uint32_t max_per_client;  /* enforced by libmicrohttpd; only reported here */
    uint32_t header_timeout_s, body_timeout_s, idle_timeout_s; /* > 0 */
    bool thread; /* run the deadline thread (the server); false in unit tests */
};

struct kvr_http_door;
struct kvr_http_door_conn; /* one connection's record (libmicrohttpd's socket context) */

/* KVR_EINVAL for a zero limit or timeout, KVR_ENOMEM, KVR_EIO if the thread won't start. */
int kvr_http_door_create(struct kvr_http_door **out, const struct kvr_http_door_config *cfg);
/* Stops the thread; connections still registered are forgotten, not closed. NULL is ok. */
void kvr_http_door_destroy(struct kvr_http_door *d);
/* Connections it can track: max_connections and room for those being closed. The server
 * gives libmicrohttpd this as its own hard limit. */
uint32_t kvr_http_door_capacity(const struct kvr_http_door *d);

/* A connection is about to be accepted (libmicrohttpd's accept policy): true to take it,
 * having closed older waiting connections if that was needed to make room. */
bool kvr_http_door_admit(struct kvr_http_door *d, uint64_t now_ns);
/* It was accepted on socket `fd`: its record (fresh), or NULL when there is none free
 * (the connection then has only libmicrohttpd's inactivity timeout). */
struct kvr_http_door_conn *kvr_http_door_opened(struct kvr_http_door *d, int fd, uint64_t now_ns);
/* Its request's headers are in (fresh or idle -> body). */
void kvr_http_door_headers(struct kvr_http_door *d, struct kvr_http_door_conn *c, uint64_t now_ns);
/* Its request is complete (body -> working). */
void kvr_http_door_working(struct kvr_http_door *d, struct kvr_http_door_conn *c);
/* Its response is done and it stays open for the next request (-> idle). */
void kvr_http_door_idle(struct kvr_http_door *d, struct kvr_http_door_conn *c, uint64_t now_ns);
/* libmicrohttpd is closing it (before closing the socket): the record is freed. */
void kvr_http_door_closed(struct kvr_http_door *d, struct kvr_http_door_conn *c);

/* libmicrohttpd refused a connection itself (its per-client or total limit). */
void kvr_http_door_refused(struct kvr_http_door *d, enum kvr_http_door_reason why, uint64_t now_ns);
/* A message from libmicrohttpd: logged, unless 3 were already logged in this burst of
 * windows (the rest are counted in the summaries instead). */
void kvr_http_door_message(struct kvr_http_door *d, const char *msg, uint64_t now_ns);

/* Close what is past its deadline and write the summary line of a finished window. Returns
 * the time of the next deadline (UINT64_MAX: none). The thread calls this. */
uint64_t kvr_http_door_tick(struct kvr_http_door *d, uint64_t now_ns);

/* Connections open (accepted and not closed or being closed). */
uint32_t kvr_http_door_open(struct kvr_http_door *d);
/* Closings and refusals by reason, since create. */
uint64_t kvr_http_door_count(struct kvr_http_door *d, enum kvr_http_door_reason why);
/* kvasir:http_connections_open and kvasir:http_connections_closed_total, Prometheus text. */
void kvr_http_door_print(struct kvr_http_door *d, struct kvr_sbuf *out);

#endif
