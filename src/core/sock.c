/* sock.c - TCP socket helpers (see sock.h). */
#include "core/sock.h"

#include "core/clock.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

uint64_t kvr_sock_deadline(int timeout_ms)
{
    if (timeout_ms < 0)
        return 0;
    return kvr_now_ns() + (uint64_t)timeout_ms * 1000000u;
}

/* poll() timeout for the time left until the deadline: -1 = forever, 0 = passed. */
static int poll_ms(uint64_t deadline_ns)
{
    if (deadline_ns == 0)
        return -1;
    uint64_t now = kvr_now_ns();
    if (now >= deadline_ns)
        return 0;
    uint64_t ms = (deadline_ns - now + 999999) / 1000000;
    return ms > INT_MAX ? INT_MAX : (int)ms;
}

int kvr_sock_wait(int fd, short events, uint64_t deadline_ns, struct kvr_err *err)
{
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = events};
        int r = poll(&pfd, 1, poll_ms(deadline_ns));
        if (r > 0)
            return KVR_OK;
        if (r == 0)
            return kvr_err_set(err, KVR_ETIMEDOUT, "timed out");
        if (errno != EINTR)
            return kvr_err_set(err, KVR_EIO, "poll: %s", strerror(errno));
    }
}

int kvr_sock_open(const struct addrinfo *ai, int *out_fd, struct kvr_err *err)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0)
        return kvr_err_set(err, KVR_EIO, "socket: %s", strerror(errno));
    *out_fd = fd;
    return KVR_OK;
}

/* A connect's errno as a status: refused means nobody listens there (yet). */
static int connect_error(int e, struct kvr_err *err)
{
    return kvr_err_set(err, e == ECONNREFUSED ? KVR_ECLOSED : KVR_EIO, "%s", strerror(e));
}

int kvr_sock_connect_begin(int fd, const struct addrinfo *ai, struct kvr_err *err)
{
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0)
        return KVR_OK;
    if (errno == EINPROGRESS)
        return KVR_EAGAIN;
    return connect_error(errno, err);
}

int kvr_sock_connect_result(int fd, struct kvr_err *err)
{
    int soerr = 0;
    socklen_t len = sizeof soerr;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) != 0)
        soerr = errno;
    return soerr ? connect_error(soerr, err) : KVR_OK;
}

int kvr_sock_connect(const struct addrinfo *ai, uint64_t deadline_ns, int *out_fd,
                     struct kvr_err *err)
{
    int fd;
    int rc = kvr_sock_open(ai, &fd, err);
    if (rc)
        return rc;
    rc = kvr_sock_connect_begin(fd, ai, err);
    if (rc == KVR_EAGAIN && (rc = kvr_sock_wait(fd, POLLOUT, deadline_ns, err)) == KVR_OK)
        rc = kvr_sock_connect_result(fd, err);
    if (rc || (rc = kvr_sock_set_blocking(fd, true, err)) || (rc = kvr_sock_set_nodelay(fd, err)))
        goto close_fd;
    *out_fd = fd;
    return KVR_OK;
close_fd:
    close(fd);
    return rc;
}

int kvr_sock_set_nodelay(int fd, struct kvr_err *err)
{
    int one = 1;
    if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
        return kvr_err_set(err, KVR_EIO, "TCP_NODELAY: %s", strerror(errno));
    return KVR_OK;
}

int kvr_sock_set_blocking(int fd, bool blocking, struct kvr_err *err)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fl = fcntl(fd, F_SETFL, blocking ? fl & ~O_NONBLOCK : fl | O_NONBLOCK);
    if (fl < 0)
        return kvr_err_set(err, KVR_EIO, "fcntl: %s", strerror(errno));
    return KVR_OK;
}
