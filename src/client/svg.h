/* svg.h - a small SVG line-plot writer for `kvasir bench`'s sweep plot: panels of line series
 * with axes, ticks, grid lines and a legend, written into a string buffer.
 *
 * Nothing here does I/O, reads a clock or keeps a global: the same panels give the same
 * bytes, so a unit test checks the document (tests/unit/test_svg.c).
 *
 * Ownership: the caller owns the panels, series and the buffer; kvr_svg_write only appends
 * to it (a failed allocation is the buffer's `failed` flag). Threads: re-entrant. */
#ifndef KVR_CLIENT_SVG_H
#define KVR_CLIENT_SVG_H

#include "core/sbuf.h"

#include <stdbool.h>
#include <stddef.h>

struct kvr_svg_series {
    const char *name;  /* legend text (escaped on output) */
    const char *color; /* an SVG colour: "#1f77b4" */
    bool dashed;
    const double *x, *y; /* n points; a NAN y breaks the line there */
    size_t n;
};

struct kvr_svg_panel {
    const char *title, *x_label, *y_label;
    bool log_y; /* decades on the y axis (values <= 0 are not drawn) */
    const struct kvr_svg_series *series;
    size_t n_series;
};

/* Append a self-contained SVG document: panels stacked vertically, each with axes, ticks,
 * tick labels, axis labels, grid lines and a legend; `title` on top (its first line as the
 * heading, further '\n'-separated lines as smaller subtitles). Each panel fits its own data
 * range. */
void kvr_svg_write(struct kvr_sbuf *out, const char *title, const struct kvr_svg_panel *panels,
                   size_t n_panels);

/* "Nice" tick positions (steps of 1, 2 or 5 times a power of ten) covering [lo, hi] with
 * at most about max_ticks ticks; the first tick is <= lo and the last >= hi. Writes up to
 * cap ticks and returns how many. */
size_t kvr_svg_nice_ticks(double lo, double hi, size_t max_ticks, double *ticks, size_t cap);

#endif
