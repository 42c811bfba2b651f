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

int kvr_credit_take(int fd, uint32_t *credits, int timeout_ms)
{
    struct pollfd p = {fd, POLLIN, 0};
    int r = poll(&p, 1, *credits ? 0 : timeout_ms);
    if (r < 0)
        return errno == EINTR ? KVR_OK : KVR_EIO;
    if (r == 0)
        return KVR_OK;
    uint8_t buf[256];
    ssize_t got = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (got == 0)
        return KVR_ECLOSED;
    if (got < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? KVR_OK
                                                                          : KVR_ECLOSED;
    for (ssize_t i = 0; i < got; i++)
        if (buf[i] != KVR_CREDIT_BYTE)
            return KVR_EPROTO;
    *credits += (uint32_t)got;
    return KVR_OK;
}
