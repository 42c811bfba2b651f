/* bench_svg.h - the plot of a `kvasir bench --sweep` run (bench_svg.c): latency percentiles
 * and goodput against the offered rate, drawn with client/svg.h and written to a file. */
#ifndef KVR_CLI_BENCH_SVG_H
#define KVR_CLI_BENCH_SVG_H

#include "client/loadgen.h"

#include <stddef.h>
#include <stdint.h>

/* One rate of the sweep: what was offered, how long it ran, what it measured. */
struct kvr_bench_point {
    double rate;   /* offered requests/s */
    double wall_s; /* first send to last response */
    const struct kvr_lg_result *res;
};

/* Write the two-panel plot of n >= 1 points to path: TTFT and E2E p50/p99 (a log axis when
 * they span more than 50x) with the budgets as flat lines (a budget of 0 is not drawn), and
 * goodput, throughput, refusals/s and the offered rate. `title` is the heading (further
 * '\n'-separated lines are subtitles). 0, or -1 (a file that cannot be written is named on
 * stderr). */
int kvr_bench_svg_write(const char *path, const char *title, uint32_t ttft_budget_ms,
                        uint32_t total_budget_ms, const struct kvr_bench_point *pts, size_t n);

#endif
