/* service_ring.h - the HTTP layer's service (service.h) backed by the bridge core: the
 * bridge's requests, refusals, events and streams are the service's (request.h, bridge.h);
 * this adds the server's default budgets, /health's stage list and the scheduler's metrics.
 *
 * Ownership: the struct borrows the bridge and the plan; both must outlive it. Thread-safe
 * as the bridge is. */
#ifndef KVR_BRIDGE_SERVICE_RING_H
#define KVR_BRIDGE_SERVICE_RING_H

#include "bridge/bridge.h"
#include "bridge/service.h"

struct kvr_ring_service {
    struct kvr_bridge *bridge;
    const struct kvr_plan *plan;
    uint32_t default_first_token_ms; /* server defaults for requests that give no budget; */
    uint32_t default_total_ms;       /* 0 = none */
};

extern const struct kvr_service_ops kvr_ring_service_ops;

#endif
