/* svg.c - the SVG line-plot writer (see svg.h). */
#include "client/svg.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

size_t kvr_svg_nice_ticks(double lo, double hi, size_t max_ticks, double *ticks, size_t cap)
{
    if (!isfinite(lo) || !isfinite(hi) || cap == 0)
        return 0;
    if (hi < lo) {
        double t = lo;
        lo = hi;
        hi = t;
    }
    if (hi == lo) {
        double pad = lo == 0 ? 1 : fabs(lo) * 0.5;
        lo -= pad;
        hi += pad;
    }
    if (max_ticks < 2)
        max_ticks = 2;
    double raw = (hi - lo) / (double)(max_ticks - 1);
    double e = floor(log10(raw)), mag = pow(10, e), norm = raw / mag;
    double mult = norm <= 1 ? 1 : norm <= 2 ? 2 : norm <= 5 ? 5 : 10, step = mult * mag;
    /* Tick k is k * mult * 10^e. For e < 0 it is computed as (k * mult) / 10^-e: both are
     * exact integers, so the quotient is the double nearest the decimal value and labels
     * print as 0.3 rather than 0.30000000000000004. */
    double k0 = floor(lo / step + 1e-9);
    size_t n = 0;
    while (n < cap) {
        double k = k0 + (double)n;
        double t = e < 0 ? k * mult / pow(10, -e) : k * mult * mag;
        ticks[n++] = t == 0 ? 0 : t; /* no "-0" */
        if (t >= hi - step * 1e-9)
            break;
    }
    return n;
}

/* Geometry of one panel, in SVG user units. */
enum {
    SVG_WIDTH = 800,
    PANEL_HEIGHT = 320,
    TITLE_HEIGHT = 36,
    SUBTITLE_HEIGHT = 18,
    MARGIN_LEFT = 78,
    MARGIN_RIGHT = 200, /* room for the legend */
    MARGIN_TOP = 34,
    MARGIN_BOTTOM = 52,
    MAX_TICKS = 16,
};

static void put_escaped(struct kvr_sbuf *out, const char *s)
{
    for (; s && *s; s++) {
        switch (*s) {
        case '<':
            kvr_sbuf_puts(out, "&lt;");
            break;
        case '>':
            kvr_sbuf_puts(out, "&gt;");
            break;
        case '&':
            kvr_sbuf_puts(out, "&amp;");
            break;
        case '"':
            kvr_sbuf_puts(out, "&quot;");
            break;
        case '\'':
            kvr_sbuf_puts(out, "&apos;");
            break;
        default:
            /* Control characters are not allowed in XML 1.0 text. */
            if ((unsigned char)*s >= 0x20 || *s == '\t' || *s == '\n')
                kvr_sbuf_append(out, s, 1);
        }
    }
}

/* An axis maps data values onto a pixel span; a log axis works on log10 of the value. */
struct axis {
    bool log;
    double lo, hi; /* data range after rounding to ticks (log10 for a log axis) */
    double ticks[MAX_TICKS * 3];
    size_t n_ticks;  /* tick values in data units */
    double px0, px1; /* pixel positions of lo and hi */
};

static double axis_map(const struct axis *a, double v)
{
    double t = a->log ? log10(v) : v;
    return a->px0 + (t - a->lo) / (a->hi - a->lo) * (a->px1 - a->px0);
}

static bool usable(const struct axis *a, double v)
{
    return isfinite(v) && (!a->log || v > 0);
}

static void axis_fit(struct axis *a, double lo, double hi, bool log_axis, bool from_zero)
{
    a->log = log_axis;
    if (!(lo <= hi)) { /* no data */
        lo = log_axis ? 1 : 0;
        hi = log_axis ? 10 : 1;
    }
    if (log_axis) {
        double d0 = floor(log10(lo)), d1 = ceil(log10(hi));
        if (d1 <= d0)
            d1 = d0 + 1;
        a->n_ticks = 0;
        bool minor = d1 - d0 <= 2; /* few decades: also label 2x and 5x */
        for (double d = d0; d <= d1 && a->n_ticks + 3 <= sizeof a->ticks / sizeof a->ticks[0];
             d++) {
            double base = pow(10, d);
            a->ticks[a->n_ticks++] = base;
            if (minor && d < d1) {
                a->ticks[a->n_ticks++] = 2 * base;
                a->ticks[a->n_ticks++] = 5 * base;
            }
        }
        a->lo = d0;
        a->hi = d1;
        return;
    }
    if (from_zero && lo > 0)
        lo = 0;
    a->n_ticks = kvr_svg_nice_ticks(lo, hi, 8, a->ticks, MAX_TICKS);
    a->lo = a->ticks[0];
    a->hi = a->ticks[a->n_ticks - 1];
    if (a->hi <= a->lo)
        a->hi = a->lo + 1;
}

static void fmt_tick(char *buf, size_t cap, double v)
{
    if (v != 0 && (fabs(v) >= 1e6 || fabs(v) < 1e-3))
        snprintf(buf, cap, "%.0e", v);
    else
        snprintf(buf, cap, "%.6g", v);
}

/* Fit both axes to the panel's drawable points and place them on its plot area. */
static void fit_axes(const struct kvr_svg_panel *p, double top, struct axis *ax, struct axis *ay)
{
    double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
    for (size_t s = 0; s < p->n_series; s++) {
        const struct kvr_svg_series *se = &p->series[s];
        for (size_t i = 0; i < se->n; i++) {
            if (!isfinite(se->x[i]) || !isfinite(se->y[i]) || (p->log_y && se->y[i] <= 0))
                continue;
            xlo = fmin(xlo, se->x[i]);
            xhi = fmax(xhi, se->x[i]);
            ylo = fmin(ylo, se->y[i]);
            yhi = fmax(yhi, se->y[i]);
        }
    }
    axis_fit(ax, xlo, xhi, false, true);
    axis_fit(ay, ylo, yhi, p->log_y, true);
    ax->px0 = MARGIN_LEFT, ax->px1 = SVG_WIDTH - MARGIN_RIGHT;
    ay->px0 = top + PANEL_HEIGHT - MARGIN_BOTTOM, ay->px1 = top + MARGIN_TOP;
}

/* The panel's title, grid lines, ticks and their labels, frame and axis labels. */
static void write_frame(struct kvr_sbuf *out, const struct kvr_svg_panel *p, double top,
                        const struct axis *ax, const struct axis *ay)
{
    double x0 = ax->px0, x1 = ax->px1, y0 = ay->px0, y1 = ay->px1;
    kvr_sbuf_printf(out, "<g class=\"panel\">\n<text x=\"%.1f\" y=\"%.1f\" class=\"ptitle\">",
                    (x0 + x1) / 2, top + 20);
    put_escaped(out, p->title);
    kvr_sbuf_puts(out, "</text>\n");
    char label[32];
    for (size_t i = 0; i < ax->n_ticks; i++) {
        double x = axis_map(ax, ax->ticks[i]);
        fmt_tick(label, sizeof label, ax->ticks[i]);
        kvr_sbuf_printf(out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"grid\"/>"
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"axis\"/>"
                        "<text x=\"%.1f\" y=\"%.1f\" class=\"xtick\">%s</text>\n",
                        x, y0, x, y1, x, y0, x, y0 + 5, x, y0 + 18, label);
    }
    for (size_t i = 0; i < ay->n_ticks; i++) {
        double y = axis_map(ay, ay->ticks[i]);
        fmt_tick(label, sizeof label, ay->ticks[i]);
        kvr_sbuf_printf(out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"grid\"/>"
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" class=\"axis\"/>"
                        "<text x=\"%.1f\" y=\"%.1f\" class=\"ytick\">%s</text>\n",
                        x0, y, x1, y, x0 - 5, y, x0, y, x0 - 8, y + 4, label);
    }
    kvr_sbuf_printf(out,
                    "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" class=\"frame\"/>\n"
                    "<text x=\"%.1f\" y=\"%.1f\" class=\"xlabel\">",
                    x0, y1, x1 - x0, y0 - y1, (x0 + x1) / 2, y0 + 38);
    put_escaped(out, p->x_label);
    kvr_sbuf_printf(out,
                    "</text>\n<text x=\"%.1f\" y=\"%.1f\" class=\"ylabel\" "
                    "transform=\"rotate(-90 %.1f %.1f)\">",
                    x0 - 58, (y0 + y1) / 2, x0 - 58, (y0 + y1) / 2);
    put_escaped(out, p->y_label);
    kvr_sbuf_puts(out, "</text>\n");
}

/* One series: a polyline per unbroken run of points, a marker on every point. */
static void write_series(struct kvr_sbuf *out, const struct kvr_svg_series *se,
                         const struct axis *ax, const struct axis *ay)
{
    kvr_sbuf_puts(out, "<g class=\"series\" data-name=\"");
    put_escaped(out, se->name);
    kvr_sbuf_puts(out, "\">\n");
    bool open = false;
    for (size_t i = 0; i < se->n; i++) {
        bool ok = isfinite(se->x[i]) && usable(ay, se->y[i]);
        if (!ok) {
            if (open)
                kvr_sbuf_puts(out, "\"/>\n");
            open = false;
            continue;
        }
        if (!open)
            kvr_sbuf_printf(out,
                            "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s "
                            "points=\"",
                            se->color, se->dashed ? " stroke-dasharray=\"6 4\"" : "");
        kvr_sbuf_printf(out, "%s%.1f,%.1f", open ? " " : "", axis_map(ax, se->x[i]),
                        axis_map(ay, se->y[i]));
        open = true;
    }
    if (open)
        kvr_sbuf_puts(out, "\"/>\n");
    for (size_t i = 0; i < se->n; i++)
        if (isfinite(se->x[i]) && usable(ay, se->y[i]))
            kvr_sbuf_printf(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n",
                            axis_map(ax, se->x[i]), axis_map(ay, se->y[i]), se->color);
    kvr_sbuf_puts(out, "</g>\n");
}

static void write_panel(struct kvr_sbuf *out, const struct kvr_svg_panel *p, double top)
{
    struct axis ax = {0}, ay = {0};
    fit_axes(p, top, &ax, &ay);
    write_frame(out, p, top, &ax, &ay);
    for (size_t s = 0; s < p->n_series; s++)
        write_series(out, &p->series[s], &ax, &ay);
    /* Legend, right of the plot area. */
    double lx = ax.px1 + 16, ly = ay.px1 + 8;
    for (size_t s = 0; s < p->n_series; s++, ly += 20) {
        const struct kvr_svg_series *se = &p->series[s];
        kvr_sbuf_printf(out,
                        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
                        "stroke-width=\"2\"%s/><text x=\"%.1f\" y=\"%.1f\" class=\"legend\">",
                        lx, ly, lx + 26, ly, se->color,
                        se->dashed ? " stroke-dasharray=\"6 4\"" : "", lx + 32, ly + 4);
        put_escaped(out, se->name);
        kvr_sbuf_puts(out, "</text>\n");
    }
    kvr_sbuf_puts(out, "</g>\n");
}

void kvr_svg_write(struct kvr_sbuf *out, const char *title, const struct kvr_svg_panel *panels,
                   size_t n_panels)
{
    /* The first line of the title is the heading, further lines ('\n') smaller below it. */
    int n_lines = 1;
    for (const char *p = title; p && *p; p++)
        n_lines += *p == '\n';
    int head = TITLE_HEIGHT + (n_lines - 1) * SUBTITLE_HEIGHT;
    int height = head + PANEL_HEIGHT * (int)n_panels;
    kvr_sbuf_printf(out,
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                    "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
                    "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n"
                    "<style>\n"
                    ".grid{stroke:#e4e4e4;stroke-width:1}\n"
                    ".axis{stroke:#333;stroke-width:1}\n"
                    ".frame{fill:none;stroke:#333;stroke-width:1}\n"
                    ".title{font-size:17px;font-weight:bold;text-anchor:middle}\n"
                    ".subtitle{font-size:12px;text-anchor:middle}\n"
                    ".ptitle{font-size:14px;font-weight:bold;text-anchor:middle}\n"
                    ".xtick{font-size:11px;text-anchor:middle}\n"
                    ".ytick{font-size:11px;text-anchor:end}\n"
                    ".xlabel,.ylabel{font-size:12px;text-anchor:middle}\n"
                    ".legend{font-size:12px}\n"
                    "</style>\n"
                    "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
                    SVG_WIDTH, height, SVG_WIDTH, height);
    const char *line = title ? title : "";
    for (int i = 0; i < n_lines; i++) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        char buf[512];
        snprintf(buf, sizeof buf, "%.*s", (int)(len < sizeof buf ? len : sizeof buf - 1), line);
        kvr_sbuf_printf(out, "<text x=\"%d\" y=\"%d\" class=\"%s\">", SVG_WIDTH / 2,
                        i == 0 ? 24 : 24 + 4 + i * SUBTITLE_HEIGHT, i == 0 ? "title" : "subtitle");
        put_escaped(out, buf);
        kvr_sbuf_puts(out, "</text>\n");
        line = nl ? nl + 1 : line + len;
    }
    for (size_t i = 0; i < n_panels; i++)
        write_panel(out, &panels[i], head + (double)PANEL_HEIGHT * (double)i);
    kvr_sbuf_puts(out, "</svg>\n");
}
