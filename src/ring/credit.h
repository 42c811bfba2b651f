/* credit.h - credit-based flow control on a link (docs/PROTOCOL.md "Credits").
 *
 * Frames flow downstream; credits flow back upstream on the same TCP connection, one byte
 * (0x01) per credit. A receiver grants one credit per input slot it has free: after the
 * handshake it grants all of its slots, then one more each time it finishes with a frame.
 * A sender sends a BATCH or RESULT frame only while it holds a credit (heartbeats and
 * goodbyes need none). So a stage never has more frames queued than it has slots, kernel
 * socket buffers never hide a slow stage, and "blocked" telemetry means exactly that the
 * downstream had no room (DESIGN.md 5).
 *
 * Pure socket helpers; the caller owns the fd and decides which thread reads credits (the
 * sending side) and which writes them (the receiving side). */
#ifndef KVR_RING_CREDIT_H
#define KVR_RING_CREDIT_H

#include <stdint.h>

#define KVR_CREDIT_BYTE 0x01

/* Write n credits to fd. KVR_ECLOSED if the peer is gone. */
int kvr_credit_grant(int fd, uint32_t n);

/* Read every credit byte available on fd (waiting at most timeout_ms for the first if
 * *credits is 0) and add them to *credits. 0 on success (possibly with no new credit),
 * KVR_ECLOSED if the peer closed, KVR_EPROTO on a byte that is not a credit. */
int kvr_credit_take(int fd, uint32_t *credits, int timeout_ms);

#endif
