/* topview.h - what `kvasir top` reads from a bridge's GET /metrics and how it draws it:
 * pure functions from a parsed metrics text (promtext.h) to a snapshot, and from one or two
 * snapshots to the text of a frame, so the view is testable without a server or terminal.
 *
 * A snapshot holds the ring's state (up, requests running / waiting, admitted and refused
 * by reason, tokens per second, KV use, latency histograms' sums and counts), per stage the
 * fractions of time it was busy (held), waiting for work (starved) and waiting for its
 * downstream (blocked), and per expert agent (docs/EXPERTS.md) its counters: seconds held,
 * starved and blocked, and (row, expert) pairs computed. A frame shows counters with their
 * rates since the previous snapshot, and per agent the fractions of the last interval it
 * spent held, starved and blocked, its pairs (with their rate) and its share of all agents'
 * pairs, the load balance the plan's expert placement aims for. Only the kvasir:* series it
 * knows are read; anything else is ignored, and a series that is missing shows as "-".
 *
 * Ownership: the caller's structs and buffer; no I/O, no globals, no clock (the caller
 * stamps t_ns and passes the wall-clock text). One thread per snapshot. */
#ifndef KVR_CLIENT_TOPVIEW_H
#define KVR_CLIENT_TOPVIEW_H

#include "core/sbuf.h"
#include "client/promtext.h"
#include "core/err.h"

#include <stdbool.h>
#include <stdint.h>

#define KVR_TOP_MAX_STAGES 64
#define KVR_TOP_MAX_AGENTS 64
#define KVR_TOP_MAX_REASONS 8

/* What one poll read; NAN where the server did not say. */
struct kvr_top_snapshot {
    uint64_t t_ns; /* when it was read (the caller's clock) */
    bool ok;       /* false: error says why the server could not be read */
    int status;    /* the HTTP status of GET /metrics; 0 when none came back */
    char error[KVR_ERR_MSG_BYTES];
    double ring_up, running, waiting, in_progress, kv_used, kv_total, tok_per_s, batch_ms;
    double admitted, refused, generated;
    double ttft_sum, ttft_count, itl_sum, itl_count, e2e_sum, e2e_count;
    uint32_t n_stages;
    double held[KVR_TOP_MAX_STAGES], starved[KVR_TOP_MAX_STAGES], blocked[KVR_TOP_MAX_STAGES];
    uint32_t n_agents; /* 0: the plan has no expert agents */
    double agent_held_s[KVR_TOP_MAX_AGENTS], agent_starved_s[KVR_TOP_MAX_AGENTS];
    double agent_blocked_s[KVR_TOP_MAX_AGENTS], agent_pairs[KVR_TOP_MAX_AGENTS];
    /* refusals by reason, as the server labels them */
    char reason[KVR_TOP_MAX_REASONS][32];
    double reason_n[KVR_TOP_MAX_REASONS];
    uint32_t n_reasons;
};

/* Fill s (all but t_ns, ok and error) from a parsed metrics text. */
void kvr_top_read(const struct kvr_prom *p, struct kvr_top_snapshot *s);

/* Append a frame for snapshot s to b: prev is the previous good snapshot (NULL on the
 * first poll: no rates), url and clock head the frame; ansi adds colours and the escapes
 * that clear what a longer previous frame left on each line. A server that answered 401 is
 * UNAUTHORIZED (the key is missing or wrong), one that did not answer UNREACHABLE. */
void kvr_top_render(struct kvr_sbuf *b, bool ansi, const char *url, const char *clock,
                    const struct kvr_top_snapshot *s, const struct kvr_top_snapshot *prev);

#endif
