/* clock.h - monotonic time in nanoseconds, wall time, condition-wait deadlines, sleeping. */
#ifndef KVR_CORE_CLOCK_H
#define KVR_CORE_CLOCK_H

#include <stdint.h>
#include <time.h>

uint64_t kvr_now_ns(void);        /* CLOCK_MONOTONIC */
uint64_t kvr_wall_ms(void);       /* CLOCK_REALTIME, ms since the epoch */
uint64_t kvr_thread_cpu_ns(void); /* CLOCK_THREAD_CPUTIME_ID: CPU the calling thread used */
void kvr_sleep_ns(uint64_t ns);
/* The CLOCK_REALTIME instant ms milliseconds from now: the deadline that
 * pthread_cond_timedwait takes. */
struct timespec kvr_deadline_after_ms(uint32_t ms);

#endif
