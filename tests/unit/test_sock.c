/* test_sock.c - the socket helpers on 127.0.0.1: a connect to a listener succeeds with a
 * blocking socket and TCP_NODELAY on, a connect where nobody listens is KVR_ECLOSED, the
 * begin/result pair reports the same, a wait ends at its deadline and as soon as data
 * comes, and the blocking mode toggles. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "core/clock.h"
#include "core/sock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MS_NS 1000000ull

/* A listener on 127.0.0.1 at a port the kernel picks; *port receives it. */
static int listen_any(uint16_t *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(listen(fd, 4), 0);
    socklen_t len = sizeof sa;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &len), 0);
    *port = ntohs(sa.sin_port);
    return fd;
}

/* 127.0.0.1:port as getaddrinfo gives it (freeaddrinfo after). */
static struct addrinfo *loopback(uint16_t port)
{
    char port_s[8];
    snprintf(port_s, sizeof port_s, "%u", (unsigned)port);
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    assert_int_equal(getaddrinfo("127.0.0.1", port_s, &hints, &res), 0);
    return res;
}

/* A port nobody listens on: one the kernel gave a listener that is closed again. */
static uint16_t closed_port(void)
{
    uint16_t port;
    close(listen_any(&port));
    return port;
}

static void test_deadline(void **state)
{
    (void)state;
    assert_int_equal(kvr_sock_deadline(-1), 0);
    uint64_t before = kvr_now_ns(), d = kvr_sock_deadline(250);
    assert_true(d >= before + 250 * MS_NS && d <= kvr_now_ns() + 250 * MS_NS);
}

static void test_connect_to_listener(void **state)
{
    (void)state;
    uint16_t port;
    int lfd = listen_any(&port);
    struct addrinfo *ai = loopback(port);
    struct kvr_err err = {0};
    int fd = -1;
    assert_int_equal(kvr_sock_connect(ai, kvr_sock_deadline(2000), &fd, &err), KVR_OK);
    assert_true(fd >= 0);
    assert_int_equal(fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
    assert_true(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    int nodelay = 0;
    socklen_t len = sizeof nodelay;
    assert_int_equal(getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &nodelay, &len), 0);
    assert_true(nodelay);

    /* Nothing to read yet: the wait ends at its deadline, not before. */
    int peer = accept(lfd, NULL, NULL);
    assert_true(peer >= 0);
    uint64_t t0 = kvr_now_ns();
    assert_int_equal(kvr_sock_wait(fd, POLLIN, t0 + 30 * MS_NS, &err), KVR_ETIMEDOUT);
    assert_string_equal(err.msg, "timed out");
    assert_true(kvr_now_ns() >= t0 + 30 * MS_NS);
    assert_int_equal(kvr_sock_wait(fd, POLLIN, KVR_SOCK_NOW, &err), KVR_ETIMEDOUT);
    /* Data comes: ready at once, and a wait for writing is ready too. */
    assert_int_equal(write(peer, "x", 1), 1);
    assert_int_equal(kvr_sock_wait(fd, POLLIN, 0, &err), KVR_OK);
    assert_int_equal(kvr_sock_wait(fd, POLLOUT, KVR_SOCK_NOW, &err), KVR_OK);
    close(peer);
    close(fd);
    close(lfd);
    freeaddrinfo(ai);
}

static void test_connect_refused(void **state)
{
    (void)state;
    struct addrinfo *ai = loopback(closed_port());
    struct kvr_err err = {0};
    int fd = -1;
    assert_int_equal(kvr_sock_connect(ai, kvr_sock_deadline(2000), &fd, &err), KVR_ECLOSED);
    assert_int_equal(fd, -1);
    assert_string_equal(err.msg, strerror(ECONNREFUSED));

    /* The same in steps, as a caller with its own wait does it. */
    assert_int_equal(kvr_sock_open(ai, &fd, &err), KVR_OK);
    assert_true(fcntl(fd, F_GETFL) & O_NONBLOCK);
    int rc = kvr_sock_connect_begin(fd, ai, &err);
    if (rc == KVR_EAGAIN) {
        assert_int_equal(kvr_sock_wait(fd, POLLOUT, kvr_sock_deadline(2000), &err), KVR_OK);
        rc = kvr_sock_connect_result(fd, &err);
    }
    assert_int_equal(rc, KVR_ECLOSED);
    assert_string_equal(err.msg, strerror(ECONNREFUSED));
    close(fd);
    freeaddrinfo(ai);
}

static void test_blocking_and_nodelay(void **state)
{
    (void)state;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct kvr_err err = {0};
    assert_int_equal(kvr_sock_set_blocking(fd, false, &err), KVR_OK);
    assert_true(fcntl(fd, F_GETFL) & O_NONBLOCK);
    assert_int_equal(kvr_sock_set_blocking(fd, true, &err), KVR_OK);
    assert_int_equal(fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
    assert_int_equal(kvr_sock_set_nodelay(fd, &err), KVR_OK);
    close(fd);
    /* A closed descriptor: each says which call failed. */
    assert_int_equal(kvr_sock_set_blocking(fd, true, &err), KVR_EIO);
    assert_memory_equal(err.msg, "fcntl: ", 7);
    assert_int_equal(kvr_sock_set_nodelay(fd, &err), KVR_EIO);
    assert_memory_equal(err.msg, "TCP_NODELAY: ", 13);
    assert_int_equal(kvr_sock_set_nodelay(fd, NULL), KVR_EIO);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deadline),
        cmocka_unit_test(test_connect_to_listener),
        cmocka_unit_test(test_connect_refused),
        cmocka_unit_test(test_blocking_and_nodelay),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
