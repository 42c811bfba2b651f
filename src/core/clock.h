/* clock.h - monotonic time in nanoseconds, and sleeping. */
#ifndef KVR_CORE_CLOCK_H
#define KVR_CORE_CLOCK_H

#include <stdint.h>

uint64_t kvr_now_ns(void);       /* CLOCK_MONOTONIC */
uint64_t kvr_wall_ms(void);      /* CLOCK_REALTIME, ms since the epoch */
void kvr_sleep_ns(uint64_t ns);

#endif
