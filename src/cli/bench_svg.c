/* bench_svg.c - the sweep plot of `kvasir bench` (see bench_svg.h). */
#include "cli/bench_svg.h"

#include "core/sbuf.h"
#include "client/svg.h"
#include "core/alloc.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>

int kvr_bench_svg_write(const char *path, const char *title, uint32_t ttft_budget_ms,
                        uint32_t total_budget_ms, const struct kvr_bench_point *pts, size_t n)
{
    double *v = kvr_calloc(n * 9 + 1, sizeof *v);
    if (!v)
        return -1;
    double *x = v, *t50 = v + n, *t99 = v + 2 * n, *e50 = v + 3 * n, *e99 = v + 4 * n,
           *good = v + 5 * n, *tput = v + 6 * n, *refused = v + 7 * n, *offered = v + 8 * n;
    double lo = INFINITY, hi = 0;
    for (size_t i = 0; i < n; i++) {
        const struct kvr_lg_result *r = pts[i].res;
        x[i] = pts[i].rate;
        t50[i] = r->ttft_s.p50 * 1e3;
        t99[i] = r->ttft_s.p99 * 1e3;
        e50[i] = r->e2e_s.p50 * 1e3;
        e99[i] = r->e2e_s.p99 * 1e3;
        good[i] = r->goodput_req_per_s;
        tput[i] = r->req_per_s;
        refused[i] = pts[i].wall_s > 0 ? (double)r->n_outcome[KVR_LG_REFUSED] / pts[i].wall_s : 0;
        offered[i] = pts[i].rate;
        double vals[] = {t50[i], t99[i], e50[i], e99[i]};
        for (size_t k = 0; k < 4; k++)
            if (isfinite(vals[k]) && vals[k] > 0) {
                lo = fmin(lo, vals[k]);
                hi = fmax(hi, vals[k]);
            }
    }
    /* The budgets as flat reference lines across the measured rates. */
    double bx[2] = {x[0], x[n - 1]}, bt[2] = {ttft_budget_ms, ttft_budget_ms},
           be[2] = {total_budget_ms, total_budget_ms};
    struct kvr_svg_series lat[6] = {
        {.name = "TTFT p50", .color = "#1f77b4", .x = x, .y = t50, .n = n},
        {.name = "TTFT p99", .color = "#1f77b4", .dashed = true, .x = x, .y = t99, .n = n},
        {.name = "E2E p50", .color = "#ff7f0e", .x = x, .y = e50, .n = n},
        {.name = "E2E p99", .color = "#ff7f0e", .dashed = true, .x = x, .y = e99, .n = n},
    };
    size_t n_lat = 4;
    if (ttft_budget_ms)
        lat[n_lat++] = (struct kvr_svg_series){
            .name = "TTFT budget", .color = "#9ecae1", .dashed = true, .x = bx, .y = bt, .n = 2};
    if (total_budget_ms)
        lat[n_lat++] = (struct kvr_svg_series){
            .name = "total budget", .color = "#fdae6b", .dashed = true, .x = bx, .y = be, .n = 2};
    if (ttft_budget_ms)
        lo = fmin(lo, ttft_budget_ms), hi = fmax(hi, ttft_budget_ms);
    if (total_budget_ms)
        lo = fmin(lo, total_budget_ms), hi = fmax(hi, total_budget_ms);
    struct kvr_svg_series thr[] = {
        {.name = "goodput", .color = "#2ca02c", .x = x, .y = good, .n = n},
        {.name = "throughput (ok)", .color = "#7f7f7f", .x = x, .y = tput, .n = n},
        {.name = "refused", .color = "#d62728", .x = x, .y = refused, .n = n},
        {.name = "offered", .color = "#000000", .dashed = true, .x = x, .y = offered, .n = n},
    };
    struct kvr_svg_panel panels[] = {
        {.title = "Latency against offered load",
         .x_label = "offered rate (requests/s)",
         .y_label = "latency (ms)",
         .log_y = hi > 0 && hi / lo > 50,
         .series = lat,
         .n_series = n_lat},
        {.title = "Goodput: requests/s that met the budget",
         .x_label = "offered rate (requests/s)",
         .y_label = "requests/s",
         .series = thr,
         .n_series = 4},
    };
    struct kvr_sbuf b;
    kvr_sbuf_init(&b);
    kvr_svg_write(&b, title, panels, 2);
    int rc = -1;
    FILE *f = b.failed ? NULL : fopen(path, "w");
    if (f) {
        rc = fwrite(b.data, 1, b.len, f) == b.len ? 0 : -1;
        if (fclose(f))
            rc = -1;
    }
    if (rc)
        fprintf(stderr, "kvasir bench: cannot write %s\n", path);
    kvr_sbuf_fini(&b);
    kvr_free(v);
    return rc;
}
