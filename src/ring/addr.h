/* addr.h - "host:port" addresses as plans and links write them: parsing and comparison.
 * Pure (no I/O, no name resolution); used by the plan's validation, the links' sockets and
 * the orchestrator files, so no module needs another one's network code for it. */
#ifndef KVR_RING_ADDR_H
#define KVR_RING_ADDR_H

#include "core/err.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVR_ADDR_HOST_BYTES 256

/* Split "host:port" into host and port. host is a DNS name or IPv4 literal ([A-Za-z0-9._-])
 * or an IPv6 literal in brackets ("[::1]:7001"; the brackets are removed). port is decimal
 * 1..65535, or 0 too when allow_port_0 (a listener that lets the kernel pick). Rejects
 * anything else with a message. */
int kvr_addr_parse(const char *addr, char *host, size_t host_cap, uint16_t *port, bool allow_port_0,
                   struct kvr_err *err);

/* Whether two addresses name the same host (case-insensitive) and port. Addresses that do
 * not parse are never equal. Names are not resolved ("localhost" != "127.0.0.1"). */
bool kvr_addr_equal(const char *a, const char *b);

#endif
