/* net.c - socket helpers and framed, authenticated links (see net.h). */
#define _GNU_SOURCE /* accept4, SOCK_CLOEXEC */
#include "ring/net.h"

#include "ring/addr.h"

#include "core/alloc.h"
#include "core/clock.h"
#include "core/log.h"
#include "core/sock.h"

#include <sodium.h>

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_WRITEV_IOV 16

/* ---- Deadlines ------------------------------------------------------------------------- */

uint64_t kvr_net_deadline(int timeout_ms)
{
    return kvr_sock_deadline(timeout_ms);
}

/* ---- Sockets --------------------------------------------------------------------------- */

int kvr_net_set_nodelay(int fd, struct kvr_err *err)
{
    return kvr_sock_set_nodelay(fd, err);
}

static int resolve(const char *addr, bool passive, struct addrinfo **res, struct kvr_err *err)
{
    char host[KVR_ADDR_HOST_BYTES], port_s[8];
    uint16_t port;
    struct kvr_err e = {0};
    if (kvr_addr_parse(addr, host, sizeof host, &port, passive, &e))
        return kvr_err_set(err, KVR_EINVAL, "address \"%s\": %s", addr, e.msg);
    snprintf(port_s, sizeof port_s, "%u", port);
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = passive ? AI_PASSIVE : 0};
    int g = getaddrinfo(host, port_s, &hints, res);
    if (g != 0)
        return kvr_err_set(err, KVR_EIO, "cannot resolve %s: %s", addr, gai_strerror(g));
    return KVR_OK;
}

int kvr_net_listen(const char *addr, int backlog, int *out_fd, uint16_t *bound_port,
                   struct kvr_err *err)
{
    struct addrinfo *res = NULL;
    int rc = resolve(addr, true, &res, err);
    if (rc)
        return rc;
    int fd = -1, saved = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            saved = errno;
            continue;
        }
        int one = 1;
        /* SO_REUSEADDR: a restarted stage can listen again at once on its plan address,
         * although connections of its previous life are still in TIME_WAIT. */
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
            bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, backlog) == 0)
            break;
        saved = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return kvr_err_set(err, KVR_EIO, "cannot listen on %s: %s", addr, strerror(saved));
    if (bound_port) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) {
            saved = errno;
            close(fd);
            return kvr_err_set(err, KVR_EIO, "getsockname: %s", strerror(saved));
        }
        *bound_port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                               : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    }
    *out_fd = fd;
    return KVR_OK;
}

static void describe_sockaddr(const struct sockaddr *sa, socklen_t len, char *out, size_t cap)
{
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (getnameinfo(sa, len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
        snprintf(out, cap, "unknown peer");
    else if (sa->sa_family == AF_INET6)
        snprintf(out, cap, "[%s]:%s", host, serv);
    else
        snprintf(out, cap, "%s:%s", host, serv);
}

int kvr_net_accept(int listen_fd, uint64_t deadline_ns, int *out_fd, char *peer, size_t peer_cap,
                   struct kvr_err *err)
{
    for (;;) {
        int rc = kvr_sock_wait(listen_fd, POLLIN, deadline_ns, err);
        if (rc)
            return rc == KVR_ETIMEDOUT
                       ? kvr_err_set(err, rc, "accept: no connection before the deadline")
                       : rc;
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int fd = accept4(listen_fd, (struct sockaddr *)&ss, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            /* The connection may have gone away between poll and accept. */
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED)
                continue;
            return kvr_err_set(err, KVR_EIO, "accept: %s", strerror(errno));
        }
        /* Back to blocking: every helper here waits with poll and MSG_DONTWAIT anyway, and
         * callers that use the fd directly expect ordinary semantics. */
        if ((rc = kvr_sock_set_blocking(fd, true, err)) || (rc = kvr_sock_set_nodelay(fd, err))) {
            close(fd);
            return rc;
        }
        if (peer)
            describe_sockaddr((struct sockaddr *)&ss, len, peer, peer_cap);
        *out_fd = fd;
        return KVR_OK;
    }
}

int kvr_net_connect(const char *addr, uint64_t deadline_ns, int *out_fd, struct kvr_err *err)
{
    struct addrinfo *res = NULL;
    int rc = resolve(addr, false, &res, err);
    if (rc)
        return rc;
    struct kvr_err e = {0};
    rc = KVR_EIO;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next)
        if ((rc = kvr_sock_connect(ai, deadline_ns, out_fd, &e)) == KVR_OK || rc == KVR_ETIMEDOUT)
            break;
    freeaddrinfo(res);
    if (rc)
        return kvr_err_set(err, rc, "connect to %s: %s", addr, e.msg[0] ? e.msg : "failed");
    return KVR_OK;
}

/* Read into buf[*have .. n) until full, the deadline, EOF or an error. Keeps *have exact
 * so a caller can resume after KVR_ETIMEDOUT. EOF returns KVR_ECLOSED whatever *have is;
 * the caller decides whether that was between messages or inside one. */
static int read_some(int fd, uint8_t *buf, size_t n, size_t *have, uint64_t deadline_ns,
                     struct kvr_err *err)
{
    while (*have < n) {
        ssize_t r = recv(fd, buf + *have, n - *have, MSG_DONTWAIT);
        if (r > 0) {
            *have += (size_t)r;
            continue;
        }
        if (r == 0)
            return kvr_err_set(err, KVR_ECLOSED, "the peer closed the connection");
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = kvr_sock_wait(fd, POLLIN, deadline_ns, err);
            if (rc)
                return rc;
            continue;
        }
        if (errno == ECONNRESET)
            return kvr_err_set(err, KVR_ECLOSED, "the peer reset the connection");
        return kvr_err_set(err, KVR_EIO, "recv: %s", strerror(errno));
    }
    return KVR_OK;
}

int kvr_net_read_full(int fd, void *buf, size_t n, uint64_t deadline_ns, size_t *got,
                      struct kvr_err *err)
{
    size_t have = 0;
    int rc = read_some(fd, buf, n, &have, deadline_ns, err);
    if (got)
        *got = have;
    if (rc == KVR_ECLOSED && have > 0)
        rc = kvr_err_set(err, KVR_EPROTO,
                         "the peer closed the connection after %zu of %zu "
                         "bytes",
                         have, n);
    return rc;
}

int kvr_net_writev_full(int fd, const struct iovec *iov_in, int n_iov, uint64_t deadline_ns,
                        struct kvr_err *err)
{
    if (n_iov < 0 || n_iov > MAX_WRITEV_IOV)
        return kvr_err_set(err, KVR_EINVAL, "writev: %d iovecs (at most %d)", n_iov,
                           MAX_WRITEV_IOV);
    struct iovec iov[MAX_WRITEV_IOV];
    int first = 0;
    for (int i = 0; i < n_iov; i++)
        iov[i] = iov_in[i];
    for (;;) {
        while (first < n_iov && iov[first].iov_len == 0)
            first++;
        if (first == n_iov)
            return KVR_OK;
        struct msghdr mh = {.msg_iov = iov + first, .msg_iovlen = (size_t)(n_iov - first)};
        /* sendmsg, not writev: MSG_NOSIGNAL turns a dead peer into EPIPE instead of a
         * process-killing SIGPIPE, and MSG_DONTWAIT lets poll enforce the deadline. */
        ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                int rc = kvr_sock_wait(fd, POLLOUT, deadline_ns, err);
                if (rc)
                    return rc;
                continue;
            }
            if (errno == EPIPE || errno == ECONNRESET)
                return kvr_err_set(err, KVR_ECLOSED, "the peer closed the connection");
            return kvr_err_set(err, KVR_EIO, "sendmsg: %s", strerror(errno));
        }
        size_t left = (size_t)w;
        while (left > 0) {
            size_t take = left < iov[first].iov_len ? left : iov[first].iov_len;
            iov[first].iov_base = (uint8_t *)iov[first].iov_base + take;
            iov[first].iov_len -= take;
            left -= take;
            if (iov[first].iov_len == 0)
                first++;
        }
    }
}

/* ---- Links ----------------------------------------------------------------------------- */

/* A frame body buffer: rounded up to whole cache lines, with room for a seal's tag; at
 * least one line so the pointer is never NULL. */
static size_t body_bytes_for(const struct kvr_wire_limits *limits)
{
    size_t body = limits->max_frame_bytes > KVR_WIRE_HEADER_BYTES
                      ? limits->max_frame_bytes - KVR_WIRE_HEADER_BYTES
                      : 0;
    return (body + 63) / 64 * 64 + 64;
}

int kvr_link_init(struct kvr_link *link, int fd, const char *peer,
                  const struct kvr_wire_limits *limits, uint32_t dirs, struct kvr_err *err)
{
    memset(link, 0, sizeof *link);
    link->fd = fd;
    link->owns_fd = true;
    link->limits = *limits;
    snprintf(link->peer, sizeof link->peer, "%s", peer ? peer : "peer");
    int rc = KVR_OK;
    if (dirs & KVR_LINK_RECV) {
        link->body_cap = body_bytes_for(limits);
        link->body = kvr_aligned_alloc(64, link->body_cap);
        if (!link->body) {
            rc = kvr_err_set(err, KVR_ENOMEM, "link %s: no memory for a %zu-byte frame buffer",
                             link->peer, link->body_cap);
            goto fail;
        }
        if ((rc = kvr_wire_frame_init(&link->frame, limits, err)))
            goto fail;
    }
    if (dirs & KVR_LINK_SEND) {
        link->scratch_cap = kvr_wire_scratch_bytes(limits);
        link->scratch = kvr_aligned_alloc(64, (link->scratch_cap + 63) / 64 * 64);
        if (!link->scratch) {
            rc = kvr_err_set(err, KVR_ENOMEM, "link %s: no memory for the send buffer", link->peer);
            goto fail;
        }
    }
    return KVR_OK;
fail:
    kvr_link_fini(link);
    return rc;
}

void kvr_link_fini(struct kvr_link *link)
{
    if (link->owns_fd && link->fd >= 0)
        close(link->fd);
    kvr_wire_frame_fini(&link->frame);
    kvr_free(link->body);
    kvr_free(link->scratch);
    kvr_free(link->sealed_out);
    kvr_seal_wipe(&link->seal_tx);
    kvr_seal_wipe(&link->seal_rx);
    memset(link, 0, sizeof *link);
    link->fd = -1;
}

/* Mark the link broken, log why, and shut the socket down (not close: another thread may
 * be blocked on it; kvr_link_fini closes). `why` holds the message, which is also copied
 * into the caller's optional `err`. Returns rc. */
static int break_link(struct kvr_link *link, int rc, const struct kvr_err *why, struct kvr_err *err)
{
    if (!link->broken)
        KVR_WARN("%s; closing the link", why->msg);
    link->broken = true;
    if (link->fd >= 0)
        shutdown(link->fd, SHUT_RDWR);
    if (err && err != why)
        *err = *why;
    return rc;
}

static int closed_error(const struct kvr_link *link, struct kvr_err *err)
{
    return kvr_err_set(err, KVR_ECLOSED, "link %s is closed", link->peer);
}

/* Receive a frame whose body goes into body/body_cap and decodes into *frame; a NULL
 * body means "no slot": only a frame without a body can be taken (see net.h). */
static int recv_frame(struct kvr_link *link, uint8_t *body, size_t body_cap,
                      struct kvr_wire_frame *frame, uint64_t deadline_ns,
                      const struct kvr_wire_frame **out, struct kvr_err *err)
{
    struct kvr_err e = {0}, why = {0};
    int rc;
    if (link->broken)
        return closed_error(link, err);
    size_t hdr_bytes = link->sealed ? KVR_SEAL_SEALED_HEADER_BYTES : KVR_WIRE_HEADER_BYTES;
    size_t tag_bytes = link->sealed ? KVR_SEAL_TAG_BYTES : 0;
    if (!link->hdr_ok) {
        rc = read_some(link->fd, link->hdr_buf, hdr_bytes, &link->hdr_have, deadline_ns, &e);
        if (rc == KVR_ETIMEDOUT)
            return kvr_err_set(err, rc, "link %s: no frame before the deadline", link->peer);
        if (rc == KVR_ECLOSED && link->hdr_have == 0) {
            /* Between frames: an orderly close (or a crash; the caller cannot tell). */
            link->broken = true;
            KVR_INFO("link %s: the peer closed the connection", link->peer);
            return kvr_err_set(err, KVR_ECLOSED, "link %s: the peer closed the connection",
                               link->peer);
        }
        if (rc == KVR_ECLOSED) {
            kvr_err_set(&e, KVR_EPROTO,
                        "the peer closed the connection inside a frame header "
                        "(%zu of %zu bytes)",
                        link->hdr_have, hdr_bytes);
            rc = KVR_EPROTO;
        }
        if (rc == KVR_OK && link->sealed && kvr_seal_open_header(&link->seal_rx, link->hdr_buf, &e))
            rc = KVR_EPROTO;
        if (rc == KVR_OK &&
            (rc = kvr_wire_decode_header(link->hdr_buf, &link->limits, &link->hdr, &e)))
            rc = KVR_EPROTO;
        if (rc) {
            kvr_err_set(&why, rc, "link %s: %s", link->peer, e.msg);
            return break_link(link, rc, &why, err);
        }
        link->hdr_ok = true;
        link->body_have = 0;
    }
    size_t body_in = link->hdr.body_bytes ? link->hdr.body_bytes + tag_bytes : 0;
    if (!body) {
        if (body_in > 0)
            return kvr_err_set(err, KVR_EAGAIN, "link %s: a %s frame waits for room", link->peer,
                               kvr_wire_type_name(link->hdr.type));
        body = link->body;
        body_cap = link->body_cap;
        frame = &link->frame;
    }
    if (body_in > body_cap) { /* cannot happen: the limits sized both */
        kvr_err_set(&why, KVR_EPROTO, "link %s: frame body of %u bytes does not fit", link->peer,
                    link->hdr.body_bytes);
        return break_link(link, KVR_EPROTO, &why, err);
    }
    rc = read_some(link->fd, body, body_in, &link->body_have, deadline_ns, &e);
    if (rc == KVR_ETIMEDOUT)
        return kvr_err_set(err, rc,
                           "link %s: frame body incomplete at the deadline (%zu of %zu "
                           "bytes)",
                           link->peer, link->body_have, body_in);
    if (rc == KVR_ECLOSED) {
        kvr_err_set(&why, KVR_EPROTO,
                    "link %s: the peer closed the connection inside a %s "
                    "frame (%zu of %zu body bytes)",
                    link->peer, kvr_wire_type_name(link->hdr.type), link->body_have, body_in);
        return break_link(link, KVR_EPROTO, &why, err);
    }
    if (rc == KVR_OK && link->sealed && body_in &&
        kvr_seal_open_body(&link->seal_rx, body, link->hdr.body_bytes, &e))
        rc = KVR_EPROTO;
    if (rc == KVR_OK && (rc = kvr_wire_decode_body(frame, &link->hdr, body, link->hdr.body_bytes,
                                                   &link->limits, &e)))
        rc = KVR_EPROTO;
    if (rc) {
        kvr_err_set(&why, rc, "link %s: %s", link->peer, e.msg);
        return break_link(link, rc, &why, err);
    }
    link->hdr_ok = false;
    link->hdr_have = 0;
    link->frames_in++;
    link->bytes_in += hdr_bytes + (uint64_t)body_in;
    *out = frame;
    return KVR_OK;
}

int kvr_link_recv(struct kvr_link *link, uint64_t deadline_ns, const struct kvr_wire_frame **out,
                  struct kvr_err *err)
{
    if (!link->body && !link->broken)
        return kvr_err_set(err, KVR_EINVAL, "link %s was not opened for receiving", link->peer);
    return recv_frame(link, link->body, link->body_cap, &link->frame, deadline_ns, out, err);
}

int kvr_link_recv_into(struct kvr_link *link, struct kvr_link_rx *rx, uint64_t deadline_ns,
                       const struct kvr_wire_frame **out, struct kvr_err *err)
{
    if (!link->body && !link->broken)
        return kvr_err_set(err, KVR_EINVAL, "link %s was not opened for receiving", link->peer);
    return recv_frame(link, rx ? rx->body : NULL, rx ? rx->body_cap : 0, rx ? &rx->frame : NULL,
                      deadline_ns, out, err);
}

int kvr_link_rx_init(struct kvr_link_rx *rx, const struct kvr_wire_limits *limits,
                     struct kvr_err *err)
{
    memset(rx, 0, sizeof *rx);
    rx->body_cap = body_bytes_for(limits);
    rx->body = kvr_aligned_alloc(64, rx->body_cap);
    if (!rx->body)
        return kvr_err_set(err, KVR_ENOMEM, "no memory for a %zu-byte frame buffer", rx->body_cap);
    int rc = kvr_wire_frame_init(&rx->frame, limits, err);
    if (rc)
        kvr_link_rx_fini(rx);
    return rc;
}

void kvr_link_rx_fini(struct kvr_link_rx *rx)
{
    kvr_wire_frame_fini(&rx->frame);
    kvr_free(rx->body);
    memset(rx, 0, sizeof *rx);
}

/* Write what the socket takes now of the pending frame. */
static int send_some(struct kvr_link *link, struct kvr_err *err)
{
    while (link->tx_first < link->tx_n_iov) {
        struct iovec *iov = link->tx_iov;
        if (iov[link->tx_first].iov_len == 0) {
            link->tx_first++;
            continue;
        }
        struct msghdr mh = {.msg_iov = iov + link->tx_first,
                            .msg_iovlen = (size_t)(link->tx_n_iov - link->tx_first)};
        ssize_t w = sendmsg(link->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return KVR_EAGAIN;
            struct kvr_err why = {0};
            int rc = errno == EPIPE || errno == ECONNRESET ? KVR_ECLOSED : KVR_EIO;
            kvr_err_set(&why, rc, "link %s: sending a %s frame: %s", link->peer,
                        kvr_wire_type_name(link->tx_type),
                        rc == KVR_ECLOSED ? "the peer closed the connection" : strerror(errno));
            link->tx_pending = false;
            return break_link(link, rc, &why, err);
        }
        size_t left = (size_t)w;
        while (left > 0) {
            struct iovec *v = &iov[link->tx_first];
            size_t take = left < v->iov_len ? left : v->iov_len;
            v->iov_base = (uint8_t *)v->iov_base + take;
            v->iov_len -= take;
            left -= take;
            if (v->iov_len == 0)
                link->tx_first++;
        }
    }
    link->tx_pending = false;
    link->frames_out++;
    link->bytes_out += link->tx_total;
    return KVR_OK;
}

int kvr_link_send_begin(struct kvr_link *link, const struct kvr_wire_msg *msg, struct kvr_err *err)
{
    if (link->broken)
        return closed_error(link, err);
    if (!link->scratch)
        return kvr_err_set(err, KVR_EINVAL, "link %s was not opened for sending", link->peer);
    if (link->tx_pending)
        return kvr_err_set(err, KVR_EFULL, "link %s: a frame is still being sent", link->peer);
    int rc = kvr_wire_encode(msg, link->scratch, link->scratch_cap, link->tx_iov, &link->tx_n_iov,
                             &link->tx_total, err);
    if (rc == KVR_OK && link->sealed &&
        (rc = kvr_seal_frame(&link->seal_tx, link->tx_iov, link->tx_n_iov, link->tx_total,
                             link->sealed_out, link->sealed_cap, &link->tx_total, err)) == KVR_OK) {
        link->tx_iov[0] = (struct iovec){link->sealed_out, link->tx_total};
        link->tx_n_iov = 1;
    }
    if (rc)
        return rc; /* nothing was sent: the link is still in step */
    link->tx_first = 0;
    link->tx_type = msg->type;
    link->tx_pending = true;
    return send_some(link, err);
}

int kvr_link_send_resume(struct kvr_link *link, struct kvr_err *err)
{
    if (link->broken)
        return closed_error(link, err);
    if (!link->tx_pending)
        return KVR_OK;
    return send_some(link, err);
}

int kvr_link_send(struct kvr_link *link, const struct kvr_wire_msg *msg, uint64_t deadline_ns,
                  struct kvr_err *err)
{
    if (link->broken)
        return closed_error(link, err);
    if (!link->scratch)
        return kvr_err_set(err, KVR_EINVAL, "link %s was not opened for sending", link->peer);
    if (link->tx_pending)
        return kvr_err_set(err, KVR_EFULL, "link %s: a frame is still being sent", link->peer);
    struct iovec iov[KVR_WIRE_MAX_IOV];
    int n_iov = 0;
    size_t total = 0;
    int rc = kvr_wire_encode(msg, link->scratch, link->scratch_cap, iov, &n_iov, &total, err);
    if (rc == KVR_OK && link->sealed &&
        (rc = kvr_seal_frame(&link->seal_tx, iov, n_iov, total, link->sealed_out, link->sealed_cap,
                             &total, err)) == KVR_OK)
        iov[0] = (struct iovec){link->sealed_out, total}, n_iov = 1;
    if (rc)
        return rc; /* nothing was sent: the link is still in step */
    struct kvr_err e = {0}, why = {0};
    if ((rc = kvr_net_writev_full(link->fd, iov, n_iov, deadline_ns, &e))) {
        kvr_err_set(&why, rc, "link %s: sending a %s frame: %s", link->peer,
                    kvr_wire_type_name(msg->type), e.msg);
        return break_link(link, rc, &why, err);
    }
    link->frames_out++;
    link->bytes_out += total;
    return KVR_OK;
}

int kvr_link_send_heartbeat(struct kvr_link *link, uint64_t seq, uint64_t deadline_ns,
                            struct kvr_err *err)
{
    struct kvr_wire_msg m = {.type = KVR_WIRE_HEARTBEAT, .batch_id = seq};
    return kvr_link_send(link, &m, deadline_ns, err);
}

int kvr_link_send_goodbye(struct kvr_link *link, enum kvr_wire_goodbye reason, uint64_t deadline_ns,
                          struct kvr_err *err)
{
    struct kvr_wire_msg m = {.type = KVR_WIRE_GOODBYE, .arg = (uint32_t)reason};
    return kvr_link_send(link, &m, deadline_ns, err);
}

/* ---- Handshake ------------------------------------------------------------------------- */

/* After a successful handshake: the session keys, and the sealed-frame buffer of a sending
 * link. The client's frames go to the server, so its tx key is the server's rx key. */
static int start_sealing(struct kvr_link *link, const struct kvr_auth *a, struct kvr_err *err)
{
    uint8_t to_server[KVR_AUTH_KEY_BYTES], to_client[KVR_AUTH_KEY_BYTES];
    int rc = kvr_auth_session_keys(a, to_server, to_client, err);
    if (rc)
        return rc;
    kvr_seal_init(&link->seal_tx, a->is_client ? to_server : to_client);
    kvr_seal_init(&link->seal_rx, a->is_client ? to_client : to_server);
    sodium_memzero(to_server, sizeof to_server);
    sodium_memzero(to_client, sizeof to_client);
    if (link->scratch && !link->sealed_out) {
        link->sealed_cap = kvr_seal_frame_bytes(link->limits.max_frame_bytes);
        link->sealed_out = kvr_aligned_alloc(64, (link->sealed_cap + 63) / 64 * 64);
        if (!link->sealed_out)
            return kvr_err_set(err, KVR_ENOMEM, "no memory for a %zu-byte sealed frame buffer",
                               link->sealed_cap);
    }
    link->sealed = true;
    return KVR_OK;
}

void kvr_link_hs_abort(struct kvr_link_hs *hs)
{
    if (hs->active)
        kvr_auth_wipe(&hs->a);
    hs->active = false;
}

static int hs_fail(struct kvr_link *link, struct kvr_link_hs *hs, int rc, const struct kvr_err *e,
                   struct kvr_err *err)
{
    struct kvr_err why = {0};
    kvr_link_hs_abort(hs);
    kvr_err_set(&why, rc, "link %s: handshake: %s", link->peer, e->msg);
    return break_link(link, rc, &why, err);
}

/* The bridge on a control link to a stage (re-planning, docs/PROTOCOL.md 6a). */
static const struct kvr_auth_id control_id = {KVR_AUTH_ROLE_BRIDGE, KVR_AUTH_INDEX_CONTROL};

int kvr_link_hs_begin_ids(struct kvr_link *link, struct kvr_link_hs *hs,
                          const struct kvr_plan *plan, struct kvr_auth_id self,
                          struct kvr_auth_id peer, bool is_client, struct kvr_err *err)
{
    memset(hs, 0, sizeof *hs);
    if (link->broken)
        return closed_error(link, err);
    int rc = kvr_auth_init(&hs->a, plan, is_client, self, peer, err);
    if (rc)
        return rc;
    kvr_auth_id_str(peer, hs->want, sizeof hs->want);
    hs->encrypt = plan->encrypt;
    hs->active = true;
    if (is_client) {
        struct kvr_err e = {0};
        if ((rc = kvr_auth_hello(&hs->a, hs->out, &e)))
            return hs_fail(link, hs, rc, &e, err);
        hs->n_out = sizeof hs->out;
    }
    return KVR_OK;
}

int kvr_link_hs_begin(struct kvr_link *link, struct kvr_link_hs *hs, const struct kvr_plan *plan,
                      enum kvr_auth_role role, uint32_t index, bool is_client, struct kvr_err *err)
{
    memset(hs, 0, sizeof *hs);
    struct kvr_auth_id self, peer;
    int rc = kvr_auth_topology(plan, role, index, is_client, &self, &peer, err);
    if (rc)
        return rc;
    return kvr_link_hs_begin_ids(link, hs, plan, self, peer, is_client, err);
}

int kvr_link_hs_begin_accept(struct kvr_link *link, struct kvr_link_hs *hs,
                             const struct kvr_plan *plan, uint32_t index, struct kvr_err *err)
{
    int rc = kvr_link_hs_begin(link, hs, plan, KVR_AUTH_ROLE_STAGE, index, false, err);
    if (rc == 0) {
        hs->a.alt_peer = control_id;
        hs->a.has_alt = true;
    }
    return rc;
}

/* Write what is left of the reply without waiting: KVR_OK once it is all out. */
static int hs_write(struct kvr_link *link, struct kvr_link_hs *hs, struct kvr_err *err)
{
    while (hs->out_sent < hs->n_out) {
        ssize_t w = send(link->fd, hs->out + hs->out_sent, hs->n_out - hs->out_sent,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            hs->out_sent += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return KVR_EAGAIN;
        if (w < 0 && errno != EPIPE && errno != ECONNRESET)
            return kvr_err_set(err, KVR_EIO, "sendmsg: %s", strerror(errno));
        return kvr_err_set(err, KVR_ECLOSED, "the peer closed the connection");
    }
    hs->n_out = hs->out_sent = 0;
    hs->progress++;
    return KVR_OK;
}

int kvr_link_hs_step(struct kvr_link *link, struct kvr_link_hs *hs, struct kvr_err *err)
{
    if (!hs->active)
        return kvr_err_set(err, KVR_EINVAL, "link %s: no handshake under way", link->peer);
    struct kvr_err e = {0};
    int rc;
    for (;;) {
        hs->want_write = false;
        if (hs->n_out > 0) {
            rc = hs_write(link, hs, &e);
            if (hs->verdict) /* a rejecting VERDICT is a courtesy: it is tried once */
                return hs_fail(link, hs, hs->verdict, &hs->verdict_err, err);
            if (rc == KVR_EAGAIN) {
                hs->want_write = true;
                return KVR_EAGAIN;
            }
            if (rc)
                return hs_fail(link, hs, rc, &e, err);
        }
        if (hs->a.done)
            break;
        rc = read_some(link->fd, hs->in, sizeof hs->in, &hs->n_in, KVR_NET_NOW, &e);
        if (rc == KVR_ETIMEDOUT)
            return KVR_EAGAIN;
        if (rc == KVR_ECLOSED && hs->n_in > 0)
            rc =
                kvr_err_set(&e, KVR_EPROTO, "the peer closed the connection after %zu of %zu bytes",
                            hs->n_in, sizeof hs->in);
        if (rc)
            return hs_fail(link, hs, rc, &e, err);
        hs->n_in = 0;
        hs->progress++;
        bool send = false;
        rc = kvr_auth_recv(&hs->a, hs->in, hs->out, &send, &e);
        if (send) {
            hs->n_out = sizeof hs->out;
            if (rc) {
                hs->verdict = rc;
                hs->verdict_err = e;
            }
            continue;
        }
        if (rc)
            return hs_fail(link, hs, rc, &e, err);
    }
    if (hs->encrypt && (rc = start_sealing(link, &hs->a, &e)))
        return hs_fail(link, hs, rc, &e, err);
    link->peer_id = hs->a.peer; /* an ANY index is now the one the peer proved */
    hs->control = hs->a.peer_is_alt;
    kvr_auth_id_str(hs->a.peer, hs->want, sizeof hs->want);
    kvr_link_hs_abort(hs);
    link->authenticated = true;
    char addr[KVR_NET_PEER_BYTES];
    snprintf(addr, sizeof addr, "%s", link->peer);
    snprintf(link->peer, sizeof link->peer, "%s (%.200s)", hs->want, addr);
    KVR_INFO("link %s: handshake done", link->peer);
    return KVR_OK;
}

/* The steps of a begun handshake, waiting at most timeout_ms for each message. */
static int hs_wait(struct kvr_link *link, struct kvr_link_hs *hs, int timeout_ms,
                   struct kvr_err *err)
{
    int rc;
    uint32_t seen = hs->progress;
    uint64_t deadline = kvr_net_deadline(timeout_ms);
    while ((rc = kvr_link_hs_step(link, hs, err)) == KVR_EAGAIN) {
        if (hs->progress != seen) {
            seen = hs->progress;
            deadline = kvr_net_deadline(timeout_ms);
        }
        struct kvr_err e = {0};
        if ((rc = kvr_sock_wait(link->fd, hs->want_write ? POLLOUT : POLLIN, deadline, &e))) {
            if (rc == KVR_ETIMEDOUT)
                kvr_err_set(&e, rc, "no handshake message from the peer within %d ms", timeout_ms);
            return hs_fail(link, hs, rc, &e, err);
        }
    }
    return rc;
}

/* The blocking handshake: the steps above, waiting at most timeout_ms for each message. */
static int handshake(struct kvr_link *link, const struct kvr_plan *plan, enum kvr_auth_role role,
                     uint32_t index, bool is_client, int timeout_ms, struct kvr_err *err)
{
    struct kvr_link_hs hs;
    int rc = kvr_link_hs_begin(link, &hs, plan, role, index, is_client, err);
    return rc ? rc : hs_wait(link, &hs, timeout_ms, err);
}

int kvr_link_handshake_control(struct kvr_link *link, const struct kvr_plan *plan, uint32_t index,
                               int timeout_ms, struct kvr_err *err)
{
    if (index >= plan->n_stages + plan->n_spares)
        return kvr_err_set(err, KVR_EINVAL, "control link: the plan has no stage %u", index);
    struct kvr_link_hs hs;
    struct kvr_auth_id peer = {KVR_AUTH_ROLE_STAGE, index};
    int rc = kvr_link_hs_begin_ids(link, &hs, plan, control_id, peer, true, err);
    return rc ? rc : hs_wait(link, &hs, timeout_ms, err);
}

int kvr_link_handshake_ids(struct kvr_link *link, const struct kvr_plan *plan,
                           struct kvr_auth_id self, struct kvr_auth_id peer, bool is_client,
                           int timeout_ms, struct kvr_err *err)
{
    struct kvr_link_hs hs;
    int rc = kvr_link_hs_begin_ids(link, &hs, plan, self, peer, is_client, err);
    return rc ? rc : hs_wait(link, &hs, timeout_ms, err);
}

int kvr_link_handshake_client(struct kvr_link *link, const struct kvr_plan *plan,
                              enum kvr_auth_role role, uint32_t index, int timeout_ms,
                              struct kvr_err *err)
{
    return handshake(link, plan, role, index, true, timeout_ms, err);
}

int kvr_link_handshake_server(struct kvr_link *link, const struct kvr_plan *plan,
                              enum kvr_auth_role role, uint32_t index, int timeout_ms,
                              struct kvr_err *err)
{
    return handshake(link, plan, role, index, false, timeout_ms, err);
}
