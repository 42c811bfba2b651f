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
 * Liveness rides on the same bytes: a receiver answers every HEARTBEAT frame with one ack
 * byte (0x02). So a sender that has sent something (a frame or a heartbeat) and heard
 * nothing back, neither credit nor ack, for the heartbeat timeout knows its downstream has
 * stopped reading, even though the socket is open and the kernel still takes bytes.
 *
 * Pure socket helpers; the caller owns the fd and decides which thread reads credits (the
 * sending side) and which writes them (the receiving side). */
#ifndef KVR_RING_CREDIT_H
#define KVR_RING_CREDIT_H

#include <stdbool.h>
#include <stdint.h>

#define KVR_CREDIT_BYTE 0x01
#define KVR_CREDIT_ACK 0x02

/* A heartbeat goes downstream after this long without a frame; a downstream that has
 * answered nothing (credit or ack) for KVR_CREDIT_DEAD_MS since something was sent to it
 * is dead. */
#define KVR_CREDIT_HEARTBEAT_MS 1000
#define KVR_CREDIT_DEAD_MS 3000

/* Write n credits to fd. KVR_ECLOSED if the peer is gone. */
int kvr_credit_grant(int fd, uint32_t n);

/* Answer a heartbeat: one ack byte. KVR_ECLOSED if the peer is gone; a full socket
 * (the peer does not read credits either) is not an error here. */
int kvr_credit_ack(int fd);

/* Without waiting, read every byte available on fd: credits are added to *credits, and
 * *heard is set when any byte (credit or ack) came. 0 (possibly nothing new), KVR_ECLOSED
 * if the peer closed, KVR_EPROTO on a byte that is neither. */
int kvr_credit_read(int fd, uint32_t *credits, bool *heard);

/* Read every credit byte available on fd (waiting at most timeout_ms for the first if
 * *credits is 0) and add them to *credits. 0 on success (possibly with no new credit),
 * KVR_ECLOSED if the peer closed, KVR_EPROTO on a byte that is not a credit or an ack. */
int kvr_credit_take(int fd, uint32_t *credits, int timeout_ms);

#endif
