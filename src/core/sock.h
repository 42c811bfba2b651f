/* sock.h - TCP socket helpers over BSD sockets, in the manner of Redis's anet.c: the
 * steps every connecting side shares (open a non-blocking socket, start a connect, read
 * its result, wait for readiness before a deadline, set TCP_NODELAY and blocking mode).
 * The ring's links and the HTTP client compose them with their own name resolution,
 * cancellation and messages.
 *
 * Each returns 0 or a negative enum kvr_status and explains a failure in `err` (may be
 * NULL) with the OS's words (strerror), which callers may wrap with what they were doing.
 * Deadlines are absolute kvr_now_ns() values; 0 waits forever. A file descriptor passed
 * in stays the caller's, also on failure. No globals; any thread. */
#ifndef KVR_CORE_SOCK_H
#define KVR_CORE_SOCK_H

#include "core/err.h"

#include <stdbool.h>
#include <stdint.h>

struct addrinfo;

/* kvr_now_ns() + timeout_ms, or 0 (forever) when timeout_ms < 0. */
uint64_t kvr_sock_deadline(int timeout_ms);
/* A deadline that has already passed: a wait checks readiness without blocking. */
#define KVR_SOCK_NOW 1ull

/* Wait until fd is ready for `events` (POLLIN, POLLOUT) or the deadline passes: 0 when
 * ready (an error or hang-up counts as ready: the next call reports it), KVR_ETIMEDOUT
 * ("timed out"), KVR_EIO when poll fails. A signal does not end the wait early. */
int kvr_sock_wait(int fd, short events, uint64_t deadline_ns, struct kvr_err *err);

/* A new non-blocking, close-on-exec socket for ai's family, type and protocol, in *out_fd
 * (the caller closes it). KVR_EIO ("socket: ...") when the OS refuses. */
int kvr_sock_open(const struct addrinfo *ai, int *out_fd, struct kvr_err *err);

/* Start connecting the non-blocking socket fd to ai's address: 0 when connected at once,
 * KVR_EAGAIN while under way (wait for POLLOUT, then kvr_sock_connect_result), KVR_ECLOSED
 * when refused (nobody listens there), KVR_EIO otherwise. */
int kvr_sock_connect_begin(int fd, const struct addrinfo *ai, struct kvr_err *err);
/* The outcome of a connect that was under way, once fd is writable: 0, KVR_ECLOSED when
 * refused, KVR_EIO otherwise. */
int kvr_sock_connect_result(int fd, struct kvr_err *err);

/* Connect to ai's address before the deadline: open, begin, wait, result, then blocking
 * mode and TCP_NODELAY, the socket in *out_fd. On failure nothing is left open. */
int kvr_sock_connect(const struct addrinfo *ai, uint64_t deadline_ns, int *out_fd,
                     struct kvr_err *err);

/* TCP_NODELAY on: small messages (frames, streamed tokens) leave at once, without Nagle's
 * wait for an acknowledgement. KVR_EIO ("TCP_NODELAY: ...") on failure. */
int kvr_sock_set_nodelay(int fd, struct kvr_err *err);
/* Clear (blocking) or set O_NONBLOCK. KVR_EIO ("fcntl: ...") on failure. */
int kvr_sock_set_blocking(int fd, bool blocking, struct kvr_err *err);

#endif
