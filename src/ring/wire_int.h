/* wire_int.h - what wire.c shares with wire_ctrl.c, its control records' codec (not part of
 * the API: wire.h is). Pure functions, like the rest of the codec. */
#ifndef KVR_RING_WIRE_INT_H
#define KVR_RING_WIRE_INT_H

#include "core/err.h"
#include "ring/wire.h"

#include <stdint.h>

/* Read control record i (KVR_WIRE_CTRL_BYTES at p) into *c and check it against the limits:
 * KVR_EPROTO with the reason in err for anything out of range. */
int kvr_wire_ctrl_decode(const uint8_t *p, uint32_t i, const struct kvr_wire_limits *lim,
                         struct kvr_wire_ctrl *c, struct kvr_err *err);

/* Write *c as one control record at p; returns the byte after it. */
uint8_t *kvr_wire_ctrl_put(uint8_t *p, const struct kvr_wire_ctrl *c);

#endif
