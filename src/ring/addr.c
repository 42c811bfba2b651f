/* addr.c - "host:port" addresses (see addr.h). */
#include "ring/addr.h"

#include <ctype.h>
#include <string.h>
#include <strings.h>

int kvr_addr_parse(const char *addr, char *host, size_t host_cap, uint16_t *port, bool allow_port_0,
                   struct kvr_err *err)
{
    const char *colon, *h = addr;
    size_t hlen;
    if (addr[0] == '[') {
        const char *close = strchr(addr, ']');
        if (!close || close[1] != ':')
            return kvr_err_set(err, KVR_EINVAL, "an IPv6 address is written \"[addr]:port\"");
        h = addr + 1;
        hlen = (size_t)(close - h);
        colon = close + 1;
        for (size_t i = 0; i < hlen; i++)
            if (!isxdigit((unsigned char)h[i]) && h[i] != ':' && h[i] != '.')
                return kvr_err_set(err, KVR_EINVAL, "bad character '%c' in an IPv6 address", h[i]);
    } else {
        colon = strrchr(addr, ':');
        if (!colon)
            return kvr_err_set(err, KVR_EINVAL, "expected \"host:port\"");
        hlen = (size_t)(colon - addr);
        for (size_t i = 0; i < hlen; i++) {
            unsigned char c = (unsigned char)h[i];
            if (!isalnum(c) && c != '.' && c != '-' && c != '_')
                return kvr_err_set(err, KVR_EINVAL,
                                   "bad character '%c' in the host name (IPv6 needs [brackets])",
                                   c);
        }
    }
    if (hlen == 0)
        return kvr_err_set(err, KVR_EINVAL, "the host is empty");
    if (hlen > 253 || hlen >= host_cap)
        return kvr_err_set(err, KVR_EINVAL, "the host name is too long");
    const char *p = colon + 1;
    size_t plen = strlen(p);
    if (plen == 0 || plen > 5)
        return kvr_err_set(err, KVR_EINVAL, "the port must be a number from 1 to 65535");
    unsigned long v = 0;
    for (size_t i = 0; i < plen; i++) {
        if (!isdigit((unsigned char)p[i]))
            return kvr_err_set(err, KVR_EINVAL, "the port must be a number from 1 to 65535");
        v = v * 10 + (unsigned long)(p[i] - '0');
    }
    if (v > 65535 || (v == 0 && !allow_port_0))
        return kvr_err_set(err, KVR_EINVAL, "port %lu is not in 1..65535", v);
    memcpy(host, h, hlen);
    host[hlen] = 0;
    *port = (uint16_t)v;
    return KVR_OK;
}

bool kvr_addr_equal(const char *a, const char *b)
{
    char ha[KVR_ADDR_HOST_BYTES], hb[KVR_ADDR_HOST_BYTES];
    uint16_t pa, pb;
    if (kvr_addr_parse(a, ha, sizeof ha, &pa, true, NULL) ||
        kvr_addr_parse(b, hb, sizeof hb, &pb, true, NULL))
        return false;
    return pa == pb && strcasecmp(ha, hb) == 0;
}
