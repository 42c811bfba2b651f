/* credit.c - credit and ack bytes on a link's socket (see credit.h). */
#include "ring/credit.h"

#include "core/err.h"

#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>

int kvr_credit_grant(int fd, uint32_t n)
{
    uint8_t buf[64];
    memset(buf, KVR_CREDIT_BYTE, sizeof buf);
    while (n > 0) {
        size_t chunk = n < sizeof buf ? n : sizeof buf;
        ssize_t w = send(fd, buf, chunk, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return KVR_ECLOSED;
        n -= (uint32_t)w;
    }
    return KVR_OK;
}

int kvr_credit_ack(int fd)
{
    uint8_t b = KVR_CREDIT_ACK;
    for (;;) {
        ssize_t w = send(fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w == 1)
            return KVR_OK;
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return KVR_OK;
        return KVR_ECLOSED;
    }
}

int kvr_credit_read(int fd, uint32_t *credits, bool *heard)
{
    *heard = false;
    for (;;) {
        uint8_t buf[256];
        ssize_t got = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (got == 0)
            return KVR_ECLOSED;
        if (got < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK ? KVR_OK
                   : errno == EINTR                        ? KVR_OK
                                                           : KVR_ECLOSED;
        *heard = true;
        for (ssize_t i = 0; i < got; i++) {
            if (buf[i] == KVR_CREDIT_BYTE)
                (*credits)++;
            else if (buf[i] != KVR_CREDIT_ACK)
                return KVR_EPROTO;
        }
        if ((size_t)got < sizeof buf)
            return KVR_OK;
    }
}

int kvr_credit_take(int fd, uint32_t *credits, int timeout_ms)
{
    struct pollfd p = {fd, POLLIN, 0};
    int r = poll(&p, 1, *credits ? 0 : timeout_ms);
    if (r < 0)
        return errno == EINTR ? KVR_OK : KVR_EIO;
    if (r == 0)
        return KVR_OK;
    bool heard;
    return kvr_credit_read(fd, credits, &heard);
}
